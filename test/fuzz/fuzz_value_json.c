/* The value-JSON reader behind `devpickle pack`: parse, build, pickle; and
 * whatever packs must unpack and pack again to the same bytes. */
#include "../../tools/vjson.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  json_error_t je;
  json_t *j = json_loadb((const char *)data, size, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
  if (!j) return 0;
  dp_value_t v;
  int is_inline;
  char msg[1024];
  if (vjson_to_value(j, &v, &is_inline, msg, sizeof msg) == 0) {
    dp_frame_t *f, *g;
    dp_pickle_opts_t po = {is_inline ? DP_PICKLE_INLINE : 0, 0, NULL, NULL};
    if (dp_frame_new(&f, NULL) == 0) {
      if (dp_pickle(v, &po, f, NULL) == 0) {
        size_t n, m;
        const uint8_t *b = dp_frame_data(f, &n);
        dp_value_t back;
        if (dp_unpickle(b, n, NULL, &back, NULL) != 0) abort();  /* what we write we read */
        if (dp_frame_new(&g, NULL) == 0) {
          dp_pickle_opts_t po2 = {is_inline ? DP_PICKLE_INLINE : 0, 0, NULL, NULL};
          if (dp_pickle(back, &po2, g, NULL) == 0) {
            const uint8_t *c = dp_frame_data(g, &m);
            if (m != n || memcmp(b, c, n) != 0) abort();  /* deterministic round trip */
          }
          dp_frame_free(g);
        }
        dp_value_release(back);
      }
      dp_frame_free(f);
    }
    dp_value_release(v);
  }
  json_decref(j);
  dp_value_collect();
  return 0;
}
