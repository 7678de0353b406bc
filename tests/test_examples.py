"""The smoke stage (`python -m pytest -m smoke`, in .ci/run): every example's documented command (README and the
example's docstring), run as a subprocess from the repository root at tiny shapes, its outputs in a temp folder. Each
must exit 0 and write or print what it promises. The vLLM ones (bench_vllm_tune.py, the vLLM arms of
bench_rollout.py and bench_epochs.py) run in .ci/run's vLLM stage (skipped without vllm); device_check.sh needs a GPU,
so it is only parsed here."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_testing import ROOT, require_vllm

pytestmark = pytest.mark.smoke
GRPO = ["examples/grpo_arithmetic.py", "--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "2",
        "--num-eval-problems", "2", "--eval-samples", "2", "--num-held-out", "2", "--max-completion-length", "32"]
TWO_CPU_PROCESSES = {  # the README's flags, and examples/accelerate_cpu.yaml (grpo_arithmetic's docstring)
    "flags": ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"],
    "config_file": ["--config_file", "examples/accelerate_cpu.yaml"]}


def run(command: list, timeout: int = 600, **env: str) -> str:
    """`command` from the repository root with the checkout's packages first on the path and `env` added; asserts a
    zero exit status (message: the output's tail) and returns stdout."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([str(part) for part in command], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def assert_grpo_ran(stdout: str) -> None:
    assert "step   2/2" in stdout and "reward on the training problems" in stdout


def test_grpo_arithmetic_on_one_process(tmp_path):
    assert_grpo_ran(run([sys.executable, *GRPO, "--output-dir", tmp_path]))


@pytest.mark.parametrize("launch", TWO_CPU_PROCESSES.values(), ids=TWO_CPU_PROCESSES.keys())
def test_grpo_arithmetic_on_two_cpu_processes(tmp_path, launch):
    accelerate = Path(sys.executable).with_name("accelerate")
    assert_grpo_ran(run([accelerate, "launch", *launch, *GRPO, "--output-dir", tmp_path], ACCELERATE_USE_CPU="1"))


def test_bench_rollout(tmp_path):
    stdout = run([sys.executable, "examples/bench_rollout.py", "--shapes", "2x2", "--repeats", "1", "--arms",
                  "no_spec,k4,trl_generate", "--max-completion-length", "32", "--threads", "1", "--greedy-check", "2",
                  "--output-dir", tmp_path])
    assert (tmp_path / "bench_rollout.png").exists()
    assert "tok/s" in stdout and json.loads((tmp_path / "bench_rollout.json").read_text())


@require_vllm
def test_bench_rollout_vllm(tmp_path):
    run([sys.executable, "examples/bench_rollout.py", "--shapes", "2x2", "--repeats", "1", "--arms",
         "no_spec,vllm_no_spec,vllm_history_k{k},vllm_default", "--max-completion-length", "32", "--threads", "1",
         "--greedy-check", "0", "--vllm-python", sys.executable, "--output-dir", tmp_path])
    arms = json.loads((tmp_path / "bench_rollout.json").read_text())["shapes"]["2x2"]["arms"]
    assert list(arms) == ["no_spec", "vllm_no_spec", "vllm_history_k4", "vllm_default"]
    assert all("over_vllm_no_spec" in arms[a] for a in ("vllm_history_k4", "vllm_default"))


EPOCHS = ["examples/bench_epochs.py", "--shapes", "2x2", "--epochs", "2", "--num-prompts", "4",
          "--max-completion-length", "32", "--threads", "1"]


def assert_bench_epochs_ran(stdout: str, output_dir: Path, arms: list[str]) -> None:
    """Every arm in every epoch, the embedded arms identical to no_spec, four optimizer steps, the plot."""
    results = json.loads((output_dir / "bench_epochs.json").read_text())
    assert list(results["arms"]) == arms and results["identical_check"]["passed"]
    shape = results["shapes"]["2x2"]
    assert set(shape["epochs"]) == {"1", "2"} and all(list(e["arms"]) == arms for e in shape["epochs"].values())
    assert len([entry for entry in shape["trainer_log"] if "loss" in entry]) == 4
    assert (output_dir / "bench_epochs.png").exists() and "identical to no_spec: True" in stdout


def test_bench_epochs(tmp_path):
    arms = ["no_spec", "draft_schedule", "suffix", "history_k4", "history_k8", "default"]
    stdout = run([sys.executable, *EPOCHS, "--arms", ",".join(arms), "--output-dir", tmp_path])
    assert_bench_epochs_ran(stdout, tmp_path, arms)


@require_vllm
def test_bench_epochs_vllm(tmp_path):
    arms = ["no_spec", "history_k8", "vllm_no_spec", "vllm_default"]
    if importlib.util.find_spec("arctic_inference"):  # without it the benchmark skips vllm_suffix (as test_vllm_suffix)
        arms.append("vllm_suffix")
    stdout = run([sys.executable, *EPOCHS, "--arms", ",".join(arms), "--vllm-python", sys.executable,
                  "--output-dir", tmp_path])
    assert_bench_epochs_ran(stdout, tmp_path, arms)


SHARING = ["examples/bench_sharing.py", "--epochs", "2", "--num-problems", "4", "--prompts-per-step", "2",
           "--num-generations", "2", "--max-completion-length", "16"]


def test_bench_sharing(tmp_path):
    run([sys.executable, *SHARING, "--arms", "hist8_1p,hist8_2p", "--seeds", "0,1", "--output-dir", tmp_path])
    results = json.loads((tmp_path / "bench_sharing.json").read_text())
    assert [len(results["results"][a]["epochs"]) for a in ("hist8_1p", "hist8_2p")] == [2, 2]
    assert "mean_acceptance_length hist8_2p / hist8_1p" in results["ratios"] and (tmp_path / "bench_sharing.png").exists()
    one = results["results"]["hist8_1p"]  # each epoch's figures: the mean over the seeds' runs
    per_seed = [one["seeds"][seed]["epochs"][0]["tokens_per_s"] for seed in ("0", "1")]
    assert one["epochs"][0]["tokens_per_s"] == pytest.approx(sum(per_seed) / 2)


@require_vllm
def test_bench_sharing_vllm_and_two_servers(tmp_path):
    run([sys.executable, *SHARING, "--arms", "vllm_default_2p,server2_default_2p", "--vllm-python", sys.executable,
         "--output-dir", tmp_path])
    results = json.loads((tmp_path / "bench_sharing.json").read_text())["results"]
    assert all(len(results[a]["epochs"]) == 2 for a in ("vllm_default_2p", "server2_default_2p"))


def test_bench_speculation(tmp_path):
    stdout = run([sys.executable, "examples/bench_speculation.py", "--batch-sizes", "1,2", "--repeats", "1",
                  "--min-repeats", "1", "--warmup", "1", "--confirm-repeats", "1", "--max-tokens", "16",
                  "--threads", "1", "--output-dir", tmp_path])
    results = json.loads((tmp_path / "bench_speculation.json").read_text())
    assert set(results["workloads"]) == {"default", "mixed"} and (tmp_path / "bench_speculation.png").exists()
    assert "wrote" in stdout


def test_train_default_pair(tmp_path):
    run([sys.executable, "examples/train_default_pair.py", "--target-steps", "2", "--draft-steps", "2",
         "--target-batch-tokens", "512", "--draft-batch-tokens", "512", "--pool-size", "64",
         "--num-distill-samples", "8", "--num-eval-prompts", "8", "--rollout-prompts", "2",
         "--rollout-generations", "2", "--max-new-tokens", "16", "--out-dir", tmp_path])
    report = json.loads((tmp_path / "training_report.json").read_text())
    assert "target/temperature_1_accuracy" in report and "draft/greedy_agreement_on_target_greedy" in report
    assert (tmp_path / "target" / "model.safetensors").exists() and (tmp_path / "draft" / "model.safetensors").exists()


@require_vllm
def test_bench_vllm_tune(tmp_path):
    stdout = run([sys.executable, "examples/bench_vllm_tune.py", "--max-batch-size", "2", "--repeats", "1",
                  "--max-tokens", "8", "--output-dir", tmp_path])
    assert "tuned schedule:" in stdout and (tmp_path / "bench_vllm_tune.png").exists()
    assert json.loads((tmp_path / "bench_vllm_tune.json").read_text())["tuned_config"]


def test_device_check_script_parses():
    run(["bash", "-n", "examples/device_check.sh"])
