/* dp_unpickle on arbitrary bytes (checksum fixed up first). Every input must
 * give a value or an error with an offset inside the frame; nothing leaks.
 * Read as a transport reads a kept frame (its buffer table bound first, its
 * value later over the same storages), it gives the same value or error.
 * A resolver rebuilds customs of type "R" from part of their state (as
 * embedders do), so that later back-references into a replaced state are
 * exercised. Whatever is read pickles again, and what the writer writes
 * the reader reads under the same limits; unless a resolver rebuilt a
 * custom, it pickles again to exactly the bytes read (the reader accepts
 * only the canonical form the writer writes). Read again with one
 * allocation failed, it fails with DP_ENOMEM. */
#include "fuzz.h"
#include "../../pickler/frame.h" /* dp__frame_bind: a transport's table-first read */

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

/* Storages bound by id, as a transport's receive allocations are: fresh
 * ones (bind_fresh, at the sender's address, never read), then the same
 * ones again (bind_again) when the value is read later. */
typedef struct bound {
  dp_storage_t **st;
  size_t n;
} bound_t;

static int bind_fresh(void *ud, const dp_buffer_desc_t *d, dp_storage_t **out, dp_error_t *err) {
  bound_t *b = ud;
  if (dp_storage_new(d->device, (void *)(uintptr_t)d->base, d->nbytes, NULL, NULL, out, err)) return err->code;
  if (d->id >= b->n) {
    size_t n = (size_t)d->id + 1;
    dp_storage_t **st = realloc(b->st, n * sizeof *st);
    if (!st) abort();
    memset(st + b->n, 0, (n - b->n) * sizeof *st);
    b->st = st;
    b->n = n;
  }
  if (b->st[d->id]) abort(); /* the reader binds each entry once */
  b->st[d->id] = dp_storage_retain(*out);
  return 0;
}

static int bind_again(void *ud, const dp_buffer_desc_t *d, dp_storage_t **out, dp_error_t *err) {
  (void)err;
  bound_t *b = ud;
  if (d->id >= b->n || !b->st[d->id] || dp_storage_nbytes(b->st[d->id]) != d->nbytes) abort();
  *out = dp_storage_retain(b->st[d->id]);
  return 0;
}

static void bound_free(bound_t *b) {
  for (size_t i = 0; i < b->n; i++) dp_storage_release(b->st[i]);
  free(b->st);
}

static int same_error(const dp_error_t *a, const dp_error_t *b) {
  return a->code == b->code && a->offset == b->offset && strcmp(a->message, b->message) == 0;
}

/* The transport binds a kept frame's buffer table as it arrives
 * (dp__frame_bind) and reads its value later, binding the same storages
 * again: the table refuses what a whole read refuses first, with the same
 * error, never what it accepts; and the later read gives what a whole read
 * gives. */
static void expect_table_first_read_agrees(const uint8_t *f, size_t size, const dp_unpickle_opts_t *o) {
  dp_frame_info_t fi;
  if (dp_frame_check(f, size, &fi, NULL) != 0 || (fi.flags & DP_FRAME_FLAG_INLINE)) return;
  bound_t first = {0}, whole = {0};
  dp_unpickle_opts_t ob = *o, ow = *o, oa = *o;
  ob.bind = bind_fresh, ob.bind_ud = &first;
  ow.bind = bind_fresh, ow.bind_ud = &whole;
  oa.bind = bind_again, oa.bind_ud = &first;
  dp_error_t eb, ew, ea;
  dp_value_t vw = dp_none(), va = dp_none();
  resolved = 0;
  int rw = dp_unpickle(f, size, &ow, &vw, &ew);
  int rb = dp__frame_bind(f, &fi, &ob, &eb);
  if (rb && (!rw || !same_error(&eb, &ew))) {
    fprintf(stderr, "the table alone: %s; the whole frame: %s\n", eb.message, rw ? ew.message : "accepted");
    abort();
  }
  if (!rb) {
    int ra = dp__unpickle_checked(f, &fi, NULL, &oa, &va, &ea);
    if (!ra != !rw || (ra && !same_error(&ea, &ew))) {
      fprintf(stderr, "read after its table: %s; read whole: %s\n", ra ? ea.message : "accepted",
              rw ? ew.message : "accepted");
      abort();
    }
    if (!ra && !resolved && dp_value_equal(va, vw, DP_EQ_SHARING, NULL) != 1) abort();
  }
  dp_value_release(va);
  dp_value_release(vw);
  bound_free(&first);
  bound_free(&whole);
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
  expect_table_first_read_agrees(f, size, &o);
  free(f);
  dp_value_collect();
  return 0;
}
