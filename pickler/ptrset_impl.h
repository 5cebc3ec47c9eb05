/* pickler/ptrset_impl.h — the pointer set's layout and its hot path, inline
 * so that the walker can pipeline inserts (see walk.c). */
#ifndef DP_PICKLER_PTRSET_IMPL_H
#define DP_PICKLER_PTRSET_IMPL_H
#include "table.h"
#include "walk.h"

typedef struct dp__pentry {
  dp_device_t device;
  uint32_t refs;
  void *base;
  size_t nbytes;
  char *path;
  uint32_t next_on;   /* next entry on the same device + 1, or 0 */
  uint32_t group;
} dp__pentry_t;

typedef struct dp__pgroup {
  dp_device_t device;
  uint32_t count;
  uint32_t head, tail;
} dp__pgroup_t;

struct dp_ptrset {
  dp__pentry_t *entries;
  size_t count, cap;
  dp__table_t tab;      /* (device, base) -> entry; tagged, cleared by generation */
  dp__pgroup_t *groups;
  size_t ngroups, groups_cap;
  size_t last_group;
  dp__arena_t paths;    /* entries' paths; kept across clears */
  dp__walker_t walker;  /* reused by dp_scan */
};

/* Keyed with the process's secret: bases a frame or a caller chose to
 * collide under a known hash do not collide here. */
static inline __attribute__((always_inline)) uint64_t dp__ptr_hash(dp_device_t d, const void *base) {
  return dp__hash_u64((uint64_t)(uintptr_t)base, ((uint64_t)d.type << 8) | d.index);
}

static inline void dp__ptrset_prefetch(const dp_ptrset_t *s, uint64_t h) {
  dp__table_prefetch(&s->tab, DP_TABLE_TAGGED, h);
}

typedef struct dp__pkey {
  const void *base;
  dp_device_t device;
} dp__pkey_t;

static inline __attribute__((always_inline)) int dp__ptrset_eq(const void *ctx, size_t i, const void *key) {
  const dp__pentry_t *e = &((const dp_ptrset_t *)ctx)->entries[i];
  const dp__pkey_t *k = key;
  return e->base == k->base && dp_device_equal(e->device, k->device);
}

/* Slow path: grow, add a device group, append the entry. `slot` is the
 * empty slot the lookup stopped at (SIZE_MAX if none was probed). */
int dp__ptrset_insert_new(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes, uint64_t h,
                          size_t slot, size_t *index);

/* Finds (device, base) given its hash or adds it; counts one more tensor. */
static inline __attribute__((always_inline)) int dp__ptrset_add_hashed(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes,
                                        uint64_t h, size_t *index, int *is_new) {
  dp__pkey_t key = {base, device};
  size_t j, at = dp__table_find(&s->tab, DP_TABLE_TAGGED, h, dp__ptrset_eq, s, &key, &j);
  if (at != DP_TABLE_NONE) {
    dp__pentry_t *e = &s->entries[at];
    e->refs++;
    if (nbytes > e->nbytes) e->nbytes = nbytes;
    *index = at;
    *is_new = 0;
    return 0;
  }
  *is_new = 1;
  /* Fast path: room everywhere and the same device as the last insert. */
  if (DP_LIKELY(j != SIZE_MAX && !dp__table_full(&s->tab) && s->count < s->cap &&
                s->last_group < s->ngroups && dp_device_equal(s->groups[s->last_group].device, device))) {
    size_t i = s->count++;
    dp__pgroup_t *gr = &s->groups[s->last_group];
    dp__pentry_t *e = &s->entries[i];
    e->device = device;
    e->refs = 1;
    e->base = base;
    e->nbytes = nbytes;
    e->path = NULL;
    e->next_on = 0;
    e->group = (uint32_t)s->last_group;
    if (gr->count++ == 0) gr->head = (uint32_t)i;
    else s->entries[gr->tail].next_on = (uint32_t)(i + 1);
    gr->tail = (uint32_t)i;
    dp__table_put(&s->tab, DP_TABLE_TAGGED, j, h, i);
    *index = i;
    return 0;
  }
  return dp__ptrset_insert_new(s, device, base, nbytes, h, j, index);
}
#endif
