"""Lossless verification of ragged drafts: the reference rejection sampler (`rejection_sample_method="standard"`).

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). For request r with drafts
x_1..x_k (k = k_r, 0 allowed), target distributions p_1..p_{k+1} and draft distributions q_1..q_k:

- greedy request (temperature 0): accept x_j while x_j == argmax p_j; then emit argmax p at the first
  mismatch (recovered token) or argmax p_{k+1} when all match (bonus token);
- otherwise: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a
  recovered token from norm(max(0, p_j - q_j)) and stop; when all k are accepted emit a bonus token from p_{k+1}.

Point proposals (n-gram, suffix, greedy draft model) have one-hot q: acceptance is p_j(x_j) and the recovered
token comes from p_j with x_j removed. Either way the emitted tokens follow p exactly. p and q are *processed*
distributions (spec/sampling.py); the logprob reported for each emitted token is log p at its position.
Randomness comes from each request's own generator, one call of k + 1 uniforms per step: k for the acceptance
tests, one for the emitted token (inverse-CDF sampling); greedy requests draw nothing.
"""

from dataclasses import dataclass
from typing import Sequence

import torch

from spec.sampling import SamplingTensors, draw_uniforms, inverse_cdf_sample, processed_logprobs


@dataclass
class VerifyResult:
    """Per request: the emitted tokens (accepted drafts, then one recovered or bonus token) and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    num_accepted: list[int]


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                     sampling: SamplingTensors, generators: Sequence[torch.Generator | None],
                     draft_probs: Sequence[torch.Tensor] | None = None) -> VerifyResult:
    """Verify every request's drafts against the target in one batched pass.

    target_logits: [sum(k_r + 1), vocab], request r's k_r + 1 positions contiguous, in request order.
    draft_token_ids: per request its k_r drafts. draft_probs: per request [k_r, vocab] processed q, or None
    for point proposals. sampling / generators: one entry per request.
    """
    device = target_logits.device
    num_draft_list = [len(d) for d in draft_token_ids]
    k_max = max(num_draft_list, default=0)
    num_draft = torch.tensor(num_draft_list, dtype=torch.long, device=device)  # [num_reqs]
    per_position = sampling.repeat_interleave(num_draft + 1) if k_max else sampling
    logp = processed_logprobs(target_logits, per_position)  # [num_pos, vocab]
    p = logp.exp()
    pos = _position_index(num_draft, k_max)  # [num_reqs, k_max + 1] flat row of (r, j), clamped to j <= k_r
    drafts = _pad(draft_token_ids, k_max, device)  # [num_reqs, k_max]
    q = None if draft_probs is None else _pad_probs(draft_probs, k_max, p.shape[-1])  # [num_reqs, k_max, vocab]
    is_greedy = sampling.is_greedy.tolist()
    counts = [0 if greedy else k + 1 for k, greedy in zip(num_draft_list, is_greedy)]
    uniform = draw_uniforms(generators, counts, k_max + 1, device)  # [num_reqs, k_max + 1]: k_r tests, then the token
    if k_max:
        accepted = _accept(p, logp, pos, drafts, q, num_draft, sampling.is_greedy, uniform)
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]
    else:
        num_accepted = torch.zeros_like(num_draft)

    rows = torch.arange(len(draft_token_ids), device=device)
    last_pos = pos[rows, num_accepted]  # [num_reqs] where the recovered/bonus token is emitted
    last = logp[last_pos].argmax(dim=-1)  # [num_reqs] greedy rows keep the argmax
    if not all(is_greedy):
        probs = _next_token_probs(p[last_pos], num_accepted, num_draft, drafts, q)  # [num_reqs, vocab]
        last = torch.where(sampling.is_greedy, last, inverse_cdf_sample(probs, uniform[rows, num_draft]))
    tokens = torch.cat([drafts, last[:, None]], dim=1)  # [num_reqs, k_max + 1], the last token at column a_r:
    tokens = torch.where(torch.arange(k_max + 1, device=device) == num_accepted[:, None], last[:, None], tokens)
    logprobs = logp[pos, tokens]  # [num_reqs, k_max + 1]
    lengths = (num_accepted + 1).tolist()
    return VerifyResult([t[:n] for t, n in zip(tokens.tolist(), lengths)],
                        [lp[:n] for lp, n in zip(logprobs.tolist(), lengths)], num_accepted.tolist())


def _position_index(num_draft: torch.Tensor, k_max: int) -> torch.Tensor:
    cu_num_pos = torch.cumsum(num_draft + 1, dim=0) - (num_draft + 1)  # [num_reqs] first position of each request
    j = torch.arange(k_max + 1, device=num_draft.device)
    return cu_num_pos[:, None] + torch.minimum(j[None, :], num_draft[:, None])


def _pad(rows: Sequence[Sequence[int]], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        out[r, :len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return out.to(device)


def _pad_probs(draft_probs: Sequence[torch.Tensor], width: int, vocab_size: int) -> torch.Tensor:
    """[num_reqs, k_max, vocab]; padding rows are zero."""
    out = torch.zeros(len(draft_probs), width, vocab_size, device=draft_probs[0].device if draft_probs else None)
    for r, probs in enumerate(draft_probs):
        out[r, :probs.shape[0]] = probs.float()
    return out


def _accept(p, logp, pos, drafts, q, num_draft, is_greedy, uniform) -> torch.Tensor:
    """[num_reqs, k_max] bool: draft j of request r passes its test (padding never does)."""
    k_max = drafts.shape[1]
    draft_pos = pos[:, :k_max]  # [num_reqs, k_max]
    is_valid = torch.arange(k_max, device=drafts.device)[None, :] < num_draft[:, None]
    p_drafts = p[draft_pos, drafts]  # [num_reqs, k_max] target probability of each draft
    q_drafts = torch.ones_like(p_drafts) if q is None else q.gather(2, drafts[..., None]).squeeze(2)
    accept_stochastic = uniform[:, :k_max] * q_drafts < p_drafts  # u < p/q, i.e. probability min(1, p/q)
    accept_greedy = drafts == logp[draft_pos].argmax(dim=-1)
    return torch.where(is_greedy[:, None], accept_greedy, accept_stochastic) & is_valid


def _next_token_probs(p_last, num_accepted, num_draft, drafts, q) -> torch.Tensor:
    """[num_reqs, vocab] unnormalised: p_{k+1} for a bonus token, max(0, p_j - q_j) for a recovered token."""
    is_rejected = num_accepted < num_draft  # [num_reqs]
    if not bool(is_rejected.any()):
        return p_last
    rows = torch.arange(len(num_draft), device=p_last.device)
    j = num_accepted.clamp(max=max(drafts.shape[1] - 1, 0))
    if q is None:  # point proposals: q is one-hot at the rejected draft
        q_last = torch.zeros_like(p_last)
        q_last[rows, drafts[rows, j]] = 1.0
    else:
        q_last = q[rows, j]
    residual = torch.clamp(p_last - q_last, min=0)
    # The residual is all zero only when p_j == q_j, where rejection has probability 0; guard float error.
    use_residual = is_rejected & (residual.sum(dim=-1) > 0)
    return torch.where(use_residual[:, None], residual, p_last)
