/* The caching allocator on the host backend: size classes, split and merge,
 * stream-ordered reuse, record_stream (with its negative control), stats,
 * OOM, interior lookups, threads. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "../device/internal.h" /* a stream of another backend, made up (no GPU here) */
#include "../cache/internal.h"  /* dp__cache_check */

static dp_backend_t *B;
static dp_cache_t *C;
#define H0 t_dev(DP_DEVICE_HOST, 0)
#define H1 t_dev(DP_DEVICE_HOST, 1)

static void setup(void) {
  unsetenv("DEVPICKLE_HOST_DEVICES");
  t_track();
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  OK(dp_cache_new(B, &C, T_ERR));
}
/* Whatever a test did, the books agree and the cache, once freed, and the
 * backends leave nothing allocated. A failed assertion in a fini is no
 * failure to Criterion (the test passes and the run exits 0), but a crash
 * there makes the run exit non-zero: so a disagreement aborts. */
static void teardown(void) {
  const char *bad = C ? dp__cache_check(C) : NULL;
  if (bad) {
    fprintf(stderr, "the cache's books disagree: %s\n", bad);
    abort();
  }
  dp_cache_free(C);
  dp_shutdown();
  dp_set_allocator(NULL, NULL);
  if (atomic_load(&t_live_blocks) || atomic_load(&t_live_bytes)) {
    fprintf(stderr, "%ld blocks (%ld bytes) still live after the cache and the backends were freed\n",
            atomic_load(&t_live_blocks), atomic_load(&t_live_bytes));
    abort();
  }
}
TestSuite(allocator, .init = setup, .fini = teardown);


static dp_stream_t *stream(dp_device_t d) {
  dp_stream_t *s;
  OK(dp_stream_new(B, d, &s, T_ERR));
  return s;
}

static dp_cache_stats_t stats(dp_device_t d) {
  dp_cache_stats_t st;
  OK(dp_cache_stats(C, d, &st, T_ERR));
  return st;
}

Test(allocator, sizes_round_up_to_512_bytes_from_two_mebibyte_segments) {
  dp_stream_t *s = stream(H0);
  void *a, *b2, *c;
  OK(dp_cache_alloc(C, H0, 1, s, &a, T_ERR));
  OK(dp_cache_alloc(C, H0, 513, s, &b2, T_ERR));
  OK(dp_cache_alloc(C, H0, 3 << 20, s, &c, T_ERR));
  void *base;
  size_t size;
  OK(dp_cache_lookup(C, a, &base, &size, T_ERR));
  cr_assert_eq(size, 512);
  OK(dp_cache_lookup(C, b2, &base, &size, T_ERR));
  cr_assert_eq(size, 1024);
  cr_assert_eq((char *)b2, (char *)a + 512, "carved from the same segment, in order");
  OK(dp_cache_lookup(C, c, &base, &size, T_ERR));
  cr_assert_eq(size, 4 << 20, "a large block keeps a remainder of 1 MiB or less rather than split");
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.allocated, 512 + 1024 + (4 << 20));
  cr_assert_eq(st.reserved, (2 << 20) + (4 << 20), "one small segment, one large rounded to 2 MiB");
  cr_assert_eq(st.segment_allocs, 2);
  OK(dp_cache_dealloc(C, a, T_ERR));
  OK(dp_cache_dealloc(C, b2, T_ERR));
  OK(dp_cache_dealloc(C, c, T_ERR));
  cr_assert_eq(stats(H0).allocated, 0);
  dp_stream_free(s);
}

Test(allocator, small_and_large_requests_never_take_each_others_segments) {
  dp_stream_t *s = stream(H0);
  void *p, *q;
  OK(dp_cache_alloc(C, H0, (1u << 20) + 1, s, &p, T_ERR)); /* large: a 2 MiB segment of its own */
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).reserved, (size_t)2 << 20);
  OK(dp_cache_alloc(C, H0, 512, s, &q, T_ERR)); /* small: the free large segment is not its */
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.reserved, (size_t)4 << 20, "a small request gets a small segment: %zu reserved", st.reserved);
  cr_assert_eq(st.cache_hits, 0);
  OK(dp_cache_dealloc(C, q, T_ERR));
  OK(dp_cache_empty(C, T_ERR));
  OK(dp_cache_alloc(C, H0, 512, s, &q, T_ERR));
  OK(dp_cache_dealloc(C, q, T_ERR));
  OK(dp_cache_alloc(C, H0, (1u << 20) + 1, s, &p, T_ERR)); /* nor a large one the free small segment */
  cr_assert_eq(stats(H0).reserved, (size_t)4 << 20);
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);
}

Test(allocator, blocks_split_on_allocation_and_merge_when_freed) {
  dp_stream_t *s = stream(H0);
  char *p[3];
  for (int i = 0; i < 3; i++) OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p[i], T_ERR));
  cr_assert(p[1] == p[0] + 4096 && p[2] == p[1] + 4096);
  OK(dp_cache_dealloc(C, p[1], T_ERR));
  OK(dp_cache_dealloc(C, p[0], T_ERR));
  char *q;
  OK(dp_cache_alloc(C, H0, 8192, s, (void **)&q, T_ERR));
  cr_assert_eq(q, p[0], "the two freed neighbours merged into one 8 KiB block");
  OK(dp_cache_dealloc(C, q, T_ERR));
  OK(dp_cache_dealloc(C, p[2], T_ERR));
  char *whole;
  OK(dp_cache_alloc(C, H0, 1 << 20, s, (void **)&whole, T_ERR));
  cr_assert_eq(whole, p[0], "everything merged back");
  cr_assert_eq(stats(H0).segment_allocs, 1);
  OK(dp_cache_dealloc(C, whole, T_ERR));
  dp_stream_free(s);
}

Test(allocator, a_block_freed_on_a_stream_is_reusable_at_once_on_that_stream) {
  dp_stream_t *s = stream(H0);
  void *a, *b2;
  OK(dp_cache_alloc(C, H0, 4096, s, &a, T_ERR));
  uint64_t hits = stats(H0).cache_hits;
  OK(dp_cache_dealloc(C, a, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &b2, T_ERR));
  cr_assert_eq(a, b2);
  cr_assert_eq(stats(H0).cache_hits, hits + 1);
  cr_assert_eq(stats(H0).cross_stream, 0);
  OK(dp_cache_dealloc(C, b2, T_ERR));
  dp_stream_free(s);
}

/* ---- cross-stream reuse is ordered after the first stream's work ---- */

typedef struct slow_fill {
  unsigned char *p;
  int value;
  int ms;
  _Atomic int done;
} slow_fill_t;

static void slow_fill(void *arg) {
  slow_fill_t *f = arg;
  sleep_ms(f->ms);
  memset(f->p, f->value, 4096);
  atomic_store(&f->done, 1);
}

/* A check that must run after other work (a negative control's race, or
 * a block asserted still in use) is held at a gate (gate: NULL for none)
 * that the test opens once that work is done, rather than sleeping and
 * hoping the other thread got there in time: a loaded machine stalls a
 * thread past any fixed sleep. Bounded (10 s), so that a test that fails
 * with the gate shut ends. */
typedef struct check {
  unsigned char *p;
  int expect;
  int ms;
  _Atomic int ok;
  _Atomic int *gate;
} check_t;

static void slow_check(void *arg) {
  check_t *c = arg;
  for (int ms = 0; c->gate && ms < 10000 && !atomic_load(c->gate); ms++) sleep_ms(1);
  sleep_ms(c->ms);
  int ok = 1;
  for (int i = 0; i < 4096; i++) ok &= c->p[i] == c->expect;
  atomic_store(&c->ok, ok);
}

Test(allocator, another_stream_gets_a_freed_block_only_after_the_first_streams_work) {
  dp_stream_t *s = stream(H0), *t = stream(H0);
  unsigned char *a;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&a, T_ERR));
  slow_fill_t first = {a, 0x11, 60, 0};
  OK(dp_host_launch(s, slow_fill, &first, T_ERR));  /* s still writes a for 60 ms */
  OK(dp_cache_dealloc(C, a, T_ERR));
  unsigned char *b2;
  OK(dp_cache_alloc(C, H0, 4096, t, (void **)&b2, T_ERR));
  cr_assert_eq(b2, a, "the block moved to the other stream");
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.cross_stream, 1);
  cr_assert(st.cache_hits == 1 && st.segment_allocs == 1, "served without a backend malloc: a cache hit");
  check_t chk = {b2, 0x11, 0, 0, NULL};
  OK(dp_host_launch(t, slow_check, &chk, T_ERR));  /* t's first use must see s's write done */
  OK(dp_stream_synchronize(t, T_ERR));
  cr_assert(atomic_load(&first.done), "t's work ran after s's");
  cr_assert(atomic_load(&chk.ok));
  OK(dp_cache_dealloc(C, b2, T_ERR));
  dp_stream_free(s);
  dp_stream_free(t);
}

/* ---- record_stream: the race and its negative control ---- */

static int user_stream_sees_its_data(int record) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  unsigned char *p;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR));
  memset(p, 0xAA, 4096);
  _Atomic int open = 0;
  check_t chk = {p, 0xAA, 0, 0, &open};
  OK(dp_host_launch(u, slow_check, &chk, T_ERR));  /* u reads p once s's later work is done */
  if (record) OK(dp_cache_record_stream(C, p + 100, u, T_ERR));  /* an interior pointer will do */
  OK(dp_cache_dealloc(C, p, T_ERR));
  unsigned char *q;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&q, T_ERR));
  slow_fill_t overwrite = {q, 0x55, 0, 0};
  OK(dp_host_launch(s, slow_fill, &overwrite, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  atomic_store(&open, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  int reused_early = q == p;
  if (record) {
    cr_assert_not(reused_early, "a block in use on u must not be handed out while u's work is pending");
    cr_assert_eq(dp_cache_poll(C, NULL), 1, "once u is done, polling reclaims the block");
    cr_assert_eq(stats(H0).pending_blocks, 0);
  }
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(s);
  dp_stream_free(u);
  return atomic_load(&chk.ok);
}

Test(allocator, record_stream_keeps_a_block_from_reuse_until_the_user_stream_is_done) {
  cr_assert(user_stream_sees_its_data(1));
}

Test(allocator, negative_control_without_record_stream_the_block_is_reused_under_the_reader) {
  cr_assert_not(user_stream_sees_its_data(0), "without record_stream the reuse corrupts what u reads");
}

static void sleep_40(void *arg) {
  (void)arg;
  sleep_ms(40);
}

static void gate_wait(void *arg);

Test(allocator, pending_blocks_are_counted_and_come_back_by_polling_without_blocking) {
  dp_stream_t *s = stream(H0), *u = stream(H1);  /* a user stream on another device */
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  _Atomic int gate1 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate1, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));  /* twice is once */
  OK(dp_cache_record_stream(C, p, s, T_ERR));  /* its own stream: nothing to do */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  cr_assert_lt((t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6, 2000,
               "free and poll never block (u's work is held at its gate: a blocking call would never return)");
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.pending_blocks, 1);
  cr_assert_eq(st.pending_bytes, 4096);
  atomic_store(&gate1, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  void *other;  /* any allocation polls, whatever its size */
  OK(dp_cache_alloc(C, H0, 100000, s, &other, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  OK(dp_cache_dealloc(C, other, T_ERR));
  dp_stream_free(s);
  dp_stream_free(u);
}

Test(allocator, stats_track_allocated_reserved_peak_and_hits) {
  dp_stream_t *s = stream(H0);
  void *p[10];
  for (int i = 0; i < 10; i++) OK(dp_cache_alloc(C, H0, 10000, s, &p[i], T_ERR));
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.allocated, 10 * 10240);
  cr_assert_eq(st.peak_allocated, 10 * 10240);
  cr_assert_eq(st.allocs, 10);
  cr_assert_eq(st.segment_allocs, 1);
  cr_assert_eq(st.cache_hits, 9);
  for (int i = 0; i < 10; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  st = stats(H0);
  cr_assert_eq(st.allocated, 0);
  cr_assert_eq(st.peak_allocated, 10 * 10240);
  cr_assert_eq(st.frees, 10);
  cr_assert_eq(st.reserved, 2 << 20);
  OK(dp_cache_alloc(C, H0, 10000, s, &p[0], T_ERR));
  cr_assert_eq(stats(H0).peak_allocated, 10 * 10240, "an allocation below the peak leaves it");
  OK(dp_cache_dealloc(C, p[0], T_ERR));
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved, 0);
  cr_assert_eq(stats(H0).segment_frees, 1);
  cr_assert_eq(stats(H1).allocs, 0, "stats are per device");
  dp_stream_free(s);
}

Test(allocator, out_of_memory_frees_the_cache_retries_then_fails_clearly) {
  OK(dp_host_set_memory_limit(H1, 5u << 20, T_ERR));
  dp_stream_t *s = stream(H1);
  void *small[2], *big, *more;
  OK(dp_cache_alloc(C, H1, 1 << 20, s, &small[0], T_ERR));
  OK(dp_cache_alloc(C, H1, 1 << 20, s, &small[1], T_ERR));  /* fills one 2 MiB segment */
  OK(dp_cache_dealloc(C, small[0], T_ERR));
  OK(dp_cache_dealloc(C, small[1], T_ERR));
  cr_assert_eq(stats(H1).reserved, 2 << 20, "cached, not given back");
  OK(dp_cache_alloc(C, H1, 4 << 20, s, &big, T_ERR));  /* needs the cached 2 MiB back */
  dp_cache_stats_t st = stats(H1);
  cr_assert_eq(st.oom_retries, 1);
  cr_assert_eq(st.segment_frees, 1);
  cr_assert_eq(st.reserved, 4 << 20);
  dp_error_t e;
  cr_assert_eq(dp_cache_alloc(C, H1, 2 << 20, s, &more, &e), DP_ENOMEM);
  cr_assert(strstr(e.message, "dp_cache_alloc(host:1): out of memory allocating 2097152 bytes (4194304 allocated, 4194304 reserved") ==
                e.message, "%s", e.message);
  cr_assert_eq(dp_cache_alloc(C, H1, 2 << 20, s, &more, NULL), DP_ENOMEM, "told without an err too");
  OK(dp_cache_dealloc(C, big, T_ERR));
  dp_stream_free(s);
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
}

Test(allocator, interior_pointers_find_their_block) {
  dp_stream_t *s = stream(H0);
  char *p;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR));
  void *base;
  size_t size;
  OK(dp_cache_lookup(C, p + 4095, &base, &size, T_ERR));
  cr_assert(base == p && size == 4096);
  cr_assert_eq(dp_cache_lookup(C, p + 4096, &base, &size, NULL), DP_ENOTFOUND, "the free remainder is nobody's");
  int local;
  cr_assert_eq(dp_cache_lookup(C, &local, &base, &size, NULL), DP_ENOTFOUND);
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(dp_cache_lookup(C, p, &base, &size, NULL), DP_ENOTFOUND);
  dp_stream_free(s);
}

/* The segments are searched by address: an interior pointer is found in
 * whichever segment holds it, not only in the last one made or the
 * highest, and a pointer just past a block is not that block's. */
Test(allocator, interior_pointers_find_their_block_in_every_segment) {
  dp_stream_t *s = stream(H0);
  enum { N = 6 };
  char *p[N];
  size_t want[N];
  for (int i = 0; i < N; i++) { /* large blocks, each a segment of its own, and small ones */
    want[i] = i % 2 ? (size_t)4096 : (size_t)(i + 1) << 21; /* whole segments: nothing to round */
    OK(dp_cache_alloc(C, H0, want[i], s, (void **)&p[i], T_ERR));
  }
  cr_assert_eq(stats(H0).segment_allocs, N / 2 + 1);
  for (int i = 0; i < N; i++) {
    size_t at[] = {1, want[i] / 2, want[i] - 1};
    for (int k = 0; k < 3; k++) {
      void *base = NULL;
      size_t size = 0;
      OK(dp_cache_lookup(C, p[i] + at[k], &base, &size, T_ERR));
      cr_assert(base == p[i] && size == want[i], "block %d, byte %zu: %p (%zu bytes)", i, at[k], base, size);
    }
    dp_stream_t *u = stream(H0);
    OK(dp_cache_record_stream(C, p[i] + want[i] - 1, u, T_ERR));
    dp_stream_free(u);
  }
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  dp_stream_free(s);
}

Test(allocator, freeing_what_it_did_not_hand_out_is_an_error) {
  dp_stream_t *s = stream(H0);
  void *p;
  dp_error_t e;
  OK(dp_cache_alloc(C, H0, 64, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(dp_cache_dealloc(C, p, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "not allocated by this allocator, or already freed") != NULL, "%s", e.message);
  cr_assert_eq(dp_cache_record_stream(C, p, s, &e), DP_ENOTFOUND);
  dp_stream_t *d1;
  OK(dp_stream_default(B, H1, &d1, T_ERR));
  cr_assert_eq(dp_cache_alloc(C, H0, 64, d1, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_alloc(host:0): the stream is on host:1; it must be on the device allocated from");
  OK(dp_cache_dealloc(C, NULL, T_ERR));
  dp_stream_free(s);
}

Test(allocator, the_hooks_record_many_pointers_and_skip_foreign_ones) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p[3];
  for (int i = 0; i < 3; i++) OK(dp_cache_alloc(C, H0, 4096, s, &p[i], T_ERR));
  int foreign;
  void *ptrs[4] = {p[0], &foreign, p[1], p[2]};
  dp_cache_hooks_t h = dp_cache_hooks(C);
  OK(dp_cache_hooks_record(&h, ptrs, 4, u, T_ERR));
  h.record_streams = NULL;  /* the fallback path: one call per pointer */
  OK(dp_cache_hooks_record(&h, ptrs, 4, u, T_ERR));
  _Atomic int gate2 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate2, T_ERR));
  for (int i = 0; i < 3; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 3);
  atomic_store(&gate2, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), 3);
  dp_stream_free(s);
  dp_stream_free(u);
}

Test(allocator, a_destroyed_stream_leaves_no_dangling_block) {
  dp_stream_t *s = stream(H0), *t = stream(H0);
  void *p, *q;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);  /* its cached blocks now belong to no stream */
  OK(dp_cache_alloc(C, H0, 4096, t, &q, T_ERR));
  cr_assert_eq(q, p);
  cr_assert_eq(stats(H0).cross_stream, 0, "no wait needed: the stream's work completed when it was destroyed");
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(t);
}

/* Free blocks of all streams shared one set of bins: an allocation on one
 * stream walked past every free block of the others before it took one of
 * theirs (40,000 allocations on B with 40,000 blocks of A free: 7 s,
 * quadratic). Each stream's free blocks are a set of their own. */
Test(allocator, allocating_on_one_stream_never_walks_the_free_blocks_of_another) {
  enum { N = 40000 };
  dp_stream_t *a = stream(H0), *b = stream(H0);
  void **pa = malloc(N * sizeof *pa), **pb = malloc(N * sizeof *pb);
  cr_assert(pa && pb);
  for (int i = 0; i < N; i++) { /* interleaved: no two of A's blocks merge */
    OK(dp_cache_alloc(C, H0, 512, a, &pa[i], T_ERR));
    OK(dp_cache_alloc(C, H0, 512, b, &pb[i], T_ERR));
  }
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, pa[i], T_ERR));
  size_t cross0 = stats(H0).cross_stream; /* B took A's remainders meanwhile */
  struct timespec t0, t1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); /* this thread's CPU time: the machine's load does not count */
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 512, b, &pa[i], T_ERR)); /* each one of A's, after A's work */
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  double sec = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
  cr_assert_lt(sec, 2.0, "40,000 allocations on B took %.2f s of CPU", sec);
  size_t cross = stats(H0).cross_stream;
  cr_assert_eq(cross - cross0, N, "%zu of %d blocks came from A's set", cross - cross0, N);
  /* a block of B's own, freed, comes back before any other stream's */
  OK(dp_cache_dealloc(C, pa[7], T_ERR));
  void *q;
  OK(dp_cache_alloc(C, H0, 512, b, &q, T_ERR));
  cr_assert_eq(q, pa[7]);
  cr_assert_eq(stats(H0).cross_stream, cross);
  for (int i = 0; i < N; i++) {
    OK(dp_cache_dealloc(C, pa[i], T_ERR));
    OK(dp_cache_dealloc(C, pb[i], T_ERR));
  }
  dp_stream_free(a);
  dp_stream_free(b);
  free(pa);
  free(pb);
}

/* Each stream's set was found by a search of all the sets (past the one
 * found last): with a thousand streams allocating in turn, every free and
 * allocation passed over the sets of all of them, ten times the cost of the
 * same work on one stream. The sets are found through a table. Measured in
 * this thread's CPU time, against the same work on one stream. */
static double thread_cpu(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + t.tv_nsec / 1e9;
}

Test(allocator, many_streams_allocating_in_turn_cost_about_what_one_stream_does) {
  enum { N = 1024, R = 200 };
  dp_stream_t **s = malloc(N * sizeof *s);
  void **p = malloc(N * sizeof *p);
  cr_assert(s && p);
  for (int i = 0; i < N; i++) {
    s[i] = stream(H0);
    OK(dp_cache_alloc(C, H0, 512, s[i], &p[i], T_ERR)); /* a set each */
  }
  uint64_t cross = stats(H0).cross_stream; /* the first blocks came from one another's remainders */
  double best_ratio = 1e9;
  for (int attempt = 0; attempt < 3 && best_ratio >= 4; attempt++) { /* the best of three: a busy machine's noise */
    double t0 = thread_cpu();
    for (int r = 0; r < R; r++)
      for (int i = 0; i < N; i++) {
        OK(dp_cache_dealloc(C, p[0], T_ERR));
        OK(dp_cache_alloc(C, H0, 512, s[0], &p[0], T_ERR));
      }
    double one = thread_cpu() - t0;
    t0 = thread_cpu();
    for (int r = 0; r < R; r++)
      for (int i = 0; i < N; i++) {
        OK(dp_cache_dealloc(C, p[i], T_ERR));
        OK(dp_cache_alloc(C, H0, 512, s[i], &p[i], T_ERR));
      }
    double many = thread_cpu() - t0;
    if (many / one < best_ratio) best_ratio = many / one;
  }
  cr_assert_lt(best_ratio, 4.0, "%d streams in turn cost %.1f times one stream's work", N, best_ratio);
  cr_assert_eq(stats(H0).cross_stream, cross, "each stream took its own block back");
  for (int i = 0; i < N; i++) {
    OK(dp_cache_dealloc(C, p[i], T_ERR));
    dp_stream_free(s[i]);
  }
  free(s);
  free(p);
}

/* A stream's set goes with it: its free blocks are tied to no stream, found
 * by the next allocation on any stream without a wait, and merged with
 * their free neighbours. */
Test(allocator, a_destroyed_streams_free_blocks_merge_and_serve_any_stream) {
  dp_stream_t *a = stream(H0), *b = stream(H0);
  void *p[4];
  for (int i = 0; i < 4; i++) OK(dp_cache_alloc(C, H0, 512, a, &p[i], T_ERR));
  for (int i = 0; i < 4; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  dp_stream_free(a);
  void *q;
  OK(dp_cache_alloc(C, H0, 2048, b, &q, T_ERR)); /* the four, merged */
  cr_assert_eq(q, p[0]);
  cr_assert_eq(stats(H0).cross_stream, 0);
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(b);
}

typedef struct churn {
  dp_device_t dev;
  uint64_t seed;
} churn_t;

static void *churn(void *arg) {
  churn_t *c = arg;
  dp_stream_t *s;
  dp_stream_new(B, c->dev, &s, NULL);
  void *live[32] = {0};
  for (int i = 0; i < 20000; i++) {
    c->seed = c->seed * 6364136223846793005ull + 1442695040888963407ull;
    int k = (int)(c->seed >> 59);
    if (live[k]) {
      dp_cache_dealloc(C, live[k], NULL);
      live[k] = NULL;
    } else {
      dp_cache_alloc(C, c->dev, (size_t)(c->seed >> 40) % 300000 + 1, s, &live[k], NULL);
    }
  }
  for (int k = 0; k < 32; k++) dp_cache_dealloc(C, live[k], NULL);
  dp_stream_free(s);
  return NULL;
}

Test(allocator, many_threads_allocate_and_free_and_the_books_balance) {
  pthread_t th[4];
  churn_t args[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (churn_t){i % 2 ? H1 : H0, (uint64_t)i + 1};
    pthread_create(&th[i], NULL, churn, &args[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int d = 0; d < 2; d++) {
    dp_cache_stats_t st = stats(t_dev(DP_DEVICE_HOST, d));
    cr_assert_eq(st.allocated, 0);
    cr_assert_eq(st.allocs, st.frees);
    cr_assert_gt(st.allocs, 10000);
  }
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved + stats(H1).reserved, 0, "every segment went back");
}

Test(allocator, every_allocation_failure_is_an_error_and_leaks_nothing) {
  dp_cache_free(C);
  C = NULL;
  dp_stream_t *s = stream(H0), *u = stream(H0);
  for (long k = 1;; k++) {
    cr_assert_lt(k, 500);
    long want = t_alloc_count + k;
    t_fail_at = want;
    dp_cache_t *c;
    void *p = NULL, *q = NULL;
    int rc = dp_cache_new(B, &c, NULL);
    if (rc == 0) {
      rc = dp_cache_alloc(c, H0, 4096, s, &p, NULL);
      if (rc == 0) rc = dp_cache_record_stream(c, p, u, NULL);
      if (rc == 0) rc = dp_cache_alloc(c, H0, 3 << 20, s, &q, NULL);
      if (p) dp_cache_dealloc(c, p, NULL);  /* free never fails: without an event it waits instead */
      if (q) dp_cache_dealloc(c, q, NULL);
      const char *bad = dp__cache_check(c);
      cr_assert_null(bad, "after failing allocation %ld, the books disagree: %s", k, bad);
      dp_cache_free(c);
    }
    /* the sweep ends where no allocation was failed: not at the first
       success, since some failures are absorbed (a segment's is retried) */
    int hit = t_alloc_count >= want;
    t_fail_at = 0;
    cr_assert(rc == 0 || rc == DP_ENOMEM, "%s", dp_err_name(rc));
    /* the event pool may keep events created along the way */
    dp_stream_free(s);
    dp_stream_free(u);
    dp_shutdown();
    cr_assert_eq(t_live_blocks, 0, "leak after failing allocation %ld", k);
    OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
    s = stream(H0);
    u = stream(H0);
    if (!hit) {
      cr_assert_eq(rc, 0, "with no allocation failed, all succeeds");
      break;
    }
  }
  dp_stream_free(s);
  dp_stream_free(u);
  OK(dp_cache_new(B, &C, T_ERR));
}

/* A record on a block's allocation stream holds nothing back (the stream
 * orders the block's reuse by itself); once that stream is destroyed the
 * block belongs to no stream, and a record on any stream — one created
 * later at the same address too — holds it until that stream's work is
 * done. Through the batched hook and the single call. */
Test(allocator, a_record_on_the_allocation_stream_is_a_no_op_and_after_its_destruction_holds_the_block) {
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_stream_t *s = stream(H0);
  void *p, *q[2];
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_hooks_record(&h, &p, 1, s, T_ERR));
  OK(dp_cache_record_stream(C, p, s, T_ERR));
  _Atomic int gate = 0; /* s held: an event on it (were the record kept) would not complete */
  OK(dp_host_launch(s, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  size_t held = stats(H0).pending_blocks;
  atomic_store(&gate, 1); /* before asserting: a failure must not leave s held */
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(held, 0, "a record on the allocation stream holds nothing");
  for (int i = 0; i < 2; i++) OK(dp_cache_alloc(C, H0, 4096, s, &q[i], T_ERR));
  dp_stream_t *old = s;
  dp_stream_free(s);
  dp_stream_t *u = stream(H0);  /* malloc tends to hand back the destroyed stream's memory */
  cr_log_info("the new stream %s the destroyed one's address", u == old ? "has" : "does not have");
  OK(dp_cache_hooks_record(&h, &q[0], 1, u, T_ERR));
  OK(dp_cache_record_stream(C, q[1], u, T_ERR));
  _Atomic int gate3 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate3, T_ERR));
  for (int i = 0; i < 2; i++) OK(dp_cache_dealloc(C, q[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 2, "both blocks wait for the stream that recorded them");
  atomic_store(&gate3, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), 2);
  dp_stream_free(u);
}

/* A host function on stream s that needs the allocator. */
static _Atomic int fn_done;
static void allocate_from_a_stream(void *arg) {
  dp_stream_t *s = arg;
  void *p;
  sleep_ms(100);  /* until the main thread is inside dp_cache_empty */
  if (dp_cache_alloc(C, H0, 1024, s, &p, NULL) == 0) dp_cache_dealloc(C, p, NULL);
  fn_done = 1;
}

Test(allocator, emptying_the_cache_waits_for_a_stream_without_holding_the_lock_its_work_needs, .timeout = 20) {
  /* Before, dp_cache_empty (and the out-of-memory retry) synchronized the
   * streams of the segments it freed while holding the allocator's lock:
   * a host function on such a stream that itself allocates deadlocked. */
  dp_stream_t *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));  /* a whole free segment, last used on s */
  fn_done = 0;
  OK(dp_host_launch(s, allocate_from_a_stream, s, T_ERR));
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(fn_done, 1, "dp_cache_empty returned before s's work that preceded it was done");
  OK(dp_stream_synchronize(s, T_ERR));
  dp_stream_free(s);
}

/* A host function that allocates when the backend is out of memory never
 * waits for a stream (an event recorded on its own stream, behind it, would
 * never complete: it deadlocked): a segment whose stream still has work
 * queued stays, and the allocation fails with DP_ENOMEM. That includes its
 * own stream: a block freed in stream order may be used by work queued on
 * that stream after the function (ASan saw such work write freed memory). */
typedef struct {
  dp_stream_t *s;
  int rc;
  char msg[DP_ERROR_MSG_MAX];
} oom_fn_t;

static void gate_wait(void *arg);

static void allocate_2mib(void *arg) {
  oom_fn_t *a = arg;
  void *p;
  dp_error_t e = {0};
  a->rc = dp_cache_alloc(C, H1, 2u << 20, a->s, &p, &e);
  snprintf(a->msg, sizeof a->msg, "%s", e.message);
  if (a->rc == 0) dp_cache_dealloc(C, p, NULL);
}

static void fill_4k(void *arg) { memset(arg, 0x5a, 4096); }

Test(allocator, a_host_function_out_of_memory_never_waits_and_never_frees_a_block_work_behind_it_uses,
     .timeout = 20) {
  dp_stream_t *s = stream(H1), *busy = stream(H1);
  _Atomic int gate = 0;
  OK(dp_host_launch(s, gate_wait, &gate, T_ERR)); /* s held: what follows is queued */
  oom_fn_t a = {.s = s, .rc = 1};
  OK(dp_host_launch(s, allocate_2mib, &a, T_ERR));
  void *p;
  OK(dp_cache_alloc(C, H1, 4096, s, &p, T_ERR));
  OK(dp_host_launch(s, fill_4k, p, T_ERR)); /* uses p after the function */
  OK(dp_cache_dealloc(C, p, T_ERR));        /* freed in stream order: its segment is free, and still used */
  OK(dp_host_set_memory_limit(H1, 3u << 20, T_ERR)); /* a second segment does not fit beside it */
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(s, T_ERR)); /* returns: the function did not wait on its own stream */
  cr_assert_eq(a.rc, DP_ENOMEM, "%d %s", a.rc, a.msg);
  cr_assert(strstr(a.msg, "dp_cache_alloc(host:1): out of memory allocating 2097152 bytes"), "%s", a.msg);
  cr_assert_eq(stats(H1).segment_frees, 0, "the segment the later work used was kept");

  /* a cached segment of another stream, held at a gate: kept as well */
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
  OK(dp_cache_empty(C, T_ERR));
  OK(dp_cache_alloc(C, H1, 4096, busy, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_host_set_memory_limit(H1, 3u << 20, T_ERR));
  atomic_store(&gate, 0);
  OK(dp_host_launch(busy, gate_wait, &gate, T_ERR));
  a.rc = 1;
  OK(dp_host_launch(s, allocate_2mib, &a, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(a.rc, DP_ENOMEM, "%d %s", a.rc, a.msg);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(busy, T_ERR));
  /* and one whose stream is idle is freed: the function's allocation succeeds */
  a.rc = 1;
  OK(dp_host_launch(s, allocate_2mib, &a, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(a.rc, 0, "%s", a.msg);
  dp_stream_free(busy);
  dp_stream_free(s);
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
}

/* A segment kept because a host function may not wait for its stream had
 * an event recorded there to learn that: the event goes back (it was left
 * out of the pool, and leaked, when it was the block that decided). */
typedef struct {
  int rc;
  size_t reserved;
} empty_fn_t;

static void empty_from_fn(void *arg) {
  empty_fn_t *a = arg;
  dp_cache_stats_t st = {0};
  a->rc = dp_cache_empty(C, NULL);
  if (dp_cache_stats(C, H0, &st, NULL) == 0) a->reserved = st.reserved;
}

Test(allocator, emptying_the_cache_from_a_host_function_keeps_a_segment_its_stream_still_uses_and_leaks_no_event,
     .timeout = 20) {
  dp_stream_t *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR)); /* a free segment, its block s's: work behind the function may use it */
  empty_fn_t a = {.rc = 1};
  OK(dp_host_launch(s, empty_from_fn, &a, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(a.rc, 0, "a segment kept for its stream's work is no failure: %s", dp_err_name(a.rc));
  cr_assert_eq(a.reserved, (size_t)2 << 20, "the segment s still uses stays cached, reserved %zu", a.reserved);
  OK(dp_cache_empty(C, T_ERR)); /* s idle now: it goes */
  cr_assert_eq(stats(H0).reserved, 0);
  dp_stream_free(s);
  dp_cache_free(C);
  C = NULL;
  dp_shutdown(); /* the event pool too: an event never given back is still live */
  ASSERT_NO_LEAK();
}

/* A segment kept from a host function lets go of the events it recorded
 * to learn that, and forgets them: once its stream is gone (its blocks tied
 * to none, so no event is made for them), the segment goes back without
 * touching those events again — by then the pool has handed them to
 * someone else, whom a second free would rob. */
Test(allocator, a_segment_kept_from_a_host_function_never_frees_its_events_again_when_it_goes, .timeout = 20) {
  enum { NEV = 8 };
  dp_stream_t *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  empty_fn_t a = {.rc = 1};
  OK(dp_host_launch(s, empty_from_fn, &a, T_ERR)); /* the segment stays: s is busy behind the function */
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(a.reserved, (size_t)2 << 20);
  dp_stream_free(s); /* the free block is tied to no stream now */
  dp_event_t *mine[2 * NEV];
  for (int i = 0; i < NEV; i++) OK(dp_event_new(B, H0, &mine[i], T_ERR)); /* the pool's: the cache's among them */
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved, 0, "the segment went back");
  for (int i = NEV; i < 2 * NEV; i++) OK(dp_event_new(B, H0, &mine[i], T_ERR));
  for (int i = 0; i < 2 * NEV; i++)
    for (int j = 0; j < i; j++) cr_assert_neq(mine[i], mine[j], "events %d and %d are one: the cache freed a held one", j, i);
  for (int i = 0; i < 2 * NEV; i++) dp_event_free(mine[i]);
}

/* A free that cannot make an event for a stream the block was used on (out
 * of memory) never waits for that stream — under the allocator's lock, or
 * from a host function on that very stream, it hung: the block waits,
 * pending, until the stream is idle. */
static void *freed_in_fn;

static void free_out_of_memory(void *arg) {
  (void)arg;
  t_fail_at = t_alloc_count + 1; /* the block's event array */
  dp_cache_dealloc(C, freed_in_fn, NULL);
  t_fail_at = 0;
}

Test(allocator, a_free_that_cannot_make_an_event_never_waits_and_keeps_the_block_until_the_stream_is_idle,
     .timeout = 20) {
  dp_stream_t *a = stream(H0), *u = stream(H0);
  void *p, *q;
  OK(dp_cache_alloc(C, H0, 4096, a, &p, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  _Atomic int gate = 0;
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR)); /* u busy until the gate opens */
  t_fail_at = t_alloc_count + 1;
  OK(dp_cache_dealloc(C, p, T_ERR)); /* returns at once */
  t_fail_at = 0;
  cr_assert_eq(stats(H0).pending_blocks, 1, "the block was not kept for its busy stream");
  OK(dp_cache_alloc(C, H0, 4096, a, &q, T_ERR));
  cr_assert_neq(q, p, "a block handed out while a stream it was used on is busy");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  OK(dp_cache_dealloc(C, q, T_ERR)); /* polls the pending blocks */
  cr_assert_eq(stats(H0).pending_blocks, 0, "the block stayed pending once its stream was idle");
  /* from a host function on the stream the block was used on */
  OK(dp_cache_alloc(C, H0, 4096, a, &freed_in_fn, T_ERR));
  OK(dp_cache_record_stream(C, freed_in_fn, u, T_ERR));
  OK(dp_host_launch(u, free_out_of_memory, NULL, T_ERR));
  OK(dp_stream_synchronize(u, T_ERR)); /* returns: the free did not wait on its own stream */
  OK(dp_cache_alloc(C, H0, 4096, a, &q, T_ERR)); /* u is idle now: the block comes back */
  cr_assert_eq(stats(H0).pending_blocks, 0);
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(u);
  dp_stream_free(a);
}

/* Freeing a cache waits for the streams its pending blocks were kept on
 * (a block freed without an event, used on another device's stream): the
 * segment is not given back under that stream's work. */
static _Atomic int late_wrote;

static void late_write(void *arg) {
  sleep_ms(100); /* dp_cache_free is called meanwhile */
  memset(arg, 0xab, 4096);
  atomic_store(&late_wrote, 1);
}

Test(allocator, freeing_a_cache_waits_for_the_streams_its_blocks_without_events_were_kept_on, .timeout = 20) {
  dp_cache_t *own;
  OK(dp_cache_new(B, &own, T_ERR));
  dp_stream_t *a = stream(H0), *u = stream(H1);
  void *p;
  OK(dp_cache_alloc(own, H0, 4096, a, &p, T_ERR));
  OK(dp_cache_record_stream(own, p, u, T_ERR));
  late_wrote = 0;
  OK(dp_host_launch(u, late_write, p, T_ERR));
  t_fail_at = t_alloc_count + 1; /* the block's event array: kept on u instead */
  OK(dp_cache_dealloc(own, p, T_ERR));
  t_fail_at = 0;
  dp_cache_free(own);
  cr_assert_eq(atomic_load(&late_wrote), 1, "the cache gave its segment back while u's work still used it");
  OK(dp_stream_synchronize(u, T_ERR));
  dp_stream_free(u);
  dp_stream_free(a);
}

/* ---- teardown and the device layer's seams ---- */

/* Holds its stream until *arg is set — for 30 s at most, so that a test
 * whose assertion fails before opening the gate ends (its teardown waits
 * for the streams) instead of hanging. */
static void gate_wait(void *arg) {
  for (int ms = 0; !atomic_load((_Atomic int *)arg) && ms < 30000; ms++) sleep_ms(1);
}

/* Taking another stream's block makes the new stream wait for the old one
 * (dp_stream_wait_stream): the event it borrows goes back to the pool when
 * the record or the wait fails too. Every allocation along the path fails
 * in turn; the code comes back as it was and nothing is left live. */
Test(allocator, a_failed_cross_stream_wait_returns_its_event_and_passes_the_code_through) {
  int failures = 0;
  for (long k = 1;; k++) {
    cr_assert_lt(k, 100);
    _Atomic int open = 0;
    dp_stream_t *t = stream(H0), *s = stream(H0);
    OK(dp_host_launch(t, gate_wait, &open, T_ERR));  /* t is busy: s must queue a wait */
    void *p, *q = NULL;
    OK(dp_cache_alloc(C, H0, 4 << 20, t, &p, T_ERR));  /* a segment of its own: no remainder */
    OK(dp_cache_dealloc(C, p, T_ERR));
    dp_error_t e;
    long want = t_alloc_count + k;
    t_fail_at = want;
    int rc = dp_cache_alloc(C, H0, 4 << 20, s, &q, &e);
    int hit = t_alloc_count >= want; /* else the sweep is over (a failure may be absorbed: rc 0) */
    t_fail_at = 0;
    atomic_store(&open, 1);
    if (rc == 0) {
      cr_assert_eq(q, p, "the block was taken across streams");
      OK(dp_cache_dealloc(C, q, T_ERR));
    } else {
      cr_assert_eq(rc, DP_ENOMEM, "%s: %s", dp_err_name(rc), e.message);
      cr_assert(e.message[0], "the failure says why");
      failures++;
    }
    dp_stream_free(s);
    dp_stream_free(t);
    if (!hit) break;
  }
  cr_assert_gt(failures, 0, "some allocation along the path was failed");
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* The device layer tells every live cache that a stream is going away
 * (a listener each cache registers); a freed cache is no longer told. */
Test(allocator, a_freed_cache_is_no_longer_told_of_destroyed_streams) {
  dp_cache_t *c2;
  OK(dp_cache_new(B, &c2, T_ERR));
  dp_stream_t *s = stream(H0), *t = stream(H0);
  void *p, *q;
  OK(dp_cache_alloc(c2, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(c2, p, T_ERR));
  dp_stream_free(s);  /* c2 hears of it: its block belongs to no stream */
  OK(dp_cache_alloc(c2, H0, 4096, t, &q, T_ERR));
  cr_assert_eq(q, p);
  OK(dp_cache_dealloc(c2, q, T_ERR));
  dp_cache_free(c2);
  dp_stream_free(t);  /* c2 is gone: telling it would touch freed memory (ASan) */
}

/* dp_shutdown frees the default caches before it stops the backends they
 * hold memory of, and a later dp_cache_default starts afresh. */
Test(allocator, shutdown_frees_the_default_caches_then_the_backends_in_that_order) {
  dp_cache_t *d, *d2;
  OK(dp_cache_default(B, &d, T_ERR));
  void *p;
  OK(dp_cache_alloc(d, H0, 4096, NULL, &p, T_ERR));  /* left allocated: the cache goes with shutdown */
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  ASSERT_NO_LEAK();
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  OK(dp_cache_default(B, &d2, T_ERR));
  OK(dp_cache_alloc(d2, H0, 4096, NULL, &p, T_ERR));
  OK(dp_cache_dealloc(d2, p, T_ERR));
}

/* ---- errors and NULL ---- */

/* A NULL allocator is DP_EINVAL with the function's name everywhere (it
 * crashed dp_cache_poll and dp_cache_lookup, and dp_cache_stats answered
 * zeros); dp_cache_free(NULL) does nothing. */
Test(allocator, a_null_allocator_is_einval_everywhere_and_free_takes_it) {
  dp_error_t e;
  void *p = NULL, *base;
  size_t size;
  dp_cache_stats_t st;
  dp_stream_t *s = stream(H0);
  cr_assert_eq(dp_cache_poll(NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_poll: NULL cache");
  cr_assert_eq(dp_cache_lookup(NULL, &e, &base, &size, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_lookup: NULL cache");
  cr_assert_eq(dp_cache_stats(NULL, H0, &st, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_stats: NULL cache");
  cr_assert_eq(dp_cache_dealloc(NULL, &e, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_dealloc: NULL cache");
  cr_assert_eq(dp_cache_alloc(NULL, H0, 64, s, &p, &e), DP_EINVAL);
  cr_assert_eq(dp_cache_record_stream(NULL, p, s, &e), DP_EINVAL);
  cr_assert_eq(dp_cache_empty(NULL, &e), DP_EINVAL);
  cr_assert_eq(dp_cache_new(NULL, NULL, &e), DP_EINVAL);
  cr_assert_eq(dp_cache_default(NULL, NULL, &e), DP_EINVAL);
  dp_cache_hooks_t h = dp_cache_hooks(NULL);
  void *ptrs[1] = {&e};
  cr_assert_eq(dp_cache_hooks_record(&h, ptrs, 1, s, &e), DP_EINVAL, "the hooks of no allocator report it");
  cr_assert_eq(dp_cache_hooks_record(NULL, ptrs, 1, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_record: NULL hooks");
  dp_cache_hooks_t owned_only = {C, NULL, NULL, h.record_streams_owned};
  cr_assert_eq(dp_cache_hooks_record(&owned_only, ptrs, 1, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_record: hooks with neither record_stream nor record_streams");
  dp_cache_free(NULL);
  cr_assert_eq(dp_cache_stats(C, t_dev(DP_DEVICE_CUDA, 0), &st, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_stats: device cuda:0 does not belong to the host backend (2 devices)");
  int local;
  cr_assert_eq(dp_cache_lookup(C, &local, &base, &size, &e), DP_ENOTFOUND);
  cr_assert(strstr(e.message, "not in a block allocated by this allocator") != NULL, "%s", e.message);
  dp_stream_free(s);
}

/* An allocation on this thread's current stream, when that stream cannot be
 * made, fails with the reason it could not (it was relabelled DP_EINVAL,
 * "the stream must be on the device allocated from"). */
Test(allocator, a_current_stream_that_cannot_be_made_passes_its_error_through) {
  void *p;
  dp_error_t e;
  t_fail_at = t_alloc_count + 1;
  int rc = dp_cache_alloc(C, H0, 64, NULL, &p, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s: %s", dp_err_name(rc), e.message);
  cr_assert_str_eq(e.message, "dp_stream_default(host:0): out of memory creating a stream");
  OK(dp_cache_alloc(C, H0, 64, NULL, &p, &e));
  OK(dp_cache_dealloc(C, p, &e));
}

/* dp_cache_free leaves a backend's default cache alone (dp_shutdown frees
 * it): freeing it left dp_cache_default handing out the freed cache. */
Test(allocator, freeing_the_default_cache_is_a_no_op_until_shutdown) {
  dp_cache_t *d, *d2;
  void *p;
  OK(dp_cache_default(B, &d, T_ERR));
  OK(dp_cache_alloc(d, H0, 4096, NULL, &p, T_ERR));
  long live = atomic_load(&t_live_blocks);
  dp_cache_free(d);
  cr_assert_eq(atomic_load(&t_live_blocks), live, "dp_cache_free freed the default cache");
  OK(dp_cache_default(B, &d2, T_ERR));
  cr_assert_eq(d2, d);
  void *base;
  size_t size;
  OK(dp_cache_lookup(d2, p, &base, &size, T_ERR));
  cr_assert_eq(base, p, "the default cache still knows its allocations");
  OK(dp_cache_dealloc(d2, p, T_ERR));
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* NULL ptrs with n > 0 is DP_EINVAL, on the batched and the per-pointer
 * path alike (both read ptrs[0] before); n == 0 records nothing. */
Test(allocator, the_hooks_refuse_null_ptrs_for_a_nonzero_count) {
  dp_stream_t *s = stream(H0);
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_error_t e;
  cr_assert_eq(dp_cache_hooks_record(&h, NULL, 2, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_record: NULL ptrs with n = 2");
  OK(dp_cache_hooks_record(&h, NULL, 0, s, T_ERR));
  cr_assert_eq(h.record_streams(h.ctx, NULL, 3, s, &e), DP_EINVAL, "the hook itself, called directly");
  cr_assert_str_eq(e.message, "record_streams: NULL ptrs with n = 3");
  OK(h.record_streams(h.ctx, NULL, 0, s, T_ERR));
  h.record_streams = NULL;
  cr_assert_eq(dp_cache_hooks_record(&h, NULL, 1, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_record: NULL ptrs with n = 1");
  OK(dp_cache_hooks_record(&h, NULL, 0, s, T_ERR));
  dp_stream_free(s);
}

/* Host work still queued when dp_shutdown frees the default caches may ask
 * for one: the caches are freed without holding their registry's lock (it
 * deadlocked), and the cache that work made is freed too. */
static void ask_default(void *arg) {
  dp_cache_t *d = NULL;
  atomic_store((_Atomic int *)arg, dp_cache_default(B, &d, NULL) == 0 && d != NULL);
}

Test(allocator, shutdown_returns_when_queued_host_work_asks_for_the_default_cache, .timeout = 20) {
  dp_cache_t *d;
  void *p;
  OK(dp_cache_default(B, &d, T_ERR));
  OK(dp_cache_alloc(d, H0, 4096, NULL, &p, T_ERR));  /* a segment: freeing d waits on H0's streams */
  dp_stream_t *s;
  OK(dp_stream_default(B, H0, &s, T_ERR));
  _Atomic int got;
  atomic_init(&got, 0);
  OK(dp_host_launch(s, sleep_40, NULL, T_ERR));
  OK(dp_host_launch(s, ask_default, (void *)&got, T_ERR));
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  cr_assert_eq(atomic_load(&got), 1, "the queued work ran to its end");
  ASSERT_NO_LEAK();
}

/* Freeing a cache (dp_cache_free, or dp_shutdown for a default one) waits
 * for the work queued on the backend's streams, and that work may free and
 * allocate through the cache: the wait is made without the cache's lock
 * (cache.h). It was made under it, and such work, blocked on the lock,
 * never let the wait end. */
typedef struct {
  dp_cache_t *c;
  void *p;
  dp_stream_t *s;
  _Atomic int rc;
} late_free_t;

static void late_free_and_alloc(void *arg) {
  late_free_t *a = arg;
  sleep_ms(100); /* the cache is being freed meanwhile */
  int rc = dp_cache_dealloc(a->c, a->p, NULL);
  void *q;
  if (rc == 0 && (rc = dp_cache_alloc(a->c, H0, 4096, a->s, &q, NULL)) == 0) rc = dp_cache_dealloc(a->c, q, NULL);
  atomic_store(&a->rc, rc);
}

Test(allocator, freeing_a_cache_lets_work_queued_before_free_and_allocate_through_it, .timeout = 20) {
  dp_cache_t *own;
  OK(dp_cache_new(B, &own, T_ERR));
  dp_stream_t *s = stream(H0);
  late_free_t a = {own, NULL, s, 1};
  OK(dp_cache_alloc(own, H0, 4096, s, &a.p, T_ERR));
  OK(dp_host_launch(s, late_free_and_alloc, &a, T_ERR));
  dp_cache_free(own);
  cr_assert_eq(atomic_load(&a.rc), 0, "the queued work freed and allocated through the cache before it went");
  dp_stream_free(s);
}

Test(allocator, shutdown_lets_queued_host_work_free_through_the_default_cache, .timeout = 20) {
  dp_cache_t *d;
  OK(dp_cache_default(B, &d, T_ERR));
  dp_stream_t *s;
  OK(dp_stream_pool_next(B, H0, &s, T_ERR)); /* the backend's: dp_shutdown runs its queued work */
  late_free_t a = {d, NULL, s, 1};
  OK(dp_cache_alloc(d, H0, 4096, s, &a.p, T_ERR));
  OK(dp_host_launch(s, late_free_and_alloc, &a, T_ERR));
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  cr_assert_eq(atomic_load(&a.rc), 0, "the queued work freed and allocated through the default cache");
  ASSERT_NO_LEAK();
}

/* Large free blocks are found best-fit in logarithmic time. They sat in
 * one list searched whole: n allocations of 2 MiB + 512 bytes, each leaving
 * a remainder of 2 MiB - 512 too small for the next, took time quadratic in
 * n (40,000 of them: 39 s, 29 of them in the search; 0.3 s now). Freeing
 * the cache gives its segments back highest address first: lowest first,
 * the host backend moved its whole sorted table at each (0.76 s for 40,000
 * segments; 0.02 s now). The segments come from address space reserved
 * once (never touched: the allocator does not write its blocks), so that
 * the time measured is the allocator's. */
#define RESERVE ((size_t)256 << 30)
static char *reserved, *reserved_next;

static void *reserving_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  if (ptr && (char *)ptr >= reserved && (char *)ptr < reserved + RESERVE) return NULL; /* a segment's: kept */
  if (!ptr && nsize > (2u << 20) && reserved_next + nsize <= reserved + RESERVE) {
    char *p = reserved_next;
    reserved_next += (nsize + 4095) & ~(size_t)4095;
    return p;
  }
  return t_alloc(ud, ptr, osize, nsize);
}

Test(allocator, many_large_blocks_are_found_and_given_back_in_time_that_grows_linearly) {
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  reserved = mmap(NULL, RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  cr_assert_neq(reserved, MAP_FAILED, "cannot reserve address space");
  reserved_next = reserved;
  dp_set_allocator(reserving_alloc, NULL);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  OK(dp_cache_new(B, &C, T_ERR));
  enum { N = 40000 };
  void **p = malloc(N * sizeof *p);
  struct timespec t0, t1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); /* this thread's CPU time: the machine's load does not count */
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, (2u << 20) + 512, NULL, &p[i], T_ERR));
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.segment_allocs, N, "one 4 MiB segment each, each with a free remainder");
  cr_assert_lt(s, 2.0, "%d large allocations took %.2f s of CPU", N, s);
  void *q;
  OK(dp_cache_alloc(C, H0, (2u << 20) - 512, NULL, &q, T_ERR));
  cr_assert_eq(stats(H0).segment_allocs, N, "a remainder serves a request it fits, best fit");
  OK(dp_cache_dealloc(C, q, T_ERR));
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  free(p);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  dp_cache_free(C);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  C = NULL;
  dp_shutdown();
  munmap(reserved, RESERVE);
  s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  cr_assert_lt(s, 0.3, "giving %d segments back took %.2f s of CPU", N, s);
}

/* The polls of malloc and free reclaim a pending block whose streams are
 * done also while a block freed before it still waits for a slow stream.
 * They stopped at the first block still in use, so one slow consumer held
 * back every block freed after its own until dp_cache_poll. */
Test(allocator, a_slow_stream_does_not_hold_back_blocks_freed_after_its_own, .timeout = 20) {
  dp_stream_t *s = stream(H0), *slow = stream(H0), *quick = stream(H0);
  _Atomic int open = 0;
  OK(dp_host_launch(slow, gate_wait, &open, T_ERR));
  void *a, *b;
  OK(dp_cache_alloc(C, H0, 4096, s, &a, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &b, T_ERR));
  OK(dp_cache_record_stream(C, a, slow, T_ERR));
  OK(dp_cache_record_stream(C, b, quick, T_ERR));
  OK(dp_cache_dealloc(C, a, T_ERR)); /* waits for slow, held */
  OK(dp_cache_dealloc(C, b, T_ERR)); /* waits for quick, idle */
  OK(dp_stream_synchronize(quick, T_ERR));
  void *q;
  OK(dp_cache_alloc(C, H0, 4096, s, &q, T_ERR));
  atomic_store(&open, 1); /* before asserting: a failure must not leave slow held */
  OK(dp_stream_synchronize(slow, T_ERR));
  cr_assert_eq(q, b, "the allocation reused b, whose stream is done (got %p, b %p)", q, b);
  OK(dp_cache_dealloc(C, q, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(quick);
  dp_stream_free(slow);
  dp_stream_free(s);
}

/* One poll passes over a few blocks still in use, not one only: with two
 * blocks held by a slow stream ahead of a block whose stream is done, the
 * next allocation reclaims that block. Passing over one a poll, the
 * allocation found the held blocks at the head in turn and the done one
 * stayed pending behind them. Both streams are held at gates while the
 * blocks are freed, so the pending list's order does not depend on when a
 * stream runs. */
Test(allocator, one_poll_passes_over_two_blocks_held_by_a_slow_stream_to_reclaim_a_finished_one, .timeout = 20) {
  dp_stream_t *s = stream(H0), *slow = stream(H0), *quick = stream(H0);
  void *a1, *a2, *b, *q = NULL;
  OK(dp_cache_alloc(C, H0, 4096, s, &a1, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &a2, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &b, T_ERR));
  /* while a gate is shut nothing asserts: the first failure is kept for later */
  _Atomic int slow_open = 0, quick_open = 0;
  dp_error_t e;
  dp_error_clear(&e);
  int rc = dp_host_launch(slow, gate_wait, &slow_open, &e);
  if (!rc) rc = dp_host_launch(quick, gate_wait, &quick_open, &e);
  if (!rc) rc = dp_cache_record_stream(C, a1, slow, &e);
  if (!rc) rc = dp_cache_record_stream(C, a2, slow, &e);
  if (!rc) rc = dp_cache_record_stream(C, b, quick, &e);
  if (!rc) rc = dp_cache_dealloc(C, a1, &e);
  if (!rc) rc = dp_cache_dealloc(C, a2, &e);
  if (!rc) rc = dp_cache_dealloc(C, b, &e);
  atomic_store(&quick_open, 1);
  if (!rc) rc = dp_stream_synchronize(quick, &e);
  if (!rc) rc = dp_cache_alloc(C, H0, 4096, s, &q, &e); /* one poll (dp_cache_stats would poll them all) */
  atomic_store(&slow_open, 1);
  OK_WITH(&e, rc);
  OK(dp_stream_synchronize(slow, T_ERR));
  cr_assert_eq(q, b, "the allocation reused b, whose stream is done, past a1 and a2 (got %p; a1 %p, a2 %p, b %p)",
               q, a1, a2, b);
  OK(dp_cache_dealloc(C, q, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(quick);
  dp_stream_free(slow);
  dp_stream_free(s);
}

/* A block used on two recorded streams: destroying either (the second
 * recorded, or the first) drops that one from its uses and keeps the
 * other, whose work the block's reuse still waits for. A use left behind
 * would name a freed stream (ASan: the dealloc records on it). */
static void drop_one_of_two_recorded_streams(int second) {
  dp_stream_t *s = stream(H0), *u[2] = {stream(H0), stream(H0)};
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_record_stream(C, p, u[0], T_ERR));
  OK(dp_cache_record_stream(C, p, u[1], T_ERR));
  dp_stream_free(u[second]);
  dp_stream_t *kept = u[!second];
  _Atomic int gate = 0; /* the kept stream held until the gate opens */
  OK(dp_host_launch(kept, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 1, "the block waits for the recorded stream still alive");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(kept, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), 1);
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(kept);
  dp_stream_free(s);
}

Test(allocator, destroying_either_of_two_recorded_streams_drops_that_use_and_keeps_the_other) {
  drop_one_of_two_recorded_streams(1);
  drop_one_of_two_recorded_streams(0);
}

/* A batch of records skips the lookup of pointers in a segment whose used
 * blocks were all allocated on the recording stream. It must still record
 * every pointer whose block is on another stream: one of a segment shared
 * by two streams, and every block of a stream destroyed since (even when a
 * new stream has the destroyed one's address). */
Test(allocator, a_batch_record_skips_only_blocks_already_on_the_recording_stream) {
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_stream_t *s1 = stream(H0), *s2 = stream(H0);
  void *q[4];
  OK(dp_cache_alloc(C, H0, 4096, s2, &q[2], T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s1, &q[0], T_ERR));  /* same segment, another stream */
  OK(dp_cache_alloc(C, H0, 4096, s1, &q[1], T_ERR));
  cr_assert_eq(stats(H0).segment_allocs, 1, "one segment holds the three blocks");
  OK(dp_cache_hooks_record(&h, q, 3, s1, T_ERR));    /* q[2] must get s1 */
  _Atomic int gate4 = 0; /* s1 held until the gate opens: none of its work completes before */
  OK(dp_host_launch(s1, gate_wait, &gate4, T_ERR));
  for (int i = 0; i < 3; i++) OK(dp_cache_dealloc(C, q[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 1, "the block of s2 waits for s1, which used it");
  atomic_store(&gate4, 1);
  OK(dp_stream_synchronize(s1, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), 1);
  /* every block of a destroyed stream: a later stream records them all */
  for (int i = 0; i < 4; i++) OK(dp_cache_alloc(C, H0, 4096, s2, &q[i], T_ERR));
  dp_stream_t *old = s2;
  dp_stream_free(s2);
  dp_stream_t *u = stream(H0);
  cr_log_info("the new stream %s the destroyed one's address", u == old ? "has" : "does not have");
  OK(dp_cache_hooks_record(&h, q, 4, u, T_ERR));
  _Atomic int gate5 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate5, T_ERR));
  for (int i = 0; i < 4; i++) OK(dp_cache_dealloc(C, q[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 4, "all four wait for the stream that recorded them");
  atomic_store(&gate5, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), 4);
  /* and blocks all on the recording stream hold nothing */
  for (int i = 0; i < 4; i++) OK(dp_cache_alloc(C, H0, 4096, u, &q[i], T_ERR));
  OK(dp_cache_hooks_record(&h, q, 4, u, T_ERR));
  for (int i = 0; i < 4; i++) OK(dp_cache_dealloc(C, q[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(u);
  dp_stream_free(s1);
}

/* A large batch (its map past the size where lookups are prefetched) passes
 * runs of pointers in segments all on the recording stream without a
 * lookup, and looks up the others — pointers of a segment two streams
 * share, a block of another stream in the middle of a run, a pointer it
 * does not own — each recorded or marked as a record one at a time would.
 * Then the same batch on a third stream: every pointer looked up, in the
 * prefetching pipeline. */
Test(allocator, a_large_batch_record_skips_runs_and_records_every_block_of_another_stream) {
  enum { N = 5000, ODD = 8 };
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_stream_t *s1 = stream(H0), *s2 = stream(H0), *u = stream(H0);
  void **p = malloc((N + ODD + 1) * sizeof *p);
  unsigned char *owned = calloc(N + ODD + 1, 1);
  cr_assert(p && owned);
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 1024, s1, &p[i], T_ERR));
  cr_assert_eq(stats(H0).segment_allocs, 3, "three 2 MiB segments of 1 KiB blocks");
  void *odd[ODD];
  for (int i = 0; i < ODD; i++) OK(dp_cache_alloc(C, H0, 1024, s2, &odd[i], T_ERR));  /* s1's remainder: shared */
  char foreign[64];
  /* the odd ones out among the runs: at the start, mid-run, at a segment's end, last */
  void **batch = malloc((N + ODD + 1) * sizeof *batch);
  static const int at[ODD] = {0, 1, 700, 2047, 2048, 3000, 4096, N - 1};
  int k = 0, o = 0;
  for (int i = 0; i < N; i++) {
    while (o < ODD && at[o] == i) batch[k++] = odd[o++];
    batch[k++] = p[i];
    if (i == 1500) batch[k++] = foreign;
  }
  while (o < ODD) batch[k++] = odd[o++];
  cr_assert_eq(k, N + ODD + 1);
  OK(h.record_streams_owned(h.ctx, batch, (size_t)k, s1, owned, T_ERR));
  for (int i = 0; i < k; i++)
    cr_assert_eq(owned[i], batch[i] != foreign, "pointer %d: %s", i, batch[i] == foreign ? "not the allocator's" : "owned");
  _Atomic int gate6 = 0; /* s1 held until the gate opens: none of its work completes before */
  OK(dp_host_launch(s1, gate_wait, &gate6, T_ERR));
  for (int i = 0; i < ODD; i++) OK(dp_cache_dealloc(C, odd[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, ODD, "the blocks of s2 wait for s1, which used them");
  atomic_store(&gate6, 1);
  OK(dp_stream_synchronize(s1, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), ODD);
  /* the s1 blocks on another stream: each one held */
  OK(dp_cache_hooks_record(&h, p, N, u, T_ERR));
  _Atomic int gate7 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate7, T_ERR));
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, N, "every block waits for the stream that recorded it");
  atomic_store(&gate7, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(dp_cache_poll(C, NULL), N);
  free(batch);
  free(owned);
  free(p);
  dp_stream_free(u);
  dp_stream_free(s2);
  dp_stream_free(s1);
}

/* ---- wrapped native streams (dp_stream_wrap) ---- */

static dp_stream_t *wrap_of(dp_stream_t *owner) {
  dp_stream_t *w;
  OK(dp_stream_wrap(B, dp_stream_device(owner), dp_stream_native(owner), &w, T_ERR));
  return w;
}

/* A framework's streams, wrapped: blocks are tied to the wrapper (one per
 * native handle, so the framework's every call finds its blocks again), and
 * a record on a wrapper holds a block for the work the framework queued on
 * the native stream. */
Test(allocator, wrapped_streams_get_stream_ordered_reuse_and_record_stream) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  dp_stream_t *ws = wrap_of(s), *wu = wrap_of(u);
  unsigned char *p, *q;
  OK(dp_cache_alloc(C, H0, 4096, ws, (void **)&p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_set_current_stream(wrap_of(s), NULL, T_ERR));  /* the same wrapper, made current */
  OK(dp_cache_alloc(C, H0, 4096, NULL, (void **)&q, T_ERR));
  cr_assert_eq(q, p, "freed on the wrapper, reused at once by the wrapper");
  cr_assert_eq(stats(H0).cross_stream, 0, "the same handle is the same stream: no wait");
  memset(q, 0xAA, 4096);
  _Atomic int open = 0;
  check_t chk = {q, 0xAA, 0, 0, &open};
  OK(dp_host_launch(u, slow_check, &chk, T_ERR));  /* the framework reads q on its stream, once r is written */
  OK(dp_cache_record_stream(C, q, wu, T_ERR));
  OK(dp_cache_dealloc(C, q, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 1, "held for the wrapped stream's work");
  unsigned char *r;
  OK(dp_cache_alloc(C, H0, 4096, ws, (void **)&r, T_ERR));
  cr_assert_neq(r, q, "not handed out while the native stream still reads it");
  memset(r, 0x55, 4096);
  atomic_store(&open, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert(atomic_load(&chk.ok), "the reader saw its data");
  cr_assert_eq(dp_cache_poll(C, NULL), 1);
  OK(dp_cache_dealloc(C, r, T_ERR));
  dp_reset_current_stream(B, H0);
  dp_stream_free(s);
  dp_stream_free(u);
}

Test(allocator, freeing_the_stream_behind_a_wrapper_unties_the_wrappers_blocks) {
  dp_stream_t *s = stream(H0), *t = stream(H0);
  dp_stream_t *ws = wrap_of(s);
  void *p, *q, *held;
  OK(dp_cache_alloc(C, H0, 4096, ws, &p, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, t, &held, T_ERR));
  OK(dp_cache_record_stream(C, held, ws, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  uint64_t cross = stats(H0).cross_stream;
  dp_stream_free(s);  /* the wrapper's blocks and uses go with the native stream */
  OK(dp_cache_alloc(C, H0, 4096, t, &q, T_ERR));
  cr_assert_eq(q, p);
  cr_assert_eq(stats(H0).cross_stream, cross, "no wait on the retired wrapper");
  OK(dp_cache_dealloc(C, held, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0, "no event on a stream that is gone");
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(t);
}

/* ---- a chain of allocators (dp_cache_hooks_chain_new) ---- */

/* An allocator devpickle knows nothing of (a framework's): one arena, and
 * a log of the records it was asked to make. batched: it also has the
 * marking batch form. */
typedef struct ext {
  char arena[8192];
  int fail;                  /* answer DP_ENOMEM for a pointer it owns */
  int single_calls, batch_calls;
  int nlog;
  void *logged[64];
  dp_stream_t *on[64];
} ext_t;

static int ext_owns(const ext_t *x, const void *p) {
  return (const char *)p >= x->arena && (const char *)p < x->arena + sizeof x->arena;
}

static int ext_take(ext_t *x, void *ptr, dp_stream_t *s, dp_error_t *err) {
  if (x->fail) {
    if (err) {
      err->code = DP_ENOMEM;
      snprintf(err->message, sizeof err->message, "ext: no room to record %p", ptr);
    }
    return DP_ENOMEM;
  }
  x->logged[x->nlog] = ptr;
  x->on[x->nlog++] = s;
  return 0;
}

static int ext_record(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  ext_t *x = ctx;
  x->single_calls++;
  if (!ext_owns(x, ptr)) {
    if (err) snprintf(err->message, sizeof err->message, "ext: not mine");
    return DP_ENOTFOUND;
  }
  return ext_take(x, ptr, s, err);
}

static int ext_record_owned(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, unsigned char *owned,
                            dp_error_t *err) {
  ext_t *x = ctx;
  x->batch_calls++;
  for (size_t i = 0; i < n; i++) {
    if (!ext_owns(x, ptrs[i])) continue;
    int rc = ext_take(x, ptrs[i], s, err);
    if (rc) return rc;
    owned[i] = 1;
  }
  return 0;
}

static dp_cache_hooks_t ext_hooks(ext_t *x, int batched) {
  dp_cache_hooks_t h = {x, ext_record, NULL, batched ? ext_record_owned : NULL};
  return h;
}

static dp_cache_hooks_chain_t *chain_of(const dp_cache_hooks_t *list, size_t n) {
  dp_cache_hooks_chain_t *ch;
  OK(dp_cache_hooks_chain_new(list, n, &ch, T_ERR));
  return ch;
}

/* Hooks that count the calls made through them, then pass them on. */
typedef struct counted {
  dp_cache_hooks_t inner;
  int single, batch, marking;
} counted_t;

static int counted_one(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  counted_t *k = ctx;
  k->single++;
  return k->inner.record_stream(k->inner.ctx, ptr, s, err);
}
static int counted_batch(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  counted_t *k = ctx;
  k->batch++;
  return k->inner.record_streams(k->inner.ctx, ptrs, n, s, err);
}
static int counted_marking(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, unsigned char *owned,
                           dp_error_t *err) {
  counted_t *k = ctx;
  k->marking++;
  return k->inner.record_streams_owned(k->inner.ctx, ptrs, n, s, owned, err);
}
static dp_cache_hooks_t counted_hooks(counted_t *k, dp_cache_hooks_t inner) {
  k->inner = inner;
  dp_cache_hooks_t h = {k, counted_one, inner.record_streams ? counted_batch : NULL,
                        inner.record_streams_owned ? counted_marking : NULL};
  return h;
}

/* Pointers of two caches and the external allocator, mixed, each recorded
 * with its owner: a record held in a cache shows as a pending block after
 * the free; the external allocator shows its log. */
static void chain_records_each_pointer_with_its_owner(int batched) {
  dp_cache_t *c2;
  OK(dp_cache_new(B, &c2, T_ERR));
  ext_t *x = calloc(1, sizeof *x);
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *a[3], *b[3];
  for (int i = 0; i < 3; i++) {
    OK(dp_cache_alloc(C, H0, 4096, s, &a[i], T_ERR));
    OK(dp_cache_alloc(c2, H0, 4096, s, &b[i], T_ERR));
  }
  int nobody;
  void *ptrs[10] = {a[0], x->arena, b[0], &nobody, (char *)a[1] + 8, b[1], x->arena + 100, a[2], b[2], x->arena + 4096};
  counted_t k1 = {0}, k2 = {0};
  dp_cache_hooks_t list[3] = {counted_hooks(&k1, dp_cache_hooks(C)), counted_hooks(&k2, dp_cache_hooks(c2)),
                              ext_hooks(x, batched)};
  dp_cache_hooks_chain_t *ch = chain_of(list, 3);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
  OK(dp_cache_hooks_record(&h, ptrs, 10, u, T_ERR));
  cr_assert(k1.marking == 1 && k1.single == 0 && k1.batch == 0, "the first cache: one marking batch call");
  cr_assert(k2.marking == 1 && k2.single == 0 && k2.batch == 0, "the second: one, with what the first left");
  cr_assert_eq(x->nlog, 3, "the external allocator got its three pointers, and only those");
  cr_assert_eq(x->logged[0], x->arena);
  cr_assert_eq(x->logged[1], x->arena + 100);
  cr_assert_eq(x->logged[2], x->arena + 4096);
  for (int i = 0; i < 3; i++) cr_assert_eq(x->on[i], u);
  if (batched) {
    cr_assert_eq(x->batch_calls, 1, "one call for the whole batch");
    cr_assert_eq(x->single_calls, 0);
  } else {
    cr_assert_eq(x->single_calls, 4, "one call per pointer the caches left: its three and the stranger");
  }
  _Atomic int gate8 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate8, T_ERR));
  for (int i = 0; i < 3; i++) {
    OK(dp_cache_dealloc(C, a[i], T_ERR));
    OK(dp_cache_dealloc(c2, b[i], T_ERR));
  }
  dp_cache_stats_t st2;
  OK(dp_cache_stats(c2, H0, &st2, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 3, "the first cache holds its blocks for u");
  cr_assert_eq(st2.pending_blocks, 3, "and so does the second");
  atomic_store(&gate8, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  dp_cache_hooks_chain_free(ch);
  dp_cache_free(c2);
  free(x);
  dp_stream_free(s);
  dp_stream_free(u);
}

Test(allocator, a_chain_records_each_pointer_with_the_allocator_that_owns_it) {
  chain_records_each_pointer_with_its_owner(1);
}

Test(allocator, a_chain_asks_an_allocator_without_the_marking_batch_pointer_by_pointer) {
  chain_records_each_pointer_with_its_owner(0);
}

Test(allocator, a_chains_single_record_goes_to_the_owner_and_reports_a_pointer_nobody_owns) {
  ext_t *x = calloc(1, sizeof *x);
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  dp_cache_hooks_t list[2] = {ext_hooks(x, 0), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *ch = chain_of(list, 2);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
  OK(h.record_stream(h.ctx, (char *)p + 1, u, T_ERR));
  cr_assert_eq(x->nlog, 0);
  OK(h.record_stream(h.ctx, x->arena + 5, u, T_ERR));
  cr_assert_eq(x->nlog, 1);
  int nobody;
  dp_error_t e;
  char want[128];
  cr_assert_eq(h.record_stream(h.ctx, &nobody, u, &e), DP_ENOTFOUND);
  snprintf(want, sizeof want, "record_stream(%p): owned by none of the chain's 2 allocators", (void *)&nobody);
  cr_assert_str_eq(e.message, want);
  void *ptrs[1] = {&nobody};
  dp_error_clear(&e);
  OK(h.record_streams(h.ctx, ptrs, 1, u, &e));  /* the batch skips it */
  cr_assert_eq(e.code, 0, "a skipped pointer is no error: err untouched (%s)", e.message);
  dp_cache_hooks_t own = dp_cache_hooks(C);
  OK(own.record_streams(own.ctx, ptrs, 1, u, &e));
  cr_assert_eq(e.code, 0, "nor from the cache's own batch (%s)", e.message);
  OK(h.record_stream(h.ctx, (char *)p + 1, u, &e));
  cr_assert_eq(e.code, 0, "nor when a chain's first allocator does not own it (%s)", e.message);
  _Atomic int gate9 = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate9, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 1, "the cache recorded its pointer");
  atomic_store(&gate9, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  dp_cache_hooks_chain_free(ch);
  free(x);
  dp_stream_free(s);
  dp_stream_free(u);
}

/* An allocator's error stops the record and comes back as it gave it. */
Test(allocator, a_chain_passes_an_allocators_error_through_and_stops) {
  for (int batched = 0; batched < 2; batched++) {
    ext_t *x = calloc(1, sizeof *x), *y = calloc(1, sizeof *y);
    x->fail = 1;
    dp_stream_t *u = stream(H0);
    dp_cache_hooks_t list[3] = {dp_cache_hooks(C), ext_hooks(x, batched), ext_hooks(y, batched)};
    dp_cache_hooks_chain_t *ch = chain_of(list, 3);
    dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
    void *ptrs[3] = {y->arena, x->arena + 4, y->arena + 8};
    dp_error_t e;
    char want[128];
    snprintf(want, sizeof want, "ext: no room to record %p", (void *)(x->arena + 4));
    cr_assert_eq(h.record_streams(h.ctx, ptrs, 3, u, &e), DP_ENOMEM);
    cr_assert_str_eq(e.message, want);
    cr_assert_eq(y->nlog, 0, "nothing after the failing allocator was asked");
    cr_assert_eq(h.record_stream(h.ctx, x->arena, u, &e), DP_ENOMEM);
    cr_assert_eq(dp_cache_hooks_record(&h, ptrs, 3, u, &e), DP_ENOMEM);
    x->fail = 0;
    OK(dp_cache_hooks_record(&h, ptrs, 3, u, T_ERR));
    cr_assert_eq(x->nlog, 1);
    cr_assert_eq(y->nlog, 2);
    dp_cache_hooks_chain_free(ch);
    free(x);
    free(y);
    dp_stream_free(u);
  }
}

/* More than one chunk of pointers, and a chain inside a chain: marks come
 * back for the pointers of the inner chain, so the outer one passes only
 * the rest on. */
Test(allocator, chains_nest_and_take_long_batches_in_chunks) {
  ext_t *x = calloc(1, sizeof *x), *y = calloc(1, sizeof *y);
  dp_stream_t *u = stream(H0);
  dp_cache_hooks_t inner_list[2] = {ext_hooks(x, 1), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *inner = chain_of(inner_list, 2);
  dp_cache_hooks_t outer_list[2] = {dp_cache_hooks_chain_hooks(inner), ext_hooks(y, 0)};
  dp_cache_hooks_chain_t *outer = chain_of(outer_list, 2);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(outer);
  enum { N = DP_CACHE_HOOKS_CHAIN_BATCH * 2 + 5 };
  int nobody;
  void *few[6] = {x->arena, y->arena, x->arena + 1, y->arena + 1, &nobody, x->arena + 2};
  unsigned char owned[6] = {0};
  OK(h.record_streams_owned(h.ctx, few, 6, u, owned, T_ERR));
  unsigned char want[6] = {1, 1, 1, 1, 0, 1};
  cr_assert_arr_eq(owned, want, 6, "every owned pointer is marked, the stranger is not");
  cr_assert_eq(x->nlog, 3);
  cr_assert_eq(y->nlog, 2);
  cr_assert_eq(y->single_calls, 3, "y was offered only what the inner chain left: its two and the stranger");
  /* a long batch, in chunks: each chunk one call to x */
  void **many = malloc(N * sizeof *many);
  for (int i = 0; i < N; i++) many[i] = i == N - 1 ? (void *)(y->arena + 9) : (void *)&nobody;  /* nobody's, but the last */
  x->batch_calls = 0;
  y->single_calls = 0;
  OK(h.record_streams(h.ctx, many, N, u, T_ERR));
  cr_assert_eq(x->batch_calls, 3, "%d pointers: three chunks of at most %d", (int)N, DP_CACHE_HOOKS_CHAIN_BATCH);
  cr_assert_eq(y->single_calls, N, "the last allocator, without a batch form, is asked for each pointer left");
  cr_assert_eq(y->nlog, 3);
  cr_assert_eq(y->logged[2], y->arena + 9, "the last pointer of the last chunk reached its owner");
  free(many);
  dp_cache_hooks_chain_free(outer);
  dp_cache_hooks_chain_free(inner);
  free(x);
  free(y);
  dp_stream_free(u);
}

/* A marking batch through a chain marks what its last allocator owned too:
 * asked for marks, the last records through its marking form, not its
 * plain batch (which says nothing of what it owned); asked for none, it
 * gets its plain batch. And once every pointer is owned, the allocators
 * after the owner are not asked. */
Test(allocator, a_chains_marking_batch_marks_its_last_allocators_pointers_and_asks_nobody_once_all_are_owned) {
  ext_t *x = calloc(1, sizeof *x), *y = calloc(1, sizeof *y);
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  dp_cache_hooks_t list[2] = {ext_hooks(x, 1), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *ch = chain_of(list, 2);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
  int nobody;
  void *ptrs[3] = {x->arena, p, &nobody};
  unsigned char owned[3] = {0};
  OK(h.record_streams_owned(h.ctx, ptrs, 3, u, owned, T_ERR));
  unsigned char want[3] = {1, 1, 0};
  cr_assert_arr_eq(owned, want, 3, "x's pointer, the cache's (last in the chain) and not the stranger's: %d %d %d",
                   owned[0], owned[1], owned[2]);
  dp_cache_hooks_t list2[2] = {dp_cache_hooks(C), ext_hooks(y, 1)};
  dp_cache_hooks_chain_t *ch2 = chain_of(list2, 2);
  dp_cache_hooks_t h2 = dp_cache_hooks_chain_hooks(ch2);
  void *mine[2] = {p, (char *)p + 8};
  OK(dp_cache_hooks_record(&h2, mine, 2, u, T_ERR));
  cr_assert_eq(y->batch_calls + y->single_calls, 0,
               "the cache owned every pointer: y was asked %d times in batches, %d singly", y->batch_calls,
               y->single_calls);
  counted_t k = {0}; /* a plain batch: the last allocator gets the rest in one plain batch call */
  dp_cache_hooks_t list3[2] = {ext_hooks(x, 1), counted_hooks(&k, dp_cache_hooks(C))};
  dp_cache_hooks_chain_t *ch3 = chain_of(list3, 2);
  dp_cache_hooks_t h3 = dp_cache_hooks_chain_hooks(ch3);
  OK(dp_cache_hooks_record(&h3, ptrs, 3, u, T_ERR));
  cr_assert(k.batch == 1 && k.marking == 0 && k.single == 0,
            "nobody asks the last what it owned: %d plain, %d marking, %d single calls", k.batch, k.marking, k.single);
  dp_cache_hooks_chain_free(ch3);
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_stream_synchronize(u, T_ERR));
  dp_cache_poll(C, NULL);
  dp_cache_hooks_chain_free(ch2);
  dp_cache_hooks_chain_free(ch);
  free(x);
  free(y);
  dp_stream_free(s);
  dp_stream_free(u);
}

/* A chain given the same allocator twice through nested chains keeps it
 * once, in a block sized for all it was given: freed, it gives back what
 * it took, to the byte (its size is the hooks counted, not those kept). */
Test(allocator, a_chain_that_leaves_out_repeated_allocators_gives_back_exactly_the_memory_it_took) {
  ext_t *x = calloc(1, sizeof *x);
  dp_cache_hooks_t inner_list[2] = {ext_hooks(x, 1), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *inner = chain_of(inner_list, 2);
  dp_cache_hooks_t twice[2] = {dp_cache_hooks_chain_hooks(inner), dp_cache_hooks_chain_hooks(inner)};
  dp_cache_hooks_chain_t *outer = chain_of(twice, 2); /* four hooks counted, two kept */
  dp_stream_t *u = stream(H0);
  void *ptrs[1] = {x->arena};
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(outer);
  OK(dp_cache_hooks_record(&h, ptrs, 1, u, T_ERR));
  cr_assert_eq(x->nlog, 1, "x, kept once, recorded its pointer once");
  dp_cache_hooks_chain_free(outer);
  dp_cache_hooks_chain_free(inner);
  dp_stream_free(u);
  free(x);
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  ASSERT_NO_LEAK();
}

static int hook_batch_only(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)ptrs, (void)n, (void)s, (void)err;
  return 0;
}

Test(allocator, a_chain_refuses_hooks_that_cannot_say_what_they_own) {
  dp_cache_hooks_chain_t *ch = NULL;
  dp_error_t e;
  dp_cache_hooks_t list[2] = {dp_cache_hooks(C), {NULL, NULL, hook_batch_only, NULL}};
  cr_assert_eq(dp_cache_hooks_chain_new(list, 2, &ch, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_chain_new: hooks 1 has neither record_stream nor record_streams_owned, "
                              "so it cannot say which pointers are its allocator's");
  cr_assert_eq(dp_cache_hooks_chain_new(list, 0, &ch, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_chain_new: an empty chain");
  cr_assert_eq(dp_cache_hooks_chain_new(NULL, 1, &ch, &e), DP_EINVAL);
  cr_assert_eq(dp_cache_hooks_chain_new(list, 1, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_chain_new: NULL out");
  cr_assert_null(ch);
  t_fail_at = t_alloc_count + 1;
  cr_assert_eq(dp_cache_hooks_chain_new(list, 1, &ch, &e), DP_ENOMEM);
  t_fail_at = 0;
  dp_cache_hooks_t none = dp_cache_hooks_chain_hooks(NULL);
  int local;
  void *ptrs[1] = {&local};
  cr_assert_eq(none.record_stream(none.ctx, &local, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_stream: NULL hooks chain");
  cr_assert_eq(dp_cache_hooks_record(&none, ptrs, 1, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams: NULL hooks chain");
  dp_cache_hooks_chain_free(NULL);
}

/* cache.h: a segment goes back through dp_device_dealloc, which waits for
 * the work queued on every stream of its device, as cudaFree does: so
 * dp_cache_empty waits for a busy stream that never used the allocator
 * (its header said only the streams that last used the segments). */
typedef struct empty_arg {
  _Atomic int done;
  int rc;
} empty_arg_t;

static void *empty_on_thread(void *p) {
  empty_arg_t *a = p;
  a->rc = dp_cache_empty(C, NULL);
  atomic_store(&a->done, 1);
  return NULL;
}

Test(allocator, emptying_the_cache_waits_for_the_work_of_every_stream_of_the_segments_device, .timeout = 20) {
  dp_stream_t *s = stream(H0), *busy = stream(H0), *other = stream(H1);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  _Atomic int gate = 0, gate_other = 0;
  OK(dp_host_launch(busy, gate_wait, &gate, T_ERR)); /* never touches the cache */
  OK(dp_host_launch(other, gate_wait, &gate_other, T_ERR)); /* another device: not waited for */
  empty_arg_t a = {0, -1};
  pthread_t t;
  cr_assert_eq(pthread_create(&t, NULL, empty_on_thread, &a), 0);
  sleep_ms(100);
  cr_assert_eq(atomic_load(&a.done), 0, "dp_cache_empty returned while a stream of host:0 was busy");
  atomic_store(&gate, 1);
  pthread_join(t, NULL);
  cr_assert_eq(a.rc, 0);
  cr_assert_eq(stats(H0).reserved, 0, "the segment went back once the device's work was done");
  atomic_store(&gate_other, 1);
  dp_stream_free(s);
  dp_stream_free(busy);
  dp_stream_free(other);
}

/* Each hook of a NULL chain's hooks names itself: record_streams_owned
 * said "record_streams", the hook its caller did not call. */
Test(allocator, each_hook_of_a_null_chain_names_itself_in_its_error) {
  dp_cache_hooks_t none = dp_cache_hooks_chain_hooks(NULL);
  int local;
  void *ptrs[1] = {&local};
  unsigned char owned[1] = {0};
  dp_error_t e;
  cr_assert_eq(none.record_streams_owned(none.ctx, ptrs, 1, NULL, owned, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams_owned: NULL hooks chain");
  cr_assert_eq(none.record_streams(none.ctx, ptrs, 1, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams: NULL hooks chain");
}

/* A nested chain's hooks met earlier in the list are left out, in one
 * pass over the list: they were looked for by going back along it, so
 * that a chain given a chain of n allocators took time in n squared (400k
 * allocators: a minute). Hooks given directly are all kept; the others
 * keep their order. */
static int owns_nothing(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)ptr, (void)s, (void)err;
  return DP_ENOTFOUND;
}

Test(allocator, a_chain_over_a_long_nested_chain_is_made_in_time_linear_in_its_length, .timeout = 10) {
  size_t n = 200000;
  char *x = calloc(n, 1);
  dp_cache_hooks_t *list = calloc(n, sizeof *list);
  for (size_t i = 0; i < n; i++) list[i] = (dp_cache_hooks_t){x + i, owns_nothing, NULL, NULL}; /* n allocators */
  dp_cache_hooks_chain_t *inner = chain_of(list, n);
  dp_cache_hooks_t twice[2] = {dp_cache_hooks_chain_hooks(inner), dp_cache_hooks_chain_hooks(inner)};
  dp_cache_hooks_chain_t *outer = chain_of(twice, 2);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(outer);
  dp_error_t e;
  int local;
  cr_assert_eq(h.record_stream(h.ctx, &local, NULL, &e), DP_ENOTFOUND);
  char want[128];
  snprintf(want, sizeof want, "record_stream(%p): owned by none of the chain's %zu allocators", (void *)&local, n);
  cr_assert_str_eq(e.message, want, "the second copy left out");
  dp_cache_hooks_chain_free(outer);
  dp_cache_hooks_chain_free(inner);
  free(list);
  free(x);
}

Test(allocator, a_chain_leaves_out_only_the_nested_repeats_and_keeps_the_order_of_the_rest) {
  ext_t *x = calloc(3, sizeof *x);
  dp_stream_t *u = stream(H0);
  dp_cache_hooks_t a = ext_hooks(&x[0], 0), b = ext_hooks(&x[1], 0), c = ext_hooks(&x[2], 0);
  dp_cache_hooks_chain_t *inner = chain_of((dp_cache_hooks_t[3]){b, a, c}, 3);
  /* a, then the inner chain (b, a again: left out, c), then b again: kept, given directly */
  dp_cache_hooks_chain_t *outer = chain_of((dp_cache_hooks_t[3]){a, dp_cache_hooks_chain_hooks(inner), b}, 3);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(outer);
  dp_error_t e;
  int local;
  cr_assert_eq(h.record_stream(h.ctx, &local, u, &e), DP_ENOTFOUND);
  char want[128];
  snprintf(want, sizeof want, "record_stream(%p): owned by none of the chain's 4 allocators", (void *)&local);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(x[0].single_calls, 1, "a asked once: its copy from the inner chain left out");
  cr_assert_eq(x[1].single_calls, 2, "b asked twice: the repeat was given directly");
  cr_assert_eq(x[2].single_calls, 1);
  void *ptrs[1] = {x[2].arena};
  OK(dp_cache_hooks_record(&h, ptrs, 1, u, T_ERR));
  cr_assert_eq(x[2].nlog, 1, "c, after a and b, recorded its pointer");
  cr_assert_eq(x[0].single_calls + x[1].single_calls, 3 + 2, "a and b were asked first, once each more");
  dp_cache_hooks_chain_free(outer);
  dp_cache_hooks_chain_free(inner);
  dp_stream_free(u);
  free(x);
}

/* Out of memory finding the repeats: DP_ENOMEM, naming the call, nothing made. */
Test(allocator, a_nested_chain_that_cannot_find_its_repeats_for_memory_is_enomem_and_leaks_nothing) {
  ext_t *x = calloc(1, sizeof *x);
  dp_cache_hooks_chain_t *inner = chain_of((dp_cache_hooks_t[1]){ext_hooks(x, 0)}, 1);
  dp_cache_hooks_t list[2] = {dp_cache_hooks_chain_hooks(inner), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *ch = NULL;
  dp_error_t e;
  t_fail_at = t_alloc_count + 2; /* the chain, then the scratch of the repeats */
  cr_assert_eq(dp_cache_hooks_chain_new(list, 2, &ch, &e), DP_ENOMEM);
  t_fail_at = 0;
  cr_assert_str_eq(e.message, "dp_cache_hooks_chain_new: out of memory finding the repeats among 2 hooks");
  cr_assert_eq(e.code, DP_ENOMEM);
  cr_assert_null(ch);
  dp_cache_hooks_chain_free(inner);
  free(x);
  dp_cache_free(C);
  C = NULL;
  dp_shutdown();
  ASSERT_NO_LEAK();
}

/* cache.h's errors follow device.h: a message names the function called.
 * A chain that could not be allocated said only "out of memory creating a
 * hooks chain", the one failure of the cache module that named no call. */
Test(allocator, a_chain_that_cannot_be_allocated_names_the_call_and_its_size) {
  dp_cache_hooks_chain_t *ch = NULL;
  dp_error_t e;
  dp_cache_hooks_t list[2] = {dp_cache_hooks(C), dp_cache_hooks(C)};
  t_fail_at = t_alloc_count + 1;
  cr_assert_eq(dp_cache_hooks_chain_new(list, 2, &ch, &e), DP_ENOMEM);
  t_fail_at = 0;
  cr_assert_str_eq(e.message, "dp_cache_hooks_chain_new: out of memory creating a chain of 2 hooks");
  cr_assert_eq(e.code, DP_ENOMEM);
  cr_assert_null(ch);
}

/* record_streams_owned without the owned array: the cache's hook recorded
 * the pointer and returned 0 where the chain's refuses (a caller would
 * never learn what the allocator owns). Both refuse it alike, recording
 * nothing. */
Test(allocator, the_caches_record_streams_owned_refuses_a_null_owned_as_the_chains_does) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 64, s, &p, T_ERR));
  dp_cache_hooks_chain_t *ch;
  dp_cache_hooks_t one = dp_cache_hooks(C);
  OK(dp_cache_hooks_chain_new(&one, 1, &ch, T_ERR));
  dp_cache_hooks_t hooks[2] = {dp_cache_hooks(C), dp_cache_hooks_chain_hooks(ch)};
  for (int i = 0; i < 2; i++) {
    dp_error_t e;
    cr_assert_eq(hooks[i].record_streams_owned(hooks[i].ctx, &p, 1, u, NULL, &e), DP_EINVAL, "%s", i ? "chain" : "cache");
    cr_assert_str_eq(e.message, "record_streams_owned: NULL owned with n = 1");
    OK(hooks[i].record_streams_owned(hooks[i].ctx, NULL, 0, u, NULL, T_ERR));
  }
  _Atomic int gate = 0; /* u held: a block recorded on it would wait for it */
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0, "the refused record recorded nothing on u");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  dp_cache_hooks_chain_free(ch);
  dp_stream_free(u);
  dp_stream_free(s);
}

/* A hook is the caller's callback (base.h): a positive return would read as
 * success to a caller testing rc < 0, and an error without a message would
 * reach the caller as code 0. Both come out as the library's own errors,
 * through the plain record and through a chain. */
static int hook_rc_ret;
static int hook_one_rc(void *ctx, void *p, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)p, (void)s, (void)err;
  return hook_rc_ret;
}
static int hook_many_rc(void *ctx, void *const *p, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)p, (void)n, (void)s, (void)err;
  return hook_rc_ret;
}

Test(allocator, a_hook_that_returns_a_positive_code_or_fails_without_a_message_gets_the_librarys_error) {
  dp_stream_t *u = stream(H0);
  void *ptrs[1] = {(void *)0x1000};
  dp_cache_hooks_t one = {NULL, hook_one_rc, NULL, NULL}, many = {NULL, NULL, hook_many_rc, NULL};
  dp_cache_hooks_chain_t *ch;
  OK(dp_cache_hooks_chain_new(&one, 1, &ch, T_ERR));
  dp_cache_hooks_t chained = dp_cache_hooks_chain_hooks(ch);
  dp_error_t e;
  hook_rc_ret = 7;
  cr_assert_eq(dp_cache_hooks_record(&one, ptrs, 1, u, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "the record_stream hook returned 7: a callback returns 0 or a negative DP_E* code");
  cr_assert_eq(dp_cache_hooks_record(&many, ptrs, 1, u, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "the record_streams hook returned 7: a callback returns 0 or a negative DP_E* code");
  cr_assert_eq(chained.record_streams(chained.ctx, ptrs, 1, u, &e), DP_EINVAL);
  cr_assert_eq(chained.record_stream(chained.ctx, ptrs[0], u, &e), DP_EINVAL);
  cr_assert_eq(e.code, DP_EINVAL);
  hook_rc_ret = DP_EIO;
  cr_assert_eq(dp_cache_hooks_record(&many, ptrs, 1, u, &e), DP_EIO);
  cr_assert_eq(e.code, DP_EIO);
  cr_assert_str_eq(e.message, "the record_streams hook failed: i/o error");
  cr_assert_eq(chained.record_streams(chained.ctx, ptrs, 1, u, &e), DP_EIO);
  cr_assert_str_eq(e.message, "the record_stream hook failed: i/o error");
  dp_cache_hooks_chain_free(ch);
  dp_stream_free(u);
}

/* A hook fills err by hand (base.h): the message it wrote is the error's,
 * with the code it returned; a call before it that succeeded leaves nothing
 * that passes for a failure's message. */
static int hook_says_why(void *ctx, void *p, dp_stream_t *s, dp_error_t *err) {
  (void)ctx, (void)s;
  if (p == (void *)0x1000) { /* recorded, with a note left behind */
    snprintf(err->message, sizeof err->message, "recorded 0x1000");
    return 0;
  }
  if (p == (void *)0x2000) return DP_EIO; /* fails without a word */
  snprintf(err->message, sizeof err->message, "stream %p is being torn down", (void *)s);
  return DP_ESTATE;
}

Test(allocator, a_hook_that_writes_its_message_without_its_code_keeps_the_message_with_the_code_it_returned) {
  dp_stream_t *u = stream(H0);
  dp_cache_hooks_t one = {NULL, hook_says_why, NULL, NULL};
  dp_cache_hooks_chain_t *ch;
  OK(dp_cache_hooks_chain_new(&one, 1, &ch, T_ERR));
  dp_cache_hooks_t chained = dp_cache_hooks_chain_hooks(ch);
  char want[128];
  snprintf(want, sizeof want, "stream %p is being torn down", (void *)u);
  void *ptrs[2] = {(void *)0x1000, (void *)0x3000};
  dp_error_t e;
  cr_assert_eq(dp_cache_hooks_record(&one, ptrs, 2, u, &e), DP_ESTATE);
  cr_assert_eq(e.code, DP_ESTATE);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(chained.record_streams(chained.ctx, ptrs, 2, u, &e), DP_ESTATE);
  cr_assert_eq(e.code, DP_ESTATE);
  cr_assert_str_eq(e.message, want);
  ptrs[1] = (void *)0x2000;
  cr_assert_eq(dp_cache_hooks_record(&one, ptrs, 2, u, &e), DP_EIO);
  cr_assert_str_eq(e.message, "the record_stream hook failed: i/o error");
  dp_cache_hooks_chain_free(ch);
  dp_stream_free(u);
}

/* An allocator that has only the marking batch (no record_stream) says
 * what it owns through that batch, one pointer at a time, when a chain's
 * single record offers it a pointer. */
Test(allocator, a_chains_single_record_asks_an_allocator_with_only_the_marking_batch_through_it) {
  ext_t *x = calloc(1, sizeof *x);
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  dp_cache_hooks_t list[2] = {{x, NULL, NULL, ext_record_owned}, dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *ch = chain_of(list, 2);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
  OK(h.record_stream(h.ctx, x->arena + 5, u, T_ERR));
  cr_assert_eq(x->batch_calls, 1, "one marking batch of one pointer");
  cr_assert(x->nlog == 1 && x->logged[0] == x->arena + 5 && x->on[0] == u, "the allocator recorded its pointer");
  OK(h.record_stream(h.ctx, p, u, T_ERR));
  cr_assert_eq(x->batch_calls, 2);
  cr_assert_eq(x->nlog, 1, "the cache's pointer is not the allocator's: it went on to the cache");
  int nobody;
  dp_error_t e;
  char want[128];
  cr_assert_eq(h.record_stream(h.ctx, &nobody, u, &e), DP_ENOTFOUND);
  snprintf(want, sizeof want, "record_stream(%p): owned by none of the chain's 2 allocators", (void *)&nobody);
  cr_assert_str_eq(e.message, want);
  x->fail = 1;
  snprintf(want, sizeof want, "ext: no room to record %p", (void *)(x->arena + 6));
  cr_assert_eq(h.record_stream(h.ctx, x->arena + 6, u, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, want);
  _Atomic int gate = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 1, "the cache recorded its pointer");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  dp_cache_hooks_chain_free(ch);
  free(x);
  dp_stream_free(s);
  dp_stream_free(u);
}

/* err is the caller's (device.h): a chain writes it on a failure only, and
 * takes a NULL one. A record that succeeds leaves what err held before. */
Test(allocator, a_chain_writes_err_only_on_a_failure_and_takes_a_null_err) {
  ext_t *x = calloc(1, sizeof *x);
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  for (int batched = 0; batched < 2; batched++) {
    dp_cache_hooks_t list[2] = {ext_hooks(x, batched), dp_cache_hooks(C)};
    dp_cache_hooks_chain_t *ch = chain_of(list, 2);
    dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
    void *ptrs[2] = {x->arena, p};
    dp_error_t e;
    x->fail = 0;
    e.code = DP_EIO;
    snprintf(e.message, sizeof e.message, "an earlier failure");
    OK(h.record_stream(h.ctx, p, u, &e));
    OK(h.record_stream(h.ctx, x->arena, u, &e));
    OK(h.record_streams(h.ctx, ptrs, 2, u, &e));
    unsigned char owned[2] = {0, 0};
    OK(h.record_streams_owned(h.ctx, ptrs, 2, u, owned, &e));
    cr_assert(owned[0] && owned[1]);
    cr_assert_eq(e.code, DP_EIO, "records that succeeded left err alone (batched %d)", batched);
    cr_assert_str_eq(e.message, "an earlier failure");
    x->fail = 1;
    cr_assert_eq(h.record_stream(h.ctx, x->arena, u, NULL), DP_ENOMEM);
    cr_assert_eq(h.record_streams(h.ctx, ptrs, 2, u, NULL), DP_ENOMEM);
    cr_assert_eq(h.record_streams_owned(h.ctx, ptrs, 2, u, owned, NULL), DP_ENOMEM);
    dp_cache_hooks_chain_free(ch);
  }
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_stream_synchronize(u, T_ERR));
  free(x);
  dp_stream_free(s);
  dp_stream_free(u);
}

/* Each hook a chain calls starts from a clear error: a hook failing without
 * a word gets the message naming it, never what an earlier call left. */
static int marking_rc(void *ctx, void *const *p, size_t n, dp_stream_t *s, unsigned char *owned, dp_error_t *err) {
  (void)p, (void)n, (void)s, (void)owned;
  if (*(int *)ctx) return DP_EIO; /* fails without a word */
  snprintf(err->message, sizeof err->message, "the first failure's message");
  return DP_ESTATE;
}

Test(allocator, a_chain_hook_failing_without_a_message_never_reports_an_earlier_failures) {
  dp_stream_t *u = stream(H0);
  int quiet = 0;
  dp_cache_hooks_t list[1] = {{&quiet, NULL, NULL, marking_rc}};
  dp_cache_hooks_chain_t *ch = chain_of(list, 1);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
  void *ptrs[1] = {(void *)0x1000};
  dp_error_t e1, e2;
  /* back to back: the second call's frames are where the first's were */
  int rc1 = h.record_streams(h.ctx, ptrs, 1, u, &e1);
  quiet = 1;
  int rc2 = h.record_streams(h.ctx, ptrs, 1, u, &e2);
  cr_assert_eq(rc1, DP_ESTATE);
  cr_assert_str_eq(e1.message, "the first failure's message");
  cr_assert_eq(rc2, DP_EIO);
  cr_assert_str_eq(e2.message, "the record_streams_owned hook failed: i/o error");
  dp_cache_hooks_chain_free(ch);
  dp_stream_free(u);
}

/* dp_cache_hooks_record writes err on a failure only, and takes a NULL
 * one, by either of its ways of calling the hooks. */
Test(allocator, a_record_through_hooks_writes_err_only_on_a_failure_and_takes_a_null_err) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  struct dp_backend other = {.type = DP_DEVICE_CUDA, .name = "cuda", .ndev = 1};
  struct dp_stream foreign = {.b = &other, .dev = {DP_DEVICE_CUDA, 0}};
  void *ptrs[1] = {p};
  for (int batched = 1; batched >= 0; batched--) {
    dp_cache_hooks_t h = dp_cache_hooks(C);
    if (!batched) h.record_streams = NULL;
    dp_error_t e;
    e.code = DP_EIO;
    snprintf(e.message, sizeof e.message, "an earlier failure");
    OK(dp_cache_hooks_record(&h, ptrs, 1, u, &e));
    cr_assert_eq(e.code, DP_EIO, "a record that succeeded left err alone (batched %d)", batched);
    cr_assert_str_eq(e.message, "an earlier failure");
    OK(dp_cache_hooks_record(&h, ptrs, 1, u, NULL));
    cr_assert_eq(dp_cache_hooks_record(&h, ptrs, 1, &foreign, NULL), DP_EINVAL);
  }
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_stream_synchronize(u, T_ERR));
  dp_stream_free(s);
  dp_stream_free(u);
}

/* dp_cache_hooks_record gives the hook a clear error: a hook failing
 * without a word gets the message naming it, never what an earlier call
 * left. */
static int batch_rc(void *ctx, void *const *p, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)p, (void)n, (void)s;
  if (*(int *)ctx) return DP_EIO; /* fails without a word */
  snprintf(err->message, sizeof err->message, "the first failure's message");
  return DP_ESTATE;
}

Test(allocator, a_record_through_hooks_failing_without_a_message_never_reports_an_earlier_failures) {
  dp_stream_t *u = stream(H0);
  int quiet = 0;
  dp_cache_hooks_t h = {&quiet, NULL, batch_rc, NULL};
  void *ptrs[1] = {(void *)0x1000};
  dp_error_t e1, e2;
  /* back to back: the second call's frame is where the first's was */
  int rc1 = dp_cache_hooks_record(&h, ptrs, 1, u, &e1);
  quiet = 1;
  int rc2 = dp_cache_hooks_record(&h, ptrs, 1, u, &e2);
  cr_assert_eq(rc1, DP_ESTATE);
  cr_assert_str_eq(e1.message, "the first failure's message");
  cr_assert_eq(rc2, DP_EIO);
  cr_assert_str_eq(e2.message, "the record_streams hook failed: i/o error");
  dp_stream_free(u);
}

/* A chain's batches refuse NULL ptrs with n > 0 before any allocator sees
 * them (an allocator's own hook might not check). */
Test(allocator, a_chains_batches_refuse_null_ptrs_for_a_nonzero_count) {
  ext_t *x = calloc(1, sizeof *x);
  dp_stream_t *u = stream(H0);
  dp_cache_hooks_t list[2] = {ext_hooks(x, 1), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *ch = chain_of(list, 2);
  dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(ch);
  dp_error_t e;
  unsigned char owned[1];
  cr_assert_eq(h.record_streams(h.ctx, NULL, 3, u, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams: NULL ptrs with n = 3");
  cr_assert_eq(h.record_streams_owned(h.ctx, NULL, 2, u, owned, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams_owned: NULL ptrs with n = 2");
  cr_assert_eq(x->batch_calls + x->single_calls, 0, "no allocator was asked");
  OK(h.record_streams(h.ctx, NULL, 0, u, T_ERR));
  dp_cache_hooks_chain_free(ch);
  free(x);
  dp_stream_free(u);
}

/* The refusals of sizes too large to round named neither the function nor
 * the reason ("allocation of 18446744073709551615 bytes"). */
Test(allocator, a_size_too_large_to_round_is_enomem_naming_the_function_and_the_reason) {
  dp_stream_t *u = stream(H0);
  void *p;
  dp_error_t e;
  cr_assert_eq(dp_cache_alloc(C, H0, SIZE_MAX, u, &p, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_cache_alloc: 18446744073709551615 bytes cannot be rounded up to a 2 MiB segment");
  cr_assert_eq(dp_device_alloc(B, H0, SIZE_MAX, &p, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_device_alloc: 18446744073709551615 bytes on host:0 cannot be allocated with its 256-byte alignment");
  dp_stream_free(u);
}

/* A stream of another backend was stored as a use: no event of the host
 * backend can be made on it, so the freed block waited for the stream to
 * go idle — and the cache never heard of that stream's destruction (it
 * follows its own backend's streams), so the poll after it queried freed
 * memory. Such a record is refused, singly and in a batch, and stores
 * nothing; the batch still skips pointers that are not the allocator's. */
Test(allocator, a_record_on_a_stream_of_another_backend_is_einval_and_holds_nothing_back) {
  dp_stream_t *s = stream(H0);
  void *p, *q;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  struct dp_backend other = {.type = DP_DEVICE_CUDA, .name = "cuda", .ndev = 1};
  struct dp_stream foreign = {.b = &other, .dev = {DP_DEVICE_CUDA, 0}};
  dp_error_t e;
  cr_assert_eq(dp_cache_record_stream(C, p, &foreign, &e), DP_EINVAL);
  char want[200];
  snprintf(want, sizeof want, "dp_cache_record_stream(%p): the stream is on cuda:0, of the cuda backend; this allocator's memory "
           "is the host backend's, whose reuse only its own streams can order", p);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(dp_cache_record_stream(C, (char *)p + 100, &foreign, &e), DP_EINVAL, "an interior pointer too");
  dp_cache_hooks_t h = dp_cache_hooks(C);
  static char elsewhere[64];
  void *others[2] = {elsewhere, elsewhere + 8};
  OK(h.record_streams(h.ctx, others, 2, &foreign, T_ERR)); /* not the allocator's: skipped */
  /* the error stops the batch: a pointer skipped after it does not clear it */
  void *mine[3] = {elsewhere, p, elsewhere + 8};
  unsigned char owned[3] = {0};
  dp_error_clear(&e); /* the batch's own error, not the one above's */
  cr_assert_eq(h.record_streams_owned(h.ctx, mine, 3, &foreign, owned, &e), DP_EINVAL);
  cr_assert_eq(e.code, DP_EINVAL);
  snprintf(want, sizeof want, "record_stream(%p): the stream is on cuda:0, of the cuda backend; this allocator's memory "
           "is the host backend's, whose reuse only its own streams can order", p);
  cr_assert_str_eq(e.message, want);
  dp_error_clear(&e);
  cr_assert_eq(h.record_streams(h.ctx, mine, 3, &foreign, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(dp_cache_hooks_record(&h, mine, 3, &foreign, &e), DP_EINVAL);
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0, "nothing was recorded: the block is free at once");
  OK(dp_cache_alloc(C, H0, 4096, s, &q, T_ERR));
  cr_assert_eq(q, p, "and reused at once on its stream");
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(s);
}

/* An entirely free segment goes back only once an event marks where its
 * stream is; when that event cannot be made (out of memory), the segment
 * stays cached — and dp_cache_empty said 0, as if the cache were empty. */
Test(allocator, emptying_the_cache_reports_a_segment_kept_for_want_of_memory) {
  dp_stream_t *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  t_fail_at = t_alloc_count + 1; /* the event pool is empty: the event must be made, and that fails */
  cr_assert_eq(dp_cache_empty(C, NULL), DP_ENOMEM, "told without an err");
  t_fail_at = t_alloc_count + 1;
  dp_error_t e;
  int rc = dp_cache_empty(C, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s", dp_err_name(rc));
  cr_assert(strstr(e.message, "dp_cache_empty: a free segment of host:0 stays cached: ") == e.message, "%s", e.message);
  cr_assert(strstr(e.message, "stays cached: dp_event_new(host:0): out of memory") != NULL, "and why: %s", e.message);
  cr_assert_eq(stats(H0).reserved, 2 << 20, "the segment is still the cache's");
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved, 0, "and goes back when memory allows");
  dp_stream_free(s);
}

/* The first segment kept for want of an event is reported even when the
 * segments after it go back. */
/* dp_cache_empty reclaims every pending block whose streams are done, not
 * only the few an allocation's poll looks at, and gives back the segments
 * that leaves free, however many blocks still held come before. */
Test(allocator, emptying_the_cache_gives_back_a_segment_whose_pending_block_is_done_behind_many_held_ones,
     .timeout = 20) {
  enum { N = 9 };
  /* slow on another device: the segment's free waits for H0's streams (device.h), not for it */
  dp_stream_t *s = stream(H0), *slow = stream(H1), *quick = stream(H0);
  void *a[N], *big;
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 4096, s, &a[i], T_ERR));
  OK(dp_cache_alloc(C, H0, 2 << 20, s, &big, T_ERR)); /* a large segment of its own */
  /* while a gate is shut nothing asserts: the first failure is kept for later */
  _Atomic int slow_open = 0, quick_open = 0;
  dp_error_t e;
  dp_error_clear(&e);
  int rc = dp_host_launch(slow, gate_wait, &slow_open, &e);
  if (!rc) rc = dp_host_launch(quick, gate_wait, &quick_open, &e);
  for (int i = 0; i < N && !rc; i++) rc = dp_cache_record_stream(C, a[i], slow, &e);
  if (!rc) rc = dp_cache_record_stream(C, big, quick, &e);
  for (int i = 0; i < N && !rc; i++) rc = dp_cache_dealloc(C, a[i], &e);
  if (!rc) rc = dp_cache_dealloc(C, big, &e);
  atomic_store(&quick_open, 1);
  if (!rc) rc = dp_stream_synchronize(quick, &e);
  if (!rc) rc = dp_cache_empty(C, &e);
  atomic_store(&slow_open, 1);
  OK_WITH(&e, rc);
  dp_cache_stats_t st = stats(H0);
  cr_assert(st.reserved == 2 << 20 && st.segment_frees == 1, "the large segment went back: %zu bytes reserved",
            st.reserved);
  OK(dp_stream_synchronize(slow, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(quick);
  dp_stream_free(slow);
  dp_stream_free(s);
}

/* An allocation out of memory reclaims every pending block whose streams
 * are done before it frees the cache and retries, however many blocks
 * still held come before: the segment that frees is what it needs. */
Test(allocator, an_allocation_out_of_memory_reclaims_a_finished_pending_block_behind_many_held_ones, .timeout = 20) {
  enum { N = 20 };
  OK(dp_host_set_memory_limit(H0, 4u << 20, T_ERR));
  /* slow on another device: the segment's free waits for H0's streams (device.h), not for it */
  dp_stream_t *s = stream(H0), *slow = stream(H1), *quick = stream(H0);
  void *a[N], *big, *again = NULL;
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 4096, s, &a[i], T_ERR));
  OK(dp_cache_alloc(C, H0, 2 << 20, s, &big, T_ERR)); /* the limit reached */
  /* while a gate is shut nothing asserts: the first failure is kept for later */
  _Atomic int slow_open = 0, quick_open = 0;
  dp_error_t e;
  dp_error_clear(&e);
  int rc = dp_host_launch(slow, gate_wait, &slow_open, &e);
  if (!rc) rc = dp_host_launch(quick, gate_wait, &quick_open, &e);
  for (int i = 0; i < N && !rc; i++) rc = dp_cache_record_stream(C, a[i], slow, &e);
  if (!rc) rc = dp_cache_record_stream(C, big, quick, &e);
  for (int i = 0; i < N && !rc; i++) rc = dp_cache_dealloc(C, a[i], &e);
  if (!rc) rc = dp_cache_dealloc(C, big, &e);
  atomic_store(&quick_open, 1);
  if (!rc) rc = dp_stream_synchronize(quick, &e);
  if (!rc) rc = dp_cache_alloc(C, H0, 2 << 20, s, &again, &e);
  atomic_store(&slow_open, 1);
  OK_WITH(&e, rc);
  dp_cache_stats_t st = stats(H0);
  cr_assert(st.oom_retries == 1 && st.segment_frees == 1, "big's segment went back for the retry");
  OK(dp_cache_dealloc(C, again, T_ERR));
  OK(dp_stream_synchronize(slow, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(quick);
  dp_stream_free(slow);
  dp_stream_free(s);
  OK(dp_host_set_memory_limit(H0, 0, T_ERR));
}

/* An allocation out of memory frees the cache and tries again; freeing
 * lets the lock go while the device's streams are waited for, and a host
 * function that the wait waits for cached a segment of its own meanwhile:
 * that segment is freed in turn and the allocation made (it failed, with
 * 0 bytes allocated and 2 MiB reserved, the whole of the cache free). */
static void wait_for_a_segment_to_go_back(void *allocate_then) {
  dp_cache_stats_t st = {0};
  while (dp_cache_stats(C, H0, &st, NULL) == 0 && st.segment_frees == 0) sched_yield();
  void *p;
  if (allocate_then && dp_cache_alloc(C, H0, 4096, NULL, &p, NULL) == 0) dp_cache_dealloc(C, p, NULL);
}

Test(allocator, an_allocation_out_of_memory_frees_what_was_cached_while_it_freed_the_cache, .timeout = 20) {
  dp_stream_t *m = stream(H0), *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, m, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR)); /* a free 2 MiB segment, cached */
  OK(dp_host_set_memory_limit(H0, 4u << 20, T_ERR));
  OK(dp_host_launch(s, wait_for_a_segment_to_go_back, (void *)1, T_ERR)); /* and cache one */
  dp_error_t e;
  int rc = dp_cache_alloc(C, H0, 3u << 20, m, &p, &e); /* a 4 MiB segment: only the cache's 2 MiB stand in its way */
  OK(dp_stream_synchronize(s, T_ERR));
  OK(dp_host_set_memory_limit(H0, 0, T_ERR));
  OK_WITH(&e, rc);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.segment_frees, 2, "the first segment, then the one the host function cached");
  cr_assert_eq(st.oom_retries, 2);
  cr_assert_eq(st.reserved, 4u << 20);
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);
  dp_stream_free(m);
}

/* The same for a pending block whose stream finished while the cache was
 * freed: it is reclaimed, its segment freed in turn, and the allocation
 * made. */

Test(allocator, an_allocation_out_of_memory_reclaims_a_block_that_finished_while_it_freed_the_cache, .timeout = 20) {
  dp_stream_t *m = stream(H0), *g = stream(H0);
  void *x, *y, *p;
  OK(dp_cache_alloc(C, H0, 4096, m, &x, T_ERR));        /* a small segment, 2 MiB */
  OK(dp_cache_alloc(C, H0, 3u << 19, m, &y, T_ERR));    /* a large one, 2 MiB */
  OK(dp_host_set_memory_limit(H0, 4u << 20, T_ERR));   /* reached */
  OK(dp_cache_dealloc(C, x, T_ERR));                    /* its segment is free */
  OK(dp_host_launch(g, wait_for_a_segment_to_go_back, NULL, T_ERR));
  OK(dp_cache_record_stream(C, y, g, T_ERR));
  OK(dp_cache_dealloc(C, y, T_ERR)); /* pending until g's function returns */
  dp_error_t e;
  int rc = dp_cache_alloc(C, H0, 3u << 20, m, &p, &e); /* a 4 MiB segment */
  OK(dp_stream_synchronize(g, T_ERR));
  OK(dp_host_set_memory_limit(H0, 0, T_ERR));
  OK_WITH(&e, rc);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.segment_frees, 2, "x's segment, then y's once y came back");
  cr_assert_eq(st.oom_retries, 2);
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(g);
  dp_stream_free(m);
}

/* A block freed with no recorded use is reusable at once on its stream,
 * however many blocks wait for slow streams: it waits in no pending list. */
Test(allocator, a_block_freed_behind_many_pending_ones_is_reusable_at_once_on_its_stream, .timeout = 20) {
  enum { N = 9 };
  dp_stream_t *s = stream(H0), *slow = stream(H1);
  void *a[N], *x, *again = NULL;
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 4096, s, &a[i], T_ERR));
  OK(dp_cache_alloc(C, H0, 8192, s, &x, T_ERR)); /* a class of its own */
  /* while the gate is shut nothing asserts: the first failure is kept for later */
  _Atomic int slow_open = 0;
  dp_error_t e;
  dp_error_clear(&e);
  int rc = dp_host_launch(slow, gate_wait, &slow_open, &e);
  for (int i = 0; i < N && !rc; i++) rc = dp_cache_record_stream(C, a[i], slow, &e);
  for (int i = 0; i < N && !rc; i++) rc = dp_cache_dealloc(C, a[i], &e);
  if (!rc) rc = dp_cache_dealloc(C, x, &e);
  if (!rc) rc = dp_cache_alloc(C, H0, 8192, s, &again, &e);
  atomic_store(&slow_open, 1);
  OK_WITH(&e, rc);
  cr_assert_eq(again, x, "x came back at once (got %p, x %p)", again, x);
  OK(dp_cache_dealloc(C, again, T_ERR));
  OK(dp_stream_synchronize(slow, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  dp_stream_free(slow);
  dp_stream_free(s);
}

/* A block a poll took back from ahead of another pending one can be freed
 * pending again after that one came back, and is then polled back once,
 * like any other. */
Test(allocator, a_block_reclaimed_ahead_of_a_held_one_can_be_pending_again, .timeout = 20) {
  dp_stream_t *s = stream(H0), *slow = stream(H1), *quick = stream(H0);
  void *held, *a, *again = NULL;
  OK(dp_cache_alloc(C, H0, 4096, s, &a, T_ERR));
  OK(dp_cache_alloc(C, H0, 8192, s, &held, T_ERR));
  /* while a gate is shut nothing asserts: the first failure is kept for later */
  _Atomic int slow_open = 0, quick_open[2] = {0, 0};
  dp_error_t e;
  dp_error_clear(&e);
  int back[2] = {-1, -1};
  int rc = dp_host_launch(slow, gate_wait, &slow_open, &e);
  if (!rc) rc = dp_host_launch(quick, gate_wait, &quick_open[0], &e);
  if (!rc) rc = dp_cache_record_stream(C, a, quick, &e);
  if (!rc) rc = dp_cache_record_stream(C, held, slow, &e);
  if (!rc) rc = dp_cache_dealloc(C, a, &e); /* the pending list: a, held */
  if (!rc) rc = dp_cache_dealloc(C, held, &e);
  atomic_store(&quick_open[0], 1);
  if (!rc) rc = dp_stream_synchronize(quick, &e);
  if (!rc) rc = back[0] = dp_cache_poll(C, &e); /* a comes back from ahead of held */
  atomic_store(&slow_open, 1);
  if (rc > 0) rc = dp_stream_synchronize(slow, &e);
  if (!rc) rc = dp_cache_alloc(C, H0, 4096, s, &again, &e); /* its poll takes held back */
  if (!rc && again == a) rc = dp_host_launch(quick, gate_wait, &quick_open[1], &e);
  if (!rc && again == a) rc = dp_cache_record_stream(C, again, quick, &e);
  if (!rc && again == a) rc = dp_cache_dealloc(C, again, &e); /* pending again, alone */
  atomic_store(&quick_open[1], 1);
  if (!rc) rc = dp_stream_synchronize(quick, &e);
  if (!rc) rc = back[1] = dp_cache_poll(C, &e);
  if (rc > 0) rc = 0;
  OK_WITH(&e, rc);
  cr_assert(back[0] == 1 && back[1] == 1 && again == a, "polls took back %d then %d blocks; a again: %d", back[0],
            back[1], again == a);
  dp_cache_stats_t st = stats(H0);
  cr_assert(st.pending_blocks == 0 && st.pending_bytes == 0, "%zu blocks pending", st.pending_blocks);
  dp_stream_free(quick);
  dp_stream_free(slow);
  dp_stream_free(s);
}

Test(allocator, emptying_the_cache_reports_a_kept_segment_though_a_later_one_goes_back) {
  dp_stream_t *s = stream(H0);
  void *p[2];
  for (int i = 0; i < 2; i++) OK(dp_cache_alloc(C, H0, 2 << 20, s, &p[i], T_ERR)); /* two large segments */
  for (int i = 0; i < 2; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  t_fail_at = t_alloc_count + 1; /* the first event fails, the second is made */
  dp_error_t e;
  int rc = dp_cache_empty(C, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s", dp_err_name(rc));
  cr_assert(strstr(e.message, "dp_cache_empty: a free segment of host:0 stays cached: ") == e.message, "%s", e.message);
  dp_cache_stats_t st = stats(H0);
  cr_assert(st.reserved == 2 << 20 && st.segment_frees == 1, "one went back, one stayed: %zu bytes reserved",
            st.reserved);
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved, 0);
  dp_stream_free(s);
}

/* Free blocks of one size class share a bin, marked non-empty in its
 * word of the bitmap and that word in the summary. A second block freed
 * into a bin that already holds one must leave both marks set: the next
 * allocation of that class, and of a smaller class whose own word is
 * empty, take those blocks rather than split the segment's free remainder
 * or make a new segment. */
Test(allocator, a_second_block_freed_into_a_size_class_is_found_again_by_both_searches) {
  dp_stream_t *s = stream(H0);
  char *a, *x, *b, *y, *q, *r;
  OK(dp_cache_alloc(C, H0, 40 << 10, s, (void **)&a, T_ERR));
  OK(dp_cache_alloc(C, H0, 512, s, (void **)&x, T_ERR)); /* a and b never merge */
  OK(dp_cache_alloc(C, H0, 40 << 10, s, (void **)&b, T_ERR));
  OK(dp_cache_alloc(C, H0, 512, s, (void **)&y, T_ERR)); /* nor b with the free remainder */
  OK(dp_cache_dealloc(C, a, T_ERR));
  OK(dp_cache_dealloc(C, b, T_ERR)); /* into a's bin */
  OK(dp_cache_alloc(C, H0, 512, s, (void **)&q, T_ERR));
  cr_assert_eq(q, b, "512 bytes (no free block of 32 KiB or less) come from the smallest larger one, b freed last "
               "(got %p; a %p, b %p)", (void *)q, (void *)a, (void *)b);
  OK(dp_cache_alloc(C, H0, 40 << 10, s, (void **)&r, T_ERR));
  cr_assert_eq(r, a, "40 KiB come from a, the block left in that bin (got %p, a %p)", (void *)r, (void *)a);
  cr_assert_eq(stats(H0).segment_allocs, 1);
  char *p[] = {q, r, x, y};
  for (int i = 0; i < 4; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  dp_stream_free(s);
}

/* The largest size that can be rounded up to a 2 MiB segment is asked of
 * the device (and refused there, as memory); one byte more is refused
 * before any rounding. */
Test(allocator, the_largest_size_that_can_be_rounded_is_asked_of_the_device) {
  OK(dp_host_set_memory_limit(H1, 5u << 20, T_ERR)); /* refused by the limit, never by malloc */
  dp_stream_t *s = stream(H1);
  void *p;
  dp_error_t e;
  size_t largest = SIZE_MAX - (2u << 20);
  cr_assert_eq(dp_cache_alloc(C, H1, largest, s, &p, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_cache_alloc(host:1): out of memory allocating 18446744073707454463 bytes (0 allocated, 0 reserved, "
                   "0 pending): dp_device_alloc(host:1): out of memory: 18446744073707454464 bytes asked, 0 of 5242880 in use");
  cr_assert_eq(stats(H1).oom_retries, 1, "the device was asked, and asked again after the cache was freed");
  cr_assert_eq(dp_cache_alloc(C, H1, largest + 1, s, &p, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "dp_cache_alloc: 18446744073707454464 bytes cannot be rounded up to a 2 MiB segment");
  cr_assert_eq(stats(H1).oom_retries, 1);
  dp_stream_free(s);
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
}

/* A stream recorded again on a block is stored once, whether the record
 * names the block or a pointer inside it: a caller that records on every
 * use must not grow the block's list of uses. */
Test(allocator, recording_a_stream_again_on_a_block_stores_nothing_more) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  char *p;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  long blocks = atomic_load(&t_live_blocks), bytes = atomic_load(&t_live_bytes);
  for (int i = 0; i < 100; i++) OK(dp_cache_record_stream(C, p + (i % 2) * 64 * (i % 64), u, T_ERR));
  cr_assert(atomic_load(&t_live_blocks) == blocks && atomic_load(&t_live_bytes) == bytes,
            "100 records more of the same stream: %ld blocks, %ld bytes live (%ld, %ld before)",
            atomic_load(&t_live_blocks), atomic_load(&t_live_bytes), blocks, bytes);
  _Atomic int gate = 0; /* u held until the gate opens: none of its work completes before */
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_cache_stats_t st = stats(H0);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(st.pending_blocks, 1, "the block waits for u");
  cr_assert_eq(dp_cache_poll(C, NULL), 1);
  dp_stream_free(u);
  dp_stream_free(s);
}

/* A block freed but waiting for a recorded stream is no allocation any
 * more: a record on it, by its pointer or one inside it, is refused as one
 * on memory the allocator never handed out, and holds the block for
 * nothing more than what was recorded while it was allocated. */
Test(allocator, a_record_on_a_freed_block_still_pending_is_refused_and_holds_nothing) {
  dp_stream_t *s = stream(H0), *u = stream(H0), *t = stream(H0);
  char *p;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR));
  _Atomic int gate_u = 0, gate_t = 0; /* each stream held until its gate opens */
  OK(dp_host_launch(u, gate_wait, &gate_u, T_ERR));
  OK(dp_host_launch(t, gate_wait, &gate_t, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  int rc[2];
  dp_error_t e[2];
  for (int k = 0; k < 2; k++) rc[k] = dp_cache_record_stream(C, p + 100 * k, t, &e[k]);
  atomic_store(&gate_u, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  int back = dp_cache_poll(C, NULL);
  atomic_store(&gate_t, 1);
  OK(dp_stream_synchronize(t, T_ERR));
  for (int k = 0; k < 2; k++) {
    char want[96];
    snprintf(want, sizeof want, "dp_cache_record_stream(%p): not an allocation of this allocator", (void *)(p + 100 * k));
    cr_assert_eq(rc[k], DP_ENOTFOUND, "%s", dp_err_name(rc[k]));
    cr_assert_str_eq(e[k].message, want);
  }
  cr_assert_eq(back, 1, "the block came back once u was done, t still held");
  dp_stream_free(t);
  dp_stream_free(u);
  dp_stream_free(s);
}

/* A record inside a block on the block's own allocation stream is a no-op,
 * as one naming the block is: freed, the block is reusable at once on that
 * stream, however much work the stream still has. */
Test(allocator, a_record_inside_a_block_on_its_own_stream_holds_nothing) {
  dp_stream_t *s = stream(H0);
  char *p, *q;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR));
  _Atomic int gate = 0; /* s held until the gate opens */
  OK(dp_host_launch(s, gate_wait, &gate, T_ERR));
  OK(dp_cache_record_stream(C, p + 100, s, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_cache_stats_t st = stats(H0);
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&q, T_ERR));
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(s, T_ERR));
  cr_assert_eq(st.pending_blocks, 0, "a record on the allocation stream holds nothing");
  cr_assert_eq(q, p, "reused at once on its stream");
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(s);
}

/* A batch passes the pointers inside a segment whose used blocks are all on
 * the recording stream without a lookup, and marks them owned; the first
 * byte past the segment is not in it, and is left for the next allocator
 * of a chain. */
Test(allocator, a_batch_marks_owned_nothing_past_the_end_of_a_segment) {
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_stream_t *s = stream(H0);
  char *p;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR)); /* a new segment's first block: its base */
  void *ptrs[2] = {p, p + (2 << 20)};
  unsigned char owned[2] = {0};
  OK(h.record_streams_owned(h.ctx, ptrs, 2, s, owned, T_ERR));
  cr_assert(owned[0], "the block is the allocator's");
  cr_assert_not(owned[1], "the byte past its segment is not");
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);
}

/* Free neighbours merge only when tied to the same stream: a block of t
 * merged into s's would be handed to s without waiting for t's work. */
/* NULL, the first pointer of a batch or any other, is nobody's. */
Test(allocator, a_batch_marks_a_null_pointer_not_owned) {
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_stream_t *s = stream(H0);
  char *p;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&p, T_ERR));
  void *ptrs[3] = {NULL, p, NULL};
  unsigned char owned[3] = {0};
  OK(h.record_streams_owned(h.ctx, ptrs, 3, s, owned, T_ERR));
  cr_assert(!owned[0] && owned[1] && !owned[2], "owned: %d %d %d", owned[0], owned[1], owned[2]);
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);
}

Test(allocator, free_neighbours_of_two_streams_never_merge) {
  dp_stream_t *s = stream(H0), *t = stream(H0);
  char *a, *b, *q, *r;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&a, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, t, (void **)&b, T_ERR)); /* from s's remainder: after a */
  cr_assert_eq(b, a + 4096);
  OK(dp_cache_dealloc(C, b, T_ERR)); /* before s's remainder */
  OK(dp_cache_dealloc(C, a, T_ERR)); /* before b */
  uint64_t cross = stats(H0).cross_stream;
  OK(dp_cache_alloc(C, H0, 8192, s, (void **)&q, T_ERR));
  cr_assert_eq(q, b + 4096, "s's 8 KiB come from its remainder, not a and b merged (got %p, a %p)", (void *)q, (void *)a);
  OK(dp_cache_alloc(C, H0, 4096, t, (void **)&r, T_ERR));
  cr_assert_eq(r, b, "t takes its own block back");
  cr_assert_eq(stats(H0).cross_stream, cross, "no block changed streams");
  OK(dp_cache_dealloc(C, q, T_ERR));
  OK(dp_cache_dealloc(C, r, T_ERR));
  dp_stream_free(t);
  dp_stream_free(s);
}

/* Emptying the cache gives back only segments whose blocks are all free: a
 * block pending for a recorded stream keeps its segment, whose memory that
 * stream may still use. */
Test(allocator, emptying_the_cache_keeps_a_segment_with_a_pending_block) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  _Atomic int gate = 0; /* u held until the gate opens */
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  int rc = dp_cache_empty(C, NULL);
  dp_cache_stats_t st = stats(H0);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(rc, 0);
  cr_assert_eq(st.pending_blocks, 1);
  cr_assert_eq(st.reserved, 2 << 20, "the segment stayed while its block was pending");
  cr_assert_eq(st.segment_frees, 0);
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved, 0, "and goes back once the block is free");
  dp_stream_free(u);
  dp_stream_free(s);
}

/* A pending block waits for the work its recorded streams had queued when
 * it was freed, not for those streams to go idle: it comes back while work
 * queued after its free still runs. */
Test(allocator, a_pending_block_comes_back_once_the_work_before_its_free_is_done) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  _Atomic int before = 0, after = 0; /* u's work before the free, and after it */
  OK(dp_host_launch(u, gate_wait, &before, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_event_t *mark;
  OK(dp_event_new(B, H0, &mark, T_ERR));
  OK(dp_event_record(mark, u, T_ERR));
  OK(dp_host_launch(u, gate_wait, &after, T_ERR));
  atomic_store(&before, 1);
  OK(dp_event_synchronize(mark, T_ERR)); /* u is past the free, held by `after` */
  int back = dp_cache_poll(C, NULL);
  atomic_store(&after, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(back, 1, "the block waited for u's later work");
  dp_event_free(mark);
  dp_stream_free(u);
  dp_stream_free(s);
}

/* ---- allocation failures of the calls the sweep above does not make ---- */

enum { AS_CROSS, AS_CHAIN, AS_DEFAULT, AS_EMPTY, AS_COUNT };

typedef struct asweep {
  int op;
  dp_stream_t *s, *u;
  void *p;                       /* AS_CHAIN: a block of C's, recorded through the chain */
  dp_cache_hooks_chain_t *chain;
  dp_cache_t *made;              /* AS_DEFAULT */
} asweep_t;

static void asweep_prepare(void *ctx) {
  asweep_t *a = ctx;
  a->chain = NULL;
  a->made = NULL;
  a->p = NULL;
  if (a->op == AS_DEFAULT) { /* a backend that has made no default allocator yet */
    dp_cache_free(C);
    dp_shutdown();
    OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
    OK(dp_cache_new(B, &C, T_ERR));
  }
  a->s = stream(H0);
  a->u = stream(H0);
  OK(dp_cache_alloc(C, H0, 4096, a->s, &a->p, T_ERR));
  if (a->op != AS_CHAIN) { /* a free block of s's: u takes it by waiting for s, or it goes back */
    OK(dp_cache_dealloc(C, a->p, T_ERR));
    a->p = NULL;
  }
}

static int asweep_run(void *ctx, dp_error_t *e) {
  asweep_t *a = ctx;
  switch (a->op) {
    case AS_CROSS: return dp_cache_alloc(C, H0, 4096, a->u, &a->p, e);
    case AS_CHAIN: {
      dp_cache_hooks_t list[2] = {dp_cache_hooks(C), dp_cache_hooks(C)};
      int rc = dp_cache_hooks_chain_new(list, 2, &a->chain, e);
      if (rc) return rc;
      dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(a->chain);
      return dp_cache_hooks_record(&h, &a->p, 1, a->u, e);
    }
    case AS_DEFAULT: return dp_cache_default(B, &a->made, e);
    default: return dp_cache_empty(C, e);
  }
}

static void asweep_check(void *ctx, int rc, long k) {
  asweep_t *a = ctx;
  dp_cache_stats_t st = stats(H0);
  switch (a->op) {
    case AS_CROSS:
      cr_assert_eq(st.allocated, rc ? 0 : 4096, "allocation %ld", k);
      if (rc) OK(dp_cache_alloc(C, H0, 4096, a->u, &a->p, T_ERR));
      cr_assert_eq(stats(H0).cross_stream, 1, "allocation %ld: u took s's block", k);
      OK(dp_cache_dealloc(C, a->p, T_ERR));
      break;
    case AS_CHAIN:
      if (!a->chain) /* chain_new failed: the record is made through a new one */ a->chain = chain_of((dp_cache_hooks_t[2]){dp_cache_hooks(C), dp_cache_hooks(C)}, 2);
      dp_cache_hooks_t h = dp_cache_hooks_chain_hooks(a->chain);
      OK(dp_cache_hooks_record(&h, &a->p, 1, a->u, T_ERR));
      _Atomic int gate = 0; /* u held until the gate opens */
      OK(dp_host_launch(a->u, gate_wait, &gate, T_ERR));
      OK(dp_cache_dealloc(C, a->p, T_ERR));
      cr_assert_eq(stats(H0).pending_blocks, 1, "allocation %ld: the block is held for u", k);
      atomic_store(&gate, 1);
      OK(dp_stream_synchronize(a->u, T_ERR));
      dp_cache_hooks_chain_free(a->chain);
      break;
    case AS_DEFAULT: {
      dp_cache_t *again;
      OK(dp_cache_default(B, &again, T_ERR));
      if (rc == 0) cr_assert_eq(again, a->made, "allocation %ld: one default allocator", k);
      break;
    }
    default:
      cr_assert_eq(st.reserved, rc ? (size_t)2 << 20 : 0, "allocation %ld: a segment kept for want of memory", k);
      OK(dp_cache_empty(C, T_ERR));
      cr_assert_eq(stats(H0).reserved, 0);
      break;
  }
  dp_stream_free(a->s);
  dp_stream_free(a->u);
  OK(dp_cache_empty(C, T_ERR));
  dp_cache_free(C);
  dp_shutdown(); /* the event pool too */
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "op %d: leak after failing allocation %ld", a->op, k);
  OK(dp_backend_get(DP_DEVICE_HOST, &B, T_ERR));
  OK(dp_cache_new(B, &C, T_ERR));
}

/* Taking another stream's block, a chain's creation and a record through
 * it, the first dp_cache_default and dp_cache_empty: each allocation failure
 * is DP_ENOMEM with a message, leaks nothing and leaves the allocator as it
 * was (the block still free, a segment still cached), ready for the call
 * to succeed next. */
Test(allocator, taking_another_streams_block_chaining_and_emptying_fail_cleanly_at_every_allocation) {
  static const t_sweep_t sw = {asweep_prepare, asweep_run, asweep_check};
  for (int op = 0; op < AS_COUNT; op++) {
    asweep_t a = {.op = op};
    long failed = t_sweep(&sw, &a);
    cr_assert_gt(failed, 0, "op %d: no allocation was failed", op);
  }
}

/* A request for 0 bytes takes the smallest block, 512 bytes, as one for a
 * single byte does — not a block of a larger class. */
Test(allocator, a_zero_byte_allocation_takes_the_smallest_block_of_512_bytes) {
  dp_stream_t *s = stream(H0);
  char *p, *q;
  OK(dp_cache_alloc(C, H0, 0, s, (void **)&p, T_ERR));
  OK(dp_cache_alloc(C, H0, 1, s, (void **)&q, T_ERR));
  void *base;
  size_t size;
  OK(dp_cache_lookup(C, p, &base, &size, T_ERR));
  cr_assert_eq(size, 512, "a 0-byte request took %zu bytes", size);
  cr_assert_eq(q, p + 512, "the next block follows the 512 bytes");
  cr_assert_eq(stats(H0).allocated, 1024);
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_cache_dealloc(C, q, T_ERR));
  cr_assert_eq(stats(H0).allocated, 0);
  dp_stream_free(s);
}

/* As above, the other way round: a block freed after its free neighbour
 * before it, of another stream, stays apart from it too (the merge with
 * the block before checks the stream as the one with the block after). */
Test(allocator, a_block_freed_after_its_free_neighbour_of_another_stream_never_merges_into_it) {
  dp_stream_t *s = stream(H0), *t = stream(H0);
  char *a, *b, *q, *r;
  OK(dp_cache_alloc(C, H0, 4096, s, (void **)&a, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, t, (void **)&b, T_ERR)); /* from s's remainder: after a */
  cr_assert_eq(b, a + 4096);
  OK(dp_cache_dealloc(C, a, T_ERR)); /* a free block of s's ... */
  OK(dp_cache_dealloc(C, b, T_ERR)); /* ... before b, freed on t */
  uint64_t cross = stats(H0).cross_stream;
  OK(dp_cache_alloc(C, H0, 4096, t, (void **)&r, T_ERR));
  cr_assert_eq(r, b, "t takes its own block back (got %p, a %p, b %p)", (void *)r, (void *)a, (void *)b);
  OK(dp_cache_alloc(C, H0, 8192, s, (void **)&q, T_ERR));
  cr_assert_eq(q, b + 4096, "s's 8 KiB come from its remainder, not a and b merged (got %p, a %p)", (void *)q, (void *)a);
  cr_assert_eq(stats(H0).cross_stream, cross, "no block changed streams");
  OK(dp_cache_dealloc(C, q, T_ERR));
  OK(dp_cache_dealloc(C, r, T_ERR));
  dp_stream_free(t);
  dp_stream_free(s);
}

/* Bins of 64 size classes share a word of the bitmap, marked in the
 * summary while any of them holds a block: taking the only block of one
 * class leaves the word marked for the other's, which a smaller request
 * (whose own word is empty) then finds through the summary, rather than
 * split the segment's free remainder. */
Test(allocator, taking_one_size_class_of_a_bitmap_word_leaves_its_other_classes_found) {
  dp_stream_t *s = stream(H0);
  char *x, *sep1, *y, *sep2, *again, *small;
  OK(dp_cache_alloc(C, H0, 36 << 10, s, (void **)&x, T_ERR)); /* 36 and 40 KiB: the second word's classes */
  OK(dp_cache_alloc(C, H0, 512, s, (void **)&sep1, T_ERR));    /* x and y never merge */
  OK(dp_cache_alloc(C, H0, 40 << 10, s, (void **)&y, T_ERR));
  OK(dp_cache_alloc(C, H0, 512, s, (void **)&sep2, T_ERR));    /* nor y with the free remainder */
  OK(dp_cache_dealloc(C, x, T_ERR));
  OK(dp_cache_dealloc(C, y, T_ERR));
  OK(dp_cache_alloc(C, H0, 36 << 10, s, (void **)&again, T_ERR));
  cr_assert_eq(again, x, "36 KiB take x back, its class's only block (got %p, x %p)", (void *)again, (void *)x);
  OK(dp_cache_alloc(C, H0, 512, s, (void **)&small, T_ERR));
  cr_assert_eq(small, y, "512 bytes come from y, the smallest free block, not the remainder (got %p; y %p, remainder %p)",
               (void *)small, (void *)y, (void *)(sep2 + 512));
  cr_assert_eq(stats(H0).segment_allocs, 1);
  char *p[] = {again, sep1, small, sep2};
  for (int i = 0; i < 4; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  dp_stream_free(s);
}

/* The pending bytes count a freed block only while it waits: reclaimed,
 * by a poll or by an allocation's, its bytes leave the count with it. */
/* The search for the smallest free block that fits works across the
 * bitmap's 64-class words: a block of any class, at either edge of a word,
 * is found for a request of its own class and of a smaller class in a lower
 * word, before the larger free remainder of its segment. */
Test(allocator, a_freed_block_is_the_best_fit_from_every_bitmap_word_edge) {
  dp_stream_t *s = stream(H0);
  static const size_t cls[] = {0, 1, 62, 63, 64, 65, 126, 127, 128, 129, 191, 192, 1023};
  static const size_t ask[] = {0, 63, 64, 127, 128};
  for (size_t i = 0; i < sizeof cls / sizeof *cls; i++)
    for (size_t j = 0; j <= sizeof ask / sizeof *ask; j++) {
      size_t k = cls[i], want = j < sizeof ask / sizeof *ask ? ask[j] : k; /* the last: its own class */
      if (want > k) continue;
      char *x, *guard, *got;
      OK(dp_cache_alloc(C, H0, (k + 1) * 512, s, (void **)&x, T_ERR));
      OK(dp_cache_alloc(C, H0, 512, s, (void **)&guard, T_ERR)); /* x never merges with the remainder */
      OK(dp_cache_dealloc(C, x, T_ERR));
      OK(dp_cache_alloc(C, H0, (want + 1) * 512, s, (void **)&got, T_ERR));
      cr_assert_eq(got, x, "%zu bytes come from the freed %zu-byte block (got %p, block %p)", (want + 1) * 512,
                   (k + 1) * 512, (void *)got, (void *)x);
      OK(dp_cache_dealloc(C, got, T_ERR));
      OK(dp_cache_dealloc(C, guard, T_ERR));
    }
  cr_assert_eq(stats(H0).segment_allocs, 1);
  dp_stream_free(s);
}

Test(allocator, pending_bytes_go_back_to_zero_when_the_pending_blocks_are_reclaimed) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p, *q, *r;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_alloc(C, H0, 10000, s, &q, T_ERR));
  _Atomic int gate = 0; /* u held until the gate opens */
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  OK(dp_cache_record_stream(C, p, u, T_ERR));
  OK(dp_cache_record_stream(C, q, u, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_cache_stats_t held = stats(H0);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(held.pending_blocks, 2);
  cr_assert_eq(held.pending_bytes, 4096 + 10240);
  OK(dp_cache_alloc(C, H0, 512, s, &r, T_ERR)); /* its poll reclaims both */
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.pending_blocks, 0);
  cr_assert_eq(st.pending_bytes, 0, "%zu bytes still counted pending", st.pending_bytes);
  OK(dp_cache_dealloc(C, r, T_ERR));
  dp_stream_free(u);
  dp_stream_free(s);
}

/* A destroyed stream's segment no longer counts as all its own: a new
 * stream — at the destroyed one's address too, as malloc tends to hand
 * back — allocating in it shares it with the blocks now tied to no stream,
 * and a batch record on it must record those blocks, not pass the
 * segment as one whose used blocks are all on the recording stream. */
Test(allocator, a_new_stream_allocating_beside_a_destroyed_streams_blocks_records_them_in_a_batch) {
  dp_cache_hooks_t h = dp_cache_hooks(C);
  dp_stream_t *s = stream(H0);
  void *q[4];
  for (int i = 1; i < 4; i++) OK(dp_cache_alloc(C, H0, 4096, s, &q[i], T_ERR));
  uintptr_t old = (uintptr_t)s; /* its address, compared after it is freed */
  dp_stream_free(s); /* q[1..3] now tied to no stream */
  dp_stream_t *u = stream(H0);
  cr_log_info("the new stream %s the destroyed one's address", (uintptr_t)u == old ? "has" : "does not have");
  OK(dp_cache_alloc(C, H0, 4096, u, &q[0], T_ERR));
  cr_assert_eq(stats(H0).segment_allocs, 1, "u's block shares the segment");
  OK(dp_cache_hooks_record(&h, q, 4, u, T_ERR)); /* u's own block first */
  _Atomic int gate = 0; /* u held until the gate opens */
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  for (int i = 0; i < 4; i++) OK(dp_cache_dealloc(C, q[i], T_ERR));
  dp_cache_stats_t st = stats(H0);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  cr_assert_eq(st.pending_blocks, 3, "the three blocks of the destroyed stream wait for u, which used them");
  cr_assert_eq(dp_cache_poll(C, NULL), 3);
  dp_stream_free(u);
}

/* cache.h: when free segments of several devices stay cached for want of
 * memory, dp_cache_empty returns the first error, naming its device — not
 * the last device's. */
static _Atomic int fail_every_allocation;
static void *failing_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  if (nsize && atomic_load(&fail_every_allocation)) return NULL;
  return t_alloc(ud, ptr, osize, nsize);
}

/* An allocation out of memory empties the cache and retries; a free
 * segment for whose stream no event can be made then stays cached, and the
 * allocation fails with DP_ENOMEM, saying what it asked — the segment's
 * own error is no caller's to see. */
Test(allocator, an_allocation_retried_out_of_memory_keeps_a_segment_it_cannot_make_an_event_for) {
  dp_stream_t *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_set_allocator(failing_alloc, NULL);
  atomic_store(&fail_every_allocation, 1); /* neither a segment nor an event can be had */
  dp_error_t e;
  int rc = dp_cache_alloc(C, H0, 4 << 20, s, &p, &e);
  atomic_store(&fail_every_allocation, 0);
  dp_set_allocator(t_alloc, NULL);
  cr_assert_eq(rc, DP_ENOMEM, "%s", dp_err_name(rc));
  cr_assert(strstr(e.message, "dp_cache_alloc(host:0): out of memory allocating 4194304 bytes") == e.message, "%s",
            e.message);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.oom_retries, 1);
  cr_assert(st.reserved == 2 << 20 && st.segment_frees == 0, "the free segment stayed cached");
  OK(dp_cache_alloc(C, H0, 4 << 20, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);
}

Test(allocator, emptying_the_cache_names_the_first_device_whose_segment_stays_cached) {
  dp_stream_t *s0 = stream(H0), *s1 = stream(H1);
  void *p0, *p1;
  OK(dp_cache_alloc(C, H0, 4096, s0, &p0, T_ERR));
  OK(dp_cache_alloc(C, H1, 4096, s1, &p1, T_ERR));
  OK(dp_cache_dealloc(C, p0, T_ERR));
  OK(dp_cache_dealloc(C, p1, T_ERR));
  dp_set_allocator(failing_alloc, NULL);
  atomic_store(&fail_every_allocation, 1); /* no event can be made on either device */
  dp_error_t e;
  int rc = dp_cache_empty(C, &e);
  atomic_store(&fail_every_allocation, 0);
  dp_set_allocator(t_alloc, NULL);
  cr_assert_eq(rc, DP_ENOMEM, "%s", dp_err_name(rc));
  cr_assert_eq(e.code, rc);
  cr_assert(strstr(e.message, "dp_cache_empty: a free segment of host:0 stays cached: ") == e.message, "%s", e.message);
  cr_assert_eq(stats(H0).reserved, 2 << 20);
  cr_assert_eq(stats(H1).reserved, 2 << 20, "host:1's segment stayed too");
  OK(dp_cache_empty(C, T_ERR));
  cr_assert_eq(stats(H0).reserved + stats(H1).reserved, 0, "both go back when memory allows");
  dp_stream_free(s0);
  dp_stream_free(s1);
}

/* dp_cache_free from a host function cannot wait for its own device (it
 * would wait for itself: device.h): cache.h says so, and that the memory
 * goes back at once, work queued on another stream or not. It neither
 * waits for that work (which would hang here: the gate opens after) nor
 * fails to free what it holds. */
static void free_cache_fn(void *arg) { dp_cache_free(arg); }

/* A cache freed from a host function while a block waits for an event
 * queued behind that very function: the wait the free would make is
 * refused (a host function may not wait on its own device), and the free
 * goes on, giving the event back, instead of polling for it forever. */
Test(allocator, a_cache_freed_from_a_host_function_ahead_of_its_pending_blocks_event_returns, .timeout = 20) {
  dp_cache_t *c;
  OK(dp_cache_new(B, &c, T_ERR));
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *p;
  OK(dp_cache_alloc(c, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_record_stream(c, p, u, T_ERR));
  _Atomic int gate = 0;
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR)); /* u held while the function and the event queue behind */
  OK(dp_host_launch(u, free_cache_fn, c, T_ERR));
  OK(dp_cache_dealloc(c, p, T_ERR)); /* pending on an event recorded on u after the function */
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR)); /* returns: the free inside did not wait for its own stream's event */
  dp_stream_free(u);
  dp_stream_free(s);
}

Test(allocator, a_cache_freed_from_a_host_function_waits_for_no_stream_of_its_device, .timeout = 20) {
  dp_cache_t *c;
  OK(dp_cache_new(B, &c, T_ERR));
  dp_stream_t *s = stream(H0), *busy = stream(H0);
  void *p;
  OK(dp_cache_alloc(c, H0, 4096, busy, &p, T_ERR));
  _Atomic int gate = 0;
  OK(dp_host_launch(busy, gate_wait, &gate, T_ERR)); /* queued before the free, held until after it */
  OK(dp_host_launch(s, free_cache_fn, c, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR)); /* returns: the free waited for nothing */
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(busy, T_ERR));
  dp_stream_free(busy);
  dp_stream_free(s);
}

/* A chain given another chain's hooks records through them: nested a few
 * thousand times deep, each level's frame (its batch's scratch on the
 * stack) overflowed the stack (SIGSEGV at 3,000 levels). A chain takes a
 * nested chain's allocators in place, so any depth records through one. */
Test(allocator, chains_nested_thousands_of_times_deep_record_in_constant_stack) {
  enum { DEPTH = 20000 };
  dp_cache_hooks_chain_t **chains = malloc(DEPTH * sizeof *chains);
  cr_assert_not_null(chains);
  dp_cache_hooks_t h = dp_cache_hooks(C);
  for (int i = 0; i < DEPTH; i++) {
    OK(dp_cache_hooks_chain_new(&h, 1, &chains[i], T_ERR));
    h = dp_cache_hooks_chain_hooks(chains[i]);
  }
  dp_stream_t *s = stream(H0), *user = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_hooks_record(&h, &p, 1, user, T_ERR));
  OK(h.record_stream(h.ctx, p, user, T_ERR));
  dp_error_t e;
  int other;
  cr_assert_eq(h.record_stream(h.ctx, &other, user, &e), DP_ENOTFOUND);
  cr_assert(strstr(e.message, "owned by none of the chain's 1 allocators"), "%s", e.message);
  /* the record holds the block: freed, it is pending until user's work is done */
  _Atomic int gate = 0;
  OK(dp_host_launch(user, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 1);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(user, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0);
  for (int i = DEPTH; i-- > 0;) dp_cache_hooks_chain_free(chains[i]);
  /* a tree: each chain given the one below it twice, 40 levels; its
     allocator is offered a pointer once, not 2^40 times */
  h = dp_cache_hooks(C);
  for (int i = 0; i < 40; i++) {
    dp_cache_hooks_t two[2] = {h, h};
    OK(dp_cache_hooks_chain_new(two, 2, &chains[i], T_ERR));
    h = dp_cache_hooks_chain_hooks(chains[i]);
  }
  cr_assert_eq(h.record_stream(h.ctx, &other, user, &e), DP_ENOTFOUND);
  cr_assert(strstr(e.message, "owned by none of the chain's 1 allocators"), "%s", e.message);
  for (int i = 40; i-- > 0;) dp_cache_hooks_chain_free(chains[i]);
  free(chains);
  dp_stream_free(user);
  dp_stream_free(s);
}

/* Every dp_stream_free tells every cache (the stream-destroy listener),
 * and each cache looked at every block it held to untie them from the
 * stream — also for a stream it had never seen: with 300,000 live blocks a
 * stream that only ran work took 3 ms of the caller's CPU to free, not
 * 30 us, in every cache of the process. A cache now answers at once for a
 * stream that never allocated there and was never recorded there. */
static double cpu_freeing_unseen_streams(int n) {
  struct timespec t0, t1;
  double total = 0;
  for (int i = 0; i < n; i++) {
    dp_stream_t *s = stream(H1);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); /* the scan runs on this thread; the joined worker does not count */
    dp_stream_free(s);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    total += (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  }
  return total;
}

Test(allocator, freeing_a_stream_the_cache_never_saw_costs_nothing_however_many_blocks_it_holds) {
  enum { N = 300000, FREES = 20 };
  dp_stream_t *s = stream(H0), *user = stream(H1);
  double empty = cpu_freeing_unseen_streams(FREES);
  void **p = malloc(N * sizeof *p);
  cr_assert(p);
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 512, s, &p[i], T_ERR));
  OK(dp_cache_record_stream(C, p[0], user, T_ERR)); /* a stream recorded, not allocating: seen */
  double full = cpu_freeing_unseen_streams(FREES);
  cr_assert_lt(full, 4 * empty + 0.005, "%d frees of unseen streams took %.4f s of CPU with %d blocks held, %.4f s "
               "with none", FREES, full, N, empty);
  /* a stream the cache saw is still untied from what it held */
  dp_stream_free(user);
  OK(dp_cache_dealloc(C, p[0], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0, "the destroyed user stream holds nothing back");
  for (int i = 1; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  free(p);
  dp_stream_free(s);
}

/* The same for a stream that allocated and freed all it took before it was
 * destroyed (a stream per request): its free blocks are untied from it
 * where its free set lists them, without a look at the other blocks, and
 * serve any stream afterwards without a wait. */
static double cpu_freeing_streams_that_freed_their_blocks(int n, uint64_t *cross) {
  struct timespec t0, t1;
  double total = 0;
  for (int i = 0; i < n; i++) {
    dp_stream_t *s = stream(H0), *u = stream(H0);
    void *q[8];
    for (int k = 0; k < 8; k++) OK(dp_cache_alloc(C, H0, 4096u << k, s, &q[k], T_ERR));
    for (int k = 0; k < 8; k++) OK(dp_cache_dealloc(C, q[k], T_ERR));
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    dp_stream_free(s);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    total += (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    uint64_t before = stats(H0).cross_stream;
    for (int k = 0; k < 8; k++) OK(dp_cache_alloc(C, H0, 4096u << k, u, &q[k], T_ERR));
    *cross += stats(H0).cross_stream - before;
    for (int k = 0; k < 8; k++) OK(dp_cache_dealloc(C, q[k], T_ERR));
    dp_stream_free(u);
  }
  return total;
}

Test(allocator, freeing_a_stream_whose_blocks_are_all_free_looks_only_at_those) {
  enum { N = 300000, FREES = 20 };
  dp_stream_t *s = stream(H0);
  uint64_t cross = 0;
  double empty = cpu_freeing_streams_that_freed_their_blocks(FREES, &cross);
  void **p = malloc(N * sizeof *p);
  cr_assert(p);
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 512, s, &p[i], T_ERR));
  double full = cpu_freeing_streams_that_freed_their_blocks(FREES, &cross);
  cr_assert_lt(full, 4 * empty + 0.005, "%d frees took %.4f s of CPU with %d blocks held, %.4f s with none", FREES, full,
               N, empty);
  cr_assert_eq(cross, 0, "the destroyed streams' blocks served the next stream without a wait");
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  free(p);
  dp_stream_free(s);
}

/* And for a consumer's stream (one that waited on a future: its records
 * are uses) once the blocks recorded on it were freed: their free made
 * events of its uses, and nothing is left to untie. */
static double cpu_freeing_consumers_of_freed_blocks(int n, dp_stream_t *producer) {
  struct timespec t0, t1;
  double total = 0;
  for (int i = 0; i < n; i++) {
    dp_stream_t *u = stream(H0);
    void *q;
    OK(dp_cache_alloc(C, H0, 4096, producer, &q, T_ERR));
    OK(dp_cache_record_stream(C, q, u, T_ERR));
    OK(dp_cache_dealloc(C, q, T_ERR)); /* pending on an event of u */
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    dp_stream_free(u);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    total += (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  }
  return total;
}

Test(allocator, freeing_a_consumer_stream_whose_recorded_blocks_were_freed_looks_at_no_block) {
  enum { N = 300000, FREES = 20 };
  dp_stream_t *s = stream(H0);
  double empty = cpu_freeing_consumers_of_freed_blocks(FREES, s);
  void **p = malloc(N * sizeof *p);
  cr_assert(p);
  for (int i = 0; i < N; i++) OK(dp_cache_alloc(C, H0, 512, s, &p[i], T_ERR));
  double full = cpu_freeing_consumers_of_freed_blocks(FREES, s);
  cr_assert_lt(full, 4 * empty + 0.005, "%d frees took %.4f s of CPU with %d blocks held, %.4f s with none", FREES, full,
               N, empty);
  OK(dp_cache_poll(C, NULL));
  cr_assert_eq(stats(H0).pending_blocks, 0, "the consumers' events completed: nothing pending");
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  free(p);
  dp_stream_free(s);
}

/* And for streams that still tie blocks up when destroyed: one whose own
 * allocations are still in use (a stream per request whose output
 * outlives it), and a consumer recorded on blocks still in use (a stream
 * per request that waited on a future holding the weights). Each looked at
 * every block of every segment to untie them: with 300,000 blocks held, a
 * free cost milliseconds. The blocks tied to a stream are listed with it. */
static double cpu_freeing_streams_that_tie_blocks(int n, void **held, uint64_t *cross) {
  struct timespec t0, t1;
  double total = 0;
  for (int i = 0; i < n; i++) {
    dp_stream_t *s = stream(H0), *u = stream(H0), *next = stream(H0);
    void *q[8];
    for (int k = 0; k < 8; k++) OK(dp_cache_alloc(C, H0, 4096u << k, s, &q[k], T_ERR));
    for (int k = 0; k < 8; k++) OK(dp_cache_record_stream(C, held[(size_t)i * 8 + (size_t)k], u, T_ERR));
    OK(dp_cache_record_stream(C, q[0], u, T_ERR));
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    dp_stream_free(s); /* its 8 blocks, still in use, now tied to no stream */
    dp_stream_free(u); /* its 9 uses dropped */
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    total += (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    /* untied: freed, they serve the next stream without a wait, and nothing is pending */
    for (int k = 0; k < 8; k++) OK(dp_cache_dealloc(C, q[k], T_ERR));
    uint64_t before = stats(H0).cross_stream;
    for (int k = 0; k < 8; k++) OK(dp_cache_alloc(C, H0, 4096u << k, next, &q[k], T_ERR));
    *cross += stats(H0).cross_stream - before;
    for (int k = 0; k < 8; k++) OK(dp_cache_dealloc(C, q[k], T_ERR));
    dp_stream_free(next);
  }
  return total;
}

Test(allocator, freeing_streams_that_still_tie_blocks_up_looks_only_at_those_blocks) {
  enum { N = 300000, FREES = 20 };
  dp_stream_t *s = stream(H0);
  void **p = malloc(N * sizeof *p);
  cr_assert(p);
  for (int i = 0; i < 8 * FREES; i++) OK(dp_cache_alloc(C, H0, 512, s, &p[i], T_ERR));
  uint64_t cross = 0;
  double few = cpu_freeing_streams_that_tie_blocks(FREES, p, &cross);
  for (int i = 8 * FREES; i < N; i++) OK(dp_cache_alloc(C, H0, 512, s, &p[i], T_ERR));
  double full = cpu_freeing_streams_that_tie_blocks(FREES, p, &cross);
  cr_assert_lt(full, 4 * few + 0.005, "%d frees took %.4f s of CPU with %d blocks held, %.4f s with %d", 2 * FREES,
               full, N, few, 8 * FREES);
  cr_assert_eq(cross, 0, "the destroyed streams' blocks served the next stream without a wait");
  cr_assert_eq(stats(H0).pending_blocks, 0);
  /* the uses the destroyed consumers left are gone: freed, the held blocks are not pending */
  for (int i = 0; i < N; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0, "a destroyed consumer's use held a block back");
  free(p);
  dp_stream_free(s);
}

/* The lists behind that, shuffled: allocations on several streams, records
 * of several consumers on them, frees (each use becomes an event), streams
 * destroyed and made again, in a random order. Every block and every use
 * stays findable from both sides (ASan sees an index gone wrong), and at
 * the end nothing is allocated or pending. */
Test(allocator, streams_made_recorded_and_destroyed_in_any_order_leave_nothing_tied) {
  enum { K = 6, NB = 256, STEPS = 40000 };
  dp_stream_t *st[K];
  void *blk[NB] = {0};
  for (int i = 0; i < K; i++) st[i] = stream(H0);
  unsigned x = 12345;
#define RND() (x = x * 1103515245u + 12345u, (x >> 8))
  for (int step = 0; step < STEPS; step++) {
    unsigned op = RND() % 16, i = RND() % NB, k = RND() % K;
    if (op < 5) {
      if (!blk[i]) OK(dp_cache_alloc(C, H0, 512u * (1 + RND() % 9), st[k], &blk[i], T_ERR));
    } else if (op < 11) {
      if (blk[i]) OK(dp_cache_record_stream(C, blk[i], st[k], T_ERR));
    } else if (op < 15) {
      if (blk[i]) OK(dp_cache_dealloc(C, blk[i], T_ERR));
      blk[i] = NULL;
    } else {
      dp_stream_free(st[k]);
      st[k] = stream(H0);
    }
    if (step % 64 == 0) {
      const char *bad = dp__cache_check(C);
      cr_assert_null(bad, "after step %d: %s", step, bad);
    }
  }
#undef RND
  const char *bad = dp__cache_check(C);
  cr_assert_null(bad, "%s", bad);
  for (int i = 0; i < NB; i++)
    if (blk[i]) OK(dp_cache_dealloc(C, blk[i], T_ERR));
  for (int i = 0; i < K; i++) dp_stream_free(st[i]);
  cr_assert_null(dp__cache_check(C));
  OK(dp_cache_poll(C, NULL));
  dp_cache_stats_t sst = stats(H0);
  cr_assert_eq(sst.allocated, 0);
  cr_assert_eq(sst.pending_blocks, 0, "%zu blocks still pending", (size_t)sst.pending_blocks);
}

/* cache.h's errors follow device.h: a failure's message names the function
 * (or the device). Out of memory inside the allocator said "out of memory
 * tracking a segment", "tracking an allocation", "recording a stream use",
 * "creating a caching allocator"; a record refused through
 * dp_cache_record_stream named the hook, record_stream. Each now starts
 * with the function called (and, for an allocation, the device). */
Test(allocator, every_failure_message_names_the_function_called) {
  dp_cache_free(C);
  C = NULL;
  dp_stream_t *s = stream(H1), *u = stream(H1);
  const char *fns[3] = {"dp_cache_new", "dp_cache_alloc(host:1)", "dp_cache_record_stream("};
  int failed[3] = {0, 0, 0};
  for (long k = 1;; k++) {
    cr_assert_lt(k, 500);
    long want = t_alloc_count + k;
    t_fail_at = want;
    dp_cache_t *c = NULL;
    void *p = NULL, *q = NULL;
    dp_error_t e;
    dp_error_clear(&e);
    int op = 0, rc = dp_cache_new(B, &c, &e);
    if (rc == 0 && (op = 1, rc = dp_cache_alloc(c, H1, 4096, s, &p, &e)) == 0 &&
        (op = 2, rc = dp_cache_record_stream(c, p, u, &e)) == 0)
      op = 1, rc = dp_cache_alloc(c, H1, 3 << 20, s, &q, &e);
    int hit = t_alloc_count >= want;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s: %s", k, dp_err_name(rc), e.message);
      cr_assert(strncmp(e.message, fns[op], strlen(fns[op])) == 0, "allocation %ld: %s does not start with %s", k,
                e.message, fns[op]);
      failed[op]++;
    }
    if (p) OK(dp_cache_dealloc(c, p, T_ERR));
    if (q) OK(dp_cache_dealloc(c, q, T_ERR));
    dp_cache_free(c);
    if (!hit) break;
  }
  for (int op = 0; op < 3; op++) cr_assert_gt(failed[op], 0, "%s never failed", fns[op]);
  OK(dp_cache_new(B, &C, T_ERR));
  int x;
  dp_error_t e;
  cr_assert_eq(dp_cache_record_stream(C, &x, u, &e), DP_ENOTFOUND);
  char want[96];
  snprintf(want, sizeof want, "dp_cache_record_stream(%p): not an allocation of this allocator", (void *)&x);
  cr_assert_str_eq(e.message, want);
  dp_stream_free(s);
  dp_stream_free(u);
}

/* ---- the books of uses and tied blocks, through every path that changes them ---- */

#include <stdarg.h>

/* Asserts that C's books agree; where (printf) says when. */
static void books(const char *where, ...) {
  const char *bad = dp__cache_check(C);
  if (!bad) return;
  char w[128];
  va_list ap;
  va_start(ap, where);
  vsnprintf(w, sizeof w, where, ap);
  va_end(ap);
  cr_assert_fail("the books disagree (%s): %s", w, bad);
}

/* Three blocks share six consumer streams, so that a use taken out of a
 * stream's list moves another block's entry into its place. A free whose
 * events fail part way (each allocation in turn, then all of them) keeps
 * the uses it could not turn into events; each stays findable from its
 * stream and from its block until that stream is destroyed or the block
 * comes back, and nothing stays pending. */
static void free_with_events_failing(long fail_at, int all) {
  enum { U = 6, NB = 3 };
  dp_stream_t *a = stream(H0), *u[U];
  void *p[NB];
  for (int k = 0; k < U; k++) u[k] = stream(H0);
  for (int i = 0; i < NB; i++) {
    OK(dp_cache_alloc(C, H0, 4096, a, &p[i], T_ERR));
    for (int k = 0; k < U; k++) OK(dp_cache_record_stream(C, p[i], u[(k + i) % U], T_ERR));
  }
  books("recorded");
  if (all) atomic_store(&fail_every_allocation, 1);
  else t_fail_at = t_alloc_count + fail_at;
  OK(dp_cache_dealloc(C, p[1], T_ERR)); /* a free never fails */
  atomic_store(&fail_every_allocation, 0);
  t_fail_at = 0;
  books("after a free whose allocation %ld failed", fail_at);
  for (int k = 0; k < U; k += 2) {
    dp_stream_free(u[k]);
    u[k] = NULL;
    books("after destroying consumer %d", k);
  }
  OK(dp_cache_dealloc(C, p[0], T_ERR));
  books("after freeing the first block");
  for (int k = 1; k < U; k += 2) OK(dp_stream_synchronize(u[k], T_ERR));
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  books("after the poll");
  OK(dp_cache_dealloc(C, p[2], T_ERR));
  for (int k = 1; k < U; k += 2) dp_stream_free(u[k]);
  books("after the last consumer went");
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.allocated, 0);
  cr_assert_eq(st.pending_blocks, 0, "allocation %ld failed: %zu blocks still pending", fail_at, st.pending_blocks);
  books("at the end");
  dp_stream_free(a);
}

Test(allocator, a_free_whose_events_fail_part_way_keeps_each_remaining_use_in_both_lists) {
  dp_set_allocator(failing_alloc, NULL);
  for (long k = 1; k <= 24; k++) free_with_events_failing(k, 0);
  free_with_events_failing(0, 1);
  dp_set_allocator(t_alloc, NULL);
}

/* A record whose memory runs out at each allocation in turn (the table of
 * users, the block's uses, the stream's list) records nothing half: the
 * books agree, and the block freed is not held for that stream. */
Test(allocator, a_record_out_of_memory_at_any_allocation_leaves_no_half_entry) {
  enum { OLD = 4 }; /* as many as the first arrays hold: the new stream's record grows each */
  dp_stream_t *a = stream(H0), *olds[OLD];
  void *q;
  OK(dp_cache_alloc(C, H0, 4096, a, &q, T_ERR));
  for (int i = 0; i < OLD; i++) {
    olds[i] = stream(H0);
    OK(dp_cache_record_stream(C, q, olds[i], T_ERR));
  }
  long failed = 0;
  for (long k = 1;; k++) {
    cr_assert_lt(k, 100);
    dp_stream_t *u = stream(H0);
    void *p;
    OK(dp_cache_alloc(C, H0, 4096, a, &p, T_ERR));
    for (int i = 0; i < OLD; i++) OK(dp_cache_record_stream(C, p, olds[i], T_ERR));
    long want = t_fail_at = t_alloc_count + k;
    dp_error_t e;
    int rc = dp_cache_record_stream(C, p, u, &e);
    int hit = t_alloc_count >= want;
    t_fail_at = 0;
    books("after a record whose allocation %ld failed", k);
    if (rc) {
      failed++;
      cr_assert_eq(rc, DP_ENOMEM, "%s", e.message);
      _Atomic int gate = 0;
      OK(dp_host_launch(u, gate_wait, &gate, T_ERR)); /* u busy: a use of it would hold the block */
      OK(dp_cache_dealloc(C, p, T_ERR));
      for (int i = 0; i < OLD; i++) OK(dp_stream_synchronize(olds[i], T_ERR));
      cr_assert_eq(stats(H0).pending_blocks, 0, "allocation %ld: a failed record holds the block", k);
      atomic_store(&gate, 1);
      OK(dp_stream_synchronize(u, T_ERR));
    } else {
      OK(dp_cache_dealloc(C, p, T_ERR));
    }
    dp_stream_free(u);
    books("after destroying the stream of the failed record %ld", k);
    if (!hit) break;
  }
  cr_assert_geq(failed, 2, "the block's uses and the stream's list each failed once (%ld)", failed);
  OK(dp_cache_dealloc(C, q, T_ERR));
  for (int i = 0; i < OLD; i++) dp_stream_free(olds[i]);
  dp_stream_free(a);
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  cr_assert_eq(stats(H0).pending_blocks, 0);
}

/* Two caches on one backend hear of every stream destroyed: each unties
 * its own blocks and drops its own uses, and neither's books move the
 * other's. */
Test(allocator, two_caches_on_one_backend_each_untie_their_own_blocks_of_a_destroyed_stream) {
  dp_cache_t *c2;
  OK(dp_cache_new(B, &c2, T_ERR));
  dp_stream_t *s = stream(H0), *u = stream(H0), *t = stream(H0);
  void *p[4], *q[4];
  for (int i = 0; i < 4; i++) {
    OK(dp_cache_alloc(C, H0, 4096, i % 2 ? s : t, &p[i], T_ERR));
    OK(dp_cache_alloc(c2, H0, 4096, i % 2 ? t : s, &q[i], T_ERR));
    OK(dp_cache_record_stream(C, p[i], u, T_ERR));
    OK(dp_cache_record_stream(c2, q[i], u, T_ERR));
  }
  OK(dp_cache_dealloc(C, p[0], T_ERR));
  OK(dp_cache_dealloc(c2, q[1], T_ERR));
  dp_stream_free(s);
  books("after s went");
  cr_assert_null(dp__cache_check(c2), "%s", dp__cache_check(c2));
  dp_stream_free(u);
  books("after u went");
  cr_assert_null(dp__cache_check(c2), "%s", dp__cache_check(c2));
  for (int i = 1; i < 4; i++) OK(dp_cache_dealloc(C, p[i], T_ERR));
  for (int i = 0; i < 4; i++)
    if (i != 1) OK(dp_cache_dealloc(c2, q[i], T_ERR));
  dp_stream_free(t);
  books("at the end");
  cr_assert_null(dp__cache_check(c2), "%s", dp__cache_check(c2));
  for (int d = 0; d < 2; d++) {
    dp_cache_t *c = d ? c2 : C;
    dp_cache_stats_t st;
    OK(dp_cache_stats(c, H0, &st, T_ERR));
    cr_assert_eq(st.allocated, 0);
    cr_assert_eq(st.pending_blocks, 0, "cache %d: a destroyed consumer's use held a block", d);
  }
  dp_cache_free(c2);
}

/* A stream destroyed from a host function on another stream, while blocks
 * of its are in use and pending and it is recorded on others' blocks. */
typedef struct {
  dp_stream_t *victim;
} kill_t;

static void free_victim(void *arg) { dp_stream_free(((kill_t *)arg)->victim); }

Test(allocator, a_stream_destroyed_from_a_host_function_on_another_unties_its_blocks, .timeout = 20) {
  dp_stream_t *s = stream(H0), *v = stream(H0), *w = stream(H0);
  void *mine[3], *held;
  for (int i = 0; i < 3; i++) OK(dp_cache_alloc(C, H0, 4096 << i, v, &mine[i], T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &held, T_ERR));
  OK(dp_cache_record_stream(C, held, v, T_ERR));
  OK(dp_cache_record_stream(C, mine[1], w, T_ERR));
  _Atomic int gate = 0;
  OK(dp_host_launch(w, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(C, mine[1], T_ERR)); /* pending on w */
  OK(dp_cache_dealloc(C, mine[2], T_ERR)); /* free in v's set */
  books("before");
  kill_t k = {v};
  OK(dp_host_launch(s, free_victim, &k, T_ERR));
  OK(dp_stream_synchronize(s, T_ERR));
  books("after the host function destroyed v");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(w, T_ERR));
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  books("after the pending block came back");
  OK(dp_cache_dealloc(C, mine[0], T_ERR));
  OK(dp_cache_dealloc(C, held, T_ERR));
  cr_assert_eq(stats(H0).pending_blocks, 0, "held waits for no destroyed stream");
  cr_assert_eq(stats(H0).allocated, 0);
  books("at the end");
  dp_stream_free(s);
  dp_stream_free(w);
}

/* Records through the batched hooks and a chain of the cache with itself,
 * on blocks of several streams in shared segments, then the streams
 * destroyed: the batch's runs and lookups add each use once, to both
 * lists. */
Test(allocator, batch_and_chained_records_keep_the_books_through_stream_destruction) {
  enum { N = 64 };
  dp_stream_t *s[3] = {stream(H0), stream(H0), stream(H0)}, *u = stream(H0), *x = stream(H0);
  void *p[N], *ptrs[2 * N];
  for (int i = 0; i < N; i++) {
    OK(dp_cache_alloc(C, H0, 512u * (1 + (unsigned)i % 5), s[i % 3], &p[i], T_ERR));
    ptrs[2 * i] = p[i];
    ptrs[2 * i + 1] = (char *)p[i] + 100; /* interior: the same block again */
  }
  dp_cache_hooks_t h = dp_cache_hooks(C);
  OK(dp_cache_hooks_record(&h, ptrs, 2 * N, u, T_ERR));
  OK(dp_cache_hooks_record(&h, ptrs, 2 * N, s[0], T_ERR));
  books("after the batches");
  dp_cache_hooks_t list[2] = {dp_cache_hooks(C), dp_cache_hooks(C)};
  dp_cache_hooks_chain_t *ch;
  OK(dp_cache_hooks_chain_new(list, 2, &ch, T_ERR));
  dp_cache_hooks_t chh = dp_cache_hooks_chain_hooks(ch);
  OK(dp_cache_hooks_record(&chh, ptrs, 2 * N, x, T_ERR));
  OK(dp_cache_hooks_record(&chh, ptrs, 2 * N, u, T_ERR));
  books("after the chain");
  dp_stream_free(s[1]);
  books("after s1 went");
  for (int i = 0; i < N; i += 2) OK(dp_cache_dealloc(C, p[i], T_ERR));
  dp_stream_free(u);
  books("after u went");
  for (int i = 1; i < N; i += 2) OK(dp_cache_dealloc(C, p[i], T_ERR));
  OK(dp_stream_synchronize(x, T_ERR));
  OK(dp_stream_synchronize(s[0], T_ERR));
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  cr_assert_eq(stats(H0).pending_blocks, 0);
  cr_assert_eq(stats(H0).allocated, 0);
  dp_cache_hooks_chain_free(ch);
  dp_stream_free(x);
  dp_stream_free(s[0]);
  dp_stream_free(s[2]);
  books("at the end");
}

/* Out of memory in the backend: an allocation empties the cache (the
 * lock let go while segments are freed) and retries, with blocks of its
 * stream in use, pending and recorded; then dp_cache_empty; then the
 * streams go. */
Test(allocator, an_allocation_that_empties_the_cache_to_retry_keeps_the_books) {
  /* u on another device: a segment given back waits for its device's work (as cudaFree does) */
  dp_stream_t *s = stream(H1), *t = stream(H1), *u = stream(H0);
  void *a, *b2, *c2, *big;
  OK(dp_cache_alloc(C, H1, 4096, s, &a, T_ERR));
  OK(dp_cache_alloc(C, H1, 3u << 20, t, &b2, T_ERR));
  OK(dp_cache_alloc(C, H1, 3u << 20, s, &c2, T_ERR));
  OK(dp_cache_record_stream(C, a, u, T_ERR));
  OK(dp_cache_dealloc(C, b2, T_ERR));
  OK(dp_cache_dealloc(C, c2, T_ERR)); /* two free large segments, cached */
  _Atomic int gate = 0;
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  OK(dp_host_set_memory_limit(H1, 9u << 20, T_ERR));
  OK(dp_cache_alloc(C, H1, 6u << 20, s, &big, T_ERR)); /* fits only once the cached ones go */
  cr_assert_eq(stats(H1).oom_retries, 1);
  books("after the retry");
  OK(dp_cache_dealloc(C, a, T_ERR)); /* pending on u */
  OK(dp_cache_empty(C, T_ERR));
  books("after emptying");
  dp_stream_free(s);
  books("after s went");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  OK(dp_cache_dealloc(C, big, T_ERR));
  dp_stream_free(u);
  dp_stream_free(t);
  OK(dp_cache_empty(C, T_ERR));
  books("at the end");
  dp_cache_stats_t st = stats(H1);
  cr_assert_eq(st.pending_blocks, 0);
  cr_assert_eq(st.allocated, 0);
  cr_assert_eq(st.reserved, 0);
  OK(dp_host_set_memory_limit(H1, 0, T_ERR));
}

/* Threads at once: each allocates on streams of its own, records shared
 * consumer streams and its own (one pointer, or all its blocks in one
 * batch), frees, destroys and remakes its streams, polls, empties, reads
 * the stats of and looks up in the cache; the shared consumers live
 * throughout. */
typedef struct {
  dp_stream_t **shared;
  unsigned seed;
} tied_churn_t;

static void *tied_churn(void *arg) {
  tied_churn_t *a = arg;
  enum { K = 3, NB = 64 };
  dp_stream_t *own[K];
  void *blk[NB] = {0};
  for (int i = 0; i < K; i++) own[i] = stream(H0);
  unsigned x = a->seed;
#define RND() (x = x * 1103515245u + 12345u, (x >> 8))
  for (int step = 0; step < 6000; step++) {
    unsigned op = RND() % 20, i = RND() % NB, k = RND() % K;
    if (op < 5) {
      if (!blk[i]) OK(dp_cache_alloc(C, H0, 512u * (1 + RND() % 9), own[k], &blk[i], T_ERR));
    } else if (op < 10) {
      if (blk[i]) OK(dp_cache_record_stream(C, blk[i], op < 8 ? a->shared[RND() % 2] : own[k], T_ERR));
    } else if (op < 11) { /* the batch: its NULL entries are skipped */
      dp_cache_hooks_t h = dp_cache_hooks(C);
      OK(h.record_streams(h.ctx, blk, NB, RND() % 2 ? a->shared[RND() % 2] : own[k], T_ERR));
    } else if (op < 15) {
      if (blk[i]) OK(dp_cache_dealloc(C, blk[i], T_ERR));
      blk[i] = NULL;
    } else if (op < 16) {
      dp_stream_free(own[k]);
      own[k] = stream(H0);
    } else if (op < 17) {
      cr_assert_geq(dp_cache_poll(C, NULL), 0);
    } else if (op < 18) {
      OK(dp_cache_empty(C, T_ERR));
    } else if (op < 19) {
      dp_cache_stats_t st;
      OK(dp_cache_stats(C, H0, &st, T_ERR));
      cr_assert_leq(st.allocated, st.reserved);
    } else if (blk[i]) { /* an interior pointer: the lookup walks the segments */
      void *base;
      size_t size;
      OK(dp_cache_lookup(C, (char *)blk[i] + 100, &base, &size, T_ERR));
      cr_assert(base == blk[i] && size >= 512, "%p: block %p of %zu bytes", blk[i], base, size);
    }
  }
#undef RND
  for (int i = 0; i < NB; i++)
    if (blk[i]) OK(dp_cache_dealloc(C, blk[i], T_ERR));
  for (int i = 0; i < K; i++) dp_stream_free(own[i]);
  return NULL;
}

Test(allocator, threads_allocating_recording_freeing_and_destroying_streams_at_once_keep_the_books) {
  dp_stream_t *shared[2] = {stream(H0), stream(H0)};
  pthread_t th[4];
  tied_churn_t args[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (tied_churn_t){shared, 77u * (unsigned)i + 1};
    pthread_create(&th[i], NULL, tied_churn, &args[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  books("after the threads");
  dp_stream_free(shared[0]);
  dp_stream_free(shared[1]);
  books("after the shared consumers went");
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.allocated, 0);
  cr_assert_eq(st.pending_blocks, 0);
}

/* Sixteen threads at once (cache.h: every function thread-safe; device.h:
 * any number of threads may wrap at once): each makes a stream, wraps its
 * native handle, allocates on the wrapper, records the stream and a shared
 * one, makes the wrapper current, and frees the block and the stream in
 * either order — so wrappers are made, used by one cache and retired (the
 * cache told of both) while other threads do the same on the same devices.
 * Each wrap gives the thread its own stream's wrapper, never a retired one;
 * the wrapper is no longer current once its stream is freed; the books agree. */
typedef struct {
  dp_stream_t *shared;
  unsigned seed;
} wrap_churn_t;

static void *wrap_churn(void *arg) {
  wrap_churn_t *a = arg;
  unsigned x = a->seed;
#define RND() (x = x * 1103515245u + 12345u, (x >> 16) & 0x7fff)
  for (int it = 0; it < 60; it++) {
    dp_device_t d = dp_stream_device(a->shared);
    dp_stream_t *s = stream(d), *w = wrap_of(s), *again = wrap_of(s), *cur;
    cr_assert(w != s && w == again && dp_stream_native(w) == dp_stream_native(s),
              "wrapping a live stream's handle twice gives one wrapper of that handle");
    void *p;
    OK(dp_cache_alloc(C, d, RND() % 9000, w, &p, T_ERR));
    OK(dp_cache_record_stream(C, p, s, T_ERR));
    OK(dp_cache_record_stream(C, p, a->shared, T_ERR));
    OK(dp_set_current_stream(w, NULL, T_ERR));
    if (RND() % 2) {
      OK(dp_cache_dealloc(C, p, T_ERR));
      dp_stream_free(s);
    } else {
      dp_stream_free(s);
      OK(dp_cache_dealloc(C, p, T_ERR));
    }
    OK(dp_current_stream(B, d, &cur, T_ERR));
    cr_assert(cur != w, "the wrapper of a freed stream is no longer current");
  }
#undef RND
  return NULL;
}

Test(allocator, sixteen_threads_wrapping_allocating_on_and_retiring_wrappers_at_once_keep_the_books) {
  alarm(60); /* the hang guard (a Criterion timeout leaks a record in its runner under --jobs 2) */
  dp_stream_t *shared[2] = {stream(H0), stream(H1)};
  pthread_t th[16];
  wrap_churn_t args[16];
  for (int i = 0; i < 16; i++) {
    args[i] = (wrap_churn_t){shared[i % 2], 2654435761u * (unsigned)i + 7};
    cr_assert_eq(pthread_create(&th[i], NULL, wrap_churn, &args[i]), 0);
  }
  for (int i = 0; i < 16; i++) pthread_join(th[i], NULL);
  books("after the threads");
  dp_stream_free(shared[0]);
  dp_stream_free(shared[1]);
  books("after the shared streams went");
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  cr_assert_eq(stats(H0).allocated + stats(H1).allocated, 0);
  cr_assert_eq(stats(H0).pending_blocks + stats(H1).pending_blocks, 0);
}

/* A native stream destroyed behind its wrapper: the wrapper's blocks in use
 * and pending, its free blocks and its uses on others' blocks (pending for
 * want of an event too) all let go of it, as do the owner's. */
Test(allocator, a_wrapped_stream_destroyed_with_blocks_in_use_pending_and_recorded_keeps_the_books, .timeout = 20) {
  dp_stream_t *s = stream(H0), *t = stream(H0), *g = stream(H0);
  dp_stream_t *ws = wrap_of(s);
  void *inuse, *pend, *freed, *own, *theirs, *kept;
  OK(dp_cache_alloc(C, H0, 4096, ws, &inuse, T_ERR));
  OK(dp_cache_alloc(C, H0, 8192, ws, &pend, T_ERR));
  OK(dp_cache_alloc(C, H0, 1u << 12, ws, &freed, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &own, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, t, &theirs, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, t, &kept, T_ERR));
  OK(dp_cache_record_stream(C, theirs, ws, T_ERR));
  OK(dp_cache_record_stream(C, theirs, s, T_ERR));
  OK(dp_cache_record_stream(C, kept, ws, T_ERR));
  OK(dp_cache_record_stream(C, own, ws, T_ERR));
  OK(dp_cache_record_stream(C, pend, g, T_ERR));
  _Atomic int gate = 0, busy = 0;
  OK(dp_host_launch(g, gate_wait, &gate, T_ERR));
  OK(dp_host_launch(s, gate_wait, &busy, T_ERR)); /* the native stream busy: kept stays pending */
  OK(dp_cache_dealloc(C, pend, T_ERR)); /* pending on g */
  OK(dp_cache_dealloc(C, freed, T_ERR));
  atomic_store(&fail_every_allocation, 1);
  dp_set_allocator(failing_alloc, NULL);
  OK(dp_cache_dealloc(C, kept, T_ERR)); /* no event: ws kept as a use */
  dp_set_allocator(t_alloc, NULL);
  atomic_store(&fail_every_allocation, 0);
  cr_assert_eq(stats(H0).pending_blocks, 2);
  books("before");
  atomic_store(&busy, 1);
  dp_stream_free(s); /* its notices come before any poll: kept is still pending */
  books("after the native stream went");
  cr_assert_eq(dp_cache_poll(C, NULL), 1, "the block kept for the wrapper waits for no stream");
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(g, T_ERR));
  OK(dp_cache_dealloc(C, inuse, T_ERR));
  OK(dp_cache_dealloc(C, own, T_ERR));
  OK(dp_cache_dealloc(C, theirs, T_ERR));
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.pending_blocks, 0);
  cr_assert_eq(st.allocated, 0);
  books("at the end");
  dp_stream_free(t);
  dp_stream_free(g);
}

/* A cache freed with blocks pending — on events and on uses kept for want
 * of one, of streams on both devices — lets go of its lists: the streams
 * destroyed afterwards find nothing of it (ASan: nothing of it is read). */
Test(allocator, streams_destroyed_after_their_cache_was_freed_with_blocks_pending_on_them_touch_nothing) {
  dp_cache_t *c2;
  OK(dp_cache_new(B, &c2, T_ERR));
  dp_stream_t *s = stream(H0), *u0 = stream(H0), *u1 = stream(H1);
  void *p[4];
  for (int i = 0; i < 4; i++) {
    OK(dp_cache_alloc(c2, H0, 4096, s, &p[i], T_ERR));
    OK(dp_cache_record_stream(c2, p[i], u0, T_ERR));
    OK(dp_cache_record_stream(c2, p[i], u1, T_ERR));
  }
  _Atomic int gate = 0;
  OK(dp_host_launch(u1, gate_wait, &gate, T_ERR));
  OK(dp_cache_dealloc(c2, p[0], T_ERR)); /* pending on u1's event */
  atomic_store(&fail_every_allocation, 1);
  dp_set_allocator(failing_alloc, NULL);
  OK(dp_cache_dealloc(c2, p[1], T_ERR)); /* pending on u1, kept as a use */
  dp_set_allocator(t_alloc, NULL);
  atomic_store(&fail_every_allocation, 0);
  cr_assert_null(dp__cache_check(c2), "%s", dp__cache_check(c2));
  dp_cache_stats_t st;
  OK(dp_cache_stats(c2, H0, &st, T_ERR));
  cr_assert_eq(st.pending_blocks, 2);
  atomic_store(&gate, 1); /* dp_cache_free waits for u1's device */
  dp_cache_free(c2); /* p[2] and p[3] still allocated, recorded on u0 and u1 */
  dp_stream_free(u0);
  dp_stream_free(u1);
  dp_stream_free(s);
}

/* An allocation on a new stream out of memory at each allocation in turn
 * (its free set, the table of sets, the split's block struct, the map),
 * beside blocks in use, recorded and pending: a failure ties nothing, and
 * the books agree. With 0 to 40 blocks held, so that the map and the
 * tables grow at some point of the run. */
Test(allocator, an_allocation_out_of_memory_at_any_allocation_ties_nothing) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  void *held[40];
  long failed = 0;
  _Atomic int gate = 0;
  OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
  for (int n = 0; n <= 40; n++) {
    for (long k = 1;; k++) {
      cr_assert_lt(k, 100);
      dp_stream_t *t = stream(H0);
      void *p = NULL;
      long want = t_fail_at = t_alloc_count + k;
      dp_error_t e;
      int rc = dp_cache_alloc(C, H0, 4096, t, &p, &e);
      int hit = t_alloc_count >= want;
      t_fail_at = 0;
      books("%d held, allocation %ld failed", n, k);
      if (rc) {
        failed++;
        cr_assert_eq(rc, DP_ENOMEM, "%s", e.message);
      } else {
        OK(dp_cache_record_stream(C, p, u, T_ERR));
        OK(dp_cache_dealloc(C, p, T_ERR)); /* pending on u */
      }
      dp_stream_free(t);
      books("%d held, allocation %ld failed, its stream gone", n, k);
      if (!hit) break;
    }
    if (n < 40) {
      OK(dp_cache_alloc(C, H0, 4096, s, &held[n], T_ERR));
      OK(dp_cache_record_stream(C, held[n], u, T_ERR));
    }
  }
  cr_assert_gt(failed, 40);
  atomic_store(&gate, 1);
  OK(dp_stream_synchronize(u, T_ERR));
  for (int n = 0; n < 40; n++) OK(dp_cache_dealloc(C, held[n], T_ERR));
  dp_stream_free(u);
  dp_stream_free(s);
  cr_assert_geq(dp_cache_poll(C, NULL), 0);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.allocated, 0);
  cr_assert_eq(st.pending_blocks, 0);
}

/* cache.h: a NULL out, backend or stream is DP_EINVAL naming the function
 * and the argument; a device of another backend, or one past the
 * backend's, is DP_EINVAL naming it; a stream on another device than the
 * one allocated from is DP_EINVAL naming both; none of them allocates. The
 * block lookup's base and size may both be NULL. */
Test(allocator, a_null_out_backend_or_stream_and_a_device_not_the_backends_are_einval_naming_them) {
  dp_error_t e;
  void *p = NULL;
  dp_cache_t *c = NULL;
  dp_cache_stats_t st;
  dp_stream_t *s0 = stream(H0), *s1 = stream(H1);
  long before = t_alloc_count;
  cr_assert_eq(dp_cache_new(NULL, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_new: NULL backend");
  cr_assert_eq(dp_cache_new(B, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_new: NULL out");
  cr_assert_eq(dp_cache_default(B, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_default: NULL out");
  cr_assert_eq(dp_cache_alloc(C, H0, 64, s0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_alloc: NULL out");
  cr_assert_eq(dp_cache_alloc(C, t_dev(DP_DEVICE_CUDA, 0), 64, NULL, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_alloc: device cuda:0 does not belong to the host backend (2 devices)");
  cr_assert_eq(dp_cache_alloc(C, t_dev(DP_DEVICE_HOST, 2), 64, NULL, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_alloc: device host:2 does not belong to the host backend (2 devices)");
  cr_assert_eq(dp_cache_alloc(C, H0, 64, s1, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_alloc(host:0): the stream is on host:1; it must be on the device allocated from");
  cr_assert_eq(dp_cache_stats(C, H0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_stats: NULL out");
  dp_cache_hooks_chain_t *ch = NULL;
  cr_assert_eq(dp_cache_hooks_chain_new(NULL, 1, &ch, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_hooks_chain_new: NULL list");
  cr_assert_null(ch);
  cr_assert_null(p);
  cr_assert_eq(t_alloc_count, before, "a refused call allocated");
  OK(dp_cache_alloc(C, H0, 64, s0, &p, T_ERR));
  cr_assert_eq(dp_cache_record_stream(C, p, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_cache_record_stream: NULL stream");
  OK(dp_cache_lookup(C, (char *)p + 63, NULL, NULL, T_ERR));
  st = stats(H0);
  cr_assert_eq(st.allocated, 512);
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s0);
  dp_stream_free(s1);
}

/* cache.h promises messages that name the function: each hook of the
 * allocator names itself, not its sibling (record_streams_owned reported
 * a NULL cache or ptrs as the record_streams hook). */
Test(allocator, each_hook_names_itself_in_its_einval_messages) {
  dp_stream_t *s = stream(H0);
  unsigned char owned[2] = {0, 0};
  dp_error_t e;
  dp_cache_hooks_t none = dp_cache_hooks(NULL), h = dp_cache_hooks(C);
  cr_assert_eq(none.record_stream(none.ctx, &e, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_stream: NULL cache");
  cr_assert_eq(none.record_streams(none.ctx, NULL, 0, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams: NULL cache");
  cr_assert_eq(none.record_streams_owned(none.ctx, NULL, 0, s, owned, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams_owned: NULL cache");
  cr_assert_eq(h.record_streams_owned(h.ctx, NULL, 0, NULL, owned, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams_owned: NULL stream");
  cr_assert_eq(h.record_streams_owned(h.ctx, NULL, 2, s, owned, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams_owned: NULL ptrs with n = 2");
  cr_assert_eq(h.record_streams(h.ctx, NULL, 2, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "record_streams: NULL ptrs with n = 2");
  dp_stream_free(s);
}

/* cache.h: the hooks of a NULL allocator (dp_cache_hooks(NULL)) have all
 * three functions set, and each reports DP_EINVAL, recording nothing. */
Test(allocator, each_hook_of_a_null_allocator_reports_einval) {
  dp_stream_t *s = stream(H0);
  void *p;
  OK(dp_cache_alloc(C, H0, 64, s, &p, T_ERR));
  dp_cache_hooks_t h = dp_cache_hooks(NULL);
  cr_assert(h.record_stream && h.record_streams && h.record_streams_owned);
  void *ptrs[1] = {p};
  unsigned char owned[1] = {0};
  dp_error_t e;
  cr_assert_eq(h.record_stream(h.ctx, p, s, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "NULL cache") != NULL, "%s", e.message);
  cr_assert_eq(h.record_streams(h.ctx, ptrs, 1, s, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "NULL cache") != NULL, "%s", e.message);
  cr_assert_eq(h.record_streams_owned(h.ctx, ptrs, 1, s, owned, &e), DP_EINVAL);
  cr_assert(strstr(e.message, "NULL cache") != NULL, "%s", e.message);
  cr_assert_eq(owned[0], 0, "a refused batch marked a pointer owned");
  OK(dp_cache_dealloc(C, p, T_ERR));
  dp_stream_free(s);
}

/* cache.h's example of the split rule: a request of 1 MiB + 1 is a large
 * one, served from a segment of 2 MiB whose remainder (1 MiB - 512) is
 * not more than 1 MiB, so the block holds the whole segment and
 * `allocated` counts it; 1 MiB + 512 left over a large block is split off. */
Test(allocator, a_request_just_over_one_mebibyte_holds_its_whole_segment_and_allocated_counts_it) {
  dp_stream_t *s = stream(H0);
  void *p, *q, *base;
  size_t size;
  OK(dp_cache_alloc(C, H0, (1 << 20) + 1, s, &p, T_ERR));
  OK(dp_cache_lookup(C, p, &base, &size, T_ERR));
  cr_assert_eq(size, 2 << 20);
  dp_cache_stats_t st = stats(H0);
  cr_assert_eq(st.allocated, 2 << 20);
  cr_assert_eq(st.reserved, 2 << 20);
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_cache_empty(C, T_ERR));
  OK(dp_cache_alloc(C, H0, 8 << 20, s, &p, T_ERR));
  OK(dp_cache_dealloc(C, p, T_ERR));
  OK(dp_cache_alloc(C, H0, (7 << 20) - 512, s, &q, T_ERR));
  OK(dp_cache_lookup(C, q, &base, &size, T_ERR));
  cr_assert_eq(size, (7 << 20) - 512, "1 MiB + 512 left was not split off");
  OK(dp_cache_dealloc(C, q, T_ERR));
  OK(dp_cache_alloc(C, H0, 7 << 20, s, &q, T_ERR));
  OK(dp_cache_lookup(C, q, &base, &size, T_ERR));
  cr_assert_eq(size, 8 << 20, "1 MiB left was split off");
  OK(dp_cache_dealloc(C, q, T_ERR));
  dp_stream_free(s);
}

/* cache.h: dp_cache_stats polls pending blocks before it counts, and
 * dp_cache_poll returns how many blocks came back (0 while their streams
 * still work). */
Test(allocator, stats_poll_first_and_a_poll_returns_how_many_blocks_came_back) {
  dp_stream_t *s = stream(H0), *u = stream(H0);
  for (int round = 0; round < 2; round++) {
    void *p, *q;
    OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
    OK(dp_cache_alloc(C, H0, 10000, s, &q, T_ERR));
    _Atomic int gate = 0;
    OK(dp_host_launch(u, gate_wait, &gate, T_ERR));
    OK(dp_cache_record_stream(C, p, u, T_ERR));
    OK(dp_cache_record_stream(C, q, u, T_ERR));
    OK(dp_cache_dealloc(C, p, T_ERR));
    OK(dp_cache_dealloc(C, q, T_ERR));
    cr_assert_eq(dp_cache_poll(C, NULL), 0, "the blocks came back while u is held");
    cr_assert_eq(stats(H0).pending_blocks, 2);
    atomic_store(&gate, 1);
    OK(dp_stream_synchronize(u, T_ERR));
    if (round == 0) {
      dp_cache_stats_t st = stats(H0);
      cr_assert_eq(st.pending_blocks, 0, "stats counted before polling");
      cr_assert_eq(st.pending_bytes, 0);
      cr_assert_eq(dp_cache_poll(C, NULL), 0, "nothing was left to come back");
    } else {
      cr_assert_eq(dp_cache_poll(C, NULL), 2);
      cr_assert_eq(stats(H0).pending_blocks, 0);
    }
  }
  dp_stream_free(u);
  dp_stream_free(s);
}

/* cache_hits counts allocations served without a backend malloc, and
 * cross_stream the blocks another stream took (cache.h): an allocation
 * that fails after finding its block (out of memory mapping it) served
 * nothing and took nothing, so it counts neither — nor an allocation. */
Test(allocator, an_allocation_that_fails_after_finding_a_cached_block_counts_no_hit_and_no_cross_stream_take) {
  dp_stream_t *s = stream(H0);
  void *a, *b1, *b2, *held[40];
  /* s's small segment filled exactly, its first 4 KiB free: a 4 KiB
     request of another stream takes that block whole, with no split */
  OK(dp_cache_alloc(C, H0, 4096, s, &a, T_ERR));
  OK(dp_cache_alloc(C, H0, 1 << 20, s, &b1, T_ERR));
  OK(dp_cache_alloc(C, H0, (1 << 20) - 4096, s, &b2, T_ERR));
  OK(dp_cache_dealloc(C, a, T_ERR));
  long failed = 0;
  /* with 0 .. 40 blocks held (large ones, of segments of their own), so
     that the pointer map grows — and that growth fails — at some counts */
  for (int n = 0; n <= 40; n++) {
    for (long k = 1;; k++) {
      cr_assert_lt(k, 100);
      dp_stream_t *t = stream(H0);
      dp_cache_stats_t before = stats(H0);
      void *p = NULL;
      dp_error_t e;
      long want = t_fail_at = t_alloc_count + k;
      int rc = dp_cache_alloc(C, H0, 4096, t, &p, &e);
      int hit = t_alloc_count >= want;
      t_fail_at = 0;
      dp_cache_stats_t after = stats(H0);
      books("%d held, allocation %ld failed", n, k);
      if (rc) {
        failed++;
        cr_assert_eq(rc, DP_ENOMEM, "%s", e.message);
        cr_assert_eq(after.allocs, before.allocs, "allocation %ld failed: %s", k, e.message);
        cr_assert_eq(after.cache_hits, before.cache_hits, "%d held, allocation %ld failed (%s), yet counted as a cache hit",
                     n, k, e.message);
        cr_assert_eq(after.cross_stream, before.cross_stream,
                     "%d held, allocation %ld failed (%s), yet counted as a block taken across streams", n, k,
                     e.message);
      } else {
        cr_assert_eq(p, a, "s's free block");
        cr_assert_eq(after.allocs, before.allocs + 1);
        cr_assert_eq(after.cache_hits, before.cache_hits + 1, "served from the cache");
        cr_assert_eq(after.cross_stream, before.cross_stream + 1, "taken from s");
        OK(dp_cache_dealloc(C, p, T_ERR));
      }
      dp_stream_free(t);
      if (rc == 0) { /* the block went stream-less with t: s takes it back, for the next t to take from s */
        OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
        cr_assert_eq(p, a);
        OK(dp_cache_dealloc(C, p, T_ERR));
      }
      if (!hit) break;
    }
    if (n < 40) OK(dp_cache_alloc(C, H0, (1 << 20) + 1, s, &held[n], T_ERR));
  }
  cr_assert_gt(failed, 40);
  for (int n = 0; n < 40; n++) OK(dp_cache_dealloc(C, held[n], T_ERR));
  OK(dp_cache_dealloc(C, b1, T_ERR));
  OK(dp_cache_dealloc(C, b2, T_ERR));
  dp_stream_free(s);
}

/* dp_cache_dealloc takes the pointer dp_cache_alloc returned (cache.h),
 * while record_stream and lookup take interior pointers too: an interior
 * pointer handed to dp_cache_dealloc is DP_EINVAL, and says so — it is in
 * an allocation of this allocator, which stays allocated — rather than
 * calling the pointer foreign or already freed. */
Test(allocator, freeing_an_interior_pointer_is_einval_naming_its_allocation_which_stays_allocated) {
  dp_stream_t *s = stream(H0);
  void *p, *q;
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  OK(dp_cache_alloc(C, H0, 3 << 20, s, &q, T_ERR)); /* a large block too */
  char want[160];
  dp_error_t e;
  void *inner[] = {(char *)p + 1, (char *)p + 4095, (char *)q + (2 << 20)};
  void *base[] = {p, p, q};
  size_t size[] = {4096, 4096, 4 << 20};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(dp_cache_dealloc(C, inner[i], &e), DP_EINVAL);
    cr_assert_eq(e.code, DP_EINVAL);
    snprintf(want, sizeof want, "dp_cache_dealloc(%p): inside the allocation at %p (%zu bytes), not its start",
             inner[i], base[i], size[i]);
    cr_assert_str_eq(e.message, want);
  }
  void *b;
  size_t n;
  OK(dp_cache_lookup(C, p, &b, &n, T_ERR)); /* still allocated */
  cr_assert_eq(b, p);
  cr_assert_eq(stats(H0).allocated, 4096 + (4 << 20));
  /* a pointer past every allocation, and one into a freed block, keep the old answer */
  OK(dp_cache_dealloc(C, q, T_ERR));
  cr_assert_eq(dp_cache_dealloc(C, (char *)q + 512, &e), DP_EINVAL);
  snprintf(want, sizeof want, "dp_cache_dealloc(%p): not allocated by this allocator, or already freed", (void *)((char *)q + 512));
  cr_assert_str_eq(e.message, want);
  OK(dp_cache_dealloc(C, p, T_ERR));
  cr_assert_eq(stats(H0).allocated, 0);
  dp_stream_free(s);
}

/* An allocation looks in its own stream's free blocks and in those tied to
 * no stream (cache.h) and takes the best fit of the two — a stream-less
 * block needs no wait either —: it does not split a larger block of its
 * own while an exact one lies free. */
Test(allocator, an_allocation_takes_the_best_fit_of_its_own_streams_blocks_and_the_stream_less_ones) {
  dp_stream_t *s = stream(H0), *t = stream(H0);
  void *a, *b, *g1, *g2, *y, *z, *f1, *f2, *p;
  /* s's segment, filled exactly */
  OK(dp_cache_alloc(C, H0, 8192, s, &a, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, s, &b, T_ERR));
  OK(dp_cache_alloc(C, H0, 1 << 20, s, &g1, T_ERR));
  OK(dp_cache_alloc(C, H0, (1 << 20) - 12288, s, &g2, T_ERR));
  /* t's segment, filled exactly */
  OK(dp_cache_alloc(C, H0, 4096, t, &y, T_ERR));
  OK(dp_cache_alloc(C, H0, 4096, t, &z, T_ERR));
  OK(dp_cache_alloc(C, H0, 1 << 20, t, &f1, T_ERR));
  OK(dp_cache_alloc(C, H0, (1 << 20) - 8192, t, &f2, T_ERR));
  cr_assert_eq(stats(H0).segment_allocs, 2);
  OK(dp_cache_dealloc(C, y, T_ERR));
  dp_stream_free(t); /* y: 4 KiB tied to no stream */
  OK(dp_cache_dealloc(C, a, T_ERR)); /* a: 8 KiB of s's */
  dp_cache_stats_t before = stats(H0);
  OK(dp_cache_alloc(C, H0, 4096, s, &p, T_ERR));
  cr_assert_eq(p, y, "the exact stream-less block, not s's larger one split (%p; s's is at %p)", p, a);
  cr_assert_eq(stats(H0).cross_stream, before.cross_stream);
  OK(dp_cache_alloc(C, H0, 8192, s, &a, T_ERR));
  void *all[] = {p, a, b, g1, g2, z, f1, f2};
  for (int i = 0; i < 8; i++) OK(dp_cache_dealloc(C, all[i], T_ERR));
  dp_stream_free(s);
}
