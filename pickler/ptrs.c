/* pickler/ptrs.c — freezing a pointer set (ptrs.h). */
#include <stddef.h>
#include <string.h>

#include "ptrs.h"
#include "ptrset_impl.h"

static size_t align_up(size_t n) {
  size_t a = _Alignof(max_align_t);
  return (n + a - 1) / a * a;
}

int dp__ptrs_freeze(dp__ptrs_t *out, const dp_ptrset_t *set, size_t extra, dp_error_t *err) {
  memset(out, 0, sizeof *out);
  size_t n = set->count, ng = set->ngroups, grouped = ng > 1 ? n : 0;
  /* Bounded by memory the set already holds: no overflow before extra. */
  size_t head = align_up(n * (sizeof(void *) + sizeof(dp__ptrs_rest_t)) + grouped * sizeof(void *) +
                         ng * sizeof(dp__ptrs_dev_t));
  size_t size;
  if (dp__add_ovf(head, extra, &size) || (size && !(out->block = dp__alloc(size))))
    return dp__err(err, DP_ENOMEM, "out of memory freezing %zu allocations", n);
  out->block_size = size;
  out->bases = out->block;
  out->rest = (dp__ptrs_rest_t *)(out->bases + n);
  out->by_dev = ng > 1 ? (void **)(out->rest + n) : out->bases;
  out->devs = (dp__ptrs_dev_t *)((void **)(out->rest + n) + grouped);
  out->extra = extra ? (char *)out->block + head : NULL;
  out->n = n;
  out->ndevs = ng;
  const dp__pentry_t *en = set->entries;
  for (size_t i = 0; i < n; i++) {
    out->bases[i] = en[i].base;
    out->rest[i] = (dp__ptrs_rest_t){en[i].nbytes, en[i].refs, en[i].device};
  }
  size_t pos = 0;
  for (size_t g = 0; g < ng; g++) {
    out->devs[g] = (dp__ptrs_dev_t){set->groups[g].device, pos, set->groups[g].count};
    if (ng == 1) pos = n;  /* one device: by_dev is bases */
    else
      for (uint32_t i = set->groups[g].head + 1; i; i = en[i - 1].next_on) out->by_dev[pos++] = en[i - 1].base;
  }
  return 0;
}

void dp__ptrs_free(dp__ptrs_t *p) {
  if (p->block) dp__free(p->block, p->block_size);
  memset(p, 0, sizeof *p);
}
