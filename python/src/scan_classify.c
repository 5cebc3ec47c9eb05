/*
 * scan_classify.c — what a type is to the walk: kind_of reads a class as
 * pickle would treat its instances, and the cache keeps the answer per type
 * and version tag (scan_classify.h).
 */
#include "scan_classify.h"

#include <string.h>

tcache_ent_t tcache[1u << TCACHE_BITS][2];
/* What the walk's helpers swallow (a failed lookup of an attribute, a repr
 * that raised) is an error of the value's, shown as a placeholder or read
 * as "not pickle's default"; an interrupt (KeyboardInterrupt, SystemExit:
 * not an Exception) or MemoryError is not: the first is kept aside, the
 * walk stops at its next step, and dpy_scan raises it as it is (as it would
 * pass through pickle). */
_Thread_local PyObject *held_exc[3]; /* this thread's walk's (a nested walk saves the outer's) */

void dpy_clear_error(void) {
  if (!PyErr_Occurred()) return;
  if (!held_exc[0] && (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))) {
    PyErr_Fetch(&held_exc[0], &held_exc[1], &held_exc[2]);
    return;
  }
  PyErr_Clear();
}

int dpy_raise_held(void) {
  if (!held_exc[0]) return 0;
  PyErr_Restore(held_exc[0], held_exc[1], held_exc[2]); /* in place of any error the walk raised since */
  held_exc[0] = held_exc[1] = held_exc[2] = NULL;
  return -1;
}

static int is_default(PyObject *type, PyObject *name, PyObject *base_attr) {
  PyObject *a = PyObject_GetAttr(type, name);
  if (!a) {
    dpy_clear_error();
    return 0;
  }
  int same = a == base_attr;
  Py_DECREF(a);
  return same;
}

/* Whether the instances of type have the attribute through their class:
 * found in its MRO, as pickle looks __getnewargs__ up (a special lookup)
 * and as cupy, numba and torch find __cuda_array_interface__ or __dlpack__
 * on an instance (getattr: the instance, then its class's MRO). Never the
 * metaclass: getattr(type, name) also asks it (a metaclass's attribute, its
 * __getattr__), which answers for the class, not for its instances — a
 * catch-all metaclass __getattr__ made every instance an array interface
 * that its getattr then refused. Runs no Python code. */
static int has_attr(PyObject *type, PyObject *name) { return _PyType_Lookup((PyTypeObject *)type, name) != NULL; }

/* Whether the instances of t answer attribute `name` with a class's own
 * code: the first class of t's MRO that holds it is written in Python (a C
 * type's — object's, tuple's — is the generic one). Runs no Python code. */
static int overrides_object(PyTypeObject *t, const char *name) {
  PyObject *mro = t->tp_mro;
  for (Py_ssize_t i = 0; mro && PyTuple_Check(mro) && i < PyTuple_GET_SIZE(mro); i++) {
    PyTypeObject *b = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
    PyObject *v = b->tp_dict ? PyDict_GetItemString(b->tp_dict, name) : NULL;
    if (v) return (b->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0;
  }
  return 0;
}

/* Whether object.__reduce_ex__ takes an instance of t (no slots, no
 * __getnewargs__) whole by its __dict__, as CPython's default state
 * decides it (object_getstate_default): a class with no tp_new, or one
 * whose instances hold more than object's header, their dict and weakref
 * pointers — a Python subclass of property, staticmethod or classmethod,
 * whose C base keeps state of its own — is refused ("cannot pickle 'C'
 * object"), and so reduced, which refuses it as pickle does. */
static int default_state_is_whole(PyTypeObject *t) {
  if (!t->tp_new || t->tp_itemsize) return 0;
  Py_ssize_t size = PyBaseObject_Type.tp_basicsize;
#ifdef Py_TPFLAGS_MANAGED_DICT
  if (t->tp_dictoffset && !(t->tp_flags & Py_TPFLAGS_MANAGED_DICT)) size += (Py_ssize_t)sizeof(PyObject *);
#else
  if (t->tp_dictoffset) size += (Py_ssize_t)sizeof(PyObject *);
#endif
  if (t->tp_weaklistoffset > 0) size += (Py_ssize_t)sizeof(PyObject *);
  return t->tp_basicsize <= size;
}

/* Pickle's defaults, so that the state is exactly the instance __dict__.
 * Pickle looks them up on the instance (getattr(obj, "__reduce_ex__"),
 * obj.__getstate__, and obj.__class__, which __newobj__ must be): a
 * __getattribute__ or __class__ of the class's own may answer otherwise
 * (another reduce, none at all, another class), so such a class is
 * reduced as pickle reduces it. */
static int plain_instance(PyTypeObject *t) {
  PyObject *type = (PyObject *)t;
  if (overrides_object(t, "__getattribute__") || overrides_object(t, "__class__")) return 0;
  if (!is_default(type, dpy.str_reduce_ex, dpy.object_reduce_ex)) return 0;
  if (!is_default(type, dpy.str_getstate, dpy.object_getstate)) return 0;
  PyObject *r = PyObject_GetAttrString(type, "__reduce__");
  if (!r) {
    dpy_clear_error();
    return 0;
  }
  int same = r == dpy.object_reduce;
  Py_DECREF(r);
  if (!same) return 0;
  if (has_attr(type, dpy.str_getnewargs_ex) || has_attr(type, dpy.str_getnewargs)) return 0;
  PyObject *slots = PyObject_CallOneArg(dpy.slotnames, type);
  if (!slots) {
    dpy_clear_error();
    return 0;
  }
  Py_ssize_t n = PyList_Check(slots) ? PyList_GET_SIZE(slots) : -1;
  Py_DECREF(slots);
  return n == 0 && default_state_is_whole(t);
}

/* The code of the __getnewargs__ collections.namedtuple writes into each
 * class it makes (tuple(self): one code object for all of them), or NULL
 * when it cannot be read (then no namedtuple is taken for pickle's
 * defaults: each is reduced, as pickle reduces it). Read once and kept. */
static PyObject *namedtuple_getnewargs_code(void) {
  static PyObject *code;
  if (code) return code;
  PyObject *mod = PyImport_ImportModule("collections");
  PyObject *make = mod ? PyObject_GetAttrString(mod, "namedtuple") : NULL;
  PyObject *cls = make ? PyObject_CallFunction(make, "ss", "_", "") : NULL;
  PyObject *fn = cls ? PyObject_GetAttr(cls, dpy.str_getnewargs) : NULL;
  if (fn && PyFunction_Check(fn)) code = Py_NewRef(PyFunction_GET_CODE(fn));
  else dpy_clear_error();
  Py_XDECREF(fn);
  Py_XDECREF(cls);
  Py_XDECREF(make);
  Py_XDECREF(mod);
  return code;
}

/* Whether pickle makes t's instances from their items: the __getnewargs__
 * they find is tuple's or a namedtuple's (both tuple(self)), and they have
 * no __getnewargs_ex__, which pickle asks first. A class's own gives other
 * args, which pickle carries instead of the items. Runs no Python code but
 * the first time (namedtuple_getnewargs_code). */
static int items_are_newargs(PyTypeObject *t) {
  if (has_attr((PyObject *)t, dpy.str_getnewargs_ex)) return 0;
  PyObject *g = _PyType_Lookup(t, dpy.str_getnewargs);
  if (!g || g == _PyType_Lookup(&PyTuple_Type, dpy.str_getnewargs)) return 1;
  PyObject *code = PyFunction_Check(g) ? namedtuple_getnewargs_code() : NULL;
  return code && PyFunction_GET_CODE(g) == code;
}

/* Whether t reduces its instances as its base does (no __reduce_ex__,
 * __reduce__ or __getstate__ of its own): a subclass of a future that
 * makes itself picklable is reduced as pickle would. */
static int keeps_reduce_of(PyTypeObject *t, PyTypeObject *base) {
  PyObject *const names[3] = {dpy.str_reduce_ex, dpy.str_reduce, dpy.str_getstate};
  for (int i = 0; i < 3; i++)
    if (_PyType_Lookup(t, names[i]) != _PyType_Lookup(base, names[i])) return 0;
  return 1;
}

static uint8_t kind_of(PyTypeObject *t) {
  PyObject *type = (PyObject *)t;
  if (PyType_IsSubtype(t, &PyType_Type) || t == &PyFunction_Type) return K_LEAF;
  if (PyType_IsSubtype(t, &PyCFunction_Type)) return K_CFUNC;
  if (PyType_IsSubtype(t, &PyModule_Type)) return K_REDUCE; /* which refuses it, as pickle does */
  if (dpy.numpy_generic && PyType_IsSubtype(t, dpy.numpy_generic)) return K_NPSCALAR;
  if (dpy.torch_tensor && PyType_IsSubtype(t, dpy.torch_tensor)) return K_TORCH;
  for (int i = 0; i < 2; i++)
    if (dpy.torch_storage[i] && PyType_IsSubtype(t, dpy.torch_storage[i])) return K_STORAGE;
  if (dpy.cupy_ndarray && dpy.cupy_ndarray != Py_None && PyType_IsSubtype(t, (PyTypeObject *)dpy.cupy_ndarray))
    return K_CUPY;
  for (size_t i = 0; i < sizeof dpy.sync_types / sizeof *dpy.sync_types; i++)
    if (dpy.sync_types[i] && PyType_IsSubtype(t, dpy.sync_types[i]) && keeps_reduce_of(t, dpy.sync_types[i]))
      return K_SYNC;
  if (has_attr(type, dpy.str_cai)) return K_CAI;
  if (t->tp_as_buffer && t->tp_as_buffer->bf_getbuffer && !PyType_IsSubtype(t, &PyBytes_Type)) return K_BUFFER;
  if (has_attr(type, dpy.str_dlpack) && has_attr(type, dpy.str_dlpack_device)) return K_DLPACK;
  int aif = has_attr(type, dpy.str_aif); /* its memory first, then walked as it would be without */
  if (PyType_IsSubtype(t, &PyTuple_Type) && t->tp_dictoffset == 0 && has_attr(type, dpy.str_fields) &&
      !overrides_object(t, "__getattribute__") && !overrides_object(t, "__class__") &&
      is_default(type, dpy.str_reduce_ex, dpy.object_reduce_ex) &&
      is_default(type, dpy.str_getstate, dpy.object_getstate) &&
      is_default(type, dpy.str_reduce, dpy.object_reduce) && items_are_newargs(t))
    return aif ? K_AIF : K_NAMEDTUPLE;
  /* classes of Python code only: a C type's instances may hold state that
   * its (inherited) reduce refuses or that __dict__ does not show */
  if (t->tp_dictoffset != 0 && (t->tp_flags & Py_TPFLAGS_HEAPTYPE) && !PyType_IsSubtype(t, &PyTuple_Type) &&
      !PyType_IsSubtype(t, &PyList_Type) && !PyType_IsSubtype(t, &PyDict_Type) && plain_instance(t))
    return aif ? K_AIF_OBJECT : K_OBJECT;
  return aif ? K_AIF : K_REDUCE;
}

/* The kind of an instance of t (K_CAI or K_DLPACK by its class) whose
 * interface raised AttributeError when read — it has none: its buffer, its
 * __array_interface__, else its reduce, as kind_of() would have classed it
 * without the interface (a plain class's instance is reduced: the same
 * attributes, as pickle carries them). */
uint8_t dpy_kind_without_iface(PyTypeObject *t) {
  if (t->tp_as_buffer && t->tp_as_buffer->bf_getbuffer && !PyType_IsSubtype(t, &PyBytes_Type)) return K_BUFFER;
  return has_attr((PyObject *)t, dpy.str_aif) ? K_AIF : K_REDUCE;
}


/* t's version tag, given one first when it has none (a class changed since
 * its last lookup — copyreg._slotnames sets torch.Tensor.__slotnames__ — has
 * none until something looks an attribute up in it; without one no instance
 * would ever hit the cache): 1 and *tag, or 0 when it can have none. Runs no
 * Python code (_PyType_Lookup assigns the tag). */
static int version_tag(PyTypeObject *t, unsigned int *tag) {
  if (!(t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) (void)_PyType_Lookup(t, dpy.str_reduce_ex);
  *tag = t->tp_version_tag;
  return (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) != 0;
}

/* Keeps kind k for t under tag: in t's own entry where its set holds one
 * (a stale tag), else first in its set, the set's first moved second (the
 * one used longest ago goes). */
static void tcache_keep(PyTypeObject *t, unsigned int tag, uint8_t k) {
  tcache_ent_t *set = tcache[dpy_type_slot(t, TCACHE_BITS)], *e = &set[0];
  if (set[1].type == t) e = &set[1];
  else if (set[0].type != t) set[1] = set[0];
  e->type = t;
  e->version = tag;
  e->kind = k;
  e->no_slots = 0;
}

uint8_t dpy_classify_slow(PyTypeObject *t) {
  if (t == &PySet_Type || t == &PyFrozenSet_Type) return K_SET;
  if (t == &PyComplex_Type || t == &PyBytes_Type) return K_LEAF;
  /* kind_of runs Python code (copyreg._slotnames, which sets __slotnames__
     on the class; a metaclass's __getattribute__), which may change the
     class, or let another thread change it, after kind_of read what it
     changed: a kind is kept only under the tag the class had before it was
     read and still has, else it is read again. A class that keeps changing
     is answered as last read, and not kept. */
  uint8_t k = K_UNKNOWN;
  for (int tries = 0; tries < 3; tries++) {
    unsigned int before, after;
    int tagged = version_tag(t, &before);
    k = kind_of(t);
    /* classified while an interrupt was held: not an answer to keep, nor one
       to act on — visit() stops there, before running any of the value's code */
    if (held_exc[0]) return K_UNKNOWN;
    if (!version_tag(t, &after) || !tagged) return k; /* no tag to keep it under */
    if (after == before) {
      tcache_keep(t, after, k);
      return k;
    }
  }
  return k;
}

/* Forgets every cached kind (torch or cupy appeared: tensor types change
 * kind). */
static void tcache_clear(void) {
  memset(tcache, 0, sizeof tcache);
}

/* The interpreter whose types the cache holds (its id: an address may be
 * reused by a later interpreter), -1 before the first walk. */
static int64_t tcache_interp = -1;

/* A walk begins: the cache is emptied when it holds another interpreter's
 * types (two interpreters may give their classes the same tags). Returns
 * what dpy_tcache_leave restores. */
int64_t dpy_tcache_enter(void) {
  int64_t outer = tcache_interp, id = PyInterpreterState_GetID(PyInterpreterState_Get());
  if (id != tcache_interp) {
    tcache_clear();
    tcache_interp = id;
  }
  return outer;
}

/* A walk ends: a walk nested in another interpreter's code (a reduce that
 * runs a subinterpreter which walks) leaves the outer walk its own types. */
void dpy_tcache_leave(int64_t outer) {
  if (outer != -1 && outer != tcache_interp) {
    tcache_clear();
    tcache_interp = outer;
  }
}

void dpy_scan_forget_types(void) { tcache_clear(); }

/* ---- opaque= ---- */

/* Whether isinstance reads an instance's __class__ as its type: the getattr
 * is object's — the generic slot itself, or a Python class's slot over a
 * __getattribute__ that wraps it (a __getattr__ is then never reached:
 * __class__ is always found) — and __class__ is object's descriptor. A C
 * type's dict may hold a wrapper of the generic slot of its own (list's):
 * its slot is what runs. Runs no Python code. */
static int class_is_type(PyTypeObject *t) {
  if (t->tp_getattro != PyObject_GenericGetAttr) {
    if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) return 0;
    PyObject *ga = _PyType_Lookup(t, dpy.str_getattribute);
    if (!ga || !Py_IS_TYPE(ga, &PyWrapperDescr_Type) ||
        ((PyWrapperDescrObject *)ga)->d_wrapped != (void *)PyObject_GenericGetAttr)
      return 0;
  }
  return _PyType_Lookup(t, dpy.str_class) == dpy.object_class;
}

/* Keeps type m watched (held, its tag recorded): 1, or 0 when it cannot
 * be (no tag, or too many types already). Held: code the walk runs may
 * take m off the class that held it (its __class__ assigned) and free it,
 * while the stale check still reads its tag. */
static int watch(dpy_opaque_t *op, PyTypeObject *m) {
  for (int i = 0; i < op->nwatch; i++)
    if (op->watch[i] == m) return 1;
  unsigned int tag;
  if (op->nwatch == OPAQUE_WATCH || !version_tag(m, &tag)) return 0;
  op->watch[op->nwatch] = (PyTypeObject *)Py_NewRef(m);
  op->watch_tag[op->nwatch++] = tag;
  return 1;
}

/* Records item i's metaclass m (watched): 1, or 0 when there is no room. */
static int note_meta(dpy_opaque_t *op, Py_ssize_t i, PyTypeObject *m) {
  if (op->nmeta == OPAQUE_WATCH) return 0;
  op->meta_item[op->nmeta] = i;
  op->meta[op->nmeta++] = m;
  return 1;
}

/* Lets go of the watched types, after the new ones are held: a type let go
 * of may be freed, and its finalization run code. */
static void unwatch(PyTypeObject **old, int n) {
  for (int i = 0; i < n; i++) Py_DECREF(old[i]);
}

/* Whether isinstance(o, T) is ABCMeta's, whose answer for o's type ABCMeta
 * keeps until the token moves: its metaclass m answers __instancecheck__
 * and __subclasscheck__ with ABCMeta's (reached through type's getattr),
 * and T has no __subclasscheck__ of its own, which ABCMeta's would call
 * each time. Both are watched. Runs no Python code. */
static int abc_kept(dpy_opaque_t *op, PyTypeObject *T, PyTypeObject *m, PyObject *check) {
  return dpy.abc_instancecheck && check == dpy.abc_instancecheck && op->nabc < OPAQUE_ABC &&
         m->tp_getattro == PyType_Type.tp_getattro && _PyType_Lookup(m, dpy.str_subclasscheck) == dpy.abc_subclasscheck &&
         !_PyType_Lookup(T, dpy.str_subclasscheck) && watch(op, m) && watch(op, T);
}

static void forget(dpy_opaque_t *op) {
  op->used = 0;
  if (++op->gen == 0) { /* wrapped: entries of 2^32 generations ago would look fresh */
    memset(op->cache, 0, sizeof(dpy_opaque_ent_t) << op->bits);
    op->gen = 1;
  }
}

/* Doubles the table, this generation's entries moved over: 0, or -1 with
 * MemoryError. */
static int grow(dpy_opaque_t *op) {
  size_t n = (size_t)1 << op->bits;
  dpy_opaque_ent_t *old = op->cache, *big = PyMem_Calloc(2 * n, sizeof *big);
  if (!big) {
    PyErr_NoMemory();
    return -1;
  }
  op->cache = big;
  op->bits++;
  for (size_t i = 0; i < n; i++)
    if (old[i].gen == op->gen) *dpy_opaque_slot(op, old[i].type) = old[i];
  if (old != op->inl) PyMem_Free(old);
  return 0;
}

int dpy_opaque_respec(dpy_opaque_t *op) {
  PyTypeObject *old[OPAQUE_WATCH];
  int nold = op->nwatch;
  memcpy(old, op->watch, sizeof(PyTypeObject *) * (size_t)nold);
  forget(op);
  op->nwatch = op->nabc = op->nmeta = 0;
  Py_CLEAR(op->token);
  op->n = op->types ? PyTuple_GET_SIZE(op->types) : 0;
  op->first_code = op->n;
  for (Py_ssize_t i = 0; i < op->n; i++) {
    PyTypeObject *T = (PyTypeObject *)PyTuple_GET_ITEM(op->types, i), *m = Py_TYPE(T);
    /* isinstance asks a metaclass other than type for __instancecheck__;
       type's own answers as type does (and type's instances cannot be
       given another metaclass: type is immutable) */
    if (m == &PyType_Type) continue;
    PyObject *check = _PyType_Lookup(m, dpy.str_instancecheck);
    if (op->nmeta < OPAQUE_WATCH && check == dpy.type_instancecheck && watch(op, m) && note_meta(op, i, m)) continue;
    if (op->nmeta < OPAQUE_WATCH && abc_kept(op, T, m, check) && note_meta(op, i, m)) {
      op->abc[op->nabc++] = i;
      continue;
    }
    op->first_code = i;
    break;
  }
  unwatch(old, nold);
  if (op->nabc && !(op->token = PyObject_CallNoArgs(dpy.abc_token))) return -1;
  return 0;
}

void dpy_opaque_end(dpy_opaque_t *op) {
  if (op->cache != op->inl) { /* the next walk begins with the scanner's own table */
    PyMem_Free(op->cache);
    memset(op->inl, 0, sizeof op->inl); /* its entries may be of a generation to come (gen wrapped meanwhile) */
    op->cache = op->inl;
    op->bits = OPAQUE_BITS;
  }
  int n = op->nwatch;
  op->nwatch = op->nabc = op->nmeta = 0;
  Py_CLEAR(op->token);
  unwatch(op->watch, n);
}

int dpy_opaque_begin(dpy_opaque_t *op, PyObject *types) {
  if (!op->cache) { /* a zeroed scanner's first walk */
    op->cache = op->inl;
    op->bits = OPAQUE_BITS;
  }
  op->types = types;
  return dpy_opaque_respec(op);
}

int dpy_opaque_token_same(dpy_opaque_t *op) {
  PyObject *now = PyObject_CallNoArgs(dpy.abc_token); /* a C function: an int */
  if (!now) return -1;
  int same = PyObject_RichCompareBool(now, op->token, Py_EQ);
  if (same == 0) {
    Py_SETREF(op->token, now);
    forget(op);
    return 0;
  }
  Py_DECREF(now);
  return same;
}

static int is_abc_item(const dpy_opaque_t *op, Py_ssize_t i) {
  for (int j = 0; j < op->nabc; j++)
    if (op->abc[j] == i) return 1;
  return 0;
}

/* isinstance(o, item) for each item in order, as an instance of t answers
 * it: the first true, else n; or, where code would run each time (an
 * item's metaclass, o's __class__), -1 - the item from which it must be
 * called. An ABC is asked (o given: Python code runs) or, without o,
 * OPAQUE_ASK is returned. OPAQUE_ERR with an exception. */
static Py_ssize_t answer(dpy_opaque_t *op, PyTypeObject *t, PyObject *o) {
  int determined = -1; /* class_is_type(t), read when first needed */
  for (Py_ssize_t i = 0; i < op->n; i++) {
    PyTypeObject *T = (PyTypeObject *)PyTuple_GET_ITEM(op->types, i);
    if (t == T) return i; /* isinstance's first test, before any __instancecheck__ */
    if (i == op->first_code) return -1 - i;
    if (determined < 0) determined = class_is_type(t);
    if (op->nabc && is_abc_item(op, i)) {
      if (!determined) return -1 - i; /* ABCMeta reads o.__class__ */
      if (!o) return OPAQUE_ASK;
      int r = PyObject_IsInstance(o, (PyObject *)T);
      if (r < 0) return OPAQUE_ERR;
      if (r) return i;
      /* the ABC's code may have changed what the items after it answer
         with: they are asked as isinstance asks them */
      if (dpy_opaque_stale(op)) return -1 - (i + 1);
      continue;
    }
    if (PyType_IsSubtype(t, T)) return i;
    if (!determined) return -1 - i; /* isinstance reads o.__class__ next */
  }
  return op->n;
}

/* Keeps hit for t, under the tag t had before it was answered and still
 * has: 0, or -1 with MemoryError. */
static int keep(dpy_opaque_t *op, PyTypeObject *t, unsigned int tag, Py_ssize_t hit) {
  unsigned int now;
  if (!version_tag(t, &now) || now != tag) return 0;
  dpy_opaque_ent_t *e = dpy_opaque_slot(op, t);
  if (e->gen != op->gen) { /* a type not met before: a slot more, the table at most three quarters full */
    if (4 * (op->used + 1) > ((size_t)3 << op->bits)) {
      if (grow(op)) return -1;
      e = dpy_opaque_slot(op, t);
    }
    op->used++;
  }
  e->type = t;
  e->version = tag;
  e->gen = op->gen;
  e->hit = hit;
  return 0;
}

Py_ssize_t dpy_opaque_slow(dpy_opaque_t *op, PyTypeObject *t) {
  unsigned int tag;
  int tagged = version_tag(t, &tag);
  Py_ssize_t hit = answer(op, t, NULL);
  if (tagged && hit != OPAQUE_ASK && keep(op, t, tag, hit)) return OPAQUE_ERR;
  return hit;
}

Py_ssize_t dpy_opaque_ask(dpy_opaque_t *op, PyObject *o) {
  PyTypeObject *t = Py_TYPE(o);
  unsigned int tag, gen = op->gen;
  int tagged = version_tag(t, &tag);
  Py_INCREF(t); /* the ABCs' code may let go of o's class (o stays: its caller holds it) */
  Py_ssize_t hit = answer(op, t, o);
  /* kept only where the code ran changed nothing it read: a watched type,
     the token (which forgets: gen), t's own tag */
  if (hit != OPAQUE_ERR && tagged && !dpy_opaque_stale(op)) {
    int same = dpy_opaque_token_same(op);
    if (same < 0) hit = OPAQUE_ERR;
    else if (same && op->gen == gen && keep(op, t, tag, hit)) hit = OPAQUE_ERR;
  }
  Py_DECREF(t);
  return hit;
}
