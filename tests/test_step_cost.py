"""The step-cost model (spec/adaptive/step_cost.py) and its measurement and disk cache (spec/adaptive/cost_profile.py)."""

import json

import numpy as np
import pytest
from conftest import tiny_llama

from spec.adaptive import cost_profile
from spec.model_runner import build_runner
from spec.proposers.draft_model import DraftModelProposer
from spec.adaptive.step_cost import StepCostModel

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
def test_runs_of_row_counts_read_the_curve_as_single_reads_do(seed):
    """draft_forward_costs sums each segment of the draft curve as an arithmetic progression; it must agree with
    draft_cost everywhere: below the curve's first point (flat), across its points and past its last (extended)."""
    rng = np.random.default_rng(seed)
    rows = sorted(rng.choice(np.arange(1, 40), size=int(rng.integers(1, 5)), replace=False).tolist())
    costs = StepCostModel({1: {1: 1.0}}, dict(zip(rows, np.cumsum(rng.uniform(0.01, 1.0, size=len(rows))).tolist())))
    max_rows = int(rng.integers(1, 60))
    expected = [costs.draft_cost([m]) for m in range(1, max_rows + 1)]
    assert costs.draft_forward_costs(max_rows) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_a_ragged_step_costs_its_widest_row_in_every_row_less_the_tokens_it_is_short_of():
    costs = StepCostModel.from_dict({"verify": {16: {16: 1.0, 32: 3.0, 48: 4.0}}, "verify_per_token": {16: 0.05}})
    shape = costs.verify_shape(16)
    assert shape.cost(16, 1, 0) == pytest.approx(1.0)  # no drafts
    assert shape.cost(48, 3, 16) == pytest.approx(4.0)  # every row 3 wide: the uniform curve
    # 8 rows at 3 tokens, 8 at 1: padded to 3 (48 query slots), 16 tokens short of them
    assert shape.cost(32, 3, 8) == pytest.approx(4.0 - 0.05 * 16)
    # 2 of 16 rows wide: the runner splits attention, so one token per row plus the others at the per-token cost
    assert shape.cost(22, 4, 2) == pytest.approx(1.0 + 0.05 * 6)
    # without a measured per-token cost: the curve's least slope (1/16 s), so that widening never costs less
    fallback = StepCostModel.from_dict({"verify": {16: {16: 1.0, 32: 3.0, 48: 4.0}}}).verify_shape(16)
    assert fallback.per_token == pytest.approx(1 / 16)
    # between grid sizes, each curve is read at the same tokens per row, the per-token cost too
    two = StepCostModel.from_dict({"verify": {2: {2: 1.0, 6: 2.0}, 4: {4: 2.0, 12: 4.0}},
                                   "verify_per_token": {2: 0.2, 4: 0.1}}).verify_shape(3)
    assert two.cost(5, 3, 2) == pytest.approx(0.5 * (2.0 - 0.2 * (6 - 5 * 2 / 3))
                                              + 0.5 * (4.0 - 0.1 * (12 - 5 * 4 / 3)))


def test_refinement_learns_from_ragged_steps_at_their_padded_cost():
    costs = StepCostModel.from_dict({"verify": {4: {4: 2.0, 12: 6.0}}, "verify_per_token": {4: 0.25}})
    for _ in range(300):
        costs.observe_verify(4, 8, 3, 2, 2 * (6.0 - 0.25 * 4))  # twice its padded cost
    assert costs.verify_cost(4, 4) == pytest.approx(4.0, rel=0.02)
    assert costs.verify_shape(4).per_token == pytest.approx(0.5, rel=0.02)  # scaled with the curve


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
    ({"verify": {1: {1: 1.0, 3: 2.0}}, "verify_per_token": {1: 0.6}}, r"\[1\]=0.6 s exceeds the verify curve's"),
    ({"verify": {1: {1: 1.0, 3: 2.0}}, "verify_per_token": {1: -0.1}}, r"must be seconds >= 0"),
    ({"verify": {1: {1: 1.0, 3: 2.0}}, "verify_per_token": {2: 0.1}}, r"num_reqs 2 has no verify curve"),
])
def test_bad_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        StepCostModel.from_dict(table)


def test_online_refinement_learns_the_observed_costs_where_the_engine_runs():
    costs = StepCostModel.from_dict(TABLE)  # 4 rows: 2.0 s at 4 tokens, 6.0 s at 12
    for _ in range(300):
        costs.observe_verify(4, 4, 1, 0, 3.0)  # 1.5x the table at 4 tokens
        costs.observe_verify(4, 12, 3, 4, 9.0)  # and at 12
    # Within 2%: the table's 2 points count as 2 observations against the ~100 the curve remembers.
    assert [costs.verify_cost(4, t) for t in (4, 8, 12)] == pytest.approx([3.0, 6.0, 9.0], rel=0.02)  # scaled
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
        costs.observe_verify(4, 10, 3, 3, 5.0 * (1.0 + 0.05 * (step % 3)))  # the band the engine runs in
        costs.observe_verify(4, 4, 1, 0, 10.0 if stalled else 2.0)
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
    assert sorted(table["verify_per_token"]) == [1, 2, 4]
    for n, curve in table["verify"].items():  # measured (from 2 rows), or the least slope: within [0, least slope]
        points = sorted(curve.items())
        least = min((s1 - s0) / (x1 - x0) for (x0, s0), (x1, s1) in zip(points, points[1:]))
        assert 0 <= table["verify_per_token"][n] <= least * (1 + 1e-9)
    assert target_runner.num_free_slots == 4 and drafter.runner.num_free_slots == 4  # scratch slots returned
    path = cost_profile.cache_path(key)
    assert path.parent == step_cost_cache and json.loads(path.read_text())["key"] == key
    assert cost_profile.load_or_profile(key, None, None, 64).to_dict() == costs.to_dict()  # no runner: from disk
    other = dict(key, dtype="torch.float16")
    assert cost_profile.cache_path(other) != path


def test_profile_takes_each_blocks_shape_within_rounds_and_its_level_from_the_fastest(monkeypatch):
    """Every point runs once untimed, then _REPEATS rounds over all of them; a block's shape comes from within each
    round, so a moment of full speed that covered one point of one round (the machine at 1.5x otherwise) does not bend
    it, as each point's fastest run would (there: 3x where the work is 2x)."""
    now, calls = [0.0], []
    monkeypatch.setattr(cost_profile, "time", __import__("types").SimpleNamespace(perf_counter=lambda: now[0]))
    cost = {("a", 1): 1.0, ("a", 2): 2.0, ("b", 1): 5.0}

    def run(key):
        calls.append(key)
        now[0] += cost[key] * (1.0 if (key, calls.count(key)) == (("a", 1), 4) else 1.5)

    times = cost_profile._block_times({key: (lambda key=key: run(key)) for key in cost})
    assert calls == list(cost) * (1 + cost_profile._REPEATS)  # a warm-up, then rounds over every point
    assert times[("a", 2)] / times[("a", 1)] == pytest.approx(2.0)
    assert times[("a", 1)] + times[("a", 2)] == pytest.approx(4.0)  # the block's fastest round
    assert times[("b", 1)] == pytest.approx(7.5)
