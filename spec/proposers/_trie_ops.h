/* The suffix trie's algorithms on C data (spec/proposers/_suffix_tree.c is their Python binding): appending tokens to
 * a sequence, all or none; uncounting a sequence (remove, and undoing an append); matching; a preorder walk. None
 * runs Python code. A broken invariant (trie_broken) sets RuntimeError and marks the trie corrupt.
 */
#ifndef SPEC_TRIE_OPS_H
#define SPEC_TRIE_OPS_H

#include "_trie_store.h"

typedef struct {
    int32_t *tokens;
    Py_ssize_t len, cap;
    int64_t weight;
    int32_t *active;  /* active[i]: the node of the sequence's suffix of length i, i < num_active; active[0] = ROOT */
    int num_active;  /* min(len + 1, max_depth) */
} Seq;

typedef struct {
    PyObject_HEAD
    int max_depth;
    int is_corrupt;
    uint64_t version;  /* bumped by every update */
    Store s;
    int32_t *path;  /* scratch for matching: max_depth tokens */
    PyObject *seqs;  /* seq id (exact int) -> capsule(Seq) */
} Trie;

typedef struct {
    int32_t token;
    double prob;
} Draft;

typedef struct {
    int64_t count;
    int32_t token;
    int depth;
} Substring;

static int trie_broken(Trie *t, const char *what) {
    t->is_corrupt = 1;
    PyErr_Format(PyExc_RuntimeError, "suffix trie: broken invariant (%s); the trie is corrupt, build a new one", what);
    return -1;
}

/* --- updates --- */

/* One more token at the end of seq: every suffix ending there (at most max_depth) counted, in room reserved. */
static int append_one(Trie *t, Seq *seq, int32_t token) {
    for (int i = seq->num_active - 1; i >= 0; i--) {  /* longest first: active[i + 1] is written after active[i] is read */
        int32_t child = edge_find(&t->s, seq->active[i], token);
        if (child == NONE) child = new_child(&t->s, seq->active[i], token);
        if (child < 0) return trie_broken(t, "an edge to a node out of range, or a node without reserved room");
        t->s.nodes[child].count += seq->weight;
        if (i + 1 < t->max_depth) seq->active[i + 1] = child;  /* a node at depth max_depth gets no children */
    }
    if (seq->num_active < t->max_depth) seq->num_active++;
    seq->tokens[seq->len++] = token;
    t->s.nodes[ROOT].count += seq->weight;
    return 0;
}

/* Uncount, weight times, every occurrence tokens[s .. e] with e >= from and e - s < max_depth: per start s, walk its
 * path down; a node whose count reaches 0 goes with its subtree (every occurrence below it is being uncounted too:
 * a later start's occurrence of it would still be counted). */
static int uncount(Trie *t, const int32_t *tokens, Py_ssize_t len, Py_ssize_t from, int64_t weight) {
    for (Py_ssize_t s = from - t->max_depth + 1 > 0 ? from - t->max_depth + 1 : 0; s < len; s++) {
        int32_t node = ROOT;
        for (Py_ssize_t e = s; e < len && e < s + t->max_depth; e++) {
            int32_t child = edge_find(&t->s, node, tokens[e]);
            if (child < 0) return trie_broken(t, "a counted substring has no node");
            Node *c = &t->s.nodes[child];
            if (e >= from && c->count < weight) return trie_broken(t, "a count below the sequence's weight");
            if (e >= from && (c->count -= weight) == 0) {
                if (free_subtree(&t->s, child) < 0) return trie_broken(t, "a node without its edge");
                break;
            }
            node = child;
        }
    }
    return 0;
}

/* seq's suffix nodes from its tokens (after an undone append). */
static int restore_active(Trie *t, Seq *seq) {
    seq->num_active = seq->len + 1 < t->max_depth ? (int)seq->len + 1 : t->max_depth;
    for (int i = 1; i < seq->num_active; i++) {
        int32_t node = walk(&t->s, seq->tokens + seq->len - i, i);
        if (node == NONE) return trie_broken(t, "a sequence's suffix has no node");
        seq->active[i] = node;
    }
    return 0;
}

/* Undo the appends since seq held start tokens, keeping the error that stopped them: -1. */
static int undo_append(Trie *t, Seq *seq, Py_ssize_t start) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int failed = uncount(t, seq->tokens, seq->len, start, seq->weight) < 0;
    if (!failed) {
        t->s.nodes[ROOT].count -= seq->weight * (seq->len - start);
        seq->len = start;
        failed = restore_active(t, seq) < 0;
    }
    if (failed) {  /* the RuntimeError of a broken invariant replaces it */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    } else {
        PyErr_Restore(type, value, traceback);
    }
    return -1;
}

static int reserve_tokens(Seq *seq, Py_ssize_t n) {
    if (seq->len + n <= seq->cap) return 0;
    Py_ssize_t cap = seq->cap * 2 > seq->len + n ? seq->cap * 2 : seq->len + n;
    int32_t *tokens = PyMem_Realloc(seq->tokens, (size_t)cap * sizeof(int32_t));
    if (tokens == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    seq->tokens = tokens;
    seq->cap = cap;
    return 0;
}

/* Counts are int64_t. A node's count is its substring's occurrences, each weighted by its sequence and each ending
 * at its own token, so it is at most the root's count (the weighted tokens: every sequence's weight * len summed),
 * and a node's children's counts sum to at most its own; append_one counts a node before the root, by the same
 * weight. So an append that keeps the root's count within INT64_MAX keeps every count and sum within it: 0, or -1
 * with a ValueError where it would not. */
static int check_count_limit(const Trie *t, const Seq *seq, Py_ssize_t n) {
    int64_t root = t->s.nodes[ROOT].count, added, total;
    if (!__builtin_mul_overflow(seq->weight, n, &added) && !__builtin_add_overflow(root, added, &total)) return 0;
    PyErr_Format(PyExc_ValueError, "%zd token(s) of weight %lld would take the trie's weighted tokens (%lld) past its "
                 "count limit INT64_MAX = 2**63 - 1", n, (long long)seq->weight, (long long)root);
    return -1;
}

/* Append ids[0 .. n) to seq, all or none: the count limit is checked first, room for each token's max_depth nodes is
 * reserved before it is counted, and a failed reservation (MemoryError) undoes the tokens counted before it. */
static int append_tokens(Trie *t, Seq *seq, const int32_t *ids, Py_ssize_t n) {
    if (n == 0) return 0;
    if (check_count_limit(t, seq, n) < 0 || reserve_tokens(seq, n) < 0) return -1;
    Py_ssize_t start = seq->len;
    t->version++;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (store_reserve(&t->s, t->max_depth) < 0) return undo_append(t, seq, start);
        if (append_one(t, seq, ids[k]) < 0) return -1;
    }
    return 0;
}

static int remove_seq(Trie *t, Seq *seq) {
    t->version++;
    if (t->s.nodes[ROOT].count < seq->weight * seq->len) return trie_broken(t, "fewer tokens than a sequence holds");
    if (uncount(t, seq->tokens, seq->len, 0, seq->weight) < 0) return -1;
    t->s.nodes[ROOT].count -= seq->weight * seq->len;
    return 0;
}

/* --- reads --- */

/* The longest suffix of context[0 .. m) with a child: its node (NONE: none), its length in *length. By binary
 * search: if s + x occurs, every suffix of s is followed by x. */
static int32_t longest_match(Trie *t, const int32_t *context, Py_ssize_t m, Py_ssize_t *length) {
    int32_t best_node = NONE;
    Py_ssize_t lo = 1, hi = m;
    *length = 0;
    while (lo <= hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int32_t node = walk(&t->s, context + m - mid, mid);
        if (node != NONE && t->s.nodes[node].first_child != NONE) {
            best_node = node;
            *length = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return best_node;
}

/* node's most frequent child (ties: the smallest token), the sum of its children's counts in *total. */
static int32_t most_frequent_child(const Store *s, int32_t node, int64_t *total) {
    int32_t best = NONE;
    *total = 0;
    for (int32_t c = s->nodes[node].first_child; c != NONE; c = s->nodes[c].next_sibling) {
        *total += s->nodes[c].count;
        if (best == NONE || s->nodes[c].count > s->nodes[best].count
            || (s->nodes[c].count == s->nodes[best].count && s->nodes[c].token < s->nodes[best].token))
            best = c;
    }
    return best;
}

/* The drafts from node, whose substring is t->path[0 .. path_len) (path_len < max_depth), into *out (a PyMem array to
 * free): their number, or -1 with an error set. */
static Py_ssize_t speculate(Trie *t, int32_t node, int path_len, Py_ssize_t max_tokens, double min_token_prob,
                            Draft **out) {
    Py_ssize_t num = 0, cap = 16;
    Draft *drafts = PyMem_Malloc((size_t)cap * sizeof(Draft));
    if (drafts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    while (num < max_tokens && node != NONE && t->s.nodes[node].first_child != NONE) {
        int64_t total;
        int32_t best = most_frequent_child(&t->s, node, &total);
        if (total <= 0) {
            PyMem_Free(drafts);
            return trie_broken(t, "children whose counts sum to 0");
        }
        double prob = (double)t->s.nodes[best].count / (double)total;
        if (prob < min_token_prob) break;
        if (num == cap) {
            Draft *more = PyMem_Realloc(drafts, (size_t)(cap *= 2) * sizeof(Draft));
            if (more == NULL) {
                PyMem_Free(drafts);
                PyErr_NoMemory();
                return -1;
            }
            drafts = more;
        }
        drafts[num++] = (Draft){t->s.nodes[best].token, prob};
        t->path[path_len++] = t->s.nodes[best].token;
        node = best;
        if (path_len == t->max_depth) {  /* a suffix link: continue from the last max_depth - 1 tokens */
            memmove(t->path, t->path + 1, (size_t)(--path_len) * sizeof(int32_t));
            node = walk(&t->s, t->path, path_len);
        }
    }
    *out = drafts;
    return num;
}

/* Every node in use, in preorder (the root first), as (count, token, depth) into *out (a PyMem array to free): their
 * number, or -1 with an error set. */
static Py_ssize_t preorder(Trie *t, Substring **out) {
    Py_ssize_t num_nodes = t->s.num_allocated - t->s.num_free, num = 0;
    Substring *entries = PyMem_Malloc((size_t)num_nodes * sizeof(Substring));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int32_t node = ROOT;
    for (int depth = 0;;) {
        Node *n = &t->s.nodes[node];
        if (num == num_nodes || (n->first_child != NONE && depth == t->max_depth)) {
            PyMem_Free(entries);
            return trie_broken(t, "more nodes reachable than in use, or deeper than max_depth");
        }
        entries[num++] = (Substring){n->count, n->token, depth};
        if (n->first_child != NONE) {
            node = n->first_child;
            depth++;
            continue;
        }
        while (node != ROOT && t->s.nodes[node].next_sibling == NONE) {
            node = t->s.nodes[node].parent;
            depth--;
        }
        if (node == ROOT) break;
        node = t->s.nodes[node].next_sibling;
    }
    if (num != num_nodes) {
        PyMem_Free(entries);
        return trie_broken(t, "nodes in use that the root does not reach");
    }
    *out = entries;
    return num;
}

#endif
