"""The Backend protocol's contract (backend_contract.py) on vLLM's CPU build: `vllm.LLM` in this process and a server
started by `python -m rollout serve`, both running the project's history drafter inside vLLM's workers on the
shipped target, at tiny shapes (8 rows of 128 tokens). tests/test_backend_contract.py runs the same checks on the
embedded engine; here the methods each vLLM backend documents as NotImplementedError are checked as refusals that
change nothing."""

import json

import pytest
from backend_contract import CHECKS, Subject
from safetensors.torch import load_file
from vllm_testing import Server, require_vllm

from rollout import RolloutGenerator, default_model_paths, default_prompts
from rollout.prompts import to_token_ids

pytestmark = require_vllm
HISTORY = {"method": "history", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 12}
SHAPE = {"max_num_seqs": 8, "max_model_len": 128}
BUILT_WITH_ITS_CONFIG = {"build_speculation", "use_speculation"}  # what a vLLM engine refuses (rollout/backend.py);
# a server also runs the schedule it was started with, and is timed by rollout tune on an engine in process


def _target_weights() -> list:
    """The shipped target's weights under HF names: what each engine loaded at start-up."""
    return list(load_file(f"{default_model_paths()['target']}/model.safetensors").items())


def _subject(generator: RolloutGenerator, tmp_path, refuses: set[str]) -> Subject:
    prompt_ids = to_token_ids(default_prompts(3, seed=11), generator.tokenizer, generator.max_model_len)
    return Subject(generator.backend, prompt_ids, _target_weights, tmp_path, frozenset(refuses))


@pytest.fixture(scope="module")
def in_process() -> RolloutGenerator:
    return RolloutGenerator("default", speculative_config=HISTORY, backend="vllm", **SHAPE)


@pytest.fixture(scope="module")
def server_client(tmp_path_factory):
    server = Server(["--model", "default", "--speculative-config", json.dumps(HISTORY), "--max-model-len",
                     str(SHAPE["max_model_len"]), "--max-num-seqs", str(SHAPE["max_num_seqs"])],
                    tmp_path_factory.mktemp("contract_server") / "server.log")
    try:
        yield RolloutGenerator(**server.client_kwargs)
    finally:
        server.stop()


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_vllm_in_process_keeps_the_backend_contract(in_process, check, tmp_path):
    check(_subject(in_process, tmp_path, BUILT_WITH_ITS_CONFIG))


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_a_vllm_server_keeps_the_backend_contract(server_client, check, tmp_path):
    check(_subject(server_client, tmp_path, {*BUILT_WITH_ITS_CONFIG, "use_schedule", "measure_step_times"}))
