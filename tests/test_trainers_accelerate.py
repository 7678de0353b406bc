"""Two CPU processes under `accelerate launch` (the command in the README): each process gets its own
prompts' rollouts back, groups split between processes are sampled independently, and metrics are gathered. (The GRPO
example on two processes: tests/test_examples.py, the smoke stage.)"""

import json

import pytest
from trainers_testing import ROOT, accelerate_launch
from transformers import AutoTokenizer

from rollout import default_model_paths

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("two_process")
    accelerate_launch(ROOT / "tests" / "two_process_grpo.py", str(output_dir))
    return [json.loads((output_dir / f"rank{i}.json").read_text()) for i in range(2)]


def test_each_process_gets_its_own_prompts_back(ranks):
    tokenizer = AutoTokenizer.from_pretrained(default_model_paths()["target"])
    assert [r["world_size"] for r in ranks] == [2, 2]
    for rank in ranks:
        assert len(rank["calls"]) == 2  # one rollout per step
        for call in rank["calls"]:
            assert len(call["prompts"]) == len(call["prompt_ids"]) == len(call["completion_ids"]) == 6
            assert call["prompt_ids"] == [tokenizer(p)["input_ids"] for p in call["prompts"]]
            assert all(1 <= n == len(c) <= 12 for n, c in zip(call["num_logprobs"], call["completion_ids"]))
    for step in range(2):
        rows = ranks[0]["calls"][step]["prompts"] + ranks[1]["calls"][step]["prompts"]
        assert ranks[0]["calls"][step]["prompts"] != ranks[1]["calls"][step]["prompts"]
        assert all(len(set(rows[i:i + 4])) == 1 for i in range(0, 12, 4))  # 3 groups, the middle one split


def test_a_split_group_is_sampled_independently_on_each_process(ranks):
    for step in range(2):
        first = ranks[0]["calls"][step]["completion_ids"][4:]  # rows 4-5 of the middle group
        second = ranks[1]["calls"][step]["completion_ids"][:2]  # rows 6-7
        assert first != second


def test_weights_synced_and_metrics_gathered_on_both_processes(ranks):
    assert [r["num_syncs"] for r in ranks] == [2, 2]
    for key in ("spec/acceptance_rate", "spec/num_draft_tokens", "spec/rollout_tokens_per_s"):
        assert [e[key] for e in ranks[0]["logged"]] == [e[key] for e in ranks[1]["logged"]]  # the same global value
    assert all(e["spec/num_draft_tokens"] > 0 for e in ranks[0]["logged"])

