/*
 * scan_memory.h — the memory a value holds (scan_memory.c). A visit_*
 * adds what o holds to the scanner's allocations (and pushes the frames of
 * what else pickle carries of it): 0, or -1 with a walk error; dpy_visit_iface
 * and dpy_visit_dlpack return 1 when o turns out to have no such interface.
 * The readers under them answer the builder too.
 */
#ifndef DEVPICKLE_PY_SCAN_MEMORY_H
#define DEVPICKLE_PY_SCAN_MEMORY_H

#include "scan_state.h"

int dpy_visit_torch(dpy_scanner_t *s, PyObject *o);
int dpy_visit_tensor_attrs(dpy_scanner_t *s, PyObject *o);
int dpy_visit_storage(dpy_scanner_t *s, PyObject *o);
int dpy_visit_cupy(dpy_scanner_t *s, PyObject *o);
int dpy_visit_iface(dpy_scanner_t *s, PyObject *o, int cuda);
int dpy_visit_dlpack(dpy_scanner_t *s, PyObject *o);
int dpy_visit_buffer(dpy_scanner_t *s, PyObject *o);
int dpy_visit_sync(dpy_scanner_t *s, PyObject *o);
/* Whether o's own __dict__ holds a __cuda_array_interface__: 1, 0, or -1
 * with an exception. */
int dpy_instance_cai(PyObject *o);

/* torch: whether o is a tensor; tensor t's allocations (their number, or
 * -1 with an exception); the UntypedStorage under a tensor or storage (a
 * new reference, or NULL with an exception) and its base and size. */
int dpy_is_torch(PyObject *o);
int dpy_torch_allocs(PyObject *t, dp_torch_alloc_t *out);
PyObject *dpy_untyped_storage(PyObject *o);
int dpy_storage_extent(PyObject *st, dp_torch_alloc_t *out);
/* cupy array o's allocation. 0, or -1 with an exception. */
int dpy_cupy_memory(PyObject *o, dp_device_t *dev, void **base, size_t *size);
/* A buffer-protocol object's cpu memory, its owner's (*borrowedp: memory
 * an owner that is no buffer may free; *objectsp, when given: whether its
 * items hold Python objects). 0, or -1 with a walk error. */
int dpy_buffer_memory_objects(dpy_scanner_t *s, PyObject *o, dp_device_t *devp, void **basep, size_t *extp,
                          int *borrowedp, int *objectsp);
int dpy_buffer_memory(dpy_scanner_t *s, PyObject *o, dp_device_t *devp, void **basep, size_t *extp, int *borrowedp);
/* Item `key` of an array-interface dict, a new reference or NULL. 0, or
 * -1 with the exception a key's comparison raised. */
int dpy_iface_part(PyObject *d, PyObject *key, PyObject **out);

#endif
