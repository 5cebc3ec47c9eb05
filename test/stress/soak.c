/* test/stress/soak.c — `make soak SOAK_SECONDS=N`: threads hammer futures,
 * the caching allocator and pickling for N seconds while the allocator hook
 * fails about one allocation in 500 at random. Errors are expected; what
 * must hold at the end: every child future created is done (no lost
 * callback), every callback ran at most once, the caches' books balance, and
 * after dp_shutdown no block is left live. Prints "N passed, M failed". */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "devpickle.h"

static _Atomic long live_blocks, injected, allocs;
static _Atomic int injecting;
static _Thread_local uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t next_rand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static void *soak_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  (void)ud;
  (void)osize;
  if (nsize == 0) {
    if (ptr) atomic_fetch_sub(&live_blocks, 1);
    free(ptr);
    return NULL;
  }
  atomic_fetch_add(&allocs, 1);
  if (atomic_load(&injecting) && next_rand() % 500 == 0) {
    atomic_fetch_add(&injected, 1);
    return NULL;
  }
  void *p = realloc(ptr, nsize);
  if (p && !ptr) atomic_fetch_add(&live_blocks, 1);
  return p;
}

static double deadline;
static dp_backend_t *B;
static _Atomic long ops, children, lost, callbacks;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  (void)err;
  atomic_fetch_add(&callbacks, 1);
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

/* A value of a few tensors over cache allocations (released by the caller
 * through the storages' callback). */
static void give_back(void *ud, dp_device_t d, void *base, size_t n) {
  (void)d;
  (void)n;
  dp_cache_dealloc(ud, base, NULL);
}

static int make_value(dp_cache_t *c, dp_device_t d, dp_value_t *out) {
  dp_value_t l;
  int rc = dp_list_new(0, &l, NULL);
  if (rc) return rc;
  int n = 1 + (int)(next_rand() % 4);
  for (int i = 0; i < n && rc == 0; i++) {
    void *p;
    dp_storage_t *st;
    dp_value_t t, o;
    int64_t shape[1] = {64};
    if ((rc = dp_cache_alloc(c, d, 256, NULL, &p, NULL)) != 0) break;
    if ((rc = dp_storage_new(d, p, 256, give_back, c, &st, NULL)) != 0) {
      dp_cache_dealloc(c, p, NULL);
      break;
    }
    if ((rc = dp_tensor_new(st, DP_FLOAT32, 1, shape, NULL, 0, &t, NULL)) != 0) break;
    if ((rc = dp_object_new("Act", &o, NULL)) != 0) {
      dp_value_release(t);
      break;
    }
    if ((rc = dp_object_set(o, "t", t, NULL)) == 0) rc = dp_list_append(l, o, NULL);
    else dp_value_release(o);
  }
  if (rc == 0 && next_rand() % 4 == 0) rc = dp_list_append(l, dp_value_retain(l), NULL);  /* a cycle now and then */
  if (rc) {
    dp_value_release(l);
    return rc;
  }
  *out = l;
  return 0;
}

static void op_future(dp_cache_t *c, dp_device_t d) {
  dp_future_t *f, *child = NULL;
  if (dp_future_new(NULL, &f, NULL) != 0) return;
  int made = dp_future_then(f, cb, NULL, &child, NULL) == 0;
  if (made) atomic_fetch_add(&children, 1);
  dp_value_t v;
  int rc = make_value(c, d, &v);
  if (rc == 0) rc = dp_future_mark_completed(f, v, NULL);
  else {
    dp_error_t e;
    dp_error_clear(&e);
    e.code = rc;
    dp_future_set_error(f, &e, NULL);
  }
  if (rc == 0) dp_future_wait(child ? child : f, -1, NULL);
  if (made && !dp_future_is_done(child)) atomic_fetch_add(&lost, 1);
  dp_future_release(child);
  dp_future_release(f);
}

static void op_pickle(dp_cache_t *c, dp_device_t d) {
  dp_value_t v;
  if (make_value(c, d, &v) != 0) return;
  dp_frame_t *fr;
  if (dp_frame_new(&fr, NULL) == 0) {
    if (dp_pickle(v, NULL, fr, NULL) == 0) {
      size_t n;
      const uint8_t *b = dp_frame_data(fr, &n);
      dp_value_t back;
      if (dp_unpickle(b, n, NULL, &back, NULL) == 0) dp_value_release(back);
    }
    dp_frame_free(fr);
  }
  dp_value_release(v);
}

static void op_alloc(dp_cache_t *c, dp_device_t d) {
  void *p[8] = {0};
  dp_stream_t *u = NULL;
  dp_stream_pool_next(B, d, &u, NULL);
  for (int i = 0; i < 8; i++) {
    if (dp_cache_alloc(c, d, 512 + next_rand() % 200000, NULL, &p[i], NULL) != 0) continue;
    if (u && next_rand() % 2) dp_cache_record_stream(c, p[i], u, NULL);
  }
  for (int i = 0; i < 8; i++) dp_cache_dealloc(c, p[i], NULL);
  dp_cache_poll(c, NULL);
}

static void *worker(void *arg) {
  rng = (uint64_t)(uintptr_t)arg * 0x9E3779B97F4A7C15ull + 1;
  dp_cache_t *c;
  if (dp_cache_default(B, &c, NULL) != 0) return NULL;
  while (now() < deadline) {
    dp_device_t d = dp_backend_device(B, (int)(next_rand() % 2));
    switch (next_rand() % 3) {
      case 0: op_future(c, d); break;
      case 1: op_pickle(c, d); break;
      default: op_alloc(c, d); break;
    }
    atomic_fetch_add(&ops, 1);
  }
  return NULL;
}

int main(int argc, char **argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 10;
  int passed = 0, failed = 0;
  setenv("DEVPICKLE_BACKEND", "host", 1);
  dp_set_allocator(soak_alloc, NULL);
  if (dp_backend_get(DP_DEVICE_HOST, &B, NULL) != 0) return 1;
  deadline = now() + seconds;
  atomic_store(&injecting, 1);
  pthread_t th[4];
  for (intptr_t i = 0; i < 4; i++) pthread_create(&th[i], NULL, worker, (void *)(i + 1));
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  atomic_store(&injecting, 0);
  printf("soak: %.0f s, %ld operations, %ld allocations, %ld failed on purpose, %ld children, %ld callbacks\n", seconds,
         atomic_load(&ops), atomic_load(&allocs), atomic_load(&injected), atomic_load(&children), atomic_load(&callbacks));
#define CHECK(cond, ...) do { if (cond) passed++; else { failed++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)
  CHECK(atomic_load(&lost) == 0, "%ld child futures never completed (lost callbacks)", atomic_load(&lost));
  CHECK(atomic_load(&callbacks) <= atomic_load(&children), "%ld callbacks for %ld children", atomic_load(&callbacks),
        atomic_load(&children));
  dp_cache_t *c;
  dp_cache_default(B, &c, NULL);
  for (int d = 0; d < 2; d++) {
    dp_device_t dev = dp_backend_device(B, d);
    dp_device_synchronize(B, dev, NULL);
    dp_cache_stats_t st;
    CHECK(dp_cache_stats(c, dev, &st, NULL) == 0, "host:%d: no statistics", d);
    CHECK(st.allocated == 0 && st.allocs == st.frees && st.pending_blocks == 0,
          "host:%d: %zu bytes still allocated, %llu allocs, %llu frees, %zu pending", d, st.allocated,
          (unsigned long long)st.allocs, (unsigned long long)st.frees, st.pending_blocks);
  }
  dp_shutdown();
  CHECK(atomic_load(&live_blocks) == 0, "%ld blocks leaked", atomic_load(&live_blocks));
  CHECK(atomic_load(&injected) > 0, "no failure was injected: the soak proved nothing");
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
