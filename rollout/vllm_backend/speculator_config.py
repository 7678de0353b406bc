"""The SpeculatorConfig of this project's drafters on vLLM 0.34+, registered for the methods `history` and
`custom_class` by versions.register_methods. vLLM resolves it in every process (the server's front end included),
so, as vLLM asks of its config modules, it names the speculator (speculator.py) without importing it.

Everything else is the base class's: no draft model (the target's config serves as the draft config), the token
history left where vLLM keeps it by default (the speculator reads each step's new tokens from it), no hidden states.
The confidences this speculator gives vLLM's adaptive verification are the project's policy's choice, not derived from
draft logits.

vLLM's SpeculatorConfig is imported only when vLLM resolves `RolloutSpeculatorConfig` (the class is built then), so
the module imports without vLLM."""

from rollout.vllm_backend.lazy_class import build_on_vllm


def __getattr__(name: str):
    """`RolloutSpeculatorConfig`, built and kept at the first request for it."""
    return build_on_vllm(globals(), name, "RolloutSpeculatorConfig",
                         "vllm.v1.worker.gpu.spec_decode.speculator_config.SpeculatorConfig",
                         attrs={"speculator_class": "rollout.vllm_backend.speculator.RolloutSpeculator",
                                "adaptive_verification_uses_draft_logits": False})
