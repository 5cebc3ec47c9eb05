/* tools/inspect.h — the value tree printer of `devpickle inspect`. */
#ifndef DP_TOOLS_INSPECT_H
#define DP_TOOLS_INSPECT_H
#include <stdio.h>
#include "devpickle.h"

/* One line a node: path, kind, summary; shared nodes as "-> PATH"; levels
 * deeper than 64 summarized. */
void inspect_print(FILE *out, dp_value_t v);
#endif
