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

#endif
