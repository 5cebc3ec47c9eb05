/* pickler/frame_stream.c — reading a frame from a stream without keeping its
 * data section.
 *
 * An inline frame's data section is most of its size (a checkpoint's weights)
 * and nothing in the value needs it to be checked: only the checksum covers
 * it, and the buffer table says how it is laid out. So the header, payload
 * and table are kept; the data section is hashed as it streams by and
 * dropped; and the table is rewritten in its out-of-band form (4 fields a
 * descriptor) into a small frame that dp_unpickle reads with the limits the
 * caller asked for, less the inline bytes already counted. Memory is that of
 * the header, payload and table and of the value, whatever the data size. */
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
    int rc = s->read(s->ud, (uint8_t *)dst + *got, n - *got, &k, s->err);
    if (rc) return rc;
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

/* ---- the buffer table: a minimal MessagePack reader for its two token kinds ---- */

typedef struct tr {
  const uint8_t *p, *end, *base;   /* base: frame offset 0 */
  dp_error_t *err;
} tr_t;

static int64_t toff(const tr_t *t, const uint8_t *at) { return (int64_t)(at - t->base); }

static int need(tr_t *t, size_t n, const uint8_t *at) {
  if ((size_t)(t->end - t->p) < n) return dp__err_at(t->err, DP_ETRUNC, toff(t, at), "truncated buffer table");
  return 0;
}

static uint64_t be(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v = v << 8 | p[i];
  return v;
}

static int tr_uint(tr_t *t, uint64_t *out, const char *what) {
  const uint8_t *at = t->p;
  if (need(t, 1, at)) return DP_ETRUNC;
  uint8_t c = *t->p++;
  int n = 0, sign = 0;
  if (c <= 0x7f) {
    *out = c;
    return 0;
  }
  if (c >= 0xcc && c <= 0xcf) n = 1 << (c - 0xcc);
  else if (c >= 0xd0 && c <= 0xd3) n = 1 << (c - 0xd0), sign = 1;
  else return dp__err_at(t->err, DP_EFORMAT, toff(t, at), "%s: unsigned integer expected", what);
  if (need(t, (size_t)n, at)) return DP_ETRUNC;
  uint64_t v = be(t->p, n);
  t->p += n;
  if (sign && (v >> (8 * n - 1)) & 1)
    return dp__err_at(t->err, DP_EFORMAT, toff(t, at), "%s: unsigned integer expected", what);
  *out = v;
  return 0;
}

static int tr_array(tr_t *t, uint64_t *out, const char *what) {
  const uint8_t *at = t->p;
  if (need(t, 1, at)) return DP_ETRUNC;
  uint8_t c = *t->p++;
  int n;
  if (c >= 0x90 && c <= 0x9f) {
    *out = c & 0x0f;
    return 0;
  }
  if (c == 0xdc) n = 2;
  else if (c == 0xdd) n = 4;
  else return dp__err_at(t->err, DP_EFORMAT, toff(t, at), "%s: array expected", what);
  if (need(t, (size_t)n, at)) return DP_ETRUNC;
  *out = be(t->p, n);
  t->p += n;
  return 0;
}

static size_t put_array(uint8_t *o, uint64_t n) {
  if (n < 16) return o[0] = (uint8_t)(0x90 | n), 1;
  if (n <= 0xffff) return o[0] = 0xdc, o[1] = (uint8_t)(n >> 8), o[2] = (uint8_t)n, 3;
  o[0] = 0xdd;
  for (int i = 0; i < 4; i++) o[1 + i] = (uint8_t)(n >> (24 - 8 * i));
  return 5;
}

static size_t put_uint(uint8_t *o, uint64_t v) {
  if (v <= 0x7f) return o[0] = (uint8_t)v, 1;
  o[0] = 0xcf;
  for (int i = 0; i < 8; i++) o[1 + i] = (uint8_t)(v >> (56 - 8 * i));
  return 9;
}

/* Rewrites an inline table (5 fields a descriptor) as an out-of-band one at
 * out, which has room for 37 bytes a descriptor (an array header and four
 * uint64) and 5 for the count. Checks the layout: buffer i's bytes follow buffer i-1's and fill the data
 * section exactly. Records where each descriptor starts in both, to map an
 * error offset in the rewritten table back to the frame. */
typedef struct tmap {
  uint64_t *orig, *syn;   /* descriptor i starts at these frame offsets */
  size_t n, cap;
} tmap_t;

static int convert_table(tr_t *t, uint64_t data_len, uint32_t max_buffers, uint8_t *out, size_t *outlen,
                         tmap_t *map) {
  uint64_t n, off = 0;
  size_t o = 0;
  const uint8_t *at = t->p;
  int rc = tr_array(t, &n, "buffer table");
  if (rc) return rc;
  if (n > max_buffers)
    return dp__err_at(t->err, DP_ELIMIT, toff(t, at), "buffer count exceeds the limit of %llu",
                      (unsigned long long)max_buffers);
  if (n > (uint64_t)(t->end - t->p)) return dp__err_at(t->err, DP_ETRUNC, toff(t, at), "truncated buffer table");
  map->cap = (size_t)n + 1;
  map->orig = dp__alloc_array(map->cap, sizeof(uint64_t));
  map->syn = dp__alloc_array(map->cap, sizeof(uint64_t));
  if (!map->orig || !map->syn) return dp__err_at(t->err, DP_ENOMEM, toff(t, at), "out of memory");
  map->n = (size_t)n;
  o += put_array(out, n);
  uint64_t syn_base = (uint64_t)toff(t, at);
  for (uint64_t i = 0; i < n; i++) {
    uint64_t fields, f[5];
    at = t->p;
    map->orig[i] = (uint64_t)toff(t, at);
    map->syn[i] = syn_base + o;
    if ((rc = tr_array(t, &fields, "buffer descriptor")) != 0) return rc;
    if (fields != 5)
      return dp__err_at(t->err, DP_EFORMAT, toff(t, at), "buffer descriptor %llu has %llu fields, expected 5",
                        (unsigned long long)i, (unsigned long long)fields);
    static const char *const what[5] = {"buffer device type", "buffer device index", "buffer size", "buffer address",
                                        "buffer data offset"};
    for (int k = 0; k < 5; k++)
      if ((rc = tr_uint(t, &f[k], what[k])) != 0) return rc;
    if (f[4] != off || f[2] > data_len - off)
      return dp__err_at(t->err, DP_EFORMAT, toff(t, at), "buffer %llu: inline data at %llu+%llu does not follow "
                        "the previous buffer within the %llu-byte data section", (unsigned long long)i,
                        (unsigned long long)f[4], (unsigned long long)f[2], (unsigned long long)data_len);
    off += f[2];
    o += put_array(out + o, 4);
    for (int k = 0; k < 4; k++) o += put_uint(out + o, f[k]);
  }
  map->orig[n] = (uint64_t)toff(t, t->p);
  map->syn[n] = syn_base + o;
  if (t->p != t->end)
    return dp__err_at(t->err, DP_EFORMAT, toff(t, t->p), "%lld bytes after the buffer table",
                      (long long)(t->end - t->p));
  if (off != data_len)
    return dp__err_at(t->err, DP_EFORMAT, toff(t, t->end), "%llu bytes of the data section belong to no buffer",
                      (unsigned long long)(data_len - off));
  *outlen = o;
  return 0;
}

/* An offset in the rewritten table, as an offset in the frame read. */
static int64_t map_offset(const tmap_t *m, int64_t o) {
  if (!m->n || o < (int64_t)m->syn[0]) return o;
  size_t i = 0;
  while (i < m->n && (int64_t)m->syn[i + 1] <= o) i++;
  uint64_t into = (uint64_t)o - m->syn[i];
  uint64_t len = m->orig[i + 1] > m->orig[i] ? m->orig[i + 1] - m->orig[i] : 0;
  return (int64_t)(m->orig[i] + (into < len ? into : len));
}

int dp_unpickle_stream(dp_stream_read_cb read, void *ud, const dp_unpickle_opts_t *opts, dp_value_t *out,
                       dp_frame_info_t *info, uint64_t *size, dp_error_t *err) {
  if (!read || !out) return dp__err(err, DP_EINVAL, "dp_unpickle_stream: NULL argument");
  sr_t s = {read, ud, err, 0};
  uint8_t hdr[DP_FRAME_HEADER];
  uint8_t *buf = NULL, *chunk = NULL, *syn = NULL;  /* buf: the header, then payload and table */
  size_t buf_cap = 0, syn_cap = 0, got;
  tmap_t map = {NULL, NULL, 0, 0};
  XXH3_state_t state, *xs = &state;
  XXH3_INITSTATE(xs);
  int rc = sread(&s, hdr, sizeof hdr, &got);
  if (rc) return rc;
  if (got < sizeof hdr || memcmp(hdr, DP_FRAME_MAGIC, 4) != 0) return dp_frame_check(hdr, got, info, err);
  dp_frame_info_t fi;
  fi.version = dp__get_le16(hdr + 4);
  fi.flags = dp__get_le16(hdr + 6);
  fi.payload_len = dp__get_le64(hdr + 8);
  fi.table_len = dp__get_le64(hdr + 16);
  fi.data_len = dp__get_le64(hdr + 24);
  fi.checksum = dp__get_le64(hdr + 32);
  fi.nbuffers = 0;

  chunk = dp__alloc(CHUNK);
  if (!chunk || XXH3_64bits_reset_withSeed(xs, XXH3_64bits(hdr, 32)) != XXH_OK) {
    rc = dp__err(err, DP_ENOMEM, "out of memory");
    goto done;
  }
  /* payload and table, grown as bytes arrive (never beyond what the header claims) */
  uint64_t want = fi.payload_len + fi.table_len;
  int overflow = fi.payload_len > UINT64_MAX - fi.table_len || want > UINT64_MAX - fi.data_len ||
                 want > SIZE_MAX - DP_FRAME_HEADER;
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
    rc = dp__err_at(err, DP_EFORMAT, (int64_t)framed, "%llu bytes after the end of the frame",
                    (unsigned long long)(s.total - framed));
    goto done;
  }
  uint64_t sum = XXH3_64bits_digest(xs);
  if (sum != fi.checksum) {
    rc = dp__err_at(err, DP_ECHECKSUM, 32, "checksum mismatch: header says %016llx, content hashes to %016llx",
                    (unsigned long long)fi.checksum, (unsigned long long)sum);
    goto done;
  }
  if (fi.version != DP_FRAME_VERSION) {
    rc = dp__err_at(err, DP_EVERSION, 4, "frame version %u, this build reads version %d", fi.version, DP_FRAME_VERSION);
    goto done;
  }
  if (fi.flags & ~DP_FRAME_FLAG_INLINE) {
    rc = dp__err_at(err, DP_EFORMAT, 6, "unknown frame flags 0x%04x", fi.flags);
    goto done;
  }
  if ((fi.flags & DP_FRAME_FLAG_INLINE) == 0 && fi.data_len != 0) {
    rc = dp__err_at(err, DP_EFORMAT, 24, "data section in a frame without the inline flag");
    goto done;
  }

  /* The frame dp_unpickle reads: the same header, payload and (out-of-band) table. */
  dp_unpickle_opts_t o;
  memset(&o, 0, sizeof o);
  if (opts) o = *opts;
  uint64_t max_bytes = o.limits.max_bytes ? o.limits.max_bytes : DP_DEFAULT_MAX_BYTES;
  uint32_t max_buffers = o.limits.max_buffers ? o.limits.max_buffers : DP_DEFAULT_MAX_BUFFERS;
  size_t table_len = (size_t)fi.table_len;
  if (!(fi.flags & DP_FRAME_FLAG_INLINE)) {  /* the frame read is the frame: no copy */
    rc = dp_unpickle(buf, DP_FRAME_HEADER + head_len, &o, out, err);
    if (rc == 0) {
      if (info) *info = fi;
      if (info) dp_frame_check(buf, DP_FRAME_HEADER + head_len, info, NULL);
      if (size) *size = s.total;
    }
    goto done;
  }
  /* a descriptor (6 bytes at least) becomes 37 at most; the count 5 */
  syn_cap = DP_FRAME_HEADER + (size_t)fi.payload_len + table_len / 6 * 37 + 5;
  syn = dp__alloc(syn_cap);
  if (!syn) {
    rc = dp__err(err, DP_ENOMEM, "out of memory");
    goto done;
  }
  memcpy(syn, hdr, DP_FRAME_HEADER);
  memcpy(syn + DP_FRAME_HEADER, head, (size_t)fi.payload_len);
  {
    tr_t t = {head + fi.payload_len, head + fi.payload_len + table_len, head - DP_FRAME_HEADER, err};
    if ((rc = convert_table(&t, fi.data_len, max_buffers, syn + DP_FRAME_HEADER + fi.payload_len, &table_len, &map)) != 0)
      goto done;
    if (fi.data_len > max_bytes) {
      rc = dp__err_at(err, DP_ELIMIT, (int64_t)(DP_FRAME_HEADER + fi.payload_len),
                      "total str, bytes and inline size exceeds the limit of %llu", (unsigned long long)max_bytes);
      goto done;
    }
    o.limits.max_bytes = max_bytes - fi.data_len;
    if (o.limits.max_bytes == 0) o.limits.max_bytes = 1;  /* 0 would mean the default; no str fits anyway */
  }
  size_t syn_len = DP_FRAME_HEADER + (size_t)fi.payload_len + table_len;
  dp__put_le16(syn + 6, 0);
  dp__put_le64(syn + 16, table_len);
  dp__put_le64(syn + 24, 0);
  dp__put_le64(syn + 32, dp__frame_checksum(syn, syn_len));
  dp_frame_info_t si;
  if ((rc = dp_frame_check(syn, syn_len, &si, err)) == 0) rc = dp_unpickle(syn, syn_len, &o, out, err);
  if (rc && err && err->offset >= 0) err->offset = map_offset(&map, err->offset);
  if (rc == 0) {
    fi.nbuffers = si.nbuffers;
    if (info) *info = fi;
    if (size) *size = s.total;
  }
done:
  if (map.orig) dp__free(map.orig, map.cap * sizeof(uint64_t));
  if (map.syn) dp__free(map.syn, map.cap * sizeof(uint64_t));
  dp__free(syn, syn_cap);
  dp__free(buf, buf_cap);
  dp__free(chunk, CHUNK);
  return rc;
}
