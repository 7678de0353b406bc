"""The history drafter with a draft model behind it (`method: "history"` with a `model`): per request, the rollout
history's drafts where they are confident, the draft model's where they are not.

History drafts cost almost nothing and, on a prompt seen before, run long and true; on a prompt's first epoch or a
continuation none of its rollouts took, they are short or missing, and a small draft model still predicts the next
tokens. Each step the history drafter proposes for every row; a row keeps those drafts when they continue a match of
at least MIN_MATCH_LENGTH tokens (the prompt itself at an output's start, a long stretch of output later on) and
their expected accepted length (the sum over k of the product of its first k confidences: the chance each draft
survives, by the drafter's own frequencies) reaches MIN_EXPECTED_ACCEPTED; otherwise it drafts with the draft model,
which runs its forwards over those rows only. A short match is a coincidence (a digit and a newline seen in the
prompt) whose one-occurrence frequency of 1 says nothing. A row skipped by the draft model catches its cache up in its next forward (its uncached tokens
are fed then), so switching sources costs no recomputation. Verification is lossless either way (point proposals).
"""

from typing import Sequence

from spec.proposers.base import DraftRequest, Proposal
from spec.proposers.draft_model import DraftModelProposer
from spec.proposers.suffix import SuffixProposer

MIN_EXPECTED_ACCEPTED = 1.0  # history drafts are kept where they expect at least one accepted token: below it a
# draft model's greedy drafts, accepted on 83% of next tokens for the shipped pair, expect more
MIN_MATCH_LENGTH = 8  # tokens of context the history drafts continue: the shipped task's prompts are 11-31 tokens


class HybridProposer:
    """history: the model-free drafter (its `history` is the rollout history); draft: the draft-model drafter."""

    def __init__(self, history: SuffixProposer, draft: DraftModelProposer):
        if draft.draft_sample_method != "greedy":
            raise ValueError("a history drafter with a draft model needs draft_sample_method='greedy' (point "
                             "proposals from both sources); sampled drafts cannot be mixed with history's")
        self.suffix, self.draft = history, draft
        self.history = history.history
        self.runner = draft.runner  # the draft model's: drafter refresh and weight loads reach it here

    def propose(self, requests: Sequence[DraftRequest], max_num_tokens: Sequence[int]) -> Proposal:
        proposal, match_lengths = self.suffix.propose_matched(requests, max_num_tokens)
        weak = [i for i, (k, conf, n) in enumerate(zip(max_num_tokens, proposal.confidence, match_lengths))
                if k > 0 and (n < MIN_MATCH_LENGTH or expected_accepted(conf) < MIN_EXPECTED_ACCEPTED)]
        if not weak:
            return proposal
        drafted = self.draft.propose([requests[i] for i in weak], [max_num_tokens[i] for i in weak])
        for j, i in enumerate(weak):
            proposal.token_ids[i], proposal.confidence[i] = drafted.token_ids[j], drafted.confidence[j]
        proposal.forward_seconds = drafted.forward_seconds
        return proposal

    def finish(self, request: DraftRequest) -> None:
        self.suffix.finish(request)
        self.draft.finish(request)

    def release_all(self) -> None:
        self.suffix.release_all()
        self.draft.release_all()


def expected_accepted(confidence: Sequence[float]) -> float:
    """sum over k of prod_{j <= k} confidence[j]: the expected number of accepted drafts if each confidence is the
    chance its draft survives given the ones before it did."""
    total, survival = 0.0, 1.0
    for value in confidence:
        survival *= value
        total += survival
    return total
