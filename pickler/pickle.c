/* pickler/pickle.c — values to frames, written with msgpack-c's packer. */
/* The checksum's long-input loop is also compiled for AVX2 and picked at run
 * time (dp__frame_checksum): xxhash's own dispatch, which only its shared
 * library carries. These must precede xxhash.h (included by table.h). */
#if defined(__x86_64__) && defined(__GNUC__)
#define DP_CHECKSUM_AVX2 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <immintrin.h>
#endif
#include <msgpack.h>
#include <string.h>

#include "frame.h"
#include "walk.h"

/* The storage first met for a buffer id, valid while dp_pickle runs (a
 * reduce state may hold the only reference to it), and what callers ask of
 * it after dp_pickle returned. */
typedef struct frame_buf {
  dp_storage_t *st;
  int not_local; /* its base is not memory of this process (read from a frame, or carrying host data) */
} frame_buf_t;

struct dp_frame {
  uint8_t *buf;
  size_t len, cap;
  size_t end;            /* cap while the writer is sound; len once it failed */
  dp_ptrset_t *set;      /* buffers, in first-met order */
  dp__walker_t walker;   /* the frame's own, reused by each pickle */
  uint64_t *data_off;    /* inline: offset of each buffer's bytes in buf */
  size_t data_off_cap;
  frame_buf_t *storages;   /* the storage behind each buffer id, as first met */
  size_t nstorages, storages_cap;
  dp_storage_t *checked;   /* the last other storage found to match its buffer */
  /* Every other storage found to match its buffer in this pickle: each is
   * compared once, not once a tensor (tensors alternating between two such
   * storages of one 1 MB buffer compared 1 MB each). A cache: one that
   * cannot grow only forgets. */
  struct {
    dp__table_t t;
    dp_storage_t **st;
    size_t cap;
  } agreed;
  int is_inline;
  int walking;             /* the walk is on: a failure names the path of the node it met */
  int busy;                /* a dp_pickle into it has not returned (reduce and read call back) */
  /* The writer's error discipline (mpack's): its first error is kept in
   * rc, with its message in err, and every later write is a no-op that
   * returns it. No code but a DP_E* one is ever returned. */
  int rc;
  dp_error_t *err;
};

#ifdef DP_CHECKSUM_AVX2
/* XXH3_64bits_withSeed's path for inputs over XXH3_MIDSIZE_MAX bytes, with
 * the AVX2 kernels: the same hash (xxhash's kernels agree by design; the
 * pickler suite checks it), twice the bytes per instruction of SSE2. */
static XXH_TARGET_AVX2 __attribute__((noinline)) uint64_t checksum_long_avx2(const void *p, size_t n, uint64_t seed) {
  return XXH3_hashLong_64b_withSeed_internal(p, n, seed, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2,
                                             XXH3_initCustomSecret_avx2);
}
#endif

uint64_t dp__frame_checksum(const uint8_t *frame, size_t n) {
  const uint8_t *p = frame + DP_FRAME_HEADER;
  size_t len = n - DP_FRAME_HEADER;
  uint64_t seed = XXH3_64bits(frame, 32);
#ifdef DP_CHECKSUM_AVX2
  if (len > XXH3_MIDSIZE_MAX && __builtin_cpu_supports("avx2")) return checksum_long_avx2(p, len, seed);
#endif
  return XXH3_64bits_withSeed(p, len, seed);
}

/* The writer fails: the first error is kept (code and message), later
 * ones return it unchanged. Appends then all take the slow path (end is
 * len), which returns it. */
static __attribute__((format(printf, 3, 4), noinline)) int writer_fail(dp_frame_t *f, int code, const char *fmt, ...) {
  if (f->rc) return f->rc;
  f->rc = code;
  f->end = f->len;
  va_list ap;
  va_start(ap, fmt);
  dp__verr(f->err, code, -1, fmt, ap);
  va_end(ap);
  return code;
}

/* Where a failure met while walking happened: " at <path>", or "" once the
 * walk is over (the buffer table, the inline data). */
static const char *where(dp_frame_t *f, char out[DP_PATH_MAX + 8]) {
  if (!f->walking) return "";
  snprintf(out, DP_PATH_MAX + 8, " at %s", dp__walker_path(&f->walker));
  return out;
}

/* Room for extra more bytes, or the writer's (sticky) error. */
static int frame_reserve(dp_frame_t *f, size_t extra) {
  if (f->rc) return f->rc;
  size_t need;
  char at[DP_PATH_MAX + 8];
  if (dp__add_ovf(f->len, extra, &need))
    return writer_fail(f, DP_ENOMEM, "out of memory: a frame of more than %zu bytes%s", SIZE_MAX, where(f, at));
  if (need <= f->cap) return 0;
  size_t ncap = f->cap ? f->cap : 256;
  while (ncap < need) {
    if (ncap > SIZE_MAX / 2) return writer_fail(f, DP_ENOMEM, "out of memory: a frame of %zu bytes%s", need, where(f, at));
    ncap *= 2;
  }
  uint8_t *p = dp__realloc(f->buf, f->cap, ncap);
  if (!p) return writer_fail(f, DP_ENOMEM, "out of memory growing the frame to %zu bytes%s", ncap, where(f, at));
  f->buf = p;
  f->cap = f->end = ncap;
  return 0;
}

/* Appends to the frame, through the hook: what msgpack-c's packer writes
 * with (below). Its result is the packer's: 0, or the writer's error. */
static inline __attribute__((always_inline)) int frame_append(dp_frame_t *f, const void *buf, size_t len) {
  if (DP_UNLIKELY(f->end - f->len < len)) {
    int rc = frame_reserve(f, len);
    if (rc) return rc;
  }
  memcpy(f->buf + f->len, buf, len);
  f->len += len;
  return 0;
}

/* msgpack-c's packer, instantiated on the frame: pack_template.h is the
 * template msgpack.h instantiates on msgpack_packer (writing through a
 * function pointer, one indirect call per header); here the same functions,
 * named fpk_*, append to the frame directly, so that each header is a few
 * stores after one bounds check. Its timestamp function calls
 * msgpack_pack_ext by name: that name is pointed at this instance too. */
#define msgpack_pack_inline_func(name) static inline __attribute__((always_inline)) int fpk##name
#define msgpack_pack_inline_func_cint(name) static inline __attribute__((always_inline)) int fpk##name
#define msgpack_pack_user dp_frame_t *
#define msgpack_pack_append_buffer(user, buf, len) return frame_append(user, buf, len)
#define msgpack_pack_ext fpk_ext
#include <msgpack/pack_template.h>
#undef msgpack_pack_ext

int dp_frame_new(dp_frame_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_frame_new: NULL out");
  dp_frame_t *f = dp__alloc(sizeof *f);
  if (!f) return dp__err(err, DP_ENOMEM, "out of memory allocating a frame");
  memset(f, 0, sizeof *f);
  dp__table_init(&f->agreed.t);
  dp__walker_init(&f->walker);
  int rc = dp_ptrset_new(&f->set, err);
  if (rc) {
    dp__free(f, sizeof *f);
    return rc;
  }
  *out = f;
  return 0;
}

void dp_frame_free(dp_frame_t *f) {
  if (!f) return;
  dp_ptrset_free(f->set);
  dp__walker_destroy(&f->walker);
  dp__free(f->buf, f->cap);
  dp__free(f->data_off, f->data_off_cap * sizeof(uint64_t));
  dp__free(f->storages, f->storages_cap * sizeof *f->storages);
  dp__table_destroy(&f->agreed.t, DP_TABLE_TAGGED);
  dp__free(f->agreed.st, f->agreed.cap * sizeof *f->agreed.st);
  dp__free(f, sizeof *f);
}

/* A frame a pickle is writing (read from its own reduce() or read
 * callback) reads as empty: its bytes and table are half made, and the
 * inline data's offsets not laid out yet (a descriptor's data pointer would
 * be made of whatever the offsets array held). An empty frame, new or left
 * by a failed pickle, reads as NULL and 0 alike: the buffer a failed pickle
 * keeps for the next one holds no frame. */
const uint8_t *dp_frame_data(const dp_frame_t *f, size_t *len) {
  int readable = f && !f->busy && f->len;
  if (len) *len = readable ? f->len : 0;
  return readable ? f->buf : NULL;
}

size_t dp_frame_nbuffers(const dp_frame_t *f) {
  return f && f->len && !f->busy ? dp_ptrset_count(f->set) : 0;
}

int dp__frame_buffer_not_local(const dp_frame_t *f, size_t i) {
  return f->len && i < f->nstorages && f->storages[i].not_local;
}

int dp_frame_buffer(const dp_frame_t *f, size_t i, dp_buffer_desc_t *out, dp_error_t *err) {
  dp_ptr_info_t info;
  if (!f || !out) return dp__err(err, DP_EINVAL, "dp_frame_buffer: NULL %s", f ? "out" : "frame");
  if (f->busy)
    return dp__err(err, DP_ESTATE, "dp_frame_buffer: the frame is being written by a pickle that has not returned");
  if (!f->len || i >= dp_ptrset_count(f->set))
    return dp__err(err, DP_EINVAL, "dp_frame_buffer: buffer %zu out of range (the frame has %zu)", i, dp_frame_nbuffers(f));
  dp_ptrset_get(f->set, i, &info, NULL);
  out->id = (uint32_t)i;
  out->device = info.device;
  out->nbytes = info.nbytes;
  out->base = (uint64_t)(uintptr_t)info.base;
  out->data = f->is_inline ? f->buf + f->data_off[i] : NULL;
  return 0;
}

/* ---- the sink ----
 * The writer writes only what the reader accepts: lengths and counts that
 * MessagePack can carry (32 bits), back-references to the first 2^32 nodes,
 * buffers of at most 2^62 bytes, one buffer per (device, base). Anything
 * else is an error naming the path, never a frame the reader refuses. */

static dp__walker_t *frame_walker(dp_frame_t *f) { return &f->walker; }

static int too_large(dp_frame_t *f, const char *what, unsigned long long n) {
  dp__walker_t *w = frame_walker(f);
  return writer_fail(f, DP_ELIMIT, "%s of %llu exceeds the frame format's limit of 4294967295 at %s", what, n,
                 dp__walker_path(w));
}



static inline __attribute__((always_inline)) int put_tag(dp_frame_t *pk, char tag) {
  int rc = fpk_ext(pk, 1, DP_EXT_TAG);
  return rc ? rc : fpk_ext_body(pk, &tag, 1);
}

static inline __attribute__((always_inline)) int put_str(dp_frame_t *pk, const char *s, size_t n) {
  int rc = fpk_str(pk, n);
  return rc ? rc : fpk_str_body(pk, s, n);
}

static int sink_scalar(void *ctx, dp_value_t v) {
  dp_frame_t *pk = ctx;
  switch (v.kind) {
    case DP_NONE: return fpk_nil(pk);
    case DP_BOOL: return v.u.i ? fpk_true(pk) : fpk_false(pk);
    case DP_INT: return fpk_int64(pk, v.u.i);
    case DP_FLOAT: return fpk_double(pk, v.u.f);
    default: {
      size_t n = DP_STROBJ(v)->len;
      if (DP_UNLIKELY(n > UINT32_MAX)) return too_large(ctx, v.kind == DP_STR ? "str length" : "bytes length", n);
      if (v.kind == DP_STR) return put_str(pk, DP_STROBJ(v)->data, n);
      int rc = fpk_bin(pk, n);
      return rc ? rc : fpk_bin_body(pk, DP_STROBJ(v)->data, n);
    }
  }
}

static int sink_enter(void *ctx, dp_value_t v, size_t n) {
  dp_frame_t *pk = ctx;
  int rc;
  /* MessagePack counts are 32 bits: an object's array holds 2 + 2n fields,
   * a tuple's n + 1 */
  if (DP_UNLIKELY(n > (UINT32_MAX - 2) / 2) &&
      (v.kind == DP_OBJECT || n > UINT32_MAX - (v.kind == DP_TUPLE)))
    return too_large(ctx, "container size", n);
  switch (v.kind) {
    case DP_LIST: return fpk_array(pk, n);
    case DP_DICT: return fpk_map(pk, n);
    case DP_TUPLE:
      rc = fpk_array(pk, n + 1);
      return rc ? rc : put_tag(pk, DP_TAG_TUPLE);
    case DP_OBJECT: {
      dp_object_t *o = DP_OBJ(v);
      int reduced = (o->c.h.flags & DP_HEAP_REDUCED) != 0;
      if (DP_UNLIKELY(o->class_len > UINT32_MAX))
        return too_large(ctx, reduced ? "type name length" : "class name length", o->class_len);
      if ((rc = fpk_array(pk, reduced ? 3 : 2 + 2 * n)) != 0) return rc;
      if ((rc = put_tag(pk, reduced ? DP_TAG_REDUCE : DP_TAG_OBJECT)) != 0) return rc;
      return put_str(pk, o->class_name, o->class_len);
    }
    default: { /* custom */
      const char *name = DP_CUSTOM(v)->type->name;
      size_t len = strlen(name);
      if (DP_UNLIKELY(len > UINT32_MAX)) return too_large(ctx, "type name length", len);
      if ((rc = fpk_array(pk, 3)) != 0) return rc;
      if ((rc = put_tag(pk, DP_TAG_REDUCE)) != 0) return rc;
      return put_str(pk, name, len);
    }
  }
}

/* Names are str headers too: msgpack-c's packer would write the low 32
 * bits of a longer length, a frame the reader misreads. */
static int sink_attr(void *ctx, const char *name, size_t n) {
  if (DP_UNLIKELY(n > UINT32_MAX)) return too_large(ctx, "attribute name length", n);
  return put_str(ctx, name, n);
}

_Thread_local uint64_t dp__buffer_bytes_compared;

static inline __attribute__((always_inline)) int agreed_eq(const void *ctx, size_t i, const void *key) {
  return ((const dp_frame_t *)ctx)->agreed.st[i] == key;
}
static uint64_t agreed_hash_at(const void *ctx, size_t i) {
  return dp__hash_ptr(((const dp_frame_t *)ctx)->agreed.st[i]);
}

/* Whether st was found to agree with its buffer in this pickle. */
static int agreed(dp_frame_t *f, dp_storage_t *st) {
  size_t j;
  return dp__table_find(&f->agreed.t, DP_TABLE_TAGGED, dp__hash_ptr(st), agreed_eq, f, st, &j) != DP_TABLE_NONE;
}

/* Remembers that st agrees (not yet remembered): 0, or DP_ENOMEM. Out of
 * memory is an error, not a storage left out: forgetting it would compare
 * an inline frame's bytes again at each of its tensors, a cost of tensors
 * times bytes exactly when memory is short. */
static int agreed_add(dp_frame_t *f, dp_storage_t *st) {
  uint64_t h = dp__hash_ptr(st);
  size_t n = f->agreed.t.count;
  if (dp__grow((void **)&f->agreed.st, &f->agreed.cap, n + 1, sizeof *f->agreed.st) != 0) return DP_ENOMEM;
  if (dp__table_full(&f->agreed.t) && dp__table_grow(&f->agreed.t, DP_TABLE_TAGGED, n, 16, agreed_hash_at, f) != 0)
    return DP_ENOMEM;
  size_t j = dp__table_empty_slot(&f->agreed.t, DP_TABLE_TAGGED, h);
  f->agreed.st[n] = st;
  dp__table_put(&f->agreed.t, DP_TABLE_TAGGED, j, h, n);
  return 0;
}

/* An inline frame's storage made by dp_unpickle for a buffer that came
 * without its bytes (and without a bind): its base is the sender's address,
 * never memory of this process (read_buffer). */
#define FOREIGN_UNREADABLE                                                                                          \
  "cannot read %zu bytes of %s memory for an inline frame%s: the storage came from a frame without its bytes, and " \
  "its base %p is the sender's address, not memory of this process (bind the buffers when reading the frame)"

/* Two storages at one (device, base) become one buffer: they must agree on
 * its size and, in an inline frame, on its bytes (the frame carries those of
 * the first). Refused otherwise, whichever is met first. */
static int check_same_buffer(dp_frame_t *f, dp_storage_t *first, dp_storage_t *st) {
  dp__walker_t *w = frame_walker(f);
  char dev[16];
  const char *why = NULL;
  if (agreed(f, st)) {
    f->checked = st;
    return 0;
  }
  if (first->nbytes != st->nbytes) {
    return writer_fail(f, DP_EINVAL, "storages of %s %p differ in size (%zu and %zu bytes) at %s: a frame has "
                   "one buffer per (device, base)", dp_device_format(st->device, dev, sizeof dev), st->base,
                   first->nbytes, st->nbytes, dp__walker_path(w));
  }
  if (f->is_inline && st->foreign && !st->host_data) { /* the first is checked when it is read */
    char at[DP_PATH_MAX + 8];
    return writer_fail(f, DP_ENODEV, FOREIGN_UNREADABLE, st->nbytes, dp_device_format(st->device, dev, sizeof dev),
                       where(f, at), st->base);
  }
  if (f->is_inline) {
    if ((first->host_data == NULL) != (st->host_data == NULL))
      why = "only one carries host bytes";
    else if (first->host_data && st->nbytes && (dp__buffer_bytes_compared += st->nbytes,
                                                 memcmp(first->host_data, st->host_data, st->nbytes) != 0))
      why = "their host bytes differ";
    if (why)
      return writer_fail(f, DP_EINVAL, "storages of %s %p (%zu bytes) disagree at %s: %s; a frame has one "
                     "buffer per (device, base)", dp_device_format(st->device, dev, sizeof dev), st->base,
                     st->nbytes, dp__walker_path(w), why);
  }
  if (agreed_add(f, st) != 0)
    return writer_fail(f, DP_ENOMEM, "out of memory remembering the storages of %s %p at %s",
                       dp_device_format(st->device, dev, sizeof dev), st->base, dp__walker_path(w));
  f->checked = st;
  return 0;
}

static int sink_tensor(void *ctx, dp_value_t v, size_t buffer) {
  dp_frame_t *f = ctx;
  dp_frame_t *pk = f;
  dp_tensor_t *t = DP_TENSOR(v);
  int rc;
  /* Remember the storage met first for each new buffer id (ids are handed
   * out in that order): an inline frame copies its bytes later, and every
   * other storage at the same (device, base) must agree with it. */
  if (buffer == f->nstorages) {
    if (DP_UNLIKELY(t->storage->nbytes > DP_FRAME_MAX_NBYTES)) {
      dp__walker_t *w = frame_walker(f);
      return writer_fail(f, DP_ELIMIT, "storage of %zu bytes exceeds the frame format's limit of 2^62 at %s",
                     t->storage->nbytes, dp__walker_path(w));
    }
    if (dp__grow((void **)&f->storages, &f->storages_cap, f->nstorages + 1, sizeof *f->storages) != 0)
      return writer_fail(f, DP_ENOMEM, "out of memory growing the frame's storage list at %s",
                         dp__walker_path(frame_walker(f)));
    f->storages[f->nstorages++] = (frame_buf_t){t->storage, t->storage->host_data != NULL || t->storage->foreign};
  } else if (DP_UNLIKELY(f->storages[buffer].st != t->storage) && t->storage != f->checked) {
    if ((rc = check_same_buffer(f, f->storages[buffer].st, t->storage)) != 0) return rc;
  }
  rc = fpk_array(pk, 6);
  rc = rc ? rc : put_tag(pk, DP_TAG_TENSOR);
  rc = rc ? rc : fpk_uint64(pk, buffer);
  rc = rc ? rc : fpk_uint8(pk, t->dtype);
  for (int half = 0; half < 2 && !rc; half++) {
    rc = fpk_array(pk, t->ndim);
    for (int d = 0; d < t->ndim && !rc; d++) rc = fpk_int64(pk, t->dims[half * t->ndim + d]);
  }
  return rc ? rc : fpk_int64(pk, t->offset);
}

static int sink_backref(void *ctx, uint64_t index) {
  dp_frame_t *pk = ctx;
  if (DP_UNLIKELY(index > UINT32_MAX)) return too_large(ctx, "back-reference to node", index);
  char be[4] = {(char)(index >> 24), (char)(index >> 16), (char)(index >> 8), (char)index};
  int rc = fpk_ext(pk, 4, DP_EXT_REF);
  return rc ? rc : fpk_ext_body(pk, be, 4);
}

static const dp__sink_t pack_sink = {sink_scalar, sink_enter, sink_attr, sink_tensor, sink_backref};

/* ---- the buffer table and inline data ---- */

static int write_table(dp_frame_t *f) {
  size_t n = dp_ptrset_count(f->set);
  uint64_t off = 0;
  int rc = fpk_array(f, n);
  for (size_t i = 0; i < n && !rc; i++) {
    dp_ptr_info_t e;
    dp_ptrset_get(f->set, i, &e, NULL);
    rc = fpk_array(f, f->is_inline ? 5 : 4);
    rc = rc ? rc : fpk_uint8(f, e.device.type);
    rc = rc ? rc : fpk_uint8(f, e.device.index);
    rc = rc ? rc : fpk_uint64(f, e.nbytes);
    rc = rc ? rc : fpk_uint64(f, (uint64_t)(uintptr_t)e.base);
    if (f->is_inline) {
      rc = rc ? rc : fpk_uint64(f, off);
      if (!rc && dp__add_ovf(off, e.nbytes, &off))
        rc = writer_fail(f, DP_ENOMEM, "out of memory: inline data of more than 2^64 bytes");
    }
  }
  return rc;
}

static int read_buffer(const dp_pickle_opts_t *opts, dp_storage_t *st, void *dst, dp_error_t *err) {
  char dev[16];
  if (st->host_data) {
    memcpy(dst, st->host_data, st->nbytes);
    return 0;
  }
  /* Its base is an address a frame named: reading through it (here, or in
   * the read callback) would read whatever this process holds there. */
  if (st->foreign)
    return dp__err(err, DP_ENODEV, FOREIGN_UNREADABLE, st->nbytes, dp_device_format(st->device, dev, sizeof dev), "",
                   st->base);
  if (opts && opts->read) {
    /* The callback fills an error of its own, cleared so that silence
     * shows; the caller's is written on failure only, as by every call
     * (what a callback that succeeded left there is no failure's). */
    dp_error_t e;
    dp_error_clear(&e);
    int rc = dp__cb_rc(opts->read(opts->read_ud, st->device, st->base, st->nbytes, dst, &e), &e, "the read callback");
    if (rc && err) *err = e;
    return rc;
  }
  if (st->device.type == DP_DEVICE_CPU) {
    /* dp_storage_new takes any base; NULL is the one known unreadable */
    if (st->nbytes && !st->base)
      return dp__err(err, DP_ENODEV, "cannot read %zu bytes of cpu memory for an inline frame: its base is NULL",
                     st->nbytes);
    if (st->nbytes) memcpy(dst, st->base, st->nbytes);
    return 0;
  }
  return dp__err(err, DP_ENODEV,
                 "cannot read %zu bytes of %s memory for an inline frame: no reader given (dp_device_read reads it "
                 "through its backend)",
                 st->nbytes, dp_device_format(st->device, dev, sizeof dev));
}

static int write_data(dp_frame_t *f, const dp_pickle_opts_t *opts, dp_error_t *err) {
  size_t n = dp_ptrset_count(f->set);
  if (dp__grow((void **)&f->data_off, &f->data_off_cap, n ? n : 1, sizeof(uint64_t)) != 0)
    return writer_fail(f, DP_ENOMEM, "out of memory laying out inline data");
  for (size_t i = 0; i < n; i++) {
    size_t nb = f->storages[i].st->nbytes;
    int rc = frame_reserve(f, nb);
    if (rc) return rc;
    f->data_off[i] = f->len;
    if ((rc = read_buffer(opts, f->storages[i].st, f->buf + f->len, err)) != 0) return rc;
    f->len += nb;
  }
  return 0;
}

static int pickle_into(dp_value_t v, const dp_pickle_opts_t *opts, dp_frame_t *f, dp_error_t *err) {
  f->len = 0;
  f->rc = 0;
  f->err = err;
  f->end = f->cap;
  f->nstorages = 0;
  f->checked = NULL;
  dp__table_clear(&f->agreed.t, DP_TABLE_TAGGED);
  f->is_inline = opts && (opts->flags & DP_PICKLE_INLINE);
  dp_ptrset_clear(f->set);
  dp__walker_t *w = frame_walker(f);
  dp__walker_setup(w, f->set, &pack_sink, f, opts ? opts->max_depth : 0, 0, err);
  /* The walk returns the sink's error as the writer reported it. The
   * header's room is the root's first bytes: a failure to get it names the
   * root's path, "$", as every failure of the walk names its node's. */
  f->walking = 1;
  int rc = frame_reserve(f, DP_FRAME_HEADER);
  if (rc == 0) {
    f->len = DP_FRAME_HEADER;
    rc = dp__walk(w, v);
  }
  f->walking = 0;
  /* A reader numbers at most 2^32 - 2 heap nodes (32-bit back-references,
   * which the sink checks as it writes them). */
  if (rc == 0 && w->next_index > (uint64_t)UINT32_MAX - 1)
    rc = dp__err(err, DP_ELIMIT, "value of %llu heap nodes: the frame format numbers at most 4294967294",
                 (unsigned long long)w->next_index);
  if (rc) goto fail;
  size_t payload_end = f->len;
  if ((rc = write_table(f)) != 0) goto fail;
  size_t table_end = f->len;
  if (f->is_inline && (rc = write_data(f, opts, err)) != 0) goto fail;

  uint8_t *h = f->buf;
  memcpy(h, DP_FRAME_MAGIC, 4);
  dp__put_le16(h + 4, DP_FRAME_VERSION);
  /* one encoding a value: a frame without buffers is self-contained either
     way, and never carries the flag (FORMAT.md) */
  dp__put_le16(h + 6, f->is_inline && f->nstorages ? DP_FRAME_FLAG_INLINE : 0);
  dp__put_le64(h + 8, payload_end - DP_FRAME_HEADER);
  dp__put_le64(h + 16, table_end - payload_end);
  dp__put_le64(h + 24, f->len - table_end);
  dp__put_le64(h + 32, dp__frame_checksum(h, f->len));
  dp__walker_release_states(w);
  return 0;
fail:
  dp__walker_release_states(frame_walker(f));
  f->len = 0;
  dp_ptrset_clear(f->set);
  return rc;
}

int dp_pickle(dp_value_t v, const dp_pickle_opts_t *opts, dp_frame_t *f, dp_error_t *err) {
  if (!f) return dp__err(err, DP_EINVAL, "dp_pickle: NULL frame");
  /* A reduce() or read callback that pickles into this frame would reset
   * it under the running pickle: its walker, and the buffer read writes to. */
  if (f->busy)
    return dp__err(err, DP_ESTATE, "dp_pickle: the frame is being written by a pickle that has not returned "
                   "(a reduce() or read callback pickling into the frame its own pickle writes)");
  if (opts && (opts->flags & ~DP_PICKLE_INLINE)) {
    f->len = 0; /* on error the frame is empty */
    dp_ptrset_clear(f->set);
    return dp__err(err, DP_EINVAL, "dp_pickle: unknown flags 0x%x (DP_PICKLE_INLINE is the only one, 0x%x)",
                   opts->flags & ~DP_PICKLE_INLINE, DP_PICKLE_INLINE);
  }
  f->busy = 1;
  int rc = pickle_into(v, opts, f, err);
  f->busy = 0;
  return rc;
}
