/* value/value.c — values: constructors, accessors, reference counting. */
#include <string.h>

#include "internal.h"
#include "../core/table.h"
#include "gc.h"

static const char *const kind_names[DP_KIND_COUNT] = {
    "none", "bool", "int", "float", "str", "bytes",
    "list", "tuple", "dict", "tensor", "object", "custom"};

const char *dp_kind_name(dp_kind_t kind) {
  return (unsigned)kind < DP_KIND_COUNT ? kind_names[kind] : "invalid";
}

static void heap_init(dp_heap_t *h, uint32_t kind) {
  dp__atomic_init(&h->rc, 1);
  h->kind = (uint8_t)kind;
  h->color = DP_GC_NONE;
  h->flags = 0;
}

static void cont_init(dp_cont_t *c, uint32_t kind) {
  heap_init(&c->h, kind);
  c->gc_refs = 0;
  dp__atomic_init(&c->gc_state, 0);
  c->gc_next = c->gc_next2 = NULL;
  c->gc_owner = NULL;
}

static dp_value_t heap_value(void *h, uint32_t kind) {
  dp_value_t v;
  v.u.h = h;
  v.kind = kind;
  v.reserved_ = 0;
  return v;
}

static int oom(dp_error_t *err, const char *what) {
  return dp__err(err, DP_ENOMEM, "out of memory allocating %s", what);
}

/* Entries of a dict, attributes of an object: the bound too_many states, so
 * that the check and the message cannot disagree (they did, by one). Below
 * the index table's own (dp__table_grow), so that it never refuses first. */
#define MAX_ENTRIES (UINT32_MAX - 2)

static int too_many(dp_error_t *err, const char *what, const char *items) {
  return dp__err(err, DP_ELIMIT, "%s holds at most %u %s", what, MAX_ENTRIES, items);
}

static int kind_mismatch(dp_error_t *err, const char *fn, dp_value_t v, const char *want) {
  return dp__err(err, DP_EINVAL, "%s: expected %s, got %s", fn, want, dp_kind_name(dp_value_kind(v)));
}

/* ---- reference counting ---- */

dp_value_t dp_value_retain(dp_value_t v) {
  if (dp_value_is_heap(v)) dp__ref_inc(&v.u.h->rc, dp_kind_name(dp_value_kind(v)));
  return v;
}

uint32_t dp_value_refcount(dp_value_t v) {
  return dp_value_is_heap(v) ? dp__rc(v.u.h) : 1;
}

void dp_value_release(dp_value_t v) {
  if (!dp_value_is_heap(v)) return;
  if (dp__is_container_kind(v.kind))
    dp__gc_release((dp_cont_t *)v.u.h);
  else
    dp__release_leaf(v.u.h);
}

/* ---- str / bytes ---- */

int dp__strobj_new(uint32_t kind, const void *p, size_t n, dp_value_t *out, dp_error_t *err) {
  size_t size;
  if (dp__add_ovf(n, sizeof(dp_strobj_t) + 1, &size)) return oom(err, dp_kind_name(kind));
  dp_strobj_t *s = dp__alloc(size);
  if (!s) return oom(err, dp_kind_name(kind));
  heap_init(&s->h, kind);
  s->len = n;
  dp__atomic_init(&s->hash, 0);
  if (n) memcpy(s->data, p, n);
  s->data[n] = '\0';
  *out = heap_value(s, kind);
  return 0;
}

int dp_str_new(const char *s, size_t n, dp_value_t *out, dp_error_t *err) {
  if (!out || (!s && n)) return dp__err(err, DP_EINVAL, "dp_str_new: NULL %s", out ? "s" : "out");
  if (!dp__utf8_valid(s, n)) return dp__err(err, DP_EINVAL, "dp_str_new: invalid UTF-8");
  return dp__strobj_new(DP_STR, s, n, out, err);
}

int dp_bytes_new(const void *p, size_t n, dp_value_t *out, dp_error_t *err) {
  if (!out || (!p && n)) return dp__err(err, DP_EINVAL, "dp_bytes_new: NULL %s", out ? "p" : "out");
  return dp__strobj_new(DP_BYTES, p, n, out, err);
}

const char *dp_str_data(dp_value_t s, size_t *len) {
  if (s.kind != DP_STR) {
    if (len) *len = 0;
    return NULL;
  }
  if (len) *len = DP_STROBJ(s)->len;
  return DP_STROBJ(s)->data;
}

const uint8_t *dp_bytes_data(dp_value_t b, size_t *len) {
  if (b.kind != DP_BYTES) {
    if (len) *len = 0;
    return NULL;
  }
  if (len) *len = DP_STROBJ(b)->len;
  return (const uint8_t *)DP_STROBJ(b)->data;
}

/* ---- list / tuple ---- */

static int seq_new(uint32_t kind, size_t cap, size_t len, dp_value_t *out, dp_error_t *err) {
  size_t size;
  if (dp__mul_ovf(cap, sizeof(dp_value_t), &size) || dp__add_ovf(size, sizeof(dp_seq_t), &size))
    return oom(err, dp_kind_name(kind));
  dp_seq_t *s = dp__alloc(size);
  if (!s) return oom(err, dp_kind_name(kind));
  cont_init(&s->c, kind);
  s->items = cap ? s->inl : NULL;
  s->inl_cap = cap;
  for (size_t i = 0; i < len; i++) s->items[i] = dp_none();
  s->len = len;
  if (kind == DP_TUPLE)
    dp__atomic_init(&s->key, 0);
  else
    s->cap = cap;
  *out = heap_value(s, kind);
  return 0;
}

int dp_list_new(size_t capacity, dp_value_t *out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_list_new: NULL out");
  return seq_new(DP_LIST, capacity, 0, out, err);
}

int dp_tuple_new(size_t n, dp_value_t *out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_tuple_new: NULL out");
  return seq_new(DP_TUPLE, n, n, out, err);
}

int dp_list_append(dp_value_t list, dp_value_t item, dp_error_t *err) {
  if (list.kind != DP_LIST) {
    dp_value_release(item);
    return kind_mismatch(err, "dp_list_append", list, "list");
  }
  dp_seq_t *s = DP_SEQ(list);
  if (s->len == s->cap &&
      dp__grow_inl((void **)&s->items, &s->cap, s->len + 1, sizeof(dp_value_t), s->inl) != 0) {
    dp_value_release(item);
    return oom(err, "list items");
  }
  s->items[s->len++] = item;
  return 0;
}

size_t dp_seq_len(dp_value_t seq) {
  return (seq.kind == DP_LIST || seq.kind == DP_TUPLE) ? DP_SEQ(seq)->len : 0;
}

dp_value_t dp_seq_get(dp_value_t seq, size_t i) {
  if ((seq.kind != DP_LIST && seq.kind != DP_TUPLE) || i >= DP_SEQ(seq)->len) return dp_none();
  return DP_SEQ(seq)->items[i];
}

int dp_seq_set(dp_value_t seq, size_t i, dp_value_t item, dp_error_t *err) {
  if (seq.kind != DP_LIST && seq.kind != DP_TUPLE) {
    dp_value_release(item);
    return kind_mismatch(err, "dp_seq_set", seq, "list or tuple");
  }
  dp_seq_t *s = DP_SEQ(seq);
  if (i >= s->len) {
    /* the message first: item may be the last reference to seq itself */
    int rc = dp__err(err, DP_EINVAL, "dp_seq_set: index %zu out of range (length %zu)", i, s->len);
    dp_value_release(item);
    return rc;
  }
  dp_value_t old = s->items[i];
  s->items[i] = item;
  if (seq.kind == DP_TUPLE) dp__store_relaxed(&s->key, 0);  /* its key word no longer holds */
  dp_value_release(old);
  return 0;
}

/* ---- keys: hashing and equality for dict keys ---- */

/* Keys are walked as trees (hashing, equality), so a key whose tuples share
 * items would cost exponential time in its depth: a key is hashable only if
 * its tree has at most KEY_MAX_NODES nodes and KEY_MAX_DEPTH levels, which
 * bounds every later walk of it. A tuple that becomes part of a dict key
 * keeps what the walk found (its key word, internal.h), so that it is never
 * walked again: a key used in many dicts, or a tuple shared by many keys,
 * costs its direct items each time, not its tree (a 1,023-item tuple key used
 * by 100,000 dicts, an 800 kB frame, walked 4 x 10^8 nodes to read). */
#define KEY_MAX_DEPTH 32
#define KEY_MAX_NODES 1024
#define KEY_WORD_NODES(w) ((uint32_t)((w) & 0x7ff))
#define KEY_WORD_HEIGHT(w) ((uint32_t)((w) >> 11 & 0x3f))

/* Work on keys done by this thread (internal.h): tests count it instead of
 * timing it. */
_Thread_local uint64_t dp__key_bytes_hashed;
_Thread_local uint64_t dp__key_nodes_walked;
_Thread_local uint64_t dp__key_bytes_compared;

static uint64_t mix(uint64_t h, uint64_t x, uint32_t kind) {
  uint64_t pair[2] = {h, x};
  return dp__hash_bytes(pair, sizeof pair, kind);
}

/* The keyed hash of a leaf: a scalar, or a str or bytes, whose hash is kept
 * once computed (a str is immutable). */
static uint64_t leaf_hash(dp_value_t v) {
  if (v.kind != DP_STR && v.kind != DP_BYTES) return dp__hash_u64(v.kind == DP_NONE ? 0 : (uint64_t)v.u.i, v.kind);
  dp_strobj_t *s = DP_STROBJ(v);
  uint64_t h = dp__load_relaxed(&s->hash);
  if (!h) {
    dp__key_bytes_hashed += s->len;
    h = dp__hash_bytes(s->data, s->len, v.kind);
    dp__store_relaxed(&s->hash, h);
  }
  return h;
}

/* What a key's walk finds: its hash, its tree's nodes, its levels below it. */
typedef struct ksum {
  uint64_t hash;
  uint32_t nodes, height;
} ksum_t;

/* Summarizes k, met `depth` levels below its key's root with *budget nodes
 * left to the key: 1 if the key can still be hashable (k is a leaf or a
 * tuple of such, within KEY_MAX_NODES nodes and KEY_MAX_DEPTH levels in all),
 * else 0. A tuple's kept word stands for its tree; the walk stops as soon as
 * the budget is spent, so whatever the sharing it visits at most
 * KEY_MAX_NODES + 1 nodes. With `keep` (the key is now in a dict), each tuple
 * walked keeps its word. */
static int key_sum(dp_value_t k, int depth, int *budget, int keep, ksum_t *out) {
  dp__key_nodes_walked++;
  switch (k.kind) {
    case DP_NONE: case DP_BOOL: case DP_INT: case DP_FLOAT: case DP_STR: case DP_BYTES:
      if (depth > KEY_MAX_DEPTH || --*budget < 0) return 0;
      *out = (ksum_t){leaf_hash(k), 1, 0};
      return 1;
    case DP_TUPLE:
      break;
    default:
      return 0;
  }
  dp_seq_t *s = DP_SEQ(k);
  uint64_t w = dp__load_relaxed(&s->key);
  if (w) {
    *out = (ksum_t){w >> DP__KEY_WORD_HASH_SHIFT, KEY_WORD_NODES(w), KEY_WORD_HEIGHT(w)};
    *budget -= (int)out->nodes;
    return *budget >= 0 && depth + (int)out->height <= KEY_MAX_DEPTH;
  }
  if (depth > KEY_MAX_DEPTH || --*budget < 0) return 0;
  uint64_t h = dp__hash_u64(s->len, DP_TUPLE);
  ksum_t sum = {0, 1, 0};
  for (size_t i = 0; i < s->len; i++) {
    ksum_t c;
    if (!key_sum(s->items[i], depth + 1, budget, keep, &c)) return 0;
    h = mix(h, c.hash, DP_TUPLE);
    sum.nodes += c.nodes;
    if (c.height + 1 > sum.height) sum.height = c.height + 1;
  }
  /* the top 47 bits: the word keeps them beside the nodes and height */
  sum.hash = h >> DP__KEY_WORD_HASH_SHIFT;
  if (keep) dp__store_relaxed(&s->key, sum.hash << DP__KEY_WORD_HASH_SHIFT | (uint64_t)sum.height << 11 | sum.nodes);
  *out = sum;
  return 1;
}

/* Whether k is hashable, and then its hash. */
static int key_hash(dp_value_t k, uint64_t *hash) {
  int budget = KEY_MAX_NODES;
  ksum_t sum;
  if (!key_sum(k, 0, &budget, 0, &sum)) return 0;
  *hash = sum.hash;
  return 1;
}

/* k was inserted as a dict key: its tuples keep their words from now on
 * (walked again only where none is kept yet). Not before it is in: a tuple
 * of a key refused or not inserted may still change. */
static void key_keep(dp_value_t k) {
  if (k.kind != DP_TUPLE || dp__key_word(k)) return;
  int budget = KEY_MAX_NODES;
  ksum_t sum;
  key_sum(k, 0, &budget, 1, &sum);
}

bool dp_value_is_hashable(dp_value_t key) {
  uint64_t h;
  return key_hash(key, &h);
}

/* The one hash of values, for dp_value_hash (equal.c): keyed with the
 * process's secret (table.h) as dict keys are. It hashes the value as a
 * tree, cut below `max_depth` levels and after `*budget` nodes, leaves
 * included (a str or bytes costs one: its hash is kept), so that it
 * terminates on cycles and costs at most the budget however often a large
 * container is shared (255 references to one list of 100,000 items read 25
 * million items); equal trees are cut alike, so values equal under
 * dp_value_equal(a, b, 0) hash equal. A dict or an object, whose order
 * equality ignores, adds its entries only when the budget has room for all
 * of them (two nodes an entry: its key or name, by the hash the container
 * keeps of it, and its value, by node_hash), summed so that the order does
 * not count; it hashed its size (and class) only, so that every dict of one
 * entry hashed alike, which any table keyed by dp_value_hash would meet as
 * one long chain. Kept tuple words are not used: a cut walk must not depend
 * on what other walks kept. */

/* A node by itself: a leaf whole, a container by its kind and size (and
 * class); what equal values have alike. */
static uint64_t node_hash(dp_value_t v) {
  switch (v.kind) {
    case DP_NONE: case DP_BOOL: case DP_INT: case DP_FLOAT: case DP_STR: case DP_BYTES:
      return leaf_hash(v);
    case DP_TENSOR: {
      /* every field tensor_equal (equal.c) compares: tensors that differ
         only in device, storage size or offset (views of one buffer, one
         address on two devices) must not all hash alike */
      dp_tensor_t *t = DP_TENSOR(v);
      const dp_storage_t *st = t->storage;
      uint64_t h = dp__hash_u64((uint64_t)(uintptr_t)st->base, DP_TENSOR);
      h = mix(h, t->dtype | ((uint64_t)t->ndim << 8) | ((uint64_t)st->device.type << 16) | ((uint64_t)st->device.index << 24),
              DP_TENSOR);
      h = mix(h, (uint64_t)st->nbytes, DP_TENSOR);
      h = mix(h, (uint64_t)t->offset, DP_TENSOR);
      return mix(h, dp__hash_bytes(t->dims, 2 * (size_t)t->ndim * sizeof(int64_t), DP_TENSOR), DP_TENSOR);
    }
    case DP_CUSTOM: return dp__hash_u64((uint64_t)(uintptr_t)v.u.h, DP_CUSTOM);
    case DP_DICT: return dp__hash_u64(DP_DICT(v)->len, DP_DICT);
    case DP_OBJECT: /* and whether it is a reduced stand-in, as equality tells them apart */
      return mix(dp__hash_u64(DP_OBJ(v)->len | (uint64_t)(DP_OBJ(v)->c.h.flags & DP_HEAP_REDUCED) << 63, DP_OBJECT),
                 dp__hash_bytes(DP_OBJ(v)->class_name, DP_OBJ(v)->class_len, DP_OBJECT), DP_OBJECT);
    default:  /* list, tuple */
      return dp__hash_u64(DP_SEQ(v)->len, v.kind);
  }
}

uint64_t dp__hash_value(dp_value_t v, int depth, int max_depth, size_t *budget) {
  if (*budget == 0) return dp__hash_u64(0, v.kind);
  (*budget)--;
  uint64_t h = node_hash(v);
  if (depth >= max_depth) return h;
  switch (v.kind) {
    case DP_LIST:
    case DP_TUPLE: {
      dp_seq_t *s = DP_SEQ(v);
      for (size_t i = 0; i < s->len && *budget; i++)
        h = mix(h, dp__hash_value(s->items[i], depth + 1, max_depth, budget), v.kind);
      return h;
    }
    case DP_DICT: {
      dp_dict_t *d = DP_DICT(v);
      if (d->len > *budget / 2) return h;
      *budget -= 2 * d->len;
      uint64_t sum = 0;
      for (size_t i = 0; i < d->len; i++) sum += mix(d->entries[i].hash, node_hash(d->entries[i].val), DP_DICT);
      return mix(h, sum, DP_DICT);
    }
    case DP_OBJECT: {
      dp_object_t *o = DP_OBJ(v);
      if (o->len > *budget / 2) return h;
      *budget -= 2 * o->len;
      uint64_t sum = 0;
      for (size_t i = 0; i < o->len; i++) sum += mix(o->attrs[i].hash, node_hash(o->attrs[i].val), DP_OBJECT);
      return mix(h, sum, DP_OBJECT);
    }
    default:
      return h;
  }
}

/* Key equality: identity first, then what the keys keep (a str's hash, a
 * tuple's word) when both kept one, then content. */
static int key_equal(dp_value_t a, dp_value_t b) {
  if (a.kind != b.kind) return 0;
  if (a.kind < DP_STR) return dp__leaf_equal(a, b);
  if (a.u.h == b.u.h) return 1;
  if (dp__key_kept_differ(a, b)) return 0;
  dp__key_nodes_walked++;
  if (a.kind != DP_TUPLE) {
    dp__key_bytes_compared += DP_STROBJ(a)->len;
    return dp__leaf_equal(a, b);
  }
  dp_seq_t *x = DP_SEQ(a), *y = DP_SEQ(b);
  if (x->len != y->len) return 0;
  for (size_t i = 0; i < x->len; i++)
    if (!key_equal(x->items[i], y->items[i])) return 0;
  return 1;
}

/* ---- the index shared by dict and object ----
 * Entries live in insertion order in an array; the index is a plain table
 * (table.h) over them, keyed by the hash each entry keeps. Small tables
 * (<= 8 entries) have no index: a linear scan is faster. */

#define INDEX_MIN_ENTRIES 8

typedef int (*entry_match_fn)(const void *entries, size_t i, const void *key, uint64_t hash);

/* The table over an index of n entries. */
static inline dp__table_t index_table(uint32_t *index, size_t index_cap, size_t n) {
  dp__table_t t;
  dp__table_init(&t);
  t.slots = index;
  t.nslots = index_cap;
  t.count = n;
  return t;
}

typedef struct index_key {
  const void *entries;
  entry_match_fn match;
  const void *key;
  uint64_t hash;
} index_key_t;

static inline __attribute__((always_inline)) int index_eq(const void *ctx, size_t i, const void *key) {
  DP_UNUSED(ctx);
  const index_key_t *k = key;
  return k->match(k->entries, i, k->key, k->hash);
}

/* Returns the entry position of key, or SIZE_MAX. */
static size_t index_find(const uint32_t *index, size_t index_cap, size_t n, const void *entries,
                         const void *key, uint64_t hash, entry_match_fn match) {
  if (!index) {
    for (size_t i = 0; i < n; i++)
      if (match(entries, i, key, hash)) return i;
    return SIZE_MAX;
  }
  dp__table_t t = index_table((uint32_t *)index, index_cap, n);
  index_key_t k = {entries, match, key, hash};
  size_t j, at = dp__table_find(&t, DP_TABLE_PLAIN, hash, index_eq, NULL, &k, &j);
  return at == DP_TABLE_NONE ? SIZE_MAX : at;
}

/* After appending entry n-1 (hash `hash`): keep the index in step. */
static int index_add(uint32_t **index, size_t *index_cap, size_t n, uint64_t hash,
                     uint64_t (*hash_at)(const void *, size_t), const void *entries) {
  if (n <= INDEX_MIN_ENTRIES) return 0;
  dp__table_t t = index_table(*index, *index_cap, n - 1);
  if (!*index || dp__table_full(&t)) {
    /* rebuilt with every entry, the new one included */
    int rc = dp__table_grow(&t, DP_TABLE_PLAIN, n, 16, hash_at, entries);
    if (rc == 0) {
      *index = t.slots;
      *index_cap = t.nslots;
    }
    return rc;
  }
  dp__table_put(&t, DP_TABLE_PLAIN, dp__table_empty_slot(&t, DP_TABLE_PLAIN, hash), hash, n - 1);
  return 0;
}

/* ---- dict ---- */

static uint64_t dict_hash_at(const void *e, size_t i) { return ((const dp_entry_t *)e)[i].hash; }
static int dict_match(const void *e, size_t i, const void *key, uint64_t hash) {
  const dp_entry_t *en = (const dp_entry_t *)e + i;
  return en->hash == hash && key_equal(en->key, *(const dp_value_t *)key);
}

int dp_dict_new(size_t capacity, dp_value_t *out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_dict_new: NULL out");
  size_t size;
  if (dp__mul_ovf(capacity, sizeof(dp_entry_t), &size) || dp__add_ovf(size, sizeof(dp_dict_t), &size))
    return oom(err, "dict");
  dp_dict_t *d = dp__alloc(size);
  if (!d) return oom(err, "dict");
  cont_init(&d->c, DP_DICT);
  d->len = 0;
  d->cap = capacity;
  d->inl_cap = capacity;
  d->entries = capacity ? d->inl : NULL;
  d->index = NULL;
  d->index_cap = 0;
  *out = heap_value(d, DP_DICT);
  return 0;
}

int dp__dict_set_checked(dp_value_t dict, dp_value_t key, dp_value_t val, int allow_replace,
                         dp_error_t *err) {
  if (dict.kind != DP_DICT) {
    dp_value_release(key);
    dp_value_release(val);
    return kind_mismatch(err, "dp_dict_set", dict, "dict");
  }
  uint64_t h;
  if (!key_hash(key, &h)) {
    int kk = key.kind;
    dp_value_release(key);
    dp_value_release(val);
    return dp__err(err, DP_ETYPE, "dict key of kind %s is not hashable%s", dp_kind_name(kk),
                   kk == DP_TUPLE ? DP__TUPLE_KEY_RULE : "");
  }
  dp_dict_t *d = DP_DICT(dict);
  size_t at = index_find(d->index, d->index_cap, d->len, d->entries, &key, h, dict_match);
  if (at != SIZE_MAX) {
    if (allow_replace != 1) {
      if (allow_replace != DP__KEEP_ON_EXISTS) {
        dp_value_release(key);
        dp_value_release(val);
      }
      return DP__EXISTS;
    }
    dp_value_t old = d->entries[at].val;
    d->entries[at].val = val;
    dp_value_release(key);
    dp_value_release(old);
    return 0;
  }
  int rc = d->len >= MAX_ENTRIES ? too_many(err, "a dict", "entries") : 0;
  if (!rc && d->len == d->cap &&
      dp__grow_inl((void **)&d->entries, &d->cap, d->len + 1, sizeof(dp_entry_t), d->inl) != 0)
    rc = oom(err, "dict entries");
  if (rc) {
    dp_value_release(key);
    dp_value_release(val);
    return rc;
  }
  d->entries[d->len].key = key;
  d->entries[d->len].val = val;
  d->entries[d->len].hash = h;
  d->len++;
  if ((rc = index_add(&d->index, &d->index_cap, d->len, h, dict_hash_at, d->entries)) != 0) {
    d->len--;
    dp_value_release(key);
    dp_value_release(val);
    return rc == DP_ELIMIT ? too_many(err, "a dict", "entries") : oom(err, "dict index");
  }
  key_keep(key);
  return 0;
}

int dp_dict_set(dp_value_t dict, dp_value_t key, dp_value_t val, dp_error_t *err) {
  return dp__dict_set_checked(dict, key, val, 1, err);
}

/* A key compared by the caller's equality (dp__dict_find_with). */
typedef struct key_with {
  dp_value_t key;
  dp__key_same_fn same;
  void *ctx;
} key_with_t;

static int dict_match_with(const void *e, size_t i, const void *key, uint64_t hash) {
  const dp_entry_t *en = (const dp_entry_t *)e + i;
  const key_with_t *k = key;
  return en->hash == hash && k->same(k->ctx, en->key, k->key);
}

size_t dp__dict_find_with(dp_value_t dict, dp_value_t key, dp__key_same_fn same, void *ctx) {
  dp_dict_t *d = DP_DICT(dict);
  uint64_t h;
  if (!key_hash(key, &h)) return SIZE_MAX;
  if (!same) return index_find(d->index, d->index_cap, d->len, d->entries, &key, h, dict_match);
  key_with_t k = {key, same, ctx};
  return index_find(d->index, d->index_cap, d->len, d->entries, &k, h, dict_match_with);
}

int dp_dict_get(dp_value_t dict, dp_value_t key, dp_value_t *val, dp_error_t *err) {
  if (dict.kind != DP_DICT) return kind_mismatch(err, "dp_dict_get", dict, "dict");
  uint64_t h; /* one walk of the key: whether it is hashable, and its hash */
  if (!key_hash(key, &h)) return dp__err(err, DP_ENOTFOUND, "dp_dict_get: no such key (a key of kind %s is not hashable)", dp_kind_name(dp_value_kind(key)));
  dp_dict_t *d = DP_DICT(dict);
  size_t at = index_find(d->index, d->index_cap, d->len, d->entries, &key, h, dict_match);
  if (at == SIZE_MAX) return dp__err(err, DP_ENOTFOUND, "dp_dict_get: no such key");
  if (val) *val = d->entries[at].val;
  return 0;
}

size_t dp_dict_len(dp_value_t dict) { return dict.kind == DP_DICT ? DP_DICT(dict)->len : 0; }

int dp_dict_item(dp_value_t dict, size_t i, dp_value_t *key, dp_value_t *val, dp_error_t *err) {
  if (dict.kind != DP_DICT) return kind_mismatch(err, "dp_dict_item", dict, "dict");
  if (i >= DP_DICT(dict)->len)
    return dp__err(err, DP_EINVAL, "dp_dict_item: index %zu out of range (length %zu)", i, DP_DICT(dict)->len);
  if (key) *key = DP_DICT(dict)->entries[i].key;
  if (val) *val = DP_DICT(dict)->entries[i].val;
  return 0;
}

/* ---- object ---- */

int dp__name_valid(const char *s, size_t n) {
  return n > 0 && !dp__has_nul(s, n) && dp__utf8_valid(s, n);
}

typedef struct name_key { const char *s; size_t n; } name_key_t;

static uint64_t attr_hash_at(const void *a, size_t i) { return ((const dp_attr_t *)a)[i].hash; }
static int attr_match(const void *a, size_t i, const void *key, uint64_t hash) {
  const dp_attr_t *at = (const dp_attr_t *)a + i;
  const name_key_t *k = key;
  return at->hash == hash && at->name_len == k->n && memcmp(dp__attr_name(at), k->s, k->n) == 0;
}

/* what: "object class" or "reduce type" */
static int bad_class_name(const char *what, dp_error_t *err) {
  return dp__err(err, DP_EINVAL, "%s name must be non-empty UTF-8 without NUL", what);
}

/* Names are checked once, where they come in: by the public constructors
 * here (dp__name_valid) and by the reader (read_name, the same rule). The
 * dp__*_n internals, the reader's, take names already checked. */
static int object_alloc(const char *cls, size_t len, size_t nattrs, uint16_t flags, dp_value_t *out,
                        dp_error_t *err) {
  size_t size;
  if (dp__mul_ovf(nattrs, sizeof(dp_attr_t), &size) || dp__add_ovf(size, sizeof(dp_object_t) + 1, &size) ||
      dp__add_ovf(size, len, &size))
    return oom(err, "object");
  dp_object_t *o = dp__alloc(size);
  if (!o) return oom(err, "object");
  cont_init(&o->c, DP_OBJECT);
  o->c.h.flags = flags;
  char *name = (char *)(o->inl + nattrs);
  memcpy(name, cls, len);
  name[len] = '\0';
  o->class_name = name;
  o->class_len = len;
  o->len = 0;
  o->cap = o->inl_cap = nattrs;
  o->attrs = nattrs ? o->inl : NULL;
  o->index = NULL;
  o->index_cap = 0;
  *out = heap_value(o, DP_OBJECT);
  return 0;
}

/* Room for a few attributes up front: most objects have a handful. */
#define OBJECT_DEFAULT_ATTRS 4

int dp__object_new_n(const char *cls, size_t len, size_t nattrs, dp_value_t *out, dp_error_t *err) {
  return object_alloc(cls, len, nattrs, 0, out, err);
}

int dp_object_new(const char *class_name, dp_value_t *out, dp_error_t *err) {
  if (!class_name || !out) return dp__err(err, DP_EINVAL, "dp_object_new: NULL %s", out ? "class_name" : "out");
  size_t len = strlen(class_name);
  if (!dp__name_valid(class_name, len)) return bad_class_name("object class", err);
  return object_alloc(class_name, len, OBJECT_DEFAULT_ATTRS, 0, out, err);
}

int dp__object_set_n(dp_value_t obj, const char *name, size_t n, dp_value_t val, int allow_replace,
                     dp_error_t *err) {
  if (obj.kind != DP_OBJECT) {
    dp_value_release(val);
    return kind_mismatch(err, "dp_object_set", obj, "object");
  }
  dp_object_t *o = DP_OBJ(obj);
  name_key_t key = {name, n};
  uint64_t h = dp__hash_bytes(name, n, DP_OBJECT);
  size_t at = index_find(o->index, o->index_cap, o->len, o->attrs, &key, h, attr_match);
  if (at != SIZE_MAX) {
    if (!allow_replace) {
      dp_value_release(val);
      return DP__EXISTS;
    }
    dp_value_t old = o->attrs[at].val;
    o->attrs[at].val = val;
    dp_value_release(old);
    return 0;
  }
  int rc = o->len >= MAX_ENTRIES ? too_many(err, "an object", "attributes") : 0;
  /* Copied before the array grows: name may lie in it (a name from
   * dp_object_attr, or the tail of one), which the growth frees. */
  char short_name[DP_ATTR_INLINE];
  if (n < DP_ATTR_INLINE) memcpy(short_name, name, n);
  char *copy = !rc && n >= DP_ATTR_INLINE ? dp__strndup(name, n) : NULL;
  if (!rc && ((n >= DP_ATTR_INLINE && !copy) ||
              (o->len == o->cap &&
               dp__grow_inl((void **)&o->attrs, &o->cap, o->len + 1, sizeof(dp_attr_t), o->inl) != 0)))
    rc = oom(err, "object attributes");
  if (rc) {
    dp__free(copy, n + 1);
    dp_value_release(val);
    return rc;
  }
  dp_attr_t *a = &o->attrs[o->len];
  if (copy) {
    a->n.heap = copy;
  } else {
    memcpy(a->n.inl, short_name, n);
    a->n.inl[n] = '\0';
  }
  a->name_len = n;
  a->hash = h;
  a->val = val;
  o->len++;
  if ((rc = index_add(&o->index, &o->index_cap, o->len, h, attr_hash_at, o->attrs)) != 0) {
    o->len--;
    dp__free(copy, n + 1);
    dp_value_release(val);
    return rc == DP_ELIMIT ? too_many(err, "an object", "attributes") : oom(err, "object index");
  }
  return 0;
}

int dp_object_set(dp_value_t obj, const char *name, dp_value_t val, dp_error_t *err) {
  if (!name) {
    dp_value_release(val);
    return dp__err(err, DP_EINVAL, "dp_object_set: NULL name");
  }
  size_t n = strlen(name);
  if (obj.kind == DP_OBJECT && !dp__name_valid(name, n)) {
    dp_value_release(val);
    return dp__err(err, DP_EINVAL, "attribute name must be non-empty UTF-8 without NUL");
  }
  if (obj.kind == DP_OBJECT && (DP_OBJ(obj)->c.h.flags & DP_HEAP_REDUCED) && strcmp(name, "__reduce__") != 0) {
    /* a frame carries a stand-in's state only: another attribute would be
     * lost. The message first: name may be borrowed from val (a str's data,
     * the class name of val itself), which releasing it may free. */
    char shown[DP__SHOWN_MAX];
    int rc = dp__err(err, DP_EINVAL, "dp_object_set: a reduced stand-in has one attribute, \"__reduce__\" (its "
                     "state), not '%s'", dp__shown(name, shown));
    dp_value_release(val);
    return rc;
  }
  return dp__object_set_n(obj, name, n, val, 1, err);
}

int dp_object_get(dp_value_t obj, const char *name, dp_value_t *val, dp_error_t *err) {
  if (obj.kind != DP_OBJECT) return kind_mismatch(err, "dp_object_get", obj, "object");
  if (!name) return dp__err(err, DP_EINVAL, "dp_object_get: NULL name");
  dp_object_t *o = DP_OBJ(obj);
  name_key_t key = {name, strlen(name)};
  size_t at = index_find(o->index, o->index_cap, o->len, o->attrs, &key, dp__hash_bytes(name, key.n, DP_OBJECT),
                         attr_match);
  if (at == SIZE_MAX) {
    char shown[DP__SHOWN_MAX]; /* whole UTF-8 characters, escaped, "…" when cut: name is any C string */
    return dp__err(err, DP_ENOTFOUND, "dp_object_get: no attribute '%s'", dp__shown(name, shown));
  }
  if (val) *val = o->attrs[at].val;
  return 0;
}

const char *dp_object_class(dp_value_t obj) {
  return obj.kind == DP_OBJECT ? DP_OBJ(obj)->class_name : NULL;
}

size_t dp_object_nattrs(dp_value_t obj) { return obj.kind == DP_OBJECT ? DP_OBJ(obj)->len : 0; }

int dp_object_attr(dp_value_t obj, size_t i, const char **name, dp_value_t *val, dp_error_t *err) {
  if (obj.kind != DP_OBJECT) return kind_mismatch(err, "dp_object_attr", obj, "object");
  if (i >= DP_OBJ(obj)->len)
    return dp__err(err, DP_EINVAL, "dp_object_attr: index %zu out of range (%zu attribute%s)", i, DP_OBJ(obj)->len,
                   DP_OBJ(obj)->len == 1 ? "" : "s");
  if (name) *name = dp__attr_name(&DP_OBJ(obj)->attrs[i]);
  if (val) *val = DP_OBJ(obj)->attrs[i].val;
  return 0;
}

bool dp_object_is_reduced(dp_value_t obj) {
  return obj.kind == DP_OBJECT && (DP_OBJ(obj)->c.h.flags & DP_HEAP_REDUCED);
}

#define REDUCED_ATTR "__reduce__"

int dp__object_new_reduced_n(const char *type, size_t len, dp_value_t *out, dp_error_t *err) {
  return object_alloc(type, len, 1, DP_HEAP_REDUCED, out, err);
}

int dp_object_new_reduced(const char *type_name, dp_value_t state, dp_value_t *out, dp_error_t *err) {
  if (!type_name || !out) {
    dp_value_release(state);
    return dp__err(err, DP_EINVAL, "dp_object_new_reduced: NULL %s", out ? "type_name" : "out");
  }
  size_t len = strlen(type_name);
  int rc = dp__name_valid(type_name, len) ? object_alloc(type_name, len, 1, DP_HEAP_REDUCED, out, err)
                                          : bad_class_name("reduce type", err);
  if (rc) {
    dp_value_release(state);
    return rc;
  }
  rc = dp_object_set(*out, REDUCED_ATTR, state, err);
  if (rc) dp_value_release(*out);
  return rc;
}

dp_value_t dp__reduced_state(dp_value_t obj) {
  dp_value_t st = dp_none();
  dp_object_get(obj, REDUCED_ATTR, &st, NULL);
  return st;
}

/* ---- storage ---- */

int dp_storage_new(dp_device_t device, void *base, size_t nbytes, dp_storage_release_cb release,
                   void *ud, dp_storage_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_storage_new: NULL out");
  if (device.type >= DP_DEVICE_TYPE_COUNT || (device.type == DP_DEVICE_CPU && device.index != 0))
    return dp__err(err, DP_EINVAL, "dp_storage_new: invalid device (type %u, index %u)",
                   device.type, device.index);
  dp_storage_t *s = dp__alloc(sizeof *s);
  if (!s) return oom(err, "storage");
  dp__atomic_init(&s->rc, 1);
  s->device = device;
  s->base = base;
  s->nbytes = nbytes;
  s->release = release;
  s->ud = ud;
  s->host_data = NULL;
  s->foreign = 0;
  *out = s;
  return 0;
}

dp_storage_t *dp_storage_retain(dp_storage_t *s) {
  if (s) dp__ref_inc(&s->rc, "storage");
  return s;
}

dp_device_t dp_storage_device(const dp_storage_t *s) {
  dp_device_t none = {DP_DEVICE_CPU, 0};
  return s ? s->device : none;
}
void *dp_storage_base(const dp_storage_t *s) { return s ? s->base : NULL; }
size_t dp_storage_nbytes(const dp_storage_t *s) { return s ? s->nbytes : 0; }
const void *dp_storage_host_data(const dp_storage_t *s) { return s ? s->host_data : NULL; }

int dp_storage_set_host_data(dp_storage_t *s, const void *data, dp_error_t *err) {
  if (!s || (!data && s->nbytes)) return dp__err(err, DP_EINVAL, "dp_storage_set_host_data: NULL %s", s ? "data" : "storage");
  void *copy = dp__alloc(s->nbytes ? s->nbytes : 1);
  if (!copy) return oom(err, "storage host data");
  if (s->nbytes) memcpy(copy, data, s->nbytes);
  dp__free(s->host_data, s->nbytes ? s->nbytes : 1);
  s->host_data = copy;
  return 0;
}

/* ---- tensor ---- */

static const struct { const char *name; size_t size; } dtypes[DP_DTYPE_COUNT] = {
    {"bool", 1},     {"int8", 1},    {"int16", 2},    {"int32", 4},    {"int64", 8},
    {"uint8", 1},    {"uint16", 2},  {"uint32", 4},   {"uint64", 8},   {"float16", 2},
    {"bfloat16", 2}, {"float32", 4}, {"float64", 8},  {"complex64", 8}, {"complex128", 16},
};

const char *dp_dtype_name(dp_dtype_t d) { return (unsigned)d < DP_DTYPE_COUNT ? dtypes[d].name : NULL; }
size_t dp_dtype_size(dp_dtype_t d) { return (unsigned)d < DP_DTYPE_COUNT ? dtypes[d].size : 0; }

int dp_dtype_parse(const char *name, dp_dtype_t *out, dp_error_t *err) {
  if (!name || !out) return dp__err(err, DP_EINVAL, "dp_dtype_parse: NULL %s", name ? "out" : "name");
  for (int i = 0; i < DP_DTYPE_COUNT; i++)
    if (strcmp(name, dtypes[i].name) == 0) {
      *out = (dp_dtype_t)i;
      return 0;
    }
  char shown[DP__SHOWN_MAX];
  return dp__err(err, DP_EINVAL, "dp_dtype_parse: unknown dtype '%s'", dp__shown(name, shown));
}

/* Checks that every element the view addresses lies in [0, nbytes). Every
 * product and sum is checked (dp__mul_ovf, dp__add_ovf): a view whose extent
 * does not fit in 64 bits addresses bytes no storage has. */
int dp__tensor_check(size_t nbytes, dp_dtype_t dtype, int ndim, const int64_t *shape,
                     const int64_t *strides, int64_t offset, dp_error_t *err) {
  if ((unsigned)dtype >= DP_DTYPE_COUNT) return dp__err(err, DP_EINVAL, "unknown dtype %d", (int)dtype);
  if (ndim < 0 || ndim > DP_TENSOR_MAX_DIMS)
    return dp__err(err, DP_EINVAL, "tensor has %d dimensions (0..%d allowed)", ndim, DP_TENSOR_MAX_DIMS);
  if (offset < 0) return dp__err(err, DP_EINVAL, "negative tensor offset %lld", (long long)offset);
  for (int d = 0; d < ndim; d++) /* the format's range (FORMAT.md): -(2^63-1) .. 2^63-1 */
    if (strides[d] == INT64_MIN) return dp__err(err, DP_EINVAL, "tensor stride -2^63 (strides lie in -(2^63-1)..2^63-1)");
  int empty = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) return dp__err(err, DP_EINVAL, "negative tensor dimension %lld", (long long)shape[d]);
    if (shape[d] == 0) empty = 1;
  }
  if (empty) return 0;  /* an empty view addresses nothing */
  int64_t count = 1;
  for (int d = 0; d < ndim; d++)
    if (dp__mul_ovf(count, shape[d], &count) || count > DP_TENSOR_MAX_ELEMENTS)
      return dp__err(err, DP_EINVAL, "tensor has too many elements (at most 2^62)");
  /* lo and hi: the lowest and highest element index addressed */
  int64_t lo = offset, hi = offset, span;
  uint64_t end;
  for (int d = 0; d < ndim; d++) {
    if (dp__mul_ovf(shape[d] - 1, strides[d], &span) ||
        (span < 0 ? dp__add_ovf(lo, span, &lo) : dp__add_ovf(hi, span, &hi)))
      goto outside;
  }
  if (lo < 0 || dp__add_ovf(hi, 1, &end) || dp__mul_ovf(end, dtypes[dtype].size, &end) || end > nbytes)
    goto outside;
  return 0;
outside:
  return dp__err(err, DP_EINVAL, "tensor view exceeds its storage of %zu byte%s", nbytes, nbytes == 1 ? "" : "s");
}

int dp_tensor_new(dp_storage_t *storage, dp_dtype_t dtype, int ndim, const int64_t *shape,
                  const int64_t *strides, int64_t offset, dp_value_t *out, dp_error_t *err) {
  int rc;
  int64_t contiguous[DP_TENSOR_MAX_DIMS];
  if (!storage || !out || (ndim > 0 && !shape)) {
    rc = dp__err(err, DP_EINVAL, "dp_tensor_new: NULL %s", !storage ? "storage" : !out ? "out" : "shape");
    goto fail;
  }
  if (ndim >= 0 && ndim <= DP_TENSOR_MAX_DIMS && !strides) {
    /* Row-major strides; the product of the shape after a 0 dimension may
     * still overflow (an empty view of a huge shape). */
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
      contiguous[d] = s;
      if (d > 0 && dp__mul_ovf(s, shape[d] > 0 ? shape[d] : 1, &s)) {
        /* the shape's own error first (a negative or too many elements);
         * else it is empty, and only its strides do not fit */
        static const int64_t zeros[DP_TENSOR_MAX_DIMS];
        rc = dp__tensor_check(storage->nbytes, dtype, ndim, shape, zeros, offset, err);
        if (rc == 0) rc = dp__err(err, DP_EINVAL, "contiguous strides of this shape overflow int64");
        goto fail;
      }
    }
    strides = contiguous;
  }
  rc = dp__tensor_check(storage->nbytes, dtype, ndim, shape, strides, offset, err);
  if (rc) goto fail;
  dp_tensor_t *t = dp__alloc(sizeof *t + 2 * (size_t)ndim * sizeof(int64_t));
  if (!t) {
    rc = oom(err, "tensor");
    goto fail;
  }
  heap_init(&t->h, DP_TENSOR);
  t->storage = storage;
  t->sdevice = storage->device;
  t->sbase = storage->base;
  t->snbytes = storage->nbytes;
  t->dtype = (uint8_t)dtype;
  t->ndim = (uint8_t)ndim;
  t->offset = offset;
  if (ndim) {
    memcpy(t->dims, shape, (size_t)ndim * sizeof(int64_t));
    memcpy(t->dims + ndim, strides, (size_t)ndim * sizeof(int64_t));
  }
  *out = heap_value(t, DP_TENSOR);
  return 0;
fail:
  dp_storage_release(storage);
  return rc;
}

dp_storage_t *dp_tensor_storage(dp_value_t t) { return t.kind == DP_TENSOR ? DP_TENSOR(t)->storage : NULL; }
dp_dtype_t dp_tensor_dtype(dp_value_t t) { return (dp_dtype_t)(t.kind == DP_TENSOR ? DP_TENSOR(t)->dtype : 0); }
int dp_tensor_ndim(dp_value_t t) { return t.kind == DP_TENSOR ? DP_TENSOR(t)->ndim : 0; }
const int64_t *dp_tensor_shape(dp_value_t t) { return t.kind == DP_TENSOR ? DP_TENSOR(t)->dims : NULL; }
const int64_t *dp_tensor_strides(dp_value_t t) {
  return t.kind == DP_TENSOR ? DP_TENSOR(t)->dims + DP_TENSOR(t)->ndim : NULL;
}
int64_t dp_tensor_offset(dp_value_t t) { return t.kind == DP_TENSOR ? DP_TENSOR(t)->offset : 0; }

/* ---- custom ---- */

int dp_custom_new(const dp_type_t *type, void *obj, dp_value_t *out, dp_error_t *err) {
  /* On failure the type is read before destroy runs: obj may hold it (a
   * type made for each object), and destroy frees obj. */
  int rc;
  if (!type || !type->name || !out)
    rc = dp__err(err, DP_EINVAL, "dp_custom_new: NULL %s", !type ? "type" : !type->name ? "type->name" : "out");
  else if (!dp__name_valid(type->name, strlen(type->name))) /* a frame names it: the reader would refuse it */
    rc = dp__err(err, DP_EINVAL, "dp_custom_new: a type name must be non-empty UTF-8");
  else
    rc = 0;
  dp_custom_t *c = rc ? NULL : dp__alloc(sizeof *c);
  if (!rc && !c) rc = oom(err, "custom");
  if (rc) {
    void (*destroy)(void *) = type ? type->destroy : NULL;
    if (destroy) destroy(obj);
    return rc;
  }
  heap_init(&c->h, DP_CUSTOM);
  c->type = type;
  c->obj = obj;
  *out = heap_value(c, DP_CUSTOM);
  return 0;
}

const dp_type_t *dp_custom_type(dp_value_t c) { return c.kind == DP_CUSTOM ? DP_CUSTOM(c)->type : NULL; }
void *dp_custom_data(dp_value_t c) { return c.kind == DP_CUSTOM ? DP_CUSTOM(c)->obj : NULL; }
