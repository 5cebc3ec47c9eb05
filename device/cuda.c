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

/* The special handles 0 (the legacy default stream), cudaStreamLegacy and
 * cudaStreamPerThread name a stream of whichever device is current when
 * they are used. A wrapper of one (dp_stream_wrap) must keep meaning its
 * own device's, so its handle is a small integer, never a stream's
 * address (nothing is mapped below 4096), that encodes the device and the
 * special handle: the calls below make that device current around each use. */
#define SPECIAL_BASE ((uintptr_t)0x100)
#define SPECIAL_KINDS 3u /* 0, cudaStreamLegacy (1), cudaStreamPerThread (2) */

static int is_special_native(void *native) { return (uintptr_t)native < SPECIAL_KINDS; }

/* -1 for an ordinary stream; else the device, with *native the special handle. */
static int special_dev(void *h, cudaStream_t *native) {
  uintptr_t v = (uintptr_t)h - SPECIAL_BASE;
  if ((uintptr_t)h < SPECIAL_BASE || v >= (DP_DEVICE_INDEX_MAX + 1) * SPECIAL_KINDS) return -1;
  *native = (cudaStream_t)(v % SPECIAL_KINDS);
  return (int)(v / SPECIAL_KINDS);
}

/* e = call(stream), with h's device current when h is a special handle. */
#define ON_STREAM(h, err, what, e, call)          \
  do {                                            \
    cudaStream_t stream = (cudaStream_t)(h);      \
    int sdev_ = special_dev((h), &stream);        \
    if (sdev_ < 0) {                              \
      e = call;                                   \
    } else {                                      \
      WITH_DEVICE(sdev_, err, what, e = call);    \
    }                                             \
  } while (0)

static int c_stream_wrap(dp_backend_t *b, int dev, void *native, void **h, dp_error_t *err) {
  (void)b;
  if (is_special_native(native)) {
    *h = (void *)(SPECIAL_BASE + (uintptr_t)dev * SPECIAL_KINDS + (uintptr_t)native);
    return 0;
  }
#if CUDART_VERSION >= 12080
  /* A stream knows its device: a wrapper on another one would record
   * events that cannot be. */
  int on;
  cudaError_t e = cudaStreamGetDevice((cudaStream_t)native, &on);
  if (e != cudaSuccess) {
    cudaGetLastError();  /* a bad handle is the caller's error, not the next call's */
    return cuda_err(err, e, "dp_stream_wrap: cudaStreamGetDevice");
  }
  if (on != dev) return dp__err(err, DP_EINVAL, "dp_stream_wrap: %p is a stream of cuda:%d, not cuda:%d", native, on, dev);
#else
  (void)dev;
  (void)err;
#endif
  *h = native;
  return 0;
}

static void *c_stream_native(void *h) {
  cudaStream_t native = (cudaStream_t)h;
  special_dev(h, &native);
  return (void *)native;
}

static int c_stream_sync(dp_backend_t *b, void *h, dp_error_t *err) {
  (void)b;
  cudaError_t e;
  ON_STREAM(h, err, "cudaStreamSynchronize", e, cudaStreamSynchronize(stream));
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaStreamSynchronize");
}

static int c_stream_query(dp_backend_t *b, void *h, dp_error_t *err) {
  (void)b;
  cudaError_t e;
  ON_STREAM(h, err, "cudaStreamQuery", e, cudaStreamQuery(stream));
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  return cuda_err(err, e, "cudaStreamQuery");
}

static int c_stream_wait(dp_backend_t *b, void *sh, void *eh, dp_error_t *err) {
  (void)b;
  cudaError_t e;
  ON_STREAM(sh, err, "cudaStreamWaitEvent", e, cudaStreamWaitEvent(stream, (cudaEvent_t)eh, 0));
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
  cudaError_t e;
  ON_STREAM(sh, err, "cudaEventRecord", e, cudaEventRecord((cudaEvent_t)eh, stream));
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaEventRecord");
}

/* CUDA has no reset: an event whose last record has not completed is
 * replaced by a new one, so that the next owner's event reads as never
 * recorded (complete), as device.h promises. A completed event already
 * reads so everywhere (query, synchronize, a stream's wait). */
static int c_event_reset(dp_backend_t *b, int dev, void **h) {
  if (cudaEventQuery((cudaEvent_t)*h) == cudaSuccess) return 0;
  cudaEventDestroy((cudaEvent_t)*h);
  *h = NULL;
  return c_event_create(b, dev, h, NULL) ? -1 : 0;
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
    return dp__err(err, DP_ENOMEM, "out of memory allocating %zu bytes", n);
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
  cudaError_t e;
  ON_STREAM(sh, err, "cudaMemcpyAsync", e, cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaMemcpyAsync");
}

static int c_pinned_alloc(dp_backend_t *b, size_t n, void **out, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaHostAlloc(out, n, cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return dp__err(err, DP_ENOMEM, "out of page-locked host memory allocating %zu bytes", n);
  }
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaHostAlloc");
}

static void c_pinned_free(dp_backend_t *b, void *p, size_t n) {
  (void)b, (void)n;
  cudaFreeHost(p);
}

static int c_pinned_register(dp_backend_t *b, void *p, size_t n, int readonly, dp_error_t *err) {
  (void)b;
  cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterPortable | (readonly ? cudaHostRegisterReadOnly : 0));
  return e == cudaSuccess ? 0 : cuda_err(err, e, "cudaHostRegister");
}

static void c_pinned_unregister(dp_backend_t *b, void *p) {
  (void)b;
  cudaHostUnregister(p);
}

const dp__backend_ops_t dp__cuda_ops = {
    c_init,        c_shutdown,     c_stream_create, c_stream_destroy, c_stream_wrap,   c_stream_native,
    c_stream_sync, c_stream_query, c_stream_wait,   c_event_create,   c_event_destroy,
    c_event_reset, c_event_record, c_event_query,   c_event_sync,     c_device_sync,
    c_malloc,      c_free,         c_pointer_device, c_memcpy_async, c_pinned_alloc, c_pinned_free,
    c_pinned_register, c_pinned_unregister, NULL,
};

#else /* no CUDA toolkit at build time */

static int c_init(dp_backend_t *b, dp_error_t *err) {
  (void)b;
  return dp__err(err, DP_ENODEV, "this devpickle was built without CUDA (no toolkit under CUDA_HOME)");
}

const dp__backend_ops_t dp__cuda_ops = {c_init, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                        NULL,   NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
#endif
