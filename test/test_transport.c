/* test/test_transport.c — the transport between two processes on localhost.
 *
 * Each test forks its peer before either side starts UCX; the peer reports
 * through its exit status (and a pipe), never through Criterion. UCX runs on
 * TCP over lo and shared memory (t_env), as CI has no other interface. */
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>
#include <time.h>

#include "helpers.h"
#include "../transport/internal.h"

#define SEC 1000000000ll

static void t_env(void) {
  /* tcp on lo and shared memory: what a container without a network has */
  setenv("UCX_TLS", "tcp,posix,sysv,self", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
  /* UCX's malloc hooks and memory events fight ASan's; nothing here registers memory */
  setenv("UCX_MEM_MALLOC_HOOKS", "no", 0);
  setenv("UCX_MEM_EVENTS", "no", 0);
  setenv("UCX_KEEPALIVE_INTERVAL", "100ms", 0);
  signal(SIGPIPE, SIG_IGN);
}

/* ---- the peer process ---- */

typedef int (*peer_fn)(dp_transport_t *t, dp_endpoint_t *ep, void *arg);

typedef struct peer {
  pid_t pid;
  int port;
} peer_t;

/* Forks a peer that listens on 127.0.0.1:0, says its port through a pipe,
 * accepts one connection and runs fn on it; its exit status is fn's result
 * (0 ok). opts: the peer's transport options. */
static peer_t spawn_peer(peer_fn fn, void *arg, const dp_transport_opts_t *opts) {
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    close(fds[0]);
    t_env();
    dp_transport_t *t;
    dp_listener_t *l;
    dp_endpoint_t *ep;
    dp_error_t e;
    if (dp_transport_new(opts, &t, &e) || dp_listener_new(t, "127.0.0.1:0", &l, &e)) {
      fprintf(stderr, "peer: %s\n", e.message);
      _exit(90);
    }
    int port = dp_listener_port(l);
    if (write(fds[1], &port, sizeof port) != sizeof port) _exit(91);
    close(fds[1]);
    if (dp_listener_accept(l, 30 * SEC, &ep, &e)) {
      fprintf(stderr, "peer: %s\n", e.message);
      _exit(92);
    }
    int rc = fn(t, ep, arg);
    dp_endpoint_free(ep);
    dp_listener_free(l);
    dp_transport_free(t);
    dp_value_collect();
    _exit(rc);
  }
  close(fds[1]);
  peer_t p = {pid, 0};
  cr_assert_eq(read(fds[0], &p.port, sizeof p.port), (ssize_t)sizeof p.port, "the peer did not start");
  close(fds[0]);
  return p;
}

static int peer_wait(peer_t p) {
  int st;
  cr_assert_eq(waitpid(p.pid, &st, 0), p.pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static dp_endpoint_t *connect_to(dp_transport_t *t, int port) {
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  dp_endpoint_t *ep;
  OK(dp_endpoint_connect(t, addr, &ep, T_ERR));
  return ep;
}

static dp_transport_t *new_transport(const dp_transport_opts_t *o) {
  t_env();
  dp_transport_t *t;
  OK(dp_transport_new(o, &t, T_ERR));
  return t;
}

/* waits on f; returns its code, the error in *e */
static int wait_f(dp_future_t *f, dp_error_t *e) {
  dp_error_clear(e);
  return dp_future_wait(f, 60 * SEC, e);
}

/* peer: receives values and sends each back, until n were echoed */
static int echo_n(dp_transport_t *t, dp_endpoint_t *ep, void *arg) {
  (void)t;
  long n = (long)(intptr_t)arg;
  dp_error_t e;
  for (long i = 0; i < n; i++) {
    dp_future_t *f, *d;
    if (dp_endpoint_recv(ep, &f, &e) || wait_f(f, &e)) {
      fprintf(stderr, "echo recv: %s\n", e.message);
      return 10;
    }
    if (dp_endpoint_send(ep, dp_future_value(f), &d, &e) || wait_f(d, &e)) {
      fprintf(stderr, "echo send: %s\n", e.message);
      return 11;
    }
    dp_future_release(d);
    dp_future_release(f);
  }
  return 0;
}

/* ---- values ---- */

static void free_cb(void *ud, dp_device_t d, void *base, size_t n) {
  (void)ud, (void)d, (void)n;
  free(base);
}

static dp_value_t owned_tensor(size_t nbytes, unsigned seed) {
  uint8_t *p = malloc(nbytes ? nbytes : 1);
  for (size_t i = 0; i < nbytes; i++) p[i] = (uint8_t)(seed * 31 + i * 7);
  dp_storage_t *s;
  OK(dp_storage_new(t_dev(DP_DEVICE_CPU, 0), p, nbytes, free_cb, NULL, &s, T_ERR));
  dp_value_t t;
  int64_t shape[1] = {(int64_t)nbytes};
  OK(dp_tensor_new(s, DP_UINT8, 1, shape, NULL, 0, &t, T_ERR));
  return t;
}

static int tensor_ok(dp_value_t t, size_t nbytes, unsigned seed) {
  if (dp_value_kind(t) != DP_TENSOR) return 0;
  dp_storage_t *s = dp_tensor_storage(t);
  if (dp_storage_nbytes(s) != nbytes) return 0;
  const uint8_t *p = dp_storage_base(s);
  for (size_t i = 0; i < nbytes; i++)
    if (p[i] != (uint8_t)(seed * 31 + i * 7)) return 0;
  return 1;
}

/* a list of n tensors, tensor i of size sizes(i) */
static size_t size_of(size_t i) { return 1 + (i * 13) % 40; }

static dp_value_t many_tensors(size_t n) {
  dp_value_t l;
  OK(dp_list_new(n, &l, T_ERR));
  for (size_t i = 0; i < n; i++) OK(dp_list_append(l, owned_tensor(size_of(i), (unsigned)i), T_ERR));
  return l;
}

Test(transport, a_value_of_100000_small_buffers_round_trips_between_two_processes) {
  peer_t p = spawn_peer(echo_n, (void *)(intptr_t)1, NULL);
  dp_transport_t *t = new_transport(NULL);
  dp_endpoint_t *ep = connect_to(t, p.port);
  dp_value_t v = many_tensors(100000);
  dp_future_t *d, *r;
  dp_error_t e;
  OK(dp_endpoint_send(ep, v, &d, T_ERR));
  OK(dp_endpoint_recv(ep, &r, T_ERR));
  OK_WITH(&e, wait_f(d, &e));
  OK_WITH(&e, wait_f(r, &e));
  dp_value_t back = dp_future_value(r);
  cr_assert_eq(dp_seq_len(back), 100000);
  for (size_t i = 0; i < 100000; i++)
    cr_assert(tensor_ok(dp_seq_get(back, i), size_of(i), (unsigned)i), "tensor %zu differs", i);
  dp_future_release(d);
  dp_future_release(r);
  dp_value_release(v);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  cr_assert_eq(peer_wait(p), 0);
}
