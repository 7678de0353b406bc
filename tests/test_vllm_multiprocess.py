"""Two trainer processes under `accelerate launch`, each with its own vLLM engine in process (backend="vllm"): the
GRPO example runs, with weight syncs and a drafter refresh every step. (Two processes sharing one server:
tests/test_vllm_server.py.)"""

import json

from trainers_testing import accelerate_launch
from vllm_testing import ROOT, require_vllm

from rollout import default_model_paths, default_speculative_config

pytestmark = require_vllm


def test_grpo_example_on_two_processes_each_with_its_own_engine(tmp_path):
    # The drafter refresh distils a draft model: the draft-model config, not vLLM's default (the history drafter).
    config = default_speculative_config("vllm", draft_model=default_model_paths()["draft"])
    result = accelerate_launch(ROOT / "examples" / "grpo_arithmetic.py", "--backend", "vllm", "--max-steps", "2",
                               "--num-problems", "8", "--prompts-per-step", "4", "--num-generations", "4",
                               "--eval-samples", "2", "--num-held-out", "8", "--drafter-refresh-steps", "1",
                               "--speculative-config", json.dumps(config), "--output-dir", str(tmp_path))
    assert "step   2/2" in result.stdout and "reward on the training problems" in result.stdout


def test_grpo_example_on_two_processes_with_vllms_default_the_history_drafter(tmp_path):
    result = accelerate_launch(ROOT / "examples" / "grpo_arithmetic.py", "--backend", "vllm", "--max-steps", "2",
                               "--num-problems", "4", "--prompts-per-step", "4", "--num-generations", "4",
                               "--eval-samples", "2", "--num-held-out", "4", "--output-dir", str(tmp_path))
    assert "step   2/2" in result.stdout and "reward on the training problems" in result.stdout
    logs = json.loads((tmp_path / "run.json").read_text())["history"]
    assert all("spec/drafter_time_fraction" in entry for entry in logs)  # the project's drafter ran inside vLLM
    assert sum(entry["spec/acceptance_rate"] for entry in logs) > 0
