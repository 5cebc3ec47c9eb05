/* table: the one open-addressing table (core/table.h) — insert, lookup,
 * growth, clearing by generation, deletion — and the keyed hashing that
 * keeps inputs built to collide from flooding it. Probes are counted, not
 * timed (dp__table_probes). */
#include "helpers.h"

#include "../pickler/ptrset_impl.h"

static void setup(void) { t_track(); }
static void teardown(void) { dp_set_allocator(NULL, NULL); }
TestSuite(table, .init = setup, .fini = teardown);

/* ---- a table over an array of 64-bit keys ---- */

typedef struct keys {
  uint64_t *k;
  size_t n, cap;
  uint64_t (*hash)(uint64_t);
} keys_t;

static uint64_t keyed(uint64_t k) { return dp__hash_u64(k, 0); }
/* Deliberately clustered: every key in one of 7 homes, near the table's end
 * so that runs wrap around it. */
static uint64_t clustered(uint64_t k) { return (k % 7) + 0xfffffffffffffffcull; }

static uint64_t keys_hash_at(const void *ctx, size_t i) {
  const keys_t *s = ctx;
  return s->hash(s->k[i]);
}

static inline int keys_eq(const void *ctx, size_t i, const void *key) {
  return ((const keys_t *)ctx)->k[i] == *(const uint64_t *)key;
}

static size_t t_find(dp__table_t *t, int kind, keys_t *s, uint64_t key) {
  size_t j;
  return dp__table_find(t, kind, s->hash(key), keys_eq, s, &key, &j);
}

/* Adds key if absent; returns its item. */
static size_t t_add(dp__table_t *t, int kind, keys_t *s, uint64_t key) {
  uint64_t h = s->hash(key);
  size_t j, at = dp__table_find(t, kind, h, keys_eq, s, &key, &j);
  if (at != DP_TABLE_NONE) return at;
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 16;
    s->k = realloc(s->k, s->cap * sizeof *s->k);
    cr_assert_not_null(s->k);
  }
  if (j == SIZE_MAX || dp__table_full(t)) {
    OK(dp__table_grow(t, kind, s->n, 16, keys_hash_at, s));
    j = dp__table_empty_slot(t, kind, h);
  }
  s->k[s->n] = key;
  dp__table_put(t, kind, j, h, s->n);
  return s->n++;
}

static void insert_and_find(int kind) {
  dp__table_t t;
  dp__table_init(&t);
  keys_t s = {NULL, 0, 0, keyed};
  for (uint64_t i = 0; i < 20000; i++) cr_assert_eq(t_add(&t, kind, &s, i * 4096), i, "items in insertion order");
  for (uint64_t i = 0; i < 20000; i += 3) cr_assert_eq(t_add(&t, kind, &s, i * 4096), i, "found, not added again");
  cr_assert_eq(t.count, 20000);
  cr_assert_geq(t.nslots, 2 * t.count, "load stays at most 1/2");
  cr_assert_eq(t.nslots & (t.nslots - 1), 0, "a power of two");
  for (uint64_t i = 0; i < 20000; i++) cr_assert_eq(t_find(&t, kind, &s, i * 4096), i);
  for (uint64_t i = 0; i < 1000; i++) cr_assert_eq(t_find(&t, kind, &s, i * 4096 + 1), DP_TABLE_NONE);
  double avg = (double)dp__table_probes(&t, kind, keys_hash_at, &s) / (double)t.count;
  cr_assert_leq(avg, 2.0, "%.2f probes per key on average", avg);
  dp__table_destroy(&t, kind);
  free(s.k);
  ASSERT_NO_LEAK();
}

Test(table, tagged_tables_find_every_item_they_were_given_and_nothing_else) { insert_and_find(DP_TABLE_TAGGED); }
Test(table, plain_tables_find_every_item_they_were_given_and_nothing_else) { insert_and_find(DP_TABLE_PLAIN); }

Test(table, clearing_empties_the_table_and_keeps_its_slots) {
  for (int kind = 0; kind < 2; kind++) {
    dp__table_t t;
    dp__table_init(&t);
    keys_t s = {NULL, 0, 0, keyed};
    for (uint64_t i = 0; i < 1000; i++) t_add(&t, kind, &s, i);
    void *slots = t.slots;
    size_t nslots = t.nslots;
    dp__table_clear(&t, kind);
    cr_assert_eq(t.count, 0);
    cr_assert_eq(t.slots, slots, "the slots are kept");
    cr_assert_eq(t.nslots, nslots);
    for (uint64_t i = 0; i < 1000; i++) cr_assert_eq(t_find(&t, kind, &s, i), DP_TABLE_NONE, "key %zu", (size_t)i);
    s.n = 0;
    for (uint64_t i = 0; i < 1000; i++) cr_assert_eq(t_add(&t, kind, &s, 5000 + i), i);
    cr_assert_eq(t.slots, slots, "refilled without growing");
    for (uint64_t i = 0; i < 1000; i++) cr_assert_eq(t_find(&t, kind, &s, 5000 + i), i);
    dp__table_destroy(&t, kind);
    free(s.k);
  }
  ASSERT_NO_LEAK();
}

Test(table, an_item_of_the_first_generation_stays_gone_when_the_generation_counter_wraps) {
  dp__table_t t;
  dp__table_init(&t);
  keys_t s = {NULL, 0, 0, keyed};
  t_add(&t, DP_TABLE_TAGGED, &s, 42);
  cr_assert_eq(t.gen, 1);
  /* 65,535 clears bring the 16-bit generation back to 1: the slot written
   * in generation 1 must not come back to life. */
  for (int i = 0; i < 65535; i++) dp__table_clear(&t, DP_TABLE_TAGGED);
  cr_assert_eq(t.gen, 1, "the counter wrapped");
  cr_assert_eq(t_find(&t, DP_TABLE_TAGGED, &s, 42), DP_TABLE_NONE, "a stale slot was taken for a live one");
  s.n = 0;
  cr_assert_eq(t_add(&t, DP_TABLE_TAGGED, &s, 7), 0);
  cr_assert_eq(t_find(&t, DP_TABLE_TAGGED, &s, 7), 0);
  cr_assert_eq(t_find(&t, DP_TABLE_TAGGED, &s, 42), DP_TABLE_NONE);
  dp__table_destroy(&t, DP_TABLE_TAGGED);
  free(s.k);
  ASSERT_NO_LEAK();
}

/* Removes key: backward-shift deletion, then the last item moves into the
 * hole (as the caching allocator keeps its blocks dense). */
static void t_remove(dp__table_t *t, int kind, keys_t *s, uint64_t key) {
  size_t j, at = dp__table_find(t, kind, s->hash(key), keys_eq, s, &key, &j);
  cr_assert_neq(at, DP_TABLE_NONE);
  dp__table_remove(t, kind, j, keys_hash_at, s);
  size_t last = --s->n;
  cr_assert_eq(t->count, s->n);
  size_t used = 0;
  for (size_t i = 0; i < t->nslots; i++) used += dp__table_ref(t, kind, i) != 0;
  cr_assert_eq(used, s->n, "%zu slots hold the %zu items left", used, s->n);
  if (at != last) {
    s->k[at] = s->k[last];
    dp__table_move(t, kind, s->hash(s->k[at]), last, at);
  }
}

Test(table, removing_items_from_runs_that_wrap_around_the_end_keeps_every_other_item_findable) {
  for (int kind = 0; kind < 2; kind++) {
    dp__table_t t;
    dp__table_init(&t);
    keys_t s = {NULL, 0, 0, clustered};
    for (uint64_t i = 0; i < 300; i++) t_add(&t, kind, &s, i);
    t_rng_t r = {0x9e3779b97f4a7c15ull};
    char gone[300] = {0};
    for (int round = 0; round < 200; round++) {
      uint64_t k;
      do k = t_rand(&r) % 300; while (gone[k]);
      t_remove(&t, kind, &s, k);
      gone[k] = 1;
      for (uint64_t i = 0; i < 300; i++) {
        size_t at = t_find(&t, kind, &s, i);
        if (gone[i])
          cr_assert_eq(at, DP_TABLE_NONE, "removed key %zu still found", (size_t)i);
        else
          cr_assert(at != DP_TABLE_NONE && s.k[at] == i, "key %zu lost after removing %zu", (size_t)i, (size_t)k);
      }
    }
    /* and the holes are usable again */
    for (uint64_t i = 0; i < 300; i++)
      if (gone[i]) t_add(&t, kind, &s, i);
    for (uint64_t i = 0; i < 300; i++) cr_assert_neq(t_find(&t, kind, &s, i), DP_TABLE_NONE);
    cr_assert_eq(t.count, 300);
    dp__table_destroy(&t, kind);
    free(s.k);
  }
  ASSERT_NO_LEAK();
}

Test(table, growth_that_runs_out_of_memory_leaves_the_table_intact) {
  dp__table_t t;
  dp__table_init(&t);
  keys_t s = {NULL, 0, 0, keyed};
  for (uint64_t i = 0; i < 16; i++) t_add(&t, DP_TABLE_TAGGED, &s, i);
  void *slots = t.slots;
  t_fail_at = atomic_load(&t_alloc_count) + 1;
  cr_assert_eq(dp__table_grow(&t, DP_TABLE_TAGGED, s.n, 1024, keys_hash_at, &s), DP_ENOMEM);
  t_fail_at = 0;
  cr_assert_eq(t.slots, slots);
  for (uint64_t i = 0; i < 16; i++) cr_assert_eq(t_find(&t, DP_TABLE_TAGGED, &s, i), i);
  dp__table_destroy(&t, DP_TABLE_TAGGED);
  free(s.k);
  ASSERT_NO_LEAK();
}

/* ---- hash flooding ----
 * XXH3-64 of 8 bytes is invertible: x -> rrmxmx(rotl(x, 32) ^ bitflip),
 * bitflip a function of the seed. With the seed known (the old code used
 * the value kind, or the device), anyone can pick inputs whose hashes share
 * their low 32 bits: one home slot in any table, every insert probing past
 * all the others. */

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t mul_inverse(uint64_t a) {
  uint64_t x = a;
  for (int i = 0; i < 6; i++) x *= 2 - a * x;
  return x;
}

/* Inverse of XXH3_rrmxmx(h, 8). */
static uint64_t rrmxmx_inverse(uint64_t h) {
  const uint64_t inv = mul_inverse(0x9FB21C651E98DF25ull);
  uint64_t x = h;
  for (int i = 0; i < 3; i++) x = h ^ (x >> 28);
  x *= inv;
  x ^= (x >> 35) + 8;
  x *= inv;
  /* L(x) = x ^ rotl(x, 49) ^ rotl(x, 24) satisfies L^64 = I over GF(2). */
  for (int i = 0; i < 63; i++) x = x ^ rotl64(x, 49) ^ rotl64(x, 24);
  return x;
}

/* The 8 bytes x with XXH3_64bits_withSeed(&x, 8, seed) == h. */
static uint64_t xxh3_preimage(uint64_t h, uint64_t seed) {
  uint64_t zero = 0;
  uint64_t bitflip = rrmxmx_inverse(XXH3_64bits_withSeed(&zero, 8, seed));
  uint64_t x = rotl64(rrmxmx_inverse(h) ^ bitflip, 32);
  cr_assert_eq(XXH3_64bits_withSeed(&x, 8, seed), h, "preimage of %016llx", (unsigned long long)h);
  return x;
}

/* Keys whose hash under the old fixed seed has the same low 32 bits. */
static uint64_t colliding(size_t i, uint64_t old_seed) {
  return xxh3_preimage(((uint64_t)(i + 1) << 32) | 0x5bd1e995u, old_seed);
}

static uint64_t entry_hash_at(const void *ctx, size_t i) { return ((const dp_entry_t *)ctx)[i].hash; }

static double dict_probes(dp_value_t d) {
  dp_dict_t *dd = (dp_dict_t *)d.u.h;
  cr_assert_not_null(dd->index, "a dict this large has an index");
  dp__table_t t;
  dp__table_init(&t);
  t.slots = dd->index;
  t.nslots = dd->index_cap;
  t.count = dd->len;
  return (double)dp__table_probes(&t, DP_TABLE_PLAIN, entry_hash_at, dd->entries) / (double)dd->len;
}

static dp_value_t flood_dict(size_t n) {
  dp_value_t d;
  OK(dp_dict_new(0, &d, T_ERR));
  for (size_t i = 0; i < n; i++) OK(dp_dict_set(d, dp_int((int64_t)colliding(i, DP_INT)), dp_int((int64_t)i), T_ERR));
  cr_assert_eq(dp_dict_len(d), n);
  return d;
}

Test(table, sixty_thousand_int_keys_built_to_collide_under_the_old_fixed_seed_take_a_few_probes_each) {
  dp_value_t d = flood_dict(60000);
  double avg = dict_probes(d);
  cr_assert_leq(avg, 3.0, "%.1f probes per key: the keys still collide", avg);
  for (size_t i = 0; i < 60000; i += 7) {
    dp_value_t v;
    OK(dp_dict_get(d, dp_int((int64_t)colliding(i, DP_INT)), &v, T_ERR));
    cr_assert_eq(dp_value_as_int(v), (int64_t)i);
  }
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* The keys above are real collisions: with the secret forced to zero, the
 * hash is the old one and they pile up (what the test above would see on
 * the old code; fewer keys, because that is quadratic). */
Test(table, with_the_secret_forced_to_zero_the_int_keys_do_collide) {
  dp__hash_secret_set(0);
  dp_value_t d = flood_dict(4000);
  double avg = dict_probes(d);
  cr_assert_geq(avg, 1000.0, "%.1f probes per key", avg);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

static uint64_t ptrset_hash_at(const void *ctx, size_t i) {
  const dp_ptrset_t *s = ctx;
  return dp__ptr_hash(s->rest[i].device, s->bases[i]);
}

static double flood_ptrset(size_t n) {
  dp_device_t dev = t_dev(DP_DEVICE_CUDA, 0);
  uint64_t old_seed = ((uint64_t)dev.type << 8) | dev.index;
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (size_t i = 0; i < n; i++) {
    size_t at;
    OK(dp_ptrset_add(s, dev, (void *)(uintptr_t)colliding(i, old_seed), 512, &at, T_ERR));
    cr_assert_eq(at, i);
  }
  cr_assert_eq(dp_ptrset_count(s), n);
  for (size_t i = 0; i < n; i += 11) {
    size_t at;
    OK(dp_ptrset_find(s, dev, (void *)(uintptr_t)colliding(i, old_seed), &at, T_ERR));
    cr_assert_eq(at, i);
  }
  double avg = (double)dp__table_probes(&s->tab, DP_TABLE_TAGGED, ptrset_hash_at, s) / (double)n;
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
  return avg;
}

Test(table, forty_thousand_buffer_bases_built_to_collide_under_the_old_fixed_seed_take_a_few_probes_each) {
  double avg = flood_ptrset(40000);
  cr_assert_leq(avg, 3.0, "%.1f probes per base: the bases still collide", avg);
}

Test(table, with_the_secret_forced_to_zero_the_buffer_bases_do_collide) {
  dp__hash_secret_set(0);
  double avg = flood_ptrset(4000);
  cr_assert_geq(avg, 1000.0, "%.1f probes per base", avg);
}

Test(table, the_two_step_keyed_hash_is_the_keyed_hash) {
  /* dp__hash_u64_key + dp__hash_u64_keyed (the pointer set's hash, the key
   * derived once per device) must be dp__hash_u64 bit for bit, whatever the
   * secret and the salt: the flooding tests above build on the latter. */
  uint64_t secrets[] = {0, 1, 0x9E3779B97F4A7C15ull, ~0ull};
  t_rng_t r = {7};
  for (size_t k = 0; k < 4; k++) {
    dp__hash_secret_set(secrets[k]);
    for (uint64_t salt = 0; salt < 0x300; salt += 0x81) {
      uint64_t key = dp__hash_u64_key(salt);
      for (int i = 0; i < 1000; i++) {
        uint64_t x = i < 8 ? (uint64_t)i << (8 * i) : t_rand(&r);
        cr_assert_eq(dp__hash_u64_keyed(x, key), dp__hash_u64(x, salt), "x %016llx salt %llx",
                     (unsigned long long)x, (unsigned long long)salt);
      }
    }
  }
}

Test(table, attribute_names_and_dict_keys_hash_with_the_secret) {
  /* the same key, two secrets: two hashes (a fixed seed gave one). A str
   * keeps its hash once computed (the secret is drawn once per process), so
   * each secret hashes a fresh copy. */
  dp__hash_secret_set(1);
  dp_value_t k = t_str("parameter");
  uint64_t a = dp_value_hash(k);
  dp_value_release(k);
  dp__hash_secret_set(2);
  k = t_str("parameter");
  uint64_t b = dp_value_hash(k);
  cr_assert_neq(a, b, "dp_value_hash ignores the secret");
  dp_value_release(k);
}

/* ---- nothing deterministic depends on the secret ---- */

/* Dicts and objects past their index threshold, shared nodes (the memo),
 * shared and repeated storages (the pointer set), tuple and str keys. */
static dp_value_t det_value(void) {
  dp_value_t root = t_list(), shared = t_list(), obj = t_obj("Module");
  dp_storage_t *st = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x7f0000100000u, 1 << 20);
  dp_value_t d, tk;
  OK(dp_dict_new(0, &d, T_ERR));
  for (int i = 0; i < 40; i++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d.weight", (i * 17) % 40);
    OK(dp_dict_set(d, t_str(name), t_tensor(t_dev(DP_DEVICE_CUDA, i % 2), 0x7f0000200000u + (uintptr_t)i * 4096u * 7, 64), T_ERR));
    OK(dp_dict_set(d, dp_int(1000 - i * 13), t_view(st, 16, i), T_ERR));
    OK(dp_tuple_new(2, &tk, T_ERR));
    OK(dp_seq_set(tk, 0, dp_int(i), T_ERR));
    OK(dp_seq_set(tk, 1, t_str(name), T_ERR));
    OK(dp_dict_set(d, tk, dp_value_retain(shared), T_ERR));
    snprintf(name, sizeof name, "attr_%d", (i * 7) % 40);
    OK(dp_object_set(obj, name, i % 3 ? dp_int(i) : dp_value_retain(shared), T_ERR));
  }
  OK(dp_list_append(shared, t_view(st, 8, 0), T_ERR));
  OK(dp_list_append(root, d, T_ERR));
  OK(dp_list_append(root, obj, T_ERR));
  OK(dp_list_append(root, shared, T_ERR));
  t_rng_t r = {12345};
  t_pool_t pool;
  t_pool_init(&pool, 3);
  for (int i = 0; i < 30; i++) OK(dp_list_append(root, t_random_value(&r, &pool, 0), T_ERR));
  t_pool_free(&pool);
  dp_storage_release(st);
  return root;
}

typedef struct det {
  uint8_t *frame;
  size_t n;
  char *scan;  /* discovery order and paths, one line per storage */
} det_t;

static det_t det_run(uint64_t secret) {
  dp__hash_secret_set(secret);
  dp_value_t v = det_value();
  det_t out;
  dp_frame_t *f;
  OK(dp_frame_new(&f, T_ERR));
  OK(dp_pickle(v, NULL, f, T_ERR));
  const uint8_t *p = dp_frame_data(f, &out.n);
  out.frame = malloc(out.n);
  memcpy(out.frame, p, out.n);
  dp_frame_free(f);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_scan_opts_t o = {DP_SCAN_PATHS, 0};
  OK(dp_scan(v, &o, s, T_ERR));
  size_t cap = 1 << 16, len = 0;
  out.scan = malloc(cap);
  for (size_t i = 0; i < dp_ptrset_count(s); i++) {
    dp_ptr_info_t e;
    OK(dp_ptrset_get(s, i, &e, T_ERR));
    len += (size_t)snprintf(out.scan + len, cap - len, "%u:%u %p %zu %u %s\n", e.device.type, e.device.index, e.base,
                            e.nbytes, e.refs, e.path);
    cr_assert_lt(len, cap);
  }
  dp_ptrset_free(s);
  /* read back: the dict's insertion order survives */
  dp_value_t back, d, k;
  OK(dp_unpickle(out.frame, out.n, NULL, &back, T_ERR));
  d = dp_seq_get(back, 0);
  cr_assert_eq(dp_dict_len(d), 120);
  OK(dp_dict_item(d, 1, &k, NULL, T_ERR));
  cr_assert_eq(dp_value_as_int(k), 1000);
  cr_assert_eq(dp_value_equal(v, back, DP_EQ_SHARING, NULL), 1);
  dp_value_release(back);
  dp_value_release(v);
  return out;
}

Test(table, pickled_bytes_discovery_order_and_paths_do_not_depend_on_the_secret) {
  det_t a = det_run(0x0123456789abcdefull), b = det_run(0xfedcba9876543210ull), c = det_run(0);
  cr_assert_eq(a.n, b.n);
  cr_assert(memcmp(a.frame, b.frame, a.n) == 0, "the pickled bytes changed with the secret");
  cr_assert_eq(a.n, c.n);
  cr_assert(memcmp(a.frame, c.frame, a.n) == 0, "the pickled bytes changed with the secret");
  cr_assert_str_eq(a.scan, b.scan, "the scan's order or paths changed with the secret");
  cr_assert_str_eq(a.scan, c.scan);
  free(a.frame), free(b.frame), free(c.frame);
  free(a.scan), free(b.scan), free(c.scan);
  ASSERT_NO_LEAK();
}

Test(table, a_set_reused_past_the_generation_counter_still_finds_and_counts_right) {
  /* One scan of 200 storages, then 70,000 scans of one other storage: the
   * pointer set's generation wraps. The first scan after the wrap looks for
   * the last 10 of the 200 (held twice, so the memo sees them too): the
   * slots the big scan wrote in the first generation must not be taken for
   * live ones then. */
  dp_value_t big = t_list(), small = t_list(), other = t_list();
  for (int i = 0; i < 200; i++) {
    dp_value_t t = t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x7f0000000000u + (uintptr_t)i * 65536u, 16);
    if (i >= 190) OK(dp_list_append(small, dp_value_retain(t), T_ERR));
    OK(dp_list_append(big, t, T_ERR));
  }
  OK(dp_list_append(other, t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x7f1000000000u, 16), T_ERR));
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_scan(big, NULL, s, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 200);
  int wrapped = 0;
  for (int i = 0; i < 70000; i++) {
    dp_ptrset_clear(s);
    if (s->tab.gen == 1) {  /* the generation of the big scan again */
      wrapped = 1;
      OK(dp_scan(small, NULL, s, T_ERR));
      cr_assert_eq(dp_ptrset_count(s), 10, "scan %d", i);
      for (size_t k = 0; k < 10; k++) {
        dp_ptr_info_t e;
        OK(dp_ptrset_get(s, k, &e, T_ERR));
        cr_assert_eq(e.base, (void *)(0x7f0000000000u + (190 + k) * 65536u));
        cr_assert_eq(e.refs, 1);
      }
    } else {
      OK(dp_scan(other, NULL, s, T_ERR));
      cr_assert_eq(dp_ptrset_count(s), 1, "scan %d", i);
    }
  }
  cr_assert(wrapped, "the generation never wrapped");
  dp_ptrset_free(s);
  dp_value_release(big);
  dp_value_release(small);
  dp_value_release(other);
  ASSERT_NO_LEAK();
}

/* Growth leaves room for one more item at a load of at most one half, and
 * refuses (before allocating anything) a table of 2^32 - 1 items, which
 * item numbers + 1 in 32 bits cannot hold. */
Test(table, growth_leaves_room_for_one_more_and_refuses_more_items_than_32_bits_number) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    for (size_t n = 0; n < 100; n++) {
      dp__table_t t;
      dp__table_init(&t);
      keys_t s = {calloc(n + 1, sizeof(uint64_t)), n, n + 1, keyed};
      for (size_t i = 0; i < n; i++) s.k[i] = i * 8;
      OK(dp__table_grow(&t, kind, n, 0, keys_hash_at, &s));
      cr_assert_eq(t.count, n);
      cr_assert(!dp__table_full(&t), "%zu items in %zu slots: no room for one more", n, t.nslots);
      cr_assert_eq(t.nslots & (t.nslots - 1), 0, "a power of two");
      for (size_t i = 0; i < n; i++) cr_assert_eq(t_find(&t, kind, &s, i * 8), i);
      dp__table_destroy(&t, kind);
      free(s.k);
    }
    dp__table_t t;
    dp__table_init(&t);
    long before = t_alloc_count;
    t_fail_at = t_alloc_count + 1; /* nothing may be allocated; if it is, it fails */
    cr_assert_eq(dp__table_grow(&t, kind, (size_t)UINT32_MAX - 1, 0, keys_hash_at, NULL), DP_ELIMIT);
    cr_assert_eq(t_alloc_count, before, "the refused growth allocated");
    cr_assert_eq(dp__table_grow(&t, kind, (size_t)UINT32_MAX - 2, 0, keys_hash_at, NULL), DP_ENOMEM,
                 "2^32 - 2 items are not refused as too many");
    t_fail_at = 0;
    cr_assert_eq(t.nslots, 0, "a failed growth leaves the table as it was");
  }
  ASSERT_NO_LEAK();
}

/* Probes count each item's distance from its home slot, plus one: items at
 * their homes take one each, a run of three on one home takes 1 + 2 + 3. */
static uint64_t home_of(uint64_t k) { return k >> 8; }

Test(table, probes_are_the_distance_from_home_plus_one_for_each_item) {
  dp__table_t t;
  dp__table_init(&t);
  keys_t s = {NULL, 0, 0, home_of};
  /* homes 1, 5, 9: one probe each */
  t_add(&t, DP_TABLE_PLAIN, &s, 1 << 8);
  t_add(&t, DP_TABLE_PLAIN, &s, 5 << 8);
  t_add(&t, DP_TABLE_PLAIN, &s, 9 << 8);
  cr_assert_eq(dp__table_probes(&t, DP_TABLE_PLAIN, keys_hash_at, &s), 3);
  /* three more at home 12: 1 + 2 + 3 */
  t_add(&t, DP_TABLE_PLAIN, &s, (12 << 8) | 1);
  t_add(&t, DP_TABLE_PLAIN, &s, (12 << 8) | 2);
  t_add(&t, DP_TABLE_PLAIN, &s, (12 << 8) | 3);
  cr_assert_eq(t.nslots, 16);
  cr_assert_eq(dp__table_probes(&t, DP_TABLE_PLAIN, keys_hash_at, &s), 3 + 6);
  dp__table_destroy(&t, DP_TABLE_PLAIN);
  free(s.k);
  ASSERT_NO_LEAK();
}

/* Moving an item the table does not hold changes nothing (and returns). */
Test(table, moving_an_item_the_table_does_not_hold_changes_nothing) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    dp__table_t t;
    dp__table_init(&t);
    keys_t s = {NULL, 0, 0, keyed};
    for (uint64_t i = 0; i < 10; i++) t_add(&t, kind, &s, i * 64);
    dp__table_move(&t, kind, keyed(12345), 20, 3);  /* item 20 does not exist */
    for (uint64_t i = 0; i < 10; i++) cr_assert_eq(t_find(&t, kind, &s, i * 64), i);
    cr_assert_eq(t.count, 10);
    dp__table_destroy(&t, kind);
    free(s.k);
  }
  ASSERT_NO_LEAK();
}

/* Growth takes the fewest slots that keep the load at most one half with
 * one more item (and at least 4), or min_slots when that is more: a table
 * twice as large as needed would still find everything, so only the count
 * of slots shows it. */
static size_t fewest_slots(size_t n, size_t min_slots) {
  size_t want = 4;
  while (want < min_slots || want < 2 * (n + 1)) want *= 2;
  return want;
}

Test(table, growth_takes_the_fewest_slots_a_power_of_two_for_a_load_of_one_half_and_at_least_min_slots) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    for (size_t n = 0; n < 70; n++) {
      static const size_t mins[] = {0, 1, 3, 4, 5, 16, 63, 64, 65, 100, 256};
      for (size_t m = 0; m < sizeof mins / sizeof *mins; m++) {
        size_t min_slots = mins[m];
        dp__table_t t;
        dp__table_init(&t);
        keys_t s = {calloc(n + 1, sizeof(uint64_t)), n, n + 1, keyed};
        for (size_t i = 0; i < n; i++) s.k[i] = i * 8;
        OK(dp__table_grow(&t, kind, n, min_slots, keys_hash_at, &s));
        cr_assert_eq(t.nslots, fewest_slots(n, min_slots), "%zu items, min_slots %zu: %zu slots, not %zu", n,
                     min_slots, t.nslots, fewest_slots(n, min_slots));
        for (size_t i = 0; i < n; i++) cr_assert_eq(t_find(&t, kind, &s, i * 8), i);
        cr_assert_eq(t_find(&t, kind, &s, 1), DP_TABLE_NONE);
        dp__table_destroy(&t, kind);
        free(s.k);
      }
    }
  }
  cr_assert_eq(fewest_slots(3, 0), 8);
  cr_assert_eq(fewest_slots(3, 64), 64);
  cr_assert_eq(fewest_slots(3, 65), 128);
  cr_assert_eq(fewest_slots(0, 5), 8);
  ASSERT_NO_LEAK();
}

/* A table of min_slots slots whose size in bytes would pass SIZE_MAX is
 * DP_ENOMEM before anything is allocated; the largest power of two that
 * fits is asked of the allocator (which refuses it here). */
Test(table, growth_to_more_slots_than_a_size_t_can_measure_is_enomem_without_allocating) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    size_t ssize = dp__table_slot_size(kind), most = ((size_t)1 << 63) / ssize; /* most * 2 * ssize == 2^64 */
    dp__table_t t;
    dp__table_init(&t);
    long before = t_alloc_count;
    cr_assert_eq(dp__table_grow(&t, kind, 0, most + 1, keys_hash_at, NULL), DP_ENOMEM);
    cr_assert_eq(dp__table_grow(&t, kind, 0, SIZE_MAX, keys_hash_at, NULL), DP_ENOMEM);
    cr_assert_eq(t_alloc_count, before, "slots past SIZE_MAX bytes were asked for");
    t_fail_at = t_alloc_count + 1; /* refused by the allocator, never handed to realloc (ASan aborts on such a size) */
    cr_assert_eq(dp__table_grow(&t, kind, 0, most, keys_hash_at, NULL), DP_ENOMEM);
    t_fail_at = 0;
    cr_assert_eq(t_alloc_count, before + 1, "the largest table that can be measured was not asked for");
    cr_assert_eq(t.nslots, 0, "a failed growth leaves the table as it was");
    cr_assert_null(t.slots);
  }
  ASSERT_NO_LEAK();
}

/* An item whose run wraps past the last slot is as far from its home as
 * the slots between, counted across the end: three items whose home is
 * the last slot of 16 sit in slots 15, 0 and 1 and take 1 + 2 + 3. */
Test(table, probes_count_the_distance_of_items_whose_run_wraps_around_the_end) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    dp__table_t t;
    dp__table_init(&t);
    keys_t s = {NULL, 0, 0, home_of};
    for (uint64_t i = 1; i <= 3; i++) t_add(&t, kind, &s, (15 << 8) | i);
    cr_assert_eq(t.nslots, 16);
    cr_assert_eq(dp__table_ref(&t, kind, 15), 1, "the first item at its home, the last slot");
    cr_assert_eq(dp__table_ref(&t, kind, 0), 2);
    cr_assert_eq(dp__table_ref(&t, kind, 1), 3);
    cr_assert_eq(dp__table_probes(&t, kind, keys_hash_at, &s), 1 + 2 + 3);
    dp__table_destroy(&t, kind);
    free(s.k);
  }
  ASSERT_NO_LEAK();
}

/* A destroyed table is empty as after dp__table_init: no slots, nothing
 * found, and it can be grown (and destroyed) again. */
Test(table, a_destroyed_table_is_as_after_init_and_can_be_grown_and_destroyed_again) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    dp__table_t t;
    dp__table_init(&t);
    keys_t s = {NULL, 0, 0, keyed};
    for (uint64_t i = 0; i < 10; i++) t_add(&t, kind, &s, i * 64);
    dp__table_destroy(&t, kind);
    cr_assert_null(t.slots);
    cr_assert_eq(t.nslots, 0);
    cr_assert_eq(t.count, 0);
    size_t j = 0;
    uint64_t key = 64;
    cr_assert_eq(dp__table_find(&t, kind, keyed(key), keys_eq, &s, &key, &j), DP_TABLE_NONE);
    cr_assert_eq(j, SIZE_MAX, "a table without slots has no slot to fill");
    OK(dp__table_grow(&t, kind, s.n, 16, keys_hash_at, &s));
    for (uint64_t i = 0; i < 10; i++) cr_assert_eq(t_find(&t, kind, &s, i * 64), i);
    dp__table_destroy(&t, kind);
    dp__table_destroy(&t, kind);
    free(s.k);
  }
  ASSERT_NO_LEAK();
}

/* Moving an item finds its slot from the item's home: an item sitting at
 * its home, with the slot after it empty, is renamed there (removing item
 * 0, then moving the last item into its place, as an owner does). */
Test(table, moving_an_item_at_its_home_renames_it_in_its_slot) {
  for (int kind = DP_TABLE_PLAIN; kind <= DP_TABLE_TAGGED; kind++) {
    dp__table_t t;
    dp__table_init(&t);
    keys_t s = {NULL, 0, 0, home_of};
    t_add(&t, kind, &s, 1 << 8);
    t_add(&t, kind, &s, 5 << 8);
    t_add(&t, kind, &s, 9 << 8);
    uint64_t key = 1 << 8;
    size_t j;
    cr_assert_eq(dp__table_find(&t, kind, home_of(key), keys_eq, &s, &key, &j), 0);
    dp__table_remove(&t, kind, j, keys_hash_at, &s);
    s.k[0] = s.k[2];
    s.n = 2;
    dp__table_move(&t, kind, home_of(s.k[0]), 2, 0);
    cr_assert_eq(dp__table_ref(&t, kind, 9), 1, "slot 9 holds item 0 now");
    cr_assert_eq(t_find(&t, kind, &s, 9 << 8), 0);
    cr_assert_eq(t_find(&t, kind, &s, 5 << 8), 1);
    cr_assert_eq(t_find(&t, kind, &s, 1 << 8), DP_TABLE_NONE);
    cr_assert_eq(t.count, 2);
    dp__table_destroy(&t, kind);
    free(s.k);
  }
  ASSERT_NO_LEAK();
}
