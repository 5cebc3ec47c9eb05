/* devpickle.h — the whole public API. */
#ifndef DEVPICKLE_H
#define DEVPICKLE_H
#include "devpickle/base.h"
#include "devpickle/value.h"
#include "devpickle/ptrset.h"
#include "devpickle/pickler.h"
#include "devpickle/device.h"
#include "devpickle/cache.h"
#include "devpickle/future.h"
#include "devpickle/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Tears the library's process-wide state down, top layer first:
 *   1. futures: the calling thread's scratch pointer set and the record
 *      blocks it kept from released futures (other threads' are freed
 *      when those threads exit);
 *   2. caches: the backends' default caching allocators (dp_cache_default):
 *      each waits for its pending blocks and gives its segments back;
 *   3. devices: every backend stops (queued host work completes, host
 *      threads are joined, pooled streams and events destroyed); the stream
 *      provider and every thread's current streams are forgotten (another
 *      thread's at its next current-stream call).
 *  Before calling it, free what you own that stands on a backend (your
 *  futures, caches from dp_cache_new, streams from dp_stream_new and
 *  events from dp_event_new), and
 *  release your values and call dp_value_collect() if their release
 *  callbacks give device memory back — on every thread that released such
 *  values (a cycle released on a thread waits in that thread's candidates,
 *  which only that thread's dp_value_collect(), or its exit, frees: collect
 *  there, or let those threads exit, first). Afterwards no backend, stream, event
 *  or cache pointer may be used; a later dp_backend_get() starts afresh.
 *  The allocator hook (dp_set_allocator) is left as it is. Not thread-safe:
 *  call it when no other thread uses devpickle. From a host function
 *  (dp_host_launch), whose worker it would join, it does nothing but say
 *  so on stderr (device.h); so too from a future's callback, the walk that
 *  completes a future or the release of one, whose futures are still held
 *  (future.h, SHUTDOWN). */
DP_API void dp_shutdown(void);

#ifdef __cplusplus
}
#endif
#endif
