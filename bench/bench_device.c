/* bench/bench_device.c — the caching allocator, record_stream, event record
 * and stream wait, per backend, against baselines measured in the same run.
 * Usage: bench_device OUT.json
 *
 * record_streams_own_N: the batched record (the hooks a future completes
 *   through) of N pointers, each its own 1 KiB block, on the stream they
 *   were allocated on (the no-op a completion makes for every allocation of
 *   its stream); ns per pointer; ratio: over the 1,000 row (the scaling).
 * stream_free_tied_300k (host): a request's streams — one that allocates 8
 *   blocks still in use when it is destroyed, one recorded as a use of 8
 *   blocks held — made and destroyed in a cache holding 300,000 blocks;
 *   ratio: over the same in a cache holding only those 8 (a destroyed
 *   stream costs the blocks it touched, not the cache's). */
#include <pthread.h>
#include <stdlib.h>

#include "bench.h"
#include "devpickle.h"
#ifdef DP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

typedef struct ctx {
  dp_backend_t *b;
  dp_device_t dev;
  dp_cache_t *cache;
  dp_stream_t *s, *u;
  dp_event_t *ev;
  void *block;
  pthread_mutex_t mu;
#ifdef DP_HAVE_CUDA
  cudaEvent_t raw_ev;
  cudaStream_t raw_s, raw_u;
#endif
} ctx_t;

static void cache_pair(void *p) {
  ctx_t *c = p;
  void *x;
  if (dp_cache_alloc(c->cache, c->dev, 4096, c->s, &x, NULL) != 0) exit(1);
  dp_cache_dealloc(c->cache, x, NULL);
}

static void malloc_pair(void *p) {
  (void)p;
  void *x = malloc(4096);
  __asm__ volatile("" : : "r"(x) : "memory");
  free(x);
}

static void record(void *p) {
  ctx_t *c = p;
  dp_cache_record_stream(c->cache, c->block, c->u, NULL);
}

static void mutex_pair(void *p) {
  ctx_t *c = p;
  pthread_mutex_lock(&c->mu);
  pthread_mutex_unlock(&c->mu);
}

static void ev_record(void *p) {
  ctx_t *c = p;
  dp_event_record(c->ev, c->s, NULL);
}

static void wait_event(void *p) {
  ctx_t *c = p;
  dp_stream_wait_event(c->u, c->ev, NULL);
}

static void setup(ctx_t *c, dp_backend_t *b) {
  memset(c, 0, sizeof *c);
  c->b = b;
  c->dev = dp_backend_device(b, 0);
  pthread_mutex_init(&c->mu, NULL);
  if (dp_cache_new(b, &c->cache, NULL) || dp_stream_new(b, c->dev, &c->s, NULL) ||
      dp_stream_new(b, c->dev, &c->u, NULL) || dp_event_new(b, c->dev, &c->ev, NULL) ||
      dp_cache_alloc(c->cache, c->dev, 4096, c->s, &c->block, NULL)) {
    fprintf(stderr, "bench_device: setup failed on %s\n", dp_backend_name(b));
    exit(1);
  }
}

static void teardown(ctx_t *c) {
  dp_stream_synchronize(c->s, NULL);
  dp_stream_synchronize(c->u, NULL);
  dp_cache_dealloc(c->cache, c->block, NULL);
  dp_event_free(c->ev);
  dp_cache_free(c->cache);
  dp_stream_free(c->s);
  dp_stream_free(c->u);
}

typedef struct batch {
  dp_cache_hooks_t h;
  void **ptrs;
  size_t n;
  dp_stream_t *s;
} batch_t;

static void record_batch(void *p) {
  batch_t *b = p;
  dp_cache_hooks_record(&b->h, b->ptrs, b->n, b->s, NULL);
}

static void record_batch_rows(const char *out, ctx_t *c) {
  static const size_t sizes[] = {1000, 10000, 100000};
  batch_t b = {dp_cache_hooks(c->cache), malloc(sizeof(void *) * 100000), 0, c->s};
  double one = 0;
  char row[64];
  for (int k = 0; k < 3; k++) {
    for (b.n = 0; b.n < sizes[k]; b.n++)
      if (dp_cache_alloc(c->cache, c->dev, 1024, c->s, &b.ptrs[b.n], NULL) != 0) exit(1);
    double t = bench_time(record_batch, &b, 7) / (double)b.n;
    if (k == 0) one = t;
    snprintf(row, sizeof row, "record_streams_own_%zu", b.n);
    bench_row(out, row, dp_backend_name(c->b), t * 1e9, "ns/ptr", t / one, "the 1,000 row (scaling factor)");
    for (size_t i = 0; i < b.n; i++) dp_cache_dealloc(c->cache, b.ptrs[i], NULL);
  }
  free(b.ptrs);
}

/* One request's streams, made and destroyed in cache ch (holding `held`). */
typedef struct churn {
  ctx_t *c;
  dp_cache_t *cache;
  void **held;
} churn_t;

static void stream_churn(churn_t *ch) {
  dp_stream_t *s, *u;
  void *q[8];
  if (dp_stream_new(ch->c->b, ch->c->dev, &s, NULL) || dp_stream_new(ch->c->b, ch->c->dev, &u, NULL)) exit(1);
  for (int k = 0; k < 8; k++) {
    if (dp_cache_alloc(ch->cache, ch->c->dev, 4096, s, &q[k], NULL) != 0) exit(1);
    if (dp_cache_record_stream(ch->cache, ch->held[k], u, NULL) != 0) exit(1);
  }
  dp_stream_free(s); /* its blocks still in use */
  dp_stream_free(u); /* recorded on blocks still held */
  for (int k = 0; k < 8; k++) dp_cache_dealloc(ch->cache, q[k], NULL);
}

static void churn_big(void *p) { stream_churn(&((churn_t *)p)[0]); }
static void churn_small(void *p) { stream_churn(&((churn_t *)p)[1]); }

static void stream_free_rows(const char *out, ctx_t *c) {
  enum { N = 300000 };
  churn_t ch[2] = {{c, NULL, malloc(sizeof(void *) * N)}, {c, NULL, malloc(sizeof(void *) * 8)}};
  size_t n[2] = {N, 8};
  for (int k = 0; k < 2; k++) {
    if (!ch[k].held || dp_cache_new(c->b, &ch[k].cache, NULL)) exit(1);
    for (size_t i = 0; i < n[k]; i++)
      if (dp_cache_alloc(ch[k].cache, c->dev, 512, c->s, &ch[k].held[i], NULL) != 0) exit(1);
  }
  double t, base;
  bench_pair(churn_big, churn_small, ch, 5, &t, &base);
  bench_row(out, "stream_free_tied_300k", dp_backend_name(c->b), t * 1e6, "us/request", t / base,
            "the same in a cache holding only its 8 blocks");
  for (int k = 0; k < 2; k++) {
    for (size_t i = 0; i < n[k]; i++) dp_cache_dealloc(ch[k].cache, ch[k].held[i], NULL);
    dp_cache_free(ch[k].cache);
    free(ch[k].held);
  }
}

#ifdef DP_HAVE_CUDA
static void cuda_pair(void *p) {
  (void)p;
  void *x;
  cudaMalloc(&x, 4096);
  cudaFree(x);
}

static void cuda_async_pair(void *p) {
  ctx_t *c = p;
  void *x;
  cudaMallocAsync(&x, 4096, c->raw_s);
  cudaFreeAsync(x, c->raw_s);
}

static void raw_record(void *p) {
  ctx_t *c = p;
  cudaEventRecord(c->raw_ev, c->raw_s);
}

static void raw_wait(void *p) {
  ctx_t *c = p;
  cudaStreamWaitEvent(c->raw_u, c->raw_ev, 0);
}
#endif

int main(int argc, char **argv) {
  const char *out = bench_out(argc, argv);
  dp_backend_t *host;
  if (dp_backend_get(DP_DEVICE_HOST, &host, NULL) != 0) return 1;
  ctx_t c;
  setup(&c, host);
  double t, base;
  bench_pair(cache_pair, malloc_pair, &c, 7, &t, &base);
  bench_row(out, "alloc_free_4k", "host", t * 1e9, "ns/pair", t / base, "malloc + free of 4 KiB (glibc)");
  bench_pair(record, mutex_pair, &c, 7, &t, &base);
  bench_row(out, "record_stream", "host", t * 1e9, "ns/call", t / base, "an uncontended mutex lock + unlock");
  bench_pair(ev_record, mutex_pair, &c, 7, &t, &base);
  bench_row(out, "event_record", "host", t * 1e9, "ns/call", t / base, "an uncontended mutex lock + unlock");
  bench_pair(wait_event, mutex_pair, &c, 5, &t, &base);
  bench_row(out, "stream_wait_event", "host", t * 1e9, "ns/call", t / base, "an uncontended mutex lock + unlock");
  record_batch_rows(out, &c);
  stream_free_rows(out, &c);
  teardown(&c);

#ifdef DP_HAVE_CUDA
  dp_backend_t *cuda;
  dp_error_t e;
  if (dp_backend_get(DP_DEVICE_CUDA, &cuda, &e) != 0) {
    printf("(cuda rows skipped: %s)\n", e.message);
  } else {
    setup(&c, cuda);
    c.raw_s = dp_stream_native(c.s);
    c.raw_u = dp_stream_native(c.u);
    cudaEventCreateWithFlags(&c.raw_ev, cudaEventDisableTiming);
    bench_pair(cache_pair, cuda_pair, &c, 7, &t, &base);
    bench_row(out, "alloc_free_4k", "cuda", t * 1e9, "ns/pair", t / base, "cudaMalloc + cudaFree of 4 KiB");
    double ta, tasync;
    bench_pair(cache_pair, cuda_async_pair, &c, 7, &ta, &tasync);
    bench_row(out, "alloc_free_4k_vs_async", "cuda", ta * 1e9, "ns/pair", ta / tasync,
              "cudaMallocAsync + cudaFreeAsync of 4 KiB on the same stream");
    bench_pair(record, mutex_pair, &c, 7, &t, &base);
    bench_row(out, "record_stream", "cuda", t * 1e9, "ns/call", t / base, "an uncontended mutex lock + unlock");
    bench_pair(ev_record, raw_record, &c, 7, &t, &base);
    bench_row(out, "event_record", "cuda", t * 1e9, "ns/call", t / base, "cudaEventRecord");
    bench_pair(wait_event, raw_wait, &c, 7, &t, &base);
    bench_row(out, "stream_wait_event", "cuda", t * 1e9, "ns/call", t / base, "cudaStreamWaitEvent");
    cudaStreamSynchronize(c.raw_s);
    cudaEventDestroy(c.raw_ev);
    record_batch_rows(out, &c);
    teardown(&c);
  }
#endif
  dp_shutdown();
  return 0;
}
