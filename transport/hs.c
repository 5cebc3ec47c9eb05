/* transport/hs.c — listeners, connections and devpickle's handshake
 * (internal.h, "THE HANDSHAKE"; docs/TRANSPORT.md, "Connections").
 *
 * A listener is a TCP socket of devpickle's own, never UCX's: UCX 1.13's
 * connection manager asserts on some malformed handshakes (17 zero bytes
 * abort the process), so no byte a stranger sends reaches UCX through it.
 * Every socket — listeners, handshakes, endpoints' connections — is in one
 * epoll set that the loop reads without blocking (dp__tp_socks) and sleeps
 * on with the workers' descriptors.
 *
 * Why the endpoints are made as they are (measured on UCX 1.13):
 * - UCX unpacks a worker address without checks: random bytes handed to
 *   ucp_ep_create abort the process. So the acceptor never unpacks the
 *   address a peer sent until UCX itself has wired an endpoint from that
 *   peer to the listen worker (whose wire-up carries the same packed
 *   address through UCX's own parser): the peer can then do to UCX no more
 *   than it already could. The connector unpacks the address of the
 *   listener it chose to connect to, as UCX's client-server mode did.
 * - UCX pairs two endpoints made from worker addresses by a per-worker-pair
 *   creation count (conn_sn), not by anything devpickle controls: two
 *   connections between the same workers pair crosswise when each side
 *   makes them in another order, and one a side abandons shifts every later
 *   pair. So the acceptor identifies its endpoint by UCX's own answer: the
 *   connector's first message (IDENT, carrying the acceptor's handshake
 *   token) arrives with UCX's reply endpoint R; the acceptor then calls
 *   ucp_ep_create to the connector's address until UCX hands back R (it
 *   returns the endpoint it made for the peer's request of the same count),
 *   keeping the others it gets (lpend) for the connections they belong to,
 *   whose IDENT names them in turn. That is also how R becomes the
 *   acceptor's own, with an error handler: an endpoint UCX made for a
 *   request and nobody claimed is destroyed by UCX when its peer goes.
 * - The listen worker is not the worker that connects: a worker's
 *   ucp_ep_create to a peer whose endpoints it already holds for accepted
 *   connections would be handed one of those.
 * - An endpoint made from an address is not told when its peer closes
 *   gracefully (its messages are dropped, no error): the handshake's TCP
 *   connection is kept, and its end (or reset) is the peer's close. */
#define _GNU_SOURCE /* accept4 */
#include <sys/random.h>

#include "tp.h"

struct hs {
  hs_t *next;
  sock_t ss;
  int fd;                   /* -1 once closed or handed to its endpoint */
  dp_listener_t *l;         /* the acceptor's listener; NULL: a connector's */
  dp_endpoint_t *ep;        /* the connector's endpoint */
  uint8_t out[DP__HS_HDR];  /* the header sent; the address follows it */
  const uint8_t *oaddr;     /* the transport's (owned by it) */
  size_t olen, osent;       /* header and address, bytes sent */
  uint8_t in[DP__HS_HDR];
  size_t inlen;
  uint8_t *addr;            /* the peer's address */
  size_t alen, agot;
  uint64_t token;           /* the acceptor's */
  int64_t deadline;
  uint32_t events;          /* what epoll watches for it */
  int connecting;           /* the connector: connect() in progress */
  int ident;                /* the acceptor: the peer's half is good; its go-ahead sent (1 byte), IDENT awaited */
  uint8_t go;               /* the connector: the acceptor's go-ahead (1) came */
  int gone;                 /* closed; freed after the events being read */
  int peer_local;
};

struct lpend {
  lpend_t *next;
  ucp_ep_h ep;
  int64_t deadline;         /* closed after it, unclaimed */
  int failed;
};

#define EVENTS_MAX 64
#define MATCH_MAX 16        /* endpoints made to find one connection's (a bound on what a peer costs) */
#define LPEND_MAX 64        /* unclaimed endpoints kept at once, all peers together */

/* ---- the epoll set ---- */

static int watch(dp_transport_t *t, int op, int fd, sock_t *s, uint32_t events) {
  struct epoll_event ev;
  memset(&ev, 0, sizeof ev);
  ev.events = events;
  ev.data.ptr = s;
  int rc = epoll_ctl(t->efd, op, fd, &ev);
  if (!rc && op == EPOLL_CTL_ADD) t->nsocks++;
  return rc;
}

static void unwatch_close(dp_transport_t *t, int *fd) {
  if (*fd < 0) return;
  epoll_ctl(t->efd, EPOLL_CTL_DEL, *fd, NULL);
  close(*fd);
  *fd = -1;
  t->nsocks--;
}

/* ---- handshakes ---- */

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) { return get32(p) | (uint64_t)get32(p + 4) << 32; }

static void hs_header(hs_t *h, size_t alen, uint64_t token) {
  memcpy(h->out, "DPHS", 4);
  put32(h->out + 4, DP__HS_VERSION); /* version u16 1, flags u16 0 */
  put32(h->out + 8, (uint32_t)alen);
  put32(h->out + 12, 0);
  put32(h->out + 16, (uint32_t)token);
  put32(h->out + 20, (uint32_t)(token >> 32));
  h->olen = DP__HS_HDR + alen;
}

/* The peer's header: the acceptor's carries a token, the connector's none. */
static int header_ok(const hs_t *h) {
  uint32_t n = get32(h->in + 8);
  uint64_t token = get64(h->in + 16);
  return !memcmp(h->in, "DPHS", 4) && get32(h->in + 4) == DP__HS_VERSION && n >= 1 && n <= DP__HS_ADDR_MAX &&
         get32(h->in + 12) == 0 && (h->l ? token == 0 : token != 0);
}

/* Closes h; its memory goes after the events being read (dp__tp_socks). */
static void hs_close(dp_transport_t *t, hs_t *h) {
  if (h->gone) return;
  h->gone = 1;
  unwatch_close(t, &h->fd);
  if (h->l) t->nhs--;
  if (h->ep) h->ep->hs = NULL;
  h->ep = NULL;
}

static void hs_sweep(dp_transport_t *t) {
  for (hs_t **p = &t->hs; *p;) {
    hs_t *h = *p;
    if (!h->gone) {
      p = &h->next;
      continue;
    }
    *p = h->next;
    if (h->addr) dp__free(h->addr, h->alen);
    dp__free(h, sizeof *h);
  }
}

static hs_t *hs_new(dp_transport_t *t, int fd, uint32_t events) {
  hs_t *h = dp__alloc(sizeof *h);
  if (!h) return NULL;
  memset(h, 0, sizeof *h);
  h->fd = fd;
  h->ss = (sock_t){SOCK_HS, h};
  h->events = events;
  h->deadline = now_ns() + t->hs_ns;
  if (watch(t, EPOLL_CTL_ADD, fd, &h->ss, events)) {
    dp__free(h, sizeof *h);
    return NULL;
  }
  h->next = t->hs;
  t->hs = h;
  return h;
}

/* A connector's handshake failed: its endpoint fails (fmt: one %s, why). */
static void hs_fail(dp_transport_t *t, hs_t *h, int code, const char *fmt, const char *why) {
  dp_endpoint_t *ep = h->ep;
  hs_close(t, h);
  if (ep) dp__tp_ep_failf(ep, code, fmt, why);
}
#define REFUSED "connection refused or lost before any reply (%s)"

/* The connector's handshake is done: its endpoint to the listener's
 * worker, IDENT first (and only, until ACCEPT), then the lane's offer. */
static void hs_connected(dp_transport_t *t, hs_t *h) {
  dp_endpoint_t *ep = h->ep;
  if (!ep || ep->dead) {
    hs_close(t, h);
    return;
  }
  ucp_ep_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = (const ucp_address_t *)h->addr;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = dp__tp_ep_err_cb;
  p.err_handler.arg = ep;
  ucs_status_t st = ucp_ep_create(t->worker, &p, &ep->ep);
  if (st != UCS_OK) {
    ep->ep = NULL;
    hs_close(t, h);
    dp__tp_ep_failf(ep, DP_EIO, "cannot connect (%s)", ucs_status_string(st));
    return;
  }
  ep->uw = t->worker;
  ep->sock = h->fd; /* kept: its end is the peer's close */
  h->fd = -1;
  ep->ss = (sock_t){SOCK_EP, ep};
  watch(t, EPOLL_CTL_MOD, ep->sock, &ep->ss, EPOLLIN);
  dp__am_shm_ctl_t id = {DP__WIRE_MAGIC, 0, h->token};
  hs_close(t, h); /* the descriptor is the endpoint's now (still watched) */
  dp__tp_ctl_queue(ep, DP__AM_IDENT, &id, sizeof id);
  if (!ep->dead) dp__tp_lane_offer(t, ep);
}

/* Moves h's bytes: connect's outcome, the header, address (and the
 * acceptor's go-ahead) out, the peer's in. 0 while it goes on (or is
 * done); -1 when h was closed. */
static int hs_io(dp_transport_t *t, hs_t *h) {
  if (h->connecting) {
    int e = 0;
    socklen_t el = sizeof e;
    if (getsockopt(h->fd, SOL_SOCKET, SO_ERROR, &e, &el) || e) {
      hs_fail(t, h, DP_EIO, REFUSED, strerror(e ? e : errno));
      return -1;
    }
    h->connecting = 0;
  }
  static const uint8_t go = 1;
  size_t alen_out = h->olen - DP__HS_HDR;
  while (h->osent < h->olen + (size_t)h->ident) {
    const uint8_t *src = h->osent < DP__HS_HDR ? h->out + h->osent
                         : h->osent < h->olen  ? h->oaddr + (h->osent - DP__HS_HDR)
                                               : &go;
    size_t n = h->osent < DP__HS_HDR ? DP__HS_HDR - h->osent
               : h->osent < h->olen  ? DP__HS_HDR + alen_out - h->osent
                                     : 1;
    ssize_t w = send(h->fd, src, n, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
    if (w <= 0) {
      if (h->l) hs_close(t, h);
      else hs_fail(t, h, DP_EIO, REFUSED, strerror(errno));
      return -1;
    }
    h->osent += (size_t)w;
  }
  for (;;) {
    uint8_t spill[64];
    void *dst = spill;
    size_t n = sizeof spill; /* beyond what the peer may send: a protocol violation */
    if (h->inlen < DP__HS_HDR) dst = h->in + h->inlen, n = DP__HS_HDR - h->inlen;
    else if (h->agot < h->alen) dst = h->addr + h->agot, n = h->alen - h->agot;
    else if (!h->l && !h->go) dst = &h->go, n = 1;
    ssize_t r = recv(h->fd, dst, n, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
    int ok = r > 0 && dst != spill;
    if (ok && h->inlen < DP__HS_HDR) {
      static const uint8_t lead[8] = {'D', 'P', 'H', 'S', DP__HS_VERSION, 0, 0, 0}; /* magic, version, flags */
      h->inlen += (size_t)r;
      ok = !memcmp(h->in, lead, h->inlen < 8 ? h->inlen : 8); /* a stranger is told apart at once */
      if (ok && h->inlen == DP__HS_HDR) {
        ok = header_ok(h);
        if (ok) {
          h->alen = get32(h->in + 8);
          if (!h->l) h->token = get64(h->in + 16);
          ok = (h->addr = dp__alloc(h->alen)) != NULL;
        }
      }
    } else if (ok && dst == &h->go) {
      ok = h->go == 1;
    } else if (ok) {
      h->agot += (size_t)r;
    }
    if (!ok) { /* an end, an error, a bad header, bytes beyond the protocol's */
      if (h->l) hs_close(t, h);
      else hs_fail(t, h, r <= 0 ? DP_EIO : DP_EFORMAT, REFUSED,
                   r < 0    ? strerror(errno)
                   : r == 0 ? "the listener closed the connection"
                            : "the listener's handshake is not devpickle's");
      return -1;
    }
  }
  if (h->l && !h->ident && h->osent == h->olen && h->inlen == DP__HS_HDR && h->agot == h->alen) {
    /* the peer's half is good: the go-ahead, after which its IDENT comes */
    h->ident = 1;
    return hs_io(t, h);
  }
  uint32_t want = EPOLLIN | (h->osent < h->olen + (size_t)h->ident ? EPOLLOUT : 0);
  if (want != h->events) watch(t, EPOLL_CTL_MOD, h->fd, &h->ss, h->events = want);
  if (!h->l && h->osent == h->olen && h->go) hs_connected(t, h);
  return 0;
}

/* ---- listeners ---- */

/* The listen worker (made by the first listener): accepted connections'
 * endpoints live there, never on the worker that connects. */
static int listen_worker(dp_transport_t *t, dp_error_t *err) {
  if (t->lworker) return 0;
  ucs_status_t st = dp__tp_new_worker(t->ctx, &t->lworker, &t->lworker_fd);
  if (st == UCS_OK && (st = dp__tp_set_handlers(t->lworker, t->lamh, t, NULL)) == UCS_OK &&
      (st = ucp_worker_get_address(t->lworker, &t->laddr, &t->laddr_len)) == UCS_OK &&
      t->laddr_len <= DP__HS_ADDR_MAX)
    return 0;
  if (t->laddr) ucp_worker_release_address(t->lworker, t->laddr);
  t->laddr = NULL;
  if (t->lworker) ucp_worker_destroy(t->lworker);
  t->lworker = NULL;
  return dp__err(err, DP_EIO, "transport: cannot listen: UCX worker: %s",
                 st == UCS_OK ? "its address is too long" : ucs_status_string(st));
}

int dp__tp_listen(dp_transport_t *t, dp_listener_t *l, const struct sockaddr_storage *a, socklen_t len,
                  dp_error_t *err) {
  l->fd = -1;
  int rc = listen_worker(t, err);
  if (rc) return rc;
  int fd = socket(a->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
      bind(fd, (const struct sockaddr *)a, len) || listen(fd, 128)) {
    int e = errno;
    if (fd >= 0) close(fd);
    return dp__err(err, DP_EIO, "transport: cannot listen: %s (%s)",
                   e == EADDRINUSE ? "the address is in use" : "the socket refused", strerror(e));
  }
  struct sockaddr_storage b;
  socklen_t bl = sizeof b;
  if (!getsockname(fd, (struct sockaddr *)&b, &bl))
    l->port = ntohs(b.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&b)->sin6_port
                                            : ((struct sockaddr_in *)&b)->sin_port);
  l->ss = (sock_t){SOCK_LISTENER, l};
  if (watch(t, EPOLL_CTL_ADD, fd, &l->ss, EPOLLIN)) {
    int e = errno;
    close(fd);
    return dp__err(err, DP_EIO, "transport: cannot listen: epoll: %s", strerror(e));
  }
  l->fd = fd;
  return 0;
}

/* Stops listening: the socket and the handshakes it accepted go. */
void dp__tp_unlisten(dp_transport_t *t, dp_listener_t *l) {
  unwatch_close(t, &l->fd);
  for (hs_t *h = t->hs; h; h = h->next)
    if (h->l == l) hs_close(t, h);
  hs_sweep(t);
}

/* Connections waiting on l: each starts its handshake at once; beyond
 * DP__HS_MAX the oldest handshake gives way (a flood of silent peers
 * delays a real one by at most the deadline, never shuts it out). */
static void on_listener(dp_transport_t *t, dp_listener_t *l) {
  for (int i = 0; i < 64 && l->fd >= 0; i++) {
    struct sockaddr_storage pa;
    socklen_t pl = sizeof pa;
    int fd = accept4(l->fd, (struct sockaddr *)&pa, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return; /* none left (or out of descriptors: tried again later) */
    uint64_t token = 0;
    if (getrandom(&token, sizeof token, GRND_NONBLOCK) != sizeof token || !token) {
      close(fd);
      continue;
    }
    if (t->nhs >= DP__HS_MAX) {
      hs_t *old = NULL;
      for (hs_t *h = t->hs; h; h = h->next)
        if (h->l && !h->gone && (!old || h->deadline < old->deadline)) old = h;
      if (old) hs_close(t, old);
    }
    hs_t *h = hs_new(t, fd, EPOLLIN | EPOLLOUT);
    if (!h) {
      close(fd);
      continue;
    }
    t->nhs++;
    h->l = l;
    h->token = token;
    h->peer_local = dp__tp_addr_is_local(&pa);
    h->oaddr = (const uint8_t *)t->laddr;
    hs_header(h, t->laddr_len, token);
    hs_io(t, h);
  }
}

/* ---- connecting ---- */

void dp__tp_connect(dp_transport_t *t, dp_endpoint_t *ep, const struct sockaddr_storage *a, socklen_t len) {
  ep->peer_local = dp__tp_addr_is_local(a);
  ep->born = now_ns();
  if (!t->caddr && (ucp_worker_get_address(t->worker, &t->caddr, &t->caddr_len) != UCS_OK ||
                    t->caddr_len > DP__HS_ADDR_MAX)) {
    if (t->caddr) ucp_worker_release_address(t->worker, t->caddr);
    t->caddr = NULL;
    dp__tp_ep_failf(ep, DP_EIO, "cannot connect (%s)", "no UCX worker address");
    return;
  }
  int fd = socket(a->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int in_progress = 0;
  if (fd >= 0 && connect(fd, (const struct sockaddr *)a, len) && !(in_progress = errno == EINPROGRESS)) {
    int e = errno;
    close(fd);
    fd = -1;
    errno = e;
  }
  hs_t *h = fd >= 0 ? hs_new(t, fd, EPOLLIN | EPOLLOUT) : NULL;
  if (!h) {
    int e = errno;
    if (fd >= 0) close(fd);
    dp__tp_ep_failf(ep, DP_EIO, "connection refused or lost before any reply (%s)", strerror(e));
    return;
  }
  h->ep = ep;
  ep->hs = h;
  h->connecting = in_progress;
  h->oaddr = (const uint8_t *)t->caddr;
  hs_header(h, t->caddr_len, 0);
  if (!in_progress) hs_io(t, h);
}

/* ---- endpoints' connections ---- */

/* The connector's handshake, if it still runs, goes (the endpoint closes). */
void dp__tp_ep_hs_drop(dp_endpoint_t *ep) {
  if (ep->hs) hs_close(ep->t, ep->hs);
}

void dp__tp_ep_sock_close(dp_endpoint_t *ep) {
  dp__tp_ep_hs_drop(ep);
  unwatch_close(ep->t, &ep->sock);
}

/* 1 when the peer closed its side of the connection (or reset it). */
int dp__tp_ep_peer_gone(const dp_endpoint_t *ep) {
  if (ep->sock < 0) return 0;
  uint8_t b;
  ssize_t r = recv(ep->sock, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* The peer's side of the connection ended (or sent what it must not): the
 * endpoint fails, once what UCX already holds of the peer's messages was
 * taken (they were sent before the close). */
static void on_ep_sock(dp_transport_t *t, dp_endpoint_t *ep) {
  uint8_t b[64];
  ssize_t r = recv(ep->sock, b, sizeof b, 0);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  int e = r < 0 ? errno : 0;
  unwatch_close(t, &ep->sock);
  if (ep->dead) return;
  if (r > 0) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "bytes on the connection after its handshake");
    return;
  }
  while (ep->uw && ucp_worker_progress(ep->uw)) {
  }
  if (ep->dead) return;
  dp__tp_ep_failf(ep, DP_EIO, ep->established ? "connection lost (%s)" : "connection refused or lost before any reply (%s)",
                  e ? strerror(e) : "the peer closed the connection");
}

/* ---- the acceptor's endpoint: IDENT ---- */

static void lpend_drop(dp_transport_t *t, int all) {
  int64_t now = now_ns();
  for (lpend_t **p = &t->lpend; *p;) {
    lpend_t *e = *p;
    if (!all && !e->failed && now < e->deadline) {
      p = &e->next;
      continue;
    }
    *p = e->next;
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof rp);
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *r = ucp_ep_close_nbx(e->ep, &rp);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    dp__free(e, sizeof *e);
  }
}

/* Errors of listen-worker endpoints: the endpoint's whose it is, else an
 * unclaimed one's (closed by the loop). */
void dp__tp_lworker_err_cb(void *arg, ucp_ep_h uep, ucs_status_t st) {
  dp_transport_t *t = arg;
  for (dp_endpoint_t *e = t->eps; e; e = e->next)
    if (e->ep == uep) {
      dp__tp_ep_fail_status(e, st);
      return;
    }
  for (lpend_t *e = t->lpend; e; e = e->next)
    if (e->ep == uep) e->failed = 1;
}

/* Makes r the acceptor's own: UCX hands it back from ucp_ep_create to the
 * peer's address once the creation count reaches the one the peer's
 * request carried; the endpoints handed back before it belong to other
 * connections from that worker (kept in lpend). 1 when r is ours. */
static int claim(dp_transport_t *t, ucp_ep_h r, const uint8_t *addr) {
  for (lpend_t **p = &t->lpend; *p; p = &(*p)->next)
    if ((*p)->ep == r) {
      lpend_t *e = *p;
      *p = e->next;
      dp__free(e, sizeof *e);
      return 1;
    }
  ucp_ep_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = (const ucp_address_t *)addr;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = dp__tp_lworker_err_cb;
  p.err_handler.arg = t;
  size_t kept = 0;
  for (lpend_t *e = t->lpend; e; e = e->next) kept++;
  for (int i = 0; i < MATCH_MAX; i++) {
    ucp_ep_h e;
    if (kept++ >= LPEND_MAX) return 0; /* no more endpoints for strangers: this connection is dropped */
    lpend_t *pe = dp__alloc(sizeof *pe);
    if (!pe) return 0;
    if (ucp_ep_create(t->lworker, &p, &e) != UCS_OK) {
      dp__free(pe, sizeof *pe);
      return 0;
    }
    if (e == r) {
      dp__free(pe, sizeof *pe);
      return 1;
    }
    pe->ep = e;
    pe->failed = 0;
    pe->deadline = now_ns() + t->hs_ns;
    pe->next = t->lpend;
    t->lpend = pe;
  }
  return 0;
}

/* IDENT, in UCX's handler on the listen worker: the handshake it names
 * becomes an endpoint, queued for dp_listener_accept. An IDENT that names
 * no handshake waiting for one is ignored (UCX's endpoint is not
 * touched); one from an endpoint already claimed drops the handshake it
 * names. What one costs is bounded: MATCH_MAX endpoints made, LPEND_MAX
 * kept unclaimed for all peers together. */
void dp__tp_ident(dp_transport_t *t, const void *hdr, size_t hlen, const ucp_am_recv_param_t *param) {
  dp__am_shm_ctl_t c;
  if (hlen != sizeof c || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return;
  memcpy(&c, hdr, sizeof c);
  if (c.magic != DP__WIRE_MAGIC || c.value || !c.token) return;
  hs_t *h = t->hs;
  while (h && (h->gone || !h->l || !h->ident || h->token != c.token)) h = h->next;
  if (!h) return;
  /* one IDENT a connection: one arriving on an endpoint already claimed
     names no new one (it would make endpoints for nothing) */
  for (dp_endpoint_t *e = t->eps; e; e = e->next)
    if (e->ep == param->reply_ep) {
      hs_close(t, h);
      return;
    }
  dp_listener_t *l = h->l;
  dp_endpoint_t *ep = NULL;
  char name[96];
  snprintf(name, sizeof name, "endpoint accepted on port %d", l->port);
  if (l->closed || !claim(t, param->reply_ep, h->addr)) {
    hs_close(t, h);
    return;
  }
  if (dp__tp_ep_alloc(t, name, &ep, NULL)) { /* ours now: closed with the unclaimed ones */
    lpend_t *pe = dp__alloc(sizeof *pe);
    if (pe) {
      *pe = (lpend_t){t->lpend, param->reply_ep, 0, 1};
      t->lpend = pe;
    }
    hs_close(t, h);
    return;
  }
  ep->ep = param->reply_ep;
  ep->uw = t->lworker;
  ep->peer_local = h->peer_local;
  ep->established = 1; /* the peer spoke */
  ep->acceptor = 1;
  ep->sock = h->fd;
  h->fd = -1;
  ep->ss = (sock_t){SOCK_EP, ep};
  watch(t, EPOLL_CTL_MOD, ep->sock, &ep->ss, EPOLLIN);
  hs_close(t, h); /* the descriptor is the endpoint's now (still watched) */
  dp__am_shm_ctl_t acc = {DP__WIRE_MAGIC, 0, 0};
  dp__tp_ctl_queue(ep, DP__AM_ACCEPT, &acc, sizeof acc); /* sent by the loop: the connector may send now */
  ep->queued = 1; /* before it is in the list dp_transport_free reads */
  dp__tp_ep_link(t, ep);
  pthread_mutex_lock(&t->mu);
  if (l->acc_tail) l->acc_tail->acc_next = ep;
  else l->acc_head = ep;
  l->acc_tail = ep;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

/* ---- the loop's part ---- */

/* Reads the epoll set without blocking and handles what it names; then the
 * handshakes' deadlines and the unclaimed endpoints. Returns the events
 * handled. */
int dp__tp_socks(dp_transport_t *t) {
  struct epoll_event evs[EVENTS_MAX];
  int n = epoll_wait(t->efd, evs, EVENTS_MAX, 0);
  for (int i = 0; i < n; i++) {
    sock_t *s = evs[i].data.ptr;
    if (s->kind == SOCK_LISTENER) {
      on_listener(t, s->obj);
    } else if (s->kind == SOCK_HS) {
      hs_t *h = s->obj;
      if (!h->gone) hs_io(t, h);
    } else {
      dp_endpoint_t *ep = s->obj;
      if (ep->sock >= 0) on_ep_sock(t, ep);
    }
  }
  if (t->hs) {
    int64_t now = now_ns();
    for (hs_t *h = t->hs; h; h = h->next)
      if (!h->gone && now > h->deadline) {
        char ms[32];
        snprintf(ms, sizeof ms, "%lld ms", (long long)(t->hs_ns / 1000000));
        if (h->l) hs_close(t, h);
        else hs_fail(t, h, DP_ETIMEDOUT, "the listener did not complete the handshake within %s", ms);
      }
    hs_sweep(t);
  }
  if (t->lpend) lpend_drop(t, 0);
  return n > 0 ? n : 0;
}

/* The transport goes: unclaimed endpoints, what is left of handshakes. */
void dp__tp_socks_free(dp_transport_t *t) {
  lpend_drop(t, 1);
  for (hs_t *h = t->hs; h; h = h->next) hs_close(t, h);
  hs_sweep(t);
}
