/* pickler/walk.h — the one walker behind scan and pickle. */
#ifndef DP_PICKLER_WALK_H
#define DP_PICKLER_WALK_H
#include "ptrset_impl.h"
#include "path.h"

/* What a walk reports, for pickle. Scan passes no sink: the walker then only
 * feeds the pointer set. */
typedef struct dp__sink {
  int (*scalar)(void *ctx, dp_value_t v);                 /* none..bytes */
  int (*enter)(void *ctx, dp_value_t v, size_t nchildren); /* containers, customs */
  int (*attr)(void *ctx, const char *name, size_t n);     /* before an attribute value */
  int (*tensor)(void *ctx, dp_value_t t, size_t buffer);  /* buffer = ptrset index */
  int (*backref)(void *ctx, uint64_t index);              /* node met before */
} dp__sink_t;

typedef struct dp__wframe {
  dp_value_t node;
  dp_value_t state;   /* a custom's reduced state */
  size_t i, n;        /* next child, child count */
} dp__wframe_t;

/* The memo's items, in the order first met; its table (table.h) maps a
 * node's address to one. */
typedef struct dp__memo_item {
  const void *key;
  uint64_t index;   /* preorder number */
} dp__memo_item_t;

/* Tensors a scan has met but not yet looked into: the tensor, its storage
 * and its hash slot are fetched for a whole batch at a time, so that the
 * cache misses of up to this many overlap. */
#define DP_WALK_BATCH 32
/* The most tensors a scan stages in place for one container (walk.c): the
 * batch holds that many past DP_WALK_BATCH. */
#define DP_INLINE_MAX 16

typedef struct dp__walker {
  struct dp_tensor *pending[DP_WALK_BATCH + DP_INLINE_MAX];
  int npending;
  int batch;                   /* scan without paths: pipeline inserts */
  dp__wframe_t *stack;
  size_t top, stack_cap;
  dp__table_t memo;            /* node -> memo_items[i]; cleared by generation */
  dp__memo_item_t *memo_items;
  size_t memo_items_cap;
  uint32_t memo_rc;            /* nodes whose count exceeds this enter the memo:
                                  1 until the walk's first reduce(), then 0 */
  dp_value_t root;             /* the walk's root, for the replay (walk.c) */
  dp__wframe_t *rstack;        /* the replay's stack */
  size_t rstack_cap;
  dp_value_t *states;          /* reduce states held until the walk ends */
  size_t nstates, states_cap;
  uint64_t next_index;         /* preorder number of the next heap node */
  uint32_t max_depth;
  int busy;                    /* a scan is running on it (dp_scan: a reduce() may call back in) */
  int want_paths;
  dp_ptrset_t *set;
  const dp__sink_t *sink;
  void *sink_ctx;
  dp_error_t *err;
  char path[DP_PATH_MAX + 1];  /* the last path rendered (bounded: ptrset.h) */
} dp__walker_t;

void dp__walker_init(dp__walker_t *w);
void dp__walker_destroy(dp__walker_t *w);
/* Sets a walker up for one walk — the one place its settings are made:
 * entries go to set; sink NULL is a scan (which then batches its inserts
 * unless it records paths), else a pickle; max_depth 0 means
 * DP_DEFAULT_MAX_DEPTH; errors go to err. */
void dp__walker_setup(dp__walker_t *w, dp_ptrset_t *set, const dp__sink_t *sink, void *sink_ctx,
                      uint32_t max_depth, int want_paths, dp_error_t *err);
/* Walks root. A scan releases the reduce states it made before returning;
 * a pickle (a walk with a sink) keeps them, since a state may hold the only
 * reference to a storage whose bytes an inline frame copies after the walk:
 * its caller releases them with dp__walker_release_states once done. */
int dp__walk(dp__walker_t *w, dp_value_t root);
void dp__walker_release_states(dp__walker_t *w);
/* Renders the path of the node being visited into w->path, bounded as
 * ptrset.h states, at a cost bounded by its length; returns it. */
const char *dp__walker_path(dp__walker_t *w);
#endif
