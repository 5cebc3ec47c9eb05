/* pickler/ptrs.h — a pointer set frozen into one block: what the layers
 * above the pickler (the future) keep of a scan, read through
 * dp__ptrs_get() as the public record (dp_ptr_info_t, without paths)
 * without knowing the set's layout.
 *
 * Layout, for the memory a completed future holds (24 bytes an allocation
 * on one device): the bases in discovery order, then the rest of each
 * allocation, then — with more than one device — the bases again, grouped
 * by device, each device's run contiguous and in discovery order, since
 * that is what the allocator hooks take (dp_cache_hooks_record); with one
 * device the grouped bases are the bases themselves. A freeze is one
 * allocation, with room after it for the caller's own per-device data.
 * Immutable once made: threads read it without a lock. */
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
  void *block;
  size_t block_size;
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

/* Freezes set into *out, with `extra` bytes for the caller. An empty set
 * with no extra allocates nothing. DP_ENOMEM leaves *out empty. */
int dp__ptrs_freeze(dp__ptrs_t *out, const dp_ptrset_t *set, size_t extra, dp_error_t *err);
/* Frees the block (an empty or zeroed record is fine): the calling thread
 * keeps it for a later freeze (see ptrs.c), within a bound. */
void dp__ptrs_free(dp__ptrs_t *p);
/* Frees the blocks the calling thread keeps (its exit does it too). */
void dp__ptrs_recycle_drain(void);

#endif
