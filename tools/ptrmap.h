/* tools/ptrmap.h — the CLI's map from an address (a node's, a storage's) to
 * a dense index: 0, 1, ... in the order the addresses were added, so that
 * an owner keeps what it needs of each in arrays of its own. It is the
 * library's table (core/table.h), hashing with its per-process secret: one
 * mechanism for every lookup, in the CLI as in the library. The addresses
 * are the library's allocations, which an input only steers. Not
 * thread-safe: a map is one owner's (the CLI is one thread). */
#ifndef DP_TOOLS_PTRMAP_H
#define DP_TOOLS_PTRMAP_H

#include <stdint.h>
#include <stdlib.h>

#include "../core/table.h"

typedef struct ptrmap {
  dp__table_t t;
  const void **keys; /* keys[k]: the address of index k */
  size_t cap;
} ptrmap_t;

static inline void ptrmap_init(ptrmap_t *m) {
  dp__table_init(&m->t);
  m->keys = NULL;
  m->cap = 0;
}

static inline size_t ptrmap_count(const ptrmap_t *m) { return m->t.count; }

static inline int ptrmap_eq_(const void *ctx, size_t k, const void *key) {
  return ((const void *const *)ctx)[k] == key;
}
static inline uint64_t ptrmap_hash_at_(const void *ctx, size_t k) {
  return dp__hash_ptr(((const void *const *)ctx)[k]);
}

/* The index of key, or SIZE_MAX if it was never added. */
static inline size_t ptrmap_find(const ptrmap_t *m, const void *key) {
  size_t slot, at = dp__table_find(&m->t, DP_TABLE_PLAIN, dp__hash_ptr(key), ptrmap_eq_, m->keys, key, &slot);
  return at == DP_TABLE_NONE ? SIZE_MAX : at;
}

/* The index of key, which gets the next one if it was not there (*added,
 * when not NULL, says whether it was added). SIZE_MAX when out of memory:
 * the map is as it was. */
static inline size_t ptrmap_add(ptrmap_t *m, const void *key, int *added) {
  uint64_t h = dp__hash_ptr(key);
  size_t slot, at = dp__table_find(&m->t, DP_TABLE_PLAIN, h, ptrmap_eq_, m->keys, key, &slot);
  if (added) *added = at == DP_TABLE_NONE;
  if (at != DP_TABLE_NONE) return at;
  size_t n = m->t.count;
  if (n == m->cap) {
    size_t ncap = m->cap ? 2 * m->cap : 64;
    const void **nk = realloc(m->keys, ncap * sizeof *nk);
    if (!nk) return SIZE_MAX;
    m->keys = nk;
    m->cap = ncap;
  }
  if (dp__table_full(&m->t)) {
    if (dp__table_grow(&m->t, DP_TABLE_PLAIN, n, 0, ptrmap_hash_at_, m->keys) != 0) return SIZE_MAX;
    slot = dp__table_empty_slot(&m->t, DP_TABLE_PLAIN, h);
  }
  m->keys[n] = key;
  dp__table_put(&m->t, DP_TABLE_PLAIN, slot, h, n);
  return n;
}

static inline void ptrmap_free(ptrmap_t *m) {
  dp__table_destroy(&m->t, DP_TABLE_PLAIN);
  free(m->keys);
  ptrmap_init(m);
}

#endif
