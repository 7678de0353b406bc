"""Run by tests/test_history_processes.py with torchrun, two CPU processes on gloo: both roll out and share once;
then process 1 leaves, and process 0's next share fails. Process 0 writes to <output_dir>/result.json whether it
warned, what the failed share added, whether its history stayed as it was, and that it rolled out again after."""

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from rollout import RolloutGenerator, SamplingParams, default_prompts
from spec.proposers.history import HistoryStore
from trainers_testing import default_tokenizer, tiny_policy

PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=0)


def snapshot(generator, path: Path) -> dict:
    generator.rollout_history.save(path)
    store = HistoryStore()
    store.load(path)
    return {key.hex(): sorted((e.tokens.tolist(), e.count) for e in entries) for key, entries in store._prompts.items()}


def main(output_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    generator = RolloutGenerator(tiny_policy(1), tokenizer=default_tokenizer(), max_num_seqs=4, max_model_len=128,
                                 speculative_config={"method": "history", "num_speculative_tokens": 3})
    prompts = default_prompts(4)
    first = generator.share_rollout_history(generator.generate([prompts[rank]], 2, PARAMS, use_tqdm=False))
    if rank == 1:
        dist.barrier()  # process 0 has its first share's result: leave without the second
        os._exit(0)
    dist.barrier()
    batch = generator.generate([prompts[2]], 2, PARAMS, use_tqdm=False)
    before = snapshot(generator, Path(output_dir, "before.npz"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failed = generator.share_rollout_history(batch)
    after = snapshot(generator, Path(output_dir, "after.npz"))
    again = generator.generate([prompts[3]], 2, PARAMS, use_tqdm=False)
    Path(output_dir, "result.json").write_text(json.dumps({
        "first_shared": first["num_shared"], "failed_shared": failed["num_shared"],
        "warnings": [str(w.message) for w in caught], "unchanged": before == after,
        "num_prompts": len(after), "rolled_out_after": len(again.samples)}))


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
