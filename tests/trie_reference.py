"""The suffix trie's contract (spec/proposers/suffix_tree.py) by brute force: the sequences kept as plain lists, every
answer recomputed from their substrings. test_suffix.py and the randomised operation sequences (trie_fuzz.py) check
the compiled trie against it. Standard library only: the sanitizer stage (.ci/sanitize_trie.sh) runs it without
torch."""

MAX_WEIGHT = 2 ** 62  # add()'s weights: 1 to MAX_WEIGHT
COUNT_LIMIT = 2 ** 63 - 1  # INT64_MAX: an update that would take num_tokens (every count's bound) past it is refused


def substring_counts(seqs, max_depth: int) -> dict[tuple, int]:
    """{substring: occurrences} over (tokens, weight) pairs, substrings of 1 .. max_depth tokens, each occurrence
    counted weight times; the root () counts every token."""
    counts = {(): sum(len(tokens) * weight for tokens, weight in seqs)}
    for tokens, weight in seqs:
        for i in range(len(tokens)):
            for end in range(i + 1, min(i + max_depth, len(tokens)) + 1):
                key = tuple(tokens[i:end])
                counts[key] = counts.get(key, 0) + weight
    return counts


def brute_force_match(counts: dict[tuple, int], context, max_depth: int, max_tokens: int, min_token_prob: float):
    """match() from substring counts alone: (drafts, probs, match_length)."""
    children: dict[tuple, dict[int, int]] = {}
    for substring, count in counts.items():
        if substring:
            children.setdefault(substring[:-1], {})[substring[-1]] = count
    context = list(context)
    lengths = [n for n in range(1, min(max_depth - 1, len(context)) + 1) if tuple(context[len(context) - n:]) in children]
    match_length = max(lengths, default=0)
    path, drafts, probs = tuple(context[len(context) - match_length:]) if match_length else (), [], []
    while match_length and len(drafts) < max_tokens and path in children:
        following = children[path]
        token = min(following, key=lambda t: (-following[t], t))
        prob = float(following[token]) / float(sum(following.values()))  # the C's doubles (below 2**53: the exact ints)
        if prob < min_token_prob:
            break
        drafts.append(token)
        probs.append(prob)
        path = (path + (token,))[-(max_depth - 1):] if len(path) + 1 == max_depth else path + (token,)
    return drafts, probs, match_length


class ReferenceTrie:
    """SuffixTree's methods on plain lists."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.seqs: dict[int, tuple[list[int], int]] = {}  # seq_id -> (tokens, weight)

    def add(self, seq_id: int, token_ids=(), weight: int = 1) -> None:
        assert seq_id not in self.seqs
        if not 1 <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight={weight}: at least 1 and at most 2**62")
        token_ids = list(token_ids)
        self.check_count_limit(weight, len(token_ids))
        self.seqs[seq_id] = (token_ids, weight)

    def extend(self, seq_id: int, token_ids) -> None:
        tokens, weight = self.seqs[seq_id]
        token_ids = list(token_ids)
        self.check_count_limit(weight, len(token_ids))
        tokens.extend(token_ids)

    def extend_to(self, seq_id: int, token_ids) -> bool:
        (tokens, weight), token_ids = self.seqs[seq_id], list(token_ids)
        checked = max(0, len(tokens) - self.max_depth)
        if len(token_ids) < len(tokens) or token_ids[checked:len(tokens)] != tokens[checked:]:
            return False
        self.check_count_limit(weight, len(token_ids) - len(tokens))
        tokens.extend(token_ids[len(tokens):])
        return True

    def check_count_limit(self, weight: int, num_new: int) -> None:
        """ValueError, before anything changes, where num_new tokens of this weight would take num_tokens past
        COUNT_LIMIT."""
        if self.num_tokens + weight * num_new > COUNT_LIMIT:
            raise ValueError(f"{num_new} token(s) of weight {weight}: past the count limit INT64_MAX = 2**63 - 1")

    def remove(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    def sequence(self, seq_id: int) -> list[int]:
        return list(self.seqs[seq_id][0])

    def substring_counts(self) -> dict[tuple, int]:
        return substring_counts(self.seqs.values(), self.max_depth)

    def count(self, token_ids) -> int:
        return self.substring_counts().get(tuple(token_ids), 0)

    def match(self, context, max_tokens: int, min_token_prob: float):
        return brute_force_match(self.substring_counts(), context, self.max_depth, max_tokens, min_token_prob)

    def match_sequence(self, seq_id: int, max_tokens: int, min_token_prob: float):
        return self.match(self.seqs[seq_id][0], max_tokens, min_token_prob)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) * weight for tokens, weight in self.seqs.values())

    @property
    def num_nodes(self) -> int:
        return len(self.substring_counts())
