import itertools
import random

import pytest

from spec.proposers.base import DraftRequest
from spec.proposers.ngram import NgramProposer
from spec.proposers.suffix import MATCH_EVIDENCE, SuffixProposer
from spec.proposers.suffix_tree import SuffixTree
from trie_reference import brute_force_match, substring_counts


def _request(req_id, group_id, prompt, output=()):
    return DraftRequest(req_id=req_id, group_id=group_id, token_ids=list(prompt) + list(output),
                        num_prompt_tokens=len(prompt))


def _snapshot(trie):
    return trie.substring_counts()


def _weighed(frequencies, match_length):
    """The confidences of drafts with these frequencies continuing a match of match_length tokens."""
    return pytest.approx([f * match_length / (match_length + MATCH_EVIDENCE) for f in frequencies])


def _propose_one(proposer, request, k):
    proposal = proposer.propose([request], [k])
    return proposal.token_ids[0], proposal.confidence[0]


# --- the trie ---

def test_trie_counts_by_hand():
    trie = SuffixTree(max_depth=3)
    trie.add(0, [1, 2, 1, 2])
    assert _snapshot(trie) == {(): 4, (1,): 2, (2,): 2, (1, 2): 2, (2, 1): 1, (1, 2, 1): 1, (2, 1, 2): 1}
    trie.add(1, [2, 1, 3])
    assert _snapshot(trie) == {(): 7, (1,): 3, (2,): 3, (3,): 1, (1, 2): 2, (2, 1): 2, (1, 3): 1,
                               (1, 2, 1): 1, (2, 1, 2): 1, (2, 1, 3): 1}
    assert trie.count([2, 1]) == 2 and trie.count([1, 2, 1, 2]) == 0 and trie.count([9]) == 0


def test_incremental_appends_equal_one_insert():
    whole, pieces = SuffixTree(max_depth=4), SuffixTree(max_depth=4)
    whole.add(3, [5, 6, 5, 6, 5, 7, 5])
    pieces.add(3, [5, 6])
    pieces.extend(3, [5])
    pieces.extend(3, [6, 5, 7])
    pieces.extend(3, [5])
    assert _snapshot(pieces) == _snapshot(whole)
    assert pieces.sequence(3) == [5, 6, 5, 6, 5, 7, 5]


def test_counts_match_brute_force_on_random_sequences():
    rng = random.Random(0)
    trie, seqs = SuffixTree(max_depth=5), {}
    for seq_id in range(20):
        seqs[seq_id] = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        trie.add(seq_id, seqs[seq_id][:5])
        trie.extend(seq_id, seqs[seq_id][5:])
    for seq_id in rng.sample(sorted(seqs), 12):
        trie.remove(seq_id)
        del seqs[seq_id]
    assert _snapshot(trie) == substring_counts([(seq, 1) for seq in seqs.values()], 5)
    assert trie.num_seqs == 8


def test_remove_restores_exact_previous_state():
    trie = SuffixTree(max_depth=3)
    trie.add(0, [1, 2, 3, 1, 2])
    before = _snapshot(trie)
    trie.add(1, [2, 3, 1])
    trie.extend(1, [2, 9, 9, 9])
    trie.remove(1)
    assert _snapshot(trie) == before  # also: no zero-count node is left behind
    assert trie.num_nodes == len(before)
    trie.remove(0)
    assert _snapshot(trie) == {(): 0}
    assert 0 not in trie and 1 not in trie


def test_extend_to_appends_only_a_continuation():
    trie = SuffixTree(max_depth=3)
    trie.add(0, [1, 2, 3])
    assert trie.extend_to(0, [1, 2, 3, 4, 5]) and trie.sequence(0) == [1, 2, 3, 4, 5]
    before = _snapshot(trie)
    assert not trie.extend_to(0, [1, 2, 3, 9, 5, 6])  # its last tokens differ: a rewrite, not a continuation
    assert not trie.extend_to(0, [1, 2, 3])  # shorter
    assert _snapshot(trie) == before and trie.sequence(0) == [1, 2, 3, 4, 5]


def test_add_twice_raises():
    trie = SuffixTree(max_depth=3)
    trie.add(0, [1])
    with pytest.raises(ValueError, match="already in the trie"):
        trie.add(0, [2])


def test_match_does_not_count_the_context_tail_as_evidence():
    trie = SuffixTree(max_depth=24)
    trie.add(0, [1, 2, 3, 1, 2])  # the querying sequence itself: [1, 2] occurs at 0 (-> 3) and at its own end
    assert trie.match([1, 2, 3, 1, 2], max_tokens=8, min_token_prob=0.1) == ([3, 1, 2], [1.0, 1.0, 1.0], 2)


def test_match_frequencies_and_tie_break():
    trie = SuffixTree(max_depth=4)
    trie.add(0, [1, 5, 1, 4, 1, 5, 1])
    assert trie.match([0, 1], 1, 0.0) == ([5], [2 / 3], 1)
    trie.add(1, [8, 1, 4])  # now 5 and 4 follow [1] twice each: the smaller id wins
    assert trie.match([0, 1], 1, 0.0) == ([4], [0.5], 1)


def test_match_cut_by_min_token_prob():
    trie = SuffixTree(max_depth=4)
    trie.add(0, [1, 5, 1, 4, 1, 5])
    assert trie.match([1], 3, min_token_prob=0.7) == ([], [], 1)
    assert trie.match([1], 3, min_token_prob=0.6) == ([5, 1, 4], [2 / 3, 1.0, 1.0], 1)


def test_match_continues_past_max_depth():
    trie = SuffixTree(max_depth=3)
    trie.add(0, [1, 2, 3, 4, 5, 6])
    assert trie.match([1, 2], 10, 0.1) == ([3, 4, 5, 6], [1.0] * 4, 2)
    assert trie.match([9, 9], 10, 0.1) == ([], [], 0)


def test_match_equals_brute_force_on_random_sequences():
    rng = random.Random(2)
    for _ in range(40):
        max_depth, vocab = rng.randrange(2, 6), rng.randrange(1, 4)
        trie, seqs = SuffixTree(max_depth), {}
        for seq_id in range(rng.randrange(1, 8)):
            seqs[seq_id] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
            trie.add(seq_id, seqs[seq_id])
        for seq_id in rng.sample(sorted(seqs), len(seqs) // 3):
            trie.remove(seq_id)
            del seqs[seq_id]
        for _ in range(5):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
            k, min_prob = rng.randrange(0, 7), rng.choice([0.0, 0.3, 0.6])
            drafts, probs, length = trie.match(context, k, min_prob)
            counts = substring_counts([(seq, 1) for seq in seqs.values()], max_depth)
            assert (drafts, probs, length) == brute_force_match(counts, context, max_depth, k, min_prob)


def test_match_sequence_equals_match_of_its_tokens():
    rng = random.Random(1)
    trie = SuffixTree(max_depth=4)
    seqs = {seq_id: [rng.randrange(3) for _ in range(rng.randrange(0, 12))] for seq_id in range(6)}
    for seq_id, seq in seqs.items():
        trie.add(seq_id, seq[:3])
    for seq_id, seq in seqs.items():
        trie.extend(seq_id, seq[3:])
        for probe in seqs:  # every sequence's tail, whatever was appended since
            assert trie.match_sequence(probe, 6, 0.2) == trie.match(trie.sequence(probe), 6, 0.2)


# --- the proposer ---

def test_drafts_from_own_prompt():
    request = _request(0, 0, prompt=[1, 2, 3, 4, 5, 9], output=[1, 2])
    assert _propose_one(SuffixProposer(), request, 2) == ([3, 4], _weighed([1.0, 1.0], 2))


def test_max_spec_factor_caps_by_match_length():
    request = _request(0, 0, prompt=[1, 2, 3, 4, 5, 9], output=[1, 2])  # match_length 2
    assert _propose_one(SuffixProposer(max_spec_factor=1.0), request, 5)[0] == [3, 4]
    assert _propose_one(SuffixProposer(max_spec_factor=0.5), request, 5)[0] == [3]
    assert _propose_one(SuffixProposer(max_spec_factor=2.0), request, 5)[0] == [3, 4, 5, 9]
    assert _propose_one(SuffixProposer(max_spec_factor=2.5), request, 5)[0] == [3, 4, 5, 9, 1]
    assert _propose_one(SuffixProposer(max_spec_factor=0.0), request, 5)[0] == []


def test_drafts_from_sibling_output():
    proposer = SuffixProposer()
    done_more = _request(0, 7, prompt=[1, 2, 3], output=[4, 5, 6, 7])
    behind = _request(1, 7, prompt=[1, 2, 3], output=[4, 5])
    other_group = _request(2, 8, prompt=[1, 2, 3], output=[4, 5])
    proposal = proposer.propose([behind, done_more, other_group], [3, 3, 3])
    assert proposal.token_ids == [[6, 7], [], []]
    assert proposal.confidence == [_weighed([1.0, 1.0], 5), [], []]  # [1, 2, 3, 4, 5] matched


def test_finished_sibling_stays_visible_until_group_empties():
    proposer = SuffixProposer(max_cached_requests=0)
    first, second = _request(0, 5, [1, 2], [3]), _request(1, 5, [1, 2])
    proposer.propose([first, second], [2, 2])
    proposer.finish(_request(0, 5, [1, 2], [3, 4, 5, 6]))  # its last tokens were never proposed from
    assert _propose_one(proposer, _request(1, 5, [1, 2], [3, 4, 5]), 2) == ([6], _weighed([1.0], 5))
    assert proposer.num_groups == 1
    proposer.finish(_request(1, 5, [1, 2], [3, 4, 5, 8]))
    assert proposer.num_groups == 0 and proposer.num_cached_requests == 0


def test_drafts_from_global_cache_after_finish():
    proposer = SuffixProposer()
    finished = _request(0, 1, prompt=[1, 2, 3], output=[4, 5, 6, 7])
    proposer.propose([finished], [2])
    proposer.finish(finished)
    assert proposer.num_groups == 0 and proposer.num_cached_requests == 1
    assert _propose_one(proposer, _request(1, 2, [9, 9], [4, 5]), 3) == ([6, 7], _weighed([1.0, 1.0], 2))
    assert _propose_one(proposer, _request(2, 3, [8], [1, 2]), 3) == ([], [])  # prompts are not cached


def test_fifo_eviction_at_max_cached_requests():
    proposer = SuffixProposer(max_cached_requests=2)
    proposer.finish(_request(0, 10, [0], [10, 11]))
    proposer.finish(_request(1, 11, [0], [20, 21]))
    assert _propose_one(proposer, _request(9, 99, [0], [10]), 2)[0] == [11]
    proposer.finish(_request(2, 12, [0], [30, 31]))
    assert proposer.num_cached_requests == 2
    assert _propose_one(proposer, _request(10, 100, [0], [10]), 2)[0] == []
    assert _propose_one(proposer, _request(11, 101, [0], [20]), 2)[0] == [21]
    assert _propose_one(proposer, _request(12, 102, [0], [30]), 2)[0] == [31]


def test_max_cached_requests_zero_disables_global_cache():
    proposer = SuffixProposer(max_cached_requests=0)
    proposer.finish(_request(0, 10, [0], [10, 11]))
    assert proposer.num_cached_requests == 0
    assert _propose_one(proposer, _request(1, 11, [0], [10]), 2) == ([], [])


def test_min_token_prob_cuts_speculation():
    request = _request(0, 0, prompt=[5, 1, 2, 6, 1, 3, 7, 1, 2, 8], output=[9, 1])  # [1] -> 2, 3, 2
    assert _propose_one(SuffixProposer(min_token_prob=0.7), request, 3) == ([], [])
    drafts, confidence = _propose_one(SuffixProposer(min_token_prob=0.6), request, 3)
    assert drafts == [2] and confidence == _weighed([2 / 3], 1)


def test_higher_score_wins_and_ties_go_to_group_trie():
    proposer = SuffixProposer()
    proposer.finish(_request(0, 1, [0], [4, 5, 8]))  # global: [4, 5] -> 8
    tied = _request(1, 2, prompt=[4, 5, 6, 0], output=[4, 5])  # group: [4, 5] -> 6, 0
    assert _propose_one(proposer, tied, 1) == ([6], _weighed([1.0], 2))
    assert _propose_one(proposer, tied, 2) == ([6, 0], _weighed([1.0, 1.0], 2))
    split = _request(2, 3, prompt=[4, 5, 6, 1, 4, 5, 7, 2], output=[4, 5])  # group: [4, 5] -> 6 or 7
    assert _propose_one(proposer, split, 1) == ([8], _weighed([1.0], 2))


def test_speculation_continues_past_max_tree_depth():
    proposer = SuffixProposer(max_tree_depth=3, max_spec_factor=3.0)
    request = _request(0, 0, prompt=[1, 2, 3, 4, 5, 6, 7], output=[1, 2])
    assert _propose_one(proposer, request, 5) == ([3, 4, 5, 6, 7], _weighed([1.0] * 5, 2))


def test_rewritten_token_ids_raise():
    proposer = SuffixProposer()
    proposer.propose([_request(0, 0, [1, 2, 3])], [2])
    with pytest.raises(ValueError, match="no longer start"):
        proposer.propose([_request(0, 0, [1, 9, 3, 4])], [2])


def test_bad_config_raises():
    for kwargs, name in [({"max_tree_depth": 1}, "max_tree_depth"), ({"max_cached_requests": -1}, "cached"),
                         ({"max_spec_factor": -0.5}, "spec_factor"), ({"min_token_prob": 1.5}, "min_token_prob")]:
        with pytest.raises(ValueError, match=name):
            SuffixProposer(**kwargs)


def test_random_rollout_proposals_validate():
    rng = random.Random(2)
    suffix, ngram = SuffixProposer(max_tree_depth=6, max_cached_requests=3), NgramProposer(1, 3)
    prompts = {group_id: [rng.randrange(6) for _ in range(8)] for group_id in range(3)}
    requests = [_request(i, i % 3, prompts[i % 3]) for i in range(9)]
    num_drafts = 0
    for step in range(30):
        for request in requests:
            request.token_ids.append(rng.randrange(6))
        max_num_tokens = [rng.randrange(0, 5) for _ in requests]
        for proposer, name in [(suffix, "suffix"), (ngram, "ngram")]:
            proposal = proposer.propose(requests, max_num_tokens)
            proposal.validate(max_num_tokens, name)
            assert all(c > 0 for conf in proposal.confidence for c in conf)
            num_drafts += sum(proposal.num_draft_tokens)
        if step % 10 == 9:
            suffix.finish(requests.pop(0))
    assert num_drafts > 0
    assert suffix.num_cached_requests == 3 and suffix.num_groups == 3


# --- the global cache's token bound ---

def test_token_bound_evicts_oldest_first():
    proposer = SuffixProposer(max_cached_tokens=5)
    for req_id, output in enumerate(([10, 11], [20, 21], [30, 31])):
        proposer.finish(_request(req_id, req_id, [0], output))
    assert proposer.num_cached_requests == 2 and proposer.num_cached_tokens == 4  # 6 tokens > 5: the first went
    assert _propose_one(proposer, _request(9, 99, [0], [10]), 2)[0] == []
    assert _propose_one(proposer, _request(10, 100, [0], [20]), 2)[0] == [21]
    assert _propose_one(proposer, _request(11, 101, [0], [30]), 2)[0] == [31]
    proposer.finish(_request(12, 102, [0], [40, 41, 42, 43]))  # 8 tokens: both older outputs go
    assert proposer.num_cached_requests == 1 and proposer.num_cached_tokens == 4


def test_an_output_longer_than_the_token_bound_is_not_cached():
    proposer = SuffixProposer(max_cached_tokens=3)
    proposer.finish(_request(0, 0, [0], [10, 11]))
    proposer.finish(_request(1, 1, [0], [20, 21, 22, 23]))
    assert proposer.num_cached_requests == 1 and proposer.num_cached_tokens == 2


def test_both_bounds_apply():
    proposer = SuffixProposer(max_cached_requests=2, max_cached_tokens=100)
    for req_id in range(4):
        proposer.finish(_request(req_id, req_id, [0], [req_id, req_id + 1]))
    assert proposer.num_cached_requests == 2 and proposer.num_cached_tokens == 4


def test_cache_stays_within_its_token_bound_over_repeated_calls():
    """Long completions call after call: the cache and its trie stop growing at the token bound (before the bound,
    the request bound alone let them grow by every call's tokens)."""
    rng = random.Random(3)
    max_tokens, depth = 3000, 8
    proposer = SuffixProposer(max_tree_depth=depth, max_cached_tokens=max_tokens)
    trie_sizes, req_ids = [], itertools.count()
    for _ in range(20):  # calls
        for group_id in range(8):
            prompt = [rng.randrange(50) for _ in range(8)]
            for _ in range(2):
                request = _request(next(req_ids), group_id, prompt, [rng.randrange(50) for _ in range(300)])
                proposer.propose([request], [3])
                proposer.finish(request)
                assert proposer.num_cached_tokens <= max_tokens
        trie_sizes.append(proposer.num_cached_nodes)
    assert max(trie_sizes) <= 1 + max_tokens * depth
    assert max(trie_sizes[5:]) <= 1.1 * trie_sizes[4]  # flat once the bound is reached (call 2 on)
