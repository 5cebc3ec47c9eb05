/* core/treap.c — the treap's split and merge (treap.h). */
#include "treap.h"

/* Whether n is before (key, tie); or at it too, when incl. */
static inline int before(const dp__treap_node_t *n, uint64_t key, uint64_t tie, int incl) {
  return n->key < key || (n->key == key && (n->tie < tie || (incl && n->tie == tie)));
}

/* Splits t into the nodes before (key, tie) — at it too when incl — (*l)
 * and the others (*r). */
static void split(dp__treap_node_t *t, uint64_t key, uint64_t tie, int incl, dp__treap_node_t **l,
                  dp__treap_node_t **r) {
  while (t) {
    if (before(t, key, tie, incl)) {
      *l = t;
      l = &t->right;
      t = t->right;
    } else {
      *r = t;
      r = &t->left;
      t = t->left;
    }
  }
  *l = *r = NULL;
}

/* Joins l and r, every node of l before every node of r. */
static dp__treap_node_t *merge(dp__treap_node_t *l, dp__treap_node_t *r) {
  dp__treap_node_t *root, **at = &root;
  while (l && r) {
    if (l->prio > r->prio) {
      *at = l;
      at = &l->right;
      l = l->right;
    } else {
      *at = r;
      at = &r->left;
      r = r->left;
    }
  }
  *at = l ? l : r;
  return root;
}

void dp__treap_insert(dp__treap_t *t, dp__treap_node_t *n, uint64_t key, uint64_t tie) {
  uint32_t x = t->rng ? t->rng : 2463534242u;
  x ^= x << 13, x ^= x >> 17, x ^= x << 5;
  t->rng = x;
  n->prio = x;
  n->key = key;
  n->tie = tie;
  /* down to where n's priority puts it; the subtree there splits around n */
  dp__treap_node_t **at = &t->root;
  while (*at && (*at)->prio >= x) at = before(*at, key, tie, 0) ? &(*at)->right : &(*at)->left;
  split(*at, key, tie, 0, &n->left, &n->right);
  *at = n;
}

/* Down to the link to n; its children joined take its place. */
void dp__treap_remove(dp__treap_t *t, dp__treap_node_t *n) {
  dp__treap_node_t **at = &t->root;
  while (*at && *at != n) at = before(*at, n->key, n->tie, 0) ? &(*at)->right : &(*at)->left;
  if (*at) *at = merge(n->left, n->right);
  n->left = n->right = NULL;
}

dp__treap_node_t *dp__treap_ceil(const dp__treap_t *t, uint64_t key, uint64_t tie) {
  dp__treap_node_t *n = t->root, *found = NULL;
  while (n) {
    if (before(n, key, tie, 0)) {
      n = n->right;
    } else {
      found = n;
      n = n->left;
    }
  }
  return found;
}

dp__treap_node_t *dp__treap_floor(const dp__treap_t *t, uint64_t key, uint64_t tie) {
  dp__treap_node_t *n = t->root, *found = NULL;
  while (n) {
    if (before(n, key, tie, 1)) {
      found = n;
      n = n->right;
    } else {
      n = n->left;
    }
  }
  return found;
}

dp__treap_node_t *dp__treap_take(dp__treap_t *t) {
  dp__treap_node_t *n = t->root;
  if (!n) return NULL;
  t->root = merge(n->left, n->right);
  n->left = n->right = NULL;
  return n;
}
