/* value/gc.c — freeing values: leaves and storages at once, containers and
 * cycles by reference counting and a cycle collector.
 *
 * Reference counting frees acyclic garbage at once. For cycles we use the
 * trial deletion of Bacon & Rajan ("Concurrent Cycle Collection in Reference
 * Counted Systems", 2001): a container whose count a release leaves above
 * zero becomes a candidate; a collection subtracts, for every container
 * reachable from the candidates, the references that come from inside that
 * subgraph. Containers left with a positive count are held from outside, and
 * so is everything they reach; the rest is garbage held only by itself.
 *
 * Hot path: no lock, no shared write. A release by the only holder (count 1,
 * not a candidate) frees the container on this thread. A release that leaves
 * the count above zero records the container in this thread's candidate
 * buffer (GC_BUF entries in thread-local storage; more, allocated, only
 * after a trial that walked much of a live value: see buffer_full) and
 * decrements. A candidate released to zero by the thread that buffered it
 * leaves the buffer and is freed at once: the usual "held by a future and by
 * the caller, both let go" costs no collection at all. Frees cascade through
 * thread-local lists (gc_next), so a chain of a million containers frees
 * without recursion, and a custom's destroy or a storage's release callback
 * that releases values only queues work for the outermost release.
 *
 * Collection: when a thread's buffer is full, when it calls
 * dp_value_collect(), or when it exits (a thread-specific destructor), its
 * candidates are tried together, under the one collector lock. Collections
 * are thus serialized, but run once per GC_BUF candidates at most, off the
 * hot path.
 *
 * Soundness against concurrent releases. A trial reads reference counts one
 * by one while other threads retain and release. Two rules keep it sound:
 *
 *  - A decrement that leaves a count above zero first checks `collecting`
 *    (after a seq_cst fence) and waits for a running collection to end. A
 *    thread that retained b (through a) and then drops a is thus either seen
 *    by the trial with its retain of b counted (Dekker's argument: the
 *    collector stores `collecting`, fences, then reads counts), or its drop
 *    of a waits: the trial cannot find a and b garbage while the thread
 *    holds b. A decrement that races past the check is a candidate on its
 *    own thread and is tried again later.
 *  - A candidate holds no reference, so it may die while buffered. Its
 *    state word (gc_state, atomic) says whether it is buffered, and
 *    gc_owner by which thread; GCS_BUFFERED is only ever set by a CAS from
 *    0, so a container is in one buffer at most. A thread releasing a
 *    container buffered by another thread does it under the collector lock;
 *    at zero, or when a trial finds such a container garbage, the container
 *    leaves the owner's buffer there and then (under the owner's buffer
 *    lock, which the owner takes only around its own short buffer updates)
 *    and is freed by that thread, memory included: nothing waits for the
 *    owner, which may idle. Holding the collector lock keeps the owner from
 *    collecting or exiting meanwhile, so its buffer is there.
 *
 * A trial visits containers buffered by other threads like any other, so a
 * cycle whose candidates sit in several buffers is still found.
 */
#include <pthread.h>
#include <string.h>

#include "gc.h"

/* ---- leaves: freed at once when their count reaches zero ----
 *
 * A custom's destroy and a storage's release callback are the user's code,
 * which may release further values — the next link of a chain of customs,
 * a tensor held by the storage's owner. Called from inside one another they
 * would recurse once a link (a chain of a million customs overflowed the
 * stack), so each thread queues them while one runs and the outermost runs
 * the queue. */

static _Thread_local struct {
  int running;              /* a destroy or release callback is running on this thread */
  dp_custom_t *customs;     /* via next_dead: count zero, destroy to run */
  dp_storage_t *storages;   /* via next_dead: count zero, release to run */
} leaf_q;

static void storage_free(dp_storage_t *s) {
  if (s->release) s->release(s->ud, s->device, s->base, s->nbytes);
  dp__free(s->host_data, s->nbytes ? s->nbytes : 1);
  dp__free(s, sizeof *s);
}

static void custom_free(dp_custom_t *c) {
  const dp_type_t *type = c->type;
  void *obj = c->obj;
  dp__free(c, sizeof *c);
  type->destroy(obj); /* queued only with one (free_leaf) */
}

static void run_leaf_queue(void) {
  if (leaf_q.running) return; /* the outermost runs it */
  leaf_q.running = 1;
  for (;;) {
    if (leaf_q.customs) {
      dp_custom_t *c = leaf_q.customs;
      leaf_q.customs = c->next_dead;
      custom_free(c);
    } else if (leaf_q.storages) {
      dp_storage_t *s = leaf_q.storages;
      leaf_q.storages = s->next_dead;
      storage_free(s);
    } else {
      break;
    }
  }
  leaf_q.running = 0;
}

void dp_storage_release(dp_storage_t *s) {
  if (!s || !dp__ref_dec(&s->rc)) return;
  if (!s->release) { /* no user code: nothing can recurse */
    storage_free(s);
    return;
  }
  s->next_dead = leaf_q.storages;
  leaf_q.storages = s;
  run_leaf_queue();
}

/* Frees a non-container heap value whose count reached zero. */
static void free_leaf(dp_heap_t *h) {
  switch (h->kind) {
    case DP_STR:
    case DP_BYTES: {
      dp_strobj_t *s = (dp_strobj_t *)h;
      dp__free(s, sizeof *s + s->len + 1);
      break;
    }
    case DP_TENSOR: {
      dp_tensor_t *t = (dp_tensor_t *)h;
      dp_storage_t *st = t->storage;
      dp__free(t, sizeof *t + 2 * (size_t)t->ndim * sizeof(int64_t));
      dp_storage_release(st);
      break;
    }
    case DP_CUSTOM: {
      dp_custom_t *c = (dp_custom_t *)h;
      if (!c->type->destroy) {
        dp__free(c, sizeof *c);
        break;
      }
      c->next_dead = leaf_q.customs;
      leaf_q.customs = c;
      run_leaf_queue();
      break;
    }
    default:
      break;
  }
}

void dp__release_leaf(dp_heap_t *h) {
  if (dp__ref_dec(&h->rc)) free_leaf(h);
}

/* Candidates held in thread-local storage. A buffer whose last trial met many
 * live containers grows before it is collected again (see buffer_full). */
#define GC_BUF 256
/* The most candidates one buffer holds: a slot index fits in gc_state. */
#define GC_BUF_MAX ((size_t)1 << 24)
#define NO_SLOT SIZE_MAX

enum {
  GCS_BUFFERED = 1u,  /* in some thread's candidate buffer (gc_owner) */
  GCS_GARBAGE = 8u,   /* trial garbage: children being released */
  GCS_FLAGS = 0xffu,  /* the bits above hold the slot, while GCS_BUFFERED */
  GCS_SLOT_SHIFT = 8,
};

typedef struct gc_tls {
  dp_cont_t *inl[GC_BUF];  /* candidates (no reference held), while big is NULL */
  dp_cont_t **big;         /* a larger array of big_cap candidates, or NULL */
  size_t big_cap;
  size_t threshold;        /* collect once this many are buffered (0: GC_BUF) */
  _Atomic size_t n;        /* relaxed: changed under buf_lock, read anywhere by
                              the owner (a removal may shrink it meanwhile) */
  dp__spin_t buf_lock;     /* buf and n: the owner's changes, and another
                              thread's removal of a dead entry (under gc_lock) */
  dp_cont_t *dead;         /* via gc_next: count zero, children to release */
  dp_cont_t *freed;        /* via gc_next: children released, memory pending */
  int depth;               /* releases in progress on this thread */
  int armed;               /* the thread-exit flush is registered */
} gc_tls_t;

static _Thread_local gc_tls_t tls;

static size_t len_of(gc_tls_t *t) { return dp__load_relaxed(&t->n); }
/* The candidates: under buf_lock, or by the owner (only it swaps arrays). */
static dp_cont_t **buf_of(gc_tls_t *t) { return t->big ? t->big : t->inl; }
static size_t cap_of(const gc_tls_t *t) { return t->big ? t->big_cap : GC_BUF; }
static void set_len(gc_tls_t *t, size_t n) { dp__store_relaxed(&t->n, n); }
static pthread_mutex_t gc_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int collecting;
static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static uint32_t rc_of(dp_cont_t *c) { return dp__load_acquire(&c->h.rc); }
static uint32_t state_of(dp_cont_t *c) { return dp__load_acquire(&c->gc_state); }

static void release_ref(gc_tls_t *t, dp_cont_t *c);
static void drain(gc_tls_t *t);
static void collect_locked(gc_tls_t *t);
static void shrink_if_empty(gc_tls_t *t);

void (*dp__gc_pause_hook)(int where);
_Thread_local uint64_t dp__gc_items_walked;

/* ---- thread exit: the buffer is collected ---- */

/* Collects this thread's candidates, and those that freeing the garbage
 * made (a custom's destroy may release a cycle), until none is left. */
static void collect_all_mine(gc_tls_t *t) {
  t->depth++;
  do {
    if (len_of(t)) {
      pthread_mutex_lock(&gc_lock);
      collect_locked(t);
      pthread_mutex_unlock(&gc_lock);
    }
    if (t->depth == 1) drain(t);
  } while (len_of(t) && t->depth == 1);
  shrink_if_empty(t);
  t->depth--;
}

static void exit_flush(void *p) {
  gc_tls_t *t = p;
  t->armed = 0;
  collect_all_mine(t);
}

static void make_exit_key(void) { pthread_key_create(&exit_key, exit_flush); }

static void arm_exit(gc_tls_t *t) {
  if (t->armed) return;
  pthread_once(&exit_once, make_exit_key);
  t->armed = pthread_setspecific(exit_key, t) == 0;
}

/* ---- freeing ---- */

static void push_dead(gc_tls_t *t, dp_cont_t *c) {
  c->gc_next = t->dead;
  t->dead = c;
}

/* Drops one reference held by a dying container. Children found garbage by
 * the same trial are freed with it. */
static void drop_child(gc_tls_t *t, dp_value_t v) {
  if (!dp_value_is_heap(v)) return;
  if (!dp__is_container_kind(v.kind)) {
    dp__release_leaf(v.u.h);
    return;
  }
  dp_cont_t *k = (dp_cont_t *)v.u.h;
  if (state_of(k) & GCS_GARBAGE) return;
  release_ref(t, k);
}

/* Releases what a dead container holds and frees its arrays; the container's
 * own memory waits for the end of the drain (a later dead container may
 * still look at its state). */
static void release_children(gc_tls_t *t, dp_cont_t *c) {
  switch (c->h.kind) {
    case DP_LIST:
    case DP_TUPLE: {
      dp_seq_t *s = (dp_seq_t *)c;
      for (size_t i = 0; i < s->len; i++) drop_child(t, s->items[i]);
      if (c->h.kind == DP_LIST) { /* a tuple's items are inline; its cap is its key word */
        dp__free_inl(s->items, s->cap, sizeof(dp_value_t), s->inl);
        s->cap = 0;
      }
      s->items = NULL;
      s->len = 0;
      break;
    }
    case DP_DICT: {
      dp_dict_t *d = (dp_dict_t *)c;
      for (size_t i = 0; i < d->len; i++) {
        drop_child(t, d->entries[i].key);
        drop_child(t, d->entries[i].val);
      }
      dp__free_inl(d->entries, d->cap, sizeof(dp_entry_t), d->inl);
      dp__free(d->index, d->index_cap * sizeof(uint32_t));
      d->entries = NULL;
      d->index = NULL;
      d->len = d->cap = d->index_cap = 0;
      break;
    }
    case DP_OBJECT: {
      dp_object_t *o = (dp_object_t *)c;
      for (size_t i = 0; i < o->len; i++) {
        if (o->attrs[i].name_len >= DP_ATTR_INLINE) dp__free(o->attrs[i].n.heap, o->attrs[i].name_len + 1);
        drop_child(t, o->attrs[i].val);
      }
      dp__free_inl(o->attrs, o->cap, sizeof(dp_attr_t), o->inl);
      dp__free(o->index, o->index_cap * sizeof(uint32_t));
      o->attrs = NULL;
      o->index = NULL;
      o->len = o->cap = o->index_cap = 0;
      break;
    }
  }
}

static size_t cont_size(const dp_cont_t *c) {
  switch (c->h.kind) {
    case DP_DICT: return sizeof(dp_dict_t) + ((const dp_dict_t *)c)->inl_cap * sizeof(dp_entry_t);
    case DP_OBJECT: return dp__object_size(((const dp_object_t *)c)->inl_cap, ((const dp_object_t *)c)->class_len);
    default: return sizeof(dp_seq_t) + ((const dp_seq_t *)c)->inl_cap * sizeof(dp_value_t);
  }
}

static void drain(gc_tls_t *t) {
  while (t->dead) {
    dp_cont_t *c = t->dead;
    t->dead = c->gc_next;
    release_children(t, c);
    c->gc_next = t->freed;
    t->freed = c;
  }
  while (t->freed) {
    dp_cont_t *c = t->freed;
    t->freed = c->gc_next;
    dp__free(c, cont_size(c));
  }
}

/* ---- the candidate buffer ---- */

/* Records slot i in c's state (its flags kept). Under the buffer's lock. */
static void set_slot(dp_cont_t *c, size_t i) {
  uint32_t st = state_of(c);
  while (!dp__cas_acq_rel(&c->gc_state, &st, (st & GCS_FLAGS) | (uint32_t)(i << GCS_SLOT_SHIFT))) {
  }
}

/* Index of c in t's buffer, or NO_SLOT (c is another thread's candidate, or
 * none); under the buffer's lock. Its state names its slot — set under that
 * lock by buffer() and unbuffer_at(), kept by every other change of the
 * state while it is buffered — so this costs the same whatever the buffer
 * holds: no scan (a grown buffer scanned at every release of another
 * thread's candidate would make releases quadratic). */
static size_t own_slot(gc_tls_t *t, const dp_cont_t *c) {
  size_t i = state_of((dp_cont_t *)c) >> GCS_SLOT_SHIFT;
  return i < len_of(t) && buf_of(t)[i] == c ? i : NO_SLOT;
}

static void unbuffer_at(gc_tls_t *t, size_t i) {
  dp_cont_t **b = buf_of(t);
  size_t n = len_of(t) - 1;
  b[i] = b[n];
  if (i != n) set_slot(b[i], i);
  set_len(t, n);
}

/* The buffer lock: held for a few stores or one scan of the buffer, never
 * while waiting for anything else. Uncontended but for a removal by
 * another thread. */
static void buf_lock(gc_tls_t *t) {
  while (!dp__spin_trylock(&t->buf_lock)) {
  }
}
static void buf_unlock(gc_tls_t *t) { dp__spin_unlock(&t->buf_lock); }

/* Appends c, whose GCS_BUFFERED this thread has just claimed. */
static void buffer(gc_tls_t *t, dp_cont_t *c) {
  c->gc_owner = t;
  buf_lock(t);
  size_t n = len_of(t);
  buf_of(t)[n] = c;
  set_slot(c, n);
  set_len(t, n + 1);
  buf_unlock(t);
  arm_exit(t);
}

/* Whether the buffer must be collected before it takes one more candidate.
 * A trial visits everything the candidates reach: were it run every GC_BUF
 * candidates, candidates that reach one large live value (the items of a
 * list shared by a million others, let go one by one) would walk that value
 * again and again, time quadratic in its size. So a buffer holds, before
 * its next trial, as many candidates as its last trial took steps over live
 * containers — one per container and one per child, leaves included —: the
 * live part of each trial is paid for by the releases that buffered the
 * candidates since the one before, and the garbage by its freeing. Counting
 * live containers alone left a live list of leaves unpaid: holders of a
 * million-int list among garbage candidates had it walked every 256. The larger array is allocated here (failing that, the buffer is
 * collected as it is) and freed by the next collection. */
static bool buffer_full(gc_tls_t *t) {
  size_t n = len_of(t), cap = cap_of(t);
  if (n < cap) return false;
  /* threshold is at most GC_BUF_MAX (collect_locked), so cap stays within it */
  if (cap >= (t->threshold > GC_BUF ? t->threshold : GC_BUF)) return true;
  size_t ncap = cap * 2 < GC_BUF_MAX ? cap * 2 : GC_BUF_MAX;
  dp_cont_t **nb = dp__alloc(ncap * sizeof *nb), **old = t->big;
  if (!nb) return true;
  buf_lock(t);  /* another thread may remove an entry meanwhile */
  memcpy(nb, buf_of(t), len_of(t) * sizeof *nb);
  t->big = nb;
  t->big_cap = ncap;
  buf_unlock(t);
  if (old) dp__free(old, cap * sizeof *old);
  return false;
}

/* The grown array goes back once the buffer is empty (its candidates
 * died or were tried). Only the owner swaps arrays; another thread that
 * removes an entry does so under the lock, so it never holds the old one. */
static void shrink_if_empty(gc_tls_t *t) {
  if (!t->big || len_of(t)) return;
  dp_cont_t **old = t->big;
  size_t cap = t->big_cap;
  buf_lock(t);
  t->big = NULL;
  t->big_cap = 0;
  buf_unlock(t);
  dp__free(old, cap * sizeof *old);
}

/* This thread's candidate c, released to zero here, leaves the buffer (its
 * slot may have moved: another thread may have removed an entry). Its state
 * is left as it is: nothing holds a dead container, so nothing reads it
 * before it is freed. */
static void unbuffer_own(gc_tls_t *t, dp_cont_t *c) {
  buf_lock(t);
  size_t i = own_slot(t, c);
  if (i != NO_SLOT) unbuffer_at(t, i);
  buf_unlock(t);
  shrink_if_empty(t);
}

/* A dead container still buffered by another thread leaves that buffer, so
 * that its memory goes back now, whatever the owner is doing. Under gc_lock:
 * the owner neither collects (which clears GCS_BUFFERED) nor exits (its
 * exit collects) meanwhile, so its buffer is there. */
static void unbuffer_foreign(dp_cont_t *c) {
  gc_tls_t *o = c->gc_owner;
  buf_lock(o);
  size_t i = own_slot(o, c);
  if (i != NO_SLOT) unbuffer_at(o, i);
  buf_unlock(o);
  dp__fetch_and_acq_rel(&c->gc_state, (uint32_t)GCS_FLAGS & ~(uint32_t)GCS_BUFFERED);
}

/* Waits while a collection runs (see the header comment). */
static void wait_not_collecting(void) {
  dp__fence_seq_cst();
  while (dp__load_relaxed(&collecting)) {
    pthread_mutex_lock(&gc_lock);
    pthread_mutex_unlock(&gc_lock);
    dp__fence_seq_cst();
  }
}

/* Gives back one reference to c, held by this thread. */
/* Claims c's buffered flag by a CAS (so that a container is never in two
 * buffers), buffers it here and drops the reference; false, doing nothing,
 * when another thread claimed it first. */
static bool claim_and_release(gc_tls_t *t, dp_cont_t *c) {
  uint32_t expect = 0;
  if (!dp__cas_acq_rel(&c->gc_state, &expect, GCS_BUFFERED))
    return false;
  buffer(t, c);
  if (dp__ref_dec(&c->h.rc)) {
    unbuffer_own(t, c);
    push_dead(t, c);
  }
  return true;
}

static void release_ref(gc_tls_t *t, dp_cont_t *c) {
  /* The count first: a thread that buffered c did so before its decrement,
   * so a count of 1 read here (acquire) comes with that thread's state. */
  uint32_t rc = rc_of(c), st = state_of(c);
  if ((st & GCS_FLAGS) == 0) {
    /* The only holder: nobody else can reach it, no trial counts it. */
    if (rc == 1) {
      push_dead(t, c);
      return;
    }
    wait_not_collecting();
    if (buffer_full(t)) {
      pthread_mutex_lock(&gc_lock);
      collect_locked(t);
      pthread_mutex_unlock(&gc_lock);
    }
    if (claim_and_release(t, c)) return;
    /* another thread buffered it meanwhile */
  } else {
    wait_not_collecting();
  }
  buf_lock(t);
  size_t i = own_slot(t, c);
  if (i != NO_SLOT) {
    /* In this thread's buffer: its next collection comes after this. */
    if (dp__ref_dec(&c->h.rc)) { /* dead: its state is read no more */
      unbuffer_at(t, i);
      buf_unlock(t);
      shrink_if_empty(t);
      push_dead(t, c);
      return;
    }
    buf_unlock(t);
    return;
  }
  buf_unlock(t);
  /* Buffered by another thread: decrement under the lock, so that its owner
   * neither collects meanwhile nor loses the container. */
  if (dp__gc_pause_hook) dp__gc_pause_hook(DP_GC_PAUSE_FOREIGN);
  pthread_mutex_lock(&gc_lock);
  st = state_of(c);
  if (!(st & GCS_BUFFERED)) {
    /* The owner let go of it: a candidate of ours now, unless a thread on the
     * lock-free path above buffers it first (the lock does not stop that):
     * the flag is claimed by a CAS, as there, so that a container is never in
     * two buffers; on failure it is buffered elsewhere after all. */
    if (dp__gc_pause_hook) dp__gc_pause_hook(DP_GC_PAUSE_OWNER_LET_GO);
    if (buffer_full(t)) collect_locked(t);
    if (claim_and_release(t, c)) {
      pthread_mutex_unlock(&gc_lock);
      return;
    }
  }
  if (dp__ref_dec(&c->h.rc)) {
    /* Dead: it leaves the owner's buffer and is freed here and now, header
     * included (a value's storages, and its memory, must not wait for
     * another thread, which may idle). */
    unbuffer_foreign(c);
    push_dead(t, c);
  }
  pthread_mutex_unlock(&gc_lock);
}

/* ---- the trial ---- */

/* For each container child K of c, runs BODY; adds the children looked at
 * (leaves too) to WALKED. */
#define FOR_EACH_CONTAINER_CHILD(c, K, WALKED, BODY)                               \
  do {                                                                             \
    dp_value_t *vals_ = NULL;                                                      \
    size_t n_ = 0, stride_ = 1;                                                    \
    switch ((c)->h.kind) {                                                         \
      case DP_LIST:                                                                \
      case DP_TUPLE:                                                               \
        vals_ = ((dp_seq_t *)(c))->items;                                          \
        n_ = ((dp_seq_t *)(c))->len;                                               \
        break;                                                                     \
      case DP_DICT:                                                                \
        n_ = ((dp_dict_t *)(c))->len * 2;                                          \
        stride_ = 0; /* handled below */                                           \
        break;                                                                     \
      case DP_OBJECT:                                                              \
        n_ = ((dp_object_t *)(c))->len;                                            \
        stride_ = 2;                                                               \
        break;                                                                     \
    }                                                                              \
    (WALKED) += n_;                                                                \
    for (size_t i_ = 0; i_ < n_; i_++) {                                           \
      dp_value_t v_;                                                               \
      if (stride_ == 1) v_ = vals_[i_];                                            \
      else if (stride_ == 0) {                                                     \
        dp_entry_t *e_ = &((dp_dict_t *)(c))->entries[i_ / 2];                     \
        v_ = (i_ & 1) ? e_->val : e_->key;                                         \
      } else v_ = ((dp_object_t *)(c))->attrs[i_].val;                             \
      if (!dp__is_container_kind(v_.kind)) continue;                               \
      dp_cont_t *K = (dp_cont_t *)v_.u.h;                                          \
      BODY                                                                         \
    }                                                                              \
  } while (0)

/* Trial deletion over everything reachable from this thread's candidates;
 * empties the buffer, queues the garbage on t->dead. Under gc_lock. */
static void collect_locked(gc_tls_t *t) {
  size_t n = len_of(t);
  set_len(t, 0);
  if (!n) return;
  dp__store_seq_cst(&collecting, 1);
  dp__fence_seq_cst();

  /* The candidates start the visit list (gc_next2), counted from their real
   * reference counts. All are alive: a candidate that dies (released to
   * zero, or garbage of another thread's trial) leaves the buffer then. */
  dp_cont_t *visit = NULL, *tail = NULL;
  dp_cont_t **buf = buf_of(t);
  size_t walked = 0;
  for (size_t i = 0; i < n; i++) {
    dp_cont_t *c = buf[i];
    c->h.color = DP_GC_GRAY;
    c->gc_refs = rc_of(c);
    c->gc_next2 = NULL;
    if (tail) tail->gc_next2 = c; else visit = c;
    tail = c;
  }

  /* Breadth-first: subtract internal references. A count read after a
   * racing decrement may go below the internal references: it wraps and
   * reads as held from outside, which only keeps nodes alive. */
  for (dp_cont_t *p = visit; p; p = p->gc_next2) {
    FOR_EACH_CONTAINER_CHILD(p, k, walked, {
      if (k->h.color != DP_GC_GRAY) {
        k->h.color = DP_GC_GRAY;
        k->gc_refs = rc_of(k);
        k->gc_next2 = NULL;
        tail->gc_next2 = k;
        tail = k;
      }
      k->gc_refs--;
    });
  }

  /* Held from outside: black, and everything it reaches (stack via gc_next).
   * live: what walking them cost, each container and its children (leaves
   * too: a live list of a million ints costs a million steps however few
   * containers it holds). */
  size_t live = 0;
  for (dp_cont_t *p = visit; p; p = p->gc_next2) {
    if (p->h.color != DP_GC_GRAY || p->gc_refs == 0) continue;
    p->h.color = DP_GC_BLACK;
    p->gc_next = NULL;
    dp_cont_t *stack = p;
    while (stack) {
      dp_cont_t *q = stack;
      stack = q->gc_next;
      size_t before = walked;
      FOR_EACH_CONTAINER_CHILD(q, k, walked, {
        if (k->h.color == DP_GC_GRAY) {
          k->h.color = DP_GC_BLACK;
          k->gc_next = stack;
          stack = k;
        }
      });
      live += 1 + (walked - before);
    }
  }

  /* Still gray: garbage. Marked before any of it is released; garbage that
   * another thread buffers leaves that buffer now (ours, below). */
  for (dp_cont_t *p = visit; p; p = p->gc_next2)
    if (p->h.color == DP_GC_GRAY &&
        (dp__fetch_or_acq_rel(&p->gc_state, GCS_GARBAGE) & GCS_BUFFERED) &&
        p->gc_owner != t)
      unbuffer_foreign(p);
  dp__store_release(&collecting, 0);

  /* Queue the garbage. The candidates are still buffered, which keeps
   * everything visited alive until the loop below. Live containers stay
   * black: to a trial only gray means visited, and none stays gray after
   * one, so black from an earlier trial reads as unvisited. */
  for (dp_cont_t *p = visit, *next; p; p = next) {
    next = p->gc_next2;
    p->gc_next2 = NULL;
    if (p->h.color == DP_GC_GRAY) {
      p->h.color = DP_GC_DEAD;
      push_dead(t, p);
    }
  }

  /* The candidates leave the buffer. Garbage is ours, header included. A
   * live one may be freed by another thread from here on: not touched
   * again. */
  for (size_t i = 0; i < n; i++) {
    dp_cont_t *c = buf[i];
    dp__store_release(&c->gc_state, c->h.color == DP_GC_DEAD ? GCS_GARBAGE : 0);
  }

  /* The next trial waits for as many candidates as this one took steps
   * over live containers and their children (buffer_full); the grown array
   * goes back now. */
  t->threshold = live < GC_BUF_MAX ? live : GC_BUF_MAX;
  dp__gc_items_walked += walked;
  shrink_if_empty(t);
}

/* ---- entry points ---- */

void dp_value_collect(void) { collect_all_mine(&tls); }

void dp__gc_release(dp_cont_t *c) {
  gc_tls_t *t = &tls;
  t->depth++;
  release_ref(t, c);
  if (t->depth == 1) drain(t);
  t->depth--;
}
