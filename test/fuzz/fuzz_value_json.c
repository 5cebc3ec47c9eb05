/* The value-JSON reader behind `devpickle pack`: parse (as jansson does),
 * build, pickle; what pack writes must unpickle under the CLI's limits, and
 * its value JSON (unpack) must parse and pack again to the same bytes. */
#include <stdio.h>

#include "../../tools/vjson.h"
#include "fuzz.h"
#include "fuzz_pack.h"


/* A prefix that vjson_prefix_fails judges failing (pack stops reading
 * there) must fail the whole text with the same message at the same byte. */
static void check_prefix(const char *text, size_t size, size_t k) {
  if (!vjson_prefix_fails(text, k)) return;
  char m1[1024], m2[1024];
  size_t p1 = 0, p2 = 0;
  json_t *whole = vjson_parse(text, size, m1, sizeof m1, &p1), *part = vjson_parse(text, k, m2, sizeof m2, &p2);
  if (whole || part || p1 != p2 || strcmp(m1, m2) != 0) abort();
}

/* Our parser reads JSON as jansson's does (tools/vjson.c replaces it only
 * for nesting past jansson's 2,048 levels and NUL bytes in keys): the same
 * texts accepted, to the same trees. Texts with a NUL byte (raw, where
 * jansson stops reading, or escaped, where it refuses a key) or a byte order
 * mark (skipped or refused by ours only) are left out. */
static void check_like_jansson(const char *text, size_t size) {
  if (memchr(text, 0, size) || (size && (uint8_t)text[0] >= 0xEF)) return;
  for (size_t i = 0; i + 6 <= size; i++)
    if (memcmp(text + i, "\\u0000", 6) == 0) return;
  char msg[1024];
  size_t pos;
  json_error_t je;
  json_t *ours = vjson_parse(text, size, msg, sizeof msg, &pos);
  json_t *theirs = json_loadb(text, size, JSON_DECODE_ANY | JSON_ALLOW_NUL | JSON_REJECT_DUPLICATES, &je);
  int deep = (!ours && strstr(msg, "nesting")) || (!theirs && strstr(je.text, "depth"));
  if (!deep && (!ours != !theirs || (ours && !json_equal(ours, theirs)))) {
    fprintf(stderr, "vjson_parse %s (%s), jansson %s (%s)\n", ours ? "accepts" : "refuses", ours ? "" : msg,
            theirs ? "accepts" : "refuses", theirs ? "" : je.text);
    abort();
  }
  vjson_free(ours); /* up to 8,008 levels: without recursion, as pack frees it */
  json_decref(theirs);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_like_jansson((const char *)data, size);
  for (size_t k = size / 4; k <= size; k += size / 4 ? size / 4 : 1) check_prefix((const char *)data, size, k);
  size_t n, m;
  uint8_t *b = fuzz_pack((const char *)data, size, &n);
  if (b) {
    dp_unpickle_opts_t o;
    memset(&o, 0, sizeof o);
    o.limits.max_depth = VJSON_MAX_DEPTH;
    dp_value_t back;
    if (dp_unpickle(b, n, &o, &back, NULL) != 0) abort();  /* what pack writes, verify reads */
    char *text = NULL, msg[256];
    size_t tn = 0;
    FILE *mf = open_memstream(&text, &tn);
    int rc = vjson_write(mf, back, 1, msg, sizeof msg);
    fclose(mf);
    if (rc == 0) {
      uint8_t *c = fuzz_pack(text, tn, &m);
      if (!c || m != n || memcmp(b, c, n) != 0) abort();  /* unpack | pack gives the same bytes */
      free(c);
    } else if (rc != DP_ENOMEM) {
      abort();  /* whatever verify accepts, unpack writes */
    }
    free(text);
    dp_value_release(back);
    free(b);
  }
  dp_value_collect();
  return 0;
}
