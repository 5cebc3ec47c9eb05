/*
 * scan_result.c — the scanner seen from outside the walk: its lifecycle
 * (dpy_scanner_get/put, from a free list), what a walk found (ext.h), and
 * devpickle.scan, whose answer is a list of devpickle.Allocation made in
 * one block from the scanner's set.
 */
#include "ext.h"
#include "scan.h"
#include "scan_build.h"
#include "scan_state.h"
#include "../../pickler/ptrset_impl.h"

#include <inttypes.h>
#include <stdint.h>
#include <string.h>

/* ---- scanners, and what a walk found ---- */

static dpy_scanner_t *free_scanners;

dpy_scanner_t *dpy_scanner_get(void) {
  dpy_scanner_t *s = free_scanners;
  if (s) {
    free_scanners = s->next_free;
    return s;
  }
  s = PyMem_Calloc(1, sizeof *s);
  if (!s) return (dpy_scanner_t *)PyErr_NoMemory();
  dp__table_init(&s->counted_tab);
  dp_error_t e;
  int rc = dp_ptrset_new(&s->found, &e);
  s->own = s->found;
  if (!rc) rc = dp_ptrset_new(&s->memo, &e);
  if (rc) {
    dp_ptrset_free(s->memo);
    dp_ptrset_free(s->found);
    PyMem_Free(s);
    return (dpy_scanner_t *)dpy_raise(rc, &e);
  }
  return s;
}

void dpy_scanner_put(dpy_scanner_t *s) {
  if (!s) return;
  dpy_refs_reset(s);
  if (s->build) dpy_build_reset(s);
  s->build = 0;
  while (s->nframes) dpy_frame_drop(&s->frames[--s->nframes]);
  Py_CLEAR(s->keep);
  Py_CLEAR(s->reprs);
  s->found = s->own;
  s->next_free = free_scanners;
  free_scanners = s;
}

const dp_ptrset_t *dpy_scanner_ptrs(const dpy_scanner_t *s) { return s->found; }

const char *dpy_scanner_path(const dpy_scanner_t *s, size_t i) {
  if (!s->want_paths || i >= s->npaths) return NULL;
  return s->text + s->path_at[i];
}

int dpy_scanner_saw_cupy(const dpy_scanner_t *s) { return s->saw_cupy; }

/* ---- devpickle.Allocation and the result of scan ---- */

/* A scan's Allocations live in one block, made at once: a list of 1,000
 * costs one allocation, not 1,000 (nor 1,000 strs: a path becomes a str
 * when first read). The block goes when its last Allocation does. */
typedef struct alloc_block {
  Py_ssize_t live; /* its Allocations not yet deallocated */
} alloc_block_t;

typedef struct alloc_obj {
  PyObject_HEAD
  dp_device_t device;
  void *ptr;
  size_t nbytes;
  uint32_t refs;
  const char *path_text; /* in the block; NULL: no path (paths=False) */
  PyObject *path;        /* the str, once read */
  alloc_block_t *block;
} alloc_obj_t;

static PyTypeObject alloc_type;

/* Device names, made once: an Allocation makes its fields on access. */
static PyObject *device_names[3][DP_CURRENT_STREAM_SLOTS];

static PyObject *device_name(dp_device_t d) {
  if ((unsigned)d.type < 3 && d.index < DP_CURRENT_STREAM_SLOTS) {
    PyObject **slot = &device_names[d.type][d.index];
    if (!*slot) *slot = dpy_device_str(d);
    return Py_XNewRef(*slot);
  }
  return dpy_device_str(d);
}

static void alloc_dealloc(PyObject *o) {
  alloc_obj_t *a = (alloc_obj_t *)o;
  Py_XDECREF(a->path);
#ifdef Py_GIL_DISABLED
  if (__atomic_sub_fetch(&a->block->live, 1, __ATOMIC_ACQ_REL) == 0) PyMem_Free(a->block);
#else
  if (--a->block->live == 0) PyMem_Free(a->block); /* under the GIL, as every dealloc */
#endif
}

/* The path, a str made on first read, or None. */
static PyObject *alloc_path(alloc_obj_t *a) {
  if (!a->path_text) return Py_NewRef(Py_None);
  if (!a->path && !(a->path = PyUnicode_FromString(a->path_text))) return NULL;
  return Py_NewRef(a->path);
}

/* An Allocation reads as a read-only mapping of these keys, in this order
 * (keys, values, items, get, in, len, iter, dict(a), **a), as well as by
 * attribute. */
static const char *const alloc_fields[] = {"device", "ptr", "nbytes", "refs", "path"};
#define ALLOC_NFIELDS 5
static PyObject *alloc_keys_tuple; /* the keys as str, made once (also Allocation._fields) */

static PyObject *alloc_field(alloc_obj_t *a, Py_ssize_t i) {
  switch (i) {
  case 0:
    return device_name(a->device);
  case 1:
    return PyLong_FromVoidPtr(a->ptr);
  case 2:
    return PyLong_FromSize_t(a->nbytes);
  case 3:
    return PyLong_FromUnsignedLong(a->refs);
  default:
    return alloc_path(a);
  }
}

static PyObject *alloc_get(PyObject *o, void *i) { return alloc_field((alloc_obj_t *)o, (Py_ssize_t)(intptr_t)i); }

/* The index of key among the fields, or -1 (a key that is not a field's
 * name, of any type). */
static Py_ssize_t alloc_index(PyObject *key) {
  Py_ssize_t n = 0;
  const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &n) : NULL;
  if (!k) PyErr_Clear();
  /* the whole key: "ptr\0x" is no field's name, though strcmp stops at its NUL */
  for (Py_ssize_t i = 0; k && i < ALLOC_NFIELDS; i++)
    if (strlen(alloc_fields[i]) == (size_t)n && !memcmp(k, alloc_fields[i], (size_t)n)) return i;
  return -1;
}

static PyObject *alloc_getitem(PyObject *o, PyObject *key) {
  Py_ssize_t i = alloc_index(key);
  if (i >= 0) return alloc_field((alloc_obj_t *)o, i);
  PyErr_SetObject(PyExc_KeyError, key);
  return NULL;
}

static PyObject *alloc_get_method(PyObject *o, PyObject *const *args, Py_ssize_t n) {
  if (!_PyArg_CheckPositional("get", n, 1, 2)) return NULL;
  Py_ssize_t i = alloc_index(args[0]);
  return i >= 0 ? alloc_field((alloc_obj_t *)o, i) : Py_NewRef(n > 1 ? args[1] : Py_None);
}

static int alloc_contains(PyObject *o, PyObject *key) {
  (void)o;
  return alloc_index(key) >= 0;
}

static Py_ssize_t alloc_len(PyObject *o) {
  (void)o;
  return ALLOC_NFIELDS;
}

static PyObject *alloc_iter(PyObject *o) {
  (void)o;
  return PyObject_GetIter(alloc_keys_tuple);
}

static PyObject *alloc_keys(PyObject *o, PyObject *unused) {
  (void)o, (void)unused;
  return Py_NewRef(alloc_keys_tuple);
}

/* The values (items: 1, (key, value) pairs) as a tuple in field order. */
static PyObject *alloc_tuple(PyObject *o, int items) {
  PyObject *t = PyTuple_New(ALLOC_NFIELDS);
  for (Py_ssize_t i = 0; t && i < ALLOC_NFIELDS; i++) {
    PyObject *v = alloc_field((alloc_obj_t *)o, i);
    if (v && items) Py_SETREF(v, PyTuple_Pack(2, PyTuple_GET_ITEM(alloc_keys_tuple, i), v));
    if (!v) Py_CLEAR(t);
    else PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}

static PyObject *alloc_values(PyObject *o, PyObject *unused) {
  (void)unused;
  return alloc_tuple(o, 0);
}

static PyObject *alloc_items(PyObject *o, PyObject *unused) {
  (void)unused;
  return alloc_tuple(o, 1);
}

static PyObject *alloc_asdict(PyObject *o, PyObject *unused) {
  (void)unused;
  PyObject *items = alloc_tuple(o, 1);
  PyObject *d = items ? PyDict_New() : NULL;
  if (d && PyDict_MergeFromSeq2(d, items, 1)) Py_CLEAR(d);
  Py_XDECREF(items);
  return d;
}

static PyObject *alloc_repr(PyObject *o) {
  alloc_obj_t *a = (alloc_obj_t *)o;
  PyObject *dev = device_name(a->device), *path = dev ? alloc_path(a) : NULL;
  /* the address as hex digits of our own: "%p" prints NULL as "0x(nil)" */
  char ptr[2 + 2 * sizeof(uintptr_t) + 1];
  PyOS_snprintf(ptr, sizeof ptr, "0x%" PRIxPTR, (uintptr_t)a->ptr);
  PyObject *r = path ? PyUnicode_FromFormat("Allocation(device=%R, ptr=%s, nbytes=%zu, refs=%u, path=%R)", dev, ptr,
                                            a->nbytes, (unsigned)a->refs, path)
                     : NULL;
  Py_XDECREF(dev);
  Py_XDECREF(path);
  return r;
}

/* An Allocation equals any mapping of the same items, as a Mapping does
 * (Mapping.__eq__ compares dict(self.items()) with dict(other.items())). */
static PyObject *alloc_eq_mapping(PyObject *a, PyObject *b, int op) {
  static PyObject *mapping_abc;
  if (!mapping_abc) {
    PyObject *abc = PyImport_ImportModule("collections.abc");
    mapping_abc = abc ? PyObject_GetAttrString(abc, "Mapping") : NULL;
    Py_XDECREF(abc);
    if (!mapping_abc) return NULL;
  }
  int is = PyDict_Check(b) ? 1 : PyObject_IsInstance(b, mapping_abc);
  if (is <= 0) return is < 0 ? NULL : Py_NewRef(Py_NotImplemented);
  PyObject *mine = alloc_asdict(a, NULL), *theirs = mine ? PyDict_New() : NULL;
  PyObject *r = NULL;
  if (theirs && !PyDict_Merge(theirs, b, 1)) r = PyObject_RichCompare(mine, theirs, op);
  Py_XDECREF(mine);
  Py_XDECREF(theirs);
  return r;
}

static PyObject *alloc_richcompare(PyObject *a, PyObject *b, int op) {
  if (op != Py_EQ && op != Py_NE) Py_RETURN_NOTIMPLEMENTED;
  if (!PyObject_TypeCheck(b, &alloc_type)) return alloc_eq_mapping(a, b, op);
  const alloc_obj_t *x = (alloc_obj_t *)a, *y = (alloc_obj_t *)b;
  int eq = dp_device_equal(x->device, y->device) && x->ptr == y->ptr && x->nbytes == y->nbytes && x->refs == y->refs;
  if (eq)
    eq = x->path_text && y->path_text ? !strcmp(x->path_text, y->path_text) : x->path_text == y->path_text;
  return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyGetSetDef alloc_getset[] = {
    {"device", alloc_get, NULL, "\"cuda:0\", \"cpu\" or \"host:0\"", (void *)0},
    {"ptr", alloc_get, NULL, "the allocation's base address (an int)", (void *)1},
    {"nbytes", alloc_get, NULL, "its size in bytes", (void *)2},
    {"refs", alloc_get, NULL, "the distinct objects (tensors, arrays, storages) found on it, by identity", (void *)3},
    {"path", alloc_get, NULL, "the first path to it (None: paths=False)", (void *)4},
    {NULL},
};

static PyMethodDef alloc_methods[] = {
    {"_asdict", alloc_asdict, METH_NOARGS, "_asdict($self, /)\n--\n\nThe allocation as a dict."},
    {"keys", alloc_keys, METH_NOARGS, "keys($self, /)\n--\n\nThe field names: device, ptr, nbytes, refs, path."},
    {"values", alloc_values, METH_NOARGS, "values($self, /)\n--\n\nThe fields' values, in keys() order."},
    {"items", alloc_items, METH_NOARGS, "items($self, /)\n--\n\n(name, value) pairs, in keys() order."},
    {"get", (PyCFunction)(void (*)(void))alloc_get_method, METH_FASTCALL,
     "get($self, key, default=None, /)\n--\n\nThe field named key, else default."},
    {NULL},
};

static PyMappingMethods alloc_mapping = {.mp_length = alloc_len, .mp_subscript = alloc_getitem};
static PySequenceMethods alloc_sequence = {.sq_contains = alloc_contains};

static PyTypeObject alloc_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "devpickle.Allocation",
    .tp_basicsize = sizeof(alloc_obj_t),
    .tp_dealloc = alloc_dealloc,
    .tp_repr = alloc_repr,
    .tp_as_mapping = &alloc_mapping,
    .tp_as_sequence = &alloc_sequence,
    .tp_iter = alloc_iter,
    .tp_richcompare = alloc_richcompare,
    /* registered as a Mapping (devpickle/__init__.py), which sets this flag
       only on heap types: match's mapping patterns read the flag */
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_MAPPING,
    .tp_doc = "One allocation found by devpickle.scan: device, ptr, nbytes, refs, path "
              "(attributes, or a read-only mapping of those keys: a[\"ptr\"], dict(a)).",
    .tp_getset = alloc_getset,
    .tp_methods = alloc_methods,
};

PyObject *dpy_device_str(dp_device_t d) {
  char buf[32];
  return PyUnicode_FromString(dp_device_format(d, buf, sizeof buf));
}

/* The scan's allocations as a list of Allocation, all in one block with
 * their paths. */
static PyObject *result_list(const dpy_scanner_t *s) {
  const dp_ptrset_t *set = s->found;
  size_t n = dp_ptrset_count(set);
  size_t head = (sizeof(alloc_block_t) + _Alignof(alloc_obj_t) - 1) / _Alignof(alloc_obj_t) * _Alignof(alloc_obj_t);
  size_t text = s->want_paths ? s->text_len : 0;
  if (n > ((size_t)PY_SSIZE_T_MAX - head - text) / sizeof(alloc_obj_t)) return PyErr_NoMemory();
  PyObject *list = PyList_New((Py_ssize_t)n);
  if (!list || !n) return list;
  alloc_block_t *b = PyMem_Malloc(head + n * sizeof(alloc_obj_t) + text);
  if (!b) {
    Py_DECREF(list);
    return PyErr_NoMemory();
  }
  alloc_obj_t *objs = (alloc_obj_t *)((char *)b + head);
  char *paths = (char *)(objs + n);
  if (text) memcpy(paths, s->text, text);
  b->live = (Py_ssize_t)n;
  for (size_t i = 0; i < n; i++) {
    const dp__pentry_t *e = &set->rest[i]; /* read in place: a call a entry cost 5 % of a list's scan */
    alloc_obj_t *a = &objs[i];
    PyObject_Init((PyObject *)a, &alloc_type);
    a->device = e->device;
    a->ptr = set->bases[i];
    a->nbytes = e->nbytes;
    a->refs = s->count_refs ? s->refs[i] : e->refs;
    const char *path = dpy_scanner_path(s, i);
    a->path_text = path ? paths + (path - s->text) : NULL;
    a->path = NULL;
    a->block = b;
    PyList_SET_ITEM(list, (Py_ssize_t)i, (PyObject *)a);
  }
  return list;
}

/* opaque='s TypeError: `head` and o's type, and for a callable given where
 * a type belongs — a factory such as threading.Lock, a function before
 * Python 3.13 — that the type of what it makes is wanted. The name's read
 * is the object's code: a missing or failing name is left out, but an
 * interrupt (not an Exception) or a MemoryError it raised passes through,
 * as the walk lets them through. -1. */
/* An attribute read for opaque_refused's hint: a new reference, or NULL,
 * cleared, where o has none or its code failed — but for an interrupt (not
 * an Exception) or a MemoryError, which stays set (*fatal). */
static PyObject *hint_attr(PyObject *o, const char *attr, int *fatal) {
  PyObject *v = PyObject_GetAttrString(o, attr);
  if (!v && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) *fatal = 1;
    else PyErr_Clear();
  }
  return v;
}

/* A type as code names it: its qualname, after its module but for
 * builtins ("int", "torch.Tensor"). A new str, or NULL with an exception. */
static PyObject *type_label(PyTypeObject *t) {
  PyObject *q = PyType_GetQualName(t);
  PyObject *m = q ? PyObject_GetAttrString((PyObject *)t, "__module__") : NULL;
  PyObject *r = NULL;
  if (m && PyUnicode_Check(m) && PyUnicode_CompareWithASCIIString(m, "builtins")) r = PyUnicode_FromFormat("%U.%U", m, q);
  else if (m) r = Py_NewRef(q);
  Py_XDECREF(q);
  Py_XDECREF(m);
  return r;
}

/* A tuple of types as code writes it, "(int, str)": a new str, or NULL
 * with an exception. */
static PyObject *type_labels(PyObject *types) {
  PyObject *parts = PyList_New(0), *r = NULL;
  for (Py_ssize_t i = 0; parts && i < PyTuple_GET_SIZE(types); i++) {
    PyObject *l = type_label((PyTypeObject *)PyTuple_GET_ITEM(types, i));
    if (!l || PyList_Append(parts, l)) {
      Py_XDECREF(l);
      Py_CLEAR(parts);
      break;
    }
    Py_DECREF(l);
  }
  PyObject *sep = parts ? PyUnicode_FromString(", ") : NULL;
  PyObject *joined = sep ? PyUnicode_Join(sep, parts) : NULL;
  if (joined) r = PyUnicode_FromFormat("(%U%s)", joined, PyTuple_GET_SIZE(types) == 1 ? "," : "");
  Py_XDECREF(parts);
  Py_XDECREF(sep);
  Py_XDECREF(joined);
  return r;
}

/* 1 when t is a tuple of types (a union's __args__), else 0. */
static int all_types(PyObject *t) {
  if (!t || !PyTuple_Check(t) || PyTuple_GET_SIZE(t) == 0) return 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++)
    if (!PyType_Check(PyTuple_GET_ITEM(t, i))) return 0;
  return 1;
}

/* opaque='s TypeError for a generic alias (list[int],
 * typing.List[int]: callable, and read as a factory by the hint below) or a
 * union of types (int | str, typing.Optional[T]), which isinstance takes but
 * opaque= does not: what to give instead. 1: raised; 0: o is neither (no
 * exception); -1: an interrupt or a MemoryError its code raised. */
static int opaque_generic_refused(const char *head, PyObject *o) {
  int fatal = 0;
  PyObject *origin = hint_attr(o, "__origin__", &fatal), *args = NULL, *text = NULL;
  int r = 0;
  if (!fatal && !(origin && PyType_Check(origin))) args = hint_attr(o, "__args__", &fatal);
  if (!fatal && ((origin && PyType_Check(origin)) || all_types(args))) {
    text = origin && PyType_Check(origin) ? type_label((PyTypeObject *)origin) : type_labels(args);
    if (!text) {
      if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) fatal = 1;
      else PyErr_Clear();
    }
  }
  if (fatal) r = -1;
  else if (text && origin && PyType_Check(origin)) {
    PyErr_Format(PyExc_TypeError, "%s '%s' (a generic alias is not a type: give its origin, %U)", head,
                 Py_TYPE(o)->tp_name, text);
    r = 1;
  } else if (text) {
    PyErr_Format(PyExc_TypeError, "%s '%s' (a union is not a type: give its types instead, %U)", head,
                 Py_TYPE(o)->tp_name, text);
    r = 1;
  }
  Py_XDECREF(origin);
  Py_XDECREF(args);
  Py_XDECREF(text);
  return r;
}

static int opaque_refused(const char *head, PyObject *o) {
  int g = opaque_generic_refused(head, o);
  if (g) return -1;
  PyObject *name = PyCallable_Check(o) ? PyObject_GetAttrString(o, "__qualname__") : NULL;
  if (!name && PyErr_Occurred() &&
      (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)))
    return -1;
  PyErr_Clear();
  if (name && PyUnicode_Check(name))
    PyErr_Format(PyExc_TypeError, "%s '%s' (%U is callable, not a type: give the type of what it makes, as "
                 "type(threading.Lock()) for threading.Lock)", head, Py_TYPE(o)->tp_name, name);
  else PyErr_Format(PyExc_TypeError, "%s '%s'", head, Py_TYPE(o)->tp_name);
  Py_XDECREF(name);
  return -1;
}

int dpy_scan_opaque(PyObject *opaque, PyObject **out) {
  *out = NULL;
  if (!opaque || opaque == Py_None) return 0;
  /* loads's stand-in answers __getitem__ with its own TypeError: named here */
  int r = dpy_refuse_stand_in(opaque, "opaque= takes types: a type or an iterable of types, not", "");
  if (r) return -1;
  /* a generic alias or a union is iterable (PEP 646's unpacking)
     or subscriptable, so told what to give before it is read as items */
  if (!PyType_Check(opaque) && !PyTuple_CheckExact(opaque) && !PyList_CheckExact(opaque) &&
      !PyAnySet_CheckExact(opaque) &&
      opaque_generic_refused("opaque= takes types: a type or an iterable of types, not a", opaque))
    return -1;
  if (PyType_Check(opaque)) opaque = PyTuple_Pack(1, opaque);
  else if (!Py_TYPE(opaque)->tp_iter && !PySequence_Check(opaque)) {
    /* named, as classes= is: "'int' object is not iterable" says not which argument */
    return opaque_refused("opaque= takes types: a type or an iterable of types, not a", opaque);
  } else opaque = dpy_items(opaque, 0, "opaque= takes types: a type or an iterable of types, not", "");
  if (!opaque) return -1;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(opaque); i++)
    if (!PyType_Check(PyTuple_GET_ITEM(opaque, i))) {
      if (!dpy_refuse_stand_in(PyTuple_GET_ITEM(opaque, i), "opaque= takes types; got", ""))
        opaque_refused("opaque= takes types; got a", PyTuple_GET_ITEM(opaque, i));
      Py_DECREF(opaque);
      return -1;
    }
  if (PyTuple_GET_SIZE(opaque) == 0) Py_CLEAR(opaque);
  *out = opaque;
  return 0;
}

PyObject *dpy_scan_py(PyObject *self, PyObject *args, PyObject *kw) {
  (void)self;
  static char *kwlist[] = {"obj", "paths", "opaque", NULL};
  PyObject *obj, *opaque = NULL;
  int paths = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$pO:scan", kwlist, &obj, &paths, &opaque)) return NULL;
  dpy_scan_opts_t o = {.paths = paths};
  if (dpy_scan_opaque(opaque, &o.opaque)) return NULL;
  dpy_scanner_t *s = dpy_scanner_get();
  PyObject *res = NULL;
  if (s && !dpy_scan(s, obj, &o, NULL)) res = result_list(s);
  dpy_scanner_put(s);
  Py_XDECREF(o.opaque);
  return res;
}

int dpy_scan_types_init(PyObject *m) {
  alloc_keys_tuple = PyTuple_New(ALLOC_NFIELDS);
  for (Py_ssize_t i = 0; alloc_keys_tuple && i < ALLOC_NFIELDS; i++) {
    PyObject *k = PyUnicode_InternFromString(alloc_fields[i]);
    if (!k) return -1;
    PyTuple_SET_ITEM(alloc_keys_tuple, i, k);
  }
  if (dpy_managed_layout_init(m)) return -1;
  if (!alloc_keys_tuple || PyType_Ready(&alloc_type) ||
      PyDict_SetItemString(alloc_type.tp_dict, "_fields", alloc_keys_tuple))
    return -1;
  PyType_Modified(&alloc_type);
  Py_INCREF(&alloc_type);
  if (PyModule_AddObject(m, "Allocation", (PyObject *)&alloc_type)) return -1;
  return 0;
}
