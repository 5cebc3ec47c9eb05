/* transport/internal.h — the transport's private interface (the wire, test hooks). */
#ifndef DP_TRANSPORT_INTERNAL_H
#define DP_TRANSPORT_INTERNAL_H

#include <stdatomic.h>

#include "devpickle/transport.h"

/* The wire (docs/TRANSPORT.md). Active-message ids and headers, written in
 * the host's byte order: both ends are little-endian x86-64/aarch64 today. */
#define DP__AM_FRAME 0x44500u
#define DP__AM_BUFS 0x44501u
#define DP__WIRE_MAGIC 0x32545044u /* "DPT2" (DPT1 charged no DP__CREDIT_PER_VALUE) */

typedef struct dp__am_frame_hdr {
  uint32_t magic;
  uint32_t nbuffers;   /* out-of-band buffers that follow (0 for inline frames) */
  uint64_t seq;        /* per endpoint and direction, from 0 */
  uint64_t frame_len;  /* bytes of the frame (the message's data) */
  uint64_t buf_bytes;  /* total bytes of the buffers that follow */
} dp__am_frame_hdr_t;

typedef struct dp__am_bufs_hdr {
  uint32_t magic;
  uint32_t count;      /* buffers first .. first + count - 1, packed in order */
  uint64_t seq;
  uint64_t first;
  uint64_t total;      /* bytes of the message's data */
  uint64_t offset;     /* count == 1: where in buffer `first` the data goes; else 0 */
  uint64_t size;       /* count == 1: buffer `first`'s size (its last chunk ends there); else 0 */
} dp__am_bufs_hdr_t;

/* Buffers up to this size are packed into one message of up to
 * DP__BATCH_BYTES (one copy on each side); larger ones go alone, from and
 * into the storage itself, by rendezvous. */
#define DP__SMALL_BUFFER (64u << 10)
#define DP__BATCH_BYTES (256u << 10)

/* A FRAME message of up to this many bytes goes eagerly; a larger one by
 * rendezvous, so that its bytes stay with the sender until the receiver,
 * under its in-flight bound, pulls them. */
#define DP__FRAME_EAGER_MAX DP__SMALL_BUFFER

/* STAGING. Device memory the host cannot address (cuda) moves through
 * page-locked host buffers ("slots") of DP__STAGE_CHUNK bytes: the sender
 * copies a chunk of a buffer (or a packed run of small buffers of one
 * device) into a slot on its send stream of that device, polls the copy's
 * event and sends the slot; the receiver receives into a slot of its own
 * and copies it to the buffer on its receive stream. Chunk k + 1 is copied
 * while chunk k is on the wire, on both sides. The sender holds at most
 * DP__STAGE_SLOTS slots (copies ahead of the wire); the receiver's slots
 * come back as their copies complete. */
#define DP__STAGE_CHUNK (4u << 20)
#define DP__STAGE_SLOTS 16u

/* SAME-HOST SLOTS. A sender offers its peer a shared-memory segment of
 * DP__STAGE_SLOTS slots (OFFER); a peer that maps it answers REPLY 1, else
 * 0. From then on the sender's pieces are copied into that segment and only
 * announced (SHM_PIECE: a buffers header and the slot; no data); the
 * receiver copies them to the device straight out of its mapping and gives
 * each slot back (DONE) once that copy has completed. Control messages
 * (OFFER, REPLY, DONE) are handled on arrival, outside the ordered stream;
 * SHM_PIECE is ordered as BUFS is. */
#define DP__AM_SHM_OFFER 0x44502u
#define DP__AM_SHM_REPLY 0x44503u
#define DP__AM_SHM_PIECE 0x44504u
#define DP__AM_SHM_DONE 0x44505u

typedef struct dp__am_shm_offer {
  uint32_t magic;
  uint32_t nslots;
  uint64_t slot_bytes;  /* DP__STAGE_CHUNK */
  uint64_t token;       /* also in the segment's header */
  char name[64];        /* NUL-terminated */
} dp__am_shm_offer_t;

typedef struct dp__am_shm_ctl {
  uint32_t magic;
  uint32_t value;       /* REPLY: 1 mapped, 0 not; DONE: the slot */
  uint64_t token;       /* REPLY: the offer's */
} dp__am_shm_ctl_t;

typedef struct dp__am_shm_piece {
  dp__am_bufs_hdr_t b;  /* as BUFS; the data is in the slot */
  uint64_t slot;
} dp__am_shm_piece_t;

/* SAME-HOST LANE. UCX 1.13 puts no shared-memory transport on an endpoint
 * that asks for the peer's failure to be reported (UCP_ERR_HANDLING_MODE_PEER),
 * and the connection-manager endpoint must ask for it. So an endpoint of a
 * pair on one host also gets a worker of its own on a context limited to
 * shared memory and an endpoint without error handling between those two
 * workers (the lane). The connector writes its lane worker's address into a
 * file of its own (shm.h) and offers it (LANE_ADDR: a ctl header, value =
 * the address's length, token = the file's; the file's name as data); the
 * acceptor reads the address from that file only if it is its own user's,
 * 0600, with that token, makes an endpoint to it and sends LANE_HELLO value
 * 1 on it once wired, or value 0 on the connection. A message of at most
 * DP__LANE_MAX bytes (header and data) then goes on the lane when UCX
 * takes it at once (one element of the peer's queue, which has room); any
 * other on the connection, whose failure stays the endpoint's failure. The
 * receiver orders both by sequence, as it does anyway. The lane never
 * holds a request: UCX 1.13 cannot fail the requests of an endpoint
 * without error handling, nor close one by force, when its peer dies. */
#define DP__AM_LANE_ADDR 0x44506u
#define DP__AM_LANE_HELLO 0x44507u
/* ACCEPT (a control header, value 0): the acceptor's first message, sent as
 * it accepts, so that a connector that only receives learns its connection
 * was established — with opts.timeout_ns, one that hears nothing from its
 * peer in that time fails (the peer never accepted). */
#define DP__AM_ACCEPT 0x44508u
/* CREDIT (a control header, value 0, token = the limit): the receiver's
 * grant. A value costs its frame's bytes plus its buffers' (its FRAME
 * header's frame length and buf_bytes) plus DP__CREDIT_PER_VALUE, what a
 * received value holds however small (its message and its error), counted
 * from the connection's
 * start; the sender posts a value only while the values it sent before it
 * stay below the grant's limit (so the last one may cross it: one value
 * larger than the window still goes). Both ends start from
 * DP__CREDIT_INITIAL without a message; a receiver grants — limit = what it
 * took plus its window, max(its in-flight bound, DP__CREDIT_INITIAL) — as
 * the first value arrives, and again whenever at most half the window is
 * left. A grant below one already had is ignored; value other than 0 fails
 * the endpoint, as does a value that arrives past the limit: the values
 * arrived, less the one latest in the sender's order, reach it (frames
 * arrive out of order, a small one on the same-host lane beside a large
 * one on the connection: the values before the latest are all the sender
 * counted when it posted that one). */
#define DP__AM_CREDIT 0x44509u
#define DP__CREDIT_INITIAL (1ull << 20)
#define DP__CREDIT_PER_VALUE 256u
/* CLOSE (a control header, on the connection): value 0, token = the values
 * (FRAME messages) this side sent on the endpoint, is a graceful close's
 * last message, sent before the UCX endpoint is flushed and closed; the
 * peer, once it has received every value it counts (they may arrive after
 * it: lanes, parking), fails its endpoint with DP_ECANCELED, "the peer
 * closed its endpoint" — its pending receives and sends at once, later
 * calls the same way, values it received first still taken in order — and
 * answers value 1 (token: the values it received). The closer closes its
 * UCX endpoint on that answer, or after DP__CLOSE_WAIT_NS without one, so
 * that UCX's disconnect cannot overtake the values it sent. A CLOSE that
 * reaches an endpoint closing itself is that endpoint's answer (both
 * closed at once). A second CLOSE, one on a lane, one counting fewer values
 * than arrived (parked ones included), an answer to a live endpoint, a value
 * beyond the count (as it arrives, or still parked once the counted ones
 * are in) or another `value` fails the endpoint (DP_EFORMAT). */
#define DP__AM_CLOSE 0x4450Au
/* Parked messages (recv.c) hold at most an endpoint's window plus this
 * much of the receiver: a cooperating peer parks at most its credit (the
 * window) plus one value's eager messages; one that sends pieces of values
 * it never frames, or frames far ahead, fails the endpoint (DP_ELIMIT)
 * instead of growing the receiver by up to 64 KiB a message. A parked
 * message is charged what it holds: its entry and its eager data copied,
 * or, sent by rendezvous, the descriptor UCX keeps of it
 * (DP__PARKED_RNDV_HOLD: measured ~1.1 KiB in UCX 1.13) — charged nothing,
 * a million of them held ~1.2 GB under the count alone. */
#define DP__PARKED_SLACK (64ull << 20)
#define DP__PARKED_RNDV_HOLD 1152u
#define DP__LANE_MAX 1024u
#define DP__LANE_ELEM "1152" /* bytes of a lane queue's element (UCX's FIFO_ELEM_SIZE) */
#define DP__LANE_ADDR_MAX 4096u
#define DP__HELLO_NS 1000000000ll /* a lane not wired in 1 s is given up */
#define DP__LANES_MAX 32u         /* lanes a transport has at once; more endpoints stay on their connections */

/* ---- test hooks (never set in production) ---- */
/** 1: send_future reads the buffers as soon as the future completes,
 *  WITHOUT waiting for its events, and dp_endpoint_send's staging copies
 *  do not wait for the caller's streams (the ordering tests' negative
 *  controls). */
extern int dp__transport_skip_events;
/** 1: the sender ignores its peer's credit (the receiver's check of it is
 *  then tested). */
extern int dp__transport_skip_credit;
/** N > 0: the Nth message the sender posts afterwards (counted down by each
 *  post) fails its endpoint from inside the post, as UCX does when a
 *  connection reports its failure within ucp_am_send_nbx (the peer died),
 *  the post itself going through. */
extern _Atomic int dp__transport_fail_in_post;
/** N > 0: the Nth parked rendezvous message the receiver releases, or
 *  rendezvous data it pulls, afterwards (counted down by each) fails its
 *  endpoint from inside that call, as UCX does when the message the call
 *  sends (the answer, the request for the data) finds the connection
 *  failed: it calls the endpoint's error callback within
 *  ucp_am_data_release or ucp_am_recv_data_nbx. */
extern _Atomic int dp__transport_fail_in_rndv;
/** 1: host:N memory is staged as cuda memory is (it is host memory, read
 *  and written directly otherwise), so that the staging path runs on a
 *  machine without a GPU. Set it on both ends. */
extern int dp__transport_stage_host;
/** 1: this process's receivers drop the peer's offers (same-host slots,
 *  a lane) unanswered, as a peer that does not know them does: a test of
 *  the offerer's withdrawal sets it in its peer, whose answers would
 *  otherwise race the test's look at the offers' names. */
extern int dp__transport_mute_offers;
/** Called (when set) by a caller-driven dp_listener_accept between the
 *  passes that saw a connection queued and taking it: a test widens there
 *  the window in which another accepting thread takes it first. */
extern void (*dp__transport_accept_gap)(void);
/** Threads waiting in dp_listener_accept on l now (registered: a free of l
 *  from now on ends their waits with DP_ECANCELED): a test waits for its
 *  accepting threads to be there instead of sleeping and hoping they are. */
int dp__listener_waiters(dp_listener_t *l);
/** Passes of the loop in which a staged send of this process found every
 *  send slot its endpoint may use taken (tests read it: the state a test of
 *  that wait must reach first). */
extern _Atomic unsigned long dp__transport_slot_waits;
/** Offers of same-host slots of this process that their peers accepted
 *  (tests read it: a test that needs its values to go through the slots
 *  waits for the answer). */
extern _Atomic unsigned long dp__transport_shm_accepted;
/** Frames this process's receivers took in order (tests read it: the
 *  values that arrived, whatever their buffers or the memory they hold). */
extern _Atomic unsigned long dp__transport_frames_in;
/** Peers' CLOSE messages this process's receivers accepted (tests read it:
 *  a test of what follows a close waits for it to have arrived, for a
 *  message sent after it may overtake it). */
extern _Atomic unsigned long dp__transport_closes_in;
/** Messages this process's receivers found complete at the head of their
 *  queue with no receive waiting, each counted once (tests read it: the
 *  state "a value has arrived and waits to be taken"). */
extern _Atomic unsigned long dp__transport_ready_unclaimed;
/** Pieces this process received through same-host slots (tests read it). */
extern _Atomic unsigned long dp__transport_shm_pieces;
/** Messages this process received on same-host lanes (tests read it). */
extern _Atomic unsigned long dp__transport_lane_msgs;
/** Steps the receivers of this process took parking messages that came
 *  out of order and taking them back (tests read it: O(log n) each). */
extern _Atomic unsigned long dp__transport_park_steps;
/** Endpoints the receivers of this process compared looking up the
 *  endpoint of a message (tests read it: O(1) each, whatever their number). */
extern _Atomic unsigned long dp__transport_find_steps;
/** Steps this process took unlinking completed sends from their
 *  endpoints' lists of posted sends (tests read it: one each). */
extern _Atomic unsigned long dp__transport_posted_steps;
/** Posted sends the timeout checks of this process looked at, and the
 *  checks (tests read them: one send an endpoint a check, however many
 *  are posted). */
extern _Atomic unsigned long dp__transport_timeout_steps, dp__transport_timeout_checks;
/** Queues one raw active message (id, header, data as given) on ep, for
 *  tests that put garbage on the wire. A frame header (DP__AM_FRAME, of its
 *  size) gets the endpoint's next sequence number, as a real send would,
 *  unless am_id has DP__RAW_SEQ (the header's goes). am_id with
 *  DP__RAW_RNDV: the message goes by rendezvous whatever its size (and so
 *  on the connection, never the lane), so that the receiver's refusals are
 *  tested holding UCX's rendezvous descriptor. */
#define DP__RAW_RNDV 0x80000000u
#define DP__RAW_SEQ 0x40000000u
int dp__endpoint_send_raw(dp_endpoint_t *ep, unsigned am_id, const void *hdr, size_t hlen, const void *data,
                          size_t n, dp_error_t *err);

#endif
