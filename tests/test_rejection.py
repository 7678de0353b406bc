import math

import pytest
import torch
from conftest import chi2_critical

from spec.rejection import rejection_sample
from spec.sampling import SamplingTensors, inverse_cdf_sample, processed_logprobs

VOCAB = 6


def _greedy_logits(argmaxes):
    """[len(argmaxes), VOCAB] logits whose argmax at each position is the given token."""
    logits = torch.randn(len(argmaxes), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def _greedy(n):
    return SamplingTensors.build([0.0] * n)


def _uniforms(num_positions, seed):
    """Each position's token and test uniforms, as the engine reads them from the requests' streams."""
    return torch.rand(num_positions, 2, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("drafts, argmaxes, expected_tokens, expected_accepted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),  # all accepted, then the bonus token
    ([5, 2, 3], [1, 2, 3, 4], [1], 0),  # first rejected: the target's token
    ([1, 5, 3], [1, 2, 3, 4], [1, 2], 1),  # second rejected
    ([], [4], [4], 0),  # empty draft: one target token
])
def test_greedy_table(drafts, argmaxes, expected_tokens, expected_accepted):
    logits = _greedy_logits(argmaxes)
    out = rejection_sample(logits, [drafts], _greedy(1), torch.zeros(len(argmaxes), 2))
    assert out.token_ids == [expected_tokens]
    assert out.num_accepted == [expected_accepted]
    logp = torch.log_softmax(logits, dim=-1)
    expected_logprobs = [float(logp[j, t]) for j, t in enumerate(expected_tokens)]
    assert out.logprobs[0] == pytest.approx(expected_logprobs, abs=1e-6)


def test_greedy_ragged_batch_keeps_rows_apart():
    # request 0: 2 drafts, both right; request 1: no drafts; request 2: 3 drafts, the 3rd wrong
    argmaxes = [[3, 1, 0], [2], [4, 4, 1, 5]]
    drafts = [[3, 1], [], [4, 4, 2]]
    logits = torch.cat([_greedy_logits(a) for a in argmaxes])
    out = rejection_sample(logits, drafts, _greedy(3), torch.zeros(len(logits), 2))
    assert out.token_ids == [[3, 1, 0], [2], [4, 4, 1]]
    assert out.num_accepted == [2, 0, 2]


@pytest.mark.parametrize("seed", range(10))
def test_point_proposals_emit_what_plain_sampling_emits_with_the_same_uniforms(seed):
    """Whatever the drafts, a request emits at each position the token that plain sampling draws there with the
    position's token uniform: the drafts that match it are accepted, and the first that does not is replaced by it."""
    g = torch.Generator().manual_seed(seed)
    num_positions = 6
    logits = torch.randn(num_positions, VOCAB, generator=g) * 2
    sampling = SamplingTensors.build([0.9], top_k=[5], top_p=[0.95])
    uniforms = _uniforms(num_positions, seed)
    plain = inverse_cdf_sample(processed_logprobs(logits, sampling.select([0] * num_positions)).exp(), uniforms[:, 0])
    num_right = int(torch.randint(0, num_positions, (1,), generator=g))
    drafts = plain[:num_right].tolist() + [(int(t) + 1) % VOCAB for t in plain[num_right:num_positions - 1]]
    out = rejection_sample(logits, [drafts], sampling, uniforms)
    assert out.num_accepted == [num_right]
    assert out.token_ids == [plain[:num_right + 1].tolist()]


def _random_case(seed, num_reqs, k_max):
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, k_max + 1, (num_reqs,), generator=g).tolist()
    logits = torch.randn(sum(num_draft) + num_reqs, VOCAB, generator=g) * 2
    draft_logits = [torch.randn(k, VOCAB, generator=g) * 2 for k in num_draft]
    return num_draft, logits, draft_logits


def _sample_drafts(draft_logits, sampling, generator):
    """Probabilistic drafts: x_j ~ q_j, with q the processed draft distribution."""
    drafts, probs = [], []
    for r, logits in enumerate(draft_logits):
        q = processed_logprobs(logits, sampling.select([r] * logits.shape[0])).exp()
        drafts.append(torch.multinomial(q, 1, generator=generator).squeeze(1).tolist() if len(q) else [])
        probs.append(q)
    return drafts, probs


@pytest.mark.parametrize("num_reqs", [1, 3, 8])
@pytest.mark.parametrize("k_max", [0, 1, 4])
def test_seeded_determinism(num_reqs, k_max):
    num_draft, logits, draft_logits = _random_case(num_reqs * 10 + k_max, num_reqs, k_max)
    sampling = SamplingTensors.build([0.9] * num_reqs, top_k=[5] * num_reqs, top_p=[0.95] * num_reqs)
    drafts, probs = _sample_drafts(draft_logits, sampling, torch.Generator().manual_seed(1))

    def run(seed):
        return rejection_sample(logits, drafts, sampling, _uniforms(len(logits), seed), probs).token_ids

    assert run(100) == run(100)
    runs = {str(run(seed)) for seed in range(100, 120)}
    assert len(runs) > 1  # the seed matters


def test_request_result_does_not_depend_on_its_batch():
    num_draft, logits, draft_logits = _random_case(3, 4, 3)
    sampling = SamplingTensors.build([1.0] * 4)
    drafts, probs = _sample_drafts(draft_logits, sampling, torch.Generator().manual_seed(1))
    uniforms = _uniforms(len(logits), 3)
    batch = rejection_sample(logits, drafts, sampling, uniforms, probs)
    start, end = sum(num_draft[:2]) + 2, sum(num_draft[:3]) + 3
    alone = rejection_sample(logits[start:end], [drafts[2]], sampling.select([2]), uniforms[start:end], [probs[2]])
    assert alone.token_ids[0] == batch.token_ids[2]
    assert alone.logprobs[0] == pytest.approx(batch.logprobs[2])


def _chi2(counts, probs):
    """Pearson statistic over the support of probs; counts outside the support must be zero."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's top-k/top-p support was emitted"
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


NUM_TRIALS = 20000
SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, -1, 1.0),
    (0.7, 4, 1.0),
    (1.3, -1, 0.8),
    (0.8, 5, 0.9),
]


@pytest.mark.parametrize("draft_sample_method", ["probabilistic", "greedy"])
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_emitted_tokens_follow_the_target_distribution(draft_sample_method, temperature, top_k, top_p):
    """Two drafts per trial; the first emitted token must follow p_1, the second (when emitted) p_2.

    Fixed seeds make the test deterministic. The threshold is chi-square's 1e-3 upper quantile: a correct
    sampler fails it with probability 1e-3 over seeds, while the negative control below shows the same
    statistic rejects the draft distribution q by a wide margin at this sample size.
    """
    g = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(3, VOCAB, generator=g) * 1.5  # positions 1, 2 and the bonus position
    draft_logits = target_logits[:2] + torch.randn(2, VOCAB, generator=g)  # a drafter that is close, not equal
    one = SamplingTensors.build([temperature], top_k=[top_k], top_p=[top_p])
    p = processed_logprobs(target_logits, one.select([0, 0, 0])).exp()
    q = processed_logprobs(draft_logits, one.select([0, 0])).exp()

    sampling = SamplingTensors.build([temperature] * NUM_TRIALS, top_k=[top_k] * NUM_TRIALS,
                                     top_p=[top_p] * NUM_TRIALS)
    if draft_sample_method == "probabilistic":
        drafts = torch.multinomial(q, NUM_TRIALS, replacement=True, generator=g).T.tolist()  # [trials, 2]
        probs = [q] * NUM_TRIALS
    else:
        drafts, probs = [q.argmax(dim=-1).tolist()] * NUM_TRIALS, None
    out = rejection_sample(target_logits.repeat(NUM_TRIALS, 1), drafts, sampling,
                           torch.rand(3 * NUM_TRIALS, 2, generator=g), probs)

    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=VOCAB).float()
    second = torch.bincount(torch.tensor([t[1] for t in out.token_ids if len(t) > 1]), minlength=VOCAB).float()
    for counts, probs_j in ((first, p[0]), (second, p[1])):
        stat, df = _chi2(counts, probs_j)
        assert stat < chi2_critical(max(df, 1)), (stat, counts.tolist(), (probs_j * counts.sum()).tolist())
    if draft_sample_method == "probabilistic":
        q_smoothed = (q[0] + 1e-3) / (q[0] + 1e-3).sum()  # q may put no mass on tokens that p emits
        q_stat, q_df = _chi2(first, q_smoothed)
        assert q_stat > 3 * chi2_critical(q_df)  # negative control: q is distinguishable from p


def test_logprobs_are_those_of_the_processed_target():
    num_draft, logits, draft_logits = _random_case(5, 5, 3)
    sampling = SamplingTensors.build([0.8] * 5, top_k=[4] * 5, top_p=[0.9] * 5)
    drafts, probs = _sample_drafts(draft_logits, sampling, torch.Generator().manual_seed(2))
    out = rejection_sample(logits, drafts, sampling, _uniforms(len(logits), 5), probs)
    logp = processed_logprobs(logits, sampling.repeat_interleave(torch.tensor(num_draft) + 1))
    start = 0
    for r, tokens in enumerate(out.token_ids):
        expected = [float(logp[start + j, t]) for j, t in enumerate(tokens)]
        assert out.logprobs[r] == pytest.approx(expected, abs=1e-6)
        assert all(math.isfinite(x) for x in out.logprobs[r])  # emitted tokens lie inside the support
        start += num_draft[r] + 1
