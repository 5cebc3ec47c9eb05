/* transport/lane.c — same-host lanes (internal.h): a worker and an endpoint without error
 * handling beside each connection between two processes of one host. */
#define _DEFAULT_SOURCE /* getifaddrs */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/mman.h>

#include "tp.h"

/* ---- the same-host lane (internal.h) ---- */

static const unsigned am_ids[AM_IDS] = {DP__AM_FRAME,     DP__AM_BUFS,      DP__AM_SHM_PIECE, DP__AM_SHM_OFFER,
                                        DP__AM_SHM_REPLY, DP__AM_SHM_DONE,  DP__AM_LANE_ADDR, DP__AM_LANE_HELLO,
                                        DP__AM_ACCEPT,    DP__AM_CREDIT,    DP__AM_CLOSE};

/* Sets the handler of every id a message can carry (UCX's are 16 bits) on
 * w, a lane's worker (ep) as the transport's (ep NULL): *stray is the
 * argument of the ids the protocol does not use, amh[i] the protocol's
 * i-th's. UCX 1.13 grows its table of handlers, when an id at or past its
 * length is registered, to max(twice its capacity, id + 1) rounded up to
 * even, and initializes only that id's entry of the ones it adds
 * (ucp_worker_set_am_handler_common): a message of another of them called
 * whatever the allocator left there. Nor does a shorter table that is all
 * set do: a message that arrives without a UCT descriptor (tcp, shared
 * memory) has its entry's flags read before its id is checked against the
 * table's length (ucp_am_handler_common), so an id past the table read up
 * to 1.5 MB past its end — a segfault where nothing is mapped there. Set
 * in increasing order from 0 to 65,535, every entry a message can name is
 * in the table and set: about 1.5 MB a worker, as a peer of a lane (a
 * process of this user) is no more trusted with it than any other. */
ucs_status_t dp__tp_set_handlers(ucp_worker_h w, amh_t *amh, amh_t *stray, dp_transport_t *t, dp_endpoint_t *ep) {
  ucp_am_handler_param_t hp;
  memset(&hp, 0, sizeof hp);
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  hp.cb = dp__tp_am_cb;
  ucs_status_t st = UCS_OK;
  *stray = (amh_t){t, AM_STRAY, ep};
  hp.arg = stray;
  for (unsigned id = 0; id <= UINT16_MAX && st == UCS_OK; id++) {
    hp.id = id;
    st = ucp_worker_set_am_recv_handler(w, &hp);
  }
  for (size_t i = 0; i < AM_IDS && st == UCS_OK; i++) {
    amh[i] = (amh_t){t, am_ids[i], ep};
    hp.id = am_ids[i];
    hp.arg = &amh[i];
    st = ucp_worker_set_am_recv_handler(w, &hp);
  }
  return st;
}

ucs_status_t dp__tp_new_worker(ucp_context_h ctx, ucp_worker_h *w, int *fd) {
  ucp_worker_params_t wp;
  memset(&wp, 0, sizeof wp);
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(ctx, &wp, w);
  if (st != UCS_OK) *w = NULL;
  else if ((st = ucp_worker_get_efd(*w, fd)) != UCS_OK) ucp_worker_destroy(*w), *w = NULL;
  return st;
}

/* The endpoint's lane worker; 0 when made. */
static int lane_worker(dp_transport_t *t, dp_endpoint_t *ep) {
  if (t->nlanes >= DP__LANES_MAX) return -1; /* a worker: ~9 descriptors, ~2 MB (1.5 its handlers) */
  if (dp__tp_new_worker(t->lctx, &ep->dw, &ep->dw_fd) != UCS_OK) return -1;
  if (dp__tp_set_handlers(ep->dw, ep->lamh, &ep->lstray, t, ep) == UCS_OK) return t->nlanes++, 0;
  ucp_worker_destroy(ep->dw);
  ep->dw = NULL;
  return -1;
}

/* The lane's worker goes (its endpoints with it). */
void dp__tp_lane_worker_free(dp_endpoint_t *ep) {
  if (!ep->dw) return;
  ucp_worker_destroy(ep->dw);
  ep->dw = NULL;
  ep->t->nlanes--;
}

/* 1 when addr is an address of this host: loopback, or one of its
 * interfaces' (a peer there may share memory with this process). */
int dp__tp_addr_is_local(const struct sockaddr_storage *addr) {
  /* IPv4 only: parse_addr refuses IPv6, so no listener or connection has it */
  if (addr->ss_family != AF_INET) return 0;
  in_addr_t ip = ((const struct sockaddr_in *)addr)->sin_addr.s_addr;
  /* 0.0.0.0 as a destination is this host: the system connects to one of
     its own addresses (a connector to it offered no lane, and every value
     crossed TCP) */
  if ((ntohl(ip) >> 24) == 127 || ip == htonl(INADDR_ANY)) return 1;
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs)) return 0;
  int local = 0;
  for (struct ifaddrs *i = ifs; i && !local; i = i->ifa_next)
    local = i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
            ((const struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == ip;
  freeifaddrs(ifs);
  return local;
}

/* "a multicast address" or "a broadcast address" (this host's interfaces',
 * the limited one, loopback's) for such an IPv4 address, else NULL: the
 * system lets a TCP socket bind and listen there, and no connection ever
 * comes (dp_listener_new refuses it). */
const char *dp__tp_addr_not_unicast(const struct sockaddr_storage *addr) {
  if (addr->ss_family != AF_INET) return NULL;
  in_addr_t ip = ((const struct sockaddr_in *)addr)->sin_addr.s_addr;
  uint32_t h = ntohl(ip);
  if ((h >> 28) == 0xe) return "a multicast address";
  if (h == 0xffffffffu || h == 0x7fffffffu) return "a broadcast address";
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs)) return NULL;
  int bcast = 0, held = 0;
  for (struct ifaddrs *i = ifs; i && !bcast; i = i->ifa_next) {
    bcast = (i->ifa_flags & IFF_BROADCAST) && i->ifa_broadaddr && i->ifa_broadaddr->sa_family == AF_INET &&
            ((const struct sockaddr_in *)i->ifa_broadaddr)->sin_addr.s_addr == ip;
    held |= i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
            ((const struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == ip;
  }
  freeifaddrs(ifs);
  if (bcast) return "a broadcast address";
  /* The system binds any 127.x.y.z, but UCX 1.13's connection manager
     takes a connection only at an address an interface holds (it looks up
     the interface of the connection's local address) and refuses the rest:
     a listener on 127.0.0.2 looked made and every connection to it failed. */
  if ((h >> 24) == 127 && !held) return "a loopback address no interface holds, where UCX refuses every connection";
  return NULL;
}

/* The connector's side, when it connects to an address of this host: its
 * lane worker's address goes into a file of its own (shm.h: 0600, a random
 * token), and the offer names the file and the token — never the address
 * itself, which UCX 1.13 unpacks without a check (a peer's bytes there
 * could abort this process): only a process of the same user on the same
 * host can read it. Without a lane (none here, another host, UCX or the
 * file refused) nothing is sent, and the endpoint stays on its
 * connection. */
void dp__tp_lane_offer(dp_transport_t *t, dp_endpoint_t *ep) {
  if (!t->lctx || !ep->peer_local || lane_worker(t, ep)) return;
  ucp_address_t *a = NULL;
  size_t n = 0;
  dp__shm_t *f = NULL;
  if (ucp_worker_get_address(ep->dw, &a, &n) != UCS_OK || n > DP__LANE_ADDR_MAX ||
      dp__shm_create(NULL, 1, DP__LANE_ADDR_MAX, &f, NULL)) {
    if (a) ucp_worker_release_address(ep->dw, a);
    dp__tp_lane_worker_free(ep);
    return;
  }
  memcpy(dp__shm_slot(f, 0), a, n);
  ucp_worker_release_address(ep->dw, a);
  dp__am_shm_ctl_t h = {DP__WIRE_MAGIC, (uint32_t)n, dp__shm_token(f)};
  const char *name = dp__shm_name(f);
  dp__tp_ctl_queue_data(ep, DP__AM_LANE_ADDR, &h, sizeof h, name, strlen(name));
  ep->lane_file = f;
  ep->lane_deadline = now_ns() + DP__OFFER_NS;
  ep->lane = LANE_WAIT;
}

/* The offer's file goes (its name at once; the mapping with it). */
void dp__tp_lane_file_drop(dp_endpoint_t *ep) {
  if (!ep->lane_file) return;
  dp__shm_unlink(ep->lane_file);
  dp__shm_release(ep->lane_file);
  ep->lane_file = NULL;
}

/* The acceptor's side, from the loop: the connector's address, read from
 * its file (of this user, 0600, the token the offer gave: else it is not a
 * process of this host and user), an endpoint to it, and the answer: HELLO
 * 1 on the lane once wired (dp__tp_lane_hello), else HELLO 0 on the
 * connection. */
void dp__tp_lane_connect(dp_transport_t *t, dp_endpoint_t *ep) {
  dp__shm_t *f = NULL;
  static _Thread_local uint64_t addr[DP__LANE_ADDR_MAX / 8]; /* the loop's own copy: the file stays writable by its creator */
  int ok = dp__shm_map(NULL, ep->lane_name, 1, DP__LANE_ADDR_MAX, ep->lane_token, &f, NULL) == 0;
  if (ok) {
    shm_unlink(ep->lane_name); /* read: it is done with (its creator unlinks it too) */
    memset(addr, 0, sizeof addr);
    memcpy(addr, dp__shm_slot(f, 0), ep->lane_addr_len);
    dp__shm_release(f);
  }
  ep->lane_name[0] = 0;
  if (ok) ok = lane_worker(t, ep) == 0;
  if (ok) {
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = (const ucp_address_t *)addr;
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE; /* shared memory has no other in UCX 1.13 */
    if (ucp_ep_create(ep->dw, &p, &ep->dep) != UCS_OK) {
      ep->dep = NULL;
      dp__tp_lane_worker_free(ep);
      ok = 0;
    }
  }
  if (ok) {
    ep->lane = LANE_HELLO; /* lane_hello sends it */
    ep->hello_deadline = now_ns() + DP__HELLO_NS;
    return;
  }
  dp__am_shm_ctl_t h = {DP__WIRE_MAGIC, 0, 0};
  dp__tp_ctl_queue(ep, DP__AM_LANE_HELLO, &h, sizeof h);
}

/* The acceptor's HELLO opens the lane: sent on it once UCX has wired it
 * (tried every pass). A lane not wired in DP__HELLO_NS is given up: HELLO 0
 * on the connection. */
void dp__tp_lane_hello(dp_endpoint_t *ep) {
  dp__am_shm_ctl_t h = {DP__WIRE_MAGIC, 1, 0};
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  if (!UCS_PTR_IS_ERR(dp__tp_lane_send(ep, DP__AM_LANE_HELLO, &h, sizeof h, NULL, 0, &p))) {
    ep->lane = LANE_ON;
    return;
  }
  if (now_ns() < ep->hello_deadline) return;
  dp__tp_lane_close(ep);
  h.value = 0;
  dp__tp_ctl_queue(ep, DP__AM_LANE_HELLO, &h, sizeof h);
}

/* The lane is no longer used. Its endpoint is not closed (UCX 1.13 cannot
 * close one without error handling by force, nor flush one to a dead
 * peer): it goes with the lane's worker when the endpoint is freed, and
 * holds no request meanwhile (lane_send). */
void dp__tp_lane_close(dp_endpoint_t *ep) {
  ep->lane = LANE_NONE;
  ep->dep = NULL;
}

/* An endpoint's memory, once UCX let go of it. */
void dp__tp_ep_free_mem(dp_endpoint_t *ep) {
  dp__tp_lane_file_drop(ep);
  dp__tp_lane_worker_free(ep);
  dp__tp_park_drop(ep->t, ep, 0); /* none left, but for one parked after the close: its worker may be gone */
  dp__free(ep, sizeof *ep);
}

void dp__tp_on_conn(ucp_conn_request_h req, void *arg) {
  dp_listener_t *l = arg;
  dp_transport_t *t = l->t;
  dp_endpoint_t *ep;
  /* where the peer connects from, asked before the request is used up; the
     endpoint's name (every error of it) says so: "endpoint accepted on port
     N" alone was the name of every connection a listener took, and a
     server's errors could not tell its clients apart */
  ucp_conn_request_attr_t ra;
  ra.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  int known = ucp_conn_request_query(req, &ra) == UCS_OK;
  char from[INET6_ADDRSTRLEN + 16] = "";
  if (known && ra.client_address.ss_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)&ra.client_address;
    char host[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &in->sin_addr, host, sizeof host))
      snprintf(from, sizeof from, "from %s:%d ", host, ntohs(in->sin_port));
  } else if (known && ra.client_address.ss_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ra.client_address;
    char host[INET6_ADDRSTRLEN];
    if (inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host))
      snprintf(from, sizeof from, "from [%s]:%d ", host, ntohs(in6->sin6_port));
  }
  char name[96];
  snprintf(name, sizeof name, "endpoint %saccepted on port %d", from, l->port);
  if (l->closed || dp__tp_ep_alloc(t, name, &ep, NULL)) {
    ucp_listener_reject(l->l, req);
    return;
  }
  ep->peer_local = known && dp__tp_addr_is_local(&ra.client_address);
  ucp_ep_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = req;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = dp__tp_ep_err_cb;
  p.err_handler.arg = ep;
  if (ucp_ep_create(t->worker, &p, &ep->ep) != UCS_OK) {
    /* not rejected here: a failed ucp_ep_create has used the request up
       (UCX rejects and frees it on its failure paths) */
    dp__free(ep, sizeof *ep);
    return;
  }
  ep->established = 1; /* the peer asked for it */
  ep->acceptor = 1;
  dp__am_shm_ctl_t acc = {DP__WIRE_MAGIC, 0, 0};
  dp__tp_ctl_queue(ep, DP__AM_ACCEPT, &acc, sizeof acc); /* sent by the loop: the connector knows it was accepted */
  ep->queued = 1; /* before it is in the list dp_transport_free reads */
  dp__tp_ep_link(t, ep);
  dp__tp_ep_index(t, ep); /* fails ep when it cannot */
  pthread_mutex_lock(&t->mu);
  if (l->acc_tail) l->acc_tail->acc_next = ep;
  else l->acc_head = ep;
  l->acc_tail = ep;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}
