"""The fallback model runner: a plain padded HF forward over the full sequences, for any causal LM.

It keeps each slot's token ids instead of keys/values and recomputes every row from its first token on each call:
slow (cost grows with sequence length, not with the new tokens) but correct for any architecture that takes
`input_ids`, `attention_mask` (and `position_ids` when its forward has them). `RaggedRunner` in
`spec/model_runner.py` is the fast path for Llama-family models; both implement `Runner` (spec/runner.py).
"""

import contextlib
import copy
import inspect

import torch

from spec.kv_cache import SlotAllocator


def resolve_device_dtype(model, device, dtype) -> tuple[torch.device, torch.dtype]:
    """Defaults: the model's device; float32 on CPU, else the model's dtype."""
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else param.dtype
    return device, dtype


def prepare_model(model, device, dtype):
    """The model itself when already on `device` in `dtype` (weights shared: in-place updates stay visible),
    else a converted deep copy, so that a model the caller still uses is never moved or cast."""
    tensors = list(model.parameters()) + list(model.buffers())
    if all(t.device == device and (t.dtype == dtype or not t.is_floating_point()) for t in tensors):
        return model
    return copy.deepcopy(model).to(device=device, dtype=dtype)


def check_forward_args(slots: list[int], token_ids: list[list[int]], num_logits: list[int]) -> None:
    if not len(slots) == len(token_ids) == len(num_logits):
        raise ValueError(f"forward got {len(slots)} slots, {len(token_ids)} token lists and {len(num_logits)} "
                         "num_logits; pass one of each per row")
    for i, (ids, k) in enumerate(zip(token_ids, num_logits)):
        if not ids:
            raise ValueError(f"row {i} (slot {slots[i]}) has no new tokens; feed at least one token per row")
        if not 0 <= k <= len(ids):
            raise ValueError(f"num_logits[{i}]={k} is outside [0, {len(ids)}] (the row's new tokens)")


@contextlib.contextmanager
def eval_mode(model):
    """Dropout off for the duration of a forward; the caller's train/eval mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class PaddedRunner:
    """A Runner (spec/runner.py) whose state is the token ids of each slot."""

    def __init__(self, model, max_num_seqs: int, max_model_len: int, device=None, dtype=None):
        self.device, self.dtype = resolve_device_dtype(model, device, dtype)
        self.model = prepare_model(model, self.device, self.dtype)
        self.slots = SlotAllocator(max_num_seqs, max_model_len)
        self._token_ids: dict[int, list[int]] = {}
        params = inspect.signature(self.model.forward).parameters
        self._takes_position_ids = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params

    def padded_queries(self, num_rows: int, num_tokens: int, width: int, num_wide: int) -> int:
        """Every row is padded to the widest (and recomputed whole: its cost follows the sequence's length)."""
        return max(num_rows * width - num_tokens, 0)

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free_slots

    def allocate(self) -> int:
        slot = self.slots.allocate()
        self._token_ids[slot] = []
        return slot

    def free(self, slot: int) -> None:
        self.slots.free(slot)
        del self._token_ids[slot]

    def release_all(self) -> None:
        self.slots.release_all()
        self._token_ids.clear()

    def seq_len(self, slot: int) -> int:
        return self.slots.seq_len(slot)

    def crop(self, slot: int, length: int) -> None:
        self.slots.crop(slot, length)
        del self._token_ids[slot][length:]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if not 0 <= length <= self.seq_len(src):
            raise ValueError(f"copy_prefix length {length} is outside [0, {self.seq_len(src)}] for source slot {src}")
        self.slots.set_seq_len(dst, length)
        self._token_ids[dst] = self._token_ids[src][:length]

    @torch.inference_mode()
    def forward(self, slots: list[int], token_ids: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """Append token_ids[i] to slot i; float32 logits [sum(num_logits), vocab] of each row's last new tokens."""
        check_forward_args(slots, token_ids, num_logits)
        self.slots.start_positions(slots, [len(t) for t in token_ids])  # validates before anything changes
        for slot, ids in zip(slots, token_ids):
            self._token_ids[slot].extend(ids)
        self.slots.advance(slots, [len(t) for t in token_ids])
        if sum(num_logits) == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        logits = self._padded_logits([self._token_ids[s] for s in slots], max(num_logits))  # [rows, keep, vocab]
        keep = logits.shape[1]
        return torch.cat([logits[i, keep - k:] for i, k in enumerate(num_logits)]).float()

    def _padded_logits(self, sequences: list[list[int]], keep: int) -> torch.Tensor:
        """Logits of the last `keep` positions of each left-padded sequence, [rows, keep, vocab]."""
        max_len = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(sequences), max_len, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), max_len, dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, max_len - len(seq):] = torch.tensor(seq)
            attention_mask[i, max_len - len(seq):] = 1
        kwargs = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device),
                  "use_cache": False}
        if self._takes_position_ids:
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0).to(self.device)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with eval_mode(self.model):
            logits = self.model(**kwargs).logits  # [rows, keep or max_len, vocab]
        return logits[:, -keep:]
