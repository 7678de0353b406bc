"""This project's drafters on vLLM 0.34+: the Model Runner V2 speculator that the registered methods `history` and
`custom_class` name (speculator_config.py, plugin.register_methods); drafting.py does the drafting.

Per step, `propose(input_batch, ..., num_sampled, ..., num_speculative_tokens=K)` runs after the step's sampled
tokens are committed to the runner's request state (`req_states`, checked at construction by versions.py): the rows'
counts and the token ids the drafter lacks are gathered on the device and read in at most three small copies (one
device sync a step). K is vLLM's (its scheduler reads the schedule at the live batch size). The result is a
[num_reqs, K] int64 tensor; a request with fewer drafts has the rest filled with its last token (a -1 placeholder
is not a valid embedding index), an ordinary draft that verification accepts or rejects losslessly.

The per-request cut: Model Runner V2 verifies fewer than K tokens for a request only through its own adaptive
verification, which ranks slots by `draft_token_confidence_probs`; with the project's enable_adaptive_verification,
this class writes 1 for the drafts the project's policy kept and 0 for the rest (docs/vllm_proposer.md says where
vLLM's budget can differ). Stop ids: Model Runner V2 keeps no request's sampling params where a speculator can read
them, so drafts are cut after the model's EOS ids only (ignore_eos and stop_token_ids are not known here; the cut
costs verified drafts, never exactness). `on_requests_finished` finishes requests into the history; `reset_state`
(after vLLM's warm-up) forgets the warm-up. vLLM's base class is imported only when vLLM asks for
`RolloutSpeculator`, so the module imports without vLLM.
"""

import time
from types import SimpleNamespace
from typing import Iterable

import torch

from rollout.loading import eos_token_ids
from rollout.vllm_backend.drafting import RolloutDrafting, Row
from rollout.vllm_backend.lazy_class import build_on_vllm
from rollout.vllm_backend.versions import generation

SOURCE = "rollout.vllm_backend.speculator.RolloutSpeculator"


def __getattr__(name: str):
    """`RolloutSpeculator`: _Speculator on vLLM's BaseSpeculator, built and kept at the first request for it."""
    return build_on_vllm(globals(), name, "RolloutSpeculator",
                         "vllm.v1.worker.gpu.spec_decode.speculator.BaseSpeculator", (_Speculator,),
                         {"__doc__": _Speculator.__doc__})


class _Speculator:
    """Built by vLLM's init_speculator with its VllmConfig, the device and the runner's request state."""

    def __init__(self, vllm_config, device: torch.device, req_states):
        from vllm.v1.worker.gpu.input_batch import InputBatch
        self.drafting = RolloutDrafting(vllm_config, SOURCE, self._stop_ids)
        generation().check_speculator(req_states, InputBatch)  # every runner field read below, before any step
        self.eos_ids = frozenset(model_eos_ids(vllm_config.model_config))
        self.device = device
        self.req_states = req_states
        self.num_speculative_steps = vllm_config.speculative_config.num_speculative_tokens  # the widest K
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.drafts = torch.zeros(max_num_reqs, self.num_speculative_steps, dtype=torch.int64, device=device)
        # read by the runner's adaptive verification (on where the project's is): 1 for a kept draft, else 0
        self.enable_adaptive_verification = self.drafting.config.enable_adaptive_verification
        self.draft_token_confidence_probs = torch.zeros(max_num_reqs, self.num_speculative_steps,
                                                        dtype=torch.float32, device=device)

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """Nothing runs on the device here to capture."""

    def capture(self) -> None:
        """Nothing runs on the device here to capture."""

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False, mm_inputs=None,
                is_profile: bool = False, num_speculative_tokens: int | None = None) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        if dummy_run:
            return self.drafts[:num_reqs].zero_()
        rows = self._rows(input_batch, num_sampled)
        start = time.perf_counter()  # after the device sync: drafter time is the host's own
        starts = self.drafting.missing(rows)
        tokens = self._read(input_batch.idx_mapping, rows, starts)
        k = self.num_speculative_steps if num_speculative_tokens is None else num_speculative_tokens
        drafts = self.drafting.propose(rows, tokens, min(k, self.num_speculative_steps), start)
        return self._pack(drafts, tokens)

    def on_requests_finished(self, finished_req_ids: Iterable[str]) -> None:
        self.drafting.finish(sorted(finished_req_ids))  # sorted: every rank finishes in the same order

    def reset_state(self) -> None:
        self.drafting.reset()

    def update_max_model_len(self, max_model_len: int) -> None:
        self.drafting.max_model_len = max_model_len

    def _stop_ids(self, vllm_id: str) -> frozenset[int]:
        return self.eos_ids  # every request's (module docstring)

    def _rows(self, input_batch, num_sampled: torch.Tensor) -> list[Row]:
        """The batch's rows: request id, prompt length, committed tokens and tokens sampled this step."""
        num_reqs = input_batch.num_reqs
        total_len = self.req_states.total_len.gpu[input_batch.idx_mapping[:num_reqs]]
        counts = torch.stack([num_sampled[:num_reqs].to(torch.int64), total_len.to(torch.int64)]).tolist()
        prompt_lens = self.req_states.prompt_len.np[input_batch.idx_mapping_np[:num_reqs]].tolist()
        return [Row(req_id, num_prompt, num_tokens, num_new) for req_id, num_prompt, num_tokens, num_new
                in zip(input_batch.req_ids[:num_reqs], prompt_lens, counts[1], counts[0])]

    def _read(self, slots: torch.Tensor, rows: list[Row], starts: list[int]) -> list[list[int]]:
        """Row i's committed token ids [starts[i], num_tokens): one gather for the requests new to the drafter (their
        whole history) and one for the running ones (this step's tokens), so neither pads to the other's width."""
        tokens = [[] for _ in rows]
        for is_new in (True, False):
            group = [i for i, (row, first) in enumerate(zip(rows, starts))
                     if row.num_tokens > first and (first == 0) == is_new]
            if group:
                for i, ids in zip(group, self._gather(slots, [starts[i] for i in group],
                                                      [rows[i].num_tokens - starts[i] for i in group], group)):
                    tokens[i] = ids
        return tokens

    def _gather(self, slots: torch.Tensor, firsts: list[int], lengths: list[int], group: list[int]) -> list[list[int]]:
        all_token_ids = self.req_states.all_token_ids.gpu  # [max_num_reqs, max_model_len]
        columns = torch.tensor(firsts)[:, None] + torch.arange(max(lengths))  # [len(group), widest]
        columns.clamp_(max=all_token_ids.shape[1] - 1)  # past a row's end: read, then cut below
        rows = slots[torch.tensor(group, device=slots.device)]
        block = all_token_ids[rows[:, None], columns.to(all_token_ids.device)].tolist()
        return [ids[:n] for ids, n in zip(block, lengths)]

    def _pack(self, drafts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
        """[num_reqs, num_speculative_steps] drafts on the device, each row filled with its last token; with
        adaptive verification on, the confidences that make vLLM verify exactly the drafts kept."""
        width = self.num_speculative_steps
        fillers = [ids[-1] if ids else 0 for ids in tokens]
        rows = [row + [filler] * (width - len(row)) for row, filler in zip(drafts, fillers)]
        out = self.drafts[:len(rows)]
        out.copy_(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width))
        if self.enable_adaptive_verification:
            kept = [[1.0] * len(row) + [0.0] * (width - len(row)) for row in drafts]
            self.draft_token_confidence_probs[:len(rows)].copy_(torch.tensor(kept).reshape(len(rows), width))
        return out


def model_eos_ids(model_config) -> set[int]:
    """The model's EOS ids, as vLLM's model config reads them: its generation config's, else its text config's."""
    generation = SimpleNamespace(eos_token_id=model_config.try_get_generation_config().get("eos_token_id"))
    return eos_token_ids(generation, model_config.hf_text_config)
