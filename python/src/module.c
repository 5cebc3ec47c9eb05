/*
 * module.c — devpickle._devpickle: module state, errors, and the lookup of
 * torch, cupy and numpy.
 */
#include "ext.h"

#include <stdlib.h>
#include <string.h>

dpy_state_t dpy;

PyObject *dpy_raise(int rc, const dp_error_t *e) {
  const char *msg = e && e->code ? e->message : dp_strerror(rc);
  switch (rc) {
  case DP_ENOMEM:
    return PyErr_NoMemory();
  case DP_ETYPE:
    PyErr_SetString(dpy.walk_error, msg);
    return NULL;
  case DP_EINVAL:
  case DP_EDEVICE:
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
  case DP_ETIMEDOUT:
    PyErr_SetString(PyExc_TimeoutError, msg);
    return NULL;
  default: { /* str(e) is the message; e.code the code's name, as FrameError's */
    PyObject *exc = PyObject_CallFunction(dpy.dp_error, "s", msg);
    PyObject *code = exc ? PyUnicode_FromString(dp_err_name(rc)) : NULL;
    if (code && PyObject_SetAttrString(exc, "code", code) == 0) PyErr_SetObject(dpy.dp_error, exc);
    Py_XDECREF(code);
    Py_XDECREF(exc);
    return NULL;
  }
  }
}

/* sys.modules[name] (borrowed), or NULL: asked at every walk while the
 * module is not imported, so the key is interned once (its hash kept). */
static PyObject *sys_module(PyObject **key, const char *name) {
  if (!*key && !(*key = PyUnicode_InternFromString(name))) {
    PyErr_Clear();
    return NULL;
  }
  PyObject *mods = PyImport_GetModuleDict();
  PyObject *m = mods ? PyDict_GetItemWithError(mods, *key) : NULL;
  if (!m) PyErr_Clear();
  return m;
}

/* Current streams are torch's: asked of the adapter (c10's thread-local
 * current stream; no GIL needed) and wrapped, once per handle. */
static dp_stream_t *torch_current(void *ud, dp_backend_t *b, dp_device_t dev) {
  (void)ud;
  if (dev.type != DP_DEVICE_CUDA || !dpy.torch) return NULL;
  dp_stream_t *s;
  return dp_stream_wrap(b, dev, dpy.torch->current_stream(dev.index), &s, NULL) ? NULL : s;
}

/* Whether module m is still being imported (importlib's spec._initializing,
 * as import itself asks): sys.modules holds a module from the start of its
 * import, so another thread's walk may meet torch or cupy half made — no
 * Tensor class yet — and must look again later rather than conclude that
 * it is not the library. */
static int initializing(PyObject *m) {
  PyObject *spec = PyObject_GetAttrString(m, "__spec__");
  PyObject *v = spec && spec != Py_None ? PyObject_GetAttrString(spec, "_initializing") : NULL;
  int r = v ? PyObject_IsTrue(v) : 0;
  Py_XDECREF(spec);
  Py_XDECREF(v);
  PyErr_Clear();
  return r > 0;
}

static void resolve_torch(PyObject *torch) {
  PyObject *c = PyObject_GetAttrString(torch, "_C");
  PyObject *base = NULL;
  if (c) {
    base = PyObject_GetAttrString(c, "TensorBase");
    if (!base) {
      PyErr_Clear();
      base = PyObject_GetAttrString(c, "_TensorBase");
    }
    Py_DECREF(c);
  }
  if (!base) {
    PyErr_Clear();
    base = PyObject_GetAttrString(torch, "Tensor");
  }
  if (!base || !PyType_Check(base)) {
    PyErr_Clear();
    Py_XDECREF(base);
    return; /* a module named torch that is not PyTorch: nothing to find */
  }
  dpy.torch_tensor = (PyTypeObject *)base;
  dpy.torch_tensor_cls = PyObject_GetAttrString(torch, "Tensor");
  if (!dpy.torch_tensor_cls) PyErr_Clear();
  static const char *const storages[2] = {"TypedStorage", "UntypedStorage"};
  for (int i = 0; i < 2; i++) {
    PyObject *st = PyObject_GetAttrString(torch, storages[i]);
    if (st && PyType_Check(st)) dpy.torch_storage[i] = (PyTypeObject *)st;
    else Py_XDECREF(st);
    PyErr_Clear();
  }
  /* torch's future and CUDA event (a CUDA build's: a CPU build has no such
     class in torch._C): synchronization, no memory (scan_classify.h, K_SYNC) */
  static const char *const syncs[2] = {"Future", "_CudaEventBase"};
  PyObject *tc = PyObject_GetAttrString(torch, "_C");
  for (int i = 0; i < 2 && tc; i++) {
    PyObject *st = PyObject_GetAttrString(tc, syncs[i]);
    if (st && PyType_Check(st)) dpy.sync_types[1 + i] = (PyTypeObject *)st;
    else Py_XDECREF(st);
  }
  Py_XDECREF(tc);
  PyErr_Clear();
  const char *off = getenv("DEVPICKLE_NO_TORCH_ADAPTER");
  if (off && *off && strcmp(off, "0")) return;
  PyObject *ad = PyImport_ImportModule("devpickle._torch");
  if (!ad) {
    PyErr_Clear(); /* not built here: torch's Python API answers instead */
    return;
  }
  PyObject *cap = PyObject_GetAttrString(ad, "_api");
  Py_DECREF(ad);
  const dp_torch_api_t *api = cap ? PyCapsule_GetPointer(cap, DP_TORCH_API_CAPSULE) : NULL;
  Py_XDECREF(cap);
  PyErr_Clear();
  if (api && api->version == DP_TORCH_API_VERSION) dpy.torch = api;
  if (dpy.torch && dpy.torch->has_cuda) dp_set_stream_provider(torch_current, NULL);
}

int dpy_resolve_frameworks(void) {
  int changed = 0;
  if (!dpy.torch_resolved) {
    static PyObject *key;
    PyObject *torch = sys_module(&key, "torch");
    if (torch && !initializing(torch)) {
      dpy.torch_resolved = 1;
      resolve_torch(torch);
      changed = 1;
    }
  }
  if (!dpy.cupy_ndarray) {
    static PyObject *key;
    PyObject *cupy = sys_module(&key, "cupy");
    if (cupy && !initializing(cupy)) {
      dpy.cupy_ndarray = PyObject_GetAttrString(cupy, "ndarray");
      if (!dpy.cupy_ndarray || !PyType_Check(dpy.cupy_ndarray)) {
        PyErr_Clear();
        Py_CLEAR(dpy.cupy_ndarray);
        dpy.cupy_ndarray = Py_NewRef(Py_None); /* looked at once */
      }
      changed = 1;
    }
  }
  if (!dpy.numpy_ndarray) {
    static PyObject *key;
    PyObject *np = sys_module(&key, "numpy");
    if (np) {
      PyObject *nd = PyObject_GetAttrString(np, "ndarray");
      PyObject *gen = nd ? PyObject_GetAttrString(np, "generic") : NULL;
      PyObject *vd = gen ? PyObject_GetAttrString(np, "void") : NULL;
      PyErr_Clear();
      if (nd && gen && vd && PyType_Check(nd) && PyType_Check(gen) && PyType_Check(vd)) {
        dpy.numpy_ndarray = (PyTypeObject *)Py_NewRef(nd);
        dpy.numpy_generic = (PyTypeObject *)Py_NewRef(gen);
        dpy.numpy_void = (PyTypeObject *)Py_NewRef(vd);
        changed = 1;
      }
      Py_XDECREF(nd);
      Py_XDECREF(gen);
      Py_XDECREF(vd);
    }
  }
  if (changed) dpy_scan_forget_types();
  return 0;
}

static PyObject *torch_adapter(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  dpy_resolve_frameworks();
  if (dpy.torch) return PyUnicode_FromString("c++");
  if (dpy.torch_tensor) return PyUnicode_FromString("python");
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))dpy_scan_py, METH_VARARGS | METH_KEYWORDS,
     "scan($module, /, obj, *, paths=True, opaque=())\n--\n\n"
     "-> list of Allocation: the memory obj references, one per (device, base), in\n"
     "the order the walk first meets it.\n\n"
     "obj is walked as pickle (protocol 5) would reduce it, serializing nothing:\n"
     "containers, plain objects and dataclasses, namedtuples, nn.Modules, anything\n"
     "with a reduce. Memory is torch tensors and storages (views of one storage\n"
     "are one allocation; a tensor's .grad is not walked, as pickle does not\n"
     "carry it), numpy, cupy, DLPack and array-interface memory, bytearrays and\n"
     "memoryviews. paths=False skips the paths (Allocation.path is None),\n"
     "faster. opaque: a type or an iterable of types whose instances\n"
     "(isinstance) are leaves, never entered. A value that cannot be walked (a\n"
     "generator, a lock) raises WalkError naming its type and path."},
    {"collect_all", (PyCFunction)(void (*)(void))dpy_collect_all, METH_FASTCALL | METH_KEYWORDS,
     "collect_all($module, /, futures)\n--\n\n"
     "-> Future whose value is the list of the futures (devpickle.Future objects,\n"
     "any iterable of them), once every one has completed; it fails with the\n"
     "first failed future in list order, once all have completed. Its then()\n"
     "children walk their callbacks' results with the opaque= types of all the\n"
     "futures. Once it has callbacks, its pending futures hold it: it lives while\n"
     "one of them can complete it; dropped with futures that nobody else holds,\n"
     "the cycle collector finds it and its then() children fail with\n"
     "devpickle.Error (code DP_ECANCELED)."},
    {"wait_all", (PyCFunction)(void (*)(void))dpy_wait_all, METH_FASTCALL | METH_KEYWORDS,
     "wait_all($module, /, futures)\n--\n\n"
     "-> list of the futures' values (devpickle.Future objects, any iterable of\n"
     "them), once every one has completed, waited on as wait() waits; else\n"
     "raises the exception of the first failed future in list order."},
    {"dumps", (PyCFunction)(void (*)(void))dpy_dumps, METH_VARARGS | METH_KEYWORDS,
     "dumps($module, /, obj, *, inline=False, buffer_callback=None)\n--\n\n"
     "-> bytes: a devpickle frame of obj, walked as scan() walks it (the CLI's\n"
     "verify, dump and inspect read it).\n\n"
     "Tensor and array memory goes out of band: the frame carries descriptors,\n"
     "and buffer_callback(buf) receives each buffer as a devpickle.Buffer, in\n"
     "the frame's table order; buf.raw() is the memory to give loads' buffers=\n"
     "(the callback's return value is ignored). inline=True copies the bytes\n"
     "into the frame instead: self-contained, no callback called. What a frame\n"
     "cannot carry (a sparse tensor, a generator, an int outside int64, ...)\n"
     "raises WalkError naming its path."},
    {"loads", (PyCFunction)(void (*)(void))dpy_loads, METH_VARARGS | METH_KEYWORDS,
     "loads($module, /, data, *, buffers=None, classes=(), max_copies=None)\n--\n\n"
     "-> the value of the frame data (a bytes-like object), rebuilt without\n"
     "importing or calling anything by name. A frame it refuses raises\n"
     "FrameError (code, offset).\n\n"
     "buffers: a sequence indexed by the frame's buffer table, each item the\n"
     "bytes of that out-of-band buffer (Buffer.raw(), a tensor, a numpy array,\n"
     "bytes); an inline frame needs none.\n"
     "classes: the classes allowed to come back (a class, or an iterable of\n"
     "them), matched by module.qualname; functions and objects dumps carries by\n"
     "name (torch.float16) too. Every class the value holds must be listed: a\n"
     "model's state_dict() needs collections.OrderedDict, an nn.Module its\n"
     "class, each submodule's and collections.OrderedDict. An unlisted one\n"
     "comes back as a devpickle.Object (class name and attributes).\n"
     "max_copies: how many items and bytes objects sharing a node may copy out\n"
     "of it (None: 4 per byte of the frame plus 65,536)."},
    {"_hash_work", dpy_hash_work, METH_VARARGS,
     "_hash_work($module, items, memo, left, /)\n--\n\n-> the tuple items CPython hashes to hash each of items, "
     "a list or tuple (loads' bound)"},
    {"_format_holds_objects", dpy_format_holds_objects, METH_O,
     "_format_holds_objects($module, x, /)\n--\n\n-> whether buffer x's items hold Python objects (an 'O' in its "
     "struct format, also in a structured one; field names aside where numpy exported it, whose names hold no "
     "colon)"},
    {"_torch_adapter", torch_adapter, METH_NOARGS,
     "_torch_adapter($module, /)\n--\n\nHow torch tensors are read: 'c++' (the adapter), 'python', or None "
     "(torch not imported)."},
    {NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "devpickle._devpickle",
    "The C core of devpickle's Python binding (use the devpickle package).", -1, methods,
};

int dpy_is_stand_in(PyObject *o) {
  static PyObject *object_type; /* looked up once one comes */
  if (strcmp(Py_TYPE(o)->tp_name, "Object") != 0) return 0;
  if (!object_type) {
    PyObject *mod = PyImport_ImportModule("devpickle._object");
    object_type = mod ? PyObject_GetAttrString(mod, "Object") : NULL;
    Py_XDECREF(mod);
    if (!object_type) return -1;
  }
  return (PyObject *)Py_TYPE(o) == object_type;
}

int dpy_refuse_stand_in(PyObject *o, const char *head, const char *tail) {
  int r = dpy_is_stand_in(o);
  if (r <= 0) return r;
  /* its own field, read as the Object reads it (no __getattr__ of its) */
  PyObject *name = PyObject_GenericGetAttr(o, dpy.str_class_name);
  if (name && PyUnicode_Check(name))
    PyErr_Format(PyExc_TypeError, "%s a devpickle.Object of class %R%s", head, name, tail);
  else if (name || PyErr_ExceptionMatches(PyExc_Exception))
    PyErr_Format(PyExc_TypeError, "%s a devpickle.Object%s", head, tail);
  Py_XDECREF(name);
  return 1;
}

PyObject *dpy_new_error(const char *name, const char *doc, PyObject *base, const char *const *attrs) {
  PyObject *dict = PyDict_New();
  for (size_t i = 0; dict && attrs[i]; i++)
    if (PyDict_SetItemString(dict, attrs[i], Py_None)) Py_CLEAR(dict);
  PyObject *cls = dict ? PyErr_NewExceptionWithDoc(name, doc, base, dict) : NULL;
  Py_XDECREF(dict);
  return cls;
}

PyObject *dpy_items(PyObject *o, int list, const char *head, const char *tail) {
  PyObject *r = list ? PySequence_List(o) : PySequence_Tuple(o); /* its length first, as Python reads one */
  if (r || !PyErr_ExceptionMatches(PyExc_TypeError)) return r;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  PyObject *it = PyObject_GetIter(o); /* iterable: the TypeError was the iteration's own */
  int iterable = it || !PyErr_ExceptionMatches(PyExc_TypeError);
  Py_XDECREF(it);
  PyErr_Clear();
  if (iterable) {
    PyErr_Restore(et, ev, tb);
    return NULL;
  }
  PyErr_NormalizeException(&et, &ev, &tb);
  if (ev && tb) PyException_SetTraceback(ev, tb);
  PyErr_Format(PyExc_TypeError, "%s a '%s'%s", head, Py_TYPE(o)->tp_name, tail);
  PyObject *nt, *nv, *ntb;
  PyErr_Fetch(&nt, &nv, &ntb);
  PyErr_NormalizeException(&nt, &nv, &ntb);
  if (nv && ev) {
    PyException_SetCause(nv, Py_NewRef(ev)); /* steals */
    PyException_SetContext(nv, Py_NewRef(ev));
  }
  PyErr_Restore(nt, nv, ntb);
  Py_XDECREF(et);
  Py_XDECREF(ev);
  Py_XDECREF(tb);
  return NULL;
}

static int intern(PyObject **slot, const char *s) { return (*slot = PyUnicode_InternFromString(s)) ? 0 : -1; }

PyMODINIT_FUNC PyInit__devpickle(void) {
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  dpy.walk_error = dpy_new_error("devpickle.WalkError",
                                 "A value that cannot be walked: the message names its type and its path "
                                 "(attributes type_name and path).",
                                 PyExc_TypeError, (const char *const[]){"type_name", "path", NULL});
  dpy.dp_error = dpy_new_error("devpickle.Error",
                               "An error of the devpickle library: str() is its message; attribute code names "
                               "the library's code (\"DP_EDEVICE\", ...).",
                               PyExc_RuntimeError, (const char *const[]){"code", NULL});
  if (!dpy.walk_error || !dpy.dp_error) goto fail;
  Py_INCREF(dpy.walk_error);
  Py_INCREF(dpy.dp_error);
  if (PyModule_AddObject(m, "WalkError", dpy.walk_error) || PyModule_AddObject(m, "Error", dpy.dp_error)) goto fail;
  /* the C library's version, as linked into this extension */
  if (PyModule_AddStringConstant(m, "__version__", dp_version_string())) goto fail;
  PyObject *copyreg = PyImport_ImportModule("copyreg");
  if (!copyreg) goto fail;
  dpy.dispatch_table = PyObject_GetAttrString(copyreg, "dispatch_table");
  dpy.slotnames = PyObject_GetAttrString(copyreg, "_slotnames");
  Py_DECREF(copyreg);
  if (!dpy.dispatch_table || !dpy.slotnames || !PyDict_Check(dpy.dispatch_table)) goto fail;
  PyObject *obj = (PyObject *)&PyBaseObject_Type;
  dpy.object_reduce_ex = PyObject_GetAttrString(obj, "__reduce_ex__");
  dpy.object_reduce = PyObject_GetAttrString(obj, "__reduce__");
  dpy.object_getstate = PyObject_GetAttrString(obj, "__getstate__");
  if (!dpy.object_reduce_ex || !dpy.object_reduce) goto fail;
  if (!dpy.object_getstate) PyErr_Clear(); /* before 3.11 */
  if (intern(&dpy.str_reduce_ex, "__reduce_ex__") || intern(&dpy.str_reduce, "__reduce__") ||
      intern(&dpy.str_getstate, "__getstate__") ||
      intern(&dpy.str_fields, "_fields") || intern(&dpy.str_dict, "__dict__") ||
      intern(&dpy.str_cai, "__cuda_array_interface__") || intern(&dpy.str_aif, "__array_interface__") ||
      intern(&dpy.str_dlpack, "__dlpack__") ||
      intern(&dpy.str_dlpack_device, "__dlpack_device__") || intern(&dpy.str_getnewargs, "__getnewargs__") ||
      intern(&dpy.str_getnewargs_ex, "__getnewargs_ex__") || intern(&dpy.str_slots, "__slots__") ||
      intern(&dpy.str_data, "data") || intern(&dpy.str_shape, "shape") || intern(&dpy.str_strides, "strides") ||
      intern(&dpy.str_typestr, "typestr") || intern(&dpy.str_torch_dot, "torch.") ||
      intern(&dpy.str_instancecheck, "__instancecheck__") ||
      intern(&dpy.str_subclasscheck, "__subclasscheck__") || intern(&dpy.str_getattribute, "__getattribute__") ||
      intern(&dpy.str_class, "__class__") || intern(&dpy.str_class_name, "__class_name__") ||
      intern(&dpy.str_numpy, "numpy") || intern(&dpy.str_numpy_ndarray, "numpy.ndarray") ||
      intern(&dpy.str_torch_tensor, "torch.Tensor") || intern(&dpy.str_base, "base") ||
      intern(&dpy.str_ptr, "ptr") || intern(&dpy.str_nbytes, "nbytes") || intern(&dpy.str_obj, "obj"))
    goto fail;
  dpy.type_instancecheck = _PyType_Lookup(&PyType_Type, dpy.str_instancecheck);
  dpy.object_getattribute = _PyType_Lookup(&PyBaseObject_Type, dpy.str_getattribute);
  dpy.object_class = _PyType_Lookup(&PyBaseObject_Type, dpy.str_class);
  if (!dpy.type_instancecheck || !dpy.object_getattribute || !dpy.object_class) {
    PyErr_SetString(PyExc_ImportError, "type.__instancecheck__, object.__getattribute__ or object.__class__ is missing");
    goto fail;
  }
  PyObject *abc = PyImport_ImportModule("abc"); /* imported at startup: nothing runs */
  PyObject *abcmeta = abc ? PyObject_GetAttrString(abc, "ABCMeta") : NULL;
  dpy.abc_token = abc ? PyObject_GetAttrString(abc, "get_cache_token") : NULL;
  Py_XDECREF(abc);
  if (abcmeta && PyType_Check(abcmeta)) { /* held: compared by address while the process lives */
    dpy.abc_instancecheck = Py_XNewRef(_PyType_Lookup((PyTypeObject *)abcmeta, dpy.str_instancecheck));
    dpy.abc_subclasscheck = Py_XNewRef(_PyType_Lookup((PyTypeObject *)abcmeta, dpy.str_subclasscheck));
  }
  Py_XDECREF(abcmeta);
  if (!dpy.abc_instancecheck || !dpy.abc_subclasscheck || !dpy.abc_token)
    dpy.abc_instancecheck = NULL; /* no abc: every ABC is asked for every object */
  PyErr_Clear();
  if (dpy_scan_types_init(m) || dpy_future_types_init(m) || dpy_frames_init(m)) goto fail;
  return m;
fail:
  Py_DECREF(m);
  return NULL;
}
