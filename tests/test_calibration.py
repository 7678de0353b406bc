"""Online confidence calibration (spec/adaptive/calibration.py) on synthetic streams with known acceptance probabilities."""

import numpy as np
import pytest

from spec.adaptive.calibration import ConfidenceCalibrator
from spec.adaptive.monotone import isotonic

TRUE_MAPS = {0: lambda c: c ** 2, 1: lambda c: 0.2 + 0.5 * c, 2: lambda c: np.full_like(c, 0.7)}


def _stream(rng, num: int):
    positions = rng.integers(0, 3, size=num)
    raw = rng.uniform(0.0, 1.0, size=num)
    truth = np.select([positions == p for p in TRUE_MAPS], [f(raw) for f in TRUE_MAPS.values()])
    return positions, raw, rng.uniform(size=num) < truth


def test_calibration_converges_to_the_true_acceptance_probabilities():
    """60000 judged drafts in 100 batches: ~1000 per (position, bin). A bin estimate's standard error is then
    <= 0.016, and a bin spans 0.05 of raw confidence (<= 0.05 of truth for these slopes): 0.06 bounds both."""
    rng = np.random.default_rng(0)
    calibrator = ConfidenceCalibrator(max_positions=3, num_bins=20)
    for _ in range(100):
        calibrator.observe(*_stream(rng, 600))
    centres = calibrator.centres
    for position, truth in TRUE_MAPS.items():
        estimate = calibrator.calibrated(np.full(len(centres), position), centres)
        assert np.abs(estimate - truth(centres)).max() < 0.06, position
    # the raw confidences are miscalibrated by construction; the learned map is not
    assert calibrator.calibration_error() < 0.5 * calibrator.calibration_error("raw")


def test_calibrated_values_are_the_map_at_each_drafts_position_and_bin():
    rng = np.random.default_rng(0)
    calibrator = ConfidenceCalibrator(max_positions=3, num_bins=10)
    calibrator.observe(rng.integers(0, 5, 400), rng.random(400), rng.random(400) < 0.6)
    raw = np.array([-0.1, 0.0, 0.33, 0.5, 0.999, 1.0, 1.2])  # out-of-range values clamp to the end bins
    positions = np.arange(len(raw))  # positions past the last share its map
    expected = [calibrator.table[min(j, 2), min(max(int(c * 10), 0), 9)] for j, c in zip(positions, raw)]
    assert calibrator.calibrated(positions, raw).tolist() == expected
    assert len(set(expected)) > 2  # the map was fitted: the check compares learned values


def test_added_drafts_are_observed_at_flush_as_one_update():
    rng = np.random.default_rng(1)
    positions, raw, accepted = rng.integers(0, 4, 300), rng.random(300), rng.random(300) < 0.5
    direct, buffered = ConfidenceCalibrator(max_positions=3), ConfidenceCalibrator(max_positions=3)
    direct.observe(positions, raw, accepted)
    for part in np.array_split(np.arange(300), 7):  # added a step at a time
        buffered.add(positions[part], raw[part], accepted[part])
    assert buffered.num_pending == 300 and buffered.num_observations == 0
    buffered.flush()
    assert buffered.num_pending == 0 and buffered.num_observations == 300
    assert np.array_equal(buffered.table, direct.table)


def test_before_any_outcome_the_map_trusts_the_drafter():
    calibrator = ConfidenceCalibrator(max_positions=2, num_bins=10)
    raw = np.array([0.05, 0.52, 0.99])
    assert calibrator.calibrated(np.array([0, 1, 5]), raw).tolist() == pytest.approx([0.05, 0.55, 0.95])
    assert calibrator.calibration_error() == 0.0


def test_the_map_is_non_decreasing_in_confidence_whatever_the_outcomes():
    rng = np.random.default_rng(1)
    calibrator = ConfidenceCalibrator(max_positions=2, num_bins=10)
    raw = rng.uniform(size=2000)
    calibrator.observe(np.zeros(2000, dtype=int), raw, rng.uniform(size=2000) < 1.0 - raw)  # anti-calibrated
    assert np.all(np.diff(calibrator.table[0]) >= 0)
    # a decreasing truth has no non-decreasing fit but its pooled mean, 0.5 (+-0.03: 2000 outcomes, prior 40)
    assert np.abs(calibrator.table[0] - 0.5).max() < 0.03


def test_isotonic_pools_violators_by_weight():
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert isotonic([3.0, 1.0], [3.0, 1.0]) == pytest.approx([2.5, 2.5])
    assert isotonic([5.0, 4.0, 3.0]) == pytest.approx([4.0, 4.0, 4.0])


def test_a_position_without_outcomes_takes_the_acceptance_rate_before_it():
    calibrator = ConfidenceCalibrator(max_positions=4, num_bins=10)
    assert calibrator.acceptance_rate(2) == 0.5  # nothing observed: 1/2
    calibrator.observe(np.zeros(20, dtype=int), np.full(20, 0.9), np.arange(20) < 18)
    first = (18 + 4 * 0.5) / (20 + 4)
    assert [calibrator.acceptance_rate(j) for j in range(5)] == pytest.approx([first] * 5)  # 4: pooled with 3
    calibrator.observe(np.ones(10, dtype=int), np.full(10, 0.9), np.zeros(10, dtype=bool))
    second = 4 * first / (10 + 4)  # none of 10 accepted, from a prior of the first position's rate
    assert [calibrator.acceptance_rate(j) for j in range(4)] == pytest.approx([first, second, second, second])
