/* cache/internal.h — what the caching allocator offers the layers above
 * besides its public API (cache.h). */
#ifndef DP_CACHE_INTERNAL_H
#define DP_CACHE_INTERNAL_H

#include "devpickle/cache.h"

/* The cache layer's part of dp_shutdown (devpickle.h): frees the backends'
 * default allocators (dp_cache_default). Caches from dp_cache_new are the
 * caller's and must be freed before. */
void dp__cache_shutdown(void);

/* The backend c allocates on. */
dp_backend_t *dp__cache_backend(const dp_cache_t *c);

/* For tests: checks that c's books agree with each other — every use a
 * block holds is in its stream's list at the place the use names and back,
 * every block in use or pending on a stream is in that stream's tied list
 * once and no other block is, and the counts match; every block in use is
 * mapped with its stream and on its segment's one stream, if it has one;
 * free blocks hold no use or event, sit in a set that exists and have
 * merged with free neighbours of their stream; the pending list holds the
 * pending blocks; the statistics' allocated and pending counts are the
 * blocks'. 0, or a description of the first disagreement (static storage).
 * Takes c's lock; O(blocks). */
const char *dp__cache_check(dp_cache_t *c);

#endif
