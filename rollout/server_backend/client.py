"""One vLLM OpenAI server as the server backend (backend.py) uses it: what it serves, its rollouts and weight reloads,
and its worker calls (vllm_backend/wire.py). No vllm import: HTTP with the standard library (http.py).

The server is `python -m rollout serve` (vllm_backend/serve.py), or vLLM's server started by hand with the flags
that command prints. The client reads the served model and max_model_len from /v1/models, and the speculative
config, max_num_seqs, dtype, logprobs mode, worker extension and folders from /server_info (dev mode, filtered by the
gate). Local copies of the model folders (default: the server's paths when they exist here) give the tokenizer, EOS
ids and the parameter names weight loads are checked against.

Rollouts: one /v1/completions request per sample (vLLM reports per-request spec-decode metrics only for n = 1), all
sent at once; sample j of prompt i draws from mix_seed(seed, i, j). Every sample comes back or the call raises a
ServerError naming the URL and the sample. Acceptance records come from each response's metrics where the server
reports them, else from the differences of /metrics' counters (which count every client of the server).

Weights: a checkpoint written under the server's weights_dir (a shared folder on another machine), loaded in place
by vLLM's `reload_weights` (the target) or the worker extension's `reload_draft_weights`, then the prefix cache
dropped; a path is always passed (vLLM keeps the last one as the model's). After a server restart (its start time in
/metrics changes) the client loads the weights it last loaded again and repeats the interrupted call.
"""

import os
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from rollout.loading import eos_token_ids, generation_config, load_tokenizer
from rollout.outputs import Sample
from rollout.sampling_params import SamplingParams, mix_seed
from rollout.server_backend.http import ServerClient, ServerError
from rollout.vllm_backend import wire
from rollout.vllm_backend.common import (
    acceptance_record,
    counters_from_records,
    difference,
    engine_counters,
    make_sample,
)
from rollout.vllm_backend.versions import runs_project_drafter
from rollout.vllm_backend.wire import CONFIG_KEY, SERVER_KEY, is_inside
from spec import RequestAcceptance, SpecConfig
from spec.config import PROTOCOL_METHODS

_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size")
_START_TIME = "process_start_time_seconds"


@dataclass
class ServerRollouts:
    """What one server returned for its share of a call: samples with their records (same order), the engine
    counters' differences over it (vllm_common.COUNTED and num_steps), and the project's drafter's counts (None under
    vLLM's own drafters)."""

    samples: list[Sample]
    records: list[RequestAcceptance]
    counters: dict
    drafter: dict | None


class Server:
    """The vLLM server at base_url (the arguments are ServerBackend's, for this server)."""

    def __init__(self, base_url: str, *, model=None, draft_model=None, tokenizer=None, weights_dir=None,
                 api_key: str | None = None, request_timeout_s: float = 600.0, reconnect_s: float = 120.0,
                 max_concurrency: int = 256):
        self.client = ServerClient(base_url, request_timeout_s, reconnect_s, api_key)
        self.base_url = self.client.base_url
        self.max_concurrency = max_concurrency
        served = self._served_model()
        self.served_model_name, self.max_model_len = served["id"], served["max_model_len"]
        info = self._server_info()
        vllm_config = info["vllm_config"]
        self.config = _spec_config(vllm_config.get("speculative_config"), vllm_config.get("additional_config"),
                                   self.base_url)
        self.num_spec_tokens = 0 if self.config is None else self.config.num_speculative_tokens
        self.uses_proposer = self.config is not None and self.config.method in PROTOCOL_METHODS
        self.max_num_seqs = vllm_config["scheduler_config"]["max_num_seqs"]
        self.dtype = getattr(torch, vllm_config["model_config"]["dtype"].removeprefix("torch."))
        self.has_request_metrics = vllm_config["observability_config"]["per_request_spec_decode_metrics"] == "detailed"
        self.has_extension = (vllm_config.get("parallel_config") or {}).get("worker_extension_cls") == \
            wire.WORKER_EXTENSION  # the project's worker calls (wire.py) run there
        _check_logprobs_mode(vllm_config["model_config"]["logprobs_mode"], self.base_url)
        self.model_path = _local_copy(model, served.get("root") or served["id"], "model")
        server_draft = self.config.model if self.config is not None and self.config.method == "draft_model" else None
        self.draft_path = _local_copy(draft_model, server_draft, "draft_model") if server_draft else None
        self.eos_token_ids = _eos_ids(self.model_path, tokenizer, self.base_url)
        self.folders = info.get(SERVER_KEY) or {}  # the server's weights_dir and history_dir (guard.py)
        self.weights_dir = _weights_dir(weights_dir, self.folders.get("weights_dir"), self.base_url)
        self.loaded: dict[str, str] = {}  # role -> the checkpoint folder it was last loaded from
        self._server_start = self._start_time(self.client.metrics())

    def rollouts(self, prompt_ids: list[list[int]], prompt_indices: list[int], num_generations: int,
                 params: SamplingParams, seed: int, decode=None, num_restarts_left: int = 2) -> ServerRollouts:
        """num_generations samples of each prompt, in input order; prompt_ids[k] is prompt prompt_indices[k] of the
        caller's call, and its sample j draws from mix_seed(seed, prompt_indices[k], j). A call during which the
        server restarted runs again (num_restarts_left times), on the weights last loaded."""
        keys = [(i, j) for i in range(len(prompt_ids)) for j in range(num_generations)]
        bodies = [self._body(prompt_ids[i], params, mix_seed(seed, prompt_indices[i], j)) for i, j in keys]
        labels = [(prompt_indices[i], j) for i, j in keys]
        before = self._restore_after_restart(self.client.metrics())
        drafter_before = self.drafter_stats()
        with ThreadPoolExecutor(max(1, min(len(bodies), self.max_concurrency))) as pool:
            responses = list(pool.map(self._complete, bodies, labels))
        after = self.client.metrics()
        if self._start_time(after) != self._server_start:
            if num_restarts_left == 0:
                raise ServerError(f"the server at {self.base_url} restarted during every try of this call")
            return self.rollouts(prompt_ids, prompt_indices, num_generations, params, seed, decode,
                                 num_restarts_left - 1)
        records = [_record(r, self.num_spec_tokens) for r in responses]
        samples = [make_sample(i, j, prompt_ids[k], *_completion(r), record, decode, self.base_url)
                   for (k, _), (i, j), r, record in zip(keys, labels, responses, records)]
        counters = difference(self._counters(after), self._counters(before))
        if self.has_request_metrics:
            counters.update(counters_from_records(records, self.num_spec_tokens))
        drafter = None if drafter_before is None else difference(self.drafter_stats(), drafter_before)
        return ServerRollouts(samples, records, counters, drafter)

    def write(self, role: str, staged: list[tuple[str, torch.Tensor]]) -> str:
        """Write staged tensors as <weights_dir>/<server host_port>/<role>/model.safetensors (a temporary file
        renamed into place); the folder written."""
        if self.weights_dir is None and self.folders.get("weights_dir"):
            raise ValueError(f"the weights_dir of the server at {self.base_url}, {self.folders['weights_dir']}, is "
                             "not on this machine: mount it here at the same path, or pass server_kwargs="
                             "{'weights_dir': <a folder inside it, as mounted here>}")
        if self.weights_dir is None:  # a server started without python -m rollout serve: no folder of its own
            self.weights_dir = Path(tempfile.mkdtemp(prefix="spec-rollouts-weights-"))
        out = self.weights_dir / urlsplit(self.base_url).netloc.replace(":", "_") / role  # a folder per server
        out.mkdir(parents=True, exist_ok=True)
        partial = out / f".model.safetensors.{os.getpid()}.partial"
        save_file({name: tensor.contiguous() for name, tensor in staged}, str(partial), metadata={"format": "pt"})
        os.replace(partial, out / "model.safetensors")
        return str(out)

    def reload(self, role: str, folder: str) -> None:
        """Have the server load the role's ("target" or "draft") weights from `folder`, then drop its prefix cache."""
        self.loaded[role] = folder  # a server that is down now loads them when it is back (_restore_after_restart)
        call = wire.RELOAD_WEIGHTS if role == "target" else wire.RELOAD_DRAFT_WEIGHTS
        self.rpc(call, {"weights_path": folder}, f"load the {role}'s weights from {folder}")
        if role == "target":
            self.rpc(wire.REPACK_TIED_LM_HEAD, {}, "re-pack a tied lm_head (vLLM's CPU build)", optional=True)
        self.client.post("/reset_prefix_cache", None, f"drop the prefix cache after loading the {role}")

    def drafter_stats(self) -> dict | None:
        """The project's drafter's cumulative counts on the server (rank 0's), None under vLLM's own drafters."""
        if not self.uses_proposer:
            return None
        return self.rpc(wire.DRAFTER_STATS, {}, "the project's drafter's counts")[0]

    def history_file(self) -> str:
        """A new file name in the server's history_dir (ValueError where this machine cannot read that folder)."""
        folder = self.folders.get("history_dir")
        if not folder or not Path(folder).is_dir():
            raise ValueError(f"the history_dir of the server at {self.base_url} ({folder}) is not on this machine: "
                             "mount it here at the same path (start the server with --history-dir on a shared "
                             "filesystem) to save or load its rollout history")
        return os.path.join(folder, f"{uuid.uuid4().hex}.npz")

    def rpc(self, call: wire.WorkerCall, kwargs: dict, what: str, optional: bool = False) -> list | None:
        """POST /collective_rpc of a worker call (wire.py); every rank's result. A call of the project's worker
        extension on a server without it (started by hand) is an error naming the extension, unless `optional`
        (then it is skipped: only the CPU build needs it)."""
        if not call.is_vllms and not self.has_extension:
            if optional:
                return None
            raise ServerError(f"the server at {self.base_url} runs no {call.name} ({what}): it has not the project's "
                              f"worker extension; start it with python -m rollout serve, or add "
                              f"--worker-extension-cls {wire.WORKER_EXTENSION}")
        answer = self.client.post("/collective_rpc", {"method": call.name, "kwargs": call.kwargs_for(**kwargs)}, what)
        return answer.get("results") if isinstance(answer, dict) else None

    def _body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict:
        stop_ids = sorted(params.stop_ids(self.eos_token_ids))
        return {"model": self.served_model_name, "prompt": list(prompt), "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": seed,
                "ignore_eos": params.ignore_eos,
                "n": 1, "logprobs": 0, "stop_token_ids": stop_ids, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "skip_special_tokens": False}

    def _complete(self, body: dict, key: tuple[int, int]) -> dict:
        return self.client.post("/v1/completions", body, f"sample {key[1]} of prompt {key[0]}, "
                                                         f"{len(body['prompt'])} prompt tokens")

    def _restore_after_restart(self, metrics: dict) -> dict:
        """metrics, after loading the last weights again if the server restarted since they were loaded."""
        start = self._start_time(metrics)
        if start == self._server_start:
            return metrics
        self._server_start = start
        for role, folder in list(self.loaded.items()):
            self.reload(role, folder)
        return self.client.metrics()

    def _counters(self, metrics: dict) -> dict:
        """The engine counters in /metrics' text form: `name_total{labels}` for counters, `name_count{labels}` for
        the step histogram's observations."""
        readings = []
        for key, value in metrics.items():
            name, _, labels = key.partition("{")
            base = name.removesuffix("_total") if name.endswith("_total") else name.removesuffix("_count")
            position = int(labels.split('position="')[1].split('"')[0]) if 'position="' in labels else None
            readings.append((base, position, value))
        return engine_counters(readings, self.num_spec_tokens)

    def _served_model(self) -> dict:
        models = self.client.get("/v1/models", "the served model").get("data") or []
        if len(models) != 1:
            raise ServerError(f"GET {self.client.base_url}/v1/models lists {len(models)} models; the server backend "
                              "needs a server with exactly one")
        return models[0]

    def _server_info(self) -> dict:
        try:
            return self.client.get("/server_info?config_format=json", "the server's engine config")
        except ServerError as e:
            if e.status == 404:
                raise ServerError(f"{e}\nThe server is not in dev mode: start it with VLLM_SERVER_DEV_MODE=1 (python "
                                  "-m rollout serve sets it); the client reads the speculative config from "
                                  "/server_info and loads weights through /collective_rpc") from None
            raise

    @staticmethod
    def _start_time(metrics: dict) -> float | None:
        return metrics.get(_START_TIME)


def _spec_config(spec: dict | None, additional: dict | None, base_url: str) -> SpecConfig | None:
    """The server's speculative config: this project's own (additional_config[CONFIG_KEY]) where the server runs the
    project's drafter (in either of vLLM's forms, versions.py), else the keys of vLLM's that this package reads."""
    if not spec:
        return None
    if runs_project_drafter(spec):
        config = (additional or {}).get(CONFIG_KEY)
    else:
        config = {key: spec[key] for key in _SPEC_KEYS if spec.get(key) is not None}
    try:
        return SpecConfig.from_dict(config)
    except ValueError as e:
        raise ValueError(f"the speculative config of the server at {base_url} ({config}) is not one this package "
                         f"reads: {e}") from None


def _weights_dir(given, server_dir: str | None, base_url: str) -> Path | None:
    """Where weight loads write: `given` (it must lie inside the server's weights_dir, which is all the server
    loads from), else the server's weights_dir when it exists here, else None."""
    if given is None:
        return Path(server_dir) if server_dir and Path(server_dir).is_dir() else None
    if server_dir and not is_inside(os.fspath(given), server_dir):
        raise ValueError(f"weights_dir={str(given)!r} is not inside the weights_dir of the server at {base_url} "
                         f"({server_dir}), the one folder it loads weights from: pass a folder inside it (on another "
                         "machine: the same path, shared), or start the server with --weights-dir "
                         f"{str(given)!r}")
    return Path(given)


def _check_logprobs_mode(mode: str, base_url: str) -> None:
    if mode != "processed_logprobs":
        raise ValueError(f"the server at {base_url} returns logprobs_mode={mode!r}; a trainer needs the processed "
                         "distribution's: restart it with --logprobs-mode processed_logprobs (python -m rollout "
                         "serve sets it)")


def _local_copy(given, server_path: str, field: str) -> str | None:
    """The local folder for `field`: the one given (it must exist), else the server's path if it exists here."""
    if given is not None:
        if not isinstance(given, (str, Path)) or not Path(given).is_dir():
            raise ValueError(f"{field}={given!r}: expected a local copy of the server's {field} folder")
        return str(given)
    return server_path if server_path and Path(server_path).is_dir() else None


def _eos_ids(model_path: str | None, tokenizer, base_url: str) -> set[int]:
    if model_path is not None:
        return eos_token_ids(generation_config(model_path), AutoConfig.from_pretrained(model_path,
                                                                                       local_files_only=True))
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(None, tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"the model folder of the server at {base_url} is not on this machine, so its EOS ids are "
                         "unknown: pass model=<a local copy of the folder> or a tokenizer object with eos_token_id")
    return {eos}


def _record(response: dict, num_spec_tokens: int):
    metrics = ((response.get("metrics") or {}).get("speculative_decoding")) or {}
    return acceptance_record(metrics.get("per_step_drafted"), metrics.get("per_step_accepted"), num_spec_tokens)


def _completion(response: dict) -> tuple[list[int], list[float] | None, str | None]:
    choice = response["choices"][0]
    logprobs = choice.get("logprobs") or {}
    return choice.get("token_ids") or [], logprobs.get("token_logprobs"), choice.get("finish_reason")
