"""Adaptive verification (`enable_adaptive_verification`): the speculation policy that sizes each request's drafts
from the drafter's confidence and the measured step costs, and what it stands on: confidence calibration, the
draft budget, the step-cost model and its profiling. The schedule tuner
(`rollout tune`), which prices Ks with the same cost model, is core: spec/tuning.py. Nothing in the spec core imports
this package."""

from spec.adaptive import cost_profile
from spec.adaptive.calibration import ConfidenceCalibrator
from spec.adaptive.policy import AdaptivePolicy
from spec.adaptive.step_cost import StepCostModel

__all__ = ["AdaptivePolicy", "ConfidenceCalibrator", "StepCostModel", "cost_profile"]
