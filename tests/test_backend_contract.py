"""The Backend protocol's contract (backend_contract.py) on the embedded engine, with each kind of drafter: the
history drafter, a draft model, and no speculation. tests/test_vllm_backend_contract.py runs the same checks on vLLM
in this process and on a vLLM server."""

from pathlib import Path

import pytest
from backend_contract import CHECKS, Subject

from rollout import RolloutGenerator, default_model_paths, default_prompts
from rollout.prompts import to_token_ids

CONFIGS = {
    "history": {"speculative_config": {"method": "history", "num_speculative_tokens": 4}},
    "draft_model": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3},
                    "draft_model": default_model_paths()["draft"]},
    "none": {"speculative_config": None},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def generator(request) -> RolloutGenerator:
    return RolloutGenerator("default", max_num_seqs=8, max_model_len=128, **CONFIGS[request.param])


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_the_embedded_engine_keeps_the_backend_contract(generator, check, tmp_path):
    model = generator.backend.runner.model
    prompt_ids = to_token_ids(default_prompts(3, seed=11), generator.tokenizer, generator.max_model_len)
    check(Subject(generator.backend, prompt_ids,
                  lambda: [(name, param.detach().clone()) for name, param in model.named_parameters()], tmp_path))


def test_the_readme_says_how_many_checks_every_backend_runs():
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert f"(`tests/backend_contract.py`) is {len(CHECKS)} checks, each run on every backend" in readme
