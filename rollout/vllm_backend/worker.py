"""The worker extension vLLM loads in its worker processes: `worker_extension_cls=WORKER_EXTENSION` (wire.py)
for `vllm.LLM`, `--worker-extension-cls rollout.vllm_backend.worker.WorkerExtension` for a server (`python -m
rollout serve` adds it).

vLLM imports this module inside each worker during init_worker, before the model loads and before anything is
sampled, in every layout: the in-process engine (TP = 1), the spawned workers of tensor parallelism, the worker
process of the OpenAI server. Importing it applies the CPU sampler fix there (sampler_fix.py) and, on vLLM 0.34+,
registers the project's speculative methods (versions.py; the plugin entry point does too, where the project is
installed). vLLM then mixes the class into its worker class, so its methods are callable by name from
`llm.collective_rpc(name, kwargs=...)` and from a dev-mode server's `POST /collective_rpc {"method": name, "kwargs":
{...}}`, on every TP rank. The project's drafter is found in either runner by one helper (`_rollout_proposer`).

The extension is also where the project's drafter meets the worker: vLLM sets `self.model_runner` when the worker builds
its runner (the runner builds the drafter), and the extension's `model_runner` property hands that runner to the
custom_class proposer (versions.V1CustomClass.attach_runner: vLLM 0.32-0.33), which reads each step's request ids from
it. A vLLM whose runner lacks what the proposer reads fails there, at start-up, naming the supported versions. (vLLM
refuses an extension whose attributes its worker class already has, and sets model_runner per instance: the property
stands.)
"""

import glob
import os

from rollout.vllm_backend.sampler_fix import apply_cpu_sampling_fix, is_cpu_sampling_fixed
from rollout.history import DrafterHistory, keeps_history
from rollout.vllm_backend.plugin import register_methods
from rollout.vllm_backend.versions import find_drafting, generation
from rollout.vllm_backend.wire import check_extension

apply_cpu_sampling_fix()
register_methods()


class WorkerExtension:
    """Methods added to vLLM's worker (`self` is the worker: self.model_runner, self.vllm_config)."""

    @property
    def model_runner(self):
        """vLLM's model runner of this worker, as vLLM set it (None before)."""
        return self.__dict__.get("_rollout_model_runner")

    @model_runner.setter
    def model_runner(self, runner) -> None:
        self.__dict__["_rollout_model_runner"] = runner
        if runner is not None:
            generation().attach_runner(runner)  # the project's proposer learns its runner here (module docstring)

    def reload_draft_weights(self, weights=None, weights_path: str | None = None) -> int:
        """Load the draft model's weights in place: `weights` ((HF name, tensor) pairs, in-process) or the
        *.safetensors files under `weights_path` (a server; the folder must be readable by the worker). vLLM's
        layerwise reload (initialize, load, finalize) re-runs the CPU build's weight repacking, which a plain
        `model.load_weights` does not. Returns the number of parameters loaded on this rank. The caller checks the
        weights first (rollout/weights.py): a failure here can leave the drafter partly loaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        model = self.model_runner.get_draft_model()
        if model is None:
            raise ValueError("this vLLM engine has no draft model (its speculative method has none); draft weights "
                             "need method 'draft_model'")
        if (weights is None) == (weights_path is None):
            raise ValueError("reload_draft_weights takes exactly one of weights=[(name, tensor), ...] and "
                             "weights_path='<folder of *.safetensors>'")
        source = weights if weights is not None else read_safetensors(weights_path)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            loaded = model.load_weights(source)
            finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        repack_tied_lm_head(model)
        return len(loaded or ())

    def repack_tied_lm_head(self) -> bool:
        """After vLLM's own `reload_weights` of the target: re-pack a tied lm_head (see repack_tied_lm_head)."""
        return repack_tied_lm_head(self.model_runner.get_model())

    def rollout_drafter_stats(self) -> dict | None:
        """The project's drafter's cumulative counts on this rank (drafting.py), with its history drafter's requests
        started and those whose prompt had history then; None under another drafter."""
        proposer = self._rollout_proposer()
        if proposer is None:
            return None
        return {**proposer.stats, **getattr(proposer.drafter, "history_counts", {})}

    def add_rollout_history(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> bool:
        """Add finished rollouts (each prompt's and its completion's token ids, checked by the caller) to this
        rank's rollout history, as its own finished requests are; False where the drafter keeps none."""
        history = self._rollout_history()
        if history is not None:
            history.add(prompt_ids, completion_ids)
        return history is not None

    def use_rollout_schedule(self, schedule: list[list[int]]) -> None:
        """Make the project's drafter follow `schedule` ([[start, end, K], ...]) from its next step on, where it
        applies the schedule itself (vLLM 0.32-0.33; on 0.34+ vLLM's scheduler does: the backend writes it there)."""
        proposer = self._rollout_proposer(required="a schedule for the project's drafter")
        proposer.config = proposer.config.with_schedule(schedule)

    def save_rollout_history(self, path: str) -> bool:
        """Write this rank's rollout history to `path` (rank 0 only: every rank holds the same); False where the
        drafter keeps none."""
        history = self._rollout_history()
        if history is not None and self.rank == 0:
            history.save(path)
        return history is not None

    def load_rollout_history(self, path: str) -> bool:
        """Replace this rank's rollout history with the one at `path` (ValueError for a file that is not one of this
        model's); False where the drafter keeps none."""
        history = self._rollout_history()
        if history is not None:
            history.load(path)
        return history is not None

    def _rollout_history(self) -> DrafterHistory | None:
        """The project's drafter's rollout history on this rank (rollout/history.py), None where it keeps none."""
        drafting = self._rollout_proposer()
        if drafting is None or not keeps_history(drafting.config):
            return None
        return DrafterHistory(drafting.drafter, drafting.vocab_size)

    def _rollout_proposer(self, required: str | None = None):
        """The project's drafter on this rank (drafting.RolloutDrafting: config, drafter, stats, vocab_size) under
        either vLLM runner (versions.find_drafting); None under another drafter, or ValueError naming `required`."""
        drafting = find_drafting(self.model_runner)
        if drafting is None and required:
            raise ValueError(f"{required} needs an engine that runs it (method 'history' or 'custom_class')")
        return drafting

    def sampler_fix_applied(self) -> bool:
        """Whether this worker samples with the fixed CPU kernels (always true off the CPU build's bug path)."""
        from vllm.platforms import current_platform
        return not current_platform.is_cpu() or is_cpu_sampling_fixed()


check_extension(WorkerExtension)  # the worker-call table (wire.py) names exactly these methods and keywords


def repack_tied_lm_head(model) -> bool:
    """vLLM's CPU build packs each linear layer's weight for its GEMM when the model loads (lm_head included:
    dispatch_cpu_unquantized_gemm keeps a packed copy). A tied lm_head shares the embedding's parameter, which
    load_weights fills through embed_tokens only, so a layerwise reload never re-packs lm_head and the logits keep
    the old weights. Re-pack it from the parameter; True if it was a tied lm_head on CPU (else nothing to do)."""
    from vllm.platforms import current_platform
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not current_platform.is_cpu() or lm_head is None or embed is None or lm_head.weight is not embed.weight:
        return False
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return True


def read_safetensors(path: str):
    """(name, tensor) pairs of every *.safetensors file under `path` (or of `path` itself, a file), on the CPU."""
    from safetensors.torch import load_file
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"weights_path={path!r}: no *.safetensors file there (is the folder shared with "
                                "this server's machine?)")
    for file in files:
        yield from load_file(file, device="cpu").items()
