/* treap: the one ordered set (core/treap.h) behind the caching allocator's
 * large free blocks and the host backend's allocations — order by (key,
 * tie), the nearest node at or around a pair, removal of any node, and a
 * depth that stays logarithmic whatever the order of the keys (checked on
 * the tree's shape, not timed). */
#include "helpers.h"

#include "../core/treap.h"

typedef struct item {
  int id;
  dp__treap_node_t tn;
} item_t;

static item_t *item_of(dp__treap_node_t *n) { return n ? DP__TREAP_ENTRY(n, item_t, tn) : NULL; }

/* Checks the search order and the heap order of the priorities, and
 * returns the number of nodes; *depth gets the longest path (no recursion:
 * a broken treap may be a list). */
static size_t check_shape(const dp__treap_t *t, size_t *depth) {
  size_t cap = 1 << 20, top = 0, count = 0;
  struct at { const dp__treap_node_t *n; size_t d; } *stack = malloc(cap * sizeof *stack);
  cr_assert_not_null(stack);
  *depth = 0;
  if (t->root) stack[top++] = (struct at){t->root, 1};
  while (top) {
    struct at a = stack[--top];
    count++;
    if (a.d > *depth) *depth = a.d;
    const dp__treap_node_t *kids[2] = {a.n->left, a.n->right};
    for (int k = 0; k < 2; k++) {
      const dp__treap_node_t *c = kids[k];
      if (!c) continue;
      cr_assert(c->prio <= a.n->prio, "a child's priority is above its parent's");
      int after = c->key > a.n->key || (c->key == a.n->key && c->tie > a.n->tie);
      cr_assert(k ? after : !after, "a %s child is on the wrong side of its parent", k ? "right" : "left");
      cr_assert(top < cap);
      stack[top++] = (struct at){c, a.d + 1};
    }
  }
  free(stack);
  return count;
}

Test(treap, an_empty_treap_finds_nothing_and_gives_nothing) {
  dp__treap_t t;
  dp__treap_init(&t);
  cr_assert_null(dp__treap_ceil(&t, 0, 0));
  cr_assert_null(dp__treap_floor(&t, UINT64_MAX, UINT64_MAX));
  cr_assert_null(dp__treap_take(&t));
}

Test(treap, ceil_finds_the_first_node_at_or_after_a_pair_and_floor_the_last_at_or_before) {
  dp__treap_t t;
  dp__treap_init(&t);
  item_t it[5];
  uint64_t keys[5] = {40, 10, 30, 20, 50};
  for (int i = 0; i < 5; i++) {
    it[i].id = i;
    dp__treap_insert(&t, &it[i].tn, keys[i], 0);
  }
  cr_assert_eq(item_of(dp__treap_ceil(&t, 25, 0))->id, 2, "30 is the first at or after 25");
  cr_assert_eq(item_of(dp__treap_ceil(&t, 30, 0))->id, 2, "at the pair itself");
  cr_assert_eq(item_of(dp__treap_ceil(&t, 0, 0))->id, 1);
  cr_assert_null(dp__treap_ceil(&t, 51, 0));
  cr_assert_eq(item_of(dp__treap_floor(&t, 25, 0))->id, 3, "20 is the last at or before 25");
  cr_assert_eq(item_of(dp__treap_floor(&t, 20, 0))->id, 3, "at the pair itself");
  cr_assert_eq(item_of(dp__treap_floor(&t, UINT64_MAX, 0))->id, 4);
  cr_assert_null(dp__treap_floor(&t, 9, 0));
}

/* The caching allocator's order: by size, then by address among blocks of
 * one size; best fit asks for (size, 0). */
Test(treap, nodes_with_one_key_are_ordered_by_their_tie) {
  dp__treap_t t;
  dp__treap_init(&t);
  item_t it[4] = {{0, {0}}, {1, {0}}, {2, {0}}, {3, {0}}};
  dp__treap_insert(&t, &it[0].tn, 4096, 0x3000);
  dp__treap_insert(&t, &it[1].tn, 4096, 0x1000);
  dp__treap_insert(&t, &it[2].tn, 8192, 0x0800);
  dp__treap_insert(&t, &it[3].tn, 4096, 0x2000);
  cr_assert_eq(item_of(dp__treap_ceil(&t, 4096, 0))->id, 1, "the lowest address of the smallest fit");
  cr_assert_eq(item_of(dp__treap_ceil(&t, 4096, 0x1001))->id, 3);
  cr_assert_eq(item_of(dp__treap_ceil(&t, 4096, 0x3001))->id, 2, "past every 4096, the next size");
  cr_assert_eq(item_of(dp__treap_floor(&t, 4096, UINT64_MAX))->id, 0);
  dp__treap_remove(&t, &it[1].tn);
  cr_assert_eq(item_of(dp__treap_ceil(&t, 4096, 0))->id, 3);
  cr_assert_null(it[1].tn.left);
  cr_assert_null(it[1].tn.right);
}

/* Random inserts and removes against a sorted reference: every search
 * answers as the reference does, and the shape stays a treap. */
Test(treap, random_inserts_and_removes_keep_every_search_right) {
  enum { N = 2000 };
  static item_t it[N];
  static int in[N];
  dp__treap_t t;
  dp__treap_init(&t);
  t_rng_t r = {0x9e3779b97f4a7c15ull};
  size_t live = 0;
  for (int round = 0; round < 20000; round++) {
    int i = (int)(t_rand(&r) % N);
    if (in[i]) {
      dp__treap_remove(&t, &it[i].tn);
      in[i] = 0;
      live--;
    } else {
      it[i].id = i;
      dp__treap_insert(&t, &it[i].tn, (uint64_t)(i / 4) * 16, (uint64_t)i); /* four share each key */
      in[i] = 1;
      live++;
    }
    if (round % 97 == 0) {
      uint64_t key = t_rand(&r) % (N / 4 * 16 + 32), tie = t_rand(&r) % (N + 1);
      int want_ceil = -1, want_floor = -1;
      for (int j = 0; j < N; j++) {
        if (!in[j]) continue;
        uint64_t k = (uint64_t)(j / 4) * 16, tj = (uint64_t)j;
        int at_or_after = k > key || (k == key && tj >= tie), at_or_before = k < key || (k == key && tj <= tie);
        if (at_or_after && want_ceil < 0) want_ceil = j; /* j ascending: (key, tie) ascending */
        if (at_or_before) want_floor = j;
      }
      item_t *c = item_of(dp__treap_ceil(&t, key, tie)), *f = item_of(dp__treap_floor(&t, key, tie));
      cr_assert_eq(c ? c->id : -1, want_ceil, "ceil(%lu, %lu)", (unsigned long)key, (unsigned long)tie);
      cr_assert_eq(f ? f->id : -1, want_floor, "floor(%lu, %lu)", (unsigned long)key, (unsigned long)tie);
      size_t depth;
      cr_assert_eq(check_shape(&t, &depth), live);
    }
  }
}

/* Addresses handed out in order, then freed in order, are what the host
 * backend and the allocator see most: a plain search tree becomes a list. */
Test(treap, keys_inserted_in_order_leave_a_logarithmic_depth) {
  enum { N = 1 << 17 };
  item_t *it = calloc(N, sizeof *it);
  cr_assert_not_null(it);
  dp__treap_t t;
  dp__treap_init(&t);
  for (int i = 0; i < N; i++) dp__treap_insert(&t, &it[i].tn, (uint64_t)i * 256, 0);
  size_t depth;
  cr_assert_eq(check_shape(&t, &depth), N);
  cr_assert_leq(depth, 4 * 17, "depth %zu for %d keys inserted in order", depth, N);
  for (int i = 0; i < N / 2; i++) dp__treap_remove(&t, &it[i].tn);
  cr_assert_eq(check_shape(&t, &depth), N / 2);
  cr_assert_leq(depth, 4 * 17, "depth %zu after removing the lower half in order", depth);
  free(it);
}

Test(treap, taking_the_root_until_empty_gives_every_node_once) {
  enum { N = 1000 };
  static item_t it[N];
  static int seen[N];
  dp__treap_t t;
  dp__treap_init(&t);
  for (int i = 0; i < N; i++) {
    it[i].id = i;
    dp__treap_insert(&t, &it[i].tn, (uint64_t)(i * 7919 % N), 0);
  }
  int n = 0;
  for (item_t *x; (x = item_of(dp__treap_take(&t))) != NULL; n++) {
    cr_assert_eq(seen[x->id]++, 0, "node %d taken twice", x->id);
    cr_assert_null(x->tn.left);
    cr_assert_null(x->tn.right);
  }
  cr_assert_eq(n, N);
  cr_assert_null(t.root);
}
