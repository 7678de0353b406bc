"""The history drafter with a draft model behind it (spec/proposers/hybrid.py): history drafts where they continue a
long match and expect an accepted token, the draft model's elsewhere, its forwards over those rows only."""

from spec.proposers.base import DraftRequest
from spec.proposers.draft_model import DraftModelProposer
from spec.proposers.history import HistoryStore
from spec.proposers.hybrid import MIN_MATCH_LENGTH, HybridProposer, expected_accepted
from spec.proposers.suffix import SuffixProposer

SEEN = list(range(2, 2 + MIN_MATCH_LENGTH))  # a prompt with a history
FRESH = list(range(20, 20 + MIN_MATCH_LENGTH))  # one without


def _request(req_id, group_id, prompt, output=()):
    return DraftRequest(req_id=req_id, group_id=group_id, token_ids=list(prompt) + list(output),
                        num_prompt_tokens=len(prompt))


def _hybrid(draft) -> HybridProposer:
    history = HistoryStore()
    history.add(SEEN, [40, 41, 42, 43])
    return HybridProposer(SuffixProposer(history=history), DraftModelProposer(draft, max_num_seqs=4, max_model_len=64))


def test_history_drafts_where_it_is_sure_and_the_draft_model_elsewhere(draft):
    hybrid = _hybrid(draft)
    rows = [_request(0, 0, SEEN), _request(1, 1, FRESH)]
    proposal = hybrid.propose(rows, [3, 3])
    assert proposal.token_ids[0] == [40, 41, 42]  # the seen prompt's history, in full
    alone = DraftModelProposer(draft, max_num_seqs=4, max_model_len=64).propose([rows[1]], [3])
    assert proposal.token_ids[1] == alone.token_ids[0]  # the fresh prompt: the draft model's greedy drafts
    assert [rows for rows, _ in proposal.forward_seconds] == [1, 1]  # its forwards ran over that row alone
    assert hybrid.draft.num_requests == 1  # the history row never took a draft-model slot


def test_a_short_coincidental_match_goes_to_the_draft_model(draft):
    """A prompt whose last token occurred before: the suffix trie continues it with frequency 1 from a 1-token match,
    which the hybrid does not trust."""
    hybrid = _hybrid(draft)
    prompt = [30, 31, 32, 33, 30, 31, 34, 35, 36, 30]
    suffix_only, match_lengths = SuffixProposer().propose_matched([_request(0, 0, prompt)], [2])
    assert (suffix_only.token_ids, suffix_only.confidence, match_lengths) == ([[31]], [[1.0]], [1])
    proposal = hybrid.propose([_request(0, 0, prompt)], [2])
    alone = DraftModelProposer(draft, max_num_seqs=4, max_model_len=64).propose([_request(0, 0, prompt)], [2])
    assert proposal.token_ids == alone.token_ids


def test_expected_accepted_is_the_sum_of_survivals():
    assert expected_accepted([1.0, 0.5, 0.5]) == 1.75 and expected_accepted([]) == 0.0
