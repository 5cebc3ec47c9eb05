/* value/internal.h — the value model's layout, shared by the value module
 * and, read-only, by the pickler above it (the walker reads containers
 * directly). */
#ifndef DP_VALUE_INTERNAL_H
#define DP_VALUE_INTERNAL_H

#include "../core/internal.h"
#include "devpickle/value.h"

/* ---- heap objects ---- */
enum { DP_GC_NONE = 0, DP_GC_GRAY, DP_GC_BLACK, DP_GC_DEAD };
enum {
  DP_HEAP_REDUCED = 1,  /* object stand-in for a custom */
  DP_HEAP_OPEN = 2,     /* container still being filled by the unpickler */
};

typedef struct dp_heap {
  _Atomic uint32_t rc;
  uint8_t kind;
  uint8_t color;   /* trial colour; containers only, under the gc lock */
  uint16_t flags;
} dp_heap_t;

/* Containers carry the collector's bookkeeping: a release needs no
 * allocation (a candidate buffer may grow, but one that cannot is collected
 * as it is). gc_state (candidate buffered, trial garbage, ...; above its low
 * byte, the candidate's slot in its buffer) and gc_owner are shared between
 * threads; the other fields belong to the running trial (under the gc lock)
 * or to the thread freeing the container. See gc.c. */
typedef struct dp_cont {
  dp_heap_t h;
  uint32_t gc_refs;
  _Atomic uint32_t gc_state;
  struct dp_cont *gc_next;   /* dead list, free list, alive stack */
  struct dp_cont *gc_next2;  /* visit list */
  struct gc_tls *gc_owner;   /* the thread buffer holding it, while GCS_BUFFERED */
} dp_cont_t;

typedef struct dp_strobj {
  dp_heap_t h;
  size_t len;
  /* The keyed hash of the bytes (a str or bytes is immutable), computed the
   * first time it is hashed as a dict key, 0 until then: a key that holds
   * one long str many times, or is used in many dicts, reads its bytes
   * once. Relaxed atomics: racing threads store the same value. */
  _Atomic uint64_t hash;
  char data[];
} dp_strobj_t;

/* Containers are allocated with room for their first `inl_cap` elements
 * after the header: one allocation and one cache miss until they outgrow
 * it, when the elements move to a separate array. */
typedef struct dp_seq {
  dp_cont_t c;
  size_t len;
  union {
    size_t cap;          /* list: room in items */
    /* tuple (its items always inline, len of them): its key word once it
     * is part of a dict key, 0 before (dp__key_word). A tuple in a key
     * never changes (value.h), so a key used again costs its direct items,
     * not its tree. Relaxed atomics: racing threads store the same word. */
    _Atomic uint64_t key;
  };
  dp_value_t *items;   /* inl, or a separate array once grown */
  size_t inl_cap;
  dp_value_t inl[];
} dp_seq_t;

typedef struct dp_entry {
  dp_value_t key;
  dp_value_t val;
  uint64_t hash;
} dp_entry_t;

typedef struct dp_dict {
  dp_cont_t c;
  size_t len, cap;
  dp_entry_t *entries;
  uint32_t *index;      /* open addressing: entry + 1, 0 empty; NULL while small */
  size_t index_cap;
  size_t inl_cap;
  dp_entry_t inl[];
} dp_dict_t;

/* Attribute names up to 15 bytes live in the attribute itself: objects
 * then cost no allocation per attribute. */
#define DP_ATTR_INLINE 16
/* The value first: a scan reads an attribute's value, not its name. */
typedef struct dp_attr {
  dp_value_t val;
  union {
    char *heap;
    char inl[DP_ATTR_INLINE];
  } n;
  size_t name_len;
  uint64_t hash;
} dp_attr_t;

static inline const char *dp__attr_name(const dp_attr_t *a) {
  return a->name_len < DP_ATTR_INLINE ? a->n.inl : a->n.heap;
}

/* What a scan reads (len, attrs, then the first attribute's value) comes
 * first: an object it walks spans two lines where it can. */
typedef struct dp_object {
  dp_cont_t c;
  size_t len;
  dp_attr_t *attrs;
  const char *class_name;   /* stored after inl[inl_cap] */
  size_t class_len;
  size_t cap;
  uint32_t *index;
  size_t index_cap;
  size_t inl_cap;
  dp_attr_t inl[];
} dp_object_t;

/* Bytes of an object with room for inl_cap attributes and its class name. */
static inline size_t dp__object_size(size_t inl_cap, size_t class_len) {
  return sizeof(dp_object_t) + inl_cap * sizeof(dp_attr_t) + class_len + 1;
}

typedef struct dp_tensor {
  dp_heap_t h;
  /* The storage's base, size and device, copied (a storage's never change):
   * a scan reads the tensor's first 28 bytes alone, not its storage too. */
  void *sbase;
  size_t snbytes;
  uint8_t dtype;
  uint8_t ndim;
  dp_device_t sdevice;
  dp_storage_t *storage;
  int64_t offset;
  int64_t dims[];  /* shape[ndim] then strides[ndim] */
} dp_tensor_t;

typedef struct dp_custom {
  dp_heap_t h;
  const dp_type_t *type;
  void *obj;
  struct dp_custom *next_dead;  /* gc.c: queued for its destroy */
} dp_custom_t;

struct dp_storage {
  _Atomic uint32_t rc;
  dp_device_t device;
  /* Made by the reader from a frame's descriptor (no bind): base is the
   * sender's address, never memory of this process, and is never read
   * through (an inline pickle uses the host data, or refuses). */
  uint8_t foreign;
  void *base;
  size_t nbytes;
  dp_storage_release_cb release;
  void *ud;
  void *host_data;
  struct dp_storage *next_dead;  /* gc.c: queued for its release callback */
};

#define DP_H(v) ((v).u.h)
#define DP_SEQ(v) ((dp_seq_t *)(v).u.h)
#define DP_DICT(v) ((dp_dict_t *)(v).u.h)
#define DP_OBJ(v) ((dp_object_t *)(v).u.h)
#define DP_TENSOR(v) ((dp_tensor_t *)(v).u.h)
#define DP_CUSTOM(v) ((dp_custom_t *)(v).u.h)
#define DP_STROBJ(v) ((dp_strobj_t *)(v).u.h)

static inline int dp__is_container_kind(uint32_t k) {
  return k == DP_LIST || k == DP_TUPLE || k == DP_DICT || k == DP_OBJECT;
}
static inline uint32_t dp__rc(const dp_heap_t *h) {
  return dp__load_relaxed(&((dp_heap_t *)h)->rc);
}

/* Bytes of str/bytes dict keys hashed on this thread (a test counter). */
extern _Thread_local uint64_t dp__key_bytes_hashed;
/* Key nodes this thread has walked (hashing, checking, comparing keys) and
 * key bytes it has compared: test counters, so that tests count work
 * instead of timing it. */
extern _Thread_local uint64_t dp__key_nodes_walked;
extern _Thread_local uint64_t dp__key_bytes_compared;
/* Children (leaves too) this thread's cycle trials have looked at: a test
 * counter, as above. */
extern _Thread_local uint64_t dp__gc_items_walked;
/* Pairs of heap nodes this thread's dp_value_equal calls have looked at: a
 * test counter, as above. */
extern _Thread_local uint64_t dp__eq_pairs_walked;

/* A tuple's key word: bits 0-10 its tree's nodes (itself included, at most
 * 1,024), bits 11-16 its levels below it (at most 32), bits 17-63 the top 47
 * bits of its keyed hash. Equal tuples have equal words; 0 means none kept. */
#define DP__KEY_WORD_HASH_SHIFT 17
static inline uint64_t dp__key_word(dp_value_t t) {
  return dp__load_relaxed(&((dp_seq_t *)t.u.h)->key);
}

/* Whether two keys of one kind are known to differ by what they keep: a str
 * or bytes its hash, a tuple its key word. 0: they may be equal. */
static inline int dp__key_kept_differ(dp_value_t a, dp_value_t b) {
  uint64_t x, y;
  if (a.kind == DP_TUPLE) {
    x = dp__key_word(a);
    y = dp__key_word(b);
  } else if (a.kind == DP_STR || a.kind == DP_BYTES) {
    x = dp__load_relaxed(&((dp_strobj_t *)a.u.h)->hash);
    y = dp__load_relaxed(&((dp_strobj_t *)b.u.h)->hash);
  } else {
    return 0;
  }
  return x && y && x != y;
}

/* The hash of values behind dp_value_hash (value.c; dict keys hash with the
 * same leaf hashes and mix, uncut, keeping tuple words). Cut below max_depth
 * levels and after *budget nodes, leaves included. */
uint64_t dp__hash_value(dp_value_t v, int depth, int max_depth, size_t *budget);

/* The one equality of leaves (none, bool, int, float bitwise, str, bytes)
 * of the same kind: dict keys and dp_value_equal. */
static inline int dp__leaf_equal(dp_value_t a, dp_value_t b) {
  switch (a.kind) {
    case DP_NONE: return 1;
    case DP_STR:
    case DP_BYTES:
      return a.u.h == b.u.h || (((dp_strobj_t *)a.u.h)->len == ((dp_strobj_t *)b.u.h)->len &&
                                __builtin_memcmp(((dp_strobj_t *)a.u.h)->data, ((dp_strobj_t *)b.u.h)->data,
                                                 ((dp_strobj_t *)a.u.h)->len) == 0);
    default:
      return a.u.i == b.u.i;  /* bool, int, and float bitwise */
  }
}

/* Reduced-object helpers: the state stored in a stand-in object. */
dp_value_t dp__reduced_state(dp_value_t obj);

#endif
