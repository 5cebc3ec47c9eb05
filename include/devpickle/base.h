/*
 * devpickle/base.h — errors, the allocator hook and device identifiers.
 *
 * Every other public header includes this one. Nothing here allocates.
 *
 * Thread safety: dp_version(), dp_version_string(), dp_strerror() and
 * dp_err_name() are thread-safe. The
 * allocator hook must be installed before any other devpickle call and is not
 * changed afterwards (dp_set_allocator() is not thread-safe).
 */
#ifndef DEVPICKLE_BASE_H
#define DEVPICKLE_BASE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(DP_BUILDING) && defined(__GNUC__)
#define DP_API __attribute__((visibility("default")))
#else
#define DP_API
#endif

/* The version of these headers, written here only: the Makefile reads these
 * three lines (devpickle.pc, the shared library's soname) and the string is
 * made from them. dp_version() gives the version of the library actually
 * linked, which a program loading libdevpickle.so may compare with them. */
#define DP_VERSION_MAJOR 0
#define DP_VERSION_MINOR 1
#define DP_VERSION_PATCH 0
#define DP__VERSION_STR(x) #x
#define DP__VERSION_XSTR(x) DP__VERSION_STR(x)
#define DP_VERSION_STRING                                                   \
  DP__VERSION_XSTR(DP_VERSION_MAJOR) "." DP__VERSION_XSTR(DP_VERSION_MINOR) \
  "." DP__VERSION_XSTR(DP_VERSION_PATCH)
#define DP_VERSION_NUMBER (DP_VERSION_MAJOR * 10000 + DP_VERSION_MINOR * 100 + DP_VERSION_PATCH)

/*
 * Error codes. A fallible call returns 0 or one of these (all negative).
 * XX(name, value, description)
 */
#define DP_ERRNO_MAP(XX)                                                      \
  XX(EINVAL, -1, "invalid argument")                                          \
  XX(ENOMEM, -2, "out of memory")                                             \
  XX(ETYPE, -3, "value cannot be walked")                                     \
  XX(ELIMIT, -4, "limit exceeded")                                            \
  XX(EFORMAT, -5, "malformed frame")                                          \
  XX(ECHECKSUM, -6, "checksum mismatch")                                      \
  XX(ETRUNC, -7, "truncated input")                                           \
  XX(EVERSION, -8, "unsupported format version")                              \
  XX(EIO, -9, "i/o error")                                                    \
  XX(ENODEV, -10, "no such device or backend unavailable")                    \
  XX(ECUDA, -11, "CUDA error")                                                \
  XX(EDEVICE, -12, "device not allowed")                                      \
  XX(ESTATE, -13, "operation not valid in this state")                        \
  XX(ETIMEDOUT, -14, "timed out")                                             \
  XX(ENOTFOUND, -15, "not found")                                             \
  XX(EMISUSE, -16, "API misuse")                                              \
  XX(ECANCELED, -17, "canceled")

typedef enum dp_errno {
  DP_OK = 0,
#define DP__ERR_ENUM(name, val, s) DP_##name = (val),
  DP_ERRNO_MAP(DP__ERR_ENUM)
#undef DP__ERR_ENUM
} dp_errno_t;

/** Size of dp_error_t's message buffer. It holds any message that names a
 *  path (paths are at most DP_PATH_MAX bytes, ptrset.h) whole: one that
 *  quotes a callback's message after a path (a reduce() that failed) cuts
 *  the quoted message to the room left, as below. A longer message keeps
 *  its beginning and its end, with "…" (U+2026) in place of its middle
 *  (one longer than 64 KiB, or one the allocator hook gives no room to be
 *  formatted whole, keeps only its beginning, then "…"). */
#define DP_ERROR_MSG_MAX 2048

/** Detail for a failed call. Caller-owned; pass NULL when detail is not wanted.
 *  `offset` is the byte offset in the input where a reader failed, or -1. */
typedef struct dp_error {
  int code;           /* DP_E*, or 0 */
  int backend_code;   /* e.g. a cudaError_t, or 0 */
  int64_t offset;     /* byte offset for reader errors, else -1 */
  char message[DP_ERROR_MSG_MAX];
} dp_error_t;

/*
 * ERRORS AND NULL — one rule for the whole API (every header follows it):
 *   - A function that can fail returns 0 or a DP_E* code (all negative)
 *     and takes a last `dp_error_t *err`, filled on failure: the code, a
 *     message, and for readers the offset. err may always be NULL. A lookup
 *     that finds nothing (DP_ENOTFOUND) is such a failure too.
 *   - A failure below a call — the allocator, a constructor, a callback
 *     (bind, resolve, read) — keeps its code and message, and the
 *     backend_code a callback gave: they are passed
 *     through, never relabelled (a reduce() that fails makes the value one
 *     that cannot be walked: DP_ETYPE, with reduce's message, unless it ran
 *     out of memory, which stays DP_ENOMEM; pickler.h).
 *   - A callback of the caller's (bind, resolve, read, a then() callback,
 *     a cache hook: cache.h)
 *     returns 0 or a DP_E* code. A positive return, which no call of the
 *     library ever makes (so a caller testing rc < 0 would take it for
 *     success), becomes DP_EINVAL ("bind returned 4: ..."), as does a
 *     negative code that is none of the DP_E* above; a failure that
 *     left err's message empty gets a message naming the callback ("the
 *     read callback failed: i/o error"). A callback fills err by hand: the
 *     message it wrote is kept (one that fills the buffer without a NUL,
 *     as strncpy leaves it, loses its last byte to one), and the code is
 *     the one it returned, whatever it stored in err->code; the offset is
 *     the call's own (a reader's position, else -1), whatever it stored in
 *     err->offset. A callback that hands back a reference (reduce's state,
 *     bind's storage, resolve's value, a then() callback's result) and
 *     fails leaves it where it stored it: the library releases it.
 *   - A reader or writer keeps its first error: what it does after one
 *     returns that error and changes nothing.
 *   - A NULL handle, or a NULL for a pointer the call needs, is DP_EINVAL
 *     with a message naming the function and the argument. Out-pointers
 *     documented as optional may be NULL.
 *   - Functions that give memory or a reference back (_free, _release,
 *     _clear) do nothing with NULL.
 *   - Functions that cannot fail (counts, accessors, formatters) return a
 *     neutral value for a NULL handle or a value of another kind: 0, NULL,
 *     false, none, or {DP_DEVICE_CPU, 0}.
 * Results that are not errors never leave the library as codes.
 */

/** The linked library's version as MAJOR * 10000 + MINOR * 100 + PATCH
 *  (DP_VERSION_NUMBER is the headers' own, computed the same way): a
 *  program built against one release and run with another can tell.
 *  Never fails. */
DP_API unsigned dp_version(void);

/** The linked library's version as a static string, "MAJOR.MINOR.PATCH"
 *  (DP_VERSION_STRING is the headers'). Never fails. */
DP_API const char *dp_version_string(void);

/** Clears an error record (code 0, offset -1, empty message). */
DP_API void dp_error_clear(dp_error_t *err);

/** Static description of a code ("out of memory"; "success" for 0);
 *  "unknown error" otherwise. */
DP_API const char *dp_strerror(int code);

/** Static name of a code ("DP_ENOMEM"; "DP_OK" for 0); "DP_UNKNOWN"
 *  otherwise. */
DP_API const char *dp_err_name(int code);

/*
 * The allocator hook, in the manner of lua_Alloc: one function does malloc,
 * realloc and free. `osize` is the size of the block at `ptr` (0 when ptr is
 * NULL); `nsize` the wanted size. nsize == 0 frees and returns NULL. Returning
 * NULL for nsize > 0 is an allocation failure; the block at ptr stays valid.
 *
 * Every allocation devpickle makes goes through this one function, so tests can
 * fail the Nth allocation. The default wraps realloc/free. What the libraries
 * below devpickle allocate for themselves does not: UCX inside a transport
 * (its workers, endpoints and messages), the CUDA runtime, and the C
 * library's: thread stacks for host streams and a transport's progress
 * thread, and what a transport asks of it — getaddrinfo's answer for a
 * HOST:PORT, getifaddrs's interface list (is a peer on this host?) and the
 * directory stream that sweeps /dev/shm — each freed before the call that
 * asked returns.
 */
typedef void *(*dp_alloc_fn)(void *ud, void *ptr, size_t osize, size_t nsize);

/** Installs the process-wide allocator (NULL restores the default). Call
 *  before any other devpickle function and never while devpickle memory is
 *  alive: blocks are freed with the function that allocated them. */
DP_API void dp_set_allocator(dp_alloc_fn fn, void *ud);

/** Reads the installed allocator, and its ud into *ud (ud may be NULL). */
DP_API dp_alloc_fn dp_get_allocator(void **ud);

/* Devices. `cpu` has no streams; `cuda` is a CUDA device; `host` is the
 * asynchronous host stream executor used where no GPU exists. */
typedef enum dp_device_type {
  DP_DEVICE_CPU = 0,
  DP_DEVICE_CUDA = 1,
  DP_DEVICE_HOST = 2,
} dp_device_type_t;

#define DP_DEVICE_TYPE_COUNT 3
#define DP_DEVICE_INDEX_MAX 255

typedef struct dp_device {
  uint8_t type;   /* dp_device_type_t */
  uint8_t index;  /* 0 for cpu */
} dp_device_t;

/** Formats "cuda:0", "host:1", "cpu" into buf (at least 16 bytes; a
 *  smaller one gets the text cut, NUL-terminated, as snprintf does; a
 *  cpu device is "cpu" whatever its index, a type past DP_DEVICE_HOST is
 *  "unknownT:N"). Returns buf (NULL or size 0: nothing is written). */
DP_API char *dp_device_format(dp_device_t dev, char *buf, size_t size);

/** Parses "cpu", "cuda:N" or "host:N" (N 0..255, in decimal as
 *  dp_device_format writes it: no sign, blank or leading zero, nothing
 *  after it; lower case). DP_EINVAL otherwise, quoting s; *out is then left
 *  as it was. */
DP_API int dp_device_parse(const char *s, dp_device_t *out, dp_error_t *err);

static inline int dp_device_equal(dp_device_t a, dp_device_t b) {
  return a.type == b.type && a.index == b.index;
}

#ifdef __cplusplus
}
#endif
#endif
