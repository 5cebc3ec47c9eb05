/*
 * scan_state.c — the scanner's frames, its memo and the allocations a walk
 * finds (scan_state.h).
 */
#include "scan_state.h"
#include "scan_path.h"
#include "../../pickler/ptrs.h"

#include <string.h>

/* ---- allocations ---- */

static int note_path(dpy_scanner_t *s, size_t index) {
  if (!s->want_paths || index < s->npaths) return 0;
  if (s->npaths == s->paths_cap) {
    size_t cap = s->paths_cap ? 2 * s->paths_cap : 64;
    size_t *pa = PyMem_Realloc(s->path_at, cap * sizeof *pa);
    if (!pa) return -1;
    s->path_at = pa;
    s->paths_cap = cap;
  }
  buf_t b = {s->text, s->text_len, s->text_cap};
  size_t at = b.n;
  int rc = dpy_render_path(s, &b);
  s->text = b.p;
  s->text_cap = b.cap;
  if (rc) return -1;
  s->text_len = b.n + 1; /* keep the NUL */
  s->path_at[s->npaths] = at;
  s->npaths++;
  return 0;
}

/* `counted`: the objects counted on allocations met with more than two,
 * each with the allocation it was counted on (entries in the order
 * entered, found through the library's table: core/table.h). An object's
 * address is the allocator's choice, hashed as the library hashes local
 * addresses; the allocation's index is mixed in first. */
static inline uint64_t counted_hash(PyObject *o, size_t alloc) {
  return dp__hash_ptr((const void *)((uintptr_t)o ^ (uintptr_t)((uint64_t)alloc * 0x9E3779B97F4A7C15u)));
}

static uint64_t counted_hash_at(const void *ctx, size_t i) {
  const dpy_scanner_t *s = ctx;
  return counted_hash(s->counted[i].obj, s->counted[i].alloc);
}

static inline int counted_eq(const void *ctx, size_t i, const void *key) {
  const struct dpy_counted *e = &((const dpy_scanner_t *)ctx)->counted[i], *k = key;
  return e->obj == k->obj && e->alloc == k->alloc;
}

/* Enters o (a new reference, stolen), found on allocation alloc, in
 * `counted`: 1 when it was there, 0, or -1 with an exception. The key is
 * the object and the allocation: an object counted on one allocation is
 * not thereby counted on another (a sparse or per-channel quantized
 * tensor, a tensor whose storage the value's code swapped meanwhile). */
static int counted_before(dpy_scanner_t *s, size_t alloc, PyObject *o) {
  const struct dpy_counted key = {o, alloc};
  const uint64_t h = counted_hash(o, alloc);
  size_t j;
  if (dp__table_find(&s->counted_tab, DP_TABLE_TAGGED, h, counted_eq, s, &key, &j) != DP_TABLE_NONE) {
    Py_DECREF(o);
    return 1;
  }
  if (s->ncounted == s->counted_cap) {
    size_t cap = s->counted_cap ? 2 * s->counted_cap : 32;
    struct dpy_counted *c = cap <= PY_SSIZE_T_MAX / sizeof *c ? PyMem_Realloc(s->counted, cap * sizeof *c) : NULL;
    if (!c) {
      Py_DECREF(o);
      PyErr_NoMemory();
      return -1;
    }
    s->counted = c;
    s->counted_cap = cap;
  }
  if (dp__table_full(&s->counted_tab)) {
    int rc = dp__table_grow(&s->counted_tab, DP_TABLE_TAGGED, s->ncounted, 64, counted_hash_at, s);
    if (rc) {
      Py_DECREF(o);
      if (rc == DP_ENOMEM) PyErr_NoMemory();
      else PyErr_Format(PyExc_OverflowError, "devpickle: more objects on shared allocations than refs can count (%zu)",
                        s->ncounted);
      return -1;
    }
    j = dp__table_empty_slot(&s->counted_tab, DP_TABLE_TAGGED, h);
  }
  s->counted[s->ncounted] = key;
  dp__table_put(&s->counted_tab, DP_TABLE_TAGGED, j, h, s->ncounted);
  s->ncounted++;
  return dpy_keep(s, o) ? 0 : -1; /* alive until the walk ends: its address stays its own */
}

/* Room in first, second and refs for allocation idx. 0, or -1 with an
 * exception. */
static int first_grow(dpy_scanner_t *s, size_t idx) {
  size_t cap = s->first_cap ? 2 * s->first_cap : 64;
  while (cap <= idx) cap *= 2;
  PyObject **f = PyMem_Realloc(s->first, cap * sizeof *f);
  if (f) s->first = f;
  PyObject **f2 = f ? PyMem_Realloc(s->second, cap * sizeof *f2) : NULL;
  if (f2) s->second = f2;
  uint32_t *r = f2 ? PyMem_Realloc(s->refs, cap * sizeof *r) : NULL;
  if (!r) {
    PyErr_NoMemory();
    return -1;
  }
  s->refs = r;
  s->first_cap = cap;
  return 0;
}

/* account() for an allocation met before (idx < nfirst). */
static int account_again(dpy_scanner_t *s, size_t idx, PyObject *obj) {
  if (idx > s->nfirst) { /* an allocation not accounted: a bug of this file's, never the value's */
    Py_DECREF(obj);
    PyErr_Format(PyExc_SystemError, "devpickle: allocation %zu counted before allocation %zu", idx, s->nfirst);
    return -1;
  }
  PyObject *f = s->first[idx];
  if (f) { /* not yet in `counted`: it holds one or two objects */
    if (f == obj || s->second[idx] == obj) {
      Py_DECREF(obj);
      return 0;
    }
    if (!s->second[idx]) {
      s->second[idx] = obj;
      s->refs[idx]++;
      return 0;
    }
    PyObject *f2 = s->second[idx];
    s->first[idx] = s->second[idx] = NULL;
    if (counted_before(s, idx, f) < 0) {
      Py_DECREF(f2);
      Py_DECREF(obj);
      return -1;
    }
    if (counted_before(s, idx, f2) < 0) {
      Py_DECREF(obj);
      return -1;
    }
  }
  int c = counted_before(s, idx, obj); /* takes it */
  if (c < 0) return -1;
  if (!c) s->refs[idx]++;
  return 0;
}

/* Counts obj on allocation idx (count_refs), taking the reference to obj
 * it is given (a batch's, or one made for the call). A tensor skips the
 * memo, so one met again reaches here again; but it then finds its
 * allocation in the set already. So a new allocation just holds its first
 * object and counts one; one met again compares with the (at most two)
 * objects it holds, and only a third distinct object moves them to
 * `counted`, which every later object of that allocation asks. Held
 * objects keep their addresses their own until the walk ends. 0, or -1
 * with an exception. */
static inline __attribute__((always_inline)) int account(dpy_scanner_t *s, size_t idx, PyObject *obj) {
  if (idx != s->nfirst) return account_again(s, idx, obj); /* allocations are numbered in discovery order */
  if (idx >= s->first_cap && first_grow(s, idx)) {
    Py_DECREF(obj);
    return -1;
  }
  s->first[idx] = obj;
  s->second[idx] = NULL;
  s->refs[idx] = 1;
  s->nfirst = idx + 1;
  return 0;
}

void dpy_refs_reset(dpy_scanner_t *s) {
  for (int i = 0; i < s->npend; i++) Py_CLEAR(s->pend_obj[i]);
  s->npend = 0;
  size_t n = s->nfirst;
  s->nfirst = 0;
  for (size_t i = 0; i < n; i++) {
    Py_CLEAR(s->first[i]);
    Py_CLEAR(s->second[i]);
  }
  dp__table_clear(&s->counted_tab, DP_TABLE_TAGGED); /* a new generation: no slot is touched */
  s->ncounted = 0;
}

int dpy_flush_pending(dpy_scanner_t *s) {
  int n = s->npend, rc = 0;
  if (!n) return 0;
  dp_error_t e;
  size_t idx[sizeof s->pend / sizeof s->pend[0]];
  rc = dp_ptrset_add_many(s->found, s->pend, (size_t)n, s->count_refs ? idx : NULL, &e);
  if (rc) dpy_raise(rc, &e);
  for (int i = 0; i < n && s->count_refs; i++) {
    PyObject *o = s->pend_obj[i];
    s->pend_obj[i] = NULL;
    if (rc) Py_DECREF(o);
    else rc = account(s, idx[i], o); /* takes the batch's reference */
  }
  s->npend = 0;
  return rc ? -1 : 0;
}

/* Adds an allocation found on obj, at once: *at (may be NULL) gets its
 * index, and its first path is rendered. */
int dpy_add_alloc_at(dpy_scanner_t *s, dp_device_t dev, void *base, size_t nbytes, PyObject *obj, size_t *at) {
  size_t idx;
  dp_error_t e;
  if (dpy_flush_pending(s)) return -1;
  int rc = dp_ptrset_add(s->found, dev, base, nbytes, &idx, &e);
  if (rc) {
    dpy_raise(rc, &e);
    return -1;
  }
  if (note_path(s, idx)) {
    PyErr_NoMemory();
    return -1;
  }
  if (s->count_refs && account(s, idx, Py_NewRef(obj))) return -1;
  if (at) *at = idx;
  return 0;
}

/* 1 when obj was entered before (a shared reference or a cycle), 0 the
 * first time. */
int dpy_seen_at(dpy_scanner_t *s, PyObject *obj, size_t *at) {
  size_t before = dp_ptrset_count(s->memo), idx;
  dp_error_t e;
  int rc = dp_ptrset_add(s->memo, (dp_device_t){DP_DEVICE_CPU, 0}, obj, 0, &idx, &e);
  if (rc) {
    dpy_raise(rc, &e);
    return -1;
  }
  *at = idx;
  /* Python code run during the walk — the value's own or any other (a
   * garbage collection's finalizers) — may free an entered object, and a
   * new one at its address would pass for it: every entered object is kept
   * alive until the walk ends. */
  if (idx >= before && !dpy_keep(s, Py_NewRef(obj))) return -1;
  return idx < before;
}

int dpy_seen(dpy_scanner_t *s, PyObject *obj) {
  size_t at;
  return dpy_seen_at(s, obj, &at);
}

PyObject *dpy_keep(dpy_scanner_t *s, PyObject *o) {
  if (!o) return NULL;
  if (!s->keep) {
    if (!(s->keep = PyList_New(0))) {
      Py_DECREF(o);
      return NULL;
    }
    /* out of the collector's sight: gc.get_referrers() would hand it to the
       value's code, which could empty it and free what the walk holds only
       here (a namedtuple's _fields its frame reads, memo entries whose
       addresses a new object could then take). Nothing refers to it but
       the scanner, so it is never part of a cycle. */
    PyObject_GC_UnTrack(s->keep);
  }
  int rc = PyList_Append(s->keep, o);
  Py_DECREF(o);
  return rc ? NULL : o;
}

/* Pushes a frame iterating obj: the parts of an object of type owner (its
 * __dict__, its reduce, its set's items), which a too-deep error names. */
int dpy_push(dpy_scanner_t *s, uint8_t kind, PyObject *obj, PyTypeObject *owner) {
  if (s->nframes >= s->max_depth) {
    PyErr_Format(PyExc_RecursionError, "nesting deeper than %u levels", s->max_depth);
    return dpy_walk_error_type(s, owner, "too deep");
  }
  if (s->nframes == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 64;
    frame_t *f = PyMem_Realloc(s->frames, cap * sizeof *f);
    if (!f) {
      PyErr_NoMemory();
      return -1;
    }
    s->frames = f;
    s->cap = cap;
  }
  frame_t *f = &s->frames[s->nframes++];
  memset(f, 0, sizeof *f);
  f->kind = kind;
  f->obj = Py_NewRef(obj); /* Python code run by the walk may drop the caller's references */
  f->idx = -1;
  if (kind == FR_DICT || kind == FR_ATTRS) f->dsize = PyDict_GET_SIZE(obj);
  if (kind == FR_ATTRS) f->type = (PyTypeObject *)Py_NewRef((PyObject *)owner); /* an error names it */
  return 0;
}

int dpy_push_set(dpy_scanner_t *s, PyObject *items, PyObject *set) {
  if (dpy_push(s, FR_SET, items, Py_TYPE(set))) return -1;
  frame_t *f = &s->frames[s->nframes - 1];
  f->value = Py_NewRef(set); /* its size is checked at each step, as pickle checks it */
  f->dsize = PySet_GET_SIZE(set);
  return 0;
}

void dpy_frame_drop(frame_t *f) {
  if (f->ks) { /* a key's step was rendered (rare) */
    Py_CLEAR(f->ks->key);
    PyMem_Free(f->ks);
    f->ks = NULL;
  }
  Py_CLEAR(f->obj);
  Py_CLEAR(f->type);
  Py_CLEAR(f->label);
  Py_CLEAR(f->value);
}
