/* transport/recv.c — receiving: frames, buffers, their order and checks, delivery. */
#include <assert.h>

#include "tp.h"
#include "../pickler/frame.h" /* dp__unpickle_checked */

/* ---- receiving ---- */

/* The rendezvous descriptor UCX's active-message callback running on this
 * thread was handed (NULL outside one, or once it was dropped). UCX
 * releases it itself, and answers its sender, when the callback returns
 * UCS_OK without having started its receive: released inside the callback
 * as well, it was released twice and its sender answered twice (a crash
 * in UCX's rendezvous code once a peer's values were refused). */
static _Thread_local void *am_cb_rndv;

void dp__tp_rndv_release(ucp_worker_h w, void *data) {
  if (data && data == am_cb_rndv) {
    am_cb_rndv = NULL; /* the callback returns UCS_OK: UCX drops it */
    return;
  }
  ucp_am_data_release(w, data);
}

static int bind_cb(void *ud, const dp_buffer_desc_t *d, dp_storage_t **out, dp_error_t *err) {
  void **ctx = ud;
  dp_transport_t *t = ctx[0];
  rmsg_t *m = ctx[1];
  int mode = dp__tp_buf_mode(t, d->device);
  if (mode == MODE_REFUSED) return dp__tp_refused(t, d->device, d->id, err);
  /* The reader binds the table's entries once each, ids 0 .. n-1, and
     on_frame checked n against the header's count, m->nbuf. */
  assert(d->id < m->nbuf);
  rbuf_t *b = &m->bufs[d->id];
  int rc = d->device.type == DP_DEVICE_CPU ? dp__tp_cpu_alloc(d->device, d->nbytes, out, &b->dst, err)
                                           : dp__tp_dev_alloc(t, d->device, d->nbytes, out, &b->dst, err);
  if (rc) return rc;
  b->storage = dp_storage_retain(*out); /* the message's own: its bytes arrive there whatever the value does */
  b->nbytes = d->nbytes;
  b->dev = d->device;
  b->staged = mode == MODE_STAGED;
  return 0;
}

/* Binds a kept frame's buffer again, as its value is read: to the storage
 * bind_cb made for it as the frame arrived (the same table, checked then). */
static int rebind_cb(void *ud, const dp_buffer_desc_t *d, dp_storage_t **out, dp_error_t *err) {
  rmsg_t *m = ((void **)ud)[1];
  /* the same bytes read again bind the same table: a difference would be
     a fault of ours, refused rather than trusted */
  if (d->id >= m->nbuf || !m->bufs[d->id].storage || m->bufs[d->id].nbytes != d->nbytes)
    return dp__err(err, DP_ESTATE, "transport: buffer %u is not the one bound as its frame arrived", d->id);
  *out = dp_storage_retain(m->bufs[d->id].storage);
  return 0;
}

/* What a value costs of its sender's credit: its frame, its buffers and
 * DP__CREDIT_PER_VALUE (internal.h, CREDIT), saturated (a header may say
 * anything). */
static uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return dp__add_ovf(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t credit_of(const dp__am_frame_hdr_t *h, size_t len) {
  return sat_add(sat_add(len, h->buf_bytes), DP__CREDIT_PER_VALUE);
}

/* Refuses message m with e: m->error is a copy, as long as its message
 * (NULL when there is no memory for one: the receive is then told so,
 * rmsg_error). */
static void refuse(rmsg_t *m, const dp_error_t *e) {
  m->failed = 1;
  if (m->error) return;
  size_t len = strnlen(e->message, sizeof e->message - 1);
  if (!(m->error = dp__alloc(DP__RERR_SIZE(len)))) return;
  m->error->code = e->code;
  m->error->backend_code = e->backend_code;
  m->error->offset = e->offset;
  memcpy(m->error->message, e->message, len);
  m->error->message[len] = 0;
}

/* Why m was refused. */
static dp_error_t rmsg_error(const rmsg_t *m) {
  dp_error_t e;
  if (!m->error) {
    dp__err(&e, DP_ENOMEM, "transport: out of memory for a refused frame's error");
    return e;
  }
  e.code = m->error->code;
  e.backend_code = m->error->backend_code;
  e.offset = m->error->offset;
  memcpy(e.message, m->error->message, strlen(m->error->message) + 1);
  return e;
}

/* Reads the frame of message m (checked by dp_frame_check: info) into
 * m->value, binding its buffers to new receive allocations — or, for a
 * kept frame (bound), to those made as it arrived. */
static int read_frame(dp_transport_t *t, rmsg_t *m, const uint8_t *b, dp_frame_info_t *info, int bound,
                      dp_error_t *e) {
  dp_unpickle_opts_t o = t->uopts;
  void *ctx[2] = {t, m};
  if (m->nbuf) {
    o.bind = bound ? rebind_cb : bind_cb;
    o.bind_ud = ctx;
  }
  /* checked: its checksum is not computed twice */
  return dp__unpickle_checked(b, info, b + DP_FRAME_HEADER + info->payload_len + info->table_len, &o, &m->value, e);
}

/* A deferred message is read as it is delivered; one the reader refuses
 * fails its receive as a frame refused on arrival does. Its frame is a copy
 * of our own, checked by dp_frame_check as it arrived: its header is only
 * parsed again, its checksum not computed twice. Refused, its buffers still
 * to come are drained, as a message refused on arrival has them: they are
 * no longer timed (a peer that never sends them holds nothing back —
 * pass_refused — and must not fail the endpoint as a stopped value does)
 * nor counted as held. */
static void read_deferred(dp_transport_t *t, dp_endpoint_t *ep, rmsg_t *m) {
  dp_error_t e;
  dp_frame_info_t info;
  m->deferred = 0;
  dp__frame_header_parse(m->frame_copy, &info);
  if (!read_frame(t, m, m->frame_copy, &info, 1, &e)) return;
  refuse(m, &e);
  m->deadline = 0;
  if (!ep->dead) ep->held -= m->held; /* a dead endpoint's count went with it (as in taken) */
  m->held = 0;
}

/* Binds the buffers of a frame kept to be read later (on_frame), so that
 * their bytes have somewhere to arrive. */
static int bind_kept(dp_transport_t *t, rmsg_t *m, const uint8_t *b, const dp_frame_info_t *info, dp_error_t *e) {
  dp_unpickle_opts_t o = t->uopts;
  void *ctx[2] = {t, m};
  o.bind = bind_cb;
  o.bind_ud = ctx;
  return dp__frame_bind(b, info, &o, e);
}

/* A frame message: check the frame, and read it into its value, binding its
 * buffers to new receive allocations — a frame that no value receive takes
 * at once is kept as its bytes, its buffers bound, and read when it is
 * delivered (deferred), so that what values nobody took hold is their
 * frames and buffers, as the credit counts them, and not up to
 * DP_UNPICKLE_MEMORY_PER_BYTE times as much, and the resolver meets values
 * in their order. A frame the unpickler refuses fails this message only (its buffers
 * are drained); bad framing fails the endpoint. pulled: NULL for an eager
 * frame (data is UCX's); for one that came by rendezvous, the memory it was
 * pulled into (data), which a kept frame keeps instead of a copy (*pulled
 * is then NULL). */
static int on_frame(dp_transport_t *t, dp_endpoint_t *ep, const dp__am_frame_hdr_t *h, const void *data, size_t len,
                    uint8_t **pulled) {
  if (h->seq != ep->recv_seq || h->frame_len != len) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "frame message out of sequence or of the wrong length");
    return DP_EFORMAT;
  }
  atomic_fetch_add_explicit(&dp__transport_frames_in, 1, memory_order_relaxed);
  rmsg_t *m = dp__alloc(sizeof *m);
  if (!m) {
    dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory for a received message");
    return DP_ENOMEM;
  }
  memset(m, 0, sizeof *m);
  m->seq = ep->recv_seq++;
  m->nbuf = h->nbuffers;
  dp_error_t e;
  dp_frame_info_t info;
  int rc = dp_frame_check(data, len, &info, &e);
  if (!rc && (info.flags & 1u) && h->nbuffers)
    rc = dp__err(&e, DP_EFORMAT, "transport: an inline frame announced %u out-of-band buffer%s", h->nbuffers,
                 h->nbuffers == 1 ? "" : "s");
  if (!rc && !(info.flags & 1u) && info.nbuffers != h->nbuffers)
    rc = dp__err(&e, DP_EFORMAT, "transport: frame has %u buffer%s, its message announced %u",
                 info.nbuffers, info.nbuffers == 1 ? "" : "s", h->nbuffers);
  /* the frame receive waiting for it refuses a message with buffers
     (deliver): at its frame, so that its buffers are neither allocated (a
     header may announce any size) nor waited for (a sender may never send
     them); one queued behind others is refused as it is delivered */
  if (!rc && m->nbuf && !ep->rq_head && ep->w_head && ep->w_head->frame)
    rc = dp__err(&e, DP_EFORMAT, "transport: %s: the message carries %u out-of-band buffer%s, "
                 "not a self-contained frame", ep->name, m->nbuf, m->nbuf == 1 ? "" : "s");
  if (!rc && m->nbuf && !(m->bufs = dp__alloc_array(m->nbuf, sizeof *m->bufs)))
    rc = dp__err(&e, DP_ENOMEM, "transport: out of memory");
  if (m->bufs) memset(m->bufs, 0, m->nbuf * sizeof *m->bufs);
  /* a self-contained frame is kept (for a recv_frame, or to be read when
     delivered) unless a value receive takes it at once (nothing queued
     before it) */
  int now = !ep->rq_head && ep->w_head && !ep->w_head->frame;
  int keep = !rc && !now;
  if (!rc && !keep) rc = read_frame(t, m, data, &info, 0, &e);
  /* a kept frame's buffers are bound now, their bytes arriving before a
     receive takes it; its value is read then, in the values' order */
  if (keep && m->nbuf) rc = bind_kept(t, m, data, &info, &e);
  if (keep && !rc && pulled) {
    m->frame_copy = *pulled; /* allocated as frame_copy is, len ? len : 1 */
    m->frame_len = len;
    *pulled = NULL;
  } else if (keep && !rc) {
    if (!(m->frame_copy = dp__alloc(len ? len : 1)))
      rc = dp__err(&e, DP_ENOMEM, "transport: out of memory");
    else {
      memcpy(m->frame_copy, data, len);
      m->frame_len = len;
    }
  }
  m->deferred = keep && !rc;
  if (rc) refuse(m, &e);
  m->buf_bytes = h->buf_bytes;
  if (!m->failed) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < m->nbuf; i++) sum += m->bufs[i].nbytes;
    if (sum != h->buf_bytes) {
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "the buffers' sizes differ from the frame message's total");
      dp__tp_rmsg_free(m);
      return DP_EFORMAT;
    }
  }
  /* an eager frame was never the sender's to hold back; a refused message
     holds nothing (its buffers are dropped as they come, whatever it claims) */
  m->held = m->failed ? 0 : m->buf_bytes + (pulled ? len : 0);
  /* a peer that announced buffers and stopped sending them would hold this
     receive, and every later one, forever: timed as a posted send is (a
     refused message's buffers hold nothing back: pass_refused) */
  if (!m->failed && m->nbuf) m->deadline = dp__tp_deadline(t);
  ep->held += m->held;
  m->charge = credit_of(h, len);
  if (ep->rq_tail) ep->rq_tail->next = m;
  else ep->rq_head = m;
  ep->rq_tail = m;
  ep->cur = m;
  dp__tp_deliver(t, ep);
  return 0;
}

static void scatter(rmsg_t *m, uint64_t first, uint32_t count, const uint8_t *src) {
  for (uint32_t k = 0; k < count; k++) {
    rbuf_t *b = &m->bufs[first + k];
    if (b->nbytes) memcpy(b->dst, src, (size_t)b->nbytes);
    src += b->nbytes;
  }
}

/* Queues the copies of a received piece (its bytes at src) to its buffers
 * on the receive stream of their device (*st). */
static int copy_in(dp_transport_t *t, rmsg_t *m, const dp__am_bufs_hdr_t *h, const uint8_t *src, dp_stream_t **st,
                   dp_error_t *e) {
  *st = NULL;
  int rc = dp__tp_own_stream(t, t->streams, m->bufs[h->first].dev, 1, st, e);
  size_t off = 0;
  for (uint32_t k = 0; !rc && k < h->count; k++) {
    rbuf_t *b = &m->bufs[h->first + k];
    size_t n = h->count == 1 ? (size_t)h->total : (size_t)b->nbytes;
    rc = dp_memcpy_async(*st, (uint8_t *)b->dst + (h->count == 1 ? h->offset : 0), src + off, n, e);
    off += n;
  }
  return rc;
}

/* Copies a received slot to its buffers; the slot comes back once the
 * copies are done (poll_slots). A failure fails the endpoint. */
static int stage_in(dp_transport_t *t, dp_endpoint_t *ep, rmsg_t *m, const dp__am_bufs_hdr_t *h, slot_t *sl) {
  dp_error_t e;
  dp_stream_t *st;
  int rc = copy_in(t, m, h, sl->p, &st, &e);
  if (!rc) rc = dp__tp_slot_mark(t, sl, st, &e);
  if (rc) {
    if (st) dp_stream_synchronize(st, NULL); /* the copies queued read the slot */
    dp__tp_slot_put(t, &t->rx, sl);
    dp__tp_ep_fail(ep, &e);
    return rc;
  }
  sl->next = t->rx_busy;
  t->rx_busy = sl;
  return 0;
}

/* A peer's slot is the peer's again. */
void dp__tp_shm_done(dp_endpoint_t *ep, uint64_t slot) {
  dp__am_shm_ctl_t c = {DP__WIRE_MAGIC, (uint32_t)slot, 0};
  dp__tp_ctl_queue(ep, DP__AM_SHM_DONE, &c, sizeof c);
}

/* A piece in the peer's slot: copied to its buffers straight from the
 * mapping (staged: on the receive stream, the slot given back once the
 * copies are done; direct: by the host, at once). */
static int shm_in(dp_transport_t *t, dp_endpoint_t *ep, rmsg_t *m, const dp__am_bufs_hdr_t *h, uint64_t slot,
                  int staged) {
  const uint8_t *src = dp__shm_slot(ep->rshm, (unsigned)slot);
  atomic_fetch_add(&dp__transport_shm_pieces, 1);
  if (!staged) {
    if (h->count > 1) scatter(m, h->first, h->count, src);
    else if (h->total) memcpy((uint8_t *)m->bufs[h->first].dst + h->offset, src, (size_t)h->total);
    dp__tp_shm_done(ep, slot);
    dp__tp_deliver(t, ep);
    return 0;
  }
  dp_error_t e;
  dp_stream_t *st;
  rdone_t *r = dp__alloc(sizeof *r);
  int rc = r ? copy_in(t, m, h, src, &st, &e) : dp__err(&e, DP_ENOMEM, "transport: out of memory");
  if (r) memset(r, 0, sizeof *r);
  if (!rc) rc = dp_event_new(t->backend, dp_stream_device(st), &r->ev, &e);
  if (!rc) rc = dp_event_record(r->ev, st, &e);
  if (rc) {
    if (r && st) dp_stream_synchronize(st, NULL); /* the copies queued read the mapping */
    if (r) dp_event_free(r->ev);
    if (r) dp__free(r, sizeof *r);
    dp__tp_ep_fail(ep, &e);
    return rc;
  }
  r->ep = ep;
  r->shm = dp__shm_retain(ep->rshm);
  r->slot = (uint32_t)slot;
  r->next = t->rdone;
  t->rdone = r;
  dp__tp_deliver(t, ep);
  return 0;
}

/* A pulled piece (c) arrived, or failed: its bytes go to their buffers
 * (scattered, or staged out of its slot), and the message may be complete.
 * -1 when the endpoint failed. */
static int recv_done(rctx_t *c, ucs_status_t st) {
  rmsg_t *m = c->m;
  dp_transport_t *t = c->t;
  int live = st == UCS_OK && !m->detached && !m->failed;
  if (live && c->tmp) scatter(m, c->h.first, c->h.count, c->tmp);
  if (c->tmp) dp__free(c->tmp, c->tmplen);
  m->pending--;
  dp_endpoint_t *ep = c->ep;
  slot_t *sl = c->slot;
  dp__am_bufs_hdr_t h = c->h;
  dp__free(c, sizeof *c);
  if (sl && !live) dp__tp_slot_put(t, &t->rx, sl);
  if (m->detached) {
    if (!m->pending) dp__tp_rmsg_free(m);
    return 0;
  }
  if (st != UCS_OK) {
    dp__tp_ep_failf(ep, DP_EIO, "receiving a buffer failed (%s)", ucs_status_string(st));
    return -1;
  }
  if (sl && live && stage_in(t, ep, m, &h, sl)) return -1;
  dp__tp_deliver(t, ep);
  return 0;
}

/* Pulls rendezvous data into dst: a request counted on the transport and
 * on the endpoint's connection (which is not closed while it is in flight:
 * dp__tp_ep_force_close), cb(ud) called when it completes; or, not a
 * pointer, the status of a pull done (or failed) at once, with no callback. */
static ucs_status_ptr_t pull_param(dp_transport_t *t, dp_endpoint_t *ep, void *data, void *dst, size_t n,
                                   const ucp_request_param_t *p) {
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(t->worker, data, dst, n, p);
  if (UCS_PTR_IS_PTR(r)) {
    t->nreq++;
    if (!ep->rndv_inflight++) ep->pull_deadline = dp__tp_deadline(t);
  }
  dp__tp_rndv_hook(ep);
  return r;
}

static ucs_status_ptr_t pull(dp_transport_t *t, dp_endpoint_t *ep, void *data, void *dst, size_t n,
                             ucp_am_recv_data_nbx_callback_t cb, void *ud) {
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = cb;
  p.user_data = ud;
  return pull_param(t, ep, data, dst, n, &p);
}

/* A pull's request completed: uncounted and freed. */
static void pulled(void *req, dp_transport_t *t, dp_endpoint_t *ep) {
  ucp_request_free(req);
  t->nreq--;
  ep->rndv_inflight--; /* the endpoint outlives it (dp__tp_ep_force_close) */
  ep->pull_deadline = ep->rndv_inflight ? dp__tp_deadline(t) : 0; /* it arrived: the clock restarts */
}

static void recv_cb(void *req, ucs_status_t st, size_t len, void *ud) {
  rctx_t *c = ud;
  (void)len;
  pulled(req, c->t, c->ep);
  recv_done(c, st);
}

typedef struct drain {
  dp_transport_t *t;
  dp_endpoint_t *ep;
} drain_t;

static void drain_cb(void *req, ucs_status_t st, size_t len, void *ud) {
  drain_t *d = ud;
  (void)st, (void)len;
  pulled(req, d->t, d->ep);
  dp__free(d, sizeof *d);
}

/* A UCX generic datatype whose receive keeps nothing: a drained buffer
 * costs no memory of its size, whatever its sender announced. Its state is
 * the byte count plus one (never NULL). */
static void *discard_start_pack(void *ctx, const void *buf, size_t count) {
  (void)ctx, (void)buf;
  return (void *)(uintptr_t)(count + 1);
}
static void *discard_start_unpack(void *ctx, void *buf, size_t count) {
  (void)ctx, (void)buf;
  return (void *)(uintptr_t)(count + 1);
}
static size_t discard_packed_size(void *state) { return (size_t)((uintptr_t)state - 1); }
static size_t discard_pack(void *state, size_t offset, void *dest, size_t max) {
  (void)state, (void)offset, (void)dest, (void)max;
  return 0;
}
static ucs_status_t discard_unpack(void *state, size_t offset, const void *src, size_t n) {
  (void)state, (void)offset, (void)src, (void)n;
  return UCS_OK;
}
static void discard_finish(void *state) { (void)state; }

static ucp_datatype_t discard_dt;
static ucs_status_t discard_status = UCS_ERR_NO_RESOURCE;
static pthread_once_t discard_once = PTHREAD_ONCE_INIT;
static void discard_init(void) {
  static const ucp_generic_dt_ops_t ops = {discard_start_pack, discard_start_unpack, discard_packed_size,
                                          discard_pack,       discard_unpack,       discard_finish};
  discard_status = ucp_dt_create_generic(&ops, NULL, &discard_dt);
}

/* Pulls a rendezvous buffer of a refused message (its endpoint lives on)
 * through the discarding datatype: the sender's send then completes as any
 * other, and UCX's descriptor goes back (one released unread stays in its
 * pool until the worker goes), with no memory held for its bytes however
 * many the peer sends. Without the datatype, or memory for the request's
 * context, it is released unread. */
static void drain_rndv(dp_transport_t *t, dp_endpoint_t *ep, void *data, size_t n) {
  pthread_once(&discard_once, discard_init);
  drain_t *d = discard_status == UCS_OK ? dp__alloc(sizeof *d) : NULL;
  if (!d) {
    dp__tp_rndv_release(t->worker, data);
    return;
  }
  d->t = t;
  d->ep = ep;
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  p.cb.recv_am = drain_cb;
  p.user_data = d;
  p.datatype = discard_dt;
  if (!UCS_PTR_IS_PTR(pull_param(t, ep, data, NULL, n, &p))) dp__free(d, sizeof *d);
}

/* Pulls a rendezvous piece (c, counted in its message's pending) into its
 * slot, its buffer, or packed scratch memory. 0, or -1 when the endpoint
 * failed. */
int dp__tp_post_recv(dp_transport_t *t, rctx_t *c, void *data) {
  rmsg_t *m = c->m;
  dp_endpoint_t *ep = c->ep;
  const dp__am_bufs_hdr_t *h = &c->h;
  void *dst = c->slot ? (void *)c->slot->p : (uint8_t *)m->bufs[h->first].dst + h->offset;
  if (!c->slot && h->count > 1) {
    if (!(c->tmp = dp__alloc(h->total ? (size_t)h->total : 1))) {
      dp__free(c, sizeof *c);
      m->pending--;
      dp__tp_rndv_release(t->worker, data);
      dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory receiving packed buffers");
      return -1;
    }
    c->tmplen = h->total ? (size_t)h->total : 1;
    dst = c->tmp;
  }
  ucs_status_ptr_t r = pull(t, ep, data, dst, (size_t)h->total, recv_cb, c);
  if (UCS_PTR_IS_PTR(r)) return 0;
  return recv_done(c, UCS_PTR_STATUS(r)); /* done at once, or failed: no callback comes */
}

/* A buffers message: checked against the frame's table (the next buffer,
 * the next chunk of it), then received where its buffers are (direct) or
 * into a slot copied to them (staged). */
static int on_bufs(dp_transport_t *t, dp_endpoint_t *ep, const dp__am_bufs_hdr_t *h, void *data, size_t len,
                   int rndv, int shm, uint64_t slot) {
  rmsg_t *m = ep->cur;
  int ok = m && h->seq == m->seq && h->first == m->next_index && h->count != 0 && h->count <= m->nbuf &&
           h->first <= m->nbuf - h->count &&
           (shm ? !rndv && !len && ep->rshm && slot < DP__STAGE_SLOTS && h->total <= DP__STAGE_CHUNK
                : len == h->total);
  if (ok && h->count == 1) /* the next chunk, a whole one or the rest (headers_ok checked the rest) */
    ok = h->offset == m->next_off && (h->total == DP__STAGE_CHUNK || h->total == h->size - h->offset);
  else if (ok)
    ok = !m->next_off;
  if (!ok) {
    if (rndv) dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a buffers message does not follow its frame's table");
    return -1;
  }
  m->got = sat_add(m->got, h->total);
  if (m->deadline) m->deadline = dp__tp_deadline(t); /* it arrives: the clock restarts */
  if (h->count > 1 || h->offset + h->total == h->size) {
    m->next_index += h->count;
    m->next_off = 0;
  } else {
    m->next_off += h->total;
  }
  if (m->failed) {
    if (shm) dp__tp_shm_done(ep, slot);
    else if (rndv) drain_rndv(t, ep, data, len);
    dp__tp_deliver(t, ep);
    return 0;
  }
  rbuf_t *b = &m->bufs[h->first];
  uint64_t sum = 0;
  int staged = 0, spans = 0;
  for (uint32_t k = 0; k < h->count; k++) {
    rbuf_t *bk = &m->bufs[h->first + k];
    sum += bk->nbytes;
    staged |= bk->staged;
    spans |= bk->dev.type != b->dev.type || bk->dev.index != b->dev.index;
  }
  if (h->count == 1 ? h->size != b->nbytes : sum != h->total) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a buffers message's size differs from its frame's table");
    if (rndv) dp__tp_rndv_release(t->worker, data);
    return -1;
  }
  /* a direct buffer comes whole; a staged one in chunks of DP__STAGE_CHUNK
     (the last shorter), so that a receive slot holds any piece */
  if (h->count == 1 && (staged ? h->total > DP__STAGE_CHUNK : h->total != h->size)) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a buffer is cut into pieces other than the protocol's");
    if (rndv) dp__tp_rndv_release(t->worker, data);
    return -1;
  }
  if (staged && spans) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a packed message of device buffers spans devices");
    if (rndv) dp__tp_rndv_release(t->worker, data);
    return -1;
  }
  if (shm) return shm_in(t, ep, m, h, slot, staged);
  slot_t *sl = NULL;
  if (staged) {
    dp_error_t e;
    if (dp__tp_slot_get(t, &t->rx, (size_t)h->total, !rndv, &sl, &e)) {
      if (rndv) dp__tp_rndv_release(t->worker, data);
      dp__tp_ep_fail(ep, &e);
      return -1;
    }
  }
  if (!rndv) {
    if (sl) {
      if (h->total) memcpy(sl->p, data, (size_t)h->total);
      if (stage_in(t, ep, m, h, sl)) return -1;
    } else if (h->count == 1) {
      if (h->total) memcpy((uint8_t *)b->dst + h->offset, data, (size_t)h->total);
    } else {
      scatter(m, h->first, h->count, data);
    }
    dp__tp_deliver(t, ep);
    return 0;
  }
  rctx_t *c = dp__alloc(sizeof *c);
  if (!c) {
    if (sl) dp__tp_slot_put(t, &t->rx, sl);
    dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory receiving a buffer");
    return -1;
  }
  memset(c, 0, sizeof *c);
  c->t = t;
  c->ep = ep;
  c->m = m;
  c->h = *h;
  c->slot = sl;
  m->pending++;
  if (staged && !sl) { /* every receive slot is taken: wait for one (poll_slots) */
    c->data = data;
    if (t->rx_wait_tail) t->rx_wait_tail->next = c;
    else t->rx_wait_head = c;
    t->rx_wait_tail = c;
    return 2;
  }
  return dp__tp_post_recv(t, c, data);
}

/* Grants the peer credit again (internal.h, CREDIT) when at most half the
 * window is left of the last grant (or the last value crossed it). */
static void grant(dp_transport_t *t, dp_endpoint_t *ep) {
  uint64_t window = t->max_inflight > DP__CREDIT_INITIAL ? t->max_inflight : DP__CREDIT_INITIAL;
  if (ep->credit_taken < ep->credit_granted && ep->credit_granted - ep->credit_taken > window / 2) return;
  ep->credit_granted = sat_add(ep->credit_taken, window);
  dp__am_shm_ctl_t c = {DP__WIRE_MAGIC, 0, ep->credit_granted};
  dp__tp_ctl_queue(ep, DP__AM_CREDIT, &c, sizeof c);
}

/* A received message leaves its endpoint (taken, or refused and drained):
 * the credit its value took goes back to the sender. */
static void taken(dp_transport_t *t, dp_endpoint_t *ep, rmsg_t *m) {
  if (ep->dead) { /* a value the peer's close left: nothing to grant */
    pthread_mutex_lock(&t->mu);
    ep->kept--;
    pthread_mutex_unlock(&t->mu);
    return;
  }
  ep->held -= m->held;
  ep->credit_taken = sat_add(ep->credit_taken, m->charge);
  grant(t, ep);
}

static void fail_waiters(dp_transport_t *t, dp_endpoint_t *ep);
static int refused_owed(const dp_endpoint_t *ep);
static void pass_refused(dp_transport_t *t, dp_endpoint_t *ep);

/* Hands complete messages, in order, to the waiting receives. */
void dp__tp_deliver(dp_transport_t *t, dp_endpoint_t *ep) {
  while (ep->rq_head && (!ep->dead || ep->keep_received)) {
    rmsg_t *m = ep->rq_head;
    if (m->deferred && ep->w_head) read_deferred(t, ep, m);
    if (m->failed && !m->answered) {
      /* a refused frame fails its receive at once: its buffers (as many as
         its message announced, which a corrupt frame cannot vouch for) are
         then absorbed without a receive waiting on them */
      rwait_t *w = ep->w_head;
      if (!w) return;
      ep->w_head = w->next;
      if (!ep->w_head) ep->w_tail = NULL;
      m->answered = 1; /* before the future: its callbacks run now, and may close the endpoint */
      dp_error_t err = rmsg_error(m);
      dp_future_set_error(w->f, &err, NULL);
      dp_future_release(w->f);
      dp__free(w, sizeof *w);
      continue; /* m is looked at again from the queue, if it is still there */
    }
    if (m->next_index < m->nbuf || m->pending) return;
    if (m->answered) {
      ep->rq_head = m->next;
      if (!ep->rq_head) ep->rq_tail = NULL;
      if (ep->cur == m) ep->cur = NULL;
      taken(t, ep, m);
      dp__tp_rmsg_free(m);
      continue;
    }
    if (!ep->w_head) {
      if (!m->ready_counted) {
        m->ready_counted = 1;
        atomic_fetch_add_explicit(&dp__transport_ready_unclaimed, 1, memory_order_relaxed);
      }
      return;
    }
    rwait_t *w = ep->w_head;
    ep->rq_head = m->next;
    if (!ep->rq_head) ep->rq_tail = NULL;
    if (ep->cur == m) ep->cur = NULL;
    ep->w_head = w->next;
    if (!ep->w_head) ep->w_tail = NULL;
    taken(t, ep, m);
    if (m->failed) {
      dp_error_t err = rmsg_error(m);
      dp_future_set_error(w->f, &err, NULL);
    } else if (w->frame) {
      dp_value_t b = dp_none();
      dp_error_t e;
      int rc = m->nbuf ? dp__err(&e, DP_EFORMAT, "transport: %s: the message carries %u out-of-band buffer%s, "
                                                 "not a self-contained frame", ep->name, m->nbuf, m->nbuf == 1 ? "" : "s")
                       : dp_bytes_new(m->frame_copy, m->frame_len, &b, &e);
      if (rc) dp_future_set_error(w->f, &e, NULL);
      else dp_future_mark_completed(w->f, b, NULL);
    } else {
      dp_future_mark_completed(w->f, m->value, NULL);
      m->value = dp_none();
    }
    dp_future_release(w->f);
    dp__free(w, sizeof *w);
    dp__tp_rmsg_free(m);
  }
  if (ep->dead && ep->keep_received && !ep->rq_head) fail_waiters(t, ep);
}

/* Receives waiting on an endpoint the peer's close failed, once the values
 * it sent first are taken: they fail with its error. */
static void fail_waiters(dp_transport_t *t, dp_endpoint_t *ep) {
  dp_error_t e;
  pthread_mutex_lock(&t->mu);
  e = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  while (ep->w_head) {
    rwait_t *w = ep->w_head;
    ep->w_head = w->next;
    if (!ep->w_head) ep->w_tail = NULL;
    dp_future_set_error(w->f, &e, NULL);
    dp_future_release(w->f);
    dp__free(w, sizeof *w);
  }
}

/* The peer closed its endpoint (internal.h, CLOSE): once every value its
 * CLOSE counts has been received — its frame and all its buffers, nothing
 * parked or being pulled — the answer goes and the endpoint fails with
 * DP_ECANCELED, its pending receives and sends at once; the values
 * received first stay to be taken. Checked by every pass while the CLOSE
 * waits for values (they may come after it: lanes, parking). */
void dp__tp_peer_close_check(dp_transport_t *t, dp_endpoint_t *ep) {
  if (ep->nparked) dp__tp_ep_pump_inbox(t, ep);
  if (ep->dead) return;
  if (ep->recv_seq > ep->peer_sent) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a value beyond the count of the peer's close");
    return;
  }
  if (ep->recv_seq < ep->peer_sent || ep->fpull) return;
  /* every value counted has come: a refused one's missing buffers hold the
     close back no more than they hold a next value (pass_refused); what is
     still parked now is past the count */
  if (refused_owed(ep)) pass_refused(t, ep);
  if (ep->dead || (ep->cur && ep->cur->next_index < ep->cur->nbuf)) return;
  if (ep->nparked) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a value beyond the count of the peer's close");
    return;
  }
  for (rmsg_t *m = ep->rq_head; m; m = m->next)
    if (m->pending) return;
  dp__am_shm_ctl_t c = {DP__WIRE_MAGIC, 1, ep->recv_seq};
  dp__tp_ctl_queue(ep, DP__AM_CLOSE, &c, sizeof c);
  dp__tp_ctl_flush(t, ep);
  if (ep->dead) return; /* the answer could not go: the connection failed */
  char what[160];
  snprintf(what, sizeof what, "the peer closed its endpoint (after sending %llu value%s, all received)",
           (unsigned long long)ep->peer_sent, ep->peer_sent == 1 ? "" : "s");
  ep->keep_received = 1;
  ep->close_gently = 1; /* flushed: the answer leaves before the connection goes */
  dp__tp_ep_failf(ep, DP_ECANCELED, "%s", what);
  dp__tp_deliver(t, ep);
}

/* Messages are processed in the sender's order: frame N, then its buffers
 * by index, then frame N + 1. UCX may hand active messages over in another
 * order (messages sent while the connection is wired up, rendezvous beside
 * eager), so one that is not the next is parked, sorted by that order, and
 * taken when its turn comes. A frame also waits while the endpoint holds
 * more than the bound of received bytes nobody took (backpressure). */
typedef struct key {
  uint64_t seq, kind, first, off;
} key_t;

static key_t key_of(unsigned id, const void *hdr) {
  key_t k;
  if (id == DP__AM_FRAME) {
    const dp__am_frame_hdr_t *h = hdr;
    k.seq = h->seq, k.kind = 0, k.first = 0, k.off = 0;
  } else {
    const dp__am_bufs_hdr_t *h = hdr;
    k.seq = h->seq, k.kind = 1, k.first = h->first, k.off = h->offset;
  }
  return k;
}

static int key_cmp(key_t a, key_t b) {
  if (a.seq != b.seq) return a.seq < b.seq ? -1 : 1;
  if (a.kind != b.kind) return a.kind < b.kind ? -1 : 1;
  if (a.first != b.first) return a.first < b.first ? -1 : 1;
  if (a.off != b.off) return a.off < b.off ? -1 : 1;
  return 0;
}

static key_t expected(const dp_endpoint_t *ep) {
  key_t k;
  if (ep->cur && ep->cur->next_index < ep->cur->nbuf)
    k.seq = ep->cur->seq, k.kind = 1, k.first = ep->cur->next_index, k.off = ep->cur->next_off;
  else
    k.seq = ep->recv_seq, k.kind = 0, k.first = 0, k.off = 0;
  return k;
}

/* ---- parked messages ----
 * Two binary min-heaps in the sender's order (key_cmp): frames, and the
 * buffers' pieces. A peer may park up to DP__MAX_PARKED messages in any
 * order (a hostile one, in the worst): each costs O(log n) steps to park
 * and to take, never a walk along the others (a sorted list made a peer
 * sending in reverse order cost n steps a message, n^2 in all). Frames are
 * kept apart so that "the next frame is parked" is a look at one top. A
 * message parked twice is found when its copy's turn comes: it then
 * repeats one already received. */
_Atomic unsigned long dp__transport_park_steps;

static int park_less(const inbox_t *a, const inbox_t *b) {
  return key_cmp(key_of(a->id, a->hdr), key_of(b->id, b->hdr)) < 0;
}

static park_t *park_of(dp_endpoint_t *ep, unsigned id) {
  return id == DP__AM_FRAME ? &ep->parked_frames : &ep->parked_pieces;
}

/* What a parked message holds of the receiver: its entry and its data,
 * copied out of UCX (am_any); a rendezvous one, whose data stays with the
 * sender, its entry and the descriptor UCX keeps of it (internal.h). */
static uint64_t park_cost(int rndv, size_t len) { return sizeof(inbox_t) + (rndv ? DP__PARKED_RNDV_HOLD : len); }
static uint64_t parked_cost(const inbox_t *b) { return park_cost(b->rndv, b->len); }

static int park_push(dp_endpoint_t *ep, inbox_t *b) {
  park_t *q = park_of(ep, b->id);
  if (dp__grow((void **)&q->v, &q->cap, q->n + 1, sizeof *q->v)) return DP_ENOMEM;
  size_t i = q->n++;
  unsigned long steps = 0;
  for (; i > 0; steps++) {
    size_t up = (i - 1) / 2;
    if (!park_less(b, q->v[up])) break;
    q->v[i] = q->v[up];
    i = up;
  }
  q->v[i] = b;
  ep->nparked++;
  ep->parked_bytes += parked_cost(b);
  atomic_fetch_add_explicit(&dp__transport_park_steps, steps + 1, memory_order_relaxed);
  return 0;
}

/* Takes the top of b's heap, which b is. */
static void park_take(dp_endpoint_t *ep, inbox_t *b) {
  park_t *q = park_of(ep, b->id);
  inbox_t *last = q->v[--q->n];
  size_t i = 0;
  unsigned long steps = 0;
  for (size_t c; (c = 2 * i + 1) < q->n; steps++) {
    if (c + 1 < q->n && park_less(q->v[c + 1], q->v[c])) c++;
    if (!park_less(q->v[c], last)) break;
    q->v[i] = q->v[c];
    i = c;
  }
  if (q->n) q->v[i] = last;
  if (!q->n && q->cap > 1024) { /* a burst's array goes with it */
    dp__free(q->v, q->cap * sizeof *q->v);
    q->v = NULL;
    q->cap = 0;
  }
  ep->nparked--;
  ep->parked_bytes -= parked_cost(b);
  atomic_fetch_add_explicit(&dp__transport_park_steps, steps + 1, memory_order_relaxed);
}

/* The parked message first in the sender's order (NULL: none). */
static inbox_t *park_head(dp_endpoint_t *ep) {
  park_t *f = &ep->parked_frames, *p = &ep->parked_pieces;
  if (!f->n || !p->n) return f->n ? f->v[0] : p->n ? p->v[0] : NULL;
  return park_less(p->v[0], f->v[0]) ? p->v[0] : f->v[0];
}

/* Every parked message goes (release: its UCX data too; not once the
 * worker is gone), and the heaps' memory with them. */
void dp__tp_park_drop(dp_transport_t *t, dp_endpoint_t *ep, int release) {
  (void)t;
  /* taken off the endpoint first: a release may fail the endpoint from
     inside (UCX calls its error callback when the answer the release sends
     finds the connection failed), and that failure drops what is parked
     again — the same messages, freed twice, when they were still there */
  park_t qs[2] = {ep->parked_frames, ep->parked_pieces};
  memset(&ep->parked_frames, 0, sizeof ep->parked_frames);
  memset(&ep->parked_pieces, 0, sizeof ep->parked_pieces);
  ep->nparked = 0;
  ep->parked_bytes = 0;
  for (int k = 0; k < 2; k++) {
    park_t *q = &qs[k];
    for (size_t i = 0; i < q->n; i++) {
      if (!release && q->v[i]->rndv) q->v[i]->data = NULL; /* UCX's: its worker may be gone */
      dp__tp_inbox_drop(ep, q->v[i]);
    }
    dp__free(q->v, q->cap * sizeof *q->v);
  }
}

/* A parked message taken and handed on (process, absorb_piece) goes: its
 * rendezvous descriptor went with it; a copy of eager data is ours. */
static void inbox_done(dp_endpoint_t *ep, inbox_t *b) {
  if (b->rndv) b->data = NULL;
  dp__tp_inbox_drop(ep, b);
}

/* A frame waits while one before it is being pulled, or while the
 * endpoint holds more than the bound of received bytes nobody took. */
static int blocked(const dp_transport_t *t, const dp_endpoint_t *ep, unsigned id) {
  return id == DP__AM_FRAME && (ep->fpull || (ep->held && ep->held > t->max_inflight));
}

/* A frame that came by rendezvous (larger than DP__FRAME_EAGER_MAX): pulled
 * into memory of ours, then read as an eager one is. Messages behind it
 * (its own buffers included) wait, parked, until it is read. */
typedef struct fpull {
  dp_transport_t *t;
  dp_endpoint_t *ep;
  dp__am_frame_hdr_t h;
  uint8_t *buf;
  size_t len;
} fpull_t;

static void pull_done(fpull_t *p, ucs_status_t st) {
  dp_transport_t *t = p->t;
  dp_endpoint_t *ep = p->ep;
  ep->fpull = NULL;
  if (ep->dead) {
    /* a failed endpoint dropped what it had: the frame goes too */
  } else if (st != UCS_OK) {
    dp__tp_ep_failf(ep, DP_EIO, "receiving a frame failed (%s)", ucs_status_string(st));
  } else {
    on_frame(t, ep, &p->h, p->buf, p->len, &p->buf);
    if (ep->nparked) dp__tp_ep_pump_inbox(t, ep);
  }
  if (p->buf) dp__free(p->buf, p->len ? p->len : 1);
  dp__free(p, sizeof *p);
}

static void pull_cb(void *req, ucs_status_t st, size_t len, void *ud) {
  fpull_t *p = ud;
  (void)len;
  pulled(req, p->t, p->ep);
  pull_done(p, st);
}

static int pull_frame(dp_transport_t *t, dp_endpoint_t *ep, const dp__am_frame_hdr_t *h, void *data, size_t len) {
  if (h->seq != ep->recv_seq || h->frame_len != len) {
    dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "frame message out of sequence or of the wrong length");
    return DP_EFORMAT;
  }
  fpull_t *p = dp__alloc(sizeof *p);
  uint8_t *buf = p ? dp__alloc(len ? len : 1) : NULL;
  if (!buf) {
    if (p) dp__free(p, sizeof *p);
    dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory for a frame sent by rendezvous");
    return DP_ENOMEM;
  }
  p->t = t;
  p->ep = ep;
  p->h = *h;
  p->buf = buf;
  p->len = len;
  ep->fpull = p;
  ucs_status_ptr_t r = pull(t, ep, data, buf, len, pull_cb, p);
  if (UCS_PTR_IS_PTR(r)) return 0;
  pull_done(p, UCS_PTR_STATUS(r)); /* done at once, or failed: no callback comes */
  return 0;
}

/* 2 when a rendezvous descriptor was kept for later (rx_wait): UCX must
 * then be told UCS_INPROGRESS. */
static int process(dp_transport_t *t, dp_endpoint_t *ep, unsigned id, const void *hdr, void *data, size_t len,
                   int rndv) {
  if (id == DP__AM_FRAME) return rndv ? pull_frame(t, ep, hdr, data, len) : on_frame(t, ep, hdr, data, len, NULL);
  if (id == DP__AM_SHM_PIECE) return on_bufs(t, ep, hdr, data, len, rndv, 1, ((const dp__am_shm_piece_t *)hdr)->slot);
  return on_bufs(t, ep, hdr, data, len, rndv, 0, 0);
}

/* A refused message's buffers are of no use: once its sender's next frame
 * is due, that frame does not wait for them (a peer whose header announced
 * buffers it never sends would hold every later value back). The message
 * is complete then (its receive fails, as it did or will), and its pieces
 * still to come are dropped as they arrive — rendezvous ones pulled into
 * scratch memory, so that the sender's send completes — until its header's
 * count of buffers and bytes has come. */
typedef struct absorb {
  struct absorb *next;
  uint64_t seq, nbuf;
  uint64_t bufs_left, bytes_left;
} absorb_t;

#define DP__MAX_ABSORB 1024 /* refused messages whose buffers are still owed */

void dp__tp_absorb_free(dp_endpoint_t *ep) {
  for (absorb_t *a = ep->absorb, *n; a; a = n) {
    n = a->next;
    dp__free(a, sizeof *a);
  }
  ep->absorb = NULL;
  ep->nabsorb = 0;
}

static absorb_t *absorbing(const dp_endpoint_t *ep, unsigned id, uint64_t seq) {
  if (id == DP__AM_FRAME) return NULL;
  for (absorb_t *a = ep->absorb; a; a = a->next)
    if (a->seq == seq) return a;
  return NULL;
}

static void drain_rndv(dp_transport_t *t, dp_endpoint_t *ep, void *data, size_t n);

/* A piece of a refused message passed by its next frame: dropped (a shared
 * slot given back). The caller releases eager data. */
static void absorb_piece(dp_transport_t *t, dp_endpoint_t *ep, absorb_t *a, unsigned id, const void *hdr, void *data,
                         size_t len, int rndv) {
  dp__am_bufs_hdr_t h;
  memcpy(&h, hdr, sizeof h);
  int shm = id == DP__AM_SHM_PIECE;
  uint64_t slot = shm ? ((const dp__am_shm_piece_t *)hdr)->slot : 0;
  int ok = h.count <= a->nbuf && h.first <= a->nbuf - h.count &&
           (shm ? !rndv && !len && ep->rshm && slot < DP__STAGE_SLOTS && h.total <= DP__STAGE_CHUNK : len == h.total);
  if (!ok) {
    if (rndv) dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a buffers message does not follow its frame's table");
    return;
  }
  if (shm) dp__tp_shm_done(ep, slot);
  else if (rndv) drain_rndv(t, ep, data, len);
  if (ep->dead) return; /* the drain failed it from inside UCX: a went with the endpoint's absorbs */
  a->bytes_left -= h.total < a->bytes_left ? h.total : a->bytes_left;
  uint64_t bufs = h.count > 1 ? h.count : h.offset + h.total == h.size;
  a->bufs_left -= bufs < a->bufs_left ? bufs : a->bufs_left;
  if (a->bufs_left || a->bytes_left) return;
  for (absorb_t **p = &ep->absorb; *p; p = &(*p)->next)
    if (*p == a) {
      *p = a->next;
      break;
    }
  ep->nabsorb--;
  dp__free(a, sizeof *a);
}

/* 1 when the current message is refused and still owed buffers. */
static int refused_owed(const dp_endpoint_t *ep) {
  return ep->cur && ep->cur->failed && ep->cur->next_index < ep->cur->nbuf;
}

/* The current message is refused and its sender's next frame is due: that
 * frame goes on without its buffers (absorb_t). */
static void pass_refused(dp_transport_t *t, dp_endpoint_t *ep) {
  rmsg_t *m = ep->cur;
  absorb_t *a = ep->nabsorb < DP__MAX_ABSORB ? dp__alloc(sizeof *a) : NULL;
  if (!a) {
    dp__tp_ep_failf(ep, ep->nabsorb < DP__MAX_ABSORB ? DP_ENOMEM : DP_ELIMIT, "%s",
                    ep->nabsorb < DP__MAX_ABSORB ? "out of memory passing a refused frame"
                                                 : "too many refused frames whose buffers never came");
    return;
  }
  a->seq = m->seq;
  a->nbuf = m->nbuf;
  a->bufs_left = m->nbuf - m->next_index;
  a->bytes_left = m->buf_bytes > m->got ? m->buf_bytes - m->got : 0;
  a->next = ep->absorb;
  ep->absorb = a;
  ep->nabsorb++;
  m->next_index = m->nbuf;
  m->next_off = 0;
  ep->cur = NULL;
  /* its pieces parked so far lead the inbox (the sender's order) */
  park_t *q = &ep->parked_pieces;
  while (q->n && !ep->dead && key_of(q->v[0]->id, q->v[0]->hdr).seq == m->seq) {
    inbox_t *b = q->v[0];
    park_take(ep, b);
    absorb_t *ab = absorbing(ep, b->id, m->seq);
    if (ab) {
      absorb_piece(t, ep, ab, b->id, b->hdr, b->data, b->len, b->rndv);
      inbox_done(ep, b);
    } else {
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a message repeats one already received");
      dp__tp_inbox_drop(ep, b);
    }
  }
  dp__tp_deliver(t, ep);
}

/* 1 when the frame of the next value is parked. */
static int next_frame_parked(const dp_endpoint_t *ep) {
  const park_t *f = &ep->parked_frames;
  return f->n && key_of(DP__AM_FRAME, f->v[0]->hdr).seq == ep->recv_seq;
}

/* Processes parked messages whose turn has come. */
void dp__tp_ep_pump_inbox(dp_transport_t *t, dp_endpoint_t *ep) {
  inbox_t *b;
  while (!ep->dead && (b = park_head(ep))) {
    key_t k = key_of(b->id, b->hdr);
    int c = key_cmp(k, expected(ep));
    absorb_t *a;
    if (c < 0 && (a = absorbing(ep, b->id, k.seq))) { /* a refused message's, passed */
      park_take(ep, b);
      absorb_piece(t, ep, a, b->id, b->hdr, b->data, b->len, b->rndv);
      inbox_done(ep, b);
      continue;
    }
    if (c < 0) { /* a repeat, parked while the one it repeats was being pulled */
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a message repeats one already received");
      return;
    }
    if (c > 0 && refused_owed(ep) && next_frame_parked(ep)) {
      pass_refused(t, ep);
      continue;
    }
    if (c > 0 || blocked(t, ep, b->id)) return;
    park_take(ep, b);
    process(t, ep, b->id, b->hdr, b->data, b->len, b->rndv);
    inbox_done(ep, b);
  }
}

#define DP__MAX_PARKED 1000000

/* What a buffers header must be whatever the table says (checked before a
 * message is parked, so that one that can never be next is refused now):
 * a pack starts at byte 0 of its first buffer; a single buffer's piece
 * starts at a chunk boundary inside it (or is the empty buffer) and ends
 * within it. */
static int bufs_hdr_ok(const void *hdr) {
  dp__am_bufs_hdr_t h;
  memcpy(&h, hdr, sizeof h);
  if (h.count == 0) return 0;
  if (h.count > 1) return !h.offset && !h.size;
  if (h.offset % DP__STAGE_CHUNK) return 0;
  if (!h.size) return !h.offset && !h.total;
  return h.offset < h.size && h.total <= h.size - h.offset;
}

static ucs_status_t am_any(dp_transport_t *t, dp_endpoint_t *ep, ucp_worker_h w, unsigned id, const void *hdr,
                           size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  size_t want = id == DP__AM_FRAME   ? sizeof(dp__am_frame_hdr_t)
                : id == DP__AM_BUFS ? sizeof(dp__am_bufs_hdr_t)
                                    : sizeof(dp__am_shm_piece_t);
  uint32_t magic = 0;
  if (hlen >= 4) memcpy(&magic, hdr, 4);
  if (hlen != want || magic != DP__WIRE_MAGIC || (id != DP__AM_FRAME && !bufs_hdr_ok(hdr))) {
    if (rndv) dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "malformed message header (not a devpickle peer?)");
    return UCS_OK;
  }
  uint64_t h[sizeof ((inbox_t *)0)->hdr / 8];
  memcpy(h, hdr, hlen); /* aligned */
  if (ep->peer_closed && key_of(id, h).seq >= ep->peer_sent) { /* its CLOSE counted the values it sent */
    if (rndv) dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a value beyond the count of the peer's close");
    return UCS_OK;
  }
  if (id == DP__AM_FRAME) { /* sent while the values before it were below the grant (internal.h, CREDIT) */
    /* Frames arrive out of order (a small one on the same-host lane
       overtakes a large one on the connection, and the other way round),
       so the check cannot be "the values arrived before this one": it is
       "the values arrived, less the latest in the sender's order", all of
       them before that one, which the sender posted below its grant. */
    const dp__am_frame_hdr_t *fh = (const dp__am_frame_hdr_t *)h;
    uint64_t charge, in;
    int top = fh->seq >= ep->credit_top;
    /* counted exactly: no sender's values reach 2^64 bytes, and a saturated
       count (a refused frame's header may claim any buf_bytes) made the
       taken count, and so the grant, 2^64 - 1: every later value passed;
       and as the sender and taken() count it, DP__CREDIT_PER_VALUE
       included (without it, a peer ignoring its credit sent 40-byte
       values up to the window's bytes, 7 times as many as it allows, and
       each value taken widened the grant by 256 bytes past what came) */
    if (dp__add_ovf(len, fh->buf_bytes, &charge) || dp__add_ovf(charge, DP__CREDIT_PER_VALUE, &charge) ||
        dp__add_ovf(ep->credit_in, charge, &in) ||
        in - (top ? charge : ep->credit_top_charge) >= ep->credit_granted) {
      if (rndv) dp__tp_rndv_release(t->worker, data);
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "values beyond the credit granted to the peer");
      return UCS_OK;
    }
    ep->credit_in = in;
    if (top) ep->credit_top = fh->seq == UINT64_MAX ? UINT64_MAX : fh->seq + 1, ep->credit_top_charge = charge;
    grant(t, ep); /* the first value: the whole window at once */
    if (ep->dead) { /* no memory for the grant */
      if (rndv) dp__tp_rndv_release(t->worker, data);
      return UCS_OK;
    }
  }
  key_t k = key_of(id, h);
  if (id == DP__AM_FRAME && k.seq == ep->recv_seq && refused_owed(ep)) {
    pass_refused(t, ep);
    if (ep->dead) {
      if (rndv) dp__tp_rndv_release(t->worker, data);
      return UCS_OK;
    }
  }
  int c = key_cmp(k, expected(ep));
  absorb_t *a;
  if (c < 0 && (a = absorbing(ep, id, k.seq))) {
    absorb_piece(t, ep, a, id, h, data, len, rndv);
    return UCS_OK;
  }
  if (c < 0) {
    if (rndv) dp__tp_rndv_release(t->worker, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a message repeats one already received");
    return UCS_OK;
  }
  if (c == 0 && !blocked(t, ep, id)) {
    int kept = process(t, ep, id, h, data, len, rndv) == 2;
    if (ep->nparked) dp__tp_ep_pump_inbox(t, ep);
    return kept ? UCS_INPROGRESS : UCS_OK;
  }
  /* not its turn: park it. Eager data is copied out of UCX, which keeps a
     message it is told to in a buffer of the message's size class (in
     1.13, 64 KiB for any over 1 KiB): the bytes parked are then the bytes
     held, and bounded (DP__PARKED_SLACK). */
  uint64_t cost = park_cost(rndv, len);
  int over = ep->nparked >= DP__MAX_PARKED || ep->parked_bytes + cost > t->max_parked;
  inbox_t *b = over ? NULL : dp__alloc(sizeof *b);
  void *copy = b && !rndv && len ? dp__alloc(len) : NULL;
  if (!b || (!rndv && len && !copy)) {
    if (b) dp__free(b, sizeof *b);
    if (rndv) dp__tp_rndv_release(t->worker, data);
    if (!over)
      dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory parking a message");
    else if (ep->nparked >= DP__MAX_PARKED)
      dp__tp_ep_failf(ep, DP_ELIMIT, "%s", "too many messages out of order or held back (1,000,000)");
    else {
      char what[160];
      snprintf(what, sizeof what, "%llu bytes (its credit window plus %llu MiB)",
               (unsigned long long)t->max_parked, (unsigned long long)(DP__PARKED_SLACK >> 20));
      dp__tp_ep_failf(ep, DP_ELIMIT, "messages out of order or held back would hold over %s", what);
    }
    return UCS_OK;
  }
  memset(b, 0, sizeof *b);
  b->id = id;
  memcpy(b->hdr, hdr, hlen);
  b->hlen = hlen;
  b->data = rndv ? data : copy; /* none: nothing to keep */
  if (copy) memcpy(copy, data, len);
  b->w = w;
  b->len = len;
  b->rndv = rndv;
  if (park_push(ep, b)) {
    dp__tp_inbox_drop(ep, b);
    dp__tp_ep_failf(ep, DP_ENOMEM, "%s", "out of memory parking a message");
    return UCS_OK;
  }
  return rndv ? UCS_INPROGRESS : UCS_OK;
}

/* A slot the peer gives back: its piece's send is done with it. */
static void on_done(dp_transport_t *t, dp_endpoint_t *ep, uint32_t i) {
  seg_t *g = ep->seg;
  if (!g || i >= DP__STAGE_SLOTS || !g->lent[i]) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a slot given back that was not lent");
    return;
  }
  piece_t *pc = g->lent[i];
  g->lent[i] = NULL;
  sop_t *s = pc->s;
  dp__tp_slot_put(t, NULL, pc->slot);
  dp__free(pc, sizeof *pc);
  dp__tp_sent(s, UCS_OK);
}

/* The lane's messages: the connector's offer (to the acceptor, on the
 * connection: the name of the file holding its lane worker's address, the
 * address's length in value, the file's token) and the acceptor's answer
 * (on the lane, or "no" on the connection). One offer an endpoint. */
static void on_lane(dp_transport_t *t, dp_endpoint_t *ep, unsigned id, const dp__am_shm_ctl_t *c, const void *data,
                    size_t len, const ucp_am_recv_param_t *param, int on_lane_worker) {
  if (id == DP__AM_LANE_ADDR && !on_lane_worker && ep->acceptor && !ep->lane_tried && data && len > 0 &&
      len < DP__SHM_NAME_MAX && !memchr(data, 0, len) && c->value > 0 && c->value <= DP__LANE_ADDR_MAX) {
    ep->lane_tried = 1;
    if (!t->lctx || !ep->peer_local) { /* no lanes here, or a peer of another host */
      dp__am_shm_ctl_t no = {DP__WIRE_MAGIC, 0, 0};
      dp__tp_ctl_queue(ep, DP__AM_LANE_HELLO, &no, sizeof no);
      return;
    }
    memcpy(ep->lane_name, data, len); /* read from the loop (dp__tp_lane_connect) */
    ep->lane_name[len] = 0;
    ep->lane_token = c->token;
    ep->lane_addr_len = c->value;
    return;
  }
  if (id == DP__AM_LANE_HELLO && !ep->acceptor && ep->lane == LANE_WAIT && !len &&
      c->value == (unsigned)on_lane_worker &&
      (!on_lane_worker || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))) {
    if (on_lane_worker) {
      ep->dep = param->reply_ep; /* UCX's endpoint answering the acceptor's */
      ep->lane = LANE_ON;
    } else {
      ep->lane = LANE_NONE;
      ep->lane_drop = 1;
    }
    dp__tp_lane_file_drop(ep);
    return;
  }
  dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a same-host lane message the protocol does not expect");
}

/* OFFER, REPLY, DONE, ACCEPT, CREDIT and the lane's: handled on arrival. */
static ucs_status_t am_ctl(dp_transport_t *t, dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen,
                           const void *data, size_t len, const ucp_am_recv_param_t *param, int on_lane_worker) {
  size_t want = id == DP__AM_SHM_OFFER ? sizeof(dp__am_shm_offer_t) : sizeof(dp__am_shm_ctl_t);
  uint64_t h[(sizeof(dp__am_shm_offer_t) + 7) / 8];
  uint32_t magic = 0;
  if (hlen == want) memcpy(h, hdr, hlen), memcpy(&magic, h, 4);
  /* a lane message's data (LANE_ADDR's name; none for LANE_HELLO) is on_lane's
     to judge: the wrong length is a use of it the protocol does not expect */
  int lane = id == DP__AM_LANE_ADDR || id == DP__AM_LANE_HELLO;
  if (hlen != want || magic != DP__WIRE_MAGIC || (len && !lane)) {
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "malformed message header (not a devpickle peer?)");
    return UCS_OK;
  }
  const dp__am_shm_ctl_t *c = (const dp__am_shm_ctl_t *)h;
  if (dp__transport_mute_offers && (id == DP__AM_LANE_ADDR || id == DP__AM_SHM_OFFER)) return UCS_OK;
  if (lane) {
    on_lane(t, ep, id, c, data, len, param, on_lane_worker);
  } else if (id == DP__AM_SHM_OFFER) {
    if (ep->peer_offered) dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a second offer of shared slots");
    else ep->peer_offered = ep->offer_pending = 1, memcpy(&ep->offer_in, h, sizeof ep->offer_in);
  } else if (id == DP__AM_SHM_REPLY) {
    if (ep->shm_state == SHM_NO && ep->offer_token && c->token == ep->offer_token) {
      ep->offer_token = 0; /* the answer to an offer withdrawn meanwhile */
    } else if (ep->shm_state != SHM_OFFERED || c->token != dp__shm_token(ep->seg->shm)) {
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a reply to no offer of shared slots");
    } else {
      ep->offer_token = 0;
      if (c->value != 1) {
        dp__tp_shm_withdraw(ep);
      } else {
        dp__shm_unlink(ep->seg->shm); /* mapped there: the name is done with */
        ep->shm_state = SHM_YES;
        atomic_fetch_add_explicit(&dp__transport_shm_accepted, 1, memory_order_relaxed);
      }
    }
  } else if (id == DP__AM_CREDIT) {
    if (c->value) dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a credit message the protocol does not expect");
    else if (c->token > ep->credit_limit) /* the loop's next pass posts what waited */
      ep->credit_limit = c->token, ep->credit_wait = 0; /* the peer took values: its clock restarts */
  } else if (id == DP__AM_CLOSE) {
    /* credit_top: the values arrived, those parked included */
    if (c->value != 0 || on_lane_worker || ep->peer_closed || c->token < ep->credit_top)
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a close message the protocol does not expect");
    else {
      ep->peer_closed = 1, ep->peer_sent = c->token; /* the loop's passes wait for its values */
      atomic_fetch_add_explicit(&dp__transport_closes_in, 1, memory_order_relaxed);
    }
  } else if (id == DP__AM_ACCEPT) {
    if (ep->acceptor || ep->accepted || on_lane_worker || c->value)
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "an accept message the protocol does not expect");
    ep->accepted = 1; /* and established, as by any message */
  } else {
    on_done(t, ep, c->value);
  }
  return UCS_OK;
}

/* Every active message: its id is the handler's (amh_t, one a message id).
 * On a lane's worker the endpoint is the handler's; on the transport's, the
 * one UCX names as the message's reply endpoint. */
static ucs_status_t am_cb(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param) {
  const amh_t *h = arg;
  dp_transport_t *t = h->t;
  dp_endpoint_t *ep = h->ep;
  ucp_worker_h w = ep ? ep->dw : t->worker;
  int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (!ep && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) ep = dp__tp_ep_find(t, param->reply_ep);
  if (!ep && h->id == DP__AM_CLOSE && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    /* the answer to a CLOSE of ours, or the peer's own CLOSE (both closed
       at once): the closing endpoint's UCX endpoint may go now (reap) */
    for (dp_endpoint_t *c = t->closing; c; c = c->next)
      if (c->ep == param->reply_ep && c->answer_deadline) c->answered = 1;
  }
  if (!ep || ep->dead) {
    /* from an endpoint failed or closed here (UCX still has it, as it
       names it): dropped */
    if (rndv) dp__tp_rndv_release(w, data);
    return UCS_OK;
  }
  if (h->ep) atomic_fetch_add(&dp__transport_lane_msgs, 1);
  if (h->id == AM_STRAY) { /* no message of the protocol: the peer is no devpickle peer, or a broken one */
    if (rndv) dp__tp_rndv_release(w, data);
    dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a message of an id the protocol does not use");
    return UCS_OK;
  }
  ep->established = 1;
  if (h->ep) {
    if (rndv) { /* never sent so: the lane carries small messages, eagerly */
      dp__tp_rndv_release(w, data);
      dp__tp_ep_failf(ep, DP_EFORMAT, "%s", "a rendezvous on the same-host lane");
      return UCS_OK;
    }
  }
  if (h->id == DP__AM_FRAME || h->id == DP__AM_BUFS || h->id == DP__AM_SHM_PIECE)
    return am_any(t, ep, w, h->id, hdr, hlen, data, len, param);
  if (rndv) dp__tp_rndv_release(w, data), data = NULL;
  return am_ctl(t, ep, h->id, hdr, hlen, data, len, param, h->ep != NULL);
}

ucs_status_t dp__tp_am_cb(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param) {
  void *outer = am_cb_rndv; /* a callback within a callback: UCX does not nest them, but were it to */
  am_cb_rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? data : NULL;
  ucs_status_t st = am_cb(arg, hdr, hlen, data, len, param);
  am_cb_rndv = outer;
  return st;
}
