"""Randomised operation sequences on the compiled suffix trie, checked against the brute-force reference
(trie_reference.py) after every operation, and hostile inputs: tokens whose __index__ empties the list being read or
calls back into the trie, tokens that are not ints or do not fit in 32 bits, empty sequences, inputs of every kind
(tuples, generators, list subclasses), weights and counts past the trie's limits, and a failed allocation at each
allocation an update makes. An update that fails must leave the trie exactly as it was.

tests/test_suffix_tree.py runs it on the normal build (the default stage). .ci/sanitize_trie.sh runs it as a script on a
build with AddressSanitizer and UndefinedBehaviorSanitizer, where reading freed memory or any undefined behaviour
aborts the run:

    python tests/trie_fuzz.py EXTENSION_FILE [--seeds 6] [--ops 1000]

Standard library only (it runs without torch): the script loads the extension from its file.
"""

import argparse
import importlib
import importlib.util
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trie_reference import MAX_WEIGHT, ReferenceTrie, brute_force_match  # noqa: E402

VOCAB = 4  # few distinct tokens: substrings repeat, so counts above 1, shared nodes, removals that keep nodes
MAX_SEQS = 8
BAD_TOKENS = [("a", TypeError), (1.5, TypeError), (None, TypeError), (object(), TypeError), (2 ** 31, OverflowError),
              (-2 ** 31 - 1, OverflowError), (2 ** 80, OverflowError)]
HUGE_WEIGHTS = (2 ** 61, MAX_WEIGHT, MAX_WEIGHT + 1, 2 ** 63 - 1)  # a few tokens of them reach the count limit


class Shrinking:
    """A token whose conversion empties the list it is in (a read of the list's old item array after it is a
    use-after-free)."""

    def __init__(self, value: int, victim: list):
        self.value, self.victim = value, victim

    def __index__(self) -> int:
        self.victim.clear()
        return self.value


class Reentrant:
    """A token whose conversion first calls back into the trie (`action`)."""

    def __init__(self, value: int, action):
        self.value, self.action = value, action

    def __index__(self) -> int:
        self.action()
        return self.value


class IntList(list):
    pass


def as_input(rng: random.Random, tokens: list[int]):
    """The same tokens as a list, a tuple, a generator, a list subclass, or a list that one token's conversion
    empties."""
    kind = rng.randrange(5)
    if kind == 4 and tokens:
        hostile = list(tokens)
        i = rng.randrange(len(hostile))
        hostile[i] = Shrinking(tokens[i], hostile)
        return hostile
    return [list(tokens), tuple(tokens), (t for t in tokens), IntList(tokens), list(tokens)][kind]


def with_bad_token(rng: random.Random, tokens: list[int]):
    """tokens with a bad token at a random position: (the list, the error it must raise)."""
    bad, error = rng.choice(BAD_TOKENS)
    bad_tokens = list(tokens)
    bad_tokens.insert(rng.randrange(len(tokens) + 1), bad)
    return bad_tokens, error


def snapshot(trie) -> tuple:
    return trie.substring_counts(), trie.num_seqs, trie.num_tokens, trie.num_nodes


def check_equal(trie, ref: ReferenceTrie, rng: random.Random, num_matches: int = 3) -> None:
    """Everything the trie answers equals the reference's: counts, sizes, sequences, matches."""
    counts = ref.substring_counts()
    assert trie.substring_counts() == counts
    assert (trie.num_seqs, trie.num_tokens, trie.num_nodes) == (ref.num_seqs, ref.num_tokens, len(counts))
    for seq_id, (tokens, _) in ref.seqs.items():
        assert trie.sequence(seq_id) == tokens
    for _ in range(num_matches):
        context = [rng.randrange(VOCAB) for _ in range(rng.randrange(ref.max_depth + 2))]
        k, min_prob = rng.randrange(8), rng.choice([0.0, 0.3, 0.6])
        assert trie.match(context, k, min_prob) == brute_force_match(counts, context, ref.max_depth, k, min_prob)
        assert trie.count(context[:3]) == counts.get(tuple(context[:3]), 0)
    if ref.seqs:
        seq_id = rng.choice(sorted(ref.seqs))
        assert trie.match_sequence(seq_id, 6, 0.2) == brute_force_match(counts, ref.seqs[seq_id][0], ref.max_depth, 6,
                                                                        0.2)


def expect_unchanged(trie, call, error) -> None:
    """call(trie) raises error and leaves the trie as it was."""
    before = snapshot(trie)
    try:
        call(trie)
    except error:
        assert snapshot(trie) == before
        return
    raise AssertionError(f"expected {error.__name__}")


class Fuzzer:
    """Random operations on a trie and its reference; every operation is checked."""

    def __init__(self, module, seed: int):
        self.rng = random.Random(seed)
        self.max_depth = self.rng.randrange(2, 7)
        self.trie, self.ref = module.SuffixTree(self.max_depth), ReferenceTrie(self.max_depth)
        self.next_id = 0

    def tokens(self, max_len: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(max_len + 1))]

    def update(self, call, ref_call) -> None:
        """call(trie) returns what ref_call(ref) does, or both raise ValueError (a weight or a count past its limit)
        and neither changes."""
        try:
            expected = ref_call(self.ref)
        except ValueError:
            expect_unchanged(self.trie, call, ValueError)
            return
        assert call(self.trie) == expected

    def step(self) -> None:
        ids = sorted(self.ref.seqs)
        if not ids or (len(ids) < MAX_SEQS and self.rng.random() < 0.3):
            self.add()
        elif self.rng.random() < 0.15 or len(ids) == MAX_SEQS:
            seq_id = self.rng.choice(ids)
            self.trie.remove(seq_id)
            self.ref.remove(seq_id)
        else:
            self.extend(self.rng.choice(ids))
        check_equal(self.trie, self.ref, self.rng)

    def add(self) -> None:
        tokens = self.tokens(12)
        weight = self.rng.choice(HUGE_WEIGHTS) if self.rng.random() < 0.05 else self.rng.randrange(1, 4)
        if self.rng.random() < 0.2 and weight <= MAX_WEIGHT:  # a larger weight is refused before the tokens are read
            bad, error = with_bad_token(self.rng, tokens)
            expect_unchanged(self.trie, lambda trie: trie.add(self.next_id, bad, weight=weight), error)
            assert self.next_id not in self.trie
        self.update(lambda trie: trie.add(self.next_id, as_input(self.rng, tokens), weight=weight),
                    lambda ref: ref.add(self.next_id, tokens, weight))
        self.next_id += 1

    def extend(self, seq_id: int) -> None:
        tokens = self.tokens(6)
        if self.rng.random() < 0.2:
            bad, error = with_bad_token(self.rng, tokens)
            expect_unchanged(self.trie, lambda trie: trie.extend(seq_id, bad), error)
        if self.rng.random() < 0.5:
            self.update(lambda trie: trie.extend(seq_id, as_input(self.rng, tokens)),
                        lambda ref: ref.extend(seq_id, tokens))
            return
        current = self.ref.sequence(seq_id)
        whole = current + tokens
        if self.rng.random() < 0.4 and current:  # fewer tokens, or one changed (inside or before the checked tail)
            i = self.rng.randrange(len(current))
            whole = current[:i] if self.rng.random() < 0.3 else whole[:i] + [whole[i] + 1] + whole[i + 1:]
        self.update(lambda trie: trie.extend_to(seq_id, as_input(self.rng, whole)),
                    lambda ref: ref.extend_to(seq_id, whole))


def run_operations(module, seed: int, num_ops: int) -> None:
    fuzzer = Fuzzer(module, seed)
    for _ in range(num_ops):
        fuzzer.step()


# --- hostile inputs, case by case ---

def shrinking_tokens(module) -> None:
    """A token whose __index__ empties the list the trie is converting, in every method that converts tokens."""
    def shrinking(tokens, i):
        hostile = list(tokens)
        hostile[i] = Shrinking(tokens[i], hostile)
        return hostile

    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3] * 3
    trie, ref = module.SuffixTree(4), ReferenceTrie(4)
    for i in (0, 5, len(tokens) - 1):
        trie.add(i, shrinking(tokens, i))
        ref.add(i, tokens)
        trie.extend(i, shrinking(tokens, i))
        ref.extend(i, tokens)
        assert trie.extend_to(i, shrinking(ref.sequence(i) + tokens, i)) and ref.extend_to(i, ref.sequence(i) + tokens)
        assert trie.match(shrinking(tokens, i), 5, 0.1) == ref.match(tokens, 5, 0.1)
        assert trie.count(shrinking(tokens[:3], 1)) == ref.count(tokens[:3])
    check_equal(trie, ref, random.Random(0))


def reentrant_tokens(module) -> None:
    """A token whose __index__ calls into the trie: it removes the sequence being extended (KeyError), extends it
    during extend_to (RuntimeError), or matches during a match; the trie stays consistent."""
    trie, ref = module.SuffixTree(3), ReferenceTrie(3)
    for seq_id in (0, 1):
        trie.add(seq_id, [1, 2, 3])
        ref.add(seq_id, [1, 2, 3])
    try:
        trie.extend(0, [1, Reentrant(2, lambda: trie.remove(0)), 3])
        raise AssertionError("extend of a sequence removed during its conversion must raise KeyError")
    except KeyError:
        ref.remove(0)
    try:
        trie.extend_to(1, [1, 2, 3, Reentrant(4, lambda: trie.extend(1, [9]))])
        raise AssertionError("extend_to whose conversion changed the trie must raise RuntimeError")
    except RuntimeError:
        ref.extend(1, [9])
    assert trie.match([1, Reentrant(2, lambda: trie.match([1, 2], 3, 0.0))], 3, 0.0) == ref.match([1, 2], 3, 0.0)
    check_equal(trie, ref, random.Random(0))


def failed_updates_change_nothing(module) -> None:
    """A bad token anywhere in an add, extend or extend_to raises, and the trie, its matches included, is as it was."""
    trie = module.SuffixTree(4)
    trie.add(0, [1, 2, 3, 1, 2, 4])
    matches = [trie.match([1, 2], 4, 0.0), trie.match_sequence(0, 4, 0.0)]
    for bad, error in BAD_TOKENS:
        for i in range(4):
            expect_unchanged(trie, lambda t: t.extend(0, [1, 2, 3][:i] + [bad] + [2]), error)
            expect_unchanged(trie, lambda t: t.extend_to(0, [1, 2, 3, 1, 2, 4] + [3] * i + [bad]), error)
            expect_unchanged(trie, lambda t: t.add(1, [1, 2][:i] + [bad]), error)
    assert [trie.match([1, 2], 4, 0.0), trie.match_sequence(0, 4, 0.0)] == matches and 1 not in trie


def edge_values(module) -> None:
    """int32's extremes are tokens; empty sequences; seq ids are ints (anything with __index__ is one)."""
    trie, ref = module.SuffixTree(3), ReferenceTrie(3)
    extremes = [2 ** 31 - 1, -2 ** 31, 0, 2 ** 31 - 1, -2 ** 31]
    trie.add(0, extremes)
    ref.add(0, extremes)
    trie.add(1, [])
    ref.add(1, [])
    trie.extend(1, ())
    assert trie.extend_to(1, []) and trie.count([]) == 5 and trie.match([], 3, 0.0) == ([], [], 0)
    assert trie.match([2 ** 31 - 1], 3, 0.0) == ref.match([2 ** 31 - 1], 3, 0.0)
    trie.add(Reentrant(7, lambda: None), [5])  # a seq id with __index__ is the int it returns
    ref.add(7, [5])
    assert True in trie and 7 in trie  # True is the int 1
    for bad_id in ("7", 7.0, None):
        expect_unchanged(trie, lambda t: t.add(bad_id, [1]), TypeError)
    check_equal(trie, ref, random.Random(0))


def allocation_failures_change_nothing(module) -> int:
    """Every allocation of an add, an extend and an extend_to, made to fail in turn (CPython's _testcapi.set_nomemory):
    the update raises MemoryError and the trie is as it was, or it completes (no allocation was left to fail: the next
    update). Only the call runs while a failure is armed, so what fails is the trie's allocations and the interpreter's
    in calling it; its inputs are built before (CPython 3.11 leaks a reference where a list display's allocation
    fails, which the sanitizer stage's leak check reports).

    Returns the failures injected: the allocations, as set_nomemory numbers them, whose failure raised MemoryError.
    It numbers every call into an allocator, and under pymalloc a block over 512 bytes is two calls that fail alike
    (PyMem's, then the raw malloc pymalloc hands the block to), so the number is of distinct allocations only under
    PYTHONMALLOC=malloc, as in the sanitizer stage. AssertionError where an update had none injected (no _testcapi, or
    hooks that never fired): the check would pass having tested nothing."""
    try:
        import _testcapi
    except ImportError:
        raise AssertionError("allocation failures: none can be injected without CPython's _testcapi (set_nomemory), "
                             "which this Python build lacks") from None
    tokens = list(range(10, 1500))  # enough nodes for the node array and the edge table to grow
    whole = [1, 2, 3] + tokens
    updates = {"extend": lambda trie: trie.extend(0, tokens), "extend_to": lambda trie: trie.extend_to(0, whole),
               "add": lambda trie: trie.add(1, tokens, weight=2)}
    num_failures = 0
    for name, update in updates.items():
        failures = inject_failures(module, _testcapi, update)
        assert failures, f"allocation failures: none injected into {name} (set_nomemory's hooks never fired)"
        num_failures += failures
    return num_failures


def inject_failures(module, _testcapi, update) -> int:
    """update(trie) with its allocation number `failing` failing, for failing = 0, 1, ... until it completes: the
    failures that raised MemoryError, each checked to leave the trie as it was."""
    for failing in range(10_000):
        trie = module.SuffixTree(3)
        trie.add(0, [1, 2, 3])
        before = snapshot(trie)
        _testcapi.set_nomemory(failing, failing + 1)
        try:
            update(trie)
        except MemoryError:
            _testcapi.remove_mem_hooks()
            assert snapshot(trie) == before
            continue
        _testcapi.remove_mem_hooks()
        return failing
    raise AssertionError("allocation failures: an update still failed at its 10,000th allocation")


HOSTILE_CASES = (shrinking_tokens, reentrant_tokens, failed_updates_change_nothing, edge_values,
                 allocation_failures_change_nothing)


def load(path: str):
    spec = importlib.util.spec_from_file_location("_suffix_tree", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extension", help="the compiled spec/proposers/_suffix_tree*.so to test")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--ops", type=int, default=1000, help="operations per seed")
    args = parser.parse_args(argv)
    module, start = load(args.extension), time.monotonic()
    for case in HOSTILE_CASES:
        num_failures = case(module)  # None but from allocation_failures_change_nothing, which ran on _testcapi
        if num_failures is None:
            print(f"{case.__name__}: passed", flush=True)
            continue
        allocator = importlib.import_module("_testcapi").pymem_getallocatorsname()
        print(f"{case.__name__}: passed, {num_failures} allocation failures injected (allocator: {allocator})",
              flush=True)
    for seed in range(args.seeds):
        run_operations(module, seed, args.ops)
    print(f"trie fuzz: {len(HOSTILE_CASES)} hostile cases and {args.seeds} x {args.ops} random operations passed "
          f"in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
