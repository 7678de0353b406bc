import tracemalloc

import pytest

from spec.schedule import BatchSizeSchedule, validate_ranges


@pytest.mark.parametrize("ranges, message", [
    ([], "must not be empty"),
    ("1-8:4", "expected a list"),
    (None, "expected a list"),
    ([[1, 8]], "is not [range_start, range_end, K]"),
    ([[1, 8, 4, 2]], "is not [range_start, range_end, K]"),
    ([[1, 8, 2.5]], "must hold integers"),
    ([[1, 8, True]], "must hold integers"),
    ([[True, 8, 2]], "must hold integers"),
    ([[1, "8", 2]], "must hold integers"),
    ([[0, 8, 4]], "non-positive bound"),
    ([[1, 8, 4], [-3, -1, 2]], "non-positive bound"),
    ([[1, 8, 4], [12, 9, 2]], "starts after it ends"),
    ([[1, 8, -1]], "K=-1"),
    ([[1, 8, 4], [8, 16, 2]], "overlap"),
    ([[1, 8, 4], [4, 6, 2]], "overlap"),
    ([[2, 8, 4]], "must start at batch size 1"),
])
def test_invalid_ranges_name_the_field_and_rule(ranges, message):
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size") as info:
        validate_ranges(ranges)
    assert message in str(info.value)


def test_ranges_are_sorted_on_input():
    assert validate_ranges([[9, 64, 1], [1, 8, 4]]) == [(1, 8, 4), (9, 64, 1)]


def test_lookup_within_ranges_gaps_and_tail():
    schedule = BatchSizeSchedule([[1, 4, 5], [8, 16, 2], [32, 32, 0]], num_speculative_tokens=8)
    expected = {1: 5, 4: 5, 5: 5, 7: 5, 8: 2, 16: 2, 17: 2, 31: 2, 32: 0, 33: 0, 1000: 0}
    assert {b: schedule.k_for_batch_size(b) for b in expected} == expected


def test_effective_k_is_capped_by_num_speculative_tokens():
    schedule = BatchSizeSchedule([[1, 2, 7], [3, 4, 3], [5, 6, 1]], num_speculative_tokens=4)
    assert [schedule.k_for_batch_size(b) for b in range(1, 8)] == [4, 4, 3, 3, 1, 1, 1]


def test_k_zero_turns_speculation_off_and_carries_forward():
    schedule = BatchSizeSchedule([[1, 1, 3], [2, 2, 0], [10, 20, 1]], num_speculative_tokens=3)
    assert [schedule.k_for_batch_size(b) for b in (1, 2, 3, 9, 10, 21)] == [3, 0, 0, 0, 1, 1]


def test_the_schedule_keeps_only_range_starts_and_k():
    schedule = BatchSizeSchedule([[6, 7, 1], [1, 3, 2]], num_speculative_tokens=4)
    assert (schedule.starts, schedule.ks) == ([1, 6], [2, 1])
    assert [schedule.k_for_batch_size(b) for b in range(9)] == [0, 2, 2, 2, 2, 2, 1, 1, 1]


def test_a_huge_range_costs_no_memory():
    """A range ending at 10**7 once built a dense 10**7-entry table (80 MB; 10**9 took GBs)."""
    tracemalloc.start()
    schedule = BatchSizeSchedule([[1, 10, 4], [11, 10 ** 7, 2]], num_speculative_tokens=8)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 100_000
    assert [schedule.k_for_batch_size(b) for b in (10, 11, 10 ** 7, 10 ** 9)] == [4, 2, 2, 2]


def test_negative_batch_size_is_rejected():
    with pytest.raises(ValueError, match="batch_size=-1"):
        BatchSizeSchedule([[1, 3, 2]], num_speculative_tokens=4).k_for_batch_size(-1)
