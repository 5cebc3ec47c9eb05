/* tools/vjson.c — value JSON <-> values, through the public API (paths and
 * names through the library's renderer, core/path.h and pickler/path.h, so
 * that they read as the library's own). Reading parses with our own iterative parser into a jansson tree (jansson's parser
 * stops at 2,048 levels and cannot take NUL in keys); writing streams the
 * text as it walks the value, building no tree. */
#include "vjson.h"
#include "ptrmap.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- base64 (RFC 4648, with padding) ---- */

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_block(const uint8_t *p, size_t n, char *o) {
  uint32_t v = (uint32_t)p[0] << 16 | (n > 1 ? (uint32_t)p[1] << 8 : 0) | (n > 2 ? p[2] : 0);
  o[0] = b64[v >> 18];
  o[1] = b64[(v >> 12) & 63];
  o[2] = n > 1 ? b64[(v >> 6) & 63] : '=';
  o[3] = n > 2 ? b64[v & 63] : '=';
}

char *vjson_b64_encode(const uint8_t *p, size_t n) {
  char *s = malloc((n + 2) / 3 * 4 + 1), *o = s;
  if (!s) return NULL;
  for (size_t i = 0; i < n; i += 3, o += 4) b64_block(p + i, n - i, o);
  *o = '\0';
  return s;
}

/* Each base64 character's value plus one; 0 for every other byte. */
static const uint8_t b64_dec[256] = {
    ['A'] = 1, ['B'] = 2, ['C'] = 3, ['D'] = 4, ['E'] = 5, ['F'] = 6, ['G'] = 7, ['H'] = 8, ['I'] = 9,
    ['J'] = 10, ['K'] = 11, ['L'] = 12, ['M'] = 13, ['N'] = 14, ['O'] = 15, ['P'] = 16, ['Q'] = 17,
    ['R'] = 18, ['S'] = 19, ['T'] = 20, ['U'] = 21, ['V'] = 22, ['W'] = 23, ['X'] = 24, ['Y'] = 25,
    ['Z'] = 26, ['a'] = 27, ['b'] = 28, ['c'] = 29, ['d'] = 30, ['e'] = 31, ['f'] = 32, ['g'] = 33,
    ['h'] = 34, ['i'] = 35, ['j'] = 36, ['k'] = 37, ['l'] = 38, ['m'] = 39, ['n'] = 40, ['o'] = 41,
    ['p'] = 42, ['q'] = 43, ['r'] = 44, ['s'] = 45, ['t'] = 46, ['u'] = 47, ['v'] = 48, ['w'] = 49,
    ['x'] = 50, ['y'] = 51, ['z'] = 52, ['0'] = 53, ['1'] = 54, ['2'] = 55, ['3'] = 56, ['4'] = 57,
    ['5'] = 58, ['6'] = 59, ['7'] = 60, ['8'] = 61, ['9'] = 62, ['+'] = 63, ['/'] = 64,
};

static int b64_val(char c) {
  return (int)b64_dec[(uint8_t)c] - 1;
}

int vjson_b64_decode(const char *s, size_t len, uint8_t **out, size_t *n) {
  if (len % 4) return -1;
  uint8_t *p = malloc(len / 4 * 3 + 1);
  if (!p) return -2;
  size_t k = 0, i = 0;
  /* every block but the last has no padding: four table reads, one test */
  for (; i + 4 < len; i += 4, k += 3) {
    const uint8_t *q = (const uint8_t *)s + i;
    uint32_t a = b64_dec[q[0]], b = b64_dec[q[1]], c = b64_dec[q[2]], d = b64_dec[q[3]];
    if (!a || !b || !c || !d) {
      free(p);
      return -1;
    }
    uint32_t v = (a - 1) << 18 | (b - 1) << 12 | (c - 1) << 6 | (d - 1);
    p[k] = (uint8_t)(v >> 16);
    p[k + 1] = (uint8_t)(v >> 8);
    p[k + 2] = (uint8_t)v;
  }
  for (; i < len; i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (int j = 0; j < 4; j++) {
      char c = s[i + j];
      int d = b64_val(c);
      if (c == '=' && i + 4 == len && j >= 2 && (j == 3 || s[i + 3] == '=')) {
        pad++;
        v <<= 6;
      } else if (d >= 0 && !pad) {
        v = v << 6 | (uint32_t)d;
      } else {
        free(p);
        return -1;
      }
    }
    if ((pad == 1 && (v & 0xff)) || (pad == 2 && (v & 0xffff))) { /* bits past the last byte: not canonical */
      free(p);
      return -1;
    }
    p[k++] = (uint8_t)(v >> 16);
    if (pad < 2) p[k++] = (uint8_t)(v >> 8);
    if (pad < 1) p[k++] = (uint8_t)v;
  }
  *out = p;
  *n = k;
  return 0;
}

/* ---- floats ---- */

/* A float as unpack writes it: the number with 17 significant digits (and
 * ".0" when it would read as an int) and 1 returned, or the text of its
 * {"$float": ...} form and 0 returned (inf, -inf, nan, or a NaN's bits). */
int vjson_float_text(double f, char *b, size_t cap) {
  uint64_t bits;
  memcpy(&bits, &f, sizeof bits);
  if (isfinite(f)) {
    int n = snprintf(b, cap, "%.17g", f);
    if (!strpbrk(b, ".e")) snprintf(b + n, cap - (size_t)n, ".0");
    return 1;
  }
  /* NaNs other than the default quiet one keep their bits: distinct NaN keys stay distinct */
  if (isnan(f) && bits != VJSON_DEFAULT_NAN_BITS) snprintf(b, cap, "0x%016" PRIx64, bits);
  else snprintf(b, cap, "%s", isnan(f) ? "nan" : f > 0 ? "inf" : "-inf");
  return 0;
}

/* ---- parsing ---- */

typedef struct ps {
  const char *s, *end, *p;
  char *msg;
  size_t msgsize;
  char *buf;      /* string scratch */
  size_t cap, len;
  char *key;      /* the member key being read */
  size_t keycap, keylen;
  const char *key_at; /* where that key starts: a duplicate is reported there */
  int prefix;     /* the text may go on past end (vjson_prefix_fails) */
  int keep;       /* a prefix's parse is reading a key: it keeps that string */
  struct pkey { uint64_t h; size_t obj, at; } *pkeys; /* a prefix's keys of open objects, a stack */
  size_t pkcap;
  dp__table_t ptab; /* their index (core/table.h): ptab.count keys are on the stack */
  int cut;        /* the error may be the end's doing: more text could mend it */
} ps_t;

static int perr(ps_t *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int perr(ps_t *ps, const char *fmt, ...) {
  char what[160 + DP__STEP_MAX];  /* room for a key, quoted and cut */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  size_t line = 1, col = 1;
  for (const char *c = ps->s; c < ps->p; c++) {
    if (*c == '\n') {
      line++;
      col = 1;
    } else if (((unsigned char)*c & 0xC0) != 0x80) {
      col++;
    }
  }
  snprintf(ps->msg, ps->msgsize, "%s (line %zu, column %zu)", what, line, col);
  return -1;
}

/* An error met at the end of the text, or near enough that the bytes after
 * it could change the verdict (a number or literal running into the end, a
 * UTF-8 sequence or escape cut there): final only when the text is whole. */
static int cut(ps_t *ps) {
  ps->cut = 1;
  return -1;
}

static void skip_ws(ps_t *ps) {
  while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) ps->p++;
}

static int buf_put(ps_t *ps, const char *c, size_t n) {
  if (ps->prefix && !ps->keep) return 0; /* it keeps no strings but keys */
  if (ps->len + n > ps->cap) {
    size_t ncap = ps->cap ? ps->cap : 64;
    while (ncap < ps->len + n) ncap *= 2;
    char *b = realloc(ps->buf, ncap);
    if (!b) return perr(ps, "%s", VJSON_NO_MEMORY), cut(ps);
    ps->buf = b;
    ps->cap = ncap;
  }
  memcpy(ps->buf + ps->len, c, n);
  ps->len += n;
  return 0;
}

/* Length of the well-formed UTF-8 sequence at p (RFC 3629), or 0. */
static size_t utf8_seq_cp(const unsigned char *p, const unsigned char *end, uint32_t *cpp);
static size_t utf8_seq(const unsigned char *p, const unsigned char *end) {
  uint32_t cp;
  return utf8_seq_cp(p, end, &cp);
}

/* A character a terminal shows as nothing, or as a space: control and
 * format characters, spaces other than ' ', the byte order mark. */
static int invisible(uint32_t cp) {
  return cp <= 0xA0 || cp == 0xAD || cp == 0x34F || cp == 0x61C || cp == 0x115F || cp == 0x1160 ||
         cp == 0x1680 || (cp >= 0x17B4 && cp <= 0x17B5) || (cp >= 0x180B && cp <= 0x180F) ||
         (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) || (cp >= 0x205F && cp <= 0x206F) ||
         cp == 0x2800 || cp == 0x3000 || cp == 0x3164 || (cp >= 0xFE00 && cp <= 0xFE0F) || cp == 0xFEFF ||
         cp == 0xFFA0 || (cp >= 0xFFF0 && cp <= 0xFFFB) || (cp >= 0x13430 && cp <= 0x1343F) ||
         (cp >= 0x1BCA0 && cp <= 0x1BCA3) || (cp >= 0x1D173 && cp <= 0x1D17A) || (cp >= 0xE0000 && cp <= 0xE0FFF);
}

/* The length of the UTF-8 character at p (0: not one) and its code point. */
static size_t utf8_seq_cp(const unsigned char *p, const unsigned char *end, uint32_t *cpp) {
  unsigned c = p[0];
  size_t n;
  uint32_t cp;
  *cpp = c;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) n = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, cp = c & 0x07;
  else return 0;
  if ((size_t)(end - p) < n) return 0;
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = cp << 6 | (p[i] & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
    return 0;
  *cpp = cp;
  return n;
}

/* The character at ps->p as a message shows it: 'c' for printable ASCII or
 * a whole UTF-8 character, U+XXXX for one that would show as nothing or a
 * space (a byte order mark, a zero-width or non-breaking space), else its
 * byte in hex (a NUL, a control character, a byte that starts no UTF-8
 * character). Near the end of a
 * prefix the error is marked cut: the same byte may show otherwise once the
 * text goes on. */
static const char *char_at(ps_t *ps, char *out, size_t size) {
  unsigned char c = (unsigned char)*ps->p;
  if (ps->end - ps->p < 4) ps->cut = 1; /* how it shows may depend on what follows */
  uint32_t cp;
  size_t n = utf8_seq_cp((const unsigned char *)ps->p, (const unsigned char *)ps->end, &cp);
  if ((c >= 0x20 && c < 0x7f) || (c >= 0x80 && n && !invisible(cp))) snprintf(out, size, "'%.*s'", (int)n, ps->p);
  else if (c >= 0x80 && n) snprintf(out, size, "U+%04X", (unsigned)cp); /* shown, it would look like nothing */
  else snprintf(out, size, "byte 0x%02X", c);
  return out;
}

/* The four hex digits of a \\u escape at ps->p; -1 when they are not (the
 * caller reports it where the escape starts). */
static int hex4(ps_t *ps, uint32_t *out) {
  if (ps->end - ps->p < 4) return -1;
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    char c = ps->p[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return -1;
    v = v << 4 | (uint32_t)d;
  }
  ps->p += 4;
  *out = v;
  return 0;
}

/* An error in the escape that starts (its backslash) at esc: reported there,
 * where the offending item starts, as every other error is. */
static int esc_err(ps_t *ps, const char *esc, const char *what) {
  ps->p = esc;
  return perr(ps, "%s", what);
}

/* The text ends inside a string, in a character or an escape that more text
 * could complete: input that ends too soon, reported at its end. */
static int str_ends(ps_t *ps) {
  ps->p = ps->end;
  perr(ps, "premature end of input in a string");
  return cut(ps);
}

/* Whether the bytes from p to the end start a UTF-8 character that more
 * bytes would complete (any lead byte's constraints on the next byte are
 * met by 0x80 or 0xBF). */
static int utf8_cut(const char *p, const char *end) {
  size_t k = (size_t)(end - p);
  unsigned char b[4];
  for (int f = 0; f < 2 && k < 4; f++) {
    memcpy(b, p, k);
    memset(b + k, f ? 0xBF : 0x80, 4 - k);
    if (utf8_seq(b, b + 4) > k) return 1;
  }
  return 0;
}

/* Whether the text from p to the end is the start of a \u escape that
 * more text would complete: "", "\", "\u", "\u0", ... "\u0a1". */
static int escape_cut(const char *p, const char *end) {
  size_t k = (size_t)(end - p);
  if (k >= 6 || (k >= 1 && p[0] != '\\') || (k >= 2 && p[1] != 'u')) return 0;
  for (size_t i = 2; i < k; i++)
    if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f') || (p[i] >= 'A' && p[i] <= 'F'))) return 0;
  return 1;
}

/* A string token into ps->buf/len (not terminated; may hold NUL bytes). */
static int parse_string(ps_t *ps) {
  ps->len = 0;
  ps->p++;  /* the opening quote */
  for (;;) {
    if (ps->p >= ps->end) return perr(ps, "premature end of input in a string"), cut(ps);
    unsigned char c = (unsigned char)*ps->p;
    if (c == '"') {
      ps->p++;
      return 0;
    }
    if (c < 0x20) return perr(ps, "control character 0x%02x in a string", c);
    if (c < 0x80 && c != '\\') { /* a run of plain ASCII (base64 data, most keys): one copy */
      const char *run = ps->p;
      while (ps->p < ps->end && (unsigned char)*ps->p >= 0x20 && (unsigned char)*ps->p < 0x80 && *ps->p != '"' &&
             *ps->p != '\\')
        ps->p++;
      if (buf_put(ps, run, (size_t)(ps->p - run))) return -1;
      continue;
    }
    if (c != '\\') {
      size_t n = utf8_seq((const unsigned char *)ps->p, (const unsigned char *)ps->end);
      if (!n) return utf8_cut(ps->p, ps->end) ? str_ends(ps) : perr(ps, "invalid UTF-8 in a string");
      if (buf_put(ps, ps->p, n)) return -1;
      ps->p += n;
      continue;
    }
    const char *esc = ps->p;
    if (++ps->p >= ps->end) return perr(ps, "premature end of input in a string"), cut(ps);
    char e = *ps->p++, one;
    switch (e) {
      case '"': case '\\': case '/': one = e; break;
      case 'b': one = '\b'; break;
      case 'f': one = '\f'; break;
      case 'n': one = '\n'; break;
      case 'r': one = '\r'; break;
      case 't': one = '\t'; break;
      case 'u': {
        uint32_t cp, lo;
        if (escape_cut(esc, ps->end)) return str_ends(ps);
        if (hex4(ps, &cp)) return esc_err(ps, esc, "invalid \\u escape");
        if (cp >= 0xDC00 && cp <= 0xDFFF) return esc_err(ps, esc, "invalid \\u escape: a lone low surrogate");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (escape_cut(ps->p, ps->end)) return str_ends(ps); /* its low surrogate may follow */
          if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u')
            return esc_err(ps, esc, "invalid \\u escape: a lone high surrogate");
          const char *esc2 = ps->p;
          ps->p += 2;
          if (hex4(ps, &lo)) return esc_err(ps, esc2, "invalid \\u escape");
          if (lo < 0xDC00 || lo > 0xDFFF) return esc_err(ps, esc, "invalid \\u escape: a lone high surrogate");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        char u[4];
        size_t n;
        if (cp < 0x80) u[0] = (char)cp, n = 1;
        else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 63)), n = 2;
        else if (cp < 0x10000)
          u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 63)), u[2] = (char)(0x80 | (cp & 63)), n = 3;
        else
          u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 63)), u[2] = (char)(0x80 | ((cp >> 6) & 63)),
          u[3] = (char)(0x80 | (cp & 63)), n = 4;
        if (buf_put(ps, u, n)) return -1;
        continue;
      }
      default: {  /* the character after the backslash as char_at shows it (a raw byte never) */
        char ch[16], what[64];
        ps->p = esc + 1;
        char_at(ps, ch, sizeof ch);
        if (ch[0] == '\'') snprintf(what, sizeof what, "invalid escape '\\%s in a string", ch + 1);
        else snprintf(what, sizeof what, "invalid escape: '\\' before %s in a string", ch);
        return esc_err(ps, esc, what);
      }
    }
    if (buf_put(ps, &one, 1)) return -1;
  }
}

/* The text ends inside a number or literal that more text could complete:
 * input that ends too soon, reported at its end as an unclosed container
 * is (README, "The CLI"), not as a bad token where it starts. */
static json_t *ends_too_soon(ps_t *ps, const char *what) {
  ps->p = ps->end;
  perr(ps, "%s", what);
  cut(ps);
  return NULL;
}

static json_t *parse_number(ps_t *ps) {
  const char *q = ps->p;
  int real = 0;
  if (q < ps->end && *q == '-') q++;
  /* each fault is reported where the number starts, and says what RFC 8259
   * wants there ("invalid number" and "invalid token" said nothing more) */
  if (q >= ps->end) return ends_too_soon(ps, "premature end of input in a number");
  if (*q < '0' || *q > '9') return perr(ps, "invalid number: a digit must follow '-'"), NULL;
  if (*q == '0') q++;
  else while (q < ps->end && *q >= '0' && *q <= '9') q++;
  if (q < ps->end && *q >= '0' && *q <= '9') /* after a leading 0: "01" */
    return perr(ps, "invalid number: a leading zero (JSON writes 1, not 01)"), NULL;
  if (q < ps->end && *q == '.') {
    real = 1;
    if (++q >= ps->end) return ends_too_soon(ps, "premature end of input in a number");
    if (*q < '0' || *q > '9') return perr(ps, "invalid number: a digit must follow '.'"), NULL;
    while (q < ps->end && *q >= '0' && *q <= '9') q++;
  }
  if (q < ps->end && (*q == 'e' || *q == 'E')) {
    real = 1;
    q++;
    if (q < ps->end && (*q == '+' || *q == '-')) q++;
    if (q >= ps->end) return ends_too_soon(ps, "premature end of input in a number");
    if (*q < '0' || *q > '9') return perr(ps, "invalid number: a digit must follow the exponent's 'e'"), NULL;
    while (q < ps->end && *q >= '0' && *q <= '9') q++;
  }
  if (q == ps->end && ps->prefix) return perr(ps, "premature end of input in a number"), cut(ps), NULL;
  /* Any length is a number (RFC 8259): a long one is copied to the heap
   * (strtod reads a long mantissa in linear time). */
  char small[512];
  size_t n = (size_t)(q - ps->p);
  char *tmp = n < sizeof small ? small : malloc(n + 1);
  if (!tmp) return perr(ps, "%s", VJSON_NO_MEMORY), cut(ps), NULL;
  memcpy(tmp, ps->p, n);
  tmp[n] = '\0';
  errno = 0;
  json_t *j;
  const char *err = NULL;
  if (real) {
    double d = strtod(tmp, NULL);
    if (errno == ERANGE && (d == HUGE_VAL || d == -HUGE_VAL))
      err = d > 0 ? "real number overflow; write an infinity as {\"$float\": \"inf\"}"
                  : "real number overflow; write an infinity as {\"$float\": \"-inf\"}";
    j = err ? NULL : ps->prefix ? json_null() : json_real(d);
  } else {
    long long v = strtoll(tmp, NULL, 10);
    if (errno == ERANGE) err = "integer";
    j = err ? NULL : ps->prefix ? json_null() : json_integer(v);
  }
  if (err && !real) { /* the integer as written, its sign and first 40 digits when longer */
    size_t sign = tmp[0] == '-', digits = n - sign;
    if (digits > 40)
      perr(ps, "integer %.*s… (%zu digits) is outside int64 (-2^63 .. 2^63-1)", (int)(sign + 40), tmp, digits);
    else perr(ps, "integer %s is outside int64 (-2^63 .. 2^63-1)", tmp);
  } else if (err) {
    perr(ps, "%s", err);
  }
  if (tmp != small) free(tmp);
  if (err) return NULL;
  if (!j) return perr(ps, "%s", VJSON_NO_MEMORY), cut(ps), NULL;
  ps->p = q;
  return j;
}

/* A prefix's parse builds nothing (it only judges the text): its scalars
 * are jansson's null, its containers these, which json_decref leaves alone
 * as it does jansson's own singletons (refcount -1). */
static json_t object_mark = {JSON_OBJECT, (size_t)-1}, array_mark = {JSON_ARRAY, (size_t)-1};

/* Grows *stack to hold at least need entries; 0 when memory ran out. */
static int grow_stack(json_t ***stack, size_t *cap, size_t need) {
  size_t ncap = *cap ? 2 * *cap : 64;
  if (ncap < need) ncap = need;
  json_t **s = ncap <= SIZE_MAX / sizeof *s ? realloc(*stack, ncap * sizeof *s) : NULL;
  if (!s) return 0;
  *stack = s;
  *cap = ncap;
  return 1;
}

/* NaN, Infinity and -Infinity, which Python's json.dumps writes and JSON
 * has not: named where they start, with the value JSON that spells them
 * (they said "unexpected 'N'" and "invalid token"). 1 when the text at
 * ps->p is one (reported), else 0; a text that ends inside one may yet be
 * one (cut), so that a prefix's parse fails as the whole text's does. */
static int nonjson_float(ps_t *ps) {
  static const struct {
    const char *word, *tag;
  } w[] = {{"NaN", "nan"}, {"Infinity", "inf"}, {"-Infinity", "-inf"}};
  size_t left = (size_t)(ps->end - ps->p);
  for (size_t i = 0; i < sizeof w / sizeof *w; i++) {
    size_t n = strlen(w[i].word);
    if (left < n && memcmp(ps->p, w[i].word, left) == 0) ps->cut = 1;
    if (left >= n && memcmp(ps->p, w[i].word, n) == 0) {
      perr(ps, "%s is no JSON number: write {\"$float\": \"%s\"}", w[i].word, w[i].tag);
      return 1;
    }
  }
  return 0;
}

/* A scalar token, or a new empty container (the caller fills it). */
static json_t *parse_token(ps_t *ps) {
  skip_ws(ps);
  if (ps->p >= ps->end) return perr(ps, "premature end of input"), cut(ps), NULL;
  json_t *j = NULL;
  switch (*ps->p) {
    case '{': j = ps->prefix ? &object_mark : json_object(); ps->p++; break;
    case '[': j = ps->prefix ? &array_mark : json_array(); ps->p++; break;
    case '"':
      if (parse_string(ps)) return NULL;
      j = ps->prefix ? json_null() : json_stringn_nocheck(ps->len ? ps->buf : "", ps->len);
      break;
    case 't': case 'f': case 'n': {
      static const char *const lit[] = {"true", "false", "null"};
      int k = *ps->p == 't' ? 0 : *ps->p == 'f' ? 1 : 2;
      size_t n = strlen(lit[k]), left = (size_t)(ps->end - ps->p);
      if (left < n && memcmp(ps->p, lit[k], left) == 0) return ends_too_soon(ps, "premature end of input");
      if (left < n || memcmp(ps->p, lit[k], n) != 0) return perr(ps, "invalid token"), NULL;
      ps->p += n;
      j = k == 0 ? json_true() : k == 1 ? json_false() : json_null();
      break;
    }
    default:
      if (nonjson_float(ps)) return NULL;
      if (*ps->p == '-' || (*ps->p >= '0' && *ps->p <= '9')) return parse_number(ps);
      {
        char ch[16];
        return perr(ps, "unexpected %s", char_at(ps, ch, sizeof ch)), NULL;
      }
  }
  if (!j) perr(ps, "%s", VJSON_NO_MEMORY), cut(ps);
  return j;
}

/* Reads `"key" :` into ps->buf/len. */
static int parse_key(ps_t *ps, int after_comma) {
  skip_ws(ps);
  if (ps->p >= ps->end) return perr(ps, "premature end of input"), cut(ps);
  char ch[16];
  if (*ps->p == '}' && after_comma) return perr(ps, "a key expected after ',', not '}' (a trailing comma)");
  if (*ps->p != '"')
    return perr(ps, after_comma ? "a key (a string) expected, not %s" : "a key (a string) or '}' expected, not %s",
                char_at(ps, ch, sizeof ch));
  ps->key_at = ps->p;
  ps->keep = 1;
  int rc = parse_string(ps);
  ps->keep = 0;
  if (rc) return -1;
  if (ps->len + 1 > ps->keycap) {
    char *k = realloc(ps->key, ps->len + 1);
    if (!k) return perr(ps, "%s", VJSON_NO_MEMORY), cut(ps);
    ps->key = k;
    ps->keycap = ps->len + 1;
  }
  memcpy(ps->key, ps->buf ? ps->buf : "", ps->len);
  ps->key[ps->len] = '\0';
  ps->keylen = ps->len;
  skip_ws(ps);
  if (ps->p >= ps->end) cut(ps);
  if (ps->p >= ps->end) return perr(ps, "':' expected");
  if (*ps->p != ':') return perr(ps, "':' expected, not %s", char_at(ps, ch, sizeof ch));
  ps->p++;
  return 0;
}

/* Whether the key just read (ps->key) repeats one of object obj's (a
 * number of its own among the objects a prefix opens). A prefix builds no
 * objects; so that a duplicate key fails it as it fails the whole text (an
 * endless stream behind one is not read on), it keeps the keys of the
 * objects still open — each key's hash and where it starts, a stack that an
 * object's closing cuts back (prefix_keys_cut) — in the library's table,
 * and decodes an earlier key again to compare only when the hashes agree:
 * time and memory stay linear in the text. -1 when out of memory. */
typedef struct pkey_probe {
  uint64_t h;
  size_t obj;
} pkey_probe_t;

static int pkey_same(const void *ctx, size_t i, const void *key) {
  const ps_t *ps = ctx;
  const pkey_probe_t *k = key;
  const struct pkey *e = &ps->pkeys[i];
  if (e->obj != k->obj || e->h != k->h) return 0;
  ps_t q = *ps; /* the earlier key, decoded again: it parsed once, it parses alike */
  q.p = ps->s + e->at;
  q.buf = NULL;
  q.cap = 0;
  q.keep = 1;
  int same = parse_string(&q) == 0 && q.len == ps->keylen && memcmp(q.buf ? q.buf : "", ps->key, q.len) == 0;
  free(q.buf);
  return same;
}

static uint64_t pkey_hash_at(const void *ctx, size_t i) { return ((const ps_t *)ctx)->pkeys[i].h; }

static int prefix_key_repeats(ps_t *ps, size_t obj) {
  pkey_probe_t k = {dp__hash_bytes(ps->key, ps->keylen, obj), obj};
  size_t slot, n = ps->ptab.count;
  if (dp__table_find(&ps->ptab, DP_TABLE_PLAIN, k.h, pkey_same, ps, &k, &slot) != DP_TABLE_NONE) return 1;
  if (n == ps->pkcap) {
    size_t ncap = ps->pkcap ? ps->pkcap * 2 : 64;
    struct pkey *nk = realloc(ps->pkeys, ncap * sizeof *nk);
    if (!nk) return -1;
    ps->pkeys = nk;
    ps->pkcap = ncap;
  }
  ps->pkeys[n] = (struct pkey){k.h, obj, (size_t)(ps->key_at - ps->s)};
  if (dp__table_full(&ps->ptab)) {
    if (dp__table_grow(&ps->ptab, DP_TABLE_PLAIN, n, 0, pkey_hash_at, ps) != 0) return -1;
    slot = dp__table_empty_slot(&ps->ptab, DP_TABLE_PLAIN, k.h);
  }
  dp__table_put(&ps->ptab, DP_TABLE_PLAIN, slot, k.h, n);
  return 0;
}

/* Cuts the stack of a prefix's keys back to its first `keep` (an object
 * closes: its keys go with it), the last first, so that the rest stay 0 ..
 * keep-1 as the table wants them. */
static void prefix_keys_cut(ps_t *ps, size_t keep) {
  dp__table_t *t = &ps->ptab;
  while (t->count > keep) {
    size_t k = t->count - 1, mask = t->nslots - 1, j = ps->pkeys[k].h & mask;
    while (dp__table_ref(t, DP_TABLE_PLAIN, j) != k + 1) j = (j + 1) & mask;
    dp__table_remove(t, DP_TABLE_PLAIN, j, pkey_hash_at, ps);
  }
}

/* The parser of vjson_parse; with prefix, text may go on past n, and
 * *was_cut tells whether a failure could be the end's doing. */
static json_t *parse_text(const char *text, size_t n, int prefix, char *msg, size_t msgsize, size_t *errpos,
                          int *was_cut) {
  ps_t ps = {.s = text, .end = text + n, .p = text, .msg = msg, .msgsize = msgsize, .prefix = prefix};
  dp__table_init(&ps.ptab);
  json_t **stack = malloc(sizeof *stack * (VJSON_MAX_JSON_DEPTH + 1));
  /* a prefix's open containers: a number each, and where their keys start */
  struct pobj { size_t num, keys; } *objs = prefix ? malloc(sizeof *objs * (VJSON_MAX_JSON_DEPTH + 1)) : NULL;
  size_t top = 0, nobjs = 0;
  json_t *root = NULL;
  int bad = !stack || (prefix && !objs);
  if (bad) perr(&ps, "%s", VJSON_NO_MEMORY), cut(&ps);
  /* A UTF-8 byte order mark is skipped (RFC 8259 lets a parser ignore it);
   * offsets still count it, columns do not. One of UTF-16 or UTF-32 says
   * what the text is. */
  if (!bad && n >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) {
    ps.s = ps.p = text + 3;
  } else if (!bad && n >= 2 && (memcmp(text, "\xFF\xFE", 2) == 0 || memcmp(text, "\xFE\xFF", 2) == 0 ||
                                (n >= 4 && memcmp(text, "\0\0\xFE\xFF", 4) == 0))) {
    bad = perr(&ps, "a UTF-16 or UTF-32 byte order mark: value JSON is UTF-8");
  }
  while (!bad) {
    /* ps.buf holds the key when the open container is an object */
    json_t *v = parse_token(&ps);
    if (!v) {
      bad = 1;
      break;
    }
    if (!root) {
      root = v;
    } else if (!prefix) {
      json_t *c = stack[top - 1];
      int rc = json_is_array(c) ? json_array_append_new(c, v) : json_object_setn_new_nocheck(c, ps.key, ps.keylen, v);
      if (rc) {
        bad = perr(&ps, "%s", VJSON_NO_MEMORY), cut(&ps);
        break;
      }
    }
    if (json_is_object(v) || json_is_array(v)) {
      if (top == VJSON_MAX_JSON_DEPTH) {
        ps.p--;
        bad = perr(&ps, "nesting deeper than %d levels", VJSON_MAX_JSON_DEPTH);
        break;
      }
      if (prefix) objs[top] = (struct pobj){++nobjs, ps.ptab.count};
      stack[top++] = v;
      skip_ws(&ps);
      char close = json_is_array(v) ? ']' : '}';
      if (ps.p < ps.end && *ps.p == close) {
        ps.p++;
        top--;
      } else {
        if (json_is_object(v) && parse_key(&ps, 0)) {
          bad = 1;
          break;
        }
        if (json_is_object(v) && prefix && prefix_key_repeats(&ps, objs[top - 1].num) < 0) {
          bad = perr(&ps, "%s", VJSON_NO_MEMORY), cut(&ps);
          break;
        }
        continue;
      }
    }
    /* a value is complete: close containers, or move to the next item */
    for (;;) {
      if (top == 0) break;
      json_t *c = stack[top - 1];
      skip_ws(&ps);
      char close = json_is_array(c) ? ']' : '}';
      if (ps.p < ps.end && *ps.p == ',') {
        ps.p++;
        if (json_is_array(c)) { /* named as an object's is: '[1,]' is a trailing comma, not a stray ']' */
          skip_ws(&ps);
          if (ps.p < ps.end && *ps.p == ']') bad = perr(&ps, "a value expected after ',', not ']' (a trailing comma)");
        } else {
          if (parse_key(&ps, 1)) {
            bad = 1;
            break;
          }
          int again = prefix ? prefix_key_repeats(&ps, objs[top - 1].num) : json_object_getn(c, ps.key, ps.keylen) != NULL;
          if (again < 0) {
            bad = perr(&ps, "%s", VJSON_NO_MEMORY), cut(&ps);
            break;
          }
          if (again) {
            char key[DP__STEP_MAX];  /* named as a path names it: escaped, cut after 64 bytes */
            key[dp__name_quoted(ps.key, ps.keylen, key)] = '\0';
            ps.p = ps.key_at;
            bad = perr(&ps, "duplicate object key %s", key);
            break;
          }
        }
        break;
      }
      if (ps.p < ps.end && *ps.p == close) {
        ps.p++;
        if (prefix) prefix_keys_cut(&ps, objs[top - 1].keys); /* its keys go with it */
        top--;
        continue;
      }
      char ch[16];  /* what may follow an item: what the object case says of a key */
      bad = ps.p < ps.end ? perr(&ps, "',' or '%c' expected, not %s", close, char_at(&ps, ch, sizeof ch))
                          : (perr(&ps, "premature end of input"), cut(&ps));
      break;
    }
    if (bad || top == 0) break;
  }
  if (!bad) {
    skip_ws(&ps);
    char ch[16];
    if (ps.p != ps.end) bad = perr(&ps, "end of input expected, not %s", char_at(&ps, ch, sizeof ch));
  }
  free(stack);
  free(objs);
  free(ps.pkeys);
  dp__table_destroy(&ps.ptab, DP_TABLE_PLAIN);
  free(ps.buf);
  free(ps.key);
  *was_cut = ps.cut;
  if (bad) {
    vjson_free(root);
    if (errpos) *errpos = (size_t)(ps.p - text);
    return NULL;
  }
  return root;
}

void vjson_free(json_t *j) {
  json_t **stack = NULL;
  size_t n = 0, cap = 0;
  while (j) {
    /* a container only this tree holds gives up its last item (held here
     * meanwhile), then goes back on the stack: one step an item, and a
     * container is freed once empty, where jansson does not recurse */
    size_t size = json_is_array(j) ? json_array_size(j) : json_is_object(j) ? json_object_size(j) : 0;
    if (j->refcount == 1 && size > 0 && (n + 2 <= cap || grow_stack(&stack, &cap, n + 2))) {
      json_t *item;
      if (json_is_array(j)) {
        item = json_incref(json_array_get(j, size - 1));
        json_array_remove(j, size - 1);
      } else {
        void *it = json_object_iter(j);
        item = json_incref(json_object_iter_value(it));
        json_object_deln(j, json_object_iter_key(it), json_object_iter_key_len(it));
      }
      stack[n++] = j;
      j = item;
      continue;
    }
    json_decref(j); /* a leaf, an empty container, one held elsewhere too, or no memory for the stack */
    j = n ? stack[--n] : NULL;
  }
  free(stack);
}

json_t *vjson_parse(const char *text, size_t n, char *msg, size_t msgsize, size_t *errpos) {
  int was_cut;
  return parse_text(text, n, 0, msg, msgsize, errpos, &was_cut);
}

int vjson_prefix_fails(const char *text, size_t n) {
  if (n < 4) return 0; /* a byte order mark may be cut */
  char msg[256];
  int was_cut;
  json_t *j = parse_text(text, n, 1, msg, sizeof msg, NULL, &was_cut);
  json_decref(j);
  return !j && !was_cut;
}

/* ---- reading ---- */

typedef struct idnode {
  char *name;
  size_t len;
  dp_value_t v;   /* borrowed */
  int open;       /* a container still being filled */
} idnode_t;

/* An index of r->ids by name, in the library's table (core/table.h): item k
 * is r->ids[at[k]]. Lookups stay O(1) however many $ids a document has. */
typedef struct idx {
  dp__table_t t;
  size_t *at;
  size_t cap;
} idx_t;

typedef struct rd {
  char *msg;
  size_t msgsize;
  char *path;        /* the JSON path being read: steps after "$" */
  size_t plen, pcap;
  size_t *marks;     /* where each step starts */
  size_t nmarks, mcap;
  idnode_t *ids;
  size_t nids, idcap;
  idx_t by_name;
  ptrmap_t by_node;  /* a named node's identity -> its index in ids (size_t); the first name kept */
  ptrmap_t closed;  /* tuple keys found closed (key_is_open) */
  dp_ptrset_t *stset;      /* (device, ptr) -> storage index */
  dp_storage_t **storages;
  unsigned char *has_data;  /* per storage: a tensor of it carried "data" */
  const json_t **first;     /* per storage: its first tensor's body, to find its path again */
  size_t nst, stcap;
  const json_t *locate;     /* read_doc's second pass: the tensor whose path is wanted */
  int located;              /* ... met: its path is in msg */
  dp_error_t e;   /* one for every call: the reader recurses, its frames stay small */
  char scratch[DP__STEP_MAX];  /* a rendered step or name, for the same reason */
} rd_t;

/* The reader's tables hash with the library's per-process secret
 * (core/table.h): $id names keyed as strings, nodes by address (ptrmap). */
static uint64_t name_hash(const char *s, size_t n) { return dp__hash_bytes(s, n, 0); }

typedef struct name_key {
  const char *name;
  size_t len;
} name_key_t;

typedef struct idx_ctx {
  const rd_t *r;
  const idx_t *x;
} idx_ctx_t;

static const idnode_t *idx_item(const idx_ctx_t *c, size_t k) { return &c->r->ids[c->x->at[k]]; }
static int name_eq(const void *ctx, size_t k, const void *key) {
  const idnode_t *e = idx_item(ctx, k);
  const name_key_t *n = key;
  return e->len == n->len && memcmp(e->name, n->name, n->len) == 0;
}
static uint64_t name_hash_at(const void *ctx, size_t k) {
  const idnode_t *e = idx_item(ctx, k);
  return name_hash(e->name, e->len);
}

/* The entry of r->ids that x holds for (name, len); NULL if none. */
static idnode_t *idx_find(rd_t *r, const idx_t *x, const char *name, size_t len) {
  idx_ctx_t c = {r, x};
  name_key_t k = {name, len};
  size_t slot, at = dp__table_find(&x->t, DP_TABLE_PLAIN, name_hash(name, len), name_eq, &c, &k, &slot);
  return at == DP_TABLE_NONE ? NULL : &r->ids[x->at[at]];
}

/* Adds r->ids[i] to x by its name, unless the name is there. */
static int idx_add(rd_t *r, idx_t *x, size_t i) {
  idnode_t *e = &r->ids[i];
  if (idx_find(r, x, e->name, e->len)) return 0;
  size_t n = x->t.count;
  if (n == x->cap) {
    size_t ncap = x->cap ? 2 * x->cap : 64;
    size_t *na = realloc(x->at, ncap * sizeof *na);
    if (!na) return -1;
    x->at = na;
    x->cap = ncap;
  }
  idx_ctx_t c = {r, x};
  if (dp__table_full(&x->t) &&
      dp__table_grow(&x->t, DP_TABLE_PLAIN, n, 0, name_hash_at, &c) != 0)
    return -1;
  uint64_t h = name_hash(e->name, e->len);
  x->at[n] = i;
  dp__table_put(&x->t, DP_TABLE_PLAIN, dp__table_empty_slot(&x->t, DP_TABLE_PLAIN, h), h, n);
  return 0;
}

static void idx_free(idx_t *x) {
  dp__table_destroy(&x->t, DP_TABLE_PLAIN);
  free(x->at);
}

static idnode_t *find_id(rd_t *r, const char *name, size_t len) { return idx_find(r, &r->by_name, name, len); }

/* Indexes r->ids[i] by its node's identity; a node named twice ($id of a
 * $ref) keeps its first entry. -1 out of memory. */
static int node_add(rd_t *r, size_t i) {
  int added;
  size_t k = ptrmap_add(&r->by_node, dp_value_id(r->ids[i].v), &added);
  if (k == SIZE_MAX) return -1;
  if (added) *(size_t *)ptrmap_val(&r->by_node, k) = i;
  return 0;
}

/* Step i after "$" of the JSON path being read (mark 0 is "$" itself): a
 * dp__step_fn, for dp__path_render. */
static size_t mark_step(void *ctx, size_t i, char *buf) {
  const rd_t *r = ctx;
  size_t from = r->marks[i + 1], to = i + 2 < r->nmarks ? r->marks[i + 2] : r->plen;
  memcpy(buf, r->path + from, to - from);
  return to - from;
}

/* The path being read, rendered into where[DP_PATH_MAX + 1]: bounded as the
 * library's paths are (docs/VALUE_JSON.md, "Paths"). */
static void render_where(rd_t *r, char *where) {
  dp__path_render(where, r->path && r->nmarks ? r->nmarks - 1 : 0, mark_step, r);
}

static int fail(rd_t *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(rd_t *r, int code, const char *fmt, ...) {
  char what[DP_ERROR_MSG_MAX], where[DP_PATH_MAX + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  render_where(r, where);
  snprintf(r->msg, r->msgsize, "%s, at %s", what, where);
  return code;
}

/* Appends one step (bounded: names are cut to 64 bytes). Out of memory, the
 * step is left out of the path, never the read. */
static void path_push(rd_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void path_push(rd_t *r, const char *fmt, ...) {
  char step[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(step, sizeof step, fmt, ap);
  va_end(ap);
  size_t k = n < 0 ? 0 : (size_t)n < sizeof step ? (size_t)n : sizeof step - 1;
  if (r->nmarks == r->mcap) {
    size_t ncap = r->mcap ? 2 * r->mcap : 64;
    size_t *m = realloc(r->marks, ncap * sizeof *m);
    if (m) {
      r->marks = m;
      r->mcap = ncap;
    }
  }
  if (r->plen + k + 1 > r->pcap) {
    size_t ncap = r->pcap ? 2 * r->pcap : 1024;
    while (ncap < r->plen + k + 1) ncap *= 2;
    char *p = realloc(r->path, ncap);
    if (p) {
      r->path = p;
      r->pcap = ncap;
    }
  }
  if (r->nmarks == r->mcap || r->plen + k + 1 > r->pcap) k = 0;
  if (r->nmarks < r->mcap) r->marks[r->nmarks++] = r->plen;
  memcpy(r->path + r->plen, step, k);
  r->plen += k;
  r->path[r->plen] = '\0';
}

static void path_pop(rd_t *r) {
  if (!r->nmarks) return;
  r->plen = r->marks[--r->nmarks];
  r->path[r->plen] = '\0';
}

static void path_step(rd_t *r, const char *step, size_t n) { path_push(r, "%.*s", (int)n, step); }

static void path_key(rd_t *r, const char *key, size_t n) {
  path_step(r, r->scratch, dp__step_name(key, n, r->scratch));
}

/* A JSON string from the input, for a message: quoted, escaped and cut as a
 * name in a path is, so that a message stays one line. */
static const char *shown_n(const char *s, size_t n, int quoted, char *buf) {
  buf[quoted ? dp__name_quoted(s, n, buf) : dp__name_bare(s, n, buf)] = '\0';
  return buf;
}

static const char *shown(json_t *s, int quoted, char *buf) {
  if (!json_is_string(s)) return "(not a string)";
  return shown_n(json_string_value(s), json_string_length(s), quoted, buf);
}

static int read_value(rd_t *r, json_t *j, dp_value_t *out, int depth);

static __attribute__((noinline)) int check_err(rd_t *r, int rc, dp_error_t *e) {
  return rc ? fail(r, rc, "%s", e->message) : 0;
}

/* A JSON string the library parses as a C string: one holding a NUL byte
 * would be read as its part before the NUL ("cuda:0\u0000junk" as "cuda:0"),
 * so it is not one. */
static int is_c_string(json_t *s) {
  return json_is_string(s) && !memchr(json_string_value(s), 0, json_string_length(s));
}

static int parse_device(rd_t *r, json_t *dj, dp_device_t *d) {
  if (!is_c_string(dj) || dp_device_parse(json_string_value(dj), d, NULL) != 0)
    return fail(r, DP_EINVAL, "tensor device must be \"cpu\", \"cuda:N\" or \"host:N\" (N 0..255)");
  return 0;
}

/* "0x" and 1..16 significant hex digits: an address that fits in 64 bits
 * (strtoull would clamp a longer one silently). */
static int parse_hex64(const char *s, size_t n, uint64_t *out) {
  if (n < 3 || s[0] != '0' || s[1] != 'x') return -1;
  uint64_t v = 0;
  int over = 0; /* no hex string is "too large" before it is known to be one */
  for (size_t i = 2; i < n; i++) {
    char c = s[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return -1;
    over |= (v >> 60) != 0;
    v = v << 4 | (uint64_t)d;
  }
  if (over) return -2;
  *out = v;
  return 0;
}

static int read_i64_array(rd_t *r, json_t *a, int64_t *out, int max, int *n, const char *what) {
  if (!json_is_array(a) || (int)json_array_size(a) > max)
    return fail(r, DP_EINVAL, "tensor %s must be an array of at most %d integers", what, max);
  *n = (int)json_array_size(a);
  for (int i = 0; i < *n; i++) {
    json_t *x = json_array_get(a, (size_t)i);
    if (!json_is_integer(x)) return fail(r, DP_EINVAL, "tensor %s must hold integers", what);
    out[i] = json_integer_value(x);
  }
  return 0;
}

/* The format's largest buffer (docs/FORMAT.md): what the reader refuses, pack refuses. */
#define VJSON_MAX_NBYTES (1ull << 62)

/* Not inlined, nor the other leaves read_value calls: read_value recurses
 * once a level, and their locals in its frame made 2,000 levels of $id and
 * $dict wrappers take 2.7 MB of stack (1.4 kB a level). */
static __attribute__((noinline)) int read_tensor(rd_t *r, json_t *t, dp_value_t *out) {
  static const char *const known[] = {"device", "ptr", "nbytes", "dtype", "shape", "strides", "offset", "data"};
  const char *k;
  json_t *x;
  if (t == r->locate) { /* read_doc's second pass: this tensor's path is all it wants */
    char where[DP_PATH_MAX + 1];
    render_where(r, where);
    snprintf(r->msg, r->msgsize, "%s", where);
    r->located = 1;
    return DP_ECANCELED;
  }
  if (!json_is_object(t)) return fail(r, DP_EINVAL, "$tensor must be an object");
  size_t klen;
  json_object_keylen_foreach(t, k, klen, x) { /* by length: "device\u0000x" is not "device" */
    size_t i = 0;
    while (i < 8 && !(strlen(known[i]) == klen && memcmp(k, known[i], klen) == 0)) i++;
    if (i == 8) return fail(r, DP_EINVAL, "unknown $tensor field %s", shown_n(k, klen, 1, r->scratch));
  }
  dp_device_t dev;
  int rc = parse_device(r, json_object_get(t, "device"), &dev);
  if (rc) return rc;
  json_t *pj = json_object_get(t, "ptr");
  uint64_t ptr = 0;
  rc = json_is_string(pj) ? parse_hex64(json_string_value(pj), json_string_length(pj), &ptr) : -1;
  if (rc == -2) { /* named by its significant digits: leading zeros, any number of them, showed nothing else */
    const char *p = json_string_value(pj) + 2, *end = json_string_value(pj) + json_string_length(pj);
    while (*p == '0') p++;
    return fail(r, DP_EINVAL, "tensor ptr 0x%s does not fit in 64 bits", shown_n(p, (size_t)(end - p), 0, r->scratch));
  }
  if (rc || ptr > UINTPTR_MAX) return fail(r, DP_EINVAL, "tensor ptr must be a hex string such as \"0x7f0000001000\"");
  json_t *nj = json_object_get(t, "nbytes");
  if (!json_is_integer(nj) || json_integer_value(nj) < 0)
    return fail(r, DP_EINVAL, "tensor nbytes must be a non-negative integer");
  if ((uint64_t)json_integer_value(nj) > VJSON_MAX_NBYTES || (uint64_t)json_integer_value(nj) > SIZE_MAX)
    return fail(r, DP_EINVAL, "tensor nbytes %" PRId64 " exceeds 2^62, the largest buffer a frame can describe",
                (int64_t)json_integer_value(nj));
  size_t nbytes = (size_t)json_integer_value(nj);
  dp_dtype_t dtype;
  json_t *dj = json_object_get(t, "dtype");
  if (!is_c_string(dj) || dp_dtype_parse(json_string_value(dj), &dtype, NULL) != 0) {
    char names[256] = ""; /* the library's own list, so that the message names what it takes */
    size_t at = 0;
    for (int i = 0; dp_dtype_name((dp_dtype_t)i) && at < sizeof names; i++)
      at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", i ? ", " : "", dp_dtype_name((dp_dtype_t)i));
    if (!dj) return fail(r, DP_EINVAL, "tensor dtype missing (one of %s)", names);
    return fail(r, DP_EINVAL, "unknown tensor dtype %s (one of %s)", shown(dj, 1, r->scratch), names);
  }
  int64_t shape[DP_TENSOR_MAX_DIMS], strides[DP_TENSOR_MAX_DIMS];
  int nd, ns;
  if ((rc = read_i64_array(r, json_object_get(t, "shape"), shape, DP_TENSOR_MAX_DIMS, &nd, "shape")) != 0) return rc;
  json_t *sj = json_object_get(t, "strides");
  if (sj) {
    if ((rc = read_i64_array(r, sj, strides, DP_TENSOR_MAX_DIMS, &ns, "strides")) != 0) return rc;
    if (ns != nd)
      return fail(r, DP_EINVAL, "tensor has %d stride%s for %d dimension%s", ns, ns == 1 ? "" : "s", nd,
                  nd == 1 ? "" : "s");
  }
  json_t *oj = json_object_get(t, "offset");
  if (oj && !json_is_integer(oj)) return fail(r, DP_EINVAL, "tensor offset must be an integer");
  int64_t offset = oj ? json_integer_value(oj) : 0;
  json_t *data = json_object_get(t, "data");
  if (data && !json_is_string(data)) return fail(r, DP_EINVAL, "tensor data must be a base64 string");
  uint8_t *bytes = NULL;
  size_t n = 0;
  if (data) {
    int brc = vjson_b64_decode(json_string_value(data), json_string_length(data), &bytes, &n);
    if (brc == -2) return fail(r, DP_ENOMEM, "out of memory decoding tensor data (%zu characters of base64)",
                               json_string_length(data));
    if (brc) return fail(r, DP_EINVAL, "tensor data is not canonical base64 (RFC 4648, padded, unused bits zero)");
    if (n != nbytes) {
      free(bytes);
      return fail(r, DP_EINVAL, "tensor data has %zu byte%s, nbytes says %zu", n, n == 1 ? "" : "s", nbytes);
    }
  }

  /* One storage per (device, ptr); its tensors agree on its size and bytes.
   * Messages name it by the values read, never the text: a ptr may carry
   * any number of leading zeros, which pushed the path out of the message. */
  char devname[16];
  size_t si;
  dp_storage_t *st;
  if (dp_ptrset_find(r->stset, dev, (void *)(uintptr_t)ptr, &si, NULL) == 0) {
    st = r->storages[si];
    const void *had = dp_storage_host_data(st);
    if (dp_storage_nbytes(st) != nbytes) {
      free(bytes);
      return fail(r, DP_EINVAL, "tensors on %s 0x%" PRIxPTR " disagree on nbytes (%zu and %zu)",
                  dp_device_format(dev, devname, sizeof devname), (uintptr_t)ptr, dp_storage_nbytes(st), nbytes);
    }
    if (had && bytes && nbytes && memcmp(had, bytes, nbytes) != 0) {
      free(bytes);
      return fail(r, DP_EINVAL, "tensors on %s 0x%" PRIxPTR " disagree on data",
                  dp_device_format(dev, devname, sizeof devname), (uintptr_t)ptr);
    }
  } else {
    if ((rc = dp_storage_new(dev, (void *)(uintptr_t)ptr, nbytes, NULL, NULL, &st, &r->e)) != 0) {
      free(bytes);
      return check_err(r, rc, &r->e);
    }
    if (r->nst == r->stcap) {
      size_t ncap = r->stcap ? 2 * r->stcap : 16;
      dp_storage_t **p = realloc(r->storages, ncap * sizeof *p);
      if (p) r->storages = p;
      unsigned char *h = p ? realloc(r->has_data, ncap) : NULL;
      if (h) r->has_data = h;
      const json_t **f = h ? realloc(r->first, ncap * sizeof *f) : NULL;
      if (f) r->first = f;
      if (!f) {
        free(bytes);
        dp_storage_release(st);
        return fail(r, DP_ENOMEM, "out of memory");
      }
      r->stcap = ncap;
    }
    si = r->nst;
    r->has_data[si] = 0;
    r->first[si] = t;
    r->storages[r->nst++] = st;
    if ((rc = dp_ptrset_add(r->stset, dev, (void *)(uintptr_t)ptr, nbytes, NULL, &r->e)) != 0) {
      free(bytes);
      return check_err(r, rc, &r->e);
    }
  }
  if (data) {  /* the first tensor that carries the storage's bytes gives them */
    rc = r->has_data[si] ? 0 : dp_storage_set_host_data(st, bytes, &r->e);
    free(bytes);
    if (rc) return check_err(r, rc, &r->e);
    r->has_data[si] = 1;
  }
  rc = dp_tensor_new(dp_storage_retain(st), dtype, nd, shape, sj ? strides : NULL, offset, out, &r->e);
  return check_err(r, rc, &r->e);
}

/* A class or type name (a JSON string): the library's names are C strings. */
static int check_name(rd_t *r, json_t *s, const char *what) {
  if (memchr(json_string_value(s), 0, json_string_length(s))) return fail(r, DP_EINVAL, "%s contains a NUL byte", what);
  return 0;
}

/* Allocates the shell of a container, so that $id can name it before its
 * children are read (cycles). */
static int make_shell(rd_t *r, json_t *j, dp_value_t *out) {
  int rc;
  json_t *x;
  if (json_is_array(j)) {
    rc = dp_list_new(json_array_size(j), out, &r->e);
  } else if ((x = json_object_get(j, "$tuple")) != NULL) {
    if (!json_is_array(x)) return fail(r, DP_EINVAL, "$tuple must be an array");
    rc = dp_tuple_new(json_array_size(x), out, &r->e);
  } else if ((x = json_object_get(j, "$object")) != NULL) {
    if (!json_is_string(x)) return fail(r, DP_EINVAL, "$object must be a class name string");
    if ((rc = check_name(r, x, "class name")) != 0) return rc;
    rc = dp_object_new(json_string_value(x), out, &r->e);
  } else if ((x = json_object_get(j, "$reduce")) != NULL) {
    if (!json_is_string(x)) return fail(r, DP_EINVAL, "$reduce must be a type name string");
    if ((rc = check_name(r, x, "type name")) != 0) return rc;
    rc = dp_object_new_reduced(json_string_value(x), dp_none(), out, &r->e);
  } else {
    rc = dp_dict_new(0, out, &r->e);
  }
  return check_err(r, rc, &r->e);
}

static int fill_seq(rd_t *r, json_t *a, dp_value_t seq, int depth) {
  for (size_t i = 0; i < json_array_size(a); i++) {
    path_push(r, "[%zu]", i);
    dp_value_t item;
    int rc = read_value(r, json_array_get(a, i), &item, depth + 1);
    if (rc) return rc;
    rc = dp_value_kind(seq) == DP_LIST ? dp_list_append(seq, item, &r->e) : dp_seq_set(seq, i, item, &r->e);
    if (rc) return check_err(r, rc, &r->e);
    path_pop(r);
  }
  return 0;
}

/* Whether a (hashable, hence bounded) key holds a tuple still being filled:
 * only $id-named containers can be, so one lookup a tuple. A tuple found
 * closed stays closed (an $id's container is open only until it is filled,
 * and a tuple's items are set once), so it is remembered and never walked
 * again: a key of 1,023 nodes used by $ref in 80,000 dicts (2.6 MB of JSON)
 * walked 4 x 10^7 nodes, half the 7.9 s that `pack` took. */
unsigned long long vjson_key_tuples_walked;

static int key_is_open(rd_t *r, dp_value_t k) {
  if (dp_value_kind(k) != DP_TUPLE) return 0;
  const void *id = dp_value_id(k);
  if (ptrmap_find(&r->closed, id) != SIZE_MAX) return 0;
  vjson_key_tuples_walked++;
  size_t named = ptrmap_find(&r->by_node, id);
  if (named != SIZE_MAX && r->ids[*(size_t *)ptrmap_val(&r->by_node, named)].open) return 1;
  for (size_t i = 0; i < dp_seq_len(k); i++)
    if (key_is_open(r, dp_seq_get(k, i))) return 1;
  ptrmap_add(&r->closed, id, NULL); /* out of memory, it is only forgotten */
  return 0;
}

/* fill_container's forms, each in a function of its own that
 * fill_container tail-calls: a level of the value pays the frame of its
 * own form only, not one holding the locals of all of them (SECURITY.md
 * promises 2,000 levels within 512 KiB of stack). */
#define FILL_FORM static __attribute__((noinline)) int

FILL_FORM fill_object(rd_t *r, json_t *j, json_t *attrs, dp_value_t v, int depth) {
  int rc;
  const char *k;
  size_t klen;
  json_t *x;
  if (json_object_size(j) != (attrs ? 2u : 1u) || (attrs && !json_is_object(attrs)))
    return fail(r, DP_EINVAL, "$object takes one other field, \"attrs\", an object");
  json_object_keylen_foreach(attrs, k, klen, x) {
    path_key(r, k, klen);
    if (memchr(k, 0, klen)) return fail(r, DP_EINVAL, "attribute name contains a NUL byte");
    dp_value_t val;
    if ((rc = read_value(r, x, &val, depth + 1)) != 0) return rc;
    if ((rc = dp_object_set(v, k, val, &r->e)) != 0) return check_err(r, rc, &r->e);
    path_pop(r);
  }
  return 0;
}

FILL_FORM fill_reduce(rd_t *r, json_t *j, json_t *x, dp_value_t v, int depth) {
  int rc;
  json_t *state = json_object_get(j, "state");
  if (json_object_size(j) != 2 || !state) return fail(r, DP_EINVAL, "$reduce takes one other field, \"state\"");
  path_step(r, r->scratch, dp__step_reduce(json_string_value(x), json_string_length(x), r->scratch));
  dp_value_t val;
  if ((rc = read_value(r, state, &val, depth + 1)) != 0) return rc;
  if ((rc = dp_object_set(v, "__reduce__", val, &r->e)) != 0) return check_err(r, rc, &r->e);
  path_pop(r);
  return 0;
}

/* Whether key (just read) may key dict v: else the error, key released.
 * Out of fill_dict, whose frame is paid once a level. */
static __attribute__((noinline)) int key_refused(rd_t *r, dp_value_t v, dp_value_t key) {
  dp_value_t dummy;
  if (!dp_value_is_hashable(key)) {  /* bounded before any walk of it */
    int kind = (int)dp_value_kind(key);
    dp_value_release(key);
    return fail(r, DP_ETYPE, "dict key of kind %s is not hashable%s", dp_kind_name((dp_kind_t)kind),
                kind == DP_TUPLE ? " (a tuple key holds only scalars, str, bytes and tuples, at most 1024 of "
                                   "them, 32 levels deep)" : "");
  }
  if (key_is_open(r, key)) {
    dp_value_release(key);
    return fail(r, DP_EINVAL, "dict key refers to a node that is still being built");
  }
  if (dp_dict_get(v, key, &dummy, NULL) == 0) {
    size_t n = dp__step_key(key, r->scratch);
    dp_value_release(key);
    return fail(r, DP_EINVAL, "duplicate dict key: the entry %.*s is given twice", (int)n, r->scratch);
  }
  return 0;
}

FILL_FORM fill_dict(rd_t *r, json_t *j, json_t *x, dp_value_t v, int depth) {
  int rc;
  if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$dict takes no other fields");
  if (!json_is_array(x)) return fail(r, DP_EINVAL, "$dict must be an array of [key, value] pairs");
  /* paths as the library names them: `<key N>` inside the key of entry N,
   * `[<key JSON>]` (or `.name`) for its value */
  for (size_t i = 0; i < json_array_size(x); i++) {
    json_t *pair = json_array_get(x, i);
    if (!json_is_array(pair) || json_array_size(pair) != 2)
      return fail(r, DP_EINVAL, "$dict item %zu is not a [key, value] pair", i);
    path_push(r, "<key %zu>", i);
    dp_value_t key, val;
    if ((rc = read_value(r, json_array_get(pair, 0), &key, depth + 1)) != 0) return rc;
    if ((rc = key_refused(r, v, key)) != 0) return rc;
    path_pop(r);
    path_step(r, r->scratch, dp__step_key(key, r->scratch));
    if ((rc = read_value(r, json_array_get(pair, 1), &val, depth + 1)) != 0) {
      dp_value_release(key);
      return rc;
    }
    if ((rc = dp_dict_set(v, key, val, &r->e)) != 0) return check_err(r, rc, &r->e);
    path_pop(r);
  }
  return 0;
}

FILL_FORM fill_plain_dict(rd_t *r, json_t *j, dp_value_t v, int depth) {
  int rc;
  const char *k;
  size_t klen;
  json_t *x;
  json_object_keylen_foreach(j, k, klen, x) {
    if (klen == 6 && memcmp(k, "$value", 6) == 0) /* a known field, of another tag */
      return fail(r, DP_EINVAL, "$value without $id: a named node is {\"$id\": \"name\", \"$value\": V}");
    if (k[0] == '$')
      return fail(r, DP_EINVAL, "unknown tag %s (a plain key starting with '$' needs $dict)",
                  shown_n(k, klen, 1, r->scratch));
    path_key(r, k, klen);
    dp_value_t key, val;
    if ((rc = dp_str_new(k, klen, &key, &r->e)) != 0) return check_err(r, rc, &r->e);
    if ((rc = read_value(r, x, &val, depth + 1)) != 0) {
      dp_value_release(key);
      return rc;
    }
    if ((rc = dp_dict_set(v, key, val, &r->e)) != 0) return check_err(r, rc, &r->e);
    path_pop(r);
  }
  return 0;
}

static int fill_container(rd_t *r, json_t *j, dp_value_t v, int depth) {
  json_t *x;
  if (json_is_array(j)) return fill_seq(r, j, v, depth);
  if ((x = json_object_get(j, "$tuple")) != NULL) {
    if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$tuple takes no other fields");
    return fill_seq(r, x, v, depth);
  }
  if (json_object_get(j, "$object") != NULL) return fill_object(r, j, json_object_get(j, "attrs"), v, depth);
  if ((x = json_object_get(j, "$reduce")) != NULL) return fill_reduce(r, j, x, v, depth);
  if ((x = json_object_get(j, "$dict")) != NULL) return fill_dict(r, j, x, v, depth);
  return fill_plain_dict(r, j, v, depth);
}

static int is_container_json(json_t *j) {
  if (json_is_array(j)) return 1;
  if (!json_is_object(j)) return 0;
  return !json_object_get(j, "$tensor") && !json_object_get(j, "$bytes") && !json_object_get(j, "$float") &&
         !json_object_get(j, "$ref") && !json_object_get(j, "$id");
}

/* Registers a named node (borrowed v). */
static __attribute__((noinline)) int add_id(rd_t *r, json_t *name, dp_value_t v, int open, size_t *at) {
  if (r->nids == r->idcap) {
    size_t ncap = r->idcap ? 2 * r->idcap : 16;
    idnode_t *p = realloc(r->ids, ncap * sizeof *p);
    if (!p) return fail(r, DP_ENOMEM, "out of memory");
    r->ids = p;
    r->idcap = ncap;
  }
  size_t len = json_string_length(name);
  idnode_t *node = &r->ids[r->nids];
  node->name = malloc(len + 1);
  if (!node->name) return fail(r, DP_ENOMEM, "out of memory");
  memcpy(node->name, json_string_value(name), len + 1);
  node->len = len;
  node->v = v;
  node->open = open;
  *at = r->nids++;
  if (idx_add(r, &r->by_name, *at) || node_add(r, *at)) return fail(r, DP_ENOMEM, "out of memory");
  return 0;
}

static __attribute__((noinline)) int read_float(rd_t *r, json_t *x, dp_value_t *out) {
  const char *s = is_c_string(x) ? json_string_value(x) : "";
  size_t n = is_c_string(x) ? json_string_length(x) : 0;
  uint64_t bits;
  double f;
  if (strcmp(s, "nan") == 0) f = NAN;
  else if (strcmp(s, "inf") == 0) f = INFINITY;
  else if (strcmp(s, "-inf") == 0) f = -INFINITY;
  else if (n == 18 && parse_hex64(s, n, &bits) == 0) memcpy(&f, &bits, sizeof f);
  else return fail(r, DP_EINVAL, "$float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 bits");
  *out = dp_float(f);
  return 0;
}

/* Why the $id object j (name x, "$value" val) names no node, or 0. */
static __attribute__((noinline)) int id_refused(rd_t *r, json_t *j, json_t *x, json_t *val) {
  if (!json_is_string(x) || !val) return fail(r, DP_EINVAL, "$id needs a string name and a \"$value\"");
  if (json_object_size(j) != 2) return fail(r, DP_EINVAL, "$id takes one other field, \"$value\"");
  if (find_id(r, json_string_value(x), json_string_length(x)))
    return fail(r, DP_EINVAL, "$id %s is defined twice", shown(x, 1, r->scratch));
  if (json_is_object(val) && json_object_get(val, "$id"))
    return fail(r, DP_EINVAL, "$id %s names an $id: a node has one name", shown(x, 1, r->scratch));
  json_t *to = json_is_object(val) ? json_object_get(val, "$ref") : NULL;
  if (to && json_equal(to, x))  /* not yet defined: its $ref would say it names no earlier $id */
    return fail(r, DP_EINVAL, "$id %s names a $ref to itself: a node cannot be its own value",
                shown(x, 1, r->scratch));
  if (to && json_object_size(val) == 1 && json_is_string(to) &&
      find_id(r, json_string_value(to), json_string_length(to))) { /* a second name for that node */
    char other[DP__STEP_MAX];
    return fail(r, DP_EINVAL, "$id %s names a $ref: a node has one name (refer to it by %s)",
                shown(x, 1, r->scratch), shown(to, 1, other));
  }
  return 0;
}

/* depth: the containers above j, every one of them with children — the
 * library's own count (an empty container adds no level). */
static int read_value(rd_t *r, json_t *j, dp_value_t *out, int depth) {
  int rc;
  json_t *x;
  if (depth > VJSON_MAX_DEPTH) {
    /* j is a child of the container past the limit (a scalar, an empty
     * list, a dict's key): the error names that container, as the library's
     * walker names it and as verify points at its header. Every caller
     * that passes depth + 1 has pushed j's step. */
    path_pop(r);
    return fail(r, DP_ELIMIT, "containers nested deeper than %d levels", VJSON_MAX_DEPTH);
  }
  switch (json_typeof(j)) {
    case JSON_NULL: *out = dp_none(); return 0;
    case JSON_TRUE: *out = dp_bool(true); return 0;
    case JSON_FALSE: *out = dp_bool(false); return 0;
    case JSON_INTEGER: *out = dp_int(json_integer_value(j)); return 0;
    case JSON_REAL: *out = dp_float(json_real_value(j)); return 0;
    case JSON_STRING:
      rc = dp_str_new(json_string_value(j), json_string_length(j), out, &r->e);
      return check_err(r, rc, &r->e);
    default: break;
  }
  if (json_is_object(j)) {
    if ((x = json_object_get(j, "$id")) != NULL) {
      json_t *val = json_object_get(j, "$value");
      if ((rc = id_refused(r, j, x, val)) != 0) return rc;
      size_t mine;
      if (is_container_json(val)) {
        if ((rc = make_shell(r, val, out)) != 0) return rc;
        if ((rc = add_id(r, x, *out, 1, &mine)) != 0) {
          dp_value_release(*out);
          return rc;
        }
        rc = fill_container(r, val, *out, depth);
        r->ids[mine].open = 0;
        if (rc) dp_value_release(*out);
        return rc;
      }
      if ((rc = read_value(r, val, out, depth)) != 0) return rc;
      if (!dp_value_is_heap(*out)) {
        dp_value_release(*out);
        return fail(r, DP_EINVAL, "$id names a scalar; only str, bytes, containers and tensors have identity");
      }
      if ((rc = add_id(r, x, *out, 0, &mine)) != 0) dp_value_release(*out);
      return rc;
    }
    if ((x = json_object_get(j, "$ref")) != NULL) {
      if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$ref takes no other fields");
      if (!json_is_string(x)) return fail(r, DP_EINVAL, "$ref must be the string name of an earlier $id");
      idnode_t *node = find_id(r, json_string_value(x), json_string_length(x));
      if (!node) return fail(r, DP_EINVAL, "$ref %s names no earlier $id", shown(x, 1, r->scratch));
      *out = dp_value_retain(node->v);
      return 0;
    }
    if ((x = json_object_get(j, "$tensor")) != NULL) {
      if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$tensor takes no other fields");
      return read_tensor(r, x, out);
    }
    if ((x = json_object_get(j, "$bytes")) != NULL) {
      uint8_t *p;
      size_t n;
      if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$bytes takes no other fields");
      int brc = json_is_string(x) ? vjson_b64_decode(json_string_value(x), json_string_length(x), &p, &n) : -1;
      if (brc == -2) return fail(r, DP_ENOMEM, "out of memory decoding $bytes (%zu characters of base64)",
                                 json_string_length(x));
      if (brc) return fail(r, DP_EINVAL, "$bytes must be a canonical base64 string (RFC 4648, padded, unused bits zero)");
      rc = dp_bytes_new(p, n, out, &r->e);
      free(p);
      return check_err(r, rc, &r->e);
    }
    if ((x = json_object_get(j, "$float")) != NULL) {
      if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$float takes no other fields");
      return read_float(r, x, out);
    }
  }
  if ((rc = make_shell(r, j, out)) != 0) return rc;
  if ((rc = fill_container(r, j, *out, depth)) != 0) dp_value_release(*out);
  return rc;
}

/* Reads document j into *out. `locate` (a $tensor body in j): read only up
 * to that tensor, and leave its path in msg (DP_ECANCELED), or another
 * error where the read fails before it. *bare: where an inline value has a
 * storage that no tensor gives "data", its first tensor's body (NULL
 * otherwise): the read keeps no path per storage (a path of long keys
 * would cost that much again for each), so the message's path comes from
 * a second read that stops there. */
static int read_doc(json_t *j, const json_t *locate, dp_value_t *out, int *is_inline, const json_t **bare,
                    char *msg, size_t msgsize) {
  rd_t r;
  memset(&r, 0, sizeof r);
  ptrmap_init(&r.by_node, sizeof(size_t));
  r.msg = msg;
  r.msgsize = msgsize;
  r.locate = locate;
  *bare = NULL;
  path_push(&r, "$");
  int rc = dp_ptrset_new(&r.stset, &r.e);
  if (rc) {
    fail(&r, rc, "%s", r.e.message);
    free(r.path);
    free(r.marks);
    return rc;
  }
  rc = read_value(&r, j, out, 0);
  if (r.located) rc = DP_ECANCELED; /* and msg holds the path */
  size_t with_data = 0, without = r.nst;
  for (size_t i = 0; i < r.nst; i++) {
    with_data += r.has_data[i];
    if (!r.has_data[i] && without == r.nst) without = i;
  }
  if (rc == 0 && with_data && without < r.nst) {
    dp_value_release(*out);
    char dev[16];
    rc = DP_EINVAL; /* the message without its path: vjson_to_value finds it */
    snprintf(msg, msgsize,
             "no tensor on %s 0x%" PRIxPTR " carries \"data\", but tensors on %zu other storage%s do: an inline "
             "frame needs each storage's data (on one of its tensors)",
             dp_device_format(dp_storage_device(r.storages[without]), dev, sizeof dev),
             (uintptr_t)dp_storage_base(r.storages[without]), with_data, with_data == 1 ? "" : "s");
    *bare = r.first[without];
  }
  *is_inline = with_data > 0;
  for (size_t i = 0; i < r.nst; i++) dp_storage_release(r.storages[i]);
  free(r.storages);
  free(r.has_data);
  free(r.first);
  for (size_t i = 0; i < r.nids; i++) free(r.ids[i].name);
  free(r.ids);
  idx_free(&r.by_name);
  ptrmap_free(&r.by_node);
  ptrmap_free(&r.closed);
  free(r.path);
  free(r.marks);
  dp_ptrset_free(r.stset);
  return rc;
}

int vjson_to_value(json_t *j, dp_value_t *out, int *is_inline, char *msg, size_t msgsize) {
  const json_t *bare;
  int rc = read_doc(j, NULL, out, is_inline, &bare, msg, msgsize);
  if (!bare) return rc;
  /* The storage's first tensor's path, from a read that stops there (the
   * same document read the same way up to it: it gets there). */
  char where[DP_PATH_MAX + 1] = "$";
  dp_value_t unused;
  int unused_inline;
  const json_t *none;
  int again = read_doc(j, bare, &unused, &unused_inline, &none, where, sizeof where);
  if (again == 0) dp_value_release(unused); /* it always stops at the tensor: never */
  if (again != DP_ECANCELED) strcpy(where, "$");
  size_t len = strlen(msg);
  snprintf(msg + len, msgsize - len, ", at %s", where);
  return rc;
}

/* ---- writing ---- */

/* A node with more than one reference: (times met, $id number). Nodes held
 * once are met once and need no entry, which keeps the table to the shared
 * nodes: unpack's memory is the value's plus this. */
typedef struct wslot {
  uint32_t count;
  int32_t id;   /* its $id number + 1; 0 until its first emission */
} wslot_t;

typedef struct wr {
  ptrmap_t shared;  /* nodes with more than one reference: identity -> wslot_t */
  int next_id;
  FILE *out;
  int indent, level;
  int rc;       /* first error: later output is skipped */
  char *msg;
  size_t msgsize;
  ptrmap_t stores;     /* storages whose "data" was written: each is written once */
  char buf[1 << 16];   /* output gathered into large writes */
  size_t len;
} wr_t;

static int wfail(wr_t *w, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int wfail(wr_t *w, int code, const char *fmt, ...) {
  if (w->rc) return w->rc;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w->msg, w->msgsize, fmt, ap);
  va_end(ap);
  return w->rc = code;
}

/* The entry of node key; with insert, made ({0, 0}) when there is none.
 * NULL when there is none, or out of memory. */
static wslot_t *wslot(wr_t *w, const void *key, int insert) {
  size_t k = insert ? ptrmap_add(&w->shared, key, NULL) : ptrmap_find(&w->shared, key);
  return k == SIZE_MAX ? NULL : ptrmap_val(&w->shared, k);
}

/* Not inlined: its name buffer in count_refs's frame, once a level, tripled
 * the stack that 2,000 levels take. */
static __attribute__((noinline)) int custom_refused(wr_t *w, dp_value_t v) {
  char name[DP__STEP_MAX];
  const char *t = dp_custom_type(v)->name;
  size_t n = dp__name_bare(t, strlen(t), name);
  return wfail(w, DP_ETYPE, "a custom of type '%.*s' has no value JSON form (pickle it first)", (int)n, name);
}

/* Pass 1: how often is each shared node met? depth: containers above v (each
 * of them has a child: v), counted as the library counts them. */
static int count_refs(wr_t *w, dp_value_t v, int depth) {
  if (depth > VJSON_MAX_DEPTH)
    return wfail(w, DP_ELIMIT, "containers nested deeper than %d levels, too deep for value JSON", VJSON_MAX_DEPTH);
  if (!dp_value_is_heap(v)) return 0;
  if (dp_value_refcount(v) > 1) {
    wslot_t *s = wslot(w, dp_value_id(v), 1);
    if (!s) return wfail(w, DP_ENOMEM, "out of memory");
    if (s->count++ > 0) return 0;
  }
  int rc = 0;
  switch (dp_value_kind(v)) {
    case DP_LIST:
    case DP_TUPLE:
      for (size_t i = 0; i < dp_seq_len(v) && !rc; i++) rc = count_refs(w, dp_seq_get(v, i), depth + 1);
      break;
    case DP_DICT:
      for (size_t i = 0; i < dp_dict_len(v) && !rc; i++) {
        dp_value_t k, x;
        dp_dict_item(v, i, &k, &x, NULL);
        rc = count_refs(w, k, depth + 1);
        if (!rc) rc = count_refs(w, x, depth + 1);
      }
      break;
    case DP_OBJECT:
      for (size_t i = 0; i < dp_object_nattrs(v) && !rc; i++) {
        dp_value_t x;
        dp_object_attr(v, i, NULL, &x, NULL);
        rc = count_refs(w, x, depth + 1);
      }
      break;
    case DP_CUSTOM: return custom_refused(w, v);
    default:
      break;
  }
  return rc;
}

/* ---- the text ---- */

static void flush_out(wr_t *w) {
  if (!w->rc && w->len && fwrite(w->buf, 1, w->len, w->out) != w->len)
    wfail(w, DP_EIO, "write failed: %s", strerror(errno));
  w->len = 0;
}

static void put(wr_t *w, const char *s, size_t n) {
  if (w->len + n > sizeof w->buf) {
    flush_out(w);
    if (n > sizeof w->buf) {
      if (!w->rc && fwrite(s, 1, n, w->out) != n) wfail(w, DP_EIO, "write failed: %s", strerror(errno));
      return;
    }
  }
  memcpy(w->buf + w->len, s, n);
  w->len += n;
}

static void puts_(wr_t *w, const char *s) { put(w, s, strlen(s)); }

static void newline(wr_t *w) {
  static const char spaces[] = "                                                                ";
  if (!w->indent) return;
  put(w, "\n", 1);
  for (size_t left = (size_t)w->level * (size_t)w->indent; left;) {
    size_t k = left < sizeof spaces - 1 ? left : sizeof spaces - 1;
    put(w, spaces, k);
    left -= k;
  }
}

/* The code point of the character at s[i] (n bytes in all) that a string is
 * written with as \uXXXX beyond C0 — DEL, C1 (U+0080-U+009F: a terminal takes
 * U+009B for CSI), U+2028/U+2029 (line ends to JavaScript) and the
 * bidirectional formatting characters (U+061C, U+200E, U+200F,
 * U+202A-U+202E, U+2066-U+2069: a right-to-left override in a str made
 * what follows it on its line, keys and values of the JSON around it,
 * display reversed in an editor or a terminal that honours it) — with its
 * length in *len; 0 for any other. The text is UTF-8 (the reader checked). */
static unsigned hazard_at(const unsigned char *s, size_t i, size_t n, size_t *len) {
  if (s[i] == 0x7f) return *len = 1, 0x7f;
  if (s[i] == 0xc2 && i + 1 < n && s[i + 1] <= 0x9f) return *len = 2, s[i + 1];
  if (s[i] == 0xd8 && i + 1 < n && s[i + 1] == 0x9c) return *len = 2, 0x61cu;
  if (s[i] != 0xe2 || i + 2 >= n) return 0;
  unsigned b = s[i + 2];
  if (s[i + 1] == 0x80 && (b == 0x8e || b == 0x8f || (b >= 0xa8 && b <= 0xae)))
    return *len = 3, 0x2000u | (b & 0x3f);
  if (s[i + 1] == 0x81 && b >= 0xa6 && b <= 0xa9) return *len = 3, 0x2040u | (b & 0x3f);
  return 0;
}

static void put_string(wr_t *w, const char *s, size_t n) {
  put(w, "\"", 1);
  size_t run = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    char esc[8];
    if (c >= 0x20 && c != '"' && c != '\\') {
      size_t len;
      unsigned cp = c < 0x7f ? 0 : hazard_at((const unsigned char *)s, i, n, &len);
      if (!cp) continue;
      put(w, s + run, i - run);
      snprintf(esc, sizeof esc, "\\u%04x", cp);
      put(w, esc, 6);
      i += len - 1;
      run = i + 1;
      continue;
    }
    put(w, s + run, i - run);
    run = i + 1;
    switch (c) {
      case '"': puts_(w, "\\\""); break;
      case '\\': puts_(w, "\\\\"); break;
      case '\b': puts_(w, "\\b"); break;
      case '\f': puts_(w, "\\f"); break;
      case '\n': puts_(w, "\\n"); break;
      case '\r': puts_(w, "\\r"); break;
      case '\t': puts_(w, "\\t"); break;
      default: snprintf(esc, sizeof esc, "\\u%04x", c); put(w, esc, 6); break;
    }
  }
  put(w, s + run, n - run);
  put(w, "\"", 1);
}

/* Containers: open, then one `sep` per member or item, then close. */
static void open_(wr_t *w, char c, int *first) {
  put(w, &c, 1);
  w->level++;
  *first = 1;
}

static void sep(wr_t *w, int *first) {
  if (!*first) put(w, ",", 1);
  *first = 0;
  newline(w);
}

static void key(wr_t *w, const char *k, size_t n, int *first) {
  sep(w, first);
  put_string(w, k, n);
  put(w, w->indent ? ": " : ":", w->indent ? 2 : 1);
}

static void close_(wr_t *w, char c, int first) {
  w->level--;
  if (!first) newline(w);
  put(w, &c, 1);
}

static void put_int(wr_t *w, long long i) {
  char b[32];
  put(w, b, (size_t)snprintf(b, sizeof b, "%lld", i));
}

static void put_b64(wr_t *w, const uint8_t *p, size_t n) {
  char chunk[4096];
  put(w, "\"", 1);
  for (size_t i = 0; i < n && !w->rc;) {
    size_t k = 0;
    for (; i < n && k + 4 <= sizeof chunk; i += 3, k += 4) b64_block(p + i, n - i, chunk + k);
    put(w, chunk, k);
  }
  put(w, "\"", 1);
}

/* {"tag": <then the caller's value>}: returns `first` for close_. */
static int tag_open(wr_t *w, const char *tag) {
  int first;
  open_(w, '{', &first);
  key(w, tag, strlen(tag), &first);
  return first;
}

/* Leaves' buffers are kept out of emit_body's frame (noinline here and on
 * emit_tensor): that frame is paid once a level of the value. */
static __attribute__((noinline)) void put_float(wr_t *w, double f) {
  char b[40];
  if (vjson_float_text(f, b, sizeof b)) {
    put(w, b, strlen(b));
    return;
  }
  int first = tag_open(w, "$float");
  put_string(w, b, strlen(b));
  close_(w, '}', first);
}

static void emit(wr_t *w, dp_value_t v);

/* Whether storage st is met for the first time (and now recorded): its
 * "data" goes on its first tensor only, so that the text stays linear in the
 * frame however many tensors share a storage. */
static int storage_first(wr_t *w, const void *st) {
  int added;
  if (ptrmap_add(&w->stores, st, &added) == SIZE_MAX) return wfail(w, DP_ENOMEM, "out of memory"), 0;
  return added;
}

static __attribute__((noinline)) void emit_tensor(wr_t *w, dp_value_t v) {
  dp_storage_t *st = dp_tensor_storage(v);
  char buf[32];
  int outer = tag_open(w, "$tensor"), first, f2;
  open_(w, '{', &first);
  key(w, "device", 6, &first);
  dp_device_format(dp_storage_device(st), buf, sizeof buf);
  put_string(w, buf, strlen(buf));
  key(w, "ptr", 3, &first);
  snprintf(buf, sizeof buf, "0x%" PRIxPTR, (uintptr_t)dp_storage_base(st));
  put_string(w, buf, strlen(buf));
  key(w, "nbytes", 6, &first);
  put_int(w, (long long)dp_storage_nbytes(st));
  key(w, "dtype", 5, &first);
  put_string(w, dp_dtype_name(dp_tensor_dtype(v)), strlen(dp_dtype_name(dp_tensor_dtype(v))));
  for (int which = 0; which < 2; which++) {
    key(w, which ? "strides" : "shape", which ? 7 : 5, &first);
    const int64_t *a = which ? dp_tensor_strides(v) : dp_tensor_shape(v);
    open_(w, '[', &f2);
    for (int d = 0; d < dp_tensor_ndim(v); d++) {
      sep(w, &f2);
      put_int(w, (long long)a[d]);
    }
    close_(w, ']', f2);
  }
  key(w, "offset", 6, &first);
  put_int(w, (long long)dp_tensor_offset(v));
  const void *data = dp_storage_host_data(st);
  if (data && storage_first(w, st)) {
    key(w, "data", 4, &first);
    put_b64(w, data, dp_storage_nbytes(st));
  }
  close_(w, '}', first);
  close_(w, '}', outer);
}

unsigned long long vjson_key_bytes_scanned;

/* Whether dict key k can be a plain JSON object key: a str met once (a
 * shared one is written as an $id or $ref), not empty, not opening with '$',
 * without NUL. Sharing is looked up before the bytes are scanned, so that a
 * long str keying many dicts is scanned once at most, not once a dict (a
 * 1 MB key of 80,000 dicts, a 1.8 MB frame, took 9.4 s to unpack). */
static int plain_key(wr_t *w, dp_value_t k) {
  size_t n;
  const char *s = dp_str_data(k, &n);
  if (!s || n == 0 || s[0] == '$') return 0;
  wslot_t *sl = wslot(w, dp_value_id(k), 0);
  if (sl && sl->count != 1) return 0;
  vjson_key_bytes_scanned += n;
  return !memchr(s, 0, n);
}

static void emit_body(wr_t *w, dp_value_t v) {
  size_t n;
  int first, outer;
  switch (dp_value_kind(v)) {
    case DP_NONE: puts_(w, "null"); return;
    case DP_BOOL: puts_(w, dp_value_as_bool(v) ? "true" : "false"); return;
    case DP_INT: put_int(w, (long long)dp_value_as_int(v)); return;
    case DP_FLOAT: put_float(w, dp_value_as_float(v)); return;
    case DP_STR: {
      const char *s = dp_str_data(v, &n);
      put_string(w, s, n);
      return;
    }
    case DP_BYTES: {
      const uint8_t *p = dp_bytes_data(v, &n);
      outer = tag_open(w, "$bytes");
      put_b64(w, p, n);
      close_(w, '}', outer);
      return;
    }
    case DP_LIST:
    case DP_TUPLE: /* items here, not in a helper: a helper's frame a level
                    * made 2,000 levels of shared tuples need 578 KiB of stack */
      outer = dp_value_kind(v) == DP_TUPLE ? tag_open(w, "$tuple") : 1;
      open_(w, '[', &first);
      for (size_t i = 0; i < dp_seq_len(v); i++) {
        sep(w, &first);
        emit(w, dp_seq_get(v, i));
      }
      close_(w, ']', first);
      if (dp_value_kind(v) == DP_TUPLE) close_(w, '}', outer);
      return;
    case DP_DICT: {
      int plain = 1;
      for (size_t i = 0; i < dp_dict_len(v) && plain; i++) {
        dp_value_t k;
        dp_dict_item(v, i, &k, NULL, NULL);
        plain = plain_key(w, k);
      }
      outer = plain ? 1 : tag_open(w, "$dict");
      open_(w, plain ? '{' : '[', &first);
      for (size_t i = 0; i < dp_dict_len(v); i++) {
        dp_value_t k, x;
        dp_dict_item(v, i, &k, &x, NULL);
        if (plain) {
          const char *ks = dp_str_data(k, &n);
          key(w, ks, n, &first);
          emit(w, x);
        } else {
          int f2;
          sep(w, &first);
          open_(w, '[', &f2);
          sep(w, &f2);
          emit(w, k);
          sep(w, &f2);
          emit(w, x);
          close_(w, ']', f2);
        }
      }
      close_(w, plain ? '}' : ']', first);
      if (!plain) close_(w, '}', outer);
      return;
    }
    case DP_TENSOR: emit_tensor(w, v); return;
    case DP_OBJECT: {
      const char *cls = dp_object_class(v);
      if (dp_object_is_reduced(v)) {
        dp_value_t st = dp_none();
        dp_object_get(v, "__reduce__", &st, NULL);
        outer = tag_open(w, "$reduce");
        put_string(w, cls, strlen(cls));
        key(w, "state", 5, &outer);
        emit(w, st);
        close_(w, '}', outer);
        return;
      }
      outer = tag_open(w, "$object");
      put_string(w, cls, strlen(cls));
      key(w, "attrs", 5, &outer);
      open_(w, '{', &first);
      for (size_t i = 0; i < dp_object_nattrs(v); i++) {
        const char *name;
        dp_value_t x;
        dp_object_attr(v, i, &name, &x, NULL);
        key(w, name, strlen(name), &first);
        emit(w, x);
      }
      close_(w, '}', first);
      close_(w, '}', outer);
      return;
    }
    default:  /* customs were refused by count_refs */
      puts_(w, "null");
      return;
  }
}

/* Opens {"$ref": "nK" or {"$id": "nK" (K = id - 1); returns `first` for
 * what follows.
 * Not inlined: its buffer in emit's frame is paid once a level. */
static __attribute__((noinline)) int put_name(wr_t *w, const char *tag, int id) {
  char name[24];
  snprintf(name, sizeof name, "n%d", id - 1);
  int first = tag_open(w, tag);
  put_string(w, name, strlen(name));
  return first;
}

static void emit(wr_t *w, dp_value_t v) {
  if (w->rc) return;
  wslot_t *s = dp_value_is_heap(v) && dp_value_refcount(v) > 1 ? wslot(w, dp_value_id(v), 0) : NULL;
  if (!s || s->count == 1) {
    emit_body(w, v);
    return;
  }
  if (s->id > 0) {
    close_(w, '}', put_name(w, "$ref", s->id));
    return;
  }
  s->id = ++w->next_id;
  int first = put_name(w, "$id", s->id);
  key(w, "$value", 6, &first);
  emit_body(w, v);
  close_(w, '}', first);
}

int vjson_write(FILE *out, dp_value_t v, int indent, char *msg, size_t msgsize) {
  wr_t *w = calloc(1, sizeof *w);
  if (!w) {
    snprintf(msg, msgsize, "out of memory");
    return DP_ENOMEM;
  }
  ptrmap_init(&w->shared, sizeof(wslot_t));
  ptrmap_init(&w->stores, 0);
  w->out = out;
  w->indent = indent;
  w->msg = msg;
  w->msgsize = msgsize;
  if (count_refs(w, v, 0) == 0) {
    emit(w, v);
    put(w, "\n", 1);
    flush_out(w);
  }
  int rc = w->rc;
  ptrmap_free(&w->shared);
  ptrmap_free(&w->stores);
  free(w);
  return rc;
}

json_t *vjson_from_value(dp_value_t v, char *msg, size_t msgsize) {
  char *text = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&text, &n);
  if (!f) {
    snprintf(msg, msgsize, "out of memory building JSON");
    return NULL;
  }
  int rc = vjson_write(f, v, 0, msg, msgsize);
  if (fclose(f) != 0 && !rc) {
    rc = DP_ENOMEM;
    snprintf(msg, msgsize, "out of memory building JSON");
  }
  json_t *j = NULL;
  if (!rc) {
    size_t pos;
    j = vjson_parse(text, n, msg, msgsize, &pos);
  }
  free(text);
  return j;
}
