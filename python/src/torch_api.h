/*
 * torch_api.h — what the devpickle extension asks of PyTorch, as a table of
 * C functions. The optional C++ adapter (torch_adapter.cpp, module
 * devpickle._torch, compiled against the installed libtorch) fills it and
 * publishes it as the capsule "devpickle._torch._api"; without the adapter the
 * extension answers the same questions through torch's Python API (slower).
 *
 * Every function is called with the GIL held unless it says otherwise, and
 * never raises a Python exception unless its return value says so.
 */
#ifndef DEVPICKLE_PY_TORCH_API_H
#define DEVPICKLE_PY_TORCH_API_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DP_TORCH_API_VERSION 4
#define DP_TORCH_API_CAPSULE "devpickle._torch._api"

/* One allocation a tensor holds. device_type uses devpickle's numbering
 * (DP_DEVICE_CPU 0, DP_DEVICE_CUDA 1; see devpickle/base.h). */
typedef struct dp_torch_alloc {
  int device_type;
  int device_index;   /* 0 for cpu */
  void *base;         /* the storage's data pointer (NULL for an empty storage) */
  size_t nbytes;      /* the storage's size in bytes */
  /* 1: cpu memory torch did not allocate (torch.from_numpy, torch.frombuffer,
   * from_dlpack, pinned or shared memory; the Python path, which cannot
   * tell, says 1 for all cpu memory). Its owner may free it while the
   * storage still reports it (numpy's resize(refcheck=False)). */
  int borrowed;
} dp_torch_alloc_t;

#define DP_TORCH_MAX_ALLOCS 4

typedef struct dp_torch_api {
  int version;              /* DP_TORCH_API_VERSION */
  int has_cuda;             /* 1 when built against torch with CUDA */
  /* o's allocations when o is a torch.Tensor (any subclass): a dense tensor
   * gives its storage (views of one storage give the same base); a sparse
   * COO tensor its indices' and values' storages; sparse CSR/CSC/BSR/BSC its
   * index and values storages; a quantized tensor its storage, then for a
   * per-channel scheme its scales' and zero points' storages. Returns the count (1..DP_TORCH_MAX_ALLOCS),
   * 0 when o is not a torch tensor, -1 with a Python exception set when o is
   * a tensor whose memory cannot be described (a meta tensor, say). */
  int (*tensor_allocs)(PyObject *o, dp_torch_alloc_t *out);
  /* --- CUDA (NULL when has_cuda is 0); callable without the GIL --- */
  /* torch's current stream (cudaStream_t) on CUDA device `device` for the
   * calling thread. */
  void *(*current_stream)(int device);
  /* Makes `stream` (a cudaStream_t on `device`) torch's current stream on
   * that device for the calling thread; returns the one it replaces. */
  void *(*set_current_stream)(int device, void *stream);
  /* A stream from torch's pool on `device` (torch.cuda.Stream-like, never
   * destroyed). */
  void *(*pool_stream)(int device);
  /* Tells torch's caching allocator that the block starting at `base` on
   * `device` is used on `stream`. Returns 0 when recorded, 1 when the block is
   * not one of torch's allocator (nothing done). */
  int (*record_stream)(void *base, int device, void *stream);
  /* --- with the GIL --- */
  /* Reads a run of dense tensors at once: for items[0], items[1], ... in
   * turn — each a torch tensor (the caller checked its class derives from
   * torch's tensor base; not checked again) — while the item is a strided
   * tensor not dispatched to Python whose storage is cpu or cuda memory,
   * writes that storage, as tensor_allocs would, to out[i]. Stops at the
   * first other item, leaving it for tensor_allocs, which reads or reports
   * it. Returns how many items it read (0..n). Runs no Python code and
   * raises nothing, so the caller's items cannot change under it. */
  Py_ssize_t (*dense_run)(PyObject *const *items, Py_ssize_t n, dp_torch_alloc_t *out);
  /* --- loads, with the GIL --- */
  /* The tensors loads makes over a devpickle.Buffer, made without torch's
   * Python API, when `source` is a torch.Tensor or torch.nn.Parameter of
   * its exact type, strided and not dispatched to Python, whose storage
   * (cpu or cuda) starts at `ptr` and holds at least `nbytes` (> 0) bytes
   * — what Buffer.raw() checks —, and no torch function or dispatch mode
   * is active (torch's Python API would consult it):
   *  - dtype None (ndim, shape, strides, offset unused): raw()'s answer, a
   *    new flat uint8 base over the whole storage (as
   *    torch.empty(0).set_(storage) makes it, its version bumped once),
   *    sliced to its first `nbytes` bytes where it holds more;
   *  - dtype a torch.dtype: the view _frames.array makes from raw()'s
   *    answer, as_strided(flat[:whole items].view(dtype), shape, strides
   *    (in items, none negative), offset (items)), within the storage's
   *    bytes as torch.as_strided requires, made by those torch ops in the
   *    grad and inference modes of the moment; flat is source itself when
   *    it is such a flat tensor (uint8, 1-d, contiguous from its storage's
   *    start, `nbytes` long: the views of one buffer then share its
   *    version counter, as autograd needs), else a new one over source's
   *    storage (declined where source is a base made here and reshaped
   *    since).
   * Returns the tensor; NULL with no exception where it declines (any
   * condition above unmet): _frames.array then makes the tensor or says
   * why not; NULL with an exception on error (memory). Runs no Python
   * code. */
  PyObject *(*tensor_over)(PyObject *source, uintptr_t ptr, size_t nbytes, PyObject *dtype, int ndim,
                           const int64_t *shape, const int64_t *strides, int64_t offset);
} dp_torch_api_t;

#ifdef __cplusplus
}
#endif
#endif
