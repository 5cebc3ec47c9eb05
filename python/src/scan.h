/*
 * scan.h — what the walk (scan.c) gives devpickle.scan's module setup
 * (scan_result.c) beyond ext.h's door.
 */
#ifndef DEVPICKLE_PY_SCAN_H
#define DEVPICKLE_PY_SCAN_H

#include "ext.h"

/* Checks the instance layout the walk reads without a call (CPython 3.11,
 * 3.12) and says whether it is read: m._managed_words, which tests read.
 * 0, or -1 with an exception. */
int dpy_managed_layout_init(PyObject *m);

#endif
