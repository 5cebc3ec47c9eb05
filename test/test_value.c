/* Value model: ownership, containers, tensors, customs, cycles, equality. */
#include <pthread.h>
#include <time.h>

#include "helpers.h"
#include "../value/gc.h" /* dp__gc_pause_hook */
#include "../core/path.h" /* dp__is_identifier */

static void setup(void) { t_track(); }
static void teardown(void) { dp_set_allocator(NULL, NULL); }
TestSuite(value, .init = setup, .fini = teardown);

Test(value, scalars_are_sixteen_bytes_and_hold_no_reference) {
  cr_assert_eq(sizeof(dp_value_t), 16);
  dp_value_t i = dp_int(-5);
  cr_assert_eq(dp_value_kind(i), DP_INT);
  cr_assert_eq(dp_value_as_int(i), -5);
  cr_assert_eq(dp_value_refcount(i), 1);
  dp_value_release(dp_value_retain(i));
  cr_assert_eq(dp_value_as_float(dp_float(2.5)), 2.5);
  cr_assert(dp_value_as_bool(dp_bool(true)));
  ASSERT_NO_LEAK();
}

Test(value, str_rejects_invalid_utf8_with_a_message) {
  dp_value_t v;
  dp_error_t e;
  cr_assert_eq(dp_str_new("\xc3\x28", 2, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_str_new: invalid UTF-8");
  cr_assert_eq(dp_str_new("\xed\xa0\x80", 3, &v, &e), DP_EINVAL, "surrogates are not UTF-8");
  cr_assert_eq(dp_str_new("\xc0\xaf", 2, &v, &e), DP_EINVAL, "overlong encodings are not UTF-8");
  OK_WITH(&e, dp_str_new("h\xc3\xa9llo\xf0\x9f\x98\x80", 10, &v, &e));
  size_t n;
  cr_assert_str_eq(dp_str_data(v, &n), "h\xc3\xa9llo\xf0\x9f\x98\x80");
  cr_assert_eq(n, 10);
  dp_value_release(v);
  ASSERT_NO_LEAK();
}

Test(value, bytes_keep_embedded_zeros) {
  dp_value_t v;
  OK(dp_bytes_new("a\0b", 3, &v, T_ERR));
  size_t n;
  const uint8_t *p = dp_bytes_data(v, &n);
  cr_assert_eq(n, 3);
  cr_assert_eq(p[1], 0);
  cr_assert_null(dp_str_data(v, NULL), "bytes are not str");
  dp_value_release(v);
  ASSERT_NO_LEAK();
}

Test(value, list_append_steals_and_release_frees_the_tree) {
  dp_value_t l = t_list();
  dp_value_t s = t_str("x");
  OK(dp_list_append(l, s, T_ERR));
  cr_assert_eq(dp_value_refcount(s), 1, "append took the caller's reference");
  OK(dp_list_append(l, dp_int(3), T_ERR));
  cr_assert_eq(dp_seq_len(l), 2);
  cr_assert_eq(dp_seq_get(l, 0).u.h, s.u.h, "get borrows the same node");
  cr_assert_eq(dp_value_kind(dp_seq_get(l, 9)), DP_NONE, "out of range reads none");
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

Test(value, stealing_functions_consume_the_argument_even_when_they_fail) {
  dp_value_t notalist = dp_int(1);
  dp_value_t s = t_str("kept?");
  dp_error_t e;
  cr_assert_eq(dp_list_append(notalist, s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_list_append: expected list, got int");
  dp_value_t t;
  OK(dp_tuple_new(1, &t, T_ERR));
  cr_assert_eq(dp_seq_set(t, 5, t_str("y"), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_seq_set: index 5 out of range (length 1)");
  dp_value_release(t);
  ASSERT_NO_LEAK();
}

Test(value, dict_keeps_insertion_order_and_replaces_in_place) {
  dp_value_t d;
  OK(dp_dict_new(0, &d, T_ERR));
  for (int i = 0; i < 40; i++) OK(dp_dict_set(d, dp_int(i * 7 % 40), dp_int(i), T_ERR));
  OK(dp_dict_set(d, t_str("k"), dp_int(1), T_ERR));
  OK(dp_dict_set(d, dp_int(0), dp_int(99), T_ERR));
  cr_assert_eq(dp_dict_len(d), 41);
  dp_value_t k, v;
  OK(dp_dict_item(d, 0, &k, &v, T_ERR));
  cr_assert_eq(dp_value_as_int(k), 0);
  cr_assert_eq(dp_value_as_int(v), 99, "replacing keeps the position");
  OK(dp_dict_item(d, 1, &k, &v, T_ERR));
  cr_assert_eq(dp_value_as_int(k), 7);
  dp_value_t key = t_str("k");
  OK(dp_dict_get(d, key, &v, T_ERR));
  cr_assert_eq(dp_value_as_int(v), 1);
  dp_value_release(key);
  cr_assert_eq(dp_dict_get(d, dp_float(0.0), &v, NULL), DP_ENOTFOUND, "int 0 and float 0.0 are different keys");
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

Test(value, dict_rejects_unhashable_keys_and_names_the_kind) {
  dp_value_t d;
  OK(dp_dict_new(0, &d, T_ERR));
  dp_error_t e;
  cr_assert_eq(dp_dict_set(d, t_list(), dp_int(1), &e), DP_ETYPE);
  cr_assert_str_eq(e.message, "dict key of kind list is not hashable");
  dp_value_t tup;
  OK(dp_tuple_new(2, &tup, T_ERR));
  OK(dp_seq_set(tup, 0, dp_int(1), T_ERR));
  OK(dp_seq_set(tup, 1, t_str("a"), T_ERR));
  cr_assert(dp_value_is_hashable(tup));
  OK(dp_dict_set(d, dp_value_retain(tup), dp_int(2), T_ERR));
  dp_value_t v;
  OK(dp_dict_get(d, tup, &v, T_ERR));
  cr_assert_eq(dp_value_as_int(v), 2);
  /* a tuple that contains itself is not hashable */
  OK(dp_seq_set(tup, 1, dp_value_retain(tup), T_ERR));
  cr_assert_not(dp_value_is_hashable(tup));
  dp_value_release(tup);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

Test(value, object_attributes_keep_order_and_are_found_by_name) {
  dp_value_t o = t_obj("Linear");
  cr_assert_str_eq(dp_object_class(o), "Linear");
  char name[16];
  for (int i = 0; i < 30; i++) {
    snprintf(name, sizeof name, "a%d", i);
    OK(dp_object_set(o, name, dp_int(i), T_ERR));
  }
  OK(dp_object_set(o, "a3", dp_int(-3), T_ERR));
  cr_assert_eq(dp_object_nattrs(o), 30);
  const char *n;
  dp_value_t v;
  OK(dp_object_attr(o, 3, &n, &v, T_ERR));
  cr_assert_str_eq(n, "a3");
  cr_assert_eq(dp_value_as_int(v), -3);
  OK(dp_object_get(o, "a29", &v, T_ERR));
  cr_assert_eq(dp_value_as_int(v), 29);
  cr_assert_eq(dp_object_get(o, "nope", &v, NULL), DP_ENOTFOUND);
  dp_error_t e;
  cr_assert_eq(dp_object_set(o, "", dp_int(1), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "attribute name must be non-empty UTF-8 without NUL");
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

Test(value, long_attribute_names_and_objects_that_outgrow_their_first_block) {
  dp_value_t o = t_obj("Config");
  const char *longname = "a_rather_long_attribute_name_well_past_sixteen_bytes";
  OK(dp_object_set(o, longname, t_str("v1"), T_ERR));
  for (int i = 0; i < 9; i++) {  /* past the attributes allocated with the object */
    char name[48];
    snprintf(name, sizeof name, "%s_%d", i % 2 ? "short" : "another_quite_long_attribute", i);
    OK(dp_object_set(o, name, dp_int(i), T_ERR));
  }
  OK(dp_object_set(o, longname, t_str("v2"), T_ERR));
  dp_value_t v;
  OK(dp_object_get(o, longname, &v, T_ERR));
  cr_assert_str_eq(dp_str_data(v, NULL), "v2");
  const char *n;
  OK(dp_object_attr(o, 0, &n, NULL, T_ERR));
  cr_assert_str_eq(n, longname);
  OK(dp_object_attr(o, 2, &n, NULL, T_ERR));
  cr_assert_str_eq(n, "short_1");
  cr_assert_eq(dp_object_nattrs(o), 10);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

/* An allocator that moves every block it grows and fills the old one with
 * 'Z' before keeping it aside (freed at the end): a read of a grown array
 * through a pointer taken before the growth reads 'Z's, not freed memory. */
#define T_MOVED_MAX 64
static struct {
  void *p[T_MOVED_MAX];
  size_t n[T_MOVED_MAX];
  int len;
} t_moved;

static void *t_moving_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  if (!ptr || nsize == 0 || t_moved.len == T_MOVED_MAX) return t_alloc(ud, ptr, osize, nsize);
  void *p = t_alloc(ud, NULL, 0, nsize);
  if (!p) return NULL;
  memcpy(p, ptr, osize < nsize ? osize : nsize);
  memset(ptr, 'Z', osize);
  t_moved.p[t_moved.len] = ptr;
  t_moved.n[t_moved.len++] = osize;
  return p;
}

Test(value, an_attribute_name_borrowed_from_the_objects_own_array_survives_the_array_growing) {
  dp_value_t o = t_obj("Grown");
  char name[32];
  for (int i = 0; i < 8; i++) {  /* past the attributes allocated with the object: the array is the hook's */
    snprintf(name, sizeof name, "x_%d", i);
    OK(dp_object_set(o, name, dp_int(i), T_ERR));
  }
  t_moved.len = 0;
  dp_set_allocator(t_moving_alloc, NULL);
  /* The tail of each name ("_0", "_1", ...) is a new attribute: a name
   * dp_object_attr gave is valid until the next set, which is this one. */
  size_t had = dp_object_nattrs(o);
  for (size_t i = 0; i < had; i++) {
    const char *n;
    OK(dp_object_attr(o, i, &n, NULL, T_ERR));
    OK(dp_object_set(o, n + 1, dp_int((int64_t)i), T_ERR));
  }
  dp_set_allocator(t_alloc, NULL);
  cr_assert_gt(t_moved.len, 0, "the attribute array never grew");
  cr_assert_eq(dp_object_nattrs(o), 2 * had);
  for (size_t i = 0; i < had; i++) {
    const char *n;
    OK(dp_object_attr(o, had + i, &n, NULL, T_ERR));
    snprintf(name, sizeof name, "_%zu", i);
    cr_assert_str_eq(n, name);
    dp_value_t v;
    OK(dp_object_get(o, name, &v, T_ERR));
    cr_assert_eq(dp_value_as_int(v), (int64_t)i);
  }
  for (int i = 0; i < t_moved.len; i++) t_alloc(NULL, t_moved.p[i], t_moved.n[i], 0);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

Test(value, tensor_views_must_fit_their_storage) {
  dp_storage_t *s = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 400);
  dp_value_t t;
  dp_error_t e;
  int64_t shape[2] = {10, 10}, strides[2] = {10, 1};
  OK_WITH(&e, dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 2, shape, strides, 0, &t, &e));
  cr_assert_eq(dp_tensor_ndim(t), 2);
  cr_assert_eq(dp_tensor_strides(t)[0], 10);
  dp_value_release(t);
  cr_assert_eq(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 2, shape, strides, 1, &t, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "tensor view exceeds its storage of 400 bytes");
  int64_t rev[1] = {-1}, n[1] = {100};
  OK_WITH(&e, dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 1, n, rev, 99, &t, &e));
  dp_value_release(t);
  cr_assert_eq(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 1, n, rev, 98, &t, &e), DP_EINVAL,
               "a negative stride below element 0 is outside");
  int64_t empty[1] = {0};
  OK_WITH(&e, dp_tensor_new(dp_storage_retain(s), DP_FLOAT64, 1, empty, NULL, 1000, &t, &e));
  dp_value_release(t);
  cr_assert_eq(dp_storage_nbytes(s), 400);
  dp_storage_release(s);
  s = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 1);
  int64_t two[1] = {2};
  cr_assert_eq(dp_tensor_new(dp_storage_retain(s), DP_UINT8, 1, two, NULL, 0, &t, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "tensor view exceeds its storage of 1 byte");
  dp_storage_release(s);
  ASSERT_NO_LEAK();
}

/* dp_tensor_new with shape, strides and offset on one storage of nbytes:
 * 0 or the error's message. */
static const char *view_check(size_t nbytes, dp_dtype_t dt, int nd, const int64_t *shape, const int64_t *strides,
                              int64_t offset) {
  static char msg[DP_ERROR_MSG_MAX];
  dp_value_t t;
  dp_error_t e;
  int rc = dp_tensor_new(t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, nbytes), dt, nd, shape, strides, offset, &t, &e);
  if (rc == 0) {
    dp_value_release(t);
    return NULL;
  }
  cr_assert_eq(rc, DP_EINVAL);
  snprintf(msg, sizeof msg, "%s", e.message);
  return msg;
}

Test(value, tensor_extents_are_computed_exactly_at_the_edges_of_64_bits) {
  const int64_t max = INT64_MAX, p61 = (int64_t)1 << 61, p62 = (int64_t)1 << 62;
  /* the review's view: complex128 [2^61+1], stride 2^63-1, offset 2^61 over 16 bytes */
  cr_assert_str_eq(view_check(16, DP_COMPLEX128, 1, (int64_t[]){p61 + 1}, (int64_t[]){max}, p61),
                   "tensor view exceeds its storage of 16 bytes");
  /* sixteen dimensions whose spans each fit but whose sum does not */
  int64_t sh[16], st[16];
  for (int d = 0; d < 16; d++) { sh[d] = 2; st[d] = max; }
  cr_assert_not_null(view_check(SIZE_MAX, DP_INT8, 16, sh, st, 0));
  /* the largest view: element index 2^63-1 of a 1-byte dtype ends at 2^63 */
  cr_assert_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){1}, NULL, max));
  cr_assert_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){2}, (int64_t[]){max}, 0));
  cr_assert_not_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){2}, (int64_t[]){max}, 1), "hi overflows int64");
  /* (hi + 1) * itemsize: 2^63 * 2 is exactly 2^64 */
  cr_assert_str_eq(view_check(SIZE_MAX, DP_INT16, 1, (int64_t[]){1}, NULL, max),
                   "tensor view exceeds its storage of 18446744073709551615 bytes");
  cr_assert_null(view_check(SIZE_MAX, DP_INT16, 1, (int64_t[]){1}, NULL, max - 1), "ends at 2^64 - 2");
  /* exactly fitting, and one byte short */
  cr_assert_null(view_check((size_t)p62, DP_INT8, 1, (int64_t[]){p62}, NULL, 0));
  cr_assert_not_null(view_check((size_t)p62 - 1, DP_INT8, 1, (int64_t[]){p62}, NULL, 0));
  /* element counts: 2^62 allowed, 2^62 + 1 not, products at 2^63 and 2^64 overflow */
  cr_assert_null(view_check(SIZE_MAX, DP_INT8, 2, (int64_t[]){(int64_t)1 << 31, (int64_t)1 << 31}, NULL, 0));
  cr_assert_str_eq(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){p62 + 1}, NULL, 0),
                   "tensor has too many elements (at most 2^62)");
  cr_assert_str_eq(view_check(SIZE_MAX, DP_INT8, 2, (int64_t[]){2, p62}, (int64_t[]){0, 0}, 0),
                   "tensor has too many elements (at most 2^62)");
  cr_assert_str_eq(view_check(SIZE_MAX, DP_INT8, 2, (int64_t[]){(int64_t)1 << 32, (int64_t)1 << 32},
                              (int64_t[]){0, 0}, 0),
                   "tensor has too many elements (at most 2^62)");
  /* negative strides: down to element 0 and not below; spans past int64 */
  cr_assert_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){2}, (int64_t[]){-max}, max));
  cr_assert_not_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){2}, (int64_t[]){-max}, max - 1));
  cr_assert_not_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){2}, (int64_t[]){INT64_MIN}, max));
  cr_assert_not_null(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){3}, (int64_t[]){INT64_MIN}, max));
  cr_assert_not_null(view_check(SIZE_MAX, DP_INT8, 2, (int64_t[]){2, 2}, (int64_t[]){-max, -max}, max));
  /* a 0 dimension addresses nothing, whatever the rest */
  cr_assert_null(view_check(0, DP_COMPLEX128, 3, (int64_t[]){p62, 0, p62}, (int64_t[]){max, max, -max}, max));
  /* but a stride of -2^63, which the format cannot carry, is refused even there (and
     on a dimension of 1, where it multiplies 0): dp_pickle would write a frame the
     reader refuses */
  cr_assert_str_eq(view_check(0, DP_COMPLEX128, 3, (int64_t[]){p62, 0, p62}, (int64_t[]){max, max, INT64_MIN}, max),
                   "tensor stride -2^63 (strides lie in -(2^63-1)..2^63-1)");
  cr_assert_str_eq(view_check(SIZE_MAX, DP_INT8, 1, (int64_t[]){1}, (int64_t[]){INT64_MIN}, 0),
                   "tensor stride -2^63 (strides lie in -(2^63-1)..2^63-1)");
  /* contiguous strides of an empty view of a huge shape do not fit int64 */
  cr_assert_str_eq(view_check(0, DP_INT8, 3, (int64_t[]){2, p62, p62}, NULL, 0),
                   "tensor has too many elements (at most 2^62)");
  cr_assert_str_eq(view_check(0, DP_INT8, 3, (int64_t[]){0, p62, p62}, NULL, 0),
                   "contiguous strides of this shape overflow int64");
  cr_assert_null(view_check(0, DP_INT8, 3, (int64_t[]){p62, p62, 0}, NULL, 0));
  ASSERT_NO_LEAK();
}

Test(value, every_dtype_has_a_name_and_size) {
  static const char *const names[] = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                      "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
                                      "complex128"};
  static const size_t sizes[] = {1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16};
  for (int i = 0; i < DP_DTYPE_COUNT; i++) {
    dp_dtype_t d;
    cr_assert_eq(dp_dtype_parse(names[i], &d, NULL), 0, "%s", names[i]);
    cr_assert_eq(d, (dp_dtype_t)i);
    cr_assert_str_eq(dp_dtype_name(d), names[i]);
    cr_assert_eq(dp_dtype_size(d), sizes[i]);
  }
  dp_dtype_t d;
  cr_assert_eq(dp_dtype_parse("float8", &d, NULL), DP_EINVAL);
}

static int released_storages;
static void count_release(void *ud, dp_device_t d, void *base, size_t n) {
  (void)ud; (void)d; (void)base; (void)n;
  released_storages++;
}

Test(value, storage_release_callback_runs_once_when_the_last_tensor_goes) {
  released_storages = 0;
  dp_storage_t *s;
  OK(dp_storage_new(t_dev(DP_DEVICE_CUDA, 1), (void *)0x5000, 64, count_release, NULL, &s, T_ERR));
  dp_value_t a = t_view(s, 4, 0), b = t_view(s, 4, 4);
  dp_storage_release(s);
  dp_value_release(a);
  cr_assert_eq(released_storages, 0);
  dp_value_release(b);
  cr_assert_eq(released_storages, 1);
  ASSERT_NO_LEAK();
}

static int destroyed;
static void destroy_count(void *obj) { (void)obj; destroyed++; }
static const dp_type_t counted_type = {"Counted", NULL, destroy_count};

Test(value, custom_destroy_runs_once_and_also_when_creation_fails) {
  destroyed = 0;
  dp_value_t c;
  OK(dp_custom_new(&counted_type, (void *)1, &c, T_ERR));
  cr_assert_eq(dp_custom_type(c), &counted_type);
  cr_assert_eq(dp_custom_data(c), (void *)1);
  dp_value_release(c);
  cr_assert_eq(destroyed, 1);
  t_fail_at = t_alloc_count + 1;
  dp_error_t e;
  cr_assert_eq(dp_custom_new(&counted_type, (void *)2, &c, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "out of memory allocating custom");
  cr_assert_eq(destroyed, 2, "ownership of obj passed even though creation failed");
  ASSERT_NO_LEAK();
}

Test(value, a_custom_without_a_type_leaves_its_obj_to_the_caller_and_one_with_a_type_takes_it_even_on_failure) {
  /* value.h: with a NULL type there is no destroy to call, so obj stays the
     caller's; with a type, a failure still hands obj to its destroy */
  destroyed = 0;
  dp_value_t c;
  dp_error_t e;
  cr_assert_eq(dp_custom_new(NULL, (void *)1, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL type");
  cr_assert_eq(destroyed, 0, "nothing could free obj: it stays the caller's");
  cr_assert_eq(dp_custom_new(&counted_type, (void *)1, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL out");
  cr_assert_eq(destroyed, 1, "a type was given: its destroy took obj");
  ASSERT_NO_LEAK();
}

/* An obj that holds its own type (a type made for each object): destroy
 * fills it with 'Z', as freeing it would leave it for all the caller can
 * tell (it is freed by the test afterwards, not by destroy). */
typedef struct self_typed {
  dp_type_t type;
} self_typed_t;

static void self_typed_destroy(void *obj) {
  memset(obj, 'Z', sizeof(self_typed_t));
}

Test(value, a_failed_custom_new_says_what_was_wrong_with_a_type_its_obj_holds_and_destroys) {
  dp_value_t c;
  dp_error_t e;
  self_typed_t *o = malloc(sizeof *o);
  cr_assert_not_null(o);
  *o = (self_typed_t){{NULL, NULL, self_typed_destroy}};
  cr_assert_eq(dp_custom_new(&o->type, o, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL type->name");
  cr_assert_eq(((unsigned char *)o)[0], 'Z', "destroy took obj");
  *o = (self_typed_t){{"SelfTyped", NULL, self_typed_destroy}};
  cr_assert_eq(dp_custom_new(&o->type, o, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL out");
  *o = (self_typed_t){{"", NULL, self_typed_destroy}};
  cr_assert_eq(dp_custom_new(&o->type, o, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: a type name must be non-empty UTF-8");
  cr_assert_eq(((unsigned char *)o)[0], 'Z', "destroy took obj");
  free(o);
  ASSERT_NO_LEAK();
}

Test(value, a_capacity_whose_size_overflows_is_out_of_memory_for_lists_tuples_and_dicts) {
  /* value.h: capacity is a hint allocated with the container; one whose
     byte size wraps must not wrap into a small block */
  dp_value_t v;
  dp_error_t e;
  cr_assert_eq(dp_list_new(SIZE_MAX / 16 + 2, &v, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "out of memory allocating list");
  cr_assert_eq(dp_tuple_new(SIZE_MAX / 16 + 2, &v, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "out of memory allocating tuple");
  cr_assert_eq(dp_dict_new(SIZE_MAX / 8 + 2, &v, &e), DP_ENOMEM);
  cr_assert_str_eq(e.message, "out of memory allocating dict");
  OK(dp_list_new(2, &v, T_ERR));
  cr_assert_eq(dp_seq_len(v), 0, "a list's capacity is room, not items");
  for (int i = 0; i < 5; i++) OK(dp_list_append(v, dp_int(i), T_ERR));
  cr_assert_eq(dp_seq_len(v), 5, "and it grows past it");
  dp_value_release(v);
  ASSERT_NO_LEAK();
}

/* ---- cycles ---- */

Test(value, a_list_that_contains_itself_is_freed) {
  dp_value_t l = t_list();
  OK(dp_list_append(l, dp_value_retain(l), T_ERR));
  OK(dp_list_append(l, t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 4), T_ERR));
  cr_assert_eq(dp_value_refcount(l), 2);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

Test(value, a_cycle_of_objects_is_freed_when_the_last_outside_reference_goes) {
  dp_value_t a = t_obj("Node"), b = t_obj("Node");
  OK(dp_object_set(a, "next", dp_value_retain(b), T_ERR));
  OK(dp_object_set(b, "next", dp_value_retain(a), T_ERR));
  OK(dp_object_set(b, "data", t_str("payload"), T_ERR));
  dp_value_release(a);
  /* b still held: nothing may be freed */
  dp_value_t n;
  OK(dp_object_get(b, "next", &n, T_ERR));
  cr_assert_str_eq(dp_object_class(n), "Node");
  OK(dp_object_get(n, "next", &n, T_ERR));
  cr_assert_eq(n.u.h, b.u.h);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* A chain whose links are freed by the user's code — a custom's destroy
 * releasing the next custom, a storage's release callback releasing a
 * tensor on the next storage — frees in constant stack: a release inside
 * such a callback is queued for the outermost one (a million links
 * overflowed the stack). */
static long links_freed;
static void free_link(void *obj) {
  dp_value_t *next = obj;
  dp_value_release(*next);
  free(next);
  links_freed++;
}
static const dp_type_t link_type = {"Link", NULL, free_link};

static void release_next_tensor(void *ud, dp_device_t device, void *base, size_t nbytes) {
  (void)device, (void)base, (void)nbytes;
  free_link(ud);
}

Test(value, a_million_links_freed_by_their_own_destroy_or_release_callbacks_free_without_recursion) {
  enum { N = 1000000 };
  links_freed = 0;
  dp_value_t head = dp_none();
  for (int i = 0; i < N; i++) {
    dp_value_t *next = malloc(sizeof *next);
    *next = head;
    OK(dp_custom_new(&link_type, next, &head, T_ERR));
  }
  dp_value_release(head);
  cr_assert_eq(links_freed, N);
  links_freed = 0;
  head = dp_none();
  for (int i = 0; i < N; i++) {
    dp_value_t *next = malloc(sizeof *next);
    *next = head;
    dp_storage_t *s;
    OK(dp_storage_new(t_dev(DP_DEVICE_CUDA, 0), (void *)(uintptr_t)(0x1000 + 64 * (uintptr_t)i), 64,
                      release_next_tensor, next, &s, T_ERR));
    head = t_view(s, 4, 0);
    dp_storage_release(s);
  }
  dp_value_release(head);
  cr_assert_eq(links_freed, N);
  ASSERT_NO_LEAK();
}

static int reduce_to_none(void *obj, dp_value_t *state, dp_error_t *err) {
  (void)obj, (void)err;
  *state = dp_none();
  return 0;
}

Test(value, a_custom_type_name_a_frame_cannot_carry_and_extra_attributes_of_a_stand_in_are_refused) {
  destroyed = 0;
  static const dp_type_t empty = {"", reduce_to_none, destroy_count}, bad = {"\xff\xfe", reduce_to_none, destroy_count};
  dp_value_t c;
  dp_error_t e;
  cr_assert_eq(dp_custom_new(&empty, NULL, &c, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: a type name must be non-empty UTF-8");
  cr_assert_eq(dp_custom_new(&bad, NULL, &c, &e), DP_EINVAL);
  cr_assert_eq(destroyed, 2, "its obj is the library's even when the call fails");
  dp_value_t o;
  OK(dp_object_new_reduced("T", dp_int(5), &o, T_ERR));
  cr_assert_eq(dp_object_set(o, "extra", dp_int(7), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_set: a reduced stand-in has one attribute, \"__reduce__\" (its state), not 'extra'");
  OK(dp_object_set(o, "__reduce__", dp_int(6), T_ERR)); /* its state may be replaced */
  cr_assert_eq(dp_object_nattrs(o), 1);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

Test(value, garbage_cycle_releases_children_that_are_still_held_elsewhere) {
  dp_value_t kept = t_list();
  OK(dp_list_append(kept, t_str("survivor"), T_ERR));
  dp_value_t a = t_list(), d;
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_dict_set(d, t_str("back"), dp_value_retain(a), T_ERR));
  OK(dp_dict_set(d, t_str("kept"), dp_value_retain(kept), T_ERR));
  OK(dp_list_append(a, d, T_ERR));
  dp_value_release(a);  /* a <-> d is garbage; kept is not */
  dp_value_collect();
  cr_assert_eq(dp_value_refcount(kept), 1);
  size_t n;
  cr_assert_str_eq(dp_str_data(dp_seq_get(kept, 0), &n), "survivor");
  dp_value_release(kept);
  ASSERT_NO_LEAK();
}

Test(value, a_ring_of_a_hundred_thousand_objects_frees_without_recursion) {
  dp_value_t head = t_obj("Node"), cur = head;
  for (int i = 0; i < 100000; i++) {
    dp_value_t n = t_obj("Node");
    OK(dp_object_set(cur, "next", n, T_ERR));
    cur = n;
  }
  OK(dp_object_set(cur, "next", dp_value_retain(head), T_ERR));
  dp_value_release(head);
  cr_assert_gt(t_live_blocks, 100000, "too large to try at release: deferred");
  dp_value_collect();
  ASSERT_NO_LEAK();
}

Test(value, releasing_a_large_value_still_held_elsewhere_costs_a_bounded_trial) {
  dp_value_t big = t_list();
  for (int i = 0; i < 5000; i++) {
    dp_value_t inner = t_list();
    OK(dp_list_append(inner, dp_int(i), T_ERR));
    OK(dp_list_append(big, inner, T_ERR));
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); /* this thread's CPU time: the machine's load does not count */
  for (int i = 0; i < 2000; i++) dp_value_release(dp_value_retain(big));  /* 2 -> 1 each time */
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  double us = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / 1e3 / 2000;
  cr_assert_lt(us, 20, "%.1f us of CPU a release: it walked the whole value", us);
  cr_assert_eq(dp_value_refcount(big), 1);
  cr_assert_eq(dp_seq_len(big), 5000, "nothing freed: the value is alive");
  dp_value_release(big);
  ASSERT_NO_LEAK();
}

/* Candidates that all reach one large live list: a trial every 256
 * candidates walked the list each time (200,000 holders of a
 * 200,000-item list: 800 walks of it, over 2 s; a 11 MB frame of this shape
 * took 52 s to verify). A buffer now holds as many candidates as its last
 * trial took steps over live containers before it is tried again. */
Test(value, releasing_many_holders_of_one_large_live_list_is_linear_not_quadratic) {
  enum { N = 200000 };
  dp_value_t big = t_list(), root = t_list();
  for (int i = 0; i < N; i++) OK(dp_list_append(big, t_list(), T_ERR));
  OK(dp_list_append(root, big, T_ERR));
  dp_value_t *holders = malloc(N * sizeof *holders);
  for (int i = 0; i < N; i++) {
    holders[i] = t_list();
    OK(dp_list_append(holders[i], dp_value_retain(big), T_ERR));
    OK(dp_list_append(root, holders[i], T_ERR));
  }
  for (int i = 0; i < N; i++) OK(dp_list_append(root, dp_value_retain(holders[i]), T_ERR));
  free(holders);
  struct timespec t0, t1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); /* this thread's CPU time: the machine's load does not count */
  dp_value_release(root);  /* each holder 2 -> 1 (a candidate reaching big), then 1 -> 0 */
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
  cr_assert_lt(s, 1.0, "releasing took %.2f s of CPU: trials walked the shared list again and again", s);
  ASSERT_NO_LEAK();
}

/* The same shape with a large live list of leaves, each of its holders
 * buffered among 255 self-referencing lists (garbage): a trial met two live
 * containers, so the next came 256 candidates later and walked the list's
 * items again — 4 bytes of frame a candidate, one walk of the list each
 * 256 of them: a 4 MB frame of this shape took 9.6 s to verify, 8 MB 35 s.
 * A buffer now holds as many candidates as its last trial walked items of
 * live containers: the walks are paid for by the releases between them. */
extern _Thread_local uint64_t dp__gc_items_walked; /* value/internal.h */
Test(value, a_live_list_of_leaves_reached_by_candidates_among_garbage_is_walked_a_bounded_number_of_times) {
  enum { ITEMS = 100000, GROUPS = 400, CYCLES = 255 };
  dp_value_t big = t_list(), root = t_list();
  for (int i = 0; i < ITEMS; i++) OK(dp_list_append(big, dp_int(i), T_ERR));
  OK(dp_list_append(root, big, T_ERR));
  dp_value_t *holders = malloc(GROUPS * sizeof *holders);
  for (int g = 0; g < GROUPS; g++) {
    for (int c = 0; c < CYCLES; c++) {
      dp_value_t self = t_list();
      OK(dp_list_append(self, dp_value_retain(self), T_ERR));
      OK(dp_list_append(root, self, T_ERR));
    }
    holders[g] = t_list();
    OK(dp_list_append(holders[g], dp_value_retain(big), T_ERR));
    OK(dp_list_append(root, holders[g], T_ERR));
  }
  for (int g = 0; g < GROUPS; g++) OK(dp_list_append(root, dp_value_retain(holders[g]), T_ERR));
  free(holders);
  size_t nodes = (size_t)GROUPS * (CYCLES + 2) + ITEMS;
  dp__gc_items_walked = 0;
  dp_value_release(root);
  dp_value_collect();
  uint64_t walked = dp__gc_items_walked;
  cr_assert_lt(walked, 8 * (uint64_t)nodes,
               "trials walked %llu items for %zu nodes: the live list again and again (%d groups x %d items)",
               (unsigned long long)walked, nodes, GROUPS, ITEMS);
  cr_assert_gt(walked, (uint64_t)ITEMS, "the list was walked at least once: the counter counts");
  ASSERT_NO_LEAK();
}

/* value.h: a candidate buffer starts at 256 entries, allocating nothing;
 * once a collection has met more live containers it grows through the
 * allocator hook, and one that cannot grow is collected as it is. */
Test(value, a_candidate_buffer_grows_through_the_hook_and_one_that_cannot_grow_is_collected_as_it_is) {
  enum { N = 2000, H = 1200 };
  dp_value_t big = t_list(), root = t_list();
  for (int i = 0; i < N; i++) OK(dp_list_append(big, t_list(), T_ERR));
  dp_value_t *holders = malloc(H * sizeof *holders);
  for (int i = 0; i < H; i++) {
    holders[i] = t_list();
    OK(dp_list_append(holders[i], dp_value_retain(big), T_ERR));
    OK(dp_list_append(root, dp_value_retain(holders[i]), T_ERR)); /* holders[i] keeps the other reference */
  }
  dp_value_release(big);
  long before = t_alloc_count;
  /* 256 candidates, then a collection that meets big's N + 1 live containers */
  for (int i = 0; i < 300; i++) dp_value_release(holders[i]);
  cr_assert_eq(t_alloc_count, before, "the first 256 candidates need no allocation");
  before = t_alloc_count;
  for (int i = 300; i < 600; i++) dp_value_release(holders[i]);
  cr_assert_gt(t_alloc_count, before, "a buffer whose last trial met %d live containers grows before the next", N);
  t_fail_at = t_alloc_count + 1; /* its next growth fails: it is collected as it is */
  for (int i = 600; i < H; i++) dp_value_release(holders[i]);
  t_fail_at = 0;
  free(holders);
  cr_assert_eq(dp_seq_len(root), H, "every holder is still held by root");
  for (int i = 0; i < H; i++) cr_assert_eq(dp_value_refcount(dp_seq_get(root, (size_t)i)), 1);
  dp_value_release(root);
  ASSERT_NO_LEAK();
}

/* n lists each holding one shared list of 100 ints, all held by *root:
 * the holders' own references are the caller's (the shared list's are
 * theirs alone). */
static dp_value_t *holders_of_one_list(int n, dp_value_t *root) {
  dp_value_t big = t_list();
  *root = t_list();
  for (int i = 0; i < 100; i++) OK(dp_list_append(big, dp_int(i), T_ERR));
  dp_value_t *holders = malloc((size_t)n * sizeof *holders);
  cr_assert_not_null(holders);
  for (int i = 0; i < n; i++) {
    holders[i] = t_list();
    OK(dp_list_append(holders[i], dp_value_retain(big), T_ERR));
    OK(dp_list_append(*root, dp_value_retain(holders[i]), T_ERR));
  }
  dp_value_release(big);
  return holders;
}

/* A grown candidate array goes back as soon as a trial has emptied it,
 * also when a release ran that trial (no dp_value_collect comes after).
 * Holders of one list of 100 ints (that list the first candidate): the
 * first trial walks 710 items, so the buffer grows to 512 and then 1,024
 * candidates, which the 1,280th holder's release tries. */
Test(value, a_grown_candidate_array_goes_back_when_a_trial_run_by_a_release_empties_it) {
  enum { H = 1280 };
  dp_value_collect();
  dp_value_t root, *holders = holders_of_one_list(H, &root);
  long before = 0;
  uint64_t walked = 0;
  for (int i = 0; i < H; i++) {
    if (i == H - 1) {
      before = atomic_load(&t_live_blocks);
      dp__gc_items_walked = 0;
    }
    dp_value_release(holders[i]);  /* live candidates: root holds them all */
  }
  walked = dp__gc_items_walked;
  long after = atomic_load(&t_live_blocks);
  free(holders);
  cr_assert_gt(walked, 2048, "the last release did not try the 1,024 candidates (%llu items walked)",
               (unsigned long long)walked);
  cr_assert_eq(after, before - 1, "the grown array (one block) did not go back with the trial: %ld blocks, then %ld",
               before, after);
  dp_value_release(root);
  dp_value_collect();
  ASSERT_NO_LEAK();
}

/* A grown candidate array goes back too when the buffer empties because
 * its candidates are released to zero one by one: 600 holders of a list of
 * 100 ints, let go, leave some 345 live candidates in a grown buffer; the
 * release of the list that holds them all frees every block. */
Test(value, a_grown_candidate_array_goes_back_when_its_last_candidate_is_released_to_zero) {
  enum { H = 600 };
  dp_value_collect();
  dp_value_t root, *holders = holders_of_one_list(H, &root);
  long before = atomic_load(&t_live_blocks);
  for (int i = 0; i < H; i++) dp_value_release(holders[i]);
  long grown = atomic_load(&t_live_blocks) - before;
  free(holders);
  dp_value_release(root);
  long live = atomic_load(&t_live_blocks);
  cr_assert_eq(grown, 1, "the buffer did not grow (%ld blocks more)", grown);
  cr_assert_eq(live, 0, "%ld blocks live once every candidate was released to zero", live);
  ASSERT_NO_LEAK();
}

Test(value, cycles_are_collected_when_a_thread_has_buffered_enough_candidates) {
  for (int k = 0; k < 300; k++) {  /* more candidates than one buffer holds */
    dp_value_t head = t_obj("Node"), cur = head;
    for (int i = 0; i < 9; i++) {
      dp_value_t n = t_obj("Node");
      OK(dp_object_set(cur, "next", n, T_ERR));
      cur = n;
    }
    OK(dp_object_set(cur, "next", dp_value_retain(head), T_ERR));
    dp_value_release(head);
  }
  cr_assert_lt(t_live_blocks, 100 * 10, "a full buffer was collected on its own (%ld blocks live)",
               (long)t_live_blocks);
  ASSERT_NO_LEAK();
}

static void destroy_releasing(void *obj) { dp_value_release(*(dp_value_t *)obj); free(obj); }
static const dp_type_t holder_type = {"Holder", NULL, destroy_releasing};

Test(value, a_custom_destroy_may_release_containers_while_a_cycle_is_freed) {
  dp_value_t inner = t_list();
  OK(dp_list_append(inner, dp_value_retain(inner), T_ERR));
  dp_value_t *box = malloc(sizeof *box);
  *box = inner;  /* the custom owns the reference */
  dp_value_t c;
  OK(dp_custom_new(&holder_type, box, &c, T_ERR));
  dp_value_t outer = t_list();
  OK(dp_list_append(outer, dp_value_retain(outer), T_ERR));
  OK(dp_list_append(outer, c, T_ERR));
  dp_value_release(outer);
  ASSERT_NO_LEAK();
}

typedef struct churn_arg {
  dp_value_t shared;
} churn_arg_t;

static void *churn(void *p) {
  churn_arg_t *a = p;
  for (int i = 0; i < 20000; i++) {
    dp_value_t l = t_list();
    dp_list_append(l, dp_value_retain(a->shared), NULL);
    dp_list_append(l, dp_value_retain(l), NULL);  /* a cycle each time */
    dp_value_release(l);
  }
  return NULL;
}

Test(value, references_may_be_taken_and_dropped_from_many_threads) {
  dp_value_t shared = t_obj("Shared");
  OK(dp_object_set(shared, "self", dp_value_retain(shared), T_ERR));
  churn_arg_t arg = {shared};
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, churn, &arg);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  cr_assert_eq(dp_value_refcount(shared), 2, "one for the caller, one for its own attribute");
  dp_value_release(shared);
  ASSERT_NO_LEAK();
}

Test(value, construction_fails_cleanly_at_every_allocation) {
  for (long n = 1;; n++) {
    t_track();
    t_fail_at = n;
    dp_value_t o;
    int rc = dp_object_new("Box", &o, NULL);
    if (rc == 0) {
      dp_value_t d;
      rc = dp_dict_new(0, &d, NULL);
      if (rc == 0) rc = dp_object_set(o, "d", d, NULL);
      for (int i = 0; rc == 0 && i < 12; i++) {
        dp_value_t s;
        rc = dp_str_new("key", 3, &s, NULL);
        if (rc == 0) rc = dp_dict_set(d, dp_int(i), s, NULL);
      }
      dp_value_release(o);
    }
    ASSERT_NO_LEAK();
    if (rc == 0) {
      cr_assert_gt(n, 10, "the loop must have failed some allocations");
      break;
    }
    cr_assert_eq(rc, DP_ENOMEM);
  }
}

/* The calls the sweep above does not make, each swept on its own: every
 * failure is DP_ENOMEM with a message, what a call steals is released, the
 * container it was given holds what it held, and the next call succeeds. */
typedef struct vsweep {
  dp_value_t c;       /* the container given (none for a constructor) */
  dp_value_t made;    /* what the call made */
  dp_value_t item;    /* what the call steals */
  dp_value_t key;
  dp_storage_t *st;
  int op;
} vsweep_t;

enum { V_BYTES, V_LIST, V_TUPLE, V_DICT, V_STORAGE, V_OBJECT, V_APPEND, V_DICT_SET, V_OBJECT_SET, V_HOST_DATA, V_TENSOR,
       V_REDUCED, V_COUNT };

#define V_FILL 8 /* entries already there: the next one makes the index */
static const char v_long_name[] = "an_attribute_name_longer_than_inline";

static void vsweep_prepare(void *p) {
  vsweep_t *s = p;
  s->c = s->made = dp_none();
  s->st = NULL;
  s->item = t_str("new");
  /* a tuple key, whose words are kept only once it is in */
  OK(dp_tuple_new(1, &s->key, T_ERR));
  OK(dp_seq_set(s->key, 0, t_str("k"), T_ERR));
  switch (s->op) {
    case V_APPEND:
      OK(dp_list_new(2, &s->c, T_ERR));
      for (int i = 0; i < 2; i++) OK(dp_list_append(s->c, t_str("item"), T_ERR));
      break;
    case V_DICT_SET:
      OK(dp_dict_new(0, &s->c, T_ERR));
      for (int i = 0; i < V_FILL; i++) OK(dp_dict_set(s->c, dp_int(i), t_str("v"), T_ERR));
      break;
    case V_OBJECT_SET:
      s->c = t_obj("Box");
      for (int i = 0; i < V_FILL; i++) {
        char name[16];
        snprintf(name, sizeof name, "a%d", i);
        OK(dp_object_set(s->c, name, dp_int(i), T_ERR));
      }
      break;
    case V_HOST_DATA:
      s->st = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 4);
      OK(dp_storage_set_host_data(s->st, "old!", T_ERR));
      break;
    case V_TENSOR:
      s->st = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 64);
      break;
  }
}

static int vsweep_run(void *p, dp_error_t *e) {
  vsweep_t *s = p;
  int64_t shape[2] = {4, 4};
  switch (s->op) {
    case V_BYTES: return dp_bytes_new("\0\1", 2, &s->made, e);
    case V_LIST: return dp_list_new(100, &s->made, e);
    case V_TUPLE: return dp_tuple_new(5, &s->made, e);
    case V_DICT: return dp_dict_new(50, &s->made, e);
    case V_STORAGE: return dp_storage_new(t_dev(DP_DEVICE_HOST, 1), (void *)0x2000, 8, NULL, NULL, &s->st, e);
    case V_APPEND: return dp_list_append(s->c, s->item, e);
    case V_DICT_SET: {
      dp_value_t k = s->key;
      s->key = dp_none();
      return dp_dict_set(s->c, k, s->item, e);
    }
    case V_OBJECT_SET: return dp_object_set(s->c, v_long_name, s->item, e);
    case V_HOST_DATA: return dp_storage_set_host_data(s->st, "new!", e);
    case V_TENSOR: return dp_tensor_new(s->st, DP_FLOAT32, 2, shape, NULL, 0, &s->made, e);
    case V_OBJECT: return dp_object_new(v_long_name, &s->made, e);
    default: return dp_object_new_reduced("Reduced", s->item, &s->made, e);
  }
}

/* The container holds what it held before a failed call (n items, the new
 * one absent), and one more after a successful one; it takes one more. */
static void vsweep_check_container(vsweep_t *s, int rc) {
  size_t n = rc ? 2 : 3;
  dp_value_t v;
  switch (s->op) {
    case V_APPEND:
      cr_assert_eq(dp_seq_len(s->c), n);
      cr_assert_str_eq(dp_str_data(dp_seq_get(s->c, 1), NULL), "item");
      OK(dp_list_append(s->c, dp_int(1), T_ERR));
      cr_assert_eq(dp_seq_len(s->c), n + 1);
      break;
    case V_DICT_SET:
      cr_assert_eq(dp_dict_len(s->c), V_FILL + !rc);
      for (int i = 0; i < V_FILL; i++) OK(dp_dict_get(s->c, dp_int(i), NULL, T_ERR));
      OK(dp_dict_set(s->c, dp_int(100), dp_int(1), T_ERR));
      OK(dp_dict_get(s->c, dp_int(100), NULL, T_ERR));
      break;
    case V_OBJECT_SET:
      cr_assert_eq(dp_object_nattrs(s->c), V_FILL + !rc);
      cr_assert_eq(dp_object_get(s->c, v_long_name, &v, NULL), rc ? DP_ENOTFOUND : 0);
      OK(dp_object_set(s->c, "a0", dp_int(7), T_ERR));
      OK(dp_object_set(s->c, "later", dp_int(1), T_ERR));
      OK(dp_object_get(s->c, "later", NULL, T_ERR));
      break;
    case V_HOST_DATA:
      cr_assert_eq(memcmp(dp_storage_host_data(s->st), rc ? "old!" : "new!", 4), 0);
      break;
  }
}

static void vsweep_check(void *p, int rc, long k) {
  vsweep_t *s = p;
  (void)k;
  vsweep_check_container(s, rc);
  if (rc == 0 && s->op == V_TENSOR) cr_assert_eq(dp_tensor_storage(s->made), s->st);
  if (rc == 0 && s->op == V_REDUCED) cr_assert(dp_object_is_reduced(s->made));
  /* the item, and the storage a tensor is given, were stolen even on failure */
  if (s->op < V_APPEND || s->op == V_HOST_DATA || s->op == V_TENSOR) dp_value_release(s->item);
  dp_value_release(s->key);
  dp_value_release(s->c);
  if (rc == 0) dp_value_release(s->made);
  if (s->op != V_TENSOR) dp_storage_release(s->st);
  ASSERT_NO_LEAK();
}

Test(value, every_other_constructor_and_setter_fails_cleanly_at_every_allocation) {
  static const t_sweep_t sw = {vsweep_prepare, vsweep_run, vsweep_check};
  static const long least[V_COUNT] = {
      [V_BYTES] = 1, [V_LIST] = 1, [V_TUPLE] = 1, [V_DICT] = 1, [V_STORAGE] = 1, [V_OBJECT] = 1, [V_APPEND] = 1,
      [V_DICT_SET] = 2, [V_OBJECT_SET] = 3, [V_HOST_DATA] = 1, [V_TENSOR] = 1, [V_REDUCED] = 1};
  for (int op = 0; op < V_COUNT; op++) {
    vsweep_t s = {.op = op};
    long failed = t_sweep(&sw, &s);
    cr_assert_geq(failed, least[op], "call %d: %ld allocations failed", op, failed);
  }
}

/* ---- equality and hash ---- */

Test(value, equality_is_structural_and_terminates_on_cycles) {
  dp_value_t a = t_list(), b = t_list();
  OK(dp_list_append(a, dp_value_retain(a), T_ERR));
  OK(dp_list_append(b, dp_value_retain(b), T_ERR));
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1);
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 1);
  dp_error_t e;
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING | 8u, &e), DP_EINVAL, "a flag it does not know is refused");
  cr_assert_str_eq(e.message, "dp_value_equal: unknown flags 0x8 (DP_EQ_SHARING is the only one, 0x1)");
  cr_assert_eq(dp_value_hash(a), dp_value_hash(b));
  /* [s, s] and [s, s'] are equal as trees but differ in sharing */
  dp_value_t s = t_str("x");
  dp_value_t x = t_list(), y = t_list();
  OK(dp_list_append(x, dp_value_retain(s), T_ERR));
  OK(dp_list_append(x, dp_value_retain(s), T_ERR));
  OK(dp_list_append(y, s, T_ERR));
  OK(dp_list_append(y, t_str("x"), T_ERR));
  cr_assert_eq(dp_value_equal(x, y, 0, NULL), 1);
  cr_assert_eq(dp_value_equal(x, y, DP_EQ_SHARING, NULL), 0);
  /* the other way round: the second pair (s', s) meets s already matched */
  cr_assert_eq(dp_value_equal(y, x, DP_EQ_SHARING, NULL), 0, "a node matched to two was taken for the same sharing");
  cr_assert_eq(dp_value_hash(x), dp_value_hash(y));
  OK(dp_list_append(y, dp_int(1), T_ERR));
  cr_assert_eq(dp_value_equal(x, y, 0, NULL), 0);
  cr_assert_eq(dp_value_equal(dp_float(1.0), dp_int(1), 0, NULL), 0);
  dp_value_release(a);
  dp_value_release(b);
  dp_value_release(x);
  dp_value_release(y);
  ASSERT_NO_LEAK();
}

/* A tensor of 2 x 2 float32 over 64 bytes at 0x1000 on cuda:0, with one
 * of its descriptors changed by `change` (0: none). */
static dp_value_t eq_tensor(int change) {
  int64_t shape[2] = {2, 2}, strides[2] = {2, 1};
  dp_device_t dev = t_dev(DP_DEVICE_CUDA, change == 2 ? 1 : 0);
  uintptr_t base = change == 1 ? 0x2000 : 0x1000;
  size_t nbytes = change == 3 ? 128 : 64;
  dp_dtype_t dt = change == 4 ? DP_INT32 : DP_FLOAT32;
  if (change == 5) shape[1] = 1;
  if (change == 6) strides[0] = 3;
  if (change == 7) strides[1] = 2, strides[0] = 4, shape[0] = 1;
  dp_value_t t;
  OK(dp_tensor_new(t_storage(dev, base, nbytes), dt, 2, shape, strides, change == 8 ? 2 : 0, &t, T_ERR));
  return t;
}

Test(value, tensors_compare_unequal_when_their_storage_dtype_shape_strides_or_offset_differ) {
  static const char *const what[] = {"", "base", "device", "nbytes", "dtype", "shape", "strides", "shape and strides",
                                     "offset"};
  dp_value_t same[2] = {eq_tensor(0), eq_tensor(0)};
  for (unsigned flags = 0; flags <= DP_EQ_SHARING; flags++) {
    cr_assert_eq(dp_value_equal(same[0], same[1], flags, NULL), 1, "two tensors of one description");
    for (int c = 1; c <= 8; c++) {
      dp_value_t other = eq_tensor(c);
      cr_assert_eq(dp_value_equal(same[0], other, flags, NULL), 0, "tensors of different %s compared equal", what[c]);
      cr_assert_eq(dp_value_equal(other, same[0], flags, NULL), 0, "tensors of different %s compared equal", what[c]);
      dp_value_release(other);
    }
  }
  dp_value_release(same[0]);
  dp_value_release(same[1]);
  ASSERT_NO_LEAK();
}

/* A one-entry dict {key: 1}. */
static dp_value_t dict_of(dp_value_t key) {
  dp_value_t d;
  OK(dp_dict_new(1, &d, T_ERR));
  OK(dp_dict_set(d, key, dp_int(1), T_ERR));
  return d;
}

Test(value, values_of_different_kinds_compare_unequal_whatever_they_hold) {
  dp_value_t list = t_list(), tuple, bytes, obj = t_obj("T");
  OK(dp_list_append(list, dp_int(7), T_ERR));
  OK(dp_tuple_new(1, &tuple, T_ERR));
  OK(dp_seq_set(tuple, 0, dp_int(7), T_ERR));
  OK(dp_bytes_new("x", 1, &bytes, T_ERR));
  dp_value_t str = t_str("x");
  dp_value_t by_str = dict_of(dp_value_retain(str)), by_bytes = dict_of(dp_value_retain(bytes));
  OK(dp_object_set(obj, "x", dp_int(1), T_ERR));
  dp_value_t pairs[][2] = {{list, tuple}, {str, bytes}, {by_str, by_bytes}, {by_str, obj}};
  static const char *const what[] = {"a list and a tuple of one item", "a str and a bytes of one byte",
                                     "dicts keyed by a str and by a bytes", "a dict and an object of one entry"};
  for (unsigned flags = 0; flags <= DP_EQ_SHARING; flags++)
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
      cr_assert_eq(dp_value_equal(pairs[i][0], pairs[i][1], flags, NULL), 0, "%s compared equal", what[i]);
      cr_assert_eq(dp_value_equal(pairs[i][1], pairs[i][0], flags, NULL), 0, "%s compared equal", what[i]);
    }
  dp_value_t all[] = {list, tuple, bytes, obj, str, by_str, by_bytes};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dp_value_release(all[i]);
  ASSERT_NO_LEAK();
}

static const dp_type_t bare_type = {"Bare", NULL, NULL};

Test(value, objects_compare_by_class_and_attributes_and_customs_by_identity) {
  dp_value_t point = t_obj("Point"), again = t_obj("Point");
  OK(dp_object_set(point, "x", dp_int(1), T_ERR));
  OK(dp_object_set(point, "y", dp_int(2), T_ERR));
  OK(dp_object_set(again, "y", dp_int(2), T_ERR));
  OK(dp_object_set(again, "x", dp_int(1), T_ERR));
  dp_value_t only_x = t_obj("Point"), only_z = t_obj("Point"), longer = t_obj("Points"), other = t_obj("Pnint");
  OK(dp_object_set(only_x, "x", dp_int(1), T_ERR));
  OK(dp_object_set(only_z, "z", dp_int(1), T_ERR));
  OK(dp_object_set(longer, "x", dp_int(1), T_ERR));
  OK(dp_object_set(other, "x", dp_int(1), T_ERR));
  /* an object with an attribute named __reduce__ is not the stand-in of a
     reduced custom, which has that one attribute too */
  dp_value_t plain = t_obj("Holder"), reduced;
  OK(dp_object_set(plain, "__reduce__", dp_int(5), T_ERR));
  OK(dp_object_new_reduced("Holder", dp_int(5), &reduced, T_ERR));
  dp_value_t c1, c2;
  OK(dp_custom_new(&bare_type, (void *)1, &c1, T_ERR));
  OK(dp_custom_new(&bare_type, (void *)1, &c2, T_ERR));
  for (unsigned flags = 0; flags <= DP_EQ_SHARING; flags++) {
    cr_assert_eq(dp_value_equal(point, again, flags, NULL), 1, "attributes set in another order");
    cr_assert_eq(dp_value_equal(c1, c1, flags, NULL), 1, "a custom and itself");
    dp_value_t pairs[][2] = {{only_x, point}, {only_x, only_z}, {only_x, longer}, {only_x, other}, {plain, reduced}, {c1, c2}};
    static const char *const what[] = {"an object and one with an attribute more", "objects of different attributes",
                                       "classes Point and Points", "classes Point and Pnint",
                                       "an object and a reduced custom's stand-in", "two customs of one type"};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
      cr_assert_eq(dp_value_equal(pairs[i][0], pairs[i][1], flags, NULL), 0, "%s compared equal", what[i]);
      cr_assert_eq(dp_value_equal(pairs[i][1], pairs[i][0], flags, NULL), 0, "%s compared equal", what[i]);
    }
  }
  dp_value_t all[] = {point, again, only_x, only_z, longer, other, plain, reduced, c1, c2};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dp_value_release(all[i]);
  ASSERT_NO_LEAK();
}

/* A list of 300 zeros, item k 1 (none for k < 0). */
static dp_value_t zeros_but(int k) {
  dp_value_t l;
  OK(dp_list_new(300, &l, T_ERR));
  for (int i = 0; i < 300; i++) OK(dp_list_append(l, dp_int(i == k), T_ERR));
  return l;
}

Test(value, the_hash_reads_the_first_256_nodes_of_a_value_leaves_included) {
  /* the list is node 1, its items 0..254 nodes 2..256 */
  dp_value_t zeros = zeros_but(-1), at254 = zeros_but(254), at255 = zeros_but(255);
  cr_assert_neq(dp_value_hash(zeros), dp_value_hash(at254), "the 256th node was not read");
  cr_assert_eq(dp_value_hash(zeros), dp_value_hash(at255), "the 257th node was read");
  dp_value_release(zeros);
  dp_value_release(at254);
  dp_value_release(at255);
  ASSERT_NO_LEAK();
}

Test(value, the_hash_of_a_value_reads_a_bounded_number_of_nodes_however_they_are_shared) {
  /* 255 references to one 100,000-item list: the hash read every item of
   * each (25 million); now 256 nodes in all, so two such values that differ
   * only past them hash alike (equal values still hash equal, above) */
  enum { ITEMS = 100000, REFS = 255 };
  dp_value_t big[2], v[2];
  for (int k = 0; k < 2; k++) {
    OK(dp_list_new(ITEMS, &big[k], T_ERR));
    for (int i = 0; i < ITEMS; i++) OK(dp_list_append(big[k], dp_int(i == ITEMS - 1 ? k : 0), T_ERR));
    v[k] = t_list();
    for (int i = 0; i < REFS; i++) OK(dp_list_append(v[k], dp_value_retain(big[k]), T_ERR));
  }
  cr_assert_eq(dp_value_equal(v[0], v[1], 0, NULL), 0);
  cr_assert_eq(dp_value_hash(v[0]), dp_value_hash(v[1]), "the hash read past its budget");
  cr_assert_eq(dp_value_hash(big[0]), dp_value_hash(big[1]));
  for (int k = 0; k < 2; k++) {
    dp_value_release(big[k]);
    dp_value_release(v[k]);
  }
  ASSERT_NO_LEAK();
}

/* The hash reads every field equality compares: tensors that differ only
 * in their storage's device or size, their offset, shape, strides or
 * dtype (views of one buffer, one address on two devices) hashed alike,
 * so that a table keyed by them met them all as one chain. */
Test(value, tensors_differing_in_any_field_equality_compares_hash_differently) {
  dp_storage_t *s = t_storage(t_dev(DP_DEVICE_HOST, 0), 0x1000, 64);
  dp_storage_t *s1 = t_storage(t_dev(DP_DEVICE_HOST, 1), 0x1000, 64);   /* another device */
  dp_storage_t *sc = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 64);   /* another type */
  dp_storage_t *s128 = t_storage(t_dev(DP_DEVICE_HOST, 0), 0x1000, 128); /* another size */
  int64_t shape4[1] = {4}, shape2x2[2] = {2, 2}, strides[2] = {1, 2};
  dp_value_t base = t_view(s, 4, 0), same = t_view(s, 4, 0);
  dp_value_t other[7];
  other[0] = t_view(s1, 4, 0);
  other[1] = t_view(sc, 4, 0);
  other[2] = t_view(s128, 4, 0);
  other[3] = t_view(s, 4, 4);
  OK(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 2, shape2x2, NULL, 0, &other[4], T_ERR));
  OK(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 2, shape2x2, strides, 0, &other[5], T_ERR));
  OK(dp_tensor_new(dp_storage_retain(s), DP_INT32, 1, shape4, NULL, 0, &other[6], T_ERR));
  const char *what[7] = {"device index", "device type", "storage size", "offset", "shape", "strides", "dtype"};
  cr_assert_eq(dp_value_equal(base, same, 0, NULL), 1);
  cr_assert_eq(dp_value_hash(base), dp_value_hash(same), "equal tensors hash alike");
  for (int i = 0; i < 7; i++) {
    cr_assert_eq(dp_value_equal(base, other[i], 0, NULL), 0, "%s", what[i]);
    cr_assert_neq(dp_value_hash(base), dp_value_hash(other[i]), "tensors differing only in %s hash alike", what[i]);
    dp_value_release(other[i]);
  }
  dp_value_release(base);
  dp_value_release(same);
  dp_storage_release(s);
  dp_storage_release(s1);
  dp_storage_release(sc);
  dp_storage_release(s128);
  ASSERT_NO_LEAK();
}

/* A reduced custom's stand-in and a plain object of its class holding
 * one attribute "__reduce__" compare unequal, and hashed alike. */
Test(value, a_reduced_stand_in_and_a_plain_object_of_the_same_attributes_hash_differently) {
  dp_value_t plain = t_obj("Holder"), reduced;
  OK(dp_object_set(plain, "__reduce__", dp_int(5), T_ERR));
  OK(dp_object_new_reduced("Holder", dp_int(5), &reduced, T_ERR));
  cr_assert_eq(dp_value_equal(plain, reduced, 0, NULL), 0);
  cr_assert_neq(dp_value_hash(plain), dp_value_hash(reduced), "a stand-in and a plain object hash alike");
  dp_value_release(plain);
  dp_value_release(reduced);
  ASSERT_NO_LEAK();
}

Test(value, dicts_and_objects_compare_regardless_of_order) {
  dp_value_t a, b;
  OK(dp_dict_new(0, &a, T_ERR));
  OK(dp_dict_new(0, &b, T_ERR));
  OK(dp_dict_set(a, t_str("x"), dp_int(1), T_ERR));
  OK(dp_dict_set(a, t_str("y"), dp_int(2), T_ERR));
  OK(dp_dict_set(b, t_str("y"), dp_int(2), T_ERR));
  OK(dp_dict_set(b, t_str("x"), dp_int(1), T_ERR));
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1);
  cr_assert_eq(dp_value_hash(a), dp_value_hash(b));
  OK(dp_dict_set(b, t_str("x"), dp_int(3), T_ERR));
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0);
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

Test(value, error_names_and_messages_come_from_one_table) {
  cr_assert_str_eq(dp_err_name(DP_ETYPE), "DP_ETYPE");
  cr_assert_str_eq(dp_strerror(DP_ENOMEM), "out of memory");
  cr_assert_str_eq(dp_err_name(-999), "DP_UNKNOWN");
  char buf[16];
  dp_device_t d;
  cr_assert_eq(dp_device_parse("cuda:12", &d, NULL), 0);
  cr_assert_str_eq(dp_device_format(d, buf, sizeof buf), "cuda:12");
  cr_assert_eq(dp_device_parse("cuda:256", &d, NULL), DP_EINVAL);
  cr_assert_eq(dp_device_parse("cuda:01", &d, NULL), DP_EINVAL);
  cr_assert_eq(dp_device_parse("tpu:0", &d, NULL), DP_EINVAL);
}

static dp_value_t big_ring(int n) {
  dp_value_t head = t_obj("Node"), cur = head;
  for (int i = 0; i < n; i++) {
    dp_value_t x = t_obj("Node");
    OK(dp_object_set(cur, "next", x, T_ERR));
    cur = x;
  }
  OK(dp_object_set(cur, "next", dp_value_retain(head), T_ERR));
  return head;
}

/* Found by fuzz_roundtrip: a deferred candidate examined again by another
 * trial, then released again, was queued a second time and cut the
 * deferred list, losing the garbage behind it. */
Test(value, a_deferred_candidate_examined_and_released_again_loses_nothing) {
  dp_value_t ring1 = big_ring(300);
  dp_value_release(ring1);                     /* garbage, deferred */
  dp_value_t big = t_list();
  for (int i = 0; i < 300; i++) OK(dp_list_append(big, t_list(), T_ERR));
  dp_value_release(dp_value_retain(big));      /* alive, deferred after ring1 */
  dp_value_t ring2 = big_ring(300);
  dp_value_release(ring2);                     /* garbage, deferred after big */
  dp_value_t holder = t_list();
  OK(dp_list_append(holder, dp_value_retain(big), T_ERR));
  dp_value_release(dp_value_retain(holder));   /* a trial that meets big again */
  dp_value_release(dp_value_retain(big));      /* and big released again */
  dp_value_release(holder);
  dp_value_release(big);
  dp_value_collect();
  ASSERT_NO_LEAK();
}

/* ---- the collector across threads ---- */

/* A container held by two (a future and its caller, say) and let go by both
 * on one thread is freed at the second release: no collection needed. */
Test(value, a_container_let_go_twice_on_one_thread_is_freed_at_once) {
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_obj("Item"), T_ERR));
  dp_value_retain(l);
  dp_value_release(l);  /* 2 -> 1: a candidate */
  dp_value_release(l);  /* 1 -> 0: leaves the candidates, freed */
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "%ld blocks live before any collection",
               (long)atomic_load(&t_live_blocks));
}

/* Releases take no process-wide lock: a custom's destroy, run while a
 * container is freed, may wait for another thread that builds and releases
 * containers. (It used to run under the collector's lock, which that
 * thread's first container release then waited for.) */
typedef struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int started, done, done_in_destroy;
} waiter_t;
static waiter_t w8 = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};

static void *build_and_release(void *p) {
  (void)p;
  pthread_mutex_lock(&w8.mu);
  while (!w8.started) pthread_cond_wait(&w8.cv, &w8.mu);
  pthread_mutex_unlock(&w8.mu);
  for (int i = 0; i < 100; i++) {
    dp_value_t l = t_list();
    dp_list_append(l, t_obj("Item"), NULL);
    dp_value_t extra = dp_value_retain(l);
    dp_value_release(l);
    dp_value_release(extra);
  }
  pthread_mutex_lock(&w8.mu);
  w8.done = 1;
  pthread_cond_broadcast(&w8.cv);
  pthread_mutex_unlock(&w8.mu);
  return NULL;
}

static void destroy_waiting(void *obj) {
  (void)obj;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 10;  /* a deadlock detector, not a timing: the other thread needs microseconds */
  pthread_mutex_lock(&w8.mu);
  w8.started = 1;
  pthread_cond_broadcast(&w8.cv);
  while (!w8.done)
    if (pthread_cond_timedwait(&w8.cv, &w8.mu, &until) != 0) break;
  w8.done_in_destroy = w8.done;
  pthread_mutex_unlock(&w8.mu);
}
static const dp_type_t waiting_type = {"Waiting", NULL, destroy_waiting};

Test(value, a_destroy_callback_may_wait_for_another_thread_that_releases_containers) {
  pthread_t th;
  pthread_create(&th, NULL, build_and_release, NULL);
  dp_value_t c, l = t_list();
  OK(dp_custom_new(&waiting_type, NULL, &c, T_ERR));
  OK(dp_list_append(l, c, T_ERR));
  OK(dp_list_append(l, dp_value_retain(l), T_ERR));  /* a cycle: freed by a collection */
  dp_value_release(l);
  dp_value_collect();  /* frees the cycle; the destroy waits for the other thread */
  pthread_join(th, NULL);
  cr_assert(w8.done_in_destroy, "the other thread's releases waited for this thread's destroy callback");
  ASSERT_NO_LEAK();
}

/* A ring whose nodes are let go by several threads at once: the candidates
 * sit in several buffers, and a trial meets the others' candidates. */
#define RING_THREADS 4
typedef struct ring_arg {
  dp_value_t node;
  pthread_barrier_t *go;
} ring_arg_t;

static void *drop_node(void *p) {
  ring_arg_t *a = p;
  pthread_barrier_wait(a->go);
  dp_value_release(a->node);  /* a candidate in this thread's buffer */
  return NULL;                /* collected as the thread exits */
}

Test(value, a_cycle_released_from_several_threads_at_once_is_freed) {
  for (int round = 0; round < 200; round++) {
    dp_value_t head = big_ring(4 * RING_THREADS), cur = head;
    ring_arg_t args[RING_THREADS];
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, RING_THREADS + 1);
    for (int i = 0; i < RING_THREADS; i++) {
      for (int k = 0; k < 4; k++) OK(dp_object_get(cur, "next", &cur, T_ERR));
      args[i].node = dp_value_retain(cur);
      args[i].go = &go;
    }
    pthread_t th[RING_THREADS];
    for (int i = 0; i < RING_THREADS; i++) pthread_create(&th[i], NULL, drop_node, &args[i]);
    dp_value_release(head);
    pthread_barrier_wait(&go);
    for (int i = 0; i < RING_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&go);
  }
  ASSERT_NO_LEAK();
}

static void *make_cycle_and_exit(void *p) {
  (void)p;
  dp_value_t l = t_list();
  dp_list_append(l, dp_value_retain(l), NULL);
  dp_list_append(l, t_obj("Payload"), NULL);
  dp_value_release(l);  /* the last outside reference: a candidate of this thread */
  return NULL;
}

Test(value, a_cycle_dropped_by_a_thread_that_exits_is_collected_when_it_exits) {
  pthread_t th;
  pthread_create(&th, NULL, make_cycle_and_exit, NULL);
  pthread_join(th, NULL);
  /* No collection on this thread: the exiting thread collected its own. */
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "%ld blocks live", (long)atomic_load(&t_live_blocks));
}

/* The contents of a container buffered as a candidate by another thread are
 * freed when it is released to zero, not when that thread next collects: a
 * value's storages must not wait for an idle thread. */
typedef struct holder_arg {
  dp_value_t v;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int buffered, finish;
} holder_arg_t;

static void *buffer_then_wait(void *p) {
  holder_arg_t *a = p;
  dp_value_release(a->v);  /* 2 -> 1: a candidate of this thread */
  pthread_mutex_lock(&a->mu);
  a->buffered = 1;
  pthread_cond_broadcast(&a->cv);
  while (!a->finish) pthread_cond_wait(&a->cv, &a->mu);
  pthread_mutex_unlock(&a->mu);
  return NULL;  /* collects its buffer as it exits: the header goes then */
}

static int storages_released;
static void count_storage_release(void *ud, dp_device_t d, void *base, size_t n) {
  (void)ud, (void)d, (void)base, (void)n;
  storages_released++;
}

Test(value, a_container_buffered_by_another_thread_frees_its_contents_when_released) {
  storages_released = 0;
  dp_storage_t *st;
  dp_value_t t, l = t_list();
  OK(dp_storage_new(t_dev(DP_DEVICE_CUDA, 0), (void *)0x1000, 64, count_storage_release, NULL, &st, T_ERR));
  int64_t shape[1] = {16};
  OK(dp_tensor_new(st, DP_FLOAT32, 1, shape, NULL, 0, &t, T_ERR));
  OK(dp_list_append(l, t, T_ERR));
  holder_arg_t a = {dp_value_retain(l), PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
  pthread_t th;
  pthread_create(&th, NULL, buffer_then_wait, &a);
  pthread_mutex_lock(&a.mu);
  while (!a.buffered) pthread_cond_wait(&a.cv, &a.mu);
  pthread_mutex_unlock(&a.mu);
  dp_value_release(l);  /* 1 -> 0 while the other thread, alive, buffers it */
  cr_assert_eq(storages_released, 1, "the storage waited for the other thread's collection");
  pthread_mutex_lock(&a.mu);
  a.finish = 1;
  pthread_cond_broadcast(&a.cv);
  pthread_mutex_unlock(&a.mu);
  pthread_join(th, NULL);
  ASSERT_NO_LEAK();
}

/* ---- the collector across threads, step by step ---- */

/* An allocator under which a freed block is never reused: it is zeroed and
 * kept until quarantine_release() checks that nothing wrote to it after it
 * was freed (the collector must not touch a dead container). Zero, not a
 * pattern: a dead container then reads as one that is neither buffered nor
 * garbage, which a stray release acts on (writes to) instead of skipping. */
enum { QUARANTINE_MAX = 4096 };
static struct {
  void *p;
  size_t n;
} quarantine[QUARANTINE_MAX];
static size_t nquarantined;
static pthread_mutex_t quarantine_mu = PTHREAD_MUTEX_INITIALIZER;

static void *quarantining_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  if (nsize || !ptr) return t_alloc(ud, ptr, osize, nsize);
  pthread_mutex_lock(&quarantine_mu);
  int room = nquarantined < QUARANTINE_MAX;
  if (room) {
    memset(ptr, 0, osize);
    quarantine[nquarantined].p = ptr;
    quarantine[nquarantined++].n = osize;
    atomic_fetch_sub(&t_live_blocks, 1);
    atomic_fetch_sub(&t_live_bytes, (long)osize);
  }
  pthread_mutex_unlock(&quarantine_mu);
  return room ? NULL : t_alloc(ud, ptr, osize, 0);
}

/* Frees the kept blocks; returns how many were written to after their free. */
static size_t quarantine_release(void) {
  size_t touched = 0;
  for (size_t i = 0; i < nquarantined; i++) {
    const unsigned char *b = quarantine[i].p;
    for (size_t k = 0; k < quarantine[i].n; k++)
      if (b[k] != 0) {
        touched++;
        break;
      }
    free(quarantine[i].p);
  }
  nquarantined = 0;
  return touched;
}


/* A thread that runs one job at a time when asked, and stays alive (a
 * thread's exit collects its buffer, which would change the scenario). */
typedef struct worker {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  void (*job)(dp_value_t);
  dp_value_t arg;
  int pending, quit;
} worker_t;

static void *worker_main(void *p) {
  worker_t *w = p;
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (!w->pending && !w->quit) pthread_cond_wait(&w->cv, &w->mu);
    if (w->pending) {
      pthread_mutex_unlock(&w->mu);
      w->job(w->arg);
      pthread_mutex_lock(&w->mu);
      w->pending = 0;
      pthread_cond_broadcast(&w->cv);
    } else {
      break;
    }
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

static void worker_start(worker_t *w) {
  memset(w, 0, sizeof *w);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  pthread_create(&w->th, NULL, worker_main, w);
}

/* Runs job(arg) on the worker and waits until it is done. */
static void worker_run(worker_t *w, void (*job)(dp_value_t), dp_value_t arg) {
  pthread_mutex_lock(&w->mu);
  w->job = job;
  w->arg = arg;
  w->pending = 1;
  pthread_cond_broadcast(&w->cv);
  while (w->pending) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
}

static void worker_stop(worker_t *w) {
  pthread_mutex_lock(&w->mu);
  w->quit = 1;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->th, NULL);
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
}

static void job_release(dp_value_t v) { dp_value_release(v); }
static void job_collect(dp_value_t v) { (void)v, dp_value_collect(); }

static worker_t w_owner, w_other;
static dp_value_t w_shared;
static pthread_t w_paused;

/* The release paused on this thread (the container buffered by w_owner):
 * before it takes the collector lock, the owner collects, which lets go of
 * the container; once it has seen that under the lock, w_other releases the
 * container on its lock-free path. */
static void pause_release(int where) {
  if (!pthread_equal(pthread_self(), w_paused)) return;
  if (where == DP_GC_PAUSE_FOREIGN) worker_run(&w_owner, job_collect, w_shared);
  else if (where == DP_GC_PAUSE_OWNER_LET_GO) worker_run(&w_other, job_release, w_shared);
}

Test(value, a_container_let_go_by_its_buffering_thread_is_buffered_by_one_other_thread_only) {
  dp_set_allocator(quarantining_alloc, NULL);
  worker_start(&w_owner);
  worker_start(&w_other);
  w_shared = t_list();
  OK(dp_list_append(w_shared, t_obj("Item"), T_ERR));
  for (int i = 0; i < 3; i++) dp_value_retain(w_shared);  /* held here twice, by w_owner and w_other */
  worker_run(&w_owner, job_release, w_shared);           /* 4 -> 3: w_owner's candidate */
  w_paused = pthread_self();
  dp__gc_pause_hook = pause_release;
  dp_value_release(w_shared);  /* 3 -> 1, with w_other's release in the middle */
  dp__gc_pause_hook = NULL;
  dp_value_release(w_shared);  /* 1 -> 0 */
  /* w_other's buffer holds the container: its collection hands over the
   * header. Had this thread buffered it too, the last release above would
   * have freed it under w_other's buffer, and this would read freed memory. */
  worker_run(&w_other, job_collect, w_shared);
  worker_stop(&w_owner);
  worker_stop(&w_other);
  cr_assert_eq(quarantine_release(), 0, "a freed block was written to");
  ASSERT_NO_LEAK();
}

/* A container buffered by a thread that then idles, released to zero on
 * another thread, is freed there, memory and all: nothing waits for the
 * idle thread's next collection. */
Test(value, a_container_buffered_by_an_idle_thread_is_freed_whole_when_released_to_zero_elsewhere) {
  dp_set_allocator(quarantining_alloc, NULL);  /* and then never touched by that thread's exit trial */
  worker_start(&w_owner);
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_obj("Item"), T_ERR));
  worker_run(&w_owner, job_release, dp_value_retain(l));  /* 2 -> 1: w_owner's candidate */
  dp_value_release(l);                                    /* 1 -> 0 here; w_owner idles */
  long live = atomic_load(&t_live_blocks);
  worker_stop(&w_owner);
  cr_assert_eq(live, 0, "%ld blocks waited for the thread that buffered the container", live);
  cr_assert_eq(quarantine_release(), 0, "a freed block was written to");
  ASSERT_NO_LEAK();
}

/* A trial empties its buffer but leaves the entries where they were: a
 * container tried from slot 0 here, then buffered by another thread at its
 * own slot 0, names slot 0 in its state while this buffer's slot 0 still
 * points at it. Released to zero here, it is another thread's candidate:
 * it leaves that buffer, and this one (empty) is not touched. */
Test(value, a_container_tried_here_then_buffered_elsewhere_is_released_as_the_other_threads_candidate) {
  worker_start(&w_owner);
  dp_value_collect();  /* this thread's buffer empty: its next candidate takes slot 0 */
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_obj("Item"), T_ERR));
  dp_value_retain(l);
  dp_value_retain(l);
  dp_value_release(l);  /* 3 -> 2: this thread's candidate, slot 0 */
  dp_value_collect();   /* live: it leaves the buffer, its entry stays behind */
  worker_run(&w_owner, job_release, l);  /* 2 -> 1: w_owner's candidate, slot 0 of its buffer */
  dp_value_release(l);                   /* 1 -> 0 here */
  long live = atomic_load(&t_live_blocks);
  dp__gc_items_walked = 0;
  dp_value_t again = t_list();
  OK(dp_list_append(again, dp_value_retain(again), T_ERR));
  dp_value_release(again);  /* a cycle buffered here: this buffer still works */
  dp_value_collect();
  uint64_t walked = dp__gc_items_walked;
  worker_run(&w_owner, job_collect, dp_none());  /* its buffer no longer holds l */
  worker_stop(&w_owner);
  cr_assert_eq(live, 0, "%ld blocks live after the last release", live);
  cr_assert_eq(walked, 1, "this thread's next trial walked %llu items: the cycle's one",
               (unsigned long long)walked);
  ASSERT_NO_LEAK();
}

/* A thread's buffer holds 256 candidates before its first trial: the
 * 257th release tries the 256 before it (each a list holding itself: one
 * item walked each). */
static void *release_257_cycles(void *p) {
  uint64_t *walked = p;
  dp_value_t l[257];
  for (int i = 0; i < 257; i++) {
    l[i] = t_list();
    dp_list_append(l[i], dp_value_retain(l[i]), NULL);
  }
  dp__gc_items_walked = 0;
  for (int i = 0; i < 256; i++) dp_value_release(l[i]);
  walked[0] = dp__gc_items_walked;
  dp_value_release(l[256]);
  walked[1] = dp__gc_items_walked;
  return NULL;  /* its exit tries the last one */
}

Test(value, a_threads_first_trial_comes_with_its_257th_candidate_not_before) {
  uint64_t walked[2] = {99, 99};
  pthread_t th;
  pthread_create(&th, NULL, release_257_cycles, walked);
  pthread_join(th, NULL);
  cr_assert_eq(walked[0], 0, "256 candidates were tried before the buffer was full (%llu items walked)",
               (unsigned long long)walked[0]);
  cr_assert_eq(walked[1], 256, "the 257th release tried %llu items, not the 256 buffered before it",
               (unsigned long long)walked[1]);
  ASSERT_NO_LEAK();
}

/* value.h, CYCLES and COST: after a trial that walked more live items than
 * 256, a buffer doubles until it holds as many, and is tried when a release
 * finds it full. A live list of 5,000 empty lists is some 10,000 items
 * walked: the next trial comes with the 16,385th candidate (16,384 >=
 * 10,000 > 8,192), not the 10,001st. */
static void *release_cycles_after_a_large_live_trial(void *p) {
  uint64_t *walked = p;
  dp_value_t big = t_list();
  for (int i = 0; i < 5000; i++) OK(dp_list_append(big, t_list(), T_ERR));
  dp_value_release(dp_value_retain(big));  /* big: a candidate, live */
  dp__gc_items_walked = 0;
  dp_value_collect();
  walked[0] = dp__gc_items_walked;
  enum { N = 16385 };
  dp_value_t *l = malloc(N * sizeof *l);
  for (int i = 0; i < N; i++) {
    l[i] = t_list();
    OK(dp_list_append(l[i], dp_value_retain(l[i]), T_ERR));
  }
  dp__gc_items_walked = 0;
  for (int i = 0; i < N - 1; i++) dp_value_release(l[i]);
  walked[1] = dp__gc_items_walked;
  dp_value_release(l[N - 1]);
  walked[2] = dp__gc_items_walked;
  free(l);
  dp_value_release(big);
  return NULL;
}

Test(value, after_a_trial_that_walked_many_live_items_a_buffer_doubles_until_it_holds_as_many) {
  uint64_t walked[3] = {0, 99, 99};
  pthread_t th;
  pthread_create(&th, NULL, release_cycles_after_a_large_live_trial, walked);
  pthread_join(th, NULL);
  cr_assert(walked[0] > 8192 && walked[0] <= 16384, "the live trial walked %llu items",
            (unsigned long long)walked[0]);
  cr_assert_eq(walked[1], 0, "a trial came before the buffer of 16,384 was full (%llu items walked)",
               (unsigned long long)walked[1]);
  cr_assert_eq(walked[2], 16384, "the 16,385th release tried %llu items, not the 16,384 buffered before it",
               (unsigned long long)walked[2]);
  ASSERT_NO_LEAK();
}

/* What a trial walks from a live container is what that container holds
 * now: a list found live by one trial, beside a cycle it then held, does not
 * keep that cycle alive in the next trial once the two are apart. */
Test(value, a_container_found_live_by_one_trial_keeps_alive_only_what_it_holds_in_the_next) {
  dp_value_collect();
  destroyed = 0;
  dp_value_t a = t_list(), b = t_list(), c = t_list(), k;
  OK(dp_custom_new(&counted_type, NULL, &k, T_ERR));
  OK(dp_list_append(b, k, T_ERR));
  OK(dp_list_append(b, dp_value_retain(b), T_ERR));  /* b holds itself */
  OK(dp_list_append(a, b, T_ERR));
  OK(dp_list_append(a, dp_value_retain(c), T_ERR));  /* c: held by a and here */
  dp_value_retain(a);
  dp_value_release(a);  /* a candidate, held from here */
  dp_value_collect();   /* a, b and c are live */
  cr_assert_eq(destroyed, 0);
  dp_value_release(a);  /* freed: b (held by itself only) and c (held here) become candidates */
  dp_value_collect();
  cr_assert_eq(destroyed, 1, "the cycle a let go of was kept alive by c, found live beside it before");
  cr_assert_eq(dp_value_refcount(c), 1);
  dp_value_release(c);
  ASSERT_NO_LEAK();
}

/* A container held once is freed by its release on the spot, without
 * becoming a candidate: a full buffer is not tried for it. */
static void *fill_buffer_then_release_a_sole_holder(void *p) {
  uint64_t *walked = p;
  dp_value_t l[256], sole = t_list(), c;
  for (int i = 0; i < 256; i++) {
    l[i] = t_list();
    dp_list_append(l[i], dp_value_retain(l[i]), NULL);
  }
  dp_custom_new(&counted_type, NULL, &c, NULL);
  dp_list_append(sole, c, NULL);
  dp__gc_items_walked = 0;
  for (int i = 0; i < 256; i++) dp_value_release(l[i]);
  dp_value_release(sole);
  walked[0] = dp__gc_items_walked;
  walked[1] = (uint64_t)destroyed;
  return NULL;  /* its exit tries the 256 */
}

Test(value, releasing_the_only_reference_to_a_container_frees_it_without_trying_a_full_buffer) {
  uint64_t walked[2] = {99, 99};
  destroyed = 0;
  pthread_t th;
  pthread_create(&th, NULL, fill_buffer_then_release_a_sole_holder, walked);
  pthread_join(th, NULL);
  cr_assert_eq(walked[1], 1, "the list held once was not freed by its release (its custom destroyed %llu times)",
               (unsigned long long)walked[1]);
  cr_assert_eq(walked[0], 0, "releasing a list held once tried the full buffer (%llu items walked)",
               (unsigned long long)walked[0]);
  ASSERT_NO_LEAK();
}

/* ---- one error discipline (base.h, ERRORS AND NULL) ---- */

Test(value, null_handles_and_other_kinds_follow_the_one_rule) {
  dp_error_t e;
  /* accessors: a neutral value, no crash */
  cr_assert(dp_device_equal(dp_storage_device(NULL), t_dev(DP_DEVICE_CPU, 0)));
  cr_assert_null(dp_storage_base(NULL));
  cr_assert_eq(dp_storage_nbytes(NULL), 0);
  cr_assert_null(dp_storage_host_data(NULL));
  cr_assert_null(dp_device_format(t_dev(DP_DEVICE_CUDA, 1), NULL, 16));
  /* fallible calls: DP_EINVAL naming the function and the argument */
  cr_assert_eq(dp_dtype_parse(NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dtype_parse: NULL name");
  dp_device_t d;
  cr_assert_eq(dp_device_parse("cuda:", &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: 'cuda:' is not a device (cpu, cuda:N or host:N, N 0..255)");
  cr_assert_eq(dp_device_parse("cpu", NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: NULL out");
  dp_dtype_t dt;
  cr_assert_eq(dp_dtype_parse("float8", &dt, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dtype_parse: unknown dtype 'float8'");
  /* what the caller gave, escaped and cut with an ellipsis, never silently */
  cr_assert_eq(dp_device_parse("cuda:0\n<object object at 0x7f0000000000>", &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: 'cuda:0\\u000a<object object at 0x7f000\xe2\x80\xa6' is not a device "
                              "(cpu, cuda:N or host:N, N 0..255)");
  cr_assert_eq(dp_dtype_parse("it's", &dt, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dtype_parse: unknown dtype 'it\\'s'");
  /* by the rule for names: C1 controls (U+009B is CSI to a terminal), line separators, stray bytes */
  cr_assert_eq(dp_device_parse("cuda:\xc2\x9b" "0\xe2\x80\xa8\xff", &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: 'cuda:\\u009b0\\u2028\\ufffd' is not a device (cpu, cuda:N or host:N, N 0..255)");
  /* stray bytes past the cut are no character to move back to: the cut
     stays at 32 bytes (it moved back over all of them, showing nothing) */
  cr_assert_eq(dp_device_parse("cuda:\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"
                               "\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80", &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: 'cuda:\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd"
                              "\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd"
                              "\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd\xe2\x80\xa6' is not a device (cpu, cuda:N or "
                              "host:N, N 0..255)");
  /* a character the cut splits is still left out whole: an e-acute at bytes 31-32 */
  cr_assert_eq(dp_device_parse("cuda:aaaaaaaaaaaaaaaaaaaaaaaaaa\xc3\xa9" "bb", &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: 'cuda:aaaaaaaaaaaaaaaaaaaaaaaaaa\xe2\x80\xa6' is not a device (cpu, cuda:N or host:N, N 0..255)");
  /* a value of another kind is misuse (DP_EINVAL), not a miss */
  dp_value_t v;
  cr_assert_eq(dp_dict_get(dp_int(1), dp_int(1), &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dict_get: expected dict, got int");
  cr_assert_eq(dp_object_get(dp_none(), "x", &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_get: expected object, got none");
  ASSERT_NO_LEAK();
}

Test(value, lookups_and_items_report_through_err) {
  dp_value_t d, o, v, k;
  dp_error_t e;
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_dict_set(d, t_str("a"), dp_int(1), T_ERR));
  cr_assert_eq(dp_dict_get(d, dp_int(7), &v, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_dict_get: no such key");
  cr_assert_eq(e.code, DP_ENOTFOUND);
  cr_assert_eq(dp_dict_item(d, 3, &k, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dict_item: index 3 out of range (length 1)");
  o = t_obj("M");
  cr_assert_eq(dp_object_get(o, "w", &v, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_object_get: no attribute 'w'");
  cr_assert_eq(dp_object_attr(o, 0, NULL, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_attr: index 0 out of range (0 attributes)");
  dp_value_release(d);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

/* The attribute name a miss or a stand-in's refusal quotes is any C string
 * the caller gave: shown as every message shows one (dp_device_parse's,
 * dp_dtype_parse's): whole UTF-8 characters of its first 32 bytes, escaped,
 * "…" when cut — never a byte cut that leaves the message invalid UTF-8. */
Test(value, an_attribute_name_quoted_in_an_error_is_cut_at_a_character_and_escaped) {
  dp_value_t o, v;
  dp_error_t e;
  o = t_obj("M");
  /* 30 euro signs (3 bytes each): the old 64-byte cut split the 22nd */
  char euros[30 * 3 + 1] = "";
  for (int i = 0; i < 30; i++) strcat(euros, "\xe2\x82\xac");
  cr_assert_eq(dp_object_get(o, euros, &v, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_object_get: no attribute '\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac"
                              "\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x80\xa6'");
  cr_assert_eq(e.code, DP_ENOTFOUND);
  /* a name dp_object_get need not validate: stray bytes, controls, quotes */
  cr_assert_eq(dp_object_get(o, "a\xff\n'b", &v, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_object_get: no attribute 'a\\ufffd\\u000a\\'b'");
  dp_value_release(o);
  OK(dp_object_new_reduced("T", dp_int(5), &o, T_ERR));
  cr_assert_eq(dp_object_set(o, euros, dp_int(7), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_set: a reduced stand-in has one attribute, \"__reduce__\" (its state), not "
                              "'\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac"
                              "\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x80\xa6'");
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

/* value.h: the out-pointers of lookups are optional (a membership test, an
 * item's key alone), as base.h lets a header document them. */
Test(value, the_out_pointers_of_lookups_may_be_null) {
  dp_value_t d, o, k;
  dp_error_t e;
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_dict_set(d, t_str("a"), dp_int(1), T_ERR));
  dp_value_t a = t_str("a");
  OK(dp_dict_get(d, a, NULL, T_ERR));
  dp_value_release(a);
  cr_assert_eq(dp_dict_get(d, dp_int(2), NULL, &e), DP_ENOTFOUND);
  OK(dp_dict_item(d, 0, &k, NULL, T_ERR));
  cr_assert_str_eq(dp_str_data(k, NULL), "a");
  OK(dp_dict_item(d, 0, NULL, NULL, T_ERR));
  o = t_obj("M");
  OK(dp_object_set(o, "w", dp_int(3), T_ERR));
  OK(dp_object_get(o, "w", NULL, T_ERR));
  const char *name = NULL;
  OK(dp_object_attr(o, 0, &name, NULL, T_ERR));
  cr_assert_str_eq(name, "w");
  cr_assert_eq(dp_object_get(o, NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_get: NULL name");
  dp_value_release(d);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

static dp_value_t t_dict(void) {
  dp_value_t d;
  OK(dp_dict_new(0, &d, T_ERR));
  return d;
}

static dp_value_t t_tuple7(void) {
  dp_value_t t;
  OK(dp_tuple_new(1, &t, T_ERR));
  OK(dp_seq_set(t, 0, dp_int(7), T_ERR));
  return t;
}

Test(value, dicts_equal_in_any_insertion_order_compare_equal_with_sharing_too) {
  /* a = {"x": k, k: 1, "y": 2}, b the same inserted in another order, k a
     tuple key also used as a value (shared in both) */
  dp_value_t ta = t_tuple7(), tb = t_tuple7(), a = t_dict(), b = t_dict();
  OK(dp_dict_set(a, t_str("x"), dp_value_retain(ta), T_ERR));
  OK(dp_dict_set(a, dp_value_retain(ta), dp_int(1), T_ERR));
  OK(dp_dict_set(a, t_str("y"), dp_int(2), T_ERR));
  OK(dp_dict_set(b, t_str("y"), dp_int(2), T_ERR));
  OK(dp_dict_set(b, dp_value_retain(tb), dp_int(1), T_ERR));
  OK(dp_dict_set(b, t_str("x"), dp_value_retain(tb), T_ERR));
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1);
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 1, "insertion order counted under DP_EQ_SHARING");
  /* the same tree, the key no longer the value's node */
  dp_value_t tc = t_tuple7(), c = t_dict();
  OK(dp_dict_set(c, t_str("y"), dp_int(2), T_ERR));
  OK(dp_dict_set(c, dp_value_retain(tb), dp_int(1), T_ERR));
  OK(dp_dict_set(c, t_str("x"), dp_value_retain(tc), T_ERR));
  cr_assert_eq(dp_value_equal(a, c, 0, NULL), 1);
  cr_assert_eq(dp_value_equal(a, c, DP_EQ_SHARING, NULL), 0, "a key shared with a value in one dict only");
  dp_value_t vals[] = {ta, tb, tc, a, b, c};
  for (size_t i = 0; i < sizeof vals / sizeof *vals; i++) dp_value_release(vals[i]);
  ASSERT_NO_LEAK();
}

/* One side of the key-sharing comparisons below: `dicts` dicts keyed by one
 * shared str, and as many keyed by (i, that str), all in one list. */
static dp_value_t dicts_over_one_key(size_t strlen_, int dicts) {
  char *text = malloc(strlen_);
  memset(text, 'k', strlen_);
  dp_value_t s, list = t_list();
  OK(dp_str_new(text, strlen_, &s, T_ERR));
  free(text);
  for (int i = 0; i < dicts; i++) {
    dp_value_t d = t_dict(), k;
    OK(dp_dict_set(d, dp_value_retain(s), dp_int(i), T_ERR));
    OK(dp_list_append(list, d, T_ERR));
    OK(dp_tuple_new(2, &k, T_ERR));
    OK(dp_seq_set(k, 0, dp_int(i), T_ERR));
    OK(dp_seq_set(k, 1, dp_value_retain(s), T_ERR));
    d = t_dict();
    OK(dp_dict_set(d, k, dp_int(i), T_ERR));
    OK(dp_list_append(list, d, T_ERR));
  }
  dp_value_release(s);
  return list;
}

Test(value, a_dict_key_shared_by_many_dicts_is_compared_once_by_equality) {
  /* Two equal values built apart, each 200 dicts keyed by its own 100 kB
   * str and 200 keyed by (i, that str): matching each dict's entry compared
   * the two strs in full, 40 MB for 200 kB of values (quadratic); now the
   * pair, once found equal, is remembered. */
  enum { LEN = 100000, DICTS = 200 };
  dp_value_t a = dicts_over_one_key(LEN, DICTS), b = dicts_over_one_key(LEN, DICTS);
  unsigned flags[] = {0, DP_EQ_SHARING};
  for (int f = 0; f < 2; f++) {
    dp__key_bytes_compared = 0;
    cr_assert_eq(dp_value_equal(a, b, flags[f], NULL), 1);
    cr_assert_leq(dp__key_bytes_compared, 2 * LEN, "flags %u: %llu key bytes compared", flags[f],
                  (unsigned long long)dp__key_bytes_compared);
    cr_assert_geq(dp__key_bytes_compared, LEN, "flags %u: the two keys are compared in full once (%llu bytes)",
                  flags[f], (unsigned long long)dp__key_bytes_compared);
  }
  /* and a str that differs is still told apart */
  dp_value_t c = dicts_over_one_key(LEN - 1, DICTS);
  cr_assert_eq(dp_value_equal(a, c, 0, NULL), 0);
  dp_value_release(a);
  dp_value_release(b);
  dp_value_release(c);
  ASSERT_NO_LEAK();
}

Test(value, an_equality_that_runs_out_of_memory_remembering_equal_keys_says_so) {
  dp_value_t a = dicts_over_one_key(100, 20), b = dicts_over_one_key(100, 20);
  int keys_failed = 0;
  for (long k = 1; k < 50; k++) {
    dp_error_t e;
    dp_error_clear(&e);
    t_fail_at = t_alloc_count + k;
    int rc = dp_value_equal(a, b, 0, &e);
    t_fail_at = 0;
    if (rc == 1) break;
    cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %d", k, rc);
    keys_failed += strcmp(e.message, "out of memory comparing values (the comparison's pairs of equal dict keys)") == 0;
  }
  cr_assert_gt(keys_failed, 0, "no failure in remembering a pair of keys");
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

static dp_value_t t_pair(dp_value_t x, dp_value_t y) {
  dp_value_t t;
  OK(dp_tuple_new(2, &t, T_ERR));
  OK(dp_seq_set(t, 0, x, T_ERR));
  OK(dp_seq_set(t, 1, y, T_ERR));
  return t;
}

Test(value, a_tuple_keeps_its_key_hash_only_once_it_is_in_a_dict_and_drops_it_when_set) {
  dp_value_t d = t_dict(), v, list = t_list();
  /* a tuple inside a key refused (it holds a list) may still change: the
   * refusal left nothing behind that the changed key would be hashed by */
  dp_value_t inner = t_pair(dp_int(1), dp_int(2));
  dp_value_t outer = t_pair(dp_value_retain(inner), dp_value_retain(list));
  cr_assert_eq(dp_dict_set(d, dp_value_retain(outer), dp_int(7), NULL), DP_ETYPE);
  OK(dp_seq_set(outer, 1, dp_int(3), T_ERR));
  OK(dp_seq_set(inner, 0, dp_int(5), T_ERR));
  OK(dp_dict_set(d, dp_value_retain(outer), dp_int(7), T_ERR));
  dp_value_t probe = t_pair(t_pair(dp_int(5), dp_int(2)), dp_int(3));
  OK(dp_dict_get(d, probe, &v, T_ERR));
  cr_assert_eq(dp_value_as_int(v), 7);
  /* a tuple used for lookups only may change, and is then looked up anew */
  OK(dp_seq_set(probe, 1, dp_int(4), T_ERR));
  cr_assert_eq(dp_dict_get(d, probe, &v, NULL), DP_ENOTFOUND);
  OK(dp_seq_set(probe, 1, dp_int(3), T_ERR));
  OK(dp_dict_get(d, probe, &v, T_ERR));
  /* a key's tuple set again (value.h forbids it for a tuple in a key) is
   * hashed anew: its own key word does not outlive the change */
  OK(dp_seq_set(inner, 1, dp_int(6), T_ERR));
  dp_value_t d2 = t_dict();
  OK(dp_dict_set(d2, dp_value_retain(inner), dp_int(8), T_ERR));
  dp_value_t p2 = t_pair(dp_int(5), dp_int(6));
  OK(dp_dict_get(d2, p2, &v, T_ERR));
  cr_assert_eq(dp_value_as_int(v), 8);
  dp_value_t vals[] = {d, list, inner, outer, probe, d2, p2};
  for (size_t i = 0; i < sizeof vals / sizeof *vals; i++) dp_value_release(vals[i]);
  ASSERT_NO_LEAK();
}

/* value.h: a key's 1,024 nodes are counted as a tree: a tuple the key
 * holds twice counts twice, though it is one node (602 distinct nodes,
 * 1,203 counted, refused; 512 distinct, 1,023 counted, hashable). */
Test(value, a_tuple_held_twice_in_a_key_counts_twice_against_its_1024_nodes) {
  dp_value_t big, small, d = t_dict();
  OK(dp_tuple_new(600, &big, T_ERR));
  OK(dp_tuple_new(510, &small, T_ERR));
  dp_value_t twice_big = t_pair(dp_value_retain(big), dp_value_retain(big));
  dp_value_t twice_small = t_pair(dp_value_retain(small), dp_value_retain(small));
  cr_assert(!dp_value_is_hashable(twice_big), "1 + 2 x 601 = 1,203 nodes counted as a tree");
  cr_assert(dp_value_is_hashable(twice_small), "1 + 2 x 511 = 1,023 nodes");
  dp_error_t e;
  cr_assert_eq(dp_dict_set(d, dp_value_retain(twice_big), dp_none(), &e), DP_ETYPE);
  cr_assert_str_eq(e.message, "dict key of kind tuple is not hashable (a tuple key holds only scalars, str, bytes "
                              "and tuples, at most 1024 of them, 32 levels deep)");
  OK(dp_dict_set(d, dp_value_retain(twice_small), dp_none(), T_ERR));
  dp_value_t vals[] = {big, small, d, twice_big, twice_small};
  for (size_t i = 0; i < sizeof vals / sizeof *vals; i++) dp_value_release(vals[i]);
  ASSERT_NO_LEAK();
}

Test(value, a_kept_key_hash_still_counts_its_tree_against_the_key_bounds) {
  /* a 1,000-node tuple and a 32-level chain, both keys already: a key that
   * holds one is bounded by its whole tree, as when nothing was kept */
  dp_value_t big, chain = dp_int(0), d = t_dict();
  OK(dp_tuple_new(999, &big, T_ERR));
  for (int i = 0; i < 999; i++) OK(dp_seq_set(big, (size_t)i, dp_int(i), T_ERR));
  for (int i = 0; i < 32; i++) {
    dp_value_t t;
    OK(dp_tuple_new(1, &t, T_ERR));
    OK(dp_seq_set(t, 0, chain, T_ERR));
    chain = t;
  }
  OK(dp_dict_set(d, dp_value_retain(big), dp_int(1), T_ERR));
  OK(dp_dict_set(d, dp_value_retain(chain), dp_int(2), T_ERR));
  cr_assert(dp_value_is_hashable(big) && dp_value_is_hashable(chain));
  dp_value_t t24;  /* itself, big's 1,000 and 24 nones: one node too many */
  OK(dp_tuple_new(25, &t24, T_ERR));
  OK(dp_seq_set(t24, 0, dp_value_retain(big), T_ERR));
  cr_assert(!dp_value_is_hashable(t24));
  dp_value_t t23;  /* 1 + 1,000 + 23 = 1,024 nodes: hashable */
  OK(dp_tuple_new(24, &t23, T_ERR));
  OK(dp_seq_set(t23, 0, dp_value_retain(big), T_ERR));
  cr_assert(dp_value_is_hashable(t23));
  dp_value_t deeper = t_pair(dp_value_retain(chain), dp_int(1));  /* the int 0 is now 33 levels down */
  cr_assert(!dp_value_is_hashable(deeper));
  cr_assert_eq(dp_dict_set(d, dp_value_retain(deeper), dp_none(), NULL), DP_ETYPE);
  dp_value_t vals[] = {big, chain, d, t24, t23, deeper};
  for (size_t i = 0; i < sizeof vals / sizeof *vals; i++) dp_value_release(vals[i]);
  ASSERT_NO_LEAK();
}

/* dp_value_equal(a, b, flags) with its k-th allocation failing, k = 1, 2,
 * ... (below `most`) until it succeeds (equal values): each failure is
 * DP_ENOMEM saying what it ran out of memory for (`what`); at least one. */
static void equal_fails_cleanly_until_it_succeeds(dp_value_t a, dp_value_t b, unsigned flags, long most,
                                                  const char *what) {
  char want[160];
  snprintf(want, sizeof want, "out of memory comparing values (%s)", what);
  int failed = 0, rc = 0;
  for (long k = 1; k < most && rc != 1; k++) {
    dp_error_t e;
    dp_error_clear(&e);
    t_fail_at = t_alloc_count + k;
    rc = dp_value_equal(a, b, flags, &e);
    t_fail_at = 0;
    if (rc == 1) break;
    failed++;
    cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %d", k, rc);
    cr_assert_eq(e.code, DP_ENOMEM);
    cr_assert_str_eq(e.message, want);
  }
  cr_assert_eq(rc, 1, "equal once no allocation fails");
  cr_assert_gt(failed, 0);
}

Test(value, an_equality_that_runs_out_of_memory_says_so_through_err) {
  dp_value_t a = t_list(), b = t_list(), s = t_list();
  for (int i = 0; i < 40; i++) {
    OK(dp_list_append(a, dp_value_retain(s), T_ERR));
    OK(dp_list_append(b, dp_value_retain(s), T_ERR));
  }
  equal_fails_cleanly_until_it_succeeds(a, b, DP_EQ_SHARING, 50, "the comparison's node bijection");
  dp_value_release(a);
  dp_value_release(b);
  dp_value_release(s);
  ASSERT_NO_LEAK();
}

Test(value, an_insert_without_replace_reports_a_duplicate_outside_the_public_codes) {
  /* The reader inserts without replace: a duplicate comes back as an
   * internal positive result, which no DP_E* code can be mistaken for
   * (it was DP_EINVAL, the code of any misuse). */
  dp_value_t d, o;
  dp_error_t e;
  dp_error_clear(&e);
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp__dict_set_checked(d, t_str("k"), dp_int(1), 0, &e));
  int rc = dp__dict_set_checked(d, t_str("k"), dp_int(2), 0, &e);
  cr_assert_eq(rc, DP__EXISTS, "%d", rc);
  cr_assert_gt(rc, 0, "not in the public code space");
  cr_assert_eq(e.code, 0, "not an error: err is untouched");
  o = t_obj("M");
  OK(dp__object_set_n(o, "x", 1, dp_int(1), 0, &e));
  cr_assert_eq(dp__object_set_n(o, "x", 1, dp_int(2), 0, &e), DP__EXISTS);
  cr_assert_eq(dp__dict_set_checked(dp_int(0), dp_int(1), dp_int(2), 0, &e), DP_EINVAL, "misuse stays DP_EINVAL");
  dp_value_release(d);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

/* A NULL argument is named in the message, as base.h's rule says. */
Test(value, a_null_argument_is_named_in_the_message) {
  dp_error_t e;
  dp_value_t v;
  cr_assert_eq(dp_str_new("ab", 2, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_str_new: NULL out");
  cr_assert_eq(dp_str_new(NULL, 2, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_str_new: NULL s");
  cr_assert_eq(dp_bytes_new(NULL, 1, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_bytes_new: NULL p");
  cr_assert_eq(dp_object_new(NULL, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_new: NULL class_name");
  int64_t shape[1] = {4};
  cr_assert_eq(dp_tensor_new(NULL, DP_FLOAT32, 1, shape, NULL, 0, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_tensor_new: NULL storage");
  cr_assert_eq(dp_object_new_reduced(NULL, dp_none(), &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_new_reduced: NULL type_name");
  /* a custom's three required pointers, each by its name (they were named
     all at once: "type, type->name and out are required") */
  static const dp_type_t unnamed = {NULL, reduce_to_none, NULL}, named = {"Named", reduce_to_none, NULL};
  cr_assert_eq(dp_custom_new(NULL, NULL, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL type");
  cr_assert_eq(dp_custom_new(&unnamed, NULL, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL type->name");
  cr_assert_eq(dp_custom_new(&named, NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL out");
  cr_assert_eq(dp_list_new(0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_list_new: NULL out");
  cr_assert_eq(dp_tuple_new(1, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_tuple_new: NULL out");
  cr_assert_eq(dp_dict_new(0, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dict_new: NULL out");
  cr_assert_eq(dp_storage_new(t_dev(DP_DEVICE_CPU, 0), NULL, 0, NULL, NULL, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_storage_new: NULL out");
  cr_assert_eq(dp_tensor_new(t_storage(t_dev(DP_DEVICE_CPU, 0), 0x10, 16), DP_FLOAT32, 1, NULL, NULL, 0, &v, &e),
               DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_tensor_new: NULL shape");
  ASSERT_NO_LEAK();
}

Test(value, a_bad_reduce_type_name_is_named_as_a_reduce_type_not_an_object_class) {
  dp_value_t o;
  dp_error_t e;
  cr_assert_eq(dp_object_new_reduced("", dp_int(1), &o, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "reduce type name must be non-empty UTF-8 without NUL");
  cr_assert_eq(dp_object_new("", &o, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "object class name must be non-empty UTF-8 without NUL");
  ASSERT_NO_LEAK();
}

/* A type without a destroy callback leaves the library only the custom's
 * own header to free: at once when its count reaches zero, whether the
 * last reference was the caller's, a container's freed with a cycle, or
 * one a destroy callback let go of while it ran. */
static const dp_type_t plain_type = {"Plain", NULL, NULL};

Test(value, a_custom_without_a_destroy_callback_is_freed_when_its_last_reference_goes) {
  static int obj;
  dp_value_t c;
  OK(dp_custom_new(&plain_type, &obj, &c, T_ERR));
  cr_assert_eq(dp_custom_data(c), &obj);
  dp_value_release(c);
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "%ld blocks live after the only reference went",
               (long)atomic_load(&t_live_blocks));
  dp_value_t l = t_list();
  OK(dp_custom_new(&plain_type, &obj, &c, T_ERR));
  OK(dp_list_append(l, c, T_ERR));
  OK(dp_list_append(l, dp_value_retain(l), T_ERR));
  dp_value_release(l);
  dp_value_collect();
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "%ld blocks live after its cycle was collected",
               (long)atomic_load(&t_live_blocks));
  dp_value_t *box = malloc(sizeof *box), h;
  OK(dp_custom_new(&plain_type, &obj, box, T_ERR));
  OK(dp_custom_new(&holder_type, box, &h, T_ERR));
  dp_value_release(h);
  ASSERT_NO_LEAK();
}

/* ---- edges a mutation run of value.c found unchecked ---- */

Test(value, a_kind_past_the_last_is_named_invalid) {
  cr_assert_str_eq(dp_kind_name(DP_CUSTOM), "custom");
  cr_assert_str_eq(dp_kind_name((dp_kind_t)DP_KIND_COUNT), "invalid");
  cr_assert_str_eq(dp_kind_name((dp_kind_t)-1), "invalid");
}

/* value.h: the text may be NULL only when its length is 0. */
Test(value, str_and_bytes_take_a_null_pointer_only_with_a_length_of_zero) {
  dp_value_t s, b;
  dp_error_t e;
  OK_WITH(&e, dp_str_new(NULL, 0, &s, &e));
  size_t n = 99;
  cr_assert_str_eq(dp_str_data(s, &n), "");
  cr_assert_eq(n, 0);
  OK_WITH(&e, dp_bytes_new(NULL, 0, &b, &e));
  cr_assert_not_null(dp_bytes_data(b, &n));
  cr_assert_eq(n, 0);
  cr_assert_eq(dp_str_new(NULL, 1, &s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_str_new: NULL s");
  cr_assert_eq(dp_bytes_new(NULL, 1, &b, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_bytes_new: NULL p");
  dp_value_release(s);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* value.h: NULL and 0 for a value of another kind, the length too. */
Test(value, str_or_bytes_data_of_another_kind_is_null_with_a_length_of_zero) {
  dp_value_t s = t_str("abc"), b;
  OK(dp_bytes_new("abc", 3, &b, T_ERR));
  size_t n = 99;
  cr_assert_null(dp_str_data(b, &n));
  cr_assert_eq(n, 0);
  n = 99;
  cr_assert_null(dp_str_data(dp_int(7), &n));
  cr_assert_eq(n, 0);
  n = 99;
  cr_assert_null(dp_bytes_data(s, &n));
  cr_assert_eq(n, 0);
  dp_value_release(s);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* value.h: a tuple has a fixed length; dp_list_append refuses it. */
Test(value, a_tuple_is_not_appended_to_and_keeps_its_length) {
  dp_value_t t;
  dp_error_t e;
  OK(dp_tuple_new(2, &t, T_ERR));
  cr_assert_eq(dp_seq_len(t), 2);
  cr_assert_eq(dp_list_append(t, t_str("x"), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_list_append: expected list, got tuple");
  cr_assert_eq(dp_seq_len(t), 2);
  cr_assert_eq(dp_value_kind(dp_seq_get(t, 1)), DP_NONE);
  dp_value_release(t);
  ASSERT_NO_LEAK();
}

/* A set that fails steals its item: when the item is the caller's only
 * reference to the sequence itself, the sequence is gone before the
 * message is written, which must not read it ("length 0" came from a
 * freed tuple). */
Test(value, a_set_out_of_range_that_steals_the_last_reference_to_the_sequence_reports_its_real_length) {
  dp_value_t t, l;
  dp_error_t e;
  OK(dp_tuple_new(2, &t, T_ERR));
  cr_assert_eq(dp_seq_set(t, 5, t, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_seq_set: index 5 out of range (length 2)");
  OK(dp_list_new(0, &l, T_ERR));
  OK(dp_list_append(l, dp_int(1), T_ERR));
  cr_assert_eq(dp_seq_set(l, SIZE_MAX, l, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_seq_set: index 18446744073709551615 out of range (length 1)");
  /* the name a stand-in refuses, borrowed from the value stolen (under
     ASan, a read of freed memory when the message came after the release) */
  dp_value_t r, name;
  OK(dp_object_new_reduced("Stand", dp_none(), &r, T_ERR));
  OK(dp_str_new("borrowed_name", 13, &name, T_ERR));
  cr_assert_eq(dp_object_set(r, dp_str_data(name, NULL), name, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_set: a reduced stand-in has one attribute, \"__reduce__\" (its state), "
                              "not 'borrowed_name'");
  dp_value_release(r);
  ASSERT_NO_LEAK();
}

Test(value, the_index_one_past_the_last_is_out_of_range_for_every_lookup) {
  dp_set_allocator(t_alloc_filled, NULL);
  dp_value_t l, d, o, v;
  dp_error_t e;
  OK(dp_list_new(4, &l, T_ERR));  /* room past its items */
  OK(dp_list_append(l, dp_int(1), T_ERR));
  OK(dp_list_append(l, dp_int(2), T_ERR));
  cr_assert_eq(dp_value_kind(dp_seq_get(l, 2)), DP_NONE, "the slot past the last item is not an item");
  cr_assert_eq(dp_seq_set(l, 2, t_str("x"), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_seq_set: index 2 out of range (length 2)");
  cr_assert_eq(dp_seq_len(l), 2);
  OK(dp_dict_new(4, &d, T_ERR));
  OK(dp_dict_set(d, dp_int(1), dp_int(2), T_ERR));
  cr_assert_eq(dp_dict_item(d, 1, NULL, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dict_item: index 1 out of range (length 1)");
  o = t_obj("M");
  OK(dp_object_set(o, "x", dp_int(1), T_ERR));
  cr_assert_eq(dp_object_attr(o, 1, NULL, &v, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_attr: index 1 out of range (1 attribute)");
  dp_value_release(l);
  dp_value_release(d);
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

/* n tuples of one item around `inner`. */
static dp_value_t wrap_in_tuples(dp_value_t inner, int n) {
  for (int i = 0; i < n; i++) {
    dp_value_t t;
    OK(dp_tuple_new(1, &t, T_ERR));
    OK(dp_seq_set(t, 0, inner, T_ERR));
    inner = t;
  }
  return inner;
}

/* value.h: no node of a key deeper than level 32 — an empty tuple is a
 * node too, and may lie at level 32 itself. */
Test(value, an_empty_tuple_at_level_32_of_a_key_is_hashable_and_one_level_deeper_is_not) {
  dp_value_t empty;
  OK(dp_tuple_new(0, &empty, T_ERR));
  dp_value_t k = wrap_in_tuples(empty, 32);
  cr_assert(dp_value_is_hashable(k), "an empty tuple at level 32");
  dp_value_t deeper = wrap_in_tuples(dp_value_retain(k), 1);
  cr_assert_not(dp_value_is_hashable(deeper), "an empty tuple at level 33");
  dp_value_t d;
  dp_error_t e;
  OK(dp_dict_new(0, &d, T_ERR));
  OK_WITH(&e, dp_dict_set(d, k, dp_int(1), &e));
  cr_assert_eq(dp_dict_set(d, deeper, dp_int(2), &e), DP_ETYPE);
  cr_assert_eq(dp_dict_len(d), 1);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* value.h: a str or bytes reads all its bytes the first time any hash
 * takes it, then keeps its hash. */
Test(value, a_str_reads_its_bytes_for_the_first_hash_taken_of_it_only) {
  char text[1000];
  memset(text, 'q', sizeof text);
  dp_value_t s, d, v;
  OK(dp_str_new(text, sizeof text, &s, T_ERR));
  uint64_t before = dp__key_bytes_hashed;
  uint64_t h = dp_value_hash(s);
  cr_assert_eq(dp_value_hash(s), h);
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_dict_set(d, dp_value_retain(s), dp_int(1), T_ERR));
  OK(dp_dict_get(d, s, &v, T_ERR));
  cr_assert_eq(dp__key_bytes_hashed - before, sizeof text, "%llu bytes read for hashes",
               (unsigned long long)(dp__key_bytes_hashed - before));
  dp_value_release(d);
  dp_value_release(s);
  ASSERT_NO_LEAK();
}

/* n nested lists around a list holding leaf: the leaf lies at level n + 1. */
static dp_value_t nested_lists(dp_value_t leaf, int n) {
  dp_value_t l = t_list();
  OK(dp_list_append(l, leaf, T_ERR));
  for (int i = 0; i < n; i++) {
    dp_value_t up = t_list();
    OK(dp_list_append(up, l, T_ERR));
    l = up;
  }
  return l;
}

/* value.h: the hash looks within 12 levels: values that differ only below
 * them hash alike; a difference at level 12 still counts. */
Test(value, two_values_that_differ_only_below_the_twelfth_level_hash_alike) {
  dp_value_t a = nested_lists(dp_int(0), 12), b = nested_lists(dp_int(1), 12);
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0);
  cr_assert_eq(dp_value_hash(a), dp_value_hash(b), "the hash read level 13");
  dp_value_t c = nested_lists(dp_int(0), 11), d = nested_lists(dp_int(1), 11);
  cr_assert_neq(dp_value_hash(c), dp_value_hash(d), "the hash did not read level 12");
  dp_value_release(a);
  dp_value_release(b);
  dp_value_release(c);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* A tuple that keys a dict keeps what the walk of its tree found: keying
 * more dicts with it walks its direct items no more (value.c, "keys"). */
Test(value, a_tuple_key_is_walked_whole_once_however_many_dicts_it_keys) {
  enum { ITEMS = 1000, DICTS = 100 };
  dp_value_t k, d[DICTS];
  OK(dp_tuple_new(ITEMS, &k, T_ERR));
  for (int i = 0; i < ITEMS; i++) OK(dp_seq_set(k, (size_t)i, dp_int(i), T_ERR));
  OK(dp_dict_new(0, &d[0], T_ERR));
  OK(dp_dict_set(d[0], dp_value_retain(k), dp_int(0), T_ERR));
  uint64_t before = dp__key_nodes_walked;
  for (int i = 1; i < DICTS; i++) {
    OK(dp_dict_new(0, &d[i], T_ERR));
    OK(dp_dict_set(d[i], dp_value_retain(k), dp_int(i), T_ERR));
  }
  uint64_t walked = dp__key_nodes_walked - before;
  cr_assert_leq(walked, 2 * DICTS, "%llu key nodes walked for %d more dicts", (unsigned long long)walked, DICTS - 1);
  for (int i = 0; i < DICTS; i++) dp_value_release(d[i]);
  dp_value_release(k);
  ASSERT_NO_LEAK();
}

Test(value, setting_into_a_value_that_is_not_a_dict_releases_the_key_and_the_value) {
  dp_value_t l = t_list();
  dp_error_t e;
  cr_assert_eq(dp_dict_set(l, t_str("k"), t_str("v"), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_dict_set: expected dict, got list");
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* The reader's insert (DP__KEEP_ON_EXISTS) hands a duplicate's key and
 * value back, to name the key before releasing them, and changes nothing. */
Test(value, an_insert_that_keeps_a_duplicate_hands_its_key_and_value_back_and_changes_nothing) {
  dp_value_t d, v;
  dp_error_t e;
  dp_error_clear(&e);
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_dict_set(d, t_str("a"), dp_int(1), T_ERR));
  dp_value_t k = t_str("a"), val = t_str("x");
  cr_assert_eq(dp__dict_set_checked(d, k, val, DP__KEEP_ON_EXISTS, &e), DP__EXISTS);
  OK(dp_dict_get(d, k, &v, T_ERR));
  cr_assert_eq(dp_value_kind(v), DP_INT, "the entry kept its value");
  cr_assert_eq(dp_value_refcount(k), 1, "the key is the caller's");
  cr_assert_eq(dp_value_refcount(val), 1, "the value is the caller's");
  dp_value_release(k);
  dp_value_release(val);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* value.h: DP_ENOTFOUND also for an unhashable key. */
Test(value, looking_up_an_unhashable_key_is_not_found_and_says_why) {
  dp_value_t d, v, l = t_list();
  dp_error_t e;
  OK(dp_dict_new(0, &d, T_ERR));
  cr_assert_eq(dp_dict_get(d, l, &v, &e), DP_ENOTFOUND);
  cr_assert_str_eq(e.message, "dp_dict_get: no such key (a key of kind list is not hashable)");
  dp_value_release(l);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* Names shorter than 16 bytes are kept inline, longer ones on the heap:
 * 15, 16 and 17 bytes are found, named and freed alike. */
Test(value, attribute_names_at_the_inline_limit_are_found_named_and_freed) {
  static const char *const names[] = {"abcdefghijklmno", "abcdefghijklmnop", "abcdefghijklmnopq"};
  dp_value_t o = t_obj("M"), v;
  for (int i = 0; i < 3; i++) OK(dp_object_set(o, names[i], dp_int(i), T_ERR));
  for (int i = 0; i < 3; i++) {
    const char *n;
    OK(dp_object_get(o, names[i], &v, T_ERR));
    cr_assert_eq(dp_value_as_int(v), i);
    OK(dp_object_attr(o, (size_t)i, &n, NULL, T_ERR));
    cr_assert_str_eq(n, names[i]);
  }
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

Test(value, a_storage_on_a_device_that_cannot_exist_is_refused_naming_it) {
  dp_storage_t *s;
  dp_error_t e;
  released_storages = 0;
  cr_assert_eq(dp_storage_new(t_dev(DP_DEVICE_TYPE_COUNT, 0), (void *)0x1000, 4, count_release, NULL, &s, &e),
               DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_storage_new: invalid device (type 3, index 0)");
  cr_assert_eq(released_storages, 0, "a refused storage leaves its memory to the caller: release is not called");
  cr_assert_eq(dp_storage_new(t_dev(DP_DEVICE_CPU, 1), (void *)0x1000, 4, NULL, NULL, &s, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_storage_new: invalid device (type 0, index 1)");
  OK_WITH(&e, dp_storage_new(t_dev(DP_DEVICE_HOST, 255), (void *)0x1000, 4, NULL, NULL, &s, &e));
  dp_storage_release(s);
  ASSERT_NO_LEAK();
}

/* A storage of 0 bytes takes host data of 0 bytes, which may be NULL;
 * any other needs its bytes. */
Test(value, host_data_may_be_null_only_for_a_storage_of_zero_bytes) {
  dp_storage_t *z = t_storage(t_dev(DP_DEVICE_CPU, 0), 0x1000, 0), *s = t_storage(t_dev(DP_DEVICE_CPU, 0), 0x2000, 4);
  dp_error_t e;
  OK_WITH(&e, dp_storage_set_host_data(z, NULL, &e));
  cr_assert_eq(dp_storage_set_host_data(s, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_storage_set_host_data: NULL data");
  cr_assert_null(dp_storage_host_data(s));
  dp_storage_release(z);
  dp_storage_release(s);
  ASSERT_NO_LEAK();
}

Test(value, a_tensor_of_sixteen_dimensions_is_made_and_one_of_seventeen_is_refused) {
  int64_t shape[DP_TENSOR_MAX_DIMS + 1];
  for (int d = 0; d <= DP_TENSOR_MAX_DIMS; d++) shape[d] = 1;
  dp_storage_t *s = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 4);
  dp_value_t t;
  dp_error_t e;
  OK_WITH(&e, dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, DP_TENSOR_MAX_DIMS, shape, NULL, 0, &t, &e));
  cr_assert_eq(dp_tensor_ndim(t), DP_TENSOR_MAX_DIMS);
  cr_assert_eq(dp_tensor_strides(t)[DP_TENSOR_MAX_DIMS - 1], 1);
  dp_value_release(t);
  cr_assert_eq(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, DP_TENSOR_MAX_DIMS + 1, shape, NULL, 0, &t, &e),
               DP_EINVAL);
  cr_assert_str_eq(e.message, "tensor has 17 dimensions (0..16 allowed)");
  dp_storage_release(s);
  ASSERT_NO_LEAK();
}

Test(value, a_negative_offset_or_dimension_is_named_in_the_refusal) {
  dp_storage_t *s = t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 64);
  dp_value_t t;
  dp_error_t e;
  int64_t one[1] = {1}, neg[1] = {-1};
  cr_assert_eq(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 1, one, NULL, -1, &t, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "negative tensor offset -1");
  cr_assert_eq(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 1, neg, one, 0, &t, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "negative tensor dimension -1");
  dp_storage_release(s);
  ASSERT_NO_LEAK();
}

/* Contiguous strides step over a 0 dimension as over one of 1 (as
 * PyTorch's do): shape [2, 0, 3] has strides [3, 3, 1]. */
Test(value, contiguous_strides_step_over_a_zero_dimension_as_over_a_dimension_of_one) {
  int64_t shape[3] = {2, 0, 3};
  dp_value_t t;
  OK(dp_tensor_new(t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 0), DP_FLOAT32, 3, shape, NULL, 0, &t, T_ERR));
  const int64_t *st = dp_tensor_strides(t);
  cr_assert(st[0] == 3 && st[1] == 3 && st[2] == 1, "strides [%lld, %lld, %lld]", (long long)st[0],
            (long long)st[1], (long long)st[2]);
  dp_value_release(t);
  ASSERT_NO_LEAK();
}

/* A shape is required when there are dimensions (not for a 0-d view); the
 * refused call still takes the storage. */
Test(value, a_tensor_with_dimensions_and_no_shape_is_refused_and_its_storage_released) {
  dp_value_t t;
  dp_error_t e;
  cr_assert_eq(dp_tensor_new(t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 4), DP_FLOAT32, 1, NULL, NULL, 0, &t, &e),
               DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_tensor_new: NULL shape");
  OK_WITH(&e, dp_tensor_new(t_storage(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 4), DP_FLOAT32, 0, NULL, NULL, 0, &t, &e));
  cr_assert_eq(dp_tensor_ndim(t), 0);
  dp_value_release(t);
  ASSERT_NO_LEAK();
}

Test(value, tensor_and_custom_accessors_of_another_kind_give_null_and_zero) {
  dp_value_t l = t_list();
  cr_assert_null(dp_tensor_storage(l));
  cr_assert_eq(dp_tensor_dtype(l), 0);
  cr_assert_eq(dp_tensor_ndim(l), 0);
  cr_assert_null(dp_tensor_shape(l));
  cr_assert_null(dp_tensor_strides(l));
  cr_assert_eq(dp_tensor_offset(l), 0);
  cr_assert_null(dp_custom_type(l));
  cr_assert_null(dp_custom_data(l));
  cr_assert_null(dp_object_class(l));
  cr_assert_eq(dp_object_nattrs(l), 0);
  cr_assert_eq(dp_dict_len(l), 0);
  cr_assert_eq(dp_seq_len(dp_int(3)), 0);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* ---- edges a mutation run of gc.c found unchecked ---- */

/* Another thread's candidate names its slot in that thread's buffer: the
 * slot of the same number here holds this thread's own candidate, which a
 * release of the other's to zero must leave in place. */
Test(value, releasing_another_threads_candidate_to_zero_leaves_this_threads_own_candidates_buffered) {
  dp_set_allocator(quarantining_alloc, NULL);
  worker_start(&w_owner);
  dp_value_collect();  /* this thread's buffer empty: its next candidate takes slot 0 */
  dp_value_t cycle = t_list();
  OK(dp_list_append(cycle, dp_value_retain(cycle), T_ERR));
  dp_value_release(cycle);  /* garbage, this thread's candidate at slot 0 */
  dp_value_t l = t_list();
  OK(dp_list_append(l, t_obj("Item"), T_ERR));
  worker_run(&w_owner, job_release, dp_value_retain(l));  /* w_owner's candidate at its slot 0 */
  dp_value_release(l);                                    /* 1 -> 0 here */
  dp_value_collect();  /* the cycle is still this thread's candidate: freed now */
  long live = atomic_load(&t_live_blocks);
  worker_run(&w_owner, job_collect, dp_none());
  worker_stop(&w_owner);
  cr_assert_eq(live, 0, "%ld blocks live: this thread's cycle left its buffer", live);
  cr_assert_eq(quarantine_release(), 0, "a freed block was written to");
  ASSERT_NO_LEAK();
}

enum { GROWN = 600 };
static dp_value_t grown[GROWN];
static void job_release_grown(dp_value_t v) {
  (void)v;
  for (int i = 0; i < GROWN; i++) dp_value_release(grown[i]);
}

/* A grown candidate array goes back when its buffer is empty, also when
 * other threads emptied it (they remove entries, never arrays): at the
 * latest when its thread exits. */
Test(value, a_grown_buffer_that_other_threads_emptied_goes_back_when_its_thread_exits) {
  worker_start(&w_owner);
  for (int i = 0; i < GROWN; i++) {
    grown[i] = t_list();
    OK(dp_list_append(grown[i], t_list(), T_ERR));
    dp_value_retain(grown[i]);
  }
  long before = t_alloc_count;
  /* 256 candidates; the 257th release tries them and meets 768 live
   * containers and children, so the buffer grows before its next trial */
  worker_run(&w_owner, job_release_grown, dp_none());
  cr_assert_gt(t_alloc_count, before, "w_owner's buffer grew");
  for (int i = 0; i < GROWN; i++) dp_value_release(grown[i]);  /* to zero here: w_owner's buffer empties */
  worker_stop(&w_owner);
  ASSERT_NO_LEAK();
}

/* value.h: a buffer that cannot grow is collected as it is — by the release
 * that found it full, not later. */
Test(value, a_release_whose_buffer_cannot_grow_collects_the_buffer_then_and_there) {
  enum { N = 1000, H = 1200 };
  dp_value_t big = t_list(), root = t_list();
  for (int i = 0; i < N; i++) OK(dp_list_append(big, t_list(), T_ERR));
  dp_value_t *holders = malloc(H * sizeof *holders);
  for (int i = 0; i < H; i++) {
    holders[i] = t_list();
    OK(dp_list_append(holders[i], dp_value_retain(big), T_ERR));
    OK(dp_list_append(root, dp_value_retain(holders[i]), T_ERR));
  }
  dp_value_release(big);
  for (int i = 0; i < 300; i++) dp_value_release(holders[i]);  /* a trial that meets big: the buffer will grow */
  long fail = t_alloc_count + 1;
  t_fail_at = fail;
  int at = -1;
  for (int i = 300; i < H && at < 0; i++) {
    dp__gc_items_walked = 0;
    dp_value_release(holders[i]);
    if (t_alloc_count >= fail) at = i;
  }
  t_fail_at = 0;
  cr_assert_geq(at, 0, "no growth was tried");
  cr_assert_gt(dp__gc_items_walked, 0, "release %d could not grow the buffer and did not collect it", at);
  for (int i = at + 1; i < H; i++) dp_value_release(holders[i]);
  free(holders);
  dp_value_release(root);
  ASSERT_NO_LEAK();
}

/* A custom's destroy that releases a container runs inside the drain that
 * frees a garbage cycle: the release must not free the cycle's members
 * already drained, whose state the rest of the drain still reads (B, below,
 * while A's items are released). */
Test(value, a_destroy_releasing_a_container_midway_through_a_cycles_drain_touches_no_freed_member) {
  dp_set_allocator(quarantining_alloc, NULL);
  dp_value_t x = t_list(), a = t_list(), b = t_list(), c;
  dp_value_t *box = malloc(sizeof *box);
  *box = dp_value_retain(x);  /* the custom's reference to x, let go in its destroy */
  OK(dp_custom_new(&holder_type, box, &c, T_ERR));
  OK(dp_list_append(a, c, T_ERR));  /* A = [C, B], B = [A] */
  OK(dp_list_append(a, b, T_ERR));
  OK(dp_list_append(b, dp_value_retain(a), T_ERR));
  dp_value_release(a);  /* the cycle's candidate */
  dp_value_collect();   /* B drains first, then A, whose C lets go of x */
  cr_assert_eq(dp_value_refcount(x), 1);
  dp_value_release(x);
  dp_value_collect();
  cr_assert_eq(quarantine_release(), 0, "a freed block was written to");
  ASSERT_NO_LEAK();
}

/* A cycle whose members are candidates of two threads is found garbage by
 * either thread's trial, which frees it whole there and then: the member
 * the other thread buffered leaves that thread's buffer, whose next trial
 * never touches it. */
Test(value, a_cycle_found_garbage_here_leaves_the_buffer_of_the_thread_that_buffered_a_member) {
  dp_set_allocator(quarantining_alloc, NULL);
  worker_start(&w_owner);
  dp_value_collect();
  dp_value_t a = t_list(), b = t_list();
  OK(dp_list_append(a, dp_value_retain(b), T_ERR));  /* A = [B], B = [A] */
  OK(dp_list_append(b, dp_value_retain(a), T_ERR));
  worker_run(&w_owner, job_release, b);  /* 2 -> 1: w_owner's candidate */
  dp_value_release(a);                   /* 2 -> 1: this thread's candidate */
  dp_value_collect();                    /* A and B: garbage, freed here */
  long live = atomic_load(&t_live_blocks);
  worker_run(&w_owner, job_collect, dp_none());  /* its buffer no longer holds B */
  worker_stop(&w_owner);
  cr_assert_eq(live, 0, "%ld blocks live after the trial that found the cycle garbage", live);
  cr_assert_eq(quarantine_release(), 0, "a freed block was written to");
  ASSERT_NO_LEAK();
}

/* A custom's destroy that collects runs inside the drain that frees a
 * garbage cycle: that collection (nested in the drain) must leave the
 * drain to the outermost one, whose members still to be read are not
 * freed under it (B, below, while A's items are released). */
static int collections_in_destroy;
static void destroy_collecting(void *obj) {
  (void)obj;
  collections_in_destroy++;
  dp_value_collect();
}
static const dp_type_t collecting_type = {"Collecting", NULL, destroy_collecting};

Test(value, a_destroy_that_collects_midway_through_a_cycles_drain_touches_no_freed_member) {
  dp_set_allocator(quarantining_alloc, NULL);
  collections_in_destroy = 0;
  dp_value_t a = t_list(), b = t_list(), c;
  OK(dp_custom_new(&collecting_type, NULL, &c, T_ERR));
  OK(dp_list_append(a, c, T_ERR));  /* A = [C, B], B = [A] */
  OK(dp_list_append(a, b, T_ERR));
  OK(dp_list_append(b, dp_value_retain(a), T_ERR));
  dp_value_release(a);  /* the cycle's candidate */
  dp_value_collect();   /* B drains first, then A, whose C collects */
  cr_assert_eq(collections_in_destroy, 1);
  dp_value_collect();
  cr_assert_eq(quarantine_release(), 0, "a freed block was written to");
  ASSERT_NO_LEAK();
}

static void pause_owner_collects(int where) {
  if (pthread_equal(pthread_self(), w_paused) && where == DP_GC_PAUSE_FOREIGN)
    worker_run(&w_owner, job_collect, dp_none());
}

/* A release that finds another thread's candidate let go by that thread
 * buffers it here; with this thread's buffer full, it collects the buffer
 * first, as any release into a full buffer does. */
Test(value, a_release_that_takes_over_a_candidate_into_a_full_buffer_collects_the_buffer_first) {
  worker_start(&w_owner);
  dp_value_collect();  /* this thread's buffer empty */
  dp_value_t keep = t_list();
  for (int i = 0; i < 256; i++) {
    dp_value_t l = t_list();
    OK(dp_list_append(l, dp_int(i), T_ERR));
    OK(dp_list_append(keep, dp_value_retain(l), T_ERR));
    dp_value_release(l);  /* live candidates: the buffer is full */
  }
  w_shared = t_list();
  OK(dp_list_append(w_shared, t_obj("Item"), T_ERR));
  dp_value_retain(w_shared);
  dp_value_retain(w_shared);
  worker_run(&w_owner, job_release, w_shared);  /* 3 -> 2: w_owner's candidate */
  w_paused = pthread_self();
  dp__gc_pause_hook = pause_owner_collects;
  dp__gc_items_walked = 0;
  dp_value_release(w_shared);  /* w_owner's trial lets go of it first: 2 -> 1, buffered here */
  dp__gc_pause_hook = NULL;
  uint64_t walked = dp__gc_items_walked;
  cr_assert_gt(walked, 0, "the full buffer was not collected before it took one more");
  dp_value_release(w_shared);
  dp_value_release(keep);
  dp_value_collect();
  worker_stop(&w_owner);
  ASSERT_NO_LEAK();
}

/* A cycle that another thread's trial found live, and that a release here
 * then leaves held only by itself, is this thread's candidate: this
 * thread's next collection frees it. */
Test(value, a_cycle_let_go_by_its_buffering_thread_and_then_released_here_is_collected_here) {
  worker_start(&w_owner);
  dp_value_collect();
  destroyed = 0;
  dp_value_t c;
  OK(dp_custom_new(&counted_type, NULL, &c, T_ERR));
  w_shared = t_list();
  OK(dp_list_append(w_shared, c, T_ERR));
  OK(dp_list_append(w_shared, dp_value_retain(w_shared), T_ERR));  /* held by itself and here */
  dp_value_retain(w_shared);
  worker_run(&w_owner, job_release, w_shared);  /* 3 -> 2: w_owner's candidate */
  w_paused = pthread_self();
  dp__gc_pause_hook = pause_owner_collects;
  dp_value_release(w_shared);  /* w_owner's trial finds it live and lets go of it; 2 -> 1 here */
  dp__gc_pause_hook = NULL;
  cr_assert_eq(destroyed, 0, "the cycle was freed while this thread held it");
  dp_value_collect();
  cr_assert_eq(destroyed, 1, "the cycle, held only by itself, was not collected by the thread that let it go");
  worker_stop(&w_owner);
  ASSERT_NO_LEAK();
}

/* A thread-specific destructor of the program's own may release a cycle
 * after the collector's exit flush has run on that thread (destructors run
 * in rounds, in no set order): the flush is armed again and the cycle is
 * collected in a later round, before the thread is gone. */
static pthread_key_t late_key;
static int late_rounds;
static void release_a_cycle_late(void *p) {
  late_rounds++;
  if (p == (void *)1) { /* first round: the collector's flush runs in this one */
    pthread_setspecific(late_key, (void *)2);
    return;
  }
  dp_value_t l = t_list();
  dp_list_append(l, dp_value_retain(l), NULL);
  dp_list_append(l, t_obj("Late"), NULL);
  dp_value_release(l); /* a candidate of a thread whose flush already ran */
}

static void *cycle_now_and_one_from_a_late_destructor(void *p) {
  (void)p;
  dp_value_t l = t_list();
  dp_list_append(l, dp_value_retain(l), NULL);
  dp_value_release(l); /* buffered: the collector's flush is armed */
  pthread_setspecific(late_key, (void *)1);
  return NULL;
}

Test(value, a_cycle_released_by_a_destructor_after_the_threads_exit_flush_is_collected_before_it_ends) {
  cr_assert_eq(pthread_key_create(&late_key, release_a_cycle_late), 0);
  late_rounds = 0;
  pthread_t th;
  pthread_create(&th, NULL, cycle_now_and_one_from_a_late_destructor, NULL);
  pthread_join(th, NULL);
  cr_assert_eq(late_rounds, 2);
  cr_assert_eq(atomic_load(&t_live_blocks), 0, "%ld blocks live after the thread ended",
               (long)atomic_load(&t_live_blocks));
  pthread_key_delete(late_key);
}

static void pause_other_collects(int where) {
  if (pthread_equal(pthread_self(), w_paused) && where == DP_GC_PAUSE_FOREIGN)
    worker_run(&w_other, job_collect, dp_none());
}

/* A candidate that a release takes over from a thread that let go of it,
 * and that this release drops to zero, leaves the buffer at once; were it
 * the only entry of a grown array (other threads emptied it), the array
 * goes back then too, not at this thread's next collection. */
Test(value, a_grown_array_emptied_by_a_taken_over_candidate_released_to_zero_goes_back_at_once) {
  worker_start(&w_owner);
  worker_start(&w_other);
  for (int i = 0; i < GROWN; i++) {
    grown[i] = t_list();
    OK(dp_list_append(grown[i], t_list(), T_ERR));
    dp_value_retain(grown[i]);
  }
  long before = t_alloc_count;
  worker_run(&w_owner, job_release_grown, dp_none());  /* w_owner's buffer grows */
  cr_assert_gt(t_alloc_count, before, "w_owner's buffer grew");
  for (int i = 0; i < GROWN; i++) dp_value_release(grown[i]);  /* and empties: its array stays */
  w_shared = t_list();
  OK(dp_list_append(w_shared, t_obj("Item"), T_ERR));
  dp_value_retain(w_shared);
  worker_run(&w_other, job_release, w_shared);  /* 2 -> 1: w_other's candidate */
  w_paused = w_owner.th;
  dp__gc_pause_hook = pause_other_collects;
  /* w_other's trial finds it live and lets go; w_owner buffers it and drops it to zero */
  worker_run(&w_owner, job_release, w_shared);
  dp__gc_pause_hook = NULL;
  long live = atomic_load(&t_live_blocks);
  worker_stop(&w_owner);
  worker_stop(&w_other);
  cr_assert_eq(live, 0, "%ld blocks live after the last release (the grown array among them)", live);
  ASSERT_NO_LEAK();
}

/* ---- base: errors, the allocator hook, devices, text (core/base.c) ---- */

TestSuite(base, .init = setup, .fini = teardown);

static void *hook_with_ud(void *ud, void *ptr, size_t osize, size_t nsize) {
  ++*(long *)ud;
  return t_alloc(NULL, ptr, osize, nsize);
}

Test(base, the_allocator_hook_is_read_back_with_its_ud_and_null_restores_the_default_without_it) {
  long calls = 0;
  dp_set_allocator(hook_with_ud, &calls);
  void *ud = NULL;
  cr_assert_eq(dp_get_allocator(&ud), hook_with_ud);
  cr_assert_eq(ud, &calls);
  cr_assert_eq(dp_get_allocator(NULL), hook_with_ud, "ud may be NULL");
  dp_value_release(t_list());
  cr_assert_gt(calls, 0, "the hook installed is the one called");
  dp_set_allocator(NULL, &calls);  /* the ud goes with the hook it was given for */
  dp_alloc_fn fn = dp_get_allocator(&ud);
  cr_assert_not_null(fn, "NULL restores the default, not no allocator");
  cr_assert_null(ud);
  long before = calls;
  dp_value_release(t_list());
  cr_assert_eq(calls, before);
  void *p = fn(NULL, NULL, 0, 24);
  cr_assert_not_null(p);
  cr_assert_null(fn(NULL, p, 24, 0), "nsize 0 frees and returns NULL");
}

Test(base, an_array_whose_size_overflows_is_not_allocated) {
  /* (2^60 + 2) * 16 wraps to 32 bytes: a product taken blindly would
     hand out 32 bytes for an array of more than 2^60 items */
  cr_assert_null(dp__alloc_array(SIZE_MAX / 16 + 2, 16));
  void *p = dp__alloc_array(3, 16);
  cr_assert_not_null(p);
  dp__free(p, 48);
  ASSERT_NO_LEAK();
}

Test(base, strndup_ends_the_copy_after_n_bytes_whatever_the_block_held) {
  dp_set_allocator(t_alloc_filled, NULL);
  char *s = dp__strndup("abcdef", 3);
  cr_assert_str_eq(s, "abc");
  dp__free(s, 4);
  ASSERT_NO_LEAK();
}

Test(base, grow_doubles_from_four_only_when_the_need_passes_the_capacity) {
  int *a = NULL;
  size_t cap = 0;
  OK(dp__grow((void **)&a, &cap, 1, sizeof *a));
  cr_assert_eq(cap, 4);
  for (int i = 0; i < 4; i++) a[i] = i;
  int *before = a;
  long calls = t_alloc_count;
  OK(dp__grow((void **)&a, &cap, 4, sizeof *a));
  cr_assert(cap == 4 && a == before, "a need of exactly the capacity changes nothing");
  cr_assert_eq(t_alloc_count, calls, "nor asks the allocator for anything");
  OK(dp__grow((void **)&a, &cap, 5, sizeof *a));
  cr_assert_eq(cap, 8);
  OK(dp__grow((void **)&a, &cap, 33, sizeof *a));
  cr_assert_eq(cap, 64);
  for (int i = 0; i < 4; i++) cr_assert_eq(a[i], i);
  cr_assert_eq(dp__grow((void **)&a, &cap, SIZE_MAX / 2, sizeof *a), DP_ENOMEM);
  cr_assert_eq(cap, 64, "a refused growth keeps the array");
  dp__free(a, cap * sizeof *a);
  ASSERT_NO_LEAK();  /* each block freed with the size it was given */
}

Test(base, grow_inl_copies_an_inline_array_out_and_leaves_it_as_it_was) {
  int inl[4] = {10, 11, 12, 13};
  int *a = inl;
  size_t cap = 4;
  OK(dp__grow_inl((void **)&a, &cap, 4, sizeof *a, inl));
  cr_assert(a == inl && cap == 4);
  OK(dp__grow_inl((void **)&a, &cap, 5, sizeof *a, inl));
  cr_assert_neq(a, inl);
  cr_assert_eq(cap, 8);
  for (int i = 0; i < 4; i++) cr_assert(a[i] == 10 + i && inl[i] == 10 + i);
  a[4] = 14;
  OK(dp__grow_inl((void **)&a, &cap, 9, sizeof *a, inl));  /* separate now: grown in place */
  cr_assert_eq(cap, 16);
  for (int i = 0; i < 5; i++) cr_assert_eq(a[i], 10 + i);
  dp__free(a, cap * sizeof *a);
  ASSERT_NO_LEAK();
}

Test(base, a_cleared_error_has_no_code_no_backend_code_offset_minus_one_and_no_message) {
  dp_error_t e;
  cr_assert_eq(dp__err_at(&e, DP_EFORMAT, 42, "bad byte %d", 7), DP_EFORMAT);
  e.backend_code = 3;
  cr_assert(e.code == DP_EFORMAT && e.offset == 42);
  cr_assert_str_eq(e.message, "bad byte 7");
  dp_error_clear(&e);
  cr_assert(e.code == 0 && e.backend_code == 0 && e.offset == -1);
  cr_assert_str_eq(e.message, "");
  dp_error_clear(NULL);
}

Test(base, an_error_resets_the_backend_code_and_takes_its_own_offset) {
  dp_error_t e;
  dp_error_clear(&e);
  e.backend_code = 700;
  e.offset = 9;
  cr_assert_eq(dp__err(&e, DP_EINVAL, "x"), DP_EINVAL);
  cr_assert(e.backend_code == 0 && e.offset == -1 && e.code == DP_EINVAL);
  cr_assert_eq(dp__err_at(&e, DP_ETRUNC, 0, "y"), DP_ETRUNC);
  cr_assert_eq(e.offset, 0);
  cr_assert_eq(dp__err(NULL, DP_EIO, "nowhere"), DP_EIO, "a NULL err still returns the code");
}

Test(base, zero_and_every_code_have_their_name_and_description_and_others_none) {
  cr_assert_str_eq(dp_strerror(0), "success");
  cr_assert_str_eq(dp_err_name(0), "DP_OK");
  cr_assert_str_eq(dp_strerror(DP_ECANCELED), "canceled");
  cr_assert_str_eq(dp_err_name(DP_ECANCELED), "DP_ECANCELED");
  cr_assert_str_eq(dp_strerror(DP_EINVAL), "invalid argument");
  cr_assert_str_eq(dp_err_name(DP_EINVAL), "DP_EINVAL");
  cr_assert_str_eq(dp_strerror(-18), "unknown error");
  cr_assert_str_eq(dp_strerror(1), "unknown error");
  cr_assert_str_eq(dp_err_name(-18), "DP_UNKNOWN");
}

/* The linked library says which release it is, as the headers do. */
Test(base, the_linked_version_is_the_headers_as_a_number_and_as_major_dot_minor_dot_patch) {
  cr_assert_eq(dp_version(), DP_VERSION_NUMBER);
  cr_assert_eq(dp_version(), (unsigned)(DP_VERSION_MAJOR * 10000 + DP_VERSION_MINOR * 100 + DP_VERSION_PATCH));
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", DP_VERSION_MAJOR, DP_VERSION_MINOR, DP_VERSION_PATCH);
  cr_assert_str_eq(dp_version_string(), want);
  cr_assert_str_eq(DP_VERSION_STRING, want);
  cr_assert_eq(dp_version_string(), dp_version_string(), "a static string, not a new one per call");
}

/* n bytes of c, NUL-terminated, through the hook (freed with n + 1). */
static char *repeated(const char *c, size_t times) {
  size_t k = strlen(c);
  char *s = dp__alloc(k * times + 1);
  for (size_t i = 0; i < times; i++) memcpy(s + i * k, c, k);
  s[k * times] = '\0';
  return s;
}

Test(base, a_message_of_2047_bytes_is_kept_whole_and_one_of_2048_loses_its_middle) {
  dp_error_t e;
  char *m = repeated("x", 2047);
  dp__err(&e, DP_EINVAL, "%s", m);
  cr_assert_str_eq(e.message, m);
  dp__free(m, 2048);
  m = repeated("x", 2048);
  m[0] = 'A';
  m[2047] = 'Z';
  dp__err(&e, DP_EINVAL, "%s", m);
  cr_assert_eq(strlen(e.message), DP_ERROR_MSG_MAX - 1);
  cr_assert_eq(e.message[0], 'A');
  cr_assert_eq(e.message[DP_ERROR_MSG_MAX - 2], 'Z', "the end is kept");
  cr_assert_eq(memcmp(e.message + 1022, "\xe2\x80\xa6", 3), 0, "the middle's 1,022nd byte is replaced by the ellipsis");
  dp__free(m, 2049);
  ASSERT_NO_LEAK();  /* the whole message formatted for the cut is freed */
}

Test(base, a_message_cut_in_its_middle_cuts_at_character_boundaries_on_both_sides) {
  dp_error_t e;
  /* "q", 1,499 e-acutes, "z": the cuts fall at byte 1,022 and from byte
     3,000 - 1,022, each the second byte of an e-acute */
  char *m = repeated("\xc3\xa9", 1500);
  memmove(m + 1, m, 2998);
  m[0] = 'q';
  m[2999] = 'z';
  dp__err(&e, DP_EINVAL, "%s", m);
  size_t n = strlen(e.message);
  cr_assert(dp__utf8_valid(e.message, n), "a cut split a character: %s", e.message);
  cr_assert_eq(n, DP_ERROR_MSG_MAX - 1 - 2, "one byte less on each side than an ASCII message");
  cr_assert_eq(strncmp(e.message, "q\xc3\xa9", 3), 0);
  cr_assert_str_eq(e.message + n - 3, "\xc3\xa9z");
  dp__free(m, 3001);
  ASSERT_NO_LEAK();
}

Test(base, a_message_of_64_kib_keeps_its_end_and_a_longer_one_only_its_beginning) {
  dp_error_t e;
  char *m = repeated("y", 64 << 10);
  m[(64 << 10) - 1] = 'Z';
  dp__err(&e, DP_EINVAL, "%s", m);
  cr_assert_eq(strlen(e.message), DP_ERROR_MSG_MAX - 1);
  cr_assert_eq(e.message[DP_ERROR_MSG_MAX - 2], 'Z');
  dp__free(m, (64 << 10) + 1);
  m = repeated("y", (64 << 10) + 1);
  dp__err(&e, DP_EINVAL, "%s", m);
  cr_assert_eq(strlen(e.message), DP_ERROR_MSG_MAX - 1);
  cr_assert_str_eq(e.message + DP_ERROR_MSG_MAX - 4, "\xe2\x80\xa6");
  cr_assert_eq(e.message[DP_ERROR_MSG_MAX - 5], 'y');
  dp__free(m, (64 << 10) + 2);
  /* its beginning cut at a character boundary: byte 2,044 is an e-acute's second */
  m = repeated("\xc3\xa9", 40000);
  memmove(m + 1, m, 79998);
  m[0] = 'a';
  m[79999] = 'z';
  dp__err(&e, DP_EINVAL, "%s", m);
  size_t n = strlen(e.message);
  cr_assert(dp__utf8_valid(e.message, n), "the cut split a character");
  cr_assert_eq(n, DP_ERROR_MSG_MAX - 2);
  cr_assert_str_eq(e.message + n - 5, "\xc3\xa9\xe2\x80\xa6");
  dp__free(m, 80001);
  ASSERT_NO_LEAK();
}

Test(base, a_callback_returning_one_is_refused_and_a_failure_keeps_its_message_with_the_code_returned) {
  dp_error_t e;
  dp_error_clear(&e);
  cr_assert_eq(dp__cb_rc(1, &e, "bind"), DP_EINVAL);
  cr_assert_str_eq(e.message, "bind returned 1: a callback returns 0 or a negative DP_E* code");
  dp_error_clear(&e);
  cr_assert_eq(dp__cb_rc(DP_EIO, &e, "the read callback"), DP_EIO);
  cr_assert_eq(e.code, DP_EIO);
  cr_assert_str_eq(e.message, "the read callback failed: i/o error");
  dp_error_clear(&e);
  snprintf(e.message, sizeof e.message, "disk on fire");
  e.code = DP_EINVAL;  /* what the callback stored is not what it returned */
  cr_assert_eq(dp__cb_rc(DP_EIO, &e, "the read callback"), DP_EIO);
  cr_assert_eq(e.code, DP_EIO);
  cr_assert_str_eq(e.message, "disk on fire");
  cr_assert_eq(dp__cb_rc(0, &e, "bind"), 0);
  cr_assert_eq(dp__cb_rc(DP_EIO, NULL, "bind"), DP_EIO);
}

Test(base, a_device_type_past_the_last_is_formatted_as_unknown_with_its_number_and_index) {
  char buf[32];
  cr_assert_str_eq(dp_device_format(t_dev(3, 1), buf, sizeof buf), "unknown3:1");
  cr_assert_str_eq(dp_device_format(t_dev(200, 0), buf, sizeof buf), "unknown200:0");
  cr_assert_str_eq(dp_device_format(t_dev(DP_DEVICE_HOST, 255), buf, sizeof buf), "host:255");
  cr_assert_str_eq(dp_device_format(t_dev(DP_DEVICE_CPU, 0), buf, sizeof buf), "cpu");
  buf[0] = 'k';
  cr_assert_eq(dp_device_format(t_dev(DP_DEVICE_CUDA, 0), buf, 0), buf);
  cr_assert_eq(buf[0], 'k', "size 0: nothing written");
}

Test(base, device_parse_reads_every_type_at_its_bounds_and_refuses_what_is_near) {
  dp_device_t d = t_dev(DP_DEVICE_CUDA, 7);
  dp_error_t e;
  OK(dp_device_parse("cpu", &d, T_ERR));
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_CPU, 0)), "cpu's index is 0, not what out held");
  OK(dp_device_parse("host:3", &d, T_ERR));
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_HOST, 3)));
  OK(dp_device_parse("cuda:255", &d, T_ERR));
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_CUDA, 255)));
  OK(dp_device_parse("cuda:0", &d, T_ERR));
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_CUDA, 0)));
  OK(dp_device_parse("cuda:9", &d, T_ERR));  /* '0' and '9', first digit and later ones */
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_CUDA, 9)));
  OK(dp_device_parse("host:109", &d, T_ERR));
  cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_HOST, 109)));
  const char *bad[] = {"cuda-5", "cuda5",  "cuda:1x", "cuda:/", "cuda::", "cuda:1/", "cuda:1:",
                       "host:", "host:256", "cpu:0", "Cuda:0", "cuda:-1", "cuda:00", "cuda:07"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    d = t_dev(DP_DEVICE_HOST, 9);
    cr_assert_eq(dp_device_parse(bad[i], &d, &e), DP_EINVAL, "%s", bad[i]);
    char want[160];
    snprintf(want, sizeof want, "dp_device_parse: '%s' is not a device (cpu, cuda:N or host:N, N 0..255)", bad[i]);
    cr_assert_str_eq(e.message, want);
    cr_assert(dp_device_equal(d, t_dev(DP_DEVICE_HOST, 9)), "%s: out is left alone", bad[i]);
  }
  cr_assert_eq(dp_device_parse(NULL, &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_device_parse: NULL s");
}

Test(base, utf8_validity_at_the_edges_of_each_rule) {
  static const struct { const char *s; size_t n; int valid; } cases[] = {
    {"abcdefg\xff", 8, 0},            /* the eighth byte of a word read at once */
    {"abcdefghijklmno\x80", 16, 0},
    {"abcdefg\xc3\xa9", 9, 1},
    {"ab\xc3\xa9", 3, 0},             /* cut before its continuation, though one follows */
    {"\xc0\x80", 2, 0},               /* overlong */
    {"\xe0\x9f\xbf", 3, 0},
    {"\xf0\x8f\xbf\xbf", 4, 0},
    {"\xc2\x80", 2, 1},
    {"\xf4\x8f\xbf\xbf", 4, 1},       /* U+10FFFF */
    {"\xf4\x90\x80\x80", 4, 0},       /* U+110000 */
    {"\xed\x9f\xbf", 3, 1},           /* U+D7FF */
    {"\xed\xa0\x80", 3, 0},           /* U+D800 */
    {"\xed\xbf\xbf", 3, 0},           /* U+DFFF */
    {"\xee\x80\x80", 3, 1},           /* U+E000 */
    {"\xf9\x90\x80\x80", 4, 0},       /* a five-byte lead is no four-byte one */
    {"\xf8\x88\x80\x80\x80", 5, 0},
    {"\xc3\x28", 2, 0},
    {"", 0, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    cr_assert_eq(dp__utf8_valid(cases[i].s, cases[i].n), cases[i].valid, "case %zu", i);
}

Test(base, an_identifier_is_a_letter_or_underscore_then_letters_digits_or_underscores) {
  cr_assert_not(dp__is_identifier("", 0));
  cr_assert_not(dp__is_identifier("1a", 2));
  cr_assert(dp__is_identifier("a1", 2));
  cr_assert(dp__is_identifier("_", 1));
  cr_assert(dp__is_identifier("_x_9Z", 5));
  cr_assert_not(dp__is_identifier("a-b", 3));
  cr_assert_not(dp__is_identifier("a b", 3));
}

/* ---- the collector's leaf queue ---- */

/* A destroy callback that releases the values its object holds: two
 * customs with a destroy of their own and two tensors on storages with a
 * release callback, all queued while it runs. */
typedef struct fan {
  dp_value_t held[4];
} fan_t;
static void destroy_fan(void *obj) {
  fan_t *f = obj;
  for (int i = 0; i < 4; i++) dp_value_release(f->held[i]);
  free(f);
}
static const dp_type_t fan_type = {"Fan", NULL, destroy_fan};

Test(value, a_destroy_that_releases_several_customs_and_storages_runs_each_of_their_callbacks_once) {
  destroyed = 0;
  released_storages = 0;
  fan_t *f = malloc(sizeof *f);
  for (int i = 0; i < 2; i++) {
    OK(dp_custom_new(&counted_type, NULL, &f->held[i], T_ERR));
    dp_storage_t *s;
    OK(dp_storage_new(t_dev(DP_DEVICE_CUDA, 0), (void *)(uintptr_t)(0x1000 + 0x100 * i), 64, count_release, NULL,
                      &s, T_ERR));
    f->held[2 + i] = t_view(s, 4, 0);
    dp_storage_release(s);
  }
  dp_value_t c;
  OK(dp_custom_new(&fan_type, f, &c, T_ERR));
  dp_value_release(c);
  cr_assert_eq(destroyed, 2, "%d of the 2 queued destroys ran", destroyed);
  cr_assert_eq(released_storages, 2, "%d of the 2 queued release callbacks ran", released_storages);
  ASSERT_NO_LEAK();
}

/* A storage's release callback is told what it releases: its user data,
 * device, base and size, as the storage was made with them. */
static struct {
  void *ud;
  dp_device_t device;
  void *base;
  size_t nbytes;
} release_seen;
static void note_release(void *ud, dp_device_t d, void *base, size_t n) {
  release_seen.ud = ud;
  release_seen.device = d;
  release_seen.base = base;
  release_seen.nbytes = n;
}

Test(value, a_release_callback_is_given_the_storages_user_data_device_base_and_size) {
  static int ud;
  memset(&release_seen, 0, sizeof release_seen);
  dp_storage_t *s;
  OK(dp_storage_new(t_dev(DP_DEVICE_CUDA, 3), (void *)0x7000, 96, note_release, &ud, &s, T_ERR));
  dp_storage_release(s);
  cr_assert_eq(release_seen.ud, &ud);
  cr_assert(release_seen.device.type == DP_DEVICE_CUDA && release_seen.device.index == 3, "device %d:%d",
            release_seen.device.type, release_seen.device.index);
  cr_assert_eq(release_seen.base, (void *)0x7000);
  cr_assert_eq(release_seen.nbytes, 96);
  ASSERT_NO_LEAK();
}

/* value.h: a storage that cannot be made leaves its memory to the caller —
 * release is not called — for DP_ENOMEM as for DP_EINVAL; a later one made
 * with the same callback runs it once. */
Test(value, a_storage_that_cannot_be_allocated_leaves_its_memory_to_the_caller) {
  released_storages = 0;
  dp_storage_t *s = NULL;
  dp_error_t e;
  t_fail_at = t_alloc_count + 1;
  int rc = dp_storage_new(t_dev(DP_DEVICE_HOST, 0), (void *)0x1000, 64, count_release, NULL, &s, &e);
  t_fail_at = 0;
  cr_assert_eq(rc, DP_ENOMEM, "%s", dp_err_name(rc));
  cr_assert_eq(e.code, DP_ENOMEM);
  cr_assert(strstr(e.message, "out of memory") != NULL, "%s", e.message);
  cr_assert_eq(released_storages, 0, "the release callback ran for a storage that was never made");
  OK(dp_storage_new(t_dev(DP_DEVICE_HOST, 0), (void *)0x1000, 64, count_release, NULL, &s, T_ERR));
  dp_storage_release(s);
  cr_assert_eq(released_storages, 1);
  ASSERT_NO_LEAK();
}

/* value.h: equal values hash equal. Dicts and objects compare as mappings,
 * so two filled in opposite orders are equal and must hash alike, also
 * when the entry met first holds more nodes than the hash reads (256): a
 * hash that spent its budget on the first entry in insertion order would
 * read a different prefix of each. */
Test(value, equal_dicts_and_objects_filled_in_other_orders_hash_alike_whatever_the_first_entry_holds) {
  for (int big = 0; big < 2; big++) {
    size_t n = big ? 300 : 3;
    dp_value_t d[2], o[2];
    for (int k = 0; k < 2; k++) {
      OK(dp_dict_new(0, &d[k], T_ERR));
      o[k] = t_obj("Box");
    }
    for (int k = 0; k < 2; k++) {
      for (int step = 0; step < 2; step++) {
        int first = (step == 0) == (k == 0); /* k 0: the large entry first; k 1: last */
        dp_value_t l = t_list();
        for (size_t i = 0; first && i < n; i++) OK(dp_list_append(l, dp_int((int64_t)i), T_ERR));
        if (first) {
          OK(dp_dict_set(d[k], t_str("large"), l, T_ERR));
          OK(dp_object_set(o[k], "large", dp_value_retain(l), T_ERR));
        } else {
          dp_value_release(l);
          OK(dp_dict_set(d[k], t_str("small"), dp_int(7), T_ERR));
          OK(dp_object_set(o[k], "small", dp_int(7), T_ERR));
        }
      }
    }
    cr_assert_eq(dp_value_equal(d[0], d[1], 0, NULL), 1);
    cr_assert_eq(dp_value_hash(d[0]), dp_value_hash(d[1]), "dicts of a %zu-item entry", n);
    cr_assert_eq(dp_value_equal(o[0], o[1], 0, NULL), 1);
    cr_assert_eq(dp_value_hash(o[0]), dp_value_hash(o[1]), "objects of a %zu-item attribute", n);
    for (int k = 0; k < 2; k++) {
      dp_value_release(d[k]);
      dp_value_release(o[k]);
    }
  }
  ASSERT_NO_LEAK();
}

/* base.h, ERRORS AND NULL: a callback's negative return that is none of
 * the DP_E* codes is refused as a positive one is (DP_EINVAL, naming the
 * callback and what it returned); the backend code a callback gave is
 * kept, whether it wrote its message or left it to the library; the
 * offset is the call's (-1), whatever the callback stored. */
Test(base, a_callback_returning_no_code_is_refused_and_a_failure_keeps_the_callbacks_backend_code) {
  dp_error_t e;
  dp_error_clear(&e);
  cr_assert_eq(dp__cb_rc(-18, &e, "resolve"), DP_EINVAL);
  cr_assert_eq(e.code, DP_EINVAL);
  cr_assert_str_eq(e.message, "resolve returned -18: a callback returns 0 or a negative DP_E* code");
  cr_assert_eq(dp__cb_rc(INT32_MIN, NULL, "resolve"), DP_EINVAL);
  dp_error_clear(&e);
  e.backend_code = 700;
  e.offset = 99;
  cr_assert_eq(dp__cb_rc(DP_ECUDA, &e, "bind"), DP_ECUDA);
  cr_assert_eq(e.code, DP_ECUDA);
  cr_assert_eq(e.backend_code, 700, "the library's message dropped the callback's backend code");
  cr_assert_eq(e.offset, -1);
  cr_assert_str_eq(e.message, "bind failed: CUDA error");
  dp_error_clear(&e);
  e.backend_code = 2;
  e.offset = 99;
  snprintf(e.message, sizeof e.message, "cudaMalloc: out of memory");
  cr_assert_eq(dp__cb_rc(DP_ECUDA, &e, "bind"), DP_ECUDA);
  cr_assert_eq(e.backend_code, 2);
  cr_assert_eq(e.offset, -1);
  cr_assert_str_eq(e.message, "cudaMalloc: out of memory");
}

/* base.h: a buffer smaller than the text gets it cut and NUL-terminated,
 * as snprintf cuts (size 1: the empty string); a cpu device is "cpu"
 * whatever its index; the longest text, "unknown255:255", fits 16 bytes. */
Test(base, a_device_formatted_into_a_small_buffer_is_cut_as_snprintf_cuts_and_cpu_ignores_its_index) {
  char buf[32];
  memset(buf, 'x', sizeof buf);
  cr_assert_eq(dp_device_format(t_dev(DP_DEVICE_CUDA, 17), buf, 4), buf);
  cr_assert_str_eq(buf, "cud");
  cr_assert_eq(buf[4], 'x', "written past size");
  cr_assert_str_eq(dp_device_format(t_dev(DP_DEVICE_HOST, 3), buf, 1), "");
  cr_assert_str_eq(dp_device_format(t_dev(DP_DEVICE_CPU, 5), buf, sizeof buf), "cpu");
  cr_assert_str_eq(dp_device_format(t_dev(255, 255), buf, 16), "unknown255:255");
}

/* base.h: "Nothing here allocates" — not even a refusal whose message
 * quotes a long input. */
Test(base, nothing_in_base_h_allocates_not_even_a_refusal_quoting_a_long_input) {
  static char long_input[8192];
  memset(long_input, 'c', sizeof long_input - 1);
  memcpy(long_input, "cuda:", 5);
  long before = t_alloc_count;
  char buf[16];
  dp_device_t d;
  dp_error_t e;
  dp_error_clear(&e);
  cr_assert_eq(dp_version(), DP_VERSION_NUMBER);
  cr_assert_str_eq(dp_version_string(), DP_VERSION_STRING);
  cr_assert_str_eq(dp_strerror(DP_ETRUNC), "truncated input");
  cr_assert_str_eq(dp_err_name(DP_ETRUNC), "DP_ETRUNC");
  cr_assert_str_eq(dp_device_format(t_dev(DP_DEVICE_CUDA, 3), buf, sizeof buf), "cuda:3");
  OK_WITH(&e, dp_device_parse("host:7", &d, &e));
  cr_assert_eq(dp_device_parse(long_input, &d, &e), DP_EINVAL);
  cr_assert(strncmp(e.message, "dp_device_parse: 'cuda:ccc", 26) == 0, "%s", e.message);
  void *ud;
  cr_assert_not_null(dp_get_allocator(&ud));
  cr_assert_eq(t_alloc_count, before, "%ld allocations", t_alloc_count - before);
}

/* value.h's one rule: storing functions steal, even on failure — for
 * every refusal, not only the ones the older tests made with scalars
 * (which hold no reference, so a leak could not show). Each refusal here
 * gets a fresh reference to a list it must give back; tensors refused
 * release their storage; a custom refused destroys its obj. */
Test(value, every_storing_call_releases_what_it_was_given_on_every_refusal) {
  dp_value_t held = t_list(), obj = t_obj("Box"), tup, stand_in, d, l = t_list();
  OK(dp_tuple_new(1, &tup, T_ERR));
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_object_new_reduced("T", dp_none(), &stand_in, T_ERR));
  dp_value_t v;
  dp_error_t e;
  struct { const char *what; int rc; } r[] = {
      {"object_set NULL name", dp_object_set(obj, NULL, dp_value_retain(held), &e)},
      {"object_set empty name", dp_object_set(obj, "", dp_value_retain(held), &e)},
      {"object_set not an object", dp_object_set(d, "x", dp_value_retain(held), &e)},
      {"object_set stand-in", dp_object_set(stand_in, "x", dp_value_retain(held), &e)},
      {"new_reduced NULL name", dp_object_new_reduced(NULL, dp_value_retain(held), &v, &e)},
      {"new_reduced bad name", dp_object_new_reduced("\xff", dp_value_retain(held), &v, &e)},
      {"new_reduced NULL out", dp_object_new_reduced("T", dp_value_retain(held), NULL, &e)},
      {"append to a tuple", dp_list_append(tup, dp_value_retain(held), &e)},
      {"seq_set on a dict", dp_seq_set(d, 0, dp_value_retain(held), &e)},
      {"seq_set past an empty list", dp_seq_set(l, 0, dp_value_retain(held), &e)},
      {"dict_set unhashable key", dp_dict_set(d, dp_value_retain(held), dp_value_retain(held), &e)},
      {"dict_set into a list", dp_dict_set(l, t_str("k"), dp_value_retain(held), &e)},
  };
  for (size_t i = 0; i < sizeof r / sizeof *r; i++)
    cr_assert(r[i].rc == DP_EINVAL || r[i].rc == DP_ETYPE, "%s: %s", r[i].what, dp_err_name(r[i].rc));
  cr_assert_eq(dp_value_refcount(held), 1, "%u references left", dp_value_refcount(held));
  cr_assert_eq(dp_object_nattrs(obj), 0);
  cr_assert_eq(dp_seq_len(l), 0);
  cr_assert_eq(dp_dict_len(d), 0);
  /* a tensor refused releases its storage, whichever check refused it */
  released_storages = 0;
  int64_t shape[1] = {4}, min_stride[1] = {INT64_MIN}, big[1] = {1000};
  int n = 0;
#define REFUSED_TENSOR(dtype, nd, sh, st, out)                                                          \
  do {                                                                                                  \
    dp_storage_t *s_;                                                                                   \
    OK(dp_storage_new(t_dev(DP_DEVICE_CPU, 0), (void *)0x1000, 64, count_release, NULL, &s_, T_ERR));   \
    cr_assert_eq(dp_tensor_new(s_, dtype, nd, sh, st, 0, out, &e), DP_EINVAL, "%s", #dtype " " #nd);    \
    cr_assert_eq(released_storages, ++n, "%s, %d: the storage was not released", e.message, n);        \
  } while (0)
  REFUSED_TENSOR((dp_dtype_t)DP_DTYPE_COUNT, 1, shape, NULL, &v);
  REFUSED_TENSOR(DP_FLOAT32, -1, shape, NULL, &v);
  REFUSED_TENSOR(DP_FLOAT32, DP_TENSOR_MAX_DIMS + 1, shape, NULL, &v);
  REFUSED_TENSOR(DP_FLOAT32, 1, NULL, NULL, &v);
  REFUSED_TENSOR(DP_FLOAT32, 1, shape, NULL, NULL);
  REFUSED_TENSOR(DP_FLOAT32, 1, shape, min_stride, &v);
  REFUSED_TENSOR(DP_FLOAT32, 1, big, NULL, &v);
#undef REFUSED_TENSOR
  /* a custom refused for its out destroys its obj */
  destroyed = 0;
  cr_assert_eq(dp_custom_new(&counted_type, (void *)3, NULL, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_custom_new: NULL out");
  cr_assert_eq(destroyed, 1, "the obj of a custom refused for its NULL out was not destroyed");
  dp_value_release(held);
  dp_value_release(obj);
  dp_value_release(tup);
  dp_value_release(stand_in);
  dp_value_release(d);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* base.h, DP_ERROR_MSG_MAX: a message too long for dp_error_t that the
 * allocator hook gives no room to be formatted whole keeps only its
 * beginning, then "…" (one it gives room keeps its end too). */
Test(base, a_long_message_the_allocator_gives_no_room_keeps_only_its_beginning) {
  dp_error_t e;
  char *m = repeated("y", 3000);
  m[2999] = 'Z';
  t_fail_at = t_alloc_count + 1;
  dp__err(&e, DP_EIO, "%s", m);
  t_fail_at = 0;
  cr_assert_eq(e.code, DP_EIO);
  cr_assert_eq(strlen(e.message), DP_ERROR_MSG_MAX - 1);
  cr_assert_str_eq(e.message + DP_ERROR_MSG_MAX - 4, "\xe2\x80\xa6");
  cr_assert_null(strchr(e.message, 'Z'), "its end was kept without room to format it whole");
  dp__err(&e, DP_EIO, "%s", m);
  cr_assert_eq(e.message[DP_ERROR_MSG_MAX - 2], 'Z', "with room, its end is kept");
  dp__free(m, 3001);
  ASSERT_NO_LEAK();
}

/* A ring of n lists, each holding its index's parity and the next list. */
static dp_value_t ring_of_lists(int n, int odd_at) {
  dp_value_t first = t_list(), cur = first;
  for (int i = 0; i < n; i++) {
    OK(dp_list_append(cur, dp_int(i == odd_at), T_ERR));
    dp_value_t next = i + 1 < n ? t_list() : dp_value_retain(first);
    OK(dp_list_append(cur, next, T_ERR));
    cur = next;
  }
  return first;
}

Test(value, two_rings_of_coprime_lengths_compare_in_steps_linear_in_their_sizes_not_their_product) {
  extern _Thread_local uint64_t dp__eq_pairs_walked;
  dp_value_t a = ring_of_lists(1000, -1), b = ring_of_lists(1001, -1), c = ring_of_lists(1001, 500);
  dp__eq_pairs_walked = 0;
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1, "equal as trees: both unroll to the same infinite list");
  /* remembered pair by pair, the walk met all 1000 * 1001 pairs */
  cr_assert_leq(dp__eq_pairs_walked, 4 * 2001, "walked %llu pairs", (unsigned long long)dp__eq_pairs_walked);
  dp__eq_pairs_walked = 0;
  cr_assert_eq(dp_value_equal(a, c, 0, NULL), 0, "one node of c holds 1 where a holds 0");
  cr_assert_leq(dp__eq_pairs_walked, 4 * 2001, "walked %llu pairs", (unsigned long long)dp__eq_pairs_walked);
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 0, "rings of different lengths share differently");
  dp_value_t shared = t_list(), one = t_list(), two = t_list(), pair = t_list(), twice = t_list();
  OK(dp_list_append(shared, dp_int(1), T_ERR));
  OK(dp_list_append(one, dp_int(1), T_ERR));
  OK(dp_list_append(two, dp_int(2), T_ERR));
  OK(dp_list_append(pair, dp_value_retain(one), T_ERR));
  OK(dp_list_append(pair, dp_value_retain(two), T_ERR));
  OK(dp_list_append(twice, dp_value_retain(shared), T_ERR));
  OK(dp_list_append(twice, dp_value_retain(shared), T_ERR));
  cr_assert_eq(dp_value_equal(pair, twice, 0, NULL), 0, "a node assumed equal to one is not thereby equal to another");
  cr_assert_eq(dp_value_equal(twice, pair, 0, NULL), 0);
  dp_value_t v[] = {a, b, c, shared, one, two, pair, twice};
  for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) dp_value_release(v[i]);
  dp_value_collect();
  ASSERT_NO_LEAK();
}

Test(value, an_equality_without_sharing_that_runs_out_of_memory_says_so_through_err) {
  dp_value_t a = ring_of_lists(50, -1), b = ring_of_lists(51, -1);
  equal_fails_cleanly_until_it_succeeds(a, b, 0, 100, "the comparison's stack and node classes");
  dp_value_release(a);
  dp_value_release(b);
  dp_value_collect();
  ASSERT_NO_LEAK();
}

static int distinct_hashes(const uint64_t *h, int n) {
  int distinct = 0;
  for (int i = 0; i < n; i++) {
    int seen = 0;
    for (int j = 0; j < i && !seen; j++) seen = h[j] == h[i];
    distinct += !seen;
  }
  return distinct;
}

Test(value, dicts_and_objects_of_one_size_hash_apart_when_their_keys_names_or_values_differ) {
  /* they hashed their size only: a table keyed by dp_value_hash met every
   * dict of one entry as one chain */
  enum { N = 200 };
  uint64_t by_key[N], by_val[N], by_name[N], by_attr[N];
  for (int i = 0; i < N; i++) {
    dp_value_t d, e, o = t_obj("Box"), p = t_obj("Box");
    char name[16];
    snprintf(name, sizeof name, "a%d", i);
    OK(dp_dict_new(0, &d, T_ERR));
    OK(dp_dict_new(0, &e, T_ERR));
    OK(dp_dict_set(d, dp_int(i), dp_none(), T_ERR));
    OK(dp_dict_set(e, t_str("k"), dp_float(i), T_ERR));
    OK(dp_object_set(o, name, dp_none(), T_ERR));
    OK(dp_object_set(p, "a", t_str(name), T_ERR));
    by_key[i] = dp_value_hash(d);
    by_val[i] = dp_value_hash(e);
    by_name[i] = dp_value_hash(o);
    by_attr[i] = dp_value_hash(p);
    dp_value_release(d);
    dp_value_release(e);
    dp_value_release(o);
    dp_value_release(p);
  }
  cr_assert_eq(distinct_hashes(by_key, N), N, "dicts that differ in their key");
  cr_assert_eq(distinct_hashes(by_val, N), N, "dicts that differ in their value");
  cr_assert_eq(distinct_hashes(by_name, N), N, "objects that differ in an attribute's name");
  cr_assert_eq(distinct_hashes(by_attr, N), N, "objects that differ in an attribute's value");
  /* equal ones still hash alike, whatever their order, and one too large
   * for the budget hashes its size */
  for (int n = 2; n <= 200; n += 198) {
    dp_value_t d[2], o[2];
    for (int k = 0; k < 2; k++) {
      OK(dp_dict_new(0, &d[k], T_ERR));
      o[k] = t_obj("Box");
      for (int i = 0; i < n; i++) {
        int at = k ? n - 1 - i : i;
        char name[16];
        snprintf(name, sizeof name, "a%d", at);
        OK(dp_dict_set(d[k], dp_int(at), dp_int(at * 3), T_ERR));
        OK(dp_object_set(o[k], name, dp_int(at * 3), T_ERR));
      }
    }
    cr_assert_eq(dp_value_equal(d[0], d[1], 0, NULL), 1);
    cr_assert_eq(dp_value_hash(d[0]), dp_value_hash(d[1]), "dicts of %d entries", n);
    cr_assert_eq(dp_value_hash(o[0]), dp_value_hash(o[1]), "objects of %d attributes", n);
    for (int k = 0; k < 2; k++) {
      dp_value_release(d[k]);
      dp_value_release(o[k]);
    }
  }
  ASSERT_NO_LEAK();
}

Test(value, scalar_accessors_of_another_kind_give_false_zero_and_zero_point_zero) {
  /* they read the union whatever the kind: a str's address as an int, a
   * float's bits as an int, any nonzero word as true */
  dp_value_t s = t_str("text"), l = t_list();
  dp_value_t others[] = {dp_none(), dp_int(7), dp_float(2.5), dp_bool(true), s, l};
  for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
    dp_value_t v = others[i];
    const char *k = dp_kind_name(dp_value_kind(v));
    if (dp_value_kind(v) != DP_BOOL) cr_assert_eq(dp_value_as_bool(v), false, "as_bool of a %s", k);
    if (dp_value_kind(v) != DP_INT) cr_assert_eq(dp_value_as_int(v), 0, "as_int of a %s", k);
    if (dp_value_kind(v) != DP_FLOAT) cr_assert(dp_value_as_float(v) == 0.0, "as_float of a %s", k);
  }
  cr_assert_eq(dp_value_as_int(dp_int(-1)), -1);
  cr_assert(dp_value_as_bool(dp_bool(true)));
  cr_assert(dp_value_as_float(dp_float(-0.5)) == -0.5);
  dp_value_release(s);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* Runs retain() on a value (or storage) whose count is `count`, in a child
 * process; returns the signal that ended it (0: it exited) and its stderr. */
typedef struct {
  int storage;
  uint32_t count;
} retain_at_t;

static void retain_at(void *arg) {
  const retain_at_t *r = arg;
  dp_value_t l;
  dp_storage_t *s;
  if (r->storage) {
    if (dp_storage_new((dp_device_t){DP_DEVICE_CPU, 0}, NULL, 0, NULL, NULL, &s, NULL) != 0) _exit(3);
    atomic_store(&s->rc, r->count);
    dp_storage_retain(s);
    _exit(atomic_load(&s->rc) == r->count + 1 ? 0 : 4);
  }
  if (dp_list_new(0, &l, NULL) != 0) _exit(3);
  atomic_store(&l.u.h->rc, r->count);
  dp_value_retain(l);
  _exit(dp_value_refcount(l) == r->count + 1 ? 0 : 4);
}

static int retain_at_count_in_a_child(int storage, uint32_t count, char *msg, size_t cap) {
  retain_at_t r = {storage, count};
  return t_in_child(retain_at, &r, msg, cap);
}

Test(value, a_retain_of_a_value_or_storage_at_the_largest_count_aborts_instead_of_wrapping_to_zero) {
  /* the count wrapped to 0 and the next release freed what was held */
  char msg[512];
  cr_assert_eq(retain_at_count_in_a_child(0, UINT32_MAX - 1, msg, sizeof msg), 0, "one below the bound is counted");
  cr_assert_str_empty(msg);
  cr_assert_eq(retain_at_count_in_a_child(0, UINT32_MAX, msg, sizeof msg), SIGABRT);
  cr_assert_str_eq(msg, "devpickle: list retained while it held 4294967295 references (the most a 32-bit count "
                        "holds): aborting\n");
  cr_assert_eq(retain_at_count_in_a_child(1, UINT32_MAX - 1, msg, sizeof msg), 0);
  cr_assert_eq(retain_at_count_in_a_child(1, UINT32_MAX, msg, sizeof msg), SIGABRT);
  cr_assert_str_eq(msg, "devpickle: storage retained while it held 4294967295 references (the most a 32-bit "
                        "count holds): aborting\n");
}

Test(base, fit_keeps_a_message_one_byte_shorter_than_the_buffer_whole_and_cuts_one_of_its_size) {
  char dst[16];
  memset(dst, '#', sizeof dst);
  const char seven[] = "abcdefg\0Q";  /* a byte after the NUL that must not be copied */
  dp__fit(dst, 8, seven);
  cr_assert_str_eq(dst, "abcdefg");
  cr_assert_eq(dst[8], '#', "nothing is written past the message's NUL");
  memset(dst, '#', sizeof dst);
  dp__fit(dst, 8, "abcdefgh");
  cr_assert_str_eq(dst, "ab\xe2\x80\xa6gh", "a message of the buffer's size loses its middle");
  cr_assert_eq(dst[8], '#', "nothing is written past the buffer");
}

/* Refuses every block larger than a terabyte, after noting the largest size
 * asked: the sizes dp__grow computes near SIZE_MAX must reach it. */
static size_t g_largest_asked;
static void *refuse_huge(void *ud, void *ptr, size_t osize, size_t nsize) {
  if (nsize > g_largest_asked) g_largest_asked = nsize;
  if (nsize > ((size_t)1 << 40)) return NULL;
  return t_alloc(ud, ptr, osize, nsize);
}

Test(base, grow_asks_for_the_largest_capacity_whose_size_fits_and_refuses_the_next_without_asking) {
  /* with elements of SIZE_MAX / 8 bytes, 8 of them take SIZE_MAX - 7 bytes:
   * the allocator is asked (and says no); 16 would overflow, so nothing is asked */
  size_t size = SIZE_MAX / 8;
  dp_set_allocator(refuse_huge, NULL);
  char inl[1];
  for (int in = 0; in < 2; in++) {
    void *a = in ? (void *)inl : NULL;
    size_t cap = 0;
    g_largest_asked = 0;
    int rc = in ? dp__grow_inl(&a, &cap, 5, size, inl) : dp__grow(&a, &cap, 5, size);
    cr_assert_eq(rc, DP_ENOMEM);
    cr_assert_eq(g_largest_asked, 8 * size, "inline %d: asked %zu", in, g_largest_asked);
    g_largest_asked = 0;
    rc = in ? dp__grow_inl(&a, &cap, 9, size, inl) : dp__grow(&a, &cap, 9, size);
    cr_assert_eq(rc, DP_ENOMEM);
    cr_assert_eq(g_largest_asked, 0, "inline %d: a size that overflows is not asked for", in);
    cr_assert(cap == 0 && a == (in ? (void *)inl : NULL), "a refused growth keeps the array");
  }
  ASSERT_NO_LEAK();
}

Test(value, two_equal_values_of_many_nodes_compare_equal_with_sharing_however_their_addresses_hash) {
  /* the node bijection holds 300,000 nodes a side: many of them meet
   * others whose hash shares its top 16 bits (the table's tag) */
  enum { N = 300000 };
  dp_value_t v[2];
  for (int s = 0; s < 2; s++) {
    OK(dp_list_new(N, &v[s], T_ERR));
    for (int i = 0; i < N; i++) OK(dp_list_append(v[s], t_list(), T_ERR));
  }
  cr_assert_eq(dp_value_equal(v[0], v[1], DP_EQ_SHARING, NULL), 1);
  cr_assert_eq(dp_value_equal(v[0], v[1], 0, NULL), 1);
  dp_value_release(v[0]);
  dp_value_release(v[1]);
  ASSERT_NO_LEAK();
}

Test(value, dict_keys_that_hash_alike_but_differ_are_never_remembered_as_equal) {
  /* k2 is made to keep k1's hash: the two shared keys meet in one dict
   * pair (found unequal) and alone in the next, which must not take them for
   * a pair found equal before */
  dp_value_t k1 = t_str("one"), k2 = t_str("two");
  (void)dp_value_hash(k1);  /* k1 keeps its hash */
  dp__store_relaxed(&DP_STROBJ(k2)->hash, dp__load_relaxed(&DP_STROBJ(k1)->hash));
  dp_value_t xa, ya, xb, yb, a = t_list(), b = t_list();
  OK(dp_dict_new(0, &xa, T_ERR));
  OK(dp_dict_new(0, &ya, T_ERR));
  OK(dp_dict_new(0, &xb, T_ERR));
  OK(dp_dict_new(0, &yb, T_ERR));
  OK(dp_dict_set(xa, dp_value_retain(k1), dp_int(1), T_ERR));
  OK(dp_dict_set(xa, dp_value_retain(k2), dp_int(2), T_ERR));
  OK(dp_dict_set(ya, dp_value_retain(k2), dp_int(2), T_ERR));  /* met first when k1 is looked up */
  OK(dp_dict_set(ya, dp_value_retain(k1), dp_int(1), T_ERR));
  OK(dp_dict_set(xb, dp_value_retain(k1), dp_int(1), T_ERR));
  OK(dp_dict_set(yb, dp_value_retain(k2), dp_int(1), T_ERR));
  OK(dp_list_append(a, xa, T_ERR));
  OK(dp_list_append(a, xb, T_ERR));
  OK(dp_list_append(b, ya, T_ERR));
  OK(dp_list_append(b, yb, T_ERR));
  cr_assert_eq(dp_value_equal(xa, ya, 0, NULL), 1);
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0, "{'one': 1} and {'two': 1} are not equal");
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 0);
  dp_value_release(k1);
  dp_value_release(k2);
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

Test(base, a_failure_is_wrapped_in_the_calls_name_with_its_code_and_backend_code_kept) {
  dp_error_t e;
  dp__err(&e, DP_ECUDA, "cudaMalloc: out of memory");
  e.backend_code = 2;
  cr_assert_eq(dp__err_prefix(&e, DP_ECUDA, "dp_storage_new"), DP_ECUDA);
  cr_assert_str_eq(e.message, "dp_storage_new: cudaMalloc: out of memory");
  cr_assert(e.code == DP_ECUDA && e.backend_code == 2 && e.offset == -1);
  cr_assert_eq(dp__err_suffix(&e, DP_ECUDA, " at $.x"), DP_ECUDA);
  cr_assert_str_eq(e.message, "dp_storage_new: cudaMalloc: out of memory at $.x");
  cr_assert_eq(e.backend_code, 2);
  cr_assert_eq(dp__err_prefix(&e, 0, "unused"), 0, "a success is no failure to wrap");
  cr_assert_eq(dp__err_suffix(&e, 1, " unused"), 1);
  cr_assert_str_eq(e.message, "dp_storage_new: cudaMalloc: out of memory at $.x", "and leaves err alone");
  cr_assert_eq(dp__err_prefix(NULL, DP_EIO, "x"), DP_EIO, "a NULL err still gives the code back");
}

Test(base, an_array_is_asked_of_the_allocator_up_to_the_largest_size_that_fits) {
  dp_set_allocator(refuse_huge, NULL);
  g_largest_asked = 0;
  cr_assert_null(dp__alloc_array(SIZE_MAX / 16, 16));
  cr_assert_eq(g_largest_asked, SIZE_MAX / 16 * 16, "SIZE_MAX - 15 bytes fit: the allocator says no");
  g_largest_asked = 0;
  cr_assert_null(dp__alloc_array(SIZE_MAX / 16 + 1, 16));
  cr_assert_eq(g_largest_asked, 0, "one more overflows: nothing is asked");
  ASSERT_NO_LEAK();
}

Test(value, a_value_compared_with_itself_is_equal_at_its_root_without_walking_it) {
  extern _Thread_local uint64_t dp__eq_pairs_walked;
  dp_value_t l = t_list();
  for (int i = 0; i < 100; i++) OK(dp_list_append(l, t_list(), T_ERR));
  dp__eq_pairs_walked = 0;
  cr_assert_eq(dp_value_equal(l, l, 0, NULL), 1);
  cr_assert_eq(dp__eq_pairs_walked, 1);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* A list of n items, each an empty list (heap) or an int (a leaf), or a dict
 * of n entries keyed by a str of its own or by an int. */
static dp_value_t n_items(int n, int heap, int dict) {
  dp_value_t v;
  if (dict) OK(dp_dict_new(0, &v, T_ERR));
  else v = t_list();
  for (int i = 0; i < n; i++) {
    char k[16];
    snprintf(k, sizeof k, "k%d", i);
    dp_value_t item = heap ? t_list() : dp_int(i);
    if (!dict) OK(dp_list_append(v, item, T_ERR));
    else OK(dp_dict_set(v, heap ? t_str(k) : dp_int(i), item, T_ERR));
  }
  return v;
}

Test(value, trees_compare_with_their_stack_alone_unshared_nodes_and_keys_are_not_remembered) {
  /* a node (or a dict key) held once has one way in: its pair cannot be met
   * again, so comparing trees allocates what a list of ints of the same
   * length does (the stack), whatever their nodes */
  for (int dict = 0; dict < 2; dict++) {
    long asked[2];
    for (int heap = 0; heap < 2; heap++) {
      dp_value_t a = n_items(1000, heap, dict), b = n_items(1000, heap, dict);
      long before = t_alloc_count;
      cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1);
      asked[heap] = t_alloc_count - before;
      dp_value_release(a);
      dp_value_release(b);
    }
    cr_assert_eq(asked[1], asked[0], "%s: %ld allocations for heap nodes, %ld for ints", dict ? "dict" : "list",
                 asked[1], asked[0]);
  }
  ASSERT_NO_LEAK();
}

Test(value, an_equality_that_runs_out_of_memory_never_finds_values_that_differ_equal) {
  /* 16 items alike but one, in a list, a dict and an object: whichever
   * allocation fails (the stack grows at the 1st, 5th and 9th item pushed),
   * the answer is "not equal" or DP_ENOMEM, never "equal" */
  for (int shape = 0; shape < 3; shape++) {
    for (int odd = 0; odd < 16; odd++) {
      dp_value_t v[2];
      for (int s = 0; s < 2; s++) {
        if (shape == 0) v[s] = t_list();
        if (shape == 1) OK(dp_dict_new(0, &v[s], T_ERR));
        if (shape == 2) v[s] = t_obj("C");
        for (int i = 0; i < 16; i++) {
          dp_value_t item = dp_int(s && i == odd ? -1 : i);
          char name[16];
          snprintf(name, sizeof name, "a%d", i);
          if (shape == 0) OK(dp_list_append(v[s], item, T_ERR));
          if (shape == 1) OK(dp_dict_set(v[s], dp_int(i), item, T_ERR));
          if (shape == 2) OK(dp_object_set(v[s], name, item, T_ERR));
        }
      }
      for (unsigned flags = 0; flags < 2; flags++)
        for (long k = 1; k < 40; k++) {
          t_fail_at = t_alloc_count + k;
          int rc = dp_value_equal(v[0], v[1], flags, NULL);
          t_fail_at = 0;
          cr_assert(rc == 0 || rc == DP_ENOMEM, "shape %d, item %d, flags %u, allocation %ld: %d", shape, odd, flags,
                    k, rc);
        }
      dp_value_release(v[0]);
      dp_value_release(v[1]);
    }
  }
  ASSERT_NO_LEAK();
}

Test(base, only_the_negative_codes_of_the_table_are_codes_not_zero_nor_their_neighbours) {
  cr_assert_eq(dp__is_code(0), 0, "success is no error code");
  cr_assert_eq(dp__is_code(DP_EINVAL), 1);
  cr_assert_eq(dp__is_code(DP_ECANCELED), 1);
  cr_assert_eq(dp__is_code(DP_ECANCELED - 1), 0);
  cr_assert_eq(dp__is_code(1), 0);
}

Test(value, with_sharing_two_nodes_each_matched_to_another_are_no_pair_of_their_own) {
  /* [p, q, p] and [r, s, s]: p is r's and s is q's; the third pair (p, s)
   * finds both nodes matched already, each to another */
  dp_value_t p = t_list(), q = t_list(), r = t_list(), s = t_list(), a = t_list(), b = t_list();
  OK(dp_list_append(a, p, T_ERR));
  OK(dp_list_append(a, q, T_ERR));
  OK(dp_list_append(a, dp_value_retain(p), T_ERR));
  OK(dp_list_append(b, r, T_ERR));
  OK(dp_list_append(b, s, T_ERR));
  OK(dp_list_append(b, dp_value_retain(s), T_ERR));
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 0);
  cr_assert_eq(dp_value_equal(b, a, DP_EQ_SHARING, NULL), 0);
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1, "as trees they are equal");
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* Notes the osize of each call that allocates (ptr NULL, nsize > 0). */
static long g_hook_calls;
static size_t g_hook_osize;
static void *note_osize(void *ud, void *ptr, size_t osize, size_t nsize) {
  g_hook_calls++;
  if (!ptr) g_hook_osize = osize;
  return t_alloc(ud, ptr, osize, nsize);
}

Test(base, a_realloc_of_no_block_is_an_allocation_the_hook_sees_with_osize_zero) {
  dp_set_allocator(note_osize, NULL);
  g_hook_calls = 0;
  g_hook_osize = 99;
  void *p = dp__realloc(NULL, 32, 16);  /* a caller's stale size is not passed on */
  cr_assert_not_null(p);
  cr_assert_eq(g_hook_osize, 0);
  dp__free(p, 16);
  long calls = g_hook_calls;
  cr_assert_null(dp__realloc(NULL, 0, 0), "nothing to allocate");
  cr_assert_eq(g_hook_calls, calls, "and the hook is not called for it");
  ASSERT_NO_LEAK();
}

Test(base, a_refused_device_quotes_its_first_32_bytes_whole_even_when_each_is_escaped_to_six) {
  char s[41], want[300] = "dp_device_parse: '";
  memset(s, 1, 40);
  s[40] = '\0';
  for (int i = 0; i < 32; i++) strcat(want, "\\u0001");
  strcat(want, "\xe2\x80\xa6' is not a device (cpu, cuda:N or host:N, N 0..255)");
  dp_device_t d;
  dp_error_t e;
  cr_assert_eq(dp_device_parse(s, &d, &e), DP_EINVAL);
  cr_assert_str_eq(e.message, want);
}

Test(base, the_default_allocator_gives_one_byte_and_nothing_for_zero) {
  dp_set_allocator(NULL, NULL);
  dp_alloc_fn fn = dp_get_allocator(NULL);
  char *p = fn(NULL, NULL, 0, 1);
  cr_assert_not_null(p, "one byte is an allocation");
  *p = 'x';
  cr_assert_null(fn(NULL, p, 1, 0));
  cr_assert_null(fn(NULL, NULL, 0, 0), "nsize 0 with no block: nothing, not malloc(0)'s block");
}

Test(base, grow_inl_copies_out_to_the_need_when_it_is_a_power_of_two_not_past_it) {
  int inl[4] = {1, 2, 3, 4};
  int *a = inl;
  size_t cap = 4;
  OK(dp__grow_inl((void **)&a, &cap, 8, sizeof *a, inl));
  cr_assert_eq(cap, 8);
  dp__free(a, cap * sizeof *a);
  ASSERT_NO_LEAK();
}

Test(value, a_str_key_and_a_bytes_key_that_hash_alike_are_different_keys) {
  dp_value_t s = t_str("k"), by, a, b;
  OK(dp_bytes_new("k", 1, &by, T_ERR));
  (void)dp_value_hash(s);  /* s keeps its hash; the bytes are made to keep it too */
  dp__store_relaxed(&DP_STROBJ(by)->hash, dp__load_relaxed(&DP_STROBJ(s)->hash));
  OK(dp_dict_new(0, &a, T_ERR));
  OK(dp_dict_new(0, &b, T_ERR));
  OK(dp_dict_set(a, s, dp_int(1), T_ERR));
  OK(dp_dict_set(b, by, dp_int(1), T_ERR));
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0);
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 0);
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

Test(base, fit_never_splits_a_character_even_when_nothing_of_the_beginning_is_left) {
  char dst[8];
  /* four 3-byte euro signs into 8 bytes: 2 bytes are left for each side,
   * too few for one whole character */
  dp__fit(dst, sizeof dst, "\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac");
  cr_assert_str_eq(dst, "\xe2\x80\xa6");
}

Test(value, a_key_shared_on_one_side_only_is_compared_once_however_often_its_dict_is_met) {
  /* 200 dicts keyed by one 100 kB str against one dict, keyed by a str of its
   * own, listed 200 times: the pair of keys is met 200 times */
  enum { LEN = 100000, DICTS = 200 };
  char *text = malloc(LEN);
  memset(text, 'k', LEN);
  dp_value_t s, s2, a = t_list(), b = t_list(), d = t_dict();
  OK(dp_str_new(text, LEN, &s, T_ERR));
  OK(dp_str_new(text, LEN, &s2, T_ERR));
  free(text);
  OK(dp_dict_set(d, s2, dp_int(0), T_ERR));
  for (int i = 0; i < DICTS; i++) {
    dp_value_t x = t_dict();
    OK(dp_dict_set(x, dp_value_retain(s), dp_int(0), T_ERR));
    OK(dp_list_append(a, x, T_ERR));
    OK(dp_list_append(b, dp_value_retain(d), T_ERR));
  }
  dp__key_bytes_compared = 0;
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 1);
  cr_assert_leq(dp__key_bytes_compared, 2 * LEN, "%llu key bytes compared", (unsigned long long)dp__key_bytes_compared);
  dp_value_release(s);
  dp_value_release(d);
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

Test(value, with_sharing_an_equality_that_runs_out_of_memory_never_takes_two_nodes_for_one) {
  /* [f, f, f, p, q] and [g, g, g, r, r], the f and g all of their own: r's
   * match, once refused a place in the bijection (whose arrays grow at the
   * fifth node), must not be forgotten, or q would match r as well */
  dp_value_t p = t_list(), q = t_list(), r = t_list(), a = t_list(), b = t_list();
  for (int i = 0; i < 3; i++) {
    OK(dp_list_append(a, t_list(), T_ERR));
    OK(dp_list_append(b, t_list(), T_ERR));
  }
  OK(dp_list_append(a, p, T_ERR));
  OK(dp_list_append(a, q, T_ERR));
  OK(dp_list_append(b, r, T_ERR));
  OK(dp_list_append(b, dp_value_retain(r), T_ERR));
  for (int dir = 0; dir < 2; dir++)
    for (long k = 1; k < 40; k++) {
      t_fail_at = t_alloc_count + k;
      int rc = dir ? dp_value_equal(b, a, DP_EQ_SHARING, NULL) : dp_value_equal(a, b, DP_EQ_SHARING, NULL);
      t_fail_at = 0;
      cr_assert(rc == 0 || rc == DP_ENOMEM, "direction %d, allocation %ld: %d", dir, k, rc);
    }
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

Test(value, a_dict_holding_all_of_anothers_entries_and_one_more_is_not_equal_to_it) {
  dp_value_t a = t_dict(), b = t_dict();
  OK(dp_dict_set(a, dp_int(1), dp_int(1), T_ERR));
  OK(dp_dict_set(b, dp_int(1), dp_int(1), T_ERR));
  OK(dp_dict_set(b, dp_int(2), dp_int(2), T_ERR));
  for (unsigned flags = 0; flags <= DP_EQ_SHARING; flags++) {
    cr_assert_eq(dp_value_equal(a, b, flags, NULL), 0, "flags %u", flags);
    cr_assert_eq(dp_value_equal(b, a, flags, NULL), 0, "flags %u", flags);
  }
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

Test(base, a_callback_message_filling_the_buffer_loses_only_its_last_byte_and_a_wrapped_one_keeps_its_end) {
  dp_error_t e;
  dp_error_clear(&e);
  memset(e.message, 'x', sizeof e.message);  /* as strncpy leaves it: no NUL */
  cr_assert_eq(dp__cb_rc(DP_EIO, &e, "bind"), DP_EIO);
  cr_assert_eq(strlen(e.message), DP_ERROR_MSG_MAX - 1);
  e.message[DP_ERROR_MSG_MAX - 2] = 'Z';
  cr_assert_eq(dp__err_suffix(&e, DP_EIO, ""), DP_EIO);
  cr_assert_eq(strlen(e.message), DP_ERROR_MSG_MAX - 1);
  cr_assert_eq(e.message[DP_ERROR_MSG_MAX - 2], 'Z', "a message of 2,047 bytes is wrapped whole");
}

Test(value, a_dict_key_met_twice_is_compared_once_whichever_side_holds_it_twice) {
  /* [x1, x2], both keyed by one str k (two references), against [d, d], d
   * keyed by a str of its own: the pair (k, d's key) is met twice */
  enum { LEN = 100000 };
  char *text = malloc(LEN);
  memset(text, 'k', LEN);
  dp_value_t k, k2, a = t_list(), b = t_list(), d = t_dict();
  OK(dp_str_new(text, LEN, &k, T_ERR));
  OK(dp_str_new(text, LEN, &k2, T_ERR));
  free(text);
  OK(dp_dict_set(d, k2, dp_int(0), T_ERR));
  for (int i = 0; i < 2; i++) {
    dp_value_t x = t_dict();
    OK(dp_dict_set(x, i ? k : dp_value_retain(k), dp_int(0), T_ERR));
    OK(dp_list_append(a, x, T_ERR));
    OK(dp_list_append(b, dp_value_retain(d), T_ERR));
  }
  dp_value_release(d);
  for (int dir = 0; dir < 2; dir++) {
    dp__key_bytes_compared = 0;
    cr_assert_eq(dir ? dp_value_equal(b, a, 0, NULL) : dp_value_equal(a, b, 0, NULL), 1);
    cr_assert_eq(dp__key_bytes_compared, LEN, "direction %d: %llu key bytes compared", dir,
                 (unsigned long long)dp__key_bytes_compared);
  }
  /* one key node in both: nothing to compare */
  dp_value_t y = t_dict(), z = t_dict(), s = t_str("shared");
  OK(dp_dict_set(y, dp_value_retain(s), dp_int(0), T_ERR));
  OK(dp_dict_set(z, s, dp_int(0), T_ERR));
  dp__key_bytes_compared = 0;
  cr_assert_eq(dp_value_equal(y, z, 0, NULL), 1);
  cr_assert_eq(dp__key_bytes_compared, 0);
  dp_value_release(y);
  dp_value_release(z);
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* Tuple keys of different lengths whose kept words (and so dict hashes)
 * collide are met by key_same: they differ by their lengths alone, here
 * (1,) and (1, 2), whose first items are equal. */
Test(value, tuple_keys_that_hash_alike_but_differ_in_length_are_different_keys) {
  dp_value_t k1, k2, x = t_dict(), y = t_dict();
  OK(dp_tuple_new(1, &k1, T_ERR));
  OK(dp_seq_set(k1, 0, dp_int(1), T_ERR));
  k2 = t_pair(dp_int(1), dp_int(2));
  OK(dp_dict_set(y, k1, dp_int(0), T_ERR)); /* k1 keeps its word */
  dp__store_relaxed(&DP_SEQ(k2)->key, dp__key_word(k1)); /* k2 is made to keep it too */
  OK(dp_dict_set(x, k2, dp_int(0), T_ERR));
  cr_assert_eq(dp_value_equal(x, y, 0, NULL), 0, "{(1, 2): 0} and {(1,): 0} are not equal");
  cr_assert_eq(dp_value_equal(x, y, DP_EQ_SHARING, NULL), 0);
  dp_value_release(x);
  dp_value_release(y);
  ASSERT_NO_LEAK();
}

/* A shared node met earlier marks only the pairs below it: a later sibling
 * tree, reached without passing a shared node, is compared with the stack
 * alone again, allocating what a list of ints of its length does. */
Test(value, a_tree_compared_after_a_shared_sibling_is_compared_with_the_stack_alone) {
  long asked[2];
  for (int heap = 0; heap < 2; heap++) {
    dp_value_t v[2];
    for (int s = 0; s < 2; s++) {
      dp_value_t shared = t_list();
      v[s] = t_list();
      OK(dp_list_append(v[s], dp_value_retain(shared), T_ERR));
      OK(dp_list_append(v[s], shared, T_ERR));
      OK(dp_list_append(v[s], n_items(1000, heap, 0), T_ERR));
    }
    long before = t_alloc_count;
    cr_assert_eq(dp_value_equal(v[0], v[1], 0, NULL), 1);
    asked[heap] = t_alloc_count - before;
    dp_value_release(v[0]);
    dp_value_release(v[1]);
  }
  cr_assert_eq(asked[1], asked[0], "%ld allocations for heap nodes, %ld for ints", asked[1], asked[0]);
  ASSERT_NO_LEAK();
}

/* Items of tuple keys met by key_same that keep hashes which differ are
 * found unequal by those hashes, without reading their bytes: here the
 * tuples' words are made to collide, and their str items differ. */
Test(value, str_items_of_tuple_keys_known_to_differ_by_their_kept_hashes_are_not_read) {
  enum { LEN = 1000 };
  char text[LEN];
  memset(text, 's', LEN);
  dp_value_t s1, s2, x = t_dict(), y = t_dict();
  OK(dp_str_new(text, LEN, &s1, T_ERR));
  text[0] = 't';
  OK(dp_str_new(text, LEN, &s2, T_ERR));
  dp_value_t k1 = t_pair(s1, dp_int(0)), k2 = t_pair(s2, dp_int(0));
  OK(dp_dict_set(y, k1, dp_int(0), T_ERR));
  dp__store_relaxed(&DP_SEQ(k2)->key, dp__key_word(k1));
  OK(dp_dict_set(x, k2, dp_int(0), T_ERR));
  (void)dp_value_hash(s2); /* s2 keeps its hash, as s1 does */
  cr_assert(dp__load_relaxed(&DP_STROBJ(s1)->hash) && dp__load_relaxed(&DP_STROBJ(s2)->hash));
  dp__key_bytes_compared = 0;
  cr_assert_eq(dp_value_equal(x, y, 0, NULL), 0);
  cr_assert_eq(dp__key_bytes_compared, 0, "%llu key bytes compared", (unsigned long long)dp__key_bytes_compared);
  dp_value_release(x);
  dp_value_release(y);
  ASSERT_NO_LEAK();
}

/* Strs and bytes are compared by their contents wherever they are met: at
 * the root, or as items, held once or shared, with or without sharing. */
Test(value, strs_and_bytes_of_different_contents_compare_unequal_as_items_too) {
  for (int bytes = 0; bytes < 2; bytes++) {
    dp_value_t x, y;
    if (bytes) {
      OK(dp_bytes_new("abc", 3, &x, T_ERR));
      OK(dp_bytes_new("abd", 3, &y, T_ERR));
    } else {
      x = t_str("abc");
      y = t_str("abd");
    }
    dp_value_t a = t_list(), b = t_list();
    OK(dp_list_append(a, dp_value_retain(x), T_ERR));
    OK(dp_list_append(b, dp_value_retain(y), T_ERR));
    for (unsigned flags = 0; flags <= DP_EQ_SHARING; flags += DP_EQ_SHARING) {
      cr_assert_eq(dp_value_equal(x, y, flags, NULL), 0, "%s at the root, flags %u", bytes ? "bytes" : "str", flags);
      cr_assert_eq(dp_value_equal(a, b, flags, NULL), 0, "%s as an item, flags %u", bytes ? "bytes" : "str", flags);
    }
    OK(dp_list_append(a, x, T_ERR)); /* now shared */
    OK(dp_list_append(b, y, T_ERR));
    cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0, "%s shared", bytes ? "bytes" : "str");
    dp_value_release(a);
    dp_value_release(b);
  }
  ASSERT_NO_LEAK();
}

/* The same with tuple keys of one length whose items are leaves that
 * differ, (1, 2) and (1, 3): the leaves are compared by value. */
Test(value, tuple_keys_that_hash_alike_but_differ_in_a_leaf_item_are_different_keys) {
  dp_value_t k1 = t_pair(dp_int(1), dp_int(2)), k2 = t_pair(dp_int(1), dp_int(3)), x = t_dict(), y = t_dict();
  OK(dp_dict_set(y, k1, dp_int(0), T_ERR));
  dp__store_relaxed(&DP_SEQ(k2)->key, dp__key_word(k1));
  OK(dp_dict_set(x, k2, dp_int(0), T_ERR));
  cr_assert_eq(dp_value_equal(x, y, 0, NULL), 0, "{(1, 3): 0} and {(1, 2): 0} are not equal");
  cr_assert_eq(dp_value_equal(x, y, DP_EQ_SHARING, NULL), 0);
  dp_value_release(x);
  dp_value_release(y);
  ASSERT_NO_LEAK();
}

/* A shared key found equal to one key is remembered as that pair only: met
 * next with another key that keeps the same hash but differs, it is
 * compared again, and found different. */
Test(value, a_shared_key_found_equal_to_one_key_is_not_taken_for_equal_to_another) {
  dp_value_t shared = t_str("one"), same = t_str("one"), other = t_str("two");
  (void)dp_value_hash(shared); /* shared keeps its hash; other is made to keep it too */
  dp__store_relaxed(&DP_STROBJ(other)->hash, dp__load_relaxed(&DP_STROBJ(shared)->hash));
  dp_value_t a = t_list(), b = t_list();
  dp_value_t keys[2] = {same, other};
  for (int i = 0; i < 2; i++) {
    dp_value_t x = t_dict(), y = t_dict();
    OK(dp_dict_set(x, keys[i], dp_int(0), T_ERR));
    OK(dp_dict_set(y, dp_value_retain(shared), dp_int(0), T_ERR));
    OK(dp_list_append(a, x, T_ERR));
    OK(dp_list_append(b, y, T_ERR));
  }
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0, "[{'one': 0}, {'two': 0}] and [{'one': 0}, {'one': 0}] differ");
  cr_assert_eq(dp_value_equal(a, b, DP_EQ_SHARING, NULL), 0);
  dp_value_release(shared);
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* Tensors of different ranks are different even where the dims of the
 * lesser rank begin those of the greater: [4] (shape 4, stride 1) and
 * [4, 1] (shape 4, 1, strides 1, 1) on one storage. */
Test(value, tensors_of_different_ranks_compare_unequal_whatever_their_leading_dims) {
  dp_storage_t *s = t_storage(t_dev(DP_DEVICE_CPU, 0), 0x1000, 64);
  dp_value_t x, y;
  OK(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 1, (int64_t[]){4}, (int64_t[]){1}, 0, &x, T_ERR));
  OK(dp_tensor_new(dp_storage_retain(s), DP_FLOAT32, 2, (int64_t[]){4, 1}, (int64_t[]){1, 1}, 0, &y, T_ERR));
  dp_storage_release(s);
  for (unsigned flags = 0; flags <= DP_EQ_SHARING; flags += DP_EQ_SHARING) {
    cr_assert_eq(dp_value_equal(x, y, flags, NULL), 0, "flags %u: [4] and [4, 1]", flags);
    cr_assert_eq(dp_value_equal(y, x, flags, NULL), 0, "flags %u: [4, 1] and [4]", flags);
  }
  dp_value_release(x);
  dp_value_release(y);
  ASSERT_NO_LEAK();
}

/* ---- keys and hashes at their bounds ---- */

/* A tuple whose kept word spends the last of a key's 1,024 nodes is
 * hashable: 23 nones, then a 1,000-node tuple that keys a dict already. */
Test(value, a_kept_tuple_that_spends_the_last_of_a_keys_1024_nodes_leaves_the_key_hashable) {
  dp_value_t big, d = t_dict(), t;
  OK(dp_tuple_new(999, &big, T_ERR));
  for (int i = 0; i < 999; i++) OK(dp_seq_set(big, (size_t)i, dp_int(i), T_ERR));
  OK(dp_dict_set(d, dp_value_retain(big), dp_int(1), T_ERR));
  OK(dp_tuple_new(24, &t, T_ERR)); /* itself, 23 nones, big's 1,000 last */
  OK(dp_seq_set(t, 23, dp_value_retain(big), T_ERR));
  cr_assert(dp_value_is_hashable(t), "1 + 23 + 1,000 = 1,024 nodes");
  OK(dp_dict_set(d, dp_value_retain(t), dp_int(2), T_ERR));
  dp_value_t got;
  OK(dp_dict_get(d, t, &got, T_ERR));
  cr_assert_eq(dp_value_as_int(got), 2);
  dp_value_release(t);
  dp_value_release(big);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* An empty tuple can be a key's 1,024th node: 1,022 ints and () in a
 * tuple is hashable; one int more is not. */
Test(value, an_empty_tuple_as_a_keys_1024th_node_leaves_it_hashable) {
  for (int extra = 0; extra < 2; extra++) {
    dp_value_t t, empty;
    size_t n = 1023 + (size_t)extra;
    OK(dp_tuple_new(n, &t, T_ERR));
    for (size_t i = 0; i + 1 < n; i++) OK(dp_seq_set(t, i, dp_int((int64_t)i), T_ERR));
    OK(dp_tuple_new(0, &empty, T_ERR));
    OK(dp_seq_set(t, n - 1, empty, T_ERR));
    cr_assert_eq(dp_value_is_hashable(t), !extra, "%zu nodes", n + 1);
    dp_value_release(t);
  }
  ASSERT_NO_LEAK();
}

/* A tuple that keys a dict already is walked as one node (its kept word)
 * when it keys another: nothing more is walked to keep it again. */
Test(value, keying_another_dict_with_a_kept_tuple_walks_exactly_one_node) {
  dp_value_t k, d0 = t_dict(), d1 = t_dict();
  OK(dp_tuple_new(3, &k, T_ERR));
  for (int i = 0; i < 3; i++) OK(dp_seq_set(k, (size_t)i, dp_int(i), T_ERR));
  uint64_t before = dp__key_nodes_walked;
  OK(dp_dict_set(d0, dp_value_retain(k), dp_int(0), T_ERR));
  cr_assert_eq(dp__key_nodes_walked - before, 8, "hashed (4 nodes), then kept (4 nodes)");
  before = dp__key_nodes_walked;
  OK(dp_dict_set(d1, dp_value_retain(k), dp_int(1), T_ERR));
  cr_assert_eq(dp__key_nodes_walked - before, 1, "%llu nodes walked", (unsigned long long)(dp__key_nodes_walked - before));
  dp_value_release(k);
  dp_value_release(d0);
  dp_value_release(d1);
  ASSERT_NO_LEAK();
}

/* A list's hash stops at its budget: items past the 256th node, of any
 * kind, are not read (a list of 300 ints and one whose last 45 items are
 * strs hash alike). */
Test(value, a_lists_items_past_the_hash_budget_do_not_count_whatever_their_kind) {
  dp_value_t a, b;
  OK(dp_list_new(300, &a, T_ERR));
  OK(dp_list_new(300, &b, T_ERR));
  for (int i = 0; i < 300; i++) {
    OK(dp_list_append(a, dp_int(0), T_ERR));
    OK(dp_list_append(b, i < 255 ? dp_int(0) : t_str("s"), T_ERR));
  }
  cr_assert_eq(dp_value_equal(a, b, 0, NULL), 0);
  cr_assert_eq(dp_value_hash(a), dp_value_hash(b), "an item past the budget was read");
  dp_value_release(a);
  dp_value_release(b);
  ASSERT_NO_LEAK();
}

/* A dict or an object whose entries just fit the budget (the root is one
 * node, each entry two: 127 of them in the 255 left) hashes its values:
 * two that differ in one value hash apart. */
Test(value, a_dict_or_object_whose_entries_just_fit_the_hash_budget_hashes_its_values) {
  dp_value_t d[2], o[2];
  for (int k = 0; k < 2; k++) {
    d[k] = t_dict();
    o[k] = t_obj("C");
    for (int i = 0; i < 127; i++) {
      char name[16];
      snprintf(name, sizeof name, "a%d", i);
      OK(dp_dict_set(d[k], dp_int(i), dp_int(i == 126 ? k : 0), T_ERR));
      OK(dp_object_set(o[k], name, dp_int(i == 126 ? k : 0), T_ERR));
    }
  }
  cr_assert_neq(dp_value_hash(d[0]), dp_value_hash(d[1]), "a dict of 127 entries hashed its size only");
  cr_assert_neq(dp_value_hash(o[0]), dp_value_hash(o[1]), "an object of 127 attributes hashed its size only");
  for (int k = 0; k < 2; k++) {
    dp_value_release(d[k]);
    dp_value_release(o[k]);
  }
  ASSERT_NO_LEAK();
}

/* Looking a str key up by an equal str of its own compares the two keys'
 * bytes once, and counts them. */
Test(value, a_str_key_found_by_an_equal_str_compares_and_counts_its_bytes_once) {
  dp_value_t d = t_dict(), probe = t_str("a key of 20 bytes...");
  OK(dp_dict_set(d, t_str("a key of 20 bytes..."), dp_int(7), T_ERR));
  dp__key_bytes_compared = 0;
  dp_value_t got;
  OK(dp_dict_get(d, probe, &got, T_ERR));
  cr_assert_eq(dp_value_as_int(got), 7);
  cr_assert_eq(dp__key_bytes_compared, 20, "%llu key bytes compared", (unsigned long long)dp__key_bytes_compared);
  dp_value_release(probe);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* Setting a dict key that is there already replaces its value: the old
 * value's reference (and the key given again) are released. */
Test(value, replacing_a_dict_value_releases_the_old_value_and_the_key_given_again) {
  dp_value_t d = t_dict(), key = t_str("k"), old = t_str("old");
  OK(dp_dict_set(d, dp_value_retain(key), dp_value_retain(old), T_ERR));
  cr_assert_eq(dp_value_refcount(old), 2);
  cr_assert_eq(dp_value_refcount(key), 2);
  dp_value_t again = t_str("k");
  OK(dp_dict_set(d, dp_value_retain(again), t_str("new"), T_ERR));
  cr_assert_eq(dp_value_refcount(old), 1, "the dict let its reference to the old value go");
  cr_assert_eq(dp_value_refcount(again), 1, "the key given again is released: the dict keeps its first");
  cr_assert_eq(dp_value_refcount(key), 2);
  dp_value_t got;
  OK(dp_dict_get(d, key, &got, T_ERR));
  cr_assert_str_eq(dp_str_data(got, NULL), "new");
  dp_value_release(again);
  dp_value_release(old);
  dp_value_release(key);
  dp_value_release(d);
  ASSERT_NO_LEAK();
}

/* A storage made by dp_storage_new is the caller's memory, never one a
 * frame named (foreign), whatever its memory held before: an inline pickle
 * reads it through the read callback. */
Test(value, a_new_storage_is_read_as_the_callers_memory_whatever_its_allocation_held) {
  dp_set_allocator(t_alloc_filled, NULL);
  static const uint8_t bytes[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  dp_storage_t *s;
  dp_device_t cpu = {DP_DEVICE_CPU, 0};
  OK(dp_storage_new(cpu, (void *)bytes, sizeof bytes, NULL, NULL, &s, T_ERR));
  cr_assert_null(dp_storage_host_data(s));
  int64_t shape[1] = {16};
  dp_value_t t;
  OK(dp_tensor_new(s, DP_UINT8, 1, shape, NULL, 0, &t, T_ERR));
  dp_frame_t *f;
  OK(dp_frame_new(&f, T_ERR));
  dp_pickle_opts_t o = {DP_PICKLE_INLINE, 0, NULL, NULL};
  OK(dp_pickle(t, &o, f, T_ERR));
  dp_frame_free(f);
  dp_value_release(t);
  ASSERT_NO_LEAK();
}

/* Setting an attribute on a value that is no object says so, whatever the
 * name (an empty one included), and releases the value it was given. */
Test(value, setting_an_attribute_with_an_empty_name_on_a_list_says_it_is_no_object) {
  dp_value_t l = t_list(), v = t_str("v");
  dp_error_t e;
  cr_assert_eq(dp_object_set(l, "", dp_value_retain(v), &e), DP_EINVAL);
  cr_assert_str_eq(e.message, "dp_object_set: expected object, got list");
  cr_assert_eq(dp_value_refcount(v), 1);
  dp_value_release(v);
  dp_value_release(l);
  ASSERT_NO_LEAK();
}

/* Attribute names of 15, 16 and 17 bytes (either side of the inline room)
 * are kept whole, found by name and listed by position. */
Test(value, attribute_names_either_side_of_the_inline_room_are_kept_whole) {
  static const char *names[] = {"abcdefghijklmno", "abcdefghijklmnop", "abcdefghijklmnopq"};
  dp_value_t o = t_obj("C");
  for (int i = 1; i < 3; i++) { /* out of memory for the copy of a name too long to keep inline */
    dp_error_t e;
    dp_value_t lost = t_str("lost");
    t_fail_at = t_alloc_count + 1;
    int rc = dp_object_set(o, names[i], lost, &e);
    t_fail_at = 0;
    cr_assert_eq(rc, DP_ENOMEM, "a %zu-byte name", strlen(names[i]));
    cr_assert_str_eq(e.message, "out of memory allocating object attributes");
    cr_assert_eq(dp_object_nattrs(o), 0);
  }
  for (int i = 0; i < 3; i++) OK(dp_object_set(o, names[i], dp_int(i), T_ERR));
  for (int i = 0; i < 3; i++) {
    dp_value_t v;
    const char *name;
    OK(dp_object_get(o, names[i], &v, T_ERR));
    cr_assert_eq(dp_value_as_int(v), i);
    OK(dp_object_attr(o, (size_t)i, &name, &v, T_ERR));
    cr_assert_str_eq(name, names[i]);
    cr_assert_eq(dp_value_as_int(v), i);
  }
  dp_value_release(o);
  ASSERT_NO_LEAK();
}

/* A dict's entries cost the hash two nodes each: in a list holding a dict
 * of 100 entries (201 nodes) and then ints, the ints from the 55th on lie
 * past the 256 nodes read, and lists that differ only there hash alike. */
Test(value, a_dicts_entries_spend_two_nodes_each_of_the_hash_budget) {
  dp_value_t l[2];
  for (int k = 0; k < 2; k++) {
    dp_value_t d = t_dict();
    for (int i = 0; i < 100; i++) OK(dp_dict_set(d, dp_int(i), dp_int(i), T_ERR));
    l[k] = t_list();
    OK(dp_list_append(l[k], d, T_ERR));
    for (int i = 1; i <= 150; i++) OK(dp_list_append(l[k], dp_int(k && i == 100), T_ERR));
  }
  cr_assert_eq(dp_value_hash(l[0]), dp_value_hash(l[1]), "the 100th int was read");
  dp_value_t m = t_list(); /* the 54th int is read */
  OK(dp_list_append(m, dp_value_retain(dp_seq_get(l[0], 0)), T_ERR));
  for (int i = 1; i <= 150; i++) OK(dp_list_append(m, dp_int(i == 54), T_ERR));
  cr_assert_neq(dp_value_hash(l[0]), dp_value_hash(m), "the 54th int was not read");
  dp_value_release(m);
  dp_value_release(l[0]);
  dp_value_release(l[1]);
  ASSERT_NO_LEAK();
}
