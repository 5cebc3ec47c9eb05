/* pickler/ptrset_impl.h — the pointer set's layout and its hot path, inline
 * so that the walker can pipeline inserts (see walk.c). */
#ifndef DP_PICKLER_PTRSET_IMPL_H
#define DP_PICKLER_PTRSET_IMPL_H
#define XXH_INLINE_ALL
#include <xxhash.h>

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

/* A slot holds the entry index and 16 bits of the hash, so that probing
 * past other keys rarely touches the entries array. Slots from an older
 * generation are empty: clearing is one increment. */
typedef struct dp__pslot {
  uint32_t entry;  /* entry + 1 */
  uint16_t gen;
  uint16_t tag;
} dp__pslot_t;

typedef struct dp__pgroup {
  dp_device_t device;
  uint32_t count;
  uint32_t head, tail;
} dp__pgroup_t;

struct dp_ptrset {
  dp__pentry_t *entries;
  size_t count, cap;
  dp__pslot_t *slots;
  size_t nslots;   /* power of two, at least twice count */
  uint16_t gen;
  dp__pgroup_t *groups;
  size_t ngroups, groups_cap;
  size_t last_group;
  dp__arena_t paths;    /* entries' paths; kept across clears */
  dp__walker_t walker;  /* reused by dp_scan */
};

static inline uint64_t dp__ptr_hash(dp_device_t d, const void *base) {
  uint64_t k = (uint64_t)(uintptr_t)base;
  return XXH3_64bits_withSeed(&k, sizeof k, ((uint64_t)d.type << 8) | d.index);
}

static inline void dp__ptrset_prefetch(const dp_ptrset_t *s, uint64_t h) {
  if (s->nslots) __builtin_prefetch(&s->slots[h & (s->nslots - 1)], 1);
}

/* Slow path: grow, add a device group, append the entry. `slot` is the
 * empty slot the lookup stopped at (SIZE_MAX if none was probed). */
int dp__ptrset_insert_new(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes, uint64_t h,
                          size_t slot, size_t *index);

/* Finds (device, base) given its hash or adds it; counts one more tensor. */
static inline __attribute__((always_inline)) int dp__ptrset_add_hashed(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes,
                                        uint64_t h, size_t *index, int *is_new) {
  size_t j = SIZE_MAX;
  if (DP_LIKELY(s->nslots)) {
    size_t mask = s->nslots - 1;
    uint16_t tag = (uint16_t)(h >> 48);
    for (j = h & mask;; j = (j + 1) & mask) {
      dp__pslot_t *sl = &s->slots[j];
      if (sl->gen != s->gen || sl->entry == 0) break;
      if (sl->tag != tag) continue;
      dp__pentry_t *e = &s->entries[sl->entry - 1];
      if (e->base == base && dp_device_equal(e->device, device)) {
        e->refs++;
        if (nbytes > e->nbytes) e->nbytes = nbytes;
        *index = sl->entry - 1;
        *is_new = 0;
        return 0;
      }
    }
  }
  *is_new = 1;
  /* Fast path: room everywhere and the same device as the last insert. */
  if (DP_LIKELY(j != SIZE_MAX && (s->count + 1) * 2 <= s->nslots && s->count < s->cap &&
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
    s->slots[j] = (dp__pslot_t){(uint32_t)(i + 1), s->gen, (uint16_t)(h >> 48)};
    *index = i;
    return 0;
  }
  return dp__ptrset_insert_new(s, device, base, nbytes, h, j, index);
}
#endif
