"""DraftModelProposer on tiny random models: drafts, rollback, sampling, prefix sharing, limits."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from conftest import FakeClock
from spec.model_runner import PaddedRunner, RaggedRunner
from spec.proposers import draft_model
from spec.proposers.base import DraftRequest
from spec.proposers.draft_model import DraftModelProposer

VOCAB = 97


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128)).eval()


@pytest.fixture(scope="module")
def model():
    return _llama()


def _tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(req_id, token_ids, group_id=None, **sampling):
    return DraftRequest(req_id=req_id, group_id=req_id if group_id is None else group_id, token_ids=list(token_ids),
                        num_prompt_tokens=len(token_ids), **sampling)


def _greedy(model, token_ids, k):
    """The model's own greedy continuation: k argmax steps of full HF forwards."""
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids):]


def _count_forwards(proposer):
    """Wrap runner.forward; the returned list collects (slots, num_new_tokens) of every call."""
    calls, forward = [], proposer.runner.forward

    def counting(slots, token_ids, num_logits):
        calls.append((list(slots), [len(t) for t in token_ids]))
        return forward(slots, token_ids, num_logits)

    proposer.runner.forward = counting
    return calls


def _commit(request, drafts, num_accepted, extra_token):
    """What verification appends: the accepted drafts, then a recovered/bonus token."""
    request.token_ids += drafts[:num_accepted] + [extra_token]


def test_greedy_drafts_follow_the_models_greedy_continuation_across_rollbacks(model):
    proposer = DraftModelProposer(model, max_num_seqs=4, max_model_len=64)
    assert isinstance(proposer.runner, RaggedRunner)
    requests = [_request(0, _tokens(6, 0)), _request(1, _tokens(3, 1)), _request(2, _tokens(9, 2))]
    for step, ks in enumerate([[4, 2, 3], [3, 4, 1], [2, 2, 2]]):
        proposal = proposer.propose(requests, ks)
        proposal.validate(ks, "draft_model")
        assert proposal.draft_probs is None
        for request, drafts, k in zip(requests, proposal.token_ids, ks):
            assert drafts == _greedy(model, request.token_ids, k)
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([requests[0].token_ids])).logits[0, -1], -1)
        assert proposal.confidence[0][0] == pytest.approx(float(probs[proposal.token_ids[0][0]]), rel=1e-4)
        # Request 0 rejects at position 1, request 1 accepts everything, request 2 rejects its first draft.
        for request, drafts, num_accepted in zip(requests, proposal.token_ids, [1, len(proposal.token_ids[1]), 0]):
            _commit(request, drafts, num_accepted, extra_token=(7 * step + request.req_id) % VOCAB)


def test_a_row_stops_drafting_at_a_stop_token(model):
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=64)
    prompt = _tokens(6, 0)
    continuation = _greedy(model, prompt, 5)
    stop = continuation[1]  # the second draft: the row drafts it, then nothing more
    calls = _count_forwards(proposer)
    proposal = proposer.propose([_request(0, prompt, stop_ids=frozenset({stop})), _request(1, _tokens(4, 1))], [5, 5])
    drafted = continuation.index(stop) + 1
    assert proposal.token_ids[0] == continuation[:drafted]
    assert len(proposal.token_ids[1]) == 5  # the other row drafts on
    # the first forward and the extensions up to the stop carry both rows, the later ones only row 1
    assert [len(slots) for slots, _ in calls] == [2] * drafted + [1] * (5 - drafted)


def test_rollback_leaves_the_cache_equal_to_a_fresh_prefill(model):
    proposer = DraftModelProposer(model, max_num_seqs=3, max_model_len=64)
    requests = [_request(0, _tokens(5, 3)), _request(1, _tokens(8, 4)), _request(2, _tokens(4, 5))]
    proposal = proposer.propose(requests, [5, 3, 4])
    for request, drafts, num_accepted in zip(requests, proposal.token_ids, [2, 3, 0]):
        _commit(request, drafts, num_accepted, extra_token=11)
    # The cache held token_ids + drafts[:k-1]: accepted drafts stay cached, the rest is fed again.
    assert [len(t) for t in proposer.sync(requests)] == [1, 3 + 1 - 2, 1]
    proposal = proposer.propose(requests, [3, 3, 0])
    _commit(requests[0], proposal.token_ids[0], 3, extra_token=12)
    # Request 1 rejects its first draft, then sits out while more tokens are committed.
    first = proposal.token_ids[1][0]
    requests[1].token_ids += [(first + 1) % VOCAB, 13, 14]
    _commit(requests[2], [], 0, extra_token=15)
    _check_cache_matches_fresh_prefill(model, proposer, requests)


def _check_cache_matches_fresh_prefill(model, proposer, requests):
    uncached = proposer.sync(requests)
    for request, new_tokens in zip(requests, uncached):
        state = proposer._states[request.req_id]
        length = len(request.token_ids) - len(new_tokens)
        assert new_tokens and state.cached == request.token_ids[:length]
        assert proposer.runner.seq_len(state.slot) == length
        fresh = RaggedRunner(model, max_num_seqs=1, max_model_len=64)
        fresh.forward([fresh.allocate()], [request.token_ids[:length]], [0])
        # Cached keys were computed one token at a time, the fresh ones in one prefill: the same math with
        # different matmul shapes, so they differ by float32 rounding only (~1e-7 on values of magnitude ~1).
        for kv, fresh_kv in [(proposer.runner.cache.keys, fresh.cache.keys),
                             (proposer.runner.cache.values, fresh.cache.values)]:
            torch.testing.assert_close(kv[:, state.slot, :, :length], fresh_kv[:, 0, :, :length],
                                       atol=1e-5, rtol=1e-4)


def test_everything_cached_keeps_one_token_to_draft_from(model):
    proposer = DraftModelProposer(model, max_num_seqs=1, max_model_len=64)
    request = _request(0, _tokens(5, 6))
    proposer.propose([request], [1])  # k=1: the cache holds exactly token_ids
    assert proposer.sync([request]) == [request.token_ids[-1:]]


def test_rows_with_no_budget_cause_no_forward(model):
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=64)
    calls = _count_forwards(proposer)
    requests = [_request(0, _tokens(4, 7)), _request(1, _tokens(6, 8))]
    proposal = proposer.propose(requests, [0, 0])
    assert proposal.token_ids == [[], []] and calls == []
    assert proposer.runner.num_free_slots == 2  # not even a slot
    proposal = proposer.propose(requests, [0, 3])
    proposal.validate([0, 3], "draft_model")
    assert proposal.token_ids[0] == [] and len(proposal.token_ids[1]) == 3
    assert calls == [([0], [6]), ([0], [1]), ([0], [1])]  # request 1 only: prefill, then k - 1 single steps


def test_probabilistic_drafts_are_seeded_and_carry_their_distribution(model):
    def run(seed):
        proposer = DraftModelProposer(model, max_num_seqs=3, max_model_len=64, draft_sample_method="probabilistic")
        requests = [
            _request(0, _tokens(5, 9), temperature=1.0, generator=torch.Generator().manual_seed(seed)),
            _request(1, _tokens(7, 10), temperature=0.7, top_k=20, top_p=0.9,
                     generator=torch.Generator().manual_seed(seed + 1)),
            _request(2, _tokens(6, 11), temperature=0.0),
        ]
        return requests, proposer.propose(requests, [4, 3, 2])

    requests, proposal = run(seed=5)
    _, again = run(seed=5)
    _, other = run(seed=6)
    proposal.validate([4, 3, 2], "draft_model")
    assert proposal.token_ids == again.token_ids and proposal.token_ids != other.token_ids
    for drafts, conf, q in zip(proposal.token_ids, proposal.confidence, proposal.draft_probs):
        assert q.shape == (len(drafts), VOCAB)
        torch.testing.assert_close(q.sum(-1), torch.ones(len(drafts)))
        assert bool((q[torch.arange(len(drafts)), drafts] > 0).all())
    for i in (0, 1):  # sampled rows: confidence is q at the sampled draft
        picked = proposal.draft_probs[i][torch.arange(len(proposal.token_ids[i])), proposal.token_ids[i]]
        torch.testing.assert_close(picked, torch.tensor(proposal.confidence[i]))
    with torch.no_grad():
        logits = model(torch.tensor([requests[0].token_ids])).logits[0, -1]
    torch.testing.assert_close(proposal.draft_probs[0][0], torch.softmax(logits, -1), atol=1e-6, rtol=1e-4)
    assert int((proposal.draft_probs[1] > 0).sum(-1).max()) <= 20  # top_k=20
    assert proposal.token_ids[2] == _greedy(model, requests[2].token_ids, 2)  # temperature 0: one-hot q rows
    one_hot = torch.nn.functional.one_hot(torch.tensor(proposal.token_ids[2]), VOCAB).float()
    torch.testing.assert_close(proposal.draft_probs[2], one_hot)


def test_sibling_prefix_sharing_gives_the_same_drafts_with_less_prefill(model):
    prompt = _tokens(10, 12)

    def run(shared: bool):
        proposer = DraftModelProposer(model, max_num_seqs=4, max_model_len=64)
        calls = _count_forwards(proposer)
        requests = [_request(i, prompt, group_id=0 if shared else i) for i in range(3)]
        steps = [proposer.propose(requests, [3, 3, 2])]
        for request, drafts in zip(requests, steps[0].token_ids):
            _commit(request, drafts, request.req_id, extra_token=request.req_id + 1)
        requests.append(_request(3, prompt, group_id=0 if shared else 3))  # a sibling admitted later
        steps.append(proposer.propose(requests, [2, 2, 2, 3]))
        return steps, calls

    shared_steps, shared_calls = run(shared=True)
    plain_steps, plain_calls = run(shared=False)
    for shared, plain in zip(shared_steps, plain_steps):
        assert shared.token_ids == plain.token_ids
        torch.testing.assert_close(torch.tensor(sum(shared.confidence, [])), torch.tensor(sum(plain.confidence, [])))
    assert plain_calls[0] == ([0, 1, 2], [10, 10, 10])
    assert shared_calls[:2] == [([0], [9]), ([0, 1, 2], [1, 1, 1])]  # one prefill of the prompt, copied twice
    late = [c for c in shared_calls if 3 in c[0]][0]
    assert late[1][late[0].index(3)] == 1  # the late sibling copied the cached prompt


def test_draft_probs_rows_are_empty_for_rows_without_drafts(model):
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=64, draft_sample_method="probabilistic")
    proposal = proposer.propose([_request(0, _tokens(3, 13), temperature=1.0), _request(1, [5])], [0, 2])
    proposal.validate([0, 2], "draft_model")
    assert proposal.draft_probs[0].shape == (0, VOCAB)


def test_slot_and_length_limits(model):
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=12)
    requests = [_request(i, _tokens(4, 20 + i)) for i in range(3)]
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        proposer.propose(requests, [1, 1, 1])
    assert proposer.runner.num_free_slots == 2  # nothing was allocated
    near_full = _request(5, _tokens(11, 30))
    assert len(proposer.propose([near_full], [5]).token_ids[0]) == 2  # the cache holds token_ids + drafts[:-1]
    with pytest.raises(ValueError, match="max_model_len=12"):
        proposer.propose([_request(6, _tokens(13, 31))], [1])
    proposer.finish(near_full)
    proposer.finish(requests[0])  # never drafted: nothing to free
    assert proposer.runner.num_free_slots == 2


def test_fallback_runner_drafts_greedily_too():
    model = _gpt2()
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=64)
    assert isinstance(proposer.runner, PaddedRunner)
    requests = [_request(0, _tokens(5, 40)), _request(1, _tokens(3, 41))]
    for ks in ([3, 2], [2, 3]):
        proposal = proposer.propose(requests, ks)
        for request, drafts, k in zip(requests, proposal.token_ids, ks):
            assert drafts == _greedy(model, request.token_ids, k)
        for request, drafts in zip(requests, proposal.token_ids):
            _commit(request, drafts, 1, extra_token=3)


def test_each_forward_after_the_first_is_timed(model, monkeypatch):
    """Proposal.forward_seconds: (rows, seconds) of each further forward, what one more draft costs (the cost model
    learns from them); the first forward, which feeds the uncached tokens, is not one of them. On a clock that only a
    forward advances (by 1 s a row), each entry spans exactly one forward."""
    clock = FakeClock()
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=clock))
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=64)
    runner_forward = proposer.runner.forward

    def forward(slots, *args):
        clock.advance(len(slots))
        return runner_forward(slots, *args)

    proposer.runner.forward = forward
    requests = [_request(0, _tokens(6, 70)), _request(1, _tokens(4, 71))]
    proposal = proposer.propose(requests, [3, 1])
    assert proposal.forward_seconds == [(1, 1.0), (1, 1.0)]  # drafts 2 and 3 of request 0 alone


def test_release_all_drops_every_request_and_the_next_propose_starts_afresh(model):
    """What the engine calls after a drafter fault or a failed call: no slot or state is left, and the requests'
    next drafts are those of a fresh proposer (each re-prefilled from its token_ids)."""
    proposer = DraftModelProposer(model, max_num_seqs=2, max_model_len=64)
    requests = [_request(0, _tokens(6, 50)), _request(1, _tokens(4, 51))]
    proposer.propose(requests, [3, 3])
    proposer.release_all()
    assert proposer.num_requests == 0 and proposer.runner.num_free_slots == 2
    fresh = DraftModelProposer(model, max_num_seqs=2, max_model_len=64)
    assert proposer.propose(requests, [3, 2]).token_ids == fresh.propose(requests, [3, 2]).token_ids
