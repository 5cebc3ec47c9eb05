#define _XOPEN_SOURCE 700
/* The devpickle CLI: subcommands, exit codes and messages. */
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "helpers.h"

static char dir[64];
static const char *cli;

static void setup(void) {
  cli = getenv("DEVPICKLE");
  if (!cli) cli = "build/devpickle";
  strcpy(dir, "/tmp/dp-cli-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}

TestSuite(cli, .init = setup, .fini = teardown);

static char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return strdup("");
  char *buf = malloc(1 << 20);
  size_t len = fread(buf, 1, (1 << 20) - 1, f);
  fclose(f);
  buf[len] = '\0';
  if (n) *n = len;
  return buf;
}

static void spit(const char *name, const char *text) {
  char path[128];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  fputs(text, f);
  fclose(f);
}

typedef struct res {
  int status;
  char *out, *err;
} res_t;

/* Runs `devpickle ARGS` in the temp dir (ARGS is shell syntax). */
static res_t run(const char *args) {
  char cmd[8192], o[128], e[128];
  snprintf(o, sizeof o, "%s/.out", dir);
  snprintf(e, sizeof e, "%s/.err", dir);
  char abs[512];
  cr_assert_not_null(realpath(cli, abs), "CLI %s not built", cli);
  snprintf(cmd, sizeof cmd, "cd %s && (%s %s) >%s 2>%s", dir, abs, args, o, e);
  int st = system(cmd);
  res_t r = {WIFEXITED(st) ? WEXITSTATUS(st) : -1, slurp(o, NULL), slurp(e, NULL)};
  return r;
}

static void res_free(res_t r) {
  free(r.out);
  free(r.err);
}

static const char *simple_json =
    "{\"w\": {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x7f0000001000\", \"nbytes\": 4096,"
    " \"dtype\": \"float32\", \"shape\": [32, 32], \"strides\": [32, 1], \"offset\": 0}},"
    " \"v\": {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x7f0000001000\", \"nbytes\": 4096,"
    " \"dtype\": \"float32\", \"shape\": [32]}},"
    " \"o\": {\"$object\": \"Opt\", \"attrs\": {\"m\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\","
    " \"nbytes\": 8, \"dtype\": \"uint8\", \"shape\": [8]}}}}}";

Test(cli, every_command_answers_help_with_its_usage) {
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify", "demo"};
  for (int i = 0; i < 6; i++) {
    char args[64];
    snprintf(args, sizeof args, "%s --help", cmds[i]);
    res_t r = run(args);
    cr_assert_eq(r.status, 0, "%s --help exited %d", cmds[i], r.status);
    char want[64];
    snprintf(want, sizeof want, "usage: devpickle %s", cmds[i]);
    cr_assert_not_null(strstr(r.out, want), "%s --help says: %s", cmds[i], r.out);
    res_free(r);
  }
  res_t r = run("--help");
  cr_assert_eq(r.status, 0);
  cr_assert_not_null(strstr(r.out, "exit status: 0 ok; 1 bad data"));
  res_free(r);
}

Test(cli, usage_errors_exit_with_status_two) {
  res_t r = run("");
  cr_assert_eq(r.status, 2);
  res_free(r);
  r = run("frobnicate");
  cr_assert_eq(r.status, 2);
  cr_assert_not_null(strstr(r.err, "devpickle: unknown command 'frobnicate'"));
  res_free(r);
  r = run("dump --yaml x.dpk");
  cr_assert_eq(r.status, 2);
  cr_assert_not_null(strstr(r.err, "devpickle dump: unknown option '--yaml'"), "%s", r.err);
  res_free(r);
  r = run("pack v.json");
  cr_assert_eq(r.status, 2);
  cr_assert_not_null(strstr(r.err, "missing -o FRAME.dpk"), "%s", r.err);
  res_free(r);
  r = run("verify");
  cr_assert_eq(r.status, 2);
  res_free(r);
}

Test(cli, pack_then_unpack_then_pack_gives_the_same_bytes_through_stdin_and_stdout) {
  spit("v.json", simple_json);
  res_t r = run("pack v.json -o a.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  r = run("unpack - < a.dpk > back.json");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  r = run("pack - -o - < back.json > b.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  char pa[128], pb[128];
  snprintf(pa, sizeof pa, "%s/a.dpk", dir);
  snprintf(pb, sizeof pb, "%s/b.dpk", dir);
  size_t na, nb;
  char *a = slurp(pa, &na), *b = slurp(pb, &nb);
  cr_assert_gt(na, 40);
  cr_assert(na == nb && memcmp(a, b, na) == 0, "frames differ (%zu vs %zu bytes)", na, nb);
  free(a);
  free(b);
}

Test(cli, dump_json_follows_the_documented_shape_exactly) {
  spit("v.json", simple_json);
  res_free(run("pack v.json -o a.dpk"));
  res_t r = run("dump a.dpk --json");
  cr_assert_eq(r.status, 0, "%s", r.err);
  json_error_t je;
  json_t *j = json_loads(r.out, 0, &je);
  cr_assert_not_null(j, "not JSON: %s", r.out);
  json_t *want = json_loads(
      "{\"count\": 2, \"devices\": [\"cuda:0\", \"cpu\"], \"pointers\": ["
      "{\"device\": \"cuda:0\", \"ptr\": \"0x7f0000001000\", \"nbytes\": 4096, \"path\": \"$.w\", \"refs\": 2},"
      "{\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 8, \"path\": \"$.o.m\", \"refs\": 1}]}",
      0, &je);
  cr_assert(json_equal(j, want), "got %s", r.out);
  json_decref(j);
  json_decref(want);
  res_free(r);
}

Test(cli, plain_dump_is_a_readable_table) {
  spit("v.json", simple_json);
  res_free(run("pack v.json -o a.dpk"));
  res_t r = run("dump a.dpk");
  cr_assert_eq(r.status, 0);
  cr_assert_not_null(strstr(r.out, "DEVICE    POINTER                    BYTES   REFS  FIRST PATH\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "cuda:0    0x00007f0000001000          4096      2  $.w\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "2 allocations on 2 devices"), "%s", r.out);
  res_free(r);
}

Test(cli, inspect_prints_paths_and_marks_shared_nodes) {
  spit("c.json", "{\"$id\": \"r\", \"$value\": [1, {\"$ref\": \"r\"}, \"s\"]}");
  res_free(run("pack c.json -o c.dpk"));
  res_t r = run("inspect c.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "$                                         list (3 items)"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[1]                                      -> $"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[2]                                      str (1 bytes) \"s\""), "%s", r.out);
  res_free(r);
}

Test(cli, verify_reports_ok_or_the_error_line_with_a_byte_offset) {
  spit("v.json", simple_json);
  res_free(run("pack v.json -o a.dpk"));
  res_t r = run("verify a.dpk");
  cr_assert_eq(r.status, 0);
  cr_assert_str_eq(r.out, "a.dpk: ok, 113 bytes, version 1, 2 buffers, 2 device pointers, out-of-band\n");
  res_free(r);
  /* flip one payload byte */
  r = run("verify a.dpk > /dev/null && printf '\\x00' | dd of=a.dpk bs=1 seek=50 conv=notrunc 2>/dev/null");
  res_free(r);
  r = run("verify a.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_eq(strncmp(r.err, "devpickle: a.dpk: checksum mismatch: header says ", 49), 0, "%s", r.err);
  cr_assert_not_null(strstr(r.err, ", at byte 32\n"), "%s", r.err);
  res_free(r);
  r = run("pack v.json -o a.dpk && head -c 100 a.dpk > cut.dpk && cp a.dpk full.dpk");
  res_free(r);
  r = run("dump cut.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: cut.dpk: truncated frame: header announces 52 + 21 + 0 body bytes, 60 present, "
                          "at byte 100\n");
  res_free(r);
  r = run("inspect missing.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: missing.dpk: No such file or directory\n");
  res_free(r);
}

Test(cli, bad_value_json_names_the_problem_and_where) {
  spit("bad.json", "{\"a\": [1, 2,, 3]}");
  res_t r = run("pack bad.json -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: bad.json: invalid JSON: unexpected ',' (line 1, column 13), at byte 12\n");
  res_free(r);
  spit("nb.json",
       "[{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 64, \"dtype\": \"float32\", \"shape\": [4]}},"
       " {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 32, \"dtype\": \"float32\", \"shape\": [4]}}]");
  r = run("pack nb.json -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: nb.json: tensors on cuda:0 0x1000 disagree on nbytes (64 and 32), at $[1]\n");
  res_free(r);
  spit("tag.json", "{\"x\": {\"y\": {\"$tupel\": []}}}");
  r = run("pack tag.json -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: tag.json: unknown tag \"$tupel\" (a plain key starting with '$' needs $dict), "
                          "at $.x.y\n");
  res_free(r);
  spit("ref.json", "[{\"$ref\": \"nope\"}]");
  r = run("pack ref.json -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: ref.json: $ref \"nope\" names no earlier $id, at $[0]\n");
  res_free(r);
  spit("view.json", "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"float64\", \"shape\": [2]}}");
  r = run("pack view.json -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: view.json: tensor view exceeds its storage of 8 bytes, at $\n");
  res_free(r);
}

Test(cli, the_examples_round_trip_and_the_demo_passes) {
  static const char *const ex[] = {"model", "shared_cycle", "mixed", "inline"};
  char cwd[512], abs[512];
  cr_assert_not_null(getcwd(cwd, sizeof cwd));
  cr_assert_not_null(realpath(cli, abs));
  for (int i = 0; i < 4; i++) {
    char args[4096];
    snprintf(args, sizeof args, "pack %s/examples/%s.json -o e.dpk && %s unpack e.dpk > e.json && "
             "%s pack e.json -o f.dpk && cmp e.dpk f.dpk", cwd, ex[i], abs, abs);
    res_t r = run(args);
    cr_assert_eq(r.status, 0, "%s: %s", ex[i], r.err);
    res_free(r);
  }
  res_t r = run("demo");
  cr_assert_eq(r.status, 0, "%s%s", r.out, r.err);
  cr_assert_not_null(strstr(r.out, "demo: all checks passed"));
  res_free(r);
}

/* ---- the JSON path in process, failing every allocation in turn ---- */
#include "../tools/vjson.h"

Test(cli, reading_value_json_fails_cleanly_at_every_allocation) {
  const char *text =
      "{\"$id\": \"r\", \"$value\": {\"$object\": \"M\", \"attrs\": {\"w\": {\"$tensor\": {\"device\": \"cuda:0\", "
      "\"ptr\": \"0x1000\", \"nbytes\": 64, \"dtype\": \"float32\", \"shape\": [4, 4]}}, \"k\": {\"$dict\": [[1, "
      "{\"$bytes\": \"AAE=\"}], [{\"$tuple\": [2, \"x\"]}, [1.5, null, {\"$ref\": \"r\"}]]]}}}}";
  json_error_t je;
  json_t *j = json_loads(text, 0, &je);
  cr_assert_not_null(j, "%s", je.text);
  t_track();
  for (long k = 1;; k++) {
    cr_assert_lt(k, 500);
    t_fail_at = t_alloc_count + k;
    dp_value_t v;
    int is_inline;
    char msg[512];
    int rc = vjson_to_value(j, &v, &is_inline, msg, sizeof msg);
    t_fail_at = 0;
    if (rc == 0) {
      json_t *back = vjson_from_value(v, msg, sizeof msg);
      cr_assert_not_null(back, "%s", msg);
      json_decref(back);
      dp_value_release(v);
      ASSERT_NO_LEAK();
      cr_assert_gt(k, 10);
      break;
    }
    cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s (%s)", k, dp_err_name(rc), msg);
    cr_assert(strstr(msg, ", at $") != NULL, "the failure says where: %s", msg);
    ASSERT_NO_LEAK();
  }
  dp_set_allocator(NULL, NULL);
  json_decref(j);
}
