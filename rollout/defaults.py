"""The library's defaults: the speculative config each backend runs when the user names none, and the schedule
tuner's minimum gain. The CLI, `rollout serve`, the examples and the docs all read them here.

No heavy import (torch, transformers): `python -m rollout --help` reads these.
"""

# K by live batch size for the default pair: the table `python -m rollout tune --max-num-seqs 512` measured on the
# 2-core CPU this project is developed on (2 torch threads, every K timed on rollouts at batch sizes 1..512), made
# non-increasing in the batch size; from 91 running requests up no K beat no speculation by 2%. Re-run tune on other
# hardware (a GPU's crossover lies about ten times higher).
DEFAULT_SCHEDULE = [[1, 1, 8], [2, 4, 4], [5, 22, 2], [23, 90, 1], [91, 512, 0]]
# K by live batch size for the history drafter (K = 8 at most, trees 12 deep) on the GRPO step's shape, what
# `python -m rollout tune --speculative-config '{"method": "history", "num_speculative_tokens": 8,
# "suffix_decoding_max_tree_depth": 12}' --max-num-seqs 512 --max-tokens 320 --num-generations 8` measured on the same
# 2-core CPU, each K from the same history state (the prompts' earlier epoch: rollout/tune.py). Adaptive verification
# cuts each request inside it. At the tuner's default 64 tokens it read K = 8 up to 181 rows: short completions keep
# the contexts short, where a verified token costs less.
HISTORY_SCHEDULE = [[1, 45, 8], [46, 512, 4]]
# spec.tuning.MIN_GAIN, written out so that the CLI's --help does not import torch (tests/test_cli.py checks both)
DEFAULT_MIN_GAIN = 1.02
BACKENDS = ("embedded", "vllm", "server")


def default_speculative_config(backend: str = "embedded", draft_model: str | None = None) -> dict:
    """The speculative config that measured fastest on the GRPO step for `backend`. A fresh dict: change it freely.

    Every backend: the rollout-history drafter (each prompt's earlier rollouts, its live siblings and a global cache
    of outputs; on vLLM inside its workers, rollout/vllm_backend/) with K = 4 and adaptive verification through the
    drain, its suffix trees 12 tokens deep (24, vLLM's default, made the drafter's trie updates a fifth of a 512-row
    call for no more acceptance). On examples/bench_epochs.py's rollouts (2-core CPU, 8x8 and 64x8, epochs 1-3) it ran
    0.96-1.03x static K = 4, the fastest static arm, and cut the drafts where they rarely survive; with K = 8 the same
    policy ran 0.92-0.99x, and with HISTORY_SCHEDULE (K = 8 up to 45 rows, 4 above) 0.94-1.10x: on top of the policy
    under K = 4 the schedule added nothing. The draft model with DEFAULT_SCHEDULE trailed both engines' defaults and
    fell below no speculation at 64x8 on vLLM. The measured guard (spec/measured_guard.py) turns drafting off at a
    batch size where it measured slower than none: on a real model the policy alone ran 0.80-0.94x no speculation.
    With `draft_model` given (any backend): that draft model with K = 8 and DEFAULT_SCHEDULE."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {list(BACKENDS)}")
    if draft_model is None:
        return {"method": "history", "num_speculative_tokens": 4, "enable_adaptive_verification": True,
                "enable_measured_guard": True, "suffix_decoding_max_tree_depth": 12}
    return {"method": "draft_model", "model": draft_model,
            "num_speculative_tokens": 8, "num_speculative_tokens_per_batch_size": [list(r) for r in DEFAULT_SCHEDULE]}
