/* transport/transport.c — values over UCX active messages (transport.h):
 * commands, endpoints and their failure, the API.
 *
 * One progress loop owns the UCX workers (UCS_THREAD_MODE_SINGLE): every
 * UCX call and every change to an endpoint's send and receive state happens
 * in a pass of it (loop.c), on the progress thread or, caller-driven, under
 * the transport's pass lock. API calls queue a command and wake the thread
 * through an eventfd; the few that must answer (listen, close) wait on the
 * transport's condition variable for it. The other files: tp.h. */
#include <arpa/inet.h>

#include "tp.h"
#include "../future/internal.h"
#include "../pickler/frame.h" /* dp__unpickle_opts_check */

int dp__transport_skip_events;
int dp__transport_skip_credit;
_Atomic int dp__transport_fail_in_rndv;
_Atomic int dp__transport_fail_in_post;
int dp__transport_stage_host;
int dp__transport_mute_offers;
_Atomic unsigned long dp__transport_shm_pieces;
_Atomic unsigned long dp__transport_lane_msgs;
void (*dp__transport_accept_gap)(void);
_Atomic unsigned long dp__transport_slot_waits;
_Atomic unsigned long dp__transport_shm_accepted;
_Atomic unsigned long dp__transport_frames_in;
_Atomic unsigned long dp__transport_closes_in;
_Atomic unsigned long dp__transport_ready_unclaimed;

/* ---- small things ---- */

/* Forks this process went through, counted in each child (pthread_atfork):
 * a transport made before one belongs to the parent. In the child its UCX
 * sockets and shared memory are the parent's connections, its progress
 * thread does not exist and its locks may be held forever (copied while a
 * parent's thread held them): no call there may touch any of it. */
static _Atomic unsigned dp__tp_forks;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
/* Transports alive in this process, and the process that made them when
 * this one is a child forked while one was (0: none; it stays: the
 * transport, the parent's, is never freed here). UCX's state in such a
 * child is a copy of the parent's, and the thread UCX started to watch its
 * sockets, which it reuses for every later context, stayed with the
 * parent: a transport the child made connected nowhere (an accept timed
 * out, sends never completed) and UCX aborted the process freeing it. */
static _Atomic unsigned dp__tp_live;
static long dp__tp_forked_from;
static void on_fork_child(void) {
  atomic_fetch_add_explicit(&dp__tp_forks, 1, memory_order_relaxed);
  if (atomic_load_explicit(&dp__tp_live, memory_order_relaxed) && !dp__tp_forked_from)
    dp__tp_forked_from = (long)getppid();
}
static void fork_hook(void) { pthread_atfork(NULL, NULL, on_fork_child); }

/* 1 in a child forked after t was made: fills err. */
static int forked(const dp_transport_t *t, const char *fn, dp_error_t *err) {
  if (atomic_load_explicit(&dp__tp_forks, memory_order_relaxed) == t->forks) return 0;
  dp__err(err, DP_EINVAL,
          "%s: the transport belongs to process %ld, which forked this one: a child cannot use it (transport.h)", fn,
          t->pid);
  return 1;
}

/* forked(), for the calls that return nothing: a line on stderr. */
static int forked_void(const dp_transport_t *t, const char *fn) {
  dp_error_t e;
  if (!forked(t, fn, &e)) return 0;
  fprintf(stderr, "devpickle: %s: nothing done\n", e.message);
  return 1;
}


static void ring(int fd) {
  uint64_t one = 1;
  ssize_t w = write(fd, &one, sizeof one);
  (void)w;
}

static void wake(dp_transport_t *t) { ring(t->wake_fd); }

/* struct dp__waker: tp.h. The transport's one reference; its eventfd is
 * t->wake_fd. */
static struct dp__waker *waker_new(void) {
  struct dp__waker *w = dp__alloc(sizeof *w);
  if (!w) return NULL;
  if ((w->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
    dp__free(w, sizeof *w);
    return NULL;
  }
  atomic_init(&w->refs, 1);
  atomic_init(&w->rings, 0);
  return w;
}

static void waker_drop(void *ctx) {
  struct dp__waker *w = ctx;
  if (!w || atomic_fetch_sub_explicit(&w->refs, 1, memory_order_acq_rel) != 1) return;
  close(w->fd);
  dp__free(w, sizeof *w);
}

/* One send's hold on the waker, shared by the send and its future's
 * notification (refs: one each). The waker goes with the first of the
 * future's completion (its ring) and the send's end (dp__tp_sop_free):
 * a future that stays pending after its send ended — its endpoint failed
 * or closed, the transport freed — keeps no freed transport's eventfd
 * open. */
struct dp__note {
  _Atomic(struct dp__waker *) w;
  _Atomic uint32_t refs;
};

static void note_unref(void *ctx) {
  struct dp__note *n = ctx;
  if (atomic_fetch_sub_explicit(&n->refs, 1, memory_order_acq_rel) == 1) dp__free(n, sizeof *n);
}

static void note_detach(struct dp__note *n) {
  if (!n) return;
  waker_drop(atomic_exchange_explicit(&n->w, NULL, memory_order_acq_rel)); /* NULL: the future rang it */
  note_unref(n);
}

static void note_ring(void *ctx, dp_future_t *f, size_t index) {
  (void)f, (void)index;
  struct dp__note *n = ctx;
  struct dp__waker *w = atomic_exchange_explicit(&n->w, NULL, memory_order_acq_rel);
  if (!w) return; /* the send ended: nothing waits */
  atomic_fetch_add_explicit(&w->rings, 1, memory_order_release); /* before the wake: a pass that sees it sees this */
  ring(w->fd);
  waker_drop(w);
}

static int new_future(dp_transport_t *t, dp_future_t **out, dp_error_t *err) {
  dp_future_opts_t o = {0};
  o.backend = t->backend;
  dp_cache_hooks_t hooks = dp_cache_hooks(t->cache);
  o.hooks = &hooks;
  int rc = dp_future_new(&o, out, err);
  if (rc == 0) dp__future_set_loop(*out, t); /* only the loop completes it */
  return rc;
}


/* Runs c on the progress thread; with wait, blocks until it was handled.
 * Caller-driven: a pass runs it at once (a wait inside this thread's own
 * pass runs c alone there and then: dp__tp_run_now). */
static int submit(dp_transport_t *t, cmd_t *c, int wait_done) {
  if (dp__tp_queue_cmd(t, c)) wake(t); /* a thread still spinning sees the queue itself */
  if (t->caller) {
    if (dp__tp_in_pass == t) {
      if (wait_done) dp__tp_run_now(t, c);
    } else if (!wait_done) {
      dp__tp_caller_commands(t); /* a send is posted now; the workers wait for the next pass */
    } else {
      do dp__tp_caller_pass(t);
      while (!c->done);
    }
    return wait_done ? c->rc : 0;
  }
  if (!wait_done) return 0;
  pthread_mutex_lock(&t->mu);
  while (!c->done) pthread_cond_wait(&t->cv, &t->mu);
  pthread_mutex_unlock(&t->mu);
  return c->rc;
}

/* Runs a command that carries only a listener or an endpoint, and waits
 * until the progress thread handled it. */
static void run_cmd(dp_transport_t *t, int type, dp_listener_t *lst, dp_endpoint_t *ep) {
  cmd_t c;
  memset(&c, 0, sizeof c);
  c.type = type;
  c.lst = lst;
  c.ep = ep;
  submit(t, &c, 1);
}

void dp__tp_cmd_finish(dp_transport_t *t, cmd_t *c, int rc) {
  pthread_mutex_lock(&t->mu);
  c->rc = rc;
  c->done = 1;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

/* An IPv6 host refused: host as the caller gave it (quoted), shown the
 * address it stands for when that differs (a name's), NULL else. */
static int ipv6_refused(const char *host, const char *shown, int passive, dp_error_t *err) {
  char quoted[DP__SHOWN_MAX];
  return dp__err(err, DP_EINVAL,
                 "transport: '%s'%s%s%s is an IPv6 address, which the transport does not support (UCX 1.13's "
                 "TCP transport corrupts its heap reaching an IPv6 peer): use an IPv4 address%s",
                 dp__shown(host, quoted), shown ? " (" : "", shown ? shown : "", shown ? ")" : "",
                 passive ? " (0.0.0.0: every interface)" : "");
}

/* "HOST:PORT" (the last colon splits; [v6] brackets allowed). */
static int parse_addr(const char *hp, int passive, struct sockaddr_storage *ss, socklen_t *len, dp_error_t *err) {
  if (!hp) return dp__err(err, DP_EINVAL, "transport: NULL address");
  char quoted[DP__SHOWN_MAX], quoted_host[DP__SHOWN_MAX]; /* the caller's text, as every message quotes it: cut at a character, escaped */
  const char *colon = strrchr(hp, ':');
  if (!colon || colon == hp || !colon[1])
    return dp__err(err, DP_EINVAL, "transport: address '%s' is not HOST:PORT", dp__shown(hp, quoted));
  for (const char *p = colon + 1; *p; p++)
    if (*p < '0' || *p > '9')
      return dp__err(err, DP_EINVAL, "transport: port in '%s' is not a number", dp__shown(hp, quoted));
  /* a port of digits, leading zeros aside, as long as it likes: "123456"
     is a port out of range, not a malformed address, and "000000" is 0 */
  const char *digits = colon + 1;
  while (digits[0] == '0' && digits[1]) digits++;
  long port = strlen(digits) > 5 ? 65536 : strtol(digits, NULL, 10);
  if (port > 65535)
    return dp__err(err, DP_EINVAL, "transport: port in '%s' is out of range (at most 65535)", dp__shown(hp, quoted));
  if (!port && !passive)
    return dp__err(err, DP_EINVAL, "transport: port 0 in '%s': a connection needs the listener's port",
                   dp__shown(hp, quoted));
  char host[256], service[24];
  snprintf(service, sizeof service, "%ld", port);
  const char *given = hp;
  size_t hl = (size_t)(colon - hp);
  if (hl >= 2 && hp[0] == '[' && hp[hl - 1] == ']') hp++, hl -= 2;
  if (hl >= sizeof host)
    return dp__err(err, DP_EINVAL, "transport: the host in '%s' is too long (%zu bytes, at most %zu)",
                   dp__shown(given, quoted), hl, sizeof host - 1);
  memcpy(host, hp, hl);
  host[hl] = 0;
  /* "::1" splits into host ":" and port 1: a host holding ':' that is no
     IPv6 address was never meant as one */
  struct in6_addr a6;
  /* a scoped address ("fe80::1%eth0") is IPv6 too: its zone is no part of
     the address inet_pton reads (it was called "no IPv6 address") */
  char bare[sizeof host];
  snprintf(bare, sizeof bare, "%.*s", (int)strcspn(host, "%"), host);
  if (strchr(host, ':') && inet_pton(AF_INET6, bare, &a6) != 1)
    return dp__err(err, DP_EINVAL,
                   "transport: address '%s' is not HOST:PORT (its host '%s' holds a ':' but is no IPv6 address; "
                   "the transport takes IPv4 addresses and names)",
                   dp__shown(given, quoted), dp__shown(host, quoted_host));
  /* an IPv6 literal is refused as one, resolvable or not ("::1%lo", whose
     zone the resolver refuses, read "cannot resolve") */
  if (strchr(host, ':')) return ipv6_refused(host, NULL, passive, err);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  int g = getaddrinfo(host, service, &hints, &res);
  if (g != 0 || !res)
    return dp__err(err, DP_EINVAL, "transport: cannot resolve '%s': %s", dp__shown(host, quoted), gai_strerror(g));
  /* IPv4 only: UCX 1.13's TCP transport keeps its peer's address in a
     struct sockaddr_in, and an endpoint to an IPv6 peer (one accepted on an
     IPv6 listener: the peer's address comes from that connection) writes a
     sockaddr_in6 over the end of its heap block — the receiver's heap is
     corrupted ("double free or corruption") and the connection refused.
     A listener on "::" takes IPv4 connections no better: UCX drops them
     before any callback (it finds no interface for ::ffff:a.b.c.d). */
  const struct addrinfo *a = res;
  while (a && a->ai_family != AF_INET) a = a->ai_next;
  if (!a) {
    char shown[INET6_ADDRSTRLEN] = "?";
    if (res->ai_family == AF_INET6)
      inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)res->ai_addr)->sin6_addr, shown, sizeof shown);
    int literal = strcmp(shown, bare) == 0 || res->ai_family != AF_INET6;
    freeaddrinfo(res);
    return ipv6_refused(host, literal ? NULL : shown, passive, err);
  }
  memcpy(ss, a->ai_addr, a->ai_addrlen);
  *len = (socklen_t)a->ai_addrlen;
  freeaddrinfo(res);
  return 0;
}

/* ---- endpoint failure ---- */

void dp__tp_sop_free(sop_t *s) {
  note_detach(s->note);
  dp_value_release(s->value);
  dp_future_release(s->src);
  dp_future_release(s->done);
  dp_frame_free(s->frame);
  if (s->bytes) dp__free(s->bytes, s->bytes_cap);
  if (s->raw_hdr) dp__free(s->raw_hdr, s->raw_hlen);
  for (size_t i = 0; i < s->nstage; i++) dp__free(s->stage[i], s->stage_len[i]);
  if (s->stage) dp__free(s->stage, s->nbh * sizeof *s->stage);
  if (s->stage_len) dp__free(s->stage_len, s->nbh * sizeof *s->stage_len);
  if (s->bh) dp__free(s->bh, s->nbh * sizeof *s->bh);
  for (size_t i = 0; i < s->nafter; i++) dp_event_free(s->after[i]);
  if (s->after) dp__free(s->after, s->after_cap * sizeof *s->after);
  dp__free(s, sizeof *s);
}

void dp__tp_sop_fail(sop_t *s, const dp_error_t *e) {
  if (!s->failed && s->done) dp_future_set_error(s->done, e, NULL);
  s->failed = 1;
}

void dp__tp_rmsg_free(rmsg_t *m) {
  dp_value_release(m->value);
  if (m->bufs) {
    for (uint32_t i = 0; i < m->nbuf; i++) dp_storage_release(m->bufs[i].storage);
    dp__free(m->bufs, m->nbuf * sizeof *m->bufs);
  }
  if (m->frame_copy) dp__free(m->frame_copy, m->frame_len ? m->frame_len : 1);
  if (m->error) dp__free(m->error, DP__RERR_SIZE(strlen(m->error->message)));
  dp__free(m, sizeof *m);
}

/* A parked message goes, with what it still holds: eager data (a copy of
 * our own) or a rendezvous descriptor. (Rendezvous data is released unread:
 * a receive posted on an endpoint being closed outlives it in UCX 1.13,
 * which then asserts when the worker goes; UCX's descriptor is reclaimed
 * with the worker.) */
void dp__tp_rndv_hook(dp_endpoint_t *ep) {
  if (atomic_load_explicit(&dp__transport_fail_in_rndv, memory_order_relaxed) > 0 &&
      atomic_fetch_sub(&dp__transport_fail_in_rndv, 1) == 1)
    dp__tp_ep_fail_status(ep, UCS_ERR_CONNECTION_RESET);
}

void dp__tp_inbox_drop(dp_endpoint_t *ep, inbox_t *b) {
  if (b->data && b->rndv) {
    dp__tp_rndv_release(b->w, b->data);
    dp__tp_rndv_hook(ep);
  } else if (b->data) {
    dp__free(b->data, b->len);
  }
  dp__free(b, sizeof *b);
}

static void ep_set_error(dp_endpoint_t *ep, const dp_error_t *e) {
  dp_transport_t *t = ep->t;
  pthread_mutex_lock(&t->mu);
  if (!ep->error) {
    ep->errinfo = *e;
    ep->error = e->code;
  }
  pthread_mutex_unlock(&t->mu);
}

/* The endpoint's error is e and its pending receives fail with it (a
 * close with receives only pending, which then goes on gracefully). */
void dp__tp_ep_cancel_recvs(dp_endpoint_t *ep, const dp_error_t *e) {
  ep_set_error(ep, e);
  for (rwait_t *w = ep->w_head, *n; w; w = n) {
    n = w->next;
    dp_future_set_error(w->f, e, NULL);
    dp_future_release(w->f);
    dp__free(w, sizeof *w);
  }
  ep->w_head = ep->w_tail = NULL;
}

/* What the endpoint received and nobody took goes: messages being
 * received are detached (freed once no pull of theirs is in flight),
 * parked ones dropped. */
void dp__tp_ep_drop_received(dp_transport_t *t, dp_endpoint_t *ep) {
  for (rmsg_t *m = ep->rq_head, *n; m; m = n) {
    n = m->next;
    m->detached = 1;
    if (!m->pending) dp__tp_rmsg_free(m);
  }
  ep->rq_head = ep->rq_tail = ep->cur = NULL;
  dp__tp_park_drop(t, ep, 1);
  dp__tp_absorb_free(ep);
}

/* The endpoint fails: every pending future fails with e, what was received
 * and not taken is freed, the UCX endpoint is closed (force). Requests UCX
 * still holds finish through their callbacks, which find their send or
 * message detached and free it. */
void dp__tp_ep_fail(dp_endpoint_t *ep, const dp_error_t *e) {
  dp_transport_t *t = ep->t;
  ep_set_error(ep, e);
  dp_error_t ee;
  pthread_mutex_lock(&t->mu);
  ee = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  for (sop_t *s = ep->sq_head, *n; s; s = n) {
    n = s->next;
    dp__tp_sop_fail(s, &ee);
    dp__tp_sop_free(s);
  }
  ep->sq_head = ep->sq_tail = NULL;
  for (sop_t *s = ep->posted, *n; s; s = n) {
    n = s->next;
    dp__tp_sop_fail(s, &ee);
    s->ep = NULL;
    /* staged pieces not posted: their slots come back when their copies
       are done (the loop polls them), and then the send goes */
    while (s->pq_head) {
      piece_t *pc = s->pq_head;
      s->pq_head = pc->next;
      pc->next = t->orphans;
      t->orphans = pc;
    }
    s->pq_tail = NULL;
    if (!s->outstanding) dp__tp_sop_free(s);
  }
  ep->posted = ep->posted_tail = ep->posting = NULL;
  ep->tx_used = 0; /* its pieces' slots come back without it */
  dp__tp_ep_drop_shm(t, ep);
  if (ep->keep_received) { /* the peer closed: what it sent first is still taken, in order */
    size_t kept = 0;
    for (rmsg_t *m = ep->rq_head; m; m = m->next) kept++;
    pthread_mutex_lock(&t->mu);
    ep->kept = kept;
    pthread_mutex_unlock(&t->mu);
    dp__tp_park_drop(t, ep, 1);
    dp__tp_absorb_free(ep);
  } else {
    dp__tp_ep_drop_received(t, ep);
  }
  for (rwait_t *w = ep->w_head, *n; w; w = n) {
    n = w->next;
    dp_future_set_error(w->f, &ee, NULL);
    dp_future_release(w->f);
    dp__free(w, sizeof *w);
  }
  ep->w_head = ep->w_tail = NULL;
  ep->held = ep->inflight = 0;
  /* UCX is not re-entered from its own callbacks: the loop closes it */
  if (ep->ep && !ep->dead) ep->need_close = 1;
  dp__tp_lane_close(ep);
  ep->dead = 1;
}

/* Closes the UCX endpoint by force, once the rendezvous receives posted on
 * it are done (or after DP__CLOSE_WAIT_NS): UCX 1.13 asserts when it
 * destroys an endpoint that still has one. Until then need_close stays
 * set, and the loop (or reap) calls again. */
void dp__tp_ep_force_close(dp_endpoint_t *ep) {
  dp__tp_lane_close(ep);
  if (ep->rndv_inflight) {
    int64_t now = now_ns();
    if (!ep->close_deadline) ep->close_deadline = dp__tp_by_hurry(ep->t, now + DP__CLOSE_WAIT_NS);
    if (now < ep->close_deadline) return;
  }
  ep->need_close = 0;
  if (!ep->ep) return;
  ucp_request_param_t p = {0};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = ep->close_gently ? 0 : UCP_EP_CLOSE_FLAG_FORCE; /* gently: the answer to a CLOSE leaves first */
  void *r = ucp_ep_close_nbx(ep->ep, &p);
  if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
}

void dp__tp_ep_failf(dp_endpoint_t *ep, int code, const char *fmt, const char *detail) {
  dp_error_t e;
  dp_error_clear(&e);
  char what[512];
  snprintf(what, sizeof what, fmt, detail);
  dp__err(&e, code, "transport: %s: %s", ep->name, what);
  dp__tp_ep_fail(ep, &e);
}

/* A UCX failure of the connection: refused while the peer never answered,
 * lost afterwards. */
void dp__tp_ep_fail_status(dp_endpoint_t *ep, ucs_status_t st) {
  if (ep->dead) return;
  const char *fmt = ep->established ? "connection lost (%s)" : "connection refused or lost before any reply (%s)";
  dp__tp_ep_failf(ep, st == UCS_ERR_ENDPOINT_TIMEOUT ? DP_ETIMEDOUT : DP_EIO, fmt, ucs_status_string(st));
}

void dp__tp_ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t st) {
  (void)uep;
  dp__tp_ep_fail_status(arg, st);
}

/* ---- endpoints ---- */

int dp__tp_ep_alloc(dp_transport_t *t, const char *name, dp_endpoint_t **out, dp_error_t *err) {
  dp_endpoint_t *ep = dp__alloc(sizeof *ep);
  if (!ep) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  memset(ep, 0, sizeof *ep);
  ep->t = t;
  snprintf(ep->name, sizeof ep->name, "%s", name);
  dp_error_clear(&ep->errinfo);
  ep->credit_limit = ep->credit_granted = DP__CREDIT_INITIAL;
  *out = ep;
  return 0;
}

/* The list changes on the progress thread only, under mu, so that
 * dp_transport_free may read it. */
void dp__tp_ep_link(dp_transport_t *t, dp_endpoint_t *ep) {
  pthread_mutex_lock(&t->mu);
  ep->next = t->eps;
  t->eps = ep;
  pthread_mutex_unlock(&t->mu);
}

static void ep_unindex(dp_transport_t *t, dp_endpoint_t *ep);

void dp__tp_ep_unlink(dp_transport_t *t, dp_endpoint_t *ep) {
  ep_unindex(t, ep);
  pthread_mutex_lock(&t->mu);
  for (dp_endpoint_t **p = &t->eps; *p; p = &(*p)->next)
    if (*p == ep) {
      *p = ep->next;
      break;
    }
  pthread_mutex_unlock(&t->mu);
  if (t->last_ep == ep) t->last_ep = NULL;
}

/* The endpoint index (tp.h, ep_index): keyed by the UCX endpoint. UCX may
 * give a new endpoint the address of one it freed while an endpoint of
 * ours that failed still holds it: a lookup skips the dead. */
_Atomic unsigned long dp__transport_find_steps;

static int ep_live_is(const void *ctx, size_t i, const void *uep) {
  const dp_endpoint_t *e = ((const dp_transport_t *)ctx)->ep_items[i];
  atomic_fetch_add_explicit(&dp__transport_find_steps, 1, memory_order_relaxed);
  return e->ep == uep && !e->dead;
}

static int ep_same(const void *ctx, size_t i, const void *ep) {
  return ((const dp_transport_t *)ctx)->ep_items[i] == ep;
}

static uint64_t ep_hash_at(const void *ctx, size_t i) {
  return dp__hash_ptr(((const dp_transport_t *)ctx)->ep_items[i]->ep);
}

/* Indexes ep by its UCX endpoint, just made. DP_ENOMEM, having failed ep
 * ("out of memory indexing the endpoint"). */
int dp__tp_ep_index(dp_transport_t *t, dp_endpoint_t *ep) {
  size_t n = t->ep_index.count;
  uint64_t h = dp__hash_ptr(ep->ep);
  if (dp__grow((void **)&t->ep_items, &t->ep_items_cap, n + 1, sizeof *t->ep_items) ||
      (dp__table_full(&t->ep_index) && dp__table_grow(&t->ep_index, DP_TABLE_TAGGED, n, 16, ep_hash_at, t))) {
    dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory indexing the endpoint");
    return DP_ENOMEM;
  }
  t->ep_items[n] = ep;
  dp__table_put(&t->ep_index, DP_TABLE_TAGGED, dp__table_empty_slot(&t->ep_index, DP_TABLE_TAGGED, h), h, n);
  ep->indexed = 1;
  return 0;
}

static void ep_unindex(dp_transport_t *t, dp_endpoint_t *ep) {
  if (!ep->indexed) return;
  size_t slot;
  size_t at = dp__table_find(&t->ep_index, DP_TABLE_TAGGED, dp__hash_ptr(ep->ep), ep_same, t, ep, &slot);
  ep->indexed = 0;
  if (at == DP_TABLE_NONE) return; /* never: it was put there */
  dp__table_remove(&t->ep_index, DP_TABLE_TAGGED, slot, ep_hash_at, t);
  size_t last = t->ep_index.count;
  if (at != last) { /* the items stay dense: the last one fills the hole */
    t->ep_items[at] = t->ep_items[last];
    dp__table_move(&t->ep_index, DP_TABLE_TAGGED, dp__hash_ptr(t->ep_items[at]->ep), last, at);
  }
}

dp_endpoint_t *dp__tp_ep_find(dp_transport_t *t, ucp_ep_h uep) {
  if (t->last_ep && t->last_ep->ep == uep && !t->last_ep->dead) return t->last_ep;
  size_t slot, at = dp__table_find(&t->ep_index, DP_TABLE_TAGGED, dp__hash_ptr(uep), ep_live_is, t, uep, &slot);
  return at == DP_TABLE_NONE ? NULL : (t->last_ep = t->ep_items[at]);
}

/* ---- the API ---- */

/* The lanes' context: the shared-memory transports among those UCX_TLS
 * allows (all when it is unset; "^a,b" excludes). NULL: none, or UCX
 * refused: endpoints stay on their connections. */
static ucp_context_h lane_context(const ucp_params_t *up) {
  const char *tls = getenv("UCX_TLS");
  int excl = tls && tls[0] == '^';
  int want[2] = {1, 1}; /* posix, sysv */
  if (tls && *tls && strcmp(tls, "all")) {
    if (!excl) want[0] = want[1] = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", tls + excl);
    for (char *sv = NULL, *tok = strtok_r(buf, ",", &sv); tok; tok = strtok_r(NULL, ",", &sv)) {
      int all = !strcmp(tok, "sm") || !strcmp(tok, "shm") || !strcmp(tok, "mm") || !strcmp(tok, "all");
      if (all || !strcmp(tok, "posix")) want[0] = !excl;
      if (all || !strcmp(tok, "sysv")) want[1] = !excl;
    }
  }
  if (!want[0] && !want[1]) return NULL;
  ucp_config_t *cfg = NULL;
  ucp_context_h ctx = NULL;
  if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) return NULL;
  /* one of them (posix where allowed: SysV segments are a scarce system
     resource); a lane's messages go in one element of the queue (lane_send),
     so its pool of larger receive buffers stays small */
  ucs_status_t st = ucp_config_modify(cfg, "TLS", want[0] ? "posix" : "sysv");
  if (st == UCS_OK) st = ucp_config_modify(cfg, "MM_FIFO_ELEM_SIZE", DP__LANE_ELEM);
  if (st == UCS_OK) st = ucp_config_modify(cfg, "MM_RX_BUFS_GROW", "16");
  if (st == UCS_OK) st = ucp_init(up, cfg, &ctx);
  ucp_config_release(cfg);
  return st == UCS_OK ? ctx : NULL;
}

int dp_transport_new(const dp_transport_opts_t *opts, dp_transport_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_transport_new: out is NULL");
  *out = NULL;
  if (opts && opts->progress != DP_TRANSPORT_PROGRESS_THREAD && opts->progress != DP_TRANSPORT_PROGRESS_CALLER)
    return dp__err(err, DP_EINVAL,
                   "dp_transport_new: progress %d is neither DP_TRANSPORT_PROGRESS_THREAD (0) nor "
                   "DP_TRANSPORT_PROGRESS_CALLER (1)",
                   (int)opts->progress);
  if (opts && dp__unpickle_opts_check(opts->unpickle, "dp_transport_new", err)) return DP_EINVAL;
  /* a value this version does not know is refused, never read as "on":
     DEVPICKLE_TRANSPORT_SHM=off left the lanes and segments on */
  const char *shm = getenv("DEVPICKLE_TRANSPORT_SHM");
  if (shm && shm[0] && strcmp(shm, "0") && strcmp(shm, "1")) {
    char shown[DP__SHOWN_MAX];
    return dp__err(err, DP_EINVAL, "dp_transport_new: DEVPICKLE_TRANSPORT_SHM='%s': expected 0 or 1", dp__shown(shm, shown));
  }
  if (dp__tp_forked_from)
    return dp__err(err, DP_EINVAL,
                   "dp_transport_new: this process was forked from process %ld while it had a transport: UCX's "
                   "state here is a copy of that process's, without the thread that watches its sockets, so a "
                   "transport made here could connect nowhere (fork before making a transport, or once every "
                   "one is freed, or exec; transport.h)",
                   dp__tp_forked_from);
  dp_transport_t *t = dp__alloc(sizeof *t);
  if (!t) return dp__err(err, DP_ENOMEM, "dp_transport_new: out of memory");
  memset(t, 0, sizeof *t);
  dp__table_init(&t->ep_index);
  t->wake_fd = -1;
  t->max_inflight = opts && opts->max_inflight_bytes ? opts->max_inflight_bytes : DP_TRANSPORT_DEFAULT_INFLIGHT;
  uint64_t window = t->max_inflight > DP__CREDIT_INITIAL ? t->max_inflight : DP__CREDIT_INITIAL;
  t->max_parked = window > UINT64_MAX - DP__PARKED_SLACK ? UINT64_MAX : window + DP__PARKED_SLACK;
  t->timeout_ns = opts ? opts->timeout_ns : 0;
  if (opts && opts->unpickle) {
    t->uopts = *opts->unpickle;
    if (opts->unpickle->resolver) {
      t->resolver = *opts->unpickle->resolver;
      t->uopts.resolver = &t->resolver;
    }
  }
  t->uopts.bind = NULL;
  t->uopts.bind_ud = NULL;
  t->shm_on = !(shm && !strcmp(shm, "0"));
  int rc = 0;
  if (opts && opts->backend) t->backend = opts->backend;
  else if (opts && opts->cache) t->backend = dp__cache_backend(opts->cache);
  else rc = dp_backend_default(&t->backend, err);
  if (!rc && opts && opts->cache && dp__cache_backend(opts->cache) != t->backend)
    rc = dp__err(err, DP_EINVAL, "dp_transport_new: opts.cache allocates on %s, opts.backend is %s",
                 dp_backend_name(dp__cache_backend(opts->cache)), dp_backend_name(t->backend));
  if (!rc && opts && opts->cache) t->cache = opts->cache;
  else if (!rc) rc = dp_cache_default(t->backend, &t->cache, err);
  if (rc) {
    dp__free(t, sizeof *t);
    return rc;
  }
  ucp_params_t up;
  memset(&up, 0, sizeof up);
  up.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  up.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  up.mt_workers_shared = 0;
  ucp_config_t *cfg = NULL;
  ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
  if (st == UCS_OK) {
    st = ucp_init(&up, cfg, &t->ctx);
    ucp_config_release(cfg);
  }
  if (st != UCS_OK) {
    dp__free(t, sizeof *t);
    return dp__err(err, DP_ENODEV, "dp_transport_new: UCX did not start: %s", ucs_status_string(st));
  }
  st = dp__tp_new_worker(t->ctx, &t->worker, &t->worker_fd);
  if (st == UCS_OK) st = dp__tp_set_handlers(t->worker, t->amh, &t->stray, t, NULL);
  if (st != UCS_OK) {
    if (t->worker) ucp_worker_destroy(t->worker);
    ucp_cleanup(t->ctx);
    dp__free(t, sizeof *t);
    return dp__err(err, DP_ENODEV, "dp_transport_new: UCX worker: %s", ucs_status_string(st));
  }
  if (t->shm_on) {
    dp__shm_sweep(); /* what killed processes of this user left behind */
    t->lctx = lane_context(&up);
  }
  if ((t->waker = waker_new())) t->wake_fd = t->waker->fd;
  pthread_mutex_init(&t->mu, NULL);
  pthread_mutex_init(&t->pmu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&t->cv, &ca);
  pthread_condattr_destroy(&ca);
  t->caller = opts && opts->progress == DP_TRANSPORT_PROGRESS_CALLER;
  pthread_once(&fork_once, fork_hook);
  t->forks = atomic_load_explicit(&dp__tp_forks, memory_order_relaxed);
  t->pid = (long)getpid();
  /* a spinning thread yields its core every idle pass where the threads it
     waits for may need it (a few cores), every 16th elsewhere */
  t->yield_every = sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? 16 : 1;
  t->last_check = now_ns();
  if (!t->waker || (!t->caller && pthread_create(&t->thread, NULL, dp__tp_progress_main, t) != 0)) {
    waker_drop(t->waker);
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->pmu);
    pthread_cond_destroy(&t->cv);
    ucp_worker_destroy(t->worker);
    ucp_cleanup(t->ctx);
    if (t->lctx) ucp_cleanup(t->lctx);
    dp__free(t, sizeof *t);
    return dp__err(err, DP_ENOMEM, "dp_transport_new: cannot start the progress thread");
  }
  atomic_fetch_add_explicit(&dp__tp_live, 1, memory_order_relaxed);
  *out = t;
  return 0;
}

static void endpoint_close(dp_endpoint_t *ep, int wait);

void dp_transport_free(dp_transport_t *t) {
  if (!t || forked_void(t, "dp_transport_free")) return;
  if (dp__tp_in_pass == t) { /* its worker would be destroyed under its own progress */
    fprintf(stderr, "devpickle: dp_transport_free called from a callback of that transport's loop: not freed "
                    "(free it after the loop returns; transport.h)\n");
    return;
  }
  if (dp__tp_driven_here(t)) { /* a callback run by a wait that drives t: it passes t again after */
    fprintf(stderr, "devpickle: dp_transport_free called from a callback run while this thread drives that "
                    "transport (dp_transport_wait, dp_listener_accept, dp_endpoint_free): not freed (free it "
                    "after that call returns; transport.h)\n");
    return;
  }
  /* From here the callbacks of the futures the closes fail make no new
     endpoint (dp_endpoint_connect): one made after the scan below was
     never closed, and UCX's endpoint outlived the worker it was made on */
  atomic_store(&t->freeing, 1);
  run_cmd(t, CMD_SYNC, NULL, NULL); /* closes queued by callbacks are done first */
  /* the caller's endpoints still open, then listeners (with the
   * connections they accepted that nobody took: their listener closes
   * them): an endpoint connected to one of this transport's listeners has
   * its futures failed with DP_ECANCELED before the listener's side of the
   * connection goes, which would fail them with a connection reset */
  for (;;) {
    pthread_mutex_lock(&t->mu);
    dp_endpoint_t *ep = t->eps;
    while (ep && ep->queued) ep = ep->next;
    pthread_mutex_unlock(&t->mu);
    if (!ep) break;
    endpoint_close(ep, 0); /* their closes run together, bounded, below (a second each added up) */
  }
  for (;;) {
    pthread_mutex_lock(&t->mu);
    dp_listener_t *l = t->lsts;
    pthread_mutex_unlock(&t->mu);
    if (!l) break;
    dp_listener_free(l);
  }
  run_cmd(t, CMD_STOP, NULL, NULL);
  if (t->caller) dp__tp_drain_stopped(t);
  else pthread_join(t->thread, NULL);
  /* a graceful close still in progress (a peer that stopped answering never
     completes UCX's disconnect) is let go of first: UCX 1.13 asserts, and
     aborts the process, when it destroys an endpoint whose close request the
     user still holds */
  for (dp_endpoint_t *ep = t->closing; ep; ep = ep->next)
    if (ep->close_req) {
      ucp_request_free(ep->close_req);
      ep->close_req = NULL;
    }
  ucp_worker_destroy(t->worker);
  ucp_cleanup(t->ctx);
  for (dp_endpoint_t *ep = t->closing, *n; ep; ep = n) {
    n = ep->next;
    dp__tp_ep_free_mem(ep);  /* their endpoints went with the worker */
  }
  if (t->lctx) ucp_cleanup(t->lctx);
  if (t->pfd) dp__free(t->pfd, t->pfd_cap * sizeof *t->pfd);
  dp__table_destroy(&t->ep_index, DP_TABLE_TAGGED);
  if (t->ep_items) dp__free(t->ep_items, t->ep_items_cap * sizeof *t->ep_items);
  for (slot_t *sl = t->tx.free, *n; sl; sl = n) n = sl->next, dp__tp_slot_destroy(t, sl);
  for (slot_t *sl = t->rx.free, *n; sl; sl = n) n = sl->next, dp__tp_slot_destroy(t, sl);
  for (int i = 0; i <= DP_DEVICE_INDEX_MAX; i++) {
    dp_stream_free(t->streams[i]);
    dp_stream_free(t->sstreams[i]);
  }
  waker_drop(t->waker); /* its eventfd, wake_fd, closes with the last reference */
  pthread_mutex_destroy(&t->mu);
  pthread_mutex_destroy(&t->pmu);
  pthread_cond_destroy(&t->cv);
  dp__free(t, sizeof *t);
  atomic_fetch_sub_explicit(&dp__tp_live, 1, memory_order_relaxed);
}

int dp_transport_progress(dp_transport_t *t) {
  return t && t->caller && !forked(t, "dp_transport_progress", NULL) ? dp__tp_caller_pass(t) : 0;
}

/* A caller's wait: f, and the answer of a wait on it made meanwhile
 * (answered: rc and e hold it). */
typedef struct drive_wait {
  dp_future_t *f;
  int answered, rc;
  dp_error_t e;
} drive_wait_t;

/* 1 once f is complete, or its wait was refused as one for itself. In a
 * future's callback a pass queues the callbacks of what it completes on
 * this thread, behind the running one: a wait there runs them
 * (dp_future_wait, which also refuses at once a wait for the running
 * callback's own child), or a then() child of a receive never completed
 * while passes ran. Its other answers on a pending f (a limit on nesting,
 * out of memory) leave the passes to complete f. */
static int drive_done(void *arg) {
  drive_wait_t *w = arg;
  if (dp_future_is_done(w->f)) return 1;
  if (!dp__future_running()) return 0;
  int rc = dp_future_wait(w->f, 0, &w->e);
  int done = dp_future_is_done(w->f);
  if (rc == DP_ETIMEDOUT) return done; /* done: just now, or its own error (the caller waits again) */
  if (!done && rc != DP_EMISUSE) return 0;
  w->answered = 1; /* f's result (its events joined once), or the refusal */
  w->rc = rc;
  return 1;
}

int dp_transport_wait(dp_transport_t *t, dp_future_t *f, int64_t timeout_ns, dp_error_t *err) {
  if (!t || !f) return dp__err(err, DP_EINVAL, "dp_transport_wait: %s is NULL", t ? "f" : "t");
  if (forked(t, "dp_transport_wait", err)) return DP_EINVAL;
  /* from a callback a caller's pass runs, no pass can run (the pass is
     this thread's): the wait is dp_future_wait's, which sleeps and refuses
     a wait for itself (its passes returned at once: it spun a core until
     its limit, forever without one, on the callback's own child) */
  int drive = t->caller && dp__tp_in_pass != t;
  drive_wait_t w = {.f = f};
  int rc;
  if (!drive) rc = dp_future_wait(f, timeout_ns, err);
  else if (!dp__tp_caller_until(t, drive_done, &w, timeout_ns)) rc = DP_ETIMEDOUT;
  else if (w.answered) {
    if (w.rc && err) *err = w.e;
    return w.rc;
  } else rc = dp_future_wait(f, 0, err);
  if (rc != DP_ETIMEDOUT) return rc;
  if (dp_future_is_done(f)) return dp_future_wait(f, 0, err); /* failed with a timeout of its own, or done just now */
  return dp__err(err, DP_ETIMEDOUT, "dp_transport_wait: the future did not complete within %lld ns",
                 (long long)timeout_ns);
}

int dp_listener_new(dp_transport_t *t, const char *host_port, dp_listener_t **out, dp_error_t *err) {
  if (out) *out = NULL;
  if (!t || !out || !host_port)
    return dp__err(err, DP_EINVAL, "dp_listener_new: %s is NULL", !t ? "t" : !out ? "out" : "host_port");
  if (forked(t, "dp_listener_new", err)) return DP_EINVAL;
  if (!t->caller && dp__tp_in_pass == t) /* the progress thread: it would wait for itself */
    return dp__err(err, DP_EINVAL,
                   "dp_listener_new: called from a callback run by the transport's progress thread, which it "
                   "waits for (transport.h)");
  cmd_t c;
  memset(&c, 0, sizeof c);
  int rc = parse_addr(host_port, 1, &c.addr, &c.addrlen, err);
  if (rc) return rc;
  /* the system binds and listens there, and nobody can ever connect: an
     accept waited forever on a listener that looked made */
  const char *what = dp__tp_addr_not_unicast(&c.addr);
  if (what) {
    char host[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &((const struct sockaddr_in *)&c.addr)->sin_addr, host, sizeof host);
    return dp__err(err, DP_EIO, "transport: cannot listen on %s: it is not an address of this machine (%s)", host,
                   what);
  }
  dp_listener_t *l = dp__alloc(sizeof *l);
  if (!l) return dp__err(err, DP_ENOMEM, "dp_listener_new: out of memory");
  memset(l, 0, sizeof *l);
  l->t = t;
  c.type = CMD_LISTEN;
  c.lst = l;
  dp_error_clear(&c.err);
  if ((rc = submit(t, &c, 1))) {
    if (err) *err = c.err;
    dp__free(l, sizeof *l);
    return rc;
  }
  *out = l;
  return 0;
}

int dp_listener_port(const dp_listener_t *l) { return l ? l->port : 0; }

static int accepted(void *arg) {
  dp_listener_t *l = arg;
  pthread_mutex_lock(&l->t->mu);
  int yes = l->acc_head != NULL || l->closed;
  pthread_mutex_unlock(&l->t->mu);
  return yes;
}

/* The first connection queued on l, taken (NULL: none); under t->mu. */
static dp_endpoint_t *acc_take(dp_listener_t *l) {
  dp_endpoint_t *ep = l->acc_head;
  if (ep) {
    l->acc_head = ep->acc_next;
    if (!l->acc_head) l->acc_tail = NULL;
    ep->acc_next = NULL;
    ep->queued = 0;
  }
  return ep;
}

int dp__listener_waiters(dp_listener_t *l) {
  pthread_mutex_lock(&l->t->mu);
  int n = l->waiters;
  pthread_mutex_unlock(&l->t->mu);
  return n;
}

int dp_listener_accept(dp_listener_t *l, int64_t timeout_ns, dp_endpoint_t **out, dp_error_t *err) {
  if (out) *out = NULL;
  if (!l || !out) return dp__err(err, DP_EINVAL, "dp_listener_accept: %s is NULL", l ? "out" : "l");
  dp_transport_t *t = l->t;
  if (forked(t, "dp_listener_accept", err)) return DP_EINVAL;
  dp_endpoint_t *ep = NULL;
  int port = l->port; /* l may be gone when this returns: freed meanwhile, by its last waiter */
  if (dp__tp_in_pass == t) {
    /* a callback the loop runs (its thread, or a caller's pass): the loop
       queues connections and waits for this callback, so none can come
       meanwhile; a wait for one blocked the loop for the whole limit, and
       one without a limit never returned */
    pthread_mutex_lock(&t->mu);
    ep = acc_take(l);
    pthread_mutex_unlock(&t->mu);
    if (!ep && timeout_ns != 0)
      /* the words transport.h quotes, in either mode */
      return dp__err(err, DP_EINVAL,
                     "dp_listener_accept: called from a callback run by the transport's progress thread with no "
                     "connection queued on port %d%s: none can come before the callback returns (a limit of 0 "
                     "polls; transport.h)",
                     l->port, t->caller ? " (the thread running a caller's pass)" : "");
  } else {
    /* a waiter: dp_listener_free from another thread meanwhile ends the
       wait (DP_ECANCELED) and waits for it to leave before freeing l (it
       woke to freed memory, or never woke) */
    int closed = 0;
    pthread_mutex_lock(&t->mu);
    l->waiters++;
    pthread_mutex_unlock(&t->mu);
    if (t->caller) {
      /* passes until a connection is queued, then take it; another thread
         accepting on l may take it first, so this goes on until the limit
         (none for a negative one) has passed */
      int64_t now = now_ns();
      int64_t end = timeout_ns < 0 || timeout_ns > INT64_MAX - now ? -1 : now + timeout_ns;
      for (;;) {
        dp__tp_caller_until(t, accepted, l, end < 0 ? -1 : end > now ? end - now : 0);
        if (dp__transport_accept_gap) dp__transport_accept_gap();
        pthread_mutex_lock(&t->mu);
        ep = acc_take(l);
        closed = l->closed;
        pthread_mutex_unlock(&t->mu);
        if (ep || closed || (end >= 0 && (now = now_ns()) >= end)) break;
      }
      pthread_mutex_lock(&t->mu);
    } else {
      struct timespec dl;
      clock_gettime(CLOCK_MONOTONIC, &dl); /* t->cv's clock */
      if (timeout_ns >= 0) {
        int64_t ns = dl.tv_nsec + timeout_ns % 1000000000;
        dl.tv_sec += (time_t)(timeout_ns / 1000000000 + ns / 1000000000);
        dl.tv_nsec = (long)(ns % 1000000000);
      }
      pthread_mutex_lock(&t->mu);
      int timed_out = 0;
      while (!l->acc_head && !timed_out && !l->closed) {
        if (timeout_ns < 0) pthread_cond_wait(&t->cv, &t->mu);
        else timed_out = pthread_cond_timedwait(&t->cv, &t->mu, &dl) == ETIMEDOUT;
      }
      ep = acc_take(l);
    }
    closed = l->closed;
    int last = --l->waiters == 0;
    int orphaned = last && l->orphaned;
    if (last && closed) pthread_cond_broadcast(&t->cv); /* the free waiting for the waiters */
    pthread_mutex_unlock(&t->mu);
    if (orphaned) dp__free(l, sizeof *l);
    if (!ep && closed)
      return dp__err(err, DP_ECANCELED, "dp_listener_accept: the listener on port %d was freed while this waited",
                     port);
  }
  if (!ep)
    return dp__err(err, DP_ETIMEDOUT, "dp_listener_accept: no connection on port %d within %lld ns", port,
                   (long long)timeout_ns);
  *out = ep;
  return 0;
}

void dp_listener_free(dp_listener_t *l) {
  if (!l || forked_void(l->t, "dp_listener_free")) return;
  if (!l->t->caller && dp__tp_in_pass == l->t) { /* the progress thread: it would wait for itself */
    fprintf(stderr, "devpickle: dp_listener_free called from a callback run by the transport's progress thread: "
                    "not freed (free it after the callback, or with the transport; transport.h)\n");
    return;
  }
  dp_transport_t *t = l->t;
  run_cmd(t, CMD_UNLISTEN, l, NULL); /* closed: the accepts waiting on l return */
  pthread_mutex_lock(&t->mu);
  if (l->waiters && dp__tp_in_pass == t) {
    /* a callback of a caller's pass: the waiters need this pass to end
       to leave, so the last of them frees l */
    l->orphaned = 1;
    pthread_mutex_unlock(&t->mu);
    return;
  }
  while (l->waiters) pthread_cond_wait(&t->cv, &t->mu);
  pthread_mutex_unlock(&t->mu);
  dp__free(l, sizeof *l);
}

int dp_endpoint_connect(dp_transport_t *t, const char *host_port, dp_endpoint_t **out, dp_error_t *err) {
  if (out) *out = NULL;
  if (!t || !out || !host_port)
    return dp__err(err, DP_EINVAL, "dp_endpoint_connect: %s is NULL", !t ? "t" : !out ? "out" : "host_port");
  if (forked(t, "dp_endpoint_connect", err)) return DP_EINVAL;
  if (atomic_load(&t->freeing))
    return dp__err(err, DP_ECANCELED,
                   "dp_endpoint_connect: the transport is being freed (dp_transport_free): no endpoint is made");
  cmd_t *c = dp__alloc(sizeof *c);
  if (!c) return dp__err(err, DP_ENOMEM, "dp_endpoint_connect: out of memory");
  memset(c, 0, sizeof *c);
  int rc = parse_addr(host_port, 0, &c->addr, &c->addrlen, err);
  char name[96];
  snprintf(name, sizeof name, "endpoint to %.80s", host_port ? host_port : "");
  dp_endpoint_t *ep = NULL;
  if (!rc) rc = dp__tp_ep_alloc(t, name, &ep, err);
  if (rc) {
    dp__free(c, sizeof *c);
    return rc;
  }
  c->type = CMD_CONNECT;
  c->ep = ep;
  submit(t, c, 0);
  *out = ep;
  return 0;
}

typedef struct closing_arg {
  dp_transport_t *t;
  dp_endpoint_t *ep;
} closing_arg_t;

/* 1 once the loop let go of a closed endpoint (reaped: its close done). */
static int close_done(void *arg) {
  closing_arg_t *a = arg;
  pthread_mutex_lock(&a->t->pmu);
  dp_endpoint_t *ep = a->t->closing;
  while (ep && ep != a->ep) ep = ep->next;
  pthread_mutex_unlock(&a->t->pmu);
  return ep == NULL;
}

/* Closes ep (dp_endpoint_free); wait: caller-driven, runs passes until the
 * close is done, at most DP__CLOSE_WAIT_NS (dp_transport_free, which closes
 * every endpoint and then drives their closes together, does not). */
static void endpoint_close(dp_endpoint_t *ep, int wait) {
  dp_transport_t *t = ep->t;
  /* A second call while the endpoint is still there — from a callback its
     close runs (it fails the pending futures: "on error, close" in each of
     their callbacks), or dp_transport_free after a callback queued its
     close — must not close it again: the command is the endpoint's own, and
     a second close put it twice on the closing list (a double free). */
  pthread_mutex_lock(&t->mu);
  int again = ep->free_asked;
  ep->free_asked = 1;
  pthread_mutex_unlock(&t->mu);
  if (again && dp__tp_in_pass == t) return;
  if (again) {
    run_cmd(t, CMD_SYNC, NULL, NULL); /* the close queued before it is done then */
  } else if (dp__tp_in_pass == t) {
    /* from a callback the loop runs (maybe inside UCX's own callback, with
       the pass iterating the endpoints): the close is queued — the
       endpoint's own command, which lives as long as it does — and done by
       the loop's next command drain; waiting here would wait for itself */
    cmd_t *c = &ep->close_cmd;
    memset(c, 0, sizeof *c);
    c->type = CMD_CLOSE;
    c->ep = ep;
    c->detached = 1;
    submit(t, c, 0);
    return;
  } else {
    run_cmd(t, CMD_CLOSE, NULL, ep);
  }
  /* caller-driven, nothing else drives the close: its flush and UCX's
     disconnect would wait for this process's next pass, and the peer would
     not learn of the close (its pending receive would hang) meanwhile */
  if (t->caller && wait) {
    closing_arg_t a = {t, ep};
    dp__tp_caller_until(t, close_done, &a, DP__CLOSE_WAIT_NS);
  }
}

void dp_endpoint_free(dp_endpoint_t *ep) {
  if (!ep || forked_void(ep->t, "dp_endpoint_free")) return;
  endpoint_close(ep, 1);
}

int dp_endpoint_error(const dp_endpoint_t *ep, dp_error_t *err) {
  if (!ep) return dp__err(err, DP_EINVAL, "dp_endpoint_error: ep is NULL");
  dp_transport_t *t = ep->t;
  if (forked(t, "dp_endpoint_error", err)) return DP_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = ep->error;
  if (rc && err) *err = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

/* DP_ECANCELED once dp_endpoint_free was called on ep: from a callback the
 * loop runs, ep is still there until the loop closes it after the callback,
 * and a send or receive made meanwhile was queued behind the close, which
 * then failed it with an error never set (a code and message of whatever
 * the stack held). Under t->mu. */
static int freed_locked(const dp_endpoint_t *ep, const char *fn, dp_error_t *err) {
  if (!ep->free_asked) return 0;
  return dp__err(err, DP_ECANCELED, "%s: transport: %s: the endpoint was freed (%s): nothing is sent or received on it "
                 "after that",
                 fn, ep->name, atomic_load(&ep->t->freeing) ? "dp_transport_free" : "dp_endpoint_free");
}

static int queue_send(dp_endpoint_t *ep, const char *fn, sop_t *s, dp_future_t **done, dp_error_t *err) {
  dp_transport_t *t = ep->t;
  /* the fork is checked by every caller; freed, then failed, under one lock */
  pthread_mutex_lock(&t->mu);
  int rc = freed_locked(ep, fn, err);
  if (!rc && (rc = ep->error) && err) *err = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  if (!rc && done) rc = new_future(t, &s->done, err);
  cmd_t *c = rc ? NULL : dp__alloc(sizeof *c);
  if (!rc && !c) rc = dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (rc) {
    dp__tp_sop_free(s);
    return rc;
  }
  memset(c, 0, sizeof *c);
  c->type = CMD_SEND;
  c->ep = ep;
  c->sop = s;
  if (done) *done = dp_future_retain(s->done);
  submit(t, c, 0);
  return 0;
}

static sop_t *sop_new(int kind) {
  sop_t *s = dp__alloc(sizeof *s);
  if (s) {
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->value = dp_none();
  }
  return s;
}

int dp_endpoint_send(dp_endpoint_t *ep, dp_value_t v, dp_future_t **done, dp_error_t *err) {
  if (done) *done = NULL;
  if (!ep || !done) return dp__err(err, DP_EINVAL, "dp_endpoint_send: %s is NULL", ep ? "done" : "ep");
  if (forked(ep->t, "dp_endpoint_send", err)) return DP_EINVAL;
  sop_t *s = sop_new(SOP_VALUE);
  if (!s) return dp__err(err, DP_ENOMEM, "dp_endpoint_send: out of memory");
  int rc = dp_frame_new(&s->frame, err);
  if (!rc) rc = dp_pickle(v, NULL, s->frame, err);
  if (!rc) rc = dp__tp_sop_plan(ep->t, s, err);
  if (!rc) rc = dp__tp_sop_after(ep->t, s, err);
  if (rc) {
    dp__tp_sop_free(s);
    return rc;
  }
  s->value = dp_value_retain(v);
  return queue_send(ep, "dp_endpoint_send", s, done, err);
}

int dp_endpoint_send_future(dp_endpoint_t *ep, dp_future_t *f, dp_future_t **done, dp_error_t *err) {
  if (done) *done = NULL;
  if (!ep || !f || !done)
    return dp__err(err, DP_EINVAL, "dp_endpoint_send_future: %s is NULL", !ep ? "ep" : !f ? "f" : "done");
  if (forked(ep->t, "dp_endpoint_send_future", err)) return DP_EINVAL;
  sop_t *s = sop_new(SOP_FUTURE);
  if (!s) return dp__err(err, DP_ENOMEM, "dp_endpoint_send_future: out of memory");
  s->src = dp_future_retain(f);
  /* the loop sleeps while f is pending: f's completion wakes it (polling
     f instead kept the progress thread, or a caller's wait, spinning on a
     core for as long as f took) */
  struct dp__waker *w = ep->t->waker;
  struct dp__note *n = dp__alloc(sizeof *n);
  if (n) {
    atomic_fetch_add_explicit(&w->refs, 1, memory_order_relaxed);
    atomic_init(&n->w, w);
    atomic_init(&n->refs, 2);
    if (dp__future_notify(f, note_ring, note_unref, n) != 0) {
      waker_drop(w);
      dp__free(n, sizeof *n);
      n = NULL;
    }
  }
  if (!(s->note = n)) {
    dp__tp_sop_free(s);
    return dp__err(err, DP_ENOMEM, "dp_endpoint_send_future: out of memory");
  }
  return queue_send(ep, "dp_endpoint_send_future", s, done, err);
}

int dp_endpoint_send_frame(dp_endpoint_t *ep, const void *bytes, size_t n, dp_future_t **done, dp_error_t *err) {
  if (done) *done = NULL;
  if (!ep || !bytes || !done)
    return dp__err(err, DP_EINVAL, "dp_endpoint_send_frame: %s is NULL", !ep ? "ep" : !bytes ? "bytes" : "done");
  if (forked(ep->t, "dp_endpoint_send_frame", err)) return DP_EINVAL;
  dp_frame_info_t info;
  int rc = dp_frame_check(bytes, n, &info, err);
  if (rc) return rc;
  if (info.nbuffers && !(info.flags & 1u))
    return dp__err(err, DP_EINVAL, "dp_endpoint_send_frame: the frame's %u buffer%s not inline", info.nbuffers,
                   info.nbuffers == 1 ? " is" : "s are");
  sop_t *s = sop_new(SOP_FRAME);
  if (!s || !(s->bytes = dp__alloc(n ? n : 1))) {
    if (s) dp__free(s, sizeof *s);
    return dp__err(err, DP_ENOMEM, "dp_endpoint_send_frame: out of memory");
  }
  memcpy(s->bytes, bytes, n);
  s->bytes_cap = n ? n : 1;
  s->nbytes = n;
  return queue_send(ep, "dp_endpoint_send_frame", s, done, err);
}

static int recv_common(dp_endpoint_t *ep, int frame, dp_future_t **out, dp_error_t *err) {
  const char *fn = frame ? "dp_endpoint_recv_frame" : "dp_endpoint_recv";
  if (out) *out = NULL;
  if (!ep || !out) return dp__err(err, DP_EINVAL, "%s: %s is NULL", fn, ep ? "out" : "ep");
  if (forked(ep->t, fn, err)) return DP_EINVAL;
  dp_transport_t *t = ep->t;
  /* a failed endpoint's error, as every later call returns it — unless the
     peer closed it and values it sent first are still to be taken */
  pthread_mutex_lock(&t->mu);
  int rc = freed_locked(ep, fn, err);
  if (!rc && (rc = ep->kept ? 0 : ep->error) && err) *err = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  if (rc) return rc;
  rwait_t *w = dp__alloc(sizeof *w);
  cmd_t *c = dp__alloc(sizeof *c);
  rc = (!w || !c) ? dp__err(err, DP_ENOMEM, "%s: out of memory", fn) : 0;
  if (!rc) {
    memset(w, 0, sizeof *w);
    w->frame = frame;
    rc = new_future(t, &w->f, err);
  }
  if (rc) {
    if (w) dp__free(w, sizeof *w);
    if (c) dp__free(c, sizeof *c);
    return rc;
  }
  memset(c, 0, sizeof *c);
  c->type = CMD_RECV;
  c->ep = ep;
  c->rw = w;
  *out = dp_future_retain(w->f);
  submit(t, c, 0);
  return 0;
}

int dp_endpoint_recv(dp_endpoint_t *ep, dp_future_t **out, dp_error_t *err) { return recv_common(ep, 0, out, err); }

int dp_endpoint_recv_frame(dp_endpoint_t *ep, dp_future_t **out, dp_error_t *err) {
  return recv_common(ep, 1, out, err);
}

int dp__endpoint_send_raw(dp_endpoint_t *ep, unsigned am_id, const void *hdr, size_t hlen, const void *data,
                          size_t n, dp_error_t *err) {
  if (forked(ep->t, "dp__endpoint_send_raw", err)) return DP_EINVAL;
  sop_t *s = sop_new(SOP_RAW);
  if (!s) return dp__err(err, DP_ENOMEM, "out of memory");
  s->raw_id = am_id;
  s->raw_hdr = dp__alloc(hlen ? hlen : 1);
  s->raw_hlen = hlen ? hlen : 1;
  s->bytes = dp__alloc(n ? n : 1);
  s->bytes_cap = n ? n : 1;
  s->nbytes = n;
  if (!s->raw_hdr || !s->bytes) {
    dp__tp_sop_free(s);
    return dp__err(err, DP_ENOMEM, "out of memory");
  }
  if (hlen) memcpy(s->raw_hdr, hdr, hlen);
  s->raw_len_hdr = hlen;
  s->raw_hlen = hlen ? hlen : 1;
  if (n) memcpy(s->bytes, data, n);
  return queue_send(ep, "dp__endpoint_send_raw", s, NULL, err);
}
