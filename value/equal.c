/* value/equal.c — deep equality and hashing that terminate on cycles. */
#include <string.h>

#include "internal.h"
#include "../core/table.h"
#include "gc.h"

/* A set of node pairs, or a map from node to node when keyed on a only: a
 * tagged table (table.h) over the pairs in the order met. */
typedef struct pair {
  const void *a, *b;
} pair_t;

typedef struct pairset {
  dp__table_t t;
  pair_t *pairs;
  size_t cap;
  int a_only;
} pairset_t;

static void ps_init(pairset_t *s, int a_only) {
  dp__table_init(&s->t);
  s->pairs = NULL;
  s->cap = 0;
  s->a_only = a_only;
}

/* Keyed (table.h): node addresses follow the allocator, which the input
 * steers. */
static uint64_t pair_hash(const pairset_t *s, const void *a, const void *b) {
  if (s->a_only) return dp__hash_ptr(a);
  uint64_t k[2] = {(uint64_t)(uintptr_t)a, (uint64_t)(uintptr_t)b};
  return dp__hash_bytes(k, sizeof k, 0);
}

static uint64_t ps_hash_at(const void *ctx, size_t i) {
  const pairset_t *s = ctx;
  return pair_hash(s, s->pairs[i].a, s->pairs[i].b);
}

static inline __attribute__((always_inline)) int ps_eq(const void *ctx, size_t i, const void *key) {
  const pairset_t *s = ctx;
  const pair_t *k = key;
  return s->pairs[i].a == k->a && (s->a_only || s->pairs[i].b == k->b);
}

/* Finds (a, b) or, when keyed on a only, a. Returns 1 found, 0 inserted, or
 * DP_ENOMEM. *bout gets the stored b, *at its position (the order met). */
static int ps_put_at(pairset_t *s, const void *a, const void *b, const void **bout, size_t *pos) {
  pair_t key = {a, b};
  uint64_t h = pair_hash(s, a, b);
  size_t j, at = dp__table_find(&s->t, DP_TABLE_TAGGED, h, ps_eq, s, &key, &j);
  if (at != DP_TABLE_NONE) {
    if (bout) *bout = s->pairs[at].b;
    if (pos) *pos = at;
    return 1;
  }
  size_t n = s->t.count;
  if (pos) *pos = n;
  if (dp__grow((void **)&s->pairs, &s->cap, n + 1, sizeof(pair_t)) != 0) return DP_ENOMEM;
  if (dp__table_full(&s->t)) {
    if (dp__table_grow(&s->t, DP_TABLE_TAGGED, n, 64, ps_hash_at, s) != 0) return DP_ENOMEM;
    j = dp__table_empty_slot(&s->t, DP_TABLE_TAGGED, h);
  }
  s->pairs[n] = key;
  dp__table_put(&s->t, DP_TABLE_TAGGED, j, h, n);
  return 0;
}

static int ps_put(pairset_t *s, const void *a, const void *b, const void **bout) {
  return ps_put_at(s, a, b, bout, NULL);
}

/* Whether (a, b) — or, keyed on a only, a — is in the set. */
static int ps_has(pairset_t *s, const void *a, const void *b) {
  pair_t key = {a, b};
  size_t j;
  return dp__table_find(&s->t, DP_TABLE_TAGGED, pair_hash(s, a, b), ps_eq, s, &key, &j) != DP_TABLE_NONE;
}

static void ps_free(pairset_t *s) {
  dp__table_destroy(&s->t, DP_TABLE_TAGGED);
  dp__free(s->pairs, s->cap * sizeof(pair_t));
}

/* Without sharing, the nodes assumed equal so far form classes (Hopcroft
 * and Karp's union-find over both graphs): a pair whose nodes are already
 * in one class is not walked again, and each pair walked joins two classes,
 * so a comparison walks each node's children a bounded number of times
 * whatever the shape — two cycles of coprime lengths p and q met p * q
 * pairs when pairs were remembered one by one. A node is entered there once
 * the walk has passed a shared node (count above one) on either side: below
 * only unshared nodes, a node has one way in and its pair is met once, so
 * trees are compared without the table. */
typedef struct frame {
  dp_value_t a, b;
  int shared;          /* a shared node lies on the way to this pair */
} frame_t;

typedef struct eq {
  frame_t *stack;
  size_t top, cap;
  int shared;          /* the pair being expanded lies below a shared node */
  pairset_t seen;      /* without sharing: node -> parent position (union-find) */
  pairset_t ab, ba;    /* with sharing: the node bijection */
  pairset_t keys;      /* dict keys found equal (key_same) */
  int keys_rc;         /* its failure, or 0 */
  unsigned flags;
} eq_t;

static int eq_push(eq_t *e, dp_value_t a, dp_value_t b) {
  if (dp__grow((void **)&e->stack, &e->cap, e->top + 1, sizeof(frame_t)) != 0) return DP_ENOMEM;
  e->stack[e->top++] = (frame_t){a, b, e->shared};
  return 0;
}

/* The class of node h: its position in e->seen, entered as a class of its
 * own when new; each entry's b is its parent's position. */
static int uf_node(pairset_t *s, const void *h, size_t *pos) {
  int rc = ps_put_at(s, h, NULL, NULL, pos);
  if (rc == 0) s->pairs[*pos].b = (const void *)(uintptr_t)*pos;
  return rc < 0 ? rc : 0;
}

static size_t uf_root(pairset_t *s, size_t i) {
  for (;;) {
    size_t p = (size_t)(uintptr_t)s->pairs[i].b;
    if (p == i) return i;
    size_t g = (size_t)(uintptr_t)s->pairs[p].b;
    s->pairs[i].b = (const void *)(uintptr_t)g; /* path halving */
    i = g;
  }
}

/* 1: same node or already matched (skip), 0: go on, <0 error, 2: unequal. */
static int eq_memo(eq_t *e, dp_value_t a, dp_value_t b) {
  const void *ha = a.u.h, *hb = b.u.h;
  if (e->flags & DP_EQ_SHARING) {
    const void *ma = NULL, *mb = NULL;
    int fa = ps_put(&e->ab, ha, hb, &ma);
    if (fa < 0) return fa;
    int fb = ps_put(&e->ba, hb, ha, &mb);
    if (fb < 0) return fb;
    if (fa != fb) return 2;
    if (fa == 1) return (ma == hb && mb == ha) ? 1 : 2;
    return 0;
  }
  if (ha == hb) return 1;
  if (!e->shared && dp__rc(a.u.h) == 1 && dp__rc(b.u.h) == 1) return 0;
  e->shared = 1;
  size_t ia, ib;
  int rc = uf_node(&e->seen, ha, &ia);
  if (rc == 0) rc = uf_node(&e->seen, hb, &ib);
  if (rc < 0) return rc;
  ia = uf_root(&e->seen, ia);
  ib = uf_root(&e->seen, ib);
  if (ia == ib) return 1;
  e->seen.pairs[ia].b = (const void *)(uintptr_t)ib;
  return 0;
}

static int tensor_equal(dp_tensor_t *x, dp_tensor_t *y) {
  return x->storage->base == y->storage->base && dp_device_equal(x->storage->device, y->storage->device) &&
         x->storage->nbytes == y->storage->nbytes && x->dtype == y->dtype && x->ndim == y->ndim &&
         x->offset == y->offset && memcmp(x->dims, y->dims, 2 * (size_t)x->ndim * sizeof(int64_t)) == 0;
}

/* Dict keys, compared while a dict's entries are matched with the other's:
 * a pair of keys found equal is remembered when either is shared, so that
 * keys shared by many dicts — a long str, a tuple, or a tuple holding one —
 * are compared once, not once a dict (10,000 dicts keyed by one 100 kB str
 * compared 1 GB). Keys are bounded, acyclic trees (value.h): a pair enters
 * the set once found equal, with no assumption to undo. Hash-equal keys that
 * differ are found by what they keep (dp__key_kept_differ) or compared. */
static int key_same(void *ctx, dp_value_t a, dp_value_t b) {
  eq_t *e = ctx;
  if (e->keys_rc || a.kind != b.kind) return 0;
  if (a.kind < DP_STR) return dp__leaf_equal(a, b);
  if (a.u.h == b.u.h) return 1;
  if (dp__key_kept_differ(a, b)) return 0;
  int shared = dp__rc(a.u.h) > 1 || dp__rc(b.u.h) > 1;
  if (shared && ps_has(&e->keys, a.u.h, b.u.h)) return 1;
  dp__key_nodes_walked++;
  int same;
  if (a.kind == DP_TUPLE) {
    dp_seq_t *x = DP_SEQ(a), *y = DP_SEQ(b);
    same = x->len == y->len;
    for (size_t i = 0; same && i < x->len; i++) same = key_same(e, x->items[i], y->items[i]);
  } else {
    dp__key_bytes_compared += DP_STROBJ(a)->len;
    same = dp__leaf_equal(a, b);
  }
  if (same && shared) {
    int rc = ps_put(&e->keys, a.u.h, b.u.h, NULL);
    if (rc < 0) e->keys_rc = rc;
  }
  return same && !e->keys_rc;
}

_Thread_local uint64_t dp__eq_pairs_walked;

static int eq_step(eq_t *e, dp_value_t a, dp_value_t b) {
  if (a.kind != b.kind) return 2;
  if (a.kind < DP_STR) return dp__leaf_equal(a, b) ? 0 : 2;
  dp__eq_pairs_walked++;
  int m = eq_memo(e, a, b);
  if (m != 0) return m == 1 ? 0 : m;
  switch (a.kind) {
    case DP_STR:
    case DP_BYTES:
      return dp__leaf_equal(a, b) ? 0 : 2;
    case DP_TENSOR:
      return tensor_equal(DP_TENSOR(a), DP_TENSOR(b)) ? 0 : 2;
    case DP_CUSTOM:
      return a.u.h == b.u.h ? 0 : 2;
    case DP_LIST:
    case DP_TUPLE: {
      dp_seq_t *x = DP_SEQ(a), *y = DP_SEQ(b);
      if (x->len != y->len) return 2;
      for (size_t i = x->len; i-- > 0;)
        if (eq_push(e, x->items[i], y->items[i]) != 0) return DP_ENOMEM;
      return 0;
    }
    case DP_DICT: {
      dp_dict_t *x = DP_DICT(a);
      if (x->len != DP_DICT(b)->len) return 2;
      for (size_t i = 0; i < x->len; i++) {
        /* whatever the order of insertion */
        size_t at = dp__dict_find_with(b, x->entries[i].key, key_same, e);
        if (e->keys_rc) return e->keys_rc;
        if (at == SIZE_MAX) return 2;
        const dp_entry_t *o = &DP_DICT(b)->entries[at];
        if ((e->flags & DP_EQ_SHARING) && eq_push(e, x->entries[i].key, o->key) != 0) return DP_ENOMEM;
        if (eq_push(e, x->entries[i].val, o->val) != 0) return DP_ENOMEM;
      }
      return 0;
    }
    case DP_OBJECT: {
      dp_object_t *x = DP_OBJ(a), *y = DP_OBJ(b);
      if (x->len != y->len || x->class_len != y->class_len || memcmp(x->class_name, y->class_name, x->class_len) ||
          (x->c.h.flags & DP_HEAP_REDUCED) != (y->c.h.flags & DP_HEAP_REDUCED))
        return 2;
      for (size_t i = 0; i < x->len; i++) {
        dp_value_t other;
        if (dp_object_get(b, dp__attr_name(&x->attrs[i]), &other, NULL) != 0) return 2;
        if (eq_push(e, x->attrs[i].val, other) != 0) return DP_ENOMEM;
      }
      return 0;
    }
  }
  return 2;
}

int dp_value_equal(dp_value_t a, dp_value_t b, unsigned flags, dp_error_t *err) {
  if (flags & ~DP_EQ_SHARING)
    return dp__err(err, DP_EINVAL, "dp_value_equal: unknown flags 0x%x (DP_EQ_SHARING is the only one, 0x%x)",
                   flags & ~DP_EQ_SHARING, DP_EQ_SHARING);
  eq_t e;
  memset(&e, 0, sizeof e);
  e.flags = flags;
  ps_init(&e.seen, 1);
  ps_init(&e.ab, 1);
  ps_init(&e.ba, 1);
  ps_init(&e.keys, 0);
  int rc = eq_step(&e, a, b);
  while (rc == 0 && e.top > 0) {
    frame_t f = e.stack[--e.top];
    e.shared = f.shared;
    rc = eq_step(&e, f.a, f.b);
  }
  dp__free(e.stack, e.cap * sizeof(frame_t));
  ps_free(&e.seen);
  ps_free(&e.ab);
  ps_free(&e.ba);
  ps_free(&e.keys);
  if (rc < 0) return dp__err(err, rc, "out of memory comparing values (the comparison's %s)",
                             e.keys_rc ? "pairs of equal dict keys" : flags & DP_EQ_SHARING ? "node bijection"
                                                                                         : "stack and node classes");
  return rc == 0 ? 1 : 0;
}

/* The hash is the one the dict keys use (dp__hash_value, value.c), cut at
 * a depth and a node budget so that it terminates on cycles and stays cheap
 * on huge values. */
#define HASH_DEPTH 12
#define HASH_BUDGET 256

uint64_t dp_value_hash(dp_value_t v) {
  size_t budget = HASH_BUDGET;
  return dp__hash_value(v, 0, HASH_DEPTH, &budget);
}
