/* pickler/path.h — the value-aware half of core/path.h: a dict key as paths
 * show it. For the walker, the reader's messages and the CLI. */
#ifndef DP_PICKLER_PATH_H
#define DP_PICKLER_PATH_H
#include "devpickle/value.h"
#include "../core/path.h"

/* A dict key as paths show it (its value JSON, compact, as unpack writes
 * it), cut after DP_PATH_NAME_MAX bytes (an ellipsis then), into
 * out[DP__STEP_MAX]; returns the length, no NUL. For messages that name a
 * key (a name: dp__name_quoted). */
size_t dp__key_text(dp_value_t key, char *out);
/* The step to a dict's value: `.name` or `["name"]` for a str key, else
 * `[<its JSON text>]`, into out[DP__STEP_MAX]; returns the length. */
size_t dp__step_key(dp_value_t key, char *out);
#endif
