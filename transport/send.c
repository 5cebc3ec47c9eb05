/* transport/send.c — sending a value: its frame, its buffers (direct, packed or staged). */
#include "tp.h"
#include "../pickler/frame.h"

/* ---- sending ---- */

/* Unlinks a completed send from its endpoint's `posted`: O(1) — sends
 * complete oldest first, at the far end from where they are pushed, and a
 * search cost each completion a step per send still posted (n^2 for a
 * burst of n rendezvous sends). */
_Atomic unsigned long dp__transport_posted_steps;

static void sop_complete(sop_t *s) {
  dp_endpoint_t *ep = s->ep;
  if (ep) {
    if (s->prev) s->prev->next = s->next;
    else ep->posted = s->next;
    if (s->next) s->next->prev = s->prev;
    else ep->posted_tail = s->prev;
    s->next = s->prev = NULL;
    atomic_fetch_add_explicit(&dp__transport_posted_steps, 1, memory_order_relaxed);
    ep->inflight -= s->cost;
    ep->nsends--;
  }
  if (!s->failed && s->done) dp_future_mark_completed(s->done, dp_none(), NULL);
  dp__tp_sop_free(s);
}

/* One of s's messages went (or failed): s completes with its last one,
 * once every buffer was posted. */
void dp__tp_sent(sop_t *s, ucs_status_t st) {
  if (st != UCS_OK && s->ep && !s->failed) dp__tp_ep_fail_status(s->ep, st);
  if (st == UCS_OK && s->ep) s->ep->established = 1;
  if (--s->outstanding == 0 && (s->posted || s->failed)) {
    if (s->ep || !s->failed) sop_complete(s);
    else dp__tp_sop_free(s);
  }
}

static void send_cb(void *req, ucs_status_t st, void *ud) {
  sop_t *s = ud;
  s->t->nreq--;
  ucp_request_free(req);
  dp__tp_sent(s, st);
}

/* A send slot of s's back to the pool (its endpoint's count, while s has one). */
static void tx_put(sop_t *s, slot_t *sl) {
  if (s->ep && !sl->seg) s->ep->tx_used--;
  dp__tp_slot_put(s->t, &s->t->tx, sl);
}

/* A staged piece went: its slot goes back to the send pool. */
static void piece_cb(void *req, ucs_status_t st, void *ud) {
  piece_t *pc = ud;
  sop_t *s = pc->s;
  s->t->nreq--;
  ucp_request_free(req);
  tx_put(s, pc->slot);
  dp__free(pc, sizeof *pc);
  dp__tp_sent(s, st);
}

/* Posts one active message of s (of piece pc, which it then owns, if not
 * NULL); counts it on s unless it completed at once. */
static int post_msg(sop_t *s, piece_t *pc, unsigned id, const void *hdr, size_t hlen, const void *data, size_t n,
                    uint32_t flags) {
  dp_endpoint_t *ep = s->ep;
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = pc ? piece_cb : send_cb;
  p.user_data = pc ? (void *)pc : (void *)s;
  p.flags = UCP_AM_SEND_FLAG_REPLY | flags;
  ucs_status_ptr_t r = dp__tp_am_send(ep, id, hdr, hlen, data, n, &p);
  if (atomic_load_explicit(&dp__transport_fail_in_post, memory_order_relaxed) > 0 &&
      atomic_fetch_sub(&dp__transport_fail_in_post, 1) == 1)
    dp__tp_ep_fail_status(ep, UCS_ERR_CONNECTION_RESET); /* the test hook (internal.h) */
  if (UCS_PTR_IS_PTR(r)) {
    s->outstanding++;
    ep->t->nreq++;
    return 0;
  }
  if (pc) {
    tx_put(s, pc->slot);
    dp__free(pc, sizeof *pc);
  }
  if (r == NULL) return 0;
  s->outstanding++; /* held across the failure: ep_fail must not free s under its poster */
  dp__tp_ep_fail_status(ep, UCS_PTR_STATUS(r));
  s->outstanding--;
  return DP_EIO;
}

/* Checks that every buffer can move and sizes the headers (at worst one a
 * buffer). */
int dp__tp_sop_plan(dp_transport_t *t, sop_t *s, dp_error_t *err) {
  size_t nb = dp_frame_nbuffers(s->frame);
  dp_buffer_desc_t d;
  for (size_t i = 0; i < nb; i++) {
    dp_frame_buffer(s->frame, i, &d, NULL);
    if (dp__tp_buf_mode(t, d.device) == MODE_REFUSED) return dp__tp_refused(t, d.device, i, err);
    if (dp__frame_buffer_not_local(s->frame, i))
      return dp__err(err, DP_EINVAL,
                     "transport: buffer %zu is a storage read from a frame (or one that carries host data): its "
                     "base is the writer's address, not this process's memory; send the frame itself "
                     "(dp_endpoint_send_frame), or read it with a bind callback that gives its buffers this "
                     "process's memory", i);
    /* a base the caller never set: the loop would read (or stage from)
       address 0 and bring the process down, far from the call */
    if (!d.base && d.nbytes)
      return dp__err(err, DP_EINVAL,
                     "transport: buffer %zu is a storage of %llu bytes at a NULL base: a buffer sent must be "
                     "readable memory of its nbytes", i, (unsigned long long)d.nbytes);
    s->buf_bytes += d.nbytes;
  }
  s->nbh = nb; /* the size of the three arrays, allocated or not */
  if (nb && !(s->bh = dp__alloc_array(nb, sizeof *s->bh))) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (nb && !(s->stage = dp__alloc_array(nb, sizeof *s->stage)))
    return dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (nb && !(s->stage_len = dp__alloc_array(nb, sizeof *s->stage_len)))
    return dp__err(err, DP_ENOMEM, "transport: out of memory");
  return 0;
}

/* dp_endpoint_send: one event a device of the staged buffers, on the
 * caller's current stream there, which the staging copies wait for. */
int dp__tp_sop_after(dp_transport_t *t, sop_t *s, dp_error_t *err) {
  size_t nb = dp_frame_nbuffers(s->frame), n = 0;
  uint8_t seen[(DP_DEVICE_INDEX_MAX + 1) / 8];
  dp_buffer_desc_t d;
  for (int round = 0; round < 2; round++) {
    memset(seen, 0, sizeof seen);
    for (size_t i = 0; i < nb; i++) {
      dp_frame_buffer(s->frame, i, &d, NULL);
      if (dp__tp_buf_mode(t, d.device) != MODE_STAGED || (seen[d.device.index / 8] & (1u << d.device.index % 8)))
        continue;
      seen[d.device.index / 8] |= (uint8_t)(1u << d.device.index % 8);
      if (!round) {
        n++;
        continue;
      }
      dp_stream_t *cs;
      dp_event_t **ev = &s->after[s->nafter++];
      int rc = dp_current_stream(t->backend, d.device, &cs, err);
      if (!rc) rc = dp_event_new(t->backend, d.device, ev, err);
      if (!rc) rc = dp_event_record(*ev, cs, err);
      if (rc) return rc;
    }
    if (!round && n && !(s->after = dp__alloc_array(n, sizeof *s->after)))
      return dp__err(err, DP_ENOMEM, "transport: out of memory");
    if (!round && n) {
      memset(s->after, 0, n * sizeof *s->after);
      s->after_cap = n;
    }
    if (!n) break;
  }
  return 0;
}

/* Posts the frame message. */
static int sop_start(dp_transport_t *t, sop_t *s) {
  dp_endpoint_t *ep = s->ep;
  s->deadline = dp__tp_deadline(t); /* set as it is posted: the oldest has the earliest (check_timeouts) */
  if (s->kind == SOP_RAW) {
    unsigned id = s->raw_id & ~(DP__RAW_RNDV | DP__RAW_SEQ);
    if (id == DP__AM_FRAME && s->raw_len_hdr == sizeof(dp__am_frame_hdr_t) && !(s->raw_id & DP__RAW_SEQ))
      ((dp__am_frame_hdr_t *)s->raw_hdr)->seq = ep->send_seq++;
    return post_msg(s, NULL, id, s->raw_hdr, s->raw_len_hdr, s->bytes, s->nbytes,
                    s->raw_id & DP__RAW_RNDV ? UCP_AM_SEND_FLAG_RNDV : 0);
  }
  const uint8_t *fb = s->bytes;
  size_t flen = s->nbytes;
  if (s->frame) fb = dp_frame_data(s->frame, &flen);
  s->seq = ep->send_seq++;
  s->fh.magic = DP__WIRE_MAGIC;
  s->fh.nbuffers = s->frame ? (uint32_t)dp_frame_nbuffers(s->frame) : 0;
  s->fh.seq = s->seq;
  s->fh.frame_len = flen;
  s->fh.buf_bytes = s->buf_bytes;
  ep->inflight += s->cost;
  ep->credit_sent += s->charge;
  /* cost > buf_bytes: the frame counts, so it goes by rendezvous (sop_measure) */
  return post_msg(s, NULL, DP__AM_FRAME, &s->fh, sizeof s->fh, fb, flen,
                  s->cost > s->buf_bytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER);
}

/* Sets what s counts against its endpoint's in-flight bound (cost: its
 * buffers, and its frame when that goes by rendezvous — over
 * DP__FRAME_EAGER_MAX, held by the sender until the receiver pulls it) and
 * what it takes of the peer's credit (charge: its frame and its buffers, as
 * its FRAME header gives them, and DP__CREDIT_PER_VALUE; internal.h, CREDIT). A raw message (tests)
 * counts for neither; its receiver counts what its header says. */
static void sop_measure(sop_t *s) {
  s->cost = s->charge = 0;
  if (s->kind == SOP_RAW) return;
  size_t flen = s->nbytes;
  if (s->frame) dp_frame_data(s->frame, &flen);
  s->cost = s->buf_bytes + (flen > DP__FRAME_EAGER_MAX ? flen : 0);
  s->charge = flen + s->buf_bytes + DP__CREDIT_PER_VALUE;
}


/* Posts the next direct message: one large buffer from its storage, or a
 * run of small direct buffers packed. */
static int post_direct(dp_transport_t *t, sop_t *s, size_t nb) {
  dp_buffer_desc_t d, e;
  size_t i = s->cur;
  dp_frame_buffer(s->frame, i, &d, NULL);
  dp__am_bufs_hdr_t *h = &s->bh[s->nh++];
  memset(h, 0, sizeof *h);
  h->magic = DP__WIRE_MAGIC;
  h->seq = s->seq;
  h->first = i;
  if (d.nbytes > DP__SMALL_BUFFER) {
    h->count = 1;
    h->total = h->size = d.nbytes;
    s->cur++;
    return post_msg(s, NULL, DP__AM_BUFS, h, sizeof *h, (const void *)(uintptr_t)d.base, (size_t)d.nbytes,
                    UCP_AM_SEND_FLAG_RNDV);
  }
  size_t j = i, total = 0;
  while (j < nb) {
    dp_frame_buffer(s->frame, j, &e, NULL);
    if (e.nbytes > DP__SMALL_BUFFER || dp__tp_buf_mode(t, e.device) != MODE_DIRECT ||
        (j > i && total + e.nbytes > DP__BATCH_BYTES))
      break;
    total += (size_t)e.nbytes;
    j++;
  }
  uint8_t *pk = total ? dp__alloc(total) : NULL;
  if (total && !pk) {
    dp__tp_ep_failf(s->ep, DP_ENOMEM, "%s", "out of memory packing buffers");
    return DP_ENOMEM;
  }
  size_t off = 0;
  for (size_t k = i; k < j; k++) {
    dp_frame_buffer(s->frame, k, &e, NULL);
    if (e.nbytes) memcpy(pk + off, (const void *)(uintptr_t)e.base, (size_t)e.nbytes);
    off += (size_t)e.nbytes;
  }
  s->stage[s->nstage] = pk;
  s->stage_len[s->nstage++] = total;
  h->count = (uint32_t)(j - i);
  h->total = total;
  if (j - i == 1) h->size = total; /* one buffer: the whole of it */
  s->cur = j;
  return post_msg(s, NULL, DP__AM_BUFS, h, sizeof *h, pk, total, 0);
}

/* Fails s's endpoint with e; the caller stops posting. */
static int sop_failed(sop_t *s, const dp_error_t *e) {
  if (s->ep) dp__tp_ep_fail(s->ep, e);
  return e->code ? e->code : DP_EIO;
}

/* Copies the next staged piece — a chunk of a large buffer, or a run of
 * small buffers of one device — into a send slot on the device's send
 * stream. 1 or 2: no slot free, the piece waits (sop_more says which). */
static int stage_next(dp_transport_t *t, sop_t *s, size_t nb) {
  dp_buffer_desc_t d, e;
  dp_error_t err;
  size_t i = s->cur, j = i + 1;
  dp_frame_buffer(s->frame, i, &d, NULL);
  uint64_t n;
  if (d.nbytes > DP__SMALL_BUFFER) {
    n = d.nbytes - s->cur_off < DP__STAGE_CHUNK ? d.nbytes - s->cur_off : DP__STAGE_CHUNK;
  } else {
    for (n = d.nbytes; j < nb; j++) {
      dp_frame_buffer(s->frame, j, &e, NULL);
      if (e.nbytes > DP__SMALL_BUFFER || e.device.type != d.device.type || e.device.index != d.device.index ||
          n + e.nbytes > DP__BATCH_BYTES)
        break;
      n += e.nbytes;
    }
  }
  slot_t *sl;
  dp_endpoint_t *ep = s->ep;
  if (ep->shm_state == SHM_NONE && t->shm_on && ep->peer_local) dp__tp_shm_offer(t, ep);
  int rc = 0;
  /* no slot free: one comes back as UCX completes a send or the peer gives
     one back (DONE), which wakes the loop: 2, nothing to poll — unless
     copies already queued wait for their events (1) */
  if (ep->shm_state == SHM_YES ? !ep->seg->free : ep->tx_used >= DP__STAGE_SLOTS) {
    atomic_fetch_add_explicit(&dp__transport_slot_waits, 1, memory_order_relaxed);
    return s->pq_head ? 1 : 2;
  }
  if (ep->shm_state == SHM_YES) {
    sl = ep->seg->free;
    ep->seg->free = sl->next;
    sl->next = NULL;
    ep->seg->refs++;
  } else {
    if ((rc = dp__tp_slot_get(t, &t->tx, (size_t)n, 0, &sl, &err))) return sop_failed(s, &err);
    ep->tx_used++;
  }
  dp_stream_t *st = NULL;
  rc = dp__tp_own_stream(t, t->sstreams, d.device, 0, &st, &err);
  for (size_t k = 0; !rc && !s->waited && !dp__transport_skip_events && k < s->nafter; k++) {
    dp_stream_t *ws;
    rc = dp__tp_own_stream(t, t->sstreams, dp_event_device(s->after[k]), 0, &ws, &err);
    if (!rc) rc = dp_stream_wait_event(ws, s->after[k], &err);
  }
  if (!rc) s->waited = 1;
  if (dp__transport_skip_events) s->waited = 1; /* the ordering test's negative control */
  if (!rc && d.nbytes > DP__SMALL_BUFFER) {
    rc = dp_memcpy_async(st, sl->p, (const uint8_t *)(uintptr_t)d.base + s->cur_off, (size_t)n, &err);
  } else {
    size_t off = 0;
    for (size_t k = i; !rc && k < j; k++) {
      dp_frame_buffer(s->frame, k, &e, NULL);
      rc = dp_memcpy_async(st, sl->p + off, (const void *)(uintptr_t)e.base, (size_t)e.nbytes, &err);
      off += (size_t)e.nbytes;
    }
  }
  if (!rc) rc = dp__tp_slot_mark(t, sl, st, &err);
  piece_t *pc = rc ? NULL : dp__alloc(sizeof *pc);
  if (!rc && !pc) rc = dp__err(&err, DP_ENOMEM, "transport: out of memory");
  if (rc) {
    if (st) dp_stream_synchronize(st, NULL); /* the copies queued read into the slot */
    tx_put(s, sl);
    return sop_failed(s, &err);
  }
  memset(pc, 0, sizeof *pc);
  pc->s = s;
  pc->slot = sl;
  pc->sh.b.magic = DP__WIRE_MAGIC;
  pc->sh.b.seq = s->seq;
  pc->sh.b.first = i;
  pc->sh.b.total = n;
  if (d.nbytes > DP__SMALL_BUFFER) {
    pc->sh.b.count = 1;
    pc->sh.b.offset = s->cur_off;
    pc->sh.b.size = d.nbytes;
    s->cur_off += n;
    if (s->cur_off == d.nbytes) s->cur++, s->cur_off = 0;
  } else {
    pc->sh.b.count = (uint32_t)(j - i);
    if (j - i == 1) pc->sh.b.size = d.nbytes;
    s->cur = j;
  }
  if (s->pq_tail) s->pq_tail->next = pc;
  else s->pq_head = pc;
  s->pq_tail = pc;
  s->outstanding++; /* the piece's, until it is posted */
  return 0;
}

/* Posts what can go now, in buffer order: staged pieces whose copies are
 * done, new copies while slots are free, direct buffers once every staged
 * piece before them went. 0: every buffer posted; 1: waiting for copies
 * (their events are polled); 2: waiting for a slot only (UCX's completion
 * of a send, or the peer's DONE, frees one and wakes the loop); <0: the
 * endpoint failed. */
static int sop_more(dp_transport_t *t, sop_t *s) {
  size_t nb = s->frame ? dp_frame_nbuffers(s->frame) : 0;
  dp_buffer_desc_t d;
  for (;;) {
    if (s->failed || !s->ep) return DP_EIO;
    while (s->pq_head) {
      piece_t *pc = s->pq_head;
      dp_error_t e;
      int q = dp_event_query(pc->slot->ev, &e);
      if (q == 0) break;
      if (q < 0) return sop_failed(s, &e);
      s->pq_head = pc->next;
      if (!s->pq_head) s->pq_tail = NULL;
      s->outstanding--; /* the request's now (the poster holds s) */
      int rc;
      if (pc->slot->seg) { /* announced; the peer gives the slot back (DONE) */
        pc->sh.slot = pc->slot->index;
        pc->slot->seg->lent[pc->slot->index] = pc;
        s->outstanding++; /* the piece keeps its hold until then */
        rc = post_msg(s, NULL, DP__AM_SHM_PIECE, &pc->sh, sizeof pc->sh, NULL, 0, UCP_AM_SEND_FLAG_EAGER);
      } else {
        rc = post_msg(s, pc, DP__AM_BUFS, &pc->sh.b, sizeof pc->sh.b, pc->slot->p, (size_t)pc->sh.b.total,
                      pc->sh.b.total > DP__SMALL_BUFFER ? UCP_AM_SEND_FLAG_RNDV : 0);
      }
      if (rc) return rc;
      /* UCX may report the connection's failure from inside the send: the
         endpoint failed then, let go of s (its pieces are orphans now) and
         nothing more of s may be posted or staged */
      if (s->failed || !s->ep) return DP_EIO;
    }
    if (s->cur == nb) return s->pq_head ? 1 : 0;
    dp_frame_buffer(s->frame, s->cur, &d, NULL);
    int rc;
    if (dp__tp_buf_mode(t, d.device) == MODE_STAGED) rc = stage_next(t, s, nb);
    else if (s->pq_head) return 1;
    else rc = post_direct(t, s, nb);
    if (rc) return rc;
  }
}

/* Starts (start) or resumes posting s. Returns 1 (copies to poll) or 2
 * (a slot to wait for) when s waits (it is the endpoint's `posting` then),
 * 0 when all of it is posted, <0 on failure. */
static int sop_go(dp_transport_t *t, sop_t *s, int start) {
  dp_endpoint_t *ep = s->ep;
  s->outstanding++; /* held while posting (see post_msg) */
  int rc = start ? sop_start(t, s) : 0;
  if (!rc) rc = sop_more(t, s);
  if (rc == 1 || rc == 2) {
    ep->posting = s;
    s->outstanding--;
    return rc;
  }
  if (ep->posting == s) ep->posting = NULL;
  if (!rc) s->posted = 1;
  if (--s->outstanding == 0) {
    if (!rc && s->ep) sop_complete(s);
    else if (!s->ep) dp__tp_sop_free(s); /* detached by the endpoint's failure */
  }
  return rc;
}

/* Moves sends from the queue to UCX while the in-flight bound and the
 * peer's credit allow.
 * Returns 1 when a send waits on its future or its copies (the loop must
 * keep polling). */
int dp__tp_ep_pump_sends(dp_transport_t *t, dp_endpoint_t *ep) {
  if (ep->posting && !ep->dead) {
    int rc = sop_go(t, ep->posting, 0);
    if (rc) return rc == 1;
  }
  while (ep->sq_head && !ep->dead) {
    sop_t *s = ep->sq_head;
    if (s->kind == SOP_FUTURE && !s->frame) {
      if (!dp_future_is_done(s->src)) return 0; /* its completion wakes the loop (s->note) */
      dp_error_t e;
      dp_error_clear(&e);
      if (dp_future_error(s->src, &e)) {
        dp__tp_sop_fail(s, &e);
      } else {
        if (!dp__transport_skip_events)
          for (size_t i = 0, n = dp_future_ndevices(s->src); i < n; i++)
            if (dp_event_query(dp_future_event(s->src, i), NULL) == 0) return 1;
        int rc = dp_frame_new(&s->frame, &e);
        if (!rc) rc = dp_pickle(dp_future_value(s->src), NULL, s->frame, &e);
        if (!rc) rc = dp__tp_sop_plan(t, s, &e);
        if (rc) dp__tp_sop_fail(s, &e);
      }
      if (s->failed) {
        ep->sq_head = s->next;
        if (!ep->sq_head) ep->sq_tail = NULL;
        ep->nsends--;
        dp__tp_sop_free(s);
        continue;
      }
    }
    sop_measure(s);
    if (ep->inflight && ep->inflight + s->cost > t->max_inflight) return 0;
    if (ep->credit_sent >= ep->credit_limit && !dp__transport_skip_credit) {
      if (!ep->credit_wait) ep->credit_wait = now_ns(); /* timed from now (check_timeouts) */
      return 0; /* the peer's credit is used: its CREDIT resumes the queue */
    }
    ep->credit_wait = 0;
    ep->sq_head = s->next;
    if (!ep->sq_head) ep->sq_tail = NULL;
    s->prev = NULL;
    s->next = ep->posted;
    if (ep->posted) ep->posted->prev = s;
    else ep->posted_tail = s;
    ep->posted = s;
    int rc = sop_go(t, s, 1);
    if (rc) return rc == 1;
  }
  return 0;
}
