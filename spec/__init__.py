"""Speculative-decoding algorithms: config and per-batch-size schedule, drafters, lossless verification,
acceptance metrics. Depends on torch and numpy only; never on `rollout` or `trainers`."""

from spec.adaptive import AdaptiveVerifier
from spec.calibration import ConfidenceCalibrator
from spec.config import SpecConfig
from spec.metrics import AcceptanceStats, RequestAcceptance
from spec.proposers import DraftRequest, Proposal, Proposer, build_proposer
from spec.rejection import VerifyResult, rejection_sample
from spec.sampling import SamplingTensors, processed_logprobs
from spec.schedule import BatchSizeSchedule
from spec.step_cost import StepCostModel
from spec.uniforms import PositionUniforms

__all__ = [
    "AcceptanceStats", "AdaptiveVerifier", "BatchSizeSchedule", "ConfidenceCalibrator", "DraftRequest",
    "PositionUniforms", "Proposal", "Proposer", "RequestAcceptance", "SamplingTensors", "SpecConfig", "StepCostModel",
    "VerifyResult", "build_proposer", "processed_logprobs", "rejection_sample",
]
