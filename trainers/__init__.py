"""TRL integration: `SpecRolloutCallback` (weight sync, acceptance metrics, drafter refresh) and TRL's
importance-sampling correction on rollout logprobs; built on `rollout` and `spec`. A `RolloutGenerator` is itself
the rollout function: `trl.GRPOTrainer(rollout_func=generator, callbacks=[SpecRolloutCallback(generator)])`."""

from rollout import RolloutGenerator
from trainers.callback import SpecRolloutCallback
from trainers.drafter_refresh import DrafterRefresh
from trainers.importance_sampling import enable_importance_sampling, is_importance_sampling_enabled
from trainers.rollout_func import rollout_for_trainer
from trainers.weight_sync import WeightSync, policy_weights

RolloutGenerator.trainer_adapter = staticmethod(rollout_for_trainer)

__all__ = ["DrafterRefresh", "SpecRolloutCallback", "WeightSync", "enable_importance_sampling",
           "is_importance_sampling_enabled", "policy_weights"]
