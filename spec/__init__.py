"""Speculative-decoding algorithms: config and per-batch-size schedule, drafters, lossless verification,
acceptance metrics. Depends on torch and numpy only; never on `rollout` or `trainers`."""

from spec.config import SpecConfig
from spec.metrics import AcceptanceStats, RequestAcceptance
from spec.proposers import DraftRequest, Proposal, Proposer, build_proposer
from spec.rejection import VerifyResult, rejection_sample
from spec.sampling import SamplingTensors, processed_logprobs
from spec.schedule import BatchSizeSchedule

__all__ = [
    "AcceptanceStats", "BatchSizeSchedule", "DraftRequest", "Proposal", "Proposer", "RequestAcceptance",
    "SamplingTensors", "SpecConfig", "VerifyResult", "build_proposer", "processed_logprobs", "rejection_sample",
]
