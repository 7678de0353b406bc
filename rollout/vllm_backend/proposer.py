"""This project's drafters on vLLM 0.32-0.33: the proposer class vLLM's `custom_class` hook builds in each worker
(versions.py sends `{"method": "custom_class", "model": PROPOSER_CLASS}`); drafting.py does the drafting.

Each step vLLM's V1 model runner calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`, one row per
running request, and verifies the lists returned (any length up to K) as point drafts with its lossless rejection
sampler. What the drafter needs beyond token ids, the runner's input batch has: the request ids and prompt lengths.
The runner hands this class no reference to itself; the worker extension (worker.py) does, when vLLM sets the
worker's runner (versions.attach_runner, which fails the start-up on a runner without such a batch). Each call
reads the runner's current input batch (vLLM may rebuild it), checked to be the one whose token ids were passed. A
request's stop ids are read once, from its sampling params in the runner's `requests`: its EOS (vLLM leaves it None
under ignore_eos) and its stop_token_ids (where vLLM adds the generation config's other EOS ids), as vLLM stops it.

vLLM tells a custom_class proposer no K: K is the config's schedule at the live batch size
(`num_speculative_tokens_per_batch_size`, else num_speculative_tokens), which is not sent to vLLM. Requests that left
the input batch since the last step are finished; a call's last requests are finished at the next call's first step,
before it drafts.
"""

import time

from rollout.sampling_params import stop_ids
from rollout.vllm_backend.drafting import RolloutDrafting, Row
from rollout.vllm_backend.wire import PROPOSER_CLASS, WORKER_EXTENSION


class RolloutProposer:
    """Built by vLLM (`create_custom_proposer`) with its VllmConfig."""

    def __init__(self, vllm_config):
        self.drafting = RolloutDrafting(vllm_config, PROPOSER_CLASS, self._stop_ids)
        self.model_runner = None  # vLLM's model runner, handed over by the worker extension (versions.attach_runner)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        start = time.perf_counter()
        batch = self._input_batch(token_ids_cpu)
        self.drafting.finish(self.drafting.tracked_ids() - set(batch.req_id_to_index))
        rows = [Row(batch.req_ids[i], int(batch.num_prompt_tokens[i]), int(num_tokens_no_spec[i]), len(sampled))
                for i, sampled in enumerate(sampled_token_ids)]
        starts = self.drafting.missing(rows)
        tokens = [token_ids_cpu[i, first:row.num_tokens].tolist() for i, (row, first) in enumerate(zip(rows, starts))]
        k = self.drafting.config.schedule.k_for_batch_size(len(rows))
        return self.drafting.propose(rows, tokens, k, start)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's hook for a drafter's weights: the model-free drafters have none."""

    def _stop_ids(self, vllm_id: str) -> set[int]:
        params = self.model_runner.requests[vllm_id].sampling_params
        return stop_ids(() if params.eos_token_id is None else (params.eos_token_id,), params.ignore_eos,
                        params.stop_token_ids)

    def _input_batch(self, token_ids_cpu):
        """The runner's input batch whose token ids vLLM passed (module docstring)."""
        if self.model_runner is None:
            raise RuntimeError(f"{PROPOSER_CLASS} was given no model runner: it runs in a vLLM worker with the "
                               f"project's worker extension ({WORKER_EXTENSION}: worker_extension_cls, or "
                               "--worker-extension-cls for a server), which RolloutGenerator(backend='vllm') and "
                               "`python -m rollout serve` add")
        batch = self.model_runner.input_batch
        if batch.token_ids_cpu is not token_ids_cpu:
            raise RuntimeError(f"{PROPOSER_CLASS}: the token ids vLLM passed are not its runner's input batch's; "
                               "this vLLM calls custom_class proposers otherwise (tested with its V1 runner, 0.32)")
        return batch
