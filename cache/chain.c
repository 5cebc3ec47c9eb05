/* cache/chain.c — hooks over several allocators (dp_cache_hooks_chain_new):
 * each pointer is recorded with the allocator that owns it.
 *
 * A batch runs down the chain once: every allocator is offered the
 * pointers that the ones before it did not own, and what it owns is taken
 * out before the next. Only a batched call that marks what it owned
 * (record_streams_owned) lets a pointer pass on in one call; an allocator
 * that has only record_stream answers pointer by pointer. */
#include <stdlib.h>
#include <string.h>

#include "devpickle/cache.h"
#include "../core/internal.h"

#define BATCH DP_CACHE_HOOKS_CHAIN_BATCH

struct dp_cache_hooks_chain {
  size_t n;
  size_t cap;  /* hooks allocated (n or more: nested chains' repeats left out) */
  dp_cache_hooks_t hooks[];
};

/* The hooks in the chain are the caller's callbacks (base.h): each runs
 * with an error of its own (clear), and a failure is passed on as one of
 * the library's — a positive return becomes DP_EINVAL, an empty message
 * one naming the hook — so that no caller takes it for success. */
static int hook_rc(int rc, dp_error_t *e, const char *what, dp_error_t *err) {
  if (rc == 0) return 0;
  rc = dp__cb_rc(rc, e, what);
  if (err) *err = *e;
  return rc;
}

/* Offers ptr to h alone: *owned says whether h's allocator owns it. */
static int offer_one(const dp_cache_hooks_t *h, void *ptr, dp_stream_t *s, int *owned, dp_error_t *err) {
  dp_error_t e; /* not owned is no failure: err is written only on one */
  dp_error_clear(&e);
  if (h->record_stream) {
    int rc = h->record_stream(h->ctx, ptr, s, &e);
    *owned = rc != DP_ENOTFOUND;
    return rc == DP_ENOTFOUND ? 0 : hook_rc(rc, &e, "the record_stream hook", err);
  }
  unsigned char o = 0;
  void *one[1] = {ptr};
  int rc = h->record_streams_owned(h->ctx, one, 1, s, &o, &e);
  *owned = o;
  return hook_rc(rc, &e, "the record_streams_owned hook", err);
}

static int chain_record_stream(void *ctx, void *ptr, dp_stream_t *s, dp_error_t *err) {
  const dp_cache_hooks_chain_t *c = ctx;
  if (!c) return dp__err(err, DP_EINVAL, "record_stream: NULL hooks chain");
  for (size_t i = 0; i < c->n; i++) {
    int owned, rc = offer_one(&c->hooks[i], ptr, s, &owned, err);
    if (rc || owned) return rc;
  }
  return dp__err(err, DP_ENOTFOUND, "record_stream(%p): owned by none of the chain's %zu allocators", ptr, c->n);
}

/* Up to BATCH pointers down the chain. marks: NULL, or where to mark the
 * pointers some allocator owned (a chain inside a chain). */
static int chain_chunk(const dp_cache_hooks_chain_t *c, void *const *ptrs, size_t m, dp_stream_t *s,
                       unsigned char *marks, dp_error_t *err) {
  void *rest[BATCH];
  uint16_t at[BATCH];  /* rest[k] is ptrs[at[k]] */
  unsigned char own[BATCH];
  void *const *cur = ptrs;
  size_t ncur = m;
  for (size_t i = 0; i < c->n && ncur; i++) {
    const dp_cache_hooks_t *h = &c->hooks[i];
    int rc = 0;
    dp_error_t e;
    dp_error_clear(&e);
    if (i + 1 == c->n && !marks && h->record_streams)  /* the last: nobody asks what it owned */
      return hook_rc(h->record_streams(h->ctx, cur, ncur, s, &e), &e, "the record_streams hook", err);
    memset(own, 0, ncur);
    if (h->record_streams_owned) {
      rc = hook_rc(h->record_streams_owned(h->ctx, cur, ncur, s, own, &e), &e, "the record_streams_owned hook", err);
    } else {
      for (size_t k = 0; k < ncur && rc == 0; k++) {
        int o;
        rc = offer_one(h, cur[k], s, &o, err);
        own[k] = (unsigned char)o;
      }
    }
    if (rc) return rc;
    /* What is left moves to the front of rest (in place after the first
     * round: k only ever runs ahead of keep). */
    size_t keep = 0;
    for (size_t k = 0; k < ncur; k++) {
      uint16_t orig = cur == ptrs ? (uint16_t)k : at[k];
      if (own[k]) {
        if (marks) marks[orig] = 1;
        continue;
      }
      rest[keep] = cur[k];
      at[keep++] = orig;
    }
    cur = rest;
    ncur = keep;
  }
  return 0;
}

/* fn: the hook called, as its messages name it */
static int chain_batch(const char *fn, void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, unsigned char *marks,
                       dp_error_t *err) {
  const dp_cache_hooks_chain_t *c = ctx;
  if (!c) return dp__err(err, DP_EINVAL, "%s: NULL hooks chain", fn);
  if (n && !ptrs) return dp__err(err, DP_EINVAL, "%s: NULL ptrs with n = %zu", fn, n);
  for (size_t done = 0; done < n; done += BATCH) {
    size_t m = n - done < BATCH ? n - done : BATCH;
    int rc = chain_chunk(c, ptrs + done, m, s, marks ? marks + done : NULL, err);
    if (rc) return rc;
  }
  return 0;
}

static int chain_record_streams(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, dp_error_t *err) {
  return chain_batch("record_streams", ctx, ptrs, n, s, NULL, err);
}

static int chain_record_streams_owned(void *ctx, void *const *ptrs, size_t n, dp_stream_t *s, unsigned char *owned,
                                      dp_error_t *err) {
  if (!ctx) return dp__err(err, DP_EINVAL, "record_streams_owned: NULL hooks chain");
  if (n && !owned) return dp__err(err, DP_EINVAL, "record_streams_owned: NULL owned with n = %zu", n);
  return chain_batch("record_streams_owned", ctx, ptrs, n, s, owned, err);
}

/* The chain whose hooks h are, as dp_cache_hooks_chain_hooks gave them
 * (none of the functions replaced), or NULL. */
static const dp_cache_hooks_chain_t *chain_of(const dp_cache_hooks_t *h) {
  return h->record_stream == chain_record_stream && h->record_streams == chain_record_streams &&
                 h->record_streams_owned == chain_record_streams_owned
             ? h->ctx
             : NULL;
}

/* One hooks of an expanded chain, where it stands, and whether a nested
 * chain brought it. */
typedef struct slot {
  dp_cache_hooks_t h;
  size_t at;
  int nested;
} slot_t;

static int slot_cmp(const void *a, const void *b) {
  const slot_t *x = a, *y = b;
  int d = memcmp(&x->h, &y->h, sizeof x->h); /* four pointers: no padding */
  return d ? d : (x->at > y->at) - (x->at < y->at);
}

/* c->hooks[0 .. *k) holds list spelled out: leaves out each hooks that a
 * nested chain brought and that stands earlier in it, keeping the order
 * of the rest; *k becomes the count kept. */
static int drop_repeats(dp_cache_hooks_chain_t *c, const dp_cache_hooks_t *list, size_t n, size_t *k,
                        dp_error_t *err) {
  size_t total = *k, bytes;
  slot_t *sl = NULL;
  if (!dp__mul_ovf(total, sizeof *sl + 1, &bytes)) sl = dp__alloc(bytes);
  if (!sl)
    return dp__err(err, DP_ENOMEM, "dp_cache_hooks_chain_new: out of memory finding the repeats among %zu hooks",
                   total);
  unsigned char *gone = (unsigned char *)(sl + total);
  for (size_t i = 0, at = 0; i < n; i++) {
    const dp_cache_hooks_chain_t *in = chain_of(&list[i]);
    for (size_t j = 0, m = in ? in->n : 1; j < m; j++, at++) sl[at] = (slot_t){c->hooks[at], at, in != NULL};
  }
  qsort(sl, total, sizeof *sl, slot_cmp);
  /* equal hooks sort together, in list order: the first stays, a later
     one goes if a nested chain brought it */
  memset(gone, 0, total);
  for (size_t i = 1; i < total; i++)
    if (sl[i].nested && memcmp(&sl[i].h, &sl[i - 1].h, sizeof sl[i].h) == 0) gone[sl[i].at] = 1;
  size_t w = 0;
  for (size_t i = 0; i < total; i++)
    if (!gone[i]) c->hooks[w++] = c->hooks[i];
  dp__free(sl, bytes);
  *k = w;
  return 0;
}

/* A chain given another chain's hooks takes that chain's allocators in
 * their place, in order: the same pointers go to the same allocators, and
 * chains nested any number of times deep record through one level, not
 * one stack frame (of DP_CACHE_HOOKS_CHAIN_BATCH entries of scratch) a
 * level, which overflowed the stack a few thousand levels down. */
int dp_cache_hooks_chain_new(const dp_cache_hooks_t *list, size_t n, dp_cache_hooks_chain_t **out, dp_error_t *err) {
  if (!list || !out) return dp__err(err, DP_EINVAL, "dp_cache_hooks_chain_new: NULL %s", !list ? "list" : "out");
  if (n == 0) return dp__err(err, DP_EINVAL, "dp_cache_hooks_chain_new: an empty chain");
  size_t total = 0;
  for (size_t i = 0; i < n; i++) {
    if (!list[i].record_stream && !list[i].record_streams_owned)
      return dp__err(err, DP_EINVAL,
                     "dp_cache_hooks_chain_new: hooks %zu has neither record_stream nor record_streams_owned, "
                     "so it cannot say which pointers are its allocator's", i);
    const dp_cache_hooks_chain_t *in = chain_of(&list[i]);
    if (dp__add_ovf(total, in ? in->n : 1, &total))
      return dp__err(err, DP_ENOMEM,
                     "dp_cache_hooks_chain_new: the %zu hooks, nested chains' included, are too many to count", n);
  }
  size_t bytes;
  if (dp__mul_ovf(total, sizeof(dp_cache_hooks_t), &bytes) ||
      dp__add_ovf(bytes, sizeof(dp_cache_hooks_chain_t), &bytes))
    return dp__err(err, DP_ENOMEM, "dp_cache_hooks_chain_new: a chain of %zu hooks does not fit in memory", total);
  dp_cache_hooks_chain_t *c = dp__alloc(bytes);
  if (!c)
    return dp__err(err, DP_ENOMEM, "dp_cache_hooks_chain_new: out of memory creating a chain of %zu hooks", total);
  c->cap = total;
  /* Every hooks in place, nested chains' spelled out; a nested chain's
   * hooks met before are then left out (it owned none of the pointers that
   * reach it again: chains of chains given twice each, a tree, would
   * otherwise double at each level). Met before is found by sorting, not
   * by looking back along the list, which took time quadratic in a nested
   * chain's length. */
  size_t k = 0, nested = 0;
  for (size_t i = 0; i < n; i++) {
    const dp_cache_hooks_chain_t *in = chain_of(&list[i]);
    if (!in) {
      c->hooks[k++] = list[i];
      continue;
    }
    memcpy(c->hooks + k, in->hooks, in->n * sizeof in->hooks[0]);
    k += in->n;
    nested = 1;
  }
  if (nested && drop_repeats(c, list, n, &k, err)) {
    dp_cache_hooks_chain_free(c);
    return err ? err->code : DP_ENOMEM;
  }
  c->n = k;
  *out = c;
  return 0;
}

void dp_cache_hooks_chain_free(dp_cache_hooks_chain_t *c) {
  if (c) dp__free(c, sizeof *c + c->cap * sizeof c->hooks[0]);
}

dp_cache_hooks_t dp_cache_hooks_chain_hooks(dp_cache_hooks_chain_t *c) {
  dp_cache_hooks_t h = {c, chain_record_stream, chain_record_streams, chain_record_streams_owned};
  return h;
}
