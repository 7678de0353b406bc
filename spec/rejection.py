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
Randomness is drawn from each request's own generator: k uniforms, then one categorical draw; greedy requests
draw nothing.
"""

from dataclasses import dataclass
from typing import Sequence

import torch

from spec.sampling import SamplingTensors, processed_logprobs, sample


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
    num_draft = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.long)  # [num_reqs]
    logp = processed_logprobs(target_logits, sampling.repeat_interleave(num_draft + 1))  # [num_pos, vocab]
    p = logp.exp()
    pos = _position_index(num_draft)  # [num_reqs, k_max + 1] flat row of (r, j), clamped to j <= k_r
    drafts = _pad(draft_token_ids, pos.shape[1] - 1)  # [num_reqs, k_max]
    q_drafts = _draft_prob_of_drafts(draft_probs, drafts)  # [num_reqs, k_max]
    accepted = _accept(p, logp, pos, drafts, q_drafts, num_draft, sampling.is_greedy, generators)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]

    token_ids, logprobs = [], []
    for r, generator in enumerate(generators):
        k, a = int(num_draft[r]), int(num_accepted[r])
        row = int(pos[r, a])
        if bool(sampling.is_greedy[r]):
            last = int(logp[row].argmax())
        else:
            last = sample(_next_token_probs(p[row], a, k, drafts[r], draft_probs, r), generator)
        tokens = drafts[r, :a].tolist() + [last]
        token_ids.append(tokens)
        logprobs.append(logp[pos[r, :a + 1], tokens].tolist())
    return VerifyResult(token_ids, logprobs, num_accepted.tolist())


def _position_index(num_draft: torch.Tensor) -> torch.Tensor:
    cu_num_pos = torch.cumsum(num_draft + 1, dim=0) - (num_draft + 1)  # [num_reqs] first position of each request
    k_max = int(num_draft.max()) if num_draft.numel() else 0
    j = torch.arange(k_max + 1)
    return cu_num_pos[:, None] + torch.minimum(j[None, :], num_draft[:, None])


def _pad(rows: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        out[r, :len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return out


def _draft_prob_of_drafts(draft_probs, drafts: torch.Tensor) -> torch.Tensor:
    """q_j(x_j) for every padded draft slot; 1 for point proposals and padding."""
    q = torch.ones(drafts.shape, dtype=torch.float32)
    if draft_probs is not None:
        for r, probs in enumerate(draft_probs):
            k = probs.shape[0]
            q[r, :k] = probs.float().gather(1, drafts[r, :k, None]).squeeze(1)
    return q


def _accept(p, logp, pos, drafts, q_drafts, num_draft, is_greedy, generators) -> torch.Tensor:
    """[num_reqs, k_max] bool: draft j of request r passes its test (padding never does)."""
    k_max = drafts.shape[1]
    draft_pos = pos[:, :k_max]  # [num_reqs, k_max]
    is_valid = torch.arange(k_max)[None, :] < num_draft[:, None]
    p_drafts = p[draft_pos, drafts]  # [num_reqs, k_max] target probability of each draft
    uniform = torch.ones(drafts.shape)
    for r, generator in enumerate(generators):
        if not bool(is_greedy[r]) and int(num_draft[r]) > 0:
            uniform[r, :int(num_draft[r])] = torch.rand(int(num_draft[r]), generator=generator)
    accept_stochastic = uniform * q_drafts < p_drafts  # u < p/q, i.e. probability min(1, p/q)
    accept_greedy = drafts == logp[draft_pos].argmax(dim=-1)
    return torch.where(is_greedy[:, None], accept_greedy, accept_stochastic) & is_valid


def _next_token_probs(p_row, num_accepted: int, num_draft: int, drafts_row, draft_probs, r: int) -> torch.Tensor:
    """p_{k+1} for a bonus token; norm(max(0, p_j - q_j)) (unnormalised) for a recovered token."""
    if num_accepted == num_draft:
        return p_row
    if draft_probs is None:
        q_row = torch.zeros_like(p_row)
        q_row[drafts_row[num_accepted]] = 1.0
    else:
        q_row = draft_probs[r][num_accepted].float()
    residual = torch.clamp(p_row - q_row, min=0)
    # The residual is all zero only when p_j == q_j, where rejection has probability 0; guard float error.
    return residual if float(residual.sum()) > 0 else p_row
