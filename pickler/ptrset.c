/* pickler/ptrset.c — deduplicated storages in discovery order, by device. */
#include <string.h>

#include "ptrset_impl.h"

int dp_ptrset_new(dp_ptrset_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_ptrset_new: NULL out");
  dp_ptrset_t *s = dp__alloc(sizeof *s);
  if (!s) return dp__err(err, DP_ENOMEM, "out of memory allocating a pointer set");
  memset(s, 0, sizeof *s);
  dp__table_init(&s->tab);
  *out = s;
  return 0;
}

/* ---- paths: an arena of chunks reused across clears ---- */

#define DP_ARENA_FIRST 4096
#define DP_ARENA_BIGGEST (1u << 20)

char *dp__arena_strdup(dp__arena_t *a, const char *s, size_t n) {
  if (!a->cur) {
    a->cur = a->head;
    a->used = 0;
  }
  while (!a->cur || a->cur->cap - a->used < n + 1) {
    if (a->cur && a->cur->next) {  /* a chunk kept from before a reset */
      a->cur = a->cur->next;
      a->used = 0;
      continue;
    }
    size_t cap = a->cur ? a->cur->cap * 2 : DP_ARENA_FIRST;
    if (cap > DP_ARENA_BIGGEST) cap = DP_ARENA_BIGGEST;
    if (cap < n + 1) cap = n + 1;
    if (cap > SIZE_MAX - sizeof(dp__achunk_t)) return NULL;
    dp__achunk_t *c = dp__alloc(sizeof *c + cap);
    if (!c) return NULL;
    c->next = NULL;
    c->cap = cap;
    if (a->cur)
      a->cur->next = c;
    else
      a->head = c;
    a->cur = c;
    a->used = 0;
  }
  char *p = a->cur->data + a->used;
  memcpy(p, s, n);
  p[n] = '\0';
  a->used += n + 1;
  return p;
}

void dp__arena_reset(dp__arena_t *a) {
  a->cur = NULL;
  a->used = 0;
}

void dp__arena_free(dp__arena_t *a) {
  for (dp__achunk_t *c = a->head, *next; c; c = next) {
    next = c->next;
    dp__free(c, sizeof *c + c->cap);
  }
  memset(a, 0, sizeof *a);
}

void dp_ptrset_free(dp_ptrset_t *s) {
  if (!s) return;
  dp__arena_free(&s->paths_arena);
  dp__free(s->paths, s->paths_cap * sizeof *s->paths);
  dp__free(s->block, s->block_size);
  dp__free(s->next_on, s->next_cap * sizeof *s->next_on);
  dp__table_destroy(&s->tab, DP_TABLE_TAGGED);
  dp__free(s->groups, s->groups_cap * sizeof(dp__pgroup_t));
  if (s->scratch_free) s->scratch_free(s->scratch);
  dp__free(s, sizeof *s);
}

void dp_ptrset_clear(dp_ptrset_t *s) {
  if (!s) return;
  dp__arena_reset(&s->paths_arena);
  s->npaths = 0;
  s->count = 0;
  s->ngroups = 0;
  s->last_group = 0;
  dp__table_clear(&s->tab, DP_TABLE_TAGGED);
}

static uint64_t entry_hash(const void *ctx, size_t i) {
  const dp_ptrset_t *s = ctx;
  return dp__ptr_hash(s->rest[i].device, s->bases[i]);
}

/* Room for `need` entries: a larger block (ptrs.h layout), the entries
 * copied over, and the chain's array grown alike once there is one. */
static int grow_entries(dp_ptrset_t *s, size_t need) {
  if (need <= s->cap) return 0;
  size_t cap = s->cap ? s->cap : 16;
  while (cap < need) {
    if (cap > SIZE_MAX / 4) return DP_ENOMEM;
    cap *= 2;
  }
  if (s->next_on && dp__grow((void **)&s->next_on, &s->next_cap, cap, sizeof *s->next_on) != 0) return DP_ENOMEM;
  size_t size = dp__ptrs_block_size(cap);
  void *b = size ? dp__alloc(size) : NULL;
  if (!b) return DP_ENOMEM;
  void **bases = b;
  dp__pentry_t *rest = (dp__pentry_t *)(bases + cap);
  if (s->count) {
    memcpy(bases, s->bases, s->count * sizeof *bases);
    memcpy(rest, s->rest, s->count * sizeof *rest);
  }
  dp__free(s->block, s->block_size);
  s->block = b;
  s->block_size = size;
  s->sized = 0;
  s->bases = bases;
  s->rest = rest;
  s->cap = cap;
  return 0;
}

static size_t group_of(dp_ptrset_t *s, dp_device_t d) {
  if (s->last_group < s->ngroups && dp_device_equal(s->groups[s->last_group].device, d))
    return s->last_group;
  for (size_t g = 0; g < s->ngroups; g++)
    if (dp_device_equal(s->groups[g].device, d)) return s->last_group = g;
  return SIZE_MAX;
}

/* A device a storage could have: a known type, and index 0 for cpu. */
static int device_ok(dp_device_t d) {
  return d.type < DP_DEVICE_TYPE_COUNT && (d.type != DP_DEVICE_CPU || d.index == 0);
}

/* A table refuses DP_ELIMIT from UINT32_MAX - 1 items (table.h): a set at
 * its limit never asks that of its table. */
_Static_assert(DP_PTRSET_MAX_ENTRIES < UINT32_MAX - 1, "a set's table can hold its entries");

/* Errors are written where they happen, and passed through by every caller. */
static int too_many(dp_error_t *err) {
  return dp__err(err, DP_ELIMIT, "a pointer set holds at most %u entries", DP_PTRSET_MAX_ENTRIES);
}

int dp__ptrset_insert_new(dp_ptrset_t *s, dp_device_t device, void *base, size_t nbytes, uint64_t h,
                          size_t slot, size_t *index, dp_error_t *err) {
  if (s->count >= DP_PTRSET_MAX_ENTRIES) return too_many(err);
  if (!s->raw && dp__table_full(&s->tab)) {
    /* never DP_ELIMIT: the count is below DP_PTRSET_MAX_ENTRIES (above) */
    int rc = dp__table_grow(&s->tab, DP_TABLE_TAGGED, s->count, 64, entry_hash, s);
    if (rc) return dp__err(err, rc, "out of memory growing a pointer set's table");
    slot = SIZE_MAX;
  }
  size_t g = group_of(s, device);
  if (g == SIZE_MAX) {
    if (dp__grow((void **)&s->groups, &s->groups_cap, s->ngroups + 1, sizeof(dp__pgroup_t)) != 0)
      return dp__err(err, DP_ENOMEM, "out of memory growing a pointer set's devices");
    if (s->ngroups == 1) {  /* a second device: chain the first one's entries (0, 1, 2, ...) */
      if (dp__grow((void **)&s->next_on, &s->next_cap, s->cap > s->count + 1 ? s->cap : s->count + 1,
                   sizeof *s->next_on) != 0)
        return dp__err(err, DP_ENOMEM, "out of memory growing a pointer set's devices");
      for (size_t k = 0; k + 1 < s->count; k++) s->next_on[k] = (uint32_t)(k + 2);
      if (s->count) s->next_on[s->count - 1] = 0;
    }
    g = s->ngroups++;
    s->groups[g] = (dp__pgroup_t){device, 0, 0, 0};
    s->last_group = g;
  }
  if (s->count == s->cap && grow_entries(s, s->count + 1) != 0) {
    if (s->groups[g].count == 0) s->ngroups--;
    return dp__err(err, DP_ENOMEM, "out of memory growing a pointer set's entries");
  }
  size_t j = s->raw ? 0 : slot != SIZE_MAX ? slot : dp__table_empty_slot(&s->tab, DP_TABLE_TAGGED, h);
  dp__pgroup_t *gr = &s->groups[g];
  if (gr->count == 0) gr->head = (uint32_t)s->count;
  int chained = s->ngroups > 1 && gr->count > 0;
  if (s->ngroups > 1 && !chained) s->next_on[s->count] = 0;  /* a group's head: its chain ends here so far */
  DP__PENTRY_PUSH(s->raw, *index, s->bases, s->rest, s->next_on, s->count, &s->tab, g, gr->count, gr->tail, chained, device,
                  base, nbytes, h, j);
  return 0;
}

int dp__ptrset_reserve(dp_ptrset_t *s, size_t n) {
  if (n > DP_PTRSET_MAX_ENTRIES - s->count) return DP_ELIMIT;
  size_t need = s->count + n;
  if (!s->raw && need * 2 > s->tab.nslots) {
    size_t slots = s->tab.nslots > 64 ? s->tab.nslots : 64;  /* a power of two */
    while (slots < need * 2) slots *= 2;
    int rc = dp__table_grow(&s->tab, DP_TABLE_TAGGED, s->count, slots, entry_hash, s);
    if (rc) return rc;
  }
  return grow_entries(s, need);
}

/* The batch loop of both batch inserts: the walker's storages (st, with
 * `again` bits) and dp_ptrset_add_many's items (with their indices asked
 * back). Exactly one of st and items is given, a constant at each call:
 * inlined, each caller gets its own loop. raw (a constant too): the set is
 * raw, h is not read and the table not touched.
 *
 * The loop keeps the table, the entries and the device's group in locals
 * (the table through its own functions, on a copy): stores into the
 * entries then cannot force them to be reloaded. They are written back
 * before a new device takes the slow path, and at the end. */
static inline __attribute__((always_inline)) int add_run(dp_ptrset_t *s, const int raw, dp_tensor_t *const *st,
                                                          const dp_ptr_info_t *items, const uint64_t *h, uint64_t again,
                                                          int n, size_t *indices, dp_error_t *err) {
  dp__table_t tab = s->tab;
  void **bases = s->bases;
  dp__pentry_t *rest = s->rest;
  uint32_t *next_on = s->next_on;
  size_t count = s->count, id = 0, g = s->last_group;
  /* the device that takes the fast path: the last insert's (none: 0x10000) */
  uint32_t gdev = g < s->ngroups ? dp__dev_bits(s->groups[g].device) : 0x10000u;
  uint32_t gcount = 0, gtail = 0;
  int chained = s->ngroups > 1;
  if (gdev != 0x10000u) {
    gcount = s->groups[g].count;
    gtail = s->groups[g].tail;
  }
  if (!raw && !tab.nslots) __builtin_unreachable();  /* reserved */
  int rc = 0;
  for (int i = 0; i < n; i++) {
    if (st && (again >> i & 1)) { /* the entry of the tensor before (its base and device) */
      dp__pentry_again(&rest[id], st[i]->snbytes);
      continue;
    }
    void *base = st ? st[i]->sbase : items[i].base;
    dp_device_t device = st ? st[i]->sdevice : items[i].device;
    size_t nbytes = st ? st[i]->snbytes : items[i].nbytes;
    dp__pkey_t key = {base, device};
    size_t j = 0, at;
    if (raw) /* the last entry, when this is it again (dp__ptrset_raw_last, on the locals) */
      at = count && bases[count - 1] == base && dp__dev_bits(rest[count - 1].device) == dp__dev_bits(device)
               ? count - 1
               : DP_TABLE_NONE;
    else
      at = dp__table_find(&tab, DP_TABLE_TAGGED, h[i], dp__ptrset_eq, s, &key, &j);
    if (at != DP_TABLE_NONE) {
      dp__pentry_t *e = &rest[at];
      dp__refs_inc(&e->refs);
      if (nbytes > e->nbytes) e->nbytes = nbytes;
      id = at;
    } else if (DP_UNLIKELY(dp__dev_bits(device) != gdev)) {
      s->tab = tab;
      s->count = count;
      if (gdev != 0x10000u) {
        s->groups[g].count = gcount;
        s->groups[g].tail = gtail;
      }
      if ((rc = dp__ptrset_insert_new(s, device, base, nbytes, raw ? 0 : h[i], j, &id, err)) != 0) return rc;
      tab = s->tab;
      bases = s->bases;
      rest = s->rest;
      next_on = s->next_on;
      count = s->count;
      g = s->last_group;
      gdev = dp__dev_bits(s->groups[g].device);
      gcount = s->groups[g].count;
      gtail = s->groups[g].tail;
      chained = s->ngroups > 1;
    } else {
      DP__PENTRY_PUSH(raw, id, bases, rest, next_on, count, &tab, g, gcount, gtail, chained, device, base, nbytes, raw ? 0 : h[i], j);
    }
    if (indices) indices[i] = id;
  }
  s->tab = tab;
  s->count = count;
  if (gdev != 0x10000u) {
    s->groups[g].count = gcount;
    s->groups[g].tail = gtail;
  }
  return rc;
}

int dp__ptrset_add_batch(dp_ptrset_t *s, dp_tensor_t *const *st, const uint64_t *h, uint64_t again, int n,
                         dp_error_t *err) {
  return s->raw ? add_run(s, 1, st, NULL, h, again, n, NULL, err) : add_run(s, 0, st, NULL, h, again, n, NULL, err);
}

int dp_ptrset_add(dp_ptrset_t *set, dp_device_t device, void *base, size_t nbytes, size_t *index,
                  dp_error_t *err) {
  if (!set) return dp__err(err, DP_EINVAL, "dp_ptrset_add: NULL set");
  if (!device_ok(device))
    return dp__err(err, DP_EINVAL, "dp_ptrset_add: invalid device (type %u, index %u)", device.type, device.index);
  size_t i;
  int is_new;
  int rc = dp__ptrset_add_hashed(set, device, base, nbytes, dp__ptr_hash(device, base), &i, &is_new, err);
  if (rc) return rc;
  if (index) *index = i;
  return 0;
}

int dp_ptrset_add_many(dp_ptrset_t *set, const dp_ptr_info_t *items, size_t n, size_t *indices, dp_error_t *err) {
  if (!set) return dp__err(err, DP_EINVAL, "dp_ptrset_add_many: NULL set");
  if (!n) return 0;
  if (!items) return dp__err(err, DP_EINVAL, "dp_ptrset_add_many: NULL items");
  for (size_t i = 0; i < n; i++)
    if (!device_ok(items[i].device))
      return dp__err(err, DP_EINVAL, "dp_ptrset_add_many: item %zu: invalid device (type %u, index %u)", i,
                     items[i].device.type, items[i].device.index);
  int rc = dp__ptrset_reserve(set, n);
  if (rc == DP_ELIMIT) return too_many(err);
  if (rc) return dp__err(err, rc, "out of memory growing a pointer set");
  if (set->raw) { /* appended: no hashes */
    enum { CHUNK = 1 << 20 };
    for (size_t at = 0; at < n; at += CHUNK) {
      int m = n - at < CHUNK ? (int)(n - at) : CHUNK;
      if ((rc = indices ? add_run(set, 1, NULL, items + at, NULL, 0, m, indices + at, err)
                        : add_run(set, 1, NULL, items + at, NULL, 0, m, NULL, err)) != 0)
        return rc;
    }
    return 0;
  }
  /* In runs of RUN: the hashes (the key derived once per device), each
   * slot fetched ahead, then the inserts, in order. */
  enum { RUN = 16 };
  uint64_t h[RUN], key = 0;
  uint16_t key_dev = 0;
  int have_key = 0;
  for (size_t at = 0; at < n; at += RUN) {
    int m = n - at < RUN ? (int)(n - at) : RUN;
    for (int i = 0; i < m; i++) {
      dp_device_t d = items[at + i].device;
      if (!have_key || dp__dev_bits(d) != key_dev) {
        key = dp__ptr_key(d);
        key_dev = dp__dev_bits(d);
        have_key = 1;
      }
      h[i] = dp__ptr_hash_keyed(items[at + i].base, key);
      dp__ptrset_prefetch(set, h[i]);
    }
    if ((rc = indices ? add_run(set, 0, NULL, items + at, h, 0, m, indices + at, err)
                      : add_run(set, 0, NULL, items + at, h, 0, m, NULL, err)) != 0)
      return rc;
  }
  return 0;
}

int dp__ptrset_set_path(dp_ptrset_t *s, size_t index, const char *path) {
  if (dp__grow((void **)&s->paths, &s->paths_cap, index + 1, sizeof *s->paths) != 0) return DP_ENOMEM;
  char *p = dp__arena_strdup(&s->paths_arena, path, strlen(path));
  if (!p) return DP_ENOMEM;
  while (s->npaths < index) s->paths[s->npaths++] = NULL;
  s->paths[index] = p;
  if (s->npaths == index) s->npaths++;
  return 0;
}

int dp_ptrset_find(const dp_ptrset_t *s, dp_device_t device, const void *base, size_t *index, dp_error_t *err) {
  if (!s) return dp__err(err, DP_EINVAL, "dp_ptrset_find: NULL set");
  dp__pkey_t key = {base, device};
  size_t j, at = dp__table_find(&s->tab, DP_TABLE_TAGGED, dp__ptr_hash(device, base), dp__ptrset_eq, s, &key, &j);
  if (at == DP_TABLE_NONE) {
    char dev[16];
    return dp__err(err, DP_ENOTFOUND, "dp_ptrset_find: %s %p is not in the set", dp_device_format(device, dev, sizeof dev),
                   base);
  }
  if (index) *index = at;
  return 0;
}

size_t dp_ptrset_count(const dp_ptrset_t *s) { return s ? s->count : 0; }

void dp__ptrset_add_refs(dp_ptrset_t *s, size_t i, uint32_t extra) {
  dp__pentry_t *e = &s->rest[i];
  e->refs = extra > UINT32_MAX - e->refs ? UINT32_MAX : e->refs + extra;
}

int dp_ptrset_get(const dp_ptrset_t *s, size_t i, dp_ptr_info_t *out, dp_error_t *err) {
  if (!s || !out) return dp__err(err, DP_EINVAL, "dp_ptrset_get: NULL %s", s ? "out" : "set");
  if (i >= s->count) return dp__err(err, DP_EINVAL, "dp_ptrset_get: index %zu out of range (the set holds %zu)", i, s->count);
  const dp__pentry_t *e = &s->rest[i];
  out->device = e->device;
  out->base = s->bases[i];
  out->nbytes = e->nbytes;
  out->refs = e->refs;
  out->path = i < s->npaths ? s->paths[i] : NULL;
  return 0;
}

size_t dp_ptrset_ndevices(const dp_ptrset_t *s) { return s ? s->ngroups : 0; }

dp_device_t dp_ptrset_device(const dp_ptrset_t *s, size_t j) {
  dp_device_t none = {DP_DEVICE_CPU, 0};
  return (s && j < s->ngroups) ? s->groups[j].device : none;
}

size_t dp_ptrset_device_count(const dp_ptrset_t *s, size_t j) {
  return (s && j < s->ngroups) ? s->groups[j].count : 0;
}

size_t dp_ptrset_first_on(const dp_ptrset_t *s, size_t j) {
  return (s && j < s->ngroups && s->groups[j].count) ? s->groups[j].head : SIZE_MAX;
}

size_t dp_ptrset_next_on(const dp_ptrset_t *s, size_t i) {
  if (!s || i >= s->count) return SIZE_MAX;
  if (s->ngroups == 1) return i + 1 < s->count ? i + 1 : SIZE_MAX;  /* not chained: see DP__PENTRY_PUSH */
  if (s->next_on[i] == 0) return SIZE_MAX;
  return s->next_on[i] - 1;
}

void dp__ptrset_set_raw(dp_ptrset_t *s, int raw) {
  dp_ptrset_clear(s);
  s->raw = raw;
}
