import random

import pytest

from spec.proposers.base import DraftRequest
from spec.proposers.ngram import NgramProposer


def _request(token_ids, req_id=0):
    return DraftRequest(req_id=req_id, group_id=0, token_ids=list(token_ids), num_prompt_tokens=1)


def _reference(context, min_n, max_n, k):
    """The docstring's rule, written as loops."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(context) or k == 0:
            continue
        pattern = context[-n:]
        starts = [i for i in range(len(context) - n) if context[i:i + n] == pattern]
        if not starts:
            continue
        drafts = context[starts[-1] + n:starts[-1] + n + k]
        confidence, agreeing = [], starts
        for j, token in enumerate(drafts):
            eligible = [i for i in agreeing if i + n + j < len(context)]
            agreeing = [i for i in eligible if context[i + n + j] == token]
            confidence.append(len(agreeing) / len(eligible))
        return drafts, confidence
    return [], []


def test_longest_n_wins():
    context = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]  # [1, 2, 3] -> 9 once; [2, 3] -> 8 most recently
    assert NgramProposer(1, 3).propose_one(context, 2) == ([9, 5], [1.0, 1.0])


def test_most_recent_occurrence_wins():
    context = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]  # [2, 3] occurs at 1 (-> 9) and at 5 (-> 8)
    assert NgramProposer(1, 2).propose_one(context, 2) == ([8, 1], [0.5, 1.0])


def test_truncated_at_end_of_context():
    assert NgramProposer(2, 2).propose_one([1, 2, 3, 1, 2], 5) == ([3, 1, 2], [1.0, 1.0, 1.0])


def test_suffix_itself_is_not_an_occurrence():
    # [7, 7, 7] occurs only at 0 besides the suffix, with one continuation token left
    assert NgramProposer(3, 3).propose_one([7, 7, 7, 7], 3) == ([7], [1.0])


def test_n_at_least_context_length_is_skipped():
    assert NgramProposer(1, 5).propose_one([5, 5], 3) == ([5], [1.0])
    assert NgramProposer(2, 5).propose_one([5, 5], 3) == ([], [])


def test_k_zero_gives_no_drafts():
    assert NgramProposer(1, 3).propose_one([1, 2, 1, 2], 0) == ([], [])


def test_no_match_gives_no_drafts():
    assert NgramProposer(1, 3).propose_one([1, 2, 3, 4], 4) == ([], [])
    assert NgramProposer(1, 3).propose_one([], 4) == ([], [])
    assert NgramProposer(1, 3).propose_one([1], 4) == ([], [])


def test_prompt_lookup_min_respected():
    context = [1, 2, 3, 9, 3]  # only the 1-gram [3] recurs
    assert NgramProposer(2, 3).propose_one(context, 3) == ([], [])
    assert NgramProposer(1, 3).propose_one(context, 3) == ([9, 3], [1.0, 1.0])


def test_confidence_of_two_occurrences_that_diverge():
    # [4, 5] occurs at 0 (-> 1, 2) and at 4 (-> 1, 3, ...): both agree on 1, then split on 3
    context = [4, 5, 1, 2, 4, 5, 1, 3, 4, 5]
    assert NgramProposer(2, 2).propose_one(context, 3) == ([1, 3, 4], [1.0, 0.5, 1.0])


def test_confidence_is_conditional_on_earlier_drafts():
    # [3] occurs at 0 (-> 9, 2), 3 (-> 1, 5), 6 (-> 1, 2, 3); the occurrence at 0 disagrees on the first draft,
    # so its agreeing second token does not count
    drafts, confidence = NgramProposer(1, 1).propose_one([3, 9, 2, 3, 1, 5, 3, 1, 2, 3], 3)
    assert drafts == [1, 2, 3]
    assert confidence == pytest.approx([2 / 3, 1 / 2, 1.0])


def test_matches_reference_on_random_contexts():
    rng = random.Random(0)
    for _ in range(300):
        context = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randrange(0, 6)
        assert NgramProposer(min_n, max_n).propose_one(context, k) == _reference(context, min_n, max_n, k)


def test_batch_proposal_validates():
    rng = random.Random(1)
    requests = [_request([rng.randrange(5) for _ in range(rng.randrange(1, 60))], i) for i in range(16)]
    max_num_tokens = [rng.randrange(0, 6) for _ in requests]
    proposal = NgramProposer(1, 4).propose(requests, max_num_tokens)
    proposal.validate(max_num_tokens, "ngram")
    assert proposal.draft_probs is None
    assert proposal.token_ids == [NgramProposer(1, 4).propose_one(r.token_ids, k)[0]
                                  for r, k in zip(requests, max_num_tokens)]
    assert sum(proposal.num_draft_tokens) > 0


def test_bad_config_raises():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 3)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer(3, 2)
