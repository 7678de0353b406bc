"""The compiled suffix trie (spec/proposers/suffix_tree.py) on the build the package imports: hostile inputs, weights
and counts past their limits, a failed allocation at each allocation of an update, and randomised operation sequences
against the brute-force reference (trie_fuzz.py; .ci/sanitize_trie.sh runs the same under AddressSanitizer and UBSan);
and the import's refusal of a missing or stale build."""

import random
import shutil
import sys

import pytest
import trie_fuzz
from trie_reference import ReferenceTrie

from spec.proposers import suffix_tree
from spec.proposers.trie_sources import FOLDER, SOURCES, source_hash


@pytest.fixture(scope="module")
def module():
    return suffix_tree.load_extension()


@pytest.mark.parametrize("case", [trie_fuzz.shrinking_tokens, trie_fuzz.reentrant_tokens,
                                  trie_fuzz.failed_updates_change_nothing, trie_fuzz.edge_values],
                         ids=lambda case: case.__name__)
def test_hostile_inputs(module, case):
    case(module)


def test_weights_and_counts_past_their_limits_are_refused_and_change_nothing(module):
    trie, ref = module.SuffixTree(3), ReferenceTrie(3)
    for seq_id, tokens, weight in [(0, [1, 2, 1], 3), (1, [5], 2 ** 62)]:  # 2**62 + 9 weighted tokens: within
        trie.add(seq_id, tokens, weight=weight)
        ref.add(seq_id, tokens, weight)
    before = trie_fuzz.snapshot(trie), trie.match([1], 4, 0.0), trie.match_sequence(1, 4, 0.0), trie.sequence(1)
    weight_limit, count_limit = r"weight=\d+: .* at most 2\*\*62", r"count limit INT64_MAX = 2\*\*63 - 1"
    refused = [(lambda t: t.add(2, [7], weight=2 ** 63 - 1), weight_limit),
               (lambda t: t.add(2, [7], weight=2 ** 62 + 1), weight_limit),
               (lambda t: t.add(2, [7], weight=2 ** 62), count_limit),  # 2**62 twice
               (lambda t: t.add(2, [7] * 4, weight=2 ** 61), count_limit),  # weight * len past INT64_MAX itself
               (lambda t: t.extend(1, [5]), count_limit),  # the sequence of weight 2**62 extended
               (lambda t: t.extend_to(1, [5, 5]), count_limit)]
    for call, limit in refused:
        with pytest.raises(ValueError, match=limit):
            call(trie)
        assert (trie_fuzz.snapshot(trie), trie.match([1], 4, 0.0), trie.match_sequence(1, 4, 0.0),
                trie.sequence(1)) == before and 2 not in trie
    trie.extend(0, [2, 5])  # still usable, and room again once the heavy sequence goes
    ref.extend(0, [2, 5])
    trie.remove(1)
    ref.remove(1)
    trie.add(2, [7], weight=2 ** 62)
    ref.add(2, [7], 2 ** 62)
    trie_fuzz.check_equal(trie, ref, random.Random(0), num_matches=10)


def test_a_failed_allocation_anywhere_in_an_update_changes_nothing(module):
    pytest.importorskip("_testcapi", reason="CPython's _testcapi (set_nomemory) is not in this Python build")
    # three updates, each growing the node array and the edge table: at least 3 allocations each that can fail
    assert trie_fuzz.allocation_failures_change_nothing(module) >= 9


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_the_reference(module, seed):
    trie_fuzz.run_operations(module, seed, num_ops=400)


# --- the build ---

def test_the_build_is_of_the_sources_at_hand(module):
    assert module.SOURCE_HASH == source_hash() is not None


def test_a_stale_build_is_refused_with_the_fix():
    with pytest.raises(ImportError, match=r"stale.*pip install -e \..*C compiler"):
        suffix_tree.check_build("0123456789abcdef", "fedcba9876543210")
    suffix_tree.check_build("", None)  # no sources shipped (an installed wheel): nothing to compare


def test_a_missing_build_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "spec.proposers._suffix_tree", None)  # the import then fails
    with pytest.raises(ImportError, match=r"cannot be imported.*pip install -e \..*C compiler"):
        suffix_tree.load_extension()


def test_the_source_hash_follows_every_source(tmp_path):
    for name in SOURCES:
        shutil.copy(FOLDER / name, tmp_path / name)
    assert source_hash(tmp_path) == source_hash()
    for name in SOURCES:
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(original + b"\n")
        assert source_hash(tmp_path) != source_hash()
        (tmp_path / name).write_bytes(original)
    (tmp_path / SOURCES[-1]).unlink()
    assert source_hash(tmp_path) is None
