"""The engine on a GPU: skipped where there is none (CI); run on a lent GPU machine."""

import pytest
import torch
from conftest import tiny_llama

from rollout import RolloutGenerator, SamplingParams
from spec.model_runner import RaggedRunner

require_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [3, 4, 10, 11]]


@require_cuda
def test_ragged_runner_on_cuda_matches_hf():
    model = tiny_llama(0).cuda()
    runner = RaggedRunner(model, max_num_seqs=4, max_model_len=64, dtype=torch.float32)
    slots = [runner.allocate() for _ in PROMPTS]
    logits = runner.forward(slots, PROMPTS, [len(p) for p in PROMPTS])
    expected = torch.cat([model(torch.tensor([p], device="cuda")).logits[0] for p in PROMPTS])
    torch.testing.assert_close(logits, expected.float(), atol=1e-4, rtol=1e-4)  # TF32 off by default for fp32


@require_cuda
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculative_equals_plain_on_cuda(method):
    target, draft = tiny_llama(0), tiny_llama(1, num_layers=1)
    config = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.0, max_tokens=16)
    plain = RolloutGenerator(target, device="cuda", dtype=torch.float32).generate(PROMPTS, 2, params,
                                                                                   use_tqdm=False)
    spec = RolloutGenerator(target, draft_model=draft if method == "draft_model" else None, device="cuda",
                            dtype=torch.float32, speculative_config=config).generate(PROMPTS, 2, params,
                                                                                     use_tqdm=False)
    assert [s.completion_ids for s in spec.samples] == [s.completion_ids for s in plain.samples]
    sampled = RolloutGenerator(target, device="cuda", dtype=torch.float32).generate(
        PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
    assert all(len(s.logprobs) == len(s.completion_ids) for s in sampled.samples)
