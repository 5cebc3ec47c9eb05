/* The future on the host backend: discovery at completion, events per
 * device, waits, then() chains (the defining case), collect_all, errors, and
 * memory held from reuse — with negative controls for every race. */
#define _GNU_SOURCE /* syscall() */
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "../cache/internal.h" /* dp__cache_check */
#include "../future/internal.h" /* dp__future_sleeps */

static dp_backend_t *B;
#define H0 t_dev(DP_DEVICE_HOST, 0)
#define H1 t_dev(DP_DEVICE_HOST, 1)

static void setup(void) {
  unsetenv("DEVPICKLE_BACKEND");
  unsetenv("DEVPICKLE_HOST_DEVICES");
  t_track();
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
}
static void teardown(void) {
  /* whatever the futures recorded and freed, the default cache's books agree */
  dp_backend_t *b;
  dp_cache_t *c;
  const char *bad = dp_backend_get(DP_DEVICE_HOST, &b, NULL) == 0 && dp_cache_default(b, &c, NULL) == 0
                        ? dp__cache_check(c)
                        : NULL;
  if (bad) cr_assert_fail("the default cache's books disagree: %s", bad);
  dp_shutdown();
  dp_set_allocator(NULL, NULL);
}
TestSuite(future, .init = setup, .fini = teardown);


static dp_future_t *future(void) {
  dp_future_t *f;
  dp_future_opts_t o = {B, NULL, 0, NULL, 0, 0};
  OK(dp_future_new(&o, &f, T_ERR));
  return f;
}

/* A tensor over `n` ints of real host-device memory from the default cache,
 * allocated on this thread's current stream. */
static dp_value_t device_ints(dp_device_t d, int n) {
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, T_ERR));
  void *p;
  OK(dp_cache_alloc(c, d, (size_t)n * sizeof(int), NULL, &p, T_ERR));
  memset(p, 0, (size_t)n * sizeof(int));
  dp_storage_t *st;
  OK(dp_storage_new(d, p, (size_t)n * sizeof(int), NULL, NULL, &st, T_ERR));
  int64_t shape[1] = {n};
  dp_value_t t;
  OK(dp_tensor_new(st, DP_INT32, 1, shape, NULL, 0, &t, T_ERR));
  return t;
}

static int *data_of(dp_value_t t) { return dp_storage_base(dp_tensor_storage(t)); }

static void free_ints(dp_value_t t) {
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, T_ERR));
  OK(dp_cache_dealloc(c, data_of(t), T_ERR));
}

/* Holds a stream until *gate is set (NULL: no gate). A negative control
 * that needs one stream's work to run before another's opens the gate
 * once the first is done, instead of sleeping and hoping the other thread
 * got there in time: a loaded machine stalls a thread past any fixed
 * sleep. Bounded (10 s), so that a test that fails with a gate shut ends. */
static void hold_at(_Atomic int *gate) {
  for (int ms = 0; gate && ms < 10000 && !atomic_load(gate); ms++) sleep_ms(1);
}

/* slow device work: spin, then fill with a value */
typedef struct fill {
  int *p;
  int n, value, ms;
  _Atomic int *gate;
} fill_t;
static void slow_fill(void *arg) {
  fill_t *f = arg;
  hold_at(f->gate);
  sleep_ms(f->ms);
  for (int i = 0; i < f->n; i++) f->p[i] = f->value;
}
typedef struct read {
  const int *p;
  int n, ms;
  int first, all_same;
  _Atomic int *gate;
} read_t;
static void slow_read(void *arg) {
  read_t *r = arg;
  hold_at(r->gate);
  sleep_ms(r->ms);
  r->first = r->p[0];
  r->all_same = 1;
  for (int i = 1; i < r->n; i++) r->all_same &= r->p[i] == r->p[0];
}

/* ---- a custom type that holds a tensor and reduces to it ---- */
typedef struct box {
  dp_value_t t;
} box_t;
static int box_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  int rc = dp_tuple_new(1, state, err);
  return rc ? rc : dp_seq_set(*state, 0, dp_value_retain(((box_t *)obj)->t), err);
}
static void box_destroy(void *obj) {
  dp_value_release(((box_t *)obj)->t);
  free(obj);
}
static const dp_type_t box_type = {"Box", box_reduce, box_destroy};
static const dp_type_t opaque_type = {"Opaque", NULL, NULL};

static dp_value_t boxed(dp_value_t t) {
  box_t *b = malloc(sizeof *b);
  b->t = t;
  dp_value_t c;
  OK(dp_custom_new(&box_type, b, &c, T_ERR));
  return c;
}

Test(future, completion_discovers_the_allocations_of_user_objects_and_records_one_event_per_device) {
  dp_value_t o = t_obj("Batch");
  dp_value_t a = device_ints(H0, 16), b = device_ints(H0, 16), c = device_ints(H1, 16);
  OK(dp_object_set(o, "a", dp_value_retain(a), T_ERR));
  OK(dp_object_set(o, "box", boxed(dp_value_retain(b)), T_ERR));
  OK(dp_object_set(o, "other", dp_value_retain(c), T_ERR));
  OK(dp_object_set(o, "cpu", t_tensor(t_dev(DP_DEVICE_CPU, 0), 0x1000, 4), T_ERR));
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, o, T_ERR));
  cr_assert_eq(dp_future_nptrs(f), 4, "cpu storages are listed too");
  cr_assert_eq(dp_future_ndevices(f), 2, "one event per device with streams; cpu has none");
  cr_assert(dp_device_equal(dp_future_device(f, 0), H0));
  cr_assert(dp_device_equal(dp_future_device(f, 1), H1));
  dp_ptr_info_t p;
  OK(dp_future_ptr(f, 1, &p, T_ERR));
  cr_assert_eq(p.base, (void *)data_of(b), "the tensor inside the custom was found");
  cr_assert_not_null(dp_future_event(f, 0));
  cr_assert_eq(dp_value_id(dp_future_value(f)), dp_value_id(o));
  OK(dp_future_wait(f, -1, T_ERR));
  free_ints(a);
  free_ints(b);
  free_ints(c);
  dp_value_release(a);
  dp_value_release(b);
  dp_value_release(c);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, introspecting_a_pending_failed_or_null_future_reports_why) {
  dp_future_t *f = future(), *g = future();
  dp_ptr_info_t p;
  dp_error_t e;
  cr_assert_eq(dp_future_ptr(f, 0, &p, &e), DP_ESTATE);
  cr_assert_str_eq(e.message, "dp_future_ptr: the future is pending");
  dp_error_t why;
  dp_error_clear(&why);
  why.code = DP_EDEVICE;
  OK(dp_future_set_error(g, &why, T_ERR));
  cr_assert_eq(dp_future_ptr(g, 0, &p, &e), DP_ESTATE);
  cr_assert_str_eq(e.message, "dp_future_ptr: the future failed");
  cr_assert_eq(dp_future_nptrs(g), 0);
  cr_assert_eq(dp_future_ptr(NULL, 0, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_ptr: NULL future");
  OK(dp_future_mark_completed(f, t_tensor(t_dev(DP_DEVICE_CPU, 0), 0x1000, 4), T_ERR));
  cr_assert_eq(dp_future_ptr(f, 1, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_ptr: index 1 out of range (the value holds 1 allocation)");
  OK(dp_future_ptr(f, 0, &p, T_ERR));
  cr_assert_eq(p.base, (void *)0x1000);
  cr_assert_eq(dp_future_ptr(f, 0, NULL, &e), DP_EINVAL);
  dp_future_release(f);
  dp_future_release(g);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A completion lists what its walk meets without looking it up (the
 * record feeds stream records and events, where twice is once): the
 * introspection lists each allocation once all the same. */
static void *count_ptrs(void *f) { return (void *)(uintptr_t)dp_future_nptrs(f); }

Test(future, an_allocation_met_apart_more_than_once_is_listed_once_with_its_tensors_counted_and_its_largest_size) {
  const dp_device_t cpu = t_dev(DP_DEVICE_CPU, 0);
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(cpu, 0x1000, 4), T_ERR));  /* 16 bytes */
  OK(dp_list_append(l, t_tensor(cpu, 0x2000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(cpu, 0x1000, 16), T_ERR)); /* another storage, the same base: 64 bytes */
  OK(dp_list_append(l, t_tensor(cpu, 0x3000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(cpu, 0x2000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(cpu, 0x1000, 2), T_ERR));
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, l, T_ERR));
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, count_ptrs, f); /* the first asks race to make the list */
  for (int i = 0; i < 4; i++) {
    void *n;
    pthread_join(th[i], &n);
    cr_assert_eq((uintptr_t)n, 3, "thread %d counted %zu allocations", i, (size_t)(uintptr_t)n);
  }
  cr_assert_eq(dp_future_nptrs(f), 3);
  const uintptr_t base[3] = {0x1000, 0x2000, 0x3000};
  const uint32_t refs[3] = {3, 2, 1};
  const size_t nbytes[3] = {64, 16, 16};
  for (size_t i = 0; i < 3; i++) {
    dp_ptr_info_t p;
    OK(dp_future_ptr(f, i, &p, T_ERR));
    cr_assert_eq(p.base, (void *)base[i], "allocation %zu in the order first met", i);
    cr_assert_eq(p.refs, refs[i], "allocation %zu: %u tensors, not %u", i, refs[i], p.refs);
    cr_assert_eq(p.nbytes, nbytes[i], "allocation %zu: the largest size met, %zu, not %zu", i, nbytes[i], p.nbytes);
  }
  dp_ptr_info_t p;
  dp_error_t e;
  cr_assert_eq(dp_future_ptr(f, 3, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_ptr: index 3 out of range (the value holds 3 allocations)");
  /* an aggregate sums each input's tensors on an allocation, once each */
  dp_future_t *g = future(), *all;
  OK(dp_future_mark_completed(g, t_tensor(cpu, 0x1000, 4), T_ERR));
  dp_future_t *in[3] = {f, g, f};
  OK(dp_future_collect_all(in, 3, NULL, &all, T_ERR));
  OK(dp_future_wait(all, -1, T_ERR));
  cr_assert_eq(dp_future_nptrs(all), 3);
  OK(dp_future_ptr(all, 0, &p, T_ERR));
  cr_assert_eq(p.base, (void *)0x1000);
  cr_assert_eq(p.refs, 4, "3 in f (counted once), 1 in g: %u", p.refs);
  dp_future_release(all);
  dp_future_release(g);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* The list of distinct allocations is made at the first ask: each of its
 * allocations failing is DP_ENOMEM with a message (and a count of 0), and
 * the next ask, with memory, makes it whole. */
typedef struct listed {
  dp_future_t *f;
} listed_t;

static void listed_prepare(void *ctx) {
  listed_t *c = ctx;
  const dp_device_t cpu = t_dev(DP_DEVICE_CPU, 0);
  dp_value_t l = t_list();
  for (uintptr_t k = 0; k < 40; k++) /* 20 allocations, each met twice apart */
    OK(dp_list_append(l, t_tensor(cpu, 0x1000 * (1 + k % 20), 4), T_ERR));
  c->f = future();
  OK(dp_future_mark_completed(c->f, l, T_ERR));
}

static int listed_run(void *ctx, dp_error_t *err) {
  listed_t *c = ctx;
  dp_ptr_info_t p;
  return dp_future_ptr(c->f, 19, &p, err);
}

static void listed_check(void *ctx, int rc, long k) {
  listed_t *c = ctx;
  (void)rc;
  cr_assert_eq(dp_future_nptrs(c->f), 20, "allocation %ld failed: the next ask lists all 20", k);
  dp_ptr_info_t p;
  OK(dp_future_ptr(c->f, 19, &p, T_ERR));
  cr_assert(p.base == (void *)0x14000 && p.refs == 2, "allocation %ld failed: %p, %u refs", k, p.base, p.refs);
  dp_future_release(c->f);
}

Test(future, the_first_listing_of_the_allocations_that_runs_out_of_memory_fails_and_the_next_lists_them_all) {
  listed_t c;
  const t_sweep_t sw = {listed_prepare, listed_run, listed_check};
  cr_assert_gt(t_sweep(&sw, &c), 0, "listing allocates");
  listed_prepare(&c); /* a count without memory for the list is 0, and says nothing more */
  t_fail_at = atomic_load(&t_alloc_count) + 1;
  cr_assert_eq(dp_future_nptrs(c.f), 0);
  t_fail_at = 0;
  cr_assert_eq(dp_future_nptrs(c.f), 20);
  dp_future_release(c.f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* Producer: fills a tensor slowly on its stream and completes the future.
 * Consumer: on another stream, reads it — after waiting on the future (or
 * on a collect_all over it: collect), or (negative control) not. */
static int consumer_reads_through(int wait, int collect) {
  dp_stream_t *prod, *cons;
  OK(dp_stream_new(B, H0, &prod, T_ERR));
  OK(dp_stream_new(B, H0, &cons, T_ERR));
  OK(dp_set_current_stream(prod, NULL, T_ERR));
  dp_value_t t = device_ints(H0, 64);
  _Atomic int open = wait; /* without the wait, the fill is held until the read is done */
  fill_t fill = {data_of(t), 64, 7, 60, &open};
  OK(dp_host_launch(prod, slow_fill, &fill, T_ERR));
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR));
  dp_future_t *all = NULL;
  if (collect) OK(dp_future_collect_all(&f, 1, NULL, &all, T_ERR));
  OK(dp_set_current_stream(cons, NULL, T_ERR));
  if (wait) OK(dp_future_wait(collect ? all : f, -1, T_ERR));
  read_t r = {data_of(dp_future_value(f).kind == DP_TENSOR ? dp_future_value(f) : t), 64, 0, -1, 0, NULL};
  OK(dp_host_launch(cons, slow_read, &r, T_ERR));
  OK(dp_stream_synchronize(cons, T_ERR));
  atomic_store(&open, 1);
  OK(dp_stream_synchronize(prod, T_ERR));
  dp_reset_current_stream(B, H0);
  free_ints(t);
  dp_value_release(t);
  dp_future_release(f);
  dp_future_release(all);
  dp_stream_free(prod);
  dp_stream_free(cons);
  return r.first;
}

Test(future, a_consumer_that_waits_sees_the_producers_data) {
  cr_assert_eq(consumer_reads_through(1, 0), 7);
}

Test(future, negative_control_a_consumer_that_does_not_wait_sees_stale_data) {
  cr_assert_eq(consumer_reads_through(0, 0), 0);
}

/* collect_all's event on a device joins its inputs' events there. */
Test(future, a_consumer_that_waits_on_a_collect_all_sees_its_inputs_producers_data) {
  cr_assert_eq(consumer_reads_through(1, 1), 7);
}

Test(future, negative_control_a_consumer_that_does_not_wait_on_the_collect_all_sees_stale_data) {
  cr_assert_eq(consumer_reads_through(0, 1), 0);
}

/* ---- the defining case ---- */

typedef struct cb_state {
  _Atomic int calls;
  _Atomic int open; /* the callback's fill is held until it opens */
  fill_t fill;
  dp_value_t made;
  int report;  /* launch_and_report: report the allocation */
} cb_state_t;

/* Launches new device work on the callback's (pool) stream and returns its
 * result inside a user-defined object. */
static int launch_and_wrap(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  cb_state_t *s = ud;
  atomic_fetch_add(&s->calls, 1);
  (void)parent;
  dp_value_t out = device_ints(H0, 64);  /* allocated on the current (pool) stream */
  s->fill = (fill_t){data_of(out), 64, 99, 60, &s->open};
  dp_stream_t *cur;
  int rc = dp_current_stream(B, H0, &cur, err);
  if (rc == 0) rc = dp_host_launch(cur, slow_fill, &s->fill, err);
  if (rc) return rc;
  s->made = dp_value_retain(out);
  dp_value_t obj;
  if ((rc = dp_object_new("Result", &obj, err)) != 0) return rc;
  *result = obj;
  return dp_object_set(obj, "payload", boxed(out), err);
}

/* As launch_and_wrap, for dp_future_then_with_ptrs: the result is a custom
 * that cannot be walked, and the callback reports the allocation itself
 * (or, for the negative control, reports nothing). */
static int launch_and_report(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  cb_state_t *s = ud;
  dp_value_t obj;
  int rc = launch_and_wrap(ud, parent, &obj, err);
  dp_value_release(obj);
  if (rc) return rc;
  if ((rc = dp_custom_new(&opaque_type, NULL, result, err)) != 0) return rc;
  return s->report ? dp_ptrset_add(ptrs, H0, data_of(s->made), 64 * sizeof(int), NULL, err) : 0;
}

enum { WAIT_PARENT, WAIT_CHILD, WAIT_REPORTED, WAIT_UNREPORTED };

static int child_consumer_reads(int how) {
  dp_stream_t *cons;
  OK(dp_stream_new(B, H0, &cons, T_ERR));
  dp_value_t t = device_ints(H0, 64);
  dp_future_t *parent = future(), *child;
  cb_state_t st = {0};
  /* the negative controls hold the callback's fill until the read is done */
  atomic_store(&st.open, how == WAIT_CHILD || how == WAIT_REPORTED);
  if (how == WAIT_REPORTED || how == WAIT_UNREPORTED) {
    st.report = how == WAIT_REPORTED;
    OK(dp_future_then_with_ptrs(parent, launch_and_report, &st, &child, T_ERR));
  } else {
    OK(dp_future_then(parent, launch_and_wrap, &st, &child, T_ERR));
  }
  OK(dp_future_mark_completed(parent, dp_value_retain(t), T_ERR));  /* runs the callback here */
  cr_assert_eq(atomic_load(&st.calls), 1);
  OK(dp_set_current_stream(cons, NULL, T_ERR));
  /* the negative control waits on the parent's events only: what a fallback
   * to the parent's events would give the child's consumers */
  OK(dp_future_wait(how == WAIT_PARENT ? parent : child, -1, T_ERR));
  read_t r = {data_of(st.made), 64, 0, -1, 0, NULL};
  OK(dp_host_launch(cons, slow_read, &r, T_ERR));
  OK(dp_stream_synchronize(cons, T_ERR));
  atomic_store(&st.open, 1);
  OK(dp_device_synchronize(B, H0, T_ERR));
  dp_reset_current_stream(B, H0);
  cr_assert_eq(dp_future_nptrs(child), how == WAIT_UNREPORTED ? 0 : 1,
               "the child walked the callback's result afresh, or took what it reported");
  free_ints(st.made);
  free_ints(t);
  dp_value_release(st.made);
  dp_value_release(t);
  dp_future_release(parent);
  dp_future_release(child);
  dp_stream_free(cons);
  return r.first;
}

Test(future, the_consumer_of_a_then_child_sees_the_callbacks_finished_device_work) {
  cr_assert_eq(child_consumer_reads(WAIT_CHILD), 99);
}

Test(future, negative_control_the_parents_events_do_not_cover_the_callbacks_work) {
  cr_assert_eq(child_consumer_reads(WAIT_PARENT), 0);
}

Test(future, a_then_child_with_reported_pointers_covers_the_callbacks_work_without_a_walk) {
  cr_assert_eq(child_consumer_reads(WAIT_REPORTED), 99);
}

Test(future, negative_control_a_then_child_whose_callback_reports_nothing_covers_nothing) {
  cr_assert_eq(child_consumer_reads(WAIT_UNREPORTED), 0);
}

static int sees_failure(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)ptrs;
  dp_error_t pe;
  int code = dp_future_error(parent, &pe);
  *(int *)ud = code;
  dp_stream_t *cur;
  if (dp_current_stream(B, H0, &cur, err)) return DP_ESTATE;
  if (code) {
    *err = pe;
    return code;
  }
  *result = dp_int(7);
  return 0;
}

Test(future, a_then_with_pointers_callback_runs_also_when_the_parent_failed) {
  dp_future_t *parent = future(), *child, *ok_parent = future(), *ok_child;
  int seen = 1, ok_seen = 1;
  OK(dp_future_then_with_ptrs(parent, sees_failure, &seen, &child, T_ERR));
  OK(dp_future_then_with_ptrs(ok_parent, sees_failure, &ok_seen, &ok_child, T_ERR));
  dp_error_t boom;
  dp_error_clear(&boom);
  boom.code = DP_EIO;
  snprintf(boom.message, sizeof boom.message, "boom");
  OK(dp_future_set_error(parent, &boom, T_ERR));
  OK(dp_future_mark_completed(ok_parent, dp_int(1), T_ERR));
  cr_assert_eq(seen, DP_EIO, "the callback ran and saw the parent's error");
  cr_assert_eq(ok_seen, 0);
  dp_error_t e;
  cr_assert_eq(dp_future_wait(child, -1, &e), DP_EIO);
  cr_assert_str_eq(e.message, "boom");
  OK(dp_future_wait(ok_child, -1, T_ERR));
  cr_assert_eq(dp_value_as_int(dp_future_value(ok_child)), 7);
  dp_error_t bad;
  cr_assert_eq(dp_future_then_with_ptrs(parent, NULL, NULL, &child, &bad), DP_EINVAL);
  cr_assert_str_eq(bad.message, "dp_future_then_with_ptrs: NULL cb");
  dp_future_release(parent);
  dp_future_release(child);
  dp_future_release(ok_parent);
  dp_future_release(ok_child);
}

static int bad_result(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  (void)parent;
  dp_value_t l;
  int rc = dp_list_new(1, &l, err);
  if (rc) return rc;
  *result = l;
  dp_value_t c;
  if ((rc = dp_custom_new(&opaque_type, NULL, &c, err)) != 0) return rc;
  return dp_list_append(l, c, err);
}

Test(future, a_child_whose_result_cannot_be_walked_fails_loudly_never_falls_back) {
  dp_future_t *parent = future(), *child;
  OK(dp_future_then(parent, bad_result, NULL, &child, T_ERR));
  OK(dp_future_mark_completed(parent, device_ints(H0, 4), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(child, -1, &e), DP_ETYPE);
  cr_assert_str_eq(e.message, "cannot walk a value of type 'Opaque' at $[0]: its type has no reduce");
  cr_assert_eq(dp_future_ndevices(child), 0, "no events borrowed from the parent");
  free_ints(dp_future_value(parent));
  dp_future_release(parent);
  dp_future_release(child);
}

static int positive_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  return 7;
}

/* The order of one future's callbacks, with one registered on it (already
 * complete) from inside its first: that one runs as its registrar returns,
 * before the callbacks registered earlier that are still to run. */
static char cb_order[8];
static size_t cb_norder;
static dp_future_t *cb_later_child;

static int note_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  cb_order[cb_norder++] = *(const char *)ud;
  return 0;
}

static int chain_inside_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)result;
  cb_order[cb_norder++] = 'a';
  int rc = dp_future_then(parent, note_cb, "c", &cb_later_child, err);
  cr_assert_eq(cb_norder, 1, "the callback chained on its complete parent did not run inside the callback");
  return rc;
}

Test(future, a_callback_chained_on_its_complete_parent_from_inside_one_of_its_callbacks_runs_next) {
  dp_future_t *f = future(), *ca, *cb;
  cb_norder = 0;
  OK(dp_future_then(f, chain_inside_cb, NULL, &ca, T_ERR));
  OK(dp_future_then(f, note_cb, "b", &cb, T_ERR));
  OK(dp_future_mark_completed(f, dp_none(), T_ERR));
  cr_assert_eq(cb_norder, 3);
  cr_assert_arr_eq(cb_order, "acb", 3, "future.h: the one registered inside 'a' runs as 'a' returns, before 'b'");
  OK(dp_future_wait(cb_later_child, -1, T_ERR));
  dp_future_release(cb_later_child);
  dp_future_release(ca);
  dp_future_release(cb);
  dp_future_release(f);
}

static int unknown_code_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result;
  snprintf(err->message, sizeof err->message, "%s", "errno-style failure");
  return -42; /* no DP_E* code: -42 is none of base.h's */
}

/* A code that is no DP_E* — positive (a caller testing rc < 0 would take
 * it for success), or negative past the last (no caller could name it) —
 * fails the child with DP_EINVAL, saying what the callback returned. */
Test(future, a_callback_that_returns_no_dp_e_code_fails_its_child_with_einval) {
  const struct {
    dp_then_cb fn;
    const char *want;
  } cases[] = {
      {positive_cb, "the callback returned 7: a callback returns 0 or a negative DP_E* code"},
      {unknown_code_cb, "the callback returned -42: a callback returns 0 or a negative DP_E* code"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    dp_future_t *parent = future(), *child;
    OK(dp_future_then(parent, cases[i].fn, NULL, &child, T_ERR));
    OK(dp_future_mark_completed(parent, dp_none(), T_ERR));
    dp_error_t e;
    cr_assert_eq(dp_future_wait(child, -1, &e), DP_EINVAL);
    cr_assert_str_eq(e.message, cases[i].want);
    cr_assert_str_eq(dp_err_name(dp_future_error(child, NULL)), "DP_EINVAL");
    dp_future_release(parent);
    dp_future_release(child);
  }
}

/* A hook that fails without a message: the future fails with the hook's
 * code (not DP_ESTATE, which a failure with code 0 became), and
 * mark_completed returns that same code. */
static int silent_failing_hook(void *ctx, void *const *p, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)p, (void)n, (void)s, (void)err;
  return DP_EIO;
}

Test(future, a_hook_that_fails_without_a_message_fails_the_future_with_its_code) {
  dp_cache_hooks_t hooks = {NULL, NULL, silent_failing_hook, NULL};
  dp_future_opts_t o = {B, NULL, 0, &hooks, 0, 0};
  dp_future_t *f;
  OK(dp_future_new(&o, &f, T_ERR));
  dp_value_t t = device_ints(H0, 4);
  void *p = data_of(t);
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, t, &e), DP_EIO);
  cr_assert_str_eq(e.message, "the record_streams hook failed: i/o error");
  cr_assert_eq(dp_future_wait(f, 0, &e), DP_EIO);
  cr_assert_str_eq(e.message, "the record_streams hook failed: i/o error");
  dp_future_release(f);
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, T_ERR));
  OK(dp_cache_dealloc(c, p, T_ERR));
}

/* An error record filled by hand, its message without a NUL: the future
 * kept it as it came, and every waiter's copy ran past its end. */
Test(future, an_error_message_without_a_nul_reaches_waiters_terminated) {
  dp_future_t *f = future();
  dp_error_t bad;
  memset(&bad, 'A', sizeof bad);
  bad.code = DP_EIO;
  OK(dp_future_set_error(f, &bad, T_ERR));
  dp_error_t e;
  memset(&e, 'B', sizeof e);
  cr_assert_eq(dp_future_wait(f, 0, &e), DP_EIO);
  cr_assert_eq(strnlen(e.message, sizeof e.message), sizeof e.message - 1);
  dp_future_release(f);
}

/* Callbacks that fill err->message by hand without a NUL (strncpy of a
 * long message): a hook's came back in the completing caller's err (and a
 * waiter's) as it was, and a reduce()'s was quoted with %s into the
 * walk's message, reading past its record (ASan: stack-buffer-overflow).
 * Each message is ended at its last byte where the callback returns. */
static int fill_hook(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)ptr, (void)s;
  memset(err->message, 'x', sizeof err->message);
  return DP_EIO;
}
static int fill_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  (void)obj, (void)state;
  memset(err->message, 'y', sizeof err->message);
  return DP_EIO;
}
static const dp_type_t filler_type = {"Filler", fill_reduce, NULL};

static void assert_ends_within(const dp_error_t *e, char last) {
  const char *nul = memchr(e->message, '\0', sizeof e->message);
  cr_assert_not_null(nul, "the message ends within its record");
  cr_assert_gt(nul - e->message, 3);
  cr_assert_eq(nul[-1], last, "the message ends with what the callback wrote, not with what lay past it");
}

Test(future, callback_messages_that_fill_the_record_without_a_nul_come_back_ended) {
  dp_cache_hooks_t h = {NULL, fill_hook, NULL, NULL};
  dp_future_opts_t o = {B, NULL, 0, &h, 0, 0};
  dp_future_t *f;
  OK(dp_future_new(&o, &f, T_ERR));
  dp_error_t e;
  memset(&e, 'B', sizeof e);
  cr_assert_eq(dp_future_mark_completed(f, t_tensor(H0, 0x1000, 4), &e), DP_EIO);
  assert_ends_within(&e, 'x');
  memset(&e, 'B', sizeof e);
  cr_assert_eq(dp_future_wait(f, 0, &e), DP_EIO);
  assert_ends_within(&e, 'x');
  dp_future_release(f);
  memset(&e, 'B', sizeof e);
  void *ptr = (void *)0x1000;
  cr_assert_eq(dp_cache_hooks_record(&h, &ptr, 1, NULL, &e), DP_EIO);
  assert_ends_within(&e, 'x');

  f = future();
  dp_value_t v;
  OK(dp_custom_new(&filler_type, NULL, &v, T_ERR));
  memset(&e, 'B', sizeof e);
  cr_assert_eq(dp_future_mark_completed(f, v, &e), DP_ETYPE);
  cr_assert_eq(strncmp(e.message, "reduce of type 'Filler' failed at $: yyy", 40), 0, "%.60s", e.message);
  assert_ends_within(&e, 'y');
  dp_future_release(f);
}

/* ---- errors ---- */

typedef struct waiter {
  dp_future_t *f;
  int rc;
  dp_error_t err;
} waiter_t;
static void *wait_thread(void *p) {
  waiter_t *w = p;
  w->rc = dp_future_wait(w->f, -1, &w->err);
  return NULL;
}

Test(future, a_walk_failure_completes_the_future_and_wakes_waiters_with_the_path) {
  dp_future_t *f = future();
  waiter_t w = {f, 1, {0}};
  pthread_t th;
  pthread_create(&th, NULL, wait_thread, &w);
  sleep_ms(20);
  dp_value_t o = t_obj("Model"), c;
  OK(dp_custom_new(&opaque_type, NULL, &c, T_ERR));
  OK(dp_object_set(o, "handle", c, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, o, &e), DP_ETYPE);
  pthread_join(th, NULL);
  cr_assert_eq(w.rc, DP_ETYPE);
  cr_assert_str_eq(w.err.message, "cannot walk a value of type 'Opaque' at $.handle: its type has no reduce");
  cr_assert_eq(dp_future_error(f, &e), DP_ETYPE);
  cr_assert(dp_future_is_done(f));
  dp_future_release(f);
}

Test(future, a_device_outside_the_future_is_an_error_naming_both_lists) {
  dp_future_t *f;
  dp_device_t only0[1] = {H0};
  dp_future_opts_t o = {B, only0, 1, NULL, 0, 0};
  OK(dp_future_new(&o, &f, T_ERR));
  dp_value_t l = t_list(), a = device_ints(H0, 4), b = device_ints(H1, 4);
  OK(dp_list_append(l, dp_value_retain(a), T_ERR));
  OK(dp_list_append(l, dp_value_retain(b), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, l, &e), DP_EDEVICE);
  cr_assert_str_eq(e.message, "the value uses host:1 (first at $[1]), which is not among the future's devices "
                              "[host:0] (the value's devices: [host:0, host:1])");
  cr_assert_eq(dp_future_wait(f, -1, &e), DP_EDEVICE);
  free_ints(a);
  free_ints(b);
  dp_value_release(a);
  dp_value_release(b);
  dp_future_release(f);
}

Test(future, another_backends_memory_is_an_error_saying_whether_that_backend_is_there) {
  dp_future_t *f;
  dp_future_opts_t o = {B, NULL, 0, NULL, 0, 0}; /* the host backend, any of its devices */
  OK(dp_future_new(&o, &f, T_ERR));
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x7f0000001000, 16), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, l, &e), DP_EDEVICE);
  cr_assert(strstr(e.message, "the value uses cuda:0 (first at $[0]), which is not among the future's devices (none named: every "
                              "device of its host backend, [host:0, host:1]; the value's devices: [cuda:0])"),
            "%s", e.message);
  dp_backend_t *cuda;
  if (dp_backend_get(DP_DEVICE_CUDA, &cuda, NULL) != 0) /* this machine: no GPU */
    cr_assert(strstr(e.message, "; memory on cuda:0 cannot be tracked in this process: "), "%s", e.message);
  else
    cr_assert(strstr(e.message, "; the future is of the host backend: a future of the cuda backend tracks it"), "%s",
              e.message);
  dp_future_release(f);
}

Test(future, completing_twice_is_an_error_and_changes_nothing, .timeout = 30) {
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, dp_int(2), &e), DP_ESTATE);
  cr_assert_str_eq(e.message, "dp_future_mark_completed: the future is already complete");
  dp_error_t boom;
  dp_error_clear(&boom);
  boom.code = DP_EINVAL;
  cr_assert_eq(dp_future_set_error(f, &boom, &e), DP_ESTATE);
  cr_assert_str_eq(e.message, "dp_future_set_error: the future is already complete", "the message names the call");
  cr_assert_eq(dp_value_as_int(dp_future_value(f)), 1);
  OK(dp_future_error(f, T_ERR));
  /* the refusals leave f as it was, its lock too: it is waited on and chained on as ever */
  OK(dp_future_wait(f, -1, T_ERR));
  dp_future_t *c;
  cb_norder = 0;
  OK(dp_future_then(f, note_cb, "x", &c, T_ERR));
  cr_assert_eq(cb_norder, 1, "the callback ran at once");
  dp_future_release(c);
  dp_future_release(f);
}

static int failing_then_never_runs(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  cr_assert_fail("a failed parent's callback ran");
  return 0;
}

Test(future, an_error_code_that_is_no_dp_e_code_is_never_handed_back_as_it_was) {
  /* positive, zero, and negative but past the last DP_E* */
  int codes[] = {4, 0, DP_ECANCELED - 1, -1000}, want[] = {DP_EINVAL, DP_ESTATE, DP_EINVAL, DP_EINVAL};
  for (int i = 0; i < 4; i++) {
    dp_future_t *f = future(), *child;
    dp_error_t why, e;
    dp_error_clear(&why);
    why.code = codes[i];
    OK(dp_future_set_error(f, &why, T_ERR));
    cr_assert_eq(dp_future_wait(f, -1, &e), want[i]);
    cr_assert_eq(e.code, want[i]);
    char msg[96];
    snprintf(msg, sizeof msg, "the future failed: %s (completed with error code %d)", dp_strerror(want[i]), codes[i]);
    cr_assert_str_eq(e.message, msg);
    cr_assert_eq(dp_future_error(f, NULL), want[i]);
    OK(dp_future_then(f, failing_then_never_runs, NULL, &child, T_ERR));
    cr_assert_eq(dp_future_wait(child, -1, NULL), want[i], "the code travels down the chain as it was stored");
    dp_future_release(child);
    dp_future_release(f);
  }
}

Test(future, a_failed_completion_of_a_complete_future_returns_the_code_err_holds) {
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  dp_error_t e;
  int rc = dp_future_mark_completed_with_ptrs(f, dp_int(2), NULL, &e);
  cr_assert_eq(rc, DP_ESTATE);
  cr_assert_eq(e.code, rc);
  cr_assert_str_eq(e.message, "dp_future_mark_completed_with_ptrs: the future is already complete");
  cr_assert_eq(dp_value_as_int(dp_future_value(f)), 1);
  dp_future_release(f);
  f = future(); /* pending: the NULL ptrs is the error, and f fails with it */
  cr_assert_eq(dp_future_mark_completed_with_ptrs(f, dp_none(), NULL, &e), DP_EINVAL);
  cr_assert_eq(e.code, DP_EINVAL);
  cr_assert_eq(dp_future_wait(f, -1, NULL), DP_EINVAL);
  dp_future_release(f);
}

/* dp_future_set_error with a NULL error is a failed completion as a NULL
 * ptrs is: f fails with DP_EINVAL, so no waiter hangs (it stayed pending,
 * and a wait without a limit blocked for good). */
Test(future, a_null_error_given_to_set_error_fails_the_future_with_einval) {
  dp_future_t *f = future();
  dp_error_t e;
  cr_assert_eq(dp_future_set_error(f, NULL, &e), DP_EINVAL);
  cr_assert_eq(e.code, DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_set_error: NULL error");
  cr_assert_eq(dp_future_is_done(f), 1);
  cr_assert_eq(dp_future_wait(f, 0, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_set_error: NULL error");
  /* complete already: DP_ESTATE, and err says so; f is left as it was */
  cr_assert_eq(dp_future_set_error(f, NULL, &e), DP_ESTATE);
  cr_assert_eq(e.code, DP_ESTATE);
  cr_assert_str_eq(e.message, "dp_future_set_error: the future is already complete");
  cr_assert_eq(dp_future_error(f, NULL), DP_EINVAL);
  dp_future_release(f);
  cr_assert_eq(dp_future_set_error(NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_set_error: NULL future");
}

/* A callback that releases its parent's last reference and then waits (the
 * wait runs this thread's queued work, the parent's free among it): the
 * parent stays alive until its callbacks have run (ASan saw the free). */
static dp_future_t *never_done;
static int release_parent_then_wait(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)result, (void)err;
  dp_future_release(parent);
  cr_assert_eq(dp_future_wait(never_done, 0, NULL), DP_ETIMEDOUT);
  return 0;
}
static int copy_parent_value(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)err;
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

Test(future, a_callback_may_release_its_parent_and_wait_while_the_parents_other_callbacks_are_due) {
  dp_future_t *f = future(), *c1, *c2;
  never_done = future();
  OK(dp_future_then(f, release_parent_then_wait, NULL, &c1, T_ERR));
  OK(dp_future_then(f, copy_parent_value, NULL, &c2, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(7), T_ERR)); /* f's reference is the first callback's now */
  OK(dp_future_wait(c1, -1, T_ERR));
  OK(dp_future_wait(c2, -1, T_ERR));
  cr_assert_eq(dp_value_as_int(dp_future_value(c2)), 7);
  dp_future_release(c1);
  dp_future_release(c2);
  dp_future_release(never_done);
}

static void gate_spin(void *arg) {
  while (!atomic_load((_Atomic int *)arg)) sleep_ms(1);
}

static void *open_gate_later(void *arg) {
  sleep_ms(150);
  atomic_store((_Atomic int *)arg, 1);
  return NULL;
}

Test(future, synchronize_keeps_to_its_timeout_while_the_events_are_behind_other_work) {
  dp_stream_t *s;
  OK(dp_stream_new(B, H0, &s, T_ERR));
  _Atomic int gate = 0;
  OK(dp_set_current_stream(s, NULL, T_ERR));
  OK(dp_host_launch(s, gate_spin, &gate, T_ERR)); /* the producer's work, still running */
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, device_ints(H0, 4), T_ERR)); /* its event follows that work */
  dp_reset_current_stream(B, H0);
  dp_error_t e;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  cr_assert_eq(dp_future_synchronize(f, 20 * 1000000, &e), DP_ETIMEDOUT);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
  cr_assert(ms >= 19 && ms < 2000, "returned after %.1f ms", ms);
  cr_assert_str_eq(e.message, "dp_future_synchronize: the future's events did not complete within 20000000 ns");
  /* negative control: without a limit it waits for the work */
  pthread_t th;
  pthread_create(&th, NULL, open_gate_later, &gate);
  OK(dp_future_synchronize(f, -1, T_ERR));
  cr_assert_eq(atomic_load(&gate), 1, "synchronize returned before the events completed");
  pthread_join(th, NULL);
  OK(dp_future_synchronize(f, 0, T_ERR)); /* complete: a zero limit is enough */
  free_ints(dp_future_value(f));
  dp_future_release(f);
  dp_stream_free(s);
}

Test(future, a_failure_whose_detail_cannot_be_copied_keeps_its_code) {
  dp_future_t *f = future();
  dp_error_t boom, e;
  dp_error_clear(&boom);
  boom.code = DP_EIO;
  snprintf(boom.message, sizeof boom.message, "peer went away");
  t_fail_at = t_alloc_count + 1;  /* the copy of the error */
  OK(dp_future_set_error(f, &boom, T_ERR));
  t_fail_at = 0;
  cr_assert_eq(dp_future_wait(f, -1, &e), DP_EIO);
  cr_assert_str_eq(e.message, "i/o error (its detail was lost: out of memory)");
  cr_assert_eq(dp_future_error(f, NULL), DP_EIO);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

static int failing_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent;
  (void)result;
  atomic_fetch_add((_Atomic int *)ud, 1);
  snprintf(err->message, sizeof err->message, "the model diverged");
  err->code = DP_EINVAL;
  return DP_EINVAL;
}

static int counting_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent;
  (void)err;
  atomic_fetch_add((_Atomic int *)ud, 1);
  *result = dp_int(5);
  return 0;
}

Test(future, a_callback_error_propagates_down_the_chain) {
  _Atomic int failing = 0, later = 0;
  dp_future_t *f = future(), *c1, *c2;
  OK(dp_future_then(f, failing_cb, &failing, &c1, T_ERR));
  OK(dp_future_then(c1, counting_cb, &later, &c2, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(c2, -1, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "the model diverged");
  cr_assert_eq(atomic_load(&failing), 1);
  cr_assert_eq(atomic_load(&later), 0, "a failed parent's callback is not called");
  dp_future_release(f);
  dp_future_release(c1);
  dp_future_release(c2);
}

/* The wall clock, as this binary sees it, can be stepped: a timed wait must
 * measure its timeout on the monotonic clock, which nobody steps. */
static _Atomic long wall_clock_step_s;

int clock_gettime(clockid_t id, struct timespec *ts) {
  int rc = (int)syscall(SYS_clock_gettime, id, ts);
  if (rc == 0 && id == CLOCK_REALTIME) ts->tv_sec += atomic_load(&wall_clock_step_s);
  return rc;
}

Test(future, a_timed_wait_is_not_stretched_when_the_wall_clock_steps_forward, .timeout = 30) {
  dp_future_t *f = future();
  dp_error_t e;
  atomic_store(&wall_clock_step_s, 86400);  /* a day ahead: a wall-clock deadline would be a day away */
  int rc = dp_future_wait(f, 20 * 1000000, &e);
  atomic_store(&wall_clock_step_s, 0);
  cr_assert_eq(rc, DP_ETIMEDOUT);
  cr_assert_str_eq(e.message, "dp_future_wait: the future did not complete within 20000000 ns");
  dp_future_release(f);
}

Test(future, wait_times_out_on_a_pending_future) {
  dp_future_t *f = future();
  dp_error_t e;
  cr_assert_eq(dp_future_wait(f, 20 * 1000000, &e), DP_ETIMEDOUT);
  cr_assert_str_eq(e.message, "dp_future_wait: the future did not complete within 20000000 ns");
  cr_assert_not(dp_future_is_done(f));
  dp_future_release(f);
}

/* A poll with a limit of 0 (or one the spin already spent) must not sleep:
 * a sleep to a deadline already due still waits out the timer's slack,
 * 50 µs on Linux, at every look. The sleeps begun are counted; a wait
 * with a limit of 2 ms on a pending future, which must sleep, shows that
 * the count sees them. */
Test(future, a_wait_with_a_limit_of_0_or_1_ns_or_1_us_on_a_pending_future_returns_without_sleeping) {
  dp_future_t *f = future();
  const int64_t limits[] = {0, 1, 1000};
  uint64_t before = dp__future_sleeps;
  for (size_t k = 0; k < sizeof limits / sizeof *limits; k++)
    for (int i = 0; i < 50; i++) {
      dp_error_t e;
      cr_assert_eq(dp_future_wait(f, limits[k], &e), DP_ETIMEDOUT, "%s", e.message);
      cr_assert_eq(dp__future_sleeps, before, "a wait with a limit of %lld ns slept",
                   (long long)limits[k]);
    }
  dp_error_t e;
  cr_assert_eq(dp_future_wait(f, 2000000, &e), DP_ETIMEDOUT, "%s", e.message);
  cr_assert_gt(dp__future_sleeps, before, "a wait of 2 ms on a pending future did not sleep");
  cr_assert_not(dp_future_is_done(f));
  dp_future_release(f);
}

static int counts_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  ++*(int *)ud;
  return 0;
}

/* Completes a future with one then() callback whose reference count was
 * set to *(uint32_t *)arg just before (run by t_in_child). */
static void complete_at_count(void *arg) {
  dp_future_t *f = future(), *c;
  int ran = 0;
  if (dp_future_then(f, counts_cb, &ran, &c, NULL) != 0) _exit(3);
  dp__future_set_refs(f, *(uint32_t *)arg);
  if (dp_future_mark_completed(f, dp_none(), NULL) != 0) _exit(4);
  _exit(ran == 1 && dp_future_is_done(c) ? 0 : 5); /* the counts are past repair: nothing released */
}

static int complete_at_count_in_a_child(uint32_t refs, char *msg, size_t cap) {
  return t_in_child(complete_at_count, &refs, msg, cap);
}

/* Each callback to run holds a reference to its future while it is queued:
 * taken all at once, they wrapped a count at the bound to a small one, and
 * the future was freed under the callbacks still to run. */
Test(future, callbacks_queued_on_a_future_holding_the_most_references_abort_instead_of_wrapping_its_count) {
  char msg[512];
  cr_assert_eq(complete_at_count_in_a_child(UINT32_MAX - 1, msg, sizeof msg), 0, "one below the bound is counted");
  cr_assert_str_empty(msg);
  cr_assert_eq(complete_at_count_in_a_child(UINT32_MAX, msg, sizeof msg), SIGABRT);
  cr_assert_str_eq(msg, "devpickle: future retained while it held 4294967295 references (the most a 32-bit count "
                        "holds): aborting\n");
}

Test(future, callbacks_added_after_completion_run_at_once_and_each_runs_once) {
  _Atomic int calls = 0;
  dp_future_t *f = future(), *c[5];
  OK(dp_future_then(f, counting_cb, &calls, &c[0], T_ERR));
  OK(dp_future_then(f, counting_cb, &calls, &c[1], T_ERR));
  OK(dp_future_mark_completed(f, dp_int(3), T_ERR));
  cr_assert_eq(atomic_load(&calls), 2);
  OK(dp_future_then(f, counting_cb, &calls, &c[2], T_ERR));
  cr_assert_eq(atomic_load(&calls), 3, "ran at once");
  OK(dp_future_then(c[2], counting_cb, &calls, &c[3], T_ERR));
  OK(dp_future_then(c[3], counting_cb, &calls, &c[4], T_ERR));
  cr_assert_eq(atomic_load(&calls), 5);
  cr_assert_eq(dp_value_as_int(dp_future_value(c[4])), 5);
  for (int i = 0; i < 5; i++) dp_future_release(c[i]);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, a_released_pending_future_cancels_its_children_without_running_their_callbacks, .timeout = 60) {
  _Atomic int calls = 0;
  dp_future_t *f = future(), *c, *grandchild;
  OK(dp_future_then(f, counting_cb, &calls, &c, T_ERR));
  OK(dp_future_then(c, counting_cb, &calls, &grandchild, T_ERR));
  dp_future_release(f);
  cr_assert_eq(atomic_load(&calls), 0);
  dp_error_t e;
  cr_assert_eq(dp_future_wait(c, -1, &e), DP_ECANCELED, "the wait returns instead of hanging");
  cr_assert_str_eq(e.message, "the parent future was released before it completed");
  cr_assert_eq(dp_future_wait(grandchild, -1, &e), DP_ECANCELED, "the failure goes down the chain");
  cr_assert_str_eq(e.message, "the parent future was released before it completed");
  cr_assert_eq(atomic_load(&calls), 0);
  dp_future_release(c);
  dp_future_release(grandchild);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, a_waiter_blocked_on_a_child_wakes_when_the_pending_parent_is_released, .timeout = 60) {
  dp_future_t *f = future(), *c;
  OK(dp_future_then(f, counting_cb, NULL, &c, T_ERR));
  waiter_t w = {c, 1, {0}};
  pthread_t th;
  pthread_create(&th, NULL, wait_thread, &w);
  sleep_ms(20);
  dp_future_release(f);
  pthread_join(th, NULL);
  cr_assert_eq(w.rc, DP_ECANCELED);
  cr_assert_str_eq(w.err.message, "the parent future was released before it completed");
  dp_future_release(c);
}

/* ---- chains of any length: constant stack, in order ---- */

enum { LONG_CHAIN = 1000000 };

typedef struct order {
  long next;  /* the link whose callback must run next */
  long out_of_order;
} order_t;

/* Link k's callback: its parent holds k; the child gets k + 1. */
static int next_link(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)err;
  order_t *o = ud;
  int64_t k = dp_value_as_int(dp_future_value(parent));
  if (k != o->next) o->out_of_order++;
  o->next = k + 1;
  *result = dp_int(k + 1);
  return 0;
}

Test(future, a_chain_of_a_million_then_links_completes_in_constant_stack_and_in_order) {
  dp_future_t **c = malloc((LONG_CHAIN + 1) * sizeof *c);
  cr_assert(c);
  order_t o = {0, 0};
  c[0] = future();
  for (long k = 0; k < LONG_CHAIN; k++) OK(dp_future_then(c[k], next_link, &o, &c[k + 1], T_ERR));
  OK(dp_future_mark_completed(c[0], dp_int(0), T_ERR));
  cr_assert_eq(o.next, LONG_CHAIN, "every callback ran");
  cr_assert_eq(o.out_of_order, 0, "in chain order");
  for (long k = 0; k <= LONG_CHAIN; k++) {
    if (dp_value_as_int(dp_future_value(c[k])) != k) cr_assert_fail("link %ld holds the wrong value", k);
    dp_future_release(c[k]);
  }
  free(c);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, releasing_a_pending_chain_of_a_million_links_cancels_it_in_constant_stack, .timeout = 60) {
  order_t o = {0, 0};
  dp_future_t *root = future(), *link = dp_future_retain(root), *last = NULL;
  for (long k = 0; k < LONG_CHAIN; k++) {
    OK(dp_future_then(link, next_link, &o, &last, T_ERR));
    dp_future_release(link);  /* only the chain holds the links now */
    link = last;
  }
  dp_future_release(root);  /* the last reference: the whole chain is canceled */
  dp_error_t e;
  cr_assert_eq(dp_future_wait(last, -1, &e), DP_ECANCELED);
  cr_assert_str_eq(e.message, "the parent future was released before it completed");
  cr_assert_eq(o.next, 0, "no callback ran");
  dp_future_release(last);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A callback that completes another future and then waits on that future's
 * child: the child's callback is run for the wait, not after it. */
typedef struct nested {
  dp_future_t *other, *other_child;
  int rc;
} nested_t;

static int complete_other_and_wait(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent;
  nested_t *n = ud;
  int rc = dp_future_mark_completed(n->other, dp_int(41), err);
  if (rc == 0) rc = dp_future_wait(n->other_child, -1, err);
  n->rc = rc;
  *result = rc ? dp_none() : dp_value_retain(dp_future_value(n->other_child));
  return rc;
}

static int plus_one(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  (void)err;
  *result = dp_int(dp_value_as_int(dp_future_value(parent)) + 1);
  return 0;
}

Test(future, a_callback_may_complete_other_futures_and_wait_on_their_children) {
  nested_t n = {future(), NULL, 1};
  OK(dp_future_then(n.other, plus_one, NULL, &n.other_child, T_ERR));
  dp_future_t *f = future(), *c;
  OK(dp_future_then(f, complete_other_and_wait, &n, &c, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  cr_assert_eq(n.rc, 0);
  cr_assert_eq(dp_value_as_int(dp_future_value(c)), 42, "complete when the outer completion returns");
  dp_future_release(f);
  dp_future_release(c);
  dp_future_release(n.other);
  dp_future_release(n.other_child);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* The callbacks of one future run in registration order, also when they are
 * run from inside another callback. */
typedef struct seq {
  int log[8];
  int n;
  dp_future_t *inner;
} seq_t;
typedef struct tag {
  seq_t *s;
  int id;
} tag_t;
static int log_tag(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent;
  (void)result;
  (void)err;
  tag_t *t = ud;
  t->s->log[t->s->n++] = t->id;
  return 0;
}
static int complete_inner(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent;
  (void)result;
  seq_t *s = ud;
  s->log[s->n++] = 0;
  return dp_future_mark_completed(s->inner, dp_none(), err);
}

Test(future, callbacks_run_in_registration_order_also_when_completed_from_a_callback) {
  seq_t s = {{0}, 0, future()};
  tag_t tags[3] = {{&s, 1}, {&s, 2}, {&s, 3}};
  dp_future_t *f = future(), *c[4];
  OK(dp_future_then(f, complete_inner, &s, &c[0], T_ERR));
  for (int i = 0; i < 3; i++) OK(dp_future_then(s.inner, log_tag, &tags[i], &c[1 + i], T_ERR));
  OK(dp_future_mark_completed(f, dp_none(), T_ERR));
  cr_assert_eq(s.n, 4);
  for (int i = 0; i < 4; i++) cr_assert_eq(s.log[i], i);
  for (int i = 0; i < 4; i++) {
    cr_assert(dp_future_is_done(c[i]));
    dp_future_release(c[i]);
  }
  dp_future_release(f);
  dp_future_release(s.inner);
}

/* Depth first, as recursion would run them (and torch does): a child's
 * callbacks run when its callback returns, before its parent's next one. */
Test(future, a_childs_callbacks_run_before_its_parents_later_callbacks) {
  seq_t s = {{0}, 0, NULL};
  tag_t tags[4] = {{&s, 1}, {&s, 2}, {&s, 3}, {&s, 4}};
  dp_future_t *f = future(), *c[4];
  OK(dp_future_then(f, log_tag, &tags[0], &c[0], T_ERR));
  OK(dp_future_then(c[0], log_tag, &tags[1], &c[1], T_ERR));
  OK(dp_future_then(c[1], log_tag, &tags[2], &c[2], T_ERR));
  OK(dp_future_then(f, log_tag, &tags[3], &c[3], T_ERR));
  OK(dp_future_mark_completed(f, dp_none(), T_ERR));
  cr_assert_eq(s.n, 4);
  for (int i = 0; i < 4; i++) cr_assert_eq(s.log[i], i + 1, "log[%d] is %d", i, s.log[i]);
  for (int i = 0; i < 4; i++) dp_future_release(c[i]);
  dp_future_release(f);
}

/* ---- memory held while a consumer still uses it ---- */

static int reused_under_consumer(int with_hooks) {
  dp_stream_t *prod, *cons;
  OK(dp_stream_new(B, H0, &prod, T_ERR));
  OK(dp_stream_new(B, H0, &cons, T_ERR));
  OK(dp_set_current_stream(prod, NULL, T_ERR));
  dp_value_t t = device_ints(H0, 1024);
  for (int i = 0; i < 1024; i++) data_of(t)[i] = 5;
  dp_future_t *f;
  dp_future_opts_t o = {B, NULL, 0, NULL, !with_hooks, 0};
  OK(dp_future_new(&o, &f, T_ERR));
  OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR));
  OK(dp_set_current_stream(cons, NULL, T_ERR));
  OK(dp_future_wait(f, -1, T_ERR));  /* cons waits, and (with hooks) is recorded */
  _Atomic int open = 0;
  read_t r = {data_of(t), 1024, 0, -1, 0, &open};
  OK(dp_host_launch(cons, slow_read, &r, T_ERR));  /* cons still reads: held until the producer is done */
  OK(dp_set_current_stream(prod, NULL, T_ERR));
  free_ints(t);  /* the producer is done with it */
  dp_value_t again = device_ints(H0, 1024);  /* and allocates the same size */
  fill_t fill = {data_of(again), 1024, 9, 0, NULL};
  OK(dp_host_launch(prod, slow_fill, &fill, T_ERR));
  OK(dp_stream_synchronize(prod, T_ERR));
  atomic_store(&open, 1);
  OK(dp_device_synchronize(B, H0, T_ERR));
  dp_reset_current_stream(B, H0);
  int same_block = data_of(again) == data_of(t);
  free_ints(again);
  dp_value_release(again);
  dp_value_release(t);
  dp_future_release(f);
  dp_stream_free(prod);
  dp_stream_free(cons);
  cr_assert_eq(same_block, !with_hooks);
  return r.first == 5 && r.all_same;
}

Test(future, storages_are_not_reused_while_a_consumer_that_waited_still_reads_them) {
  cr_assert(reused_under_consumer(1));
}

Test(future, negative_control_without_allocator_hooks_the_storage_is_reused_under_the_consumer) {
  cr_assert_not(reused_under_consumer(0));
}

/* ---- collect_all, with_ptrs ---- */

Test(future, collect_all_gathers_values_and_passes_pointers_through) {
  dp_future_t *in[3], *all;
  dp_value_t t[3];
  for (int i = 0; i < 3; i++) {
    in[i] = future();
    t[i] = device_ints(i == 2 ? H1 : H0, 8);
  }
  OK(dp_future_collect_all(in, 3, NULL, &all, T_ERR));
  OK(dp_future_mark_completed(in[2], dp_value_retain(t[2]), T_ERR));
  OK(dp_future_mark_completed(in[0], dp_value_retain(t[0]), T_ERR));
  cr_assert_not(dp_future_is_done(all));
  OK(dp_future_mark_completed(in[1], dp_value_retain(t[1]), T_ERR));
  OK(dp_future_wait(all, -1, T_ERR));
  dp_value_t v = dp_future_value(all);
  cr_assert_eq(dp_seq_len(v), 3);
  for (int i = 0; i < 3; i++) cr_assert_eq(dp_value_id(dp_seq_get(v, (size_t)i)), dp_value_id(t[i]));
  cr_assert_eq(dp_future_nptrs(all), 3);
  cr_assert_eq(dp_future_ndevices(all), 2);
  for (int i = 0; i < 3; i++) {
    free_ints(t[i]);
    dp_value_release(t[i]);
    dp_future_release(in[i]);
  }
  dp_future_release(all);
}

/* The aggregate may be written over one of its inputs in the caller's
 * array (the inputs replaced by what gathers them). It was stored before
 * the inputs were read, so the aggregate waited on itself and never
 * completed, and the input it replaced was never waited on. */
Test(future, collect_all_may_store_its_future_over_an_input_of_the_same_array) {
  dp_future_t *in[2] = {future(), future()};
  dp_future_t *a = in[0], *b = in[1];
  OK(dp_future_collect_all(in, 2, NULL, &in[0], T_ERR));
  cr_assert_neq(in[0], a, "the aggregate is in in[0]");
  OK(dp_future_mark_completed(a, dp_int(1), T_ERR));
  OK(dp_future_mark_completed(b, dp_int(2), T_ERR));
  OK(dp_future_wait(in[0], 1000000000, T_ERR));
  dp_value_t v = dp_future_value(in[0]);
  cr_assert_eq(dp_seq_len(v), 2);
  cr_assert_eq(dp_value_as_int(dp_seq_get(v, 0)), 1, "input 0 is the future that was in in[0]");
  cr_assert_eq(dp_value_as_int(dp_seq_get(v, 1)), 2);
  dp_future_release(in[0]);
  dp_future_release(a);
  dp_future_release(b);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: without opts the aggregate takes its first input's backend,
 * devices and hooks; an input on a device outside them fails it with
 * DP_EDEVICE, naming the device and the path in the list of values, while
 * opts that allow it let it through. */
Test(future, collect_all_without_opts_takes_the_first_inputs_devices) {
  dp_future_t *only0;
  dp_device_t d0 = H0;
  OK(dp_future_new(&(dp_future_opts_t){B, &d0, 1, NULL, 0, 0}, &only0, T_ERR));
  dp_future_t *any = future();
  OK(dp_future_mark_completed(only0, dp_int(0), T_ERR));
  OK(dp_future_mark_completed(any, t_tensor(H1, 0x1000, 4), T_ERR));
  dp_future_t *in[2] = {only0, any}, *all;
  OK(dp_future_collect_all(in, 2, NULL, &all, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(all, 1000000000, &e), DP_EDEVICE, "%s", e.message);
  cr_assert(strstr(e.message, "the value uses host:1 (first at $[1]), which"), "%s", e.message); /* the list's */
  dp_future_release(all);
  OK(dp_future_collect_all(in, 2, &(dp_future_opts_t){B, NULL, 0, NULL, 0, 0}, &all, T_ERR));
  OK(dp_future_wait(all, 1000000000, T_ERR));
  cr_assert_eq(dp_future_nptrs(all), 1);
  dp_future_release(all);
  OK(dp_future_collect_all(NULL, 0, NULL, &all, T_ERR)); /* no input: the defaults, done at once with [] */
  OK(dp_future_wait(all, 0, T_ERR));
  cr_assert_eq(dp_seq_len(dp_future_value(all)), 0);
  dp_future_release(all);
  dp_future_release(only0);
  dp_future_release(any);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A then() callback fills err by hand (base.h): its message reaches the
 * child's waiters with the code it returned, whatever it put in err->code. */
static int then_says_why(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result;
  if (ud) err->code = DP_EIO;
  snprintf(err->message, sizeof err->message, "the kernel launch failed: too many resources requested");
  return DP_ECUDA;
}
static int then_ptrs_says_why(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)ptrs;
  return then_says_why(ud, parent, result, err);
}

Test(future, a_callback_that_writes_its_message_without_its_code_fails_its_child_with_that_message) {
  dp_future_t *f = future(), *c1, *c2, *c3;
  OK(dp_future_then(f, then_says_why, NULL, &c1, T_ERR));
  OK(dp_future_then(f, then_says_why, (void *)1, &c2, T_ERR));
  OK(dp_future_then_with_ptrs(f, then_ptrs_says_why, NULL, &c3, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  dp_future_t *kids[3] = {c1, c2, c3};
  for (int i = 0; i < 3; i++) {
    dp_error_t e;
    cr_assert_eq(dp_future_wait(kids[i], 1000000000, &e), DP_ECUDA, "child %d: %s", i, e.message);
    cr_assert_eq(e.code, DP_ECUDA, "child %d", i);
    cr_assert_str_eq(e.message, "the kernel launch failed: too many resources requested", "child %d", i);
    dp_future_release(kids[i]);
  }
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, collect_all_counts_refs_over_its_distinct_inputs) {
  /* f: one tensor; g: a list of three views of one storage */
  dp_value_t t = device_ints(H0, 8), u = device_ints(H0, 8), views;
  OK(dp_list_new(3, &views, T_ERR));
  for (int i = 0; i < 3; i++) {
    dp_value_t w;
    int64_t shape[1] = {4};
    OK(dp_tensor_new(dp_storage_retain(dp_tensor_storage(u)), DP_INT32, 1, shape, NULL, i, &w, T_ERR));
    OK(dp_list_append(views, w, T_ERR));
  }
  dp_future_t *f = future(), *g = future(), *all;
  OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR));
  OK(dp_future_mark_completed(g, dp_value_retain(views), T_ERR));
  dp_future_t *in[4] = {f, f, g, f};
  OK(dp_future_collect_all(in, 4, NULL, &all, T_ERR));
  OK(dp_future_wait(all, -1, T_ERR));
  cr_assert_eq(dp_future_nptrs(all), 2);
  dp_ptr_info_t p;
  OK(dp_future_ptr(all, 0, &p, T_ERR));
  cr_assert_eq(p.base, data_of(t));
  cr_assert_eq(p.refs, 1, "a tensor of an input given three times counted %u times", p.refs);
  OK(dp_future_ptr(all, 1, &p, T_ERR));
  cr_assert_eq(p.base, data_of(u));
  cr_assert_eq(p.refs, 3, "three views of one storage in one input counted as %u", p.refs);
  dp_future_release(all);
  free_ints(t);
  free_ints(u);
  dp_value_release(t);
  dp_value_release(u);
  dp_value_release(views);
  dp_future_release(f);
  dp_future_release(g);
}

Test(future, collect_all_fails_with_the_first_failed_input) {
  dp_future_t *in[2] = {future(), future()}, *all;
  OK(dp_future_collect_all(in, 2, NULL, &all, T_ERR));
  dp_error_t boom;
  dp_error_clear(&boom);
  boom.code = DP_EIO;
  snprintf(boom.message, sizeof boom.message, "peer went away");
  OK(dp_future_set_error(in[1], &boom, T_ERR));
  OK(dp_future_mark_completed(in[0], dp_int(1), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(all, -1, &e), DP_EIO);
  cr_assert_str_eq(e.message, "peer went away");
  dp_future_release(in[0]);
  dp_future_release(in[1]);
  dp_future_release(all);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, collect_all_over_a_released_pending_input_fails_with_ecanceled, .timeout = 60) {
  dp_future_t *in[3] = {future(), future(), future()}, *all;
  OK(dp_future_collect_all(in, 3, NULL, &all, T_ERR));
  OK(dp_future_mark_completed(in[0], dp_int(1), T_ERR));
  dp_future_release(in[1]);  /* pending, and nobody else holds it */
  OK(dp_future_mark_completed(in[2], dp_int(3), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(all, -1, &e), DP_ECANCELED, "the wait returns instead of hanging");
  cr_assert_str_eq(e.message, "input 1 of collect_all was released before it completed");
  dp_future_release(in[0]);
  dp_future_release(in[2]);
  dp_future_release(all);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

Test(future, completing_with_known_pointers_skips_the_walk) {
  dp_future_t *f = future();
  dp_value_t c;
  OK(dp_custom_new(&opaque_type, NULL, &c, T_ERR));  /* could not be walked */
  dp_value_t t = device_ints(H1, 4);
  dp_ptrset_t *ptrs;
  OK(dp_ptrset_new(&ptrs, T_ERR));
  OK(dp_ptrset_add(ptrs, H1, data_of(t), 16, NULL, T_ERR));
  OK(dp_future_mark_completed_with_ptrs(f, c, ptrs, T_ERR));
  cr_assert_eq(dp_future_nptrs(f), 1);
  cr_assert(dp_device_equal(dp_future_device(f, 0), H1));
  dp_ptrset_free(ptrs);
  free_ints(t);
  dp_value_release(t);
  dp_future_release(f);
}

/* ---- threads ---- */

typedef struct stress {
  dp_future_t **fs;
  int n, id, nthreads;
  _Atomic int *calls;
} stress_t;

static void *completer(void *p) {
  stress_t *s = p;
  for (int i = s->id; i < s->n; i += s->nthreads) dp_future_mark_completed(s->fs[(i * 7919) % s->n], dp_int(i), NULL);
  return NULL;
}

static void *chainer(void *p) {
  stress_t *s = p;
  for (int i = s->id; i < s->n; i += s->nthreads) {
    dp_future_t *c;
    if (dp_future_then(s->fs[(i * 104729) % s->n], counting_cb, s->calls, &c, NULL) == 0) dp_future_release(c);
  }
  return NULL;
}

Test(future, threads_complete_and_chain_concurrently_and_no_callback_is_lost_or_doubled) {
  enum { N = 4000, T = 4 };
  dp_future_t **fs = malloc(N * sizeof *fs);
  for (int i = 0; i < N; i++) fs[i] = future();
  _Atomic int calls = 0;
  pthread_t th[2 * T];
  stress_t args[2 * T];
  for (int t = 0; t < T; t++) {
    args[t] = (stress_t){fs, N, t, T, &calls};
    args[T + t] = (stress_t){fs, N, t, T, &calls};
    pthread_create(&th[t], NULL, chainer, &args[t]);
    pthread_create(&th[T + t], NULL, completer, &args[T + t]);
  }
  for (int t = 0; t < 2 * T; t++) pthread_join(th[t], NULL);
  cr_assert_eq(atomic_load(&calls), N, "every callback ran exactly once");
  for (int i = 0; i < N; i++) {
    cr_assert(dp_future_is_done(fs[i]));
    dp_future_release(fs[i]);
  }
  free(fs);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

static int hop_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud;
  (void)err;
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

/* collect_all out of memory: its future fails, never hangs, and releases
 * only what it made (the aggregate list's failure released an unset value:
 * under ASan a use-after-free of an earlier aggregate's list; over no
 * futures it returned 0 and a future that never completed). */
static int collect_strs(int n, long fail_after) {
  dp_future_t *in[64], *all;
  for (int i = 0; i < n; i++) OK(dp_future_new(NULL, &in[i], T_ERR));
  OK(dp_future_collect_all(in, (size_t)n, NULL, &all, T_ERR));
  for (int i = 0; i < n; i++) {
    dp_value_t x = t_str("x");
    if (i == n - 1 && fail_after) t_fail_at = t_alloc_count + fail_after; /* the last runs the aggregate */
    int rc = dp_future_mark_completed(in[i], x, NULL);
    t_fail_at = 0;
    cr_assert(rc == 0 || rc == DP_ENOMEM);
  }
  dp_error_t e;
  int rc = dp_future_wait(all, 1000000000ll, &e);
  cr_assert(rc == 0 || rc == DP_ENOMEM, "%s: %s", dp_err_name(rc), e.message);
  if (rc == 0) cr_assert_eq(dp_seq_len(dp_future_value(all)), (size_t)n);
  for (int i = 0; i < n; i++) dp_future_release(in[i]);
  dp_future_release(all);
  return rc;
}

Test(future, collect_all_out_of_memory_fails_its_future_and_releases_only_what_it_made) {
  for (long k = 1;; k++) {
    cr_assert_lt(k, 200);
    OK(collect_strs(64, 0)); /* an aggregate freed: its list's address left behind */
    if (collect_strs(64, k) == 0) break;
  }
  for (long k = 1;; k++) {
    cr_assert_lt(k, 200);
    dp_future_t *all = NULL;
    dp_error_t e;
    t_fail_at = t_alloc_count + k;
    int rc = dp_future_collect_all(NULL, 0, NULL, &all, &e);
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "%s", e.message);
      continue;
    }
    rc = dp_future_wait(all, 1000000000ll, &e);
    cr_assert(rc == 0 || rc == DP_ENOMEM, "collect_all over no futures: %s: %s", dp_err_name(rc), e.message);
    dp_future_release(all);
    if (rc == 0) break;
  }
  dp_shutdown(); /* the backend's streams and the thread's kept blocks go too */
  ASSERT_NO_LEAK();
}

Test(future, every_allocation_failure_is_an_error_and_leaks_nothing) {
  /* the default backend (dp_future_new(NULL)) must be the one the value's
     host:N memory is of, on a machine with a GPU too */
  setenv("DEVPICKLE_BACKEND", "host", 1);
  dp_shutdown();
  for (long k = 1;; k++) {
    cr_assert_lt(k, 2000);
    OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
    dp_value_t o = t_obj("Pair");
    dp_value_t a = device_ints(H0, 8), b = device_ints(H1, 8);
    OK(dp_object_set(o, "a", dp_value_retain(a), T_ERR));
    OK(dp_object_set(o, "b", dp_value_retain(b), T_ERR));
    long want = t_alloc_count + k;
    t_fail_at = want;
    dp_future_t *f = NULL, *child = NULL, *all = NULL;
    int rc = dp_future_new(NULL, &f, NULL);
    if (rc == 0) rc = dp_future_then(f, hop_cb, NULL, &child, NULL);
    int rc_all = rc == 0 ? dp_future_collect_all(&f, 1, NULL, &all, NULL) : 0;
    /* f is completed whatever failed after it was made: a child then never hangs */
    int rc_mark = f ? dp_future_mark_completed(f, o, NULL) : (dp_value_release(o), 0);
    o = dp_none();
    if (rc == 0) rc = rc_all ? rc_all : rc_mark;
    int rc_child = child ? dp_future_wait(child, -1, NULL) : 0;
    int rc_agg = all ? dp_future_wait(all, -1, NULL) : 0;
    int hit = t_alloc_count >= want; /* the failure was injected: else the sweep is over */
    t_fail_at = 0;
    cr_assert(rc == 0 || rc == DP_ENOMEM, "allocation %ld: %s", k, dp_err_name(rc));
    cr_assert(rc_child == 0 || rc_child == DP_ENOMEM, "allocation %ld: the child: %s", k, dp_err_name(rc_child));
    cr_assert(rc_agg == 0 || rc_agg == DP_ENOMEM, "allocation %ld: the aggregate: %s", k, dp_err_name(rc_agg));
    if (child) cr_assert(dp_future_is_done(child), "a failure never leaves a child hanging (allocation %ld)", k);
    dp_future_release(all);
    dp_future_release(child);
    dp_future_release(f);
    OK(dp_device_synchronize(B, H0, T_ERR));
    OK(dp_device_synchronize(B, H1, T_ERR));
    free_ints(a);
    free_ints(b);
    dp_value_release(a);
    dp_value_release(b);
    dp_shutdown();
    cr_assert_eq(t_live_blocks, 0, "leak after failing allocation %ld", k);
    if (!hit) {
      cr_assert(rc == 0 && rc_child == 0 && rc_agg == 0, "with no allocation failed, all succeeds");
      break;
    }
  }
}

/* The calls the sweep above does not make: then_with_ptrs on a pending and
 * on a complete parent, then() on a complete parent (its callback runs at
 * once), completion from the producer's set, and a wait and a synchronize
 * on a value over two devices. Every failure is DP_ENOMEM with a message;
 * a then_with_ptrs callback runs exactly once (with ptrs NULL when it cannot
 * run); the parent still completes and is waited on, and a child never hangs. */
enum { FS_THEN_PTRS, FS_THEN_PTRS_DONE, FS_THEN_DONE, FS_MARK_PTRS, FS_WAIT, FS_SYNC, FS_COUNT };

typedef struct fsweep {
  int op;
  dp_value_t o, a, b;   /* o holds a (host:0) and b (host:1) */
  dp_ptrset_t *set;     /* FS_MARK_PTRS: the producer's */
  dp_future_t *f, *child;
  dp_stream_t *mine[2]; /* FS_WAIT, FS_SYNC: the waiting thread's streams, not the completing ones */
  _Atomic int calls, calls_without_ptrs;
} fsweep_t;

static int fsweep_ptrs_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  fsweep_t *s = ud;
  atomic_fetch_add(&s->calls, 1);
  if (!ptrs) {
    atomic_fetch_add(&s->calls_without_ptrs, 1);
    cr_assert_eq(err->code, DP_ENOMEM, "told why it cannot run: %s", err->message);
    return 0;
  }
  int rc = dp_future_error(parent, err); /* it runs for a failed parent too */
  if (rc) return rc;
  *result = dp_value_retain(dp_future_value(parent));
  return dp_scan(*result, NULL, ptrs, err);
}

static void fsweep_prepare(void *p) {
  fsweep_t *s = p;
  s->child = NULL;
  s->set = NULL;
  atomic_store(&s->calls, 0);
  atomic_store(&s->calls_without_ptrs, 0);
  s->o = t_obj("Pair");
  s->a = device_ints(H0, 8);
  s->b = device_ints(H1, 8);
  OK(dp_object_set(s->o, "a", dp_value_retain(s->a), T_ERR));
  OK(dp_object_set(s->o, "b", dp_value_retain(s->b), T_ERR));
  s->f = future();
  if (s->op == FS_MARK_PTRS) {
    OK(dp_ptrset_new(&s->set, T_ERR));
    OK(dp_scan(s->o, NULL, s->set, T_ERR));
  } else if (s->op != FS_THEN_PTRS) {
    OK(dp_future_mark_completed(s->f, s->o, T_ERR));
    s->o = dp_none();
  }
  for (int d = 0; d < 2 && s->op >= FS_WAIT; d++) {
    OK(dp_stream_new(B, d ? H1 : H0, &s->mine[d], T_ERR));
    OK(dp_set_current_stream(s->mine[d], NULL, T_ERR));
  }
}

static int fsweep_run(void *p, dp_error_t *e) {
  fsweep_t *s = p;
  int rc = 0;
  switch (s->op) {
    case FS_THEN_PTRS:
      rc = dp_future_then_with_ptrs(s->f, fsweep_ptrs_cb, s, &s->child, e);
      break;
    case FS_THEN_PTRS_DONE: return dp_future_then_with_ptrs(s->f, fsweep_ptrs_cb, s, &s->child, e);
    case FS_THEN_DONE: return dp_future_then(s->f, hop_cb, NULL, &s->child, e);
    case FS_MARK_PTRS: {
      dp_value_t o = s->o;
      s->o = dp_none();
      return dp_future_mark_completed_with_ptrs(s->f, o, s->set, e);
    }
    case FS_WAIT: return dp_future_wait(s->f, -1, e);
    default: return dp_future_synchronize(s->f, -1, e);
  }
  /* the parent completes after the callback was chained, or its chaining failed */
  dp_value_t o = s->o;
  s->o = dp_none();
  int rc_mark = dp_future_mark_completed(s->f, o, rc ? NULL : e);
  return rc ? rc : rc_mark;
}

static void fsweep_check(void *p, int rc, long k) {
  fsweep_t *s = p;
  dp_error_t e;
  /* the parent is complete, with its value unless its own completion failed */
  cr_assert(dp_future_is_done(s->f), "allocation %ld: the parent never completed", k);
  int rc_f = dp_future_wait(s->f, -1, &e);
  cr_assert(rc_f == 0 || (rc_f == DP_ENOMEM && rc == DP_ENOMEM), "allocation %ld: the parent: %s: %s", k,
            dp_err_name(rc_f), e.message);
  if (rc == 0 || s->op >= FS_WAIT) cr_assert_eq(rc_f, 0, "allocation %ld: a failed wait fails no future", k);
  if (s->child) {
    int rc_c = dp_future_wait(s->child, -1, &e);
    /* a failure in the callback's run fails the child only */
    cr_assert(rc_c == 0 || (rc_c == DP_ENOMEM && e.message[0]), "allocation %ld: the child: %s: %s", k,
              dp_err_name(rc_c), e.message);
    if (rc_c == 0) cr_assert_eq(dp_future_nptrs(s->child), 2, "op %d, allocation %ld: the child holds %zu allocations", s->op, k, dp_future_nptrs(s->child));
    if (s->op != FS_THEN_DONE) cr_assert_eq(atomic_load(&s->calls), 1, "allocation %ld: the callback ran %d times", k,
                                            atomic_load(&s->calls));
    if (atomic_load(&s->calls_without_ptrs)) cr_assert_eq(rc_c, DP_ENOMEM);
  } else if (s->op <= FS_THEN_DONE) {
    cr_assert_neq(rc, 0, "allocation %ld: no child without an error", k);
    cr_assert_eq(atomic_load(&s->calls), 0, "allocation %ld: a callback that was not chained never runs", k);
  }
  if (rc == 0 && s->op == FS_MARK_PTRS) cr_assert_eq(dp_future_nptrs(s->f), 2);
  dp_future_release(s->child);
  dp_future_release(s->f);
  dp_ptrset_free(s->set);
  for (int d = 0; d < 2 && s->op >= FS_WAIT; d++) dp_stream_free(s->mine[d]);
  OK(dp_device_synchronize(B, H0, T_ERR));
  OK(dp_device_synchronize(B, H1, T_ERR));
  free_ints(s->a);
  free_ints(s->b);
  dp_value_release(s->a);
  dp_value_release(s->b);
  dp_value_release(s->o);
  dp_shutdown(); /* the event pool and the thread's kept blocks go too */
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "op %d: leak after failing allocation %ld", s->op, k);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
}

Test(future, chaining_on_complete_parents_completing_from_a_set_and_waiting_fail_cleanly_at_every_allocation) {
  static const t_sweep_t sw = {fsweep_prepare, fsweep_run, fsweep_check};
  for (int op = 0; op < FS_COUNT; op++) {
    fsweep_t s = {.op = op};
    long failed = t_sweep(&sw, &s);
    cr_assert_gt(failed, 0, "op %d: no allocation was failed", op);
  }
}

/* ---- what a completion holds ---- */

/* Completing and releasing futures in steady state allocates nothing: the
 * scan uses the thread's scratch set, events come from the pool, and the
 * record's block is one the thread kept from a released future (a fresh
 * block would be unmapped or trimmed away by malloc and fault in again on
 * every completion). The kept blocks are freed at shutdown. */
Test(future, steady_state_completions_reuse_the_threads_record_blocks_and_allocate_nothing) {
  enum { N = 1000 };
  dp_value_t l;
  OK(dp_list_new(N, &l, T_ERR));
  for (int i = 0; i < N; i++) OK(dp_list_append(l, device_ints(H0, 4), T_ERR));
  for (int round = 0; round < 3; round++) {
    dp_future_t *fs[4];
    for (int i = 0; i < 4; i++) fs[i] = future();
    long before = atomic_load(&t_alloc_count);
    for (int i = 0; i < 4; i++) OK(dp_future_mark_completed(fs[i], dp_value_retain(l), T_ERR));
    long made = atomic_load(&t_alloc_count) - before;
    if (round > 0) cr_assert_eq(made, 0, "round %d: %ld allocations completing 4 futures", round, made);
    for (int i = 0; i < 4; i++) dp_future_release(fs[i]);
  }
  for (int i = 0; i < N; i++) free_ints(dp_seq_get(l, (size_t)i));
  dp_value_release(l);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A completed future keeps, per allocation of its value, its base and its
 * other fields (24 bytes), and with one device nothing more: the record
 * that record_stream reads is the list of bases itself. Also checks that
 * every allocation is still reported, in discovery order, and that a
 * two-device value still groups its bases per device. */
Test(future, a_completed_future_holds_24_bytes_per_allocation_of_a_one_device_value) {
  enum { N = 1000 };
  dp_value_t l;
  OK(dp_list_new(N, &l, T_ERR));
  for (int i = 0; i < N; i++) OK(dp_list_append(l, device_ints(H0, 4), T_ERR));
  dp_future_t *warm = future();  /* grows the thread's scratch set and the event pool */
  OK(dp_future_mark_completed(warm, dp_value_retain(l), T_ERR));
  dp_future_t *f = future();
  long before = atomic_load(&t_live_bytes);
  OK(dp_future_mark_completed(f, dp_value_retain(l), T_ERR));
  long held = atomic_load(&t_live_bytes) - before;
  cr_assert_leq(held, 24 * N + 256, "a completion holds %ld bytes for %d allocations", held, N);
  cr_assert_eq(dp_future_nptrs(f), N);
  for (int i = 0; i < N; i++) {
    dp_ptr_info_t info;
    OK(dp_future_ptr(f, (size_t)i, &info, T_ERR));
    cr_assert_eq(info.base, data_of(dp_seq_get(l, (size_t)i)));
    cr_assert_eq(info.nbytes, 16);
    cr_assert(dp_device_equal(info.device, H0));
  }
  /* two devices: bases grouped per device, each device's event recorded */
  dp_value_t two;
  OK(dp_list_new(3, &two, T_ERR));
  OK(dp_list_append(two, device_ints(H0, 4), T_ERR));
  OK(dp_list_append(two, device_ints(H1, 4), T_ERR));
  OK(dp_list_append(two, device_ints(H0, 4), T_ERR));
  dp_future_t *g = future();
  OK(dp_future_mark_completed(g, dp_value_retain(two), T_ERR));
  cr_assert_eq(dp_future_nptrs(g), 3);
  cr_assert_eq(dp_future_ndevices(g), 2);
  dp_ptr_info_t info;
  OK(dp_future_ptr(g, 1, &info, T_ERR));
  cr_assert_eq(info.base, data_of(dp_seq_get(two, 1)));
  cr_assert(dp_device_equal(info.device, H1));
  OK(dp_future_wait(g, -1, T_ERR));
  OK(dp_future_wait(f, -1, T_ERR));
  dp_future_release(g);
  dp_future_release(f);
  dp_future_release(warm);
  for (int i = 0; i < 3; i++) free_ints(dp_seq_get(two, (size_t)i));
  for (int i = 0; i < N; i++) free_ints(dp_seq_get(l, (size_t)i));
  dp_value_release(two);
  dp_value_release(l);
}

/* A completion's record is its scratch set's block, taken (the set gets
 * another): later completions on the thread — of values of the same size,
 * of other sizes, over two devices — must not write into a record already
 * published, and completing from a caller's set copies it and leaves it as
 * it was. Each future reads back its own value's allocations, in order. */
static void check_record(dp_future_t *f, dp_value_t l) {
  size_t n = dp_seq_len(l);
  cr_assert_eq(dp_future_nptrs(f), n);
  for (size_t i = 0; i < n; i++) {
    dp_ptr_info_t info;
    OK(dp_future_ptr(f, i, &info, T_ERR));
    dp_storage_t *st = dp_tensor_storage(dp_seq_get(l, i));
    cr_assert_eq(info.base, dp_storage_base(st), "allocation %zu of %zu", i, n);
    cr_assert(dp_device_equal(info.device, dp_storage_device(st)));
    cr_assert_eq(info.nbytes, dp_storage_nbytes(st));
    cr_assert_eq(info.refs, 1);
  }
}

Test(future, a_record_taken_from_the_scratch_set_is_never_written_by_later_completions) {
  static const int sizes[] = {1000, 1000, 300, 10, 5000, 1000};
  enum { K = sizeof sizes / sizeof *sizes };
  dp_value_t v[K];
  dp_future_t *f[K + 2];
  for (int k = 0; k < K; k++) {
    OK(dp_list_new((size_t)sizes[k], &v[k], T_ERR));
    for (int i = 0; i < sizes[k]; i++)  /* the third value over two devices */
      OK(dp_list_append(v[k], device_ints(k == 2 && i % 3 == 1 ? H1 : H0, 4), T_ERR));
  }
  for (int k = 0; k < K; k++) {
    f[k] = future();
    OK(dp_future_mark_completed(f[k], dp_value_retain(v[k]), T_ERR));
  }
  cr_assert_eq(dp_future_ndevices(f[2]), 2);
  /* the same value again, after all of them */
  f[K] = future();
  OK(dp_future_mark_completed(f[K], dp_value_retain(v[0]), T_ERR));
  for (int k = 0; k < K; k++) check_record(f[k], v[k]);
  check_record(f[K], v[0]);
  /* a caller's set: copied, and still the caller's */
  dp_ptrset_t *mine;
  OK(dp_ptrset_new(&mine, T_ERR));
  OK(dp_scan(v[1], NULL, mine, T_ERR));
  f[K + 1] = future();
  OK(dp_future_mark_completed_with_ptrs(f[K + 1], dp_value_retain(v[1]), mine, T_ERR));
  check_record(f[K + 1], v[1]);
  cr_assert_eq(dp_ptrset_count(mine), 1000, "the caller's set keeps its entries");
  for (size_t i = 0; i < 1000; i++) {
    dp_ptr_info_t e;
    OK(dp_ptrset_get(mine, i, &e, T_ERR));
    cr_assert_eq(e.base, dp_storage_base(dp_tensor_storage(dp_seq_get(v[1], i))));
  }
  dp_ptrset_free(mine);
  for (int k = 0; k < K + 2; k++) dp_future_release(f[k]);
  for (int k = 0; k < K; k++) {
    for (int i = 0; i < sizes[k]; i++) free_ints(dp_seq_get(v[k], (size_t)i));
    dp_value_release(v[k]);
  }
  dp_shutdown();
  ASSERT_NO_LEAK();
}


/* A then() callback runs with pool streams current on every device its
 * parent's value uses, however many: they do not count against the
 * thread's DP_CURRENT_STREAM_SLOTS, and the thread's own current streams
 * come back afterwards. The callback's streams were set with
 * dp_set_current_stream, so a parent on 17 devices, or one device beyond a
 * thread's 16 own current streams, failed every child with DP_ELIMIT. */
typedef struct {
  int ndev, on_default;
} many_t;

static int count_default_streams(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  many_t *m = ud;
  for (int i = 0; i < m->ndev; i++) {
    dp_stream_t *cur, *dflt;
    int rc = dp_current_stream(B, t_dev(DP_DEVICE_HOST, i), &cur, err);
    if (rc == 0) rc = dp_stream_default(B, t_dev(DP_DEVICE_HOST, i), &dflt, err);
    if (rc) return rc;
    m->on_default += cur == dflt;
  }
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

Test(future, a_callback_gets_pool_streams_on_more_devices_than_a_thread_may_set_itself) {
  dp_shutdown();
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  dp_value_t l;
  OK(dp_list_new(20, &l, T_ERR));
  for (int i = 0; i < 20; i++) OK(dp_list_append(l, device_ints(t_dev(DP_DEVICE_HOST, i), 4), T_ERR));
  /* the thread holds its own current streams on devices 0..15 */
  dp_stream_t *own[DP_CURRENT_STREAM_SLOTS];
  for (int i = 0; i < DP_CURRENT_STREAM_SLOTS; i++) {
    OK(dp_stream_new(B, t_dev(DP_DEVICE_HOST, i), &own[i], T_ERR));
    OK(dp_set_current_stream(own[i], NULL, T_ERR));
  }
  dp_future_t *f = future(), *c;
  many_t m = {20, 0};
  OK(dp_future_then(f, count_default_streams, &m, &c, T_ERR));
  OK(dp_future_mark_completed(f, dp_value_retain(l), T_ERR));
  OK(dp_future_wait(c, -1, T_ERR));
  cr_assert_eq(dp_future_ndevices(c), 20, "the child records its events on the callback's 20 streams");
  cr_assert_eq(m.on_default, 0, "every device had a pool stream current in the callback");
  for (int i = 0; i < DP_CURRENT_STREAM_SLOTS; i++) {
    dp_stream_t *cur;
    OK(dp_current_stream(B, t_dev(DP_DEVICE_HOST, i), &cur, T_ERR));
    cr_assert_eq(cur, own[i], "host:%d's own current stream is back after the callback", i);
  }
  dp_stream_t *dflt17;
  OK(dp_stream_default(B, t_dev(DP_DEVICE_HOST, 17), &dflt17, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_set_current_stream(dflt17, NULL, &e), DP_ELIMIT, "the thread still holds its 16");
  cr_assert_str_eq(e.message, "dp_set_current_stream(host:17): this thread already holds current streams for 16 devices");
  dp_future_release(c);
  dp_future_release(f);
  for (int i = 0; i < 20; i++) free_ints(dp_seq_get(l, (size_t)i));
  dp_value_release(l);
  for (int i = 0; i < DP_CURRENT_STREAM_SLOTS; i++) dp_stream_free(own[i]);
}

/* dp_stream_free makes the calling thread stop using the stream as its
 * current one (device.h). Freed inside a then() callback, while the
 * callback's pool stream stood in for it, it was put back as current when
 * the callback returned: the thread's next allocation or wait used freed
 * memory. */
static int free_the_threads_stream(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  dp_stream_free(ud);
  return 0;
}

Test(future, a_stream_freed_in_a_callback_is_not_current_again_when_the_callback_returns) {
  dp_stream_t *mine, *dflt, *cur;
  OK(dp_stream_default(B, H0, &dflt, T_ERR)); /* made before mine is freed: never at its address */
  OK(dp_stream_new(B, H0, &mine, T_ERR));
  OK(dp_set_current_stream(mine, NULL, T_ERR));
  dp_value_t t = device_ints(H0, 4); /* on mine */
  dp_future_t *f = future(), *c;
  OK(dp_future_then(f, free_the_threads_stream, mine, &c, T_ERR));
  OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR)); /* the callback runs here */
  OK(dp_future_wait(c, -1, T_ERR));
  OK(dp_current_stream(B, H0, &cur, T_ERR));
  cr_assert_eq(cur, dflt, "the freed stream is forgotten: the default stream is current again");
  dp_future_release(c);
  dp_future_release(f);
  free_ints(t);
  dp_value_release(t);
}

/* A host function that completes a future on its own stream and then
 * synchronizes it would wait for itself: DP_EMISUSE at once, with a time
 * limit as without one, in the name of dp_future_synchronize (the message
 * named dp_event_synchronize, which the caller never called). With a limit it polled the event, which could not
 * complete before the function returned, for the whole limit and then
 * reported DP_ETIMEDOUT. */
typedef struct {
  dp_future_t *f;
  dp_value_t v;
  int64_t timeout_ns;
  int rc;
  double took_s;
  dp_error_t err;
} self_sync_t;

static void complete_and_synchronize(void *arg) {
  self_sync_t *x = arg;
  OK(dp_future_mark_completed(x->f, x->v, T_ERR));
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  x->rc = dp_future_synchronize(x->f, x->timeout_ns, &x->err);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  x->took_s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
}

Test(future, synchronizing_from_a_host_function_on_the_events_stream_is_emisuse_with_or_without_a_limit) {
  dp_stream_t *s;
  OK(dp_stream_default(B, H0, &s, T_ERR)); /* the host function's thread records there */
  int64_t limits[2] = {-1, 3000000000LL};
  for (int i = 0; i < 2; i++) {
    dp_value_t t = device_ints(H0, 4);
    self_sync_t x = {future(), dp_value_retain(t), limits[i], 1, 0, {0}};
    OK(dp_host_launch(s, complete_and_synchronize, &x, T_ERR));
    OK(dp_stream_synchronize(s, T_ERR));
    cr_assert_eq(x.rc, DP_EMISUSE, "limit %lld: %s", (long long)limits[i], x.err.message);
    cr_assert_str_eq(x.err.message,
                     "dp_future_synchronize: called from a host function on the stream of the future's event, "
                     "recorded after the function was queued: it would wait for itself");
    cr_assert_lt(x.took_s, 1.0, "limit %lld: refused after %.2f s", (long long)limits[i], x.took_s);
    dp_future_release(x.f);
    free_ints(t);
    dp_value_release(t);
  }
}

/* The allowed-devices array is given back with the size it was allocated
 * with (the allocator hook's osize) also when a device in it is refused:
 * it was freed as 0 bytes, which a hook that keeps accounts took for a leak
 * of the whole array. */
Test(future, a_future_refused_for_a_device_of_another_backend_gives_back_all_it_allocated) {
  dp_error_t e;
  dp_future_t *f = NULL;
  dp_device_t devs[3] = {H0, t_dev(DP_DEVICE_CUDA, 0), H1};
  dp_future_opts_t o = {B, devs, 3, NULL, 0, 0};
  cr_assert_eq(dp_future_new(&o, &f, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_new: device cuda:0 does not belong to the host backend (2 devices)");
  cr_assert_null(f, "no future is handed out");
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* value.h: cpu has index 0 only, so a listed cpu with another index names
 * no device a storage can be on; it was taken as cpu and allowed. */
Test(future, a_listed_cpu_with_an_index_other_than_0_is_refused_naming_it) {
  dp_error_t e;
  dp_future_t *f = NULL;
  dp_device_t devs[2] = {H0, t_dev(DP_DEVICE_CPU, 7)};
  dp_future_opts_t o = {B, devs, 2, NULL, 0, 0};
  cr_assert_eq(dp_future_new(&o, &f, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_new: device cpu:7 cannot exist (cpu has index 0 only)");
  cr_assert_null(f, "no future is handed out");
  dp_future_t *in = future(), *all = NULL;
  cr_assert_eq(dp_future_collect_all(&in, 1, &o, &all, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_collect_all: dp_future_new: device cpu:7 cannot exist (cpu has index 0 only)");
  cr_assert_null(all);
  dp_future_release(in);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* Bad arguments are refused up front, each naming the function and what is
 * wrong, and a completion refused for its arguments still completes the
 * future (with the error), so that no waiter hangs. */
Test(future, bad_arguments_are_refused_with_what_is_wrong_and_never_strand_a_waiter) {
  dp_error_t e;
  dp_future_t *f, *g;
  dp_future_opts_t o = {B, NULL, 3, NULL, 0, 0};
  cr_assert_eq(dp_future_new(&o, &f, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_new: devices is NULL but ndevices is 3");
  dp_device_t cpu_and_h0[2] = {t_dev(DP_DEVICE_CPU, 0), H0};
  dp_future_opts_t oc = {B, cpu_and_h0, 2, NULL, 0, 0};
  OK(dp_future_new(&oc, &f, T_ERR));  /* cpu may be listed: it is always allowed */
  dp_future_release(f);
  dp_cache_hooks_t none = {NULL, NULL, NULL, NULL};
  dp_future_opts_t oh = {B, NULL, 0, &none, 0, 0};
  cr_assert_eq(dp_future_new(&oh, &f, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_new: hooks with neither record_stream nor record_streams");
  f = future();
  dp_future_t *ins[2] = {f, NULL};
  cr_assert_eq(dp_future_collect_all(ins, 2, NULL, &g, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_collect_all: futures[1] is NULL");
  g = NULL;
  cr_assert_eq(dp_future_collect_all(NULL, 2, NULL, &g, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_collect_all: NULL futures");
  cr_assert_null(g, "nothing is written to out on a refusal");
  cr_assert_eq(dp_future_mark_completed_with_ptrs(f, dp_int(1), NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_mark_completed_with_ptrs: NULL ptrs");
  cr_assert(dp_future_is_done(f), "the refused completion completed f");
  cr_assert_eq(dp_future_wait(f, -1, &e), DP_EINVAL, "a waiter wakes with the error");
  cr_assert_eq(dp_future_synchronize(NULL, -1, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_synchronize: NULL future");
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* ---- memory of several allocators: a hooks chain ---- */

/* A framework's allocator, as the hooks see it: one arena, a log of the
 * records it was asked to make. */
typedef struct ext {
  int arena[256];
  int nlog;
  void *logged[8];
  dp_stream_t *on[8];
} ext_t;

static int ext_record(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  ext_t *x = ctx;
  (void)err;
  if ((char *)ptr < (char *)x->arena || (char *)ptr >= (char *)(x->arena + 256)) return DP_ENOTFOUND;
  if (x->nlog < 8) {
    x->logged[x->nlog] = ptr;
    x->on[x->nlog++] = s;
  }
  return 0;
}

static dp_value_t ints_at(void *p, int n) {
  dp_storage_t *st;
  OK(dp_storage_new(H0, p, (size_t)n * sizeof(int), NULL, NULL, &st, T_ERR));
  int64_t shape[1] = {n};
  dp_value_t t;
  OK(dp_tensor_new(st, DP_INT32, 1, shape, NULL, 0, &t, T_ERR));
  return t;
}

/* One value over memory of two caches and of an allocator devpickle does
 * not know: completion and wait record each allocation with its owner. */
Test(future, a_future_with_a_hooks_chain_records_each_allocation_with_its_owner) {
  dp_cache_t *ca, *cb;
  OK(dp_cache_new(B, &ca, T_ERR));
  OK(dp_cache_new(B, &cb, T_ERR));
  ext_t *x = calloc(1, sizeof *x);
  dp_cache_hooks_t list[3] = {dp_cache_hooks(ca), dp_cache_hooks(cb), {x, ext_record, NULL, NULL}};
  dp_cache_hooks_chain_t *ch;
  OK(dp_cache_hooks_chain_new(list, 3, &ch, T_ERR));
  dp_cache_hooks_t hooks = dp_cache_hooks_chain_hooks(ch);
  dp_stream_t *prod, *cons;
  OK(dp_stream_new(B, H0, &prod, T_ERR));
  OK(dp_stream_new(B, H0, &cons, T_ERR));
  void *pa, *pb;
  OK(dp_cache_alloc(ca, H0, 1024, prod, &pa, T_ERR));
  OK(dp_cache_alloc(cb, H0, 1024, prod, &pb, T_ERR));
  dp_value_t l;
  OK(dp_list_new(3, &l, T_ERR));
  OK(dp_list_append(l, ints_at(pa, 256), T_ERR));
  OK(dp_list_append(l, ints_at(x->arena, 256), T_ERR));
  OK(dp_list_append(l, ints_at(pb, 256), T_ERR));
  dp_future_t *f;
  dp_future_opts_t o = {B, NULL, 0, &hooks, 0, 0};
  OK(dp_future_new(&o, &f, T_ERR));
  OK(dp_set_current_stream(prod, NULL, T_ERR));
  OK(dp_future_mark_completed(f, l, T_ERR));
  cr_assert_eq(dp_future_nptrs(f), 3);
  cr_assert_eq(x->nlog, 1, "completion recorded the external allocation on the producer's stream");
  cr_assert_eq(x->logged[0], x->arena);
  cr_assert_eq(x->on[0], prod);
  OK(dp_set_current_stream(cons, NULL, T_ERR));
  OK(dp_future_wait(f, -1, T_ERR));
  cr_assert_eq(x->nlog, 2, "the wait recorded it on the consumer's");
  cr_assert_eq(x->on[1], cons);
  _Atomic int open = 0;
  read_t r = {pa, 256, 0, -1, 0, &open};
  OK(dp_host_launch(cons, slow_read, &r, T_ERR));  /* the consumer still reads, until the gate opens */
  OK(dp_cache_dealloc(ca, pa, T_ERR));
  OK(dp_cache_dealloc(cb, pb, T_ERR));
  dp_cache_stats_t sa, sb;
  OK(dp_cache_stats(ca, H0, &sa, T_ERR));
  OK(dp_cache_stats(cb, H0, &sb, T_ERR));
  cr_assert_eq(sa.pending_blocks, 1, "the first cache holds its block for the consumer");
  cr_assert_eq(sb.pending_blocks, 1, "and so does the second");
  atomic_store(&open, 1);
  OK(dp_stream_synchronize(cons, T_ERR));
  dp_reset_current_stream(B, H0);
  dp_future_release(f);
  dp_cache_hooks_chain_free(ch);
  dp_cache_free(ca);
  dp_cache_free(cb);
  dp_stream_free(prod);
  dp_stream_free(cons);
  free(x);
}

/* ---- consumers_only ---- */

static _Atomic int recorded_calls;
static int count_record(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)ptr, (void)s, (void)err;
  atomic_fetch_add(&recorded_calls, 1);
  return 0;
}

Test(future, consumers_only_records_on_the_consumers_streams_and_not_on_the_completing_one) {
  for (int only = 0; only < 2; only++) {
    atomic_store(&recorded_calls, 0);
    dp_cache_hooks_t hooks = {NULL, count_record, NULL, NULL};
    dp_future_opts_t o = {B, NULL, 0, &hooks, 0, only};
    dp_future_t *f, *child;
    OK(dp_future_new(&o, &f, T_ERR));
    OK(dp_future_then(f, bad_result, NULL, &child, T_ERR)); /* the child inherits the option */
    dp_value_t t = device_ints(H0, 4);
    OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR));
    int at_completion = atomic_load(&recorded_calls);
    dp_stream_t *cons;
    OK(dp_stream_new(B, H0, &cons, T_ERR));
    OK(dp_set_current_stream(cons, NULL, T_ERR));
    OK(dp_future_wait(f, -1, T_ERR));
    dp_reset_current_stream(B, H0);
    /* completion: once (only 0); the then() callback's pool stream: once; wait: once */
    cr_assert_eq(at_completion, only ? 1 : 2, "consumers_only=%d: %d records by completion", only, at_completion);
    cr_assert_eq(atomic_load(&recorded_calls), only ? 2 : 3);
    free_ints(t);
    dp_value_release(t);
    dp_future_release(f);
    dp_future_release(child);
    dp_stream_free(cons);
  }
}

Test(future, an_error_without_a_message_or_with_code_zero_reaches_waiters_with_one) {
  dp_future_t *f = future();
  dp_error_t none;
  dp_error_clear(&none);
  OK(dp_future_set_error(f, &none, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(f, -1, &e), DP_ESTATE);
  char want[DP_ERROR_MSG_MAX];
  snprintf(want, sizeof want, "the future failed: %s (completed with error code 0)", dp_strerror(DP_ESTATE));
  cr_assert_str_eq(e.message, want);
  dp_future_release(f);
  f = future();
  dp_error_t io;
  dp_error_clear(&io);
  io.code = DP_EIO;
  OK(dp_future_set_error(f, &io, T_ERR));
  cr_assert_eq(dp_future_wait(f, -1, &e), DP_EIO);
  snprintf(want, sizeof want, "the future failed: %s", dp_strerror(DP_EIO)); /* a code of the library's: no more */
  cr_assert_str_eq(e.message, want);
  dp_future_release(f);
}

/* A callback that waits on its own child — the future its result
 * completes, which only its return can complete — waited for itself: an
 * untimed wait hung the thread for good, a timed one spent its whole
 * limit. It is DP_EMISUSE at once, naming the function; so is a wait on it
 * from a callback nested in it (run by a wait of its own). */
typedef struct {
  dp_future_t *child;  /* set before the parent completes */
  int64_t timeout_ns;
  int rc;
  double took_s;
  dp_error_t err;
} self_wait_t;

static int wait_on_own_child(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  self_wait_t *x = ud;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  x->rc = dp_future_synchronize(x->child, x->timeout_ns, &x->err);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  x->took_s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  return 0;
}

Test(future, a_callback_waiting_on_its_own_child_is_emisuse_at_once_not_a_hang, .timeout = 20) {
  int64_t limits[2] = {-1, 5000000000ll};
  for (int i = 0; i < 2; i++) {
    self_wait_t x = {NULL, limits[i], 0, 0, {0}};
    dp_future_t *f = future();
    OK(dp_future_then(f, wait_on_own_child, &x, &x.child, T_ERR));
    OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
    cr_assert_eq(x.rc, DP_EMISUSE, "limit %lld: %s: %s", (long long)limits[i], dp_err_name(x.rc), x.err.message);
    cr_assert_str_eq(x.err.message,
                     "dp_future_synchronize: called from the then() callback whose result completes the future: it would "
                     "wait for itself");
    cr_assert_lt(x.took_s, 1.0, "refused at once, not after the limit (%.3f s)", x.took_s);
    OK(dp_future_wait(x.child, -1, T_ERR)); /* completed once the callback returned */
    dp_future_release(x.child);
    dp_future_release(f);
  }
}

/* negative control: a callback may wait on a sibling's child, which a
 * callback queued ahead of it completes */
static int returns_two(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)err;
  *result = dp_int(2);
  return 0;
}

Test(future, a_callback_may_wait_on_the_child_of_a_callback_that_ran_before_it) {
  self_wait_t x = {NULL, -1, 0, 0, {0}};
  dp_future_t *f = future(), *own;
  OK(dp_future_then(f, returns_two, NULL, &x.child, T_ERR));
  OK(dp_future_then(f, wait_on_own_child, &x, &own, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  cr_assert_eq(x.rc, 0, "%s: %s", dp_err_name(x.rc), x.err.message);
  cr_assert_eq(dp_value_as_int(dp_future_value(x.child)), 2);
  dp_future_release(own);
  dp_future_release(x.child);
  dp_future_release(f);
}

/* A callback that completes another future and waits on it: the wait
 * returns once that future's callbacks (queued by this callback) ran; the
 * callbacks its own parent has left wait until it returns. */
static dp_future_t *other;
static _Atomic int other_cb_ran, second_ran;
static int mark_other(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  atomic_store(&other_cb_ran, 1);
  return 0;
}
static int mark_second(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  atomic_store(&second_ran, 1);
  return 0;
}
static int complete_other_then_wait(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)err;
  OK(dp_future_mark_completed(other, dp_int(1), T_ERR)); /* other's callback: queued, not run here */
  OK(dp_future_wait(other, -1, T_ERR));
  int ran = atomic_load(&other_cb_ran);
  OK(dp_future_wait(parent, -1, T_ERR)); /* its own parent: done, its next callback still due */
  *result = dp_int(ran * 10 + atomic_load(&second_ran));
  return 0;
}

Test(future, a_callback_waiting_on_a_future_it_completed_returns_after_that_futures_callbacks) {
  dp_future_t *f = future(), *c1, *c2, *oc;
  other = future();
  OK(dp_future_then(other, mark_other, NULL, &oc, T_ERR));
  OK(dp_future_then(f, complete_other_then_wait, NULL, &c1, T_ERR));
  OK(dp_future_then(f, mark_second, NULL, &c2, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(7), T_ERR));
  OK(dp_future_wait(c1, -1, T_ERR));
  cr_assert_eq(dp_value_as_int(dp_future_value(c1)), 10, "other's callback ran in the wait, f's second did not");
  dp_future_release(c1);
  dp_future_release(c2);
  dp_future_release(oc);
  dp_future_release(other);
  dp_future_release(f);
}

/* A then-with-pointers callback is told when it cannot run (its pool
 * streams could not be set up: an allocation failed): called once with ptrs
 * NULL and err saying why, so that a binding completes what it owns and
 * frees ud — it was never called, and a Python then() child waited
 * forever. Every allocation of the then() call and of running it is failed
 * in turn. */
typedef struct told {
  int calls, not_run;
} told_t;

static int tell(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)parent;
  told_t *t = ud;
  t->calls++;
  if (!ptrs) {
    t->not_run++;
    cr_assert(err->message[0], "err says why the callback could not run");
    return err->code;
  }
  *result = dp_int(5);
  return 0;
}

Test(future, a_then_with_pointers_callback_that_cannot_run_is_told_so_once) {
  int told_not_run = 0;
  for (long k = 1; k < 400; k++) {
    dp_value_t t = device_ints(H0, 4); /* the parent's value holds host:0 memory: a stream to set up */
    dp_future_t *parent = future(), *child = NULL;
    OK(dp_future_mark_completed(parent, dp_value_retain(t), T_ERR));
    told_t seen = {0, 0};
    t_fail_at = t_alloc_count + k;
    int rc = dp_future_then_with_ptrs(parent, tell, &seen, &child, NULL);
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(seen.calls, 0, "a refused then() never calls back");
    } else {
      cr_assert_eq(seen.calls, 1, "called once, however the run went (k %ld)", k);
      dp_error_t e;
      int w = dp_future_wait(child, -1, &e);
      if (seen.not_run) {
        told_not_run++;
        cr_assert_neq(w, 0, "the child of a callback that could not run fails");
      }
      dp_future_release(child);
    }
    dp_future_release(parent);
    free_ints(t);
    dp_value_release(t);
    dp_shutdown(); /* the next round makes its pool streams again */
    OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
    if (!rc && !seen.not_run && told_not_run) break; /* past every allocation */
  }
  cr_assert(told_not_run > 0, "some failed allocation kept the streams from being set up");
}

/* A test that hung before its fix ends after `seconds` instead (SIGALRM
 * kills its process: the test crashes, so it fails) rather than hang the
 * suite. Not Criterion's .timeout: its runner leaks a record when timed
 * tests overlap under --jobs 2, which fails test-asan. */
static void watchdog(unsigned seconds) { alarm(seconds); }

/* A callback that waits on a future which completes only after its own
 * child — its grandchild (child.then()), a collect_all over its child, any
 * chain of then() and collect_all links down from it — waited for itself
 * as surely as one that waits on the child: an untimed wait hung the thread
 * for good, a timed one spent its whole limit. DP_EMISUSE at once, saying
 * why. (The callback is wait_on_own_child above, given the future to wait
 * on in child.) */
#define WAITS_THROUGH(fn)                                                                                      \
  fn ": called from a then() callback, on a future that waits (through then() parents and collect_all inputs) " \
     "for the child of a then() callback running on this thread, which only that callback's return completes: " \
     "it would wait for itself"

static void assert_refused_at_once(const self_wait_t *x, int64_t limit) {
  cr_assert_eq(x->rc, DP_EMISUSE, "limit %lld: %s: %s", (long long)limit, dp_err_name(x->rc), x->err.message);
  cr_assert_str_eq(x->err.message, WAITS_THROUGH("dp_future_synchronize"));
  cr_assert_lt(x->took_s, 1.0, "refused at once, not after the limit (%.3f s)", x->took_s);
}

Test(future, a_callback_waiting_on_its_grandchild_is_emisuse_at_once_not_a_hang) {
  watchdog(20);
  int64_t limits[2] = {-1, 5000000000ll};
  for (int i = 0; i < 2; i++) {
    self_wait_t x = {NULL, limits[i], 0, 0, {0}};
    dp_future_t *f = future(), *child;
    OK(dp_future_then(f, wait_on_own_child, &x, &child, T_ERR));
    OK(dp_future_then(child, returns_two, NULL, &x.child, T_ERR));
    OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
    assert_refused_at_once(&x, limits[i]);
    OK(dp_future_wait(x.child, -1, T_ERR)); /* completed once the callback returned */
    cr_assert_eq(dp_value_as_int(dp_future_value(x.child)), 2);
    dp_future_release(x.child);
    dp_future_release(child);
    dp_future_release(f);
  }
}

Test(future, a_callback_waiting_on_a_collect_all_over_its_own_child_is_emisuse_at_once_not_a_hang) {
  watchdog(20);
  int64_t limits[2] = {-1, 5000000000ll};
  for (int i = 0; i < 2; i++) {
    self_wait_t x = {NULL, limits[i], 0, 0, {0}};
    dp_future_t *f = future(), *done = future(), *child;
    OK(dp_future_mark_completed(done, dp_int(3), T_ERR));
    OK(dp_future_then(f, wait_on_own_child, &x, &child, T_ERR));
    dp_future_t *in[2] = {done, child};
    OK(dp_future_collect_all(in, 2, NULL, &x.child, T_ERR));
    OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
    assert_refused_at_once(&x, limits[i]);
    OK(dp_future_wait(x.child, -1, T_ERR));
    cr_assert_eq(dp_seq_len(dp_future_value(x.child)), 2);
    dp_future_release(x.child);
    dp_future_release(child);
    dp_future_release(done);
    dp_future_release(f);
  }
}

/* The links are followed however long the way: ten thousand then() links,
 * a collect_all that also waits on a future another thread completes
 * later, then ten thousand more. */
Test(future, a_callback_waiting_on_a_long_chain_down_from_its_child_is_emisuse_at_once) {
  watchdog(30);
  enum { LINKS = 10000 };
  self_wait_t x = {NULL, -1, 0, 0, {0}};
  dp_future_t *f = future(), *later = future(), *child, *link;
  OK(dp_future_then(f, wait_on_own_child, &x, &child, T_ERR));
  link = dp_future_retain(child);
  for (int half = 0; half < 2; half++) {
    for (int i = 0; i < LINKS; i++) {
      dp_future_t *next;
      OK(dp_future_then(link, returns_two, NULL, &next, T_ERR));
      dp_future_release(link);
      link = next;
    }
    if (half == 0) { /* the unrelated input first: followed first, to its end */
      dp_future_t *in[2] = {later, link}, *agg;
      OK(dp_future_collect_all(in, 2, NULL, &agg, T_ERR));
      dp_future_release(link);
      link = agg;
    }
  }
  x.child = link;
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  assert_refused_at_once(&x, -1);
  OK(dp_future_mark_completed(later, dp_int(0), T_ERR));
  OK(dp_future_wait(link, -1, T_ERR));
  dp_future_release(link);
  dp_future_release(child);
  dp_future_release(later);
  dp_future_release(f);
}

/* A callback nested in another (run by the outer one's wait) that waits on
 * the outer callback's grandchild waits for the outer callback's return,
 * which waits for it. */
static self_wait_t nested_wait;
static dp_future_t *nested_g, *nested_child;

static int complete_g_and_wait_on_its_child(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  OK(dp_future_mark_completed(nested_g, dp_int(1), T_ERR)); /* queues g's callback: wait_on_own_child */
  OK(dp_future_wait(nested_child, -1, T_ERR));              /* runs it, nested in this one */
  return 0;
}

Test(future, a_nested_callback_waiting_on_the_grandchild_of_the_callback_it_runs_in_is_emisuse) {
  watchdog(20);
  dp_future_t *f = future(), *outer_child, *grandchild;
  nested_g = future();
  nested_wait = (self_wait_t){NULL, -1, 0, 0, {0}};
  OK(dp_future_then(nested_g, wait_on_own_child, &nested_wait, &nested_child, T_ERR));
  OK(dp_future_then(f, complete_g_and_wait_on_its_child, NULL, &outer_child, T_ERR));
  OK(dp_future_then(outer_child, returns_two, NULL, &grandchild, T_ERR));
  nested_wait.child = grandchild;
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  assert_refused_at_once(&nested_wait, -1);
  OK(dp_future_wait(grandchild, -1, T_ERR));
  dp_future_release(grandchild);
  dp_future_release(outer_child);
  dp_future_release(nested_child);
  dp_future_release(nested_g);
  dp_future_release(f);
}

/* Negative control: waits from a callback that wait for nothing of its own
 * still work — on complete futures, and on a pending one (a then() child,
 * an aggregate of a diamond 64 collect_alls deep: 2^64 ways up, each future
 * looked at once) that another thread completes. */
typedef struct {
  dp_future_t *done, *done_child, *pending;
  int rc[3];
  dp_error_t err[3];
} legit_t;

static int waits_legitimately(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  legit_t *l = ud;
  l->rc[0] = dp_future_wait(l->done, -1, &l->err[0]);
  l->rc[1] = dp_future_synchronize(l->done_child, -1, &l->err[1]);
  l->rc[2] = dp_future_wait(l->pending, 20000000000ll, &l->err[2]);
  return 0;
}

static void *complete_later(void *p) {
  struct timespec ts = {0, 50000000};
  nanosleep(&ts, NULL);
  OK(dp_future_mark_completed(p, dp_int(4), T_ERR));
  return NULL;
}

Test(future, a_callback_may_still_wait_on_futures_that_do_not_wait_for_it) {
  watchdog(30);
  dp_future_t *f = future(), *root = future(), *child, *link;
  legit_t l = {future(), NULL, NULL, {0}, {{0}}};
  OK(dp_future_mark_completed(l.done, dp_int(1), T_ERR));
  OK(dp_future_then(l.done, returns_two, NULL, &l.done_child, T_ERR));
  OK(dp_future_then(root, returns_two, NULL, &link, T_ERR));
  for (int i = 0; i < 64; i++) {
    dp_future_t *in[2] = {link, link}, *agg;
    OK(dp_future_collect_all(in, 2, NULL, &agg, T_ERR));
    dp_future_release(link);
    link = agg;
  }
  l.pending = link;
  OK(dp_future_then(f, waits_legitimately, &l, &child, T_ERR));
  pthread_t th;
  pthread_create(&th, NULL, complete_later, root);
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  pthread_join(th, NULL);
  for (int i = 0; i < 3; i++) cr_assert_eq(l.rc[i], 0, "wait %d: %s: %s", i, dp_err_name(l.rc[i]), l.err[i].message);
  OK(dp_future_wait(child, -1, T_ERR));
  dp_future_release(child);
  dp_future_release(link);
  dp_future_release(l.done_child);
  dp_future_release(l.done);
  dp_future_release(root);
  dp_future_release(f);
}

/* The links are followed while other threads complete and release the
 * futures on them: a callback polls a collect_all's then() child while
 * another thread completes half its inputs and drops the last reference
 * to the other half (cancelling them). No future is read after it went,
 * no link is left dangling (the TSan build runs this too), and the wait
 * ends with the cancellation. */
enum { RACE_INPUTS = 64 };
typedef struct {
  dp_future_t *in[RACE_INPUTS]; /* the releasing thread's references */
  dp_future_t *target;
  int rc, polls;
  dp_error_t err;
} race_t;

static void *complete_or_drop_inputs(void *p) {
  race_t *r = p;
  for (int i = 0; i < RACE_INPUTS; i++) {
    if (i % 2 == 0) OK(dp_future_mark_completed(r->in[i], dp_int(i), T_ERR));
    dp_future_release(r->in[i]);
    sched_yield();
  }
  return NULL;
}

static int poll_target(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  race_t *r = ud;
  pthread_t th;
  pthread_create(&th, NULL, complete_or_drop_inputs, r);
  while ((r->rc = dp_future_wait(r->target, 0, &r->err)) == DP_ETIMEDOUT) r->polls++;
  pthread_join(th, NULL);
  return 0;
}

Test(future, links_are_followed_safely_while_another_thread_completes_and_releases_their_futures) {
  watchdog(60);
  for (int round = 0; round < 20; round++) {
    race_t r = {{NULL}, NULL, 0, 0, {0}};
    dp_future_t *f = future(), *agg, *child;
    for (int i = 0; i < RACE_INPUTS; i++) r.in[i] = future();
    OK(dp_future_collect_all(r.in, RACE_INPUTS, NULL, &agg, T_ERR));
    OK(dp_future_then(agg, returns_two, NULL, &r.target, T_ERR));
    OK(dp_future_then(f, poll_target, &r, &child, T_ERR));
    OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
    cr_assert_eq(r.rc, DP_ECANCELED, "round %d: %s: %s", round, dp_err_name(r.rc), r.err.message);
    OK(dp_future_wait(child, -1, T_ERR));
    dp_future_release(child);
    dp_future_release(r.target);
    dp_future_release(agg);
    dp_future_release(f);
  }
}

/* Following the links may need memory (a collect_all of many pending
 * inputs): when it runs out, the wait says so — DP_ENOMEM — rather than
 * wait for itself. Every allocation of the wait is failed in turn. */
typedef struct {
  dp_future_t *target;
  long fail_after; /* the wait's allocation to fail (1-based) */
  int rc;
  dp_error_t err;
} oom_wait_t;

static int wait_failing_allocation(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  oom_wait_t *w = ud;
  t_fail_at = t_alloc_count + w->fail_after;
  w->rc = dp_future_wait(w->target, -1, &w->err);
  t_fail_at = 0;
  return 0;
}

Test(future, a_wait_that_runs_out_of_memory_following_the_links_is_enomem_not_a_hang) {
  watchdog(60);
  enum { INPUTS = 100 };
  int enomem = 0, refused = 0;
  for (long k = 1; k < 50 && !refused; k++) {
    oom_wait_t w = {NULL, k, 0, {0}};
    dp_future_t *f = future(), *child, *in[INPUTS + 1];
    OK(dp_future_then(f, wait_failing_allocation, &w, &child, T_ERR));
    for (int i = 0; i < INPUTS; i++) in[i] = future();
    in[INPUTS] = child; /* with 100 others to take up: more than the inline room */
    OK(dp_future_collect_all(in, INPUTS + 1, NULL, &w.target, T_ERR));
    OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
    if (w.rc == DP_ENOMEM) {
      enomem++;
      cr_assert(strstr(w.err.message, "dp_future_wait: ") == w.err.message && strstr(w.err.message, "out of memory"),
                "%s", w.err.message);
    } else {
      cr_assert_eq(w.rc, DP_EMISUSE, "allocation %ld: %s: %s", k, dp_err_name(w.rc), w.err.message);
      refused = 1;
    }
    for (int i = 0; i < INPUTS; i++) {
      OK(dp_future_mark_completed(in[i], dp_int(i), T_ERR));
      dp_future_release(in[i]);
    }
    OK(dp_future_wait(w.target, -1, T_ERR));
    dp_future_release(w.target);
    dp_future_release(child);
    dp_future_release(f);
  }
  cr_assert(enomem > 0, "some allocation of the wait was failed");
  cr_assert(refused, "past its allocations, the wait is refused as misuse");
}

/* The host backend has two devices here: host:2 is past its last, not one
 * of "every device of the backend" (opts.ndevices 0). */
Test(future, memory_on_a_device_past_the_backends_last_is_refused_naming_it) {
  dp_future_t *f = future();
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_HOST, 2), 0x7f0000001000, 16), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, l, &e), DP_EDEVICE);
  cr_assert_str_eq(e.message, "the value uses host:2 (first at $[0]), which is not among the future's devices (none "
                              "named: every device of its host backend, [host:0, host:1]; the value's devices: [host:2])");
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A device list too long for its message is cut at a device and says how
 * many more there are, closing its bracket: the value's devices were cut
 * mid-name, without "]", past 255 bytes. */
Test(future, a_refusal_naming_many_devices_counts_those_it_leaves_out) {
  dp_future_t *f = future();
  dp_value_t l = t_list();
  for (int i = 0; i < 100; i++) OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CUDA, i), 0x1000, 4), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, l, &e), DP_EDEVICE);
  const char *used = strstr(e.message, "the value's devices: [cuda:0, cuda:1, ");
  cr_assert(used, "%s", e.message);
  const char *more = strstr(used, " more])");
  cr_assert(more, "%s", e.message);
  int shown = 0, left = 0;
  for (const char *c = used; c < more; c++) shown += strncmp(c, "cuda:", 5) == 0;
  const char *and = strstr(used, ", and ");
  cr_assert(and && sscanf(and, ", and %d more]", &left) == 1, "%s", e.message);
  cr_assert_eq(shown + left, 100, "%d shown, %d more: %s", shown, left, e.message);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A refused device names where the value holds memory there: the first
 * path of a walk with paths (the completion's own walk keeps none), under
 * a dict and a list; a producer's set scanned with paths gives its own; a
 * set the producer filled with memory the value does not hold names none. */
Test(future, a_refused_device_names_the_first_path_to_its_memory_and_a_producers_set_names_none) {
  dp_device_t only0[1] = {H0};
  dp_future_opts_t o = {B, only0, 1, NULL, 0, 0};
  dp_future_t *f, *g;
  OK(dp_future_new(&o, &f, T_ERR));
  OK(dp_future_new(&o, &g, T_ERR));
  dp_value_t d, inner = t_list(), key;
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_list_append(inner, t_tensor(H0, 0x7f0000001000, 16), T_ERR));
  OK(dp_list_append(inner, t_tensor(H1, 0x7f0000002000, 16), T_ERR));
  OK(dp_list_append(inner, t_tensor(H1, 0x7f0000003000, 16), T_ERR));
  OK(dp_str_new("blocks", 6, &key, T_ERR));
  OK(dp_dict_set(d, key, inner, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed(f, d, &e), DP_EDEVICE);
  cr_assert(strstr(e.message, "the value uses host:1 (first at $.blocks[1]), which"), "%s", e.message);
  dp_ptrset_t *set;
  OK(dp_ptrset_new(&set, T_ERR));
  OK(dp_ptrset_add(set, H1, (void *)0x7f0000004000, 16, NULL, T_ERR));
  cr_assert_eq(dp_future_mark_completed_with_ptrs(g, dp_int(3), set, &e), DP_EDEVICE);
  cr_assert(strstr(e.message, "the value uses host:1, which"), "%s", e.message);
  dp_ptrset_clear(set);
  dp_value_t held = t_list(), none = t_list();
  OK(dp_list_append(held, t_tensor(H1, 0x7f0000005000, 16), T_ERR));
  dp_scan_opts_t so = {0};
  so.flags = DP_SCAN_PATHS;
  OK(dp_scan(held, &so, set, T_ERR));
  dp_future_t *h;
  OK(dp_future_new(&o, &h, T_ERR));
  cr_assert_eq(dp_future_mark_completed_with_ptrs(h, none, set, &e), DP_EDEVICE); /* the set's own path */
  cr_assert(strstr(e.message, "the value uses host:1 (first at $[0]), which"), "%s", e.message);
  dp_value_release(held);
  dp_ptrset_free(set);
  dp_future_release(f);
  dp_future_release(g);
  dp_future_release(h);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: dp_future_device and dp_future_event answer cpu:0 and NULL out
 * of range — at ndevices too (the value holds device memory only, so the
 * record has no slot past its devices). */
Test(future, device_and_event_just_past_the_last_device_are_cpu_and_null) {
  dp_value_t l = t_list(), a = device_ints(H0, 4), b = device_ints(H1, 4);
  OK(dp_list_append(l, dp_value_retain(a), T_ERR));
  OK(dp_list_append(l, dp_value_retain(b), T_ERR));
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, l, T_ERR));
  cr_assert_eq(dp_future_ndevices(f), 2);
  cr_assert_not_null(dp_future_event(f, 1));
  for (size_t i = 2; i < 4; i++) {
    dp_device_t d = dp_future_device(f, i);
    cr_assert(d.type == DP_DEVICE_CPU && d.index == 0, "device %zu: type %d index %d", i, (int)d.type, (int)d.index);
    cr_assert_null(dp_future_event(f, i), "event %zu", i);
  }
  cr_assert_null(dp_future_event(f, SIZE_MAX));
  OK(dp_future_wait(f, -1, T_ERR));
  free_ints(a);
  free_ints(b);
  dp_value_release(a);
  dp_value_release(b);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

static int same_value(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)err;
  *result = dp_value_retain(dp_future_value(parent));
  return 0;
}

/* A then() child shares its parent's hooks — "none" included: a parent made
 * with no_hooks gets a child that records no stream use either, so a block
 * its consumer's busy stream waited for returns to the pool at its free. */
Test(future, the_child_of_a_future_without_hooks_records_no_stream_use_either) {
  for (int no_hooks = 1; no_hooks >= 0; no_hooks--) {
    dp_future_opts_t o = {B, NULL, 0, NULL, no_hooks, 0};
    dp_future_t *f, *child;
    OK(dp_future_new(&o, &f, T_ERR));
    OK(dp_future_then(f, same_value, NULL, &child, T_ERR));
    dp_value_t t = device_ints(H0, 4);
    OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR));
    dp_stream_t *cons;
    OK(dp_stream_new(B, H0, &cons, T_ERR));
    _Atomic int gate = 0;
    OK(dp_host_launch(cons, gate_spin, &gate, T_ERR)); /* the consumer's stream stays busy */
    OK(dp_set_current_stream(cons, NULL, T_ERR));
    OK(dp_future_wait(child, -1, T_ERR));
    dp_reset_current_stream(B, H0);
    dp_cache_t *c;
    OK(dp_cache_default(B, &c, T_ERR));
    dp_cache_stats_t before, after;
    OK(dp_cache_stats(c, H0, &before, T_ERR));
    free_ints(t);
    OK(dp_cache_stats(c, H0, &after, T_ERR));
    atomic_store(&gate, 1);
    OK(dp_stream_synchronize(cons, T_ERR));
    /* the control (hooks): the consumer's stream held the block until idle */
    cr_assert_eq(after.pending_blocks - before.pending_blocks, no_hooks ? 0u : 1u, "no_hooks=%d: %zu blocks pending",
                 no_hooks, after.pending_blocks - before.pending_blocks);
    cr_assert_eq(dp_cache_poll(c, NULL), no_hooks ? 0 : 1, "the block comes back once the stream is idle");
    dp_value_release(t);
    dp_future_release(f);
    dp_future_release(child);
    dp_stream_free(cons);
  }
}

/* A limit with a fraction of a second is kept whole: the deadline adds its
 * nanoseconds, not their remainder below 0.1 s. */
Test(future, a_wait_with_a_limit_of_a_quarter_second_waits_that_long) {
  dp_future_t *f = future();
  struct timespec t0, t1;
  dp_error_t e;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  cr_assert_eq(dp_future_wait(f, 250 * 1000000ll, &e), DP_ETIMEDOUT);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
  cr_assert(ms >= 249.9, "returned after %.1f ms", ms);
  cr_assert_str_eq(e.message, "dp_future_wait: the future did not complete within 250000000 ns");
  dp_future_release(f);
}

/* A pending future released cancels its then() children in the order they
 * were chained, as a completion would run their callbacks: the failure goes
 * down each child's chain in turn (then-with-pointers callbacks run on a
 * failed parent, so their order shows it). */
static int log_canceled(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)result, (void)ptrs, (void)err;
  tag_t *t = ud;
  t->s->log[t->s->n++] = dp_future_error(parent, NULL) == DP_ECANCELED ? t->id : -t->id;
  return 0;
}

Test(future, a_released_pending_future_cancels_its_children_in_the_order_they_were_chained) {
  seq_t s = {{0}, 0, NULL};
  tag_t tags[3] = {{&s, 1}, {&s, 2}, {&s, 3}};
  dp_future_t *f = future(), *c[3], *g[3];
  for (int i = 0; i < 3; i++) {
    OK(dp_future_then(f, failing_then_never_runs, NULL, &c[i], T_ERR));
    OK(dp_future_then_with_ptrs(c[i], log_canceled, &tags[i], &g[i], T_ERR));
  }
  dp_future_release(f);
  cr_assert_eq(s.n, 3, "each canceled child's callback ran once");
  for (int i = 0; i < 3; i++)
    cr_assert_eq(s.log[i], i + 1, "callback %d saw child %d (negative: not canceled) where child %d was due", i,
                 s.log[i], i + 1);
  for (int i = 0; i < 3; i++) {
    dp_error_t e;
    cr_assert_eq(dp_future_wait(c[i], 0, &e), DP_ECANCELED);
    cr_assert_str_eq(e.message, "the parent future was released before it completed");
    OK(dp_future_wait(g[i], 0, T_ERR));
    dp_future_release(c[i]);
    dp_future_release(g[i]);
  }
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: dp_future_error is 0 for a future completed with a value, and
 * err is written only with a failure — not with a made-up "detail lost"
 * message of code 0. */
Test(future, the_error_of_a_future_completed_with_a_value_is_zero_and_leaves_err_as_it_was) {
  dp_future_t *f = future();
  dp_error_t e;
  dp_error_clear(&e);
  e.code = DP_EIO;
  snprintf(e.message, sizeof e.message, "the caller's own");
  cr_assert_eq(dp_future_error(f, &e), 0, "pending");
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  cr_assert_eq(dp_future_error(f, &e), 0, "completed with a value");
  cr_assert_eq(e.code, DP_EIO, "err was written: code %d", e.code);
  cr_assert_str_eq(e.message, "the caller's own");
  cr_assert_eq(dp_future_error(f, NULL), 0);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: a NULL future reads as a pending one for dp_future_error, as
 * for dp_future_value and dp_future_is_done: 0, err left as it was; the
 * introspection counts are 0, device and event neutral, and retain and
 * release do nothing with it. */
Test(future, a_null_future_reads_as_a_pending_one_and_its_error_is_zero_leaving_err_as_it_was) {
  dp_error_t e;
  dp_error_clear(&e);
  e.code = DP_EIO;
  snprintf(e.message, sizeof e.message, "the caller's own");
  cr_assert_eq(dp_future_error(NULL, &e), 0);
  cr_assert_eq(e.code, DP_EIO, "err was written: code %d", e.code);
  cr_assert_str_eq(e.message, "the caller's own");
  cr_assert_eq(dp_future_error(NULL, NULL), 0);
  cr_assert_eq(dp_future_is_done(NULL), 0);
  cr_assert_eq(dp_value_kind(dp_future_value(NULL)), DP_NONE);
  cr_assert_eq(dp_future_nptrs(NULL), 0);
  cr_assert_eq(dp_future_ndevices(NULL), 0);
  cr_assert(dp_device_equal(dp_future_device(NULL, 0), t_dev(DP_DEVICE_CPU, 0)));
  cr_assert_null(dp_future_event(NULL, 0));
  cr_assert_null(dp_future_retain(NULL));
  dp_future_release(NULL);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* Completing a complete future with pointers it would refuse (a device past
 * the backend's last) is DP_ESTATE — the code err holds, naming the call —
 * not the refusal of a completion that was never going to happen. */
Test(future, completing_a_complete_future_with_pointers_it_would_refuse_is_estate) {
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  dp_ptrset_t *set;
  OK(dp_ptrset_new(&set, T_ERR));
  OK(dp_ptrset_add(set, t_dev(DP_DEVICE_HOST, 2), (void *)0x7f0000001000, 64, NULL, T_ERR));
  dp_error_t e;
  int rc = dp_future_mark_completed_with_ptrs(f, dp_int(2), set, &e);
  cr_assert_eq(rc, DP_ESTATE, "%s: %s", dp_err_name(rc), e.message);
  cr_assert_eq(e.code, rc);
  cr_assert_str_eq(e.message, "dp_future_mark_completed_with_ptrs: the future is already complete");
  cr_assert_eq(dp_value_as_int(dp_future_value(f)), 1, "the future is as it was");
  cr_assert_eq(dp_ptrset_count(set), 1, "the caller's set is left as it was");
  dp_ptrset_free(set);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A then-with-pointers callback runs while its scan set (the thread's
 * scratch set) is in use: completions it makes take a set of their own,
 * and the thread's set stays the thread's — freed at shutdown, not lost. */
static int complete_two_others(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)parent;
  dp_future_t **others = ud;
  for (int i = 0; i < 2; i++) {
    int rc = dp_future_mark_completed(others[i], t_tensor(t_dev(DP_DEVICE_CPU, 0), 0x1000 + 0x100 * (uintptr_t)i, 4), err);
    if (rc) return rc;
  }
  *result = dp_int(9);
  return dp_ptrset_add(ptrs, t_dev(DP_DEVICE_CPU, 0), (void *)0x2000, 16, NULL, err);
}

Test(future, completions_made_by_a_then_with_pointers_callback_keep_the_threads_scratch_set_and_leak_nothing) {
  dp_future_t *f = future(), *child, *others[2] = {future(), future()};
  OK(dp_future_then_with_ptrs(f, complete_two_others, others, &child, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  OK(dp_future_wait(child, 0, T_ERR));
  cr_assert_eq(dp_value_as_int(dp_future_value(child)), 9);
  cr_assert_eq(dp_future_nptrs(child), 1, "the callback's report, not the other completions' allocations");
  for (int i = 0; i < 2; i++) {
    dp_ptr_info_t p;
    cr_assert_eq(dp_future_nptrs(others[i]), 1);
    OK(dp_future_ptr(others[i], 0, &p, T_ERR));
    cr_assert_eq(p.base, (void *)(0x1000 + 0x100 * (uintptr_t)i));
    dp_future_release(others[i]);
  }
  dp_future_release(child);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A wait in a callback runs what is queued on its thread, the outer
 * frames' callbacks included: a callback may wait on the child of a
 * callback registered after it on the same parent (queued behind it). */
Test(future, a_callback_may_wait_on_the_child_of_a_callback_queued_after_it) {
  self_wait_t x = {NULL, 1000000000ll, 0, 0, {0}};
  dp_future_t *f = future(), *own;
  OK(dp_future_then(f, wait_on_own_child, &x, &own, T_ERR));
  OK(dp_future_then(f, returns_two, NULL, &x.child, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  cr_assert_eq(x.rc, 0, "%s: %s", dp_err_name(x.rc), x.err.message);
  cr_assert_lt(x.took_s, 0.5, "the queued callback ran in the wait, not after its limit (%.3f s)", x.took_s);
  cr_assert_eq(dp_value_as_int(dp_future_value(x.child)), 2);
  dp_future_release(own);
  dp_future_release(x.child);
  dp_future_release(f);
}

/* A wait in a callback runs what is queued on its thread before it decides
 * that it would wait for itself: a callback queued behind it that completes
 * its own child by hand makes that wait a legitimate one (future.h: one
 * completed by hand is no wait for itself). */
static dp_future_t *completed_by_hand;
static int complete_by_hand(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result;
  return dp_future_mark_completed(completed_by_hand, dp_int(5), err);
}

Test(future, a_callback_may_wait_on_its_own_child_that_a_callback_queued_behind_it_completes_by_hand) {
  self_wait_t x = {NULL, -1, 0, 0, {0}};
  dp_future_t *f = future(), *other_child;
  OK(dp_future_then(f, wait_on_own_child, &x, &x.child, T_ERR));
  completed_by_hand = x.child;
  OK(dp_future_then(f, complete_by_hand, NULL, &other_child, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  cr_assert_eq(x.rc, 0, "%s: %s", dp_err_name(x.rc), x.err.message);
  cr_assert_eq(dp_value_as_int(dp_future_value(x.child)), 5, "the child holds what it was completed with by hand");
  OK(dp_future_wait(other_child, 0, T_ERR));
  dp_future_release(other_child);
  dp_future_release(x.child);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* dp_future_device and dp_future_event answer cpu:0 and NULL at
 * ndevices also when the value holds cpu memory besides (its record has
 * room for a device more than it has events), and the record's block held
 * another future's devices before (the thread keeps record blocks for
 * later completions). */
Test(future, device_and_event_just_past_the_last_device_are_cpu_and_null_whatever_the_block_held_before) {
  dp_value_t a = device_ints(H0, 4), b = device_ints(H1, 4);
  for (int round = 0; round < 4; round++) { /* records of host:0 and host:1, their blocks kept */
    dp_value_t l = t_list();
    OK(dp_list_append(l, dp_value_retain(a), T_ERR));
    OK(dp_list_append(l, dp_value_retain(b), T_ERR));
    dp_future_t *f = future();
    OK(dp_future_mark_completed(f, l, T_ERR));
    cr_assert_eq(dp_future_ndevices(f), 2);
    OK(dp_future_wait(f, -1, T_ERR));
    dp_future_release(f);
  }
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CPU, 0), 0x1000, 4), T_ERR));
  OK(dp_list_append(l, dp_value_retain(b), T_ERR));
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, l, T_ERR));
  cr_assert_eq(dp_future_nptrs(f), 2);
  cr_assert_eq(dp_future_ndevices(f), 1, "host:1 only: cpu has no event");
  cr_assert(dp_device_equal(dp_future_device(f, 0), H1));
  dp_device_t d = dp_future_device(f, 1);
  cr_assert(d.type == DP_DEVICE_CPU && d.index == 0, "device 1: type %d index %d", (int)d.type, (int)d.index);
  cr_assert_null(dp_future_event(f, 1));
  OK(dp_future_wait(f, -1, T_ERR));
  dp_future_release(f);
  free_ints(a);
  free_ints(b);
  dp_value_release(a);
  dp_value_release(b);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* Each wait in a callback runs the callbacks queued on its thread, and a
 * callback it runs that waits runs the next one inside itself: thousands
 * of callbacks of one future, each polling a pending future with a limit
 * of 0, nested that deep and overflowed the stack (SIGSEGV at 10,000).
 * Waits nest DP_FUTURE_WAIT_NESTING_MAX deep at most; one further in, with
 * callbacks queued that it may not run, is DP_ELIMIT at once, and the
 * last callback, with nothing queued behind it, waits as any wait does. */
#define POLLERS 20000
static _Atomic int poll_depth, poll_max_depth, poll_timed_out, poll_limited, poll_other, poll_not_canceled;
static dp_error_t poll_limit_err;

static int poll_never(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  int d = atomic_fetch_add(&poll_depth, 1) + 1;
  if (d > atomic_load(&poll_max_depth)) atomic_store(&poll_max_depth, d);
  /* queued frees still run at any depth (they run no callback): a pending
     parent released here cancels its child, which the wait then sees */
  dp_future_t *p = future(), *c;
  dp_error_t e;
  OK(dp_future_then(p, poll_never, NULL, &c, T_ERR));
  dp_future_release(p);
  if (dp_future_wait(c, -1, &e) != DP_ECANCELED) atomic_fetch_add(&poll_not_canceled, 1);
  dp_future_release(c);
  int rc = dp_future_wait(never_done, 0, &e);
  if (rc == DP_ETIMEDOUT) atomic_fetch_add(&poll_timed_out, 1);
  else if (rc == DP_ELIMIT && atomic_fetch_add(&poll_limited, 1) == 0) poll_limit_err = e;
  else if (rc != DP_ELIMIT) atomic_fetch_add(&poll_other, 1);
  atomic_fetch_sub(&poll_depth, 1);
  return 0;
}

Test(future, thousands_of_callbacks_polling_a_pending_future_nest_their_waits_only_so_deep, .timeout = 60) {
  dp_future_t *f = future(), **kids = malloc(POLLERS * sizeof *kids);
  cr_assert_not_null(kids);
  never_done = future();
  for (int i = 0; i < POLLERS; i++) OK(dp_future_then(f, poll_never, NULL, &kids[i], T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  cr_assert_eq(atomic_load(&poll_other), 0);
  cr_assert_eq(atomic_load(&poll_not_canceled), 0, "a released parent's child is canceled at any depth");
  cr_assert_eq(atomic_load(&poll_max_depth), DP_FUTURE_WAIT_NESTING_MAX + 1,
               "callbacks nest inside %d waits, not as deep as they are many (%d)", DP_FUTURE_WAIT_NESTING_MAX,
               atomic_load(&poll_max_depth));
  cr_assert_eq(atomic_load(&poll_timed_out), DP_FUTURE_WAIT_NESTING_MAX + 1,
               "the waits that ran the queue, and the last one, with nothing queued, time out");
  cr_assert_eq(atomic_load(&poll_limited), POLLERS - DP_FUTURE_WAIT_NESTING_MAX - 1);
  cr_assert_eq(poll_limit_err.code, DP_ELIMIT);
  cr_assert_str_eq(poll_limit_err.message,
                   "dp_future_wait: called from a callback run inside 64 waits nested in callbacks on this thread (each "
                   "runs the callbacks queued here, which may wait in turn): the future is pending, and the queued "
                   "callbacks that might complete it do not run nested deeper");
  for (int i = 0; i < POLLERS; i++) {
    OK(dp_future_wait(kids[i], 0, T_ERR));
    dp_future_release(kids[i]);
  }
  free(kids);
  dp_future_release(never_done);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A reduce() of the value that completes a future runs before the future
 * is complete: a wait there on that future, or on one that waits for it (a
 * then() child), waited for itself and hung for good. It is DP_EMISUSE at
 * once, with a limit or without, as the same wait from a then() callback
 * on its own child is; a wait there on an unrelated future still works. */
static dp_future_t *walked, *walked_child, *unrelated;
static int walk_wait_rc[3];
static dp_error_t walk_wait_err[3];

static int reduce_waits(void *obj, dp_value_t *state, dp_error_t *err) {
  (void)obj, (void)err;
  *state = dp_int(1);
  if (dp_future_is_done(walked)) return 0; /* the child's walk of the same value (hop_cb) */
  walk_wait_rc[0] = dp_future_wait(walked, -1, &walk_wait_err[0]);
  walk_wait_rc[1] = dp_future_synchronize(walked_child, 1000000000ll, &walk_wait_err[1]);
  walk_wait_rc[2] = dp_future_wait(unrelated, 0, &walk_wait_err[2]);
  return 0;
}
static const dp_type_t waiting_type = {"Waits", reduce_waits, NULL};

Test(future, a_reduce_waiting_on_the_future_its_walk_completes_is_emisuse_at_once_not_a_hang, .timeout = 20) {
  walked = future();
  unrelated = future();
  OK(dp_future_mark_completed(unrelated, dp_int(3), T_ERR));
  OK(dp_future_then(walked, hop_cb, NULL, &walked_child, T_ERR));
  dp_value_t v;
  OK(dp_custom_new(&waiting_type, NULL, &v, T_ERR));
  OK(dp_future_mark_completed(walked, v, T_ERR));
  cr_assert_eq(walk_wait_rc[0], DP_EMISUSE, "%s", dp_err_name(walk_wait_rc[0]));
  cr_assert_str_eq(walk_wait_err[0].message,
                   "dp_future_wait: called while the future is being completed on this thread (a reduce() of the "
                   "value it walks, or a record hook): it would wait for itself");
  cr_assert_eq(walk_wait_rc[1], DP_EMISUSE, "%s", dp_err_name(walk_wait_rc[1]));
  cr_assert_str_eq(walk_wait_err[1].message,
                   "dp_future_synchronize: called while a future is being completed on this thread (a reduce() of "
                   "the value it walks, or a record hook), on a future that waits for that one (through then() parents "
                   "and collect_all inputs): it would wait for itself");
  cr_assert_eq(walk_wait_rc[2], 0, "%s", walk_wait_err[2].message);
  OK(dp_future_wait(walked_child, 0, T_ERR)); /* and the walk completed it as ever */
  dp_future_release(walked_child);
  dp_future_release(unrelated);
  dp_future_release(walked);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A record hook runs while the completion that calls it has not yet
 * published its future (it is complete once the hook returns): a wait
 * there on that future hung for good, and a dp_shutdown there freed the
 * streams and events the completion held. The wait is DP_EMISUSE at once,
 * with a limit or without; the shutdown tears nothing down (it says so on
 * stderr), and the future completes as ever — by
 * dp_future_mark_completed, by dp_future_mark_completed_with_ptrs, and as
 * a collect_all (completed by its input's completion, with no walk: its
 * hook's wait hung as the others did). */
static dp_future_t *recorded;
static int hook_calls, hook_wait_rc[2];
static dp_error_t hook_wait_err[2];
static int record_waits(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)ptr, (void)s, (void)err;
  if (hook_calls++) return 0; /* the consumer's record of the wait below */
  hook_wait_rc[0] = dp_future_wait(recorded, -1, &hook_wait_err[0]);
  hook_wait_rc[1] = dp_future_wait(recorded, 1000000000ll, &hook_wait_err[1]);
  dp_shutdown();
  return 0;
}

Test(future, a_record_hook_waiting_on_the_future_it_records_for_is_emisuse_at_once_and_its_shutdown_tears_nothing_down) {
  watchdog(20);
  dp_cache_hooks_t h = {NULL, record_waits, NULL, NULL};
  dp_future_opts_t o = {B, NULL, 0, &h, 0, 0};
  for (int with_ptrs = 0; with_ptrs < 3; with_ptrs++) {
    hook_calls = 0;
    dp_value_t t = t_tensor(H0, 0x1000, 4);
    if (with_ptrs == 2) { /* a collect_all (hooked) over a future without hooks */
      dp_future_t *in = future();
      OK(dp_future_collect_all(&in, 1, &o, &recorded, T_ERR));
      OK(dp_future_mark_completed(in, t, T_ERR));
      dp_future_release(in);
    } else if (with_ptrs) {
      OK(dp_future_new(&o, &recorded, T_ERR));
      dp_ptrset_t *set;
      OK(dp_ptrset_new(&set, T_ERR));
      OK(dp_scan(t, NULL, set, T_ERR));
      OK(dp_future_mark_completed_with_ptrs(recorded, t, set, T_ERR));
      dp_ptrset_free(set);
    } else {
      OK(dp_future_new(&o, &recorded, T_ERR));
      OK(dp_future_mark_completed(recorded, t, T_ERR));
    }
    cr_assert_eq(hook_calls, 1, "with_ptrs %d", with_ptrs);
    for (int k = 0; k < 2; k++) {
      cr_assert_eq(hook_wait_rc[k], DP_EMISUSE, "with_ptrs %d, wait %d: %s", with_ptrs, k, dp_err_name(hook_wait_rc[k]));
      cr_assert_str_eq(hook_wait_err[k].message,
                       "dp_future_wait: called while the future is being completed on this thread (a reduce() of the "
                       "value it walks, or a record hook): it would wait for itself");
    }
    OK(dp_future_wait(recorded, -1, T_ERR)); /* its events and the thread's streams are still there */
    cr_assert_eq(hook_calls, 2, "the wait recorded on the consumer's stream");
    dp_future_release(recorded);
  }
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A then() callback runs on whatever thread completes its parent (future.h):
 * a current stream it set on a device the parent's value does not use, or
 * one it reset, stayed so on that thread after it returned — a stream of
 * the callback's made current for every later completion and allocation
 * of an unrelated caller (freed by the callback's owner afterwards, it was
 * used after free), and one of the thread's 16 slots taken. Every current
 * stream a callback changes is put back when it returns, as the pool
 * streams on the parent's devices are. */
typedef struct set_in_cb {
  dp_stream_t *set_h1;  /* made current on host:1 by the callback, or NULL: host:1 reset */
  dp_stream_t *seen_h1; /* current on host:1 inside the callback, after the change */
} set_in_cb_t;

static int change_host1_stream(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result;
  set_in_cb_t *x = ud;
  if (x->set_h1) {
    int rc = dp_set_current_stream(x->set_h1, NULL, err);
    if (rc) return rc;
  } else {
    dp_reset_current_stream(B, H1);
  }
  return dp_current_stream(B, H1, &x->seen_h1, err);
}

Test(future, a_current_stream_a_callback_sets_or_resets_on_any_device_is_put_back_when_it_returns) {
  dp_stream_t *dflt1, *own1, *cbs, *cur;
  OK(dp_stream_default(B, H1, &dflt1, T_ERR));
  OK(dp_stream_new(B, H1, &own1, T_ERR));
  OK(dp_stream_new(B, H1, &cbs, T_ERR));
  dp_value_t t = device_ints(H0, 4); /* the parent uses host:0 only */
  for (int round = 0; round < 3; round++) {
    /* 0: the thread has none on host:1, the callback sets one; 1: the
       thread has its own, the callback sets another; 2: the callback resets
       the thread's own */
    if (round == 0) dp_reset_current_stream(B, H1);
    else OK(dp_set_current_stream(own1, NULL, T_ERR));
    set_in_cb_t x = {round == 2 ? NULL : cbs, NULL};
    dp_future_t *f = future(), *c;
    OK(dp_future_then(f, change_host1_stream, &x, &c, T_ERR));
    OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR)); /* the callback runs here */
    OK(dp_future_wait(c, -1, T_ERR));
    cr_assert_eq(x.seen_h1, round == 2 ? dflt1 : cbs, "round %d: the change held inside the callback", round);
    OK(dp_current_stream(B, H1, &cur, T_ERR));
    cr_assert_eq(cur, round == 0 ? dflt1 : own1, "round %d: host:1's current stream is the thread's again", round);
    dp_future_release(c);
    dp_future_release(f);
  }
  dp_reset_current_stream(B, H1);
  free_ints(t);
  dp_value_release(t);
  dp_stream_free(own1);
  dp_stream_free(cbs);
}

/* The same on more devices than the frame logs inline, with one of the
 * callback's streams freed inside it: none of them is current after it. */
typedef struct set_many {
  dp_stream_t *s[8];
} set_many_t;

static int set_on_seven_devices(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result;
  set_many_t *x = ud;
  for (int i = 1; i < 8; i++) {
    int rc = dp_set_current_stream(x->s[i], NULL, err);
    if (rc) return rc;
  }
  dp_stream_free(x->s[3]);
  x->s[3] = NULL;
  return 0;
}

Test(future, current_streams_a_callback_sets_on_many_devices_and_one_it_frees_are_all_put_back) {
  dp_shutdown();
  setenv("DEVPICKLE_HOST_DEVICES", "8", 1);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  unsetenv("DEVPICKLE_HOST_DEVICES");
  set_many_t x;
  for (int i = 1; i < 8; i++) OK(dp_stream_new(B, t_dev(DP_DEVICE_HOST, i), &x.s[i], T_ERR));
  dp_value_t t = device_ints(H0, 4);
  dp_future_t *f = future(), *c;
  OK(dp_future_then(f, set_on_seven_devices, &x, &c, T_ERR));
  OK(dp_future_mark_completed(f, dp_value_retain(t), T_ERR));
  OK(dp_future_wait(c, -1, T_ERR));
  for (int i = 1; i < 8; i++) {
    dp_stream_t *cur, *dflt;
    OK(dp_current_stream(B, t_dev(DP_DEVICE_HOST, i), &cur, T_ERR));
    OK(dp_stream_default(B, t_dev(DP_DEVICE_HOST, i), &dflt, T_ERR));
    cr_assert_eq(cur, dflt, "host:%d: the default stream is current again", i);
  }
  /* all 16 slots are the thread's: none was left taken */
  for (int i = 1; i < 8; i++) OK(dp_set_current_stream(x.s[i == 3 ? 1 : i], NULL, T_ERR));
  dp_future_release(c);
  dp_future_release(f);
  free_ints(t);
  dp_value_release(t);
  for (int i = 1; i < 8; i++) {
    dp_reset_current_stream(B, t_dev(DP_DEVICE_HOST, i));
    if (x.s[i]) dp_stream_free(x.s[i]);
  }
}

/* The same through another stream: a host function completes a future
 * whose event lands on a stream that waits for work queued on the
 * function's own stream after it. Synchronizing it there polled (with a
 * limit: the whole limit, then DP_ETIMEDOUT) or hung (without one). */
typedef struct via_sync {
  dp_future_t *f;
  dp_value_t v;
  _Atomic int go;
  int64_t timeout_ns;
  int completed_rc, rc;
  dp_error_t err;
} via_sync_t;

static void complete_then_synchronize_when_told(void *arg) {
  via_sync_t *x = arg;
  while (!atomic_load(&x->go)) sleep_ms(1);
  /* no assertion here: on a worker thread Criterion keeps what an assertion allocates */
  x->completed_rc = dp_future_mark_completed(x->f, x->v, NULL); /* its event: on host:1's default stream, behind the wait */
  x->rc = dp_future_synchronize(x->f, x->timeout_ns, &x->err);
}

/* Guarded by alarm(), not .timeout: Criterion's timeout leaks its timer
 * record (LeakSanitizer reports it) when it overlaps another timed test. */
Test(future, synchronizing_from_a_host_function_through_a_stream_waiting_for_it_is_emisuse) {
  alarm(30); /* a hang is a crash, not a stalled suite */
  for (int limited = 0; limited < 2; limited++) {
    dp_stream_t *mine, *d1;
    OK(dp_stream_new(B, H0, &mine, T_ERR));
    OK(dp_stream_default(B, H1, &d1, T_ERR));
    dp_value_t t = device_ints(H1, 4);
    via_sync_t x = {.f = future(), .v = dp_value_retain(t), .timeout_ns = limited ? 5000000000ll : -1, .rc = 1};
    OK(dp_host_launch(mine, complete_then_synchronize_when_told, &x, T_ERR));
    dp_event_t *after;
    OK(dp_event_new(B, H0, &after, T_ERR));
    OK(dp_event_record(after, mine, T_ERR));
    OK(dp_stream_wait_event(d1, after, T_ERR));
    atomic_store(&x.go, 1);
    OK(dp_stream_synchronize(mine, T_ERR));
    cr_assert_eq(x.completed_rc, 0, "limited %d: %s", limited, dp_err_name(x.completed_rc));
    cr_assert_eq(x.rc, DP_EMISUSE, "limited %d: %s: %s", limited, dp_err_name(x.rc), x.err.message);
    cr_assert(strstr(x.err.message, "dp_future_synchronize: ") == x.err.message, "%s", x.err.message);
    OK(dp_stream_synchronize(d1, T_ERR));
    dp_event_free(after);
    dp_future_release(x.f);
    free_ints(t);
    dp_value_release(t);
    dp_stream_free(mine);
  }
  alarm(0);
}

/* Out of memory in a call names the call (as device.h and cache.h do):
 * "out of memory creating a future", "chaining a callback", "collecting
 * futures" and "listing the future's allocations" named none. */
static int no_op_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)err;
  *result = dp_none();
  return 0;
}
static int no_op_ptrs_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)ptrs;
  return no_op_cb(ud, parent, result, err);
}

Test(future, out_of_memory_in_a_call_names_the_call) {
  const char *fns[5] = {"dp_future_new", "dp_future_then", "dp_future_then_with_ptrs", "dp_future_collect_all",
                        "dp_future_ptr"};
  dp_value_t t = device_ints(H0, 4), u = device_ints(H0, 4);
  for (int op = 0; op < 5; op++) {
    int failed = 0;
    for (long k = 1;; k++) {
      cr_assert_lt(k, 200);
      dp_future_t *f = future(), *g = NULL;
      dp_value_t l;
      OK(dp_list_new(2, &l, T_ERR));
      OK(dp_list_append(l, dp_value_retain(t), T_ERR));
      OK(dp_list_append(l, dp_value_retain(u), T_ERR)); /* two storages, met apart: a list is made at the first ask */
      OK(dp_future_mark_completed(f, l, T_ERR));
      dp_error_t e;
      dp_error_clear(&e);
      long want = t_fail_at = atomic_load(&t_alloc_count) + k;
      dp_future_opts_t o = {B, NULL, 0, NULL, 0, 0};
      dp_ptr_info_t info;
      int rc = op == 0   ? dp_future_new(&o, &g, &e)
               : op == 1 ? dp_future_then(f, no_op_cb, NULL, &g, &e)
               : op == 2 ? dp_future_then_with_ptrs(f, no_op_ptrs_cb, NULL, &g, &e)
               : op == 3 ? dp_future_collect_all(&f, 1, NULL, &g, &e)
                         : dp_future_ptr(f, 0, &info, &e);
      int hit = atomic_load(&t_alloc_count) >= want;
      t_fail_at = 0;
      if (rc) {
        cr_assert_eq(rc, DP_ENOMEM, "%s, allocation %ld: %s: %s", fns[op], k, dp_err_name(rc), e.message);
        cr_assert(strncmp(e.message, fns[op], strlen(fns[op])) == 0, "%s, allocation %ld: %s", fns[op], k, e.message);
        failed++;
      }
      dp_future_release(g);
      dp_future_release(f);
      if (!hit) break;
    }
    cr_assert_gt(failed, 0, "%s: no allocation was failed", fns[op]);
  }
  free_ints(t);
  free_ints(u);
  dp_value_release(t);
  dp_value_release(u);
}

/* A wait in a callback on a future that is already complete runs nothing
 * queued: the callback returns before its future's next callback starts.
 * One on a pending future runs every callback queued on the thread (any of
 * them might complete it), the running callback's own future's later ones
 * included: they start inside the wait (WAITS NEST). */
typedef struct poller {
  seq_t *s;
  dp_future_t *on;
  int rc;
} poller_t;
static int log_around_a_wait(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  poller_t *w = ud;
  w->s->log[w->s->n++] = 10;
  w->rc = dp_future_wait(w->on, 0, NULL);
  w->s->log[w->s->n++] = 11;
  return 0;
}

Test(future, a_wait_in_a_callback_runs_its_futures_later_callbacks_only_when_it_waits_on_a_pending_future) {
  for (int pending = 0; pending < 2; pending++) {
    seq_t s = {{0}, 0, NULL};
    tag_t later = {&s, 2};
    poller_t w = {&s, future(), 0};
    if (!pending) OK(dp_future_mark_completed(w.on, dp_none(), T_ERR));
    dp_future_t *f = future(), *c[2];
    OK(dp_future_then(f, log_around_a_wait, &w, &c[0], T_ERR));
    OK(dp_future_then(f, log_tag, &later, &c[1], T_ERR));
    OK(dp_future_mark_completed(f, dp_none(), T_ERR));
    cr_assert_eq(s.n, 3);
    int want[2][3] = {{10, 11, 2}, {10, 2, 11}};
    for (int i = 0; i < 3; i++)
      cr_assert_eq(s.log[i], want[pending][i], "%s future: step %d is %d", pending ? "pending" : "complete", i,
                   s.log[i]);
    cr_assert_eq(w.rc, pending ? DP_ETIMEDOUT : 0);
    for (int i = 0; i < 2; i++) dp_future_release(c[i]);
    dp_future_release(f);
    dp_future_release(w.on);
  }
}

/* A consumer's record of a complete future's allocations on its own
 * streams can fail (the hook refuses): the wait returns that error as the
 * hook gave it, and the future stays complete with its value; a then()
 * callback, which would run on streams that record them, is not called
 * and its child fails with the same error. */
static int refusing_hook_calls;
static int refusing_hook(void *ctx, void *const *p, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)p, (void)n, (void)s;
  refusing_hook_calls++;
  snprintf(err->message, sizeof err->message, "the allocator refuses");
  return DP_EIO;
}
static int refused_cb_calls;
static int refused_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  refused_cb_calls++;
  return 0;
}

static int refused_ptrs_cb_told;
static dp_error_t refused_ptrs_cb_err;
static int refused_ptrs_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)ud, (void)parent, (void)result;
  if (!ptrs) {
    refused_ptrs_cb_told++;
    refused_ptrs_cb_err = *err;
  } else {
    refused_cb_calls++;
  }
  return 0;
}

Test(future, a_consumers_record_that_the_hook_refuses_fails_the_wait_and_the_then_child_not_the_future) {
  dp_cache_hooks_t hooks = {NULL, NULL, refusing_hook, NULL};
  dp_future_opts_t o = {B, NULL, 0, &hooks, 0, 1}; /* consumers_only: the completion records nothing */
  dp_future_t *f, *child;
  OK(dp_future_new(&o, &f, T_ERR));
  dp_value_t t = device_ints(H0, 4);
  void *p = data_of(t);
  OK(dp_future_mark_completed(f, t, T_ERR));
  cr_assert_eq(refusing_hook_calls, 0);
  dp_error_t e;
  cr_assert_eq(dp_future_wait(f, -1, &e), DP_EIO);
  cr_assert_eq(e.code, DP_EIO);
  cr_assert_str_eq(e.message, "the allocator refuses");
  cr_assert_eq(refusing_hook_calls, 1);
  cr_assert_eq(dp_future_error(f, NULL), 0, "the future itself completed with its value");
  cr_assert_eq(dp_value_kind(dp_future_value(f)), DP_TENSOR);
  OK(dp_future_then(f, refused_cb, NULL, &child, T_ERR));
  cr_assert_eq(refused_cb_calls, 0, "the callback never ran");
  cr_assert_eq(dp_future_error(child, &e), DP_EIO);
  cr_assert_str_eq(e.message, "the allocator refuses");
  dp_future_release(child);
  OK(dp_future_then_with_ptrs(f, refused_ptrs_cb, NULL, &child, T_ERR));
  cr_assert_eq(refused_cb_calls, 0, "the callback never ran with a set");
  cr_assert_eq(refused_ptrs_cb_told, 1, "it was told once that it cannot run");
  cr_assert_eq(refused_ptrs_cb_err.code, DP_EIO);
  cr_assert_str_eq(refused_ptrs_cb_err.message, "the allocator refuses");
  cr_assert_eq(dp_future_error(child, &e), DP_EIO);
  cr_assert_str_eq(e.message, "the allocator refuses");
  dp_future_release(child);
  dp_future_release(f);
  dp_cache_t *c;
  OK(dp_cache_default(B, &c, T_ERR));
  OK(dp_cache_dealloc(c, p, T_ERR));
}

/* future.h: a NULL future, callback or out is DP_EINVAL, naming the call
 * and what is NULL; a completing call steals its value even then. */
static int never_called(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  cr_assert_fail("a refused then() never runs its callback");
  return 0;
}
static int never_called_with_ptrs(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs,
                                  dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)ptrs, (void)err;
  cr_assert_fail("a refused then_with_ptrs() never runs its callback");
  return 0;
}

Test(future, a_null_argument_is_einval_naming_the_call_and_what_is_null) {
  dp_error_t e;
  dp_future_t *f = future(), *c = NULL;
  dp_ptrset_t *ps;
  OK(dp_ptrset_new(&ps, T_ERR));
  dp_value_t l;
  OK(dp_list_new(1, &l, T_ERR)); /* stolen by each refused completion below */
  cr_assert_eq(dp_future_new(NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_new: NULL out");
  cr_assert_eq(dp_future_mark_completed(NULL, l, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_mark_completed: NULL future");
  OK(dp_list_new(1, &l, T_ERR));
  cr_assert_eq(dp_future_mark_completed_with_ptrs(NULL, l, ps, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_mark_completed_with_ptrs: NULL future");
  cr_assert_eq(dp_future_wait(NULL, 0, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_wait: NULL future");
  cr_assert_eq(dp_future_then(NULL, never_called, NULL, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_then: NULL future");
  cr_assert_eq(dp_future_then(f, NULL, NULL, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_then: NULL cb");
  cr_assert_eq(dp_future_then(f, never_called, NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_then: NULL child");
  cr_assert_eq(dp_future_then_with_ptrs(NULL, never_called_with_ptrs, NULL, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_then_with_ptrs: NULL future");
  cr_assert_eq(dp_future_then_with_ptrs(f, never_called_with_ptrs, NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_then_with_ptrs: NULL child");
  cr_assert_null(c, "nothing is written to child on a refusal");
  cr_assert_eq(dp_future_collect_all(&f, 1, NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_collect_all: NULL out");
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  cr_assert_eq(dp_future_ptr(f, 0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_future_ptr: NULL out");
  cr_assert_not(dp_future_is_done(NULL));
  dp_future_release(f);
  dp_ptrset_free(ps);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: a wait makes this thread's current stream on each device of
 * the value record that device's allocations, on every device (a value on
 * two devices beside cpu memory: both are recorded, each on its own). */
typedef struct {
  int n;
  void *ptr[8];
  dp_stream_t *on[8];
} records_t;
static int log_record(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  records_t *r = ctx;
  (void)err;
  if (r->n < 8) {
    r->ptr[r->n] = ptr;
    r->on[r->n] = s;
  }
  r->n++;
  return 0;
}

Test(future, a_wait_records_the_allocations_of_every_device_on_that_devices_current_stream) {
  records_t r = {0};
  dp_cache_hooks_t hooks = {&r, log_record, NULL, NULL};
  dp_future_t *f;
  OK(dp_future_new(&(dp_future_opts_t){B, NULL, 0, &hooks, 0, 1}, &f, T_ERR)); /* consumers only */
  dp_value_t l;
  OK(dp_list_new(3, &l, T_ERR));
  OK(dp_list_append(l, t_tensor(H0, 0x1000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CPU, 0), 0x3000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(H1, 0x2000, 4), T_ERR));
  OK(dp_future_mark_completed(f, l, T_ERR));
  cr_assert_eq(r.n, 0, "consumers only: the completion records nothing");
  dp_stream_t *s0, *s1;
  OK(dp_stream_new(B, H0, &s0, T_ERR));
  OK(dp_stream_new(B, H1, &s1, T_ERR));
  OK(dp_set_current_stream(s0, NULL, T_ERR));
  OK(dp_set_current_stream(s1, NULL, T_ERR));
  OK(dp_future_wait(f, -1, T_ERR));
  dp_reset_current_stream(B, H0);
  dp_reset_current_stream(B, H1);
  cr_assert_eq(r.n, 2, "one record a device's allocation, cpu's none: %d", r.n);
  for (int i = 0; i < 2; i++) {
    int on1 = r.ptr[i] == (void *)0x2000;
    cr_assert(on1 || r.ptr[i] == (void *)0x1000, "record %d: %p", i, r.ptr[i]);
    cr_assert_eq(r.on[i], on1 ? s1 : s0, "record %d: on the current stream of its device", i);
  }
  cr_assert_neq(r.ptr[0], r.ptr[1], "each device's allocation is recorded");
  dp_future_release(f);
  dp_stream_free(s0);
  dp_stream_free(s1);
}

/* More devices than a collect_all or a then() callback keeps room for
 * inline (16): the aggregate joins each device's events on a stream of
 * that device, the callback gets a pool stream on each, and what was
 * allocated for them goes back. */
Test(future, a_collect_all_and_a_callback_over_more_devices_than_fit_inline_join_each_and_leak_nothing) {
  dp_shutdown();
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  dp_future_t *in[20], *all, *c;
  for (int i = 0; i < 20; i++) {
    in[i] = future();
    OK(dp_future_mark_completed(in[i], t_tensor(t_dev(DP_DEVICE_HOST, i), 0x1000 * (uintptr_t)(i + 1), 4), T_ERR));
  }
  OK(dp_future_collect_all(in, 20, NULL, &all, T_ERR));
  OK(dp_future_wait(all, -1, T_ERR));
  cr_assert_eq(dp_future_ndevices(all), 20, "one event a device");
  for (size_t i = 0; i < 20; i++) {
    dp_device_t d = dp_future_device(all, i);
    char one[16];
    cr_assert(d.type == DP_DEVICE_HOST && d.index == (int)i, "device %zu: %s", i, dp_device_format(d, one, sizeof one));
  }
  many_t m = {20, 0};
  OK(dp_future_then(all, count_default_streams, &m, &c, T_ERR));
  OK(dp_future_wait(c, -1, T_ERR));
  cr_assert_eq(m.on_default, 0, "every device had a pool stream current in the callback");
  cr_assert_eq(dp_future_ndevices(c), 20);
  dp_future_release(c);
  dp_future_release(all);
  for (int i = 0; i < 20; i++) dp_future_release(in[i]);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: once f is complete, a wait hands back the error of the current
 * stream it would join f's events on (here the device's default stream,
 * made on first use, that cannot have its memory), and f keeps its value. */
Test(future, a_wait_whose_current_stream_cannot_be_made_fails_with_that_error_and_the_future_keeps_its_value) {
  dp_shutdown();
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  dp_future_t *f = future();
  dp_stream_t *s;
  OK(dp_stream_new(B, H0, &s, T_ERR));
  OK(dp_set_current_stream(s, NULL, T_ERR)); /* the completion's: H0's default stream is not made */
  OK(dp_future_mark_completed(f, t_tensor(H0, 0x1000, 4), T_ERR));
  dp_reset_current_stream(B, H0);
  dp_error_t e;
  t_fail_at = atomic_load(&t_alloc_count) + 1;
  int rc = dp_future_wait(f, -1, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s: %s", dp_err_name(rc), e.message);
  cr_assert_eq(e.code, DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_stream_default(host:0): out of memory creating a stream");
  cr_assert(dp_future_is_done(f) && dp_future_error(f, NULL) == 0, "f stays complete with its value");
  cr_assert_eq(dp_future_nptrs(f), 1);
  OK(dp_future_wait(f, -1, T_ERR)); /* the next wait makes the stream */
  dp_future_release(f);
  dp_stream_free(s);
}

/* future.h: a future completed with pointers runs its callbacks as any
 * completion does: its then() children complete, in their order. */
Test(future, callbacks_chained_on_a_future_completed_with_pointers_run_when_it_completes) {
  dp_future_t *f = future(), *c1, *c2;
  _Atomic int calls = 0;
  OK(dp_future_then(f, counting_cb, &calls, &c1, T_ERR));
  OK(dp_future_then(f, counting_cb, &calls, &c2, T_ERR));
  dp_ptrset_t *ps;
  OK(dp_ptrset_new(&ps, T_ERR));
  OK(dp_future_mark_completed_with_ptrs(f, dp_int(1), ps, T_ERR));
  cr_assert_eq(atomic_load(&calls), 2, "both callbacks ran before the completion returned");
  OK(dp_future_wait(c1, 0, T_ERR));
  OK(dp_future_wait(c2, 0, T_ERR));
  cr_assert_eq(dp_value_as_int(dp_future_value(c2)), 5);
  dp_future_release(c1);
  dp_future_release(c2);
  dp_future_release(f);
  dp_ptrset_free(ps);
}

/* future.h: a collect_all over no futures is complete at once, with [] or,
 * out of memory, failed with DP_ENOMEM: never pending, whichever allocation
 * fails. */
Test(future, a_collect_all_over_no_futures_is_complete_at_once_whichever_allocation_fails) {
  for (long k = 1;; k++) {
    cr_assert_lt(k, 100, "the call never ran without a failed allocation");
    dp_future_t *all = NULL;
    dp_error_t e;
    long want = t_fail_at = atomic_load(&t_alloc_count) + k;
    int rc = dp_future_collect_all(NULL, 0, NULL, &all, &e);
    int hit = atomic_load(&t_alloc_count) >= want;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      cr_assert_null(all);
      continue;
    }
    cr_assert(dp_future_is_done(all), "allocation %ld failed: the future is complete", k);
    rc = dp_future_wait(all, 0, &e);
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      cr_assert(e.message[0]);
    } else {
      dp_value_t v = dp_future_value(all);
      cr_assert_eq(dp_value_kind(v), DP_LIST, "allocation %ld failed: a %s", k, dp_kind_name(dp_value_kind(v)));
      cr_assert_eq(dp_seq_len(v), 0);
    }
    dp_future_release(all);
    if (!hit) break;
  }
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: callbacks run depth first. Here f's callbacks are a and b; a
 * completes g (whose callback c runs as a returns, before b) and drops the
 * last reference to a pending p, whose then() child fails, and z, chained
 * with pointers on that child, runs after what was queued before it. */
static dp_future_t *dq_g, *dq_p;
static int completes_g_and_drops_p(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result;
  cb_order[cb_norder++] = 'a';
  dp_future_release(dq_p);
  return dp_future_mark_completed(dq_g, dp_int(2), err);
}
static int note_ptrs_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)parent, (void)result, (void)ptrs, (void)err;
  cb_order[cb_norder++] = *(const char *)ud;
  return 0;
}

Test(future, a_canceled_childs_callback_runs_after_those_queued_before_it_and_none_is_lost) {
  for (int with_b = 1; with_b >= 0; with_b--) { /* without b: the level a ran from is empty */
    dp_future_t *f = future(), *a, *b = NULL, *c, *pc, *z;
    dq_g = future();
    dq_p = future();
    cb_norder = 0;
    OK(dp_future_then(f, completes_g_and_drops_p, NULL, &a, T_ERR));
    if (with_b) OK(dp_future_then(f, note_cb, "b", &b, T_ERR));
    OK(dp_future_then(dq_g, note_cb, "c", &c, T_ERR));
    OK(dp_future_then(dq_p, note_cb, "p", &pc, T_ERR));
    OK(dp_future_then_with_ptrs(pc, note_ptrs_cb, "z", &z, T_ERR));
    OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
    size_t n = with_b ? 4 : 3;
    cr_assert_eq(cb_norder, n, "%zu callbacks ran", cb_norder);
    cr_assert_arr_eq(cb_order, with_b ? "acbz" : "acz", n, "%.*s", (int)n, cb_order);
    dp_error_t e;
    cr_assert_eq(dp_future_wait(pc, 0, &e), DP_ECANCELED);
    cr_assert_str_eq(e.message, "the parent future was released before it completed");
    if (with_b) OK(dp_future_wait(b, 0, T_ERR));
    dp_future_t *all[] = {f, a, b, c, pc, z, dq_g};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
  }
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: a then() callback whose streams cannot be set up is not called
 * and its child fails with why; on more devices than fit inline the saved
 * streams need memory too: DP_ENOMEM, whichever allocation fails. */
Test(future, a_callback_over_more_devices_than_fit_inline_out_of_memory_fails_its_child_with_enomem) {
  dp_shutdown();
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  dp_value_t l;
  OK(dp_list_new(20, &l, T_ERR));
  for (int i = 0; i < 20; i++) OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_HOST, i), 0x1000 * (uintptr_t)(i + 1), 4), T_ERR));
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, l, T_ERR));
  int saw_callback_oom = 0;
  for (long k = 1;; k++) {
    cr_assert_lt(k, 1000, "the call never ran without a failed allocation");
    many_t m = {20, 0};
    dp_future_t *c = NULL;
    dp_error_t e;
    long want = t_fail_at = atomic_load(&t_alloc_count) + k;
    int rc = dp_future_then(f, count_default_streams, &m, &c, &e); /* f is complete: runs at once */
    int hit = atomic_load(&t_alloc_count) >= want;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      continue;
    }
    rc = dp_future_wait(c, 0, &e);
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      saw_callback_oom |= strcmp(e.message, "out of memory running a callback") == 0;
    }
    dp_future_release(c);
    if (!hit) break;
  }
  cr_assert(saw_callback_oom, "one failed allocation was that of the callback's saved streams");
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: a wait with a limit returns when the future completes, not when
 * the limit is spent (an hour here: a wait that sat out its limit would
 * run past the test's). */
Test(future, a_wait_with_a_long_limit_returns_once_another_thread_completes_the_future, .timeout = 60) {
  dp_future_t *f = future();
  pthread_t th;
  pthread_create(&th, NULL, complete_later, f);
  OK(dp_future_wait(f, 3600ll * 1000000000ll, T_ERR));
  cr_assert_eq(dp_value_as_int(dp_future_value(f)), 4);
  pthread_join(th, NULL);
  dp_future_release(f);
}

/* future.h: waiters on a then() child wake with DP_ECANCELED when its
 * pending parent goes, also when that happens on the waiting thread while
 * the wait looks at what the child waits for (from a then_with_ptrs
 * callback, whose thread's scratch set is taken: the look makes a set of
 * its own, and the allocator drops the parent then). The queued free runs
 * before the wait blocks. */
static dp_future_t *drop_in_alloc;
static void *drop_on_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  dp_future_t *f = drop_in_alloc;
  if (f && nsize) {
    drop_in_alloc = NULL;
    dp_future_release(f); /* on a trampoline: only queued */
  }
  return t_alloc(ud, ptr, osize, nsize);
}
static int waits_while_the_parent_goes(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs,
                                       dp_error_t *err) {
  (void)parent, (void)result, (void)ptrs, (void)err;
  dp_future_t **pc = ud; /* the parent to drop, and its child */
  drop_in_alloc = pc[0];
  dp_set_allocator(drop_on_alloc, NULL);
  dp_error_t e;
  int rc = dp_future_wait(pc[1], 5ll * 1000000000ll, &e);
  dp_set_allocator(t_alloc, NULL);
  cr_assert_null(drop_in_alloc, "the wait allocated");
  cr_assert_eq(rc, DP_ECANCELED, "%s: %s", dp_err_name(rc), e.message);
  cr_assert_str_eq(e.message, "the parent future was released before it completed");
  return 0;
}

Test(future, a_wait_wakes_canceled_when_the_parent_goes_on_its_own_thread_while_it_follows_the_links, .timeout = 60) {
  dp_future_t *f = future(), *cb_child, *pc[2];
  pc[0] = future();
  OK(dp_future_then(pc[0], counting_cb, &(_Atomic int){0}, &pc[1], T_ERR));
  OK(dp_future_then_with_ptrs(f, waits_while_the_parent_goes, pc, &cb_child, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  OK(dp_future_wait(cb_child, 0, T_ERR));
  dp_future_release(pc[1]);
  dp_future_release(cb_child);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: a callback whose wait ran other callbacks is still the one
 * running: what it completes afterwards is queued on its level, in front
 * of its future's later callbacks (depth first), and a wait on its own
 * child is DP_EMISUSE. */
static dp_future_t *wr_g, *wr_gc, *wr_h;
static dp_future_t *wr_own_child;
static int waits_then_completes(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result;
  cb_order[cb_norder++] = 'a';
  OK(dp_future_mark_completed(wr_g, dp_int(1), T_ERR)); /* g's callback is queued here */
  OK(dp_future_wait(wr_g, 0, T_ERR)); /* runs it, and nothing else (b stays queued) */
  OK(dp_future_mark_completed(wr_h, dp_int(2), T_ERR));
  /* a wait on a pending future runs every queued callback first: h's, then b's */
  dp_error_t e;
  int rc = dp_future_wait(wr_own_child, 0, &e);
  cr_assert_eq(rc, DP_EMISUSE, "%s: %s", dp_err_name(rc), e.message);
  cr_assert_str_eq(e.message, "dp_future_wait: called from the then() callback whose result completes the future: it "
                              "would wait for itself");
  (void)err;
  return 0;
}

Test(future, a_callback_that_ran_others_in_a_wait_still_runs_depth_first_and_may_not_wait_on_its_child) {
  dp_future_t *f = future(), *b, *hc;
  wr_g = future();
  wr_h = future();
  cb_norder = 0;
  OK(dp_future_then(f, waits_then_completes, NULL, &wr_own_child, T_ERR));
  OK(dp_future_then(f, note_cb, "b", &b, T_ERR));
  OK(dp_future_then(wr_g, note_cb, "g", &wr_gc, T_ERR));
  OK(dp_future_then(wr_h, note_cb, "h", &hc, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  cr_assert_eq(cb_norder, 4, "%zu callbacks ran", cb_norder);
  cr_assert_arr_eq(cb_order, "aghb", 4, "%.4s", cb_order);
  OK(dp_future_wait(wr_own_child, 0, T_ERR));
  dp_future_t *all[] = {f, b, hc, wr_g, wr_gc, wr_h, wr_own_child};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: a wait in a callback on a complete future it did not complete
 * runs nothing: the callbacks the running one queued for another future
 * run as it returns. */
static dp_future_t *wn_done, *wn_g;
static int completes_g_then_waits_on_another(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  cb_order[cb_norder++] = 'a';
  OK(dp_future_mark_completed(wn_g, dp_int(1), T_ERR));
  OK(dp_future_wait(wn_done, 0, T_ERR));
  cr_assert_eq(cb_norder, 1, "the wait on a complete future ran %.*s", (int)cb_norder, cb_order);
  return 0;
}

Test(future, a_wait_in_a_callback_on_an_unrelated_complete_future_runs_no_queued_callback) {
  dp_future_t *f = future(), *a, *gc;
  wn_done = future();
  wn_g = future();
  OK(dp_future_mark_completed(wn_done, dp_int(0), T_ERR));
  cb_norder = 0;
  OK(dp_future_then(f, completes_g_then_waits_on_another, NULL, &a, T_ERR));
  OK(dp_future_then(wn_g, note_cb, "g", &gc, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  cr_assert_eq(cb_norder, 2);
  cr_assert_arr_eq(cb_order, "ag", 2);
  dp_future_t *all[] = {f, a, gc, wn_done, wn_g};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
}

/* future.h: from a then() callback, a wait's limit counts from once the
 * callbacks queued on the thread that it runs first have run — a 1 ms
 * limit waited the 300 ms of a callback queued behind the waiting one,
 * which the header did not say ("until f completes or timeout_ns
 * passes"). Outside callbacks the limit holds. */
static dp_future_t *lim_g;
static double lim_waited_ms;
static int lim_rc;

static double mono_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int waits_1ms_on_pending(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  double t0 = mono_ms();
  lim_rc = dp_future_wait(lim_g, 1000000, NULL);
  lim_waited_ms = mono_ms() - t0;
  return 0;
}

static int sleeps_300ms(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  struct timespec ts = {0, 300 * 1000000};
  nanosleep(&ts, NULL);
  return 0;
}

Test(future, a_waits_limit_in_a_callback_counts_from_after_the_queued_callbacks_it_runs) {
  dp_future_t *f = future(), *a, *b;
  lim_g = future();
  OK(dp_future_then(f, waits_1ms_on_pending, NULL, &a, T_ERR));
  OK(dp_future_then(f, sleeps_300ms, NULL, &b, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  cr_assert_eq(lim_rc, DP_ETIMEDOUT);
  cr_assert(lim_waited_ms >= 300, "the wait ran the queued callback first: %.1f ms", lim_waited_ms);
  /* control: the same wait outside a callback keeps to its limit */
  double t0 = mono_ms();
  cr_assert_eq(dp_future_wait(lim_g, 1000000, NULL), DP_ETIMEDOUT);
  double ms = mono_ms() - t0;
  cr_assert(ms >= 1 && ms < 250, "outside callbacks: %.1f ms", ms); /* room for a loaded machine, below 300 */
  dp_future_t *all[] = {f, a, b, lim_g};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
}

/* future.h: a completion that fails completes the future with that error;
 * without an err record to copy it into (err NULL), it is still the
 * future's, message and all. */
Test(future, a_failed_completion_without_an_err_record_still_fails_the_future_with_its_message) {
  dp_future_t *f[4];
  for (int i = 0; i < 4; i++) f[i] = future();
  dp_value_t opaque;
  OK(dp_custom_new(&opaque_type, NULL, &opaque, T_ERR));
  dp_device_t only0 = H0;
  dp_future_t *narrow;
  OK(dp_future_new(&(dp_future_opts_t){B, &only0, 1, NULL, 0, 0}, &narrow, T_ERR));
  cr_assert_eq(dp_future_mark_completed_with_ptrs(f[0], dp_int(1), NULL, NULL), DP_EINVAL);
  cr_assert_eq(dp_future_set_error(f[1], NULL, NULL), DP_EINVAL);
  cr_assert_eq(dp_future_mark_completed(f[2], opaque, NULL), DP_ETYPE);
  cr_assert_eq(dp_future_mark_completed(narrow, t_tensor(H1, 0x1000, 4), NULL), DP_EDEVICE);
  const char *why[] = {"dp_future_mark_completed_with_ptrs: NULL ptrs", "dp_future_set_error: NULL error"};
  for (int i = 0; i < 2; i++) {
    dp_error_t e;
    cr_assert_eq(dp_future_wait(f[i], 0, &e), DP_EINVAL);
    cr_assert_str_eq(e.message, why[i]);
  }
  dp_error_t e;
  cr_assert_eq(dp_future_wait(f[2], 0, &e), DP_ETYPE);
  cr_assert(strstr(e.message, "Opaque"), "%s", e.message);
  cr_assert_eq(dp_future_wait(narrow, 0, &e), DP_EDEVICE);
  cr_assert(strstr(e.message, "the value uses host:1"), "%s", e.message);
  for (int i = 0; i < 4; i++) dp_future_release(f[i]);
  dp_future_release(narrow);
}

/* A reduce() may complete futures: the walk that runs it holds the
 * thread's scratch set, and the completions inside take sets of their own.
 * One that cannot have its set (out of memory) hands back none: the walk's
 * set stays the walk's, and a completion after it in the same reduce() does
 * not take it (the outer future lists what its value holds). */
typedef struct in_reduce {
  int how;       /* 0: a completion inside fails; 1: a then_with_ptrs callback inside cannot run */
  long k;        /* the allocation that fails, counted from the first inside */
  dp_future_t *h; /* completed after, with a tensor on host:1 */
  dp_value_t b;   /* the state's tensor */
} in_reduce_t;
static in_reduce_t nested_now;
static int ptrs_cb_noop(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)ptrs, (void)err;
  return 0;
}
static int reduce_completing(void *obj, dp_value_t *state, dp_error_t *err) {
  (void)obj;
  in_reduce_t *n = &nested_now;
  dp_future_t *g = future(), *child = NULL;
  if (n->how == 1) OK(dp_future_mark_completed(g, dp_int(1), T_ERR));
  t_fail_at = atomic_load(&t_alloc_count) + n->k;
  if (n->how == 0) dp_future_mark_completed(g, dp_int(1), NULL);
  else if (dp_future_then_with_ptrs(g, ptrs_cb_noop, NULL, &child, NULL) == 0) dp_future_release(child);
  t_fail_at = 0;
  dp_future_release(g);
  OK(dp_future_mark_completed(n->h, t_tensor(H1, 0x9000, 4), T_ERR));
  int rc = dp_tuple_new(1, state, err);
  return rc ? rc : dp_seq_set(*state, 0, dp_value_retain(n->b), err);
}
static const dp_type_t completing_type = {"Completing", reduce_completing, NULL};

Test(future, a_completion_inside_a_reduce_that_runs_out_of_memory_leaves_the_walks_set_to_the_walk) {
  for (int how = 0; how < 2; how++)
    for (long k = 1; k <= 8; k++) {
      nested_now = (in_reduce_t){how, k, future(), t_tensor(H0, 0x2000, 4)};
      dp_value_t l = t_list(), x;
      OK(dp_list_append(l, t_tensor(H0, 0x1000, 4), T_ERR));
      OK(dp_custom_new(&completing_type, NULL, &x, T_ERR));
      OK(dp_list_append(l, x, T_ERR));
      dp_future_t *f = future();
      OK(dp_future_mark_completed(f, l, T_ERR));
      cr_assert_eq(dp_future_nptrs(f), 2, "how %d, allocation %ld: the outer value's two allocations", how, k);
      dp_ptr_info_t p;
      OK(dp_future_ptr(f, 0, &p, T_ERR));
      cr_assert_eq(p.base, (void *)0x1000, "how %d, allocation %ld", how, k);
      OK(dp_future_ptr(f, 1, &p, T_ERR));
      cr_assert_eq(p.base, (void *)0x2000, "how %d, allocation %ld", how, k);
      cr_assert_eq(dp_future_nptrs(nested_now.h), 1);
      dp_future_release(f);
      dp_future_release(nested_now.h);
      dp_value_release(nested_now.b);
    }
}

/* future.h: a wait in a callback on a future it completed returns once
 * every callback it queued for that future ran, not only the first. */
static dp_future_t *wt_g;
static int completes_g_and_waits(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  cb_order[cb_norder++] = 'a';
  OK(dp_future_mark_completed(wt_g, dp_int(1), T_ERR));
  OK(dp_future_wait(wt_g, -1, T_ERR));
  cr_assert_eq(cb_norder, 3, "g's callbacks that ran in the wait: %.*s", (int)cb_norder - 1, cb_order + 1);
  return 0;
}

Test(future, a_callback_waiting_on_a_future_it_completed_returns_after_all_that_futures_callbacks) {
  dp_future_t *f = future(), *a, *g1, *g2;
  wt_g = future();
  cb_norder = 0;
  OK(dp_future_then(f, completes_g_and_waits, NULL, &a, T_ERR));
  OK(dp_future_then(wt_g, note_cb, "1", &g1, T_ERR));
  OK(dp_future_then(wt_g, note_cb, "2", &g2, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  cr_assert_eq(cb_norder, 3);
  cr_assert_arr_eq(cb_order, "a12", 3);
  dp_future_t *all[] = {f, a, g1, g2, wt_g};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
}

/* future.h: an allocation's refs in a collect_all is the sum over its
 * distinct inputs: over one input, that input's. */
Test(future, a_collect_all_over_one_input_counts_its_allocations_refs_once) {
  dp_future_t *f = future(), *all;
  OK(dp_future_mark_completed(f, t_tensor(H0, 0x1000, 4), T_ERR));
  OK(dp_future_collect_all(&f, 1, NULL, &all, T_ERR));
  OK(dp_future_wait(all, 0, T_ERR));
  cr_assert_eq(dp_future_nptrs(all), 1);
  dp_ptr_info_t p;
  OK(dp_future_ptr(all, 0, &p, T_ERR));
  cr_assert_eq(p.refs, 1, "one tensor counted %u times", p.refs);
  dp_future_release(all);
  dp_future_release(f);
}

/* future.h: completing a complete future is DP_ESTATE and leaves it as it
 * was: with pointers it accepts, the record made for them (events, the
 * allocations' block) goes too. */
Test(future, completing_a_complete_future_with_pointers_is_estate_and_keeps_nothing_it_made) {
  dp_future_t *f = future();
  OK(dp_future_mark_completed(f, dp_int(1), T_ERR));
  dp_ptrset_t *ps;
  OK(dp_ptrset_new(&ps, T_ERR));
  OK(dp_ptrset_add(ps, H0, (void *)0x1000, 16, NULL, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_mark_completed_with_ptrs(f, dp_int(2), ps, &e), DP_ESTATE);
  cr_assert_str_eq(e.message, "dp_future_mark_completed_with_ptrs: the future is already complete");
  cr_assert_eq(dp_value_as_int(dp_future_value(f)), 1);
  cr_assert_eq(dp_future_ndevices(f), 0);
  dp_ptrset_free(ps);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A collect_all input released pending goes from the aggregate's links
 * before its memory does: a wait in a callback that follows them later
 * (the aggregate still pending on another input) reads no freed future. */
static dp_future_t *lk_all;
static int waits_on_the_aggregate(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  dp_error_t e;
  int rc = dp_future_wait(lk_all, 0, &e);
  cr_assert_eq(rc, DP_ETIMEDOUT, "%s: %s", dp_err_name(rc), e.message);
  return 0;
}

Test(future, a_wait_in_a_callback_follows_a_collect_alls_links_past_an_input_released_pending) {
  dp_future_t *in[2] = {future(), future()}, *r = future(), *rc;
  OK(dp_future_collect_all(in, 2, NULL, &lk_all, T_ERR));
  dp_future_release(in[0]); /* released pending: the aggregate will fail naming it */
  OK(dp_future_then(r, waits_on_the_aggregate, NULL, &rc, T_ERR));
  OK(dp_future_mark_completed(r, dp_int(1), T_ERR));
  OK(dp_future_wait(rc, 0, T_ERR));
  OK(dp_future_mark_completed(in[1], dp_int(2), T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_future_wait(lk_all, 0, &e), DP_ECANCELED);
  cr_assert_str_eq(e.message, "input 0 of collect_all was released before it completed");
  dp_future_t *all[] = {in[1], r, rc, lk_all};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* collect_all over more devices than fit inline allocates its streams: out
 * of memory there fails the aggregate with DP_ENOMEM, as everywhere. */
Test(future, a_collect_all_over_more_devices_than_fit_inline_out_of_memory_fails_with_enomem) {
  dp_shutdown();
  setenv("DEVPICKLE_HOST_DEVICES", "20", 1);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  dp_future_t *in[20];
  for (int i = 0; i < 20; i++) {
    in[i] = future();
    OK(dp_future_mark_completed(in[i], t_tensor(t_dev(DP_DEVICE_HOST, i), 0x1000 * (uintptr_t)(i + 1), 4), T_ERR));
  }
  int saw_streams_oom = 0;
  for (long k = 1;; k++) {
    cr_assert_lt(k, 1000, "the call never ran without a failed allocation");
    dp_future_t *all = NULL;
    dp_error_t e;
    long want = t_fail_at = atomic_load(&t_alloc_count) + k;
    int rc = dp_future_collect_all(in, 20, NULL, &all, &e); /* the inputs are complete: it completes here */
    int hit = atomic_load(&t_alloc_count) >= want;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      continue;
    }
    rc = dp_future_wait(all, 0, &e);
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      saw_streams_oom |= strcmp(e.message, "out of memory collecting futures") == 0;
    } else {
      cr_assert_eq(dp_future_ndevices(all), 20);
    }
    dp_future_release(all);
    if (!hit) break;
  }
  cr_assert(saw_streams_oom, "one failed allocation was that of the aggregate's streams");
  for (int i = 0; i < 20; i++) dp_future_release(in[i]);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* future.h: releases in a callback are freed once it returns, each: two
 * pending futures whose last references a callback drops both cancel
 * their children. */
static int drops_two(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)parent, (void)result, (void)err;
  dp_future_t **two = ud;
  dp_future_release(two[0]);
  dp_future_release(two[1]);
  return 0;
}

Test(future, a_callback_that_drops_two_pending_futures_cancels_the_children_of_each) {
  dp_future_t *f = future(), *a, *two[2] = {future(), future()}, *c[2];
  for (int i = 0; i < 2; i++) OK(dp_future_then(two[i], note_cb, "x", &c[i], T_ERR));
  OK(dp_future_then(f, drops_two, two, &a, T_ERR));
  OK(dp_future_mark_completed(f, dp_int(0), T_ERR));
  for (int i = 0; i < 2; i++) {
    dp_error_t e;
    cr_assert_eq(dp_future_wait(c[i], 0, &e), DP_ECANCELED, "child %d: %s", i, e.message);
    cr_assert_str_eq(e.message, "the parent future was released before it completed");
    dp_future_release(c[i]);
  }
  dp_future_release(a);
  dp_future_release(f);
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* A wait from a callback follows a pending future's links and stops at a
 * complete one, whatever links that one had while it was pending (a then()
 * child's parent: dropped at its completion). */
static dp_future_t *st_agg;
static int waits_on_st_agg(void *ud, dp_future_t *parent, dp_value_t *result, dp_error_t *err) {
  (void)ud, (void)parent, (void)result, (void)err;
  dp_error_t e;
  int rc = dp_future_wait(st_agg, 0, &e);
  cr_assert_eq(rc, DP_ETIMEDOUT, "%s: %s", dp_err_name(rc), e.message);
  return 0;
}

Test(future, a_wait_in_a_callback_stops_following_links_at_a_complete_then_child) {
  dp_future_t *p = future(), *done_child, *q = future(), *r = future(), *rc;
  OK(dp_future_then(p, note_cb, "p", &done_child, T_ERR));
  cb_norder = 0;
  OK(dp_future_mark_completed(p, dp_int(1), T_ERR)); /* done_child completes */
  dp_future_t *in[2] = {done_child, q};
  OK(dp_future_collect_all(in, 2, NULL, &st_agg, T_ERR));
  OK(dp_future_then(r, waits_on_st_agg, NULL, &rc, T_ERR));
  OK(dp_future_mark_completed(r, dp_int(2), T_ERR));
  OK(dp_future_wait(rc, 0, T_ERR));
  OK(dp_future_mark_completed(q, dp_int(3), T_ERR));
  OK(dp_future_wait(st_agg, 0, T_ERR));
  dp_future_t *all[] = {p, done_child, q, r, rc, st_agg};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) dp_future_release(all[i]);
}

/* dp_future_new out of memory, for the list of devices too: DP_ENOMEM. */
Test(future, a_future_with_devices_that_cannot_have_its_memory_is_enomem) {
  dp_device_t devs[2] = {H0, H1};
  dp_future_release(future()); /* the default cache is made: its own failures say so */
  for (long k = 1;; k++) {
    cr_assert_lt(k, 100, "the call never ran without a failed allocation");
    dp_future_t *f = NULL;
    dp_error_t e;
    long want = t_fail_at = atomic_load(&t_alloc_count) + k;
    int rc = dp_future_new(&(dp_future_opts_t){B, devs, 2, NULL, 0, 0}, &f, &e);
    int hit = atomic_load(&t_alloc_count) >= want;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      cr_assert_str_eq(e.message, "dp_future_new: out of memory creating a future");
      continue;
    }
    dp_future_release(f);
    if (!hit) break;
  }
  dp_shutdown();
  ASSERT_NO_LEAK();
}
