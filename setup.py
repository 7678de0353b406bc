"""The one compiled module, the suffix trie the history and suffix drafters match against (spec/proposers/
suffix_tree.py), with the hash of its sources compiled in (spec/proposers/trie_sources.py); everything else is in
pyproject.toml."""

import runpy
from pathlib import Path

from setuptools import Extension, setup

FOLDER = "spec/proposers"
sources = runpy.run_path(str(Path(__file__).resolve().parent / FOLDER / "trie_sources.py"))
setup(ext_modules=[Extension("spec.proposers._suffix_tree", [f"{FOLDER}/{sources['SOURCES'][0]}"],
                             depends=[f"{FOLDER}/{name}" for name in sources["SOURCES"][1:]],
                             define_macros=[("SOURCE_HASH", f'"{sources["source_hash"]()}"')],
                             extra_compile_args=["-O2", "-std=c11"])])
