"""Measuring the step-cost model (spec/adaptive/step_cost.py) on the running hardware, and caching it on disk.

The profile times the real work on scratch cache slots: for num_reqs on a doubling grid up to max_num_seqs, rows
holding a typical mid-rollout context verify 1 .. max_tokens_per_row tokens each (target forward and rejection
sampling), half of them max_tokens_per_row and half one (the per-token cost at a fixed padded width: the step costs
what max_tokens_per_row in every row does, less that for each token it is short), or draft one token each (the
draft-model proposer's own propose call). It runs once per (models, dtype,
device, threads, grid): the result is a JSON file in the cache folder (`$SPEC_ROLLOUTS_CACHE`, else
`$XDG_CACHE_HOME/spec-rollouts`, else `~/.cache/spec-rollouts`), which later runs load and the engine's online
refinement keeps up to date.
"""

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from spec.proposers.base import DraftRequest
from spec.rejection import rejection_sample
from spec.runner import Runner
from spec.sampling import SamplingTensors
from spec.adaptive.monotone import isotonic
from spec.adaptive.step_cost import StepCostModel

_CONTEXT = 32  # cached tokens per row while timing: a prompt plus part of a completion
_FORMAT = 7  # in the cache key: a table measured by an older profile is measured again
_REPEATS = 5
_MIN_SECONDS = 1e-5  # a difference of two timings that noise made non-positive: costs must be > 0


def cache_dir() -> Path:
    if os.environ.get("SPEC_ROLLOUTS_CACHE"):
        return Path(os.environ["SPEC_ROLLOUTS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spec-rollouts"


def cache_key(target_model, draft_model, dtype: torch.dtype, device: torch.device, max_num_seqs: int,
              max_tokens_per_row: int) -> dict:
    """What a measured table depends on: architectures and sizes (not weights), dtype, hardware, grid."""
    device = torch.device(device)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"format": _FORMAT, "target": _architecture(target_model),
            "draft": None if draft_model is None else _architecture(draft_model), "dtype": str(dtype),
            "device": f"{device.type}:{hardware}", "threads": torch.get_num_threads(),
            "max_num_seqs": max_num_seqs, "max_tokens_per_row": max_tokens_per_row}


def load_or_profile(key: dict, target_runner: Runner | None, drafter, max_model_len: int,
                    refresh: bool = False) -> StepCostModel:
    """The cached table for `key`, or (none cached, or refresh) a fresh profile, then cached."""
    path = cache_path(key)
    if path.exists() and not refresh:
        return StepCostModel.from_dict(json.loads(path.read_text())["costs"])
    costs = profile(target_runner, drafter, key["max_num_seqs"], key["max_tokens_per_row"], max_model_len)
    save(costs, key)
    return costs


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"step_costs-{digest}.json"


def save(costs: StepCostModel, key: dict) -> None:
    """Write atomically: processes sharing the cache folder never read half a file."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "costs": costs.to_dict()}, indent=1))
    os.replace(tmp, path)


@torch.inference_mode()
def profile(target_runner: Runner, drafter, max_num_seqs: int, max_tokens_per_row: int,
            max_model_len: int) -> StepCostModel:
    """Seconds on this hardware. Verification: a target forward plus rejection sampling of its logits. Drafting:
    one `drafter.propose` call per timing, one token per row (a draft-model proposer; None for model-free
    drafters). Needs max_num_seqs free cache slots in the runner and the drafter; frees them again."""
    grid = doubling_grid(max_num_seqs)
    widths = sorted({1, 2, 3, 5, max_tokens_per_row} & set(range(1, max_tokens_per_row + 1)))
    context = max(1, min(_CONTEXT, max_model_len - max_tokens_per_row))
    verify, ragged = _time_verification(target_runner, grid, widths, context)
    draft = None if drafter is None else _time_drafting(drafter, grid, context)
    return _monotone(verify, draft, ragged)


def _time_verification(runner: Runner, grid: list[int], widths: list[int], context: int):
    """{num_reqs: {num_reqs * width: seconds}} of uniform widths, and {num_reqs: (tokens, seconds)} of half the rows
    at the widest width and half at one (num_reqs >= 2)."""
    slots = [runner.allocate() for _ in range(max(grid))]
    widest = max(widths)
    ragged = {n: [widest] * (n // 2) + [1] * (n - n // 2) for n in grid if n >= 2}
    try:
        runner.forward(slots, [[3] * context] * len(slots), [0] * len(slots))
        runs = {}  # each num_reqs' points one after another: a block (_block_times)
        for n in grid:
            runs.update({(n, w): lambda n=n, w=w: _verify(runner, slots[:n], [w] * n, context) for w in widths})
            if n in ragged:
                runs[n, "ragged"] = lambda n=n: _verify(runner, slots[:n], ragged[n], context)
        times = _block_times(runs)
        return ({n: {n * w: times[n, w] for w in widths} for n in grid},
                {n: (sum(ragged[n]), times[n, "ragged"]) for n in ragged})
    finally:
        for slot in slots:
            runner.free(slot)


def _verify(runner: Runner, slots: list[int], widths: list[int], context: int) -> None:
    logits = runner.forward(slots, [[3] * w for w in widths], widths)
    sampling = SamplingTensors.build([1.0] * len(slots), device=logits.device)
    rejection_sample(logits, [[3] * (w - 1) for w in widths], sampling, torch.rand(sum(widths), 2))
    for slot in slots:
        runner.crop(slot, context)


def _time_drafting(drafter, grid: list[int], context: int) -> dict[int, float]:
    """{num_reqs: seconds of one more draft per row}: a call drafting two tokens per row less one drafting one, so
    that the curve holds what a further draft forward costs (the forward, sampling the drafts, the drafter's
    bookkeeping), which is what the engine prices and refines it with, and not a call's one-off work (syncing each
    row's cache, its first forward). A single scale had to fit both: timing whole one-draft calls, the refined
    curve read 0.59 ms at one row where a further forward took 0.40, and 10-15% too little at 32-64 rows. The same
    requests every time: the drafter re-feeds each one's last token (its cache keeps one token uncached)."""
    requests = [DraftRequest(-1 - i, -1 - i, [3] * context + [4], context) for i in range(max(grid))]
    try:
        drafter.propose(requests, [2] * len(requests))  # prefill and warm-up
        times = _block_times({(n, k): lambda n=n, k=k: drafter.propose(requests[:n], [k] * n)
                              for n in grid for k in (1, 2)})
        return {n: max(times[n, 2] - times[n, 1], _MIN_SECONDS) for n in grid}
    finally:
        for request in requests:
            drafter.finish(request)


def _block_times(runs: dict) -> dict:
    """Seconds per key (block, point), from _REPEATS timed rounds after a warm-up. The runs take turns, one round over
    all keys at a time, a block's points one after another: a slow spell of the machine (on a shared 2-core VM, one
    lasting seconds once measured 128 rows at 1.45x their cost) then slows one round of every point instead of every
    repeat of a few. A block's shape, each point's share of the block's time, is the median over rounds of its share
    within the round: its points run milliseconds apart, so the machine's speed, which moves from one round to the
    next (by 1.5x within a profile), cancels. Its level is the block's fastest round: interference only adds time.
    Each point the fastest of its own rounds instead, the step-cost shape moved with the spells: over 6 profiles, the
    cost of 9 tokens per row over 5 at 64 and 128 rows varied by 9% and 11% (coefficient of variation), against 1.4%
    and 2.1% so; the K the closed batches choose follows those slopes."""
    for run in runs.values():
        run()
    times = {key: [] for key in runs}
    for _ in range(_REPEATS):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    blocks: dict = {}
    for key in runs:
        blocks.setdefault(key[0], []).append(key)
    seconds = {}
    for keys in blocks.values():
        totals = [sum(round_) for round_ in zip(*(times[key] for key in keys))]
        shares = {key: statistics.median(t / total for t, total in zip(times[key], totals)) for key in keys}
        level = min(totals) / sum(shares.values())
        seconds.update({key: share * level for key, share in shares.items()})
    return seconds


def _monotone(verify: dict, draft: dict | None, ragged: dict) -> StepCostModel:
    """Timing noise can make a larger batch look cheaper: fit each curve by isotonic regression. Each per-token cost
    is the widest uniform point's seconds less the ragged one's, per token short of it, kept between 1% of the
    fitted curve's least slope and that slope (a wider row must not cost less than its tokens)."""
    def fit(curve: dict) -> dict:
        xs = sorted(curve)
        return {x: float(y) for x, y in zip(xs, isotonic([curve[x] for x in xs]))}
    verify = {n: fit(c) for n, c in verify.items()}
    per_token = {}
    for n, (tokens, seconds) in ragged.items():
        points = sorted(verify[n].items())
        least = min((s1 - s0) / (x1 - x0) for (x0, s0), (x1, s1) in zip(points, points[1:]))
        widest, widest_seconds = points[-1]
        if least > 0:
            per_token[n] = min(max((widest_seconds - seconds) / (widest - tokens), 0.01 * least), least)
    return StepCostModel(verify, None if draft is None else fit(draft), per_token)


def doubling_grid(limit: int) -> list[int]:
    """1, 2, 4, ... below limit, then limit."""
    grid, n = [], 1
    while n < limit:
        grid.append(n)
        n *= 2
    return grid + [limit]


def _architecture(model) -> dict:
    config = model.config
    return {"class": type(model).__name__, **{name: getattr(config, name, None) for name in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size")}}
