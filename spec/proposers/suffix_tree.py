"""A count-annotated suffix trie capped at a depth: the data structure behind SuffixDecoding.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; arctic-inference's suffix cache) drafts by matching the
tail of a context against earlier token sequences and following the most frequent continuation. This trie holds
every substring of length <= max_depth of the sequences inserted, each node counting the occurrences of its
substring (the root's count is the number of tokens inserted); a node exists iff its count is > 0. It is
uncompressed: up to max_depth nodes a token (fewer where sequences repeat each other), 87 bytes a trie node (the
README's figure, measured by tests/test_memory.py; 64 to 128 by how full the node array and the edge table are).
`nbytes()`: the bytes its C buffers hold.

`SuffixTree(max_depth)`, sequences keyed by integer ids (anything with __index__ is the int it returns); tokens are
ints in int32's range (TypeError, OverflowError otherwise):
- `add(seq_id, token_ids=(), weight=1)`: a new sequence; weight w (1 to 2**62) counts it as w identical sequences (at
  the cost of one). `extend(seq_id, token_ids)` appends; `extend_to(seq_id, token_ids)` appends what token_ids has
  beyond the sequence, and returns False (appending nothing) where token_ids does not continue it (checked on the last
  max_depth tokens); `remove(seq_id)` uncounts it and frees the nodes whose count drops to 0.
- `match(context, max_tokens, min_token_prob)` -> (drafts, probs, match_length). match_length: the longest suffix
  of context that occurs followed by a token (at most max_depth - 1 tokens: a path of max_depth tokens has no
  children), found by binary search (if s + x occurs, every suffix of s is followed by x somewhere too). From its
  node, greedily take the most frequent child (ties: smallest token id) while its conditional frequency child count
  / (sum of the children's counts) is >= min_token_prob and fewer than max_tokens drafts are taken. The denominator
  counts only occurrences that have a next token: an occurrence at the end of a sequence (the querying request's
  own tail, a running sibling's) says nothing about what comes next. When the path reaches max_depth tokens the
  walk continues from its last max_depth - 1 tokens (a suffix link), so speculation runs past max_depth.
- `match_sequence(seq_id, ...)`: match(sequence(seq_id), ...) without the search: the trie keeps the nodes of each
  sequence's suffixes of length 0 .. max_depth - 1, and the longest with a child is the deepest that has children.
- `count(token_ids)`, `sequence(seq_id)`, `substring_counts()` (tests and debugging), `num_seqs`, `num_tokens`
  (weighted), `num_nodes`, `seq_id in trie`.

Failures: every input is converted before the trie changes (a token's __index__ may run any code, this trie's methods
included; extend_to raises RuntimeError where that code changed the trie), and an update that raises (a bad token,
MemoryError, a ValueError where it would take num_tokens, which bounds every count, past 2**63 - 1) leaves the trie
exactly as it was. A broken invariant found by a lookup raises RuntimeError, nothing is read or written out of
bounds, and the trie refuses every later call. A missing build, or one compiled from other sources than those beside
it (stale), is an ImportError naming the fix (load_extension).

Costs (D = max_depth): append one token O(D) node updates (every substring ending at it); remove a sequence of
length n O(n * D); match O(D log D) to find the tail plus O(D) per draft token. Drafting extends every running
request every step, so the trie is compiled (spec/proposers/_suffix_tree.c, built by `pip install`): in Python a
token's D updates took about 7 us.
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
