/* test/fuzz/fuzz.h — shared by the libFuzzer targets. */
#ifndef DP_FUZZ_H
#define DP_FUZZ_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "devpickle.h"

/* The checksum a writer would put in bytes 32..39: fuzzed frames get it, as
 * an attacker's would, so that mutations reach the decoder behind it. */
static inline void fuzz_fix_checksum(uint8_t *f, size_t n) {
  if (n < 40) return;
  uint64_t sum = XXH3_64bits_withSeed(f + 40, n - 40, XXH3_64bits(f, 32));
  for (int i = 0; i < 8; i++) f[32 + i] = (uint8_t)(sum >> (8 * i));
}

/* A small budget keeps each execution fast: limits are part of the surface. */
static inline dp_unpickle_opts_t fuzz_opts(void) {
  dp_unpickle_opts_t o;
  memset(&o, 0, sizeof o);
  o.limits.max_depth = 4096;
  o.limits.max_items = 1 << 16;
  o.limits.max_bytes = 1 << 22;
  return o;
}
#endif
