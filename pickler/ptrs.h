/* pickler/ptrs.h — a pointer set frozen into a record: what the layers
 * above the pickler (the future) keep of a scan, read through
 * dp__ptrs_get() as the public record (dp_ptr_info_t, without paths)
 * without knowing the set's layout.
 *
 * Layout, for the memory a completed future holds (24 bytes an allocation
 * on one device): the bases in discovery order, then the rest of each
 * allocation, in one block — the layout of a pointer set's own block
 * (ptrset_impl.h), so that a completion takes its scratch set's block as
 * the record (no copy) and gives the set another. With more than one device
 * the bases are also kept grouped by device, each device's run contiguous
 * and in discovery order, since that is what the allocator hooks take
 * (dp_cache_hooks_record); with one device the grouped bases are the bases
 * themselves. The devices and the caller's per-device data go in the
 * block's tail (DP__PTRS_TAIL bytes) when they fit, else in a second block
 * with the grouped bases. Immutable once made: threads read it without a
 * lock. A record frozen from a raw set (dp__ptrset_set_raw) may hold an
 * allocation more than once: dp__ptrs_distinct makes the list. */
#ifndef DP_PICKLER_PTRS_H
#define DP_PICKLER_PTRS_H

#include "devpickle/ptrset.h"

typedef struct dp__ptrs_dev {
  dp_device_t device;
  size_t first, count;  /* this device's bases: by_dev[first .. first + count) */
} dp__ptrs_dev_t;

/* An allocation but its base; read it through dp__ptrs_get. */
typedef struct dp__ptrs_rest {
  size_t nbytes;
  uint32_t refs;
  dp_device_t device;
} dp__ptrs_rest_t;

typedef struct dp__ptrs {
  int raw;                /* frozen from a raw set: an allocation may be there more than once */
  void *block;            /* bases, rest (and the tail): a set's block or a copy */
  size_t block_size;
  void *meta;             /* devs, grouped bases, extra, when not in the tail */
  size_t meta_size;
  size_t n;
  void **bases;           /* n, discovery order */
  dp__ptrs_rest_t *rest;  /* n, discovery order */
  void **by_dev;          /* n bases, grouped by device */
  dp__ptrs_dev_t *devs;   /* every device of the set, in the order first met */
  size_t ndevs;
  void *extra;            /* the caller's extra bytes (max_align_t aligned) */
} dp__ptrs_t;

/* Allocation i (i < p->n) as the public record; its path is NULL. */
static inline void dp__ptrs_get(const dp__ptrs_t *p, size_t i, dp_ptr_info_t *out) {
  const dp__ptrs_rest_t *r = &p->rest[i];
  *out = (dp_ptr_info_t){r->device, p->bases[i], r->nbytes, r->refs, NULL};
}

/* Bytes after a block's two arrays, for a small record's devices and extra. */
#define DP__PTRS_TAIL 128u

/* A block of `size` bytes laid out for `cap` entries: bases at the start,
 * the rest after bases[cap], the tail after rest[cap]. */
size_t dp__ptrs_block_size(size_t cap);   /* 0 on overflow */
size_t dp__ptrs_block_cap(size_t size);

/* Freezes set into *out, with `extra` bytes for the caller. take: the set
 * is the caller's scratch — its block becomes the record's, and the set,
 * now empty, gets another (from the thread's kept blocks when one fits);
 * else the set is copied and left as it was. An empty set with no extra
 * allocates nothing. DP_ENOMEM leaves *out empty and the set as it was. */
int dp__ptrs_freeze(dp__ptrs_t *out, dp_ptrset_t *set, int take, size_t extra, dp_error_t *err);
/* Frees the blocks (an empty or zeroed record is fine): the calling thread
 * keeps them for a later freeze or set (see ptrs.c), within a bound. */
void dp__ptrs_free(dp__ptrs_t *p);
/* Counts extra more tensors on allocation i of s (saturating). */
void dp__ptrset_add_refs(dp_ptrset_t *s, size_t i, uint32_t extra);
/* Empties s and makes it raw or not (the default): a raw set appends
 * what it is given without looking it up (an allocation right after
 * itself still counts on its entry), which is what a completion needs: its
 * record feeds the streams' records and the events, where an allocation
 * met twice is recorded twice to the same effect. Raw sets are the future's
 * and a binding's own: dp_ptrset_find and indices mean nothing in them,
 * and no raw set is handed to a caller. */
void dp__ptrset_set_raw(dp_ptrset_t *s, int raw);
/* The allocations of a raw record each once, in the order first met, with
 * refs summed and the largest nbytes (what a set that is not raw would
 * have held), into *out (a record to dp__ptrs_free). DP_ENOMEM. */
int dp__ptrs_distinct(const dp__ptrs_t *raw, dp__ptrs_t *out, dp_error_t *err);
/* Frees the blocks the calling thread keeps (its exit does it too). */
void dp__ptrs_recycle_drain(void);

#endif
