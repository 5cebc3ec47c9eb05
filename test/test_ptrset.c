/* ptrset: dedup by device + base, discovery order, device groups, reuse. */
#include <pthread.h>

#include "helpers.h"

/* The set's layout and its frozen records (pickler/ptrs.h): the hash a
 * base gets, the table's size, dp__ptrset_add_refs and dp__ptrs_freeze. */
#include "../pickler/ptrset_impl.h"

/* t_alloc, with every byte it hands out new set to 0xA5: nothing in the
 * set may read memory it did not write (a fresh block is often zeroed). */
static void *poisoned_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  void *p = t_alloc(ud, ptr, osize, nsize);
  if (p && nsize > osize) memset((char *)p + osize, 0xA5, nsize - osize);
  return p;
}

static void setup(void) {
  t_track();
  dp_set_allocator(poisoned_alloc, NULL);
}
static void teardown(void) { dp_set_allocator(NULL, NULL); }
TestSuite(ptrset, .init = setup, .fini = teardown);

Test(ptrset, the_same_base_on_the_same_device_is_one_entry_with_a_count) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  size_t i;
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x1000, 64, &i, T_ERR));
  cr_assert_eq(i, 0);
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 1), (void *)0x1000, 64, &i, T_ERR));
  cr_assert_eq(i, 1, "another device is another allocation");
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x1000, 128, &i, T_ERR));
  cr_assert_eq(i, 0);
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_eq(p.refs, 2);
  cr_assert_eq(p.nbytes, 128, "the larger size is kept");
  cr_assert_null(p.path, "no path unless a scan asked for it");
  cr_assert_eq(dp_ptrset_find(s, t_dev(DP_DEVICE_CUDA, 1), (void *)0x1000, &i, NULL), 0);
  cr_assert_eq(i, 1);
  cr_assert_eq(dp_ptrset_find(s, t_dev(DP_DEVICE_HOST, 0), (void *)0x1000, &i, NULL), DP_ENOTFOUND);
  cr_assert_eq(dp_ptrset_get(s, 2, &p, NULL), DP_EINVAL);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

Test(ptrset, a_hundred_thousand_entries_keep_discovery_order_and_device_groups) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 100000; k++)
    OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, (int)(k % 3)), (void *)(0x10000 + k * 512), 512, NULL, T_ERR));
  for (uintptr_t k = 0; k < 100000; k += 7)
    OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, (int)(k % 3)), (void *)(0x10000 + k * 512), 512, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 100000);
  cr_assert_eq(dp_ptrset_ndevices(s), 3);
  for (size_t j = 0; j < 3; j++) {
    cr_assert_eq(dp_ptrset_device(s, j).index, j);
    size_t n = 0, prev = 0;
    for (size_t i = dp_ptrset_first_on(s, j); i != SIZE_MAX; i = dp_ptrset_next_on(s, i)) {
      cr_assert(n == 0 || i > prev, "discovery order within a group");
      cr_assert_eq(i % 3, j);
      prev = i;
      n++;
    }
    cr_assert_eq(n, dp_ptrset_device_count(s, j));
  }
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 99995, &p, T_ERR));
  cr_assert_eq((uintptr_t)p.base, 0x10000 + 99995u * 512);
  cr_assert_eq(p.refs, 1 + (99995 % 7 == 0));
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

static void expect_chain(dp_ptrset_t *s, size_t g, const size_t *want, size_t n) {
  size_t k = 0;
  for (size_t i = dp_ptrset_first_on(s, g); i != SIZE_MAX; i = dp_ptrset_next_on(s, i), k++) {
    cr_assert_lt(k, n, "device %zu: more entries than %zu", g, n);
    cr_assert_eq(i, want[k], "device %zu, entry %zu: %zu, expected %zu", g, k, i, want[k]);
  }
  cr_assert_eq(k, n, "device %zu: %zu entries, expected %zu", g, k, n);
  cr_assert_eq(dp_ptrset_device_count(s, g), n);
}

Test(ptrset, device_groups_stay_in_order_when_a_second_device_comes_late) {
  /* 1000 entries on one device, then another device, then both again; then
   * the same after a clear, with the devices the other way round. */
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  size_t *a = malloc(2000 * sizeof *a), *b = malloc(2000 * sizeof *b);
  for (int round = 0; round < 2; round++) {
    dp_device_t d0 = t_dev(DP_DEVICE_CUDA, round), d1 = t_dev(DP_DEVICE_CUDA, 1 - round);
    size_t na = 0, nb = 0, i;
    dp_ptrset_clear(s);
    for (uintptr_t k = 0; k < 1000; k++) {
      OK(dp_ptrset_add(s, d0, (void *)(0x10000 + k * 64), 64, &i, T_ERR));
      a[na++] = i;
    }
    expect_chain(s, 0, a, na);
    OK(dp_ptrset_add(s, d1, (void *)0x10000, 64, &i, T_ERR));
    b[nb++] = i;
    for (uintptr_t k = 1000; k < 1500; k++) {
      OK(dp_ptrset_add(s, k % 3 ? d0 : d1, (void *)(0x10000 + k * 64), 64, &i, T_ERR));
      if (k % 3) a[na++] = i; else b[nb++] = i;
    }
    OK(dp_ptrset_add(s, d0, (void *)0x10000, 64, &i, T_ERR));  /* met again: no new entry */
    cr_assert_eq(i, 0);
    cr_assert_eq(dp_ptrset_ndevices(s), 2);
    cr_assert(dp_device_equal(dp_ptrset_device(s, 0), d0));
    expect_chain(s, 0, a, na);
    expect_chain(s, 1, b, nb);
  }
  free(a);
  free(b);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

Test(ptrset, clear_keeps_memory_so_refilling_allocates_nothing) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 5000; k++) OK(dp_ptrset_add(s, t_dev(DP_DEVICE_HOST, 1), (void *)(k * 64 + 64), 64, NULL, T_ERR));
  long before = t_alloc_count;
  for (int round = 0; round < 3; round++) {
    dp_ptrset_clear(s);
    cr_assert_eq(dp_ptrset_count(s), 0);
    cr_assert_eq(dp_ptrset_ndevices(s), 0);
    size_t i;
    cr_assert_eq(dp_ptrset_find(s, t_dev(DP_DEVICE_HOST, 1), (void *)64, &i, NULL), DP_ENOTFOUND, "cleared means gone");
    for (uintptr_t k = 0; k < 5000; k++) OK(dp_ptrset_add(s, t_dev(DP_DEVICE_HOST, 1), (void *)(k * 64 + 64), 64, NULL, T_ERR));
  }
  cr_assert_eq(t_alloc_count, before);
  cr_assert_eq(dp_ptrset_count(s), 5000);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

Test(ptrset, a_failed_add_leaves_the_set_as_it_was) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  size_t added = 0;
  for (uintptr_t k = 0; k < 2000; k++) {
    t_fail_at = t_alloc_count + 1;
    dp_error_t e;
    int rc = dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, (int)(k & 1)), (void *)(k * 16 + 16), 16, NULL, &e);
    if (rc == 0) {
      added++;
    } else {
      cr_assert_eq(rc, DP_ENOMEM);
      cr_assert(strncmp(e.message, "out of memory growing a pointer set", 35) == 0, "%s", e.message);
      cr_assert_eq(dp_ptrset_count(s), added);
      t_fail_at = 0;
      OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, (int)(k & 1)), (void *)(k * 16 + 16), 16, NULL, T_ERR));
      added++;
    }
  }
  t_fail_at = 0;
  cr_assert_eq(dp_ptrset_count(s), 2000);
  cr_assert_eq(dp_ptrset_ndevices(s), 2);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* dp_ptrset_add_many is n dp_ptrset_add calls: the same entries, order,
 * counts, sizes, device groups and indices, over runs longer than its
 * internal run, devices alternating and bases met again. */
Test(ptrset, adding_many_at_once_gives_what_adding_each_in_turn_gives) {
  enum { N = 1000 };
  dp_ptr_info_t *items = calloc(N, sizeof *items);
  size_t *got = calloc(N, sizeof *got), want;
  for (size_t k = 0; k < N; k++) {
    size_t b = k % 7 == 3 ? k / 2 : k; /* every 7th a base met before (or next) */
    items[k] = (dp_ptr_info_t){t_dev(k % 50 < 45 ? DP_DEVICE_CUDA : DP_DEVICE_HOST, (int)(k / 400)),
                               (void *)(0x1000 + b * 64), 16 + k % 5, 99, "ignored"};
  }
  dp_ptrset_t *a, *b;
  OK(dp_ptrset_new(&a, T_ERR));
  OK(dp_ptrset_new(&b, T_ERR));
  OK(dp_ptrset_add(a, t_dev(DP_DEVICE_CUDA, 0), (void *)0x1000, 8, NULL, T_ERR)); /* both hold one already */
  OK(dp_ptrset_add(b, t_dev(DP_DEVICE_CUDA, 0), (void *)0x1000, 8, NULL, T_ERR));
  OK(dp_ptrset_add_many(a, items, 300, got, T_ERR));
  OK(dp_ptrset_add_many(a, items + 300, N - 300, got + 300, T_ERR));
  for (size_t k = 0; k < N; k++) {
    OK(dp_ptrset_add(b, items[k].device, items[k].base, items[k].nbytes, &want, T_ERR));
    cr_assert_eq(got[k], want, "item %zu: index %zu, one by one %zu", k, got[k], want);
  }
  cr_assert_eq(dp_ptrset_count(a), dp_ptrset_count(b));
  for (size_t i = 0; i < dp_ptrset_count(a); i++) {
    dp_ptr_info_t x, y;
    OK(dp_ptrset_get(a, i, &x, T_ERR));
    OK(dp_ptrset_get(b, i, &y, T_ERR));
    cr_assert(x.base == y.base && x.nbytes == y.nbytes && x.refs == y.refs &&
                  x.device.type == y.device.type && x.device.index == y.device.index && !x.path,
              "entry %zu differs", i);
  }
  cr_assert_eq(dp_ptrset_ndevices(a), dp_ptrset_ndevices(b));
  for (size_t j = 0; j < dp_ptrset_ndevices(a); j++) {
    cr_assert_eq(dp_ptrset_device_count(a, j), dp_ptrset_device_count(b, j));
    for (size_t i = dp_ptrset_first_on(a, j), k = dp_ptrset_first_on(b, j); i != SIZE_MAX || k != SIZE_MAX;
         i = dp_ptrset_next_on(a, i), k = dp_ptrset_next_on(b, k))
      cr_assert_eq(i, k, "device %zu's chain differs", j);
  }
  OK(dp_ptrset_add_many(a, NULL, 0, NULL, T_ERR)); /* nothing to add */
  dp_ptrset_free(a);
  dp_ptrset_free(b);
  free(items);
  free(got);
  ASSERT_NO_LEAK();
}

Test(ptrset, adding_many_refuses_a_bad_item_or_no_memory_and_changes_nothing) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_ptr_info_t items[3] = {{t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 0), (void *)0x80, 8, 0, NULL},
                            {{DP_DEVICE_TYPE_COUNT, 0}, (void *)0xc0, 8, 0, NULL}};
  dp_error_t e;
  cr_assert_eq(dp_ptrset_add_many(s, items, 3, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add_many: item 2: invalid device (type 3, index 0)");
  cr_assert_eq(dp_ptrset_count(s), 0);
  cr_assert_eq(dp_ptrset_add(s, t_dev(DP_DEVICE_CPU, 3), (void *)0x40, 8, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add: invalid device (type 0, index 3)", "cpu has index 0 only");
  cr_assert_eq(dp_ptrset_add_many(s, NULL, 2, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add_many: NULL items");
  cr_assert_eq(dp_ptrset_add_many(NULL, items, 2, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add_many: NULL set");
  t_fail_at = t_alloc_count + 1;
  int rc = dp_ptrset_add_many(s, items, 2, NULL, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM);
  cr_assert(strncmp(e.message, "out of memory growing a pointer set", 35) == 0, "%s", e.message);
  cr_assert_eq(dp_ptrset_count(s), 0);
  OK(dp_ptrset_add_many(s, items, 2, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 2);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* Every item is checked before any is added, the first one too. */
Test(ptrset, adding_many_refuses_a_bad_first_item_naming_item_0_and_changes_nothing) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_ptr_info_t items[2] = {{t_dev(DP_DEVICE_CPU, 1), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 0), (void *)0x80, 8, 0, NULL}};
  dp_error_t e;
  cr_assert_eq(dp_ptrset_add_many(s, items, 2, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add_many: item 0: invalid device (type 0, index 1)");
  cr_assert_eq(dp_ptrset_count(s), 0);
  cr_assert_eq(dp_ptrset_ndevices(s), 0);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

Test(ptrset, a_null_set_is_einval_with_a_message_and_a_miss_says_what_was_missed) {
  dp_error_t e;
  size_t i;
  dp_ptr_info_t p;
  cr_assert_eq(dp_ptrset_find(NULL, t_dev(DP_DEVICE_CUDA, 0), (void *)64, &i, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_find: NULL set");
  cr_assert_eq(dp_ptrset_get(NULL, 0, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_get: NULL set");
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_find(s, t_dev(DP_DEVICE_CUDA, 1), (void *)0x40, &i, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_ptrset_find: cuda:1 0x40 is not in the set");
  cr_assert_eq(dp_ptrset_get(s, 1, &p, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_get: index 1 out of range (the set holds 1)");
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* Paths are kept beside the entries, for those a scan with paths added:
 * an entry added without one (dp_ptrset_add, or a scan without paths)
 * reads NULL, before and after entries that have one, and a clear drops
 * them all. */
Test(ptrset, paths_belong_to_the_entries_a_scan_with_paths_added_and_to_no_other) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_device_t d = t_dev(DP_DEVICE_HOST, 0);
  OK(dp_ptrset_add(s, d, (void *)0x1000, 64, NULL, T_ERR));
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(d, 0x2000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(d, 0x1000, 4), T_ERR));  /* already in: keeps no path */
  OK(dp_list_append(l, t_tensor(d, 0x3000, 4), T_ERR));
  dp_scan_opts_t o = {0};
  o.flags = DP_SCAN_PATHS;
  OK(dp_scan(l, &o, s, T_ERR));
  OK(dp_ptrset_add(s, d, (void *)0x4000, 64, NULL, T_ERR));
  static const char *const want[] = {NULL, "$[0]", "$[2]", NULL};
  cr_assert_eq(dp_ptrset_count(s), 4);
  for (size_t i = 0; i < 4; i++) {
    dp_ptr_info_t p;
    OK(dp_ptrset_get(s, i, &p, T_ERR));
    if (want[i]) cr_assert_str_eq(p.path, want[i], "entry %zu", i);
    else cr_assert_null(p.path, "entry %zu has no path", i);
  }
  dp_ptrset_clear(s);
  OK(dp_ptrset_add(s, d, (void *)0x5000, 64, NULL, T_ERR));
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_null(p.path, "a clear drops the paths");
  dp_value_release(l);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* Paths are copied into chunks that a clear keeps: 400 paths of 64
 * bytes fill several, all kept, and a second scan after a clear reuses them
 * without allocating and reads its own paths back. */
Test(ptrset, paths_longer_than_one_chunk_are_all_kept_and_reused_after_a_clear) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_device_t d = t_dev(DP_DEVICE_HOST, 0);
  enum { N = 400 };
  char key[80];
  dp_value_t dict;
  OK(dp_dict_new(N, &dict, T_ERR));
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof key, "k%060d", i);
    OK(dp_dict_set(dict, t_str(key), t_tensor(d, 0x1000 + 0x100 * (uintptr_t)i, 4), T_ERR));
  }
  dp_scan_opts_t o = {0};
  o.flags = DP_SCAN_PATHS;
  long before = 0;
  for (int round = 0; round < 2; round++) {
    dp_ptrset_clear(s);
    if (round) before = t_alloc_count;
    OK(dp_scan(dict, &o, s, T_ERR));
    if (round) cr_assert_eq(t_alloc_count, before, "the second scan allocated %ld times", t_alloc_count - before);
    cr_assert_eq(dp_ptrset_count(s), N);
    for (int i = 0; i < N; i++) {
      dp_ptr_info_t p;
      OK(dp_ptrset_get(s, (size_t)i, &p, T_ERR));
      char want[96];
      snprintf(want, sizeof want, "$.k%060d", i);
      cr_assert_str_eq(p.path, want, "round %d, entry %d: %s", round, i, p.path);
    }
  }
  dp_value_release(dict);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A second device met after a clear, with the first device's entries
 * chained before the clear: the first device's chain ends at its last entry
 * (what the earlier fill left in the chain is not followed). */
Test(ptrset, a_device_chain_ends_at_its_last_entry_when_another_device_comes_after_a_clear) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0), b = t_dev(DP_DEVICE_CUDA, 1);
  /* a, b, then a four times: entries 0 and 2..5 of a chained */
  OK(dp_ptrset_add(s, a, (void *)0x100, 8, NULL, T_ERR));
  OK(dp_ptrset_add(s, b, (void *)0x100, 8, NULL, T_ERR));
  for (uintptr_t k = 0; k < 4; k++) OK(dp_ptrset_add(s, a, (void *)(0x200 + 0x100 * k), 8, NULL, T_ERR));
  dp_ptrset_clear(s);
  /* a three times, then b: a's chain is 0, 1, 2 and ends there */
  for (uintptr_t k = 0; k < 3; k++) OK(dp_ptrset_add(s, a, (void *)(0x1000 + 0x100 * k), 8, NULL, T_ERR));
  OK(dp_ptrset_add(s, b, (void *)0x1000, 8, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_ndevices(s), 2);
  size_t want_a[] = {0, 1, 2}, want_b[] = {3};
  expect_chain(s, 0, want_a, 3);
  expect_chain(s, 1, want_b, 1);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* Out-of-range device and entry numbers read as nothing, a NULL set too. */
Test(ptrset, a_device_or_entry_number_past_the_end_reads_as_nothing) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 3; k++) {
    OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
    OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 1), (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
  }
  cr_assert_eq(dp_ptrset_ndevices(s), 2);
  cr_assert_eq(dp_ptrset_device_count(s, 2), 0);
  cr_assert_eq(dp_ptrset_device_count(s, 1000), 0);
  cr_assert_eq(dp_ptrset_first_on(s, 2), SIZE_MAX);
  cr_assert(dp_device_equal(dp_ptrset_device(s, 2), t_dev(DP_DEVICE_CPU, 0)));
  cr_assert_eq(dp_ptrset_next_on(s, 5), SIZE_MAX, "entry 5 is the last");
  cr_assert_eq(dp_ptrset_next_on(s, 6), SIZE_MAX, "there is no entry 6");
  cr_assert_eq(dp_ptrset_next_on(s, 1000), SIZE_MAX);
  cr_assert_eq(dp_ptrset_count(NULL), 0);
  cr_assert_eq(dp_ptrset_ndevices(NULL), 0);
  cr_assert_eq(dp_ptrset_device_count(NULL, 0), 0);
  cr_assert_eq(dp_ptrset_first_on(NULL, 0), SIZE_MAX);
  cr_assert_eq(dp_ptrset_next_on(NULL, 0), SIZE_MAX);
  dp_ptrset_clear(NULL);
  dp_ptrset_free(NULL);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* Adding many whose new device cannot get its group fails with ENOMEM;
 * whenever it succeeds, every item is in the set. */
/* Plain or raw (a completion's walk), every allocation a batch's new
 * devices need may fail: the batch then fails, saying so. */
Test(ptrset, adding_many_with_a_new_device_that_runs_out_of_memory_fails_and_a_success_holds_every_item) {
  dp_ptr_info_t items[4] = {{t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 1), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 2), (void *)0x80, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 1), (void *)0x80, 8, 0, NULL}};
  for (int raw = 0; raw < 2; raw++) {
    int failed = 0;
    for (long k = 1;; k++) {
      cr_assert_lt(k, 100);
      dp_ptrset_t *s;
      OK(dp_ptrset_new(&s, T_ERR));
      dp__ptrset_set_raw(s, raw);
      OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
      dp_error_t e;
      t_fail_at = t_alloc_count + k;
      int rc = dp_ptrset_add_many(s, items, 4, NULL, &e);
      t_fail_at = 0;
      if (rc) {
        failed++;
        cr_assert_eq(rc, DP_ENOMEM, "raw %d, allocation %ld: %s", raw, k, e.message);
        cr_assert(strncmp(e.message, "out of memory growing a pointer set", 35) == 0, "%s", e.message);
        dp_ptrset_free(s);
        continue;
      }
      cr_assert_eq(dp_ptrset_count(s), 4, "raw %d: allocation %ld failed and add_many returned 0", raw, k);
      cr_assert_eq(dp_ptrset_ndevices(s), 3);
      for (int i = 0; i < 4; i++) {
        dp_ptr_info_t p;
        OK(dp_ptrset_get(s, (size_t)i, &p, T_ERR));
        cr_assert(p.base == items[i].base && dp_device_equal(p.device, items[i].device), "raw %d: entry %d", raw, i);
        if (!raw) OK(dp_ptrset_find(s, items[i].device, items[i].base, NULL, T_ERR));
      }
      dp_ptrset_free(s);
      break;
    }
    cr_assert_geq(failed, 1, "raw %d: no allocation could fail", raw);
  }
  ASSERT_NO_LEAK();
}

/* A batch on one device goes in without a lookup of the device: the table
 * must have been grown for the whole batch beforehand. 5000 items added at
 * once, then 5000 tensors scanned, on one device: every one is found. */

/* s holds items[0..n) at device d, numbered in their order. */
static void holds_in_order(const dp_ptrset_t *s, dp_device_t d, const dp_ptr_info_t *items, size_t n) {
  cr_assert_eq(dp_ptrset_count(s), n);
  for (size_t k = 0; k < n; k++) {
    size_t i;
    OK(dp_ptrset_find(s, d, items[k].base, &i, T_ERR));
    cr_assert_eq(i, k);
  }
}

Test(ptrset, a_large_batch_on_one_device_is_added_whole_and_every_item_is_found) {
  enum { N = 5000 };
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptr_info_t *items = calloc(N, sizeof *items);
  for (size_t k = 0; k < N; k++) items[k] = (dp_ptr_info_t){d, (void *)(0x1000 + 64 * k), 64, 0, NULL};
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add_many(s, items, N, NULL, T_ERR));
  holds_in_order(s, d, items, N);
  dp_ptrset_clear(s);
  dp_value_t l = t_list();
  for (size_t k = 0; k < N; k++) OK(dp_list_append(l, t_tensor(d, 0x1000 + 64 * k, 16), T_ERR));
  OK(dp_scan(l, NULL, s, T_ERR));
  holds_in_order(s, d, items, N);
  dp_value_release(l);
  dp_ptrset_free(s);
  free(items);
  ASSERT_NO_LEAK();
}

/* A new device whose entry cannot be stored (the entries are full and
 * cannot grow) is not left behind as an empty device group. */
Test(ptrset, a_new_device_whose_entry_cannot_be_stored_leaves_no_empty_device) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0), b = t_dev(DP_DEVICE_CUDA, 1);
  int failed = 0;
  for (long k = 1;; k++) {
    cr_assert_lt(k, 100);
    dp_ptrset_t *s;
    OK(dp_ptrset_new(&s, T_ERR));
    for (uintptr_t i = 0; i < 16; i++) OK(dp_ptrset_add(s, a, (void *)(0x100 * (i + 1)), 8, NULL, T_ERR));
    dp_error_t e;
    t_fail_at = t_alloc_count + k;
    int rc = dp_ptrset_add(s, b, (void *)0x100, 8, NULL, &e);
    t_fail_at = 0;
    if (rc == 0) {
      cr_assert_eq(dp_ptrset_ndevices(s), 2);
      dp_ptrset_free(s);
      break;
    }
    failed++;
    cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s", k, e.message);
    cr_assert(strncmp(e.message, "out of memory growing a pointer set", 35) == 0, "%s", e.message);
    cr_assert_eq(dp_ptrset_count(s), 16);
    cr_assert_eq(dp_ptrset_ndevices(s), 1, "allocation %ld failed: %zu devices", k, dp_ptrset_ndevices(s));
    /* and the set goes on: b comes as device 1 */
    OK(dp_ptrset_add(s, b, (void *)0x100, 8, NULL, T_ERR));
    cr_assert_eq(dp_ptrset_ndevices(s), 2);
    cr_assert(dp_device_equal(dp_ptrset_device(s, 1), b));
    cr_assert_eq(dp_ptrset_device_count(s, 1), 1);
    dp_ptrset_free(s);
  }
  cr_assert_geq(failed, 2, "only %d allocations could fail", failed);
  ASSERT_NO_LEAK();
}

/* Two devices' entries for one base are told apart by their device, not by
 * their hashes: a base whose hashes on cuda:0 and cuda:1 share their tag
 * and their slot in a set's first table (64 slots), searched for under
 * this process's secret, is still two entries. */
Test(ptrset, the_same_base_on_two_devices_stays_two_entries_where_their_hashes_collide) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0), b = t_dev(DP_DEVICE_CUDA, 1);
  uint64_t ka = dp__ptr_key(a), kb = dp__ptr_key(b);
  uintptr_t base = 0;
  for (uintptr_t x = 64; !base; x += 64) {
    cr_assert_lt(x, (uintptr_t)64 << 28, "no colliding base found");
    uint64_t ha = dp__ptr_hash_keyed((void *)x, ka), hb = dp__ptr_hash_keyed((void *)x, kb);
    if (ha >> 48 == hb >> 48 && (ha & 63) == (hb & 63)) base = x;
  }
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  size_t i;
  OK(dp_ptrset_add(s, a, (void *)base, 8, &i, T_ERR));
  cr_assert_eq(i, 0);
  cr_assert_eq(s->tab.nslots, 64, "a set's first table has 64 slots");
  dp_error_t e;
  cr_assert_eq(dp_ptrset_find(s, b, (void *)base, &i, &e), DP_ENOTFOUND, "cuda:1 found as entry %zu", i);
  char want[64];
  snprintf(want, sizeof want, "dp_ptrset_find: cuda:1 %p is not in the set", (void *)base);
  cr_assert_str_eq(e.message, want);
  OK(dp_ptrset_add(s, b, (void *)base, 16, &i, T_ERR));
  cr_assert_eq(i, 1, "another device is another entry");
  cr_assert_eq(dp_ptrset_count(s), 2);
  cr_assert_eq(dp_ptrset_ndevices(s), 2);
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert(p.nbytes == 8 && p.refs == 1 && dp_device_equal(p.device, a), "entry 0: %zu bytes, %u refs", p.nbytes, p.refs);
  OK(dp_ptrset_get(s, 1, &p, T_ERR));
  cr_assert(p.nbytes == 16 && p.refs == 1 && dp_device_equal(p.device, b), "entry 1: %zu bytes, %u refs", p.nbytes, p.refs);
  dp_ptr_info_t items[2] = {{b, (void *)base, 4, 0, NULL}, {a, (void *)base, 4, 0, NULL}};
  size_t got[2];
  OK(dp_ptrset_add_many(s, items, 2, got, T_ERR));
  cr_assert(got[0] == 1 && got[1] == 0, "add_many found %zu and %zu", got[0], got[1]);
  cr_assert_eq(dp_ptrset_count(s), 2);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* An entry's count of tensors stays at UINT32_MAX once there, whichever
 * way one more tensor comes: dp_ptrset_add, dp_ptrset_add_many, a scan's
 * batch (a tensor found, and its view right after it), or extra refs. */
Test(ptrset, a_count_of_tensors_stays_at_its_most_whichever_way_more_tensors_come) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 0);
  size_t i, j;
  dp_ptr_info_t p;
  OK(dp_ptrset_add(s, d, (void *)0x1000, 64, &i, T_ERR));
  dp__ptrset_add_refs(s, i, UINT32_MAX);  /* 1 + (2^32 - 1): that many or more */
  OK(dp_ptrset_get(s, i, &p, T_ERR));
  cr_assert_eq(p.refs, UINT32_MAX, "extra refs: %u", p.refs);
  OK(dp_ptrset_add(s, d, (void *)0x2000, 64, &j, T_ERR));
  dp__ptrset_add_refs(s, j, UINT32_MAX - 3);  /* UINT32_MAX - 2 */
  OK(dp_ptrset_add(s, d, (void *)0x2000, 64, NULL, T_ERR));
  OK(dp_ptrset_get(s, j, &p, T_ERR));
  cr_assert_eq(p.refs, UINT32_MAX - 1, "one below the most still counts: %u", p.refs);
  OK(dp_ptrset_add(s, d, (void *)0x2000, 64, NULL, T_ERR));
  dp_ptr_info_t item = {d, (void *)0x2000, 64, 0, NULL};
  OK(dp_ptrset_add_many(s, &item, 1, NULL, T_ERR));
  OK(dp_ptrset_get(s, j, &p, T_ERR));
  cr_assert_eq(p.refs, UINT32_MAX, "add, then add_many: %u", p.refs);
  OK(dp_ptrset_add(s, d, (void *)0x1000, 64, NULL, T_ERR));
  item.base = (void *)0x1000;
  OK(dp_ptrset_add_many(s, &item, 1, NULL, T_ERR));
  OK(dp_ptrset_get(s, i, &p, T_ERR));
  cr_assert_eq(p.refs, UINT32_MAX, "add and add_many at the most: %u", p.refs);
  dp_storage_t *st = t_storage(d, 0x1000, 64);
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_view(st, 16, 0), T_ERR));
  OK(dp_list_append(l, t_view(st, 8, 8), T_ERR));  /* the same storage right after: no probe */
  dp_storage_release(st);
  OK(dp_scan(l, NULL, s, T_ERR));
  OK(dp_ptrset_get(s, i, &p, T_ERR));
  cr_assert_eq(p.refs, UINT32_MAX, "a scan's tensor and view at the most: %u", p.refs);
  cr_assert_eq(dp_ptrset_count(s), 2);
  dp_value_release(l);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A scan without paths adds a tensor and the views after it on the same
 * storage as one entry, counting each of them. */
Test(ptrset, a_tensor_and_the_views_right_after_it_are_one_entry_counting_each) {
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 0), h = t_dev(DP_DEVICE_HOST, 0);
  dp_storage_t *a = t_storage(d, 0x1000, 256), *b = t_storage(h, 0x1000, 128);
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_view(a, 64, 0), T_ERR));
  OK(dp_list_append(l, t_view(a, 16, 4), T_ERR));
  OK(dp_list_append(l, t_view(a, 16, 8), T_ERR));
  OK(dp_list_append(l, t_view(b, 32, 0), T_ERR));
  OK(dp_list_append(l, t_view(b, 8, 0), T_ERR));
  OK(dp_list_append(l, t_view(a, 4, 0), T_ERR));  /* a again, after b: found */
  dp_storage_release(a);
  dp_storage_release(b);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (int round = 0; round < 2; round++) {
    dp_ptrset_clear(s);
    OK(dp_scan(l, NULL, s, T_ERR));
    cr_assert_eq(dp_ptrset_count(s), 2);
    dp_ptr_info_t p;
    OK(dp_ptrset_get(s, 0, &p, T_ERR));
    cr_assert(dp_device_equal(p.device, d) && p.nbytes == 256 && p.refs == 4, "round %d, entry 0: %zu bytes, %u refs",
              round, p.nbytes, p.refs);
    OK(dp_ptrset_get(s, 1, &p, T_ERR));
    cr_assert(dp_device_equal(p.device, h) && p.nbytes == 128 && p.refs == 2, "round %d, entry 1: %zu bytes, %u refs",
              round, p.nbytes, p.refs);
  }
  dp_value_release(l);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A scan that cannot reserve room for its batch adds each storage in turn
 * instead; a view right after the tensor before it (the same base and
 * device) must still have its larger size kept there, as in the reserved
 * path: the scan succeeds either way, so a size lost would go unseen. */
Test(ptrset, a_scan_that_cannot_reserve_its_batch_still_keeps_the_larger_size_of_a_view_right_after) {
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 0);
  dp_storage_t *small = t_storage(d, 0x1000, 16), *large = t_storage(d, 0x1000, 256);
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_view(small, 4, 0), T_ERR));
  OK(dp_list_append(l, t_view(large, 4, 0), T_ERR));
  dp_storage_release(small);
  dp_storage_release(large);
  int failed = 0;
  for (long k = 1;; k++) {
    cr_assert_lt(k, 100);
    dp_ptrset_t *s;
    OK(dp_ptrset_new(&s, T_ERR));
    dp_error_t e;
    long want = t_fail_at = t_alloc_count + k;
    int rc = dp_scan(l, NULL, s, &e);
    long done = t_alloc_count;
    t_fail_at = 0;
    if (rc) {
      cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s", k, e.message);
      failed++;
    } else {
      dp_ptr_info_t p;
      cr_assert_eq(dp_ptrset_count(s), 1);
      OK(dp_ptrset_get(s, 0, &p, T_ERR));
      cr_assert(p.nbytes == 256 && p.refs == 2, "allocation %ld failed, the scan succeeded: %zu bytes, %u refs", k,
                p.nbytes, p.refs);
    }
    dp_ptrset_free(s);
    if (!rc && done < want) break; /* nothing failed: every allocation was tried */
  }
  cr_assert_geq(failed, 1, "no allocation could fail");
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* Entries added one at a time while the table grows under them (the entry
 * that makes it grow included) are all found where they were added: eight
 * sets of 20,000 entries, ten growths each. */
Test(ptrset, every_entry_added_as_the_table_grows_is_found_at_its_index) {
  enum { N = 20000 };
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 0);
  for (int round = 0; round < 8; round++) {
    dp_ptrset_t *s;
    OK(dp_ptrset_new(&s, T_ERR));
    uintptr_t at = 0x100000 * (uintptr_t)(round + 1);
    for (size_t k = 0; k < N; k++) {
      size_t i;
      OK(dp_ptrset_add(s, d, (void *)(at + 64 * k), 64, &i, T_ERR));
      cr_assert_eq(i, k);
    }
    for (size_t k = 0; k < N; k++) {
      size_t i = SIZE_MAX;
      dp_error_t e;
      int rc = dp_ptrset_find(s, d, (void *)(at + 64 * k), &i, &e);
      cr_assert(rc == 0 && i == k, "round %d, entry %zu: %s, at %zu", round, k, rc ? e.message : "found", i);
    }
    cr_assert_eq(dp_ptrset_count(s), N);
    dp_ptrset_free(s);
  }
  ASSERT_NO_LEAK();
}

/* Adding many makes room in the table for every item at once: filled to
 * 64 entries by one add_many, the set still answers a miss (a table with no
 * empty slot would probe forever) and takes more. */
Test(ptrset, adding_many_up_to_the_tables_first_size_keeps_room_to_answer_a_miss, .timeout = 10) {
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add(s, d, (void *)0x40, 8, NULL, T_ERR));
  cr_assert_eq(s->tab.nslots, 64);
  dp_ptr_info_t items[63];
  for (size_t k = 0; k < 63; k++) items[k] = (dp_ptr_info_t){d, (void *)(0x80 + 0x40 * (uintptr_t)k), 8, 0, NULL};
  OK(dp_ptrset_add_many(s, items, 63, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 64);
  cr_assert_geq(s->tab.nslots, 2 * dp_ptrset_count(s), "%zu slots for %zu entries", s->tab.nslots, dp_ptrset_count(s));
  dp_error_t e;
  cr_assert_eq(dp_ptrset_find(s, d, (void *)0x8, NULL, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_ptrset_find: cuda:0 0x8 is not in the set");
  size_t i;
  OK(dp_ptrset_add(s, d, (void *)0x8, 8, &i, T_ERR));
  cr_assert_eq(i, 64);
  for (size_t k = 0; k < 63; k++) {
    OK(dp_ptrset_find(s, d, items[k].base, &i, T_ERR));
    cr_assert_eq(i, k + 1);
  }
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A clear drops the paths of the entries that had one: an entry added in
 * their place after it has none. */
Test(ptrset, a_clear_drops_the_paths_of_the_entries_that_had_one) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_device_t d = t_dev(DP_DEVICE_HOST, 0);
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(d, 0x2000, 4), T_ERR));
  OK(dp_list_append(l, t_tensor(d, 0x3000, 4), T_ERR));
  dp_scan_opts_t o = {0};
  o.flags = DP_SCAN_PATHS;
  OK(dp_scan(l, &o, s, T_ERR));
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 1, &p, T_ERR));
  cr_assert_str_eq(p.path, "$[1]");
  dp_ptrset_clear(s);
  OK(dp_ptrset_add(s, d, (void *)0x5000, 64, NULL, T_ERR));
  OK(dp_ptrset_add(s, d, (void *)0x6000, 64, NULL, T_ERR));
  for (size_t i = 0; i < 2; i++) {
    OK(dp_ptrset_get(s, i, &p, T_ERR));
    cr_assert_null(p.path, "entry %zu, added after the clear, has the path %s", i, p.path);
  }
  OK(dp_scan(l, &o, s, T_ERR));  /* two new entries, with their paths */
  static const char *const want[] = {NULL, NULL, "$[0]", "$[1]"};
  cr_assert_eq(dp_ptrset_count(s), 4);
  for (size_t i = 0; i < 4; i++) {
    OK(dp_ptrset_get(s, i, &p, T_ERR));
    if (want[i]) cr_assert_str_eq(p.path, want[i], "entry %zu", i);
    else cr_assert_null(p.path, "entry %zu has the path %s", i, p.path);
  }
  dp_value_release(l);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* ---- frozen records (pickler/ptrs.h) ---- */

/* Record r holds n entries, entry k at bases[k] with nbytes[k] and refs[k],
 * all on device d[k]. */
static void expect_record(const dp__ptrs_t *r, size_t n, const uintptr_t *bases, const size_t *nbytes,
                          const uint32_t *refs, const dp_device_t *d) {
  cr_assert_eq(r->n, n, "%zu entries, expected %zu", r->n, n);
  for (size_t k = 0; k < n; k++) {
    dp_ptr_info_t p;
    dp__ptrs_get(r, k, &p);
    cr_assert((uintptr_t)p.base == bases[k] && p.nbytes == nbytes[k] && p.refs == refs[k] && dp_device_equal(p.device, d[k]) &&
                  !p.path,
              "entry %zu: %p, %zu bytes, %u refs", k, p.base, p.nbytes, p.refs);
  }
}

/* A frozen copy keeps the entries in discovery order, and each device's
 * bases together in discovery order (by_dev), with where they start and
 * how many; the caller's extra bytes are its own. The set is left as it
 * was. */
Test(ptrset, a_frozen_set_keeps_its_entries_and_each_devices_bases_in_discovery_order) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0), b = t_dev(DP_DEVICE_CUDA, 1);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  /* one device */
  OK(dp_ptrset_add(s, a, (void *)0x100, 8, NULL, T_ERR));
  OK(dp_ptrset_add(s, a, (void *)0x200, 16, NULL, T_ERR));
  OK(dp_ptrset_add(s, a, (void *)0x100, 8, NULL, T_ERR));
  OK(dp_ptrset_add(s, a, (void *)0x300, 24, NULL, T_ERR));
  dp__ptrs_t r;
  OK(dp__ptrs_freeze(&r, s, 0, 0, T_ERR));
  {
    uintptr_t bases[] = {0x100, 0x200, 0x300};
    size_t nbytes[] = {8, 16, 24};
    uint32_t refs[] = {2, 1, 1};
    dp_device_t d[] = {a, a, a};
    expect_record(&r, 3, bases, nbytes, refs, d);
    cr_assert_eq(r.ndevs, 1);
    cr_assert(dp_device_equal(r.devs[0].device, a) && r.devs[0].first == 0 && r.devs[0].count == 3,
              "device 0: first %zu, count %zu", r.devs[0].first, r.devs[0].count);
    for (size_t k = 0; k < 3; k++) cr_assert_eq((uintptr_t)r.by_dev[k], bases[k], "by_dev[%zu]", k);
  }
  cr_assert_eq(dp_ptrset_count(s), 3, "a copy leaves the set as it was");
  dp__ptrs_free(&r);
  /* two devices, interleaved, with extra bytes */
  dp_ptrset_clear(s);
  for (uintptr_t k = 1; k <= 5; k++) OK(dp_ptrset_add(s, k & 1 ? a : b, (void *)(0x1000 * k), 8 * k, NULL, T_ERR));
  OK(dp__ptrs_freeze(&r, s, 0, 40, T_ERR));
  {
    uintptr_t bases[] = {0x1000, 0x2000, 0x3000, 0x4000, 0x5000};
    size_t nbytes[] = {8, 16, 24, 32, 40};
    uint32_t refs[] = {1, 1, 1, 1, 1};
    dp_device_t d[] = {a, b, a, b, a};
    expect_record(&r, 5, bases, nbytes, refs, d);
    cr_assert_eq(r.ndevs, 2);
    cr_assert(dp_device_equal(r.devs[0].device, a) && r.devs[0].first == 0 && r.devs[0].count == 3,
              "device 0: first %zu, count %zu", r.devs[0].first, r.devs[0].count);
    cr_assert(dp_device_equal(r.devs[1].device, b) && r.devs[1].first == 3 && r.devs[1].count == 2,
              "device 1: first %zu, count %zu", r.devs[1].first, r.devs[1].count);
    uintptr_t grouped[] = {0x1000, 0x3000, 0x5000, 0x2000, 0x4000};
    for (size_t k = 0; k < 5; k++)
      cr_assert_eq((uintptr_t)r.by_dev[k], grouped[k], "by_dev[%zu]: %p", k, r.by_dev[k]);
    cr_assert_not_null(r.extra);
    cr_assert_eq((uintptr_t)r.extra % _Alignof(max_align_t), 0);
    memset(r.extra, 0xab, 40);
  }
  cr_assert_eq(dp_ptrset_count(s), 5);
  dp__ptrs_free(&r);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A raw set (a completion's) appends what it is given; its record's
 * distinct list is what a set that is not raw holds. */
Test(ptrset, a_raw_set_appends_and_its_records_distinct_list_is_what_a_plain_set_holds) {
  dp_device_t dev[2] = {t_dev(DP_DEVICE_CUDA, 0), t_dev(DP_DEVICE_CUDA, 1)};
  t_rng_t rng = {42};
  dp_ptrset_t *raw, *plain;
  OK(dp_ptrset_new(&raw, T_ERR));
  OK(dp_ptrset_new(&plain, T_ERR));
  for (int round = 0; round < 50; round++) {
    /* first one device only, then two: the chain of the first is made late */
    int ndev = round < 10 ? 1 : 2;
    enum { N = 300 };
    dp_ptr_info_t items[N];
    size_t repeats = 0;
    for (int i = 0; i < N; i++) {
      if (i && (t_rand(&rng) % 4) == 0) { /* right after itself: its entry counts one more */
        items[i] = items[i - 1];
        items[i].nbytes = 8 * (1 + (t_rand(&rng) % 8));
        continue;
      }
      items[i] = (dp_ptr_info_t){dev[(t_rand(&rng) % (uint64_t)ndev)], (void *)(uintptr_t)(0x1000 * (1 + (t_rand(&rng) % 40))),
                                 8 * (1 + (t_rand(&rng) % 8)), 0, NULL};
    }
    for (int i = 0; i < N; i++) /* an entry each but for one right after itself */
      repeats += i && items[i].base == items[i - 1].base && dp_device_equal(items[i].device, items[i - 1].device);
    dp__ptrset_set_raw(raw, 1);
    dp_ptrset_clear(plain);
    /* in pieces, some one at a time, as a walk adds */
    for (int i = 0; i < N;) {
      int m = 1 + (int)(t_rand(&rng) % 20);
      if (m > N - i) m = N - i;
      if (m == 1) OK(dp_ptrset_add(raw, items[i].device, items[i].base, items[i].nbytes, NULL, T_ERR));
      else OK(dp_ptrset_add_many(raw, items + i, (size_t)m, NULL, T_ERR));
      i += m;
    }
    OK(dp_ptrset_add_many(plain, items, N, NULL, T_ERR));
    cr_assert_eq(raw->tab.nslots, 0, "round %d: a raw set's table stays empty", round);
    cr_assert_eq(dp_ptrset_count(raw), N - repeats, "round %d: %zu entries, not %zu", round, dp_ptrset_count(raw),
                 N - repeats);
    dp__ptrs_t r, d;
    OK(dp__ptrs_freeze(&r, raw, round & 1, 0, T_ERR));
    cr_assert(r.raw, "a raw set's record says it may repeat");
    size_t on_dev[2] = {0, 0};
    for (size_t g = 0; g < r.ndevs; g++) on_dev[g] = r.devs[g].count;
    cr_assert_eq(on_dev[0] + on_dev[1], r.n, "every entry is in its device's group");
    OK(dp__ptrs_distinct(&r, &d, T_ERR));
    cr_assert(!d.raw);
    cr_assert_eq(d.n, dp_ptrset_count(plain), "round %d: %zu distinct, the plain set %zu", round, d.n,
                 dp_ptrset_count(plain));
    for (size_t i = 0; i < d.n; i++) {
      dp_ptr_info_t got, want;
      dp__ptrs_get(&d, i, &got);
      OK(dp_ptrset_get(plain, i, &want, T_ERR));
      cr_assert(got.base == want.base && dp_device_equal(got.device, want.device) && got.nbytes == want.nbytes &&
                    got.refs == want.refs,
                "round %d, entry %zu: %p %zu bytes %u refs, the plain set %p %zu bytes %u refs", round, i, got.base,
                got.nbytes, got.refs, want.base, want.nbytes, want.refs);
    }
    cr_assert_eq(d.ndevs, dp_ptrset_ndevices(plain));
    for (size_t g = 0; g < d.ndevs; g++)
      cr_assert(dp_device_equal(d.devs[g].device, dp_ptrset_device(plain, g)) &&
                d.devs[g].count == dp_ptrset_device_count(plain, g));
    dp__ptrs_free(&d);
    dp__ptrs_free(&r);
  }
  /* made plain again, the set finds what it holds */
  dp__ptrset_set_raw(raw, 0);
  OK(dp_ptrset_add(raw, dev[0], (void *)0x10, 8, NULL, T_ERR));
  OK(dp_ptrset_add(raw, dev[0], (void *)0x20, 8, NULL, T_ERR));
  OK(dp_ptrset_add(raw, dev[0], (void *)0x10, 8, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_count(raw), 2);
  OK(dp_ptrset_find(raw, dev[0], (void *)0x10, NULL, T_ERR));
  dp_ptrset_free(raw);
  dp_ptrset_free(plain);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A thread's scratch set goes from raw to plain: it keeps the entries'
 * room its raw use grew to, while its table is still small. Adding one at a
 * time then grows the table as it fills, never past a load of one half,
 * whether or not a batch (dp_ptrset_add_many) filled half of it first, on
 * one device or on two in turn: every entry is found, and a miss is
 * answered. */
Test(ptrset, a_set_made_plain_after_a_large_raw_use_grows_its_table_as_it_fills, .timeout = 10) {
  dp_device_t dev[2] = {t_dev(DP_DEVICE_CUDA, 0), t_dev(DP_DEVICE_CUDA, 1)};
  enum { N = 1000, BATCH = 32 };
  static dp_ptr_info_t items[N];
  for (int mode = 0; mode < 3; mode++) { /* no batch, a batch on one device, a batch on two in turn */
    for (size_t i = 0; i < N; i++)
      items[i] = (dp_ptr_info_t){dev[mode == 2 ? i & 1 : 0], (void *)(uintptr_t)(0x1000 * (i + 1)), 8, 0, NULL};
    dp_ptrset_t *s;
    OK(dp_ptrset_new(&s, T_ERR));
    dp__ptrset_set_raw(s, 1);
    for (size_t i = 0; i < N; i++) OK(dp_ptrset_add(s, items[i].device, items[i].base, 8, NULL, T_ERR));
    cr_assert_geq(s->cap, (size_t)N);
    dp__ptrset_set_raw(s, 0);
    size_t first = mode ? BATCH : 0;
    if (mode) OK(dp_ptrset_add_many(s, items, BATCH, NULL, T_ERR));
    cr_assert_eq(s->tab.count, first, "mode %d: the table counts the batch's entries", mode);
    for (size_t i = first; i < N; i++) {
      size_t at;
      OK(dp_ptrset_add(s, items[i].device, items[i].base, 8, &at, T_ERR));
      cr_assert_eq(at, i);
      cr_assert_leq(s->tab.count * 2, s->tab.nslots, "mode %d: %zu entries in %zu slots", mode, s->tab.count,
                    s->tab.nslots);
    }
    for (size_t i = 0; i < N; i++) {
      size_t at;
      OK(dp_ptrset_find(s, items[i].device, items[i].base, &at, T_ERR));
      cr_assert_eq(at, i);
    }
    cr_assert_eq(dp_ptrset_find(s, dev[0], (void *)0x8, NULL, NULL), DP_ENOTFOUND);
    cr_assert_eq(dp_ptrset_count(s), N);
    dp_ptrset_free(s);
  }
  ASSERT_NO_LEAK();
}

/* A set that is the caller's scratch, its block all but full, gives the
 * block to the record and starts again empty, with a block of its own. */
Test(ptrset, a_taken_set_gives_its_block_to_the_record_and_starts_again_empty) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  uintptr_t bases[16], more[16];
  size_t nbytes[16];
  uint32_t refs[16];
  dp_device_t d[16];
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (size_t k = 0; k < 16; k++) {
    bases[k] = 0x100 * (k + 1);
    more[k] = 0x10000 + 0x100 * k;
    nbytes[k] = 8;
    refs[k] = 1;
    d[k] = a;
    OK(dp_ptrset_add(s, a, (void *)bases[k], 8, NULL, T_ERR));
  }
  void *block = s->block;
  dp__ptrs_t r;
  OK(dp__ptrs_freeze(&r, s, 1, 0, T_ERR));
  cr_assert_eq(r.block, block, "the record took the set's block");
  expect_record(&r, 16, bases, nbytes, refs, d);
  cr_assert_eq(dp_ptrset_count(s), 0, "a taken set starts again empty");
  cr_assert_eq(dp_ptrset_ndevices(s), 0);
  cr_assert_eq(dp_ptrset_find(s, a, (void *)bases[0], NULL, NULL), DP_ENOTFOUND);
  cr_assert_neq(s->block, block);
  for (size_t k = 0; k < 16; k++) OK(dp_ptrset_add(s, a, (void *)more[k], 8, NULL, T_ERR));
  expect_record(&r, 16, bases, nbytes, refs, d);  /* the set's new entries are not the record's */
  for (size_t k = 0; k < 16; k++) {
    size_t i;
    OK(dp_ptrset_find(s, a, (void *)more[k], &i, T_ERR));
    cr_assert_eq(i, k);
  }
  dp__ptrs_free(&r);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A scratch set that outgrew the block a record left it (it grew by
 * doubling) is copied from, then emptied and given a block of the size it
 * needed: the next value of that shape fills it and gives it up. */
Test(ptrset, a_taken_set_that_outgrew_its_block_is_emptied_and_given_one_of_the_size_it_needed) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 16; k++) OK(dp_ptrset_add(s, a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
  dp__ptrs_t r1, r2, r3;
  OK(dp__ptrs_freeze(&r1, s, 1, 0, T_ERR));  /* taken: the set gets a block of 16 */
  cr_assert_eq(s->cap, 16);
  for (uintptr_t k = 0; k < 40; k++) OK(dp_ptrset_add(s, a, (void *)(0x10000 + 0x100 * k), 8, NULL, T_ERR));
  cr_assert_eq(s->cap, 64, "grown by doubling");
  void *grown = s->block;
  OK(dp__ptrs_freeze(&r2, s, 1, 0, T_ERR));
  cr_assert_neq(r2.block, grown, "a block a third unused is copied from, not taken");
  cr_assert_eq(r2.n, 40);
  cr_assert_eq(dp_ptrset_count(s), 0, "the set is emptied");
  cr_assert_eq(s->cap, 40, "and given a block of 40 entries, not %zu", s->cap);
  for (uintptr_t k = 0; k < 40; k++) OK(dp_ptrset_add(s, a, (void *)(0x20000 + 0x100 * k), 8, NULL, T_ERR));
  void *fits = s->block;
  OK(dp__ptrs_freeze(&r3, s, 1, 0, T_ERR));
  cr_assert_eq(r3.block, fits, "the next value of that shape gives its block");
  for (size_t k = 0; k < 40; k++) {
    dp_ptr_info_t p;
    dp__ptrs_get(&r2, k, &p);
    cr_assert_eq((uintptr_t)p.base, 0x10000 + 0x100 * k);
    dp__ptrs_get(&r3, k, &p);
    cr_assert_eq((uintptr_t)p.base, 0x20000 + 0x100 * k);
  }
  dp__ptrs_free(&r1);
  dp__ptrs_free(&r2);
  dp__ptrs_free(&r3);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A freed record's block is kept by the thread and given to a later copy
 * that needs at least half of it, never to a much smaller one. */
Test(ptrset, a_kept_block_goes_to_a_copy_that_needs_at_least_half_of_it) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptrset_t *big, *mid, *small;
  OK(dp_ptrset_new(&big, T_ERR));
  OK(dp_ptrset_new(&mid, T_ERR));
  OK(dp_ptrset_new(&small, T_ERR));
  for (uintptr_t k = 0; k < 1000; k++) {
    OK(dp_ptrset_add(big, a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
    if (k < 600) OK(dp_ptrset_add(mid, a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
    if (k < 4) OK(dp_ptrset_add(small, a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
  }
  dp__ptrs_t r1, r2, r3;
  OK(dp__ptrs_freeze(&r1, big, 0, 0, T_ERR));
  size_t big_size = r1.block_size;
  cr_assert_eq(big_size, dp__ptrs_block_size(1000));
  dp__ptrs_free(&r1);  /* kept */
  OK(dp__ptrs_freeze(&r2, small, 0, 0, T_ERR));
  cr_assert_eq(r2.block_size, dp__ptrs_block_size(4), "4 entries took a block of %zu bytes", r2.block_size);
  cr_assert_eq(r2.n, 4);
  long before = t_alloc_count;
  OK(dp__ptrs_freeze(&r3, mid, 0, 0, T_ERR));
  cr_assert_eq(t_alloc_count, before, "600 entries take the kept block of 1000");
  cr_assert_eq(r3.block_size, big_size);
  for (size_t k = 0; k < 600; k++) {
    dp_ptr_info_t p;
    dp__ptrs_get(&r3, k, &p);
    cr_assert_eq((uintptr_t)p.base, 0x100 * (k + 1));
  }
  dp__ptrs_free(&r2);
  dp__ptrs_free(&r3);
  dp_ptrset_free(big);
  dp_ptrset_free(mid);
  dp_ptrset_free(small);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A block of any size (a kept one may be of any size) holds the entries its
 * capacity says, and its tail, within its bytes; one more would not fit. */
Test(ptrset, a_block_of_any_size_holds_the_entries_its_capacity_says_and_no_more) {
  for (size_t size = 0; size < 4096; size++) {
    size_t cap = dp__ptrs_block_cap(size);
    if (cap) cr_assert_leq(dp__ptrs_block_size(cap), size, "%zu bytes: %zu entries need %zu", size, cap, dp__ptrs_block_size(cap));
    cr_assert_gt(dp__ptrs_block_size(cap + 1), size, "%zu bytes hold more than %zu entries", size, cap);
  }
  for (size_t cap = 0; cap < 200; cap++) cr_assert_eq(dp__ptrs_block_cap(dp__ptrs_block_size(cap)), cap);
}

/* refs counts the distinct tensors of each scan: a tensor met twice in one
 * scan counts once, and the same value scanned again into the set before a
 * dp_ptrset_clear counts again (ptrset.h). */
Test(ptrset, a_scan_counts_each_tensor_once_and_a_second_scan_before_a_clear_counts_again) {
  dp_value_t t = t_tensor(t_dev(DP_DEVICE_HOST, 0), 0x1000, 4);
  dp_value_t l = t_list();
  OK(dp_list_append(l, dp_value_retain(t), T_ERR));
  OK(dp_list_append(l, t, T_ERR)); /* the same tensor twice */
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_ptr_info_t p;
  OK(dp_scan(l, NULL, s, T_ERR));
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_eq(p.refs, 1, "one tensor, met twice in a scan");
  OK(dp_scan(l, NULL, s, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 1);
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_eq(p.refs, 2, "a second scan into the set counts it again");
  dp_ptrset_clear(s);
  OK(dp_scan(l, NULL, s, T_ERR));
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_eq(p.refs, 1, "after a clear, once again");
  dp_ptrset_free(s);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* ptrset.h and base.h's rule: a NULL out, set or entry record is DP_EINVAL
 * naming the function and the argument; a set that cannot be allocated is
 * DP_ENOMEM and leaves nothing behind; adding no items needs no items. */
Test(ptrset, a_null_out_or_set_is_einval_naming_it_and_a_set_that_cannot_be_made_is_enomem) {
  dp_error_t e;
  cr_assert_eq(dp_ptrset_new(NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_new: NULL out");
  cr_assert_eq(dp_ptrset_add(NULL, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add: NULL set");
  dp_ptrset_t *s = NULL;
  t_fail_at = t_alloc_count + 1;
  int rc = dp_ptrset_new(&s, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM);
  cr_assert_str_eq(e.message, "out of memory allocating a pointer set");
  ASSERT_NO_LEAK();
  OK(dp_ptrset_new(&s, T_ERR));
  dp_ptr_info_t p;
  cr_assert_eq(dp_ptrset_get(s, 0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_get: NULL out");
  OK(dp_ptrset_add_many(s, NULL, 0, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 0);
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
  OK(dp_ptrset_find(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, NULL, T_ERR));
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_eq(p.base, (void *)0x40);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* ptrset.h: one entry past DP_PTRSET_MAX_ENTRIES is DP_ELIMIT, by add or
 * by add_many, and add_many makes room for all n first, so it refuses a
 * batch whose items are in the set already; neither changes the set. (The
 * count is set by hand: four billion entries do not fit a test.) */
/* Room for entries up to the limit exactly is asked of the allocator, not
 * refused as too many (a set this large cannot be made here: the allocator
 * refuses it). */
Test(ptrset, adding_many_up_to_the_limit_exactly_is_not_refused_as_too_many) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_ptr_info_t items[2] = {{t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 0), (void *)0x80, 8, 0, NULL}};
  dp_error_t e;
  s->count = DP_PTRSET_MAX_ENTRIES - 2;
  t_fail_at = t_alloc_count + 1;
  int rc = dp_ptrset_add_many(s, items, 2, NULL, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s", e.message);
  cr_assert_str_eq(e.message, "out of memory growing a pointer set");
  s->count = 0;
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A batch hashes each base with its device's key, derived when the device
 * changes: cpu's key too, though cpu is device 0 (the bits a batch starts
 * comparing with). */
Test(ptrset, a_batch_on_cpu_hashes_its_bases_as_a_single_add_does) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_ptr_info_t items[3] = {{t_dev(DP_DEVICE_CPU, 0), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CPU, 0), (void *)0x80, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, 0, NULL}};
  OK(dp_ptrset_add_many(s, items, 3, NULL, T_ERR));
  for (size_t i = 0; i < 3; i++) {
    size_t at;
    OK(dp_ptrset_find(s, items[i].device, items[i].base, &at, T_ERR));
    cr_assert_eq(at, i);
    OK(dp_ptrset_add(s, items[i].device, items[i].base, 8, &at, T_ERR));
    cr_assert_eq(at, i, "item %zu was added again, as entry %zu", i, at);
  }
  cr_assert_eq(dp_ptrset_count(s), 3);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

Test(ptrset, an_entry_past_the_limit_is_elimit_by_add_or_add_many_and_changes_nothing) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
  dp_ptr_info_t known[2] = {{t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, 0, NULL}};
  dp_error_t e;
  char want[80];
  snprintf(want, sizeof want, "a pointer set holds at most %u entries", DP_PTRSET_MAX_ENTRIES);
  s->count = DP_PTRSET_MAX_ENTRIES - 1;
  cr_assert_eq(dp_ptrset_add_many(s, known, 2, NULL, &e), DP_ELIMIT, "room for two more was not asked first");
  cr_assert_str_eq(e.message, want);
  s->count = DP_PTRSET_MAX_ENTRIES;
  long before = t_alloc_count;
  cr_assert_eq(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x80, 8, NULL, &e), DP_ELIMIT);
  cr_assert_str_eq(e.message, want);
  cr_assert_eq(t_alloc_count, before, "a refused add allocated");
  s->count = 1;
  cr_assert_eq(dp_ptrset_count(s), 1);
  cr_assert_eq(dp_ptrset_find(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x80, NULL, NULL), DP_ENOTFOUND);
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_eq(p.refs, 1, "a refused batch counted its items: %u", p.refs);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* ---- the paths' arena (ptrset_impl.h): chunks of 4 KiB, doubling ---- */

/* A string with its NUL that exactly fills what is left of a chunk goes
 * there; one byte longer and it starts the next chunk (nothing is written
 * past a chunk's end). */
Test(ptrset, an_arena_string_that_exactly_fills_its_chunk_stays_there_and_one_byte_more_takes_a_new_chunk) {
  static char text[4096];
  memset(text, 'a', sizeof text);
  dp__arena_t a = {0}, b = {0};
  long before = t_alloc_count;
  char *p = dp__arena_strdup(&a, text, 4000);
  cr_assert_eq(t_alloc_count, before + 1);
  cr_assert_eq(a.head->cap, 4096);
  char *q = dp__arena_strdup(&a, text, 94); /* 95 bytes: what is left */
  cr_assert_eq(q, p + 4001, "a string that fits was put elsewhere");
  cr_assert_eq(t_alloc_count, before + 1, "a string that fits took a chunk");
  cr_assert_eq(q[94], '\0');
  cr_assert_null(a.head->next);

  before = t_alloc_count;
  p = dp__arena_strdup(&b, text, 4000);
  q = dp__arena_strdup(&b, text, 95); /* 96 bytes: one more than is left */
  cr_assert_eq(t_alloc_count, before + 2, "a string one byte too long was not given a new chunk");
  cr_assert_not_null(b.head->next);
  cr_assert_eq(q, b.head->next->data);
  cr_assert_eq(strlen(p), 4000);
  cr_assert_eq(strlen(q), 95);
  dp__arena_free(&a);
  dp__arena_free(&b);
  ASSERT_NO_LEAK();
}

/* After a reset the same strings land where they did, from the start of
 * each kept chunk: a first chunk filled to its last byte is filled again,
 * and nothing is allocated. */
Test(ptrset, an_arena_refilled_after_a_reset_puts_each_string_where_it_was_and_allocates_nothing) {
  static char text[8192];
  memset(text, 'b', sizeof text);
  static const size_t len[] = {4000, 94, 10, 8190, 7}; /* chunks of 4096, 8192, 16384 */
  enum { N = sizeof len / sizeof *len };
  char *was[N];
  dp__arena_t a = {0};
  for (size_t i = 0; i < N; i++) cr_assert_not_null(was[i] = dp__arena_strdup(&a, text, len[i]));
  cr_assert_eq(was[1] + 95, a.head->data + a.head->cap, "the first chunk is not filled to its end");
  cr_assert_eq(a.head->next->cap, 8192);
  cr_assert_eq(a.head->next->next->cap, 16384);
  cr_assert_eq(was[4], a.head->next->next->data + 8191);
  for (int round = 0; round < 2; round++) {
    dp__arena_reset(&a);
    long before = t_alloc_count;
    for (size_t i = 0; i < N; i++) {
      char *p = dp__arena_strdup(&a, text, len[i]);
      cr_assert_eq(p, was[i], "round %d, string %zu moved", round, i);
      cr_assert_eq(strlen(p), len[i]);
    }
    cr_assert_eq(t_alloc_count, before, "refilling allocated");
  }
  dp__arena_free(&a);
  ASSERT_NO_LEAK();
}

/* A string whose chunk's size would not fit a size_t is refused before
 * anything is asked of the allocator; the longest one that fits is asked
 * for (and refused by it here). */
Test(ptrset, an_arena_string_too_long_to_size_a_chunk_for_is_refused_without_allocating) {
  dp__arena_t a = {0};
  size_t longest = SIZE_MAX - sizeof(dp__achunk_t) - 1; /* its chunk: exactly SIZE_MAX bytes */
  long before = t_alloc_count;
  cr_assert_null(dp__arena_strdup(&a, "", longest + 1));
  cr_assert_null(dp__arena_strdup(&a, "", longest + 8));
  cr_assert_null(dp__arena_strdup(&a, "", SIZE_MAX - 1));
  cr_assert_eq(t_alloc_count, before, "a chunk past SIZE_MAX bytes was asked for");
  t_fail_at = t_alloc_count + 1; /* refused by the allocator, never handed to realloc (ASan aborts on such a size) */
  cr_assert_null(dp__arena_strdup(&a, "", longest));
  t_fail_at = 0;
  cr_assert_eq(t_alloc_count, before + 1);
  cr_assert_null(a.head);
  char *p = dp__arena_strdup(&a, "x", 1);
  cr_assert_str_eq(p, "x");
  dp__arena_free(&a);
  ASSERT_NO_LEAK();
}

/* A string longer than the next chunk would be gets a chunk of its own
 * size, its NUL included, and nothing is wasted on the way. */
/* Chunks double from 4 KiB up to 1 MiB, then stay at 1 MiB: a large
 * scan's paths do not take chunks ever larger than they need. */
Test(ptrset, arena_chunks_double_up_to_one_mib_and_stay_there) {
  static char text[1000];
  memset(text, 'p', sizeof text);
  dp__arena_t a = {0};
  for (int i = 0; i < 6000; i++) cr_assert_not_null(dp__arena_strdup(&a, text, sizeof text - 1));
  size_t want = 4096, chunks = 0;
  for (dp__achunk_t *c = a.head; c; c = c->next, chunks++) {
    cr_assert_eq(c->cap, want, "chunk %zu: %zu bytes, not %zu", chunks, c->cap, want);
    if (want < (1u << 20)) want *= 2;
  }
  cr_assert_geq(chunks, 10, "6 MB of paths in %zu chunks", chunks);
  dp__arena_free(&a);
  ASSERT_NO_LEAK();
}

Test(ptrset, an_arena_string_longer_than_a_chunk_gets_a_chunk_of_exactly_its_size) {
  static char text[10000];
  memset(text, 'c', sizeof text);
  dp__arena_t a = {0};
  long before = t_alloc_count;
  char *p = dp__arena_strdup(&a, text, sizeof text);
  cr_assert_eq(t_alloc_count, before + 1);
  cr_assert_eq(p, a.head->data);
  cr_assert_eq(a.head->cap, sizeof text + 1);
  cr_assert_eq(strlen(p), sizeof text);
  p = dp__arena_strdup(&a, text, 20000 - sizeof text - 2); /* the next chunk: twice the first */
  cr_assert_eq(p, a.head->next->data);
  cr_assert_eq(a.head->next->cap, 2 * (sizeof text + 1));
  dp__arena_free(&a);
  ASSERT_NO_LEAK();
}

/* A table of 64 slots holds 32 entries (load at most one half): a batch
 * that brings a cleared set to exactly 32 fits the table and the entries it
 * kept and allocates nothing; one of 33 grows both. */
Test(ptrset, adding_many_into_a_set_with_room_for_them_allocates_nothing_and_one_more_grows_it) {
  dp_ptr_info_t items[33];
  for (size_t k = 0; k < 33; k++) items[k] = (dp_ptr_info_t){t_dev(DP_DEVICE_CUDA, 0), (void *)(0x1000 + k * 64), 64, 0, NULL};
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add_many(s, items, 32, NULL, T_ERR));
  cr_assert_eq(s->tab.nslots, 64);
  cr_assert_eq(s->cap, 32);
  for (int round = 0; round < 2; round++) {
    dp_ptrset_clear(s);
    long before = t_alloc_count;
    OK(dp_ptrset_add_many(s, items, 32, NULL, T_ERR));
    cr_assert_eq(t_alloc_count, before, "round %d: a batch with room allocated %ld times", round, t_alloc_count - before);
    cr_assert_eq(s->tab.nslots, 64);
  }
  dp_ptrset_clear(s);
  long before = t_alloc_count;
  size_t idx[33];
  OK(dp_ptrset_add_many(s, items, 33, idx, T_ERR));
  cr_assert_gt(t_alloc_count, before, "33 entries fit where 32 did");
  cr_assert_eq(s->tab.nslots, 128);
  cr_assert_eq(s->cap, 64);
  for (size_t k = 0; k < 33; k++) {
    size_t i;
    OK(dp_ptrset_find(s, items[k].device, items[k].base, &i, T_ERR));
    cr_assert_eq(i, k);
    cr_assert_eq(idx[k], k);
  }
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* Entries start at 16 and double to the fewest that hold them. */
Test(ptrset, the_entries_grow_by_doubling_only_when_the_next_one_does_not_fit) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 33; k++) {
    OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
    size_t want = k < 16 ? 16 : k < 32 ? 32 : 64;
    cr_assert_eq(s->cap, want, "%zu entries: room for %zu, not %zu", (size_t)k + 1, s->cap, want);
  }
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A set that had two devices and now has one: device 1 is past the end,
 * whatever its group held before the clear. */
Test(ptrset, the_device_past_the_end_of_a_set_cleared_of_more_devices_reads_as_nothing) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x100, 8, NULL, T_ERR));
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 1), (void *)0x200, 8, NULL, T_ERR));
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 1), (void *)0x300, 8, NULL, T_ERR));
  dp_ptrset_clear(s);
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x100, 8, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_ndevices(s), 1);
  cr_assert_eq(dp_ptrset_first_on(s, 0), 0);
  cr_assert_eq(dp_ptrset_first_on(s, 1), SIZE_MAX);
  cr_assert_eq(dp_ptrset_device_count(s, 1), 0);
  cr_assert(dp_device_equal(dp_ptrset_device(s, 1), t_dev(DP_DEVICE_CPU, 0)));
  cr_assert_eq(dp_ptrset_next_on(s, 0), SIZE_MAX);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* The host's memory is one device, cpu 0: index 1 is the first that is
 * refused, by add and by add_many alike; so is the first unknown type. */
Test(ptrset, cpu_0_is_a_device_and_cpu_1_or_an_unknown_type_is_einval_naming_it) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_error_t e;
  size_t i;
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CPU, 0), (void *)0x40, 8, &i, T_ERR));
  cr_assert_eq(i, 0);
  cr_assert_eq(dp_ptrset_add(s, t_dev(DP_DEVICE_CPU, 1), (void *)0x80, 8, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add: invalid device (type 0, index 1)");
  cr_assert_eq(dp_ptrset_add(s, (dp_device_t){DP_DEVICE_TYPE_COUNT, 0}, (void *)0x80, 8, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add: invalid device (type 3, index 0)");
  OK(dp_ptrset_add(s, (dp_device_t){DP_DEVICE_TYPE_COUNT - 1, 0}, (void *)0x80, 8, NULL, T_ERR));
  dp_ptr_info_t items[2] = {{t_dev(DP_DEVICE_CPU, 0), (void *)0xc0, 8, 0, NULL},
                            {t_dev(DP_DEVICE_CPU, 1), (void *)0x100, 8, 0, NULL}};
  cr_assert_eq(dp_ptrset_add_many(s, items, 2, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_ptrset_add_many: item 1: invalid device (type 0, index 1)");
  cr_assert_eq(dp_ptrset_count(s), 2);
  OK(dp_ptrset_add_many(s, items, 1, NULL, T_ERR));
  cr_assert_eq(dp_ptrset_count(s), 3);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A path whose text cannot be stored is DP_ENOMEM and leaves the entry
 * without one; the same path stored later is kept. */
Test(ptrset, a_path_that_cannot_be_stored_is_enomem_and_the_entry_keeps_none) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
  OK(dp__ptrset_set_path(s, 0, "$.a")); /* the paths' array and the arena's first chunk now exist */
  dp_ptrset_clear(s);
  OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
  static char longer[5000];
  memset(longer, 'x', sizeof longer - 1);
  t_fail_at = t_alloc_count + 1; /* the first allocation: a chunk for a path longer than the one kept */
  int rc = dp__ptrset_set_path(s, 0, longer);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM);
  dp_ptr_info_t p;
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_null(p.path, "a path that was not stored: %s", p.path ? p.path : "");
  OK(dp__ptrset_set_path(s, 0, longer));
  OK(dp_ptrset_get(s, 0, &p, T_ERR));
  cr_assert_str_eq(p.path, longer);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

Test(ptrset, an_entry_past_the_limit_is_elimit_by_a_scan_with_or_without_paths) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x40, 8), T_ERR));
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x80, 8), T_ERR));
  char want[96];
  for (int paths = 0; paths < 2; paths++) {
    OK(dp_ptrset_add(s, t_dev(DP_DEVICE_CUDA, 0), (void *)0x40, 8, NULL, T_ERR));
    s->count = DP_PTRSET_MAX_ENTRIES;
    dp_scan_opts_t o = {paths ? DP_SCAN_PATHS : 0, 0};
    dp_error_t e;
    cr_assert_eq(dp_scan(l, &o, s, &e), DP_ELIMIT, "%s", e.message);
    snprintf(want, sizeof want, "a pointer set holds at most %u entries%s", DP_PTRSET_MAX_ENTRIES, paths ? " at $[1]" : "");
    cr_assert_str_eq(e.message, want);
    s->count = 1;
    dp_ptr_info_t p;
    OK(dp_ptrset_get(s, 0, &p, T_ERR));
    cr_assert_eq(p.refs, 2, "the entry in the set counts the scan's tensor on it: %u", p.refs);
    dp_ptrset_clear(s);
  }
  dp_ptrset_free(s);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* A set of n entries on one device, bases 0x100, 0x200, ... */
static dp_ptrset_t *filled_set(size_t n, dp_device_t d) {
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (size_t k = 0; k < n; k++) OK(dp_ptrset_add(s, d, (void *)(uintptr_t)(0x100 * (k + 1)), 8, NULL, T_ERR));
  return s;
}

/* A thread keeps freed blocks of up to 1 MiB, 8 MiB in all: eight blocks of
 * exactly 1 MiB are kept and a ninth is freed; records that take them back
 * and free them again leave the thread keeping as much as before; a drain
 * frees them all and forgets them, so that the next records allocate and
 * the thread keeps eight again. */
Test(ptrset, a_thread_keeps_eight_blocks_of_one_mib_frees_a_ninth_and_a_drain_forgets_them) {
  dp__ptrs_recycle_drain();
  size_t n = dp__ptrs_block_cap((size_t)1 << 20);
  cr_assert_eq(dp__ptrs_block_size(n), (size_t)1 << 20);
  dp_ptrset_t *s = filled_set(n, t_dev(DP_DEVICE_CUDA, 0));
  dp__ptrs_t r[9];
  for (int i = 0; i < 9; i++) {
    OK(dp__ptrs_freeze(&r[i], s, 0, 0, T_ERR));
    cr_assert_eq(r[i].block_size, (size_t)1 << 20);
    cr_assert_null(r[i].meta, "one device and no extra: all in the block");
  }
  long live = t_live_blocks;
  for (int i = 0; i < 8; i++) dp__ptrs_free(&r[i]);
  cr_assert_eq(t_live_blocks, live, "eight blocks of 1 MiB (8 MiB in all) are kept, %ld freed", live - t_live_blocks);
  dp__ptrs_free(&r[8]);
  cr_assert_eq(t_live_blocks, live - 1, "a ninth would pass 8 MiB: it is freed");
  for (int round = 0; round < 2; round++) {
    long allocs = t_alloc_count;
    for (int i = 0; i < 8; i++) OK(dp__ptrs_freeze(&r[i], s, 0, 0, T_ERR));
    cr_assert_eq(t_alloc_count, allocs, "round %d: eight records take the kept blocks (%ld allocations)", round,
                 t_alloc_count - allocs);
    dp_ptr_info_t p;
    dp__ptrs_get(&r[7], n - 1, &p);
    cr_assert_eq((uintptr_t)p.base, 0x100 * n);
    for (int i = 0; i < 8; i++) dp__ptrs_free(&r[i]);
    cr_assert_eq(t_live_blocks, live - 1, "round %d: freed again, all eight are kept again", round);
  }
  dp__ptrs_recycle_drain();
  cr_assert_eq(t_live_blocks, live - 9, "a drain frees every kept block");
  long allocs = t_alloc_count;
  for (int i = 0; i < 8; i++) OK(dp__ptrs_freeze(&r[i], s, 0, 0, T_ERR));
  cr_assert_eq(t_alloc_count, allocs + 8, "after a drain nothing is kept: each record allocates its block");
  for (int i = 0; i < 8; i++) dp__ptrs_free(&r[i]);
  cr_assert_eq(t_live_blocks, live - 1, "and the thread keeps eight blocks again");
  dp__ptrs_recycle_drain();
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A thread keeps at most 32 blocks, however small: the 33rd is freed. */
Test(ptrset, a_thread_keeps_at_most_32_blocks_and_frees_the_33rd) {
  dp__ptrs_recycle_drain();
  dp_ptrset_t *s = filled_set(1, t_dev(DP_DEVICE_CUDA, 0));
  dp__ptrs_t r[33];
  for (int i = 0; i < 33; i++) OK(dp__ptrs_freeze(&r[i], s, 0, 0, T_ERR));
  long live = t_live_blocks;
  for (int i = 0; i < 32; i++) dp__ptrs_free(&r[i]);
  cr_assert_eq(t_live_blocks, live, "32 blocks are kept, %ld freed", live - t_live_blocks);
  dp__ptrs_free(&r[32]);
  cr_assert_eq(t_live_blocks, live - 1, "the 33rd is freed");
  dp__ptrs_recycle_drain();
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}

/* A kept block goes to a record that needs exactly half of it, and not to
 * one that needs less than half: 9 entries' block (352 bytes) holds 2
 * entries' (176), not 1 entry's (160). */
Test(ptrset, a_kept_block_goes_to_a_record_needing_exactly_half_of_it_and_not_to_one_needing_less) {
  dp__ptrs_recycle_drain();
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  cr_assert_eq(dp__ptrs_block_size(9), 2 * dp__ptrs_block_size(2));
  cr_assert_lt(2 * dp__ptrs_block_size(1), dp__ptrs_block_size(9));
  dp_ptrset_t *s9 = filled_set(9, a), *s2 = filled_set(2, a), *s1 = filled_set(1, a);
  dp__ptrs_t r9, r2, r1;
  OK(dp__ptrs_freeze(&r9, s9, 0, 0, T_ERR));
  dp__ptrs_free(&r9); /* kept */
  long allocs = t_alloc_count;
  OK(dp__ptrs_freeze(&r1, s1, 0, 0, T_ERR));
  cr_assert_eq(t_alloc_count, allocs + 1, "1 entry needs less than half of the kept block: it allocates");
  cr_assert_eq(r1.block_size, dp__ptrs_block_size(1));
  allocs = t_alloc_count;
  OK(dp__ptrs_freeze(&r2, s2, 0, 0, T_ERR));
  cr_assert_eq(t_alloc_count, allocs, "2 entries need exactly half of it: they take it");
  cr_assert_eq(r2.block_size, dp__ptrs_block_size(9));
  dp__ptrs_free(&r1);
  dp__ptrs_free(&r2);
  dp_ptrset_free(s9);
  dp_ptrset_free(s2);
  dp_ptrset_free(s1);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A taken set given a kept block larger than it needed uses all of that
 * block; then, sized for records, a value that fills half of it is copied
 * and leaves the set, its block and its entries as they were. */
Test(ptrset, a_taken_set_uses_the_whole_kept_block_it_gets_and_then_keeps_it_for_smaller_values) {
  dp__ptrs_recycle_drain();
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptrset_t *s40 = filled_set(40, a), *s = filled_set(24, a);
  cr_assert_eq(s->cap, 32);
  dp__ptrs_t r40, r, r2;
  OK(dp__ptrs_freeze(&r40, s40, 0, 0, T_ERR));
  dp__ptrs_free(&r40); /* kept: room for 40 */
  void *block = s->block;
  OK(dp__ptrs_freeze(&r, s, 1, 0, T_ERR));
  cr_assert_eq(r.block, block, "taken");
  cr_assert_eq(s->block_size, dp__ptrs_block_size(40), "the set got the kept block");
  cr_assert_eq(s->cap, 40, "and all of its room: %zu entries, not 40", s->cap);
  for (uintptr_t k = 0; k < 20; k++) OK(dp_ptrset_add(s, a, (void *)(0x10000 + 0x100 * k), 8, NULL, T_ERR));
  void *sized = s->block;
  OK(dp__ptrs_freeze(&r2, s, 1, 0, T_ERR));
  cr_assert_neq(r2.block, sized, "half of the block unused: copied");
  cr_assert_eq(s->block, sized, "the set sized for records keeps its block");
  cr_assert_eq(s->cap, 40);
  cr_assert_eq(dp_ptrset_count(s), 20, "and its entries");
  dp__ptrs_free(&r);
  dp__ptrs_free(&r2);
  dp_ptrset_free(s);
  dp_ptrset_free(s40);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A set that grew to 64 entries' room: taken when at most n/16 + 8 of it are
 * unused (53 entries: 11), copied with one more unused (52: 12); copied at
 * exactly half full (32), it is emptied and given a block of 32. */
Test(ptrset, a_grown_set_is_taken_with_at_most_n_16_plus_8_unused_and_emptied_when_half_full) {
  dp__ptrs_recycle_drain();
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  size_t ns[3] = {53, 52, 32};
  for (int i = 0; i < 3; i++) {
    dp_ptrset_t *s = filled_set(i == 2 ? 40 : ns[i], a);
    if (i == 2) { /* cleared: its room stays */
      dp_ptrset_clear(s);
      for (uintptr_t k = 0; k < ns[i]; k++) OK(dp_ptrset_add(s, a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
    }
    cr_assert_eq(s->cap, 64);
    void *block = s->block;
    dp__ptrs_t r;
    OK(dp__ptrs_freeze(&r, s, 1, 0, T_ERR));
    cr_assert_eq(r.n, ns[i]);
    if (i == 0) cr_assert_eq(r.block, block, "53 of 64: taken");
    else cr_assert_neq(r.block, block, "%zu of 64: copied", ns[i]);
    if (i == 2) {
      cr_assert_eq(dp_ptrset_count(s), 0, "half full: the set is emptied");
      cr_assert_eq(s->cap, 32, "and given a block of 32 entries, not %zu", s->cap);
    }
    dp__ptrs_free(&r);
    dp_ptrset_free(s);
  }
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* The caller's extra bytes go in the block's tail when they fit beside the
 * one device's entry (DP__PTRS_TAIL - 32 bytes), else in a block of their
 * own; an empty set frozen with extra bytes has them too. */
Test(ptrset, extra_bytes_that_just_fit_the_tail_go_there_one_more_gets_a_block_and_an_empty_set_has_them_too) {
  dp__ptrs_recycle_drain();
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptrset_t *s = filled_set(3, a);
  size_t fit = DP__PTRS_TAIL - 32;
  dp__ptrs_t r;
  OK(dp__ptrs_freeze(&r, s, 0, fit, T_ERR));
  cr_assert_null(r.meta, "%zu extra bytes fit the tail", fit);
  cr_assert(r.extra && (char *)r.extra + fit <= (char *)r.block + r.block_size);
  memset(r.extra, 0x5a, fit);
  cr_assert_eq(r.ndevs, 1);
  cr_assert_eq(r.devs[0].count, 3);
  dp__ptrs_free(&r);
  OK(dp__ptrs_freeze(&r, s, 0, fit + 1, T_ERR));
  cr_assert_not_null(r.meta, "%zu do not", fit + 1);
  memset(r.extra, 0x5a, fit + 1);
  dp__ptrs_free(&r);
  dp_ptrset_t *e;
  OK(dp_ptrset_new(&e, T_ERR));
  OK(dp__ptrs_freeze(&r, e, 0, 16, T_ERR));
  cr_assert_eq(r.n, 0);
  cr_assert_not_null(r.extra, "an empty set frozen with extra bytes has them");
  memset(r.extra, 0x5a, 16);
  dp__ptrs_free(&r);
  OK(dp__ptrs_freeze(&r, e, 0, 0, T_ERR));
  cr_assert(!r.block && !r.meta && !r.extra, "and without extra allocates nothing");
  dp_ptrset_free(e);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* With two devices the extra bytes lie after the grouped bases: writing all
 * of them leaves every device's bases as they were. */
Test(ptrset, extra_bytes_beside_grouped_bases_do_not_overlap_them) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0), b = t_dev(DP_DEVICE_CUDA, 1);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 6; k++) OK(dp_ptrset_add(s, k & 1 ? b : a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
  dp__ptrs_t r;
  OK(dp__ptrs_freeze(&r, s, 0, 64, T_ERR));
  memset(r.extra, 0xff, 64);
  cr_assert_eq(r.ndevs, 2);
  for (size_t g = 0; g < 2; g++) {
    cr_assert_eq(r.devs[g].count, 3);
    for (size_t i = 0; i < 3; i++)
      cr_assert_eq((uintptr_t)r.by_dev[r.devs[g].first + i], 0x100 * (2 * i + g + 1), "device %zu, base %zu", g, i);
  }
  dp__ptrs_free(&r);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A taken set whose grouped bases cannot be stored (two devices) fails
 * with DP_ENOMEM and keeps its block, which nothing else keeps: freeing
 * the set and draining the thread frees each block once. */
Test(ptrset, a_taken_set_whose_grouped_bases_cannot_be_stored_keeps_its_block_and_it_is_freed_once) {
  dp__ptrs_recycle_drain();
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0), b = t_dev(DP_DEVICE_CUDA, 1);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  for (uintptr_t k = 0; k < 16; k++) OK(dp_ptrset_add(s, k & 1 ? b : a, (void *)(0x100 * (k + 1)), 8, NULL, T_ERR));
  cr_assert_eq(s->cap, 16);
  void *block = s->block;
  dp__ptrs_t r;
  dp_error_t e;
  dp_error_clear(&e);
  t_fail_at = t_alloc_count + 1;
  int rc = dp__ptrs_freeze(&r, s, 1, 0, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM);
  cr_assert_str_eq(e.message, "out of memory freezing 16 allocations");
  cr_assert(!r.block && !r.meta, "the record is left empty");
  cr_assert_eq(s->block, block, "the set keeps its block");
  cr_assert_eq(dp_ptrset_count(s), 16);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* A record's distinct list fails with DP_ENOMEM whichever allocation fails,
 * and without a failure lists each allocation once. */
typedef struct distinct_ctx {
  dp__ptrs_t raw, out;
} distinct_ctx_t;
static int distinct_run(void *ctx, dp_error_t *err) {
  distinct_ctx_t *c = ctx;
  return dp__ptrs_distinct(&c->raw, &c->out, err);
}
static void distinct_check(void *ctx, int rc, long k) {
  distinct_ctx_t *c = ctx;
  if (rc) cr_assert(!c->out.block && c->out.n == 0, "allocation %ld failed: nothing listed", k);
  else cr_assert_eq(c->out.n, 3, "allocation %ld failed: %zu listed", k, c->out.n);
  dp__ptrs_free(&c->out);
}
Test(ptrset, a_distinct_list_is_enomem_whichever_allocation_fails) {
  dp_device_t a = t_dev(DP_DEVICE_CUDA, 0);
  dp_ptrset_t *s;
  OK(dp_ptrset_new(&s, T_ERR));
  dp__ptrset_set_raw(s, 1);
  uintptr_t bases[5] = {0x100, 0x200, 0x100, 0x300, 0x200};
  for (int k = 0; k < 5; k++) OK(dp_ptrset_add(s, a, (void *)bases[k], 8, NULL, T_ERR));
  distinct_ctx_t c;
  OK(dp__ptrs_freeze(&c.raw, s, 0, 0, T_ERR));
  cr_assert_eq(c.raw.n, 5);
  t_sweep_t sw = {NULL, distinct_run, distinct_check};
  cr_assert_geq(t_sweep(&sw, &c), 2, "the set and its block can each fail");
  dp__ptrs_free(&c.raw);
  dp_ptrset_free(s);
  dp__ptrs_recycle_drain();
  ASSERT_NO_LEAK();
}

/* The largest capacity whose block size fits in a size_t gets one, and one
 * entry more gets 0. */
Test(ptrset, the_largest_capacity_whose_block_fits_gets_a_size_and_one_more_gets_0) {
  size_t per = sizeof(void *) + sizeof(dp__ptrs_rest_t);
  size_t max = (SIZE_MAX - DP__PTRS_TAIL - 64) / per;
  cr_assert_gt(dp__ptrs_block_size(max), max * per);
  cr_assert_eq(dp__ptrs_block_size(max + 1), 0);
}

/* A record freed by a thread-exit destructor that runs after the thread's
 * kept blocks were drained is kept again and drained in the next round:
 * nothing the thread kept outlives it. */
static pthread_key_t late_key;
static void late_free(void *p) {
  dp__ptrs_free(p);
  free(p);
}
static void *keep_then_free_late(void *arg) {
  dp_ptrset_t *s = arg;
  dp__ptrs_t r, *late = malloc(sizeof *late);
  if (!late || dp__ptrs_freeze(&r, s, 0, 0, NULL) != 0) return (void *)1;
  dp__ptrs_free(&r); /* kept: the thread's drain is armed */
  if (dp__ptrs_freeze(late, s, 0, 0, NULL) != 0) return (void *)1;
  pthread_setspecific(late_key, late); /* freed after the drain (a later key) */
  return NULL;
}
Test(ptrset, a_record_freed_by_a_later_thread_exit_destructor_is_drained_too) {
  dp_ptrset_t *s = filled_set(4, t_dev(DP_DEVICE_CUDA, 0));
  dp__ptrs_t r;
  OK(dp__ptrs_freeze(&r, s, 0, 0, T_ERR));
  dp__ptrs_free(&r); /* the drain's key exists before late_key */
  dp__ptrs_recycle_drain();
  cr_assert_eq(pthread_key_create(&late_key, late_free), 0);
  pthread_t th;
  void *ret;
  cr_assert_eq(pthread_create(&th, NULL, keep_then_free_late, s), 0);
  cr_assert_eq(pthread_join(th, &ret), 0);
  cr_assert_null(ret);
  pthread_key_delete(late_key);
  dp_ptrset_free(s);
  ASSERT_NO_LEAK();
}
