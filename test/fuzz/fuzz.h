/* test/fuzz/fuzz.h — shared by the libFuzzer targets. */
#ifndef DP_FUZZ_H
#define DP_FUZZ_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "../mem_reader.h"
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

/* The canonical-form invariant: a frame the reader accepted is exactly what
 * the writer writes for the value read (inline when the frame is), so that
 * reading and writing again never changes a byte. Aborts otherwise. */
static inline void fuzz_expect_rewritten_same(const uint8_t *f, size_t n, dp_value_t v, uint32_t max_depth) {
  dp_frame_t *fr;
  dp_error_t e;
  if (dp_frame_new(&fr, NULL) != 0) abort();
  dp_pickle_opts_t po = {(f[6] & 1) ? DP_PICKLE_INLINE : 0, max_depth, NULL, NULL};
  if (dp_pickle(v, &po, fr, &e) != 0) {
    fprintf(stderr, "accepted frame cannot be written again: %s\n", e.message);
    abort();
  }
  size_t m;
  const uint8_t *b = dp_frame_data(fr, &m);
  if (m != n || memcmp(b, f, n) != 0) {
    size_t at = 0;
    while (at < n && at < m && b[at] == f[at]) at++;
    fprintf(stderr, "accepted frame of %zu bytes is written again as %zu bytes, first difference at byte %zu\n", n,
            m, at);
    abort();
  }
  dp_frame_free(fr);
}
#endif
