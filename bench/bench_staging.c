/* bench/bench_staging.c — the transport's staging path on one GPU: a value
 * of one 1 GiB cuda:0 buffer sent between two processes on this machine
 * (device -> page-locked slot -> UCX -> slot -> device, in 4 MiB chunks),
 * against the copies it is made of, measured in the same run: one
 * cudaMemcpy of 1 GiB device -> page-locked host, then host -> device.
 * Usage: bench_staging OUT.json. Without a usable GPU it says so and writes
 * nothing. UCX's transports: UCX_TLS as given (default here: tcp on lo and
 * shared memory, as the tests use).
 *
 * transport_staged_1GiB: MiB/s from the send call until the receiver has
 *   synchronized the value's events and answered (best of 3); ratio over
 *   1 GiB / (time of the D2H copy + time of the H2D copy) (higher is better). */
#define _DEFAULT_SOURCE
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "devpickle.h"
#ifdef DP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define SEC 1000000000ll
#define SIZE ((size_t)1 << 30)
#define ROUNDS 3

static void die(const char *what, const dp_error_t *e) {
  fprintf(stderr, "bench_staging: %s: %s\n", what, e ? e->message : "");
  exit(1);
}

/* The receiver: each value is received on cuda:0, synchronized, and
 * answered with an int; none ends it. Port -1: no GPU. */
static void receiver(int wfd) {
  dp_error_t e;
  dp_backend_t *b;
  int port = -1;
  if (dp_backend_get(DP_DEVICE_CUDA, &b, &e)) {
    if (write(wfd, &port, sizeof port) != sizeof port) _exit(2);
    _exit(0);
  }
  dp_transport_opts_t o = {0};
  o.backend = b;
  dp_transport_t *t;
  dp_listener_t *l;
  dp_endpoint_t *ep;
  if (dp_transport_new(&o, &t, &e) || dp_listener_new(t, "127.0.0.1:0", &l, &e)) die("receiver", &e);
  port = dp_listener_port(l);
  if (write(wfd, &port, sizeof port) != sizeof port) _exit(2);
  if (dp_listener_accept(l, 60 * SEC, &ep, &e)) die("accept", &e);
  for (int64_t n = 0;; n++) {
    dp_future_t *f, *d;
    if (dp_endpoint_recv(ep, &f, &e) || dp_future_wait(f, 120 * SEC, &e) || dp_future_synchronize(f, 120 * SEC, &e))
      die("receive", &e);
    int none = dp_value_kind(dp_future_value(f)) == DP_NONE;
    dp_future_release(f);
    if (none) break;
    if (dp_endpoint_send(ep, dp_int(n), &d, &e)) die("answer", &e);
    dp_future_release(d);
  }
  dp_endpoint_free(ep);
  dp_listener_free(l);
  dp_transport_free(t);
  dp_shutdown();
  _exit(0);
}

int main(int argc, char **argv) {
  const char *out = bench_out(argc, argv);
  setenv("UCX_TLS", "tcp,posix,sysv,self", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  signal(SIGPIPE, SIG_IGN);
#ifndef DP_HAVE_CUDA
  (void)out;
  (void)receiver;
  printf("bench_staging: built without CUDA: skipped\n");
  return 0;
#else
  pid_t pid;
  int port = bench_spawn(receiver, &pid); /* before this process touches CUDA */
  if (port < 0) {
    waitpid(pid, NULL, 0);
    printf("bench_staging: no usable GPU: skipped\n");
    return 0;
  }
  dp_error_t e;
  dp_backend_t *b;
  if (dp_backend_get(DP_DEVICE_CUDA, &b, &e)) die("cuda", &e);
  dp_transport_opts_t o = {0};
  o.backend = b;
  dp_transport_t *t;
  dp_endpoint_t *ep;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  if (dp_transport_new(&o, &t, &e) || dp_endpoint_connect(t, addr, &ep, &e)) die("connect", &e);
  dp_device_t g0 = {DP_DEVICE_CUDA, 0};
  void *mem, *mem2, *pinned;
  if (dp_device_alloc(b, g0, SIZE, &mem, &e) || dp_device_alloc(b, g0, SIZE, &mem2, &e)) die("alloc", &e);
  if (cudaHostAlloc(&pinned, SIZE, cudaHostAllocPortable) != cudaSuccess) die("cudaHostAlloc", NULL);
  cudaMemset(mem, 1, SIZE);
  cudaDeviceSynchronize();
  dp_storage_t *st;
  dp_value_t v;
  int64_t shape[1] = {(int64_t)SIZE};
  if (dp_storage_new(g0, mem, SIZE, NULL, NULL, &st, &e) || dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &v, &e))
    die("tensor", &e);
  double ours = 0, base = 0;
  for (int r = 0; r < ROUNDS + 1; r++) { /* round 0 warms both up */
    dp_future_t *d, *a;
    double t0 = bench_now();
    if (dp_endpoint_send(ep, v, &d, &e) || dp_endpoint_recv(ep, &a, &e) || dp_future_wait(a, 120 * SEC, &e))
      die("round trip", &e);
    double dt = bench_now() - t0;
    dp_future_wait(d, 60 * SEC, NULL);
    dp_future_release(d);
    dp_future_release(a);
    t0 = bench_now();
    cudaMemcpy(pinned, mem, SIZE, cudaMemcpyDeviceToHost);
    double d2h = bench_now() - t0;
    t0 = bench_now();
    cudaMemcpy(mem2, pinned, SIZE, cudaMemcpyHostToDevice);
    double h2d = bench_now() - t0;
    if (!r) continue;
    double mibs = (double)SIZE / dt / (1 << 20), bmibs = (double)SIZE / (d2h + h2d) / (1 << 20);
    printf("round %d: staged %.0f MiB/s, copies %.0f MiB/s (D2H %.1f ms, H2D %.1f ms)\n", r, mibs, bmibs, d2h * 1e3,
           h2d * 1e3);
    if (mibs > ours) ours = mibs;
    if (bmibs > base) base = bmibs;
  }
  dp_future_t *d;
  if (dp_endpoint_send(ep, dp_none(), &d, &e)) die("end", &e);
  dp_future_wait(d, 10 * SEC, NULL);
  dp_future_release(d);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  waitpid(pid, NULL, 0);
  dp_value_release(v);
  dp_device_dealloc(b, g0, mem, NULL);
  dp_device_dealloc(b, g0, mem2, NULL);
  cudaFreeHost(pinned);
  bench_row(out, "transport_staged_1GiB", "cuda", ours, "MiB/s", base > 0 ? ours / base : 0,
            "D2H + H2D cudaMemcpy of 1 GiB through page-locked memory, same run (higher is better)");
  dp_shutdown();
  return 0;
#endif
}
