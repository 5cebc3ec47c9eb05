/*
 * scan.c — the walk of a Python object.
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
 *
 * The walk is in layers, each a file whose header is its door, each calling
 * only those below it: scan_classify (what a type is to the walk),
 * scan_path (the path to the value visited; walk errors), scan_state (the
 * scanner: its frames, memo and allocations), scan_reduce (the reduce
 * protocol), scan_memory (the memory readers), scan_build (dumps' build
 * mode). This file is the loop over them; scan_result.c holds the
 * scanners, what a walk found, and devpickle.scan.
 */
#include "ext.h"
#include "scan.h"
#include "scan_build.h"
#include "scan_classify.h"
#include "scan_memory.h"
#include "scan_path.h"
#include "scan_reduce.h"
#include "scan_state.h"
#include "../../pickler/ptrs.h"

#include <stdint.h>

/* ---- the walk ---- */

/* isinstance(o, opaque=), answered from o's type where isinstance would run
 * no Python code, or an ABC's answer kept (scan_classify.h); else the items
 * are asked from the first that runs code, each as isinstance asks it. The
 * walk has run code once an ABC or such an item was asked. */
static int is_opaque(dpy_scanner_t *s, PyObject *o) {
  dpy_opaque_t *op = &s->op;
  if (op->nwatch && dpy_opaque_stale(op) && dpy_opaque_respec(op)) return -1;
  if (op->nabc && dpy_opaque_token_same(op) < 0) return -1; /* a register() since: answers forgotten */
  Py_ssize_t hit = dpy_opaque_hit(op, Py_TYPE(o));
  if (hit == OPAQUE_ERR) return -1;
  if (hit == OPAQUE_ASK) {
    s->ran_code = 1;
    if ((hit = dpy_opaque_ask(op, o)) == OPAQUE_ERR) return -1;
  }
  if (hit >= 0) return hit < op->n;
  s->ran_code = 1;
  for (Py_ssize_t i = -1 - hit; i < PyTuple_GET_SIZE(s->opaque); i++) {
    int r = PyObject_IsInstance(o, PyTuple_GET_ITEM(s->opaque, i));
    if (r) return r;
  }
  return 0;
}

/* Whether a run (seq_run) leaves an object of type t to visit(): t's
 * instances are opaque, or may be (code decides). Runs no Python code. */
static inline int opaque_type(dpy_scanner_t *s, PyTypeObject *t) {
  if (!s->opaque) return 0;
  if (s->op.nwatch && dpy_opaque_stale(&s->op)) return 1;
  if (s->op.nabc) { /* an ABC's answer kept holds until the token moves */
    int same = dpy_opaque_token_same(&s->op);
    if (same <= 0) {
      if (same < 0) dpy_clear_error(); /* visit() asks again, and reports it */
      return 1;
    }
  }
  Py_ssize_t hit = dpy_opaque_hit(&s->op, t);
  if (hit == OPAQUE_ERR) dpy_clear_error(); /* visit() asks again, and reports it */
  return hit != s->op.n;
}

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

/* Whether numpy scalar o is a structured one with object fields (a
 * numpy.void whose dtype has objects): its reduce carries those objects
 * (a tensor among them), as an object array's does. 1, 0, or -1 with an
 * exception. */
static int npscalar_holds_objects(PyObject *o) {
  if (!dpy.numpy_void || !PyObject_TypeCheck(o, dpy.numpy_void)) return 0;
  PyObject *dt = PyObject_GetAttrString(o, "dtype");
  PyObject *h = dt ? PyObject_GetAttrString(dt, "hasobject") : NULL;
  int r = h ? PyObject_IsTrue(h) : -1;
  Py_XDECREF(h);
  Py_XDECREF(dt);
  return r;
}

/* An object reduced (types.SimpleNamespace, a class with a __reduce__, a
 * plain object whose instance __dict__ pickle reduces) may carry a
 * __cuda_array_interface__ in its instance __dict__: device memory to the
 * libraries that read it with getattr (cupy, numba, torch), as for a plain
 * object; then what pickle walks of it. */
static int enter_reduce_iface(dpy_scanner_t *s, PyObject *o) {
  if (Py_TYPE(o)->tp_dictoffset) {
    int h = dpy_instance_cai(o);
    if (h < 0) return dpy_walk_error(s, o, "its __dict__ cannot be read");
    if (h && dpy_visit_iface(s, o, 1) < 0) return -1;
  }
  return dpy_enter_reduce(s, o);
}

/* Whether o is a builtin function pickle saves by name, a leaf (len,
 * print: a module's or none's), rather than a bound builtin method, which
 * it reduces to getattr(self, name) and so walks its __self__ (lst.append,
 * t.clone) — a reduce's callable too. */
static inline int cfunc_global(PyObject *o) {
  if (!PyCFunction_Check(o)) return 0;
  PyObject *self = PyCFunction_GET_SELF(o);
  return !self || PyModule_Check(self);
}

static int visit(dpy_scanner_t *s, PyObject *o) {
  PyTypeObject *t = Py_TYPE(o);
  PyObject *known = s->dispatch_obj; /* run_object's lookup of o's class, when it left o to visit() */
  s->dispatch_obj = NULL;
  int solo = s->solo;
  s->solo = 0;
  uint8_t k = classify(t);
  if (k == K_UNKNOWN) return -1; /* an interrupt held (classify_slow): dpy_scan raises it */
  if (s->build) return dpy_build_visit(s, o, k);
  if (k == K_LEAF) return 0;
  if (k == K_NPSCALAR) { /* a value, not memory: a leaf, save a structured one holding objects (reduced below) */
    int objs = npscalar_holds_objects(o);
    if (objs <= 0) return objs < 0 ? dpy_walk_error(s, o, "its dtype cannot be read") : 0;
  }
  if (k == K_CFUNC && cfunc_global(o)) return 0;
  if (s->opaque) {
    int op = is_opaque(s, o);
    if (op) return op < 0 ? dpy_walk_error(s, o, "isinstance against opaque= failed") : 0;
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
   * are entered once (dpy_visit_tensor_attrs). */
  if (k == K_TORCH) return dpy_visit_torch(s, o);
  /* a plain object's or namedtuple's dispatch-table entry, looked up once:
     both the memo decision and the switch below need it */
  /* run_object's answer covers the table, and the instance's __dict__ only
     where it read that whole (it says so by dispatch_known) */
  int reduced = k == K_OBJECT || k == K_NAMEDTUPLE || k == K_SYNC
                    ? o == known && k == K_OBJECT ? (s->dispatch_known ? 1 : dpy_instance_reduces(s, o))
                                                  : dpy_dispatched(s, o)
                    : 0;
  if (reduced < 0) return -1;
  if (!s->ran_code && runs_value_code(k, t, reduced)) s->ran_code = 1;
  int sn = solo && !s->ran_code ? 0 : dpy_seen(s, o);
  if (sn) return sn < 0 ? -1 : 0;
  switch (k) {
  case K_LIST:
  case K_TUPLE:
    return dpy_push(s, FR_SEQ, o, t);
  case K_NAMEDTUPLE: {
    if (reduced) return dpy_enter_reduce(s, o); /* copyreg.pickle(NT, ...) */
    PyObject *names = dpy_keep(s, PyObject_GetAttr((PyObject *)t, dpy.str_fields));
    if (!names) return -1;
    if (PyTuple_GET_SIZE(o) == 0) return 0;
    if (dpy_push(s, FR_SEQ, o, t)) return -1;
    if (PyTuple_Check(names)) s->frames[s->nframes - 1].names = names;
    return 0;
  }
  case K_DICT:
    return dpy_push(s, FR_DICT, o, t);
  case K_SET: {
    PyObject *items = dpy_keep(s, dpy_private_list(PySequence_List(o)));
    return items ? dpy_push_set(s, items, o) : -1;
  }
  case K_AIF_OBJECT:
    if (dpy_visit_iface(s, o, 0) < 0 || (reduced = dpy_dispatched(s, o)) < 0) return -1;
    /* fall through */
  case K_OBJECT: {
    if (reduced) return enter_reduce_iface(s, o);
    PyObject **dp = _PyObject_GetDictPtr(o);
    PyObject *d = dp ? *dp : NULL;
    if (!d) { /* a managed dict (3.11+): ask for it */
      d = PyObject_GenericGetDict(o, NULL);
      if (!d) return dpy_walk_error(s, o, "its __dict__ cannot be read");
      if (!dpy_keep(s, d)) return -1;
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
    int rc = !cai && PyErr_Occurred() ? dpy_walk_error(s, o, "its __dict__ cannot be read") : 0;
    if (!rc && cai && dpy_visit_iface(s, o, 1) < 0) rc = -1;
    if (!rc) rc = dpy_push(s, FR_ATTRS, d, Py_TYPE(o));
    Py_DECREF(d);
    return rc;
  }
  case K_SYNC:
    return reduced ? dpy_enter_reduce(s, o) : dpy_visit_sync(s, o);
  case K_CUPY:
    return dpy_visit_cupy(s, o);
  case K_STORAGE:
    return dpy_visit_storage(s, o);
  case K_CAI: /* the memory it describes; none (1): walked as without it */
  case K_DLPACK: {
    int r = k == K_CAI ? dpy_visit_iface(s, o, 1) : dpy_visit_dlpack(s, o);
    if (r <= 0) return r;
    switch (dpy_kind_without_iface(t)) {
    case K_BUFFER:
      return dpy_visit_buffer(s, o);
    case K_AIF:
      return dpy_visit_iface(s, o, 0) < 0 ? -1 : dpy_enter_reduce(s, o);
    default:
      return dpy_enter_reduce(s, o);
    }
  }
  case K_AIF: /* the memory it describes, then what pickle would walk of it */
    return dpy_visit_iface(s, o, 0) < 0 ? -1 : dpy_enter_reduce(s, o);
  case K_BUFFER:
    return dpy_visit_buffer(s, o);
  default:
    return enter_reduce_iface(s, o);
  }
}

/* The next child of the top frame (borrowed), or NULL when it is done. */
static PyObject *next_child(dpy_scanner_t *s, frame_t *f) {
  switch (f->kind) {
  case FR_SEQ:
  case FR_SET: {
    if (f->kind == FR_SET && PySet_GET_SIZE(f->value) != f->dsize) { /* as pickle refuses it: items added go unseen */
      PyErr_SetString(PyExc_RuntimeError, "set changed size during the walk (Python code of the value's changed it)");
      return NULL;
    }
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
    if (f->label) { /* the key met last still where it was: else the positions moved under the iteration */
      Py_ssize_t p = f->kpos;
      if (!PyDict_Next(f->obj, &p, &k, &v) || k != f->label || p != f->pos) {
        PyErr_SetString(PyExc_RuntimeError, DPY_KEYS_CHANGED);
        return NULL;
      }
    }
    f->kpos = f->pos;
    if (!PyDict_Next(f->obj, &f->pos, &k, &v)) return NULL;
    if (f->idx + 1 >= f->dsize) { /* more entries than it holds: a key met again, as Python's iteration refuses it */
      PyErr_SetString(PyExc_RuntimeError, DPY_KEYS_CHANGED);
      return NULL;
    }
    f->idx++;
    Py_XSETREF(f->label, Py_NewRef(k));
    /* a dict's key, and an attribute's that is not a str (pickle's state
       is that dict: it walks the key), when it holds more than a leaf;
       dumps refuses such an attribute name (set_attr) */
    if ((f->kind == FR_DICT || (!s->build && !PyUnicode_Check(k))) && !plain_leaf(Py_TYPE(k))) {
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
      if (f->pos >= 2) dpy_build_made(s, f); /* its callable and args made: the object is */
      f->idx = order[f->pos++];
      if (f->idx >= n) continue;
      PyObject *part = PyTuple_GET_ITEM(f->obj, f->idx);
      if (part == Py_None || (f->idx == 5 && PyTuple_GET_ITEM(f->obj, 2) == Py_None)) continue;
      if (!s->build && f->idx == 0 && (PyType_Check(part) || PyFunction_Check(part) || cfunc_global(part)))
        continue;
      if (f->idx == 3 || f->idx == 4) { /* iterators: drained into lists */
        PyObject *l = dpy_drain(s, part);
        if (!l) return NULL;
        if (f->idx == 4) {
          if (PyList_GET_SIZE(l) == 0) continue;
          PyTypeObject *reduced = f->type; /* dpy_push may move the frames */
          if (s->build && dpy_build_pairs(s)) return NULL;
          if (dpy_push(s, FR_PAIRS, l, reduced)) return NULL;
          s->frames[s->nframes - 1].type = (PyTypeObject *)Py_XNewRef((PyObject *)reduced);
          if (s->build) s->frames[s->nframes - 1].out = s->made;
          return Py_None; /* the pushed frame is the child */
        }
        return l;
      }
      return part;
    }
    dpy_build_made(s, f);
    if (f->pos == 6 && f->value) {
      /* an object-dtype array subclass's attributes (dpy_visit_buffer): the
         reduced object's own, at its path (`<reduce T>.name`) */
      f->pos = 7;
      f->idx = 6;
      PyObject *d = f->value;
      PyTypeObject *owner = f->type; /* dpy_push may move the frames */
      if (dpy_push(s, FR_ATTRS, d, owner)) return NULL;
      return Py_None; /* the pushed frame is the child */
    }
    return NULL;
  }
  }
  return NULL;
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

int dpy_managed_layout_init(PyObject *m) {
  if (managed_layout_check()) return -1;
#ifdef MANAGED_WORDS
  PyObject *words = managed_layout_ok ? Py_True : Py_False;
#else
  PyObject *words = Py_False;
#endif
  if (PyModule_AddObjectRef(m, "_managed_words", words)) return -1; /* tests read it */
  return 0;
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
  Py_ssize_t kpos;      /* FR_ATTRS: the position label was read from */
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
    if (dpy_push(s, c->kind, c->obj, c->owner)) return -1;
    frame_t *f = &s->frames[s->nframes - 1];
    f->pos = c->pos;
    f->idx = c->idx;
    if (c->kind == FR_ATTRS) {
      f->dsize = c->dsize;
      f->kpos = c->kpos;
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
    if (!e || e->kind != K_TORCH || opaque_type(s, t)) return 0;
    /* slots (instances larger than torch.Tensor's), not yet asked, or a
       __getstate__ of its own, whatever the size (a subclass's dict and
       weakref add nothing to it where CPython manages them): visit() */
    if ((t->tp_basicsize > ((PyTypeObject *)dpy.torch_tensor)->tp_basicsize && !e->no_slots) || dpy_own_getstate(t))
      return 0;
    int own = dpy_own_class_reduce(t); /* a reduce of its class's own: visit() (an error: visit() reports it) */
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
      dpy_walk_error(s, o, "a tensor whose memory cannot be described");
    }
    rc = -1;
  }
  for (int i = 0; i < na && rc == 1; i++)
    if (a[i].nbytes &&
        add_alloc(s, (dp_device_t){(dp_device_type_t)a[i].device_type, a[i].device_index}, a[i].base, a[i].nbytes, o))
      rc = -1;
  /* Python code under the adapter may have given it attributes: visit()
     walks them after its memory */
  if (rc == 1 && may_hold_attrs(o, t)) rc = resume(s, in) || dpy_visit_tensor_attrs(s, o) ? -1 : 2;
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
      rc = level < INLINE_DEPTH && !s->ran_code && Py_REFCNT(o) == 1 && !opaque_type(s, t)
               ? run_inline(s, o, ok, level + 1, &me)
               : 0;
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
  /* too deep, or a leaf to opaque= (maybe): visit() says so, or asks */
  if (Py_TYPE(t) != &PyType_Type || s->nframes + 1 > s->max_depth || opaque_type(s, t)) return 0;
  PyObject *fn = PyDict_GetItemWithError(dpy.dispatch_table, (PyObject *)t);
  if (!fn && PyErr_Occurred()) return dpy_dispatch_error(s, o); /* at o's path: the run's frame's item */
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
    if (dpy_reduce_name(k)) { /* an instance's own __reduce_ex__ or __getstate__: visit() reduces it */
      s->dispatch_known = 1;
      return let_go(s, o);
    }
  }
  s->dispatch_obj = NULL;
  inl_t me = {.obj = d, .owner = t, .kind = FR_ATTRS, .dsize = n};
  int rc = 1;
  Py_INCREF(d); /* Python code under the adapter may replace the object's dict: this one is read, as a frame reads it */
  PyObject *last = NULL; /* the key of the value read last, which may have run code: still at last_at? */
  Py_ssize_t last_at = 0;
  for (pos = 0; rc == 1;) {
    Py_ssize_t at = pos;
    if (last) {
      Py_ssize_t p = last_at;
      if (!PyDict_Next(d, &p, &k, &v) || k != last || p != at) { /* moved: the walk resumed reports it */
        me.pos = at, me.idx = count - 1, me.label = last, me.kpos = last_at;
        rc = resume(s, &me) ? -1 : 2;
        break;
      }
      Py_CLEAR(last);
    }
    if (PyDict_GET_SIZE(d) != n) { /* the walk resumed reports it, as a frame's next step does */
      me.pos = at, me.idx = count - 1, me.label = NULL;
      rc = resume(s, &me) ? -1 : 2;
      break;
    }
    if (!PyDict_Next(d, &pos, &k, &v)) break;
    if (count == n) { /* an entry past its size: a key moved, which the walk resumed reports */
      me.pos = at, me.idx = count - 1, me.label = NULL;
      rc = resume(s, &me) ? -1 : 2;
      break;
    }
    count++;
    PyTypeObject *vt = Py_TYPE(v);
    if (plain_leaf(vt)) continue;
    int solo = Py_REFCNT(v) == 1;
    Py_INCREF(k);
    Py_INCREF(v);
    me.pos = pos, me.idx = count - 1, me.label = k, me.kpos = at;
    if (vt == &PyTuple_Type || vt == &PyList_Type)
      rc = !s->ran_code && solo && !opaque_type(s, vt) ? run_inline(s, v, ok, 2, &me) : 0;
    else
      rc = run_tensor(s, v, ok, &me);
    if (rc == 0) { /* the walk visits this value next */
      me.pos = at, me.idx = count - 2, me.label = NULL;
      rc = resume(s, &me) ? -1 : 2;
    }
    if (rc == 1) last = Py_NewRef(k), last_at = at;
    Py_DECREF(k);
    Py_DECREF(v);
  }
  Py_XDECREF(last);
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
  if (s->npend == CAP && dpy_flush_pending(s)) return -1;
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

/* The walk of scan and of the Future (not building) over a list or
 * tuple: a run of items that are leaves, tensors run_tensor reads, or
 * small containers and objects read in place, is read here, as visit()
 * would read each (the same allocations, in the same order), without the
 * loop's per-child dispatch (an item that opaque= makes, or may make, a
 * leaf is left to visit(): opaque_type). Python code can still run under
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
        r = in_place && !opaque_type(s, t) ? run_inline(s, o, &ok, 1, NULL) : 0;
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
  s->chained = opts->chained;
  s->root = dp_none();
  s->saw_cupy = 0;
  if (!s->own) s->own = s->found;
  s->found = into ? into : s->own;
  /* A future's walk (no refs, no paths, into its own set) lists what it
     meets without deduplicating: the future needs no more (ptrs.h) */
  if (!into) dp__ptrset_set_raw(s->found, opts->no_refs && !opts->build && !opts->paths);
  dp_ptrset_clear(s->memo);
  s->nframes = 0;
  dpy_refs_reset(s);
  s->npaths = 0;
  s->text_len = 0;
  s->want_paths = opts->paths;
  s->error_path = NULL;
  s->count_refs = !opts->no_refs && !opts->build && !into; /* refs are of a set of its own */
  s->solo = 0;
  s->dispatch_obj = NULL;
  s->opaque = opts->opaque;
  if (dpy_opaque_begin(&s->op, s->opaque)) return -1;
  /* opaque=: isinstance runs code only where is_opaque says so */
  s->ran_code = 0;
  s->max_depth = opts->max_depth ? opts->max_depth : DP_DEFAULT_MAX_DEPTH;
  int runs = !s->build && dpy.torch && dpy.torch_tensor;
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
        if (f->kind != FR_DICT && f->kind != FR_ATTRS && f->kind != FR_SET)
          return dpy_walk_error_type(s, f->type ? f->type : Py_TYPE(f->obj), "its items cannot be read");
        /* a dict or set that changed: the path is the container's (an
           object's, for its __dict__, named by its class), not its last item's */
        PyTypeObject *named = f->kind == FR_ATTRS ? f->type : f->kind == FR_SET ? Py_TYPE(f->value) : Py_TYPE(f->obj);
        size_t n = s->nframes;
        s->nframes = n - 1;
        int rc = dpy_walk_error_type(s, named, "its items cannot be read");
        s->nframes = n;
        return rc;
      }
      dpy_build_made(s, f); /* a tuple's items are made: the tuple is */
      dpy_frame_drop(&s->frames[--s->nframes]);
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
  if (dpy_flush_pending(s)) return -1;
  return s->build ? dpy_check_storages(s) : 0;
}

int dpy_scan(dpy_scanner_t *s, PyObject *obj, const dpy_scan_opts_t *opts, dp_ptrset_t *into) {
  /* Python code under a walk may walk again (a repr that scans): the outer
     walk's held interrupt waits for it, untouched */
  PyObject *outer[3] = {held_exc[0], held_exc[1], held_exc[2]};
  held_exc[0] = held_exc[1] = held_exc[2] = NULL;
  int64_t interp = dpy_tcache_enter();
  int rc = scan_walk(s, obj, opts, into);
  dpy_opaque_end(&s->op);
  dpy_tcache_leave(interp);
  if (dpy_raise_held()) rc = -1;
  held_exc[0] = outer[0], held_exc[1] = outer[1], held_exc[2] = outer[2];
  return rc;
}
