"""Lossless verification of ragged drafts: the reference rejection sampler (`rejection_sample_method="standard"`).

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). For request r with drafts x_1..x_k
(k = k_r, 0 allowed), target distributions p_1..p_{k+1} and draft distributions q_1..q_k:

- greedy request (temperature 0): accept x_j while x_j == argmax p_j; then emit argmax p at the first
  mismatch (recovered token) or argmax p_{k+1} when all match (bonus token);
- otherwise: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a
  recovered token from norm(max(0, p_j - q_j)) and stop; when all k are accepted emit a bonus token from p_{k+1}.

Either way the emitted tokens follow p exactly. p and q are *processed* distributions (spec/sampling.py); the logprob
reported for each emitted token is log p at its position.

Randomness: a pair of uniforms per position, fixed by the request's output position (spec/uniforms.py). For point
proposals (n-gram, suffix, greedy draft model: q one-hot at the draft) one inverse-CDF draw from p_j with the token
uniform gives t_j; x_j is accepted iff x_j == t_j (probability p_j(x_j)), and a rejected position emits t_j (which then
follows p_j without x_j): seeded speculative sampling emits what seeded plain sampling does, token for token, whatever
the drafts. Probabilistic drafts test u < p/q with the test uniform and draw the recovered or bonus token with the token
uniform.
"""

from dataclasses import dataclass
from typing import Sequence

import torch

from spec.sampling import SamplingTensors, inverse_cdf_sample, processed_logprobs


@dataclass
class VerifyResult:
    """Per request: the emitted tokens (accepted drafts, then one recovered or bonus token) and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    num_accepted: list[int]


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                     sampling: SamplingTensors, uniforms: torch.Tensor,
                     draft_probs: Sequence[torch.Tensor] | None = None) -> VerifyResult:
    """Verify every request's drafts against the target in one batched pass.

    target_logits: [sum(k_r + 1), vocab], request r's k_r + 1 positions contiguous, in request order.
    draft_token_ids: per request its k_r drafts. draft_probs: per request [k_r, vocab] processed q, or None
    for point proposals. sampling: one entry per request. uniforms: [sum(k_r + 1), 2], each position's token and
    test uniforms (spec/uniforms.py; greedy requests read none).
    """
    device = target_logits.device
    num_draft_list = [len(d) for d in draft_token_ids]
    k_max = max(num_draft_list, default=0)
    num_draft = torch.tensor(num_draft_list, dtype=torch.long, device=device)  # [num_reqs]
    per_position = sampling.repeat_interleave(num_draft + 1) if k_max else sampling
    logp = processed_logprobs(target_logits, per_position)  # [num_pos, vocab]
    p = logp.exp()
    uniforms = uniforms.to(device)
    pos = _position_index(num_draft, k_max)  # [num_reqs, k_max + 1] flat row of (r, j), clamped to j <= k_r
    drafts = _pad(draft_token_ids, k_max, device)  # [num_reqs, k_max]
    is_valid = torch.arange(k_max, device=device)[None, :] < num_draft[:, None]  # [num_reqs, k_max]
    if draft_probs is None or not k_max:  # one draw per position decides the test and the token (above)
        drawn = logp.argmax(dim=-1)  # [num_pos]
        if not bool(per_position.is_greedy.all()):
            drawn = torch.where(per_position.is_greedy, drawn, inverse_cdf_sample(p, uniforms[:, 0]))
        tokens = drawn[pos]  # [num_reqs, k_max + 1]: the drafts up to the first mismatch, then the emitted token
        num_accepted = ((tokens[:, :k_max] == drafts) & is_valid).long().cumprod(dim=1).sum(dim=1)
    else:
        q = _pad_probs(draft_probs, k_max, p.shape[-1])  # [num_reqs, k_max, vocab]
        accepted = _accept(p, logp, pos, drafts, q, sampling.is_greedy, uniforms[pos[:, :k_max], 1]) & is_valid
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]
        rows = torch.arange(len(draft_token_ids), device=device)
        last_pos = pos[rows, num_accepted]  # [num_reqs] where the recovered/bonus token is emitted
        last = logp[last_pos].argmax(dim=-1)  # [num_reqs] greedy rows keep the argmax
        if not bool(sampling.is_greedy.all()):
            probs = _next_token_probs(p[last_pos], num_accepted, num_draft, drafts, q)  # [num_reqs, vocab]
            last = torch.where(sampling.is_greedy, last, inverse_cdf_sample(probs, uniforms[last_pos, 0]))
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


def _accept(p, logp, pos, drafts, q, is_greedy, uniform) -> torch.Tensor:
    """[num_reqs, k_max] bool: draft j of request r passes its test (padding is masked by the caller)."""
    draft_pos = pos[:, :drafts.shape[1]]  # [num_reqs, k_max]
    p_drafts = p[draft_pos, drafts]  # [num_reqs, k_max] target probability of each draft
    q_drafts = q.gather(2, drafts[..., None]).squeeze(2)
    accept_stochastic = uniform * q_drafts < p_drafts  # u < p/q, i.e. probability min(1, p/q)
    accept_greedy = drafts == logp[draft_pos].argmax(dim=-1)
    return torch.where(is_greedy[:, None], accept_greedy, accept_stochastic)


def _next_token_probs(p_last, num_accepted, num_draft, drafts, q) -> torch.Tensor:
    """[num_reqs, vocab] unnormalised: p_{k+1} for a bonus token, max(0, p_j - q_j) for a recovered token."""
    is_rejected = num_accepted < num_draft  # [num_reqs]
    if not bool(is_rejected.any()):
        return p_last
    rows = torch.arange(len(num_draft), device=p_last.device)
    q_last = q[rows, num_accepted.clamp(max=max(drafts.shape[1] - 1, 0))]
    residual = torch.clamp(p_last - q_last, min=0)
    # The residual is all zero only when p_j == q_j, where rejection has probability 0; guard float error.
    use_residual = is_rejected & (residual.sum(dim=-1) > 0)
    return torch.where(use_residual[:, None], residual, p_last)
