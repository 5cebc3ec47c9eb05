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

/* Where type t's entries go in a table of 2^bits slots or sets: its
 * address mixed (Fibonacci hashing: the top bits of its product with
 * 2^64/phi). An allocator that aligns types (jemalloc, mimalloc,
 * ThreadSanitizer's: a class 1 KiB apart from the next) leaves their low
 * bits equal, and the address's low bits alone put every class in one
 * slot (each lookup then misses, and runs the classification's Python code
 * again). */
static inline size_t dpy_type_slot(const PyTypeObject *t, unsigned bits) {
  return (size_t)(((uint64_t)(uintptr_t)t * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - bits));
}

/* The kinds: 2^TCACHE_BITS sets of two (two types that share a set do not
 * take turns missing). */
#define TCACHE_BITS 10
extern tcache_ent_t tcache[1u << TCACHE_BITS][2];

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
__attribute__((noinline)) uint8_t dpy_classify_slow(PyTypeObject *t);

/* The kind of t, cached per type and version tag (a class changed after it
 * was cached gets a new tag, so the cache never answers for a stale class). */
/* t's cache entry, or NULL when it holds another type or a stale tag. */
static inline tcache_ent_t *tcache_hit(PyTypeObject *t) {
  tcache_ent_t *set = tcache[dpy_type_slot(t, TCACHE_BITS)];
  if (!(t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return NULL;
  if (set[0].type == t && set[0].version == t->tp_version_tag) return &set[0];
  if (set[1].type == t && set[1].version == t->tp_version_tag) return &set[1];
  return NULL;
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
  return e ? e->kind : dpy_classify_slow(t);
}

/* ---- opaque=: which instances are leaves ---- */

/* isinstance(o, types) answered from o's type, once a type a walk, where
 * isinstance would run no Python code: an item whose metaclass is `type`,
 * or one whose metaclass does not override __instancecheck__ (watched: a
 * change to it is seen), answers by o's type's MRO alone — provided o's
 * __class__ is its type (no __class__ or __getattribute__ of its class's
 * own, nor a C type's getattr: a proxy's __class__ is another's).
 *
 * An ABC (its metaclass's __instancecheck__ and __subclasscheck__ are
 * abc.ABCMeta's, the ABC has no __subclasscheck__ of its own; both
 * watched) is asked once a type a walk, as isinstance asks it: ABCMeta
 * keeps every answer for the type itself, until a register() moves
 * abc.get_cache_token(), which the walk reads before each object (a moved
 * token forgets every answer). From the first other item whose metaclass
 * overrides __instancecheck__ (a typing protocol, nn.Parameter, an ABC
 * past OPAQUE_ABC) on, or for an object whose __class__ isinstance would
 * read, isinstance is called item by item, as isinstance(o, types) calls
 * it: the same answers, the same code run, in the same order.
 *
 * The cache holds types by address, borrowed and never dereferenced, beside
 * their version tag (a class changed during the walk is answered afresh;
 * see tcache_ent_t for why a tag is never reused), and only for the walk
 * (its generation): nothing is kept alive, nothing outlives the call. It
 * forgets nothing else: an open-addressing table (linear probes; an entry
 * of another generation is an empty slot) that doubles past three
 * quarters full — every type met, however many, is answered once a walk
 * (a cache that let a type go would ask an ABC again for it). */
#define OPAQUE_BITS 6 /* the table a walk begins with: 2^6 entries, in the scanner */
#define OPAQUE_WATCH 8
#define OPAQUE_ABC 4
#define OPAQUE_ASK PY_SSIZE_T_MIN        /* dpy_opaque_hit: an ABC must be asked (dpy_opaque_ask) */
#define OPAQUE_ERR (PY_SSIZE_T_MIN + 1)  /* dpy_opaque_ask: an exception is set */

typedef struct dpy_opaque_ent {
  PyTypeObject *type; /* borrowed, compared only */
  unsigned int version, gen;
  /* >= 0: the first item that answers true (n: none does), read without
   * code or an ABC's kept answer; < 0: -1 - the item from which isinstance
   * must be called */
  Py_ssize_t hit;
} dpy_opaque_ent_t;

typedef struct dpy_opaque {
  PyObject *types;     /* the walk's tuple (borrowed: the options hold it), or NULL */
  Py_ssize_t n;
  Py_ssize_t first_code; /* the first item isinstance must ask each time (n: none) */
  int nwatch;          /* the metaclasses of items before it (and ABCs) whose tag is watched (held) */
  PyTypeObject *watch[OPAQUE_WATCH];
  unsigned int watch_tag[OPAQUE_WATCH];
  /* the items before first_code whose metaclass is not `type`, and that
     metaclass: a class's __class__ can be assigned another metaclass (one
     with an __instancecheck__ of its own) by code the walk runs */
  int nmeta;
  Py_ssize_t meta_item[OPAQUE_WATCH];
  PyTypeObject *meta[OPAQUE_WATCH]; /* compared only: each is watched */
  int nabc;            /* ABCs before first_code: their items, in order */
  Py_ssize_t abc[OPAQUE_ABC];
  PyObject *token;     /* abc.get_cache_token() when their answers were kept (held), or NULL */
  unsigned int gen;    /* the walk's: entries of another walk are stale */
  unsigned int bits;   /* the table: 2^bits entries, `used` of them of this generation */
  size_t used;
  dpy_opaque_ent_t *cache; /* inl, or a larger table made for the walk (PyMem) */
  dpy_opaque_ent_t inl[1u << OPAQUE_BITS];
} dpy_opaque_t;

/* A walk with these types (NULL: none) begins (op zeroed, or ended
 * before). 0, or -1 with an exception. */
int dpy_opaque_begin(dpy_opaque_t *op, PyObject *types);
/* A watched type changed: the items are read again. 0, or -1. */
int dpy_opaque_respec(dpy_opaque_t *op);
/* The walk is over: lets go of the watched types and the token. */
void dpy_opaque_end(dpy_opaque_t *op);
/* Whether the ABCs' answers kept still hold (abc.get_cache_token() has not
 * moved): 1, 0 (forgotten now), or -1 with an exception. Runs no Python
 * code. */
int dpy_opaque_token_same(dpy_opaque_t *op);
/* dpy_opaque_hit's answer for a type not in the cache (kept there), or
 * OPAQUE_ERR with an exception (MemoryError: the table could not grow). */
__attribute__((noinline)) Py_ssize_t dpy_opaque_slow(dpy_opaque_t *op, PyTypeObject *t);
/* The answer for o, asking the ABCs (Python code) where dpy_opaque_hit
 * said OPAQUE_ASK; kept for o's type. OPAQUE_ERR with an exception. */
Py_ssize_t dpy_opaque_ask(dpy_opaque_t *op, PyObject *o);

/* Whether a watched type changed, or an item was given another
 * metaclass, since the items were read. Runs no Python code. */
static inline int dpy_opaque_stale(const dpy_opaque_t *op) {
  for (int i = 0; i < op->nwatch; i++)
    if (!(op->watch[i]->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) || op->watch[i]->tp_version_tag != op->watch_tag[i])
      return 1;
  for (int i = 0; i < op->nmeta; i++)
    if (Py_TYPE(PyTuple_GET_ITEM(op->types, op->meta_item[i])) != op->meta[i]) return 1;
  return 0;
}

/* The answer for instances of t (dpy_opaque_ent_t.hit) from the cache, or
 * OPAQUE_ASK, or OPAQUE_ERR with an exception. Runs no Python code. */
/* The slot of t's entry in the table, or of the empty slot (an entry of
 * another generation) where it would go. */
static inline dpy_opaque_ent_t *dpy_opaque_slot(dpy_opaque_t *op, PyTypeObject *t) {
  size_t mask = ((size_t)1 << op->bits) - 1, i = dpy_type_slot(t, op->bits);
  while (op->cache[i].gen == op->gen && op->cache[i].type != t) i = (i + 1) & mask;
  return &op->cache[i];
}

static inline Py_ssize_t dpy_opaque_hit(dpy_opaque_t *op, PyTypeObject *t) {
  const dpy_opaque_ent_t *e = dpy_opaque_slot(op, t);
  if (e->gen == op->gen && (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && e->version == t->tp_version_tag)
    return e->hit;
  return dpy_opaque_slow(op, t);
}

#endif
