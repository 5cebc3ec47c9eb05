/*
 * scan_state.h — the scanner: the state every layer of the walk reads and
 * writes (its frames, memo, allocations found, and what a build makes).
 * Not installed; included by the walk's files only.
 */
#ifndef DEVPICKLE_PY_SCAN_STATE_H
#define DEVPICKLE_PY_SCAN_STATE_H

#include "ext.h"
#include "scan_classify.h"
#include "../../core/table.h"

#include <stdint.h>

/* A dict whose iteration meets more entries than it held when entered: the
 * value's code put a key back or moved one, as Python's iteration refuses it
 * ("dictionary keys changed during iteration"). */
#define DPY_KEYS_CHANGED "dictionary keys changed during the walk (Python code of the value's changed it)"

/* ---- frames ---- */
enum { FR_SEQ, FR_DICT, FR_ATTRS, FR_SET, FR_REDUCE, FR_PAIRS };

typedef struct frame {
  uint8_t kind;
  PyObject *obj;        /* what is iterated (borrowed: held by its parent or the keep list) */
  PyObject *names;      /* FR_SEQ of a namedtuple: its _fields (kept) */
  PyTypeObject *type;   /* FR_REDUCE, FR_PAIRS: the reduced object's type; FR_ATTRS: the
                           object's, whose __dict__ obj is (held) */
  Py_ssize_t pos;       /* iteration position */
  Py_ssize_t idx;       /* the current child's index */
  PyObject *label;      /* the current child's key or name (borrowed) */
  int key_part;         /* FR_DICT / FR_PAIRS: 1 while the key itself is walked */
  PyObject *value;      /* FR_DICT: the value of that key (held: no second lookup); FR_SET: the set */
  Py_ssize_t dsize;     /* FR_DICT / FR_ATTRS: the dict's size when entered; FR_SET: the set's */
  Py_ssize_t kpos;      /* FR_DICT / FR_ATTRS: the position label (the key met last) was read from */
  struct keystep *ks;   /* a non-str key's rendered step (put_key_once), or NULL */
  /* building (dumps): the container being filled (borrowed: its parent or
   * the memo holds it) and a key built before its value */
  dp_value_t out;
  dp_value_t key;
  int has_key;
  /* FR_REDUCE, building: 1 + the memo entry whose value (out) is entered
   * once the reduce's callable and args are made (dpy_build_made); 0 once
   * entered. Until then a reference to the object is a cycle through its
   * callable or args, which loads cannot rebuild (pickle: RecursionError). */
  size_t memo_pending;
} frame_t;

struct dpy_scanner {
  dpy_scanner_t *next_free;
  dp_ptrset_t *found;    /* the allocations: own, or the caller's */
  dp_ptrset_t *own;
  dp_ptrset_t *memo;     /* objects entered, by address (each also in keep: see dpy_seen_at) */
  PyObject *keep;        /* a list: what the walk created or entered, alive until it ends */
  PyObject *reprs;       /* key_text: the items of tuple and frozenset keys shown, by identity: id -> (item, text,
                            cut) */
  frame_t *frames;
  size_t nframes, cap;
  /* first paths: offsets into text, one per allocation */
  char *text;
  size_t text_len, text_cap;
  size_t *path_at;
  size_t npaths, paths_cap;
  int want_paths;
  const char *error_path; /* set: the path a walk error names (an allocation's, after the walk) */
  /* refs (scan): tensors skip the memo, so the set counts every visit of
   * one; the scanner counts distinct objects instead (account()). first[i]
   * and second[i] are the first two distinct objects found on allocation i
   * (held until a third comes: then all are entered in `counted`, the
   * objects counted on allocations met with more than two, each with the
   * allocation it was counted on: an object found on several allocations —
   * a sparse or per-channel quantized tensor, a tensor whose storage the
   * value's code swapped during the walk — counts on each). */
  int count_refs;
  /* the walk of the next visit() (not building): `solo` — its only
   * reference is its container's slot; `ran_code` — the walk has called
   * Python code that may hand it new references (a reduce, a slot read) */
  int solo, ran_code;
  /* run_object looked o's class up in copyreg.dispatch_table (which may
   * run a metaclass's code) and left o for visit(): the answer, for it */
  PyObject *dispatch_obj; /* borrowed, compared only */
  int dispatch_known;
  uint32_t *refs;
  PyObject **first, **second;
  size_t nfirst, first_cap;
  struct dpy_counted { PyObject *obj; size_t alloc; } *counted; /* [ncounted], in the order entered */
  size_t ncounted, counted_cap;
  dp__table_t counted_tab; /* (obj, alloc) -> its entry (scan_state.c) */
  PyObject *opaque;   /* opts->opaque: the types, or NULL */
  dpy_opaque_t op;    /* and what each type met is to them (scan_classify.h) */
  uint32_t max_depth;
  /* allocations found and not yet in `found`, when no path or index is asked
   * for them: added in batches (dp_ptrset_add_many), in order */
  dp_ptr_info_t pend[32];
  PyObject *pend_obj[32]; /* count_refs: the object each was found on (held) */
  int npend;
  /* building (dumps): the root, a value per memo entry, a storage per
   * allocation and the first object found on it */
  int build;
  int copy_borrowed; /* opts->inline_data */
  int chained;       /* opts->chained: where a walk error says opaque= is given */
  dp_value_t root;
  dp_value_t *vals;
  size_t vals_cap;
  dp_storage_t **stor;
  PyObject **stor_obj;
  PyObject **stor_st;   /* a torch tensor's storage object, held (the frame reads its memory) */
  size_t stor_cap;
  dp_value_t made;  /* the container dpy_build_pairs made for the frame pushed next */
  int saw_cupy;     /* a cupy array was found: its streams are cupy's */
};

/* Frames: pushed (of kind FR_*, iterating obj, the parts of an object of
 * type owner, which a too-deep error names; 0, or -1 with a walk error)
 * and dropped. */
int dpy_push(dpy_scanner_t *s, uint8_t kind, PyObject *obj, PyTypeObject *owner);
/* An FR_SET frame over items, a list of set's items: the set is held and its
 * size checked at each step (a set that changed size is refused, as pickle
 * refuses it). 0, or -1 with an exception. */
int dpy_push_set(dpy_scanner_t *s, PyObject *items, PyObject *set);
void dpy_frame_drop(frame_t *f);

/* The memo: 1 when obj was entered before, 0 the first time (*at: its
 * entry), -1 with an exception. */
int dpy_seen_at(dpy_scanner_t *s, PyObject *obj, size_t *at);
int dpy_seen(dpy_scanner_t *s, PyObject *obj);
/* Keeps o (a new reference, stolen; NULL passes through) alive until the
 * walk ends. o, borrowed, or NULL with an exception. */
PyObject *dpy_keep(dpy_scanner_t *s, PyObject *o);

/* Allocations: added at once (*at its index, its first path rendered),
 * or in a batch (add_alloc) that dpy_flush_pending adds. 0, or -1 with an
 * exception. */
int dpy_add_alloc_at(dpy_scanner_t *s, dp_device_t dev, void *base, size_t nbytes, PyObject *obj, size_t *at);
int dpy_flush_pending(dpy_scanner_t *s);
/* Lets go of the objects the last walk counted refs on. */
void dpy_refs_reset(dpy_scanner_t *s);

/* Adds an allocation found on obj: in a batch when no path or index is
 * asked for it. */
static inline __attribute__((always_inline)) int add_alloc(dpy_scanner_t *s, dp_device_t dev, void *base, size_t nbytes, PyObject *obj) {
  if (s->want_paths || s->build) return dpy_add_alloc_at(s, dev, base, nbytes, obj, NULL);
  if (s->npend == (int)(sizeof s->pend / sizeof s->pend[0]) && dpy_flush_pending(s)) return -1;
  if (s->count_refs) s->pend_obj[s->npend] = Py_NewRef(obj);
  s->pend[s->npend++] = (dp_ptr_info_t){dev, base, nbytes, 0, NULL};
  return 0;
}

#endif
