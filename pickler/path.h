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
/* The step from container c (list, tuple, dict, object) to its child i (a
 * dict's value i, an object's attribute i; a reduced stand-in's parts are
 * all `<reduce Name>`) into out[DP__STEP_MAX]; returns the length, 0 for a
 * value of another kind. For readers of a value that keep a stack of
 * (container, index) and name a node only when something fails. */
size_t dp__step_child(dp_value_t c, size_t i, char *out);
#endif
