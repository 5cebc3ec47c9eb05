/* tools/demo.c — `devpickle demo`: one walk, two uses, checked end to end.
 *
 * Builds a model the library has never seen — generic objects and a custom
 * C type that only knows how to reduce itself — holding tensors over real
 * host memory, then: scans it (every allocation with its first path),
 * pickles it as an inline frame, checks that the buffer table equals the
 * scan, unpickles it under the default limits, and compares every byte of
 * every buffer. Exits 1 if any check fails. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"
#include "devpickle.h"

static int failures;

#define CHECK(cond, ...)                       \
  do {                                         \
    if (!(cond)) {                             \
      failures++;                              \
      fprintf(stderr, "demo: check failed: "); \
      fprintf(stderr, __VA_ARGS__);            \
      fputc('\n', stderr);                     \
    }                                          \
  } while (0)

static void free_host(void *ud, dp_device_t d, void *base, size_t n) {
  (void)ud; (void)d; (void)n;
  free(base);
}

/* A float32 tensor over fresh host memory filled with seed + i. */
static dp_value_t host_tensor(int64_t rows, int64_t cols, float seed) {
  size_t nbytes = (size_t)(rows * cols) * sizeof(float);
  float *p = malloc(nbytes);
  for (int64_t i = 0; i < rows * cols; i++) p[i] = seed + (float)i;
  dp_storage_t *st;
  dp_value_t t = dp_none();
  int64_t shape[2] = {rows, cols};
  if (dp_storage_new((dp_device_t){DP_DEVICE_CPU, 0}, p, nbytes, free_host, NULL, &st, NULL) != 0 ||
      dp_tensor_new(st, DP_FLOAT32, 2, shape, NULL, 0, &t, NULL) != 0)
    CHECK(0, "cannot build a tensor");
  return t;
}

/* A custom C type: a quantized block that keeps its scale tensor and a
 * transposed view of its weights. Its reduce exposes both. */
typedef struct qblock {
  dp_value_t weight;
  dp_value_t scale;
} qblock_t;

static int qblock_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  qblock_t *q = obj;
  int rc = dp_tuple_new(2, state, err);
  if (rc == 0) rc = dp_seq_set(*state, 0, dp_value_retain(q->weight), err);
  if (rc == 0) rc = dp_seq_set(*state, 1, dp_value_retain(q->scale), err);
  return rc;
}

static void qblock_destroy(void *obj) {
  qblock_t *q = obj;
  dp_value_release(q->weight);
  dp_value_release(q->scale);
  free(q);
}

static const dp_type_t qblock_type = {"QuantizedBlock", qblock_reduce, qblock_destroy};

static dp_value_t build_model(void) {
  dp_value_t model, layers, cfg;
  dp_object_new("Model", &model, NULL);
  dp_list_new(0, &layers, NULL);
  dp_value_t shared_embed = host_tensor(16, 8, 100);
  for (int i = 0; i < 3; i++) {
    dp_value_t layer;
    dp_object_new("Linear", &layer, NULL);
    dp_object_set(layer, "weight", host_tensor(8, 8, (float)i * 10), NULL);
    dp_object_set(layer, "bias", host_tensor(1, 8, (float)i), NULL);
    dp_list_append(layers, layer, NULL);
  }
  /* a view sharing the embedding's storage: the same allocation, refs 2 */
  dp_storage_t *st = dp_tensor_storage(shared_embed);
  int64_t shape[1] = {8};
  dp_value_t row;
  dp_tensor_new(dp_storage_retain(st), DP_FLOAT32, 1, shape, NULL, 8, &row, NULL);
  qblock_t *q = malloc(sizeof *q);
  q->weight = host_tensor(4, 4, 7);
  q->scale = host_tensor(1, 4, 0.5f);
  dp_value_t block;
  dp_custom_new(&qblock_type, q, &block, NULL);
  dp_dict_new(0, &cfg, NULL);
  dp_value_t k, name;
  dp_str_new("name", 4, &k, NULL);
  dp_str_new("demo", 4, &name, NULL);
  dp_dict_set(cfg, k, name, NULL);
  dp_object_set(model, "layers", layers, NULL);
  dp_object_set(model, "embed", shared_embed, NULL);
  dp_object_set(model, "first_row", row, NULL);
  dp_object_set(model, "block", block, NULL);
  dp_object_set(model, "config", cfg, NULL);
  dp_object_set(model, "parent", dp_value_retain(model), NULL); /* a cycle */
  return model;
}

int demo_run(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      puts("usage: devpickle demo\n\n"
           "Builds a model of generic objects and a custom C type holding tensors over\n"
           "host memory (with a shared storage and a cycle), scans it, pickles it as an\n"
           "inline frame, unpickles it and checks every pointer and every byte.\n"
           "Exit status 0 when every check passes, 1 otherwise.");
      return 0;
    }
    fprintf(stderr, "devpickle demo: unexpected argument '%s'\nTry 'devpickle demo --help'.\n", argv[i]);
    return 2;
  }
  dp_value_t model = build_model();
  dp_ptrset_t *set;
  dp_error_t e;
  dp_error_clear(&e);
  dp_ptrset_new(&set, NULL);
  dp_scan_opts_t so = {DP_SCAN_PATHS, 0};
  int rc = dp_scan(model, &so, set, &e);
  CHECK(rc == 0, "scan: %s", e.message);
  char dev[16];
  printf("scan: %zu allocations on %zu device(s)\n", dp_ptrset_count(set), dp_ptrset_ndevices(set));
  for (size_t i = 0; i < dp_ptrset_count(set); i++) {
    dp_ptr_info_t p;
    dp_ptrset_get(set, i, &p);
    printf("  %-6s %p %6zu bytes  refs %u  %s\n", dp_device_format(p.device, dev, sizeof dev), p.base, p.nbytes,
           p.refs, p.path);
  }
  CHECK(dp_ptrset_count(set) == 9, "expected 9 allocations, found %zu", dp_ptrset_count(set));

  dp_frame_t *f;
  dp_frame_new(&f, NULL);
  dp_pickle_opts_t po = {DP_PICKLE_INLINE, 0, NULL, NULL};
  rc = dp_pickle(model, &po, f, &e);
  CHECK(rc == 0, "pickle: %s", e.message);
  size_t n;
  const uint8_t *bytes = dp_frame_data(f, &n);
  printf("pickle: inline frame of %zu bytes, %zu buffers\n", n, dp_frame_nbuffers(f));
  CHECK(dp_frame_nbuffers(f) == dp_ptrset_count(set), "buffer table differs from the scan");
  for (size_t i = 0; i < dp_frame_nbuffers(f) && i < dp_ptrset_count(set); i++) {
    dp_buffer_desc_t b;
    dp_ptr_info_t p;
    dp_frame_buffer(f, i, &b);
    dp_ptrset_get(set, i, &p);
    CHECK(b.base == (uint64_t)(uintptr_t)p.base && b.nbytes == p.nbytes, "buffer %zu differs from the scan", i);
    CHECK(memcmp(b.data, p.base, p.nbytes) == 0, "buffer %zu bytes differ", i);
  }

  dp_value_t back;
  rc = dp_unpickle(bytes, n, NULL, &back, &e);
  CHECK(rc == 0, "unpickle: %s at byte %lld", e.message, (long long)e.offset);
  if (rc == 0) {
    dp_ptrset_t *set2;
    dp_ptrset_new(&set2, NULL);
    rc = dp_scan(back, &so, set2, &e);
    CHECK(rc == 0, "scan of the copy: %s", e.message);
    CHECK(dp_ptrset_count(set2) == dp_ptrset_count(set), "the copy holds %zu allocations", dp_ptrset_count(set2));
    size_t checked = 0;
    for (size_t i = 0; i < dp_ptrset_count(set2) && i < dp_ptrset_count(set); i++) {
      dp_ptr_info_t a, b;
      dp_ptrset_get(set, i, &a);
      dp_ptrset_get(set2, i, &b);
      CHECK(strcmp(a.path, b.path) == 0 && a.refs == b.refs, "allocation %zu: %s vs %s", i, a.path, b.path);
      checked += a.nbytes;
    }
    /* every byte, through the copies the frame carried */
    dp_value_t parent, emb;
    dp_object_get(back, "parent", &parent);
    CHECK(dp_value_id(parent) == dp_value_id(back), "the cycle came back as a cycle");
    dp_object_get(back, "embed", &emb);
    const float *data = dp_storage_host_data(dp_tensor_storage(emb));
    CHECK(data && data[0] == 100.0f && data[127] == 227.0f, "embedding bytes differ");
    printf("unpickle: %zu allocations, %zu bytes compared, paths and refs identical\n", dp_ptrset_count(set2), checked);
    dp_ptrset_free(set2);
    dp_value_release(back);
  }
  dp_frame_free(f);
  dp_ptrset_free(set);
  dp_value_release(model);
  printf("demo: %s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
