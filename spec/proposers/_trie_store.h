/* The node store of the suffix trie (spec/proposers/_suffix_tree.c): nodes in one array (ids are indices; freed ids
 * are reused through a free list threaded through next_sibling), each with its count, token, parent and a doubly
 * linked list of its children; the edges (parent, token) -> child in one open-addressing hash table with linear
 * probing and backward-shift deletion, at most half full.
 *
 * Only store_init and store_reserve allocate. A caller reserves room for k nodes first (store_reserve: MemoryError
 * and the store unchanged, or room), then the next k new_child calls cannot fail for want of memory; deleting
 * allocates nothing. So an update either fails before it changes anything or runs to its end. A lookup that finds
 * something the invariants rule out (an edge to a node id out of range, a node with no edge) returns CORRUPT or -1;
 * nothing is read or written out of bounds, and the caller raises RuntimeError (trie_broken).
 */
#ifndef SPEC_TRIE_STORE_H
#define SPEC_TRIE_STORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROOT 0
#define NONE (-1)
#define CORRUPT (-2)  /* an edge whose child id is out of range */
#define EMPTY UINT64_MAX
#define MAX_NODES INT32_MAX

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
    uint64_t mask;  /* the table has mask + 1 slots, a power of two */
    int64_t num_edges;
} Store;

static Slot *new_table(uint64_t size) {
    Slot *slots = PyMem_Malloc(size * sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (uint64_t i = 0; i < size; i++) slots[i].key = EMPTY;
    return slots;
}

static int store_init(Store *t) {
    t->nodes_cap = 1024;
    t->nodes = PyMem_Malloc(t->nodes_cap * sizeof(Node));
    t->mask = 2047;
    t->slots = new_table(t->mask + 1);
    if (t->nodes == NULL || t->slots == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    t->nodes[ROOT] = (Node){0, -1, NONE, NONE, NONE, NONE};
    t->num_allocated = 1;
    t->free_head = NONE;
    return 0;
}

static void store_free(Store *t) {
    PyMem_Free(t->nodes);
    PyMem_Free(t->slots);
}

static size_t store_nbytes(const Store *t) {
    return (size_t)t->nodes_cap * sizeof(Node) + (size_t)(t->mask + 1) * sizeof(Slot);
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

/* The child of parent by token: its id, NONE where there is no such edge, CORRUPT where the edge's child is out of
 * range. The table always has an EMPTY slot (at most half full), so the probe ends. */
static inline int32_t edge_find(const Store *t, int32_t parent, int32_t token) {
    uint64_t key = edge_key(parent, token);
    for (uint64_t i = slot_of(key, t->mask);; i = (i + 1) & t->mask) {
        if (t->slots[i].key == key) {
            int32_t child = t->slots[i].child;
            return child > ROOT && child < t->num_allocated ? child : CORRUPT;
        }
        if (t->slots[i].key == EMPTY) return NONE;
    }
}

static void edge_put(Slot *slots, uint64_t mask, uint64_t key, int32_t child) {
    uint64_t i = slot_of(key, mask);
    while (slots[i].key != EMPTY) i = (i + 1) & mask;
    slots[i].key = key;
    slots[i].child = child;
}

/* Remove the edge (parent, token): 0, or -1 where there is none (a broken invariant). */
static int edge_delete(Store *t, int32_t parent, int32_t token) {
    uint64_t key = edge_key(parent, token), i = slot_of(key, t->mask);
    while (t->slots[i].key != key) {
        if (t->slots[i].key == EMPTY) return -1;
        i = (i + 1) & t->mask;
    }
    for (uint64_t j = (i + 1) & t->mask; t->slots[j].key != EMPTY; j = (j + 1) & t->mask) {
        uint64_t home = slot_of(t->slots[j].key, t->mask);
        /* the entry at j stays unless its home slot lies cyclically outside (i, j] */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].key = EMPTY;
    t->num_edges--;
    return 0;
}

/* --- room --- */

static int grow_nodes(Store *t, int64_t needed) {
    if (needed > MAX_NODES) {
        PyErr_SetString(PyExc_MemoryError, "suffix trie: more than 2**31 nodes");
        return -1;
    }
    int64_t cap = (int64_t)t->nodes_cap * 2 > needed ? (int64_t)t->nodes_cap * 2 : needed;
    if (cap > MAX_NODES) cap = MAX_NODES;
    Node *nodes = PyMem_Realloc(t->nodes, (size_t)cap * sizeof(Node));
    if (nodes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->nodes = nodes;
    t->nodes_cap = (int32_t)cap;
    return 0;
}

static int grow_table(Store *t, uint64_t size) {
    Slot *slots = new_table(size);
    if (slots == NULL) return -1;
    for (uint64_t i = 0; i <= t->mask; i++)
        if (t->slots[i].key != EMPTY) edge_put(slots, size - 1, t->slots[i].key, t->slots[i].child);
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = size - 1;
    return 0;
}

/* Room for k more nodes and edges: 0, or -1 with MemoryError set and the store unchanged (what it holds; at most its
 * node capacity grew). */
static int store_reserve(Store *t, int32_t k) {
    int64_t needed = (int64_t)t->num_allocated + k - t->num_free;
    if (needed > t->nodes_cap && grow_nodes(t, needed) < 0) return -1;
    uint64_t size = t->mask + 1;
    while ((uint64_t)(t->num_edges + k) * 2 > size) size *= 2;
    return size == t->mask + 1 ? 0 : grow_table(t, size);
}

/* --- nodes --- */

/* A new child of parent by token, in room store_reserve made: its id, or CORRUPT where there is no room (a caller
 * that did not reserve). */
static int32_t new_child(Store *t, int32_t parent, int32_t token) {
    if ((uint64_t)(t->num_edges + 1) * 2 > t->mask + 1 || (t->free_head == NONE && t->num_allocated == t->nodes_cap))
        return CORRUPT;
    int32_t id;
    if (t->free_head != NONE) {
        id = t->free_head;
        t->free_head = t->nodes[id].next_sibling;
        t->num_free--;
    } else {
        id = t->num_allocated++;
    }
    Node *node = &t->nodes[id], *up = &t->nodes[parent];
    *node = (Node){0, token, parent, NONE, up->first_child, NONE};
    if (up->first_child != NONE) t->nodes[up->first_child].prev_sibling = id;
    up->first_child = id;
    edge_put(t->slots, t->mask, edge_key(parent, token), id);
    t->num_edges++;
    return id;
}

/* Unlink node from its parent's children and delete its edge: 0, or -1 where the edge is missing. */
static int unlink_node(Store *t, int32_t id) {
    Node *node = &t->nodes[id];
    if (node->prev_sibling != NONE) t->nodes[node->prev_sibling].next_sibling = node->next_sibling;
    else t->nodes[node->parent].first_child = node->next_sibling;
    if (node->next_sibling != NONE) t->nodes[node->next_sibling].prev_sibling = node->prev_sibling;
    return edge_delete(t, node->parent, node->token);
}

/* Free top and its whole subtree (every occurrence below it was in what is being uncounted), post-order along the
 * parent links, without allocating: 0, or -1 where an edge is missing. */
static int free_subtree(Store *t, int32_t top) {
    int32_t id = top;
    for (;;) {
        while (t->nodes[id].first_child != NONE) id = t->nodes[id].first_child;
        int32_t parent = t->nodes[id].parent;
        if (unlink_node(t, id) < 0) return -1;
        t->nodes[id].count = 0;
        t->nodes[id].next_sibling = t->free_head;
        t->free_head = id;
        t->num_free++;
        if (id == top) return 0;
        id = parent;
    }
}

/* The node of the substring tokens[0 .. n), NONE where it does not occur (or a lookup finds a broken edge). */
static int32_t walk(const Store *t, const int32_t *tokens, Py_ssize_t n) {
    int32_t node = ROOT;
    for (Py_ssize_t i = 0; i < n && node >= 0; i++) node = edge_find(t, node, tokens[i]);
    return node < 0 ? NONE : node;
}

#endif
