"""Adaptive verification (`enable_adaptive_verification`): the one speculation policy, for both engines, that sizes
each request's drafts from the drafter's confidence and the step costs the engine has run, and what it stands on:
confidence calibration, the draft budget and the online step-cost fit. Nothing in the spec core imports this
package."""

from spec.adaptive.build import build_policy
from spec.adaptive.calibration import ConfidenceCalibrator
from spec.adaptive.policy import AdaptivePolicy
from spec.adaptive.step_fit import StepFit, StepPrice

__all__ = ["AdaptivePolicy", "ConfidenceCalibrator", "StepFit", "StepPrice", "build_policy"]
