/* test/stress/transport_stress.c — the transport's threads under
 * ThreadSanitizer (Criterion cannot start under TSan): two transports in one
 * process over UCX (tcp on lo and shared memory), values with buffers sent
 * from two threads at once and received on a third, a future's value sent
 * after its host-stream work, an endpoint closed with sends pending, a
 * refused connection; the same with progress driven by the callers' threads
 * (DP_TRANSPORT_PROGRESS_CALLER: three threads run passes at once). Prints "N passed, M failed"; exit status 1 on failure. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "devpickle.h"
#include "check.h"

#define SEC 1000000000ll
#define PER_THREAD 300


static void free_cb(void *ud, dp_device_t d, void *base, size_t n) {
  (void)ud, (void)d, (void)n;
  free(base);
}

static dp_value_t tensor(size_t n, int fill) {
  void *p = malloc(n);
  memset(p, fill, n);
  dp_storage_t *s;
  dp_value_t t = dp_none();
  int64_t shape[1] = {(int64_t)n};
  dp_device_t cpu = {DP_DEVICE_CPU, 0};
  if (dp_storage_new(cpu, p, n, free_cb, NULL, &s, NULL) == 0) dp_tensor_new(s, DP_UINT8, 1, shape, NULL, 0, &t, NULL);
  return t;
}

typedef struct sender {
  dp_transport_t *t;
  dp_endpoint_t *ep;
  int id, failed;
} sender_t;

static dp_transport_opts_t opts; /* the scenario's: progress by a thread or the callers */
static int big_frames;           /* values whose frames go by rendezvous (over 64 KiB) */

static void *send_main(void *arg) {
  sender_t *s = arg;
  for (int i = 0; i < PER_THREAD; i++) {
    dp_value_t v;
    dp_tuple_new(2, &v, NULL);
    dp_seq_set(v, 0, dp_int(s->id), NULL);
    dp_seq_set(v, 1, tensor(i % 3 == 0 ? 100000 : 64, i & 0xff), NULL);
    if (big_frames) { /* a frame over 64 KiB (rendezvous) every other value */
      dp_value_t w;
      dp_tuple_new(3, &w, NULL);
      dp_seq_set(w, 0, dp_int(s->id), NULL);
      dp_seq_set(w, 1, dp_value_retain(dp_seq_get(v, 1)), NULL);
      size_t n = i % 2 ? 70000 + i : 100;
      uint8_t *b = malloc(n);
      memset(b, i, n);
      dp_value_t bv;
      dp_bytes_new(b, n, &bv, NULL);
      free(b);
      dp_seq_set(w, 2, bv, NULL);
      dp_value_release(v);
      v = w;
    }
    dp_future_t *d;
    dp_error_t e;
    if (dp_endpoint_send(s->ep, v, &d, &e) || dp_transport_wait(s->t, d, 30 * SEC, &e)) s->failed = 1;
    dp_future_release(d);
    dp_value_release(v);
  }
  return NULL;
}

static int scenario_two_senders_one_receiver(void) {
  dp_transport_t *a, *b;
  dp_listener_t *l;
  dp_endpoint_t *ea, *eb;
  dp_error_t e;
  CHECK(dp_transport_new(&opts, &a, &e) == 0, "%s", e.message);
  CHECK(dp_transport_new(&opts, &b, &e) == 0, "%s", e.message);
  CHECK(dp_listener_new(a, "127.0.0.1:0", &l, &e) == 0, "%s", e.message);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", dp_listener_port(l));
  CHECK(dp_endpoint_connect(b, addr, &eb, &e) == 0, "%s", e.message);
  sender_t s[2] = {{b, eb, 0, 0}, {b, eb, 1, 0}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, send_main, &s[i]);
  CHECK(dp_listener_accept(l, 30 * SEC, &ea, &e) == 0, "%s", e.message);
  int got[2] = {0, 0};
  for (int i = 0; i < 2 * PER_THREAD; i++) {
    dp_future_t *f;
    CHECK(dp_endpoint_recv(ea, &f, &e) == 0 && dp_transport_wait(a, f, 30 * SEC, &e) == 0, "%s", e.message);
    dp_value_t v = dp_future_value(f);
    int id = (int)dp_value_as_int(dp_seq_get(v, 0));
    const uint8_t *p = dp_storage_base(dp_tensor_storage(dp_seq_get(v, 1)));
    CHECK(p[0] == (got[id] & 0xff), "thread %d's values out of order", id);
    got[id]++;
    dp_future_release(f);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  CHECK(!s[0].failed && !s[1].failed, "a send failed");
  /* close with sends pending on the other side's endpoint */
  dp_future_t *d[4];
  for (int i = 0; i < 4; i++) {
    dp_value_t v = tensor(1 << 20, i);
    if (big_frames) {
      dp_value_release(v);
      uint8_t *b = calloc(1, 1 << 20);
      dp_bytes_new(b, 1 << 20, &v, NULL);
      free(b);
    }
    CHECK(dp_endpoint_send(eb, v, &d[i], &e) == 0, "%s", e.message);
    dp_value_release(v);
  }
  dp_endpoint_free(eb);
  for (int i = 0; i < 4; i++) {
    int rc = dp_transport_wait(b, d[i], 30 * SEC, &e);
    CHECK(rc == 0 || rc == DP_ECANCELED, "%s", e.message);
    dp_future_release(d[i]);
  }
  dp_endpoint_free(ea);
  dp_listener_free(l);
  dp_transport_free(a);
  dp_transport_free(b);
  return 0;
}

static int scenario_refused(void) {
  dp_transport_t *t;
  dp_endpoint_t *ep;
  dp_error_t e;
  CHECK(dp_transport_new(NULL, &t, &e) == 0, "%s", e.message);
  CHECK(dp_endpoint_connect(t, "127.0.0.1:1", &ep, &e) == 0, "%s", e.message);
  dp_future_t *r;
  CHECK(dp_endpoint_recv(ep, &r, &e) == 0, "%s", e.message);
  CHECK(dp_future_wait(r, 30 * SEC, &e) == DP_EIO, "%s", e.message);
  dp_future_release(r);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  return 0;
}


int main(void) {
  setenv("UCX_TLS", "tcp,posix,sysv,self", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  run("transport: two senders, one receiver, close with sends pending", scenario_two_senders_one_receiver);
  run("transport: a refused connection", scenario_refused);
  opts.progress = DP_TRANSPORT_PROGRESS_CALLER;
  run("transport, driven by the callers: two senders, one receiver, close with sends pending",
      scenario_two_senders_one_receiver);
  big_frames = 1;
  opts.max_inflight_bytes = 64 << 10;
  opts.progress = 0;
  run("transport: frames over 64 KiB, a 64 KiB bound, a progress thread", scenario_two_senders_one_receiver);
  opts.progress = DP_TRANSPORT_PROGRESS_CALLER;
  run("transport: frames over 64 KiB, a 64 KiB bound, driven by the callers", scenario_two_senders_one_receiver);
  printf("%d passed, %d failed\n", passes, failures);
  return failures ? 1 : 0;
}
