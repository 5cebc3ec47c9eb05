/*
 * scan_reduce.h — the reduce protocol (scan_reduce.c): an object's reduce,
 * checked as pickle checks it and pushed as a frame of its parts; the
 * state pickle carries of an instance (its own __getstate__'s, its
 * __dict__ and set slots); copyreg.dispatch_table's say.
 */
#ifndef DEVPICKLE_PY_SCAN_REDUCE_H
#define DEVPICKLE_PY_SCAN_REDUCE_H

#include "scan_state.h"

/* o's reduce (a str, or a tuple of 2 to 6 parts: borrowed, kept by the
 * walk), or NULL with a walk error; dpy_push_reduce pushes the frame of r's
 * parts; dpy_enter_reduce does both. 0, or -1 with a walk error. */
PyObject *dpy_reduce_of(dpy_scanner_t *s, PyObject *o);
int dpy_push_reduce(dpy_scanner_t *s, PyObject *o, PyObject *r);
int dpy_enter_reduce(dpy_scanner_t *s, PyObject *o);
/* A reduce's listitems or dictitems drained into a list the walk keeps
 * (borrowed), or NULL with an exception. */
PyObject *dpy_drain(dpy_scanner_t *s, PyObject *it);
/* l (a new list, or NULL) out of the collector's sight. */
PyObject *dpy_private_list(PyObject *l);

/* Whether k names what pickle looks up on the instance (getattr) to reduce
 * an object whose class keeps its defaults: __reduce_ex__ (pickle's own
 * lookup) and __getstate__ (object.__reduce_ex__'s). An instance __reduce__
 * is not one: object.__reduce_ex__ asks the class for it. Compares
 * characters only, running no code (a str subclass's __eq__ is not asked). */
static inline int dpy_reduce_name(PyObject *k) {
  if (k == dpy.str_reduce_ex || k == dpy.str_getstate) return 1;
  if (!PyUnicode_Check(k)) return 0;
  /* most names differ in length: no compare */
  Py_ssize_t n = PyUnicode_GET_LENGTH(k);
  PyObject *like = n == PyUnicode_GET_LENGTH(dpy.str_reduce_ex) ? dpy.str_reduce_ex
                   : n == PyUnicode_GET_LENGTH(dpy.str_getstate) ? dpy.str_getstate
                                                                  : NULL;
  return like && PyUnicode_Compare(k, like) == 0;
}

/* Whether copyreg.dispatch_table or the instance's own __dict__ reduces o:
 * 1, 0, or -1 with a walk error (dpy_dispatch_error's, when the table's
 * lookup raised). dpy_instance_reduces: the __dict__ alone — one that holds
 * a __reduce_ex__ or __getstate__, or (not building: dumps carries its
 * entries as attributes, refusing a name that is not a str) a key that is
 * not a str or a dict subclass, which pickle's state carries otherwise
 * than as attributes. */
int dpy_dispatched(dpy_scanner_t *s, PyObject *o);
int dpy_instance_reduces(dpy_scanner_t *s, PyObject *o);
int dpy_dispatch_error(dpy_scanner_t *s, PyObject *o);

/* Whether t has a __getstate__ of its own; the state it returns, pushed
 * as a reduce's (0, or -1 with a walk error). */
int dpy_own_getstate(PyTypeObject *t);
int dpy_push_own_state(dpy_scanner_t *s, PyObject *o);
/* Whether tensors of class t, or tensor o, are reduced by a reduce of
 * their own rather than torch's: 1, 0, or -1 with an error set. */
int dpy_own_class_reduce(PyTypeObject *t);
int dpy_own_tensor_reduce(PyObject *o);
/* The instance attributes pickle carries beyond what a C base's reduce
 * does: a tensor subclass's slots merged into *d (dpy_tensor_slots), a Python
 * subclass's __dict__ and slots of an instance of kind `kind`
 * (dpy_subclass_attrs, *out or NULL). 0, or -1 with a walk error. */
int dpy_tensor_slots(dpy_scanner_t *s, PyObject *o, PyObject **d);
int dpy_subclass_attrs(dpy_scanner_t *s, PyObject *o, uint8_t kind, PyObject **out);
/* What a walk error says of an object with no reduce: with the opaque=
 * hint where the walk takes opaque= (not building for dumps), naming the
 * parent's for a then() future's walk. */
const char *dpy_not_reducible(const dpy_scanner_t *s);

#endif
