/* What `verify`, `dump`, `inspect` and `unpack` do with a frame: unpickle
 * (whole, and streamed as verify/dump/inspect read it: both must accept the
 * same frames, fail with the same error and read the same value), scan with
 * paths, print the tree, write value JSON. And the CLI's round trip
 * (docs/VALUE_JSON.md): a frame that verify accepts is unpacked, indented
 * and compact, and each text must pack to the frame's own bytes.
 * fuzz_value_json checks it from value JSON; this checks it from arbitrary
 * frames. */
#include <stdio.h>

#include "../../tools/inspect.h"
#include "../../tools/vjson.h"
#include "fuzz.h"
#include "fuzz_pack.h"

static FILE *sink;

static int same_error(const dp_error_t *a, const dp_error_t *b) {
  return a->code == b->code && a->offset == b->offset && strcmp(a->message, b->message) == 0;
}

/* unpack | pack gives the frame back, for every frame verify accepts (read
 * under value JSON's nesting limit, as the CLI reads frames). */
static void expect_cli_round_trip(const uint8_t *f, size_t size) {
  dp_unpickle_opts_t o = fuzz_opts();
  o.limits.max_depth = VJSON_MAX_DEPTH;
  dp_value_t v;
  if (dp_unpickle(f, size, &o, &v, NULL) != 0) return;
  for (int indent = 0; indent <= 2; indent += 2) {
    char *text = NULL, msg[256];
    size_t tn = 0, m = 0;
    FILE *mf = open_memstream(&text, &tn);
    int rc = vjson_write(mf, v, indent, msg, sizeof msg);
    fclose(mf);
    if (rc == DP_ENOMEM) {
      free(text);
      break;
    }
    if (rc != 0) abort(); /* whatever verify accepts, unpack writes */
    uint8_t *back = fuzz_pack(text, tn, &m);
    if (!back || m != size || memcmp(back, f, size) != 0) {
      fprintf(stderr, "unpack | pack of an accepted %zu-byte frame gives %s\n", size,
              back ? "other bytes" : "nothing");
      abort();
    }
    free(back);
    free(text);
  }
  dp_value_release(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!sink) sink = fopen("/dev/null", "w");
  uint8_t *f = malloc(size ? size : 1);
  memcpy(f, data, size);
  fuzz_fix_checksum(f, size);
  dp_unpickle_opts_t o = fuzz_opts();
  dp_value_t v, sv;
  dp_frame_info_t fi, sfi;
  dp_error_t ce, we, se;
  uint64_t ssize = 0;
  int checked = dp_frame_check(f, size, &fi, &ce);
  int whole = dp_unpickle(f, size, &o, &v, &we);
  /* what the frame check refuses, the reader refuses alike */
  if (checked != 0 && (whole != checked || !same_error(&ce, &we))) abort();
  /* short reads of a size chosen by the input (1 to 200 bytes a call) */
  mem_reader_t c = {f, size, size ? 1 + data[0] % 200u : 1};
  int streamed = dp_unpickle_stream(mem_read, &c, &o, &sv, &sfi, &ssize, &se);
  /* verify and unpack accept the same frames; under 64 KiB of payload and
     table the streamed reader fails as the whole one does: same code, byte
     and message (pickler.h) */
  if (whole != streamed || (whole != 0 && !same_error(&we, &se))) {
    fprintf(stderr, "whole: %s at %lld: %s\nstreamed: %s at %lld: %s\n", dp_err_name(whole), (long long)we.offset,
            we.message, dp_err_name(streamed), (long long)se.offset, se.message);
    abort();
  }
  /* and read the same header facts, length and value */
  if (whole == 0 && (ssize != size || fi.version != sfi.version || fi.flags != sfi.flags ||
                     fi.payload_len != sfi.payload_len || fi.table_len != sfi.table_len ||
                     fi.data_len != sfi.data_len || fi.checksum != sfi.checksum || fi.nbuffers != sfi.nbuffers ||
                     dp_value_equal(v, sv, DP_EQ_SHARING, NULL) != 1))
    abort();
  /* what the checks of a frame still arriving refuse, the reader refuses:
     at its end, and at a cut chosen by the input */
  size_t cut = size > 41 ? 40 + data[size - 1] % (size - 40) : size;
  if (whole == 0 && (dp_frame_prefix_check(f, size, NULL) != 0 || dp_frame_prefix_check(f, cut, NULL) != 0 ||
                     dp_frame_value_check(f, size, &o, NULL) != 0 || dp_frame_value_check(f, cut, &o, NULL) != 0))
    abort();
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
    expect_cli_round_trip(f, size);
  }
  free(f);
  dp_value_collect();
  return 0;
}
