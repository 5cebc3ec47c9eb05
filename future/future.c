/* future/future.c — the stream-aware future.
 *
 * Completing: walk the value into this thread's scratch pointer set (no lock
 * held; a raw set, which lists an allocation met apart twice twice:
 * dp_future_ptr's list is made from it when first asked, distinct_ptrs),
 * copy the allocations into one block owned by the future, record one
 * event per used device on that device's current stream and record the
 * allocations on it, then take the lock only to publish. Everything published
 * is immutable afterwards, so waiters read it without the lock.
 *
 * Callbacks never recurse. Running a callback completes its child, whose own
 * callbacks would run next, and so on down a chain; releasing a pending
 * future cancels its children, and so on. Each thread has a trampoline: the
 * outermost completion (or release) on the thread runs its own callbacks,
 * and any completion or release nested under it only queues its work there
 * (the callbacks, each with a reference to its parent; the futures to free),
 * which the outermost frame drains. Callbacks run depth first, the order
 * recursion would give (and torch gives): what a callback queues runs once it
 * returns, before the callbacks that were queued before it ran. A chain of
 * any length thus completes and is released in constant stack, in chain
 * order; the callbacks of one future stay in registration order. A wait
 * nested in a callback runs the queue first, so that a callback may wait on
 * what it completed.
 *
 * A pending future keeps links to what its completion waits for (a then()
 * child's parent, a collect_all's pending inputs), without references, so
 * that a wait from a callback can follow them up to the running callback's
 * child and refuse to wait for itself (waits_on_running); so can a wait
 * from a reduce() of a completion's walk, up to the future it completes.
 * A link is cut under its holder's lock before the future it names can go.
 * A wait in a callback runs the thread's queue, and callbacks it runs may
 * wait in turn: those waits nest, DP_FUTURE_WAIT_NESTING_MAX deep at most.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "devpickle/future.h"
#include "../device/internal.h"
#include "../pickler/ptrs.h"
#include "internal.h"

enum { PENDING = 0, DONE = 1, FAILED = 2 };

/* A device the value uses (CPU aside), and its event. */
typedef struct fdev {
  dp_device_t dev;
  dp_event_t *ev;
  size_t first, count;   /* this device's bases in ptrs.by_dev */
} fdev_t;

/* What a completion publishes: the scan's pointer set frozen (one block,
 * pickler/ptrs.h), whose extra room holds the devices and their events. */
typedef struct record {
  dp__ptrs_t ptrs;
  fdev_t *devs;
  size_t ndevs;
} record_t;

typedef struct cbent {
  struct cbent *next;
  dp_future_t *parent;  /* a reference, while queued on a trampoline */
  dp_then_cb cb;
  dp_then_ptrs_cb ptrs_cb;  /* dp_future_then_with_ptrs: instead of cb */
  void *ud;
  dp_future_t *child;
  /* collect_all: input `index` completed (parent NULL: it was released
   * pending) */
  void (*internal)(void *ctx, dp_future_t *parent, size_t index);
  void (*internal_drop)(void *ctx);
  void *ctx;
  size_t index;
} cbent_t;

struct dp_future {
  _Atomic uint32_t refs;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  _Atomic int state;   /* written under mu, with release; read without it (acquire) */
  dp_value_t value;
  int error_code;      /* FAILED: the code */
  dp_error_t *error;   /* and its detail; NULL when recording it ran out of memory */
  dp_backend_t *b;
  dp_device_t *allowed;
  size_t nallowed;
  dp_cache_hooks_t hooks;
  int use_hooks;
  int consumers_only;  /* no record on the completing stream */
  record_t rec;
  /* rec's allocations each once, made at the first ask (dp_future_ptr)
   * when rec is raw: written once under mu, with release */
  _Atomic(dp__ptrs_t *) distinct;
  cbent_t *cbs;
  dp_future_t *free_next;  /* on a trampoline's free queue; NULL until one is queued behind it (a future is queued once) */
  /* While pending, the futures whose completion its own waits for: a
   * then() child's parent (dep), a collect_all's inputs (its collect's
   * array), so that a wait from a callback can tell that it would wait for
   * itself (waits_on_running). No references: a collect_all input's slot
   * is cleared under mu when the input is released pending, before its
   * memory goes (a completed one is held by the collect until f
   * completes; a then() parent's release completes f first), and deps goes
   * when f completes. ndeps is set before f is shared and never changes. */
  dp_future_t **deps;
  size_t ndeps;
  dp_future_t *dep;
  const void *loop;  /* completed only by this loop's threads (dp__future_set_loop); NULL: anyone */
};

/* ---- the trampoline: one per thread ---- */

/* Callbacks to run, each holding its parent: one level per callback running
 * on the thread (what it queues), the outermost frame's at the bottom. */
typedef struct level {
  cbent_t *head, *tail;
  struct level *outer;
  const dp_future_t *child;  /* the running then() callback's child (NULL: none) */
} level_t;

typedef struct tramp {
  int depth;      /* 1 while the outermost frame runs */
  int waits;      /* waits in callbacks running queued callbacks, nested (DP_FUTURE_WAIT_NESTING_MAX) */
  level_t base;   /* the outermost frame's queue */
  level_t *top;   /* the running callback's queue; NULL: base */
  dp_future_t *free_head, *free_tail;  /* futures whose last reference went */
} tramp_t;

static _Thread_local tramp_t tramp;

/* The futures whose completion's walk (dp_future_mark_completed) runs on
 * this thread, innermost first: a reduce() of the value may wait, and
 * only the walk's return completes them (the way a then() callback's
 * return completes its child). */
typedef struct walking {
  const dp_future_t *f;
  struct walking *outer;
} walking_t;
static _Thread_local walking_t *walking;

/* The loops of layers above that this thread runs, innermost first
 * (internal.h): a wait here on a future only they complete never ends. */
static _Thread_local dp__future_loop_frame_t *loops;

static void future_free(dp_future_t *f);
static void run_entry(dp_future_t *f, cbent_t *e);

static level_t *tramp_top(tramp_t *t) { return t->top ? t->top : &t->base; }

int dp__future_running(void) { return tramp.depth || walking; }

/* Frees one future whose last reference went; 0 when none is queued. */
static int tramp_free_one(tramp_t *t) {
  dp_future_t *f = t->free_head;
  if (!f) return 0;
  if (!(t->free_head = f->free_next)) t->free_tail = NULL;
  future_free(f);
  return 1;
}

/* Runs one queued item; 0 when the queue is empty. Frees go first: they
 * keep memory low, and a free only queues (never runs) callbacks. A
 * callback runs with a level of its own, whose entries then go in front of
 * the level it was called from: depth first, without recursion. */
static int tramp_step(tramp_t *t) {
  if (tramp_free_one(t)) return 1;
  level_t *from = tramp_top(t), *lv = from;
  while (lv && !lv->head) lv = lv->outer; /* a wait in a callback also runs what outer levels queued */
  if (!lv) return 0;
  cbent_t *e = lv->head;
  if (!(lv->head = e->next)) lv->tail = NULL;
  level_t mine = {NULL, NULL, from, e->child};
  t->top = &mine;
  dp_future_t *p = e->parent;
  run_entry(p, e);
  dp_future_release(p);
  t->top = from == &t->base ? NULL : from;
  if (mine.head) {
    mine.tail->next = from->head;
    from->head = mine.head;
    if (!from->tail) from->tail = mine.tail;
  }
  return 1;
}

static void tramp_drain(tramp_t *t) {
  while (tramp_step(t)) {
  }
}

/* ---- the scratch pointer set: one per thread, reused ---- */

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static _Thread_local int scratch_busy;

static void scratch_destroy(void *p) { dp_ptrset_free(p); }

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_destroy); }

void dp__future_shutdown(void) {
  pthread_once(&scratch_once, scratch_init);  /* scratch_key is valid only after it */
  dp_ptrset_t *s = pthread_getspecific(scratch_key);
  if (s && !scratch_busy) {
    pthread_setspecific(scratch_key, NULL);
    dp_ptrset_free(s);
  }
  dp__ptrs_recycle_drain();
}

/* The thread's set, or a fresh one when it is in use further up the stack
 * (a reduce() that completes a future); *owned tells which. raw: for a
 * completion's walk (ptrs.h: the record lists an allocation met twice
 * twice, and dp_future_ptr lists them once). */
static dp_ptrset_t *scratch_get(int *owned, int raw, dp_error_t *err) {
  pthread_once(&scratch_once, scratch_init);
  dp_ptrset_t *s = scratch_busy ? NULL : pthread_getspecific(scratch_key);
  *owned = 0;
  if (!s) {
    if (dp_ptrset_new(&s, err) != 0) return NULL;
    /* kept for this thread unless the thread's own is busy up the stack */
    *owned = scratch_busy || pthread_setspecific(scratch_key, s) != 0;
  }
  if (!*owned) scratch_busy = 1;
  dp__ptrset_set_raw(s, raw); /* emptied */
  return s;
}

static void scratch_put(dp_ptrset_t *s, int owned) {
  if (owned) dp_ptrset_free(s);
  else scratch_busy = 0;
}

/* ---- creation and lifetime ---- */

static int init_opts(dp_future_t *f, const dp_future_opts_t *o, dp_error_t *err) {
  int rc;
  if (o && o->backend) f->b = o->backend;
  else if ((rc = dp_backend_default(&f->b, err)) != 0) return rc;
  if (o && o->ndevices && !o->devices)
    return dp__err(err, DP_EINVAL, "dp_future_new: devices is NULL but ndevices is %zu", o->ndevices);
  if (o && o->ndevices) {
    f->allowed = dp__alloc_array(o->ndevices, sizeof(dp_device_t));
    if (!f->allowed) return dp__err(err, DP_ENOMEM, "dp_future_new: out of memory creating a future");
    /* set before the checks: a refused device frees the array with its size */
    f->nallowed = o->ndevices;
    for (size_t i = 0; i < o->ndevices; i++) {
      /* cpu is always allowed; any other device must be the backend's */
      if (o->devices[i].type == DP_DEVICE_CPU && o->devices[i].index != 0) /* no storage can be there */
        return dp__err(err, DP_EINVAL, "dp_future_new: device cpu:%u cannot exist (cpu has index 0 only)",
                       (unsigned)o->devices[i].index);
      if (o->devices[i].type != DP_DEVICE_CPU && (rc = dp__check_device("dp_future_new", f->b, o->devices[i], err)) != 0) return rc;
      f->allowed[i] = o->devices[i];
    }
  }
  if (o && o->no_hooks) return 0;
  f->consumers_only = o && o->consumers_only;
  if (o && o->hooks) {
    if (!o->hooks->record_stream && !o->hooks->record_streams)
      return dp__err(err, DP_EINVAL, "dp_future_new: hooks with neither record_stream nor record_streams");
    f->hooks = *o->hooks;
  } else {
    dp_cache_t *c;
    if ((rc = dp_cache_default(f->b, &c, err)) != 0) return rc;
    f->hooks = dp_cache_hooks(c);
  }
  f->use_hooks = 1;
  return 0;
}

/* Timed waits measure on the monotonic clock: a step of the wall clock
 * neither stretches nor cuts them. */
static pthread_condattr_t cv_attr;
static pthread_once_t cv_attr_once = PTHREAD_ONCE_INIT;
static void cv_attr_init(void) {
  pthread_condattr_init(&cv_attr);
  pthread_condattr_setclock(&cv_attr, CLOCK_MONOTONIC);
}

int dp_future_new(const dp_future_opts_t *opts, dp_future_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_future_new: NULL out");
  dp_future_t *f = dp__alloc(sizeof *f);
  if (!f) return dp__err(err, DP_ENOMEM, "dp_future_new: out of memory creating a future");
  memset(f, 0, sizeof *f);
  dp__atomic_init(&f->refs, 1);
  pthread_mutex_init(&f->mu, NULL);
  pthread_once(&cv_attr_once, cv_attr_init);
  pthread_cond_init(&f->cv, &cv_attr);
  f->value = dp_none();
  int rc = init_opts(f, opts, err);
  if (rc) {
    future_free(f);
    return rc;
  }
  *out = f;
  return 0;
}

/* A child shares its parent's backend, devices and hooks. */
static int future_like(const dp_future_t *p, dp_future_t **out, dp_error_t *err) {
  dp_future_opts_t o = {p->b, p->allowed, p->nallowed, p->use_hooks ? &p->hooks : NULL, !p->use_hooks,
                       p->consumers_only};
  return dp_future_new(&o, out, err);
}

dp_future_t *dp_future_retain(dp_future_t *f) {
  if (f) dp__ref_inc(&f->refs, "future");
  return f;
}

void dp__future_set_refs(dp_future_t *f, uint32_t refs) { dp__store_relaxed(&f->refs, refs); }

/* A reference to f unless its last one went already (its memory is then
 * still there only while something holds back its free: see deps). */
static int try_retain(dp_future_t *f) {
  uint32_t n = dp__load_relaxed(&f->refs);
  while (n) {
    if (DP_UNLIKELY(n == UINT32_MAX)) dp__ref_overflow("future");
    if (dp__cas_acq_rel(&f->refs, &n, n + 1)) return 1;
  }
  return 0;
}

static void record_free(record_t *r) {
  for (size_t i = 0; i < r->ndevs; i++) dp_event_free(r->devs[i].ev);
  dp__ptrs_free(&r->ptrs);
  memset(r, 0, sizeof *r);
}

static void cbent_free(cbent_t *e) {
  dp_future_release(e->child); /* NULL for collect_all's entries: does nothing */
  if (e->internal_drop) e->internal_drop(e->ctx);
  dp__free(e, sizeof *e);
}

static cbent_t *reverse(cbent_t *list) {
  cbent_t *rev = NULL;
  while (list) {
    cbent_t *n = list->next;
    list->next = rev;
    rev = list;
    list = n;
  }
  return rev;
}

/* The last reference to a pending future went: its callbacks never run, and
 * whoever waits on them is told (then() children fail, which goes down their
 * chains as any failure does; collect_all aggregates fail naming the input).
 * Runs on a trampoline, so the children's completions only queue. */
static void cancel_callbacks(cbent_t *list) {
  dp_error_t canceled;
  dp_error_clear(&canceled);
  dp__err(&canceled, DP_ECANCELED, "the parent future was released before it completed");
  for (cbent_t *e = reverse(list), *n; e; e = n) {
    n = e->next;
    if (e->internal) e->internal(e->ctx, NULL, e->index);
    else dp_future_set_error(e->child, &canceled, NULL);
    cbent_free(e);
  }
}

static void future_free(dp_future_t *f) {
  if (f->cbs) cancel_callbacks(f->cbs);
  dp_value_release(f->value);
  dp__free(f->error, f->error ? sizeof *f->error : 0);
  record_free(&f->rec);
  dp__ptrs_t *d = dp__load_relaxed(&f->distinct);
  if (d) {
    dp__ptrs_free(d);
    dp__free(d, sizeof *d);
  }
  dp__free(f->allowed, f->nallowed * sizeof(dp_device_t));
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  dp__free(f, sizeof *f);
}

void dp_future_release(dp_future_t *f) {
  if (!f || !dp__ref_dec(&f->refs)) return;
  tramp_t *t = &tramp;
  if (t->depth) {  /* nested: the outermost frame frees it */
    if (t->free_tail) t->free_tail->free_next = f;
    else t->free_head = f;
    t->free_tail = f;
    return;
  }
  t->depth = 1;
  future_free(f);
  tramp_drain(t);
  t->depth = 0;
}

/* ---- completion ---- */

int dp__future_accepts(const dp_future_t *f, dp_device_t d) {
  if (d.type == DP_DEVICE_CPU) return 1;
  if (d.type != dp_backend_type(f->b) || d.index >= dp_backend_device_count(f->b)) return 0;
  if (!f->nallowed) return 1;
  for (size_t i = 0; i < f->nallowed; i++)
    if (dp_device_equal(f->allowed[i], d)) return 1;
  return 0;
}

/* "[a, b, c]" in buf (cap bytes, at least 48): the first n of total
 * devices from d (total 0: every device of backend b) while they fit, the
 * rest counted: "[cuda:0, cuda:1, and 62 more]". */
static void put_devices(char *buf, size_t cap, const dp_device_t *d, size_t n, size_t total, const dp_backend_t *b) {
  enum { SUFFIX = 34 }; /* ", and N more]", N of up to 20 digits */
  char one[16];
  size_t count = total ? total : (size_t)dp_backend_device_count(b), pos = 1;
  buf[0] = '[';
  for (size_t i = 0; i < count; i++) {
    size_t len = cap; /* past the n devices given: only counted */
    if (!total || i < n)
      len = strlen(dp_device_format(total ? d[i] : dp_backend_device(b, (int)i), one, sizeof one)) + (i ? 2 : 0);
    if (pos + len + (i + 1 < count ? SUFFIX : 1) >= cap) { /* room for this one and what may follow */
      snprintf(buf + pos, cap - pos, "%sand %zu more]", i ? ", " : "", count - i);
      return;
    }
    pos += (size_t)snprintf(buf + pos, cap - pos, "%s%s", i ? ", " : "", one);
  }
  snprintf(buf + pos, cap - pos, "]");
}

/* The path of set's first allocation on device d, as " (first at PATH)"
 * in out; 0 when it has none (a scan without paths, or nothing there). */
static int set_path_on(const dp_ptrset_t *set, dp_device_t d, char *out, size_t cap) {
  for (size_t j = 0; j < dp_ptrset_ndevices(set); j++) {
    if (!dp_device_equal(dp_ptrset_device(set, j), d)) continue;
    dp_ptr_info_t pi;
    if (dp_ptrset_get(set, dp_ptrset_first_on(set, j), &pi, NULL) || !pi.path) return 0;
    snprintf(out, cap, " (first at %s)", pi.path);
    return 1;
  }
  return 0;
}

/* Where the value first holds memory on device d, as " (first at PATH)" in
 * out: from the producer's set when it was scanned with paths (given:
 * dp_future_mark_completed_with_ptrs), else by walking the value again
 * with paths — the completion's own walk keeps none (they cost on every
 * completion), and a refusal is rare; a custom's reduce runs once more, as
 * in any walk. Nothing when that walk fails or meets no memory there (a
 * set the producer filled itself may hold what the value does not). */
static void first_path_on(dp_value_t value, const dp_ptrset_t *given, dp_device_t d, char *out, size_t cap) {
  out[0] = 0;
  if (given && set_path_on(given, d, out, cap)) return;
  dp_ptrset_t *set;
  if (dp_ptrset_new(&set, NULL)) return;
  dp_scan_opts_t o = {0};
  o.flags = DP_SCAN_PATHS;
  if (dp_scan(value, &o, set, NULL) == 0) set_path_on(set, d, out, cap);
  dp_ptrset_free(set);
}

/* The value uses device d, which the future does not allow: says so, and
 * where the value holds memory there. */
static int refuse_device(const dp_future_t *f, const dp__ptrs_t *p, dp_value_t value, const dp_ptrset_t *given,
                         dp_device_t d, dp_error_t *err) {
  char used[256], ok[256], one[16], where[DP_PATH_MAX + 16];
  first_path_on(value, given, d, where, sizeof where);
  dp_device_t all[64]; /* more cannot be named in used[] */
  size_t k = 0;
  for (size_t j = 0; j < p->ndevs && k < 64; j++) all[k++] = p->devs[j].device;
  put_devices(used, sizeof used, all, k, p->ndevs, f->b);
  put_devices(ok, sizeof ok, f->allowed, f->nallowed, f->nallowed, f->b);
  /* another backend's memory: say whether that backend could have had it */
  char why[DP_ERROR_MSG_MAX / 2] = "";
  if (d.type != dp_backend_type(f->b)) {
    dp_backend_t *other;
    dp_error_t e;
    if (dp_backend_get(d.type, &other, &e) != 0)
      snprintf(why, sizeof why, "; memory on %s cannot be tracked in this process: %.400s",
               dp_device_format(d, one, sizeof one), e.message);
    else
      snprintf(why, sizeof why, "; the future is of the %s backend: a future of the %s backend tracks it",
               dp_backend_name(f->b), dp_backend_name(other));
  }
  /* none named (ndevices 0): the backend's, which the caller never listed */
  char list[600];
  if (f->nallowed) snprintf(list, sizeof list, "%s (the value's devices: %s)", ok, used);
  else
    snprintf(list, sizeof list, "(none named: every device of its %s backend, %s; the value's devices: %s)",
             dp_backend_name(f->b), ok, used);
  return dp__err(err, DP_EDEVICE, "the value uses %s%s, which is not among the future's devices %s%s",
                 dp_device_format(d, one, sizeof one), where, list, why);
}

/* Freezes the set into a record (take: the set is scratch, whose block the
 * record takes instead of a copy: pickler/ptrs.h), checks devices, records
 * one event per used device on the given streams (the current ones when
 * streams is NULL) and the allocations on those streams. */
static int prepare(dp_future_t *f, dp_value_t value, dp_ptrset_t *set, int take, dp_stream_t *const *streams,
                   record_t *r, dp_error_t *err) {
  r->devs = NULL;
  r->ndevs = 0;
  /* Room for an fdev_t a device (cpu's unused), with the record. */
  int rc = dp__ptrs_freeze(&r->ptrs, set, take, dp_ptrset_ndevices(set) * sizeof(fdev_t), err);
  if (rc) return rc;
  r->devs = r->ptrs.extra;
  for (size_t g = 0; g < r->ptrs.ndevs; g++)
    if (!dp__future_accepts(f, r->ptrs.devs[g].device)) {
      rc = refuse_device(f, &r->ptrs, value, take ? NULL : set, r->ptrs.devs[g].device, err);
      record_free(r);
      return rc;
    }
  for (size_t g = 0; g < r->ptrs.ndevs; g++) {
    const dp__ptrs_dev_t *pd = &r->ptrs.devs[g];
    if (pd->device.type == DP_DEVICE_CPU) continue;
    fdev_t *fd = &r->devs[r->ndevs];
    *fd = (fdev_t){pd->device, NULL, pd->first, pd->count};
    dp_stream_t *s = streams ? streams[r->ndevs] : NULL;
    rc = s ? 0 : dp_current_stream(f->b, pd->device, &s, err);
    if (rc == 0 && (rc = dp_event_new(f->b, pd->device, &fd->ev, err)) == 0 && (rc = dp_event_record(fd->ev, s, err)) != 0)
      dp_event_free(fd->ev);
    if (rc == 0 && f->use_hooks && !f->consumers_only &&
        (rc = dp_cache_hooks_record(&f->hooks, r->ptrs.by_dev + fd->first, fd->count, s, err)) != 0)
      dp_event_free(fd->ev);
    if (rc) {
      record_free(r);
      return rc;
    }
    r->ndevs++;
  }
  return 0;
}

static void dispatch(dp_future_t *f, cbent_t *list);

/* Publishes a record (or an error when rec is NULL) and hands back the
 * callbacks to dispatch (in *cbs, newest first). Steals value. */
static int publish_only(const char *fn, dp_future_t *f, dp_value_t value, record_t *rec, const dp_error_t *error, dp_error_t *err,
                        cbent_t **cbs) {
  *cbs = NULL;
  /* The error is kept out of line (most futures never fail): copied before
   * the lock; without memory for it only its code is kept. */
  dp_error_t *detail = rec ? NULL : dp__alloc(sizeof *detail);
  if (detail) {
    *detail = *error;
    /* the producer's record may lack a NUL (filled by hand): every waiter
     * would read past the message */
    detail->message[sizeof detail->message - 1] = '\0';
  }
  pthread_mutex_lock(&f->mu);
  if (dp__load_relaxed(&f->state) != PENDING) {
    pthread_mutex_unlock(&f->mu);
    dp_value_release(value);
    if (rec) record_free(rec);
    dp__free(detail, detail ? sizeof *detail : 0);
    return dp__err(err, DP_ESTATE, "%s: the future is already complete", fn);
  }
  /* The state is stored last, with release: readers that see it without
   * the lock (dp_future_value, dp_future_is_done) see what it publishes. */
  if (rec) {
    f->value = value;
    f->rec = *rec;
    dp__store_release(&f->state, DONE);
  } else {
    /* codes are DP_E*: 0 and a positive one would read as success, and
       any other as no code of the library's */
    f->error_code = dp__is_code(error->code) ? error->code : error->code ? DP_EINVAL : DP_ESTATE;
    if ((f->error = detail)) {
      detail->code = f->error_code;
      if (!detail->message[0]) { /* waiters get a message, whatever the producer gave */
        char why[48] = "";
        if (!dp__is_code(error->code)) snprintf(why, sizeof why, " (completed with error code %d)", error->code);
        snprintf(detail->message, sizeof detail->message, "the future failed: %s%s", dp_strerror(f->error_code), why);
      }
    }
    dp_value_release(value);
    dp__store_release(&f->state, FAILED);
  }
  *cbs = f->cbs;
  f->cbs = NULL;
  f->deps = NULL; /* it waits for nothing now */
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  return 0;
}

static int publish(const char *fn, dp_future_t *f, dp_value_t value, record_t *rec, const dp_error_t *error, dp_error_t *err) {
  cbent_t *cbs;
  int rc = publish_only(fn, f, value, rec, error, err, &cbs);
  dispatch(f, cbs);
  return rc;
}

/* Completes f from a filled set on the given streams (NULL: current); take:
 * the set is scratch (see prepare). A failure completes f with that
 * failure. The callbacks to dispatch are handed back in *cbs. */
static int complete_with_set(const char *fn, dp_future_t *f, dp_value_t value, dp_ptrset_t *set, int take, dp_stream_t *const *streams,
                             dp_error_t *err, cbent_t **cbs) {
  record_t rec;
  dp_error_t e;
  dp_error_clear(&e);
  int rc = prepare(f, value, set, take, streams, &rec, &e);
  if (rc) {
    if (err) *err = e;
    int prc = publish_only(fn, f, value, NULL, &e, err, cbs);  /* already complete: says so */
    return prc ? prc : rc;
  }
  return publish_only(fn, f, value, &rec, NULL, err, cbs);
}

int dp_future_mark_completed(dp_future_t *f, dp_value_t value, dp_error_t *err) {
  if (!f) {
    dp_value_release(value);
    return dp__err(err, DP_EINVAL, "dp_future_mark_completed: NULL future");
  }
  if (dp_future_is_done(f)) {
    dp_value_release(value);
    return dp__err(err, DP_ESTATE, "dp_future_mark_completed: the future is already complete");
  }
  int owned;
  dp_error_t e;
  dp_error_clear(&e);
  dp_ptrset_t *set = scratch_get(&owned, 1, &e);
  /* A reduce() of the walk, or a record hook after it, that waits on f
     would wait for itself (DP_EMISUSE), and one that calls dp_shutdown
     would free the streams and events the completion holds (refused) */
  walking_t me = {f, walking};
  walking = &me;
  int rc = set ? dp_scan(value, NULL, set, &e) : e.code;
  if (rc) {
    walking = me.outer;
    if (set) scratch_put(set, owned);
    if (err) *err = e;
    /* The walk failed: so does the future, so that nobody waits forever
     * (unless it completed meanwhile: DP_ESTATE, and err says so). */
    int prc = publish("dp_future_mark_completed", f, value, NULL, &e, err);
    return prc ? prc : rc;
  }
  cbent_t *cbs;
  rc = complete_with_set("dp_future_mark_completed", f, value, set, 1, NULL, err, &cbs);
  walking = me.outer;
  scratch_put(set, owned);  /* free for the callbacks */
  dispatch(f, cbs);
  return rc;
}

int dp_future_mark_completed_with_ptrs(dp_future_t *f, dp_value_t value, const dp_ptrset_t *ptrs, dp_error_t *err) {
  if (!f) {
    dp_value_release(value);
    return dp__err(err, DP_EINVAL, "dp_future_mark_completed_with_ptrs: NULL future");
  }
  if (!ptrs) {  /* a failed completion: f fails with it, so no waiter hangs */
    dp_error_t e;
    dp__err(&e, DP_EINVAL, "dp_future_mark_completed_with_ptrs: NULL ptrs");
    if (err) *err = e;
    int prc = publish("dp_future_mark_completed_with_ptrs", f, value, NULL, &e, err); /* already complete: DP_ESTATE, and err says so */
    return prc ? prc : DP_EINVAL;
  }
  cbent_t *cbs;
  walking_t me = {f, walking}; /* a record hook that waits on f, or shuts down (as in dp_future_mark_completed) */
  walking = &me;
  /* the caller's set: copied, never changed (take 0) */
  int rc = complete_with_set("dp_future_mark_completed_with_ptrs", f, value, (dp_ptrset_t *)ptrs, 0, NULL, err, &cbs);
  walking = me.outer;
  dispatch(f, cbs);
  return rc;
}

int dp_future_set_error(dp_future_t *f, const dp_error_t *error, dp_error_t *err) {
  if (!f) return dp__err(err, DP_EINVAL, "dp_future_set_error: NULL future");
  if (!error) { /* a failed completion: f fails with it, so no waiter hangs */
    dp_error_t e;
    dp__err(&e, DP_EINVAL, "dp_future_set_error: NULL error");
    if (err) *err = e;
    int prc = publish("dp_future_set_error", f, dp_none(), NULL, &e, err); /* already complete: DP_ESTATE, and err says so */
    return prc ? prc : DP_EINVAL;
  }
  return publish("dp_future_set_error", f, dp_none(), NULL, error, err);
}

/* ---- waiting ---- */

/* A failed future's error, copied into err; returns its code. */
static int get_error(const dp_future_t *f, dp_error_t *err) {
  if (!err) return f->error_code;
  if (f->error) {
    *err = *f->error;
    return f->error_code;
  }
  return dp__err(err, f->error_code, "%s (its detail was lost: out of memory)", dp_strerror(f->error_code));
}

#ifndef WAIT_SPIN_NS
#define WAIT_SPIN_NS 100000
#endif

/* Where the first callback of f that the running callback queued (f
 * completed, or chained on when complete, inside it) stands in t's top
 * level, or -1: that level only — what outer levels hold (f's own later
 * callbacks, when the running one is f's) runs after the running callback,
 * as always. */
static long queued_by_running(tramp_t *t, const dp_future_t *f) {
  long i = 0;
  for (const cbent_t *e = t->top ? t->top->head : NULL; e; e = e->next, i++)
    if (e->parent == f) return i;
  return -1;
}

/* 1 when f is marked with a loop this thread runs: only that loop
 * completes it, and it cannot run while this thread waits. */
static int completed_by_loop(const dp_future_t *f) {
  if (!f->loop) return 0;
  for (const dp__future_loop_frame_t *fr = loops; fr; fr = fr->outer)
    if (fr->loop == f->loop) return 1;
  return 0;
}

/* 1 when f is the child of a then() callback running on this thread, 2
 * when a walk running here completes it, 3 when a loop running here does:
 * only that callback's (walk's) return, or the loop, completes it, so a
 * wait for it from there would never end. */
static int completed_by_running(const tramp_t *t, const dp_future_t *f) {
  for (const level_t *lv = t->top; lv; lv = lv->outer)
    if (lv->child == f) return 1;
  for (const walking_t *w = walking; w; w = w->outer)
    if (w->f == f) return 2;
  return completed_by_loop(f) ? 3 : 0;
}

/* 1 when a then() callback (its child in a level), a completion's walk or
 * a loop of a layer above runs on this thread. */
static int running_child(const tramp_t *t) {
  for (const level_t *lv = t->top; lv; lv = lv->outer)
    if (lv->child) return 1;
  return walking != NULL || loops != NULL;
}

/* A future reached from the one waited on: a reference, and its place in
 * the set of those seen. */
typedef struct reach {
  dp_future_t *f;
  size_t at;
} reach_t;

#define REACH_INLINE 32

/* 1 when f (pending) completes only after the child of a then() callback
 * running on this thread, which only that callback's return can complete
 * (2: after a future whose completion's walk runs here; 3: after one that
 * only a loop running here completes): a chain of
 * pending futures leads there from f through the links of deps (then()
 * parents, collect_all inputs). 0 when none does; else an error (out of
 * memory), in *e.
 *
 * Each future is visited once: the seen set's first k entries are the
 * running children (then the walks' futures, from kc on), so that one
 * look-up both skips a future met before and finds a running child. One
 * lock is held at a time and nothing is allocated or called under it. The links hold no references, so a future
 * is followed under one taken while its dependant's lock holds back its
 * free (see deps) — unless its last one went already: its release then
 * completes the dependant (cancel), so it is no wait for itself. */
static int waits_on_running(tramp_t *t, dp_future_t *f, dp_error_t *e) {
  int owned, found = 0, rc;
  dp_ptrset_t *seen = scratch_get(&owned, 0, e);
  if (!seen) return e->code;
  const dp_device_t key = {DP_DEVICE_CPU, 0};
  rc = 0;
  for (const level_t *lv = t->top; lv && rc == 0; lv = lv->outer)
    if (lv->child) rc = dp_ptrset_add(seen, key, (void *)lv->child, 1, NULL, e);
  size_t kc = dp_ptrset_count(seen);
  for (const walking_t *w = walking; w && rc == 0; w = w->outer)
    rc = dp_ptrset_add(seen, key, (void *)w->f, 1, NULL, e);
  size_t k = dp_ptrset_count(seen), at, cap = REACH_INLINE, sp = 0;
  reach_t inl[REACH_INLINE], *stack = inl;
  if (rc == 0 && (rc = dp_ptrset_add(seen, key, f, 1, &at, e)) == 0) stack[sp++] = (reach_t){dp_future_retain(f), at};
  while (rc == 0 && sp && !found) {
    reach_t x = stack[--sp];
    size_t from = sp, n = x.f->ndeps;
    if ((rc = dp__grow_inl((void **)&stack, &cap, sp + n, sizeof *stack, inl)) != 0) {
      dp_future_release(x.f);
      dp__err(e, rc, "out of memory following what the future waits for");
      break;
    }
    pthread_mutex_lock(&x.f->mu);
    if (dp__load_relaxed(&x.f->state) == PENDING) {
      if (x.at < k) found = x.at < kc ? 1 : 2;
      else if (completed_by_loop(x.f)) found = 3;
      else
        for (size_t i = 0; i < n; i++)
          if (x.f->deps[i] && try_retain(x.f->deps[i])) stack[sp++].f = x.f->deps[i];
    }
    pthread_mutex_unlock(&x.f->mu);
    dp_future_release(x.f); /* in a callback: a last one only queues the free */
    /* keep those not seen before, and running children (looked at when
       taken: one completed by hand is no wait for itself) */
    size_t keep = from;
    for (size_t i = from; i < sp; i++) {
      size_t before = dp_ptrset_count(seen);
      if (rc == 0) rc = dp_ptrset_add(seen, key, stack[i].f, 1, &at, e);
      if (rc == 0 && (at < k || dp_ptrset_count(seen) > before)) stack[keep++] = (reach_t){stack[i].f, at};
      else dp_future_release(stack[i].f);
    }
    sp = keep;
  }
  while (sp) dp_future_release(stack[--sp].f);
  dp__free_inl(stack, cap, sizeof *stack, inl);
  scratch_put(seen, owned);
  return rc ? rc : found;
}

/* past the states; errors are negative */
#define WAITS_FOR_ITSELF 3
#define WAITS_THROUGH 4
#define WAITS_TOO_DEEP 5
#define WAITS_IN_WALK 6
#define WAITS_THROUGH_WALK 7
#define WAITS_ON_LOOP 8

/* 1 when a callback is queued on t, at any level. */
static int callbacks_queued(const tramp_t *t) {
  for (const level_t *lv = tramp_top((tramp_t *)t); lv; lv = lv->outer)
    if (lv->head) return 1;
  return 0;
}

/* Refused at once, with a limit or without (as a host function that
 * would wait for itself is: device.h), not a hang or a spent limit: a
 * wait on a pending f that only a running then() callback's or walk's
 * return, or a loop running here, completes, or that waits for one. 0: no
 * such wait. */
static int waits_for_itself(tramp_t *t, dp_future_t *f, dp_error_t *e) {
  if (dp__load_acquire(&f->state) != PENDING) return 0;
  int by = completed_by_running(t, f);
  if (by) return by == 1 ? WAITS_FOR_ITSELF : by == 2 ? WAITS_IN_WALK : WAITS_ON_LOOP;
  if (!running_child(t)) return 0;
  int rc = waits_on_running(t, f, e);
  return rc == 1 ? WAITS_THROUGH : rc == 2 ? WAITS_THROUGH_WALK : rc == 3 ? WAITS_ON_LOOP : rc;
}

/* The part of a wait that runs in a callback, before it blocks: 0 to go on
 * waiting, else wait_done's answer. */
static int wait_in_callback(tramp_t *t, dp_future_t *f, dp_error_t *e) {
  /* Each callback run here that waits in turn runs the next one inside
   * itself: past DP_FUTURE_WAIT_NESTING_MAX such waits (thousands of
   * callbacks of one future, each polling a pending future, overflowed the
   * stack) nothing more runs nested, and a wait for a pending future that
   * the queued callbacks might have completed is refused, not a hang. */
  int may_run = t->waits <= DP_FUTURE_WAIT_NESTING_MAX; /* this wait counted */
  /* frees run callbacks of none (they only queue them): they always may,
     and may cancel f */
  while (!may_run && !dp_future_is_done(f) && tramp_free_one(t)) {
  }
  if (may_run) {
    while (!dp_future_is_done(f) && tramp_step(t)) {
    }
    /* the entries up to f's first run before the level is looked at again:
       each is passed over once, however many stand before f's */
    for (long k; (k = queued_by_running(t, f)) >= 0;) {
      int ran = 1;
      for (long i = 0; i <= k && ran; i++) ran = tramp_step(t);
    } /* a step that ran nothing left the level empty: the next look ends the loop */
  }
  int rc = waits_for_itself(t, f, e);
  if (rc) return rc;
  /* frees the releases the links' walk queued (what they cancel may complete f) */
  while (may_run && !dp_future_is_done(f) && tramp_step(t)) {
  }
  if (!may_run && dp__load_acquire(&f->state) == PENDING && callbacks_queued(t)) return WAITS_TOO_DEEP;
  return 0;
}

/* f's state once complete or timed out; WAITS_FOR_ITSELF (f is a running
 * callback's child), WAITS_THROUGH (f waits for one), WAITS_IN_WALK and
 * WAITS_THROUGH_WALK (the same for a completion's walk), WAITS_TOO_DEEP,
 * or an error in *e. */
_Atomic uint64_t dp__future_sleeps;

static int wait_done(dp_future_t *f, int64_t timeout_ns, dp_error_t *e) {
  /* In a callback, f may be waiting on work queued on this very thread:
   * run it first (the queue keeps its order; nothing runs under a lock).
   * So do the callbacks the running callback queued for f itself (it
   * completed f): the wait returns once they ran, as recursion would have
   * run them inside the completion. */
  tramp_t *t = &tramp;
  if (t->depth) {
    t->waits++;
    int rc = wait_in_callback(t, f, e);
    t->waits--;
    if (rc) return rc;
  } else if (walking || loops) { /* a reduce() of a completion's walk, or a loop's own code, outside callbacks */
    int rc = waits_for_itself(t, f, e);
    if (rc) return rc;
  }
  /* A completion often follows soon (a reply, a short kernel): look for it
   * a while before sleeping, which costs a wake-up (a futex and a
   * reschedule) worth more than a short wait. */
  int timed = dp__load_acquire(&f->state) == PENDING && timeout_ns != 0; /* a complete future reads no clock */
  struct timespec t0, t1; /* the deadline counts from here: the spin is part of the wait */
  if (timed) {
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int64_t spin = timeout_ns > 0 && timeout_ns < WAIT_SPIN_NS ? timeout_ns : WAIT_SPIN_NS;
    for (unsigned i = 1; dp__load_acquire(&f->state) == PENDING; i++) {
      if (i % 16) continue;
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((t1.tv_sec - t0.tv_sec) * 1000000000ll + (t1.tv_nsec - t0.tv_nsec) > spin) break;
      sched_yield(); /* the thread that completes it may need this core */
    }
  }
  pthread_mutex_lock(&f->mu);
  if (timeout_ns < 0) {
    while (dp__load_relaxed(&f->state) == PENDING) {
      dp__fetch_add_relaxed(&dp__future_sleeps, 1);
      pthread_cond_wait(&f->cv, &f->mu);
    }
  } else if (timeout_ns > 0 && dp__load_relaxed(&f->state) == PENDING) {
    /* A limit of 0 never sleeps: a sleep whose deadline is already due
     * still waits out the timer's slack (50 µs on Linux), which a caller
     * polling with a limit of 0 would pay at each look. So is one whose
     * limit the spin above spent. */
    struct timespec ts = t0;
    int64_t ns = ts.tv_nsec + timeout_ns % 1000000000;
    ts.tv_sec += (time_t)(timeout_ns / 1000000000 + ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    while (dp__load_relaxed(&f->state) == PENDING) {
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if (t1.tv_sec > ts.tv_sec || (t1.tv_sec == ts.tv_sec && t1.tv_nsec >= ts.tv_nsec)) break;
      dp__fetch_add_relaxed(&dp__future_sleeps, 1);
      if (pthread_cond_timedwait(&f->cv, &f->mu, &ts) == ETIMEDOUT) break;
    }
  }
  int state = dp__load_relaxed(&f->state);
  pthread_mutex_unlock(&f->mu);
  return state;
}

/* Makes stream s wait on the event of device i and records the device's
 * allocations on s. */
static int join_device(dp_future_t *f, size_t i, dp_stream_t *s, dp_error_t *err) {
  fdev_t *d = &f->rec.devs[i];
  int rc = dp_stream_wait_event(s, d->ev, err);
  if (rc == 0 && f->use_hooks) rc = dp_cache_hooks_record(&f->hooks, f->rec.ptrs.by_dev + d->first, d->count, s, err);
  return rc;
}

/* dp_future_wait, its timeout named as fn's */
static int wait_as(const char *fn, dp_future_t *f, int64_t timeout_ns, dp_error_t *err) {
  dp_error_t e;
  int state = wait_done(f, timeout_ns, &e);
  if (state == WAITS_FOR_ITSELF)
    return dp__err(err, DP_EMISUSE,
                   "%s: called from the then() callback whose result completes the future: it would wait for itself", fn);
  if (state == WAITS_THROUGH)
    return dp__err(err, DP_EMISUSE,
                   "%s: called from a then() callback, on a future that waits (through then() parents and collect_all "
                   "inputs) for the child of a then() callback running on this thread, which only that callback's "
                   "return completes: it would wait for itself",
                   fn);
  if (state == WAITS_IN_WALK)
    return dp__err(err, DP_EMISUSE,
                   "%s: called while the future is being completed on this thread (a reduce() of the value it walks, "
                   "or a record hook): it would wait for itself",
                   fn);
  if (state == WAITS_THROUGH_WALK)
    return dp__err(err, DP_EMISUSE,
                   "%s: called while a future is being completed on this thread (a reduce() of the value it walks, or a "
                   "record hook), on a "
                   "future that waits for that one (through then() parents and collect_all inputs): it would wait for "
                   "itself",
                   fn);
  if (state == WAITS_ON_LOOP)
    return dp__err(err, DP_EMISUSE,
                   "%s: called on the thread that runs the loop which alone completes the future (or a future it "
                   "waits for through then() parents and collect_all inputs): a transport's progress thread, or a "
                   "pass of a caller-driven transport, in one of its callbacks. The loop cannot run while this "
                   "waits: it would wait forever. Chain on the future with dp_future_then instead, or wait for it "
                   "from another thread",
                   fn);
  if (state == WAITS_TOO_DEEP)
    return dp__err(err, DP_ELIMIT,
                   "%s: called from a callback run inside %d waits nested in callbacks on this thread (each runs the "
                   "callbacks queued here, which may wait in turn): the future is pending, and the queued callbacks that "
                   "might complete it do not run nested deeper",
                   fn, DP_FUTURE_WAIT_NESTING_MAX);
  if (state < 0) return dp__err(err, state, "%s: %s", fn, e.message);
  if (state == PENDING)
    return dp__err(err, DP_ETIMEDOUT, "%s: the future did not complete within %lld ns", fn, (long long)timeout_ns);
  if (state == FAILED) return get_error(f, err);
  for (size_t i = 0; i < f->rec.ndevs; i++) {
    dp_stream_t *s;
    int rc = dp_current_stream(f->b, f->rec.devs[i].dev, &s, err);
    if (rc == 0) rc = join_device(f, i, s, err);
    if (rc) return rc;
  }
  return 0;
}

int dp_future_wait(dp_future_t *f, int64_t timeout_ns, dp_error_t *err) {
  if (!f) return dp__err(err, DP_EINVAL, "dp_future_wait: NULL future");
  return wait_as("dp_future_wait", f, timeout_ns, err);
}

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A host function on the stream of one of the future's events, queued
 * before the event was recorded: waiting for the event would wait for
 * itself. Said in the name of the function called, not the event's. */
static int sync_waits_for_itself(dp_error_t *err) {
  return dp__err(err, DP_EMISUSE,
                 "dp_future_synchronize: called from a host function on the stream of the future's event, recorded "
                 "after the function was queued: it would wait for itself");
}

int dp_future_synchronize(dp_future_t *f, int64_t timeout_ns, dp_error_t *err) {
  if (!f) return dp__err(err, DP_EINVAL, "dp_future_synchronize: NULL future");
  int64_t start = timeout_ns >= 0 ? mono_ns() : 0;
  int rc = wait_as("dp_future_synchronize", f, timeout_ns, err);
  for (size_t i = 0; rc == 0 && i < f->rec.ndevs; i++) {
    dp_event_t *ev = f->rec.devs[i].ev;
    if (timeout_ns < 0) {
      rc = dp__event_waits_for_itself(ev, "dp_future_synchronize", err);
      rc = rc < 0 ? rc : rc ? sync_waits_for_itself(err) : dp_event_synchronize(ev, err);
      continue;
    }
    /* within the same limit: no event call waits a given time, so poll,
       sleeping 1 µs, doubling up to 1 ms */
    for (int64_t nap = 1000;; nap = nap < 1000000 ? 2 * nap : nap) {
      int q = dp_event_query(ev, err);
      if (q == 1) break;
      if (q < 0) return q;
      /* a host function waiting for work behind itself: DP_EMISUSE at once,
         as without a limit, not the whole limit spent polling */
      int self = dp__event_waits_for_itself(ev, "dp_future_synchronize", err);
      if (self < 0) return self;
      if (self) return sync_waits_for_itself(err);
      int64_t left = timeout_ns - (mono_ns() - start);
      if (left <= 0)
        return dp__err(err, DP_ETIMEDOUT, "dp_future_synchronize: the future's events did not complete within %lld ns",
                       (long long)timeout_ns);
      struct timespec ts = {0, (long)(nap < left ? nap : left)};
      nanosleep(&ts, NULL);
    }
  }
  return rc;
}

dp_value_t dp_future_value(const dp_future_t *f) {
  if (!f) return dp_none();
  int state = dp__load_acquire(&f->state);
  return state == DONE ? f->value : dp_none();
}

int dp_future_is_done(const dp_future_t *f) {
  return f && dp__load_acquire(&f->state) != PENDING;
}

int dp_future_error(const dp_future_t *f, dp_error_t *err) {
  if (!f || dp__load_acquire(&f->state) != FAILED) return 0;
  return get_error(f, err);
}

/* ---- then ---- */

#define STREAMS_INLINE 16

/* The callback of e cannot run (its streams could not be set up: err says
 * why): the child fails with err, and a dp_then_ptrs_cb is told so (ptrs
 * NULL), so that it can complete what it owns and free its ud. */
static void not_run(dp_future_t *p, cbent_t *e, dp_error_t *err) {
  if (e->ptrs_cb) {
    dp_value_t unused = dp_none();
    dp_error_t copy = *err;
    e->ptrs_cb(e->ud, p, &unused, NULL, &copy);
    dp_value_release(unused);
  }
  dp_future_set_error(e->child, err, NULL);
}

/* Runs a then() callback for a completed parent (in run_then's frame). */
static void run_then_in(dp_future_t *p, cbent_t *e) {
  dp_future_t *child = e->child;
  dp_error_t err;
  dp_error_clear(&err);
  int failed = dp__load_acquire(&p->state) == FAILED;
  if (failed && !e->ptrs_cb) {
    get_error(p, &err);
    dp_future_set_error(child, &err, NULL);
    return;
  }
  size_t n = failed ? 0 : p->rec.ndevs;
  /* what each device's current stream was: put back after the callback */
  dp__current_saved_t inl[STREAMS_INLINE], *prev = inl;
  if (n > STREAMS_INLINE && !(prev = dp__alloc_array(n, sizeof *prev))) {
    dp__err(&err, DP_ENOMEM, "out of memory running a callback");
    not_run(p, e, &err);
    return;
  }
  size_t set = 0;
  int rc = 0;
  /* Pool streams, current for the callback (on as many devices as the
   * parent used: they do not count against the thread's
   * DP_CURRENT_STREAM_SLOTS), wait on the parent's events. */
  for (; set < n && rc == 0; set++) {
    dp_stream_t *s;
    rc = dp_stream_pool_next(p->b, p->rec.devs[set].dev, &s, &err);
    if (rc == 0) rc = join_device(p, set, s, &err);
    if (rc) break;
    dp__current_stream_enter(s, &prev[set]);
  }
  int ran = 0; /* a dp_then_ptrs_cb was called: not_run must not call it again (for a dp_then_cb it only fails the child) */
  if (rc == 0 && e->ptrs_cb) {
    /* The callback reports its result's allocations: no walk. */
    dp_value_t result = dp_none();
    int owned;
    dp_ptrset_t *found = scratch_get(&owned, 0, &err);
    ran = found != NULL;
    rc = found ? dp__cb_rc(e->ptrs_cb(e->ud, p, &result, found, &err), &err, "the callback") : err.code;
    if (rc) {
      dp_value_release(result);
    } else {
      dp_future_mark_completed_with_ptrs(child, result, found, NULL);
    }
    if (found) scratch_put(found, owned);
  } else if (rc == 0) {
    dp_value_t result = dp_none();
    rc = dp__cb_rc(e->cb(e->ud, p, &result, &err), &err, "the callback");
    if (rc) {
      dp_value_release(result);
    } else {
      /* The result is walked afresh; its events go on the callback's streams
       * (still current). A failed walk fails the child — never a fallback. */
      dp_future_mark_completed(child, result, NULL);
    }
  }
  for (size_t i = set; i-- > 0;) dp__current_stream_leave(p->rec.devs[i].dev, &prev[i]);
  if (rc && !ran) not_run(p, e, &err);
  else if (rc) dp_future_set_error(child, &err, NULL);
  if (prev != inl) dp__free(prev, n * sizeof *prev);
}

/* The callback runs on whatever thread completes the parent: what it does
 * to that thread's current streams, on any device, is put back when it
 * returns (device/internal.h's frame), as the pool streams on the parent's
 * devices are. */
static void run_then(dp_future_t *p, cbent_t *e) {
  dp__current_frame_t fr;
  dp__current_frame_begin(&fr);
  run_then_in(p, e);
  dp__current_frame_end(&fr);
}

static void run_entry(dp_future_t *f, cbent_t *e) {
  if (e->internal) e->internal(e->ctx, f, e->index);
  else run_then(f, e);
  cbent_free(e);
}

/* Runs the callbacks of a completed f (newest first in list), in registered
 * order: queued on the running callback's level (each with a reference to
 * f, which the queue holds until the entry ran), and run here when this is
 * the thread's outermost frame. The reference also lets a callback release
 * f's last one and then wait, which runs the queued free. */
static void dispatch(dp_future_t *f, cbent_t *list) {
  if (!list) return;
  list = reverse(list);
  tramp_t *t = &tramp;
  uint32_t n = 0;
  cbent_t *last = list;
  for (cbent_t *e = list; e; e = e->next) {
    e->parent = f;
    last = e;
    n++;
  }
  if (DP_UNLIKELY(dp__fetch_add_relaxed(&f->refs, n) > UINT32_MAX - n)) dp__ref_overflow("future");
  level_t *lv = tramp_top(t);
  if (lv->tail) lv->tail->next = list;
  else lv->head = list;
  lv->tail = last;
  if (t->depth) return;
  t->depth = 1;
  tramp_drain(t);
  t->depth = 0;
}

/* Adds a callback entry, or runs it at once if f is complete. e comes
 * zeroed from its maker but for its callback: its next is NULL (a list of
 * one, for dispatch). */
static void add_callback(dp_future_t *f, cbent_t *e) {
  pthread_mutex_lock(&f->mu);
  if (dp__load_relaxed(&f->state) == PENDING) {
    e->next = f->cbs;
    f->cbs = e;
    pthread_mutex_unlock(&f->mu);
    return;
  }
  pthread_mutex_unlock(&f->mu);
  dispatch(f, e);
}

static int then_entry(const char *fn, dp_future_t *f, dp_then_cb cb, dp_then_ptrs_cb ptrs_cb, void *ud,
                      dp_future_t **child, dp_error_t *err) {
  dp_future_t *c;
  int rc = future_like(f, &c, err);
  if (rc) return dp__err_prefix(err, rc, fn);
  cbent_t *e = dp__alloc(sizeof *e);
  if (!e) {
    dp_future_release(c);
    return dp__err(err, DP_ENOMEM, "%s: out of memory chaining a callback", fn);
  }
  memset(e, 0, sizeof *e);
  e->cb = cb;
  e->ptrs_cb = ptrs_cb;
  e->ud = ud;
  e->child = dp_future_retain(c);
  /* before c is shared: the link waits_on_running follows */
  c->dep = f;
  c->deps = &c->dep;
  c->ndeps = 1;
  *child = c;
  add_callback(f, e);
  return 0;
}

int dp_future_then(dp_future_t *f, dp_then_cb cb, void *ud, dp_future_t **child, dp_error_t *err) {
  if (!f || !cb || !child) return dp__err(err, DP_EINVAL, "dp_future_then: NULL %s", !f ? "future" : !cb ? "cb" : "child");
  return then_entry("dp_future_then", f, cb, NULL, ud, child, err);
}

int dp_future_then_with_ptrs(dp_future_t *f, dp_then_ptrs_cb cb, void *ud, dp_future_t **child, dp_error_t *err) {
  if (!f || !cb || !child)
    return dp__err(err, DP_EINVAL, "dp_future_then_with_ptrs: NULL %s", !f ? "future" : !cb ? "cb" : "child");
  return then_entry("dp_future_then_with_ptrs", f, NULL, cb, ud, child, err);
}

int dp__future_notify(dp_future_t *f, void (*fn)(void *ctx, dp_future_t *f, size_t index), void (*drop)(void *ctx),
                      void *ctx) {
  cbent_t *e = dp__alloc(sizeof *e);
  if (!e) return DP_ENOMEM;
  memset(e, 0, sizeof *e);
  e->internal = fn;
  e->internal_drop = drop;
  e->ctx = ctx;
  add_callback(f, e);
  return 0;
}

void dp__future_set_loop(dp_future_t *f, const void *loop) { f->loop = loop; }

void dp__future_loop_enter(dp__future_loop_frame_t *fr, const void *loop) {
  fr->loop = loop;
  fr->outer = loops;
  loops = fr;
}

void dp__future_loop_leave(dp__future_loop_frame_t *fr) { loops = fr->outer; }

/* ---- collect_all ---- */

/* The aggregate holds no reference to its inputs while they are pending (an
 * input that held the aggregate that held it would never be freed): each
 * input's callback stores a reference to it as it completes, or leaves NULL
 * when it was released pending. */
typedef struct collect {
  _Atomic uint32_t refs;
  _Atomic size_t remaining;
  size_t n;
  dp_future_t **in;
  dp_future_t **pending; /* out's deps: input i, unless released pending (in's second half) */
  dp_future_t *out;
} collect_t;

/* Room for in and pending: two slots an input, one at least. */
static size_t collect_slots(size_t n) { return n ? 2 * n : 1; }

static void collect_drop(void *p) {
  collect_t *c = p;
  if (!dp__ref_dec(&c->refs)) return;
  for (size_t i = 0; i < c->n; i++)
    dp_future_release(c->in[i]); /* NULL: released pending */
  dp__free(c->in, collect_slots(c->n) * sizeof *c->in);
  dp_future_release(c->out);
  dp__free(c, sizeof *c);
}

static void collect_finish(collect_t *c) {
  dp_error_t err;
  dp_error_clear(&err);
  for (size_t i = 0; i < c->n; i++) {
    if (!c->in[i]) {
      dp__err(&err, DP_ECANCELED, "input %zu of collect_all was released before it completed", i);
      dp_future_set_error(c->out, &err, NULL);
      return;
    }
    if (dp__load_acquire(&c->in[i]->state) == FAILED) {
      get_error(c->in[i], &err);
      dp_future_set_error(c->out, &err, NULL);
      return;
    }
  }
  dp_value_t list = dp_none(); /* released on every failure, the list's own included */
  dp_ptrset_t *set = NULL;
  int rc = dp_list_new(c->n, &list, &err);
  for (size_t i = 0; rc == 0 && i < c->n; i++) rc = dp_list_append(list, dp_value_retain(c->in[i]->value), &err);
  if (rc == 0) rc = dp_ptrset_new(&set, &err);
  /* The inputs' allocations pass through: no walk. An allocation's refs is
     the sum of its refs in the distinct inputs (an input given twice counts
     once; a tensor two inputs hold counts in each). */
  dp_ptrset_t *seen = NULL; /* the inputs met, when more than one */
  if (rc == 0 && c->n > 1) rc = dp_ptrset_new(&seen, &err);
  for (size_t i = 0; rc == 0 && i < c->n; i++) {
    size_t before = dp_ptrset_count(seen);
    if (seen && (rc = dp_ptrset_add(seen, (dp_device_t){DP_DEVICE_CPU, 0}, c->in[i], 1, NULL, &err)) != 0) break;
    if (seen && dp_ptrset_count(seen) == before) continue;
    for (size_t k = 0; rc == 0 && k < c->in[i]->rec.ptrs.n; k++) {
      dp_ptr_info_t p;
      size_t at;
      dp__ptrs_get(&c->in[i]->rec.ptrs, k, &p);
      rc = dp_ptrset_add(set, p.device, p.base, p.nbytes, &at, &err);
      if (rc == 0 && p.refs > 1) dp__ptrset_add_refs(set, at, p.refs - 1);
    }
  }
  dp_ptrset_free(seen);
  /* One stream per used device joins every input's event there. */
  size_t ngroups = rc == 0 ? dp_ptrset_ndevices(set) : 0, nd = 0;
  dp_stream_t *inl[STREAMS_INLINE], **streams = inl;
  if (rc == 0 && ngroups > STREAMS_INLINE && !(streams = dp__alloc_array(ngroups, sizeof *streams)))
    rc = dp__err(&err, DP_ENOMEM, "out of memory collecting futures");
  for (size_t g = 0; rc == 0 && g < ngroups; g++) {
    dp_device_t d = dp_ptrset_device(set, g);
    if (d.type == DP_DEVICE_CPU) continue;
    /* A device the aggregate does not allow gets no stream (one of another
     * backend cannot have one): prepare() refuses the value before it uses
     * any, with DP_EDEVICE naming the device, as a completion does. */
    if (!dp__future_accepts(c->out, d)) break;
    dp_stream_t *s;
    if ((rc = dp_stream_pool_next(c->out->b, d, &s, &err)) != 0) break;
    for (size_t i = 0; rc == 0 && i < c->n; i++)
      for (size_t k = 0; rc == 0 && k < c->in[i]->rec.ndevs; k++)
        if (dp_device_equal(c->in[i]->rec.devs[k].dev, d)) rc = dp_stream_wait_event(s, c->in[i]->rec.devs[k].ev, &err);
    streams[nd++] = s;
  }
  cbent_t *cbs = NULL;
  if (rc == 0) {
    walking_t me = {c->out, walking}; /* a record hook that waits on it (as in dp_future_mark_completed) */
    walking = &me;
    rc = complete_with_set("dp_future_collect_all", c->out, list, set, 0, streams, &err, &cbs);
    walking = me.outer;
  } else {
    dp_value_release(list);
    dp_future_set_error(c->out, &err, NULL);
  }
  if (streams != inl) dp__free(streams, ngroups * sizeof *streams);
  dp_ptrset_free(set);
  dispatch(c->out, cbs);
}

static void collect_one(void *p, dp_future_t *parent, size_t index) {
  collect_t *c = p;
  /* Released pending, its memory goes once this returns: out's link to it
     is cut first, under out's lock (which a wait following it holds). A
     completed input stays linked, held by in[] until out completes: the
     wait stops at it (done), and completions take no second lock. */
  if (!parent) {
    pthread_mutex_lock(&c->out->mu);
    c->pending[index] = NULL;
    pthread_mutex_unlock(&c->out->mu);
  }
  c->in[index] = parent ? dp_future_retain(parent) : NULL;
  /* acq_rel: the last input sees every other input's store */
  if (dp__ref_dec(&c->remaining)) collect_finish(c);
}

int dp_future_collect_all(dp_future_t *const *futures, size_t n, const dp_future_opts_t *opts, dp_future_t **out,
                          dp_error_t *err) {
  if (!out || (n && !futures))
    return dp__err(err, DP_EINVAL, "dp_future_collect_all: NULL %s", out ? "futures" : "out");
  for (size_t i = 0; i < n; i++)
    if (!futures[i]) return dp__err(err, DP_EINVAL, "dp_future_collect_all: futures[%zu] is NULL", i);
  dp_future_t *o;
  int rc = opts || n == 0 ? dp_future_new(opts, &o, err) : future_like(futures[0], &o, err);
  if (rc) return dp__err_prefix(err, rc, "dp_future_collect_all");
  collect_t *c = dp__alloc(sizeof *c);
  cbent_t **es = c ? dp__alloc_array(n ? n : 1, sizeof *es) : NULL;
  dp_future_t **in = c ? dp__alloc_array(collect_slots(n), sizeof *in) : NULL;
  size_t made = 0;
  if (es && in)
    for (; made < n; made++)
      if (!(es[made] = dp__alloc(sizeof(cbent_t)))) break;
  if (!c || !es || !in || made < n) {
    for (size_t i = 0; i < made; i++) dp__free(es[i], sizeof(cbent_t));
    dp__free(es, es ? (n ? n : 1) * sizeof *es : 0);
    dp__free(in, in ? collect_slots(n) * sizeof *in : 0);
    dp__free(c, c ? sizeof *c : 0);
    dp_future_release(o);
    return dp__err(err, DP_ENOMEM, "dp_future_collect_all: out of memory collecting futures");
  }
  c->n = n;
  c->in = in;
  c->pending = in + n;
  c->out = dp_future_retain(o);
  dp__atomic_init(&c->refs, (uint32_t)n + 1);
  dp__atomic_init(&c->remaining, n);
  /* in[i] is written by input i's callback (collect_one), run or canceled
     before its entry drops c: nothing reads it before */
  for (size_t i = 0; i < n; i++) c->pending[i] = futures[i];
  /* before o is shared (an input's callback may run at once): the links
     waits_on_running follows */
  o->deps = c->pending;
  o->ndeps = n;
  if (n == 0) { /* complete at once: with [], or failed (out of memory), never left pending */
    dp_value_t empty;
    dp_error_t e;
    if (dp_list_new(0, &empty, &e) == 0) dp_future_mark_completed(o, empty, NULL);
    else dp_future_set_error(o, &e, NULL);
  }
  for (size_t i = 0; i < n; i++) {
    memset(es[i], 0, sizeof(cbent_t));
    es[i]->internal = collect_one;
    es[i]->internal_drop = collect_drop;
    es[i]->ctx = c;
    es[i]->index = i;
    add_callback(futures[i], es[i]);
  }
  dp__free(es, (n ? n : 1) * sizeof *es);
  /* Written last: out may point into futures (a caller replacing its
   * inputs by their aggregate), which must be read whole first. */
  *out = o;
  collect_drop(c);
  return 0;
}

/* ---- introspection ---- */

/* The allocations of f (completed with a value) each once: its record, or
 * when that is raw (a completion's walk lists an allocation as often as
 * it meets it apart: ptrs.h) the list made from it at the first ask and
 * kept. NULL with err when that list cannot be made. */
static const dp__ptrs_t *distinct_ptrs(const dp_future_t *cf, dp_error_t *err) {
  dp_future_t *f = (dp_future_t *)cf; /* the list is made once, under mu: the future reads the same */
  if (!f->rec.ptrs.raw) return &f->rec.ptrs;
  dp__ptrs_t *d = dp__load_acquire(&f->distinct);
  if (d) return d;
  pthread_mutex_lock(&f->mu);
  if (!(d = dp__load_relaxed(&f->distinct))) {
    if (!(d = dp__alloc(sizeof *d))) {
      dp__err(err, DP_ENOMEM, "dp_future_ptr: out of memory listing the future's allocations");
    } else if (dp__err_prefix(err, dp__ptrs_distinct(&f->rec.ptrs, d, err), "dp_future_ptr") != 0) {
      dp__free(d, sizeof *d);
      d = NULL;
    } else {
      dp__store_release(&f->distinct, d);
    }
  }
  pthread_mutex_unlock(&f->mu);
  return d;
}

size_t dp_future_nptrs(const dp_future_t *f) {
  if (!f || dp__load_acquire(&f->state) != DONE) return 0;
  dp_error_t e;
  const dp__ptrs_t *d = distinct_ptrs(f, &e);
  return d ? d->n : 0;
}

int dp_future_ptr(const dp_future_t *f, size_t i, dp_ptr_info_t *out, dp_error_t *err) {
  if (!f || !out) return dp__err(err, DP_EINVAL, "dp_future_ptr: NULL %s", f ? "out" : "future");
  if (dp__load_acquire(&f->state) != DONE)
    return dp__err(err, DP_ESTATE, "dp_future_ptr: the future %s", dp_future_is_done(f) ? "failed" : "is pending");
  const dp__ptrs_t *d = distinct_ptrs(f, err);
  if (!d) return DP_ENOMEM;
  if (i >= d->n)
    return dp__err(err, DP_EINVAL, "dp_future_ptr: index %zu out of range (the value holds %zu allocation%s)", i,
                   d->n, d->n == 1 ? "" : "s");
  dp__ptrs_get(d, i, out);
  return 0;
}

size_t dp_future_ndevices(const dp_future_t *f) { return dp_future_is_done(f) ? f->rec.ndevs : 0; }

dp_device_t dp_future_device(const dp_future_t *f, size_t i) {
  dp_device_t none = {DP_DEVICE_CPU, 0};
  return dp_future_is_done(f) && i < f->rec.ndevs ? f->rec.devs[i].dev : none;
}

dp_event_t *dp_future_event(const dp_future_t *f, size_t i) {
  return dp_future_is_done(f) && i < f->rec.ndevs ? f->rec.devs[i].ev : NULL;
}
