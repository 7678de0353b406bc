"""`SpecRolloutCallback`: a RolloutGenerator as a trainer's rollout function, with what a trainer needs around it.

    generator = RolloutGenerator("default", speculative_config=...)
    callback = SpecRolloutCallback(generator, drafter_refresh_steps=10)
    trainer = GRPOTrainer(model=policy, rollout_func=callback.rollout_func, callbacks=[callback], ...)

`rollout_func(prompts, trainer)` checks the call (rollout_func.py); before the rollout it copies the policy's weights
into the generator's target when `global_step` changed (weight_sync.py) and, on the first rollout, switches TRL's
importance-sampling correction on if the GRPOConfig asks (importance_sampling.py). After each rollout the acceptance
metrics go to the trainer's logs (metrics.py); with a rollout-history drafter (method "history") on several processes
every process's rollouts reach every process's history, whichever process a prompt goes to next
(`generator.share_rollout_history`, one all-gather after the metrics' gather; `share_history=False` turns it off;
`spec/history_hit_rate`: the share of requests whose prompt had history, `spec/history_share_s`: the sharing's seconds);
and the rollouts join the drafter refresh's collection. At the end of every `drafter_refresh_steps`-th optimizer step
the draft model is distilled toward the policy on them and loaded into the generator's drafter (drafter_refresh.py; the
mean KL: `spec/drafter_refresh_kl`). Seconds and KL are logged with the next rollout's metrics. Trainer processes
sharing servers (`generator.is_shared`) share their drafter: the servers' writer process (weight_sync.py) refreshes it,
and the next weight sync's barrier holds the others until it is loaded. The rollout history is saved with each trainer
checkpoint, one file for the job, and restored on resume (history_checkpoint.py).
"""

from transformers import TrainerCallback

from rollout import RolloutBatch, RolloutGenerator
from trainers.drafter_refresh import DrafterRefresh
from trainers.history_checkpoint import history_path, restore_history, save_history
from trainers.importance_sampling import enable_importance_sampling, is_importance_sampling_enabled
from trainers.metrics import log_rollout_metrics
from trainers.rollout_func import plan_rollout, run_rollout, trainer_outputs
from trainers.weight_sync import WeightSync, zero_stage


class SpecRolloutCallback(TrainerCallback):
    """drafter_refresh_steps: refresh the draft model every this many optimizer steps (None: never);
    drafter_learning_rate: its AdamW learning rate; share_history: share each rollout with the other processes'
    rollout histories (module docstring)."""

    def __init__(self, generator: RolloutGenerator, *, drafter_refresh_steps: int | None = None,
                 drafter_learning_rate: float = 1e-4, share_history: bool = True):
        if not isinstance(share_history, bool):
            raise ValueError(f"share_history={share_history!r}: must be True or False")
        self.generator = generator
        self.share_history = share_history
        self.weight_sync = WeightSync(generator)
        self.drafter_refresh = None if drafter_refresh_steps is None else DrafterRefresh(
            generator, every_n_steps=drafter_refresh_steps, learning_rate=drafter_learning_rate)
        self.last_metrics: dict[str, float] = {}
        self._is_attached = False  # the trainer calls our TrainerCallback hooks
        self._pending: dict[str, float] = {}  # logged with the next rollout's metrics

    def rollout_func(self, prompts: list, trainer) -> dict:
        """TRL's rollout function (`GRPOTrainer(rollout_func=callback.rollout_func)`), called on every process with
        its slice of the generation batch: check, sync, roll out, log; the dict TRL expects (rollout_func.py)."""
        rollout = plan_rollout(self.generator, prompts, trainer)
        self.before_rollout(trainer)
        batch = run_rollout(self.generator, rollout)
        self.after_rollout(trainer, batch)
        return trainer_outputs(batch, rollout.params.max_tokens)

    def before_rollout(self, trainer) -> None:
        if self.drafter_refresh is not None and not self._is_attached:
            raise ValueError("drafter_refresh_steps is set but the trainer does not run this callback; pass "
                             "callbacks=[callback] to the trainer")
        if self.drafter_refresh is not None and zero_stage(trainer.accelerator) == 3:
            raise NotImplementedError("drafter_refresh_steps with DeepSpeed ZeRO-3: each process distils its drafter "
                                      "against the policy on its own rollouts, which sharded parameters cannot serve; "
                                      "drop drafter_refresh_steps or use ZeRO-2 / DDP")
        if trainer.args.vllm_importance_sampling_correction and not is_importance_sampling_enabled(trainer):
            enable_importance_sampling(trainer)
        self.weight_sync.maybe_sync(trainer)

    def after_rollout(self, trainer, batch: RolloutBatch) -> None:
        config = self.generator.config  # read per rollout: `rollout tune` and benchmarks change it between calls
        num_positions = 0 if config is None else config.num_speculative_tokens
        self.last_metrics = log_rollout_metrics(trainer, batch, num_positions, extra=self._pending)
        self._pending = {}
        if self.share_history and self.generator.rollout_history is not None:
            # the metrics' gather has synced the processes: the share's time is its own, not a wait for the slowest
            # rollout; it is logged with the next rollout's
            self._pending["spec/history_share_s"] = self.generator.share_rollout_history(batch)["seconds"]
        if self.drafter_refresh is not None and trainer.model.training:
            self.drafter_refresh.add(batch, trainer.args.temperature)

    # TrainerCallback hooks.
    def on_init_end(self, args, state, control, **kwargs):
        self._is_attached = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._is_attached = True
        if state.global_step > 0:  # resumed from a checkpoint (its state is loaded before this hook)
            restore_history(self.generator, history_path(args.output_dir, state.global_step), args.process_index)

    def on_save(self, args, state, control, **kwargs):
        if args.process_index == 0:  # one file for the job: with shared histories, every process holds the same
            save_history(self.generator, history_path(args.output_dir, state.global_step))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.drafter_refresh is None or not self.drafter_refresh.is_due(state.global_step):
            return
        if self.weight_sync.is_writer is False:  # a shared backend that another process writes
            self.drafter_refresh.sequences.clear()
            return
        self._pending["spec/drafter_refresh_kl"] = self.drafter_refresh.refresh(teacher=model)
