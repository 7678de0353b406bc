"""What the processes of a vLLM deployment agree on, in the standard library only: the trainer's driver (the in-process
backend, the server client), vLLM's workers (the worker extension), the API server's gate and the plugin entry point.
Importing it imports nothing else of the project's, no torch and no vLLM, so that every process can read it.

The worker calls: each method the clients run on vLLM's workers by name (`llm.collective_rpc(name, kwargs=...)` in
process, `POST /collective_rpc {"method": name, "kwargs": {...}}` on a server) is one WorkerCall here, with its keyword
arguments and, where a server runs it for its clients, the keywords it admits there and the server folder each path
must lie in. The gate admits exactly the SERVED calls; the worker extension checks at import that it defines every
call of its own with these keywords; the clients build every call through `WorkerCall.kwargs_for`.
"""

import inspect
import os
from dataclasses import dataclass

CONFIG_KEY = "rollout_speculative_config"  # vLLM's additional_config key that holds the project's speculative config
FAULTS_KEY = "rollout_max_drafter_faults"  # ... and the drafter faults a run tolerates (spec/drafting_host.py)
SERVER_KEY = "rollout_server"  # where /server_info holds the server's folders for the client
KEY_ENV = "VLLM_API_KEY"  # vLLM's: the server's key, read by the server, the gate and the clients
FOLDERS_ENV = "ROLLOUT_SERVER_FOLDERS"  # {"weights_dir": path, "history_dir": path}, set by serve.py for the gate
FOLDERS = ("weights_dir", "history_dir")
DRAFTER_METHODS = ("history", "custom_class")  # spec.config.PROTOCOL_METHODS: the project's drafters on vLLM
PROPOSER_CLASS = "rollout.vllm_backend.proposer.RolloutProposer"  # vLLM 0.32-0.33's custom_class hook builds it
WORKER_EXTENSION = "rollout.vllm_backend.worker.WorkerExtension"


@dataclass(frozen=True)
class WorkerCall:
    """A worker method called by name. kwargs: every keyword it takes; served: the keywords a server admits for it ->
    the server folder (FOLDERS) a path argument must lie in, or None for a value that is not a path; None where only
    the in-process backend calls it. is_vllms: vLLM's own worker method, not the extension's."""

    name: str
    kwargs: tuple[str, ...]
    served: dict | None = None
    is_vllms: bool = False

    def kwargs_for(self, **kwargs) -> dict:
        """kwargs, checked against the call's keywords (a programming error otherwise: AssertionError)."""
        assert set(kwargs) <= set(self.kwargs), f"{self.name} takes {self.kwargs}, not {sorted(kwargs)}"
        return kwargs

    def run(self, llm, **kwargs) -> list:
        """Every worker's result of the call on an in-process `vllm.LLM` (its collective_rpc)."""
        return llm.collective_rpc(self.name, kwargs=self.kwargs_for(**kwargs))


RELOAD_WEIGHTS = WorkerCall("reload_weights", ("weights_iterator", "weights_path"), {"weights_path": "weights_dir"},
                            is_vllms=True)
RELOAD_DRAFT_WEIGHTS = WorkerCall("reload_draft_weights", ("weights", "weights_path"), {"weights_path": "weights_dir"})
REPACK_TIED_LM_HEAD = WorkerCall("repack_tied_lm_head", (), {})
SAVE_HISTORY = WorkerCall("save_rollout_history", ("path",), {"path": "history_dir"})
LOAD_HISTORY = WorkerCall("load_rollout_history", ("path",), {"path": "history_dir"})
ADD_HISTORY = WorkerCall("add_rollout_history", ("prompt_ids", "completion_ids"),
                         {"prompt_ids": None, "completion_ids": None})
DRAFTER_STATS = WorkerCall("rollout_drafter_stats", (), {})
USE_SCHEDULE = WorkerCall("use_rollout_schedule", ("schedule",))
SAMPLER_FIX_APPLIED = WorkerCall("sampler_fix_applied", ())
CALLS = (RELOAD_WEIGHTS, RELOAD_DRAFT_WEIGHTS, REPACK_TIED_LM_HEAD, SAVE_HISTORY, LOAD_HISTORY, ADD_HISTORY,
         DRAFTER_STATS, USE_SCHEDULE, SAMPLER_FIX_APPLIED)
SERVED = {call.name: call.served for call in CALLS if call.served is not None}


def check_extension(cls) -> None:
    """RuntimeError where the worker extension `cls` lacks a call of its own or takes other keywords than CALLS says
    (run at the extension's import: the table and the worker never drift apart)."""
    for call in CALLS:
        method = getattr(cls, call.name, None)
        if call.is_vllms:
            continue
        taken = None if method is None else tuple(inspect.signature(method).parameters)[1:]
        if taken != call.kwargs:
            raise RuntimeError(f"{cls.__name__}.{call.name} takes {taken}, but the worker-call table "
                               f"(rollout/vllm_backend/wire.py) says {call.kwargs}: make them agree")


def is_inside(path, folder: str | None) -> bool:
    """Whether `path` (a non-empty string), with `..` and symlinks resolved, is `folder` or lies below it."""
    if not folder or not isinstance(path, str) or not path or "\0" in path:
        return False
    resolved, root = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([resolved, root]) == root
