"""`python -m rollout serve`: vLLM's OpenAI server with the settings the server backend needs (a thin launcher).

    python -m rollout serve --model FOLDER --speculative-config JSON --port 8000 --max-model-len 512 [vLLM flags]

It takes vLLM's own flag names and passes every flag through; `--model default` is the shipped pair's target, with
`rollout.default_speculative_config("vllm")` unless --speculative-config is given (as `python -m rollout generate`). A
config of this project's drafters (`method: "history"` or a `custom_class` to the project's protocol) becomes the form
the installed vLLM runs them in (versions.py: vLLM's custom_class hook before 0.34, the project's registered method
from 0.34), with the config in --additional-config; the server's processes import the project, so this package must
be installed where the server runs: the launcher imports the classes the server will (a custom_class drafter's, the
proposer before 0.34) and on 0.34+ checks the project's vLLM plugin is installed, failing before the server starts.

It adds what the client (rollout/server_backend.py) relies on, unless the flag is given: `--logprobs-mode
processed_logprobs`, `--per-request-spec-decode-metrics detailed`, `--generation-config vllm`,
`--worker-extension-cls` (worker.py: the CPU sampler fix in the server's worker processes, draft-weight reloads),
and on CPU `--enforce-eager`, `--dtype float32`, `--max-model-len` (the model's, capped at 2048) and
`--kv-cache-memory-bytes` sized for --max-num-seqs (vLLM's default 128) requests of --max-model-len tokens
(engine_args.py says why). It sets VLLM_SERVER_DEV_MODE=1 (the client reads /server_info and syncs weights through
/collective_rpc) and, for tensor parallelism on CPU, VLLM_CPU_OMP_THREADS_BIND.

It prints the equivalent plain command, then replaces itself with `python -m vllm.entrypoints.openai.api_server`
(the `vllm serve` CLI fails on the CPU wheel: it asks for the version of a package named "vllm"; on a CUDA install
`vllm serve --model ...` with the same flags and environment is the same server). `--dry-run` prints and exits.
"""

import argparse
import json
import os
import shlex
import sys

import torch

from rollout.loading import default_max_model_len
from rollout.vllm_backend.engine_args import (WORKER_EXTENSION, cpu_thread_binding, drafter_folder, kv_cache_bytes,
                                              speculative_config)
from rollout.vllm_backend.versions import check_server_drafter
from spec import SpecConfig
from spec.config import PROTOCOL_METHODS
from spec.proposers.custom import load_class

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_DEFAULT_MAX_NUM_SEQS = 128
# Flags the client needs at these values: another value is refused (the fix is named).
REQUIRED = {"--logprobs-mode": "processed_logprobs"}
ADDED = {"--per-request-spec-decode-metrics": "detailed", "--generation-config": "vllm",
         "--worker-extension-cls": WORKER_EXTENSION}


def build_command(argv: list[str], is_cpu: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """(the server's argv after `python -m SERVER_MODULE`, the environment variables it needs) for the user's
    vLLM flags `argv`. ValueError for a missing --model or a flag at a value the client cannot use;
    NotImplementedError for a config of this project's drafters that vLLM cannot run (SpecConfig.check_vllm_protocol)."""
    is_cpu = not torch.cuda.is_available() if is_cpu is None else is_cpu
    known = _parser().parse_known_args(argv)[0]
    if not known.model:
        raise ValueError("rollout serve needs --model FOLDER (the target; vLLM's flag names, e.g. --model "
                         "/models/target --speculative-config '{\"method\": \"draft_model\", ...}' --port 8000)")
    args = _project_drafter(_default_pair(list(argv), known), known)
    for flag, value in REQUIRED.items():
        given = getattr(known, _dest(flag))
        if given is not None and given != value:
            raise ValueError(f"{flag} {given}: the server backend needs {flag} {value} (the trainer's logprobs are "
                             "the processed distribution's); drop the flag")
    for flag, value in {**REQUIRED, **ADDED}.items():
        if getattr(known, _dest(flag)) is None:
            args += [flag, value]
    if is_cpu:
        args += _cpu_defaults(known)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if is_cpu and known.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(known.tensor_parallel_size)
    return args, env


def plain_command(args: list[str], env: dict[str, str]) -> str:
    """The shell command that starts the same server without this launcher."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "python", "-m", SERVER_MODULE,
                     shlex.join(args)])


def main(argv: list[str]) -> int:
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    try:
        args, env = build_command(argv)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"rollout serve: the plain command is\n  {plain_command(args, env)}", flush=True)
    if dry_run:
        return 0
    os.execve(sys.executable, [sys.executable, "-m", SERVER_MODULE, *args], {**os.environ, **env})


def _default_pair(args: list[str], known: argparse.Namespace) -> list[str]:
    """args with `--model default` made the shipped target's folder, plus rollout.defaults' speculative config for
    vLLM unless one is given; `known` is updated to match."""
    if known.model != "default":
        return args
    from rollout.default_models import default_model_paths
    from rollout.defaults import default_speculative_config
    known.model = default_model_paths()["target"]
    args = [known.model if a == "default" and i > 0 and args[i - 1] == "--model" else a for i, a in enumerate(args)]
    args = [f"--model={known.model}" if a == "--model=default" else a for a in args]
    if known.speculative_config is None:
        known.speculative_config = json.dumps(default_speculative_config(backend="vllm"))
        args += ["--speculative-config", known.speculative_config]
    return args


def _project_drafter(args: list[str], known: argparse.Namespace) -> list[str]:
    """args with a config of this project's drafters (PROTOCOL_METHODS, e.g. "history") made what the installed vLLM
    runs (versions.py), with the config in --additional-config (merged into one given)."""
    given = _json_object(known.speculative_config, "--speculative-config") if known.speculative_config else None
    if not given or given.get("method") not in PROTOCOL_METHODS:
        return args
    config = SpecConfig.from_dict(given)
    spec, additional = speculative_config(config, None)
    for path in check_server_drafter(config):
        load_class(path)  # the server's processes import these: fail here, naming the path, not in its start-up
    known.speculative_config = json.dumps(spec)
    additional = {**_json_object(known.additional_config or "{}", "--additional-config"), **additional}
    args = _without(_without(args, "--speculative-config"), "--additional-config")
    return args + ["--speculative-config", known.speculative_config, "--additional-config", json.dumps(additional)]


def _without(args: list[str], flag: str) -> list[str]:
    """args without `flag VALUE` and `flag=VALUE`."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r} is not valid JSON ({e}); e.g. "
                         '\'{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} {text!r} is not a JSON object; e.g. "
                         '\'{"method": "history", "num_speculative_tokens": 4}\'')
    return value


def _cpu_defaults(known: argparse.Namespace) -> list[str]:
    """--enforce-eager, --dtype float32, --max-model-len and a KV cache size, each unless given."""
    args = [] if known.enforce_eager else ["--enforce-eager"]
    dtype = known.dtype or "float32"
    if known.dtype is None:
        args += ["--dtype", dtype]
    max_model_len = known.max_model_len
    if max_model_len is None:
        from transformers import AutoConfig
        max_model_len = default_max_model_len(AutoConfig.from_pretrained(known.model, local_files_only=True), None)
        args += ["--max-model-len", str(max_model_len)]
    sized = known.kv_cache_memory_bytes or known.gpu_memory_utilization or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if not sized:
        spec = _json_object(known.speculative_config, "--speculative-config") if known.speculative_config else None
        torch_dtype = getattr(torch, "float32" if dtype == "auto" else dtype)
        num_bytes = kv_cache_bytes(known.model, drafter_folder(spec), known.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS,
                                   max_model_len, torch_dtype)
        args += ["--kv-cache-memory-bytes", str(num_bytes)]
    return args


def _parser() -> argparse.ArgumentParser:
    """The vLLM flags the launcher reads (everything else passes through untouched)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--model", "--speculative-config", "--additional-config", "--dtype", *REQUIRED, *ADDED):
        parser.add_argument(flag)
    for flag in ("--max-model-len", "--max-num-seqs", "--kv-cache-memory-bytes"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    return parser


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
