"""The step-cost model (spec/step_cost.py) and its measurement and disk cache (spec/cost_profile.py)."""

import json

import numpy as np
import pytest
from conftest import tiny_llama

from spec import cost_profile
from spec.model_runner import build_runner
from spec.proposers.draft_model import DraftModelProposer
from spec.step_cost import StepCostModel

TABLE = {"verify": {1: {1: 1.0, 3: 2.0}, 4: {4: 2.0, 12: 6.0}}, "draft": {1: 0.5, 4: 1.0}}


def test_interpolates_in_tokens_then_in_requests():
    costs = StepCostModel.from_dict(TABLE)
    assert [costs.verify_cost(1, t) for t in (1, 2, 3, 5)] == pytest.approx([1.0, 1.5, 2.0, 3.0])  # past the end:
    # the last slope
    assert costs.verify_cost(4, 8) == pytest.approx(4.0)
    # 2 rows, a third of the way to 4: each curve is read at the same tokens per row (2 tokens per row: 2 at 1 row,
    # 8 at 4), so a step without drafts is read where each curve measured one (not below the 4-row curve's range)
    assert costs.verify_cost(2, 4) == pytest.approx(2 / 3 * 1.5 + 1 / 3 * 4.0)
    assert costs.verify_cost(2, 2) == pytest.approx(2 / 3 * 1.0 + 1 / 3 * 2.0)
    assert costs.verify_cost(9, 12) == pytest.approx(6.0)  # beyond the grid: the largest row
    assert costs.draft_cost([4, 2, 1]) == pytest.approx(1.0 + 2 / 3 + 0.5)
    assert StepCostModel.from_dict({"verify": TABLE["verify"]}).draft_cost([4]) == 0.0  # model-free drafter


@pytest.mark.parametrize("seed", range(20))
def test_runs_of_token_counts_read_the_curves_as_single_reads_do(seed):
    """verify_costs sums each segment as an arithmetic progression; it must agree with verify_cost everywhere: below
    a curve's first point (flat), across its points, past its last (extended), between grid rows (read at the same
    tokens per row, a non-integer step) and beyond the grid."""
    rng = np.random.default_rng(seed)
    table = {}
    for num_reqs in sorted(rng.choice(np.arange(1, 40), size=int(rng.integers(1, 4)), replace=False).tolist()):
        tokens = sorted(rng.choice(np.arange(num_reqs, 10 * num_reqs + 1), size=int(rng.integers(1, 5)),
                                   replace=False).tolist())
        table[num_reqs] = dict(zip(tokens, np.cumsum(rng.uniform(0.01, 1.0, size=len(tokens))).tolist()))
    costs = StepCostModel.from_dict({"verify": table})
    for num_reqs in range(1, 45):
        first, count = int(rng.integers(1, 3 * num_reqs + 2)), int(rng.integers(1, 12 * num_reqs))
        expected = [costs.verify_cost(num_reqs, t) for t in range(first, first + count)]
        assert costs.verify_costs(num_reqs, first, count) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_json_round_trip_with_string_keys():
    costs = StepCostModel.from_dict(json.loads(json.dumps(TABLE)))
    assert costs.to_dict() == StepCostModel.from_dict(TABLE).to_dict()


@pytest.mark.parametrize("table, message", [
    ({"verify": {1: {1: 1.0, 2: 0.5}}}, r"step_costs\['verify'\]\[1\]: cost falls from 1 s at 1 to 0.5 s at 2"),
    ({"verify": {1: {1: 0.0}}}, r"cost 0.0 at 1 is not positive"),
    ({"verify": {1: {1: -1.0}}}, r"is not positive"),
    ({"verify": {1: {1: 1.0}}, "draft": {1: 2.0, 8: 1.0}}, r"step_costs\['draft'\]: cost falls"),
    ({"verify": {"x": {1: 1.0}}}, r"key 'x' is not a positive integer"),
    ({"verify": {}}, r"expected a non-empty"),
    ({"draft": {1: 1.0}}, r"expected \{'verify'"),
])
def test_bad_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        StepCostModel.from_dict(table)


def test_online_refinement_learns_the_observed_costs_where_the_engine_runs():
    costs = StepCostModel.from_dict(TABLE)  # 4 rows: 2.0 s at 4 tokens, 6.0 s at 12
    for _ in range(300):
        costs.observe_verify(4, 4, 3.0)  # 1.5x the table at 4 tokens
        costs.observe_verify(4, 12, 9.0)  # and at 12
    # Within 2%: the table's 2 points count as 2 observations against the ~100 the curve remembers.
    assert costs.verify_costs(4, 4, 9)[::4] == pytest.approx([3.0, 6.0, 9.0], rel=0.02)  # the whole curve, scaled
    assert costs.verify_cost(1, 1) == pytest.approx(1.0)  # a curve nothing was observed on stays as measured
    for _ in range(300):
        costs.observe_draft([4], [0.5])  # half the table
    assert costs.draft_cost([4]) == pytest.approx(0.5, rel=0.02)
    assert costs.draft_cost([1]) == pytest.approx(0.25, rel=0.02)  # the draft curve's shape, scaled by the same


def test_refinement_keeps_the_measured_shape_through_noise_and_the_cache():
    """Only a scale is learned: slow single steps (which only ever add time) and tables saved and reloaded (a refined
    table is what the next run starts from) cannot tilt a curve, whose slope sizes verification."""
    costs = StepCostModel.from_dict(TABLE)
    for step in range(500):
        stalled = step % 7 == 0  # every 7th step at 4 tokens stalls to 5x its cost
        costs.observe_verify(4, 10, 5.0 * (1.0 + 0.05 * (step % 3)))  # the band the engine runs in: 10 tokens
        costs.observe_verify(4, 4, 10.0 if stalled else 2.0)
    for _ in range(3):  # saved and reloaded, as the generator does between runs
        costs = StepCostModel.from_dict(json.loads(json.dumps(costs.to_dict())))
    curve = costs.to_dict()["verify"][4]
    assert curve[12] / curve[4] == pytest.approx(3.0)  # the table's 2.0 s at 4 tokens and 6.0 s at 12


def test_profile_measures_monotone_positive_costs_and_caches_them(step_cost_cache):
    target, draft = tiny_llama(0), tiny_llama(1, num_layers=1)
    target_runner, drafter = build_runner(target, 4, 64), DraftModelProposer(draft, max_num_seqs=4, max_model_len=64)
    key = cost_profile.cache_key(target, draft, target.dtype, "cpu", max_num_seqs=4, max_tokens_per_row=3)
    costs = cost_profile.load_or_profile(key, target_runner, drafter, max_model_len=64)
    table = costs.to_dict()
    assert sorted(table["verify"]) == [1, 2, 4] and sorted(table["draft"]) == [1, 2, 4]
    for curve in [*table["verify"].values(), table["draft"]]:
        values = list(curve.values())
        assert min(values) > 0 and values == sorted(values)
    assert sorted(table["verify"][4]) == [4, 8, 12]  # 1, 2 and 3 tokens per row
    assert target_runner.num_free_slots == 4 and drafter.runner.num_free_slots == 4  # scratch slots returned
    path = cost_profile.cache_path(key)
    assert path.parent == step_cost_cache and json.loads(path.read_text())["key"] == key
    assert cost_profile.load_or_profile(key, None, None, 64).to_dict() == costs.to_dict()  # no runner: from disk
    other = dict(key, dtype="torch.float16")
    assert cost_profile.cache_path(other) != path


def test_profile_timings_take_turns_so_a_slow_spell_slows_one_round_of_every_point(monkeypatch):
    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(cost_profile, "time", __import__("types").SimpleNamespace(perf_counter=lambda: next(clock)))
    runs = {key: (lambda key=key: calls.append(key)) for key in "ab"}
    assert cost_profile._fastest_times(runs) == {"a": 1, "b": 1}  # every timed run takes one tick here
    assert calls == ["a", "b"] + ["a", "b"] * cost_profile._REPEATS  # warm-ups, then rounds over every point
