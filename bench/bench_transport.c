/* bench/bench_transport.c — the transport between two processes on this
 * machine, against ucx_perftest (Debian's ucx-utils) run in the same run,
 * with the same UCX environment (UCX_TLS, UCX_NET_DEVICES; set here to
 * tcp on lo and shared memory unless given).
 * Usage: bench_transport OUT.json
 *
 * Ours and ucx_perftest's alternate, three rounds each; each figure is the
 * best of its rounds.
 *
 * transport_bw_64MiB: MiB/s sending values of one 64 MiB host:0 buffer back
 *   to back (20 of them, timed until the receiver has all); ratio over
 *   ucx_perftest -t ucp_am_bw -s 64MiB (the same unit: MB there is MiB).
 * transport_lat_frame: one-way latency (half a round trip) of a value whose
 *   frame is under 256 bytes, sent and echoed; ratio over ucx_perftest -t
 *   ucp_am_lat -s 256 (lower is better).
 * transport_lat_frame_caller: the same with both transports driven by the
 *   caller (DP_TRANSPORT_PROGRESS_CALLER, waits by dp_transport_wait), as
 *   ucx_perftest drives its worker.
 *
 * BENCH_TRANSPORT_PROFILE=thread or =caller: only that latency loop, for
 * LOOPS rounds (default 20), printed and not written (for perf record). */
#define _DEFAULT_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "devpickle.h"

#define SEC 1000000000ll
#define BW_SIZE ((size_t)64 << 20)
#define BW_COUNT 20
#define LAT_ITERS 20000

static void env(void) {
  setenv("UCX_TLS", "tcp,posix,sysv,self", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  setenv("DEVPICKLE_BACKEND", "host", 1); /* the transports move host:0 memory */
  signal(SIGPIPE, SIG_IGN);
}

static void die(const char *what, const dp_error_t *e) {
  fprintf(stderr, "bench_transport: %s: %s\n", what, e ? e->message : "");
  exit(1);
}

/* the next transport made: driven by the caller */
static int g_caller;

static dp_transport_t *new_transport(void) {
  dp_transport_opts_t o = {0};
  o.progress = g_caller ? DP_TRANSPORT_PROGRESS_CALLER : DP_TRANSPORT_PROGRESS_THREAD;
  dp_transport_t *t;
  dp_error_t e;
  if (dp_transport_new(&o, &t, &e)) die("transport", &e);
  return t;
}

/* The peer: tensors are counted and dropped; an int asks for the count;
 * anything else is echoed; none ends it. */
static void peer(int wfd) {
  dp_transport_t *t = new_transport();
  dp_listener_t *l;
  dp_endpoint_t *ep;
  dp_error_t e;
  if ( dp_listener_new(t, "127.0.0.1:0", &l, &e)) die("peer", &e);
  int port = dp_listener_port(l);
  if (write(wfd, &port, sizeof port) != sizeof port) _exit(2);
  if (dp_listener_accept(l, 60 * SEC, &ep, &e)) die("accept", &e);
  int64_t count = 0;
  for (;;) {
    dp_future_t *f, *d = NULL;
    if (dp_endpoint_recv(ep, &f, &e) || dp_transport_wait(t, f, 120 * SEC, &e)) die("peer recv", &e);
    dp_value_t v = dp_future_value(f);
    int rc = 0;
    if (dp_value_kind(v) == DP_NONE) {
      dp_future_release(f);
      break;
    }
    if (dp_value_kind(v) == DP_TENSOR) count++;
    else if (dp_value_kind(v) == DP_INT) rc = dp_endpoint_send(ep, dp_int(count), &d, &e);
    else rc = dp_endpoint_send(ep, v, &d, &e);
    if (rc) die("peer send", &e);
    dp_future_release(d);
    dp_future_release(f);
  }
  dp_endpoint_free(ep);
  dp_listener_free(l);
  dp_transport_free(t);
  _exit(0);
}

static dp_value_t recv_one(dp_transport_t *t, dp_endpoint_t *ep) {
  dp_future_t *f;
  dp_error_t e;
  if (dp_endpoint_recv(ep, &f, &e) || dp_transport_wait(t, f, 120 * SEC, &e)) die("recv", &e);
  dp_value_t v = dp_value_retain(dp_future_value(f));
  dp_future_release(f);
  return v;
}

static void send_one(dp_endpoint_t *ep, dp_value_t v, dp_future_t **d) {
  dp_error_t e;
  if (dp_endpoint_send(ep, v, d, &e)) die("send", &e);
}

static double our_bw(dp_transport_t *t, dp_endpoint_t *ep, dp_value_t tensor) {
  double best = 0;
  for (int round = 0; round < 2; round++) {
    dp_future_t *d[BW_COUNT];
    double t0 = bench_now();
    for (int i = 0; i < BW_COUNT; i++) send_one(ep, tensor, &d[i]);
    dp_future_t *ask;
    send_one(ep, dp_int(0), &ask);
    dp_value_t n = recv_one(t, ep);
    double dt = bench_now() - t0;
    for (int i = 0; i < BW_COUNT; i++) {
      dp_future_wait(d[i], 60 * SEC, NULL);
      dp_future_release(d[i]);
    }
    dp_future_release(ask);
    (void)n;
    double mibs = (double)BW_SIZE * BW_COUNT / dt / (1 << 20);
    if (mibs > best) best = mibs;
  }
  return best;
}

static double our_lat(dp_transport_t *t, dp_endpoint_t *ep) {
  dp_value_t b;
  uint8_t payload[100] = {0};
  dp_error_t e;
  if (dp_bytes_new(payload, sizeof payload, &b, &e)) die("bytes", &e);
  dp_frame_t *fr;
  size_t flen;
  dp_frame_new(&fr, NULL);
  dp_pickle(b, NULL, fr, NULL);
  dp_frame_data(fr, &flen);
  dp_frame_free(fr);
  if (flen > 256) die("frame over 256 bytes", NULL);
  double best = 1e9;
  for (int round = 0; round < 3; round++) {
    double t0 = bench_now();
    for (int i = 0; i < LAT_ITERS / 4; i++) {
      dp_future_t *d;
      send_one(ep, b, &d);
      dp_value_t v = recv_one(t, ep);
      dp_value_release(v);
      dp_transport_wait(t, d, 60 * SEC, NULL);
      dp_future_release(d);
    }
    double us = (bench_now() - t0) / (LAT_ITERS / 4) / 2 * 1e6;
    if (us < best) best = us;
  }
  dp_value_release(b);
  return best;
}

static int free_port(void) {
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &len)) return 13337;
  close(fd);
  return ntohs(a.sin_port);
}

/* Runs ucx_perftest's server and client for one test; returns the column
 * col (1-based, of the final line's numbers) or -1 when it could not run. */
static double perftest(const char *args, int col) {
  int port = free_port();
  char cmd[512];
  snprintf(cmd, sizeof cmd, "ucx_perftest -p %d >/dev/null 2>&1", port);
  pid_t srv = fork();
  if (srv == 0) {
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  double v = -1;
  /* the client retries until the server listens (a bench, not a test) */
  for (int attempt = 0; attempt < 100 && v < 0; attempt++) {
    snprintf(cmd, sizeof cmd, "ucx_perftest 127.0.0.1 -p %d %s -f 2>/dev/null | tail -1", port, args);
    FILE *p = popen(cmd, "r");
    char line[512] = "";
    if (p && fgets(line, sizeof line, p)) {
      double x[8];
      if (sscanf(line, "%lf %lf %lf %lf %lf %lf %lf %lf", &x[0], &x[1], &x[2], &x[3], &x[4], &x[5], &x[6], &x[7]) ==
          8)
        v = x[col - 1];
    }
    if (p) pclose(p);
    if (v < 0) usleep(100000);
  }
  kill(srv, SIGTERM);
  waitpid(srv, NULL, 0);
  return v;
}

int main(int argc, char **argv) {
  const char *out = bench_out(argc, argv);
  env();
  pid_t pid, cpid;
  int port = bench_spawn(peer, &pid);
  g_caller = 1;
  int cport = bench_spawn(peer, &cpid);
  dp_transport_t *tc = new_transport();
  g_caller = 0;
  dp_transport_t *t = new_transport();
  dp_endpoint_t *ep, *cep;
  dp_error_t e;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  if (dp_endpoint_connect(t, addr, &ep, &e)) die("connect", &e);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", cport);
  if (dp_endpoint_connect(tc, addr, &cep, &e)) die("connect", &e);

  dp_backend_t *host;
  if (dp_backend_get(DP_DEVICE_HOST, &host, &e)) die("host backend", &e);
  dp_device_t dev = {DP_DEVICE_HOST, 0};
  void *mem;
  if (dp_device_alloc(host, dev, BW_SIZE, &mem, &e)) die("alloc", &e);
  memset(mem, 1, BW_SIZE);
  dp_storage_t *st;
  dp_value_t tensor;
  int64_t shape[1] = {(int64_t)BW_SIZE};
  if (dp_storage_new(dev, mem, BW_SIZE, NULL, NULL, &st, &e) ||
      dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &tensor, &e))
    die("tensor", &e);

  const char *prof = getenv("BENCH_TRANSPORT_PROFILE");
  if (prof) {
    int loops = getenv("LOOPS") ? atoi(getenv("LOOPS")) : 20;
    int caller = !strcmp(prof, "caller");
    for (int i = 0; i < loops; i++) printf("%s latency %.3f us\n", prof, caller ? our_lat(tc, cep) : our_lat(t, ep));
  }
  /* ours and ucx_perftest's alternate, three rounds each; the best of each */
  char args[128];
  snprintf(args, sizeof args, "-t ucp_am_bw -s %zu -n 20 -w 2", BW_SIZE);
  double lat = 1e30, clat = 1e30, bw = 0, base_bw = -1, base_lat = 1e30;
  for (int round = 0; round < (prof ? 0 : 3); round++) {
    double x = our_lat(t, ep);
    if (x < lat) lat = x;
    x = our_lat(tc, cep);
    if (x < clat) clat = x;
    x = our_bw(t, ep, tensor);
    if (x > bw) bw = x;
    x = perftest(args, 5);
    if (x > base_bw) base_bw = x;
    x = perftest("-t ucp_am_lat -s 256 -n 100000", 3);
    if (x > 0 && x < base_lat) base_lat = x;
  }
  if (base_lat >= 1e30) base_lat = -1;
  dp_future_t *d;
  send_one(ep, dp_none(), &d);
  dp_future_wait(d, 10 * SEC, NULL);
  dp_future_release(d);
  send_one(cep, dp_none(), &d);
  dp_transport_wait(tc, d, 10 * SEC, NULL);
  dp_future_release(d);
  dp_endpoint_free(ep);
  dp_endpoint_free(cep);
  dp_transport_free(t);
  dp_transport_free(tc);
  waitpid(pid, NULL, 0);
  waitpid(cpid, NULL, 0);
  dp_value_release(tensor);
  dp_device_dealloc(host, dev, mem, NULL);

  if (prof) return 0;
  if (base_bw <= 0 || base_lat <= 0) printf("(ucx_perftest did not run: the ratios are 0)\n");
  bench_row(out, "transport_bw_64MiB", "host", bw, "MiB/s", base_bw > 0 ? bw / base_bw : 0,
            "ucx_perftest ucp_am_bw 64 MiB, same UCX_TLS (higher is better)");
  bench_row(out, "transport_lat_frame", "host", lat, "us", base_lat > 0 ? lat / base_lat : 0,
            "ucx_perftest ucp_am_lat 256 B, same UCX_TLS (lower is better)");
  bench_row(out, "transport_lat_frame_caller", "host", clat, "us", base_lat > 0 ? clat / base_lat : 0,
            "ucx_perftest ucp_am_lat 256 B, same UCX_TLS (lower is better)");
  return 0;
}
