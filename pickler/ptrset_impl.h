/* pickler/ptrset_impl.h — the pointer set's layout and its hot path, inline
 * so that the walker can pipeline inserts (see walk.c). The set knows
 * nothing of the walker: walk.c stands on this file, never the reverse. */
#ifndef DP_PICKLER_PTRSET_IMPL_H
#define DP_PICKLER_PTRSET_IMPL_H
#include "internal.h"
#include "ptrs.h"

/* A bump arena of strings: chunks kept across resets, so that refilling it
 * with what it held before allocates nothing. */
typedef struct dp__achunk {
  struct dp__achunk *next;
  size_t cap;
  char data[];
} dp__achunk_t;

typedef struct dp__arena {
  dp__achunk_t *head, *cur;  /* cur: the chunk being filled (NULL: none yet) */
  size_t used;               /* bytes used in cur */
} dp__arena_t;

/* A copy of s[0..n) plus a NUL in the arena, or NULL. */
char *dp__arena_strdup(dp__arena_t *a, const char *s, size_t n);
void dp__arena_reset(dp__arena_t *a);
void dp__arena_free(dp__arena_t *a);

/* An entry but its base: the set keeps bases and the rest in two arrays of
 * one block, laid out as a frozen record's (ptrs.h), so that a completion
 * takes the block as its record instead of copying it (dp__ptrs_freeze). */
typedef dp__ptrs_rest_t dp__pentry_t;

typedef struct dp__pgroup {
  dp_device_t device;
  uint32_t count;
  uint32_t head, tail;
} dp__pgroup_t;

struct dp_ptrset {
  void *block;          /* bases[cap], rest[cap], then DP__PTRS_TAIL bytes (ptrs.h) */
  size_t block_size;
  void **bases;         /* count, discovery order */
  dp__pentry_t *rest;   /* count, discovery order */
  size_t count, cap;
  int sized;            /* the block was sized for a record (ptrs.c), not grown */
  /* Raw (dp__ptrset_set_raw): entries are appended, never looked up in
   * the table (left empty), so an allocation met again is a new entry
   * unless it comes right after itself; only the walk of a completion
   * fills a raw set, and only the future reads it (ptrs.h). */
  int raw;
  dp__table_t tab;      /* (device, base) -> entry; tagged, cleared by generation */
  /* next entry on the same device + 1, or 0: written only once the set has
   * met a second device (NULL before; next_cap entries) */
  uint32_t *next_on;
  size_t next_cap;
  dp__pgroup_t *groups;
  size_t ngroups, groups_cap;
  size_t last_group;
  char **paths;         /* paths[i] for i < npaths; NULL past it */
  size_t npaths, paths_cap;
  dp__arena_t paths_arena; /* the paths' text; kept across clears */
  /* Scratch memory that a user of the set keeps with it between uses (a
   * scan keeps its walker here, walk.c): opaque to the set, which only
   * frees it, with scratch_free, when the set is freed. */
  void *scratch;
  void (*scratch_free)(void *scratch);
};

/* Keyed with the process's secret: bases a frame or a caller chose to
 * collide under a known hash do not collide here. The key of a device is
 * derived once (dp__hash_u64_key); a scan derives it once per batch.
 *
 * Why not a lighter keyed mix. Bases come from untrusted frames, so the
 * mix must spread every input bit into the slot index: a keyed multiply
 * then xorshift, ((x ^ k) * C) ^ (... >> 32), does not — bases differing
 * only in bits 48..63 give products differing only there, and after the
 * shift the low 16 bits (the slot in tables up to 65,536 slots) are equal
 * whatever k is. splitmix64's finalizer of x ^ k (dp__hash_ptr, for local
 * addresses) would do, but costs what XXH3's 8-byte path costs once its
 * key is hoisted (two multiplies, a few shifts): keeping XXH3 keeps the
 * hash bit for bit, and the flooding tests built on it. */
static inline __attribute__((always_inline)) uint64_t dp__ptr_salt(dp_device_t d) {
  return ((uint64_t)d.type << 8) | d.index;
}
static inline __attribute__((always_inline)) uint64_t dp__ptr_key(dp_device_t d) {
  return dp__hash_u64_key(dp__ptr_salt(d));
}
static inline __attribute__((always_inline)) uint64_t dp__ptr_hash_keyed(const void *base, uint64_t key) {
  return dp__hash_u64_keyed((uint64_t)(uintptr_t)base, key);
}
static inline __attribute__((always_inline)) uint64_t dp__ptr_hash(dp_device_t d, const void *base) {
  return dp__ptr_hash_keyed(base, dp__ptr_key(d));
}

static inline void dp__ptrset_prefetch(const dp_ptrset_t *s, uint64_t h) {
  dp__table_prefetch(&s->tab, DP_TABLE_TAGGED, h);
}

/* A device as one 16-bit number: compared in one instruction. */
_Static_assert(sizeof(dp_device_t) == 2, "a device is two bytes");
static inline __attribute__((always_inline)) uint16_t dp__dev_bits(dp_device_t d) {
  uint16_t x;
  memcpy(&x, &d, sizeof x);
  return x;
}

typedef struct dp__pkey {
  const void *base;
  dp_device_t device;
} dp__pkey_t;

static inline __attribute__((always_inline)) int dp__ptrset_eq(const void *ctx, size_t i, const void *key) {
  const dp_ptrset_t *s = ctx;
  const dp__pkey_t *k = key;
  return s->bases[i] == k->base && dp__dev_bits(s->rest[i].device) == dp__dev_bits(k->device);
}

/* The one way an entry is added: appended as entry `count` (its index
 * stored in `id`: bases[id], rest[id]), in group g (its entry count
 * `gcount`, its last entry `gtail`), linked after that last entry when
 * `chained`, and put in the table *tab at slot j (hash h). Room has been
 * made. Each device's entries are chained in order (next_on); while the set
 * has one device the chain is entries 0, 1, 2, ... and is not written
 * (chained is 0, next_on may be NULL: ptrset.c links it when a second device
 * comes). A group's first entry is its head: the caller sets it (chained is
 * then 0).
 * A macro over lvalues, not a function over pointers: the batch loop
 * (dp__ptrset_add_batch) passes locals that must stay in registers, and
 * pointers to them cost its loop 3 % (the compiler then keeps the table and
 * the entries in memory). */
#define DP__PENTRY_PUSH(raw_, id, bases, rest, next_on, count, tab, g, gcount, gtail, chained, device_, base_, nbytes_, h, j) \
  do {                                                                                                   \
    (id) = (count)++;                                                                                    \
    (bases)[id] = (base_);                                                                               \
    (rest)[id] = (dp__pentry_t){(nbytes_), 1, (device_)};                                                \
    if (chained) {                                                                                       \
      (next_on)[gtail] = (uint32_t)((id) + 1);                                                           \
      (next_on)[id] = 0;                                                                                 \
    }                                                                                                    \
    (gtail) = (uint32_t)(id);                                                                            \
    (gcount)++;                                                                                          \
    if (!raw_) dp__table_put((tab), DP_TABLE_TAGGED, (j), (h), (id));                                   \
  } while (0)

/* Slow path: grow, add a device group, then DP__PENTRY_PUSH. `slot` is the
 * empty slot the lookup stopped at (SIZE_MAX if none was probed). */
int dp__ptrset_insert_new(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes, uint64_t h,
                          size_t slot, size_t *index, dp_error_t *err);

/* Room for n more entries, in the entries and in the table: then n calls
 * of the fast path need no growth. DP_ENOMEM (or DP_ELIMIT) and
 * nothing changed when it cannot be had. */
int dp__ptrset_reserve(dp_ptrset_t *s, size_t n);

/* Records entry index's path (a copy, in the set's arena). DP_ENOMEM. */
int dp__ptrset_set_path(dp_ptrset_t *set, size_t index, const char *path);

/* Adds the storages of a scan's batch of tensors (their copies of base,
 * size and device), hashes h (dp__ptr_hash), in order, with room reserved
 * for n (dp__ptrset_reserve); bit i of `again` marks st[i] as on the base
 * and device of st[i - 1] (the same entry, no probe; its size kept if
 * larger). Fails (DP_ENOMEM) only where a
 * new device needs a group. */
int dp__ptrset_add_batch(dp_ptrset_t *s, struct dp_tensor *const *st, const uint64_t *h, uint64_t again, int n,
                         dp_error_t *err);

/* One more tensor on an entry: the count stays at UINT32_MAX once there
 * (as dp__ptrset_add_refs does), never wraps to a small number. */
static inline __attribute__((always_inline)) void dp__refs_inc(uint32_t *refs) { *refs += *refs != UINT32_MAX; }
/* One more tensor on entry e, of nbytes: counted, the larger size kept (a
 * batch's tensor on the base and device of the one before it). */
static inline __attribute__((always_inline)) void dp__pentry_again(dp__pentry_t *e, size_t nbytes) {
  dp__refs_inc(&e->refs);
  if (nbytes > e->nbytes) e->nbytes = nbytes;
}

/* In a raw set: the last entry when it is (device, base) (it then counts
 * one more tensor), else DP_TABLE_NONE (a new entry, whatever came before). */
static inline __attribute__((always_inline)) size_t dp__ptrset_raw_last(const dp_ptrset_t *s, size_t count,
                                                                       const dp__pkey_t *key) {
  return count && dp__ptrset_eq(s, count - 1, key) ? count - 1 : DP_TABLE_NONE;
}

/* Finds (device, base) given its hash or adds it; counts one more tensor. */
static inline __attribute__((always_inline)) int dp__ptrset_add_hashed(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes,
                                        uint64_t h, size_t *index, int *is_new, dp_error_t *err) {
  dp__pkey_t key = {base, device};
  size_t j = SIZE_MAX,
         at = s->raw ? dp__ptrset_raw_last(s, s->count, &key) : dp__table_find(&s->tab, DP_TABLE_TAGGED, h, dp__ptrset_eq, s, &key, &j);
  if (at != DP_TABLE_NONE) {
    dp__pentry_t *e = &s->rest[at];
    dp__refs_inc(&e->refs);
    if (nbytes > e->nbytes) e->nbytes = nbytes;
    *index = at;
    *is_new = 0;
    return 0;
  }
  *is_new = 1;
  /* Fast path: room everywhere and the same device as the last insert. */
  if (DP_LIKELY((s->raw || (j != SIZE_MAX && !dp__table_full(&s->tab))) && s->count < s->cap &&
                s->last_group < s->ngroups && dp__dev_bits(s->groups[s->last_group].device) == dp__dev_bits(device))) {
    dp__pgroup_t *gr = &s->groups[s->last_group];
    DP__PENTRY_PUSH(s->raw, *index, s->bases, s->rest, s->next_on, s->count, &s->tab, s->last_group, gr->count, gr->tail,
                    s->ngroups > 1, device, base, nbytes, h, j);
    return 0;
  }
  return dp__ptrset_insert_new(s, device, base, nbytes, h, j, index, err);
}
#endif
