"""Run by tests/test_vllm_server.py under `accelerate launch` with two CPU processes: two GRPO steps of the default
pair's target (float32) whose rollouts come from one vLLM server shared by both processes (backend="server"), with the callback's weight sync and a
drafter refresh every step. Each process writes what it was asked and what came back to <output_dir>/rank<i>.json;
the main process also writes the policy as it was at the last rollout (just synced) and its refreshed draft, as
safetensors files, for the test to compare with what the server holds."""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from trainers_testing import RecordingCallback, grpo_config, grpo_trainer

from rollout import RolloutGenerator, default_model_paths


def main(output_dir: str, base_url: str) -> None:
    args = grpo_config(output_dir, per_device_train_batch_size=6, num_generations=4, max_steps=2)
    generator = RolloutGenerator(backend="server", base_url=base_url)  # the key: VLLM_API_KEY (the test sets it)
    calls = []
    callback = RecordingCallback(generator, drafter_refresh_steps=1, drafter_learning_rate=1e-2)

    def rollout_func(prompts, trainer):  # the callback's, with a record of each call
        out = callback.rollout_func(prompts, trainer)
        calls.append({"prompts": list(prompts), "completion_ids": out["completion_ids"],
                      "num_logprobs": [len(x) for x in out["logprobs"]]})
        return out

    policy = AutoModelForCausalLM.from_pretrained(default_model_paths()["target"], dtype=torch.float32)
    trainer = grpo_trainer(policy, rollout_func, args, callbacks=[callback])
    trainer.train()
    rank = trainer.accelerator.process_index
    if rank == 0:
        save_file({n: p.detach().contiguous() for n, p in callback.policy.named_parameters()},
                  str(Path(output_dir, "policy.safetensors")))
        draft = callback.drafter_refresh.draft
        save_file({n: p.detach().contiguous() for n, p in draft.named_parameters()},
                  str(Path(output_dir, "draft.safetensors")))
    record = {"rank": rank, "world_size": trainer.accelerator.num_processes, "calls": calls,
              "num_syncs": callback.weight_sync.num_syncs,
              "num_refreshes": callback.drafter_refresh.num_refreshes}
    Path(output_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as examples/grpo_arithmetic.py: gloo's teardown can hang or abort a finished rank
