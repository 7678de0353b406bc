"""backend="vllm" with tensor_parallel_size=2 on vLLM's CPU build (tests/tensor_parallel_check.py, in its own
process): the backend binds each rank to its own cores (VLLM_CPU_OMP_THREADS_BIND), the worker extension applies the
sampler fix in both spawned workers, target and draft loads reach both ranks, and the project's history drafter runs
on both ranks alike."""

import json
import os
import subprocess
import sys

from vllm_testing import ROOT, require_vllm

pytestmark = require_vllm


def test_tensor_parallel_2_samples_right_and_loads_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the backend sets it
    shm_before = set(os.listdir("/dev/shm"))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "tensor_parallel_check.py"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # the JSON line; the spawned workers' log lines may come after it on the same stdout
    result = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))
    assert result["sampler_fix_applied"] == [True, True]
    assert result["worst_sampled_logprob_diff"] < 1e-4
    before, noisy, restored = result["draft_acceptance"]
    assert before == restored == 1.0 and noisy < 0.3
    assert result["target_logprob_diff_after_load"] < 1e-4
    assert result["history_greedy_equal"] == [True, True, True]
    first, second, fed = result["history_mean_acceptance_length"]
    assert second > first + 1  # greedy siblings and a repeated call: the second call drafts from the first's outputs
    # a rollout added to both ranks' histories (rollout_history.add): a new prompt's first call drafts it, K at a time
    assert result["history_kept"] and result["history_hit_rate"] == 1.0 and fed > 3.0
    drafts = result["history_drafts_per_rank"]
    assert drafts[0] == drafts[1] > 0
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("vllm_dist_")]
