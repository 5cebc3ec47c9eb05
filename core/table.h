/* core/table.h — the one open-addressing hash table behind every lookup
 * keyed by data: the pointer set, the walker's memo, equality's pair maps,
 * the dict and object indexes and the caching allocator's block map.
 *
 * Layout. A table maps a 64-bit hash to an item: a position in an array the
 * owner keeps (entries in discovery or insertion order), so that the items
 * of a table are always 0 .. count-1. A slot holds item + 1 (0: empty).
 * Linear probing from hash & (nslots - 1), load at most 1/2, power-of-two
 * sizes; growing rebuilds from the items in their order. Two slot layouts:
 *
 *   DP_TABLE_TAGGED  8 bytes {ref, gen, tag}: 16 bits of the hash, so that
 *                    probing past other keys rarely touches the items, and
 *                    a generation, so that clearing is one increment (slots
 *                    of another generation are empty; when the 16-bit
 *                    counter wraps, the slots are zeroed).
 *   DP_TABLE_PLAIN   4 bytes {ref}: one per dict and object, kept small.
 *
 * The layout is a constant at every call: the inline functions below are
 * compiled once per table, with the owner's equality inlined.
 *
 * Hashing. Every hash of a key that a frame, a caller or an allocator can
 * choose is keyed with a per-process secret (dp__hash_secret, base.c), so
 * that keys found to collide in one process do not collide in another: no
 * input can force long probe sequences ("hash flooding"). Nothing that must
 * be deterministic depends on the secret: items keep their owner's order
 * and nothing is ever listed in slot order.
 */
#ifndef DP_CORE_TABLE_H
#define DP_CORE_TABLE_H
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "internal.h"

/* ---- the per-process secret ---- */

/* hidden: read without going through the GOT. 0 until drawn. */
extern __attribute__((visibility("hidden"))) _Atomic uint64_t dp__g_hash_secret;
uint64_t dp__hash_secret_slow(void);

/* The secret every hash is keyed with: random (getrandom) once per process,
 * never 0 unless a test forces it (then every call takes the slow path).
 * Relaxed: the secret is the only thing published. */
static inline __attribute__((always_inline)) uint64_t dp__hash_secret(void) {
  uint64_t s = dp__load_relaxed(&dp__g_hash_secret);
  return DP_LIKELY(s != 0) ? s : dp__hash_secret_slow();
}

/* Test hook: replaces the secret. Only before any table or hashed value
 * exists (their hashes were taken with the old one). */
void dp__hash_secret_set(uint64_t secret);

/* Keyed hashes of data — 8 bytes (integers, buffer bases from a frame) and
 * byte strings: XXH3 seeded with the secret. `salt` separates key kinds (a
 * device, a value kind); with the secret 0 these are the fixed-seed hashes
 * the library used before (the tests build their collisions that way). */
static inline __attribute__((always_inline)) uint64_t dp__hash_u64(uint64_t x, uint64_t salt) {
  return XXH3_64bits_withSeed(&x, sizeof x, dp__hash_secret() ^ salt);
}
/* dp__hash_u64 in two steps, for loops hashing many keys of one salt: the
 * key that XXH3 derives from its seed for 4- to 8-byte inputs, computed once,
 * then each input with it. dp__hash_u64_keyed(x, dp__hash_u64_key(salt)) is
 * dp__hash_u64(x, salt), bit for bit (XXH3_64bits_withSeed's path for 8
 * bytes spelled out; the table suite checks it): the same keyed hash, minus
 * deriving the key and reading the secret for every input. */
static inline __attribute__((always_inline)) uint64_t dp__hash_u64_key(uint64_t salt) {
  uint64_t seed = dp__hash_secret() ^ salt;
  seed ^= (uint64_t)XXH_swap32((uint32_t)seed) << 32;
  return (XXH_readLE64(XXH3_kSecret + 8) ^ XXH_readLE64(XXH3_kSecret + 16)) - seed;
}
static inline __attribute__((always_inline)) uint64_t dp__hash_u64_keyed(uint64_t x, uint64_t key) {
  if (!XXH_CPU_LITTLE_ENDIAN) x = XXH_swap64(x);  /* XXH3 reads the bytes little-endian */
  return XXH3_rrmxmx(((x << 32) | (x >> 32)) ^ key, 8);
}
static inline uint64_t dp__hash_bytes(const void *p, size_t n, uint64_t salt) {
  return XXH3_64bits_withSeed(p, n, dp__hash_secret() ^ salt);
}

/* Keyed hash of a local address (the memo, equality's node maps, the
 * allocator's blocks): the allocator picks those, an input only steers it,
 * so a lighter full-avalanche mix (splitmix64's finalizer) of the address
 * xor the secret does, at half XXH3's instructions on the walk's path. */
static inline __attribute__((always_inline)) uint64_t dp__hash_ptr(const void *p) {
  uint64_t z = (uint64_t)(uintptr_t)p ^ dp__hash_secret();
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* ---- the table ---- */

enum { DP_TABLE_PLAIN = 0, DP_TABLE_TAGGED = 1 };
#define DP_TABLE_NONE SIZE_MAX

typedef struct dp__tslot {
  uint32_t ref;  /* item + 1; 0: empty */
  uint16_t gen;
  uint16_t tag;  /* hash >> 48 */
} dp__tslot_t;

typedef struct dp__table {
  void *slots;    /* dp__tslot_t or uint32_t [nslots]; NULL until first grown */
  size_t nslots;  /* 0 or a power of two, at least 2 * count */
  size_t count;   /* items 0 .. count-1 are in the table */
  uint16_t gen;   /* tagged: the live generation, never 0 */
} dp__table_t;

/* Whether item i equals key; the hash of item i (to rebuild and delete). */
typedef int (*dp__table_eq_fn)(const void *ctx, size_t i, const void *key);
typedef uint64_t (*dp__table_hash_fn)(const void *ctx, size_t i);

#define DP_TABLE_INLINE static inline __attribute__((always_inline))

DP_TABLE_INLINE void dp__table_init(dp__table_t *t) {
  t->slots = NULL;
  t->nslots = 0;
  t->count = 0;
  t->gen = 1;
}

DP_TABLE_INLINE size_t dp__table_slot_size(int kind) {
  return kind == DP_TABLE_TAGGED ? sizeof(dp__tslot_t) : sizeof(uint32_t);
}

/* The item + 1 in slot j, or 0 if it is empty. */
DP_TABLE_INLINE uint32_t dp__table_ref(const dp__table_t *t, int kind, size_t j) {
  if (kind == DP_TABLE_TAGGED) {
    const dp__tslot_t *s = (const dp__tslot_t *)t->slots + j;
    return s->gen == t->gen ? s->ref : 0;
  }
  return ((const uint32_t *)t->slots)[j];
}

/* Start fetching the slot a lookup of h begins at. */
DP_TABLE_INLINE void dp__table_prefetch(const dp__table_t *t, int kind, uint64_t h) {
  if (t->nslots) __builtin_prefetch((const char *)t->slots + (h & (t->nslots - 1)) * dp__table_slot_size(kind), 1);
}

/* The item equal to key (hash h), or DP_TABLE_NONE. *slot receives the slot
 * found, or the empty slot where probing stopped (SIZE_MAX in a table with
 * no slots): dp__table_put fills it, if nothing grows the table between. */
DP_TABLE_INLINE size_t dp__table_find(const dp__table_t *t, int kind, uint64_t h, dp__table_eq_fn eq, const void *ctx,
                                      const void *key, size_t *slot) {
  if (DP_UNLIKELY(!t->nslots)) {
    *slot = SIZE_MAX;
    return DP_TABLE_NONE;
  }
  size_t mask = t->nslots - 1;
  uint16_t tag = (uint16_t)(h >> 48);
  for (size_t j = h & mask;; j = (j + 1) & mask) {
    uint32_t ref;
    if (kind == DP_TABLE_TAGGED) {
      const dp__tslot_t *s = (const dp__tslot_t *)t->slots + j;
      if (s->gen != t->gen || s->ref == 0) {
        *slot = j;
        return DP_TABLE_NONE;
      }
      if (s->tag != tag) continue;
      ref = s->ref;
    } else {
      ref = ((const uint32_t *)t->slots)[j];
      if (ref == 0) {
        *slot = j;
        return DP_TABLE_NONE;
      }
    }
    if (eq(ctx, ref - 1, key)) {
      *slot = j;
      return ref - 1;
    }
  }
}

/* The first empty slot on h's probe sequence (the table has room). */
DP_TABLE_INLINE size_t dp__table_empty_slot(const dp__table_t *t, int kind, uint64_t h) {
  size_t mask = t->nslots - 1, j = h & mask;
  while (dp__table_ref(t, kind, j) != 0) j = (j + 1) & mask;
  return j;
}

/* Whether one more item needs a larger table. */
DP_TABLE_INLINE int dp__table_full(const dp__table_t *t) { return (t->count + 1) * 2 > t->nslots; }

/* Records item `item` (== count: items stay dense) with hash h in `slot`,
 * an empty slot from dp__table_find or dp__table_empty_slot. */
DP_TABLE_INLINE void dp__table_put(dp__table_t *t, int kind, size_t slot, uint64_t h, size_t item) {
  if (kind == DP_TABLE_TAGGED)
    ((dp__tslot_t *)t->slots)[slot] = (dp__tslot_t){(uint32_t)(item + 1), t->gen, (uint16_t)(h >> 48)};
  else
    ((uint32_t *)t->slots)[slot] = (uint32_t)(item + 1);
  t->count++;
}

/* Empties the table, keeping its slots: tagged, one increment. */
DP_TABLE_INLINE void dp__table_clear(dp__table_t *t, int kind) {
  t->count = 0;
  if (!t->slots) return;
  if (kind == DP_TABLE_PLAIN) {
    memset(t->slots, 0, t->nslots * sizeof(uint32_t));
  } else if (++t->gen == 0) {  /* generations wrapped: really clear */
    memset(t->slots, 0, t->nslots * sizeof(dp__tslot_t));
    t->gen = 1;
  }
}

/* Rebuilds the table with items 0 .. nitems-1 (hashes from hash_at, in item
 * order) and room for one more: the fewest slots, a power of two, that is
 * at least min_slots. DP_ELIMIT when items no longer fit 32 bits, DP_ENOMEM
 * (slots whose size would pass SIZE_MAX included). On failure the table is
 * intact. */
int dp__table_grow(dp__table_t *t, int kind, size_t nitems, size_t min_slots, dp__table_hash_fn hash_at,
                   const void *ctx);

/* Removes the item in `slot` (backward-shift deletion: no tombstones). The
 * owner then keeps its items dense, moving its last item into the hole with
 * dp__table_move. hash_at must still answer for every item in the table. */
void dp__table_remove(dp__table_t *t, int kind, size_t slot, dp__table_hash_fn hash_at, const void *ctx);

/* The slot holding item `from` (hash h) now holds item `to`. */
void dp__table_move(dp__table_t *t, int kind, uint64_t h, size_t from, size_t to);

/* Frees the slots: the table is empty, as after dp__table_init. */
void dp__table_destroy(dp__table_t *t, int kind);

/* Test hook: the probes that finding every item takes, in total (each
 * item: its distance from its home slot, plus one). */
size_t dp__table_probes(const dp__table_t *t, int kind, dp__table_hash_fn hash_at, const void *ctx);

#endif
