/* tools/inspect.h — the value tree printer of `devpickle inspect`. */
#ifndef DP_TOOLS_INSPECT_H
#define DP_TOOLS_INSPECT_H
#include <stdio.h>
#include "devpickle.h"

/* One line a node: path, kind, summary; shared nodes as "-> PATH"; levels
 * deeper than 64 summarized; paths shortened by the rule of
 * docs/VALUE_JSON.md ("Paths"). Time and memory linear in the nodes printed.
 * Returns 0, or -1 when out of memory (the output stops there). */
int inspect_print(FILE *out, dp_value_t v);
#endif
