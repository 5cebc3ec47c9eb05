/* tools/vjson.h — the value-JSON notation (docs/VALUE_JSON.md). */
#ifndef DP_TOOLS_VJSON_H
#define DP_TOOLS_VJSON_H
#include <jansson.h>
#include "devpickle.h"

#define VJSON_MAX_DEPTH 2000

/* Builds a value from parsed JSON. On error returns a DP_E* code and writes
 * a message naming the JSON path into msg. *is_inline tells whether the
 * tensors carry "data" (all of them) — such values make inline frames. */
int vjson_to_value(json_t *j, dp_value_t *out, int *is_inline, char *msg, size_t msgsize);

/* Renders a value as value JSON (new reference), or NULL with msg. */
json_t *vjson_from_value(dp_value_t v, char *msg, size_t msgsize);

/* base64 */
char *vjson_b64_encode(const uint8_t *p, size_t n);
int vjson_b64_decode(const char *s, uint8_t **out, size_t *n);
#endif
