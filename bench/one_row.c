/* bench/one_row.c — one completion row of bench_future, in a process of its
 * own: one_row KIND N [ROUNDS [BACKEND]] prints the fastest round, in µs a
 * completion (KIND list, nested or objects; BACKEND host, the default, or
 * cuda; the same value, futures and timing loop as bench_future's
 * future_complete_KIND_N row).
 *
 * Why: on some hosts a binary's row lands in one of two modes from process
 * to process (the heap's and the code's placement), so that one run of each
 * of two binaries can show a difference that is neither's. Run it a dozen
 * times per binary and compare the distributions:
 *   for i in $(seq 12); do build/one_row list 1; done | sort -n */
#include <string.h>

#define main bench_future_main
#include "bench_future.c"
#undef main

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: one_row list|nested|objects N [ROUNDS [host|cuda]]\n");
    return 2;
  }
  int n = atoi(argv[2]), rounds = argc > 3 ? atoi(argv[3]) : 20;
  const char *k = argv[1];
  if ((strcmp(k, "list") && strcmp(k, "nested") && strcmp(k, "objects")) || n < 1 || n > 100000 || rounds < 1) {
    fprintf(stderr, "one_row: KIND list, nested or objects; N in 1..100000; ROUNDS >= 1\n");
    return 2;
  }
  ctx_t c = {0};
  const char *bk = argc > 4 ? argv[4] : "host";
  if (strcmp(bk, "host") && strcmp(bk, "cuda")) {
    fprintf(stderr, "one_row: BACKEND host or cuda\n");
    return 2;
  }
  dp_error_t e;
  if (dp_backend_get(bk[0] == 'c' ? DP_DEVICE_CUDA : DP_DEVICE_HOST, &c.b, &e)) {
    fprintf(stderr, "one_row: %s\n", e.message);
    return 1;
  }
  c.dev = dp_backend_device(c.b, 0);
  c.blocks = malloc(sizeof(void *) * 200000);
  c.fs = malloc(sizeof(dp_future_t *) * 1000);
  if (!c.blocks || !c.fs || dp_ptrset_new(&c.set, NULL) || dp_cache_default(c.b, &c.cache, NULL)) return 1;
  c.v = make(&c, argv[1], n);
  c.k = n >= 1000 ? 20 : n >= 100 ? 200 : 1000;
  printf("%.4f\n", time_ops(&c, rounds, COMPLETE) * 1e6);
  return 0;
}
