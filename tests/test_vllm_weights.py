"""Weights on backend="vllm" (in-process): draft weights reach vLLM's drafter, target and draft loads are atomic,
and the drafter refresh distils a draft whose acceptance rises on vLLM.

The first engine drafts with a copy of its target (greedy acceptance 1.0), so a drafter that no longer matches is
seen at once; greedy completions cannot change with the drafter (verification is lossless).
"""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from trainers_testing import refresh_toward
from vllm_testing import hf_logprobs, require_vllm, save_tiny_llama, tiny_default_vocab

from rollout import RolloutGenerator, SamplingParams, default_model_paths

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [3, 4, 10, 11], [20, 21], [12, 13, 14], [20, 3, 4]]  # ids < 28
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
pytestmark = require_vllm


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_weights")
    target = save_tiny_llama(root / "target", 0, 2)
    shutil.copytree(target, root / "draft_copy")
    tiny_default_vocab(1, 2).save_pretrained(root / "target28")  # the drafter refresh's pair, as the embedded test's
    tiny_default_vocab(2, 1).save_pretrained(root / "draft28")
    return {"target": target, "draft_copy": str(root / "draft_copy"), "target28": str(root / "target28"),
            "draft28": str(root / "draft28")}


@pytest.fixture(scope="module")
def gen(folders):
    config = {"method": "draft_model", "model": folders["draft_copy"], "num_speculative_tokens": 3}
    return RolloutGenerator(folders["target"], backend="vllm", speculative_config=config, max_num_seqs=8,
                            max_model_len=128)


def _run(gen) -> tuple[list[list[int]], float]:
    batch = gen.generate(PROMPTS, 1, GREEDY, use_tqdm=False)
    return [s.completion_ids for s in batch.samples], batch.stats["draft_acceptance_rate"]


def _hf(folder) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_draft_weights_reach_vllms_drafter(gen, folders):
    completions, acceptance = _run(gen)
    assert acceptance == 1.0  # the drafter is the target
    original = _hf(folders["draft_copy"])
    torch.manual_seed(0)
    noise = {name: 0.05 * torch.randn_like(t) for name, t in original.items()}
    assert gen.load_draft_weights(noise.items()) == len(original)
    noisy_completions, noisy_acceptance = _run(gen)
    assert noisy_acceptance < 0.3 and noisy_completions == completions
    gen.load_draft_weights(original.items())
    assert _run(gen) == (completions, 1.0)


def _failing(weights: dict, at: int):
    for i, item in enumerate(weights.items()):
        if i == at:
            raise RuntimeError("the source failed mid-stream")
        yield item


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_bad_load_leaves_the_old_weights(gen, folders, role):
    load = gen.load_weights if role == "target" else gen.load_draft_weights
    good = _hf(folders["target"])  # the draft is a copy of the target: the same names and shapes
    torch.manual_seed(1)
    noise = {name: 0.05 * torch.randn_like(t) for name, t in good.items()}
    before = _run(gen)
    name = "model.layers.0.mlp.up_proj.weight"
    bad_loads = [({**noise, "model.no_such.weight": good[name]}, ValueError, "no parameter of that name"),
                 ({**noise, name: good[name][:, :8]}, ValueError, "has shape"),
                 ({**noise, name: good[name].long()}, ValueError, "dtype torch.int64"),
                 ({n: t for n, t in noise.items() if n != name}, ValueError, "were not given")]
    for weights, error, match in bad_loads:
        with pytest.raises(error, match=match):
            load(weights.items())
    with pytest.raises(RuntimeError, match="mid-stream"):
        load(_failing(noise, at=len(noise) - 1))
    assert _run(gen) == before


def test_draft_model_copy_is_the_draft_folder_in_float32(gen, folders):
    copy = gen.draft_model_copy()
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in copy.parameters())
    for name, tensor in _hf(folders["draft_copy"]).items():
        torch.testing.assert_close(dict(copy.named_parameters())[name], tensor)


def test_target_load_gives_the_new_models_logprobs(gen, folders):
    original = _hf(folders["target"])
    model = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    gen.load_weights(model.named_parameters())
    for sample in gen.generate(PROMPTS[:3], 1, GREEDY, use_tqdm=False).samples:
        expected = hf_logprobs(model, sample.prompt_ids, sample.completion_ids, GREEDY)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    gen.load_weights(original.items())


def _lm_head_error(worker, role: str) -> float:
    """Run in vLLM's worker: how far the target's or draft's lm_head GEMM (on CPU, a packed copy of the weight)
    is from multiplying by its weight parameter now."""
    model = worker.model_runner.get_model() if role == "target" else worker.model_runner.get_draft_model()
    x = torch.randn(3, model.lm_head.weight.shape[1])
    return float((model.lm_head.quant_method.apply(model.lm_head, x) - x @ model.lm_head.weight.T).abs().max())


def test_tied_embeddings_reach_the_logits():
    """The default pair ties lm_head to the embedding. On the CPU build a reload must re-pack the tied lm_head
    (rollout/vllm_backend/worker.py), for the target and the draft; the target's logprobs show it end to end."""
    paths = default_model_paths()
    gen = RolloutGenerator("default", backend="vllm", max_num_seqs=8, max_model_len=128,
                           speculative_config={"method": "draft_model", "model": paths["draft"],
                                               "num_speculative_tokens": 3})
    for role, load in (("target", gen.load_weights), ("draft", gen.load_draft_weights)):
        model = AutoModelForCausalLM.from_pretrained(paths[role], dtype=torch.float32).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.1 * torch.randn_like(model.model.embed_tokens.weight))
        load(model.named_parameters())
        assert gen.backend.llm.collective_rpc(_lm_head_error, args=(role,))[0] < 1e-4
        if role == "target":
            sample = gen.generate(["Q: 12+7\nA:\n"], 1, GREEDY, use_tqdm=False).samples[0]
            expected = hf_logprobs(model, sample.prompt_ids, sample.completion_ids, GREEDY)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_refresh_raises_acceptance_on_vllm(folders):
    """DrafterRefresh distils the 1-layer random draft toward the target on vLLM rollouts and loads it into vLLM's
    drafter (an in-process engine: the module's other one sits idle meanwhile)."""
    config = {"method": "draft_model", "model": folders["draft28"], "num_speculative_tokens": 3}
    generator = RolloutGenerator(folders["target28"], backend="vllm", speculative_config=config, max_num_seqs=32,
                                 max_model_len=128)
    teacher = AutoModelForCausalLM.from_pretrained(folders["target28"], dtype=torch.float32)
    kls, before, after = refresh_toward(generator, teacher, PROMPTS, SamplingParams(temperature=1.0, max_tokens=12,
                                                                                    seed=0))
    assert kls[-1] < 0.5 * kls[0]
    assert after.metrics["spec/acceptance_rate"] > before.metrics["spec/acceptance_rate"] + 0.05  # 0.007 -> 0.10
