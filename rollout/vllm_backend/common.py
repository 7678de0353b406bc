"""What the two vLLM backends share, the in-process engine (rollout/vllm_backend/) and the server client
(rollout/server_backend/backend.py). No vllm import: both read plain ids, logprobs, per-step lists and counter values
from their own responses and hand them here.

- each sample's acceptance record is rebuilt from vLLM's per-request metrics at the "detailed" level (drafts offered
  and accepted per step), so it has the embedded record's fields; `k_per_step` lists only the steps in which the
  request was offered drafts (vLLM does not report steps with K = 0);
- the aggregate counts (spec steps, draft tokens, accepted tokens, accepted per position) and `num_steps` are the
  differences of vLLM's cumulative engine counters across the call; the histogram, drafts per position and K
  offered come from the records; `k_per_batch_size` is empty (vLLM does not report a step's batch size);
- the models are known by their folders (`VLLMCommon`): weight loads are checked against the folder's HF parameter
  names and shapes, and the drafter refresh trains a copy of the draft folder's model;
- the engine is built with its speculative config: a drafter cannot be swapped on a running engine.
"""

from typing import Iterable

import torch
from transformers import AutoModelForCausalLM

from rollout.outputs import RolloutBatch, Sample, build_batch, history_stats
from rollout.vllm_backend.wire import CONFIG_KEY  # noqa: F401  TEMPORARY: drafting.py's import, moved to wire
from rollout.weights import no_draft_model, parameter_skeleton, stage_weights
from spec import AcceptanceStats, RequestAcceptance, SpecConfig

COUNTED = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_accepted_per_position")
# vLLM's counter names (without the Prometheus suffixes _total / _count) -> ours; the step count is the number of
# observations of a histogram that vLLM observes once per engine step
COUNTER_NAMES = {"vllm:spec_decode_num_drafts": "num_spec_steps",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_draft_tokens",
                 "vllm:iteration_tokens_total": "num_steps"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


class VLLMCommon:
    """What both vLLM backends do alike, from what each sets: `model_path` and `draft_path` (the model folders; None
    where not on this machine), `config` (the speculative config, None: none) and `dtype`."""

    model_path: str | None
    draft_path: str | None
    config: SpecConfig | None
    dtype: torch.dtype

    def draft_model_copy(self) -> torch.nn.Module:
        """The draft folder's model, float32 on the CPU (not draft weights loaded into the engine since)."""
        return AutoModelForCausalLM.from_pretrained(self.draft_folder(), dtype=torch.float32, local_files_only=True)

    def draft_folder(self) -> str:
        """The draft model's local folder; ValueError where the method has none, or it is not on this machine."""
        if self.config is None or self.config.method != "draft_model":
            raise no_draft_model(self.config)
        return require_local(self.draft_path, "draft_model")

    def stage(self, role: str, named_tensors) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """(staged tensors, number given): every tensor checked against the folder's HF parameters (role "target" or
        "draft model"), converted to the engine's dtype on the CPU (rollout/weights.py)."""
        folder = require_local(self.model_path, "model") if role == "target" else self.draft_folder()
        params, model_name = parameter_skeleton(folder)
        return stage_weights(params, named_tensors, role, model_name, device="cpu", dtype=self.dtype)


    def build_speculation(self, config, draft_model=None):
        raise NotImplementedError("a vLLM engine runs the speculative config it was built with; build a "
                                  "RolloutGenerator per config, or use backend='embedded' to swap drafters")

    use_speculation = build_speculation


def require_local(path: str | None, field: str) -> str:
    if path is None:
        raise ValueError(f"{field}=None: the server's {field} folder is not on this machine; pass {field}=<a "
                         f"local copy of it> to RolloutGenerator (needed for weight loads and drafter refresh)")
    return path


def acceptance_record(per_step_drafted, per_step_accepted, num_spec_tokens: int) -> RequestAcceptance:
    """A request's record from vLLM's per-step drafted and accepted counts (None: no metrics, an empty record)."""
    record = RequestAcceptance.sized(num_spec_tokens)
    for num_drafted, num_accepted in zip(per_step_drafted or (), per_step_accepted or ()):
        record.observe(num_drafted, num_accepted)
    return record


def make_sample(i: int, j: int, prompt_ids: list[int], ids: list[int], logprobs: list[float] | None,
                finish_reason: str | None, record: RequestAcceptance, decode, source: str) -> Sample:
    """Sample j of prompt i; RuntimeError naming `source` (the engine or server) when vLLM ended it otherwise than
    by a stop or the length limit, or returned no logprobs for it."""
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"{source} ended sample {j} of prompt {i} with finish_reason={finish_reason!r} after "
                           f"{len(ids)} tokens")
    if logprobs is None or len(logprobs) != len(ids):
        raise RuntimeError(f"{source} returned no logprobs for sample {j} of prompt {i} (DSpark's adaptive "
                           "verification cannot return them); set enable_adaptive_verification=false for rollouts a "
                           "trainer uses")
    return Sample(i, j, list(prompt_ids), list(ids), list(logprobs), None if decode is None else decode(ids),
                  finish_reason, record.to_dict())


def vllm_batch(samples: list[Sample], records: list[RequestAcceptance], counters: dict, elapsed: float,
               drafter: dict | None = None) -> RolloutBatch:
    """The batch; counters: the call's engine-counter differences (COUNTED and num_steps); drafter: the differences
    of the project's proposer's counts over the call (vllm_backend/proposer.py), None under vLLM's own drafters."""
    stats = AcceptanceStats()
    for record in records:
        stats.add(record)
    for name in COUNTED:
        setattr(stats.total, name, counters[name])
    extra, metrics = history_stats(drafter)
    if drafter is not None:
        extra.update(drafter_seconds=drafter["seconds"], num_drafter_faults=drafter["num_faults"],
                     num_proposed_draft_tokens=drafter["num_draft_tokens"])
        metrics.update({"spec/drafter_time_fraction": drafter["seconds"] / max(elapsed, 1e-9),
                        "spec/num_drafter_faults": float(drafter["num_faults"])})
    return build_batch(samples, stats, num_row_steps=sum(map(_num_row_steps, samples)),
                       num_steps=counters["num_steps"], elapsed=elapsed, stats=extra, metrics=metrics)


def engine_counters(readings: Iterable[tuple[str, int | None, float]], num_spec_tokens: int) -> dict:
    """COUNTED and num_steps from vLLM's cumulative metrics, given as (name without Prometheus suffix, draft position
    for the per-position counter else None, value) readings; several readings of one name (label sets) add up."""
    counters = {name: 0 for name in COUNTER_NAMES.values()}
    counters["num_accepted_per_position"] = [0] * num_spec_tokens
    for name, position, value in readings:
        if name == PER_POSITION:
            if position < num_spec_tokens:
                counters["num_accepted_per_position"][position] += int(value)
        elif name in COUNTER_NAMES:
            counters[COUNTER_NAMES[name]] += int(value)
    return counters


def counters_from_records(records: list[RequestAcceptance], num_spec_tokens: int) -> dict:
    """The COUNTED sums over the records (what the engine counters' differences are when nothing else ran)."""
    per_position = [0] * num_spec_tokens
    for record in records:
        per_position = [a + b for a, b in zip(per_position, record.num_accepted_per_position)]
    sums = {name: sum(getattr(r, name) for r in records) for name in COUNTED[:3]}
    return {**sums, "num_accepted_per_position": per_position}


def difference(after: dict, before: dict) -> dict:
    return {name: [a - b for a, b in zip(value, before[name])] if isinstance(value, list) else value - before[name]
            for name, value in after.items()}


def _num_row_steps(sample: Sample) -> int:
    """Steps the request took part in: each emits its accepted drafts + 1 token, except that the last one may be
    cut by max_tokens or a stop token; the first (prefill) step has no drafts."""
    record = sample.acceptance
    return max(record["num_spec_steps"] + 1, len(sample.completion_ids) - record["num_accepted_draft_tokens"])
