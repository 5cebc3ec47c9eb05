/* examples/embed.c — embedding devpickle: a user-defined C type, a scan with
 * paths, a frame for transport and the receiving side.
 * Build: cc -std=c11 embed.c $(pkg-config --cflags --libs devpickle)
 * (installed under another PREFIX than /usr/local or /usr, set
 * PKG_CONFIG_PATH=PREFIX/lib/pkgconfig first, or pkg-config finds nothing;
 * under a PREFIX the loader does not search, add
 * -Wl,-rpath,$(pkg-config --variable=libdir devpickle): else ./a.out cannot
 * find libdevpickle.so.0)
 * or, static: cc -std=c11 embed.c $(pkg-config --cflags devpickle) $(pkg-config --variable=staticlibs devpickle)
 * (README, "Embedding": --static --libs would still link libdevpickle.so). */
#include <devpickle.h>
#include <stdio.h>
#include <stdlib.h>

/* A C type devpickle has never seen: it exposes its contents through reduce. */
struct block {
  dp_value_t weights;
};

static int block_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  int rc = dp_list_new(1, state, err);
  return rc ? rc : dp_list_append(*state, dp_value_retain(((struct block *)obj)->weights), err);
}

static void block_destroy(void *obj) {
  dp_value_release(((struct block *)obj)->weights);
  free(obj);
}

static const dp_type_t block_type = {"Block", block_reduce, block_destroy};

static dp_value_t device_tensor(uintptr_t address, int64_t n) {
  dp_storage_t *st;
  dp_value_t t = dp_none();
  dp_device_t cuda0 = {DP_DEVICE_CUDA, 0};
  if (dp_storage_new(cuda0, (void *)address, (size_t)n * 4, NULL, NULL, &st, NULL) == 0)
    dp_tensor_new(st, DP_FLOAT32, 1, &n, NULL, 0, &t, NULL);  /* steals st */
  return t;
}

int main(void) {
  dp_error_t err;
  dp_value_t model, blk;
  struct block *b = malloc(sizeof *b);
  if (!b) return 1;
  b->weights = device_tensor(0x7f0000000000, 1024);
  if (dp_object_new("Model", &model, &err) || dp_custom_new(&block_type, b, &blk, &err) ||
      dp_object_set(model, "block", blk, &err) ||  /* steals blk */
      dp_object_set(model, "bias", device_tensor(0x7f0000100000, 16), &err)) {
    fprintf(stderr, "build: %s: %s\n", dp_err_name(err.code), err.message);
    return 1;
  }

  dp_ptrset_t *set;  /* keep it: later scans reuse its memory */
  dp_scan_opts_t opts = {DP_SCAN_PATHS, 0};
  if (dp_ptrset_new(&set, &err) || dp_scan(model, &opts, set, &err)) {
    fprintf(stderr, "%s: %s\n", dp_err_name(err.code), err.message);  /* names the type and path */
    return 1;
  }
  for (size_t i = 0; i < dp_ptrset_count(set); i++) {
    dp_ptr_info_t p;
    char dev[16];
    if (dp_ptrset_get(set, i, &p, &err)) {
      fprintf(stderr, "%s: %s\n", dp_err_name(err.code), err.message);
      return 1;
    }
    printf("%s %p %zu bytes at %s\n", dp_device_format(p.device, dev, sizeof dev), p.base, p.nbytes, p.path);
  }

  dp_frame_t *frame;  /* the frame for transport; device buffers go out-of-band */
  size_t n;
  if (dp_frame_new(&frame, &err) || dp_pickle(model, NULL, frame, &err)) {
    fprintf(stderr, "pickle: %s: %s\n", dp_err_name(err.code), err.message);
    return 1;
  }
  const uint8_t *bytes = dp_frame_data(frame, &n);
  printf("frame: %zu bytes, %zu buffers\n", n, dp_frame_nbuffers(frame));

  dp_value_t copy;  /* the receiver treats the bytes as hostile */
  if (dp_unpickle(bytes, n, NULL, &copy, &err)) {
    fprintf(stderr, "unpickle: %s at byte %lld\n", err.message, (long long)err.offset);
    return 1;
  }
  /* Without a resolver the Block comes back generic: class "Block", its state
   * in the attribute "__reduce__". */
  dp_value_t blk2;
  if (dp_object_get(copy, "block", &blk2, &err)) {
    fprintf(stderr, "%s: %s\n", dp_err_name(err.code), err.message);
    return 1;
  }
  printf("received a %s (reduced: %s)\n", dp_object_class(blk2), dp_object_is_reduced(blk2) ? "yes" : "no");

  dp_value_release(copy);
  dp_frame_free(frame);
  dp_ptrset_free(set);
  dp_value_release(model);
  dp_value_collect(); /* cyclic garbage this thread released: exit() runs no thread exit (value.h, EXIT) */
  dp_shutdown(); /* the library's threads and caches go; nothing of it is used after */
  return 0;
}
