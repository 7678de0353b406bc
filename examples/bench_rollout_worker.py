"""The arms of examples/bench_rollout.py, served from their own process: JSON lines in, JSON lines out.

    python examples/bench_rollout_worker.py --arms no_spec,k4,schedule [--max-rows 512] ...

One process hosts the embedded arms on one generator (one KV cache, one set of weights): an arm is a speculation
(its drafter and policy, RolloutGenerator.build_speculation) swapped in before its call, and every adaptive arm keeps
its own policy (its calibration and refined costs) across calls, as a training run does. A vLLM arm or TRL's own
generation runs alone in its process (vLLM's engine is built for one config). Every arm is timed through the same
code, `GRPOTrainer._generate` on the batch a GRPO step would generate, with one trainer per batch shape.

Requests (one JSON object per line on stdin): {"arm", "num_prompts", "num_generations", "prompt_seed"}; or
{"greedy_check": N} (each embedded arm's greedy completions of N prompts against HF `generate`'s). Replies (stdout,
one line each): {"arm", "seconds", "num_tokens", "lengths", "steps", "stats"}, where steps are the embedded engine's
[seconds since the call started, running requests, the step's K, verified drafts per request, step seconds].
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from rollout import (RolloutGenerator, SamplingParams, default_model_paths, default_prompts,  # noqa: E402
                     default_speculative_config)
from rollout.defaults import DEFAULT_SCHEDULE, HISTORY_SCHEDULE  # noqa: E402

MAX_K = 8
STATIC_KS = (1, 2, 4, 8)


def embedded_configs(tuned: list | None) -> dict[str, dict | None]:
    """Embedded arm -> speculative config (None: no speculation)."""
    draft = {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": MAX_K}
    configs = {"no_spec": None, **{f"k{k}": {**draft, "num_speculative_tokens": k} for k in STATIC_KS},
               "schedule": {**draft, "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE},
               "adaptive": {**draft, "enable_adaptive_verification": True},
               "schedule_adaptive": {**draft, "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE,
                                     "enable_adaptive_verification": True}}
    if tuned is not None:
        configs["tuned"] = {**draft, "num_speculative_tokens_per_batch_size": tuned}
    return configs


class Recorded:
    """An arm's speculation policy, recording every step: when it ended (seconds since the run began), its running
    requests, its K, its verified drafts per request, and its seconds."""

    def __init__(self, inner):
        self.inner, self.steps, self._start, self._k = inner, [], 0.0, 0

    def begin_run(self):
        self.steps, self._start = [], time.perf_counter()
        self.inner.begin_run()

    def draft_limits(self, step):
        plan = self.inner.draft_limits(step)
        self._k = plan.k
        return plan

    def select(self, step, proposal, draft_seconds):
        return self.inner.select(step, proposal, draft_seconds)

    def observe(self, step, outcome):
        verified = sum(outcome.verified.num_draft_tokens) / step.num_reqs
        self.steps.append([round(time.perf_counter() - self._start, 5), step.num_reqs, self._k, round(verified, 3),
                           round(outcome.seconds, 6)])
        self.inner.observe(step, outcome)

    def end_run(self):
        self.inner.end_run()

    def stats(self):
        return self.inner.stats()


class Arms:
    """The arms this process serves, each a callable rollout function for a GRPOTrainer."""

    def __init__(self, names: list[str], args):
        self.args, self.names = args, names
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        self.embedded = [n for n in names if not n.startswith(("vllm_", "trl_"))]
        self.generator = self.speculations = None
        if self.embedded:
            self._build_embedded()
        elif names[0].startswith("vllm_"):
            self.generator = RolloutGenerator("default", backend="vllm", speculative_config=vllm_config(names[0]),
                                              max_num_seqs=args.max_rows, max_model_len=args.max_model_len,
                                              seed=args.seed, vllm_kwargs=one_step_prefill(args.max_rows))
        self.trainers: dict[tuple, object] = {}
        self._outputs = tempfile.mkdtemp()

    def _build_embedded(self) -> None:
        """One generator (one target and KV cache) for every embedded arm; each arm's drafter and policy take turns
        on it (build_speculation / use_speculation), each policy recorded."""
        tuned = json.loads(Path(self.args.tuned_config).read_text())["num_speculative_tokens_per_batch_size"] \
            if self.args.tuned_config else None
        configs = {name: embedded_configs(tuned)[name] for name in self.embedded}
        self.generator = RolloutGenerator("default", speculative_config=None, max_num_seqs=self.args.max_rows,
                                          max_model_len=self.args.max_model_len, device=self.device,
                                          dtype=self.dtype, seed=self.args.seed)
        self.speculations = {name: self.generator.build_speculation(config) for name, config in configs.items()}
        for speculation in self.speculations.values():
            speculation.policy = Recorded(speculation.policy)

    def use(self, arm: str) -> None:
        if arm in self.embedded:
            self.generator.use_speculation(self.speculations[arm])

    def run(self, arm: str, num_prompts: int, num_generations: int, prompt_seed: int) -> dict:
        self.use(arm)
        trainer = self._trainer(arm, num_prompts, num_generations)
        prompts = [p for p in default_prompts(num_prompts, seed=prompt_seed) for _ in range(num_generations)]
        start = time.perf_counter()
        completions = trainer._generate(prompts)[1]
        seconds = time.perf_counter() - start
        reply = {"arm": arm, "seconds": seconds, "num_tokens": sum(map(len, completions)),
                 "lengths": [len(c) for c in completions], "steps": [], "stats": {}}
        if arm in self.embedded:
            reply["steps"] = self.speculations[arm].policy.steps
        for mode in ("train", "eval"):  # the callback logs under the policy's mode
            metrics = trainer._metrics[mode]
            reply["stats"].update({key: values[-1] for key, values in metrics.items()
                                   if key.startswith("spec/") and values})
        return reply

    def _trainer(self, arm: str, num_prompts: int, num_generations: int):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from rollout.default_task import reward
        from trainers import SpecRolloutCallback
        key = ("trl" if arm.startswith("trl_") else "generator", num_prompts, num_generations)
        if key not in self.trainers:
            rows = num_prompts * num_generations
            config = GRPOConfig(output_dir=self._outputs, per_device_train_batch_size=rows,
                                num_generations=num_generations, max_completion_length=self.args.max_completion_length,
                                temperature=1.0, bf16=False, report_to=[], save_strategy="no", seed=self.args.seed,
                                use_cpu=self.device.type == "cpu")
            callbacks = [] if key[0] == "trl" else [SpecRolloutCallback(self.generator)]
            rollout_func = callbacks[0].rollout_func if callbacks else None
            dataset = Dataset.from_dict({"prompt": default_prompts(num_prompts, seed=self.args.seed)})
            self.trainers[key] = GRPOTrainer(
                model=self._policy(), reward_funcs=lambda prompts, completions, **kw: [
                    reward(p, c) for p, c in zip(prompts, completions)],
                args=config, train_dataset=dataset, processing_class=self._tokenizer(), rollout_func=rollout_func,
                callbacks=callbacks)
        return self.trainers[key]

    def _policy(self):
        from transformers import AutoModelForCausalLM
        if not hasattr(self, "_policy_model"):
            self._policy_model = AutoModelForCausalLM.from_pretrained(
                default_model_paths()["target"], dtype=self.dtype).to(self.device).eval()
        return self._policy_model

    def _tokenizer(self):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(default_model_paths()["target"])

    def greedy_check(self, num_prompts: int) -> dict:
        """Each embedded arm's greedy completions of num_prompts prompts against HF generate's, token for token."""
        tokenizer, model = self._tokenizer(), self._policy()
        prompts = default_prompts(num_prompts, seed=self.args.seed + 99)
        expected = [hf_greedy(model, tokenizer, p, self.args.max_completion_length) for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=self.args.max_completion_length)
        result = {}
        for arm in self.embedded:
            self.use(arm)
            samples = self.generator.generate(prompts, 1, params, use_tqdm=False).samples
            result[arm] = sum(s.completion_ids == e for s, e in zip(samples, expected)) / len(prompts)
        return {"greedy_check": result, "num_prompts": num_prompts}


def hf_greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()[:max_tokens]


def vllm_config(arm: str) -> dict | None:
    """vllm_no_spec; the draft model at static K (vllm_k<K>) or with the default schedule (vllm_schedule); vLLM's
    suffix decoding (vllm_suffix_k<K>; with its own adaptive verification on 0.34+: vllm_suffix_adaptive_k<K>); the
    project's history drafter through vLLM's custom_class hook at static K
    (vllm_history_k<K>, trees 12 deep as the default's), with adaptive verification under that K
    (vllm_history_adaptive_k<K>) or under rollout.defaults.HISTORY_SCHEDULE (vllm_history_schedule_adaptive);
    rollout.default_speculative_config("vllm") (vllm_default)."""
    draft = {"method": "draft_model", "model": default_model_paths()["draft"], "num_speculative_tokens": MAX_K}
    if arm == "vllm_no_spec":
        return None
    if arm == "vllm_default":
        return default_speculative_config("vllm")
    if arm == "vllm_schedule":
        return {**draft, "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE}
    if arm.startswith("vllm_suffix_k"):
        return {"method": "suffix", "num_speculative_tokens": int(arm.removeprefix("vllm_suffix_k"))}
    if arm.startswith("vllm_suffix_adaptive_k"):
        return {"method": "suffix", "num_speculative_tokens": int(arm.removeprefix("vllm_suffix_adaptive_k")),
                "enable_adaptive_verification": True}
    history = {"method": "history", "suffix_decoding_max_tree_depth": 12}
    if arm.startswith("vllm_history_k"):
        return {**history, "num_speculative_tokens": int(arm.removeprefix("vllm_history_k"))}
    if arm.startswith("vllm_history_adaptive_k"):
        return {**history, "num_speculative_tokens": int(arm.removeprefix("vllm_history_adaptive_k")),
                "enable_adaptive_verification": True}
    if arm == "vllm_history_schedule_adaptive":
        return {**history, "num_speculative_tokens": 8, "num_speculative_tokens_per_batch_size": HISTORY_SCHEDULE,
                "enable_adaptive_verification": True}
    return {**draft, "num_speculative_tokens": int(arm.removeprefix("vllm_k"))}


def one_step_prefill(max_num_seqs: int) -> dict:
    """vLLM kwargs that prefill every prompt of a batch in one step: vLLM's CPU build aborts seeded sampling when it
    chunks a prefill ("CPU Generator does not use offset": a chunked request's generator is rewound, which a CPU
    generator cannot do); the default task's prompts are at most 31 tokens, so 32 a row covers a whole batch."""
    return {"max_num_batched_tokens": max(8192, 32 * max_num_seqs)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", required=True)
    p.add_argument("--max-rows", type=int, default=512)
    p.add_argument("--max-completion-length", type=int, default=320)
    p.add_argument("--max-model-len", type=int, default=384)
    p.add_argument("--tuned-config", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    arms = Arms(args.arms.split(","), args)
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "greedy_check" in request:
            reply = arms.greedy_check(request["greedy_check"])
        else:
            reply = arms.run(request["arm"], request["num_prompts"], request["num_generations"],
                             request["prompt_seed"])
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
