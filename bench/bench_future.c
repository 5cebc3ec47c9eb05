/* bench/bench_future.c — completing, chaining and waiting on futures whose
 * values hold device allocations, per backend. Usage: bench_future OUT.json
 *
 * future_complete_{list,nested,objects}_N: dp_future_mark_completed of a
 *   value holding N tensors (N up to 100000), each on its own allocation from the backend's
 *   caching allocator: a list of N tensors; N x tuple(tensor, [view]); N user
 *   objects each holding a tensor. The future is created before the clock
 *   starts and released after it stops.
 * future_then_hop: dp_future_then on a completed future whose value holds one
 *   tensor; the callback returns the parent's value: one hop, the child
 *   complete when the call returns.
 * future_wait: dp_future_wait on a completed future with one device event.
 * threads_future_T: T threads at once, each building a list of 100 user
 *   objects holding a tensor (CPU storages), completing a fresh future with
 *   it, waiting, releasing both; value: iterations per second over all
 *   threads; ratio: over one thread (the scaling factor).
 * threads_spin_T, threads_malloc_T: the same harness over work that shares
 *   nothing (register arithmetic; malloc/free of the blocks an iteration
 *   builds): the host's own ceilings for the scaling factors (bench.h).
 * Ratios: against the scan alone (dp_scan of the same value), for completions;
 * against a bare dp_stream_wait_event for the wait; the then hop against
 * a completion of the same one-tensor value. */
#include <stdlib.h>

#include "bench.h"
#include "devpickle.h"

typedef struct ctx {
  dp_backend_t *b;
  dp_device_t dev;
  dp_cache_t *cache;
  dp_value_t v;
  void **blocks;
  size_t nblocks;
  dp_ptrset_t *set;
  dp_future_t **fs;
  int k;
  dp_future_t *done;
  dp_event_t *ev;
} ctx_t;

static dp_value_t tensor(ctx_t *c) {
  void *p;
  if (dp_cache_alloc(c->cache, c->dev, 1024, NULL, &p, NULL)) exit(1);
  c->blocks[c->nblocks++] = p;
  dp_storage_t *st;
  dp_value_t t;
  int64_t shape[1] = {256};
  if (dp_storage_new(c->dev, p, 1024, NULL, NULL, &st, NULL) || dp_tensor_new(st, DP_FLOAT32, 1, shape, NULL, 0, &t, NULL))
    exit(1);
  return t;
}

static dp_value_t make(ctx_t *c, const char *kind, int n) {
  dp_value_t l;
  dp_list_new((size_t)n, &l, NULL);
  for (int i = 0; i < n; i++) {
    dp_value_t t = tensor(c);
    if (kind[0] == 'l') {
      dp_list_append(l, t, NULL);
    } else if (kind[0] == 'n') {
      dp_value_t tup, inner, view;
      int64_t shape[1] = {128};
      dp_tensor_new(dp_storage_retain(dp_tensor_storage(t)), DP_FLOAT32, 1, shape, NULL, 128, &view, NULL);
      dp_list_new(1, &inner, NULL);
      dp_list_append(inner, view, NULL);
      dp_tuple_new(2, &tup, NULL);
      dp_seq_set(tup, 0, t, NULL);
      dp_seq_set(tup, 1, inner, NULL);
      dp_list_append(l, tup, NULL);
    } else {
      dp_value_t o;
      dp_object_new("Activation", &o, NULL);
      dp_object_set(o, "data", t, NULL);
      dp_list_append(l, o, NULL);
    }
  }
  return l;
}

static void release_blocks(ctx_t *c) {
  for (size_t i = 0; i < c->nblocks; i++) dp_cache_dealloc(c->cache, c->blocks[i], NULL);
  c->nblocks = 0;
}

static int hop_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  (void)err;
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

/* Fastest of `rounds` rounds of K operations: completions of fresh futures
 * (made before the clock starts) or then() hops on c->done. The futures are
 * released, and their device work drained, after the clock stops. */
enum { COMPLETE, HOP };
static double time_ops(ctx_t *c, int rounds, int op) {
  double best = 1e9;
  for (int r = 0; r < rounds; r++) {
    dp_future_opts_t o = {c->b, NULL, 0, NULL, 0, 0};
    if (op == COMPLETE)
      for (int i = 0; i < c->k; i++) dp_future_new(&o, &c->fs[i], NULL);
    double t0 = bench_now();
    for (int i = 0; i < c->k; i++) {
      if (op == COMPLETE) dp_future_mark_completed(c->fs[i], dp_value_retain(c->v), NULL);
      else dp_future_then(c->done, hop_cb, NULL, &c->fs[i], NULL);
    }
    double t = (bench_now() - t0) / c->k;
    for (int i = 0; i < c->k; i++) dp_future_release(c->fs[i]);
    dp_device_synchronize(c->b, c->dev, NULL);
    dp_cache_poll(c->cache, NULL);
    if (t < best) best = t;
  }
  return best;
}

static void run_scan(void *p) {
  ctx_t *c = p;
  dp_ptrset_clear(c->set);
  dp_scan(c->v, NULL, c->set, NULL);
}

/* The value's own memory, read in a plain loop (no set, no record): for
 * each item, every tensor it holds and its storage's base, through the
 * public accessors (a list item; a tuple's tensor and its list's view; an
 * object's attribute). Its cost per tensor at 10,000 and 100,000 against
 * 1,000 shows how merely reading the value grows on the host (issue 8's
 * 1.5x): a completion reads as many nodes (and a set and a record) but
 * fetches them ahead; the plain loop takes its misses one at a time. */
static volatile uintptr_t touched;
static char touch_kind;
static uintptr_t touch_tensor(dp_value_t t) { return (uintptr_t)dp_storage_base(dp_tensor_storage(t)); }
static void run_touch(void *p) {
  ctx_t *c = p;
  uintptr_t sum = 0;
  for (size_t i = 0, n = dp_seq_len(c->v); i < n; i++) {
    dp_value_t x = dp_seq_get(c->v, i);
    if (touch_kind == 'l') {
      sum += touch_tensor(x);
    } else if (touch_kind == 'n') {
      sum += touch_tensor(dp_seq_get(x, 0)) + touch_tensor(dp_seq_get(dp_seq_get(x, 1), 0));
    } else {
      dp_value_t a;
      if (dp_object_get(x, "data", &a, NULL) == 0) sum += touch_tensor(a);
    }
  }
  touched = sum;
}

static void run_wait(void *p) {
  ctx_t *c = p;
  dp_future_wait(c->done, -1, NULL);
}

static void run_raw_wait(void *p) {
  ctx_t *c = p;
  dp_stream_t *s;
  if (dp_current_stream(c->b, c->dev, &s, NULL) == 0) dp_stream_wait_event(s, c->ev, NULL);
}

static void bench_backend(const char *out, dp_backend_t *b) {
  ctx_t c = {0};
  c.b = b;
  c.dev = dp_backend_device(b, 0);
  c.blocks = malloc(sizeof(void *) * 200000);
  c.fs = malloc(sizeof(dp_future_t *) * 1000);
  dp_ptrset_new(&c.set, NULL);
  if (dp_cache_default(b, &c.cache, NULL)) exit(1);
  const char *name = dp_backend_name(b);
  static const char *const kinds[] = {"list", "nested", "objects"};
  static const int sizes[] = {1, 10, 100, 1000, 10000, 100000};
  char row[64];
  double touch_1000 = 1;
  for (int ki = 0; ki < 3; ki++)
    for (int si = 0; si < 6; si++) {
      int n = sizes[si];
      c.v = make(&c, kinds[ki], n);
      c.k = n >= 1000 ? 20 : n >= 100 ? 200 : 1000;
      double t = time_ops(&c, 5, COMPLETE);
      double ts = bench_time(run_scan, &c, 5);
      snprintf(row, sizeof row, "future_complete_%s_%d", kinds[ki], n);
      bench_row(out, row, name, t * 1e6, "us", t / ts, "dp_scan of the same value alone");
      if (n >= 1000) {
        touch_kind = kinds[ki][0];
        double tt = bench_time(run_touch, &c, 5);
        if (n == 1000) touch_1000 = tt / n;
        snprintf(row, sizeof row, "value_touch_%s_%d", kinds[ki], n);
        bench_row(out, row, name, tt / n * 1e9, "ns/tensor", tt / n / touch_1000,
                  "the same per tensor at 1,000 (a plain loop reading each tensor and its storage)");
      }
      dp_value_release(c.v);
      release_blocks(&c);
    }
  /* one hop, and a wait */
  c.v = make(&c, "list", 1);
  dp_future_opts_t o = {b, NULL, 0, NULL, 0, 0};
  dp_future_new(&o, &c.done, NULL);
  dp_future_mark_completed(c.done, dp_value_retain(c.v), NULL);
  c.k = 1000;
  double th = time_ops(&c, 5, HOP);
  double tc = time_ops(&c, 5, COMPLETE);
  bench_row(out, "future_then_hop", name, th * 1e6, "us", th / tc, "completing a future with the same value");
  dp_event_new(b, c.dev, &c.ev, NULL);
  dp_stream_t *cur;
  dp_current_stream(b, c.dev, &cur, NULL);
  dp_event_record(c.ev, cur, NULL);
  double tw, traw;
  bench_pair(run_wait, run_raw_wait, &c, 5, &tw, &traw);
  bench_row(out, "future_wait", name, tw * 1e6, "us", tw / traw, "a bare stream wait on one event");
  dp_device_synchronize(b, c.dev, NULL);
  dp_event_free(c.ev);
  dp_future_release(c.done);
  dp_value_release(c.v);
  release_blocks(&c);
  dp_ptrset_free(c.set);
  free(c.blocks);
  free(c.fs);
}

/* ---- threads: build, complete a future, wait, release ---- */

/* One iteration: a list of 100 user objects, each holding a tensor on its
 * own CPU storage (no device event or stream lock enters the figure), made
 * the value of a fresh future, waited on, then both released. */
static dp_backend_t *thread_backend;

static void thread_future(void *ctx, int thread) {
  (void)ctx;
  dp_value_t l = bench_thread_objects(thread);
  dp_future_opts_t o = {thread_backend, NULL, 0, NULL, 1, 0};
  dp_future_t *f;
  if (dp_future_new(&o, &f, NULL) || dp_future_mark_completed(f, dp_value_retain(l), NULL) ||
      dp_future_wait(f, -1, NULL))
    exit(1);
  dp_future_release(f);
  dp_value_release(l);
}

static void bench_thread_rows(const char *out, dp_backend_t *b) {
  thread_backend = b;
  bench_thread_scaling(out, thread_future, "threads_future", dp_backend_name(b));
  bench_thread_scaling(out, bench_thread_spin, "threads_spin", "cpu");
  bench_thread_scaling(out, bench_thread_malloc, "threads_malloc", "cpu");
}

int main(int argc, char **argv) {
  const char *out = bench_out(argc, argv);
  dp_backend_t *b;
  if (dp_backend_get(DP_DEVICE_HOST, &b, NULL) != 0) return 1;
  bench_backend(out, b);
  bench_thread_rows(out, b);
  dp_error_t e;
  if (dp_backend_get(DP_DEVICE_CUDA, &b, &e) == 0) bench_backend(out, b);
  else printf("(cuda rows skipped: %s)\n", e.message);
  dp_shutdown();
  return 0;
}
