"""TRL's importance-sampling correction on a rollout function's logprobs.

GRPOTrainer (TRL 1.16) corrects for the gap between the sampler's logprobs and the trainer's recomputed ones
(bf16 autocast, kernels, a stale sampler) with a ratio exp(old_logps - sampling_logps), truncated or masked by
`vllm_importance_sampling_mode` and its clip bounds, but only when `use_vllm` is set; a rollout_func's `logprobs`
reach it as `sampling_per_token_logps` and are otherwise unused. `use_vllm=True` in the GRPOConfig would start
vLLM, so `enable_importance_sampling` flips the trainer's own flag after construction instead. That flag gates,
on the rollout_func path: the correction (ratio, loss weighting, `sampling/...` metrics), the extra forward that
computes old_logps, and one weight-sync call per step on `trainer.vllm_generation`, which becomes a stand-in
whose sync is a no-op (SpecRolloutCallback syncs the generator). The tool-call loop would also take the vLLM
path, hence tools are refused. The configuration keys are TRL's: `vllm_importance_sampling_correction`,
`vllm_importance_sampling_mode`, `vllm_importance_sampling_clip_min` / `_clip_max`.
"""


class RolloutFuncBackend:
    """Stands where GRPOTrainer keeps its vLLM backend; the generator's weights are synced elsewhere."""

    def sync_weights(self) -> None:
        pass


def enable_importance_sampling(trainer) -> None:
    """Make `trainer` (a GRPOTrainer with a rollout_func) apply its importance-sampling correction to the rollout
    logprobs. Call it once, after constructing the trainer; SpecRolloutCallback calls it when the GRPOConfig's
    `vllm_importance_sampling_correction` is True (TRL's default)."""
    if getattr(trainer, "rollout_func", None) is None:
        raise ValueError("rollout_func=None: importance sampling on rollout logprobs needs "
                         "GRPOTrainer(rollout_func=generator)")
    if trainer.args.use_vllm:
        return  # TRL applies it already
    if not trainer.args.vllm_importance_sampling_correction:
        raise ValueError("vllm_importance_sampling_correction=False: set it to True in the GRPOConfig to correct "
                         "with the rollout logprobs")
    if getattr(trainer, "tools", None):
        raise NotImplementedError("importance sampling with tools: GRPOTrainer's tool loop would generate with vLLM")
    if trainer.loss_type == "vespo" and trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        raise ValueError(f"vllm_importance_sampling_mode={trainer.vllm_importance_sampling_mode!r}: the vespo loss "
                         "needs 'token_truncate' or 'token_mask'")  # GRPOTrainer's own check, skipped at its init
    trainer.vllm_generation = RolloutFuncBackend()
    trainer._last_loaded_step = trainer.state.global_step
    trainer.use_vllm = True


def is_importance_sampling_enabled(trainer) -> bool:
    return bool(getattr(trainer, "use_vllm", False) and trainer.vllm_importance_sampling_correction)
