/* device/cuda.c — the CUDA backend: the CUDA runtime, linked statically.
 *
 * Built with DP_HAVE_CUDA when the toolkit is present; without it, or
 * without a driver or a device at run time, the backend reports DP_ENODEV
 * with the reason. Every CUDA error becomes DP_ECUDA with the cudaError_t in
 * err->backend_code and its message in err->message. Calls that touch a
 * device make it current for the call and restore the caller's device. */
#include "internal.h"

#ifdef DP_HAVE_CUDA
#include <cuda_runtime_api.h>

static int cuda_err(dp_error_t *err, cudaError_t e, const char *what) {
  int code = (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorSystemNotReady ||
              e == cudaErrorSystemDriverMismatch || e == cudaErrorCompatNotSupportedOnDevice)
                 ? DP_ENODEV
                 : DP_ECUDA;
  dp__err(err, code, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  if (err) err->backend_code = (int)e;
  return code;
}

/* Runs a block with `dev` current, restoring the caller's device. */
#define WITH_DEVICE(dev, err, what, body)                             \
  do {                                                                \
    int prev_;                                                        \
    cudaError_t e_ = cudaGetDevice(&prev_);                           \
    if (e_ == cudaSuccess && prev_ != (dev)) e_ = cudaSetDevice(dev); \
    if (e_ != cudaSuccess) return cuda_err(err, e_, what);            \
    body;                                                             \
    if (prev_ != (dev)) cudaSetDevice(prev_);                         \
  } while (0)

static int c_init(dp_backend_t *b, dp_error_t *err) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  /* clear the error state */
    cuda_err(err, e, "no usable CUDA device");
    if (err) err->code = DP_ENODEV;  /* whatever the cause, the backend is unavailable */
    return DP_ENODEV;
  }
  if (n == 0) return dp__err(err, DP_ENODEV, "no CUDA device");
  b->impl = NULL;  /* the CUDA runtime keeps the state */
  b->ndev = n > DP_DEVICE_INDEX_MAX + 1 ? DP_DEVICE_INDEX_MAX + 1 : n;
  return 0;
}

static void c_shutdown(dp_backend_t *b) { (void)b; }

static int c_stream_create(dp_backend_t *b, int dev, void **h, dp_error_t *err) {
  (void)b;
  cudaStream_t s = NULL;
  cudaError_t e;
  WITH_DEVICE(dev, err, "cudaStreamCreateWithFlags", e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (e != cudaSuccess) return cuda_err(err, e, "cudaStreamCreateWithFlags");
  *h = s;
  return 0;
}

static void c_stream_destroy(dp_backend_t *b, void *h) {
  (void)b;
  cudaStreamSynchronize((cudaStream_t)h);
  cudaStreamDestroy((cudaStream_t)h);
}

static void *c_stream_native(void *h) { return h; }

static int c_stream_sync(dp_backend_t *b, void *h, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)h);
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaStreamSynchronize");
}

static int c_stream_query(dp_backend_t *b, void *h, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaStreamQuery((cudaStream_t)h);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  return cuda_err(err, e, "cudaStreamQuery");
}

static int c_stream_wait(dp_backend_t *b, void *sh, void *eh, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)sh, (cudaEvent_t)eh, 0);
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaStreamWaitEvent");
}

static int c_event_create(dp_backend_t *b, int dev, void **h, dp_error_t *err) {
  (void)b;
  cudaEvent_t ev = NULL;
  cudaError_t e;
  WITH_DEVICE(dev, err, "cudaEventCreateWithFlags", e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  if (e != cudaSuccess) return cuda_err(err, e, "cudaEventCreateWithFlags");
  *h = ev;
  return 0;
}

static void c_event_destroy(dp_backend_t *b, void *h) {
  (void)b;
  cudaEventDestroy((cudaEvent_t)h);
}

static int c_event_record(dp_backend_t *b, void *eh, void *sh, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaEventRecord((cudaEvent_t)eh, (cudaStream_t)sh);
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaEventRecord");
}

static int c_event_query(dp_backend_t *b, void *eh, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaEventQuery((cudaEvent_t)eh);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  return cuda_err(err, e, "cudaEventQuery");
}

static int c_event_sync(dp_backend_t *b, void *eh, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaEventSynchronize((cudaEvent_t)eh);
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaEventSynchronize");
}

static int c_device_sync(dp_backend_t *b, int dev, dp_error_t *err) {
  (void)b;
  cudaError_t e;
  WITH_DEVICE(dev, err, "cudaDeviceSynchronize", e = cudaDeviceSynchronize());
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaDeviceSynchronize");
}

static int c_malloc(dp_backend_t *b, int dev, size_t n, void **out, dp_error_t *err) {
  (void)b;
  cudaError_t e;
  WITH_DEVICE(dev, err, "cudaMalloc", e = cudaMalloc(out, n ? n : 1));
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return dp__err(err, DP_ENOMEM, "cuda:%d is out of memory allocating %zu bytes", dev, n);
  }
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaMalloc");
}

static int c_free(dp_backend_t *b, int dev, void *p, dp_error_t *err) {
  (void)b;
  cudaError_t e;
  WITH_DEVICE(dev, err, "cudaFree", e = cudaFree(p));
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaFree");
}

static int c_pointer_device(dp_backend_t *b, const void *p, int *dev) {
  (void)b;
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return DP_ENOTFOUND;
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) return DP_ENOTFOUND;
  *dev = a.device;
  return 0;
}

static int c_memcpy_async(dp_backend_t *b, void *sh, void *dst, const void *src, size_t n, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, (cudaStream_t)sh);
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaMemcpyAsync");
}

const dp__backend_ops_t dp__cuda_ops = {
    c_init,        c_shutdown,     c_stream_create, c_stream_destroy, c_stream_native,
    c_stream_sync, c_stream_query, c_stream_wait,   c_event_create,   c_event_destroy,
    NULL,          c_event_record, c_event_query,   c_event_sync,     c_device_sync,
    c_malloc,      c_free,         c_pointer_device, c_memcpy_async,
};

#else /* no CUDA toolkit at build time */

static int c_init(dp_backend_t *b, dp_error_t *err) {
  (void)b;
  return dp__err(err, DP_ENODEV, "this devpickle was built without CUDA (no toolkit under CUDA_HOME)");
}

const dp__backend_ops_t dp__cuda_ops = {c_init, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                        NULL,   NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
#endif
