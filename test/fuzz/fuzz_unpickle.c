/* dp_unpickle on arbitrary bytes (checksum fixed up first). Every input must
 * give a value or an error with an offset inside the frame; nothing leaks. */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t *f = malloc(size ? size : 1);
  memcpy(f, data, size);
  fuzz_fix_checksum(f, size);
  dp_unpickle_opts_t o = fuzz_opts();
  dp_value_t v;
  dp_error_t e;
  if (dp_unpickle(f, size, &o, &v, &e) == 0) {
    dp_value_release(v);
  } else if (e.offset < 0 || (size_t)e.offset > size || !e.message[0]) {
    abort();  /* every failure says where and what */
  }
  free(f);
  dp_value_collect();
  return 0;
}
