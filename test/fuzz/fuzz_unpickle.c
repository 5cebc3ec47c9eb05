/* dp_unpickle on arbitrary bytes (checksum fixed up first). Every input must
 * give a value or an error with an offset inside the frame; nothing leaks.
 * A resolver rebuilds customs of type "R" from part of their state (as
 * embedders do), so that later back-references into a replaced state are
 * exercised. Whatever is read pickles again, and what the writer writes
 * the reader reads under the same limits; unless a resolver rebuilt a
 * custom, it pickles again to exactly the bytes read (the reader accepts
 * only the canonical form the writer writes). Read again with one
 * allocation failed, it fails with DP_ENOMEM. */
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

/* Allocations counted, and the one numbered fail_at (1-based; 0: none) failed. */
static long allocs, fail_at;

static void *counting_alloc(void *ud, void *p, size_t osize, size_t nsize) {
  (void)ud;
  (void)osize;
  if (nsize == 0) {
    free(p);
    return NULL;
  }
  if (++allocs == fail_at) return NULL;
  return realloc(p, nsize);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  dp_set_allocator(counting_alloc, NULL);
  return 0;
}

/* Every allocation a read reaches fails it with DP_ENOMEM and a message, and
 * leaks nothing (base.h): the frame is read again, whole or streamed, with
 * the allocation the input picks among the `total` the first read made
 * failed. */
static void expect_enomem(const uint8_t *f, size_t size, const dp_unpickle_opts_t *o, long total) {
  if (total == 0) return;
  int streamed = f[size - 1] & 2;
  dp_value_t v;
  dp_error_t e;
  mem_reader_t c = {f, size, 13};
  allocs = 0;
  fail_at = 1 + (long)(((unsigned)f[size - 2] << 8 | f[size - 3]) % (unsigned long)total);
  int rc = streamed ? dp_unpickle_stream(mem_read, &c, o, &v, NULL, NULL, &e) : dp_unpickle(f, size, o, &v, &e);
  long failed = fail_at;
  fail_at = 0;
  if (rc == 0) {
    dp_value_release(v);
    if (allocs >= failed) {
      fprintf(stderr, "allocation %ld of %ld failed, and the %s read succeeded\n", failed, total,
              streamed ? "streamed" : "whole");
      abort();
    }
  } else if (rc != DP_ENOMEM || e.code != rc || !e.message[0]) {
    fprintf(stderr, "allocation %ld of %ld failed: %s: %s\n", failed, total, dp_err_name(rc), e.message);
    abort();
  }
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
  allocs = 0;
  if (dp_unpickle(f, size, &o, &v, &e) == 0) {
    long total = allocs;
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
    dp_value_collect();
    expect_enomem(f, size, &o, total);
  } else if (e.offset < 0 || (size_t)e.offset > size || !e.message[0]) {
    abort();  /* every failure says where and what */
  }
  free(f);
  dp_value_collect();
  return 0;
}
