/* test/fuzz/fuzz_pack.h — value JSON to a frame, as `devpickle pack` makes
 * it, for the fuzz targets that check the CLI's round trip. */
#ifndef DP_FUZZ_PACK_H
#define DP_FUZZ_PACK_H
#include <stdlib.h>
#include <string.h>

#include "../../tools/vjson.h"
#include "devpickle.h"

/* fuzz_pack: value JSON to a frame as `devpickle pack` makes it (malloc'd), or NULL. */
static uint8_t *fuzz_pack(const char *text, size_t size, size_t *n) {
  char msg[1024];
  size_t pos;
  json_t *j = vjson_parse(text, size, msg, sizeof msg, &pos);
  if (!j) return NULL;
  dp_value_t v;
  int is_inline;
  uint8_t *out = NULL;
  if (vjson_to_value(j, &v, &is_inline, msg, sizeof msg) == 0) {
    dp_frame_t *fr;
    dp_pickle_opts_t po = {is_inline ? DP_PICKLE_INLINE : 0, 0, NULL, NULL};
    if (dp_frame_new(&fr, NULL) == 0) {
      if (dp_pickle(v, &po, fr, NULL) == 0) {
        const uint8_t *b = dp_frame_data(fr, n);
        out = malloc(*n);
        memcpy(out, b, *n);
      }
      dp_frame_free(fr);
    }
    dp_value_release(v);
  }
  json_decref(j);
  return out;
}

#endif
