/*
 * devpickle/device.h — backends, streams, events, device memory.
 *
 * A backend is a table of operations on one kind of device: `cuda` (the CUDA
 * runtime) or `host` (an asynchronous executor on the CPU that behaves like
 * a GPU: one worker thread per stream, work in order, events marking
 * positions in streams). Both are built in; `host` stands in where no GPU
 * exists and lets tests prove ordering with real concurrency.
 *
 * Streams and events behave as CUDA's do: work on one stream runs in order;
 * an event recorded on a stream completes when all work queued before the
 * record has; a stream told to wait on an event runs nothing queued after
 * the wait until the event completes, without blocking the host. A
 * never-recorded event counts as complete. Default streams do not
 * synchronize implicitly with other streams (CUDA's non-blocking streams).
 *
 * Thread safety: every function here may be called from any thread, except
 * that a stream must not be destroyed while another thread uses it, and an
 * event must not be released while another thread uses it.
 *
 * Errors and NULL: every function that can fail returns an int code (0,
 * or a negative DP_E*; the queries return 1 or 0 on success) and, when err
 * is not NULL, fills *err with the code and a message naming the function
 * or the device. A NULL handle or out pointer passed to such a function is
 * DP_EINVAL, reported like any other error. Backend codes come through as
 * the backend gave them (DP_ECUDA with the cudaError_t in
 * err->backend_code, DP_ENOMEM, ...). The _free functions accept NULL and do
 * nothing. The accessors (dp_backend_name, dp_stream_device, ...) cannot
 * fail: for a NULL handle they return a neutral value (base.h): NULL, 0,
 * DP_DEVICE_CPU or {DP_DEVICE_CPU, 0}.
 *
 * Lifetime: backends are process-wide and live until dp_shutdown()
 * (devpickle.h), which stops them after the caches and futures above them.
 * Streams from dp_stream_default(), dp_stream_pool_next() and
 * dp_stream_wrap() belong to the backend; streams from dp_stream_new()
 * belong to the caller, who frees them before dp_shutdown(): one still
 * held then is stopped with its backend (`host`: its queued work
 * completes and its thread is joined; `cuda`: the CUDA stream is left to
 * the runtime, neither synchronized nor destroyed) but its handle is not
 * freed, and may not be used or freed afterwards.
 * Events from dp_event_new are the caller's likewise: give them back
 * (dp_event_free) before dp_shutdown(), which frees only the pools; one
 * still held then stays allocated (the allocator hook sees it live) and
 * may be neither used nor freed afterwards. dp_shutdown() also forgets the current streams of every thread
 * (dp_set_current_stream: they were the stopped backends'), each thread's
 * at its next call here, so that none hands out a freed stream. Host work
 * still queued when dp_shutdown() runs completes before it returns; if that
 * work calls dp_backend_get() it gets a new backend, which the next
 * dp_shutdown() stops. dp_shutdown() called from a host function
 * (dp_host_launch) tears nothing down — it would wait for that very
 * function — and says so in a line on stderr.
 */
#ifndef DEVPICKLE_DEVICE_H
#define DEVPICKLE_DEVICE_H

#include "base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_backend dp_backend_t;
typedef struct dp_stream dp_stream_t;
typedef struct dp_event dp_event_t;

/* ---- backends ---- */

/** The backend for DP_DEVICE_CUDA or DP_DEVICE_HOST. CUDA without a usable
 *  driver or device (or in a build without CUDA) is DP_ENODEV, with the
 *  reason in err; that answer is kept: later calls return it without asking
 *  the driver again, until dp_shutdown(). Any other type (DP_DEVICE_CPU
 *  included) is DP_EINVAL, and so is `host` when DEVPICKLE_HOST_DEVICES,
 *  read as the host backend starts (its first dp_backend_get, or the first
 *  after dp_shutdown), is set to anything but an integer in 1..64 (its
 *  text in the message; set but empty counts as unset). */
DP_API int dp_backend_get(dp_device_type_t type, dp_backend_t **out, dp_error_t *err);

/** The default backend: `cuda` when a GPU is usable, else `host`. The
 *  environment variable DEVPICKLE_BACKEND=host|cuda forces one (lower
 *  case; any other non-empty value is DP_EINVAL, naming it); forcing
 *  `cuda` without a GPU is DP_ENODEV, never a fallback. `host` stands in
 *  only for DP_ENODEV: another failure of `cuda` (DP_ENOMEM starting it)
 *  is returned as it is. */
DP_API int dp_backend_default(dp_backend_t **out, dp_error_t *err);

/** The backend's device type and name. */
DP_API dp_device_type_t dp_backend_type(const dp_backend_t *b);
DP_API const char *dp_backend_name(const dp_backend_t *b);   /* "cuda", "host" */
/** Number of devices: CUDA's device count; for `host`, DEVPICKLE_HOST_DEVICES
 *  (1..64, default 2). */
DP_API int dp_backend_device_count(const dp_backend_t *b);
/** dp_device_t {type, index} for device index of this backend;
 *  {DP_DEVICE_CPU, 0} for an index outside 0 .. device count - 1. */
DP_API dp_device_t dp_backend_device(const dp_backend_t *b, int index);

/* ---- streams ---- */

/** A new stream on dev (the caller's; destroy it with dp_stream_free). */
DP_API int dp_stream_new(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err);
/** Waits for the stream's work, then destroys it. Streams the backend owns
 *  (default, pool and wrapped streams) are left alone, and so is s when
 *  called from a host function (dp_host_launch) on s itself, or on a
 *  stream for whose work queued after the function s waits (through
 *  dp_stream_wait_event or wait_stream, down any chain of such waits): that
 *  wait would wait for the function itself (a line on stderr says so, and
 *  s stays usable). The calling thread stops
 *  using s as its current stream (dp_set_current_stream); another thread
 *  that made s current must reset it (dp_reset_current_stream) first. Call
 *  it once per stream from dp_stream_new: s is gone after it, and a second
 *  call reads freed memory (undetected), as free(3) does. NULL: nothing. */
DP_API void dp_stream_free(dp_stream_t *s);
/** The device's default stream, owned by the backend (made on first use:
 *  the backend's error when that fails). DP_EINVAL for a device of another
 *  backend. */
DP_API int dp_stream_default(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err);
/** The next stream of the device's pool (4 streams, round-robin), owned by
 *  the backend; errors as dp_stream_default. */
DP_API int dp_stream_pool_next(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err);

/** A stream over a native stream that the caller (a framework: PyTorch,
 *  CuPy) owns: for `cuda`, a cudaStream_t of dev; for `host`, the
 *  dp_stream_native() handle of a live host stream of dev. Work queued
 *  through it, events recorded on it and waits made by it happen on the
 *  native stream itself, in order with the framework's own work there; it
 *  is a stream like any other for events, waits, dp_set_current_stream,
 *  the stream provider and the caching allocator.
 *
 *  Cached: the backend keeps one wrapper per (device, native handle), so
 *  wrapping the same handle again returns the same dp_stream_t, found
 *  without a lock (made under the device's lock on the first call). The
 *  wrapper belongs to the backend and lives until dp_shutdown:
 *  dp_stream_free on it does nothing, and nothing in devpickle destroys or
 *  synchronizes the native stream on its own.
 *
 *  The native stream must outlive every use of the wrapper, including
 *  memory of a caching allocator allocated or recorded on it and futures
 *  whose events are on it (PyTorch's pool streams are never destroyed).
 *  The one exception is a native handle of a stream from dp_stream_new:
 *  dp_stream_free of that stream retires its wrapper too (caches are told,
 *  as for the stream itself), and a later wrap of a handle at that address
 *  makes a new wrapper.
 *
 *  NULL native: the device's default stream. For `cuda` that is the
 *  legacy default stream (cudaStream_t 0, PyTorch's current stream unless
 *  one is set), of dev whatever device is current when the wrapper is used
 *  — not dp_stream_default's stream, which is a non-blocking stream
 *  devpickle made and does not order with it. cudaStreamLegacy and
 *  cudaStreamPerThread are taken likewise, each as the stream it names on
 *  dev (per-thread: of the thread that uses the wrapper). For `host`, which
 *  has no native default stream, NULL returns dp_stream_default's stream.
 *
 *  Errors: DP_EINVAL for NULL b or out, a device of another backend, or a
 *  native handle that is not a stream of dev — `host` checks against its
 *  live streams; `cuda` asks cudaStreamGetDevice (CUDA 12.8 and later), whose
 *  refusal comes through as DP_ECUDA (a destroyed or made-up handle is
 *  undefined behaviour there, as in CUDA) — each the first time a handle
 *  is wrapped; DP_ENOMEM. Thread-safe: any number of threads may wrap at
 *  once, the same handle or others. */
DP_API int dp_stream_wrap(dp_backend_t *b, dp_device_t dev, void *native, dp_stream_t **out, dp_error_t *err);

/** The backend and the device the stream belongs to. */
DP_API dp_backend_t *dp_stream_backend(const dp_stream_t *s);
DP_API dp_device_t dp_stream_device(const dp_stream_t *s);
/** The native handle: a cudaStream_t for `cuda` (for a wrapper, the
 *  handle it was made from); for `host`, an opaque handle of the host
 *  stream, meaningful only to dp_stream_wrap. */
DP_API void *dp_stream_native(const dp_stream_t *s);

/** Blocks until all work queued on s so far has completed. */
DP_API int dp_stream_synchronize(dp_stream_t *s, dp_error_t *err);
/** 1 when all queued work has completed, 0 when some is pending, <0 error. */
DP_API int dp_stream_query(dp_stream_t *s, dp_error_t *err);
/** Work queued on s after this call waits for e (device side; the host
 *  does not block). e and s may be on different devices of one backend. */
DP_API int dp_stream_wait_event(dp_stream_t *s, dp_event_t *e, dp_error_t *err);
/** Work queued on s after this call waits for the work queued on t so far
 *  (device side; the host does not block): an event from the pool is
 *  recorded on t, s waits on it, and the event goes back to the pool. A
 *  no-op when s == t. s and t may be on different devices of one backend. */
DP_API int dp_stream_wait_stream(dp_stream_t *s, dp_stream_t *t, dp_error_t *err);
/** Blocks until all work on every stream of dev has completed. */
DP_API int dp_device_synchronize(dp_backend_t *b, dp_device_t dev, dp_error_t *err);

/* ---- the current stream of this thread ---- */

/** This thread's current stream on dev: the one set with
 *  dp_set_current_stream, else the provider's (if installed), else the
 *  device's default stream (errors as dp_stream_default). */
DP_API int dp_current_stream(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err);
#define DP_CURRENT_STREAM_SLOTS 16
/** Makes s the calling thread's current stream for s's device. *prev (may
 *  be NULL) receives the one it replaces (NULL when none was set; NULL too
 *  when the call fails, which changes nothing). A thread
 *  holds current streams for up to DP_CURRENT_STREAM_SLOTS devices at once:
 *  one more is DP_ELIMIT. Use dp_reset_current_stream to clear one. The
 *  pool streams a then() callback runs with (future.h) do not count, on
 *  however many devices: the thread's own come back when it returns. So
 *  does whatever a callback sets or resets here, on any device: it runs on
 *  whichever thread completes its parent, whose current streams are that
 *  thread's again once it returns (a stream the callback frees meanwhile
 *  is forgotten). Inside a callback, DP_ENOMEM when the stream it replaces
 *  cannot be remembered (nothing changes); dp_reset_current_stream resets
 *  all the same, and the thread then has its default stream after the
 *  callback. */
DP_API int dp_set_current_stream(dp_stream_t *s, dp_stream_t **prev, dp_error_t *err);
/** Forgets this thread's current stream for dev (back to provider/default). */
DP_API void dp_reset_current_stream(dp_backend_t *b, dp_device_t dev);

/** An embedder's source of current streams, asked when a thread has set
 *  none. Return NULL to fall back to the default stream. A stream of
 *  another device or backend than asked is an error of dp_current_stream
 *  (DP_EINVAL naming both devices). While it is asked for a device, a
 *  lookup of that device's current stream on its thread (dp_current_stream,
 *  or a call that makes one: dp_cache_alloc with no stream,
 *  dp_future_wait) would ask it again, without end: it is DP_EMISUSE. */
typedef dp_stream_t *(*dp_stream_provider_cb)(void *ud, dp_backend_t *b, dp_device_t dev);
/** Installs a provider for every thread (NULL removes it; dp_shutdown
 *  removes it too). fn and ud are stored one after the other, not as one
 *  atomic pair: install or change the provider while no other thread looks
 *  up a current stream (at startup, say), or a lookup may call the old fn
 *  with the new ud. */
DP_API void dp_set_stream_provider(dp_stream_provider_cb fn, void *ud);

/* ---- events (pooled: no create/destroy on the hot path) ---- */

/** An event for dev from the backend's pool (created when the pool is
 *  empty). Timing is disabled. Give it back with dp_event_free. */
DP_API int dp_event_new(dp_backend_t *b, dp_device_t dev, dp_event_t **out, dp_error_t *err);
/** Returns e to its pool. Its recorded state is dropped. Freeing it again
 *  before dp_event_new hands it out again does nothing; a free after that
 *  frees the new owner's event (use after free, as for any handle). */
DP_API void dp_event_free(dp_event_t *e);
/** Captures the work queued on s so far. Re-recording replaces the capture.
 *  s must be a stream of e's device (as CUDA requires): one of another
 *  device or backend is DP_EINVAL, naming both. */
DP_API int dp_event_record(dp_event_t *e, dp_stream_t *s, dp_error_t *err);
/** 1 when complete (or never recorded), 0 when not yet, <0 error. */
DP_API int dp_event_query(dp_event_t *e, dp_error_t *err);
/** Blocks until e completes. */
DP_API int dp_event_synchronize(dp_event_t *e, dp_error_t *err);
/** The device the event was made for. */
DP_API dp_device_t dp_event_device(const dp_event_t *e);

/* ---- device memory (raw, uncached: see cache.h for the caching allocator) ---- */

/** nbytes of memory on dev, in *out; nbytes 0 gets a pointer of its own all
 *  the same (a 1-byte allocation), given back with dp_device_dealloc like
 *  any other. */
DP_API int dp_device_alloc(dp_backend_t *b, dp_device_t dev, size_t nbytes, void **out, dp_error_t *err);
/** Gives p (from dp_device_alloc on dev) back; NULL p frees nothing (b
 *  and dev are checked all the same: DP_EINVAL as below, 0 otherwise).
 *  First it waits for the work queued on dev's streams so far, as cudaFree
 *  does (host: except in a host function, which must not wait for itself
 *  and frees at once). DP_EINVAL for a device of another backend, or
 *  (`host`) a p that this backend did not hand out on dev or already took
 *  back, refused at once, without waiting. `cuda` does not check p:
 *  cudaFree's error comes through (DP_ECUDA), and a p of another CUDA
 *  device is not told apart. */
DP_API int dp_device_dealloc(dp_backend_t *b, dp_device_t dev, void *p, dp_error_t *err);
/** The device holding p (interior pointers included), or DP_ENOTFOUND. */
DP_API int dp_pointer_device(dp_backend_t *b, const void *p, dp_device_t *out, dp_error_t *err);
/** Copies n bytes in stream order (host or device memory on either side).
 *  n == 0 queues nothing and returns 0; dst and src may then be NULL. */
DP_API int dp_memcpy_async(dp_stream_t *s, void *dst, const void *src, size_t n, dp_error_t *err);
/** Reads device memory into host memory through its backend: the read
 *  callback of an inline pickle (dp_pickle_opts_t.read, pickler.h's
 *  dp_read_cb: `opts.read = dp_device_read`). Copies nbytes at src on
 *  `device` into dst on this thread's current stream of that device — after
 *  the work queued there so far — and waits for the copy, by a
 *  synchronize of that stream: not for work queued on other streams, but
 *  for work another thread queues on the same stream between the copy and
 *  the wait too. ud: the backend (a dp_backend_t *),
 *  or NULL for the one of device.type (dp_backend_get; its errors). A cpu
 *  device's memory is copied directly. DP_EINVAL for a device of another
 *  backend than ud or out of its range, NULL src or dst with nbytes > 0;
 *  the errors of dp_current_stream, dp_memcpy_async and
 *  dp_stream_synchronize (in a host function, a read on its own stream, or
 *  on one that waits for work queued there after the function, is
 *  DP_EMISUSE: it would wait for itself; refused before the copy is
 *  queued, so dst is left untouched). */
DP_API int dp_device_read(void *ud, dp_device_t device, const void *src, size_t nbytes, void *dst, dp_error_t *err);

/* ---- host backend only ---- */

typedef void (*dp_host_fn)(void *arg);
/** Queues fn(arg) on a host stream: it runs on the stream's worker thread,
 *  after the work queued before it. DP_EINVAL for a non-host stream.
 *  fn may call devpickle (allocate, record, queue work) but must not wait
 *  for itself: dp_stream_synchronize of its own stream, dp_event_synchronize
 *  of an event recorded there after fn was queued and dp_device_synchronize
 *  of its device are DP_EMISUSE from fn (as CUDA refuses them in a host
 *  function), and so are these calls on another stream (event, device) that
 *  waits, through dp_stream_wait_event (or wait_stream) queued there, down
 *  any chain of such waits, for work queued on fn's stream after fn
 *  (dp_device_read on such a current stream too, before it queues its
 *  copy). (A
 *  wait for another host function that itself waits for fn is not seen:
 *  it hangs, as two threads waiting on each other do.) Following those
 *  waits takes time linear in the streams and waits reached, and memory:
 *  without it, these calls from fn are DP_ENOMEM and wait for nothing (a
 *  wait they could not clear might be one for fn). dp_stream_free of
 *  its own stream, or of a stream that waits so for fn (or for which that
 *  could not be told), frees nothing (it
 *  would wait for fn, and free the thread running it): a line on stderr
 *  says so, and the stream stays usable. */
DP_API int dp_host_launch(dp_stream_t *s, dp_host_fn fn, void *arg, dp_error_t *err);
/** Caps the memory dp_device_alloc hands out on a host device (0: no cap),
 *  so that out-of-memory paths can be exercised: an allocation that would
 *  take the bytes in use past the cap is DP_ENOMEM (a 0-byte one counts as
 *  1 byte; what is already in use stays, a cap below it refuses every
 *  allocation until enough comes back). dev may be any of host:0..host:63,
 *  whatever DEVPICKLE_HOST_DEVICES says, and the backend need not be
 *  started: the cap is the process's, not the backend's, and holds across
 *  dp_shutdown() until set again (set 0 to lift it). DP_EINVAL for a device
 *  that is not one of those, naming it. */
DP_API int dp_host_set_memory_limit(dp_device_t dev, size_t nbytes, dp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
