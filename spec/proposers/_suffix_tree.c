/* The count-annotated, depth-capped suffix trie of spec/proposers/suffix_tree.py (the contract), in C: drafting
 * extends every running request's sequence every step, max_depth node updates a token. Nodes and edges: a Store
 * (_trie_store.h); a sequence: a PyCapsule in a dict keyed by its id, an exact int (tokens, weight, suffix nodes);
 * the algorithms on them: _trie_ops.h. This file is their Python binding.
 *
 * Every method first converts its Python inputs into C (_trie_tokens.h; a token's __index__ may run any Python code,
 * this trie's methods included), then updates the trie without running Python code, then builds its Python result.
 * Updates are atomic: an update checks its counts' limit and reserves its memory before it changes anything (appends:
 * a token at a time, undone on failure), so on an error (a bad token, a count past its limit, MemoryError) the trie is
 * as it was. A lookup that finds a broken invariant raises RuntimeError and marks the trie corrupt: every later call
 * raises too.
 */
#include "_trie_ops.h"
#include "_trie_tokens.h"

#ifndef SOURCE_HASH
#define SOURCE_HASH ""  /* built without setup.py: suffix_tree.py refuses it as stale */
#endif

static const char *SEQ_CAPSULE = "spec.proposers._suffix_tree.Seq";

/* --- arguments --- */

static int check_usable(Trie *t) {
    if (!t->is_corrupt) return 0;
    PyErr_SetString(PyExc_RuntimeError, "suffix trie: corrupt since an earlier broken invariant; build a new one");
    return -1;
}

/* A seq id as an exact int (new reference): dict lookups by it then run no Python code. */
static PyObject *seq_key(Trie *t, PyObject *seq_id) {
    return check_usable(t) < 0 ? NULL : PyNumber_Index(seq_id);
}

static Seq *get_seq(Trie *t, PyObject *key) {
    PyObject *capsule = PyDict_GetItemWithError(t->seqs, key);
    if (capsule == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return capsule == NULL ? NULL : PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
}

static void free_seq(PyObject *capsule) {
    Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
    PyMem_Free(seq->tokens);
    PyMem_Free(seq->active);
    PyMem_Free(seq);
}

static PyObject *new_seq_capsule(Trie *t, int64_t weight, Py_ssize_t cap) {
    Seq *seq = PyMem_Calloc(1, sizeof(Seq));
    if (seq == NULL) return PyErr_NoMemory();
    seq->weight = weight;
    seq->cap = cap > 16 ? cap : 16;
    seq->tokens = PyMem_Malloc((size_t)seq->cap * sizeof(int32_t));
    seq->active = PyMem_Malloc((size_t)t->max_depth * sizeof(int32_t));
    PyObject *capsule = seq->tokens && seq->active ? PyCapsule_New(seq, SEQ_CAPSULE, free_seq) : NULL;
    if (capsule == NULL) {
        PyMem_Free(seq->tokens);
        PyMem_Free(seq->active);
        PyMem_Free(seq);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    seq->active[0] = ROOT;
    seq->num_active = 1;
    return capsule;
}

/* A weight's own bound, so that add() refuses an absurd weight where it is given: what keeps the counts within int64_t
 * is the count limit of appends (check_count_limit), which a few tokens of weights this large reach. */
#define MAX_WEIGHT ((int64_t)1 << 62)

static int parse_weight(PyObject *weight_obj, int64_t *weight) {
    long long value = weight_obj == NULL ? 1 : PyLong_CheckExact(weight_obj) ? PyLong_AsLongLong(weight_obj) : -1;
    if (value == -1 && PyErr_Occurred()) PyErr_Clear();
    if (value < 1 || value > MAX_WEIGHT) {
        PyErr_Format(PyExc_ValueError, "weight=%R: a sequence counts as an integer number of sequences, at least 1 "
                     "and at most 2**62", weight_obj);
        return -1;
    }
    *weight = value;
    return 0;
}

/* --- results --- */

/* (drafts, probs, match_length) as Python lists; frees drafts. */
static PyObject *match_result(Draft *drafts, Py_ssize_t num_drafts, int match_length) {
    PyObject *tokens = PyList_New(num_drafts), *probs = PyList_New(num_drafts);
    for (Py_ssize_t i = 0; tokens != NULL && probs != NULL && i < num_drafts; i++) {
        PyObject *token = PyLong_FromLong(drafts[i].token), *prob = PyFloat_FromDouble(drafts[i].prob);
        PyList_SET_ITEM(tokens, i, token);
        PyList_SET_ITEM(probs, i, prob);
        if (token == NULL || prob == NULL) Py_CLEAR(tokens);
    }
    PyMem_Free(drafts);
    if (tokens == NULL || probs == NULL) {
        Py_XDECREF(tokens);
        Py_XDECREF(probs);
        return NULL;
    }
    return Py_BuildValue("(NNi)", tokens, probs, match_length);
}

static PyObject *int_list(const int32_t *values, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *value = PyLong_FromLong(values[i]);
        if (value == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* --- methods --- */

static PyObject *Trie_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_depth", NULL};
    int max_depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &max_depth)) return NULL;
    if (max_depth < 2)
        return PyErr_Format(PyExc_ValueError,
                            "max_depth=%d must be >= 2: matching needs a context token and a continuation", max_depth);
    Trie *t = (Trie *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->max_depth = max_depth;
    t->path = PyMem_Malloc((size_t)max_depth * sizeof(int32_t));
    t->seqs = PyDict_New();
    if (store_init(&t->s) < 0 || t->path == NULL || t->seqs == NULL) {
        Py_DECREF(t);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void Trie_dealloc(Trie *t) {
    store_free(&t->s);
    PyMem_Free(t->path);
    Py_XDECREF(t->seqs);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* add: the tokens converted, the sequence registered, then appended (or unregistered again where that fails). */
static PyObject *add_seq(Trie *t, PyObject *key, int64_t weight, const Tokens *tokens) {
    int present = PyDict_Contains(t->seqs, key);
    if (present)
        return present < 0 ? NULL : PyErr_Format(PyExc_ValueError, "sequence %R is already in the trie; use "
                                                                   "extend() to append to it", key);
    PyObject *capsule = new_seq_capsule(t, weight, tokens_len(tokens));
    if (capsule == NULL || PyDict_SetItem(t->seqs, key, capsule) < 0) {
        Py_XDECREF(capsule);
        return NULL;
    }
    Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
    Py_DECREF(capsule);  /* the dict holds it */
    t->version++;
    if (append_tokens(t, seq, tokens->ids, tokens_len(tokens)) < 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (PyDict_DelItem(t->seqs, key) < 0) PyErr_Clear();  /* an exact int key that is there: cannot fail */
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Trie_add(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seq_id", "token_ids", "weight", NULL};
    PyObject *seq_id, *token_ids = NULL, *weight_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO", kwlist, &seq_id, &token_ids, &weight_obj)) return NULL;
    int64_t weight;
    if (parse_weight(weight_obj, &weight) < 0) return NULL;
    PyObject *key = seq_key(t, seq_id), *result = NULL;
    Tokens tokens = {NULL, 0, 0};
    if (key != NULL && (token_ids == NULL || tokens_convert(token_ids, 0, PY_SSIZE_T_MAX, &tokens) == 0))
        result = add_seq(t, key, weight, &tokens);
    tokens_free(&tokens);
    Py_XDECREF(key);
    return result;
}

static PyObject *Trie_extend(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seq_id", "token_ids", NULL};
    PyObject *seq_id, *token_ids;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &seq_id, &token_ids)) return NULL;
    PyObject *key = seq_key(t, seq_id);
    Tokens tokens;
    if (key == NULL || tokens_convert(token_ids, 0, PY_SSIZE_T_MAX, &tokens) < 0) {
        Py_XDECREF(key);
        return NULL;
    }
    Seq *seq = get_seq(t, key);  /* after the conversion, which may have run Python code */
    int failed = seq == NULL || append_tokens(t, seq, tokens.ids, tokens_len(&tokens)) < 0;
    tokens_free(&tokens);
    Py_DECREF(key);
    return failed ? NULL : Py_NewRef(Py_None);
}

/* extend_to once token_ids[first:] is converted: 1 (appended), 0 (not a continuation) or -1 (an error). */
static int extend_seq_to(Trie *t, Seq *seq, const Tokens *tokens) {
    if (tokens->total < seq->len) return 0;
    for (Py_ssize_t i = tokens->first; i < seq->len; i++)
        if (tokens->ids[i - tokens->first] != seq->tokens[i]) return 0;
    Py_ssize_t num_new = tokens->total - seq->len;
    return append_tokens(t, seq, tokens->ids + (seq->len - tokens->first), num_new) < 0 ? -1 : 1;
}

static PyObject *Trie_extend_to(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seq_id", "token_ids", NULL};
    PyObject *seq_id, *token_ids;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &seq_id, &token_ids)) return NULL;
    PyObject *key = seq_key(t, seq_id);
    Seq *seq = key == NULL ? NULL : get_seq(t, key);
    Py_XDECREF(key);  /* seq stays valid while the version stands */
    if (seq == NULL) return NULL;
    uint64_t version = t->version;
    Tokens tokens;
    if (tokens_convert(token_ids, seq->len > t->max_depth ? seq->len - t->max_depth : 0, PY_SSIZE_T_MAX, &tokens) < 0)
        return NULL;
    int result = t->version == version ? extend_seq_to(t, seq, &tokens) : -2;
    tokens_free(&tokens);
    if (result == -2)
        PyErr_SetString(PyExc_RuntimeError, "extend_to: the trie changed while token_ids were converted (a token's "
                                             "__index__ called into it); pass ints");
    return result < 0 ? NULL : PyBool_FromLong(result);
}

static PyObject *Trie_remove(Trie *t, PyObject *seq_id) {
    PyObject *key = seq_key(t, seq_id);
    Seq *seq = key == NULL ? NULL : get_seq(t, key);
    int failed = seq == NULL || remove_seq(t, seq) < 0 || PyDict_DelItem(t->seqs, key) < 0;
    Py_XDECREF(key);
    return failed ? NULL : Py_NewRef(Py_None);
}

static PyObject *Trie_sequence(Trie *t, PyObject *seq_id) {
    PyObject *key = seq_key(t, seq_id);
    Seq *seq = key == NULL ? NULL : get_seq(t, key);
    Py_XDECREF(key);
    if (seq == NULL) return NULL;
    Py_ssize_t n = seq->len;
    int32_t *copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));  /* int_list runs allocations, which may */
    if (copy == NULL) return PyErr_NoMemory();                              /* collect garbage: copy the tokens out */
    memcpy(copy, seq->tokens, (size_t)n * sizeof(int32_t));
    PyObject *list = int_list(copy, n);
    PyMem_Free(copy);
    return list;
}

static PyObject *Trie_count(Trie *t, PyObject *token_ids) {
    Tokens tokens;
    if (check_usable(t) < 0 || tokens_convert(token_ids, 0, (Py_ssize_t)t->max_depth + 1, &tokens) < 0) return NULL;
    int32_t node = tokens.total > t->max_depth ? NONE : walk(&t->s, tokens.ids, tokens.total);
    tokens_free(&tokens);
    return PyLong_FromLongLong(node == NONE ? 0 : t->s.nodes[node].count);
}

static PyObject *Trie_match(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"context", "max_tokens", "min_token_prob", NULL};
    PyObject *context;
    Py_ssize_t max_tokens;
    double min_token_prob;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ond", kwlist, &context, &max_tokens, &min_token_prob))
        return NULL;
    Tokens tokens;
    if (check_usable(t) < 0 || tokens_convert(context, 0, t->max_depth - 1, &tokens) < 0) return NULL;
    Py_ssize_t length;
    int32_t node = longest_match(t, tokens.ids, tokens_len(&tokens), &length);
    memcpy(t->path, tokens.ids + tokens_len(&tokens) - length, (size_t)length * sizeof(int32_t));
    tokens_free(&tokens);
    Draft *drafts;
    Py_ssize_t num_drafts = speculate(t, node, (int)length, max_tokens, min_token_prob, &drafts);
    return num_drafts < 0 ? NULL : match_result(drafts, num_drafts, (int)length);
}

static PyObject *Trie_match_sequence(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seq_id", "max_tokens", "min_token_prob", NULL};
    PyObject *seq_id;
    Py_ssize_t max_tokens;
    double min_token_prob;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ond", kwlist, &seq_id, &max_tokens, &min_token_prob))
        return NULL;
    PyObject *key = seq_key(t, seq_id);
    Seq *seq = key == NULL ? NULL : get_seq(t, key);
    Py_XDECREF(key);
    if (seq == NULL) return NULL;
    int length = seq->num_active - 1;
    while (length && t->s.nodes[seq->active[length]].first_child == NONE) length--;
    if (length) memcpy(t->path, seq->tokens + seq->len - length, (size_t)length * sizeof(int32_t));
    Draft *drafts;
    Py_ssize_t num_drafts = speculate(t, length ? seq->active[length] : NONE, length, max_tokens, min_token_prob,
                                      &drafts);
    return num_drafts < 0 ? NULL : match_result(drafts, num_drafts, length);
}

static PyObject *Trie_substring_counts(Trie *t, PyObject *unused) {
    Substring *entries;
    Py_ssize_t num_entries = check_usable(t) < 0 ? -1 : preorder(t, &entries);
    if (num_entries < 0) return NULL;
    int32_t *path = PyMem_Malloc((size_t)t->max_depth * sizeof(int32_t));  /* preorder: a node's path is its parent's */
    PyObject *counts = path == NULL ? PyErr_NoMemory() : PyDict_New();      /* with its own token at its depth */
    for (Py_ssize_t i = 0; counts != NULL && i < num_entries; i++) {
        if (entries[i].depth) path[entries[i].depth - 1] = entries[i].token;
        PyObject *list = int_list(path, entries[i].depth), *substring = list ? PyList_AsTuple(list) : NULL;
        PyObject *count = PyLong_FromLongLong(entries[i].count);
        if (substring == NULL || count == NULL || PyDict_SetItem(counts, substring, count) < 0) Py_CLEAR(counts);
        Py_XDECREF(list);
        Py_XDECREF(substring);
        Py_XDECREF(count);
    }
    PyMem_Free(path);
    PyMem_Free(entries);
    return counts;
}

static PyObject *Trie_nbytes(Trie *t, PyObject *unused) {
    size_t total = store_nbytes(&t->s) + (size_t)t->max_depth * sizeof(int32_t);
    Py_ssize_t pos = 0;
    PyObject *key, *capsule;
    while (PyDict_Next(t->seqs, &pos, &key, &capsule)) {
        Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
        total += sizeof(Seq) + ((size_t)seq->cap + t->max_depth) * sizeof(int32_t);
    }
    return PyLong_FromSize_t(total);
}

static int Trie_contains(Trie *t, PyObject *seq_id) {
    PyObject *key = seq_key(t, seq_id);
    int present = key == NULL ? -1 : PyDict_Contains(t->seqs, key);
    Py_XDECREF(key);
    return present;
}

static PyObject *Trie_get_max_depth(Trie *t, void *closure) { return PyLong_FromLong(t->max_depth); }
static PyObject *Trie_get_num_seqs(Trie *t, void *closure) { return PyLong_FromSsize_t(PyDict_Size(t->seqs)); }
static PyObject *Trie_get_num_tokens(Trie *t, void *closure) { return PyLong_FromLongLong(t->s.nodes[ROOT].count); }
static PyObject *Trie_get_num_nodes(Trie *t, void *closure) {
    return PyLong_FromLong(t->s.num_allocated - t->s.num_free);
}

static PyMethodDef Trie_methods[] = {  /* the contract of each: spec/proposers/suffix_tree.py */
    {"add", (PyCFunction)(void (*)(void))Trie_add, METH_VARARGS | METH_KEYWORDS, "add(seq_id, token_ids=(), weight=1)"},
    {"extend", (PyCFunction)(void (*)(void))Trie_extend, METH_VARARGS | METH_KEYWORDS, "extend(seq_id, token_ids)"},
    {"extend_to", (PyCFunction)(void (*)(void))Trie_extend_to, METH_VARARGS | METH_KEYWORDS,
     "extend_to(seq_id, token_ids) -> bool"},
    {"remove", (PyCFunction)Trie_remove, METH_O, "remove(seq_id)"},
    {"sequence", (PyCFunction)Trie_sequence, METH_O, "sequence(seq_id) -> a new list of its tokens"},
    {"count", (PyCFunction)Trie_count, METH_O, "count(token_ids) -> occurrences"},
    {"match", (PyCFunction)(void (*)(void))Trie_match, METH_VARARGS | METH_KEYWORDS,
     "match(context, max_tokens, min_token_prob) -> (drafts, probs, match_length)"},
    {"match_sequence", (PyCFunction)(void (*)(void))Trie_match_sequence, METH_VARARGS | METH_KEYWORDS,
     "match_sequence(seq_id, max_tokens, min_token_prob) -> (drafts, probs, match_length)"},
    {"substring_counts", (PyCFunction)Trie_substring_counts, METH_NOARGS, "{substring: count}, the root as ()"},
    {"nbytes", (PyCFunction)Trie_nbytes, METH_NOARGS, "bytes the trie's C buffers hold (nodes, edges, sequences)"},
    {NULL}};

static PyGetSetDef Trie_getset[] = {
    {"max_depth", (getter)Trie_get_max_depth, NULL, "the longest substring counted", NULL},
    {"num_seqs", (getter)Trie_get_num_seqs, NULL, "sequences in the trie", NULL},
    {"num_tokens", (getter)Trie_get_num_tokens, NULL, "tokens inserted, each counted by its sequence's weight", NULL},
    {"num_nodes", (getter)Trie_get_num_nodes, NULL, "nodes in use, the root included", NULL},
    {NULL}};

static PySequenceMethods Trie_as_sequence = {.sq_contains = (objobjproc)Trie_contains};

static PyTypeObject TrieType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spec.proposers._suffix_tree.SuffixTree",
    .tp_doc = "SuffixTree(max_depth): substring counts of a set of sequences, keyed by sequence ids "
              "(spec/proposers/suffix_tree.py).",
    .tp_basicsize = sizeof(Trie),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Trie_new,
    .tp_dealloc = (destructor)Trie_dealloc,
    .tp_methods = Trie_methods,
    .tp_getset = Trie_getset,
    .tp_as_sequence = &Trie_as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_suffix_tree",
                                    "The suffix trie of spec/proposers/suffix_tree.py, in C.", -1, NULL};

PyMODINIT_FUNC PyInit__suffix_tree(void) {
    if (PyType_Ready(&TrieType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", SOURCE_HASH) < 0
        || PyModule_AddObjectRef(m, "SuffixTree", (PyObject *)&TrieType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
