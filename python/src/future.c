/*
 * future.c — devpickle.Future: torch.futures.Future's interface over the C
 * library's stream-aware future.
 *
 * The Python result lives in the Python object; the C future holds none and
 * carries what the walk found (dp_future_mark_completed_with_ptrs), its
 * events and its waits. then() and add_done_callback() register a
 * dp_future_then_with_ptrs callback, which the library runs — inline on the
 * completing thread, or at once when the future is already done — with no
 * lock of its own held and with pool streams current; the callback takes the
 * GIL, makes those streams torch's current streams too, calls Python, walks
 * the result and completes the child — a future of its own, made by then()
 * before the callback can run, so that whoever completes it first (its own
 * set_result on any thread, or the callback) wins — and puts the streams
 * back.
 *
 * GIL rules: every call into the C future that can block (wait) releases the
 * GIL first; the C future never holds its lock while a callback runs, so a
 * callback taking the GIL cannot deadlock against a waiter (PyTorch #58239).
 * A callback entry holds its child, so a chain `f.then(a).then(b)` stays
 * alive while f can complete; it holds f itself only once f is claimed
 * (then_ud_t), so a pending f whose last reference goes fails its children.
 * A collect_all future with callbacks is held by its pending inputs
 * instead (link_t): it lives while one of them can complete it, and a
 * cycle of it and inputs nobody else holds is the collector's to find.
 */
#include "ext.h"
#include "../../future/internal.h"
#include "../../pickler/ptrset_impl.h"

#include <string.h>

typedef struct pyfut {
  PyObject_HEAD
  dp_future_t *f;
  PyObject *result;   /* set just before the C future completes */
  PyObject *exc;      /* the exception it failed with, when Python gave one */
  PyObject *exc_tb;   /* its traceback then: each raise starts from it, not from the last raise's */
  PyObject *inputs;   /* collect_all: the input futures (its value). Let go of only once this
                       * future goes (fut_dealloc), after its callbacks (cancel_unarmed): an input
                       * released pending fails it, and the collect_all futures over it, whose
                       * callbacks would run. A tuple, which the collector cannot clear */
  dp_device_t *devices;
  size_t ndevices;
  int track;          /* 0 for devices=[]: nothing is walked */
  int cupy;           /* the value holds cupy arrays: cupy's current streams */
  int completing;     /* set_result/set_exception began: a second one is refused */
  int used;           /* waited on, chained or collected: __init__ may no longer remake it */
  int chained;        /* a then() future: its opaque types came from its parent (a walk error says so) */
  unsigned long walker; /* the thread walking the result it will complete with (set_result, a then()
                         * callback's), or 0: that thread's wait() on it could never return */
  struct pyfut *parent; /* a then() future's, until its callback ran or the parent went (borrowed):
                         * with inputs, what its completion waits for (waits_for_running) */
  PyObject *weakrefs;
  PyObject *dict;     /* attributes, as on torch.futures.Future */
  PyObject *devices_read; /* the devices= that tp_new read, until __init__: the same object is not read
                           * again (its items' __str__ would run twice, and could answer otherwise) */
  PyObject *opaque;   /* opaque=: a tuple of types the walks of its results treat as leaves, or NULL */
  PyObject *opaque_read; /* the opaque= that tp_new read, until __init__ (an iterator is read once) */
  struct then_ud *unarmed; /* callback entries that borrow this future (see then_ud_t), under the GIL */
  struct link *links; /* a pending input's links to the collect_all futures over it (link_t) */
  int linked;         /* collect_all: its pending inputs hold it (link_collect) */
} pyfut_t;

/* A then() or add_done_callback() entry. While its future is pending and
 * unclaimed the entry only borrows it (parent, unarmed: on the future's
 * list): a reference would make future -> C future -> entry -> future a
 * cycle the collector cannot see, so a future dropped pending with
 * callbacks would never go, and its children would wait forever. Its C
 * future is then held by the wrapper alone (a then() child holds no
 * reference to its parent, a collect_all none to a pending input), so the
 * wrapper's last reference releases it: the callbacks can never run, and
 * cancel_unarmed fails the children with DP_ECANCELED, as the C library
 * fails its own. Once the future is claimed (claim(): set_result,
 * set_exception, a callback completing its child) every entry is armed,
 * holding a reference until it ran, since its callback may then run on a
 * trampoline after the claimer dropped the future. A collect_all future,
 * which its inputs complete without anyone holding its wrapper, borrows
 * the same way: its pending inputs hold it instead (link_t), so that it
 * lives while one of them can complete it, and is armed once it is done
 * (the first of its callbacks to run, or the link that saw it complete). */
typedef struct then_ud {
  PyObject *callback;
  pyfut_t *parent;  /* a reference once armed; borrowed before */
  pyfut_t *child;   /* NULL for add_done_callback */
  int armed;
  /* cancelled (cancel_unarmed) by a parent that the library may still
   * complete (collect_all): 1 while the cancel uses it, 2 once it is
   * done with it, 3 once the callback was called (and did nothing) first;
   * freed by whichever of the two comes last */
  int dead;
  struct then_ud *prev, *next; /* on parent->unarmed while not armed */
} then_ud_t;

/* A pending input's hold on a collect_all future over it (made once the
 * collect_all future has callbacks, link_collect): while the input can
 * complete, so can the collect_all future, which must then be alive for
 * its callbacks, with nobody else holding it. The reference is the
 * input's, visible to the collector (fut_traverse), so a collect_all
 * future and inputs that hold each other and that nobody else holds are
 * collected like any cycle, and its then() children fail (cancel_unarmed).
 * Once the input is claimed the link is armed: no longer the input's (not
 * traversed), it holds the collect_all future until the input has
 * completed. The library calls link_fire once the input is complete (after
 * the collect_all future's own callbacks, when the input completed it), or
 * released pending, and link_drop after. Under the GIL, but for
 * link_drop. */
typedef struct link {
  pyfut_t *out;  /* a reference, until it fired or its input let go (dead) */
  pyfut_t *in;   /* borrowed: the input, while on its list; NULL once it let go */
  int armed;
  int dead;
  struct link *prev, *next; /* on in->links */
} link_t;

static PyTypeObject fut_type;

static int same_devices(pyfut_t *f, dp_future_opts_t *o, dp_backend_t *b) {
  memset(o, 0, sizeof *o);
  o->backend = b;
  o->devices = f->devices;
  o->ndevices = f->ndevices;
  o->no_hooks = !f->track;
  o->consumers_only = 1; /* torch's semantics; its allocator's records are dear */
  return 0;
}

/* ---- stream uses: torch's allocator for torch's blocks, devpickle's for its own ---- */

static int record_streams(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  (void)ctx;
  dp_device_t dev = dp_stream_device(s);
  dp_cache_t *cache = NULL;
  for (size_t i = 0; i < n; i++) {
    if (dev.type == DP_DEVICE_CUDA && dpy.torch && dpy.torch->has_cuda &&
        dpy.torch->record_stream(ptrs[i], dev.index, dp_stream_native(s)) == 0)
      continue;
    if (!cache) {
      int rc = dp_cache_default(dp_stream_backend(s), &cache, err);
      if (rc) return rc;
    }
    int rc = dp_cache_record_stream(cache, ptrs[i], s, err);
    if (rc && rc != DP_ENOTFOUND) return rc;
  }
  return 0;
}

static int record_stream(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  return record_streams(ctx, &ptr, 1, s, err);
}

static const dp_cache_hooks_t owner_hooks = {NULL, record_stream, record_streams};

/* ---- construction ---- */

/* A device's text as torch names it: the library's names, and torch's cpu
 * with an index ("cpu:0", torch.device("cpu", 0): torch's own future takes
 * its cpu device only so), which is cpu whatever N 0..255 says. */
static int parse_device(const char *txt, dp_device_t *d, dp_error_t *e) {
  char host[16];
  if (strncmp(txt, "cpu:", 4) != 0) return dp_device_parse(txt, d, e);
  /* N read by the library's rule for host:N (0..255, no sign, no leading 0) */
  if ((size_t)snprintf(host, sizeof host, "host:%s", txt + 4) >= sizeof host) return -1;
  if (dp_device_parse(host, d, e)) return -1;
  d->type = DP_DEVICE_CPU;
  d->index = 0;
  return 0;
}

/* 1 when x is a numpy integer scalar (numpy.integer: np.int64(0), not
 * np.bool_), which torch reads as a CUDA index as it reads an int; 0 when it
 * is not, or numpy was never imported; -1 with an exception set. */
static int is_numpy_integer(PyObject *x) {
  if (PyLong_Check(x) || PyUnicode_Check(x)) return 0;
  if (dpy_resolve_frameworks()) return -1;
  if (!dpy.numpy_generic || !PyObject_TypeCheck(x, dpy.numpy_generic)) return 0;
  PyObject *name = PyUnicode_FromString("numpy");
  PyObject *np = name ? PyImport_GetModule(name) : NULL;
  Py_XDECREF(name);
  if (!np) return PyErr_Occurred() ? -1 : 0;
  PyObject *integer = PyObject_GetAttrString(np, "integer");
  Py_DECREF(np);
  if (!integer) return -1;
  int r = PyObject_IsInstance(x, integer);
  Py_DECREF(integer);
  return r;
}

static int parse_devices(PyObject *devices, dp_device_t **out, size_t *n) {
  *out = NULL;
  *n = 0;
  if (PyUnicode_Check(devices)) {
    PyErr_SetString(PyExc_TypeError, "devices must be a list of devices, not a str (devices=[\"cuda:0\"])");
    return -1;
  }
  /* a sequence of ints, but not a list of devices: b"cpu" would be cuda:99,
   * cuda:112 and cuda:117 (memoryview(b"cpu") too) */
  if (PyBytes_Check(devices) || PyByteArray_Check(devices) || PyMemoryView_Check(devices)) {
    PyErr_Format(PyExc_TypeError, "devices must be a list of devices, not a '%s' (devices=[\"cuda:0\"])",
                 Py_TYPE(devices)->tp_name);
    return -1;
  }
  /* loads's stand-in is a sequence to PySequence_Check, whose first item
   * raises its own TypeError */
  int stand_in = dpy_refuse_stand_in(devices, "devices must be a list of devices, not", " (devices=[\"cuda:0\"])");
  if (stand_in) return -1;
  /* a sequence, as documented: PySequence_Tuple alone would drain a
   * generator or take a set's arbitrary order */
  if (!PySequence_Check(devices)) {
    PyErr_Format(PyExc_TypeError, "devices must be a list of devices, not a '%s' (devices=[\"cuda:0\"])",
                 Py_TYPE(devices)->tp_name);
    return -1;
  }
  /* a copy, read once: an item's __str__ or __index__ is Python code, which
   * may empty the list it came from, freeing the items after it */
  PyObject *seq = dpy_items(devices, 0, "devices must be a list of devices, not", " (devices=[\"cuda:0\"])");
  if (!seq) return -1;
  Py_ssize_t k = PyTuple_GET_SIZE(seq);
  dp_device_t *d = PyMem_Calloc((size_t)k + 1, sizeof *d);
  if (!d) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  Py_ssize_t kept = 0; /* distinct devices, in d[0 .. kept) */
  for (Py_ssize_t i = 0; i < k; i++) {
    PyObject *x = PyTuple_GET_ITEM(seq, i);
    /* an int, or a numpy integer, is a CUDA index; a bool is not an int
     * here (torch's reading): it is read by its str(), as any other item */
    int npint = is_numpy_integer(x);
    PyObject *s = NULL;
    if (npint > 0 || (PyLong_Check(x) && !PyBool_Check(x))) {
      PyObject *index = PyNumber_Index(x);
      s = index ? PyUnicode_FromFormat("cuda:%S", index) : NULL;
      Py_XDECREF(index);
    } else if (npint == 0) {
      s = PyObject_Str(x);
    }
    Py_ssize_t len = 0;
    const char *txt = s ? PyUnicode_AsUTF8AndSize(s, &len) : NULL;
    dp_error_t e;
    /* the whole text names the device: one holding a NUL ("cpu\0x") is
       none, never the part before it */
    int nul = txt && strlen(txt) != (size_t)len;
    if (!txt || nul || parse_device(txt, &d[kept], &e)) {
      /* in Python's words (the library's message names its own function) */
      if (txt) PyErr_Format(PyExc_ValueError, "devices: %R is not a device (cpu, cuda:N or host:N, N 0..255)", s);
      Py_XDECREF(s);
      Py_DECREF(seq);
      PyMem_Free(d);
      return -1;
    }
    Py_DECREF(s);
    /* a device named twice is one device (torch deduplicates a future's
       devices too): kept once, where first named */
    for (Py_ssize_t j = 0; j < kept; j++)
      if (dp_device_equal(d[j], d[kept])) {
        kept--;
        break;
      }
    kept++;
  }
  Py_DECREF(seq);
  *out = d;
  *n = (size_t)kept;
  return 0;
}

/* A new future of type (Future or a subclass): zeroed and tracked by the
 * collector (tp_alloc). */
static pyfut_t *fut_alloc(PyTypeObject *type) {
  pyfut_t *f = (pyfut_t *)type->tp_alloc(type, 0);
  if (f) f->track = 1;
  return f;
}

/* The backend for these devices: the default one (cuda where a GPU is
 * usable, else host) unless the devices name another. */
static int pick_backend(const dp_device_t *d, size_t n, dp_backend_t **b) {
  dp_error_t e;
  int rc = 0;
  for (size_t i = 0; i < n && !rc; i++)
    if (d[i].type != DP_DEVICE_CPU) return dp_backend_get(d[i].type, b, &e) ? (dpy_raise(e.code, &e), -1) : 0;
  rc = dp_backend_default(b, &e);
  if (rc) dpy_raise(rc, &e);
  return rc ? -1 : 0;
}

static int fut_make(pyfut_t *self, dp_future_t *from) {
  if (from) {
    self->f = from;
    return 0;
  }
  dp_backend_t *b;
  if (pick_backend(self->devices, self->ndevices, &b)) return -1;
  dp_future_opts_t o;
  same_devices(self, &o, b);
  o.hooks = &owner_hooks;
  dp_error_t e;
  int rc = dp_future_new(&o, &self->f, &e);
  if (rc) dpy_raise(rc, &e);
  return rc ? -1 : 0;
}

static PyObject *fut_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"devices", "opaque", NULL};
  PyObject *devices = Py_None, *opaque = NULL;
  if (type == &fut_type) {
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OO:Future", kwlist, &devices, &opaque)) return NULL;
  } else if (kw) { /* a subclass: its __init__ takes its own arguments; devices= and opaque= are ours */
    static PyObject *key, *opaque_key;
    if (!key && !(key = PyUnicode_InternFromString("devices"))) return NULL;
    if (!opaque_key && !(opaque_key = PyUnicode_InternFromString("opaque"))) return NULL;
    devices = PyDict_GetItemWithError(kw, key);
    if (!devices && PyErr_Occurred()) return NULL;
    if (!devices) devices = Py_None;
    opaque = PyDict_GetItemWithError(kw, opaque_key);
    if (!opaque && PyErr_Occurred()) return NULL;
  }
  pyfut_t *f = fut_alloc(type);
  if (!f) return NULL;
  if (devices != Py_None) {
    if (parse_devices(devices, &f->devices, &f->ndevices)) goto fail;
    if (f->ndevices == 0) f->track = 0;
    f->devices_read = Py_NewRef(devices);
  }
  if (opaque) {
    if (dpy_scan_opaque(opaque, &f->opaque)) goto fail;
    f->opaque_read = Py_NewRef(opaque);
  }
  if (fut_make(f, NULL)) goto fail;
  return (PyObject *)f;
fail:
  Py_DECREF(f);
  return NULL;
}

/* Whether two lists of distinct devices (parse_devices keeps each once) name
 * the same devices, in any order: the order changes nothing (every non-cpu
 * device of a future is of its one backend). */
static int same_list(const dp_device_t *a, size_t na, const dp_device_t *b, size_t nb) {
  if (na != nb) return 0;
  for (size_t i = 0; i < na; i++) {
    size_t j = 0;
    while (j < nb && !dp_device_equal(a[i], b[j])) j++;
    if (j == nb) return 0;
  }
  return 1;
}

/* Devices given to __init__ (see fut_init). 0, or -1 with an exception. */
static int init_devices(pyfut_t *self, PyObject *devices) {
  dp_device_t *d = NULL;
  size_t n = 0;
  if (devices != Py_None && parse_devices(devices, &d, &n)) return -1;
  int track = devices == Py_None || n > 0;
  if (track == self->track && same_list(d, n, self->devices, self->ndevices)) {
    PyMem_Free(d);
    return 0;
  }
  if (self->used || self->completing || dp_future_is_done(self->f)) {
    PyMem_Free(d);
    PyErr_SetString(PyExc_RuntimeError, "Future.__init__() cannot change the devices of a future already completed, "
                                        "waited on, chained or collected");
    return -1;
  }
  if (self->inputs) {
    /* a collect_all future's C future is the library's, completed by its
       inputs: a new one would never complete, and its waiters would hang */
    PyMem_Free(d);
    PyErr_SetString(PyExc_RuntimeError, "Future.__init__() cannot change the devices of a collect_all() future "
                                        "(its inputs complete it)");
    return -1;
  }
  dp_device_t *old_d = self->devices;
  size_t old_n = self->ndevices;
  int old_track = self->track;
  dp_future_t *old = self->f;
  self->devices = d;
  self->ndevices = n;
  self->track = track;
  if (fut_make(self, NULL)) {
    self->devices = old_d;
    self->ndevices = old_n;
    self->track = old_track;
    self->f = old;
    PyMem_Free(d);
    return -1;
  }
  dp_future_release(old);
  PyMem_Free(old_d);
  return 0;
}

/* Future.__init__(*, devices=None, opaque=()). tp_new made the C future from
 * the same arguments already; a subclass's __init__ may hand other devices
 * to super().__init__() (torch.futures.Future itself is built that way),
 * which remakes it while nobody can hold it yet: not completed, waited on,
 * chained or collected. Other opaque types replace the ones the walks to
 * come use (a walk under way holds its own); then() children made before
 * keep theirs. Neither changes when the other's argument is refused. */
static int fut_init(pyfut_t *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"devices", "opaque", NULL};
  PyObject *devices = NULL, *opaque = NULL;
  if ((PyTuple_GET_SIZE(args) || kw) &&
      !PyArg_ParseTupleAndKeywords(args, kw, "|$OO:Future", kwlist, &devices, &opaque))
    return -1;
  /* the objects construction read: what they gave stands, unread again */
  PyObject *read_devices = self->devices_read, *read_types = self->opaque_read;
  self->devices_read = self->opaque_read = NULL;
  int new_opaque = opaque && opaque != read_types;
  PyObject *types = NULL;
  int rc = new_opaque ? dpy_scan_opaque(opaque, &types) : 0;
  /* none given (a subclass's super().__init__()) changes nothing */
  if (!rc && devices && devices != read_devices) rc = init_devices(self, devices);
  if (!rc && new_opaque) Py_XSETREF(self->opaque, types);
  else Py_XDECREF(types);
  Py_XDECREF(read_devices);
  Py_XDECREF(read_types);
  return rc;
}

/* ---- callback entries that borrow their future (then_ud_t) ---- */

static void unarmed_unlink(pyfut_t *f, then_ud_t *u) {
  if (u->prev) u->prev->next = u->next;
  else f->unarmed = u->next;
  if (u->next) u->next->prev = u->prev;
  u->prev = u->next = NULL;
}

/* Claims f for completion (set_result, set_exception, a callback's
 * result): no other completion is taken, and every callback entry now holds
 * f, since from here its callback may run after whoever completes f has
 * dropped it (queued on a trampoline). Under the GIL. */
static void claim(pyfut_t *f) {
  f->completing = 1;
  while (f->unarmed) {
    then_ud_t *u = f->unarmed;
    unarmed_unlink(f, u);
    Py_INCREF(f);
    u->armed = 1;
  }
  /* f completes: the collect_all futures over it may complete with it, and
     are held until it has (the holds are no longer f's own) */
  for (link_t *l = f->links; l; l = l->next) l->armed = 1;
}

/* ---- a pending input's hold on a collect_all future over it (link_t) ---- */

static void links_unlink(pyfut_t *f, link_t *l) {
  if (l->prev) l->prev->next = l->next;
  else f->links = l->next;
  if (l->next) l->next->prev = l->prev;
  l->prev = l->next = NULL;
}

/* The input is complete (f), or was released pending (f NULL, which its
 * wrapper's last reference does only after letting go of its links: not
 * reached with a live link). The collect_all future, if complete now,
 * has its callbacks armed before the link's reference goes. */
static void link_fire(void *ctx, dp_future_t *f, size_t index) {
  (void)f;
  (void)index;
  link_t *l = ctx;
  PyGILState_STATE g = PyGILState_Ensure();
  if (!l->dead) {
    pyfut_t *out = l->out;
    if (l->in) links_unlink(l->in, l);
    l->in = NULL;
    l->out = NULL;
    l->dead = 1;
    if (dp_future_is_done(out->f)) claim(out);
    Py_DECREF(out);
  }
  PyGILState_Release(g);
}

static void link_drop(void *ctx) { PyMem_RawFree(ctx); }

/* f goes (tp_clear, tp_dealloc): its unarmed links let go of their
 * collect_all futures (which then go too, if nothing else holds them, and
 * fail their children); an armed one is the library's until f completes.
 * One at a time, from f's list: a release runs Python code, which may let
 * another thread fire a link still on it. */
static void cancel_links(pyfut_t *f) {
  link_t *l;
  while ((l = f->links)) {
    links_unlink(f, l);
    l->in = NULL;
    if (l->armed || l->dead) continue;
    pyfut_t *out = l->out;
    l->out = NULL;
    l->dead = 1;
    Py_DECREF(out);
  }
}

/* out, a collect_all future getting its first callback while pending and
 * unclaimed: each pending input holds it from now on (link_t), and each
 * pending collect_all among them its own inputs' holds, and so on (a
 * stack, not recursion: they nest without bound). No Python code runs.
 * 0, or -1 with MemoryError (the links made stay: a second one of an input
 * only holds out a little longer). */
static int link_collect(pyfut_t *out) {
  size_t n = 0, cap = 8;
  pyfut_t **stack = PyMem_Malloc(cap * sizeof *stack);
  if (!stack) return PyErr_NoMemory(), -1;
  stack[n++] = out;
  int rc = 0;
  while (n && !rc) {
    pyfut_t *o = stack[--n];
    if (o->linked || !o->inputs) continue;
    o->linked = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o->inputs); i++) {
      pyfut_t *x = (pyfut_t *)PyTuple_GET_ITEM(o->inputs, i);
      if (dp_future_is_done(x->f)) continue;
      link_t *l = PyMem_RawMalloc(sizeof *l);
      if (!l) {
        rc = -1;
        break;
      }
      l->out = (pyfut_t *)Py_NewRef(o);
      l->in = x;
      l->armed = x->completing; /* claimed: it completes, whoever holds it */
      l->dead = 0;
      l->prev = NULL;
      l->next = x->links;
      if (l->next) l->next->prev = l;
      x->links = l;
      /* may fire at once, x having completed meanwhile on a thread
         without the GIL (a collect_all's inputs): o is held the while */
      if (dp__future_notify(x->f, link_fire, link_drop, l)) {
        links_unlink(x, l);
        Py_DECREF(o);
        PyMem_RawFree(l);
        rc = -1;
        break;
      }
      if (x->inputs && !x->linked && !x->completing) {
        if (n == cap) {
          pyfut_t **grown = PyMem_Realloc(stack, 2 * cap * sizeof *stack);
          if (!grown) {
            rc = -1;
            break;
          }
          stack = grown;
          cap *= 2;
        }
        stack[n++] = x;
      }
    }
    if (rc) o->linked = 0; /* linked again at the next callback */
  }
  PyMem_Free(stack);
  if (rc) PyErr_NoMemory();
  return rc;
}

/* f goes while pending, unclaimed: nobody can complete it any more, so its
 * callbacks never run (its C future, which only f holds, is released with
 * it; a collect_all's, which the library completes, runs them as no-ops)
 * and its then() children fail with DP_ECANCELED, as the C library's own
 * do. Each child is failed by its own completion, so its callbacks — and
 * their chains — run as on any failure. Called from tp_finalize (the
 * collector found f unreachable: through a callback that refers to it, or
 * a collect_all future and inputs that hold each other), or tp_dealloc;
 * tp_clear only lets go of what is left (fut_clear). */
static void cancel_unarmed(pyfut_t *f) {
  /* no completion of f is taken from here (set_result on f from code run
     below): the entries freed below must never be called */
  f->completing = 1;
  /* newest first on f's list: reversed, so the children fail in the order
     then() made them, as their callbacks would have run */
  then_ud_t *list = NULL;
  while (f->unarmed) {
    then_ud_t *u = f->unarmed;
    f->unarmed = u->next;
    u->next = list;
    list = u;
  }
  /* f goes: the wait check no longer follows it, from any child, and a
     callback the library calls meanwhile does nothing, before the first
     failure below runs Python code */
  for (then_ud_t *u = list; u; u = u->next) {
    if (u->child) u->child->parent = NULL;
    u->dead = 1;
  }
  while (list) {
    then_ud_t *u = list;
    list = u->next;
    pyfut_t *child = u->child;
    if (child) {
      if (!child->completing && !dp_future_is_done(child->f)) {
        claim(child);
        dp_error_t e;
        dp_error_clear(&e);
        e.code = DP_ECANCELED;
        snprintf(e.message, sizeof e.message, "%s",
                 "the Future this then() future was chained on was dropped before it completed (its last "
                 "reference went): nothing can complete it, so its callbacks never run");
        dp_future_set_error(child->f, &e, NULL);
      }
    }
    PyObject *cb = u->callback;
    u->callback = NULL;
    u->child = NULL;
    /* a collect_all's C future lives on in the library, which calls every
       entry once: the last of the two frees it */
    if (!f->inputs || u->dead == 3) PyMem_RawFree(u);
    else u->dead = 2;
    Py_DECREF(cb);
    Py_XDECREF(child);
  }
  cancel_links(f);
}

static int fut_traverse(pyfut_t *f, visitproc visit, void *arg) {
  /* what the unarmed entries hold is f's: a callback that refers to f is a
     cycle the collector can then see */
  for (then_ud_t *u = f->unarmed; u; u = u->next) {
    Py_VISIT(u->callback);
    Py_VISIT(u->child);
  }
  /* and the collect_all futures f holds while it can complete them */
  for (link_t *l = f->links; l; l = l->next)
    if (!l->armed && !l->dead) Py_VISIT(l->out);
  Py_VISIT(f->dict);
  Py_VISIT(f->result);
  Py_VISIT(f->exc);
  Py_VISIT(f->exc_tb);
  Py_VISIT(f->inputs);
  Py_VISIT(f->devices_read);
  Py_VISIT(f->opaque);
  Py_VISIT(f->opaque_read);
  return 0;
}

/* tp_finalize: the collector runs it on every object it found unreachable
 * before it clears any of them, so the children's callbacks run while all
 * they may touch is whole. From tp_clear they ran after the collector had
 * cleared some: a child's callback among the garbage was called with its
 * function cleared (no globals), which crashed the interpreter. */
static void fut_finalize(pyfut_t *f) {
  if (!f->unarmed && !f->links) return;
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  cancel_unarmed(f);
  PyErr_Restore(t, v, tb);
}

static int fut_clear(pyfut_t *f) {
  /* finalized first (fut_finalize): left over only where a subclass's own
     __del__ took the place of tp_finalize */
  cancel_unarmed(f);
  Py_CLEAR(f->dict);
  Py_CLEAR(f->result);
  Py_CLEAR(f->exc);
  Py_CLEAR(f->exc_tb);
  /* not inputs (see pyfut_t): they form no cycle of their own (a
     collect_all's inputs were made before it), so what they hold goes
     with the links and entries cleared here */
  Py_CLEAR(f->devices_read);
  Py_CLEAR(f->opaque);
  Py_CLEAR(f->opaque_read);
  return 0;
}

static void fut_dealloc(pyfut_t *f) {
  PyObject_GC_UnTrack(f);
  /* a result may be a future whose result is a future, ... (devices=[]
     stores any object): freed through the trashcan, not one C frame each */
  Py_TRASHCAN_BEGIN(f, fut_dealloc);
  if (f->weakrefs) PyObject_ClearWeakRefs((PyObject *)f);
  fut_clear(f);
  Py_CLEAR(f->inputs);
  dp_future_t *c = f->f;
  f->f = NULL;
  if (c) {
    /* a release may cancel children, which never calls Python */
    dp_future_release(c);
  }
  PyMem_Free(f->devices);
  Py_TYPE(f)->tp_free((PyObject *)f);
  Py_TRASHCAN_END;
}

/* ---- cupy's current streams ----
 * A value holding cupy arrays is completed and waited on cupy's current
 * streams (torch's are the default through the stream provider): for the
 * call, each CUDA device's devpickle current stream is a wrapper of cupy's. */

typedef struct cupy_swap {
  int n;
  dp_backend_t *b;
  dp_device_t dev[DP_CURRENT_STREAM_SLOTS];
  dp_stream_t *prev[DP_CURRENT_STREAM_SLOTS];
} cupy_swap_t;

static int cupy_stream_of(int device, void **out) {
  PyObject *cuda = PyImport_ImportModule("cupy.cuda");
  PyObject *dev = cuda ? PyObject_CallMethod(cuda, "Device", "i", device) : NULL;
  PyObject *ent = dev ? PyObject_CallMethod(dev, "__enter__", NULL) : NULL;
  PyObject *st = ent ? PyObject_CallMethod(cuda, "get_current_stream", NULL) : NULL;
  PyObject *ptr = st ? PyObject_GetAttrString(st, "ptr") : NULL;
  if (ent) { /* never called under the exception a read after __enter__ raised: it is put back after */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethod(dev, "__exit__", "OOO", Py_None, Py_None, Py_None);
    if (et) {
      if (!r) PyErr_Clear();
      PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(r);
  }
  if (ptr) *out = PyLong_AsVoidPtr(ptr);
  Py_XDECREF(cuda);
  Py_XDECREF(dev);
  Py_XDECREF(ent);
  Py_XDECREF(st);
  Py_XDECREF(ptr);
  return PyErr_Occurred() ? -1 : 0;
}

/* devs: the CUDA devices to switch (others are skipped). */
static int cupy_in(const dp_device_t *devs, size_t n, cupy_swap_t *sw) {
  sw->n = 0;
  for (size_t i = 0; i < n && sw->n < DP_CURRENT_STREAM_SLOTS; i++) {
    if (devs[i].type != DP_DEVICE_CUDA) continue;
    void *native = NULL;
    dp_stream_t *s;
    dp_error_t e;
    if (!sw->b && dp_backend_get(DP_DEVICE_CUDA, &sw->b, &e)) return dpy_raise(e.code, &e), -1;
    if (cupy_stream_of(devs[i].index, &native)) return -1;
    if (dp_stream_wrap(sw->b, devs[i], native, &s, &e) || dp_set_current_stream(s, &sw->prev[sw->n], &e))
      return dpy_raise(e.code, &e), -1;
    sw->dev[sw->n++] = devs[i];
  }
  return 0;
}

static void cupy_out(cupy_swap_t *sw) {
  for (int i = sw->n; i-- > 0;) {
    if (sw->prev[i]) dp_set_current_stream(sw->prev[i], NULL, NULL);
    else dp_reset_current_stream(sw->b, sw->dev[i]);
  }
  sw->n = 0;
}

static size_t set_devices(const dp_ptrset_t *set, dp_device_t *out, size_t max) {
  size_t n = dp_ptrset_ndevices(set);
  if (n > max) n = max;
  for (size_t j = 0; j < n; j++) out[j] = dp_ptrset_device(set, j);
  return n;
}

static size_t future_devices(dp_future_t *f, dp_device_t *out, size_t max) {
  size_t n = dp_future_ndevices(f);
  if (n > max) n = max;
  for (size_t j = 0; j < n; j++) out[j] = dp_future_device(f, j);
  return n;
}

/* ---- completion ---- */

static void already_complete(const pyfut_t *f) {
  PyErr_SetString(PyExc_RuntimeError,
                  f && f->f && !dp_future_is_done(f->f)
                      ? "Future can only be marked completed once (set_result or set_exception was already "
                        "called: it is being completed)"
                      : "Future can only be marked completed once (it is already complete)");
}

/* The futures whose results this thread is walking (set_result, a then()
 * callback's result), innermost first: each completes only once its walk
 * returns, so the value's code must not wait on it, nor on a future that
 * waits for it (waits_for_running). */
typedef struct walking {
  pyfut_t *f;
  struct walking *outer;
} walking_t;

static _Thread_local walking_t *walking;

/* The allocations of value, for a future that tracks devices (with their
 * first paths when paths is set). 0 and a scanner holding them, or -1 with
 * an exception. */
static int walk_value(pyfut_t *self, PyObject *value, dpy_scanner_t **out, int paths) {
  *out = NULL;
  if (!self->track) return 0;
  dpy_scanner_t *s = dpy_scanner_get();
  if (!s) return -1;
  /* the future needs the allocations, not their refs. The opaque types are
     held for the walk: the value's code may replace self's (__init__) */
  dpy_scan_opts_t o = {.paths = paths, .no_refs = 1, .opaque = Py_XNewRef(self->opaque), .chained = self->chained};
  /* the value's code runs under the walk: a wait() on self from it (on
     this thread) is refused, since self completes only once the walk
     returns. A nested walk of the same future cannot begin (completing is
     set), so the previous owner is 0. */
  unsigned long prev = self->walker;
  self->walker = PyThread_get_thread_ident();
  walking_t me = {self, walking}; /* self is held by the caller until the walk returns */
  walking = &me;
  int rc = dpy_scan(s, value, &o, NULL);
  walking = me.outer;
  self->walker = prev;
  Py_XDECREF(o.opaque);
  if (rc) {
    dpy_scanner_put(s);
    return -1;
  }
  *out = s;
  return 0;
}

/* The Python exception now raised, normalized, with its traceback (a new
 * reference; cleared). */
static PyObject *fetch_raised(void) {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (tb && v) PyException_SetTraceback(v, tb);
  Py_XDECREF(t);
  Py_XDECREF(tb);
  return v ? v : Py_NewRef(Py_None);
}

/* The walk of value found memory (s) on a device self refuses: the value
 * is walked again with paths, and the first path of its memory on each
 * such device goes into s's set, at s's first allocation there, so that
 * the refusal (DP_EDEVICE) names where the value holds it, as the
 * library's own walk does (future.h); the value's code runs once more, as
 * in any walk. The completion keeps s, the first walk's verdict: a second
 * walk that differs (a reduce that returns another thing, or fails) only
 * names a path, or none, and never lets a refused value through. Returns
 * an interrupt (KeyboardInterrupt, SystemExit: not an Exception) that
 * second walk raised, a new reference for the caller to raise once the
 * future has failed with the refusal; NULL otherwise (an Exception it
 * raised is dropped: the refusal names no path). */
static PyObject *paths_where_refused(pyfut_t *self, PyObject *value, dpy_scanner_t *s) {
  dp_ptrset_t *set = (dp_ptrset_t *)dpy_scanner_ptrs(s);
  size_t j = 0, n = dp_ptrset_ndevices(set);
  while (j < n && dp__future_accepts(self->f, dp_ptrset_device(set, j))) j++;
  if (j == n) return NULL;
  dpy_scanner_t *p;
  if (walk_value(self, value, &p, 1)) {
    PyObject *raised = fetch_raised();
    if (PyExceptionInstance_Check(raised) && !PyObject_TypeCheck(raised, (PyTypeObject *)PyExc_Exception))
      return raised;
    Py_DECREF(raised);
    return NULL;
  }
  const dp_ptrset_t *found = dpy_scanner_ptrs(p);
  for (; j < n; j++) {
    dp_device_t d = dp_ptrset_device(set, j);
    if (dp__future_accepts(self->f, d)) continue;
    for (size_t k = 0; k < dp_ptrset_ndevices(found); k++) {
      if (!dp_device_equal(dp_ptrset_device(found, k), d)) continue;
      const char *path = dpy_scanner_path(p, dp_ptrset_first_on(found, k));
      /* out of memory for the copy: the refusal names no path */
      if (path) (void)dp__ptrset_set_path(set, dp_ptrset_first_on(set, j), path);
      break;
    }
  }
  dpy_scanner_put(p);
  return NULL;
}

/* Raises interrupt (a new reference, stolen), replacing any exception
 * now raised, when there is one; NULL either way. */
static PyObject *raise_instead(PyObject *interrupt) {
  if (interrupt) {
    PyErr_SetObject((PyObject *)Py_TYPE(interrupt), interrupt);
    Py_DECREF(interrupt);
  }
  return NULL;
}

static dp_error_t py_failure(const char *what) {
  dp_error_t e;
  dp_error_clear(&e);
  e.code = DP_ESTATE;
  snprintf(e.message, sizeof e.message, "%s", what);
  return e;
}

/* f fails with exc (a new reference, stolen): kept with its traceback now. */
static void set_exc(pyfut_t *f, PyObject *exc) {
  PyObject *tb = PyExceptionInstance_Check(exc) ? PyException_GetTraceback(exc) : NULL;
  Py_XSETREF(f->exc, exc);
  Py_XSETREF(f->exc_tb, tb);
}

/* Moves the Python exception now raised into f->exc (cleared). */
static void keep_raised(pyfut_t *f) {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (tb && v) PyException_SetTraceback(v, tb);
  set_exc(f, v ? v : Py_NewRef(Py_None));
  Py_XDECREF(t);
  Py_XDECREF(tb);
}

/* What a future whose result's walk raised `raised` fails with (a new
 * reference): that exception — a WalkError, a MemoryError — unless it is
 * an interrupt (KeyboardInterrupt, SystemExit: not an Exception), which is
 * the walking thread's, not the future's: set_result raises it, and the
 * future fails with a RuntimeError naming it (its __cause__), so that no
 * waiter on another thread is interrupted, and a future holds only what
 * set_exception would take. */
static PyObject *walk_failure(PyObject *raised) {
  if (!PyExceptionInstance_Check(raised) || PyObject_TypeCheck(raised, (PyTypeObject *)PyExc_Exception))
    return Py_NewRef(raised);
  PyObject *text = PyObject_Str(raised);
  if (!text) {
    PyErr_Clear();
    text = PyUnicode_FromString("<exception str() failed>");
  }
  PyObject *exc = text ? PyUnicode_FromFormat("the walk of the future's result was interrupted (%s: %U): it holds "
                                              "no result",
                                              _PyType_Name(Py_TYPE(raised)), text)
                        : NULL;
  Py_XDECREF(text);
  PyObject *err = exc ? PyObject_CallOneArg(PyExc_RuntimeError, exc) : NULL;
  Py_XDECREF(exc);
  if (!err) { /* no memory for it: the interrupt itself, rather than no exception */
    PyErr_Clear();
    return Py_NewRef(raised);
  }
  PyException_SetCause(err, Py_NewRef(raised));
  return err;
}

/* Completes self with no allocations (devices=[]). On failure self has
 * failed too (nobody waits forever): NULL with the exception. */
static PyObject *empty_ptrs_complete(pyfut_t *self) {
  static dp_ptrset_t *empty;
  dp_error_t e;
  if (!empty && dp_ptrset_new(&empty, &e)) {
    dp_future_set_error(self->f, &e, NULL);
    return dpy_raise(e.code, &e);
  }
  int rc = dp_future_mark_completed_with_ptrs(self->f, dp_none(), empty, &e);
  if (rc == DP_ESTATE) { /* completed meanwhile by the library (a collect_all future): that stands */
    Py_CLEAR(self->result);
    already_complete(self);
    return NULL;
  }
  if (rc) return dpy_raise(rc, &e);
  Py_RETURN_NONE;
}

/* The one argument of a method of torch's (then's `callback`, set_result's
 * `result`, collect_all's `futures`), given by position or by its name as in
 * torch; Python's own messages for one missing, doubled, unknown or extra,
 * word for word torch's: a method (is_method) counts its self among the
 * positional arguments, as Python counts a method defined in Python. A
 * borrowed reference, or NULL with TypeError. */
static PyObject *one_arg(const char *fn, int is_method, const char *name, PyObject *const *args,
                         Py_ssize_t nargs, PyObject *kwnames) {
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs == 1 && nkw == 0) return args[0];
  if (nargs > 1) {
    PyErr_Format(PyExc_TypeError, "%s() takes %d positional argument%s but %zd were given", fn, 1 + is_method,
                 is_method ? "s" : "", nargs + is_method);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < nkw; i++) {
    PyObject *k = PyTuple_GET_ITEM(kwnames, i);
    if (PyUnicode_CompareWithASCIIString(k, name) != 0) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, k);
      return NULL;
    }
    if (nargs) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, name);
      return NULL;
    }
  }
  if (nkw) return args[0];
  PyErr_Format(PyExc_TypeError, "%s() missing 1 required positional argument: '%s'", fn, name);
  return NULL;
}

static PyObject *set_result(pyfut_t *self, PyObject *value) {
  /* claimed before the walk (which may run Python code, or let another
   * thread in): the loser must not replace the winner's result */
  if (self->completing || dp_future_is_done(self->f)) {
    already_complete(self);
    return NULL;
  }
  claim(self);
  dpy_scanner_t *s;
  if (walk_value(self, value, &s, 0)) {
    /* the future fails with the WalkError too, so that no waiter hangs */
    PyObject *exc = fetch_raised();
    set_exc(self, walk_failure(exc));
    dp_error_t e = py_failure("the result cannot be walked (WalkError)");
    if (dp_future_set_error(self->f, &e, NULL)) { /* a collect_all future completed meanwhile: that stands */
      Py_CLEAR(self->exc);
      Py_CLEAR(self->exc_tb);
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
  }
  /* the result is stored only as the future completes, with no Python code
     run between (the refusal's second walk and cupy's streams run some):
     a collect_all future its inputs complete meanwhile is then never seen
     with this result by a waiter the completion let in */
  if (!s) {
    Py_XSETREF(self->result, Py_NewRef(value));
    return empty_ptrs_complete(self);
  }
  /* the future is refused, and set_result raises the interrupt that its
     walk for the refusal's path raised, if any, rather than the refusal */
  PyObject *interrupt = paths_where_refused(self, value, s);
  cupy_swap_t sw = {0};
  if (dpy_scanner_saw_cupy(s)) {
    dp_device_t devs[DP_CURRENT_STREAM_SLOTS];
    self->cupy = 1;
    if (cupy_in(devs, set_devices(dpy_scanner_ptrs(s), devs, DP_CURRENT_STREAM_SLOTS), &sw)) {
      cupy_out(&sw);
      dpy_scanner_put(s);
      /* claimed and never to be completed otherwise: it fails with this */
      PyObject *exc = fetch_raised();
      set_exc(self, walk_failure(exc));
      dp_error_t e = py_failure("the result's cupy streams could not be read");
      dp_future_set_error(self->f, &e, NULL);
      PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
      Py_DECREF(exc);
      return raise_instead(interrupt);
    }
  }
  dp_error_t e;
  Py_XSETREF(self->result, Py_NewRef(value));
  int rc = dp_future_mark_completed_with_ptrs(self->f, dp_none(), dpy_scanner_ptrs(s), &e);
  cupy_out(&sw);
  dpy_scanner_put(s);
  if (interrupt) {
    if (rc == DP_ESTATE) Py_CLEAR(self->result);
    return raise_instead(interrupt);
  }
  if (rc == DP_ESTATE) {
    /* completed meanwhile by the library itself (a collect_all future's
     * inputs, done while this walk ran): its outcome stands, not this one */
    Py_CLEAR(self->result);
    already_complete(self);
    return NULL;
  }
  if (rc) return dpy_raise(rc, &e);
  Py_RETURN_NONE;
}

static PyObject *fut_set_result(pyfut_t *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *value = one_arg("Future.set_result", 1, "result", args, nargs, kwnames);
  return value ? set_result(self, value) : NULL;
}

static PyObject *set_exception(pyfut_t *self, PyObject *exc) {
  if (!PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_Exception)) { /* as torch: an Exception, not a BaseException */
    PyErr_Format(PyExc_TypeError, "set_exception() takes an Exception instance, not '%s'", Py_TYPE(exc)->tp_name);
    return NULL;
  }
  if (self->completing || dp_future_is_done(self->f)) {
    already_complete(self);
    return NULL;
  }
  claim(self);
  set_exc(self, Py_NewRef(exc));
  dp_error_t e = py_failure("the future failed with a Python exception"), out;
  if (dp_future_set_error(self->f, &e, &out)) {
    /* completed by the library first (a collect_all future): that outcome stands */
    Py_CLEAR(self->exc);
    Py_CLEAR(self->exc_tb);
    already_complete(self);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *fut_set_exception(pyfut_t *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *exc = one_arg("Future.set_exception", 1, "result", args, nargs, kwnames);
  return exc ? set_exception(self, exc) : NULL;
}

/* The outcome of a complete future: its value (new reference), or NULL with
 * its exception raised. */
static PyObject *outcome(pyfut_t *self) {
  for (;;) { /* a loop, not recursion: collect_all futures nest without bound */
    dp_error_t e;
    int code = dp_future_error(self->f, &e);
    if (!code) { /* a collect_all future completed by hand (set_result) has that result */
      /* a new list each time, as torch's: a caller that changes it changes
       * its own copy, not what the future's other consumers get */
      if (self->inputs && !self->result) return PySequence_List(self->inputs);
      return Py_NewRef(self->result ? self->result : Py_None);
    }
    if (self->exc) {
      if (PyExceptionInstance_Check(self->exc)) PyException_SetTraceback(self->exc, self->exc_tb ? self->exc_tb : Py_None);
      PyErr_SetObject((PyObject *)Py_TYPE(self->exc), self->exc);
      return NULL;
    }
    pyfut_t *failed = NULL; /* collect_all: the first failed input's exception */
    for (Py_ssize_t i = 0; self->inputs && !failed && i < PyTuple_GET_SIZE(self->inputs); i++) {
      pyfut_t *in = (pyfut_t *)PyTuple_GET_ITEM(self->inputs, i);
      if (dp_future_error(in->f, NULL)) failed = in;
    }
    if (!failed) return dpy_raise(code, &e);
    self = failed; /* held by the tuple, which self (held by the caller) holds */
  }
}

/* ---- a wait that would wait for itself ----
 * A then() future completes once its callback returns (then_cb): a wait
 * from that callback — or from one nested in it, run by a wait of its own —
 * on that future, or on one that completes only after it (a then() future
 * of it, a collect_all over it, any chain of those), would never return.
 * The binding's futures are linked in Python (parent, inputs), not in the
 * C library's futures (a then() future is a C future of its own), so the
 * binding follows its own links, under the GIL: no Python code runs on the
 * way, so nothing changes under it. */

/* The then() futures whose callbacks run on this thread, innermost first. */
typedef struct running {
  pyfut_t *child;
  struct running *outer;
} running_t;

static _Thread_local running_t *running;

/* 0 when f is complete, or being completed by another thread (its
 * set_result or set_exception claimed it): no callback of this thread
 * stands in its way. */
static int still_waits(const pyfut_t *f) {
  return !dp_future_is_done(f->f) && !(f->completing && f->walker != PyThread_get_thread_ident());
}

typedef struct reach {
  dp_ptrset_t *seen; /* the running futures first (k of them: kcb callbacks' first), then those met */
  size_t k, kcb;
  size_t at;         /* found: the index of the running future met */
  pyfut_t **stack;
  size_t n, cap;
  int found;
} reach_t;

/* Meets f: found when it is a running callback's future that still waits,
 * else kept to follow when still waiting and met for the first time. 0, or
 * -1 with an exception. */
static int reach(reach_t *r, pyfut_t *f) {
  if (!still_waits(f)) return 0;
  dp_error_t e;
  size_t before = dp_ptrset_count(r->seen), at;
  if (dp_ptrset_add(r->seen, (dp_device_t){DP_DEVICE_CPU, 0}, f, 1, &at, &e)) return dpy_raise(e.code, &e), -1;
  if (at < r->k) r->found = 1, r->at = at;
  if (r->found || dp_ptrset_count(r->seen) == before) return 0;
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 16;
    pyfut_t **grown = PyMem_Realloc(r->stack, cap * sizeof *grown);
    if (!grown) return PyErr_NoMemory(), -1;
    r->stack = grown;
    r->cap = cap;
  }
  r->stack[r->n++] = f;
  return 0;
}

/* 1 when self completes only once a then() callback running on this thread
 * returns, 2 when only once the walk of a result this thread is walking
 * returns (a wait from the value's code: its set_result's future, or a
 * then() or collect_all of it); 0 when not; -1 with an exception. Each
 * future is followed once. */
static int waits_for_running(pyfut_t *self) {
  reach_t r = {0};
  dp_error_t e;
  if (dp_ptrset_new(&r.seen, &e)) return dpy_raise(e.code, &e), -1;
  int rc = 0;
  for (running_t *x = running; x && !rc; x = x->outer)
    if (dp_ptrset_add(r.seen, (dp_device_t){DP_DEVICE_CPU, 0}, x->child, 1, NULL, &e)) rc = (dpy_raise(e.code, &e), -1);
  r.kcb = dp_ptrset_count(r.seen);
  /* a collect_all future being walked may still be completed by its inputs
     meanwhile: nothing waits for its walk */
  for (walking_t *x = walking; x && !rc; x = x->outer)
    if (!x->f->inputs && dp_ptrset_add(r.seen, (dp_device_t){DP_DEVICE_CPU, 0}, x->f, 1, NULL, &e))
      rc = (dpy_raise(e.code, &e), -1);
  r.k = dp_ptrset_count(r.seen);
  if (!rc) rc = reach(&r, self);
  while (!rc && !r.found && r.n) {
    pyfut_t *f = r.stack[--r.n];
    if (f->parent) rc = reach(&r, f->parent);
    for (Py_ssize_t i = 0; !rc && !r.found && f->inputs && i < PyTuple_GET_SIZE(f->inputs); i++)
      rc = reach(&r, (pyfut_t *)PyTuple_GET_ITEM(f->inputs, i));
  }
  PyMem_Free(r.stack);
  dp_ptrset_free(r.seen);
  return rc ? rc : !r.found ? 0 : r.at < r.kcb ? 1 : 2;
}

/* How long wait() blocks between two looks at the signal handlers. */
#define WAIT_SLICE_NS 50000000 /* 50 ms */

/* Blocks (without the GIL, in slices that run the signal handlers) until
 * self is complete, refusing a wait that could never return. 0 when
 * complete (*joined: the wait that saw it complete also joined the current
 * streams), or -1 with an exception (an interrupt, a refused wait): self's
 * own outcome is not raised here. */
static int wait_done(pyfut_t *self, int *joined) {
  dp_error_t e;
  int rc;
  *joined = 0;
  self->used = 1;
  if (self->walker && self->walker == PyThread_get_thread_ident() && !self->inputs && !dp_future_is_done(self->f)) {
    /* called by the value's own code (a __reduce__) while this thread walks
       the result self is to complete with: nothing else may complete it
       meanwhile (it is claimed), so the wait would never return. A
       collect_all future's inputs may still complete it: it waits. */
    PyErr_SetString(PyExc_RuntimeError, "wait() on a Future from inside the walk of its own result (a __reduce__ or "
                                        "other code of the value's, on the thread completing it): it would wait "
                                        "forever");
    return -1;
  }
  if ((running || walking) && !dp_future_is_done(self->f)) {
    int w = waits_for_running(self);
    if (w < 0) return -1;
    if (w) {
      dp_error_t e;
      dp_error_clear(&e);
      e.code = DP_EMISUSE;
      snprintf(e.message, sizeof e.message, "%s",
               w == 1 ? "wait() in a then() callback on a Future that completes only once a then() callback running "
                        "on this thread returns (that callback's own Future, or one that waits for it through then() "
                        "parents and collect_all inputs): it would wait forever"
                      : "wait() from inside the walk of a Future's result (a __reduce__ or other code of the value's, "
                        "on the thread completing it) on a Future that completes only once that walk returns (a "
                        "then() of it, or one that waits for it through then() parents and collect_all inputs): it "
                        "would wait forever");
      dpy_raise(DP_EMISUSE, &e);
      return -1;
    }
  }
  if (!dp_future_is_done(self->f)) {
    /* blocks without the GIL; joins the (torch) current streams. In
     * slices, taking the GIL between them to run the signal handlers (the
     * main thread's): a Ctrl-C raises KeyboardInterrupt from wait() instead
     * of waiting for a completion that may never come. */
    for (;;) {
      dp_future_t *f = self->f;
      Py_BEGIN_ALLOW_THREADS;
      rc = dp_future_wait(f, WAIT_SLICE_NS, &e);
      Py_END_ALLOW_THREADS;
      if (rc != DP_ETIMEDOUT || dp_future_is_done(self->f)) break;
      if (PyErr_CheckSignals()) return -1;
    }
    /* an error of a future that completed fine is the join's (a stream
       that could not wait on its events): the value is not ready for them */
    if (rc && (!dp_future_is_done(self->f) || (rc != DP_ETIMEDOUT && !dp_future_error(self->f, NULL)))) {
      dpy_raise(rc, &e);
      return -1;
    }
    *joined = rc != DP_ETIMEDOUT; /* else it completed just after the slice ran out: join below */
  }
  return 0;
}

static PyObject *fut_wait(pyfut_t *self, PyObject *unused) {
  (void)unused;
  dp_error_t e;
  int rc, joined;
  if (wait_done(self, &joined)) return NULL;
  if (joined && !self->cupy) return outcome(self);
  cupy_swap_t sw = {0};
  if (self->cupy) {
    dp_device_t devs[DP_CURRENT_STREAM_SLOTS];
    if (cupy_in(devs, future_devices(self->f, devs, DP_CURRENT_STREAM_SLOTS), &sw)) {
      cupy_out(&sw);
      return NULL;
    }
  }
  rc = dp_future_wait(self->f, -1, &e); /* done: joins the current streams */
  cupy_out(&sw);
  /* a fine future's error is the join's: raised, not the value unordered */
  if (rc && (!dp_future_is_done(self->f) || !dp_future_error(self->f, NULL))) return dpy_raise(rc, &e);
  return outcome(self);
}

static PyObject *fut_value(pyfut_t *self, PyObject *unused) {
  (void)unused;
  if (!dp_future_is_done(self->f)) {
    PyErr_SetString(PyExc_RuntimeError, "value() of a Future that is not complete (wait() first)");
    return NULL;
  }
  return outcome(self);
}

static PyObject *fut_done(pyfut_t *self, PyObject *unused) {
  (void)unused;
  return PyBool_FromLong(dp_future_is_done(self->f));
}

/* ---- callbacks ---- */

/* Makes the pool streams the library made current torch's current streams
 * too, so that the callback's kernels run on them. */
typedef struct swap {
  int n;
  int dev[DP_CURRENT_STREAM_SLOTS];
  void *prev[DP_CURRENT_STREAM_SLOTS];
} swap_t;

static void streams_in(dp_future_t *parent, swap_t *sw) {
  sw->n = 0;
  if (!dpy.torch || !dpy.torch->has_cuda) return;
  dp_backend_t *b = NULL;
  size_t n = dp_future_ndevices(parent);
  for (size_t i = 0; i < n && sw->n < DP_CURRENT_STREAM_SLOTS; i++) {
    dp_device_t d = dp_future_device(parent, i);
    dp_stream_t *s;
    if (d.type != DP_DEVICE_CUDA) continue;
    if (!b && dp_backend_get(DP_DEVICE_CUDA, &b, NULL)) return;
    if (dp_current_stream(b, d, &s, NULL)) continue;
    sw->dev[sw->n] = d.index;
    sw->prev[sw->n] = dpy.torch->set_current_stream(d.index, dp_stream_native(s));
    sw->n++;
  }
}

static void streams_out(const swap_t *sw) {
  for (int i = sw->n; i-- > 0;) dpy.torch->set_current_stream(sw->dev[i], sw->prev[i]);
}

#define CALLBACK_ERROR "Got the following error when running the callback: "

/* The message of the RuntimeError a then() child fails with when its
 * callback raised `cause` (a new reference; NULL with an exception):
 * CALLBACK_ERROR, cause's type and text, as torch words it. A text that
 * already begins with CALLBACK_ERROR (a callback re-raised its failed
 * parent's error, or a torch future's) is the message as it is, the same
 * string: wrapped again at every link, a chain of n re-raising callbacks
 * would hold n messages of up to n wrappers each (quadratic); as it is, the
 * message stays the wrapper and the first cause once, and each link's type
 * is in the __cause__ chain. */
static PyObject *callback_error_text(PyObject *cause) {
  PyObject *text = PyObject_Str(cause);
  if (!text) { /* a RuntimeError still, as torch's, whatever its __str__ does */
    PyErr_Clear();
    return PyUnicode_FromFormat(CALLBACK_ERROR "%s: <exception str() failed>", _PyType_Name(Py_TYPE(cause)));
  }
  if (PyUnicode_GET_LENGTH(text) == 0) { /* as torch words it */
    Py_DECREF(text);
    return PyUnicode_FromFormat(CALLBACK_ERROR "%s: <EMPTY MESSAGE>", _PyType_Name(Py_TYPE(cause)));
  }
  PyObject *words = PyUnicode_FromString(CALLBACK_ERROR);
  Py_ssize_t wrapped = words ? PyUnicode_Tailmatch(text, words, 0, PY_SSIZE_T_MAX, -1) : -1;
  Py_XDECREF(words);
  if (wrapped < 0) {
    Py_DECREF(text);
    return NULL;
  }
  if (wrapped) return text;
  Py_SETREF(text, PyUnicode_FromFormat(CALLBACK_ERROR "%s: %U", _PyType_Name(Py_TYPE(cause)), text));
  return text;
}

/* Completes a then() child (claimed: completing set) from inside its
 * callback, with the pool streams still current: with the callback's
 * result r (stolen), walked afresh, or, r NULL, with the exception raised
 * (cleared). No Python exception is left set. */
static void complete_child(pyfut_t *child, PyObject *r) {
  dp_error_t e;
  if (!r) {
    /* as torch does: the child fails with a RuntimeError naming what the
     * callback raised (kept as its __cause__) */
    keep_raised(child);
    PyObject *cause = child->exc;
    PyObject *wrapped = callback_error_text(cause);
    PyObject *exc = wrapped ? PyObject_CallOneArg(PyExc_RuntimeError, wrapped) : NULL;
    Py_XDECREF(wrapped);
    if (exc) {
      PyException_SetCause(exc, Py_NewRef(cause));
      set_exc(child, exc);
    } else {
      PyErr_Clear();
    }
    e = py_failure("the then() callback failed with a Python exception");
    dp_future_set_error(child->f, &e, NULL);
    return;
  }
  dpy_scanner_t *s;
  if (walk_value(child, r, &s, 0)) {
    PyObject *exc = fetch_raised();
    set_exc(child, walk_failure(exc));
    Py_DECREF(exc);
    Py_DECREF(r);
    e = py_failure("the then() callback's result cannot be walked (WalkError)");
    dp_future_set_error(child->f, &e, NULL);
    return;
  }
  Py_XSETREF(child->result, r);
  if (!s) {
    PyObject *ok = empty_ptrs_complete(child);
    if (!ok) PyErr_Clear(); /* it failed the child */
    Py_XDECREF(ok);
    return;
  }
  /* an interrupt there is dropped, as the callback's own is: the child
     fails (with the refusal) and nobody is interrupted */
  Py_XDECREF(paths_where_refused(child, r, s));
  child->cupy = dpy_scanner_saw_cupy(s);
  /* the events go on the pool streams, current for the callback; a
   * failure (a device outside the child's list) fails the child with it */
  dp_future_mark_completed_with_ptrs(child->f, dp_none(), dpy_scanner_ptrs(s), &e);
  dpy_scanner_put(s);
}

/* Runs a then() or add_done_callback() callback. The then() child is a
 * future of its own (made by chain(), never NULL while anyone can see it),
 * which this completes itself, unless it was claimed first — by its own
 * set_result or set_exception, on any thread, finished or still walking:
 * the first completion stands, and the callback's outcome is reported.
 * The library's own child of the parent is a placeholder that completes
 * with nothing. */
static int then_cb(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)result; /* the library's placeholder child: the Python child is completed below */
  then_ud_t *u = ud;
  PyGILState_STATE g = PyGILState_Ensure();
  if (u->dead) { /* its collect_all future went pending: nothing to run (cancel_unarmed) */
    if (u->dead == 1) u->dead = 3;
    else PyMem_RawFree(u);
    PyGILState_Release(g);
    return 0;
  }
  /* the library may call this while an exception is being raised: a
     pending future dropped as a frame unwinds fails its then() children
     from its dealloc, and their callbacks run there. The callback runs
     with none set (Python code must not start with one), and the
     exception is put back as it was */
  PyObject *raised_type, *raised, *raised_tb;
  PyErr_Fetch(&raised_type, &raised, &raised_tb);
  /* a collect_all future its inputs completed: held by them until now,
     and by its callbacks from here (the first to run arms them all) */
  if (!u->armed) claim(u->parent);
  /* until the child is complete, a wait on it here would wait for itself */
  running_t me = {u->child, running};
  if (u->child) running = &me;
  swap_t sw = {0};
  PyObject *r;
  if (ptrs) {
    streams_in(parent, &sw);
    r = PyObject_CallOneArg(u->callback, (PyObject *)u->parent);
  } else { /* the library could not set the callback's streams up: it does not run, the child fails */
    PyErr_Format(PyExc_RuntimeError, "the callback could not run: %s", err->message);
    r = NULL;
  }
  pyfut_t *child = u->child;
  if (child && (child->completing || dp_future_is_done(child->f))) {
    if (r) {
      Py_DECREF(r);
      PyErr_SetString(PyExc_RuntimeError, "a then() callback's result was dropped: its future had already been "
                                          "completed (set_result or set_exception on it)");
    }
    PyErr_WriteUnraisable(u->callback);
  } else if (!child) { /* add_done_callback: the result is dropped, an error reported */
    if (!r) PyErr_WriteUnraisable(u->callback);
    Py_XDECREF(r);
  } else {
    claim(child); /* a set_result on it meanwhile (the walk runs Python code) is refused */
    complete_child(child, r);
  }
  if (sw.n) streams_out(&sw);
  if (u->child) {
    running = me.outer;
    u->child->parent = NULL; /* u's reference to it goes */
  }
  Py_DECREF(u->callback);
  Py_DECREF(u->parent);
  Py_XDECREF(u->child);
  PyMem_RawFree(u);
  PyErr_Restore(raised_type, raised, raised_tb);
  PyGILState_Release(g);
  return 0;
}

/* A devpickle.Object (what loads made of a function its classes= did not
 * list) is callable, so that an API which tests callable() first takes it
 * and its call says what to list; a callback runs later, where what it
 * raises is a child's failure or, for add_done_callback, unraisable. So
 * then() and add_done_callback refuse it at once, with what its call would
 * say. 1 (an exception set) for an Object, 0 for any other callable, -1. */
static int callback_is_object(PyObject *callback) {
  int is = dpy_is_stand_in(callback);
  if (is <= 0) return is;
  PyObject *r = PyObject_CallNoArgs(callback); /* raises the TypeError that names what to list */
  if (r) { /* not reached: an Object's call always raises */
    Py_DECREF(r);
    PyErr_SetString(PyExc_TypeError, "the callback must be callable, not a devpickle.Object");
    return 1;
  }
  if (!PyErr_ExceptionMatches(PyExc_TypeError)) return 1;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyErr_Format(PyExc_TypeError, "the callback must be callable: %S", value);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return 1;
}

static PyObject *chain(pyfut_t *self, PyObject *callback, int with_child) {
  if (!PyCallable_Check(callback)) {
    PyErr_Format(PyExc_TypeError, "the callback must be callable, not '%s'", Py_TYPE(callback)->tp_name);
    return NULL;
  }
  if (callback_is_object(callback)) return NULL;
  /* a collect_all future's first callback: its pending inputs hold it */
  if (self->inputs && !self->linked && !self->completing && !dp_future_is_done(self->f) && link_collect(self))
    return NULL;
  self->used = 1;
  then_ud_t *u = PyMem_RawMalloc(sizeof *u);
  pyfut_t *child = with_child ? fut_alloc(&fut_type) : NULL;
  if (!u || (with_child && !child)) {
    PyMem_RawFree(u);
    Py_XDECREF(child);
    return PyErr_NoMemory();
  }
  if (child) {
    /* the parent's devices and opaque types (the callback's result is
     * walked as the parent's was), and a C future of its own, made before
     * the callback can run (at once, when the parent is done) */
    child->track = self->track;
    child->opaque = Py_XNewRef(self->opaque);
    child->chained = 1;
    if (self->ndevices) {
      child->devices = PyMem_Calloc(self->ndevices, sizeof *child->devices);
      if (!child->devices) {
        PyMem_RawFree(u);
        Py_DECREF(child);
        return PyErr_NoMemory();
      }
      memcpy(child->devices, self->devices, self->ndevices * sizeof *child->devices);
      child->ndevices = self->ndevices;
    }
    if (fut_make(child, NULL)) {
      PyMem_RawFree(u);
      Py_DECREF(child);
      return NULL;
    }
  }
  u->callback = Py_NewRef(callback);
  u->child = child ? (pyfut_t *)Py_NewRef(child) : NULL;
  u->parent = self;
  u->prev = u->next = NULL;
  /* borrowed while self is pending and unclaimed (then_ud_t), when
     self's pending inputs hold it if it is a collect_all (link_t); armed
     when self is done already or being completed */
  u->armed = self->completing || dp_future_is_done(self->f);
  u->dead = 0;
  if (u->armed) {
    Py_INCREF(self);
  } else {
    u->next = self->unarmed;
    if (u->next) u->next->prev = u;
    self->unarmed = u;
  }
  if (child) child->parent = self; /* held by u until the callback ran, or cleared when self goes */
  dp_future_t *c;
  dp_error_t e;
  /* may run the callback at once (self already done): it takes the GIL we
   * hold, which is reentrant */
  int rc = dp_future_then_with_ptrs(self->f, then_cb, u, &c, &e);
  if (rc) {
    if (child) child->parent = NULL;
    Py_DECREF(u->callback);
    if (u->armed) Py_DECREF(u->parent);
    else unarmed_unlink(self, u);
    Py_XDECREF(u->child);
    PyMem_RawFree(u);
    Py_XDECREF(child);
    return dpy_raise(rc, &e);
  }
  dp_future_release(c); /* the placeholder: the callback completes our child */
  if (!child) Py_RETURN_NONE;
  return (PyObject *)child;
}

static PyObject *fut_then(pyfut_t *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *cb = one_arg("Future.then", 1, "callback", args, nargs, kwnames);
  return cb ? chain(self, cb, 1) : NULL;
}

static PyObject *fut_add_done_callback(pyfut_t *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  PyObject *cb = one_arg("Future.add_done_callback", 1, "callback", args, nargs, kwnames);
  return cb ? chain(self, cb, 0) : NULL;
}

/* ---- collect_all, wait_all ---- */

/* The TypeError for item i, x, of collect_all's or wait_all's futures: its
 * class by module.qualname (tp_name of a class defined in Python is its name
 * alone: torch's future read "a 'Future'"), and for torch's future what to
 * do instead, since code moving from torch.futures meets it first. */
static void not_a_future(const char *who, Py_ssize_t i, PyObject *x) {
  char head[96];
  snprintf(head, sizeof head, "%s takes devpickle.Future objects; item %zd is", who, i);
  if (dpy_refuse_stand_in(x, head, "")) return;
  PyErr_Clear(); /* not an Object, or not told: named by its class below */
  PyTypeObject *t = Py_TYPE(x);
  PyObject *mod = NULL, *qual = NULL, *name = NULL;
  if (t->tp_flags & Py_TPFLAGS_HEAPTYPE) {
    mod = PyObject_GetAttrString((PyObject *)t, "__module__");
    qual = mod ? PyObject_GetAttrString((PyObject *)t, "__qualname__") : NULL;
    if (qual && PyUnicode_Check(mod) && PyUnicode_Check(qual))
      name = PyUnicode_CompareWithASCIIString(mod, "builtins") ? PyUnicode_FromFormat("%U.%U", mod, qual)
                                                              : Py_NewRef(qual);
    Py_XDECREF(mod);
    Py_XDECREF(qual);
  }
  PyErr_Clear(); /* a class whose names cannot be read is named by tp_name */
  if (!name && !(name = PyUnicode_FromString(t->tp_name))) return;
  int torch_future = dpy_resolve_frameworks() == 0 && dpy.sync_types[1] && PyType_IsSubtype(t, dpy.sync_types[1]);
  PyErr_Clear();
  if (torch_future)
    PyErr_Format(PyExc_TypeError,
                 "%s takes devpickle.Future objects; item %zd is torch's future ('%U'): make it a devpickle.Future "
                 "(the same interface), or use torch.futures' own collect_all and wait_all",
                 who, i, name);
  else
    PyErr_Format(PyExc_TypeError, "%s takes devpickle.Future objects; item %zd is a '%U'", who, i, name);
  Py_DECREF(name);
}

/* arg as a list of Futures and their C futures; who names the caller in
 * errors. */
static PyObject *as_futures(const char *who, PyObject *arg, dp_future_t ***out, Py_ssize_t *n) {
  char head[96];
  snprintf(head, sizeof head, "%s takes an iterable of devpickle.Future objects (a list), not", who);
  if (dpy_refuse_stand_in(arg, head, "")) return NULL; /* iterable through __getitem__, which raises its own */
  if (!Py_TYPE(arg)->tp_iter && !PySequence_Check(arg)) {
    /* named: "'devpickle.Future' object is not iterable" says not what was wanted */
    PyErr_Format(PyExc_TypeError, "%s takes an iterable of devpickle.Future objects (a list), not a '%s'", who,
                 Py_TYPE(arg)->tp_name);
    return NULL;
  }
  PyObject *list = dpy_items(arg, 1, head, "");
  if (!list) return NULL;
  *n = PyList_GET_SIZE(list);
  *out = PyMem_Calloc((size_t)*n + 1, sizeof **out);
  if (!*out) {
    Py_DECREF(list);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < *n; i++) {
    PyObject *x = PyList_GET_ITEM(list, i);
    if (!PyObject_TypeCheck(x, &fut_type)) {
      not_a_future(who, i, x);
      PyMem_Free(*out);
      Py_DECREF(list);
      return NULL;
    }
    (*out)[i] = ((pyfut_t *)x)->f;
  }
  /* only once every item is a future: a refused call collected and waited on
   * nothing, so the futures before the refused item may still be remade */
  for (Py_ssize_t i = 0; i < *n; i++) ((pyfut_t *)PyList_GET_ITEM(list, i))->used = 1;
  return list;
}

/* The opaque types of collect_all's inputs, each once, in the order the
 * inputs name them: its then() children walk what their callbacks make of
 * the inputs' results (collect_all(fs).then(combine)) with them, as a then()
 * child of one of those inputs would. Inputs that share one tuple (or all
 * but those with none) give that tuple; others are merged by identity, each
 * type looked up in a set of the addresses taken (held by the merged list
 * while there): linear in the types, where a scan of the list for each was
 * quadratic (seconds for an opaque= of 60,000 types). A tuple, or NULL for
 * none (or with an exception). */
static PyObject *inputs_opaque(PyObject *list) {
  PyObject *one = NULL;
  Py_ssize_t i;
  for (i = 0; i < PyList_GET_SIZE(list); i++) {
    PyObject *op = ((pyfut_t *)PyList_GET_ITEM(list, i))->opaque;
    if (!op || op == one) continue;
    if (one) break;
    one = op;
  }
  if (i == PyList_GET_SIZE(list)) return Py_XNewRef(one); /* no code ran: one is still held */
  PyObject *types = PyList_New(0), *taken = types ? PySet_New(NULL) : NULL, *last = NULL;
  for (i = 0; taken && i < PyList_GET_SIZE(list); i++) {
    PyObject *op = ((pyfut_t *)PyList_GET_ITEM(list, i))->opaque;
    if (!op || op == last) continue;
    /* held: an allocation may collect garbage, whose finalizers may give the input other types */
    Py_XSETREF(last, Py_NewRef(op));
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(op); j++) {
      PyObject *t = PyTuple_GET_ITEM(op, j), *key = PyLong_FromVoidPtr(t);
      Py_ssize_t before = PySet_GET_SIZE(taken);
      int rc = key ? PySet_Add(taken, key) : -1;
      Py_XDECREF(key);
      if (rc || (PySet_GET_SIZE(taken) != before && PyList_Append(types, t))) {
        Py_CLEAR(types);
        break;
      }
    }
    if (!types) break;
  }
  Py_XDECREF(last);
  if (!taken) Py_CLEAR(types);
  Py_XDECREF(taken);
  if (!types) return NULL;
  Py_SETREF(types, PyList_AsTuple(types));
  return types;
}

PyObject *dpy_collect_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  (void)self;
  PyObject *arg = one_arg("collect_all", 0, "futures", args, nargs, kwnames);
  if (!arg) return NULL;
  dp_future_t **in;
  Py_ssize_t n;
  PyObject *list = as_futures("collect_all", arg, &in, &n);
  if (!list) return NULL;
  pyfut_t *out = fut_alloc(&fut_type);
  if (!out) goto fail;
  if (!(out->inputs = PyList_AsTuple(list))) goto fail;
  if (!(out->opaque = inputs_opaque(list)) && PyErr_Occurred()) goto fail;
  /* its devices: every input's (none listed: the backend's) */
  dp_error_t e;
  int rc = dp_future_collect_all(in, (size_t)n, NULL, &out->f, &e);
  if (rc) {
    dpy_raise(rc, &e);
    goto fail;
  }
  PyMem_Free(in);
  Py_DECREF(list);
  return (PyObject *)out;
fail:
  Py_XDECREF(out);
  PyMem_Free(in);
  Py_DECREF(list);
  return NULL;
}

PyObject *dpy_wait_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  (void)self;
  PyObject *arg = one_arg("wait_all", 0, "futures", args, nargs, kwnames);
  if (!arg) return NULL;
  dp_future_t **in;
  Py_ssize_t n;
  PyObject *list = as_futures("wait_all", arg, &in, &n);
  if (!list) return NULL;
  PyMem_Free(in);
  /* every future completes first, as torch's wait_all waits on
   * collect_all(futures) before it reads a value, and as collect_all here
   * completes only once all its inputs have: a failure raises only then, the
   * first in list order, whatever the order they completed in */
  for (Py_ssize_t i = 0; i < n; i++) {
    int joined;
    if (wait_done((pyfut_t *)PyList_GET_ITEM(list, i), &joined)) {
      Py_DECREF(list);
      return NULL;
    }
  }
  PyObject *values = PyList_New(n);
  for (Py_ssize_t i = 0; values && i < n; i++) {
    PyObject *v = fut_wait((pyfut_t *)PyList_GET_ITEM(list, i), NULL);
    if (!v) Py_CLEAR(values);
    else PyList_SET_ITEM(values, i, v);
  }
  Py_DECREF(list);
  return values;
}

/* ---- introspection ---- */

static PyObject *fut_allocations(pyfut_t *self, PyObject *unused) {
  (void)unused;
  size_t n = dp_future_nptrs(self->f);
  PyObject *l = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; l && i < n; i++) {
    dp_ptr_info_t p;
    dp_future_ptr(self->f, i, &p, NULL);
    PyObject *t = Py_BuildValue("(NNn)", dpy_device_str(p.device), PyLong_FromVoidPtr(p.base), (Py_ssize_t)p.nbytes);
    if (!t) Py_CLEAR(l);
    else PyList_SET_ITEM(l, (Py_ssize_t)i, t);
  }
  return l;
}

static PyObject *fut_devices_used(pyfut_t *self, PyObject *unused) {
  (void)unused;
  size_t n = dp_future_ndevices(self->f);
  PyObject *l = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; l && i < n; i++) {
    PyObject *d = dpy_device_str(dp_future_device(self->f, i));
    if (!d) Py_CLEAR(l);
    else PyList_SET_ITEM(l, (Py_ssize_t)i, d);
  }
  return l;
}

/* Future[T]: one type parameter, as torch's Future (a typing.Generic[T]),
 * which refuses Future[int, str] and Future[()]. */
static PyObject *fut_class_getitem(PyObject *cls, PyObject *arg) {
  Py_ssize_t n = PyTuple_Check(arg) ? PyTuple_GET_SIZE(arg) : 1;
  if (n != 1) {
    PyErr_Format(PyExc_TypeError, "Too %s arguments for %R; actual %zd, expected 1", n > 1 ? "many" : "few", cls, n);
    return NULL;
  }
  return Py_GenericAlias(cls, arg);
}

static PyMethodDef fut_methods[] = {
    {"set_result", (PyCFunction)(void (*)(void))fut_set_result, METH_FASTCALL | METH_KEYWORDS,
     "set_result($self, /, result)\n--\n\nCompletes the future. The result is walked (unless devices=[]): one event per device it "
     "uses, on that device's current stream. A result that cannot be walked raises WalkError and fails the future "
     "with it. RuntimeError if already complete."},
    {"set_exception", (PyCFunction)(void (*)(void))fut_set_exception, METH_FASTCALL | METH_KEYWORDS,
     "set_exception($self, /, result)\n--\n\nCompletes the future with the exception result (an Exception instance; "
     "anything else is a TypeError); wait() and value() raise it."},
    {"wait", (PyCFunction)fut_wait, METH_NOARGS,
     "wait($self, /)\n--\n\n-> result: blocks (without the GIL) until complete, makes the current streams wait on the result's "
     "events and records its allocations on them; raises the future's exception."},
    {"value", (PyCFunction)fut_value, METH_NOARGS,
     "value($self, /)\n--\n\n-> result of a complete future, without any synchronization; raises its exception."},
    {"done", (PyCFunction)fut_done, METH_NOARGS, "done($self, /)\n--\n\n-> True once complete (with a result or an exception)."},
    {"then", (PyCFunction)(void (*)(void))fut_then, METH_FASTCALL | METH_KEYWORDS,
     "then($self, /, callback)\n--\n\n-> Future: callback(self) runs once self is complete, with pool streams current (waiting on "
     "self's events); the new future completes with its result, walked afresh (with self's opaque types), or "
     "fails, as torch's does, with "
     "RuntimeError(\"Got the following error when running the callback: ...\") whose __cause__ is what it raised "
     "(its text as it is where it already begins with those words: not wrapped again), or with a WalkError if "
     "its result cannot be walked; if self's last reference goes while it is pending, "
     "callback never runs and the new future fails with devpickle.Error (code DP_ECANCELED) — for a "
     "collect_all future, once none of its pending futures that could complete it is held (the cycle "
     "collector finds them)."},
    {"add_done_callback", (PyCFunction)(void (*)(void))fut_add_done_callback, METH_FASTCALL | METH_KEYWORDS,
     "add_done_callback($self, /, callback)\n--\n\ncallback(self) runs once self is complete; its result is ignored and an "
     "exception it raises goes to sys.unraisablehook. It never runs if self's last reference goes while self is "
     "pending (for a collect_all future: once none of its pending futures is held)."},
    {"_allocations", (PyCFunction)fut_allocations, METH_NOARGS,
     "_allocations($self, /)\n--\n\nThe (device, ptr, nbytes) the completed result holds (devices with streams "
     "only)."},
    {"_devices", (PyCFunction)fut_devices_used, METH_NOARGS, "_devices($self, /)\n--\n\nThe devices that have an event."},
    {"__class_getitem__", fut_class_getitem, METH_O | METH_CLASS, "__class_getitem__($type, item, /)\n--\n\nFuture[T]"},
    {NULL},
};

static PyGetSetDef fut_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject fut_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "devpickle.Future",
    .tp_basicsize = sizeof(pyfut_t),
    .tp_dealloc = (destructor)fut_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Future(*, devices=None, opaque=())\n--\n\n"
              "torch.futures.Future's interface, stream-aware for every value.\n\n"
              "devices=None walks each result and tracks every device it uses; devices=[...] also refuses others; "
              "devices=[] walks nothing (a CPU future). opaque: a type or an iterable of types whose instances "
              "the walks of its results (and of its then() callbacks' results) treat as leaves, as scan's "
              "opaque= does: their memory is not tracked.",
    .tp_traverse = (traverseproc)fut_traverse,
    .tp_clear = (inquiry)fut_clear,
    .tp_finalize = (destructor)fut_finalize,
    .tp_weaklistoffset = offsetof(pyfut_t, weakrefs),
    .tp_methods = fut_methods,
    .tp_getset = fut_getset,
    .tp_dictoffset = offsetof(pyfut_t, dict),
    .tp_init = (initproc)fut_init,
    .tp_new = fut_new,
};

int dpy_future_types_init(PyObject *m) {
  if (PyType_Ready(&fut_type)) return -1;
  dpy.sync_types[0] = &fut_type; /* a future inside a value: its attributes only (scan_classify.h, K_SYNC) */
  Py_INCREF(&fut_type);
  return PyModule_AddObject(m, "Future", (PyObject *)&fut_type);
}
