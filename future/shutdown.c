/* future/shutdown.c — dp_shutdown (devpickle.h): the one teardown order.
 *
 * It lives in the top layer because only the top layer may call every
 * layer below it: each layer frees its own process-wide state in its own
 * function, and nothing below calls up. Top layer first, so that whatever
 * a layer frees may still use the layers under it: the futures' scratch
 * sets, then the default caches (which give their segments back to the
 * backends and wait on streams), then the backends. */
#include <stdio.h>

#include "devpickle.h"  /* dp_shutdown */
#include "../cache/internal.h"
#include "../device/internal.h"
#include "internal.h"

void dp_shutdown(void) {
  /* A host function (dp_host_launch) runs on a worker the backend joins
   * when it stops, after the queued work, this function's included: the
   * teardown would wait for itself. Refused as dp_stream_free of a host
   * function's own stream is (device.h). */
  if (dp__host_fn_stream) {
    fprintf(stderr, "devpickle: dp_shutdown called from a host function: nothing torn down (device.h)\n");
    return;
  }
  /* The frames running a future's callbacks, frees or completion walk on
   * this thread hold futures (their pooled events) and put pool streams
   * back as current when they return: the teardown would free them under
   * those frames. */
  if (dp__future_running()) {
    fprintf(stderr,
            "devpickle: dp_shutdown called while a future's callback, completion or release runs on this thread: "
            "nothing torn down (future.h)\n");
    return;
  }
  dp__future_shutdown();
  dp__cache_shutdown();
  dp__device_shutdown();
}
