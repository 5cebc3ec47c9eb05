/* pickler/frame_stream.c — reading a frame from a stream without keeping its
 * data section.
 *
 * An inline frame's data section is most of its size (a checkpoint's weights)
 * and nothing in the value needs it to be checked: only the checksum covers
 * it, and the buffer table says how it is laid out. So the header, payload
 * and table are kept; the data section is hashed as it streams by and
 * dropped; and dp_unpickle's own reader reads what was kept, checking the
 * data section's layout against its length (so both readers accept the
 * same frames under the same limits). Memory is that of the header,
 * payload and table and of the value, whatever the data size. */
#include <string.h>
#define XXH_STATIC_LINKING_ONLY   /* XXH3_state_t on the stack: no allocation outside dp__alloc */
#include <xxhash.h>

#include "devpickle/pickler.h"
#include "frame.h"

#define CHUNK (1u << 16)

typedef struct sr {
  dp_stream_read_cb read;
  void *ud;
  dp_error_t *err;
  uint64_t total;   /* bytes read so far */
} sr_t;

/* Reads up to n bytes (fewer only at the end of the stream). */
static int sread(sr_t *s, void *dst, size_t n, size_t *got) {
  *got = 0;
  while (*got < n) {
    size_t k = 0;
    dp_error_t own, *e = s->err ? s->err : &own; /* the callback always gets an error to fill */
    dp_error_clear(e); /* so that a callback failing without a word is seen */
    int rc = dp__cb_rc(s->read(s->ud, (uint8_t *)dst + *got, n - *got, &k, e), e, "the read callback");
    if (rc) {
      e->offset = (int64_t)s->total;
      return rc;
    }
    if (k > n - *got)
      return dp__err_at(s->err, DP_EINVAL, (int64_t)s->total,
                        "the read callback reported %zu byte%s read where at most %zu %s asked", k, k == 1 ? "" : "s",
                        n - *got, n - *got == 1 ? "was" : "were");
    if (k == 0) break;
    *got += k;
    s->total += k;
  }
  return 0;
}

/* The rest of the stream is counted (and dropped) to say how long it was. */
static int drain(sr_t *s, uint8_t *buf) {
  size_t got;
  int rc;
  do {
    if ((rc = sread(s, buf, CHUNK, &got)) != 0) return rc;
  } while (got == CHUNK);
  return 0;
}

int dp_unpickle_stream(dp_stream_read_cb read, void *ud, const dp_unpickle_opts_t *opts, dp_value_t *out,
                       dp_frame_info_t *info, uint64_t *size, dp_error_t *err) {
  if (!read || !out) return dp__err(err, DP_EINVAL, "dp_unpickle_stream: NULL %s", read ? "out" : "read");
  sr_t s = {read, ud, err, 0};
  uint8_t hdr[DP_FRAME_HEADER];
  uint8_t *buf = NULL, *chunk = NULL;  /* buf: the header, then payload and table */
  size_t buf_cap = 0, got;
  XXH3_state_t state, *xs = &state;
  XXH3_INITSTATE(xs);
  int rc = sread(&s, hdr, sizeof hdr, &got);
  if (rc) return rc;
  if (got < sizeof hdr || memcmp(hdr, DP_FRAME_MAGIC, 4) != 0) return dp_frame_check(hdr, got, info, err);
  dp_frame_info_t fi;
  dp__frame_header_parse(hdr, &fi);
  if ((rc = dp__frame_lengths_check(&fi, err)) != 0) return rc;

  chunk = dp__alloc(CHUNK);
  if (!chunk || XXH3_64bits_reset_withSeed(xs, XXH3_64bits(hdr, 32)) != XXH_OK) {
    rc = dp__err(err, DP_ENOMEM, "out of memory");
    goto done;
  }
  /* payload and table, grown as bytes arrive (never beyond what the header claims) */
  uint64_t want = fi.payload_len + fi.table_len;  /* the lengths' sum fits: checked above */
  int overflow = want > SIZE_MAX - DP_FRAME_HEADER;  /* more than memory can address (32-bit) */
  size_t head_len = 0;
  uint8_t *head = NULL;
  while (!overflow && (head_len < want || !buf)) {
    size_t step = want - head_len < CHUNK ? (size_t)(want - head_len) : CHUNK;
    size_t need = DP_FRAME_HEADER + head_len + step;
    if (need > buf_cap) {
      size_t ncap = buf_cap ? buf_cap * 2 : CHUNK;
      if (ncap < need) ncap = need;
      if (ncap > DP_FRAME_HEADER + want) ncap = DP_FRAME_HEADER + (size_t)want;
      uint8_t *nb = dp__realloc(buf, buf_cap, ncap);
      if (!nb) {
        rc = dp__err(err, DP_ENOMEM, "out of memory reading %llu bytes of payload and buffer table",
                     (unsigned long long)want);
        goto done;
      }
      buf = nb;
      buf_cap = ncap;
      memcpy(buf, hdr, DP_FRAME_HEADER);
      head = buf + DP_FRAME_HEADER;
    }
    if ((rc = sread(&s, head + head_len, step, &got)) != 0) goto done;
    XXH3_64bits_update(xs, head + head_len, got);
    head_len += got;
    if (got < step) break;
  }
  /* the data section: hashed, not kept */
  uint64_t data_seen = 0;
  while (!overflow && head_len == want && data_seen < fi.data_len) {
    size_t step = fi.data_len - data_seen < CHUNK ? (size_t)(fi.data_len - data_seen) : CHUNK;
    if ((rc = sread(&s, chunk, step, &got)) != 0) goto done;
    XXH3_64bits_update(xs, chunk, got);
    data_seen += got;
    if (got < step) break;
  }
  uint64_t framed = s.total;
  if ((rc = drain(&s, chunk)) != 0) goto done;
  uint64_t body = s.total - DP_FRAME_HEADER;
  if (overflow || fi.payload_len > body || fi.table_len > body - fi.payload_len ||
      fi.data_len > body - fi.payload_len - fi.table_len) {
    rc = dp__err_at(err, DP_ETRUNC, (int64_t)s.total,
                    "truncated frame: header announces %llu + %llu + %llu body bytes, %llu present",
                    (unsigned long long)fi.payload_len, (unsigned long long)fi.table_len,
                    (unsigned long long)fi.data_len, (unsigned long long)body);
    goto done;
  }
  if (s.total != framed) {
    rc = dp__err_at(err, DP_EFORMAT, (int64_t)framed, "%llu byte%s after the end of the frame",
                    (unsigned long long)(s.total - framed), s.total - framed == 1 ? "" : "s");
    goto done;
  }
  if ((rc = dp__frame_header_check(&fi, XXH3_64bits_digest(xs), err)) != 0) goto done;

  /* The header, payload and table read as dp_unpickle reads them, with
   * the data section's layout checked against its length alone. */
  if ((rc = dp__unpickle_checked(buf, &fi, NULL, opts, out, err)) == 0) {
    if (info) *info = fi;
    if (size) *size = s.total;
  }
done:
  dp__free(buf, buf_cap);
  dp__free(chunk, CHUNK);
  return rc;
}
