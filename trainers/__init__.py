"""TRL integration: `SpecRolloutCallback` (the rollout function, weight sync, acceptance metrics, drafter refresh)
and TRL's importance-sampling correction on rollout logprobs; built on `rollout` and `spec`:
`callback = SpecRolloutCallback(generator)`, then `trl.GRPOTrainer(rollout_func=callback.rollout_func,
callbacks=[callback])`."""

from trainers.callback import SpecRolloutCallback
from trainers.drafter_refresh import DrafterRefresh
from trainers.importance_sampling import enable_importance_sampling, is_importance_sampling_enabled
from trainers.weight_sync import WeightSync, policy_weights

__all__ = ["DrafterRefresh", "SpecRolloutCallback", "WeightSync", "enable_importance_sampling",
           "is_importance_sampling_enabled", "policy_weights"]
