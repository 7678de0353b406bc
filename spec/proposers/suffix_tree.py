"""The count-annotated, depth-capped suffix trie behind SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975).

`SuffixTree(max_depth)` counts every substring of length <= max_depth of its sequences (a node exists iff its count
is > 0; the root's count is num_tokens): up to max_depth nodes a token, 87 bytes a trie node (the README's figure,
measured by tests/test_memory.py; `nbytes()`: its C buffers). Sequences are keyed by ints; tokens are ints in int32's
range (TypeError, OverflowError otherwise). `add(seq_id, token_ids=(), weight=1)` counts a new sequence as `weight` (1
to 2**62) identical ones; `extend(seq_id, token_ids)` appends; `extend_to(seq_id, token_ids)` appends what token_ids has
beyond the sequence, False (appending nothing) where it does not continue it (checked on the last max_depth tokens);
`remove(seq_id)` uncounts it and frees the nodes left at 0. `match(context, max_tokens, min_token_prob)` -> (drafts,
probs, match_length): match_length is the longest suffix of context (< max_depth tokens) that occurs followed by a
token, found by binary search; from its node, take the most frequent child (ties: smallest id) while child count / (the
children's total) >= min_token_prob, up to max_tokens drafts; a path of max_depth tokens goes on from its last
max_depth - 1. `match_sequence(seq_id, ...)` is match(sequence(seq_id), ...) without the search. Costs (D = max_depth):
O(D) a token appended or removed, O(D log D) + O(D) a draft to match.

Failures: inputs are converted before the trie changes, and an update that raises (a bad token, MemoryError, a
ValueError past num_tokens' 2**63 - 1) leaves it as it was; extend_to raises RuntimeError where a token's __index__
changed the trie. A broken invariant raises RuntimeError and the trie refuses every later call. A missing or stale build
of spec/proposers/_suffix_tree.c is an ImportError naming the fix (load_extension).
"""

import importlib

from spec.proposers.trie_sources import source_hash

BUILD_FIX = ("re-run `pip install -e .` in the project's folder (it compiles spec/proposers/_suffix_tree.c: a C compiler "
             "and Python's headers are needed), or `python setup.py build_ext --inplace` there")


def load_extension():
    """The compiled module; ImportError naming the fix where it is not built, or was built from other sources than
    the ones beside it (a stale build: the C changed since)."""
    try:
        module = importlib.import_module("spec.proposers._suffix_tree")
    except ImportError as e:
        raise ImportError(f"the compiled suffix trie (spec.proposers._suffix_tree) cannot be imported ({e}): "
                          f"{BUILD_FIX}") from e
    check_build(getattr(module, "SOURCE_HASH", None), source_hash())
    return module


def check_build(built: str | None, sources: str | None) -> None:
    """ImportError where a module built from sources hashing to `built` is not the build of the sources at hand (None:
    not shipped, as in an installed wheel, and nothing to compare)."""
    if sources is not None and built != sources:
        raise ImportError(f"the compiled suffix trie is stale: it was built from sources hashing to {built!r}, the "
                          f"sources now hash to {sources!r}; {BUILD_FIX}")


SuffixTree = load_extension().SuffixTree

__all__ = ["SuffixTree"]
