/*
 * scan_path.h — the path to the value being visited (scan_path.c): what
 * an allocation's first path and a WalkError name, rendered from the
 * scanner's frames by the library's renderer (core/path.h).
 */
#ifndef DEVPICKLE_PY_SCAN_PATH_H
#define DEVPICKLE_PY_SCAN_PATH_H

#include "scan_state.h"
#include "../../core/path.h"

typedef struct buf {
  char *p;
  size_t n, cap;
} buf_t;

/* A non-str key's step, rendered once per key and kept while the walk is
 * under it: a repr costs the key's size (a 1 MB bytes key over 2,000
 * allocations took seconds), a path is rendered per allocation. */
struct keystep {
  PyObject *key; /* whose step text holds (held) */
  size_t n;
  char text[DP__STEP_MAX];
};

/* Appends s[0..n) to b, NUL-terminated. 0, or -1 out of memory. */
int dpy_buf_put(buf_t *b, const char *s, size_t n);
/* Appends the path to the value being visited to out. 0, or -1. */
int dpy_render_path(dpy_scanner_t *s, buf_t *out);
/* Raise WalkError naming a type (or obj's) and the current path, with the
 * pending exception as its cause. Return -1. */
int dpy_walk_error_type(dpy_scanner_t *s, PyTypeObject *type, const char *what);
int dpy_walk_error(dpy_scanner_t *s, PyObject *obj, const char *what);
/* The name of t as a frame carries a class, or NULL with a WalkError. */
const char *dpy_frame_class(dpy_scanner_t *s, PyObject *o, PyTypeObject *t, PyObject **hold);

#endif
