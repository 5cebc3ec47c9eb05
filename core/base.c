/* core/base.c — errors, the allocator hook, devices, small text helpers. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/random.h>
#endif

#include "path.h"
#include "table.h"

static void *default_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  DP_UNUSED(ud);
  DP_UNUSED(osize);
  if (nsize == 0) {
    free(ptr);
    return NULL;
  }
  return realloc(ptr, nsize);
}

static dp_alloc_fn g_alloc = default_alloc;
static void *g_alloc_ud;

void dp_set_allocator(dp_alloc_fn fn, void *ud) {
  g_alloc = fn ? fn : default_alloc;
  g_alloc_ud = fn ? ud : NULL;
}

dp_alloc_fn dp_get_allocator(void **ud) {
  if (ud) *ud = g_alloc_ud;
  return g_alloc;
}

void *dp__alloc(size_t n) { return n ? g_alloc(g_alloc_ud, NULL, 0, n) : NULL; }

void *dp__realloc(void *p, size_t osize, size_t nsize) {
  if (p == NULL) return dp__alloc(nsize);
  return g_alloc(g_alloc_ud, p, osize, nsize);
}

void dp__free(void *p, size_t n) {
  if (p) g_alloc(g_alloc_ud, p, n, 0);
}

void *dp__alloc_array(size_t n, size_t size) {
  if (size && n > SIZE_MAX / size) return NULL;
  return dp__alloc(n * size);
}

char *dp__strndup(const char *s, size_t n) {
  char *d = dp__alloc(n + 1);
  if (d) {
    memcpy(d, s, n);
    d[n] = '\0';
  }
  return d;
}

int dp__grow(void **arr, size_t *cap, size_t need, size_t size) {
  if (need <= *cap) return 0;
  size_t ncap = *cap ? *cap : 4;
  while (ncap < need) {
    if (ncap > SIZE_MAX / 2 / size) return DP_ENOMEM;
    ncap *= 2;
  }
  void *p = dp__realloc(*arr, *cap * size, ncap * size);
  if (!p) return DP_ENOMEM;
  *arr = p;
  *cap = ncap;
  return 0;
}

int dp__grow_inl(void **arr, size_t *cap, size_t need, size_t size, const void *inl) {
  if (need <= *cap) return 0;
  if (*arr != inl) return dp__grow(arr, cap, need, size);  /* already separate, or none yet */
  size_t ncap = *cap ? *cap : 4;
  while (ncap < need) {
    if (ncap > SIZE_MAX / 2 / size) return DP_ENOMEM;
    ncap *= 2;
  }
  void *p = dp__alloc(ncap * size);
  if (!p) return DP_ENOMEM;
  memcpy(p, inl, *cap * size);
  *arr = p;
  *cap = ncap;
  return 0;
}

/* ---- the hash secret ----
 * Every table keyed by data hashes with this per-process secret (table.h).
 * It comes from getrandom(2), once, without blocking. Where that fails (no
 * such call, or the kernel's pool is not yet initialised, early at boot) it
 * is derived from what an outside sender cannot see: both clocks in
 * nanoseconds, the process id and the addresses of a stack variable and of
 * this code (randomised by ASLR). That fallback resists a remote sender, not
 * a local one that can read the clock and the process's memory map. */

_Atomic uint64_t dp__g_hash_secret;
static pthread_once_t g_hash_once = PTHREAD_ONCE_INIT;

static void hash_secret_init(void) {
  uint64_t s = 0;
  int ok = 0;
#if defined(__linux__)
  ok = getrandom(&s, sizeof s, GRND_NONBLOCK) == (ssize_t)sizeof s;
#endif
  if (!ok) {
    struct timespec rt = {0, 0}, mt = {0, 0};
    clock_gettime(CLOCK_REALTIME, &rt);
    clock_gettime(CLOCK_MONOTONIC, &mt);
    uint64_t mix[6] = {(uint64_t)rt.tv_sec, (uint64_t)rt.tv_nsec, (uint64_t)mt.tv_sec ^ ((uint64_t)mt.tv_nsec << 20),
                       (uint64_t)getpid(), (uint64_t)(uintptr_t)&s, (uint64_t)(uintptr_t)&hash_secret_init};
    s = XXH3_64bits(mix, sizeof mix);
  }
  dp__store_relaxed(&dp__g_hash_secret, s ? s : 1);  /* 0 means "not yet" */
}

uint64_t dp__hash_secret_slow(void) {
  pthread_once(&g_hash_once, hash_secret_init);
  return dp__load_relaxed(&dp__g_hash_secret);
}

void dp__hash_secret_set(uint64_t secret) {
  pthread_once(&g_hash_once, hash_secret_init);
  dp__store_relaxed(&dp__g_hash_secret, secret);
}

/* ---- errors ---- */

void dp_error_clear(dp_error_t *err) {
  if (!err) return;
  err->code = 0;
  err->backend_code = 0;
  err->offset = -1;
  err->message[0] = '\0';
}

unsigned dp_version(void) { return DP_VERSION_NUMBER; }

const char *dp_version_string(void) { return DP_VERSION_STRING; }

const char *dp_strerror(int code) {
  switch (code) {
    case 0: return "success";
#define DP__STR(name, val, s) case val: return s;
    DP_ERRNO_MAP(DP__STR)
#undef DP__STR
  }
  return "unknown error";
}

const char *dp_err_name(int code) {
  switch (code) {
    case 0: return "DP_OK";
#define DP__NAME(name, val, s) case val: return "DP_" #name;
    DP_ERRNO_MAP(DP__NAME)
#undef DP__NAME
  }
  return "DP_UNKNOWN";
}

int dp__is_code(int code) {
  return code < 0 && strcmp(dp_err_name(code), "DP_UNKNOWN") != 0;
}

#define DP_ERR_FULL_MAX (64u << 10)

/* Fits a message of n bytes into dst[cap]: its beginning and its end, with
 * "…" in place of its middle, each cut at a UTF-8 character boundary. */
static void cut_middle(char *dst, size_t cap, const char *msg, size_t n) {
  size_t room = cap - 1 - 3, head = room / 2, tail = room - head;
  while (head > 0 && ((unsigned char)msg[head] & 0xC0) == 0x80) head--;
  size_t from = n - tail;
  while (from < n && ((unsigned char)msg[from] & 0xC0) == 0x80) from++;
  memcpy(dst, msg, head);
  memcpy(dst + head, "\xe2\x80\xa6", 3);
  memcpy(dst + head + 3, msg + from, n - from);
  dst[head + 3 + n - from] = '\0';
}

void dp__fit(char *dst, size_t cap, const char *msg) {
  size_t n = strlen(msg);
  if (n < cap) {
    memcpy(dst, msg, n + 1);
    return;
  }
  cut_middle(dst, cap, msg, n);
}

int dp__verr(dp_error_t *err, int code, int64_t offset, const char *fmt, va_list ap) {
  if (!err) return code;
  err->code = code;
  err->backend_code = 0;
  err->offset = offset;
  va_list again;
  va_copy(again, ap);
  int n = vsnprintf(err->message, sizeof err->message, fmt, ap);
  if (n >= (int)sizeof err->message) {
    /* Too long: the end of a message (the end of a path, the cause) matters
     * as much as its beginning, so the middle goes. A message longer than
     * DP_ERR_FULL_MAX (some caller formatted a huge string) is not copied
     * whole: its end goes instead. */
    char *full = (size_t)n <= DP_ERR_FULL_MAX ? dp__alloc((size_t)n + 1) : NULL;
    if (full) {
      vsnprintf(full, (size_t)n + 1, fmt, again);
      cut_middle(err->message, sizeof err->message, full, (size_t)n);
      dp__free(full, (size_t)n + 1);
    } else {
      size_t k = sizeof err->message - 4;
      while (k > 0 && ((unsigned char)err->message[k] & 0xC0) == 0x80) k--;
      memcpy(err->message + k, "\xe2\x80\xa6", 4);
    }
  }
  va_end(again);
  return code;
}

int dp__cb_rc(int rc, dp_error_t *err, const char *what) {
  if (rc == 0) return 0;
  /* A message written by hand may fill the buffer without its NUL
   * (strncpy does): ended here, where every callback's failure passes,
   * before the library formats it into another or hands it back. */
  if (err) err->message[sizeof err->message - 1] = '\0';
  if (!dp__is_code(rc))
    return dp__err(err, DP_EINVAL, "%s returned %d: a callback returns 0 or a negative DP_E* code", what, rc);
  if (!err) return rc;
  /* Whether the callback set err->code or not (dp_error_t's fields are all
   * it has to fill), its message is kept, and err carries the code it
   * returned, as the call does; only an empty message is made here. The
   * offset is the call's, not the callback's: -1 here, and a reader that
   * called it (a stream's read, bind, resolve) sets where it stopped. */
  if (!err->message[0]) {
    /* the message is the library's; the backend code stays the callback's */
    int backend = err->backend_code;
    dp__err(err, rc, "%s failed: %s", what, dp_strerror(rc));
    err->backend_code = backend;
    return rc;
  }
  err->code = rc;
  err->offset = -1;
  return rc;
}

/* err's message between "prefix: " (none for NULL) and suffix, its code rc
 * and its backend code kept. */
static int err_wrap(dp_error_t *err, int rc, const char *prefix, const char *suffix) {
  if (rc >= 0 || !err) return rc;
  char msg[sizeof err->message];
  memcpy(msg, err->message, sizeof msg);
  msg[sizeof msg - 1] = '\0';
  int backend = err->backend_code;
  dp__err(err, rc, "%s%s%s%s", prefix ? prefix : "", prefix ? ": " : "", msg, suffix ? suffix : "");
  err->backend_code = backend;
  return rc;
}

int dp__err_prefix(dp_error_t *err, int rc, const char *prefix) { return err_wrap(err, rc, prefix, NULL); }

int dp__err_suffix(dp_error_t *err, int rc, const char *suffix) { return err_wrap(err, rc, NULL, suffix); }

int dp__err(dp_error_t *err, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  dp__verr(err, code, -1, fmt, ap);
  va_end(ap);
  return code;
}

int dp__err_at(dp_error_t *err, int code, int64_t offset, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  dp__verr(err, code, offset, fmt, ap);
  va_end(ap);
  return code;
}

/* ---- devices ---- */

static const char *const device_type_names[DP_DEVICE_TYPE_COUNT] = {"cpu", "cuda", "host"};

char *dp_device_format(dp_device_t dev, char *buf, size_t size) {
  if (!buf || !size) return buf;
  if (dev.type == DP_DEVICE_CPU)
    snprintf(buf, size, "cpu");
  else if (dev.type < DP_DEVICE_TYPE_COUNT)
    snprintf(buf, size, "%s:%u", device_type_names[dev.type], (unsigned)dev.index);
  else
    snprintf(buf, size, "unknown%u:%u", (unsigned)dev.type, (unsigned)dev.index);
  return buf;
}

const char *dp__shown(const char *s, char out[DP__SHOWN_MAX]) {
  size_t n = strlen(s), k = dp__name_shown(s, n, 32);
  dp__sbuf_t b = {out, 0, DP__SHOWN_MAX - 1, 0};
  dp__sb_escaped(&b, s, k, DP__ESC_SQUOTED, k < n);
  out[b.len] = '\0';
  return out;
}

static int bad_device(dp_error_t *err, const char *s) {
  char shown[DP__SHOWN_MAX];
  return dp__err(err, DP_EINVAL, "dp_device_parse: '%s' is not a device (cpu, cuda:N or host:N, N 0..%d)",
                 dp__shown(s, shown), DP_DEVICE_INDEX_MAX);
}

int dp_device_parse(const char *s, dp_device_t *out, dp_error_t *err) {
  if (!s || !out) return dp__err(err, DP_EINVAL, "dp_device_parse: NULL %s", s ? "out" : "s");
  if (strcmp(s, "cpu") == 0) {
    out->type = DP_DEVICE_CPU;
    out->index = 0;
    return 0;
  }
  for (int t = 1; t < DP_DEVICE_TYPE_COUNT; t++) {
    size_t n = strlen(device_type_names[t]);
    if (strncmp(s, device_type_names[t], n) != 0 || s[n] != ':') continue;
    const char *d = s + n + 1;
    if (*d < '0' || *d > '9' || (d[0] == '0' && d[1] != '\0')) return bad_device(err, s);
    unsigned v = 0;
    for (; *d; d++) {
      if (*d < '0' || *d > '9') return bad_device(err, s);
      v = v * 10 + (unsigned)(*d - '0');
      if (v > DP_DEVICE_INDEX_MAX) return bad_device(err, s);
    }
    out->type = (uint8_t)t;
    out->index = (uint8_t)v;
    return 0;
  }
  return bad_device(err, s);
}

/* ---- text ---- */

int dp__utf8_valid(const char *str, size_t n) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < n) {
    /* ASCII fast path, 8 bytes at a time. */
    while (i + 8 <= n) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t len;
    unsigned cp, min;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; min = 0x10000; }
    else return 0;
    if (n - i < len) return 0;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return 0;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    i += len;
  }
  return 1;
}

_Noreturn void dp__ref_overflow(const char *what) {
  fprintf(stderr, "devpickle: %s retained while it held 4294967295 references (the most a 32-bit count holds): "
                  "aborting\n", what);
  abort();
}
