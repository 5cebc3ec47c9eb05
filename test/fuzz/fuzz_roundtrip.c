/* Structure-aware: the input drives a small builder (with sharing and
 * cycles, dict keys of every kind, and customs as a process without their
 * type holds them); the value is scanned and pickled, the frame must
 * unpickle to an equal value with the same sharing, and the scan must equal
 * the buffer table. Pickled inline (storages with host bytes) it reads back
 * equal and writes again to the same bytes. Whatever the writer writes under a depth limit, the reader reads
 * under the same limit; two storages at one (device, base) that disagree
 * are refused by the writer, never written. Then the last input bytes pick
 * a frame byte to change (checksum fixed up): the reader must survive it,
 * and a changed frame it accepts must be what the writer writes for the
 * value read. */
#include <stdio.h>

#include "fuzz.h"

typedef struct rd {
  const uint8_t *p;
  size_t n;
} rd_t;

static unsigned next(rd_t *r) {
  if (!r->n) return 0;
  r->n--;
  return *r->p++;
}

#define MAXNODES 64
#define MAXBUILT 600  /* values stay small: executions stay fast */

static int built;

/* A dict key from the input, of any kind a key may be: scalars at the edges
 * of their encodings (ints at each width's limits, -0.0, NaNs with
 * payloads), str with NUL, bytes, and tuples of those. */
static dp_value_t key_of(rd_t *r, int depth) {
  static const int64_t ints[] = {0,   1,     -1,    127,       128,       -32,       -33,       255,
                                 256, 65535, 65536, INT32_MIN, INT64_MIN, INT64_MAX, 1ll << 32, -129};
  static const uint64_t bits[] = {0, 1ull << 63, 0x7ff8000000000000ull, 0x7ff8000000000001ull,
                                  0xfff8000000000000ull, 0x7ff0000000000000ull, 0x3ff0000000000000ull, 1};
  unsigned op = next(r) % 8;
  char s[4] = {'k', (char)('0' + next(r) % 4), 0, 'z'};
  dp_value_t v;
  double d;
  switch (op) {
    case 0: return dp_none();
    case 1: return dp_bool(next(r) & 1);
    case 2: return dp_int(ints[next(r) % 16]);
    case 3:
      memcpy(&d, &bits[next(r) % 8], sizeof d);
      return dp_float(d);
    case 4: dp_str_new(s, next(r) % 5, &v, NULL); return v;
    case 5: dp_bytes_new(s, next(r) % 4, &v, NULL); return v;
    default: {
      unsigned k = depth > 3 ? 0 : next(r) % 3;
      dp_tuple_new(k, &v, NULL);
      for (unsigned i = 0; i < k; i++) dp_seq_set(v, i, key_of(r, depth + 1), NULL);
      return v;
    }
  }
}

static dp_value_t build(rd_t *r, dp_value_t *nodes, size_t *nn, dp_storage_t **st, int depth) {
  unsigned op = next(r) % 15;
  if (depth > 8 || ++built > MAXBUILT) op %= 6;
  dp_value_t v;
  char s[8];
  switch (op) {
    case 0: return dp_none();
    case 1: return dp_int((int64_t)next(r) - 128);
    case 2: return dp_float((double)next(r) / 3.0);
    case 3:
      snprintf(s, sizeof s, "k%u", next(r) % 10);
      dp_str_new(s, strlen(s), &v, NULL);
      return v;
    case 4: {
      int64_t shape[1] = {(int64_t)(next(r) % 8) + 1};
      /* st[4] is st[0]'s allocation described with another size */
      unsigned which = next(r) % 9;
      dp_tensor_new(dp_storage_retain(st[which < 8 ? which % 4 : 4]), DP_FLOAT32, 1, shape, NULL, next(r) % 8, &v,
                    NULL);
      return v;
    }
    case 5:  /* a reference to an earlier container: sharing or a cycle */
      if (*nn) return dp_value_retain(nodes[next(r) % *nn]);
      return dp_bool(1);
    case 6:
    case 7: {
      dp_list_new(0, &v, NULL);
      if (*nn < MAXNODES) nodes[(*nn)++] = dp_value_retain(v); /* owned: a replaced dict value may die */
      unsigned k = next(r) % 4;
      for (unsigned i = 0; i < k; i++) dp_list_append(v, build(r, nodes, nn, st, depth + 1), NULL);
      return v;
    }
    case 8: {
      unsigned k = next(r) % 3;
      dp_tuple_new(k, &v, NULL);
      for (unsigned i = 0; i < k; i++) dp_seq_set(v, i, build(r, nodes, nn, st, depth + 1), NULL);
      return v;
    }
    case 9: {
      dp_dict_new(0, &v, NULL);
      if (*nn < MAXNODES) nodes[(*nn)++] = dp_value_retain(v); /* owned: a replaced dict value may die */
      unsigned k = next(r) % 3;
      for (unsigned i = 0; i < k; i++) {
        snprintf(s, sizeof s, "d%u", next(r) % 5);
        dp_value_t key;
        dp_str_new(s, strlen(s), &key, NULL);
        dp_dict_set(v, key, build(r, nodes, nn, st, depth + 1), NULL);
      }
      return v;
    }
    case 12: return key_of(r, 0);
    case 13: {  /* a dict with keys of every kind */
      dp_dict_new(0, &v, NULL);
      if (*nn < MAXNODES) nodes[(*nn)++] = dp_value_retain(v);
      unsigned k = next(r) % 4;
      for (unsigned i = 0; i < k; i++) dp_dict_set(v, key_of(r, 0), build(r, nodes, nn, st, depth + 1), NULL);
      return v;
    }
    case 14:  /* a custom as a process without its type holds it */
      snprintf(s, sizeof s, "T%u", next(r) % 3);
      dp_object_new_reduced(s, build(r, nodes, nn, st, depth + 1), &v, NULL);
      return v;
    default: {
      dp_object_new(op == 10 ? "Layer" : "Block", &v, NULL);
      if (*nn < MAXNODES) nodes[(*nn)++] = dp_value_retain(v); /* owned: a replaced dict value may die */
      unsigned k = next(r) % 3;
      for (unsigned i = 0; i < k; i++) {
        snprintf(s, sizeof s, "a%u", next(r) % 4);
        dp_object_set(v, s, build(r, nodes, nn, st, depth + 1), NULL);
      }
      return v;
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  rd_t r = {data, size};
  built = 0;
  dp_storage_t *st[5];
  for (int i = 0; i < 4; i++)
    dp_storage_new((dp_device_t){(uint8_t)(i % 2), 0}, (void *)(uintptr_t)(0x1000 * (i + 1)), 64, NULL, NULL, &st[i], NULL);
  dp_storage_new((dp_device_t){0, 0}, (void *)(uintptr_t)0x1000, 128, NULL, NULL, &st[4], NULL);
  dp_value_t nodes[MAXNODES];
  size_t nn = 0;
  dp_value_t v = build(&r, nodes, &nn, st, 0);
  dp_ptrset_t *set;
  dp_frame_t *f;
  dp_ptrset_new(&set, NULL);
  dp_frame_new(&f, NULL);
  if (dp_scan(v, NULL, set, NULL) != 0) abort();
  /* a depth limit from the input: the writer and the reader agree on it */
  uint32_t depth = 1 + next(&r) % 12;
  dp_pickle_opts_t po = {0, depth, NULL, NULL};
  dp_unpickle_opts_t uo;
  memset(&uo, 0, sizeof uo);
  uo.limits.max_depth = depth;
  int prc = dp_pickle(v, &po, f, NULL);
  if (prc == 0) {
    dp_value_t back;
    size_t n;
    const uint8_t *b = dp_frame_data(f, &n);
    if (dp_unpickle(b, n, &uo, &back, NULL) != 0) abort();  /* written at this depth, readable at it */
    dp_value_release(back);
  } else if (prc != DP_ELIMIT && prc != DP_EINVAL) {
    abort();
  }
  /* inline: the storages carry host bytes (st[0] and st[4] disagree: refused) */
  static uint8_t host[5][128];
  for (int i = 0; i < 5; i++) {
    memset(host[i], i % 4 + 1, sizeof host[i]);
    dp_storage_set_host_data(st[i], host[i], NULL);
  }
  dp_pickle_opts_t io = {DP_PICKLE_INLINE, 0, NULL, NULL};
  if ((next(&r) & 1) && dp_pickle(v, &io, f, NULL) == 0) {
    dp_value_t back;
    size_t n;
    const uint8_t *b = dp_frame_data(f, &n);
    if (dp_unpickle(b, n, NULL, &back, NULL) != 0) abort();
    if (dp_value_equal(v, back, DP_EQ_SHARING, NULL) != 1) abort();
    fuzz_expect_rewritten_same(b, n, back, 0);  /* the bytes came along */
    dp_value_release(back);
  }
  int rc = dp_pickle(v, NULL, f, NULL);
  if (rc == DP_EINVAL) goto done;  /* st[0] and st[4] both met: refused, as it must be */
  if (rc != 0 || dp_frame_nbuffers(f) != dp_ptrset_count(set)) abort();
  size_t n;
  const uint8_t *b = dp_frame_data(f, &n);
  dp_value_t back;
  if (dp_unpickle(b, n, NULL, &back, NULL) != 0) abort();
  if (dp_value_equal(v, back, DP_EQ_SHARING, NULL) != 1) abort();
  dp_value_release(back);
  /* damage one byte */
  uint8_t *c = malloc(n);
  memcpy(c, b, n);
  size_t at = (next(&r) << 8 | next(&r)) % n;
  c[at] ^= (uint8_t)(next(&r) | 1);
  fuzz_fix_checksum(c, n);
  dp_unpickle_opts_t o = fuzz_opts();
  if (dp_unpickle(c, n, &o, &back, NULL) == 0) {
    fuzz_expect_rewritten_same(c, n, back, o.limits.max_depth);  /* a change the reader accepts is canonical */
    dp_value_release(back);
  }
  free(c);
done:
  dp_frame_free(f);
  dp_ptrset_free(set);
  dp_value_release(v);
  for (size_t i = 0; i < nn; i++) dp_value_release(nodes[i]);
  for (int i = 0; i < 5; i++) dp_storage_release(st[i]);
  dp_value_collect();  /* deferred cycles too: what is left now is a leak */
  return 0;
}
