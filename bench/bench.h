/* bench/bench.h — timing and the bench.json writer. */
#ifndef DP_BENCH_H
#define DP_BENCH_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/types.h>
#include <unistd.h>

#include "devpickle.h"

static inline double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The output path of a bench binary: its one argument (default
 * build/bench.json), to which it appends its rows. -h or --help prints the
 * usage; any other argument starting with '-', or a second argument, is a
 * usage error (exit 2) rather than a file name. */
static inline const char *bench_out(int argc, char **argv) {
  int help = argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"));
  if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
    fprintf(help ? stdout : stderr,
            "usage: %s [OUT.json]\n"
            "Runs this benchmark and appends its rows to OUT.json (default build/bench.json),\n"
            "one JSON object a line: name, backend, value, unit, ratio, ratio_vs\n"
            "(docs/PERFORMANCE.md). 'make bench' runs every bench binary.\n",
            argv[0]);
    exit(help ? 0 : 2);
  }
  return argc > 1 ? argv[1] : "build/bench.json";
}

/* Forks a peer process running peer(wfd), which writes one int (its port,
 * or what it has to say instead) to wfd; returns that int, *pid the peer.
 * Exits when the peer never says. */
static inline int bench_spawn(void (*peer)(int wfd), pid_t *pid) {
  int fds[2], port;
  if (pipe(fds)) exit(1);
  *pid = fork();
  if (*pid == 0) {
    close(fds[0]);
    peer(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  if (read(fds[0], &port, sizeof port) != sizeof port) {
    fprintf(stderr, "the peer process did not start\n");
    exit(1);
  }
  close(fds[0]);
  return port;
}

static int bench_cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Fastest over `rounds` of the seconds per call of fn(ctx), each round
 * running enough calls to last about 20 ms. The fastest round is the one
 * least disturbed by other tenants of a shared machine; the median moved by
 * half between runs on the 2-core VM where these figures were taken. */
static inline double bench_time(void (*fn)(void *), void *ctx, int rounds) {
  fn(ctx); /* warm up */
  int iters = 1;
  for (;;) {
    double t0 = bench_now();
    for (int i = 0; i < iters; i++) fn(ctx);
    double dt = bench_now() - t0;
    if (dt > 0.02 || iters > (1 << 24)) break;
    iters *= 2;
  }
  double *s = malloc(sizeof(double) * (size_t)rounds);
  for (int r = 0; r < rounds; r++) {
    double t0 = bench_now();
    for (int i = 0; i < iters; i++) fn(ctx);
    s[r] = (bench_now() - t0) / iters;
  }
  qsort(s, (size_t)rounds, sizeof(double), bench_cmp);
  double best = s[0];
  free(s);
  return best;
}

/* Alternates two measurements so that both see the same machine state. */
static inline void bench_pair(void (*a)(void *), void (*b)(void *), void *ctx, int rounds, double *ta, double *tb) {
  double *xa = malloc(sizeof(double) * (size_t)rounds), *xb = malloc(sizeof(double) * (size_t)rounds);
  for (int r = 0; r < rounds; r++) {
    xa[r] = bench_time(a, ctx, 3);
    xb[r] = bench_time(b, ctx, 3);
  }
  qsort(xa, (size_t)rounds, sizeof(double), bench_cmp);
  qsort(xb, (size_t)rounds, sizeof(double), bench_cmp);
  *ta = xa[0];
  *tb = xb[0];
  free(xa);
  free(xb);
}

static inline void bench_row(const char *file, const char *name, const char *backend, double value, const char *unit,
                             double ratio, const char *ratio_vs) {
  FILE *f = fopen(file, "a");
  if (!f) {
    perror(file);
    exit(1);
  }
  fprintf(f, "{\"name\": \"%s\", \"backend\": \"%s\", \"value\": %.4g, \"unit\": \"%s\", \"ratio\": %.3f, \"ratio_vs\": \"%s\"}\n",
          name, backend, value, unit, ratio, ratio_vs);
  fclose(f);
  printf("%-22s %-5s %10.4g %-7s ratio %6.3f vs %s\n", name, backend, value, unit, ratio, ratio_vs);
}
/* ---- threads: the same work on T threads at once ---- */
#include <pthread.h>

typedef struct bench_thread {
  void (*fn)(void *ctx, int thread);  /* one iteration */
  void *ctx;
  int id, iters;
  pthread_barrier_t *go;
  double t0, t1;
} bench_thread_t;

static void *bench_thread_main(void *p) {
  bench_thread_t *b = p;
  b->fn(b->ctx, b->id);  /* warm up this thread's caches and buffers */
  pthread_barrier_wait(b->go);
  b->t0 = bench_now();
  for (int i = 0; i < b->iters; i++) b->fn(b->ctx, b->id);
  b->t1 = bench_now();
  return NULL;
}

/* Iterations per second of fn over T threads together, each running
 * `iters` iterations after a common start: the best of `rounds`. */
static inline double bench_threads(void (*fn)(void *, int), void *ctx, int T, int iters, int rounds) {
  double best = 0;
  bench_thread_t *b = malloc(sizeof *b * (size_t)T);
  pthread_t *th = malloc(sizeof *th * (size_t)T);
  for (int r = 0; r < rounds; r++) {
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)T);
    for (int i = 0; i < T; i++) {
      b[i] = (bench_thread_t){fn, ctx, i, iters, &go, 0, 0};
      pthread_create(&th[i], NULL, bench_thread_main, &b[i]);
    }
    double t0 = 1e300, t1 = 0;
    for (int i = 0; i < T; i++) {
      pthread_join(th[i], NULL);
      if (b[i].t0 < t0) t0 = b[i].t0;
      if (b[i].t1 > t1) t1 = b[i].t1;
    }
    pthread_barrier_destroy(&go);
    double rate = (double)T * iters / (t1 - t0);
    if (rate > best) best = rate;
  }
  free(b);
  free(th);
  return best;
}

/* One thread's work item for the threads rows: a list of BENCH_THREAD_OBJECTS
 * user objects, each holding a tensor on its own CPU storage (addresses
 * apart per thread, no device event or stream lock in the figure). */
#define BENCH_THREAD_OBJECTS 100
static inline dp_value_t bench_thread_objects(int thread) {
  static const dp_device_t cpu = {DP_DEVICE_CPU, 0};
  dp_value_t l;
  dp_list_new(BENCH_THREAD_OBJECTS, &l, NULL);
  for (int i = 0; i < BENCH_THREAD_OBJECTS; i++) {
    dp_storage_t *st;
    dp_value_t t, o;
    int64_t shape[1] = {256};
    uintptr_t base = 0x100000000000u + ((uintptr_t)thread << 32) + (uintptr_t)i * 4096;
    dp_storage_new(cpu, (void *)base, 1024, NULL, NULL, &st, NULL);
    dp_tensor_new(st, DP_FLOAT32, 1, shape, NULL, 0, &t, NULL);
    dp_object_new("Activation", &o, NULL);
    dp_object_set(o, "data", t, NULL);
    dp_list_append(l, o, NULL);
  }
  return l;
}

/* Anchors for the scaling factors: what the host gives work that shares
 * nothing. threads_spin_T: pure register arithmetic (eight independent
 * chains, about a row's iteration long) — the ceiling that the cores, their
 * clocks under load and the hypervisor's placement set for any code.
 * threads_malloc_T: the C library's malloc and free of 301 small blocks,
 * the sizes a row's iteration builds its value from — the ceiling of any
 * code that allocates as the rows do. */
static _Thread_local volatile uint64_t bench_sink;  /* keeps the spin's result alive */

static inline void bench_thread_spin(void *ctx, int thread) {
  (void)ctx;
  uint64_t a[8];
  for (int j = 0; j < 8; j++) a[j] = (uint64_t)thread + (uint64_t)j;
  for (int i = 0; i < 6000; i++)
    for (int j = 0; j < 8; j++) a[j] = (a[j] ^ (a[j] >> 7)) + (a[j] << 3) + 0x9e3779b97f4a7c15ull;
  uint64_t x = 0;
  for (int j = 0; j < 8; j++) x ^= a[j];
  bench_sink = x;
}

static inline void bench_thread_malloc(void *ctx, int thread) {
  (void)ctx;
  (void)thread;
  void *p[301];
  for (int i = 0; i < 301; i++) {
    p[i] = malloc(48 + (size_t)(i % 3) * 40);
    if (!p[i]) exit(1);
    memset(p[i], 0, 48);
  }
  for (int i = 0; i < 301; i++) free(p[i]);
}

/* The rows PREFIX_T for T = 1, 2, 4, 16 threads running fn: thousands of
 * iterations per second, and the scaling factor over one thread. */
static inline void bench_thread_scaling(const char *out, void (*fn)(void *, int), const char *prefix,
                                        const char *backend) {
  static const int threads[] = {1, 2, 4, 16};
  double one = 0;
  char row[64];
  for (int k = 0; k < 4; k++) {
    double rate = bench_threads(fn, NULL, threads[k], 2000, 5);
    if (k == 0) one = rate;
    snprintf(row, sizeof row, "%s_%d", prefix, threads[k]);
    bench_row(out, row, backend, rate / 1e3, "k/s", rate / one, "one thread (scaling factor)");
  }
}
#endif
