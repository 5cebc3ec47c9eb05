/* future/internal.h — what the future offers the layer above it besides
 * its public API (future.h). */
#ifndef DP_FUTURE_INTERNAL_H
#define DP_FUTURE_INTERNAL_H

/* The future's part of dp_shutdown (devpickle.h): frees the calling
 * thread's scratch pointer set (unless it is in use further up the stack)
 * and the record blocks it kept (pickler/ptrs.h)
 * (other threads' are freed at their exit, by a thread-specific destructor). */
void dp__future_shutdown(void);

/* 1 when a completion of f may hold memory on device d (cpu, or a device
 * of f's backend that f's devices name, any of them when none are named),
 * else 0: the completion would fail with DP_EDEVICE. f's devices never
 * change: any thread may ask. */
int dp__future_accepts(const dp_future_t *f, dp_device_t d);

/* 1 while this thread runs a future's callbacks (then(), collect_all's,
 * dp__future_notify's), frees futures whose last reference went, or walks
 * the value that completes one: those frames hold futures, their pooled
 * events and the streams a callback runs on, so dp_shutdown refuses to
 * tear the backends down under them. */
int dp__future_running(void);

/* Calls fn(ctx, f, 0) once f completes, with a value or an error (on the
 * thread that completes it; here, at once, when f is complete already), or
 * fn(ctx, NULL, 0) when f's last reference goes while it is pending; then,
 * either way, drop(ctx) (drop may be NULL). fn must not call back into f's
 * completion (it runs on f's trampoline, as collect_all's inputs do). 0, or
 * DP_ENOMEM (nothing registered, neither called). */
int dp__future_notify(dp_future_t *f, void (*fn)(void *ctx, dp_future_t *f, size_t index), void (*drop)(void *ctx),
                      void *ctx);

/* A loop of a layer above — the transport's progress loop — that alone
 * completes the futures marked with it, on the threads that run it (its
 * progress thread, or a caller's pass). While a thread runs the loop
 * (between enter and leave; frames nest, and fr stays on the caller's
 * stack until leave), a wait there on a pending future marked with it, or
 * on one that waits for such a future through then() parents and
 * collect_all inputs, would wait forever: it is DP_EMISUSE at once
 * (future.h, WAITING FOR ONE'S OWN LOOP). set_loop marks f before it is
 * shared; loop only names the loop (it is never read). */
typedef struct dp__future_loop_frame {
  const void *loop;
  struct dp__future_loop_frame *outer;
} dp__future_loop_frame_t;
void dp__future_set_loop(dp_future_t *f, const void *loop);
void dp__future_loop_enter(dp__future_loop_frame_t *fr, const void *loop);
void dp__future_loop_leave(dp__future_loop_frame_t *fr);

/* Tests: the sleeps dp_future_wait has begun on a future's condition
 * variable, in every thread (a limit of 0, or one its spin spent, begins
 * none). */
extern _Atomic uint64_t dp__future_sleeps;
/* Tests: sets f's reference count (to try the bound a retain checks). */
void dp__future_set_refs(dp_future_t *f, uint32_t refs);

#endif
