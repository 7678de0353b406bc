"""A count-annotated suffix trie capped at a depth: the data structure behind SuffixDecoding.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; arctic-inference's suffix cache) drafts by matching the
tail of a context against earlier token sequences and following the most frequent continuation. This trie holds
every substring of length <= max_depth of the sequences inserted, each node counting the occurrences of its
substring (the root's count is the number of tokens inserted); a node exists iff its count is > 0. It is
uncompressed: memory is O(num_tokens * max_depth) nodes in the worst case (about 60 bytes a node).

`SuffixTree(max_depth)`, sequences keyed by integer ids:
- `add(seq_id, token_ids=(), weight=1)`: a new sequence; weight w counts it as w identical sequences (at the cost of
  one). `extend(seq_id, token_ids)` appends; `extend_to(seq_id, token_ids)` appends what token_ids has beyond the
  sequence, and returns False (appending nothing) where token_ids does not continue it (checked on the last
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

Costs (D = max_depth): append one token O(D) node updates (every substring ending at it); remove a sequence of
length n O(n * D); match O(D log D) to find the tail plus O(D) per draft token. Drafting extends every running
request every step, so the trie is compiled (spec/proposers/_suffix_tree.c, built by `pip install`): in Python a
token's D updates took about 7 us.
"""

from spec.proposers._suffix_tree import SuffixTree

__all__ = ["SuffixTree"]
