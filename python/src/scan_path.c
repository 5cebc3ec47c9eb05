/*
 * scan_path.c — the path to the value being visited, as a walk error and an
 * allocation's first path name it (scan_path.h).
 */
#include "scan_path.h"
#include "scan_classify.h"
#include "../../core/path.h"

#include <string.h>

/* ---- paths ---- */

int dpy_buf_put(buf_t *b, const char *s, size_t n) {
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
  return 0;
}

/* Paths are rendered by the library's renderer (core/path.h), the rule
 * written once for C, the CLI and Python; here only what Python adds: how a
 * step is found in a frame, repr for keys that are not str, None or bool. */

/* A str's UTF-8; for one holding a lone surrogate (it has none) its
 * "surrogatepass" bytes, which the renderer writes \udXXX as JSON does
 * (*hold then keeps them: release it). NULL, the error cleared, when
 * neither can be had. */
static const char *str_bytes(PyObject *str, size_t *n, PyObject **hold) {
  Py_ssize_t len;
  *hold = NULL;
  const char *s = PyUnicode_AsUTF8AndSize(str, &len);
  if (!s) {
    dpy_clear_error();
    if (!(*hold = PyUnicode_AsEncodedString(str, "utf-8", "surrogatepass"))) {
      dpy_clear_error();
      return NULL;
    }
    len = PyBytes_GET_SIZE(*hold);
    s = PyBytes_AS_STRING(*hold);
  }
  *n = (size_t)len;
  return s;
}

/* A name or string key: .name when it is an identifier, else ["..."]. */
static size_t put_name(PyObject *str, char *out) {
  size_t n;
  PyObject *hold;
  const char *s = str_bytes(str, &n, &hold);
  if (!s) {
    memcpy(out, "[<str>]", 7);
    return 7;
  }
  n = dp__step_name(s, n, out);
  Py_XDECREF(hold);
  return n;
}

/* The characters of a key's repr that key_text makes at least, when it
 * makes less than all of it: more than a step shows (DP_PATH_NAME_MAX
 * bytes, a character at most 4 of them), so the step is the one the whole
 * repr gives. */
#define KEY_TEXT_CHARS (DP_PATH_NAME_MAX + 16)

static PyObject *key_text(dpy_scanner_t *s, PyObject *o, int *cut, int depth);

/* The text of item o of a tuple or frozenset key (key_text), made once per
 * object in a walk: many keys that share one large item — (i, T) over one
 * 100,000-item T — cost its repr once, not once a key. A new reference, or
 * NULL with an exception. */
static PyObject *item_text(dpy_scanner_t *s, PyObject *o, int *cut, int depth) {
  if (!s->reprs && !(s->reprs = PyDict_New())) return NULL;
  PyObject *id = PyLong_FromVoidPtr(o);
  if (!id) return NULL;
  PyObject *hit = PyDict_GetItemWithError(s->reprs, id); /* int keys: no code runs */
  if (hit) {
    Py_DECREF(id);
    *cut = PyTuple_GET_ITEM(hit, 2) == Py_True;
    return Py_NewRef(PyTuple_GET_ITEM(hit, 1));
  }
  PyObject *t = PyErr_Occurred() ? NULL : key_text(s, o, cut, depth);
  if (t && *cut == 0 && PyUnicode_GET_LENGTH(t) > KEY_TEXT_CHARS) { /* kept short: what a step can show */
    Py_SETREF(t, PyUnicode_Substring(t, 0, KEY_TEXT_CHARS));
    *cut = 1;
  }
  PyObject *ent = t ? PyTuple_Pack(3, o, t, *cut ? Py_True : Py_False) : NULL; /* o held: its id stays its own */
  int rc = ent ? PyDict_SetItem(s->reprs, id, ent) : -1;
  Py_DECREF(id);
  Py_XDECREF(ent);
  if (rc) Py_CLEAR(t);
  return t;
}

/* repr(o) — or, *cut set, a prefix of it of at least KEY_TEXT_CHARS
 * characters: an exact tuple's or frozenset's is made of its items' texts
 * (item_text) as repr makes it, up to that length, so that a key's step
 * costs what it shows, not the key's size. A new reference, or NULL with
 * an exception (repr's: the step then names the type). */
static PyObject *key_text(dpy_scanner_t *s, PyObject *o, int *cut, int depth) {
  *cut = 0;
  int tuple = PyTuple_CheckExact(o), fset = PyFrozenSet_CheckExact(o);
  if ((!tuple && !fset) || depth > KEY_TEXT_CHARS) return PyObject_Repr(o); /* deeper: its "(" alone fill it */
  if (fset && PySet_GET_SIZE(o) == 0) return PyUnicode_FromString("frozenset()");
  PyObject *parts = PyList_New(0), *sep = PyUnicode_FromString(", "), *it = PyObject_GetIter(o), *x;
  PyObject *open = PyUnicode_FromString(tuple ? "(" : "frozenset({"), *r = NULL;
  Py_ssize_t len = PyUnicode_GET_LENGTH(open ? open : sep), n = 0;
  int ok = parts && sep && it && open && !PyList_Append(parts, open);
  while (ok && !*cut && len < KEY_TEXT_CHARS && (x = PyIter_Next(it))) {
    PyObject *t = item_text(s, x, cut, depth + 1);
    Py_DECREF(x);
    ok = t && (!n++ || !PyList_Append(parts, sep)) && !PyList_Append(parts, t);
    if (t) len += PyUnicode_GET_LENGTH(t) + 2;
    Py_XDECREF(t);
  }
  if (ok && PyErr_Occurred()) ok = 0;
  if (ok && len >= KEY_TEXT_CHARS) *cut = 1; /* a prefix: the rest is not looked at */
  if (ok && !*cut) {
    PyObject *close = PyUnicode_FromString(tuple ? n == 1 ? ",)" : ")" : "})");
    ok = close && !PyList_Append(parts, close);
    Py_XDECREF(close);
  }
  if (ok) {
    PyObject *empty = PyUnicode_FromString("");
    r = empty ? PyUnicode_Join(empty, parts) : NULL;
    Py_XDECREF(empty);
  }
  Py_XDECREF(parts);
  Py_XDECREF(sep);
  Py_XDECREF(it);
  Py_XDECREF(open);
  return r;
}

/* A key that is not a str: [null], [true], [false], else [repr] (repr
 * escapes already: only control characters are escaped again). */
static size_t put_key(dpy_scanner_t *sc, PyObject *key, char *out) {
  if (PyUnicode_CheckExact(key)) return put_name(key, out);
  if (key == Py_None) return memcpy(out, "[null]", 6), 6;
  if (key == Py_True) return memcpy(out, "[true]", 6), 6;
  if (key == Py_False) return memcpy(out, "[false]", 7), 7;
  int cut;
  PyObject *r = key_text(sc, key, &cut, 0);
  dp__sbuf_t b = {out, 0, DP__STEP_MAX, 0};
  if (!r) {
    /* its type's name instead, cut and escaped as in <reduce T>: a name
       is any str (a newline, a `>`, 300 bytes cut mid-character) */
    dpy_clear_error();
    char tn[DP__STEP_MAX];
    size_t tl = dp__name_bare(Py_TYPE(key)->tp_name, strlen(Py_TYPE(key)->tp_name), tn);
    dp__sb_put(&b, "[<", 2);
    dp__sb_put(&b, tn, tl);
    dp__sb_put(&b, ">]", 2);
    return b.len;
  }
  size_t n;
  PyObject *hold;
  const char *s = str_bytes(r, &n, &hold);
  if (!s) {
    dp__sb_put(&b, "[?]", 3);
  } else {
    size_t k = dp__name_shown(s, n, DP_PATH_NAME_MAX);
    dp__sb_put(&b, "[", 1);
    dp__sb_escaped(&b, s, k, DP__ESC_CONTROLS, k < n);
    dp__sb_put(&b, "]", 1);
  }
  Py_XDECREF(hold);
  Py_DECREF(r);
  return b.len;
}

/* "m.q", or q alone when m is NULL or `builtins`, as a bytes object in
 * *hold: a name has no length limit (a fixed buffer cut a 300-byte class
 * name, and the frame carried the cut one). Returns its text, or fallback
 * (*hold NULL) when memory runs out: the MemoryError is held for the walk
 * (dpy_clear_error). */
static const char *dotted(const char *m, const char *q, const char *fallback, PyObject **hold) {
  *hold = m && strcmp(m, "builtins") ? PyBytes_FromFormat("%s.%s", m, q) : PyBytes_FromString(q);
  if (*hold) return PyBytes_AS_STRING(*hold);
  dpy_clear_error();
  return fallback;
}

/* What makes a class's name no name for a frame (type_name_nul's *bad). */
enum { NAME_OK, NAME_NUL, NAME_NOT_TEXT };

/* A type as paths, errors and frames name it: module.qualname for classes
 * defined in Python (tp_name is only their name), tp_name (already
 * qualified) for C types. *hold keeps the text (a new reference, or NULL:
 * Py_XDECREF it once the text is used). *bad (when given) says when the
 * text is not the class's module.qualname, as loads' classes= labels it
 * (module "builtins" or None: the qualname alone): NAME_NUL when the module
 * or qualname holds a NUL byte (the text is then cut at it), NAME_NOT_TEXT
 * when either is no str of UTF-8 (a lone surrogate; a __module__ of another
 * type; a metaclass's __qualname__ that is none), whose place the text
 * fills with tp_name, or leaves out: another class's name. */
static const char *type_name_nul(PyTypeObject *t, PyObject **hold, int *bad) {
  *hold = NULL;
  if (bad) *bad = NAME_OK;
  if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) return t->tp_name;
  /* each lookup may run a metaclass's code: an error it raised is cleared
     (an interrupt held) before the next runs, never left pending under it */
  Py_ssize_t mn = 0, qn = 0;
  PyObject *mod = PyObject_GetAttrString((PyObject *)t, "__module__");
  const char *m = mod && PyUnicode_Check(mod) ? PyUnicode_AsUTF8AndSize(mod, &mn) : NULL;
  dpy_clear_error();
  PyObject *qual = PyObject_GetAttrString((PyObject *)t, "__qualname__");
  const char *q = qual && PyUnicode_Check(qual) ? PyUnicode_AsUTF8AndSize(qual, &qn) : NULL;
  dpy_clear_error();
  if (bad) {
    if ((m && strlen(m) != (size_t)mn) || (q && strlen(q) != (size_t)qn)) *bad = NAME_NUL;
    else if (!q || (mod && mod != Py_None && !m)) *bad = NAME_NOT_TEXT;
  }
  const char *name = dotted(m, q ? q : t->tp_name, t->tp_name, hold);
  Py_XDECREF(mod);
  Py_XDECREF(qual);
  return name;
}

static const char *type_name(PyTypeObject *t, PyObject **hold) { return type_name_nul(t, hold, NULL); }

static int put_key_once(dpy_scanner_t *s, frame_t *f, char *out, size_t *n) {
  struct keystep *k = f->ks;
  if (!k && !(k = f->ks = PyMem_Calloc(1, sizeof *k))) return -1;
  if (k->key != f->label) {
    Py_CLEAR(k->key);
    k->n = put_key(s, f->label, k->text);
    k->key = Py_NewRef(f->label);
  }
  memcpy(out, k->text, k->n);
  *n = k->n;
  return 0;
}

/* What dp__path_render's steps need: the scanner, and whether a step
 * failed (out of memory). */
typedef struct path_ctx {
  dpy_scanner_t *s;
  int failed;
} path_ctx_t;

/* The step from frame i to its current child, into out[DP__STEP_BUF]: a
 * dp__step_fn. */
static size_t put_step(void *ctx, size_t i, char *out) {
  path_ctx_t *c = ctx;
  frame_t *f = &c->s->frames[i];
  size_t n = 0;
  switch (f->kind) {
  case FR_SEQ:
    if (f->names && f->idx < PyTuple_GET_SIZE(f->names)) return put_name(PyTuple_GET_ITEM(f->names, f->idx), out);
    /* fall through */
  case FR_SET:
    return dp__step_index((size_t)f->idx, out);
  case FR_ATTRS:
  case FR_DICT:
  case FR_PAIRS:
    if (f->key_part) return (size_t)snprintf(out, DP__STEP_BUF, "<key %zd>", f->idx);
    if (f->kind == FR_ATTRS && f->label && PyUnicode_Check(f->label)) return put_name(f->label, out);
    if (!f->label) return dp__step_index((size_t)f->idx, out);
    break;
  case FR_REDUCE: {
    static const char *const part[] = {".callable", ".args", ".state", ".listitems", ".dictitems", ".state_setter"};
    PyObject *hold;
    const char *tn = type_name(f->type, &hold);
    n = dp__step_reduce(tn, strlen(tn), out);
    Py_XDECREF(hold);
    if (f->idx >= 0 && f->idx < 6) {
      memcpy(out + n, part[f->idx], strlen(part[f->idx]));
      n += strlen(part[f->idx]);
    }
    return n;
  }
  default:
    return 0;
  }
  if (put_key_once(c->s, f, out, &n)) c->failed = 1;
  return n;
}

/* The path to the value being visited, bounded as ptrset.h says, appended
 * to out. */
int dpy_render_path(dpy_scanner_t *s, buf_t *out) {
  char path[DP_PATH_MAX + 1];
  path_ctx_t c = {s, 0};
  size_t n = dp__path_render(path, s->nframes, put_step, &c);
  return c.failed || dpy_buf_put(out, path, n) ? -1 : 0;
}

/* ---- errors ---- */

/* Raises WalkError naming type t and the current path, with the pending
 * exception as its cause. What is not an error of the value — an interrupt
 * (KeyboardInterrupt, SystemExit: not an Exception) or MemoryError — passes
 * through as it is, as it would through pickle. */
int dpy_walk_error_type(dpy_scanner_t *s, PyTypeObject *type, const char *what) {
  if (PyErr_Occurred() && (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)))
    return -1;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  PyErr_NormalizeException(&et, &ev, &tb);
  buf_t path = {0};
  if (s->error_path ? dpy_buf_put(&path, s->error_path, strlen(s->error_path)) : dpy_render_path(s, &path)) {
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    PyMem_Free(path.p);
    PyErr_NoMemory();
    return -1;
  }
  char shown[6 * 256 + 3 + 1];
  PyObject *hold;
  const char *tn = type_name(type, &hold);
  /* the name as the message quotes it: one line, escaped by the rule for
     names (only what a repr would escape: `<locals>` reads as it is) */
  size_t tlen = strlen(tn), k = dp__name_shown(tn, tlen, 256);
  dp__sbuf_t sb = {shown, 0, sizeof shown - 1, 0};
  dp__sb_escaped(&sb, tn, k, DP__ESC_CONTROLS, k < tlen);
  shown[sb.len] = '\0';
  PyObject *msg = NULL;
  if (ev) {
    /* the cause's text is the value's code (its exception's __str__), which
       may raise or return a non-str: the error is still a WalkError, with
       a placeholder, as a then() callback's failure is worded */
    PyObject *text = PyObject_Str(ev);
    if (!text) {
      if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) {
        Py_XDECREF(et); /* an interrupt raised by that code passes through, as any other */
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        Py_XDECREF(hold);
        PyMem_Free(path.p);
        return -1;
      }
      PyErr_Clear();
      text = PyUnicode_FromString("<exception str() failed>");
    }
    if (text) msg = PyUnicode_FromFormat("cannot walk a '%s' at %s: %s: %U", shown, path.p, what, text);
    Py_XDECREF(text);
  } else {
    msg = PyUnicode_FromFormat("cannot walk a '%s' at %s: %s", shown, path.p, what);
  }
  PyObject *exc = msg ? PyObject_CallOneArg(dpy.walk_error, msg) : NULL;
  Py_XDECREF(msg);
  if (exc) {
    PyObject *p = PyUnicode_FromString(path.p);
    PyObject *t = PyUnicode_FromString(tn);
    if (p && t) {
      PyObject_SetAttrString(exc, "path", p);
      PyObject_SetAttrString(exc, "type_name", t);
    }
    Py_XDECREF(p);
    Py_XDECREF(t);
    if (ev) PyException_SetCause(exc, Py_NewRef(ev));
    PyErr_SetObject(dpy.walk_error, exc);
    Py_DECREF(exc);
  }
  Py_XDECREF(et);
  Py_XDECREF(ev);
  Py_XDECREF(tb);
  Py_XDECREF(hold);
  PyMem_Free(path.p);
  return -1;
}

int dpy_walk_error(dpy_scanner_t *s, PyObject *obj, const char *what) {
  return dpy_walk_error_type(s, Py_TYPE(obj), what);
}

/* type_name for a frame's class (an object's, a tensor subclass's): a name
 * holding a NUL byte — a __module__ or __qualname__ set so — is refused, as
 * frames carry none in class names (docs/FORMAT.md), never cut to another
 * class's name. NULL with the WalkError set. */
const char *dpy_frame_class(dpy_scanner_t *s, PyObject *o, PyTypeObject *t, PyObject **hold) {
  int bad;
  const char *name = type_name_nul(t, hold, &bad);
  /* a class of one of the names frames reserve (its __module__ and
     __qualname__ make "builtins.set") would come back from loads as that
     kind, a silent change of type: refused, whatever its attributes */
  const char *kind = bad ? NULL : dpy_reserved_class(name);
  if (!bad && !kind) return name;
  if (kind)
    PyErr_Format(PyExc_TypeError,
                 "its class is named '%s', a name frames reserve for %s: loads would read it as %s (give the class "
                 "another __module__ or __qualname__)",
                 name, kind, kind);
  else if (bad == NAME_NUL)
    PyErr_SetString(PyExc_ValueError, "its class's __module__ or __qualname__ holds a NUL byte");
  else
    /* named by what stands in for them (tp_name, the qualname alone), it
       would come back from loads as the class of that name, listed */
    PyErr_SetString(PyExc_TypeError, "its class's __module__ or __qualname__ is no str of UTF-8 (a lone surrogate, "
                                     "a __module__ neither a str nor None): a frame would name it as another class");
  Py_CLEAR(*hold);
  dpy_walk_error(s, o, "its class cannot be named in a frame");
  return NULL;
}
