/*
 * scan_build.c — the walk's build mode (dumps): the devpickle value made
 * as the walk visits (scan_build.h).
 */
#include "scan_build.h"
#include "scan_classify.h"
#include "scan_memory.h"
#include "scan_path.h"
#include "scan_reduce.h"

#include <string.h>

/* ---- building a value (dumps) ----
 *
 * The same walk, in build mode, makes the devpickle value that dp_pickle
 * writes: each value visited is made and attached to the slot of the frame
 * above it; a container is made before its children, so shared references
 * and cycles point at the same node (the memo keeps a value per entry).
 * Python-only kinds become objects with reserved class names, which loads()
 * turns back (docs/PYTHON.md, "Frames"):
 *   torch.Tensor / numpy.ndarray / cupy.ndarray {data: tensor}
 *   builtins.set / builtins.frozenset {items: [...]}, builtins.complex
 *   {real, imag}, builtins.bytearray {data: bytes}, devpickle.global {name}
 *   (a class or function, pickled by name); an object whose class keeps
 *   pickle's defaults has its attributes; any other reduced object has
 *   "<callable>", "<args>", "<state>", "<listitems>", "<dictitems>".
 */

static int dp_fail(dpy_scanner_t *s, PyObject *o, int rc, const dp_error_t *e) {
  if (rc == DP_ENOMEM) {
    PyErr_NoMemory();
    return -1;
  }
  PyErr_SetString(PyExc_ValueError, e->message);
  return dpy_walk_error(s, o, "it cannot be carried in a frame");
}

static int memo_store(dpy_scanner_t *s, size_t at, dp_value_t v) {
  if (at >= s->vals_cap) {
    size_t cap = s->vals_cap ? s->vals_cap : 64;
    while (cap <= at) cap *= 2;
    dp_value_t *nv = PyMem_Realloc(s->vals, cap * sizeof *nv);
    if (!nv) {
      PyErr_NoMemory();
      return -1;
    }
    for (size_t i = s->vals_cap; i < cap; i++) nv[i] = dp_none();
    s->vals = nv;
    s->vals_cap = cap;
  }
  s->vals[at] = dp_value_retain(v);
  return 0;
}

static const char *const reduce_part[] = {"<callable>", "<args>",      "<state>",
                                          "<listitems>", "<dictitems>", "<state_setter>"};

/* A leaf key of a dict, as a devpickle key. */
static int build_leaf(dpy_scanner_t *s, PyObject *o, dp_value_t *out);

/* Sets attribute `name` (a str) of obj to v (stolen): a name that is not
 * a str, holds a NUL, starts with '<' (a reduce part's name), or is already
 * set (two namedtuple fields of one name) is a walk error — a frame's names
 * are C strings, an object is never read back as another form, and one
 * attribute never silently replaces another. */
static int set_attr(dpy_scanner_t *s, PyObject *o, dp_value_t obj, PyObject *name, dp_value_t v) {
  Py_ssize_t n;
  const char *c = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &n) : NULL;
  const char *why = NULL;
  if (!c) why = "an attribute name that is not a str (or not UTF-8)";
  else if ((size_t)n != strlen(c)) why = "an attribute name that holds a NUL";
  else if (c[0] == '<')
    /* loads reads an object holding one as a reduced object's parts */
    why = "an attribute name that starts with '<', as a reduced object's parts are named in a frame (<callable>, "
          "<args>, <state>, ...)";
  else if (dp_object_get(obj, c, NULL, NULL) == 0) why = "two attributes of one name";
  if (why) {
    dp_value_release(v);
    if (c || !PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception)) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "%s: %R", why, name);
    }
    return dpy_walk_error(s, o, "it cannot be carried in a frame");
  }
  dp_error_t e;
  int rc = dp_object_set(obj, c, v, &e);
  return rc ? dp_fail(s, o, rc, &e) : 0;
}

/* Puts v (stolen) in the slot of the top frame, or makes it the root. */
static int attach(dpy_scanner_t *s, PyObject *o, dp_value_t v) {
  dp_error_t e;
  int rc = 0;
  if (!s->nframes) {
    s->root = v;
    return 0;
  }
  frame_t *f = &s->frames[s->nframes - 1];
  switch (f->kind) {
  case FR_SEQ:
  case FR_SET:
    if (f->names && f->idx < PyTuple_GET_SIZE(f->names)) {
      return set_attr(s, o, f->out, PyTuple_GET_ITEM(f->names, f->idx), v);
    } else if (dp_value_kind(f->out) == DP_TUPLE) {
      rc = dp_seq_set(f->out, (size_t)f->idx, v, &e);
    } else {
      rc = dp_list_append(f->out, v, &e);
    }
    break;
  case FR_ATTRS:
    return set_attr(s, o, f->out, f->label, v);
  case FR_DICT:
  case FR_PAIRS:
    if (f->key_part) { /* the key itself, walked: kept for its value */
      f->key = v;
      f->has_key = 1;
      return 0;
    }
    {
      dp_value_t k;
      if (f->has_key) {
        k = f->key;
        f->has_key = 0;
      } else if (build_leaf(s, f->label, &k)) {
        dp_value_release(v);
        return -1;
      }
      if (f->kind == FR_DICT) {
        size_t before = dp_dict_len(f->out);
        rc = dp_dict_set(f->out, k, v, &e);
        /* what a frame's dict refuses is the key (a tuple nested too deep, a
           kind a key cannot be): named by its type, not by the value's */
        if (rc == DP_ETYPE && f->label) {
          /* the library names its own kinds ("kind object": a frozenset,
             a complex, a class): say which Python keys a frame holds */
          PyErr_Format(PyExc_ValueError, "a frame's dict keys are None, bool, int, float, str, bytes and tuples of "
                                         "those (%s)",
                       dp_value_kind(k) == DP_OBJECT ? "this one would be an object in the frame" : e.message);
          return dpy_walk_error(s, f->label, "it cannot be a frame's dict key");
        }
        if (rc && rc != DP_ENOMEM && f->label) return dp_fail(s, f->label, rc, &e);
        if (!rc && dp_dict_len(f->out) == before) {
          /* never a silent merge: keys Python keeps apart (two NaN objects,
             tuples holding them) that a frame's keys would make one */
          PyErr_SetString(PyExc_ValueError, "two keys of this dict are one key in a frame (floats compare by their "
                                            "bits there: two NaN objects, or tuples holding them, are one key)");
          return dpy_walk_error(s, f->obj, "it cannot be carried in a frame"); /* the dict */
        }
      } else {
        dp_value_t pair;
        rc = dp_tuple_new(2, &pair, &e);
        if (rc) {
          dp_value_release(k);
          dp_value_release(v);
          break;
        }
        dp_seq_set(pair, 0, k, NULL);
        dp_seq_set(pair, 1, v, NULL);
        rc = dp_list_append(f->out, pair, &e);
      }
    }
    break;
  case FR_REDUCE:
    rc = dp_object_set(f->out, reduce_part[f->idx], v, &e);
    break;
  }
  return rc ? dp_fail(s, o, rc, &e) : 0;
}

/* An object of a reserved class with one attribute. */
static int wrap(dpy_scanner_t *s, PyObject *o, const char *cls, const char *attr, dp_value_t v, dp_value_t *out) {
  dp_error_t e;
  int rc = dp_object_new(cls, out, &e);
  if (rc) {
    dp_value_release(v);
    return dp_fail(s, o, rc, &e);
  }
  rc = dp_object_set(*out, attr, v, &e);
  if (rc) {
    dp_value_release(*out);
    return dp_fail(s, o, rc, &e);
  }
  return 0;
}

/* A class's or function's name as a global, module.qualname, kept in *hold
 * (a new reference), *len bytes long: NULL when it has none, or with a
 * MemoryError. *text is cleared when a __module__ or __qualname__ (or
 * __name__) that is a str is no UTF-8 (a lone surrogate): the name then
 * made without it would be another global's. */
static const char *global_name(PyObject *o, PyObject **hold, Py_ssize_t *len, int *text) {
  *text = 1;
  PyObject *mod = PyObject_GetAttrString(o, "__module__");
  if (!mod) dpy_clear_error();
  PyObject *qual = PyObject_GetAttrString(o, "__qualname__");
  if (!qual) {
    dpy_clear_error();
    qual = PyObject_GetAttrString(o, "__name__");
  }
  Py_ssize_t mn = 0, qn = 0;
  const char *m = mod && PyUnicode_Check(mod) ? PyUnicode_AsUTF8AndSize(mod, &mn) : NULL;
  dpy_clear_error();
  const char *q = qual && PyUnicode_Check(qual) ? PyUnicode_AsUTF8AndSize(qual, &qn) : NULL;
  dpy_clear_error();
  if ((mod && PyUnicode_Check(mod) && !m) || (qual && PyUnicode_Check(qual) && !q)) {
    *text = 0;
    Py_XDECREF(mod);
    Py_XDECREF(qual);
    *hold = NULL;
    return NULL;
  }
  /* whole, however long (a fixed buffer cut it), and past a NUL byte (a
     format's %s cut it there: another global's name) */
  *hold = q ? PyBytes_FromStringAndSize(NULL, (m ? mn + 1 : 0) + qn) : NULL;
  if (*hold) {
    char *p = PyBytes_AS_STRING(*hold);
    if (m) {
      memcpy(p, m, (size_t)mn);
      p[mn] = '.';
      p += mn + 1;
    }
    memcpy(p, q, (size_t)qn);
    *len = PyBytes_GET_SIZE(*hold);
  }
  Py_XDECREF(mod);
  Py_XDECREF(qual);
  return *hold ? PyBytes_AS_STRING(*hold) : NULL;
}

/* 1 when importing module `mod` and looking up the dotted `name` in it
 * gives o (pickle's check of a global), 0 when not, -1 with an exception
 * that is not an import's or a lookup's. */
static int resolves_to(PyObject *mod, PyObject *name, PyObject *o) {
  static PyObject *dot;
  if (!dot && !(dot = PyUnicode_InternFromString("."))) return -1;
  PyObject *x = PyImport_Import(mod), *parts = x ? PyUnicode_Split(name, dot, -1) : NULL;
  for (Py_ssize_t i = 0; x && parts && i < PyList_GET_SIZE(parts); i++)
    Py_SETREF(x, PyObject_GetAttr(x, PyList_GET_ITEM(parts, i)));
  int same = x && parts ? x == o : -1;
  Py_XDECREF(x);
  Py_XDECREF(parts);
  if (same < 0 && (PyErr_ExceptionMatches(PyExc_ImportError) || PyErr_ExceptionMatches(PyExc_AttributeError))) {
    PyErr_Clear();
    same = 0;
  }
  return same;
}

/* An object whose reduce is a str: a global, pickle's module.name — the
 * module from pickle.whichmodule, as pickle finds it, and refused as pickle
 * refuses it when that name is not the object — as devpickle.global
 * {name}. */
static int global_of(dpy_scanner_t *s, PyObject *o, PyObject *name, dp_value_t *out) {
  PyObject *pickle = PyImport_ImportModule("pickle");
  PyObject *mod = pickle ? PyObject_CallMethod(pickle, "whichmodule", "OO", o, name) : NULL;
  Py_XDECREF(pickle);
  int same = mod && PyUnicode_Check(mod) ? resolves_to(mod, name, o) : -1;
  if (same == 0)
    PyErr_Format(PyExc_TypeError, "its reduce names the global %U.%U, which is not it (pickle refuses it too)", mod,
                 name);
  PyObject *full = same == 1 ? PyUnicode_FromFormat("%U.%U", mod, name) : NULL;
  Py_XDECREF(mod);
  Py_ssize_t n;
  const char *c = full ? PyUnicode_AsUTF8AndSize(full, &n) : NULL;
  if (!c) {
    Py_XDECREF(full);
    return dpy_walk_error(s, o, "its global name cannot be found");
  }
  dp_value_t str;
  dp_error_t e;
  int rc = dp_str_new(c, (size_t)n, &str, &e);
  Py_DECREF(full);
  if (rc) return dp_fail(s, o, rc, &e);
  return wrap(s, o, "devpickle.global", "name", str, out);
}

static int build_leaf(dpy_scanner_t *s, PyObject *o, dp_value_t *out) {
  dp_error_t e;
  int rc = 0;
  if (o == Py_None) *out = dp_none();
  else if (PyBool_Check(o)) *out = dp_bool(o == Py_True);
  else if (PyLong_CheckExact(o)) {
    int over;
    long long x = PyLong_AsLongLongAndOverflow(o, &over);
    if (over) {
      PyErr_SetString(PyExc_OverflowError, "an int outside int64 (a frame's integers are 64-bit signed)");
      return dpy_walk_error(s, o, "it cannot be carried in a frame");
    }
    *out = dp_int(x);
  } else if (PyFloat_CheckExact(o)) *out = dp_float(PyFloat_AS_DOUBLE(o));
  else if (PyUnicode_CheckExact(o)) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(o, &n);
    if (!u) return dpy_walk_error(s, o, "a str that is not valid UTF-8");
    rc = dp_str_new(u, (size_t)n, out, &e);
  } else if (PyBytes_CheckExact(o)) {
    rc = dp_bytes_new(PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o), out, &e);
  } else if (PyComplex_CheckExact(o)) {
    rc = dp_object_new("builtins.complex", out, &e);
    if (!rc) rc = dp_object_set(*out, "real", dp_float(PyComplex_RealAsDouble(o)), &e);
    if (!rc) rc = dp_object_set(*out, "imag", dp_float(PyComplex_ImagAsDouble(o)), &e);
  } else if (PyTuple_CheckExact(o)) { /* a dict key: a tuple of keys */
    Py_ssize_t n = PyTuple_GET_SIZE(o);
    rc = dp_tuple_new((size_t)n, out, &e);
    for (Py_ssize_t i = 0; !rc && i < n; i++) {
      dp_value_t it;
      if (build_leaf(s, PyTuple_GET_ITEM(o, i), &it)) {
        dp_value_release(*out);
        return -1;
      }
      rc = dp_seq_set(*out, (size_t)i, it, &e);
    }
  } else {
    PyObject *hold;
    Py_ssize_t len = 0;
    int text;
    const char *name = global_name(o, &hold, &len, &text);
    if (!name) {
      if (PyErr_Occurred()) return -1; /* out of memory */
      PyErr_SetString(PyExc_TypeError, text ? "a class or function without a name"
                                            : "a class or function whose __module__ or __qualname__ is no UTF-8 "
                                              "(a lone surrogate): a frame would name it as another");
      return dpy_walk_error(s, o, "it cannot be carried in a frame");
    }
    dp_value_t n;
    rc = dp_str_new(name, (size_t)len, &n, &e);
    Py_XDECREF(hold);
    if (!rc) return wrap(s, o, "devpickle.global", "name", n, out);
  }
  return rc ? dp_fail(s, o, rc, &e) : 0;
}

static int check_storage(dpy_scanner_t *s, size_t i);

/* A tensor over allocation (dev, base, nbytes): one storage per allocation,
 * shared by every view of it. Borrowed cpu memory (torch_api.h) in an inline
 * frame is copied here, when the walk meets it, as pickle reads it: its
 * owner (the ndarray of torch.from_numpy) may free it under the Python code
 * the rest of the walk runs while torch's storage still reports it, so no
 * later check could see that it went. */
static int build_tensor(dpy_scanner_t *s, PyObject *o, dp_device_t dev, void *base, size_t nbytes, int borrowed,
                        const char *dtype, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset, dp_value_t *out) {
  size_t at;
  /* a storage of no bytes is none, wherever it points (from_numpy(a[10:])
     points at a's memory): its buffer is the empty one at address 0, as
     torch.zeros(0)'s, never one at an address that holds another's bytes,
     which it would take for itself */
  if (!nbytes) base = NULL;
  if (dpy_add_alloc_at(s, dev, base, nbytes, o, &at)) return -1;
  if (at >= s->stor_cap) {
    size_t cap = s->stor_cap ? s->stor_cap : 16;
    while (cap <= at) cap *= 2;
    dp_storage_t **ns = PyMem_Realloc(s->stor, cap * sizeof *ns);
    if (!ns) return PyErr_NoMemory(), -1;
    s->stor = ns;
    PyObject **no = PyMem_Realloc(s->stor_obj, cap * sizeof *no);
    if (!no) return PyErr_NoMemory(), -1;
    s->stor_obj = no;
    PyObject **nt = PyMem_Realloc(s->stor_st, cap * sizeof *nt);
    if (!nt) return PyErr_NoMemory(), -1;
    s->stor_st = nt;
    for (size_t i = s->stor_cap; i < cap; i++) s->stor[i] = NULL, s->stor_obj[i] = NULL, s->stor_st[i] = NULL;
    s->stor_cap = cap;
  }
  dp_error_t e;
  int rc;
  if (!s->stor[at]) {
    dp_ptr_info_t p;
    dp_ptrset_get(s->found, at, &p, NULL);
    if ((rc = dp_storage_new(dev, base, p.nbytes, NULL, NULL, &s->stor[at], &e))) return dp_fail(s, o, rc, &e);
    s->stor_obj[at] = Py_NewRef(o); /* for buffer_callback, whatever Python code does meanwhile */
    /* A tensor holds its storage only while nothing changes it: a reduce run
     * later in the walk may t.set_() it away and free the memory the frame
     * will read. The storage itself is kept until dumps ends. */
    if (dpy_is_torch(o)) {
      PyObject *st = dpy_untyped_storage(o);
      if (!st) return dpy_walk_error(s, o, "its storage cannot be held");
      s->stor_st[at] = st;
    }
    /* the attribute reads since the memory was found may have run a
       subclass's code: checked again, then read with no Python code between */
    if (borrowed && s->copy_borrowed && dev.type == DP_DEVICE_CPU && p.nbytes) {
      if (check_storage(s, at)) return -1;
      if ((rc = dp_storage_set_host_data(s->stor[at], p.base, &e))) return dp_fail(s, o, rc, &e);
    }
  }
  dp_dtype_t dt;
  if (dp_dtype_parse(dtype, &dt, &e)) {
    PyErr_Format(PyExc_TypeError, "dtype %s has no devpickle equivalent", dtype);
    return dpy_walk_error(s, o, "it cannot be carried in a frame");
  }
  size_t had = dp_storage_nbytes(s->stor[at]);
  rc = dp_tensor_new(dp_storage_retain(s->stor[at]), dt, ndim, shape, strides, offset, out, &e);
  if (rc && nbytes > had) {
    /* two storages that start at one address (borrowed memory: from_numpy
       of a[:2] and of a, an UntypedStorage and its slice u[:8]): a frame
       carries one buffer there, the size of the first met, which this
       view runs past. Said so, not as the library's bounds check. */
    PyErr_Format(PyExc_ValueError,
                 "its memory (%zu bytes) starts where the walk met %zu bytes of another tensor's or array's first "
                 "(two storages at one address, as torch.from_numpy of a[:2] and of a): a frame carries one buffer "
                 "an address, the size met first, and this view runs past its end (put the larger first)",
                 nbytes, had);
    return dpy_walk_error(s, o, "it cannot be carried in a frame");
  }
  return rc ? dp_fail(s, o, rc, &e) : 0;
}

static int int64_seq(PyObject *seq, int64_t *out, int max) {
  PyObject *t = PySequence_Tuple(seq);
  if (!t) return -1;
  Py_ssize_t n = PyTuple_GET_SIZE(t);
  if (n > max) {
    Py_DECREF(t);
    PyErr_SetString(PyExc_ValueError, "too many dimensions");
    return -1;
  }
  for (Py_ssize_t i = 0; i < n && !PyErr_Occurred(); i++) out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
  Py_DECREF(t);
  return PyErr_Occurred() ? -1 : (int)n;
}

#define MAX_DIMS 64

/* torch's own attribute `name` of tensor o (a new reference; called, when
 * `call`, with no arguments: a method), read through the descriptor
 * torch.Tensor's base class defines, never through what a subclass defines
 * under that name: a property `dtype` or `shape`, or a method `stride`, of
 * its own would describe other memory than the tensor's, and the frame
 * would carry another tensor (its bytes read as another dtype, part of
 * them). A subclass's __torch_function__ still answers, as torch's own
 * descriptors ask it (pickle's reduce reads these through it too). Where
 * torch has no such descriptor (an older torch), read as any attribute:
 * NULL with AttributeError where it has none. */
static PyObject *tensor_own(PyObject *o, const char *name, int call) {
  /* the names, interned once: a handful of string literals */
  static struct {
    const char *name;
    PyObject *key;
  } keys[16];
  PyObject *key = NULL, *v = NULL;
  for (size_t i = 0; !key && i < sizeof keys / sizeof *keys; i++) {
    if (!keys[i].name) {
      if (!(keys[i].key = PyUnicode_InternFromString(name))) return NULL;
      keys[i].name = name;
    }
    if (keys[i].name == name || !strcmp(keys[i].name, name)) key = keys[i].key;
  }
  if (!key) key = PyUnicode_InternFromString(name);
  else Py_INCREF(key);
  if (!key) return NULL;
  PyObject *d = dpy.torch_tensor_cls && PyType_Check(dpy.torch_tensor_cls)
                    ? _PyType_Lookup((PyTypeObject *)dpy.torch_tensor_cls, key)
                    : NULL;
  if (d && Py_TYPE(d)->tp_descr_get) {
    Py_INCREF(d); /* borrowed from the type's dict, which the getter's code may change */
    v = Py_TYPE(d)->tp_descr_get(d, o, (PyObject *)Py_TYPE(o));
    Py_DECREF(d);
  } else if (!PyErr_Occurred()) {
    v = PyObject_GetAttr(o, key);
  }
  Py_DECREF(key);
  if (v && call) Py_SETREF(v, PyObject_CallNoArgs(v));
  return v;
}

/* A tensor that requires grad carries it (attribute requires_grad: true),
 * as torch's pickling does; loads makes it a leaf that requires grad (its
 * graph, like pickle's, is not carried). */
static int carry_requires_grad(dpy_scanner_t *s, PyObject *o, dp_value_t obj) {
  PyObject *rg = tensor_own(o, "requires_grad", 0);
  int yes = rg ? PyObject_IsTrue(rg) : -1;
  Py_XDECREF(rg);
  if (yes < 0) return dpy_walk_error(s, o, "its requires_grad cannot be read");
  if (!yes) return 0;
  dp_error_t e;
  int rc = dp_object_set(obj, "requires_grad", dp_bool(1), &e);
  return rc ? dp_fail(s, o, rc, &e) : 0;
}

/* A tensor of a subclass (nn.Parameter, a user's) carries its class's name
 * (attribute subclass: "module.qualname"); loads makes that class again
 * where classes= allows it (docs/PYTHON.md). */
static int carry_subclass(dpy_scanner_t *s, PyObject *o, dp_value_t obj) {
  PyObject *hold;
  const char *name = dpy_frame_class(s, o, Py_TYPE(o), &hold);
  if (!name) return -1;
  /* loads makes torch's Parameter and Buffer of these names whatever
     classes= lists: a class of one's own so named would come back as
     torch's (a silent change of type), so it is refused as a class named
     as a reserved one is (dpy_frame_class) */
  const char *own = !strcmp(name, "torch.nn.parameter.Parameter") ? "Parameter"
                    : !strcmp(name, "torch.nn.parameter.Buffer")  ? "Buffer"
                                                                  : NULL;
  if (own) {
    PyObject *mod = PyImport_ImportModule("torch.nn.parameter");
    PyObject *real = mod ? PyObject_GetAttrString(mod, own) : NULL;
    /* a torch without the class (Buffer before 2.5) makes none of it: loads
       gives a devpickle.Object of that name, as for any class */
    if (!real && mod && PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      own = NULL;
    }
    Py_XDECREF(mod);
    int same = real && (PyObject *)Py_TYPE(o) == real;
    Py_XDECREF(real);
    if (!real && own) { /* its error stands (an interrupt too) */
      Py_XDECREF(hold);
      return dpy_walk_error(s, o, "its class cannot be named in a frame");
    }
    if (own && !same) {
      PyErr_Format(PyExc_TypeError,
                   "its class is named '%s', the name of torch's own %s, which loads makes of it: give the class "
                   "another __module__ or __qualname__",
                   name, own);
      Py_XDECREF(hold);
      return dpy_walk_error(s, o, "its class cannot be named in a frame");
    }
  }
  dp_value_t v;
  dp_error_t e;
  int rc = dp_str_new(name, strlen(name), &v, &e);
  Py_XDECREF(hold);
  if (!rc) rc = dp_object_set(obj, "subclass", v, &e);
  return rc ? dp_fail(s, o, rc, &e) : 0;
}

/* 1 when torch's method `name` (is_conj, is_neg) says yes, 0 when it says
 * no or this torch has no such method, -1 with an exception. */
static int tensor_bit(PyObject *o, const char *name) {
  PyObject *r = tensor_own(o, name, 1);
  if (!r) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    return 0;
  }
  int yes = PyObject_IsTrue(r);
  Py_DECREF(r);
  return yes;
}

/* What a frame has no field for, so that the tensor would come back silently
 * different: a conjugate or negative view (t.conj() of a complex tensor,
 * torch._neg_view) keeps the other values in memory and a bit that says so,
 * and a named tensor its dimension names (pickle refuses it too). A frame
 * carries dtype, shape, strides and offset; resolving a view would copy the
 * buffer, which a frame never does: each is refused, as sparse tensors are. */
static int refuse_unframed(dpy_scanner_t *s, PyObject *o) {
  /* a nested tensor's one buffer holds tensors of different shapes, which
     its own sizes tensor says: it has no shape or strides of its own (torch
     raises an "internal error" for them, sending the user to its tracker) */
  PyObject *nested = tensor_own(o, "is_nested", 0);
  int is_nested = nested ? PyObject_IsTrue(nested) : 0;
  Py_XDECREF(nested);
  if (!nested && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear(); /* a torch without them */
  else if (is_nested < 0 || !nested) return dpy_walk_error(s, o, "a tensor whose memory cannot be described");
  if (is_nested) {
    PyErr_SetString(PyExc_TypeError, "a nested tensor is not carried in frames: a frame has no field for its "
                                     "tensors' sizes (send t.unbind(), its tensors, instead)");
    return dpy_walk_error(s, o, "it cannot be carried in a frame");
  }
  int conj = tensor_bit(o, "is_conj");
  int neg = conj ? 0 : tensor_bit(o, "is_neg");
  int named = conj || neg ? 0 : tensor_bit(o, "has_names");
  if (conj < 0 || neg < 0 || named < 0) return dpy_walk_error(s, o, "a tensor whose memory cannot be described");
  if (!conj && !neg && !named) return 0;
  if (named)
    PyErr_SetString(PyExc_TypeError, "a named tensor is not carried in frames: a frame has no field for its "
                                     "dimension names (call rename(None) first)");
  else
    PyErr_Format(PyExc_TypeError,
                 "a %s view is not carried in frames: its memory holds other values than it reads "
                 "(call %s() first)",
                 conj ? "conjugate" : "negative", conj ? "resolve_conj" : "resolve_neg");
  return dpy_walk_error(s, o, "it cannot be carried in a frame");
}

static int build_torch(dpy_scanner_t *s, PyObject *o, dp_value_t *out) {
  /* a subclass's __torch_function__ runs the value's code on every attribute
     read below (dtype, shape, stride(), ...): dpy_check_storages looks again */
  dp_torch_alloc_t a[DP_TORCH_MAX_ALLOCS];
  int n = dpy_torch_allocs(o, a);
  if (n < 0) return dpy_walk_error(s, o, "a tensor whose memory cannot be described");
  int own = dpy_own_tensor_reduce(o); /* pickle carries what that returns, which a frame has no field for */
  if (own) {
    if (own > 0)
      PyErr_SetString(PyExc_TypeError, "a tensor with a reduce of its own (its class's __reduce_ex__, one set on it, or "
                                       "copyreg.dispatch_table's) is not carried in frames: a frame carries a tensor's data, not what its reduce returns");
    return dpy_walk_error(s, o, own > 0 ? "it cannot be carried in a frame" : "its reduce cannot be looked up");
  }
  PyObject **dp = _PyObject_GetDictPtr(o);
  PyObject *d = dp && *dp && PyDict_Check(*dp) ? *dp : NULL;
  int state = 0; /* what its own __getstate__ returns, which torch's pickling carries */
  if (dpy_own_getstate(Py_TYPE(o))) {
    PyObject *st = PyObject_CallMethodNoArgs(o, dpy.str_getstate);
    if (!st) return dpy_walk_error(s, o, "its __getstate__ failed");
    state = st != Py_None;
    Py_DECREF(st);
  } else if (dpy_tensor_slots(s, o, &d)) {
    return -1;
  }
  if (state || (d && PyDict_GET_SIZE(d))) {
    PyErr_SetString(PyExc_TypeError, "a tensor's attributes (a subclass's state) are not carried in frames");
    return dpy_walk_error(s, o, "it cannot be carried in a frame");
  }
  if (n != 1) {
    PyErr_SetString(PyExc_TypeError, "a tensor over more than one storage (a sparse tensor, a per-channel quantized "
                                     "one) is not carried in frames (make a sparse tensor dense, or send its indices "
                                     "and values; send a quantized one's int_repr() and its scales and zero points)");
    return dpy_walk_error(s, o, "it cannot be carried in a frame");
  }
  if (refuse_unframed(s, o)) return -1;
  int64_t shape[MAX_DIMS], strides[MAX_DIMS];
  /* each read only once the one before it succeeded: a subclass's
     __torch_function__ runs for each, and must not run under an exception
     (an interrupt) the one before raised */
  PyObject *dtype = tensor_own(o, "dtype", 0);
  PyObject *dstr = dtype ? PyObject_Str(dtype) : NULL;
  PyObject *shp = dstr ? tensor_own(o, "shape", 0) : NULL;
  PyObject *str = shp ? tensor_own(o, "stride", 1) : NULL;
  PyObject *off = str ? tensor_own(o, "storage_offset", 1) : NULL;
  int nd = -1, nd2 = -1;
  int64_t offset = 0;
  if (off) {
    nd = int64_seq(shp, shape, MAX_DIMS);
    nd2 = nd < 0 ? -1 : int64_seq(str, strides, MAX_DIMS);
    if (nd2 == nd) offset = PyLong_AsLongLong(off);
  }
  const char *ds = dstr ? PyUnicode_AsUTF8(dstr) : NULL;
  int rc = -1;
  if (ds && nd >= 0 && nd2 == nd && !PyErr_Occurred()) {
    if (!strncmp(ds, "torch.", 6)) ds += 6;
    dp_value_t t;
    rc = build_tensor(s, o, (dp_device_t){(dp_device_type_t)a[0].device_type, (uint8_t)a[0].device_index},
                      a[0].base, a[0].nbytes, a[0].borrowed, ds, nd, shape, strides, offset, &t);
    if (!rc) rc = wrap(s, o, "torch.Tensor", "data", t, out);
    if (!rc) rc = carry_requires_grad(s, o, *out);
    if (!rc && (PyObject *)Py_TYPE(o) != dpy.torch_tensor_cls) rc = carry_subclass(s, o, *out);
  }
  Py_XDECREF(dtype);
  Py_XDECREF(dstr);
  Py_XDECREF(shp);
  Py_XDECREF(str);
  Py_XDECREF(off);
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return dpy_walk_error(s, o, "a tensor that cannot be described");
  return rc;
}

/* numpy's typestr ("<f4") as a devpickle dtype name. */
static const char *typestr_dtype(const char *ts) {
  static const struct {
    const char *ts, *name;
  } map[] = {{"|b1", "bool"},     {"|i1", "int8"},      {"<i2", "int16"},      {"<i4", "int32"},   {"<i8", "int64"},
             {"|u1", "uint8"},    {"<u2", "uint16"},    {"<u4", "uint32"},     {"<u8", "uint64"},  {"<f2", "float16"},
             {"<f4", "float32"},  {"<f8", "float64"},   {"<c8", "complex64"},  {"<c16", "complex128"}};
  for (size_t i = 0; i < sizeof map / sizeof *map; i++)
    if (!strcmp(ts, map[i].ts)) return map[i].name;
  return NULL;
}

static int build_view(dpy_scanner_t *s, PyObject *o, int cupy, const char *dt, int nd, const int64_t *shape,
                      int64_t *strides, int have_strides, char *ptr, dp_value_t *out);

/* numpy.ndarray's own strides of array o (a new reference), read through
 * ndarray's descriptor; NULL (maybe with an exception) otherwise. */
static PyObject *ndarray_strides(PyObject *o) {
  static PyObject *descr;
  if (!dpy.numpy_ndarray || !PyObject_TypeCheck(o, dpy.numpy_ndarray)) return NULL;
  if (!descr) {
    PyObject *d = PyDict_GetItemString(dpy.numpy_ndarray->tp_dict, "strides");
    if (d && Py_TYPE(d)->tp_descr_get) descr = Py_NewRef(d); /* numpy.ndarray is never unloaded */
  }
  return descr ? Py_TYPE(descr)->tp_descr_get(descr, o, (PyObject *)Py_TYPE(o)) : NULL;
}

/* The view of a numpy array as its buffer export describes it (the format
 * numpy gives a dtype of the machine's byte order, a struct code, and the
 * item size): 1 with *dt, shape, strides (in bytes) and *ptr; 0 where the
 * export is of another form (another byte order, a structured or datetime
 * dtype, none at all), which __array_interface__ then reads and names. No
 * Python code runs: numpy exports its own arrays. */
static int buffer_view(PyObject *o, const char **dt, int *nd, int64_t *shape, int64_t *strides, int *have_strides,
                       char **ptr) {
  Py_buffer v;
  if (PyObject_GetBuffer(o, &v, PyBUF_RECORDS_RO)) {
    PyErr_Clear();
    return 0;
  }
  static const struct {
    const char *fmt;
    Py_ssize_t size;
    const char *name;
  } map[] = {{"?", 1, "bool"},    {"b", 1, "int8"},     {"B", 1, "uint8"},      {"h", 2, "int16"},
             {"H", 2, "uint16"},  {"i", 4, "int32"},    {"I", 4, "uint32"},     {"l", 8, "int64"},
             {"L", 8, "uint64"},  {"q", 8, "int64"},    {"Q", 8, "uint64"},     {"e", 2, "float16"},
             {"f", 4, "float32"}, {"d", 8, "float64"},  {"Zf", 8, "complex64"}, {"Zd", 16, "complex128"}};
  *dt = NULL;
  for (size_t i = 0; v.format && i < sizeof map / sizeof *map; i++)
    if (v.itemsize == map[i].size && !strcmp(v.format, map[i].fmt)) *dt = map[i].name;
  int ok = *dt && v.ndim >= 0 && v.ndim <= MAX_DIMS && (v.ndim == 0 || (v.shape && v.strides));
  for (int i = 0; ok && i < v.ndim; i++) shape[i] = v.shape[i], strides[i] = v.strides[i];
  /* the strides as numpy has them, a C-contiguous array's too: numpy calls
     an array contiguous whatever its size-1 dimensions' strides, and any
     empty one (np.empty((0, 3)).strides is (0, 0)), and exports such an
     array's strides recomputed (PEP 3118); but a.strides is part of the
     value, carried as a tensor's stride() is. Only an array with a
     dimension of size 0 or 1 can differ so: its own strides are read
     (numpy.ndarray's descriptor: C code, never a subclass's property) and
     carried where they differ; any other contiguous array carries none,
     the frame's own. Such a stride addresses nothing: one that is no whole
     number of items, which a frame cannot count, is carried as the item
     size instead of refused */
  int contiguous = ok && PyBuffer_IsContiguous(&v, 'C');
  *have_strides = !contiguous;
  int small_dim = 0;
  for (int i = 0; contiguous && i < v.ndim; i++) small_dim |= shape[i] <= 1;
  if (small_dim) {
    PyObject *own = ndarray_strides(o);
    if (own && PyTuple_Check(own) && PyTuple_GET_SIZE(own) == v.ndim) {
      for (int i = 0; i < v.ndim; i++) {
        long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(own, i));
        if (x == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          x = strides[i];
        }
        x = x % v.itemsize ? v.itemsize : x;
        if (x != strides[i]) *have_strides = 1;
        strides[i] = x;
      }
    }
    Py_XDECREF(own);
    PyErr_Clear();
  }
  *nd = v.ndim;
  *ptr = v.buf;
  PyBuffer_Release(&v);
  return ok;
}

/* numpy and cupy arrays: __array_interface__ / __cuda_array_interface__
 * give the view (a numpy array's buffer export, where it names a frame's
 * dtype: the same view, without the interface's dict); the allocation is
 * the owner's (numpy) or arr.data.mem. */
static int build_array(dpy_scanner_t *s, PyObject *o, int cupy, dp_value_t *out) {
  int64_t shape[MAX_DIMS], strides[MAX_DIMS];
  const char *dt;
  int nd;
  char *ptr;
  int have_strides;
  if (!cupy && buffer_view(o, &dt, &nd, shape, strides, &have_strides, &ptr))
    return build_view(s, o, 0, dt, nd, shape, strides, have_strides, ptr, out);
  PyObject *ai = PyObject_GetAttrString(o, cupy ? "__cuda_array_interface__" : "__array_interface__");
  if (!ai || !PyDict_Check(ai)) {
    Py_XDECREF(ai);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "no array interface");
    return dpy_walk_error(s, o, "an array that cannot be described");
  }
  /* held, as dpy_visit_iface holds them (numpy's and cupy's own dicts: str keys) */
  PyObject *typestr = NULL, *shp = NULL, *str = NULL, *data = NULL;
  if (dpy_iface_part(ai, dpy.str_typestr, &typestr) || dpy_iface_part(ai, dpy.str_shape, &shp) ||
      dpy_iface_part(ai, dpy.str_strides, &str) || dpy_iface_part(ai, dpy.str_data, &data))
    PyErr_Clear(); /* what is missing is reported below */
  const char *ts = typestr && PyUnicode_Check(typestr) ? PyUnicode_AsUTF8(typestr) : NULL;
  dt = ts ? typestr_dtype(ts) : NULL;
  nd = shp ? int64_seq(shp, shape, MAX_DIMS) : -1;
  int rc = -1;
  if (!dt || nd < 0 || !data || !PyTuple_Check(data)) {
    if (!PyErr_Occurred()) {
      /* what to do instead: another byte order of a dtype a frame has is
         one astype away; any other dtype has no frame name at all */
      char native[8];
      int swapped = ts && ts[0] == '>' && strlen(ts) < sizeof native;
      if (swapped) {
        snprintf(native, sizeof native, "<%s", ts + 1);
        swapped = typestr_dtype(native) != NULL;
      }
      if (dt) /* the dtype is a frame's: the interface's shape or data is what failed */
        PyErr_Format(PyExc_TypeError, "an array of dtype %s cannot be carried", ts);
      else
        PyErr_Format(PyExc_TypeError, "an array of dtype %s cannot be carried: %s", ts ? ts : "?",
                     swapped ? "frames hold the machine's byte order: "
                               "a.astype(a.dtype.newbyteorder('=')) makes such a copy"
                             : "frames carry arrays of bool, int8 to int64, uint8 to uint64, float16 to float64, "
                               "complex64 and complex128");
    }
    goto out;
  }
  have_strides = str && str != Py_None;
  if (have_strides && int64_seq(str, strides, MAX_DIMS) != nd) goto out;
  rc = build_view(s, o, cupy, dt, nd, shape, strides, have_strides, PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0)), out);
  goto done;
out:
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) rc = dpy_walk_error(s, o, "an array that cannot be carried");
done:
  Py_XDECREF(typestr);
  Py_XDECREF(shp);
  Py_XDECREF(str);
  Py_XDECREF(data);
  Py_DECREF(ai);
  return rc;
}

/* build_array's view: dtype name dt, nd dimensions of shape, strides in
 * bytes (have_strides; else C-contiguous), data at ptr. */
static int build_view(dpy_scanner_t *s, PyObject *o, int cupy, const char *dt, int nd, const int64_t *shape,
                      int64_t *strides, int have_strides, char *ptr, dp_value_t *out) {
  int rc = -1;
  dp_dtype_t d;
  dp_dtype_parse(dt, &d, NULL);
  int64_t isz = (int64_t)dp_dtype_size(d);
  if (have_strides) {
    for (int i = 0; i < nd; i++) {
      if (strides[i] % isz) {
        PyErr_SetString(PyExc_ValueError, "strides that are not a multiple of the item size");
        goto out;
      }
      strides[i] /= isz;
    }
  } else {
    for (int i = nd; i-- > 0;) strides[i] = i == nd - 1 ? 1 : strides[i + 1] * shape[i + 1];
  }
  void *base;
  size_t ext;
  dp_device_t dev = {DP_DEVICE_CPU, 0};
  int borrowed = 0;
  if (cupy) {
    if (dpy_cupy_memory(o, &dev, &base, &ext)) goto out;
  } else {
    int objects;
    if (dpy_buffer_memory_objects(s, o, &dev, &base, &ext, &borrowed, &objects)) goto out;
    if (objects) {
      /* a view of plain items over memory that holds Python objects (a
         structured array's int field beside an object field): the buffer is
         the owner's whole allocation, pointers and all — the process's
         addresses in the frame, and raw() a writable view of references */
      PyErr_SetString(PyExc_TypeError, "an array over memory that holds Python objects (a structured array's "
                                       "field beside an object field, np.frombuffer of an object array): its "
                                       "buffer would carry their pointers");
      goto out;
    }
  }
  if (PyErr_Occurred()) goto out;
  ptrdiff_t delta = (ptrdiff_t)((uintptr_t)ptr - (uintptr_t)base); /* numbers: the two need not be one object's */
  int empty = 0;
  for (int i = 0; i < nd; i++) empty |= shape[i] == 0;
  /* an empty view addresses nothing, and its data pointer may lie outside
     the memory it is found on (numpy over an empty torch view, t[5:5].numpy(),
     points at memory of numpy's own): any offset in the buffer serves */
  if (empty && (delta < 0 || delta % isz || (size_t)delta > ext)) delta = 0;
  if (delta % isz) {
    PyErr_SetString(PyExc_ValueError, "a view whose offset is not a multiple of the item size");
    goto out;
  }
  dp_value_t t;
  rc = build_tensor(s, o, dev, base, ext, borrowed, dt, nd, shape, strides, delta / isz, &t);
  if (!rc) rc = wrap(s, o, cupy ? "cupy.ndarray" : "numpy.ndarray", "data", t, out);
out:
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return dpy_walk_error(s, o, "an array that cannot be carried");
  return rc;
}

/* The container for a frame, attached to its slot and kept in the memo —
 * a tuple's (and a namedtuple's) once its items are made: loads makes a
 * tuple from its items, so one met again among them (a list in it holding
 * it) is a cycle loads cannot rebuild, refused where it closes. */
static int build_container(dpy_scanner_t *s, PyObject *o, size_t at, uint8_t fr, PyObject *iter, const char *cls,
                           dp_value_t made, PyObject *names) {
  int later = iter && PyTuple_Check(o);
  if (memo_store(s, at, later ? dp_none() : made) || attach(s, o, made)) return -1;
  dp_value_t into = made;
  if (cls) { /* sets: the object holds a list of items */
    dp_error_t e;
    dp_value_t items;
    int rc = dp_list_new(0, &items, &e);
    if (rc) return dp_fail(s, o, rc, &e);
    if ((rc = dp_object_set(made, "items", items, &e))) return dp_fail(s, o, rc, &e);
    dp_object_get(made, "items", &into, NULL);
  }
  if (!iter) return 0;
  if (fr == FR_SET ? dpy_push_set(s, iter, o) : dpy_push(s, fr, iter, Py_TYPE(o))) return -1;
  frame_t *f = &s->frames[s->nframes - 1];
  f->out = into;
  f->names = names;
  if (later) f->memo_pending = at + 1;
  return 0;
}

/* A numpy scalar: numpy.generic {dtype: its dtype.str, data: its bytes}. */
static int build_npscalar(dpy_scanner_t *s, PyObject *o, dp_value_t *out) {
  PyObject *dt = PyObject_GetAttrString(o, "dtype");
  PyObject *has = dt ? PyObject_GetAttrString(dt, "hasobject") : NULL;
  PyObject *names = has ? PyObject_GetAttrString(dt, "names") : NULL;
  PyObject *str = names ? PyObject_GetAttrString(dt, "str") : NULL;
  PyObject *data = str ? PyObject_CallMethod(o, "tobytes", NULL) : NULL;
  int objects = has ? PyObject_IsTrue(has) : -1, rc = -1;
  const char *u = NULL;
  Py_ssize_t n = 0;
  if (objects > 0) PyErr_SetString(PyExc_TypeError, "a numpy scalar holding Python objects is not carried in frames");
  else if (names && names != Py_None)
    /* its dtype.str ('|V8') names no fields: loads would make a plain void */
    PyErr_SetString(PyExc_TypeError, "a structured numpy scalar is not carried in frames: its dtype's str names "
                                     "no fields");
  else if (data && PyUnicode_Check(str) && PyBytes_Check(data)) u = PyUnicode_AsUTF8AndSize(str, &n);
  if (u) {
    dp_error_t e;
    dp_value_t d, b;
    int dr = dp_str_new(u, (size_t)n, &d, &e);
    if (dr) {
      rc = dp_fail(s, o, dr, &e);
    } else if (!(rc = wrap(s, o, "numpy.generic", "dtype", d, out))) {
      dr = dp_bytes_new(PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data), &b, &e);
      if (!dr) dr = dp_object_set(*out, "data", b, &e);
      if (dr) {
        dp_value_release(*out);
        rc = dp_fail(s, o, dr, &e);
      }
    }
  }
  Py_XDECREF(dt);
  Py_XDECREF(has);
  Py_XDECREF(names);
  Py_XDECREF(str);
  Py_XDECREF(data);
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return dpy_walk_error(s, o, "it cannot be carried in a frame");
  return rc;
}

int dpy_build_visit(dpy_scanner_t *s, PyObject *o, uint8_t k) {
  dp_value_t v;
  dp_error_t e;
  int rc;
  if (k == K_CFUNC && (!PyCFunction_GET_SELF(o) || PyModule_Check(PyCFunction_GET_SELF(o)))) k = K_LEAF;
  if (k == K_AIF_OBJECT) k = K_OBJECT; /* carried as pickle carries it */
  if (k == K_SYNC) k = K_REDUCE;        /* pickle refuses a future, an event: so does a frame */
  if (k == K_CAI || k == K_DLPACK) {
    /* an instance whose class's interface raises AttributeError has none
       (visit()): carried as it would be without it */
    PyObject *iface;
    int found = _PyObject_LookupAttr(o, k == K_CAI ? dpy.str_cai : dpy.str_dlpack_device, &iface);
    Py_XDECREF(iface);
    if (found > 0 && k == K_DLPACK) { /* both, as dpy_visit_dlpack reads them */
      found = _PyObject_LookupAttr(o, dpy.str_dlpack, &iface);
      Py_XDECREF(iface);
      if (found < 0) return dpy_walk_error(s, o, "__dlpack__ failed");
    }
    if (found < 0) return dpy_walk_error(s, o, k == K_CAI ? "__cuda_array_interface__ failed" : "__dlpack_device__ failed");
    if (!found) k = dpy_kind_without_iface(Py_TYPE(o));
  }
  /* a long str or bytes enters the memo, as in pickle's: written once, met
     again it is a back-reference (a 1 MB str in a list 300 times made a
     300 MB frame) */
  int long_leaf = k == K_LEAF && (PyUnicode_CheckExact(o) ? PyUnicode_GET_LENGTH(o) >= 32
                                                          : PyBytes_CheckExact(o) && PyBytes_GET_SIZE(o) >= 32);
  if (k == K_LEAF && !long_leaf) return build_leaf(s, o, &v) ? -1 : attach(s, o, v);
  if (k == K_NPSCALAR) return build_npscalar(s, o, &v) ? -1 : attach(s, o, v);
  size_t at;
  int sn = dpy_seen_at(s, o, &at);
  if (sn < 0) return -1;
  if (sn) {
    if (at >= s->vals_cap || dp_value_kind(s->vals[at]) == DP_NONE) {
      /* a tuple (namedtuple) is made from its items; anything else,
         a tuple subclass pickle reduces included, from its reduce */
      PyErr_SetString(PyExc_ValueError, k == K_TUPLE || k == K_NAMEDTUPLE ? "a reference to a tuple from within its own items (a "
                                                           "cycle through a tuple, which loads cannot rebuild)"
                                                         : "a reference to an object that is still being reduced (a "
                                                           "cycle through a reduce's arguments)");
      return dpy_walk_error(s, o, "it cannot be carried in a frame");
    }
    return attach(s, o, dp_value_retain(s->vals[at]));
  }
  if (long_leaf) {
    if (build_leaf(s, o, &v)) return -1;
    if (memo_store(s, at, v)) {
      dp_value_release(v);
      return -1;
    }
    return attach(s, o, v);
  }
  PyTypeObject *t = Py_TYPE(o);
  switch (k) {
  case K_LIST:
    if ((rc = dp_list_new((size_t)PyList_GET_SIZE(o), &v, &e))) return dp_fail(s, o, rc, &e);
    return build_container(s, o, at, FR_SEQ, PyList_GET_SIZE(o) ? o : NULL, NULL, v, NULL);
  case K_TUPLE:
    if ((rc = dp_tuple_new((size_t)PyTuple_GET_SIZE(o), &v, &e))) return dp_fail(s, o, rc, &e);
    return build_container(s, o, at, FR_SEQ, PyTuple_GET_SIZE(o) ? o : NULL, NULL, v, NULL);
  case K_DICT:
    if ((rc = dp_dict_new((size_t)PyDict_GET_SIZE(o), &v, &e))) return dp_fail(s, o, rc, &e);
    return build_container(s, o, at, FR_DICT, PyDict_GET_SIZE(o) ? o : NULL, NULL, v, NULL);
  case K_SET: {
    const char *cls = t == &PySet_Type ? "builtins.set" : "builtins.frozenset";
    if ((rc = dp_object_new(cls, &v, &e))) return dp_fail(s, o, rc, &e);
    PyObject *items = dpy_keep(s, dpy_private_list(PySequence_List(o)));
    if (!items) return -1;
    return build_container(s, o, at, FR_SET, PyList_GET_SIZE(items) ? items : NULL, cls, v, NULL);
  }
  case K_NAMEDTUPLE:
  case K_OBJECT: {
    PyObject *iter = NULL, *names = NULL;
    int reduced = dpy_dispatched(s, o);
    if (reduced) { /* reduced below */
      if (reduced < 0) return -1;
      break;
    }
    if (k == K_NAMEDTUPLE) {
      names = dpy_keep(s, PyObject_GetAttr((PyObject *)t, dpy.str_fields));
      if (!names) return -1;
      /* each item becomes the attribute its field names: a _fields that is
         not a tuple, or names more or fewer fields than there are items,
         has no such object (pickle carries the items through the class's
         __getnewargs__, never through _fields) */
      if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(o)) {
        if (PyTuple_Check(names))
          PyErr_Format(PyExc_TypeError, "its _fields names %zd fields for its %zd items", PyTuple_GET_SIZE(names),
                       PyTuple_GET_SIZE(o));
        else PyErr_Format(PyExc_TypeError, "its _fields is a '%s', not a tuple of names", Py_TYPE(names)->tp_name);
        return dpy_walk_error(s, o, "it cannot be carried in a frame");
      }
      iter = PyTuple_GET_SIZE(o) ? o : NULL;
    } else {
      PyObject *d = PyObject_GenericGetDict(o, NULL);
      if (!d || !dpy_keep(s, d)) return dpy_walk_error(s, o, "its __dict__ cannot be read");
      iter = PyDict_Check(d) && PyDict_GET_SIZE(d) ? d : NULL;
      /* device memory by its instance's __cuda_array_interface__ (visit()):
         refused as any such producer is, never carried as its address */
      PyObject *cai = iter ? PyDict_GetItemWithError(d, dpy.str_cai) : NULL;
      if (cai || PyErr_Occurred()) {
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
        return dpy_walk_error(s, o, "memory that cannot be carried in a frame");
      }
    }
    PyObject *hold;
    const char *cname = dpy_frame_class(s, o, t, &hold);
    if (!cname) return -1;
    rc = dp_object_new(cname, &v, &e);
    Py_XDECREF(hold);
    if (rc) return dp_fail(s, o, rc, &e);
    return build_container(s, o, at, k == K_OBJECT ? FR_ATTRS : FR_SEQ, iter, NULL, v, names);
  }
  case K_TORCH:
    if (build_torch(s, o, &v) || memo_store(s, at, v)) return -1;
    return attach(s, o, v);
  case K_CUPY:
  case K_BUFFER:
    /* a bytearray subclass is reduced as pickle reduces it: (cls, (bytes,),
       its __dict__), below; an allowed class comes back from loads */
    if (k == K_BUFFER && PyByteArray_Check(o) && !PyByteArray_CheckExact(o)) break;
    if (k == K_BUFFER && PyByteArray_CheckExact(o)) {
      if ((rc = dp_bytes_new(PyByteArray_AS_STRING(o), (size_t)PyByteArray_GET_SIZE(o), &v, &e)))
        return dp_fail(s, o, rc, &e);
      if (wrap(s, o, "builtins.bytearray", "data", v, &v)) return -1;
    } else if (k == K_CUPY || !strcmp(t->tp_name, "numpy.ndarray")) {
      if (build_array(s, o, k == K_CUPY, &v)) return -1;
    } else if (dpy.numpy_ndarray && PyType_IsSubtype(t, dpy.numpy_ndarray)) {
      /* a numpy array, to its user: said so, with the way to carry its data */
      PyErr_SetString(PyExc_TypeError, "an instance of a numpy.ndarray subclass is not carried in frames, whose "
                                       "arrays are numpy.ndarray: np.asarray(x) is one over the same memory");
      return dpy_walk_error(s, o, "memory that cannot be carried in a frame");
    } else {
      PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
      return dpy_walk_error(s, o, "memory that cannot be carried in a frame");
    }
    if (memo_store(s, at, v)) return -1;
    return attach(s, o, v);
  case K_CAI:
  case K_DLPACK:
    PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
    return dpy_walk_error(s, o, "memory that cannot be carried in a frame");
  case K_STORAGE:
    PyErr_SetString(PyExc_TypeError, "frames carry tensors, not bare storages: carry a tensor over it "
                                     "(torch.tensor([], dtype=...).set_(storage))");
    return dpy_walk_error(s, o, "memory that cannot be carried in a frame");
  default:
    break;
  }
  /* everything else: reduced; the object exists once its parts are made
     (but for device memory named by its instance's
     __cuda_array_interface__, refused as for a plain object) */
  if (t->tp_dictoffset) {
    int h = dpy_instance_cai(o);
    if (h) {
      if (h > 0) PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
      return dpy_walk_error(s, o, h > 0 ? "memory that cannot be carried in a frame" : "its __dict__ cannot be read");
    }
  }
  PyObject *r = dpy_reduce_of(s, o);
  if (!r) return -1;
  if (PyUnicode_Check(r)) { /* a global by its reduce (torch.float16, numpy.add): by name, as pickle saves it */
    if (global_of(s, o, r, &v)) return -1;
  } else {
    PyObject *hold;
    const char *cname = dpy_frame_class(s, o, t, &hold);
    if (!cname) return -1;
    rc = dp_object_new(cname, &v, &e);
    Py_XDECREF(hold);
    if (rc) return dp_fail(s, o, rc, &e);
  }
  /* A reduced object is made from its callable and args: met again while
     they are walked (its own args hold it), it would be a cycle loads cannot
     rebuild. Its memo entry holds none until they are made (the entry's
     room made now), and a reference meanwhile is refused, above. */
  int reduced = !PyUnicode_Check(r);
  if (memo_store(s, at, reduced ? dp_none() : v) || attach(s, o, v)) return -1;
  if (!reduced) return 0;
  if (dpy_push_reduce(s, o, r)) return -1;
  frame_t *f = &s->frames[s->nframes - 1];
  f->out = v;
  f->memo_pending = at + 1;
  return 0;
}

void dpy_build_made(dpy_scanner_t *s, frame_t *f) {
  /* a reduce's object, its callable and args made; a tuple, its items */
  if (!f->memo_pending) return;
  s->vals[f->memo_pending - 1] = dp_value_retain(f->out);
  f->memo_pending = 0;
}

/* dictitems of a reduce: a list of (key, value) pairs, made for the frame
 * about to be pushed. */
int dpy_build_pairs(dpy_scanner_t *s) {
  dp_error_t e;
  int rc = dp_list_new(0, &s->made, &e);
  if (rc) return dp_fail(s, Py_None, rc, &e);
  return attach(s, Py_None, s->made);
}

void dpy_build_reset(dpy_scanner_t *s) {
  dp_value_release(s->root);
  s->root = dp_none();
  for (size_t i = 0; i < s->vals_cap; i++) {
    dp_value_release(s->vals[i]);
    s->vals[i] = dp_none();
  }
  for (size_t i = 0; i < s->stor_cap; i++) {
    dp_storage_release(s->stor[i]);
    s->stor[i] = NULL;
    Py_CLEAR(s->stor_obj[i]);
    Py_CLEAR(s->stor_st[i]);
  }
  for (size_t i = 0; i < s->nframes; i++)
    if (s->frames[i].has_key) dp_value_release(s->frames[i].key);
}
dp_value_t dpy_scanner_root(const dpy_scanner_t *s) { return s->root; }

PyObject *dpy_scanner_buffer_obj(const dpy_scanner_t *s, size_t i) { return i < s->stor_cap ? s->stor_obj[i] : NULL; }

int dpy_scanner_root_error(dpy_scanner_t *s, PyObject *obj, const char *what) {
  s->error_path = "$";
  int rc = dpy_walk_error(s, obj, what);
  s->error_path = NULL;
  return rc;
}

/* The walk error for o, found first at allocation i's path, that changed
 * under the walk (reported once the walk is over: its own path then). */
static int changed(dpy_scanner_t *s, PyObject *o, size_t i) {
  s->error_path = dpy_scanner_path(s, i);
  int rc = dpy_walk_error(s, o, "it changed during the walk");
  s->error_path = NULL;
  return rc;
}

/* dumps, after its walk: every torch storage (or numpy array's memory) the
 * frame will read must still be where, and as large as, the walk found it.
 * Python code may have run under the walk — the value's (a reduce may have
 * resized a tensor walked before it: t.resize_() moves the data of the very
 * storage the walk holds, or set_() it elsewhere), a metaclass's met while
 * a type is classified or named, a garbage collection's finalizers at any
 * allocation — so the check is made after every walk. 0, or -1 with a
 * WalkError. */
static int check_storage(dpy_scanner_t *s, size_t i) {
  PyObject *o = s->stor_obj[i], *st = s->stor_st[i];
  if (!o || dp_storage_host_data(s->stor[i])) return 0; /* copied when found: the frame reads the copy */
  dp_ptr_info_t p;
  dp_ptrset_get(s->found, i, &p, NULL);
  /* the bytes the frame reads: the storage made when the allocation was
     first met. The allocation's size in the set may be larger: another
     storage at its base met later (from_numpy of a and of a[:2]), which
     moved nothing */
  size_t need = dp_storage_nbytes(s->stor[i]);
  if (!need) return 0; /* no bytes to read, nor to have moved */
  if (!st) { /* cpu memory read through the buffer protocol (numpy): read again */
    dp_device_t dev;
    void *now;
    size_t ext;
    if (p.device.type != DP_DEVICE_CPU || dpy_is_torch(o)) return 0;
    int borrowed;
    if (dpy_buffer_memory(s, o, &dev, &now, &ext, &borrowed)) return -1;
    if (now != p.base || ext < need) {
      PyErr_SetString(PyExc_RuntimeError, "an array's memory moved (it was resized) while the walk ran the value's "
                                          "Python code (a __reduce__?): the frame would read freed memory");
      return changed(s, o, i);
    }
    return 0;
  }
  dp_torch_alloc_t now;
  if (dpy_storage_extent(st, &now)) return dpy_walk_error(s, o, "its storage cannot be described");
  if (now.base != p.base || now.nbytes < need) {
    PyErr_SetString(PyExc_RuntimeError, "a tensor's storage was resized (its memory moved) while the walk ran the "
                                        "value's Python code (a __reduce__?): the frame would read freed memory");
    return changed(s, o, i);
  }
  return 0;
}

int dpy_check_storages(dpy_scanner_t *s) {
  for (size_t i = 0; i < s->stor_cap; i++)
    if (check_storage(s, i)) return -1;
  return 0;
}

int dpy_scanner_recheck(dpy_scanner_t *s, dp_device_t device, const void *base) {
  size_t at;
  if (dp_ptrset_find(s->found, device, (void *)base, &at, NULL) || at >= s->stor_cap) return 0;
  return check_storage(s, at);
}
