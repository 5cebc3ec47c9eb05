/* device/device.c — what every backend shares: the registry, stream and
 * event handles, pools, the per-thread current stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "../core/table.h"

/* Process-wide (ARCHITECTURE.md, "Process-wide state"): one backend per
 * device type, as the CUDA runtime is one per process. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static dp_backend_t *registry[DP_DEVICE_TYPE_COUNT];
/* A backend whose devices are unavailable (DP_ENODEV at init) stays so until
 * dp_shutdown: its error is kept and returned, not found again at each call
 * (without a GPU, each future with the default backend asked the CUDA
 * runtime anew). */
static dp_error_t unavailable[DP_DEVICE_TYPE_COUNT];
_Atomic unsigned dp__backend_inits[DP_DEVICE_TYPE_COUNT];

/* Stream-destroy listeners (internal.h). */
static pthread_mutex_t listeners_mu = PTHREAD_MUTEX_INITIALIZER;
static dp__stream_listener_t *listeners;

/* This thread's current streams: one entry a device, found by index (no
 * search, no allocation). The caller may hold DP_CURRENT_STREAM_SLOTS of
 * them (device.h); the streams a then() callback runs with (future.h,
 * dp__current_stream_enter) do not count, so that a callback over a value
 * on more devices than that still gets its streams. */
#define TLS_DEVICES (DP_DEVICE_TYPE_COUNT * (DP_DEVICE_INDEX_MAX + 1))
enum { OWN_NONE = 0, OWN_CALLER, OWN_LIBRARY };
static _Thread_local dp_stream_t *tls_current[TLS_DEVICES];
static _Thread_local unsigned char tls_owner[TLS_DEVICES];
static _Thread_local int tls_caller_count;  /* entries owned by the caller */
/* What the running then() callbacks' streams replaced, innermost first
 * (dp__current_stream_enter): current again once they return. */
static _Thread_local dp__current_saved_t *tls_saved;
/* The running callbacks' frames, innermost first, and for each device the
 * depth of the frame that has logged (or entered) it, 0 for none: a frame
 * puts back what it marked before it ends, so a mark equal to the running
 * frame's depth is always that frame's own. */
static _Thread_local dp__current_frame_t *tls_frame;
static _Thread_local uint32_t tls_mark[TLS_DEVICES];
/* 1 while the stream provider runs on this thread for that device. */
static _Thread_local unsigned char tls_asking[TLS_DEVICES];
/* dp_shutdown frees every backend's streams, but reaches only its own
 * thread's slots: another thread's still named them, and its next lookup
 * handed out a freed stream. Each shutdown counts one more generation; a
 * thread whose slots are of an older one forgets them at its next call
 * (one load on the hot path, no lock, no list of threads). */
static _Atomic unsigned current_gen;
static _Thread_local unsigned tls_gen;

static void tls_forget_all(void) {
  memset(tls_current, 0, sizeof tls_current);
  memset(tls_owner, 0, sizeof tls_owner);
  if (!tls_frame) memset(tls_mark, 0, sizeof tls_mark);
  tls_caller_count = 0;
}

/* Forgets this thread's current streams when a dp_shutdown has run since
 * it last looked (they were freed with their backends). */
static inline void tls_catch_up(void) {
  unsigned g = dp__load_acquire(&current_gen);
  if (DP_LIKELY(tls_gen == g)) return;
  tls_gen = g;
  tls_forget_all();
}

/* The entry of d, or -1 for a device type that does not exist. */
static int slot_of(dp_device_t d) {
  return d.type < DP_DEVICE_TYPE_COUNT ? (int)d.type * (DP_DEVICE_INDEX_MAX + 1) + d.index : -1;
}

static void slot_clear(int i) {
  if (tls_owner[i] == OWN_CALLER) tls_caller_count--;
  tls_current[i] = NULL;
  tls_owner[i] = OWN_NONE;
}

/* Puts slot i as it was: current stream, owner and mark. */
static void slot_restore(int i, dp_stream_t *s, int owner, uint32_t mark) {
  if (tls_owner[i] == OWN_CALLER) tls_caller_count--;
  if (owner == OWN_CALLER) tls_caller_count++;
  tls_current[i] = s;
  tls_owner[i] = (unsigned char)owner;
  tls_mark[i] = mark;
}

/* Before the first change of slot i inside the running callback's frame:
 * logs what it holds, to be put back when the callback returns. 0, or
 * DP_ENOMEM (nothing logged). */
static int frame_log(int i) {
  dp__current_frame_t *fr = tls_frame;
  if (!fr || tls_mark[i] == fr->depth) return 0;
  if (dp__grow_inl((void **)&fr->log, &fr->cap, fr->n + 1, sizeof *fr->log, fr->inl) != 0) return DP_ENOMEM;
  fr->log[fr->n++] = (dp__current_log_t){i, tls_owner[i], tls_mark[i], tls_current[i]};
  tls_mark[i] = fr->depth;
  return 0;
}
static _Atomic(dp_stream_provider_cb) provider_fn;
static void *_Atomic provider_ud;

int dp__named(const char *fn, const char *dev, int rc, dp_error_t *err) {
  size_t n = strlen(fn);
  if (rc >= 0 || !err || (strncmp(err->message, fn, n) == 0 && (err->message[n] == ':' || err->message[n] == '(')))
    return rc;
  char prefix[96];
  snprintf(prefix, sizeof prefix, "%s(%s)", fn, dev);
  return dp__err_prefix(err, rc, prefix);
}

int dp__named_dev(const char *fn, dp_device_t dev, int rc, dp_error_t *err) {
  if (rc >= 0 || !err) return rc;
  char d[16];
  return dp__named(fn, dp_device_format(dev, d, sizeof d), rc, err);
}

static const dp__backend_ops_t *ops_for(dp_device_type_t t) {
  return t == DP_DEVICE_HOST ? &dp__host_ops : t == DP_DEVICE_CUDA ? &dp__cuda_ops : NULL;
}

int dp_backend_get(dp_device_type_t type, dp_backend_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_backend_get: NULL out");
  const dp__backend_ops_t *ops = ops_for(type);
  if (!ops)
    return dp__err(err, DP_EINVAL, "dp_backend_get: no backend for device type %d%s", (int)type,
                   type == DP_DEVICE_CPU ? " (cpu has no streams)" : "");
  pthread_mutex_lock(&registry_mu);
  dp_backend_t *b = registry[type];
  int rc = 0;
  if (!b && unavailable[type].code) {
    rc = unavailable[type].code;
    if (err) *err = unavailable[type];
  } else if (!b) {
    b = dp__alloc(sizeof *b);
    if (!b) {
      rc = dp__err(err, DP_ENOMEM, "dp_backend_get(%s): out of memory creating a backend",
                   type == DP_DEVICE_HOST ? "host" : "cuda");
      goto out;
    }
    memset(b, 0, sizeof *b);
    b->type = type;
    b->name = type == DP_DEVICE_HOST ? "host" : "cuda";
    b->ops = ops;
    dp_error_t why = {0};
    dp__backend_inits[type]++;
    if ((rc = ops->init(b, &why)) != 0) {
      dp__named("dp_backend_get", b->name, rc, &why);
      dp__free(b, sizeof *b);
      if (rc == DP_ENODEV) unavailable[type] = why;
      if (err) *err = why;
      goto out;
    }
    b->devs = dp__alloc_array((size_t)b->ndev, sizeof(dp__devstate_t));
    if (!b->devs) {
      ops->shutdown(b);
      rc = dp__err(err, DP_ENOMEM, "dp_backend_get(%s): out of memory creating a backend", b->name);
      dp__free(b, sizeof *b);
      goto out;
    }
    memset(b->devs, 0, (size_t)b->ndev * sizeof(dp__devstate_t));
    for (int i = 0; i < b->ndev; i++) pthread_mutex_init(&b->devs[i].mu, NULL);
    registry[type] = b;
  }
out:
  pthread_mutex_unlock(&registry_mu);
  if (rc == 0) *out = b;
  return rc;
}

int dp_backend_default(dp_backend_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_backend_default: NULL out");
  const char *env = getenv("DEVPICKLE_BACKEND");
  if (env && *env) {
    if (strcmp(env, "host") == 0) return dp_backend_get(DP_DEVICE_HOST, out, err);
    if (strcmp(env, "cuda") == 0) return dp_backend_get(DP_DEVICE_CUDA, out, err);
    char shown[DP__SHOWN_MAX];
    return dp__err(err, DP_EINVAL, "dp_backend_default: DEVPICKLE_BACKEND='%s': expected host or cuda",
                   dp__shown(env, shown));
  }
  /* host stands in only where no GPU is usable (DP_ENODEV): any other
     failure (out of memory starting the backend) is no sign that there is
     none, and falling back then would give the caller the other backend,
     whose futures refuse the GPU's memory, for the rest of the process */
  dp_error_t why;
  int rc = dp_backend_get(DP_DEVICE_CUDA, out, &why);
  if (rc == 0) return 0;
  if (rc != DP_ENODEV) {
    if (err) *err = why;
    return rc;
  }
  return dp_backend_get(DP_DEVICE_HOST, out, err);
}

/* Accessors: a neutral value for a NULL handle (base.h). */
static const dp_device_t no_device = {DP_DEVICE_CPU, 0};

dp_device_type_t dp_backend_type(const dp_backend_t *b) { return b ? b->type : DP_DEVICE_CPU; }
const char *dp_backend_name(const dp_backend_t *b) { return b ? b->name : NULL; }
int dp_backend_device_count(const dp_backend_t *b) { return b ? b->ndev : 0; }

dp_device_t dp_backend_device(const dp_backend_t *b, int index) {
  if (!b || index < 0 || index >= b->ndev) return no_device;
  dp_device_t d = {(uint8_t)b->type, (uint8_t)index};
  return d;
}

int dp__check_device(const char *fn, const dp_backend_t *b, dp_device_t dev, dp_error_t *err) {
  if (!b) return dp__err(err, DP_EINVAL, "%s: NULL backend", fn);
  if (dev.type != b->type || dev.index >= b->ndev) {
    char buf[16];
    return dp__err(err, DP_EINVAL, "%s: device %s does not belong to the %s backend (%d devices)", fn,
                   dp_device_format(dev, buf, sizeof buf), b->name, b->ndev);
  }
  return 0;
}

static void free_stream_handle(dp_stream_t *s) {
  if (!s) return;
  s->b->ops->stream_destroy(s->b, s->h);
  dp__free(s, sizeof *s);
}

static inline int stream_default(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err);

/* ---- wrappers of native streams (dp_stream_wrap) ----
 * Not core/table.h: that table is rebuilt in place and read under its
 * owner's lock, while a wrap lookup (every completion of a future made
 * with a framework's current stream) must not take one. */

/* 0 marks an empty slot; a native of UINTPTR_MAX is refused before. */
static inline uintptr_t wrap_key(const void *native) { return (uintptr_t)native + 1; }

/* The slot holding key in t, or the empty slot where probing stopped
 * (tables are at most half full). */
static inline dp__wrap_slot_t *wrap_probe(dp__wrap_table_t *t, uintptr_t key, int *found) {
  size_t mask = t->nslots - 1;
  for (size_t j = dp__hash_ptr((const void *)key) & mask;; j = (j + 1) & mask) {
    uintptr_t k = dp__load_acquire(&t->slots[j].key);
    if (k == key || k == 0) {
      *found = k == key;
      return &t->slots[j];
    }
  }
}

/* The wrapper of key, without a lock; NULL when there is none (yet). */
static inline dp_stream_t *wrap_find(dp__devstate_t *ds, uintptr_t key) {
  dp__wrap_table_t *t = dp__load_acquire(&ds->wraps);
  int found;
  if (DP_UNLIKELY(!t)) return NULL;
  dp__wrap_slot_t *sl = wrap_probe(t, key, &found);
  return found ? dp__load_acquire(&sl->s) : NULL;
}

/* Publishes a table with room for one more key, holding the live entries
 * of the current one (slots of natives gone away are dropped). Under mu. */
static int wrap_grow(dp__devstate_t *ds) {
  dp__wrap_table_t *old = dp__load_relaxed(&ds->wraps);
  size_t live = 0, n = 16;
  if (old)
    for (size_t j = 0; j < old->nslots; j++) live += dp__load_relaxed(&old->slots[j].s) != NULL;
  while ((live + 1) * 2 > n) n *= 2;
  dp__wrap_table_t *t = dp__alloc(sizeof *t + n * sizeof t->slots[0]);
  if (!t) return DP_ENOMEM;
  memset(t, 0, sizeof *t + n * sizeof t->slots[0]);
  t->nslots = n;
  t->older = old;
  if (old)
    for (size_t j = 0; j < old->nslots; j++) {
      dp_stream_t *s = dp__load_relaxed(&old->slots[j].s);
      if (!s) continue;
      int found;
      uintptr_t key = dp__load_relaxed(&old->slots[j].key);
      dp__wrap_slot_t *sl = wrap_probe(t, key, &found);
      dp__store_relaxed(&sl->s, s);
      dp__store_relaxed(&sl->key, key);
      t->used++;
    }
  dp__store_release(&ds->wraps, t);  /* a reader that sees t sees its slots */
  return 0;
}

/* The locked path of dp_stream_wrap: another thread may have made the
 * wrapper meanwhile; otherwise the backend checks the handle and a new
 * wrapper is published. */
static int wrap_insert(dp_backend_t *b, dp_device_t dev, void *native, dp_stream_t **out, dp_error_t *err) {
  dp__devstate_t *ds = &b->devs[dev.index];
  uintptr_t key = wrap_key(native);
  dp_stream_t *s = NULL;
  int rc = 0, found = 0;
  pthread_mutex_lock(&ds->mu);
  dp__wrap_table_t *t = dp__load_relaxed(&ds->wraps);
  dp__wrap_slot_t *sl = t ? wrap_probe(t, key, &found) : NULL;
  if (found && (s = dp__load_relaxed(&sl->s)) != NULL) goto out;
  if (!found && (!t || (t->used + 1) * 2 > t->nslots)) {
    if (wrap_grow(ds) != 0) {
      rc = dp__err(err, DP_ENOMEM, "out of memory wrapping a native stream");
      goto out;
    }
    t = dp__load_relaxed(&ds->wraps);
    sl = wrap_probe(t, key, &found);
  }
  void *h;
  if ((rc = b->ops->stream_wrap(b, dev.index, native, &h, err)) != 0) goto out;
  if (!(s = dp__alloc(sizeof *s))) {
    rc = dp__err(err, DP_ENOMEM, "out of memory wrapping a native stream");
    goto out;
  }
  *s = (dp_stream_t){b, dev, h, DP__STREAM_WRAPPED, NULL};
  dp__store_release(&sl->s, s);
  if (!found) {  /* the stream before the key: a reader that finds the key finds the stream */
    dp__store_release(&sl->key, key);
    t->used++;
  }
out:
  pthread_mutex_unlock(&ds->mu);
  if (rc == 0) *out = s;
  return rc;
}

int dp_stream_wrap(dp_backend_t *b, dp_device_t dev, void *native, dp_stream_t **out, dp_error_t *err) {
  int rc = dp__check_device("dp_stream_wrap", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_stream_wrap: NULL out");
  /* host streams have no native default stream: NULL names the device's
   * default stream (device.h) */
  if (!native && b->type == DP_DEVICE_HOST) return stream_default(b, dev, out, err);
  uintptr_t key = wrap_key(native);
  if (DP_UNLIKELY(key == 0)) return dp__err(err, DP_EINVAL, "dp_stream_wrap: %p is not a stream handle", native);
  dp_stream_t *s = wrap_find(&b->devs[dev.index], key);
  if (DP_LIKELY(s != NULL)) {
    *out = s;
    return 0;
  }
  return dp__named_dev("dp_stream_wrap", dev, wrap_insert(b, dev, native, out, err), err);
}

/* s (the caller's) is being destroyed, and with it its native handle: the
 * wrapper of that handle, if any, leaves the table for the retired list
 * (a thread may still hold it; it is freed by dp_shutdown). Returns it, for
 * the listeners to be told. */
static dp_stream_t *wrap_forget(dp_stream_t *s) {
  dp__devstate_t *ds = &s->b->devs[s->dev.index];
  uintptr_t key = wrap_key(s->b->ops->stream_native(s->h));
  dp_stream_t *w = NULL;
  int found;
  pthread_mutex_lock(&ds->mu);
  dp__wrap_table_t *t = dp__load_relaxed(&ds->wraps);
  dp__wrap_slot_t *sl = t ? wrap_probe(t, key, &found) : NULL;
  if (sl && found && (w = dp__load_relaxed(&sl->s)) != NULL) {
    dp__store_release(&sl->s, NULL);
    w->next_retired = ds->retired;
    ds->retired = w;
  }
  pthread_mutex_unlock(&ds->mu);
  return w;
}

/* dp_shutdown's part: the wrappers (never their handles) and the tables. */
static void wraps_free(dp__devstate_t *ds) {
  dp__wrap_table_t *t = dp__load_relaxed(&ds->wraps);
  if (t)
    for (size_t j = 0; j < t->nslots; j++) dp__free(dp__load_relaxed(&t->slots[j].s), sizeof(dp_stream_t));
  while (t) {
    dp__wrap_table_t *older = t->older;
    dp__free(t, sizeof *t + t->nslots * sizeof t->slots[0]);
    t = older;
  }
  dp__store_relaxed(&ds->wraps, NULL);
  while (ds->retired) {
    dp_stream_t *w = ds->retired;
    ds->retired = w->next_retired;
    dp__free(w, sizeof *w);
  }
}

void dp__stream_listen(dp__stream_listener_t *l) {
  pthread_mutex_lock(&listeners_mu);
  l->next = listeners;
  listeners = l;
  pthread_mutex_unlock(&listeners_mu);
}

void dp__stream_unlisten(dp__stream_listener_t *l) {
  pthread_mutex_lock(&listeners_mu);
  for (dp__stream_listener_t **p = &listeners; *p; p = &(*p)->next)
    if (*p == l) {
      *p = l->next;
      break;
    }
  pthread_mutex_unlock(&listeners_mu);
  l->next = NULL;
}

/* Host work still queued completes before anything of its backend is
 * torn down: it may use the backend it was given (make an event, a pool
 * stream), which was freed under it when the events and streams went
 * first and the workers were joined last. Work that queues more work is
 * waited for too, until every stream is idle. */
static void quiesce(dp_backend_t *b) {
  if (!b->ops->idle) return;
  do
    for (int d = 0; d < b->ndev; d++) (void)b->ops->device_sync(b, d, NULL);
  while (!b->ops->idle(b));
}

/* The backends come out of the registry under its lock and are stopped
 * after it is released: stopping joins the host workers, and work still
 * queued on them may call dp_backend_get (which takes the lock). Such a
 * call during the shutdown starts a new backend, which the next
 * dp_shutdown stops. */
void dp__device_shutdown(void) {
  dp_backend_t *gone[DP_DEVICE_TYPE_COUNT];
  pthread_mutex_lock(&registry_mu);
  for (int t = 0; t < DP_DEVICE_TYPE_COUNT; t++) {
    gone[t] = registry[t];
    registry[t] = NULL;
    unavailable[t].code = 0;
  }
  pthread_mutex_unlock(&registry_mu);
  for (int t = 0; t < DP_DEVICE_TYPE_COUNT; t++) {
    dp_backend_t *b = gone[t];
    if (!b) continue;
    quiesce(b);
    for (int d = 0; d < b->ndev; d++) {
      dp__devstate_t *ds = &b->devs[d];
      while (ds->free_events) {
        dp_event_t *e = ds->free_events;
        ds->free_events = e->next_free;
        if (e->h) b->ops->event_destroy(b, e->h);
        dp__free(e, sizeof *e);
      }
      wraps_free(ds);
      for (int i = 0; i < DP_POOL_STREAMS; i++) free_stream_handle(dp__load_relaxed(&ds->pool[i]));
      free_stream_handle(dp__load_relaxed(&ds->default_stream));
      pthread_mutex_destroy(&ds->mu);
    }
    b->ops->shutdown(b);
    dp__free(b->devs, (size_t)b->ndev * sizeof(dp__devstate_t));
    dp__free(b, sizeof *b);
  }
  /* every thread's current streams went with their backends: this thread
     forgets them now, the others at their next call (tls_catch_up) */
  tls_forget_all();
  tls_gen = dp__fetch_add_release(&current_gen, 1) + 1;
  dp_set_stream_provider(NULL, NULL);
}

/* ---- streams ---- */

static int stream_new(const char *fn, dp_backend_t *b, dp_device_t dev, int owned, dp_stream_t **out,
                      dp_error_t *err) {
  dp_stream_t *s = dp__alloc(sizeof *s);
  if (!s) return dp__named_dev(fn, dev, dp__err(err, DP_ENOMEM, "out of memory creating a stream"), err);
  int rc = b->ops->stream_create(b, dev.index, &s->h, err);
  if (rc) {
    dp__free(s, sizeof *s);
    return dp__named_dev(fn, dev, rc, err);
  }
  s->b = b;
  s->dev = dev;
  s->owned = owned;
  *out = s;
  return 0;
}

int dp_stream_new(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err) {
  int rc = dp__check_device("dp_stream_new", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_stream_new: NULL out");
  return stream_new("dp_stream_new", b, dev, DP__STREAM_CALLER, out, err);
}

void dp_stream_free(dp_stream_t *s) {
  if (!s || s->owned != DP__STREAM_CALLER) return;
  /* From a host function on s itself, or on a stream whose work waits
     (through event waits) for work queued on the function's own stream
     after it: freeing waits for s's work and joins its worker, which would
     wait for the very function running it. Nothing is freed, and a line
     says so (as a transport freed from its own thread does). The check is
     dp_stream_synchronize's, which refuses those waits. */
  if (dp__host_fn_stream) {
    dp_error_t e;
    if (dp__host_fn_stream == s->h) {
      fprintf(stderr, "devpickle: dp_stream_free called from a host function on that stream: nothing freed (device.h)\n");
      return;
    }
    int rc = dp_stream_synchronize(s, &e);
    if (rc == DP_EMISUSE) {
      fprintf(stderr,
              "devpickle: dp_stream_free called from a host function, on a stream that waits for work queued on the "
              "function's own stream after it: nothing freed (device.h)\n");
      return;
    }
    if (rc) { /* it could not tell (out of memory): freeing might wait for the function itself */
      fprintf(stderr, "devpickle: dp_stream_free called from a host function: %s: nothing freed\n", e.message);
      return;
    }
  }
  /* A wrapper of s's native handle goes with it: nothing may keep using it. */
  dp_stream_t *w = wrap_forget(s);
  tls_catch_up();
  /* this thread's current-stream slots forget them (other threads' cannot be
   * reached: they reset theirs first, device.h) */
  for (int i = 0; i < TLS_DEVICES; i++)
    if (tls_current[i] && (tls_current[i] == s || (w && tls_current[i] == w))) slot_clear(i);
  /* nor when a then() callback running here returns: what its streams
     replaced would be put back, s included (freed inside the callback) */
  for (dp__current_saved_t *sv = tls_saved; sv; sv = sv->outer)
    if (sv->s && (sv->s == s || (w && sv->s == w))) {
      sv->s = NULL;
      sv->owner = OWN_NONE;
    }
  /* nor what a callback's frame logged to put back */
  for (dp__current_frame_t *fr = tls_frame; fr; fr = fr->outer)
    for (size_t k = 0; k < fr->n; k++)
      if (fr->log[k].s && (fr->log[k].s == s || (w && fr->log[k].s == w))) {
        fr->log[k].s = NULL;
        fr->log[k].owner = OWN_NONE;
      }
  dp_stream_synchronize(s, NULL);
  pthread_mutex_lock(&listeners_mu);
  for (dp__stream_listener_t *l = listeners; l; l = l->next) {
    l->fn(l->ctx, s);
    if (w) l->fn(l->ctx, w);
  }
  pthread_mutex_unlock(&listeners_mu);
  free_stream_handle(s);
}

/* The backend's stream in *slot, made on first use (under the device's
 * lock; read without it afterwards). A failed creation leaves the slot
 * empty, for the next call to try again, and reports why. */
static int owned_stream(const char *fn, dp_backend_t *b, dp_device_t dev, dp_stream_t *_Atomic *slot,
                        dp_stream_t **out, dp_error_t *err) {
  dp__devstate_t *ds = &b->devs[dev.index];
  int rc = 0;
  pthread_mutex_lock(&ds->mu);
  dp_stream_t *s = dp__load_relaxed(slot);
  if (!s && (rc = stream_new(fn, b, dev, DP__STREAM_BACKEND, &s, err)) == 0) dp__store_release(slot, s);
  pthread_mutex_unlock(&ds->mu);
  if (rc == 0) *out = s;
  return rc;
}

/* dp_stream_default once b, dev and out are checked. */
static inline int stream_default(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err) {
  dp_stream_t *s = dp__load_acquire(&b->devs[dev.index].default_stream);
  if (DP_LIKELY(s != NULL)) {
    *out = s;
    return 0;
  }
  return owned_stream("dp_stream_default", b, dev, &b->devs[dev.index].default_stream, out, err);
}

int dp_stream_default(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err) {
  int rc = dp__check_device("dp_stream_default", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_stream_default: NULL out");
  return stream_default(b, dev, out, err);
}

int dp_stream_pool_next(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err) {
  int rc = dp__check_device("dp_stream_pool_next", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_stream_pool_next: NULL out");
  dp__devstate_t *ds = &b->devs[dev.index];
  unsigned i = dp__fetch_add_relaxed(&ds->pool_next, 1) % DP_POOL_STREAMS;
  dp_stream_t *s = dp__load_acquire(&ds->pool[i]);
  if (DP_LIKELY(s != NULL)) {
    *out = s;
    return 0;
  }
  return owned_stream("dp_stream_pool_next", b, dev, &ds->pool[i], out, err);
}

dp_backend_t *dp_stream_backend(const dp_stream_t *s) { return s ? s->b : NULL; }
dp_device_t dp_stream_device(const dp_stream_t *s) { return s ? s->dev : no_device; }
void *dp_stream_native(const dp_stream_t *s) { return s ? s->b->ops->stream_native(s->h) : NULL; }

int dp_stream_synchronize(dp_stream_t *s, dp_error_t *err) {
  if (!s) return dp__err(err, DP_EINVAL, "dp_stream_synchronize: NULL stream");
  return dp__named_dev("dp_stream_synchronize", s->dev, s->b->ops->stream_sync(s->b, s->h, err), err);
}

int dp_stream_query(dp_stream_t *s, dp_error_t *err) {
  if (!s) return dp__err(err, DP_EINVAL, "dp_stream_query: NULL stream");
  return dp__named_dev("dp_stream_query", s->dev, s->b->ops->stream_query(s->b, s->h, err), err);
}

int dp_stream_wait_event(dp_stream_t *s, dp_event_t *e, dp_error_t *err) {
  if (!s || !e) return dp__err(err, DP_EINVAL, "dp_stream_wait_event: NULL %s", !s ? "stream" : "event");
  if (s->b != e->b)
    return dp__err(err, DP_EINVAL, "dp_stream_wait_event: the stream (%s) and the event (%s) belong to different backends",
                   s->b->name, e->b->name);
  return dp__named_dev("dp_stream_wait_event", s->dev, s->b->ops->stream_wait(s->b, s->h, e->h, err), err);
}

int dp_stream_wait_stream(dp_stream_t *s, dp_stream_t *t, dp_error_t *err) {
  /* both are streams: the message says which of the two is missing */
  if (!s || !t)
    return dp__err(err, DP_EINVAL, "dp_stream_wait_stream: NULL %s",
                   !s ? "s (the stream that waits)" : "t (the stream waited for)");
  if (s->b != t->b)
    return dp__err(err, DP_EINVAL, "dp_stream_wait_stream: s (%s) and t (%s) belong to different backends", s->b->name,
                   t->b->name);
  if (s == t) return 0;  /* stream order already covers it */
  dp_event_t *e;
  int rc = dp_event_new(t->b, t->dev, &e, err);
  if (rc) return dp__named_dev("dp_stream_wait_stream", s->dev, rc, err);
  if ((rc = dp_event_record(e, t, err)) == 0) rc = s->b->ops->stream_wait(s->b, s->h, e->h, err);
  dp_event_free(e);  /* the wait holds what it needs (CUDA and host alike) */
  return dp__named_dev("dp_stream_wait_stream", s->dev, rc, err);
}

int dp_device_synchronize(dp_backend_t *b, dp_device_t dev, dp_error_t *err) {
  int rc = dp__check_device("dp_device_synchronize", b, dev, err);
  return rc ? rc : dp__named_dev("dp_device_synchronize", dev, b->ops->device_sync(b, dev.index, err), err);
}

/* ---- current stream ---- */

int dp_current_stream(dp_backend_t *b, dp_device_t dev, dp_stream_t **out, dp_error_t *err) {
  int rc = dp__check_device("dp_current_stream", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_current_stream: NULL out");
  tls_catch_up();
  dp_stream_t *cur = tls_current[slot_of(dev)];  /* dev is b's: its type exists */
  if (cur) {
    *out = cur;
    return 0;
  }
  dp_stream_provider_cb fn = dp__load_acquire(&provider_fn);
  if (fn) {
    /* A provider that looks up the current stream of the device it is
       asked about (here, or through a call that does: dp_cache_alloc with
       no stream, dp_future_wait) would ask itself again, without end: the
       stack overflowed. */
    int i = slot_of(dev);
    if (tls_asking[i]) {
      char d[16];
      return dp__err(err, DP_EMISUSE,
                     "dp_current_stream(%s): called while the stream provider is asked for that device: it would "
                     "ask itself again",
                     dp_device_format(dev, d, sizeof d));
    }
    tls_asking[i] = 1;
    dp_stream_t *s = fn(dp__load_acquire(&provider_ud), b, dev);
    tls_asking[i] = 0;
    if (s) {
      /* Checked here, where the provider can be named: a stream of another
       * device failed later as an event "recorded on a stream of another
       * device" or a cache's refusal, naming neither. */
      if (DP_UNLIKELY(s->b != b || !dp_device_equal(s->dev, dev))) {
        char want[16], got[16];
        return dp__err(err, DP_EINVAL, "dp_current_stream(%s): the stream provider returned a stream of %s%s",
                       dp_device_format(dev, want, sizeof want), dp_device_format(s->dev, got, sizeof got),
                       s->b != b ? " of another backend" : "");
      }
      *out = s;
      return 0;
    }
  }
  return stream_default(b, dev, out, err);
}

int dp_set_current_stream(dp_stream_t *s, dp_stream_t **prev, dp_error_t *err) {
  if (prev) *prev = NULL;
  if (!s) return dp__err(err, DP_EINVAL, "dp_set_current_stream: NULL stream");
  tls_catch_up();
  int i = slot_of(s->dev);
  if (!tls_current[i] && tls_caller_count == DP_CURRENT_STREAM_SLOTS) {
    char buf[16];
    return dp__err(err, DP_ELIMIT, "dp_set_current_stream(%s): this thread already holds current streams for %d devices",
                   dp_device_format(s->dev, buf, sizeof buf), DP_CURRENT_STREAM_SLOTS);
  }
  if (frame_log(i) != 0) {
    char buf[16];
    return dp__err(err, DP_ENOMEM,
                   "dp_set_current_stream(%s): out of memory remembering the thread's current stream, to put back "
                   "when the then() callback returns",
                   dp_device_format(s->dev, buf, sizeof buf));
  }
  if (!tls_current[i]) {
    tls_owner[i] = OWN_CALLER;
    tls_caller_count++;
  }
  /* replacing a then() callback's stream keeps it the library's: it goes
     when the callback returns */
  if (prev) *prev = tls_current[i];
  tls_current[i] = s;
  return 0;
}

void dp_reset_current_stream(dp_backend_t *b, dp_device_t dev) {
  (void)b;
  tls_catch_up();
  int i = slot_of(dev);
  if (i < 0 || !tls_current[i]) return;
  /* without memory to log it, reset all the same: the thread then has the
     default stream after the callback, never a stream it did not choose */
  (void)frame_log(i);
  slot_clear(i);
}

void dp__current_frame_begin(dp__current_frame_t *fr) {
  fr->outer = tls_frame;
  fr->depth = tls_frame ? tls_frame->depth + 1 : 1;
  fr->n = 0;
  fr->cap = DP__FRAME_LOG_INLINE;
  fr->log = fr->inl;
  tls_frame = fr;
}

void dp__current_frame_end(dp__current_frame_t *fr) {
  for (size_t k = fr->n; k-- > 0;) {
    const dp__current_log_t *l = &fr->log[k];
    slot_restore(l->slot, l->s, l->owner, l->mark);
  }
  dp__free_inl(fr->log, fr->cap, sizeof *fr->log, fr->inl);
  tls_frame = fr->outer;
}

void dp__current_stream_enter(dp_stream_t *s, dp__current_saved_t *saved) {
  tls_catch_up();
  int i = slot_of(s->dev);
  saved->s = tls_current[i];
  saved->owner = tls_owner[i];
  saved->mark = tls_mark[i];
  saved->outer = tls_saved;
  tls_saved = saved;
  if (!tls_current[i]) tls_owner[i] = OWN_LIBRARY;
  tls_current[i] = s;
  tls_mark[i] = tls_frame ? tls_frame->depth : 0; /* the callback's changes here are put back below */
}

void dp__current_stream_leave(dp_device_t dev, const dp__current_saved_t *saved) {
  int i = slot_of(dev);
  /* the callback may have set or reset it meanwhile: counted as it was */
  slot_restore(i, saved->s, saved->owner, saved->mark);
  tls_saved = saved->outer;  /* left in the reverse order of entering: saved is the innermost */
}

void dp_set_stream_provider(dp_stream_provider_cb fn, void *ud) {
  /* ud first: a thread that sees the new fn (acquire) sees its ud */
  dp__store_release(&provider_ud, ud);
  dp__store_release(&provider_fn, fn);
}

/* ---- events ---- */

int dp_event_new(dp_backend_t *b, dp_device_t dev, dp_event_t **out, dp_error_t *err) {
  int rc = dp__check_device("dp_event_new", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_event_new: NULL out");
  dp__devstate_t *ds = &b->devs[dev.index];
  pthread_mutex_lock(&ds->mu);
  dp_event_t *e = ds->free_events;
  if (e) {
    ds->free_events = e->next_free;
    dp__store_relaxed(&e->pooled, 0);  /* handed out: the owner frees it once */
  }
  pthread_mutex_unlock(&ds->mu);
  if (e && !e->h && (rc = b->ops->event_create(b, dev.index, &e->h, err)) != 0) {
    e->h = NULL;
    dp__store_relaxed(&e->pooled, 1); /* back in the pool, still without a handle */
    pthread_mutex_lock(&ds->mu);
    e->next_free = ds->free_events;
    ds->free_events = e;
    pthread_mutex_unlock(&ds->mu);
    return dp__named_dev("dp_event_new", dev, rc, err);
  }
  if (!e) {
    e = dp__alloc(sizeof *e);
    if (!e) return dp__named_dev("dp_event_new", dev, dp__err(err, DP_ENOMEM, "out of memory creating an event"), err);
    if ((rc = b->ops->event_create(b, dev.index, &e->h, err)) != 0) {
      dp__free(e, sizeof *e);
      return dp__named_dev("dp_event_new", dev, rc, err);
    }
    e->b = b;
    e->dev = dev;
    dp__atomic_init(&e->pooled, 0);
  }
  *out = e;
  return 0;
}

void dp_event_free(dp_event_t *e) {
  /* Freed twice, it would be on the list twice: dp_event_new would hand it
   * to two owners (whose records replace each other's), and shutdown would
   * destroy it twice. The flag catches a second free until the pool hands
   * the event out again, from any thread (an atomic exchange, not the
   * lock: the reset must come before the event is on the list). */
  if (!e || dp__fetch_or_acq_rel(&e->pooled, 1)) return;
  /* a handle that could not be made afresh is dropped (NULL): the pool
     makes one when it hands the event out again */
  if (e->b->ops->event_reset && e->b->ops->event_reset(e->b, e->dev.index, &e->h) != 0) e->h = NULL;
  dp__devstate_t *ds = &e->b->devs[e->dev.index];
  pthread_mutex_lock(&ds->mu);
  e->next_free = ds->free_events;
  ds->free_events = e;
  pthread_mutex_unlock(&ds->mu);
}

int dp_event_record(dp_event_t *e, dp_stream_t *s, dp_error_t *err) {
  if (!e || !s) return dp__err(err, DP_EINVAL, "dp_event_record: NULL %s", !e ? "event" : "stream");
  if (s->b != e->b || !dp_device_equal(s->dev, e->dev)) {
    char ed[16], sd[16];
    return dp__err(err, DP_EINVAL, "dp_event_record: an event of %s is recorded on a stream of %s%s (of its own device only)",
                   dp_device_format(e->dev, ed, sizeof ed), dp_device_format(s->dev, sd, sizeof sd),
                   s->b != e->b ? " of another backend" : "");
  }
  return dp__named_dev("dp_event_record", e->dev, e->b->ops->event_record(e->b, e->h, s->h, err), err);
}

int dp_event_query(dp_event_t *e, dp_error_t *err) {
  if (!e) return dp__err(err, DP_EINVAL, "dp_event_query: NULL event");
  return dp__named_dev("dp_event_query", e->dev, e->b->ops->event_query(e->b, e->h, err), err);
}

int dp_event_synchronize(dp_event_t *e, dp_error_t *err) {
  if (!e) return dp__err(err, DP_EINVAL, "dp_event_synchronize: NULL event");
  return dp__named_dev("dp_event_synchronize", e->dev, e->b->ops->event_sync(e->b, e->h, err), err);
}

dp_device_t dp_event_device(const dp_event_t *e) { return e ? e->dev : no_device; }

int dp__event_waits_for_itself(const dp_event_t *e, const char *fn, dp_error_t *err) {
  return e && e->b->type == DP_DEVICE_HOST ? dp__host_event_waits_for_itself(e->h, fn, err) : 0;
}

/* ---- memory ---- */

int dp_device_alloc(dp_backend_t *b, dp_device_t dev, size_t nbytes, void **out, dp_error_t *err) {
  int rc = dp__check_device("dp_device_alloc", b, dev, err);
  if (rc) return rc;
  if (!out) return dp__err(err, DP_EINVAL, "dp_device_alloc: NULL out");
  return dp__named_dev("dp_device_alloc", dev, b->ops->malloc(b, dev.index, nbytes, out, err), err);
}

int dp_device_dealloc(dp_backend_t *b, dp_device_t dev, void *p, dp_error_t *err) {
  int rc = dp__check_device("dp_device_dealloc", b, dev, err);
  if (rc == 0 && p) rc = dp__named_dev("dp_device_dealloc", dev, b->ops->free(b, dev.index, p, err), err);
  return rc;
}

int dp_pointer_device(dp_backend_t *b, const void *p, dp_device_t *out, dp_error_t *err) {
  if (!b || !out) return dp__err(err, DP_EINVAL, "dp_pointer_device: NULL %s", !b ? "backend" : "out");
  int dev, rc = b->ops->pointer_device(b, p, &dev);
  if (rc == DP_ENOTFOUND) return dp__err(err, rc, "dp_pointer_device(%p): not memory of the %s backend", p, b->name);
  if (rc) return rc;
  *out = dp_backend_device(b, dev);
  return 0;
}

int dp__pinned_alloc(dp_backend_t *b, size_t n, void **out, dp_error_t *err) {
  if (!b || !out || !n) return dp__err(err, DP_EINVAL, "pinned allocation: NULL backend or out, or 0 bytes");
  return b->ops->pinned_alloc(b, n, out, err);
}

void dp__pinned_free(dp_backend_t *b, void *p, size_t n) {
  if (b && p) b->ops->pinned_free(b, p, n);
}

int dp__pinned_register(dp_backend_t *b, void *p, size_t n, int readonly, dp_error_t *err) {
  if (!b || !p || !n) return dp__err(err, DP_EINVAL, "pinned register: NULL backend or memory, or 0 bytes");
  return b->ops->pinned_register(b, p, n, readonly, err);
}

void dp__pinned_unregister(dp_backend_t *b, void *p) {
  if (b && p) b->ops->pinned_unregister(b, p);
}

int dp_memcpy_async(dp_stream_t *s, void *dst, const void *src, size_t n, dp_error_t *err) {
  if (!s || (n && (!dst || !src)))
    return dp__err(err, DP_EINVAL, "dp_memcpy_async: NULL %s", !s ? "stream" : !dst ? "dst" : "src");
  if (n == 0) return 0;  /* nothing to order: no work is queued (and no memmove sees NULL) */
  return dp__named_dev("dp_memcpy_async", s->dev, s->b->ops->memcpy_async(s->b, s->h, dst, src, n, err), err);
}

int dp_device_read(void *ud, dp_device_t device, const void *src, size_t nbytes, void *dst, dp_error_t *err) {
  if (nbytes && (!src || !dst)) return dp__err(err, DP_EINVAL, "dp_device_read: NULL %s", !src ? "src" : "dst");
  if (device.type == DP_DEVICE_CPU) { /* this process's memory: no backend, no stream */
    if (nbytes) memcpy(dst, src, nbytes);
    return 0;
  }
  dp_backend_t *b = ud;
  int rc = b ? 0 : dp_backend_get(device.type, &b, err);
  if (rc) return rc;
  rc = dp__check_device("dp_device_read", b, device, err);
  if (rc || !nbytes) return rc;
  dp_stream_t *s;
  if ((rc = dp_current_stream(b, device, &s, err)) != 0) return rc;
  /* In a host function, a stream whose synchronize would wait for the
     function itself (its own, or one waiting for work queued on it after
     the function) is refused before the copy is queued: refused after, the
     copy still ran once the function had returned, into a dst the caller
     took as untouched (a buffer of the function's frame, gone by then). */
  if (dp__host_fn_stream && b->type == DP_DEVICE_HOST &&
      (rc = dp__host_stream_waits_for_itself(b, s->h, "dp_device_read", err)) != 0) {
    if (rc < 0) return dp__named_dev("dp_device_read", device, rc, err);
    char d[16];
    return dp__err(err, DP_EMISUSE,
                   "dp_device_read(%s): called from a host function, on a stream whose synchronize would wait for the "
                   "function itself (%s): nothing copied",
                   dp_device_format(device, d, sizeof d),
                   rc == 1 ? "its own stream" : "the stream waits for work queued on the function's stream after it");
  }
  /* after the work queued on the current stream so far, as a consumer of
     the memory on this thread would read it; then waited for */
  if ((rc = dp_memcpy_async(s, dst, src, nbytes, err)) != 0) return rc;
  return dp_stream_synchronize(s, err);
}
