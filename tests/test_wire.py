"""The worker-call table (rollout/vllm_backend/wire.py) and its readers, without vLLM: the gate admits exactly the
served calls, the worker extension's check refuses a method that drifted from the table, a client builds only the
table's keywords, and a server without the project's worker extension is told apart by its config, not by an error's
text."""

import inspect

import pytest

from rollout.server_backend.client import Server
from rollout.server_backend.http import ServerError
from rollout.vllm_backend import wire
from rollout.vllm_backend.guard import check_rpc


def test_the_gate_admits_the_served_calls_and_nothing_else():
    served = [call for call in wire.CALLS if call.served is not None]
    assert {call.name for call in served} == set(wire.SERVED) and wire.USE_SCHEDULE.name not in wire.SERVED
    for call in wire.CALLS:
        refusal = check_rpc(f'{{"method": "{call.name}", "kwargs": {{}}}}'.encode(), {}) or ""
        assert ("is not one this server runs" in refusal) == (call.served is None), (call.name, refusal)
        assert call.served is None or set(call.served) <= set(call.kwargs)


def test_the_extension_check_refuses_a_method_that_drifted_from_the_table():
    class Extension:
        pass

    with pytest.raises(RuntimeError, match="Extension.reload_draft_weights takes None"):  # a method missing
        wire.check_extension(Extension)

    def add_rollout_history(self, prompt_ids, completions):
        return None

    for call in wire.CALLS:
        if not call.is_vllms:
            setattr(Extension, call.name, _method(call.kwargs))
    wire.check_extension(Extension)  # the table's own signatures pass
    Extension.add_rollout_history = add_rollout_history
    with pytest.raises(RuntimeError, match="add_rollout_history takes \\('prompt_ids', 'completions'\\)"):
        wire.check_extension(Extension)


def test_a_client_builds_only_the_tables_keywords():
    assert wire.ADD_HISTORY.kwargs_for(prompt_ids=[[1]], completion_ids=[[2]]) == {"prompt_ids": [[1]],
                                                                                    "completion_ids": [[2]]}
    with pytest.raises(AssertionError, match="add_rollout_history takes"):
        wire.ADD_HISTORY.kwargs_for(prompts=[[1]])


def test_a_server_without_the_worker_extension_runs_none_of_its_calls():
    server = object.__new__(Server)  # no server: rpc decides from what the server's config said
    server.base_url, server.has_extension = "http://127.0.0.1:1", False
    with pytest.raises(ServerError, match="runs no add_rollout_history .*--worker-extension-cls"):
        server.rpc(wire.ADD_HISTORY, {"prompt_ids": [[1]], "completion_ids": [[2]]}, "add rollouts")
    assert server.rpc(wire.REPACK_TIED_LM_HEAD, {}, "re-pack", optional=True) is None


def _method(kwargs: tuple[str, ...]):
    """A method whose signature is (self, *kwargs)."""
    def method(self, **given):
        return None

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    method.__signature__ = inspect.Signature([inspect.Parameter(name, kind) for name in ("self", *kwargs)])
    return method
