/* pickler/unpickle.c — frames to values. The input is hostile.
 *
 * Why not msgpack-c's unpacker: its C API builds a whole object tree in a
 * zone allocated with malloc (outside the allocator hook) and sizes arrays
 * from the counts in their headers before checking that the bytes exist.
 * This reader is a bounds-checked pull decoder over the same format: every
 * length is checked against the bytes left before anything is allocated, so
 * allocation stays within a constant factor of the input, and values are
 * built directly with an explicit stack (no recursion). */
#include <stdio.h>
#include <string.h>

#include "frame.h"
#include "walk.h"
#include "../value/gc.h"

/* ---- tokens ---- */

enum tok_type { T_NIL, T_BOOL, T_INT, T_UINT, T_FLOAT, T_STR, T_BIN, T_ARRAY, T_MAP, T_EXT };

typedef struct tok {
  int type;
  union {
    int64_t i;
    uint64_t u;
    double f;
  } v;
  uint64_t len;          /* str/bin/ext bytes, array items, map pairs */
  const uint8_t *data;   /* str/bin/ext bytes */
  int8_t ext;
} tok_t;

/* The reader's error discipline (mpack's): its first error is kept in rc,
 * with its message and offset in err, and every later read is a no-op that
 * returns it (end is moved to p, so the inline fast path falls through to
 * next_tok_slow, which returns rc). Only DP_E* codes are returned. */
typedef struct rd {
  const uint8_t *base;   /* frame start, for offsets */
  const uint8_t *p, *end;
  dp_error_t *err;
  int rc;                /* the first error, or 0 */
} rd_t;

static int64_t off(const rd_t *r, const uint8_t *at) { return (int64_t)(at - r->base); }

/* A count's noun, singular for one. */
static const char *plural(uint64_t n, const char *one, const char *many) { return n == 1 ? one : many; }

/* The reader fails at `at` (unless it failed already: then that error). */
static __attribute__((format(printf, 4, 5), noinline)) int rd_fail(rd_t *r, int code, const uint8_t *at,
                                                                  const char *fmt, ...) {
  if (r->rc) return r->rc;
  r->rc = code;
  r->end = r->p;
  va_list ap;
  va_start(ap, fmt);
  dp__verr(r->err, code, off(r, at), fmt, ap);
  va_end(ap);
  return code;
}

/* The first error, made by rd_fail just now from a failure below the
 * reader (e): it keeps that failure's backend code (a bind's or a
 * resolver's cudaError_t, say), as its code and message are kept. */
static int rd_keep_backend(rd_t *r, int first, int rc, const dp_error_t *e) {
  if (first && r->err) r->err->backend_code = e->backend_code;
  return rc;
}

/* A failure of a call below the reader (a constructor, bind, resolve),
 * reported at `at` with its own code and message. */
static int rd_pass(rd_t *r, const uint8_t *at, int code, const dp_error_t *e) {
  int first = !r->rc;
  return rd_keep_backend(r, first, rd_fail(r, code, at, "%s", e->message[0] ? e->message : dp_strerror(code)), e);
}

static int need(rd_t *r, const uint8_t *start, uint64_t n, const char *what) {
  if ((uint64_t)(r->end - r->p) < n)
    return rd_fail(r, DP_EFORMAT, start, "%s runs past the end of its section", what);
  return 0;
}

static int next_tok_slow(rd_t *r, tok_t *t);

/* Reads one token header. Counts and lengths are checked against the bytes
 * left: an array of n items needs at least n bytes, a map 2n. The one-byte
 * forms that make up most payloads are decoded inline. */
static inline int next_tok(rd_t *r, tok_t *t) {
  if (DP_LIKELY(r->p < r->end)) {
    uint8_t b = *r->p;
    if (b <= 0x7f) {
      r->p++;
      t->type = T_INT;
      t->v.i = b;
      return 0;
    }
    if ((b & 0xe0) == 0xa0 && (uint64_t)(r->end - r->p - 1) >= (b & 0x1fu)) {
      t->type = T_STR;
      t->len = b & 0x1f;
      t->data = r->p + 1;
      r->p += 1 + t->len;
      return 0;
    }
  }
  return next_tok_slow(r, t);
}

/* Canonical form. A frame holds every MessagePack header in the one form
 * the writer (msgpack-c's packers) gives it: integers, lengths and counts in
 * their shortest form (non-negative integers in the unsigned family,
 * negative ones in the signed family), floats as float 64 and extension
 * values as fixext. Anything else is refused, so that a frame read and
 * written again is the same bytes. These names are MessagePack's. */
static const char *uint_form(uint64_t v) {
  return v < 0x80 ? "positive fixint" : v <= UINT8_MAX ? "uint 8" : v <= UINT16_MAX ? "uint 16"
         : v <= UINT32_MAX ? "uint 32" : "uint 64";
}

static const char *int_form(int64_t v) {
  if (v >= 0) return uint_form((uint64_t)v);
  return v >= -32 ? "negative fixint" : v >= INT8_MIN ? "int 8" : v >= INT16_MIN ? "int 16"
         : v >= INT32_MIN ? "int 32" : "int 64";
}

/* The shortest form for a length or count n in a family whose short forms
 * hold up to `fix` (0: none), then 8 bits (when `has8`), 16 and 32 bits. */
static const char *len_form(const char *family, uint64_t n, uint64_t fix, int has8, char *buf, size_t cap) {
  if (n < fix) snprintf(buf, cap, "fix%s", family);
  else snprintf(buf, cap, "%s %d", family, has8 && n <= UINT8_MAX ? 8 : n <= UINT16_MAX ? 16 : 32);
  return buf;
}

/* The form of header byte b, for messages. */
static const char *wire_form(uint8_t b, char *buf, size_t cap) {
  static const char *const forms[] = {"bin 8", "bin 16", "bin 32", "ext 8", "ext 16", "ext 32", "float 32",
                                      "float 64", "uint 8", "uint 16", "uint 32", "uint 64", "int 8", "int 16",
                                      "int 32", "int 64"};
  if (b >= 0xc4 && b <= 0xd3) return forms[b - 0xc4];
  if (b >= 0xd9 && b <= 0xdb) return snprintf(buf, cap, "str %d", 8 << (b - 0xd9)), buf;
  if (b >= 0xdc) return snprintf(buf, cap, "%s %d", b <= 0xdd ? "array" : "map", b & 1 ? 32 : 16), buf;
  return "?";
}

static int noncanonical(rd_t *r, const uint8_t *start, const char *what, const char *canon) {
  char form[16];
  return rd_fail(r, DP_EFORMAT, start, "non-canonical encoding: %s as %s (canonical: %s)", what,
                    wire_form(*start, form, sizeof form), canon);
}

static int next_tok_slow(rd_t *r, tok_t *t) {
  const uint8_t *start = r->p;
  if (DP_UNLIKELY(r->rc)) return r->rc;
  if (r->p >= r->end) return rd_fail(r, DP_EFORMAT, start, "value expected, section ended");
  uint8_t b = *r->p++;
  int lenbytes = 0, rc;
  char what[48], canon[16];
  t->data = NULL;
  t->len = 0;
  if (b <= 0x7f) { t->type = T_INT; t->v.i = b; return 0; }
  if (b >= 0xe0) { t->type = T_INT; t->v.i = (int8_t)b; return 0; }
  if ((b & 0xf0) == 0x80) { t->type = T_MAP; t->len = b & 0x0f; goto check_count; }
  if ((b & 0xf0) == 0x90) { t->type = T_ARRAY; t->len = b & 0x0f; goto check_count; }
  if ((b & 0xe0) == 0xa0) { t->type = T_STR; t->len = b & 0x1f; goto body; }
  switch (b) {
    case 0xc0: t->type = T_NIL; return 0;
    case 0xc2: t->type = T_BOOL; t->v.i = 0; return 0;
    case 0xc3: t->type = T_BOOL; t->v.i = 1; return 0;
    case 0xc4: case 0xc5: case 0xc6:
      t->type = T_BIN; lenbytes = 1 << (b - 0xc4); break;
    case 0xd9: case 0xda: case 0xdb:
      t->type = T_STR; lenbytes = 1 << (b - 0xd9); break;
    case 0xdc: case 0xdd:
      t->type = T_ARRAY; lenbytes = b == 0xdc ? 2 : 4; break;
    case 0xde: case 0xdf:
      t->type = T_MAP; lenbytes = b == 0xde ? 2 : 4; break;
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
      int n = 1 << (b - 0xcc);
      if ((rc = need(r, start, (uint64_t)n, "integer")) != 0) return rc;
      t->type = T_UINT;
      t->v.u = dp__get_be(r->p, n);
      r->p += n;
      /* the shortest unsigned form: at least the previous one's limit */
      if (DP_UNLIKELY(t->v.u < (n == 1 ? 0x80u : (uint64_t)1 << (4 * n)))) {
        snprintf(what, sizeof what, "integer %llu", (unsigned long long)t->v.u);
        return noncanonical(r, start, what, uint_form(t->v.u));
      }
      return 0;
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
      int n = 1 << (b - 0xd0);
      if ((rc = need(r, start, (uint64_t)n, "integer")) != 0) return rc;
      uint64_t u = dp__get_be(r->p, n);
      r->p += n;
      t->type = T_INT;
      t->v.i = n == 8 ? (int64_t)u : (int64_t)(u << (64 - 8 * n)) >> (64 - 8 * n);
      /* signed forms hold negative integers below the previous form's range */
      if (DP_UNLIKELY(t->v.i >= (n == 1 ? -32 : -((int64_t)1 << (4 * n - 1))))) {
        snprintf(what, sizeof what, "integer %lld", (long long)t->v.i);
        return noncanonical(r, start, what, int_form(t->v.i));
      }
      return 0;
    }
    case 0xca: case 0xcb: {
      int n = b == 0xca ? 4 : 8;
      if ((rc = need(r, start, (uint64_t)n, "float")) != 0) return rc;
      if (n == 4) return noncanonical(r, start, "float", "float 64");
      uint64_t u = dp__get_be(r->p, n);
      r->p += n;
      t->type = T_FLOAT;
      memcpy(&t->v.f, &u, 8);
      return 0;
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
      t->type = T_EXT;
      t->len = 1u << (b - 0xd4);
      if ((rc = need(r, start, 1 + t->len, "ext")) != 0) return rc;
      t->ext = (int8_t)*r->p++;
      t->data = r->p;
      r->p += t->len;
      return 0;
    case 0xc7: case 0xc8: case 0xc9: {
      int n = 1 << (b - 0xc7);
      if ((rc = need(r, start, (uint64_t)n + 1, "ext")) != 0) return rc;
      t->type = T_EXT;
      t->len = dp__get_be(r->p, n);
      /* 1, 2, 4, 8 and 16 bytes are fixext; otherwise the shortest length */
      int fix = t->len <= 16 && (t->len & (t->len - 1)) == 0 && t->len != 0;
      if (DP_UNLIKELY(fix || t->len < (n == 1 ? 0 : (uint64_t)1 << (4 * n)))) {
        snprintf(what, sizeof what, "ext of %llu byte%s", (unsigned long long)t->len, t->len == 1 ? "" : "s");
        if (fix) snprintf(canon, sizeof canon, "fixext %llu", (unsigned long long)t->len);
        return noncanonical(r, start, what, fix ? canon : len_form("ext", t->len, 0, 1, canon, sizeof canon));
      }
      r->p += n;
      t->ext = (int8_t)*r->p++;
      goto body_checked;
    }
    default:
      return rd_fail(r, DP_EFORMAT, start, "invalid msgpack type byte 0x%02x", b);
  }
  if ((rc = need(r, start, (uint64_t)lenbytes, "length")) != 0) return rc;
  t->len = dp__get_be(r->p, lenbytes);
  r->p += lenbytes;
  /* the shortest length form: str 8 holds 32.., bin 8 0.., 16-bit forms
   * 256.. (arrays and maps: 16..), 32-bit forms 65536.. */
  if (DP_UNLIKELY(t->len < (lenbytes == 4 ? 65536u : lenbytes == 2 ? (t->type == T_ARRAY || t->type == T_MAP ? 16u : 256u)
                                                   : t->type == T_STR ? 32u : 0u))) {
    const char *fam = t->type == T_STR ? "str" : t->type == T_BIN ? "bin" : t->type == T_ARRAY ? "array" : "map";
    int container = t->type == T_ARRAY || t->type == T_MAP;
    snprintf(what, sizeof what, "%s of %llu %s%s", fam, (unsigned long long)t->len,
             t->type == T_ARRAY ? "item" : t->type == T_MAP ? "pair" : "byte", t->len == 1 ? "" : "s");
    return noncanonical(r, start, what,
                        len_form(fam, t->len, t->type == T_STR ? 32 : container ? 16 : 0, !container, canon,
                                 sizeof canon));
  }
  if (t->type == T_ARRAY || t->type == T_MAP) goto check_count;
body:
body_checked:
  if ((uint64_t)(r->end - r->p) < t->len)
    return rd_fail(r, DP_EFORMAT, start,
                      "%s of %llu %s is longer than the %lld %s left", t->type == T_STR ? "str" : t->type == T_BIN ? "bytes" : "ext",
                      (unsigned long long)t->len, plural(t->len, "byte", "bytes"), (long long)(r->end - r->p),
                      plural((uint64_t)(r->end - r->p), "byte", "bytes"));
  t->data = r->p;
  r->p += t->len;
  return 0;
check_count:
  if (t->len > (uint64_t)(r->end - r->p) / (t->type == T_MAP ? 2 : 1))
    return rd_fail(r, DP_EFORMAT, start,
                      "%s claims %llu %s but only %lld %s left", t->type == T_MAP ? "map" : "array",
                      (unsigned long long)t->len,
                      t->type == T_MAP ? plural(t->len, "pair", "pairs") : plural(t->len, "item", "items"),
                      (long long)(r->end - r->p), plural((uint64_t)(r->end - r->p), "byte is", "bytes are"));
  return 0;
}

static int read_int(rd_t *r, int64_t *out, int64_t lo, int64_t hi, const char *what) {
  const uint8_t *start = r->p;
  tok_t t;
  int rc = next_tok(r, &t);
  if (rc) return rc;
  if (t.type == T_UINT) {
    if (t.v.u > (uint64_t)INT64_MAX) goto range;
    t.v.i = (int64_t)t.v.u;
  } else if (t.type != T_INT) {
    return rd_fail(r, DP_EFORMAT, start, "%s: integer expected", what);
  }
  if (t.v.i < lo || t.v.i > hi) goto range;
  *out = t.v.i;
  return 0;
range:;
  /* the value and the range it missed, as pack's messages give them */
  char val[24];
  if (t.type == T_UINT) snprintf(val, sizeof val, "%llu", (unsigned long long)t.v.u);
  else snprintf(val, sizeof val, "%lld", (long long)t.v.i);
  if (lo > hi) /* a tensor's buffer id in a frame without buffers */
    return rd_fail(r, DP_EFORMAT, start, "%s %s out of range (the frame has no buffers)", what, val);
  return rd_fail(r, DP_EFORMAT, start, "%s %s out of range (%lld..%lld)", what, val, (long long)lo, (long long)hi);
}

static int read_uint(rd_t *r, uint64_t *out, const char *what) {
  const uint8_t *start = r->p;
  tok_t t;
  int rc = next_tok(r, &t);
  if (rc) return rc;
  if (t.type == T_INT && t.v.i >= 0) t.v.u = (uint64_t)t.v.i;
  else if (t.type != T_UINT) return rd_fail(r, DP_EFORMAT, start, "%s: unsigned integer expected", what);
  *out = t.v.u;
  return 0;
}

static int read_array(rd_t *r, uint64_t *n, const char *what) {
  const uint8_t *start = r->p;
  tok_t t;
  int rc = next_tok(r, &t);
  if (rc) return rc;
  if (t.type != T_ARRAY) return rd_fail(r, DP_EFORMAT, start, "%s: array expected", what);
  *n = t.len;
  return 0;
}

/* A class, type or attribute name: non-empty UTF-8 without NUL (names are
 * handed out as C strings; a NUL would cut them, and what is read must be
 * what is written back). */
static int read_name(rd_t *r, const char **s, size_t *n, const char *what) {
  const uint8_t *start = r->p;
  tok_t t;
  int rc = next_tok(r, &t);
  if (rc) return rc;
  if (t.type != T_STR || t.len == 0)
    return rd_fail(r, DP_EFORMAT, start, "%s: non-empty str expected", what);
  if (!dp__utf8_valid((const char *)t.data, t.len))
    return rd_fail(r, DP_EFORMAT, start, "%s: invalid UTF-8", what);
  if (dp__has_nul(t.data, t.len))
    return rd_fail(r, DP_EFORMAT, start, "%s: NUL byte in a name", what);
  *s = (const char *)t.data;
  *n = t.len;
  return 0;
}

/* ---- the unpickler ---- */

/* An open container: one that still has children to read. Empty ones are
 * finished as soon as they are read and never take a frame, so that depth
 * counts exactly what the writer's walk counts (containers with children;
 * a reduce node always has one, its state). */
typedef struct uframe {
  dp_heap_t *h;          /* the container (owned by the frame until delivered) */
  uint64_t remaining;    /* children still to read (pairs for dict/object) */
  uint32_t node;         /* preorder index */
  uint32_t low;          /* lowest open container its subtree refers to (NO_LOW: none) */
  uint8_t tag;           /* 0 list, DP_TAG_*, or 'd' for dict */
  uint8_t have_key;
  union {
    dp_value_t key;      /* dict: the key read, waiting for its value */
    struct {             /* object: the attribute name read (in the input) */
      const char *s;
      size_t n;
    } name;
  } u;
  const uint8_t *start;  /* where the container began */
  const uint8_t *key_at; /* dict: where the pending key began; object: the pending attribute's name */
} uframe_t;

#define NO_LOW UINT32_MAX

/* A container's value (its kind is in its header). */
static inline dp_value_t hval(dp_heap_t *h) {
  dp_value_t v;
  v.u.h = h;
  v.kind = h->kind;
  v.reserved_ = 0;
  return v;
}

/* Cycles. A resolved custom must not be in a cycle (customs are opaque to
 * the collector): its state must not reach a container that is still open
 * (its ancestors). Each frame tracks the lowest open container its subtree
 * refers to, directly or through a finished node that did; a finished
 * container that reached an open one records it in its node-table entry
 * (reserved_ = node index + 1), so that a later back-reference to it
 * carries the fact along. Open containers close in stack order, so the
 * lowest one reached is the last to close: while it is open, the node still
 * reaches an open container; once it is closed, nothing it reached is open. */

/* A buffer of the table: its storage, and the size its descriptor gives,
 * which bounds the views of it. A bind callback may hand back a larger
 * storage; a tensor that fits that storage but not the buffer is still
 * refused, so that whether a frame is read does not depend on the bind. */
typedef struct ubuf {
  dp_storage_t *st;
  uint64_t nbytes;
} ubuf_t;

/* Ownership. The node table borrows: every node in it is owned by the tree
 * being built (its parent container, an open frame, or the root) or by
 * `kept`. The reader never releases a node before the end: a reduce node
 * that a resolver replaced is moved to `kept` with its whole state (the
 * table still points into it) and released only when the read is over. */
typedef struct up {
  rd_t r;
  dp_limits_t lim;
  const dp_unpickle_opts_t *opts;
  dp_value_t *nodes;     /* by preorder number; borrowed (see above) */
  size_t nnodes, nodes_cap;
  uframe_t *stack;
  size_t top, stack_cap;
  ubuf_t *bufs;
  size_t nbufs, bufs_cap;
  size_t next_buf;       /* buffers 0..next_buf-1 have been referred to */
  dp_value_t *kept;      /* replaced reduce stand-ins, released at the end */
  size_t nkept, kept_cap;
  uint64_t items, bytes;
  size_t owed;           /* items the open containers still need (each a byte at least), the one being read excepted */
  dp_value_t root;
  int have_root;
  /* The resolver's allow-list by name (allow_index): 1 built, -1 scanned,
   * 0 not asked yet. */
  dp__table_t allow;
  int allow_index;
} up_t;

static int lim_err(up_t *u, const uint8_t *at, const char *what, unsigned long long limit) {
  return rd_fail(&u->r, DP_ELIMIT, at, "%s exceeds the limit of %llu", what, limit);
}

static int oom_at(up_t *u, const uint8_t *at, const char *what) {
  return rd_fail(&u->r, DP_ENOMEM, at, "out of memory growing %s", what);
}

/* Grows *arr to hold one more element than `len`: doubling, but never past
 * `bound`, the most elements it can ever need. The node table and the stack
 * are bounded by the input (every node, every open container takes at least
 * one byte of it): capped by what is left, they never hold more than the
 * input can fill, so their slack costs no memory beyond the bound in
 * pickler.h. */
static int grow_bounded(void **arr, size_t *cap, size_t len, size_t bound, size_t size) {
  size_t ncap = *cap < 8 ? 8 : *cap * 2;
  if (ncap > bound) ncap = bound;
  if (ncap < len + 1) ncap = len + 1;
  size_t nbytes;
  if (dp__mul_ovf(ncap, size, &nbytes)) return DP_ENOMEM;
  void *p = dp__realloc(*arr, *cap * size, nbytes);
  if (!p) return DP_ENOMEM;
  *arr = p;
  *cap = ncap;
  return 0;
}

/* Payload bytes not read yet: an upper bound on the nodes still to come. */
static size_t bytes_left(const up_t *u) { return (size_t)(u->r.end - u->r.p); }

/* A container about to be made for `items` items (each a byte at least):
 * they must fit in the bytes left beside those the open containers still
 * need, so that the containers open at any moment never claim more items
 * than the input holds — each is made at its full size, and the sum of
 * their sizes stays within the memory bound (a count checked only against
 * the bytes left would let every open container claim them all). */
static int claim(up_t *u, const uint8_t *at, uint64_t items, const char *what) {
  size_t left = bytes_left(u), room = left > u->owed ? left - u->owed : 0;
  if (items > room)
    return rd_fail(&u->r, DP_EFORMAT, at,
                   "%s claims %llu %s, more than the %zu %s left hold beside the %zu %s its enclosing containers still need",
                   what, (unsigned long long)items, plural(items, "item", "items"), left, plural(left, "byte", "bytes"),
                   u->owed, plural(u->owed, "item", "items"));
  u->owed += (size_t)items;
  return 0;
}

/* Preorder numbers are 32 bits on the wire (back-references) and here: the
 * table never grows past MAX_NODES, so the check costs nothing until then. */
#define MAX_NODES ((size_t)UINT32_MAX - 1)

static int add_node(up_t *u, dp_value_t v, const uint8_t *at) {
  if (DP_UNLIKELY(u->nnodes == u->nodes_cap)) {
    if (u->nnodes >= MAX_NODES) return lim_err(u, at, "node count", MAX_NODES);
    size_t bound = u->nnodes + 1 + bytes_left(u);
    if (grow_bounded((void **)&u->nodes, &u->nodes_cap, u->nnodes, bound < MAX_NODES ? bound : MAX_NODES,
                     sizeof *u->nodes) != 0)
      return oom_at(u, at, "the node table");
  }
  u->nodes[u->nnodes++] = v;
  return 0;
}

/* A container just read: finished at once when it has no children (*done
 * = 1, *out stays v), else pushed as an open frame (*done = 0). */
static int push_frame(up_t *u, dp_value_t v, uint8_t tag, uint64_t remaining, const uint8_t *at);
static int open_container(up_t *u, dp_value_t v, uint8_t tag, uint64_t remaining, const uint8_t *at, int *done) {
  if (remaining == 0) {
    *done = 1;
    int rc = add_node(u, v, at);
    if (rc) dp_value_release(v);
    return rc;
  }
  *done = 0;
  return push_frame(u, v, tag, remaining, at);
}

static int push_frame(up_t *u, dp_value_t v, uint8_t tag, uint64_t remaining, const uint8_t *at) {
  if (u->top >= u->lim.max_depth) {
    dp_value_release(v);
    return lim_err(u, at, "nesting depth", u->lim.max_depth);
  }
  /* an open container has a child still to read: at least one byte each */
  if (u->top == u->stack_cap &&
      grow_bounded((void **)&u->stack, &u->stack_cap, u->top,
                   u->top + 1 + (bytes_left(u) < u->lim.max_depth ? bytes_left(u) : u->lim.max_depth),
                   sizeof(uframe_t)) != 0) {
    dp_value_release(v);
    return oom_at(u, at, "the reader's stack");
  }
  int rc = add_node(u, v, at);
  if (rc) {
    dp_value_release(v);
    return rc;
  }
  uframe_t *f = &u->stack[u->top++];
  memset(f, 0, sizeof *f);
  v.u.h->flags |= DP_HEAP_OPEN;
  f->h = v.u.h;
  f->remaining = remaining;
  f->node = (uint32_t)(u->nnodes - 1);
  f->low = NO_LOW;
  f->tag = tag;
  f->start = at;
  return 0;
}

/* A str, bytes or name (class, attribute, reduce type) of len bytes. */
static int check_len(up_t *u, const uint8_t *at, uint64_t len) {
  if (len > u->lim.max_str) return lim_err(u, at, "str, bytes or name length", u->lim.max_str);
  if (dp__add_ovf(u->bytes, len, &u->bytes) || u->bytes > u->lim.max_bytes)
    return lim_err(u, at, "total str, bytes and name size", u->lim.max_bytes);
  return 0;
}

static int read_tensor(up_t *u, const uint8_t *at, dp_value_t *out) {
  rd_t *r = &u->r;
  int64_t id, dtype, offset;
  uint64_t nd, ns;
  int64_t shape[DP_TENSOR_MAX_DIMS], strides[DP_TENSOR_MAX_DIMS];
  const uint8_t *id_at = r->p;
  int rc = read_int(r, &id, 0, (int64_t)u->nbufs - 1, "tensor buffer id");
  /* The writer numbers buffers as its walk first meets them: a tensor
   * refers to a buffer met before or to the next one, never beyond. */
  if (!rc && DP_UNLIKELY((size_t)id >= u->next_buf)) {
    if ((size_t)id > u->next_buf)
      return rd_fail(r, DP_EFORMAT, id_at, "tensor refers to buffer %lld before buffer %zu: a frame "
                        "lists buffers in the order its tensors first refer to them", (long long)id, u->next_buf);
    u->next_buf++;
  }
  if (!rc) rc = read_int(r, &dtype, 0, DP_DTYPE_COUNT - 1, "tensor dtype");
  if (!rc) rc = read_array(r, &nd, "tensor shape");
  if (!rc && nd > DP_TENSOR_MAX_DIMS)
    rc = rd_fail(r, DP_EFORMAT, at, "tensor has %llu dimensions (at most %d)",
                    (unsigned long long)nd, DP_TENSOR_MAX_DIMS);
  for (uint64_t d = 0; !rc && d < nd; d++) rc = read_int(r, &shape[d], 0, INT64_MAX, "tensor dimension");
  if (!rc) rc = read_array(r, &ns, "tensor strides");
  if (!rc && ns != nd)
    rc = rd_fail(r, DP_EFORMAT, at, "tensor has %llu stride%s for %llu dimension%s", (unsigned long long)ns,
                 ns == 1 ? "" : "s", (unsigned long long)nd, nd == 1 ? "" : "s");
  for (uint64_t d = 0; !rc && d < ns; d++) rc = read_int(r, &strides[d], INT64_MIN + 1, INT64_MAX, "tensor stride");
  if (!rc) rc = read_int(r, &offset, 0, INT64_MAX, "tensor offset");
  if (rc) return rc;
  dp_storage_t *st = u->bufs[id].st;
  dp_error_t e;
  if (dp__tensor_check((size_t)u->bufs[id].nbytes, (dp_dtype_t)dtype, (int)nd, shape, strides, offset, &e) != 0)
    return rd_fail(r, DP_EFORMAT, at, "%s", e.message); /* each names the tensor already */
  rc = dp_tensor_new(dp_storage_retain(st), (dp_dtype_t)dtype, (int)nd, shape, strides, offset, out, &e);
  return rc ? rd_pass(r, at, rc, &e) : 0;
}

/* Reads one value. Scalars, strings, tensors and back-references come back
 * complete in *out (*done = 1); containers are pushed (*done = 0). */
static int read_value(up_t *u, dp_value_t *out, int *done) {
  rd_t *r = &u->r;
  const uint8_t *at = r->p;
  tok_t t;
  int rc = next_tok(r, &t);
  if (rc) return rc;
  if (++u->items > u->lim.max_items) return lim_err(u, at, "value count", u->lim.max_items);
  *done = 1;
  dp_error_t e;
  switch (t.type) {
    case T_NIL: *out = dp_none(); return 0;
    case T_BOOL: *out = dp_bool(t.v.i != 0); return 0;
    case T_INT: *out = dp_int(t.v.i); return 0;
    case T_UINT:
      if (t.v.u > (uint64_t)INT64_MAX) return rd_fail(r, DP_EFORMAT, at, "integer out of range");
      *out = dp_int((int64_t)t.v.u);
      return 0;
    case T_FLOAT: *out = dp_float(t.v.f); return 0;
    case T_STR:
    case T_BIN:
      if ((rc = check_len(u, at, t.len)) != 0) return rc;
      if (t.type == T_STR && !dp__utf8_valid((const char *)t.data, t.len))
        return rd_fail(r, DP_EFORMAT, at, "invalid UTF-8 in str");
      rc = dp__strobj_new(t.type == T_STR ? DP_STR : DP_BYTES, t.data, t.len, out, &e);
      if (rc) return rd_pass(r, at, rc, &e);
      if ((rc = add_node(u, *out, at)) != 0) dp_value_release(*out);
      return rc;
    case T_EXT: {
      if (t.ext != DP_EXT_REF || t.len != 4)
        return rd_fail(r, DP_EFORMAT, at, "unexpected ext type %d of %llu %s", t.ext,
                          (unsigned long long)t.len, plural(t.len, "byte", "bytes"));
      uint64_t idx = dp__get_be(t.data, 4);
      if (idx >= u->nnodes)
        return rd_fail(r, DP_EFORMAT, at, "back-reference to node %llu, but only %zu node%s precede%s it (a "
                       "back-reference names a node already started)", (unsigned long long)idx, u->nnodes,
                       u->nnodes == 1 ? "" : "s", u->nnodes == 1 ? "s" : "");
      dp_value_t target = u->nodes[idx];
      if (u->top > 0) {
        /* the open container it is, or the lowest one it reaches */
        uint64_t reach = dp_value_is_heap(target) && (target.u.h->flags & DP_HEAP_OPEN) ? idx
                         : target.reserved_ ? target.reserved_ - 1 : NO_LOW;
        if (reach != NO_LOW && reach < u->stack[u->top - 1].low &&
            (reach == idx || (dp__is_container_kind(u->nodes[reach].kind) &&
                              (u->nodes[reach].u.h->flags & DP_HEAP_OPEN))))
          u->stack[u->top - 1].low = (uint32_t)reach;
      }
      target.reserved_ = 0;
      *out = dp_value_retain(target);
      return 0;
    }
    case T_MAP: {
      /* exact sizes: counts were checked against the bytes left */
      if ((rc = claim(u, at, 2 * t.len, "map")) != 0) return rc;
      if ((rc = dp_dict_new(t.len, out, &e)) != 0) return rd_pass(r, at, rc, &e);
      return open_container(u, *out, 'd', t.len, at, done);
    }
    default: /* T_ARRAY */
      break;
  }
  /* An array: a list, or a tagged node when it opens with a tag. */
  if (t.len > 0 && r->end - r->p >= 3 && r->p[0] == 0xd4 && r->p[1] == DP_EXT_TAG) {
    uint8_t tag = r->p[2];
    r->p += 3;
    uint64_t n = t.len - 1;
    switch (tag) {
      case DP_TAG_TUPLE:
        if ((rc = claim(u, at, n, "tuple")) != 0) return rc;
        if ((rc = dp_tuple_new(n, out, &e)) != 0) return rd_pass(r, at, rc, &e);
        return open_container(u, *out, DP_TAG_TUPLE, n, at, done);
      case DP_TAG_TENSOR:
        if (n != 5)
          return rd_fail(r, DP_EFORMAT, at, "tensor node has %llu field%s, expected 5", (unsigned long long)n,
                         n == 1 ? "" : "s");
        if ((rc = read_tensor(u, at, out)) != 0) return rc;
        if ((rc = add_node(u, *out, at)) != 0) dp_value_release(*out);
        return rc;
      case DP_TAG_OBJECT:
      case DP_TAG_REDUCE: {
        const char *cls;
        size_t cls_len;
        if (n < 1 || (tag == DP_TAG_OBJECT ? (n - 1) % 2 != 0 : n != 2))
          return rd_fail(r, DP_EFORMAT, at, "%s node has %llu field%s, expected %s", tag == DP_TAG_OBJECT ? "object" : "reduce",
                         (unsigned long long)n, n == 1 ? "" : "s",
                         tag == DP_TAG_OBJECT ? "an odd number (its class name, then a name and a value for each attribute)"
                                              : "2 (its type name and its state)");
        const uint8_t *nat = r->p;
        if ((rc = read_name(r, &cls, &cls_len, tag == DP_TAG_OBJECT ? "object class" : "reduce type")) != 0 ||
            (rc = check_len(u, nat, cls_len)) != 0)
          return rc;
        if ((rc = claim(u, at, n - 1, tag == DP_TAG_OBJECT ? "object" : "reduce node")) != 0) return rc;
        rc = tag == DP_TAG_OBJECT ? dp__object_new_n(cls, cls_len, (n - 1) / 2, out, &e)
                                  : dp__object_new_reduced_n(cls, cls_len, out, &e);
        if (rc) return rd_pass(r, at, rc, &e);
        return open_container(u, *out, tag, tag == DP_TAG_OBJECT ? (n - 1) / 2 : 1, at, done);
      }
      default:
        return rd_fail(r, DP_EFORMAT, at, "unknown node tag %u", tag);
    }
  }
  if ((rc = claim(u, at, t.len, "array")) != 0) return rc;
  if ((rc = dp_list_new(t.len, out, &e)) != 0) return rd_pass(r, at, rc, &e);
  return open_container(u, *out, 0, t.len, at, done);
}

_Thread_local uint64_t dp__allowed_names_compared;

#define ALLOW_SALT 0x616c6c6f772d6c73ull
/* An allow-list this long or shorter is scanned: an index would not pay. */
#define ALLOW_SCAN_MAX 16

typedef struct {
  const char *name;
  size_t n;
} allow_key_t;

static int allow_name_eq(const char *type, const char *name, size_t n) {
  dp__allowed_names_compared++;
  return type && strncmp(type, name, n) == 0 && type[n] == '\0';
}

static int allow_eq(const void *ctx, size_t i, const void *key) {
  const allow_key_t *k = key;
  return allow_name_eq(((const dp_resolver_t *)ctx)->types[i], k->name, k->n);
}


/* A long allow-list is indexed by name when the first reduce node asks, so
 * that each reduce node costs one lookup, not a pass over the list: a frame
 * of n reduce nodes against a list of m names took n * m comparisons (100,000
 * nodes against 40,000 names: 19 s), now n + m. The index is the one memory
 * the reader holds beside the frame's bound (pickler.h: at most 16 bytes a
 * name, and 32 more). 1 built; -1 not (a short list: it is scanned);
 * DP_ENOMEM when the index cannot be made — an error, not a fall back to
 * the scan, which would make a hostile frame cost n * m exactly when memory
 * is short. */
static int allow_index(up_t *u, const dp_resolver_t *res) {
  if (u->allow_index) return u->allow_index;
  /* Empty slots for every name, at load 1/2 at most; each distinct name
   * once (NULLs and repeats left out: a list of one name many times would
   * make one long probe run), so that the table is never grown again. */
  if (res->ntypes <= ALLOW_SCAN_MAX || res->ntypes >= UINT32_MAX / 4) return u->allow_index = -1;
  size_t nslots = 4;
  while (nslots < 2 * (res->ntypes + 1)) nslots *= 2;
  if (dp__table_grow(&u->allow, DP_TABLE_PLAIN, 0, nslots, NULL, NULL) != 0) return DP_ENOMEM;
  for (size_t i = 0; i < res->ntypes; i++) {
    if (!res->types[i]) continue;
    allow_key_t key = {res->types[i], strlen(res->types[i])};
    uint64_t h = dp__hash_bytes(key.name, key.n, ALLOW_SALT);
    size_t slot;
    if (dp__table_find(&u->allow, DP_TABLE_PLAIN, h, allow_eq, res, &key, &slot) == DP_TABLE_NONE)
      dp__table_put(&u->allow, DP_TABLE_PLAIN, slot, h, i);
  }
  return u->allow_index = 1;
}

/* 1 allowed, 0 not, DP_ENOMEM (allow_index). */
static int allowed_type(up_t *u, const char *name, size_t n) {
  const dp_resolver_t *res = u->opts->resolver;
  if (!res || !res->resolve) return 0;
  int indexed = allow_index(u, res);
  if (indexed == DP_ENOMEM) return DP_ENOMEM;
  if (indexed == 1) {
    allow_key_t key = {name, n};
    size_t slot;
    return dp__table_find(&u->allow, DP_TABLE_PLAIN, dp__hash_bytes(name, n, ALLOW_SALT), allow_eq, res, &key,
                          &slot) != DP_TABLE_NONE;
  }
  for (size_t i = 0; i < res->ntypes; i++)
    if (allow_name_eq(res->types[i], name, n)) return 1;
  return 0;
}

/* A type name for a message, as the walker's messages show one (its first
 * DP_PATH_NAME_MAX bytes, cut at a character, escaped, "…" when cut). */
static const char *type_shown(const char *name, size_t n, char out[DP__STEP_MAX]) {
  out[dp__name_bare(name, n, out)] = '\0';
  return out;
}

/* A frame that has all its children: closes it and yields its value. */
static int finish_frame(up_t *u, uframe_t *f, dp_value_t *out, const uint8_t *at) {
  f->h->flags &= (uint16_t)~DP_HEAP_OPEN;
  dp_value_t v = hval(f->h);
  *out = v;
  if (f->low < f->node) {
    /* it reaches an open ancestor: remember it, and so does the parent */
    u->nodes[f->node].reserved_ = f->low + 1;
    if (u->top >= 2 && f->low < u->stack[u->top - 2].low) u->stack[u->top - 2].low = f->low;
  }
  if (f->tag != DP_TAG_REDUCE) return 0;
  /* The stand-in holds its type name, NUL-terminated (names with a NUL are
   * refused): the resolver gets all of it, as the allow-list matched it. */
  const char *name = DP_OBJ(v)->class_name;
  size_t name_len = DP_OBJ(v)->class_len;
  int allowed = allowed_type(u, name, name_len);
  if (allowed < 0) return oom_at(u, at, "the index of the resolver's allow-list");
  if (!allowed) return 0;
  /* An allowed custom: rebuild it from its state, unless the state refers
   * to the stand-in itself or to a container around it. */
  char shown[DP__STEP_MAX];
  if (dp_value_refcount(v) != 1 || f->low < f->node) {
    return rd_fail(&u->r, DP_EFORMAT, at,
                      "reduced state of '%s' refers to it or to a container around it: a resolved custom "
                      "cannot be in a cycle", type_shown(name, name_len, shown));
  }
  /* Room to keep the stand-in first: once the resolver has run, nothing
   * may fail before the stand-in is kept. */
  if (u->nkept == u->kept_cap &&
      dp__grow((void **)&u->kept, &u->kept_cap, u->nkept + 1, sizeof *u->kept) != 0)
    return oom_at(u, at, "the list of resolved stand-ins");
  const dp_resolver_t *res = u->opts->resolver;
  dp_value_t made;
  made.u.h = NULL;
  made.kind = DP_KIND_COUNT; /* no kind: a resolver that returns 0 without a value is seen */
  dp_error_t e;
  dp_error_clear(&e);
  int rc = dp__cb_rc(res->resolve(res->ud, name, dp__reduced_state(v), &made, &e), &e, "the resolver");
  if (rc) {
    if (made.kind != DP_KIND_COUNT) dp_value_release(made); /* what a failing resolver left is the library's */
    int first = !u->r.rc;
    return rd_keep_backend(&u->r, first,
                           rd_fail(&u->r, rc, at, "resolving custom '%s' failed: %s",
                                   type_shown(name, name_len, shown), e.message),
                           &e);
  }
  if (made.kind == DP_KIND_COUNT)
    return rd_fail(&u->r, DP_EINVAL, at, "resolving custom '%s' failed: the resolver returned 0 without a value "
                   "(dp_none() is one)", type_shown(name, name_len, shown));
  /* The node table points into the stand-in's state (any node of it may be
   * referred to later): keep the stand-in, and so its state, until the end.
   * The table's entries carry the reader's own word in reserved_ (what open
   * container a node reaches, read at each back-reference to it): a value
   * the resolver made by hand may hold anything there, and is stored
   * without it. */
  u->kept[u->nkept++] = v;
  made.reserved_ = 0;
  u->nodes[f->node] = made;
  *out = made;
  return 0;
}

/* Whether a hashable key holds no tuple that is still being filled (its
 * hash would change under the dict). Hashable keys are bounded trees
 * (dp_value_is_hashable), so this walk is too; a tuple already part of a
 * key (it keeps a key word) was finished then, and is not walked again. */
static int key_finished(dp_value_t k) {
  if (k.kind != DP_TUPLE || dp__key_word(k)) return 1;
  if (k.u.h->flags & DP_HEAP_OPEN) return 0;
  for (size_t i = 0; i < DP_SEQ(k)->len; i++)
    if (!key_finished(DP_SEQ(k)->items[i])) return 0;
  return 1;
}

/* Gives a finished child to the frame on top (stealing it). */
static int deliver(up_t *u, dp_value_t v, const uint8_t *at) {
  if (u->top == 0) {
    u->root = v;
    u->have_root = 1;
    return 0;
  }
  uframe_t *f = &u->stack[u->top - 1];
  dp_error_t e;
  int rc = 0;
  switch (f->tag) {
    case 0:
      rc = dp_list_append(hval(f->h), v, &e);
      break;
    case DP_TAG_TUPLE:
      ((dp_seq_t *)f->h)->items[((dp_seq_t *)f->h)->len - f->remaining] = v;
      break;
    case 'd':
      if (!f->have_key) {
        /* A key must be hashable and finished: a back-reference to a tuple
         * still being filled would change under the dict. */
        if (!dp_value_is_hashable(v)) {
          int k = (int)v.kind;
          dp_value_release(v);
          return rd_fail(&u->r, DP_EFORMAT, at, "dict key of kind %s is not hashable%s",
                            dp_kind_name((dp_kind_t)k), k == DP_TUPLE ? DP__TUPLE_KEY_RULE : "");
        }
        if (!key_finished(v)) {
          dp_value_release(v);
          return rd_fail(&u->r, DP_EFORMAT, at, "dict key refers to an unfinished tuple");
        }
        f->u.key = v;
        f->key_at = at;
        f->have_key = 1;
        return 0;
      }
      f->have_key = 0;
      rc = dp__dict_set_checked(hval(f->h), f->u.key, v, DP__KEEP_ON_EXISTS, &e);
      if (rc == DP__EXISTS) {
        /* named as a path shows it: a str key by its text (cut after 64
         * bytes of it, the quotes kept), any other by its value JSON */
        char key[DP__STEP_MAX];
        int n = f->u.key.kind == DP_STR
                    ? (int)dp__name_quoted(DP_STROBJ(f->u.key)->data, DP_STROBJ(f->u.key)->len, key)
                    : (int)dp__key_text(f->u.key, key);
        dp_value_release(f->u.key);
        dp_value_release(v);
        return rd_fail(&u->r, DP_EFORMAT, f->key_at, "duplicate dict key %.*s", n, key);
      }
      break;
    case DP_TAG_OBJECT: {
      const char *name = f->u.name.s;
      size_t len = f->u.name.n;
      rc = dp__object_set_n(hval(f->h), name, len, v, 0, &e);
      f->u.name.s = NULL;
      if (rc == DP__EXISTS) {
        char shown[DP__STEP_MAX];
        int n = (int)dp__name_quoted(name, len, shown);
        return rd_fail(&u->r, DP_EFORMAT, f->key_at, "duplicate attribute %.*s", n, shown);
      }
      break;
    }
    case DP_TAG_REDUCE:
      rc = dp__object_set_n(hval(f->h), "__reduce__", 10, v, 0, &e);
      break;
  }
  f->remaining--;
  return rc ? rd_pass(&u->r, at, rc, &e) : 0;
}

static int parse_payload(up_t *u) {
  rd_t *r = &u->r;
  int rc = 0, done;
  dp_value_t v;
  if ((rc = read_value(u, &v, &done)) != 0) return rc;
  if (done && (rc = deliver(u, v, r->p)) != 0) return rc;
  while (u->top > 0) {
    uframe_t *f = &u->stack[u->top - 1];
    const uint8_t *at = r->p;
    if (f->remaining == 0 && !(f->tag == 'd' && f->have_key)) {
      const uint8_t *start = f->start;
      if ((rc = finish_frame(u, f, &v, at)) != 0) return rc;
      u->top--;
      if ((rc = deliver(u, v, start)) != 0) return rc;
      continue;
    }
    if (f->tag == DP_TAG_OBJECT && f->u.name.s == NULL) {
      u->owed--; /* claimed with the object (claim) */
      const uint8_t *nat = r->p;
      if ((rc = read_name(r, &f->u.name.s, &f->u.name.n, "attribute name")) != 0 ||
          (rc = check_len(u, nat, f->u.name.n)) != 0)
        return rc;
      f->key_at = nat;
    }
    u->owed--;
    const uint8_t *vstart = r->p;
    if ((rc = read_value(u, &v, &done)) != 0) return rc;
    if (!done) continue;  /* a new frame: its value arrives when it closes */
    if ((rc = deliver(u, v, vstart)) != 0) return rc;
  }
  return 0;
}

/* ---- header, table, entry point ---- */

void dp__frame_header_parse(const uint8_t *h, dp_frame_info_t *fi) {
  fi->version = dp__get_le16(h + 4);
  fi->flags = dp__get_le16(h + 6);
  fi->payload_len = dp__get_le64(h + 8);
  fi->table_len = dp__get_le64(h + 16);
  fi->data_len = dp__get_le64(h + 24);
  fi->checksum = dp__get_le64(h + 32);
  fi->nbuffers = 0;
}

#define NO_BUFFERS_INLINE "inline flag on a frame without buffers (not canonical: a writer sets it only when it carries buffer bytes)"

int dp__frame_lengths_check(const dp_frame_info_t *fi, dp_error_t *err) {
  uint64_t end;
  if (dp__add_ovf(fi->payload_len, fi->table_len, &end) || dp__add_ovf(end, fi->data_len, &end) ||
      dp__add_ovf(end, (uint64_t)DP_FRAME_HEADER, &end))
    return dp__err_at(err, DP_EFORMAT, 8,
                      "header announces %llu + %llu + %llu body bytes: more than a frame can hold (its length "
                      "must fit in 64 bits)",
                      (unsigned long long)fi->payload_len, (unsigned long long)fi->table_len,
                      (unsigned long long)fi->data_len);
  return 0;
}

int dp__frame_header_check(const dp_frame_info_t *fi, uint64_t sum, dp_error_t *err) {
  if (sum != fi->checksum)
    return dp__err_at(err, DP_ECHECKSUM, 32, "checksum mismatch: header says %016llx, content hashes to %016llx",
                      (unsigned long long)fi->checksum, (unsigned long long)sum);
  return dp__frame_fields_check(fi, err);
}

int dp__frame_version_check(unsigned version, dp_error_t *err) {
  if (version != DP_FRAME_VERSION)
    return dp__err_at(err, DP_EVERSION, 4, "unsupported version %u: this build reads frame version %d", version,
                      DP_FRAME_VERSION);
  return 0;
}

int dp__frame_fields_check(const dp_frame_info_t *fi, dp_error_t *err) {
  int rc = dp__frame_version_check(fi->version, err);
  if (rc) return rc;
  if (fi->flags & ~DP_FRAME_FLAG_INLINE)
    return dp__err_at(err, DP_EFORMAT, 6, "unknown frame flags 0x%04x", fi->flags);
  if ((fi->flags & DP_FRAME_FLAG_INLINE) == 0 && fi->data_len != 0)
    return dp__err_at(err, DP_EFORMAT, 24, "data section in a frame without the inline flag");
  return 0;
}

/* Magic first, then version: the layout after the version is that
 * version's, so a frame of another one is refused as such (the error a
 * reader needs: upgrade), whatever follows, even a header cut short after
 * its version bytes; then the header's presence. */
int dp__frame_start_check(const uint8_t *b, size_t n, dp_error_t *err) {
  if (n < 4 || memcmp(b, DP_FRAME_MAGIC, 4) != 0) {
    if (n < 4 && (n == 0 || memcmp(b, DP_FRAME_MAGIC, n) == 0))
      return dp__err_at(err, DP_ETRUNC, (int64_t)n, "truncated frame: %zu byte%s, the header needs %d", n,
                        n == 1 ? "" : "s", DP_FRAME_HEADER);
    return dp__err_at(err, DP_EFORMAT, 0, "not a devpickle frame (bad magic)");
  }
  int rc = n >= 6 ? dp__frame_version_check(dp__get_le16(b + 4), err) : 0;
  if (rc) return rc;
  if (n < DP_FRAME_HEADER) /* the magic is in: 4 bytes at least */
    return dp__err_at(err, DP_ETRUNC, (int64_t)n, "truncated frame: %zu bytes, the header needs %d", n,
                      DP_FRAME_HEADER);
  return 0;
}

int dp_frame_check(const void *bytes, size_t n, dp_frame_info_t *info, dp_error_t *err) {
  const uint8_t *b = bytes;
  if (!bytes && n) return dp__err(err, DP_EINVAL, "dp_frame_check: NULL bytes");
  int rc0 = dp__frame_start_check(b, n, err);
  if (rc0) return rc0;
  dp_frame_info_t fi;
  dp__frame_header_parse(b, &fi);
  int rc = dp__frame_lengths_check(&fi, err);
  if (rc) return rc;
  uint64_t body = n - DP_FRAME_HEADER;
  if (fi.payload_len > body || fi.table_len > body - fi.payload_len ||
      fi.data_len > body - fi.payload_len - fi.table_len) {
    /* Lengths claim more than is here: truncated, or a corrupt header (the
     * checksum cannot be trusted to say which without the missing bytes). */
    return dp__err_at(err, DP_ETRUNC, (int64_t)n,
                      "truncated frame: header announces %llu + %llu + %llu body bytes, %llu present",
                      (unsigned long long)fi.payload_len, (unsigned long long)fi.table_len,
                      (unsigned long long)fi.data_len, (unsigned long long)body);
  }
  if (fi.payload_len + fi.table_len + fi.data_len != body)
    return dp__err_at(err, DP_EFORMAT, (int64_t)(DP_FRAME_HEADER + fi.payload_len + fi.table_len + fi.data_len),
                      "%llu byte%s after the end of the frame",
                      (unsigned long long)(body - fi.payload_len - fi.table_len - fi.data_len),
                      body - fi.payload_len - fi.table_len - fi.data_len == 1 ? "" : "s");
  rc = dp__frame_header_check(&fi, dp__frame_checksum(b, n), err);
  if (rc) return rc;
  /* Count the buffers: the table opens with an array header. */
  rd_t r = {b, b + DP_FRAME_HEADER + fi.payload_len, b + DP_FRAME_HEADER + fi.payload_len + fi.table_len, err, 0};
  uint64_t nb;
  rc = read_array(&r, &nb, "buffer table");
  if (rc) return rc;
  if (nb == 0 && (fi.flags & DP_FRAME_FLAG_INLINE)) return dp__err_at(err, DP_EFORMAT, 6, "%s", NO_BUFFERS_INLINE);
  fi.nbuffers = (uint32_t)nb; /* an array header's count: 32 bits at most */
  if (info) *info = fi;
  return 0;
}

/* A buffer's (device, base), to find one described twice. */
typedef struct bkey {
  uint64_t base;
  uint32_t dev;   /* type << 8 | index */
  uint32_t id;
} bkey_t;

/* The sort key's byte d, least significant first: dev's 2 bytes, then
 * base's 8 (any total order finds equal keys; this one is cheap). */
static inline unsigned bkey_digit(const bkey_t *k, int d) {
  return d < 2 ? (k->dev >> (8 * d)) & 0xffu : (unsigned)(k->base >> (8 * (d - 2))) & 0xffu;
}

/* LSD radix sort, stable (keys come in id order, so equal keys stay in id
 * order): linear whatever the addresses, so a hostile table cannot slow it
 * down. All ten histograms are counted in one pass; a digit that is the
 * same in every key (the high bytes of addresses, usually) is skipped.
 * tmp holds n keys. Returns the array that holds the sorted keys. */
static bkey_t *bkey_sort(bkey_t *k, bkey_t *tmp, size_t n) {
  uint32_t count[10][256];
  memset(count, 0, sizeof count);
  for (size_t i = 0; i < n; i++)
    for (int d = 0; d < 10; d++) count[d][bkey_digit(&k[i], d)]++;
  for (int d = 0; d < 10; d++) {
    if (count[d][bkey_digit(&k[0], d)] == n) continue;
    uint32_t pos[256], sum = 0;
    for (int j = 0; j < 256; j++) {
      pos[j] = sum;
      sum += count[d][j];
    }
    for (size_t i = 0; i < n; i++) tmp[pos[bkey_digit(&k[i], d)]++] = k[i];
    bkey_t *t = k;
    k = tmp;
    tmp = t;
  }
  return k;
}

/* Where descriptor `id` starts (the table was read and checked already). */
static const uint8_t *descriptor_at(up_t *u, const dp_frame_info_t *fi, uint32_t id) {
  rd_t r = u->r;
  r.p = r.base + DP_FRAME_HEADER + fi->payload_len;
  r.end = r.p + fi->table_len;
  uint64_t n, x;
  read_array(&r, &n, "buffer table");
  for (uint32_t i = 0; i < id; i++) {
    uint64_t fields;
    read_array(&r, &fields, "buffer descriptor");
    for (uint64_t j = 0; j < fields; j++) read_uint(&r, &x, "buffer field");
  }
  return r.p;
}

static int check_distinct(up_t *u, const dp_frame_info_t *fi, bkey_t *keys, uint64_t n) {
  if (n < 2) return 0;
  size_t i;
  keys = bkey_sort(keys, keys + n, (size_t)n);
  /* Report the first repeat in table order: the smallest id of a key equal
   * to the one before it. A run of equal keys is in id order (the sort is
   * stable), so that is the second of some run, named with the run's first. */
  size_t rep = SIZE_MAX;
  for (i = 1; i < n; i++)
    if (keys[i].base == keys[i - 1].base && keys[i].dev == keys[i - 1].dev &&
        (rep == SIZE_MAX || keys[i].id < keys[rep].id))
      rep = i;
  if (rep == SIZE_MAX) return 0;
  char dev[16];
  dp_device_t d = {(uint8_t)(keys[rep].dev >> 8), (uint8_t)keys[rep].dev};
  return rd_fail(&u->r, DP_EFORMAT, descriptor_at(u, fi, keys[rep].id),
                    "buffer %u describes %s 0x%llx again (buffer %u did): a frame has one buffer per "
                    "(device, base)", keys[rep].id, dp_device_format(d, dev, sizeof dev),
                    (unsigned long long)keys[rep].base, keys[rep - 1].id);
}

enum { PASS_CHECK, PASS_MAKE, PASS_KEYS, PASS_BIND };
static int read_descriptors(up_t *u, const dp_frame_info_t *fi, uint64_t n, int pass, bkey_t *keys,
                            const uint8_t *data, int *sorted);

static int read_table(up_t *u, const dp_frame_info_t *fi, const uint8_t *data) {
  rd_t *r = &u->r;
  r->p = r->base + DP_FRAME_HEADER + fi->payload_len;
  r->end = r->p + fi->table_len;
  uint64_t n;
  const uint8_t *at = r->p;
  int rc = read_array(r, &n, "buffer table");
  if (rc) return rc;
  if (n == 0 && (fi->flags & DP_FRAME_FLAG_INLINE))
    return rd_fail(r, DP_EFORMAT, r->base + 6, "%s", NO_BUFFERS_INLINE);
  if (n > u->lim.max_buffers) return lim_err(u, at, "buffer count", u->lim.max_buffers);
  u->bufs = dp__alloc_array(n ? n : 1, sizeof *u->bufs);
  if (!u->bufs) return oom_at(u, at, "the buffer list");
  u->bufs_cap = n ? n : 1;
  /* Every descriptor must name a distinct (device, base). Writers list
   * buffers as met, often in address order: the first pass notes whether
   * they are sorted, which shows them distinct. Otherwise a second pass
   * collects keys (2n of them: the radix sort's room) to sort, freed before
   * the payload is read. With a bind callback the table is checked whole
   * before a last pass binds it, so that a bad table binds nothing; without
   * one the first pass makes the storages (a bad table frees them). */
  const uint8_t *first = r->p;
  int bind = u->opts->bind != NULL, sorted;
  rc = read_descriptors(u, fi, n, bind ? PASS_CHECK : PASS_MAKE, NULL, data, &sorted);
  if (rc == 0 && !sorted) {
    size_t nk = 2 * n;
    bkey_t *keys = dp__alloc_array(nk, sizeof *keys);
    if (!keys) return oom_at(u, at, "the buffer keys");
    r->p = first;
    read_descriptors(u, fi, n, PASS_KEYS, keys, data, &sorted);  /* checked already */
    rc = check_distinct(u, fi, keys, n);
    dp__free(keys, nk * sizeof *keys);
  }
  if (rc || !bind) return rc;
  r->p = first;
  return read_descriptors(u, fi, n, PASS_BIND, NULL, data, &sorted);
}

/* Reads the n descriptors, checking each, and notes in *sorted whether
 * their (base, device) increase strictly. The first pass (CHECK or MAKE)
 * also counts inline bytes against the limit; MAKE and BIND make or bind
 * the storages; KEYS fills keys. data: the inline data section, or NULL
 * when it was not kept (the storages then carry no host bytes). */
static int read_descriptors(up_t *u, const dp_frame_info_t *fi, uint64_t n, int pass, bkey_t *keys,
                            const uint8_t *data, int *sorted) {
  rd_t *r = &u->r;
  int is_inline = (fi->flags & DP_FRAME_FLAG_INLINE) != 0;
  int make = pass == PASS_MAKE || pass == PASS_BIND;
  uint64_t data_off = 0, prev_base = 0;
  uint32_t prev_dev = 0;
  const uint8_t *at;
  int rc;
  *sorted = 1;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t fields, dtype, dindex, nbytes, base, doff = 0;
    at = r->p;
    if ((rc = read_array(r, &fields, "buffer descriptor")) != 0) return rc;
    if (fields != (is_inline ? 5u : 4u))
      return rd_fail(r, DP_EFORMAT, at, "buffer descriptor %llu has %llu field%s, expected %d",
                        (unsigned long long)i, (unsigned long long)fields, fields == 1 ? "" : "s", is_inline ? 5 : 4);
    if ((rc = read_uint(r, &dtype, "buffer device type")) || (rc = read_uint(r, &dindex, "buffer device index")) ||
        (rc = read_uint(r, &nbytes, "buffer size")) || (rc = read_uint(r, &base, "buffer address")))
      return rc;
    if (is_inline && (rc = read_uint(r, &doff, "buffer data offset")) != 0) return rc;
    if (dtype >= DP_DEVICE_TYPE_COUNT || dindex > DP_DEVICE_INDEX_MAX || (dtype == DP_DEVICE_CPU && dindex != 0))
      return rd_fail(r, DP_EFORMAT, at, "buffer %llu: invalid device (type %llu, index %llu)",
                        (unsigned long long)i, (unsigned long long)dtype, (unsigned long long)dindex);
    if (nbytes > DP_FRAME_MAX_NBYTES)
      return rd_fail(r, DP_EFORMAT, at, "buffer %llu: size %llu is out of range",
                        (unsigned long long)i, (unsigned long long)nbytes);
    if (is_inline) {
      if (doff != data_off || nbytes > fi->data_len - data_off)
        return rd_fail(r, DP_EFORMAT, at, "buffer %llu: inline data at %llu+%llu does not follow "
                          "the previous buffer within the %llu-byte data section", (unsigned long long)i,
                          (unsigned long long)doff, (unsigned long long)nbytes, (unsigned long long)fi->data_len);
      data_off += nbytes;
      /* the table is read before anything else counts: u->bytes was the
         previous data_off, and the check above keeps this one within
         data_len, so the sum cannot wrap */
      if ((pass == PASS_CHECK || pass == PASS_MAKE) && (u->bytes += nbytes) > u->lim.max_bytes)
        return lim_err(u, at, "total str, bytes and inline size", u->lim.max_bytes);
    }
    uint32_t dev = (uint32_t)(dtype << 8 | dindex);
    if (i > 0 && !(base > prev_base || (base == prev_base && dev > prev_dev))) *sorted = 0;
    prev_base = base;
    prev_dev = dev;
    if (keys) {
      keys[i].base = base;
      keys[i].dev = dev;
      keys[i].id = (uint32_t)i;
    }
    if (!make) continue;
    dp_buffer_desc_t desc = {(uint32_t)i, {(uint8_t)dtype, (uint8_t)dindex}, nbytes, base,
                             is_inline && data ? data + doff : NULL};
    dp_storage_t *st = NULL;
    dp_error_t e;
    dp_error_clear(&e);
    if (u->opts->bind) {
      rc = dp__cb_rc(u->opts->bind(u->opts->bind_ud, &desc, &st, &e), &e, "bind");
      if (rc) {
        dp_storage_release(st); /* what a failing bind left there is the library's to release */
      } else if (!st || st->nbytes < nbytes) {
        dp_storage_release(st);
        rc = dp__err(&e, DP_EINVAL, "bind returned %s", st ? "a storage smaller than the buffer" : "no storage");
      }
      if (rc) {
        int first = !r->rc;
        return rd_keep_backend(r, first,
                               rd_fail(r, rc, at, "binding buffer %llu failed: %s", (unsigned long long)i, e.message),
                               &e);
      }
    } else {
      if ((rc = dp_storage_new(desc.device, (void *)(uintptr_t)base, nbytes, NULL, NULL, &st, &e)) != 0)
        return rd_pass(r, at, rc, &e);
      st->foreign = 1;
      if (desc.data && (rc = dp_storage_set_host_data(st, desc.data, &e)) != 0) {
        dp_storage_release(st);
        return rd_pass(r, at, rc, &e);
      }
    }
    u->bufs[u->nbufs].st = st;
    u->bufs[u->nbufs++].nbytes = nbytes;
  }
  if (r->p != r->end)
    return rd_fail(r, DP_EFORMAT, r->p, "%lld byte%s after the buffer table", (long long)(r->end - r->p),
                   r->end - r->p == 1 ? "" : "s");
  if (is_inline && data_off != fi->data_len)
    return rd_fail(r, DP_EFORMAT, r->end, "%llu byte%s of the data section belong%s to no buffer",
                   (unsigned long long)(fi->data_len - data_off), fi->data_len - data_off == 1 ? "" : "s",
                   fi->data_len - data_off == 1 ? "s" : "");
  return 0;
}

static void resolve_limits(dp_limits_t *l, const dp_limits_t *in);

int dp__frame_table_check(const uint8_t *frame, const dp_frame_info_t *fi, dp_error_t *err) {
  up_t u;
  memset(&u, 0, sizeof u);
  resolve_limits(&u.lim, NULL); /* no limit is checked: max_bytes is UINT64_MAX, the buffer count is not looked at */
  u.r.base = frame;
  u.r.err = err;
  u.r.p = frame + DP_FRAME_HEADER + fi->payload_len;
  u.r.end = u.r.p + fi->table_len;
  uint64_t n;
  int rc = read_array(&u.r, &n, "buffer table"), sorted;
  if (rc) return rc;
  if (n == 0 && (fi->flags & DP_FRAME_FLAG_INLINE))
    return rd_fail(&u.r, DP_EFORMAT, frame + 6, "%s", NO_BUFFERS_INLINE);
  return read_descriptors(&u, fi, n, PASS_CHECK, NULL, NULL, &sorted);
}

static void resolve_limits(dp_limits_t *l, const dp_limits_t *in) {
  l->max_depth = in && in->max_depth ? in->max_depth : DP_DEFAULT_MAX_DEPTH;
  l->max_buffers = in && in->max_buffers ? in->max_buffers : DP_DEFAULT_MAX_BUFFERS;
  l->max_items = in && in->max_items ? in->max_items : DP_DEFAULT_MAX_ITEMS;
  l->max_bytes = in && in->max_bytes ? in->max_bytes : DP_DEFAULT_MAX_BYTES;
  l->max_str = in && in->max_str ? in->max_str : DP_DEFAULT_MAX_STR;
}

static void up_cleanup(up_t *u, int failed) {
  while (u->top > 0) {
    uframe_t *f = &u->stack[--u->top];
    if (f->have_key) dp_value_release(f->u.key);
    f->h->flags &= (uint16_t)~DP_HEAP_OPEN;
    dp_value_release(hval(f->h));
  }
  if (failed && u->have_root) dp_value_release(u->root);
  for (size_t i = 0; i < u->nkept; i++) dp_value_release(u->kept[i]);
  dp__free(u->kept, u->kept_cap * sizeof *u->kept);
  for (size_t i = 0; i < u->nbufs; i++) dp_storage_release(u->bufs[i].st);
  dp__free(u->bufs, u->bufs_cap * sizeof *u->bufs);
  dp__free(u->nodes, u->nodes_cap * sizeof *u->nodes);
  dp__free(u->stack, u->stack_cap * sizeof(uframe_t));
  dp__table_destroy(&u->allow, DP_TABLE_PLAIN);
}

int dp__frame_bind(const uint8_t *frame, const dp_frame_info_t *fi, const dp_unpickle_opts_t *opts,
                   dp_error_t *err) {
  up_t u;
  memset(&u, 0, sizeof u);
  u.opts = opts;
  resolve_limits(&u.lim, &opts->limits);
  u.r.base = frame;
  u.r.err = err;
  int rc = read_table(&u, fi, NULL);
  up_cleanup(&u, 1);
  return rc;
}

/* Reads running on this thread, one inside another's bind or resolve
 * callback (a resolver rebuilding a custom from a frame its state holds):
 * bounded, as walks nested in reduce() are (walk.c), so that frames nested
 * in frames — a hostile input's choice — fail instead of overflowing the
 * stack. The reader itself is iterative; only this nesting recurses. */
static _Thread_local unsigned nested_reads;

static int unpickle_read(const uint8_t *frame, dp_frame_info_t *fi, const uint8_t *data,
                         const dp_unpickle_opts_t *opts, dp_value_t *out, dp_error_t *err);

int dp__unpickle_checked(const uint8_t *frame, dp_frame_info_t *fi, const uint8_t *data,
                         const dp_unpickle_opts_t *opts, dp_value_t *out, dp_error_t *err) {
  /* the public calls checked opts by their names first; a transport's
     received frames come here directly */
  int rc = dp__unpickle_opts_check(opts, "dp_unpickle", err);
  if (rc) return rc;
  if (nested_reads >= DP_MAX_NESTED_UNPICKLES)
    return dp__err_at(err, DP_ELIMIT, 0, "unpickles nested %u deep on this thread (a resolve or bind callback that "
                      "unpickles a frame holding its own type?)", DP_MAX_NESTED_UNPICKLES);
  nested_reads++;
  rc = unpickle_read(frame, fi, data, opts, out, err);
  nested_reads--;
  return rc;
}

static int unpickle_read(const uint8_t *frame, dp_frame_info_t *fi, const uint8_t *data,
                         const dp_unpickle_opts_t *opts, dp_value_t *out, dp_error_t *err) {
  static const dp_unpickle_opts_t no_opts;
  int rc;
  up_t u;
  memset(&u, 0, sizeof u);
  u.opts = opts ? opts : &no_opts;
  resolve_limits(&u.lim, opts ? &opts->limits : NULL);
  u.r.base = frame;
  u.r.err = err;
  rc = read_table(&u, fi, data);
  if (rc == 0) {
    u.r.p = frame + DP_FRAME_HEADER;
    u.r.end = u.r.p + fi->payload_len;
    rc = parse_payload(&u);
    if (rc == 0 && u.r.p != u.r.end)
      rc = rd_fail(&u.r, DP_EFORMAT, u.r.p, "%lld byte%s after the root value in the payload",
                   (long long)(u.r.end - u.r.p), u.r.end - u.r.p == 1 ? "" : "s");
    /* the writer lists only the buffers its walk met */
    if (rc == 0 && u.next_buf < u.nbufs)
      rc = rd_fail(&u.r, DP_EFORMAT, descriptor_at(&u, fi, (uint32_t)u.next_buf),
                      "buffer %zu is referred to by no tensor: a frame lists only the buffers its value uses",
                      u.next_buf);
  }
  if (rc == 0) {
    *out = u.root;
    fi->nbuffers = (uint32_t)u.nbufs;
  }
  up_cleanup(&u, rc != 0);
  return rc;
}

int dp__unpickle_opts_check(const dp_unpickle_opts_t *opts, const char *fn, dp_error_t *err) {
  const dp_resolver_t *res = opts ? opts->resolver : NULL;
  if (res && (!res->resolve || (!res->types && res->ntypes)))
    return dp__err(err, DP_EINVAL, "%s: the resolver has a NULL %s", fn, res->resolve ? "types" : "resolve");
  return 0;
}

int dp_unpickle(const void *bytes, size_t n, const dp_unpickle_opts_t *opts, dp_value_t *out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_unpickle: NULL out");
  if (!bytes && n) return dp__err(err, DP_EINVAL, "dp_unpickle: NULL bytes");
  int rc = dp__unpickle_opts_check(opts, "dp_unpickle", err);
  if (rc) return rc;
  dp_frame_info_t fi;
  rc = dp_frame_check(bytes, n, &fi, err);
  if (rc) return rc;
  const uint8_t *b = bytes;
  return dp__unpickle_checked(b, &fi, b + DP_FRAME_HEADER + fi.payload_len + fi.table_len, opts, out, err);
}
