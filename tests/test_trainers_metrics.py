"""Acceptance metrics in the trainer's logs (trainers/metrics.py): present in log_history and in what the report_to
integrations receive, equal to the rollouts' own counts, and consistent with RolloutBatch.metrics."""

import dataclasses

import pytest

from rollout import SamplingParams
from trainers.metrics import log_rollout_metrics, rollout_counts, spec_metrics
from trainers_testing import NUM_SPECULATIVE_TOKENS, shared_grpo_run, tiny_generator

KEYS = ("spec/acceptance_rate", "spec/mean_acceptance_length", "spec/acceptance_rate_pos_0", "spec/mean_k",
        "spec/verified_tokens_per_emitted_token", "spec/rollout_tokens_per_s", "spec/num_draft_tokens")


def _step_logs(logs: list[dict]) -> list[dict]:
    return [entry for entry in logs if "loss" in entry]


def test_metrics_reach_log_history():
    run = shared_grpo_run()
    steps = _step_logs(run.trainer.state.log_history)
    assert [entry["step"] for entry in steps] == [1, 2]
    for entry in steps:
        assert set(KEYS) <= set(entry)
        assert 0 <= entry["spec/acceptance_rate"] <= 1 and entry["spec/mean_k"] > 0


def test_metrics_reach_the_report_to_integrations():
    run = shared_grpo_run()
    steps = _step_logs(run.logs)  # the dict every callback's on_log gets, integrations included
    assert len(steps) == 2  # one a training step
    for entry in steps:
        assert set(KEYS) <= set(entry)


def test_logged_values_are_each_steps_rollout():
    run = shared_grpo_run()
    for entry, batch in zip(_step_logs(run.trainer.state.log_history), run.batches, strict=True):
        records = [s.acceptance for s in batch.samples]
        num_drafted = sum(r["num_draft_tokens"] for r in records)
        num_accepted = sum(r["num_accepted_draft_tokens"] for r in records)
        assert num_drafted > 0
        assert entry["spec/num_draft_tokens"] == num_drafted
        assert entry["spec/acceptance_rate"] == pytest.approx(num_accepted / num_drafted)
        num_tokens = sum(len(s.completion_ids) for s in batch.samples)
        assert entry["spec/rollout_tokens_per_s"] == pytest.approx(num_tokens / batch.stats["elapsed_s"])


def test_recomputed_metrics_match_the_generators_own():
    generator = tiny_generator()
    batch = generator.generate([[1, 20, 5], [1, 20, 6, 7]], 4, SamplingParams(max_tokens=10), use_tqdm=False)
    recomputed = spec_metrics(rollout_counts(batch, NUM_SPECULATIVE_TOKENS), NUM_SPECULATIVE_TOKENS)
    shared = set(recomputed) & set(batch.metrics)
    assert set(KEYS) <= shared
    assert {k: recomputed[k] for k in shared} == pytest.approx({k: batch.metrics[k] for k in shared})


def test_other_spec_keys_pass_through_and_eval_rollouts_log_as_eval():
    run = shared_grpo_run()
    trainer = run.trainer
    batch = dataclasses.replace(run.batches[0], metrics={**run.batches[0].metrics, "spec/custom": 2.5})
    trainer.model.eval()
    try:
        logged = log_rollout_metrics(trainer, batch, NUM_SPECULATIVE_TOKENS, extra={"spec/extra": 1.0})
        assert logged["spec/custom"] == 2.5 and logged["spec/extra"] == 1.0
        assert trainer._metrics["eval"]["spec/custom"] == [2.5]
    finally:
        trainer.model.train()
        trainer._metrics["eval"].clear()
