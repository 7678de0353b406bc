"""RaggedRunner / PaddedRunner against the HF model's own forward over the full sequences, on tiny random models."""

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from spec.kv_cache import KVCache
from spec.model_runner import PaddedRunner, RaggedRunner, _attention_parts, build_runner

VOCAB = 97
# fp32 throughout. The runner and HF compute the same ops in the same order except attention (one SDPA over
# the padded row vs HF's over the full sequence) and the shapes the matmuls see, so the logits differ only by
# float32 rounding: ~1e-7 relative per op, observed max |diff| ~3e-7 on logits of magnitude ~1. 1e-5 leaves
# margin while still catching any real error (a wrong position or mask moves logits by ~1e-1).
ATOL, RTOL = 1e-5, 1e-4

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)


def _llama(num_kv_heads=4):
    return LlamaForCausalLM(LlamaConfig(**SIZES, num_attention_heads=4, num_key_value_heads=num_kv_heads))


def _qwen2():  # q/k/v projections with bias
    return Qwen2ForCausalLM(Qwen2Config(**SIZES, num_attention_heads=4, num_key_value_heads=2))


def _qwen3():  # q_norm / k_norm, head_dim decoupled from hidden_size / num_heads
    return Qwen3ForCausalLM(Qwen3Config(**SIZES, num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def _mistral(sliding_window=None):
    return MistralForCausalLM(MistralConfig(**SIZES, num_attention_heads=4, num_key_value_heads=1,
                                            sliding_window=sliding_window))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128))


MODELS = {"llama": _llama, "llama_gqa": lambda: _llama(num_kv_heads=2), "qwen2": _qwen2, "qwen3": _qwen3,
          "mistral_mqa": _mistral}


def _model(factory):
    torch.manual_seed(0)
    return factory().eval()


class Mirror:
    """Feeds a runner and checks every returned logit row against the HF forward over the full sequence."""

    def __init__(self, runner, model):
        self.runner, self.model, self.seqs = runner, model, {}
        self.gen = torch.Generator().manual_seed(1)

    def allocate(self) -> int:
        slot = self.runner.allocate()
        self.seqs[slot] = []
        return slot

    def random_tokens(self, n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=self.gen).tolist()

    def feed(self, slots, num_new, num_logits):
        new = [self.random_tokens(n) for n in num_new]
        logits = self.runner.forward(slots, new, num_logits)
        assert logits.dtype == torch.float32 and logits.shape == (sum(num_logits), VOCAB)
        expected = []
        for slot, tokens, k in zip(slots, new, num_logits):
            self.seqs[slot] += tokens
            assert self.runner.seq_len(slot) == len(self.seqs[slot])
            with torch.no_grad():
                full = self.model(torch.tensor([self.seqs[slot]])).logits[0]  # [seq_len, vocab]
            expected.append(full[len(full) - k:])
        torch.testing.assert_close(logits, torch.cat(expected), atol=ATOL, rtol=RTOL)

    def crop(self, slot, length):
        self.runner.crop(slot, length)
        del self.seqs[slot][length:]

    def copy_prefix(self, src, dst, length):
        self.runner.copy_prefix(src, dst, length)
        self.seqs[dst] = self.seqs[src][:length]


def _exercise(runner, model):
    """Ragged prefill, ragged multi-token steps in shuffled slot order, rollback + re-feed, prefix copy."""
    m = Mirror(runner, model)
    a, b, c = m.allocate(), m.allocate(), m.allocate()
    m.feed([a, b, c], [5, 9, 1], [5, 2, 1])  # prefill of different lengths
    m.feed([c, a], [3, 1], [3, 1])  # non-contiguous, reversed slot order
    m.feed([a, b, c], [1, 1, 1], [1, 1, 1])  # decode step, rows of different lengths
    m.feed([b, c, a], [4, 2, 3], [4, 0, 2])  # verify-like: k_i + 1 tokens per row
    m.crop(b, 11)  # rollback of rejected positions
    m.crop(a, 2)
    m.feed([a, b], [2, 3], [2, 3])  # re-feed over the cropped positions
    d = m.allocate()
    m.copy_prefix(b, d, 7)  # sibling shares b's prefix
    m.feed([d, b], [2, 1], [2, 1])
    m.feed([d], [1], [1])
    rows = [a, b, c, d] + [m.allocate() for _ in range(4)]
    m.feed(rows, [3] * 8, [0] * 8)
    m.feed(rows, [1, 4, 1, 1, 1, 1, 1, 1], [1, 4, 1, 1, 1, 1, 1, 1])  # one wide row among 8: attention in 2 blocks
    m.feed(rows[::-1], [1, 1, 1, 1, 1, 1, 1, 3], [1, 1, 0, 1, 1, 1, 1, 2])  # reversed slot order: keys gathered
    return m


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ragged_runner_matches_hf(name):
    model = _model(MODELS[name])
    _exercise(RaggedRunner(model, max_num_seqs=8, max_model_len=48), model)


def test_attention_splits_off_a_few_wide_rows():
    """Every row's first query in one block and the wide rows' others in a second, when at most an eighth of the
    rows are wide; one padded block otherwise (_exercise checks both against HF)."""
    assert _attention_parts([1, 4, 1, 1, 1, 1, 1, 1]) == [(list(range(8)), [0] * 8, [1] * 8), ([1], [1], [4])]
    assert _attention_parts([1, 4, 1, 1, 1, 1, 1]) == [(list(range(7)), [0] * 7, [1, 4, 1, 1, 1, 1, 1])]
    assert _attention_parts([1, 1]) == [([0, 1], [0, 0], [1, 1])]
    assert _attention_parts([3] * 8) == [(list(range(8)), [0] * 8, [3] * 8)]


def test_padded_runner_matches_hf_and_is_picked_for_gpt2():
    model = _model(_gpt2)
    runner = build_runner(model, max_num_seqs=8, max_model_len=48)
    assert isinstance(runner, PaddedRunner)
    _exercise(runner, model)


def test_padded_runner_on_llama_matches_hf():
    model = _model(_llama)
    _exercise(PaddedRunner(model, max_num_seqs=8, max_model_len=48), model)


def test_build_runner_picks_ragged_for_llama_family():
    assert isinstance(build_runner(_model(_qwen3), 2, 16), RaggedRunner)
    assert isinstance(build_runner(_model(lambda: _mistral(sliding_window=64)), 2, 32), RaggedRunner)  # inactive


def test_unsupported_models_are_rejected():
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        RaggedRunner(_model(_gpt2), 2, 16)
    windowed = _model(lambda: _mistral(sliding_window=8))
    with pytest.raises(NotImplementedError, match="sliding window"):
        RaggedRunner(windowed, 2, 16)
    assert isinstance(build_runner(windowed, 2, 16), PaddedRunner)


@pytest.mark.parametrize("runner_cls", [RaggedRunner, PaddedRunner])
def test_slot_and_length_errors(runner_cls):
    runner = runner_cls(_model(_llama), max_num_seqs=2, max_model_len=8)
    a, b = runner.allocate(), runner.allocate()
    assert runner.num_free_slots == 0
    with pytest.raises(ValueError, match="no free cache slot"):
        runner.allocate()
    runner.forward([a], [[1, 2, 3, 4, 5]], [1])
    with pytest.raises(ValueError, match="max_model_len=8"):
        runner.forward([b, a], [[1], [1, 2, 3, 4]], [1, 1])
    assert runner.seq_len(a) == 5 and runner.seq_len(b) == 0  # the failed call changed nothing
    with pytest.raises(ValueError, match="crop length 6"):
        runner.crop(a, 6)
    with pytest.raises(ValueError, match="num_logits"):
        runner.forward([a], [[1]], [2])
    with pytest.raises(ValueError, match="no new tokens"):
        runner.forward([a], [[]], [0])
    with pytest.raises(ValueError, match="repeat a slot"):
        runner.forward([a, a], [[1], [1]], [1, 1])
    runner.free(b)
    with pytest.raises(ValueError, match="not allocated"):
        runner.seq_len(b)
    assert runner.allocate() == b


def test_runner_shares_weights_or_copies_without_touching_the_callers_model():
    model = _model(_llama)
    assert RaggedRunner(model, 1, 8).model is model  # same device and dtype: weights shared
    runner = RaggedRunner(model, 1, 8, dtype=torch.float64)
    assert runner.model is not model and model.lm_head.weight.dtype == torch.float32
    assert runner.cache.keys.dtype == torch.float64
    slot = runner.allocate()
    tokens = [3, 1, 4, 1, 5]
    logits = runner.forward([slot], [tokens], [1])
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, -1:]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


def test_padded_runner_restores_train_mode():
    model = _model(_gpt2).train()
    runner = PaddedRunner(model, 2, 8)
    first = runner.forward([runner.allocate()], [[1, 2, 3]], [3])
    second = runner.forward([runner.allocate()], [[1, 2, 3]], [3])
    assert model.training
    torch.testing.assert_close(first, second)  # dropout was off in both calls


def test_kv_cache_write_crop_copy_prefix():
    cache = KVCache(num_layers=2, max_num_seqs=3, num_kv_heads=2, max_model_len=4, head_dim=3)
    a, b = cache.allocate(), cache.allocate()
    keys = torch.randn(3, 2, 3)  # [num_tokens, num_kv_heads, head_dim]
    cache.write(1, torch.tensor([a, a, b]), torch.tensor([0, 1, 0]), keys, -keys)
    cache.advance([a, b], [2, 1])
    torch.testing.assert_close(cache.keys[1, a, :, :2], keys[:2].transpose(0, 1))
    torch.testing.assert_close(cache.values[1, b, :, 0], -keys[2])
    c = cache.allocate()
    cache.copy_prefix(a, c, 1)
    assert cache.seq_len(c) == 1 and cache.num_free_slots == 0
    torch.testing.assert_close(cache.keys[:, c, :, :1], cache.keys[:, a, :, :1])
    cache.crop(a, 1)
    assert cache.seq_len(a) == 1
    with pytest.raises(ValueError, match="copy_prefix length 2"):
        cache.copy_prefix(a, b, 2)
    with pytest.raises(ValueError, match="max_model_len=4"):
        cache.start_positions([a], [4])


@pytest.mark.parametrize("runner_cls", [RaggedRunner, PaddedRunner])
def test_release_all_frees_every_slot_whatever_its_state(runner_cls):
    """The reset after a failed call: slots allocated, filled or not, all free again (lowest first), and a ragged
    cache all zeros (spec/kv_cache.py, stale values), so a slot computes what a fresh one does."""
    runner = runner_cls(_model(_llama), max_num_seqs=3, max_model_len=8)
    a, b = runner.allocate(), runner.allocate()
    runner.forward([a], [[1, 2, 3]], [1])
    runner.release_all()
    assert runner.num_free_slots == 3 and [runner.allocate() for _ in range(3)] == [a, b, 2]
    if runner_cls is RaggedRunner:
        assert not runner.cache.keys.any() and not runner.cache.values.any()
    torch.testing.assert_close(runner.forward([a], [[1, 2, 3]], [1]), runner.forward([b], [[1, 2, 3]], [1]))
