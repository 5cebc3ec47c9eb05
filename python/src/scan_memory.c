/*
 * scan_memory.c — the memory a value holds, read where each kind keeps it:
 * torch tensors and storages (the adapter, else torch's Python API), cupy
 * arrays, __cuda_array_interface__ and __array_interface__, DLPack
 * producers, the buffer protocol (numpy) (scan_memory.h).
 */
#include "scan_memory.h"
#include "scan_classify.h"
#include "scan_path.h"
#include "scan_reduce.h"

#include <string.h>

static int torch_python_allocs(PyObject *t, dp_torch_alloc_t *out, int depth);

static int is_storage(PyObject *o) {
  for (int i = 0; i < 2; i++)
    if (dpy.torch_storage[i] && PyObject_TypeCheck(o, dpy.torch_storage[i])) return 1;
  return 0;
}

/* torch.UntypedStorage's own attribute `name` (its C base's descriptor),
 * read from st: a Python subclass of the storage (or of the tensor that
 * handed it out) may override data_ptr, nbytes or device to name any
 * address, which an inline frame would then copy. Borrowed; NULL with an
 * exception. */
static PyObject *storage_descr(int i) {
  static const char *const names[3] = {"data_ptr", "nbytes", "device"};
  static PyObject *d[3]; /* torch is never unloaded */
  if (!d[i] && dpy.torch_storage[1]) d[i] = PyObject_GetAttrString((PyObject *)dpy.torch_storage[1], names[i]);
  if (!d[i] && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "torch.UntypedStorage was not found");
  return d[i];
}

static PyObject *storage_get(PyObject *st, int i) {
  PyObject *d = storage_descr(i);
  if (!d) return NULL;
  if (i == 2) { /* device: a getset */
    descrgetfunc get = Py_TYPE(d)->tp_descr_get;
    return get ? get(d, st, (PyObject *)Py_TYPE(st)) : PyObject_GetAttrString(st, "device");
  }
  return PyObject_CallOneArg(d, st);
}

/* fn(arg) — or, for a getset descriptor, its get on arg — with torch's
 * __torch_function__ dispatch off: a tensor subclass, or an active
 * TorchFunctionMode, would otherwise answer untyped_storage(), layout or
 * values() of the tensor with another tensor's, whose memory the walk would
 * report (and an inline frame copy) in place of its own, where the adapter
 * reads the tensor itself. torch 2's DisableTorchFunction turns modes off
 * too; torch 1's leaves them on (docs/PYTHON.md). A new reference, or NULL
 * with an exception. */
static PyObject *torch_call(PyObject *fn, PyObject *arg) {
  static PyObject *off;   /* torch._C.DisableTorchFunction */
  static PyObject *modes; /* torch._C._len_torch_function_stack, or None where torch has none */
  descrgetfunc get = PyObject_TypeCheck(fn, &PyGetSetDescr_Type) ? Py_TYPE(fn)->tp_descr_get : NULL;
  if (!off) {
    PyObject *c = PyImport_ImportModule("torch._C");
    if (!c) return NULL;
    off = PyObject_GetAttrString(c, "DisableTorchFunction");
    if (off && !(modes = PyObject_GetAttrString(c, "_len_torch_function_stack"))) {
      PyErr_Clear();
      modes = Py_NewRef(Py_None);
    }
    Py_DECREF(c);
    if (!off) return NULL;
  }
  /* torch's own classes dispatch to no __torch_function__ of their own:
     called as they are while no mode is pushed */
  if (Py_IS_TYPE(arg, dpy.torch_tensor) || (PyObject *)Py_TYPE(arg) == dpy.torch_tensor_cls) {
    PyObject *n = modes != Py_None ? PyObject_CallNoArgs(modes) : NULL;
    if (!n && modes != Py_None) return NULL;
    int none = n && PyLong_Check(n) && PyLong_AsLong(n) == 0;
    Py_XDECREF(n);
    if (none) return get ? get(fn, arg, (PyObject *)Py_TYPE(arg)) : PyObject_CallOneArg(fn, arg);
  }
  PyObject *ctx = PyObject_CallNoArgs(off);
  PyObject *entered = ctx ? PyObject_CallMethod(ctx, "__enter__", NULL) : NULL;
  if (!entered) {
    Py_XDECREF(ctx);
    return NULL;
  }
  Py_DECREF(entered);
  PyObject *r = get ? get(fn, arg, (PyObject *)Py_TYPE(arg)) : PyObject_CallOneArg(fn, arg);
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb); /* __exit__ runs with none set; the call's error is kept */
  PyObject *exited = PyObject_CallMethod(ctx, "__exit__", "OOO", Py_None, Py_None, Py_None);
  Py_DECREF(ctx);
  if (!exited) {
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    Py_XDECREF(r);
    return NULL;
  }
  Py_DECREF(exited);
  PyErr_Restore(et, ev, tb);
  return r;
}

/* torch.Tensor's own attribute `name` (its C base's descriptor or method),
 * read on tensor t through torch_call: a subclass's property or method of
 * that name is not asked. */
static PyObject *tensor_get(PyObject *t, const char *name) {
  PyObject *fn = PyObject_GetAttrString((PyObject *)dpy.torch_tensor, name);
  PyObject *r = fn ? torch_call(fn, t) : NULL;
  Py_XDECREF(fn);
  return r;
}

/* The device of UntypedStorage st, found on t (a tensor, or a storage:
 * how errors word it). */
static int device_from_torch(PyObject *st, PyObject *t, dp_torch_alloc_t *a) {
  PyObject *dev = storage_get(st, 2);
  if (!dev) return -1;
  PyObject *type = PyObject_GetAttrString(dev, "type");
  PyObject *index = type ? PyObject_GetAttrString(dev, "index") : NULL;
  Py_DECREF(dev);
  if (!index) {
    Py_XDECREF(type);
    return -1;
  }
  const char *ts = PyUnicode_AsUTF8(type);
  int rc = 0;
  if (ts && !strcmp(ts, "cpu")) {
    a->device_type = DP_DEVICE_CPU;
    a->device_index = 0;
  } else if (ts && !strcmp(ts, "cuda")) {
    a->device_type = DP_DEVICE_CUDA;
    a->device_index = index == Py_None ? 0 : (int)PyLong_AsLong(index);
  } else if (ts && !is_storage(t)) { /* worded as the adapter words it */
    PyObject *layout = tensor_get(t, "layout");
    PyObject *ls = layout ? PyObject_Str(layout) : NULL;
    const char *l = ls ? PyUnicode_AsUTF8(ls) : NULL;
    if (l)
      PyErr_Format(PyExc_TypeError,
                   "devpickle: cannot describe the memory of a torch tensor (layout %s, device %s): %s", l, ts,
                   !strcmp(ts, "meta") ? "its storage is on the meta device (a meta or fake tensor has no memory)"
                                       : "devpickle knows only cpu and cuda memory");
    Py_XDECREF(layout);
    Py_XDECREF(ls);
    rc = -1;
  } else {
    if (ts) PyErr_Format(PyExc_TypeError, "a storage on device type '%s' has no memory devpickle can track", ts);
    rc = -1;
  }
  Py_DECREF(type);
  Py_DECREF(index);
  return rc;
}

/* The UntypedStorage under tensor or TypedStorage o (new reference): torch
 * 2's o.dpy_untyped_storage(), torch 1.13's o.storage()._storage. A C type's
 * methods (its data_ptr and nbytes run no Python code). Which torch this is
 * is asked of torch's tensor class, never of o: a subclass's __getattr__ is
 * not run for it. */
PyObject *dpy_untyped_storage(PyObject *o) {
  static int torch2 = -1;
  static PyObject *method; /* the tensor's C method: a subclass's override of storage() is not asked */
  if (torch2 < 0) torch2 = PyObject_HasAttrString((PyObject *)dpy.torch_tensor, "untyped_storage");
  if (!dpy.torch_storage[1]) {
    PyErr_SetString(PyExc_TypeError, "torch.UntypedStorage was not found");
    return NULL;
  }
  PyObject *u;
  if (PyObject_TypeCheck(o, dpy.torch_storage[1])) return Py_NewRef(o);
  if (dpy.torch_storage[0] && PyObject_TypeCheck(o, dpy.torch_storage[0])) {
    u = Py_NewRef(o);
  } else {
    if (!method && !(method = PyObject_GetAttrString((PyObject *)dpy.torch_tensor,
                                                     torch2 ? "untyped_storage" : "_storage")))
      return NULL;
    u = torch_call(method, o);
  }
  /* a TypedStorage (what torch 1.13's dispatch gives for a subclass) wraps the untyped one */
  if (u && dpy.torch_storage[0] && PyObject_TypeCheck(u, dpy.torch_storage[0]))
    Py_SETREF(u, PyObject_GetAttrString(u, torch2 ? "_untyped_storage" : "_storage"));
  if (u && !PyObject_TypeCheck(u, dpy.torch_storage[1])) {
    PyErr_Format(PyExc_TypeError, "its storage is a '%.200s', not a torch.UntypedStorage", Py_TYPE(u)->tp_name);
    Py_CLEAR(u);
  }
  return u;
}

/* An UntypedStorage's base and size, read through torch's own methods. 0,
 * or -1 with an exception. */
int dpy_storage_extent(PyObject *st, dp_torch_alloc_t *out) {
  PyObject *ptr = storage_get(st, 0);
  PyObject *nb = ptr ? storage_get(st, 1) : NULL;
  if (nb) {
    out->base = PyLong_AsVoidPtr(ptr);
    out->nbytes = PyLong_AsSize_t(nb);
  }
  Py_XDECREF(ptr);
  Py_XDECREF(nb);
  return PyErr_Occurred() ? -1 : 0;
}

/* Whether tensor t is quantized with a per-channel scheme, whose scales
 * and zero points are tensors of their own: 1, 0, or -1 with an exception. */
static int per_channel_quantized(PyObject *t) {
  PyObject *isq = tensor_get(t, "is_quantized");
  int q = isq ? PyObject_IsTrue(isq) : -1;
  Py_XDECREF(isq);
  if (q <= 0) return q;
  PyObject *scheme = tensor_get(t, "qscheme");
  PyObject *ss = scheme ? PyObject_Str(scheme) : NULL;
  Py_XDECREF(scheme);
  const char *n = ss ? PyUnicode_AsUTF8(ss) : NULL;
  q = n ? !strncmp(n, "torch.per_channel", 17) : -1;
  Py_XDECREF(ss);
  return q;
}

/* Without the C++ adapter: the same answers through torch's Python API. */
static int torch_python_allocs(PyObject *t, dp_torch_alloc_t *out, int depth) {
  if (depth == 0) {
    /* sparse layouts: their member tensors, in the adapter's order */
    static const char *const coo[] = {"_indices", "_values", NULL};
    static const char *const csr[] = {"crow_indices", "col_indices", "values", NULL};
    static const char *const csc[] = {"ccol_indices", "row_indices", "values", NULL};
    PyObject *layout = tensor_get(t, "layout");
    PyObject *ls = layout ? PyObject_Str(layout) : NULL;
    Py_XDECREF(layout);
    const char *l = ls ? PyUnicode_AsUTF8(ls) : NULL;
    if (!l) {
      Py_XDECREF(ls);
      return -1;
    }
    const char *const *parts = !strcmp(l, "torch.sparse_coo")                                   ? coo
                               : !strcmp(l, "torch.sparse_csr") || !strcmp(l, "torch.sparse_bsr") ? csr
                               : !strcmp(l, "torch.sparse_csc") || !strcmp(l, "torch.sparse_bsc") ? csc
                                                                                                  : NULL;
    Py_DECREF(ls);
    if (!parts) { /* a per-channel quantized tensor: its storage, its scales and zero points */
      static const char *const qch[] = {"", "q_per_channel_scales", "q_per_channel_zero_points", NULL}; /* "": t */
      int q = per_channel_quantized(t);
      if (q < 0) return -1;
      if (q) parts = qch;
    }
    if (parts) {
      int n = 0;
      for (int i = 0; parts[i]; i++) {
        PyObject *p = *parts[i] ? tensor_get(t, parts[i]) : Py_NewRef(t);
        if (!p) return -1;
        int k = torch_python_allocs(p, out + n, 1);
        Py_DECREF(p);
        if (k < 0) return -1;
        n += k;
      }
      return n;
    }
  }
  PyObject *st = dpy_untyped_storage(t);
  if (!st) return -1;
  int rc = dpy_storage_extent(st, out) || device_from_torch(st, t, out);
  Py_DECREF(st);
  if (rc) return -1;
  out->borrowed = out->device_type == DP_DEVICE_CPU; /* torch's Python API does not say whose memory it is */
  return 1;
}

/* The allocations of tensor t (the adapter's answer, or torch's Python
 * API's): their number, or -1 with an exception. */
int dpy_torch_allocs(PyObject *t, dp_torch_alloc_t *out) {
  return dpy.torch ? dpy.torch->tensor_allocs(t, out) : torch_python_allocs(t, out, 0);
}

int dpy_is_torch(PyObject *o) { return dpy.torch_tensor && PyObject_TypeCheck(o, dpy.torch_tensor); }

/* A tensor's state beyond its memory: what a reduce of its own returns
 * (the memory is reported all the same: a future that waits on more than
 * it needs costs nothing), else its own __getstate__'s, else its __dict__
 * and the slots that are set. */
int dpy_visit_tensor_attrs(dpy_scanner_t *s, PyObject *o) {
  int own = dpy_own_tensor_reduce(o);
  if (own < 0) return dpy_walk_error(s, o, "its reduce cannot be looked up");
  if (own) {
    int sn = dpy_seen(s, o); /* entered once, as its attributes below */
    return sn ? (sn < 0 ? -1 : 0) : dpy_enter_reduce(s, o);
  }
  if (dpy_own_getstate(Py_TYPE(o))) {
    int sn = dpy_seen(s, o); /* entered once, as its attributes below */
    return sn ? (sn < 0 ? -1 : 0) : dpy_push_own_state(s, o);
  }
  PyObject **dp = _PyObject_GetDictPtr(o);
  if (!dp && PyErr_Occurred()) return dpy_walk_error(s, o, "its __dict__ cannot be read");
  PyObject *d = dp ? *dp : NULL;
  if (d && !PyDict_Check(d)) d = NULL;
  if (dpy_tensor_slots(s, o, &d)) return -1;
  if (!d || !PyDict_GET_SIZE(d)) return 0;
  int sn = dpy_seen(s, o); /* the tensor skipped the memo: its attributes are entered once (t.me = t) */
  if (sn) return sn < 0 ? -1 : 0;
  return dpy_push(s, FR_ATTRS, d, Py_TYPE(o));
}

int dpy_visit_torch(dpy_scanner_t *s, PyObject *o) {
  dp_torch_alloc_t a[DP_TORCH_MAX_ALLOCS];
  int n = dpy_torch_allocs(o, a);
  if (n < 0) return dpy_walk_error(s, o, "a tensor whose memory cannot be described");
  for (int i = 0; i < n; i++) {
    /* an empty storage holds no memory, wherever it points: torch.from_numpy
       of an empty view points at the array's own memory, whose allocation
       it would otherwise join (its path the first, one more in its refs) */
    if (!a[i].nbytes) continue;
    if (add_alloc(s, (dp_device_t){(dp_device_type_t)a[i].device_type, a[i].device_index}, a[i].base, a[i].nbytes, o))
      return -1;
  }
  return dpy_visit_tensor_attrs(s, o);
}

/* A future (devpickle's, torch's) or a CUDA event holds no memory of its
 * own: a future's value is reached through its own wait(), which orders
 * the caller after the future's events, and an event is a position on a
 * stream. torch's extractor skips both; pickle refuses both (so does
 * dumps: dpy_build_visit reduces it). What a subclass or the instance adds —
 * its __dict__ and the slots that are set — is walked as attributes. */
int dpy_visit_sync(dpy_scanner_t *s, PyObject *o) {
  PyObject *d;
  if (dpy_subclass_attrs(s, o, K_SYNC, &d)) return -1;
  return d && PyDict_GET_SIZE(d) ? dpy_push(s, FR_ATTRS, d, Py_TYPE(o)) : 0;
}

/* A torch storage, typed or untyped (t.storage(), t.dpy_untyped_storage()):
 * its memory, as a tensor's, read without its __reduce__ (which would copy
 * it through torch.save). */
int dpy_visit_storage(dpy_scanner_t *s, PyObject *o) {
  dp_torch_alloc_t a;
  PyObject *st = dpy_untyped_storage(o);
  int rc = st ? dpy_storage_extent(st, &a) || device_from_torch(st, o, &a) : -1;
  Py_XDECREF(st);
  if (rc) return dpy_walk_error(s, o, "a storage whose memory cannot be described");
  if (!a.nbytes) return 0; /* an empty storage holds no memory, wherever it points (dpy_visit_torch) */
  return add_alloc(s, (dp_device_t){(dp_device_type_t)a.device_type, a.device_index}, a.base, a.nbytes, o);
}

/* cupy: the allocation behind the view (arr.data.mem: ptr, size, and the
 * device of arr.data). 0, or -1 with an exception. */
int dpy_cupy_memory(PyObject *o, dp_device_t *dev, void **base, size_t *size) {
  PyObject *data = PyObject_GetAttrString(o, "data");
  PyObject *mem = data ? PyObject_GetAttrString(data, "mem") : NULL;
  PyObject *ptr = mem ? PyObject_GetAttrString(mem, "ptr") : NULL;
  PyObject *sz = ptr ? PyObject_GetAttrString(mem, "size") : NULL;
  PyObject *d = sz ? PyObject_GetAttrString(data, "device_id") : NULL;
  if (d) {
    *base = PyLong_AsVoidPtr(ptr);
    *size = PyErr_Occurred() ? 0 : PyLong_AsSize_t(sz);
    long id = PyErr_Occurred() ? 0 : PyLong_AsLong(d);
    if (!PyErr_Occurred() && (id < 0 || id > UINT8_MAX))
      PyErr_Format(PyExc_ValueError, "a cupy array on device %ld", id);
    *dev = (dp_device_t){DP_DEVICE_CUDA, (uint8_t)id};
  }
  Py_XDECREF(data);
  Py_XDECREF(mem);
  Py_XDECREF(ptr);
  Py_XDECREF(sz);
  Py_XDECREF(d);
  return PyErr_Occurred() ? -1 : 0;
}

int dpy_visit_cupy(dpy_scanner_t *s, PyObject *o) {
  s->saw_cupy = 1;
  dp_device_t dev;
  void *base;
  size_t size;
  if (dpy_cupy_memory(o, &dev, &base, &size)) return dpy_walk_error(s, o, "a cupy array without its memory");
  return add_alloc(s, dev, base, size, o);
}

/* p + off as an address: the interfaces' pointers are numbers a producer
 * gives, never dereferenced here, and one near the top of the address space
 * would overflow pointer arithmetic (undefined); the address wraps as the
 * number does. */
static inline void *addr_at(const void *p, int64_t off) { return (void *)((uintptr_t)p + (uintptr_t)off); }

/* The extent in bytes of a strided view: from its lowest to its highest
 * addressed byte. 0 when it addresses nothing. lo receives the lowest
 * element's byte offset (<= 0). */
static int view_extent(Py_ssize_t ndim, const Py_ssize_t *shape, const Py_ssize_t *strides, Py_ssize_t itemsize,
                       Py_ssize_t *lo, size_t *extent) {
  Py_ssize_t l = 0, h = 0;
  /* any empty dimension first: a view of no items addresses nothing, however
     far another dimension's strides would reach */
  for (Py_ssize_t i = 0; i < ndim; i++)
    if (shape[i] == 0) {
      *lo = 0;
      *extent = 0;
      return 0;
    }
  for (Py_ssize_t i = 0; i < ndim; i++) {
    Py_ssize_t span;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &span)) return -1;
    if (span < 0) {
      if (__builtin_add_overflow(l, span, &l)) return -1;
    } else if (__builtin_add_overflow(h, span, &h)) {
      return -1;
    }
  }
  Py_ssize_t e;
  if (__builtin_sub_overflow(h, l, &e) || __builtin_add_overflow(e, itemsize, &e)) return -1;
  *lo = l;
  *extent = (size_t)e;
  return 0;
}

/* Whether the ext bytes from ptr + lo (lo <= 0) are addresses: a view that
 * starts below 0 or ends past the top of the address space is none. */
static int view_in_address_space(const void *ptr, Py_ssize_t lo, size_t ext) {
  uintptr_t first, end;
  return !ext || (__builtin_add_overflow((uintptr_t)ptr, (uintptr_t)lo, &first) == (lo < 0) &&
                  !__builtin_add_overflow(first, (uintptr_t)ext, &end));
}

/* The item size in bytes of an array-interface typestr ("<f4", "|b1",
 * "<M8[ns]", "<U10"): the digits after the kind, which count characters of
 * 4 bytes for 'U' (as numpy reads it). 0 when it names none. */
static Py_ssize_t typestr_itemsize(PyObject *typestr) {
  const char *ts = PyUnicode_AsUTF8(typestr);
  if (!ts) {
    PyErr_Clear();
    return 0;
  }
  if (strlen(ts) < 3 || ts[2] < '0' || ts[2] > '9') return 0;
  Py_ssize_t n = 0;
  for (const char *c = ts + 2; *c >= '0' && *c <= '9'; c++)
    if (__builtin_mul_overflow(n, 10, &n) || __builtin_add_overflow(n, *c - '0', &n)) return 0;
  if (ts[1] == 'U' && __builtin_mul_overflow(n, 4, &n)) return 0;
  return n;
}

/* The item `key` of an interface dict, as a new reference (NULL when it
 * has none). 0, or -1 with the exception a key's comparison raised. */
int dpy_iface_part(PyObject *d, PyObject *key, PyObject **out) {
  PyObject *v = PyDict_GetItemWithError(d, key);
  *out = Py_XNewRef(v);
  return v || !PyErr_Occurred() ? 0 : -1;
}

/* Item i of an interface's shape or strides tuple as numpy reads it,
 * through __index__ (a numpy integer, as a shape taken from an array holds):
 * -1 with an exception when it is none. */
static Py_ssize_t iface_index(PyObject *tuple, Py_ssize_t i) {
  PyObject *n = PyNumber_Index(PyTuple_GET_ITEM(tuple, i));
  Py_ssize_t v = n ? PyLong_AsSsize_t(n) : -1;
  Py_XDECREF(n);
  return v;
}

/* __cuda_array_interface__ (cuda) or __array_interface__: data pointer and
 * extent of the view (no owner is known, so views at different offsets are
 * different entries). 1, with no error, when reading it raises
 * AttributeError: a property of the class that has none for this instance
 * (torch's __cuda_array_interface__ of a cpu tensor, a wrapper forwarding
 * it) — hasattr() is false, numpy, cupy and numba read no memory, and the
 * object is walked as it would be without it. */
int dpy_visit_iface(dpy_scanner_t *s, PyObject *o, int cuda) {
  const char *what = cuda ? "a malformed __cuda_array_interface__" : "a malformed __array_interface__";
  PyObject *cai;
  int found = _PyObject_LookupAttr(o, cuda ? dpy.str_cai : dpy.str_aif, &cai);
  if (found == 0) return 1;
  if (found < 0) return dpy_walk_error(s, o, cuda ? "__cuda_array_interface__ failed" : "__array_interface__ failed");
  int rc = -1;
  /* each part held as soon as it is found: a lookup compares keys, and a
     key's __eq__ (a str subclass's of the same hash) may empty the dict */
  PyObject *data = NULL, *shape = NULL, *strides = NULL, *typestr = NULL;
  if (PyDict_Check(cai) && dpy_iface_part(cai, dpy.str_data, &data)) goto out;
  if (!cuda && data && !PyTuple_Check(data) && PyObject_CheckBuffer(data)) {
    /* the memory of a buffer object, often a copy made by the property
       (PIL's tobytes()): no address to report; the walk of the object
       itself finds what it holds */
    Py_DECREF(data);
    Py_DECREF(cai);
    return 0;
  }
  if (PyDict_Check(cai) && (dpy_iface_part(cai, dpy.str_shape, &shape) || dpy_iface_part(cai, dpy.str_strides, &strides) ||
                            dpy_iface_part(cai, dpy.str_typestr, &typestr)))
    goto out;
  if (!PyDict_Check(cai) || !data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1 || !shape ||
      !PyTuple_Check(shape) || !typestr || !PyUnicode_Check(typestr)) {
    /* which part, and what it is instead (the WalkError's text names the
       interface): one written by hand, a list for shape, is told what to
       change */
    if (!PyDict_Check(cai))
      PyErr_Format(PyExc_ValueError, "it is a '%s', not a dict", Py_TYPE(cai)->tp_name);
    else if (data && PyTuple_Check(data) && PyTuple_GET_SIZE(data) < 1)
      PyErr_SetString(PyExc_ValueError, "data must be a tuple (address, read-only flag), not an empty tuple");
    else if (!data || !PyTuple_Check(data))
      PyErr_Format(PyExc_ValueError, "data must be a tuple (address, read-only flag), not %s%s%s",
                   data ? "a '" : "missing", data ? Py_TYPE(data)->tp_name : "", data ? "'" : "");
    else if (!shape || !PyTuple_Check(shape))
      PyErr_Format(PyExc_ValueError, "shape must be a tuple of ints, not %s%s%s", shape ? "a '" : "missing",
                   shape ? Py_TYPE(shape)->tp_name : "", shape ? "'" : "");
    else
      PyErr_Format(PyExc_ValueError, "typestr must be a str (as '<f4'), not %s%s%s", typestr ? "a '" : "missing",
                   typestr ? Py_TYPE(typestr)->tp_name : "", typestr ? "'" : "");
    goto out;
  }
  Py_ssize_t isz = typestr_itemsize(typestr);
  Py_ssize_t nd = PyTuple_GET_SIZE(shape), shp[64], str[64];
  /* an address, so an int in [0, UINTPTR_MAX]: PyLong_AsVoidPtr would take
     -1 for the last byte of the address space */
  PyObject *addr = PyTuple_GET_ITEM(data, 0);
  int below = 0;
  long long as_ll = PyLong_Check(addr) ? PyLong_AsLongLongAndOverflow(addr, &below) : 0;
  if (as_ll == -1 && PyErr_Occurred()) goto out;
  if (below < 0 || (!below && as_ll < 0)) {
    PyErr_SetString(PyExc_ValueError, "a negative address in data");
    goto out;
  }
  void *ptr = PyLong_AsVoidPtr(addr);
  if (!ptr && PyErr_Occurred()) goto out;
  if (nd > 64) {
    PyErr_Format(PyExc_ValueError, "unsupported shape: %zd dimensions (64 at most)", nd);
    goto out;
  }
  if (isz <= 0) {
    PyErr_Format(PyExc_ValueError, "unsupported typestr '%U': it names no item size (as '<f4': byte order, kind, size)",
                 typestr);
    goto out;
  }
  if (strides && strides != Py_None && (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != nd)) {
    PyErr_SetString(PyExc_ValueError, "strides must be None or a tuple as long as shape");
    goto out;
  }
  /* strides in bytes, as given (a stride need not be a multiple of the
     item size); without them, C-contiguous */
  for (Py_ssize_t i = nd; i-- > 0;) {
    shp[i] = iface_index(shape, i);
    if (shp[i] < 0) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "a negative dimension (%zd) in shape", shp[i]);
      goto out;
    }
    if (strides && strides != Py_None) {
      str[i] = iface_index(strides, i);
      if (str[i] == -1 && PyErr_Occurred()) goto out;
    } else if (i == nd - 1) {
      str[i] = isz;
    } else if (__builtin_mul_overflow(str[i + 1], shp[i + 1] ? shp[i + 1] : 1, &str[i])) {
      PyErr_SetString(PyExc_OverflowError, "the view's extent overflows");
      goto out;
    }
  }
  Py_ssize_t lo;
  size_t ext;
  /* the bytes it addresses, [ptr + lo, ptr + lo + ext), must be addresses:
     a view below 0 or past the top of the address space overflows too */
  if (view_extent(nd, shp, str, isz, &lo, &ext) || !view_in_address_space(ptr, lo, ext)) {
    PyErr_SetString(PyExc_OverflowError, "the view's extent overflows");
    goto out;
  }
  if (ext && !ptr) {
    /* the interfaces allow a NULL data pointer for an empty view only */
    PyErr_SetString(PyExc_ValueError, "a NULL data pointer for a view that is not empty");
    goto out;
  }
  /* The interface names no device: the CUDA runtime knows the pointer's. */
  dp_device_t dev = {cuda ? DP_DEVICE_CUDA : DP_DEVICE_CPU, 0};
  dp_backend_t *backend;
  if (cuda && ext && !dp_backend_get(DP_DEVICE_CUDA, &backend, NULL)) dp_pointer_device(backend, ptr, &dev, NULL);
  rc = ext ? add_alloc(s, dev, addr_at(ptr, lo), ext, o) : 0;
out:
  Py_XDECREF(data);
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(typestr);
  Py_DECREF(cai);
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return dpy_walk_error(s, o, what);
  return rc;
}

/* numpy.ndarray's own attribute `name` of array o (a new reference), read
 * through ndarray's descriptor: a subclass's property of that name (a
 * `base` that names other memory, a `dtype` that hides its objects) is not
 * what the array holds. */
static PyObject *ndarray_attr(PyObject *o, const char *name) {
  static PyObject *descr[2];
  int i = name[0] == 'b' ? 0 : 1; /* "base", "dtype" */
  if (!descr[i]) {
    PyObject *d = PyDict_GetItemString(dpy.numpy_ndarray->tp_dict, name);
    if (d && Py_TYPE(d)->tp_descr_get) descr[i] = Py_NewRef(d); /* numpy.ndarray is never unloaded */
  }
  if (!descr[i] || !PyObject_TypeCheck(o, dpy.numpy_ndarray)) return PyObject_GetAttrString(o, name);
  return Py_TYPE(descr[i])->tp_descr_get(descr[i], o, (PyObject *)Py_TYPE(o));
}

static int object_array(PyObject *o);

/* 1 when a buffer's struct format holds an 'O' item (a Python object's
 * pointer), also inside a structured format. Field names, between colons,
 * are skipped only when `names` says the exporter's names hold no colon —
 * numpy's (it refuses one) —: ctypes writes a name as given, and a field
 * named "a:" turns the colons' parity, so that the 'O' after it reads as
 * part of a name; there any 'O' counts (a name holding one too: a buffer
 * refused, never a view of pointers). */
static int format_holds_objects(const char *f, int names) {
  for (int in_name = 0; f && *f; f++) {
    if (*f == ':' && names) in_name = !in_name;
    else if (!in_name && *f == 'O') return 1;
  }
  return 0;
}

/* 1 when o's buffer format comes from numpy (whose field names hold no
 * colon): a numpy array, or memoryviews of one. */
static int numpy_exported(PyObject *o) {
  for (int hops = 0; hops < 64 && PyMemoryView_Check(o); hops++) {
    if (((PyMemoryViewObject *)o)->flags & _Py_MEMORYVIEW_RELEASED) return 0;
    o = PyMemoryView_GET_BASE(o);
    if (!o) return 0;
  }
  return dpy.numpy_ndarray && PyObject_TypeCheck(o, dpy.numpy_ndarray);
}

/* _format_holds_objects(x): whether buffer x's items hold Python objects —
 * the rule for _frames.py too (Buffer.raw, loads' buffers=): one rule for
 * both languages. TypeError for an object without the buffer protocol. */
PyObject *dpy_format_holds_objects(PyObject *self, PyObject *x) {
  (void)self;
  Py_buffer v;
  if (dpy_resolve_frameworks() || PyObject_GetBuffer(x, &v, PyBUF_FULL_RO)) return NULL; /* as memoryview(x) */
  int r = format_holds_objects(v.format, numpy_exported(x));
  PyBuffer_Release(&v);
  return PyBool_FromLong(r);
}

/* Buffer-protocol objects: cpu memory, owner first (numpy views and
 * memoryviews report the array they view; an array over a torch tensor —
 * Tensor.numpy() — is the tensor's allocation), never copied. *objectsp
 * (when not NULL): 1 when an array on the way or the owner's format holds
 * Python objects (a field of a structured array with an object field: its
 * allocation's bytes are pointers). */
int dpy_buffer_memory_objects(dpy_scanner_t *s, PyObject *o, dp_device_t *devp, void **basep, size_t *extp,
                          int *borrowedp, int *objectsp) {
  PyObject *owner = o;
  Py_INCREF(owner);
  *devp = (dp_device_t){DP_DEVICE_CPU, 0};
  *borrowedp = 0;
  if (objectsp) *objectsp = 0;
  int hops = 0;
  for (; hops < 64; hops++) {
    PyObject *next = NULL;
    if (objectsp && dpy.numpy_ndarray && PyObject_TypeCheck(owner, dpy.numpy_ndarray)) {
      int ob = object_array(owner);
      if (ob < 0) dpy_clear_error();
      if (ob) *objectsp = 1; /* unreadable: taken as holding them */
    }
    if (PyMemoryView_Check(owner)) {
      /* a released view's base is a dangling pointer (its export, which
         held the base, is gone): the view itself is asked, and refuses */
      if (!(((PyMemoryViewObject *)owner)->flags & _Py_MEMORYVIEW_RELEASED)) next = PyMemoryView_GET_BASE(owner);
      Py_XINCREF(next);
    } else if (dpy.numpy_ndarray && PyObject_TypeCheck(owner, dpy.numpy_ndarray)) {
      next = ndarray_attr(owner, "base");
      if (!next) dpy_clear_error();
      else if (dpy_is_torch(next)) {
        dp_torch_alloc_t a[DP_TORCH_MAX_ALLOCS];
        int n = dpy_torch_allocs(next, a);
        Py_DECREF(next);
        Py_DECREF(owner);
        if (n != 1) return dpy_walk_error(s, o, "an array over a tensor whose memory cannot be described");
        *devp = (dp_device_t){(dp_device_type_t)a[0].device_type, a[0].device_index};
        *basep = a[0].base;
        *extp = a[0].nbytes;
        *borrowedp = a[0].borrowed;
        return 0;
      } else if (next == Py_None || !PyObject_CheckBuffer(next)) {
        /* an array over memory of an owner that is no buffer (a DLPack
           capsule, an __array_interface__ object): that owner may free it
           while the array still points at it (borrowed: copied when met) */
        if (next != Py_None) *borrowedp = 1;
        Py_CLEAR(next);
      }
    }
    if (!next) break;
    Py_DECREF(owner);
    owner = next;
  }
  if (hops == 64) *borrowedp = 1; /* a chain followed no further: its owner unknown, as above */
  Py_buffer v;
  if (PyObject_GetBuffer(owner, &v, PyBUF_RECORDS_RO) && (dpy_clear_error(), PyObject_GetBuffer(owner, &v, PyBUF_SIMPLE))) {
    Py_DECREF(owner);
    return dpy_walk_error(s, o, "its buffer cannot be read");
  }
  Py_ssize_t lo = 0;
  size_t ext = (size_t)v.len;
  if (v.strides && view_extent(v.ndim, v.shape, v.strides, v.itemsize, &lo, &ext)) ext = (size_t)v.len;
  if (objectsp && format_holds_objects(v.format, dpy.numpy_ndarray && PyObject_TypeCheck(owner, dpy.numpy_ndarray)))
    *objectsp = 1;
  *basep = addr_at(v.buf, lo);
  *extp = ext;
  PyBuffer_Release(&v);
  Py_DECREF(owner);
  return 0;
}

int dpy_buffer_memory(dpy_scanner_t *s, PyObject *o, dp_device_t *devp, void **basep, size_t *extp,
                  int *borrowedp) {
  return dpy_buffer_memory_objects(s, o, devp, basep, extp, borrowedp, NULL);
}

/* A numpy array of Python objects holds no data, only references: pickle
 * reduces it to a list of its items, and so does the walk. */
static int object_array(PyObject *o) {
  if (!dpy.numpy_ndarray || !PyObject_TypeCheck(o, dpy.numpy_ndarray)) return 0;
  PyObject *dt = ndarray_attr(o, "dtype");
  PyObject *has = dt ? PyObject_GetAttrString(dt, "hasobject") : NULL;
  Py_XDECREF(dt);
  if (!has) return -1;
  int r = PyObject_IsTrue(has);
  Py_DECREF(has);
  return r;
}


int dpy_visit_buffer(dpy_scanner_t *s, PyObject *o) {
  int obj = object_array(o);
  if (obj) {
    if (obj < 0) return dpy_walk_error(s, o, "its dtype cannot be read");
    size_t before = s->nframes;
    if (dpy_enter_reduce(s, o)) return -1;
    /* a subclass's attributes, which numpy's reduce drops, as for an array
       of another dtype: the reduce frame's last step, after the items */
    PyObject *d;
    if (dpy_subclass_attrs(s, o, K_BUFFER, &d)) return -1;
    if (d && PyDict_GET_SIZE(d) && s->nframes == before + 1 && s->frames[before].kind == FR_REDUCE)
      s->frames[before].value = Py_NewRef(d);
    return 0;
  }
  dp_device_t dev;
  void *base;
  size_t ext;
  int borrowed;
  if (dpy_buffer_memory(s, o, &dev, &base, &ext, &borrowed)) return -1;
  if (ext && add_alloc(s, dev, base, ext, o)) return -1;
  PyTypeObject *t = Py_TYPE(o);
  if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) return 0;
  if (PyType_IsSubtype(t, &PyByteArray_Type) && dpy_own_getstate(t)) return dpy_push_own_state(s, o);
  PyObject *d;
  if (dpy_subclass_attrs(s, o, K_BUFFER, &d)) return -1;
  if (!d || PyDict_GET_SIZE(d) == 0) return 0;
  return dpy_push(s, FR_ATTRS, d, Py_TYPE(o));
}

/* DLPack producers (jax arrays): the view's data, from the capsule. */
typedef struct {
  void *data;
  struct {
    int32_t device_type, device_id;
  } device;
  int32_t ndim;
  struct {
    uint8_t code, bits;
    uint16_t lanes;
  } dtype;
  int64_t *shape, *strides;
  uint64_t byte_offset;
} dl_tensor_t;

#define DL_FLAG_SUBBYTE_PADDED (1u << 2) /* DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED */

/* 1, with no error, when reading __dlpack_device__ or __dlpack__ raises
 * AttributeError (a property that has none for this instance: hasattr() is
 * false, and no consumer reads memory through it): the object is walked as
 * it would be without them. */
int dpy_visit_dlpack(dpy_scanner_t *s, PyObject *o) {
  PyObject *fn, *devt;
  int found = _PyObject_LookupAttr(o, dpy.str_dlpack_device, &fn);
  if (found == 0) return 1;
  devt = found > 0 ? PyObject_CallNoArgs(fn) : NULL;
  Py_XDECREF(fn);
  if (!devt) return dpy_walk_error(s, o, "__dlpack_device__ failed");
  long dt = -1, di = 0;
  if (PyTuple_Check(devt) && PyTuple_GET_SIZE(devt) == 2) {
    dt = PyLong_AsLong(PyTuple_GET_ITEM(devt, 0));
    if (!PyErr_Occurred()) di = PyLong_AsLong(PyTuple_GET_ITEM(devt, 1));
  } else {
    PyErr_Format(PyExc_TypeError, "__dlpack_device__ must return a (device_type, device_id) tuple, not %.200s",
                 Py_TYPE(devt)->tp_name);
  }
  Py_DECREF(devt);
  if (PyErr_Occurred()) return dpy_walk_error(s, o, "__dlpack_device__ returned a bad device");
  dp_device_t dev;
  if (dt == 1 || dt == 3) dev = (dp_device_t){DP_DEVICE_CPU, 0}; /* kDLCPU, kDLCUDAHost */
  else if (dt == 2 && di >= 0 && di <= DP_DEVICE_INDEX_MAX) dev = (dp_device_t){DP_DEVICE_CUDA, (uint8_t)di};
  else {
    if (dt == 2) PyErr_Format(PyExc_ValueError, "DLPack device id %ld is not a CUDA device's (0..%d)", di,
                              DP_DEVICE_INDEX_MAX); /* never wrapped onto another device */
    else PyErr_Format(PyExc_TypeError, "DLPack device type %ld is not cpu or cuda", dt);
    return dpy_walk_error(s, o, "memory devpickle cannot track");
  }
  if ((found = _PyObject_LookupAttr(o, dpy.str_dlpack, &fn)) == 0) return 1;
  PyObject *cap = found > 0 ? PyObject_CallNoArgs(fn) : NULL;
  Py_XDECREF(fn);
  if (!cap) return dpy_walk_error(s, o, "__dlpack__ failed");
  /* Only an unconsumed DLPack capsule is read: a "used_dltensor" one's
   * tensor belongs to its consumer, which may have freed it, and any other
   * capsule's pointer is not a DLManagedTensor at all. */
  const char *name = PyCapsule_CheckExact(cap) ? PyCapsule_GetName(cap) : NULL;
  int versioned = name && !strcmp(name, "dltensor_versioned");
  void *p = name && (versioned || !strcmp(name, "dltensor")) ? PyCapsule_GetPointer(cap, name) : NULL;
  if (!p) {
    if (!PyErr_Occurred()) {
      if (PyCapsule_CheckExact(cap))
        PyErr_Format(PyExc_TypeError, "__dlpack__ returned a capsule named '%s', not an unconsumed 'dltensor'",
                     name ? name : "(null)");
      else
        PyErr_Format(PyExc_TypeError, "__dlpack__ returned a '%.200s', not a capsule", Py_TYPE(cap)->tp_name);
    }
    Py_DECREF(cap);
    return dpy_walk_error(s, o, "__dlpack__ returned no capsule");
  }
  /* DLManagedTensor starts with its DLTensor; the versioned form with a
   * version (2 x uint32) and a manager pointer and deleter before flags. */
  if (versioned && *(const uint32_t *)p != 1) {
    PyErr_Format(PyExc_ValueError, "a DLPack %u.x capsule (devpickle reads 1.x)", *(const uint32_t *)p);
    Py_DECREF(cap);
    return dpy_walk_error(s, o, "memory devpickle cannot describe");
  }
  const dl_tensor_t *t = versioned ? (const dl_tensor_t *)((char *)p + 8 + 2 * sizeof(void *) + 8) : p;
  /* the capsule's device is the one its consumer uses: one that is not
     what __dlpack_device__ said is refused, never reported on the wrong
     device (a future would wait on the other one) */
  if (t->device.device_type != dt || (dt == 2 && t->device.device_id != di)) {
    PyErr_Format(PyExc_ValueError, "__dlpack_device__ says (%ld, %ld), its capsule (%d, %d)", dt, dt == 2 ? di : 0L,
                 (int)t->device.device_type, (int)t->device.device_id);
    Py_DECREF(cap);
    return dpy_walk_error(s, o, "memory devpickle cannot describe");
  }
  Py_ssize_t shp[64], str[64], lo = 0;
  size_t ext = 0;
  int nd = t->ndim, bpe = t->dtype.bits * t->dtype.lanes, isz = (bpe + 7) / 8;
  /* Items of fewer bits than whole bytes (int4, fp4) are packed in a DLPack
   * 1.1 capsule, unless its flags say padded: the extent is found in items,
   * then in the bytes they span. Before 1.1 they are taken as padded, each in
   * isz bytes (a bool of 1 bit in a byte, as TVM's): more bytes than packed
   * items span, never fewer. */
  uint64_t flags = versioned ? *(const uint64_t *)((const char *)p + 8 + 2 * sizeof(void *)) : 0;
  int packed = bpe % 8 && versioned && ((const uint32_t *)p)[1] >= 1 && !(flags & DL_FLAG_SUBBYTE_PADDED);
  Py_ssize_t unit = packed ? 1 : isz;
  int bad = nd < 0 || nd > 64 || isz <= 0 || (nd > 0 && !t->shape);
  for (int i = nd; !bad && i-- > 0;) {
    shp[i] = (Py_ssize_t)t->shape[i];
    if (shp[i] < 0) bad = 1;
    else if (t->strides) bad = __builtin_mul_overflow((Py_ssize_t)t->strides[i], unit, &str[i]);
    else if (i == nd - 1) str[i] = unit;
    else bad = __builtin_mul_overflow(str[i + 1], shp[i + 1] ? shp[i + 1] : 1, &str[i]);
  }
  if (!bad) bad = view_extent(nd, shp, str, unit, &lo, &ext);
  if (!bad && packed && ext) { /* items [lo, lo + ext) span bits [lo * bpe, (lo + ext) * bpe) */
    Py_ssize_t first, end;
    bad = __builtin_mul_overflow(lo, (Py_ssize_t)bpe, &first) ||
          __builtin_mul_overflow(lo + (Py_ssize_t)ext, (Py_ssize_t)bpe, &end) || end > PY_SSIZE_T_MAX - 7;
    if (!bad) {
      lo = first >= 0 ? first / 8 : -((7 - first) / 8); /* first <= 0: rounded down */
      ext = (size_t)((end + 7) / 8 - lo);
    }
  }
  /* as the array interfaces' (dpy_visit_iface): the bytes it addresses,
     from data + byte_offset, must be addresses, and a NULL data pointer
     names none */
  uintptr_t start;
  const char *why = bad ? "a DLPack tensor with a bad shape, strides or dtype"
                    : ext && (__builtin_add_overflow((uintptr_t)t->data, t->byte_offset, &start) ||
                              !view_in_address_space((void *)start, lo, ext))
                        ? "a DLPack tensor whose extent overflows"
                    : ext && !t->data ? "a NULL data pointer for a DLPack tensor that is not empty"
                                      : NULL;
  void *base = addr_at(addr_at(t->data, (int64_t)t->byte_offset), lo);
  Py_DECREF(cap);
  if (why) {
    PyErr_SetString(PyExc_ValueError, why);
    return dpy_walk_error(s, o, "memory devpickle cannot describe");
  }
  return ext ? add_alloc(s, dev, base, ext, o) : 0;
}

/* Whether o's own __dict__ holds a __cuda_array_interface__ (its class's
 * kind did not say so): 1, 0, or -1 with an exception. */
int dpy_instance_cai(PyObject *o) {
  if (PyType_Check(o)) return 0;
  PyObject **dp = _PyObject_GetDictPtr(o);
  if (!dp || !*dp || !PyDict_Check(*dp)) return PyErr_Occurred() ? -1 : 0;
  PyObject *d = Py_NewRef(*dp); /* held: a key's __eq__ may replace it */
  PyObject *cai = PyDict_GetItemWithError(d, dpy.str_cai);
  Py_DECREF(d);
  return cai ? 1 : PyErr_Occurred() ? -1 : 0;
}
