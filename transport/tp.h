/* transport/tp.h — the transport's objects and the functions its files
 * share (transport.c: commands, endpoints, their failure, the API; slots.c:
 * where buffers go, staging and same-host slots; lane.c: same-host lanes;
 * send.c; recv.c; loop.c: the progress loop, by a thread or the caller).
 * Private: not installed. The wire and the test hooks: internal.h. */
#ifndef DP_TRANSPORT_TP_H
#define DP_TRANSPORT_TP_H

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
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
#include "../core/table.h"
#include "../cache/internal.h"
#include "../device/internal.h"
#include "devpickle/transport.h"
#include "internal.h"
#include "shm.h"

/* ---- objects ---- */

#define DP__CLOSE_WAIT_NS 1000000000ll
#define DP__OFFER_NS 2000000000ll /* an offer's name (slots, lanes) goes unanswered after it */

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
#define AM_IDS 11
#define AM_STRAY 0u /* the handler of every id the protocol does not use (dp__tp_set_handlers) */
typedef struct amh {
  dp_transport_t *t;
  unsigned id;
  dp_endpoint_t *ep;
} amh_t;

/* A lane's state: none; the connector's offer sent (WAIT); the acceptor's
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
  sop_t *prev;              /* on its endpoint's `posted` (doubly linked: a send leaves it in O(1)) */
  dp_transport_t *t;
  dp_endpoint_t *ep;        /* NULL once the endpoint let go of it */
  int kind;
  dp_value_t value;         /* retained (SOP_VALUE, SOP_FUTURE once ready) */
  dp_future_t *src;         /* SOP_FUTURE */
  struct dp__note *note;    /* SOP_FUTURE: src's completion wakes the loop (no polling for it) */
  dp_future_t *done;
  dp_frame_t *frame;        /* SOP_VALUE / SOP_FUTURE */
  uint8_t *bytes;           /* SOP_FRAME / SOP_RAW: our copy */
  size_t nbytes, bytes_cap;
  uint8_t *raw_hdr;         /* SOP_RAW */
  size_t raw_hlen, raw_len_hdr;
  unsigned raw_id;
  uint64_t seq;
  uint64_t buf_bytes;       /* its buffers' bytes (the frame message says so) */
  uint64_t cost;            /* what counts against the in-flight bound: buf_bytes, and
                               the frame when it goes by rendezvous */
  uint64_t charge;          /* against the peer's credit: its frame's bytes and its buffers' */
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
  dp_storage_t *storage;    /* the message's reference (its value holds its own): the
                               bytes arrive there until the message is freed */
  void *dst;
  uint64_t nbytes;
  dp_device_t dev;
  int staged;               /* dst is device memory: bytes go through a slot */
} rbuf_t;

/* Why a received message was refused, as long as its message is: a
 * refused message waits for its receive holding this, and a whole
 * dp_error_t (2 KiB of message buffer) made values nobody took, a hostile
 * peer's refused ones, hold ~7 times their credit. */
typedef struct rerr {
  int code, backend_code;
  int64_t offset;
  char message[]; /* NUL-terminated */
} rerr_t;

#define DP__RERR_SIZE(len) (offsetof(rerr_t, message) + (len) + 1)

struct rmsg {
  rmsg_t *next;
  uint64_t seq;
  uint32_t nbuf;
  uint64_t next_index;      /* next buffer index expected on the wire */
  uint64_t next_off;        /* and its next byte (chunked buffers) */
  uint64_t buf_bytes;
  uint64_t held;            /* what it counts in its endpoint's held: buffers, and the
                               frame when it came by rendezvous */
  uint64_t charge;          /* its frame's bytes and its buffers', as the FRAME header
                               says: credit given back once it is taken */
  rbuf_t *bufs;
  dp_value_t value;
  uint8_t *frame_copy;      /* for recv_frame, and the frame of a value read only when
                               delivered (deferred) */
  size_t frame_len;
  size_t pending;           /* rendezvous receives in flight */
  int failed;               /* the message is refused: its buffers are drained */
  int answered;             /* failed, and its receive already told so: kept only to absorb its buffers */
  int ready_counted;        /* counted in dp__transport_ready_unclaimed */
  int deferred;             /* a frame queued behind others, or for a frame receive: kept
                               as its bytes (frame_copy), its buffers bound, and read as
                               it is delivered, so that values nobody took hold their
                               frames' bytes, not the memory of their values (recv.c,
                               on_frame) */
  uint64_t got;             /* bytes of its buffers' messages received so far */
  rerr_t *error;            /* why it is refused (failed; NULL: out of memory for it) —
                               apart, so that a message holds ~160 bytes, not ~2 KiB */
  int detached;             /* the endpoint let go; free when pending == 0 */
  int64_t deadline;         /* opts.timeout_ns: its buffers owed and none arriving past it fails
                               the endpoint (0: none); each piece that arrives restarts it */
};

struct inbox {
  unsigned id;
  uint64_t hdr[(sizeof(dp__am_shm_piece_t) > sizeof(dp__am_frame_hdr_t) ? sizeof(dp__am_shm_piece_t)
                                                                           : sizeof(dp__am_frame_hdr_t)) / 8];
  size_t hlen;
  void *data;               /* rendezvous: UCX's descriptor; eager: a copy of the data (len bytes) */
  ucp_worker_h w;           /* the worker it came from (the lane's, or the transport's) */
  size_t len;
  int rndv;
};

/* Parked messages of one kind: a binary min-heap in the sender's order
 * (recv.c, "parked messages"). */
typedef struct park {
  inbox_t **v;
  size_t n, cap;
} park_t;

typedef struct rwait {
  struct rwait *next;
  dp_future_t *f;
  int frame;                /* recv_frame */
} rwait_t;

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
  int detached;             /* nobody waits for it (an endpoint's close_cmd, from a callback) */
  dp_error_t err;
};

struct dp_endpoint {
  dp_transport_t *t;
  dp_endpoint_t *next;      /* the transport's list */
  ucp_ep_h ep;
  char name[96];
  /* shared, under t->mu */
  int error;
  dp_error_t errinfo;
  int free_asked;           /* dp_endpoint_free was called: later calls, from callbacks its close
                               runs (or ran), only wait for that close */
  size_t kept;              /* failed by the peer's close: values received first, not yet taken */
  /* the progress thread's */
  sop_t *sq_head, *sq_tail; /* sends, in order: unposted ones wait here */
  sop_t *posted;            /* posted and not complete, newest first; */
  sop_t *posted_tail;       /* ... its oldest, whose deadline is the earliest (check_timeouts) */
  sop_t *posting;           /* on `posted`, its buffers not all posted yet */
  uint64_t send_seq;
  uint64_t inflight;
  size_t nsends;
  rmsg_t *rq_head, *rq_tail;/* messages being received, in order */
  rmsg_t *cur;              /* the one whose buffers arrive now */
  uint64_t recv_seq;
  uint64_t held;            /* received bytes not yet taken: buffers, rendezvous frames */
  /* credit (internal.h, CREDIT): bytes of values since the connection began */
  uint64_t credit_sent;     /* sending: posted */
  uint64_t credit_limit;    /* sending: the peer's last grant */
  int64_t credit_wait;      /* sending: since when the queue's head waits for a grant
                               (0: it does not; a grant restarts the clock) */
  uint64_t credit_in;       /* receiving: arrived (their FRAME messages) */
  uint64_t credit_top;      /* receiving: 1 + the highest sequence number arrived (0: none) */
  uint64_t credit_top_charge; /* receiving: that value's charge */
  uint64_t credit_taken;    /* receiving: taken (delivered, or refused and drained) */
  uint64_t credit_granted;  /* receiving: the grant last sent */
  park_t parked_frames;     /* parked messages: frames, */
  park_t parked_pieces;     /* and buffers' pieces (BUFS, SHM_PIECE) */
  size_t nparked;           /* in both */
  uint64_t parked_bytes;    /* what they hold (recv.c, park_cost; at most t->max_parked) */
  struct fpull *fpull;      /* a rendezvous frame being pulled (one at a time) */
  struct absorb *absorb;    /* refused messages passed by their next frame, whose buffers may still come */
  size_t nabsorb;
  rwait_t *w_head, *w_tail;
  void *close_req;
  unsigned tx_used;         /* send slots its pieces hold */
  int shm_state;            /* SHM_*: this side's offer of a segment */
  seg_t *seg;               /* offered, then used (SHM_YES) */
  dp__shm_t *rshm;          /* the peer's segment, mapped */
  int peer_offered;         /* the peer made its offer (once) */
  int offer_pending;        /* ... kept in offer_in, to be mapped and answered from the loop */
  dp__am_shm_offer_t offer_in;
  int64_t offer_deadline;   /* SHM_OFFERED: withdrawn unanswered after it */
  uint64_t offer_token;     /* a late answer to a withdrawn offer is ignored */
  ctl_t *ctl_head, *ctl_tail;  /* control messages to send */
  dp_endpoint_t *acc_next;  /* a listener's queue of accepted endpoints */
  int queued;               /* in that queue (not taken by dp_listener_accept): under mu */
  int dead;                 /* failed: UCX ep closed or closing */
  int need_close;           /* failed inside a UCX callback: close from the loop */
  int established;          /* the peer answered once */
  int acceptor;             /* accepted on a listener (else connected) */
  int accepted;             /* the connector: the peer's ACCEPT came */
  cmd_t close_cmd;          /* dp_endpoint_free from a callback the loop runs queues this one */
  int64_t born;             /* the connector: when it connected (timeout_ns counts from there) */
  int peer_local;           /* the peer's address is one of this host's: only then are
                               shared-memory offers (slots, lane) made to it or taken from it */
  unsigned rndv_inflight;   /* rendezvous receives posted on its connection, not yet done */
  int64_t pull_deadline;    /* with timeout_ns, while rendezvous receives are posted: none of them
                               completed since then (set as the first is posted and as one completes) */
  int64_t close_deadline;   /* need_close: closed then even with receives in flight */
  /* the same-host lane (internal.h): a worker of its own and an endpoint
     without error handling; the connection reports the peer's failure */
  int lane;                 /* LANE_*: WAIT, the connector's offer sent, no answer yet */
  ucp_worker_h dw;
  int dw_fd;
  ucp_ep_h dep;             /* the connector's own; the acceptor's is UCX's reply endpoint */
  int64_t hello_deadline;   /* LANE_HELLO: given up after it */
  char lane_name[DP__SHM_NAME_MAX]; /* the acceptor: the file of the connector's offer, to read from the loop */
  uint64_t lane_token;
  size_t lane_addr_len;     /* the address's length in it */
  int lane_tried;           /* the acceptor: an offer came (one an endpoint) */
  dp__shm_t *lane_file;     /* the connector: its offer's file, until answered */
  int64_t lane_deadline;    /* the connector: its offer's name goes after it */
  int lane_drop;            /* the connector: refused; its worker goes from the loop */
  amh_t lamh[AM_IDS];       /* the lane's worker's handlers' arguments */
  amh_t lstray;             /* and that of its every other id */
  int indexed;              /* in t->ep_index */
  /* graceful close (internal.h, CLOSE) */
  int peer_closed;          /* the peer's CLOSE came: */
  uint64_t peer_sent;       /* ... the values it counts */
  int keep_received;        /* failed by the peer's close: the values it received first stay to be taken */
  int close_gently;         /* its UCX endpoint is flushed, not forced, when it goes (the answer leaves) */
  int64_t answer_deadline;  /* closing: its CLOSE sent, the UCX endpoint closed on the answer or then */
  int answered;             /* closing: the answer came */
};

struct dp_listener {
  dp_transport_t *t;
  dp_listener_t *next;
  ucp_listener_h l;
  int port;
  dp_endpoint_t *acc_head, *acc_tail; /* under t->mu */
  int closed;
  int waiters;  /* threads waiting in dp_listener_accept (under t->mu): its free waits for them to leave */
  int orphaned; /* freed from a callback of a caller's pass while some waited: the last to leave frees it */
};

enum { CMD_LISTEN, CMD_UNLISTEN, CMD_CONNECT, CMD_SEND, CMD_RECV, CMD_CLOSE, CMD_STOP, CMD_SYNC };


/* The loop's wake-up, the transport's eventfd (wake_fd), shared with the
 * futures that sends wait for: a future completing on any thread rings it
 * while the loop sleeps, whether or not the transport is still there (the
 * eventfd closes with the last reference). rings counts the futures' rings,
 * so that a pass can tell that one completed while it ran (transport.c,
 * loop.c). */
struct dp__waker {
  _Atomic uint32_t refs;
  _Atomic unsigned long rings;
  int fd;
};

struct dp_transport {
  ucp_context_h ctx;
  ucp_worker_h worker;
  pthread_t thread;
  int wake_fd, worker_fd; /* wake_fd: waker->fd */
  /* the eventfd's owner: the transport holds a reference, and so does the
     notification of each future a dp_endpoint_send_future waits for, until
     that future completes or the send ends */
  struct dp__waker *waker;
  unsigned long rings_seen; /* waker->rings as a pass began (dp__tp_pass) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  cmd_t *c_head, *c_tail;
  dp_endpoint_t *eps;           /* the progress thread's */
  dp_endpoint_t *closing;       /* closing: freed once UCX let go */
  dp_listener_t *lsts;
  dp_endpoint_t *last_ep;       /* reply_ep cache */
  /* The endpoints whose UCX endpoint exists, found by it (dp__tp_ep_find):
     every message names its endpoint so, and a peer controls how many there
     are (connections accepted and not yet taken included): a walk of the
     list cost each message one step per endpoint. The loop's only. */
  dp__table_t ep_index;
  dp_endpoint_t **ep_items;     /* the table's items */
  size_t ep_items_cap;
  uint64_t max_inflight;
  uint64_t max_parked;          /* an endpoint's parked data: its credit window plus DP__PARKED_SLACK */
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
  amh_t stray;                  /* the argument of the handler of every other id */
  ucp_context_h lctx;           /* same-host lanes' (shared memory only); NULL: no lanes */
  struct pollfd *pfd;           /* the loop's descriptors while it sleeps */
  size_t pfd_cap;
  piece_t *orphans;             /* pieces of failed sends whose copies run */
  size_t nreq;                  /* UCX requests not yet complete: the worker outlives them */
  int stop;
  int nested;                   /* caller-driven: a command run alone from a callback of a pass (dp__tp_run_now) */
  _Atomic int freeing;          /* dp_transport_free has begun: no endpoint may be made any more */
  int64_t hurry;                /* stopping: every close still waiting is forced by then (drain_stopped) */
  int sleeping;                 /* under mu: the thread sleeps in poll; commands must wake it */
  int64_t last_check;           /* timeouts last checked */
  unsigned yield_every;         /* idle passes between yields: 1 where cores are few */
  _Atomic int queued;           /* commands may be queued (set under mu; read without) */
  int caller;                   /* DP_TRANSPORT_PROGRESS_CALLER: no thread; passes under pmu */
  unsigned nlanes;              /* lane workers alive (DP__LANES_MAX at most) */
  /* The connections' worker's progress polls its TCP interface (a system
   * call) however idle it is: while every live endpoint has its lane on
   * (small messages go there) and that worker did nothing at its last
   * progress, a pass progresses it only every DP__MAIN_EVERY passes. */
#define DP__MAIN_EVERY 32u
  int lanes_all;                /* every live endpoint had its lane on at the last pass */
  int main_idle;                /* the last progress of the worker found nothing */
  unsigned main_skipped;        /* passes since the worker's last progress */
  _Atomic unsigned ncommands;   /* caller-driven: commands queued (a whole pass every 16th) */
  pthread_mutex_t pmu;
  unsigned forks;               /* dp__tp_forks when it was made: another value, a forked child */
  long pid;                     /* the process that made it (for the child's error) */
};

/* A close's deadline `at`, or the transport's hurry when that is sooner
 * (dp__tp_drain_stopped: the worker is about to go). */
static inline int64_t dp__tp_by_hurry(const dp_transport_t *t, int64_t at) {
  return t->hurry && at > t->hurry ? t->hurry : at;
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

static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* now + the transport's timeout_ns, saturated (a huge timeout is no
 * timeout, never a deadline in the past); 0 without one. */
static inline int64_t dp__tp_deadline(const dp_transport_t *t) {
  if (t->timeout_ns <= 0) return 0;
  int64_t now = now_ns();
  return t->timeout_ns > INT64_MAX - now ? INT64_MAX : now + t->timeout_ns;
}

/* The transport whose pass this thread runs (caller-driven progress). */
extern _Thread_local dp_transport_t *dp__tp_in_pass;

/* What the files call of each other (each documented where it is defined). */

/* transport.c */
void dp__tp_cmd_finish(dp_transport_t *t, cmd_t *c, int rc);
int dp__tp_queue_cmd(dp_transport_t *t, cmd_t *c); /* 1: the progress thread was asleep */
void dp__tp_sop_free(sop_t *s);
void dp__tp_sop_fail(sop_t *s, const dp_error_t *e);
void dp__tp_rmsg_free(rmsg_t *m);
void dp__tp_inbox_drop(dp_endpoint_t *ep, inbox_t *b);
/* The test hook dp__transport_fail_in_rndv (internal.h), after a release or a pull. */
void dp__tp_rndv_hook(dp_endpoint_t *ep);
/** Releases a rendezvous descriptor not received (ucp_am_data_release),
 *  but for the one UCX's callback on this thread was handed: UCX drops that
 *  one itself when the callback returns UCS_OK, which it then must. */
void dp__tp_rndv_release(ucp_worker_h w, void *data);
void dp__tp_ep_drop_received(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_ep_fail(dp_endpoint_t *ep, const dp_error_t *e);
void dp__tp_ep_cancel_recvs(dp_endpoint_t *ep, const dp_error_t *e);
void dp__tp_ep_force_close(dp_endpoint_t *ep);
void dp__tp_ep_failf(dp_endpoint_t *ep, int code, const char *fmt, const char *detail);
void dp__tp_ep_fail_status(dp_endpoint_t *ep, ucs_status_t st);
void dp__tp_ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t st);
int dp__tp_ep_alloc(dp_transport_t *t, const char *name, dp_endpoint_t **out, dp_error_t *err);
void dp__tp_ep_link(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_ep_unlink(dp_transport_t *t, dp_endpoint_t *ep);
dp_endpoint_t *dp__tp_ep_find(dp_transport_t *t, ucp_ep_h uep);
int dp__tp_ep_index(dp_transport_t *t, dp_endpoint_t *ep);

/* slots.c */
int dp__tp_buf_mode(const dp_transport_t *t, dp_device_t dev);
int dp__tp_refused(const dp_transport_t *t, dp_device_t dev, uint64_t i, dp_error_t *err);
int dp__tp_cpu_alloc(dp_device_t dev, uint64_t n, dp_storage_t **out, void **dst, dp_error_t *err);
int dp__tp_own_stream(dp_transport_t *t, dp_stream_t **tab, dp_device_t dev, int current, dp_stream_t **out,
                      dp_error_t *err);
int dp__tp_dev_alloc(dp_transport_t *t, dp_device_t dev, uint64_t n, dp_storage_t **out, void **dst, dp_error_t *err);
int dp__tp_slot_get(dp_transport_t *t, pool_t *pool, size_t n, int heap_ok, slot_t **out, dp_error_t *err);
void dp__tp_slot_destroy(dp_transport_t *t, slot_t *sl);
void dp__tp_slot_put(dp_transport_t *t, pool_t *pool, slot_t *sl);
int dp__tp_slot_mark(dp_transport_t *t, slot_t *sl, dp_stream_t *s, dp_error_t *err);
void dp__tp_ctl_queue_data(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data, size_t n);
void dp__tp_ctl_queue(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen);
ucs_status_ptr_t dp__tp_lane_send(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                                  size_t n, const ucp_request_param_t *p);
ucs_status_ptr_t dp__tp_am_send(dp_endpoint_t *ep, unsigned id, const void *hdr, size_t hlen, const void *data,
                                size_t n, const ucp_request_param_t *p);
void dp__tp_ctl_flush(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_shm_offer(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_shm_answer(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_shm_withdraw(dp_endpoint_t *ep);
void dp__tp_ep_drop_shm(dp_transport_t *t, dp_endpoint_t *ep);
/* lane.c */
ucs_status_t dp__tp_set_handlers(ucp_worker_h w, amh_t *amh, amh_t *stray, dp_transport_t *t, dp_endpoint_t *ep);
ucs_status_t dp__tp_new_worker(ucp_context_h ctx, ucp_worker_h *w, int *fd);
void dp__tp_lane_connect(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_lane_offer(dp_transport_t *t, dp_endpoint_t *ep);
int dp__tp_addr_is_local(const struct sockaddr_storage *addr);
const char *dp__tp_addr_not_unicast(const struct sockaddr_storage *addr);
void dp__tp_lane_file_drop(dp_endpoint_t *ep);
void dp__tp_lane_worker_free(dp_endpoint_t *ep);
void dp__tp_lane_hello(dp_endpoint_t *ep);
void dp__tp_lane_close(dp_endpoint_t *ep);
void dp__tp_ep_free_mem(dp_endpoint_t *ep);
void dp__tp_on_conn(ucp_conn_request_h req, void *arg);
/* send.c */
void dp__tp_sent(sop_t *s, ucs_status_t st);
int dp__tp_sop_plan(dp_transport_t *t, sop_t *s, dp_error_t *err);
int dp__tp_sop_after(dp_transport_t *t, sop_t *s, dp_error_t *err);
int dp__tp_ep_pump_sends(dp_transport_t *t, dp_endpoint_t *ep);
/* recv.c */
void dp__tp_deliver(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_shm_done(dp_endpoint_t *ep, uint64_t slot);
int dp__tp_post_recv(dp_transport_t *t, rctx_t *c, void *data);
void dp__tp_ep_pump_inbox(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_peer_close_check(dp_transport_t *t, dp_endpoint_t *ep);
void dp__tp_absorb_free(dp_endpoint_t *ep);
void dp__tp_park_drop(dp_transport_t *t, dp_endpoint_t *ep, int release);
ucs_status_t dp__tp_am_cb(void *arg, const void *hdr, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param);
/* loop.c */
int dp__tp_drain_cmds(dp_transport_t *t);
void dp__tp_run_now(dp_transport_t *t, cmd_t *c);
int dp__tp_pass(dp_transport_t *t, int *polling_out);
int dp__tp_caller_pass(dp_transport_t *t);
void dp__tp_caller_commands(dp_transport_t *t);
int dp__tp_caller_until(dp_transport_t *t, int (*done)(void *), void *arg, int64_t timeout_ns);
int dp__tp_driven_here(const dp_transport_t *t);
void dp__tp_drain_stopped(dp_transport_t *t);
void *dp__tp_progress_main(void *arg);

#endif
