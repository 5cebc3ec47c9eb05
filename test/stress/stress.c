/* test/stress/stress.c — concurrency stress without Criterion, for
 * ThreadSanitizer (Criterion cannot start under TSan: its inheritable arena
 * collides with TSan's memory layout).
 *
 *   stress            run every scenario; prints "N passed, M failed"
 *   stress --control  run a deliberately racy scenario: under TSan it must
 *                     be reported, which shows the harness catches races
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "devpickle.h"
#include "check.h"
#include "../../cache/internal.h" /* dp__cache_check */



/* A pool stream of d (NULL when none can be had: the scenario then fails). */
static dp_stream_t *pool(dp_backend_t *b, dp_device_t d) {
  dp_stream_t *s = NULL;
  dp_stream_pool_next(b, d, &s, NULL);
  return s;
}

static void spin(int us) {
  struct timespec ts = {0, (long)us * 1000};
  nanosleep(&ts, NULL);
}

/* ---- values shared across threads, cycles collected concurrently ---- */

static dp_value_t shared_obj;

static void *value_churn(void *arg) {
  (void)arg;
  for (int i = 0; i < 5000; i++) {
    dp_value_t l;
    dp_list_new(2, &l, NULL);
    dp_list_append(l, dp_value_retain(shared_obj), NULL);
    dp_list_append(l, dp_value_retain(l), NULL);
    dp_value_release(l);
  }
  return NULL;
}

static int scenario_values(void) {
  dp_object_new("Shared", &shared_obj, NULL);
  dp_object_set(shared_obj, "self", dp_value_retain(shared_obj), NULL);
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, value_churn, NULL);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  CHECK(dp_value_refcount(shared_obj) == 2, "refcount %u", dp_value_refcount(shared_obj));
  dp_value_release(shared_obj);
  return 0;
}

/* ---- rings let go by several threads at once: candidates in several
 * buffers, handed between threads, collected as the threads exit ---- */

#define RINGS 400
#define RING_NODES 8
static _Atomic int payloads_freed;
static void payload_destroy(void *p) { (void)p; atomic_fetch_add(&payloads_freed, 1); }
static const dp_type_t payload_type = {"Payload", NULL, payload_destroy};
static dp_value_t ring_nodes[RINGS][4];
static dp_value_t shared_lists[RINGS];  /* one reference per thread */

static void *ring_dropper(void *arg) {
  int id = (int)(intptr_t)arg;
  for (int r = 0; r < RINGS; r++) {
    dp_value_release(shared_lists[r]);  /* buffered by one thread, freed by another */
    dp_value_release(ring_nodes[r][id]);
    if (r % 97 == id) dp_value_collect();
  }
  return NULL;
}

static int scenario_rings(void) {
  atomic_store(&payloads_freed, 0);
  for (int r = 0; r < RINGS; r++) {
    dp_value_t head, cur, p;
    dp_object_new("Node", &head, NULL);
    cur = head;
    for (int i = 1; i < RING_NODES; i++) {
      dp_value_t n;
      dp_object_new("Node", &n, NULL);
      dp_object_set(cur, "next", n, NULL);
      cur = n;
    }
    dp_object_set(cur, "next", dp_value_retain(head), NULL);
    dp_custom_new(&payload_type, NULL, &p, NULL);
    dp_object_set(head, "payload", p, NULL);
    /* threads 0..3 hold nodes 0, 2, 4, 6; thread 3 also holds the head */
    cur = head;
    for (int t = 0; t < 4; t++) {
      ring_nodes[r][t] = dp_value_retain(t == 3 ? head : cur);
      dp_object_get(cur, "next", &cur, NULL);
      dp_object_get(cur, "next", &cur, NULL);
    }
    dp_value_release(head);
    dp_list_new(1, &shared_lists[r], NULL);
    dp_custom_new(&payload_type, NULL, &p, NULL);
    dp_list_append(shared_lists[r], p, NULL);
    for (int t = 1; t < 4; t++) dp_value_retain(shared_lists[r]);
  }
  dp_value_collect();
  CHECK(atomic_load(&payloads_freed) == 0, "%d rings freed while held", atomic_load(&payloads_freed));
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, ring_dropper, (void *)(intptr_t)i);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  dp_value_collect();  /* headers handed back to this thread's buffer, if any */
  CHECK(atomic_load(&payloads_freed) == 2 * RINGS, "%d of %d rings and lists freed", atomic_load(&payloads_freed),
        2 * RINGS);
  return 0;
}

/* ---- candidates handed between threads: a shared container let go and
 * buffered again by several threads at once (its buffered flag claimed on
 * the lock-free path and under the collector lock: never in two buffers),
 * and containers buffered on one thread released to zero on the next
 * (the dead entry leaves the owner's buffer while the owner keeps
 * changing it) ---- */

#define HANDOFF_THREADS 4
#define HANDOFF_ITERS 4000
static dp_value_t handoff_shared;
static dp_value_t handoff_box[HANDOFF_THREADS];
static _Atomic int handoff_full[HANDOFF_THREADS];
static _Atomic int handoff_made, handoff_done;

static void handoff_take(int id) {
  if (!atomic_load_explicit(&handoff_full[id], memory_order_acquire)) return;
  dp_value_t v = handoff_box[id];
  atomic_store_explicit(&handoff_full[id], 0, memory_order_release);
  dp_value_release(v);  /* to zero, buffered by the previous thread */
}

static void *handoff_thread(void *arg) {
  int id = (int)(intptr_t)arg, next = (id + 1) % HANDOFF_THREADS;
  for (int i = 0; i < HANDOFF_ITERS; i++) {
    dp_value_release(dp_value_retain(handoff_shared));
    if (i % 61 == id) dp_value_collect();  /* lets go of the shared container */
    dp_value_t l, p;
    dp_list_new(1, &l, NULL);
    dp_custom_new(&payload_type, NULL, &p, NULL);
    dp_list_append(l, p, NULL);
    atomic_fetch_add(&handoff_made, 1);
    dp_value_t mine = dp_value_retain(l);
    dp_value_release(l);  /* 2 -> 1: this thread's candidate */
    while (atomic_load_explicit(&handoff_full[next], memory_order_acquire)) {
      handoff_take(id);
      sched_yield();
    }
    handoff_box[next] = mine;
    atomic_store_explicit(&handoff_full[next], 1, memory_order_release);
    handoff_take(id);
  }
  /* the previous thread may still hand this one a list */
  atomic_fetch_add(&handoff_done, 1);
  while (atomic_load(&handoff_done) < HANDOFF_THREADS) {
    handoff_take(id);
    sched_yield();
  }
  return NULL;
}

static int scenario_handoff(void) {
  atomic_store(&payloads_freed, 0);
  atomic_store(&handoff_made, 0);
  atomic_store(&handoff_done, 0);
  dp_value_t p;
  dp_list_new(1, &handoff_shared, NULL);
  dp_custom_new(&payload_type, NULL, &p, NULL);
  dp_list_append(handoff_shared, p, NULL);
  atomic_fetch_add(&handoff_made, 1);
  pthread_t th[HANDOFF_THREADS];
  for (int i = 0; i < HANDOFF_THREADS; i++) pthread_create(&th[i], NULL, handoff_thread, (void *)(intptr_t)i);
  for (int i = 0; i < HANDOFF_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < HANDOFF_THREADS; i++) handoff_take(i);
  CHECK(dp_value_refcount(handoff_shared) == 1, "refcount %u", dp_value_refcount(handoff_shared));
  CHECK(atomic_load(&payloads_freed) == atomic_load(&handoff_made) - 1, "%d of %d handed-off lists freed",
        atomic_load(&payloads_freed), atomic_load(&handoff_made) - 1);
  dp_value_release(handoff_shared);
  CHECK(atomic_load(&payloads_freed) == atomic_load(&handoff_made), "the shared list was not freed");
  return 0;
}

/* ---- producers and consumers on host streams, from many threads ---- */

typedef struct slot {
  int data;            /* written by a producer stream, read by a consumer stream */
  int seen;
} slot_t;

static void produce(void *arg) {
  slot_t *s = arg;
  spin(50);
  s->data = 7;
}

static void touch_later(void *arg) {
  (void)arg;
  spin(20);
}

static void consume(void *arg) {
  slot_t *s = arg;
  s->seen = s->data;
}

typedef struct worker_arg {
  dp_backend_t *b;
  int id;
  int bad;
} worker_arg_t;

static void *stream_worker(void *p) {
  worker_arg_t *a = p;
  dp_device_t d0 = {DP_DEVICE_HOST, 0}, d1 = {DP_DEVICE_HOST, 1};
  for (int i = 0; i < 200; i++) {
    slot_t *s = calloc(1, sizeof *s);
    dp_stream_t *prod = pool(a->b, d0), *cons = pool(a->b, d1);
    dp_event_t *ev;
    dp_event_new(a->b, d0, &ev, NULL);
    dp_host_launch(prod, produce, s, NULL);
    dp_event_record(ev, prod, NULL);
    dp_stream_wait_event(cons, ev, NULL);
    dp_event_free(ev);
    dp_host_launch(cons, consume, s, NULL);
    dp_stream_synchronize(cons, NULL);
    if (s->seen != 7) a->bad++;
    dp_stream_synchronize(prod, NULL);
    free(s);
  }
  return NULL;
}

/* Runs fn on 4 threads of the host backend, each with its args[i]. */
static int four_workers(void *(*fn)(void *), worker_arg_t args[4]) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  pthread_t th[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (worker_arg_t){b, i, 0};
    pthread_create(&th[i], NULL, fn, &args[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  return 0;
}

static int scenario_streams(void) {
  worker_arg_t args[4];
  if (four_workers(stream_worker, args)) return 1;
  for (int i = 0; i < 4; i++) CHECK(args[i].bad == 0, "thread %d saw %d stale reads", i, args[i].bad);
  return 0;
}

/* ---- host memory freed by 4 threads while streams come and go ----
 * Each free drains the device, walking its list of streams from a cursor
 * that keeps its place while the drain waits without the lock; the other
 * threads add and destroy streams, and drain, around it. */

static void *drain_worker(void *p) {
  worker_arg_t *a = p;
  dp_device_t d0 = {DP_DEVICE_HOST, 0};
  static const char src[4096];
  for (int i = 0; i < 150; i++) {
    dp_stream_t *s;
    void *m;
    if (dp_stream_new(a->b, d0, &s, NULL) != 0) {
      a->bad++;
      continue;
    }
    if (dp_device_alloc(a->b, d0, sizeof src, &m, NULL) == 0) {
      dp_host_launch(s, touch_later, NULL, NULL);
      dp_memcpy_async(s, m, src, sizeof src, NULL);
      if (dp_device_dealloc(a->b, d0, m, NULL) != 0 || dp_stream_query(s, NULL) != 1) a->bad++;
    }
    /* walks the device's list of streams while the others add and remove theirs */
    if (dp_device_synchronize(a->b, d0, NULL) != 0 || dp_stream_query(s, NULL) != 1) a->bad++;
    dp_stream_free(s);
  }
  return NULL;
}

static int scenario_drains(void) {
  worker_arg_t args[4];
  if (four_workers(drain_worker, args)) return 1;
  for (int i = 0; i < 4; i++)
    CHECK(args[i].bad == 0, "thread %d: %d frees failed or came before the work queued on their stream", i, args[i].bad);
  return 0;
}

/* ---- wrapped native streams: 8 threads wrap the same handles at once ----
 * while the wrapper table grows under them and another thread wraps and
 * frees streams of its own (retiring their wrappers); through the wrappers
 * they order a consumer after work queued on the native streams. */

#define WRAP_THREADS 8
#define WRAP_HANDLES 24
static dp_stream_t *wrap_owners[WRAP_HANDLES];
static dp_stream_t *_Atomic wrap_seen[WRAP_HANDLES];
static _Atomic int wrap_go;

static void *wrap_worker(void *p) {
  worker_arg_t *a = p;
  dp_device_t d0 = {DP_DEVICE_HOST, 0}, d1 = {DP_DEVICE_HOST, 1};
  while (!atomic_load(&wrap_go)) sched_yield();
  for (int round = 0; round < 20; round++)
    for (int k = 0; k < WRAP_HANDLES; k++) {
      int i = (a->id * 3 + k) % WRAP_HANDLES;
      dp_stream_t *w = NULL, *expect = NULL;
      if (dp_stream_wrap(a->b, d0, dp_stream_native(wrap_owners[i]), &w, NULL) != 0) {
        a->bad++;
        continue;
      }
      if (!atomic_compare_exchange_strong(&wrap_seen[i], &expect, w) && expect != w) a->bad++;
      if (k % 8) continue;
      slot_t *s = calloc(1, sizeof *s);
      dp_stream_t *cons = pool(a->b, d1);
      dp_event_t *ev;
      dp_event_new(a->b, d0, &ev, NULL);
      dp_host_launch(wrap_owners[i], produce, s, NULL);  /* the owner's work */
      dp_event_record(ev, w, NULL);                        /* ordered through the wrapper */
      dp_stream_wait_event(cons, ev, NULL);
      dp_event_free(ev);
      dp_host_launch(cons, consume, s, NULL);
      dp_stream_synchronize(cons, NULL);
      if (s->seen != 7) a->bad++;
      dp_stream_synchronize(wrap_owners[i], NULL);
      free(s);
    }
  return NULL;
}

static void *wrap_churn(void *p) {
  worker_arg_t *a = p;
  dp_device_t d1 = {DP_DEVICE_HOST, 1};
  while (!atomic_load(&wrap_go)) sched_yield();
  for (int i = 0; i < 40; i++) {
    dp_stream_t *s, *w, *again;
    if (dp_stream_new(a->b, d1, &s, NULL) != 0) {
      a->bad++;
      continue;
    }
    if (dp_stream_wrap(a->b, d1, dp_stream_native(s), &w, NULL) != 0 ||
        dp_stream_wrap(a->b, d1, dp_stream_native(s), &again, NULL) != 0 || again != w)
      a->bad++;
    dp_stream_free(s);
  }
  return NULL;
}

static int scenario_wraps(void) {
  dp_backend_t *b;
  dp_device_t d0 = {DP_DEVICE_HOST, 0};
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  for (int i = 0; i < WRAP_HANDLES; i++) {
    CHECK(dp_stream_new(b, d0, &wrap_owners[i], NULL) == 0, "stream %d", i);
    atomic_store(&wrap_seen[i], NULL);
  }
  atomic_store(&wrap_go, 0);
  pthread_t th[WRAP_THREADS + 1];
  worker_arg_t args[WRAP_THREADS + 1];
  for (int i = 0; i <= WRAP_THREADS; i++) {
    args[i] = (worker_arg_t){b, i, 0};
    pthread_create(&th[i], NULL, i < WRAP_THREADS ? wrap_worker : wrap_churn, &args[i]);
  }
  atomic_store(&wrap_go, 1);
  for (int i = 0; i <= WRAP_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i <= WRAP_THREADS; i++) CHECK(args[i].bad == 0, "thread %d: %d bad wraps or stale reads", i, args[i].bad);
  for (int i = 0; i < WRAP_HANDLES; i++) dp_stream_free(wrap_owners[i]);
  return 0;
}

/* ---- the caching allocator under contention, with record_stream ---- */

static dp_cache_t *cache;

static void touch(void *arg) {
  memset(arg, 0x5a, 256);
}

static void *alloc_worker(void *p) {
  worker_arg_t *a = p;
  dp_device_t dev = {DP_DEVICE_HOST, (uint8_t)(a->id % 2)};
  dp_stream_t *s, *u;
  dp_stream_new(a->b, dev, &s, NULL);
  u = pool(a->b, dev);
  uint64_t seed = (uint64_t)a->id * 7919 + 1;
  void *live[16] = {0};
  for (int i = 0; i < 3000; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    int k = (int)(seed >> 60);
    if (live[k]) {
      dp_cache_dealloc(cache, live[k], NULL);
      live[k] = NULL;
    } else if (dp_cache_alloc(cache, dev, 256 + (size_t)(seed >> 44) % 100000, s, &live[k], NULL) == 0) {
      dp_host_launch(s, touch, live[k], NULL);
      if (seed & 1) {
        dp_host_launch(u, touch, live[k], NULL);
        dp_cache_record_stream(cache, live[k], u, NULL);
      }
    }
    if (i % 500 == 0) dp_cache_poll(cache, NULL);
  }
  for (int k = 0; k < 16; k++) dp_cache_dealloc(cache, live[k], NULL);
  dp_stream_free(s);
  return NULL;
}

static int scenario_allocator(void) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  CHECK(dp_cache_new(b, &cache, NULL) == 0, "cache");
  pthread_t th[4];
  worker_arg_t args[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (worker_arg_t){b, i, 0};
    pthread_create(&th[i], NULL, alloc_worker, &args[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int d = 0; d < 2; d++) dp_device_synchronize(b, (dp_device_t){DP_DEVICE_HOST, (uint8_t)d}, NULL);
  for (int d = 0; d < 2; d++) {
    dp_cache_stats_t st;
    CHECK(dp_cache_stats(cache, (dp_device_t){DP_DEVICE_HOST, (uint8_t)d}, &st, NULL) == 0, "device %d: no statistics", d);
    CHECK(st.allocated == 0 && st.allocs == st.frees && st.pending_blocks == 0,
          "device %d: allocated %zu, allocs %llu, frees %llu, pending %zu", d, st.allocated,
          (unsigned long long)st.allocs, (unsigned long long)st.frees, st.pending_blocks);
  }
  dp_cache_free(cache);
  return 0;
}

/* ---- the allocator's books while streams come and go ----
 * Threads allocate on streams of their own, record them and two shared
 * consumers, free, and destroy their streams — directly or from a host
 * function on a shared consumer — while the others do the same: every
 * destruction unties blocks and drops uses that other threads' frees and
 * records move in the same lists. */
static dp_stream_t *consumers[2];

static void free_stream_fn(void *s) { dp_stream_free(s); }

static void *tie_worker(void *p) {
  worker_arg_t *a = p;
  dp_device_t dev = {DP_DEVICE_HOST, 0};
  enum { K = 3, NB = 32 };
  dp_stream_t *own[K];
  void *blk[NB] = {0};
  for (int k = 0; k < K; k++) dp_stream_new(a->b, dev, &own[k], NULL);
  uint64_t seed = (uint64_t)a->id * 104729 + 7;
  for (int i = 0; i < 4000; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    unsigned op = (unsigned)(seed >> 60), j = (unsigned)(seed >> 40) % NB, k = (unsigned)(seed >> 20) % K;
    if (op < 5) {
      if (!blk[j]) dp_cache_alloc(cache, dev, 512u * (1 + (unsigned)(seed >> 8) % 9), own[k], &blk[j], NULL);
    } else if (op < 11) {
      if (blk[j]) dp_cache_record_stream(cache, blk[j], op < 8 ? consumers[op % 2] : own[k], NULL);
    } else if (op < 15) {
      dp_cache_dealloc(cache, blk[j], NULL);
      blk[j] = NULL;
    } else {
      if (seed & 1) dp_host_launch(consumers[seed >> 1 & 1], free_stream_fn, own[k], NULL);
      else dp_stream_free(own[k]);
      dp_stream_new(a->b, dev, &own[k], NULL);
    }
  }
  for (int j = 0; j < NB; j++) dp_cache_dealloc(cache, blk[j], NULL);
  for (int k = 0; k < K; k++) dp_stream_free(own[k]);
  return NULL;
}

static int scenario_allocator_streams(void) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  CHECK(dp_cache_new(b, &cache, NULL) == 0, "cache");
  dp_device_t dev = {DP_DEVICE_HOST, 0};
  for (int i = 0; i < 2; i++) CHECK(dp_stream_new(b, dev, &consumers[i], NULL) == 0, "a consumer stream");
  pthread_t th[4];
  worker_arg_t args[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (worker_arg_t){b, i, 0};
    pthread_create(&th[i], NULL, tie_worker, &args[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) dp_stream_synchronize(consumers[i], NULL); /* the destructions they queued */
  const char *bad = dp__cache_check(cache);
  CHECK(!bad, "the books disagree: %s", bad);
  for (int i = 0; i < 2; i++) dp_stream_free(consumers[i]);
  bad = dp__cache_check(cache);
  CHECK(!bad, "the books disagree once the consumers went: %s", bad);
  dp_cache_stats_t st;
  dp_cache_poll(cache, NULL);
  CHECK(dp_cache_stats(cache, dev, &st, NULL) == 0, "no statistics");
  CHECK(st.allocated == 0 && st.pending_blocks == 0, "allocated %zu, pending %zu", st.allocated, st.pending_blocks);
  CHECK(st.allocs > 1000 && st.allocs == st.frees, "allocs %llu, frees %llu", (unsigned long long)st.allocs,
        (unsigned long long)st.frees);
  dp_cache_free(cache);
  return 0;
}

/* ---- futures: 8 threads, 100k futures, random completion order, chains ---- */

enum { NFUT = 100000, NTHREADS = 8 };
static dp_future_t **futs;
static _Atomic int chained_calls;

static int count_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  (void)err;
  atomic_fetch_add(&chained_calls, 1);
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

static void *future_worker(void *p) {
  worker_arg_t *a = p;
  uint64_t seed = (uint64_t)a->id * 2654435761u + 17;
  for (int i = a->id; i < NFUT; i += NTHREADS) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    int k = (int)((seed >> 33) % NFUT);
    switch (i % 4) {
      case 0:
      case 1: {  /* complete some future, perhaps one already complete */
        dp_value_t v = dp_int(i);
        int rc = dp_future_mark_completed(futs[k], v, NULL);
        if (rc != 0 && rc != DP_ESTATE) a->bad++;
        break;
      }
      case 2: {  /* chain on some future */
        dp_future_t *c;
        if (dp_future_then(futs[k], count_cb, NULL, &c, NULL) == 0) dp_future_release(c);
        else a->bad++;
        break;
      }
      default: {  /* collect three */
        dp_future_t *three[3] = {futs[k], futs[(k + 1) % NFUT], futs[(k + 7) % NFUT]}, *all;
        if (dp_future_collect_all(three, 3, NULL, &all, NULL) == 0) dp_future_release(all);
        else a->bad++;
      }
    }
  }
  return NULL;
}

static int scenario_futures(void) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  dp_future_opts_t o = {b, NULL, 0, NULL, 0, 0};
  futs = malloc(NFUT * sizeof *futs);
  for (int i = 0; i < NFUT; i++) CHECK(dp_future_new(&o, &futs[i], NULL) == 0, "future");
  atomic_store(&chained_calls, 0);
  pthread_t th[NTHREADS];
  worker_arg_t args[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    args[i] = (worker_arg_t){b, i, 0};
    pthread_create(&th[i], NULL, future_worker, &args[i]);
  }
  for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
  int chained = NFUT / 4;  /* i % 4 == 2 */
  /* complete whatever random order left pending: their callbacks run now */
  for (int i = 0; i < NFUT; i++) dp_future_mark_completed(futs[i], dp_none(), NULL);
  for (int i = 0; i < NTHREADS; i++) CHECK(args[i].bad == 0, "thread %d: %d unexpected errors", i, args[i].bad);
  CHECK(atomic_load(&chained_calls) == chained, "%d callbacks ran, %d were chained", atomic_load(&chained_calls), chained);
  for (int i = 0; i < NFUT; i++) dp_future_release(futs[i]);
  free(futs);
  return 0;
}

/* ---- futures dropped pending: cancellation races with completions and waits ----
 * Each worker makes root -> mid -> leaf and all = collect_all(root, leaf),
 * drops mid, and trades root through a shared slot: whoever takes a root
 * completes it or drops it pending. A waiter per worker blocks on each leaf
 * and each all, which must end complete or canceled, never hang. */

enum { NDROP = 8000, DROP_THREADS = 4, DROP_SLOTS = 16 };
static dp_future_t *_Atomic drop_slot[DROP_SLOTS];

typedef struct drop_arg {
  dp_backend_t *b;
  int id;
  int bad;
  dp_future_t *_Atomic *leaves, *_Atomic *alls;  /* published for the waiter */
} drop_arg_t;

static void trade(dp_future_t *other, uint64_t seed) {
  if (other && (seed >> 40) % 2) dp_future_mark_completed(other, dp_int(1), NULL);
  dp_future_release(other);  /* pending: cancels its chain and its collect_all */
}

static void *drop_worker(void *p) {
  drop_arg_t *a = p;
  dp_future_opts_t o = {a->b, NULL, 0, NULL, 0, 0};
  uint64_t seed = (uint64_t)a->id * 2654435761u + 99;
  for (int i = 0; i < NDROP; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    dp_future_t *root, *mid, *leaf, *all;
    if (dp_future_new(&o, &root, NULL) || dp_future_then(root, count_cb, NULL, &mid, NULL) ||
        dp_future_then(mid, count_cb, NULL, &leaf, NULL)) {
      a->bad++;
      break;
    }
    dp_future_release(mid);
    dp_future_t *two[2] = {root, leaf};
    if (dp_future_collect_all(two, 2, NULL, &all, NULL)) a->bad++;
    atomic_store(&a->leaves[i], leaf);
    atomic_store(&a->alls[i], all);
    trade(atomic_exchange(&drop_slot[(seed >> 33) % DROP_SLOTS], root), seed);
  }
  return NULL;
}

static void *drop_waiter(void *p) {
  drop_arg_t *a = p;
  for (int i = 0; i < NDROP; i++) {
    dp_future_t *leaf, *all;
    while (!(leaf = atomic_load(&a->leaves[i])) || !(all = atomic_load(&a->alls[i]))) sched_yield();
    dp_error_t e;
    int rc = dp_future_wait(leaf, -1, &e);
    if (rc != 0 && !(rc == DP_ECANCELED && strcmp(e.message, "the parent future was released before it completed") == 0))
      a->bad++;
    rc = dp_future_wait(all, -1, &e);
    if (rc != 0 && !(rc == DP_ECANCELED && strcmp(e.message, "input 0 of collect_all was released before it completed") == 0))
      a->bad++;
    dp_future_release(leaf);
    dp_future_release(all);
  }
  return NULL;
}

static int scenario_dropped_futures(void) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  pthread_t th[2 * DROP_THREADS];
  drop_arg_t args[DROP_THREADS];
  for (int i = 0; i < DROP_THREADS; i++) {
    args[i] = (drop_arg_t){b, i, 0, calloc(NDROP, sizeof(dp_future_t *)), calloc(NDROP, sizeof(dp_future_t *))};
    CHECK(args[i].leaves && args[i].alls, "out of memory");
    pthread_create(&th[i], NULL, drop_worker, &args[i]);
    pthread_create(&th[DROP_THREADS + i], NULL, drop_waiter, &args[i]);
  }
  for (int i = 0; i < DROP_THREADS; i++) pthread_join(th[i], NULL);
  for (int k = 0; k < DROP_SLOTS; k++) trade(atomic_exchange(&drop_slot[k], NULL), (uint64_t)k << 40);
  for (int i = 0; i < DROP_THREADS; i++) pthread_join(th[DROP_THREADS + i], NULL);
  for (int i = 0; i < DROP_THREADS; i++) {
    CHECK(args[i].bad == 0, "thread %d: %d unexpected results", i, args[i].bad);
    free((void *)args[i].leaves);
    free((void *)args[i].alls);
  }
  return 0;
}

/* ---- waits from callbacks follow what a future waits for, while other
 * threads complete and drop the futures on the way ----
 * In each round a callback, while a thread of the round completes half of
 * a collect_all's inputs and drops the last reference to the other half,
 * waits on a future that also waits for the callback's own child (refused
 * at once: DP_EMISUSE), then polls the collect_all's then() child until
 * the cancellation reaches it. The links hold no references: following
 * them must never read a future that went. */

enum { LINK_ROUNDS = 150, LINK_INPUTS = 32, LINK_THREADS = 4 };

typedef struct link_round {
  dp_future_t *in[LINK_INPUTS];  /* the dropping thread's references */
  dp_future_t *target, *self_wait;
  int bad;
} link_round_t;

static void *link_dropper(void *p) {
  link_round_t *r = p;
  for (int i = 0; i < LINK_INPUTS; i++) {
    if (i % 2 == 0) dp_future_mark_completed(r->in[i], dp_int(i), NULL);
    dp_future_release(r->in[i]);
    if (i % 4 == 0) sched_yield();
  }
  return NULL;
}

static int link_poll(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  link_round_t *r = ud;
  pthread_t th;
  pthread_create(&th, NULL, link_dropper, r);
  dp_error_t e;
  if (dp_future_wait(r->self_wait, -1, &e) != DP_EMISUSE) r->bad++;
  int rc;
  while ((rc = dp_future_wait(r->target, 0, &e)) == DP_ETIMEDOUT) {
  }
  if (rc != DP_ECANCELED) r->bad++;
  pthread_join(th, NULL);
  return 0;
}

static void *link_worker(void *p) {
  int *bad = p;
  dp_backend_t *b;
  if (dp_backend_get(DP_DEVICE_HOST, &b, NULL)) return (void)++*bad, NULL;
  dp_future_opts_t o = {b, NULL, 0, NULL, 0, 0};
  for (int round = 0; round < LINK_ROUNDS; round++) {
    link_round_t r = {{NULL}, NULL, NULL, 0};
    dp_future_t *f, *agg, *child, *mixed, *two[2];
    int ok = dp_future_new(&o, &f, NULL) == 0;
    for (int i = 0; ok && i < LINK_INPUTS; i++) ok = dp_future_new(&o, &r.in[i], NULL) == 0;
    ok = ok && dp_future_collect_all(r.in, LINK_INPUTS, NULL, &agg, NULL) == 0 &&
         dp_future_then(agg, count_cb, NULL, &r.target, NULL) == 0 &&
         dp_future_then(f, link_poll, &r, &child, NULL) == 0;
    two[0] = agg;
    two[1] = child;
    ok = ok && dp_future_collect_all(two, 2, NULL, &mixed, NULL) == 0 &&
         dp_future_then(mixed, count_cb, NULL, &r.self_wait, NULL) == 0;
    if (!ok) return (void)++*bad, NULL;
    dp_future_mark_completed(f, dp_int(1), NULL);
    *bad += r.bad;
    dp_future_release(r.self_wait);
    dp_future_release(mixed);
    dp_future_release(child);
    dp_future_release(r.target);
    dp_future_release(agg);
    dp_future_release(f);
  }
  return NULL;
}

static int scenario_links(void) {
  pthread_t th[LINK_THREADS];
  int bad[LINK_THREADS] = {0};
  for (int i = 0; i < LINK_THREADS; i++) pthread_create(&th[i], NULL, link_worker, &bad[i]);
  for (int i = 0; i < LINK_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < LINK_THREADS; i++) CHECK(bad[i] == 0, "thread %d: %d unexpected results", i, bad[i]);
  return 0;
}

/* ---- host memory limits set while the backend stops and starts ----
 * A limit set before the backend exists is kept for it; one set while it
 * runs applies at once: the setter and the backend's start and stop share
 * the pending limits and the live backend. The setter also looks the
 * backend up, racing the main thread's start and stop for the registry. */

static _Atomic int limits_stop;

static void *limit_setter(void *p) {
  (void)p;
  for (unsigned k = 0; !atomic_load(&limits_stop); k++) {
    dp_host_set_memory_limit((dp_device_t){DP_DEVICE_HOST, (uint8_t)(k % 2)}, (size_t)(k % 3 + 1) << 20, NULL);
    dp_backend_t *b; /* looked up (or started) beside the main thread's start and stop; not used */
    dp_backend_get(DP_DEVICE_HOST, &b, NULL);
  }
  return NULL;
}

static int scenario_limits(void) {
  pthread_t th;
  atomic_store(&limits_stop, 0);
  CHECK(pthread_create(&th, NULL, limit_setter, NULL) == 0, "setter thread");
  int bad = 0;
  for (int round = 0; round < 200; round++) {
    dp_backend_t *b;
    void *m;
    dp_device_t d = {DP_DEVICE_HOST, (uint8_t)(round % 2)};
    if (dp_backend_get(DP_DEVICE_HOST, &b, NULL) != 0 || dp_device_alloc(b, d, 4096, &m, NULL) != 0 ||
        dp_device_dealloc(b, d, m, NULL) != 0)
      bad++;
    dp_shutdown();
  }
  atomic_store(&limits_stop, 1);
  pthread_join(th, NULL);
  for (int d = 0; d < 2; d++) dp_host_set_memory_limit((dp_device_t){DP_DEVICE_HOST, (uint8_t)d}, 0, NULL);
  CHECK(bad == 0, "%d rounds could not allocate 4 KiB under a limit of 1 MiB or more", bad);
  return 0;
}

/* ---- the control: a consumer without the wait races with the producer ---- */

static void *racy_worker(void *p) {
  worker_arg_t *a = p;
  dp_device_t d0 = {DP_DEVICE_HOST, 0}, d1 = {DP_DEVICE_HOST, 1};
  slot_t *s = calloc(1, sizeof *s);
  dp_stream_t *prod = pool(a->b, d0), *cons = pool(a->b, d1);
  dp_host_launch(prod, produce, s, NULL);
  dp_host_launch(cons, consume, s, NULL);  /* no event, no wait: a data race */
  dp_stream_synchronize(cons, NULL);
  dp_stream_synchronize(prod, NULL);
  free(s);
  return NULL;
}

/* ---- a record's list of distinct allocations, first asked by several
 * threads at once: one of them makes it, every one reads the same ---- */

enum { NLIST = 2000, LIST_THREADS = 4 };
static dp_future_t *list_futs[NLIST];

static void *list_reader(void *p) {
  int *bad = p;
  for (int i = 0; i < NLIST; i++) {
    if (dp_future_nptrs(list_futs[i]) != 2) ++*bad;
    dp_ptr_info_t a, c;
    if (dp_future_ptr(list_futs[i], 0, &a, NULL) || dp_future_ptr(list_futs[i], 1, &c, NULL) || a.refs != 2 ||
        c.refs != 1 || a.base != (void *)0x1000 || c.base != (void *)0x2000)
      ++*bad;
  }
  return NULL;
}

static int scenario_listing(void) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  dp_future_opts_t o = {b, NULL, 0, NULL, 0, 0};
  const dp_device_t cpu = {DP_DEVICE_CPU, 0};
  const int64_t shape[1] = {4};
  for (int i = 0; i < NLIST; i++) {
    dp_value_t l, t[3];
    CHECK(dp_list_new(3, &l, NULL) == 0, "list");
    const uintptr_t base[3] = {0x1000, 0x2000, 0x1000}; /* the first again, not right after itself */
    for (int k = 0; k < 3; k++) {
      dp_storage_t *st;
      CHECK(dp_storage_new(cpu, (void *)base[k], 16, NULL, NULL, &st, NULL) == 0, "storage");
      CHECK(dp_tensor_new(st, DP_FLOAT32, 1, shape, NULL, 0, &t[k], NULL) == 0, "tensor");
      CHECK(dp_list_append(l, t[k], NULL) == 0, "append");
    }
    CHECK(dp_future_new(&o, &list_futs[i], NULL) == 0, "future");
    CHECK(dp_future_mark_completed(list_futs[i], l, NULL) == 0, "completion");
  }
  pthread_t th[LIST_THREADS];
  int bad[LIST_THREADS] = {0};
  for (int i = 0; i < LIST_THREADS; i++) pthread_create(&th[i], NULL, list_reader, &bad[i]);
  for (int i = 0; i < LIST_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < NLIST; i++) dp_future_release(list_futs[i]);
  for (int i = 0; i < LIST_THREADS; i++) CHECK(bad[i] == 0, "thread %d read %d wrong lists", i, bad[i]);
  return 0;
}

/* Several rounds, so that one round whose threads happened to touch the slot
 * far apart in time cannot leave the control unreported. */
static int scenario_racy_control(void) {
  dp_backend_t *b;
  CHECK(dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0, "host backend");
  worker_arg_t a = {b, 0, 0};
  for (int round = 0; round < 8; round++) racy_worker(&a);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--control") == 0) {
    run("racy control (must be reported by ThreadSanitizer)", scenario_racy_control);
    return 0;
  }
  run("values: concurrent retain, release and cycle collection", scenario_values);
  run("values: rings and lists let go by 4 threads at once, collected as they exit", scenario_rings);
  run("values: candidates handed between 4 threads, released to zero by the next", scenario_handoff);
  run("streams: producer/consumer pairs from 4 threads", scenario_streams);
  run("streams: 8 threads wrap the same native streams while the table grows and wrappers retire", scenario_wraps);
  run("host memory: 4 threads free while streams come and go", scenario_drains);
  run("allocator: 4 threads, record_stream, polling", scenario_allocator);
  run("allocator: 4 threads record and destroy streams, some from host functions on shared ones",
      scenario_allocator_streams);
  run("futures: 8 threads, 100k futures, random completion order, then chains, collect_all", scenario_futures);
  run("futures: pending chains and collect_all inputs dropped while others complete and wait", scenario_dropped_futures);
  run("futures: waits from callbacks follow collect_all and then() links while their futures complete and go",
      scenario_links);
  run("futures: 4 threads list the allocations of the same futures at once", scenario_listing);
  run("host memory: limits set by one thread while the backend stops and starts",
      scenario_limits);
  printf("%d passed, %d failed\n", passes, failures);
  return failures ? 1 : 0;
}
