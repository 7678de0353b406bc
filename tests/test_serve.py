"""`python -m rollout serve` (rollout/vllm_backend/serve.py): the flags it adds for the server backend, the ones it
refuses, the default pair, and the plain command it prints. No server is started here (tests/test_vllm_server.py
starts one)."""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from rollout import default_model_paths, default_speculative_config
from rollout.vllm_backend.serve import build_command, plain_command
from spec import SpecConfig


def _flags(args: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(args, args[1:] + [""]) if flag.startswith("--")}


def test_the_settings_the_client_needs_are_added_on_cpu():
    target = default_model_paths()["target"]
    args, env = build_command(["--model", target, "--max-num-seqs", "8", "--port", "9"], is_cpu=True)
    flags = _flags(args)
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--per-request-spec-decode-metrics"] == \
        "detailed"
    assert flags["--worker-extension-cls"] == "rollout.vllm_backend.worker.WorkerExtension"
    config = AutoConfig.from_pretrained(target)
    max_model_len = min(config.max_position_embeddings, 2048)  # the model's, capped
    assert (flags["--generation-config"], flags["--dtype"], flags["--max-model-len"]) == ("vllm", "float32",
                                                                                         str(max_model_len))
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # K and V, float32
    assert "--enforce-eager" in flags and int(flags["--kv-cache-memory-bytes"]) == per_token * 8 * (max_model_len + 64)
    assert flags["--port"] == "9" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert flags["--host"] == "127.0.0.1" and flags["--middleware"] == "rollout.vllm_backend.guard.ServerGuard"
    folders = json.loads(env["ROLLOUT_SERVER_FOLDERS"])  # new private folders, for the gate and the clients
    assert sorted(folders) == ["history_dir", "weights_dir"] and all(os.path.isdir(f) for f in folders.values())
    gpu_args, _ = build_command(["--model", target], is_cpu=False)
    assert "--enforce-eager" not in gpu_args and "--kv-cache-memory-bytes" not in gpu_args


def test_given_flags_win_and_a_wrong_logprobs_mode_is_refused():
    target = default_model_paths()["target"]
    args, _ = build_command(["--model", target, "--dtype", "bfloat16", "--max-model-len", "64",
                             "--gpu-memory-utilization", "0.5", "--generation-config", "auto"], is_cpu=True)
    assert _flags(args)["--dtype"] == "bfloat16" and args.count("--dtype") == args.count("--max-model-len") == 1
    assert "--kv-cache-memory-bytes" not in args and _flags(args)["--generation-config"] == "auto"
    with pytest.raises(ValueError, match="--logprobs-mode raw_logprobs: the server backend needs"):
        build_command(["--model", target, "--logprobs-mode", "raw_logprobs"], is_cpu=True)
    with pytest.raises(ValueError, match="needs --model"):
        build_command(["--port", "8000"], is_cpu=True)


def test_default_pair_and_tensor_parallel_binding(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args, env = build_command(["--model", "default", "-tp", "2"], is_cpu=True)
    flags = _flags(args)
    assert flags["--model"] == default_model_paths()["target"]
    spec, additional = json.loads(flags["--speculative-config"]), json.loads(flags["--additional-config"])
    assert spec["method"] == "custom_class"  # the default (the history drafter) runs through the project's proposer
    default = SpecConfig.from_dict(default_speculative_config(backend="vllm"))
    assert SpecConfig.from_dict(additional["rollout_speculative_config"]) == default
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert plain_command(args, env).startswith("VLLM_SERVER_DEV_MODE=1 ROLLOUT_SERVER_FOLDERS=")
    assert "VLLM_CPU_OMP_THREADS_BIND='0,1|2,3' python -m vllm.entrypoints.openai.api_server --model " in \
        plain_command(args, env)


def test_the_projects_drafter_becomes_vllms_custom_class_with_its_config_beside_it():
    target = default_model_paths()["target"]
    history = {"method": "history", "num_speculative_tokens": 4, "history_max_tokens": 1000}
    args, _ = build_command(["--model", target, "--max-num-seqs", "8", "--speculative-config", json.dumps(history),
                             "--additional-config={\"plugin\": 1}"], is_cpu=True)
    flags = _flags(args)
    assert json.loads(flags["--speculative-config"]) == {
        "method": "custom_class", "model": "rollout.vllm_backend.proposer.RolloutProposer", "num_speculative_tokens": 4}
    additional = json.loads(flags["--additional-config"])
    assert additional["plugin"] == 1 and additional["rollout_speculative_config"]["history_max_tokens"] == 1000
    assert additional["rollout_max_drafter_faults"] == 8  # the workers' fault limit (spec/drafting_host.py)
    limited, _ = build_command(["--model", target, "--speculative-config", json.dumps(history),
                                "--max-drafter-faults", "0"], is_cpu=True)
    assert json.loads(_flags(limited)["--additional-config"])["rollout_max_drafter_faults"] == 0
    with pytest.raises(ValueError, match="--max-drafter-faults=-1: must be an integer >= 0"):
        build_command(["--model", target, "--speculative-config", json.dumps(history), "--max-drafter-faults", "-1"],
                      is_cpu=True)
    assert args.count("--speculative-config") == 1 and not [a for a in args if a.startswith("--additional-config=")]
    config = AutoConfig.from_pretrained(target)  # no draft model's KV cache: the class is not a model folder
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert int(flags["--kv-cache-memory-bytes"]) == per_token * 8 * (min(config.max_position_embeddings, 2048) + 64)
    with pytest.raises(NotImplementedError, match="point proposals"):
        build_command(["--model", target, "--speculative-config",
                       json.dumps({**history, "draft_sample_method": "probabilistic"})], is_cpu=True)
    missing = {"method": "custom_class", "model": "not_installed.drafters.Mine", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="model='not_installed.drafters.Mine': cannot import module 'not_installed"):
        build_command(["--model", target, "--speculative-config", json.dumps(missing)], is_cpu=True)


def test_a_server_open_beyond_loopback_needs_a_key(monkeypatch, tmp_path):
    target = default_model_paths()["target"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for host in ("0.0.0.0", "10.1.2.3", "server1", ""):
        with pytest.raises(ValueError, match=f"--host {host}: a server bound beyond loopback needs an API key"):
            build_command(["--model", target, "--host", host], is_cpu=True)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        build_command(["--model", target, "--host", host], is_cpu=True)
    build_command(["--model", target, "--host", "0.0.0.0", "--trusted-network"], is_cpu=True)
    args, env = build_command(["--model", target, "--host", "0.0.0.0", "--api-key", "s3cret",
                               "--weights-dir", str(tmp_path / "w"), "--history-dir", str(tmp_path / "h")], is_cpu=True)
    assert "--trusted-network" not in args and "--weights-dir" not in args  # the launcher's own flags stay here
    assert json.loads(env["ROLLOUT_SERVER_FOLDERS"]) == {"weights_dir": str(tmp_path / "w"),
                                                          "history_dir": str(tmp_path / "h")}
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    build_command(["--model", target, "--host", "0.0.0.0"], is_cpu=True)


def test_the_key_reaches_vllm_in_its_environment_never_in_its_argv(monkeypatch):
    target = default_model_paths()["target"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for given in (["--api-key", "s3cret"], ["--api-key=s3cret"]):
        args, env = build_command(["--model", target, "--host", "0.0.0.0", *given], is_cpu=True)
        assert env["VLLM_API_KEY"] == "s3cret" and not [a for a in args if "s3cret" in a or "--api-key" in a]
        assert "s3cret" not in plain_command(args, env) and plain_command(args, env).count("VLLM_API_KEY=<key>") == 1
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert build_command(["--model", target], is_cpu=True)[1]["VLLM_API_KEY"] == "from-env"
    with pytest.raises(ValueError, match="--api-key given 2 times"):
        build_command(["--model", target, "--api-key", "a", "--api-key", "b"], is_cpu=True)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_an_empty_key_does_not_start_on_any_host(monkeypatch, host):
    target = default_model_paths()["target"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key='' is not an API key"):
        build_command(["--model", target, "--host", host, "--api-key", ""], is_cpu=True)
    monkeypatch.setenv("VLLM_API_KEY", "")
    for extra in ([], ["--trusted-network"]):
        with pytest.raises(ValueError, match="VLLM_API_KEY='' is not an API key"):
            build_command(["--model", target, "--host", host, *extra], is_cpu=True)


def test_the_cli_refuses_an_open_server_before_starting_it():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "rollout", "serve", "--model", "default", "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "needs an API key" in out.stderr and "--trusted-network" in out.stderr


@pytest.mark.parametrize("how", ["environment", "flag"])
def test_the_cli_refuses_an_empty_key_before_starting(how):
    env = {**os.environ, "VLLM_API_KEY": ""} if how == "environment" else {
        k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    flag = ["--api-key", ""] if how == "flag" else []
    out = subprocess.run([sys.executable, "-m", "rollout", "serve", "--model", "default", "--host", "0.0.0.0", *flag],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "is not an API key: a key is a non-empty string" in out.stderr, out.stderr
    assert "plain command" not in out.stdout


def test_the_cli_help_says_what_trusted_network_exposes():
    out = subprocess.run([sys.executable, "-m", "rollout", "serve", "--trusted-network", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--trusted-network" in out.stdout and "--weights-dir" in out.stdout
    assert "loading weights and rollout histories" in " ".join(out.stdout.split()), out.stdout


def test_the_cli_prints_the_plain_command_on_a_dry_run():
    out = subprocess.run([sys.executable, "-m", "rollout", "serve", "--model", "default", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "python -m vllm.entrypoints.openai.api_server --model" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "rollout", "serve", "--port", "1"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "needs --model" in bad.stderr
