/*
 * devpickle/ptrset.h — the set of device allocations a value references.
 *
 * Entries are deduplicated by (device, base pointer), kept in the order they
 * were first met, and grouped by device. Each entry counts the distinct
 * tensors seen on it. A set is reused across scans: dp_ptrset_clear() keeps
 * its memory, so a steady-state scan allocates nothing.
 *
 * Thread safety: a set is not thread-safe; use one per thread.
 */
#ifndef DEVPICKLE_PTRSET_H
#define DEVPICKLE_PTRSET_H

#include "base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_ptrset dp_ptrset_t;

typedef struct dp_ptr_info {
  dp_device_t device;
  void *base;
  size_t nbytes;
  uint32_t refs;      /* distinct tensors on this storage */
  const char *path;   /* first path, when the scan asked for paths; else NULL.
                         Borrowed: valid until the set is cleared or freed. */
} dp_ptr_info_t;

/** A new, empty set. */
DP_API int dp_ptrset_new(dp_ptrset_t **out, dp_error_t *err);
/** Frees the set (NULL is fine). */
DP_API void dp_ptrset_free(dp_ptrset_t *set);
/** Empties the set, keeping its memory for the next scan. */
DP_API void dp_ptrset_clear(dp_ptrset_t *set);

/** Adds an allocation (or finds it) and counts one more tensor on it.
 *  *index (may be NULL) receives its position in discovery order. When the
 *  same base is met with another size the larger size is kept. */
DP_API int dp_ptrset_add(dp_ptrset_t *set, dp_device_t device, void *base, size_t nbytes,
                         size_t *index, dp_error_t *err);
/** Position of (device, base), or DP_ENOTFOUND. */
DP_API int dp_ptrset_find(const dp_ptrset_t *set, dp_device_t device, const void *base,
                          size_t *index);

DP_API size_t dp_ptrset_count(const dp_ptrset_t *set);
/** Entry i in discovery order. DP_EINVAL when out of range. */
DP_API int dp_ptrset_get(const dp_ptrset_t *set, size_t i, dp_ptr_info_t *out);

/** Devices in the order first met. */
DP_API size_t dp_ptrset_ndevices(const dp_ptrset_t *set);
DP_API dp_device_t dp_ptrset_device(const dp_ptrset_t *set, size_t j);
/** Number of entries on device j. */
DP_API size_t dp_ptrset_device_count(const dp_ptrset_t *set, size_t j);
/** First entry on device j, then the next on the same device, in discovery
 *  order; SIZE_MAX at the end. */
DP_API size_t dp_ptrset_first_on(const dp_ptrset_t *set, size_t j);
DP_API size_t dp_ptrset_next_on(const dp_ptrset_t *set, size_t i);

#ifdef __cplusplus
}
#endif
#endif
