/* tools/ptrmap.h — the CLI's map from an address (a node's, a storage's) to
 * a dense index: 0, 1, ... in the order the addresses were added, with
 * vsize bytes of the owner's beside each (ptrmap_val). It is the
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
  char *vals;        /* the owner's vsize bytes of index k at vals + k * vsize */
  size_t vsize, cap;
} ptrmap_t;

/* An empty map whose entries carry vsize bytes each (0: a set). A map
 * zeroed whole is an empty set too. */
static inline void ptrmap_init(ptrmap_t *m, size_t vsize) {
  dp__table_init(&m->t);
  m->keys = NULL;
  m->vals = NULL;
  m->vsize = vsize;
  m->cap = 0;
}

/* Index k's bytes (k < ptrmap_count): valid until the next ptrmap_add. */
static inline void *ptrmap_val(const ptrmap_t *m, size_t k) { return m->vals + k * m->vsize; }

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
 * when not NULL, says whether it was added; a new entry's bytes are
 * zero). SIZE_MAX when out of memory: the map is as it was. */
static inline size_t ptrmap_add(ptrmap_t *m, const void *key, int *added) {
  uint64_t h = dp__hash_ptr(key);
  size_t slot, at = dp__table_find(&m->t, DP_TABLE_PLAIN, h, ptrmap_eq_, m->keys, key, &slot);
  if (added) *added = at == DP_TABLE_NONE;
  if (at != DP_TABLE_NONE) return at;
  size_t n = m->t.count;
  if (n == m->cap) {
    size_t ncap = m->cap ? 2 * m->cap : 64;
    const void **nk = realloc(m->keys, ncap * sizeof *nk);
    if (nk) m->keys = nk;
    char *nv = nk && m->vsize ? realloc(m->vals, ncap * m->vsize) : NULL;
    if (nv) m->vals = nv;
    if (!nk || (m->vsize && !nv)) return SIZE_MAX;
    m->cap = ncap;
  }
  if (dp__table_full(&m->t)) {
    if (dp__table_grow(&m->t, DP_TABLE_PLAIN, n, 0, ptrmap_hash_at_, m->keys) != 0) return SIZE_MAX;
    slot = dp__table_empty_slot(&m->t, DP_TABLE_PLAIN, h);
  }
  m->keys[n] = key;
  if (m->vsize) memset(ptrmap_val(m, n), 0, m->vsize);
  dp__table_put(&m->t, DP_TABLE_PLAIN, slot, h, n);
  return n;
}

static inline void ptrmap_free(ptrmap_t *m) {
  dp__table_destroy(&m->t, DP_TABLE_PLAIN);
  free(m->keys);
  free(m->vals);
  ptrmap_init(m, m->vsize);
}

#endif
