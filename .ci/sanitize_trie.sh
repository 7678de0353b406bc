#!/usr/bin/env bash
# The suffix trie (spec/proposers/_suffix_tree.c) under AddressSanitizer and UndefinedBehaviorSanitizer: built with
# -fsanitize=address,undefined into a temporary folder (the installed build is left alone), then tests/trie_fuzz.py
# runs on that build: hostile inputs (a token whose __index__ empties the list being read, or calls back into the
# trie; bad and huge tokens; empty sequences; an allocation failing at each allocation of an update) and randomised
# operation sequences checked against a brute-force reference. PYTHONMALLOC=malloc hands Python's own small blocks to
# malloc too, so that ASan sees every block the trie and the lists it reads use; leak detection is off (CPython leaves
# memory to the OS at exit). Any sanitizer report aborts the run: a non-zero status.
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
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$python" tests/trie_fuzz.py "$extension" --seeds 8 --ops 1500
echo "sanitizer stage: $((SECONDS - start)) s"
