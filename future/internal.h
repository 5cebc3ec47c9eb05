/* future/internal.h — what the future offers the layer above it besides
 * its public API (future.h). */
#ifndef DP_FUTURE_INTERNAL_H
#define DP_FUTURE_INTERNAL_H

/* The future's part of dp_shutdown (devpickle.h): frees the calling
 * thread's scratch pointer set (unless it is in use further up the stack)
 * and the record blocks it kept (pickler/ptrs.h)
 * (other threads' are freed at their exit, by a thread-specific destructor). */
void dp__future_shutdown(void);

#endif
