"""The rollout engine and `RolloutGenerator`; built on `spec`."""

from rollout.default_models import default_model_paths
from rollout.default_task import default_prompts
from rollout.generator import RolloutGenerator
from rollout.outputs import RolloutBatch, Sample
from rollout.sampling_params import SamplingParams

__all__ = ["RolloutBatch", "RolloutGenerator", "Sample", "SamplingParams", "default_model_paths",
           "default_prompts"]
