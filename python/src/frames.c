/*
 * frames.c — devpickle.dumps and devpickle.loads: devpickle frames (the C
 * library's format, the bytes `devpickle verify` checks), with device buffers
 * out of band in the manner of pickle protocol 5.
 *
 * dumps walks the object in build mode (scan_build.c) into a devpickle value and
 * pickles it; buffer_callback then receives each buffer in table order.
 * loads unpickles (the C library's checks and limits apply: the input is
 * hostile) and turns the value back into Python objects without recursion;
 * classes come back only through classes=, tensors and arrays are rebuilt
 * over the inline bytes or the buffers given (devpickle/_frames.py).
 */
#include "ext.h"
#include "../../pickler/path.h"

#include <string.h>

static PyObject *frames_py;   /* devpickle._frames */
static PyObject *frame_error; /* devpickle.FrameError */

static PyObject *helper(const char *name) {
  if (!frames_py && !(frames_py = PyImport_ImportModule("devpickle._frames"))) return NULL;
  return PyObject_GetAttrString(frames_py, name);
}

/* ---- dumps ---- */

/* Inline frames: dp_pickle runs with the GIL held, so that no other thread
 * resizes or frees cpu memory (a numpy array, a cpu tensor's storage) under
 * the copy, as pickle copies it. Device memory is read on this thread's
 * current stream (torch's, where torch is in use: the data the caller's
 * queued work writes), without the GIL while the copy waits for that work;
 * other threads run meanwhile, so cpu memory read after such a wait is
 * checked again first (the walk's dpy_check_storages no longer answers for it). */
typedef struct reader {
  dpy_scanner_t *scanner;
  int gil_dropped; /* the GIL was released since the walk checked the storages */
} reader_t;

static int read_memory(void *ud, dp_device_t device, const void *src, size_t n, void *dst, dp_error_t *err) {
  reader_t *r = ud;
  if (device.type == DP_DEVICE_CPU) {
    if (r->gil_dropped && dpy_scanner_recheck(r->scanner, device, src)) {
      err->code = DP_ESTATE;
      snprintf(err->message, sizeof err->message, "cpu memory changed while a device copy waited");
      return DP_ESTATE; /* the WalkError raised stands */
    }
    if (n) memcpy(dst, src, n); /* an empty storage's base may be NULL (torch.zeros(0)) */
    return 0;
  }
  dp_backend_t *b;
  dp_stream_t *s;
  int rc;
  r->gil_dropped = 1;
  Py_BEGIN_ALLOW_THREADS;
  rc = dp_backend_get(device.type, &b, err);
  if (!rc) rc = dp_current_stream(b, device, &s, err);
  if (!rc) rc = dp_memcpy_async(s, dst, src, n, err);
  if (!rc) rc = dp_stream_synchronize(s, err);
  Py_END_ALLOW_THREADS;
  return rc;
}

/* A FrameError whose message names the byte, as the CLI's does: a
 * traceback shows the message, not the offset attribute. */
static PyObject *frame_fail(int rc, const dp_error_t *e) {
  if (rc == DP_ENOMEM) return PyErr_NoMemory();
  PyObject *text = e->offset >= 0 ? PyUnicode_FromFormat("%s, at byte %lld", e->message, (long long)e->offset)
                                  : PyUnicode_FromFormat("%s", e->message);
  PyObject *exc = text ? PyObject_CallOneArg(frame_error, text) : NULL;
  Py_XDECREF(text);
  if (!exc) return NULL;
  PyObject *code = PyUnicode_FromString(dp_err_name(rc)), *off = PyLong_FromLongLong(e->offset);
  if (code && off && !PyObject_SetAttrString(exc, "code", code) && !PyObject_SetAttrString(exc, "offset", off))
    PyErr_SetObject(frame_error, exc);
  Py_XDECREF(code);
  Py_XDECREF(off);
  Py_DECREF(exc);
  return NULL;
}

PyObject *dpy_dumps(PyObject *self, PyObject *args, PyObject *kw) {
  (void)self;
  static char *kwlist[] = {"obj", "inline", "buffer_callback", NULL};
  PyObject *obj, *cb = Py_None;
  int inl = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$pO:dumps", kwlist, &obj, &inl, &cb)) return NULL;
  if (cb != Py_None && !PyCallable_Check(cb)) {
    PyErr_Format(PyExc_TypeError, "buffer_callback must be callable or None, not '%s'", Py_TYPE(cb)->tp_name);
    return NULL;
  }
  /* a stand-in is callable only to refuse: say so before the walk, not at the first buffer */
  if (cb != Py_None && dpy_refuse_stand_in(cb, "buffer_callback must be callable or None, not", "")) return NULL;
  dpy_scanner_t *s = dpy_scanner_get();
  if (!s) return NULL;
  PyObject *out = NULL, *mk = NULL;
  dp_frame_t *frame = NULL;
  dpy_scan_opts_t o = {.build = 1, .paths = 1, .inline_data = inl}; /* a storage that changed is named by its path */
  if (dpy_scan(s, obj, &o, NULL)) goto done;
  dp_error_t e;
  int rc = dp_frame_new(&frame, &e);
  reader_t rd = {.scanner = s};
  dp_pickle_opts_t po = {.flags = inl ? DP_PICKLE_INLINE : 0, .read = read_memory, .read_ud = &rd};
  if (!rc) rc = dp_pickle(dpy_scanner_root(s), &po, frame, &e);
  if (rc) {
    if (PyErr_Occurred()) goto done; /* read_memory's WalkError */
    if (rc == DP_ENOMEM) {
      PyErr_NoMemory();
      goto done;
    }
    /* a value the frame cannot carry as built — nested deeper than a frame
       may be (a reduced object is several of a frame's levels: the object,
       its <dictitems> list, each pair): a WalkError, as a walk's too deep
       is, at the root, the message naming the frame's path where the limit
       was passed */
    PyErr_SetString(rc == DP_ELIMIT ? PyExc_RecursionError : PyExc_ValueError, e.message);
    dpy_scanner_root_error(s, obj, "it cannot be carried in a frame");
    goto done;
  }
  size_t len;
  const uint8_t *data = dp_frame_data(frame, &len);
  if (!(out = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)len))) goto done;
  if (cb == Py_None || inl) goto done;
  if (!(mk = helper("Buffer"))) goto fail;
  for (size_t i = 0; i < dp_frame_nbuffers(frame); i++) {
    dp_buffer_desc_t d;
    size_t at;
    dp_frame_buffer(frame, i, &d, NULL);
    PyObject *owner = NULL;
    if (!dp_ptrset_find(dpy_scanner_ptrs(s), d.device, (void *)(uintptr_t)d.base, &at, NULL))
      owner = dpy_scanner_buffer_obj(s, at);
    PyObject *b = PyObject_CallFunction(mk, "NNKO", dpy_device_str(d.device), PyLong_FromUnsignedLongLong(d.base),
                                        (unsigned long long)d.nbytes, owner ? owner : Py_None);
    PyObject *r = b ? PyObject_CallOneArg(cb, b) : NULL;
    Py_XDECREF(b);
    if (!r) goto fail;
    Py_DECREF(r);
  }
  goto done;
fail:
  Py_CLEAR(out);
done:
  Py_XDECREF(mk);
  dp_frame_free(frame);
  dpy_scanner_put(s);
  return out;
}

/* ---- loads ---- */

/* Hashing. CPython keeps no tuple's hash: each time a tuple is a set's item
 * or a dict's key, its items are hashed, and theirs, by C recursion without
 * a depth guard. A frame shares a tuple by back-reference, so 1,000 items
 * (i, T) over one 1,000-item T hash T's items 1,000,000 times (uses x size:
 * quadratic in the frame), and 250,000 nested tuples overflow the C stack.
 * hash_work says what one hash of x costs — the tuple items hashed: len(t)
 * plus each tuple item's work — so that loads charges it (max_copies) before
 * Python does it, and refuses a tree more than HASH_MAX_DEPTH tuples deep
 * (pickle's own recursion stops at 1,000 levels too). Anything else is 0
 * here: str, bytes and frozenset keep their hash once computed, a frame's
 * ints are int64, and an allowed class's own __hash__ is its code. A tuple
 * of tuples is walked once per loads: memo maps id -> (the tuple, kept so
 * its id is not reused; work << 11 | height); a tuple of none is walked
 * again each time (memory for the memo only where sharing can multiply the
 * walk), and a walk stops once its steps pass the budget left, so the walk
 * costs no more than what is charged. Not CPython's private known-hash
 * inserts (_PyDict_SetItem_KnownHash): sets have none, and (i, T) is a new
 * tuple whose hash CPython computes in full whatever T's. */
#define HASH_MAX_DEPTH 1000
#define HASH_WORK_MAX ((uint64_t)1 << 52) /* saturates: 2^52 is past any budget */

typedef struct hframe {
  PyObject *t; /* borrowed: the root is held by the caller, the rest by their tuples */
  Py_ssize_t i;
  uint64_t work;
  unsigned height; /* of its tuple items, 0 for none */
} hframe_t;

static int hashed_in_full(PyObject *x) { return PyTuple_Check(x) && Py_TYPE(x)->tp_hash == PyTuple_Type.tp_hash; }

static uint64_t work_add(uint64_t a, uint64_t b) { return a + b > HASH_WORK_MAX ? HASH_WORK_MAX : a + b; }

/* 1 and *work, *height when t was walked; 0 when not; -1 on error. */
static int hash_memo_get(PyObject *memo, PyObject *t, uint64_t *work, unsigned *height) {
  PyObject *id = PyLong_FromVoidPtr(t);
  if (!id) return -1;
  PyObject *hit = PyDict_GetItemWithError(memo, id);
  Py_DECREF(id);
  if (!hit) return PyErr_Occurred() ? -1 : 0;
  if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2 || PyTuple_GET_ITEM(hit, 0) != t) {
    /* only _hash_work's caller can put anything else there */
    PyErr_SetString(PyExc_TypeError, "_hash_work: memo holds an entry it did not make");
    return -1;
  }
  unsigned long long w = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(hit, 1));
  if (w == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *work = w >> 11;
  *height = (unsigned)(w & 0x7ff);
  return 1;
}

static int hash_memo_put(PyObject *memo, PyObject *t, uint64_t work, unsigned height) {
  PyObject *id = PyLong_FromVoidPtr(t);
  PyObject *v = id ? Py_BuildValue("(OK)", t, (unsigned long long)(work << 11 | height)) : NULL;
  int rc = v ? PyDict_SetItem(memo, id, v) : -1;
  Py_XDECREF(id);
  Py_XDECREF(v);
  return rc;
}

static int too_deep(void) {
  PyErr_Format(PyExc_ValueError,
               "loads: a set item or dict key nested more than %d tuples deep: CPython hashes a tuple by C "
               "recursion, which a tree that deep can overflow (a crash, not an exception)",
               HASH_MAX_DEPTH);
  return -1;
}

/* The tuple items one hash of x hashes, into *out; HASH_WORK_MAX once the
 * walk took more than `left` steps (each step is at least one item of the
 * work: the caller refuses it). 0, or -1 with an exception (too deep).
 * Iterative: its depth is the frame's. */
static int hash_work(PyObject *memo, PyObject *x, uint64_t left, uint64_t *out) {
  uint64_t w, steps = 0;
  unsigned h;
  *out = 0;
  if (!hashed_in_full(x)) return 0;
  int found = hash_memo_get(memo, x, out, &h);
  if (found) return found < 0 ? -1 : 0;
  /* a key's tree is shallow: no allocation until it is 16 tuples deep */
  hframe_t small[16], *st = small;
  size_t n = 0, cap = 16;
  int rc = -1;
  st[n++] = (hframe_t){.t = x};
  while (n) {
    hframe_t *f = &st[n - 1];
    if (f->i == PyTuple_GET_SIZE(f->t)) {
      uint64_t work = f->work;
      unsigned height = f->height + 1;
      if (height > 1 && hash_memo_put(memo, f->t, work, height)) goto done;
      if (!--n) {
        *out = work;
        rc = 0;
        break;
      }
      f = &st[n - 1];
      f->work = work_add(f->work, work);
      if (height > f->height) f->height = height;
      continue;
    }
    PyObject *item = PyTuple_GET_ITEM(f->t, f->i++);
    f->work = work_add(f->work, 1);
    if (++steps > left) {
      *out = HASH_WORK_MAX;
      rc = 0;
      goto done;
    }
    if (!hashed_in_full(item)) continue;
    if ((found = hash_memo_get(memo, item, &w, &h)) < 0) goto done;
    if (found) {
      if (n + h > HASH_MAX_DEPTH) {
        too_deep();
        goto done;
      }
      f->work = work_add(f->work, w);
      if (h > f->height) f->height = h;
      continue;
    }
    if (n == HASH_MAX_DEPTH) {
      too_deep();
      goto done;
    }
    if (n == cap) {
      hframe_t *ns = PyMem_Realloc(st == small ? NULL : st, 2 * cap * sizeof *ns);
      if (!ns) {
        PyErr_NoMemory();
        goto done;
      }
      if (st == small) memcpy(ns, small, sizeof small);
      st = ns;
      cap *= 2;
    }
    st[n++] = (hframe_t){.t = item};
  }
done:
  if (st != small) PyMem_Free(st);
  return rc;
}

/* Keys of one hash in one dict or set. CPython's hashes of ints, floats,
 * tuples and frozensets have no secret (only str and bytes hashes are
 * keyed), and are easily inverted: a frame whose keys all share one hash
 * makes building their dict or set quadratic (20,000 such tuple keys, a
 * 347 kB frame: 2.3 s). Keys of distinct hashes part ways within a few
 * probes, so counting equal hashes bounds the work: at most SAME_HASH_MAX
 * comparisons a key. Honest data stays far below it (an int64 shares its
 * hash with at most 9 others: hashes are taken modulo 2^61 - 1, and
 * hash(-1) is hash(-2); the 128 7-tuples of -1 and -2 share one). */
#define SAME_HASH_MAX 128

/* Counts x's hash in *counts (a dict made on first use: hash -> keys);
 * 0, or -1 with a ValueError past SAME_HASH_MAX (or the error of the hash).
 * str and bytes, whose hashes are keyed, and other types (an allowed
 * class's own __hash__, run once as Python runs it) are not counted. */
static int same_hash_guard(PyObject **counts, PyObject *x, const char *what) {
  PyTypeObject *t = Py_TYPE(x), *base = t;
  /* every value hashed by a C type's hash but str's and bytes': ints,
     floats, complex (complex(C - 1000003 * b, b) all share one hash),
     tuples, frozensets, numpy's scalars (a longdouble past DBL_MAX hashes as
     inf), ranges — C code, with no secret, run a second time at no risk —,
     and instances of classes written in Python that keep such a hash (a
     namedtuple's is tuple's: 20,000 namedtuples of one hash, a 707 kB
     frame, took 4.2 s); an instance of a class with a __hash__ of its own
     hashes by its own code, run once, as Python runs it */
  while (base->tp_base && (base->tp_flags & Py_TPFLAGS_HEAPTYPE)) base = base->tp_base;
  if (base == &PyUnicode_Type || base == &PyBytes_Type || t->tp_hash != base->tp_hash) return 0;
  Py_hash_t h = PyObject_Hash(x);
  if (h == -1) {
    /* an unhashable item (a pair (key, a list) of an allowed dict
       subclass's argument): Python hashes it only where it must, and
       refuses it there itself */
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
    PyErr_Clear();
    return 0;
  }
  if (!*counts && !(*counts = PyDict_New())) return -1;
  PyObject *k = PyLong_FromSsize_t(h);
  if (!k) return -1;
  PyObject *c = PyDict_GetItemWithError(*counts, k);
  long n = c ? PyLong_AsLong(c) + 1 : 1;
  int rc = -1;
  if (PyErr_Occurred()) goto out;
  if (n > SAME_HASH_MAX) {
    PyErr_Format(PyExc_ValueError,
                 "loads: the frame's %s hold more than %d keys of one hash (CPython's hashes of ints, floats and "
                 "tuples have no secret: keys chosen to collide would make building them quadratic)",
                 what, SAME_HASH_MAX);
    goto out;
  }
  PyObject *nv = PyLong_FromLong(n);
  rc = nv ? PyDict_SetItem(*counts, k, nv) : -1;
  Py_XDECREF(nv);
out:
  Py_DECREF(k);
  return rc;
}

/* _hash_work(items, memo, left): the tuple items hashing each of items
 * hashes (what set(items) costs), for devpickle/_frames.py; once past left
 * (an int >= 0), some number past it. items is a list or a tuple, taken
 * once as a tuple: both passes below (the charge, then the hash count) see
 * the same items, where a one-shot iterator would leave the second pass
 * nothing and a list could be changed between them by Python code that a
 * hash runs (an allowed class's __hash__ inside a tuple item). */
PyObject *dpy_hash_work(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *items, *memo;
  unsigned long long left;
  if (!PyArg_ParseTuple(args, "OO!K:_hash_work", &items, &PyDict_Type, &memo, &left)) return NULL;
  if (!PyList_Check(items) && !PyTuple_Check(items)) {
    PyErr_Format(PyExc_TypeError, "_hash_work: items must be a list or a tuple (it is read twice), not %s",
                 Py_TYPE(items)->tp_name);
    return NULL;
  }
  PyObject *t = PySequence_Tuple(items); /* an exact tuple is itself */
  if (!t) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(t), i;
  uint64_t total = 0, w;
  for (i = 0; i < n && total <= left; i++) {
    if (hash_work(memo, PyTuple_GET_ITEM(t, i), left - total, &w)) goto fail;
    total = work_add(total, w);
  }
  if (total <= left) {
    /* within the budget: their keys counted by hash (hashing them is what
       was charged), before Python builds anything of them */
    PyObject *counts = NULL;
    int rc = 0;
    for (i = 0; i < n && !rc; i++) rc = same_hash_guard(&counts, PyTuple_GET_ITEM(t, i), "set items or keys");
    Py_XDECREF(counts);
    if (rc) goto fail;
  }
  Py_DECREF(t);
  return PyLong_FromUnsignedLongLong(total);
fail:
  Py_DECREF(t);
  return NULL;
}

typedef struct loader {
  dp_ptrset_t *table;  /* the frame's buffers by (device, base), in table order */
  PyObject *buffers;   /* buffers= as iterating it gave them, once (a tuple), or NULL */
  PyObject *classes;   /* label -> class */
  PyObject *cache;     /* per buffer: the flat array rebuilt over it */
  dp_ptrset_t *memo;   /* heap nodes converted, by identity */
  PyObject *memo_objs; /* their Python objects (unfinished while being made) */
  PyObject *copies;    /* what finish copies out of shared nodes, bounded (_frames.Copies) */
  PyObject *hashed;    /* copies.hashed: hash_work's memo */
  uint64_t hash_owed;  /* dict keys' hashing work not yet charged to copies */
  PyObject *fn_array, *fn_new, *fn_fill, *fn_finish, *fn_subclass, *fn_object, *fn_reduced_new, *fn_reduced_done;
  PyObject *buffer_type; /* _frames.Buffer, what dumps hands buffer_callback */
  PyObject *np_dtypes[DP_DTYPE_COUNT]; /* numpy arrays' fast path: numpy.dtype of each dtype, or NULL */
  Py_ssize_t np_itemsize[DP_DTYPE_COUNT]; /* and its item size (-1: numpy has none; 0: not asked) */
  PyObject *np_module;   /* the sys.modules["numpy"] np_dtypes was answered for, or NULL */
  PyObject *torch_dtypes; /* torch tensors' fast path: dtype name -> torch.dtype or None, or NULL */
  PyObject *torch_module; /* the sys.modules["torch"] torch_dtypes was answered for, or NULL */
  PyObject *torch_flats;  /* torch tensors' fast path: buffer -> (its flat uint8 tensor, ptr, nbytes), or NULL */
  /* memo_objs' mark of a node being made: an object of its own, as a node
     may well be made into None (a reduce whose callable returns it) */
  PyObject *unfinished;
} loader_t;

static int bind(void *ud, const dp_buffer_desc_t *desc, dp_storage_t **out, dp_error_t *err) {
  loader_t *l = ud;
  int rc = dp_ptrset_add(l->table, desc->device, (void *)(uintptr_t)desc->base, desc->nbytes, NULL, err);
  if (!rc)
    rc = dp_storage_new(desc->device, (void *)(uintptr_t)desc->base, desc->nbytes, NULL, NULL, out, err);
  if (!rc && desc->data) {
    rc = dp_storage_set_host_data(*out, desc->data, err);
    if (rc) dp_storage_release(*out), *out = NULL; /* what a failing bind leaves is released by the library */
  }
  return rc;
}

static int memo_put(loader_t *l, dp_value_t v, PyObject *obj, size_t *at);
static PyObject *key_to_py(loader_t *l, dp_value_t k, int depth);

/* A str, bytes or key tuple the frame refers to more than once is converted
 * once, as containers are (by identity): a 1 MB str referred to 2,000
 * times is one object, not 2,000 copies. */
static PyObject *leaf_to_py(loader_t *l, dp_value_t v, int depth) {
  if (!dp_value_is_heap(v) || dp_value_refcount(v) < 2) return key_to_py(l, v, depth);
  size_t at;
  if (!dp_ptrset_find(l->memo, (dp_device_t){DP_DEVICE_CPU, 0}, dp_value_id(v), &at, NULL)) {
    PyObject *o = PyList_GET_ITEM(l->memo_objs, (Py_ssize_t)at);
    /* a key is never a tuple still being made (the reader refuses it);
       should one be, it is made afresh */
    return o != l->unfinished ? Py_NewRef(o) : key_to_py(l, v, depth);
  }
  PyObject *r = key_to_py(l, v, depth);
  if (r && memo_put(l, v, r, &at)) Py_CLEAR(r);
  return r;
}

static PyObject *key_to_py(loader_t *l, dp_value_t k, int depth) {
  switch (dp_value_kind(k)) {
  case DP_NONE:
    Py_RETURN_NONE;
  case DP_BOOL:
    return PyBool_FromLong(dp_value_as_bool(k));
  case DP_INT:
    return PyLong_FromLongLong(dp_value_as_int(k));
  case DP_FLOAT:
    return PyFloat_FromDouble(dp_value_as_float(k));
  case DP_STR: {
    size_t n;
    const char *p = dp_str_data(k, &n);
    return PyUnicode_DecodeUTF8(p, (Py_ssize_t)n, "surrogatepass");
  }
  case DP_BYTES: {
    size_t n;
    const uint8_t *p = dp_bytes_data(k, &n);
    return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
  }
  case DP_TUPLE: { /* keys are bounded (32 levels): this recursion is too */
    if (depth > 64) break;
    size_t n = dp_seq_len(k);
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t && i < n; i++) {
      PyObject *x = leaf_to_py(l, dp_seq_get(k, i), depth + 1);
      if (!x) Py_CLEAR(t);
      else PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
    }
    return t;
  }
  default:
    break;
  }
  PyErr_SetString(PyExc_ValueError, "loads: a dict key of an unexpected kind");
  return NULL;
}

/* ---- numpy arrays over out-of-band buffers, without _frames.array ----
 *
 * The common case of loads(data, buffers=bufs) with numpy arrays, made here
 * as _frames.array would make it (the same array, the same checks passed)
 * at a fraction of its cost: the buffer is a devpickle.Buffer whose obj is
 * an array of numpy's own type that owns its memory, contiguous, holding no
 * Python objects, still exactly [ptr, ptr + nbytes) (what Buffer.raw()
 * checks), or such an array given itself, at least nbytes long. The array
 * is made over its bytes (numpy.ndarray(shape, dtype, buffer, offset,
 * strides)), which the cache keeps, as the general path's entries, for
 * every later view of the buffer, of any kind. Anything else — another
 * source, a dtype numpy lacks, strides past its int64 bytes, a view numpy
 * refuses — is left to _frames.array, which makes it or says why not
 * (np_fast returns 0; numpy's own refusal is read again there, with the
 * buffer named). */

/* The flat bytes of obj, exported once (a memoryview: see above), where obj
 * is an exact numpy.ndarray owning its memory, C-contiguous, its format
 * free of objects, of at least `need` bytes (exactly `exact`, when not 0, at
 * address ptr); NULL with no exception where it is not; NULL with one. */
static PyObject *np_owning_view(PyObject *obj, uintptr_t ptr, size_t need, size_t exact) {
  if (!dpy.numpy_ndarray || Py_TYPE(obj) != dpy.numpy_ndarray) return NULL;
  PyObject *base = PyObject_GetAttr(obj, dpy.str_base);
  if (!base) return NULL;
  int owns = base == Py_None;
  Py_DECREF(base);
  if (!owns) return NULL;
  PyObject *mv = PyMemoryView_FromObject(obj);
  if (!mv) { /* datetime64: no buffer; _frames says so */
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError) ||
        PyErr_ExceptionMatches(PyExc_TypeError))
      PyErr_Clear();
    return NULL;
  }
  const Py_buffer *v = PyMemoryView_GET_BUFFER(mv);
  int ok = v->len > 0 && (size_t)v->len >= need && PyBuffer_IsContiguous(v, 'C') &&
           (!v->format || !strchr(v->format, 'O')) && (!exact || ((uintptr_t)v->buf == ptr && (size_t)v->len == exact));
  if (!ok) Py_CLEAR(mv);
  return mv;
}

/* A Buffer's int field (ptr, nbytes): 1 and *out, or 0 where it is no
 * exact non-negative int that fits (raw() says why), -1: error. */
static int buffer_field(PyObject *b, PyObject *name, unsigned long long *out) {
  PyObject *x = PyObject_GetAttr(b, name);
  if (!x) return -1;
  int ok = PyLong_CheckExact(x);
  if (ok) {
    *out = PyLong_AsUnsignedLongLong(x);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) ok = -1;
      else PyErr_Clear(), ok = 0;
    }
  }
  Py_DECREF(x);
  return ok;
}

/* The flat bytes of buffer source `source` for numpy arrays (see above): a
 * memoryview of the array given itself or of a Buffer's obj; NULL with no
 * exception where it is no such source, NULL with one on error. */
static PyObject *np_flat_source(PyObject *source, size_t nbytes) {
  if (PyObject_TypeCheck(source, dpy.numpy_ndarray)) return np_owning_view(source, 0, nbytes, 0);
  unsigned long long ptr, n;
  int r = buffer_field(source, dpy.str_ptr, &ptr);
  if (r == 1) r = buffer_field(source, dpy.str_nbytes, &n);
  if (r != 1 || n < nbytes || !n) return NULL;
  PyObject *obj = PyObject_GetAttr(source, dpy.str_obj);
  if (!obj) return NULL;
  PyObject *mv = np_owning_view(obj, (uintptr_t)ptr, (size_t)n, (size_t)n);
  Py_DECREF(obj);
  return mv;
}

/* numpy's dtype for a frame's dtype and its item size, cached per loads. 1;
 * 0: numpy has none, or is not in sys.modules (no exception); -1: error.
 * The general path asks sys.modules for numpy at each array: where code
 * run in between took numpy out of it (the general path then says to
 * import numpy) or put another module there, the dtypes are asked again. */
static int np_dtype(loader_t *l, dp_dtype_t dtype, PyObject **dt, Py_ssize_t *itemsize) {
  PyObject *mod = PyDict_GetItemWithError(PyImport_GetModuleDict(), dpy.str_numpy);
  if (!mod) return PyErr_Occurred() ? -1 : 0;
  if (mod != l->np_module) {
    Py_XSETREF(l->np_module, Py_NewRef(mod));
    for (int i = 0; i < DP_DTYPE_COUNT; i++) Py_CLEAR(l->np_dtypes[i]);
    memset(l->np_itemsize, 0, sizeof l->np_itemsize);
  }
  if ((unsigned)dtype >= DP_DTYPE_COUNT) return 0;
  if (!l->np_dtypes[dtype]) {
    if (l->np_itemsize[dtype] < 0) return 0; /* asked already: numpy has none (bfloat16) */
    PyObject *np = PyImport_GetModule(dpy.str_numpy);
    PyObject *mk = np ? PyObject_GetAttrString(np, "dtype") : NULL;
    Py_XDECREF(np);
    if (!mk) {
      PyErr_Clear();
      return 0;
    }
    PyObject *d = PyObject_CallFunction(mk, "s", dp_dtype_name(dtype));
    Py_DECREF(mk);
    PyObject *size = d ? PyObject_GetAttrString(d, "itemsize") : NULL;
    Py_ssize_t n = size && PyLong_CheckExact(size) ? PyLong_AsSsize_t(size) : 0;
    Py_XDECREF(size);
    if (n <= 0) {
      Py_XDECREF(d);
      if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
      PyErr_Clear(); /* bfloat16: _frames names the buffer */
      l->np_itemsize[dtype] = -1;
      return 0;
    }
    l->np_dtypes[dtype] = d;
    l->np_itemsize[dtype] = n;
  }
  *dt = l->np_dtypes[dtype];
  *itemsize = l->np_itemsize[dtype];
  return 1;
}

/* A numpy array view t of buffer key over flat (np_flat_source's): the
 * array, or NULL with no exception where _frames.array is to make it, or
 * NULL with one. */
static PyObject *np_fast(loader_t *l, dp_value_t t, PyObject *flat) {
  PyObject *dt;
  Py_ssize_t isz;
  int r = np_dtype(l, dp_tensor_dtype(t), &dt, &isz);
  if (r != 1) return NULL;
  int nd = dp_tensor_ndim(t);
  const int64_t *shp = dp_tensor_shape(t), *str = dp_tensor_strides(t);
  int64_t at = 0;
  int empty = 0;
  for (int i = 0; i < nd; i++) empty |= shp[i] == 0;
  /* an empty view addresses nothing: its offset may lie past the end */
  if (!empty && __builtin_mul_overflow(dp_tensor_offset(t), (int64_t)isz, &at)) return NULL;
  PyObject *shape = PyTuple_New(nd), *strides = PyTuple_New(nd), *off = NULL, *a = NULL;
  if (!shape || !strides) goto done;
  for (int i = 0; i < nd; i++) {
    int64_t b;
    if (__builtin_mul_overflow(str[i], (int64_t)isz, &b)) goto done; /* past int64 bytes: _frames says so */
    PyObject *x = PyLong_FromLongLong(shp[i]), *y = PyLong_FromLongLong(b);
    if (x) PyTuple_SET_ITEM(shape, i, x);
    if (y) PyTuple_SET_ITEM(strides, i, y);
    if (!x || !y) goto done;
  }
  if (!(off = PyLong_FromLongLong(at))) goto done;
  a = PyObject_CallFunctionObjArgs((PyObject *)dpy.numpy_ndarray, shape, dt, flat, off, strides, NULL);
  if (!a && (PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_TypeError)))
    PyErr_Clear(); /* refused ("array is too big"): _frames names the buffer */
done:
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(off);
  return a;
}

/* tensor_to_py's fast path for numpy arrays: the array; NULL with no
 * exception where the general path is to make it; NULL with one. */
static PyObject *np_array(loader_t *l, dp_value_t t, PyObject *key, size_t at, size_t nbytes) {
  PyObject *kk = PyTuple_Pack(2, key, dpy.str_numpy_ndarray), *flat = NULL, *a = NULL;
  if (!kk) return NULL;
  flat = PyDict_GetItemWithError(l->cache, kk);
  if (flat) {
    Py_INCREF(flat);
  } else if (!PyErr_Occurred() && !PyDict_GetItemWithError(l->cache, key) && !PyErr_Occurred() && l->buffers &&
             (Py_ssize_t)at < PyTuple_GET_SIZE(l->buffers)) {
    PyObject *src = PyTuple_GET_ITEM(l->buffers, (Py_ssize_t)at);
    if ((PyObject *)Py_TYPE(src) == l->buffer_type || Py_TYPE(src) == dpy.numpy_ndarray) {
      /* its bytes exported once, as the general path takes them (raw()'s
         uint8 view, numpy.frombuffer): every later view, of any kind, is
         made over that export, so its memory and writability are those the
         array had at the buffer's first view, whatever code run in between
         (a class's __setstate__, another thread) does to the array's flags;
         numpy takes the exporting array for a view's base, as it does the
         uint8 view's. The cache holds what the general path's would: the
         source (raw()'s bytes for a Buffer, the array given itself) and the
         flat bytes */
      flat = np_flat_source(src, nbytes);
      if (flat && (PyDict_SetItem(l->cache, key, Py_TYPE(src) == dpy.numpy_ndarray ? src : flat) ||
                   PyDict_SetItem(l->cache, kk, flat)))
        Py_CLEAR(flat);
    }
  }
  if (flat) a = np_fast(l, t, flat);
  Py_XDECREF(flat);
  Py_DECREF(kk);
  return a;
}

/* ---- torch tensors over out-of-band buffers, without _frames.array ----
 *
 * A torch tensor over a buffer given as the devpickle.Buffer dumps handed
 * out: at the buffer's first view the adapter makes what Buffer.raw()
 * makes — a flat uint8 tensor over the storage of the Buffer's tensor,
 * with raw()'s checks (torch_api.h, tensor_over) — and the cache keeps it
 * as the general path keeps raw()'s answer, for every later view of the
 * buffer, of any kind; each view is then made of that flat tensor by the
 * torch ops _frames.array makes it with (views sharing its version
 * counter), with as_strided's checks. What the adapter declines,
 * _frames.array makes or says why not. The dtype is _frames.torch_dtype's
 * answer for the frame's dtype name, asked once per loads. */

/* torch's dtype for a frame's dtype name (Py_None: none), borrowed from
 * the loader's cache, or NULL with an exception. The general path asks
 * sys.modules for torch at each view: where code run in between took torch
 * out of it (the general path then says to import torch) or put another
 * module there, the names are asked again. */
static PyObject *torch_dtype(loader_t *l, const char *name) {
  static PyObject *str_torch;
  if (!str_torch && !(str_torch = PyUnicode_InternFromString("torch"))) return NULL;
  PyObject *mod = PyDict_GetItemWithError(PyImport_GetModuleDict(), str_torch);
  if (!mod) return PyErr_Occurred() ? NULL : Py_None;
  if (mod != l->torch_module) {
    Py_XSETREF(l->torch_module, Py_NewRef(mod));
    Py_CLEAR(l->torch_dtypes);
  }
  if (!l->torch_dtypes && !(l->torch_dtypes = PyDict_New())) return NULL;
  PyObject *dt = PyDict_GetItemString(l->torch_dtypes, name);
  if (dt) return dt;
  PyObject *fn = helper("torch_dtype");
  dt = fn ? PyObject_CallFunction(fn, "s", name) : NULL;
  Py_XDECREF(fn);
  if (!dt) return NULL;
  int rc = PyDict_SetItemString(l->torch_dtypes, name, dt);
  Py_DECREF(dt); /* the dict holds it */
  return rc ? NULL : dt;
}

/* Returns the tensor; NULL with no exception where the general path is to
 * make it; NULL with one. */
static PyObject *torch_array(loader_t *l, dp_value_t t, PyObject *key, size_t at, size_t nbytes) {
  if (!dpy.torch || !dpy.torch->tensor_over || !l->buffers || (Py_ssize_t)at >= PyTuple_GET_SIZE(l->buffers))
    return NULL;
  PyObject *dt = torch_dtype(l, dp_dtype_name(dp_tensor_dtype(t)));
  if (!dt || dt == Py_None) return NULL;
  /* the buffer's flat tensor, made here before: (flat, ptr, nbytes) */
  PyObject *made = l->torch_flats ? PyDict_GetItemWithError(l->torch_flats, key) : NULL;
  if (!made && PyErr_Occurred()) return NULL;
  if (!made) {
    PyObject *src = PyTuple_GET_ITEM(l->buffers, (Py_ssize_t)at);
    if ((PyObject *)Py_TYPE(src) != l->buffer_type || PyDict_GetItemWithError(l->cache, key) || PyErr_Occurred())
      return NULL; /* not a Buffer, or its bytes taken by the general path or as numpy's */
    unsigned long long ptr, n;
    int r = buffer_field(src, dpy.str_ptr, &ptr);
    if (r == 1) r = buffer_field(src, dpy.str_nbytes, &n);
    if (r != 1 || n < nbytes || n > INT64_MAX) return NULL;
    PyObject *obj = PyObject_GetAttr(src, dpy.str_obj);
    if (!obj) return NULL;
    PyObject *flat = dpy.torch->tensor_over(obj, (uintptr_t)ptr, (size_t)n, Py_None, 0, NULL, NULL, 0);
    Py_DECREF(obj);
    if (!flat) return NULL;
    PyObject *kk = PyTuple_Pack(2, key, dpy.str_torch_tensor);
    made = Py_BuildValue("(NKK)", flat, ptr, n);
    int rc = !kk || !made || (!l->torch_flats && !(l->torch_flats = PyDict_New())) ||
             PyDict_SetItem(l->torch_flats, key, made) || PyDict_SetItem(l->cache, key, flat) ||
             PyDict_SetItem(l->cache, kk, flat);
    Py_XDECREF(kk);
    Py_XDECREF(made); /* the dict holds it */
    if (rc) return NULL;
  }
  return dpy.torch->tensor_over(PyTuple_GET_ITEM(made, 0), (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(made, 1)),
                                (size_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(made, 2)), dt, dp_tensor_ndim(t),
                                dp_tensor_shape(t), dp_tensor_strides(t), dp_tensor_offset(t));
}

static PyObject *tensor_to_py(loader_t *l, dp_value_t t, const char *kind) {
  dp_storage_t *st = dp_tensor_storage(t);
  dp_device_t dev = dp_storage_device(st);
  size_t at;
  if (dp_ptrset_find(l->table, dev, dp_storage_base(st), &at, NULL)) {
    PyErr_SetString(PyExc_ValueError, "loads: a tensor whose storage is not in the frame's table");
    return NULL;
  }
  PyObject *key = PyLong_FromSize_t(at), *source = NULL;
  if (!key) return NULL;
  const void *host = dp_storage_host_data(st);
  if (!host) { /* the common cases, made here (or NULL: by _frames.array) */
    PyObject *a = NULL;
    if (dev.type == DP_DEVICE_CPU && kind && !strcmp(kind, "numpy.ndarray") && dpy.numpy_ndarray)
      a = np_array(l, t, key, at, dp_storage_nbytes(st));
    else if ((!kind || !strcmp(kind, "torch.Tensor")) && (dev.type == DP_DEVICE_CPU || dev.type == DP_DEVICE_CUDA))
      a = torch_array(l, t, key, at, dp_storage_nbytes(st));
    if (a || PyErr_Occurred()) {
      Py_DECREF(key);
      return a;
    }
  }
  Py_ssize_t given = l->buffers ? PyTuple_GET_SIZE(l->buffers) : 0;
  if (PyDict_GetItemWithError(l->cache, key)) {
    source = Py_NewRef(Py_None); /* rebuilt already: the helper has it */
  } else if (PyErr_Occurred()) {
    Py_DECREF(key);
    return NULL;
  } else if (host) {
    source = PyByteArray_FromStringAndSize(host, (Py_ssize_t)dp_storage_nbytes(st));
  } else if ((Py_ssize_t)at < given) {
    source = Py_NewRef(PyTuple_GET_ITEM(l->buffers, (Py_ssize_t)at));
    if (source == Py_None) {
      char dn[32];
      Py_CLEAR(source);
      PyErr_Format(PyExc_ValueError, "loads: buffers[%zu] is None: buffer %zu (%s, %zu bytes) needs its bytes", at,
                   at, dp_device_format(dev, dn, sizeof dn), dp_storage_nbytes(st));
    }
  } else {
    char dn[32];
    if (l->buffers)
      PyErr_Format(PyExc_ValueError,
                   "loads: buffer %zu (%s, %zu bytes) is out of band and buffers= has no such item (it holds %zd)", at,
                   dp_device_format(dev, dn, sizeof dn), dp_storage_nbytes(st), given);
    else
      /* what to do, for code moving from pickle.loads(pickle.dumps(x)):
         dumps keeps buffers out of the frame unless told otherwise */
      PyErr_Format(PyExc_ValueError,
                   "loads: buffer %zu (%s, %zu bytes) is out of band and buffers= was not given (dumps(obj, "
                   "inline=True) writes a frame that carries its buffers; else pass buffers=bufs, the Buffers dumps "
                   "gave its buffer_callback)",
                   at, dp_device_format(dev, dn, sizeof dn), dp_storage_nbytes(st));
  }
  PyObject *r = NULL;
  if (source) {
    int nd = dp_tensor_ndim(t);
    const int64_t *shp = dp_tensor_shape(t), *str = dp_tensor_strides(t);
    PyObject *shape = PyTuple_New(nd), *strides = PyTuple_New(nd);
    for (int i = 0; shape && strides && i < nd; i++) {
      PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(shp[i]));
      PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(str[i]));
    }
    PyObject *dev_s = dpy_device_str(dev);
    if (shape && strides && dev_s)
      r = PyObject_CallFunction(l->fn_array, "zOOsOOLOOnO", kind, dev_s, source, dp_dtype_name(dp_tensor_dtype(t)),
                                shape, strides, (long long)dp_tensor_offset(t), l->cache, key,
                                (Py_ssize_t)dp_storage_nbytes(st), host ? Py_True : Py_False);
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dev_s);
    Py_DECREF(source);
  }
  Py_DECREF(key);
  return r;
}

enum { CF_LIST, CF_TUPLE, CF_DICT, CF_OBJECT };

typedef struct cframe {
  dp_value_t v;
  int kind;
  size_t i, n;
  PyObject *py;          /* list, dict, items (tuple) or attrs (object) */
  PyObject *placeholder; /* a plain object made first (cycles), or NULL */
  PyObject *made;        /* a reduced object made before its state (reduced_new's pair), or NULL */
  size_t make_at;        /* a reduced object's first part after <callable> and <args>: made there; 0: never */
  PyObject *key;         /* the key of the value being converted */
  PyObject *hcount;      /* a dict's keys counted by hash (same_hash_guard), or NULL */
  size_t memo_at;         /* its slot in memo_objs, or NO_MEMO for a node held once */
} cframe_t;

#define NO_MEMO SIZE_MAX

#define PENDING ((PyObject *)1)

const char *dpy_reserved_class(const char *name) {
  static const char *const r[][2] = {
      {"torch.Tensor", "a torch tensor"},        {"numpy.ndarray", "a numpy array"},
      {"cupy.ndarray", "a cupy array"},          {"builtins.set", "a set"},
      {"builtins.frozenset", "a frozenset"},     {"builtins.complex", "a complex"},
      {"builtins.bytearray", "a bytearray"},     {"numpy.generic", "a numpy scalar"},
      {"devpickle.global", "a class or function carried by name"}};
  for (size_t i = 0; i < sizeof r / sizeof *r; i++)
    if (!strcmp(name, r[i][0])) return r[i][1];
  return NULL;
}

static int is_array_class(const char *name) {
  return !strcmp(name, "torch.Tensor") || !strcmp(name, "numpy.ndarray") || !strcmp(name, "cupy.ndarray");
}

/* The reserved names but the arrays': objects loads makes at the end, from
 * their attributes (devpickle/_frames.py, finish). */
static int is_reserved(const char *name) { return dpy_reserved_class(name) && !is_array_class(name); }

/* Whether any of object v's attributes is named as a reduce's part
 * (<callable>, <args>, ...): such an object is rebuilt as a reduce, at the
 * end (devpickle/_frames.py refuses one that mixes the parts with other
 * names), never made first as a plain object whose attributes they would
 * be. dumps writes the parts alone, <callable> first. */
static int names_a_part(dp_value_t v) {
  size_t n = dp_object_nattrs(v);
  for (size_t i = 0; i < n; i++) {
    const char *name = NULL;
    dp_object_attr(v, i, &name, NULL, NULL);
    if (name && name[0] == '<') return 1;
  }
  return 0;
}

/* For a reduced object whose attributes are <callable> and <args>, then
 * <state>, <listitems> and <dictitems> alone (dumps's form; no
 * state_setter, which loads refuses, nor other names): the index of the
 * first of those last ones, where the object is made — from its callable
 * and args, before the parts that fill it, as pickle.loads makes it, so a
 * cycle through them comes back to it. 0 when there is none, or another
 * form (made at the end, as a whole). */
static size_t reduce_make_at(dp_value_t v) {
  size_t n = dp_object_nattrs(v), i = 0;
  const char *name = NULL;
  for (; i < n; i++) {
    dp_object_attr(v, i, &name, NULL, NULL);
    if (!name || (strcmp(name, "<callable>") && strcmp(name, "<args>"))) break;
  }
  if (i == 0 || i == n) return 0;
  for (size_t j = i; j < n; j++) {
    dp_object_attr(v, j, &name, NULL, NULL);
    if (!name || (strcmp(name, "<state>") && strcmp(name, "<listitems>") && strcmp(name, "<dictitems>"))) return 0;
  }
  return i;
}

typedef struct cstack {
  cframe_t *f;
  size_t n, cap;
} cstack_t;

/* Enters a node not yet converted; obj NULL: its object is made at the end
 * (the slot holds None until then). */
static int memo_put(loader_t *l, dp_value_t v, PyObject *obj, size_t *at) {
  dp_error_t e;
  int rc = dp_ptrset_add(l->memo, (dp_device_t){DP_DEVICE_CPU, 0}, (void *)dp_value_id(v), 0, at, &e);
  if (rc) return dpy_raise(rc, &e), -1;
  return PyList_Append(l->memo_objs, obj ? obj : l->unfinished);
}

/* One value: its Python object (new reference), or PENDING with a frame
 * pushed for a container. */
static PyObject *convert(loader_t *l, cstack_t *st, dp_value_t v) {
  dp_kind_t k = dp_value_kind(v);
  if (k <= DP_BYTES) return leaf_to_py(l, v, 0);
  /* A node held once (no back-reference names it, no cycle runs through
     it) is met once: it enters no memo, as leaf_to_py's leaves don't. The
     memo's entry and slot were a third of what a nest of lists of one cost
     beside the decoded value. */
  int shared = dp_value_refcount(v) > 1;
  size_t at;
  if (shared && !dp_ptrset_find(l->memo, (dp_device_t){DP_DEVICE_CPU, 0}, dp_value_id(v), &at, NULL)) {
    PyObject *o = PyList_GET_ITEM(l->memo_objs, (Py_ssize_t)at);
    if (o == l->unfinished) {
      PyErr_SetString(PyExc_ValueError, "loads: a cycle through a tuple, or through a reduced object's callable or "
                                        "args (the object is made from them; pickle cannot rebuild it either), "
                                        "cannot be rebuilt");
      return NULL;
    }
    return Py_NewRef(o);
  }
  if (k == DP_TENSOR) {
    PyObject *r = tensor_to_py(l, v, NULL);
    if (r && shared && memo_put(l, v, r, &at)) Py_CLEAR(r);
    return r;
  }
  cframe_t f = {.v = v, .memo_at = NO_MEMO};
  const char *cname = NULL;
  switch (k) {
  case DP_LIST:
    f.kind = CF_LIST;
    f.n = dp_seq_len(v);
    f.py = PyList_New(0);
    break;
  case DP_TUPLE:
    f.kind = CF_TUPLE;
    f.n = dp_seq_len(v);
    f.py = PyList_New(0);
    break;
  case DP_DICT:
    f.kind = CF_DICT;
    f.n = dp_dict_len(v);
    f.py = PyDict_New();
    break;
  case DP_OBJECT: {
    cname = dp_object_class(v);
    f.kind = CF_OBJECT;
    f.n = dp_object_nattrs(v);
    const char *first = NULL;
    dp_value_t data = dp_none();
    if (f.n) dp_object_attr(v, 0, &first, &data, NULL);
    /* torch.Tensor's further attributes, in this order: requires_grad (true)
       and subclass (the tensor's class, a str) */
    int grad = 0, extra = 0;
    const char *subclass = NULL;
    size_t subclass_len = 0; /* a str value may hold NUL: passed with its length, never cut at one */
    if (f.n >= 2 && f.n <= 3 && !strcmp(cname, "torch.Tensor")) {
      for (size_t i = 1; i < f.n; i++) {
        const char *name = NULL;
        dp_value_t x = dp_none();
        dp_object_attr(v, i, &name, &x, NULL);
        if (i == 1 && name && !strcmp(name, "requires_grad") && dp_value_kind(x) == DP_BOOL && dp_value_as_bool(x))
          grad = 1, extra++;
        else if (i == f.n - 1 && name && !strcmp(name, "subclass") && dp_value_kind(x) == DP_STR)
          subclass = dp_str_data(x, &subclass_len), extra++;
      }
    }
    if (is_array_class(cname) && f.n == 1 + (size_t)extra && !strcmp(first, "data") &&
        dp_value_kind(data) == DP_TENSOR) {
      PyObject *r = tensor_to_py(l, data, cname);
      if (r && grad) {
        PyObject *ok = PyObject_CallMethod(r, "requires_grad_", NULL);
        if (!ok) {
          PyObject *et, *ev, *tb;
          PyErr_Fetch(&et, &ev, &tb);
          PyErr_Format(PyExc_ValueError, "loads: a tensor that requires grad cannot be made here: %S", ev ? ev : Py_None);
          Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
        }
        Py_XDECREF(ok);
        if (!ok) Py_CLEAR(r);
      }
      if (r && subclass) Py_SETREF(r, PyObject_CallFunction(l->fn_subclass, "Os#O", r, subclass, (Py_ssize_t)subclass_len, l->classes));
      if (r && shared && memo_put(l, v, r, &at)) Py_CLEAR(r);
      return r;
    }
    if (dp_object_is_reduced(v)) {
      /* a C custom's stand-in (FORMAT.md, "reduce"): its state is no Python
         class's attributes, whatever classes= allows, and no reserved
         class's form */
      if (!(f.placeholder = PyObject_CallFunction(l->fn_object, "s", cname))) return NULL;
    } else if (!is_reserved(cname) && !names_a_part(v)) {
      f.placeholder = PyObject_CallFunction(l->fn_new, "sO", cname, l->classes);
      if (!f.placeholder) return NULL;
      if (f.placeholder == Py_None) Py_CLEAR(f.placeholder); /* made at the end, from its attributes */
    } else if (!is_reserved(cname)) {
      f.make_at = reduce_make_at(v);
    }
    f.py = PyDict_New();
    break;
  }
  default:
    PyErr_Format(PyExc_ValueError, "loads: a value of kind %s", dp_kind_name(k));
    return NULL;
  }
  if (!f.py || (shared && memo_put(l, v, f.kind == CF_LIST || f.kind == CF_DICT ? f.py : f.placeholder, &f.memo_at))) {
    Py_XDECREF(f.py);
    Py_XDECREF(f.placeholder);
    return NULL;
  }
  if (st->n == st->cap) {
    size_t cap = st->cap ? 2 * st->cap : 32;
    cframe_t *nf = PyMem_Realloc(st->f, cap * sizeof *nf);
    if (!nf) {
      Py_DECREF(f.py);
      Py_XDECREF(f.placeholder);
      return PyErr_NoMemory();
    }
    st->f = nf;
    st->cap = cap;
  }
  st->f[st->n++] = f;
  return PENDING;
}

/* The finished object of a popped frame (new reference). */
static PyObject *finish(loader_t *l, cframe_t *f) {
  PyObject *r = NULL;
  switch (f->kind) {
  case CF_LIST:
  case CF_DICT:
    return Py_NewRef(f->py);
  case CF_TUPLE:
    r = PyList_AsTuple(f->py);
    break;
  case CF_OBJECT:
    if (f->made)
      r = PyObject_CallFunction(l->fn_reduced_done, "OsOOO", f->made, dp_object_class(f->v), f->py, l->classes,
                                l->copies);
    else if (f->placeholder) r = PyObject_CallFunctionObjArgs(l->fn_fill, f->placeholder, f->py, l->copies, NULL);
    else r = PyObject_CallFunction(l->fn_finish, "sOOO", dp_object_class(f->v), f->py, l->classes, l->copies);
    break;
  }
  if (r && f->memo_at != NO_MEMO && PyList_SetItem(l->memo_objs, (Py_ssize_t)f->memo_at, Py_NewRef(r))) Py_CLEAR(r);
  return r;
}

static int deliver(cframe_t *f, PyObject *r) {
  int rc;
  switch (f->kind) {
  case CF_LIST:
  case CF_TUPLE:
    rc = PyList_Append(f->py, r);
    break;
  default: {
    Py_ssize_t before = PyDict_GET_SIZE(f->py);
    rc = PyDict_SetItem(f->py, f->key, r);
    if (!rc && f->kind == CF_DICT && PyDict_GET_SIZE(f->py) == before) {
      /* never a silent merge: the frame's keys are distinct, Python's equal.
         The key as reprlib shows it: its full repr grows with what it
         shares (1,022 references to one 256 kB str: a 268 MB message). */
      PyObject *shown = helper("shown"), *text = shown ? PyObject_CallOneArg(shown, f->key) : NULL;
      Py_XDECREF(shown);
      if (text)
        PyErr_Format(PyExc_ValueError,
                     "loads: a dict whose keys are distinct in the frame but equal in Python (1, 1.0 and True; "
                     "0.0 and -0.0): key %U",
                     text);
      Py_XDECREF(text);
      rc = -1;
    }
    Py_CLEAR(f->key);
    break;
  }
  }
  Py_DECREF(r);
  return rc;
}

/* Charges a frame dict key's hashing work (a key is at most 1,024 nodes) to
 * copies, in batches of HASH_BATCH, before Python hashes past it; `all`
 * charges what is left. 0, or -1 with the ValueError. */
#define HASH_BATCH 4096
static int charge_key(loader_t *l, PyObject *key, int all) {
  uint64_t w = 0;
  if (key && hash_work(l->hashed, key, UINT64_MAX, &w)) return -1; /* at most 1,024 steps: a key's tree */
  l->hash_owed = work_add(l->hash_owed, w);
  if (!l->hash_owed || (!all && l->hash_owed < HASH_BATCH)) return 0;
  PyObject *r = PyObject_CallMethod(l->copies, "charge_hashing", "sK", "dict keys", (unsigned long long)l->hash_owed);
  l->hash_owed = 0;
  Py_XDECREF(r);
  return r ? 0 : -1;
}

static void frame_drop(cframe_t *f) {
  Py_XDECREF(f->py);
  Py_XDECREF(f->placeholder);
  Py_XDECREF(f->made);
  Py_XDECREF(f->key);
  Py_XDECREF(f->hcount);
}

/* Where a rebuild failed, for dp__path_render: each frame of the stack at
 * the child it was making (i - 1), the last one inside its key `at_key`. */
typedef struct {
  const cstack_t *st;
  int at_key;
} fail_path_t;

static size_t fail_step(void *ctx, size_t j, char *out) {
  const fail_path_t *p = ctx;
  const cframe_t *f = &p->st->f[j];
  size_t i = f->i ? f->i - 1 : 0;
  if (p->at_key && j + 1 == p->st->n) return dp__step_in_key(i, out);
  return dp__step_child(f->v, i, out);
}

/* The error being raised names the node whose rebuild raised it, as a path
 * (docs/FORMAT.md, "Paths"): loads' own ValueError or TypeError ("loads:
 * ...") ends with ", at $.k[0]", as a FrameError ends with its byte; any
 * other exception (an allowed class's own code raised it) keeps its message
 * and gains a note (PEP 678) saying where. A MemoryError is left as it is. */
static void name_failed_node(const cstack_t *st, int at_key) {
  if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) return;
  char path[DP_PATH_MAX + 1];
  fail_path_t p = {st, at_key};
  dp__path_render(path, st->n, fail_step, &p);
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  PyErr_NormalizeException(&et, &ev, &tb);
  if (!ev) {
    PyErr_Restore(et, ev, tb);
    return;
  }
  PyObject *args = PyObject_GetAttrString(ev, "args"), *prefix = PyUnicode_FromString("loads: ");
  PyObject *named = PyUnicode_FromString(", at $");
  PyObject *msg = args && PyTuple_Check(args) && PyTuple_GET_SIZE(args) == 1 ? PyTuple_GET_ITEM(args, 0) : NULL;
  /* one path in the message: an error a nested loads (an allowed class's
     __setstate__ calling loads) already named gains a note at each outer
     loads, as any error of the class's code does, rather than a path each,
     which would grow its message with the nesting */
  if ((et == PyExc_ValueError || et == PyExc_TypeError) && msg && prefix && named && PyUnicode_Check(msg) &&
      PyUnicode_Tailmatch(msg, prefix, 0, PY_SSIZE_T_MAX, -1) == 1 &&
      PyUnicode_Find(msg, named, 0, PY_SSIZE_T_MAX, 1) == -1) {
    PyObject *m = PyUnicode_FromFormat("%U, at %s", msg, path);
    PyObject *a = m ? PyTuple_Pack(1, m) : NULL;
    if (a) PyObject_SetAttrString(ev, "args", a);
    Py_XDECREF(a);
    Py_XDECREF(m);
  } else {
    PyObject *note = PyUnicode_FromFormat("raised while devpickle.loads rebuilt %s", path);
    PyObject *r = note ? PyObject_CallMethod(ev, "add_note", "O", note) : NULL; /* Python 3.11 on */
    Py_XDECREF(r);
    Py_XDECREF(note);
  }
  Py_XDECREF(named);
  Py_XDECREF(prefix);
  Py_XDECREF(args);
  PyErr_Clear(); /* naming the node is best effort: the error raised stands */
  PyErr_Restore(et, ev, tb);
}

/* Makes f's reduced object from the parts rebuilt so far (its callable and
 * args) and puts it in the memo: what its state, listitems and dictitems
 * refer back to. 0, or -1 with the error. */
static int make_reduced(loader_t *l, cframe_t *f) {
  PyObject *made = PyObject_CallFunction(l->fn_reduced_new, "sOOO", dp_object_class(f->v), f->py, l->classes, l->copies);
  if (!made) return -1;
  if (!PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 2) {
    Py_DECREF(made);
    PyErr_SetString(PyExc_SystemError, "loads: reduced_new returned no pair");
    return -1;
  }
  f->made = made;
  if (f->memo_at != NO_MEMO &&
      PyList_SetItem(l->memo_objs, (Py_ssize_t)f->memo_at, Py_NewRef(PyTuple_GET_ITEM(made, 0))))
    return -1;
  return 0;
}

static PyObject *to_python(loader_t *l, dp_value_t root) {
  cstack_t st = {0};
  int at_key = 0;
  PyObject *result = convert(l, &st, root);
  if (!result) name_failed_node(&st, 0);
  if (result != PENDING) return result;
  result = NULL;
  while (st.n) {
    cframe_t *f = &st.f[st.n - 1];
    if (f->i == f->n) {
      PyObject *r = finish(l, f);
      frame_drop(f);
      st.n--;
      if (!r) goto fail;
      if (!st.n) {
        if (charge_key(l, NULL, 1)) {
          Py_DECREF(r);
          goto fail;
        }
        result = r;
        break;
      }
      if (deliver(&st.f[st.n - 1], r)) goto fail;
      continue;
    }
    if (f->kind == CF_OBJECT && f->make_at && f->i == f->make_at && !f->made && make_reduced(l, f)) {
      /* named as a failure to make the object at the end is: at its path */
      frame_drop(f);
      st.n--;
      goto fail;
    }
    dp_value_t child;
    size_t i = f->i++;
    if (f->kind == CF_LIST || f->kind == CF_TUPLE) {
      child = dp_seq_get(f->v, i);
    } else if (f->kind == CF_DICT) {
      dp_value_t k;
      dp_dict_item(f->v, i, &k, &child, NULL);
      if (!(f->key = leaf_to_py(l, k, 0)) || charge_key(l, f->key, 0) ||
          same_hash_guard(&f->hcount, f->key, "dict keys")) {
        at_key = 1;
        goto fail;
      }
    } else {
      const char *name;
      dp_object_attr(f->v, i, &name, &child, NULL);
      if (!(f->key = PyUnicode_FromString(name))) goto fail;
    }
    PyObject *r = convert(l, &st, child);
    if (!r) goto fail;
    if (r != PENDING && deliver(&st.f[st.n - 1], r)) goto fail;
  }
  PyMem_Free(st.f);
  return result;
fail:
  name_failed_node(&st, at_key);
  while (st.n) frame_drop(&st.f[--st.n]);
  PyMem_Free(st.f);
  return NULL;
}

/* NULL, with loads' TypeError for data that is no buffer, or a buffer that
 * is not C-contiguous (a strided memoryview, a Fortran-ordered array) in
 * place of the exporter's error (memoryview's BufferError, numpy's
 * ValueError) when data is one: a frame is its bytes end to end, and is
 * never copied to make it so; loads' ValueError for a released memoryview.
 * Any other error stands. */
static PyObject *not_contiguous(PyObject *data) {
  Py_buffer v;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  if (!PyObject_CheckBuffer(data) && et && PyErr_GivenExceptionMatches(et, PyExc_TypeError)) {
    /* no buffer at all: said in loads' words, as its other errors are */
    Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
    return PyErr_Format(PyExc_TypeError, "loads: data must be a bytes-like object (a frame's bytes), not '%s'",
                        Py_TYPE(data)->tp_name);
  }
  if (PyMemoryView_Check(data) && et && PyErr_GivenExceptionMatches(et, PyExc_ValueError)) {
    /* a released memoryview (its only ValueError here): no bytes at all */
    Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
    PyErr_SetString(PyExc_ValueError, "loads: data is a released memoryview: it holds no frame's bytes");
    return NULL;
  }
  if (!PyObject_CheckBuffer(data) || PyObject_GetBuffer(data, &v, PyBUF_FULL_RO)) {
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    return NULL;
  }
  int contiguous = PyBuffer_IsContiguous(&v, 'C');
  PyBuffer_Release(&v);
  if (contiguous) {
    PyErr_Restore(et, ev, tb);
    return NULL;
  }
  Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
  return PyErr_Format(PyExc_TypeError,
                      "loads: data must be a C-contiguous bytes-like object (a frame's bytes end to end), not a "
                      "non-contiguous %s (bytes(data) makes a contiguous copy)",
                      Py_TYPE(data)->tp_name);
}

PyObject *dpy_loads(PyObject *self, PyObject *args, PyObject *kw) {
  (void)self;
  static char *kwlist[] = {"data", "buffers", "classes", "max_copies", NULL};
  PyObject *data, *buffers = Py_None, *classes = NULL, *max_copies = Py_None, *result = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOO:loads", kwlist, &data, &buffers, &classes, &max_copies))
    return NULL;
  /* data is checked here, and its export taken again just before the frame
   * is read: the Python code run meanwhile (a classes= generator, a buffers=
   * sequence, max_copies' __index__) may free the memory under an export
   * (numpy's a.resize(..., refcheck=False)), on this thread too */
  Py_buffer view;
  if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)) return not_contiguous(data);
  Py_ssize_t size = view.len;
  PyBuffer_Release(&view);
  int viewing = 0;
  loader_t l = {0};
  dp_error_t e;
  dp_value_t root = dp_none();
  PyObject *mk = helper("allowed");
  if (!mk) goto done;
  l.classes = PyObject_CallOneArg(mk, classes ? classes : Py_None);
  Py_DECREF(mk);
  if (!l.classes) goto done;
  PyObject *mk_copies = helper("Copies"); /* before the frame is read: a bad max_copies fails first */
  if (!mk_copies) goto done;
  l.copies = PyObject_CallFunction(mk_copies, "nO", size, max_copies);
  Py_DECREF(mk_copies);
  if (!l.copies || !(l.hashed = PyObject_GetAttrString(l.copies, "hashed"))) goto done;
  if (!PyDict_Check(l.hashed)) {
    PyErr_SetString(PyExc_TypeError, "loads: Copies.hashed is not a dict");
    goto done;
  }
  if (buffers != Py_None) {
    /* one buffer given for the list or a str: its items are no buffers
       (bytes, an array.array: ints, "buffers[0] is of type 'int'"), or
       each is a byte of it (a numpy array, what raw() gives: "buffer 0
       holds 0 bytes"; a tensor is no sequence at all), which would not say
       why. Any object with the buffer protocol, a torch tensor or a cupy
       array is one buffer, as buffers= takes each */
    if (dpy_resolve_frameworks()) goto done;
    if (PyUnicode_Check(buffers) || PyObject_CheckBuffer(buffers) ||
        (dpy.torch_tensor && PyObject_TypeCheck(buffers, dpy.torch_tensor)) ||
        (dpy.cupy_ndarray && PyType_Check(dpy.cupy_ndarray) &&
         PyObject_TypeCheck(buffers, (PyTypeObject *)dpy.cupy_ndarray))) {
      PyErr_Format(PyExc_TypeError, "buffers= must be a sequence of buffers, one per buffer of the frame's table "
                   "(buffers=[b]), not a '%s'", Py_TYPE(buffers)->tp_name);
      goto done;
    }
    /* loads's stand-in is a sequence whose items raise its own TypeError */
    int stand_in = dpy_refuse_stand_in(buffers, "buffers= must be a sequence of buffers, one per buffer of the "
                                       "frame's table (buffers=[b]), not", "");
    if (stand_in) goto done;
    if (!PySequence_Check(buffers)) { /* an iterator too (pickle takes one): named, with the way out */
      PyErr_Format(PyExc_TypeError, "buffers= must be a sequence of buffers, indexed by the frame's table "
                   "(buffers=list(it)), not a '%s'", Py_TYPE(buffers)->tp_name);
      goto done;
    }
    /* taken once, as list(buffers) takes them: a sequence whose __len__
       disagrees with its items is read by its items, and one that Python
       code run later (an allowed class's) changes is read as given */
    if (!(l.buffers = dpy_items(buffers, 0,
                                "buffers= must be a sequence of buffers, indexed by the frame's table (buffers=list(it)), "
                                "not",
                                "")))
      goto done;
  }
  if (!(l.cache = PyDict_New()) || !(l.memo_objs = PyList_New(0)) ||
      !(l.unfinished = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) || !(l.fn_array = helper("array")) ||
      !(l.fn_new = helper("new")) || !(l.fn_fill = helper("fill")) || !(l.fn_finish = helper("finish")) ||
      !(l.fn_subclass = helper("tensor_subclass")) || !(l.fn_object = helper("Object")) ||
      !(l.fn_reduced_new = helper("reduced_new")) || !(l.fn_reduced_done = helper("reduced_done")) ||
      !(l.buffer_type = helper("Buffer")))
    goto done;
  /* out of the collector's sight: convert() reads it by index, and
     gc.get_referrers() would hand it to an allowed class's code */
  PyObject_GC_UnTrack(l.memo_objs);
  int rc = dp_ptrset_new(&l.table, &e);
  if (!rc) rc = dp_ptrset_new(&l.memo, &e);
  if (rc) {
    dpy_raise(rc, &e);
    goto done;
  }
  dp_unpickle_opts_t uo = {.bind = bind, .bind_ud = &l};
  if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)) { /* no Python code runs from here to the read */
    not_contiguous(data);
    goto done;
  }
  viewing = 1;
  if (PyBytes_CheckExact(data)) {
    /* bytes are immutable and held by the caller's reference: no other
     * thread can free them, so the GIL is free while the frame is read */
    Py_BEGIN_ALLOW_THREADS;
    rc = dp_unpickle(view.buf, (size_t)view.len, &uo, &root, &e);
    Py_END_ALLOW_THREADS;
  } else {
    /* any other buffer's memory may be freed under a buffer export by
     * another thread (numpy's a.resize(..., refcheck=False)): read with
     * the GIL held, as the unpickled value keeps no pointer into it */
    rc = dp_unpickle(view.buf, (size_t)view.len, &uo, &root, &e);
  }
  if (rc) {
    frame_fail(rc, &e);
    goto done;
  }
  result = to_python(&l, root);
done:
  dp_value_release(root);
  if (viewing) PyBuffer_Release(&view);
  dp_ptrset_free(l.table);
  dp_ptrset_free(l.memo);
  Py_XDECREF(l.classes);
  Py_XDECREF(l.buffers);
  Py_XDECREF(l.cache);
  Py_XDECREF(l.memo_objs);
  Py_XDECREF(l.copies);
  Py_XDECREF(l.hashed);
  Py_XDECREF(l.fn_array);
  Py_XDECREF(l.fn_new);
  Py_XDECREF(l.unfinished);
  Py_XDECREF(l.fn_fill);
  Py_XDECREF(l.fn_finish);
  Py_XDECREF(l.fn_reduced_new);
  Py_XDECREF(l.fn_reduced_done);
  Py_XDECREF(l.fn_subclass);
  Py_XDECREF(l.fn_object);
  Py_XDECREF(l.buffer_type);
  for (int i = 0; i < DP_DTYPE_COUNT; i++) Py_XDECREF(l.np_dtypes[i]);
  Py_XDECREF(l.np_module);
  Py_XDECREF(l.torch_dtypes);
  Py_XDECREF(l.torch_module);
  Py_XDECREF(l.torch_flats);
  return result;
}

int dpy_frames_init(PyObject *m) {
  frame_error = dpy_new_error("devpickle.FrameError",
                              "A frame loads() refused: the library's message; attributes code (\"DP_ECHECKSUM\", ...) "
                              "and offset (the byte where reading stopped).",
                              PyExc_ValueError, (const char *const[]){"code", "offset", NULL});
  if (!frame_error) return -1;
  Py_INCREF(frame_error);
  return PyModule_AddObject(m, "FrameError", frame_error);
}
