/* bench/bench_pickler.c — scan, pickle and unpickle against their baselines,
 * measured in the same run. Usage: bench_pickler OUT.json */
#include <msgpack.h>
#include <xxhash.h>

#include "bench.h"
#include "devpickle.h"

static dp_device_t cuda0 = {DP_DEVICE_CUDA, 0};

static dp_value_t tensor_at(uintptr_t base) {
  dp_storage_t *s;
  dp_value_t t;
  int64_t shape[1] = {256};
  if (dp_storage_new(cuda0, (void *)base, 1024, NULL, NULL, &s, NULL) ||
      dp_tensor_new(s, DP_FLOAT32, 1, shape, NULL, 0, &t, NULL)) {
    fprintf(stderr, "bench: cannot build a tensor\n");
    exit(1);
  }
  return t;
}

/* ---- scan workloads ---- */

typedef struct scan_ctx {
  dp_value_t v;
  dp_ptrset_t *set;
  dp_storage_t **storages;  /* the same storages, for the hand-written loop */
  size_t nstorages;
} scan_ctx_t;

static void run_scan(void *p) {
  scan_ctx_t *c = p;
  dp_ptrset_clear(c->set);
  if (dp_scan(c->v, NULL, c->set, NULL) != 0) exit(1);
}

/* The baseline: a loop that already knows every storage. */
static void run_loop(void *p) {
  scan_ctx_t *c = p;
  dp_ptrset_clear(c->set);
  for (size_t i = 0; i < c->nstorages; i++) {
    dp_storage_t *s = c->storages[i];
    dp_ptrset_add(c->set, dp_storage_device(s), dp_storage_base(s), dp_storage_nbytes(s), NULL, NULL);
  }
}

static void collect(scan_ctx_t *c, dp_value_t t) {
  c->storages[c->nstorages++] = dp_tensor_storage(t);
}

static scan_ctx_t make_list(size_t n) {
  scan_ctx_t c = {0};
  dp_list_new(n, &c.v, NULL);
  c.storages = malloc(n * sizeof *c.storages);
  for (size_t i = 0; i < n; i++) {
    dp_value_t t = tensor_at(0x7f0000000000 + i * 4096);
    collect(&c, t);
    dp_list_append(c.v, t, NULL);
  }
  return c;
}

/* 1000 x tuple(tensor, [view of the same storage]) */
static scan_ctx_t make_nested(size_t n) {
  scan_ctx_t c = {0};
  dp_list_new(n, &c.v, NULL);
  c.storages = malloc(2 * n * sizeof *c.storages);
  for (size_t i = 0; i < n; i++) {
    dp_value_t t = tensor_at(0x7f0000000000 + i * 4096), view, tup, inner;
    int64_t shape[1] = {128};
    dp_tensor_new(dp_storage_retain(dp_tensor_storage(t)), DP_FLOAT32, 1, shape, NULL, 128, &view, NULL);
    collect(&c, t);
    collect(&c, view);
    dp_list_new(1, &inner, NULL);
    dp_list_append(inner, view, NULL);
    dp_tuple_new(2, &tup, NULL);
    dp_seq_set(tup, 0, t, NULL);
    dp_seq_set(tup, 1, inner, NULL);
    dp_list_append(c.v, tup, NULL);
  }
  return c;
}

/* 1000 user objects, each holding a tensor and a scalar */
static scan_ctx_t make_objects(size_t n) {
  scan_ctx_t c = {0};
  dp_list_new(n, &c.v, NULL);
  c.storages = malloc(n * sizeof *c.storages);
  for (size_t i = 0; i < n; i++) {
    dp_value_t o, t = tensor_at(0x7f0000000000 + i * 4096);
    collect(&c, t);
    dp_object_new("Activation", &o, NULL);
    dp_object_set(o, "data", t, NULL);
    dp_object_set(o, "step", dp_int((int64_t)i), NULL);
    dp_list_append(c.v, o, NULL);
  }
  return c;
}

/* Memo-heavy: 1000 references to 100 tensors (each held 10 times) and 500
 * to 100 small lists (each held 5 times): every one goes through the walker's
 * memo. The baseline adds the 1000 tensors' storages. */
static scan_ctx_t make_shared(void) {
  scan_ctx_t c = {0};
  dp_value_t ts[100], ls[100];
  dp_list_new(1500, &c.v, NULL);
  c.storages = malloc(1000 * sizeof *c.storages);
  for (int i = 0; i < 100; i++) {
    ts[i] = tensor_at(0x7f0000000000 + (uintptr_t)i * 4096);
    dp_list_new(2, &ls[i], NULL);
    dp_list_append(ls[i], dp_int(i), NULL);
  }
  for (int i = 0; i < 1000; i++) {
    collect(&c, ts[(i * 7) % 100]);
    dp_list_append(c.v, dp_value_retain(ts[(i * 7) % 100]), NULL);
    if (i % 2) dp_list_append(c.v, dp_value_retain(ls[(i * 3) % 100]), NULL);
  }
  for (int i = 0; i < 100; i++) {
    dp_value_release(ts[i]);
    dp_value_release(ls[i]);
  }
  return c;
}

/* Trees of 1.11 million nodes: fan-out-10 lists, six levels, a million
 * leaves. `tensor_every` picks how many leaves are tensors (each on its own
 * storage); of the rest, every third is a short str and the others ints and
 * floats. */
static void bench_scan(const char *out, const char *name, scan_ctx_t c, size_t nodes, int per_node);
static size_t tree_nodes;
static dp_value_t build_tree(scan_ctx_t *c, int depth, size_t *counter, size_t tensor_every) {
  tree_nodes++;
  if (depth == 0) {
    size_t k = (*counter)++;
    if (k % tensor_every == 0) {
      dp_value_t t = tensor_at(0x7f0000000000 + k * 4096);
      collect(c, t);
      return t;
    }
    if (k % 3 == 0) {
      dp_value_t s;
      dp_str_new("lr", 2, &s, NULL);
      return s;
    }
    return k % 3 == 1 ? dp_int((int64_t)k) : dp_float((double)k);
  }
  dp_value_t l;
  dp_list_new(10, &l, NULL);
  for (int i = 0; i < 10; i++) dp_list_append(l, build_tree(c, depth - 1, counter, tensor_every), NULL);
  return l;
}

static void bench_tree(const char *out, const char *name, size_t tensor_every) {
  scan_ctx_t c = {0};
  c.storages = malloc(sizeof *c.storages * (1000000 / tensor_every + 1));
  size_t counter = 0;
  tree_nodes = 0;
  c.v = build_tree(&c, 6, &counter, tensor_every);
  bench_scan(out, name, c, tree_nodes, 1);
}

static void free_ctx(scan_ctx_t *c) {
  dp_value_release(c->v);
  free(c->storages);
}

static void bench_scan(const char *out, const char *name, scan_ctx_t c, size_t nodes, int per_node) {
  dp_ptrset_new(&c.set, NULL);
  double ts, tl;
  bench_pair(run_scan, run_loop, &c, 7, &ts, &tl);
  if (per_node)
    bench_row(out, name, "cpu", ts * 1e9 / (double)nodes, "ns/node", ts / tl, "hand-written loop over the same storages");
  else
    bench_row(out, name, "cpu", ts * 1e6, "us", ts / tl, "hand-written loop over the same storages");
  dp_ptrset_free(c.set);
  free_ctx(&c);
}

/* ---- threads: build, scan, release ---- */

/* One iteration: a list of 100 user objects, each holding a tensor on its
 * own CPU storage, scanned into this thread's set, then released. */
static dp_ptrset_t *thread_sets[64];

static void thread_scan(void *ctx, int thread) {
  (void)ctx;
  /* made on its thread (the warm-up call): no cache line shared with another's */
  if (!thread_sets[thread]) dp_ptrset_new(&thread_sets[thread], NULL);
  dp_value_t l = bench_thread_objects(thread);
  dp_ptrset_clear(thread_sets[thread]);
  if (dp_scan(l, NULL, thread_sets[thread], NULL) != 0) exit(1);
  dp_value_release(l);
}

static void bench_thread_rows(const char *out) {
  bench_thread_scaling(out, thread_scan, "threads_scan", "cpu");
  for (int i = 0; i < 64; i++) {
    dp_ptrset_free(thread_sets[i]);
    thread_sets[i] = NULL;
  }
}

/* ---- pickle / unpickle on a mixed payload ---- */

static dp_value_t make_mixed(void) {
  dp_value_t root;
  dp_list_new(0, &root, NULL);
  char text[200];
  uint8_t blob[1024];
  for (size_t i = 0; i < sizeof blob; i++) blob[i] = (uint8_t)(i * 31);
  for (int i = 0; i < 20000; i++) {
    dp_value_t rec, k, v;
    dp_dict_new(6, &rec, NULL);
    int n = snprintf(text, sizeof text, "record-%d with a moderately long description field", i);
    dp_str_new("name", 4, &k, NULL);
    dp_str_new(text, (size_t)n, &v, NULL);
    dp_dict_set(rec, k, v, NULL);
    dp_str_new("id", 2, &k, NULL);
    dp_dict_set(rec, k, dp_int(i * 7919), NULL);
    dp_str_new("score", 5, &k, NULL);
    dp_dict_set(rec, k, dp_float(i * 0.5), NULL);
    dp_str_new("blob", 4, &k, NULL);
    dp_bytes_new(blob, 64 + (size_t)(i % 8) * 120, &v, NULL);
    dp_dict_set(rec, k, v, NULL);
    dp_str_new("grad", 4, &k, NULL);
    dp_dict_set(rec, k, tensor_at(0x7f0000000000 + (uintptr_t)i * 4096), NULL);
    dp_value_t o, vals;
    dp_object_new("Stats", &o, NULL);
    dp_list_new(4, &vals, NULL);
    for (int j = 0; j < 4; j++) dp_list_append(vals, dp_int(j - i), NULL);
    dp_object_set(o, "values", vals, NULL);
    dp_object_set(o, "ok", dp_bool(i & 1), NULL);
    dp_str_new("stats", 5, &k, NULL);
    dp_dict_set(rec, k, o, NULL);
    dp_list_append(root, rec, NULL);
  }
  return root;
}

/* The baseline: the same tree packed by a direct recursive walk with
 * msgpack-c's sbuffer, same layout, no memo and no buffer table. */
static void pack_direct(msgpack_packer *pk, dp_value_t v) {
  size_t n;
  switch (dp_value_kind(v)) {
    case DP_NONE: msgpack_pack_nil(pk); break;
    case DP_BOOL: dp_value_as_bool(v) ? msgpack_pack_true(pk) : msgpack_pack_false(pk); break;
    case DP_INT: msgpack_pack_int64(pk, dp_value_as_int(v)); break;
    case DP_FLOAT: msgpack_pack_double(pk, dp_value_as_float(v)); break;
    case DP_STR: {
      const char *s = dp_str_data(v, &n);
      msgpack_pack_str(pk, n);
      msgpack_pack_str_body(pk, s, n);
      break;
    }
    case DP_BYTES: {
      const uint8_t *b = dp_bytes_data(v, &n);
      msgpack_pack_bin(pk, n);
      msgpack_pack_bin_body(pk, b, n);
      break;
    }
    case DP_LIST:
      msgpack_pack_array(pk, dp_seq_len(v));
      for (size_t i = 0; i < dp_seq_len(v); i++) pack_direct(pk, dp_seq_get(v, i));
      break;
    case DP_DICT:
      msgpack_pack_map(pk, dp_dict_len(v));
      for (size_t i = 0; i < dp_dict_len(v); i++) {
        dp_value_t k, x;
        dp_dict_item(v, i, &k, &x, NULL);
        pack_direct(pk, k);
        pack_direct(pk, x);
      }
      break;
    case DP_OBJECT: {
      char tag = 3;
      msgpack_pack_array(pk, 2 + 2 * dp_object_nattrs(v));
      msgpack_pack_ext(pk, 1, 0);
      msgpack_pack_ext_body(pk, &tag, 1);
      const char *cls = dp_object_class(v);
      msgpack_pack_str(pk, strlen(cls));
      msgpack_pack_str_body(pk, cls, strlen(cls));
      for (size_t i = 0; i < dp_object_nattrs(v); i++) {
        const char *name;
        dp_value_t x;
        dp_object_attr(v, i, &name, &x, NULL);
        msgpack_pack_str(pk, strlen(name));
        msgpack_pack_str_body(pk, name, strlen(name));
        pack_direct(pk, x);
      }
      break;
    }
    case DP_TENSOR: {
      char tag = 2;
      msgpack_pack_array(pk, 6);
      msgpack_pack_ext(pk, 1, 0);
      msgpack_pack_ext_body(pk, &tag, 1);
      msgpack_pack_uint64(pk, 0);
      msgpack_pack_uint8(pk, (uint8_t)dp_tensor_dtype(v));
      for (int h = 0; h < 2; h++) {
        const int64_t *d = h ? dp_tensor_strides(v) : dp_tensor_shape(v);
        msgpack_pack_array(pk, (size_t)dp_tensor_ndim(v));
        for (int i = 0; i < dp_tensor_ndim(v); i++) msgpack_pack_int64(pk, d[i]);
      }
      msgpack_pack_int64(pk, dp_tensor_offset(v));
      break;
    }
    default: msgpack_pack_nil(pk); break;
  }
}

typedef struct pk_ctx {
  dp_value_t v;
  dp_frame_t *frame;
  msgpack_sbuffer sb;
  const uint8_t *bytes;
  size_t n;
  const char *payload;
  size_t payload_len;
} pk_ctx_t;

static void run_pickle(void *p) {
  pk_ctx_t *c = p;
  if (dp_pickle(c->v, NULL, c->frame, NULL) != 0) exit(1);
}

static void run_direct(void *p) {
  pk_ctx_t *c = p;
  msgpack_sbuffer_clear(&c->sb);
  msgpack_packer pk;
  msgpack_packer_init(&pk, &c->sb, msgpack_sbuffer_write);
  pack_direct(&pk, c->v);
}

/* Decoding is timed alone: freeing the result (or msgpack-c's zone) is
 * outside the clock for both. Fastest of `rounds` single decodes. */
static double time_decode(pk_ctx_t *c, int msgpack_c, int rounds) {
  double *t = malloc(sizeof(double) * (size_t)rounds);
  for (int r = 0; r < rounds; r++) {
    if (msgpack_c) {
      msgpack_zone zone;
      msgpack_zone_init(&zone, 1 << 20);
      msgpack_object obj;
      size_t off = 0;
      double t0 = bench_now();
      if (msgpack_unpack(c->payload, c->payload_len, &off, &zone, &obj) != MSGPACK_UNPACK_SUCCESS) exit(1);
      t[r] = bench_now() - t0;
      msgpack_zone_destroy(&zone);
    } else {
      dp_value_t v;
      double t0 = bench_now();
      if (dp_unpickle(c->bytes, c->n, NULL, &v, NULL) != 0) exit(1);
      t[r] = bench_now() - t0;
      dp_value_release(v);
    }
  }
  qsort(t, (size_t)rounds, sizeof(double), bench_cmp);
  double best = t[0];
  free(t);
  return best;
}

/* ---- hash flooding: keys built to collide vs random keys ----
 * XXH3-64 of 8 bytes is invertible (x -> rrmxmx(rotl(x, 32) ^ bitflip),
 * bitflip a function of the seed), so under a known seed anyone can pick
 * keys whose hashes share their low 32 bits. The library keys its hashes
 * with a per-process secret: these keys, built for the old fixed seeds (the
 * value kind for dict keys, the device for buffer bases), must cost what
 * random keys cost (ratio close to 1). */

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t rrmxmx_inverse(uint64_t h) {
  const uint64_t p = 0x9FB21C651E98DF25ull;
  uint64_t inv = p;
  for (int i = 0; i < 6; i++) inv *= 2 - p * inv;
  uint64_t x = h;
  for (int i = 0; i < 3; i++) x = h ^ (x >> 28);
  x *= inv;
  x ^= (x >> 35) + 8;
  x *= inv;
  for (int i = 0; i < 63; i++) x = x ^ rotl64(x, 49) ^ rotl64(x, 24);  /* L^64 = I */
  return x;
}

/* Key i of a family colliding under XXH3_64bits_withSeed(., 8, seed). */
static uint64_t colliding_key(size_t i, uint64_t seed) {
  uint64_t zero = 0, bitflip = rrmxmx_inverse(XXH3_64bits_withSeed(&zero, 8, seed));
  return rotl64(rrmxmx_inverse(((uint64_t)(i + 1) << 32) | 0x5bd1e995u) ^ bitflip, 32);
}

static uint64_t random_key(size_t i) {
  uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

typedef struct flood_ctx {
  uint8_t *frame;
  size_t n;
  dp_ptrset_t *set;
  uint64_t *bases;
  size_t nbases;
} flood_ctx_t;

static flood_ctx_t flood_dict_frame(size_t n, int collide) {
  dp_value_t d;
  dp_dict_new(n, &d, NULL);
  for (size_t i = 0; i < n; i++)
    dp_dict_set(d, dp_int((int64_t)(collide ? colliding_key(i, DP_INT) : random_key(i))), dp_int((int64_t)i), NULL);
  dp_frame_t *f;
  dp_frame_new(&f, NULL);
  if (dp_pickle(d, NULL, f, NULL) != 0) exit(1);
  flood_ctx_t c = {0};
  const uint8_t *p = dp_frame_data(f, &c.n);
  c.frame = malloc(c.n);
  memcpy(c.frame, p, c.n);
  dp_frame_free(f);
  dp_value_release(d);
  return c;
}

static void run_unpickle_frame(void *p) {
  flood_ctx_t *c = p;
  dp_value_t v;
  if (dp_unpickle(c->frame, c->n, NULL, &v, NULL) != 0) exit(1);
  dp_value_release(v);
}

static void run_ptrset_adds(void *p) {
  flood_ctx_t *c = p;
  dp_ptrset_clear(c->set);
  for (size_t i = 0; i < c->nbases; i++) dp_ptrset_add(c->set, cuda0, (void *)(uintptr_t)c->bases[i], 512, NULL, NULL);
}

/* Times a and b alternately (as bench_pair does), each on its own context. */
static void flood_pair(void (*fn)(void *), flood_ctx_t *a, flood_ctx_t *b, double *ta, double *tb) {
  double xa[5], xb[5];
  for (int r = 0; r < 5; r++) {
    xa[r] = bench_time(fn, a, 3);
    xb[r] = bench_time(fn, b, 3);
  }
  qsort(xa, 5, sizeof(double), bench_cmp);
  qsort(xb, 5, sizeof(double), bench_cmp);
  *ta = xa[0];
  *tb = xb[0];
}

static void bench_flood(const char *out) {
  flood_ctx_t a = flood_dict_frame(60000, 1), b = flood_dict_frame(60000, 0);
  double ta, tb;
  flood_pair(run_unpickle_frame, &a, &b, &ta, &tb);
  bench_row(out, "flood_dict_60000", "cpu", ta * 1e3, "ms", ta / tb,
            "unpickle of a dict of 60,000 int keys colliding under the old fixed seed vs random keys (time ratio)");
  free(a.frame);
  free(b.frame);
  uint64_t old_seed = ((uint64_t)cuda0.type << 8) | cuda0.index;
  flood_ctx_t pa = {0}, pb = {0};
  pa.nbases = pb.nbases = 40000;
  pa.bases = malloc(40000 * sizeof(uint64_t));
  pb.bases = malloc(40000 * sizeof(uint64_t));
  for (size_t i = 0; i < 40000; i++) {
    pa.bases[i] = colliding_key(i, old_seed);
    pb.bases[i] = random_key(i);
  }
  dp_ptrset_new(&pa.set, NULL);
  dp_ptrset_new(&pb.set, NULL);
  flood_pair(run_ptrset_adds, &pa, &pb, &ta, &tb);
  bench_row(out, "flood_ptrset_40000", "cpu", ta * 1e3, "ms", ta / tb,
            "40,000 buffer bases colliding under the old fixed seed added to a pointer set vs random bases (time ratio)");
  dp_ptrset_free(pa.set);
  dp_ptrset_free(pb.set);
  free(pa.bases);
  free(pb.bases);
}

int main(int argc, char **argv) {
  const char *out = bench_out(argc, argv);
  bench_scan(out, "scan_list_1000", make_list(1000), 1001, 0);
  bench_scan(out, "scan_nested_1000", make_nested(1000), 5001, 0);
  bench_scan(out, "scan_objects_1000", make_objects(1000), 2001, 0);
  /* the same at 10 and 100 times the size: the cost per tensor should hold */
  bench_scan(out, "scan_list_10000", make_list(10000), 10001, 0);
  bench_scan(out, "scan_list_100000", make_list(100000), 100001, 0);
  bench_scan(out, "scan_nested_10000", make_nested(10000), 50001, 0);
  bench_scan(out, "scan_nested_100000", make_nested(100000), 500001, 0);
  bench_thread_rows(out);
  bench_tree(out, "scan_tree_1m", 10);       /* 100k tensors among 1.11M nodes */
  bench_tree(out, "scan_tree_1m_dense", 2);  /* 500k distinct allocations: the worst case */
  bench_flood(out);

  pk_ctx_t c = {0};
  c.v = make_mixed();
  dp_frame_new(&c.frame, NULL);
  msgpack_sbuffer_init(&c.sb);
  run_pickle(&c);
  run_direct(&c);
  c.bytes = dp_frame_data(c.frame, &c.n);
  double tp, td;
  bench_pair(run_pickle, run_direct, &c, 7, &tp, &td);
  bench_row(out, "pickle_mixed", "cpu", (double)c.n / tp / 1e6, "MB/s", tp / td,
            "the same tree packed directly with msgpack-c (time ratio)");
  /* the payload alone, for msgpack-c's decoder */
  c.payload = (const char *)c.bytes + 40;
  dp_frame_info_t fi;
  dp_frame_check(c.bytes, c.n, &fi, NULL);
  c.payload_len = fi.payload_len;
  double tu = 0, tm = 0, xu[5], xm[5];
  for (int r = 0; r < 5; r++) {  /* interleaved, as bench_pair does */
    xu[r] = time_decode(&c, 0, 5);
    xm[r] = time_decode(&c, 1, 5);
  }
  qsort(xu, 5, sizeof(double), bench_cmp);
  qsort(xm, 5, sizeof(double), bench_cmp);
  tu = xu[0];
  tm = xm[0];
  bench_row(out, "unpickle_mixed", "cpu", (double)c.n / tu / 1e6, "MB/s", tu / tm,
            "msgpack-c unpack of the payload into its object tree (time ratio; decode timed, free not)");
  printf("(mixed payload: %zu-byte frame, %zu-byte direct msgpack)\n", c.n, c.sb.size);
  bench_scan(out, "scan_shared_1000", make_shared(), 1501, 0);
  msgpack_sbuffer_destroy(&c.sb);
  dp_frame_free(c.frame);
  dp_value_release(c.v);
  return 0;
}
