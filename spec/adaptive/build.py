"""The speculation policy a config asks for, one rule for both engines (rollout/embedded_backend/backend.py and
vLLM's workers, rollout/vllm_backend/drafting.py): adaptive verification where `enable_adaptive_verification`, else
the static schedule; wrapped in the measured guard (spec/measured_guard.py) where `enable_measured_guard`."""

from spec.adaptive.policy import AdaptivePolicy
from spec.config import SpecConfig
from spec.measured_guard import MeasuredGuard
from spec.policy import SpeculationPolicy, StaticPolicy


def build_policy(config: SpecConfig, padding=None) -> SpeculationPolicy:
    """config's policy; padding: the runner's padded-queries rule (the embedded engine's; None elsewhere)."""
    policy = AdaptivePolicy(config.num_speculative_tokens, padding=padding) if config.enable_adaptive_verification \
        else StaticPolicy()
    return MeasuredGuard(policy) if config.enable_measured_guard else policy
