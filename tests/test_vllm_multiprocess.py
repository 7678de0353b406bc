"""Two trainer processes under `accelerate launch`, each with its own vLLM engine in process (backend="vllm"): the
GRPO example runs, with weight syncs and a drafter refresh every step. (Two processes sharing one server:
tests/test_vllm_server.py.)"""

from trainers_testing import accelerate_launch
from vllm_testing import ROOT, require_vllm

pytestmark = require_vllm


def test_grpo_example_on_two_processes_each_with_its_own_engine(tmp_path):
    result = accelerate_launch(ROOT / "examples" / "grpo_arithmetic.py", "--backend", "vllm", "--max-steps", "2",
                               "--num-problems", "8", "--prompts-per-step", "4", "--num-generations", "4",
                               "--eval-samples", "2", "--num-held-out", "8", "--drafter-refresh-steps", "1",
                               "--output-dir", str(tmp_path))
    assert "step   2/2" in result.stdout and "reward on the training problems" in result.stdout
