"""The compiled suffix trie's C sources and their hash. setup.py compiles the hash into the module (SOURCE_HASH), and
suffix_tree.py compares it with the sources' at import: a module built from other sources (a stale build) is refused
with the fix instead of run. Standard library only: setup.py loads this file by its path, before anything is built."""

import hashlib
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
SOURCES = ("_suffix_tree.c", "_trie_store.h", "_trie_tokens.h", "_trie_ops.h")  # the first is the one compiled


def source_hash(folder: Path = FOLDER) -> str | None:
    """The first 16 hex digits of the sources' sha256; None where they are not all in `folder` (an installed wheel
    ships the module without them)."""
    paths = [folder / name for name in SOURCES]
    if not all(path.is_file() for path in paths):
        return None
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
