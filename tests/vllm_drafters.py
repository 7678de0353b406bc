"""A user's drafter to the project's Proposer protocol, for tests/test_vllm_proposer.py: vLLM's worker imports it
by its path ("vllm_drafters.FlakyDrafter", tests/ on the path) through the project's custom_class proposer."""

from spec import Proposal


class FlakyDrafter:
    """Drafts each request's last token k times, and raises at every FAULT_EVERY-th step (a drafter bug)."""

    FAULT_EVERY = 7

    def __init__(self, config):
        self.num_calls = 0

    def propose(self, requests, max_num_tokens) -> Proposal:
        self.num_calls += 1
        if self.num_calls % self.FAULT_EVERY == 0:
            raise RuntimeError("a drafter bug")
        drafts = [[r.token_ids[-1]] * k for r, k in zip(requests, max_num_tokens)]
        return Proposal(drafts, [[0.5] * len(d) for d in drafts])
