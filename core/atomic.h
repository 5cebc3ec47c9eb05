/* core/atomic.h — the one set of atomic operations the library uses.
 *
 * Rule: a field shared between threads without a lock is declared _Atomic
 * (C11), and every access to it goes through one of these, whose name says
 * its memory order. No __atomic_* builtins on plain fields, no
 * order-less atomic_load()/atomic_store() (seq_cst by default, and silent
 * about why). Reference counts use dp__ref_inc/dp__ref_dec, the one
 * idiom: relaxed increment, acq_rel decrement (the last owner sees every
 * other owner's writes before it frees). */
#ifndef DP_CORE_ATOMIC_H
#define DP_CORE_ATOMIC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define dp__atomic_init(p, v) atomic_init((p), (v))

#define dp__load_relaxed(p) atomic_load_explicit((p), memory_order_relaxed)
#define dp__load_acquire(p) atomic_load_explicit((p), memory_order_acquire)

#define dp__store_relaxed(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define dp__store_release(p, v) atomic_store_explicit((p), (v), memory_order_release)
#define dp__store_seq_cst(p, v) atomic_store_explicit((p), (v), memory_order_seq_cst)

#define dp__fetch_add_relaxed(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define dp__fetch_add_release(p, v) atomic_fetch_add_explicit((p), (v), memory_order_release)
#define dp__fetch_or_acq_rel(p, v) atomic_fetch_or_explicit((p), (v), memory_order_acq_rel)
#define dp__fetch_and_acq_rel(p, v) atomic_fetch_and_explicit((p), (v), memory_order_acq_rel)

/* Strong CAS; on failure *expect receives the value seen (acquire). */
#define dp__cas_acq_rel(p, expect, desired) \
  atomic_compare_exchange_strong_explicit((p), (expect), (desired), memory_order_acq_rel, memory_order_acquire)

#define dp__fence_seq_cst() atomic_thread_fence(memory_order_seq_cst)

/* Reference counts (_Atomic uint32_t). One more reference past UINT32_MAX
 * would wrap the count to 0, and the next release would free what is still
 * held — a use after free far from its cause — so the process stops there
 * instead, naming `what` (a const char *, read only then:
 * dp__ref_overflow, base.c). */
_Noreturn void dp__ref_overflow(const char *what);
#define dp__ref_inc(p, what)                                                                            \
  do {                                                                                                  \
    if (__builtin_expect(atomic_fetch_add_explicit((p), 1, memory_order_relaxed) == UINT32_MAX, 0)) \
      dp__ref_overflow(what);                                                                           \
  } while (0)
/* True when this was the last reference. */
#define dp__ref_dec(p) (atomic_fetch_sub_explicit((p), 1, memory_order_acq_rel) == 1)

/* A spinlock for critical sections of a few instructions. */
typedef atomic_flag dp__spin_t;
static inline bool dp__spin_trylock(dp__spin_t *l) {
  return !atomic_flag_test_and_set_explicit(l, memory_order_acquire);
}
static inline void dp__spin_unlock(dp__spin_t *l) { atomic_flag_clear_explicit(l, memory_order_release); }

#endif
