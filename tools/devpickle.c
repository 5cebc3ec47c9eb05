/* tools/devpickle.c — the devpickle command-line tool (public API only). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"
#include "inspect.h"
#include "vjson.h"

#define EXIT_DATA 1
#define EXIT_USAGE 2

static const char *const usage_main =
    "usage: devpickle <command> [options] [FILE]\n"
    "\n"
    "Finds the device allocations a value references, and packs values into\n"
    "checksummed frames whose device buffers travel out-of-band.\n"
    "\n"
    "commands:\n"
    "  pack VALUE.json -o FRAME.dpk   value JSON to a frame\n"
    "  unpack FRAME.dpk               a frame to value JSON on stdout\n"
    "  dump FRAME.dpk [--json]        the device pointers a frame's value holds\n"
    "  inspect FRAME.dpk              the value as a tree, one node a line, with paths\n"
    "  verify FRAME.dpk               check a frame completely; print a summary\n"
    "  demo                           walk, pickle and check an example value\n"
    "\n"
    "FILE may be '-' for stdin (and -o - for stdout).\n"
    "Run 'devpickle <command> --help' for a command's options.\n"
    "\n"
    "exit status: 0 ok; 1 bad data or a runtime failure (one line on stderr:\n"
    "'devpickle: FILE: what, at byte N'); 2 usage error.\n"
    "Value JSON: docs/VALUE_JSON.md. Frame format: docs/FORMAT.md.\n";

typedef struct cmd {
  const char *name;
  int (*run)(int argc, char **argv);
} cmd_t;

static int usage_error(const char *cmd, const char *fmt, const char *arg) {
  fprintf(stderr, "devpickle %s: ", cmd);
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nTry 'devpickle %s --help'.\n", cmd);
  return EXIT_USAGE;
}

/* One line on stderr: devpickle: FILE: what[, at byte N] */
static int data_error(const char *file, const char *what, int64_t offset) {
  if (offset >= 0)
    fprintf(stderr, "devpickle: %s: %s, at byte %lld\n", file, what, (long long)offset);
  else
    fprintf(stderr, "devpickle: %s: %s\n", file, what);
  return EXIT_DATA;
}

static const char *display(const char *path) { return strcmp(path, "-") == 0 ? "<stdin>" : path; }

/* Reads a whole file (or stdin). */
static int read_all(const char *path, uint8_t **out, size_t *n) {
  FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
  if (!f) return data_error(display(path), strerror(errno), -1);
  size_t cap = 1 << 16, len = 0;
  uint8_t *buf = malloc(cap);
  for (;;) {
    if (!buf) break;
    size_t got = fread(buf + len, 1, cap - len, f);
    len += got;
    if (len < cap) break;
    uint8_t *nb = realloc(buf, cap * 2);
    if (!nb) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = nb;
    cap *= 2;
  }
  int err = ferror(f);
  if (f != stdin) fclose(f);
  if (!buf) return data_error(display(path), "out of memory reading the file", -1);
  if (err) {
    free(buf);
    return data_error(display(path), "read error", -1);
  }
  *out = buf;
  *n = len;
  return 0;
}

static int write_all(const char *path, const void *p, size_t n) {
  FILE *f = strcmp(path, "-") == 0 ? stdout : fopen(path, "wb");
  if (!f) return data_error(path, strerror(errno), -1);
  size_t put = fwrite(p, 1, n, f);
  int bad = put != n || fflush(f) != 0;
  if (f != stdout) bad |= fclose(f) != 0;
  return bad ? data_error(strcmp(path, "-") ? path : "<stdout>", "write failed", -1) : 0;
}

/* Parses "--help" / flags shared by the frame readers. Returns the file. */
typedef struct args {
  const char *file;
  const char *out;
  int json;
} args_t;

static int parse_args(const char *cmd, const char *help, int argc, char **argv, args_t *a, int allow_o,
                      int allow_json) {
  memset(a, 0, sizeof *a);
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
      fputs(help, stdout);
      exit(0);
    } else if (allow_o && (strcmp(s, "-o") == 0 || strcmp(s, "--output") == 0)) {
      if (++i == argc) return usage_error(cmd, "%s needs a file name", s);
      a->out = argv[i];
    } else if (allow_json && strcmp(s, "--json") == 0) {
      a->json = 1;
    } else if (s[0] == '-' && s[1] != '\0') {
      return usage_error(cmd, "unknown option '%s'", s);
    } else if (a->file) {
      return usage_error(cmd, "unexpected argument '%s'", s);
    } else {
      a->file = s;
    }
  }
  if (!a->file) return usage_error(cmd, "%s", "missing input file (use - for stdin)");
  if (allow_o && !a->out) return usage_error(cmd, "%s", "missing -o FRAME.dpk (use -o - for stdout)");
  return 0;
}

/* The common start of the commands that read a frame: their arguments, the
 * file, its header facts and its value. Returns 0 or the exit status. */
typedef struct loaded {
  args_t a;
  dp_value_t v;
  dp_frame_info_t info;
  size_t size;
} loaded_t;

static int load_command(const char *cmd, const char *help, int argc, char **argv, int allow_json, loaded_t *l) {
  int rc = parse_args(cmd, help, argc, argv, &l->a, 0, allow_json);
  if (rc) return rc;
  uint8_t *bytes;
  if ((rc = read_all(l->a.file, &bytes, &l->size)) != 0) return rc;
  dp_error_t e;
  dp_error_clear(&e);
  rc = dp_unpickle(bytes, l->size, NULL, &l->v, &e);
  if (rc == 0) dp_frame_check(bytes, l->size, &l->info, NULL);
  free(bytes);
  return rc ? data_error(display(l->a.file), e.message, e.offset) : 0;
}

/* Prints JSON (taking the reference) and a newline on stdout. */
static int put_json(json_t *j, size_t flags, const char *file) {
  char *s = json_dumps(j, flags);
  json_decref(j);
  if (!s) return data_error(display(file), "out of memory writing JSON", -1);
  puts(s);
  free(s);
  return fflush(stdout) == 0 ? 0 : data_error("<stdout>", "write failed", -1);
}

/* ---- pack ---- */

static const char *const help_pack =
    "usage: devpickle pack VALUE.json -o FRAME.dpk\n"
    "\n"
    "Reads a value in value JSON (docs/VALUE_JSON.md) and writes it as a frame.\n"
    "Tensors naming the same device and ptr share one storage. When the tensors\n"
    "carry \"data\" (base64) the frame is inline: it holds the buffer bytes.\n"
    "Use - for stdin, -o - for stdout.\n";

static int inline_reader(void *ud, dp_device_t d, const void *src, size_t n, void *dst, dp_error_t *err) {
  (void)ud; (void)d; (void)src; (void)n; (void)dst;
  if (err) snprintf(err->message, sizeof err->message, "a tensor without \"data\" in an inline frame");
  return DP_EINVAL;
}

static int cmd_pack(int argc, char **argv) {
  args_t a;
  int rc = parse_args("pack", help_pack, argc, argv, &a, 1, 0);
  if (rc) return rc;
  json_error_t je;
  json_t *j = strcmp(a.file, "-") == 0 ? json_loadf(stdin, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je)
                                       : json_load_file(a.file, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
  if (!j) {
    char what[256];
    snprintf(what, sizeof what, "invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    return data_error(display(a.file), what, je.position);
  }
  dp_value_t v;
  int is_inline = 0;
  char msg[1024];
  rc = vjson_to_value(j, &v, &is_inline, msg, sizeof msg);
  json_decref(j);
  if (rc) return data_error(display(a.file), msg, -1);
  dp_frame_t *f;
  dp_error_t e;
  dp_error_clear(&e);
  dp_pickle_opts_t po = {is_inline ? DP_PICKLE_INLINE : 0, 0, inline_reader, NULL};
  if ((rc = dp_frame_new(&f, &e)) == 0) rc = dp_pickle(v, &po, f, &e);
  if (rc == 0) {
    size_t n;
    const uint8_t *b = dp_frame_data(f, &n);
    rc = write_all(a.out, b, n);
  } else {
    rc = data_error(display(a.file), e.message, -1);
  }
  dp_frame_free(f);
  dp_value_release(v);
  return rc;
}

/* ---- unpack ---- */

static const char *const help_unpack =
    "usage: devpickle unpack FRAME.dpk\n"
    "\n"
    "Checks a frame and prints its value as value JSON on stdout. 'devpickle\n"
    "pack' turns that JSON back into the same bytes. Shared nodes and cycles\n"
    "appear as {\"$id\": ..., \"$value\": ...} and {\"$ref\": ...}.\n";

static int cmd_unpack(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("unpack", help_unpack, argc, argv, 0, &l);
  if (rc) return rc;
  char msg[256];
  json_t *j = vjson_from_value(l.v, msg, sizeof msg);
  dp_value_release(l.v);
  if (!j) return data_error(display(l.a.file), msg, -1);
  return put_json(j, JSON_ENCODE_ANY | JSON_INDENT(2) | JSON_REAL_PRECISION(17), l.a.file);
}

/* ---- dump ---- */

static const char *const help_dump =
    "usage: devpickle dump FRAME.dpk [--json]\n"
    "\n"
    "Lists the device allocations the frame's value references, in the order a\n"
    "walk first meets them: device, pointer, size, refs (tensors on that\n"
    "storage) and the first path. CPU storages are listed with device cpu.\n"
    "--json prints one object:\n"
    "  {\"count\": N, \"devices\": [...], \"pointers\": [{\"device\": \"cuda:0\",\n"
    "   \"ptr\": \"0x...\", \"nbytes\": N, \"path\": \"$...\", \"refs\": K}, ...]}\n";

static int scan_value(const char *file, dp_value_t v, dp_ptrset_t **set) {
  dp_error_t e;
  dp_error_clear(&e);
  dp_scan_opts_t so = {DP_SCAN_PATHS, 0};
  if (dp_ptrset_new(set, &e) != 0 || dp_scan(v, &so, *set, &e) != 0) {
    dp_ptrset_free(*set);
    return data_error(display(file), e.message, -1);
  }
  return 0;
}

static int cmd_dump(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("dump", help_dump, argc, argv, 1, &l);
  if (rc) return rc;
  dp_ptrset_t *set;
  rc = scan_value(l.a.file, l.v, &set);
  dp_value_release(l.v);
  if (rc) return rc;
  char dev[16];
  size_t count = dp_ptrset_count(set);
  if (l.a.json) {
    json_t *o = json_object(), *devs = json_array(), *ptrs = json_array();
    json_object_set_new(o, "count", json_integer((json_int_t)count));
    for (size_t j = 0; j < dp_ptrset_ndevices(set); j++)
      json_array_append_new(devs, json_string(dp_device_format(dp_ptrset_device(set, j), dev, sizeof dev)));
    for (size_t i = 0; i < count; i++) {
      dp_ptr_info_t p;
      dp_ptrset_get(set, i, &p);
      char ptr[32];
      snprintf(ptr, sizeof ptr, "0x%" PRIxPTR, (uintptr_t)p.base);
      json_t *e = json_object();
      json_object_set_new(e, "device", json_string(dp_device_format(p.device, dev, sizeof dev)));
      json_object_set_new(e, "ptr", json_string(ptr));
      json_object_set_new(e, "nbytes", json_integer((json_int_t)p.nbytes));
      json_object_set_new(e, "path", json_string(p.path ? p.path : ""));
      json_object_set_new(e, "refs", json_integer(p.refs));
      json_array_append_new(ptrs, e);
    }
    json_object_set_new(o, "devices", devs);
    json_object_set_new(o, "pointers", ptrs);
    dp_ptrset_free(set);
    return put_json(o, JSON_INDENT(2), l.a.file);
  } else {
    printf("%-8s  %-18s  %12s  %5s  %s\n", "DEVICE", "POINTER", "BYTES", "REFS", "FIRST PATH");
    for (size_t i = 0; i < count; i++) {
      dp_ptr_info_t p;
      dp_ptrset_get(set, i, &p);
      printf("%-8s  0x%016" PRIxPTR "  %12zu  %5u  %s\n", dp_device_format(p.device, dev, sizeof dev),
             (uintptr_t)p.base, p.nbytes, p.refs, p.path ? p.path : "");
    }
    printf("%zu allocation%s on %zu device%s\n", count, count == 1 ? "" : "s", dp_ptrset_ndevices(set),
           dp_ptrset_ndevices(set) == 1 ? "" : "s");
  }
  dp_ptrset_free(set);
  return fflush(stdout) == 0 ? 0 : data_error("<stdout>", "write failed", -1);
}

/* ---- inspect ---- */

static const char *const help_inspect =
    "usage: devpickle inspect FRAME.dpk\n"
    "\n"
    "Prints the frame's header and its value as a tree, one node a line: the\n"
    "path, the kind and a summary. A node met again is shown as '-> PATH' of\n"
    "its first appearance. Levels deeper than 64 are summarized.\n";

static int cmd_inspect(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("inspect", help_inspect, argc, argv, 0, &l);
  if (rc) return rc;
  const dp_frame_info_t fi = l.info;
  printf("frame: %zu bytes, version %u, %s, payload %" PRIu64 ", table %" PRIu64 ", data %" PRIu64
         ", %u buffer%s, checksum %016" PRIx64 "\n",
         l.size, fi.version, (fi.flags & 1) ? "inline" : "buffers out-of-band", fi.payload_len, fi.table_len, fi.data_len,
         fi.nbuffers, fi.nbuffers == 1 ? "" : "s", fi.checksum);
  inspect_print(stdout, l.v);
  dp_value_release(l.v);
  return fflush(stdout) == 0 ? 0 : data_error("<stdout>", "write failed", -1);
}

/* ---- verify ---- */

static const char *const help_verify =
    "usage: devpickle verify FRAME.dpk\n"
    "\n"
    "Checks a frame completely: header, lengths, checksum, buffer table and\n"
    "every value in the payload, under the default limits (docs/FORMAT.md).\n"
    "Prints one line, 'FILE: ok, ...', and exits 0; otherwise the error line\n"
    "and exit status 1.\n";

static int cmd_verify(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("verify", help_verify, argc, argv, 0, &l);
  if (rc) return rc;
  dp_ptrset_t *set;
  rc = scan_value(l.a.file, l.v, &set);
  dp_value_release(l.v);
  if (rc) return rc;
  const dp_frame_info_t fi = l.info;
  printf("%s: ok, %zu bytes, version %u, %u buffer%s, %zu device pointer%s, %s\n", display(l.a.file), l.size, fi.version,
         fi.nbuffers, fi.nbuffers == 1 ? "" : "s", dp_ptrset_count(set), dp_ptrset_count(set) == 1 ? "" : "s",
         (fi.flags & 1) ? "inline" : "out-of-band");
  dp_ptrset_free(set);
  return 0;
}

/* ---- demo ---- */

static const cmd_t commands[] = {
    {"pack", cmd_pack},       {"unpack", cmd_unpack}, {"dump", cmd_dump},
    {"inspect", cmd_inspect}, {"verify", cmd_verify}, {"demo", demo_run},
};

int main(int argc, char **argv) {
  if (argc < 2) {
    fputs(usage_main, stderr);
    return EXIT_USAGE;
  }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
    fputs(usage_main, stdout);
    return 0;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("devpickle %s (frame format version 1)\n", DP_VERSION_STRING);
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (strcmp(argv[1], commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "devpickle: unknown command '%s'\n\n%s", argv[1], usage_main);
  return EXIT_USAGE;
}
