"""Processed sampling distributions, shared by drafters, verification and the trainer-facing logprobs.

"Processed" means temperature, then top-k, then top-p, applied to raw logits in that order (vLLM's order).
Drafter (q) and target (p) distributions go through this one function so that verification compares like
with like, and the logprobs handed to trainers are those of the distribution the tokens were sampled from.

Temperature 0 means greedy: the emitted token is the argmax, and its reported logprob is taken from the
unscaled distribution (temperature 1, top-k/top-p still applied), as vLLM reports it. So is any temperature below
GREEDY_TEMPERATURE (vLLM's _SAMPLING_EPS): nothing divides logits by a temperature that small.
"""

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: logits / 1e-30 overflow to inf, and their softmax to NaN


@dataclass
class SamplingTensors:
    """Per-request sampling settings as tensors, one entry per request.

    temperature: [num_reqs] float, 0 (or anything below GREEDY_TEMPERATURE) = greedy.
    top_k: [num_reqs] long, -1 = off.
    top_p: [num_reqs] float in (0, 1], 1 = off.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def build(cls, temperature, top_k=None, top_p=None, device=None) -> "SamplingTensors":
        """From per-request lists (or one value per request); top_k/top_p default to off."""
        temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1)
        n = temperature.numel()
        top_k = torch.full((n,), -1) if top_k is None else torch.as_tensor(top_k)
        top_p = torch.ones(n) if top_p is None else torch.as_tensor(top_p, dtype=torch.float32)
        return cls(temperature, top_k.to(device=device, dtype=torch.long).reshape(-1),
                   top_p.to(device=device, dtype=torch.float32).reshape(-1))

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_TEMPERATURE

    def repeat_interleave(self, repeats: torch.Tensor) -> "SamplingTensors":
        """Expand per-request settings to per-position settings ([sum(repeats)])."""
        return SamplingTensors(self.temperature.repeat_interleave(repeats),
                               self.top_k.repeat_interleave(repeats), self.top_p.repeat_interleave(repeats))

    def select(self, index) -> "SamplingTensors":
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index])


def processed_logprobs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Log-probabilities of the processed distribution, -inf outside the top-k/top-p support.

    logits: [n, vocab], one row per position; sampling holds one entry per row. Returns float32 [n, vocab].
    """
    temperature = torch.where(sampling.is_greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    logits = logits.float() / temperature[:, None]
    vocab_size = logits.shape[-1]
    use_top_k = (sampling.top_k > 0) & (sampling.top_k < vocab_size)
    use_top_p = sampling.top_p < 1
    if bool(use_top_k.any()) or bool(use_top_p.any()):
        logits = logits.masked_fill(_top_k_top_p_mask(logits, sampling.top_k, sampling.top_p), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def _top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token falls outside the top-k, then outside the smallest top-p nucleus of what is left."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop_sorted = ranks[None, :] >= k[:, None]  # [n, vocab]
    probs_sorted = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    drop_sorted |= mass_before >= top_p[:, None]  # keeps the first token always: its mass_before is 0
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from unnormalised probs [n, vocab] with the given uniforms in [0, 1) [n].

    Exact: token i is drawn with probability probs[i] / sum(probs); zero-probability tokens never are.
    """
    cdf = probs.double().cumsum(dim=-1)  # float64: the running sum over a large vocabulary stays exact enough
    target = uniform.to(cdf) * cdf[:, -1]
    token = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # first token with cdf > target
    return token.clamp(max=probs.shape[-1] - 1)


def draw_uniforms(generators, wanted: list[bool], device=None) -> torch.Tensor:
    """[n] uniforms in [0, 1): one draw from generators[i] where wanted[i], 0 (and no draw) elsewhere."""
    uniform = torch.zeros(len(wanted))
    for i, (want, generator) in enumerate(zip(wanted, generators)):
        if want:
            uniform[i] = torch.rand(1, generator=generator, device=getattr(generator, "device", None))[0]
    return uniform.to(device)
