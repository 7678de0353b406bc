"""The compiled suffix trie (spec/proposers/suffix_tree.py) on the build the package imports: hostile inputs, a failed
allocation at each allocation of an update, and randomised operation sequences against the brute-force reference
(trie_fuzz.py; .ci/sanitize_trie.sh runs the same under AddressSanitizer and UBSan); and the import's refusal of a
missing or stale build."""

import shutil
import sys

import pytest
import trie_fuzz

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
