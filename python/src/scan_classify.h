/*
 * scan_classify.h — what a type is to the walk (scan_classify.c): its kind,
 * cached per type and version tag, and what the walk's helpers swallow.
 * The lookup is inlined in the walk's loop: it is here, with the cache.
 */
#ifndef DEVPICKLE_PY_SCAN_CLASSIFY_H
#define DEVPICKLE_PY_SCAN_CLASSIFY_H

#include "ext.h"

#include <stdint.h>

/* ---- what a type is to the walk ---- */
enum {
  K_UNKNOWN = 0,
  K_LEAF,
  K_LIST,
  K_TUPLE,
  K_DICT,
  K_SET,
  K_OBJECT,      /* pickle's defaults: the walk enters __dict__ directly */
  K_NAMEDTUPLE,  /* a tuple subclass with _fields and pickle's defaults */
  K_TORCH,
  K_CUPY,
  K_CAI,         /* __cuda_array_interface__ */
  K_AIF,         /* __array_interface__ without the buffer protocol: cpu memory, then reduced */
  K_AIF_OBJECT,  /* the same, of a class that keeps pickle's defaults: then as K_OBJECT */
  K_BUFFER,      /* the buffer protocol: cpu memory */
  K_DLPACK,
  K_REDUCE,
  K_CFUNC,       /* a builtin function or method: a global, or its __self__'s method */
  K_NPSCALAR,    /* a numpy scalar: a value, not memory (a leaf to the walk) */
  K_STORAGE,     /* a torch storage (typed or untyped): memory, as a tensor's */
  K_SYNC,        /* a future or a CUDA event (dpy.sync_types): its attributes only */
};

typedef struct tcache_ent {
  /* Borrowed, never dereferenced: only compared with a live type's address,
   * beside its version tag. A type freed and another made at its address
   * cannot answer for it: CPython 3.11+ never hands out a version tag twice
   * (its specializing interpreter keeps tags in bytecode caches and relies
   * on that; the counter, once spent, hands out none), and an entry matches only a
   * type with a valid tag equal to the one kept. From 3.12 each
   * interpreter counts its own tags, from the same start: the cache holds
   * one interpreter's types (dpy_tcache_enter). A strong reference kept a
   * walked class — its class attributes, its methods' closures — alive
   * until another type took its slot. */
  PyTypeObject *type;
  unsigned int version;
  uint8_t kind;
  uint8_t no_slots;     /* K_TORCH, K_BUFFER, K_SYNC: copyreg._slotnames(type) was [] (slots are fixed at class
                         * creation) */
} tcache_ent_t;

#define TCACHE_SIZE 512
extern tcache_ent_t tcache[TCACHE_SIZE];

/* The first interrupt or MemoryError a helper of the walk met, kept aside
 * (dpy_clear_error): dpy_scan raises it as it is (dpy_raise_held). */
extern _Thread_local PyObject *held_exc[3];
void dpy_clear_error(void);
int dpy_raise_held(void);

/* The kind of an instance of t whose interface (K_CAI, K_DLPACK) turned
 * out to be none. */
uint8_t dpy_kind_without_iface(PyTypeObject *t);

/* A walk begins and ends: the cache holds one interpreter's types. */
int64_t dpy_tcache_enter(void);
void dpy_tcache_leave(int64_t outer);

/* A type not in the cache: classified and cached (out of line, so that the
 * lookup below stays small enough to inline). */
__attribute__((noinline)) uint8_t dpy_classify_slow(PyTypeObject *t, tcache_ent_t *e);

/* The kind of t, cached per type and version tag (a class changed after it
 * was cached gets a new tag, so the cache never answers for a stale class). */
/* t's cache entry, or NULL when it holds another type or a stale tag. */
static inline tcache_ent_t *tcache_hit(PyTypeObject *t) {
  tcache_ent_t *e = &tcache[((uintptr_t)t >> 4) % TCACHE_SIZE];
  return e->type == t && (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && e->version == t->tp_version_tag ? e : NULL;
}

/* The exact types that are leaves without a cache lookup. */
static inline int plain_leaf(PyTypeObject *t) {
  return t == &PyLong_Type || t == &PyUnicode_Type || t == &PyFloat_Type || t == &_PyNone_Type || t == &PyBool_Type;
}

static inline uint8_t classify(PyTypeObject *t) {
  if (t == &PyList_Type) return K_LIST;
  if (t == &PyTuple_Type) return K_TUPLE;
  if (t == &PyDict_Type) return K_DICT;
  if (plain_leaf(t)) return K_LEAF;
  tcache_ent_t *e = tcache_hit(t);
  return e ? e->kind : dpy_classify_slow(t, &tcache[((uintptr_t)t >> 4) % TCACHE_SIZE]);
}

#endif
