"""The ragged model runner: one forward over flattened tokens of many rows, each with its own KV cache slot.

Used by the target's verification (sum(k_i + 1) tokens, not num_reqs x (k_max + 1)) and by the draft-model
drafter. Terms:

- row: one sequence in a call, living in a cache slot; its *new tokens* are appended at positions
  seq_len(slot) ..; the row's cached keys are positions 0 .. seq_len(slot) + num_new - 1.
- flattened tokens: the new tokens of all rows, row-major, [num_tokens]; `cu_*` offsets index into them.

The linear layers, norms and MLP run on [num_tokens, hidden], so their cost follows the number of new tokens.
Attention pads only the queries per row, [num_rows, heads, max_new, head_dim], against keys read from the
row's slot up to its own length, with a float mask (causal within the new tokens); where a few rows are wide,
in two blocks (`_attention_parts`), so that the narrow rows are not padded to the wide rows' width.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec.kv_cache import KVCache
from spec.padded_runner import PaddedRunner, check_forward_args, prepare_model, resolve_device_dtype
from spec.runner import Runner

MAX_WIDE_FRACTION = 1 / 8  # of the rows, for attention in two blocks (_attention_parts)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def check_supported(model, max_model_len: int) -> None:
    """NotImplementedError unless RaggedRunner computes exactly what the HF model computes."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(f"RaggedRunner supports {SUPPORTED_ARCHITECTURES}, not {name}; "
                                  "use PaddedRunner (or build_runner, which picks it)")
    config = model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
    if window is not None and window < max_model_len and "sliding_attention" in layer_types:
        raise NotImplementedError(f"{name} has an active sliding window ({window} < max_model_len="
                                  f"{max_model_len}); RaggedRunner attends to the full context")
    rope_type = model.model.rotary_emb.rope_type
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        raise NotImplementedError(f"{name} uses rope_type={rope_type!r}, whose frequencies depend on the "
                                  "sequence length; RaggedRunner precomputes a fixed cos/sin table")


def is_supported(model, max_model_len: int) -> bool:
    try:
        check_supported(model, max_model_len)
    except NotImplementedError:
        return False
    return True


@dataclass
class _Block:
    """Queries attended together: rows side by side, each row's queries padded to the block's widest."""

    token_index: torch.Tensor | None  # [num_queries] flattened tokens whose queries these are; None: all, in order
    pad_index: torch.Tensor | None  # [num_queries] place in [num_rows * max_new]; None when no row is padded
    slots: torch.Tensor | slice  # [num_rows] slot of each row; a slice when contiguous and ascending (no gather)
    mask: torch.Tensor | None  # [num_rows, 1, max_new, max_len] 0 / -inf; None when nothing is masked
    num_rows: int
    max_new: int
    max_len: int


@dataclass
class _Batch:
    """Index tensors of one call, built once and shared by every layer."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] position of each new token in its row
    token_slots: torch.Tensor  # [num_tokens] slot of each new token
    logit_index: torch.Tensor  # [sum(num_logits)] flattened tokens that get logits
    blocks: list[_Block]  # attention's; together they hold each token's query once


def _build_batch(slots, token_ids, num_logits, starts, device, dtype) -> _Batch:
    flat_ids, positions, token_slots, logit_index, cu_tokens = [], [], [], [], [0]
    for slot, ids, start, k in zip(slots, token_ids, starts, num_logits):
        n = len(ids)
        flat_ids += ids
        positions += range(start, start + n)
        token_slots += [slot] * n
        logit_index += range(cu_tokens[-1] + n - k, cu_tokens[-1] + n)
        cu_tokens.append(cu_tokens[-1] + n)
    packed = [flat_ids, positions, token_slots, logit_index]
    parts = _attention_parts([len(ids) for ids in token_ids])
    for rows, first, end in parts:
        packed += _block_indices(rows, first, end, slots, starts, cu_tokens, is_whole=len(parts) == 1)
    tensors = torch.tensor([x for part in packed for x in part], dtype=torch.long).to(device).split(
        [len(part) for part in packed])  # one host -> device copy
    blocks = [_block(tensors[i:i + 5], packed[i:i + 5], dtype) for i in range(4, len(packed), 5)]
    return _Batch(input_ids=tensors[0], positions=tensors[1], token_slots=tensors[2], logit_index=tensors[3],
                  blocks=blocks)


def splits_attention(num_rows: int, num_wide: int) -> bool:
    """Whether a forward whose num_wide of num_rows rows feed more than one token attends in two blocks
    (_attention_parts); with no wide row there is nothing to split and one block costs the same."""
    return num_wide <= num_rows * MAX_WIDE_FRACTION


def padded_queries(num_rows: int, num_tokens: int, width: int, num_wide: int) -> int:
    """Query slots that attention pads in a forward of num_rows rows feeding num_tokens tokens, the widest `width`,
    num_wide of them more than one (_attention_parts): in two blocks, the wide rows' queries after their first, each
    padded to the widest; in one, every row's."""
    if splits_attention(num_rows, num_wide):
        return max(num_wide * (width - 1) - (num_tokens - num_rows), 0)
    return max(num_rows * width - num_tokens, 0)


def _attention_parts(num_new: list[int]) -> list[tuple[list[int], list[int], list[int]]]:
    """(rows, first query, end query) per attention block. Attention pads each row's queries to the widest row's:
    where a few rows verify drafts among many that verify none, that would cost every row the widest row's
    queries (at 256 rows, one row with 2 drafts made a step 16% dearer), so then every row's first query is one
    block and the wide rows' other queries a second, whose keys are gathered out of the cache. Measured at 32 and
    256 rows with 1-8 drafts in the wide rows: with a sixteenth of the rows wide the split is 4-19% faster, with
    an eighth 11% faster to 3% slower, with a quarter up to 8% slower (the gather grows with the wide rows)."""
    rows = list(range(len(num_new)))
    wide = [row for row in rows if num_new[row] > 1]
    if not wide or not splits_attention(len(rows), len(wide)):
        return [(rows, [0] * len(rows), num_new)]
    return [(rows, [0] * len(rows), [1] * len(rows)), (wide, [1] * len(wide), [num_new[row] for row in wide])]


def _block_indices(rows, first, end, slots, starts, cu_tokens, is_whole: bool) -> list[list[int]]:
    """Token index (empty for a block of every query in order), pad index (empty when no row is padded), slots,
    first query positions and key lengths of the block that attends queries first[b] .. end[b] - 1 of row rows[b]."""
    widths = [e - f for f, e in zip(first, end)]
    max_new = max(widths)
    token_index, pad_index = [], []
    if not is_whole:
        for row, f, e in zip(rows, first, end):
            token_index += range(cu_tokens[row] + f, cu_tokens[row] + e)
    if min(widths) < max_new:
        for b, width in enumerate(widths):
            pad_index += range(b * max_new, b * max_new + width)
    query_starts = [starts[row] + f for row, f in zip(rows, first)]
    lens = [s + w for s, w in zip(query_starts, widths)]  # keys up to the row's last query
    return [token_index, pad_index, [slots[row] for row in rows], query_starts, lens]


def _block(tensors, lists, dtype) -> _Block:
    """The block of _block_indices' lists, given them as tensors too (the lists spare the device a sync)."""
    token_index, pad_index, slot_index, query_starts, lens = tensors
    block_slots, starts, ends = lists[2], lists[3], lists[4]
    num_rows, max_new, max_len = len(block_slots), max(e - s for s, e in zip(starts, ends)), max(ends)
    is_contiguous = block_slots == list(range(block_slots[0], block_slots[0] + num_rows))
    needs_mask = max_new > 1 or min(ends) < max_len
    return _Block(token_index=token_index if lists[0] else None, pad_index=pad_index if lists[1] else None,
                  slots=slice(block_slots[0], block_slots[0] + num_rows) if is_contiguous else slot_index,
                  mask=_attention_mask(query_starts, lens, max_new, max_len, dtype) if needs_mask else None,
                  num_rows=num_rows, max_new=max_new, max_len=max_len)


def _attention_mask(starts, lens, max_new: int, max_len: int, dtype) -> torch.Tensor:
    """0 where query j of a row (position start + j) may attend key position p: p <= start + j, p < len.

    Padding queries (j >= num_new) attend like the row's last new token, so no query row is all -inf (NaN).
    """
    steps = torch.arange(max_new, device=starts.device)
    query_pos = torch.minimum(starts[:, None] + steps, lens[:, None] - 1)  # [num_rows, max_new]
    key_pos = torch.arange(max_len, device=starts.device)
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # [num_rows, max_new, max_len]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=starts.device).masked_fill_(~allowed, float("-inf"))
    return mask[:, None]


class RaggedRunner:
    """Ragged forward for Llama-family HF causal LMs, reusing the HF module's weights and submodules; a Runner
    (spec/runner.py).

    The model is used as is when already on `device` in `dtype` (weights shared, so in-place weight updates
    are seen by the next forward); otherwise the runner works on a converted copy. Its train/eval mode is
    irrelevant: the runner's own forward has no dropout.
    """

    def __init__(self, model, max_num_seqs: int, max_model_len: int, device=None, dtype=None):
        check_supported(model, max_model_len)
        self.device, self.dtype = resolve_device_dtype(model, device, dtype)
        self.model = prepare_model(model, self.device, self.dtype)
        attn = self.model.model.layers[0].self_attn
        self.layers = list(self.model.model.layers)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.has_qk_norm = hasattr(attn, "q_norm")
        config = self.model.config
        self.cache = KVCache(len(self.layers), max_num_seqs, config.num_key_value_heads, max_model_len,
                             self.head_dim, dtype=self.dtype, device=self.device)
        self.cos, self.sin = self._rope_tables(max_model_len)  # [max_model_len, head_dim] each

    @torch.inference_mode()
    def _rope_tables(self, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, from the model's own rotary embedding; sin's first half negated so
        that rotate_half(x) * sin == cat(x2, x1) * signed_sin."""
        positions = torch.arange(max_model_len, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, positions)  # [1, max_model_len, head_dim]
        half = self.head_dim // 2
        signed_sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0].clone(), signed_sin

    def padded_queries(self, num_rows: int, num_tokens: int, width: int, num_wide: int) -> int:
        return padded_queries(num_rows, num_tokens, width, num_wide)

    # Slot management, delegated to the cache.
    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free_slots

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def seq_len(self, slot: int) -> int:
        return self.cache.seq_len(slot)

    def crop(self, slot: int, length: int) -> None:
        self.cache.crop(slot, length)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.cache.copy_prefix(src, dst, length)

    def release_all(self) -> None:
        """Free every slot and zero the cache, whatever state a failed caller left them in."""
        self.cache.release_all()

    @torch.inference_mode()
    def forward(self, slots: list[int], token_ids: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """Append token_ids[i] to slot i; float32 logits [sum(num_logits), vocab] of each row's last
        num_logits[i] new tokens, row-major."""
        check_forward_args(slots, token_ids, num_logits)
        num_new = [len(t) for t in token_ids]
        starts = self.cache.start_positions(slots, num_new)
        batch = _build_batch(list(slots), token_ids, num_logits, starts, self.device, self.dtype)
        cos, sin = self.cos[batch.positions][:, None], self.sin[batch.positions][:, None]  # [num_tokens, 1, hd]
        hidden = self.model.model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        for i, layer in enumerate(self.layers):
            hidden = self._layer(i, layer, hidden, batch, cos, sin)
        self.cache.advance(slots, num_new)
        hidden = _rms_norm(self.model.model.norm, hidden[batch.logit_index])  # [sum(num_logits), hidden]
        return self.model.lm_head(hidden).float()

    def _layer(self, i: int, layer, hidden, batch: _Batch, cos, sin) -> torch.Tensor:
        attn = layer.self_attn
        x = _rms_norm(layer.input_layernorm, hidden)
        q = attn.q_proj(x).unflatten(-1, (-1, self.head_dim))  # [num_tokens, num_heads, head_dim]
        k = attn.k_proj(x).unflatten(-1, (-1, self.head_dim))  # [num_tokens, num_kv_heads, head_dim]
        v = attn.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.has_qk_norm:
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.cache.write(i, batch.token_slots, batch.positions, k, v)
        hidden = hidden + attn.o_proj(self._attend(i, q, batch))
        return hidden + layer.mlp(_rms_norm(layer.post_attention_layernorm, hidden))

    def _attend(self, i: int, q: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] against each row's cached keys -> [num_tokens, num_heads * hd]."""
        if len(batch.blocks) == 1:
            return self._attend_block(i, q, batch.blocks[0])
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for block in batch.blocks:
            out.index_copy_(0, block.token_index, self._attend_block(i, q[block.token_index], block))
        return out

    def _attend_block(self, i: int, q: torch.Tensor, block: _Block) -> torch.Tensor:
        """The block's queries [num_queries, num_heads, head_dim] -> [num_queries, num_heads * head_dim]."""
        rows, max_new = block.num_rows, block.max_new
        if block.pad_index is not None:
            padded = q.new_zeros(rows * max_new, *q.shape[1:])
            q = padded.index_copy_(0, block.pad_index, q)
        q = q.view(rows, max_new, *q.shape[1:]).transpose(1, 2)  # [num_rows, num_heads, max_new, head_dim]
        keys = self.cache.keys[i, block.slots, :, :block.max_len]  # [num_rows, num_kv_heads, max_len, head_dim]
        values = self.cache.values[i, block.slots, :, :block.max_len]
        out = _attention(q, keys, values, block.mask, self.scaling)  # [num_rows, num_heads, max_new, head_dim]
        out = out.transpose(1, 2).reshape(rows * max_new, -1)
        return out if block.pad_index is None else out[block.pad_index]

def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The HF RMSNorm module's computation as one fused op (the module runs six small ones)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _attention(q, keys, values, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, with kv heads shared by groups of query heads (GQA).

    On CPU two batched matmuls beat scaled_dot_product_attention for the short queries of decoding and
    verification (measured: 0.09 vs 0.13 ms at 64 rows x 1 query x 40 keys, 0.42 vs 0.77 ms at 256 rows),
    and they read the cache's strided slices without a copy; elsewhere SDPA's fused kernels win.
    """
    group = q.shape[1] // keys.shape[1]
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    rows, num_heads, num_queries, head_dim = q.shape
    q = q.reshape(rows, keys.shape[1], group * num_queries, head_dim)  # queries of a kv head side by side
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [rows, kv_heads, group * num_queries, keys]
    if mask is not None:
        scores = (scores.view(rows, keys.shape[1], group, num_queries, -1) + mask[:, :, None]).flatten(2, 3)
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [rows, kv_heads, group * num_queries, head_dim]
    return out.view(rows, num_heads, num_queries, head_dim)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == cat(x2, x1) * signed_sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


def build_runner(model, max_num_seqs: int, max_model_len: int, device=None, dtype=None) -> Runner:
    """RaggedRunner when the architecture is supported, else the padded HF-forward fallback."""
    runner_cls = RaggedRunner if is_supported(model, max_model_len) else PaddedRunner
    return runner_cls(model, max_num_seqs, max_model_len, device=device, dtype=dtype)
