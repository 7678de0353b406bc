"""A count-annotated suffix trie capped at a depth: the data structure behind SuffixDecoding.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; arctic-inference's suffix cache) drafts by matching the
tail of a context against earlier token sequences and following the most frequent continuation. This trie holds
every substring of length <= max_depth of the sequences inserted, each node counting the occurrences of its
substring (the root's count is the number of tokens inserted); a node exists iff its count is > 0. It is
uncompressed: memory is O(num_tokens * max_depth) nodes in the worst case.

Costs (D = max_depth): append one token O(D) node updates (every substring ending at it); remove a sequence of
length n O(n * D); match O(D log D) to find the tail plus O(D) per draft token.
"""

from typing import Sequence

ROOT = 0


class SuffixTree:
    """Substring counts of a set of sequences, keyed by integer sequence ids.

    Nodes are integer ids into `_counts` and `_children` ({token: child id}): containers of ints only, which
    Python's garbage collector does not track (with one object per node, inserts ran ~5x slower, mostly in GC).
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth={max_depth} must be >= 2: matching needs a context token and a continuation")
        self.max_depth = max_depth
        self._counts: list[int] = [0]  # node id -> occurrences of its substring
        self._children: dict[int, dict[int, int]] = {}  # only nodes that have children
        self._free_ids: list[int] = []
        self._seqs: dict[int, list[int]] = {}
        self._weights: dict[int, int] = {}  # per sequence, what each of its substrings adds to the counts
        # per sequence, the nodes of its suffixes of length 0..max_depth-1 (root first): where the next token hangs
        self._active_nodes: dict[int, list[int]] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        """Tokens inserted, over every sequence, each counted by its sequence's weight (the root's count)."""
        return self._counts[ROOT]

    @property
    def num_nodes(self) -> int:
        return len(self._counts) - len(self._free_ids)

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens inserted for seq_id (the trie's own list: do not modify it)."""
        return self._seqs[seq_id]

    def add(self, seq_id: int, token_ids: Sequence[int] = (), weight: int = 1) -> None:
        """A new sequence; weight w counts it as w identical sequences (at the cost of one)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the trie; use extend() to append to it")
        if type(weight) is not int or weight < 1:
            raise ValueError(f"weight={weight!r}: a sequence counts as an integer number >= 1 of sequences")
        self._seqs[seq_id] = []
        self._weights[seq_id] = weight
        self._active_nodes[seq_id] = [ROOT]
        self.extend(seq_id, token_ids)

    def extend(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Append tokens to seq_id, counting every substring (of length <= max_depth) that ends at each: O(max_depth)
        a token. The hot path of drafting (every step extends every running request), hence the local names."""
        seq, weight, counts, all_children = self._seqs[seq_id], self._weights[seq_id], self._counts, self._children
        active_nodes, max_depth = self._active_nodes[seq_id], self.max_depth
        for token in token_ids:
            seq.append(token)
            extended = [ROOT]  # the nodes of the suffixes ending at token, by length
            for node in active_nodes:
                children = all_children.get(node)
                if children is None:
                    children = all_children[node] = {}
                child = children.get(token)
                if child is None:
                    child = children[token] = self._new_node()
                counts[child] += weight
                extended.append(child)
            if len(extended) > max_depth:
                extended.pop()  # a node at depth max_depth gets no children
            active_nodes = extended
        self._active_nodes[seq_id] = active_nodes
        counts[ROOT] += weight * len(token_ids)

    def remove(self, seq_id: int) -> None:
        """Uncount every substring of the sequence and delete the nodes whose count drops to 0: O(n * max_depth)."""
        seq = self._seqs.pop(seq_id)
        weight = self._weights.pop(seq_id)
        del self._active_nodes[seq_id]
        self._counts[ROOT] -= weight * len(seq)
        for start in range(len(seq)):
            node = ROOT
            for token in seq[start:start + self.max_depth]:
                child = self._children[node][token]
                self._counts[child] -= weight
                if self._counts[child] == 0:
                    # every occurrence below it is inside this sequence too: the whole subtree goes
                    self._delete_child(node, token)
                    break
                node = child

    def count(self, token_ids: Sequence[int]) -> int:
        """Occurrences of token_ids as a substring (0 when absent or longer than max_depth)."""
        node = self._walk(token_ids)
        return 0 if node is None else self._counts[node]

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """{substring: count} for every node, the root as (); for tests and debugging."""
        counts, stack = {}, [((), ROOT)]
        while stack:
            path, node = stack.pop()
            counts[path] = self._counts[node]
            stack.extend((path + (token,), child) for token, child in self._children.get(node, {}).items())
        return counts

    def match(self, context: Sequence[int], max_tokens: int,
              min_token_prob: float) -> tuple[list[int], list[float], int]:
        """(drafts, probs, match_length): speculate a continuation of context from the counts.

        match_length: the longest suffix of context that occurs followed by a token; a path of max_depth tokens
        has no children, so it is at most max_depth - 1 tokens.
        From its node, greedily take the most frequent child (ties: smallest token id) while its conditional
        frequency child count / (sum of the children's counts) is >= min_token_prob and fewer than max_tokens
        drafts are taken. The denominator counts only occurrences that have a next token: an occurrence at the end
        of a sequence (the querying request's own tail, a running sibling's) says nothing about what comes next.
        When the path reaches max_depth tokens the walk continues from its last max_depth - 1 tokens (a suffix
        link), so speculation runs past max_depth.
        """
        node, match_length = self._longest_continued_suffix(context)
        return self._continue(node, list(context[len(context) - match_length:]), max_tokens, min_token_prob)

    def match_sequence(self, seq_id: int, max_tokens: int,
                       min_token_prob: float) -> tuple[list[int], list[float], int]:
        """match(self.sequence(seq_id), ...) without searching: the trie keeps the nodes of the sequence's suffixes,
        so the longest one with a child is the deepest of them that has children."""
        active_nodes = self._active_nodes[seq_id]
        match_length = len(active_nodes) - 1
        while match_length and active_nodes[match_length] not in self._children:
            match_length -= 1
        seq = self._seqs[seq_id]
        return self._continue(active_nodes[match_length] if match_length else None,
                              seq[len(seq) - match_length:], max_tokens, min_token_prob)

    def _continue(self, node: int | None, path: list[int], max_tokens: int,
                  min_token_prob: float) -> tuple[list[int], list[float], int]:
        """The drafts from node, whose substring is path (match's docstring)."""
        match_length = len(path)
        drafts, probs = [], []
        counts, all_children = self._counts, self._children
        while len(drafts) < max_tokens and node in all_children:
            token, child, best, total = -1, -1, 0, 0  # the most frequent child, ties to the smallest token id
            for t, c in all_children[node].items():
                n = counts[c]
                total += n
                if n > best or (n == best and t < token):
                    token, child, best = t, c, n
            prob = best / total
            if prob < min_token_prob:
                break
            drafts.append(token)
            probs.append(prob)
            path.append(token)
            node = child
            if len(path) == self.max_depth:
                del path[0]
                node = self._walk(path)
                assert node is not None, "every substring of a stored path is stored"
        return drafts, probs, match_length

    def _longest_continued_suffix(self, context: Sequence[int]) -> tuple[int | None, int]:
        """The node of the longest suffix (length <= max_depth - 1) that has a child, by binary search.

        Monotone in the length: if s + x occurs, every suffix of s is followed by x somewhere too.
        """
        best_node, best_length = None, 0
        lo, hi = 1, min(self.max_depth - 1, len(context))
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self._walk(context[len(context) - mid:])
            if node is not None and node in self._children:
                best_node, best_length, lo = node, mid, mid + 1
            else:
                hi = mid - 1
        return best_node, best_length

    def _walk(self, token_ids: Sequence[int]) -> int | None:
        node = ROOT
        for token in token_ids:
            children = self._children.get(node)
            node = None if children is None else children.get(token)
            if node is None:
                return None
        return node

    def _new_node(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._counts.append(0)
        return len(self._counts) - 1

    def _delete_child(self, node: int, token: int) -> None:
        """Unlink node's child for token and free the ids of its subtree."""
        children = self._children[node]
        stack = [children.pop(token)]
        if not children:
            del self._children[node]
        while stack:
            node = stack.pop()
            self._counts[node] = 0
            stack.extend(self._children.pop(node, {}).values())
            self._free_ids.append(node)
