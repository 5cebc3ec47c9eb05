/* cache/cache.c — the stream-ordered caching allocator.
 *
 * Layout. Per device and per stream (a free set: the free blocks tied to
 * that stream, or to none): free blocks of small segments sit in exact-size
 * bins (multiples of 512 bytes up to 2 MiB, a bitmap finds the next
 * non-empty bin), free blocks of large segments in a treap ordered by size
 * and address, searched best-fit in logarithmic time (one list searched
 * whole made n large allocations, each leaving a remainder too small for
 * the next, take time quadratic in n). An allocation on a stream looks in
 * that stream's set and in the stream-less one, never past the blocks of
 * other streams (one set for all made n allocations on one stream, with n
 * blocks of another free, take time quadratic in n); only when neither has
 * a block does it look in every set.
 * Segments are kept sorted by address for interior-pointer lookups; blocks
 * are linked in address order within their segment for split and merge.
 * Allocated blocks are found by pointer through an open-addressing map.
 *
 * Streams. A block carries the stream it was allocated on: freed there it is
 * reusable at once on that stream, because the stream orders the next use
 * after the last. Blocks merge only with free neighbours of the same stream,
 * so that the affinity stays true. Streams added with record_stream hold a
 * freed block pending until one event recorded on each at free time
 * completes.
 */
#include <stdio.h>
#include <string.h>

#include "devpickle/cache.h"
#include "../device/internal.h"
#include "../core/table.h"
#include "../core/treap.h"
#include "internal.h"

#define ROUND 512u
#define SMALL_MAX ((size_t)1 << 20)
#define SMALL_SEGMENT ((size_t)2 << 20)
#define LARGE_ROUND ((size_t)2 << 20)
#define NBINS (SMALL_SEGMENT / ROUND)   /* 4096: sizes 512 .. 2 MiB */

enum { B_FREE, B_USED, B_PENDING };

/* The functions of an allocation and a free start on a cache line of their
 * own: otherwise their placement, and with it the speed of a 4 KiB
 * allocate-free pair, moves by 5-10 % with unrelated code earlier in the
 * file (same instructions, measured with cachegrind). */
#define HOT __attribute__((aligned(64)))

typedef struct segment segment_t;
typedef struct block block_t;

/* A stream recorded as a use of a block, and where the block is in that
 * stream's list of blocks (user_t.ents[at]). */
typedef struct use {
  dp_stream_t *s;
  uint32_t at;
} use_t;

/* What a record_stream lookup reads (ptr, state, stream; nuses and uses
 * when the stream differs) comes first: in one cache line, not two, for a
 * lookup that the record of a large value makes for every allocation. */
struct block {
  char *ptr;
  int state;
  uint32_t nuses;
  dp_stream_t *stream;
  use_t *uses;                   /* record_stream streams */
  uint32_t uses_cap;
  size_t size;
  segment_t *seg;
  struct block *prev, *next;     /* address order in the segment */
  struct block *tprev, *tnext;   /* in use or pending: its stream's set's tied list (beside prev and next: a
                                  * free reads those) */
  union {
    struct {
      struct block *fprev, *fnext; /* small free block: its bin's list; spare struct: fnext */
    };
    dp__treap_node_t tn;           /* large free block: its set's treap */
  };
  struct block *pnext;           /* pending list */
  dp_event_t **events;           /* pending: one per use stream */
  uint32_t nevents, events_cap;
  dp_event_t *drop_ev;           /* its stream's position when its segment was dropped; NULL at any other time
                                  * (a block struct is zeroed when made, and drop_free_segments frees those
                                  * of a segment it keeps) */
};

/* A segment knows the stream its used blocks were allocated on while they
 * share one (one_stream; NULL while none is used, MIXED once two differ or
 * a stream went away), so that a batch of records on that stream — what a
 * completion does for every allocation it made there — skips the lookup of
 * each pointer (hook_record_streams): such a record is a no-op for every
 * used block of the segment, and a pointer into a free block is skipped
 * anyway. */
struct segment {
  char *base;
  size_t size;
  int small;
  int dev;
  uint32_t nused;               /* blocks in use */
  dp_stream_t *one_stream;
  block_t *first;
  struct segment *next_drop;    /* dropped segments, until they are freed */
};

static char mixed_tag;
#define MIXED ((dp_stream_t *)(void *)&mixed_tag)

/* The free blocks of one device tied to one stream (NULL: to none). */
typedef struct freeset {
  dp_stream_t *stream;
  size_t tied;                   /* blocks in use or pending whose stream it is (the rest are in the set) */
  block_t *tied_head;            /* those blocks (tprev/tnext): what the stream's destruction unties */
  uint64_t summary;              /* non-zero bitmap words */
  uint64_t bitmap[NBINS / 64];   /* non-empty bins */
  dp__treap_t large;             /* the free blocks of large segments */
  block_t *bins[NBINS];
} freeset_t;

typedef struct devpool {
  freeset_t **sets;              /* one per stream that allocated here (made by dp_cache_alloc), and none's */
  size_t nsets, sets_cap;
  dp__table_t set_index;         /* sets[] by stream (table.h) */
  freeset_t *none;               /* the set of blocks tied to no stream (also in sets) */
  freeset_t *last;               /* the stream's set found last */
  segment_t **segs;              /* sorted by base */
  size_t nsegs, segs_cap;
  dp_cache_stats_t st;
} devpool_t;

struct dp_cache {
  dp_backend_t *b;
  pthread_mutex_t mu;
  devpool_t *pools;
  int ndev;
  dp__table_t map;               /* allocated blocks by ptr: mapped[] */
  struct mapent *mapped;         /* the allocated blocks, dense */
  size_t mapped_cap;
  block_t *pending_head, *pending_tail;
  block_t *spare;                /* recycled block structs */
  /* The streams recorded as uses of blocks (record_stream), until they are
   * destroyed: with those that allocated (their free sets), the only
   * streams a stream-destroy notice must look for among the blocks. */
  struct user *users;
  size_t nusers, users_cap;
  dp__table_t user_index;        /* users[] by stream (table.h) */
  dp__stream_listener_t gone;    /* the device layer's stream-destroy notice (cold: last) */
  int is_default;                /* dp_cache_default's: dp_cache_free leaves it alone */
};

/* ---- block structs ---- */

static block_t *block_new(dp_cache_t *c) {
  block_t *b = c->spare;
  if (b) c->spare = b->fnext;
  else if (!(b = dp__alloc(sizeof *b))) return NULL;
  memset(b, 0, sizeof *b);
  return b;
}

static void block_recycle(dp_cache_t *c, block_t *b) {
  dp__free(b->uses, b->uses_cap * sizeof *b->uses);
  dp__free(b->events, b->events_cap * sizeof *b->events);
  b->uses = NULL;
  b->events = NULL;
  b->fnext = c->spare;
  c->spare = b;
}

/* ---- the pointer map: a tagged table (table.h) over mapped[] ----
 * Deletion shifts back (no tombstones) and moves the last block into the
 * hole, so that mapped[] stays dense.
 *
 * An entry holds, beside its block, what a record_stream lookup needs: the
 * key and the block's allocation stream (kept equal to b->stream while the
 * block is mapped). A record on the allocation stream — what a completion
 * does for every allocation made on its stream — thus reads a slot and one
 * dense entry, never the block. */
typedef struct mapent {
  char *ptr;
  dp_stream_t *stream;           /* == b->stream */
  block_t *b;
} mapent_t;

/* Keyed (table.h): which pointers come back is up to the caller. */
static uint64_t map_hash_at(const void *ctx, size_t i) {
  return dp__hash_ptr(((const dp_cache_t *)ctx)->mapped[i].ptr);
}

static inline __attribute__((always_inline)) int map_eq(const void *ctx, size_t i, const void *key) {
  return ((const dp_cache_t *)ctx)->mapped[i].ptr == (const char *)key;
}

/* Maps b, allocated for stream s. */
static int map_insert(dp_cache_t *c, block_t *b, dp_stream_t *s) {
  size_t n = c->map.count;
  if (dp__grow((void **)&c->mapped, &c->mapped_cap, n + 1, sizeof *c->mapped) != 0) return DP_ENOMEM;
  if (dp__table_full(&c->map) && dp__table_grow(&c->map, DP_TABLE_TAGGED, n, 256, map_hash_at, c) != 0)
    return DP_ENOMEM;
  uint64_t h = dp__hash_ptr(b->ptr);
  c->mapped[n] = (mapent_t){b->ptr, s, b};
  dp__table_put(&c->map, DP_TABLE_TAGGED, dp__table_empty_slot(&c->map, DP_TABLE_TAGGED, h), h, n);
  return 0;
}

/* The entry of the block allocated at p (hash h), or NULL. */
static inline __attribute__((always_inline)) mapent_t *map_entry(dp_cache_t *c, const void *p, uint64_t h,
                                                                 size_t *slot) {
  size_t j, at = dp__table_find(&c->map, DP_TABLE_TAGGED, h, map_eq, c, p, &j);
  if (at == DP_TABLE_NONE) return NULL;
  if (slot) *slot = j;
  return &c->mapped[at];
}

static block_t *map_find(dp_cache_t *c, const void *p, size_t *slot) {
  mapent_t *e = map_entry(c, p, dp__hash_ptr(p), slot);
  return e ? e->b : NULL;
}

static void map_remove_at(dp_cache_t *c, size_t j) {
  size_t at = dp__table_ref(&c->map, DP_TABLE_TAGGED, j) - 1;
  dp__table_remove(&c->map, DP_TABLE_TAGGED, j, map_hash_at, c);
  size_t last = c->map.count;
  if (at != last) {
    c->mapped[at] = c->mapped[last];
    dp__table_move(&c->map, DP_TABLE_TAGGED, dp__hash_ptr(c->mapped[at].ptr), last, at);
  }
}

/* ---- free lists ---- */

static size_t bin_of(size_t size) { return size / ROUND - 1; }

/* ---- large free blocks: a treap (core/treap.h) keyed by (size, address) ---- */

static inline block_t *large_block(dp__treap_node_t *n) { return n ? DP__TREAP_ENTRY(n, block_t, tn) : NULL; }

static void large_insert(freeset_t *p, block_t *b) { dp__treap_insert(&p->large, &b->tn, b->size, (uintptr_t)b->ptr); }

static void large_remove(freeset_t *p, block_t *b) { dp__treap_remove(&p->large, &b->tn); }

/* The sets are found by stream through a table over sets[] (kept dense):
 * a search of sets[] cost every allocation and free on a stream other than
 * the one found last a pass over the sets of all streams — with a thousand
 * streams allocating in turn, a free and an allocation took 1.3 us instead
 * of 0.15. */
static uint64_t set_hash_at(const void *ctx, size_t i) {
  return dp__hash_ptr(((const devpool_t *)ctx)->sets[i]->stream);
}

static inline int set_eq(const void *ctx, size_t i, const void *key) {
  return ((const devpool_t *)ctx)->sets[i]->stream == (const dp_stream_t *)key;
}

/* The free set of stream st on pool p; NULL if it has none (none is made). */
static inline freeset_t *set_find(devpool_t *p, dp_stream_t *st) {
  if (!st) return p->none;
  if (p->last && p->last->stream == st) return p->last;
  size_t slot, at = dp__table_find(&p->set_index, DP_TABLE_TAGGED, dp__hash_ptr(st), set_eq, p, st, &slot);
  return at == DP_TABLE_NONE ? NULL : (p->last = p->sets[at]);
}

/* The free set of st, made if it has none: 0, or DP_ENOMEM. A block is
 * tied to a stream only by an allocation, which makes the sets first, so
 * that freeing a block never needs memory. */
static int set_need(devpool_t *p, dp_stream_t *st) {
  if (set_find(p, st)) return 0;
  freeset_t *f = dp__alloc(sizeof *f);
  if (!f || dp__grow((void **)&p->sets, &p->sets_cap, p->nsets + 1, sizeof *p->sets) != 0 ||
      (dp__table_full(&p->set_index) &&
       dp__table_grow(&p->set_index, DP_TABLE_TAGGED, p->nsets, 16, set_hash_at, p) != 0)) {
    dp__free(f, f ? sizeof *f : 0);
    return DP_ENOMEM;
  }
  memset(f, 0, sizeof *f);
  f->stream = st;
  uint64_t h = dp__hash_ptr(st);
  p->sets[p->nsets] = f;
  dp__table_put(&p->set_index, DP_TABLE_TAGGED, dp__table_empty_slot(&p->set_index, DP_TABLE_TAGGED, h), h,
                p->nsets++);
  if (st) p->last = f;
  else p->none = f;
  return 0;
}

/* Drops st's free set (empty: its stream went away and its blocks were
 * tied to none). Its one caller, stream_gone, has just found that set, and
 * st is a stream: the set is in the table, and it is not none's. */
static void set_drop(devpool_t *p, dp_stream_t *st) {
  size_t slot, at = dp__table_find(&p->set_index, DP_TABLE_TAGGED, dp__hash_ptr(st), set_eq, p, st, &slot);
  freeset_t *f = p->sets[at];
  dp__table_remove(&p->set_index, DP_TABLE_TAGGED, slot, set_hash_at, p);
  if (p->last == f) p->last = NULL;
  dp__free(f, sizeof *f);
  size_t last = --p->nsets; /* the last set fills the hole: sets[] stays dense */
  if (at != last) {
    p->sets[at] = p->sets[last];
    dp__table_move(&p->set_index, DP_TABLE_TAGGED, dp__hash_ptr(p->sets[at]->stream), last, at);
  }
}

/* ---- the streams recorded as uses ---- */

/* A stream recorded as a use, and the blocks that hold it as one (their
 * free turns each use into an event, which the stream need not outlive):
 * block ents[i].b holds it as its use ents[i].k. Its destruction lets go
 * of those, and looks at no other block. */
typedef struct uent {
  block_t *b;
  uint32_t k;
} uent_t;

typedef struct user {
  dp_stream_t *s;
  uent_t *ents;
  uint32_t nents, cap;
} user_t;

static uint64_t user_hash_at(const void *ctx, size_t i) { return dp__hash_ptr(((const dp_cache_t *)ctx)->users[i].s); }

static inline int user_eq(const void *ctx, size_t i, const void *key) {
  return ((const dp_cache_t *)ctx)->users[i].s == (const dp_stream_t *)key;
}

/* s's entry; NULL when it has none (*slot: where the search ended). */
static user_t *user_find(dp_cache_t *c, const dp_stream_t *s, size_t *slot) {
  size_t at = dp__table_find(&c->user_index, DP_TABLE_TAGGED, dp__hash_ptr(s), user_eq, c, s, slot);
  return at == DP_TABLE_NONE ? NULL : &c->users[at];
}

/* s's entry, made if it has none; NULL when out of memory. */
static user_t *user_need(dp_cache_t *c, dp_stream_t *s) {
  size_t slot;
  user_t *u = user_find(c, s, &slot);
  if (u) return u;
  if (dp__grow((void **)&c->users, &c->users_cap, c->nusers + 1, sizeof *c->users) != 0 ||
      (dp__table_full(&c->user_index) &&
       dp__table_grow(&c->user_index, DP_TABLE_TAGGED, c->nusers, 16, user_hash_at, c) != 0))
    return NULL;
  uint64_t h = dp__hash_ptr(s);
  c->users[c->nusers] = (user_t){s, NULL, 0, 0};
  dp__table_put(&c->user_index, DP_TABLE_TAGGED, dp__table_empty_slot(&c->user_index, DP_TABLE_TAGGED, h), h,
                c->nusers);
  return &c->users[c->nusers++];
}

/* Adds u's stream to b's uses: 0, or DP_ENOMEM with nothing changed. */
static int use_add(block_t *b, user_t *u) {
  if (b->nuses == b->uses_cap) {
    size_t cap = b->uses_cap;
    if (dp__grow((void **)&b->uses, &cap, b->nuses + 1, sizeof *b->uses) != 0) return DP_ENOMEM;
    b->uses_cap = (uint32_t)cap;
  }
  if (u->nents == u->cap) {
    size_t cap = u->cap;
    if (cap >= UINT32_MAX / 2 || dp__grow((void **)&u->ents, &cap, (size_t)u->nents + 1, sizeof *u->ents) != 0)
      return DP_ENOMEM;
    u->cap = (uint32_t)cap;
  }
  b->uses[b->nuses] = (use_t){u->s, u->nents};
  u->ents[u->nents++] = (uent_t){b, b->nuses++};
  return 0;
}

/* Block b no longer holds its use k (of user u, its stream's): each side
 * fills the hole with its last entry and tells that entry's other side. A
 * block holds a stream once, so the entries moved are other blocks' (u's
 * list) and other streams' (b's uses); and every use has its user (use_add
 * makes both sides at once, user_drop lets go of a user's uses before the
 * user goes), so the moved use's user is always found. */
static void use_remove(dp_cache_t *c, block_t *b, uint32_t k, user_t *u) {
  uint32_t at = b->uses[k].at, last = --u->nents;
  if (at != last) {
    u->ents[at] = u->ents[last];
    u->ents[at].b->uses[u->ents[at].k].at = at;
  }
  last = --b->nuses;
  if (k != last) {
    b->uses[k] = b->uses[last];
    size_t slot;
    user_find(c, b->uses[k].s, &slot)->ents[b->uses[k].at].k = k;
  }
}

/* Block b lets go of its use k. */
static void use_drop(dp_cache_t *c, block_t *b, uint32_t k) {
  size_t slot;
  use_remove(c, b, k, user_find(c, b->uses[k].s, &slot));
}

/* Takes s out of the users (if it is one), every block that held it as a
 * use letting go of it. */
static void user_drop(dp_cache_t *c, dp_stream_t *s) {
  size_t slot;
  user_t *u = user_find(c, s, &slot);
  if (!u) return;
  while (u->nents) use_remove(c, u->ents[u->nents - 1].b, u->ents[u->nents - 1].k, u);
  dp__free(u->ents, u->cap * sizeof *u->ents);
  size_t at = (size_t)(u - c->users);
  dp__table_remove(&c->user_index, DP_TABLE_TAGGED, slot, user_hash_at, c);
  size_t last = --c->nusers; /* the last fills the hole: users[] stays dense */
  if (at != last) {
    c->users[at] = c->users[last];
    dp__table_move(&c->user_index, DP_TABLE_TAGGED, dp__hash_ptr(c->users[at].s), last, at);
  }
}

HOT static void free_insert(devpool_t *pool, block_t *b) {
  freeset_t *p = set_find(pool, b->stream);
  if (!b->seg->small) {
    large_insert(p, b);
    return;
  }
  block_t **head = &p->bins[bin_of(b->size)];
  b->fprev = NULL;
  b->fnext = *head;
  if (*head) (*head)->fprev = b;
  *head = b;
  size_t bin = bin_of(b->size);
  p->bitmap[bin / 64] |= 1ull << (bin % 64);
  p->summary |= 1ull << (bin / 64);
}

HOT static void free_remove(devpool_t *pool, block_t *b) {
  freeset_t *p = set_find(pool, b->stream);
  if (!b->seg->small) {
    large_remove(p, b);
    return;
  }
  block_t **head = &p->bins[bin_of(b->size)];
  if (b->fprev) b->fprev->fnext = b->fnext; else *head = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  if (!*head) {
    size_t bin = bin_of(b->size);
    p->bitmap[bin / 64] &= ~(1ull << (bin % 64));
    if (!p->bitmap[bin / 64]) p->summary &= ~(1ull << (bin / 64));
  }
  /* fprev and fnext are left as they are: nothing reads them before
   * free_insert or block_recycle writes them */
}

/* A small request is at most SMALL_MAX: its bin's word is below the last,
 * so the summary's shift to the next word is less than 64 bits. */
_Static_assert(SMALL_MAX / ROUND / 64 < 63, "a small request's next bitmap word must exist");

/* The smallest free block of set f (never NULL: the stream-less set is
 * made before any search, and only a stream's set is dropped) of at least
 * size, or NULL. */
HOT static block_t *set_fit(const freeset_t *f, size_t size, int small) {
  if (!small) return large_block(dp__treap_ceil(&f->large, size, 0));
  if (!f->summary) return NULL; /* the stream-less set is mostly empty */
  size_t bin = bin_of(size);
  uint64_t word = f->bitmap[bin / 64] >> (bin % 64);
  if (!word) { /* the next non-empty word, through the summary */
    size_t next = bin / 64 + 1;
    uint64_t rest = f->summary >> next;
    if (!rest) return NULL;
    bin = (next + (size_t)__builtin_ctzll(rest)) * 64;
    word = f->bitmap[bin / 64];
  }
  return f->bins[bin + (size_t)__builtin_ctzll(word)];
}

static block_t *smaller(block_t *a, block_t *b) { return !a || (b && b->size < a->size) ? b : a; }

/* A free block of at least size for the stream of set own — its own or
 * one tied to no stream, the smaller — or, when own is NULL, of any
 * stream. */
HOT static block_t *find_free(devpool_t *p, size_t size, int small, const freeset_t *own) {
  if (own) return smaller(set_fit(own, size, small), set_fit(p->none, size, small));
  block_t *best = NULL;
  for (size_t i = 0; i < p->nsets; i++) best = smaller(best, set_fit(p->sets[i], size, small));
  return best;
}

/* Returns a block to its free list, merged with free neighbours of its
 * stream; returns the block it ended up in. */
HOT static block_t *free_block(dp_cache_t *c, devpool_t *p, block_t *b) {
  b->state = B_FREE;
  block_t *n = b->next;
  if (n && n->state == B_FREE && n->stream == b->stream) {
    free_remove(p, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    block_recycle(c, n);
  }
  block_t *q = b->prev;
  if (q && q->state == B_FREE && q->stream == b->stream) {
    free_remove(p, q);
    q->size += b->size;
    q->next = b->next;
    if (b->next) b->next->prev = q;
    block_recycle(c, b);
    b = q;
  }
  free_insert(p, b);
  return b;
}

/* ---- segments ---- */

static size_t seg_find(devpool_t *p, const char *ptr) {  /* last seg with base <= ptr, or SIZE_MAX */
  size_t lo = 0, hi = p->nsegs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (p->segs[mid]->base <= ptr) lo = mid + 1; else hi = mid;
  }
  return lo ? lo - 1 : SIZE_MAX;
}

static int dev_of(dp_cache_t *c, devpool_t *p) { return (int)(p - c->pools); }

/* Rounds of freeing the cache that one allocation refused for want of
 * memory makes (dp_cache_alloc): the first always, the others only while
 * segments were cached again while the lock was let go. */
#define OOM_ROUNDS 8

/* 1 when a segment of p is free whole (drop_free_segments would give it
 * back, its streams' work allowing). */
static int has_free_segment(const devpool_t *p) {
  for (size_t i = 0; i < p->nsegs; i++) {
    int all_free = 1;
    for (const block_t *b = p->segs[i]->first; b && all_free; b = b->next) all_free = b->state == B_FREE;
    if (all_free) return 1;
  }
  return 0;
}

static int segment_alloc(dp_cache_t *c, devpool_t *p, size_t seg_size, int small, dp_stream_t *s, block_t **out,
                         dp_error_t *err) {
  segment_t *seg = dp__alloc(sizeof *seg);
  block_t *b = block_new(c);
  if (!seg || !b ||
      dp__grow((void **)&p->segs, &p->segs_cap, p->nsegs + 1, sizeof *p->segs) != 0) {
    dp__free(seg, seg ? sizeof *seg : 0);
    if (b) block_recycle(c, b);
    char d[16];
    return dp__err(err, DP_ENOMEM, "dp_cache_alloc(%s): out of memory tracking a segment",
                   dp_device_format(dp_backend_device(c->b, dev_of(c, p)), d, sizeof d));
  }
  void *mem;
  int rc = dp_device_alloc(c->b, dp_backend_device(c->b, dev_of(c, p)), seg_size, &mem, err);
  if (rc) {
    dp__free(seg, sizeof *seg);
    block_recycle(c, b);
    return rc;
  }
  seg->base = mem;
  seg->size = seg_size;
  seg->nused = 0;
  seg->one_stream = NULL;
  seg->small = small;
  seg->dev = dev_of(c, p);
  seg->first = b;
  b->ptr = mem;
  b->size = seg_size;
  b->stream = s;
  b->seg = seg;
  b->state = B_FREE;
  size_t at = seg_find(p, mem) + 1;
  memmove(&p->segs[at + 1], &p->segs[at], (p->nsegs - at) * sizeof *p->segs);
  p->segs[at] = seg;
  p->nsegs++;
  p->st.reserved += seg_size;
  p->st.segment_allocs++;
  *out = b;
  return 0;
}

/* Gives entirely free segments back to the backend. The streams that last
 * used them are synchronized first: on the host backend the memory would
 * otherwise be freed under work still queued (cudaFree synchronizes by
 * itself). */
/* Segments whose blocks are all free go back to the backend in two steps,
 * so that nothing blocks while the allocator's lock is held (a host
 * function on one of those streams may itself be waiting for the lock):
 * drop_free_segments(), under the lock, takes them out of the pool and
 * records an event on each of their blocks' streams; free_dropped(),
 * without the lock, waits on those events, frees the memory, and retakes
 * the lock to recycle the blocks. A segment whose event cannot be had
 * stays in the pool (*failed gets the first such error, err its message).
 * A host function (dp__host_fn_stream) must not wait: a
 * segment with work still queued on a block's stream stays in the pool —
 * its own stream's too, since a block freed in stream order may be used by
 * work queued on that stream after the function. */
static segment_t *drop_free_segments(dp_cache_t *c, devpool_t *p, int *failed, dp_error_t *err) {
  segment_t *dropped = NULL;
  size_t keep = 0;
  for (size_t i = 0; i < p->nsegs; i++) {
    segment_t *seg = p->segs[i];
    int all_free = 1;
    for (block_t *b = seg->first; b && all_free; b = b->next) all_free = b->state == B_FREE;
    /* Free blocks of several streams do not merge, so a free segment may
     * hold several: mark where each one's stream is. */
    for (block_t *b = seg->first; b && all_free; b = b->next) {
      if (!b->stream) continue;
      dp_error_t e;
      int rc = dp_event_new(c->b, dp__stream_dev(b->stream), &b->drop_ev, &e);
      if (rc == 0) rc = dp_event_record(b->drop_ev, b->stream, &e);
      if (rc && !*failed) {
        *failed = rc;
        if (err) *err = e;
      }
      if (rc || (dp__host_fn_stream && dp_event_query(b->drop_ev, NULL) != 1)) {
        for (block_t *u = seg->first; u != b->next; u = u->next) {
          dp_event_free(u->drop_ev);
          u->drop_ev = NULL;
        }
        all_free = 0;
      }
    }
    if (!all_free) {
      p->segs[keep++] = seg;
      continue;
    }
    for (block_t *b = seg->first; b; b = b->next) free_remove(p, b);
    p->st.reserved -= seg->size;
    p->st.segment_frees++;
    seg->next_drop = dropped;
    dropped = seg;
  }
  p->nsegs = keep;
  return dropped;
}

/* Called with the lock held; returns with it held, having let it go while
 * the dropped segments' streams were waited on and their memory freed. */
static void free_dropped(dp_cache_t *c, segment_t *dropped) {
  if (!dropped) return;
  pthread_mutex_unlock(&c->mu);
  for (segment_t *seg = dropped; seg; seg = seg->next_drop) {
    for (block_t *b = seg->first; b; b = b->next)
      if (b->drop_ev) {
        dp_event_synchronize(b->drop_ev, NULL);
        dp_event_free(b->drop_ev); /* the block struct is recycled below, and zeroed when made again */
      }
    dp_device_dealloc(c->b, dp_backend_device(c->b, seg->dev), seg->base, NULL);
  }
  pthread_mutex_lock(&c->mu);
  while (dropped) {
    segment_t *seg = dropped;
    dropped = seg->next_drop;
    for (block_t *b = seg->first, *n; b; b = n) {
      n = b->next;
      block_recycle(c, b);
    }
    dp__free(seg, sizeof *seg);
  }
}

/* 0, or the first error that kept a free segment in the pool (err: its
 * message). */
static int release_free_segments(dp_cache_t *c, devpool_t *p, dp_error_t *err) {
  int failed = 0;
  free_dropped(c, drop_free_segments(c, p, &failed, err));
  return failed;
}

/* ---- pending blocks ---- */

/* A pending block is free once its events completed and the streams it
 * kept (no event could be made for them) are idle (or gone: stream_gone
 * drops them). */
static int pending_done(block_t *b) {
  for (uint32_t i = 0; i < b->nevents; i++)
    if (dp_event_query(b->events[i], NULL) == 0) return 0;
  for (uint32_t i = 0; i < b->nuses; i++)
    if (dp_stream_query(b->uses[i].s, NULL) == 0) return 0;
  return 1;
}

static devpool_t *pool_of(dp_cache_t *c, block_t *b);

/* Block b, now in use, is tied to the stream of set f (its allocation's). */
static void tie(freeset_t *f, block_t *b) {
  /* b->tprev is NULL: a block out of use is in no tied list, and untie_used and stream_gone clear its links */
  b->tnext = f->tied_head;
  if (f->tied_head) f->tied_head->tprev = b;
  f->tied_head = b;
  f->tied++;
}

/* A block of b->stream's leaves use (freed, or back from pending). */
static inline __attribute__((always_inline)) void untie_used(devpool_t *p, block_t *b) {
  freeset_t *f = b->stream ? set_find(p, b->stream) : NULL;
  if (!f) return;
  if (b->tprev) b->tprev->tnext = b->tnext;
  else f->tied_head = b->tnext;
  if (b->tnext) b->tnext->tprev = b->tprev;
  b->tprev = b->tnext = NULL;
  f->tied--;
}

static void pending_finish(dp_cache_t *c, block_t *b) {
  devpool_t *p = pool_of(c, b);
  untie_used(p, b);
  for (uint32_t i = 0; i < b->nevents; i++) dp_event_free(b->events[i]);
  while (b->nuses) use_drop(c, b, b->nuses - 1); /* kept for want of an event */
  b->nevents = 0;
  p->st.pending_blocks--;
  p->st.pending_bytes -= b->size;
  free_block(c, p, b);
}

/* Reclaims completed pending blocks (hot path: every malloc and free)
 * from the head, passing over at most POLL_PASS blocks still in use, each
 * moved to the tail. Stopping at the first one in use let a single slow
 * stream hold back every block freed after its own, whatever streams those
 * waited for. No caller asks how many came back: none is counted. */
#define POLL_PASS 4

static void pending_unlink_head(dp_cache_t *c) {
  block_t *b = c->pending_head;
  if (!(c->pending_head = b->pnext)) c->pending_tail = NULL;
  b->pnext = NULL;
}

static void poll_some(dp_cache_t *c) {
  for (unsigned passed = 0; c->pending_head && passed < POLL_PASS;) {
    block_t *b = c->pending_head;
    if (pending_done(b)) {
      pending_unlink_head(c);
      pending_finish(c, b);
    } else {
      if (b == c->pending_tail) break;
      pending_unlink_head(c);
      c->pending_tail->pnext = b;
      c->pending_tail = b;
      passed++;
    }
  }
}

/* Reclaims every completed pending block; returns how many. */
static int poll_all(dp_cache_t *c) {
  int n = 0;
  block_t *prev = NULL, *b = c->pending_head;
  while (b) {
    block_t *next = b->pnext;
    if (pending_done(b)) {
      if (prev) prev->pnext = next; else c->pending_head = next;
      if (c->pending_tail == b) c->pending_tail = prev;
      pending_finish(c, b);
      n++;
    } else {
      prev = b;
    }
    b = next;
  }
  return n;
}

/* ---- public ---- */

/* A stream is being destroyed, its work done: the blocks tied to it — its
 * free set, and its tied list of blocks in use or pending — become tied
 * to no stream (reusable by any without waiting), and the blocks that hold
 * it as a use let go of it (its user's list). Only those blocks are looked
 * at: every stream freed in the process tells every cache, and a look at
 * every block cost milliseconds a stream with 300,000 blocks held. */
static void stream_gone(void *ctx, dp_stream_t *s) {
  dp_cache_t *c = ctx;
  if (dp_stream_backend(s) != c->b) return;
  pthread_mutex_lock(&c->mu);
  user_drop(c, s);
  for (int d = 0; d < c->ndev; d++) {
    devpool_t *p = &c->pools[d];
    freeset_t *f = set_find(p, s);
    if (!f) continue;
    for (block_t *b = f->tied_head, *n; b; b = n) {
      n = b->tnext;
      b->tprev = b->tnext = NULL;
      b->stream = NULL;
      mapent_t *e = b->state == B_USED ? map_entry(c, b->ptr, dp__hash_ptr(b->ptr), NULL) : NULL;
      if (e) e->stream = NULL;
      /* a segment whose used blocks were all s's has one of them here */
      if (b->seg->one_stream == s) b->seg->one_stream = MIXED; /* its blocks now have none */
    }
    /* Its tied list and count are left as they are: the set is dropped
       below. Its free blocks leave it while s still names them, then go
       to none's, merged with their free stream-less neighbours */
    for (block_t *b; (b = set_fit(f, ROUND, 1)) != NULL || (b = set_fit(f, 0, 0)) != NULL;) {
      free_remove(p, b);
      b->stream = NULL;
      free_block(c, p, b);
    }
    set_drop(p, s);
  }
  pthread_mutex_unlock(&c->mu);
}

const char *dp__cache_check(dp_cache_t *c) {
  static char why[160];
  const char *bad = NULL;
#define BAD(...) (snprintf(why, sizeof why, __VA_ARGS__), bad = why)
  pthread_mutex_lock(&c->mu);
  size_t uses = 0, ents = 0, tied = 0, listed = 0, used = 0, npending = 0;
  for (int d = 0; d < c->ndev && !bad; d++) {
    devpool_t *p = &c->pools[d];
    size_t allocated = 0, pending = 0, pending_bytes = 0;
    for (size_t i = 0; i < p->nsegs && !bad; i++) {
      segment_t *sg = p->segs[i];
      uint32_t nused = 0;
      if (sg->first->ptr != sg->base) BAD("a segment's first block is not at its base");
      for (block_t *b = sg->first; b && !bad; b = b->next) {
        for (uint32_t k = 0; k < b->nuses && !bad; k++) {
          size_t slot;
          user_t *u = user_find(c, b->uses[k].s, &slot);
          if (!u || b->uses[k].at >= u->nents || u->ents[b->uses[k].at].b != b || u->ents[b->uses[k].at].k != k)
            BAD("block %p's use %u is not in its stream's list there", (void *)b->ptr, k);
          for (uint32_t j = 0; j < k && !bad; j++)
            if (b->uses[j].s == b->uses[k].s)
              BAD("block %p holds a stream twice", (void *)b->ptr);
        }
        uses += b->nuses;
        if (b->state != B_FREE && b->stream) tied++;
        if (b->state == B_FREE && (b->tprev || b->tnext))
          BAD("free block %p is in a tied list", (void *)b->ptr);
        if (!bad && b->state == B_FREE && (b->nuses || b->nevents))
          BAD("free block %p holds %u uses and %u events", (void *)b->ptr, b->nuses, b->nevents);
        if (!bad && b->state == B_FREE && !set_find(p, b->stream))
          BAD("free block %p is tied to a stream without a free set", (void *)b->ptr);
        if (!bad && b->state == B_FREE && b->next && b->next->state == B_FREE && b->next->stream == b->stream)
          BAD("free blocks %p and %p of one stream did not merge", (void *)b->ptr, (void *)b->next->ptr);
        if (!bad && b->state == B_USED) {
          mapent_t *e = map_entry(c, b->ptr, dp__hash_ptr(b->ptr), NULL);
          if (!e || e->b != b || e->stream != b->stream)
            BAD("block %p in use is not mapped with its stream", (void *)b->ptr);
          used++;
          nused++;
          allocated += b->size;
          if (sg->one_stream && sg->one_stream != MIXED && b->stream != sg->one_stream)
            BAD("block %p is on another stream than its segment's one stream", (void *)b->ptr);
        }
        if (b->state == B_PENDING) pending++, pending_bytes += b->size;
        if (!bad && b->next && (b->next->prev != b || b->next->ptr != b->ptr + b->size))
          BAD("block %p's neighbour is out of place", (void *)b->ptr);
      }
      if (!bad && (nused != sg->nused || (!nused && sg->one_stream)))
        BAD("a segment counts %u blocks in use (one stream %p), %u are", sg->nused, (void *)sg->one_stream, nused);
    }
    if (!bad &&
        (allocated != p->st.allocated || pending != p->st.pending_blocks || pending_bytes != p->st.pending_bytes))
      BAD("device %d: %zu bytes allocated, %zu pending blocks (%zu bytes); counted %zu, %zu (%zu)", d, allocated,
          pending, pending_bytes, p->st.allocated, p->st.pending_blocks, p->st.pending_bytes);
    npending += pending;
    for (size_t i = 0; i < p->nsets && !bad; i++) {
      freeset_t *f = p->sets[i];
      size_t n = 0;
      for (block_t *b = f->tied_head; b && !bad; b = b->tnext, n++) {
        if (b->stream != f->stream || b->state == B_FREE || (b->tnext && b->tnext->tprev != b) ||
            (b == f->tied_head && b->tprev))
          BAD("block %p is in the tied list of a stream it is not in use on", (void *)b->ptr);
      }
      if (!bad && n != f->tied)
        BAD("a stream's tied list has %zu blocks, its count %zu", n, f->tied);
      listed += n;
    }
  }
  for (size_t i = 0; i < c->nusers && !bad; i++) {
    user_t *u = &c->users[i];
    for (uint32_t j = 0; j < u->nents && !bad; j++) {
      block_t *b = u->ents[j].b;
      if (u->ents[j].k >= b->nuses || b->uses[u->ents[j].k].s != u->s || b->uses[u->ents[j].k].at != j)
        BAD("a stream's list names block %p's use %u, which is not its", (void *)b->ptr, u->ents[j].k);
    }
    ents += u->nents;
  }
  if (!bad && uses != ents)
    BAD("%zu uses held by blocks, %zu in the streams' lists", uses, ents);
  if (!bad && used != c->map.count)
    BAD("%zu blocks in use, %zu mapped", used, (size_t)c->map.count);
  size_t listed_pending = 0;
  for (block_t *b = c->pending_head; b && !bad; b = b->pnext, listed_pending++)
    if (b->state != B_PENDING || (!b->pnext && b != c->pending_tail))
      BAD("block %p in the pending list is not pending, or the tail is not last", (void *)b->ptr);
  if (!bad && listed_pending != npending)
    BAD("%zu blocks pending, %zu in the pending list", npending, listed_pending);
  if (!bad && tied != listed)
    BAD("%zu blocks in use on a stream, %zu in the tied lists", tied, listed);
#undef BAD
  pthread_mutex_unlock(&c->mu);
  return bad;
}

int dp_cache_new(dp_backend_t *b, dp_cache_t **out, dp_error_t *err) {
  if (!b || !out) return dp__err(err, DP_EINVAL, "dp_cache_new: NULL %s", !b ? "backend" : "out");
  dp_cache_t *c = dp__alloc(sizeof *c);
  if (!c) return dp__err(err, DP_ENOMEM, "dp_cache_new: out of memory creating a caching allocator");
  memset(c, 0, sizeof *c);
  int ndev = dp_backend_device_count(b);
  c->pools = dp__alloc_array((size_t)ndev, sizeof(devpool_t));
  if (!c->pools) {
    dp__free(c, sizeof *c);
    return dp__err(err, DP_ENOMEM, "dp_cache_new: out of memory creating a caching allocator");
  }
  memset(c->pools, 0, (size_t)ndev * sizeof(devpool_t));
  for (int d = 0; d < ndev; d++) dp__table_init(&c->pools[d].set_index);
  dp__table_init(&c->map);
  dp__table_init(&c->user_index);
  c->b = b;
  c->ndev = ndev;
  pthread_mutex_init(&c->mu, NULL);
  c->gone = (dp__stream_listener_t){stream_gone, c, NULL};
  dp__stream_listen(&c->gone);
  *out = c;
  return 0;
}

static void cache_destroy(dp_cache_t *c);

void dp_cache_free(dp_cache_t *c) {
  if (!c || c->is_default) return;  /* a default cache is dp_shutdown's to free */
  cache_destroy(c);
}

/* Waits, without the lock, until the work queued on the devices the cache
 * has memory on (and those of the streams its pending blocks wait for) has
 * completed and no freed block is pending. Work queued on a stream (a host
 * function) may itself allocate and free here, which takes the lock:
 * waiting under it left such work, and the wait, blocked for good. A
 * device that cannot be waited on (a host function waiting for its own
 * stream: DP_EMISUSE) ends the wait. */
static void cache_quiesce(dp_cache_t *c) {
  unsigned char want[DP_DEVICE_INDEX_MAX + 1];
  for (;;) {
    memset(want, 0, sizeof want);
    int any = 0;
    pthread_mutex_lock(&c->mu);
    poll_all(c);
    for (int d = 0; d < c->ndev; d++) any |= want[d] = c->pools[d].nsegs != 0;
    for (block_t *b = c->pending_head; b; b = b->pnext) {
      for (uint32_t i = 0; i < b->nevents; i++) any |= want[dp_event_device(b->events[i]).index] = 1;
      for (uint32_t i = 0; i < b->nuses; i++) any |= want[dp__stream_dev(b->uses[i].s).index] = 1;
    }
    pthread_mutex_unlock(&c->mu);
    if (!any) return;
    int rc = 0;
    for (int d = 0; d < c->ndev && rc == 0; d++)
      if (want[d]) rc = dp_device_synchronize(c->b, dp_backend_device(c->b, d), NULL);
    pthread_mutex_lock(&c->mu);
    poll_all(c);
    int pending = c->pending_head != NULL;
    pthread_mutex_unlock(&c->mu);
    if (!pending || rc) return;
  }
}

static void cache_destroy(dp_cache_t *c) {
  cache_quiesce(c);
  dp__stream_unlisten(&c->gone);
  pthread_mutex_lock(&c->mu);
  /* left pending only when a wait above was refused: the events go back */
  for (block_t *b = c->pending_head; b; b = b->pnext)
    for (uint32_t i = 0; i < b->nevents; i++) dp_event_free(b->events[i]);
  for (int d = 0; d < c->ndev; d++) {
    devpool_t *p = &c->pools[d];
    for (size_t i = p->nsegs; i-- > 0;) {
      segment_t *seg = p->segs[i];
      for (block_t *b = seg->first, *n; b; b = n) {
        n = b->next;
        dp__free(b->uses, b->uses_cap * sizeof *b->uses);
        dp__free(b->events, b->events_cap * sizeof *b->events);
        dp__free(b, sizeof *b);
      }
      seg->first = NULL;
    }
    for (size_t i = 0; i < p->nsets; i++) dp__free(p->sets[i], sizeof *p->sets[i]);
    dp__free(p->sets, p->sets_cap * sizeof *p->sets);
    dp__table_destroy(&p->set_index, DP_TABLE_TAGGED);
  }
  while (c->spare) {
    block_t *b = c->spare;
    c->spare = b->fnext;
    dp__free(b, sizeof *b);
  }
  dp__table_destroy(&c->map, DP_TABLE_TAGGED);
  dp__free(c->mapped, c->mapped_cap * sizeof *c->mapped);
  dp__table_destroy(&c->user_index, DP_TABLE_TAGGED);
  for (size_t i = 0; i < c->nusers; i++) dp__free(c->users[i].ents, c->users[i].cap * sizeof *c->users[i].ents);
  dp__free(c->users, c->users_cap * sizeof *c->users);
  pthread_mutex_unlock(&c->mu);
  /* The memory goes back without the lock: a backend's free waits for the
     device's queued work (cudaFree does, and the host backend as it), and
     no function waits on a stream under the lock (cache.h). */
  for (int d = 0; d < c->ndev; d++) {
    devpool_t *p = &c->pools[d];
    /* highest address first: a backend that keeps its allocations sorted
       (the host's) then removes each at the end of its table, not the
       front (quadratic in the segments) */
    for (size_t i = p->nsegs; i-- > 0;) {
      dp_device_dealloc(c->b, dp_backend_device(c->b, d), p->segs[i]->base, NULL);
      dp__free(p->segs[i], sizeof *p->segs[i]);
    }
    dp__free(p->segs, p->segs_cap * sizeof *p->segs);
  }
  dp__free(c->pools, (size_t)c->ndev * sizeof(devpool_t));
  pthread_mutex_destroy(&c->mu);
  dp__free(c, sizeof *c);
}

HOT int dp_cache_alloc(dp_cache_t *c, dp_device_t dev, size_t nbytes, dp_stream_t *s, void **out, dp_error_t *err) {
  if (!c || !out) return dp__err(err, DP_EINVAL, "dp_cache_alloc: NULL %s", !c ? "cache" : "out");
  int rc = dp__check_device(__func__, c->b, dev, err);
  if (rc) return rc;
  if (!s && (rc = dp_current_stream(c->b, dev, &s, err)) != 0) return rc;
  if (DP_UNLIKELY(!dp_device_equal(dp__stream_dev(s), dev))) {
    char want[16], got[16]; /* both named: a caller passing the wrong one of several streams sees which */
    return dp__err(err, DP_EINVAL, "dp_cache_alloc(%s): the stream is on %s; it must be on the device allocated from",
                   dp_device_format(dev, want, sizeof want), dp_device_format(dp__stream_dev(s), got, sizeof got));
  }
  if (nbytes > SIZE_MAX - LARGE_ROUND)
    return dp__err(err, DP_ENOMEM, "dp_cache_alloc: %zu bytes cannot be rounded up to a 2 MiB segment", nbytes);
  size_t size = nbytes ? (nbytes + ROUND - 1) / ROUND * ROUND : ROUND;
  int small = size <= SMALL_MAX;
  devpool_t *p = &c->pools[dev.index];

  pthread_mutex_lock(&c->mu);
  freeset_t *own = set_find(p, s);
  if (DP_UNLIKELY(!own || !p->none)) {
    if (set_need(p, s) || set_need(p, NULL)) {
      char d[16];
      rc = dp__err(err, DP_ENOMEM, "dp_cache_alloc(%s): out of memory tracking the free blocks of a stream",
                   dp_device_format(dev, d, sizeof d));
      goto out;
    }
    own = set_find(p, s);
  }
  if (c->pending_head) poll_some(c);
  /* A hit and a take from another stream are counted once the allocation
   * is made (below): one that fails after finding its block served none. */
  int hit = 1, cross = 0, released = 0;
  block_t *b;
  for (unsigned round = 0;; round++) {
    rc = 0; /* a refusal retried is no error yet */
    if ((b = find_free(p, size, small, own)) != NULL) break; /* its own stream's, or one tied to none */
    if ((b = find_free(p, size, small, NULL)) != NULL) {
      /* Another stream's block: order this stream after its earlier work. */
      if ((rc = dp_stream_wait_stream(s, b->stream, err)) != 0) goto out;
      cross = 1;
      break;
    }
    size_t seg_size = small ? SMALL_SEGMENT : (size + LARGE_ROUND - 1) / LARGE_ROUND * LARGE_ROUND;
    dp_error_t first;
    rc = segment_alloc(c, p, seg_size, small, s, &b, &first);
    if (rc == 0) {
      hit = 0;
      free_insert(p, b);
      break;
    }
    /* Out of memory: free the cache and try again. Freeing it lets the
     * lock go while the segments' streams are waited for, and meanwhile
     * another thread (a host function that the wait waits for, say) may
     * cache a segment of its own or free a block that fits, and pending
     * blocks may finish: a refusal after a round that freed segments
     * reclaims those blocks and looks at the free ones again, and frees
     * the segments cached meanwhile, for up to OOM_ROUNDS rounds. A round
     * that freed none let the lock go nowhere: its refusal stands. */
    if (rc == DP_ENOMEM && round < OOM_ROUNDS && (round == 0 || released)) {
      int back = poll_all(c);
      if (round == 0 || has_free_segment(p)) {
        p->st.oom_retries++;
        uint64_t frees = p->st.segment_frees;
        release_free_segments(c, p, NULL); /* what stays cached shows in the OOM message's reserved */
        released = p->st.segment_frees != frees;
        continue;
      }
      if (back > 0) { /* a block that came back may fit: look again, letting the lock go nowhere */
        released = 0;
        continue;
      }
    }
    if (err) *err = first;
    if (rc == DP_ENOMEM)
      dp__err(err, DP_ENOMEM, "dp_cache_alloc(%s:%d): out of memory allocating %zu bytes (%zu allocated, %zu reserved, %zu pending): %s",
              dp_backend_name(c->b), dev.index, nbytes, p->st.allocated, p->st.reserved, p->st.pending_bytes, first.message);
    goto out;
  }
  free_remove(p, b);
  b->state = B_USED;  /* before splitting: the remainder must not merge back */
  dp_stream_t *owner = b->stream;
  /* Split: keep what is not needed, with the block's old stream. */
  size_t rest = b->size - size;
  if (small ? rest >= ROUND : rest > SMALL_MAX) {
    block_t *r = block_new(c);
    if (r) {
      r->ptr = b->ptr + size;
      r->size = rest;
      r->seg = b->seg;
      r->stream = owner;
      r->prev = b;
      r->next = b->next;
      if (b->next) b->next->prev = r;
      b->next = r;
      b->size = size;
      free_block(c, p, r);
    }
  }
  if (map_insert(c, b, s) != 0) {
    free_block(c, p, b);
    char d[16];
    rc = dp__err(err, DP_ENOMEM, "dp_cache_alloc(%s): out of memory tracking an allocation", dp_device_format(dev, d, sizeof d));
    goto out;
  }
  b->stream = s;
  tie(own, b); /* b->nuses is 0: a free block holds no use (pending_finish drops those kept) */
  segment_t *sg = b->seg;
  sg->one_stream = sg->nused++ == 0 || sg->one_stream == s ? s : MIXED;
  p->st.allocated += b->size;
  if (p->st.allocated > p->st.peak_allocated) p->st.peak_allocated = p->st.allocated;
  p->st.allocs++;
  p->st.cache_hits += (uint64_t)hit;
  p->st.cross_stream += (uint64_t)cross;
  *out = b->ptr;
out:
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static devpool_t *pool_of(dp_cache_t *c, block_t *b) { return &c->pools[b->seg->dev]; }

static block_t *find_used(dp_cache_t *c, const void *ptr);

HOT int dp_cache_dealloc(dp_cache_t *c, void *ptr, dp_error_t *err) {
  if (!c) return dp__err(err, DP_EINVAL, "dp_cache_dealloc: NULL cache");
  if (!ptr) return 0;
  pthread_mutex_lock(&c->mu);
  size_t slot;
  block_t *b = map_find(c, ptr, &slot);
  if (!b) {
    /* An interior pointer (which record_stream and lookup take) is in an
     * allocation of this allocator: say which, rather than foreign. */
    block_t *in = find_used(c, ptr);
    char *base = in && in->state == B_USED ? in->ptr : NULL;
    size_t size = base ? in->size : 0;
    pthread_mutex_unlock(&c->mu);
    if (base)
      return dp__err(err, DP_EINVAL, "dp_cache_dealloc(%p): inside the allocation at %p (%zu bytes), not its start",
                     ptr, (void *)base, size);
    return dp__err(err, DP_EINVAL, "dp_cache_dealloc(%p): not allocated by this allocator, or already freed", ptr);
  }
  map_remove_at(c, slot);
  if (--b->seg->nused == 0) b->seg->one_stream = NULL;
  devpool_t *p = pool_of(c, b);
  p->st.allocated -= b->size;
  p->st.frees++;
  /* One event on each stream that used the block besides its own; the
   * last use first, so that a use dropped is the last and moves none (a
   * moved use's stream would be looked up to mend its back-link). */
  for (uint32_t i = b->nuses; i-- > 0;) {
    dp_stream_t *u = b->uses[i].s;
    dp_event_t *ev = NULL;
    if (b->nevents == b->events_cap) {
      size_t cap = b->events_cap;
      if (dp__grow((void **)&b->events, &cap, b->nevents + 1, sizeof *b->events) == 0) b->events_cap = (uint32_t)cap;
    }
    if (b->nevents < b->events_cap && dp_event_new(c->b, dp__stream_dev(u), &ev, NULL) == 0 &&
        dp_event_record(ev, u, NULL) == 0) {
      b->events[b->nevents++] = ev;
      use_drop(c, b, i); /* the event stands in for it */
      continue;
    }
    /* No event to be had (out of memory): the block waits until the stream
       is idle, never by waiting here (under the lock, perhaps on a host
       function of that very stream) */
    if (ev) dp_event_free(ev);
  }
  if (b->nevents || b->nuses) {
    b->state = B_PENDING;
    b->pnext = NULL;
    if (c->pending_tail) c->pending_tail->pnext = b; else c->pending_head = b;
    c->pending_tail = b;
    p->st.pending_blocks++;
    p->st.pending_bytes += b->size;
  } else {
    untie_used(p, b);
    free_block(c, p, b);
  }
  if (c->pending_head) poll_some(c);
  pthread_mutex_unlock(&c->mu);
  return 0;
}

/* The allocated block holding p, exact or interior. */
static block_t *find_used(dp_cache_t *c, const void *ptr) {
  block_t *b = map_find(c, ptr, NULL);
  if (b) return b;
  for (int d = 0; d < c->ndev; d++) {
    devpool_t *p = &c->pools[d];
    size_t at = seg_find(p, ptr);
    if (at == SIZE_MAX || (const char *)ptr >= p->segs[at]->base + p->segs[at]->size) continue;
    for (b = p->segs[at]->first; b; b = b->next)
      if ((const char *)ptr >= b->ptr && (const char *)ptr < b->ptr + b->size) return b;
  }
  return NULL;
}

/* Adds stream s to an allocated block's uses (and to the cache's users). */
static int record_block(const char *fn, dp_cache_t *c, block_t *b, dp_stream_t *s, dp_error_t *err) {
  for (uint32_t i = 0; i < b->nuses; i++)
    if (b->uses[i].s == s) return 0;
  user_t *u = user_need(c, s);
  if (!u || use_add(b, u) != 0)
    return dp__err(err, DP_ENOMEM, "%s(%p): out of memory recording a stream use", fn, (void *)b->ptr);
  return 0;
}

/* Records s on the allocation holding ptr (hash h of ptr). A record on the
 * block's allocation stream is a no-op and is not stored: a block freed is
 * reusable at once on that stream (the stream orders the next use after
 * every earlier one), and an allocation on another stream takes it only
 * after waiting for an event recorded on that stream (dp_cache_alloc), so
 * an event on it at free time would order nothing more. An exact pointer is
 * decided from the map entry alone; an interior one looks for its segment. */
static int record_slow(const char *fn, dp_cache_t *c, void *ptr, mapent_t *e, dp_stream_t *s, dp_error_t *err) {
  block_t *b;
  if (e) {
    b = e->b;
  } else if (!(b = find_used(c, ptr)) || b->state != B_USED) {
    return dp__err(err, DP_ENOTFOUND, "%s(%p): not an allocation of this allocator", fn, ptr);
  } else if (b->stream == s) {
    return 0;
  }
  /* Another backend's stream could be neither waited on by an event of
   * this allocator's backend nor followed to its destruction (stream_gone
   * hears of this backend's streams only): kept as a use, it held the
   * block until it was idle and was queried after it was freed. */
  if (DP_UNLIKELY(dp_stream_backend(s) != c->b)) {
    char dev[16];
    return dp__err(err, DP_EINVAL,
                   "%s(%p): the stream is on %s, of the %s backend; this allocator's memory is the %s "
                   "backend's, whose reuse only its own streams can order",
                   fn, ptr, dp_device_format(dp__stream_dev(s), dev, sizeof dev), dp_backend_name(dp_stream_backend(s)),
                   dp_backend_name(c->b));
  }
  return record_block(fn, c, b, s, err);
}

static inline __attribute__((always_inline)) int record_hashed(const char *fn, dp_cache_t *c, void *ptr, uint64_t h,
                                                               dp_stream_t *s, dp_error_t *err) {
  mapent_t *e = map_entry(c, ptr, h, NULL);
  if (DP_LIKELY(e != NULL) && e->stream == s) return 0;
  return record_slow(fn, c, ptr, e, s, err);
}

static inline __attribute__((always_inline)) int ents_eq(const void *ctx, size_t i, const void *key) {
  return ((const mapent_t *)ctx)[i].ptr == (const char *)key;
}

/* fn: the name the messages give (the public call's, or the hook's). */
static int record_one(const char *fn, dp_cache_t *c, void *ptr, dp_stream_t *s, dp_error_t *err) {
  if (!c || !s) return dp__err(err, DP_EINVAL, "%s: NULL %s", fn, !c ? "cache" : "stream");
  pthread_mutex_lock(&c->mu);
  int rc = record_hashed(fn, c, ptr, dp__hash_ptr(ptr), s, err);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int dp_cache_record_stream(dp_cache_t *c, void *ptr, dp_stream_t *s, dp_error_t *err) {
  return record_one("dp_cache_record_stream", c, ptr, s, err);
}

static int hook_record_stream(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  return record_one("record_stream", ctx, ptr, s, err);
}

/* The batched record: one lock; most pointers need no lookup, and the
 * lookups that remain are pipelined.
 *
 * Runs. Most pointers of a completion lie in the segment of the pointer
 * before, whose used blocks were all allocated on the recording stream
 * (segment.one_stream): a record there is a no-op. Such a run is passed in
 * a loop of a range check a pointer, with nothing hashed or fetched. (The
 * pipeline below used to hash every pointer and fetch its slot and entry,
 * for the lookup of perhaps one pointer in a thousand: two thirds of the
 * record's instructions and, past RECORD_PREFETCH_SLOTS, two cache lines a
 * pointer that nothing read.)
 *
 * Lookups. Each lookup fetches, RECORD_SLOT_AHEAD pointers ahead, the slots
 * of the pointers not in the current run's segment, and the dense entry the
 * home slot names for the one RECORD_ENTRY_AHEAD ahead, so that the misses
 * of many lookups (slots and entries out of cache) overlap instead of
 * queuing one after another. Hashes taken ahead wait in a ring, each with
 * the index it is for. A map whose slots fit the first-level cache
 * (RECORD_PREFETCH_SLOTS) is not prefetched: the extra instructions would
 * only cost there. */
#define RECORD_RING 32u           /* a power of two, > RECORD_SLOT_AHEAD */
#define RECORD_SLOT_AHEAD 16u
#define RECORD_ENTRY_AHEAD 8u
#define RECORD_PREFETCH_SLOTS 8192u  /* 64 KiB of slots */

/* owned: NULL, or marks what is this allocator's (a chain passes the rest
 * on): a pointer into one of its used blocks; inside a run (a segment whose
 * used blocks are all on s) any pointer into the segment, a free or
 * pending block's too, which the slow path would call not found — memory
 * no other allocator can own either, so no chain hands it on wrongly.
 * Inlined twice, so that the plain batch pays nothing. */
static inline __attribute__((always_inline)) int record_streams(const char *fn, dp_cache_t *c, void *const *ptrs,
                                                                size_t n, dp_stream_t *s, unsigned char *owned,
                                                                dp_error_t *err) {
  if (!c || !s) return dp__err(err, DP_EINVAL, "%s: NULL %s", fn, !c ? "cache" : "stream");
  if (n && !ptrs) return dp__err(err, DP_EINVAL, "%s: NULL ptrs with n = %zu", fn, n);
  int rc = 0;
  uint64_t ring[RECORD_RING];
  size_t ring_at[RECORD_RING];  /* the index whose hash ring[] holds (prefetch only) */
  pthread_mutex_lock(&c->mu);
  /* Nothing in the loop changes the map: its fields are read once. */
  const dp__table_t map = c->map, *t = &map;
  mapent_t *const mapped = c->mapped;
  size_t mask = t->nslots ? t->nslots - 1 : 0;
  int prefetch = t->nslots > RECORD_PREFETCH_SLOTS && n > 1;
  if (prefetch)
    for (unsigned k = 0; k < RECORD_RING; k++) ring_at[k] = SIZE_MAX;
  /* The run's segment: found last, all its used blocks on s (else NULL). */
  uintptr_t run_base = 0;
  size_t run_size = 0;
  size_t pf = 0;  /* the next index the pipeline has not looked at */
  for (size_t i = 0; i < n && rc == 0;) {
    if (run_size) {
      size_t j = i;
      while (j < n && (uintptr_t)ptrs[j] - run_base < run_size) j++;
      if (j != i) {
        if (owned) memset(owned + i, 1, j - i);
        i = j;
        continue;
      }
    }
    if (prefetch) {
      if (pf <= i) pf = i;
      for (; pf < n && pf <= i + RECORD_SLOT_AHEAD; pf++) {
        if (pf > i && (uintptr_t)ptrs[pf] - run_base < run_size) continue;
        uint64_t h = ring[pf % RECORD_RING] = dp__hash_ptr(ptrs[pf]);
        ring_at[pf % RECORD_RING] = pf;
        dp__table_prefetch(t, DP_TABLE_TAGGED, h);
      }
      size_t e = i + RECORD_ENTRY_AHEAD;
      if (e < n && ring_at[e % RECORD_RING] == e) {
        uint32_t ref = dp__table_ref(t, DP_TABLE_TAGGED, ring[e % RECORD_RING] & mask);
        if (ref) __builtin_prefetch(&mapped[ref - 1]);
      }
    }
    uint64_t h = prefetch && ring_at[i % RECORD_RING] == i ? ring[i % RECORD_RING] : dp__hash_ptr(ptrs[i]);
    size_t slot, at = dp__table_find(t, DP_TABLE_TAGGED, h, ents_eq, mapped, ptrs[i], &slot);
    if (DP_LIKELY(at != DP_TABLE_NONE) && mapped[at].stream == s) {
      /* The block itself is read only on entering another segment: the
       * entry alone decides every other record. */
      const segment_t *seg = mapped[at].b->seg;
      int same = seg->one_stream == s;
      run_base = same ? (uintptr_t)seg->base : 0;
      run_size = same ? seg->size : 0;
      if (owned) owned[i] = 1;
      i++;
      continue;
    }
    dp_error_t e; /* a pointer not of this allocator is skipped: err is written only on failure */
    rc = record_slow("record_stream", c, ptrs[i], at != DP_TABLE_NONE ? &mapped[at] : NULL, s, &e);
    if (rc == DP_ENOTFOUND) rc = 0;
    else if (rc && err) *err = e;
    else if (owned && rc == 0) owned[i] = 1;
    i++;
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static int hook_record_streams(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  return record_streams("record_streams", ctx, ptrs, n, s, NULL, err);
}

static int hook_record_streams_owned(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, unsigned char *owned,
                                     dp_error_t *err) {
  /* as the chain's: without owned, a record would say nothing of what it owns */
  if (n && !owned) return dp__err(err, DP_EINVAL, "record_streams_owned: NULL owned with n = %zu", n);
  return record_streams("record_streams_owned", ctx, ptrs, n, s, owned, err);
}

dp_cache_hooks_t dp_cache_hooks(dp_cache_t *c) {
  dp_cache_hooks_t h = {c, hook_record_stream, hook_record_streams, hook_record_streams_owned};
  return h;
}

/* The hooks are the caller's callbacks (base.h): a positive return would
 * read as success to a caller testing rc < 0, and a failure that left err
 * empty would complete a future with code 0 (DP_ESTATE) instead of the
 * hook's. So each runs with an error of its own, and its answer is made
 * one of the library's (dp__cb_rc) before it goes further. */
int dp_cache_hooks_record(const dp_cache_hooks_t *h, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  if (!h) return dp__err(err, DP_EINVAL, "dp_cache_hooks_record: NULL hooks");
  if (!h->record_streams && !h->record_stream) /* record_streams_owned alone cannot record (cache.h) */
    return dp__err(err, DP_EINVAL, "dp_cache_hooks_record: hooks with neither record_stream nor record_streams");
  if (n && !ptrs) return dp__err(err, DP_EINVAL, "dp_cache_hooks_record: NULL ptrs with n = %zu", n);
  dp_error_t e;
  dp_error_clear(&e);
  int rc = 0;
  if (h->record_streams) {
    rc = dp__cb_rc(h->record_streams(h->ctx, ptrs, n, s, &e), &e, "the record_streams hook");
  } else {
    for (size_t i = 0; i < n && rc == 0; i++) {
      dp_error_clear(&e); /* what a call that succeeded left is no failure's message */
      rc = h->record_stream(h->ctx, ptrs[i], s, &e);
      if (rc == DP_ENOTFOUND) rc = 0; /* not the allocator's: skipped (its message is cleared above, or never read) */
      rc = dp__cb_rc(rc, &e, "the record_stream hook");
    }
  }
  if (rc && err) *err = e;
  return rc;
}

int dp_cache_poll(dp_cache_t *c, dp_error_t *err) {
  if (!c) return dp__err(err, DP_EINVAL, "dp_cache_poll: NULL cache");
  pthread_mutex_lock(&c->mu);
  int n = poll_all(c);
  pthread_mutex_unlock(&c->mu);
  return n;
}

int dp_cache_empty(dp_cache_t *c, dp_error_t *err) {
  if (!c) return dp__err(err, DP_EINVAL, "dp_cache_empty: NULL cache");
  pthread_mutex_lock(&c->mu);
  poll_all(c);
  int rc = 0;
  dp_error_t e;
  for (int d = 0; d < c->ndev; d++) {
    int r = release_free_segments(c, &c->pools[d], &e);
    if (r && !rc) {
      rc = dp__err(err, r, "dp_cache_empty: a free segment of %s:%d stays cached: %s", dp_backend_name(c->b), d, e.message);
      if (err) err->backend_code = e.backend_code;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int dp_cache_lookup(dp_cache_t *c, const void *ptr, void **base, size_t *size, dp_error_t *err) {
  if (!c) return dp__err(err, DP_EINVAL, "dp_cache_lookup: NULL cache");
  pthread_mutex_lock(&c->mu);
  block_t *b = find_used(c, ptr);
  int found = b && b->state == B_USED;
  if (found) {
    if (base) *base = b->ptr;
    if (size) *size = b->size;
  }
  pthread_mutex_unlock(&c->mu);
  return found ? 0 : dp__err(err, DP_ENOTFOUND, "dp_cache_lookup(%p): not in a block allocated by this allocator", ptr);
}

int dp_cache_stats(dp_cache_t *c, dp_device_t dev, dp_cache_stats_t *out, dp_error_t *err) {
  if (!c || !out) return dp__err(err, DP_EINVAL, "dp_cache_stats: NULL %s", !c ? "cache" : "out");
  int rc = dp__check_device(__func__, c->b, dev, err);
  if (rc) return rc;
  pthread_mutex_lock(&c->mu);
  poll_all(c);
  *out = c->pools[dev.index].st;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

/* ---- the backends' default allocators ---- */

static pthread_mutex_t defaults_mu = PTHREAD_MUTEX_INITIALIZER;
/* Made under the lock, then read without it: every future asks for its
 * backend's (dp_future_new), and a lock there serialized threads that
 * complete futures at once. Published with release, read with acquire; only
 * dp_shutdown takes them back (no other call may run then). */
static _Atomic(dp_cache_t *) defaults[DP_DEVICE_TYPE_COUNT];

/* The caches come out under the lock and are freed after it is released:
 * freeing waits on streams, whose queued work may call dp_cache_default
 * (which takes the lock). A cache such work made meanwhile is freed by the
 * next round, before the backends go. */
void dp__cache_shutdown(void) {
  for (;;) {
    dp_cache_t *gone[DP_DEVICE_TYPE_COUNT];
    int any = 0;
    pthread_mutex_lock(&defaults_mu);
    for (int t = 0; t < DP_DEVICE_TYPE_COUNT; t++) {
      gone[t] = dp__load_relaxed(&defaults[t]);
      dp__store_relaxed(&defaults[t], NULL);
      any |= gone[t] != NULL;
    }
    pthread_mutex_unlock(&defaults_mu);
    if (!any) return;
    for (int t = 0; t < DP_DEVICE_TYPE_COUNT; t++)
      if (gone[t]) cache_destroy(gone[t]);
  }
}

dp_backend_t *dp__cache_backend(const dp_cache_t *c) { return c->b; }

int dp_cache_default(dp_backend_t *b, dp_cache_t **out, dp_error_t *err) {
  if (!b || !out) return dp__err(err, DP_EINVAL, "dp_cache_default: NULL %s", !b ? "backend" : "out");
  dp_device_type_t t = dp_backend_type(b);
  dp_cache_t *c = dp__load_acquire(&defaults[t]);
  if (c) {
    *out = c;
    return 0;
  }
  pthread_mutex_lock(&defaults_mu);
  int rc = 0;
  if (!(c = dp__load_relaxed(&defaults[t])) && (rc = dp_cache_new(b, &c, err)) == 0) {
    c->is_default = 1;
    dp__store_release(&defaults[t], c);
  }
  *out = rc ? NULL : c;
  pthread_mutex_unlock(&defaults_mu);
  return rc;
}
