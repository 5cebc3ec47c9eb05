/* Device layer on the host backend: ordering with real concurrency, events,
 * pools, the current stream, memory. CUDA runs in test/gpu/. */
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "../device/internal.h" /* dp__backend_inits */
#include "../core/table.h"   /* dp__hash_ptr: where a wrapper lands */

static void setup(void) {
  unsetenv("DEVPICKLE_BACKEND");
  unsetenv("DEVPICKLE_HOST_DEVICES");
  t_track();
}
static void teardown(void) {
  dp_shutdown();
  dp_set_allocator(NULL, NULL);
}
TestSuite(device, .init = setup, .fini = teardown);

static dp_backend_t *host(void) {
  dp_backend_t *b;
  dp_error_t e;
  int rc = dp_backend_get(DP_DEVICE_HOST, &b, &e);
  cr_assert_eq(rc, 0, "%s", e.message);
  return b;
}

#define H0 t_dev(DP_DEVICE_HOST, 0)
#define H1 t_dev(DP_DEVICE_HOST, 1)

static dp_stream_t *dflt(dp_backend_t *b, dp_device_t d) {
  dp_stream_t *s;
  OK(dp_stream_default(b, d, &s, T_ERR));
  return s;
}
static dp_stream_t *pooled(dp_backend_t *b, dp_device_t d) {
  dp_stream_t *s;
  OK(dp_stream_pool_next(b, d, &s, T_ERR));
  return s;
}
static dp_stream_t *current(dp_backend_t *b, dp_device_t d) {
  dp_stream_t *s;
  OK(dp_current_stream(b, d, &s, T_ERR));
  return s;
}


/* ---- slow producer, consumer on another stream ---- */

typedef struct cell {
  _Atomic int value;
  _Atomic int seen;
} cell_t;

static void slow_write(void *arg) {
  sleep_ms(60);  /* device work made slow on purpose */
  atomic_store(&((cell_t *)arg)->value, 42);
}

static void read_value(void *arg) {
  cell_t *c = arg;
  atomic_store(&c->seen, atomic_load(&c->value));
}

/* stderr into a temporary file until captured_line(), which puts it back
 * and gives the first line written there. */
typedef struct capture {
  FILE *file;
  int saved;
} capture_t;

static capture_t capture_stderr(void) {
  fflush(stderr);
  capture_t c = {tmpfile(), dup(2)};
  cr_assert_not_null(c.file);
  cr_assert_geq(c.saved, 0);
  cr_assert_eq(dup2(fileno(c.file), 2), 2);
  return c;
}

static void captured_line(capture_t *c, char *line, size_t size) {
  fflush(stderr);
  dup2(c->saved, 2);
  close(c->saved);
  line[0] = '\0';
  rewind(c->file);
  cr_assert_not_null(fgets(line, (int)size, c->file), "nothing was written on stderr");
  fclose(c->file);
}

/* s still runs what is launched on it. */
static void assert_stream_runs(dp_stream_t *s) {
  cell_t cell;
  atomic_init(&cell.value, 7);
  atomic_init(&cell.seen, -1);
  OK(dp_host_launch(s, read_value, &cell, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(atomic_load(&cell.seen), 7, "the stream still runs its work");
}

/* Holds its stream until *open is set: what a test asserts about work
 * still running stays true however late the test's own thread gets to it
 * (a loaded machine stalls it past any fixed sleep). Bounded (10 s), so
 * that a test that fails with the gate shut ends. */
static void hold_at_gate(void *arg) {
  for (int ms = 0; ms < 10000 && !atomic_load((_Atomic int *)arg); ms++) sleep_ms(1);
}

/* slow_write held at a gate: the write comes 60 ms after the gate opens */
typedef struct held_write {
  cell_t *cell;
  _Atomic int open;
} held_write_t;

static void write_when_open(void *arg) {
  held_write_t *h = arg;
  hold_at_gate(&h->open);
  slow_write(h->cell);
}

static int consumer_sees(int with_wait) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H0, &c, T_ERR));
  cell_t cell;
  atomic_init(&cell.value, 0);
  atomic_init(&cell.seen, -1);
  dp_event_t *ev;
  /* without the wait, the write is held until the read is done: the race
     is observed whenever the consumer's thread gets to run */
  held_write_t w = {&cell, with_wait};
  OK(dp_host_launch(a, write_when_open, &w, T_ERR));
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_event_record(ev, a, T_ERR));
  if (with_wait) OK(dp_stream_wait_event(c, ev, T_ERR));
  OK(dp_host_launch(c, read_value, &cell, T_ERR));
  OK(dp_stream_synchronize(c, T_ERR));
  int seen = atomic_load(&cell.seen);
  atomic_store(&w.open, 1);
  OK(dp_stream_synchronize(a, T_ERR));
  dp_event_free(ev);
  dp_stream_free(a);
  dp_stream_free(c);
  return seen;
}

/* dp_stream_free from a host function on that very stream would wait for
 * the function and free the worker running it: it frees nothing, says so
 * on stderr, and the stream keeps working. */
static void free_own_stream(void *arg) { dp_stream_free(arg); }

Test(device, freeing_a_stream_from_a_host_function_on_it_frees_nothing_and_says_so) {
  dp_stream_t *s;
  OK(dp_stream_new(host(), H0, &s, T_ERR));
  capture_t cap = capture_stderr();
  OK(dp_host_launch(s, free_own_stream, s, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  char line[256];
  captured_line(&cap, line, sizeof line);
  cr_assert_str_eq(line, "devpickle: dp_stream_free called from a host function on that stream: nothing freed (device.h)\n");
  assert_stream_runs(s);
  dp_stream_free(s); /* from here: freed */
}

/* dp_shutdown from a host function would join the worker running it,
 * after the queued work, its own call included: it hung, and so did every
 * wait on the stream. It tears nothing down, says so, and the backend
 * keeps working. */
static void shutdown_from_host_fn(void *arg) {
  (void)arg;
  dp_shutdown();
}

Test(device, shutting_down_from_a_host_function_tears_nothing_down_and_says_so, .timeout = 30) {
  dp_backend_t *b = host();
  dp_stream_t *s = dflt(b, H0);
  capture_t cap = capture_stderr();
  OK(dp_host_launch(s, shutdown_from_host_fn, NULL, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  char line[256];
  captured_line(&cap, line, sizeof line);
  cr_assert_str_eq(line, "devpickle: dp_shutdown called from a host function: nothing torn down (device.h)\n");
  dp_backend_t *again;
  OK(dp_backend_get(DP_DEVICE_HOST, &again, T_ERR));
  cr_assert_eq(again, b, "the backend was not stopped");
  assert_stream_runs(s);
}

/* dp_shutdown from a then() callback, from a release callback of a
 * storage that a future's release frees, or from a reduce() of the walk
 * that completes a future: the futures that frame runs on (the callback's
 * parent, the future being freed or completed) hold pooled events and
 * streams of the backend, and the callback's frame puts pool streams back
 * as current when it returns: the teardown freed them under it (ASan saw
 * the events freed twice). It tears nothing down, says so, and the
 * backend keeps working. */
static int copy_nothing(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  return 0;
}
static int shutdown_from_callback(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  dp_shutdown();
  return 0;
}
static void shutdown_from_release(void *ud, dp_device_t device, void *base, size_t nbytes) {
  (void)ud, (void)device, (void)base, (void)nbytes;
  dp_shutdown();
}
static int shutdown_from_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  (void)err;
  dp_shutdown();
  *state = dp_value_retain(*(dp_value_t *)obj);
  return 0;
}
static void drop_held(void *obj) { dp_value_release(*(dp_value_t *)obj); }
static const dp_type_t stops_type = {"Stops", shutdown_from_reduce, drop_held};

Test(device, shutting_down_from_a_futures_callback_completion_walk_or_release_tears_nothing_down_and_says_so) {
  dp_backend_t *b = host();
  for (int from = 0; from < 3; from++) { /* a then() callback, a release, a completion's walk */
    int from_release = from == 1;
    dp_cache_t *c;
    OK(dp_cache_default(b, &c, T_ERR));
    void *p;
    OK(dp_cache_alloc(c, H0, 64, NULL, &p, T_ERR));
    dp_storage_t *st;
    OK(dp_storage_new(H0, p, 64, from_release ? shutdown_from_release : NULL, NULL, &st, T_ERR));
    int64_t shape[1] = {16};
    dp_value_t t;
    OK(dp_tensor_new(st, DP_INT32, 1, shape, NULL, 0, &t, T_ERR));
    dp_value_t held = t;
    if (from == 2) OK(dp_custom_new(&stops_type, &held, &t, T_ERR));
    dp_future_t *f, *child = NULL;
    OK(dp_future_new(NULL, &f, T_ERR));
    OK(dp_future_then(f, from == 0 ? shutdown_from_callback : copy_nothing, NULL, &child, T_ERR));
    capture_t cap = capture_stderr();
    OK(dp_future_mark_completed(f, t, T_ERR)); /* an event on host:0, the callback on a pool stream */
    if (from_release) dp_future_release(f);     /* the value's last holder */
    char line[256];
    captured_line(&cap, line, sizeof line);
    cr_assert_str_eq(line,
                     "devpickle: dp_shutdown called while a future's callback, completion or release runs on this "
                     "thread: nothing torn down (future.h)\n");
    dp_backend_t *again;
    OK(dp_backend_get(DP_DEVICE_HOST, &again, T_ERR));
    cr_assert_eq(again, b, "the backend was not stopped");
    dp_cache_t *c2;
    OK(dp_cache_default(b, &c2, T_ERR));
    cr_assert_eq(c2, c, "the default cache was not freed");
    OK(dp_future_wait(child, 0, T_ERR));
    dp_future_release(child);
    if (!from_release) {
      OK(dp_future_synchronize(f, -1, T_ERR));
      dp_future_release(f);
    }
    OK(dp_cache_dealloc(c, p, T_ERR));
    assert_stream_runs(dflt(b, H0));
  }
}

/* The same from a host function freeing another stream that waits, through
 * an event recorded after the function on its own stream, for the function
 * itself: the free waited for that stream's work, which waited for the
 * function, and hung. It frees nothing, says so, and both streams work on. */
typedef struct free_other {
  dp_stream_t *other;
} free_other_t;

static void free_other_stream(void *arg) { dp_stream_free(((free_other_t *)arg)->other); }

Test(device, freeing_a_stream_that_waits_for_the_calling_host_function_frees_nothing_and_says_so, .timeout = 30) {
  dp_backend_t *b = host();
  dp_stream_t *mine, *other;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H1, &other, T_ERR));
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  free_other_t fo = {other};
  capture_t cap = capture_stderr();
  /* The function runs only once other waits: run before, it would free
     other under the test's next calls. */
  _Atomic int queued = 0;
  OK(dp_host_launch(mine, hold_at_gate, &queued, T_ERR));
  OK(dp_host_launch(mine, free_other_stream, &fo, T_ERR));
  OK(dp_event_record(ev, mine, T_ERR));      /* after the function */
  OK(dp_stream_wait_event(other, ev, T_ERR)); /* other waits for it */
  atomic_store(&queued, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  OK(dp_stream_synchronize(other, T_ERR));
  char line[256];
  captured_line(&cap, line, sizeof line);
  cr_assert_str_eq(line, "devpickle: dp_stream_free called from a host function, on a stream that waits for work queued "
                         "on the function's own stream after it: nothing freed (device.h)\n");
  assert_stream_runs(other);
  dp_event_free(ev);
  dp_stream_free(other);
  dp_stream_free(mine);
}

/* A provider that looks up the current stream of the device it is asked
 * about asked itself again without end, and the stack overflowed. */
typedef struct asking {
  int calls, rc;
  dp_error_t e;
} asking_t;

static dp_stream_t *provider_asking_itself(void *ud, dp_backend_t *b, dp_device_t dev) {
  asking_t *a = ud;
  a->calls++;
  dp_stream_t *s = NULL;
  dp_error_clear(&a->e);
  a->rc = dp_current_stream(b, dev, &s, &a->e);
  return NULL;
}

Test(device, a_stream_provider_that_asks_for_its_own_devices_current_stream_is_refused_not_recursed) {
  dp_backend_t *b = host();
  asking_t a = {0, 1, {0}};
  dp_set_stream_provider(provider_asking_itself, &a);
  dp_stream_t *s;
  OK(dp_current_stream(b, H1, &s, T_ERR));
  dp_set_stream_provider(NULL, NULL);
  cr_assert_eq(s, dflt(b, H1), "the provider gave none: the default stream");
  cr_assert_eq(a.calls, 1);
  cr_assert_eq(a.rc, DP_EMISUSE, "%s: %s", dp_err_name(a.rc), a.e.message);
  cr_assert_str_eq(a.e.message, "dp_current_stream(host:1): called while the stream provider is asked for that "
                                "device: it would ask itself again");
}

Test(device, a_stream_that_waits_on_an_event_sees_the_producers_writes) {
  for (int i = 0; i < 3; i++) cr_assert_eq(consumer_sees(1), 42, "the wait must order the read after the write");
}

Test(device, negative_control_without_the_wait_the_consumer_reads_stale_data) {
  cr_assert_eq(consumer_sees(0), 0, "without the wait the read runs before the slow write: the race is observable");
}

/* dp_stream_wait_stream: the consumer waits for everything queued on the
 * producer so far, without an event of the caller's. */
Test(device, a_stream_made_to_wait_for_another_sees_its_writes) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H1, &c, T_ERR));
  cell_t cell;
  atomic_init(&cell.value, 0);
  atomic_init(&cell.seen, -1);
  OK(dp_host_launch(a, slow_write, &cell, T_ERR));
  long before = t_live_blocks;
  OK(dp_stream_wait_stream(c, a, T_ERR));
  OK(dp_host_launch(c, read_value, &cell, T_ERR));
  OK(dp_stream_synchronize(c, T_ERR));
  cr_assert_eq(atomic_load(&cell.seen), 42, "the wait must order the read after the write");
  OK(dp_stream_wait_stream(c, c, T_ERR));  /* a no-op */
  dp_error_t e;
  cr_assert_eq(dp_stream_wait_stream(c, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wait_stream: NULL t (the stream waited for)");
  dp_stream_free(a);
  dp_stream_free(c);
  cr_assert_leq(t_live_blocks, before, "the event went back to the pool, the streams are gone");
}

Test(device, a_wait_does_not_block_the_host_thread) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H1, &c, T_ERR));
  cell_t cell;
  atomic_init(&cell.value, 0);
  atomic_init(&cell.seen, -1);
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  held_write_t w = {&cell, 0}; /* the write waits for this thread: a wait that blocked would wait 10 s */
  OK(dp_host_launch(a, write_when_open, &w, T_ERR));
  OK(dp_event_record(ev, a, T_ERR));
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  OK(dp_stream_wait_event(c, ev, T_ERR));  /* across devices */
  OK(dp_host_launch(c, read_value, &cell, T_ERR));
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
  cr_assert_lt(ms, 5000, "queueing the wait took %.1f ms: it blocked", ms);
  cr_assert_eq(dp_stream_query(c, NULL), 0, "the consumer stream is still waiting");
  atomic_store(&w.open, 1);
  OK(dp_stream_synchronize(c, T_ERR));
  cr_assert_eq(atomic_load(&cell.seen), 42);
  dp_event_free(ev);
  dp_stream_free(a);
  dp_stream_free(c);
}

/* ---- order, events, queries ---- */

typedef struct log {
  _Atomic int n;
  int order[2000];
} log_t;
typedef struct entry {
  log_t *log;
  int id;
} entry_t;
static void append(void *arg) {
  entry_t *e = arg;
  e->log->order[atomic_fetch_add(&e->log->n, 1)] = e->id;
}

Test(device, a_stream_runs_its_work_in_order) {
  dp_backend_t *b = host();
  dp_stream_t *s = dflt(b, H0);
  cr_assert_not_null(s);
  static log_t log;
  static entry_t es[2000];
  atomic_init(&log.n, 0);
  for (int i = 0; i < 2000; i++) {
    es[i] = (entry_t){&log, i};
    OK(dp_host_launch(s, append, &es[i], T_ERR));
  }
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(atomic_load(&log.n), 2000);
  for (int i = 0; i < 2000; i++) cr_assert_eq(log.order[i], i);
}

Test(device, events_and_streams_answer_queries_as_cuda_does) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  cr_assert_eq(dp_event_query(ev, NULL), 1, "a never-recorded event is complete");
  OK(dp_event_synchronize(ev, T_ERR));
  cr_assert_eq(dp_stream_query(s, NULL), 1, "an idle stream is complete");
  _Atomic int first = 0, second = 0; /* each task runs until its gate opens */
  OK(dp_host_launch(s, hold_at_gate, &first, T_ERR));
  OK(dp_event_record(ev, s, T_ERR));
  cr_assert_eq(dp_event_query(ev, NULL), 0);
  cr_assert_eq(dp_stream_query(s, NULL), 0);
  OK(dp_host_launch(s, hold_at_gate, &second, T_ERR));
  atomic_store(&first, 1);
  OK(dp_event_synchronize(ev, T_ERR));
  cr_assert_eq(dp_event_query(ev, NULL), 1);
  cr_assert_eq(dp_stream_query(s, NULL), 0, "work queued after the record is still running");
  OK(dp_event_record(ev, s, T_ERR));  /* re-record: captures the second task too */
  cr_assert_eq(dp_event_query(ev, NULL), 0);
  atomic_store(&second, 1);
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(dp_event_query(ev, NULL), 1);
  cr_assert_eq(dp_stream_query(s, NULL), 1);
  dp_event_free(ev);
  dp_stream_free(s);
}

Test(device, device_synchronize_waits_for_every_stream_of_the_device) {
  dp_backend_t *b = host();
  dp_stream_t *s[3];
  cell_t cells[3];
  for (int i = 0; i < 3; i++) {
    OK(dp_stream_new(b, H1, &s[i], T_ERR));
    atomic_init(&cells[i].value, 0);
    OK(dp_host_launch(s[i], slow_write, &cells[i], T_ERR));
  }
  OK(dp_device_synchronize(b, H1, T_ERR));
  for (int i = 0; i < 3; i++) cr_assert_eq(atomic_load(&cells[i].value), 42);
  for (int i = 0; i < 3; i++) dp_stream_free(s[i]);
}

Test(device, memcpy_runs_in_stream_order) {
  dp_backend_t *b = host();
  dp_stream_t *s = dflt(b, H0);
  void *dev;
  OK(dp_device_alloc(b, H0, 64, &dev, T_ERR));
  cell_t cell;
  atomic_init(&cell.value, 0);
  OK(dp_host_launch(s, slow_write, &cell, T_ERR));
  OK(dp_memcpy_async(s, dev, &cell.value, sizeof(int), T_ERR));
  int out = -1;
  OK(dp_memcpy_async(s, &out, dev, sizeof(int), T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(out, 42);
  OK(dp_device_dealloc(b, H0, dev, T_ERR));
}

/* ---- pools and the current stream ---- */

Test(device, the_stream_pool_hands_out_its_streams_round_robin) {
  dp_backend_t *b = host();
  dp_stream_t *first[4];
  for (int i = 0; i < 4; i++) first[i] = pooled(b, H0);
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++) cr_assert_neq(first[i], first[j]);
  for (int i = 0; i < 8; i++) cr_assert_eq(pooled(b, H0), first[i % 4]);
  cr_assert_neq(pooled(b, H1), first[0], "each device has its own pool");
  cr_assert_neq(dflt(b, H0), first[0]);
}

Test(device, released_events_are_reused_not_recreated) {
  dp_backend_t *b = host();
  dp_event_t *e1, *e2;
  OK(dp_event_new(b, H0, &e1, T_ERR));
  dp_event_free(e1);
  long before = t_alloc_count;
  OK(dp_event_new(b, H0, &e2, T_ERR));
  cr_assert_eq(e1, e2);
  cr_assert_eq(t_alloc_count, before, "acquiring from the pool allocates nothing");
  dp_event_free(e2);
}

typedef struct thread_arg {
  dp_backend_t *b;
  dp_stream_t *seen;
} thread_arg_t;

static void *read_current(void *p) {
  thread_arg_t *a = p;
  if (dp_current_stream(a->b, H0, &a->seen, NULL) != 0) a->seen = NULL;
  return NULL;
}

static dp_stream_t *provided;
static dp_stream_t *provider(void *ud, dp_backend_t *b, dp_device_t dev) {
  (void)ud;
  (void)b;
  return dev.index == 0 ? provided : NULL;
}

Test(device, the_current_stream_is_per_thread_and_falls_back_to_provider_then_default) {
  dp_backend_t *b = host();
  dp_stream_t *mine, *prev;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  cr_assert_eq(current(b, H0), dflt(b, H0));
  OK(dp_set_current_stream(mine, &prev, T_ERR));
  cr_assert_null(prev);
  cr_assert_eq(current(b, H0), mine);
  cr_assert_eq(current(b, H1), dflt(b, H1), "other devices are unaffected");
  thread_arg_t a = {b, NULL};
  pthread_t th;
  pthread_create(&th, NULL, read_current, &a);
  pthread_join(th, NULL);
  cr_assert_eq(a.seen, dflt(b, H0), "another thread does not see this thread's stream");
  provided = pooled(b, H0);
  dp_set_stream_provider(provider, NULL);
  pthread_create(&th, NULL, read_current, &a);
  pthread_join(th, NULL);
  cr_assert_eq(a.seen, provided, "threads without their own stream ask the provider");
  cr_assert_eq(current(b, H0), mine, "a thread's own stream wins over the provider");
  dp_reset_current_stream(b, H0);
  cr_assert_eq(current(b, H0), provided);
  dp_set_stream_provider(NULL, NULL);
  cr_assert_eq(current(b, H0), dflt(b, H0));
  dp_stream_free(mine);
}

static _Atomic int provider_calls;
static dp_stream_t *counting_provider(void *ud, dp_backend_t *b, dp_device_t dev) {
  atomic_fetch_add(&provider_calls, 1);
  return provider(ud, b, dev);
}

Test(device, shutdown_forgets_the_stream_provider) {
  dp_backend_t *b = host();
  provided = pooled(b, H0);
  dp_set_stream_provider(counting_provider, NULL);
  cr_assert_eq(current(b, H0), provided);
  dp_shutdown();  /* provided is freed: a provider still installed would hand it out */
  atomic_store(&provider_calls, 0);
  b = host();
  cr_assert_not_null(current(b, H0));
  cr_assert_eq(atomic_load(&provider_calls), 0, "the provider was asked after shutdown");
}

Test(device, a_thread_holds_current_streams_for_a_bounded_number_of_devices) {
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  dp_backend_t *b = host();
  cr_assert_eq(dp_backend_device_count(b), 20);
  for (int i = 0; i < DP_CURRENT_STREAM_SLOTS; i++)
    OK(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, i)), NULL, T_ERR));
  dp_error_t e;
  dp_stream_t *prev = (dp_stream_t *)&e; /* not NULL: the refusal writes NULL there */
  cr_assert_eq(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, 17)), &prev, &e), DP_ELIMIT);
  cr_assert_str_eq(e.message, "dp_set_current_stream(host:17): this thread already holds current streams for 16 devices");
  cr_assert_null(prev, "a refused call gives back no stream it replaced");
  cr_assert_eq(current(b, t_dev(DP_DEVICE_HOST, 17)), dflt(b, t_dev(DP_DEVICE_HOST, 17)), "and changes nothing");
  dp_reset_current_stream(b, t_dev(DP_DEVICE_HOST, 3));
  OK(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, 17)), NULL, T_ERR));
}

/* ---- backend selection ---- */

Test(device, the_host_device_count_comes_from_the_environment_and_is_checked) {
  setenv("DEVPICKLE_HOST_DEVICES", "0", 1);
  dp_backend_t *b;
  dp_error_t e;
  cr_assert_eq(dp_backend_get(DP_DEVICE_HOST, &b, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_get(host): DEVPICKLE_HOST_DEVICES='0': expected 1..64");
  setenv("DEVPICKLE_HOST_DEVICES", "3", 1);
  cr_assert_eq(dp_backend_device_count(host()), 3);
  unsetenv("DEVPICKLE_HOST_DEVICES");
  dp_shutdown();
  cr_assert_eq(dp_backend_device_count(host()), 2, "two host devices by default");
}

Test(device, forcing_cuda_without_a_gpu_is_an_error_not_a_fallback) {
  dp_backend_t *b;
  dp_error_t e;
  if (dp_backend_get(DP_DEVICE_CUDA, &b, NULL) == 0) cr_skip_test("a CUDA device is usable here");
  setenv("DEVPICKLE_BACKEND", "cuda", 1);
  cr_assert_eq(dp_backend_default(&b, &e), DP_ENODEV);
  cr_assert(strstr(e.message, "CUDA") != NULL, "the reason is given: %s", e.message);
  setenv("DEVPICKLE_BACKEND", "host", 1);
  OK_WITH(&e, dp_backend_default(&b, &e));
  cr_assert_str_eq(dp_backend_name(b), "host");
  unsetenv("DEVPICKLE_BACKEND");
  OK_WITH(&e, dp_backend_default(&b, &e));
  cr_assert_str_eq(dp_backend_name(b), "host", "without a GPU the default is host");
}

/* device.h: every failure names the function or the device. A bad
 * DEVPICKLE_BACKEND reaches callers through dp_future_new and
 * dp_transport_new too, where the bare variable named neither. */
Test(device, an_unknown_devpickle_backend_is_refused_naming_the_call_and_the_value) {
  dp_backend_t *b;
  dp_error_t e;
  setenv("DEVPICKLE_BACKEND", "tpu", 1);
  cr_assert_eq(dp_backend_default(&b, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_default: DEVPICKLE_BACKEND='tpu': expected host or cuda");
  /* the value is shown as a device name given to dp_device_parse is: one
     line, control characters escaped, a long one cut */
  setenv("DEVPICKLE_BACKEND", "cu\nda\x1b[2J0123456789012345678901234567890123456789", 1);
  cr_assert_eq(dp_backend_default(&b, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_default: DEVPICKLE_BACKEND='cu\\u000ada\\u001b[2J01234567890123456789012\u2026': expected host or cuda");
  unsetenv("DEVPICKLE_BACKEND");
}

/* The default backend falls back to host only where no GPU is usable:
 * running out of memory while starting cuda made it host silently, for the
 * rest of the process, on a machine whose GPU was there. */
Test(device, running_out_of_memory_starting_cuda_is_enomem_not_a_fallback_to_host) {
  dp_backend_t *b = NULL;
  dp_error_t e;
  dp_shutdown();
  unsetenv("DEVPICKLE_BACKEND");
  t_fail_at = t_alloc_count + 1; /* cuda's backend record, the first thing made */
  int rc = dp_backend_default(&b, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s: %s (backend %s)", dp_err_name(rc), e.message, rc ? "-" : dp_backend_name(b));
  cr_assert_str_eq(e.message, "dp_backend_get(cuda): out of memory creating a backend");
  OK_WITH(&e, dp_backend_default(&b, &e)); /* not kept: the next call asks again */
  dp_backend_t *cuda;
  cr_assert_str_eq(dp_backend_name(b), dp_backend_get(DP_DEVICE_CUDA, &cuda, NULL) == 0 ? "cuda" : "host");
}

Test(device, an_unavailable_cuda_is_asked_once_until_shutdown) {
  dp_backend_t *b;
  dp_error_t e, again;
  if (dp_backend_get(DP_DEVICE_CUDA, &b, NULL) == 0) cr_skip_test("a CUDA device is usable here");
  dp_shutdown();
  unsigned before = dp__backend_inits[DP_DEVICE_CUDA];
  cr_assert_eq(dp_backend_get(DP_DEVICE_CUDA, &b, &e), DP_ENODEV);
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(dp_backend_get(DP_DEVICE_CUDA, &b, &again), DP_ENODEV);
    cr_assert_str_eq(again.message, e.message, "the same reason each time");
    OK_WITH(&again, dp_backend_default(&b, &again));
    cr_assert_str_eq(dp_backend_name(b), "host");
  }
  cr_assert_eq(dp__backend_inits[DP_DEVICE_CUDA] - before, 1, "the driver was asked once, not at each call");
  dp_shutdown();
  cr_assert_eq(dp_backend_get(DP_DEVICE_CUDA, &b, NULL), DP_ENODEV);
  cr_assert_eq(dp__backend_inits[DP_DEVICE_CUDA] - before, 2, "dp_shutdown forgets the answer");
}

Test(device, devices_are_checked_against_the_backend) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  dp_error_t e;
  cr_assert_eq(dp_stream_new(b, t_dev(DP_DEVICE_HOST, 2), &s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_new: device host:2 does not belong to the host backend (2 devices)");
  cr_assert_eq(dp_stream_new(b, t_dev(DP_DEVICE_CUDA, 0), &s, &e), DP_EINVAL);
  cr_assert_eq(dp_stream_default(b, t_dev(DP_DEVICE_CPU, 0), &s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_default: device cpu does not belong to the host backend (2 devices)");
}

/* ---- memory ---- */

Test(device, host_memory_is_tagged_by_device_and_found_from_interior_pointers) {
  dp_backend_t *b = host();
  char *p0, *p1;
  OK(dp_device_alloc(b, H0, 1000, (void **)&p0, T_ERR));
  OK(dp_device_alloc(b, H1, 1000, (void **)&p1, T_ERR));
  cr_assert_eq((uintptr_t)p0 % 256, 0, "aligned like cudaMalloc");
  dp_device_t d;
  OK(dp_pointer_device(b, p0 + 999, &d, T_ERR));
  cr_assert(dp_device_equal(d, H0));
  OK(dp_pointer_device(b, p1, &d, T_ERR));
  cr_assert(dp_device_equal(d, H1));
  int local;
  cr_assert_eq(dp_pointer_device(b, &local, &d, NULL), DP_ENOTFOUND);
  cr_assert_eq(dp_pointer_device(b, p0 + 1000, &d, NULL), DP_ENOTFOUND, "one past the end is not inside");
  OK(dp_device_dealloc(b, H0, p0, T_ERR));
  cr_assert_eq(dp_pointer_device(b, p0, &d, NULL), DP_ENOTFOUND);
  OK(dp_device_dealloc(b, H1, p1, T_ERR));
}

Test(device, a_memory_limit_makes_host_allocations_fail_cleanly) {
  OK(dp_host_set_memory_limit(H1, 4096, T_ERR));
  dp_backend_t *b = host();
  void *p, *q;
  dp_error_t e;
  OK_WITH(&e, dp_device_alloc(b, H1, 4000, &p, &e));
  cr_assert_eq(dp_device_alloc(b, H1, 200, &q, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_device_alloc(host:1): out of memory: 200 bytes asked, 4000 of 4096 in use");
  OK(dp_device_alloc(b, H0, 8000, &q, &e));
  OK(dp_device_dealloc(b, H1, p, T_ERR));
  OK(dp_device_dealloc(b, H0, q, T_ERR));
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
}

Test(device, a_host_memory_limit_may_be_set_before_the_backend_starts_on_any_host_device_and_outlives_shutdown) {
  dp_error_t e;
  /* host:5 is past this backend's 2 devices, yet one of host:0..host:63 */
  OK(dp_host_set_memory_limit(t_dev(DP_DEVICE_HOST, 5), 1, T_ERR));
  cr_assert_eq(dp_host_set_memory_limit(t_dev(DP_DEVICE_HOST, 64), 1, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_host_set_memory_limit: host:64 is not a host device (host:0..host:63)");
  OK(dp_host_set_memory_limit(t_dev(DP_DEVICE_HOST, 5), 0, T_ERR));
  OK(dp_host_set_memory_limit(H1, 100, T_ERR)); /* no backend yet */
  dp_backend_t *b = host();
  void *p;
  cr_assert_eq(dp_device_alloc(b, H1, 101, &p, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_device_alloc(host:1): out of memory: 101 bytes asked, 0 of 100 in use");
  dp_shutdown();
  b = host();
  cr_assert_eq(dp_device_alloc(b, H1, 101, &p, &e), DP_ENOMEM, "the cap is kept across dp_shutdown");
  OK(dp_device_alloc(b, H1, 100, &p, T_ERR));
  cr_assert_eq(dp_device_alloc(b, H1, 0, &p, &e), DP_ENOMEM, "a 0-byte allocation counts as 1 byte");
  cr_assert_str_eq(e.message, "dp_device_alloc(host:1): out of memory: 1 bytes asked, 100 of 100 in use");
  OK(dp_device_dealloc(b, H1, p, T_ERR));
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
}

Test(device, deallocating_null_frees_nothing_but_still_checks_the_backend_and_device) {
  dp_backend_t *b = host();
  dp_error_t e;
  OK(dp_device_dealloc(b, H0, NULL, T_ERR));
  cr_assert_eq(dp_device_dealloc(b, t_dev(DP_DEVICE_CUDA, 0), NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_dealloc: device cuda:0 does not belong to the host backend (2 devices)");
  cr_assert_eq(dp_device_dealloc(NULL, H0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_dealloc: NULL backend");
}

Test(device, a_device_name_is_parsed_only_as_dp_device_format_writes_it_and_a_refusal_leaves_out_alone) {
  dp_device_t d = t_dev(DP_DEVICE_HOST, 7);
  dp_error_t e;
  const char *bad[] = {"host:00", "cuda:0255", "host:+1", "host: 1", "host:1 ", "CPU", "cpu:0", "host:256"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    cr_assert_eq(dp_device_parse(bad[i], &d, &e), DP_EINVAL, "%s", bad[i]);
    char want[128];
    snprintf(want, sizeof want, "dp_device_parse: '%s' is not a device (cpu, cuda:N or host:N, N 0..255)", bad[i]);
    cr_assert_str_eq(e.message, want);
    cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_HOST, 7)), "out is left as it was");
  }
  OK(dp_device_parse("cuda:255", &d, T_ERR));
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_CUDA, 255)));
}

/* ---- shutdown ---- */

struct other_thread {
  pthread_barrier_t bar;
  dp_stream_t *after, *fresh_default;
  dp_backend_t *fresh;
};

static void *set_current_then_look_after_shutdown(void *arg) {
  struct other_thread *t = arg;
  dp_backend_t *b = host();
  OK(dp_set_current_stream(pooled(b, H0), NULL, T_ERR));
  pthread_barrier_wait(&t->bar); /* the main thread shuts down */
  pthread_barrier_wait(&t->bar);
  t->fresh = host();
  t->fresh_default = dflt(t->fresh, H0);
  OK(dp_current_stream(t->fresh, H0, &t->after, T_ERR));
  return NULL;
}

Test(device, shutdown_forgets_the_current_streams_of_every_thread_not_only_its_own) {
  struct other_thread t = {0};
  pthread_barrier_init(&t.bar, NULL, 2);
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, set_current_then_look_after_shutdown, &t), 0);
  pthread_barrier_wait(&t.bar);
  dp_shutdown(); /* frees the stream the other thread made current */
  pthread_barrier_wait(&t.bar);
  pthread_join(th, NULL);
  pthread_barrier_destroy(&t.bar);
  cr_assert_eq(t.after, t.fresh_default, "the thread gets the new backend's default stream, not the freed one");
  cr_assert_eq(dp_stream_backend(t.after), t.fresh);
}


Test(device, shutdown_joins_every_thread_and_frees_everything) {
  dp_backend_t *b = host();
  for (int i = 0; i < 4; i++) (void)pooled(b, H0);
  dp_stream_t *s;
  OK(dp_stream_new(b, H1, &s, T_ERR));
  cell_t cell;
  atomic_init(&cell.value, 0);
  OK(dp_host_launch(dflt(b, H0), slow_write, &cell, T_ERR));
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_event_record(ev, dflt(b, H0), T_ERR));
  dp_event_free(ev);
  dp_stream_free(s);
  void *p;
  OK(dp_device_alloc(b, H0, 100, &p, T_ERR));  /* not freed: shutdown frees it */
  dp_shutdown();
  cr_assert_eq(atomic_load(&cell.value), 42, "queued work ran before the threads stopped");
  ASSERT_NO_LEAK();
  OK(dp_backend_get(DP_DEVICE_HOST, &b, T_ERR));  /* and it starts again */
  cr_assert_not_null(dflt(b, H0));
}

/* ---- errors and NULL ---- */

/* Every function that can fail says so through its code and err: a NULL
 * handle or out pointer is DP_EINVAL with the function's name (never a
 * crash, never a code of another meaning); the _free functions take NULL. */
Test(device, null_arguments_are_einval_with_a_message_and_free_takes_null) {
  dp_backend_t *b = host();
  dp_error_t e;
  dp_stream_t *s;
  dp_device_t d;
  int local;
  cr_assert_eq(dp_stream_query(NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_query: NULL stream");
  cr_assert_eq(dp_event_query(NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_event_query: NULL event");
  cr_assert_eq(dp_stream_default(b, H0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_default: NULL out");
  cr_assert_eq(dp_stream_pool_next(NULL, H0, &s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_pool_next: NULL backend");
  cr_assert_eq(dp_current_stream(b, H0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_current_stream: NULL out");
  cr_assert_eq(dp_set_current_stream(NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_set_current_stream: NULL stream");
  cr_assert_eq(dp_event_new(b, H0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_event_new: NULL out");
  cr_assert_eq(dp_pointer_device(NULL, &local, &d, &e), DP_EINVAL, "a NULL backend is not a pointer not found");
  cr_assert_str_eq(e.message, "dp_pointer_device: NULL backend");
  void *mine;
  OK(dp_device_alloc(b, H0, 16, &mine, T_ERR));
  cr_assert_eq(dp_pointer_device(b, mine, NULL, &e), DP_EINVAL, "a NULL out is refused, even for memory of the backend");
  cr_assert_str_eq(e.message, "dp_pointer_device: NULL out");
  OK(dp_device_dealloc(b, H0, mine, T_ERR));
  cr_assert_eq(dp_stream_wait_stream(NULL, NULL, &e), DP_EINVAL);
  dp_stream_free(NULL);
  dp_event_free(NULL);
  OK(dp_device_dealloc(b, H0, NULL, T_ERR));
}

Test(device, devices_of_another_backend_are_reported_not_ignored) {
  dp_backend_t *b = host();
  dp_error_t e;
  void *p;
  OK(dp_device_alloc(b, H0, 64, &p, T_ERR));
  cr_assert_eq(dp_device_dealloc(b, t_dev(DP_DEVICE_CUDA, 0), p, &e), DP_EINVAL, "the memory is not freed silently");
  cr_assert_str_eq(e.message, "dp_device_dealloc: device cuda:0 does not belong to the host backend (2 devices)");
  OK(dp_device_dealloc(b, H0, p, &e));
  cr_assert_eq(dp_host_set_memory_limit(t_dev(DP_DEVICE_CUDA, 0), 1, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_host_set_memory_limit: cuda:0 is not a host device (host:0..host:63)");
  int local;
  dp_device_t d;
  cr_assert_eq(dp_pointer_device(b, &local, &d, &e), DP_ENOTFOUND);
  cr_assert(strstr(e.message, "not memory of the host backend") != NULL, "%s", e.message);
}

/* A default stream that cannot be made reports the backend's reason, and a
 * later call tries again. */
Test(device, a_stream_that_cannot_be_made_reports_why_and_is_tried_again) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  dp_error_t e;
  t_fail_at = t_alloc_count + 1;
  cr_assert_eq(dp_stream_default(b, H0, &s, &e), DP_ENOMEM);
  t_fail_at = 0;
  cr_assert_str_eq(e.message, "dp_stream_default(host:0): out of memory creating a stream");
  OK(dp_stream_default(b, H0, &s, &e));
  cr_assert_not_null(s);
}

/* Host work still queued when dp_shutdown runs may ask for a backend: the
 * shutdown stops the backends without holding the registry's lock, so that
 * work completes (it gets a new backend, which the next shutdown stops). */
typedef struct late_get {
  _Atomic int rc;
  dp_backend_t *_Atomic b;
} late_get_t;

static void sleep_60(void *arg) {
  (void)arg;
  sleep_ms(60);  /* keeps the next task queued until dp_shutdown has begun */
}

static void get_backend(void *arg) {
  late_get_t *g = arg;
  dp_backend_t *b = NULL;
  atomic_store(&g->rc, dp_backend_get(DP_DEVICE_HOST, &b, NULL));
  atomic_store(&g->b, b);
}

Test(device, shutdown_returns_when_queued_host_work_asks_for_a_backend, .timeout = 20) {
  dp_backend_t *b = host();
  late_get_t g;
  atomic_init(&g.rc, -1);
  atomic_init(&g.b, NULL);
  OK(dp_host_launch(dflt(b, H0), sleep_60, NULL, T_ERR));
  OK(dp_host_launch(dflt(b, H0), get_backend, &g, T_ERR));
  dp_shutdown();
  cr_assert_eq(atomic_load(&g.rc), 0, "the queued work ran to its end");
  cr_assert_not_null(atomic_load(&g.b));
  dp_shutdown();  /* the backend the work started */
  ASSERT_NO_LEAK();
}

/* Work that runs while dp_shutdown stops its backend may still use the
 * backend it was given (device.h: queued host work completes before
 * dp_shutdown returns): events and streams it makes there are freed with
 * the backend. The backend's events and streams were torn down before
 * the caller's streams were stopped: what the work made then was leaked,
 * on mutexes already destroyed. */
typedef struct during_shutdown {
  dp_backend_t *b;
  dp_stream_t *own;
  _Atomic int rc;
} during_shutdown_t;

static void use_backend_during_shutdown(void *arg) {
  during_shutdown_t *w = arg;
  dp_backend_t *now = w->b;
  while (now == w->b) { /* until dp_shutdown has taken the backend out of the registry */
    sleep_ms(1);
    if (dp_backend_get(DP_DEVICE_HOST, &now, NULL) != 0) return;
  }
  dp_event_t *ev;
  dp_stream_t *pool;
  int rc = dp_event_new(w->b, H1, &ev, NULL);
  if (rc == 0) {
    rc = dp_event_record(ev, w->own, NULL);
    dp_event_free(ev);
  }
  if (rc == 0) rc = dp_stream_pool_next(w->b, H0, &pool, NULL);
  atomic_store(&w->rc, rc);
}

Test(device, host_work_running_during_shutdown_may_use_its_backend_and_leaks_nothing, .timeout = 20) {
  during_shutdown_t w = {host(), NULL, -1};
  w.own = dflt(w.b, H1);
  OK(dp_host_launch(w.own, use_backend_during_shutdown, &w, T_ERR));
  dp_shutdown();
  cr_assert_eq(atomic_load(&w.rc), 0, "the work made an event and a stream of its backend");
  dp_shutdown(); /* the backend the work's dp_backend_get started */
  ASSERT_NO_LEAK();
}

/* An event, and a wait queued on another stream, outlive the stream they
 * were recorded on: dp_stream_free waits for its work, so both count as
 * complete after it, and a wait that runs only once the stream is gone
 * (held behind a gate) still lets the work after it see the writes. */
Test(device, an_event_and_a_queued_wait_outlive_the_stream_they_were_recorded_on, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s, *t;
  dp_event_t *ev;
  cell_t cell;
  atomic_init(&cell.value, 0);
  atomic_init(&cell.seen, -1);
  _Atomic int open;
  atomic_init(&open, 0);
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_stream_new(b, H1, &t, T_ERR));
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_host_launch(s, slow_write, &cell, T_ERR));
  OK(dp_event_record(ev, s, T_ERR));
  OK(dp_host_launch(t, hold_at_gate, &open, T_ERR));
  OK(dp_stream_wait_event(t, ev, T_ERR));
  OK(dp_host_launch(t, read_value, &cell, T_ERR));
  dp_stream_free(s);
  cr_assert_eq(atomic_load(&cell.value), 42, "dp_stream_free returned before the stream's work completed");
  cr_assert_eq(dp_event_query(ev, NULL), 1, "the event of a freed stream is complete");
  OK(dp_event_synchronize(ev, T_ERR));
  atomic_store(&open, 1);
  OK(dp_stream_wait_event(t, ev, T_ERR));
  OK(dp_stream_synchronize(t, T_ERR));
  cr_assert_eq(atomic_load(&cell.seen), 42, "the wait queued before the free ordered the read after the write");
  dp_event_t *again;
  OK(dp_event_new(b, H1, &again, T_ERR));
  OK(dp_event_record(again, t, T_ERR));
  dp_event_free(again);
  dp_event_free(ev);
  dp_stream_free(t);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A stream freed while it is this thread's current stream stops being
 * current: the next dp_current_stream falls back to the default. */
Test(device, freeing_the_current_stream_makes_it_no_longer_current) {
  dp_backend_t *b = host();
  dp_stream_t *s, *other, *d0 = dflt(b, H0), *d1 = dflt(b, H1);
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_stream_new(b, H1, &other, T_ERR));
  OK(dp_set_current_stream(s, NULL, T_ERR));
  OK(dp_set_current_stream(other, NULL, T_ERR));
  dp_stream_free(s);
  cr_assert_eq(current(b, H0), d0, "the freed stream is still current");
  cr_assert_eq(current(b, H1), other, "other devices' current streams stay");
  dp_stream_free(other);
  cr_assert_eq(current(b, H1), d1);
}

/* Accessors cannot fail: a NULL handle gives a neutral value (base.h), and
 * a device index out of the backend's range gives {DP_DEVICE_CPU, 0}. */
Test(device, accessors_give_neutral_values_for_null_handles_and_bad_indices) {
  cr_assert_eq(dp_backend_type(NULL), DP_DEVICE_CPU);
  cr_assert_null(dp_backend_name(NULL));
  cr_assert_eq(dp_backend_device_count(NULL), 0);
  dp_device_t d = dp_backend_device(NULL, 0);
  cr_assert(d.type == DP_DEVICE_CPU && d.index == 0);
  cr_assert_null(dp_stream_backend(NULL));
  d = dp_stream_device(NULL);
  cr_assert(d.type == DP_DEVICE_CPU && d.index == 0);
  cr_assert_null(dp_stream_native(NULL));
  d = dp_event_device(NULL);
  cr_assert(d.type == DP_DEVICE_CPU && d.index == 0);
  dp_backend_t *b = host();
  d = dp_backend_device(b, 1);
  cr_assert(d.type == DP_DEVICE_HOST && d.index == 1);
  int bad[] = {-1, 2, 255, 256};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    d = dp_backend_device(b, bad[i]);
    cr_assert(d.type == DP_DEVICE_CPU && d.index == 0, "index %d gave %d:%d", bad[i], d.type, d.index);
  }
}

/* The error messages name the function called and say what was wrong. */
Test(device, backend_lookups_name_the_function_and_the_unknown_type) {
  dp_backend_t *b;
  dp_error_t e;
  cr_assert_eq(dp_backend_get((dp_device_type_t)77, &b, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_get: no backend for device type 77");
  cr_assert_eq(dp_backend_get(DP_DEVICE_CPU, &b, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_get: no backend for device type 0 (cpu has no streams)");
  cr_assert_eq(dp_backend_get(DP_DEVICE_HOST, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_get: NULL out");
  cr_assert_eq(dp_backend_default(NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_backend_default: NULL out");
}

/* A zero-byte copy queues nothing and takes NULL pointers (the worker never
 * calls memmove with them: UBSan in make test-asan reports that). */
Test(device, a_zero_byte_copy_takes_null_pointers_and_does_nothing) {
  dp_backend_t *b = host();
  dp_stream_t *s = dflt(b, H0);
  OK(dp_memcpy_async(s, NULL, NULL, 0, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_memcpy_async(NULL, NULL, NULL, 0, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_memcpy_async: NULL stream");
}

/* Giving back memory the backend did not hand out (or handed out on another
 * device) is an error, not a silent success. */
Test(device, deallocating_memory_the_backend_did_not_hand_out_is_einval) {
  dp_backend_t *b = host();
  dp_error_t e;
  int local;
  cr_assert_eq(dp_device_dealloc(b, H0, &local, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "is not an allocation of host:0") != NULL, "%s", e.message);
  void *p;
  OK(dp_device_alloc(b, H1, 64, &p, T_ERR));
  cr_assert_eq(dp_device_dealloc(b, H0, p, &e), DP_EINVAL, "host:1's memory is not host:0's");
  OK(dp_device_dealloc(b, H1, p, T_ERR));
  cr_assert_eq(dp_device_dealloc(b, H1, p, &e), DP_EINVAL, "twice is once too many");
  OK(dp_device_dealloc(b, H1, NULL, T_ERR));
}

/* Memory given back while work queued on the device still uses it: the
 * host backend freed it at once, so the copy queued into it wrote freed
 * memory — where the same code on a GPU is correct, since cudaFree first
 * waits for the device's work. It waits too now: for every stream of the
 * device, the backend's and the caller's. */
static void nap_200ms(void *arg) {
  (void)arg;
  sleep_ms(200);
}

Test(device, deallocating_waits_for_the_work_queued_on_the_device_as_cudafree_does) {
  dp_backend_t *b = host();
  dp_stream_t *s, *d = dflt(b, H0);
  OK(dp_stream_new(b, H0, &s, T_ERR));
  static char src[4096];
  void *p;
  OK(dp_device_alloc(b, H0, sizeof src, &p, T_ERR));
  OK(dp_host_launch(s, nap_200ms, NULL, T_ERR));
  OK(dp_memcpy_async(s, p, src, sizeof src, T_ERR)); /* into p, once the nap is over */
  OK(dp_host_launch(d, nap_200ms, NULL, T_ERR));
  OK(dp_device_dealloc(b, H0, p, T_ERR));
  cr_assert_eq(dp_stream_query(s, NULL), 1, "the copy into p ran before p was freed");
  cr_assert_eq(dp_stream_query(d, NULL), 1, "the backend's streams are waited on too");
  dp_stream_free(s);
}

/* A pointer the backend did not hand out (or took back already) is refused
 * at once: the free first drained the device, so that a double free or a
 * foreign pointer waited for every stream of the device — here, for work
 * the caller lets go only after the call returns — before it was told
 * DP_EINVAL. */
typedef struct gate {
  _Atomic int open, queried;
} gate_t;

static void wait_gate(void *arg) {
  while (!atomic_load(&((gate_t *)arg)->open)) sleep_ms(1);
}

/* Opens the gate once the test has looked at the stream, or after 10 s:
 * a refusal that waited for the device returns only then, and finds the
 * stream idle. */
static void *open_gate_later(void *arg) {
  gate_t *g = arg;
  for (int ms = 0; ms < 10000 && !atomic_load(&g->queried); ms++) sleep_ms(1);
  atomic_store(&g->open, 1);
  return NULL;
}

Test(device, a_bad_pointer_is_refused_without_waiting_for_the_device, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  void *p;
  OK(dp_device_alloc(b, H0, 64, &p, T_ERR));
  OK(dp_device_dealloc(b, H0, p, T_ERR));
  gate_t g = {0};
  OK(dp_host_launch(s, wait_gate, &g, T_ERR));
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, open_gate_later, &g), 0);
  static char local[64];
  dp_error_t e;
  cr_assert_eq(dp_device_dealloc(b, H0, p, &e), DP_EINVAL, "freed twice");
  cr_assert_eq(dp_device_dealloc(b, H0, local, &e), DP_EINVAL, "never handed out");
  int busy = dp_stream_query(s, NULL);
  atomic_store(&g.queried, 1);
  pthread_join(th, NULL);
  cr_assert_eq(busy, 0, "the refusals came before the device's work was done: nothing was waited for");
  char want[96];
  snprintf(want, sizeof want, "dp_device_dealloc: %p is not an allocation of host:0", (void *)local);
  cr_assert_str_eq(e.message, want);
  dp_stream_free(s);
}

/* A host function must not wait for itself: what it gives back, it gives
 * back at once (the caller orders it), with work still queued behind it. */
typedef struct {
  dp_backend_t *b;
  void *p;
  int rc;
} dealloc_in_fn_t;

static void dealloc_in_fn(void *arg) {
  dealloc_in_fn_t *x = arg;
  x->rc = dp_device_dealloc(x->b, H0, x->p, NULL);
}

Test(device, a_host_function_deallocating_on_its_own_device_does_not_wait_for_itself, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  dealloc_in_fn_t x = {b, NULL, 1};
  OK(dp_device_alloc(b, H0, 64, &x.p, T_ERR));
  OK(dp_host_launch(s, dealloc_in_fn, &x, T_ERR));
  OK(dp_host_launch(s, nap_200ms, NULL, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(x.rc, 0);
  dp_stream_free(s);
}

/* A free waits on each busy stream of the device once, and steps over each
 * stream of the list once: finding "the oldest stream not waited on yet"
 * afresh after every wait stepped over the whole list each time, so that
 * freeing with n streams busy cost n * n steps under the backend's lock.
 * The streams are let go one at a time, each a moment after the one before
 * has finished. */
#define DRAIN_STREAMS 48

typedef struct gated {
  _Atomic int open;
  _Atomic int ran;
} gated_t;

static void wait_for_gate(void *arg) {
  gated_t *g = arg;
  while (!atomic_load(&g->open)) sleep_ms(1);
  atomic_store(&g->ran, 1);
}

typedef struct opener {
  dp_stream_t **s;
  gated_t *g;
  int newest_first;
} opener_t;

static void *open_gates_in_order(void *arg) {
  opener_t *o = arg;
  sleep_ms(20); /* the free has started waiting */
  for (int k = 0; k < DRAIN_STREAMS; k++) {
    int i = o->newest_first ? DRAIN_STREAMS - 1 - k : k;
    atomic_store(&o->g[i].open, 1);
    dp_stream_synchronize(o->s[i], NULL);
    sleep_ms(2);
  }
  return NULL;
}

/* Frees with DRAIN_STREAMS streams of the device busy, let go one at a
 * time in the order asked; returns the steps the drain took. */
static uint64_t drain_steps(int newest_first) {
  dp_backend_t *b = host();
  static dp_stream_t *s[DRAIN_STREAMS];
  static gated_t g[DRAIN_STREAMS];
  for (int i = 0; i < DRAIN_STREAMS; i++) {
    OK(dp_stream_new(b, H0, &s[i], T_ERR));
    OK(dp_host_launch(s[i], wait_for_gate, &g[i], T_ERR));
  }
  void *p;
  OK(dp_device_alloc(b, H0, 64, &p, T_ERR));
  opener_t o = {s, g, newest_first};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, open_gates_in_order, &o), 0);
  uint64_t before = atomic_load(&dp__host_drain_steps);
  OK(dp_device_dealloc(b, H0, p, T_ERR));
  uint64_t steps = atomic_load(&dp__host_drain_steps) - before;
  pthread_join(th, NULL);
  for (int i = 0; i < DRAIN_STREAMS; i++) cr_assert_eq(atomic_load(&g[i].ran), 1, "stream %d ran before the free", i);
  for (int i = 0; i < DRAIN_STREAMS; i++) dp_stream_free(s[i]);
  return steps;
}

/* Oldest first: the order in which the old drain waited on them, so that
 * every stream it looked at again was still busy. */
Test(device, deallocating_steps_over_each_stream_once_however_many_are_busy, .timeout = 30) {
  uint64_t steps = drain_steps(0);
  cr_assert_leq(steps, 2 * DRAIN_STREAMS, "%lu steps over a list of %d busy streams", (unsigned long)steps,
                DRAIN_STREAMS);
}

/* The list is newest first: streams let go newest first are each found
 * busy right after the one before it. A drain that looked again from the
 * head of the list after each wait stepped over every stream it had waited
 * on already, n * n / 2 steps; the cursor goes on from where it was. */
Test(device, deallocating_goes_on_from_its_place_when_the_newest_streams_finish_first, .timeout = 30) {
  uint64_t steps = drain_steps(1);
  cr_assert_leq(steps, 2 * DRAIN_STREAMS, "%lu steps over a list of %d busy streams", (unsigned long)steps,
                DRAIN_STREAMS);
}

/* ---- wrapped native streams (dp_stream_wrap) ---- */

static dp_stream_t *wrapped(dp_backend_t *b, dp_device_t d, void *native) {
  dp_stream_t *w;
  OK(dp_stream_wrap(b, d, native, &w, T_ERR));
  return w;
}

Test(device, wrapping_a_native_handle_twice_gives_the_same_backend_owned_stream) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  void *native = dp_stream_native(s);
  cr_assert_not_null(native, "a host stream has a native handle to wrap");
  dp_stream_t *w = wrapped(b, H0, native);
  cr_assert_neq(w, s, "the wrapper is the backend's, not the caller's stream");
  cr_assert_eq(dp_stream_native(w), native);
  cr_assert(dp_device_equal(dp_stream_device(w), H0));
  cr_assert_eq(dp_stream_backend(w), b);
  long allocs = t_alloc_count;
  for (int i = 0; i < 100; i++) cr_assert_eq(wrapped(b, H0, native), w, "the same handle wraps to the same stream");
  cr_assert_eq(t_alloc_count, allocs, "a cached wrapper costs no allocation");
  dp_stream_free(w);  /* the backend's: nothing happens, the native stream lives on */
  cr_assert_eq(wrapped(b, H0, native), w);
  OK(dp_stream_synchronize(w, T_ERR));
  dp_stream_t *other;
  OK(dp_stream_new(b, H0, &other, T_ERR));
  cr_assert_neq(wrapped(b, H0, dp_stream_native(other)), w, "another handle, another wrapper");
  dp_stream_t *pool = pooled(b, H0);
  cr_assert_not_null(wrapped(b, H0, dp_stream_native(pool)), "the backend's own streams wrap too");
  dp_stream_free(other);
  dp_stream_free(s);
}

/* Work queued on the native stream (through the caller's handle) and work
 * ordered through the wrapper are one stream: an event recorded on the
 * wrapper covers what the owner queued before it. */
static int wrapped_consumer_sees(int with_wait) {
  dp_backend_t *b = host();
  dp_stream_t *owner, *c;
  OK(dp_stream_new(b, H0, &owner, T_ERR));
  OK(dp_stream_new(b, H1, &c, T_ERR));
  dp_stream_t *w = wrapped(b, H0, dp_stream_native(owner));
  cell_t cell;
  atomic_init(&cell.value, 0);
  atomic_init(&cell.seen, -1);
  held_write_t hw = {&cell, 0}; /* held until the query; without the wait, until the read is done */
  OK(dp_host_launch(owner, write_when_open, &hw, T_ERR));  /* the framework's work */
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_event_record(ev, w, T_ERR));
  cr_assert_eq(dp_event_query(ev, NULL), 0, "the event waits for the owner's work");
  if (with_wait) OK(dp_stream_wait_event(c, ev, T_ERR));
  OK(dp_host_launch(c, read_value, &cell, T_ERR));
  if (with_wait) atomic_store(&hw.open, 1);
  OK(dp_stream_synchronize(c, T_ERR));
  int seen = atomic_load(&cell.seen);
  atomic_store(&hw.open, 1);
  OK(dp_event_synchronize(ev, T_ERR));
  cr_assert_eq(dp_stream_query(w, NULL), 1);
  dp_event_free(ev);
  dp_stream_free(owner);
  dp_stream_free(c);
  return seen;
}

Test(device, an_event_recorded_on_a_wrapped_stream_covers_the_owners_earlier_work) {
  for (int i = 0; i < 3; i++) cr_assert_eq(wrapped_consumer_sees(1), 42, "the wait must order the read after the write");
}

Test(device, negative_control_without_a_wait_on_the_wrapped_streams_event_the_read_is_stale) {
  cr_assert_eq(wrapped_consumer_sees(0), 0, "without the wait the read overtakes the owner's slow write");
}

Test(device, a_wrapped_stream_waits_and_is_waited_on_in_stream_order) {
  dp_backend_t *b = host();
  dp_stream_t *producer, *owner;
  OK(dp_stream_new(b, H0, &producer, T_ERR));
  OK(dp_stream_new(b, H1, &owner, T_ERR));
  dp_stream_t *w = wrapped(b, H1, dp_stream_native(owner));
  cell_t cell;
  atomic_init(&cell.value, 0);
  atomic_init(&cell.seen, -1);
  OK(dp_host_launch(producer, slow_write, &cell, T_ERR));
  OK(dp_stream_wait_stream(w, producer, T_ERR));  /* the wrapper waits ... */
  OK(dp_host_launch(owner, read_value, &cell, T_ERR));  /* ... and so does the owner's later work */
  OK(dp_stream_synchronize(owner, T_ERR));
  cr_assert_eq(atomic_load(&cell.seen), 42);
  cell_t copy;
  atomic_init(&copy.value, 7);
  int dst = 0;
  OK(dp_memcpy_async(w, &dst, &copy.value, sizeof dst, T_ERR));
  OK(dp_stream_synchronize(owner, T_ERR));
  cr_assert_eq(dst, 7, "a copy through the wrapper runs on the owner's stream");
  dp_stream_free(producer);
  dp_stream_free(owner);
}

Test(device, a_null_native_handle_wraps_to_the_host_devices_default_stream) {
  dp_backend_t *b = host();
  cr_assert_eq(wrapped(b, H0, NULL), dflt(b, H0));
  cr_assert_eq(wrapped(b, H1, NULL), dflt(b, H1));
}

Test(device, wrapping_what_is_not_a_live_stream_of_the_device_is_einval_with_the_reason) {
  dp_backend_t *b = host();
  dp_stream_t *s, *w = NULL;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  void *native = dp_stream_native(s);
  dp_error_t e;
  char want[128];
  cr_assert_eq(dp_stream_wrap(b, H1, native, &w, &e), DP_EINVAL, "a stream of host:0 is not one of host:1");
  snprintf(want, sizeof want, "dp_stream_wrap: %p is a stream of host:0, not host:1", native);
  cr_assert_str_eq(e.message, want);
  int local;
  cr_assert_eq(dp_stream_wrap(b, H0, &local, &w, &e), DP_EINVAL);
  snprintf(want, sizeof want, "dp_stream_wrap: %p is not a live host stream", (void *)&local);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(dp_stream_wrap(b, H0, (void *)UINTPTR_MAX, &w, &e), DP_EINVAL);
  cr_assert_eq(dp_stream_wrap(b, t_dev(DP_DEVICE_HOST, 9), native, &w, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wrap: device host:9 does not belong to the host backend (2 devices)");
  cr_assert_eq(dp_stream_wrap(b, t_dev(DP_DEVICE_CUDA, 0), native, &w, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wrap: device cuda:0 does not belong to the host backend (2 devices)");
  cr_assert_eq(dp_stream_wrap(b, H0, native, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wrap: NULL out");
  cr_assert_eq(dp_stream_wrap(NULL, H0, native, &w, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wrap: NULL backend");
  cr_assert_null(w, "no failed call wrote *out");
  cr_assert_eq(dp_stream_wrap(b, H1, native, &w, NULL), DP_EINVAL, "a refusal is not cached: it is refused again");
  dp_stream_free(s);
}

/* The one native stream devpickle sees go away: a dp_stream_new stream's.
 * Its wrapper goes with it — out of the cache, out of this thread's current
 * streams — so a later wrap of that address is checked again. */
Test(device, freeing_a_stream_retires_its_wrapper_and_the_handle_is_checked_again) {
  dp_backend_t *b = host();
  (void)dflt(b, H0);  /* made now, so that no stream is made at the freed address below */
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  void *native = dp_stream_native(s);
  dp_stream_t *w = wrapped(b, H0, native);
  OK(dp_set_current_stream(w, NULL, T_ERR));
  cr_assert_eq(current(b, H0), w, "a wrapper can be this thread's current stream");
  dp_stream_free(s);
  cr_assert_eq(current(b, H0), dflt(b, H0), "the retired wrapper is no longer current");
  dp_error_t e;
  dp_stream_t *again;
  cr_assert_eq(dp_stream_wrap(b, H0, native, &again, &e), DP_EINVAL, "the handle of a freed stream is not a stream");
  OK(dp_stream_new(b, H0, &s, T_ERR));
  dp_stream_t *w2 = wrapped(b, H0, dp_stream_native(s));
  cr_assert_neq(w2, w, "a new stream gets a new wrapper, even at the old address");
  dp_stream_free(s);
}

Test(device, a_wrapped_stream_serves_as_current_stream_and_through_the_provider) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  provided = wrapped(b, H0, dp_stream_native(s));
  dp_set_stream_provider(provider, NULL);
  cr_assert_eq(current(b, H0), provided, "the provider may hand out a wrapper");
  dp_set_stream_provider(NULL, NULL);
  dp_stream_t *prev;
  OK(dp_set_current_stream(provided, &prev, T_ERR));
  cr_assert_eq(current(b, H0), provided);
  dp_stream_free(provided);  /* the backend's: still current */
  cr_assert_eq(current(b, H0), provided);
  dp_reset_current_stream(b, H0);
  dp_stream_free(s);
}

Test(device, every_allocation_failure_while_wrapping_is_an_error_and_leaks_nothing) {
  for (long n = 1;; n++) {
    dp_backend_t *b = host();
    dp_stream_t *s[20];
    for (int i = 0; i < 20; i++) OK(dp_stream_new(b, H0, &s[i], T_ERR));
    t_fail_at = t_alloc_count + n;
    int rc = 0;
    dp_error_t e;
    for (int i = 0; i < 20 && rc == 0; i++) {  /* 20 handles: the table grows once */
      dp_stream_t *w;
      rc = dp_stream_wrap(b, H0, dp_stream_native(s[i]), &w, &e);
      if (rc == 0) cr_assert_eq(wrapped(b, H0, dp_stream_native(s[i])), w);
    }
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM);
      cr_assert_str_eq(e.message, "dp_stream_wrap(host:0): out of memory wrapping a native stream");
    }
    for (int i = 0; i < 20; i++) dp_stream_free(s[i]);
    dp_shutdown();
    ASSERT_NO_LEAK();
    if (rc == 0) {
      cr_assert_geq(n, 3, "failures were injected: the wrapper and the table, twice");
      break;
    }
  }
}

/* Many threads wrap the same handles at once, while the table grows under
 * them: every thread gets the one wrapper of each handle. (test/stress runs
 * this under ThreadSanitizer.) */
#define WRAP_THREADS 8
#define WRAP_HANDLES 40
typedef struct wrap_arg {
  dp_backend_t *b;
  void *natives[WRAP_HANDLES];
  dp_stream_t *got[WRAP_HANDLES];
  int start;
  _Atomic int *go;
} wrap_arg_t;

static void *wrap_many(void *p) {
  wrap_arg_t *a = p;
  while (!atomic_load(a->go)) {
  }
  for (int round = 0; round < 50; round++)
    for (int k = 0; k < WRAP_HANDLES; k++) {
      int i = (a->start + k) % WRAP_HANDLES;
      dp_stream_t *w;
      if (dp_stream_wrap(a->b, H0, a->natives[i], &w, NULL) != 0) return "wrap failed";
      if (round > 0 && w != a->got[i]) return "a handle wrapped to two streams";
      a->got[i] = w;
    }
  return NULL;
}

/* The wrapper table (device/internal.h) is read without a lock and probed
 * until a key or an empty slot: it must keep empty slots. Its count of
 * keys decides when it grows; each grow counts the live wrappers it
 * carries over (a grow that lost the count of the wrappers it copied, or
 * skipped slot 0 counting them, let the table fill past half). Checked
 * after every wrap, through a first grow made to carry a wrapper in slot
 * 0 (the slot a scan looks at first): the 8th handle wrapped is one whose
 * key hashes there, picked among new streams. */
static size_t keys_in(dp__wrap_table_t *t) {
  size_t n = 0;
  for (size_t j = 0; j < t->nslots; j++) n += atomic_load(&t->slots[j].key) != 0;
  return n;
}

#define MANY_WRAPS 40
#define CANDIDATES 400
Test(device, the_wrapper_table_stays_at_most_half_full_and_counts_its_keys_through_every_grow, .timeout = 60) {
  dp_backend_t *b = host();
  dp__devstate_t *ds = &b->devs[0];
  static dp_stream_t *s[CANDIDATES];
  int made = 0, slot0_grown = 0;
  for (int n = 0; n < MANY_WRAPS; n++) {
    dp__wrap_table_t *before = atomic_load(&ds->wraps);
    int slot0 = before && atomic_load(&before->slots[0].s) != NULL;
    OK(dp_stream_new(b, H0, &s[made], T_ERR));
    if (n == 7 && !slot0) /* the last wrap before the first grow: one that lands in slot 0 */
      while (made + 1 < CANDIDATES &&
             (dp__hash_ptr((const void *)((uintptr_t)dp_stream_native(s[made]) + 1)) & (before->nslots - 1)) != 0)
        OK(dp_stream_new(b, H0, &s[++made], T_ERR));
    dp_stream_t *w;
    OK(dp_stream_wrap(b, H0, dp_stream_native(s[made++]), &w, T_ERR));
    dp__wrap_table_t *t = atomic_load(&ds->wraps);
    cr_assert_eq(keys_in(t), t->used, "after %d wraps: %zu keys, counted %zu", n + 1, keys_in(t), t->used);
    cr_assert_leq(t->used * 2, t->nslots, "after %d wraps: %zu keys in %zu slots", n + 1, t->used, t->nslots);
    cr_assert_eq(t->nslots & (t->nslots - 1), 0, "%zu slots: not a power of two, the probe's mask", t->nslots);
    slot0_grown += t != before && slot0;
  }
  cr_assert_gt(slot0_grown, 0, "no grow carried a wrapper in slot 0");
  for (int i = 0; i < made; i++) {
    dp_stream_t *w, *again;
    OK(dp_stream_wrap(b, H0, dp_stream_native(s[i]), &w, T_ERR));
    OK(dp_stream_wrap(b, H0, dp_stream_native(s[i]), &again, T_ERR));
    cr_assert_eq(w, again, "a handle found two wrappers");
  }
  for (int i = 0; i < made; i++) dp_stream_free(s[i]);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* Shutdown frees every wrapper still in a table, the one in slot 0
 * included (it is checked to be there on some device: wrappers of the
 * backend's own default and pool streams, which stay in the table until
 * shutdown, on 32 devices). */
Test(device, shutdown_frees_the_wrappers_in_every_slot_of_the_tables, .timeout = 60) {
  setenv("DEVPICKLE_HOST_DEVICES", "32", 1);
  dp_backend_t *b = host();
  int slot0 = 0;
  for (int d = 0; d < 32; d++) {
    dp_device_t dev = t_dev(DP_DEVICE_HOST, d);
    dp_stream_t *w;
    OK(dp_stream_wrap(b, dev, dp_stream_native(dflt(b, dev)), &w, T_ERR));
    for (int i = 0; i < DP_POOL_STREAMS; i++) OK(dp_stream_wrap(b, dev, dp_stream_native(pooled(b, dev)), &w, T_ERR));
    slot0 += atomic_load(&atomic_load(&b->devs[d].wraps)->slots[0].s) != NULL;
  }
  cr_assert_gt(slot0, 0, "no device's table holds a wrapper in slot 0");
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(device, threads_wrapping_the_same_handles_at_once_all_get_one_wrapper_per_handle) {
  dp_backend_t *b = host();
  dp_stream_t *s[WRAP_HANDLES];
  static wrap_arg_t args[WRAP_THREADS];
  _Atomic int go = 0;
  for (int i = 0; i < WRAP_HANDLES; i++) OK(dp_stream_new(b, H0, &s[i], T_ERR));
  pthread_t th[WRAP_THREADS];
  for (int t = 0; t < WRAP_THREADS; t++) {
    args[t].b = b;
    args[t].start = t * 5;
    args[t].go = &go;
    for (int i = 0; i < WRAP_HANDLES; i++) args[t].natives[i] = dp_stream_native(s[i]);
    pthread_create(&th[t], NULL, wrap_many, &args[t]);
  }
  atomic_store(&go, 1);
  for (int t = 0; t < WRAP_THREADS; t++) {
    void *why;
    pthread_join(th[t], &why);
    cr_assert_null(why, "thread %d: %s", t, (const char *)why);
  }
  for (int i = 0; i < WRAP_HANDLES; i++) {
    for (int t = 1; t < WRAP_THREADS; t++) cr_assert_eq(args[t].got[i], args[0].got[i], "handle %d", i);
    cr_assert_eq(dp_stream_native(args[0].got[i]), dp_stream_native(s[i]));
    dp_stream_free(s[i]);
  }
}

/* A second free of an event put it on the pool's list twice: the next two
 * dp_event_new handed the same event to two owners, and shutdown destroyed
 * it twice (a use after free under ASan). */
Test(device, freeing_an_event_twice_hands_it_to_one_owner_only) {
  dp_backend_t *b = host();
  dp_event_t *e, *x, *y;
  OK(dp_event_new(b, H0, &e, T_ERR));
  dp_event_free(e);
  dp_event_free(e);
  OK(dp_event_new(b, H0, &x, T_ERR));
  OK(dp_event_new(b, H0, &y, T_ERR));
  cr_assert_neq(x, y, "two owners were given one event");
  dp_event_free(x);
  dp_event_free(y);
}

/* A provider that answers with a stream of another device: its stream was
 * taken as the device's current stream, and what used it failed far away
 * (dp_event_record refused it, naming neither the provider nor a device). */
static dp_stream_t *wrong_device_provider(void *ud, dp_backend_t *b, dp_device_t dev) {
  (void)b, (void)dev;
  return ud;
}

Test(device, a_provider_stream_of_another_device_is_einval_naming_both_devices) {
  dp_backend_t *b = host();
  dp_stream_t *on1, *s;
  OK(dp_stream_new(b, H1, &on1, T_ERR));
  dp_set_stream_provider(wrong_device_provider, on1);
  dp_error_t e;
  cr_assert_eq(dp_current_stream(b, H0, &s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_current_stream(host:0): the stream provider returned a stream of host:1");
  OK(dp_current_stream(b, H1, &s, T_ERR));
  cr_assert_eq(s, on1);
  dp_set_stream_provider(NULL, NULL);
  dp_stream_free(on1);
}

/* The refusals of a stream and an event that do not go together named
 * neither the function nor the devices. */
Test(device, recording_an_event_on_another_devices_stream_names_the_function_and_both_devices) {
  dp_backend_t *b = host();
  dp_event_t *e;
  dp_stream_t *on1;
  OK(dp_event_new(b, H0, &e, T_ERR));
  OK(dp_stream_new(b, H1, &on1, T_ERR));
  dp_error_t err;
  cr_assert_eq(dp_event_record(e, on1, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_event_record: an event of host:0 is recorded on a stream of host:1 (of its own device only)");
  dp_event_free(e);
  dp_stream_free(on1);
}

/* used + n wrapped for a size near SIZE_MAX, so the cap let it through to
 * the allocator hook (which failed it with another message, or, given the
 * memory, would have handed out more than the cap). */
Test(device, a_size_near_size_max_is_refused_by_the_memory_cap_without_reaching_the_allocator) {
  dp_backend_t *b = host();
  OK(dp_host_set_memory_limit(H0, 1 << 20, T_ERR));
  void *p, *q;
  OK(dp_device_alloc(b, H0, 1000, &p, T_ERR));
  long asked = atomic_load(&t_alloc_count);
  dp_error_t e;
  cr_assert_eq(dp_device_alloc(b, H0, SIZE_MAX - 300, &q, &e), DP_ENOMEM);
  cr_assert(strstr(e.message, "dp_device_alloc(host:0): out of memory: "), "%s", e.message);
  cr_assert_eq(atomic_load(&t_alloc_count), asked, "the allocator was asked for the size");
  OK(dp_device_dealloc(b, H0, p, T_ERR));
  OK(dp_host_set_memory_limit(H0, 0, T_ERR));
}

/* A host function that synchronized its own stream (or its device, or an
 * event recorded there after it) waited for itself: the worker never
 * returned and everything that synchronized with the stream hung. */
typedef struct self_sync {
  dp_stream_t *s;
  dp_event_t *e;
  int how, rc;
  dp_error_t err;
} self_sync_t;
static void sync_self(void *arg) {
  self_sync_t *x = arg;
  if (x->how == 0) x->rc = dp_stream_synchronize(x->s, &x->err);
  if (x->how == 1) x->rc = dp_device_synchronize(dp_stream_backend(x->s), dp_stream_device(x->s), &x->err);
  if (x->how == 2) {
    dp_event_record(x->e, x->s, NULL);
    x->rc = dp_event_synchronize(x->e, &x->err);
  }
}

Test(device, a_host_function_that_would_wait_for_itself_is_emisuse_not_a_hang, .timeout = 20) {
  dp_backend_t *b = host();
  const char *want[3] = {"dp_stream_synchronize: called from a host function on that stream, which would wait for itself",
                         "dp_device_synchronize: called from a host function on a stream of host:0, which would wait for itself",
                         "dp_event_synchronize: called from a host function on the event's stream, recorded after the function "
                         "was queued: it would wait for itself"};
  for (int how = 0; how < 3; how++) {
    self_sync_t x = {NULL, NULL, how, 1, {0}};
    OK(dp_stream_new(b, H0, &x.s, T_ERR));
    OK(dp_event_new(b, H0, &x.e, T_ERR));
    OK(dp_host_launch(x.s, sync_self, &x, T_ERR));
    OK(dp_stream_synchronize(x.s, T_ERR));
    cr_assert_eq(x.rc, DP_EMISUSE, "how %d", how);
    cr_assert_str_eq(x.err.message, want[how]);
    dp_event_free(x.e);
    dp_stream_free(x.s);
  }
}

/* The host backend found an allocation in an array sorted by base, and
 * moved the array's tail at every allocation and free: freeing 150,000
 * allocations in the order they were made moved it all each time
 * (quadratic: 15 s). Each is now a node of a balanced tree. */
Test(device, host_allocations_freed_in_the_order_they_were_made_cost_linear_time) {
  enum { N = 150000 };
  dp_backend_t *b = host();
  dp_device_t d = {DP_DEVICE_HOST, 0};
  void **p = malloc(N * sizeof *p);
  cr_assert(p);
  struct timespec t0, t1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); /* this thread's CPU time: the machine's load does not count */
  for (int i = 0; i < N; i++) OK(dp_device_alloc(b, d, 16, &p[i], T_ERR));
  for (int i = 0; i < N; i += 997) { /* any interior byte names its device; one past the end does not */
    dp_device_t got;
    OK(dp_pointer_device(b, (char *)p[i] + 15, &got, T_ERR));
    cr_assert(got.type == DP_DEVICE_HOST && got.index == 0);
    cr_assert_neq(dp_pointer_device(b, (char *)p[i] + 16, &got, NULL), 0);
  }
  for (int i = 0; i < N; i++) OK(dp_device_dealloc(b, d, p[i], T_ERR));
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
  cr_assert_lt(s, 3.0, "150,000 allocations and frees took %.2f s of CPU", s);
  dp_error_t e;
  cr_assert_eq(dp_device_dealloc(b, d, p[0], &e), DP_EINVAL, "a freed pointer is no allocation any more");
  cr_assert(strstr(e.message, "is not an allocation of host:0"), "%s", e.message);
  free(p);
}

/* ---- the host backend's queues, waits and memory, at their edges ---- */

typedef struct started_gate {
  _Atomic int started, open;
} started_gate_t;

static void hold_until_open(void *arg) {
  started_gate_t *g = arg;
  atomic_store(&g->started, 1);
  while (!atomic_load(&g->open)) sleep_ms(1);
}

/* Bounded: the stream's worker has taken the task (a few ms at most). */
static void wait_started(started_gate_t *g) {
  for (int i = 0; i < 5000 && !atomic_load(&g->started); i++) sleep_ms(1);
  cr_assert(atomic_load(&g->started), "the gated task never started");
}

static void store_one(void *arg) { atomic_store((_Atomic int *)arg, 1); }

/* A stream's queue is a ring: it grows when full, with its head wherever the
 * worker left it. The tasks are copied out in queue order, not in the order
 * of the ring's slots. */
Test(device, a_queue_that_grows_after_its_head_has_moved_keeps_its_order, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(s, hold_until_open, &g, T_ERR));
  wait_started(&g); /* taken off the ring: its head is at slot 1 */
  static log_t log;
  static entry_t es[200];
  atomic_init(&log.n, 0);
  for (int i = 0; i < 200; i++) {
    es[i] = (entry_t){&log, i};
    OK(dp_host_launch(s, append, &es[i], T_ERR));
  }
  atomic_store(&g.open, 1);
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(atomic_load(&log.n), 200, "every task ran once");
  for (int i = 0; i < 200; i++) cr_assert_eq(log.order[i], i, "place %d", i);
  dp_stream_free(s);
}

/* A queue that cannot grow refuses the task, and the stream goes on: the
 * failure left the stream's lock held, and the next launch hung. */
Test(device, a_launch_that_cannot_grow_the_queue_is_enomem_and_the_stream_goes_on, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  _Atomic int done = 0;
  dp_error_t e;
  t_fail_at = t_alloc_count + 1; /* the queue's first ring */
  int rc = dp_host_launch(s, store_one, &done, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_host_launch(host:0): out of memory queueing host work");
  OK(dp_host_launch(s, store_one, &done, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(atomic_load(&done), 1);
  dp_stream_free(s);
}

/* A wait on an event that has completed queues nothing; the stream's
 * progress it looked at is let go (it outlived the stream, a leak). */
Test(device, waiting_on_a_completed_event_queues_nothing_and_keeps_nothing) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H1, &c, T_ERR));
  _Atomic int done = 0;
  OK(dp_host_launch(a, store_one, &done, T_ERR));
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_event_record(ev, a, T_ERR));
  OK(dp_event_synchronize(ev, T_ERR));
  OK(dp_stream_wait_event(c, ev, T_ERR));
  cr_assert_eq(dp_stream_query(c, NULL), 1, "nothing was queued");
  dp_event_free(ev);
  dp_stream_free(a);
  dp_stream_free(c);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* "Queues nothing" seen where it shows: a stream whose queue is full (64
 * tasks behind a held one) would have to grow it to queue a wait, and no
 * allocation can succeed. A wait on an event complete to the last task
 * (completed == target, the usual case after a synchronize) must not
 * need to. */
Test(device, waiting_on_an_event_complete_to_its_last_task_queues_nothing_even_on_a_full_queue, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H1, &c, T_ERR));
  _Atomic int done = 0;
  OK(dp_host_launch(a, store_one, &done, T_ERR));
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_event_record(ev, a, T_ERR));
  OK(dp_event_synchronize(ev, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(c, hold_until_open, &g, T_ERR));
  wait_started(&g);
  for (int i = 0; i < 64; i++) OK(dp_host_launch(c, store_one, &done, T_ERR));
  t_fail_at = t_alloc_count + 1;
  dp_error_t e;
  int rc = dp_stream_wait_event(c, ev, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, 0, "a wait was queued: %s", rc ? e.message : "");
  atomic_store(&g.open, 1);
  OK(dp_stream_synchronize(c, T_ERR));
  dp_event_free(ev);
  dp_stream_free(a);
  dp_stream_free(c);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* dp_device_synchronize on a device without streams, out of memory at
 * each of its allocations: DP_ENOMEM naming the call, and what it did
 * allocate is freed with the size it was allocated with. */
Test(device, synchronizing_a_device_without_streams_fails_cleanly_at_every_allocation) {
  dp_backend_t *b = host();
  for (long k = 1; k <= 2; k++) {
    dp_error_t e;
    t_fail_at = t_alloc_count + k;
    int rc = dp_device_synchronize(b, H1, &e);
    t_fail_at = 0;
    cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s", k, dp_err_name(rc));
    cr_assert_str_eq(e.message, "dp_device_synchronize(host:1): out of memory synchronizing a device");
  }
  OK(dp_device_synchronize(b, H1, T_ERR));
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A wait on a pending event that cannot be queued is an error and keeps
 * nothing of the event's stream. */
Test(device, a_wait_that_cannot_be_queued_is_enomem_and_keeps_nothing, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H1, &c, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(a, hold_until_open, &g, T_ERR));
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  OK(dp_event_record(ev, a, T_ERR));
  dp_error_t e;
  t_fail_at = t_alloc_count + 1; /* c's first ring */
  int rc = dp_stream_wait_event(c, ev, &e);
  t_fail_at = 0;
  atomic_store(&g.open, 1);
  cr_assert_eq(rc, DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_stream_wait_event(host:1): out of memory queueing host work");
  cr_assert_eq(dp_stream_query(c, NULL), 1, "nothing was queued");
  OK(dp_event_synchronize(ev, T_ERR));
  dp_event_free(ev);
  dp_stream_free(a);
  dp_stream_free(c);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* An event handed out again by the pool is never-recorded: complete, even
 * while the work its last owner recorded is running. */
Test(device, an_event_the_pool_hands_out_again_is_not_recorded, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(s, hold_until_open, &g, T_ERR));
  dp_event_t *e1, *e2;
  OK(dp_event_new(b, H0, &e1, T_ERR));
  OK(dp_event_record(e1, s, T_ERR));
  cr_assert_eq(dp_event_query(e1, NULL), 0);
  dp_event_free(e1);
  OK(dp_event_new(b, H0, &e2, T_ERR));
  cr_assert_eq(e2, e1, "the pool's event");
  int done = dp_event_query(e2, NULL);
  atomic_store(&g.open, 1);
  cr_assert_eq(done, 1, "the last owner's record is gone");
  OK(dp_stream_synchronize(s, T_ERR));
  dp_event_free(e2);
  dp_stream_free(s);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(device, a_launch_names_the_null_argument) {
  dp_backend_t *b = host();
  dp_error_t e;
  cr_assert_eq(dp_host_launch(NULL, store_one, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_host_launch: NULL stream");
  cr_assert_eq(dp_host_launch(dflt(b, H0), NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_host_launch: NULL fn");
}

/* A host function may wait for another stream's work: only its own
 * stream's later work is refused (it would wait for itself). */
typedef struct other_sync {
  dp_stream_t *other;
  dp_event_t *e;
  int rc_stream, rc_event;
  _Atomic int *other_done;
  int saw_done;
} other_sync_t;

static void sync_other(void *arg) {
  other_sync_t *x = arg;
  x->rc_event = dp_event_synchronize(x->e, NULL);
  x->rc_stream = dp_stream_synchronize(x->other, NULL);
  x->saw_done = atomic_load(x->other_done);
}

static void nap_then_store_one(void *arg) {
  sleep_ms(30);
  store_one(arg);
}

Test(device, a_host_function_may_wait_for_another_streams_work, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s, *other;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_stream_new(b, H0, &other, T_ERR));
  _Atomic int done = 0;
  other_sync_t x = {other, NULL, 1, 1, &done, 0};
  OK(dp_host_launch(other, nap_then_store_one, &done, T_ERR));
  OK(dp_event_new(b, H0, &x.e, T_ERR));
  OK(dp_event_record(x.e, other, T_ERR));
  OK(dp_host_launch(s, sync_other, &x, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(x.rc_event, 0, "%s", dp_err_name(x.rc_event));
  cr_assert_eq(x.rc_stream, 0, "%s", dp_err_name(x.rc_stream));
  cr_assert_eq(x.saw_done, 1, "the wait returned once the other stream's work was done");
  dp_event_free(x.e);
  dp_stream_free(s);
  dp_stream_free(other);
}

/* The self-wait check of dp_device_synchronize looks at every stream of
 * the device, whatever the place of the caller's own in the device's list
 * (newest first); and the refusal keeps no stream's progress. */
Test(device, a_host_function_synchronizing_its_device_is_emisuse_whatever_its_streams_age, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *older;
  OK(dp_stream_new(b, H0, &older, T_ERR)); /* after the caller's stream in the list */
  self_sync_t x = {NULL, NULL, 1, 1, {0}};
  OK(dp_stream_new(b, H0, &x.s, T_ERR));
  OK(dp_host_launch(x.s, sync_self, &x, T_ERR));
  OK(dp_stream_synchronize(x.s, T_ERR));
  cr_assert_eq(x.rc, DP_EMISUSE, "%s", dp_err_name(x.rc));
  cr_assert_str_eq(x.err.message,
                   "dp_device_synchronize: called from a host function on a stream of host:0, which would wait for itself");
  dp_stream_free(x.s);
  dp_stream_free(older);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* The cap is a number of bytes that can all be used, and each free gives
 * its bytes back. */
Test(device, a_memory_limit_can_be_filled_exactly_and_each_free_gives_its_bytes_back) {
  OK(dp_host_set_memory_limit(H1, 4096, T_ERR));
  dp_backend_t *b = host();
  void *p, *q;
  dp_error_t e;
  for (int round = 0; round < 3; round++) {
    OK_WITH(&e, dp_device_alloc(b, H1, 4096, &p, &e));
    cr_assert_eq(dp_device_alloc(b, H1, 1, &q, &e), DP_ENOMEM);
    cr_assert_str_eq(e.message, "dp_device_alloc(host:1): out of memory: 1 bytes asked, 4096 of 4096 in use");
    OK(dp_device_dealloc(b, H1, p, T_ERR));
  }
}

/* Without a cap, a size whose alignment slack wraps size_t is refused
 * before the allocator hook is asked: n + 256 wrapped to a few bytes, and
 * the call handed out a block that small for a size near SIZE_MAX. */
Test(device, a_size_that_cannot_take_its_alignment_is_enomem_without_a_cap) {
  dp_backend_t *b = host();
  void *p = NULL;
  dp_error_t e;
  long asked = atomic_load(&t_alloc_count);
  cr_assert_eq(dp_device_alloc(b, H0, SIZE_MAX - 100, &p, &e), DP_ENOMEM);
  char want[160];
  snprintf(want, sizeof want, "dp_device_alloc: %zu bytes on host:0 cannot be allocated with its 256-byte alignment",
           (size_t)SIZE_MAX - 100);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(atomic_load(&t_alloc_count), asked, "the allocator was asked");
  cr_assert_null(p);
}

/* Only the address an allocation was handed out at frees it: a pointer
 * inside it, or past its end, is refused and the allocation stays. */
Test(device, deallocating_a_pointer_inside_an_allocation_is_einval_and_frees_nothing) {
  dp_backend_t *b = host();
  char *p;
  OK(dp_device_alloc(b, H0, 1000, (void **)&p, T_ERR));
  dp_error_t e;
  char want[96];
  char *bad[2] = {p + 1, p + 5000};
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(dp_device_dealloc(b, H0, bad[i], &e), DP_EINVAL);
    snprintf(want, sizeof want, "dp_device_dealloc: %p is not an allocation of host:0", (void *)bad[i]);
    cr_assert_str_eq(e.message, want);
  }
  dp_device_t d;
  OK(dp_pointer_device(b, p + 999, &d, T_ERR));
  cr_assert(dp_device_equal(d, H0), "the allocation is still there");
  OK(dp_device_dealloc(b, H0, p, T_ERR));
}

/* host:63 is the last host device: host:64 was taken, and its limit
 * written past the end of the table of limits. */
Test(device, a_memory_limit_for_a_device_past_host_63_is_einval) {
  dp_error_t e;
  OK(dp_host_set_memory_limit(t_dev(DP_DEVICE_HOST, 63), 1, T_ERR));
  OK(dp_host_set_memory_limit(t_dev(DP_DEVICE_HOST, 63), 0, T_ERR));
  cr_assert_eq(dp_host_set_memory_limit(t_dev(DP_DEVICE_HOST, 64), 1, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_host_set_memory_limit: host:64 is not a host device (host:0..host:63)");
}

/* Between two backends the limit is kept for the next one, not written
 * into the one that was shut down (ASan reports that write). */
Test(device, a_memory_limit_set_after_shutdown_applies_to_the_next_backend) {
  (void)host();
  dp_shutdown();
  OK(dp_host_set_memory_limit(H0, 100, T_ERR));
  dp_backend_t *b = host();
  void *p;
  dp_error_t e;
  cr_assert_eq(dp_device_alloc(b, H0, 101, &p, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_device_alloc(host:0): out of memory: 101 bytes asked, 0 of 100 in use");
  OK(dp_host_set_memory_limit(H0, 0, T_ERR));
}

Test(device, the_host_device_count_takes_1_to_64_and_nothing_else) {
  setenv("DEVPICKLE_HOST_DEVICES", "64", 1);
  cr_assert_eq(dp_backend_device_count(host()), 64);
  dp_shutdown();
  const char *bad[] = {"65", "3x", "-1", " 3", "+3"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("DEVPICKLE_HOST_DEVICES", bad[i], 1);
    dp_backend_t *b;
    dp_error_t e;
    char want[96];
    cr_assert_eq(dp_backend_get(DP_DEVICE_HOST, &b, &e), DP_EINVAL, "%s", bad[i]);
    snprintf(want, sizeof want, "dp_backend_get(host): DEVPICKLE_HOST_DEVICES='%s': expected 1..64", bad[i]); /* quoted: " 3" shows its space */
    cr_assert_str_eq(e.message, want);
  }
  unsetenv("DEVPICKLE_HOST_DEVICES");
}

/* ---- the device layer's bookkeeping: counts, pools, saved streams ---- */

/* Setting the current stream of a device that has one replaces it: it
 * takes no second slot of the thread's DP_CURRENT_STREAM_SLOTS. */
Test(device, replacing_a_devices_current_stream_takes_no_more_slots) {
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  for (int i = 0; i < 2 * DP_CURRENT_STREAM_SLOTS; i++) OK(dp_set_current_stream(i % 2 ? s : dflt(b, H0), NULL, T_ERR));
  for (int i = 1; i < DP_CURRENT_STREAM_SLOTS; i++) OK(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, i)), NULL, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, 17)), NULL, &e), DP_ELIMIT);
  dp_stream_free(s);
}

/* dp_shutdown forgets this thread's current streams and their count: a
 * thread that held all its slots holds them all again afterwards. */
Test(device, after_shutdown_a_thread_has_all_its_current_stream_slots_again) {
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  for (int round = 0; round < 2; round++) {
    dp_backend_t *b = host();
    for (int i = 0; i < DP_CURRENT_STREAM_SLOTS; i++)
      OK(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, i)), NULL, T_ERR));
    dp_shutdown();
  }
}

/* A then() callback's stream (dp__current_stream_enter) replaces a
 * caller's current stream for the callback's time: leaving it puts the
 * caller's back, counted again as the caller's. */
Test(device, leaving_a_callbacks_stream_gives_the_callers_stream_back_with_its_slot) {
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  dp_backend_t *b = host();
  dp_stream_t *mine, *cb;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H0, &cb, T_ERR));
  OK(dp_set_current_stream(mine, NULL, T_ERR));
  dp__current_saved_t saved;
  dp__current_stream_enter(cb, &saved);
  cr_assert_eq(current(b, H0), cb);
  dp__current_stream_leave(H0, &saved);
  cr_assert_eq(current(b, H0), mine);
  for (int i = 1; i < DP_CURRENT_STREAM_SLOTS; i++) OK(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, i)), NULL, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_set_current_stream(dflt(b, t_dev(DP_DEVICE_HOST, 17)), NULL, &e), DP_ELIMIT,
               "host:0's stream still holds one of the caller's slots");
  dp_stream_free(cb);
  dp_stream_free(mine);
}

/* The caller's current stream freed inside a callback is not put back
 * when the callback returns; and a record once left is no longer the
 * thread's: a stream freed afterwards leaves it as it is. */
Test(device, a_stream_freed_inside_a_callback_is_not_current_after_it) {
  dp_backend_t *b = host();
  dp_stream_t *mine, *cb, *later, *d0 = dflt(b, H0); /* made first: never at the address of the one freed */
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H0, &cb, T_ERR));
  OK(dp_set_current_stream(mine, NULL, T_ERR));
  dp__current_saved_t saved;
  dp__current_stream_enter(cb, &saved);
  dp_stream_free(mine);
  dp__current_stream_leave(H0, &saved);
  cr_assert_eq(current(b, H0), d0, "the freed stream came back as current");
  OK(dp_stream_new(b, H0, &later, T_ERR));
  OK(dp_set_current_stream(later, NULL, T_ERR));
  dp__current_stream_enter(cb, &saved);
  dp__current_stream_leave(H0, &saved);
  cr_assert_eq(saved.s, later);
  dp_stream_free(later);
  cr_assert_eq(saved.s, later, "a record left is not the thread's any more");
  dp_stream_free(cb);
}

/* The stream-destroy listeners hear of a freed stream and of the wrapper
 * of its native handle, which goes with it. */
typedef struct heard {
  dp__stream_listener_t l;
  dp_stream_t *s[4];
  int n;
} heard_t;

static void hear(void *ctx, dp_stream_t *s) {
  heard_t *h = ctx;
  if (h->n < 4) h->s[h->n] = s;
  h->n++;
}

Test(device, freeing_a_stream_tells_the_listeners_of_it_and_of_its_wrapper) {
  dp_backend_t *b = host();
  dp_stream_t *s, *w;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_stream_wrap(b, H0, dp_stream_native(s), &w, T_ERR));
  heard_t h = {{hear, NULL, NULL}, {NULL}, 0};
  h.l.ctx = &h;
  dp__stream_listen(&h.l);
  dp_stream_free(s);
  dp__stream_unlisten(&h.l);
  cr_assert_eq(h.n, 2);
  cr_assert_eq(h.s[0], s);
  cr_assert_eq(h.s[1], w);
}

/* An event the pool handed out is the new owner's to free: it goes back to
 * the pool each time (a second free after a reuse was taken for a double
 * free, and the event was lost to the pool and never freed). */
Test(device, an_event_reused_from_the_pool_goes_back_to_it_when_freed) {
  dp_backend_t *b = host();
  dp_event_t *first, *e;
  OK(dp_event_new(b, H0, &first, T_ERR));
  dp_event_free(first);
  long allocs = t_alloc_count;
  for (int i = 0; i < 3; i++) {
    OK(dp_event_new(b, H0, &e, T_ERR));
    cr_assert_eq(e, first, "round %d: the pool's event", i);
    dp_event_free(e);
  }
  cr_assert_eq(t_alloc_count, allocs, "no event was made");
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* dp_stream_wait_stream's event goes back to the pool; a wait of a stream
 * for itself makes none. */
Test(device, waiting_for_a_stream_keeps_no_event_and_for_itself_makes_none) {
  dp_backend_t *b = host();
  dp_stream_t *a, *c;
  OK(dp_stream_new(b, H0, &a, T_ERR));
  OK(dp_stream_new(b, H0, &c, T_ERR));
  long allocs = t_alloc_count;
  OK(dp_stream_wait_stream(c, c, T_ERR));
  cr_assert_eq(t_alloc_count, allocs, "a stream waiting for itself made an event");
  OK(dp_stream_wait_stream(c, a, T_ERR));
  OK(dp_stream_synchronize(c, T_ERR));
  dp_stream_free(a);
  dp_stream_free(c);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(device, a_copy_names_the_null_pointer_and_a_zero_byte_copy_allocates_nothing) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  char buf[8] = {0};
  dp_error_t e;
  cr_assert_eq(dp_memcpy_async(s, NULL, buf, sizeof buf, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_memcpy_async: NULL dst");
  cr_assert_eq(dp_memcpy_async(s, buf, NULL, sizeof buf, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_memcpy_async: NULL src");
  cr_assert_eq(dp_memcpy_async(s, NULL, NULL, sizeof buf, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_memcpy_async: NULL dst", "the first NULL argument is named");
  long allocs = t_alloc_count;
  t_fail_at = t_alloc_count + 1; /* a queued task would need the stream's first ring */
  int rc = dp_memcpy_async(s, buf, buf + 4, 0, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, 0, "%s", dp_err_name(rc));
  cr_assert_eq(t_alloc_count, allocs, "nothing was queued");
  dp_stream_free(s);
}

Test(device, pinned_memory_of_zero_bytes_or_without_a_backend_is_einval) {
  dp_backend_t *b = host();
  void *p = NULL;
  dp_error_t e;
  cr_assert_eq(dp__pinned_alloc(b, 0, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "pinned allocation: NULL backend or out, or 0 bytes");
  cr_assert_eq(dp__pinned_alloc(NULL, 16, &p, &e), DP_EINVAL);
  cr_assert_null(p);
  OK(dp__pinned_alloc(b, 16, &p, T_ERR));
  memset(p, 1, 16);
  dp__pinned_free(b, p, 16);
  dp__pinned_free(b, NULL, 16); /* nothing, as free(NULL) */
  dp__pinned_free(NULL, p, 16);
  dp_shutdown();
  ASSERT_NO_LEAK(); /* the free gave the memory back */
}

/* ---- allocation failures of the calls the sweeps above do not make ---- */

enum { DS_BACKEND, DS_STREAM_NEW, DS_DEFAULT, DS_POOL, DS_EVENT, DS_WAIT_EVENT, DS_ALLOC, DS_SYNC, DS_COPY, DS_COUNT };

typedef struct dsweep {
  int op;
  dp_backend_t *b;
  dp_stream_t *s, *made, *t;
  _Atomic int gate;     /* DS_WAIT_EVENT: t is held until it opens */
  dp_event_t *ev;
  void *p;
  char src[64], dst[64];
} dsweep_t;

static void dsweep_gate(void *arg) {
  for (int ms = 0; !atomic_load((_Atomic int *)arg) && ms < 30000; ms++) sleep_ms(1);
}

static void dsweep_prepare(void *ctx) {
  dsweep_t *d = ctx;
  d->b = NULL;
  d->s = d->made = d->t = NULL;
  atomic_store(&d->gate, 0);
  d->ev = NULL;
  d->p = NULL;
  memset(d->dst, 0, sizeof d->dst);
  if (d->op == DS_BACKEND) return;
  d->b = host();
  if (d->op == DS_SYNC || d->op == DS_COPY || d->op == DS_WAIT_EVENT) OK(dp_stream_new(d->b, H0, &d->s, T_ERR));
  if (d->op == DS_WAIT_EVENT) {
    OK(dp_stream_new(d->b, H1, &d->t, T_ERR));
    OK(dp_host_launch(d->t, dsweep_gate, &d->gate, T_ERR));
    OK(dp_event_new(d->b, H1, &d->ev, T_ERR));
    OK(dp_event_record(d->ev, d->t, T_ERR));
  }
}

static int dsweep_run(void *ctx, dp_error_t *e) {
  dsweep_t *d = ctx;
  switch (d->op) {
    case DS_BACKEND: return dp_backend_get(DP_DEVICE_HOST, &d->b, e);
    case DS_STREAM_NEW: return dp_stream_new(d->b, H1, &d->made, e);
    case DS_DEFAULT: return dp_stream_default(d->b, H1, &d->made, e);
    case DS_POOL: return dp_stream_pool_next(d->b, H1, &d->made, e);
    case DS_EVENT: return dp_event_new(d->b, H1, &d->ev, e);
    case DS_WAIT_EVENT: return dp_stream_wait_event(d->s, d->ev, e);
    case DS_ALLOC: return dp_device_alloc(d->b, H1, 4096, &d->p, e);
    case DS_SYNC: return dp_device_synchronize(d->b, H0, e);
    default: return dp_memcpy_async(d->s, d->dst, d->src, sizeof d->src, e);
  }
}

static void dsweep_ran(void *arg) { atomic_store((_Atomic int *)arg, 1); }

static void dsweep_check(void *ctx, int rc, long k) {
  dsweep_t *d = ctx;
  if (rc) { /* the same call succeeds next */
    cr_assert(d->made == NULL && d->p == NULL, "allocation %ld: a failed call hands out nothing", k);
    if (d->op == DS_EVENT) cr_assert_null(d->ev, "allocation %ld: a failed call hands out nothing", k);
    OK(dsweep_run(d, T_ERR));
  }
  switch (d->op) {
    case DS_STREAM_NEW:
    case DS_DEFAULT:
    case DS_POOL: {
      _Atomic int ran = 0;
      OK(dp_host_launch(d->made, dsweep_ran, &ran, T_ERR));
      OK(dp_stream_synchronize(d->made, T_ERR));
      cr_assert(atomic_load(&ran), "allocation %ld: the stream runs work", k);
      dp_stream_free(d->made);
      break;
    }
    case DS_EVENT: {
      dp_stream_t *t = pooled(d->b, H1);
      OK(dp_event_record(d->ev, t, T_ERR));
      OK(dp_event_synchronize(d->ev, T_ERR));
      break;
    }
    case DS_ALLOC:
      memset(d->p, 1, 4096);
      OK(dp_device_dealloc(d->b, H1, d->p, T_ERR));
      break;
    case DS_WAIT_EVENT: {
      _Atomic int ran = 0;
      OK(dp_host_launch(d->s, dsweep_ran, &ran, T_ERR));
      sleep_ms(2);
      cr_assert(!atomic_load(&ran), "allocation %ld: s waits for t's work", k);
      atomic_store(&d->gate, 1);
      OK(dp_stream_synchronize(d->s, T_ERR));
      cr_assert(atomic_load(&ran));
      dp_stream_free(d->t);
      break;
    }
    case DS_COPY:
      OK(dp_stream_synchronize(d->s, T_ERR));
      cr_assert_eq(memcmp(d->dst, d->src, sizeof d->src), 0, "allocation %ld: the copy was made once queued", k);
      break;
  }
  dp_event_free(d->ev);
  dp_stream_free(d->s);
  dp_shutdown();
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "op %d: leak after failing allocation %ld", d->op, k);
}

/* Starting the host backend, making streams (new, default, pooled) and
 * events, queueing a wait on an event, allocating device memory,
 * synchronizing a device and queueing a copy: each allocation failure is
 * DP_ENOMEM with a message, hands out nothing, leaks nothing, and the same
 * call succeeds next, with what it made working. */
Test(device, starting_making_streams_and_events_allocating_and_copying_fail_cleanly_at_every_allocation) {
  static const t_sweep_t sw = {dsweep_prepare, dsweep_run, dsweep_check};
  for (int op = 0; op < DS_COUNT; op++) {
    dsweep_t d = {.op = op};
    for (size_t i = 0; i < sizeof d.src; i++) d.src[i] = (char)i;
    long failed = t_sweep(&sw, &d);
    cr_assert_gt(failed, 0, "op %d: no allocation was failed", op);
  }
}

Test(device, an_empty_devpickle_backend_chooses_as_an_unset_one_does) {
  dp_backend_t *unset, *empty;
  dp_error_t e;
  OK_WITH(&e, dp_backend_default(&unset, &e));
  setenv("DEVPICKLE_BACKEND", "", 1);
  OK_WITH(&e, dp_backend_default(&empty, &e));
  unsetenv("DEVPICKLE_BACKEND");
  cr_assert_eq(empty, unset);
}

/* The first wrap of a handle is held up (the allocator sleeps under the
 * device's lock) while a second thread wraps it too: the second finds no
 * wrapper without the lock, waits for it, and must take the one the first
 * made rather than make its own. */
static _Atomic int wrap_stall_armed;
static pthread_t wrap_stalled;
static void *stalling_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  if (nsize && atomic_load(&wrap_stall_armed) && pthread_equal(pthread_self(), wrap_stalled) &&
      atomic_exchange(&wrap_stall_armed, 0))
    sleep_ms(150);  /* the other thread reaches the lock meanwhile */
  return t_alloc(ud, ptr, osize, nsize);
}

typedef struct late_wrap {
  dp_backend_t *b;
  void *native;
  _Atomic int *go;
  dp_stream_t *got;
} late_wrap_t;

static void *wrap_when_told(void *arg) {
  late_wrap_t *a = arg;
  while (!atomic_load(a->go)) sleep_ms(1);
  sleep_ms(30);  /* the first wrap holds the lock by now */
  if (dp_stream_wrap(a->b, H0, a->native, &a->got, NULL) != 0) a->got = NULL;
  return NULL;
}

Test(device, a_wrap_that_waited_for_another_threads_first_wrap_of_the_handle_takes_its_wrapper, .timeout = 20) {
  dp_backend_t *b = host();
  dp_stream_t *s, *w;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  _Atomic int go = 0;
  late_wrap_t a = {b, dp_stream_native(s), &go, NULL};
  pthread_t th;
  pthread_create(&th, NULL, wrap_when_told, &a);
  dp_set_allocator(stalling_alloc, NULL);
  wrap_stalled = pthread_self();
  atomic_store(&wrap_stall_armed, 1);
  atomic_store(&go, 1);
  OK(dp_stream_wrap(b, H0, a.native, &w, T_ERR));
  pthread_join(th, NULL);
  cr_assert_not_null(a.got);
  cr_assert_eq(a.got, w, "two wrappers of one handle");
  dp_stream_free(s);
}

/* A listener (a cache) that frees what the stream used must find its work
 * done: dp_stream_free waits before it tells anyone. */
static cell_t *heard_cell;
static _Atomic int value_when_heard = -1;
static void hear_value(void *ctx, dp_stream_t *s) {
  (void)ctx, (void)s;
  atomic_store(&value_when_heard, atomic_load(&heard_cell->value));
}

Test(device, the_listeners_of_a_freed_stream_are_told_once_its_work_has_completed) {
  dp_backend_t *b = host();
  dp_stream_t *s;
  cell_t cell = {0, 0};
  heard_cell = &cell;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_host_launch(s, slow_write, &cell, T_ERR));
  dp__stream_listener_t l = {hear_value, NULL, NULL};
  dp__stream_listen(&l);
  dp_stream_free(s);
  dp__stream_unlisten(&l);
  cr_assert_eq(atomic_load(&value_when_heard), 42, "the listener was told while the stream's work ran");
}

/* Only one backend can be started without a GPU: the other backend here is
 * a copy of the host backend's record, which the device layer tells apart
 * by its address as it tells cuda from host. */
Test(device, a_stream_and_an_event_or_provided_stream_of_different_backends_are_refused_naming_them) {
  dp_backend_t *b = host();
  dp_backend_t other = *b;
  other.name = "other";
  dp_stream_t *s, *got;
  dp_event_t *e;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_event_new(b, H0, &e, T_ERR));
  struct dp_stream their_stream = {&other, H0, s->h, DP__STREAM_BACKEND, NULL};
  struct dp_event their_event = {&other, H0, e->h, NULL, 0};
  dp_error_t err;
  cr_assert_eq(dp_stream_wait_event(s, &their_event, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_stream_wait_event: the stream (host) and the event (other) belong to different backends");
  cr_assert_eq(dp_event_record(e, &their_stream, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_event_record: an event of host:0 is recorded on a stream of host:0 of another backend "
                                "(of its own device only)");
  dp_set_stream_provider(wrong_device_provider, &their_stream);
  cr_assert_eq(dp_current_stream(b, H0, &got, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_current_stream(host:0): the stream provider returned a stream of host:0 of another backend");
  dp_set_stream_provider(NULL, NULL);
  dp_event_free(e);
  dp_stream_free(s);
}

static void set_flag(void *arg) { atomic_store((_Atomic int *)arg, 1); }

/* The same for a wait between streams of two backends (named, as
 * dp_stream_wait_event names them) and a host launch on a stream that is
 * not the host backend's (device.h: DP_EINVAL for a non-host stream):
 * nothing is queued on either. */
Test(device, a_wait_between_two_backends_streams_and_a_launch_on_a_non_host_stream_are_einval_naming_them) {
  dp_backend_t *b = host();
  dp_backend_t other = *b;
  other.type = DP_DEVICE_CUDA;
  other.name = "cuda";
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  struct dp_stream their_stream = {&other, t_dev(DP_DEVICE_CUDA, 0), s->h, DP__STREAM_BACKEND, NULL};
  dp_error_t err;
  cr_assert_eq(dp_stream_wait_stream(s, &their_stream, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_stream_wait_stream: s (host) and t (cuda) belong to different backends");
  cr_assert_eq(dp_stream_wait_stream(&their_stream, s, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_stream_wait_stream: s (cuda) and t (host) belong to different backends");
  _Atomic int ran;
  atomic_init(&ran, 0);
  cr_assert_eq(dp_host_launch(&their_stream, set_flag, &ran, &err), DP_EINVAL);
  cr_assert_str_eq(err.message, "dp_host_launch needs a host stream, got cuda");
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(dp_stream_query(s, NULL), 1, "nothing was queued on the host stream behind the fake");
  cr_assert_eq(atomic_load(&ran), 0, "the refused launch ran");
  dp_stream_free(s);
}

Test(device, setting_a_current_stream_gives_back_the_one_it_replaces_and_null_when_refused) {
  dp_backend_t *b = host();
  dp_stream_t *mine, *other, *prev;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H0, &other, T_ERR));
  OK(dp_set_current_stream(mine, &prev, T_ERR));
  cr_assert_null(prev);
  OK(dp_set_current_stream(other, &prev, T_ERR));
  cr_assert_eq(prev, mine);
  OK(dp_set_current_stream(other, &prev, T_ERR));
  cr_assert_eq(prev, other);
  dp_error_t e;
  prev = mine;
  cr_assert_eq(dp_set_current_stream(NULL, &prev, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_set_current_stream: NULL stream");
  cr_assert_null(prev, "a refused call gives back no stream");
  dp_stream_free(mine);
  dp_stream_free(other);
}

/* The host backend's reset never fails; CUDA's can, and leaves the pooled
 * event without a handle (dp_event_free). Made so by hand here: the pool
 * makes a handle when it hands such an event out, and when that fails the
 * event stays in the pool for the next call. */
Test(device, an_event_pooled_without_a_handle_gets_one_when_handed_out_again) {
  dp_backend_t *b = host();
  dp_event_t *e, *again;
  dp_stream_t *s;
  OK(dp_stream_new(b, H0, &s, T_ERR));
  OK(dp_event_new(b, H0, &e, T_ERR));
  dp_event_free(e);
  b->ops->event_destroy(b, e->h);
  e->h = NULL;
  dp_error_t err;
  t_fail_at = t_alloc_count + 1;
  int rc = dp_event_new(b, H0, &again, &err);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s", err.message);
  cr_assert_str_eq(err.message, "dp_event_new(host:0): out of memory creating a host event");
  cr_assert_null(e->h);
  OK(dp_event_new(b, H0, &again, T_ERR));
  cr_assert_eq(again, e, "the event waited in the pool");
  cr_assert_not_null(again->h);
  OK(dp_event_record(again, s, T_ERR));
  OK(dp_event_synchronize(again, T_ERR));
  dp_event_free(again);
  dp_stream_free(s);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* device.h: freeing an event again before dp_event_new hands it out again
 * does nothing. A dp_event_new that took it from the pool and failed to
 * make its handle put it back: it was not handed out, so the old owner's
 * second free must still do nothing (the event was on the list twice,
 * and went to two owners). */
Test(device, an_event_freed_again_after_a_failed_hand_out_does_nothing) {
  dp_backend_t *b = host();
  dp_event_t *e, *again, *other;
  OK(dp_event_new(b, H0, &e, T_ERR));
  dp_event_free(e);
  b->ops->event_destroy(b, e->h);
  e->h = NULL; /* as a failed CUDA reset leaves it */
  dp_error_t err;
  t_fail_at = t_alloc_count + 1;
  int rc = dp_event_new(b, H0, &again, &err);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s", err.message);
  dp_event_free(e); /* the old owner's second free */
  OK(dp_event_new(b, H0, &again, T_ERR));
  OK(dp_event_new(b, H0, &other, T_ERR));
  cr_assert_eq(again, e, "the event waited in the pool");
  cr_assert_neq(other, again, "one event was handed to two owners");
  dp_event_free(again);
  dp_event_free(other);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* internal.h: a frame (then() callbacks run inside one) puts back, at its
 * end, what the callback changed of the thread's current streams on any
 * device, the outermost frame's too; a nested frame puts back only its
 * own changes. */
Test(device, a_frame_puts_back_the_current_streams_changed_inside_it_outermost_or_nested) {
  dp_backend_t *b = host();
  dp_stream_t *mine, *cb, *inner;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H1, &cb, T_ERR));
  OK(dp_stream_new(b, H1, &inner, T_ERR));
  OK(dp_set_current_stream(mine, NULL, T_ERR));
  dp__current_frame_t outer, nested;
  dp__current_frame_begin(&outer);
  OK(dp_set_current_stream(cb, NULL, T_ERR));
  dp_reset_current_stream(b, H0);
  cr_assert_eq(current(b, H0), dflt(b, H0));
  dp__current_frame_begin(&nested);
  OK(dp_set_current_stream(inner, NULL, T_ERR));
  dp__current_frame_end(&nested);
  cr_assert_eq(current(b, H1), cb, "the nested frame put back the outer frame's change");
  dp__current_frame_end(&outer);
  cr_assert_eq(current(b, H0), mine, "the thread's own stream did not come back");
  cr_assert_eq(current(b, H1), dflt(b, H1), "the callback's stream stayed current after it");
  dp_reset_current_stream(b, H0);
  dp_stream_free(mine);
  dp_stream_free(cb);
  dp_stream_free(inner);
}

/* A stream freed inside a frame is forgotten by the frame's log: at the
 * frame's end the thread gets its default stream back, never the freed
 * one (what the other entries logged still comes back). */
Test(device, a_stream_freed_inside_a_frame_is_not_put_back_at_its_end) {
  dp_backend_t *b = host();
  dp_stream_t *gone, *kept, *cb0, *cb1;
  OK(dp_stream_new(b, H0, &gone, T_ERR));
  OK(dp_stream_new(b, H1, &kept, T_ERR));
  OK(dp_stream_new(b, H0, &cb0, T_ERR));
  OK(dp_stream_new(b, H1, &cb1, T_ERR));
  OK(dp_set_current_stream(gone, NULL, T_ERR));
  OK(dp_set_current_stream(kept, NULL, T_ERR));
  dp__current_frame_t fr;
  dp__current_frame_begin(&fr);
  OK(dp_set_current_stream(cb0, NULL, T_ERR)); /* logs gone */
  OK(dp_set_current_stream(cb1, NULL, T_ERR)); /* logs kept */
  dp_stream_free(gone);
  dp__current_frame_end(&fr);
  cr_assert_eq(current(b, H0), dflt(b, H0), "the stream freed inside the frame came back as current");
  cr_assert_eq(current(b, H1), kept, "the other device's stream did not come back");
  dp_reset_current_stream(b, H1);
  dp_stream_free(kept);
  dp_stream_free(cb0);
  dp_stream_free(cb1);
}

Test(device, a_wait_or_a_record_names_which_of_its_two_handles_is_null) {
  dp_backend_t *b = host();
  dp_stream_t *s = dflt(b, H0);
  dp_event_t *ev;
  OK(dp_event_new(b, H0, &ev, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_stream_wait_event(s, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wait_event: NULL event");
  cr_assert_eq(dp_stream_wait_event(NULL, ev, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wait_event: NULL stream");
  cr_assert_eq(dp_event_record(ev, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_event_record: NULL stream");
  cr_assert_eq(dp_event_record(NULL, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_event_record: NULL event");
  cr_assert_eq(dp_stream_wait_stream(s, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wait_stream: NULL t (the stream waited for)");
  cr_assert_eq(dp_stream_wait_stream(NULL, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_stream_wait_stream: NULL s (the stream that waits)");
  dp_event_free(ev);
}

/* Every failure's message names the function called and the device
 * (device.h, "Errors and NULL"): out of memory deep in the backend said
 * "out of memory queueing host work" or "creating a stream", which names
 * neither the call (a launch? a copy? a wait?) nor the device. */
enum { NM_BACKEND, NM_STREAM_NEW, NM_DEFAULT, NM_POOL, NM_EVENT, NM_ALLOC, NM_SYNC, NM_COPY, NM_LAUNCH, NM_WRAP,
       NM_WAIT_EVENT, NM_WAIT_STREAM, NM_COUNT };
static const char *const nm_fn[NM_COUNT] = {
    "dp_backend_get", "dp_stream_new",  "dp_stream_default", "dp_stream_pool_next",  "dp_event_new",         "dp_device_alloc",
    "dp_device_synchronize", "dp_memcpy_async", "dp_host_launch", "dp_stream_wrap", "dp_stream_wait_event", "dp_stream_wait_stream"};

static void nm_noop(void *arg) { (void)arg; }
/* Holds t's stream until the op ran: a wait on work already done may
 * allocate nothing, and the op then fails no allocation. */
static _Atomic int nm_open;
static void nm_gate(void *arg) {
  (void)arg;
  while (!atomic_load(&nm_open)) sched_yield();
}

Test(device, every_out_of_memory_message_names_the_function_and_the_device) {
  for (int op = 0; op < NM_COUNT; op++) {
    long k = 1;
    for (;; k++) {
      cr_assert_lt(k, 100, "%s never ran without a failed allocation", nm_fn[op]);
      dp_backend_t *b = NULL;
      dp_stream_t *s = NULL, *t = NULL, *made = NULL;
      dp_event_t *ev = NULL;
      void *p = NULL;
      char src[8] = {0}, dst[8];
      if (op != NM_BACKEND) {
        b = host();
        OK(dp_stream_new(b, H0, &s, T_ERR));
        OK(dp_stream_new(b, H1, &t, T_ERR));
        OK(dp_event_new(b, H1, &ev, T_ERR));
        int gated = op == NM_WAIT_EVENT || op == NM_WAIT_STREAM; /* not a sync of t's device */
        atomic_store(&nm_open, !gated);
        OK(dp_host_launch(t, gated ? nm_gate : nm_noop, NULL, T_ERR));
        OK(dp_event_record(ev, t, T_ERR));
      }
      dp_error_t e;
      dp_error_clear(&e);
      long want = t_fail_at = atomic_load(&t_alloc_count) + k;
      int rc;
      switch (op) {
        case NM_BACKEND: rc = dp_backend_get(DP_DEVICE_HOST, &b, &e); break;
        case NM_STREAM_NEW: rc = dp_stream_new(b, H1, &made, &e); break;
        case NM_DEFAULT: rc = dp_stream_default(b, H1, &made, &e); break;
        case NM_POOL: rc = dp_stream_pool_next(b, H1, &made, &e); break;
        case NM_EVENT: {
          dp_event_t *more;
          rc = dp_event_new(b, H1, &more, &e);
          if (rc == 0) dp_event_free(more);
          break;
        }
        case NM_ALLOC: rc = dp_device_alloc(b, H1, 100, &p, &e); break;
        case NM_SYNC: rc = dp_device_synchronize(b, H1, &e); break;
        case NM_COPY: rc = dp_memcpy_async(s, dst, src, sizeof src, &e); break;
        case NM_LAUNCH: rc = dp_host_launch(s, nm_noop, NULL, &e); break;
        case NM_WRAP: rc = dp_stream_wrap(b, H0, dp_stream_native(s), &made, &e); break;
        case NM_WAIT_EVENT: rc = dp_stream_wait_event(s, ev, &e); break;
        default: rc = dp_stream_wait_stream(s, t, &e); break;
      }
      int hit = atomic_load(&t_alloc_count) >= want;
      t_fail_at = 0;
      atomic_store(&nm_open, 1);
      if (rc) {
        cr_assert_eq(rc, DP_ENOMEM, "%s, allocation %ld: %s: %s", nm_fn[op], k, dp_err_name(rc), e.message);
        cr_assert(strncmp(e.message, nm_fn[op], strlen(nm_fn[op])) == 0,
                  "%s, allocation %ld: the message does not name the function: %s", nm_fn[op], k, e.message);
        const char *dev = op == NM_BACKEND ? "host" : op >= NM_COPY ? "host:0" : "host:1"; /* the stream's */
        cr_assert(strstr(e.message, dev), "%s, allocation %ld: the message does not name %s: %s", nm_fn[op], k, dev,
                  e.message);
      }
      if (s) OK(dp_stream_synchronize(s, T_ERR));
      if (p) OK(dp_device_dealloc(b, H1, p, T_ERR));
      if (op == NM_STREAM_NEW) dp_stream_free(made);
      dp_event_free(ev);
      dp_stream_free(s);
      dp_stream_free(t);
      dp_shutdown();
      if (!hit) break;
    }
    cr_assert_gt(k, 1, "%s: no allocation was failed", nm_fn[op]);
  }
}

/* A host function that waits for another stream which itself waits (an
 * event wait) for work queued on the function's own stream after it,
 * waits for itself as surely as one that synchronizes its own stream: it
 * hung, its stream and the other with it. Such a wait, through any chain
 * of event waits, is DP_EMISUSE at once; one on an event the function's
 * stream had passed before it is waited for as usual. */
typedef struct via_wait {
  dp_stream_t *other, *third;
  dp_event_t *ev;           /* recorded on third (how 1) */
  _Atomic int go;
  int how;                  /* 0: sync other; 1: sync an event on third, which waits for other; 2: sync other's device */
  int rc;
  dp_error_t err;
} via_wait_t;

static void sync_through_another_stream(void *arg) {
  via_wait_t *x = arg;
  while (!atomic_load(&x->go)) sleep_ms(1);
  dp_error_clear(&x->err);
  x->rc = x->how == 0 ? dp_stream_synchronize(x->other, &x->err)
          : x->how == 1 ? dp_event_synchronize(x->ev, &x->err)
                        : dp_device_synchronize(dp_stream_backend(x->other), dp_stream_device(x->other), &x->err);
}

static void nm_noop2(void *arg) { (void)arg; }

/* Guarded by alarm(), not .timeout: Criterion's timeout record leaks
 * (LeakSanitizer) when two timed tests overlap. A hang is a crash. */
Test(device, a_host_function_waiting_for_a_stream_that_waits_for_its_own_later_work_is_emisuse_not_a_hang) {
  alarm(30);
  dp_backend_t *b = host();
  const char *want[3] = {"dp_stream_synchronize", "dp_event_synchronize", "dp_device_synchronize"};
  for (int how = 0; how < 3; how++) {
    dp_stream_t *mine;
    via_wait_t x = {.how = how, .rc = 1};
    OK(dp_stream_new(b, H0, &mine, T_ERR));
    OK(dp_stream_new(b, H1, &x.other, T_ERR));
    OK(dp_stream_new(b, H1, &x.third, T_ERR));
    OK(dp_host_launch(mine, sync_through_another_stream, &x, T_ERR));
    OK(dp_host_launch(mine, nm_noop2, NULL, T_ERR));
    dp_event_t *after, *on_other;
    OK(dp_event_new(b, H0, &after, T_ERR));
    OK(dp_event_record(after, mine, T_ERR)); /* after the function */
    OK(dp_stream_wait_event(x.other, after, T_ERR));
    OK(dp_host_launch(x.other, nm_noop2, NULL, T_ERR));
    OK(dp_event_new(b, H1, &on_other, T_ERR));
    OK(dp_event_record(on_other, x.other, T_ERR));
    OK(dp_stream_wait_event(x.third, on_other, T_ERR)); /* third waits for other, which waits for mine */
    OK(dp_event_new(b, H1, &x.ev, T_ERR));
    OK(dp_event_record(x.ev, x.third, T_ERR));
    atomic_store(&x.go, 1);
    OK(dp_stream_synchronize(mine, T_ERR));
    cr_assert_eq(x.rc, DP_EMISUSE, "how %d: %s: %s", how, dp_err_name(x.rc), x.err.message);
    cr_assert(strncmp(x.err.message, want[how], strlen(want[how])) == 0 && strstr(x.err.message, "wait for itself"),
              "how %d: %s", how, x.err.message);
    OK(dp_stream_synchronize(x.third, T_ERR));
    dp_event_free(after);
    dp_event_free(on_other);
    dp_event_free(x.ev);
    dp_stream_free(x.third);
    dp_stream_free(x.other);
    dp_stream_free(mine);
  }
  /* a wait on what the function's stream did before it is no wait for itself */
  dp_stream_t *mine;
  via_wait_t x = {.how = 0, .rc = 1};
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H1, &x.other, T_ERR));
  dp_event_t *before;
  OK(dp_event_new(b, H0, &before, T_ERR));
  OK(dp_host_launch(mine, nm_noop2, NULL, T_ERR));
  OK(dp_event_record(before, mine, T_ERR));
  OK(dp_stream_wait_event(x.other, before, T_ERR));
  OK(dp_host_launch(mine, sync_through_another_stream, &x, T_ERR));
  atomic_store(&x.go, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  cr_assert_eq(x.rc, 0, "%s", x.err.message);
  dp_event_free(before);
  dp_stream_free(x.other);
  dp_stream_free(mine);
  alarm(0);
}

/* The chain is followed through each stream once, for the furthest target
 * asked of it: a stream met again with a target it has already been
 * scanned up to is passed over. Here the stream first looked at (third,
 * target 3) is asked of more than the next one (other, target 1): a scan
 * that took third's record for other's passed over other and its wait for
 * the function, and the function hung instead of being refused. */
Test(device, a_host_function_is_emisuse_through_a_chain_whose_later_targets_are_lower) {
  alarm(30);
  dp_backend_t *b = host();
  dp_stream_t *mine;
  via_wait_t x = {.how = 1, .rc = 1};
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H1, &x.other, T_ERR));
  OK(dp_stream_new(b, H1, &x.third, T_ERR));
  OK(dp_host_launch(mine, sync_through_another_stream, &x, T_ERR));
  dp_event_t *after, *on_other;
  OK(dp_event_new(b, H0, &after, T_ERR));
  OK(dp_event_record(after, mine, T_ERR)); /* after the function */
  OK(dp_stream_wait_event(x.other, after, T_ERR));
  OK(dp_event_new(b, H1, &on_other, T_ERR));
  OK(dp_event_record(on_other, x.other, T_ERR)); /* other's target: 1 */
  OK(dp_host_launch(x.third, nm_noop2, NULL, T_ERR));
  OK(dp_host_launch(x.third, nm_noop2, NULL, T_ERR));
  OK(dp_stream_wait_event(x.third, on_other, T_ERR));
  OK(dp_event_new(b, H1, &x.ev, T_ERR));
  OK(dp_event_record(x.ev, x.third, T_ERR)); /* third's target: 3 */
  atomic_store(&x.go, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  cr_assert_eq(x.rc, DP_EMISUSE, "%s: %s", dp_err_name(x.rc), x.err.message);
  cr_assert_str_eq(x.err.message,
                   "dp_event_synchronize: called from a host function, on an event of a stream that waits (through event "
                   "waits) for work queued on the function's own stream after it: it would wait for itself");
  OK(dp_stream_synchronize(x.third, T_ERR));
  dp_event_free(after);
  dp_event_free(on_other);
  dp_event_free(x.ev);
  dp_stream_free(x.third);
  dp_stream_free(x.other);
  dp_stream_free(mine);
  alarm(0);
}

/* A host function synchronizing a stream with many waits queued (more
 * than the chain walk keeps on its own stack) on work that is not its
 * own: no wait for itself, it waits as usual. */
static void sync_other_when_go(void *arg) {
  via_wait_t *x = arg;
  while (!atomic_load(&x->go)) sleep_ms(1);
  x->rc = dp_stream_synchronize(x->other, &x->err);
}

Test(device, a_host_function_synchronizing_a_stream_with_many_queued_waits_waits_for_them) {
  alarm(30);
  dp_backend_t *b = host();
  dp_stream_t *mine, *held;
  via_wait_t x = {.rc = 1};
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H1, &held, T_ERR));
  OK(dp_stream_new(b, H1, &x.other, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(held, hold_until_open, &g, T_ERR));
  enum { NWAITS = 20 };
  dp_event_t *ev[NWAITS];
  for (int i = 0; i < NWAITS; i++) {
    OK(dp_host_launch(held, nm_noop2, NULL, T_ERR));
    OK(dp_event_new(b, H1, &ev[i], T_ERR));
    OK(dp_event_record(ev[i], held, T_ERR));
    OK(dp_stream_wait_event(x.other, ev[i], T_ERR));
  }
  OK(dp_host_launch(mine, sync_other_when_go, &x, T_ERR));
  atomic_store(&x.go, 1);
  atomic_store(&g.open, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  cr_assert_eq(x.rc, 0, "%s", x.err.message);
  cr_assert_eq(dp_stream_query(held, NULL), 1, "the synchronize returned before the work it waited for");
  for (int i = 0; i < NWAITS; i++) dp_event_free(ev[i]);
  dp_stream_free(x.other);
  dp_stream_free(held);
  dp_stream_free(mine);
  alarm(0);
}

/* Following the waits takes memory (a stack of the waits met): when it
 * could not be had, the walk stopped and said "no wait for itself", and
 * the host function waited on — for itself, hanging, where the walk would
 * have found it. Now the call is DP_ENOMEM, naming itself, and waits for
 * nothing: here it returns while the stream it would wait for is still
 * held (the old code waited until the gate opened). */
typedef struct oom_sync {
  dp_stream_t *other, *held;
  dp_event_t *ev;   /* recorded on other (how 1) */
  int how;          /* 0: sync other; 1: sync ev; 2: sync other's device */
  long nth;         /* the allocation of the call that fails */
  _Atomic int done;
  int rc, held_done;
  dp_error_t err;
} oom_sync_t;

static void sync_with_an_allocation_failed(void *arg) {
  oom_sync_t *x = arg;
  dp_error_clear(&x->err);
  t_fail_at = atomic_load(&t_alloc_count) + x->nth;
  x->rc = x->how == 0 ? dp_stream_synchronize(x->other, &x->err)
          : x->how == 1 ? dp_event_synchronize(x->ev, &x->err)
                        : dp_device_synchronize(dp_stream_backend(x->other), dp_stream_device(x->other), &x->err);
  t_fail_at = 0;
  x->held_done = dp_stream_query(x->held, NULL);
  atomic_store(&x->done, 1);
}

Test(device, a_host_function_whose_wait_cannot_be_followed_for_want_of_memory_is_enomem_and_waits_for_nothing) {
  alarm(60);
  dp_backend_t *b = host();
  const char *fn[3] = {"dp_stream_synchronize", "dp_event_synchronize", "dp_device_synchronize"};
  for (int how = 0; how < 3; how++) {
    dp_stream_t *mine;
    oom_sync_t x = {.how = how, .nth = how == 2 ? 3 : 1 /* after the device's two arrays */, .rc = 1};
    OK(dp_stream_new(b, H0, &mine, T_ERR));
    OK(dp_stream_new(b, H1, &x.held, T_ERR));
    OK(dp_stream_new(b, H1, &x.other, T_ERR));
    started_gate_t g;
    atomic_init(&g.started, 0);
    atomic_init(&g.open, 0);
    OK(dp_host_launch(x.held, hold_until_open, &g, T_ERR));
    enum { NWAITS = 40 }; /* more than the walk keeps on its own stack */
    dp_event_t *ev[NWAITS];
    for (int i = 0; i < NWAITS; i++) {
      OK(dp_host_launch(x.held, nm_noop2, NULL, T_ERR));
      OK(dp_event_new(b, H1, &ev[i], T_ERR));
      OK(dp_event_record(ev[i], x.held, T_ERR));
      OK(dp_stream_wait_event(x.other, ev[i], T_ERR));
    }
    OK(dp_event_new(b, H1, &x.ev, T_ERR));
    OK(dp_event_record(x.ev, x.other, T_ERR));
    wait_started(&g);
    OK(dp_host_launch(mine, sync_with_an_allocation_failed, &x, T_ERR));
    for (int i = 0; i < 10000 && !atomic_load(&x.done); i++) sleep_ms(1); /* allocates nothing */
    atomic_store(&g.open, 1);
    OK(dp_stream_synchronize(mine, T_ERR));
    cr_assert_eq(x.rc, DP_ENOMEM, "how %d: %s: %s", how, dp_err_name(x.rc), x.err.message);
    char want[300];
    snprintf(want, sizeof want,
             "%s: out of memory following the event waits of the streams it would wait for, to tell whether the "
             "host function calling it would wait for itself: nothing waited for",
             fn[how]);
    cr_assert_str_eq(x.err.message, want, "how %d", how);
    cr_assert_eq(x.held_done, 0, "how %d: the call waited for the stream it could not clear", how);
    OK(dp_stream_synchronize(x.other, T_ERR));
    for (int i = 0; i < NWAITS; i++) dp_event_free(ev[i]);
    dp_event_free(x.ev);
    dp_stream_free(x.other);
    dp_stream_free(x.held);
    dp_stream_free(mine);
  }
  alarm(0);
}

/* The walk looks at each stream once and scans each task once: a chain of
 * n streams, each waiting for the one before, the first for the host
 * function's own later work, cost n * n steps (every stream looked up in a
 * list of those seen), and a stream met again and again with a further
 * target was scanned from its head each time, k * k for k targets. Both
 * are refused as before, in steps linear in the streams and waits. */
typedef struct steps_sync {
  dp_stream_t *target;
  dp_event_t *ev;   /* when set, synchronized instead of target */
  dp_backend_t *b;  /* when set, its device host:1 synchronized instead */
  _Atomic int go;
  int rc;
  uint64_t steps;
  dp_error_t err;
} steps_sync_t;

static void sync_counting_steps(void *arg) {
  steps_sync_t *x = arg;
  while (!atomic_load(&x->go)) sleep_ms(1);
  dp_error_clear(&x->err);
  uint64_t before = atomic_load(&dp__host_self_wait_steps);
  x->rc = x->b    ? dp_device_synchronize(x->b, H1, &x->err)
          : x->ev ? dp_event_synchronize(x->ev, &x->err)
                  : dp_stream_synchronize(x->target, &x->err);
  x->steps = atomic_load(&dp__host_self_wait_steps) - before;
}

Test(device, the_look_for_a_host_function_waiting_for_itself_takes_steps_linear_in_the_streams_and_waits) {
  alarm(60);
  dp_backend_t *b = host();
  dp_stream_t *mine;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  /* a chain of NS streams, the first waiting for mine after the function */
  enum { NS = 200 };
  dp_stream_t *chain[NS];
  dp_event_t *after, *ev[NS];
  steps_sync_t x = {.rc = 1};
  OK(dp_host_launch(mine, sync_counting_steps, &x, T_ERR));
  OK(dp_event_new(b, H0, &after, T_ERR));
  OK(dp_event_record(after, mine, T_ERR));
  for (int i = 0; i < NS; i++) {
    OK(dp_stream_new(b, H1, &chain[i], T_ERR));
    OK(dp_stream_wait_event(chain[i], i ? ev[i - 1] : after, T_ERR));
    OK(dp_event_new(b, H1, &ev[i], T_ERR));
    OK(dp_event_record(ev[i], chain[i], T_ERR));
  }
  x.target = chain[NS - 1];
  atomic_store(&x.go, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  cr_assert_eq(x.rc, DP_EMISUSE, "%s: %s", dp_err_name(x.rc), x.err.message);
  cr_assert_leq(x.steps, 4 * NS, "a chain of %d streams took %llu steps", NS, (unsigned long long)x.steps);
  for (int i = NS; i-- > 0;) {
    OK(dp_stream_synchronize(chain[i], T_ERR));
    dp_event_free(ev[i]);
    dp_stream_free(chain[i]);
  }
  /* one stream met with K further targets, the last behind a wait for mine */
  enum { K = 2000 };
  dp_stream_t *o, *w;
  dp_event_t *on_o[K], *last;
  OK(dp_stream_new(b, H1, &o, T_ERR));
  OK(dp_stream_new(b, H1, &w, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(o, hold_until_open, &g, T_ERR)); /* nothing of o's completes meanwhile */
  steps_sync_t y = {.target = w, .rc = 1};
  OK(dp_host_launch(mine, sync_counting_steps, &y, T_ERR));
  OK(dp_event_record(after, mine, T_ERR));
  for (int i = 0; i < K; i++) {
    OK(dp_host_launch(o, nm_noop2, NULL, T_ERR));
    OK(dp_event_new(b, H1, &on_o[i], T_ERR));
    OK(dp_event_record(on_o[i], o, T_ERR));
  }
  OK(dp_stream_wait_event(o, after, T_ERR));
  OK(dp_event_new(b, H1, &last, T_ERR));
  OK(dp_event_record(last, o, T_ERR));
  /* w's waits, furthest first: the walk meets them nearest first */
  OK(dp_stream_wait_event(w, last, T_ERR));
  for (int i = K; i-- > 0;) OK(dp_stream_wait_event(w, on_o[i], T_ERR));
  atomic_store(&y.go, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  cr_assert_eq(y.rc, DP_EMISUSE, "%s: %s", dp_err_name(y.rc), y.err.message);
  cr_assert_leq(y.steps, 4 * (K + 4), "%d targets on one stream took %llu steps", K, (unsigned long long)y.steps);
  atomic_store(&g.open, 1);
  OK(dp_stream_synchronize(w, T_ERR));
  for (int i = 0; i < K; i++) dp_event_free(on_o[i]);
  dp_event_free(last);
  dp_event_free(after);
  dp_stream_free(w);
  dp_stream_free(o);
  dp_stream_free(mine);
  alarm(0);
}

/* ---- dp_device_read: an inline pickle's reader through the backend ---- */

typedef struct fill {
  uint8_t *at;
  size_t n;
} fill_t;

static void slow_fill(void *arg) {
  fill_t *f = arg;
  sleep_ms(60); /* device work made slow on purpose: a read not ordered after it sees zeros */
  for (size_t i = 0; i < f->n; i++) f->at[i] = (uint8_t)(0xa0 + i);
}

Test(device, an_inline_pickle_reads_device_memory_through_dp_device_read_after_the_current_streams_work) {
  dp_backend_t *b = host();
  void *p;
  OK(dp_device_alloc(b, H0, 16, &p, T_ERR));
  memset(p, 0, 16);
  fill_t f = {p, 16};
  OK(dp_host_launch(current(b, H0), slow_fill, &f, T_ERR)); /* queued, not yet run */
  dp_value_t t = t_tensor(H0, (uintptr_t)p, 4);
  dp_frame_t *fr;
  OK(dp_frame_new(&fr, T_ERR));
  OK(dp_pickle(t, &(dp_pickle_opts_t){.flags = DP_PICKLE_INLINE, .read = dp_device_read}, fr, T_ERR));
  uint8_t want[16];
  for (int i = 0; i < 16; i++) want[i] = (uint8_t)(0xa0 + i);
  size_t n;
  const uint8_t *bytes = dp_frame_data(fr, &n);
  int found = 0;
  for (size_t i = 0; i + 16 <= n && !found; i++) found = !memcmp(bytes + i, want, 16);
  cr_assert(found, "the frame carries the bytes the stream's work wrote");
  /* and back: the storage carries them as host data */
  dp_value_t back;
  OK(dp_unpickle(bytes, n, NULL, &back, T_ERR));
  dp_storage_t *st = dp_tensor_storage(back);
  const void *hd = dp_storage_host_data(st);
  cr_assert(hd && dp_storage_nbytes(st) == 16 && !memcmp(hd, want, 16));
  dp_value_release(back);
  dp_value_release(t);
  dp_frame_free(fr);
  OK(dp_device_dealloc(b, H0, p, T_ERR));
}

Test(device, dp_device_read_refuses_a_device_of_another_backend_or_out_of_range_and_copies_cpu_memory_itself) {
  dp_backend_t *b = host();
  uint8_t src[4] = {1, 2, 3, 4}, dst[4] = {0};
  dp_error_t e;
  cr_assert_eq(dp_device_read(b, t_dev(DP_DEVICE_CUDA, 0), src, 4, dst, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "dp_device_read"), "%s", e.message);
  cr_assert_eq(dp_device_read(NULL, t_dev(DP_DEVICE_HOST, 9), src, 4, dst, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "dp_device_read") && strstr(e.message, "host:9"), "%s", e.message);
  cr_assert_eq(dp_device_read(NULL, H0, NULL, 4, dst, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_read: NULL src");
  cr_assert_eq(dp_device_read(NULL, H0, src, 4, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_read: NULL dst");
  OK(dp_device_read(NULL, H0, NULL, 0, NULL, T_ERR)); /* nothing to read */
  OK(dp_device_read(NULL, t_dev(DP_DEVICE_CPU, 0), src, 4, dst, T_ERR));
  cr_assert(!memcmp(src, dst, 4));
}

/* A read refused from a host function (it would wait for the function
 * itself) must not leave the copy queued: it ran once the function had
 * returned, into a dst the caller took as untouched. */
typedef struct read_in_fn {
  dp_backend_t *b;
  const void *src;
  uint8_t *dst;
  int rc;
  dp_error_t err;
} read_in_fn_t;

static void read_from_fn(void *arg) {
  read_in_fn_t *r = arg;
  r->rc = dp_device_read(r->b, H0, r->src, 16, r->dst, &r->err);
}

Test(device, dp_device_read_refused_in_a_host_function_on_its_own_stream_copies_nothing_later) {
  dp_backend_t *b = host();
  void *p;
  OK(dp_device_alloc(b, H0, 16, &p, T_ERR));
  memset(p, 'X', 16);
  uint8_t dst[16] = {0};
  read_in_fn_t r = {b, p, dst, 1, {0}};
  dp_stream_t *s = current(b, H0); /* the worker's current stream is the default one too */
  OK(dp_host_launch(s, read_from_fn, &r, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(r.rc, DP_EMISUSE, "%s: %s", dp_err_name(r.rc), r.err.message);
  cr_assert(strstr(r.err.message, "dp_device_read(host:0)") && strstr(r.err.message, "nothing copied"), "%s",
            r.err.message);
  for (int i = 0; i < 16; i++) cr_assert_eq(dst[i], 0, "byte %d was copied after the refusal", i);
  OK(dp_device_dealloc(b, H0, p, T_ERR));
}

/* dp_device_synchronize from a host function looked for a wait for the
 * function from each stream of the device in a walk of its own: streams
 * that wait one for the next were looked at again from each of them, n * n
 * steps for a chain of n. One walk from all of them is linear (counted by
 * sync_counting_steps above). Guarded by alarm(), as the other timed tests
 * added alongside it: Criterion's timeout record leaks when two timed
 * tests overlap. */
Test(device, a_host_function_synchronizing_a_device_follows_its_streams_waits_in_steps_linear_in_them) {
  alarm(60);
  dp_backend_t *b = host();
  dp_stream_t *mine, *x, *o;
  dp_event_t *after, *held;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  steps_sync_t d = {.b = b, .rc = 1};
  OK(dp_host_launch(mine, sync_counting_steps, &d, T_ERR));
  OK(dp_event_new(b, H0, &after, T_ERR));
  OK(dp_event_record(after, mine, T_ERR));
  /* the oldest stream of host:1 waits for mine's work after the function:
     the device's list is newest first, so it is reached last */
  OK(dp_stream_new(b, H1, &x, T_ERR));
  OK(dp_stream_wait_event(x, after, T_ERR));
  /* a chain of NS streams, the first held by a gate that opens at the end */
  OK(dp_stream_new(b, H0, &o, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(o, hold_until_open, &g, T_ERR));
  OK(dp_event_new(b, H0, &held, T_ERR));
  OK(dp_event_record(held, o, T_ERR));
  enum { NS = 300 };
  dp_stream_t *chain[NS];
  dp_event_t *ev[NS];
  for (int i = 0; i < NS; i++) {
    OK(dp_stream_new(b, H1, &chain[i], T_ERR));
    OK(dp_stream_wait_event(chain[i], i ? ev[i - 1] : held, T_ERR));
    OK(dp_event_new(b, H1, &ev[i], T_ERR));
    OK(dp_event_record(ev[i], chain[i], T_ERR));
  }
  atomic_store(&d.go, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  atomic_store(&g.open, 1); /* before any assertion: the teardown waits for the chain */
  cr_assert_eq(d.rc, DP_EMISUSE, "%s: %s", dp_err_name(d.rc), d.err.message);
  cr_assert_leq(d.steps, 4 * (NS + 4), "%d streams waiting one for the next took %llu steps", NS,
                (unsigned long long)d.steps);
  for (int i = NS; i-- > 0;) {
    OK(dp_stream_synchronize(chain[i], T_ERR));
    dp_event_free(ev[i]);
    dp_stream_free(chain[i]);
  }
  dp_event_free(held);
  dp_event_free(after);
  dp_stream_free(o);
  dp_stream_free(x);
  dp_stream_free(mine);
}

/* The walk made room on its stack for every task it scanned, waits or not:
 * a host function synchronizing a stream with many host functions queued
 * asked for 16 bytes a task (and, refused that, was DP_ENOMEM where it
 * could tell). It makes room for the waits it follows only. */
Test(device, a_host_function_synchronizing_a_stream_with_many_tasks_but_one_wait_asks_no_memory_per_task) {
  alarm(60);
  dp_backend_t *b = host();
  dp_stream_t *mine, *o;
  dp_event_t *after;
  OK(dp_stream_new(b, H0, &mine, T_ERR));
  OK(dp_stream_new(b, H1, &o, T_ERR));
  steps_sync_t x = {.target = o, .rc = 1};
  OK(dp_host_launch(mine, sync_counting_steps, &x, T_ERR));
  OK(dp_event_new(b, H0, &after, T_ERR));
  OK(dp_event_record(after, mine, T_ERR));
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(o, hold_until_open, &g, T_ERR)); /* nothing of o's completes meanwhile */
  enum { K = 20000 };
  for (int i = 0; i < K; i++) OK(dp_host_launch(o, nm_noop2, NULL, T_ERR));
  OK(dp_stream_wait_event(o, after, T_ERR)); /* the one wait, behind them: for mine after the function */
  atomic_store(&t_max_block, 0);
  atomic_store(&x.go, 1);
  OK(dp_stream_synchronize(mine, T_ERR));
  long biggest = atomic_load(&t_max_block); /* the walk's, while nothing else here allocates */
  atomic_store(&g.open, 1);
  cr_assert_eq(x.rc, DP_EMISUSE, "%s: %s", dp_err_name(x.rc), x.err.message);
  cr_assert_lt(biggest, 1024, "a walk over %d tasks and one wait asked for a block of %ld bytes", K, biggest);
  OK(dp_stream_synchronize(o, T_ERR));
  dp_event_free(after);
  dp_stream_free(o);
  dp_stream_free(mine);
}

/* A stream's queue grew for a burst and kept that size until the stream
 * went: a default or pool stream, alive until dp_shutdown, held 64 bytes
 * for every task of its largest burst. Once drained, it gives them back. */
Test(device, a_queue_grown_for_a_burst_gives_its_memory_back_once_drained) {
  alarm(30);
  dp_backend_t *b = host();
  dp_stream_t *s = dflt(b, H0);
  OK(dp_stream_synchronize(s, T_ERR));
  long before = atomic_load(&t_live_bytes);
  started_gate_t g;
  atomic_init(&g.started, 0);
  atomic_init(&g.open, 0);
  OK(dp_host_launch(s, hold_until_open, &g, T_ERR));
  enum { K = 100000 };
  for (int i = 0; i < K; i++) OK(dp_host_launch(s, nm_noop2, NULL, T_ERR));
  long during = atomic_load(&t_live_bytes);
  atomic_store(&g.open, 1);
  OK(dp_stream_synchronize(s, T_ERR));
  long after = atomic_load(&t_live_bytes);
  cr_assert_gt(during - before, (long)K * 32, "the burst was queued (%ld bytes)", during - before);
  cr_assert_leq(after - before, 64 * 64, "%ld bytes still held after a burst of %d tasks drained", after - before, K);
  /* and the stream goes on as before */
  _Atomic int one = 0;
  OK(dp_host_launch(s, store_one, &one, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(atomic_load(&one), 1);
}
