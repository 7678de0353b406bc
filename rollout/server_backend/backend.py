"""`RolloutGenerator(backend="server", base_url=URL or [URL, ...])`: rollouts from running vLLM OpenAI servers
(`python -m rollout serve`), the same RolloutBatch as the other backends. Each server is a `Server` (client.py);
this backend spreads a call over them.

Routing. Each prompt's group runs on one server, `route(prompt)`: a stable hash of the prompt's token ids (blake2b of
their int32 bytes) modulo the number of servers, so its siblings batch together and its rollout history stays on one
server (server_backend/history.py) across calls, epochs and trainer processes.

Failover. With several servers, each one a call routes prompts to is probed first (GET /health within
probe_timeout_s); a server down, or unreachable during the call, has its prompts sent to the next in list order. The
call fails only when no server is left; it warns and names the servers skipped (`stats["skipped_servers"]`;
`stats["rows_per_server"]`, and `spec/server_load_imbalance`: the busiest server's rows over the mean).

Weights. One checkpoint per distinct weights_dir of the servers, then every server reloads once; several trainer
processes sharing the servers leave this to one writer (trainers/weight_sync.py). A server unreachable during a load
loads the weights when it is back.
"""

import hashlib
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rollout.history import keeps_history
from rollout.outputs import RolloutBatch
from rollout.sampling_params import SamplingParams
from rollout.server_backend.client import Server, ServerRollouts
from rollout.server_backend.history import ServerHistory
from rollout.server_backend.http import ServerError, ServerUnreachable
from rollout.vllm_backend.common import VLLMCommon, vllm_batch


def route(prompt_ids, num_servers: int) -> int:
    """The server index of a prompt: stable across processes, runs and Python versions."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_servers


class ServerBackend(VLLMCommon):
    """base_url: one server's URL, or a list of them (all serving the same model and speculative config).

    model, draft_model: local copies of the servers' model folders (default: their own paths, if they exist here).
    tokenizer: used for EOS ids when no model folder is local (RolloutGenerator loads it for prompts).
    weights_dir: where weight loads write their checkpoints, a folder inside each server's `--weights-dir` (default:
        each server's weights_dir, read from it, when that path exists here).
    api_key: the servers' key (default: VLLM_API_KEY from the environment; None where it is not set either), sent
        with every request.
    request_timeout_s: the longest wait for one answer; reconnect_s: how long a request retries a connection that
        cannot be made (server down or restarting); max_concurrency: requests in flight per server at most. A seeded
        call repeats its draws only where its requests batch the same way on the server (a per-batch-size schedule's
        K decides how many random draws verification takes): max_concurrency=1 makes that so, at a cost in speed.
    probe_timeout_s: with several servers, how long a server may take to answer /health before its prompts go to
        the next one.
    """

    is_shared = True  # several trainer processes may share the servers: one of them writes weights

    def __init__(self, base_url, *, model=None, draft_model=None, tokenizer=None, weights_dir=None,
                 api_key: str | None = None, request_timeout_s: float = 600.0, reconnect_s: float = 120.0,
                 max_concurrency: int = 256, probe_timeout_s: float = 5.0):
        urls = _urls(base_url)
        api_key = (os.environ.get("VLLM_API_KEY") or None) if api_key is None else api_key
        self.servers = [Server(url, model=model, draft_model=draft_model, tokenizer=tokenizer, weights_dir=weights_dir,
                               api_key=api_key, request_timeout_s=request_timeout_s, reconnect_s=reconnect_s,
                               max_concurrency=max_concurrency) for url in urls]
        first = self.servers[0]
        _check_alike(self.servers)
        self.config, self.max_model_len, self.dtype = first.config, first.max_model_len, first.dtype
        self.max_num_seqs = sum(s.max_num_seqs for s in self.servers)
        self.eos_token_ids, self.model_path, self.draft_path = first.eos_token_ids, first.model_path, first.draft_path
        self.target_source = self.model_path
        self.base_url = ",".join(s.base_url for s in self.servers)  # one writer per set of servers
        self.probe_timeout_s = probe_timeout_s
        self.history = ServerHistory(self.servers, route, self.config.history_max_rollouts_per_prompt,
                                     self.config.history_max_tokens, self._vocab_size()) \
            if keeps_history(self.config) else None

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, seed: int,
                 decode=None, use_tqdm: bool = False) -> RolloutBatch:
        """num_generations samples per prompt, in input order; sample j of prompt i draws from mix_seed(seed, i, j)
        on whichever server runs it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r}: backend='server' takes rollout.SamplingParams")
        start = time.perf_counter()
        down = self._probe(prompt_ids)
        pending = self._assign(range(len(prompt_ids)), [route(p, len(self.servers)) for p in prompt_ids], down)
        parts: list[tuple[int, ServerRollouts]] = []
        while pending:
            failed = self._run(pending, prompt_ids, num_generations, params, seed, decode, parts)
            down |= set(failed)
            pending = self._assign([k for i in failed for k in pending[i]], [i for i in failed for _ in pending[i]],
                                   down)
        return self._batch(parts, time.perf_counter() - start, down)

    def load_weights(self, named_tensors) -> int:
        """Check and stage the target's weights once, write a checkpoint per distinct weights_dir, have every server
        reload it in place (vLLM's reload_weights) and drop its prefix cache. All or nothing up to the reloads."""
        return self._load("target", named_tensors)

    def load_draft_weights(self, named_tensors) -> int:
        """Likewise for the draft model (the worker extension's reload_draft_weights)."""
        return self._load("draft", named_tensors)

    def use_schedule(self, schedule: list[list[int]]) -> None:
        raise NotImplementedError("backend='server' runs the schedule the server was started with; restart it with "
                                  "--speculative-config holding the new num_speculative_tokens_per_batch_size")

    def measure_step_times(self, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int]):
        raise NotImplementedError("step times are measured on an engine in this process: run rollout tune --backend "
                                  "vllm with the server's model and drafter, then restart the server with the schedule")

    def _probe(self, prompt_ids: list[list[int]]) -> set[int]:
        """The servers this call routes prompts to that do not answer /health (none probed with one server: its own
        reconnection attempts apply)."""
        if len(self.servers) == 1:
            return set()
        routed = {route(p, len(self.servers)) for p in prompt_ids}
        return {i for i in routed if not self.servers[i].client.is_up(self.probe_timeout_s)}

    def _assign(self, prompts, servers, down: set[int]) -> dict[int, list[int]]:
        """server index -> the prompt indices it runs: each prompt on its server, or the next one up."""
        assigned: dict[int, list[int]] = {}
        for k, i in zip(prompts, servers):
            assigned.setdefault(self._next_up(i, down), []).append(k)
        return assigned

    def _next_up(self, i: int, down: set[int]) -> int:
        for step in range(len(self.servers)):
            j = (i + step) % len(self.servers)
            if j not in down:
                return j
        raise ServerError(f"no server is reachable: {', '.join(s.base_url for s in self.servers)} (is python -m "
                          "rollout serve running there?)")

    def _run(self, pending: dict[int, list[int]], prompt_ids, num_generations, params, seed, decode,
             parts: list) -> list[int]:
        """Each server's share, at once; results appended to `parts`; the servers that became unreachable (with
        one server, its error is raised)."""
        with ThreadPoolExecutor(len(pending)) as pool:
            futures = {i: pool.submit(self.servers[i].rollouts, [prompt_ids[k] for k in ks], ks, num_generations,
                                      params, seed, decode) for i, ks in pending.items()}
        failed = []
        for i, future in futures.items():
            try:
                parts.append((i, future.result()))
            except ServerUnreachable:
                if len(self.servers) == 1:
                    raise
                failed.append(i)
        return failed

    def _batch(self, parts: list[tuple[int, ServerRollouts]], elapsed: float, down: set[int]) -> RolloutBatch:
        pairs = sorted(((s, r) for _, part in parts for s, r in zip(part.samples, part.records)),
                       key=lambda pair: (pair[0].prompt_index, pair[0].sample_index))
        drafters = [part.drafter for _, part in parts if part.drafter is not None]
        batch = vllm_batch([s for s, _ in pairs], [r for _, r in pairs], _sum([p.counters for _, p in parts]),
                           elapsed, _sum(drafters) if drafters else None)
        rows = {s.base_url: 0 for s in self.servers}
        for i, part in parts:
            rows[self.servers[i].base_url] += len(part.samples)
        skipped = [self.servers[i].base_url for i in sorted(down)]
        if skipped:
            warnings.warn(f"servers skipped (down): {skipped}; their prompts ran on the next server in order",
                          RuntimeWarning, stacklevel=3)
        batch.stats.update(rows_per_server=rows, skipped_servers=skipped)
        if len(self.servers) > 1:  # the busiest server's rows over the mean: 1.0 is an even spread
            batch.metrics["spec/server_load_imbalance"] = max(rows.values()) * len(rows) / max(sum(rows.values()), 1)
        return batch

    def _load(self, role: str, named_tensors) -> int:
        staged, num_given = self.stage("target" if role == "target" else "draft model", named_tensors)
        written: dict = {}  # a server's weights_dir -> the checkpoint folder written there
        for server in self.servers:
            if server.weights_dir is None or server.weights_dir not in written:
                written[server.weights_dir] = server.write(role, staged)  # sets weights_dir where it was None
        with ThreadPoolExecutor(len(self.servers)) as pool:
            futures = [pool.submit(self._reload, s, role, written[s.weights_dir]) for s in self.servers]
        for future in futures:
            future.result()
        return num_given

    def _reload(self, server: Server, role: str, folder: str) -> None:
        try:
            server.reload(role, folder)
        except ServerUnreachable:
            if len(self.servers) == 1:
                raise
            warnings.warn(f"the server at {server.base_url} is unreachable: it loads the {role}'s weights when it is "
                          "back", RuntimeWarning, stacklevel=2)

    def _vocab_size(self) -> int | None:
        if self.model_path is None:
            return None
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(self.model_path, local_files_only=True).get_text_config().vocab_size


def _urls(base_url) -> list[str]:
    urls = [base_url] if isinstance(base_url, str) else list(base_url) if isinstance(base_url, (list, tuple)) else []
    if not urls or len(set(urls)) != len(urls) or not all(isinstance(u, str) for u in urls):
        raise ValueError(f"base_url={base_url!r}: expected a server's URL or a list of distinct URLs, e.g. "
                         "['http://server0:8000', 'http://server1:8000']")
    return urls


def _check_alike(servers: list[Server]) -> None:
    """ValueError unless every server serves what the first does (a prompt may run on any of them)."""
    first = servers[0]
    for server in servers[1:]:
        for field in ("served_model_name", "config", "max_model_len", "dtype"):
            if getattr(server, field) != getattr(first, field):
                raise ValueError(f"base_url: the servers differ in {field} ({first.base_url}: "
                                 f"{getattr(first, field)!r}, {server.base_url}: {getattr(server, field)!r}); start "
                                 "every server with the same model and speculative config")


def _sum(dicts: list[dict]) -> dict:
    """Key-wise sums of counter dicts (lists element-wise)."""
    total = dicts[0]
    for other in dicts[1:]:
        total = {k: [a + b for a, b in zip(v, other[k])] if isinstance(v, list) else v + other[k]
                 for k, v in total.items()}
    return total

