"""Deriving the per-batch-size schedule: predicted from acceptance and step costs (spec/tuning.py), and measured
by timing rollouts per K (rollout/tune.py)."""

import os
import tempfile
from types import SimpleNamespace

import pytest

from rollout import RolloutGenerator, SamplingParams
from rollout.tune import SameHistory, measure_speeds, schedule_from_measurements
from spec import BatchSizeSchedule, Proposal
from spec.tuning import MeasuredSteps, best_k, predicted_speedup, tuned_schedule

ACCEPTANCE = [0.8, 0.6, 0.4]  # vLLM-style per-position rates: each includes the positions before it


class _Costs:
    """Step times where verification is memory-bound (flat in tokens) below `compute_bound_from` rows and each
    further token per row costs a one-token verification above; a draft forward costs a tenth of one."""

    def __init__(self, compute_bound_from: int):
        self.compute_bound_from = compute_bound_from

    def step_seconds(self, batch_size: int, k: int) -> float:
        return 0.1 * k + 1.0 + (k if batch_size >= self.compute_bound_from else 0.0)


def test_predicted_speedup_by_hand():
    costs = _Costs(compute_bound_from=64)
    assert predicted_speedup(ACCEPTANCE, costs, 4, 0) == pytest.approx(1.0)
    assert predicted_speedup(ACCEPTANCE, costs, 4, 2) == pytest.approx((1 + 0.8 + 0.6) / (2 * 0.1 + 1.0))
    assert predicted_speedup(ACCEPTANCE, costs, 64, 3) == pytest.approx((1 + 1.8) / (0.3 + 4.0))
    with pytest.raises(ValueError, match="measured for 3 positions"):
        predicted_speedup(ACCEPTANCE, costs, 4, 4)


def test_schedule_speculates_while_it_pays_and_turns_off_where_it_loses():
    costs = _Costs(compute_bound_from=64)
    ranges = tuned_schedule(ACCEPTANCE, costs, 128)
    schedule = BatchSizeSchedule(ranges, 3)  # valid under the schedule rules
    assert ranges[0][0] == 1 and ranges[-1][1] == 128
    assert schedule.k_for_batch_size(1) == 3  # free verification: draft as far as acceptance allows
    assert schedule.k_for_batch_size(128) == 0  # every extra token costs a full row: speculation loses
    assert best_k(ACCEPTANCE, costs, 128, 1.02) == (0, 1.0)
    for batch_size in range(1, 129):
        k = schedule.k_for_batch_size(batch_size)
        speedups = [predicted_speedup(ACCEPTANCE, costs, batch_size, j) for j in range(4)]
        assert speedups[k] == pytest.approx(max(speedups)) or (k == 0 and max(speedups) < 1.02)


def test_measured_steps_interpolate_in_batch_size_and_k():
    steps = MeasuredSteps({1: {0: 1.0, 2: 2.0, 4: 4.0}, 4: {0: 2.0, 2: 5.0, 4: 8.0}})
    assert steps.step_seconds(1, 2) == 2.0 and steps.step_seconds(4, 4) == 8.0  # grid points
    assert steps.step_seconds(1, 3) == pytest.approx(3.0)  # between Ks
    assert steps.step_seconds(2, 0) == pytest.approx(1.0 + (2.0 - 1.0) / 3)  # between batch sizes
    assert steps.step_seconds(16, 8) == 8.0 and steps.step_seconds(1, 1) == pytest.approx(1.5)  # beyond: nearest
    assert predicted_speedup([0.5, 0.5, 0.5, 0.5], steps, 1, 4) == pytest.approx(3.0 * 1.0 / 4.0)


def test_min_gain_keeps_marginal_speculation_off():
    costs = _Costs(compute_bound_from=1)  # every batch size compute-bound: K=1 gives 1.8 / (0.1 + 2.0)
    assert best_k(ACCEPTANCE, costs, 8, min_gain=1.0)[0] == 0  # 0.86x: a loss even without a margin
    flat = _Costs(compute_bound_from=1000)
    assert best_k(ACCEPTANCE, flat, 8, min_gain=2.5) == (0, 1.0)  # K=3: 2.8 / 1.3 = 2.15x, not the 2.5x asked
    assert best_k(ACCEPTANCE, flat, 8, min_gain=1.02)[0] == 3


def test_measured_schedule_switches_between_grid_points_at_their_geometric_mean():
    measured = {1: {0: 100.0, 4: 200.0}, 2: {0: 100.0, 4: 190.0}, 4: {0: 100.0, 2: 150.0, 4: 140.0},
                8: {0: 100.0, 2: 101.0}}  # at 8, K=2 wins by 1%: less than min_gain, so K=0
    ranges = schedule_from_measurements(measured, 8, min_gain=1.02)
    # 3 > sqrt(2 x 4) = 2.83 takes batch size 4's K; 5 <= sqrt(4 x 8) = 5.66 still does; 6 takes 8's
    assert ranges == [[1, 2, 4], [3, 5, 2], [6, 8, 0]]
    BatchSizeSchedule(ranges, 4)  # valid under the schedule rules


class EchoDrafter:
    """Echoes the last tokens."""

    def __init__(self, config):
        pass

    def propose(self, requests, max_num_tokens):
        tokens = [r.token_ids[-k:] if k else [] for r, k in zip(requests, max_num_tokens)]
        return Proposal(tokens, [[0.5] * len(t) for t in tokens])


def test_measured_tuning_picks_k0_where_drafting_costs_more_than_it_gives(target, engine_clock):
    """The engine's clock (a fake one) charges each target forward 10 ms and each drafter call 200 ms: a speculative
    step costs 21 plain ones and emits at most 1 + K tokens a row, so the measured speeds favour K = 0 by far and the
    schedule never speculates."""
    static = {"method": "custom_class", "model": f"{__name__}.EchoDrafter", "num_speculative_tokens": 2}
    generator = RolloutGenerator(target, speculative_config=static, max_num_seqs=4)
    propose, forward = generator.backend.speculation.proposer.propose, generator.backend.runner.forward
    generator.backend.speculation.proposer.propose = lambda *args, **kwargs: engine_clock.advance(0.2) or propose(*args, **kwargs)
    generator.backend.runner.forward = lambda *args: engine_clock.advance(0.01) or forward(*args)
    speeds = measure_speeds(generator, 4, [0, 1, 2], SamplingParams(temperature=1.0, max_tokens=12),
                            SimpleNamespace(num_generations=1, seed=0, repeats=1),
                            lambda n, seed: [[5 + (seed + i) % 40] * 3 for i in range(n)])
    assert speeds[0] > 3 * max(speeds[1], speeds[2])
    assert schedule_from_measurements({1: speeds, 4: speeds}, 4, min_gain=1.02) == [[1, 4, 0]]


def test_each_k_drafts_from_the_same_history(target):
    """The history drafter drafts from what the runs before left: with the same seed every K samples the same
    completions, so a K run after another would draft that run's very completions. SameHistory saves the state
    after the prompts' earlier epoch and loads it before each run: two runs from it draft alike; without the load,
    the second drafts its own completions and accepts far more."""
    config = {"method": "history", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 0}
    generator = RolloutGenerator(target, speculative_config=config, max_num_seqs=4, seed=0)
    prompts = [[5, 6, 7], [9, 10]]
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
    with tempfile.TemporaryDirectory() as folder:
        history = SameHistory(generator, os.path.join(folder, "history.npz"))
        history.revisit(prompts, 2, params)
        runs = []
        for restore in (True, True, False):
            if restore:
                history.restore()
            runs.append(generator.generate(prompts, 2, params, use_tqdm=False).stats["mean_acceptance_length"])
    assert runs[0] == runs[1] and runs[2] > runs[1] + 1
