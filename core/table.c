/* core/table.c — the table's slow paths: growth, deletion, statistics. */
#include "table.h"

int dp__table_grow(dp__table_t *t, int kind, size_t nitems, size_t min_slots, dp__table_hash_fn hash_at,
                   const void *ctx) {
  if (nitems >= UINT32_MAX - 1) return DP_ELIMIT;
  /* doubled from 4, not started at min_slots: the size stays a power of
   * two (the probe mask) whatever min_slots is */
  size_t n = 4, ssize = dp__table_slot_size(kind);
  while (n < min_slots || n < (nitems + 1) * 2) {
    if (n > SIZE_MAX / 2 / ssize) return DP_ENOMEM;
    n *= 2;
  }
  void *slots = dp__alloc_array(n, ssize);
  if (!slots) return DP_ENOMEM;
  memset(slots, 0, n * ssize);
  dp__table_destroy(t, kind);
  t->slots = slots;
  t->nslots = n;
  t->gen = 1;
  t->count = 0;
  for (size_t i = 0; i < nitems; i++) {
    uint64_t h = hash_at(ctx, i);
    dp__table_put(t, kind, dp__table_empty_slot(t, kind, h), h, i);
  }
  return 0;
}

static void set_ref(dp__table_t *t, int kind, size_t j, uint32_t ref, const dp__tslot_t *from) {
  if (kind == DP_TABLE_TAGGED) {
    dp__tslot_t *s = (dp__tslot_t *)t->slots + j;
    if (from)
      *s = *from;
    else
      s->ref = ref;
  } else {
    ((uint32_t *)t->slots)[j] = ref;
  }
}

void dp__table_remove(dp__table_t *t, int kind, size_t j, dp__table_hash_fn hash_at, const void *ctx) {
  size_t mask = t->nslots - 1;
  set_ref(t, kind, j, 0, NULL);
  t->count--;
  /* Pull back each following item of the run whose home is not between the
   * hole and its slot, so that no lookup stops at the hole too early. */
  for (size_t k = (j + 1) & mask;; k = (k + 1) & mask) {
    uint32_t ref = dp__table_ref(t, kind, k);
    if (ref == 0) return;
    size_t home = hash_at(ctx, ref - 1) & mask;
    if (((k - home) & mask) >= ((k - j) & mask)) {
      if (kind == DP_TABLE_TAGGED)
        set_ref(t, kind, j, 0, (const dp__tslot_t *)t->slots + k);
      else
        set_ref(t, kind, j, ref, NULL);
      set_ref(t, kind, k, 0, NULL);
      j = k;
    }
  }
}

void dp__table_move(dp__table_t *t, int kind, uint64_t h, size_t from, size_t to) {
  size_t mask = t->nslots - 1;
  for (size_t j = h & mask;; j = (j + 1) & mask) {
    uint32_t ref = dp__table_ref(t, kind, j);
    if (ref == 0) return;  /* not there: nothing to do */
    if (ref == from + 1) {
      set_ref(t, kind, j, (uint32_t)(to + 1), NULL);
      return;
    }
  }
}

void dp__table_destroy(dp__table_t *t, int kind) {
  dp__free(t->slots, t->nslots * dp__table_slot_size(kind));
  t->slots = NULL;
  t->nslots = 0;
  t->count = 0;
}

size_t dp__table_probes(const dp__table_t *t, int kind, dp__table_hash_fn hash_at, const void *ctx) {
  size_t total = 0, mask = t->nslots - 1;
  for (size_t j = 0; j < t->nslots; j++) {
    uint32_t ref = dp__table_ref(t, kind, j);
    if (ref) total += ((j - (hash_at(ctx, ref - 1) & mask)) & mask) + 1;
  }
  return total;
}
