"""`SamplingParams`: how each completion is sampled (the names and meanings of vLLM's)."""

import math
from dataclasses import dataclass

_SEED_MIX = 1_000_003


@dataclass
class SamplingParams:
    """temperature: 0 = greedy; top_p in (0, 1]; top_k: -1 = off, else >= 1; max_tokens >= 1;
    stop_token_ids: extra ids that end a completion (EOS always does); seed: base seed of the completions'
    generators (None: the generator's seed). Stop tokens are kept in `completion_ids`, as vLLM keeps them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) \
                or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]; use 1.0 to turn it off")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be -1 (off) or an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be a list of token ids (int)")


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from integers, order-sensitive: ((parts[0] x M + parts[1]) x M + ...) mod 2^63. Every
    backend derives its per-call and per-completion seeds with it, so a seed means the same draws everywhere."""
    seed = 0
    for part in parts:
        seed = (seed * _SEED_MIX + part) % 2 ** 63
    return seed
