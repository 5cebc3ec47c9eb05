/* pickler/walk.c — the walker: iterative, memoized, with lazy paths.
 *
 * Memo. Every heap node gets a preorder number, and a node met again is a
 * back-reference to it. Recording every node would make trees pay a hash
 * insert per node, so a walk starts by recording only nodes whose reference
 * count exceeds one (the root, node 0, is known without an entry), and
 * records every node from its first reduce() on.
 * Why that is sound, and why the bytes stay the same whatever references
 * the caller holds: see memo_everything() below.
 *
 * Paths are rendered from the stack only when asked for or on error, and
 * are bounded (ptrset.h). */
#include <stdio.h>
#include <string.h>

#include "walk.h"

void dp__walker_init(dp__walker_t *w) {
  memset(w, 0, sizeof *w);
  dp__table_init(&w->memo);
  w->memo_rc = 1;
}

void dp__walker_setup(dp__walker_t *w, dp_ptrset_t *set, const dp__sink_t *sink, void *sink_ctx,
                      uint32_t max_depth, int want_paths, dp_error_t *err) {
  w->set = set;
  w->sink = sink;
  w->sink_ctx = sink_ctx;
  w->err = err;
  w->want_paths = want_paths;
  w->batch = !sink && !want_paths;  /* a pickle's sink needs each buffer id at once */
  w->max_depth = max_depth ? max_depth : DP_DEFAULT_MAX_DEPTH;
}

void dp__walker_release_states(dp__walker_t *w) {
  for (size_t i = 0; i < w->nstates; i++) dp_value_release(w->states[i]);
  w->nstates = 0;
}

void dp__walker_destroy(dp__walker_t *w) {
  dp__walker_release_states(w);
  dp__free(w->stack, w->stack_cap * sizeof(dp__wframe_t));
  dp__table_destroy(&w->memo, DP_TABLE_TAGGED);
  dp__free(w->memo_items, w->memo_items_cap * sizeof(dp__memo_item_t));
  dp__free(w->states, w->states_cap * sizeof(dp_value_t));
  dp__free(w->rstack, w->rstack_cap * sizeof(dp__wframe_t));
  memset(w, 0, sizeof *w);
}

/* ---- memo: node -> preorder index, cleared by bumping a generation ---- */

/* Keyed (table.h): node addresses follow the allocator, which the input
 * steers. */
static inline __attribute__((always_inline)) int memo_eq(const void *ctx, size_t i, const void *key) {
  return ((const dp__walker_t *)ctx)->memo_items[i].key == key;
}

static uint64_t memo_hash_at(const void *ctx, size_t i) {
  return dp__hash_ptr(((const dp__walker_t *)ctx)->memo_items[i].key);
}

/* Room for one more item, in the table and in the items. */
/* DP_ENOMEM, or the table's DP_ELIMIT (2^32 - 2 nodes), passed through. */
static int memo_grow(dp__walker_t *w) {
  size_t n = w->memo.count;
  if (n == w->memo_items_cap &&
      dp__grow((void **)&w->memo_items, &w->memo_items_cap, n + 1, sizeof(dp__memo_item_t)) != 0)
    return DP_ENOMEM;
  if (dp__table_full(&w->memo)) return dp__table_grow(&w->memo, DP_TABLE_TAGGED, n, 256, memo_hash_at, w);
  return 0;
}

/* Records key (hash h, not found: probing stopped at slot j). */
static __attribute__((noinline)) int memo_insert(dp__walker_t *w, const void *key, uint64_t h, size_t j,
                                                 uint64_t index) {
  size_t n = w->memo.count;
  if (DP_UNLIKELY(j == SIZE_MAX || n == w->memo_items_cap || dp__table_full(&w->memo))) {
    int rc = memo_grow(w);
    if (rc) return rc;
    j = dp__table_empty_slot(&w->memo, DP_TABLE_TAGGED, h);
  }
  w->memo_items[n] = (dp__memo_item_t){key, index};
  dp__table_put(&w->memo, DP_TABLE_TAGGED, j, h, n);
  return 0;
}

/* Returns 1 and *index when key was seen; else records it (0), or a
 * negative code (DP_ENOMEM, DP_ELIMIT: memo_failed says which).
 * The lookup is inlined where the walk asks; recording is not. */
static inline __attribute__((always_inline)) int memo_check(dp__walker_t *w, const void *key, uint64_t index,
                                                            uint64_t *seen) {
  uint64_t h = dp__hash_ptr(key);
  size_t j, at = dp__table_find(&w->memo, DP_TABLE_TAGGED, h, memo_eq, w, key, &j);
  if (at != DP_TABLE_NONE) {
    *seen = w->memo_items[at].index;
    return 1;
  }
  return memo_insert(w, key, h, j, index);
}

/* A failure of the walk's own means (its memory, its memo's bound) at the
 * node being visited: the message names the path, as every other failure
 * of a walk does (pickler.h), so that an embedder sees where a value too
 * large to walk grew too large. */
static int walk_fail(dp__walker_t *w, int code, const char *what) {
  return dp__err(w->err, code, "%s at %s", what, dp__walker_path(w));
}

/* A failure passed through from below the walker (the pointer set's, the
 * sink's), which knows nothing of the path: its code, backend code and
 * message kept, " at <path>" added. */
static int walk_failed_at(dp__walker_t *w, int rc) {
  if (!w->err || rc >= 0) return rc;
  char at[DP_PATH_MAX + 8];
  snprintf(at, sizeof at, " at %s", dp__walker_path(w));
  return dp__err_suffix(w->err, rc, at);
}

/* A failed memo_check: its code, kept. A scan's batch (flush_pending) looks
 * tensors up away from where they were met, and says no path. */
static int memo_failed(dp__walker_t *w, int rc, int where) {
  char what[64];
  if (rc == DP_ELIMIT)
    snprintf(what, sizeof what, "a walk memoizes at most %u nodes", UINT32_MAX - 2);
  else
    snprintf(what, sizeof what, "out of memory growing the walk memo");
  return where ? walk_fail(w, rc, what) : dp__err(w->err, rc, "%s", what);
}

static void memo_reset(dp__walker_t *w) { dp__table_clear(&w->memo, DP_TABLE_TAGGED); }

/* ---- paths: bounded, as ptrset.h states; rendered by core/path.h ---- */

/* bytes as base64 (RFC 4648, padded), as unpack writes them; stops once b
 * is full (a path shows at most DP_PATH_NAME_MAX bytes of a key). */
static void pb_base64(dp__sbuf_t *b, const uint8_t *p, size_t n) {
  static const char d[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (size_t i = 0; i < n && !b->full; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
    char o[4] = {d[v >> 18], d[v >> 12 & 63], i + 1 < n ? d[v >> 6 & 63] : '=', i + 2 < n ? d[v & 63] : '='};
    dp__sb_put(b, o, 4);
  }
}

/* A dict key as its value JSON (docs/VALUE_JSON.md, compact, as unpack
 * writes it: a float always with a fraction or exponent, inf and NaNs as
 * {"$float":...}), for `[<json>]` path steps; stops once b is full. */
static void pb_key_json(dp__sbuf_t *b, dp_value_t k, int depth) {
  char tmp[48];
  switch (k.kind) {
    case DP_NONE: dp__sb_put(b, "null", 4); break;
    case DP_BOOL: k.u.i ? dp__sb_put(b, "true", 4) : dp__sb_put(b, "false", 5); break;
    case DP_INT: dp__sb_put(b, tmp, (size_t)snprintf(tmp, sizeof tmp, "%lld", (long long)k.u.i)); break;
    case DP_FLOAT: {
      uint64_t bits;
      memcpy(&bits, &k.u.f, sizeof bits);
      size_t n;
      if ((bits >> 52 & 0x7ff) != 0x7ff) {  /* finite */
        n = (size_t)snprintf(tmp, sizeof tmp, "%.17g", k.u.f);
        if (!strpbrk(tmp, ".e")) n += (size_t)snprintf(tmp + n, sizeof tmp - n, ".0");
      } else if (bits << 12 == 0) {  /* an infinity */
        n = (size_t)snprintf(tmp, sizeof tmp, "{\"$float\":\"%s\"}", bits >> 63 ? "-inf" : "inf");
      } else if (bits == 0x7ff8000000000000ull) {  /* the default quiet NaN */
        n = (size_t)snprintf(tmp, sizeof tmp, "{\"$float\":\"nan\"}");
      } else {  /* any other NaN by its bits */
        n = (size_t)snprintf(tmp, sizeof tmp, "{\"$float\":\"0x%016llx\"}", (unsigned long long)bits);
      }
      dp__sb_put(b, tmp, n);
      break;
    }
    case DP_STR: dp__sb_quote(b, DP_STROBJ(k)->data, DP_STROBJ(k)->len, 0); break;
    case DP_BYTES:
      dp__sb_put(b, "{\"$bytes\":\"", 11);
      pb_base64(b, (const uint8_t *)DP_STROBJ(k)->data, DP_STROBJ(k)->len);
      dp__sb_put(b, "\"}", 2);
      break;
    case DP_TUPLE: {
      dp__sb_put(b, "{\"$tuple\":[", 11);
      for (size_t i = 0; i < DP_SEQ(k)->len && depth < 8 && !b->full; i++) {
        if (i) dp__sb_put(b, ",", 1);
        pb_key_json(b, DP_SEQ(k)->items[i], depth + 1);
      }
      dp__sb_put(b, "]}", 2);
      break;
    }
    default: dp__sb_put(b, "?", 1); break;
  }
}

/* The length of a custom's type name as far as a path or a message shows
 * it: one byte past DP_PATH_NAME_MAX says it is cut. A path is rendered for
 * each storage a scan with paths records, and costs time bounded by its
 * length (ptrset.h), not by the names' lengths: strlen would read the whole
 * name at each. */
static size_t type_name_shown_len(const char *name) { return strnlen(name, DP_PATH_NAME_MAX + 1); }

/* A custom type's name as a message shows it: cut and escaped as in a
 * path's <reduce T> step, so a message is one line. */
static const char *shown_name(const char *name, char out[DP__STEP_MAX]) {
  out[dp__name_bare(name, type_name_shown_len(name), out)] = 0;
  return out;
}

/* Where the first n bytes of a key's JSON text end, moved back to the
 * start of an escape they would split: `"a\u00…` or `"a\…` would read as
 * an escape of the ellipsis or of nothing. A `\` there only ever starts an
 * escape (a str's own is written `\\`): \uXXXX is 6 bytes, the others 2. */
static size_t whole_escapes(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (s[i] != '\\') continue;
    size_t len = i + 1 < n && s[i + 1] == 'u' ? 6 : 2;
    if (i + len > n) return i;
    i += len - 1;
  }
  return n;
}

size_t dp__key_text(dp_value_t key, char *out) {
  /* rendered in place up to one byte past the limit, to see whether it is cut */
  dp__sbuf_t kb = {out, 0, DP_PATH_NAME_MAX + 1, 0};
  pb_key_json(&kb, key, 0);
  if (!kb.full && kb.len <= DP_PATH_NAME_MAX) return kb.len;
  size_t k = whole_escapes(kb.s, dp__name_shown(kb.s, kb.len, DP_PATH_NAME_MAX));
  dp__sbuf_t b = {out, k, DP__STEP_MAX, 0};
  dp__sb_put(&b, DP__ELLIPSIS, 3);
  return b.len;
}

size_t dp__step_key(dp_value_t key, char *out) {
  if (key.kind == DP_STR) return dp__step_name(DP_STROBJ(key)->data, DP_STROBJ(key)->len, out);
  out[0] = '[';
  size_t n = 1 + dp__key_text(key, out + 1);
  out[n] = ']';
  return n + 1;
}

size_t dp__step_child(dp_value_t c, size_t i, char *out) {
  switch (dp_value_kind(c)) {
    case DP_LIST:
    case DP_TUPLE: return dp__step_index(i, out);
    case DP_DICT: {
      dp_value_t k;
      dp_dict_item(c, i, &k, NULL, NULL);
      return dp__step_key(k, out);
    }
    case DP_OBJECT:
      if (dp_object_is_reduced(c)) {
        const char *cls = dp_object_class(c);
        return dp__step_reduce(cls, strnlen(cls, DP_PATH_NAME_MAX + 1), out);
      } else {
        const char *name;
        dp_object_attr(c, i, &name, NULL, NULL);
        return dp__step_name(name, strnlen(name, DP_PATH_NAME_MAX + 1), out);
      }
    default: return 0;
  }
}

/* The step of frame d of the walker (the child being visited) into
 * out[DP__STEP_MAX]; returns its length. A dp__step_fn. */
static size_t render_step(void *ctx, size_t d, char *out) {
  const dp__wframe_t *f = &((dp__walker_t *)ctx)->stack[d];
  size_t i = f->i - 1;
  dp_value_t node = f->node;
  switch (node.kind) {
    case DP_LIST:
    case DP_TUPLE:
      return dp__step_index(i, out);
    case DP_DICT:
      if (!(i & 1))  /* inside a key itself */
        return dp__step_in_key(i / 2, out);
      return dp__step_key(DP_DICT(node)->entries[i / 2].key, out);
    case DP_OBJECT:
      if (DP_OBJ(node)->c.h.flags & DP_HEAP_REDUCED)
        return dp__step_reduce(DP_OBJ(node)->class_name, DP_OBJ(node)->class_len, out);
      dp_attr_t *a = &DP_OBJ(node)->attrs[i];
      return dp__step_name(dp__attr_name(a), a->name_len, out);
    case DP_CUSTOM:
      return dp__step_reduce(DP_CUSTOM(node)->type->name, type_name_shown_len(DP_CUSTOM(node)->type->name), out);
  }
  return 0;
}

const char *dp__walker_path(dp__walker_t *w) {
  dp__path_render(w->path, w->top, render_step, w);
  return w->path;
}

/* ---- the walk ---- */

/* How many list items ahead a scan prefetches. */
#define DP_PREFETCH_AHEAD 8

static int push(dp__walker_t *w, dp_value_t node, dp_value_t state, size_t n) {
  if (w->top >= w->max_depth)
    return dp__err(w->err, DP_ELIMIT, "nesting deeper than %u level%s at %s", w->max_depth,
                   w->max_depth == 1 ? "" : "s", dp__walker_path(w));
  if (w->top == w->stack_cap &&
      dp__grow((void **)&w->stack, &w->stack_cap, w->top + 1, sizeof(dp__wframe_t)) != 0)
    return walk_fail(w, DP_ENOMEM, "out of memory growing the walk stack");
  dp__wframe_t *f = &w->stack[w->top++];
  f->node = node;
  f->state = state;
  f->i = 0;
  f->n = n;
  return 0;
}

static int flush_pending(dp__walker_t *w);

/* The child i of a node being replayed (never a custom: see below). */
static dp_value_t replay_child(dp_value_t node, size_t i) {
  switch (node.kind) {
    case DP_LIST:
    case DP_TUPLE: return DP_SEQ(node)->items[i];
    case DP_DICT: {
      dp_entry_t *e = &DP_DICT(node)->entries[i >> 1];
      return (i & 1) ? e->val : e->key;
    }
    default:
      return (DP_OBJ(node)->c.h.flags & DP_HEAP_REDUCED) ? dp__reduced_state(node) : DP_OBJ(node)->attrs[i].val;
  }
}

/* Called just before the walk's first reduce(), on the custom `stop` about
 * to be reduced: from here on every heap node is recorded in the memo.
 *
 * Why recording only nodes with a count above one is sound until now: a
 * node the walk meets twice is reached through two distinct edges (the walk
 * enters only first meetings, so it crosses each edge at most once), and
 * every edge holds a reference. Before the first reduce() nothing but the
 * value holds references for the walk, so such a node's count is at least
 * two the first time it is met — but for the root, which the walk enters
 * through no edge (the caller's handle may be borrowed): visit() knows it
 * by its address (node 0) whatever its count. reduce() breaks this: its state may hold a
 * node met before with a count of one (an ancestor, a tensor), which then
 * has a second way in that the memo does not know.
 *
 * So before the first reduce() the memo is rebuilt as if every node had
 * been recorded: the walk is replayed from the root — the value has not
 * changed, so the replay meets the same nodes in the same order and stops
 * at `stop`, where the walk is — recording each heap node met with its
 * preorder number. Nodes met before were then first met exactly where the
 * walk met them first, and their numbers are the walk's. From here on every
 * node is recorded whatever its count, so a node met again through a state
 * is a back-reference, and reduce() runs once per custom.
 *
 * The walk is thus the same as one that records every node from the start,
 * which never looks at a reference count: the bytes do not depend on the
 * references the caller holds. Values without customs never replay and
 * never hash a node held once. A scan's tensors waiting in
 * the batch are looked into first, under the old rule, since the replay
 * records them.
 * Scan never numbers str and bytes (it skips them), pickle does. */
static int memo_everything(dp__walker_t *w, const void *stop, const int S) {
  int rc;
  if (w->npending && (rc = flush_pending(w)) != 0) return rc;
  memo_reset(w);
  w->memo_rc = 0;
  size_t top = 0;
  uint64_t index = 0;
  int found = 0;
  dp_value_t v = w->root;
  for (;;) {
    uint32_t k = v.kind;
    if (k >= DP_LIST || (S && k >= DP_STR)) {
      uint64_t seen = 0;
      int m = memo_check(w, v.u.h, index, &seen);
      if (m < 0) return memo_failed(w, m, 1);
      if (m == 0) {
        index++;
        if (v.u.h == stop) {
          found = 1;
          break;
        }
        /* Before the first reduce() the walk met no custom but `stop`. */
        size_t n = 0;
        if (k == DP_LIST || k == DP_TUPLE)
          n = DP_SEQ(v)->len;
        else if (k == DP_DICT)
          n = 2 * DP_DICT(v)->len;
        else if (k == DP_OBJECT)
          n = (DP_OBJ(v)->c.h.flags & DP_HEAP_REDUCED) ? 1 : DP_OBJ(v)->len;
        if (n) {
          if (top == w->rstack_cap &&
              dp__grow((void **)&w->rstack, &w->rstack_cap, top + 1, sizeof(dp__wframe_t)) != 0)
            return walk_fail(w, DP_ENOMEM, "out of memory growing the walk stack");
          w->rstack[top++] = (dp__wframe_t){v, dp_none(), 0, n};
        }
      }
    }
    while (top && w->rstack[top - 1].i == w->rstack[top - 1].n) top--;
    if (!top) break;  /* `stop` not met: the value changed */
    dp__wframe_t *f = &w->rstack[top - 1];
    v = replay_child(f->node, f->i++);
  }
  /* Pickle numbered `stop` already: the replay must agree. */
  if (!found || (S && index != w->next_index))
    return dp__err(w->err, DP_ESTATE, "the value changed while it was walked, at %s", dp__walker_path(w));
  w->next_index = index;
  return 0;
}

/* A reduce() that failed with rc, its error in *inner. Out of memory stays
 * out of memory; any other failure means the value cannot be walked. Its
 * message is cut to the room the path leaves (the path and the type take at
 * most 1,450 of the 2,048 bytes), so that the path stays whole. Not inlined:
 * its buffers stay off the stack of walks nested in reduce(). */
static __attribute__((noinline)) int reduce_failed(dp__walker_t *w, const dp_type_t *t, int rc,
                                                   const dp_error_t *inner) {
  char name[DP__STEP_MAX], head[DP_ERROR_MSG_MAX], cause[DP_ERROR_MSG_MAX];
  int len = snprintf(head, sizeof head, "reduce of type '%s' failed at %s: ", shown_name(t->name, name),
                     dp__walker_path(w));
  dp__fit(cause, sizeof cause - (size_t)len, inner->message[0] ? inner->message : dp_strerror(rc));
  int code = dp__err(w->err, rc == DP_ENOMEM ? DP_ENOMEM : DP_ETYPE, "%s%s", head, cause);
  if (w->err) w->err->backend_code = inner->backend_code; /* passed through, as any callback's (base.h) */
  return code;
}

static int reduce_custom(dp__walker_t *w, dp_value_t v, dp_value_t *state, const int S) {
  const dp_type_t *t = DP_CUSTOM(v)->type;
  char name[DP__STEP_MAX];
  if (!t->reduce)
    return dp__err(w->err, DP_ETYPE, "cannot walk a value of type '%s' at %s: its type has no reduce",
                   shown_name(t->name, name), dp__walker_path(w));
  int rc;
  if (w->memo_rc && (rc = memo_everything(w, v.u.h, S)) != 0) return rc;
  if (w->nstates == w->states_cap &&
      dp__grow((void **)&w->states, &w->states_cap, w->nstates + 1, sizeof(dp_value_t)) != 0)
    return walk_fail(w, DP_ENOMEM, "out of memory holding reduce states");
  dp_error_t inner;
  dp_error_clear(&inner);
  *state = dp_none();
  rc = t->reduce(DP_CUSTOM(v)->obj, state, &inner);
  /* a positive code is no success, and a negative one of no DP_E* code is
     none (base.h): either fails, and the message says what reduce returned
     ("unknown error" would not); a message written without its NUL is ended
     before it is quoted */
  if (rc > 0 || (rc < 0 && (inner.message[0] || !dp__is_code(rc)))) rc = dp__cb_rc(rc, &inner, "reduce");
  if (rc != 0) {
    dp_value_release(*state);
    return reduce_failed(w, t, rc, &inner);
  }
  w->states[w->nstates++] = *state;
  return 0;
}

/* Resolves the pending tensors in three passes over the batch — tensor
 * (memo for shared ones), hash (prefetch the slot), insert — each pass
 * issuing its cache misses together. A tensor carries its storage's base,
 * size and device: the storage itself is never read. Inserts keep
 * discovery order. */
/* A pointer-set failure comes back with its code and message (written by
 * the set): the walker passes it through. */

static int flush_pending(dp__walker_t *w) {
  dp_tensor_t *st[DP_WALK_BATCH + DP_INLINE_MAX];
  uint64_t h[DP_WALK_BATCH + DP_INLINE_MAX];
  int n = 0, m = w->npending, rc;
  w->npending = 0;
  /* A tensor on the memory of the one before it (a view after its base
   * tensor: the same base and device) is marked in `again`: the same entry,
   * no probe. */
  uint64_t again = 0;
  _Static_assert(DP_WALK_BATCH + DP_INLINE_MAX <= 64, "a batch fits a 64-bit mask");
  const void *prev_base = NULL;
  uint32_t prev_dev = 0x10000u; /* no device's bits */
  for (int i = 0; i < m; i++) {
    dp_tensor_t *t = w->pending[i];
    if (dp__rc(&t->h) > w->memo_rc) {
      uint64_t seen = 0;
      int r = memo_check(w, t, w->next_index++, &seen);
      if (r < 0) return memo_failed(w, r, 0);
      if (r == 1) continue;  /* the same tensor again: counted once */
    }
    again |= (uint64_t)(t->sbase == prev_base && dp__dev_bits(t->sdevice) == prev_dev) << n;
    st[n++] = t;
    prev_base = t->sbase;
    prev_dev = dp__dev_bits(t->sdevice);
  }
  if (!n) return 0;
  dp_ptrset_t *s = w->set;
  /* Room for the whole batch at once, so that inserts check nothing but the
   * device; if it cannot be had, each insert grows what it needs (and what
   * was met before running out still lands in the set). Room for the
   * storages that can be new, not for every tensor: a set sized for its
   * value (ptrs.c) is then never grown by a tensor and its view. */
  int reserved = dp__ptrset_reserve(s, (size_t)(n - __builtin_popcountll(again))) == 0;
  /* One key per device, derived again only when the device changes. */
  dp_device_t kdev = st[0]->sdevice;
  uint64_t key = dp__ptr_key(kdev);
  const dp__tslot_t *slots = s->tab.slots;
  size_t mask = s->tab.nslots - 1;
  for (int i = 0; i < n && !s->raw; i++) {
    if (again >> i & 1) continue;
    if (DP_UNLIKELY(dp__dev_bits(st[i]->sdevice) != dp__dev_bits(kdev))) key = dp__ptr_key(kdev = st[i]->sdevice);
    h[i] = dp__ptr_hash_keyed(st[i]->sbase, key);
    if (reserved) __builtin_prefetch(slots + (h[i] & mask), 1);
  }
  if (reserved) {
    return dp__ptrset_add_batch(s, st, h, again, n, w->err);
  }
  size_t id = 0;
  for (int i = 0; i < n; i++) {
    if (again >> i & 1) { /* as add_run counts it: one more tensor, the larger size kept */
      dp__pentry_again(&s->rest[id], st[i]->snbytes);
      continue;
    }
    int is_new;
    if ((rc = dp__ptrset_add_hashed(s, st[i]->sdevice, st[i]->sbase, st[i]->snbytes, s->raw ? 0 : h[i], &id, &is_new, w->err)) != 0)
      return rc;
  }
  return 0;
}

#define DP_WALK_INLINE static inline __attribute__((always_inline))

/* A scan's tensor waits in the batch, looked into later (flush_pending). */
DP_WALK_INLINE void pend(dp__walker_t *w, dp_heap_t *h) {
  __builtin_prefetch(h);
  w->pending[w->npending++] = (dp_tensor_t *)h;
}

DP_WALK_INLINE int stage_tensor(dp__walker_t *w, dp_heap_t *h) {
  pend(w, h);
  return w->npending >= DP_WALK_BATCH ? flush_pending(w) : 0;
}

/* Scan only: stages the tensors of v — a list, tuple or object held once —
 * in place, without a frame, if its items are leaves (scalars, str, bytes,
 * tensors) or, with room for one more level, lists and tuples held once
 * that hold only leaves; DP_INLINE_MAX items in all. Returns 1 if it did;
 * 0 (nothing staged: what was staged is taken back) if v needs a frame.
 * `room`: how many levels of non-empty containers the depth limit still
 * allows below the frame being scanned; each container staged in place
 * would have been a frame, and the limit counts them the same. The batch
 * has room for DP_INLINE_MAX tensors past DP_WALK_BATCH: nothing is looked
 * into before v is known to need no frame. */
DP_WALK_INLINE int try_stage(dp__walker_t *w, dp_value_t v, uint32_t room) {
  int mark = w->npending;
  if (v.kind == DP_OBJECT) {
    const dp_object_t *o = DP_OBJ(v);
    if ((o->c.h.flags & DP_HEAP_REDUCED) || o->len > DP_INLINE_MAX || (o->len && room < 1)) return 0;
    for (size_t j = 0; j < o->len; j++) {
      uint32_t k = o->attrs[j].val.kind;
      if (k < DP_LIST) continue;
      if (k != DP_TENSOR) goto undo;
      pend(w, o->attrs[j].val.u.h);
    }
    return 1;
  }
  const dp_seq_t *s = DP_SEQ(v);
  size_t budget = DP_INLINE_MAX;
  if (s->len > budget || (s->len && room < 1)) return 0;
  budget -= s->len;
  for (size_t j = 0; j < s->len; j++) {
    dp_value_t x = s->items[j];
    if (x.kind < DP_LIST) continue;
    if (x.kind == DP_TENSOR) {
      pend(w, x.u.h);
      continue;
    }
    if ((x.kind != DP_LIST && x.kind != DP_TUPLE) || dp__rc(x.u.h) != 1) goto undo;
    const dp_seq_t *c = DP_SEQ(x);
    if (!c->len) continue;
    if (room < 2 || c->len > budget) goto undo;
    budget -= c->len;
    for (size_t i = 0; i < c->len; i++) {
      uint32_t k = c->items[i].kind;
      if (k < DP_LIST) continue;
      if (k != DP_TENSOR) goto undo;
      pend(w, c->items[i].u.h);
    }
  }
  return 1;
undo:
  w->npending = mark;
  return 0;
}

/* Scan only, over a long run of items (DP_SCAN_FAR_MIN or more, a value
 * larger than the caches): fetches the node DP_SCAN_FAR_AHEAD places ahead
 * (every line a scan reads of it: prefetch_node), and for the one
 * DP_SCAN_NEAR_AHEAD ahead, fetched by then, what it points to
 * (prefetch_children). Without it each (tensor, [view]) of a list of
 * 100,000 costs its misses one after another (completion 6.2-7.6 ms →
 * 4.3-4.7 ms on the 2-core VM; a list of tensors 2.7 → 2.55 ms). Fetching
 * a node's last line too, not only its first two (a node on 16 bytes may
 * start anywhere in its first line, and a tuple's items end 104 bytes in),
 * and a user object whole, up to its first attribute's value: 100,000
 * (tensor, [view]) 52-58 → 31-43 ns a tensor, 100,000 objects 28-32 →
 * 23-27, on the VM loaded by other work; at 10,000, in its caches, the
 * extra instructions cost 3-12 %. A short run is in cache and is left
 * alone (the instructions would only cost there). */
#define DP_SCAN_FAR_MIN 2048
#define DP_SCAN_FAR_AHEAD 16
#define DP_SCAN_NEAR_AHEAD 8

/* Fetches the lines of [p, p + end): `end` is a constant, so the loop
 * unrolls into a prefetch a line. A node allocated on 16 bytes may start
 * anywhere in its first line: its last byte's line is fetched as well. */
DP_WALK_INLINE void prefetch_span(const void *p, size_t end) {
  for (size_t o = 0; o < end; o += 64) __builtin_prefetch((const char *)p + o);
  __builtin_prefetch((const char *)p + end - 1);
}

/* What a scan reads of a node: a tensor's first 28 bytes (the storage's
 * copies: the storage itself need not be fetched); a list or tuple's
 * header and its first two items, when inline; an object's header and its
 * first attribute's value. */
enum {
  SPAN_TENSOR = offsetof(dp_tensor_t, sdevice) + sizeof(dp_device_t),
  SPAN_SEQ = offsetof(dp_seq_t, inl) + 2 * sizeof(dp_value_t),
  SPAN_OBJECT = offsetof(dp_object_t, inl) + offsetof(dp_attr_t, val) + sizeof(dp_value_t),
};

DP_WALK_INLINE void prefetch_node(dp_value_t x) {
  if (x.kind == DP_TENSOR) prefetch_span(x.u.h, SPAN_TENSOR);
  else if (x.kind == DP_LIST || x.kind == DP_TUPLE) prefetch_span(x.u.h, SPAN_SEQ);
  else if (x.kind == DP_OBJECT) prefetch_span(x.u.h, SPAN_OBJECT);
  else if (x.kind >= DP_LIST) prefetch_span(x.u.h, 128);
}

/* What the node n places ahead points to, its own lines fetched by now: a
 * tensor's second line, where its 28 bytes cross one; a sequence's first
 * two items; an object's first two attributes. */
DP_WALK_INLINE void prefetch_children(dp_value_t x) {
  if (x.kind == DP_TENSOR) {
    __builtin_prefetch((const char *)x.u.h + SPAN_TENSOR - 1);
  } else if (x.kind == DP_LIST || x.kind == DP_TUPLE) {
    const dp_seq_t *q = DP_SEQ(x);
    for (size_t j = 0; j < q->len && j < 2; j++) prefetch_node(q->items[j]);
  } else if (x.kind == DP_OBJECT) {
    const dp_object_t *o = DP_OBJ(x);
    for (size_t j = 0; j < o->len && j < 2; j++) prefetch_node(o->attrs[j].val);
  }
}

DP_WALK_INLINE void scan_prefetch(const dp_value_t *items, size_t n, size_t i) {
  size_t a = i + DP_SCAN_FAR_AHEAD;
  if (a < n && items[a].kind == DP_TENSOR) __builtin_prefetch(items[a].u.h); /* the rest comes with the near fetch */
  else if (a < n && items[a].kind >= DP_LIST) prefetch_node(items[a]);
  a = i + DP_SCAN_NEAR_AHEAD;
  if (a < n && items[a].kind >= DP_LIST) prefetch_children(items[a]);
}

/* Scan only: runs over seq items from *i that need no frame of their own —
 * scalars, str and bytes (skipped), tensors (staged), small containers held
 * once that try_stage() stages in place — and stops at the first other
 * item. Staging in place is sound only before a walk's first reduce(): a
 * container held once cannot be met again until a reduce() adds a
 * reference, so the memo never needs it (the replay before the first
 * reduce() records it all the same). After it every node must enter the
 * memo, so containers get frames again through visit(): one staged in place
 * then and met again through a later state would be walked a second time —
 * its tensors counted once, but its depth counted again (a scan without
 * paths refused what pickle accepts). The items would be frames at depth
 * `depth`. */
DP_WALK_INLINE int scan_leaves(dp__walker_t *w, const dp_value_t *items, size_t n, size_t *i, size_t depth) {
  uint32_t room = depth < w->max_depth ? (uint32_t)(w->max_depth - depth) : 0;
  int far = n >= DP_SCAN_FAR_MIN;
  for (; *i < n; (*i)++) {
    if (far) scan_prefetch(items, n, *i);
    uint32_t k = items[*i].kind;
    if (k < DP_LIST) continue;
    if (k == DP_TENSOR || ((k == DP_LIST || k == DP_TUPLE || k == DP_OBJECT) && w->memo_rc &&
                           dp__rc(items[*i].u.h) == 1 && try_stage(w, items[*i], room))) {
      if (k == DP_TENSOR) pend(w, items[*i].u.h);
      if (w->npending >= DP_WALK_BATCH) {
        int rc = flush_pending(w);
        if (rc) return rc;
      }
      continue;
    }
    return 0;
  }
  return 0;
}

/* S: the walk has a sink. Each function below is compiled twice, with S a
 * constant 0 (scan) and 1 (pickle), from the one body. */
DP_WALK_INLINE int visit_tensor(dp__walker_t *w, dp_value_t v, const int S) {
  const dp_tensor_t *t = DP_TENSOR(v);
  size_t id;
  int is_new;
  int rc = dp__ptrset_add_hashed(w->set, t->sdevice, t->sbase, t->snbytes, dp__ptr_hash(t->sdevice, t->sbase), &id,
                                 &is_new, w->err);
  if (rc) return walk_failed_at(w, rc);
  if (is_new && w->want_paths && dp__ptrset_set_path(w->set, id, dp__walker_path(w)) != 0)
    return walk_fail(w, DP_ENOMEM, "out of memory recording the path");
  return S ? w->sink->tensor(w->sink_ctx, v, id) : 0;
}

DP_WALK_INLINE int visit(dp__walker_t *w, dp_value_t v, const int S) {
  uint32_t k = v.kind;
  /* Without a sink (a scan) str and bytes are leaves that hold no pointer:
   * not even their memory is touched. */
  if (k < DP_LIST && (k < DP_STR || !S)) return S ? w->sink->scalar(w->sink_ctx, v) : 0;
  dp_heap_t *h = v.u.h;
  if (k == DP_TENSOR && w->batch) return stage_tensor(w, h);
  uint64_t index = w->next_index++;
  if (dp__rc(h) > w->memo_rc) {
    uint64_t seen = 0;
    int m = memo_check(w, h, index, &seen);
    if (m < 0) return memo_failed(w, m, 1);
    if (m == 1) {
      w->next_index--;
      return S ? w->sink->backref(w->sink_ctx, seen) : 0;
    }
  } else if (DP_UNLIKELY(h == w->root.u.h) && index != 0) {
    /* The root met again, though held once: the caller's handle need not
     * be a reference (a getter's result is borrowed), so a root held once,
     * by a cycle through it, is met again through its one edge. It is node
     * 0, and needs no memo entry to be known (a replay records it as any
     * other node, and the memo answers from then on). */
    w->next_index--;
    return S ? w->sink->backref(w->sink_ctx, 0) : 0;
  }
  switch (k) {
    case DP_STR:
    case DP_BYTES:
      return S ? w->sink->scalar(w->sink_ctx, v) : 0;
    case DP_TENSOR:
      return visit_tensor(w, v, S);
    case DP_LIST:
    case DP_TUPLE: {
      size_t n = DP_SEQ(v)->len;
      if (S) {
        int rc = w->sink->enter(w->sink_ctx, v, n);
        if (rc) return rc;
      } else {
        const dp_value_t *items = DP_SEQ(v)->items;
        if (w->batch && n && w->top < w->max_depth) {
          /* A container of leaves needs no frame: stage its tensors here;
           * otherwise its frame starts where the leaves stop. (Past the
           * depth limit, push() refuses it as a frame would be.) */
          size_t start = 0;
          int rc = scan_leaves(w, items, n, &start, w->top + 1);
          if (rc || start == n) return rc;
          if ((rc = push(w, v, dp_none(), n)) == 0) w->stack[w->top - 1].i = start;
          return rc;
        }
        /* Issue the misses of the first children together rather than
         * one at a time as the walk reaches them. */
        for (size_t i = 0; i < n && i < DP_PREFETCH_AHEAD; i++) {
          if (items[i].kind < DP_LIST) continue;
          const char *p = (const char *)items[i].u.h;
          __builtin_prefetch(p);
          if (items[i].kind <= DP_TUPLE) {  /* and the first items, after the header */
            __builtin_prefetch(p + 64);
            __builtin_prefetch(p + 128);
            __builtin_prefetch(p + 192);
          }
        }
      }
      return n ? push(w, v, dp_none(), n) : 0;
    }
    case DP_DICT: {
      size_t n = DP_DICT(v)->len;
      if (S) {
        int rc = w->sink->enter(w->sink_ctx, v, n);
        if (rc) return rc;
      }
      for (size_t i = 0; i < n && i < DP_PREFETCH_AHEAD; i++) {
        const dp_value_t *x = &DP_DICT(v)->entries[i].val;
        if (x->kind >= DP_LIST) __builtin_prefetch(x->u.h);
      }
      return n ? push(w, v, dp_none(), 2 * n) : 0;
    }
    case DP_OBJECT: {
      dp_object_t *o = DP_OBJ(v);
      int reduced = (o->c.h.flags & DP_HEAP_REDUCED) != 0;
      size_t n = reduced ? 1 : o->len;
      if (S) {
        int rc = w->sink->enter(w->sink_ctx, v, n);
        if (rc) return rc;
      }
      if (reduced) return push(w, v, dp__reduced_state(v), 1);
      return n ? push(w, v, dp_none(), n) : 0;
    }
    case DP_CUSTOM: {
      dp_value_t state;
      int rc = reduce_custom(w, v, &state, S);
      if (rc) return rc;
      if (S && (rc = w->sink->enter(w->sink_ctx, v, 1)) != 0) return rc;
      return push(w, v, state, 1);
    }
  }
  return dp__err(w->err, DP_EINVAL, "corrupt value of kind %u at %s", k, dp__walker_path(w));
}

DP_WALK_INLINE int next_child(dp__walker_t *w, dp__wframe_t *f, dp_value_t *child, const int S) {
  size_t i = f->i++;
  dp_value_t node = f->node;
  switch (node.kind) {
    case DP_LIST:
    case DP_TUPLE:
      *child = DP_SEQ(node)->items[i];
      return 0;
    case DP_DICT: {
      dp_entry_t *e = &DP_DICT(node)->entries[i >> 1];
      *child = (i & 1) ? e->val : e->key;
      /* A tensor is usually a dict value: while its key is written, start
       * fetching its storage (its header was fetched when the dict was
       * entered). */
      if (S && !(i & 1) && e->val.kind == DP_TENSOR) __builtin_prefetch(DP_TENSOR(e->val)->storage);
      return 0;
    }
    case DP_OBJECT:
      if (DP_OBJ(node)->c.h.flags & DP_HEAP_REDUCED) {
        *child = f->state;
        return 0;
      }
      *child = DP_OBJ(node)->attrs[i].val;
      return S ? w->sink->attr(w->sink_ctx, dp__attr_name(&DP_OBJ(node)->attrs[i]),
                                     DP_OBJ(node)->attrs[i].name_len)
                     : 0;
    default:
      *child = f->state;
      return 0;
  }
}

/* Pickle only: writes the run of scalar children of a list, tuple or dict
 * frame from f->i — none, bool, int, float, and str and bytes whose count
 * is not above memo_rc (numbered as visit() numbers them, which would not
 * record them either) — and stops at the first other child. The same calls
 * to the sink as visit() makes, without a round of the walk loop each. */
DP_WALK_INLINE int write_scalars(dp__walker_t *w, dp__wframe_t *f) {
  dp_value_t node = f->node;
  const dp__sink_t *sink = w->sink;
  while (f->i < f->n) {
    size_t i = f->i;
    dp_value_t c;
    if (node.kind == DP_DICT) {
      dp_entry_t *e = &DP_DICT(node)->entries[i >> 1];
      c = (i & 1) ? e->val : e->key;
      /* as next_child(): fetch a tensor value's storage while its key is written */
      if (!(i & 1) && e->val.kind == DP_TENSOR) __builtin_prefetch(DP_TENSOR(e->val)->storage);
    } else {
      c = DP_SEQ(node)->items[i];
    }
    if (c.kind >= DP_STR) {
      if (c.kind >= DP_LIST || dp__rc(c.u.h) > w->memo_rc) return 0;
      w->next_index++;
    }
    f->i = i + 1;  /* the child being visited, for paths */
    int rc = sink->scalar(w->sink_ctx, c);
    if (rc) return rc;
  }
  return 0;
}

DP_WALK_INLINE int walk_impl(dp__walker_t *w, dp_value_t root, const int S) {
  w->top = 0;
  w->next_index = 0;
  w->memo_rc = 1;
  w->root = root;
  memo_reset(w);
  int rc = visit(w, root, S);
  while (rc == 0 && w->top > 0) {
    dp__wframe_t *f = &w->stack[w->top - 1];
    if (f->i == f->n) {
      w->top--;
      continue;
    }
    /* Fast path for the common case: a run of list items. Scalars are
     * skipped in place; heap items a few places ahead are prefetched. */
    if (!S && (f->node.kind == DP_LIST || f->node.kind == DP_TUPLE)) {
      dp_value_t *items = DP_SEQ(f->node)->items;
      size_t n = f->n;
      if (w->batch) {
        if ((rc = scan_leaves(w, items, n, &f->i, w->top)) != 0) break;
      } else {
        while (f->i < n && items[f->i].kind < DP_LIST) f->i++;
      }
      if (f->i == n) continue;
      size_t ahead = f->i + DP_PREFETCH_AHEAD;
      if (ahead < n && items[ahead].kind >= DP_LIST) __builtin_prefetch(items[ahead].u.h);
    }
    if (S && f->node.kind >= DP_LIST && f->node.kind <= DP_DICT) {
      if ((rc = write_scalars(w, f)) != 0) break;
      if (f->i == f->n) continue;
    }
    dp_value_t child;
    rc = next_child(w, f, &child, S);
    if (rc == 0) rc = visit(w, child, S);
  }
  /* What was met before an error still lands in the set. */
  if (w->npending) {
    int frc = flush_pending(w);
    if (rc == 0) rc = frc;
  }
  /* A pickle's caller still reads what the states hold (dp__walker_release_states). */
  if (!S) dp__walker_release_states(w);
  w->top = 0;
  w->root = dp_none();
  return rc;
}

/* Walks running on this thread, one inside another's reduce() (a reduce
 * that scans or pickles some other value): bounded, so that a reduce
 * walking a value that holds its own type fails instead of overflowing the
 * stack. The walk itself is iterative; only this nesting recurses. */
static _Thread_local unsigned nested_walks;

int dp__walk(dp__walker_t *w, dp_value_t root) {
  if (nested_walks >= DP_MAX_NESTED_WALKS)
    return dp__err(w->err, DP_ELIMIT, "walks nested %u deep on this thread (a reduce() that scans or pickles a value "
                   "holding its own type?)", DP_MAX_NESTED_WALKS);
  nested_walks++;
  int rc = w->sink ? walk_impl(w, root, 1) : walk_impl(w, root, 0);
  nested_walks--;
  return rc;
}

/* ---- scan ---- */

/* A scan's walker is kept with the set it fills, as the set's opaque
 * scratch (ptrset_impl.h): made at the set's first scan, freed with the
 * set, so that a steady-state scan allocates nothing. A set is used by one
 * thread at a time, and so is its walker. */
static void scan_walker_free(void *p) {
  dp__walker_destroy(p);
  dp__free(p, sizeof(dp__walker_t));
}

static int scan_walker(dp_ptrset_t *set, dp__walker_t **out, dp_error_t *err) {
  if (DP_LIKELY(set->scratch_free == scan_walker_free)) {
    *out = set->scratch;
    return 0;
  }
  if (set->scratch_free) return dp__err(err, DP_ESTATE, "dp_scan: the set's scratch is in other use");
  dp__walker_t *w = dp__alloc(sizeof *w);
  if (!w) return dp__err(err, DP_ENOMEM, "out of memory allocating the scan's walker");
  dp__walker_init(w);
  set->scratch = w;
  set->scratch_free = scan_walker_free;
  *out = w;
  return 0;
}

int dp_scan(dp_value_t v, const dp_scan_opts_t *opts, dp_ptrset_t *set, dp_error_t *err) {
  if (!set) return dp__err(err, DP_EINVAL, "dp_scan: NULL set");
  if (opts && (opts->flags & ~DP_SCAN_PATHS))
    return dp__err(err, DP_EINVAL, "dp_scan: unknown flags 0x%x (DP_SCAN_PATHS is the only one, 0x%x)",
                   opts->flags & ~DP_SCAN_PATHS, DP_SCAN_PATHS);
  dp__walker_t *w = NULL;
  int rc = scan_walker(set, &w, err);
  if (rc) return rc;
  /* A reduce() that scans into this set would set the walker up again
   * under the running scan (its stack, memo and states). */
  if (w->busy)
    return dp__err(err, DP_ESTATE, "dp_scan: the set is being filled by a scan that has not returned "
                   "(a reduce() scanning into the set its own scan fills)");
  dp__walker_setup(w, set, NULL, NULL, opts ? opts->max_depth : 0, opts && (opts->flags & DP_SCAN_PATHS), err);
  w->busy = 1;
  rc = dp__walk(w, v);
  w->busy = 0;
  return rc;
}
