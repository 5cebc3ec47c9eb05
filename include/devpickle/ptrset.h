/*
 * devpickle/ptrset.h — the set of device allocations a value references.
 *
 * Entries are deduplicated by (device, base pointer), kept in the order they
 * were first met, and grouped by device. Each entry counts the distinct
 * tensors seen on it by each scan (or add): a scan counts a tensor once,
 * and a scan of the same value into a set not cleared meanwhile counts
 * them again. A set is reused across scans: dp_ptrset_clear() keeps
 * its memory, paths included, and the set keeps what dp_scan works with
 * until it is freed, so a steady-state scan allocates nothing, with or
 * without DP_SCAN_PATHS.
 *
 * Paths (docs/FORMAT.md, "Paths") are bounded, whatever the value:
 *   - a dict key, attribute name or class/type name shows at most its first
 *     DP_PATH_NAME_MAX bytes (a str key or a name: of the text itself, before
 *     escaping; any other key: of its JSON text), cut back to a UTF-8
 *     character boundary (and, in a key's JSON text, to the start of an
 *     escape it splits) and followed by "…" (U+2026) when anything was cut;
 *     the notation (.name or ["name"]) is chosen from the part shown;
 *   - a path longer than DP_PATH_MAX bytes keeps "$" and the leading steps
 *     that fit in DP_PATH_HEAD bytes, then "<…N steps…>" (N the steps left
 *     out; "<…1 step…>" for one), then the trailing steps that fit in
 *     DP_PATH_TAIL bytes.
 * A path is therefore at most DP_PATH_MAX bytes, and rendering it costs time
 * bounded by its length, not by the depth or the names' lengths.
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

#define DP_PATH_NAME_MAX 64   /* bytes of one key or name shown in a path */
#define DP_PATH_MAX 1024      /* bytes of a whole path */
#define DP_PATH_HEAD 256      /* an elided path: bytes of its head ("$" included) */
#define DP_PATH_TAIL 704      /* an elided path: bytes of its tail */
/* Entries in one set (2^32 - 3; positions are 32-bit). One more is DP_ELIMIT,
 * by whichever call (add, add_many, scan) it would be added. */
#define DP_PTRSET_MAX_ENTRIES 4294967293u

typedef struct dp_ptr_info {
  dp_device_t device;
  void *base;
  size_t nbytes;
  uint32_t refs;      /* distinct tensors on this storage, summed over the scans and adds
                         since the set was cleared (UINT32_MAX: that many or more) */
  const char *path;   /* the path where the entry was added, when the scan
                         that added it asked for paths; else NULL (a later
                         scan with paths that meets the entry again leaves it
                         so). At most DP_PATH_MAX bytes (see above). Borrowed:
                         valid until the set is cleared or freed. */
} dp_ptr_info_t;

/** A new, empty set. */
DP_API int dp_ptrset_new(dp_ptrset_t **out, dp_error_t *err);
/** Frees the set (NULL is fine). */
DP_API void dp_ptrset_free(dp_ptrset_t *set);
/** Empties the set, keeping its memory for the next scan. */
DP_API void dp_ptrset_clear(dp_ptrset_t *set);

/** Adds an allocation (or finds it) and counts one more tensor on it.
 *  *index (may be NULL) receives its position in discovery order. When the
 *  same base is met with another size the larger size is kept. DP_EINVAL
 *  for a NULL set or a device no storage can have (a type past
 *  DP_DEVICE_HOST, or cpu with an index but 0: dp_storage_new refuses them
 *  too), DP_ENOMEM, and DP_ELIMIT when a new entry would pass
 *  DP_PTRSET_MAX_ENTRIES; each changes nothing. */
DP_API int dp_ptrset_add(dp_ptrset_t *set, dp_device_t device, void *base, size_t nbytes,
                         size_t *index, dp_error_t *err);
/** Adds n allocations in order, with the result of n dp_ptrset_add calls
 *  (items[i].refs and .path are ignored), at less cost a pointer: each
 *  device's hash key is derived once and the table's slots are fetched
 *  ahead. indices (may be NULL) receives each item's position. Room for n
 *  new entries is made first, so DP_ELIMIT comes when the count plus n
 *  would pass DP_PTRSET_MAX_ENTRIES, even if some items are in the set
 *  already.
 *  DP_EINVAL (an invalid device, naming the item), DP_ENOMEM or DP_ELIMIT
 *  change nothing; DP_ENOMEM for the first item of a new device leaves the
 *  items before it added. */
DP_API int dp_ptrset_add_many(dp_ptrset_t *set, const dp_ptr_info_t *items, size_t n, size_t *indices,
                              dp_error_t *err);
/** Position of (device, base) in *index (may be NULL), or DP_ENOTFOUND. */
DP_API int dp_ptrset_find(const dp_ptrset_t *set, dp_device_t device, const void *base,
                          size_t *index, dp_error_t *err);

/** Number of entries (allocations) in the set. */
DP_API size_t dp_ptrset_count(const dp_ptrset_t *set);
/** Entry i in discovery order. DP_EINVAL when out of range. */
DP_API int dp_ptrset_get(const dp_ptrset_t *set, size_t i, dp_ptr_info_t *out, dp_error_t *err);

/** Devices in the order first met. */
DP_API size_t dp_ptrset_ndevices(const dp_ptrset_t *set);
/** Device j (0 <= j < dp_ptrset_ndevices). Out of range, or a NULL set:
 *  {DP_DEVICE_CPU, 0} — check j against dp_ptrset_ndevices first, since
 *  that value is also a real device. */
DP_API dp_device_t dp_ptrset_device(const dp_ptrset_t *set, size_t j);
/** Number of entries on device j; 0 when out of range. */
DP_API size_t dp_ptrset_device_count(const dp_ptrset_t *set, size_t j);
/** First entry on device j, then the next on the same device, in discovery
 *  order; SIZE_MAX at the end. */
DP_API size_t dp_ptrset_first_on(const dp_ptrset_t *set, size_t j);
DP_API size_t dp_ptrset_next_on(const dp_ptrset_t *set, size_t i);

#ifdef __cplusplus
}
#endif
#endif
