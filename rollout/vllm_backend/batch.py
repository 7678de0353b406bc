"""vLLM's outputs -> a RolloutBatch, for the in-process engine and the server client alike. No vllm import: it takes
plain ids, logprobs and per-step lists, which both read from their own responses.

- each sample's acceptance record is rebuilt from vLLM's per-request metrics at the "detailed" level (drafts offered
  and accepted per step), so it has the embedded record's fields; `k_per_step` lists only the steps in which the
  request was offered drafts (vLLM does not report steps with K = 0);
- the aggregate counts (spec steps, draft tokens, accepted tokens, accepted per position) and `num_steps` are the
  differences of vLLM's cumulative engine counters across the call; the histogram, drafts per position and K
  offered come from the records; `k_per_batch_size` is empty (vLLM does not report a step's batch size).
"""

from rollout.outputs import RolloutBatch, Sample
from spec import AcceptanceStats, RequestAcceptance

COUNTED = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_accepted_per_position")


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


def rollout_batch(samples: list[Sample], records: list[RequestAcceptance], counters: dict,
                  elapsed: float) -> RolloutBatch:
    """The batch, its stats and its `spec/...` metrics; counters: the call's engine-counter differences (COUNTED
    and num_steps)."""
    stats = AcceptanceStats()
    for record in records:
        stats.add(record)
    total = stats.total
    for name in COUNTED:
        setattr(total, name, counters[name])
    num_tokens = sum(len(s.completion_ids) for s in samples)
    verified = (sum(map(_num_row_steps, samples)) + total.num_draft_tokens) / max(num_tokens, 1)
    tokens_per_s = num_tokens / max(elapsed, 1e-9)
    stats_dict = {**stats.to_dict(), "num_steps": counters["num_steps"], "num_completion_tokens": num_tokens,
                  "verified_tokens_per_emitted_token": verified, "elapsed_s": elapsed, "tokens_per_s": tokens_per_s}
    metrics = {**stats.to_metrics(), "spec/rollout_tokens_per_s": tokens_per_s,
               "spec/verified_tokens_per_emitted_token": verified}
    return RolloutBatch(samples, stats_dict, metrics)


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
