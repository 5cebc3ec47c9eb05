/*
 * devpickle/transport.h — send values between processes and nodes over UCX.
 *
 * A transport is a UCX context and worker whose progress is driven by a
 * THREAD OF ITS OWN, started by dp_transport_new and joined by
 * dp_transport_free: every UCX call is made on that thread, and the calls
 * below only queue work for it (they never progress UCX on the caller's
 * thread). Or, with opts.progress = DP_TRANSPORT_PROGRESS_CALLER, BY THE
 * CALLER: no thread; the work runs in passes on the threads that call
 * dp_transport_progress, dp_transport_wait, dp_listener_accept and the
 * calls that queue work (a send is posted by the call that makes it), one
 * thread at a time (a lock). This is the mode for the lowest latency (no
 * hand-off between threads); its futures only complete while some thread
 * drives the transport: wait for them with dp_transport_wait, not
 * dp_future_wait (which drives nothing: without a limit, and with no other
 * thread driving the transport, it waits forever; with one, it times
 * out). Listeners bind HOST:PORT; endpoints connect or are
 * accepted.
 *
 * dp_endpoint_send() pickles a value (or, with dp_endpoint_send_future, the
 * value of a future once the future's events have completed: the loop polls
 * them, nothing blocks a host thread or synchronizes a device)
 * and sends its frame as one UCX active message, its out-of-band buffers in
 * messages of their own (rendezvous for large ones; small ones packed
 * together). The send's result is a future that completes (with none) when
 * every buffer of the value may be reused by the sender.
 *
 * dp_endpoint_recv() gives a future of the next value from an endpoint, in
 * the order the peer sent them: the frame is checked as dp_unpickle checks
 * any input (it is hostile: checksum, limits, layout), each out-of-band
 * buffer is received into memory allocated on the receiver — device
 * buffers from the transport's caching allocator on the transport's receive
 * stream of that device, cpu from the allocator hook — and the future
 * completes once every byte has arrived (or, for staged buffers, its copy
 * to the device is queued), its events recorded on that stream. Consumers
 * use the ordinary dp_future_wait/then; the host reads device bytes after
 * dp_future_synchronize.
 *
 * SAME-HOST LANES. An endpoint connected to an address of this host
 * (loopback, a local interface, or 0.0.0.0), to a peer process of the same user,
 * also gets a shared-memory lane to its peer when UCX_TLS allows posix or
 * sysv (a peer of another user stays on the connection): messages of up to 1 KiB that UCX
 * takes at once go there (UCX 1.13 gives a connection that reports its
 * peer's failure no shared memory); the rest, and every failure, stay on the
 * connection. At most 32 lanes a transport (each a UCX worker: ~9 file
 * descriptors, ~0.7 MB). DEVPICKLE_TRANSPORT_SHM=0 turns lanes (and
 * same-host slots) off; 1 (or unset) leaves them on, and any other value
 * is refused by dp_transport_new. docs/TRANSPORT.md, "Same-host lanes".
 *
 * Wire protocol, matching, validation and failures: docs/TRANSPORT.md.
 *
 * WHAT MOVES. cpu memory and the memory of one device backend, the
 * transport's (opts.backend: host or cuda). A buffer on another backend's
 * device, or on a device index its backend does not have in this process
 * (host:3 of a 2-device host backend), is refused by send (DP_ENODEV naming
 * the buffer and the device, before anything is sent), and a frame that
 * names one among its
 * out-of-band buffers fails its receive the same way (an inline frame's
 * buffers, which do not move, fail a value receive as its future refuses
 * the device: DP_EDEVICE; a frame receive takes the frame). cpu and host:N memory is read and written where it is: a
 * storage's base must be readable host memory of its nbytes (so not the
 * storages of a value read back from an inline frame without a bind
 * callback, whose base is the writer's address and whose bytes are host
 * data: send such a frame as it is, with dp_endpoint_send_frame). cuda
 * memory is STAGED: copied in 4 MiB chunks (small buffers packed) into
 * page-locked host buffers on the transport's send stream of the device,
 * sent, received into page-locked buffers and copied to the device on the
 * receive stream, chunk k + 1 copied while chunk k is on the wire. Between
 * processes of one host the page-locked buffers are a shared-memory
 * segment the sender offers and the receiver maps (only between processes
 * of the same user whose connection runs between addresses of this host):
 * the bytes cross on the copy engines only, no CPU copy (DEVPICKLE_TRANSPORT_SHM=0 turns this
 * off; docs/TRANSPORT.md, "Same-host slots"). Staged
 * buffers sent with dp_endpoint_send are read after the work queued on the
 * calling thread's current stream of their device when send was called
 * (an event the send stream waits on, on the device); with
 * dp_endpoint_send_future, after the future's events.
 *
 * FAILURES are errors, never hangs: connection refused or reset, peer death,
 * a corrupt or unexpected message, a timeout (opts.timeout_ns), closing an
 * endpoint with work pending, the peer closing its endpoint (DP_ECANCELED,
 * "the peer closed its endpoint", once the values it sent first arrived;
 * they are still taken, in order). The endpoint fails: every pending send and
 * receive future of it fails with the error (code and message naming the
 * endpoint), every buffer allocated for an unfinished receive is freed, and
 * later calls on it fail with the same error. Other endpoints keep working.
 * A frame the reader refuses (checksum, limits, layout: dp_unpickle's
 * checks, with opts.unpickle) is no failure of the endpoint: it fails the
 * one receive it was for, with the reader's error, and the endpoint goes on
 * with the next value (docs/TRANSPORT.md, "What the receiver checks").
 * Bounded in-flight bytes: an endpoint posts at most opts.max_inflight_bytes
 * of buffers (and frames over 64 KiB) whose sends are not complete (one
 * sent by rendezvous completes once the peer pulled it, a small one sent
 * eagerly once UCX let go of the sender's memory); more sends
 * wait in the transport (their futures pending) — send() itself never
 * blocks. A receiver that holds more than max_inflight_bytes of received
 * values not yet taken by dp_endpoint_recv stops fetching what was sent by
 * rendezvous (frames and buffers over 64 KiB), which holds the sender's
 * sends pending in turn (backpressure). And a receiver grants its peer a
 * credit: values (their frames' and buffers' bytes, and 256 bytes a value)
 * sent and not yet taken by its dp_endpoint_recv stay within max(its
 * max_inflight_bytes, 1 MiB) plus one value; further sends wait at the
 * sender, small ones included (docs/TRANSPORT.md, "Flow control").
 *
 * TRUST: listeners must be reachable only by trusted peers — UCX 1.13's
 * connection manager, which runs before devpickle sees a byte, aborts the
 * process on some malformed handshakes (docs/TRANSPORT.md, "Not yet
 * supported"). The transport does not authenticate peers.
 *
 * OWNERSHIP: transports, listeners and endpoints are freed with their
 * _free function; an endpoint or listener must be freed before its
 * transport (dp_transport_free fails the pending futures of endpoints still
 * open and frees them). A pair of endpoints of one transport (connected to
 * its own listener) may leave UCX's sockets open, 0 to 3 descriptors a
 * pair, until the transport is freed; endpoints of two transports leave
 * none (docs/TRANSPORT.md, "Not yet supported"). Returned futures are new
 * references. Free every
 * transport before dp_shutdown(): it stands on its backend, its
 * caching allocator and its streams.
 *
 * THREAD SAFETY: every function may be called from any thread, except that
 * an object must not be freed while another thread uses it (but a listener
 * may be freed while other threads wait in dp_listener_accept on it: their
 * waits end with DP_ECANCELED). Futures
 * complete on the progress thread, or caller-driven on the thread running a
 * pass (their then() callbacks run there: keep them short). Only that loop
 * completes them, so a wait there on a pending future of the transport (a
 * later receive, a send's completion, a then() of either) would wait
 * forever: it is DP_EMISUSE at once (future.h, WAITING FOR ONE'S OWN LOOP):
 * chain on it with dp_future_then, or wait from another thread. From such
 * a callback dp_endpoint_free returns at once (the loop closes the
 * endpoint after it) and dp_endpoint_connect, send and recv only queue;
 * dp_transport_free is refused (a line on stderr, nothing freed), and so, on a transport with a
 * thread of its own, are dp_listener_new (DP_EINVAL) and dp_listener_free
 * (a line on stderr, nothing freed): each would wait for the thread that
 * runs the callback.
 *
 * FORK: a transport, its listeners and endpoints belong to the process that
 * made them. In a child forked after dp_transport_new, every call on them
 * is refused — DP_EINVAL ("... which forked this one: a child cannot use
 * it"), dp_transport_progress 0, the _free functions a line on stderr and
 * nothing freed — so the child never writes to the parent's connections nor
 * waits for its progress thread; their futures never complete there. The
 * child may exec or exit, but not make a transport of its own: UCX's state
 * there is a copy of the parent's, without the thread that watches its
 * sockets (such a transport connected nowhere, and UCX aborted the child
 * freeing it), so dp_transport_new is DP_EINVAL ("this process was forked
 * from process N while it had a transport ..."). A child forked before the
 * first transport, or once every one was freed, makes its own as usual.
 */
#ifndef DEVPICKLE_TRANSPORT_H
#define DEVPICKLE_TRANSPORT_H

#include "future.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_transport dp_transport_t;
typedef struct dp_listener dp_listener_t;
typedef struct dp_endpoint dp_endpoint_t;

#define DP_TRANSPORT_DEFAULT_INFLIGHT (256ull << 20)

/** Who drives the transport (dp_transport_opts_t.progress). */
typedef enum dp_transport_progress_mode {
  DP_TRANSPORT_PROGRESS_THREAD = 0, /**< a progress thread of its own (the default) */
  DP_TRANSPORT_PROGRESS_CALLER = 1  /**< the caller: dp_transport_progress / dp_transport_wait */
} dp_transport_progress_mode_t;

typedef struct dp_transport_opts {
  /** Per endpoint, per direction: bytes of buffers and of frames over
   *  64 KiB posted and not yet complete (sender), or received and not yet
   *  taken by dp_endpoint_recv (receiver). 0:
   *  DP_TRANSPORT_DEFAULT_INFLIGHT. One value larger than the bound still
   *  goes, alone. As a receiver, also the credit it grants its peers (at
   *  least 1 MiB): bytes of values (frames, buffers and 256 bytes a
   *  value) sent and not yet taken, which the last value sent may cross; a
   *  frame nobody has taken yet is held as its bytes (and a value's buffers
   *  in the allocations its buffer table asks for, bound as it arrives) and
   *  read when taken, values in their order (docs/TRANSPORT.md, "Flow
   *  control");
   *  messages that arrive out of order or held back wait (parked) holding
   *  at most that credit plus 64 MiB of the receiver's memory (their
   *  data, or for one sent by rendezvous the descriptor UCX keeps of it),
   *  past which the endpoint fails (DP_ELIMIT). */
  uint64_t max_inflight_bytes;
  /** A send posted to UCX and not complete after this long fails its
   *  endpoint with DP_ETIMEDOUT; so does a connected endpoint whose peer
   *  has not accepted it after this long (its first message, ACCEPT, never
   *  came), even one that only receives, and one whose sends have waited
   *  this long for the peer's credit with no grant meanwhile (a peer that
   *  stopped taking values: the small ones it was sent completed as they
   *  went, so no posted send is left to time). As a receiver, a value whose
   *  frame came and whose buffers stop arriving (none for this long: a peer
   *  that announced buffers and never sends them) fails its endpoint the
   *  same way, and so does a frame or buffer sent by rendezvous whose
   *  transfer, pulled by this side, makes no progress for this long (a
   *  peer stopped or hung mid-transfer: no pull posted to it completes).
   *  Sends held back by the in-flight bound are not yet posted and not
   *  timed. 0 (or less): no limit (a dead peer is still detected
   *  by UCX's keepalive). */
  int64_t timeout_ns;
  /** Limits and resolver for received frames (copied; the resolver and
   *  its types must outlive the transport; a resolver without its callback,
   *  or with NULL types and ntypes > 0, is DP_EINVAL, as dp_unpickle). bind is ignored: the
   *  transport binds buffers itself. NULL: dp_unpickle's defaults. A frame
   *  is read (its resolver called, on the loop's thread) as it arrives when
   *  a dp_endpoint_recv already waits for it, else as a receive
   *  (dp_endpoint_recv or dp_endpoint_recv_frame) takes it: in the order
   *  the values were sent. A frame with out-of-band buffers has its buffer
   *  table alone checked and bound, under these limits, as it arrives; its
   *  value may be read before its buffers' bytes have all arrived, so a
   *  resolver must not read them (it may keep the tensors: the receive's
   *  future completes, with events covering the bytes, once they are in). A
   *  frame they refuse fails the receive that takes it, a frame receive
   *  included (its buffers are drained, as they come or never do). */
  const dp_unpickle_opts_t *unpickle;
  /** Where received device buffers are allocated: an allocator of
   *  `backend`. NULL: the backend's default caching allocator. Must
   *  outlive the transport and every value and future received through
   *  it. */
  dp_cache_t *cache;
  /** The device backend whose memory the transport moves besides cpu
   *  memory (`host` or `cuda`), and the backend of the futures it returns.
   *  NULL: cache's backend when cache is set, else dp_backend_default()
   *  (cuda when a GPU is usable; DEVPICKLE_BACKEND forces one). */
  dp_backend_t *backend;
  /** DP_TRANSPORT_PROGRESS_THREAD (0, the default) or
   *  DP_TRANSPORT_PROGRESS_CALLER (see the top of this file). */
  dp_transport_progress_mode_t progress;
} dp_transport_opts_t;

/** A transport and its progress thread. opts may be NULL. UCX reads its
 *  own environment (UCX_TLS, UCX_NET_DEVICES, ...). Errors: DP_EINVAL for
 *  a NULL out, an opts.progress that is neither mode or a
 *  DEVPICKLE_TRANSPORT_SHM other than 0 or 1 (set but empty is unset), in
 *  a child forked while a transport lived (FORK, above), or as
 *  dp_backend_default and dp_cache_default fail (an opts.cache of another
 *  backend than opts.backend is DP_EINVAL); DP_ENODEV when UCX cannot start
 *  (its message in err), DP_ENOMEM. */
DP_API int dp_transport_new(const dp_transport_opts_t *opts, dp_transport_t **out, dp_error_t *err);
/** Stops the progress thread after failing every pending future of the
 *  endpoints still open with DP_ECANCELED; frees them, the listeners and
 *  the transport. NULL: nothing. Not from a transport's own callback (nor
 *  from one that a wait driving it runs between its passes: refused, a
 *  line on stderr, nothing freed). The
 *  callbacks of the futures it fails may no longer connect: there
 *  dp_endpoint_connect is DP_ECANCELED ("the transport is being freed"). */
DP_API void dp_transport_free(dp_transport_t *t);

/** Caller-driven transports: one pass of the progress loop on this thread
 *  (commands, UCX, sends, receives, slots, closes, timeouts); never blocks
 *  for long (another thread's pass, at most). Returns 1 when it did work
 *  (call again soon), 0 when idle — and 0 for a transport with a thread of
 *  its own, for NULL, and from inside a pass of this thread (a callback). */
DP_API int dp_transport_progress(dp_transport_t *t);
/** Waits for f as dp_future_wait does (timeout_ns < 0: no limit; the same
 *  result and errors), driving a caller-driven transport meanwhile: passes
 *  while there is work, a spin of up to 200 us, then sleeps on UCX's and
 *  the command queue's descriptors; in a callback of another future (a
 *  pass queues the callbacks of what it completes behind the running one)
 *  it runs those between passes, as dp_future_wait there does, and a wait
 *  for the running callback's own child is DP_EMISUSE at once (future.h).
 *  With a thread of its own, and from a
 *  callback a caller's pass runs (no pass can run there), it is
 *  dp_future_wait (a message of its own limit running out names
 *  dp_transport_wait; a wait on the callback's own child, or on a pending
 *  future of this transport, is DP_EMISUSE at once, future.h). It drives
 *  t alone: a future of another caller-driven transport completes only
 *  while some thread drives that one (with none, a wait without a limit
 *  waits forever, as dp_future_wait does). DP_EINVAL for NULL. */
DP_API int dp_transport_wait(dp_transport_t *t, dp_future_t *f, int64_t timeout_ns, dp_error_t *err);
/** Listens on "HOST:PORT" (PORT 0: an ephemeral port, see
 *  dp_listener_port; HOST may be an IPv4 address or a name, "0.0.0.0" all
 *  interfaces; a name's first IPv4 address is used). Returns once the
 *  socket is bound. Errors: DP_EINVAL for a malformed address, a name
 *  that does not resolve ("cannot resolve 'NAME': " and the resolver's
 *  reason, a name server out of reach included), an IPv6
 *  address or a name with none but IPv6 ones (UCX 1.13's TCP transport
 *  corrupts its heap reaching an IPv6 peer: "'::1' is an IPv6 address,
 *  which the transport does not support ..."), or when called from a
 *  callback run by the transport's own progress thread; DP_EIO when UCX
 *  cannot listen, with the reason: "cannot listen on A:PORT: the address
 *  is in use (...)", "cannot listen on A: it is not an address of this
 *  machine (...)" (a multicast or broadcast address too, and a loopback
 *  address no interface holds, 127.0.0.2: the system would listen and no
 *  connection could come), or the system's. */
DP_API int dp_listener_new(dp_transport_t *t, const char *host_port, dp_listener_t **out, dp_error_t *err);
/** The bound port (0 for NULL). */
DP_API int dp_listener_port(const dp_listener_t *l);
/** The next connection made to l, as a new endpoint, waiting up to
 *  timeout_ns (<0: no limit). DP_ETIMEDOUT when none came. Several threads
 *  may accept on one listener at once: each connection goes to one of them,
 *  and one whose connection another took waits on for the next. From a
 *  callback the transport's loop runs (its thread, or a caller's pass), it
 *  never waits: a connection already queued is taken, else a limit of 0
 *  is DP_ETIMEDOUT and any other DP_EINVAL ("... called from a callback
 *  run by the transport's progress thread with no connection queued ...":
 *  the loop that queues connections waits for the callback). */
DP_API int dp_listener_accept(dp_listener_t *l, int64_t timeout_ns, dp_endpoint_t **out, dp_error_t *err);
/** Stops listening; connections accepted and not yet taken are closed,
 *  and accepts that other threads wait in on l return DP_ECANCELED ("the
 *  listener on port N was freed while this waited"; l's memory goes once
 *  they left). Waits for the loop; from a callback run by the transport's own progress
 *  thread it is refused (a line on stderr, nothing freed). Not while
 *  connection requests are still arriving: UCX 1.13 may then read the
 *  freed listener and crash the process, even later (openucx/ucx#11087;
 *  docs/TRANSPORT.md, "Not yet supported"): accept, or stop the peers
 *  connecting, first. */
DP_API void dp_listener_free(dp_listener_t *l);

/** An endpoint connecting to "HOST:PORT" (IPv4, as dp_listener_new).
 *  Returns at once (once a name is resolved, which it does on the calling
 *  thread, as dp_listener_new does): a refused or failed connection fails the endpoint (its
 *  futures fail with DP_EIO, "connection refused or lost before any reply
 *  (UCX's reason)", or "connection lost (...)" once the peer answered).
 *  DP_EINVAL for a malformed address, a name that does not resolve or an
 *  IPv6 address (as dp_listener_new). */
DP_API int dp_endpoint_connect(dp_transport_t *t, const char *host_port, dp_endpoint_t **out, dp_error_t *err);
/** Closes the endpoint: pending sends and receives fail with DP_ECANCELED
 *  ("closed with N sends and M receives pending"), received buffers not
 *  taken are freed, and the connection is closed. With no send pending
 *  the close is graceful: a CLOSE message counting the values sent tells
 *  the peer, whose endpoint fails with DP_ECANCELED ("the peer closed its
 *  endpoint (after sending N values, all received)") once those values
 *  arrived — they are still taken by its receives first — and the
 *  connection is flushed and closed on its answer (or after 1 s without
 *  one); with sends pending it is closed by force, and the peer reads
 *  "connection lost" (docs/TRANSPORT.md, "Failures"). So does the peer of
 *  a connected endpoint freed before the peer's first message (ACCEPT)
 *  reached it, whatever is pending: its connection may not be made yet,
 *  and it sends no CLOSE (DP_EIO, or DP_ETIMEDOUT "connection lost
 *  (Endpoint timeout)" as UCX reports it). Waits for the loop to close it (caller-driven: runs
 *  passes until the close is done, at most 1 s, so the peer learns of it
 *  without further passes; a peer that does not answer UCX's disconnect
 *  meanwhile sees it at this process's later passes); called from a
 *  callback the loop runs (a future of this transport completing on the
 *  progress thread, or in a caller's pass), it returns at once and the
 *  loop closes the endpoint after the callback (do not use ep after:
 *  a send or receive made on it there is DP_ECANCELED at once, "the
 *  endpoint was freed (dp_endpoint_free)"; except: a callback of
 *  another of its futures may call dp_endpoint_free on it again while that close runs — the close fails the futures still
 *  pending, so "on error, close" in each callback is safe: that call
 *  returns at once; one from a thread before the loop has closed it waits
 *  for that close; neither closes it twice).
 *  dp_transport_free from such a callback is refused (a message on stderr,
 *  nothing freed): free the transport after the loop returns. NULL:
 *  nothing. */
DP_API void dp_endpoint_free(dp_endpoint_t *ep);
/** 0 while the endpoint works; else its error (copied into err, which may
 *  be NULL). DP_EINVAL for a NULL ep. */
DP_API int dp_endpoint_error(const dp_endpoint_t *ep, dp_error_t *err);

/** Sends v (retained until the send completes; do not mutate it meanwhile).
 *  Host memory is read as it is then; staged (cuda) buffers after the work
 *  queued on this thread's current stream of their device so far. *done
 *  completes when every buffer may be reused. Errors returned at once (and
 *  *done then NULL): DP_EINVAL (also for a storage dp_unpickle made
 *  without a bind callback, or one carrying host data — its base is the
 *  writer's address, not this process's memory: send that frame instead;
 *  and for a storage at a NULL base with bytes), the pickler's (DP_ETYPE, DP_ELIMIT, ...),
 *  DP_ENODEV for a buffer the transport cannot move (a device of another
 *  backend, or an index the backend does not have), the backend's (recording on the current stream), the
 *  endpoint's error. Later failures fail *done. */
DP_API int dp_endpoint_send(dp_endpoint_t *ep, dp_value_t v, dp_future_t **done, dp_error_t *err);
/** Sends f's value once f has completed and its events have (f's
 *  completion wakes the transport's loop, which then polls the events: no
 *  host thread blocks, no device is synchronized, and nothing spins while
 *  f is pending). f is retained. If f fails, *done fails with its error and
 *  nothing is sent. Errors returned at once (*done then NULL): DP_EINVAL
 *  for a NULL argument, the endpoint's error, DP_ENOMEM. What
 *  dp_endpoint_send refuses of a value at once (the pickler's errors,
 *  DP_ENODEV, DP_EINVAL for a storage it cannot read) is known only once
 *  f has completed: it fails *done then, nothing of that value is sent,
 *  and the endpoint goes on with the next send. */
DP_API int dp_endpoint_send_future(dp_endpoint_t *ep, dp_future_t *f, dp_future_t **done, dp_error_t *err);
/** Sends a frame as it is (the bytes are copied): it must pass
 *  dp_frame_check (its error otherwise: DP_ETRUNC, DP_EFORMAT, ...) and
 *  carry its buffers inline, or have none (DP_EINVAL otherwise). The peer
 *  receives it as any value: dp_endpoint_recv gives a value whose storages
 *  carry the frame's bytes as host data (their base is the sender's
 *  address, never read), dp_endpoint_recv_frame the frame itself. */
DP_API int dp_endpoint_send_frame(dp_endpoint_t *ep, const void *bytes, size_t n, dp_future_t **done,
                                  dp_error_t *err);

/** A future of the next value received on ep (new reference). Futures are
 *  matched to values in call order and in the sender's order. The value's
 *  out-of-band storages are new allocations on this process (their base is
 *  the received memory; freeing the value frees them). */
DP_API int dp_endpoint_recv(dp_endpoint_t *ep, dp_future_t **out, dp_error_t *err);
/** As dp_endpoint_recv, for a self-contained frame (inline, or without
 *  buffers): the future's value is a bytes value holding the frame,
 *  checked as dp_unpickle checks it (with the transport's unpickle options,
 *  limits and resolver: a frame they refuse fails this receive).
 *  A message with out-of-band buffers fails it with DP_EFORMAT — at its
 *  frame when this receive is already waiting for it (its buffers are then
 *  neither allocated nor waited for), else as it is delivered. */
DP_API int dp_endpoint_recv_frame(dp_endpoint_t *ep, dp_future_t **out, dp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
