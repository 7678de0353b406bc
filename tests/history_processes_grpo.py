"""Run by tests/test_history_processes.py under `accelerate launch` with several CPU processes: one epoch of GRPO
over 8 prompts (4 rows a process, num_generations 4: each process rolls out one prompt a step) with the history
drafter and SpecRolloutCallback, which shares every rollout with the other processes' histories. Each process writes
its history (<output_dir>/history<rank>.npz) and the prompts it rolled out itself (<output_dir>/rank<rank>.json)."""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset
from trl import GRPOTrainer

from rollout import RolloutGenerator, default_prompts
from trainers import SpecRolloutCallback
from trainers_testing import default_tokenizer, grpo_config, length_reward, tiny_policy

NUM_PROMPTS = 8


def main(output_dir: str) -> None:
    num_processes = int(os.environ["WORLD_SIZE"])
    steps = NUM_PROMPTS // num_processes  # one epoch: each process rolls out one prompt a step
    args = grpo_config(output_dir, per_device_train_batch_size=4, num_generations=4, max_steps=steps)
    generator = RolloutGenerator(tiny_policy(1), tokenizer=default_tokenizer(), max_num_seqs=8, max_model_len=128,
                                 speculative_config={"method": "history", "num_speculative_tokens": 3})
    callback = SpecRolloutCallback(generator)
    own = []

    def rollout_func(prompts, trainer):  # the callback's, with a record of this process's prompts
        own.extend(dict.fromkeys(prompts))
        return callback.rollout_func(prompts, trainer)

    trainer = GRPOTrainer(model=tiny_policy(0), reward_funcs=length_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": default_prompts(NUM_PROMPTS)}),
                          processing_class=default_tokenizer(), rollout_func=rollout_func, callbacks=[callback])
    trainer.train()
    rank = trainer.accelerator.process_index
    generator.rollout_history.save(Path(output_dir, f"history{rank}.npz"))
    logged = [e for e in trainer.state.log_history if "loss" in e]
    Path(output_dir, f"rank{rank}.json").write_text(json.dumps({"own_prompts": own, "logged": logged}))


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as examples/grpo_arithmetic.py: gloo's teardown can hang or abort a finished rank
