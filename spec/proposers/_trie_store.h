/* The node store of the suffix trie (spec/proposers/_suffix_tree.c): nodes in one array (ids are indices; freed ids
 * are reused through a free list threaded through next_sibling), each with its count, token, parent and a doubly
 * linked list of its children; the edges (parent, token) -> child in one open-addressing hash table with linear
 * probing and backward-shift deletion. Functions that allocate return NONE or -1 with a Python error set.
 */
#ifndef SPEC_TRIE_STORE_H
#define SPEC_TRIE_STORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROOT 0
#define NONE (-1)
#define EMPTY UINT64_MAX

typedef struct {
    int64_t count;
    int32_t token, parent, first_child, next_sibling, prev_sibling;
} Node;

typedef struct {
    uint64_t key;
    int32_t child;
} Slot;

typedef struct {
    Node *nodes;
    int32_t num_allocated, nodes_cap, free_head, num_free;
    Slot *slots;
    uint64_t mask;
    int64_t num_edges;
    int32_t *stack;  /* scratch for subtree deletion */
    Py_ssize_t stack_cap;
} Store;

static int store_init(Store *t) {
    t->nodes_cap = 1024;
    t->nodes = PyMem_Malloc(t->nodes_cap * sizeof(Node));
    t->mask = 2047;
    t->slots = PyMem_Malloc((t->mask + 1) * sizeof(Slot));
    t->stack_cap = 1024;
    t->stack = PyMem_Malloc(t->stack_cap * sizeof(int32_t));
    if (t->nodes == NULL || t->slots == NULL || t->stack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i <= t->mask; i++) t->slots[i].key = EMPTY;
    t->nodes[ROOT] = (Node){0, -1, NONE, NONE, NONE, NONE};
    t->num_allocated = 1;
    t->free_head = NONE;
    return 0;
}

static void store_free(Store *t) {
    PyMem_Free(t->nodes);
    PyMem_Free(t->slots);
    PyMem_Free(t->stack);
}

/* --- edges --- */

static inline uint64_t edge_key(int32_t parent, int32_t token) {
    return ((uint64_t)(uint32_t)parent << 32) | (uint32_t)token;
}

static inline uint64_t slot_of(uint64_t key, uint64_t mask) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    key *= 0xc4ceb9fe1a85ec53ULL;
    key ^= key >> 33;
    return key & mask;
}

static inline int32_t edge_find(const Store *t, int32_t parent, int32_t token) {
    uint64_t key = edge_key(parent, token);
    for (uint64_t i = slot_of(key, t->mask);; i = (i + 1) & t->mask) {
        if (t->slots[i].key == key) return t->slots[i].child;
        if (t->slots[i].key == EMPTY) return NONE;
    }
}

static void edge_put(Slot *slots, uint64_t mask, uint64_t key, int32_t child) {
    uint64_t i = slot_of(key, mask);
    while (slots[i].key != EMPTY) i = (i + 1) & mask;
    slots[i].key = key;
    slots[i].child = child;
}

static int edges_reserve(Store *t) {
    if ((uint64_t)(t->num_edges + 1) * 2 <= t->mask + 1) return 0;
    uint64_t size = (t->mask + 1) * 2;
    Slot *slots = PyMem_Malloc(size * sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < size; i++) slots[i].key = EMPTY;
    for (uint64_t i = 0; i <= t->mask; i++)
        if (t->slots[i].key != EMPTY) edge_put(slots, size - 1, t->slots[i].key, t->slots[i].child);
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = size - 1;
    return 0;
}

static void edge_delete(Store *t, int32_t parent, int32_t token) {
    uint64_t key = edge_key(parent, token), i = slot_of(key, t->mask);
    while (t->slots[i].key != key) i = (i + 1) & t->mask;
    for (uint64_t j = (i + 1) & t->mask; t->slots[j].key != EMPTY; j = (j + 1) & t->mask) {
        uint64_t home = slot_of(t->slots[j].key, t->mask);
        /* the entry at j stays unless its home slot lies cyclically outside (i, j] */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].key = EMPTY;
    t->num_edges--;
}

/* --- nodes --- */

static int32_t new_child(Store *t, int32_t parent, int32_t token) {
    if (edges_reserve(t) < 0) return NONE;
    int32_t id;
    if (t->free_head != NONE) {
        id = t->free_head;
        t->free_head = t->nodes[id].next_sibling;
        t->num_free--;
    } else {
        if (t->num_allocated == t->nodes_cap) {
            if (t->nodes_cap > INT32_MAX / 2) {
                PyErr_SetString(PyExc_MemoryError, "suffix trie: more than 2**31 nodes");
                return NONE;
            }
            Node *nodes = PyMem_Realloc(t->nodes, (size_t)t->nodes_cap * 2 * sizeof(Node));
            if (nodes == NULL) {
                PyErr_NoMemory();
                return NONE;
            }
            t->nodes = nodes;
            t->nodes_cap *= 2;
        }
        id = t->num_allocated++;
    }
    Node *node = &t->nodes[id], *up = &t->nodes[parent];
    node->count = 0;
    node->token = token;
    node->parent = parent;
    node->first_child = NONE;
    node->prev_sibling = NONE;
    node->next_sibling = up->first_child;
    if (up->first_child != NONE) t->nodes[up->first_child].prev_sibling = id;
    up->first_child = id;
    edge_put(t->slots, t->mask, edge_key(parent, token), id);
    t->num_edges++;
    return id;
}

/* Unlink child from its parent and free its whole subtree (every occurrence below it was in the removed sequence). */
static int delete_subtree(Store *t, int32_t child) {
    Node *node = &t->nodes[child];
    if (node->prev_sibling != NONE) t->nodes[node->prev_sibling].next_sibling = node->next_sibling;
    else t->nodes[node->parent].first_child = node->next_sibling;
    if (node->next_sibling != NONE) t->nodes[node->next_sibling].prev_sibling = node->prev_sibling;
    edge_delete(t, node->parent, node->token);
    Py_ssize_t top = 0;
    t->stack[top++] = child;
    while (top) {
        int32_t id = t->stack[--top];
        for (int32_t c = t->nodes[id].first_child; c != NONE; c = t->nodes[c].next_sibling) {
            if (top == t->stack_cap) {
                int32_t *stack = PyMem_Realloc(t->stack, (size_t)t->stack_cap * 2 * sizeof(int32_t));
                if (stack == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                t->stack = stack;
                t->stack_cap *= 2;
            }
            edge_delete(t, id, t->nodes[c].token);
            t->stack[top++] = c;
        }
        t->nodes[id].count = 0;
        t->nodes[id].first_child = NONE;
        t->nodes[id].next_sibling = t->free_head;
        t->free_head = id;
        t->num_free++;
    }
    return 0;
}

static int32_t walk(const Store *t, const int32_t *tokens, Py_ssize_t n) {
    int32_t node = ROOT;
    for (Py_ssize_t i = 0; i < n && node != NONE; i++) node = edge_find(t, node, tokens[i]);
    return node;
}

#endif
