/*
 * scan_reduce.c — the reduce protocol: what pickle carries of an object
 * that is not entered directly — its reduce (copyreg.dispatch_table's, else
 * __reduce_ex__(5)), its own __getstate__'s state, its __dict__ and the
 * slots that are set (scan_reduce.h).
 */
#include "scan_reduce.h"
#include "scan_classify.h"
#include "scan_path.h"

/* *d (borrowed, or NULL) and the slots of o named in names (a non-empty
 * list, copyreg._slotnames') that are set, as a new dict kept by the walk
 * in *d: the state pickle carries of an instance with __slots__ (tensors',
 * bytearrays'). 0, or -1 with a walk error. */
static int with_slots(dpy_scanner_t *s, PyObject *o, PyObject *names, PyObject **d) {
  PyObject *all = *d ? PyDict_Copy(*d) : PyDict_New();
  if (!dpy_keep(s, all)) return -1;
  s->ran_code = 1; /* a slot's descriptor, or __getattribute__, is Python code */
  Py_ssize_t n = PyList_GET_SIZE(names);
  for (Py_ssize_t i = 0; i < n; i++) {
    /* held: the read runs Python code (a property __slotnames__ names, a
       __getattribute__), which may change the class's __slotnames__ list,
       freeing the name */
    PyObject *name = Py_NewRef(PyList_GET_ITEM(names, i)), *v = PyObject_GetAttr(o, name);
    if (!v && !PyErr_ExceptionMatches(PyExc_AttributeError)) {
      Py_DECREF(name);
      return dpy_walk_error(s, o, "a slot cannot be read");
    }
    PyErr_Clear(); /* a slot never set */
    if (PyList_GET_SIZE(names) != n) { /* as object.__getstate__ refuses it: an endless list, or items skipped */
      Py_DECREF(name);
      Py_XDECREF(v);
      PyErr_SetString(PyExc_RuntimeError, "__slotnames__ changed size during the walk");
      return dpy_walk_error(s, o, "its __slots__ cannot be read");
    }
    int rc = v ? PyDict_SetItem(all, name, v) : 0; /* a name whose __hash__ raises: the value's error */
    Py_DECREF(name);
    Py_XDECREF(v);
    if (rc) return dpy_walk_error(s, o, "its __slots__ cannot be read");
  }
  *d = all;
  return 0;
}

/* A tensor's state beyond its data — a subclass's or a tensor's own
 * attributes (nn.Parameter's, say), which pickle carries — is walked as the
 * attributes of an object. */
/* A tensor subclass's __slots__ (instances larger than torch.Tensor's):
 * *d becomes a new dict of __dict__'s items and the slots that are set, as
 * torch's pickling carries them. 0, or -1 with a walk error. */
int dpy_tensor_slots(dpy_scanner_t *s, PyObject *o, PyObject **d) {
  PyTypeObject *t = Py_TYPE(o);
  if (t->tp_basicsize <= ((PyTypeObject *)dpy.torch_tensor)->tp_basicsize) return 0;
  tcache_ent_t *e = tcache_hit(t); /* torch.Tensor itself is larger than its C base: asked once a type */
  if (e && e->no_slots) return 0;
  /* *d is borrowed from o, and the class's code runs from here (_slotnames
     reads cls.__dict__ through a metaclass's __getattribute__, classify):
     it may replace o.__dict__, freeing the dict the caller then reads */
  if (*d && !dpy_keep(s, Py_NewRef(*d))) return -1;
  PyObject *names = PyObject_CallOneArg(dpy.slotnames, (PyObject *)t);
  if (!names) return dpy_walk_error(s, o, "its __slots__ cannot be read");
  if (!dpy_keep(s, names)) return -1;
  if (!PyList_Check(names) || PyList_GET_SIZE(names) == 0) {
    /* _slotnames may have set t.__slotnames__ (a new version tag): the
       entry is made again, then marked */
    if (classify(t) == K_TORCH && (e = tcache_hit(t))) e->no_slots = 1;
    return 0;
  }
  return with_slots(s, o, names, d);
}

/* Whether t has a __getstate__ of its own (not object's), found as pickle
 * finds it, in the class's MRO (runs no Python code): torch's reduce of a
 * tensor subclass and bytearray's reduce carry what it returns as the
 * state, in place of __dict__ and __slots__. */
int dpy_own_getstate(PyTypeObject *t) {
  PyObject *g = _PyType_Lookup(t, dpy.str_getstate);
  return g && g != dpy.object_getstate;
}
/* The state o's own __getstate__ returns, walked as a reduce's state
 * (<reduce T>.state), as pickle carries it. 0, or -1 with a walk error. */
int dpy_push_own_state(dpy_scanner_t *s, PyObject *o) {
  s->ran_code = 1;
  PyObject *st = PyObject_CallMethodNoArgs(o, dpy.str_getstate);
  if (!st) return dpy_walk_error(s, o, "its __getstate__ failed");
  if (!dpy_keep(s, st)) return -1;
  if (st == Py_None) return 0;
  PyObject *r = dpy_keep(s, PyTuple_Pack(3, Py_None, Py_None, st));
  return r ? dpy_push_reduce(s, o, r) : -1;
}

/* Whether pickle would reduce tensors of class t by a reduce of their own
 * rather than torch's: t in copyreg.dispatch_table, or a __reduce_ex__
 * found in its MRO that is not defined in torch (torch.Tensor's and
 * nn.Parameter's carry the tensor's data and state, which the walk reads
 * directly). Runs no Python code. 1, 0, or -1 with an error set. */
int dpy_own_class_reduce(PyTypeObject *t) {
  if (PyDict_GetItemWithError(dpy.dispatch_table, (PyObject *)t)) return 1;
  if (PyErr_Occurred()) return -1;
  PyObject *f = _PyType_Lookup(t, dpy.str_reduce_ex);
  if (!f || f == dpy.object_reduce_ex) return 0;
  if (dpy.torch_tensor_cls && PyType_Check(dpy.torch_tensor_cls) &&
      f == _PyType_Lookup((PyTypeObject *)dpy.torch_tensor_cls, dpy.str_reduce_ex))
    return 0;
  if (!PyFunction_Check(f)) return 1;
  PyObject *m = ((PyFunctionObject *)f)->func_module;
  if (!m || !PyUnicode_Check(m)) return 1;
  return !(PyUnicode_CompareWithASCIIString(m, "torch") == 0 ||
           PyUnicode_Tailmatch(m, dpy.str_torch_dot, 0, 6, -1) == 1);
}

/* Whether tensor o is reduced by a reduce of its own (dpy_own_class_reduce, or
 * a __reduce_ex__ set on the instance, which pickle looks up there first).
 * 1, 0, or -1 with an error set. */
int dpy_own_tensor_reduce(PyObject *o) {
  PyObject **dp = _PyObject_GetDictPtr(o);
  if (dp && *dp && PyDict_Check(*dp)) {
    PyObject *d = Py_NewRef(*dp); /* held: a key's __eq__ may replace it, freeing it under the lookup */
    int found = PyDict_GetItemWithError(d, dpy.str_reduce_ex) != NULL;
    Py_DECREF(d);
    if (found) return 1;
    if (PyErr_Occurred()) return -1;
  }
  return dpy_own_class_reduce(Py_TYPE(o));
}
/* A subclass written in Python (bytearray's, ndarray's) may hold more in
 * its instance __dict__ and its __slots__, which pickle's reduce of it
 * carries (bytearray's does: both): walked as an object's attributes,
 * never skipped. *out: those (a dict the walk keeps), or NULL. kind: o's
 * (K_BUFFER: a C type's instance has none; K_SYNC: devpickle.Future, a C
 * type, has an instance __dict__ too), under which a type without slots
 * is remembered. */
int dpy_subclass_attrs(dpy_scanner_t *s, PyObject *o, uint8_t kind, PyObject **out) {
  *out = NULL;
  PyTypeObject *t = Py_TYPE(o);
  int heap = (t->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0;
  if (!heap && kind != K_SYNC) return 0;
  PyObject *d = NULL;
  if (t->tp_dictoffset != 0) {
    if (!(d = PyObject_GenericGetDict(o, NULL))) return dpy_walk_error(s, o, "its __dict__ cannot be read");
    if (!dpy_keep(s, d)) return -1;
    if (!PyDict_Check(d)) d = NULL;
  }
  tcache_ent_t *e = tcache_hit(t); /* asked once a type, as a tensor's */
  if (heap && (!e || !e->no_slots)) {
    PyObject *names = PyObject_CallOneArg(dpy.slotnames, (PyObject *)t);
    if (!names) return dpy_walk_error(s, o, "its __slots__ cannot be read");
    if (!dpy_keep(s, names)) return -1;
    if (PyList_Check(names) && PyList_GET_SIZE(names)) {
      if (with_slots(s, o, names, &d)) return -1;
    } else if (classify(t) == kind && (e = tcache_hit(t))) {
      e->no_slots = 1; /* the entry made again: _slotnames may have set t.__slotnames__ */
    }
  }
  *out = d;
  return 0;
}
/* o.__reduce_ex__(5), found as pickle finds it (on the instance: a class's
 * __getattribute__ may answer), else o.__reduce__() as pickle falls back to
 * it when there is no __reduce_ex__, else pickle's refusal. New reference,
 * or NULL with an exception. */
static PyObject *reduce_ex_5(PyObject *o) {
  PyObject *m = PyObject_GetAttr(o, dpy.str_reduce_ex);
  if (m) {
    PyObject *five = PyLong_FromLong(5);
    PyObject *r = five ? PyObject_CallOneArg(m, five) : NULL;
    Py_XDECREF(five);
    Py_DECREF(m);
    return r;
  }
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
  PyErr_Clear();
  if ((m = PyObject_GetAttr(o, dpy.str_reduce))) {
    PyObject *r = PyObject_CallNoArgs(m);
    Py_DECREF(m);
    return r;
  }
  if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "can't pickle '%.200s' object", Py_TYPE(o)->tp_name);
  }
  return NULL;
}

/* -1 with a walk error when pickle (protocol 2+, its C pickler) refuses
 * the args of a reduce r of o whose callable is named __newobj__ or
 * __newobj_ex__ (copyreg's, or any function of that name), worded as it
 * words it (or when a lookup it makes raises); 0 when not. */
static int newobj_refused(dpy_scanner_t *s, PyObject *o, PyObject *r) {
  PyObject *name = PyObject_GetAttrString(PyTuple_GET_ITEM(r, 0), "__name__");
  if (!name) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return dpy_walk_error(s, o, dpy_not_reducible(s));
    PyErr_Clear();
    return 0;
  }
  int ex = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__newobj_ex__") == 0;
  int plain = !ex && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__newobj__") == 0;
  Py_DECREF(name);
  if (!ex && !plain) return 0;
  PyObject *args = PyTuple_GET_ITEM(r, 1);
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  PyObject *cls = n ? PyTuple_GET_ITEM(args, 0) : NULL;
  if (ex) {
    if (n != 3)
      PyErr_Format(PyExc_TypeError, "length of the NEWOBJ_EX argument tuple must be exactly 3, not %zd", n);
    else if (!PyType_Check(cls))
      PyErr_Format(PyExc_TypeError, "first item from NEWOBJ_EX argument tuple must be a class, not %.200s",
                   Py_TYPE(cls)->tp_name);
    else if (!PyTuple_Check(PyTuple_GET_ITEM(args, 1)))
      PyErr_Format(PyExc_TypeError, "second item from NEWOBJ_EX argument tuple must be a tuple, not %.200s",
                   Py_TYPE(PyTuple_GET_ITEM(args, 1))->tp_name);
    else if (!PyDict_Check(PyTuple_GET_ITEM(args, 2)))
      PyErr_Format(PyExc_TypeError, "third item from NEWOBJ_EX argument tuple must be a dict, not %.200s",
                   Py_TYPE(PyTuple_GET_ITEM(args, 2))->tp_name);
    else
      return 0;
  } else if (!n) {
    PyErr_SetString(PyExc_TypeError, "__newobj__ arglist is empty");
  } else if (!PyType_Check(cls)) {
    PyErr_SetString(PyExc_TypeError, "args[0] from __newobj__ args is not a type");
  } else {
    PyObject *c = PyObject_GetAttrString(o, "__class__"); /* pickle asks the object, as isinstance does */
    if (!c) return dpy_walk_error(s, o, dpy_not_reducible(s));
    int same = c == cls;
    Py_DECREF(c);
    if (same) return 0;
    PyErr_SetString(PyExc_TypeError, "args[0] from __newobj__ args has the wrong class");
  }
  return dpy_walk_error(s, o, "its reduce is malformed");
}

/* What a refused reduce of o says: a generator or a dict view stands where
 * its items would (scan(model.parameters()), scan(sd.values())), and pickle's
 * "cannot pickle 'generator' object" says nothing of what to walk instead. */
static const char *unreducible(dpy_scanner_t *s, PyObject *o) {
  if (PyGen_Check(o)) return "an iterator cannot be reduced (walk list(...) of it)";
  if (PyDictKeys_Check(o) || PyDictValues_Check(o) || PyDictItems_Check(o))
    return "a dict view cannot be reduced (walk list(...) of it)";
  return dpy_not_reducible(s);
}

/* "it cannot be reduced", and to scan and the Future (which take opaque=,
 * dumps does not) how to walk past such an object: a lock or a handle
 * beside the tensors. A then() future takes no opaque= of its own: its
 * walk says where its types come from (its parent; a collect_all future,
 * its parent down a then() chain, from its inputs). */
const char *dpy_not_reducible(const dpy_scanner_t *s) {
  if (s->build) return "it cannot be reduced";
  return s->chained ? "it cannot be reduced (if it holds no device memory, list its type in opaque= of the future "
                      "then() was called on: a then() future walks with its parent's types, a collect_all "
                      "future's with its inputs')"
                    : "it cannot be reduced (if it holds no device memory, list its type in opaque=)";
}

/* The reduce of an object that keeps pickle's defaults differs only in form:
 * its state is its __dict__, entered as attributes. */
/* o's reduce — copyreg.dispatch_table's, else __reduce_ex__(5) — checked
 * as pickle checks it: a str (a global), or a tuple of 2 to 6 parts, kept
 * alive by the walk (borrowed); NULL with a walk error. */
PyObject *dpy_reduce_of(dpy_scanner_t *s, PyObject *o) {
  PyObject *r;
  s->ran_code = 1;
  PyObject *fn = PyDict_GetItemWithError(dpy.dispatch_table, (PyObject *)Py_TYPE(o));
  if (fn) {
    /* held, as pickle holds it: the call may remove it from the table,
       freeing it (a bound dict.get, and its dict) under its own call */
    Py_INCREF(fn);
    r = PyObject_CallOneArg(fn, o);
    Py_DECREF(fn);
  } else {
    if (PyErr_Occurred()) return dpy_dispatch_error(s, o), NULL;
    r = reduce_ex_5(o);
  }
  if (!r) return dpy_walk_error(s, o, unreducible(s, o)), NULL;
  if (!dpy_keep(s, r)) return NULL;
  if (PyUnicode_Check(r)) return r; /* a global, pickled by name */
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 2 || PyTuple_GET_SIZE(r) > 6) {
    PyErr_SetString(PyExc_TypeError, "__reduce_ex__ must return a string or a tuple of 2 to 6 items");
    return dpy_walk_error(s, o, "its reduce is malformed"), NULL;
  }
  /* what pickle refuses in a reduce's result, refused as pickle words it */
  Py_ssize_t n = PyTuple_GET_SIZE(r);
  static const char *const nth[] = {"first", "second", "third", "fourth", "fifth", "sixth"};
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *part = PyTuple_GET_ITEM(r, i);
    const char *want = NULL;
    if (i == 0 && !PyCallable_Check(part)) want = "callable";
    else if (i == 1 && !PyTuple_Check(part)) want = "a tuple";
    else if ((i == 3 || i == 4) && part != Py_None && !PyIter_Check(part)) want = "an iterator";
    else if (i == 5 && part != Py_None && !PyCallable_Check(part)) want = "a function";
    if (want) {
      PyErr_Format(PyExc_TypeError, "%s element of the tuple returned by __reduce__ must be %s, not %.200s", nth[i],
                   want, Py_TYPE(part)->tp_name);
      return dpy_walk_error(s, o, "its reduce is malformed"), NULL;
    }
  }
  return newobj_refused(s, o, r) ? NULL : r;
}

/* Walks the parts of o's reduce r (a tuple; a str, a global, has none). */
int dpy_push_reduce(dpy_scanner_t *s, PyObject *o, PyObject *r) {
  if (PyUnicode_Check(r)) return 0;
  if (dpy_push(s, FR_REDUCE, r, Py_TYPE(o))) return -1;
  s->frames[s->nframes - 1].type = (PyTypeObject *)Py_NewRef((PyObject *)Py_TYPE(o));
  return 0;
}

int dpy_enter_reduce(dpy_scanner_t *s, PyObject *o) {
  PyObject *r = dpy_reduce_of(s, o);
  return r ? dpy_push_reduce(s, o, r) : -1;
}

/* Turns a listitems/dictitems iterator into a list the walk can index. */
/* A reduce's listitems or dictitems, drained into a list (as pickle reads
 * them, once). An iterator runs C code that never returns to the
 * interpreter's loop (itertools.count() never ends): signals are checked
 * every DRAIN_CHECK items, so that an interrupt stops the walk, as it
 * would stop a loop in Python, instead of leaving it running. */
#define DRAIN_CHECK 4096
PyObject *dpy_private_list(PyObject *l) {
  /* out of the collector's sight, as the keep list (dpy_keep()): frames read it
     by index, and gc.get_referrers() would hand it to the value's code */
  if (l) PyObject_GC_UnTrack(l);
  return l;
}

/* Whether x is an exact scalar that holds no memory and no reference: the
 * walk does nothing with it but pass it (scan.c, visit()). */
static inline int bare_leaf(PyObject *x) {
  PyTypeObject *t = Py_TYPE(x);
  return plain_leaf(t) || t == &PyBytes_Type || t == &PyComplex_Type;
}

/* What the walk keeps of a drained item x (a new reference). Without a
 * frame to build, a bare leaf is None in its place and a (key, value) pair
 * of bare leaves one shared pair of Nones: the walk meets nothing in them,
 * and a reduce that yields 10 million ints would otherwise hold them all
 * until the walk ends (36 bytes an item in place of the list's 8; the
 * indices, and so the paths of the items after them, stay as they were). */
static PyObject *drained_item(dpy_scanner_t *s, PyObject *x) {
  static PyObject *bare_pair;
  if (s->build) return Py_NewRef(x);
  if (bare_leaf(x)) return Py_NewRef(Py_None);
  if (PyTuple_CheckExact(x) && PyTuple_GET_SIZE(x) == 2 && bare_leaf(PyTuple_GET_ITEM(x, 0)) &&
      bare_leaf(PyTuple_GET_ITEM(x, 1))) {
    if (!bare_pair && !(bare_pair = PyTuple_Pack(2, Py_None, Py_None))) return NULL;
    return Py_NewRef(bare_pair);
  }
  return Py_NewRef(x);
}

PyObject *dpy_drain(dpy_scanner_t *s, PyObject *it) {
  PyObject *iter = PyObject_GetIter(it);
  if (!iter) return NULL;
  PyObject *l = dpy_private_list(PyList_New(0)), *x = NULL;
  for (size_t n = 1; l && (x = PyIter_Next(iter)) != NULL; n++) {
    Py_SETREF(x, drained_item(s, x));
    int rc = x ? PyList_Append(l, x) : -1;
    Py_XDECREF(x);
    if (rc) Py_CLEAR(l);
    else if (n % DRAIN_CHECK == 0 && PyErr_CheckSignals()) {
      /* the handler's exception, whatever it is, is no error of the
         value's: held, it passes through as it is (dpy_scan), as it
         would from a loop in Python, in place of the walk error the
         caller raises for the items that could not be read */
      if (!held_exc[0]) {
        PyErr_Fetch(&held_exc[0], &held_exc[1], &held_exc[2]);
        PyErr_SetString(PyExc_RuntimeError, "a signal handler raised");
      }
      Py_CLEAR(l);
    }
  }
  Py_DECREF(iter);
  if (l && PyErr_Occurred()) Py_CLEAR(l);
  return dpy_keep(s, l);
}
/* The walk error for o, whose class's lookup in copyreg's dispatch table
 * raised (its metaclass's __hash__ or __eq__ is the value's code). */
int dpy_dispatch_error(dpy_scanner_t *s, PyObject *o) {
  return dpy_walk_error(s, o, "its class cannot be looked up in copyreg.dispatch_table");
}

/* Whether o's own __dict__ makes pickle's state other than attributes
 * named by str: it holds a __reduce_ex__ or __getstate__ (pickle reduces
 * o through them, whatever its class keeps), a key that is not an exact
 * str (pickle's state is that dict: it walks its keys, a tensor key too,
 * and a str subclass's own attributes) or
 * is a dict subclass (pickle reduces that state as any value: its
 * attributes, its own items()). Then o is reduced, and its state walked as
 * a value. as_state: those last two count (a walk's, not dumps', which
 * carries the entries as attributes and refuses a name that is not a str,
 * set_attr, rather than write the object in another form). 1, 0, or -1
 * with an exception. */
static int instance_reduces(PyObject *o, int as_state) {
  PyObject **dp = _PyObject_GetDictPtr(o);
  if (!dp || !*dp || !PyDict_Check(*dp)) return PyErr_Occurred() ? -1 : 0;
  if (!PyDict_CheckExact(*dp) && as_state) return 1;
  /* one pass over the keys, running no code (so the dict stays as it is),
     instead of two lookups and a pass: every plain object visit() enters
     comes here */
  PyObject *k, *v;
  int r = 0;
  /* a key that is no str is walked by pickle, and so is one of a str
     subclass (reduced: its own attributes); dumps carries the latter as a
     name and refuses the former */
  for (Py_ssize_t pos = 0; !r && PyDict_Next(*dp, &pos, &k, &v);)
    r = (as_state && !PyUnicode_CheckExact(k)) || dpy_reduce_name(k);
  return r;
}

int dpy_instance_reduces(dpy_scanner_t *s, PyObject *o) {
  /* dumps keeps carrying such a dict's entries as the object's attributes,
     which loads gives back without the dict subclass listed in classes=,
     and refusing a key that is not a str as an attribute name */
  int r = instance_reduces(o, !s->build);
  return r < 0 ? dpy_walk_error(s, o, "its __dict__ cannot be read") : r;
}

/* Whether an object of a class that keeps pickle's defaults is reduced
 * all the same: its class in copyreg.dispatch_table, or its instance's
 * __dict__ (dpy_instance_reduces). */
int dpy_dispatched(dpy_scanner_t *s, PyObject *o) {
  PyObject *fn = PyDict_GetItemWithError(dpy.dispatch_table, (PyObject *)Py_TYPE(o));
  if (fn) return 1;
  if (PyErr_Occurred()) return dpy_dispatch_error(s, o);
  return dpy_instance_reduces(s, o);
}
