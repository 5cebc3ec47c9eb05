/* core/internal.h — the runtime every module stands on: checked arithmetic,
 * the allocator hook, errors, text helpers. Nothing here knows values,
 * devices or frames. */
#ifndef DP_CORE_INTERNAL_H
#define DP_CORE_INTERNAL_H

#include <stdarg.h>
#include "atomic.h"
#include "devpickle/base.h"

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

/* ---- errors ----
 * Every function returns 0 or a DP_E* code (negative). Internal results
 * that are not errors are positive, so that they can never be taken for
 * one, and never leave the library: */
#define DP__EXISTS 1  /* an insert without replace met the key or name already there */

int dp__err(dp_error_t *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* 1 when code is one of base.h's DP_E* codes (negative), else 0. */
int dp__is_code(int code);
/* What a caller's callback returned, as the API returns it: 0, or a
 * negative DP_E* code with err filled — a positive code (which no call
 * returns, so `rc < 0` tests would take it for success) or a negative one
 * that is no DP_E* (no caller could tell it by name) becomes DP_EINVAL,
 * a failure that left err's message empty gets one naming `what`, and a
 * message the callback wrote is kept (its last byte made a NUL: one that
 * fills the buffer may lack it), with err->code set to the code it
 * returned. err must be clear when the callback runs. */
int dp__cb_rc(int rc, dp_error_t *err, const char *what);

/* A failure rc < 0 of something a call used, in the call's name:
 * "prefix: <err's message>", its code rc and its backend code kept. Returns
 * rc (untouched for rc >= 0 or a NULL err). */
int dp__err_prefix(dp_error_t *err, int rc, const char *prefix);
/* The same with "<err's message><suffix>" (" at $.x", where it happened). */
int dp__err_suffix(dp_error_t *err, int rc, const char *suffix);
/* msg into dst[cap] (cap at least 8): whole when it fits, else its
 * beginning and its end with "…" in place of its middle, each cut at a
 * character boundary, as a message too long for dp_error_t is. For a cause
 * quoted after a path: cut to the room the path leaves, it keeps the path
 * whole (base.h: a message holds any path). */
void dp__fit(char *dst, size_t cap, const char *msg);

/* What a tuple dict key may hold (dp_value_is_hashable), said where one is refused. */
#define DP__TUPLE_KEY_RULE " (a tuple key holds only scalars, str, bytes and tuples, at most 1024 of them, 32 levels deep)"
int dp__err_at(dp_error_t *err, int code, int64_t offset, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int dp__verr(dp_error_t *err, int code, int64_t offset, const char *fmt, va_list ap);

/* s for a message, inside '...': its first 32 bytes (whole UTF-8
 * characters), escaped by the rule for names (core/path.h: control
 * characters, U+2028/U+2029, stray bytes; ' and \), an ellipsis when cut. */
#define DP__SHOWN_MAX (32 * 6 + 3 + 1)
const char *dp__shown(const char *s, char out[DP__SHOWN_MAX]);
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

#endif
