"""`python -m rollout serve`: vLLM's OpenAI server with the settings the server backend needs (a thin launcher).

    python -m rollout serve --model FOLDER --speculative-config JSON --port 8000 --max-model-len 512 [vLLM flags]

Every vLLM flag passes through; `--model default` is the shipped target with the default config. A config of this
project's drafters becomes the form the installed vLLM runs them in (versions.py), the config itself in
--additional-config; the classes the server will import are imported here first, so a missing one fails before it
starts. Added unless given: what the client (rollout/server_backend/backend.py) relies on (processed logprobs, detailed
per-request spec-decode metrics, `--generation-config vllm`, the worker extension, dev mode), and on CPU eager mode,
float32, the model's max_model_len capped at 2048 and a KV cache sized for --max-num-seqs (engine_args.py).

Access (guard.py, vLLM's `--middleware`): the key goes to vLLM in its environment (an `--api-key` given here is moved
there, out of every argv); an empty key does not start, on any host (guard.api_keys). The launcher's own flags
`--weights-dir` and `--history-dir` (each a new private folder unless given) reach the gate in wire.FOLDERS_ENV. The
server binds 127.0.0.1 unless --host is given; another host without a key needs `--trusted-network`.

It prints the equivalent plain command (the key masked), then replaces itself with `python -m
vllm.entrypoints.openai.api_server` (the `vllm serve` CLI fails on the CPU wheel). `--dry-run` prints and exits;
`--help` lists the launcher's own flags.
"""

import argparse
import ipaddress
import json
import os
import shlex
import sys
import tempfile

import torch

from rollout.loading import default_max_model_len
from rollout.vllm_backend.engine_args import cpu_thread_binding, drafter_folder, kv_cache_bytes, speculative_config
from rollout.vllm_backend.guard import api_keys
from rollout.vllm_backend.versions import generation
from rollout.vllm_backend.wire import FAULTS_KEY, FOLDERS, FOLDERS_ENV, KEY_ENV, WORKER_EXTENSION
from spec import SpecConfig
from spec.checks import check_int
from spec.config import PROTOCOL_METHODS
from spec.drafting_host import MAX_DRAFTER_FAULTS
from spec.proposers.custom import load_class

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_DEFAULT_MAX_NUM_SEQS = 128
# Flags the client needs at these values: another value is refused (the fix is named).
REQUIRED = {"--logprobs-mode": "processed_logprobs"}
ADDED = {"--per-request-spec-decode-metrics": "detailed", "--generation-config": "vllm",
         "--worker-extension-cls": WORKER_EXTENSION, "--host": "127.0.0.1"}
GUARD = "rollout.vllm_backend.guard.ServerGuard"
LOOPBACK_NAMES = ("localhost",)


def build_command(argv: list[str], is_cpu: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """(the server's argv after `python -m SERVER_MODULE`, the environment variables it needs) for the user's
    vLLM flags `argv`. ValueError for a missing --model or a flag at a value the client cannot use;
    NotImplementedError for a config of this project's drafters that vLLM cannot run (SpecConfig.check_vllm_protocol)."""
    is_cpu = not torch.cuda.is_available() if is_cpu is None else is_cpu
    own, argv = _own_parser().parse_known_args(argv)
    known = _parser().parse_known_args(argv)[0]
    if not known.model:
        raise ValueError("rollout serve needs --model FOLDER (the target; vLLM's flag names, e.g. --model "
                         "/models/target --speculative-config '{\"method\": \"draft_model\", ...}' --port 8000)")
    for flag, value in REQUIRED.items():
        given = getattr(known, _dest(flag))
        if given is not None and given != value:
            raise ValueError(f"{flag} {given}: the server backend needs {flag} {value} (the trainer's logprobs are "
                             "the processed distribution's); drop the flag")
    keys = api_keys(known.api_key, os.environ)
    if len(keys) > 1:
        raise ValueError(f"--api-key given {len(keys)} times: rollout serve hands vLLM its key in the environment "
                         f"({KEY_ENV}), which holds one; pass one key")
    check_access(ADDED["--host"] if known.host is None else known.host, bool(keys), own.trusted_network)
    check_int("--max-drafter-faults", own.max_drafter_faults, 0)
    args, additional = _project_drafter(_default_pair(_without(argv, "--api-key"), known), known,
                                        own.max_drafter_faults)
    args += [*(["--additional-config", json.dumps(additional)] if additional else []), "--middleware", GUARD]
    for flag, value in {**REQUIRED, **ADDED}.items():
        if getattr(known, _dest(flag)) is None:
            args += [flag, value]
    if is_cpu:
        args += _cpu_defaults(known)
    env = {"VLLM_SERVER_DEV_MODE": "1",
           FOLDERS_ENV: json.dumps({name: _folder(getattr(own, name), name) for name in FOLDERS}),
           **({KEY_ENV: keys[0]} if keys else {})}
    if is_cpu and known.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(known.tensor_parallel_size)
    return args, env


def plain_command(args: list[str], env: dict[str, str]) -> str:
    """The shell command that starts the same server without this launcher (the API key masked)."""
    shown = {k: "<key>" if k == KEY_ENV else shlex.quote(v) for k, v in env.items()}
    return " ".join([*(f"{k}={v}" for k, v in shown.items()), "python", "-m", SERVER_MODULE, shlex.join(args)])


def check_access(host: str, has_key: bool, trusted_network: bool) -> None:
    """ValueError for a server that would be open to other machines: bound beyond loopback without a key."""
    if has_key or trusted_network or _is_loopback(host):
        return
    raise ValueError(f"--host {host}: a server bound beyond loopback needs an API key, or anyone who reaches its port "
                     f"can load weights into it and pause it; start it with {KEY_ENV}=<key> in the environment and "
                     f"give the trainers the same key (server_kwargs={{'api_key': ...}} or {KEY_ENV}), or pass "
                     "--trusted-network to serve without one on a network you trust")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOOPBACK_NAMES


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(_own_parser().format_help())
        return 0
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


def _project_drafter(args: list[str], known: argparse.Namespace, max_drafter_faults: int) -> tuple[list[str], dict]:
    """(args without --additional-config, the additional config): a config of this project's drafters
    (PROTOCOL_METHODS, e.g. "history") made what the installed vLLM runs (versions.py), with the config added to the
    additional config given."""
    additional = _json_object(known.additional_config or "{}", "--additional-config")
    args = _without(args, "--additional-config")
    given = _json_object(known.speculative_config, "--speculative-config") if known.speculative_config else None
    if not given or given.get("method") not in PROTOCOL_METHODS:
        return args, additional
    config = SpecConfig.from_dict(given)
    spec, drafter = speculative_config(config, None)
    for path in generation().server_imports(config):
        load_class(path)  # the server's processes import these: fail here, naming the path, not in its start-up
    known.speculative_config = json.dumps(spec)
    args = _without(args, "--speculative-config")
    return args + ["--speculative-config", known.speculative_config], {**additional, **drafter,
                                                                        FAULTS_KEY: max_drafter_faults}


def _folder(given: str | None, name: str) -> str:
    """The server's folder `name` (FOLDERS) as an absolute path: the one given (created if missing), else a new
    private temporary folder."""
    if given is None:
        return tempfile.mkdtemp(prefix=f"rollout-serve-{name.removesuffix('_dir')}-")
    os.makedirs(given, exist_ok=True)
    return os.path.abspath(given)


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
    parser.add_argument("--api-key", action="append")
    for flag in ("--max-model-len", "--max-num-seqs", "--kv-cache-memory-bytes"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    return parser


def _own_parser() -> argparse.ArgumentParser:
    """This launcher's own flags (taken out of what reaches vLLM), with the help `rollout serve --help` prints."""
    parser = argparse.ArgumentParser(
        prog="python -m rollout serve", add_help=False, allow_abbrev=False,
        usage="%(prog)s --model FOLDER [vLLM's flags] [--weights-dir DIR] [--history-dir DIR] [--trusted-network] "
              "[--max-drafter-faults N] [--dry-run]",
        description="vLLM's OpenAI server with the settings backend='server' needs. Every flag not listed here is "
                    "vLLM's and passes through (python -m vllm.entrypoints.openai.api_server --help lists them). "
                    f"The key: {KEY_ENV} in the environment (an --api-key given here is moved there, out of the "
                    "process list); an empty key does not start.")
    parser.add_argument("--weights-dir", dest="weights_dir",
                        help="where clients write the checkpoints the server loads (default: a new private folder)")
    parser.add_argument("--history-dir", dest="history_dir",
                        help="where rollout-history files are saved and loaded (default: a new private folder)")
    parser.add_argument("--trusted-network", action="store_true",
                        help="serve beyond loopback (--host) without a key. It exposes everything the server does to "
                             "anyone who reaches its port: generation, pausing and resuming the server, and loading "
                             "weights and rollout histories from its --weights-dir and --history-dir")
    parser.add_argument("--max-drafter-faults", dest="max_drafter_faults", type=int,
                        default=MAX_DRAFTER_FAULTS, help="drafter faults a run of the project's drafter tolerates "
                        f"before it stops drafting (default {MAX_DRAFTER_FAULTS}; 0: the first fails the request)")
    parser.add_argument("--dry-run", action="store_true", help="print the plain vLLM command and exit")
    return parser


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
