"""Run by tests/test_vllm_tensor_parallel.py in its own process (vLLM spawns one worker process per TP rank, which
re-imports this file as __mp_main__: the work stays under the __main__ guard). backend="vllm" with
tensor_parallel_size=2 on tiny folders: sampled logprobs against HF (the CPU sampler fix must reach both workers),
a draft reload (a drafter that is a copy of the target, then noise, then the copy again), a target load, and the
project's history drafter through vLLM's custom_class hook on both ranks. Prints one JSON line of results."""

import gc
import json
import shutil
import sys
from pathlib import Path

import torch


def main(root: str) -> dict:
    from transformers import AutoModelForCausalLM
    from vllm_testing import hf_logprobs, save_tiny_llama

    from rollout import RolloutGenerator, SamplingParams
    target = save_tiny_llama(Path(root, "target"), 0, 2)
    shutil.copytree(target, Path(root, "draft"))
    gen = RolloutGenerator(target, backend="vllm", max_num_seqs=8, max_model_len=128,
                           speculative_config={"method": "draft_model", "model": str(Path(root, "draft")),
                                               "num_speculative_tokens": 3},
                           vllm_kwargs={"tensor_parallel_size": 2})
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts, greedy = [[5, 6, 7], [9, 10, 11, 12], [30, 31]], SamplingParams(temperature=0.0, max_tokens=16)
    sampled = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, max_tokens=16)
    worst = max(float((torch.tensor(s.logprobs) - hf_logprobs(model, s.prompt_ids, s.completion_ids, sampled)).abs()
                      .max()) for s in gen.generate(prompts, 2, sampled, use_tqdm=False).samples)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    acceptance = [gen.generate(prompts, 1, greedy, use_tqdm=False).stats["draft_acceptance_rate"]]
    gen.load_draft_weights((n, 0.05 * torch.randn_like(t)) for n, t in weights.items())
    acceptance.append(gen.generate(prompts, 1, greedy, use_tqdm=False).stats["draft_acceptance_rate"])
    gen.load_draft_weights(weights.items())
    acceptance.append(gen.generate(prompts, 1, greedy, use_tqdm=False).stats["draft_acceptance_rate"])
    with torch.no_grad():
        model.model.norm.weight.neg_()
    gen.load_weights(model.named_parameters())
    sample = gen.generate(prompts[:1], 1, greedy, use_tqdm=False).samples[0]
    target_diff = float((torch.tensor(sample.logprobs)
                         - hf_logprobs(model, sample.prompt_ids, sample.completion_ids, greedy)).abs().max())
    fixed = gen.backend.llm.collective_rpc("sampler_fix_applied")
    del gen  # one engine at a time: vLLM's parallel groups are process-global
    gc.collect()
    return {"worst_sampled_logprob_diff": worst, "draft_acceptance": acceptance,
            "target_logprob_diff_after_load": target_diff, "sampler_fix_applied": fixed,
            **history_drafter(target, prompts, greedy)}


def history_drafter(target: str, prompts: list[list[int]], greedy) -> dict:
    """The project's history drafter on both ranks: greedy output against HF's, twice (the second call drafts from
    the first's rollouts), and each rank's count of proposed drafts (identical drafts on both ranks)."""
    from transformers import AutoModelForCausalLM

    from rollout import RolloutGenerator
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    expected = [model.generate(torch.tensor([p]), max_new_tokens=greedy.max_tokens, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    gen = RolloutGenerator(target, backend="vllm", max_num_seqs=8, max_model_len=128,
                           speculative_config={"method": "history", "num_speculative_tokens": 3},
                           vllm_kwargs={"tensor_parallel_size": 2})
    batches = [gen.generate(prompts, 2, greedy, use_tqdm=False) for _ in range(2)]
    # another process's rollout of a new prompt, added to every rank's history: its first call drafts it whole
    new = [40, 41, 42]
    rollout = model.generate(torch.tensor([new]), max_new_tokens=greedy.max_tokens, do_sample=False)[0, 3:].tolist()
    gen.rollout_history.add([new], [rollout])
    fed = gen.generate([new], 1, greedy, use_tqdm=False)
    stats = gen.backend.llm.collective_rpc("rollout_drafter_stats")
    return {"history_greedy_equal": [[s.completion_ids for s in b.samples] == [e for e in expected for _ in range(2)]
                                     for b in batches] + [fed.samples[0].completion_ids == rollout],
            "history_mean_acceptance_length": [b.stats["mean_acceptance_length"] for b in batches + [fed]],
            "history_kept": gen.rollout_history is not None, "history_hit_rate": fed.stats["history_hit_rate"],
            "history_drafts_per_rank": [s["num_draft_tokens"] for s in stats]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
