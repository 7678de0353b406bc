"""`RolloutGenerator(backend="server", base_url=...)`: rollouts from a running vLLM OpenAI server, the same
RolloutBatch as the other backends. No vllm import: HTTP with the standard library (server_http.py).

The server: `python -m rollout serve --model FOLDER --speculative-config JSON ...` (rollout/vllm_backend/serve.py),
or vLLM's own server started by hand with VLLM_SERVER_DEV_MODE=1 and the flags that command prints. The client
reads what it needs from the server: the served model, its folder and max_model_len from /v1/models; the
speculative config, max_num_seqs, dtype and logprobs mode from /server_info (dev mode). Local copies of the folders
(`model`, `draft_model`; default: the server's paths when they exist here) give the tokenizer, EOS ids, the HF
parameter names that weight loads are checked against, and the drafter refresh's trainable copy.

Generation: one /v1/completions request per sample (vLLM reports per-request spec-decode metrics only for a
single prompt with n = 1), all sent at once from a thread pool (the server batches them), token-id prompts, seed
mix_seed(seed, i, j) for sample j of prompt i, processed logprobs of the sampled tokens. Every sample comes back
or the call raises a ServerError naming the URL and the sample: nothing is dropped. Acceptance records come from
each response's `metrics.speculative_decoding` when the server exposes it (--per-request-spec-decode-metrics
detailed), and the aggregate counts are their sums; without them, the differences of /metrics' spec-decode
counters across the call, which count every client of the server. `num_steps` is always the latter (engine steps,
shared by all clients).

Weights (CPU and any server without a GPU weight-transfer engine): the client checks and stages the tensors
(rollout/weights.py), writes them as one safetensors file under `weights_dir`/<server host_port>/<target|draft> (a
folder the server can read: on another machine, a shared filesystem mounted at the same path), then asks the server to load it in place: the
target with vLLM's own `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}`, the
draft with the worker extension's `reload_draft_weights` (worker.py), then `POST /reset_prefix_cache`. vLLM's
reload_weights keeps the given path as the model's path in its worker, so a later reload without a path would read
this folder: the client always passes one. Several trainer processes share one server (`is_shared`): only one of
them writes its weights, the others wait (trainers/weight_sync.py). If the server restarts (its process start time in
/metrics changes), the client loads the weights it last loaded again before the next call, and repeats a call
during which the server restarted.
"""

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from rollout.loading import eos_token_ids, generation_config, load_tokenizer
from rollout.outputs import RolloutBatch
from rollout.sampling_params import SamplingParams, mix_seed
from rollout.server_http import ServerClient, ServerError
from rollout.vllm_backend.versions import runs_project_drafter
from rollout.vllm_common import (CONFIG_KEY, VLLMCommon, acceptance_record, counters_from_records, difference,
                                 engine_counters, make_sample, vllm_batch)
from spec import SpecConfig

_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size")
_START_TIME = "process_start_time_seconds"


class ServerBackend(VLLMCommon):
    """A vLLM server at base_url.

    model, draft_model: local copies of the server's model folders (default: its own paths, if they exist here).
    tokenizer: used for EOS ids when no model folder is local (RolloutGenerator loads it for prompts).
    weights_dir: where weight loads write their checkpoint; the server must read the same path (default: a new
        folder under this machine's temp dir, right when the server runs here).
    request_timeout_s: the longest wait for one answer; reconnect_s: how long a request retries a connection that
        cannot be made (server down or restarting); max_concurrency: requests in flight at most. A seeded call
        repeats its draws only where its requests batch the same way on the server (a per-batch-size schedule's K
        decides how many random draws verification takes): max_concurrency=1 makes that so, at a cost in speed.
    """

    is_shared = True  # several trainer processes may share the server: one of them writes weights

    def __init__(self, base_url: str, *, model=None, draft_model=None, tokenizer=None, weights_dir=None,
                 request_timeout_s: float = 600.0, reconnect_s: float = 120.0, max_concurrency: int = 256):
        self.client = ServerClient(base_url, request_timeout_s, reconnect_s)
        self.base_url = self.client.base_url
        self.max_concurrency = max_concurrency
        served = self._served_model()
        self.served_model_name, self.max_model_len = served["id"], served["max_model_len"]
        vllm_config = self._vllm_config()
        self.config = _spec_config(vllm_config.get("speculative_config"), vllm_config.get("additional_config"),
                                   self.client.base_url)
        self.num_spec_tokens = 0 if self.config is None else self.config.num_speculative_tokens
        self.max_num_seqs = vllm_config["scheduler_config"]["max_num_seqs"]
        self.dtype = getattr(torch, vllm_config["model_config"]["dtype"].removeprefix("torch."))
        self.has_request_metrics = vllm_config["observability_config"]["per_request_spec_decode_metrics"] == "detailed"
        _check_logprobs_mode(vllm_config["model_config"]["logprobs_mode"], self.client.base_url)
        self.model_path = self.target_source = _local_copy(model, served.get("root") or served["id"], "model")
        server_draft = self.config.model if self.config is not None and self.config.method == "draft_model" else None
        self.draft_path = _local_copy(draft_model, server_draft, "draft_model") if server_draft else None
        self.eos_token_ids = _eos_ids(self.model_path, tokenizer, self.client.base_url)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self._loaded: dict[str, str] = {}  # role -> the checkpoint folder it was last loaded from
        self._server_start = self._start_time(self.client.metrics())

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, seed: int,
                 decode=None, use_tqdm: bool = False, num_restarts_left: int = 2) -> RolloutBatch:
        """num_generations samples per prompt, in input order; sample j of prompt i draws from mix_seed(seed, i, j).
        A call during which the server restarted runs again (num_restarts_left times), on the weights last loaded."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r}: backend='server' takes rollout.SamplingParams")
        keys = [(i, j) for i in range(len(prompt_ids)) for j in range(num_generations)]
        bodies = [self._body(prompt_ids[i], params, mix_seed(seed, i, j)) for i, j in keys]
        before = self._restore_after_restart(self.client.metrics())
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, min(len(bodies), self.max_concurrency))) as pool:
            responses = list(pool.map(self._complete, bodies, keys))
        elapsed = time.perf_counter() - start
        after = self.client.metrics()
        if self._start_time(after) != self._server_start:
            if num_restarts_left == 0:
                raise ServerError(f"the server at {self.client.base_url} restarted during every try of this call")
            return self.generate(prompt_ids, num_generations, params, seed, decode, use_tqdm, num_restarts_left - 1)
        records = [_record(r, self.num_spec_tokens) for r in responses]
        samples = [make_sample(i, j, prompt_ids[i], *_completion(r), record, decode, self.client.base_url)
                   for (i, j), r, record in zip(keys, responses, records)]
        counters = difference(self._counters(after), self._counters(before))
        if self.has_request_metrics:
            counters.update(counters_from_records(records, self.num_spec_tokens))
        return vllm_batch(samples, records, counters, elapsed)

    def load_weights(self, named_tensors) -> int:
        """Check and stage the target's weights, write them under weights_dir, have the server reload them in place
        (vLLM's reload_weights), drop its prefix cache. All or nothing up to the server's reload."""
        folder, num_given = self._write("target", named_tensors)
        self._reload("target", folder)
        return num_given

    def load_draft_weights(self, named_tensors) -> int:
        """Likewise for the draft model (the worker extension's reload_draft_weights)."""
        folder, num_given = self._write("draft", named_tensors)
        self._reload("draft", folder)
        return num_given

    def use_schedule(self, schedule: list[list[int]]) -> None:
        raise NotImplementedError("backend='server' runs the schedule the server was started with; restart it with "
                                  "--speculative-config holding the new num_speculative_tokens_per_batch_size")

    def measure_step_times(self, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int]):
        raise NotImplementedError("step times are measured on an engine in this process: run rollout tune --backend "
                                  "vllm with the server's model and drafter, then restart the server with the schedule")

    def _body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict:
        stop_ids = sorted(self.eos_token_ids | set(params.stop_token_ids or ()))
        return {"model": self.served_model_name, "prompt": list(prompt), "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": seed,
                "n": 1, "logprobs": 0, "stop_token_ids": stop_ids, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "skip_special_tokens": False}

    def _complete(self, body: dict, key: tuple[int, int]) -> dict:
        return self.client.post("/v1/completions", body, f"sample {key[1]} of prompt {key[0]}, "
                                                         f"{len(body['prompt'])} prompt tokens")

    def _write(self, role: str, named_tensors) -> tuple[str, int]:
        """Stage the tensors against the role's folder (VLLMCommon.stage), then write
        <weights_dir>/<role>/model.safetensors (a temporary file renamed into place); (the folder written, the number
        of tensors given)."""
        staged, num_given = self.stage("target" if role == "target" else "draft model", named_tensors)
        if self.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="spec-rollouts-weights-"))
        out = self.weights_dir / urlsplit(self.base_url).netloc.replace(":", "_") / role  # a folder per server
        out.mkdir(parents=True, exist_ok=True)
        partial = out / f".model.safetensors.{os.getpid()}.partial"
        save_file({name: tensor.contiguous() for name, tensor in staged}, str(partial), metadata={"format": "pt"})
        os.replace(partial, out / "model.safetensors")
        return str(out), num_given

    def _reload(self, role: str, folder: str) -> None:
        method = "reload_weights" if role == "target" else "reload_draft_weights"
        self._rpc(method, {"weights_path": folder}, f"load the {role}'s weights from {folder}")
        if role == "target":
            self._rpc("repack_tied_lm_head", {}, "re-pack a tied lm_head (vLLM's CPU build)", optional=True)
        self.client.post("/reset_prefix_cache", None, f"drop the prefix cache after loading the {role}")
        self._loaded[role] = folder

    def _rpc(self, method: str, kwargs: dict, what: str, optional: bool = False) -> None:
        """POST /collective_rpc; a method the server lacks is an error naming the worker extension, unless
        `optional` (then the server is one started by hand without it, where only the CPU build needs it)."""
        try:
            self.client.post("/collective_rpc", {"method": method, "kwargs": kwargs}, what)
        except ServerError as e:
            if "has no attribute" not in str(e):
                raise
            if not optional:
                raise ServerError(f"{e}\nThe server has no {method} method: start it with python -m rollout serve, "
                                  "or add --worker-extension-cls rollout.vllm_backend.worker.WorkerExtension") from None

    def _restore_after_restart(self, metrics: dict) -> dict:
        """metrics, after loading the last weights again if the server restarted since they were loaded."""
        start = self._start_time(metrics)
        if start == self._server_start:
            return metrics
        self._server_start = start
        for role, folder in self._loaded.items():
            self._reload(role, folder)
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

    def _vllm_config(self) -> dict:
        try:
            info = self.client.get("/server_info?config_format=json", "the server's engine config")
        except ServerError as e:
            if "HTTP 404" in str(e):
                raise ServerError(f"{e}\nThe server is not in dev mode: start it with VLLM_SERVER_DEV_MODE=1 (python "
                                  "-m rollout serve sets it); the client reads the speculative config from "
                                  "/server_info and loads weights through /collective_rpc") from None
            raise
        return info["vllm_config"]

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
