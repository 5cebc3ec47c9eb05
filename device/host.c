/* device/host.c — the host backend: streams executed by worker threads.
 *
 * Each stream has one worker thread that runs its queue in order. A stream's
 * progress is a counter of completed tasks; an event is a (progress, target)
 * pair captured at record time and is complete when the counter reaches the
 * target. Waiting on an event from another stream queues a task that blocks
 * that stream's worker until the counter gets there — the host thread that
 * queued it never blocks. The progress record is reference counted, so an
 * event or a queued wait outlives the stream it refers to safely.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "../core/treap.h"

#define HOST_MAX_DEVICES 64
#define HOST_ALIGN 256   /* as cudaMalloc's alignment */
#define HOST_RING_KEEP 64  /* tasks: a stream's first ring, kept while idle; a larger one is freed once drained */

struct hstream;

typedef struct progress {
  _Atomic uint32_t refs;
  struct hstream *owner;        /* the stream it counts for; NULL once gone (under the impl's mu) */
  pthread_mutex_t mu;
  pthread_cond_t cv;            /* broadcast after every completed task */
  _Atomic uint64_t completed;
  /* waits_for_itself_locked's marks, under the impl's mu: the walk that
     last looked at the stream, and the task it was scanned up to */
  uint64_t walk;
  uint64_t walk_scanned;
} progress_t;

enum { T_FN, T_WAIT, T_COPY };

typedef struct task {
  int kind;
  dp_host_fn fn;
  void *arg;
  progress_t *wait_on;   /* T_WAIT: a reference */
  uint64_t wait_for;
  void *dst;
  const void *src;
  size_t n;
} task_t;

/* A place in a device's list of streams, newest first: a stream's own, or
 * the cursor of a free draining the device (s NULL), which holds the
 * drain's place while it waits without the lock — the stream it waited on
 * may go meanwhile, the cursor stays. Whoever walks the list passes over
 * cursors. */
typedef struct slink {
  struct slink *next, *prev;
  struct hstream *s;       /* NULL: a cursor */
} slink_t;

typedef struct hstream {
  pthread_mutex_t mu;
  pthread_cond_t work_cv;
  task_t *ring;
  size_t cap, head, count;
  uint64_t enqueued;       /* under mu */
  progress_t *waiting_on;  /* the T_WAIT running now (a reference), and its target: under mu */
  uint64_t waiting_for;
  int stop;
  int dev;
  progress_t *prog;
  pthread_t thread;
  slink_t link;            /* in the device's streams */
} hstream_t;

typedef struct host_impl host_impl_t;

typedef struct hevent {
  pthread_mutex_t mu;
  host_impl_t *im;
  progress_t *prog;        /* NULL: never recorded */
  uint64_t target;
} hevent_t;

/* An allocation: a node of a treap (core/treap.h) ordered by base, so
 * that any interior pointer finds its allocation, and an allocation is
 * added or removed in logarithmic time whatever the order of frees. */
typedef struct alloc_rec {
  uintptr_t base;          /* aligned address handed out */
  size_t size;
  void *raw;               /* what the hook returned */
  size_t raw_size;
  int dev;
  dp__treap_node_t tn;     /* keyed (base, 0) */
} alloc_rec_t;

struct host_impl {
  pthread_mutex_t mu;      /* streams lists, allocation registry, progress owners */
  slink_t *streams[HOST_MAX_DEVICES];  /* newest first */
  dp__treap_t recs;        /* the allocations */
  size_t used[HOST_MAX_DEVICES];
  size_t limit[HOST_MAX_DEVICES];
  uint64_t walks;          /* waits_for_itself_locked's walks so far: each marks what it looked at */
};

/* Limits set before the backend exists are kept here. */
static size_t pending_limit[HOST_MAX_DEVICES];
static pthread_mutex_t limit_mu = PTHREAD_MUTEX_INITIALIZER;
static host_impl_t *live_impl;

/* ---- progress ---- */

static progress_t *progress_new(void) {
  progress_t *p = dp__alloc(sizeof *p);
  if (!p) return NULL;
  dp__atomic_init(&p->refs, 1);
  dp__atomic_init(&p->completed, 0);
  p->walk = p->walk_scanned = 0;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  return p;
}

static progress_t *progress_retain(progress_t *p) {
  dp__ref_inc(&p->refs, "host stream progress");
  return p;
}

static void progress_release(progress_t *p) {
  if (!p || !dp__ref_dec(&p->refs)) return;
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  dp__free(p, sizeof *p);
}

static void progress_wait(progress_t *p, uint64_t target) {
  if (dp__load_acquire(&p->completed) >= target) return;
  pthread_mutex_lock(&p->mu);
  while (dp__load_acquire(&p->completed) < target) pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

/* ---- streams ---- */

static void link_push(slink_t **head, slink_t *l) {
  l->prev = NULL;
  l->next = *head;
  if (*head) (*head)->prev = l;
  *head = l;
}

static void link_unlink(slink_t **head, slink_t *l) {
  if (l->prev) l->prev->next = l->next; else *head = l->next;
  if (l->next) l->next->prev = l->prev;
  l->next = l->prev = NULL;
}

static void link_insert_after(slink_t *at, slink_t *l) {
  l->prev = at;
  l->next = at->next;
  if (at->next) at->next->prev = l;
  at->next = l;
}

_Thread_local const void *dp__host_fn_stream;

static void *worker(void *arg) {
  hstream_t *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (s->count == 0 && !s->stop) pthread_cond_wait(&s->work_cv, &s->mu);
    if (s->count == 0 && s->stop) break;
    task_t t = s->ring[s->head];
    s->head = (s->head + 1) % s->cap;
    s->count--;
    /* A burst grew the ring; once the last task is taken, the memory goes
       back (the next launch makes a small one again), before that task
       completes, so a synchronize sees it gone: a default or pool stream,
       alive until dp_shutdown, kept 64 bytes for every task of its largest
       burst (64 MB after a million launches queued at once). */
    if (s->count == 0 && s->cap > HOST_RING_KEEP) {
      dp__free(s->ring, s->cap * sizeof(task_t));
      s->ring = NULL;
      s->cap = 0;
      s->head = 0;
    }
    if (t.kind == T_WAIT) { /* still a wait of the stream's while it runs (waits_for_itself) */
      s->waiting_on = t.wait_on;
      s->waiting_for = t.wait_for;
    }
    pthread_mutex_unlock(&s->mu);
    switch (t.kind) {
      case T_FN:
        dp__host_fn_stream = s;
        t.fn(t.arg);
        dp__host_fn_stream = NULL;
        break;
      case T_WAIT:
        progress_wait(t.wait_on, t.wait_for);
        pthread_mutex_lock(&s->mu);
        s->waiting_on = NULL;
        pthread_mutex_unlock(&s->mu);
        progress_release(t.wait_on);
        break;
      case T_COPY:
        memmove(t.dst, t.src, t.n);
        break;
    }
    pthread_mutex_lock(&s->prog->mu);
    dp__fetch_add_release(&s->prog->completed, 1);
    pthread_cond_broadcast(&s->prog->cv);
    pthread_mutex_unlock(&s->prog->mu);
    pthread_mutex_lock(&s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static int enqueue(hstream_t *s, const task_t *t, dp_error_t *err) {
  pthread_mutex_lock(&s->mu);
  if (s->count == s->cap) {
    size_t ncap = s->cap ? s->cap * 2 : HOST_RING_KEEP;
    task_t *r = dp__alloc_array(ncap, sizeof *r);
    if (!r) {
      pthread_mutex_unlock(&s->mu);
      return dp__err(err, DP_ENOMEM, "out of memory queueing host work");
    }
    for (size_t i = 0; i < s->count; i++) r[i] = s->ring[(s->head + i) % s->cap];
    dp__free(s->ring, s->cap * sizeof *r);
    s->ring = r;
    s->cap = ncap;
    s->head = 0;
  }
  s->ring[(s->head + s->count) % s->cap] = *t;
  s->count++;
  s->enqueued++;
  pthread_cond_signal(&s->work_cv);
  pthread_mutex_unlock(&s->mu);
  return 0;
}

static int h_stream_create(dp_backend_t *b, int dev, void **h, dp_error_t *err) {
  host_impl_t *im = b->impl;
  hstream_t *s = dp__alloc(sizeof *s);
  if (!s) return dp__err(err, DP_ENOMEM, "out of memory creating a host stream");
  memset(s, 0, sizeof *s);
  s->dev = dev;
  if (!(s->prog = progress_new())) {
    dp__free(s, sizeof *s);
    return dp__err(err, DP_ENOMEM, "out of memory creating a host stream");
  }
  s->prog->owner = s;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->work_cv, NULL);
  if (pthread_create(&s->thread, NULL, worker, s) != 0) {
    progress_release(s->prog);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->work_cv);
    dp__free(s, sizeof *s);
    return dp__err(err, DP_ENOMEM, "cannot start a host stream thread");
  }
  s->link.s = s;
  pthread_mutex_lock(&im->mu);
  link_push(&im->streams[dev], &s->link);
  pthread_mutex_unlock(&im->mu);
  *h = s;
  return 0;
}

static void h_stream_destroy(dp_backend_t *b, void *h) {
  host_impl_t *im = b->impl;
  hstream_t *s = h;
  pthread_mutex_lock(&s->mu);
  s->stop = 1;  /* the worker drains the queue first */
  pthread_cond_signal(&s->work_cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  pthread_mutex_lock(&im->mu);
  link_unlink(&im->streams[s->dev], &s->link);
  s->prog->owner = NULL; /* events and waits that hold it outlive the stream */
  pthread_mutex_unlock(&im->mu);
  progress_release(s->prog);
  dp__free(s->ring, s->cap * sizeof(task_t));
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->work_cv);
  dp__free(s, sizeof *s);
}

/* A host stream's native handle is its hstream_t: opaque to the caller,
 * good for dp_stream_wrap and nothing else. */
static void *h_stream_native(void *h) { return h; }

/* Wrapping checks that native is a live stream of dev: the host backend
 * knows all of its streams, and a wrapper is made only once per handle
 * (dp_stream_free takes it out of the cache when the stream goes). */
static int h_stream_wrap(dp_backend_t *b, int dev, void *native, void **h, dp_error_t *err) {
  host_impl_t *im = b->impl;
  int on = -1;
  pthread_mutex_lock(&im->mu);
  for (int d = 0; d < b->ndev && on < 0; d++)
    for (slink_t *l = im->streams[d]; l; l = l->next)
      if (l->s && l->s == native) {
        on = d;
        break;
      }
  pthread_mutex_unlock(&im->mu);
  if (on < 0) return dp__err(err, DP_EINVAL, "dp_stream_wrap: %p is not a live host stream", native);
  if (on != dev) return dp__err(err, DP_EINVAL, "dp_stream_wrap: %p is a stream of host:%d, not host:%d", native, on, dev);
  *h = native;
  return 0;
}

static uint64_t enqueued_now(hstream_t *s) {
  pthread_mutex_lock(&s->mu);
  uint64_t n = s->enqueued;
  pthread_mutex_unlock(&s->mu);
  return n;
}

/* A host function that waits for work of its own stream queued from itself
 * on (itself included) waits for itself: its worker never returns, and the
 * stream, and whatever synchronizes with it, hangs. CUDA refuses a
 * synchronizing call from a host function (cudaErrorNotPermitted); here it
 * is DP_EMISUSE. Work queued before the function has completed already.
 *
 * So does one that waits for another stream's work that waits (a
 * dp_stream_wait_event queued there, running or not, or down a chain of
 * them) for such work: the waits that stand before the target are followed
 * under the impl's lock (which keeps progress owners, and so the progress
 * records of live streams, alive) and one stream's lock at a time. Each
 * stream's tasks are scanned once a walk: its progress record keeps the
 * walk's mark and how far it was scanned, so a stream met again with a
 * further target scans only the tasks past that, and one met with a target
 * it was scanned to costs one step. Time is linear in the streams and tasks
 * reached (a chain of n streams cost n * n with a list of those seen).
 * Only host functions pay for it. Returns 1 (direct), 2 (through another
 * stream's wait) or 0; without memory to follow the waits, DP_ENOMEM with a
 * message naming fn: the caller must not wait then (it may wait for
 * itself). */
typedef struct reach_wait {
  progress_t *p;
  uint64_t target;
} reach_wait_t;

_Atomic uint64_t dp__host_self_wait_steps;

static int push_wait(reach_wait_t **stack, size_t *cap, size_t *sp, const reach_wait_t *inl, progress_t *p,
                     uint64_t target) {
  if (dp__grow_inl((void **)stack, cap, *sp + 1, sizeof **stack, inl) != 0) return DP_ENOMEM;
  (*stack)[(*sp)++] = (reach_wait_t){p, target};
  return 0;
}

/* One walk from n targets at once (dp_device_synchronize's, one for each
 * stream of the device): a walk for each of them looked at the streams
 * they share again each time, n * n steps for n streams that wait one for
 * the next. */
static int waits_for_itself_locked_n(host_impl_t *im, progress_t *const *ps, const uint64_t *targets, size_t nt,
                                     const char *fn, dp_error_t *err) {
  const hstream_t *me = dp__host_fn_stream;
  if (!me) return 0;
  const progress_t *mine = me->prog;
  uint64_t now = dp__load_acquire(&mine->completed);
  for (size_t i = 0; i < nt; i++)
    if (ps[i] == mine && now < targets[i]) return 1;
  /* No entry holds a reference: only mine and records whose stream is
     live are pushed, and those live while the impl's lock is held. */
  reach_wait_t inl[16] = {{NULL, 0}}, *stack = inl;
  size_t cap = 16, sp = 0;
  uint64_t walk = ++im->walks, steps = 0;
  int found = 0, rc = 0;
  if (dp__grow_inl((void **)&stack, &cap, nt, sizeof *stack, inl) != 0)
    return dp__err(err, DP_ENOMEM,
                   "%s: out of memory following the event waits of the streams it would wait for, to tell whether "
                   "the host function calling it would wait for itself: nothing waited for",
                   fn);
  for (size_t i = nt; i-- > 0;)  /* popped in the order given */
    if (ps[i] != mine) stack[sp++] = (reach_wait_t){ps[i], targets[i]};
  while (sp && !found) {
    reach_wait_t x = stack[--sp];
    steps++;
    if (x.p == mine) {
      found = now < x.target ? 2 : 0;
      continue;
    }
    hstream_t *s = x.p->owner;
    if (!s || dp__load_acquire(&x.p->completed) >= x.target) continue;
    uint64_t done = 0; /* the tasks up to it were scanned this walk */
    if (x.p->walk == walk) {
      if (x.p->walk_scanned >= x.target) continue;
      done = x.p->walk_scanned;
    }
    x.p->walk = walk;
    x.p->walk_scanned = x.target;
    pthread_mutex_lock(&s->mu);
    uint64_t first = s->enqueued - s->count + 1; /* the sequence number of the ring's head */
    uint64_t lo = done + 1 > first ? done + 1 : first, n = 0;
    if (lo - first < s->count && lo <= x.target) {
      n = s->count - (lo - first);
      if (n > x.target - lo + 1) n = x.target - lo + 1;
    }
    /* room for the waits pushed, not for every task scanned: a stream
       with a million host functions queued and no wait asked for 16 MB */
    int oom = 0;
    progress_t *q = s->waiting_on;
    if (q && (q == mine || q->owner)) oom = push_wait(&stack, &cap, &sp, inl, q, s->waiting_for);
    for (uint64_t j = 0; j < n && !oom; j++) {
      const task_t *t = &s->ring[(s->head + (lo - first) + j) % s->cap];
      q = t->wait_on;
      if (t->kind == T_WAIT && (q == mine || q->owner)) oom = push_wait(&stack, &cap, &sp, inl, q, t->wait_for);
    }
    steps += n;
    pthread_mutex_unlock(&s->mu);
    if (oom) {
      rc = dp__err(err, DP_ENOMEM,
                   "%s: out of memory following the event waits of the streams it would wait for, to tell whether "
                   "the host function calling it would wait for itself: nothing waited for",
                   fn);
      break;
    }
  }
  dp__free_inl(stack, cap, sizeof *stack, inl);
  dp__fetch_add_relaxed(&dp__host_self_wait_steps, steps);
  return rc ? rc : found;
}

static int waits_for_itself_locked(host_impl_t *im, progress_t *p, uint64_t target, const char *fn,
                                   dp_error_t *err) {
  return waits_for_itself_locked_n(im, &p, &target, 1, fn, err);
}

static int waits_for_itself(host_impl_t *im, progress_t *p, uint64_t target, const char *fn, dp_error_t *err) {
  if (!dp__host_fn_stream) return 0;
  pthread_mutex_lock(&im->mu);
  int self = waits_for_itself_locked(im, p, target, fn, err);
  pthread_mutex_unlock(&im->mu);
  return self;
}

int dp__host_stream_waits_for_itself(dp_backend_t *b, void *sh, const char *fn, dp_error_t *err) {
  hstream_t *s = sh;
  if (!dp__host_fn_stream) return 0;
  return waits_for_itself(b->impl, s->prog, enqueued_now(s), fn, err);
}

static int h_stream_sync(dp_backend_t *b, void *h, dp_error_t *err) {
  hstream_t *s = h;
  uint64_t target = enqueued_now(s);
  int self = waits_for_itself(b->impl, s->prog, target, "dp_stream_synchronize", err);
  if (self < 0) return self;
  if (self == 1)
    return dp__err(err, DP_EMISUSE, "dp_stream_synchronize: called from a host function on that stream, which would wait for itself");
  if (self)
    return dp__err(err, DP_EMISUSE,
                   "dp_stream_synchronize: called from a host function, on a stream that waits (through event waits) for "
                   "work queued on the function's own stream after it: it would wait for itself");
  progress_wait(s->prog, target);
  return 0;
}

static int h_stream_query(dp_backend_t *b, void *h, dp_error_t *err) {
  (void)b;
  (void)err;
  hstream_t *s = h;
  return dp__load_acquire(&s->prog->completed) >= enqueued_now(s);
}

static int h_stream_wait(dp_backend_t *b, void *sh, void *eh, dp_error_t *err) {
  (void)b;
  hevent_t *e = eh;
  task_t t = {T_WAIT, NULL, NULL, NULL, 0, NULL, NULL, 0};
  pthread_mutex_lock(&e->mu);
  if (e->prog) {
    t.wait_on = progress_retain(e->prog);
    t.wait_for = e->target;
  }
  pthread_mutex_unlock(&e->mu);
  if (!t.wait_on) return 0;  /* never recorded: nothing to wait for */
  if (dp__load_acquire(&t.wait_on->completed) >= t.wait_for) {  /* already complete */
    progress_release(t.wait_on);
    return 0;
  }
  int rc = enqueue(sh, &t, err);
  if (rc) progress_release(t.wait_on);
  return rc;
}

static int h_device_sync(dp_backend_t *b, int dev, dp_error_t *err) {
  host_impl_t *im = b->impl;
  /* Capture every stream's target under the lock, wait outside it. */
  pthread_mutex_lock(&im->mu);
  size_t n = 0;
  for (slink_t *l = im->streams[dev]; l; l = l->next) n += l->s != NULL;
  progress_t **p = dp__alloc_array(n ? n : 1, sizeof *p);
  uint64_t *target = dp__alloc_array(n ? n : 1, sizeof *target);
  if (!p || !target) {
    pthread_mutex_unlock(&im->mu);
    dp__free(p, p ? (n ? n : 1) * sizeof *p : 0);
    dp__free(target, target ? (n ? n : 1) * sizeof *target : 0);
    return dp__err(err, DP_ENOMEM, "out of memory synchronizing a device");
  }
  size_t i = 0;
  for (slink_t *l = im->streams[dev]; l; l = l->next) {
    if (!l->s) continue;
    p[i] = progress_retain(l->s->prog);
    target[i] = enqueued_now(l->s);
    i++;
  }
  int self = waits_for_itself_locked_n(im, p, target, n, "dp_device_synchronize", err);
  pthread_mutex_unlock(&im->mu);
  for (i = 0; i < n && self; i++) progress_release(p[i]);
  for (i = 0; i < n && !self; i++) {
    progress_wait(p[i], target[i]);
    progress_release(p[i]);
  }
  dp__free(p, (n ? n : 1) * sizeof *p);
  dp__free(target, (n ? n : 1) * sizeof *target);
  if (self < 0) return self;
  if (self == 1)
    return dp__err(err, DP_EMISUSE,
                   "dp_device_synchronize: called from a host function on a stream of host:%d, which would wait for itself", dev);
  if (self)
    return dp__err(err, DP_EMISUSE,
                   "dp_device_synchronize: called from a host function, on host:%d, a stream of which waits (through event "
                   "waits) for work queued on the function's own stream after it: it would wait for itself",
                   dev);
  return 0;
}

/* ---- events ---- */

static int h_event_create(dp_backend_t *b, int dev, void **h, dp_error_t *err) {
  (void)dev; /* the event's device is dp_event's */
  hevent_t *e = dp__alloc(sizeof *e);
  if (!e) return dp__err(err, DP_ENOMEM, "out of memory creating a host event");
  pthread_mutex_init(&e->mu, NULL);
  e->im = b->impl;
  e->prog = NULL;
  e->target = 0;
  *h = e;
  return 0;
}

static void h_event_reset(dp_backend_t *b, void *h) {
  (void)b;
  hevent_t *e = h;
  pthread_mutex_lock(&e->mu);
  progress_t *old = e->prog;
  e->prog = NULL;
  pthread_mutex_unlock(&e->mu);
  progress_release(old);
}

static int h_event_reset_op(dp_backend_t *b, int dev, void **h) {
  (void)dev;
  h_event_reset(b, *h);
  return 0;
}

static void h_event_destroy(dp_backend_t *b, void *h) {
  hevent_t *e = h;
  h_event_reset(b, h);
  pthread_mutex_destroy(&e->mu);
  dp__free(e, sizeof *e);
}

static int h_event_record(dp_backend_t *b, void *eh, void *sh, dp_error_t *err) {
  (void)b;
  (void)err;
  hevent_t *e = eh;
  hstream_t *s = sh;
  uint64_t target = enqueued_now(s);
  progress_t *p = progress_retain(s->prog);
  pthread_mutex_lock(&e->mu);
  progress_t *old = e->prog;
  e->prog = p;
  e->target = target;
  pthread_mutex_unlock(&e->mu);
  progress_release(old);
  return 0;
}

static int h_event_query(dp_backend_t *b, void *eh, dp_error_t *err) {
  (void)b;
  (void)err;
  hevent_t *e = eh;
  pthread_mutex_lock(&e->mu);
  int done = !e->prog || dp__load_acquire(&e->prog->completed) >= e->target;
  pthread_mutex_unlock(&e->mu);
  return done;
}

/* e's capture, retained (NULL: never recorded). Not under e's lock while
 * the streams are looked at: a record takes a stream's lock, then e's. */
static progress_t *event_capture(hevent_t *e, uint64_t *target) {
  pthread_mutex_lock(&e->mu);
  progress_t *p = e->prog ? progress_retain(e->prog) : NULL;
  *target = e->target;
  pthread_mutex_unlock(&e->mu);
  return p;
}

int dp__host_event_waits_for_itself(void *eh, const char *fn, dp_error_t *err) {
  hevent_t *e = eh;
  if (!dp__host_fn_stream) return 0;
  uint64_t target;
  progress_t *p = event_capture(e, &target);
  int self = p ? waits_for_itself(e->im, p, target, fn, err) : 0;
  progress_release(p);
  return self;
}

static int h_event_sync(dp_backend_t *b, void *eh, dp_error_t *err) {
  hevent_t *e = eh;
  uint64_t target;
  progress_t *p = event_capture(e, &target);
  if (!p) return 0;
  int self = waits_for_itself(b->impl, p, target, "dp_event_synchronize", err);
  if (self) {
    progress_release(p);
    if (self < 0) return self;
    if (self == 1)
      return dp__err(err, DP_EMISUSE,
                     "dp_event_synchronize: called from a host function on the event's stream, recorded after the function "
                     "was queued: it would wait for itself");
    return dp__err(err, DP_EMISUSE,
                   "dp_event_synchronize: called from a host function, on an event of a stream that waits (through event "
                   "waits) for work queued on the function's own stream after it: it would wait for itself");
  }
  progress_wait(p, target);
  progress_release(p);
  return 0;
}

/* ---- memory: tagged by device, found again by any interior pointer ---- */

static alloc_rec_t *rec_of(dp__treap_node_t *n) { return n ? DP__TREAP_ENTRY(n, alloc_rec_t, tn) : NULL; }

/* The record with the greatest base <= p, or NULL. */
static alloc_rec_t *rec_find(host_impl_t *im, uintptr_t p) { return rec_of(dp__treap_floor(&im->recs, p, 0)); }

static int h_malloc(dp_backend_t *b, int dev, size_t n, void **out, dp_error_t *err) {
  host_impl_t *im = b->impl;
  if (n == 0) n = 1;
  if (n > SIZE_MAX - HOST_ALIGN)
    return dp__err(err, DP_ENOMEM, "dp_device_alloc: %zu bytes on host:%d cannot be allocated with its %d-byte alignment", n,
                   dev, HOST_ALIGN);
  pthread_mutex_lock(&im->mu);
  /* not used + n > limit: a size near SIZE_MAX wraps the sum below the cap */
  if (im->limit[dev] && (im->used[dev] > im->limit[dev] || n > im->limit[dev] - im->used[dev])) {
    size_t used = im->used[dev], limit = im->limit[dev];
    pthread_mutex_unlock(&im->mu);
    return dp__err(err, DP_ENOMEM, "out of memory: %zu bytes asked, %zu of %zu in use", n, used, limit);
  }
  alloc_rec_t *r = dp__alloc(sizeof *r);
  if (!r) {
    pthread_mutex_unlock(&im->mu);
    return dp__err(err, DP_ENOMEM, "out of memory tracking host allocations");
  }
  void *raw = dp__alloc(n + HOST_ALIGN);
  if (!raw) {
    pthread_mutex_unlock(&im->mu);
    dp__free(r, sizeof *r);
    return dp__err(err, DP_ENOMEM, "out of memory allocating %zu bytes", n);
  }
  uintptr_t base = ((uintptr_t)raw + HOST_ALIGN - 1) & ~(uintptr_t)(HOST_ALIGN - 1);
  *r = (alloc_rec_t){.base = base, .size = n, .raw = raw, .raw_size = n + HOST_ALIGN, .dev = dev};
  dp__treap_insert(&im->recs, &r->tn, r->base, 0);
  im->used[dev] += n;
  pthread_mutex_unlock(&im->mu);
  *out = (void *)base;
  return 0;
}

/* Waits until the work queued on dev's streams before the call has
 * completed, as cudaFree does before it frees: memory given back under
 * queued work (a copy into it, a host function reading it) was used after
 * it was freed, where the same code on a GPU is correct. The drain walks
 * the device's list once, from a cursor put at its head: streams made
 * after the call go before the cursor and are passed over (all their work
 * came after it); each older one is waited on once, for what it holds when
 * it is looked at, so that streams other threads keep busy cannot hold the
 * free forever. While it waits, the cursor keeps its place after the
 * stream waited on: looking again for "the oldest stream not waited on
 * yet" after each wait stepped over the whole list each time, n * n steps
 * under the lock for n busy streams. It allocates nothing: a free must not
 * fail for want of memory. A host function does not wait (it would wait
 * for itself, or for work behind it): what it frees, it frees at once. */
_Atomic uint64_t dp__host_drain_steps;

static void drain_device(host_impl_t *im, int dev) {
  if (dp__host_fn_stream) return;
  slink_t cur = {NULL, NULL, NULL};
  uint64_t steps = 0;
  pthread_mutex_lock(&im->mu);
  link_push(&im->streams[dev], &cur);
  for (;;) {
    slink_t *l;
    uint64_t target = 0;
    for (l = cur.next; l; l = l->next) { /* the next stream with work pending */
      steps++;
      if (!l->s) continue; /* another drain's cursor */
      target = enqueued_now(l->s);
      if (dp__load_acquire(&l->s->prog->completed) < target) break;
    }
    if (!l) break;
    link_unlink(&im->streams[dev], &cur);
    link_insert_after(l, &cur);
    progress_t *p = progress_retain(l->s->prog);
    pthread_mutex_unlock(&im->mu);
    progress_wait(p, target);
    progress_release(p);
    pthread_mutex_lock(&im->mu);
  }
  link_unlink(&im->streams[dev], &cur);
  pthread_mutex_unlock(&im->mu);
  dp__fetch_add_relaxed(&dp__host_drain_steps, steps);
}

/* The record of allocation p of dev, or NULL; under im->mu. */
static alloc_rec_t *rec_of_alloc(host_impl_t *im, int dev, const void *p) {
  alloc_rec_t *r = rec_find(im, (uintptr_t)p);
  return r && r->base == (uintptr_t)p && r->dev == dev ? r : NULL;
}

static int not_an_alloc(dp_error_t *err, const void *p, int dev) {
  return dp__err(err, DP_EINVAL, "dp_device_dealloc: %p is not an allocation of host:%d", p, dev);
}

/* A pointer that is not an allocation of dev (a double free, a foreign
 * pointer) is refused before the drain, which would wait for every stream
 * of the device to tell the caller so; it is looked up again after, since
 * another thread may have freed it meanwhile. */
static int h_free(dp_backend_t *b, int dev, void *p, dp_error_t *err) {
  host_impl_t *im = b->impl;
  pthread_mutex_lock(&im->mu);
  int known = rec_of_alloc(im, dev, p) != NULL;
  pthread_mutex_unlock(&im->mu);
  if (!known) return not_an_alloc(err, p, dev);
  drain_device(im, dev);
  pthread_mutex_lock(&im->mu);
  alloc_rec_t *r = rec_of_alloc(im, dev, p);
  if (!r) {
    pthread_mutex_unlock(&im->mu);
    return not_an_alloc(err, p, dev);
  }
  dp__treap_remove(&im->recs, &r->tn);
  im->used[r->dev] -= r->size;
  pthread_mutex_unlock(&im->mu);
  dp__free(r->raw, r->raw_size);
  dp__free(r, sizeof *r);
  return 0;
}

static int h_pointer_device(dp_backend_t *b, const void *p, int *dev) {
  host_impl_t *im = b->impl;
  int rc = DP_ENOTFOUND;
  pthread_mutex_lock(&im->mu);
  const alloc_rec_t *r = rec_find(im, (uintptr_t)p);
  if (r && (uintptr_t)p - r->base < r->size) {
    *dev = r->dev;
    rc = 0;
  }
  pthread_mutex_unlock(&im->mu);
  return rc;
}

static int h_memcpy_async(dp_backend_t *b, void *sh, void *dst, const void *src, size_t n, dp_error_t *err) {
  (void)b;
  task_t t = {T_COPY, NULL, NULL, NULL, 0, dst, src, n};
  return enqueue(sh, &t, err);
}

/* The host backend's "devices" are host memory already: any memory is as
 * fast to copy as page-locked memory would be. */
static int h_pinned_alloc(dp_backend_t *b, size_t n, void **out, dp_error_t *err) {
  (void)b;
  if (!(*out = dp__alloc(n))) return dp__err(err, DP_ENOMEM, "out of memory allocating %zu bytes of staging memory", n);
  return 0;
}

static void h_pinned_free(dp_backend_t *b, void *p, size_t n) {
  (void)b;
  dp__free(p, n);
}

static int h_pinned_register(dp_backend_t *b, void *p, size_t n, int readonly, dp_error_t *err) {
  (void)b, (void)p, (void)n, (void)readonly, (void)err;
  return 0;
}

static void h_pinned_unregister(dp_backend_t *b, void *p) { (void)b, (void)p; }

int dp_host_launch(dp_stream_t *s, dp_host_fn fn, void *arg, dp_error_t *err) {
  if (!s || !fn) return dp__err(err, DP_EINVAL, "dp_host_launch: NULL %s", !s ? "stream" : "fn");
  if (s->b->type != DP_DEVICE_HOST) return dp__err(err, DP_EINVAL, "dp_host_launch needs a host stream, got %s", s->b->name);
  task_t t = {T_FN, fn, arg, NULL, 0, NULL, NULL, 0};
  return dp__named_dev("dp_host_launch", s->dev, enqueue(s->h, &t, err), err);
}

int dp_host_set_memory_limit(dp_device_t dev, size_t nbytes, dp_error_t *err) {
  if (dev.type != DP_DEVICE_HOST || dev.index >= HOST_MAX_DEVICES) {
    char buf[16];
    return dp__err(err, DP_EINVAL, "dp_host_set_memory_limit: %s is not a host device (host:0..host:%d)",
                   dp_device_format(dev, buf, sizeof buf), HOST_MAX_DEVICES - 1);
  }
  pthread_mutex_lock(&limit_mu);
  pending_limit[dev.index] = nbytes;
  if (live_impl) {
    pthread_mutex_lock(&live_impl->mu);
    live_impl->limit[dev.index] = nbytes;
    pthread_mutex_unlock(&live_impl->mu);
  }
  pthread_mutex_unlock(&limit_mu);
  return 0;
}

/* ---- lifecycle ---- */

static int h_idle(dp_backend_t *b) {
  host_impl_t *im = b->impl;
  int idle = 1;
  pthread_mutex_lock(&im->mu);
  for (int d = 0; d < b->ndev && idle; d++)
    for (slink_t *l = im->streams[d]; l && idle; l = l->next)
      if (l->s) idle = dp__load_acquire(&l->s->prog->completed) >= enqueued_now(l->s);
  pthread_mutex_unlock(&im->mu);
  return idle;
}

static int h_init(dp_backend_t *b, dp_error_t *err) {
  int n = 2;
  const char *env = getenv("DEVPICKLE_HOST_DEVICES");
  if (env && *env) {
    char *end;
    long v = strtol(env, &end, 10);
    char shown[DP__SHOWN_MAX];
    /* digits only, as dp_device_parse takes an index: strtol would skip
     * leading blanks and a sign (" 3" but not "3 ") */
    if (*env < '0' || *env > '9' || *end || v < 1 || v > HOST_MAX_DEVICES)
      return dp__err(err, DP_EINVAL, "DEVPICKLE_HOST_DEVICES='%s': expected 1..%d", dp__shown(env, shown),
                     HOST_MAX_DEVICES);
    n = (int)v;
  }
  host_impl_t *im = dp__alloc(sizeof *im);
  if (!im) return dp__err(err, DP_ENOMEM, "out of memory starting the host backend");
  memset(im, 0, sizeof *im);
  pthread_mutex_init(&im->mu, NULL);
  pthread_mutex_lock(&limit_mu);
  memcpy(im->limit, pending_limit, sizeof im->limit);
  live_impl = im;
  pthread_mutex_unlock(&limit_mu);
  b->impl = im;
  b->ndev = n;
  return 0;
}

static void h_shutdown(dp_backend_t *b) {
  host_impl_t *im = b->impl;
  /* Streams the caller still holds are stopped too (their handles, device.c's, stay the caller's: device.h). */
  for (int d = 0; d < HOST_MAX_DEVICES; d++)
    while (im->streams[d]) h_stream_destroy(b, im->streams[d]->s); /* no drain runs now: no cursor */
  for (alloc_rec_t *r; (r = rec_of(dp__treap_take(&im->recs))) != NULL;) {
    dp__free(r->raw, r->raw_size);
    dp__free(r, sizeof *r);
  }
  pthread_mutex_lock(&limit_mu);
  if (live_impl == im) live_impl = NULL;  /* not one started since (device.c's shutdown) */
  pthread_mutex_unlock(&limit_mu);
  pthread_mutex_destroy(&im->mu);
  dp__free(im, sizeof *im);
}

const dp__backend_ops_t dp__host_ops = {
    h_init,        h_shutdown,     h_stream_create, h_stream_destroy, h_stream_wrap,   h_stream_native,
    h_stream_sync, h_stream_query, h_stream_wait,   h_event_create,   h_event_destroy,
    h_event_reset_op, h_event_record, h_event_query,   h_event_sync,     h_device_sync,
    h_malloc,      h_free,         h_pointer_device, h_memcpy_async, h_pinned_alloc, h_pinned_free,
    h_pinned_register, h_pinned_unregister, h_idle,
};
