/*
 * devpickle/value.h — the value model.
 *
 * OWNERSHIP — one rule for the whole API:
 *   - Constructors (dp_*_new) hand the caller a new reference.
 *   - Functions that store a value or storage into another object STEAL the
 *     caller's reference — even when they fail (the argument is released).
 *     So `dp_list_append(l, v)` never leaks v.
 *   - Getters BORROW: the result is valid while its container holds it.
 *     Call dp_value_retain() to keep it longer. (Two exceptions: an
 *     attribute name from dp_object_attr is valid until the object is next
 *     set, and a storage's host data from dp_storage_host_data until it is
 *     next set; see there.)
 *   - dp_value_release() gives a reference back. Scalars (none, bool, int,
 *     float) hold no reference; retain/release on them do nothing.
 *
 * CYCLES. Containers (list, tuple, dict, object) may form cycles; devpickle
 * frees them by trial deletion (Bacon & Rajan's algorithm). A release that
 * leaves a container's count above zero records it as a candidate in the
 * releasing thread's buffer (256 entries, allocating nothing; a buffer whose
 * previous collection walked more live items (containers and their children)
 * first grows, through the allocator hook, doubling until it holds as many
 * (16,777,216 entries at most) — see COST — and one that cannot grow is
 * collected as it is: a release never fails); a buffer is collected — the
 * containers reachable from its candidates are tried, and those held only
 * by each other freed — when a release finds it full (so a fresh thread's
 * first collection comes with its 257th candidate, not its 256th), when its thread
 * calls dp_value_collect(), and when its thread exits. A garbage cycle thus
 * outlives its last outside reference until one of those happens. Any
 * acyclic container released to zero is freed at once, memory and all, on
 * the releasing thread — whichever thread buffered it.
 * EXIT: thread exit means a thread-specific destructor, which exit() does
 * not run: the main thread, and any thread that ends the process through
 * exit() or a return from main(), must call dp_value_collect() before that
 * for the storage release callbacks and custom destroys of the cyclic
 * garbage it released to run. (No atexit collection is made: it would run
 * those callbacks after other libraries' exit handlers — a device runtime's
 * teardown, say — and while other threads may still run.) The memory goes
 * back with the process either way; a leak checker does not report it,
 * since the buffer still points at it.
 * COST: a collection walks everything reachable from its candidates, live
 * or not. A thread that keeps releasing extra references to the root of a
 * large live graph (retain/release pairs around it, futures holding it)
 * makes it a candidate again and again, and pays a walk of the whole graph
 * per collection (each dp_value_collect(), or once a thread's buffer is
 * full: 256 candidates, or its size grown by doubling to at least as many as
 * the live containers and children its previous collection walked — 512,
 * 1,024, ... up to 16,777,216 — so that the walks cost at most one step per
 * release, for graphs of up to 16,777,216 live items);
 * and while any collection runs, other threads' releases that leave a count
 * above zero wait for it. Hold one reference to such a graph and borrow
 * from it rather than retaining it in hot loops.
 * Customs are opaque to the collector: a cycle that passes through a custom's
 * own C data is the custom's to break in its destroy().
 *
 * THREAD SAFETY. Reference counts are atomic: any thread may retain and
 * release any value, and values may be read (walked, scanned, pickled) from
 * several threads at once. Mutation (append, set) of one container is not
 * thread-safe, and the collector reads containers behind the caller's
 * back: a collection on any thread — its buffer full during any release
 * of a container, dp_value_collect(), its exit — reads the items of every
 * container reachable from its candidates, and a thread's candidates are
 * the containers it released while they were still held elsewhere; they
 * stay candidates after the thread let go, until it collects. So a
 * container may be mutated only while no other thread can reach it: once
 * it has been reachable from another thread (held there, directly or
 * through another container), mutate it again only after that thread has
 * let go of every such reference and then finished a dp_value_collect()
 * (or ended). Otherwise a collection may read an items array that the
 * mutation frees: a use after free, not merely a stale read. In practice:
 * build a value on one thread, then share it and treat it as immutable.
 * Releases take no process-wide lock, except while a collection runs (a
 * release that leaves a count above zero then waits for it) and for a
 * container buffered as a candidate by another thread. Storage release
 * callbacks and custom destroys run under no devpickle lock.
 */
#ifndef DEVPICKLE_VALUE_H
#define DEVPICKLE_VALUE_H

#include <stdbool.h>
#include "base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dp_kind {
  DP_NONE = 0,
  DP_BOOL,
  DP_INT,
  DP_FLOAT,
  DP_STR,
  DP_BYTES,
  DP_LIST,
  DP_TUPLE,
  DP_DICT,
  DP_TENSOR,
  DP_OBJECT,
  DP_CUSTOM,
} dp_kind_t;

#define DP_KIND_COUNT 12

struct dp_heap;

/** A 16-byte tagged value, passed by value. Treat the fields as private;
 *  use the accessors. */
typedef struct dp_value {
  union {
    int64_t i;
    double f;
    struct dp_heap *h;
  } u;
  uint32_t kind;
  uint32_t reserved_;
} dp_value_t;

/* ---- scalars: no reference, nothing to release ---- */
static inline dp_value_t dp_none(void) { dp_value_t v; v.u.i = 0; v.kind = DP_NONE; v.reserved_ = 0; return v; }
static inline dp_value_t dp_bool(bool b) { dp_value_t v; v.u.i = b ? 1 : 0; v.kind = DP_BOOL; v.reserved_ = 0; return v; }
static inline dp_value_t dp_int(int64_t i) { dp_value_t v; v.u.i = i; v.kind = DP_INT; v.reserved_ = 0; return v; }
static inline dp_value_t dp_float(double f) { dp_value_t v; v.u.f = f; v.kind = DP_FLOAT; v.reserved_ = 0; return v; }

static inline dp_kind_t dp_value_kind(dp_value_t v) { return (dp_kind_t)v.kind; }
/* A scalar's content; for a value of another kind base.h's neutral value
 * (false, 0, 0.0): no conversion between kinds (an int is no bool, a bool
 * no int), and never a heap value's address. */
static inline bool dp_value_as_bool(dp_value_t v) { return v.kind == DP_BOOL && v.u.i != 0; }
static inline int64_t dp_value_as_int(dp_value_t v) { return v.kind == DP_INT ? v.u.i : 0; }
static inline double dp_value_as_float(dp_value_t v) { return v.kind == DP_FLOAT ? v.u.f : 0.0; }
static inline bool dp_value_is_heap(dp_value_t v) { return v.kind >= DP_STR; }
/** Identity of a heap value (NULL for scalars): equal pointers, same node. */
static inline const void *dp_value_id(dp_value_t v) { return dp_value_is_heap(v) ? (const void *)v.u.h : (const void *)0; }

/** Lower-case kind name: "none", "list", "tensor", ...; "invalid" for a
 *  number that is no dp_kind_t. */
DP_API const char *dp_kind_name(dp_kind_t kind);

/** New reference to the same value. Thread-safe. Returns v. A count is
 *  32 bits: a retain of a value (or storage) that already holds
 *  4,294,967,295 references aborts the process, naming the kind on
 *  stderr, rather than wrap the count to 0 and free what is held. */
DP_API dp_value_t dp_value_retain(dp_value_t v);
/** Gives back one reference; frees what is no longer reachable, cycles at
 *  the next collection (see CYCLES). Thread-safe (see THREAD SAFETY). */
DP_API void dp_value_release(dp_value_t v);
/** Collects the calling thread's cycle candidates now, and those that
 *  freeing garbage makes (see CYCLES). Candidates buffered by other threads
 *  are collected by those threads. Call it on the main thread before the
 *  process exits, for the callbacks of its cyclic garbage to run (see
 *  CYCLES, EXIT). Thread-safe. */
DP_API void dp_value_collect(void);
/** Current reference count (1 for scalars). For diagnostics and tests. */
DP_API uint32_t dp_value_refcount(dp_value_t v);

/* ---- str and bytes: immutable, length-counted ---- */
/** Copies n bytes of UTF-8 (validated: DP_EINVAL if malformed). The text
 *  (bytes_new: p) may be NULL only when n is 0. */
DP_API int dp_str_new(const char *s, size_t n, dp_value_t *out, dp_error_t *err);
DP_API int dp_bytes_new(const void *p, size_t n, dp_value_t *out, dp_error_t *err);
/** Borrowed pointer and length (len may be NULL); NULL and 0 for a value
 *  of another kind. The str data is NUL-terminated too. */
DP_API const char *dp_str_data(dp_value_t s, size_t *len);
DP_API const uint8_t *dp_bytes_data(dp_value_t b, size_t *len);

/* ---- list and tuple ---- */
/** An empty list with room for capacity items allocated with it (a hint:
 *  it grows past them). DP_EINVAL for a NULL out; DP_ENOMEM, also for a
 *  capacity whose size overflows. */
DP_API int dp_list_new(size_t capacity, dp_value_t *out, dp_error_t *err);
/** Appends (steals item). DP_EINVAL when list is not a list (a tuple has
 *  a fixed length). */
DP_API int dp_list_append(dp_value_t list, dp_value_t item, dp_error_t *err);
/** A tuple of n items, each none until set. Tuples are fixed-length.
 *  Errors as dp_list_new's. */
DP_API int dp_tuple_new(size_t n, dp_value_t *out, dp_error_t *err);
/** Length of a list or tuple (0 for other kinds). */
DP_API size_t dp_seq_len(dp_value_t seq);
/** Borrowed item i of a list or tuple; none when out of range. */
DP_API dp_value_t dp_seq_get(dp_value_t seq, size_t i);
/** Replaces item i of a list or tuple (steals item; releases the old one).
 *  A tuple is filled this way while it is built: one already used as a dict
 *  key (or inside one) must not change — the dict keeps its hash and its
 *  uniqueness, every tuple of the key keeps its own hash for later keys
 *  that hold it, and a frame written from it could hold a key the reader
 *  refuses (unhashable, or a duplicate). DP_EINVAL when seq is not a list
 *  or tuple or i is out of range. */
DP_API int dp_seq_set(dp_value_t seq, size_t i, dp_value_t item, dp_error_t *err);

/* ---- dict: insertion-ordered; keys none/bool/int/float/str/bytes or tuples
 * of those, a tuple key bounded to 1,024 nodes, counted as a tree (a tuple
 * the key holds twice counts twice), and 32 levels below the key
 * (docs/FORMAT.md: a key is walked when hashed and compared). Keys compare by kind and content: int 1 and float 1.0 are
 * different keys; floats compare bitwise (a NaN key finds itself). ---- */
/** An empty dict with room for capacity entries allocated with it (a
 *  hint). Errors as dp_list_new's. */
DP_API int dp_dict_new(size_t capacity, dp_value_t *out, dp_error_t *err);
/** Inserts or replaces (steals key and val); a replaced entry keeps its
 *  position. DP_ETYPE for an unhashable key, DP_EINVAL when dict is not a
 *  dict, DP_ELIMIT for a new key past its 32-bit bound (about 2^32
 *  entries). */
DP_API int dp_dict_set(dp_value_t dict, dp_value_t key, dp_value_t val, dp_error_t *err);
/** Looks key up (borrowed key). 0 and *val borrowed (val may be NULL: a
 *  membership test), or DP_ENOTFOUND (also for an unhashable key);
 *  DP_EINVAL when dict is not a dict. */
DP_API int dp_dict_get(dp_value_t dict, dp_value_t key, dp_value_t *val, dp_error_t *err);
/** Number of entries; 0 for a value of another kind. */
DP_API size_t dp_dict_len(dp_value_t dict);
/** Item i in insertion order (borrowed; key and val may be NULL).
 *  DP_EINVAL when out of range or not a dict. */
DP_API int dp_dict_item(dp_value_t dict, size_t i, dp_value_t *key, dp_value_t *val, dp_error_t *err);
/** Whether a value may be a dict key: a scalar, str or bytes, or an acyclic
 *  tuple of those of at most 1,024 nodes, itself included, counted as a
 *  tree (an item held twice counts twice: a pair of one 600-item tuple is
 *  1,203 nodes), with no node deeper than level 32 (its items are level 1). */
DP_API bool dp_value_is_hashable(dp_value_t key);

/* ---- storage: one allocation ---- */
typedef struct dp_storage dp_storage_t;
/** Called once when the last reference to a storage goes. */
typedef void (*dp_storage_release_cb)(void *ud, dp_device_t device, void *base, size_t nbytes);

/** A storage of nbytes at base on device. base may be any address: walking,
 *  scanning and out-of-band pickling never dereference it; an inline pickle
 *  (DP_PICKLE_INLINE, pickler.h) reads the bytes of a cpu storage at base
 *  unless a read callback or host data is given. release (may be NULL) runs when the storage dies
 *  (queued, as a custom's destroy is, when one of them is already running on
 *  this thread: see dp_type_t). DP_EINVAL for a NULL out or a device that
 *  cannot exist (a type past DP_DEVICE_HOST, or cpu with an index other
 *  than 0), naming it; DP_ENOMEM. When the call fails release is not
 *  called: the memory stays the caller's. */
DP_API int dp_storage_new(dp_device_t device, void *base, size_t nbytes,
                          dp_storage_release_cb release, void *ud,
                          dp_storage_t **out, dp_error_t *err);
/** Counts one more reference (returns s), and drops one: the last runs
 *  its release callback, if any (see dp_storage_new). NULL does nothing. */
DP_API dp_storage_t *dp_storage_retain(dp_storage_t *s);
DP_API void dp_storage_release(dp_storage_t *s);
/** The storage's device, base address and size, as given to
 *  dp_storage_new ({DP_DEVICE_CPU, 0}, NULL and 0 for NULL). */
DP_API dp_device_t dp_storage_device(const dp_storage_t *s);
DP_API void *dp_storage_base(const dp_storage_t *s);
DP_API size_t dp_storage_nbytes(const dp_storage_t *s);
/** Host bytes attached to the storage (an inline frame's copy), or NULL.
 *  Borrowed: valid until the next dp_storage_set_host_data on s, which
 *  frees them, or the storage's end. */
DP_API const void *dp_storage_host_data(const dp_storage_t *s);
/** Attaches a copy of the storage's nbytes host bytes from data (for
 *  inline frames), replacing (and freeing) any attached before. Not
 *  thread-safe on one storage. DP_EINVAL for a NULL s, or a NULL data when
 *  nbytes is above 0; DP_ENOMEM, keeping what was attached. */
DP_API int dp_storage_set_host_data(dp_storage_t *s, const void *data, dp_error_t *err);

/* ---- tensor: a strided view of a storage ---- */
typedef enum dp_dtype {
  DP_BOOL8 = 0, DP_INT8, DP_INT16, DP_INT32, DP_INT64,
  DP_UINT8, DP_UINT16, DP_UINT32, DP_UINT64,
  DP_FLOAT16, DP_BFLOAT16, DP_FLOAT32, DP_FLOAT64,
  DP_COMPLEX64, DP_COMPLEX128,
} dp_dtype_t;
#define DP_DTYPE_COUNT 15
#define DP_TENSOR_MAX_DIMS 16
#define DP_TENSOR_MAX_ELEMENTS (1ll << 62)  /* elements in one non-empty view */

DP_API const char *dp_dtype_name(dp_dtype_t d);       /* "float32"; NULL if unknown */
DP_API int dp_dtype_parse(const char *name, dp_dtype_t *out, dp_error_t *err);  /* DP_EINVAL if unknown */
DP_API size_t dp_dtype_size(dp_dtype_t d);             /* bytes per element; 0 if unknown */

/** A view (steals storage). strides NULL means contiguous (DP_EINVAL when
 *  those strides overflow int64, even for a view with a 0 dimension: give
 *  strides then); strides and offset count elements. Shape entries and the
 *  offset lie in 0..2^63-1, strides in -(2^63-1)..2^63-1 (INT64_MIN is
 *  DP_EINVAL: the format cannot carry it), ndim in 0..DP_TENSOR_MAX_DIMS.
 *  DP_EINVAL unless every addressed element lies inside the storage
 *  (negative strides allowed when they stay inside): with lo and hi the
 *  lowest and highest element index addressed, lo >= 0 and
 *  (hi + 1) * itemsize <= nbytes, computed exactly (a view whose extent
 *  overflows 64 bits is refused). A view with a 0 dimension addresses
 *  nothing and always fits; any other has at most DP_TENSOR_MAX_ELEMENTS
 *  elements. */
DP_API int dp_tensor_new(dp_storage_t *storage, dp_dtype_t dtype, int ndim,
                         const int64_t *shape, const int64_t *strides,
                         int64_t offset, dp_value_t *out, dp_error_t *err);
/* The accessors of a tensor. For a value of another kind they return
 * base.h's neutral values: NULL storage, shape and strides, and 0 for the
 * dtype, ndim and offset — 0 is also DP_BOOL8 and a zero-dimensional
 * tensor's ndim, so check dp_value_kind first. */
DP_API dp_storage_t *dp_tensor_storage(dp_value_t t);  /* borrowed */
DP_API dp_dtype_t dp_tensor_dtype(dp_value_t t);
DP_API int dp_tensor_ndim(dp_value_t t);
DP_API const int64_t *dp_tensor_shape(dp_value_t t);
DP_API const int64_t *dp_tensor_strides(dp_value_t t);
DP_API int64_t dp_tensor_offset(dp_value_t t);

/* ---- object: a user-defined class instance, held generically ----
 * Class and attribute names are non-empty UTF-8 without NUL (they are handed
 * out as C strings); DP_EINVAL otherwise. */
DP_API int dp_object_new(const char *class_name, dp_value_t *out, dp_error_t *err);
/** Sets an attribute (steals val). A new name is appended; an existing one
 *  keeps its position (DP_ELIMIT for a new one past the 32-bit bound,
 *  about 2^32 attributes).
 *  DP_EINVAL when obj is not an object, and for any
 *  name but "__reduce__" on a reduced stand-in (dp_object_is_reduced: a
 *  frame carries only its state, so another attribute would be lost). */
DP_API int dp_object_set(dp_value_t obj, const char *name, dp_value_t val, dp_error_t *err);
/** Borrowed attribute in *val (val may be NULL), or DP_ENOTFOUND;
 *  DP_EINVAL when obj is not an object or name is NULL. */
DP_API int dp_object_get(dp_value_t obj, const char *name, dp_value_t *val, dp_error_t *err);
/** The class name (borrowed: valid while obj lives), and the number of
 *  attributes; NULL and 0 for a value of another kind. */
DP_API const char *dp_object_class(dp_value_t obj);
DP_API size_t dp_object_nattrs(dp_value_t obj);
/** Attribute i in order (borrowed; name and val may be NULL). DP_EINVAL
 *  when out of range or not an object. *name is valid until the next
 *  dp_object_set on obj (which may be given it, or its tail, as the name),
 *  or its end: short names live in the attribute array, which a new
 *  attribute may move (copy the name to keep it). */
DP_API int dp_object_attr(dp_value_t obj, size_t i, const char **name, dp_value_t *val, dp_error_t *err);
/** True for the generic stand-in of a custom that came off the wire
 *  without a resolver: its class is the custom's type name and its one
 *  attribute "__reduce__" the reduced state. Pickled again it is written as
 *  the custom was, so frames survive a round trip through such a process. */
DP_API bool dp_object_is_reduced(dp_value_t obj);
/** Makes such a stand-in (steals state). */
DP_API int dp_object_new_reduced(const char *type_name, dp_value_t state, dp_value_t *out, dp_error_t *err);

/* ---- custom: a foreign C object that carries its own type ---- */
typedef struct dp_type {
  /** Type name, reported in errors and written to frames. Required:
   *  non-empty UTF-8 (a frame carries it), else dp_custom_new is
   *  DP_EINVAL. */
  const char *name;
  /** Reduces obj to a state value: any value, which may hold tensors and
   *  other customs (Python's __reduce__ contract). Returns 0 and a new
   *  reference in *state, or a DP_E* code (details in err); a positive
   *  return is a failure too (DP_ETYPE, "reduce returned N"). On failure
   *  the library releases whatever reduce left in *state (it starts as
   *  none), as it does for bind and resolve: reduce never releases what it
   *  stored there itself. NULL: the type
   *  cannot be walked, which is DP_ETYPE with the type name and path.
   *  It runs during a walk (scan, pickle, a future's completion), which
   *  reads the walked value without holding references to its nodes: it
   *  may make and retain values, but must not change, release or add to any
   *  container of the value being walked (as a container must not change
   *  while it is iterated) — the walk would read freed memory. */
  int (*reduce)(void *obj, dp_value_t *state, dp_error_t *err);
  /** Frees obj when the custom dies. May be NULL. It may release values;
   *  a custom (or a storage with a release callback) that dies meanwhile on
   *  this thread has its destroy run after this one returns, not inside it,
   *  so that a chain of any length is freed in constant stack. */
  void (*destroy)(void *obj);
} dp_type_t;

/** Wraps obj (ownership of obj passes to the custom; destroy frees it, also
 *  when this call fails — but for a NULL type, which has no destroy to call:
 *  obj then stays the caller's). type must outlive the value, unchanged:
 *  its name is checked here, once (a name changed later is written to
 *  frames as it stands, and a reader may refuse them). Errors:
 *  DP_EINVAL for a NULL type, type->name or out, or a name that is not
 *  non-empty UTF-8; DP_ENOMEM. */
DP_API int dp_custom_new(const dp_type_t *type, void *obj, dp_value_t *out, dp_error_t *err);
/** The custom's type and the obj it wraps (borrowed: the custom owns obj);
 *  NULL for a value of another kind. */
DP_API const dp_type_t *dp_custom_type(dp_value_t c);
DP_API void *dp_custom_data(dp_value_t c);

/* ---- equality and hashing; both terminate on cycles ---- */
#define DP_EQ_SHARING 1u  /* also require the same sharing (same node graph) */

/** Deep equality. Without flags: equal as trees (bisimulation: cycles
 *  compare equal when their unrollings do). With DP_EQ_SHARING: also the
 *  same pattern of shared nodes and cycles, as a round trip preserves.
 *  Tensors compare storage device, base and nbytes, dtype, shape, strides and
 *  offset; customs compare by identity; floats bitwise. Dicts and objects
 *  compare as mappings, their order aside (with DP_EQ_SHARING too): two
 *  equal dicts filled in different orders pickle to different bytes.
 *  Time and memory grow about linearly with the two values' nodes and
 *  items, whatever their sharing and cycles (two rings of coprime lengths
 *  included). Returns 1 equal, 0 not, or a negative DP_E*: DP_ENOMEM, or
 *  DP_EINVAL for a flag other than DP_EQ_SHARING (with err). */
DP_API int dp_value_equal(dp_value_t a, dp_value_t b, unsigned flags, dp_error_t *err);

/** XXH3-based hash consistent with dp_value_equal(a, b, 0): equal values hash
 *  equal. Looks at its first 256 nodes (leaves included; a str or bytes
 *  reads all its bytes the first time any hash takes it, then keeps its
 *  hash) within 12 levels (the value is level 0, so a node at level 12
 *  counts and one at level 13 does not): a bounded prefix of large, shared
 *  or cyclic values. A dict or object adds its keys (attribute names) and its values,
 *  each value by its kind and size, or whole if a leaf, two nodes an entry,
 *  when all of them fit in what is left of the 256; else its size (and
 *  class) only. Keyed with a secret drawn once per process (so that values built
 *  to collide cannot flood a table using it): stable within a process,
 *  different in the next one — never store it or send it. */
DP_API uint64_t dp_value_hash(dp_value_t v);

#ifdef __cplusplus
}
#endif
#endif
