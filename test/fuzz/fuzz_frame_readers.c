/* What `verify`, `dump`, `inspect` and `unpack` do with a frame: unpickle
 * (whole, and streamed as verify/dump/inspect read it: both must accept the
 * same frames), scan with paths, print the tree, write value JSON. */
#include <stdio.h>

#include "../../tools/inspect.h"
#include "../../tools/vjson.h"
#include "fuzz.h"

static FILE *sink;

typedef struct cursor {
  const uint8_t *p;
  size_t left;
} cursor_t;

/* Hands out at most 7 bytes a call, to exercise the stream's refills. */
static int mem_read(void *ud, void *dst, size_t n, size_t *got, dp_error_t *err) {
  (void)err;
  cursor_t *c = ud;
  size_t k = n < c->left ? n : c->left;
  if (k > 7) k = 7;
  memcpy(dst, c->p, k);
  c->p += k;
  c->left -= k;
  *got = k;
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!sink) sink = fopen("/dev/null", "w");
  uint8_t *f = malloc(size ? size : 1);
  memcpy(f, data, size);
  fuzz_fix_checksum(f, size);
  dp_unpickle_opts_t o = fuzz_opts();
  dp_value_t v, sv;
  dp_frame_info_t fi;
  int whole = dp_frame_check(f, size, &fi, NULL) == 0 ? dp_unpickle(f, size, &o, &v, NULL) : -1;
  cursor_t c = {f, size};
  int streamed = dp_unpickle_stream(mem_read, &c, &o, &sv, NULL, NULL, NULL);
  if ((whole == 0) != (streamed == 0)) abort();  /* verify and unpack accept the same frames */
  if (streamed == 0) dp_value_release(sv);
  if (whole == 0) {
    dp_ptrset_t *set;
    dp_scan_opts_t so = {DP_SCAN_PATHS, 0};
    if (dp_ptrset_new(&set, NULL) == 0) {
      dp_scan(v, &so, set, NULL);
      for (size_t i = 0; i < dp_ptrset_count(set); i++) {
        dp_ptr_info_t p;
        dp_ptrset_get(set, i, &p);
        fprintf(sink, "%p %zu %u %s\n", p.base, p.nbytes, p.refs, p.path ? p.path : "");
      }
      dp_ptrset_free(set);
    }
    inspect_print(sink, v);
    char msg[256];
    vjson_write(sink, v, 2, msg, sizeof msg);
    dp_value_release(v);
  }
  free(f);
  dp_value_collect();
  return 0;
}
