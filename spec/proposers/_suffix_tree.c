/* The count-annotated, depth-capped suffix trie of spec/proposers/suffix_tree.py (the contract), in C: drafting
 * extends every running request's sequence every step, max_depth node updates a token. Nodes and edges: a Store
 * (_trie_store.h); a sequence: a PyCapsule in a dict keyed by its id (tokens, weight, suffix nodes). */
#include "_trie_store.h"

typedef struct {
    int32_t *tokens;
    Py_ssize_t len, cap;
    int64_t weight;
    int32_t *active;  /* active[i]: the node of the sequence's suffix of length i; active[0] = ROOT */
    int num_active;
} Seq;

typedef struct {
    PyObject_HEAD
    int max_depth;
    Store s;
    int32_t *path;  /* scratch for matching: max_depth tokens */
    PyObject *seqs;  /* seq id -> capsule(Seq) */
} Trie;

static const char *SEQ_CAPSULE = "spec.proposers._suffix_tree.Seq";

/* --- conversions --- */

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

/* The last min(len(seq), limit) tokens of a Python sequence into buf; their number, or -1. */
static Py_ssize_t tail_tokens(PyObject *seq, Py_ssize_t limit, int32_t *buf) {
    PyObject *fast = PySequence_Fast(seq, "token ids must be a sequence of ints");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), m = n < limit ? n : limit;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < m; i++)
        if (as_token(items[n - m + i], &buf[i]) < 0) {
            Py_DECREF(fast);
            return -1;
        }
    Py_DECREF(fast);
    return m;
}

static Seq *get_seq(Trie *t, PyObject *seq_id) {
    PyObject *capsule = PyDict_GetItemWithError(t->seqs, seq_id);
    if (capsule == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, seq_id);
    return capsule == NULL ? NULL : PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
}

static void free_seq(PyObject *capsule) {
    Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
    PyMem_Free(seq->tokens);
    PyMem_Free(seq->active);
    PyMem_Free(seq);
}

/* --- core --- */

static int extend_seq(Trie *t, Seq *seq, PyObject **items, Py_ssize_t n) {
    if (seq->len + n > seq->cap) {
        Py_ssize_t cap = seq->cap * 2 > seq->len + n ? seq->cap * 2 : seq->len + n;
        int32_t *tokens = PyMem_Realloc(seq->tokens, (size_t)cap * sizeof(int32_t));
        if (tokens == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        seq->tokens = tokens;
        seq->cap = cap;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t token;
        if (as_token(items[k], &token) < 0) return -1;
        /* longest suffix first, so that active[i + 1] is written after active[i] is read */
        for (int i = seq->num_active - 1; i >= 0; i--) {
            int32_t child = edge_find(&t->s, seq->active[i], token);
            if (child == NONE && (child = new_child(&t->s, seq->active[i], token)) == NONE) return -1;
            t->s.nodes[child].count += seq->weight;
            if (i + 1 < t->max_depth) seq->active[i + 1] = child;  /* a node at depth max_depth gets no children */
        }
        if (seq->num_active < t->max_depth) seq->num_active++;
        seq->tokens[seq->len++] = token;
        t->s.nodes[ROOT].count += seq->weight;
    }
    return 0;
}

static int extend_with(Trie *t, Seq *seq, PyObject *token_ids) {
    PyObject *fast = PySequence_Fast(token_ids, "token_ids must be a sequence of ints");
    if (fast == NULL) return -1;
    int failed = extend_seq(t, seq, PySequence_Fast_ITEMS(fast), PySequence_Fast_GET_SIZE(fast));
    Py_DECREF(fast);
    return failed;
}

/* (drafts, probs, match_length) from node, whose substring is path[0 .. path_len); path has room for max_depth. */
static PyObject *speculate(Trie *t, int32_t node, int32_t *path, int path_len, Py_ssize_t max_tokens,
                           double min_token_prob) {
    int match_length = path_len;
    PyObject *drafts = PyList_New(0), *probs = PyList_New(0);
    if (drafts == NULL || probs == NULL) goto fail;
    while (PyList_GET_SIZE(drafts) < max_tokens && node != NONE && t->s.nodes[node].first_child != NONE) {
        int32_t best = NONE;
        int64_t total = 0;
        for (int32_t c = t->s.nodes[node].first_child; c != NONE; c = t->s.nodes[c].next_sibling) {
            total += t->s.nodes[c].count;
            if (best == NONE || t->s.nodes[c].count > t->s.nodes[best].count
                || (t->s.nodes[c].count == t->s.nodes[best].count && t->s.nodes[c].token < t->s.nodes[best].token))
                best = c;
        }
        double prob = (double)t->s.nodes[best].count / (double)total;
        if (prob < min_token_prob) break;
        PyObject *token = PyLong_FromLong(t->s.nodes[best].token), *p = PyFloat_FromDouble(prob);
        int failed = token == NULL || p == NULL || PyList_Append(drafts, token) < 0 || PyList_Append(probs, p) < 0;
        Py_XDECREF(token);
        Py_XDECREF(p);
        if (failed) goto fail;
        path[path_len++] = t->s.nodes[best].token;
        node = best;
        if (path_len == t->max_depth) {  /* a suffix link: continue from the last max_depth - 1 tokens */
            memmove(path, path + 1, (size_t)(--path_len) * sizeof(int32_t));
            node = walk(&t->s, path, path_len);
        }
    }
    return Py_BuildValue("(NNi)", drafts, probs, match_length);
fail:
    Py_XDECREF(drafts);
    Py_XDECREF(probs);
    return NULL;
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

static PyObject *Trie_add(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seq_id", "token_ids", "weight", NULL};
    PyObject *seq_id, *token_ids = NULL, *weight_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO", kwlist, &seq_id, &token_ids, &weight_obj)) return NULL;
    int present = PyDict_Contains(t->seqs, seq_id);
    if (present < 0) return NULL;
    if (present)
        return PyErr_Format(PyExc_ValueError, "sequence %R is already in the trie; use extend() to append to it",
                            seq_id);
    long long weight = 1;
    if (weight_obj != NULL) {
        weight = PyLong_CheckExact(weight_obj) ? PyLong_AsLongLong(weight_obj) : -1;
        if (weight == -1 && PyErr_Occurred()) PyErr_Clear();
        if (weight < 1)
            return PyErr_Format(PyExc_ValueError,
                                "weight=%R: a sequence counts as an integer number >= 1 of sequences", weight_obj);
    }
    Seq *seq = PyMem_Calloc(1, sizeof(Seq));
    if (seq == NULL) return PyErr_NoMemory();
    seq->weight = weight;
    seq->active = PyMem_Malloc((size_t)t->max_depth * sizeof(int32_t));
    PyObject *capsule = seq->active == NULL ? NULL : PyCapsule_New(seq, SEQ_CAPSULE, free_seq);
    if (capsule == NULL) {
        PyMem_Free(seq->active);
        PyMem_Free(seq);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    seq->active[0] = ROOT;
    seq->num_active = 1;
    int failed = PyDict_SetItem(t->seqs, seq_id, capsule);
    Py_DECREF(capsule);
    if (failed || (token_ids != NULL && extend_with(t, seq, token_ids) < 0)) return NULL;
    Py_RETURN_NONE;
}

/* The (seq_id, token_ids) arguments of extend and extend_to: the sequence, *token_ids set; NULL with an error set. */
static Seq *seq_and_tokens(Trie *t, PyObject *args, PyObject *kwds, PyObject **token_ids) {
    static char *kwlist[] = {"seq_id", "token_ids", NULL};
    PyObject *seq_id;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &seq_id, token_ids)) return NULL;
    return get_seq(t, seq_id);
}

static PyObject *Trie_extend(Trie *t, PyObject *args, PyObject *kwds) {
    PyObject *token_ids;
    Seq *seq = seq_and_tokens(t, args, kwds, &token_ids);
    return seq == NULL || extend_with(t, seq, token_ids) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *Trie_extend_to(Trie *t, PyObject *args, PyObject *kwds) {
    PyObject *token_ids;
    Seq *seq = seq_and_tokens(t, args, kwds, &token_ids);
    if (seq == NULL) return NULL;
    PyObject *fast = PySequence_Fast(token_ids, "token_ids must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int result = n >= seq->len;  /* then 0: not a continuation, -1: an error */
    for (Py_ssize_t i = seq->len - t->max_depth > 0 ? seq->len - t->max_depth : 0; result > 0 && i < seq->len; i++) {
        int32_t token;
        result = as_token(items[i], &token) < 0 ? -1 : token == seq->tokens[i];
    }
    if (result > 0 && extend_seq(t, seq, items + seq->len, n - seq->len) < 0) result = -1;
    Py_DECREF(fast);
    return result < 0 ? NULL : PyBool_FromLong(result);
}

static PyObject *Trie_remove(Trie *t, PyObject *seq_id) {
    Seq *seq = get_seq(t, seq_id);
    if (seq == NULL) return NULL;
    for (Py_ssize_t start = 0; start < seq->len; start++) {
        int32_t node = ROOT;
        for (Py_ssize_t i = start; i < seq->len && i < start + t->max_depth; i++) {
            int32_t child = edge_find(&t->s, node, seq->tokens[i]);
            if ((t->s.nodes[child].count -= seq->weight) == 0) {
                if (delete_subtree(&t->s, child) < 0) return NULL;
                break;
            }
            node = child;
        }
    }
    t->s.nodes[ROOT].count -= seq->weight * seq->len;
    if (PyDict_DelItem(t->seqs, seq_id) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Trie_sequence(Trie *t, PyObject *seq_id) {
    Seq *seq = get_seq(t, seq_id);
    if (seq == NULL) return NULL;
    PyObject *list = PyList_New(seq->len);
    for (Py_ssize_t i = 0; list != NULL && i < seq->len; i++) {
        PyObject *token = PyLong_FromLong(seq->tokens[i]);
        if (token == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, token);
    }
    return list;
}

static PyObject *Trie_count(Trie *t, PyObject *token_ids) {
    Py_ssize_t n = PySequence_Length(token_ids);
    if (n < 0) return NULL;
    if (n > t->max_depth) return PyLong_FromLong(0);
    if (tail_tokens(token_ids, n, t->path) < 0) return NULL;
    int32_t node = walk(&t->s, t->path, n);
    return PyLong_FromLongLong(node == NONE ? 0 : t->s.nodes[node].count);
}

static PyObject *Trie_match(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"context", "max_tokens", "min_token_prob", NULL};
    PyObject *context;
    Py_ssize_t max_tokens;
    double min_token_prob;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ond", kwlist, &context, &max_tokens, &min_token_prob))
        return NULL;
    int32_t *buf = t->path;
    Py_ssize_t m = tail_tokens(context, t->max_depth - 1, buf);
    if (m < 0) return NULL;
    /* the longest suffix with a child, by binary search: if s + x occurs, every suffix of s is followed by x */
    int32_t best_node = NONE;
    Py_ssize_t best_length = 0, lo = 1, hi = m;
    while (lo <= hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int32_t node = walk(&t->s, buf + m - mid, mid);
        if (node != NONE && t->s.nodes[node].first_child != NONE) {
            best_node = node;
            best_length = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    memmove(buf, buf + m - best_length, (size_t)best_length * sizeof(int32_t));
    return speculate(t, best_node, buf, (int)best_length, max_tokens, min_token_prob);
}

static PyObject *Trie_match_sequence(Trie *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seq_id", "max_tokens", "min_token_prob", NULL};
    PyObject *seq_id;
    Py_ssize_t max_tokens;
    double min_token_prob;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ond", kwlist, &seq_id, &max_tokens, &min_token_prob))
        return NULL;
    Seq *seq = get_seq(t, seq_id);
    if (seq == NULL) return NULL;
    int length = seq->num_active - 1;
    while (length && t->s.nodes[seq->active[length]].first_child == NONE) length--;
    if (length) memcpy(t->path, seq->tokens + seq->len - length, (size_t)length * sizeof(int32_t));
    return speculate(t, length ? seq->active[length] : NONE, t->path, length, max_tokens, min_token_prob);
}

/* counts[path] = the node's count, then each child's subtree; recursion is at most max_depth deep */
static int collect_counts(Trie *t, int32_t node, PyObject *path, PyObject *counts) {
    PyObject *count = PyLong_FromLongLong(t->s.nodes[node].count);
    int failed = count == NULL || PyDict_SetItem(counts, path, count) < 0;
    Py_XDECREF(count);
    for (int32_t c = t->s.nodes[node].first_child; !failed && c != NONE; c = t->s.nodes[c].next_sibling) {
        PyObject *token = Py_BuildValue("(i)", t->s.nodes[c].token);
        PyObject *longer = token == NULL ? NULL : PySequence_Concat(path, token);
        failed = longer == NULL || collect_counts(t, c, longer, counts) < 0;
        Py_XDECREF(token);
        Py_XDECREF(longer);
    }
    return failed ? -1 : 0;
}

static PyObject *Trie_substring_counts(Trie *t, PyObject *unused) {
    PyObject *counts = PyDict_New(), *root = PyTuple_New(0);
    if (counts == NULL || root == NULL || collect_counts(t, ROOT, root, counts) < 0) Py_CLEAR(counts);
    Py_XDECREF(root);
    return counts;
}

static int Trie_contains(Trie *t, PyObject *seq_id) { return PyDict_Contains(t->seqs, seq_id); }

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
    Py_INCREF(&TrieType);
    if (PyModule_AddObject(m, "SuffixTree", (PyObject *)&TrieType) < 0) {
        Py_DECREF(&TrieType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
