/* value/gc.h — the cycle collector, and the value module's private constructors (used by the unpickler). */
#ifndef DP_VALUE_GC_H
#define DP_VALUE_GC_H
#include "internal.h"

void dp__gc_release(dp_cont_t *c);
/* Tests only: called, when set, where a release of a container buffered by
 * another thread may be overtaken: before it takes the collector lock
 * (DP_GC_PAUSE_FOREIGN), and under it once it has seen that the owner let
 * go of the container (DP_GC_PAUSE_OWNER_LET_GO). */
enum { DP_GC_PAUSE_FOREIGN, DP_GC_PAUSE_OWNER_LET_GO };
extern void (*dp__gc_pause_hook)(int where);
void dp__release_leaf(dp_heap_t *h);
/* str or bytes without validation: the caller has checked the text. */
int dp__strobj_new(uint32_t kind, const void *p, size_t n, dp_value_t *out, dp_error_t *err);

/* Inserts (steals key and val). Without allow_replace a key or name already
 * there is DP__EXISTS (positive, internal: err untouched, key and val
 * released — or, for a dict with DP__KEEP_ON_EXISTS, handed back to the
 * caller, who releases them once it has named the key); any failure is a
 * DP_E* code with its message in err. */
#define DP__KEEP_ON_EXISTS 2
int dp__dict_set_checked(dp_value_t dict, dp_value_t key, dp_value_t val, int allow_replace,
                         dp_error_t *err);
/* The index of key's entry in dict (a dict), or SIZE_MAX (also for a key
 * that is not hashable). Entries of key's hash are compared with same(ctx,
 * entry key, key), or with the dict's own key equality when same is NULL. */
typedef int (*dp__key_same_fn)(void *ctx, dp_value_t a, dp_value_t b);
size_t dp__dict_find_with(dp_value_t dict, dp_value_t key, dp__key_same_fn same, void *ctx);
int dp__object_new_n(const char *cls, size_t len, size_t nattrs, dp_value_t *out, dp_error_t *err);
int dp__object_new_reduced_n(const char *type, size_t len, dp_value_t *out, dp_error_t *err);
int dp__object_set_n(dp_value_t obj, const char *name, size_t n, dp_value_t val, int allow_replace,
                     dp_error_t *err);
int dp__tensor_check(size_t nbytes, dp_dtype_t dtype, int ndim, const int64_t *shape,
                     const int64_t *strides, int64_t offset, dp_error_t *err);
#endif
