/*
 * scan.c — the walk of a Python object, and devpickle.scan.
 *
 * The walk visits what pickle (protocol 5) would visit, without writing
 * anything: exact list, tuple, dict, set and frozenset are entered directly;
 * instances whose class keeps pickle's defaults (object.__reduce_ex__,
 * __reduce__ and __getstate__, no __slots__, no __getnewargs__, not in
 * copyreg.dispatch_table) are entered through their __dict__ without calling
 * anything; every other object goes through copyreg.dispatch_table or
 * __reduce_ex__(5), whose parts (callable, args, listitems, dictitems,
 * state: pickle's order) are walked. Memory — torch tensors, cupy arrays,
 * objects with __cuda_array_interface__, buffer-protocol objects, DLPack
 * producers, __array_interface__ — is added to a devpickle pointer set
 * (deduplicated by device and base).
 *
 * The walk is iterative (an explicit stack of frames), so depth is bounded by
 * max_depth, never by the C stack. Shared objects and cycles are entered
 * once: a second pointer set serves as the memo, keyed by the object's
 * address; every object the walk creates (reduce results) stays referenced
 * until the walk ends, so no address is reused while the memo holds it.
 */
#include "ext.h"
#include "scan_classify.h"
#include "scan_memory.h"
#include "scan_path.h"
#include "scan_reduce.h"
#include "scan_state.h"
#include "../../core/path.h"
#include "../../pickler/ptrs.h"
#include "../../pickler/ptrset_impl.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>
#include <string.h>

static dpy_scanner_t *free_scanners;
static void build_reset(dpy_scanner_t *s);

dpy_scanner_t *dpy_scanner_get(void) {
  dpy_scanner_t *s = free_scanners;
  if (s) {
    free_scanners = s->next_free;
    return s;
  }
  s = PyMem_Calloc(1, sizeof *s);
  if (!s) return (dpy_scanner_t *)PyErr_NoMemory();
  dp_error_t e;
  int rc = dp_ptrset_new(&s->found, &e);
  s->own = s->found;
  if (!rc) rc = dp_ptrset_new(&s->memo, &e);
  if (!rc) rc = dp_ptrset_new(&s->counted, &e);
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
  refs_reset(s);
  if (s->build) build_reset(s);
  s->build = 0;
  while (s->nframes) frame_drop(&s->frames[--s->nframes]);
  Py_CLEAR(s->keep);
  Py_CLEAR(s->reprs);
  s->found = s->own;
  s->next_free = free_scanners;
  free_scanners = s;
}

/* ---- the walk ---- */

static int is_opaque(dpy_scanner_t *s, PyObject *o) {
  if (!s->opaque) return 0;
  return PyObject_IsInstance(o, s->opaque);
}

/* Visits one value: a leaf returns, memory is added, a container or an
 * object gets a frame. */
static int build_visit(dpy_scanner_t *s, PyObject *o, uint8_t k);

/* 1 when visiting an object of kind k and type t may run the value's own
 * Python code (a reduce, a property read for an array interface, a
 * __dlpack__, a Python subclass's buffer or attributes): such an object is
 * always entered in the memo, so that its code runs once a walk as pickle
 * runs it, and it ends the walk without the memo (ran_code) — its code may
 * hand the walk new references to objects walked so. A container, a plain
 * object's __dict__, a C type's buffer are read without any. dispatched:
 * whether copyreg's dispatch table reduces t (looked up by visit). */
static int runs_value_code(uint8_t k, PyTypeObject *t, int dispatched) {
  switch (k) {
  case K_LIST:
  case K_TUPLE:
  case K_DICT:
  case K_SET:
    return 0;
  case K_NAMEDTUPLE: /* its _fields read from its class: code only under a metaclass */
    if (Py_TYPE(t) != &PyType_Type) return 1;
    /* fall through */
  case K_OBJECT: /* a dispatch-table entry is a reduce */
  case K_SYNC:   /* and a slot's read runs code (with_slots says so) */
    return dispatched;
  case K_BUFFER:
    return (t->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0;
  default:
    return 1;
  }
}

static int visit(dpy_scanner_t *s, PyObject *o) {
  PyTypeObject *t = Py_TYPE(o);
  PyObject *known = s->dispatch_obj; /* run_object's lookup of o's class, when it left o to visit() */
  s->dispatch_obj = NULL;
  int solo = s->solo;
  s->solo = 0;
  uint8_t k = classify(t);
  if (k == K_UNKNOWN) return -1; /* an interrupt held (classify_slow): dpy_scan raises it */
  if (s->build) return build_visit(s, o, k);
  if (k == K_LEAF || k == K_NPSCALAR) return 0;
  if (k == K_CFUNC) { /* len, print: globals; lst.append: getattr(lst, "append") */
    PyObject *self = PyCFunction_GET_SELF(o);
    if (!self || PyModule_Check(self)) return 0;
  }
  if (s->opaque) {
    int op = is_opaque(s, o);
    if (op) return op < 0 ? walk_error(s, o, "isinstance against opaque= failed") : 0;
  }
  switch (k) {
  case K_LIST:
    if (PyList_GET_SIZE(o) == 0) return 0;
    break;
  case K_TUPLE:
    if (PyTuple_GET_SIZE(o) == 0) return 0;
    break;
  case K_DICT:
    if (PyDict_GET_SIZE(o) == 0) return 0;
    break;
  case K_SET:
    if (PySet_GET_SIZE(o) == 0) return 0;
    break;
  default:
    break;
  }
  /* A tensor skips the memo: met twice, its allocation is found again (the
   * same one; account() counts the tensor once in refs) and its attributes
   * are entered once (visit_tensor_attrs). */
  if (k == K_TORCH) return visit_torch(s, o);
  /* a plain object's or namedtuple's dispatch-table entry, looked up once:
     both the memo decision and the switch below need it */
  int reduced = k == K_OBJECT || k == K_NAMEDTUPLE || k == K_SYNC
                    ? o == known && k == K_OBJECT ? s->dispatch_known : dispatched(s, o)
                    : 0;
  if (reduced < 0) return -1;
  if (!s->ran_code && runs_value_code(k, t, reduced)) s->ran_code = 1;
  int sn = solo && !s->ran_code ? 0 : seen(s, o);
  if (sn) return sn < 0 ? -1 : 0;
  switch (k) {
  case K_LIST:
  case K_TUPLE:
    return push(s, FR_SEQ, o, t);
  case K_NAMEDTUPLE: {
    if (reduced) return enter_reduce(s, o); /* copyreg.pickle(NT, ...) */
    PyObject *names = keep(s, PyObject_GetAttr((PyObject *)t, dpy.str_fields));
    if (!names) return -1;
    if (PyTuple_GET_SIZE(o) == 0) return 0;
    if (push(s, FR_SEQ, o, t)) return -1;
    if (PyTuple_Check(names)) s->frames[s->nframes - 1].names = names;
    return 0;
  }
  case K_DICT:
    return push(s, FR_DICT, o, t);
  case K_SET: {
    PyObject *items = keep(s, private_list(PySequence_List(o)));
    return items ? push(s, FR_SET, items, t) : -1;
  }
  case K_AIF_OBJECT:
    if (visit_iface(s, o, 0) < 0 || (reduced = dispatched(s, o)) < 0) return -1;
    /* fall through */
  case K_OBJECT: {
    if (reduced) return enter_reduce(s, o);
    PyObject **dp = _PyObject_GetDictPtr(o);
    PyObject *d = dp ? *dp : NULL;
    if (!d) { /* a managed dict (3.11+): ask for it */
      d = PyObject_GenericGetDict(o, NULL);
      if (!d) return walk_error(s, o, "its __dict__ cannot be read");
      if (!keep(s, d)) return -1;
    }
    if (!PyDict_Check(d) || PyDict_GET_SIZE(d) == 0) return 0;
    /* __cuda_array_interface__ set on the instance (its class has none):
       cupy, numba and torch read it with getattr, so the object is device
       memory to them, whatever its class says; its attributes are walked
       too, as an object's. (One lookup a plain object: an
       __array_interface__ set on an instance, cpu memory no future waits
       on, is not looked for.) */
    Py_INCREF(d); /* borrowed from o, which Python code may give another (a key's __eq__ in the lookup below) */
    PyObject *cai = PyDict_GetItemWithError(d, dpy.str_cai);
    int rc = !cai && PyErr_Occurred() ? walk_error(s, o, "its __dict__ cannot be read") : 0;
    if (!rc && cai && visit_iface(s, o, 1) < 0) rc = -1;
    if (!rc) rc = push(s, FR_ATTRS, d, Py_TYPE(o));
    Py_DECREF(d);
    return rc;
  }
  case K_SYNC:
    return reduced ? enter_reduce(s, o) : visit_sync(s, o);
  case K_CUPY:
    return visit_cupy(s, o);
  case K_STORAGE:
    return visit_storage(s, o);
  case K_CAI: /* the memory it describes; none (1): walked as without it */
  case K_DLPACK: {
    int r = k == K_CAI ? visit_iface(s, o, 1) : visit_dlpack(s, o);
    if (r <= 0) return r;
    switch (kind_without_iface(t)) {
    case K_BUFFER:
      return visit_buffer(s, o);
    case K_AIF:
      return visit_iface(s, o, 0) < 0 ? -1 : enter_reduce(s, o);
    default:
      return enter_reduce(s, o);
    }
  }
  case K_AIF: /* the memory it describes, then what pickle would walk of it */
    return visit_iface(s, o, 0) < 0 ? -1 : enter_reduce(s, o);
  case K_BUFFER:
    return visit_buffer(s, o);
  default:
    /* an object reduced (types.SimpleNamespace, a class with a __reduce__)
       may carry a __cuda_array_interface__ in its instance __dict__ too:
       device memory to the libraries that read it, as for a plain object */
    if (t->tp_dictoffset) {
      int h = instance_cai(o);
      if (h < 0) return walk_error(s, o, "its __dict__ cannot be read");
      if (h && visit_iface(s, o, 1) < 0) return -1;
    }
    return enter_reduce(s, o);
  }
}


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
  return walk_error(s, o, "it cannot be carried in a frame");
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
    return walk_error(s, o, "it cannot be carried in a frame");
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
          return walk_error(s, f->label, "it cannot be a frame's dict key");
        }
        if (rc && rc != DP_ENOMEM && f->label) return dp_fail(s, f->label, rc, &e);
        if (!rc && dp_dict_len(f->out) == before) {
          /* never a silent merge: keys Python keeps apart (two NaN objects,
             tuples holding them) that a frame's keys would make one */
          PyErr_SetString(PyExc_ValueError, "two keys of this dict are one key in a frame (floats compare by their "
                                            "bits there: two NaN objects, or tuples holding them, are one key)");
          return walk_error(s, f->obj, "it cannot be carried in a frame"); /* the dict */
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
 * MemoryError. */
static const char *global_name(PyObject *o, PyObject **hold, Py_ssize_t *len) {
  PyObject *mod = PyObject_GetAttrString(o, "__module__");
  if (!mod) clear_error();
  PyObject *qual = PyObject_GetAttrString(o, "__qualname__");
  if (!qual) {
    clear_error();
    qual = PyObject_GetAttrString(o, "__name__");
  }
  Py_ssize_t mn = 0, qn = 0;
  const char *m = mod && PyUnicode_Check(mod) ? PyUnicode_AsUTF8AndSize(mod, &mn) : NULL;
  const char *q = qual && PyUnicode_Check(qual) ? PyUnicode_AsUTF8AndSize(qual, &qn) : NULL;
  clear_error();
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
    return walk_error(s, o, "its global name cannot be found");
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
      return walk_error(s, o, "it cannot be carried in a frame");
    }
    *out = dp_int(x);
  } else if (PyFloat_CheckExact(o)) *out = dp_float(PyFloat_AS_DOUBLE(o));
  else if (PyUnicode_CheckExact(o)) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(o, &n);
    if (!u) return walk_error(s, o, "a str that is not valid UTF-8");
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
    const char *name = global_name(o, &hold, &len);
    if (!name) {
      if (PyErr_Occurred()) return -1; /* out of memory */
      PyErr_SetString(PyExc_TypeError, "a class or function without a name");
      return walk_error(s, o, "it cannot be carried in a frame");
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
  if (add_alloc_at(s, dev, base, nbytes, o, &at)) return -1;
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
    if (is_torch(o)) {
      PyObject *st = untyped_storage(o);
      if (!st) return walk_error(s, o, "its storage cannot be held");
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
    return walk_error(s, o, "it cannot be carried in a frame");
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
    return walk_error(s, o, "it cannot be carried in a frame");
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

/* A tensor that requires grad carries it (attribute requires_grad: true),
 * as torch's pickling does; loads makes it a leaf that requires grad (its
 * graph, like pickle's, is not carried). */
static int carry_requires_grad(dpy_scanner_t *s, PyObject *o, dp_value_t obj) {
  PyObject *rg = PyObject_GetAttrString(o, "requires_grad");
  int yes = rg ? PyObject_IsTrue(rg) : -1;
  Py_XDECREF(rg);
  if (yes < 0) return walk_error(s, o, "its requires_grad cannot be read");
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
  const char *name = frame_class(s, o, Py_TYPE(o), &hold);
  if (!name) return -1;
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
  PyObject *r = PyObject_CallMethod(o, name, NULL);
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
  PyObject *nested = PyObject_GetAttrString(o, "is_nested");
  int is_nested = nested ? PyObject_IsTrue(nested) : 0;
  Py_XDECREF(nested);
  if (!nested && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear(); /* a torch without them */
  else if (is_nested < 0 || !nested) return walk_error(s, o, "a tensor whose memory cannot be described");
  if (is_nested) {
    PyErr_SetString(PyExc_TypeError, "a nested tensor is not carried in frames: a frame has no field for its "
                                     "tensors' sizes (send t.unbind(), its tensors, instead)");
    return walk_error(s, o, "it cannot be carried in a frame");
  }
  int conj = tensor_bit(o, "is_conj");
  int neg = conj ? 0 : tensor_bit(o, "is_neg");
  int named = conj || neg ? 0 : tensor_bit(o, "has_names");
  if (conj < 0 || neg < 0 || named < 0) return walk_error(s, o, "a tensor whose memory cannot be described");
  if (!conj && !neg && !named) return 0;
  if (named)
    PyErr_SetString(PyExc_TypeError, "a named tensor is not carried in frames: a frame has no field for its "
                                     "dimension names (call rename(None) first)");
  else
    PyErr_Format(PyExc_TypeError,
                 "a %s view is not carried in frames: its memory holds other values than it reads "
                 "(call %s() first)",
                 conj ? "conjugate" : "negative", conj ? "resolve_conj" : "resolve_neg");
  return walk_error(s, o, "it cannot be carried in a frame");
}

static int build_torch(dpy_scanner_t *s, PyObject *o, dp_value_t *out) {
  /* a subclass's __torch_function__ runs the value's code on every attribute
     read below (dtype, shape, stride(), ...): check_storages looks again */
  dp_torch_alloc_t a[DP_TORCH_MAX_ALLOCS];
  int n = torch_allocs(o, a);
  if (n < 0) return walk_error(s, o, "a tensor whose memory cannot be described");
  int own = own_tensor_reduce(o); /* pickle carries what that returns, which a frame has no field for */
  if (own) {
    if (own > 0)
      PyErr_SetString(PyExc_TypeError, "a tensor with a __reduce_ex__ of its own (its class's, or set on it) is not "
                                       "carried in frames: a frame carries a tensor's data, not what its reduce returns");
    return walk_error(s, o, own > 0 ? "it cannot be carried in a frame" : "its reduce cannot be looked up");
  }
  PyObject **dp = _PyObject_GetDictPtr(o);
  PyObject *d = dp && *dp && PyDict_Check(*dp) ? *dp : NULL;
  int state = 0; /* what its own __getstate__ returns, which torch's pickling carries */
  if (own_getstate(Py_TYPE(o))) {
    PyObject *st = PyObject_CallMethodNoArgs(o, dpy.str_getstate);
    if (!st) return walk_error(s, o, "its __getstate__ failed");
    state = st != Py_None;
    Py_DECREF(st);
  } else if (tensor_slots(s, o, &d)) {
    return -1;
  }
  if (state || (d && PyDict_GET_SIZE(d))) {
    PyErr_SetString(PyExc_TypeError, "a tensor's attributes (a subclass's state) are not carried in frames");
    return walk_error(s, o, "it cannot be carried in a frame");
  }
  if (n != 1) {
    PyErr_SetString(PyExc_TypeError, "sparse tensors are not carried in frames (make them dense, or send "
                                     "their indices and values)");
    return walk_error(s, o, "it cannot be carried in a frame");
  }
  if (refuse_unframed(s, o)) return -1;
  int64_t shape[MAX_DIMS], strides[MAX_DIMS];
  /* each read only once the one before it succeeded: a subclass's
     __torch_function__ runs for each, and must not run under an exception
     (an interrupt) the one before raised */
  PyObject *dtype = PyObject_GetAttrString(o, "dtype");
  PyObject *dstr = dtype ? PyObject_Str(dtype) : NULL;
  PyObject *shp = dstr ? PyObject_GetAttrString(o, "shape") : NULL;
  PyObject *str = shp ? PyObject_CallMethod(o, "stride", NULL) : NULL;
  PyObject *off = str ? PyObject_CallMethod(o, "storage_offset", NULL) : NULL;
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
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return walk_error(s, o, "a tensor that cannot be described");
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

/* numpy and cupy arrays: __array_interface__ / __cuda_array_interface__
 * give the view; the allocation is the owner's (numpy) or arr.data.mem. */
static int build_array(dpy_scanner_t *s, PyObject *o, int cupy, dp_value_t *out) {
  PyObject *ai = PyObject_GetAttrString(o, cupy ? "__cuda_array_interface__" : "__array_interface__");
  if (!ai || !PyDict_Check(ai)) {
    Py_XDECREF(ai);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "no array interface");
    return walk_error(s, o, "an array that cannot be described");
  }
  /* held, as visit_iface holds them (numpy's and cupy's own dicts: str keys) */
  PyObject *typestr = NULL, *shp = NULL, *str = NULL, *data = NULL;
  if (iface_part(ai, dpy.str_typestr, &typestr) || iface_part(ai, dpy.str_shape, &shp) ||
      iface_part(ai, dpy.str_strides, &str) || iface_part(ai, dpy.str_data, &data))
    PyErr_Clear(); /* what is missing is reported below */
  const char *ts = typestr && PyUnicode_Check(typestr) ? PyUnicode_AsUTF8(typestr) : NULL;
  const char *dt = ts ? typestr_dtype(ts) : NULL;
  int64_t shape[MAX_DIMS], strides[MAX_DIMS];
  int nd = shp ? int64_seq(shp, shape, MAX_DIMS) : -1;
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
  dp_dtype_t d;
  dp_dtype_parse(dt, &d, NULL);
  int64_t isz = (int64_t)dp_dtype_size(d);
  if (str && str != Py_None) {
    if (int64_seq(str, strides, MAX_DIMS) != nd) goto out;
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
  char *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
  void *base;
  size_t ext;
  dp_device_t dev = {DP_DEVICE_CPU, 0};
  int borrowed = 0;
  if (cupy) {
    if (cupy_memory(o, &dev, &base, &ext)) goto out;
  } else {
    int objects;
    if (buffer_memory_objects(s, o, &dev, &base, &ext, &borrowed, &objects)) goto out;
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
  Py_XDECREF(typestr);
  Py_XDECREF(shp);
  Py_XDECREF(str);
  Py_XDECREF(data);
  Py_DECREF(ai);
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return walk_error(s, o, "an array that cannot be carried");
  return rc;
}

/* The container for a frame, attached to its slot and kept in the memo. */
static int build_container(dpy_scanner_t *s, PyObject *o, size_t at, uint8_t fr, PyObject *iter, const char *cls,
                           dp_value_t made, PyObject *names) {
  if (memo_store(s, at, made) || attach(s, o, made)) return -1;
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
  if (push(s, fr, iter, Py_TYPE(o))) return -1;
  frame_t *f = &s->frames[s->nframes - 1];
  f->out = into;
  f->names = names;
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
  if (rc && !PyErr_ExceptionMatches(dpy.walk_error)) return walk_error(s, o, "it cannot be carried in a frame");
  return rc;
}

static int build_visit(dpy_scanner_t *s, PyObject *o, uint8_t k) {
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
    if (found > 0 && k == K_DLPACK) { /* both, as visit_dlpack reads them */
      found = _PyObject_LookupAttr(o, dpy.str_dlpack, &iface);
      Py_XDECREF(iface);
      if (found < 0) return walk_error(s, o, "__dlpack__ failed");
    }
    if (found < 0) return walk_error(s, o, k == K_CAI ? "__cuda_array_interface__ failed" : "__dlpack_device__ failed");
    if (!found) k = kind_without_iface(Py_TYPE(o));
  }
  /* a long str or bytes enters the memo, as in pickle's: written once, met
     again it is a back-reference (a 1 MB str in a list 300 times made a
     300 MB frame) */
  int long_leaf = k == K_LEAF && (PyUnicode_CheckExact(o) ? PyUnicode_GET_LENGTH(o) >= 32
                                                          : PyBytes_CheckExact(o) && PyBytes_GET_SIZE(o) >= 32);
  if (k == K_LEAF && !long_leaf) return build_leaf(s, o, &v) ? -1 : attach(s, o, v);
  if (k == K_NPSCALAR) return build_npscalar(s, o, &v) ? -1 : attach(s, o, v);
  size_t at;
  int sn = seen_at(s, o, &at);
  if (sn < 0) return -1;
  if (sn) {
    if (at >= s->vals_cap || dp_value_kind(s->vals[at]) == DP_NONE) {
      PyErr_SetString(PyExc_ValueError, "a reference to an object that is still being reduced (a cycle "
                                        "through a reduce's arguments)");
      return walk_error(s, o, "it cannot be carried in a frame");
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
    PyObject *items = keep(s, private_list(PySequence_List(o)));
    if (!items) return -1;
    return build_container(s, o, at, FR_SET, PyList_GET_SIZE(items) ? items : NULL, cls, v, NULL);
  }
  case K_NAMEDTUPLE:
  case K_OBJECT: {
    PyObject *iter = NULL, *names = NULL;
    int reduced = dispatched(s, o);
    if (reduced) { /* reduced below */
      if (reduced < 0) return -1;
      break;
    }
    if (k == K_NAMEDTUPLE) {
      names = keep(s, PyObject_GetAttr((PyObject *)t, dpy.str_fields));
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
        return walk_error(s, o, "it cannot be carried in a frame");
      }
      iter = PyTuple_GET_SIZE(o) ? o : NULL;
    } else {
      PyObject *d = PyObject_GenericGetDict(o, NULL);
      if (!d || !keep(s, d)) return walk_error(s, o, "its __dict__ cannot be read");
      iter = PyDict_Check(d) && PyDict_GET_SIZE(d) ? d : NULL;
      /* device memory by its instance's __cuda_array_interface__ (visit()):
         refused as any such producer is, never carried as its address */
      PyObject *cai = iter ? PyDict_GetItemWithError(d, dpy.str_cai) : NULL;
      if (cai || PyErr_Occurred()) {
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
        return walk_error(s, o, "memory that cannot be carried in a frame");
      }
    }
    PyObject *hold;
    const char *cname = frame_class(s, o, t, &hold);
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
    } else {
      PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
      return walk_error(s, o, "memory that cannot be carried in a frame");
    }
    if (memo_store(s, at, v)) return -1;
    return attach(s, o, v);
  case K_CAI:
  case K_DLPACK:
    PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
    return walk_error(s, o, "memory that cannot be carried in a frame");
  case K_STORAGE:
    PyErr_SetString(PyExc_TypeError, "frames carry tensors, not bare storages: carry a tensor over it "
                                     "(torch.tensor([], dtype=...).set_(storage))");
    return walk_error(s, o, "memory that cannot be carried in a frame");
  default:
    break;
  }
  /* everything else: reduced; the object exists once its parts are made
     (but for device memory named by its instance's
     __cuda_array_interface__, refused as for a plain object) */
  if (t->tp_dictoffset) {
    int h = instance_cai(o);
    if (h) {
      if (h > 0) PyErr_SetString(PyExc_TypeError, "frames carry torch tensors, numpy and cupy arrays and bytearrays");
      return walk_error(s, o, h > 0 ? "memory that cannot be carried in a frame" : "its __dict__ cannot be read");
    }
  }
  PyObject *r = reduce_of(s, o);
  if (!r) return -1;
  if (PyUnicode_Check(r)) { /* a global by its reduce (torch.float16, numpy.add): by name, as pickle saves it */
    if (global_of(s, o, r, &v)) return -1;
  } else {
    PyObject *hold;
    const char *cname = frame_class(s, o, t, &hold);
    if (!cname) return -1;
    rc = dp_object_new(cname, &v, &e);
    Py_XDECREF(hold);
    if (rc) return dp_fail(s, o, rc, &e);
  }
  if (memo_store(s, at, v) || attach(s, o, v)) return -1;
  size_t depth = s->nframes;
  if (push_reduce(s, o, r)) return -1;
  if (s->nframes > depth) s->frames[s->nframes - 1].out = v;
  return 0;
}

/* dictitems of a reduce: a list of (key, value) pairs, made for the frame
 * about to be pushed. */
static int build_pairs(dpy_scanner_t *s) {
  dp_error_t e;
  int rc = dp_list_new(0, &s->made, &e);
  if (rc) return dp_fail(s, Py_None, rc, &e);
  return attach(s, Py_None, s->made);
}

static void build_reset(dpy_scanner_t *s) {
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

/* The next child of the top frame (borrowed), or NULL when it is done. */
static PyObject *next_child(dpy_scanner_t *s, frame_t *f) {
  switch (f->kind) {
  case FR_SEQ:
  case FR_SET: {
    Py_ssize_t n = PyList_Check(f->obj) ? PyList_GET_SIZE(f->obj) : PyTuple_GET_SIZE(f->obj);
    if (f->pos >= n) return NULL;
    f->idx = f->pos++;
    return PyList_Check(f->obj) ? PyList_GET_ITEM(f->obj, f->idx) : PyTuple_GET_ITEM(f->obj, f->idx);
  }
  case FR_DICT:
  case FR_ATTRS: {
    PyObject *k, *v;
    if (f->key_part) { /* the key was walked; now its value, as iteration gave it */
      f->key_part = 0;
      return f->value;
    }
    if (PyDict_GET_SIZE(f->obj) != f->dsize) { /* as pickle refuses it: iteration would skip items */
      PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during the walk (Python code of the value's "
                                          "changed it)");
      return NULL;
    }
    if (!PyDict_Next(f->obj, &f->pos, &k, &v)) return NULL;
    f->idx++;
    Py_XSETREF(f->label, Py_NewRef(k));
    if (f->kind == FR_DICT && !plain_leaf(Py_TYPE(k))) {
      /* classifying the key's type may run Python code (a metaclass's
         __getattr__) that empties the dict: the value is held first, or it
         could be freed under the walk */
      Py_XSETREF(f->value, Py_NewRef(v));
      if (classify(Py_TYPE(k)) != K_LEAF) {
        f->key_part = 1; /* a key that holds more than a leaf is walked too */
        return k;
      }
      if (Py_REFCNT(v) == 1) { /* the dict let go of it meanwhile */
        PyErr_SetString(PyExc_RuntimeError, "dictionary changed during the walk (Python code run while a key's "
                                            "type was classified changed it)");
        return NULL;
      }
      Py_CLEAR(f->value); /* still the dict's: a value of its slot, as without the key's classification */
    }
    return v;
  }
  case FR_PAIRS: { /* dictitems of a reduce: a list of (key, value) */
    for (;;) {
      if (f->key_part) {
        f->key_part = 0;
        return PyTuple_GET_ITEM(PyList_GET_ITEM(f->obj, f->idx), 1);
      }
      if (f->pos >= PyList_GET_SIZE(f->obj)) return NULL;
      f->idx = f->pos++;
      PyObject *kv = PyList_GET_ITEM(f->obj, f->idx);
      if (!PyTuple_Check(kv) || PyTuple_GET_SIZE(kv) != 2) {
        Py_CLEAR(f->label);
        PyErr_SetString(PyExc_TypeError, "dictitems must yield (key, value) pairs");
        return NULL;
      }
      Py_XSETREF(f->label, Py_NewRef(PyTuple_GET_ITEM(kv, 0)));
      if (classify(Py_TYPE(f->label)) != K_LEAF) {
        f->key_part = 1;
        return f->label;
      }
      return PyTuple_GET_ITEM(kv, 1);
    }
  }
  case FR_REDUCE: {
    /* the parts in pickle's order (save_reduce): callable, args, listitems,
       dictitems, then the state — after its state_setter, which pickle
       saves only with a state. f->pos counts the steps, f->idx is the part. */
    static const int8_t order[] = {0, 1, 3, 4, 5, 2};
    Py_ssize_t n = PyTuple_GET_SIZE(f->obj);
    while (f->pos < 6) {
      f->idx = order[f->pos++];
      if (f->idx >= n) continue;
      PyObject *part = PyTuple_GET_ITEM(f->obj, f->idx);
      if (part == Py_None || (f->idx == 5 && PyTuple_GET_ITEM(f->obj, 2) == Py_None)) continue;
      if (!s->build && f->idx == 0 && (PyType_Check(part) || PyCFunction_Check(part) || PyFunction_Check(part)))
        continue;
      if (f->idx == 3 || f->idx == 4) { /* iterators: drained into lists */
        PyObject *l = drain(s, part);
        if (!l) return NULL;
        if (f->idx == 4) {
          if (PyList_GET_SIZE(l) == 0) continue;
          PyTypeObject *reduced = f->type; /* push may move the frames */
          if (s->build && build_pairs(s)) return NULL;
          if (push(s, FR_PAIRS, l, reduced)) return NULL;
          s->frames[s->nframes - 1].type = (PyTypeObject *)Py_XNewRef((PyObject *)reduced);
          if (s->build) s->frames[s->nframes - 1].out = s->made;
          return Py_None; /* the pushed frame is the child */
        }
        return l;
      }
      return part;
    }
    if (f->pos == 6 && f->value) {
      /* an object-dtype array subclass's attributes (visit_buffer): the
         reduced object's own, at its path (`<reduce T>.name`) */
      f->pos = 7;
      f->idx = 6;
      PyObject *d = f->value;
      PyTypeObject *owner = f->type; /* push may move the frames */
      if (push(s, FR_ATTRS, d, owner)) return NULL;
      return Py_None; /* the pushed frame is the child */
    }
    return NULL;
  }
  }
  return NULL;
}

dp_value_t dpy_scanner_root(const dpy_scanner_t *s) { return s->root; }

PyObject *dpy_scanner_buffer_obj(const dpy_scanner_t *s, size_t i) { return i < s->stor_cap ? s->stor_obj[i] : NULL; }

int dpy_scanner_root_error(dpy_scanner_t *s, PyObject *obj, const char *what) {
  s->error_path = "$";
  int rc = walk_error(s, obj, what);
  s->error_path = NULL;
  return rc;
}

/* The walk error for o, found first at allocation i's path, that changed
 * under the walk (reported once the walk is over: its own path then). */
static int changed(dpy_scanner_t *s, PyObject *o, size_t i) {
  s->error_path = dpy_scanner_path(s, i);
  int rc = walk_error(s, o, "it changed during the walk");
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
    if (p.device.type != DP_DEVICE_CPU || is_torch(o)) return 0;
    int borrowed;
    if (buffer_memory(s, o, &dev, &now, &ext, &borrowed)) return -1;
    if (now != p.base || ext < need) {
      PyErr_SetString(PyExc_RuntimeError, "an array's memory moved (it was resized) while the walk ran the value's "
                                          "Python code (a __reduce__?): the frame would read freed memory");
      return changed(s, o, i);
    }
    return 0;
  }
  dp_torch_alloc_t now;
  if (storage_extent(st, &now)) return walk_error(s, o, "its storage cannot be described");
  if (now.base != p.base || now.nbytes < need) {
    PyErr_SetString(PyExc_RuntimeError, "a tensor's storage was resized (its memory moved) while the walk ran the "
                                        "value's Python code (a __reduce__?): the frame would read freed memory");
    return changed(s, o, i);
  }
  return 0;
}

static int check_storages(dpy_scanner_t *s) {
  for (size_t i = 0; i < s->stor_cap; i++)
    if (check_storage(s, i)) return -1;
  return 0;
}

int dpy_scanner_recheck(dpy_scanner_t *s, dp_device_t device, const void *base) {
  size_t at;
  if (dp_ptrset_find(s->found, device, (void *)base, &at, NULL) || at >= s->stor_cap) return 0;
  return check_storage(s, at);
}

/* On CPython 3.11 and 3.12 an instance of a class with a managed dict
 * (torch.Tensor, a Python subclass of torch's C type) keeps its attributes
 * in words before its header: 3.11 a dict at word -3 and inline values at
 * -4, 3.12 one word at -3 holding either (values tagged by bit 0). Reading
 * them says whether the instance may hold attributes without
 * _PyObject_GetDictPtr, which makes a dict from inline values — an
 * allocation, in which 3.11 may run a garbage collection and so Python code
 * (finalizers) in the middle of a run that must run none. The layout is
 * checked against _PyObject_GetDictPtr at import (managed_layout_check);
 * elsewhere, or when the check fails, the call is made. */
#if defined(Py_TPFLAGS_MANAGED_DICT) && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
#define MANAGED_WORDS 1
static int managed_layout_ok;

static inline int managed_words_set(PyObject *o) {
  PyObject **w = (PyObject **)o;
#if PY_VERSION_HEX < 0x030C0000
  return w[-3] != NULL || w[-4] != NULL;
#else
  return w[-3] != NULL;
#endif
}
#endif

/* Checks the words managed_words_set reads against _PyObject_GetDictPtr,
 * on instances of a class made for it: one made by tp_alloc (as torch makes
 * a tensor) holds nothing, and its dict pointer is word -3, empty; one
 * given an attribute holds it, and the dict _PyObject_GetDictPtr then
 * makes of it is at word -3. Any other answer, and the words are never
 * read. 0, or -1 with an exception. */
static int managed_layout_check(void) {
#ifdef MANAGED_WORDS
  managed_layout_ok = 0;
  PyObject *cls = PyObject_CallFunction((PyObject *)&PyType_Type, "s(){}", "_devpickle_layout_probe");
  if (!cls) return -1;
  PyTypeObject *t = (PyTypeObject *)cls;
  PyObject *bare = (t->tp_flags & Py_TPFLAGS_MANAGED_DICT) ? t->tp_alloc(t, 0) : NULL;
  PyObject *full = bare ? PyObject_CallNoArgs(cls) : NULL;
  int rc = 0;
  if (full && !PyObject_SetAttrString(full, "a", Py_None)) {
    int before = !managed_words_set(bare) && managed_words_set(full);
    PyObject **bd = _PyObject_GetDictPtr(bare), **fd = _PyObject_GetDictPtr(full);
    managed_layout_ok = before && bd == (PyObject **)bare - 3 && !*bd && fd == (PyObject **)full - 3 && *fd &&
                        PyDict_CheckExact(*fd) && PyDict_GetItemString(*fd, "a") == Py_None &&
                        managed_words_set(full);
  } else if (PyErr_Occurred()) {
    rc = -1;
  }
  Py_XDECREF(full);
  Py_XDECREF(bare);
  Py_DECREF(cls);
  return rc;
#else
  return 0;
#endif
}

/* 1 when o (of type t) may hold instance attributes (a dict, empty or not,
 * or inline values), 0 when it holds none. A dict at a fixed offset is read
 * there, without _PyObject_GetDictPtr's call. */
static inline int may_hold_attrs(PyObject *o, PyTypeObject *t) {
#ifdef MANAGED_WORDS
  if ((t->tp_flags & Py_TPFLAGS_MANAGED_DICT) && managed_layout_ok) return managed_words_set(o);
#endif
  Py_ssize_t off = t->tp_dictoffset;
#ifdef Py_TPFLAGS_MANAGED_DICT
  if (t->tp_flags & Py_TPFLAGS_MANAGED_DICT) off = 0;
#endif
  PyObject **dp = off > 0 ? (PyObject **)((char *)o + off) : _PyObject_GetDictPtr(o);
  return dp && *dp;
}

#define INLINE_DEPTH 3 /* levels of containers read in place, one in another */

/* A container read in place by a run (seq_run), and how far: the chain
 * from the run's frame down to the item being read. A read in place that
 * stops at an item — one it cannot read so, a tensor whose memory the
 * adapter could not describe, one that gained attributes meanwhile —
 * resumes there: the frames visit() and next_child would have left for
 * these containers are pushed (resume()), and the walk goes on from that
 * item. Nothing read is read again: reading a tensor can run Python code (a
 * sparse tensor's parts go through torch's dispatcher: a dispatch mode, a
 * subclass's __torch_dispatch__), which a second read would run twice. */
typedef struct inl {
  const struct inl *up; /* the container holding this one; NULL: an item of the run's frame */
  PyObject *obj;        /* the list or tuple, or the object's __dict__ (held while read) */
  PyTypeObject *owner;  /* the type a too-deep error names */
  uint8_t kind;         /* FR_SEQ, or FR_ATTRS (an object's __dict__) */
  Py_ssize_t pos, idx;  /* the frame's, as next_child leaves them */
  PyObject *label;      /* FR_ATTRS: the current key (borrowed, held by the reader), or NULL */
  Py_ssize_t dsize;     /* FR_ATTRS: the dict's size when entered */
} inl_t;

/* Pushes the frames of the chain ending at in (outermost first), after the
 * run's frame (the top one), whose item they hold: that item is then done
 * for it. 0, or -1 with an exception. */
static int resume(dpy_scanner_t *s, const inl_t *in) {
  frame_t *root = &s->frames[s->nframes - 1];
  root->pos = root->idx + 1;
  const inl_t *chain[INLINE_DEPTH + 1];
  int n = 0;
  for (; in && n < INLINE_DEPTH + 1; in = in->up) chain[n++] = in;
  while (n--) {
    const inl_t *c = chain[n];
    if (push(s, c->kind, c->obj, c->owner)) return -1;
    frame_t *f = &s->frames[s->nframes - 1];
    f->pos = c->pos;
    f->idx = c->idx;
    if (c->kind == FR_ATTRS) {
      f->dsize = c->dsize;
      f->label = Py_XNewRef(c->label);
    }
  }
  return 0;
}

/* A tensor met by a run (seq_run): one of a class already classified as a
 * tensor class with no slots (*ok: the last class found so), holding no
 * attributes, has its allocations added as visit() would add them, the
 * tensor held while read (Python code can run under the adapter: a sparse
 * tensor's dispatch). in: its container read in place (NULL: the run's
 * frame), its pos and idx past o. 1: done; 0: not such a tensor (nothing
 * read: visit() reads it); 2: read, and the frames to o's container
 * resumed — its attributes, given meanwhile, entered as visit() enters
 * them; -1: error (a WalkError at o's path where the adapter raised, as
 * visit() words it). */
static inline __attribute__((always_inline)) int run_tensor(dpy_scanner_t *s, PyObject *o, PyTypeObject **ok,
                                                            const inl_t *in) {
  PyTypeObject *t = Py_TYPE(o);
  if (t != *ok) {
    tcache_ent_t *e = tcache_hit(t); /* a kind not yet cached: classifying may run Python code */
    if (!e || e->kind != K_TORCH) return 0;
    /* slots (instances larger than torch.Tensor's), not yet asked, or a
       __getstate__ of its own, whatever the size (a subclass's dict and
       weakref add nothing to it where CPython manages them): visit() */
    if ((t->tp_basicsize > ((PyTypeObject *)dpy.torch_tensor)->tp_basicsize && !e->no_slots) || own_getstate(t))
      return 0;
    int own = own_class_reduce(t); /* a reduce of its class's own: visit() (an error: visit() reports it) */
    if (own) {
      if (own < 0) PyErr_Clear();
      return 0;
    }
    *ok = t;
  }
  if (may_hold_attrs(o, t)) return 0; /* attributes (or a dict once made): visit() */
  Py_INCREF(o);
  dp_torch_alloc_t a[DP_TORCH_MAX_ALLOCS];
  int na = dpy.torch->tensor_allocs(o, a), rc = 1;
  if (na < 0) {
    /* its error is the value's (its code may have raised it): reported
       here, never swallowed for visit() to read the tensor again */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (resume(s, in)) {
      Py_XDECREF(et);
      Py_XDECREF(ev);
      Py_XDECREF(tb);
    } else {
      PyErr_Restore(et, ev, tb);
      walk_error(s, o, "a tensor whose memory cannot be described");
    }
    rc = -1;
  }
  for (int i = 0; i < na && rc == 1; i++)
    if (a[i].nbytes &&
        add_alloc(s, (dp_device_t){(dp_device_type_t)a[i].device_type, a[i].device_index}, a[i].base, a[i].nbytes, o))
      rc = -1;
  /* Python code under the adapter may have given it attributes: visit()
     walks them after its memory */
  if (rc == 1 && may_hold_attrs(o, t)) rc = resume(s, in) || visit_tensor_attrs(s, o) ? -1 : 2;
  Py_DECREF(o);
  return rc;
}

#define INLINE_MAX 8   /* items of a container read in place */

/* A small list or tuple met by a run, held only by its slot there (solo:
 * see scan_walk), before the walk ran any of the value's code and with no
 * path asked for: its items — leaves, tensors run_tensor reads, small
 * containers read so in turn (level: how many hold it, up to INLINE_DEPTH)
 * — are read in place, no frame, no memo, the same allocations in the same
 * order as its frame would give. At an item it cannot read so, the frames
 * are resumed (see inl_t) and the walk visits that item. up: the container
 * holding c read in place (NULL: the run's frame). 1: done; 0: not started
 * (nothing read: visit() enters c); 2: frames resumed; -1: error. */
static int run_inline(dpy_scanner_t *s, PyObject *c, PyTypeObject **ok, int level, const inl_t *up) {
  int list = PyList_CheckExact(c);
  Py_ssize_t n = list ? PyList_GET_SIZE(c) : PyTuple_GET_SIZE(c);
  if (n > INLINE_MAX || s->nframes + (size_t)level > s->max_depth) return 0; /* too deep: visit() says so */
  inl_t me = {.up = up, .obj = c, .owner = Py_TYPE(c), .kind = FR_SEQ};
  int rc = 1;
  Py_INCREF(c); /* a list's items are read afresh: Python code under the adapter may change it */
  for (Py_ssize_t i = 0; rc == 1 && i < (list ? PyList_GET_SIZE(c) : PyTuple_GET_SIZE(c)); i++) {
    PyObject *o = list ? PyList_GET_ITEM(c, i) : PyTuple_GET_ITEM(c, i);
    PyTypeObject *t = Py_TYPE(o);
    if (plain_leaf(t)) continue;
    me.pos = i + 1, me.idx = i;
    if (t == &PyTuple_Type || t == &PyList_Type)
      rc = level < INLINE_DEPTH && !s->ran_code && Py_REFCNT(o) == 1 ? run_inline(s, o, ok, level + 1, &me) : 0;
    else
      rc = run_tensor(s, o, ok, &me);
    if (rc == 0) { /* the walk visits item i next */
      me.pos = i, me.idx = i - 1;
      rc = resume(s, &me) ? -1 : 2;
    }
  }
  Py_DECREF(c);
  return rc;
}

/* An instance of a class that keeps pickle's defaults (K_OBJECT, of a
 * plain metaclass), met by a run, held only by its slot there, before the
 * walk ran any of the value's code and with no path asked for: its
 * __dict__, when small and made of str keys (none
 * `__cuda_array_interface__`), is read in place as run_inline reads a
 * container — no frame, no memo, the same allocations in the same order as
 * visit() would give, frames resumed at a value it cannot read so. Its
 * class is looked up in copyreg.dispatch_table once (the lookup may run a
 * metaclass's __eq__): visit() takes the answer when it enters the object
 * instead. 1: done; 0: not started (visit() enters o); 2: frames resumed;
 * -1: error. */
/* Drops run_object's hold on o, for visit() to enter what the slot holds
 * now (0): an o freed meanwhile is no longer what dispatch_obj names. */
static int let_go(dpy_scanner_t *s, PyObject *o) {
  if (Py_REFCNT(o) == 1 && s->dispatch_obj == o) s->dispatch_obj = NULL;
  Py_DECREF(o);
  return 0;
}

static int run_object(dpy_scanner_t *s, PyObject *o, PyTypeObject **ok) {
  PyTypeObject *t = Py_TYPE(o);
  if (Py_TYPE(t) != &PyType_Type || s->nframes + 1 > s->max_depth) return 0; /* too deep: visit() says so */
  PyObject *fn = PyDict_GetItemWithError(dpy.dispatch_table, (PyObject *)t);
  if (!fn && PyErr_Occurred()) return dispatch_error(s, o); /* at o's path: the run's frame's item */
  s->dispatch_obj = o, s->dispatch_known = fn != NULL; /* for visit(), when it enters o */
  if (fn) return 0;
  /* o is held from here: making its dict from inline attributes (3.11,
     3.12) allocates, and on 3.11 a garbage collection there may run code
     that drops the reference its slot held */
  Py_INCREF(o);
  PyObject **dp = _PyObject_GetDictPtr(o);
  PyObject *d = dp ? *dp : NULL;
  if (!d || !PyDict_CheckExact(d)) return let_go(s, o); /* a managed dict not made, or a dict subclass: visit() */
  Py_ssize_t n = PyDict_GET_SIZE(d), pos = 0, count = 0;
  if (n > INLINE_MAX) return let_go(s, o);
  PyObject *k, *v;
  while (PyDict_Next(d, &pos, &k, &v)) { /* visit() looks for an instance's array interface first */
    if (!PyUnicode_CheckExact(k) || k == dpy.str_cai ||
        (PyUnicode_GET_LENGTH(k) == PyUnicode_GET_LENGTH(dpy.str_cai) && PyUnicode_Compare(k, dpy.str_cai) == 0))
      return let_go(s, o);
    if (reduce_name(k)) { /* an instance's own __reduce_ex__ or __getstate__: visit() reduces it */
      s->dispatch_known = 1;
      return let_go(s, o);
    }
  }
  s->dispatch_obj = NULL;
  inl_t me = {.obj = d, .owner = t, .kind = FR_ATTRS, .dsize = n};
  int rc = 1;
  Py_INCREF(d); /* Python code under the adapter may replace the object's dict: this one is read, as a frame reads it */
  for (pos = 0; rc == 1;) {
    Py_ssize_t at = pos;
    if (PyDict_GET_SIZE(d) != n) { /* the walk resumed reports it, as a frame's next step does */
      me.pos = at, me.idx = count - 1, me.label = NULL;
      rc = resume(s, &me) ? -1 : 2;
      break;
    }
    if (!PyDict_Next(d, &pos, &k, &v)) break;
    count++;
    PyTypeObject *vt = Py_TYPE(v);
    if (plain_leaf(vt)) continue;
    int solo = Py_REFCNT(v) == 1;
    Py_INCREF(k);
    Py_INCREF(v);
    me.pos = pos, me.idx = count - 1, me.label = k;
    if (vt == &PyTuple_Type || vt == &PyList_Type)
      rc = !s->ran_code && solo ? run_inline(s, v, ok, 2, &me) : 0;
    else
      rc = run_tensor(s, v, ok, &me);
    if (rc == 0) { /* the walk visits this value next */
      me.pos = at, me.idx = count - 2, me.label = NULL;
      rc = resume(s, &me) ? -1 : 2;
    }
    Py_DECREF(k);
    Py_DECREF(v);
  }
  Py_DECREF(d);
  Py_DECREF(o);
  return rc;
}

/* Items from items[0] on that are tensors of class ok (a plain tensor
 * class: no slots) holding no attributes, read by the adapter at once into
 * the pending batch (no paths asked for). dense_run runs no Python code, so
 * neither the sequence nor an item's attributes can change under it: each
 * item's __dict__ is looked at once, before. Returns how many items were
 * read (0: items[0] is for run_tensor, which reads or reports it), or -1. */
static Py_ssize_t tensor_run(dpy_scanner_t *s, PyObject *const *items, Py_ssize_t n, PyTypeObject *ok) {
  enum { CAP = sizeof s->pend / sizeof s->pend[0] };
  if (s->npend == CAP && flush_pending(s)) return -1;
  if (n > CAP - s->npend) n = CAP - s->npend;
  Py_ssize_t k = 0;
  for (; k < n && Py_TYPE(items[k]) == ok; k++)
    if (may_hold_attrs(items[k], ok)) break; /* attributes: run_tensor walks them */
  dp_torch_alloc_t a[CAP];
  Py_ssize_t got = k ? dpy.torch->dense_run(items, k, a) : 0;
  for (Py_ssize_t i = 0; i < got; i++) /* an empty storage adds nothing, as in run_tensor */
    if (a[i].nbytes &&
        add_alloc(s, (dp_device_t){(dp_device_type_t)a[i].device_type, a[i].device_index}, a[i].base, a[i].nbytes,
                  items[i]))
      return -1; /* not reached: the batch has room for the run */
  return got;
}

/* The walk of scan and of the Future (not building, no opaque types) over
 * a list or tuple: a run of items that are leaves, tensors run_tensor
 * reads, or small containers and objects read in place, is read here, as
 * visit() would read each (the same allocations, in the same order),
 * without the loop's per-child dispatch. Python code can still run under
 * it (a garbage collection's finalizers, a tensor's dispatch in the
 * adapter), so the sequence is read afresh for every item. Stops at the
 * first other item, which the loop visits, or where frames were resumed
 * (the loop goes on with them). 0, or -1 with an exception. */
static int seq_run(dpy_scanner_t *s, frame_t *f) {
  PyObject *seq = f->obj;
  int list = PyList_Check(seq);
  PyTypeObject *ok = NULL; /* a tensor class found plain */
  for (;;) {
    Py_ssize_t n = list ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
    if (f->pos >= n) return 0;
    PyObject *o = list ? PyList_GET_ITEM(seq, f->pos) : PyTuple_GET_ITEM(seq, f->pos);
    PyTypeObject *t = Py_TYPE(o);
    if (plain_leaf(t)) {
      f->idx = f->pos++;
      continue;
    }
    f->idx = f->pos; /* the item's path */
    int r;
    if (t == ok) {
      if (!s->want_paths) { /* a run of such tensors, read at once */
        Py_ssize_t got = tensor_run(s, PySequence_Fast_ITEMS(seq) + f->pos, n - f->pos, ok);
        if (got < 0) return -1;
        if (got) {
          f->pos += got;
          f->idx = f->pos - 1;
          continue;
        }
      }
      r = run_tensor(s, o, &ok, NULL);
    } else {
      /* a container or object held only here, with no path asked for and no
         value code run yet, is read in place */
      int in_place = !s->want_paths && !s->ran_code && Py_REFCNT(o) == 1;
      tcache_ent_t *e;
      if (t == &PyTuple_Type || t == &PyList_Type)
        r = in_place ? run_inline(s, o, &ok, 1, NULL) : 0;
      else if ((e = tcache_hit(t)) && e->kind == K_OBJECT)
        r = in_place ? run_object(s, o, &ok) : 0;
      else
        r = run_tensor(s, o, &ok, NULL);
    }
    if (r != 1) return r < 0 ? -1 : 0; /* 2: f may have moved (frames were pushed) */
    f->idx = f->pos++;
  }
}

static int scan_walk(dpy_scanner_t *s, PyObject *obj, const dpy_scan_opts_t *opts, dp_ptrset_t *into) {
  PyObject *const *held = held_exc; /* the thread's slot, looked up once (a thread-local costs a call in a module) */
  if (dpy_resolve_frameworks()) return -1;
  s->build = opts->build;
  s->copy_borrowed = opts->build && opts->inline_data;
  s->root = dp_none();
  s->saw_cupy = 0;
  if (!s->own) s->own = s->found;
  s->found = into ? into : s->own;
  /* A future's walk (no refs, no paths, into its own set) lists what it
     meets without deduplicating: the future needs no more (ptrs.h) */
  if (!into) dp__ptrset_set_raw(s->found, opts->no_refs && !opts->build && !opts->paths);
  dp_ptrset_clear(s->memo);
  s->nframes = 0;
  refs_reset(s);
  s->npaths = 0;
  s->text_len = 0;
  s->want_paths = opts->paths;
  s->error_path = NULL;
  s->count_refs = !opts->no_refs && !opts->build && !into; /* refs are of a set of its own */
  s->solo = 0;
  s->dispatch_obj = NULL;
  s->opaque = opts->opaque;
  /* opaque=: every object meets isinstance, which may run its code (a
     metaclass's __instancecheck__, the object's __class__) */
  s->ran_code = s->opaque != NULL;
  s->max_depth = opts->max_depth ? opts->max_depth : DP_DEFAULT_MAX_DEPTH;
  int runs = !s->build && !s->opaque && dpy.torch && dpy.torch_tensor;
  if (visit(s, obj)) return -1;
  while (s->nframes) {
    frame_t *f = &s->frames[s->nframes - 1];
    size_t before = s->nframes;
    if (runs && f->kind == FR_SEQ) {
      if (seq_run(s, f)) return -1;
      if (s->nframes != before) continue; /* frames resumed over items read in place */
    }
    PyObject *c = next_child(s, f);
    if (!c) {
      if (PyErr_Occurred()) { /* a reduce's parts are the reduced object's */
        if (f->kind != FR_DICT && f->kind != FR_ATTRS)
          return walk_error_type(s, f->type ? f->type : Py_TYPE(f->obj), "its items cannot be read");
        /* a dict that changed: the path is the dict's (an object's, for its
           __dict__, named by its class), not its last item's */
        size_t n = s->nframes;
        s->nframes = n - 1;
        int rc = walk_error_type(s, f->kind == FR_ATTRS ? f->type : Py_TYPE(f->obj), "its items cannot be read");
        s->nframes = n;
        return rc;
      }
      frame_drop(&s->frames[--s->nframes]);
      continue;
    }
    if (s->nframes != before) continue; /* next_child pushed the child's frame */
    /* A child whose one reference is its container's slot (a list's item,
       a dict's value, the walk holding neither) cannot be met again: its
       container is entered once, and a cycle through it would be a second
       reference. So it skips the memo — while no Python code the walk ran
       could have made new references to what was walked (then every object
       enters the memo, and one walked before is walked at most once more:
       the walk stays linear). dumps keeps every object it makes in the
       memo. */
    s->solo = !s->build && !s->ran_code && Py_REFCNT(c) == 1 &&
              (f->kind == FR_SEQ || ((f->kind == FR_DICT || f->kind == FR_ATTRS) && c != f->value));
    Py_INCREF(c); /* a reduce it calls may drop its container's reference */
    int rc = visit(s, c);
    Py_DECREF(c);
    if (rc || held[0]) return -1;
  }
  if (flush_pending(s)) return -1;
  return s->build ? check_storages(s) : 0;
}

int dpy_scan(dpy_scanner_t *s, PyObject *obj, const dpy_scan_opts_t *opts, dp_ptrset_t *into) {
  /* Python code under a walk may walk again (a repr that scans): the outer
     walk's held interrupt waits for it, untouched */
  PyObject *outer[3] = {held_exc[0], held_exc[1], held_exc[2]};
  held_exc[0] = held_exc[1] = held_exc[2] = NULL;
  int64_t interp = tcache_enter();
  int rc = scan_walk(s, obj, opts, into);
  tcache_leave(interp);
  if (raise_held()) rc = -1;
  held_exc[0] = outer[0], held_exc[1] = outer[1], held_exc[2] = outer[2];
  return rc;
}

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

static int check_opaque(PyObject *opaque, PyObject **out) {
  *out = NULL;
  if (!opaque || opaque == Py_None) return 0;
  if (PyType_Check(opaque)) opaque = PyTuple_Pack(1, opaque);
  else if (!Py_TYPE(opaque)->tp_iter && !PySequence_Check(opaque)) {
    /* named, as classes= is: "'int' object is not iterable" says not which argument */
    PyErr_Format(PyExc_TypeError, "opaque= takes types: a type or an iterable of types, not a '%s'",
                 Py_TYPE(opaque)->tp_name);
    return -1;
  } else opaque = PySequence_Tuple(opaque);
  if (!opaque) return -1;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(opaque); i++)
    if (!PyType_Check(PyTuple_GET_ITEM(opaque, i))) {
      PyErr_Format(PyExc_TypeError, "opaque= takes types; got a '%s'", Py_TYPE(PyTuple_GET_ITEM(opaque, i))->tp_name);
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
  if (check_opaque(opaque, &o.opaque)) return NULL;
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
  if (managed_layout_check()) return -1;
#ifdef MANAGED_WORDS
  PyObject *words = managed_layout_ok ? Py_True : Py_False;
#else
  PyObject *words = Py_False;
#endif
  if (PyModule_AddObjectRef(m, "_managed_words", words)) return -1; /* tests read it */
  if (!alloc_keys_tuple || PyType_Ready(&alloc_type) ||
      PyDict_SetItemString(alloc_type.tp_dict, "_fields", alloc_keys_tuple))
    return -1;
  PyType_Modified(&alloc_type);
  Py_INCREF(&alloc_type);
  if (PyModule_AddObject(m, "Allocation", (PyObject *)&alloc_type)) return -1;
  return 0;
}
