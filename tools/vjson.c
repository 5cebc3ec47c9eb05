/* tools/vjson.c — value JSON <-> values, through jansson and the public API. */
#include "vjson.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- base64 (RFC 4648, with padding) ---- */

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *vjson_b64_encode(const uint8_t *p, size_t n) {
  char *s = malloc((n + 2) / 3 * 4 + 1), *o = s;
  if (!s) return NULL;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
    *o++ = b64[v >> 18];
    *o++ = b64[(v >> 12) & 63];
    *o++ = i + 1 < n ? b64[(v >> 6) & 63] : '=';
    *o++ = i + 2 < n ? b64[v & 63] : '=';
  }
  *o = '\0';
  return s;
}

int vjson_b64_decode(const char *s, uint8_t **out, size_t *n) {
  size_t len = strlen(s);
  if (len % 4) return -1;
  uint8_t *p = malloc(len / 4 * 3 + 1);
  if (!p) return -1;
  size_t k = 0;
  for (size_t i = 0; i < len; i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (int j = 0; j < 4; j++) {
      char c = s[i + j];
      const char *at = c ? strchr(b64, c) : NULL;
      if (c == '=' && i + 4 == len && j >= 2 && (j == 3 || s[i + 3] == '=')) {
        pad++;
        v <<= 6;
      } else if (at && !pad) {
        v = v << 6 | (uint32_t)(at - b64);
      } else {
        free(p);
        return -1;
      }
    }
    p[k++] = (uint8_t)(v >> 16);
    if (pad < 2) p[k++] = (uint8_t)(v >> 8);
    if (pad < 1) p[k++] = (uint8_t)v;
  }
  *out = p;
  *n = k;
  return 0;
}

/* ---- reading ---- */

typedef struct idnode {
  char *name;
  dp_value_t v;   /* borrowed */
  int open;       /* still being filled */
} idnode_t;

typedef struct rd {
  char *msg;
  size_t msgsize;
  char path[1024];
  idnode_t *ids;
  size_t nids, idcap;
  const void *open[VJSON_MAX_DEPTH + 2];  /* $id containers being filled */
  size_t nopen;
  dp_ptrset_t *stset;      /* (device, ptr) -> storage index */
  dp_storage_t **storages;
  size_t nst, stcap;
  int with_data, without_data;
} rd_t;

static int fail(rd_t *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(rd_t *r, int code, const char *fmt, ...) {
  char what[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  snprintf(r->msg, r->msgsize, "%s, at %s", what, r->path);
  return code;
}

static size_t path_push(rd_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static size_t path_push(rd_t *r, const char *fmt, ...) {
  size_t len = strlen(r->path);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->path + len, sizeof r->path - len, fmt, ap);
  va_end(ap);
  return len;
}

static void path_key(rd_t *r, const char *key) {
  int ident = key[0] && !(key[0] >= '0' && key[0] <= '9');
  for (const char *c = key; *c && ident; c++)
    ident = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || *c == '_' || (*c >= '0' && *c <= '9');
  if (ident) {
    path_push(r, ".%s", key);
  } else {
    json_t *js = json_string(key);
    char *q = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
    path_push(r, "[%s]", q ? q : "?");
    free(q);
    json_decref(js);
  }
}

static int read_value(rd_t *r, json_t *j, dp_value_t *out, int depth);

static idnode_t *find_id(rd_t *r, const char *name) {
  for (size_t i = 0; i < r->nids; i++)
    if (strcmp(r->ids[i].name, name) == 0) return &r->ids[i];
  return NULL;
}

static int check_err(rd_t *r, int rc, dp_error_t *e) {
  return rc ? fail(r, rc, "%s", e->message) : 0;
}

static int parse_device(rd_t *r, json_t *dj, dp_device_t *d) {
  if (!json_is_string(dj) || dp_device_parse(json_string_value(dj), d) != 0)
    return fail(r, DP_EINVAL, "tensor device must be \"cpu\", \"cuda:N\" or \"host:N\"");
  return 0;
}

static int read_i64_array(rd_t *r, json_t *a, int64_t *out, int max, int *n, const char *what) {
  if (!json_is_array(a) || (int)json_array_size(a) > max)
    return fail(r, DP_EINVAL, "tensor %s must be an array of at most %d integers", what, max);
  *n = (int)json_array_size(a);
  for (int i = 0; i < *n; i++) {
    json_t *x = json_array_get(a, (size_t)i);
    if (!json_is_integer(x)) return fail(r, DP_EINVAL, "tensor %s must hold integers", what);
    out[i] = json_integer_value(x);
  }
  return 0;
}

static int read_tensor(rd_t *r, json_t *t, dp_value_t *out) {
  static const char *const known[] = {"device", "ptr", "nbytes", "dtype", "shape", "strides", "offset", "data"};
  const char *k;
  json_t *x;
  if (!json_is_object(t)) return fail(r, DP_EINVAL, "$tensor must be an object");
  json_object_foreach(t, k, x) {
    size_t i = 0;
    while (i < 8 && strcmp(k, known[i]) != 0) i++;
    if (i == 8) return fail(r, DP_EINVAL, "unknown $tensor field \"%s\"", k);
  }
  dp_device_t dev;
  int rc = parse_device(r, json_object_get(t, "device"), &dev);
  if (rc) return rc;
  json_t *pj = json_object_get(t, "ptr");
  char *end = NULL;
  unsigned long long ptr = 0;
  if (json_is_string(pj)) ptr = strtoull(json_string_value(pj), &end, 16);
  if (!json_is_string(pj) || strncmp(json_string_value(pj), "0x", 2) != 0 || !end || *end)
    return fail(r, DP_EINVAL, "tensor ptr must be a hex string such as \"0x7f0000001000\"");
  json_t *nj = json_object_get(t, "nbytes");
  if (!json_is_integer(nj) || json_integer_value(nj) < 0)
    return fail(r, DP_EINVAL, "tensor nbytes must be a non-negative integer");
  size_t nbytes = (size_t)json_integer_value(nj);
  dp_dtype_t dtype;
  json_t *dj = json_object_get(t, "dtype");
  if (!json_is_string(dj) || dp_dtype_parse(json_string_value(dj), &dtype) != 0)
    return fail(r, DP_EINVAL, "unknown tensor dtype %s", json_is_string(dj) ? json_string_value(dj) : "(missing)");
  int64_t shape[DP_TENSOR_MAX_DIMS], strides[DP_TENSOR_MAX_DIMS];
  int nd, ns;
  if ((rc = read_i64_array(r, json_object_get(t, "shape"), shape, DP_TENSOR_MAX_DIMS, &nd, "shape")) != 0) return rc;
  json_t *sj = json_object_get(t, "strides");
  if (sj) {
    if ((rc = read_i64_array(r, sj, strides, DP_TENSOR_MAX_DIMS, &ns, "strides")) != 0) return rc;
    if (ns != nd) return fail(r, DP_EINVAL, "tensor has %d strides for %d dimensions", ns, nd);
  }
  json_t *oj = json_object_get(t, "offset");
  if (oj && !json_is_integer(oj)) return fail(r, DP_EINVAL, "tensor offset must be an integer");
  int64_t offset = oj ? json_integer_value(oj) : 0;
  json_t *data = json_object_get(t, "data");
  if (data && !json_is_string(data)) return fail(r, DP_EINVAL, "tensor data must be a base64 string");

  /* One storage per (device, ptr). */
  dp_error_t e;
  size_t idx;
  dp_storage_t *st;
  if (dp_ptrset_find(r->stset, dev, (void *)(uintptr_t)ptr, &idx) == 0) {
    st = r->storages[idx];
    if (dp_storage_nbytes(st) != nbytes)
      return fail(r, DP_EINVAL, "tensors on %s %s disagree on nbytes (%zu and %zu)", json_string_value(
                  json_object_get(t, "device")), json_string_value(pj), dp_storage_nbytes(st), nbytes);
  } else {
    if ((rc = dp_storage_new(dev, (void *)(uintptr_t)ptr, nbytes, NULL, NULL, &st, &e)) != 0) return check_err(r, rc, &e);
    if (r->nst == r->stcap) {
      size_t ncap = r->stcap ? 2 * r->stcap : 16;
      dp_storage_t **p = realloc(r->storages, ncap * sizeof *p);
      if (!p) {
        dp_storage_release(st);
        return fail(r, DP_ENOMEM, "out of memory");
      }
      r->storages = p;
      r->stcap = ncap;
    }
    r->storages[r->nst++] = st;
    if ((rc = dp_ptrset_add(r->stset, dev, (void *)(uintptr_t)ptr, nbytes, NULL, &e)) != 0) return check_err(r, rc, &e);
  }
  if (data) {
    uint8_t *bytes;
    size_t n;
    if (vjson_b64_decode(json_string_value(data), &bytes, &n) != 0) return fail(r, DP_EINVAL, "tensor data is not valid base64");
    if (n != nbytes) {
      free(bytes);
      return fail(r, DP_EINVAL, "tensor data has %zu bytes, nbytes says %zu", n, nbytes);
    }
    rc = dp_storage_host_data(st) ? 0 : dp_storage_set_host_data(st, bytes, &e);
    free(bytes);
    if (rc) return check_err(r, rc, &e);
    r->with_data++;
  } else {
    r->without_data++;
  }
  rc = dp_tensor_new(dp_storage_retain(st), dtype, nd, shape, sj ? strides : NULL, offset, out, &e);
  return check_err(r, rc, &e);
}

/* Allocates the shell of a container, so that $id can name it before its
 * children are read (cycles). */
static int make_shell(rd_t *r, json_t *j, dp_value_t *out) {
  dp_error_t e;
  int rc;
  json_t *x;
  if (json_is_array(j)) {
    rc = dp_list_new(json_array_size(j), out, &e);
  } else if ((x = json_object_get(j, "$tuple")) != NULL) {
    if (!json_is_array(x)) return fail(r, DP_EINVAL, "$tuple must be an array");
    rc = dp_tuple_new(json_array_size(x), out, &e);
  } else if ((x = json_object_get(j, "$object")) != NULL) {
    if (!json_is_string(x)) return fail(r, DP_EINVAL, "$object must be a class name string");
    rc = dp_object_new(json_string_value(x), out, &e);
  } else if ((x = json_object_get(j, "$reduce")) != NULL) {
    if (!json_is_string(x)) return fail(r, DP_EINVAL, "$reduce must be a type name string");
    rc = dp_object_new_reduced(json_string_value(x), dp_none(), out, &e);
  } else {
    rc = dp_dict_new(0, out, &e);
  }
  return check_err(r, rc, &e);
}

static int fill_seq(rd_t *r, json_t *a, dp_value_t seq, int depth) {
  for (size_t i = 0; i < json_array_size(a); i++) {
    size_t mark = path_push(r, "[%zu]", i);
    dp_value_t item;
    int rc = read_value(r, json_array_get(a, i), &item, depth + 1);
    if (rc) return rc;
    dp_error_t e;
    rc = dp_value_kind(seq) == DP_LIST ? dp_list_append(seq, item, &e) : dp_seq_set(seq, i, item, &e);
    if (rc) return check_err(r, rc, &e);
    r->path[mark] = '\0';
  }
  return 0;
}

/* Whether a (hashable, hence bounded) key holds a tuple still being filled. */
static int key_is_open(rd_t *r, dp_value_t k) {
  if (dp_value_kind(k) != DP_TUPLE) return 0;
  for (size_t i = 0; i < r->nopen; i++)
    if (r->open[i] == dp_value_id(k)) return 1;
  for (size_t i = 0; i < dp_seq_len(k); i++)
    if (key_is_open(r, dp_seq_get(k, i))) return 1;
  return 0;
}

static int fill_container(rd_t *r, json_t *j, dp_value_t v, int depth) {
  dp_error_t e;
  int rc;
  const char *k;
  json_t *x;
  if (json_is_array(j)) return fill_seq(r, j, v, depth);
  if ((x = json_object_get(j, "$tuple")) != NULL) {
    if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$tuple takes no other fields");
    return fill_seq(r, x, v, depth);
  }
  if ((x = json_object_get(j, "$object")) != NULL) {
    json_t *attrs = json_object_get(j, "attrs");
    if (json_object_size(j) != (attrs ? 2u : 1u) || (attrs && !json_is_object(attrs)))
      return fail(r, DP_EINVAL, "$object takes one other field, \"attrs\", an object");
    json_object_foreach(attrs, k, x) {
      size_t mark = strlen(r->path);
      path_key(r, k);
      dp_value_t val;
      if ((rc = read_value(r, x, &val, depth + 1)) != 0) return rc;
      if ((rc = dp_object_set(v, k, val, &e)) != 0) return check_err(r, rc, &e);
      r->path[mark] = '\0';
    }
    return 0;
  }
  if ((x = json_object_get(j, "$reduce")) != NULL) {
    json_t *state = json_object_get(j, "state");
    if (json_object_size(j) != 2 || !state) return fail(r, DP_EINVAL, "$reduce takes one other field, \"state\"");
    size_t mark = path_push(r, "<reduce %s>", json_string_value(x));
    dp_value_t val;
    if ((rc = read_value(r, state, &val, depth + 1)) != 0) return rc;
    if ((rc = dp_object_set(v, "__reduce__", val, &e)) != 0) return check_err(r, rc, &e);
    r->path[mark] = '\0';
    return 0;
  }
  if ((x = json_object_get(j, "$dict")) != NULL) {
    if (json_object_size(j) != 1 || !json_is_array(x)) return fail(r, DP_EINVAL, "$dict must be an array of [key, value] pairs");
    for (size_t i = 0; i < json_array_size(x); i++) {
      json_t *pair = json_array_get(x, i);
      size_t mark = path_push(r, "<item %zu>", i);
      if (!json_is_array(pair) || json_array_size(pair) != 2) return fail(r, DP_EINVAL, "$dict items are [key, value] pairs");
      dp_value_t key, val;
      if ((rc = read_value(r, json_array_get(pair, 0), &key, depth + 1)) != 0) return rc;
      if (!dp_value_is_hashable(key)) {  /* bounded before any walk of it */
        int kind = (int)dp_value_kind(key);
        dp_value_release(key);
        return fail(r, DP_ETYPE, "dict key of kind %s is not hashable", dp_kind_name((dp_kind_t)kind));
      }
      if (key_is_open(r, key)) {
        dp_value_release(key);
        return fail(r, DP_EINVAL, "dict key refers to a node that is still being built");
      }
      if ((rc = read_value(r, json_array_get(pair, 1), &val, depth + 1)) != 0) {
        dp_value_release(key);
        return rc;
      }
      dp_value_t dummy;
      if (dp_dict_get(v, key, &dummy) == 0) {
        dp_value_release(key);
        dp_value_release(val);
        return fail(r, DP_EINVAL, "duplicate dict key");
      }
      if ((rc = dp_dict_set(v, key, val, &e)) != 0) return check_err(r, rc, &e);
      r->path[mark] = '\0';
    }
    return 0;
  }
  json_object_foreach(j, k, x) {
    if (k[0] == '$') return fail(r, DP_EINVAL, "unknown tag \"%s\" (a plain key starting with '$' needs $dict)", k);
    size_t mark = strlen(r->path);
    path_key(r, k);
    dp_value_t key, val;
    if ((rc = dp_str_new(k, strlen(k), &key, &e)) != 0) return check_err(r, rc, &e);
    if ((rc = read_value(r, x, &val, depth + 1)) != 0) {
      dp_value_release(key);
      return rc;
    }
    if ((rc = dp_dict_set(v, key, val, &e)) != 0) return check_err(r, rc, &e);
    r->path[mark] = '\0';
  }
  return 0;
}

static int is_container_json(json_t *j) {
  if (json_is_array(j)) return 1;
  if (!json_is_object(j)) return 0;
  return !json_object_get(j, "$tensor") && !json_object_get(j, "$bytes") && !json_object_get(j, "$float") &&
         !json_object_get(j, "$ref") && !json_object_get(j, "$id");
}

static int read_value(rd_t *r, json_t *j, dp_value_t *out, int depth) {
  dp_error_t e;
  int rc;
  json_t *x;
  if (depth > VJSON_MAX_DEPTH) return fail(r, DP_ELIMIT, "nesting deeper than %d levels", VJSON_MAX_DEPTH);
  switch (json_typeof(j)) {
    case JSON_NULL: *out = dp_none(); return 0;
    case JSON_TRUE: *out = dp_bool(true); return 0;
    case JSON_FALSE: *out = dp_bool(false); return 0;
    case JSON_INTEGER: *out = dp_int(json_integer_value(j)); return 0;
    case JSON_REAL: *out = dp_float(json_real_value(j)); return 0;
    case JSON_STRING:
      rc = dp_str_new(json_string_value(j), json_string_length(j), out, &e);
      return check_err(r, rc, &e);
    default: break;
  }
  if (json_is_object(j)) {
    if ((x = json_object_get(j, "$id")) != NULL) {
      json_t *val = json_object_get(j, "$value");
      if (!json_is_string(x) || !val || json_object_size(j) != 2)
        return fail(r, DP_EINVAL, "$id needs a string name and a \"$value\"");
      if (find_id(r, json_string_value(x))) return fail(r, DP_EINVAL, "$id \"%s\" is defined twice", json_string_value(x));
      if (r->nids == r->idcap) {
        size_t ncap = r->idcap ? 2 * r->idcap : 16;
        idnode_t *p = realloc(r->ids, ncap * sizeof *p);
        if (!p) return fail(r, DP_ENOMEM, "out of memory");
        r->ids = p;
        r->idcap = ncap;
      }
      idnode_t *node = &r->ids[r->nids];
      if (is_container_json(val)) {
        if ((rc = make_shell(r, val, out)) != 0) return rc;
        node->name = strdup(json_string_value(x));
        node->v = *out;
        node->open = 1;
        size_t mine = r->nids++;
        r->open[r->nopen++] = dp_value_id(*out);
        rc = fill_container(r, val, *out, depth);
        r->nopen--;
        r->ids[mine].open = 0;
        if (rc) dp_value_release(*out);
        return rc;
      }
      if ((rc = read_value(r, val, out, depth + 1)) != 0) return rc;
      if (!dp_value_is_heap(*out)) {
        dp_value_release(*out);
        return fail(r, DP_EINVAL, "$id names a scalar; only str, bytes, containers and tensors have identity");
      }
      node->name = strdup(json_string_value(x));
      node->v = *out;
      node->open = 0;
      r->nids++;
      return 0;
    }
    if ((x = json_object_get(j, "$ref")) != NULL) {
      idnode_t *node = json_is_string(x) ? find_id(r, json_string_value(x)) : NULL;
      if (!node || json_object_size(j) != 1)
        return fail(r, DP_EINVAL, "$ref \"%s\" names no earlier $id", json_is_string(x) ? json_string_value(x) : "?");
      *out = dp_value_retain(node->v);
      return 0;
    }
    if ((x = json_object_get(j, "$tensor")) != NULL) {
      if (json_object_size(j) != 1) return fail(r, DP_EINVAL, "$tensor takes no other fields");
      return read_tensor(r, x, out);
    }
    if ((x = json_object_get(j, "$bytes")) != NULL) {
      uint8_t *p;
      size_t n;
      if (json_object_size(j) != 1 || !json_is_string(x) || vjson_b64_decode(json_string_value(x), &p, &n) != 0)
        return fail(r, DP_EINVAL, "$bytes must be a base64 string");
      rc = dp_bytes_new(p, n, out, &e);
      free(p);
      return check_err(r, rc, &e);
    }
    if ((x = json_object_get(j, "$float")) != NULL) {
      const char *s = json_is_string(x) ? json_string_value(x) : "";
      if (json_object_size(j) == 1 && strcmp(s, "nan") == 0) *out = dp_float(NAN);
      else if (json_object_size(j) == 1 && strcmp(s, "inf") == 0) *out = dp_float(INFINITY);
      else if (json_object_size(j) == 1 && strcmp(s, "-inf") == 0) *out = dp_float(-INFINITY);
      else return fail(r, DP_EINVAL, "$float must be \"nan\", \"inf\" or \"-inf\"");
      return 0;
    }
  }
  if ((rc = make_shell(r, j, out)) != 0) return rc;
  if ((rc = fill_container(r, j, *out, depth)) != 0) dp_value_release(*out);
  return rc;
}

int vjson_to_value(json_t *j, dp_value_t *out, int *is_inline, char *msg, size_t msgsize) {
  rd_t r;
  memset(&r, 0, sizeof r);
  r.msg = msg;
  r.msgsize = msgsize;
  strcpy(r.path, "$");
  dp_error_t e;
  int rc = dp_ptrset_new(&r.stset, &e);
  if (rc) return fail(&r, rc, "%s", e.message);
  rc = read_value(&r, j, out, 0);
  if (rc == 0 && r.with_data && r.without_data) {
    dp_value_release(*out);
    rc = fail(&r, DP_EINVAL, "%d tensors carry \"data\" and %d do not: an inline frame needs it on all",
              r.with_data, r.without_data);
  }
  *is_inline = r.with_data > 0;
  for (size_t i = 0; i < r.nst; i++) dp_storage_release(r.storages[i]);
  free(r.storages);
  for (size_t i = 0; i < r.nids; i++) free(r.ids[i].name);
  free(r.ids);
  dp_ptrset_free(r.stset);
  return rc;
}

/* ---- writing ---- */

/* Heap node -> (times met, $id number) */
typedef struct wslot {
  const void *key;
  uint32_t count;
  int32_t id;   /* -1 until its first emission */
} wslot_t;

typedef struct wr {
  wslot_t *slots;
  size_t cap, n;
  int next_id;
  int failed;   /* some piece could not be built: the whole result is refused */
  char *msg;
  size_t msgsize;
} wr_t;

/* base64 of p as a JSON string; on failure marks the writer failed. */
static json_t *b64_string(wr_t *w, const uint8_t *p, size_t n) {
  char *b = vjson_b64_encode(p, n);
  json_t *s = b ? json_string(b) : NULL;
  free(b);
  if (!s) w->failed = 1;
  return s;
}

static wslot_t *wslot(wr_t *w, const void *key, int insert) {
  if (insert && (w->n + 1) * 2 > w->cap) {
    size_t ncap = w->cap ? w->cap * 2 : 256;
    wslot_t *ns = calloc(ncap, sizeof *ns);
    if (!ns) return NULL;
    for (size_t i = 0; i < w->cap; i++) {
      if (!w->slots[i].key) continue;
      size_t j = ((uintptr_t)w->slots[i].key >> 4) * 0x9E3779B97F4A7C15ull % ncap;
      while (ns[j].key) j = (j + 1) % ncap;
      ns[j] = w->slots[i];
    }
    free(w->slots);
    w->slots = ns;
    w->cap = ncap;
  }
  if (!w->cap) return NULL;
  for (size_t j = ((uintptr_t)key >> 4) * 0x9E3779B97F4A7C15ull % w->cap;; j = (j + 1) % w->cap) {
    if (w->slots[j].key == key) return &w->slots[j];
    if (!w->slots[j].key) {
      if (!insert) return NULL;
      w->slots[j] = (wslot_t){key, 0, -1};
      w->n++;
      return &w->slots[j];
    }
  }
}

/* Pass 1: how often is each heap node met? */
static int count_refs(wr_t *w, dp_value_t v, int depth) {
  if (!dp_value_is_heap(v)) return 0;
  if (depth > VJSON_MAX_DEPTH) {
    snprintf(w->msg, w->msgsize, "value nests deeper than %d levels, too deep for value JSON", VJSON_MAX_DEPTH);
    return DP_ELIMIT;
  }
  wslot_t *s = wslot(w, dp_value_id(v), 1);
  if (!s) {
    snprintf(w->msg, w->msgsize, "out of memory");
    return DP_ENOMEM;
  }
  if (s->count++ > 0) return 0;
  int rc = 0;
  switch (dp_value_kind(v)) {
    case DP_LIST:
    case DP_TUPLE:
      for (size_t i = 0; i < dp_seq_len(v) && !rc; i++) rc = count_refs(w, dp_seq_get(v, i), depth + 1);
      break;
    case DP_DICT:
      for (size_t i = 0; i < dp_dict_len(v) && !rc; i++) {
        dp_value_t k, x;
        dp_dict_item(v, i, &k, &x);
        rc = count_refs(w, k, depth + 1);
        if (!rc) rc = count_refs(w, x, depth + 1);
      }
      break;
    case DP_OBJECT:
      for (size_t i = 0; i < dp_object_nattrs(v) && !rc; i++) {
        dp_value_t x;
        dp_object_attr(v, i, NULL, &x);
        rc = count_refs(w, x, depth + 1);
      }
      break;
    case DP_CUSTOM:
      snprintf(w->msg, w->msgsize, "a custom of type '%s' has no value JSON form (pickle it first)",
               dp_custom_type(v)->name);
      return DP_ETYPE;
    default:
      break;
  }
  return rc;
}

static json_t *emit(wr_t *w, dp_value_t v);

static json_t *tag1(const char *k, json_t *v) {
  json_t *o = json_object();
  json_object_set_new(o, k, v);
  return o;
}

static json_t *emit_tensor(wr_t *w, dp_value_t v) {
  dp_storage_t *st = dp_tensor_storage(v);
  char buf[32];
  json_t *t = json_object();
  json_object_set_new(t, "device", json_string(dp_device_format(dp_storage_device(st), buf, sizeof buf)));
  snprintf(buf, sizeof buf, "0x%" PRIxPTR, (uintptr_t)dp_storage_base(st));
  json_object_set_new(t, "ptr", json_string(buf));
  json_object_set_new(t, "nbytes", json_integer((json_int_t)dp_storage_nbytes(st)));
  json_object_set_new(t, "dtype", json_string(dp_dtype_name(dp_tensor_dtype(v))));
  json_t *shape = json_array(), *strides = json_array();
  for (int d = 0; d < dp_tensor_ndim(v); d++) {
    json_array_append_new(shape, json_integer(dp_tensor_shape(v)[d]));
    json_array_append_new(strides, json_integer(dp_tensor_strides(v)[d]));
  }
  json_object_set_new(t, "shape", shape);
  json_object_set_new(t, "strides", strides);
  json_object_set_new(t, "offset", json_integer(dp_tensor_offset(v)));
  const void *data = dp_storage_host_data(st);
  if (data) json_object_set_new(t, "data", b64_string(w, data, dp_storage_nbytes(st)));
  return tag1("$tensor", t);
}

static int plain_key(wr_t *w, dp_value_t k) {
  size_t n;
  const char *s = dp_str_data(k, &n);
  if (!s || n == 0 || s[0] == '$' || memchr(s, 0, n)) return 0;
  wslot_t *sl = wslot(w, dp_value_id(k), 0);
  return sl && sl->count == 1;
}

static json_t *emit_body(wr_t *w, dp_value_t v) {
  switch (dp_value_kind(v)) {
    case DP_NONE: return json_null();
    case DP_BOOL: return json_boolean(dp_value_as_bool(v));
    case DP_INT: return json_integer(dp_value_as_int(v));
    case DP_FLOAT: {
      double f = dp_value_as_float(v);
      if (isnan(f)) return tag1("$float", json_string("nan"));
      if (isinf(f)) return tag1("$float", json_string(f > 0 ? "inf" : "-inf"));
      return json_real(f);
    }
    case DP_STR: {
      size_t n;
      const char *s = dp_str_data(v, &n);
      return json_stringn(s, n);
    }
    case DP_BYTES: {
      size_t n;
      const uint8_t *p = dp_bytes_data(v, &n);
      return tag1("$bytes", b64_string(w, p, n));
    }
    case DP_LIST:
    case DP_TUPLE: {
      json_t *a = json_array();
      for (size_t i = 0; i < dp_seq_len(v); i++) json_array_append_new(a, emit(w, dp_seq_get(v, i)));
      return dp_value_kind(v) == DP_TUPLE ? tag1("$tuple", a) : a;
    }
    case DP_DICT: {
      int plain = 1;
      for (size_t i = 0; i < dp_dict_len(v) && plain; i++) {
        dp_value_t k;
        dp_dict_item(v, i, &k, NULL);
        plain = plain_key(w, k);
      }
      json_t *o = plain ? json_object() : json_array();
      for (size_t i = 0; i < dp_dict_len(v); i++) {
        dp_value_t k, x;
        dp_dict_item(v, i, &k, &x);
        if (plain) {
          json_object_set_new(o, dp_str_data(k, NULL), emit(w, x));
        } else {
          json_t *pair = json_array();
          json_array_append_new(pair, emit(w, k));
          json_array_append_new(pair, emit(w, x));
          json_array_append_new(o, pair);
        }
      }
      return plain ? o : tag1("$dict", o);
    }
    case DP_TENSOR:
      return emit_tensor(w, v);
    case DP_OBJECT: {
      json_t *o = json_object();
      if (dp_object_is_reduced(v)) {
        dp_value_t st = dp_none();
        dp_object_get(v, "__reduce__", &st);
        json_object_set_new(o, "$reduce", json_string(dp_object_class(v)));
        json_object_set_new(o, "state", emit(w, st));
        return o;
      }
      json_t *attrs = json_object();
      for (size_t i = 0; i < dp_object_nattrs(v); i++) {
        const char *name;
        dp_value_t x;
        dp_object_attr(v, i, &name, &x);
        json_object_set_new(attrs, name, emit(w, x));
      }
      json_object_set_new(o, "$object", json_string(dp_object_class(v)));
      json_object_set_new(o, "attrs", attrs);
      return o;
    }
    default:  /* customs were refused by count_refs */
      return json_null();
  }
}

static json_t *emit(wr_t *w, dp_value_t v) {
  if (!dp_value_is_heap(v)) return emit_body(w, v);
  wslot_t *s = wslot(w, dp_value_id(v), 0);
  if (!s || s->count == 1) return emit_body(w, v);
  char name[24];
  if (s->id >= 0) {
    snprintf(name, sizeof name, "n%d", s->id);
    return tag1("$ref", json_string(name));
  }
  s->id = w->next_id++;
  snprintf(name, sizeof name, "n%d", s->id);
  json_t *o = json_object();
  json_object_set_new(o, "$id", json_string(name));
  json_object_set_new(o, "$value", emit_body(w, v));
  return o;
}

json_t *vjson_from_value(dp_value_t v, char *msg, size_t msgsize) {
  wr_t w;
  memset(&w, 0, sizeof w);
  w.msg = msg;
  w.msgsize = msgsize;
  json_t *j = NULL;
  if (count_refs(&w, v, 0) == 0) {
    j = emit(&w, v);
    if (!j || w.failed) {
      json_decref(j);
      j = NULL;
      snprintf(msg, msgsize, "out of memory building JSON");
    }
  }
  free(w.slots);
  return j;
}
