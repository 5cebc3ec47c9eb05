/* pickler/gc.c — freeing containers, cycles included.
 *
 * Reference counting frees acyclic garbage at once. For cycles we use the
 * synchronous trial deletion of Bacon & Rajan ("Concurrent Cycle Collection
 * in Reference Counted Systems", 2001): when a release leaves a container with
 * a non-zero count it becomes a candidate; at the end of the outermost release
 * the collector subtracts, for every container reachable from the candidates,
 * the references that come from inside that subgraph. Containers left with a
 * positive count are held from outside, and so is everything they reach; the
 * rest is garbage held only by itself and is freed.
 *
 * The collector allocates nothing: its lists are threaded through the
 * containers themselves (gc_next, gc_next2), so a release cannot fail and a
 * chain of a million containers frees without recursion.
 *
 * Budget. A release-time trial visits at most GC_BUDGET containers: a
 * candidate whose subgraph is larger (a big value still held elsewhere, say
 * by a future) is deferred instead, so that a release costs O(1) amortized
 * rather than O(its subgraph). Deferred candidates are collected together,
 * without a budget, when GC_DEFER_BATCH of them have accumulated or when
 * dp_value_collect() asks; those that die meanwhile simply leave the list.
 *
 * Concurrency. Every container release — the decrement included — runs under
 * one process-wide recursive lock. Retains stay lock-free. This is enough for
 * the trial counts to be sound: a thread can only add a reference into a
 * subgraph through a reference it already holds there, which keeps that
 * node's count above its internal in-degree for the whole collection, and it
 * cannot drop that reference until the collection releases the lock. The lock
 * is recursive because a custom's destroy or a storage's release callback,
 * run while freeing, may release containers itself: such nested releases only
 * queue their work for the outermost one.
 */
#include <pthread.h>

#include "gc.h"

static pthread_mutex_t gc_lock;
static pthread_once_t gc_once = PTHREAD_ONCE_INIT;
static int gc_depth;            /* nesting of releases on the lock holder */
static dp_cont_t *dead_list;    /* via gc_next: count reached zero or garbage */
static dp_cont_t *cand_list;    /* via gc_next2: released with count > 0 */
static dp_cont_t *free_list;    /* via gc_next: children released, memory pending */
static dp_cont_t *deferred_list; /* via gc_next2: candidates too large to try at release */
static size_t ndeferred, deferred_dead;

#define GC_BUDGET 256
#define GC_DEFER_BATCH 64

static void gc_init(void) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&gc_lock, &a);
  pthread_mutexattr_destroy(&a);
}

static void mark_dead(dp_cont_t *c) {
  if (c->h.flags & DP_HEAP_INDEFERRED) deferred_dead++;  /* purged at the end of the drain */
  c->h.color = DP_GC_DEAD;
  c->gc_next = dead_list;
  dead_list = c;
}

static void make_candidate(dp_cont_t *c) {
  /* Already queued: a candidate now, or deferred (its link is taken). */
  if (c->h.color != DP_GC_NONE || (c->h.flags & DP_HEAP_INDEFERRED)) return;
  c->h.color = DP_GC_PURPLE;
  c->gc_next2 = cand_list;
  cand_list = c;
}

/* Drops one reference held by a dying container. Children already dead
 * belong to the same garbage batch and are freed with it. */
static void drop_child(dp_value_t v) {
  if (!dp_value_is_heap(v)) return;
  if (!dp__is_container_kind(v.kind)) {
    dp__release_leaf(v.u.h);
    return;
  }
  dp_cont_t *k = (dp_cont_t *)v.u.h;
  if (k->h.color == DP_GC_DEAD) return;
  if (atomic_fetch_sub_explicit(&k->h.rc, 1, memory_order_acq_rel) == 1)
    mark_dead(k);
  else
    make_candidate(k);
}

/* Releases what a dead container holds and frees its arrays; the container's
 * own memory waits for the end of the drain (it may still be on a list). */
static void release_children(dp_cont_t *c) {
  switch (c->h.kind) {
    case DP_LIST:
    case DP_TUPLE: {
      dp_seq_t *s = (dp_seq_t *)c;
      for (size_t i = 0; i < s->len; i++) drop_child(s->items[i]);
      dp__free_inl(s->items, s->cap, sizeof(dp_value_t), s->inl);
      s->items = NULL;
      s->len = s->cap = 0;
      break;
    }
    case DP_DICT: {
      dp_dict_t *d = (dp_dict_t *)c;
      for (size_t i = 0; i < d->len; i++) {
        drop_child(d->entries[i].key);
        drop_child(d->entries[i].val);
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
        drop_child(o->attrs[i].val);
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

/* Calls fn(child, ctx) for each container child of c. */
#define FOR_EACH_CONTAINER_CHILD(c, K, BODY)                                       \
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
                                                                                   \
        n_ = ((dp_dict_t *)(c))->len * 2;                                          \
        stride_ = 0; /* handled below */                                           \
        break;                                                                     \
      case DP_OBJECT:                                                              \
        n_ = ((dp_object_t *)(c))->len;                                            \
        stride_ = 2;                                                               \
        break;                                                                     \
    }                                                                              \
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

static void defer(dp_cont_t *c) {
  c->h.color = DP_GC_DEFERRED;
  c->h.flags |= DP_HEAP_INDEFERRED;
  c->gc_next2 = deferred_list;
  deferred_list = c;
  ndeferred++;
}

/* Trial deletion over everything reachable from the candidates; budget 0
 * means no limit. Over budget, the candidates are deferred. */
static void collect_candidates(size_t budget) {
  /* The candidates become the visit list (gc_next2), counted from their
   * real reference counts. */
  dp_cont_t *visit = NULL, *tail = NULL;
  size_t ncand = 0, visited = 0;
  for (dp_cont_t *c = cand_list, *next; c; c = next) {
    next = c->gc_next2;
    c->gc_next2 = NULL;
    if (c->h.color != DP_GC_PURPLE) continue;  /* died since */
    c->h.color = DP_GC_GRAY;
    c->gc_refs = dp__rc(&c->h);
    if (tail) tail->gc_next2 = c; else visit = c;
    tail = c;
    ncand++;
  }
  cand_list = NULL;

  /* Breadth-first: subtract internal references. */
  for (dp_cont_t *p = visit; p; p = p->gc_next2) {
    if (budget && ++visited > budget) {
      /* Too big to try now: undo the marks, defer the candidates. */
      size_t i = 0;
      for (dp_cont_t *q = visit, *next; q; q = next, i++) {
        next = q->gc_next2;
        q->gc_next2 = NULL;
        if (i < ncand) defer(q);
        else q->h.color = DP_GC_NONE;
      }
      return;
    }
    FOR_EACH_CONTAINER_CHILD(p, k, {
      /* A deferred node stays outside this trial: its link belongs to the
       * deferred list. Counting it as outside can only keep nodes alive
       * (never frees a live one); it is tried when its batch is collected. */
      if (k->h.flags & DP_HEAP_INDEFERRED) continue;
      if (k->h.color != DP_GC_GRAY) {
        k->h.color = DP_GC_GRAY;
        k->gc_refs = dp__rc(&k->h);
        k->gc_next2 = NULL;
        tail->gc_next2 = k;
        tail = k;
      }
      k->gc_refs--;
    });
  }

  /* Held from outside: black, and everything it reaches (stack via gc_next). */
  for (dp_cont_t *p = visit; p; p = p->gc_next2) {
    if (p->h.color != DP_GC_GRAY || p->gc_refs == 0) continue;
    p->h.color = DP_GC_BLACK;
    p->gc_next = NULL;
    dp_cont_t *stack = p;
    while (stack) {
      dp_cont_t *q = stack;
      stack = q->gc_next;
      FOR_EACH_CONTAINER_CHILD(q, k, {
        if (k->h.color == DP_GC_GRAY) {
          k->h.color = DP_GC_BLACK;
          k->gc_next = stack;
          stack = k;
        }
      });
    }
  }

  /* Still gray: garbage. */
  for (dp_cont_t *p = visit, *next; p; p = next) {
    next = p->gc_next2;
    p->gc_next2 = NULL;
    if (p->h.color == DP_GC_GRAY)
      mark_dead(p);
    else
      p->h.color = DP_GC_NONE;
  }
}

/* Moves the deferred candidates back to the candidate list (the dead ones
 * leave it). */
static void undefer_all(void) {
  for (dp_cont_t *c = deferred_list, *next; c; c = next) {
    next = c->gc_next2;
    c->gc_next2 = NULL;
    c->h.flags &= (uint16_t)~DP_HEAP_INDEFERRED;
    if (c->h.color == DP_GC_DEFERRED) {
      c->h.color = DP_GC_PURPLE;
      c->gc_next2 = cand_list;
      cand_list = c;
    }
  }
  deferred_list = NULL;
  ndeferred = deferred_dead = 0;
}

/* Drops deferred candidates that died (so that their memory can go now). */
static void purge_deferred(void) {
  dp_cont_t **link = &deferred_list;
  while (*link) {
    dp_cont_t *c = *link;
    if (c->h.color == DP_GC_DEAD) {
      *link = c->gc_next2;
      c->gc_next2 = NULL;
      c->h.flags &= (uint16_t)~DP_HEAP_INDEFERRED;
      ndeferred--;
    } else {
      link = &c->gc_next2;
    }
  }
  deferred_dead = 0;
}

static int force_collect;

static void drain(void) {
  for (;;) {
    while (dead_list) {
      dp_cont_t *c = dead_list;
      dead_list = c->gc_next;
      release_children(c);
      c->gc_next = free_list;
      free_list = c;
    }
    if (cand_list) {
      collect_candidates(GC_BUDGET);
      continue;
    }
    if (deferred_list && (force_collect || ndeferred >= GC_DEFER_BATCH)) {
      force_collect = 0;
      undefer_all();
      collect_candidates(0);
      continue;
    }
    break;
  }
  if (deferred_dead) purge_deferred();
  while (free_list) {
    dp_cont_t *c = free_list;
    free_list = c->gc_next;
    dp__free(c, cont_size(c));
  }
}

void dp_value_collect(void) {
  pthread_once(&gc_once, gc_init);
  pthread_mutex_lock(&gc_lock);
  gc_depth++;
  force_collect = 1;
  if (gc_depth == 1) drain();
  gc_depth--;
  pthread_mutex_unlock(&gc_lock);
}

void dp__gc_release(dp_cont_t *c) {
  pthread_once(&gc_once, gc_init);
  pthread_mutex_lock(&gc_lock);
  gc_depth++;
  if (atomic_fetch_sub_explicit(&c->h.rc, 1, memory_order_acq_rel) == 1)
    mark_dead(c);
  else
    make_candidate(c);
  if (gc_depth == 1) drain();
  gc_depth--;
  pthread_mutex_unlock(&gc_lock);
}
