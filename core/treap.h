/* core/treap.h — the one ordered set of the library: a treap (a binary
 * search tree kept balanced by random heap priorities) of intrusive nodes.
 * The caching allocator keeps its large free blocks in one, best fit by
 * (size, address); the host backend its allocations, by base address, so
 * that any interior pointer finds its allocation. Both need an insert, a
 * remove and a search in logarithmic time whatever the order of the keys
 * (a sorted array costs a move of half of it a change: quadratic for n
 * frees in allocation order).
 *
 * A node is ordered by the pair (key, tie); the pairs of the nodes in one
 * treap must be distinct (remove finds a node by its pair). The pair is
 * stored in the node when it is inserted, so that comparisons read the node
 * alone: the owner may change its own copy of the key (a block's size as it
 * merges) only while the node is out of the treap.
 *
 * Split and merge are loops over pointers to links: no recursion, whatever
 * the depth. Nothing here allocates; the nodes are the owner's (embed one
 * and get back to its struct with DP__TREAP_ENTRY). Not thread-safe: the
 * owner locks. */
#ifndef DP_CORE_TREAP_H
#define DP_CORE_TREAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct dp__treap_node {
  struct dp__treap_node *left, *right;
  uint64_t key, tie;
  uint32_t prio;                 /* a max-heap over the tree */
} dp__treap_node_t;

typedef struct dp__treap {
  dp__treap_node_t *root;        /* NULL: empty */
  uint32_t rng;                  /* the priorities (xorshift); 0: not drawn yet */
} dp__treap_t;

/* The struct of type `type` whose member `member` is node n. */
#define DP__TREAP_ENTRY(n, type, member) ((type *)(void *)((char *)(n) - offsetof(type, member)))

/* A zeroed dp__treap_t is empty; this says so. */
static inline void dp__treap_init(dp__treap_t *t) {
  t->root = NULL;
  t->rng = 0;
}

/* Inserts n under (key, tie), which no node of t has. */
void dp__treap_insert(dp__treap_t *t, dp__treap_node_t *n, uint64_t key, uint64_t tie);
/* Removes n, a node of t. Its links are left NULL. */
void dp__treap_remove(dp__treap_t *t, dp__treap_node_t *n);
/* The first node at (key, tie) or after it, or NULL. */
dp__treap_node_t *dp__treap_ceil(const dp__treap_t *t, uint64_t key, uint64_t tie);
/* The last node at (key, tie) or before it, or NULL. */
dp__treap_node_t *dp__treap_floor(const dp__treap_t *t, uint64_t key, uint64_t tie);
/* Removes the root and returns it (NULL when empty), its children joined
 * in its place: how an owner empties a treap to free its nodes, with no
 * search and no stack. */
dp__treap_node_t *dp__treap_take(dp__treap_t *t);

#endif
