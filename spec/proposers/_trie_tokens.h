/* Token ids from Python into C buffers, for the suffix trie (spec/proposers/_suffix_tree.c), which converts every
 * input before it touches the trie: a conversion may run Python code (a token's __index__), and that code may do
 * anything, the trie's own methods included.
 *
 * Exact ints in a list or tuple are read in place: converting them runs no Python code, so nothing can change the
 * sequence while it is read. Anything else (an int subclass, an object with __index__, a generator, a numpy array)
 * is converted from a tuple snapshot, which holds a reference to each item: whatever a conversion runs, it cannot
 * free or change what is read.
 */
#ifndef SPEC_TRIE_TOKENS_H
#define SPEC_TRIE_TOKENS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    int32_t *ids;  /* token_ids[first:], a PyMem buffer */
    Py_ssize_t first, total;  /* total: len(token_ids) */
} Tokens;

static inline Py_ssize_t tokens_len(const Tokens *tokens) { return tokens->total - tokens->first; }

static void tokens_free(Tokens *tokens) {
    PyMem_Free(tokens->ids);
    tokens->ids = NULL;
}

static int as_token(PyObject *item, int32_t *out) {
    long value = PyLong_AsLong(item);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < INT32_MIN || value > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "token id %ld does not fit in 32 bits", value);
        return -1;
    }
    *out = (int32_t)value;
    return 0;
}

/* items[first:] of a list or tuple into out, first = max(lo, n - max_tail) (at most n): 0, -1 with an error set,
 * or 1 where exact_only is set and an item is not an exact int (nothing converted; out unset). */
static int convert_items(PyObject *fast, Py_ssize_t lo, Py_ssize_t max_tail, int exact_only, Tokens *out) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), first = n - max_tail > lo ? n - max_tail : lo;
    if (first > n) first = n;
    int32_t *ids = PyMem_Malloc((size_t)(n - first > 0 ? n - first : 1) * sizeof(int32_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);  /* read only while no Python code runs, or from a tuple */
    for (Py_ssize_t i = first; i < n; i++) {
        int failed = exact_only && !PyLong_CheckExact(items[i]) ? 1 : as_token(items[i], &ids[i - first]) < 0 ? -1 : 0;
        if (failed) {
            PyMem_Free(ids);
            return failed;
        }
    }
    *out = (Tokens){ids, first, n};
    return 0;
}

/* token_ids[first:] into *out, first = max(lo, len(token_ids) - max_tail): 0, or -1 with an error set (TypeError for
 * an item that is not an int, OverflowError for one outside int32). Free out with tokens_free. */
static int tokens_convert(PyObject *token_ids, Py_ssize_t lo, Py_ssize_t max_tail, Tokens *out) {
    PyObject *items = PySequence_Fast(token_ids, "token_ids must be a sequence of ints");
    if (items == NULL) return -1;
    int result = convert_items(items, lo, max_tail, 1, out);
    if (result == 1) {
        PyObject *snapshot = PySequence_Tuple(items);
        Py_SETREF(items, snapshot);
        result = items == NULL ? -1 : convert_items(items, lo, max_tail, 0, out);
    }
    Py_XDECREF(items);
    return result;
}

#endif
