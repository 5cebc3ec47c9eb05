/* dp_unpickle on arbitrary bytes (checksum fixed up first). Every input must
 * give a value or an error with an offset inside the frame; nothing leaks.
 * A resolver rebuilds customs of type "R" from part of their state (as
 * embedders do), so that later back-references into a replaced state are
 * exercised. Whatever is read pickles again, and what the writer writes
 * the reader reads under the same limits; unless a resolver rebuilt a
 * custom, it pickles again to exactly the bytes read (the reader accepts
 * only the canonical form the writer writes). */
#include "fuzz.h"

typedef struct held { dp_value_t v; } held_t;
static int held_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  (void)err;
  *state = dp_value_retain(((held_t *)obj)->v);
  return 0;
}
static void held_destroy(void *obj) {
  dp_value_release(((held_t *)obj)->v);
  free(obj);
}
static const dp_type_t held_type = {"R", held_reduce, held_destroy};

/* Keeps the first item of a list or tuple state (or the state itself). */
static int resolved;  /* customs rebuilt for this input */

static int resolve(void *ud, const char *type, dp_value_t state, dp_value_t *out, dp_error_t *err) {
  (void)ud;
  (void)type;
  resolved++;
  held_t *h = malloc(sizeof *h);
  dp_kind_t k = dp_value_kind(state);
  h->v = dp_value_retain((k == DP_LIST || k == DP_TUPLE) && dp_seq_len(state) ? dp_seq_get(state, 0) : state);
  return dp_custom_new(&held_type, h, out, err);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t *f = malloc(size ? size : 1);
  memcpy(f, data, size);
  fuzz_fix_checksum(f, size);
  dp_unpickle_opts_t o = fuzz_opts();
  static const char *const allowed[] = {"R"};
  dp_resolver_t res = {allowed, 1, resolve, NULL};
  if (size > 40 && (f[size - 1] & 1)) o.resolver = &res;
  dp_value_t v;
  dp_error_t e;
  resolved = 0;
  if (dp_unpickle(f, size, &o, &v, &e) == 0) {
    if (!resolved) fuzz_expect_rewritten_same(f, size, v, o.limits.max_depth);
    /* written again (inline when it came inline: storages carry its bytes) */
    dp_frame_t *fr;
    if (dp_frame_new(&fr, NULL) != 0) abort();
    dp_pickle_opts_t po = {(f[6] & 1) ? DP_PICKLE_INLINE : 0, o.limits.max_depth, NULL, NULL};
    if (dp_pickle(v, &po, fr, &e) != 0) abort();  /* what was read can be written */
    size_t n;
    const uint8_t *b = dp_frame_data(fr, &n);
    dp_unpickle_opts_t o2 = fuzz_opts();
    o2.limits.max_items = 0;  /* a resolver may have changed the count; the rest is the same */
    dp_value_t back;
    if (dp_unpickle(b, n, &o2, &back, &e) != 0) abort();  /* and what was written can be read */
    dp_value_release(back);
    dp_frame_free(fr);
    dp_value_release(v);
  } else if (e.offset < 0 || (size_t)e.offset > size || !e.message[0]) {
    abort();  /* every failure says where and what */
  }
  free(f);
  dp_value_collect();
  return 0;
}
