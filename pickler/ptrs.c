/* pickler/ptrs.c — freezing a pointer set (ptrs.h).
 *
 * A completion's record is its scratch set's block, taken (ptrs.h); the set
 * gets another block of the size it needed. Blocks are recycled per thread:
 * a runtime completes and releases futures all the time, and a block of a
 * large value is hundreds of kilobytes: handed back to malloc, such blocks
 * are unmapped or trimmed from the heap's top and every new completion pays
 * page faults for memory it writes once (a fifth of a 1,000-tensor
 * completion here, more under a hypervisor). A thread keeps up to
 * RECYCLE_MAX freed blocks of at most RECYCLE_BLOCK_MAX bytes,
 * RECYCLE_BYTES_MAX in all; a set's new block, or a copy, is a kept block
 * that fits, if it is at most twice the size needed (the most recently kept
 * such block). Kept blocks go at thread exit and in
 * dp__ptrs_recycle_drain(). */
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "ptrs.h"
#include "ptrset_impl.h"

static size_t align_up(size_t n) {
  size_t a = _Alignof(max_align_t);
  return (n + a - 1) / a * a;
}

#define RECYCLE_MAX 32
#define RECYCLE_BLOCK_MAX ((size_t)1 << 20)
#define RECYCLE_BYTES_MAX ((size_t)8 << 20)

typedef struct recycle {
  void *block[RECYCLE_MAX];
  size_t size[RECYCLE_MAX];
  int n;
  size_t bytes;
  int armed;  /* the thread-exit drain is registered */
} recycle_t;

static _Thread_local recycle_t recycle;
static pthread_key_t recycle_key;
static pthread_once_t recycle_once = PTHREAD_ONCE_INIT;

void dp__ptrs_recycle_drain(void) {
  recycle_t *r = &recycle;
  for (int i = 0; i < r->n; i++) dp__free(r->block[i], r->size[i]);
  r->n = 0;
  r->bytes = 0;
}

/* At thread exit. A block freed after this (a future released by a later
 * destructor) arms the key again, and the next destructor round frees it. */
static void recycle_exit(void *p) {
  (void)p;
  dp__ptrs_recycle_drain();
  recycle.armed = 0;
}

static void recycle_init(void) { pthread_key_create(&recycle_key, recycle_exit); }

/* The most recently kept block that fits (completions of values of one
 * shape ask for one size: the first probe takes it). */
static inline void *block_get(size_t size, size_t *got) {
  recycle_t *r = &recycle;
  int best = r->n - 1;
  while (best >= 0 && (r->size[best] < size || r->size[best] / 2 > size)) best--;
  if (best < 0) {
    *got = size;
    return dp__alloc(size);
  }
  void *b = r->block[best];
  *got = r->size[best];
  r->bytes -= r->size[best];
  r->n--;
  r->block[best] = r->block[r->n];
  r->size[best] = r->size[r->n];
  return b;
}

static void block_put(void *b, size_t size) {
  recycle_t *r = &recycle;
  if (size > RECYCLE_BLOCK_MAX || r->n == RECYCLE_MAX || r->bytes + size > RECYCLE_BYTES_MAX) {
    dp__free(b, size);
    return;
  }
  if (!r->armed) {  /* once a thread: its blocks go when it exits */
    pthread_once(&recycle_once, recycle_init);
    if (pthread_setspecific(recycle_key, r) != 0) {
      dp__free(b, size);
      return;
    }
    r->armed = 1;
  }
  r->block[r->n] = b;
  r->size[r->n++] = size;
  r->bytes += size;
}

size_t dp__ptrs_block_size(size_t cap) {
  if (cap > (SIZE_MAX - DP__PTRS_TAIL - 64) / (sizeof(void *) + sizeof(dp__ptrs_rest_t))) return 0;
  return align_up(cap * (sizeof(void *) + sizeof(dp__ptrs_rest_t))) + DP__PTRS_TAIL;
}

size_t dp__ptrs_block_cap(size_t size) {
  if (size < DP__PTRS_TAIL) return 0;
  size_t cap = (size - DP__PTRS_TAIL) / (sizeof(void *) + sizeof(dp__ptrs_rest_t));
  if (cap && dp__ptrs_block_size(cap) > size) cap--;  /* the alignment took one entry's room */
  return cap;
}

/* The arrays of a block laid out for cap entries. */
static void block_arrays(void *block, size_t cap, void ***bases, dp__ptrs_rest_t **rest, char **tail) {
  *bases = block;
  *rest = (dp__ptrs_rest_t *)(*bases + cap);
  *tail = (char *)block + dp__ptrs_block_size(cap) - DP__PTRS_TAIL;
}

/* Gives set a block of room for at least cap entries, from the kept blocks
 * when one fits (its arrays empty): the set had none (its own went to a
 * record). Without memory it stays without: its next insert grows it. */
static void rearm(dp_ptrset_t *set, size_t cap) {
  size_t size = dp__ptrs_block_size(cap), got;
  void *b = size ? block_get(size, &got) : NULL;
  if (!b) return;
  char *tail;
  set->block = b;
  set->block_size = got;
  set->sized = 1;
  set->cap = dp__ptrs_block_cap(got);
  block_arrays(b, set->cap, &set->bases, &set->rest, &tail);
}

int dp__ptrs_freeze(dp__ptrs_t *out, dp_ptrset_t *set, int take, size_t extra, dp_error_t *err) {
  size_t n = set->count, ng = set->ngroups;
  *out = (dp__ptrs_t){0};
  /* The devices and extra: in the tail when they fit and nothing is
   * grouped; else in a block of their own, with the grouped bases. Sizes
   * are bounded by memory the set already holds: no overflow before extra. */
  size_t grouped = ng > 1 ? n : 0;
  size_t devs_size = align_up(ng * sizeof(dp__ptrs_dev_t)), head = align_up(devs_size + grouped * sizeof(void *));
  int in_tail = !grouped && head <= DP__PTRS_TAIL && extra <= DP__PTRS_TAIL - head;
  size_t meta = 0;
  if (!in_tail && dp__add_ovf(head, extra, &meta)) return dp__err(err, DP_ENOMEM, "out of memory freezing %zu allocations", n);
  if (!n && !extra) return 0;
  size_t cap;
  char *tail;
  /* The set's block becomes the record's when little of it is unused (a
   * record holds its allocations' 24 bytes each, and not much more); the
   * set then gets a block of just the size this one needed, so that the
   * next scan of a value of the same shape fills it and gives it in turn. */
  if (take && n && set->block && set->cap - n <= n / 16 + 8) {
    out->block = set->block;
    out->block_size = set->block_size;
    cap = set->cap;
  } else {
    size_t size = dp__ptrs_block_size(n);
    if (!size || !(out->block = block_get(size, &out->block_size))) goto oom;
    cap = dp__ptrs_block_cap(out->block_size);
  }
  block_arrays(out->block, cap, &out->bases, &out->rest, &tail);
  if (!in_tail && !(out->meta = block_get(meta, &out->meta_size))) goto oom;
  char *m = in_tail ? tail : out->meta;
  out->devs = (dp__ptrs_dev_t *)m;
  out->by_dev = grouped ? (void **)(m + devs_size) : out->bases;
  out->extra = extra ? m + head : NULL;
  out->n = n;
  out->ndevs = ng;
  out->raw = set->raw;
  if (n && out->block != set->block) {
    if (n <= 8) {  /* a small value: no call */
      for (size_t i = 0; i < n; i++) {
        out->bases[i] = set->bases[i];
        out->rest[i] = set->rest[i];
      }
    } else {
      memcpy(out->bases, set->bases, n * sizeof *out->bases);
      memcpy(out->rest, set->rest, n * sizeof *out->rest);
    }
  }
  size_t pos = 0;
  for (size_t g = 0; g < ng; g++) {
    out->devs[g] = (dp__ptrs_dev_t){set->groups[g].device, pos, set->groups[g].count};
    if (ng == 1) pos = n;  /* one device: by_dev is bases */
    else
      for (uint32_t i = set->groups[g].head + 1; i; i = set->next_on[i - 1]) out->by_dev[pos++] = set->bases[i - 1];
  }
  /* Taken: the set starts again, empty. Copied, the set's block being too
   * large for a record (it grew by doubling): the set, now empty, gets one
   * of just this size, which the next completion of a value of this shape
   * takes. Much smaller values leave the set as it is, and so does a set
   * that outgrew a block of the size it was given (a scan may reserve room
   * for storages it then finds in the set already): it keeps its larger
   * block, and its completions copy, rather than growing and shrinking
   * every time. */
  int taken = out->block == set->block;
  if (taken || (take && !set->sized && n >= set->cap / 2)) {
    if (!taken) dp__free(set->block, set->block_size);
    set->block = NULL;
    set->block_size = 0;
    set->bases = NULL;
    set->rest = NULL;
    dp_ptrset_clear(set);
    set->cap = 0;
    rearm(set, n);
  }
  return 0;
oom:
  if (out->block && out->block != set->block) block_put(out->block, out->block_size);
  memset(out, 0, sizeof *out);
  return dp__err(err, DP_ENOMEM, "out of memory freezing %zu allocations", n);
}

void dp__ptrs_free(dp__ptrs_t *p) {
  if (p->block) block_put(p->block, p->block_size);
  if (p->meta) block_put(p->meta, p->meta_size);
  memset(p, 0, sizeof *p);
}

int dp__ptrs_distinct(const dp__ptrs_t *raw, dp__ptrs_t *out, dp_error_t *err) {
  *out = (dp__ptrs_t){0};
  dp_ptrset_t *set;
  int rc = dp_ptrset_new(&set, err);
  if (rc) return rc;
  if (dp__ptrset_reserve(set, raw->n) != 0) rc = dp__err(err, DP_ENOMEM, "out of memory listing %zu allocations", raw->n);
  for (size_t i = 0; rc == 0 && i < raw->n; i++) {
    const dp__ptrs_rest_t *r = &raw->rest[i];
    size_t at;
    if ((rc = dp_ptrset_add(set, r->device, raw->bases[i], r->nbytes, &at, err)) == 0 && r->refs > 1)
      dp__ptrset_add_refs(set, at, r->refs - 1);
  }
  if (rc == 0) rc = dp__ptrs_freeze(out, set, 0, 0, err);
  dp_ptrset_free(set);
  return rc;
}
