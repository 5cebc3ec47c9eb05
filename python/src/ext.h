/*
 * ext.h — what the files of the devpickle extension share. Not installed.
 *
 * The GIL protects everything here unless a comment says otherwise: module
 * state is touched only by threads that hold it.
 */
#ifndef DEVPICKLE_PY_EXT_H
#define DEVPICKLE_PY_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <devpickle.h>

#include "torch_api.h"

/* ---- module state (module.c) ---- */
typedef struct dpy_state {
  PyObject *walk_error;        /* devpickle.WalkError (a TypeError) */
  PyObject *dp_error;          /* devpickle.Error (a RuntimeError) for library errors */
  PyObject *dispatch_table;    /* copyreg.dispatch_table */
  PyObject *object_reduce_ex;  /* object.__reduce_ex__, object.__reduce__, object.__getstate__ */
  PyObject *object_reduce;
  PyObject *object_getstate;
  PyObject *slotnames;         /* copyreg._slotnames */
  PyObject *str_reduce_ex, *str_reduce, *str_getstate, *str_fields, *str_dict, *str_cai, *str_aif, *str_dlpack,
      *str_dlpack_device, *str_getnewargs, *str_getnewargs_ex, *str_slots, *str_data, *str_shape, *str_strides,
      *str_typestr, /* the array interfaces' keys */
      *str_torch_dot, /* "torch.", the prefix of torch's modules */
      *str_instancecheck, *str_subclasscheck, *str_getattribute, *str_class, *str_class_name,
      *str_numpy, *str_numpy_ndarray, *str_torch_tensor, /* "numpy", "numpy.ndarray", "torch.Tensor" (loads' C paths) */
      *str_base, *str_ptr, *str_nbytes, *str_obj; /* an array's base; a Buffer's fields (loads' C paths) */
  /* type.__instancecheck__, object.__getattribute__ and object.__class__ as
   * their dicts hold them (borrowed from static types): what isinstance
   * reads when nothing overrides them (scan_classify.h, opaque=) */
  PyObject *type_instancecheck, *object_getattribute, *object_class;
  /* abc.ABCMeta's __instancecheck__ and __subclasscheck__ (its dict's), and
   * abc.get_cache_token: an ABC's answers, cached by ABCMeta itself until a
   * register() moves the token, are cached by a walk too (scan_classify.h) */
  PyObject *abc_instancecheck, *abc_subclasscheck, *abc_token;
  /* torch, resolved on first need once torch is imported */
  int torch_resolved;
  PyTypeObject *torch_tensor;  /* torch.Tensor's C base, or NULL */
  PyObject *torch_tensor_cls;  /* torch.Tensor itself (a tensor of another class carries its class), or NULL */
  PyTypeObject *torch_storage[2]; /* torch.TypedStorage, torch.UntypedStorage (or NULL) */
  const dp_torch_api_t *torch; /* the adapter, or NULL: Python-level calls */
  PyObject *cupy_ndarray;      /* cupy.ndarray once cupy is imported, else NULL */
  PyTypeObject *numpy_ndarray; /* numpy.ndarray and numpy.generic (its scalars) once numpy is */
  PyTypeObject *numpy_generic; /* imported, else NULL */
  PyTypeObject *numpy_void;    /* numpy.void (a structured scalar), with numpy_generic */
  /* What synchronizes and holds no memory of its own (scan_classify.h, K_SYNC):
   * devpickle.Future (future.c, at import), torch's future (torch._C.Future)
   * and CUDA event (torch._C._CudaEventBase) once torch is resolved. */
  PyTypeObject *sync_types[3];
} dpy_state_t;

extern dpy_state_t dpy;

/* Raises the Python exception for a library error. Returns NULL. */
PyObject *dpy_raise(int rc, const dp_error_t *e);
/* A new exception class (PyErr_NewExceptionWithDoc) whose attributes
 * `attrs` (NULL-ended) are None on the class: an instance made by hand,
 * WalkError("why"), reads them as None; devpickle's own set them. */
PyObject *dpy_new_error(const char *name, const char *doc, PyObject *base, const char *const *attrs);
/* o's items as a tuple (list: a list), as PySequence_Tuple reads them. A
 * TypeError from an o that cannot be iterated at all — one that subscripts
 * but does not iterate, typing.List — becomes "<head> a '<o's type>'<tail>",
 * naming the argument, with Python's own as its __cause__; any other error
 * (one of its __len__, or raised while iterating) is its own. */
PyObject *dpy_items(PyObject *o, int list, const char *head, const char *tail);
/* Looks torch (and its adapter), cupy and numpy up if they were imported
 * since the last look. 0, or -1 with an exception. */
int dpy_resolve_frameworks(void);

/* ---- scan (scan.c, the walk, over its layers in scan_*.c; scanners, what a
 * walk found and devpickle.scan: scan_result.c; what a build made: scan_build.c) ---- */
typedef struct dpy_scanner dpy_scanner_t;

typedef struct dpy_scan_opts {
  int paths;            /* render each allocation's first path */
  PyObject *opaque;     /* a tuple of types treated as leaves, or NULL */
  uint32_t max_depth;   /* 0: DP_DEFAULT_MAX_DEPTH */
  int build;            /* also make the devpickle value (dumps): dpy_scanner_root */
  int inline_data;      /* build for an inline frame: borrowed cpu memory (torch_api.h) is copied
                         * when found (dp_storage_set_host_data) */
  int no_refs;          /* the allocations only: a tensor met twice counts twice in the set's
                         * refs (refs are counted exactly only without `into`) */
  int chained;          /* a then() future's walk: its opaque types are its parent's (walk errors say so) */
} dpy_scan_opts_t;

/* A scanner from the module's cache (or a new one). */
dpy_scanner_t *dpy_scanner_get(void);
void dpy_scanner_put(dpy_scanner_t *s);
/* Walks obj; the allocations found go into `into`, or (NULL) into the
 * scanner's own set, cleared first: dpy_scanner_ptrs(s). 0, or -1 with an
 * exception (WalkError naming type and path). */
int dpy_scan(dpy_scanner_t *s, PyObject *obj, const dpy_scan_opts_t *opts, dp_ptrset_t *into);
const dp_ptrset_t *dpy_scanner_ptrs(const dpy_scanner_t *s);
/* Allocation i's first path (paths on), or NULL. */
const char *dpy_scanner_path(const dpy_scanner_t *s, size_t i);
/* After a build: the value made (borrowed: valid until the scanner is put
 * back), and the first Python object found on allocation i. */
dp_value_t dpy_scanner_root(const dpy_scanner_t *s);
PyObject *dpy_scanner_buffer_obj(const dpy_scanner_t *s, size_t i);
/* After a build: the WalkError, at the root (obj) and with the exception now
 * set as its cause, for a value the frame cannot carry as built (dp_pickle
 * refused it: nested deeper than a frame may be). Returns -1. */
int dpy_scanner_root_error(dpy_scanner_t *s, PyObject *obj, const char *what);
/* After a build: whether the memory the frame will read at (device, base)
 * is still where, and as large as, the walk found it (Python code run
 * since may have resized it). 0, or -1 with a WalkError. */
int dpy_scanner_recheck(dpy_scanner_t *s, dp_device_t device, const void *base);
/* 1 when the walk met a cupy array. */
int dpy_scanner_saw_cupy(const dpy_scanner_t *s);

PyObject *dpy_scan_py(PyObject *self, PyObject *args, PyObject *kw);
/* opaque= as scan() takes it (Future's too): a type, an iterable of types
 * (read once, into a tuple), None or () for none. *out: a new tuple of
 * types, or NULL for none. 0, or -1 with a TypeError naming what it got. */
int dpy_scan_opaque(PyObject *opaque, PyObject **out);
void dpy_scan_forget_types(void);
int dpy_scan_types_init(PyObject *m);

/* ---- future (future.c) ---- */
int dpy_future_types_init(PyObject *m);
PyObject *dpy_collect_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *dpy_wait_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* ---- frames (frames.c) ---- */
int dpy_frames_init(PyObject *m);
PyObject *dpy_dumps(PyObject *self, PyObject *args, PyObject *kw);
PyObject *dpy_loads(PyObject *self, PyObject *args, PyObject *kw);
/* _hash_work(items, memo, left): what hashing each of items (a list or tuple) costs (frames.c). */
PyObject *dpy_hash_work(PyObject *self, PyObject *args);
/* What a frame's class name reserved for a Python-only kind (torch.Tensor,
 * builtins.set, devpickle.global, ...) stands for ("a torch tensor"), or
 * NULL for any other name: loads reads an object of that name as that
 * kind, so dumps names no class of its own so (a WalkError). */
const char *dpy_reserved_class(const char *name);
/* Whether buffer x's items hold Python objects ('O' in its struct format,
 * also in a structured format): devpickle._devpickle._format_holds_objects(x). */
PyObject *dpy_format_holds_objects(PyObject *self, PyObject *x);

/* loads's stand-in for an object of a class its classes= did not list
 * (devpickle._object.Object): 1 when o is one, 0 when not, -1 with an
 * exception (the first one met imports devpickle._object). An Object
 * answers __getitem__ (with a TypeError saying what to list), so an
 * argument that takes sequences or iterables would take it and raise that
 * instead of its own message. */
int dpy_is_stand_in(PyObject *o);
/* The TypeError "<head> a devpickle.Object of class 'C'<tail>" for a
 * stand-in given as an argument: 1 (raised) when o is one, 0 when not, -1. */
int dpy_refuse_stand_in(PyObject *o, const char *head, const char *tail);

/* Device names as the C library writes them ("cuda:0", "cpu", "host:1"). */
PyObject *dpy_device_str(dp_device_t d);

#endif
