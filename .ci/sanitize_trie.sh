#!/usr/bin/env bash
# The suffix trie (spec/proposers/_suffix_tree.c) under AddressSanitizer and UndefinedBehaviorSanitizer: built with
# -fsanitize=address,undefined into a temporary folder (the installed build is left alone), then tests/trie_fuzz.py
# runs on that build: hostile inputs (a token whose __index__ empties the list being read, or calls back into the
# trie; bad and huge tokens; empty sequences; weights and counts past their limits; an allocation failing at each
# allocation of an update) and randomised operation sequences checked against a brute-force reference.
# PYTHONMALLOC=malloc hands Python's own small blocks to malloc too, so that ASan sees every block the trie and the
# lists it reads use, and each allocation the fault injection fails is one. Leak detection is on: a block nothing
# points to at exit is reported, a buffer the trie did not free or an object it holds a reference too many to (what
# CPython leaves to the OS at exit is still reachable from its globals). Nothing is suppressed. CPython 3.11 leaks a
# reference where a list display's first allocation fails (list.extend of its constant tuple), so the fault injection
# builds its inputs before it arms a failure. A suppression would not do: CPython is built without frame pointers, so
# the leaked tuple's stack ends in its allocator (_PyObject_GC_NewVar), as does that of any object the trie holds a
# reference too many to; only the slow unwinder (fast_unwind_on_malloc=0, ten times the run time) reaches the compiler
# that made it. Any sanitizer report aborts the run: a non-zero status.
#
#   .ci/sanitize_trie.sh [PYTHON]     (default: python; needs gcc's libasan and libubsan)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python}
start=$SECONDS
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
if ! CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
        "$python" setup.py build_ext --build-lib "$build/lib" --build-temp "$build/tmp" > "$build/build.log" 2>&1; then
    cat "$build/build.log"
    exit 1
fi
extension=$(ls "$build"/lib/spec/proposers/_suffix_tree*.so)
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" PYTHONMALLOC=malloc \
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$python" tests/trie_fuzz.py "$extension" --seeds 8 --ops 1500
echo "sanitizer stage: $((SECONDS - start)) s"
