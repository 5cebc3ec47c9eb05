/* The CUDA backend and the caching allocator on a real GPU. Device work is
 * slowed down on purpose (a kernel that spins before it writes), so that a
 * missing wait shows up as wrong data; each race test has a negative control
 * that leaves the synchronization out and observes the race. Every test
 * skips, saying why, where no CUDA device is usable. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "devpickle.h"
#include "../../transport/internal.h"

int gpu_spin_write(void *stream, int *p, int value, double ms);
int gpu_spin_check(void *stream, const void *p, int n, unsigned char expect, double ms, int *ok);
int gpu_fill(void *stream, void *p, int n, unsigned char v);
int gpu_spin_fill(void *stream, void *p, size_t n, unsigned char v, double ms);
void *gpu_stream_create(void);
void gpu_stream_destroy(void *s);

static dp_backend_t *B;
#define G0 ((dp_device_t){DP_DEVICE_CUDA, 0})

#define OK(call)                                                                  \
  do {                                                                            \
    dp_error_t e_;                                                                \
    dp_error_clear(&e_);                                                          \
    int rc_ = (call);                                                             \
    cr_assert_eq(rc_, 0, "%s failed: %s %s", #call, dp_err_name(rc_), e_.message); \
  } while (0)

static void setup(void) {
  dp_error_t e;
  unsetenv("DEVPICKLE_BACKEND");
  if (dp_backend_get(DP_DEVICE_CUDA, &B, &e) != 0) cr_skip_test("%s", e.message);
}
static void teardown(void) { dp_shutdown(); }
TestSuite(gpu, .init = setup, .fini = teardown);

Test(gpu, the_default_backend_is_cuda_when_a_gpu_is_usable) {
  dp_backend_t *b;
  OK(dp_backend_default(&b, NULL));
  cr_assert_str_eq(dp_backend_name(b), "cuda");
  cr_assert_gt(dp_backend_device_count(b), 0);
}

/* Producer on stream a: spin, then write 42 into device memory. Consumer on
 * stream c: copy it to the host. */
static int consumer_sees(int with_wait) {
  dp_stream_t *a, *c;
  OK(dp_stream_new(B, G0, &a, NULL));
  OK(dp_stream_new(B, G0, &c, NULL));
  int *dev;
  OK(dp_device_alloc(B, G0, sizeof(int), (void **)&dev, NULL));
  int zero = 0, out = -1;
  OK(dp_memcpy_async(a, dev, &zero, sizeof zero, NULL));
  OK(dp_stream_synchronize(a, NULL));
  cr_assert_eq(gpu_spin_write(dp_stream_native(a), dev, 42, 20.0), 0);
  dp_event_t *ev;
  OK(dp_event_new(B, G0, &ev, NULL));
  OK(dp_event_record(ev, a, NULL));
  if (with_wait) OK(dp_stream_wait_event(c, ev, NULL));
  OK(dp_memcpy_async(c, &out, dev, sizeof out, NULL));
  OK(dp_stream_synchronize(c, NULL));
  OK(dp_stream_synchronize(a, NULL));
  dp_event_free(ev);
  OK(dp_device_dealloc(B, G0, dev, NULL));
  dp_stream_free(a);
  dp_stream_free(c);
  return out;
}

Test(gpu, a_stream_that_waits_on_an_event_sees_the_kernels_write) {
  for (int i = 0; i < 3; i++) cr_assert_eq(consumer_sees(1), 42);
}

Test(gpu, negative_control_without_the_wait_the_copy_reads_stale_data) {
  cr_assert_eq(consumer_sees(0), 0, "without the wait the copy overtakes the spinning kernel");
}

Test(gpu, an_event_freed_while_its_record_runs_comes_back_from_the_pool_never_recorded) {
  dp_stream_t *s;
  OK(dp_stream_new(B, G0, &s, NULL));
  int *dev;
  OK(dp_device_alloc(B, G0, sizeof(int), (void **)&dev, NULL));
  dp_event_t *ev, *again;
  OK(dp_event_new(B, G0, &ev, NULL));
  cr_assert_eq(gpu_spin_write(dp_stream_native(s), dev, 1, 200.0), 0);
  OK(dp_event_record(ev, s, NULL));
  cr_assert_eq(dp_event_query(ev, NULL), 0, "the kernel spins for 200 ms");
  dp_event_free(ev);
  OK(dp_event_new(B, G0, &again, NULL));
  cr_assert_eq(again, ev, "the pool hands the same event out");
  cr_assert_eq(dp_event_query(again, NULL), 1, "its previous owner's record is dropped (device.h)");
  cr_assert_eq(dp_stream_query(s, NULL), 0, "while that kernel still runs");
  dp_event_free(again);
  OK(dp_device_synchronize(B, G0, NULL));
  OK(dp_device_dealloc(B, G0, dev, NULL));
  dp_stream_free(s);
}

Test(gpu, events_and_streams_answer_queries) {
  dp_stream_t *s;
  OK(dp_stream_new(B, G0, &s, NULL));
  int *dev;
  OK(dp_device_alloc(B, G0, sizeof(int), (void **)&dev, NULL));
  dp_event_t *ev;
  OK(dp_event_new(B, G0, &ev, NULL));
  cr_assert_eq(dp_event_query(ev, NULL), 1, "never recorded: complete");
  cr_assert_eq(gpu_spin_write(dp_stream_native(s), dev, 1, 20.0), 0);
  OK(dp_event_record(ev, s, NULL));
  cr_assert_eq(dp_event_query(ev, NULL), 0);
  cr_assert_eq(dp_stream_query(s, NULL), 0);
  OK(dp_event_synchronize(ev, NULL));
  cr_assert_eq(dp_event_query(ev, NULL), 1);
  OK(dp_device_synchronize(B, G0, NULL));
  cr_assert_eq(dp_stream_query(s, NULL), 1);
  dp_device_t d;
  OK(dp_pointer_device(B, (char *)dev + 2, &d, NULL));
  cr_assert(dp_device_equal(d, G0));
  int local;
  cr_assert_eq(dp_pointer_device(B, &local, &d, NULL), DP_ENOTFOUND);
  dp_event_free(ev);
  dp_event_t *again;
  OK(dp_event_new(B, G0, &again, NULL));
  cr_assert_eq(again, ev, "events come back from the pool");
  dp_event_free(again);
  OK(dp_device_dealloc(B, G0, dev, NULL));
  dp_stream_free(s);
}

/* ---- the caching allocator on the GPU ---- */

static int user_stream_sees_its_data(int record) {
  dp_cache_t *c;
  OK(dp_cache_new(B, &c, NULL));
  dp_stream_t *s, *u;
  OK(dp_stream_new(B, G0, &s, NULL));
  OK(dp_stream_new(B, G0, &u, NULL));
  int *ok;
  OK(dp_device_alloc(B, G0, sizeof(int), (void **)&ok, NULL));
  void *p;
  OK(dp_cache_alloc(c, G0, 4096, s, &p, NULL));
  cr_assert_eq(gpu_fill(dp_stream_native(s), p, 4096, 0xAA), 0);
  OK(dp_stream_synchronize(s, NULL));
  /* u reads p after spinning 20 ms */
  cr_assert_eq(gpu_spin_check(dp_stream_native(u), p, 4096, 0xAA, 20.0, ok), 0);
  if (record) OK(dp_cache_record_stream(c, (char *)p + 64, u, NULL));
  OK(dp_cache_dealloc(c, p, NULL));
  void *q;
  OK(dp_cache_alloc(c, G0, 4096, s, &q, NULL));
  cr_assert_eq(gpu_fill(dp_stream_native(s), q, 4096, 0x55), 0);
  OK(dp_device_synchronize(B, G0, NULL));
  int host_ok = -1;
  OK(dp_memcpy_async(s, &host_ok, ok, sizeof host_ok, NULL));
  OK(dp_stream_synchronize(s, NULL));
  if (record) {
    cr_assert_neq(q, p, "the block was in use on u: not handed out again");
    cr_assert_eq(dp_cache_poll(c, NULL), 1);
  }
  OK(dp_cache_dealloc(c, q, NULL));
  OK(dp_device_dealloc(B, G0, ok, NULL));
  dp_stream_free(s);
  dp_stream_free(u);
  dp_cache_free(c);
  return host_ok;
}

Test(gpu, record_stream_keeps_a_block_until_the_user_streams_kernel_is_done) {
  cr_assert_eq(user_stream_sees_its_data(1), 1);
}

Test(gpu, negative_control_without_record_stream_the_reused_block_is_overwritten_under_the_kernel) {
  cr_assert_eq(user_stream_sees_its_data(0), 0);
}

Test(gpu, another_stream_reusing_a_block_waits_for_the_first_streams_kernel) {
  dp_cache_t *c;
  OK(dp_cache_new(B, &c, NULL));
  dp_stream_t *s, *t;
  OK(dp_stream_new(B, G0, &s, NULL));
  OK(dp_stream_new(B, G0, &t, NULL));
  int *p;
  OK(dp_cache_alloc(c, G0, 4096, s, (void **)&p, NULL));
  cr_assert_eq(gpu_spin_write(dp_stream_native(s), p, 7, 20.0), 0);  /* s writes 7 late */
  OK(dp_cache_dealloc(c, p, NULL));
  int *q;
  OK(dp_cache_alloc(c, G0, 4096, t, (void **)&q, NULL));
  cr_assert_eq(q, p);
  cr_assert_eq(gpu_fill(dp_stream_native(t), q, 4, 0x01), 0);  /* t's write must land after s's */
  int out = 0;
  OK(dp_memcpy_async(t, &out, q, sizeof out, NULL));
  OK(dp_stream_synchronize(t, NULL));
  cr_assert_eq(out, 0x01010101, "t's write came last");
  dp_cache_stats_t st;
  OK(dp_cache_stats(c, G0, &st, NULL));
  cr_assert_eq(st.cross_stream, 1);
  OK(dp_cache_dealloc(c, q, NULL));
  OK(dp_device_synchronize(B, G0, NULL));
  dp_stream_free(s);
  dp_stream_free(t);
  dp_cache_free(c);
}

Test(gpu, an_impossible_allocation_is_enomem_after_freeing_the_cache) {
  dp_cache_t *c;
  OK(dp_cache_new(B, &c, NULL));
  void *p;
  dp_error_t e;
  cr_assert_eq(dp_cache_alloc(c, G0, (size_t)1 << 50, NULL, &p, &e), DP_ENOMEM, "%s", e.message);
  dp_cache_stats_t st;
  OK(dp_cache_stats(c, G0, &st, NULL));
  cr_assert_eq(st.oom_retries, 1);
  dp_cache_free(c);
}

/* ---- the future on the GPU ---- */

static int *tensor_base(dp_value_t t) { return dp_storage_base(dp_tensor_storage(t)); }

static dp_value_t cuda_ints(dp_cache_t *c, int n) {
  void *p;
  OK(dp_cache_alloc(c, G0, (size_t)n * sizeof(int), NULL, &p, NULL));
  dp_storage_t *st;
  OK(dp_storage_new(G0, p, (size_t)n * sizeof(int), NULL, NULL, &st, NULL));
  int64_t shape[1] = {n};
  dp_value_t t;
  OK(dp_tensor_new(st, DP_INT32, 1, shape, NULL, 0, &t, NULL));
  return t;
}

typedef struct gpu_cb {
  dp_cache_t *c;
  dp_value_t made;
} gpu_cb_t;

/* The defining case: new device work launched in the callback, its result
 * returned inside a user-defined object. */
static int gpu_launch_and_wrap(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  gpu_cb_t *s = ud;
  (void)parent;
  dp_value_t out = cuda_ints(s->c, 1);
  dp_stream_t *cur;
  OK(dp_current_stream(B, G0, &cur, NULL));
  int rc = gpu_spin_write(dp_stream_native(cur), tensor_base(out), 99, 20.0);
  if (rc) return DP_ECUDA;
  s->made = dp_value_retain(out);
  dp_value_t obj;
  if ((rc = dp_object_new("Result", &obj, err)) != 0) return rc;
  *result = obj;
  return dp_object_set(obj, "out", out, err);
}

static int gpu_child_consumer_reads(int wait_on_child) {
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, NULL));
  dp_stream_t *cons;
  OK(dp_stream_new(B, G0, &cons, NULL));
  dp_future_t *parent, *child;
  dp_future_opts_t o = {B, NULL, 0, NULL, 0, 0};
  OK(dp_future_new(&o, &parent, NULL));
  gpu_cb_t st;
  st.c = c;
  st.made = dp_none();
  OK(dp_future_then(parent, gpu_launch_and_wrap, &st, &child, NULL));
  OK(dp_future_mark_completed(parent, cuda_ints(c, 1), NULL));
  OK(dp_set_current_stream(cons, NULL, NULL));
  OK(dp_future_wait(wait_on_child ? child : parent, -1, NULL));
  int out = -1;
  OK(dp_memcpy_async(cons, &out, tensor_base(st.made), sizeof out, NULL));
  OK(dp_stream_synchronize(cons, NULL));
  OK(dp_device_synchronize(B, G0, NULL));
  dp_reset_current_stream(B, G0);
  cr_assert_eq(dp_future_nptrs(child), 1);
  dp_cache_dealloc(c, tensor_base(st.made), NULL);
  dp_cache_dealloc(c, tensor_base(dp_future_value(parent)), NULL);
  dp_value_release(st.made);
  dp_future_release(parent);
  dp_future_release(child);
  dp_stream_free(cons);
  return out;
}

Test(gpu, the_consumer_of_a_then_child_sees_the_callbacks_finished_kernel) {
  cr_assert_eq(gpu_child_consumer_reads(1), 99);
}

Test(gpu, negative_control_the_parents_events_do_not_cover_the_callbacks_kernel) {
  int v = gpu_child_consumer_reads(0);
  cr_assert_neq(v, 99, "waiting on the parent alone must not be enough (read %d)", v);
}

/* A tensor at a made-up address of dev: its future records no stream uses. */
static dp_future_t *completed_with_tensor_on(dp_backend_t *b, dp_device_t dev) {
  dp_storage_t *st;
  dp_value_t t;
  int64_t n = 4;
  OK(dp_storage_new(dev, (void *)(uintptr_t)0x7f0000000000u, 16, NULL, NULL, &st, NULL));
  OK(dp_tensor_new(st, DP_FLOAT32, 1, &n, NULL, 0, &t, NULL));
  dp_future_t *f;
  dp_future_opts_t o = {b, NULL, 0, NULL, 1, 0};
  OK(dp_future_new(&o, &f, NULL));
  OK(dp_future_mark_completed(f, t, NULL));
  return f;
}

/* future.h: with opts NULL the aggregate takes futures[0]'s backend and
 * devices, and an input's allocation outside them fails it with
 * DP_EDEVICE, as dp_future_mark_completed does — a device of the other
 * backend too, whichever backend comes first — naming the second input's
 * path in the list of values. */
Test(gpu, collect_all_over_futures_of_two_backends_fails_with_edevice_naming_the_device) {
  dp_backend_t *host;
  OK(dp_backend_get(DP_DEVICE_HOST, &host, NULL));
  dp_future_t *on_host = completed_with_tensor_on(host, (dp_device_t){DP_DEVICE_HOST, 0});
  dp_future_t *on_gpu = completed_with_tensor_on(B, G0);
  dp_future_t *orders[2][2] = {{on_host, on_gpu}, {on_gpu, on_host}};
  const char *foreign[2] = {"the value uses cuda:0 (first at $[1]), which is not among the future's devices",
                            "the value uses host:0 (first at $[1]), which is not among the future's devices"};
  for (int k = 0; k < 2; k++) {
    dp_future_t *all;
    dp_error_t e;
    OK(dp_future_collect_all(orders[k], 2, NULL, &all, NULL));
    cr_assert_eq(dp_future_wait(all, -1, &e), DP_EDEVICE, "order %d: %s: %s", k, dp_err_name(e.code), e.message);
    cr_assert(strstr(e.message, foreign[k]) == e.message, "order %d: %s", k, e.message);
    dp_future_release(all);
  }
  dp_future_release(on_host);
  dp_future_release(on_gpu);
}

static int gpu_future_consumer_reads(int wait) {
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, NULL));
  dp_stream_t *prod, *cons;
  OK(dp_stream_new(B, G0, &prod, NULL));
  OK(dp_stream_new(B, G0, &cons, NULL));
  OK(dp_set_current_stream(prod, NULL, NULL));
  dp_value_t t = cuda_ints(c, 1);
  int zero = 0, out = -1;
  OK(dp_memcpy_async(prod, tensor_base(t), &zero, sizeof zero, NULL));
  OK(dp_stream_synchronize(prod, NULL));
  cr_assert_eq(gpu_spin_write(dp_stream_native(prod), tensor_base(t), 7, 20.0), 0);
  dp_future_t *f;
  dp_future_opts_t o = {B, NULL, 0, NULL, 0, 0};
  OK(dp_future_new(&o, &f, NULL));
  OK(dp_future_mark_completed(f, dp_value_retain(t), NULL));
  OK(dp_set_current_stream(cons, NULL, NULL));
  if (wait) OK(dp_future_wait(f, -1, NULL));
  OK(dp_memcpy_async(cons, &out, tensor_base(t), sizeof out, NULL));
  OK(dp_stream_synchronize(cons, NULL));
  OK(dp_device_synchronize(B, G0, NULL));
  dp_reset_current_stream(B, G0);
  dp_cache_dealloc(c, tensor_base(t), NULL);
  dp_value_release(t);
  dp_future_release(f);
  dp_stream_free(prod);
  dp_stream_free(cons);
  return out;
}

Test(gpu, a_future_consumer_that_waits_sees_the_producers_kernel) {
  cr_assert_eq(gpu_future_consumer_reads(1), 7);
}

Test(gpu, negative_control_a_future_consumer_that_does_not_wait_reads_stale_data) {
  cr_assert_eq(gpu_future_consumer_reads(0), 0);
}

/* ---- native streams a framework owns (dp_stream_wrap) ---- */

static dp_stream_t *wrap(void *native) {
  dp_stream_t *w;
  OK(dp_stream_wrap(B, G0, native, &w, NULL));
  return w;
}

/* The framework writes 42 late on its own stream (the native handle); the
 * event recorded through the wrapper is what a consumer waits on. */
static int wrapped_consumer_sees(void *native, dp_stream_t *record_on, int with_wait) {
  dp_stream_t *c;
  OK(dp_stream_new(B, G0, &c, NULL));
  int *dev;
  OK(dp_device_alloc(B, G0, sizeof(int), (void **)&dev, NULL));
  int zero = 0, out = -1;
  OK(dp_memcpy_async(c, dev, &zero, sizeof zero, NULL));
  OK(dp_stream_synchronize(c, NULL));
  cr_assert_eq(gpu_spin_write(native, dev, 42, 20.0), 0);
  dp_event_t *ev;
  OK(dp_event_new(B, G0, &ev, NULL));
  OK(dp_event_record(ev, record_on, NULL));
  if (with_wait) OK(dp_stream_wait_event(c, ev, NULL));
  OK(dp_memcpy_async(c, &out, dev, sizeof out, NULL));
  OK(dp_stream_synchronize(c, NULL));
  OK(dp_device_synchronize(B, G0, NULL));
  dp_event_free(ev);
  OK(dp_device_dealloc(B, G0, dev, NULL));
  dp_stream_free(c);
  return out;
}

Test(gpu, a_wrapped_cuda_stream_is_cached_and_orders_with_the_frameworks_own_kernels) {
  void *native = gpu_stream_create();
  cr_assert_not_null(native);
  dp_stream_t *w = wrap(native);
  cr_assert_eq(wrap(native), w, "the same handle wraps to the same stream");
  cr_assert_eq(dp_stream_native(w), native);
  dp_stream_free(w);  /* the backend's: the native stream lives on */
  for (int i = 0; i < 3; i++) cr_assert_eq(wrapped_consumer_sees(native, w, 1), 42);
  OK(dp_stream_synchronize(w, NULL));
  cr_assert_eq(dp_stream_query(w, NULL), 1);
  gpu_stream_destroy(native);
}

Test(gpu, negative_control_without_the_wait_on_the_wrapped_streams_event_the_copy_is_stale) {
  void *native = gpu_stream_create();
  cr_assert_eq(wrapped_consumer_sees(native, wrap(native), 0), 0);
  gpu_stream_destroy(native);
}

/* cudaStream_t 0, PyTorch's current stream unless one is set: the legacy
 * default stream, not devpickle's default stream (a non-blocking stream of
 * its own, which does not order with it). */
Test(gpu, a_null_handle_wraps_the_legacy_default_stream_of_the_device) {
  dp_stream_t *w = wrap(NULL), *dflt;
  OK(dp_stream_default(B, G0, &dflt, NULL));
  cr_assert_neq(w, dflt);
  cr_assert_null(dp_stream_native(w), "the handle it was made from");
  cr_assert_eq(wrap(NULL), w);
  for (int i = 0; i < 3; i++) cr_assert_eq(wrapped_consumer_sees(NULL, w, 1), 42);
  dp_stream_t *legacy, *per_thread;
  OK(dp_stream_wrap(B, G0, (void *)1, &legacy, NULL));     /* cudaStreamLegacy */
  OK(dp_stream_wrap(B, G0, (void *)2, &per_thread, NULL)); /* cudaStreamPerThread */
  cr_assert_eq(dp_stream_native(legacy), (void *)1);
  cr_assert_eq(wrapped_consumer_sees(NULL, legacy, 1), 42, "cudaStreamLegacy is the same stream as 0");
  OK(dp_stream_synchronize(per_thread, NULL));
  cr_assert_eq(dp_stream_query(w, NULL), 1);
}

Test(gpu, negative_control_an_event_on_devpickles_own_default_stream_does_not_cover_the_legacy_stream) {
  dp_stream_t *dflt;
  OK(dp_stream_default(B, G0, &dflt, NULL));
  cr_assert_eq(wrapped_consumer_sees(NULL, dflt, 1), 0, "dp_stream_default is not cudaStream_t 0");
}

Test(gpu, wrapping_a_stream_of_another_device_is_einval) {
  if (dp_backend_device_count(B) < 2) cr_skip_test("one GPU: no other device to wrap a stream of");
  dp_device_t g1 = {DP_DEVICE_CUDA, 1};
  dp_stream_t *s1, *w = NULL;
  OK(dp_stream_new(B, g1, &s1, NULL));
  dp_error_t e;
  char want[128];
  cr_assert_eq(dp_stream_wrap(B, G0, dp_stream_native(s1), &w, &e), DP_EINVAL);
  snprintf(want, sizeof want, "dp_stream_wrap: %p is a stream of cuda:1, not cuda:0", dp_stream_native(s1));
  cr_assert_str_eq(e.message, want);
  cr_assert_null(w);
  dp_stream_t *w1;
  OK(dp_stream_wrap(B, g1, NULL, &w1, NULL));  /* the legacy stream of cuda:1, whatever device is current */
  int *dev;
  OK(dp_device_alloc(B, g1, sizeof(int), (void **)&dev, NULL));
  int v = 5, out = 0;
  OK(dp_memcpy_async(w1, dev, &v, sizeof v, NULL));
  OK(dp_memcpy_async(w1, &out, dev, sizeof out, NULL));
  OK(dp_stream_synchronize(w1, NULL));
  cr_assert_eq(out, 5);
  OK(dp_device_dealloc(B, g1, dev, NULL));
  dp_stream_free(s1);
}

/* The caching allocator on wrapped streams: blocks tied to the wrapper are
 * reused on it at once; a record on a wrapped user stream holds the block
 * while the framework's kernel there still reads it. */
Test(gpu, the_caching_allocator_treats_a_wrapped_stream_as_a_stream) {
  dp_cache_t *c;
  OK(dp_cache_new(B, &c, NULL));
  void *ns = gpu_stream_create(), *nu = gpu_stream_create();
  dp_stream_t *s = wrap(ns), *u = wrap(nu);
  int *ok;
  OK(dp_device_alloc(B, G0, sizeof(int), (void **)&ok, NULL));
  void *p, *q;
  OK(dp_cache_alloc(c, G0, 4096, s, &p, NULL));
  cr_assert_eq(gpu_fill(ns, p, 4096, 0xAA), 0);
  OK(dp_cache_dealloc(c, p, NULL));
  OK(dp_cache_alloc(c, G0, 4096, wrap(ns), &q, NULL));
  cr_assert_eq(q, p, "freed on the wrapper, reused by it");
  cr_assert_eq(gpu_fill(ns, q, 4096, 0xAA), 0);
  OK(dp_stream_synchronize(s, NULL));
  cr_assert_eq(gpu_spin_check(nu, q, 4096, 0xAA, 20.0, ok), 0);  /* the framework reads q late */
  OK(dp_cache_record_stream(c, q, u, NULL));
  OK(dp_cache_dealloc(c, q, NULL));
  void *r;
  OK(dp_cache_alloc(c, G0, 4096, s, &r, NULL));
  cr_assert_neq(r, q, "in use on the wrapped user stream: not handed out");
  cr_assert_eq(gpu_fill(ns, r, 4096, 0x55), 0);
  OK(dp_device_synchronize(B, G0, NULL));
  int host_ok = -1;
  OK(dp_memcpy_async(s, &host_ok, ok, sizeof host_ok, NULL));
  OK(dp_stream_synchronize(s, NULL));
  cr_assert_eq(host_ok, 1, "the framework's kernel read its data");
  dp_cache_stats_t st;
  OK(dp_cache_stats(c, G0, &st, NULL));
  cr_assert_eq(st.cross_stream, 0);
  OK(dp_cache_dealloc(c, r, NULL));
  OK(dp_device_dealloc(B, G0, ok, NULL));
  dp_cache_free(c);
  gpu_stream_destroy(ns);
  gpu_stream_destroy(nu);
}

/* The Python Future's path: producer and consumer are a framework's
 * streams, made current through their wrappers. */
static int wrapped_future_consumer_reads(int wait) {
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, NULL));
  void *np = gpu_stream_create(), *nc = gpu_stream_create();
  OK(dp_set_current_stream(wrap(np), NULL, NULL));
  dp_value_t t = cuda_ints(c, 1);
  int zero = 0, out = -1;
  OK(dp_memcpy_async(wrap(np), tensor_base(t), &zero, sizeof zero, NULL));
  OK(dp_stream_synchronize(wrap(np), NULL));
  cr_assert_eq(gpu_spin_write(np, tensor_base(t), 7, 20.0), 0);  /* the framework's kernel */
  dp_future_t *f;
  dp_future_opts_t o = {B, NULL, 0, NULL, 0, 0};
  OK(dp_future_new(&o, &f, NULL));
  OK(dp_future_mark_completed(f, dp_value_retain(t), NULL));
  OK(dp_set_current_stream(wrap(nc), NULL, NULL));
  if (wait) OK(dp_future_wait(f, -1, NULL));
  OK(dp_memcpy_async(wrap(nc), &out, tensor_base(t), sizeof out, NULL));
  OK(dp_stream_synchronize(wrap(nc), NULL));
  OK(dp_device_synchronize(B, G0, NULL));
  dp_reset_current_stream(B, G0);
  dp_cache_dealloc(c, tensor_base(t), NULL);
  dp_value_release(t);
  dp_future_release(f);
  gpu_stream_destroy(np);
  gpu_stream_destroy(nc);
  return out;
}

Test(gpu, a_future_between_wrapped_framework_streams_orders_the_consumer_after_the_kernel) {
  cr_assert_eq(wrapped_future_consumer_reads(1), 7);
}

Test(gpu, negative_control_a_consumer_on_a_wrapped_stream_that_does_not_wait_reads_stale_data) {
  cr_assert_eq(wrapped_future_consumer_reads(0), 0);
}

/* ---- the transport's staging path: two processes on one GPU ---- */

#define SEC 1000000000ll
#define STAGED_BYTES (((size_t)64 << 20) + 3) /* 17 chunks: more than the sender's slots */

static void ucx_env(void) {
  setenv("UCX_TLS", "tcp,posix,sysv,self", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  signal(SIGPIPE, SIG_IGN);
}

/* The receiver, forked before either process touches CUDA: receives one
 * value on cuda:0 and checks every byte is 0xab. Exit 0: the producer's
 * bytes; 20: stale bytes; 77: no GPU (its port is then -1). */
static void staged_receiver(int wfd) {
  alarm(120);
  ucx_env();
  dp_error_t e;
  dp_backend_t *b;
  int port = -1;
  if (dp_backend_get(DP_DEVICE_CUDA, &b, &e)) {
    if (write(wfd, &port, sizeof port) != sizeof port) _exit(91);
    _exit(77);
  }
  dp_transport_opts_t o = {0};
  o.backend = b;
  dp_transport_t *t;
  dp_listener_t *l;
  dp_endpoint_t *ep;
  dp_future_t *f;
  if (dp_transport_new(&o, &t, &e) || dp_listener_new(t, "127.0.0.1:0", &l, &e)) _exit(90);
  port = dp_listener_port(l);
  if (write(wfd, &port, sizeof port) != sizeof port) _exit(91);
  if (dp_listener_accept(l, 30 * SEC, &ep, &e)) _exit(92);
  if (dp_endpoint_recv(ep, &f, &e) || dp_future_wait(f, 60 * SEC, &e) || dp_future_synchronize(f, 60 * SEC, &e)) {
    fprintf(stderr, "staged receiver: %s\n", e.message);
    _exit(93);
  }
  dp_storage_t *st = dp_tensor_storage(dp_future_value(f));
  if (!st || dp_storage_device(st).type != DP_DEVICE_CUDA || dp_storage_nbytes(st) != STAGED_BYTES) _exit(94);
  unsigned char *host = malloc(STAGED_BYTES);
  dp_stream_t *s;
  if (!host || dp_stream_new(b, G0, &s, &e) ||
      dp_memcpy_async(s, host, dp_storage_base(st), STAGED_BYTES, &e) || dp_stream_synchronize(s, &e))
    _exit(95);
  int rc = 0;
  for (size_t i = 0; i < STAGED_BYTES; i++)
    if (host[i] != 0xab) rc = 20;
  /* stay until the sender closes (its close ends this receive) */
  dp_future_t *bye;
  if (dp_endpoint_recv(ep, &bye, &e) == 0) {
    dp_future_wait(bye, 30 * SEC, NULL);
    dp_future_release(bye);
  }
  free(host);
  dp_stream_free(s);
  dp_future_release(f);
  dp_endpoint_free(ep);
  dp_listener_free(l);
  dp_transport_free(t);
  dp_shutdown();
  _exit(rc);
}

/* Sends a cuda:0 buffer that a kernel fills after spinning 200 ms on a
 * stream of the sender's: as a future completed on that stream
 * (as_future), or as a value sent with that stream current. skip: the
 * transport does not wait for the events (the negative control). Returns
 * the receiver's verdict. */
static int staged_send(int as_future, int skip) {
  ucx_env();
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    close(fds[0]);
    staged_receiver(fds[1]);
  }
  close(fds[1]);
  int port;
  cr_assert_eq(read(fds[0], &port, sizeof port), (ssize_t)sizeof port, "the receiver did not start");
  close(fds[0]);
  if (port < 0) {
    waitpid(pid, NULL, 0);
    cr_skip_test("no usable CUDA device");
  }
  dp_error_t e;
  OK(dp_backend_get(DP_DEVICE_CUDA, &B, &e));
  dp_transport_opts_t o = {0};
  o.backend = B;
  dp_transport_t *t;
  dp_endpoint_t *ep;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  OK(dp_transport_new(&o, &t, &e));
  OK(dp_endpoint_connect(t, addr, &ep, &e));
  dp_stream_t *s;
  OK(dp_stream_new(B, G0, &s, &e));
  void *mem;
  OK(dp_device_alloc(B, G0, STAGED_BYTES, &mem, &e));
  cr_assert_eq(gpu_spin_fill(dp_stream_native(s), mem, STAGED_BYTES, 0, 0.0), 0);
  OK(dp_stream_synchronize(s, &e));
  cr_assert_eq(gpu_spin_fill(dp_stream_native(s), mem, STAGED_BYTES, 0xab, 200.0), 0);
  dp_storage_t *st;
  dp_value_t v;
  int64_t shape[1] = {(int64_t)STAGED_BYTES};
  OK(dp_storage_new(G0, mem, STAGED_BYTES, NULL, NULL, &st, &e));
  OK(dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &v, &e));
  dp__transport_skip_events = skip;
  OK(dp_set_current_stream(s, NULL, &e));
  dp_future_t *d, *f = NULL;
  if (as_future) {
    dp_future_opts_t fo = {0};
    fo.backend = B;
    fo.no_hooks = 1;
    OK(dp_future_new(&fo, &f, &e));
    OK(dp_future_mark_completed(f, dp_value_retain(v), &e)); /* its event follows the kernel */
    OK(dp_endpoint_send_future(ep, f, &d, &e));
  } else {
    OK(dp_endpoint_send(ep, v, &d, &e)); /* the copies follow the kernel on s */
  }
  dp_reset_current_stream(B, G0);
  dp_error_clear(&e);
  cr_assert_eq(dp_future_wait(d, 60 * SEC, &e), 0, "%s", e.message);
  OK(dp_stream_synchronize(s, &e));
  dp_future_release(d);
  dp_future_release(f);
  dp_value_release(v);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  dp_device_dealloc(B, G0, mem, NULL);
  dp_stream_free(s);
  int status;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TestSuite(gpu_transport, .fini = teardown);

Test(gpu_transport, a_staged_future_of_a_cuda_buffer_arrives_with_the_kernels_bytes_on_the_other_process) {
  cr_assert_eq(staged_send(1, 0), 0, "the receiver saw bytes from before the kernel");
}

Test(gpu_transport, negative_control_a_staged_future_sent_without_its_events_carries_stale_bytes) {
  cr_assert_eq(staged_send(1, 1), 20, "skipping the events went unnoticed: the test is blind");
}

Test(gpu_transport, a_staged_cuda_value_is_copied_after_the_senders_current_stream) {
  cr_assert_eq(staged_send(0, 0), 0, "the receiver saw bytes from before the kernel");
}

Test(gpu_transport, negative_control_staging_copies_that_skip_the_senders_stream_carry_stale_bytes) {
  cr_assert_eq(staged_send(0, 1), 20, "skipping the wait went unnoticed: the test is blind");
}

/* ---- dp_device_read: an inline pickle of device memory, through the backend ---- */

/* A kernel on stream `kernel_on` spins 20 ms, then fills 4096 bytes of a
 * cuda tensor with 0xAB; an inline pickle on this thread, whose current
 * stream is `current`, reads the tensor with dp_device_read. 1 when the
 * frame carries the kernel's bytes. */
static int inline_frame_sees_the_kernel(int same_stream) {
  dp_stream_t *cur, *other;
  OK(dp_stream_new(B, G0, &cur, NULL));
  OK(dp_stream_new(B, G0, &other, NULL));
  OK(dp_set_current_stream(cur, NULL, NULL));
  enum { N = 4096 };
  void *p;
  OK(dp_device_alloc(B, G0, N, &p, NULL));
  static unsigned char zeros[N], want[N];
  memset(want, 0xAB, N);
  OK(dp_memcpy_async(cur, p, zeros, N, NULL));
  OK(dp_stream_synchronize(cur, NULL));
  cr_assert_eq(gpu_spin_fill(dp_stream_native(same_stream ? cur : other), p, N, 0xAB, 20.0), 0);
  dp_storage_t *st;
  OK(dp_storage_new(G0, p, N, NULL, NULL, &st, NULL));
  int64_t shape[1] = {N};
  dp_value_t t;
  OK(dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &t, NULL));
  dp_frame_t *f;
  OK(dp_frame_new(&f, NULL));
  OK(dp_pickle(t, &(dp_pickle_opts_t){.flags = DP_PICKLE_INLINE, .read = dp_device_read}, f, NULL));
  size_t n;
  const unsigned char *bytes = dp_frame_data(f, &n);
  int found = 0;
  for (size_t i = 0; i + N <= n && !found; i++) found = bytes[i] == 0xAB && !memcmp(bytes + i, want, N);
  OK(dp_stream_synchronize(other, NULL));
  dp_frame_free(f);
  dp_value_release(t);
  dp_reset_current_stream(B, G0);
  OK(dp_device_dealloc(B, G0, p, NULL));
  dp_stream_free(cur);
  dp_stream_free(other);
  return found;
}

Test(gpu, an_inline_pickle_with_dp_device_read_carries_what_the_current_streams_kernel_wrote) {
  for (int i = 0; i < 3; i++) cr_assert(inline_frame_sees_the_kernel(1), "round %d", i);
}

Test(gpu, negative_control_dp_device_read_does_not_wait_for_a_kernel_on_another_stream) {
  cr_assert(!inline_frame_sees_the_kernel(0), "the read on the current stream overtakes the other stream's kernel");
}
