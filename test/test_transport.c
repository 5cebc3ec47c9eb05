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

/* ---- one large buffer ---- */

static size_t big_size(void) {
  /* 1 GiB when the machine has room for it on both sides, else 256 MiB */
  long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  return (double)pages * psz > 6.0 * (1 << 30) ? (size_t)1 << 30 : (size_t)256 << 20;
}

static uint64_t sum64(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i += 4096) h = (h ^ p[i] ^ ((uint64_t)p[n - 1 - i] << 8)) * 1099511628211ull;
  return h;
}

static int recv_big(dp_transport_t *t, dp_endpoint_t *ep, void *arg) {
  (void)t;
  size_t n = (size_t)(uintptr_t)arg;
  dp_future_t *f;
  dp_error_t e;
  if (dp_endpoint_recv(ep, &f, &e) || wait_f(f, &e)) {
    fprintf(stderr, "recv_big: %s\n", e.message);
    return 10;
  }
  dp_value_t v = dp_future_value(f);
  dp_storage_t *s = dp_tensor_storage(v);
  if (!s || dp_storage_nbytes(s) != n) return 11;
  const uint8_t *p = dp_storage_base(s);
  /* every byte */
  for (size_t i = 0; i < n; i++)
    if (p[i] != (uint8_t)(i * 7 + (i >> 20))) return 12;
  dp_future_t *d;
  dp_value_t ok = dp_int((int64_t)sum64(p, n));
  if (dp_endpoint_send(ep, ok, &d, &e) || wait_f(d, &e)) return 13;
  dp_future_release(d);
  dp_future_release(f);
  return 0;
}

Test(transport, a_buffer_of_1_GiB_arrives_byte_for_byte) {
  size_t n = big_size();
  if (n < ((size_t)1 << 30)) cr_log_warn("not enough memory for 1 GiB: sending %zu MiB", n >> 20);
  peer_t p = spawn_peer(recv_big, (void *)(uintptr_t)n, NULL);
  dp_transport_t *t = new_transport(NULL);
  dp_endpoint_t *ep = connect_to(t, p.port);
  uint8_t *buf = malloc(n);
  cr_assert(buf);
  for (size_t i = 0; i < n; i++) buf[i] = (uint8_t)(i * 7 + (i >> 20));
  dp_storage_t *st;
  OK(dp_storage_new(t_dev(DP_DEVICE_CPU, 0), buf, n, free_cb, NULL, &st, T_ERR));
  dp_value_t v;
  int64_t shape[1] = {(int64_t)n};
  OK(dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &v, T_ERR));
  dp_future_t *d, *r;
  dp_error_t e;
  OK(dp_endpoint_send(ep, v, &d, T_ERR));
  OK(dp_endpoint_recv(ep, &r, T_ERR));
  OK_WITH(&e, wait_f(d, &e));
  OK_WITH(&e, wait_f(r, &e));
  cr_assert_eq((uint64_t)dp_value_as_int(dp_future_value(r)), sum64(buf, n));
  dp_future_release(d);
  dp_future_release(r);
  dp_value_release(v);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  cr_assert_eq(peer_wait(p), 0);
}

/* ---- many messages in flight ---- */

static int recv_in_order(dp_transport_t *t, dp_endpoint_t *ep, void *arg) {
  (void)t;
  long n = (long)(intptr_t)arg;
  dp_future_t **fs = malloc(n * sizeof *fs);
  dp_error_t e;
  for (long i = 0; i < n; i++)
    if (dp_endpoint_recv(ep, &fs[i], &e)) return 10;
  for (long i = 0; i < n; i++) {
    if (wait_f(fs[i], &e)) {
      fprintf(stderr, "recv %ld: %s\n", i, e.message);
      return 11;
    }
    dp_value_t v = dp_future_value(fs[i]);
    if (dp_value_kind(v) != DP_TUPLE || dp_value_as_int(dp_seq_get(v, 0)) != i ||
        !tensor_ok(dp_seq_get(v, 1), 16, (unsigned)i))
      return 12;
    dp_future_release(fs[i]);
  }
  free(fs);
  dp_future_t *d;
  if (dp_endpoint_send(ep, dp_int(n), &d, &e) || wait_f(d, &e)) return 13;
  dp_future_release(d);
  return 0;
}

Test(transport, ten_thousand_small_messages_in_flight_arrive_complete_and_in_order) {
  long n = 10000;
  peer_t p = spawn_peer(recv_in_order, (void *)(intptr_t)n, NULL);
  dp_transport_t *t = new_transport(NULL);
  dp_endpoint_t *ep = connect_to(t, p.port);
  dp_future_t **ds = malloc(n * sizeof *ds);
  for (long i = 0; i < n; i++) {
    dp_value_t v;
    OK(dp_tuple_new(2, &v, T_ERR));
    OK(dp_seq_set(v, 0, dp_int(i), T_ERR));
    OK(dp_seq_set(v, 1, owned_tensor(16, (unsigned)i), T_ERR));
    OK(dp_endpoint_send(ep, v, &ds[i], T_ERR));
    dp_value_release(v);  /* the transport holds it until sent */
  }
  dp_future_t *r;
  dp_error_t e;
  OK(dp_endpoint_recv(ep, &r, T_ERR));
  OK_WITH(&e, wait_f(r, &e));
  cr_assert_eq(dp_value_as_int(dp_future_value(r)), n);
  for (long i = 0; i < n; i++) {
    OK_WITH(&e, wait_f(ds[i], &e));
    dp_future_release(ds[i]);
  }
  free(ds);
  dp_future_release(r);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  cr_assert_eq(peer_wait(p), 0);
}

/* ---- user objects and customs ---- */

typedef struct point {
  dp_value_t tensor;
  int64_t x;
} point_t;
static int point_reduce(void *obj, dp_value_t *state, dp_error_t *err) {
  point_t *pt = obj;
  int rc = dp_tuple_new(2, state, err);
  if (!rc) rc = dp_seq_set(*state, 0, dp_int(pt->x), err);
  if (!rc) rc = dp_seq_set(*state, 1, dp_value_retain(pt->tensor), err);
  return rc;
}
static void point_destroy(void *obj) {
  dp_value_release(((point_t *)obj)->tensor);
  free(obj);
}
static const dp_type_t point_type = {"test.Point", point_reduce, point_destroy};

static int point_resolve(void *ud, const char *type_name, dp_value_t state, dp_value_t *out, dp_error_t *err) {
  (void)ud, (void)type_name;
  point_t *pt = malloc(sizeof *pt);
  pt->x = dp_value_as_int(dp_seq_get(state, 0));
  pt->tensor = dp_value_retain(dp_seq_get(state, 1));
  return dp_custom_new(&point_type, pt, out, err);
}

Test(transport, user_objects_and_customs_round_trip_with_their_buffers) {
  /* the peer has no resolver: the custom passes through it as its reduced stand-in */
  peer_t p = spawn_peer(echo_n, (void *)(intptr_t)1, NULL);
  const char *types[] = {"test.Point"};
  dp_resolver_t res = {types, 1, point_resolve, NULL};
  dp_unpickle_opts_t uo;
  memset(&uo, 0, sizeof uo);
  uo.resolver = &res;
  dp_transport_opts_t o;
  memset(&o, 0, sizeof o);
  o.unpickle = &uo;
  dp_transport_t *t = new_transport(&o);
  dp_endpoint_t *ep = connect_to(t, p.port);
  dp_value_t obj, c;
  OK(dp_object_new("test.Model", &obj, T_ERR));
  OK(dp_object_set(obj, "weight", owned_tensor(100000, 5), T_ERR));
  point_t *pt = malloc(sizeof *pt);
  pt->x = 42;
  pt->tensor = owned_tensor(300, 6);
  OK(dp_custom_new(&point_type, pt, &c, T_ERR));
  OK(dp_object_set(obj, "point", c, T_ERR));
  dp_future_t *d, *r;
  dp_error_t e;
  OK(dp_endpoint_send(ep, obj, &d, T_ERR));
  OK(dp_endpoint_recv(ep, &r, T_ERR));
  OK_WITH(&e, wait_f(r, &e));
  dp_value_t back = dp_future_value(r), w, pc;
  cr_assert_str_eq(dp_object_class(back), "test.Model");
  OK(dp_object_get(back, "weight", &w, T_ERR));
  cr_assert(tensor_ok(w, 100000, 5));
  OK(dp_object_get(back, "point", &pc, T_ERR));
  cr_assert_eq(dp_custom_type(pc), &point_type, "the custom came back as a %s", dp_kind_name(dp_value_kind(pc)));
  point_t *bp = dp_custom_data(pc);
  cr_assert_eq(bp->x, 42);
  cr_assert(tensor_ok(bp->tensor, 300, 6));
  OK_WITH(&e, wait_f(d, &e));
  dp_future_release(d);
  dp_future_release(r);
  dp_value_release(obj);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  cr_assert_eq(peer_wait(p), 0);
}
