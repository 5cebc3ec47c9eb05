/* test/helpers.h — shared by the Criterion suites. */
#ifndef DP_TEST_HELPERS_H
#define DP_TEST_HELPERS_H

#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "devpickle.h"
#include "mem_reader.h"

/* Sleeps ms milliseconds (the whole of them, signals or not). */
static inline void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* ---- a counting allocator that can fail the Nth allocation ---- */
static _Atomic long t_live_blocks;
static _Atomic long t_live_bytes;
static _Atomic long t_alloc_count;
static long t_fail_at;  /* fail allocation number t_fail_at (1-based); 0: never */
static _Atomic long t_max_block; /* the largest block asked for since t_track() */

static void *t_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  (void)ud;
  if (nsize == 0) {
    if (ptr) {
      atomic_fetch_sub(&t_live_blocks, 1);
      atomic_fetch_sub(&t_live_bytes, (long)osize);
    }
    free(ptr);
    return NULL;
  }
  long n = atomic_fetch_add(&t_alloc_count, 1) + 1;
  if (t_fail_at && n == t_fail_at) return NULL;
  void *p = realloc(ptr, nsize);
  if (!p) return NULL;
  long m = atomic_load(&t_max_block);
  while ((long)nsize > m && !atomic_compare_exchange_weak(&t_max_block, &m, (long)nsize)) {
  }
  if (!ptr) atomic_fetch_add(&t_live_blocks, 1);
  atomic_fetch_add(&t_live_bytes, (long)nsize - (long)osize);
  return p;
}

/* t_alloc, with every byte it hands out new set to 0xff: a read of memory
 * the library never wrote (an item past a container's end, a flag left
 * unset) finds no zero that happens to read as none, false or clear. */
static inline void *t_alloc_filled(void *ud, void *ptr, size_t osize, size_t nsize) {
  void *p = t_alloc(ud, ptr, osize, nsize);
  if (p && nsize > osize) memset((char *)p + osize, 0xff, nsize - osize);
  return p;
}

static inline void t_track(void) {
  t_live_blocks = 0;
  t_live_bytes = 0;
  t_alloc_count = 0;
  t_fail_at = 0;
  t_max_block = 0;
  dp_set_allocator(t_alloc, NULL);
}

/* Fails allocation 1, 2, 3, ... of run(ctx, err) (counted from its start)
 * until a run has none failed, and returns how many runs failed one. Before
 * each run, prepare(ctx) (may be NULL) makes what the call is given, with
 * nothing failed; after it, check(ctx, rc, k) asserts the state the call left
 * (rc its return, 0 when the failure was absorbed) and frees what it made.
 * A failed run must return DP_ENOMEM with the code and a message in err. */
typedef struct t_sweep {
  void (*prepare)(void *ctx);
  int (*run)(void *ctx, dp_error_t *err);
  void (*check)(void *ctx, int rc, long k);
} t_sweep_t;

__attribute__((unused)) static long t_sweep(const t_sweep_t *s, void *ctx) {
  for (long k = 1;; k++) {
    cr_assert_lt(k, 10000, "the call never ran without a failed allocation");
    if (s->prepare) s->prepare(ctx);
    dp_error_t e;
    dp_error_clear(&e);
    long want = t_fail_at = atomic_load(&t_alloc_count) + k;
    int rc = s->run(ctx, &e);
    int hit = atomic_load(&t_alloc_count) >= want;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld failed: %s: %s", k, dp_err_name(rc), e.message);
      cr_assert_eq(e.code, rc, "allocation %ld failed: err->code %d", k, e.code);
      cr_assert(e.message[0], "allocation %ld failed: DP_ENOMEM without a message", k);
    }
    s->check(ctx, rc, k);
    if (!hit) {
      cr_assert_eq(rc, 0, "with no allocation failed, the call succeeds");
      return k - 1;
    }
  }
}

/* Cycles released on this thread are collected first (dp_value_collect):
 * what is still live afterwards is a leak. */
#define ASSERT_NO_LEAK()                                                              \
  do {                                                                                \
    dp_value_collect();                                                               \
    cr_assert(atomic_load(&t_live_blocks) == 0 && atomic_load(&t_live_bytes) == 0,   \
              "%ld blocks (%ld bytes) still live (a block freed with another size " \
              "than it was allocated with shows as bytes)",                         \
              atomic_load(&t_live_blocks), atomic_load(&t_live_bytes));             \
  } while (0)

/* Assert that a fallible call succeeds; on failure, show the call, the code
 * and the library's message. Inside OK(), T_ERR is the error record to pass:
 *   OK(dp_list_append(l, v, T_ERR));
 * A call that fills its own record (to look at it afterwards) names it:
 *   OK_WITH(&e, dp_unpickle(b, n, NULL, &out, &e));
 * A call that takes no dp_error_t shows the code alone. */
#define T_ERR (&t_err_)
#define OK(call)                                                                       \
  do {                                                                                 \
    dp_error_t t_err_;                                                                 \
    dp_error_clear(&t_err_);                                                           \
    int t_rc_ = (call);                                                                \
    cr_assert_eq(t_rc_, 0, "%s failed: %s: %s", #call, dp_err_name(t_rc_), t_err_.message); \
  } while (0)
#define OK_WITH(errp, call)                                                            \
  do {                                                                                 \
    const dp_error_t *t_errp_ = (errp);                                                \
    int t_rc_ = (call);                                                                \
    cr_assert_eq(t_rc_, 0, "%s failed: %s: %s", #call, dp_err_name(t_rc_),             \
                 t_errp_ ? t_errp_->message : "");                                     \
  } while (0)

/* Runs body(arg) in a child process with its stderr captured into msg (cap
 * bytes, NUL-ended); body ends the child with _exit. Returns the signal that
 * ended the child, or 0 when it exited 0 (another status fails the test). */
static inline int t_in_child(void (*body)(void *), void *arg, char *msg, size_t cap) {
  int fd[2];
  cr_assert_eq(pipe(fd), 0);
  fflush(NULL);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    dup2(fd[1], 2);
    close(fd[0]);
    body(arg);
    _exit(0);
  }
  close(fd[1]);
  size_t n = 0;
  ssize_t got;
  while (n + 1 < cap && (got = read(fd[0], msg + n, cap - 1 - n)) > 0) n += (size_t)got;
  msg[n] = '\0';
  close(fd[0]);
  int status;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  if (WIFSIGNALED(status)) return WTERMSIG(status);
  cr_assert_eq(WEXITSTATUS(status), 0, "the child exited %d", WEXITSTATUS(status));
  return 0;
}

static inline dp_device_t t_dev(int type, int index) {
  dp_device_t d = {(uint8_t)type, (uint8_t)index};
  return d;
}

static inline dp_value_t t_str(const char *s) {
  dp_value_t v;
  OK(dp_str_new(s, strlen(s), &v, T_ERR));
  return v;
}

static inline dp_storage_t *t_storage(dp_device_t d, uintptr_t base, size_t nbytes) {
  dp_storage_t *s;
  OK(dp_storage_new(d, (void *)base, nbytes, NULL, NULL, &s, T_ERR));
  return s;
}

/* A contiguous float32 vector of n elements on its own storage. */
static inline dp_value_t t_tensor(dp_device_t d, uintptr_t base, int64_t n) {
  dp_value_t t;
  int64_t shape[1] = {n};
  OK(dp_tensor_new(t_storage(d, base, (size_t)n * 4), DP_FLOAT32, 1, shape, NULL, 0, &t, T_ERR));
  return t;
}

/* A view on an existing storage (borrowed; retained here). */
static inline dp_value_t t_view(dp_storage_t *s, int64_t n, int64_t offset) {
  dp_value_t t;
  int64_t shape[1] = {n};
  OK(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 1, shape, NULL, offset, &t, T_ERR));
  return t;
}

static inline dp_value_t t_list(void) {
  dp_value_t l;
  OK(dp_list_new(0, &l, T_ERR));
  return l;
}

static inline dp_value_t t_obj(const char *cls) {
  dp_value_t o;
  OK(dp_object_new(cls, &o, T_ERR));
  return o;
}

/* ---- a seeded random value generator ---- */
typedef struct t_rng {
  uint64_t s;
} t_rng_t;

static inline uint64_t t_rand(t_rng_t *r) {
  r->s ^= r->s << 13;
  r->s ^= r->s >> 7;
  r->s ^= r->s << 17;
  return r->s;
}

/* Storage pool so that random tensors share storages now and then. */
typedef struct t_pool {
  dp_storage_t *st[8];
} t_pool_t;

static inline void t_pool_init(t_pool_t *p, uint64_t salt) {
  for (int i = 0; i < 8; i++)
    p->st[i] = t_storage(t_dev(i % 3 == 0 ? DP_DEVICE_CPU : DP_DEVICE_CUDA, i % 3 == 0 ? 0 : i % 2),
                         0x7f0000000000u + (salt << 20) + (uintptr_t)i * 0x10000u, 4096);
}

static inline void t_pool_free(t_pool_t *p) {
  for (int i = 0; i < 8; i++) dp_storage_release(p->st[i]);
}

static dp_value_t t_random_value(t_rng_t *r, t_pool_t *pool, int depth);

static inline dp_value_t t_random_key(t_rng_t *r) {
  char buf[16];
  switch (t_rand(r) % 4) {
    case 0: return dp_int((int64_t)(t_rand(r) % 1000));
    case 1: {
      int n = (int)(t_rand(r) % 6);
      for (int i = 0; i < n; i++) buf[i] = (char)('a' + t_rand(r) % 26);
      dp_value_t s;
      OK(dp_str_new(buf, (size_t)n, &s, T_ERR));
      return s;
    }
    case 2: {
      dp_value_t t;
      OK(dp_tuple_new(2, &t, T_ERR));
      OK(dp_seq_set(t, 0, dp_int((int64_t)(t_rand(r) % 50)), T_ERR));
      OK(dp_seq_set(t, 1, dp_bool(t_rand(r) & 1), T_ERR));
      return t;
    }
    default: return dp_none();
  }
}

__attribute__((unused)) static dp_value_t t_random_value(t_rng_t *r, t_pool_t *pool, int depth) {
  uint64_t pick = t_rand(r) % (depth > 4 ? 7 : 12);
  dp_value_t v;
  switch (pick) {
    case 0: return dp_none();
    case 1: return dp_bool(t_rand(r) & 1);
    case 2: return dp_int((int64_t)t_rand(r));
    case 3: return dp_float((double)(int64_t)t_rand(r) / 7.0);
    case 4: {
      char buf[24];
      int n = (int)(t_rand(r) % 20);
      for (int i = 0; i < n; i++) buf[i] = (char)(' ' + t_rand(r) % 90);
      OK(dp_str_new(buf, (size_t)n, &v, T_ERR));
      return v;
    }
    case 5: {
      uint8_t buf[24];
      int n = (int)(t_rand(r) % 24);
      for (int i = 0; i < n; i++) buf[i] = (uint8_t)t_rand(r);
      OK(dp_bytes_new(buf, (size_t)n, &v, T_ERR));
      return v;
    }
    case 6: {
      dp_storage_t *s = pool->st[t_rand(r) % 8];
      int64_t n = (int64_t)(t_rand(r) % 64) + 1;
      return t_view(s, n, (int64_t)(t_rand(r) % 64));
    }
    case 7:
    case 8: {
      size_t n = t_rand(r) % 6;
      if (pick == 7) {
        v = t_list();
        for (size_t i = 0; i < n; i++) OK(dp_list_append(v, t_random_value(r, pool, depth + 1), T_ERR));
      } else {
        OK(dp_tuple_new(n, &v, T_ERR));
        for (size_t i = 0; i < n; i++) OK(dp_seq_set(v, i, t_random_value(r, pool, depth + 1), T_ERR));
      }
      return v;
    }
    case 9: {
      OK(dp_dict_new(0, &v, T_ERR));
      size_t n = t_rand(r) % 5;
      for (size_t i = 0; i < n; i++)
        OK(dp_dict_set(v, t_random_key(r), t_random_value(r, pool, depth + 1), T_ERR));
      return v;
    }
    default: {
      static const char *const names[] = {"weights", "bias", "next", "state", "x"};
      v = t_obj(t_rand(r) & 1 ? "Layer" : "Block");
      size_t n = t_rand(r) % 4;
      for (size_t i = 0; i < n; i++)
        OK(dp_object_set(v, names[t_rand(r) % 5], t_random_value(r, pool, depth + 1), T_ERR));
      return v;
    }
  }
}

#endif
