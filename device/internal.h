/* device/internal.h — the backend ops table and the structs behind the
 * handles of device.h. */
#ifndef DP_DEVICE_INTERNAL_H
#define DP_DEVICE_INTERNAL_H

#include <pthread.h>

#include "devpickle/base.h"
#include "devpickle/device.h"
#include "../core/internal.h"

/* A backend is this table. Handles are the backend's own (a cudaStream_t,
 * a host stream); device.c wraps them in dp_stream_t / dp_event_t. */
typedef struct dp__backend_ops {
  int (*init)(dp_backend_t *b, dp_error_t *err);          /* sets b->ndev, and b->impl if it keeps state */
  void (*shutdown)(dp_backend_t *b);
  int (*stream_create)(dp_backend_t *b, int dev, void **h, dp_error_t *err);
  void (*stream_destroy)(dp_backend_t *b, void *h);        /* after its work completes */
  /* The handle for a native stream the caller owns (dp_stream_wrap), after
   * checking it where the backend can; stream_destroy is never called on it. */
  int (*stream_wrap)(dp_backend_t *b, int dev, void *native, void **h, dp_error_t *err);
  void *(*stream_native)(void *h);
  int (*stream_sync)(dp_backend_t *b, void *h, dp_error_t *err);
  int (*stream_query)(dp_backend_t *b, void *h, dp_error_t *err);  /* 1 done, 0 pending, <0 error */
  int (*stream_wait)(dp_backend_t *b, void *sh, void *eh, dp_error_t *err);
  int (*event_create)(dp_backend_t *b, int dev, void **h, dp_error_t *err);
  void (*event_destroy)(dp_backend_t *b, void *h);
  /* Back to never-recorded (may be NULL). <0: no handle could be made
   * afresh; *h is then NULL (the old one destroyed). */
  int (*event_reset)(dp_backend_t *b, int dev, void **h);
  int (*event_record)(dp_backend_t *b, void *eh, void *sh, dp_error_t *err);
  int (*event_query)(dp_backend_t *b, void *eh, dp_error_t *err);
  int (*event_sync)(dp_backend_t *b, void *eh, dp_error_t *err);
  int (*device_sync)(dp_backend_t *b, int dev, dp_error_t *err);
  int (*malloc)(dp_backend_t *b, int dev, size_t n, void **out, dp_error_t *err);
  int (*free)(dp_backend_t *b, int dev, void *p, dp_error_t *err);  /* DP_EINVAL: not this backend's */
  int (*pointer_device)(dp_backend_t *b, const void *p, int *dev);
  int (*memcpy_async)(dp_backend_t *b, void *sh, void *dst, const void *src, size_t n, dp_error_t *err);
  /* Page-locked host memory, for staging copies (cudaHostAlloc; plain
   * memory for `host`). n > 0. */
  int (*pinned_alloc)(dp_backend_t *b, size_t n, void **out, dp_error_t *err);
  void (*pinned_free)(dp_backend_t *b, void *p, size_t n);
  /* Page-locks memory mapped elsewhere (a shared segment): cudaHostRegister;
   * nothing for `host`. */
  int (*pinned_register)(dp_backend_t *b, void *p, size_t n, int readonly, dp_error_t *err);
  void (*pinned_unregister)(dp_backend_t *b, void *p);
  /* 1 when no stream of any device has work pending (may be NULL: the
   * backend runs no work of the caller's that could use it meanwhile). */
  int (*idle)(dp_backend_t *b);
} dp__backend_ops_t;

/* Who owns a dp_stream_t, and with it its handle. */
enum {
  DP__STREAM_CALLER = 0,  /* dp_stream_new: dp_stream_free destroys it */
  DP__STREAM_BACKEND,     /* default and pool streams: destroyed by dp_shutdown */
  DP__STREAM_WRAPPED,     /* dp_stream_wrap: the struct is the backend's, the handle the caller's */
};

struct dp_stream {
  dp_backend_t *b;
  dp_device_t dev;
  void *h;
  int owned;              /* DP__STREAM_* */
  dp_stream_t *next_retired;  /* wrapped: on the device's retired list once its native went away */
};

struct dp_event {
  dp_backend_t *b;
  dp_device_t dev;
  void *h;
  dp_event_t *next_free;  /* the pool's free list */
  _Atomic int pooled;     /* on the free list: a second dp_event_free does nothing */
};

#define DP_POOL_STREAMS 4

/* The wrappers of native streams (dp_stream_wrap) of one device, by native
 * handle: open addressing, read without a lock. A table is never changed
 * except by filling an empty slot (stream, then key, released) or by
 * emptying a slot's stream (its native went away: a reader then takes the
 * locked path); growing publishes a copy and keeps the old table, for the
 * readers still in it, until dp_shutdown. */
typedef struct dp__wrap_slot {
  _Atomic uintptr_t key;        /* native + 1; 0: empty */
  dp_stream_t *_Atomic s;       /* NULL: its native was freed through dp_stream_free */
} dp__wrap_slot_t;

typedef struct dp__wrap_table {
  size_t nslots;                /* a power of two */
  size_t used;                  /* slots with a key */
  struct dp__wrap_table *older; /* the tables it replaced */
  dp__wrap_slot_t slots[];
} dp__wrap_table_t;

typedef struct dp__devstate {
  pthread_mutex_t mu;     /* guards lazy creation, the event pool, wrapper inserts */
  dp_stream_t *_Atomic default_stream;  /* made once, under mu; read without it */
  dp_stream_t *_Atomic pool[DP_POOL_STREAMS];
  _Atomic unsigned pool_next;
  dp_event_t *free_events;
  dp__wrap_table_t *_Atomic wraps;  /* NULL until the first wrap; grown under mu */
  dp_stream_t *retired;   /* wrappers whose native went away, freed by dp_shutdown */
} dp__devstate_t;

struct dp_backend {
  dp_device_type_t type;
  const char *name;
  const dp__backend_ops_t *ops;
  int ndev;
  dp__devstate_t *devs;
  void *impl;
};

extern const dp__backend_ops_t dp__host_ops;
/* Tests: the places in a device's list of streams that the host backend's
 * frees have stepped over while draining the device (host.c): linear in
 * its streams, however many of them are busy. */
extern _Atomic uint64_t dp__host_drain_steps;
/* Calls of each type's init (tests: an unavailable backend is asked once). */
extern _Atomic unsigned dp__backend_inits[DP_DEVICE_TYPE_COUNT];
extern const dp__backend_ops_t dp__cuda_ops;

/* Stream-destroy notices. A module above that keeps stream pointers (the
 * caching allocator) registers a listener; dp_stream_free calls every
 * listener, after the stream's work has completed and before its handle is
 * freed, so that nothing keeps pointing at it. The node is the caller's
 * (embedded in its object: registering cannot fail); unlisten before
 * freeing it. Listeners run under the device layer's listener lock, in no
 * particular order, and must not create or free streams. */
typedef struct dp__stream_listener {
  void (*fn)(void *ctx, dp_stream_t *s);
  void *ctx;
  struct dp__stream_listener *next;
} dp__stream_listener_t;
void dp__stream_listen(dp__stream_listener_t *l);
void dp__stream_unlisten(dp__stream_listener_t *l);

/* The device layer's part of dp_shutdown (devpickle.h): stops every backend
 * (waits for queued host work, joins the host threads, destroys pooled
 * streams and events), empties the registry, forgets the stream provider
 * and the calling thread's current streams. Everything above that holds
 * backend objects (caches, futures) must be gone first. */
void dp__device_shutdown(void);
/* On a host stream's worker thread while it runs a host function
 * (dp_host_launch): that stream's handle (dp_stream's h), else NULL. Such
 * code must not block on a stream's events: its own stream's, recorded
 * after it, would never complete. */
extern _Thread_local const void *dp__host_fn_stream;

/* 1 when dp_event_synchronize(e) would wait for the host function that
 * calls it (it is DP_EMISUSE there): a poll of e from that function would
 * never see it complete, so a timed wait refuses at once as the untimed
 * one does. 0 when it would not; DP_ENOMEM (err says so, naming fn, the
 * public call asking) when the waits could not be followed for want of
 * memory: the caller must not wait then. */
int dp__event_waits_for_itself(const dp_event_t *e, const char *fn, dp_error_t *err);
int dp__host_event_waits_for_itself(void *eh, const char *fn, dp_error_t *err);
/* The same for dp_stream_synchronize of host stream sh (its handle) from
 * the host function calling it: 1 or 2 when it would wait for itself, 0
 * when not, DP_ENOMEM (err names fn) when that could not be told. For a
 * call that queues work before it waits (dp_device_read): asked first, so
 * that a refusal queues nothing. */
int dp__host_stream_waits_for_itself(dp_backend_t *b, void *sh, const char *fn, dp_error_t *err);
/* Test hook: the steps (streams looked at, tasks scanned) that the host
 * backend's look for a host function waiting for itself has taken. */
extern _Atomic uint64_t dp__host_self_wait_steps;

/* dp_stream_device, inline: the cache's allocation path reads it. */
static inline dp_device_t dp__stream_dev(const dp_stream_t *s) { return s->dev; }

/* Host memory the backend copies to and from its devices at full speed
 * (page-locked for cuda), for staging buffers: n bytes, n > 0. Freed with
 * dp__pinned_free(b, p, n) before dp_shutdown. */
int dp__pinned_alloc(dp_backend_t *b, size_t n, void **out, dp_error_t *err);
void dp__pinned_free(dp_backend_t *b, void *p, size_t n);
/* The same for memory mapped by the caller (a shared-memory segment):
 * registered in place (readonly: the device only reads it), unregistered
 * before it is unmapped. */
int dp__pinned_register(dp_backend_t *b, void *p, size_t n, int readonly, dp_error_t *err);
void dp__pinned_unregister(dp_backend_t *b, void *p);

/* The streams a then() callback runs with (future.h): enter makes s
 * current for its device on this thread, saving what was there; leave puts
 * that back. Unlike dp_set_current_stream, they never fail: they do not
 * count against the caller's DP_CURRENT_STREAM_SLOTS. Pairs nest (a wait in
 * a callback runs other callbacks) and are left in the reverse order of
 * entering. The saved records stay linked on the thread until left, so
 * that dp_stream_free of a saved stream (from the callback) forgets it
 * there too: leave must not put a freed stream back.
 *
 * They are made inside a frame (frame_begin, before the first enter;
 * frame_end, after the last leave): a callback runs on whatever thread
 * completes its parent, so what it does to that thread's current streams
 * on other devices (dp_set_current_stream, dp_reset_current_stream) is
 * logged in the frame, on the first change of each device, and put back at
 * its end — a stream of the callback's left current there was used by that
 * thread's later completions, after its owner freed it. The log lives in
 * the frame (a few entries inline, more on the heap). */
typedef struct dp__current_saved {
  dp_stream_t *s;
  int owner;
  uint32_t mark;                    /* the frame that had logged the device before */
  struct dp__current_saved *outer;  /* the record entered before this one */
} dp__current_saved_t;

typedef struct dp__current_log {
  int slot;
  int owner;
  uint32_t mark;
  dp_stream_t *s;
} dp__current_log_t;

#define DP__FRAME_LOG_INLINE 4
typedef struct dp__current_frame {
  struct dp__current_frame *outer;
  uint32_t depth;                   /* 1 for the outermost frame */
  size_t n, cap;
  dp__current_log_t *log;           /* inl, or the heap */
  dp__current_log_t inl[DP__FRAME_LOG_INLINE];
} dp__current_frame_t;
void dp__current_frame_begin(dp__current_frame_t *fr);
void dp__current_frame_end(dp__current_frame_t *fr);
void dp__current_stream_enter(dp_stream_t *s, dp__current_saved_t *saved);
void dp__current_stream_leave(dp_device_t dev, const dp__current_saved_t *saved);

/* A failure from below a public call of this layer (a backend's op, which
 * serves several calls and cannot tell which): its message is made to name
 * the call and the device, "fn(host:1): ..." (device.h promises both), but
 * for one that starts with fn already. The code and backend code stay. */
int dp__named(const char *fn, const char *dev, int rc, dp_error_t *err);
int dp__named_dev(const char *fn, dp_device_t dev, int rc, dp_error_t *err);

/* Checks that dev belongs to b; fills err. */
int dp__check_device(const char *fn, const dp_backend_t *b, dp_device_t dev, dp_error_t *err);
#endif
