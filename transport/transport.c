/* transport/transport.c — values over UCX active messages (transport.h).
 *
 * One progress thread owns the UCX worker (UCS_THREAD_MODE_SINGLE): every
 * UCX call and every change to an endpoint's send and receive state happens
 * there. API calls queue a command and wake the thread through an eventfd;
 * the few that must answer (listen, close) wait on the transport's
 * condition variable for it. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include "../core/internal.h"
#include "../cache/internal.h"
#include "../device/internal.h"
#include "devpickle/transport.h"
#include "internal.h"
#include "shm.h"

int dp__transport_skip_events;
int dp__transport_stage_host;
_Atomic unsigned long dp__transport_shm_pieces;
_Atomic unsigned long dp__transport_lane_msgs;

/* ---- objects ---- */

typedef struct sop sop_t;        /* one send */
typedef struct rmsg rmsg_t;      /* one message being received */
typedef struct inbox inbox_t;    /* an active message not yet processed */
typedef struct cmd cmd_t;
typedef struct slot slot_t;      /* a staging buffer */
typedef struct piece piece_t;    /* a staged message of a send */
typedef struct seg seg_t;        /* a sender's same-host segment of slots */
typedef struct ctl ctl_t;        /* a control message to send */
typedef struct rdone rdone_t;    /* a receiver's copy out of a peer's slot */

/* How a buffer moves (buf_mode). */
enum { MODE_REFUSED, MODE_DIRECT, MODE_STAGED };

struct slot {
  slot_t *next;
  uint8_t *p;
  size_t cap;
  dp_event_t *ev;           /* after the copies from or into it */
  int pooled;               /* DP__STAGE_CHUNK bytes, back to its pool; else freed */
  seg_t *seg;               /* a slot of a same-host segment (index) */
  unsigned index;
};

struct seg {
  dp__shm_t *shm;
  slot_t slots[DP__STAGE_SLOTS];
  slot_t *free;
  piece_t *lent[DP__STAGE_SLOTS]; /* announced, not yet given back */
  int refs;                 /* the endpoint's, and one a slot out of `free` */
};

struct ctl {
  ctl_t *next;
  dp_transport_t *t;        /* for the send's callback */
  unsigned id;
  size_t hlen;
  uint64_t hdr[(sizeof(dp__am_shm_offer_t) + 7) / 8];
  void *data;               /* LANE_ADDR: the address (owned) */
  size_t dlen;
};

struct rdone {
  rdone_t *next;
  dp_endpoint_t *ep;        /* NULL once it went */
  dp__shm_t *shm;           /* a reference */
  uint32_t slot;
  dp_event_t *ev;
};

enum { SHM_NONE, SHM_OFFERED, SHM_YES, SHM_NO };

/* A message id and its transport: the argument of UCX's handler for it;
 * on a lane's worker, also the endpoint (the lane's messages are its). */
#define AM_IDS 8
typedef struct amh {
  dp_transport_t *t;
  unsigned id;
  dp_endpoint_t *ep;
} amh_t;

/* A lane's state: none; the acceptor's address sent (WAIT); the connector's
 * endpoint made, its HELLO not yet gone (HELLO); in use (ON). */
enum { LANE_NONE, LANE_WAIT, LANE_HELLO, LANE_ON };

typedef struct pool {
  slot_t *free;
  unsigned made;            /* pooled slots in existence */
} pool_t;

struct piece {
  piece_t *next;
  sop_t *s;
  slot_t *slot;
  dp__am_shm_piece_t sh;    /* sh.b: the BUFS header */
};

enum { SOP_VALUE, SOP_FUTURE, SOP_FRAME, SOP_RAW };

struct sop {
  sop_t *next;
  dp_transport_t *t;
  dp_endpoint_t *ep;        /* NULL once the endpoint let go of it */
  int kind;
  dp_value_t value;         /* retained (SOP_VALUE, SOP_FUTURE once ready) */
  dp_future_t *src;         /* SOP_FUTURE */
  dp_future_t *done;
  dp_frame_t *frame;        /* SOP_VALUE / SOP_FUTURE */
  uint8_t *bytes;           /* SOP_FRAME / SOP_RAW: our copy */
  size_t nbytes, bytes_cap;
  uint8_t *raw_hdr;         /* SOP_RAW */
  size_t raw_hlen, raw_len_hdr;
  unsigned raw_id;
  uint64_t seq;
  uint64_t buf_bytes;       /* what counts against the in-flight bound */
  uint8_t **stage;          /* packed batches (owned) */
  size_t *stage_len;
  size_t nstage;
  dp__am_frame_hdr_t fh;    /* headers must live until their sends complete */
  dp__am_bufs_hdr_t *bh;
  size_t nbh;
  size_t outstanding;       /* UCX requests not yet complete */
  int posted;
  int failed;
  int64_t deadline;         /* CLOCK_MONOTONIC ns, 0: none */
  /* posting, resumed while staged pieces wait for slots and copies */
  size_t cur;               /* next buffer to post */
  uint64_t cur_off;         /* next byte of it (staged chunks) */
  size_t nh;                /* bh used */
  piece_t *pq_head, *pq_tail;  /* staged pieces copying, not yet posted, in order */
  dp_event_t **after;       /* dp_endpoint_send: the callers' streams, one event a device */
  size_t nafter, after_cap;
  int waited;               /* the send streams wait on `after` */
};

typedef struct rbuf {
  dp_storage_t *storage;    /* borrowed from the value */
  void *dst;
  uint64_t nbytes;
  dp_device_t dev;
  int bound;
  int staged;               /* dst is device memory: bytes go through a slot */
} rbuf_t;

struct rmsg {
  rmsg_t *next;
  uint64_t seq;
  uint32_t nbuf;
  uint64_t next_index;      /* next buffer index expected on the wire */
  uint64_t next_off;        /* and its next byte (chunked buffers) */
  uint64_t buf_bytes;
  rbuf_t *bufs;
  dp_value_t value;
  uint8_t *frame_copy;      /* for recv_frame */
  size_t frame_len;
  size_t pending;           /* rendezvous receives in flight */
  int failed;               /* the message is refused: its buffers are drained */
  dp_error_t error;
  int detached;             /* the endpoint let go; free when pending == 0 */
};

struct inbox {
  inbox_t *next, *prev;
  unsigned id;
  uint64_t hdr[(sizeof(dp__am_shm_piece_t) > sizeof(dp__am_frame_hdr_t) ? sizeof(dp__am_shm_piece_t)
                                                                           : sizeof(dp__am_frame_hdr_t)) / 8];
  size_t hlen;
  void *data;               /* a UCX data descriptor (persistent or rendezvous) */
  ucp_worker_h w;           /* the worker it came from (the lane's, or the transport's) */
  size_t len;
  int rndv;
};

typedef struct rwait {
  struct rwait *next;
  dp_future_t *f;
  int frame;                /* recv_frame */
} rwait_t;

struct dp_endpoint {
  dp_transport_t *t;
  dp_endpoint_t *next;      /* the transport's list */
  ucp_ep_h ep;
  char name[96];
  /* shared, under t->mu */
  int error;
  dp_error_t errinfo;
  /* the progress thread's */
  sop_t *sq_head, *sq_tail; /* sends, in order: unposted ones wait here */
  sop_t *posted;            /* posted and not complete */
  sop_t *posting;           /* on `posted`, its buffers not all posted yet */
  uint64_t send_seq;
  uint64_t inflight;
  size_t nsends;
  rmsg_t *rq_head, *rq_tail;/* messages being received, in order */
  rmsg_t *cur;              /* the one whose buffers arrive now */
  uint64_t recv_seq;
  uint64_t held;            /* received buffer bytes not yet taken */
  inbox_t *in_head, *in_tail;  /* parked messages, in the sender's order */
  size_t nparked;
  rwait_t *w_head, *w_tail;
  void *close_req;
  unsigned tx_used;         /* send slots its pieces hold */
  int shm_state;            /* SHM_*: this side's offer of a segment */
  seg_t *seg;               /* offered, then used (SHM_YES) */
  dp__shm_t *rshm;          /* the peer's segment, mapped */
  int peer_offered;         /* the peer made its offer (once) */
  int64_t offer_deadline;   /* SHM_OFFERED: withdrawn unanswered after it */
  uint64_t offer_token;     /* a late answer to a withdrawn offer is ignored */
  ctl_t *ctl_head, *ctl_tail;  /* control messages to send */
  dp_endpoint_t *acc_next;  /* a listener's queue of accepted endpoints */
  int dead;                 /* failed: UCX ep closed or closing */
  int need_close;           /* failed inside a UCX callback: close from the loop */
  int established;          /* the peer answered once */
  int acceptor;             /* accepted on a listener (else connected) */
  /* the same-host lane (internal.h): a worker of its own and an endpoint
     without error handling; the connection reports the peer's failure */
  int lane;                 /* LANE_*: WAIT, the acceptor's address sent, no answer yet */
  ucp_worker_h dw;
  int dw_fd;
  ucp_ep_h dep;             /* the connector's own; the acceptor's is UCX's reply endpoint */
  int64_t hello_deadline;   /* LANE_HELLO: given up after it */
  void *lane_addr;          /* the connector: the peer's lane address, to connect from the loop */
  size_t lane_addr_len;
  int lane_drop;            /* the acceptor: refused; its worker goes from the loop */
  amh_t lamh[AM_IDS];
};

struct dp_listener {
  dp_transport_t *t;
  dp_listener_t *next;
  ucp_listener_h l;
  int port;
  dp_endpoint_t *acc_head, *acc_tail; /* under t->mu */
  int closed;
};

enum { CMD_LISTEN, CMD_UNLISTEN, CMD_CONNECT, CMD_SEND, CMD_RECV, CMD_CLOSE, CMD_STOP };

struct cmd {
  cmd_t *next;
  int type;
  dp_endpoint_t *ep;
  dp_listener_t *lst;
  sop_t *sop;
  rwait_t *rw;
  struct sockaddr_storage addr;
  socklen_t addrlen;
  int done, rc;
  dp_error_t err;
};

struct dp_transport {
  ucp_context_h ctx;
  ucp_worker_h worker;
  pthread_t thread;
  int wake_fd, worker_fd;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  cmd_t *c_head, *c_tail;
  dp_endpoint_t *eps;           /* the progress thread's */
  dp_endpoint_t *closing;       /* closing: freed once UCX let go */
  dp_listener_t *lsts;
  dp_endpoint_t *last_ep;       /* reply_ep cache */
  uint64_t max_inflight;
  int64_t timeout_ns;
  dp_unpickle_opts_t uopts;
  dp_resolver_t resolver;
  dp_backend_t *backend;        /* whose devices' memory moves besides cpu */
  dp_cache_t *cache;            /* on backend */
  dp_stream_t *streams[DP_DEVICE_INDEX_MAX + 1];   /* receive streams */
  dp_stream_t *sstreams[DP_DEVICE_INDEX_MAX + 1];  /* send streams (staging copies) */
  pool_t tx, rx;                /* staging slots */
  slot_t *rx_busy;              /* received slots whose copies run */
  struct rctx *rx_wait_head, *rx_wait_tail;  /* rendezvous pieces waiting for a receive slot */
  rdone_t *rdone;               /* copies out of peers' slots */
  int shm_on;                   /* offer same-host slots (DEVPICKLE_TRANSPORT_SHM) */
  amh_t amh[AM_IDS];            /* the active-message handlers' arguments */
  ucp_context_h lctx;           /* same-host lanes' (shared memory only); NULL: no lanes */
  struct pollfd *pfd;           /* the loop's descriptors while it sleeps */
  size_t pfd_cap;
  piece_t *orphans;             /* pieces of failed sends whose copies run */
  size_t nreq;                  /* UCX requests not yet complete: the worker outlives them */
  int stop;
  int sleeping;                 /* under mu: the thread sleeps in poll; commands must wake it */
  int64_t last_check;           /* timeouts last checked */
  unsigned yield_every;         /* idle passes between yields: 1 where cores are few */
  _Atomic int queued;           /* commands may be queued (set under mu; read without) */
  int caller;                   /* DP_TRANSPORT_PROGRESS_CALLER: no thread; passes under pmu */
  pthread_mutex_t pmu;
};

/* ---- small things ---- */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void wake(dp_transport_t *t) {
  uint64_t one = 1;
  ssize_t w = write(t->wake_fd, &one, sizeof one);
  (void)w;
}

static int new_future(dp_transport_t *t, dp_future_t **out, dp_error_t *err) {
  dp_future_opts_t o = {0};
  o.backend = t->backend;
  dp_cache_hooks_t hooks = dp_cache_hooks(t->cache);
  o.hooks = &hooks;
  return dp_future_new(&o, out, err);
}

static int caller_pass(dp_transport_t *t);
static void caller_commands(dp_transport_t *t);
static int drain_cmds(dp_transport_t *t);
/* The transport whose pass this thread runs (caller-driven progress). */
static _Thread_local dp_transport_t *tl_pass;

/* Runs c on the progress thread; with wait, blocks until it was handled.
 * Caller-driven: a pass runs it at once (a wait inside this thread's own
 * pass handles the queue there and then). */
static int submit(dp_transport_t *t, cmd_t *c, int wait_done) {
  pthread_mutex_lock(&t->mu);
  c->next = NULL;
  if (t->c_tail) t->c_tail->next = c;
  else t->c_head = c;
  t->c_tail = c;
  atomic_store_explicit(&t->queued, 1, memory_order_release);
  int asleep = t->sleeping; /* a thread still spinning sees the queue itself */
  pthread_mutex_unlock(&t->mu);
  if (asleep) wake(t);
  if (t->caller) {
    if (tl_pass == t) {
      if (wait_done) drain_cmds(t);
    } else if (!wait_done) {
      caller_commands(t); /* a send is posted now; the workers wait for the next pass */
    } else {
      do caller_pass(t);
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

static void cmd_finish(dp_transport_t *t, cmd_t *c, int rc) {
  pthread_mutex_lock(&t->mu);
  c->rc = rc;
  c->done = 1;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

/* "HOST:PORT" (the last colon splits; [v6] brackets allowed). */
static int parse_addr(const char *hp, int passive, struct sockaddr_storage *ss, socklen_t *len, dp_error_t *err) {
  if (!hp) return dp__err(err, DP_EINVAL, "transport: NULL address");
  const char *colon = strrchr(hp, ':');
  if (!colon || colon == hp || !colon[1] || strlen(colon + 1) > 5)
    return dp__err(err, DP_EINVAL, "transport: address '%.200s' is not HOST:PORT", hp);
  for (const char *p = colon + 1; *p; p++)
    if (*p < '0' || *p > '9') return dp__err(err, DP_EINVAL, "transport: port in '%.200s' is not a number", hp);
  long port = strtol(colon + 1, NULL, 10);
  if (port > 65535) return dp__err(err, DP_EINVAL, "transport: port %ld out of range", port);
  char host[256];
  size_t hl = (size_t)(colon - hp);
  if (hl >= 2 && hp[0] == '[' && hp[hl - 1] == ']') hp++, hl -= 2;
  if (hl >= sizeof host) return dp__err(err, DP_EINVAL, "transport: host name too long");
  memcpy(host, hp, hl);
  host[hl] = 0;
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  int g = getaddrinfo(host, colon + 1, &hints, &res);
  if (g != 0 || !res)
    return dp__err(err, DP_EINVAL, "transport: cannot resolve '%s': %s", host, gai_strerror(g));
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = (socklen_t)res->ai_addrlen;
  freeaddrinfo(res);
  return 0;
}

/* ---- where buffers go ---- */

/* cpu memory is read and written where it is; memory of the transport's
 * backend is too when the host can address it (host:N), else it is staged
 * (cuda); any other device is refused. */
static int buf_mode(const dp_transport_t *t, dp_device_t dev) {
  if (dev.type == DP_DEVICE_CPU) return MODE_DIRECT;
  if (dev.type != (uint8_t)dp_backend_type(t->backend)) return MODE_REFUSED;
  return dev.type == DP_DEVICE_HOST && !dp__transport_stage_host ? MODE_DIRECT : MODE_STAGED;
}

static int refused(const dp_transport_t *t, dp_device_t dev, uint64_t i, dp_error_t *err) {
  char d[16];
  return dp__err(err, DP_ENODEV,
                 "transport: buffer %llu is on %s: this transport moves cpu and %s memory "
                 "(dp_transport_opts_t.backend)",
                 (unsigned long long)i, dp_device_format(dev, d, sizeof d), dp_backend_name(t->backend));
}

static void cpu_release(void *ud, dp_device_t dev, void *base, size_t n) {
  (void)ud, (void)dev;
  if (base) dp__free(base, n);
}

static int cpu_alloc(dp_device_t dev, uint64_t n, dp_storage_t **out, void **dst, dp_error_t *err) {
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
static int own_stream(dp_transport_t *t, dp_stream_t **tab, dp_device_t dev, int current, dp_stream_t **out,
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
static int dev_alloc(dp_transport_t *t, dp_device_t dev, uint64_t n, dp_storage_t **out, void **dst,
                     dp_error_t *err) {
  dp_stream_t *s;
  void *p = NULL;
  int rc = own_stream(t, t->streams, dev, 1, &s, err);
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

/* A slot for n <= DP__STAGE_CHUNK bytes, or NULL when the caller must
 * wait for one. Sending: each endpoint holds at most DP__STAGE_SLOTS (so a
 * slow peer holds back its own sends only); the pool keeps every slot made.
 * Receiving: at most 2 * DP__STAGE_SLOTS page-locked slots (one for each
 * piece a sender has on the wire, and more while their copies run);
 * beyond that a rendezvous piece waits (rx_wait) and an eager one, already
 * here and small, takes a slot of ordinary memory made for it (heap). */
static int slot_get(dp_transport_t *t, pool_t *pool, size_t n, int heap_ok, slot_t **out, dp_error_t *err) {
  *out = NULL;
  if (pool->free) {
    *out = pool->free;
    pool->free = (*out)->next;
    (*out)->next = NULL;
    return 0;
  }
  int pooled = pool == &t->tx || pool->made < 2 * DP__STAGE_SLOTS;
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

static void slot_destroy(dp_transport_t *t, slot_t *sl) {
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
static void slot_put(dp_transport_t *t, pool_t *pool, slot_t *sl) {
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
    slot_destroy(t, sl);
    return;
  }
  sl->next = pool->free;
  pool->free = sl;
}

/* Marks the copies queued on s so far with the slot's event. */
static int slot_mark(dp_transport_t *t, slot_t *sl, dp_stream_t *s, dp_error_t *err) {
  int rc = sl->ev ? 0 : dp_event_new(t->backend, dp_stream_device(s), &sl->ev, err);
  return rc ? rc : dp_event_record(sl->ev, s, err);
}

/* ---- same-host slots: control messages ---- */

static void sop_free(sop_t *s);

static void ep_failf(dp_endpoint_t *ep, int code, const char *fmt, const char *detail);
static void lane_close(dp_endpoint_t *ep);

static void ctl_free(ctl_t *c) {
  if (c->data) dp__free(c->data, c->dlen);
  dp__free(c, sizeof *c);
}

/* Queues a control message (its header, and data copied when n > 0); the
 * loop sends it (never from a UCX callback). */
static void ctl_queue_data(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                           size_t n) {
  ctl_t *c = dp__alloc(sizeof *c);
  if (c) {
    memset(c, 0, sizeof *c);
    c->data = n ? dp__alloc(n) : NULL;
    if (n && !c->data) dp__free(c, sizeof *c), c = NULL;
  }
  if (!c) {
    ep_failf(ep, DP_ENOMEM, "%s", "out of memory for a control message");
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

static void ctl_queue(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen) {
  ctl_queue_data(ep, id, hdr, hlen, NULL, 0);
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
static ucs_status_ptr_t lane_send(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                                  size_t n, const ucp_request_param_t *p) {
  ucp_request_param_t q = *p;
  q.op_attr_mask |= UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL;
  q.flags |= UCP_AM_SEND_FLAG_EAGER;
  return ucp_am_send_nbx(ep->dep, id, hdr, hlen, data, n, &q);
}

/* Sends one active message: on the same-host lane when there is one, the
 * message is small and the lane takes it at once; else on the connection
 * (the receiver orders both by sequence). */
static ucs_status_ptr_t am_send(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                                size_t n, const ucp_request_param_t *p) {
  if (ep->lane == LANE_ON && hlen + n <= DP__LANE_MAX && !(p->flags & UCP_AM_SEND_FLAG_RNDV)) {
    ucs_status_ptr_t r = lane_send(ep, id, hdr, hlen, data, n, p);
    if (!UCS_PTR_IS_ERR(r)) return r;
  }
  return ucp_am_send_nbx(ep->ep, id, hdr, hlen, data, n, p);
}

static void ep_fail_status(dp_endpoint_t *ep, ucs_status_t st);

static void ctl_flush(dp_transport_t *t, dp_endpoint_t *ep) {
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
    ucs_status_ptr_t r = am_send(ep, c->id, c->hdr, c->hlen, c->data, c->dlen, &p);
    if (UCS_PTR_IS_PTR(r)) {
      t->nreq++;
      continue;
    }
    ctl_free(c);
    if (r != NULL) ep_fail_status(ep, UCS_PTR_STATUS(r));
  }
}

#define DP__OFFER_NS 2000000000ll

/* The sender's offer: a segment of slots and its name. A segment that
 * cannot be made (no /dev/shm) leaves the endpoint on the UCX path. */
static void shm_offer(dp_transport_t *t, dp_endpoint_t *ep) {
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
  ctl_queue(ep, DP__AM_SHM_OFFER, &o, sizeof o);
}

/* An offer refused, or unanswered in time (a peer stopped, or one that does
 * not know it), is withdrawn: its name would outlive this process if it
 * were killed. */
static void shm_withdraw(dp_endpoint_t *ep) {
  dp__shm_unlink(ep->seg->shm);
  seg_unref(ep->seg); /* no slot of it was used yet */
  ep->seg = NULL;
  ep->shm_state = SHM_NO;
}

/* An endpoint that fails or closes lets go of its segments: pieces the
 * peer still holds are dropped with their slots (the peer may still read
 * them: they are never reused), and copies out of the peer's slots finish
 * without it. */
static void ep_drop_shm(dp_transport_t *t, dp_endpoint_t *ep) {
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
      if (--s->outstanding == 0) sop_free(s);
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

/* ---- endpoint failure ---- */

static void sop_free(sop_t *s) {
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

static void sop_fail(sop_t *s, const dp_error_t *e) {
  if (!s->failed && s->done) dp_future_set_error(s->done, e, NULL);
  s->failed = 1;
}

static void rmsg_free(rmsg_t *m) {
  dp_value_release(m->value);
  if (m->bufs) dp__free(m->bufs, m->nbuf * sizeof *m->bufs);
  if (m->frame_copy) dp__free(m->frame_copy, m->frame_len ? m->frame_len : 1);
  dp__free(m, sizeof *m);
}

/* A parked message that will not be processed: its endpoint failed or
 * closes. (Rendezvous data is released unread: a receive posted on an
 * endpoint being closed outlives it in UCX 1.13, which then asserts when the
 * worker goes; UCX's descriptor is reclaimed with the worker.) */
static void inbox_drop(dp_transport_t *t, inbox_t *b) {
  (void)t;
  if (b->data) ucp_am_data_release(b->w, b->data);
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

/* The endpoint fails: every pending future fails with e, what was received
 * and not taken is freed, the UCX endpoint is closed (force). Requests UCX
 * still holds finish through their callbacks, which find their send or
 * message detached and free it. */
static void ep_fail(dp_endpoint_t *ep, const dp_error_t *e) {
  dp_transport_t *t = ep->t;
  ep_set_error(ep, e);
  dp_error_t ee;
  pthread_mutex_lock(&t->mu);
  ee = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  for (sop_t *s = ep->sq_head, *n; s; s = n) {
    n = s->next;
    sop_fail(s, &ee);
    sop_free(s);
  }
  ep->sq_head = ep->sq_tail = NULL;
  for (sop_t *s = ep->posted, *n; s; s = n) {
    n = s->next;
    sop_fail(s, &ee);
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
    if (!s->outstanding) sop_free(s);
  }
  ep->posted = ep->posting = NULL;
  ep->tx_used = 0; /* its pieces' slots come back without it */
  ep_drop_shm(t, ep);
  for (rmsg_t *m = ep->rq_head, *n; m; m = n) {
    n = m->next;
    m->detached = 1;
    if (!m->pending) rmsg_free(m);
  }
  ep->rq_head = ep->rq_tail = ep->cur = NULL;
  for (rwait_t *w = ep->w_head, *n; w; w = n) {
    n = w->next;
    dp_future_set_error(w->f, &ee, NULL);
    dp_future_release(w->f);
    dp__free(w, sizeof *w);
  }
  ep->w_head = ep->w_tail = NULL;
  for (inbox_t *b = ep->in_head, *n; b; b = n) {
    n = b->next;
    inbox_drop(t, b);
  }
  ep->in_head = ep->in_tail = NULL;
  ep->nparked = 0;
  ep->held = ep->inflight = 0;
  /* UCX is not re-entered from its own callbacks: the loop closes it */
  if (ep->ep && !ep->dead) ep->need_close = 1;
  lane_close(ep);
  ep->dead = 1;
}

static void ep_force_close(dp_endpoint_t *ep) {
  ep->need_close = 0;
  lane_close(ep);
  if (!ep->ep) return;
  ucp_request_param_t p = {0};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  void *r = ucp_ep_close_nbx(ep->ep, &p);
  if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
}

static void ep_failf(dp_endpoint_t *ep, int code, const char *fmt, const char *detail) {
  dp_error_t e;
  dp_error_clear(&e);
  char what[512];
  snprintf(what, sizeof what, fmt, detail);
  dp__err(&e, code, "transport: %s: %s", ep->name, what);
  ep_fail(ep, &e);
}

/* A UCX failure of the connection: refused while the peer never answered,
 * lost afterwards. */
static void ep_fail_status(dp_endpoint_t *ep, ucs_status_t st) {
  if (ep->dead) return;
  const char *fmt = ep->established ? "connection lost (%s)" : "connection refused or lost before any reply (%s)";
  ep_failf(ep, st == UCS_ERR_ENDPOINT_TIMEOUT ? DP_ETIMEDOUT : DP_EIO, fmt, ucs_status_string(st));
}

static void ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t st) {
  (void)uep;
  ep_fail_status(arg, st);
}

/* ---- endpoints ---- */

static int ep_alloc(dp_transport_t *t, const char *name, dp_endpoint_t **out, dp_error_t *err) {
  dp_endpoint_t *ep = dp__alloc(sizeof *ep);
  if (!ep) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  memset(ep, 0, sizeof *ep);
  ep->t = t;
  snprintf(ep->name, sizeof ep->name, "%s", name);
  dp_error_clear(&ep->errinfo);
  *out = ep;
  return 0;
}

/* The list changes on the progress thread only, under mu, so that
 * dp_transport_free may read it. */
static void ep_link(dp_transport_t *t, dp_endpoint_t *ep) {
  pthread_mutex_lock(&t->mu);
  ep->next = t->eps;
  t->eps = ep;
  pthread_mutex_unlock(&t->mu);
}

static void ep_unlink(dp_transport_t *t, dp_endpoint_t *ep) {
  pthread_mutex_lock(&t->mu);
  for (dp_endpoint_t **p = &t->eps; *p; p = &(*p)->next)
    if (*p == ep) {
      *p = ep->next;
      break;
    }
  pthread_mutex_unlock(&t->mu);
  if (t->last_ep == ep) t->last_ep = NULL;
}

static dp_endpoint_t *ep_find(dp_transport_t *t, ucp_ep_h uep) {
  if (t->last_ep && t->last_ep->ep == uep && !t->last_ep->dead) return t->last_ep;
  for (dp_endpoint_t *e = t->eps; e; e = e->next)
    if (e->ep == uep && !e->dead) return t->last_ep = e;
  return NULL;
}

/* ---- the same-host lane (internal.h) ---- */

static const unsigned am_ids[AM_IDS] = {DP__AM_FRAME,     DP__AM_BUFS,      DP__AM_SHM_PIECE, DP__AM_SHM_OFFER,
                                        DP__AM_SHM_REPLY, DP__AM_SHM_DONE,  DP__AM_LANE_ADDR, DP__AM_LANE_HELLO};

static ucs_status_t am_cb(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param);

/* Sets every message's handler on w; amh[i] is its argument. */
static ucs_status_t set_handlers(ucp_worker_h w, amh_t *amh, dp_transport_t *t, dp_endpoint_t *ep) {
  ucp_am_handler_param_t hp;
  memset(&hp, 0, sizeof hp);
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  hp.cb = am_cb;
  ucs_status_t st = UCS_OK;
  for (size_t i = 0; i < AM_IDS && st == UCS_OK; i++) {
    amh[i] = (amh_t){t, am_ids[i], ep};
    hp.id = am_ids[i];
    hp.arg = &amh[i];
    st = ucp_worker_set_am_recv_handler(w, &hp);
  }
  return st;
}

static ucs_status_t new_worker(ucp_context_h ctx, ucp_worker_h *w, int *fd) {
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
  if (new_worker(t->lctx, &ep->dw, &ep->dw_fd) != UCS_OK) return -1;
  if (set_handlers(ep->dw, ep->lamh, t, ep) == UCS_OK) return 0;
  ucp_worker_destroy(ep->dw);
  ep->dw = NULL;
  return -1;
}

/* The acceptor's side: its lane worker's address goes to the connector.
 * Without one (no lanes here, or UCX refused) nothing is sent, and the
 * endpoint stays on its connection. */
static void lane_offer(dp_transport_t *t, dp_endpoint_t *ep) {
  if (!t->lctx || lane_worker(t, ep)) return;
  ucp_address_t *a = NULL;
  size_t n = 0;
  if (ucp_worker_get_address(ep->dw, &a, &n) != UCS_OK || n > DP__LANE_ADDR_MAX) {
    if (a) ucp_worker_release_address(ep->dw, a);
    ucp_worker_destroy(ep->dw);
    ep->dw = NULL;
    return;
  }
  dp__am_shm_ctl_t h = {DP__WIRE_MAGIC, (uint32_t)n, 0};
  ctl_queue_data(ep, DP__AM_LANE_ADDR, &h, sizeof h, a, n);
  ucp_worker_release_address(ep->dw, a);
  ep->lane = LANE_WAIT;
}

/* The connector's side, from the loop: an endpoint to the acceptor's lane
 * worker (UCX refuses one to another host), and the answer: HELLO 1 on
 * the lane, else HELLO 0 on the connection. */
static void lane_connect(dp_transport_t *t, dp_endpoint_t *ep) {
  void *a = ep->lane_addr;
  ep->lane_addr = NULL;
  int ok = lane_worker(t, ep) == 0;
  if (ok) {
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = a;
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE; /* shared memory has no other in UCX 1.13 */
    if (ucp_ep_create(ep->dw, &p, &ep->dep) != UCS_OK) {
      ep->dep = NULL;
      ucp_worker_destroy(ep->dw);
      ep->dw = NULL;
      ok = 0;
    }
  }
  dp__free(a, ep->lane_addr_len);
  if (ok) {
    ep->lane = LANE_HELLO; /* lane_hello sends it */
    ep->hello_deadline = now_ns() + DP__HELLO_NS;
    return;
  }
  dp__am_shm_ctl_t h = {DP__WIRE_MAGIC, 0, 0};
  ctl_queue(ep, DP__AM_LANE_HELLO, &h, sizeof h);
}

/* The connector's HELLO opens the lane: sent on it once UCX has wired it
 * (tried every pass). A lane not wired in DP__HELLO_NS is given up: HELLO 0
 * on the connection. */
static void lane_hello(dp_endpoint_t *ep) {
  dp__am_shm_ctl_t h = {DP__WIRE_MAGIC, 1, 0};
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  if (!UCS_PTR_IS_ERR(lane_send(ep, DP__AM_LANE_HELLO, &h, sizeof h, NULL, 0, &p))) {
    ep->lane = LANE_ON;
    return;
  }
  if (now_ns() < ep->hello_deadline) return;
  lane_close(ep);
  h.value = 0;
  ctl_queue(ep, DP__AM_LANE_HELLO, &h, sizeof h);
}

/* The lane is no longer used. Its endpoint is not closed (UCX 1.13 cannot
 * close one without error handling by force, nor flush one to a dead
 * peer): it goes with the lane's worker when the endpoint is freed, and
 * holds no request meanwhile (lane_send). */
static void lane_close(dp_endpoint_t *ep) {
  ep->lane = LANE_NONE;
  ep->dep = NULL;
}

/* An endpoint's memory, once UCX let go of it. */
static void ep_free_mem(dp_endpoint_t *ep) {
  if (ep->lane_addr) dp__free(ep->lane_addr, ep->lane_addr_len);
  if (ep->dw) ucp_worker_destroy(ep->dw);
  dp__free(ep, sizeof *ep);
}

static void on_conn(ucp_conn_request_h req, void *arg) {
  dp_listener_t *l = arg;
  dp_transport_t *t = l->t;
  dp_endpoint_t *ep;
  char name[96];
  snprintf(name, sizeof name, "endpoint accepted on port %d", l->port);
  if (l->closed || ep_alloc(t, name, &ep, NULL)) {
    ucp_listener_reject(l->l, req);
    return;
  }
  ucp_ep_params_t p;
  memset(&p, 0, sizeof p);
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = req;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = ep_err_cb;
  p.err_handler.arg = ep;
  if (ucp_ep_create(t->worker, &p, &ep->ep) != UCS_OK) {
    dp__free(ep, sizeof *ep);
    return;
  }
  ep->established = 1; /* the peer asked for it */
  ep->acceptor = 1;
  lane_offer(t, ep);
  ep_link(t, ep);
  pthread_mutex_lock(&t->mu);
  if (l->acc_tail) l->acc_tail->acc_next = ep;
  else l->acc_head = ep;
  l->acc_tail = ep;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

/* ---- sending ---- */

static void sop_complete(sop_t *s) {
  dp_endpoint_t *ep = s->ep;
  if (ep) {
    for (sop_t **p = &ep->posted; *p; p = &(*p)->next)
      if (*p == s) {
        *p = s->next;
        break;
      }
    ep->inflight -= s->buf_bytes;
    ep->nsends--;
  }
  if (!s->failed && s->done) dp_future_mark_completed(s->done, dp_none(), NULL);
  sop_free(s);
}

/* One of s's messages went (or failed): s completes with its last one,
 * once every buffer was posted. */
static void sent(sop_t *s, ucs_status_t st) {
  if (st != UCS_OK && s->ep && !s->failed) ep_fail_status(s->ep, st);
  if (st == UCS_OK && s->ep) s->ep->established = 1;
  if (--s->outstanding == 0 && (s->posted || s->failed)) {
    if (s->ep || !s->failed) sop_complete(s);
    else sop_free(s);
  }
}

static void send_cb(void *req, ucs_status_t st, void *ud) {
  sop_t *s = ud;
  s->t->nreq--;
  ucp_request_free(req);
  sent(s, st);
}

/* A send slot of s's back to the pool (its endpoint's count, while s has one). */
static void tx_put(sop_t *s, slot_t *sl) {
  if (s->ep && !sl->seg) s->ep->tx_used--;
  slot_put(s->t, &s->t->tx, sl);
}

/* A staged piece went: its slot goes back to the send pool. */
static void piece_cb(void *req, ucs_status_t st, void *ud) {
  piece_t *pc = ud;
  sop_t *s = pc->s;
  s->t->nreq--;
  ucp_request_free(req);
  tx_put(s, pc->slot);
  dp__free(pc, sizeof *pc);
  sent(s, st);
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
  ucs_status_ptr_t r = am_send(ep, id, hdr, hlen, data, n, &p);
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
  ep_fail_status(ep, UCS_PTR_STATUS(r));
  s->outstanding--;
  return DP_EIO;
}

/* Checks that every buffer can move and sizes the headers (at worst one a
 * buffer). */
static int sop_plan(dp_transport_t *t, sop_t *s, dp_error_t *err) {
  size_t nb = dp_frame_nbuffers(s->frame);
  dp_buffer_desc_t d;
  for (size_t i = 0; i < nb; i++) {
    dp_frame_buffer(s->frame, i, &d, NULL);
    if (buf_mode(t, d.device) == MODE_REFUSED) return refused(t, d.device, i, err);
    s->buf_bytes += d.nbytes;
  }
  s->nbh = nb; /* the size of the three arrays, allocated or not */
  if (nb && !(s->bh = dp__alloc_array(nb, sizeof *s->bh))) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (nb && !(s->stage = dp__alloc_array(nb, sizeof *s->stage))) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (nb && !(s->stage_len = dp__alloc_array(nb, sizeof *s->stage_len)))
    return dp__err(err, DP_ENOMEM, "transport: out of memory");
  return 0;
}

/* dp_endpoint_send: one event a device of the staged buffers, on the
 * caller's current stream there, which the staging copies wait for. */
static int sop_after(dp_transport_t *t, sop_t *s, dp_error_t *err) {
  size_t nb = dp_frame_nbuffers(s->frame), n = 0;
  uint8_t seen[(DP_DEVICE_INDEX_MAX + 1) / 8];
  dp_buffer_desc_t d;
  for (int pass = 0; pass < 2; pass++) {
    memset(seen, 0, sizeof seen);
    for (size_t i = 0; i < nb; i++) {
      dp_frame_buffer(s->frame, i, &d, NULL);
      if (buf_mode(t, d.device) != MODE_STAGED || (seen[d.device.index / 8] & (1u << d.device.index % 8))) continue;
      seen[d.device.index / 8] |= (uint8_t)(1u << d.device.index % 8);
      if (!pass) {
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
    if (!pass && n && !(s->after = dp__alloc_array(n, sizeof *s->after)))
      return dp__err(err, DP_ENOMEM, "transport: out of memory");
    if (!pass && n) {
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
  if (s->kind == SOP_RAW) {
    if (s->raw_id == DP__AM_FRAME && s->raw_len_hdr == sizeof(dp__am_frame_hdr_t))
      ((dp__am_frame_hdr_t *)s->raw_hdr)->seq = ep->send_seq++;
    return post_msg(s, NULL, s->raw_id, s->raw_hdr, s->raw_len_hdr, s->bytes, s->nbytes, 0);
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
  ep->inflight += s->buf_bytes;
  if (t->timeout_ns > 0) s->deadline = now_ns() + t->timeout_ns;
  return post_msg(s, NULL, DP__AM_FRAME, &s->fh, sizeof s->fh, fb, flen, UCP_AM_SEND_FLAG_EAGER);
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
    if (e.nbytes > DP__SMALL_BUFFER || buf_mode(t, e.device) != MODE_DIRECT ||
        (j > i && total + e.nbytes > DP__BATCH_BYTES))
      break;
    total += (size_t)e.nbytes;
    j++;
  }
  uint8_t *pk = total ? dp__alloc(total) : NULL;
  if (total && !pk) {
    ep_failf(s->ep, DP_ENOMEM, "%s", "out of memory packing buffers");
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
  if (s->ep) ep_fail(s->ep, e);
  return e->code ? e->code : DP_EIO;
}

/* Copies the next staged piece — a chunk of a large buffer, or a run of
 * small buffers of one device — into a send slot on the device's send
 * stream. 1: no slot free (the piece waits). */
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
  if (ep->shm_state == SHM_NONE && t->shm_on) shm_offer(t, ep);
  int rc = 0;
  if (ep->shm_state == SHM_YES) {
    if (!(sl = ep->seg->free)) return 1;
    ep->seg->free = sl->next;
    sl->next = NULL;
    ep->seg->refs++;
  } else {
    if (ep->tx_used >= DP__STAGE_SLOTS) return 1;
    if ((rc = slot_get(t, &t->tx, (size_t)n, 0, &sl, &err))) return sop_failed(s, &err);
    ep->tx_used++;
  }
  dp_stream_t *st = NULL;
  rc = own_stream(t, t->sstreams, d.device, 0, &st, &err);
  for (size_t k = 0; !rc && !s->waited && !dp__transport_skip_events && k < s->nafter; k++) {
    dp_stream_t *ws;
    rc = own_stream(t, t->sstreams, dp_event_device(s->after[k]), 0, &ws, &err);
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
  if (!rc) rc = slot_mark(t, sl, st, &err);
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
 * piece before them went. 0: every buffer posted; 1: waiting for copies or
 * slots; <0: the endpoint failed. */
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
    }
    if (s->cur == nb) return s->pq_head ? 1 : 0;
    dp_frame_buffer(s->frame, s->cur, &d, NULL);
    int rc;
    if (buf_mode(t, d.device) == MODE_STAGED) rc = stage_next(t, s, nb);
    else if (s->pq_head) return 1;
    else rc = post_direct(t, s, nb);
    if (rc) return rc;
  }
}

/* Starts (start) or resumes posting s. Returns 1 when s waits (it is the
 * endpoint's `posting` then), 0 when all of it is posted, <0 on failure. */
static int sop_go(dp_transport_t *t, sop_t *s, int start) {
  dp_endpoint_t *ep = s->ep;
  s->outstanding++; /* held while posting (see post_msg) */
  int rc = start ? sop_start(t, s) : 0;
  if (!rc) rc = sop_more(t, s);
  if (rc == 1) {
    ep->posting = s;
    s->outstanding--;
    return 1;
  }
  if (ep->posting == s) ep->posting = NULL;
  if (!rc) s->posted = 1;
  if (--s->outstanding == 0) {
    if (!rc && s->ep) sop_complete(s);
    else if (!s->ep) sop_free(s); /* detached by the endpoint's failure */
  }
  return rc;
}

/* Moves sends from the queue to UCX while the in-flight bound allows.
 * Returns 1 when a send waits on its future or its copies (the loop must
 * keep polling). */
static int ep_pump_sends(dp_transport_t *t, dp_endpoint_t *ep) {
  if (ep->posting && !ep->dead) {
    int rc = sop_go(t, ep->posting, 0);
    if (rc) return rc == 1;
  }
  while (ep->sq_head && !ep->dead) {
    sop_t *s = ep->sq_head;
    if (s->kind == SOP_FUTURE && !s->frame) {
      if (!dp_future_is_done(s->src)) return 1;
      dp_error_t e;
      dp_error_clear(&e);
      if (dp_future_error(s->src, &e)) {
        sop_fail(s, &e);
      } else {
        if (!dp__transport_skip_events)
          for (size_t i = 0, n = dp_future_ndevices(s->src); i < n; i++)
            if (dp_event_query(dp_future_event(s->src, i), NULL) == 0) return 1;
        int rc = dp_frame_new(&s->frame, &e);
        if (!rc) rc = dp_pickle(dp_future_value(s->src), NULL, s->frame, &e);
        if (!rc) rc = sop_plan(t, s, &e);
        if (rc) sop_fail(s, &e);
      }
      if (s->failed) {
        ep->sq_head = s->next;
        if (!ep->sq_head) ep->sq_tail = NULL;
        ep->nsends--;
        sop_free(s);
        continue;
      }
    }
    if (ep->inflight && ep->inflight + s->buf_bytes > t->max_inflight) return 0;
    ep->sq_head = s->next;
    if (!ep->sq_head) ep->sq_tail = NULL;
    s->next = ep->posted;
    ep->posted = s;
    int rc = sop_go(t, s, 1);
    if (rc) return rc == 1;
  }
  return 0;
}

/* ---- receiving ---- */

static int bind_cb(void *ud, const dp_buffer_desc_t *d, dp_storage_t **out, dp_error_t *err) {
  void **ctx = ud;
  dp_transport_t *t = ctx[0];
  rmsg_t *m = ctx[1];
  if (d->id >= m->nbuf || m->bufs[d->id].bound)
    return dp__err(err, DP_EFORMAT, "transport: buffer id %u out of the message's %u", d->id, m->nbuf);
  int mode = buf_mode(t, d->device);
  if (mode == MODE_REFUSED) return refused(t, d->device, d->id, err);
  rbuf_t *b = &m->bufs[d->id];
  int rc = d->device.type == DP_DEVICE_CPU ? cpu_alloc(d->device, d->nbytes, out, &b->dst, err)
                                           : dev_alloc(t, d->device, d->nbytes, out, &b->dst, err);
  if (rc) return rc;
  b->storage = *out;
  b->nbytes = d->nbytes;
  b->dev = d->device;
  b->staged = mode == MODE_STAGED;
  b->bound = 1;
  return 0;
}

static void deliver(dp_transport_t *t, dp_endpoint_t *ep);

/* A frame message: check and unpickle the frame, binding its buffers to new
 * receive allocations. A frame the unpickler refuses fails this message
 * only (its buffers are drained); bad framing fails the endpoint. */
static int on_frame(dp_transport_t *t, dp_endpoint_t *ep, const dp__am_frame_hdr_t *h, const void *data, size_t len) {
  if (ep->cur && ep->cur->next_index < ep->cur->nbuf) {
    ep_failf(ep, DP_EFORMAT, "%s", "a frame arrived before the previous message's buffers");
    return DP_EFORMAT;
  }
  if (h->seq != ep->recv_seq || h->frame_len != len) {
    ep_failf(ep, DP_EFORMAT, "%s", "frame message out of sequence or of the wrong length");
    return DP_EFORMAT;
  }
  rmsg_t *m = dp__alloc(sizeof *m);
  if (!m) {
    ep_failf(ep, DP_ENOMEM, "%s", "out of memory for a received message");
    return DP_ENOMEM;
  }
  memset(m, 0, sizeof *m);
  dp_error_clear(&m->error);
  m->seq = ep->recv_seq++;
  m->nbuf = h->nbuffers;
  dp_frame_info_t info;
  int rc = dp_frame_check(data, len, &info, &m->error);
  if (!rc && (info.flags & 1u) && h->nbuffers)
    rc = dp__err(&m->error, DP_EFORMAT, "transport: an inline frame announced %u out-of-band buffers", h->nbuffers);
  if (!rc && !(info.flags & 1u) && info.nbuffers != h->nbuffers)
    rc = dp__err(&m->error, DP_EFORMAT, "transport: frame has %u buffers, its message announced %u",
                 info.nbuffers, h->nbuffers);
  if (!rc && m->nbuf && !(m->bufs = dp__alloc_array(m->nbuf, sizeof *m->bufs)))
    rc = dp__err(&m->error, DP_ENOMEM, "transport: out of memory");
  if (!rc) {
    if (m->bufs) memset(m->bufs, 0, m->nbuf * sizeof *m->bufs);
    dp_unpickle_opts_t o = t->uopts;
    void *ctx[2] = {t, m};
    if (m->nbuf) {
      o.bind = bind_cb;
      o.bind_ud = ctx;
    }
    rc = dp_unpickle(data, len, &o, &m->value, &m->error);
  }
  if (!rc && !m->nbuf) { /* a self-contained frame: kept for recv_frame */
    if (!(m->frame_copy = dp__alloc(len ? len : 1)))
      rc = dp__err(&m->error, DP_ENOMEM, "transport: out of memory");
    else {
      memcpy(m->frame_copy, data, len);
      m->frame_len = len;
    }
  }
  if (rc) m->failed = 1;
  m->buf_bytes = h->buf_bytes;
  if (!m->failed) {
    uint64_t sum = 0;
    for (uint32_t i = 0; i < m->nbuf; i++) sum += m->bufs[i].nbytes;
    if (sum != h->buf_bytes) {
      ep_failf(ep, DP_EFORMAT, "%s", "the buffers' sizes differ from the frame message's total");
      rmsg_free(m);
      return DP_EFORMAT;
    }
  }
  ep->held += m->buf_bytes;
  if (ep->rq_tail) ep->rq_tail->next = m;
  else ep->rq_head = m;
  ep->rq_tail = m;
  ep->cur = m;
  deliver(t, ep);
  return 0;
}

typedef struct rctx {
  struct rctx *next;        /* rx_wait */
  dp_transport_t *t;
  dp_endpoint_t *ep;
  rmsg_t *m;
  dp__am_bufs_hdr_t h;
  uint8_t *tmp;             /* packed direct buffers land here */
  size_t tmplen;
  slot_t *slot;             /* staged ones here */
  void *data;               /* rx_wait: UCX's descriptor, not yet pulled */
} rctx_t;

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
  int rc = own_stream(t, t->streams, m->bufs[h->first].dev, 1, st, e);
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
  if (!rc) rc = slot_mark(t, sl, st, &e);
  if (rc) {
    if (st) dp_stream_synchronize(st, NULL); /* the copies queued read the slot */
    slot_put(t, &t->rx, sl);
    ep_fail(ep, &e);
    return rc;
  }
  sl->next = t->rx_busy;
  t->rx_busy = sl;
  return 0;
}

/* A peer's slot is the peer's again. */
static void shm_done(dp_endpoint_t *ep, uint64_t slot) {
  dp__am_shm_ctl_t c = {DP__WIRE_MAGIC, (uint32_t)slot, 0};
  ctl_queue(ep, DP__AM_SHM_DONE, &c, sizeof c);
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
    shm_done(ep, slot);
    deliver(t, ep);
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
    ep_fail(ep, &e);
    return rc;
  }
  r->ep = ep;
  r->shm = dp__shm_retain(ep->rshm);
  r->slot = (uint32_t)slot;
  r->next = t->rdone;
  t->rdone = r;
  deliver(t, ep);
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
  if (sl && !live) slot_put(t, &t->rx, sl);
  if (m->detached) {
    if (!m->pending) rmsg_free(m);
    return 0;
  }
  if (st != UCS_OK) {
    ep_failf(ep, DP_EIO, "receiving a buffer failed (%s)", ucs_status_string(st));
    return -1;
  }
  if (sl && live && stage_in(t, ep, m, &h, sl)) return -1;
  deliver(t, ep);
  return 0;
}

static void recv_cb(void *req, ucs_status_t st, size_t len, void *ud) {
  rctx_t *c = ud;
  (void)len;
  ucp_request_free(req);
  c->t->nreq--;
  recv_done(c, st);
}

typedef struct drain {
  dp_transport_t *t;
  void *scratch;
  size_t n;
} drain_t;

static void drain_cb(void *req, ucs_status_t st, size_t len, void *ud) {
  drain_t *d = ud;
  (void)st, (void)len;
  ucp_request_free(req);
  d->t->nreq--;
  dp__free(d->scratch, d->n);
  dp__free(d, sizeof *d);
}

/* Pulls a rendezvous buffer of a refused message (its endpoint lives on)
 * into scratch memory and drops it: the sender's send then completes as any
 * other, and UCX's descriptor goes back (one released unread stays in its
 * pool until the worker goes). Without memory for it, it is released. */
static void drain_rndv(dp_transport_t *t, void *data, size_t n) {
  drain_t *d = dp__alloc(sizeof *d);
  if (d && !(d->scratch = dp__alloc(n ? n : 1))) {
    dp__free(d, sizeof *d);
    d = NULL;
  }
  if (!d) {
    ucp_am_data_release(t->worker, data);
    return;
  }
  d->n = n ? n : 1;
  d->t = t;
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = drain_cb;
  p.user_data = d;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(t->worker, data, d->scratch, n, &p);
  if (UCS_PTR_IS_PTR(r)) {
    t->nreq++;
  } else {
    dp__free(d->scratch, d->n);
    dp__free(d, sizeof *d);
  }
}

/* Pulls a rendezvous piece (c, counted in its message's pending) into its
 * slot, its buffer, or packed scratch memory. 0, or -1 when the endpoint
 * failed. */
static int post_recv(dp_transport_t *t, rctx_t *c, void *data) {
  rmsg_t *m = c->m;
  dp_endpoint_t *ep = c->ep;
  const dp__am_bufs_hdr_t *h = &c->h;
  void *dst = c->slot ? (void *)c->slot->p : (uint8_t *)m->bufs[h->first].dst + h->offset;
  if (!c->slot && h->count > 1) {
    if (!(c->tmp = dp__alloc(h->total ? (size_t)h->total : 1))) {
      dp__free(c, sizeof *c);
      m->pending--;
      ucp_am_data_release(t->worker, data);
      ep_failf(ep, DP_ENOMEM, "%s", "out of memory receiving packed buffers");
      return -1;
    }
    c->tmplen = h->total ? (size_t)h->total : 1;
    dst = c->tmp;
  }
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = recv_cb;
  p.user_data = c;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(t->worker, data, dst, (size_t)h->total, &p);
  if (UCS_PTR_IS_PTR(r)) {
    t->nreq++;
    return 0;
  }
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
    if (rndv) ucp_am_data_release(t->worker, data);
    ep_failf(ep, DP_EFORMAT, "%s", "a buffers message does not follow its frame's table");
    return -1;
  }
  if (h->count > 1 || h->offset + h->total == h->size) {
    m->next_index += h->count;
    m->next_off = 0;
  } else {
    m->next_off += h->total;
  }
  if (m->failed) {
    if (shm) shm_done(ep, slot);
    else if (rndv) drain_rndv(t, data, len);
    deliver(t, ep);
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
    ep_failf(ep, DP_EFORMAT, "%s", "a buffers message's size differs from its frame's table");
    if (rndv) ucp_am_data_release(t->worker, data);
    return -1;
  }
  /* a direct buffer comes whole; a staged one in chunks of DP__STAGE_CHUNK
     (the last shorter), so that a receive slot holds any piece */
  if (h->count == 1 && (staged ? h->total > DP__STAGE_CHUNK : h->total != h->size)) {
    ep_failf(ep, DP_EFORMAT, "%s", "a buffer is cut into pieces other than the protocol's");
    if (rndv) ucp_am_data_release(t->worker, data);
    return -1;
  }
  if (staged && spans) {
    ep_failf(ep, DP_EFORMAT, "%s", "a packed message of device buffers spans devices");
    if (rndv) ucp_am_data_release(t->worker, data);
    return -1;
  }
  if (shm) return shm_in(t, ep, m, h, slot, staged);
  slot_t *sl = NULL;
  if (staged) {
    dp_error_t e;
    if (slot_get(t, &t->rx, (size_t)h->total, !rndv, &sl, &e)) {
      if (rndv) ucp_am_data_release(t->worker, data);
      ep_fail(ep, &e);
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
    deliver(t, ep);
    return 0;
  }
  rctx_t *c = dp__alloc(sizeof *c);
  if (!c) {
    if (sl) slot_put(t, &t->rx, sl);
    ucp_am_data_release(t->worker, data);
    ep_failf(ep, DP_ENOMEM, "%s", "out of memory receiving a buffer");
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
  return post_recv(t, c, data);
}

/* Hands complete messages, in order, to the waiting receives. */
static void deliver(dp_transport_t *t, dp_endpoint_t *ep) {
  while (ep->rq_head && ep->w_head && !ep->dead) {
    rmsg_t *m = ep->rq_head;
    if (m->next_index < m->nbuf || m->pending) return;
    rwait_t *w = ep->w_head;
    ep->rq_head = m->next;
    if (!ep->rq_head) ep->rq_tail = NULL;
    if (ep->cur == m) ep->cur = NULL;
    ep->w_head = w->next;
    if (!ep->w_head) ep->w_tail = NULL;
    ep->held -= m->buf_bytes;
    if (m->failed) {
      dp_future_set_error(w->f, &m->error, NULL);
    } else if (w->frame) {
      dp_value_t b = dp_none();
      dp_error_t e;
      int rc = m->nbuf ? dp__err(&e, DP_EFORMAT, "transport: %s: the message carries %u out-of-band buffers, "
                                                 "not a self-contained frame", ep->name, m->nbuf)
                       : dp_bytes_new(m->frame_copy, m->frame_len, &b, &e);
      if (rc) dp_future_set_error(w->f, &e, NULL);
      else dp_future_mark_completed(w->f, b, NULL);
    } else {
      dp_future_mark_completed(w->f, m->value, NULL);
      m->value = dp_none();
    }
    dp_future_release(w->f);
    dp__free(w, sizeof *w);
    rmsg_free(m);
  }
  (void)t;
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

static int blocked(const dp_transport_t *t, const dp_endpoint_t *ep, unsigned id) {
  return id == DP__AM_FRAME && ep->held && ep->held > t->max_inflight;
}

/* 2 when a rendezvous descriptor was kept for later (rx_wait): UCX must
 * then be told UCS_INPROGRESS. */
static int process(dp_transport_t *t, dp_endpoint_t *ep, unsigned id, const void *hdr, void *data, size_t len,
                   int rndv) {
  if (id == DP__AM_FRAME) return on_frame(t, ep, hdr, data, len);
  if (id == DP__AM_SHM_PIECE) return on_bufs(t, ep, hdr, data, len, rndv, 1, ((const dp__am_shm_piece_t *)hdr)->slot);
  return on_bufs(t, ep, hdr, data, len, rndv, 0, 0);
}

/* Processes parked messages whose turn has come. */
static void ep_pump_inbox(dp_transport_t *t, dp_endpoint_t *ep) {
  while (ep->in_head && !ep->dead) {
    inbox_t *b = ep->in_head;
    if (key_cmp(key_of(b->id, b->hdr), expected(ep)) != 0 || blocked(t, ep, b->id)) return;
    ep->in_head = b->next;
    if (!ep->in_head) ep->in_tail = NULL;
    else ep->in_head->prev = NULL;
    ep->nparked--;
    void *data = b->data;
    b->data = NULL;
    process(t, ep, b->id, b->hdr, data, b->len, b->rndv);
    if (!b->rndv && data) ucp_am_data_release(b->w, data); /* rendezvous data went to on_bufs */
    dp__free(b, sizeof *b);
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
  int persistent = rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA);
  size_t want = id == DP__AM_FRAME   ? sizeof(dp__am_frame_hdr_t)
                : id == DP__AM_BUFS ? sizeof(dp__am_bufs_hdr_t)
                                    : sizeof(dp__am_shm_piece_t);
  uint32_t magic = 0;
  if (hlen >= 4) memcpy(&magic, hdr, 4);
  if (hlen != want || magic != DP__WIRE_MAGIC || (id == DP__AM_FRAME && rndv) ||
      (id != DP__AM_FRAME && !bufs_hdr_ok(hdr))) {
    if (rndv) ucp_am_data_release(t->worker, data);
    ep_failf(ep, DP_EFORMAT, "%s", "malformed message header (not a devpickle peer?)");
    return UCS_OK;
  }
  uint64_t h[sizeof ((inbox_t *)0)->hdr / 8];
  memcpy(h, hdr, hlen); /* aligned */
  key_t k = key_of(id, h);
  int c = key_cmp(k, expected(ep));
  if (c < 0) {
    if (rndv) ucp_am_data_release(t->worker, data);
    ep_failf(ep, DP_EFORMAT, "%s", "a message repeats one already received");
    return UCS_OK;
  }
  if (c == 0 && !blocked(t, ep, id)) {
    int kept = process(t, ep, id, h, data, len, rndv) == 2;
    if (ep->in_head) ep_pump_inbox(t, ep);
    return kept ? UCS_INPROGRESS : UCS_OK;
  }
  /* not its turn: park it, in order */
  inbox_t *b = ep->nparked < DP__MAX_PARKED ? dp__alloc(sizeof *b) : NULL;
  if (!b || (!persistent && len)) {
    if (b) dp__free(b, sizeof *b);
    if (rndv) ucp_am_data_release(t->worker, data);
    ep_failf(ep, b || ep->nparked < DP__MAX_PARKED ? DP_ENOMEM : DP_ELIMIT, "%s",
             ep->nparked >= DP__MAX_PARKED ? "too many messages out of order" : "out of memory parking a message");
    return UCS_OK;
  }
  memset(b, 0, sizeof *b);
  b->id = id;
  memcpy(b->hdr, hdr, hlen);
  b->hlen = hlen;
  b->data = persistent ? data : NULL; /* no data: nothing to keep */
  b->w = w;
  b->len = len;
  b->rndv = rndv;
  inbox_t *at = ep->in_tail;
  while (at && key_cmp(key_of(at->id, at->hdr), k) > 0) at = at->prev;
  if (at && key_cmp(key_of(at->id, at->hdr), k) == 0) {
    dp__free(b, sizeof *b);
    if (rndv) ucp_am_data_release(t->worker, data);
    ep_failf(ep, DP_EFORMAT, "%s", "a message repeats one already received");
    return UCS_OK;
  }
  b->prev = at;
  b->next = at ? at->next : ep->in_head;
  if (b->next) b->next->prev = b;
  else ep->in_tail = b;
  if (at) at->next = b;
  else ep->in_head = b;
  ep->nparked++;
  return UCS_INPROGRESS;
}

/* The peer's offer of its segment: mapped if it is on this host and is
 * what the offer says; answered either way. */
static void on_offer(dp_transport_t *t, dp_endpoint_t *ep, const dp__am_shm_offer_t *o) {
  dp__am_shm_ctl_t r = {DP__WIRE_MAGIC, 0, o->token};
  if (o->name[sizeof o->name - 1] == 0 && o->nslots == DP__STAGE_SLOTS && o->slot_bytes == DP__STAGE_CHUNK &&
      dp__shm_map(t->backend, o->name, o->nslots, (size_t)o->slot_bytes, o->token, &ep->rshm, NULL) == 0)
    r.value = 1;
  ctl_queue(ep, DP__AM_SHM_REPLY, &r, sizeof r);
}

/* A slot the peer gives back: its piece's send is done with it. */
static void on_done(dp_transport_t *t, dp_endpoint_t *ep, uint32_t i) {
  seg_t *g = ep->seg;
  if (!g || i >= DP__STAGE_SLOTS || !g->lent[i]) {
    ep_failf(ep, DP_EFORMAT, "%s", "a slot given back that was not lent");
    return;
  }
  piece_t *pc = g->lent[i];
  g->lent[i] = NULL;
  sop_t *s = pc->s;
  slot_put(t, NULL, pc->slot);
  dp__free(pc, sizeof *pc);
  sent(s, UCS_OK);
}

/* The lane's messages: the acceptor's address (to the connector, on the
 * connection) and the connector's answer (on the lane, or "no" on the
 * connection). */
static void on_lane(dp_transport_t *t, dp_endpoint_t *ep, unsigned id, const dp__am_shm_ctl_t *c, const void *data,
                    size_t len, const ucp_am_recv_param_t *param, int on_lane_worker) {
  if (id == DP__AM_LANE_ADDR && !on_lane_worker && !ep->acceptor && ep->lane == LANE_NONE && !ep->dw &&
      !ep->lane_addr && data && len == c->value && len > 0 && len <= DP__LANE_ADDR_MAX) {
    if (!t->lctx) { /* no lanes here */
      dp__am_shm_ctl_t no = {DP__WIRE_MAGIC, 0, 0};
      ctl_queue(ep, DP__AM_LANE_HELLO, &no, sizeof no);
      return;
    }
    ep->lane_addr = dp__alloc(len);
    if (!ep->lane_addr) {
      ep_failf(ep, DP_ENOMEM, "%s", "out of memory for the peer's lane address");
      return;
    }
    memcpy(ep->lane_addr, data, len);
    ep->lane_addr_len = len;
    return;
  }
  if (id == DP__AM_LANE_HELLO && ep->acceptor && ep->lane == LANE_WAIT && !len && c->value == (unsigned)on_lane_worker &&
      (!on_lane_worker || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))) {
    if (on_lane_worker) {
      ep->dep = param->reply_ep; /* UCX's endpoint answering the connector's */
      ep->lane = LANE_ON;
    } else {
      ep->lane = LANE_NONE;
      ep->lane_drop = 1;
    }
    return;
  }
  ep_failf(ep, DP_EFORMAT, "%s", "a same-host lane message the protocol does not expect");
}

/* OFFER, REPLY, DONE and the lane's: handled on arrival. */
static ucs_status_t am_ctl(dp_transport_t *t, dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen,
                           const void *data, size_t len, const ucp_am_recv_param_t *param, int on_lane_worker) {
  size_t want = id == DP__AM_SHM_OFFER ? sizeof(dp__am_shm_offer_t) : sizeof(dp__am_shm_ctl_t);
  uint64_t h[(sizeof(dp__am_shm_offer_t) + 7) / 8];
  uint32_t magic = 0;
  if (hlen == want) memcpy(h, hdr, hlen), memcpy(&magic, h, 4);
  if (hlen != want || magic != DP__WIRE_MAGIC || (len && id != DP__AM_LANE_ADDR)) {
    ep_failf(ep, DP_EFORMAT, "%s", "malformed message header (not a devpickle peer?)");
    return UCS_OK;
  }
  const dp__am_shm_ctl_t *c = (const dp__am_shm_ctl_t *)h;
  if (id == DP__AM_LANE_ADDR || id == DP__AM_LANE_HELLO) {
    on_lane(t, ep, id, c, data, len, param, on_lane_worker);
  } else if (id == DP__AM_SHM_OFFER) {
    if (ep->peer_offered) ep_failf(ep, DP_EFORMAT, "%s", "a second offer of shared slots");
    else ep->peer_offered = 1, on_offer(t, ep, (const dp__am_shm_offer_t *)h);
  } else if (id == DP__AM_SHM_REPLY) {
    if (ep->shm_state == SHM_NO && ep->offer_token && c->token == ep->offer_token) {
      ep->offer_token = 0; /* the answer to an offer withdrawn meanwhile */
    } else if (ep->shm_state != SHM_OFFERED || c->token != dp__shm_token(ep->seg->shm)) {
      ep_failf(ep, DP_EFORMAT, "%s", "a reply to no offer of shared slots");
    } else {
      ep->offer_token = 0;
      if (c->value != 1) {
        shm_withdraw(ep);
      } else {
        dp__shm_unlink(ep->seg->shm); /* mapped there: the name is done with */
        ep->shm_state = SHM_YES;
      }
    }
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
  if (!ep && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) ep = ep_find(t, param->reply_ep);
  if (!ep || ep->dead) {
    /* from an endpoint failed or closed here (UCX still has it, as it
       names it): dropped */
    if (rndv) ucp_am_data_release(w, data);
    return UCS_OK;
  }
  ep->established = 1;
  if (h->ep) {
    atomic_fetch_add(&dp__transport_lane_msgs, 1);
    if (rndv) { /* never sent so: the lane carries small messages, eagerly */
      ucp_am_data_release(w, data);
      ep_failf(ep, DP_EFORMAT, "%s", "a rendezvous on the same-host lane");
      return UCS_OK;
    }
  }
  if (h->id == DP__AM_FRAME || h->id == DP__AM_BUFS || h->id == DP__AM_SHM_PIECE)
    return am_any(t, ep, w, h->id, hdr, hlen, data, len, param);
  if (rndv) ucp_am_data_release(w, data), data = NULL;
  return am_ctl(t, ep, h->id, hdr, hlen, data, len, param, h->ep != NULL);
}

/* ---- the progress thread ---- */

static void ep_close_now(dp_transport_t *t, dp_endpoint_t *ep) {
  size_t ns = ep->nsends, nr = 0;
  for (rwait_t *w = ep->w_head; w; w = w->next) nr++;
  if (!ep->dead) {
    if (ns || nr) {
      dp_error_t e;
      dp__err(&e, DP_ECANCELED, "transport: %s closed with %zu sends and %zu receives pending", ep->name, ns, nr);
      ep_fail(ep, &e);
    } else {
      for (rmsg_t *m = ep->rq_head, *n; m; m = n) {
        n = m->next;
        m->detached = 1;
        if (!m->pending) rmsg_free(m);
      }
      ep->rq_head = ep->rq_tail = ep->cur = NULL;
      for (inbox_t *b = ep->in_head, *n; b; b = n) {
        n = b->next;
        inbox_drop(t, b);
      }
      ep->in_head = ep->in_tail = NULL;
      /* the peer's slots whose copies run here go back before the close,
         or its sends would fail with the connection */
      for (rdone_t *r = t->rdone; r; r = r->next)
        if (r->ep == ep) {
          dp_event_synchronize(r->ev, NULL);
          shm_done(ep, r->slot);
          r->ep = NULL;
        }
      ctl_flush(t, ep);
      ep_drop_shm(t, ep);
      lane_close(ep);
      if (ep->ep) {
        /* flush: eager messages whose sends completed may not have left yet */
        ucp_request_param_t p = {0};
        void *r = ucp_ep_close_nbx(ep->ep, &p);
        if (UCS_PTR_IS_PTR(r)) ep->close_req = r;
      }
      ep->dead = 1;
    }
  }
  if (ep->need_close) ep_force_close(ep);
  ep_unlink(t, ep);
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
    p.conn_handler.cb = on_conn;
    p.conn_handler.arg = l;
    ucs_status_t st = ucp_listener_create(t->worker, &p, &l->l);
    if (st != UCS_OK) {
      cmd_finish(t, c, dp__err(&c->err, DP_EIO, "transport: cannot listen: %s", ucs_status_string(st)));
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
    cmd_finish(t, c, 0);
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
      ep_close_now(t, a);
      a->next = t->closing;
      t->closing = a;
      a = n;
    }
    cmd_finish(t, c, 0);
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
    p.err_handler.cb = ep_err_cb;
    p.err_handler.arg = ep;
    ep_link(t, ep);
    ucs_status_t st = ucp_ep_create(t->worker, &p, &ep->ep);
    if (st != UCS_OK) {
      ep->ep = NULL;
      ep_failf(ep, DP_EIO, "cannot connect (%s)", ucs_status_string(st));
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
      sop_fail(s, &e);
      sop_free(s);
      return;
    }
    s->ep = ep;
    s->t = t;
    ep->nsends++;
    if (ep->sq_tail) ep->sq_tail->next = s;
    else ep->sq_head = s;
    ep->sq_tail = s;
    ep_pump_sends(t, ep);
    return;
  }
  case CMD_RECV: {
    rwait_t *w = c->rw;
    dp_endpoint_t *ep = c->ep;
    dp__free(c, sizeof *c);
    if (ep->dead) {
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
    deliver(t, ep);
    ep_pump_inbox(t, ep);
    return;
  }
  case CMD_CLOSE: {
    dp_endpoint_t *ep = c->ep;
    ep_close_now(t, ep);
    ep->next = t->closing;
    t->closing = ep;
    cmd_finish(t, c, 0);
    return;
  }
  case CMD_STOP:
    t->stop = 1;
    cmd_finish(t, c, 0);
    return;
  }
}

static int drain_cmds(dp_transport_t *t) {
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
    if (ep->close_req && ucp_request_check_status(ep->close_req) == UCS_INPROGRESS) {
      p = &ep->next;
      continue;
    }
    if (ep->close_req) ucp_request_free(ep->close_req);
    *p = ep->next;
    ep_free_mem(ep);
  }
}

static void check_timeouts(dp_transport_t *t) {
  int64_t now = now_ns();
  for (dp_endpoint_t *ep = t->eps, *n; ep; ep = n) {
    n = ep->next;
    for (sop_t *s = ep->posted; s; s = s->next)
      if (s->deadline && now > s->deadline && !ep->dead) {
        char d[64];
        snprintf(d, sizeof d, "%lld ms", (long long)(t->timeout_ns / 1000000));
        ep_failf(ep, DP_ETIMEDOUT, "a send was not complete after %s", d);
        break;
      }
  }
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
    slot_put(t, &t->rx, sl);
  }
  for (piece_t **p = &t->orphans; *p;) {
    piece_t *pc = *p;
    if (dp_event_query(pc->slot->ev, NULL) == 0) {
      p = &pc->next;
      continue;
    }
    *p = pc->next;
    sop_t *s = pc->s;
    slot_put(t, &t->tx, pc->slot);
    dp__free(pc, sizeof *pc);
    if (--s->outstanding == 0) sop_free(s);
  }
  while (t->rx_wait_head) { /* rendezvous pieces that waited for a slot */
    rctx_t *c = t->rx_wait_head;
    rmsg_t *m = c->m;
    slot_t *sl = NULL;
    dp_error_t e;
    int rc = (m->detached || m->failed) ? 0 : slot_get(t, &t->rx, DP__STAGE_CHUNK, 0, &sl, &e);
    if (!rc && !sl && !m->detached && !m->failed) break;
    t->rx_wait_head = c->next;
    if (!t->rx_wait_head) t->rx_wait_tail = NULL;
    c->next = NULL;
    if (rc || m->detached || m->failed) { /* its endpoint failed meanwhile, or no memory */
      dp_endpoint_t *ep = c->ep;
      int detached = m->detached;
      ucp_am_data_release(t->worker, c->data);
      dp__free(c, sizeof *c);
      if (--m->pending == 0 && detached) rmsg_free(m);
      if (rc && !detached) ep_fail(ep, &e);
      continue;
    }
    c->slot = sl;
    void *data = c->data;
    c->data = NULL;
    post_recv(t, c, data);
  }
  for (rdone_t **p = &t->rdone; *p;) { /* copies out of peers' slots */
    rdone_t *r = *p;
    if (dp_event_query(r->ev, NULL) == 0) {
      p = &r->next;
      continue;
    }
    *p = r->next;
    if (r->ep && !r->ep->dead) shm_done(r->ep, r->slot);
    dp__shm_release(r->shm);
    dp_event_free(r->ev);
    dp__free(r, sizeof *r);
  }
  return t->rx_busy || t->orphans || t->rx_wait_head || t->rdone;
}

#define DP__SPIN_NS 200000

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
static int pass(dp_transport_t *t, int *polling_out) {
  int work = drain_cmds(t);
  if (t->stop) return work;
  while (ucp_worker_progress(t->worker)) work++;
  int polling = 0;
  for (dp_endpoint_t *ep = t->eps; ep; ep = ep->next) {
    if (ep->dw)
      while (ucp_worker_progress(ep->dw)) work++;
    if (ep->lane_addr && !ep->dead) lane_connect(t, ep), work++;
    if (ep->lane == LANE_HELLO && !ep->dead) lane_hello(ep);
    if (ep->lane_drop) { /* the connector has no lane: the worker goes */
      ep->lane_drop = 0;
      ucp_worker_destroy(ep->dw);
      ep->dw = NULL;
    }
    if (ep->need_close) ep_force_close(ep), work++;
    if (ep->ctl_head && !ep->dead) ctl_flush(t, ep), work++;
    if (ep->shm_state == SHM_OFFERED && now_ns() > ep->offer_deadline) shm_withdraw(ep);
    if (ep->sq_head || ep->posting) polling |= ep_pump_sends(t, ep);
    if (ep->in_head && !ep->dead) ep_pump_inbox(t, ep);
  }
  if (t->rx_busy || t->orphans || t->rx_wait_head || t->rdone) polling |= poll_slots(t);
  if (t->closing) reap(t);
  if (t->timeout_ns > 0 && now_ns() - t->last_check > 1000000) {
    check_timeouts(t);
    t->last_check = now_ns();
  }
  *polling_out = polling || t->closing;
  return work;
}

/* ---- caller-driven progress ---- */

/* One pass on the calling thread (under pmu: one thread at a time); 0 from
 * inside this thread's own pass (a callback it runs). Returns the work
 * done, or 1 while copies are polled. */
static int caller_pass(dp_transport_t *t) {
  if (tl_pass == t) return 0;
  pthread_mutex_lock(&t->pmu);
  dp_transport_t *outer = tl_pass;
  tl_pass = t;
  int polling = 0;
  int work = t->stop ? 0 : pass(t, &polling);
  tl_pass = outer;
  pthread_mutex_unlock(&t->pmu);
  return work || polling;
}

/* The queued commands only (a send posts what it can), on the calling
 * thread under pmu. */
static void caller_commands(dp_transport_t *t) {
  pthread_mutex_lock(&t->pmu);
  dp_transport_t *outer = tl_pass;
  tl_pass = t;
  if (!t->stop) drain_cmds(t);
  tl_pass = outer;
  pthread_mutex_unlock(&t->pmu);
}

#define CALLER_FDS 64

/* Nothing to do for a while (*idle_since: since when; now: the time): spin
 * on (yielding the core now and then) up to DP__SPIN_NS, then sleep on the
 * workers' descriptors, at most until deadline (< 0: none) and 10 ms. */
static void caller_idle(dp_transport_t *t, int64_t *idle_since, int64_t deadline, int64_t now) {
  if (!*idle_since) *idle_since = now;
  if (now - *idle_since < DP__SPIN_NS) {
    sched_yield(); /* the peer may need this core */
    return;
  }
  if (tl_pass == t) return;
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

/* Caller-driven: runs passes until done(arg) or the deadline (< 0: none);
 * 1 when done. */
static int caller_until(dp_transport_t *t, int (*done)(void *), void *arg, int64_t timeout_ns) {
  int64_t deadline = timeout_ns < 0 ? -1 : now_ns() + timeout_ns;
  int64_t idle_since = 0;
  for (unsigned i = 1;; i++) {
    if (done(arg)) return 1;
    int busy = caller_pass(t);
    if (busy) idle_since = 0;
    if (i % 32) continue; /* the clock is read every 32 passes */
    int64_t now = now_ns();
    if (deadline >= 0 && now >= deadline) return done(arg);
    if (!busy) caller_idle(t, &idle_since, deadline, now);
  }
}

/* After CMD_STOP: closes in progress finish (bounded: a flush to a dead
 * peer fails), then the copies into and out of slots. */
static void drain_stopped(dp_transport_t *t) {
  for (int64_t until = now_ns() + 2000000000; (t->closing || t->nreq) && now_ns() < until;) {
    ucp_worker_progress(t->worker);
    reap(t);
  }
  while (poll_slots(t)) sched_yield();
  for (int i = 0; i <= DP_DEVICE_INDEX_MAX; i++)
    if (t->streams[i]) dp_reset_current_stream(t->backend, dp_stream_device(t->streams[i]));
}

static void *progress_main(void *arg) {
  dp_transport_t *t = arg;
  int64_t idle_since = 0; /* 0: busy */
  unsigned spins = 0;
  while (!t->stop) {
    int polling = 0;
    int work = pass(t, &polling);
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
    poll(t->pfd, nfd, t->timeout_ns > 0 ? 10 : 100);
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
  drain_stopped(t);
  return NULL;
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
  ucs_status_t st = ucp_config_modify(cfg, "TLS", want[0] && want[1] ? "posix,sysv" : want[0] ? "posix" : "sysv");
  /* a message sent in one piece of the queue completes at once (lane_send) */
  if (st == UCS_OK) st = ucp_config_modify(cfg, "MM_FIFO_ELEM_SIZE", DP__LANE_ELEM); /* posix's and sysv's */
  if (st == UCS_OK) st = ucp_init(up, cfg, &ctx);
  ucp_config_release(cfg);
  return st == UCS_OK ? ctx : NULL;
}

int dp_transport_new(const dp_transport_opts_t *opts, dp_transport_t **out, dp_error_t *err) {
  if (!out) return dp__err(err, DP_EINVAL, "dp_transport_new: out is NULL");
  *out = NULL;
  dp_transport_t *t = dp__alloc(sizeof *t);
  if (!t) return dp__err(err, DP_ENOMEM, "dp_transport_new: out of memory");
  memset(t, 0, sizeof *t);
  t->wake_fd = -1;
  t->max_inflight = opts && opts->max_inflight_bytes ? opts->max_inflight_bytes : DP_TRANSPORT_DEFAULT_INFLIGHT;
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
  const char *shm = getenv("DEVPICKLE_TRANSPORT_SHM");
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
  st = new_worker(t->ctx, &t->worker, &t->worker_fd);
  if (st == UCS_OK) st = set_handlers(t->worker, t->amh, t, NULL);
  if (st != UCS_OK) {
    if (t->worker) ucp_worker_destroy(t->worker);
    ucp_cleanup(t->ctx);
    dp__free(t, sizeof *t);
    return dp__err(err, DP_ENODEV, "dp_transport_new: UCX worker: %s", ucs_status_string(st));
  }
  if (t->shm_on) t->lctx = lane_context(&up);
  t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  pthread_mutex_init(&t->mu, NULL);
  pthread_mutex_init(&t->pmu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&t->cv, &ca);
  pthread_condattr_destroy(&ca);
  t->caller = opts && opts->progress == DP_TRANSPORT_PROGRESS_CALLER;
  /* a spinning thread yields its core every idle pass where the threads it
     waits for may need it (a few cores), every 16th elsewhere */
  t->yield_every = sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? 16 : 1;
  t->last_check = now_ns();
  if (t->wake_fd < 0 || (!t->caller && pthread_create(&t->thread, NULL, progress_main, t) != 0)) {
    if (t->wake_fd >= 0) close(t->wake_fd);
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->pmu);
    pthread_cond_destroy(&t->cv);
    ucp_worker_destroy(t->worker);
    ucp_cleanup(t->ctx);
    if (t->lctx) ucp_cleanup(t->lctx);
    dp__free(t, sizeof *t);
    return dp__err(err, DP_ENOMEM, "dp_transport_new: cannot start the progress thread");
  }
  *out = t;
  return 0;
}

void dp_transport_free(dp_transport_t *t) {
  if (!t) return;
  /* endpoints and listeners still open */
  for (;;) {
    pthread_mutex_lock(&t->mu);
    dp_listener_t *l = t->lsts;
    pthread_mutex_unlock(&t->mu);
    if (!l) break;
    dp_listener_free(l);
  }
  for (;;) {
    dp_endpoint_t *ep = NULL;
    pthread_mutex_lock(&t->mu);
    ep = t->eps;
    pthread_mutex_unlock(&t->mu);
    if (!ep) break;
    dp_endpoint_free(ep);
  }
  run_cmd(t, CMD_STOP, NULL, NULL);
  if (t->caller) drain_stopped(t);
  else pthread_join(t->thread, NULL);
  ucp_worker_destroy(t->worker);
  ucp_cleanup(t->ctx);
  for (dp_endpoint_t *ep = t->closing, *n; ep; ep = n) {
    n = ep->next;
    ep_free_mem(ep);  /* their close requests went with the worker */
  }
  if (t->lctx) ucp_cleanup(t->lctx);
  if (t->pfd) dp__free(t->pfd, t->pfd_cap * sizeof *t->pfd);
  for (slot_t *sl = t->tx.free, *n; sl; sl = n) n = sl->next, slot_destroy(t, sl);
  for (slot_t *sl = t->rx.free, *n; sl; sl = n) n = sl->next, slot_destroy(t, sl);
  for (int i = 0; i <= DP_DEVICE_INDEX_MAX; i++) {
    dp_stream_free(t->streams[i]);
    dp_stream_free(t->sstreams[i]);
  }
  close(t->wake_fd);
  pthread_mutex_destroy(&t->mu);
  pthread_mutex_destroy(&t->pmu);
  pthread_cond_destroy(&t->cv);
  dp__free(t, sizeof *t);
}

int dp_transport_progress(dp_transport_t *t) { return t && t->caller ? caller_pass(t) : 0; }

static int future_done(void *f) { return dp_future_is_done(f); }

int dp_transport_wait(dp_transport_t *t, dp_future_t *f, int64_t timeout_ns, dp_error_t *err) {
  if (!t || !f) return dp__err(err, DP_EINVAL, "dp_transport_wait: %s is NULL", t ? "f" : "t");
  if (!t->caller) return dp_future_wait(f, timeout_ns, err);
  if (!caller_until(t, future_done, f, timeout_ns))
    return dp__err(err, DP_ETIMEDOUT, "the future did not complete within %lld ns", (long long)timeout_ns);
  return dp_future_wait(f, 0, err);
}

int dp_listener_new(dp_transport_t *t, const char *host_port, dp_listener_t **out, dp_error_t *err) {
  if (!t || !out) return dp__err(err, DP_EINVAL, "dp_listener_new: %s is NULL", t ? "out" : "t");
  *out = NULL;
  cmd_t c;
  memset(&c, 0, sizeof c);
  int rc = parse_addr(host_port, 1, &c.addr, &c.addrlen, err);
  if (rc) return rc;
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
  int yes = l->acc_head != NULL;
  pthread_mutex_unlock(&l->t->mu);
  return yes;
}

int dp_listener_accept(dp_listener_t *l, int64_t timeout_ns, dp_endpoint_t **out, dp_error_t *err) {
  if (!l || !out) return dp__err(err, DP_EINVAL, "dp_listener_accept: %s is NULL", l ? "out" : "l");
  *out = NULL;
  dp_transport_t *t = l->t;
  if (t->caller) caller_until(t, accepted, l, timeout_ns);
  struct timespec dl;
  clock_gettime(CLOCK_MONOTONIC, &dl); /* t->cv's clock */
  if (timeout_ns >= 0) {
    int64_t ns = dl.tv_nsec + timeout_ns % 1000000000;
    dl.tv_sec += (time_t)(timeout_ns / 1000000000 + ns / 1000000000);
    dl.tv_nsec = (long)(ns % 1000000000);
  }
  pthread_mutex_lock(&t->mu);
  int timed_out = t->caller; /* caller-driven: the passes above waited */
  while (!l->acc_head && !timed_out) {
    if (timeout_ns < 0) pthread_cond_wait(&t->cv, &t->mu);
    else timed_out = pthread_cond_timedwait(&t->cv, &t->mu, &dl) == ETIMEDOUT;
  }
  dp_endpoint_t *ep = l->acc_head;
  if (ep) {
    l->acc_head = ep->acc_next;
    if (!l->acc_head) l->acc_tail = NULL;
    ep->acc_next = NULL;
  }
  pthread_mutex_unlock(&t->mu);
  if (!ep) return dp__err(err, DP_ETIMEDOUT, "dp_listener_accept: no connection on port %d in time", l->port);
  *out = ep;
  return 0;
}

void dp_listener_free(dp_listener_t *l) {
  if (!l) return;
  run_cmd(l->t, CMD_UNLISTEN, l, NULL);
  dp__free(l, sizeof *l);
}

int dp_endpoint_connect(dp_transport_t *t, const char *host_port, dp_endpoint_t **out, dp_error_t *err) {
  if (!t || !out) return dp__err(err, DP_EINVAL, "dp_endpoint_connect: %s is NULL", t ? "out" : "t");
  *out = NULL;
  cmd_t *c = dp__alloc(sizeof *c);
  if (!c) return dp__err(err, DP_ENOMEM, "dp_endpoint_connect: out of memory");
  memset(c, 0, sizeof *c);
  int rc = parse_addr(host_port, 0, &c->addr, &c->addrlen, err);
  char name[96];
  snprintf(name, sizeof name, "endpoint to %.80s", host_port ? host_port : "");
  dp_endpoint_t *ep = NULL;
  if (!rc) rc = ep_alloc(t, name, &ep, err);
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

void dp_endpoint_free(dp_endpoint_t *ep) {
  if (!ep) return;
  run_cmd(ep->t, CMD_CLOSE, NULL, ep);
}

int dp_endpoint_error(const dp_endpoint_t *ep, dp_error_t *err) {
  if (!ep) return dp__err(err, DP_EINVAL, "dp_endpoint_error: ep is NULL");
  dp_transport_t *t = ep->t;
  pthread_mutex_lock(&t->mu);
  int rc = ep->error;
  if (rc && err) *err = ep->errinfo;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

static int queue_send(dp_endpoint_t *ep, sop_t *s, dp_future_t **done, dp_error_t *err) {
  dp_transport_t *t = ep->t;
  int rc = dp_endpoint_error(ep, err);
  if (!rc && done) rc = new_future(t, &s->done, err);
  cmd_t *c = rc ? NULL : dp__alloc(sizeof *c);
  if (!rc && !c) rc = dp__err(err, DP_ENOMEM, "transport: out of memory");
  if (rc) {
    sop_free(s);
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
  if (!ep || !done) return dp__err(err, DP_EINVAL, "dp_endpoint_send: %s is NULL", ep ? "done" : "ep");
  *done = NULL;
  sop_t *s = sop_new(SOP_VALUE);
  if (!s) return dp__err(err, DP_ENOMEM, "dp_endpoint_send: out of memory");
  int rc = dp_frame_new(&s->frame, err);
  if (!rc) rc = dp_pickle(v, NULL, s->frame, err);
  if (!rc) rc = sop_plan(ep->t, s, err);
  if (!rc) rc = sop_after(ep->t, s, err);
  if (rc) {
    sop_free(s);
    return rc;
  }
  s->value = dp_value_retain(v);
  return queue_send(ep, s, done, err);
}

int dp_endpoint_send_future(dp_endpoint_t *ep, dp_future_t *f, dp_future_t **done, dp_error_t *err) {
  if (!ep || !f || !done)
    return dp__err(err, DP_EINVAL, "dp_endpoint_send_future: %s is NULL", !ep ? "ep" : !f ? "f" : "done");
  *done = NULL;
  sop_t *s = sop_new(SOP_FUTURE);
  if (!s) return dp__err(err, DP_ENOMEM, "dp_endpoint_send_future: out of memory");
  s->src = dp_future_retain(f);
  return queue_send(ep, s, done, err);
}

int dp_endpoint_send_frame(dp_endpoint_t *ep, const void *bytes, size_t n, dp_future_t **done, dp_error_t *err) {
  if (!ep || !bytes || !done)
    return dp__err(err, DP_EINVAL, "dp_endpoint_send_frame: %s is NULL", !ep ? "ep" : !bytes ? "bytes" : "done");
  *done = NULL;
  dp_frame_info_t info;
  int rc = dp_frame_check(bytes, n, &info, err);
  if (rc) return rc;
  if (info.nbuffers && !(info.flags & 1u))
    return dp__err(err, DP_EINVAL, "dp_endpoint_send_frame: the frame's %u buffers are not inline", info.nbuffers);
  sop_t *s = sop_new(SOP_FRAME);
  if (!s || !(s->bytes = dp__alloc(n ? n : 1))) {
    if (s) dp__free(s, sizeof *s);
    return dp__err(err, DP_ENOMEM, "dp_endpoint_send_frame: out of memory");
  }
  memcpy(s->bytes, bytes, n);
  s->bytes_cap = n ? n : 1;
  s->nbytes = n;
  return queue_send(ep, s, done, err);
}

static int recv_common(dp_endpoint_t *ep, int frame, dp_future_t **out, dp_error_t *err) {
  if (!ep || !out) return dp__err(err, DP_EINVAL, "dp_endpoint_recv: %s is NULL", ep ? "out" : "ep");
  *out = NULL;
  dp_transport_t *t = ep->t;
  rwait_t *w = dp__alloc(sizeof *w);
  cmd_t *c = dp__alloc(sizeof *c);
  int rc = (!w || !c) ? dp__err(err, DP_ENOMEM, "dp_endpoint_recv: out of memory") : 0;
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
  sop_t *s = sop_new(SOP_RAW);
  if (!s) return dp__err(err, DP_ENOMEM, "out of memory");
  s->raw_id = am_id;
  s->raw_hdr = dp__alloc(hlen ? hlen : 1);
  s->raw_hlen = hlen ? hlen : 1;
  s->bytes = dp__alloc(n ? n : 1);
  s->bytes_cap = n ? n : 1;
  s->nbytes = n;
  if (!s->raw_hdr || !s->bytes) {
    sop_free(s);
    return dp__err(err, DP_ENOMEM, "out of memory");
  }
  if (hlen) memcpy(s->raw_hdr, hdr, hlen);
  s->raw_len_hdr = hlen;
  s->raw_hlen = hlen ? hlen : 1;
  if (n) memcpy(s->bytes, data, n);
  return queue_send(ep, s, NULL, err);
}
