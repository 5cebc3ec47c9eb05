/* bench/bench.h — timing and the bench.json writer. */
#ifndef DP_BENCH_H
#define DP_BENCH_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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
#endif
