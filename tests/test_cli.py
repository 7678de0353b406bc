"""The main job, end to end on the shipped default pair, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout import default_model_paths, default_prompts
from rollout.default_task import reward
from spec import SpecConfig


def _run(*args, cwd):
    """`python -m rollout ...` as a user runs it, offline, with a step-cost cache of its own. The guard only stops
    a hung process: generous, and on expiry the failure shows what the command had printed."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "SPEC_ROLLOUTS_CACHE": str(Path(cwd) / "cache"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        return subprocess.run([sys.executable, "-m", "rollout", *args], cwd=cwd, capture_output=True, text=True,
                              env=env, timeout=1800)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"python -m rollout {' '.join(args)} ran past 30 minutes; it printed:\n{e.stdout}\n{e.stderr}")


def test_generate_writes_jsonl_and_prints_the_summary(tmp_path):
    out = tmp_path / "samples.jsonl"
    result = _run("generate", "--num-prompts", "3", "--num-generations", "2", "--max-tokens", "48",
                  "--output", str(out), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6
    assert [(s["prompt_index"], s["sample_index"]) for s in lines] == [(i, j) for i in range(3) for j in range(2)]
    for sample in lines:
        assert len(sample["logprobs"]) == len(sample["completion_ids"]) > 0
        assert sample["finish_reason"] in ("stop", "length")
        assert {"num_draft_tokens", "acceptance_histogram", "k_per_step"} <= set(sample["acceptance"])
    assert sum(s["acceptance"]["num_draft_tokens"] for s in lines) > 0  # the default config speculates
    for name in ("tokens/s", "acceptance rate", "mean acceptance length", "K per batch size"):
        assert name in result.stdout
    prompts = default_prompts(3, seed=0)
    scores = [reward(prompts[s["prompt_index"]], s["text"]) for s in lines]
    assert all(score in (0.0, 1.0) for score in scores)


def test_generate_with_a_user_config_and_no_speculation(tmp_path):
    out = tmp_path / "plain.jsonl"
    result = _run("generate", "--num-prompts", "2", "--num-generations", "1", "--max-tokens", "8",
                  "--speculative-config", "none", "--output", str(out), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(json.loads(line)["acceptance"]["num_draft_tokens"] == 0 for line in out.read_text().splitlines())
    ngram = _run("generate", "--num-prompts", "2", "--max-tokens", "8", "--output", str(out), "--no-progress",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', cwd=tmp_path)
    assert ngram.returncode == 0, ngram.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    result = _run("generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
                  "--output", str(tmp_path / "x.jsonl"), cwd=tmp_path)
    assert result.returncode == 2 and "num_speculative_tokens=0" in result.stderr
    result = _run("generate", "--speculative-config", "{not json", cwd=tmp_path)
    assert result.returncode == 2 and "not valid JSON" in result.stderr
    result = _run("generate", "--model", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert result.returncode == 2 and "expected a local model folder" in result.stderr


def test_default_pair_is_shipped():
    paths = default_model_paths()
    for path in paths.values():
        assert (Path(path) / "model.safetensors").is_file()


@pytest.mark.slow
def test_tune_prints_a_schedule_both_engines_accept(tmp_path):
    result = _run("tune", "--num-prompts", "4", "--num-generations", "2", "--max-tokens", "24", "--max-num-seqs", "8",
                  "--max-k", "4", "--repeats", "1", "--output", str(tmp_path / "tuned.json"), "--no-progress",
                  cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout.strip().splitlines()[-1])
    assert config == json.loads((tmp_path / "tuned.json").read_text())
    spec = SpecConfig.from_dict(config)  # the keys and rules of vLLM's --speculative-config
    ranges = config["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 8 and all(0 <= k <= 4 for *_, k in ranges)
    assert spec.num_speculative_tokens == max(1, max(k for *_, k in ranges))
    assert "acceptance per position" in result.stderr and "predicted K" in result.stderr
    assert "measured K" in result.stderr  # every K was timed at every batch size of the grid
    assert list((tmp_path / "cache").glob("step_costs-*.json"))  # the measured costs are cached for later runs


def test_tune_without_a_drafter_is_refused(tmp_path):
    result = _run("tune", "--speculative-config", "none", "--no-progress", cwd=tmp_path)
    assert result.returncode == 2 and "tune needs a speculative config" in result.stderr
