import math
import os

# One thread for torch in the tests and the subprocesses they start: the models are tiny, and on a machine whose
# other core is busy two OpenMP threads spin against each other (a 12-token rollout took 10 s instead of 0.15).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int, vocab_size: int = 48, num_layers: int = 2, eos_token_id=1, max_len: int = 64):
    """A random tiny Llama. initializer_range 0.3 makes its next-token distributions peaked, so greedy argmaxes
    have margins far above float32 noise and token-for-token comparisons are meaningful."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         initializer_range=0.3, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper 1e-3 quantile of chi-square(df) (z is the normal's), Wilson-Hilferty approximation: within ~1% for
    df >= 2. Statistical tests compare against it, so a correct sampler fails them with probability ~1e-3."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def draft():
    return tiny_llama(1, num_layers=1)


class FakeClock:
    """A clock (seconds) that only `advance` moves, for timing tests that assert exact seconds, not wall time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def engine_clock(monkeypatch):
    """A FakeClock that is the clock of every engine the embedded backend builds during the test."""
    import functools

    from rollout.embedded_backend import backend
    from rollout.embedded_backend.engine import Engine

    clock = FakeClock()
    monkeypatch.setattr(backend, "Engine", functools.partial(Engine, clock=clock))
    return clock


def priced(generator, clock, per_token: float, per_row: float = 0.01):
    """`generator` with each target forward advancing the engine's `clock` by per_row a row and per_token a further
    token (a draft, or a prompt's): what a step costs, set by the test."""
    forward = generator.backend.runner.forward

    def timed(slots, token_ids, num_logits):
        clock.advance(per_row * len(slots) + per_token * sum(len(ids) - 1 for ids in token_ids))
        return forward(slots, token_ids, num_logits)
    generator.backend.runner.forward = timed
    return generator
