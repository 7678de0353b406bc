"""The rollout engine and `RolloutGenerator`; built on `spec`.

The public names load on first use (PEP 562), so that `python -m rollout --help`, which imports this package
first, answers without importing torch; `from rollout import RolloutGenerator` works as usual.
"""

from rollout.lazy import lazy_getattr

_MODULES = {"RolloutBatch": "rollout.outputs", "RolloutGenerator": "rollout.generator", "Sample": "rollout.outputs",
            "SamplingParams": "rollout.sampling_params", "default_model_paths": "rollout.default_models",
            "default_prompts": "rollout.default_task", "default_speculative_config": "rollout.defaults",
            "DEFAULT_SCHEDULE": "rollout.defaults"}

__all__ = sorted(_MODULES)

__getattr__ = lazy_getattr(__name__, _MODULES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
