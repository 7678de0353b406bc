"""The memory figures the README quotes, measured: the bytes of a stored rollout token at rest (the history store's
arrays and its Python bookkeeping) and of a trie node while a group runs (the trie's C buffers and Python's part),
both by tracemalloc, which sees the numpy arrays and the trie's PyMem buffers. Each must be within 10% of the README's
figure; docs/rollout_history.md and the docstrings quote the README's phrase word for word, and the README's 10,000 x
8 x 500 example follows from its figure."""

import random
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from spec.proposers.history import HistoryStore
from spec.proposers.suffix_tree import SuffixTree

ROOT = Path(__file__).resolve().parents[1]
TOKEN = r"([\d.]+) bytes a stored rollout token"
NODE = r"([\d.]+) bytes a trie node"
EXAMPLE = r"10,000 prompts x 8 rollouts x 500 tokens is ([\d.]+) MB"
QUOTED_BY = {"docs/rollout_history.md": (TOKEN, NODE), "spec/config.py": (TOKEN, NODE),
             "spec/proposers/history.py": (TOKEN,), "spec/proposers/suffix_tree.py": (NODE,)}
PROMPT_LEN, OUTPUT_LEN, NUM_ROLLOUTS, VOCAB = 50, 500, 8, 32_000  # the README's example: 8 rollouts of 500 tokens


def _words(text: str) -> str:
    """Text with line breaks, indentation and comment marks folded into single spaces."""
    return " ".join(text.replace("#", " ").split())


def _readme(pattern: str) -> tuple[str, float]:
    """The README's phrase and its number."""
    match = re.search(pattern, _words((ROOT / "README.md").read_text()))
    assert match, f"the README does not say {pattern!r}"
    return match.group(0), float(match.group(1))


def _traced(build) -> tuple[object, int]:
    """What build() returns and the bytes it holds at the end (tracemalloc)."""
    tracemalloc.start()
    try:
        result = build()
        return result, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def _rollouts(rng: np.random.Generator, num_prompts: int) -> list[tuple[list[int], list[list[int]]]]:
    """Per prompt, its tokens and its distinct rollouts, as lists (what the drafter hands the store)."""
    return [(rng.integers(0, VOCAB, PROMPT_LEN).tolist(),
             [rng.integers(0, VOCAB, OUTPUT_LEN).tolist() for _ in range(NUM_ROLLOUTS)]) for _ in range(num_prompts)]


def test_a_stored_rollout_token_takes_what_the_readme_says():
    rollouts = _rollouts(np.random.default_rng(0), num_prompts=200)  # per-token bytes do not depend on the count

    def build():
        store = HistoryStore(max_rollouts_per_prompt=NUM_ROLLOUTS, max_tokens=10 ** 9)
        for prompt, outputs in rollouts:
            for output in outputs:
                store.add(prompt, output)
        return store

    store, used = _traced(build)
    assert store.num_tokens == 200 * NUM_ROLLOUTS * OUTPUT_LEN and store.nbytes() == 4 * store.num_tokens
    assert used / store.num_tokens == pytest.approx(_readme(TOKEN)[1], rel=0.1)


def test_a_trie_node_takes_what_the_readme_says():
    """A group's trie while it runs: its prompt and 8 rollouts of 500 tokens that never repeat each other (every
    token adds a node at each depth), at the default config's depth 12."""
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    sequences = [prompt + [rng.randrange(VOCAB) for _ in range(OUTPUT_LEN)] for _ in range(NUM_ROLLOUTS)]

    def build():
        trie = SuffixTree(12)
        for seq_id, tokens in enumerate(sequences):
            trie.add(seq_id, tokens)
        return trie

    trie, used = _traced(build)
    assert trie.num_nodes > 10 * len(sequences) * len(sequences[0])  # nearly 12 a token: the prompt is shared
    assert 0.95 * used <= trie.nbytes() <= used  # the C buffers are nearly all of it
    assert used / trie.num_nodes == pytest.approx(_readme(NODE)[1], rel=0.1)


def test_the_readmes_example_follows_from_its_figure():
    num_tokens = 10_000 * NUM_ROLLOUTS * OUTPUT_LEN
    assert _readme(EXAMPLE)[1] == pytest.approx(num_tokens * _readme(TOKEN)[1] / 1e6, rel=0.02)


@pytest.mark.parametrize("path, patterns", QUOTED_BY.items())
def test_the_docs_quote_the_readmes_figures(path, patterns):
    text = _words((ROOT / path).read_text())
    for pattern in patterns:
        phrase = _readme(pattern)[0]
        assert phrase in text, f"{path} does not quote the README's {phrase!r}"
        assert all(m.group(0) == phrase for m in re.finditer(pattern, text)), f"{path} quotes another figure"
