/*
 * devpickle/cache.h — allocator hooks and the built-in caching allocator.
 *
 * A stream-aware consumer (the future) must tell the allocator on which
 * streams an allocation is used, so that freeing it does not hand the
 * memory to someone else while those streams still read it. The hooks are
 * that channel; the built-in caching allocator implements them.
 *
 * The caching allocator (one per backend by default, or your own):
 *   - per-device pools of blocks carved from segments obtained from the
 *     backend: requests up to 1 MiB come from 2 MiB segments, larger ones get
 *     a segment of their size rounded up to 2 MiB; sizes round up to 512
 *     bytes; a block larger than asked is split on allocation (a small
 *     block when 512 bytes or more are left, a large one when more than
 *     1 MiB is left: a 1 MiB + 1 request served from a 2 MiB segment holds
 *     the whole segment, and `allocated` counts it) and blocks merge with
 *     free neighbours on free. Small and large requests keep to their own
 *     segments: a request up to 1 MiB never takes a block of a large
 *     segment, free as it may be, nor a larger one a small segment's (it
 *     gets a new segment, and `reserved` grows);
 *   - stream-ordered reuse: a block remembers the stream it was allocated on
 *     and a block freed there is reusable at once by allocations on that
 *     stream. An allocation on another stream takes it only by making its
 *     stream wait (device side) for an event recorded on the block's stream,
 *     so that the block's earlier work completes first. Each stream keeps
 *     its free blocks apart (a free set per device: about 32 KiB of
 *     bookkeeping for each stream that allocated there, kept until the
 *     stream is destroyed; for a wrapper of a framework's stream, until
 *     dp_shutdown or the cache is freed), so an allocation never looks past
 *     other streams' blocks: it takes the best fit among its own stream's
 *     and those tied to no stream (neither needs a wait), and another
 *     stream's only when both have none that fits;
 *   - record_stream adds a stream that uses the block. Freeing such a block
 *     records one event on each of those streams; the block returns to the
 *     pool only when they have completed. A record on the block's own
 *     allocation stream is a no-op (stream order already covers it, as
 *     above) and stores nothing. Pending blocks are reclaimed by polling —
 *     in every malloc and free (the oldest first, passing over a few still
 *     in use: one slow stream does not hold back the others' blocks), and
 *     in dp_cache_poll (all) — never by blocking the caller;
 *   - a stream destroyed (dp_stream_free) leaves the allocator: the blocks
 *     allocated on it become tied to no stream (reusable by any without a
 *     wait) and the blocks that recorded it as a use let go of it. This
 *     costs the blocks that stream touched, not the allocator's (every
 *     allocator hears of every stream's destruction);
 *   - when the backend is out of memory: free the cached segments, retry,
 *     then DP_ENOMEM. Freeing them lets the allocator's lock go while
 *     their streams are waited for: pending blocks that finished
 *     meanwhile are reclaimed, blocks that other threads (a host function
 *     that wait waits for) freed and that fit are taken, and segments they
 *     cached are freed in turn, before the refusal stands (up to 8 such
 *     rounds). A segment goes back through dp_device_dealloc, which
 *     waits first for the work queued on every stream of its device, as
 *     cudaFree does (device.h): so that allocation blocks until then, even
 *     for streams that never used the allocator (dp_cache_empty too).
 *
 * Errors and NULL follow device.h: every function that can fail returns an
 * int code and fills err (when not NULL) with it and a message; a NULL
 * allocator is DP_EINVAL, dp_cache_free(NULL) does nothing; backend codes
 * come through unchanged.
 *
 * Thread safety: all functions are thread-safe (one lock per allocator).
 * No function waits on a stream while holding that lock, so work queued on
 * a stream (a host function, dp_host_launch) may itself allocate and free.
 */
#ifndef DEVPICKLE_CACHE_H
#define DEVPICKLE_CACHE_H

#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

/** How a consumer tells an allocator which streams use an allocation. The
 *  functions may be called from any thread, concurrently; ctx must outlive
 *  every future (and chain) holding the hooks. A struct initialized with
 *  fewer fields leaves the later ones NULL, as C does. */
typedef struct dp_cache_hooks {
  void *ctx;
  /** The allocation holding ptr (any interior pointer) is used on s; a
   *  stream it has already is recorded once (the same call may come again).
   *  DP_ENOTFOUND when the allocator does not own ptr. */
  int (*record_stream)(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err);
  /** The same for n pointers on one stream; pointers the allocator does not
   *  own are skipped. A pointer may come more than once (a future's value
   *  holding two tensors over one allocation), as for record_stream. The first error stops the batch (records already
   *  made stay made). May be NULL: record_stream is then called n times. */
  int (*record_streams)(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err);
  /** record_streams that also says which pointers are the allocator's: it
   *  sets owned[i] to 1 for each such pointer and leaves the others' as
   *  they were (owned NULL with n > 0 is DP_EINVAL, nothing recorded).
   *  May be NULL. A chain (dp_cache_hooks_chain_new) uses it to hand the
   *  allocators after this one only the pointers it did not own, in one
   *  call instead of one per pointer. Alone it is not enough for a
   *  future or dp_cache_hooks_record, which call record_streams or
   *  record_stream. */
  int (*record_streams_owned)(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, unsigned char *owned,
                              dp_error_t *err);
} dp_cache_hooks_t;

/** Calls hooks->record_streams, or record_stream for each pointer
 *  (skipping DP_ENOTFOUND) when the batched form is missing. DP_EINVAL
 *  for NULL hooks, hooks with neither function, or NULL ptrs with n > 0. */
DP_API int dp_cache_hooks_record(const dp_cache_hooks_t *hooks, void *const *ptrs, size_t n, dp_stream_t *s,
                               dp_error_t *err);

/* ---- several allocators: each pointer recorded with the one that owns it ---- */

/** Allocators chained in order, for a consumer whose values hold memory of
 *  several (a framework's caching allocator beside devpickle's, say): the
 *  chain's hooks offer each pointer to the allocators in list order until
 *  one owns it, and record it there only.
 *
 *  - record_stream: the first allocator whose answer is not DP_ENOTFOUND
 *    decides (0, or its error, with its err); DP_ENOTFOUND, naming the
 *    pointer, when none owns it.
 *  - record_streams (and record_streams_owned, so that chains nest): each
 *    allocator gets one call with the pointers the ones before it did not
 *    own — through its record_streams_owned when it has one, else one
 *    record_stream per pointer; the last allocator gets the rest through
 *    its record_streams when it has one (nothing after it needs to know).
 *    Pointers no allocator owns are skipped. Batches of more than
 *    DP_CACHE_HOOKS_CHAIN_BATCH pointers are taken that many at a time (the
 *    scratch space is on the stack: a record allocates nothing). The first
 *    error stops the batch and is returned as the allocator gave it;
 *    records already made stay made.
 *
 *  Every hooks in list must say what it owns: record_stream or
 *  record_streams_owned, else DP_EINVAL naming its index (as does n == 0,
 *  a NULL list or out). The hooks are copied; their ctx are not owned and
 *  must outlive the chain. The hooks of another chain in list are replaced
 *  by that chain's own list, in place, less the hooks already in the new
 *  list (an allocator offered a pointer again never owns it), so that
 *  chains nested any number of times deep record in constant stack, and a
 *  tree of chains offers each pointer to each allocator once. The chain
 *  must outlive the futures and the chains given its hooks. Its hooks may be called from any thread; they
 *  take no lock of their own (the allocators lock what they need). */
typedef struct dp_cache_hooks_chain dp_cache_hooks_chain_t;
#define DP_CACHE_HOOKS_CHAIN_BATCH 512
DP_API int dp_cache_hooks_chain_new(const dp_cache_hooks_t *list, size_t n, dp_cache_hooks_chain_t **out,
                                    dp_error_t *err);
/** Frees the chain (NULL: nothing). Not while its hooks may still be called. */
DP_API void dp_cache_hooks_chain_free(dp_cache_hooks_chain_t *chain);
/** The chain's hooks, to pass as dp_future_opts_t.hooks or into another
 *  chain (for a NULL chain, hooks that report DP_EINVAL). */
DP_API dp_cache_hooks_t dp_cache_hooks_chain_hooks(dp_cache_hooks_chain_t *chain);

typedef struct dp_cache dp_cache_t;

typedef struct dp_cache_stats {
  size_t allocated;        /* bytes in blocks handed out (rounded sizes) */
  size_t peak_allocated;
  size_t reserved;         /* bytes in segments held from the backend */
  size_t pending_blocks;   /* freed blocks waiting for their streams */
  size_t pending_bytes;
  uint64_t allocs, frees;
  uint64_t cache_hits;     /* allocations served without a backend malloc */
  uint64_t segment_allocs, segment_frees;
  uint64_t cross_stream;   /* blocks taken by another stream through an event wait */
  uint64_t oom_retries;    /* new segments refused for want of memory (the backend's, or the
                              allocator hook's for the segment's bookkeeping) and answered
                              by freeing the cache and trying again (dp_cache_alloc's rounds
                              above: one, or more when segments were cached meanwhile) */
} dp_cache_stats_t;

/** A caching allocator over backend b (its own, independent of the
 *  default). The caller's: free it with dp_cache_free before dp_shutdown()
 *  (devpickle.h), which stops b; a cache still held then is not freed, and
 *  may be neither used nor freed afterwards (it stands on the stopped
 *  backend). DP_EINVAL for NULL b or out; DP_ENOMEM. */
DP_API int dp_cache_new(dp_backend_t *b, dp_cache_t **out, dp_error_t *err);
/** Waits for pending blocks and for the work queued on the devices it
 *  holds memory on (dp_device_synchronize, without the allocator's lock:
 *  that work may still allocate and free here), gives every segment back
 *  to the backend and frees the allocator. Pointers still allocated from
 *  it become invalid.
 *  From a host function (dp_host_launch) it cannot wait for its own
 *  device (dp_device_synchronize is DP_EMISUSE there: device.h): the
 *  segments go back at once, as dp_device_dealloc frees there, whatever
 *  work queued before the call, on another stream of that device, still
 *  uses them (it then uses freed memory). Free a cache from a host
 *  function only once no queued work uses its memory.
 *  A backend's default allocator (dp_cache_default) is left alone:
 *  dp_shutdown frees it (as dp_stream_free leaves the backend's streams). */
DP_API void dp_cache_free(dp_cache_t *c);
/** The backend's built-in allocator (created on first use, destroyed by
 *  dp_shutdown). */
DP_API int dp_cache_default(dp_backend_t *b, dp_cache_t **out, dp_error_t *err);

/** Allocates nbytes on dev for use on stream s (NULL: this thread's current
 *  stream of dev); nbytes 0 gets a block of its own, of the smallest size
 *  (512 bytes). Errors: DP_EINVAL (a device of another backend, a stream s
 *  that is not on dev, naming both), DP_ENOMEM (after freeing the cache and
 *  retrying), backend errors. */
DP_API int dp_cache_alloc(dp_cache_t *c, dp_device_t dev, size_t nbytes, dp_stream_t *s, void **out,
                           dp_error_t *err);
/** Frees a pointer from dp_cache_alloc (NULL p does nothing). It is
 *  reusable at once on its allocation stream; streams recorded with
 *  dp_cache_record_stream hold it until their work queued before this call
 *  completes. DP_EINVAL for a pointer this allocator did not hand out (or
 *  already freed) — an interior pointer too, unlike record_stream and
 *  lookup: its message names the allocation, which stays allocated. */
DP_API int dp_cache_dealloc(dp_cache_t *c, void *p, dp_error_t *err);
/** Marks the allocation holding p (interior pointers too) as used on s.
 *  DP_ENOTFOUND when p is not from this allocator; DP_EINVAL for a stream
 *  of another backend than the allocator's (its reuse could not be ordered
 *  after that stream's work). */
DP_API int dp_cache_record_stream(dp_cache_t *c, void *p, dp_stream_t *s, dp_error_t *err);
/** Reclaims pending blocks whose streams have completed; never blocks.
 *  Returns how many came back (>= 0), or an error. */
DP_API int dp_cache_poll(dp_cache_t *c, dp_error_t *err);
/** Gives every entirely free segment back to the backend, after the work
 *  already queued on the streams that last used them (waited on without
 *  the allocator's lock) — and, since each goes back through
 *  dp_device_dealloc (which waits as cudaFree does), after the work queued
 *  so far on every other stream of its device, whatever memory that work
 *  uses: a busy stream of the device holds the call up. A segment for whose stream no event can be made
 *  (to wait on) stays cached: the first such error (DP_ENOMEM, a backend
 *  error) is returned, naming the device; the other segments go back all
 *  the same. From a host function, segments with work still queued on
 *  their streams stay cached too (it must not wait), and that is no error. */
DP_API int dp_cache_empty(dp_cache_t *c, dp_error_t *err);
/** The allocated block holding p: its base and size (either may be NULL).
 *  DP_ENOTFOUND otherwise. */
DP_API int dp_cache_lookup(dp_cache_t *c, const void *p, void **base, size_t *size, dp_error_t *err);
/** Statistics for one device (pending blocks are polled first). DP_EINVAL
 *  for a device of another backend. */
DP_API int dp_cache_stats(dp_cache_t *c, dp_device_t dev, dp_cache_stats_t *out, dp_error_t *err);
/** The hooks through which a future records stream uses on this allocator
 *  (for a NULL allocator, hooks that report DP_EINVAL); all three functions
 *  are set. */
DP_API dp_cache_hooks_t dp_cache_hooks(dp_cache_t *c);

#ifdef __cplusplus
}
#endif
#endif
