"""A slot-addressed key/value cache with per-row rollback, shared by the target and draft-model runners.

Each running sequence owns one *slot*: a row of every layer's key and value tensors,
[max_num_seqs, num_kv_heads, max_model_len, head_dim], plus a length. Positions `0 .. seq_len(slot) - 1` are
valid. Rolling back rejected drafts is `crop` (the length moves back; nothing is recomputed) and a sibling
sample reuses another's prompt prefill with `copy_prefix`.

Stale values. Attention reads a row's slot up to the widest row's length and masks the positions past its own, but
masked positions still enter the arithmetic: a stale NaN key gives NaN - inf = NaN, a stale NaN value 0 * NaN = NaN.
`free` leaves what a slot held in place, which is safe while it is finite. A non-finite key or value reaches its own
forward's logits (a row's last query attends to every position the row wrote): the target's fail the call, the
drafter's fail its step (non-finite confidences), and both end in `release_all`, which zeroes the whole cache.
Zeroing at every `free` instead cost about 1% of a CPU rollout of the default pair.
"""

import heapq

import torch


class SlotAllocator:
    """Slot ids 0 .. max_num_seqs - 1 and the length of each allocated slot."""

    def __init__(self, max_num_seqs: int, max_model_len: int):
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_model_len={max_model_len} must both be >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._free = list(range(max_num_seqs))  # a heap: the lowest free slot is handed out first, so that a
        # caller that moves its sequences into freed slots keeps them in the lowest ones
        self._seq_lens: dict[int, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ValueError(f"no free cache slot: all max_num_seqs={self.max_num_seqs} slots are in use; "
                             "free() finished sequences or raise max_num_seqs")
        slot = heapq.heappop(self._free)
        self._seq_lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_allocated(slot)
        del self._seq_lens[slot]
        heapq.heappush(self._free, slot)

    def seq_len(self, slot: int) -> int:
        self._check_allocated(slot)
        return self._seq_lens[slot]

    def crop(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of the slot (rollback)."""
        if not 0 <= length <= self.seq_len(slot):
            raise ValueError(f"crop length {length} is outside [0, {self.seq_len(slot)}] for slot {slot}")
        self._seq_lens[slot] = length

    def release_all(self) -> None:
        """Free every slot, whatever state an interrupted caller left the allocator in."""
        self._free = list(range(self.max_num_seqs))  # ascending: a valid heap
        self._seq_lens.clear()

    def start_positions(self, slots: list[int], num_new_tokens: list[int]) -> list[int]:
        """Where each row's new tokens would start; ValueError when a row would not fit. Changes nothing."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} repeat a slot; feed each slot at most once per call")
        starts = [self.seq_len(s) for s in slots]
        for slot, start, n in zip(slots, starts, num_new_tokens):
            if start + n > self.max_model_len:
                raise ValueError(f"slot {slot} holds {start} tokens and {n} more would exceed "
                                 f"max_model_len={self.max_model_len}; raise max_model_len or shorten the sequence")
        return starts

    def advance(self, slots: list[int], num_new_tokens: list[int]) -> None:
        for slot, n in zip(slots, num_new_tokens):
            self._seq_lens[slot] += n

    def set_seq_len(self, slot: int, length: int) -> None:
        self._check_allocated(slot)
        if not 0 <= length <= self.max_model_len:
            raise ValueError(f"length {length} is outside [0, max_model_len={self.max_model_len}]")
        self._seq_lens[slot] = length

    def _check_allocated(self, slot: int) -> None:
        if slot not in self._seq_lens:
            raise ValueError(f"slot {slot} is not allocated; call allocate() first")


class KVCache(SlotAllocator):
    """Keys and values of every layer, [num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim] each.

    `keys[layer]` / `values[layer]` are the per-layer views [max_num_seqs, num_kv_heads, max_model_len, head_dim].
    """

    def __init__(self, num_layers: int, max_num_seqs: int, num_kv_heads: int, max_model_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__(max_num_seqs, max_model_len)
        shape = (num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @torch.no_grad()
    def release_all(self) -> None:
        """Free every slot and zero the cache (module docstring): the reset after a failed call or drafter step."""
        self.keys.zero_()
        self.values.zero_()
        super().release_all()

    @torch.no_grad()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot `dst` hold the first `length` positions of slot `src` (shared prompt prefill)."""
        if not 0 <= length <= self.seq_len(src):
            raise ValueError(f"copy_prefix length {length} is outside [0, {self.seq_len(src)}] for source slot {src}")
        self._check_allocated(dst)
        if src != dst:
            self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
            self.values[:, dst, :, :length] = self.values[:, src, :, :length]
        self.set_seq_len(dst, length)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store keys/values [num_tokens, num_kv_heads, head_dim] at the (slots[i], positions[i]) pairs.

        Lengths are not changed: the runner calls `advance` once every layer is written.
        """
        self.keys[layer, slots, :, positions] = keys
        self.values[layer, slots, :, positions] = values
