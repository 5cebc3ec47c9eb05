/* tools/demo.c — `devpickle demo`: the future pipeline end to end, on the
 * default backend (CUDA when a GPU is usable, else the host executor).
 *
 *  1. A producer stream fills two allocations with slow device work: one
 *     held by a generic user object, one by a custom C type that only knows
 *     how to reduce itself.
 *  2. A future is completed from the producer stream: it walks the value,
 *     finds both allocations and records one event per device.
 *  3. then(): the callback runs on a pool stream that waits on those events;
 *     it launches new device work (out = weights + 1, slowly) and returns the
 *     result inside a user-defined object.
 *  4. A consumer on a third stream waits on the child future and copies the
 *     result back: every byte is checked.
 *  5. The final value goes through an inline frame and back; its bytes are
 *     checked again.
 * Exits 1 if any check fails. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "demo.h"
#include "devpickle.h"

#ifdef DP_DEMO_CUDA
int demo_cuda_fill(void *stream, void *p, size_t n, unsigned char v, double ms);
int demo_cuda_add(void *stream, void *dst, const void *src, size_t n, unsigned char add, double ms);
#endif

#define NBYTES ((size_t)1 << 20)
#define SLOW_MS 30.0

static int failures;

/* A then() callback's own failure, as the library reports one: code and message. */
static int demo_err(dp_error_t *err, int code, const char *msg) {
  if (err) {
    err->code = code;
    snprintf(err->message, sizeof err->message, "%s", msg);
  }
  return code;
}

#define CHECK(cond, ...)                       \
  do {                                         \
    if (!(cond)) {                             \
      failures++;                              \
      fprintf(stderr, "demo: check failed: "); \
      fprintf(stderr, __VA_ARGS__);            \
      fputc('\n', stderr);                     \
    }                                          \
  } while (0)

static dp_backend_t *B;
static dp_cache_t *C;
static dp_device_t D;

/* ---- slow device work on either backend ---- */

typedef struct host_work {
  unsigned char *dst;
  const unsigned char *src;
  unsigned char v;
} host_work_t;

static void sleep_ms(double ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)((ms - (int)(ms / 1000) * 1000) * 1e6)};
  nanosleep(&ts, NULL);
}

static void host_fill(void *arg) {
  host_work_t *w = arg;
  sleep_ms(SLOW_MS);
  memset(w->dst, w->v, NBYTES);
  free(w);
}

static void host_add(void *arg) {
  host_work_t *w = arg;
  sleep_ms(SLOW_MS);
  for (size_t i = 0; i < NBYTES; i++) w->dst[i] = (unsigned char)(w->src[i] + w->v);
  free(w);
}

static int slow_fill(dp_stream_t *s, void *p, unsigned char v) {
#ifdef DP_DEMO_CUDA
  if (dp_backend_type(B) == DP_DEVICE_CUDA) return demo_cuda_fill(dp_stream_native(s), p, NBYTES, v, SLOW_MS) ? DP_ECUDA : 0;
#endif
  host_work_t *w = malloc(sizeof *w);
  *w = (host_work_t){p, NULL, v};
  return dp_host_launch(s, host_fill, w, NULL);
}

static int slow_add(dp_stream_t *s, void *dst, const void *src, unsigned char add) {
#ifdef DP_DEMO_CUDA
  if (dp_backend_type(B) == DP_DEVICE_CUDA) return demo_cuda_add(dp_stream_native(s), dst, src, NBYTES, add, SLOW_MS) ? DP_ECUDA : 0;
#endif
  host_work_t *w = malloc(sizeof *w);
  *w = (host_work_t){dst, src, add};
  return dp_host_launch(s, host_add, w, NULL);
}

/* ---- values ---- */

static void give_back(void *ud, dp_device_t d, void *base, size_t n) {
  (void)ud;
  (void)d;
  (void)n;
  dp_cache_dealloc(C, base, NULL);
}

/* A tensor over a fresh allocation from the caching allocator, on the
 * current stream; the storage gives the memory back when it dies. */
static dp_value_t device_tensor(void) {
  void *p = NULL;
  dp_storage_t *st;
  dp_value_t t = dp_none();
  int64_t shape[1] = {(int64_t)NBYTES};
  dp_error_t e;
  if (dp_cache_alloc(C, D, NBYTES, NULL, &p, &e) || dp_storage_new(D, p, NBYTES, give_back, NULL, &st, &e) ||
      dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &t, &e))
    CHECK(0, "allocating a tensor: %s", e.message);
  return t;
}

static void *base_of(dp_value_t t) { return dp_storage_base(dp_tensor_storage(t)); }

/* A custom C type: a quantization scale the library knows nothing about
 * except that it reduces to its tensor. */
typedef struct qscale {
  dp_value_t t;
} qscale_t;
static int qscale_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  int rc = dp_tuple_new(1, state, err);
  return rc ? rc : dp_seq_set(*state, 0, dp_value_retain(((qscale_t *)obj)->t), err);
}
static void qscale_destroy(void *obj) {
  dp_value_release(((qscale_t *)obj)->t);
  free(obj);
}
static const dp_type_t qscale_type = {"QuantScale", qscale_reduce, qscale_destroy};

/* Counts what the future asks of the allocator. */
static long record_calls, record_ptrs;
static dp_cache_hooks_t inner;
static int counting_record(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)ctx;
  record_calls++;
  record_ptrs += (long)n;
  return dp_cache_hooks_record(&inner, ptrs, n, s, err);
}

static void print_ptrs(const char *title, dp_value_t v) {
  dp_ptrset_t *set;
  dp_scan_opts_t o = {DP_SCAN_PATHS, 0};
  char dev[16];
  if (dp_ptrset_new(&set, NULL) || dp_scan(v, &o, set, NULL)) return;
  printf("%s:\n", title);
  for (size_t i = 0; i < dp_ptrset_count(set); i++) {
    dp_ptr_info_t p;
    dp_ptrset_get(set, i, &p, NULL);
    printf("  %-7s %p %8zu byte%s  refs %u  %s\n", dp_device_format(p.device, dev, sizeof dev), p.base, p.nbytes,
           p.nbytes == 1 ? " " : "s", p.refs, p.path);
  }
  dp_ptrset_free(set);
}

static void print_events(const char *who, dp_future_t *f) {
  char dev[16];
  size_t n = dp_future_nptrs(f);
  printf("%s: %zu allocation%s, events on", who, n, n == 1 ? "" : "s");
  for (size_t i = 0; i < dp_future_ndevices(f); i++)
    printf(" %s", dp_device_format(dp_future_device(f, i), dev, sizeof dev));
  printf("\n");
}

/* ---- then(): new device work, returned inside a user object ---- */

static int add_one(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  dp_value_t layer = dp_future_value(parent), weight;
  int rc = dp_object_get(layer, "weight", &weight, NULL);
  if (rc) return demo_err(err, rc, "the parent's value has no weight");
  dp_value_t out = device_tensor();  /* on the callback's stream (current) */
  dp_stream_t *cur;
  if ((rc = dp_current_stream(B, D, &cur, err)) != 0 || (rc = slow_add(cur, base_of(out), base_of(weight), 1)) != 0) {
    dp_value_release(out);
    return rc;
  }
  dp_value_t res;
  if ((rc = dp_object_new("Activation", &res, err)) != 0) {
    dp_value_release(out);
    return rc;
  }
  *result = res;
  return dp_object_set(res, "out", out, err);
}

/* Reads device memory into host memory for an inline frame. */
static int read_device(void *ud, dp_device_t dev, const void *src, size_t n, void *dst, dp_error_t *err) {
  (void)ud;
  dp_stream_t *s;
  int rc = dp_stream_default(B, dev, &s, err);
  if (rc == 0) rc = dp_memcpy_async(s, dst, src, n, err);
  return rc ? rc : dp_stream_synchronize(s, err);
}

static int check_bytes(const unsigned char *p, unsigned char want, const char *what) {
  size_t bad = 0;
  for (size_t i = 0; i < NBYTES; i++) bad += p[i] != want;
  CHECK(bad == 0, "%s: %zu of %zu bytes differ from 0x%02x (first byte 0x%02x)", what, bad, NBYTES, want, p[0]);
  return bad == 0;
}

/* The library's message less the names of its functions ("dp_backend_get(cuda): "),
 * which tell a user of the CLI nothing. */
static const char *reason(const char *msg) {
  while (strncmp(msg, "dp_", 3) == 0 && strstr(msg, ": ")) msg = strstr(msg, ": ") + 2;
  return msg;
}

/* B, from DEVPICKLE_BACKEND or the default (cuda where a GPU is usable,
 * else host); a failure says which backend was tried and how to pick
 * another, on one line. */
static int open_backend(void) {
  const char *env = getenv("DEVPICKLE_BACKEND");
  dp_error_t e;
  dp_error_clear(&e);
  if (dp_backend_default(&B, &e) == 0) return 0;
  fputs("devpickle: demo: ", stderr);
  if (env && *env && strcmp(env, "host") != 0 && strcmp(env, "cuda") != 0) {
    fputs("DEVPICKLE_BACKEND='", stderr);
    cli_put_text(stderr, env);
    fputs("' is no backend: set it to host or cuda, or unset it (then cuda where a GPU is usable, else host)\n",
          stderr);
  } else if (env && *env) {
    fprintf(stderr, "the %s backend (DEVPICKLE_BACKEND=%s) cannot start: ", env, env);
    cli_put_text(stderr, reason(e.message));
    fprintf(stderr, "; DEVPICKLE_BACKEND=%s runs the demo on the %s\n", *env == 'c' ? "host" : "cuda",
            *env == 'c' ? "host executor" : "GPU");
  } else {
    fputs("no backend could start (tried cuda where a GPU is usable, else host): ", stderr);
    cli_put_text(stderr, reason(e.message));
    fputs("; DEVPICKLE_BACKEND=host or DEVPICKLE_BACKEND=cuda forces one\n", stderr);
  }
  return -1;
}

int demo_run(int argc, char **argv) {
  for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++) /* --help answers wherever it comes before '--' */
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      puts("usage: devpickle demo\n\n"
           "Runs the future pipeline end to end on the default backend (CUDA when a GPU\n"
           "is usable, else the host executor; DEVPICKLE_BACKEND=host|cuda forces one):\n"
           "slow device work fills tensors held by a user object and a custom C type; a\n"
           "future completed from that stream discovers them; a then() callback launches\n"
           "new device work and returns it inside a user object; a consumer on a third\n"
           "stream checks every byte; the result goes through an inline frame and back.\n"
           "Prints on stdout the allocations with their paths, the events per device,\n"
           "the record_stream calls and the allocator's statistics; a failed check is\n"
           "one line on stderr. Exit status 0 when every check passes, 1 otherwise; 2\n"
           "usage.");
      if (fflush(stdout) == 0 && !ferror(stdout)) return 0;
      fprintf(stderr, "devpickle: <stdout>: write failed: %s\n", strerror(errno ? errno : EIO));
      return EXIT_DATA;
    }
  for (int i = 1, opts = 1; i < argc; i++) {
    if (opts && strcmp(argv[i], "--") == 0) { /* the end of the options, as for every command: none follow */
      opts = 0;
      continue;
    }
    /* as every usage error: an option or an argument, escaped (cli_put_text) */
    fprintf(stderr, "devpickle demo: %s '",
            opts && argv[i][0] == '-' && argv[i][1] ? "unknown option" : "unexpected argument");
    cli_put_text(stderr, argv[i]);
    fputs("'\nTry 'devpickle demo --help'.\n", stderr);
    return EXIT_USAGE;
  }
  dp_error_t e;
  dp_error_clear(&e);
  if (open_backend() != 0) return EXIT_DATA;
  if (dp_cache_default(B, &C, &e)) {
    fprintf(stderr, "devpickle: demo: the %s backend's caching allocator cannot start: %s\n", dp_backend_name(B),
            reason(e.message));
    return EXIT_DATA;
  }
  D = dp_backend_device(B, 0);
  char dev[16];
  printf("backend: %s (%d device%s), device %s\n", dp_backend_name(B), dp_backend_device_count(B),
         dp_backend_device_count(B) == 1 ? "" : "s", dp_device_format(D, dev, sizeof dev));

  dp_stream_t *producer, *consumer;
  if (dp_stream_new(B, D, &producer, &e) || dp_stream_new(B, D, &consumer, &e)) {
    fprintf(stderr, "devpickle: demo: %s\n", e.message);
    return EXIT_DATA;
  }
  inner = dp_cache_hooks(C);
  dp_cache_hooks_t counting = {NULL, NULL, counting_record, NULL};
  dp_future_opts_t fo = {B, &D, 1, &counting, 0, 0};

  /* 1. the producer's slow work fills a user object's tensors */
  CHECK(dp_set_current_stream(producer, NULL, &e) == 0, "current stream: %s", e.message);
  dp_value_t weight = device_tensor(), scale = device_tensor();
  CHECK(slow_fill(producer, base_of(weight), 0x41) == 0, "launching the producer's work");
  CHECK(slow_fill(producer, base_of(scale), 0x07) == 0, "launching the producer's work");
  qscale_t *q = malloc(sizeof *q);
  q->t = scale;
  dp_value_t layer, qs;
  dp_object_new("Linear", &layer, NULL);
  dp_object_set(layer, "weight", weight, NULL);
  dp_custom_new(&qscale_type, q, &qs, NULL);
  dp_object_set(layer, "scale", qs, NULL);
  print_ptrs("the value's allocations", layer);

  /* 2. complete a future from the producer stream */
  dp_future_t *f, *child;
  if (dp_future_new(&fo, &f, &e) || dp_future_mark_completed(f, layer, &e)) {
    fprintf(stderr, "devpickle: demo: %s\n", e.message);
    return EXIT_DATA;
  }
  print_events("future", f);
  CHECK(dp_future_nptrs(f) == 2, "the future found %zu allocations, expected 2", dp_future_nptrs(f));

  /* 3. then(): runs here, now, on a pool stream that waits on f's events */
  CHECK(dp_future_then(f, add_one, NULL, &child, &e) == 0, "then: %s", e.message);
  dp_error_t ce;
  CHECK(dp_future_error(child, &ce) == 0, "the callback failed: %s", ce.message);
  print_events("then() child", child);

  /* 4. a consumer on a third stream */
  CHECK(dp_set_current_stream(consumer, NULL, &e) == 0, "current stream: %s", e.message);
  CHECK(dp_future_wait(child, -1, &e) == 0, "wait: %s", e.message);
  dp_value_t out = dp_none();
  dp_object_get(dp_future_value(child), "out", &out, NULL);
  unsigned char *host = malloc(NBYTES);
  memset(host, 0, NBYTES);
  CHECK(dp_memcpy_async(consumer, host, base_of(out), NBYTES, &e) == 0, "copy: %s", e.message);
  CHECK(dp_stream_synchronize(consumer, &e) == 0, "sync: %s", e.message);
  if (check_bytes(host, 0x42, "the consumer's copy of the callback's result"))
    printf("consumer: all %zu bytes are 0x42 (0x41 + 1): the callback's device work had finished\n", NBYTES);
  print_ptrs("the child's value", dp_future_value(child));

  /* 5. a frame round trip of the final value */
  dp_frame_t *frame;
  dp_pickle_opts_t po = {DP_PICKLE_INLINE, 0, read_device, NULL};
  dp_value_t back = dp_none();
  CHECK(dp_frame_new(&frame, &e) == 0 && dp_pickle(dp_future_value(child), &po, frame, &e) == 0, "pickle: %s", e.message);
  size_t n;
  const uint8_t *bytes = dp_frame_data(frame, &n);
  CHECK(dp_unpickle(bytes, n, NULL, &back, &e) == 0, "unpickle: %s at byte %lld", e.message, (long long)e.offset);
  dp_value_t out2 = dp_none();
  if (dp_object_get(back, "out", &out2, NULL) == 0 && dp_value_kind(out2) == DP_TENSOR) {
    const unsigned char *copy = dp_storage_host_data(dp_tensor_storage(out2));
    CHECK(copy != NULL, "the inline frame carried no bytes");
    if (copy && check_bytes(copy, 0x42, "the frame's copy")) printf("frame: %zu-byte inline frame, round trip checked\n", n);
  } else {
    CHECK(0, "the unpickled value has no tensor 'out'");
  }

  printf("record_stream: %ld call%s covering %ld allocation%s\n", record_calls, record_calls == 1 ? "" : "s",
         record_ptrs, record_ptrs == 1 ? "" : "s");
  dp_cache_stats_t st;
  CHECK(dp_cache_stats(C, D, &st, &e) == 0, "stats: %s", e.message);
  printf("allocator: %zu byte%s allocated, %zu reserved, peak %zu, %llu hit%s, %zu pending block%s\n", st.allocated,
         st.allocated == 1 ? "" : "s", st.reserved, st.peak_allocated, (unsigned long long)st.cache_hits,
         st.cache_hits == 1 ? "" : "s", st.pending_blocks, st.pending_blocks == 1 ? "" : "s");

  dp_value_release(back);
  dp_frame_free(frame);
  free(host);
  dp_future_release(child);
  dp_future_release(f);
  dp_device_synchronize(B, D, NULL);
  dp_reset_current_stream(B, D);
  dp_stream_free(producer);
  dp_stream_free(consumer);
  dp_shutdown();
  printf("demo: %s\n", failures ? "FAILED" : "all checks passed");
  return failures ? EXIT_DATA : 0;
}
