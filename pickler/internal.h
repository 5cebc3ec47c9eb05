/* pickler/internal.h — declarations shared inside the pickler module. */
#ifndef DP_PICKLER_INTERNAL_H
#define DP_PICKLER_INTERNAL_H

#include <stdarg.h>
#include <stdatomic.h>
#include "devpickle.h"

#define DP_UNUSED(x) ((void)(x))
#define DP_LIKELY(x) __builtin_expect(!!(x), 1)
#define DP_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- checked arithmetic: every size, span and offset goes through these ----
 * dp__add_ovf(a, b, &r) and dp__mul_ovf(a, b, &r) store a+b or a*b in r and
 * return nonzero when the exact result does not fit r's type (r then holds
 * the wrapped value: never use it). Type-generic: mixed signed and unsigned
 * operands are computed exactly, then checked against r's type. */
#define dp__add_ovf(a, b, r) __builtin_add_overflow((a), (b), (r))
#define dp__sub_ovf(a, b, r) __builtin_sub_overflow((a), (b), (r))
#define dp__mul_ovf(a, b, r) __builtin_mul_overflow((a), (b), (r))

/* ---- memory: everything goes through the hook ---- */
void *dp__alloc(size_t n);
void *dp__realloc(void *p, size_t osize, size_t nsize);
void dp__free(void *p, size_t n);
/* n * size with overflow check; NULL on overflow or failure. */
void *dp__alloc_array(size_t n, size_t size);
char *dp__strndup(const char *s, size_t n);
/* Grows *arr (element size `size`) to hold at least `need` elements. */
int dp__grow(void **arr, size_t *cap, size_t need, size_t size);
/* dp__grow for an array that may still live inline at `inl`. */
int dp__grow_inl(void **arr, size_t *cap, size_t need, size_t size, const void *inl);
static inline void dp__free_inl(void *arr, size_t cap, size_t size, const void *inl) {
  if (arr != inl) dp__free(arr, cap * size);
}

/* ---- errors ---- */
int dp__err(dp_error_t *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int dp__err_at(dp_error_t *err, int code, int64_t offset, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int dp__verr(dp_error_t *err, int code, int64_t offset, const char *fmt, va_list ap);

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

/* Containers carry the collector's bookkeeping: no allocation at release.
 * gc_state (candidate buffered, trial garbage, ...) and gc_owner are shared between
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
  size_t len, cap;
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
typedef struct dp_attr {
  union {
    char *heap;
    char inl[DP_ATTR_INLINE];
  } n;
  size_t name_len;
  uint64_t hash;
  dp_value_t val;
} dp_attr_t;

static inline const char *dp__attr_name(const dp_attr_t *a) {
  return a->name_len < DP_ATTR_INLINE ? a->n.inl : a->n.heap;
}

typedef struct dp_object {
  dp_cont_t c;
  const char *class_name;   /* stored after inl[inl_cap] */
  size_t class_len;
  size_t len, cap;
  dp_attr_t *attrs;
  uint32_t *index;
  size_t index_cap;
  size_t inl_cap;
  dp_attr_t inl[];
} dp_object_t;

typedef struct dp_tensor {
  dp_heap_t h;
  dp_storage_t *storage;
  uint8_t dtype;
  uint8_t ndim;
  int64_t offset;
  int64_t dims[];  /* shape[ndim] then strides[ndim] */
} dp_tensor_t;

typedef struct dp_custom {
  dp_heap_t h;
  const dp_type_t *type;
  void *obj;
} dp_custom_t;

struct dp_storage {
  _Atomic uint32_t rc;
  dp_device_t device;
  void *base;
  size_t nbytes;
  dp_storage_release_cb release;
  void *ud;
  void *host_data;
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
  return atomic_load_explicit(&((dp_heap_t *)h)->rc, memory_order_relaxed);
}

/* Bytes of str/bytes dict keys hashed on this thread (a test counter). */
extern _Thread_local uint64_t dp__key_bytes_hashed;

/* UTF-8 validation (RFC 3629: no overlongs, no surrogates, <= U+10FFFF). */
int dp__utf8_valid(const char *s, size_t n);
/* Whether s may name a class, type or attribute: non-empty UTF-8 without
 * NUL (names are also handed out as C strings, so a NUL would cut them). */
int dp__name_valid(const char *s, size_t n);

/* Whether n bytes at s hold a 0 byte: eight at a time, for names. */
static inline int dp__has_nul(const void *s, size_t n) {
  const unsigned char *p = s;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    __builtin_memcpy(&x, p + i, 8);
    if ((x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull) return 1;
  }
  for (; i < n; i++)
    if (p[i] == 0) return 1;
  return 0;
}
/* Whether s is an identifier ([A-Za-z_][A-Za-z0-9_]*) for path rendering. */
int dp__is_identifier(const char *s, size_t n);

/* Appends a JSON string literal (quoted, escaped) to buf; truncates safely. */
size_t dp__json_quote(char *buf, size_t cap, size_t pos, const char *s, size_t n);

/* Reduced-object helpers: the state stored in a stand-in object. */
dp_value_t dp__reduced_state(dp_value_t obj);

#endif
