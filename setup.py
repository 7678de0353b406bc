"""The one compiled module, the suffix trie the history and suffix drafters match against (spec/proposers/
suffix_tree.py); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("spec.proposers._suffix_tree", ["spec/proposers/_suffix_tree.c"],
                             depends=["spec/proposers/_trie_store.h"], extra_compile_args=["-O2", "-std=c11"])])
