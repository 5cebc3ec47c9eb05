/*
 * torch_adapter.cpp — the optional C++ adapter devpickle._torch: answers the
 * questions of torch_api.h from libtorch's C++ objects directly, without a
 * Python call per tensor. Built by python/build_torch_adapter.py against the
 * installed torch (1.13 and 2.x headers); the extension falls back to torch's
 * Python API when this module is absent.
 *
 * The CUDA half is compiled only when the build defines DP_TORCH_CUDA (torch
 * built with CUDA and its c10/cuda headers present).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "torch_api.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/Layout.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <ATen/core/Tensor.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#if defined(DP_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cctype>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <exception>
#include <typeinfo>

namespace {

/* The C type of every torch tensor object: torch._C.TensorBase (2.x) or
 * torch._C._TensorBase (1.13). An object whose type derives from it is laid
 * out as a THPVariable, which is what makes THPVariable_Unpack sound on it.
 * (THPVariable_Check is not used: it calls PyObject_IsInstance, which looks
 * up __instancecheck__ on the metaclass — a bound-method allocation per call
 * — and which also accepts objects that merely claim the class through
 * __class__, on which THPVariable_Unpack would read garbage.) */
PyTypeObject *tensor_base_type = nullptr;
/* torch.Tensor and torch.nn.Parameter: the exact types of nearly every
 * tensor, checked before walking the MRO. */
PyTypeObject *tensor_type = nullptr;
PyTypeObject *parameter_type = nullptr;

constexpr int DP_DEVICE_CPU = 0;
constexpr int DP_DEVICE_CUDA = 1;

bool is_tensor(PyObject *o) {
  PyTypeObject *t = Py_TYPE(o);
  return t == tensor_type || t == parameter_type || t == tensor_base_type ||
         PyType_IsSubtype(t, tensor_base_type);
}

/* Layouts by their Python names (torch.sparse_coo, ...). */
std::string layout_name(c10::Layout l) {
  switch (l) {
    case c10::kStrided: return "torch.strided";
    case c10::kSparse: return "torch.sparse_coo";
    case c10::kSparseCsr: return "torch.sparse_csr";
    case c10::kSparseCsc: return "torch.sparse_csc";
    case c10::kSparseBsr: return "torch.sparse_bsr";
    case c10::kSparseBsc: return "torch.sparse_bsc";
    case c10::kMkldnn: return "torch._mkldnn";
    default: { /* torch.jagged (2.x) and whatever comes later */
      std::ostringstream os;
      os << l;
      std::string name = os.str();
      for (char &c : name)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

/* Sets the TypeError for a tensor whose memory cannot be described and
 * returns -1. Only on error paths: it builds strings. */
[[gnu::noinline, gnu::cold]] int fail(const at::Tensor &t, const char *why) {
  std::string dev = "unknown", lay = "unknown";
  try {
    dev = t.device().str();
  } catch (...) {
  }
  try {
    lay = layout_name(t.unsafeGetTensorImpl()->layout());
  } catch (...) {
  }
  PyErr_Format(PyExc_TypeError,
               "devpickle: cannot describe the memory of a torch tensor "
               "(layout %s, device %s): %s",
               lay.c_str(), dev.c_str(), why);
  return -1;
}

/* Whether memory with this deleter is torch's cpu allocator's: the default
 * allocator's deleter (which never changes) asked first, held after the
 * first call; the current allocator's (c10::SetCPUAllocator may replace
 * it) asked each time the first does not match. */
inline bool torch_cpu_deleter(c10::DeleterFnPtr d) {
  static const c10::DeleterFnPtr default_deleter = c10::GetDefaultCPUAllocator()->raw_deleter();
  return d == default_deleter || d == c10::GetCPUAllocator()->raw_deleter();
}

/* One dense tensor's storage into *out. Returns NULL, or why its memory
 * cannot be described (for fail() to report). No Python object, no Tensor
 * or Storage copy (no refcount traffic), no Python code. */
inline const char *dense_read(const at::Tensor &t, dp_torch_alloc_t *out) {
  const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
  /* storage() throws where torch forbids access (functional and fake
   * tensors, wrapper subclasses) and is empty where there is none. */
  const c10::Storage &s = impl->storage();
  if (C10_UNLIKELY(!s))
    return "it has no storage (a tensor subclass or a functional/fake tensor?)";
  const c10::DeviceType dt = s.device_type();
  const void *data = s.data();
  const size_t nbytes = s.nbytes();
  if (dt == c10::DeviceType::CPU) {
    out->device_type = DP_DEVICE_CPU;
    out->device_index = 0;
  } else if (dt == c10::DeviceType::CUDA) {
    out->device_type = DP_DEVICE_CUDA;
    out->device_index = s.device().index();
  } else {
    return dt == c10::DeviceType::Meta
               ? "its storage is on the meta device (a meta or fake tensor has no memory)"
               : "devpickle knows only cpu and cuda memory";
  }
  if (data == nullptr && nbytes != 0)
    return "its storage has a size but no data pointer (a wrapper tensor "
           "subclass keeps its data in other tensors)";
  out->base = const_cast<void *>(data);
  out->nbytes = nbytes;
  /* Memory from torch's cpu allocator is freed only with its storage (or
   * moved by resize_/set_, which the storage shows); any other deleter (the
   * context of from_blob, which from_numpy and frombuffer use) frees
   * memory whose owner torch does not hold to account. */
  out->borrowed = dt == c10::DeviceType::CPU && nbytes != 0 && !torch_cpu_deleter(s.data_ptr().get_deleter());
  return nullptr;
}

/* dense_read, its refusal a TypeError naming `whole` (t itself, or the
 * sparse tensor t belongs to). Returns 0 or -1. */
inline int dense_alloc(const at::Tensor &t, const at::Tensor &whole, dp_torch_alloc_t *out) {
  const char *why = dense_read(t, out);
  return C10_LIKELY(why == nullptr) ? 0 : fail(whole, why);
}

/* torch's layout(), inlined here (an out-of-line call goes through the PLT,
 * libc10 exporting it). */
[[gnu::flatten]] inline c10::Layout layout_of(const c10::TensorImpl *impl) {
  return impl->layout();
}

/* The allocations of a sparse tensor (an out-of-line cold path). */
[[gnu::noinline]] int sparse_allocs(const at::Tensor &t, c10::Layout layout,
                                    dp_torch_alloc_t *out);

/* The allocations of a quantized tensor (an out-of-line cold path): its
 * storage, and for a per-channel scheme its quantizer's scales and zero
 * points, tensors of their own that pickle carries beside the data (its
 * reduce's quantizer parameters) and every kernel reading the values reads. */
[[gnu::noinline]] int quantized_allocs(const at::Tensor &t, dp_torch_alloc_t *out);

inline int tensor_allocs_impl(PyObject *o, dp_torch_alloc_t *out) {
  const at::Tensor &t = THPVariable_Unpack(o);
  if (!t.defined()) {
    PyErr_SetString(PyExc_TypeError,
                    "devpickle: cannot describe the memory of an undefined torch tensor");
    return -1;
  }
  const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
  const c10::Layout layout = layout_of(impl);
  if (C10_LIKELY(layout == c10::kStrided))
    return C10_UNLIKELY(impl->is_quantized()) ? quantized_allocs(t, out) : dense_alloc(t, t, out) == 0 ? 1 : -1;
  return sparse_allocs(t, layout, out);
}

int quantized_allocs(const at::Tensor &t, dp_torch_alloc_t *out) {
  if (dense_alloc(t, t, out) != 0)
    return -1;
  const c10::QScheme q = t.qscheme();
  if (q != c10::kPerChannelAffine && q != c10::kPerChannelSymmetric &&
      q != c10::kPerChannelAffineFloatQParams)
    return 1; /* per tensor: the scale and zero point are numbers */
  /* the quantizer's own tensors (aliases, never copies) */
  const at::Tensor parts[2] = {t.q_per_channel_scales(), t.q_per_channel_zero_points()};
  int n = 1;
  for (const at::Tensor &p : parts)
    if (dense_alloc(p, t, &out[n++]) != 0)
      return -1;
  return n;
}

int sparse_allocs(const at::Tensor &t, c10::Layout layout, dp_torch_alloc_t *out) {
  /* The index and values tensors below are the sparse tensor's own members
   * (aliases, never copies): _indices()/_values() do not coalesce. */
  at::Tensor parts[2];
  switch (layout) {
    case c10::kSparse:
      parts[0] = t._indices();
      parts[1] = t._values();
      break;
    case c10::kSparseCsr:
    case c10::kSparseBsr:
      parts[0] = t.crow_indices();
      parts[1] = t.col_indices();
      break;
    case c10::kSparseCsc:
    case c10::kSparseBsc:
      parts[0] = t.ccol_indices();
      parts[1] = t.row_indices();
      break;
    default:
      return fail(t, "devpickle knows only strided and sparse layouts");
  }
  int n = 0;
  for (const at::Tensor &p : parts)
    if (dense_alloc(p, t, &out[n++]) != 0)
      return -1;
  if (layout != c10::kSparse) {
    at::Tensor v = t.values();
    if (dense_alloc(v, t, &out[n++]) != 0)
      return -1;
  }
  return n;
}

extern "C" int dp_tensor_allocs(PyObject *o, dp_torch_alloc_t *out) {
  if (!is_tensor(o))
    return 0;
  try {
    return tensor_allocs_impl(o, out);
  } catch (python_error &e) {
    e.restore(); /* a tensor subclass's Python code raised */
    return -1;
  } catch (const c10::Error &e) {
    return fail(THPVariable_Unpack(o), e.what_without_backtrace());
  } catch (const std::exception &e) {
    PyErr_Format(PyExc_TypeError,
                 "devpickle: cannot describe the memory of a torch tensor: %s", e.what());
    return -1;
  }
}

/* The run reader of torch_api.h. A tensor dispatched to Python (a
 * __torch_dispatch__ subclass, whose layout or storage may be answered by
 * Python code) ends the run before anything of it is read, so no Python
 * code runs here; a c10 error (a storage torch forbids to read) ends it
 * too, at that item, and tensor_allocs reports it when the caller asks. */
extern "C" Py_ssize_t dp_dense_run(PyObject *const *items, Py_ssize_t n, dp_torch_alloc_t *out) {
  Py_ssize_t i = 0;
  try {
    for (; i < n; i++) {
      const at::Tensor &t = THPVariable_Unpack(items[i]);
      if (C10_UNLIKELY(!t.defined()))
        break;
      const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
      if (C10_UNLIKELY(impl->is_python_dispatch()) || layout_of(impl) != c10::kStrided ||
          C10_UNLIKELY(impl->is_quantized()) || dense_read(t, &out[i]) != nullptr)
        break;
    }
  } catch (...) {
  }
  return i;
}

/* Whether torch's Python API would consult a mode: a torch function mode
 * or a dispatch mode is active on this thread. */
inline bool modes_active() {
#if TORCH_VERSION_MAJOR >= 2
  return at::impl::torch_function_mode_enabled() || c10::impl::dispatch_mode_enabled();
#else
  return at::impl::function_mode_enabled() || c10::impl::dispatch_mode_enabled();
#endif
}

/* The base tensor tensor_over makes over a storage, as Buffer.raw()'s
 * torch.empty(0, dtype=torch.uint8).set_(storage) is: flat uint8 over the
 * whole storage, its version counter bumped once (set_ is an in-place op).
 * A class of its own only so that tensor_over knows its own bases again
 * (to leave one changed since to _frames): it overrides nothing, and views
 * of it are plain TensorImpls. */
struct FlatBase final : c10::TensorImpl {
  using c10::TensorImpl::TensorImpl;
};

bool is_flat_base(const c10::TensorImpl *impl) {
  return typeid(*impl) == typeid(FlatBase);
}

at::Tensor make_flat_base(const c10::Storage &s) {
  const c10::DispatchKey key =
      s.device_type() == c10::DeviceType::CPU ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA;
  at::Tensor b = at::detail::make_tensor<FlatBase>(c10::Storage(s), c10::DispatchKeySet(key),
                                                   c10::scalarTypeToTypeMeta(c10::ScalarType::Byte));
  const int64_t n = static_cast<int64_t>(s.nbytes());
  b.unsafeGetTensorImpl()->set_sizes_contiguous(c10::IntArrayRef(&n, 1));
  if (!b.is_inference()) /* an inference tensor has no version counter */
    b.unsafeGetTensorImpl()->bump_version();
  return b;
}

/* torch_api.h's tensor_over: the checks of Buffer.raw() and of as_strided's
 * bounds (checkInBoundsForStorage: an empty view is not bounded), made here
 * so that what torch would refuse is declined without a C++ exception; then
 * the tensors themselves made by the torch ops _frames makes them with
 * (slicing, view(dtype), as_strided), so that they are views of one base,
 * sharing its version counter as autograd requires (an in-place write
 * through one view is seen by a backward that saved another), made as the
 * grad and inference modes of the moment make them. */
extern "C" PyObject *dp_tensor_over(PyObject *source, uintptr_t ptr, size_t nbytes, PyObject *dtype, int ndim,
                                    const int64_t *shape, const int64_t *strides, int64_t offset) {
  const bool flat = dtype == Py_None;
  if ((Py_TYPE(source) != tensor_type && Py_TYPE(source) != parameter_type) || (!flat && !THPDtype_Check(dtype)) ||
      nbytes == 0 || nbytes > static_cast<size_t>(INT64_MAX) || ndim < 0 || offset < 0 || modes_active())
    return nullptr;
  const c10::ScalarType st = flat ? c10::ScalarType::Byte : reinterpret_cast<THPDtype *>(dtype)->scalar_type;
  try {
    const at::Tensor &t = THPVariable_Unpack(source);
    if (!t.defined())
      return nullptr;
    const c10::TensorImpl *impl = t.unsafeGetTensorImpl();
    if (impl->is_python_dispatch() || layout_of(impl) != c10::kStrided)
      return nullptr;
    const c10::Storage &s = impl->storage(); /* throws for functional and fake tensors */
    if (!s || reinterpret_cast<uintptr_t>(s.data()) != ptr || s.nbytes() < nbytes)
      return nullptr;
    const c10::DeviceType dt = s.device_type();
    if (dt != c10::DeviceType::CPU && dt != c10::DeviceType::CUDA)
      return nullptr;
    if (flat) {
      /* raw(): base[:nbytes]; the base itself where that is all of it,
       * so that the views made of it know it in any grad or inference
       * mode (an inference tensor's slice does not know its base): the
       * views are the same, raw()'s own answer being seen by no one */
      at::Tensor b = make_flat_base(s);
      return THPVariable_Wrap(nbytes < s.nbytes() ? b.slice(0, 0, static_cast<int64_t>(nbytes)) : std::move(b));
    }
    const uint64_t isz = c10::elementSize(st);
    /* the bytes the view reaches: (offset + sum (shape-1)*stride + 1) items */
    uint64_t last = static_cast<uint64_t>(offset);
    bool empty = false;
    for (int i = 0; i < ndim; i++) {
      if (shape[i] < 0 || strides[i] < 0)
        return nullptr;
      if (shape[i] == 0)
        empty = true;
    }
    if (!empty) {
      for (int i = 0; i < ndim; i++) {
        uint64_t step;
        if (__builtin_mul_overflow(static_cast<uint64_t>(shape[i] - 1), static_cast<uint64_t>(strides[i]), &step) ||
            __builtin_add_overflow(last, step, &last))
          return nullptr;
      }
      uint64_t need;
      if (__builtin_add_overflow(last, uint64_t{1}, &last) || __builtin_mul_overflow(last, isz, &need) ||
          need > s.nbytes())
        return nullptr;
    }
    /* the flat tensor the view is made of, as _frames._array makes it of
     * raw()'s: source itself when it is one (uint8, 1-d, contiguous from
     * its storage's start, nbytes long: what dtype None makes, which
     * frames.c passes), so that the views of one buffer are made of one
     * tensor in the modes of the moment; one made here from a flat tensor
     * reshaped since (torch 2's loaded views show it as their _base, which
     * code run between two views can resize_ or set_) is left to _frames;
     * else a new one over source's storage */
    const c10::TensorImpl *fi = impl;
    at::Tensor flat_t;
    if (fi->dtype() == caffe2::TypeMeta::Make<uint8_t>() && fi->dim() == 1 && fi->strides()[0] == 1 &&
        fi->storage_offset() == 0 && fi->sizes()[0] == static_cast<int64_t>(nbytes)) {
      flat_t = t;
    } else if (is_flat_base(impl) ||
               (t.is_view() && t._base().defined() && is_flat_base(t._base().unsafeGetTensorImpl()))) {
      return nullptr;
    } else {
      flat_t = make_flat_base(s);
      if (nbytes < s.nbytes())
        flat_t = flat_t.slice(0, 0, static_cast<int64_t>(nbytes));
    }
    /* _frames._array: (flat[:whole items] where a part item ends it)
     * .view(dtype), then as_strided */
    const int64_t whole = static_cast<int64_t>(nbytes - nbytes % isz);
    const at::Tensor typed = (whole < static_cast<int64_t>(nbytes) ? flat_t.slice(0, 0, whole) : flat_t).view(st);
    at::Tensor r = typed.as_strided(c10::IntArrayRef(shape, static_cast<size_t>(ndim)),
                                    c10::IntArrayRef(strides, static_cast<size_t>(ndim)), offset);
    return THPVariable_Wrap(std::move(r));
  } catch (...) {
    return nullptr;
  }
}

#if defined(DP_TORCH_CUDA)
/* Streams seen by this thread, so that handing a stream back (a pool stream,
 * or the one set_current_stream replaced) restores torch's own CUDAStream —
 * its stream id, so torch.cuda.current_stream() == s still holds — rather
 * than an external wrapper of the same handle. An entry whose (device,
 * handle) matches names the same cudaStream_t, so a stale entry is harmless.
 * Plain data: no TLS constructor, no guard. */
struct seen_stream {
  void *handle;
  int64_t id;
  int device;
};
constexpr unsigned SEEN_STREAMS = 16;
thread_local seen_stream seen[SEEN_STREAMS];
thread_local unsigned seen_count = 0;
thread_local unsigned seen_next = 0;

void remember(int device, const c10::cuda::CUDAStream &s) {
  void *h = reinterpret_cast<void *>(s.stream());
  for (unsigned i = 0; i < seen_count; i++) {
    if (seen[i].device == device && seen[i].handle == h) {
      seen[i].id = s.id();
      return;
    }
  }
  seen[seen_next] = seen_stream{h, static_cast<int64_t>(s.id()), device};
  seen_next = (seen_next + 1) % SEEN_STREAMS;
  if (seen_count < SEEN_STREAMS)
    seen_count++;
}

c10::cuda::CUDAStream stream_for(int device, void *handle) {
  const c10::DeviceIndex dev = static_cast<c10::DeviceIndex>(device);
  for (unsigned i = 0; i < seen_count; i++) {
    if (seen[i].device == device && seen[i].handle == handle)
      return c10::cuda::CUDAStream(
          c10::cuda::CUDAStream::UNCHECKED,
          c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, dev),
                      static_cast<c10::StreamId>(seen[i].id)));
  }
  return c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(handle), dev);
}

/* These run without the GIL and cannot raise: a torch error (a bad device
 * index, no GPU) answers NULL — which is also the legacy default stream's
 * handle, so callers pass only devices that exist. */
extern "C" void *dp_current_stream(int device) {
  try {
    return reinterpret_cast<void *>(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  } catch (...) {
    return nullptr;
  }
}

extern "C" void *dp_set_current_stream(int device, void *stream) {
  try {
    c10::cuda::CUDAStream prev =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    remember(device, prev);
    c10::cuda::setCurrentCUDAStream(stream_for(device, stream));
    return reinterpret_cast<void *>(prev.stream());
  } catch (...) {
    return nullptr;
  }
}

extern "C" void *dp_pool_stream(int device) {
  try {
    c10::cuda::CUDAStream s =
        c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
    remember(device, s);
    return reinterpret_cast<void *>(s.stream());
  } catch (...) {
    return nullptr;
  }
}

/* recordStream takes a DataPtr and does something only when its deleter is
 * the allocator's own (raw_deleter(): local_raw_delete for the native caching
 * allocator, its own for the cudaMallocAsync backend); it then looks the DATA
 * pointer up among the allocator's live blocks and throws (TORCH_CHECK /
 * TORCH_INTERNAL_ASSERT "No allocated block can be found") when it is not
 * one, having changed nothing. So a DataPtr of (data = base, ctx = NULL,
 * deleter = raw_deleter()) asks exactly the question we mean: "is base a
 * block of yours? then record it". It is sound because:
 *  - the context is NULL, so destroying the DataPtr calls no deleter (a
 *    unique_ptr never calls its deleter on NULL): nothing is freed, on the
 *    normal path or when recordStream throws;
 *  - only the data pointer is read, and it is compared for equality with the
 *    allocator's block addresses: an interior or foreign pointer is not found
 *    (the exception, answered 1 here), never misread;
 *  - when caching is disabled (PYTORCH_NO_CUDA_MEMORY_CACHING) raw_deleter()
 *    is the uncached deleter and recordStream does nothing; that memory is
 *    freed with cudaFree, which waits for the device, so 0 is still true.
 * The caller keeps the tensor alive while it records, so base cannot be freed
 * and reused under us. The foreign-pointer path costs a C++ exception (a few
 * microseconds: torch captures a backtrace); torch's own blocks do not. */
extern "C" int dp_record_stream(void *base, int device, void *stream) {
  if (base == nullptr)
    return 1;
  try {
    auto *alloc = c10::cuda::CUDACachingAllocator::get();
    if (alloc == nullptr)
      return 1;
    const c10::DataPtr probe(base, nullptr, alloc->raw_deleter(),
                             c10::Device(c10::DeviceType::CUDA,
                                         static_cast<c10::DeviceIndex>(device)));
    c10::cuda::CUDACachingAllocator::recordStream(probe, stream_for(device, stream));
    return 0;
  } catch (...) {
    return 1;
  }
}
#endif /* DP_TORCH_CUDA */

dp_torch_api_t api_table = {
    DP_TORCH_API_VERSION,
#if defined(DP_TORCH_CUDA)
    1,
    dp_tensor_allocs,
    dp_current_stream,
    dp_set_current_stream,
    dp_pool_stream,
    dp_record_stream,
    dp_dense_run,
    dp_tensor_over,
#else
    0,
    dp_tensor_allocs,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    dp_dense_run,
    dp_tensor_over,
#endif
};

/* _time_tensor_allocs(seq, repeat) -> nanoseconds per tensor_allocs call,
 * looping in C over the items of the list or tuple seq `repeat` times. For
 * benchmarks only. */
PyObject *time_tensor_allocs(PyObject *, PyObject *args) {
  PyObject *seq;
  Py_ssize_t repeat;
  if (!PyArg_ParseTuple(args, "On:_time_tensor_allocs", &seq, &repeat))
    return nullptr;
  PyObject *fast = PySequence_Fast(seq, "_time_tensor_allocs: expected a sequence");
  if (fast == nullptr)
    return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject **items = PySequence_Fast_ITEMS(fast);
  dp_torch_alloc_t out[DP_TORCH_MAX_ALLOCS];
  volatile size_t sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (Py_ssize_t r = 0; r < repeat; r++) {
    for (Py_ssize_t i = 0; i < n; i++) {
      int k = api_table.tensor_allocs(items[i], out);
      if (k < 0) {
        Py_DECREF(fast);
        return nullptr;
      }
      if (k > 0)
        sink = sink + out[0].nbytes;
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  Py_DECREF(fast);
  const double calls = static_cast<double>(n) * static_cast<double>(repeat);
  const double ns =
      std::chrono::duration<double, std::nano>(t1 - t0).count();
  return PyFloat_FromDouble(calls > 0 ? ns / calls : 0.0);
}

PyMethodDef methods[] = {
    {"_time_tensor_allocs", time_tensor_allocs, METH_VARARGS,
     "_time_tensor_allocs(seq, repeat) -> ns per tensor_allocs call (benchmark)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "devpickle._torch",
    "devpickle's adapter to libtorch: the table of torch_api.h as capsule _api.",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

} // namespace

/* A new reference to the type module.name, or NULL (and an exception). */
static PyTypeObject *get_type(const char *module, const char *name) {
  PyObject *mod = PyImport_ImportModule(module);
  if (mod == nullptr)
    return nullptr;
  PyObject *t = PyObject_GetAttrString(mod, name);
  Py_DECREF(mod);
  if (t != nullptr && !PyType_Check(t)) {
    PyErr_Format(PyExc_ImportError, "devpickle._torch: %s.%s is not a type", module, name);
    Py_CLEAR(t);
  }
  return reinterpret_cast<PyTypeObject *>(t);
}

PyMODINIT_FUNC PyInit__torch(void) {
  /* Importing torch initializes it; the type references are kept for the
   * life of the process (torch is never unloaded). */
  if (tensor_base_type == nullptr) {
    PyTypeObject *base = get_type("torch._C", "TensorBase"); /* 2.x */
    if (base == nullptr) {
      PyErr_Clear();
      base = get_type("torch._C", "_TensorBase"); /* 1.13 */
    }
    if (base == nullptr)
      return nullptr;
    PyTypeObject *tensor = get_type("torch", "Tensor");
    PyTypeObject *param = tensor ? get_type("torch.nn", "Parameter") : nullptr;
    if (param == nullptr || !PyType_IsSubtype(tensor, base) || !PyType_IsSubtype(param, base)) {
      if (param != nullptr)
        PyErr_SetString(PyExc_ImportError,
                        "devpickle._torch: torch.Tensor does not derive from torch._C.TensorBase");
      Py_DECREF(base);
      Py_XDECREF(tensor);
      Py_XDECREF(param);
      return nullptr;
    }
    tensor_base_type = base;
    tensor_type = tensor;
    parameter_type = param;
  }

  PyObject *m = PyModule_Create(&module_def);
  if (m == nullptr)
    return nullptr;
  PyObject *cap = PyCapsule_New(&api_table, DP_TORCH_API_CAPSULE, nullptr);
  if (cap == nullptr || PyModule_AddObject(m, "_api", cap) < 0) {
    Py_XDECREF(cap);
    Py_DECREF(m);
    return nullptr;
  }
  if (PyModule_AddIntConstant(m, "has_cuda", api_table.has_cuda) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
