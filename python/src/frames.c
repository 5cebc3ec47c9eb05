#include "ext.h"
int dpy_frames_init(PyObject *m) { (void)m; return 0; }
PyObject *dpy_dumps(PyObject *self, PyObject *args, PyObject *kw) { (void)self; (void)args; (void)kw; PyErr_SetString(PyExc_NotImplementedError, "wip"); return NULL; }
PyObject *dpy_loads(PyObject *self, PyObject *args, PyObject *kw) { (void)self; (void)args; (void)kw; PyErr_SetString(PyExc_NotImplementedError, "wip"); return NULL; }
