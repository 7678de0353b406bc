"""Rollout history shared by the processes of one job, for real: `accelerate launch` with 4 CPU processes on gloo
(every process's history holds every prompt after one epoch, its own rollouts once), and a process group that fails
mid-share under torchrun (the history stays as it was, a warning, the process rolls out on)."""

import json
import os
import subprocess
import sys

import pytest
from trainers_testing import ROOT, accelerate_launch

from rollout import default_prompts
from spec.proposers.history import HistoryStore
from trainers_testing import default_tokenizer

pytestmark = pytest.mark.slow


def test_after_one_epoch_every_process_holds_every_prompts_history(tmp_path):
    accelerate_launch(ROOT / "tests" / "history_processes_grpo.py", str(tmp_path), num_processes=4, timeout=1200)
    tokenizer = default_tokenizer()
    everything = {tuple(tokenizer(p)["input_ids"]) for p in default_prompts(8)}
    own = [set(json.loads((tmp_path / f"rank{r}.json").read_text())["own_prompts"]) for r in range(4)]
    assert all(len(prompts) == 2 for prompts in own)  # each rolled out 2 of the 8 prompts itself
    for rank in range(4):
        store = HistoryStore()
        store.load(tmp_path / f"history{rank}.npz")
        prompts = {tuple(int(t) for t in memoryview(key).cast("i")) for key in store._prompts}
        assert prompts == everything, rank
        counts = [sum(e.count for e in entries) for entries in store._prompts.values()]
        assert counts == [4] * 8, (rank, counts)  # 4 generations each, its own not added twice
    logged = json.loads((tmp_path / "rank0.json").read_text())["logged"]
    assert [e["spec/history_hit_rate"] for e in logged] == [0.0, 0.0]  # one epoch: every prompt fresh
    assert "spec/history_share_s" in logged[-1] and logged[-1]["spec/history_share_s"] >= 0


def test_a_share_that_fails_leaves_the_history_and_the_run_goes_on(tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(ROOT / "tests" / "history_share_failure.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["first_shared"] == 2 and result["num_prompts"] == 3  # its 2 prompts and the other's
    assert result["failed_shared"] == 0 and result["unchanged"] and result["rolled_out_after"] == 2
    assert any("sharing rollout history across processes failed" in w for w in result["warnings"])
