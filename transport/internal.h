/* transport/internal.h — the transport's private interface (movers, test hooks). */
#ifndef DP_TRANSPORT_INTERNAL_H
#define DP_TRANSPORT_INTERNAL_H

#include "devpickle/transport.h"

/* The wire (docs/TRANSPORT.md). Active-message ids and headers, written in
 * the host's byte order: both ends are little-endian x86-64/aarch64 today. */
#define DP__AM_FRAME 0x44500u
#define DP__AM_BUFS 0x44501u
#define DP__WIRE_MAGIC 0x31545044u /* "DPT1" */

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
} dp__am_bufs_hdr_t;

/* Buffers up to this size are packed into one message of up to
 * DP__BATCH_BYTES (one copy on each side); larger ones go alone, from and
 * into the storage itself, by rendezvous. */
#define DP__SMALL_BUFFER (64u << 10)
#define DP__BATCH_BYTES (256u << 10)

/* How one kind of device's buffers move. The transport looks the mover up
 * by the buffer's device type; a type without one (cuda today) is refused
 * with DP_ENODEV on both ends. A device path (NCCL, pinned staging) slots in
 * here: `source` gives what UCX reads on the sender (a device path would
 * post its own transfer instead), `alloc` the receive storage. */
typedef struct dp__mover {
  const char *name;
  /** The host address the sender reads buffer d from. */
  int (*source)(dp_transport_t *t, const dp_buffer_desc_t *d, const void **src, dp_error_t *err);
  /** A new storage of nbytes on dev for receiving (*dst: where the bytes go). */
  int (*alloc)(dp_transport_t *t, dp_device_t dev, uint64_t nbytes, dp_storage_t **out, void **dst,
               dp_error_t *err);
} dp__mover_t;

const dp__mover_t *dp__mover_for(dp_device_type_t type);

/* ---- test hooks (never set in production) ---- */
/** 1: send_future reads the buffers as soon as the future completes,
 *  WITHOUT waiting for its events (the ordering test's negative control). */
extern int dp__transport_skip_events;
/** Queues one raw active message (id, header, data as given) on ep, for
 *  tests that put garbage on the wire. A frame header (DP__AM_FRAME, of its
 *  size) gets the endpoint's next sequence number, as a real send would. */
int dp__endpoint_send_raw(dp_endpoint_t *ep, unsigned am_id, const void *hdr, size_t hlen, const void *data,
                          size_t n, dp_error_t *err);

#endif
