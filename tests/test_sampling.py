import math

import pytest
import torch

from spec.sampling import SamplingTensors, processed_logprobs

LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))


def _probs(temperature=1.0, top_k=-1, top_p=1.0, logits=LOGITS):
    return processed_logprobs(logits, SamplingTensors.build([temperature], [top_k], [top_p])).exp()[0].tolist()


def test_no_processing_is_softmax():
    assert _probs() == pytest.approx([0.4, 0.3, 0.2, 0.1])


def test_temperature_scales_logits():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1]) ** 2
    assert _probs(temperature=0.5) == pytest.approx((p / p.sum()).tolist())


def test_greedy_reports_unscaled_distribution():
    assert _probs(temperature=0.0) == pytest.approx([0.4, 0.3, 0.2, 0.1])


def test_top_k_keeps_k_largest():
    assert _probs(top_k=2) == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0])


def test_top_p_keeps_smallest_nucleus_reaching_p():
    assert _probs(top_p=0.7) == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0])  # 0.4 < 0.7, 0.4 + 0.3 >= 0.7
    assert _probs(top_p=0.71) == pytest.approx([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0])
    assert _probs(top_p=0.1) == pytest.approx([1, 0, 0, 0])  # the most likely token always stays


def test_top_k_then_top_p():
    # top-k=3 renormalises to [4/9, 3/9, 2/9]; top-p=0.5 then keeps 4/9 < 0.5 plus the next token
    assert _probs(top_k=3, top_p=0.5) == pytest.approx([4 / 7, 3 / 7, 0, 0])


def test_per_row_settings_and_masked_logprobs():
    logits = LOGITS.repeat(2, 1)
    logp = processed_logprobs(logits, SamplingTensors.build([1.0, 1.0], top_k=[1, -1], top_p=[1.0, 1.0]))
    assert logp[0].tolist() == [0.0, -math.inf, -math.inf, -math.inf]
    assert logp[1].exp().tolist() == pytest.approx([0.4, 0.3, 0.2, 0.1])


def test_a_temperature_below_the_greedy_threshold_is_greedy():
    """1e-30 once divided the logits: inf, then NaN logprobs."""
    tiny = SamplingTensors.build([1e-30, 0.0])
    assert tiny.is_greedy.tolist() == [True, True]
    logp = processed_logprobs(LOGITS.repeat(2, 1), tiny)
    assert torch.isfinite(logp).all() and torch.equal(logp[0], logp[1])
