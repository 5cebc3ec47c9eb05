/* transport/shm.h — shared-memory segments of staging slots, for peers on
 * one host (docs/TRANSPORT.md, "Same-host slots"). A segment is one page of
 * header (magic, token) and nslots slots of slot_bytes, named
 * "/devpickle-PID-N-RANDOM", mode 0600, its pages reserved at creation
 * (posix_fallocate), page-locked by the backend in each process that maps
 * it (no backend, NULL: not page-locked; same-host lanes pass their
 * address so). A process maps only a segment of its own user with mode 0600. Reference-counted: the last release unregisters and
 * unmaps it (and removes the name, if its creator has not yet). Not
 * thread-safe: the transport's progress thread owns its segments. */
#ifndef DP_TRANSPORT_SHM_H
#define DP_TRANSPORT_SHM_H

#include <stdint.h>

#include "devpickle/device.h"

typedef struct dp__shm dp__shm_t;

#define DP__SHM_NAME_MAX 64
#define DP__SHM_MAX_SLOTS 64u

/** Creates, maps and registers a segment of nslots slots; its token is
 *  random. Errors: DP_EIO (shm_open, ftruncate, mmap with errno's text),
 *  the backend's (registering), DP_ENOMEM. */
int dp__shm_create(dp_backend_t *b, unsigned nslots, size_t slot_bytes, dp__shm_t **out, dp_error_t *err);
/** Maps a peer's segment read-only after checking what the peer claims:
 *  the name's form, nslots (1..DP__SHM_MAX_SLOTS), the file's size, the
 *  header's magic and token. DP_EFORMAT for a bad name or claim, DP_EIO
 *  when it cannot be opened (another host), the backend's errors. */
int dp__shm_map(dp_backend_t *b, const char *name, unsigned nslots, size_t slot_bytes, uint64_t token,
                dp__shm_t **out, dp_error_t *err);
/** Removes the names this user's processes that died left in /dev/shm
 *  (killed between an offer and its answer): "devpickle-PID-..." whose PID
 *  no longer exists and that are over 60 s old (offers live 2 s). */
void dp__shm_sweep(void);
/** The age in seconds from which sweep removes a dead process's name (60;
 *  a test hook). */
extern int dp__shm_stale_s;
const char *dp__shm_name(const dp__shm_t *s);
uint64_t dp__shm_token(const dp__shm_t *s);
/** Slot i's memory. */
uint8_t *dp__shm_slot(const dp__shm_t *s, unsigned i);
/** Removes the name (the creator, once the peer mapped it or will not). */
void dp__shm_unlink(dp__shm_t *s);
dp__shm_t *dp__shm_retain(dp__shm_t *s);
void dp__shm_release(dp__shm_t *s);

#endif
