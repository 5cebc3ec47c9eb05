/*
 * devpickle/future.h — a stream-aware future.
 *
 * When a future is completed with a value, it walks the value (dp_scan) to
 * learn which device allocations the value holds — user-defined objects and
 * customs included, with no registration — and records one event per device
 * on that device's current stream. A consumer that waits on the future makes
 * its own current streams wait on those events (device side: the host does
 * not block on device work) and tells the allocator that the allocations are
 * used on its streams, so their memory is not reused under it.
 *
 * then() chains a callback: it runs when the parent completes, with pool
 * streams current on the devices the parent's value uses, after those streams
 * wait on the parent's events. The current streams of the thread it runs on
 * are put back when it returns, on every device, whatever it set or reset
 * (dp_set_current_stream). The callback's result is walked afresh and the
 * child records its own events on the callback's streams. If that walk fails
 * the child fails loudly, naming the type and the path; it never falls back
 * to the parent's events.
 *
 * OWNERSHIP: futures are reference counted (dp_future_retain/release).
 * Completing functions steal the value they are given, even on failure.
 * dp_future_value() borrows.
 *
 * THREAD SAFETY: every function may be called from any thread at once: any
 * thread may complete, wait and chain. Callbacks never run under the
 * future's lock; each runs exactly once, on the thread that completes the
 * parent, or at once on the thread calling then() if the parent is already
 * complete (inside a callback: once that callback returns, see below).
 *
 * CHAINS OF ANY LENGTH: completions and releases never recurse. A
 * completion (or a release) made while a callback runs on the same thread —
 * the child that a callback's result completes, a future the callback
 * completes, one it chains on when already complete — does not run its
 * callbacks there: they are queued on the thread and run, in order, once the
 * running callback returns, before any callback that was queued ahead of it
 * (depth first, the order recursion would give), and before the outermost
 * call returns. So a chain of a million then() links completes, or is
 * released, in constant stack and in chain order, and the callbacks of one
 * future run in the order they were registered — but for one registered on
 * a complete future from inside one of that future's own callbacks: it runs
 * once that callback returns, before the future's callbacks still to run
 * (as PyTorch's runs it at once, inside the callback). A dp_future_wait() in a callback first runs what is queued on
 * its thread, so a callback may wait on what it completed; waiting on a future it completed (or chained on)
 * also returns only once the callbacks it queued for that future ran, and runs nothing else: the running
 * callback's own future's later callbacks still run after it returns. A wait there on a pending future runs
 * every callback queued on the thread (any of them might complete it), the running callback's own future's
 * later ones included: they start inside the wait, before the callback returns (WAITS NEST below).
 * So a callback must return: one left by longjmp (or a C++ exception)
 * leaves its frame running on the thread for good — later callbacks there
 * only queue, and dp_shutdown there tears nothing down.
 *
 * WAITS NEST: a callback that such a wait runs may wait in turn, and runs
 * the next queued callback inside itself, and so on: waits nest as deep as
 * the callbacks queued on the thread that wait (a future with thousands of
 * then() callbacks, each polling a pending future with a limit of 0). At
 * most DP_FUTURE_WAIT_NESTING_MAX waits nest so; a wait further in runs no
 * queued callback (it still frees the futures released meanwhile, which
 * may cancel its own), and if its future is pending while callbacks are queued
 * on the thread (which might complete it) it is DP_ELIMIT at once, with a
 * limit or without, naming the depth. It waits as any wait does when
 * nothing is queued.
 *
 * WAITING FOR ITSELF: a wait (or synchronize) from a then() callback on the
 * child its own result completes — or on that of a callback it is nested
 * in — would wait for itself: it is DP_EMISUSE without blocking, with a
 * limit or without, once the callbacks queued on the thread have run (as
 * any wait there on a pending future runs them, above: one of them that
 * completes the child by hand makes the wait return 0). So is a wait there on any pending future that completes only
 * after such a child: its then() children (the callback's grandchildren),
 * a collect_all over it, and so on down any chain of then() parents and
 * collect_all inputs that are still pending. The wait follows those links
 * itself, each future once, holding one future's lock at a time; only a
 * wait on a pending future from a thread running a then() callback (or a
 * completion's walk, below) does, so other waits cost nothing more. The links are what the futures' own
 * completions wait for: a then() child or a collect_all future that
 * another thread might complete by hand (dp_future_mark_completed on it)
 * is not counted on. Waits on futures that wait for nothing of the
 * callback's — complete ones, ones another thread completes — work as
 * anywhere. (Out of memory while following the links: DP_ENOMEM.) The
 * same holds in a reduce() of the value that dp_future_mark_completed
 * walks, and in the hooks' record_stream or record_streams called by
 * dp_future_mark_completed or dp_future_mark_completed_with_ptrs: that
 * future is complete only once they return, so a wait there on it, or on
 * a pending future that waits for it through those links, is DP_EMISUSE
 * at once (a completion of it by another thread meanwhile is not counted
 * on). What no link shows is not seen: a wait on
 * a future the callback itself means to complete after it, or one that
 * waits for a callback running on another thread that waits for this one,
 * still blocks.
 *
 * WAITING FOR ONE'S OWN LOOP: a future that only a loop completes — a
 * transport's receives and sends (transport.h), completed by its progress
 * thread or in a caller's pass — cannot complete while that loop's thread
 * waits: a wait for it (pending) there, from any callback the loop runs, or
 * for a pending future that waits for it through the links above, is
 * DP_EMISUSE at once, with a limit or without ("... Chain on the future
 * with dp_future_then instead, or wait for it from another thread").
 *
 * CANCELLATION: when the last reference to a pending future is dropped, its
 * callbacks never run; its then() children fail with DP_ECANCELED ("the
 * parent future was released before it completed"), which goes down their
 * chains as any failure does, and a collect_all over it fails with
 * DP_ECANCELED naming the input (once its other inputs are done). Waiters on
 * them wake with that error.
 *
 * SHUTDOWN: futures go before dp_shutdown() (devpickle.h). Called while a
 * future's callback, the walk that completes one (a reduce()) or its
 * record hooks, or the release of one (a storage's release callback) runs
 * on the thread — whose
 * futures are still held — it tears nothing down and says so in a line on
 * stderr, as from a host function (device.h).
 */
#ifndef DEVPICKLE_FUTURE_H
#define DEVPICKLE_FUTURE_H

#include "cache.h"
#include "pickler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_future dp_future_t;

/** How many waits in callbacks may run queued callbacks inside one another
 *  on one thread (WAITS NEST above). */
#define DP_FUTURE_WAIT_NESTING_MAX 64

typedef struct dp_future_opts {
  /** NULL: dp_backend_default(). */
  dp_backend_t *backend;
  /** The devices the future's values may use (ndevices of them); ndevices
   *  0: every device of the backend (devices NULL with ndevices above 0 is
   *  DP_EINVAL). cpu memory is always allowed (it needs no stream work),
   *  listed or not. */
  const dp_device_t *devices;
  size_t ndevices;
  /** Where stream uses are recorded. NULL: the backend's default caching
   *  allocator (dp_cache_default). Hooks with neither record_stream nor
   *  record_streams (record_streams_owned alone is not enough) are
   *  DP_EINVAL at dp_future_new. */
  const dp_cache_hooks_t *hooks;
  /** 1: record no stream uses at all (hooks ignored). */
  int no_hooks;
  /** 1: record stream uses on the consumers' streams only (dp_future_wait,
   *  then() callbacks), not on the completing stream: the producer answers
   *  for its own uses on other streams, as torch's CUDA future does. The
   *  Python binding sets it: torch's allocator records cost ~80 ns each. */
  int consumers_only;
} dp_future_opts_t;

/** A new pending future. opts may be NULL. Errors: DP_EINVAL for a NULL
 *  out, devices NULL with ndevices above 0, a listed device that is
 *  neither cpu (index 0: value.h) nor one of the backend's (its message
 *  names it), or hooks
 *  with neither record_stream nor record_streams; dp_backend_default's and dp_cache_default's
 *  errors when they are asked; DP_ENOMEM. */
DP_API int dp_future_new(const dp_future_opts_t *opts, dp_future_t **out, dp_error_t *err);
/** Counts one more reference; returns f (NULL does nothing). A count is
 *  32 bits: a retain of a future already holding 4,294,967,295 references
 *  aborts the process with a message on stderr, as value.h's retains do,
 *  rather than wrap to 0 and let a release free it while it is held. */
DP_API dp_future_t *dp_future_retain(dp_future_t *f);
/** Drops a reference; the last one frees the future, its value and its
 *  events. A pending future's callbacks then never run: its then()
 *  children and the collect_all futures over it fail with DP_ECANCELED
 *  (see CANCELLATION above). */
DP_API void dp_future_release(dp_future_t *f);

/** Completes f with value (stolen). The value is walked before any lock is
 *  taken. Errors (f then completes with that error, so no waiter hangs):
 *  DP_ETYPE / DP_ELIMIT from the walk, with the type and the path;
 *  DP_EDEVICE when the value uses a device outside f's devices (the message
 *  names both lists, and the path where the value first holds memory on
 *  the refused device: the value is walked again, with paths, to find it —
 *  a custom's reduce runs once more); backend errors, and the hooks' errors for the records on
 *  the completing stream (unless consumers_only or no_hooks). DP_ESTATE if
 *  f was already complete (f is left as it was). */
DP_API int dp_future_mark_completed(dp_future_t *f, dp_value_t value, dp_error_t *err);
/** As dp_future_mark_completed, without the walk: the producer gives the
 *  allocations (copied from ptrs). A DP_EDEVICE message takes its path
 *  from ptrs when dp_scan filled it with DP_SCAN_PATHS, else from a walk
 *  of value with paths (none when value holds no memory there). A NULL ptrs is DP_EINVAL, and f
 *  completes with that error (DP_ESTATE, as err says, if f was complete
 *  already). */
DP_API int dp_future_mark_completed_with_ptrs(dp_future_t *f, dp_value_t value, const dp_ptrset_t *ptrs,
                                              dp_error_t *err);
/** Completes f with an error (copied; a code of 0 becomes DP_ESTATE, and
 *  one that is no DP_E* code — positive, or negative but none of base.h's —
 *  DP_EINVAL; an empty message becomes one naming the code). DP_ESTATE if f was already complete. A NULL error
 *  is DP_EINVAL, and f completes with that error (DP_ESTATE, as err says,
 *  if f was complete already), as for a NULL ptrs above. */
DP_API int dp_future_set_error(dp_future_t *f, const dp_error_t *error, dp_error_t *err);

/** Blocks the host until f completes or timeout_ns passes (<0: no limit;
 *  measured on CLOCK_MONOTONIC, so a step of the wall clock does not change
 *  it; the thread looks for the completion for up to 100 µs, yielding the
 *  core, before it sleeps; a limit of 0, or one spent by then, returns
 *  without sleeping; from a then() callback, the limit counts from
 *  once the callbacks queued on the thread that the wait runs first have
 *  run (WAITS NEST above): however long they take, a wait there with a
 *  limit of 1 ms returns no sooner), then makes this thread's current streams wait on f's events and records
 *  f's allocations on those streams: one record a storage as the completion's walk met it, so an
 *  allocation met apart more than once (views of one storage between other tensors) is recorded
 *  that many times, to the same effect (a record is idempotent; a wait costs what the value's
 *  tensors number, as the completion did). Returns 0, DP_ETIMEDOUT, or f's own
 *  error (copied into err); once f is complete, the errors of those streams'
 *  waits and records, as they came (dp_current_stream's, the backend's, the
 *  hooks': f stays complete with its value); from a then() callback, DP_EMISUSE without
 *  blocking (after the callbacks queued on the thread, WAITS NEST) when f completes only after that callback returns (WAITING FOR ITSELF
 *  above) or only by the loop that runs it (WAITING FOR ONE'S OWN LOOP),
 *  and DP_ELIMIT at once past DP_FUTURE_WAIT_NESTING_MAX nested
 *  waits (WAITS NEST above). */
DP_API int dp_future_wait(dp_future_t *f, int64_t timeout_ns, dp_error_t *err);
/** dp_future_wait, then blocks the host until f's events complete too,
 *  all within timeout_ns (<0: no limit; the events are polled, sleeping up
 *  to 1 ms between looks): DP_ETIMEDOUT when they have not. From a host
 *  function (dp_host_launch) whose stream holds an event of f recorded
 *  after it, or an event of f on a stream that waits for work queued there
 *  after it, DP_EMISUSE at once, with a limit or without (device.h);
 *  DP_ENOMEM, waiting for nothing, when memory to tell so was lacking. */
DP_API int dp_future_synchronize(dp_future_t *f, int64_t timeout_ns, dp_error_t *err);

/** The value, borrowed, without any synchronization: device memory it
 *  references may still be being written. none while pending or failed. */
DP_API dp_value_t dp_future_value(const dp_future_t *f);
/** 1 when complete (with a value or an error), else 0. */
DP_API int dp_future_is_done(const dp_future_t *f);
/** 0 while pending or completed with a value; else the error code, with
 *  the error copied into err (err may be NULL; it is written only for a
 *  failed future). A NULL f reads as a pending one, as for the getters
 *  above: 0, err left as it was. */
DP_API int dp_future_error(const dp_future_t *f, dp_error_t *err);

/** A then() callback: parent is complete with a value. Return 0 and a new
 *  reference in *result (none is fine), or an error code with err filled. */
typedef int (*dp_then_cb)(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err);

/** A child future, with f's backend, devices and hooks, completed by cb's
 *  result. If f fails the child fails with the same error and cb is not
 *  called; if f is released pending, with DP_ECANCELED; if the streams cb
 *  would run on cannot be set up (to wait on f's events and record f's
 *  allocations there: out of memory, the backend's or the hooks' error),
 *  with that error, cb not called. The child holds no
 *  reference to f: keep f while you want the child to complete. */
DP_API int dp_future_then(dp_future_t *f, dp_then_cb cb, void *ud, dp_future_t **child, dp_error_t *err);

/** A then() callback that reports its result's allocations itself (as
 *  dp_future_mark_completed_with_ptrs does for a producer: the child does
 *  not walk the result). It runs whether the parent completed with a value
 *  or failed (dp_future_error(parent, ...) tells which; a failed parent has
 *  no events and no streams are made current), as a language binding whose
 *  callbacks read the parent's outcome themselves needs. ptrs is an empty
 *  set: add the result's allocations to it (dp_ptrset_add, or dp_scan). It
 *  is borrowed for the call (the thread's scratch set, which the next
 *  completion on the thread empties and reuses): never free it or keep it
 *  past the return; parent, too, is borrowed (retain it to keep it).
 *  Return 0 and a new reference in *result, or an error code with err
 *  filled: the child fails with it. When the callback cannot run — the
 *  pool streams it would run on cannot be set up to wait on the parent's
 *  events and record its allocations (out of memory, a stream or event the
 *  backend refuses, a record the hooks refuse) — it is
 *  called once all the same with ptrs NULL and err saying why, so that it
 *  can complete what it owns and free ud; its return and *result are then
 *  ignored, and the child fails with that error. */
typedef int (*dp_then_ptrs_cb)(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs,
                               dp_error_t *err);
/** As dp_future_then, with a dp_then_ptrs_cb: the child completes with the
 *  value and the allocations the callback gives, its events recorded on the
 *  callback's (pool) streams. If f is released pending, cb never runs (ud
 *  stays the caller's to free) and the child fails with DP_ECANCELED. */
DP_API int dp_future_then_with_ptrs(dp_future_t *f, dp_then_ptrs_cb cb, void *ud, dp_future_t **child,
                                    dp_error_t *err);
/** A future of a list of the futures' values, complete when all are (failed
 *  when any fails, with the first error by input order; DP_ECANCELED when
 *  an input is released pending, naming it). It holds no reference to a
 *  pending input. Allocations pass through without a new walk (an
 *  allocation's refs is the sum of its refs in the distinct inputs: an
 *  input given twice counts once, a tensor two inputs hold counts in each);
 *  one event per device joins the inputs' events. opts NULL: futures[0]'s
 *  backend, devices and hooks, as a then() child takes its parent's
 *  (dp_future_new's defaults when n is 0); an input's allocation on a
 *  device outside the aggregate's devices fails it with DP_EDEVICE, as
 *  dp_future_mark_completed does (its path is in the list of the inputs'
 *  values, which that refusal alone walks), so pass opts to gather futures made with
 *  different devices. *out is written once the inputs are read: it may be
 *  a slot of futures. */
DP_API int dp_future_collect_all(dp_future_t *const *futures, size_t n, const dp_future_opts_t *opts,
                                 dp_future_t **out, dp_error_t *err);

/* ---- introspection of a completed future ----
 * The counts are 0 for a NULL, pending or failed future. */
/** Allocations the value holds, each once, in discovery order. A
 *  completion's walk does not deduplicate (the streams' records and events
 *  need no more); the list is made from its record at the first call of
 *  this or dp_future_ptr and kept (thread-safe). 0 when that list cannot
 *  have its memory (dp_future_ptr then says DP_ENOMEM). */
DP_API size_t dp_future_nptrs(const dp_future_t *f);
/** Allocation i (its path is NULL: completions scan without paths; refs
 *  counts the tensors on it, nbytes is the largest size a tensor's storage
 *  gave it). DP_EINVAL for a NULL future or out, DP_ESTATE while it is not
 *  completed with a value, DP_EINVAL for i out of range, DP_ENOMEM when the
 *  list (dp_future_nptrs) cannot be made. */
DP_API int dp_future_ptr(const dp_future_t *f, size_t i, dp_ptr_info_t *out, dp_error_t *err);
/** Devices that have an event (the used non-cpu devices). */
DP_API size_t dp_future_ndevices(const dp_future_t *f);
/** Device i; {DP_DEVICE_CPU, 0} out of range (check i against
 *  dp_future_ndevices). */
DP_API dp_device_t dp_future_device(const dp_future_t *f, size_t i);
/** The event recorded for device i (borrowed; owned by the future);
 *  NULL out of range. */
DP_API dp_event_t *dp_future_event(const dp_future_t *f, size_t i);

#ifdef __cplusplus
}
#endif
#endif
