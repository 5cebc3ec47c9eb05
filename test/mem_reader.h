/* test/mem_reader.h — a dp_unpickle_stream reader over bytes in memory,
 * shared by the Criterion suites (helpers.h) and the fuzz targets (fuzz.h). */
#ifndef DP_TEST_MEM_READER_H
#define DP_TEST_MEM_READER_H
#include <stdint.h>
#include <string.h>

#include "devpickle.h"

typedef struct mem_reader {
  const uint8_t *p;
  size_t left;
  size_t chunk; /* the most bytes one call hands out: short reads make the stream refill */
} mem_reader_t;

static inline int mem_read(void *ud, void *dst, size_t n, size_t *got, dp_error_t *err) {
  (void)err;
  mem_reader_t *c = ud;
  size_t k = n < c->left ? n : c->left;
  if (k > c->chunk) k = c->chunk;
  memcpy(dst, c->p, k);
  c->p += k;
  c->left -= k;
  *got = k;
  return 0;
}
#endif
