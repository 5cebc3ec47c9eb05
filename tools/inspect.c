/* tools/inspect.c — `devpickle inspect`'s tree printer (its own file so that
 * the fuzzers can drive it). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inspect.h"
#include "vjson.h"

#define INSPECT_DEPTH 64

typedef struct seen {
  const void **ids;
  char **paths;
  size_t n, cap;
} seen_t;

static const char *seen_find(seen_t *s, const void *id) {
  for (size_t i = 0; i < s->n; i++)
    if (s->ids[i] == id) return s->paths[i];
  return NULL;
}

static void seen_add(seen_t *s, const void *id, const char *path) {
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 64;
    s->ids = realloc(s->ids, s->cap * sizeof *s->ids);
    s->paths = realloc(s->paths, s->cap * sizeof *s->paths);
    if (!s->ids || !s->paths) {
      fprintf(stderr, "devpickle: out of memory\n");
      exit(1);
    }
  }
  s->ids[s->n] = id;
  s->paths[s->n++] = strdup(path);
}

static int is_ident(const char *s) {
  if (!*s || (*s >= '0' && *s <= '9')) return 0;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_' || (*s >= '0' && *s <= '9'))) return 0;
  return 1;
}

static void print_node(FILE *out, seen_t *seen, dp_value_t v, char *path, size_t plen, int depth) {
  char dev[16];
  fprintf(out, "%-40s  ", path);
  if (dp_value_is_heap(v)) {
    const char *first = seen_find(seen, dp_value_id(v));
    if (first) {
      fprintf(out, "-> %s\n", first);
      return;
    }
    seen_add(seen, dp_value_id(v), path);
  }
  size_t n;
  switch (dp_value_kind(v)) {
    case DP_NONE: fprintf(out, "none\n"); return;
    case DP_BOOL: fprintf(out, "bool %s\n", dp_value_as_bool(v) ? "true" : "false"); return;
    case DP_INT: fprintf(out, "int %" PRId64 "\n", dp_value_as_int(v)); return;
    case DP_FLOAT: fprintf(out, "float %.17g\n", dp_value_as_float(v)); return;
    case DP_STR: {
      const char *s = dp_str_data(v, &n);
      fprintf(out, "str (%zu bytes) \"%.*s%s\"\n", n, n > 40 ? 40 : (int)n, s, n > 40 ? "..." : "");
      return;
    }
    case DP_BYTES: dp_bytes_data(v, &n); fprintf(out, "bytes (%zu)\n", n); return;
    case DP_TENSOR: {
      dp_storage_t *st = dp_tensor_storage(v);
      fprintf(out, "tensor %s[", dp_dtype_name(dp_tensor_dtype(v)));
      for (int d = 0; d < dp_tensor_ndim(v); d++) fprintf(out, "%s%" PRId64, d ? ", " : "", dp_tensor_shape(v)[d]);
      fprintf(out, "] %s 0x%" PRIxPTR " (%zu bytes) offset %" PRId64 "\n", dp_device_format(dp_storage_device(st), dev, sizeof dev),
             (uintptr_t)dp_storage_base(st), dp_storage_nbytes(st), dp_tensor_offset(v));
      return;
    }
    default: break;
  }
  int kind = dp_value_kind(v);
  size_t count = kind == DP_DICT ? dp_dict_len(v) : kind == DP_OBJECT ? dp_object_nattrs(v) : dp_seq_len(v);
  if (kind == DP_OBJECT)
    fprintf(out, "%s %s (%zu attribute%s)\n", dp_object_is_reduced(v) ? "reduced" : "object", dp_object_class(v), count,
           count == 1 ? "" : "s");
  else
    fprintf(out, "%s (%zu item%s)\n", dp_kind_name((dp_kind_t)kind), count, count == 1 ? "" : "s");
  if (depth >= INSPECT_DEPTH) {
    if (count) fprintf(out, "%-40s  (deeper levels not shown)\n", "");
    return;
  }
  for (size_t i = 0; i < count; i++) {
    dp_value_t child;
    char step[512];
    if (kind == DP_LIST || kind == DP_TUPLE) {
      child = dp_seq_get(v, i);
      snprintf(step, sizeof step, "[%zu]", i);
    } else if (kind == DP_DICT) {
      dp_value_t k;
      dp_dict_item(v, i, &k, &child);
      const char *ks = dp_str_data(k, &n);
      if (ks && is_ident(ks) && strlen(ks) == n) {
        snprintf(step, sizeof step, ".%s", ks);
      } else {
        char m[64];
        json_t *kj = vjson_from_value(k, m, sizeof m);
        char *txt = kj ? json_dumps(kj, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
        snprintf(step, sizeof step, "[%s]", txt ? txt : "?");
        free(txt);
        json_decref(kj);
      }
    } else if (dp_object_is_reduced(v)) {
      dp_object_get(v, "__reduce__", &child);
      snprintf(step, sizeof step, "<reduce %s>", dp_object_class(v));
    } else {
      const char *name;
      dp_object_attr(v, i, &name, &child);
      if (is_ident(name)) snprintf(step, sizeof step, ".%s", name);
      else snprintf(step, sizeof step, "[\"%s\"]", name);
    }
    size_t sl = strlen(step);
    if (plen + sl + 1 > 8192) {
      fprintf(out, "%-40s  (path too long)\n", "");
      return;
    }
    memcpy(path + plen, step, sl + 1);
    print_node(out, seen, child, path, plen + sl, depth + 1);
    path[plen] = '\0';
  }
}


void inspect_print(FILE *out, dp_value_t v) {
  char *path = malloc(8192);
  if (!path) return;
  strcpy(path, "$");
  seen_t seen = {0};
  print_node(out, &seen, v, path, 1, 0);
  for (size_t i = 0; i < seen.n; i++) free(seen.paths[i]);
  free(seen.ids);
  free(seen.paths);
  free(path);
}
