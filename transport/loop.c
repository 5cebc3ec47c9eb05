/* transport/loop.c — the progress loop: a pass, the progress thread,
 * caller-driven progress. */
#include <arpa/inet.h>

#include "tp.h"
#include "../future/internal.h"

_Thread_local dp_transport_t *dp__tp_in_pass;

/* ---- the progress thread ---- */

static void close_flushed(dp_endpoint_t *ep);

static void ep_close_now(dp_transport_t *t, dp_endpoint_t *ep) {
  size_t ns = ep->nsends, nr = 0;
  for (rwait_t *w = ep->w_head; w; w = w->next) nr++;
  if (!ep->dead) {
    dp_error_t e;
    if (ns || nr)
      dp__err(&e, DP_ECANCELED, "transport: %s: closed with %zu send%s and %zu receive%s pending", ep->name, ns,
              ns == 1 ? "" : "s", nr, nr == 1 ? "" : "s");
    else /* its error all the same: a command queued behind the close fails with it */
      dp__err(&e, DP_ECANCELED, "transport: %s: closed (dp_endpoint_free)", ep->name);
    /* a connector that never heard from its peer sends no CLOSE: its
       connection may not be made yet (and a listener of this process may be
       freed next, under the request: openucx/ucx#11087) */
    int up = ep->ep && (ep->acceptor || ep->established);
    if (ns || (nr && !up)) {
      dp__tp_ep_fail(ep, &e); /* a value may be half sent: closed by force */
    } else {
      /* receives only pending: they fail, and the close is graceful (the
         peer needs nothing of them) */
      dp__tp_ep_cancel_recvs(ep, &e);
      dp__tp_ep_drop_received(t, ep);
      /* the peer's slots whose copies run here go back before the close,
         or its sends would fail with the connection */
      for (rdone_t *r = t->rdone; r; r = r->next)
        if (r->ep == ep) {
          dp_event_synchronize(r->ev, NULL);
          dp__tp_shm_done(ep, r->slot);
          r->ep = NULL;
        }
      /* the last message: CLOSE, counting the values sent, so that the
         peer tells this close from a death (internal.h, CLOSE) */
      if (up) {
        dp__am_shm_ctl_t c = {DP__WIRE_MAGIC, 0, ep->send_seq};
        dp__tp_ctl_queue(ep, DP__AM_CLOSE, &c, sizeof c);
      }
      dp__tp_ctl_flush(t, ep);
      int failed = ep->dead; /* a send failed it: closed by force */
      dp__tp_ep_drop_shm(t, ep);
      dp__tp_lane_close(ep);
      ep->dead = 1;
      /* the UCX endpoint is closed once the peer answers that it has
         every value (reap), or after DP__CLOSE_WAIT_NS */
      if (up && !failed) ep->answer_deadline = now_ns() + DP__CLOSE_WAIT_NS;
      else if (ep->ep && !failed) close_flushed(ep);
    }
  } else if (ep->rq_head) {
    dp__tp_ep_drop_received(t, ep); /* values the peer's close left untaken */
  }
  if (ep->need_close) dp__tp_ep_force_close(ep);
  dp__tp_ep_unlink(t, ep);
}

/* A graceful close's UCX endpoint goes: flushed, or by force once the
 * rendezvous receives posted on it are done. */
static void close_flushed(dp_endpoint_t *ep) {
  ep->answer_deadline = 0;
  if (ep->rndv_inflight) {
    ep->need_close = 1; /* the peer's buffers still arrive: by force once they have */
  } else {
    /* flush: eager messages whose sends completed may not have left yet */
    ucp_request_param_t p = {0};
    void *r = ucp_ep_close_nbx(ep->ep, &p);
    if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
  }
}

/* Why UCX could not listen. It says "Input/output error" for most bind()
 * failures, whatever the reason (an address not of this machine, a
 * privileged port): a bind of our own to the same address, which UCX
 * made with SO_REUSEADDR too, finds the system's reason. */
static int listen_failed(cmd_t *c, ucs_status_t st) {
  char host[INET_ADDRSTRLEN] = "?";
  int port = 0;
  if (c->addr.ss_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)&c->addr;
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
  }
  /* the port is what is in use: the message names it, as HOST:PORT */
  if (st == UCS_ERR_BUSY)
    return dp__err(&c->err, DP_EIO, "transport: cannot listen on %s:%d: the address is in use (UCX: Device is busy)",
                   host, port);
  int fd = socket(c->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1, why = 0;
  if (fd >= 0) {
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (const struct sockaddr *)&c->addr, c->addrlen)) why = errno;
    close(fd);
  }
  if (why == EADDRNOTAVAIL)
    return dp__err(&c->err, DP_EIO, "transport: cannot listen on %s: it is not an address of this machine (%s)", host,
                   strerror(why));
  if (why == EADDRINUSE)
    return dp__err(&c->err, DP_EIO, "transport: cannot listen on %s:%d: the address is in use (%s)", host, port,
                   strerror(why));
  if (why)
    return dp__err(&c->err, DP_EIO, "transport: cannot listen on %s: %s", host, strerror(why));
  return dp__err(&c->err, DP_EIO, "transport: cannot listen on %s: %s", host, ucs_status_string(st));
}

/* Queues c for the next drain; returns whether the progress thread was
 * asleep then (the caller wakes it, or, on the loop's thread, need not). */
int dp__tp_queue_cmd(dp_transport_t *t, cmd_t *c) {
  pthread_mutex_lock(&t->mu);
  c->next = NULL;
  if (t->c_tail) t->c_tail->next = c;
  else t->c_head = c;
  t->c_tail = c;
  atomic_store_explicit(&t->queued, 1, memory_order_release);
  int asleep = t->sleeping;
  pthread_mutex_unlock(&t->mu);
  return asleep;
}

static void handle_cmd(dp_transport_t *t, cmd_t *c) {
  switch (c->type) {
  case CMD_LISTEN: {
    dp_listener_t *l = c->lst;
    ucp_listener_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = (const struct sockaddr *)&c->addr;
    p.sockaddr.addrlen = c->addrlen;
    p.conn_handler.cb = dp__tp_on_conn;
    p.conn_handler.arg = l;
    ucs_status_t st = ucp_listener_create(t->worker, &p, &l->l);
    if (st != UCS_OK) {
      dp__tp_cmd_finish(t, c, listen_failed(c, st));
      return;
    }
    ucp_listener_attr_t a;
    a.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(l->l, &a) == UCS_OK) {
      if (a.sockaddr.ss_family == AF_INET) l->port = ntohs(((struct sockaddr_in *)&a.sockaddr)->sin_port);
      else if (a.sockaddr.ss_family == AF_INET6) l->port = ntohs(((struct sockaddr_in6 *)&a.sockaddr)->sin6_port);
    }
    pthread_mutex_lock(&t->mu); /* dp_transport_free reads the list */
    l->next = t->lsts;
    t->lsts = l;
    pthread_mutex_unlock(&t->mu);
    dp__tp_cmd_finish(t, c, 0);
    return;
  }
  case CMD_UNLISTEN: {
    dp_listener_t *l = c->lst;
    if (l->l) ucp_listener_destroy(l->l);
    pthread_mutex_lock(&t->mu);
    for (dp_listener_t **p = &t->lsts; *p; p = &(*p)->next)
      if (*p == l) {
        *p = l->next;
        break;
      }
    dp_endpoint_t *a = l->acc_head;
    l->acc_head = l->acc_tail = NULL;
    l->closed = 1;
    pthread_mutex_unlock(&t->mu);
    while (a) {
      dp_endpoint_t *n = a->acc_next;
      if (t->nested) {
        /* from a callback (dp__tp_run_now): the loop closes it after the
           callback, as it closes an endpoint a callback frees */
        cmd_t *cc = &a->close_cmd;
        memset(cc, 0, sizeof *cc);
        cc->type = CMD_CLOSE;
        cc->ep = a;
        cc->detached = 1;
        a->free_asked = 1;
        (void)dp__tp_queue_cmd(t, cc); /* on the loop's thread: no wake */
      } else {
        ep_close_now(t, a);
        a->next = t->closing;
        t->closing = a;
      }
      a = n;
    }
    dp__tp_cmd_finish(t, c, 0);
    return;
  }
  case CMD_CONNECT: {
    dp_endpoint_t *ep = c->ep;
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = (const struct sockaddr *)&c->addr;
    p.sockaddr.addrlen = c->addrlen;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = dp__tp_ep_err_cb;
    p.err_handler.arg = ep;
    dp__tp_ep_link(t, ep);
    ucs_status_t st = ucp_ep_create(t->worker, &p, &ep->ep);
    if (st != UCS_OK) {
      ep->ep = NULL;
      dp__tp_ep_failf(ep, DP_EIO, "cannot connect (%s)", ucs_status_string(st));
    } else if (!dp__tp_ep_index(t, ep)) {
      ep->peer_local = dp__tp_addr_is_local(&c->addr);
      ep->born = now_ns();
      dp__tp_lane_offer(t, ep);
    }
    dp__free(c, sizeof *c);
    return;
  }
  case CMD_SEND: {
    sop_t *s = c->sop;
    dp_endpoint_t *ep = c->ep;
    dp__free(c, sizeof *c);
    if (ep->dead) {
      dp_error_t e;
      dp_endpoint_error(ep, &e);
      dp__tp_sop_fail(s, &e);
      dp__tp_sop_free(s);
      return;
    }
    s->ep = ep;
    s->t = t;
    ep->nsends++;
    if (ep->sq_tail) ep->sq_tail->next = s;
    else ep->sq_head = s;
    ep->sq_tail = s;
    dp__tp_ep_pump_sends(t, ep);
    return;
  }
  case CMD_RECV: {
    rwait_t *w = c->rw;
    dp_endpoint_t *ep = c->ep;
    dp__free(c, sizeof *c);
    if (ep->dead && !ep->rq_head) { /* (values the peer's close left are still taken) */
      dp_error_t e;
      dp_endpoint_error(ep, &e);
      dp_future_set_error(w->f, &e, NULL);
      dp_future_release(w->f);
      dp__free(w, sizeof *w);
      return;
    }
    if (ep->w_tail) ep->w_tail->next = w;
    else ep->w_head = w;
    ep->w_tail = w;
    dp__tp_deliver(t, ep);
    if (!ep->dead) dp__tp_ep_pump_inbox(t, ep);
    return;
  }
  case CMD_CLOSE: {
    dp_endpoint_t *ep = c->ep;
    ep_close_now(t, ep);
    ep->next = t->closing;
    t->closing = ep;
    if (!c->detached) dp__tp_cmd_finish(t, c, 0); /* a detached one is the endpoint's own: nobody waits */
    return;
  }
  case CMD_STOP:
    t->stop = 1;
    dp__tp_cmd_finish(t, c, 0);
    return;
  case CMD_SYNC: /* handled after every command queued before it */
    dp__tp_cmd_finish(t, c, 0);
    return;
  }
}

/* Caller-driven, from a callback a pass runs (dp_listener_new,
 * dp_listener_free, which wait for their command): c alone is taken out of
 * the queue and run now. The whole queue was drained there once — closes,
 * sends and receives that callbacks had queued ran inside the callback, and
 * so inside UCX's callback and the pass's walk of the endpoints: an endpoint
 * closed by force from a send's completion callback had its peer's
 * rendezvous receive purged under UCX, which then wrote into freed memory.
 * What else is queued waits for the next drain, as it does anywhere in a
 * callback. */
void dp__tp_run_now(dp_transport_t *t, cmd_t *c) {
  pthread_mutex_lock(&t->mu);
  cmd_t *prev = NULL;
  for (cmd_t *x = t->c_head; x && x != c; x = x->next) prev = x;
  if (prev ? prev->next == c : t->c_head == c) {
    if (prev) prev->next = c->next;
    else t->c_head = c->next;
    if (t->c_tail == c) t->c_tail = prev;
  }
  c->next = NULL;
  pthread_mutex_unlock(&t->mu);
  int outer = t->nested;
  t->nested = 1;
  handle_cmd(t, c);
  t->nested = outer;
}

int dp__tp_drain_cmds(dp_transport_t *t) {
  if (!atomic_load_explicit(&t->queued, memory_order_acquire)) return 0;
  pthread_mutex_lock(&t->mu);
  atomic_store_explicit(&t->queued, 0, memory_order_relaxed);
  cmd_t *c = t->c_head;
  t->c_head = t->c_tail = NULL;
  pthread_mutex_unlock(&t->mu);
  int n = 0;
  while (c) {
    cmd_t *next = c->next;
    handle_cmd(t, c);
    c = next;
    n++;
  }
  return n;
}

/* Frees closed endpoints once UCX is done with them. */
static void reap(dp_transport_t *t) {
  for (dp_endpoint_t **p = &t->closing; *p;) {
    dp_endpoint_t *ep = *p;
    if (ep->answer_deadline && !ep->answered && now_ns() < ep->answer_deadline) { /* the CLOSE's answer */
      p = &ep->next;
      continue;
    }
    if (ep->answer_deadline) close_flushed(ep);
    if (ep->need_close) dp__tp_ep_force_close(ep);
    if (ep->need_close || ep->rndv_inflight ||
        (ep->close_req && ucp_request_check_status(ep->close_req) == UCS_INPROGRESS)) {
      p = &ep->next;
      continue;
    }
    if (ep->close_req) ucp_request_free(ep->close_req);
    *p = ep->next;
    dp__tp_ep_free_mem(ep);
  }
}

_Atomic unsigned long dp__transport_timeout_steps, dp__transport_timeout_checks;

static void check_timeouts(dp_transport_t *t) {
  int64_t now = now_ns();
  char ms[48]; /* the timeout, as every message says it: "200 ms", "1.5 ms", "0.000001 ms" */
  long long whole = (long long)(t->timeout_ns / 1000000), frac = (long long)(t->timeout_ns % 1000000);
  int k = snprintf(ms, sizeof ms, "%lld", whole);
  if (frac) { /* a timeout under a millisecond, or not a whole number of them, is not rounded down */
    k += snprintf(ms + k, sizeof ms - (size_t)k, ".%06lld", frac);
    while (ms[k - 1] == '0') ms[--k] = '\0';
  }
  snprintf(ms + k, sizeof ms - (size_t)k, " ms");
  for (dp_endpoint_t *ep = t->eps, *n; ep; ep = n) {
    n = ep->next;
    if (!ep->acceptor && !ep->established && !ep->dead && ep->born && now - ep->born > t->timeout_ns) {
      dp__tp_ep_failf(ep, DP_ETIMEDOUT, "the peer did not accept the connection within %s", ms);
      continue;
    }
    /* a peer that stopped taking leaves no posted send once its credit is
       used (small values complete as they go): the wait for its grant is
       timed as a posted send is */
    if (ep->credit_wait && ep->sq_head && !ep->dead && now - ep->credit_wait > t->timeout_ns) {
      dp__tp_ep_failf(ep, DP_ETIMEDOUT, "a send waited for the peer's credit for over %s", ms);
      continue;
    }
    rmsg_t *m = ep->cur;
    if (m && m->deadline && m->next_index < m->nbuf && !ep->dead && now > m->deadline) {
      dp__tp_ep_failf(ep, DP_ETIMEDOUT, "a value's buffers stopped arriving: none for %s", ms);
      continue;
    }
    /* a frame or a buffer the peer sent by rendezvous arrives as this side
       pulls it: a peer that stops serving the pull (stopped, hung) once
       held the receive forever, its header having come */
    if (ep->rndv_inflight && ep->pull_deadline && !ep->dead && now > ep->pull_deadline) {
      dp__tp_ep_failf(ep, DP_ETIMEDOUT, "a value stopped arriving: a rendezvous transfer from the peer made no "
                      "progress for %s", ms);
      continue;
    }
    /* the oldest posted send only: every deadline is set as its send is
       posted, with the same timeout, and a send is pushed at the list's
       head, so none behind the oldest expires before it (a walk of all
       of them cost each check a step per send posted, every millisecond) */
    sop_t *s = ep->posted_tail;
    if (s) atomic_fetch_add_explicit(&dp__transport_timeout_steps, 1, memory_order_relaxed);
    if (s && s->deadline && now > s->deadline && !ep->dead)
      dp__tp_ep_failf(ep, DP_ETIMEDOUT, "a send was not complete after %s", ms);
  }
  atomic_fetch_add_explicit(&dp__transport_timeout_checks, 1, memory_order_relaxed);
}

/* Slots whose copies completed go back to their pools (an orphan's send,
 * failed, is freed with its last piece). 1 while some copies still run. */
static int poll_slots(dp_transport_t *t) {
  for (slot_t **p = &t->rx_busy; *p;) {
    slot_t *sl = *p;
    if (dp_event_query(sl->ev, NULL) == 0) {
      p = &sl->next;
      continue;
    }
    *p = sl->next;
    dp__tp_slot_put(t, &t->rx, sl);
  }
  for (piece_t **p = &t->orphans; *p;) {
    piece_t *pc = *p;
    if (dp_event_query(pc->slot->ev, NULL) == 0) {
      p = &pc->next;
      continue;
    }
    *p = pc->next;
    sop_t *s = pc->s;
    dp__tp_slot_put(t, &t->tx, pc->slot);
    dp__free(pc, sizeof *pc);
    if (--s->outstanding == 0) dp__tp_sop_free(s);
  }
  while (t->rx_wait_head) { /* rendezvous pieces that waited for a slot */
    rctx_t *c = t->rx_wait_head;
    rmsg_t *m = c->m;
    slot_t *sl = NULL;
    dp_error_t e;
    int rc = (m->detached || m->failed) ? 0 : dp__tp_slot_get(t, &t->rx, DP__STAGE_CHUNK, 0, &sl, &e);
    if (!rc && !sl && !m->detached && !m->failed) break;
    t->rx_wait_head = c->next;
    if (!t->rx_wait_head) t->rx_wait_tail = NULL;
    c->next = NULL;
    if (rc || m->detached || m->failed) { /* its endpoint failed meanwhile, or no memory */
      dp_endpoint_t *ep = c->ep;
      int detached = m->detached;
      dp__tp_rndv_release(t->worker, c->data);
      dp__free(c, sizeof *c);
      if (--m->pending == 0 && detached) dp__tp_rmsg_free(m);
      if (rc && !detached) dp__tp_ep_fail(ep, &e);
      continue;
    }
    c->slot = sl;
    void *data = c->data;
    c->data = NULL;
    dp__tp_post_recv(t, c, data);
  }
  for (rdone_t **p = &t->rdone; *p;) { /* copies out of peers' slots */
    rdone_t *r = *p;
    if (dp_event_query(r->ev, NULL) == 0) {
      p = &r->next;
      continue;
    }
    *p = r->next;
    if (r->ep && !r->ep->dead) dp__tp_shm_done(r->ep, r->slot);
    dp__shm_release(r->shm);
    dp_event_free(r->ev);
    dp__free(r, sizeof *r);
  }
  return t->rx_busy || t->orphans || t->rx_wait_head || t->rdone;
}

#define DP__SPIN_NS 200000
#define DP__CLOSING_SLEEP_MS 10 /* the longest sleep while closes are in progress (their deadlines) */

/* Arms the workers (the transport's and the lanes') and lists their
 * descriptors and the command queue's in t->pfd, the queue's first; 0 when
 * a worker has events already (or no memory for the list: poll again). */
static size_t arm_all(dp_transport_t *t) {
  size_t n = 2;
  for (dp_endpoint_t *ep = t->eps; ep; ep = ep->next) n += ep->dw != NULL;
  if (n > t->pfd_cap) {
    size_t cap = n * 2;
    struct pollfd *p = dp__alloc(cap * sizeof *p);
    if (!p) return 0;
    if (t->pfd) dp__free(t->pfd, t->pfd_cap * sizeof *t->pfd);
    t->pfd = p;
    t->pfd_cap = cap;
  }
  t->main_idle = 0; /* the pass after a sleep progresses every worker */
  if (ucp_worker_arm(t->worker) == UCS_ERR_BUSY) return 0;
  t->pfd[0] = (struct pollfd){t->wake_fd, POLLIN, 0};
  t->pfd[1] = (struct pollfd){t->worker_fd, POLLIN, 0};
  n = 2;
  for (dp_endpoint_t *ep = t->eps; ep; ep = ep->next) {
    if (!ep->dw) continue;
    if (ucp_worker_arm(ep->dw) == UCS_ERR_BUSY) return 0;
    t->pfd[n++] = (struct pollfd){ep->dw_fd, POLLIN, 0};
  }
  return n;
}

/* One pass of the progress loop: commands, UCX's workers, each endpoint's
 * queues, slots, closes, timeouts. Returns the work done; *polling when
 * copies or events are polled (work to come without UCX's wake-up). */
int dp__tp_pass(dp_transport_t *t, int *polling_out) {
  /* a future a send waits for that completes from here on may do so after
     its endpoint was looked at (a then() of a send this pass completes, a
     receive that a timeout fails): its send goes next pass, which is work */
  t->rings_seen = atomic_load_explicit(&t->waker->rings, memory_order_acquire);
  int work = dp__tp_drain_cmds(t);
  if (t->stop) return work;
  if (!t->lanes_all || !t->main_idle || ++t->main_skipped >= DP__MAIN_EVERY) {
    int before = work;
    while (ucp_worker_progress(t->worker)) work++;
    t->main_idle = work == before;
    t->main_skipped = 0;
  }
  int polling = 0, lanes_all = t->eps != NULL;
  for (dp_endpoint_t *ep = t->eps; ep; ep = ep->next) {
    if (!ep->dead && ep->lane != LANE_ON) lanes_all = 0;
    if (ep->dw)
      while (ucp_worker_progress(ep->dw)) work++;
    /* a failed endpoint's lane is of no more use: its worker goes now, not
       when the endpoint is freed — one whose peer went while it waited in
       the listener's queue held the worker's descriptors, segments and
       place among the DP__LANES_MAX until the application accepted and
       freed it. A connector's offer still unanswered keeps it until its
       file goes: a peer that read the address meanwhile would connect to
       a worker that is gone (UCX prints an error there) */
    if (ep->dead && ep->dw && !ep->lane_file) dp__tp_lane_worker_free(ep);
    if (ep->lane_name[0] && !ep->dead) dp__tp_lane_connect(t, ep), work++;
    if (ep->lane_file && now_ns() > ep->lane_deadline) dp__tp_lane_file_drop(ep); /* unanswered */
    if (ep->lane == LANE_HELLO && !ep->dead) dp__tp_lane_hello(ep);
    if (ep->lane_drop) { /* the connector has no lane: the worker goes */
      ep->lane_drop = 0;
      dp__tp_lane_worker_free(ep);
    }
    if (ep->offer_pending && !ep->dead) dp__tp_shm_answer(t, ep), work++;
    if (ep->peer_closed && !ep->dead) dp__tp_peer_close_check(t, ep);
    if (ep->need_close) dp__tp_ep_force_close(ep), work++;
    if (ep->ctl_head && !ep->dead) dp__tp_ctl_flush(t, ep), work++;
    if (ep->shm_state == SHM_OFFERED && now_ns() > ep->offer_deadline) dp__tp_shm_withdraw(ep);
    if (ep->sq_head || ep->posting) polling |= dp__tp_ep_pump_sends(t, ep);
    if (ep->nparked && !ep->dead) dp__tp_ep_pump_inbox(t, ep);
  }
  t->lanes_all = lanes_all;
  if (t->rx_busy || t->orphans || t->rx_wait_head || t->rdone) polling |= poll_slots(t);
  if (t->closing) reap(t);
  if (t->timeout_ns > 0 && now_ns() - t->last_check > 1000000) {
    check_timeouts(t);
    t->last_check = now_ns();
  }
  /* closes in progress wait for UCX (its events wake a sleep) or for a
     deadline (a sleep is cut to DP__CLOSING_SLEEP_MS for them): no polling,
     which spun a core for as long as a close to a stopped peer lasted —
     until dp_transport_free */
  *polling_out = polling;
  if (atomic_load_explicit(&t->waker->rings, memory_order_acquire) != t->rings_seen) work++;
  return work;
}

/* ---- caller-driven progress ---- */

/* One pass on the calling thread (under pmu: one thread at a time); 0 from
 * inside this thread's own pass (a callback it runs). Returns the work
 * done, or 1 while copies are polled. */
int dp__tp_caller_pass(dp_transport_t *t) {
  if (dp__tp_in_pass == t) return 0;
  pthread_mutex_lock(&t->pmu);
  dp_transport_t *outer = dp__tp_in_pass;
  dp__tp_in_pass = t;
  dp__future_loop_frame_t fr; /* its callbacks' waits on its futures refused: no pass runs meanwhile */
  dp__future_loop_enter(&fr, t);
  int polling = 0;
  int work = t->stop ? 0 : dp__tp_pass(t, &polling);
  dp__future_loop_leave(&fr);
  dp__tp_in_pass = outer;
  pthread_mutex_unlock(&t->pmu);
  return work || polling;
}

/* The queued commands only (a send posts what it can), on the calling
 * thread under pmu. */
void dp__tp_caller_commands(dp_transport_t *t) {
  /* every 16th, a whole pass: a thread that only sends still sees its
     sends complete, its lanes come up and its peers fail */
  if (++t->ncommands % 16 == 0) {
    dp__tp_caller_pass(t);
    return;
  }
  pthread_mutex_lock(&t->pmu);
  dp_transport_t *outer = dp__tp_in_pass;
  dp__tp_in_pass = t;
  dp__future_loop_frame_t fr;
  dp__future_loop_enter(&fr, t);
  if (!t->stop) dp__tp_drain_cmds(t);
  dp__future_loop_leave(&fr);
  dp__tp_in_pass = outer;
  pthread_mutex_unlock(&t->pmu);
}

#define CALLER_FDS 64
_Static_assert(DP__LANES_MAX + 2 <= CALLER_FDS, "a caller's poll sees every worker");

/* Nothing to do for a while (*idle_since: since when; now: the time): spin
 * on (yielding the core now and then) up to DP__SPIN_NS, then sleep on the
 * workers' descriptors, at most until deadline (< 0: none) and 10 ms. */
static void caller_idle(dp_transport_t *t, int64_t *idle_since, int64_t deadline, int64_t now) {
  if (!*idle_since) *idle_since = now;
  if (now - *idle_since < DP__SPIN_NS) {
    sched_yield(); /* the peer may need this core */
    return;
  }
  if (dp__tp_in_pass == t) return;
  struct pollfd fds[CALLER_FDS];
  pthread_mutex_lock(&t->pmu);
  size_t n = arm_all(t);
  if (n > CALLER_FDS) n = CALLER_FDS; /* the others are seen at the next pass */
  if (n) memcpy(fds, t->pfd, n * sizeof *fds);
  pthread_mutex_unlock(&t->pmu);
  if (!n) return;
  pthread_mutex_lock(&t->mu);
  int queued = t->c_head != NULL;
  t->sleeping = !queued;
  pthread_mutex_unlock(&t->mu);
  if (!queued) {
    int64_t ms = 10;
    if (deadline >= 0 && (deadline - now) / 1000000 < ms) ms = (deadline - now) / 1000000;
    poll(fds, n, ms > 0 ? (int)ms : 0);
  }
  pthread_mutex_lock(&t->mu);
  t->sleeping = 0;
  pthread_mutex_unlock(&t->mu);
  if (fds[0].revents & POLLIN) {
    uint64_t v;
    ssize_t r = read(t->wake_fd, &v, sizeof v);
    (void)r;
  }
  *idle_since = 0;
}

/* The transports this thread drives (dp__tp_caller_until), innermost
 * first: each frame on the stack of the call that drives. */
typedef struct drive_frame {
  const dp_transport_t *t;
  struct drive_frame *outer;
} drive_frame_t;
static _Thread_local drive_frame_t *driving;

int dp__tp_driven_here(const dp_transport_t *t) {
  for (const drive_frame_t *f = driving; f; f = f->outer)
    if (f->t == t) return 1;
  return 0;
}

/* Caller-driven: runs passes until done(arg) or the deadline (< 0: none);
 * 1 when done. While it runs, dp_transport_free of t on this thread is
 * refused: done() may run callbacks that a pass queued (dp_transport_wait
 * in a callback), and one that freed t left this loop passing a freed
 * transport. */
int dp__tp_caller_until(dp_transport_t *t, int (*done)(void *), void *arg, int64_t timeout_ns) {
  int64_t now0 = now_ns();
  int64_t deadline = timeout_ns < 0 || timeout_ns > INT64_MAX - now0 ? -1 : now0 + timeout_ns;
  int64_t idle_since = 0;
  drive_frame_t fr = {t, driving};
  driving = &fr;
  int r;
  for (unsigned i = 1;; i++) {
    if (done(arg)) {
      r = 1;
      break;
    }
    int busy = dp__tp_caller_pass(t);
    if (busy) idle_since = 0;
    if (i % 32) continue; /* the clock is read every 32 passes */
    int64_t now = now_ns();
    if (deadline >= 0 && now >= deadline) {
      r = done(arg);
      break;
    }
    if (!busy) caller_idle(t, &idle_since, deadline, now);
  }
  driving = fr.outer;
  return r;
}

/* After CMD_STOP: closes in progress finish (bounded: a flush to a dead
 * peer fails), then the copies into and out of slots.
 *
 * The worker goes after DP__DRAIN_NS at most, and UCX 1.13 aborts the
 * process when it destroys an endpoint that still holds a request (a pull
 * of a peer that stopped answering). A close waits up to DP__CLOSE_WAIT_NS
 * for its CLOSE's answer and as long again for its pulls, together as long
 * as the drain: one that began just before it was forced just after the
 * worker went. So the waits still running are cut to DP__HURRY_NS from
 * here, and what is forced then has the rest of the drain to be purged. */
#define DP__DRAIN_NS 2000000000ll
#define DP__HURRY_NS (DP__CLOSE_WAIT_NS / 2)
void dp__tp_drain_stopped(dp_transport_t *t) {
  int64_t start = now_ns();
  t->hurry = start + DP__HURRY_NS;
  for (dp_endpoint_t *ep = t->closing; ep; ep = ep->next) {
    if (ep->answer_deadline) ep->answer_deadline = dp__tp_by_hurry(t, ep->answer_deadline);
    if (ep->close_deadline) ep->close_deadline = dp__tp_by_hurry(t, ep->close_deadline);
  }
  for (int64_t until = start + DP__DRAIN_NS; (t->closing || t->nreq) && now_ns() < until;) {
    ucp_worker_progress(t->worker);
    reap(t);
  }
  while (poll_slots(t)) sched_yield();
  for (int i = 0; i <= DP_DEVICE_INDEX_MAX; i++)
    if (t->streams[i]) dp_reset_current_stream(t->backend, dp_stream_device(t->streams[i]));
}

void *dp__tp_progress_main(void *arg) {
  dp_transport_t *t = arg;
  dp__tp_in_pass = t; /* this thread runs every pass: a callback's call that waits for one runs it here */
  /* and only this thread completes the transport's futures: a callback's
     wait on one of them would wait forever (refused: future/internal.h) */
  dp__future_loop_frame_t fr;
  dp__future_loop_enter(&fr, t);
  int64_t idle_since = 0; /* 0: busy */
  unsigned spins = 0;
  while (!t->stop) {
    int polling = 0;
    int work = dp__tp_pass(t, &polling);
    if (t->stop) break;
    if (work) {
      idle_since = 0;
      continue;
    }
    if (polling) {
      sched_yield();
      continue;
    }
    /* spin a while after the last work (a reply often follows at once),
     * then sleep on the worker's and the command queue's descriptors */
    if (!idle_since) idle_since = now_ns();
    if (++spins % t->yield_every) continue; /* the clock and the yield: every yield_every idle passes */
    if (now_ns() - idle_since < DP__SPIN_NS) {
      sched_yield(); /* the threads this one waits for may need the core */
      continue;
    }
    size_t nfd = arm_all(t);
    if (!nfd) continue;
    pthread_mutex_lock(&t->mu);
    int queued = t->c_head != NULL;
    t->sleeping = !queued;
    pthread_mutex_unlock(&t->mu);
    if (queued) continue;
    poll(t->pfd, nfd, t->timeout_ns > 0 || t->closing ? DP__CLOSING_SLEEP_MS : 100);
    pthread_mutex_lock(&t->mu);
    t->sleeping = 0;
    pthread_mutex_unlock(&t->mu);
    if (t->pfd[0].revents & POLLIN) {
      uint64_t v;
      ssize_t r = read(t->wake_fd, &v, sizeof v);
      (void)r;
    }
    idle_since = 0;
  }
  dp__tp_drain_stopped(t);
  dp__future_loop_leave(&fr);
  return NULL;
}
