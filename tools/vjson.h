/* tools/vjson.h — the value-JSON notation (docs/VALUE_JSON.md). */
#ifndef DP_TOOLS_VJSON_H
#define DP_TOOLS_VJSON_H
#include <stdio.h>
#include <jansson.h>
#include "devpickle.h"
#include "../pickler/path.h"

/* Containers nested at most this deep, in value JSON and in the frames the
 * CLI reads (the same number, so that every frame the CLI accepts has a value
 * JSON form and packs back). */
#define VJSON_MAX_DEPTH 2000
/* JSON nesting that VJSON_MAX_DEPTH value levels can need: a level costs at
 * most 4 JSON levels ({"$id", "$value": {"$dict": [[k, v]]}}), a tensor 3. */
#define VJSON_MAX_JSON_DEPTH (4 * VJSON_MAX_DEPTH + 8)

/* Parses JSON text of n bytes into a jansson tree without jansson's parser:
 * nesting up to VJSON_MAX_JSON_DEPTH, NUL bytes allowed in strings and keys
 * (\u0000), duplicate keys refused, integers outside int64 refused. NULL on
 * error with msg ("... (line L, column C)") and *errpos, the byte offset. */
json_t *vjson_parse(const char *text, size_t n, char *msg, size_t msgsize, size_t *errpos);
/* Frees a tree from vjson_parse (NULL: nothing) without recursion:
 * json_decref frees a tree by recursion, three calls a level, so that the
 * 8,008 levels of objects vjson_parse accepts took 646 KiB of stack. */
void vjson_free(json_t *j);
/* How vjson_parse's msg starts when memory ran out, and only then: no fault
 * of the text, which pack must not call invalid. */
#define VJSON_NO_MEMORY "out of memory"
/* 1 when the first n bytes of a text already fail vjson_parse whatever
 * follows them (and so fail it with the same message, at the same byte): a
 * reader of an endless or huge input can stop there. 0 while they may still
 * begin JSON (or are JSON). Costs a parse of the n bytes. */
int vjson_prefix_fails(const char *text, size_t n);

/* Builds a value from parsed JSON. On error returns a DP_E* code and writes
 * a message naming the JSON path into msg. *is_inline tells whether the
 * storages carry "data" (each on at least one of its tensors) — such values
 * make inline frames. */
int vjson_to_value(json_t *j, dp_value_t *out, int *is_inline, char *msg, size_t msgsize);
/* Tuples of dict keys vjson_to_value has looked into for one still being
 * built: a test counter (the CLI is one thread). */
extern unsigned long long vjson_key_tuples_walked;

/* Writes v as value JSON to out as it walks (no tree is built), indented by
 * `indent` spaces a level (0: compact), and a final newline. Memory: one
 * table entry per node with more than one reference. Returns 0, or a DP_E*
 * code with msg (a custom, nesting deeper than VJSON_MAX_DEPTH, no memory, or
 * DP_EIO when a write failed: check ferror(out)). */
int vjson_write(FILE *out, dp_value_t v, int indent, char *msg, size_t msgsize);
/* Bytes of str dict keys vjson_write has scanned to tell whether they can be
 * plain JSON keys: a test counter. */
extern unsigned long long vjson_key_bytes_scanned;

/* Renders a value as value JSON (new reference), or NULL with msg: the text
 * vjson_write gives, parsed back. For tests and fuzzers. */
json_t *vjson_from_value(dp_value_t v, char *msg, size_t msgsize);

/* Path steps and names are rendered by the library's implementation of
 * docs/FORMAT.md ("Paths"): core/path.h (names, steps, whole paths) and
 * pickler/path.h (dict keys). */
/* The NaN that value JSON writes as {"$float": "nan"}; others go by their bits. */
#define VJSON_DEFAULT_NAN_BITS 0x7ff8000000000000ull

/* A float as value JSON writes it, into b (40 bytes are enough): a finite one
 * with 17 significant digits and always a fraction or an exponent (returns
 * 1); otherwise the text of its {"$float": ...}: nan (the default NaN), inf,
 * -inf, or 0x and the 16 hex digits of its bits (returns 0). */
int vjson_float_text(double f, char *b, size_t cap);

/* base64 */
char *vjson_b64_encode(const uint8_t *p, size_t n);
/* Decodes the len bytes at s (canonical base64: RFC 4648, padded, unused
 * bits zero) into *out (malloc'd; the caller frees) and *n: 0; -1 when the
 * text is not canonical base64, -2 when no memory for the bytes could be
 * had (s is then not read). */
int vjson_b64_decode(const char *s, size_t len, uint8_t **out, size_t *n);
#endif
