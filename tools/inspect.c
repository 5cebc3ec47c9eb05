/* tools/inspect.c — `devpickle inspect`'s tree printer (its own file so that
 * the fuzzers can drive it).
 *
 * Memory and time are linear in the nodes printed: a path is rendered from
 * the stack of steps as the line is printed, never stored; a node that can be
 * met again keeps a 32-byte record (its container, its index, its parent's
 * record) from which a later "-> PATH" is rendered; `seen` maps it to its
 * record (tools/ptrmap.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inspect.h"
#include "ptrmap.h"
#include "vjson.h"

#define INSPECT_DEPTH 64

#define STEP_MAX DP__STEP_MAX  /* an escaped, cut name and its brackets */
#define NO_REC UINT32_MAX

/* Where a node was first met: child `index` of `container`, below `parent`. */
typedef struct rec {
  dp_value_t container;  /* borrowed; none for the root */
  size_t index;
  uint32_t parent;
} rec_t;

typedef struct frame {
  dp_value_t v;
  size_t i, count;
  uint32_t rec;
} frame_t;

/* Rendered steps of one path: step k at text + k * STEP_MAX. */
typedef struct stepbuf {
  char text[(INSPECT_DEPTH + 2) * STEP_MAX];
  size_t len[INSPECT_DEPTH + 2];
} stepbuf_t;

typedef struct ins {
  FILE *out;
  rec_t *recs;
  size_t nrecs, reccap;
  ptrmap_t seen;         /* nodes met that can be met again: identity -> their record (uint32_t) */
  frame_t stack[INSPECT_DEPTH + 1];
  size_t top;
  stepbuf_t cur;   /* the stack's steps, each rendered when its frame moves on */
  char path[DP_PATH_MAX + 1];
} ins_t;

/* ---- steps and paths: rendered by the library's renderer (core/path.h) ---- */

static void set_step(stepbuf_t *b, size_t k, dp_value_t c, size_t i) {
  b->len[k] = dp__step_child(c, i, b->text + k * STEP_MAX);
}

/* Step i of the stack's path, rendered already: a dp__step_fn. */
static size_t cur_step(void *ctx, size_t i, char *buf) {
  const stepbuf_t *b = &((const ins_t *)ctx)->cur;
  memcpy(buf, b->text + i * STEP_MAX, b->len[i]);
  return b->len[i];
}

static const char *cur_path(ins_t *s) {
  dp__path_render(s->path, s->top, cur_step, s);
  return s->path;
}

/* A record's chain of records, itself first and the root's child last, for rec_step. */
typedef struct chain {
  const ins_t *s;
  uint32_t at[INSPECT_DEPTH + 2];
  size_t n;
} chain_t;

/* Step i of a record's path, rendered when the path can show it: a
 * dp__step_fn. Rendering every step of a 64-level chain of long escaped
 * names cost 25 kB of work for each "-> PATH" of 1 kB. */
static size_t rec_step(void *ctx, size_t i, char *buf) {
  const chain_t *c = ctx;
  const rec_t *r = &c->s->recs[c->at[c->n - 1 - i]];
  return dp__step_child(r->container, r->index, buf);
}

/* The path where record r was first met. */
static const char *rec_path(ins_t *s, uint32_t r) {
  chain_t c = {.s = s, .n = 0};
  for (uint32_t q = r; s->recs[q].parent != NO_REC; q = s->recs[q].parent) c.at[c.n++] = q;
  dp__path_render(s->path, c.n, rec_step, &c);
  return s->path;
}

/* ---- seen: node identity -> record ---- */

/* The record of the node with identity id, or NO_REC if it was not met. */
static uint32_t seen_find(const ins_t *s, const void *id) {
  size_t k = ptrmap_find(&s->seen, id);
  return k == SIZE_MAX ? NO_REC : *(uint32_t *)ptrmap_val(&s->seen, k);
}

static int seen_add(ins_t *s, const void *id, uint32_t rec) {
  size_t k = ptrmap_add(&s->seen, id, NULL);
  if (k == SIZE_MAX) return -1;
  *(uint32_t *)ptrmap_val(&s->seen, k) = rec;
  return 0;
}

static int rec_add(ins_t *s, dp_value_t container, size_t index, uint32_t parent, uint32_t *out) {
  if (s->nrecs == s->reccap) {
    size_t ncap = s->reccap ? s->reccap * 2 : 256;
    rec_t *p = ncap < NO_REC ? realloc(s->recs, ncap * sizeof *p) : NULL;
    if (!p) return -1;
    s->recs = p;
    s->reccap = ncap;
  }
  s->recs[s->nrecs] = (rec_t){container, index, parent};
  *out = (uint32_t)s->nrecs++;
  return 0;
}

/* ---- the tree ---- */

static size_t child_count(dp_value_t v) {
  switch (dp_value_kind(v)) {
    case DP_LIST:
    case DP_TUPLE: return dp_seq_len(v);
    case DP_DICT: return dp_dict_len(v);
    case DP_OBJECT: return dp_object_is_reduced(v) ? 1 : dp_object_nattrs(v);
    default: return 0;
  }
}

static dp_value_t child_at(dp_value_t v, size_t i) {
  dp_value_t c = dp_none();
  switch (dp_value_kind(v)) {
    case DP_LIST:
    case DP_TUPLE: return dp_seq_get(v, i);
    case DP_DICT: dp_dict_item(v, i, NULL, &c, NULL); return c;
    case DP_OBJECT:
      if (dp_object_is_reduced(v)) dp_object_get(v, "__reduce__", &c, NULL);
      else dp_object_attr(v, i, NULL, &c, NULL);
      return c;
    default: return c;
  }
}

/* Whether strides are the shape's row-major default (value JSON's, which
 * unpack writes and pack assumes when "strides" is left out): the last 1,
 * each other the next times the next dimension (a 0 dimension counted as 1). */
static int contiguous(int nd, const int64_t *shape, const int64_t *strides) {
  int64_t s = 1;
  for (int d = nd - 1; d >= 0; d--) {
    if (strides[d] != s) return 0;
    int64_t dim = shape[d] > 0 ? shape[d] : 1;
    if (d > 0 && s > INT64_MAX / dim) return 0;
    s *= dim;
  }
  return 1;
}

static void summary(FILE *out, dp_value_t v) {
  char dev[16];
  size_t n;
  switch (dp_value_kind(v)) {
    case DP_NONE: fprintf(out, "none\n"); return;
    case DP_BOOL: fprintf(out, "bool %s\n", dp_value_as_bool(v) ? "true" : "false"); return;
    case DP_INT: fprintf(out, "int %" PRId64 "\n", dp_value_as_int(v)); return;
    case DP_FLOAT: { /* as value JSON writes it: distinct floats (NaN payloads, -0.0) read apart */
      char b[40];
      vjson_float_text(dp_value_as_float(v), b, sizeof b);
      fprintf(out, "float %s\n", b);
      return;
    }
    case DP_STR: {
      const char *s = dp_str_data(v, &n);
      /* its first 40 bytes, escaped as a path's names are: one line */
      char text[2 + 6 * 40 + 3];
      dp__sbuf_t b = {text, 0, sizeof text, 0};
      size_t k = dp__name_shown(s, n, 40);
      dp__sb_quote(&b, s, k, k < n);
      fprintf(out, "str (%zu byte%s) %.*s\n", n, n == 1 ? "" : "s", (int)b.len, text);
      return;
    }
    case DP_BYTES: dp_bytes_data(v, &n); fprintf(out, "bytes (%zu)\n", n); return;
    case DP_TENSOR: {
      dp_storage_t *st = dp_tensor_storage(v);
      fprintf(out, "tensor %s[", dp_dtype_name(dp_tensor_dtype(v)));
      int nd = dp_tensor_ndim(v);
      const int64_t *shape = dp_tensor_shape(v), *strides = dp_tensor_strides(v);
      for (int d = 0; d < nd; d++) fprintf(out, "%s%" PRId64, d ? ", " : "", shape[d]);
      fputc(']', out);
      if (!contiguous(nd, shape, strides)) { /* a transpose or a slice: not the shape's default view */
        for (int d = 0; d < nd; d++) fprintf(out, "%s%" PRId64, d ? ", " : " strides [", strides[d]);
        fputc(']', out);
      }
      n = dp_storage_nbytes(st);
      fprintf(out, " %s 0x%" PRIxPTR " (%zu byte%s) offset %" PRId64 "\n",
              dp_device_format(dp_storage_device(st), dev, sizeof dev), (uintptr_t)dp_storage_base(st), n,
              n == 1 ? "" : "s", dp_tensor_offset(v));
      return;
    }
    case DP_OBJECT: {
      const char *cls = dp_object_class(v);
      char name[DP__STEP_MAX];
      size_t k = dp__name_bare(cls, strnlen(cls, DP_PATH_NAME_MAX + 1), name), count = dp_object_nattrs(v);
      if (dp_object_is_reduced(v)) /* its one child is its state, shown on the next line as <reduce T> */
        fprintf(out, "reduced %.*s\n", (int)k, name);
      else
        fprintf(out, "object %.*s (%zu attribute%s)\n", (int)k, name, count, count == 1 ? "" : "s");
      return;
    }
    default: {
      size_t count = child_count(v);
      fprintf(out, "%s (%zu item%s)\n", dp_kind_name(dp_value_kind(v)), count, count == 1 ? "" : "s");
      return;
    }
  }
}

/* The record of stack frame k, made when first needed: only nodes that can
 * be met again (more than one reference) and their ancestors get one, so a
 * tree costs no record at all. */
static int frame_rec(ins_t *s, size_t k, uint32_t *out) {
  if (s->stack[k].rec == NO_REC) {
    uint32_t parent = NO_REC;
    if (k > 0 && frame_rec(s, k - 1, &parent)) return -1;
    frame_t *up = k > 0 ? &s->stack[k - 1] : NULL;
    if (rec_add(s, up ? up->v : dp_none(), up ? up->i - 1 : 0, parent, &s->stack[k].rec)) return -1;
  }
  *out = s->stack[k].rec;
  return 0;
}

/* The path column: 40 characters wide, counted as UTF-8 characters (not
 * bytes), so that a path with "é" or "…" lines up with the others. */
static void put_path(FILE *out, const char *path) {
  size_t cols = 0;
  for (const unsigned char *q = (const unsigned char *)path; *q; q++) cols += (*q & 0xC0) != 0x80;
  fputs(path, out);
  for (; cols < 40; cols++) fputc(' ', out);
  fputs("  ", out);
}

/* Prints one node's line; pushes a container whose children are to be shown. */
static int visit(ins_t *s, dp_value_t v) {
  put_path(s->out, cur_path(s));
  uint32_t r = NO_REC;
  size_t count = child_count(v);
  /* A container on the last level shown has its children cut: its line
   * shows no more of it than a node below that level, so a later meeting
   * shows it again (in full when it is shallower) rather than pointing back
   * to a line that never showed its children. */
  int cut = count && s->top >= INSPECT_DEPTH;
  /* A node held once is met once (the caller's reference aside, which only
   * adds): it needs no entry in `seen`. */
  if (dp_value_is_heap(v) && dp_value_refcount(v) > 1) {
    const void *id = dp_value_id(v);
    uint32_t met = seen_find(s, id);
    if (met != NO_REC) {
      fprintf(s->out, "-> %s\n", rec_path(s, met));
      return 0;
    }
    uint32_t parent = NO_REC;
    frame_t *up = s->top ? &s->stack[s->top - 1] : NULL;
    if (!cut && ((s->top && frame_rec(s, s->top - 1, &parent)) ||
                 rec_add(s, up ? up->v : dp_none(), up ? up->i - 1 : 0, parent, &r) || seen_add(s, id, r)))
      return -1;
  }
  summary(s->out, v);
  if (!count) return 0;
  if (cut) {
    fprintf(s->out, "%-40s  (deeper levels not shown)\n", "");
    return 0;
  }
  s->stack[s->top++] = (frame_t){v, 0, count, r};
  return 0;
}

int inspect_print(FILE *out, dp_value_t v) {
  ins_t *s = calloc(1, sizeof *s);
  if (!s) return -1;
  s->out = out;
  ptrmap_init(&s->seen, sizeof(uint32_t));
  int rc = visit(s, v);
  while (rc == 0 && s->top && !ferror(out)) {
    frame_t *f = &s->stack[s->top - 1];
    if (f->i == f->count) {
      s->top--;
      continue;
    }
    set_step(&s->cur, s->top - 1, f->v, f->i);
    dp_value_t child = child_at(f->v, f->i++);
    rc = visit(s, child);
  }
  free(s->recs);
  ptrmap_free(&s->seen);
  free(s);
  return rc;
}
