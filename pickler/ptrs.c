/* pickler/ptrs.c — freezing a pointer set (ptrs.h).
 *
 * Blocks are recycled per thread. A runtime completes and releases futures
 * all the time, and a freeze block of a large value is hundreds of
 * kilobytes: handed back to malloc, such blocks are unmapped or trimmed
 * from the heap's top and every new completion pays page faults for
 * memory it writes once (a fifth of a 1,000-tensor completion here, more
 * under a hypervisor). A thread keeps up to RECYCLE_MAX freed blocks of at
 * most RECYCLE_BLOCK_MAX bytes, RECYCLE_BYTES_MAX in all; a freeze takes
 * a kept block that fits, if it is at most twice the size needed (the
 * most recently kept such block). Kept blocks go at thread exit
 * and in dp__ptrs_recycle_drain(). */
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

int dp__ptrs_freeze(dp__ptrs_t *out, const dp_ptrset_t *set, size_t extra, dp_error_t *err) {
  size_t n = set->count, ng = set->ngroups, grouped = ng > 1 ? n : 0;
  /* Bounded by memory the set already holds: no overflow before extra. */
  size_t head = align_up(n * (sizeof(void *) + sizeof(dp__ptrs_rest_t)) + grouped * sizeof(void *) +
                         ng * sizeof(dp__ptrs_dev_t));
  size_t size;
  out->block = NULL;
  if (dp__add_ovf(head, extra, &size) || (size && !(out->block = block_get(size, &size)))) {
    memset(out, 0, sizeof *out);
    return dp__err(err, DP_ENOMEM, "out of memory freezing %zu allocations", n);
  }
  out->block_size = size;
  out->bases = out->block;
  out->rest = (dp__ptrs_rest_t *)(out->bases + n);
  out->by_dev = ng > 1 ? (void **)(out->rest + n) : out->bases;
  out->devs = (dp__ptrs_dev_t *)((void **)(out->rest + n) + grouped);
  out->extra = extra ? (char *)out->block + head : NULL;
  out->n = n;
  out->ndevs = ng;
  const dp__pentry_t *en = set->entries;
  for (size_t i = 0; i < n; i++) {
    out->bases[i] = en[i].base;
    out->rest[i] = (dp__ptrs_rest_t){en[i].nbytes, en[i].refs, en[i].device};
  }
  size_t pos = 0;
  for (size_t g = 0; g < ng; g++) {
    out->devs[g] = (dp__ptrs_dev_t){set->groups[g].device, pos, set->groups[g].count};
    if (ng == 1) pos = n;  /* one device: by_dev is bases */
    else
      for (uint32_t i = set->groups[g].head + 1; i; i = en[i - 1].next_on) out->by_dev[pos++] = en[i - 1].base;
  }
  return 0;
}

void dp__ptrs_free(dp__ptrs_t *p) {
  if (p->block) block_put(p->block, p->block_size);
  memset(p, 0, sizeof *p);
}
