/* What `verify`, `dump`, `inspect` and `unpack` do with a frame: unpickle
 * (whole, and streamed as verify/dump/inspect read it: both must accept the
 * same frames), scan with paths, print the tree, write value JSON. */
#include <stdio.h>

#include "../../tools/inspect.h"
#include "../../tools/vjson.h"
#include "fuzz.h"

static FILE *sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!sink) sink = fopen("/dev/null", "w");
  uint8_t *f = malloc(size ? size : 1);
  memcpy(f, data, size);
  fuzz_fix_checksum(f, size);
  dp_unpickle_opts_t o = fuzz_opts();
  dp_value_t v, sv;
  dp_frame_info_t fi;
  int whole = dp_frame_check(f, size, &fi, NULL) == 0 ? dp_unpickle(f, size, &o, &v, NULL) : -1;
  mem_reader_t c = {f, size, 7}; /* at most 7 bytes a call */
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
        dp_ptrset_get(set, i, &p, NULL);
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
