/*
 * scan_build.h — the walk's build mode (scan_build.c), for dumps: each
 * value visited is made and attached to the slot of the frame above it.
 * The scanner's results after a build are ext.h's (dpy_scanner_root, ...).
 */
#ifndef DEVPICKLE_PY_SCAN_BUILD_H
#define DEVPICKLE_PY_SCAN_BUILD_H

#include "scan_state.h"

/* Visits one value: a leaf returns, memory is added, a container or an
 * object gets a frame. */
int dpy_build_visit(dpy_scanner_t *s, PyObject *o, uint8_t k);
/* The list of (key, value) pairs for the FR_PAIRS frame about to be
 * pushed (s->made). 0, or -1 with an exception. */
int dpy_build_pairs(dpy_scanner_t *s);
/* Reduce frame f's callable and args are made, or tuple frame f's items:
 * its object's value enters the memo (nothing when it has). Needs no
 * memory (dpy_build_visit made the entry's room). */
void dpy_build_made(dpy_scanner_t *s, frame_t *f);
/* After the walk: every storage the frame will read is still where the
 * walk found it. 0, or -1 with a WalkError. */
int dpy_check_storages(dpy_scanner_t *s);
/* Lets go of what the last build made. */
void dpy_build_reset(dpy_scanner_t *s);

#endif
