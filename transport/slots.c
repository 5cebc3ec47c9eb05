/* transport/slots.c — where buffers go; staging slots; same-host slots' control messages. */
#include "tp.h"

/* ---- where buffers go ---- */

/* cpu memory is read and written where it is; memory of the transport's
 * backend is too when the host can address it (host:N), else it is staged
 * (cuda); any other device is refused, and so is a device index the backend
 * does not have: the sender read host:3 of a 2-device host backend as host
 * memory and its receiver failed binding it, a receiver's caching allocator
 * has no stream for it. */
int dp__tp_buf_mode(const dp_transport_t *t, dp_device_t dev) {
  if (dev.type == DP_DEVICE_CPU) return MODE_DIRECT;
  if (dev.type != (uint8_t)dp_backend_type(t->backend)) return MODE_REFUSED;
  if ((int)dev.index >= dp_backend_device_count(t->backend)) return MODE_REFUSED;
  return dev.type == DP_DEVICE_HOST && !dp__transport_stage_host ? MODE_DIRECT : MODE_STAGED;
}

int dp__tp_refused(const dp_transport_t *t, dp_device_t dev, uint64_t i, dp_error_t *err) {
  char d[16];
  if (dev.type == (uint8_t)dp_backend_type(t->backend))
    return dp__err(err, DP_ENODEV, "transport: buffer %llu is on %s: this process's %s backend has %d devices",
                   (unsigned long long)i, dp_device_format(dev, d, sizeof d), dp_backend_name(t->backend),
                   dp_backend_device_count(t->backend));
  return dp__err(err, DP_ENODEV,
                 "transport: buffer %llu is on %s: this transport moves cpu and %s memory "
                 "(dp_transport_opts_t.backend)",
                 (unsigned long long)i, dp_device_format(dev, d, sizeof d), dp_backend_name(t->backend));
}

static void cpu_release(void *ud, dp_device_t dev, void *base, size_t n) {
  (void)ud, (void)dev;
  if (base) dp__free(base, n);
}

int dp__tp_cpu_alloc(dp_device_t dev, uint64_t n, dp_storage_t **out, void **dst, dp_error_t *err) {
  void *p = NULL;
  if (n > SIZE_MAX) return dp__err(err, DP_ENOMEM, "transport: buffer of %llu bytes", (unsigned long long)n);
  if (n && !(p = dp__alloc((size_t)n)))
    return dp__err(err, DP_ENOMEM, "transport: out of memory receiving a buffer of %llu bytes",
                   (unsigned long long)n);
  int rc = dp_storage_new(dev, p, (size_t)n, cpu_release, NULL, out, err);
  if (rc) {
    cpu_release(NULL, dev, p, (size_t)n);
    return rc;
  }
  *dst = p;
  return 0;
}

static void dev_release(void *ud, dp_device_t dev, void *base, size_t n) {
  (void)dev, (void)n;
  if (base) dp_cache_dealloc((dp_cache_t *)ud, base, NULL);
}

/* A stream of the transport's on dev (receive or send), made on first use
 * on the progress thread. A receive stream is made current there, so that
 * completed receives record their events on it. */
int dp__tp_own_stream(dp_transport_t *t, dp_stream_t **tab, dp_device_t dev, int current, dp_stream_t **out,
                      dp_error_t *err) {
  if (!tab[dev.index]) {
    int rc = dp_stream_new(t->backend, dev, &tab[dev.index], err);
    if (rc) return rc;
    if (current && (rc = dp_set_current_stream(tab[dev.index], NULL, err))) {
      dp_stream_free(tab[dev.index]);
      tab[dev.index] = NULL;
      return rc;
    }
  }
  *out = tab[dev.index];
  return 0;
}

/* The receive storage: from the caching allocator on the receive stream.
 * A block handed out on it is free of earlier work there; the host writes
 * direct blocks itself, staged ones are written by copies queued on that
 * stream, after everything before them. */
int dp__tp_dev_alloc(dp_transport_t *t, dp_device_t dev, uint64_t n, dp_storage_t **out, void **dst,
                     dp_error_t *err) {
  dp_stream_t *s;
  void *p = NULL;
  int rc = dp__tp_own_stream(t, t->streams, dev, 1, &s, err);
  if (rc) return rc;
  if (n > SIZE_MAX) return dp__err(err, DP_ENOMEM, "transport: buffer of %llu bytes", (unsigned long long)n);
  if (n && (rc = dp_cache_alloc(t->cache, dev, (size_t)n, s, &p, err))) return rc;
  rc = dp_storage_new(dev, p, (size_t)n, dev_release, t->cache, out, err);
  if (rc) {
    if (p) dp_cache_dealloc(t->cache, p, NULL);
    return rc;
  }
  *dst = p;
  return 0;
}

/* ---- staging slots ---- */

/* A slot for n bytes, or NULL when the caller must
 * wait for one. Sending: each endpoint holds at most DP__STAGE_SLOTS (so a
 * slow peer holds back its own sends only); the pool keeps every slot made.
 * Receiving: at most 2 * DP__STAGE_SLOTS page-locked slots (one for each
 * piece a sender has on the wire, and more while their copies run);
 * beyond that a rendezvous piece waits (rx_wait) and an eager one, already
 * here and small, takes a slot of ordinary memory made for it (heap). A
 * piece larger than a pooled slot (a peer may pack more than DP__STAGE_CHUNK
 * of small staged buffers into one message) always gets a slot of its own
 * size, made for it and freed after: a pooled slot would be written past
 * its end. */
int dp__tp_slot_get(dp_transport_t *t, pool_t *pool, size_t n, int heap_ok, slot_t **out, dp_error_t *err) {
  *out = NULL;
  int large = n > DP__STAGE_CHUNK;
  if (large) heap_ok = 1;
  else if (pool->free) {
    *out = pool->free;
    pool->free = (*out)->next;
    (*out)->next = NULL;
    return 0;
  }
  int pooled = !large && (pool == &t->tx || pool->made < 2 * DP__STAGE_SLOTS);
  if (!pooled && !heap_ok) return 0;
  slot_t *sl = dp__alloc(sizeof *sl);
  if (!sl) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  memset(sl, 0, sizeof *sl);
  sl->cap = pooled ? DP__STAGE_CHUNK : (n ? n : 1);
  sl->pooled = pooled;
  void *p = NULL;
  int rc = pooled ? dp__pinned_alloc(t->backend, sl->cap, &p, err) : 0;
  if (!pooled && !(p = dp__alloc(sl->cap))) rc = dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (rc) {
    dp__free(sl, sizeof *sl);
    return rc;
  }
  sl->p = p;
  pool->made += (unsigned)pooled;
  *out = sl;
  return 0;
}

void dp__tp_slot_destroy(dp_transport_t *t, slot_t *sl) {
  dp_event_free(sl->ev);
  if (sl->pooled) dp__pinned_free(t->backend, sl->p, sl->cap);
  else dp__free(sl->p, sl->cap);
  dp__free(sl, sizeof *sl);
}

static void seg_unref(seg_t *g) {
  if (--g->refs) return;
  for (unsigned i = 0; i < DP__STAGE_SLOTS; i++) dp_event_free(g->slots[i].ev);
  dp__shm_release(g->shm);
  dp__free(g, sizeof *g);
}

/* Back to its pool (or segment), its copies complete. */
void dp__tp_slot_put(dp_transport_t *t, pool_t *pool, slot_t *sl) {
  if (sl->seg) {
    dp_event_free(sl->ev); /* its next copy may be on another device */
    sl->ev = NULL;
    sl->next = sl->seg->free;
    sl->seg->free = sl;
    seg_unref(sl->seg);
    return;
  }
  dp_event_free(sl->ev);
  sl->ev = NULL;
  if (!sl->pooled) {
    dp__tp_slot_destroy(t, sl);
    return;
  }
  sl->next = pool->free;
  pool->free = sl;
}

/* Marks the copies queued on s so far with the slot's event. */
int dp__tp_slot_mark(dp_transport_t *t, slot_t *sl, dp_stream_t *s, dp_error_t *err) {
  int rc = sl->ev ? 0 : dp_event_new(t->backend, dp_stream_device(s), &sl->ev, err);
  return rc ? rc : dp_event_record(sl->ev, s, err);
}

/* ---- same-host slots: control messages ---- */



static void ctl_free(ctl_t *c) {
  if (c->data) dp__free(c->data, c->dlen);
  dp__free(c, sizeof *c);
}

/* Queues a control message (its header, and data copied when n > 0); the
 * loop sends it (never from a UCX callback). */
void dp__tp_ctl_queue_data(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                           size_t n) {
  ctl_t *c = dp__alloc(sizeof *c);
  if (c) {
    memset(c, 0, sizeof *c);
    c->data = n ? dp__alloc(n) : NULL;
    if (n && !c->data) dp__free(c, sizeof *c), c = NULL;
  }
  if (!c) {
    dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory for a control message");
    return;
  }
  c->id = id;
  c->hlen = hlen;
  memcpy(c->hdr, hdr, hlen);
  if (n) memcpy(c->data, data, n);
  c->dlen = n;
  if (ep->ctl_tail) ep->ctl_tail->next = c;
  else ep->ctl_head = c;
  ep->ctl_tail = c;
}

void dp__tp_ctl_queue(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen) {
  dp__tp_ctl_queue_data(ep, id, hdr, hlen, NULL, 0);
}

static void ctl_free_all(dp_endpoint_t *ep) {
  for (ctl_t *c = ep->ctl_head, *n; c; c = n) {
    n = c->next;
    ctl_free(c);
  }
  ep->ctl_head = ep->ctl_tail = NULL;
}

static void ctl_cb(void *req, ucs_status_t st, void *ud) {
  ctl_t *c = ud;
  (void)st; /* a lost control message is the endpoint's failure, reported on its own */
  dp_transport_t *t = c->t;
  t->nreq--;
  ucp_request_free(req);
  ctl_free(c);
}

/* Tries one active message on the lane, eagerly and only if UCX takes it at
 * once (a lane never holds a request: its endpoints have no error handling,
 * so UCX could not fail one when the peer dies). An error: not taken. */
ucs_status_ptr_t dp__tp_lane_send(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                                  size_t n, const ucp_request_param_t *p) {
  ucp_request_param_t q = *p;
  q.op_attr_mask |= UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL;
  q.flags |= UCP_AM_SEND_FLAG_EAGER;
  return ucp_am_send_nbx(ep->dep, id, hdr, hlen, data, n, &q);
}

/* Sends one active message: on the same-host lane when there is one, the
 * message is small and the lane takes it at once; else on the connection
 * (the receiver orders both by sequence). */
ucs_status_ptr_t dp__tp_am_send(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                                size_t n, const ucp_request_param_t *p) {
  if (ep->lane == LANE_ON && hlen + n <= DP__LANE_MAX && !(p->flags & UCP_AM_SEND_FLAG_RNDV)) {
    ucs_status_ptr_t r = dp__tp_lane_send(ep, id, hdr, hlen, data, n, p);
    if (!UCS_PTR_IS_ERR(r)) return r;
  }
  return ucp_am_send_nbx(ep->ep, id, hdr, hlen, data, n, p);
}


void dp__tp_ctl_flush(dp_transport_t *t, dp_endpoint_t *ep) {
  while (ep->ctl_head && !ep->dead) {
    ctl_t *c = ep->ctl_head;
    c->t = t;
    ep->ctl_head = c->next;
    if (!ep->ctl_head) ep->ctl_tail = NULL;
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = ctl_cb;
    p.user_data = c;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    /* CLOSE goes on the connection: a closing endpoint's lane worker is
       no longer progressed, and its answer must be seen there */
    ucs_status_ptr_t r = c->id == DP__AM_CLOSE ? ucp_am_send_nbx(ep->ep, c->id, c->hdr, c->hlen, c->data, c->dlen, &p)
                                               : dp__tp_am_send(ep, c->id, c->hdr, c->hlen, c->data, c->dlen, &p);
    if (UCS_PTR_IS_PTR(r)) {
      t->nreq++;
      continue;
    }
    ctl_free(c);
    if (r != NULL) dp__tp_ep_fail_status(ep, UCS_PTR_STATUS(r));
  }
}


/* The sender's offer: a segment of slots and its name. A segment that
 * cannot be made (no /dev/shm) leaves the endpoint on the UCX path. */
void dp__tp_shm_offer(dp_transport_t *t, dp_endpoint_t *ep) {
  ep->shm_state = SHM_NO;
  seg_t *g = dp__alloc(sizeof *g);
  if (!g) return;
  memset(g, 0, sizeof *g);
  if (dp__shm_create(t->backend, DP__STAGE_SLOTS, DP__STAGE_CHUNK, &g->shm, NULL)) {
    dp__free(g, sizeof *g);
    return;
  }
  g->refs = 1;
  for (unsigned i = DP__STAGE_SLOTS; i-- > 0;) {
    slot_t *sl = &g->slots[i];
    sl->p = dp__shm_slot(g->shm, i);
    sl->cap = DP__STAGE_CHUNK;
    sl->seg = g;
    sl->index = i;
    sl->next = g->free;
    g->free = sl;
  }
  dp__am_shm_offer_t o;
  memset(&o, 0, sizeof o);
  o.magic = DP__WIRE_MAGIC;
  o.nslots = DP__STAGE_SLOTS;
  o.slot_bytes = DP__STAGE_CHUNK;
  o.token = dp__shm_token(g->shm);
  snprintf(o.name, sizeof o.name, "%s", dp__shm_name(g->shm));
  ep->seg = g;
  ep->shm_state = SHM_OFFERED;
  ep->offer_deadline = now_ns() + DP__OFFER_NS;
  ep->offer_token = o.token;
  dp__tp_ctl_queue(ep, DP__AM_SHM_OFFER, &o, sizeof o);
}

/* The peer's offer of its segment (kept by the message's handler: mapping
 * and page-locking it takes long for a UCX callback), from the loop: mapped
 * if the peer connected from an address of this host and the file is what
 * the offer says; answered either way. */
void dp__tp_shm_answer(dp_transport_t *t, dp_endpoint_t *ep) {
  const dp__am_shm_offer_t *o = &ep->offer_in;
  ep->offer_pending = 0;
  dp__am_shm_ctl_t r = {DP__WIRE_MAGIC, 0, o->token};
  if (ep->peer_local && o->name[sizeof o->name - 1] == 0 && o->nslots == DP__STAGE_SLOTS &&
      o->slot_bytes == DP__STAGE_CHUNK &&
      dp__shm_map(t->backend, o->name, o->nslots, (size_t)o->slot_bytes, o->token, &ep->rshm, NULL) == 0)
    r.value = 1;
  dp__tp_ctl_queue(ep, DP__AM_SHM_REPLY, &r, sizeof r);
}

/* An offer refused, or unanswered in time (a peer stopped, or one that does
 * not know it), is withdrawn: its name would outlive this process if it
 * were killed. */
void dp__tp_shm_withdraw(dp_endpoint_t *ep) {
  dp__shm_unlink(ep->seg->shm);
  seg_unref(ep->seg); /* no slot of it was used yet */
  ep->seg = NULL;
  ep->shm_state = SHM_NO;
}

/* An endpoint that fails or closes lets go of its segments: pieces the
 * peer still holds are dropped with their slots (the peer may still read
 * them: they are never reused), and copies out of the peer's slots finish
 * without it. */
void dp__tp_ep_drop_shm(dp_transport_t *t, dp_endpoint_t *ep) {
  seg_t *g = ep->seg;
  if (g) {
    dp__shm_unlink(g->shm);
    for (unsigned i = 0; i < DP__STAGE_SLOTS; i++) {
      piece_t *pc = g->lent[i];
      if (!pc) continue;
      g->lent[i] = NULL;
      sop_t *s = pc->s;
      dp__free(pc, sizeof *pc);
      g->refs--; /* the slot's; never back to `free` */
      if (--s->outstanding == 0) dp__tp_sop_free(s);
    }
    ep->seg = NULL;
    seg_unref(g);
  }
  ep->shm_state = SHM_NO;
  for (rdone_t *r = t->rdone; r; r = r->next)
    if (r->ep == ep) r->ep = NULL;
  dp__shm_release(ep->rshm);
  ep->rshm = NULL;
  ctl_free_all(ep);
}
