/* core/path.h — names and paths as docs/FORMAT.md ("Paths") renders them.
 *
 * The one implementation of the rule: the walker's paths and messages
 * (pickler/), the CLI's paths into value JSON and `inspect`'s (tools/) and
 * the Python binding's paths (python/src/scan.c) all render through it, so
 * an escape or a bound changes in one place. Bytes only: it knows no value,
 * frame or stack; a caller hands it names, and for a whole path a function
 * that renders step i.
 *
 * Nothing here allocates: steps render into caller buffers of fixed size,
 * and a path costs time bounded by DP_PATH_MAX, not by its depth or its
 * names' lengths. */
#ifndef DP_CORE_PATH_H
#define DP_CORE_PATH_H

#include <stddef.h>
#include <stdint.h>
#include "devpickle/ptrset.h"

#define DP__ELLIPSIS "\xe2\x80\xa6" /* U+2026 */
/* The longest step the library renders: <reduce <64 bytes, each escaped to
 * 6>…> (an escape never takes more than 6 bytes per byte of text). */
#define DP__STEP_MAX (8 + 6 * DP_PATH_NAME_MAX + 3 + 1)
/* A step as dp__path_render's callback writes it: room for a caller's own
 * suffix after a name (the Python binding's `<reduce T>.state_setter`).
 * Under DP_PATH_TAIL, so that a path's last step always fits. */
#define DP__STEP_BUF 512
_Static_assert(DP__STEP_MAX <= DP__STEP_BUF && DP__STEP_BUF <= DP_PATH_TAIL, "the last step always fits");

/* Appends to a fixed buffer; what does not fit is dropped and `full` set. */
typedef struct dp__sbuf {
  char *s;
  size_t len, cap;
  int full;
} dp__sbuf_t;

void dp__sb_put(dp__sbuf_t *b, const char *s, size_t n);

/* What a name's text is escaped for. Every mode writes each control
 * character (U+0000–U+001F, U+007F, U+0080–U+009F) and each line or
 * paragraph separator (U+2028, U+2029) as \uXXXX, an encoded lone surrogate
 * (a Python str's, encoded with "surrogatepass") as \uXXXX too, and each
 * byte that is no part of a well-formed UTF-8 character as \ufffd; so a
 * name shown is one line of valid UTF-8 that no terminal, JSON or JS
 * reader takes for more. The modes add: */
typedef enum dp__esc {
  DP__ESC_QUOTED,   /* inside "...": `"` as \" and `\` as \\ (a JSON string) */
  DP__ESC_SQUOTED,  /* inside '...' (messages): `'` as \' and `\` as \\ */
  DP__ESC_BARE,     /* outside quotes (<reduce T>, a class name): `\` as \\, `>` as \u003e */
  DP__ESC_CONTROLS  /* text escaped already (a Python repr): nothing more */
} dp__esc_t;

/* How many of a name's n bytes a path shows: at most max (DP_PATH_NAME_MAX
 * for paths), cut back to the start of a UTF-8 character. */
size_t dp__name_shown(const char *s, size_t n, size_t max);
/* Whether s is an identifier ([A-Za-z_][A-Za-z0-9_]*): a name written .name. */
int dp__is_identifier(const char *s, size_t n);
/* s[0..n) escaped for `mode`, "…" after it when cut; stops once b is full
 * (a long text costs what is kept of it, not its length). */
void dp__sb_escaped(dp__sbuf_t *b, const char *s, size_t n, dp__esc_t mode, int cut);
/* A JSON string of s[0..n), "…" before its closing quote when cut. */
void dp__sb_quote(dp__sbuf_t *b, const char *s, size_t n, int cut);

/* Steps into out[DP__STEP_MAX]; each returns its length (no NUL). A name
 * shows its first DP_PATH_NAME_MAX bytes (dp__name_shown), then "…". */
size_t dp__step_name(const char *s, size_t n, char *out);   /* .name or ["name"] */
size_t dp__step_reduce(const char *s, size_t n, char *out); /* <reduce Name> */
size_t dp__step_index(size_t i, char *out);                 /* [i] */
size_t dp__step_in_key(size_t i, char *out);                /* <key i>: inside entry i's key */
/* A name outside quotes, cut and escaped as in <reduce Name>: for messages
 * and summaries that show a class or type name. */
size_t dp__name_bare(const char *s, size_t n, char *out);
/* A name as a JSON string, cut and escaped as in ["name"]. */
size_t dp__name_quoted(const char *s, size_t n, char *out);
/* Writes into out a path of nsteps steps after "$", step i rendered by
 * step(ctx, i, buf) into buf[DP__STEP_BUF] (its length returned): whole when
 * it is at most DP_PATH_MAX bytes, else the leading steps that fit in
 * DP_PATH_HEAD bytes ("$" included), "<…N steps…>" and the trailing steps
 * that fit in DP_PATH_TAIL bytes. Steps are rendered only while they can
 * show (the tail's twice), so the cost is bounded by DP_PATH_MAX however
 * deep the path. Returns the length; out is NUL-terminated. */
typedef size_t (*dp__step_fn)(void *ctx, size_t i, char *buf);
size_t dp__path_render(char out[DP_PATH_MAX + 1], size_t nsteps, dp__step_fn step, void *ctx);
/* Steps this thread's dp__path_render calls have asked their callback for:
 * a test counter, so that tests count a path's cost instead of timing it. */
extern _Thread_local uint64_t dp__path_steps_rendered;

#endif
