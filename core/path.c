/* core/path.c — names and paths, rendered by the rule of docs/FORMAT.md
 * ("Paths"); see path.h. */
#include "path.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>


_Static_assert(DP_PATH_HEAD + 40 + DP_PATH_TAIL <= DP_PATH_MAX, "an elided path fits in DP_PATH_MAX");

void dp__sb_put(dp__sbuf_t *b, const char *s, size_t n) {
  if (n > b->cap - b->len) {
    n = b->cap - b->len;
    b->full = 1;
  }
  memcpy(b->s + b->len, s, n);
  b->len += n;
}

/* The bytes a character starting with c takes: 1 for ASCII and for a byte
 * that starts none (a stray lead, shown as \ufffd on its own). */
static size_t lead_len(unsigned c) {
  return c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 1;
}

/* A character is at most 4 bytes: the cut moves back over at most 3
 * continuation bytes to the start of the one it splits — only if that
 * one runs past the cut. Continuation bytes after a whole character, or
 * four of them in a row, belong to no character (invalid UTF-8, each shown
 * as \ufffd): the cut stays where it is, between two of them — moving back
 * over them showed "a…" for "a" and 70 stray bytes, or dropped a whole
 * character that fit before them. */
size_t dp__name_shown(const char *s, size_t n, size_t max) {
  if (n <= max) return n;
  for (size_t back = 0; back < 4 && back <= max; back++) {
    size_t k = max - back;
    unsigned c = (unsigned char)s[k];
    if ((c & 0xC0) != 0x80) return k + lead_len(c) > max ? k : max;
  }
  return max;
}

/* The character that starts at p (c = p[0] >= 0x80, avail bytes there):
 * its length, its code point in *cp; 0 when p starts no well-formed UTF-8
 * character (RFC 3629), except that an encoded surrogate is taken as one. */
static size_t utf8_char(const unsigned char *p, size_t avail, uint32_t *cp) {
  unsigned c = p[0];
  size_t n;
  uint32_t v, min;
  if (c >= 0xC2 && c <= 0xDF) n = 2, v = c & 0x1F, min = 0x80;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, v = c & 0x0F, min = 0x800;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, v = c & 0x07, min = 0x10000;
  else return 0;
  if (avail < n) return 0;
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    v = v << 6 | (p[i] & 0x3F);
  }
  if (v < min || v > 0x10FFFF) return 0;
  *cp = v;
  return n;
}

int dp__is_identifier(const char *s, size_t n) {
  if (n == 0) return 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return 0;
  }
  return 1;
}

/* \uXXXX for code point cp (at most U+FFFF), without snprintf: a name may
 * be 64 of them and a path hundreds. */
static void put_u(dp__sbuf_t *b, uint32_t cp) {
  static const char hex[] = "0123456789abcdef";
  char t[6] = {'\\', 'u', hex[cp >> 12 & 15], hex[cp >> 8 & 15], hex[cp >> 4 & 15], hex[cp & 15]};
  dp__sb_put(b, t, 6);
}

/* A character past ASCII written \uXXXX (FORMAT.md, "Paths"): C1 controls
 * (U+009B is CSI to a terminal), the line ends U+2028/U+2029, lone
 * surrogates, and the bidirectional formatting characters — a right-to-left
 * override (U+202E) in a key made the rest of its line display reversed,
 * so that a hostile frame's path could read as another. */
static int escaped_char(uint32_t cp) {
  return cp <= 0x9F || cp == 0x2028 || cp == 0x2029 || (cp >= 0xD800 && cp <= 0xDFFF) || cp == 0x061C ||
         cp == 0x200E || cp == 0x200F || (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

void dp__sb_escaped(dp__sbuf_t *b, const char *str, size_t n, dp__esc_t mode, int cut) {
  const unsigned char *s = (const unsigned char *)str;
  unsigned char delim = mode == DP__ESC_QUOTED ? '"' : mode == DP__ESC_SQUOTED ? '\'' : mode == DP__ESC_BARE ? '>' : 0;
  int backslash = mode != DP__ESC_CONTROLS;
  size_t run = 0, i = 0;
  /* stops once what is pending fills b: the rest is never shown */
  while (i < n && !b->full && i - run <= b->cap - b->len) {
    unsigned c = s[i];
    if (c >= 0x20 && c < 0x7f && c != delim && !(c == '\\' && backslash)) {
      i++;
      continue;
    }
    uint32_t cp = c;
    size_t len = 1;
    if (c >= 0x80) {
      len = utf8_char(s + i, n - i, &cp);
      if (len && !escaped_char(cp)) {
        i += len;  /* a character shown as it is */
        continue;
      }
      if (!len) cp = 0xFFFD, len = 1;  /* a byte of no character */
    }
    dp__sb_put(b, str + run, i - run);
    if (c == '\\' || c == '"' || c == '\'') {  /* a quote is only escaped as the delimiter */
      char t[2] = {'\\', (char)c};
      dp__sb_put(b, t, 2);
    } else {
      put_u(b, cp);
    }
    i += len;
    run = i;
  }
  dp__sb_put(b, str + run, i - run);
  if (cut) dp__sb_put(b, DP__ELLIPSIS, 3);
}

void dp__sb_quote(dp__sbuf_t *b, const char *s, size_t n, int cut) {
  dp__sb_put(b, "\"", 1);
  dp__sb_escaped(b, s, n, DP__ESC_QUOTED, cut);
  dp__sb_put(b, "\"", 1);
}

size_t dp__step_name(const char *s, size_t n, char *out) {
  dp__sbuf_t b = {out, 0, DP__STEP_MAX, 0};
  size_t k = dp__name_shown(s, n, DP_PATH_NAME_MAX);
  if (dp__is_identifier(s, k)) {
    dp__sb_put(&b, ".", 1);
    dp__sb_put(&b, s, k);
    if (k < n) dp__sb_put(&b, DP__ELLIPSIS, 3);
  } else {
    dp__sb_put(&b, "[", 1);
    dp__sb_quote(&b, s, k, k < n);
    dp__sb_put(&b, "]", 1);
  }
  return b.len;
}

size_t dp__name_bare(const char *s, size_t n, char *out) {
  dp__sbuf_t b = {out, 0, DP__STEP_MAX, 0};
  size_t k = dp__name_shown(s, n, DP_PATH_NAME_MAX);
  dp__sb_escaped(&b, s, k, DP__ESC_BARE, k < n);
  return b.len;
}

size_t dp__name_quoted(const char *s, size_t n, char *out) {
  dp__sbuf_t b = {out, 0, DP__STEP_MAX, 0};
  size_t k = dp__name_shown(s, n, DP_PATH_NAME_MAX);
  dp__sb_quote(&b, s, k, k < n);
  return b.len;
}

size_t dp__step_reduce(const char *s, size_t n, char *out) {
  dp__sbuf_t b = {out, 0, DP__STEP_MAX, 0};
  size_t k = dp__name_shown(s, n, DP_PATH_NAME_MAX);
  dp__sb_put(&b, "<reduce ", 8);
  dp__sb_escaped(&b, s, k, DP__ESC_BARE, k < n);
  dp__sb_put(&b, ">", 1);
  return b.len;
}

size_t dp__step_in_key(size_t i, char *out) {
  return (size_t)snprintf(out, DP__STEP_MAX, "<key %zu>", i);
}

size_t dp__step_index(size_t i, char *out) {
  char tmp[24];
  size_t k = sizeof tmp;
  tmp[--k] = ']';
  do {
    tmp[--k] = (char)('0' + i % 10);
    i /= 10;
  } while (i);
  tmp[--k] = '[';
  memcpy(out, tmp + k, sizeof tmp - k);
  return sizeof tmp - k;
}

_Thread_local uint64_t dp__path_steps_rendered;

size_t dp__path_render(char out[DP_PATH_MAX + 1], size_t nsteps, dp__step_fn step, void *ctx) {
  char buf[DP__STEP_BUF];
  size_t len = 1, head_steps = 0, head_len = 1, d, n;
  out[0] = '$';
  for (d = 0; d < nsteps; d++) {
    n = step(ctx, d, buf);
    dp__path_steps_rendered++;
    if (len + n > DP_PATH_MAX) break;
    memcpy(out + len, buf, n);
    len += n;
    if (len <= DP_PATH_HEAD) {
      head_steps = d + 1;
      head_len = len;
    }
  }
  if (d < nsteps) {
    /* Too long: the head, how many steps are left out, the tail. The head
     * and the tail together are under DP_PATH_MAX bytes, so at least one
     * step is left out; no step is longer than the tail's budget, so the
     * last one is always shown. */
    size_t tail_len = 0, t = nsteps;
    while (t > head_steps && (dp__path_steps_rendered++, tail_len + (n = step(ctx, t - 1, buf)) <= DP_PATH_TAIL)) {
      tail_len += n;
      t--;
    }
    len = head_len;
    len += (size_t)snprintf(out + len, DP_PATH_MAX + 1 - len, "<" DP__ELLIPSIS "%zu step%s" DP__ELLIPSIS ">",
                            t - head_steps, t - head_steps == 1 ? "" : "s");
    for (d = t; d < nsteps; d++) {
      n = step(ctx, d, buf);
      dp__path_steps_rendered++;
      memcpy(out + len, buf, n);
      len += n;
    }
  }
  out[len] = '\0';
  return len;
}
