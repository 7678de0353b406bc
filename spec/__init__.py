"""Speculative-decoding algorithms: config and per-batch-size schedule, the speculation policy seam, drafters,
lossless verification, acceptance metrics and the model runners (their protocol: `Runner`). Depends on torch and
numpy only; never on `rollout` or `trainers`. Adaptive verification lives in `spec.adaptive`, which this core never
imports."""

from spec.config import SpecConfig
from spec.metrics import AcceptanceStats, RequestAcceptance
from spec.policy import DraftPlan, SpeculationPolicy, StaticPolicy, StepInfo, StepOutcome
from spec.proposers import DrafterConfigError, DraftRequest, Proposal, Proposer, build_proposer
from spec.rejection import VerifyResult, rejection_sample
from spec.runner import Runner
from spec.sampling import SamplingTensors, processed_logprobs
from spec.schedule import BatchSizeSchedule
from spec.uniforms import PositionUniforms

__all__ = [
    "AcceptanceStats", "BatchSizeSchedule", "DraftPlan", "DrafterConfigError", "DraftRequest", "PositionUniforms",
    "Proposal", "Proposer",
    "RequestAcceptance", "Runner", "SamplingTensors", "SpecConfig", "SpeculationPolicy", "StaticPolicy",
    "StepInfo", "StepOutcome", "VerifyResult", "build_proposer", "processed_logprobs", "rejection_sample",
]
