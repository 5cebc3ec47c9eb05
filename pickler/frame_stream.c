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
    /* The callback fills an error of its own, cleared so that a failure
     * without a word is seen; the caller's is written on failure only. */
    dp_error_t e;
    dp_error_clear(&e);
    int rc = dp__cb_rc(s->read(s->ud, (uint8_t *)dst + *got, n - *got, &k, &e), &e, "the read callback");
    if (rc) {
      e.offset = (int64_t)s->total;
      if (s->err) *s->err = e;
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

/* ---- the framing of a section still arriving ---- */

/* Checks that the first `have` bytes of a section of `len` bytes (at s, at
 * offset `at` in the frame) can still begin the one MessagePack value the
 * section must hold, ending at its end. Only what every reader refuses is
 * refused: a byte that is no MessagePack type, a header, length or count
 * running past the section, more values still owed than bytes left (each
 * value takes one at least), bytes after the value's end. Constant memory
 * (a count of the values owed, not a stack), time linear in `have`. 0 while
 * more bytes may complete it. */
static int framing_check(const uint8_t *s, uint64_t have, uint64_t len, uint64_t at, const char *section,
                         const char *after, dp_error_t *err) {
  uint64_t pos = 0, owed = 1;
  while (owed) {
    if (owed > len - pos)
      return dp__err_at(err, DP_EFORMAT, (int64_t)(at + pos),
                        "the %s ends inside its value: %llu more value%s, %llu byte%s left", section,
                        (unsigned long long)owed, owed == 1 ? "" : "s", (unsigned long long)(len - pos),
                        len - pos == 1 ? "" : "s");
    if (pos >= have) return 0;
    uint8_t b = s[pos];
    /* the header: the type byte, lb bytes of length or count, `fixed`
       bytes more (an ext's type, a number's own bytes) */
    int lb = 0, per = 0, fixed = 0; /* per: values an item of the count owes (array 1, map 2) */
    uint64_t head, body = 0, count = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
    } else if ((b & 0xf0) == 0x80 || (b & 0xf0) == 0x90) {
      count = b & 0x0f, per = (b & 0xf0) == 0x80 ? 2 : 1;
    } else if ((b & 0xe0) == 0xa0) {
      body = b & 0x1f;
    } else if (b >= 0xc4 && b <= 0xc6) {
      lb = 1 << (b - 0xc4);
    } else if (b >= 0xc7 && b <= 0xc9) {
      lb = 1 << (b - 0xc7), fixed = 1;
    } else if (b >= 0xca && b <= 0xd3) { /* float 32, 64; uint, int 8 to 64 */
      fixed = b == 0xca ? 4 : b == 0xcb ? 8 : 1 << ((b - 0xcc) & 3);
    } else if (b >= 0xd4 && b <= 0xd8) {
      fixed = 1, body = 1u << (b - 0xd4);
    } else if (b >= 0xd9 && b <= 0xdb) {
      lb = 1 << (b - 0xd9);
    } else if (b >= 0xdc) {
      lb = b & 1 ? 4 : 2, per = b >= 0xde ? 2 : 1;
    } else {
      return dp__err_at(err, DP_EFORMAT, (int64_t)(at + pos), "invalid msgpack type byte 0x%02x", b);
    }
    head = 1 + (uint64_t)lb + (uint64_t)fixed;
    if (head > len - pos)
      return dp__err_at(err, DP_EFORMAT, (int64_t)(at + pos), "a %llu-byte header runs past the end of the %s",
                        (unsigned long long)head, section);
    if (head > have - pos) return 0;
    if (lb) {
      uint64_t n = dp__get_be(s + pos + 1, lb);
      if (per) count = n;
      else body = n;
    }
    uint64_t start = pos;
    pos += head;
    owed--;
    if (per && (count > (len - pos) / (uint64_t)per || owed > len - pos - count * (uint64_t)per))
      return dp__err_at(err, DP_EFORMAT, (int64_t)(at + start),
                        "the %s's %s of %llu claims more values than the %llu byte%s left", section,
                        per == 2 ? "map" : "array", (unsigned long long)count, (unsigned long long)(len - pos),
                        len - pos == 1 ? "" : "s");
    owed += count * (uint64_t)per;
    if (body > len - pos)
      return dp__err_at(err, DP_EFORMAT, (int64_t)(at + start),
                        "the %s's value of %llu byte%s is longer than the %llu byte%s left", section,
                        (unsigned long long)body, body == 1 ? "" : "s", (unsigned long long)(len - pos),
                        len - pos == 1 ? "" : "s");
    pos += body;
  }
  if (pos < len)
    return dp__err_at(err, DP_EFORMAT, (int64_t)(at + pos), "%llu byte%s %s", (unsigned long long)(len - pos),
                      len - pos == 1 ? "" : "s", after);
  return 0;
}

int dp_frame_prefix_check(const void *bytes, size_t n, dp_error_t *err) {
  const uint8_t *b = bytes;
  if (!bytes && n) return dp__err(err, DP_EINVAL, "dp_frame_prefix_check: NULL bytes");
  if (n && memcmp(b, DP_FRAME_MAGIC, n < 4 ? n : 4) != 0)
    return dp__err_at(err, DP_EFORMAT, 0, "not a devpickle frame (bad magic)");
  if (n < DP_FRAME_HEADER) return n >= 6 ? dp__frame_version_check(dp__get_le16(b + 4), err) : 0;
  dp_frame_info_t fi;
  dp__frame_header_parse(b, &fi);
  int rc;
  if ((rc = dp__frame_version_check(fi.version, err)) != 0 || (rc = dp__frame_lengths_check(&fi, err)) != 0 ||
      (rc = dp__frame_fields_check(&fi, err)) != 0)
    return rc;
  uint64_t body = n - DP_FRAME_HEADER;
  /* an empty section holds no value: the readers say so */
  if (fi.payload_len && (rc = framing_check(b + DP_FRAME_HEADER, body < fi.payload_len ? body : fi.payload_len,
                                            fi.payload_len, DP_FRAME_HEADER, "payload",
                                            "after the root value in the payload", err)) != 0)
    return rc;
  if (body < fi.payload_len) return 0;
  body -= fi.payload_len;
  if (fi.table_len && (rc = framing_check(b + DP_FRAME_HEADER + fi.payload_len, body < fi.table_len ? body : fi.table_len,
                                          fi.table_len, DP_FRAME_HEADER + fi.payload_len, "buffer table",
                                          "after the buffer table", err)) != 0)
    return rc;
  if (body < fi.table_len) return 0;
  /* the whole table (an empty one too): its descriptors say how long the
     data section is; then an empty payload, as the reader reads them */
  if ((rc = dp__frame_table_check(b, &fi, err)) != 0) return rc;
  if (!fi.payload_len) return dp__err_at(err, DP_EFORMAT, DP_FRAME_HEADER, "value expected, section ended");
  return 0;
}

int dp_frame_value_check(const void *bytes, size_t n, const dp_unpickle_opts_t *opts, dp_error_t *err) {
  if (!bytes && n) return dp__err(err, DP_EINVAL, "dp_frame_value_check: NULL bytes");
  /* opts as dp_unpickle takes them: a resolver it would refuse is refused
   * here too, though this check never asks it */
  int rc = dp__unpickle_opts_check(opts, "dp_frame_value_check", err);
  if (rc) return rc;
  rc = dp_frame_prefix_check(bytes, n, err);
  if (rc || n < DP_FRAME_HEADER || (opts && opts->resolver)) return rc;
  dp_frame_info_t fi;
  dp__frame_header_parse(bytes, &fi);
  /* the lengths' sum fits: the prefix check checked it */
  if (n - DP_FRAME_HEADER < fi.payload_len + fi.table_len) return 0;
  /* the reader itself, on what is in: no callback runs (nothing is bound,
     and no resolver is asked: see pickler.h), the value is dropped */
  dp_unpickle_opts_t o;
  memset(&o, 0, sizeof o);
  if (opts) o.limits = opts->limits;
  dp_value_t v;
  if ((rc = dp__unpickle_checked(bytes, &fi, NULL, &o, &v, err)) == 0) dp_value_release(v);
  return rc;
}

/* The rest of the stream is counted (and dropped) to say how long it was:
 * behind a frame read whole (`bounded`), up to CHUNK bytes, then one more
 * says that more follow, and reading stops there — a stream that never
 * ends behind a frame (`cat f.dpk /dev/zero`) would otherwise hold the
 * call forever. *more: it did. A frame too long to hold (32-bit) is
 * truncated wherever the stream ends, which only its end says. */
static int drain(sr_t *s, uint8_t *buf, int bounded, int *more) {
  size_t got;
  int rc;
  *more = 0;
  do {
    if ((rc = sread(s, buf, CHUNK, &got)) != 0) return rc;
  } while (got == CHUNK && !bounded);
  if (got < CHUNK) return 0;
  if ((rc = sread(s, buf, 1, &got)) != 0) return rc;
  *more = got != 0;
  return 0;
}

int dp_unpickle_stream(dp_stream_read_cb read, void *ud, const dp_unpickle_opts_t *opts, dp_value_t *out,
                       dp_frame_info_t *info, uint64_t *size, dp_error_t *err) {
  if (!read || !out) return dp__err(err, DP_EINVAL, "dp_unpickle_stream: NULL %s", read ? "out" : "read");
  if (dp__unpickle_opts_check(opts, "dp_unpickle_stream", err)) return DP_EINVAL;
  sr_t s = {read, ud, err, 0};
  uint8_t hdr[DP_FRAME_HEADER];
  uint8_t *buf = NULL, *chunk = NULL;  /* buf: the header, then payload and table */
  size_t buf_cap = 0, got;
  XXH3_state_t state, *xs = &state;
  XXH3_INITSTATE(xs);
  int rc = sread(&s, hdr, sizeof hdr, &got);
  if (rc) return rc;
  if ((rc = dp__frame_start_check(hdr, got, err)) != 0) return rc; /* magic, version, a whole header */
  dp_frame_info_t fi;
  dp__frame_header_parse(hdr, &fi);
  if ((rc = dp__frame_lengths_check(&fi, err)) != 0) return rc;

  /* Its own failures, as the reader's, say where in the stream it stopped
   * (base.h: a reader's errors carry the offset) and what it was reading. */
  chunk = dp__alloc(CHUNK);
  if (!chunk || XXH3_64bits_reset_withSeed(xs, XXH3_64bits(hdr, 32)) != XXH_OK) {
    rc = dp__err_at(err, DP_ENOMEM, (int64_t)s.total, "out of memory allocating the %u-byte buffer that reads the "
                    "frame's body", CHUNK);
    goto done;
  }
  /* payload and table, grown as bytes arrive (never beyond what the header claims) */
  uint64_t want = fi.payload_len + fi.table_len;  /* the lengths' sum fits: checked above */
  int overflow = want > SIZE_MAX - DP_FRAME_HEADER;  /* more than memory can address (32-bit) */
  size_t head_len = 0, check_at = CHUNK;
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
        rc = dp__err_at(err, DP_ENOMEM, (int64_t)s.total, "out of memory reading %llu bytes of payload and buffer table",
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
    /* what is held is checked as it grows (at 64 KiB, then at each
       doubling: twice its reading at most), so that bytes behind a long
       header that can be no frame's are refused as they come, not held to
       the header's end or the memory's */
    if (head_len >= check_at && head_len < want) {
      if ((rc = dp_frame_prefix_check(buf, DP_FRAME_HEADER + head_len, err)) != 0) goto done;
      check_at = head_len * 2;
    }
  }
  /* the data section: hashed, not kept */
  uint64_t data_seen = 0;
  while (!overflow && head_len == want && data_seen < fi.data_len) {
    size_t step = fi.data_len - data_seen < CHUNK ? (size_t)(fi.data_len - data_seen) : CHUNK;
    if ((rc = sread(&s, chunk, step, &got)) != 0) goto done;
    XXH3_64bits_update(xs, chunk, got);
    data_seen += got;
    if (got < step) break;
    /* once 64 KiB of it are in, and more is to come, what is held is
       read whole as the reader reads it (the header's fields, the table's
       layout, which gives the data section's length, and the value): a
       data section that no frame with this header, payload and table can
       have (`cat header /dev/zero` behind a header announcing 2^62 bytes
       of data) is refused, not hashed to its end */
    if (data_seen == CHUNK && data_seen < fi.data_len &&
        (rc = dp_frame_value_check(buf, DP_FRAME_HEADER + head_len, opts, err)) != 0)
      goto done;
  }
  uint64_t framed = s.total;
  int more;
  if ((rc = drain(&s, chunk, !overflow, &more)) != 0) goto done;
  if (more) {
    rc = dp__err_at(err, DP_EFORMAT, (int64_t)framed,
                    "more than %u bytes after the end of the frame (a stream holds one frame; the rest was not read)",
                    CHUNK);
    goto done;
  }
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
