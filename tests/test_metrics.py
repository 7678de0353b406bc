import random

import pytest

from spec.metrics import AcceptanceStats, RequestAcceptance


def test_request_record_by_hand():
    record = RequestAcceptance.sized(3)
    for drafted, accepted in [(3, 3), (3, 1), (0, 0), (2, 0)]:
        record.observe(drafted, accepted)
    d = record.to_dict()
    assert d["num_spec_steps"] == 3  # the K=0 step is not a spec step
    assert d["num_draft_tokens"] == 8 and d["num_accepted_draft_tokens"] == 4
    assert d["acceptance_histogram"] == [1, 1, 0, 1]  # length k + 1, indexed by number accepted
    assert d["num_drafted_per_position"] == [3, 3, 2]
    assert d["num_accepted_per_position"] == [2, 1, 1]
    assert d["k_per_step"] == [3, 3, 0, 2]
    assert d["num_accepted_per_step"] == [3, 1, 0, 0]
    assert d["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)  # includes the bonus token
    assert d["draft_acceptance_rate"] == pytest.approx(0.5)


def test_empty_record():
    record = RequestAcceptance()
    assert record.mean_acceptance_length == 1.0 and record.draft_acceptance_rate == 0.0


def test_accepting_more_than_drafted_is_an_internal_error():
    with pytest.raises(AssertionError):
        RequestAcceptance().observe(2, 3)


def test_aggregate_is_exactly_the_sum_of_records():
    rng = random.Random(0)
    records = []
    for _ in range(20):
        record = RequestAcceptance.sized(4)
        for _ in range(rng.randint(0, 12)):
            k = rng.randint(0, 4)
            record.observe(k, rng.randint(0, k))
        records.append(record)
    stats = AcceptanceStats()
    for record in records:
        stats.add(record)
    total = stats.total
    for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
        assert getattr(total, name) == sum(getattr(r, name) for r in records)
    for name in ("acceptance_histogram", "num_drafted_per_position", "num_accepted_per_position"):
        assert getattr(total, name) == [sum(column) for column in zip(*(getattr(r, name) for r in records))]
    assert sorted(total.k_per_step) == sorted(k for r in records for k in r.k_per_step)
    assert stats.num_requests == 20


def test_aggregate_metrics_and_k_per_batch_size():
    stats = AcceptanceStats()
    record = RequestAcceptance()
    record.observe(4, 2)
    record.observe(2, 2)
    stats.add(record)
    for batch_size, k, num_drafts in [(1, 4, 4), (1, 4, 2), (40, 0, 0), (8, 2, 11)]:
        stats.observe_step(batch_size, k, num_drafts)
    metrics = stats.to_metrics()
    assert metrics["spec/acceptance_rate"] == pytest.approx(4 / 6)
    assert metrics["spec/mean_acceptance_length"] == pytest.approx(3.0)
    assert metrics["spec/acceptance_rate_pos_0"] == 1.0 and metrics["spec/acceptance_rate_pos_2"] == 0.0
    assert metrics["spec/mean_k"] == pytest.approx(3.0)
    d = stats.to_dict()
    assert d["k_per_batch_size"] == {1: {4: 2}, 8: {2: 1}, 40: {0: 1}}
    assert d["drafts_per_batch_size"] == {1: 6, 8: 11, 40: 0}  # verified, under each cap (fewer where cut)
    assert d["k_offered_histogram"] == {2: 1, 4: 1}
    assert "num_accepted_per_step" not in d  # per request only
