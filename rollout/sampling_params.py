"""`SamplingParams`: how each completion is sampled (the names and meanings of vLLM's)."""

from dataclasses import dataclass

from spec.checks import check_int, check_number, check_token_ids, is_int
from spec.sampling import GREEDY_TEMPERATURE

_SEED_MIX = 1_000_003


@dataclass
class SamplingParams:
    """How each completion is sampled. Every field is checked on construction (ValueError naming it).

    temperature: >= 0; 0 = greedy. As in vLLM, a temperature below GREEDY_TEMPERATURE = 1e-5 (its
        _SAMPLING_EPS) is greedy too: it is stored as 0.0, so the completion is the argmax path and its logprobs
        are those reported for temperature 0 (the unscaled distribution's); nothing divides by it.
    top_p: in (0, 1]; 1.0 = off.
    top_k: -1 = off, else an integer >= 1.
    max_tokens: an integer >= 1.
    stop_token_ids: a list of extra token ids that end a completion (EOS always does); checked against the
        model's vocabulary at each call. Stop tokens are kept in `completion_ids`, as vLLM keeps them.
    seed: base seed of the completions' generators, an integer in [0, 2**63); None: the generator's seed.
    ignore_eos: as vLLM's: EOS does not end a completion (stop_token_ids still do), so each runs to max_tokens (what
        timing whole engine steps needs: rollout/step_times.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        check_number("temperature", self.temperature, ">= 0 (0 = greedy)", lambda t: t >= 0)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        check_number("top_p", self.top_p, "in (0, 1]; use 1.0 to turn it off", lambda p: 0 < p <= 1)
        if not (is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1)):
            raise ValueError(f"top_k={self.top_k!r}: must be -1 (off) or an integer >= 1")
        check_int("max_tokens", self.max_tokens, 1)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: must be a list of token ids, e.g. [2]")
            check_token_ids("stop_token_ids", self.stop_token_ids)
            self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2 ** 63 - 1, hint=" or None (the generator's seed)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: must be True or False")

    def stop_ids(self, eos_token_ids) -> set[int]:
        """The token ids that end a completion (stop_ids)."""
        return stop_ids(eos_token_ids, self.ignore_eos, self.stop_token_ids)


def stop_ids(eos_token_ids, ignore_eos: bool, stop_token_ids) -> set[int]:
    """The token ids that end a completion, for every form of sampling params (this project's and vLLM's): the
    model's EOS ids unless ignore_eos, and stop_token_ids."""
    return (set() if ignore_eos else set(eos_token_ids)) | set(stop_token_ids or ())


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from integers, order-sensitive: ((parts[0] x M + parts[1]) x M + ...) mod 2^63. Every
    backend derives its per-call and per-completion seeds with it, so a seed means the same draws everywhere."""
    seed = 0
    for part in parts:
        seed = (seed * _SEED_MIX + part) % 2 ** 63
    return seed
