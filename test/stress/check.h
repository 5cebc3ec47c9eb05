/* test/stress/check.h — what the stress programs share: a scenario is an
 * int (*)(void) that returns 0 or, through CHECK, 1 with the reason on
 * stderr; run() counts it and starts the next one from a clean library. */
#ifndef DP_STRESS_CHECK_H
#define DP_STRESS_CHECK_H

#include <stdio.h>

#include "devpickle.h"

static int failures, passes;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
      return 1;                                            \
    }                                                      \
  } while (0)

static void run(const char *name, int (*fn)(void)) {
  int rc = fn();
  if (rc) failures++;
  else passes++;
  printf("%s %s\n", rc ? "FAIL" : "ok  ", name);
  dp_value_collect();
  dp_shutdown();
}

#endif
