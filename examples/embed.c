/* examples/embed.c — embedding devpickle: a user-defined C type, a scan with
 * paths, a frame for transport and the receiving side, then the same value
 * as an inline frame, its device bytes read through the backend. The
 * tensors live in memory of the default backend (cuda where a GPU is
 * usable, else host: DEVPICKLE_BACKEND=host|cuda forces one).
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

/* The storage's release callback: the memory goes back to its backend. */
static void device_release(void *backend, dp_device_t device, void *base, size_t nbytes) {
  (void)nbytes;
  dp_device_dealloc(backend, device, base, NULL);
}

/* A float32 tensor of n elements in memory of device 0 of the backend, every
 * byte set to fill (copied on the current stream, which the copy finishes). */
static int device_tensor(dp_backend_t *be, int64_t n, unsigned char fill, dp_value_t *out, dp_error_t *err) {
  dp_device_t dev = dp_backend_device(be, 0);
  size_t nbytes = (size_t)n * 4;
  unsigned char *src = malloc(nbytes);
  void *mem;
  dp_stream_t *s;
  dp_storage_t *st;
  int rc;
  if (!src) return DP_ENOMEM;
  for (size_t i = 0; i < nbytes; i++) src[i] = fill;
  rc = dp_device_alloc(be, dev, nbytes, &mem, err);
  if (rc) {
    free(src);
    return rc;
  }
  rc = dp_current_stream(be, dev, &s, err);
  if (!rc) rc = dp_memcpy_async(s, mem, src, nbytes, err);
  if (!rc) rc = dp_stream_synchronize(s, err);
  free(src);
  if (!rc) rc = dp_storage_new(dev, mem, nbytes, device_release, be, &st, err);
  if (rc) {
    dp_device_dealloc(be, dev, mem, NULL);  /* a failed dp_storage_new leaves the memory ours */
    return rc;
  }
  return dp_tensor_new(st, DP_FLOAT32, 1, &n, NULL, 0, out, err);  /* steals st */
}

int main(void) {
  dp_error_t err;
  dp_backend_t *be;
  dp_value_t model, blk, bias;
  struct block *b = malloc(sizeof *b);
  if (!b) return 1;
  b->weights = dp_none();
  if (dp_backend_default(&be, &err) || device_tensor(be, 1024, 0x11, &b->weights, &err) ||
      device_tensor(be, 16, 0x22, &bias, &err)) {
    fprintf(stderr, "device memory: %s: %s\n", dp_err_name(err.code), err.message);
    return 1;
  }
  if (dp_object_new("Model", &model, &err) || dp_custom_new(&block_type, b, &blk, &err) ||
      dp_object_set(model, "block", blk, &err) ||  /* steals blk */
      dp_object_set(model, "bias", bias, &err)) {   /* steals bias */
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

  /* Or inline, self-contained: the device bytes are read through the backend
   * (device -> host, after the current stream's work) into the frame; bytes
   * above is stale now (valid until the next pickle into the frame). */
  dp_pickle_opts_t inl = {.flags = DP_PICKLE_INLINE, .read = dp_device_read};
  if (dp_pickle(model, &inl, frame, &err)) {
    fprintf(stderr, "inline pickle: %s: %s\n", dp_err_name(err.code), err.message);
    return 1;
  }
  bytes = dp_frame_data(frame, &n);
  if (dp_unpickle(bytes, n, NULL, &copy, &err)) {
    fprintf(stderr, "unpickle: %s at byte %lld\n", err.message, (long long)err.offset);
    return 1;
  }
  /* The receiver has the bytes without the sender's memory: its storages
   * carry them as host data. */
  dp_value_t bias2;
  const unsigned char *data;
  if (dp_object_get(copy, "bias", &bias2, &err)) {
    fprintf(stderr, "%s: %s\n", dp_err_name(err.code), err.message);
    return 1;
  }
  data = dp_storage_host_data(dp_tensor_storage(bias2));
  for (size_t i = 0; i < 64; i++)
    if (!data || data[i] != 0x22) {
      fprintf(stderr, "inline frame: the bias's byte %zu is not the one written\n", i);
      return 1;
    }
  printf("inline frame: %zu bytes, the bias's 64 bytes as written\n", n);

  dp_value_release(copy);
  dp_frame_free(frame);
  dp_ptrset_free(set);
  dp_value_release(model);
  dp_value_collect(); /* cyclic garbage this thread released: exit() runs no thread exit (value.h, EXIT) */
  dp_shutdown(); /* the library's threads and caches go; nothing of it is used after */
  return 0;
}
