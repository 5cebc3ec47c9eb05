/* pickler/frame.h — the frame layout shared by the writer and the reader. */
#ifndef DP_PICKLER_FRAME_H
#define DP_PICKLER_FRAME_H
#include "internal.h"

#define DP_FRAME_MAGIC "DPKL"
#define DP_FRAME_VERSION 1
#define DP_FRAME_HEADER 40
#define DP_FRAME_FLAG_INLINE 1u
#define DP_FRAME_MAX_NBYTES ((uint64_t)1 << 62)  /* one buffer's size */

/* msgpack ext types */
#define DP_EXT_TAG 0   /* fixext1: the node kind of the array it opens */
#define DP_EXT_REF 1   /* fixext4: big-endian preorder index of an earlier node */

enum { DP_TAG_TUPLE = 1, DP_TAG_TENSOR = 2, DP_TAG_OBJECT = 3, DP_TAG_REDUCE = 4 };

static inline void dp__put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t dp__get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
/* n bytes (1..8) in MessagePack's order, most significant first */
static inline uint64_t dp__get_be(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v = (v << 8) | p[i];
  return v;
}
static inline void dp__put_le16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline uint16_t dp__get_le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

uint64_t dp__frame_checksum(const uint8_t *frame, size_t n);

/* The header's fields (nbuffers left 0), and the checks that follow the
 * length checks: checksum (sum, computed by the caller over the whole frame),
 * version and flags. Shared by dp_frame_check and dp_unpickle_stream so that
 * both refuse the same headers with the same messages. */
void dp__frame_header_parse(const uint8_t *h, dp_frame_info_t *fi);
/* The frame's length, 40 + payload + table + data, must fit in 64 bits:
 * DP_EFORMAT at 8 otherwise. No input holds such a frame, so both readers
 * refuse it from the header alone — the stream reader without reading on
 * to the end of a stream that may never end. */
int dp__frame_lengths_check(const dp_frame_info_t *fi, dp_error_t *err);
/* The checks every reader makes first, in this order: the magic (DP_EFORMAT
 * at 0; DP_ETRUNC for a prefix of it), the version as soon as its two bytes
 * are in (DP_EVERSION at 4: what follows is that version's layout, so
 * nothing after it is judged), the 40-byte header present (DP_ETRUNC). */
int dp__frame_start_check(const uint8_t *b, size_t n, dp_error_t *err);
/* DP_EVERSION at 4, "unsupported version N", for any version but ours. */
int dp__frame_version_check(unsigned version, dp_error_t *err);
int dp__frame_header_check(const dp_frame_info_t *fi, uint64_t sum, dp_error_t *err);
/* dp__frame_header_check's checks that follow the checksum, which the header
 * alone decides: version, flags, a data section without the inline flag. */
int dp__frame_fields_check(const dp_frame_info_t *fi, dp_error_t *err);
/* The buffer table of a frame whose header, payload and table are at
 * `frame` (the lengths checked): an array of descriptors, each as the
 * reader checks it (fields, device, size, the inline layout filling the
 * data_len announced), nothing after it, and no inline flag on an empty
 * table. What it refuses, the reader refuses under any options (it checks
 * no limit, nor that allocations are distinct); it allocates nothing and
 * needs neither the payload nor the data bytes. */
int dp__frame_table_check(const uint8_t *frame, const dp_frame_info_t *fi, dp_error_t *err);

/* Binds the buffer table of a frame dp_frame_check has checked, as
 * dp__unpickle_checked would before its payload (the same checks, under
 * opts' limits, and opts->bind, required, once an entry), and releases
 * what the binds returned: a caller that keeps a storage retains it in its
 * bind. The transport binds a kept frame's buffers as it arrives, to
 * receive their bytes, and reads its value only when a receive takes it,
 * binding the same storages again. Reads neither the payload nor a data
 * section (the frame has none: bind is for out-of-band buffers). */
int dp__frame_bind(const uint8_t *frame, const dp_frame_info_t *fi, const dp_unpickle_opts_t *opts,
                   dp_error_t *err);

/* Checks what opts hands the reader (a resolver needs its callback, and its
 * list of types unless it has none): DP_EINVAL naming fn, the public call
 * given them, before any input is read. */
int dp__unpickle_opts_check(const dp_unpickle_opts_t *opts, const char *fn, dp_error_t *err);

/* Reads a frame whose header dp_frame_check (or the stream reader) has
 * checked: lengths, checksum, version and flags. frame holds the header,
 * the payload and the buffer table; data is the inline data section, or
 * NULL when it was not kept (storages then carry no host bytes). The one
 * reader behind dp_unpickle and dp_unpickle_stream, so that both accept the
 * same frames under the same limits. Sets fi->nbuffers on success. */
int dp__unpickle_checked(const uint8_t *frame, dp_frame_info_t *fi, const uint8_t *data,
                         const dp_unpickle_opts_t *opts, dp_value_t *out, dp_error_t *err);
/* 1 when the base of the storage behind buffer i of the last pickle is not
 * memory of this process: a storage dp_unpickle made for a buffer without a
 * bind callback (the writer's address), or one carrying host data
 * (dp_storage_host_data). Noted as the pickle met the storage, which may be
 * gone once dp_pickle returned (a reduce state may have held the only
 * reference to it). */
int dp__frame_buffer_not_local(const dp_frame_t *f, size_t i);
/* Host bytes this thread's pickles compared between storages at one
 * (device, base): a test counter. */
extern _Thread_local uint64_t dp__buffer_bytes_compared;
/* Allow-list names this thread's readers compared with a reduce node's type
 * name: a test counter. */
extern _Thread_local uint64_t dp__allowed_names_compared;
#endif
