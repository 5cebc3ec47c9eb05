#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE  /* wait4 */
/* The devpickle CLI: subcommands, exit codes and messages. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <math.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <jansson.h>
#include <xxhash.h>

#include "helpers.h"
#include "net.h"

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

static void path_in(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", dir, name); }

/* slurp of NAME in the temp dir. */
static char *slurp_in(const char *name, size_t *n) {
  char path[256];
  path_in(path, sizeof path, name);
  return slurp(path, n);
}

/* NAME in the temp dir must hold WANT, exactly (what says why it must). */
static void assert_file_is(const char *name, const char *want, const char *what) {
  char *got = slurp_in(name, NULL);
  cr_assert_str_eq(got, want, "%s: %s", name, what);
  free(got);
}

/* SENT and GOT in the temp dir hold the same bytes (a frame received whole). */
static void assert_received_whole(const char *sent, const char *got) {
  size_t na, nb;
  char *x = slurp_in(sent, &na), *y = slurp_in(got, &nb);
  cr_assert_eq(na, nb);
  cr_assert_eq(memcmp(x, y, na), 0, "the received frame differs");
  free(x);
  free(y);
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

/* Runs a shell script in the temp dir, with $D the CLI. */
static res_t run_sh(const char *script) {
  char abs[512], args[8192];
  cr_assert_not_null(realpath(cli, abs));
  snprintf(args, sizeof args, "--version >/dev/null; D='%s'; %s", abs, script);
  return run(args);
}

static void res_free(res_t r) {
  free(r.out);
  free(r.err);
}

/* Runs ARGS; it must exit 0 (its stderr is shown when it does not). */
static void run_ok(const char *args) {
  res_t r = run(args);
  cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
  res_free(r);
}

/* Runs ARGS; it must exit with STATUS, and its stdout and stderr must be
 * OUT and ERR exactly (NULL: not looked at). */
static void run_expect(const char *args, int status, const char *out, const char *err) {
  res_t r = run(args);
  cr_assert_eq(r.status, status, "%s: exit %d: %s", args, r.status, r.err);
  if (out) cr_assert_str_eq(r.out, out, "%s", args);
  if (err) cr_assert_str_eq(r.err, err, "%s", args);
  res_free(r);
}

/* Runs ARGS; it must exit with STATUS with ERR, whole, on stderr and nothing
 * on stdout. */
static void run_err_only(const char *args, int status, const char *err) { run_expect(args, status, "", err); }

/* Runs ARGS; it must exit with STATUS, and its stdout (run_out_has) or its
 * stderr (run_err_has) must hold TEXT. */
static void run_has(const char *args, int status, int on_out, const char *text) {
  res_t r = run(args);
  cr_assert_eq(r.status, status, "%s: exit %d: %s", args, r.status, r.err);
  const char *in = on_out ? r.out : r.err;
  cr_assert_not_null(strstr(in, text), "%s: no \"%s\" in: %s", args, text, in);
  res_free(r);
}
static void run_out_has(const char *args, int status, const char *text) { run_has(args, status, 1, text); }
static void run_err_has(const char *args, int status, const char *text) { run_has(args, status, 0, text); }

/* Writes JSON to NAME and packs it into FRAME, which must succeed. */
static void pack_json(const char *name, const char *json, const char *frame) {
  char args[256];
  spit(name, json);
  snprintf(args, sizeof args, "pack %s -o %s", name, frame);
  run_ok(args);
}

/* Writes JSON to NAME; `pack NAME -o OUT` must fail with exactly WANT. */
static void pack_fails(const char *name, const char *out, const char *json, const char *want) {
  char args[256];
  spit(name, json);
  snprintf(args, sizeof args, "pack %s -o %s", name, out);
  run_expect(args, 1, NULL, want);
}

static const char *simple_json =
    "{\"w\": {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x7f0000001000\", \"nbytes\": 4096,"
    " \"dtype\": \"float32\", \"shape\": [32, 32], \"strides\": [32, 1], \"offset\": 0}},"
    " \"v\": {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x7f0000001000\", \"nbytes\": 4096,"
    " \"dtype\": \"float32\", \"shape\": [32]}},"
    " \"o\": {\"$object\": \"Opt\", \"attrs\": {\"m\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\","
    " \"nbytes\": 8, \"dtype\": \"uint8\", \"shape\": [8]}}}}}";

Test(cli, every_command_answers_help_with_its_usage) {
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify", "demo", "send", "recv"};
  for (int i = 0; i < 8; i++) {
    char args[64];
    snprintf(args, sizeof args, "%s --help", cmds[i]);
    res_t r = run(args);
    cr_assert_eq(r.status, 0, "%s --help exited %d", cmds[i], r.status);
    char want[64];
    snprintf(want, sizeof want, "usage: devpickle %s", cmds[i]);
    cr_assert_not_null(strstr(r.out, want), "%s --help says: %s", cmds[i], r.out);
    res_free(r);
  }
  run_out_has("--help", 0, "exit status: 0 ok; 1 bad data");
}

/* Every command that reads a value refuses one nested deeper than 2,000
 * levels, but only verify's --help said so: pack, unpack, dump and inspect
 * name the limit too. */
Test(cli, every_command_that_reads_a_value_names_the_nesting_limit_in_its_help) {
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify"};
  for (int i = 0; i < 5; i++) {
    char args[64];
    snprintf(args, sizeof args, "%s --help", cmds[i]);
    run_out_has(args, 0, "2,000 levels");
  }
}

Test(cli, a_file_whose_name_starts_with_a_dash_is_named_after_a_double_dash) {
  spit("-v.json", simple_json);
  static const struct {
    const char *args;
    int status;
    int on_out; /* the text is on stdout, else on stderr */
    const char *text;
  } runs[] = {
      {"pack -o -f.dpk -- -v.json", 0, 1, ""},
      {"verify -- -f.dpk", 0, 1, "-f.dpk: ok"},
      {"verify -f.dpk", 2, 0, "unknown option '-f.dpk'"}, /* without --, an option */
      {"verify -- -f.dpk extra", 2, 0, "unexpected argument 'extra'"},
      {"pack -o a.dpk -o b.dpk -- -v.json", 2, 0, "-o given twice"}, /* which one was meant? */
      {"recv 0 --timeout 1 --timeout 2", 2, 0, "--timeout given twice"},
      {"recv 0 --host 127.0.0.1 --host ::1", 2, 0, "--host given twice"},
      {"dump --json --json -- -f.dpk", 2, 0, "devpickle dump: --json given twice"}, /* README: any option */
      {"unpack --compact -- -f.dpk --compact", 2, 0, "unexpected argument '--compact'"},
      {"unpack --compact --compact -- -f.dpk", 2, 0, "devpickle unpack: --compact given twice"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
    res_t r = run(runs[i].args);
    cr_assert_eq(r.status, runs[i].status, "%s: %s", runs[i].args, r.err);
    cr_assert_not_null(strstr(runs[i].on_out ? r.out : r.err, runs[i].text), "%s: %s%s", runs[i].args, r.out, r.err);
    res_free(r);
  }
}

/* The limit a timeout names is the --timeout given, every digit of it:
 * "%g" showed 0.1000001 as 0.1, 1e-7 as 1e-07 and 1000000 as 1e+06. */
Test(cli, a_timeout_names_its_limit_as_given_never_rounded_nor_in_exponent_form) {
  static const struct { const char *arg, *shown; } cases[] = {
      {"0.1000001", "within 0.1000001 s (--timeout)"},
      {"1e-7", "within 0.0000001 s (--timeout)"},
      {"0.50", "within 0.5 s (--timeout)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char args[96];
    snprintf(args, sizeof args, "recv 0 --host 127.0.0.1 --timeout %s -o never.dpk", cases[i].arg);
    run_err_has(args, 1, cases[i].shown);
  }
}

Test(cli, recv_gives_up_after_its_timeout_in_seconds_and_names_the_port_it_bound) {
  res_t r = run("recv 0 --host 127.0.0.1 --timeout 0.3 -o never.dpk");
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_not_null(strstr(r.err, "no frame within 0.3 s (--timeout)"), "%s", r.err);
  cr_assert_null(strstr(r.err, "127.0.0.1:0:"), "the port bound, not 0: %s", r.err);
  res_free(r);
  run_err_has("recv 0 --host 127.0.0.1 --timeout 1e-12 -o never.dpk", 1, "no frame within");
}

/* recv listened for a frame it could never write to -o (a missing
 * directory, a directory, a file under a file): it failed only once a sender
 * had sent the whole frame, or waited for one until its timeout. It says so
 * at once, before listening, with the reason the write would have given. */
Test(cli, recv_refuses_an_output_it_cannot_make_before_it_listens) {
  spit("f", "x");
  res_free(run_sh("mkdir sub"));
  static const struct {
    const char *out, *err;
  } cases[] = {
      {"nodir/x.dpk", "devpickle: nodir/x.dpk: No such file or directory\n"},
      {"sub", "devpickle: sub: Is a directory\n"},
      {"f/x.dpk", "devpickle: f/x.dpk: Not a directory\n"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char args[128];
    snprintf(args, sizeof args, "recv 0 --host 127.0.0.1 --timeout 5 -o %s", cases[i].out);
    run_expect(args, 1, NULL, cases[i].err);
  }
  res_t r = run("recv 0 --host 127.0.0.1 --timeout 0.2 -o sub/new.dpk"); /* one it can make: it listens */
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_not_null(strstr(r.err, "no frame within 0.2 s"), "%s", r.err);
  res_free(r);
}

/* pack and unpack read their whole input before they made their output, so
 * that an -o they could not make (a missing directory, a directory) failed
 * only once a pipe had ended: behind a producer that never closes it, never.
 * They refuse it at once, before reading, as recv does before listening. */
Test(cli, pack_and_unpack_refuse_an_output_they_cannot_make_before_reading_their_input) {
  res_t r = run_sh("mkfifo p && mkdir sub && "
                   "timeout 5 $D pack - -o nodir/x.dpk <>p; echo \"pack $?\"; "
                   "timeout 5 $D unpack - -o sub <>p; echo \"unpack $?\"");
  cr_assert_str_eq(r.out, "pack 1\nunpack 1\n", "%s", r.err);
  cr_assert_str_eq(r.err,
                   "devpickle: nodir/x.dpk: No such file or directory\n"
                   "devpickle: sub: Is a directory\n");
  res_free(r);
}

/* An output whose name the system refuses (a component longer than
 * NAME_MAX) was found only by the rename at the end: pack and unpack read
 * their whole input first and called it "write failed", and recv listened
 * and took a sender's frame before failing. It is refused at once. */
Test(cli, an_output_name_too_long_is_refused_before_reading_or_listening) {
  char name[301], script[2048], want[512];
  memset(name, 'n', 300);
  name[300] = '\0';
  snprintf(script, sizeof script,
           "mkfifo p && timeout 5 $D pack - -o %s <>p; echo \"pack $?\"; "
           "timeout 5 $D unpack - -o %s <>p; echo \"unpack $?\"; "
           "$D recv 0 --host 127.0.0.1 --timeout 5 -o %s; echo \"recv $?\"",
           name, name, name);
  res_t r = run_sh(script);
  cr_assert_str_eq(r.out, "pack 1\nunpack 1\nrecv 1\n", "%s", r.err);
  snprintf(want, sizeof want, "devpickle: %s: File name too long\n", name);
  size_t n = strlen(want);
  cr_assert_eq(strlen(r.err), 3 * n, "%s", r.err);
  for (int i = 0; i < 3; i++) cr_assert_eq(strncmp(r.err + i * n, want, n), 0, "%s", r.err);
  res_free(r);
}

/* pack and unpack opened an -o FIFO only once their output was ready:
 * when the input was bad they never opened it, and the FIFO's reader
 * waited for a writer for good. As a shell's '>' would, they now open it
 * before reading, so the reader sees its end when they fail. */
Test(cli, pack_and_unpack_open_a_fifo_before_reading_so_its_reader_sees_a_failure_end, .timeout = 60) {
  spit("bad.json", "[1,");
  spit("v.json", "[1, {\"$bytes\": \"AAE=\"}]");
  res_t r = run_sh("mkfifo p && "
                   "(timeout 10 cat p > out1; echo \"cat $?\" > c1) & sleep 0.1; $D pack bad.json -o p; echo \"pack $?\"; "
                   "wait; cat c1; printf 'DPKL' > bad.dpk; "
                   "(timeout 10 cat p > out2; echo \"cat $?\" > c2) & sleep 0.1; $D unpack bad.dpk -o p; echo \"unpack $?\"; "
                   "wait; cat c2; "
                   "(timeout 10 cat p > f.dpk; echo \"cat $?\" > c3) & sleep 0.1; $D pack v.json -o p; echo \"pack $?\"; "
                   "wait; cat c3; $D verify f.dpk >/dev/null && wc -c < out1 && wc -c < out2");
  cr_assert_str_eq(r.out, "pack 1\ncat 0\nunpack 1\ncat 0\npack 0\ncat 0\n0\n0\n", "%s", r.err);
  cr_assert_not_null(strstr(r.err, "devpickle: bad.json: invalid JSON: "), "%s", r.err);
  cr_assert_not_null(strstr(r.err, "devpickle: bad.dpk: truncated frame"), "%s", r.err);
  res_free(r);
}

Test(cli, usage_errors_exit_with_status_two) {
  run_expect("", 2, NULL, NULL);
  run_err_has("frobnicate", 2, "devpickle: unknown command 'frobnicate'");
  run_err_has("dump --yaml x.dpk", 2, "devpickle dump: unknown option '--yaml'");
  run_err_has("pack v.json", 2, "missing -o FRAME.dpk");
  run_expect("verify", 2, NULL, NULL);
  /* demo's usage errors read as every command's, and cannot forge a line */
  run_expect("demo --yaml", 2, NULL, "devpickle demo: unknown option '--yaml'\nTry 'devpickle demo --help'.\n");
  run_expect("demo \"$(printf 'x\\nfake')\"", 2, NULL,
             "devpickle demo: unexpected argument 'x\\u000afake'\nTry 'devpickle demo --help'.\n");
  /* nor with a C1 control (CSI to a terminal), a line separator or a byte of no UTF-8 character */
  run_expect("demo \"$(printf 'x\\302\\233\\342\\200\\250\\377fake')\"", 2, NULL,
             "devpickle demo: unexpected argument 'x\\u009b\\u2028\\ufffdfake'\nTry 'devpickle demo --help'.\n");
}

Test(cli, pack_then_unpack_then_pack_gives_the_same_bytes_through_stdin_and_stdout) {
  pack_json("v.json", simple_json, "a.dpk");
  run_ok("unpack - < a.dpk > back.json");
  run_ok("pack - -o - < back.json > b.dpk");
  size_t na, nb;
  char *a = slurp_in("a.dpk", &na), *b = slurp_in("b.dpk", &nb);
  cr_assert_gt(na, 40);
  cr_assert(na == nb && memcmp(a, b, na) == 0, "frames differ (%zu vs %zu bytes)", na, nb);
  free(b);
  /* --compact: one line, and the same frame back */
  run_ok("unpack a.dpk --compact -o c.json");
  size_t nc;
  char *c = slurp_in("c.json", &nc);
  cr_assert(nc > 2 && c[nc - 1] == '\n' && !memchr(c, '\n', nc - 1) && !strstr(c, ": "), "not compact: %s", c);
  free(c);
  run_ok("pack c.json -o c.dpk");
  b = slurp_in("c.dpk", &nb);
  cr_assert(na == nb && memcmp(a, b, na) == 0, "compact JSON packs to another frame");
  free(a);
  free(b);
}

/* A path holding a quote or a backslash (a dict key) is a JSON string in
 * dump --json, escaped as JSON escapes it. */
Test(cli, dump_json_escapes_a_path_as_a_json_string) {
  pack_json("q.json",
            "{\"a\\\"b\\\\\": {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 4, "
            "\"dtype\": \"uint8\", \"shape\": [4]}}}",
            "q.dpk");
  res_t r = run("dump q.dpk --json");
  cr_assert_eq(r.status, 0, "%s", r.err);
  json_error_t je;
  json_t *j = json_loads(r.out, 0, &je);
  cr_assert_not_null(j, "not JSON: %s", r.out);
  const char *path = json_string_value(json_object_get(json_array_get(json_object_get(j, "pointers"), 0), "path"));
  cr_assert_str_eq(path ? path : "", "$[\"a\\\"b\\\\\"]");
  json_decref(j);
  res_free(r);
  run_out_has("dump q.dpk", 0, "  $[\"a\\\"b\\\\\"]\n1 allocation on 1 device\n");
}

Test(cli, dump_json_follows_the_documented_shape_exactly) {
  spit("v.json", simple_json);
  run_ok("pack v.json -o a.dpk");
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
  run_ok("pack v.json -o a.dpk");
  res_t r = run("dump a.dpk");
  cr_assert_eq(r.status, 0);
  cr_assert_not_null(strstr(r.out, "DEVICE    POINTER                    BYTES   REFS  FIRST PATH\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "cuda:0    0x00007f0000001000          4096      2  $.w\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "2 allocations on 2 devices"), "%s", r.out);
  res_free(r);
}

/* inspect's first line says what verify's last word says: inline,
 * buffers out-of-band, or self-contained. */
Test(cli, inspect_names_an_inline_frame_inline_in_its_header) {
  pack_json("i.json",
            "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 2, \"dtype\": \"uint8\", "
            "\"shape\": [2], \"data\": \"AAE=\"}}]",
            "i.dpk");
  res_t r = run("inspect i.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert(strncmp(r.out, "frame: ", 7) == 0 && strstr(r.out, ", version 1, inline, payload ") != NULL &&
            strstr(r.out, ", 1 buffer, checksum ") != NULL, "%s", r.out);
  res_free(r);
  run_out_has("verify i.dpk", 0, ", 1 buffer, 0 device pointers, 1 cpu buffer, inline\n");
}

/* verify's summary counted every storage as a "device pointer", cpu ones
 * too: a frame of one cpu tensor said "1 device pointer". */
Test(cli, verify_counts_cpu_buffers_apart_from_device_pointers) {
  spit("m.json", "[{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", "
                 "\"shape\": [4]}}, {\"$tensor\": {\"device\": \"host:1\", \"ptr\": \"0x1000\", \"nbytes\": 4, "
                 "\"dtype\": \"uint8\", \"shape\": [4]}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", "
                 "\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4]}}, {\"$tensor\": {\"device\": \"cpu\", "
                 "\"ptr\": \"0x20\", \"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [2]}}]");
  res_t r = run_sh("$D pack m.json -o m.dpk && $D verify m.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "m.dpk: ok, "), "%s", r.out);
  cr_assert_not_null(strstr(r.out, ", 4 buffers, 2 device pointers, 2 cpu buffers, out-of-band\n"), "%s", r.out);
  res_free(r);
}

Test(cli, inspect_prints_paths_and_marks_shared_nodes) {
  spit("c.json", "{\"$id\": \"r\", \"$value\": [1, {\"$ref\": \"r\"}, \"s\"]}");
  run_ok("pack c.json -o c.dpk");
  res_t r = run("inspect c.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "$                                         list (3 items)"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[1]                                      -> $"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[2]                                      str (1 byte) \"s\""), "%s", r.out);
  res_free(r);
}

Test(cli, inspect_and_dump_tell_bytes_keys_apart_by_their_base64) {
  spit("k.json", "{\"$dict\": [[{\"$bytes\": \"AA==\"}, {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", "
                 "\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4]}}], [{\"$bytes\": \"AQ==\"}, 1]]}");
  run_ok("pack k.json -o k.dpk");
  res_t r = run("inspect k.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "$[{\"$bytes\":\"AA==\"}]   "), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[{\"$bytes\":\"AQ==\"}]   "), "%s", r.out);
  res_free(r);
  run_out_has("dump k.dpk", 0, "$[{\"$bytes\":\"AA==\"}]\n");
}

Test(cli, inspect_cuts_a_long_str_after_forty_bytes_with_the_ellipsis_paths_use) {
  spit("ls.json", "[\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\", \"short\"]");
  run_ok("pack ls.json -o ls.dpk");
  res_t r = run("inspect ls.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "str (60 bytes) \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\xe2\x80\xa6\"\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "str (5 bytes) \"short\"\n"), "%s", r.out);
  res_free(r);
}

/* U+009B is CSI to a terminal and U+0085 a new line; U+2028 and U+2029 end
 * a line in JavaScript and in many JSON readers: written raw, a name could
 * spoof what a printed path says. */
Test(cli, pack_errors_escape_delete_c1_controls_and_line_separators_in_paths) {
  pack_fails("p.json", "p.dpk", "{\"k\\u009b\\u2028\\u007f\\u2029\\u0085\": [{\"$float\": \"x\"}]}",
             "devpickle: p.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
             "bits, at $[\"k\\u009b\\u2028\\u007f\\u2029\\u0085\"][0]\n");
  pack_fails("r.json", "r.dpk", "{\"$reduce\": \"T\\u009b\\u2028\", \"state\": [{\"$float\": \"x\"}]}",
             "devpickle: r.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
             "bits, at $<reduce T\\u009b\\u2028>[0]\n");
}

Test(cli, inspect_and_dump_escape_delete_c1_controls_and_line_separators) {
  pack_json("e.json",
            "{\"k\\u0085\\u2029\": {\"$reduce\": \"C\\u007f\\u009b\", \"state\": ["
            "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", "
            "\"shape\": [4]}}, \"s\\u2028\\u009b\"]}}",
            "e.dpk");
  res_t r = run("inspect e.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "$[\"k\\u0085\\u2029\"]  "), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "reduced C\\u007f\\u009b\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[\"k\\u0085\\u2029\"]<reduce C\\u007f\\u009b>[1]  str (6 bytes) \"s\\u2028\\u009b\"\n"),
                     "%s", r.out);
  res_free(r);
  run_out_has("dump e.dpk", 0, "$[\"k\\u0085\\u2029\"]<reduce C\\u007f\\u009b>[0]\n");
}

Test(cli, verify_reports_ok_or_the_error_line_with_a_byte_offset) {
  spit("v.json", simple_json);
  run_ok("pack v.json -o a.dpk");
  run_expect("verify a.dpk", 0,
             "a.dpk: ok, 113 bytes, version 1, 2 buffers, 1 device pointer, 1 cpu buffer, out-of-band\n", NULL);
  /* flip one payload byte */
  res_t r = run("verify a.dpk > /dev/null && printf '\\x00' | dd of=a.dpk bs=1 seek=50 conv=notrunc 2>/dev/null");
  res_free(r);
  r = run("verify a.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_eq(strncmp(r.err, "devpickle: a.dpk: checksum mismatch: header says ", 49), 0, "%s", r.err);
  cr_assert_not_null(strstr(r.err, ", at byte 32\n"), "%s", r.err);
  res_free(r);
  r = run("pack v.json -o a.dpk && head -c 100 a.dpk > cut.dpk && cp a.dpk full.dpk");
  res_free(r);
  run_expect("dump cut.dpk", 1, NULL,
             "devpickle: cut.dpk: truncated frame: header announces 52 + 21 + 0 body bytes, 60 present, "
             "at byte 100\n");
  run_expect("inspect missing.dpk", 1, NULL, "devpickle: missing.dpk: No such file or directory\n");
  /* a file that cannot be read says why, for every command */
  r = run("--version >/dev/null && mkdir -p d.dpk");
  res_free(r);
  run_expect("unpack d.dpk", 1, NULL, "devpickle: d.dpk: read error: Is a directory\n");
  run_expect("pack d.dpk -o x.dpk", 1, NULL, "devpickle: d.dpk: read error: Is a directory\n");
  static const char *const streamed[] = {"verify d.dpk", "inspect d.dpk", "dump d.dpk"};
  for (int i = 0; i < 3; i++) { /* the commands that stream the frame say it alike, with no offset */
    run_expect(streamed[i], 1, NULL, "devpickle: d.dpk: read error: Is a directory\n");
  }
}

/* The commands read a frame as a stream and refuse what its header alone
 * shows as soon as the header is in (FORMAT.md, "Reading hostile input"):
 * unknown flags and a data section without the inline flag are named ahead
 * of a body cut short and of a checksum that no longer matches. */
Test(cli, verify_names_a_header_field_fault_ahead_of_a_truncation_and_of_the_checksum) {
  spit("v.json", "[1]");
  res_t r = run_sh("\"$D\" pack v.json -o a.dpk && cp a.dpk d.dpk && "
                   "printf '\\002' | dd of=a.dpk bs=1 seek=6 conv=notrunc 2>/dev/null && head -c 42 a.dpk > cut.dpk && "
                   "printf '\\001' | dd of=d.dpk bs=1 seek=24 conv=notrunc 2>/dev/null");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  run_expect("verify a.dpk", 1, NULL, "devpickle: a.dpk: unknown frame flags 0x0002, at byte 6\n");
  run_expect("verify cut.dpk", 1, NULL, "devpickle: cut.dpk: unknown frame flags 0x0002, at byte 6\n");
  run_expect("unpack cut.dpk", 1, NULL, "devpickle: cut.dpk: unknown frame flags 0x0002, at byte 6\n");
  run_expect("verify d.dpk", 1, NULL, "devpickle: d.dpk: data section in a frame without the inline flag, at byte 24\n");
}

/* The frame commands read a pipe up to the frame's end and at most 64 KiB
 * past it: an endless pipe behind a frame is refused, never read to its end. */
Test(cli, a_frame_followed_by_an_endless_pipe_is_refused_once_64_kib_follow_it_by_every_frame_command,
     .timeout = 60) {
  spit("v.json", "[1]");
  run_ok("pack v.json -o f.dpk");
  static const char *const cmds[] = {"verify", "dump", "inspect", "unpack", "send"};
  for (int i = 0; i < 5; i++) {
    char script[160];
    /* timeout: a command that reads on to the pipe's end exits 124, not hangs the test */
    snprintf(script, sizeof script, "cat f.dpk /dev/zero | timeout 20 \"$D\" %s -%s", cmds[i],
             i == 4 ? " 127.0.0.1:1" : "");
    res_t r = run_sh(script);
    cr_assert_eq(r.status, 1, "%s: %s", cmds[i], r.err);
    cr_assert_str_eq(r.err, "devpickle: <stdin>: more than 65536 bytes after the end of the frame (a stream holds "
                            "one frame; the rest was not read), at byte 43\n", "%s", cmds[i]);
    res_free(r);
  }
  /* up to 64 KiB are read and counted, as a file's are */
  res_t r = run_sh("(cat f.dpk; head -c 65536 /dev/zero) | \"$D\" verify -");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: <stdin>: 65536 bytes after the end of the frame, at byte 43\n");
  res_free(r);
  r = run_sh("cat f.dpk | \"$D\" verify -");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_str_eq(r.out, "<stdin>: ok, 43 bytes, version 1, 0 buffers, 0 device pointers, 0 cpu buffers, self-contained\n");
  res_free(r);
  /* a regular file says how much follows (its size), however much it is */
  r = run_sh("{ cat f.dpk; head -c 1000000 /dev/zero; } > big.dpk && \"$D\" verify big.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: big.dpk: 1000000 bytes after the end of the frame, at byte 43\n");
  res_free(r);
}

/* A header announcing more than 2^64 bytes was read on to the pipe's end
 * (to report the input's length as DP_ETRUNC's offset): behind /dev/zero
 * no command ever returned. It is refused from the header. */
Test(cli, a_header_announcing_more_than_2_64_bytes_before_an_endless_pipe_is_refused_at_once, .timeout = 60) {
  static const char *const cmds[] = {"verify", "dump", "inspect", "unpack"};
  for (int i = 0; i < 4; i++) {
    char script[320];
    snprintf(script, sizeof script,
             "{ printf 'DPKL\\001\\000\\000\\000'; head -c 16 /dev/zero | tr '\\000' '\\377'; "
             "head -c 16 /dev/zero; cat /dev/zero; } | timeout 20 \"$D\" %s -", cmds[i]);
    res_t r = run_sh(script);
    cr_assert_eq(r.status, 1, "%s: %s", cmds[i], r.err);
    cr_assert_str_eq(r.err, "devpickle: <stdin>: header announces 18446744073709551615 + 18446744073709551615 + 0 "
                            "body bytes: more than a frame can hold (its length must fit in 64 bits), at byte 8\n",
                     "%s", cmds[i]);
    res_free(r);
  }
}

/* A terminal on stdin would wait, silently, for a frame no one types. */
/* A pseudo-terminal: its master in *m, the name of its other end returned. */
static const char *open_pty(int *m) {
  *m = posix_openpt(O_RDWR | O_NOCTTY);
  cr_assert_geq(*m, 0);
  cr_assert_eq(grantpt(*m), 0);
  cr_assert_eq(unlockpt(*m), 0);
  const char *slave = ptsname(*m);
  cr_assert_not_null(slave);
  return slave;
}

Test(cli, a_frame_command_refuses_a_terminal_on_stdin_instead_of_waiting_on_it) {
  int m;
  const char *slave = open_pty(&m);
  char script[512];
  snprintf(script, sizeof script, "timeout 20 \"$D\" verify - < %s", slave);
  res_t r = run_sh(script);
  close(m);
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: <stdin>: is a terminal: a frame is binary (name a file, or pipe a frame in)\n");
  res_free(r);
}

/* A terminal named as the frame (/dev/stdin, the terminal's own name) is
 * stdin's terminal all the same: refused, where every frame command waited
 * on it for a frame that a user could not type. */
Test(cli, a_frame_command_refuses_a_terminal_by_any_name) {
  int m;
  const char *slave = open_pty(&m);
  char script[1024];
  snprintf(script, sizeof script,
           "for c in verify dump inspect unpack; do timeout 20 \"$D\" $c /dev/stdin < %s; echo $?; done;"
           " timeout 20 \"$D\" verify %s; echo $?; timeout 20 \"$D\" send /dev/stdin 127.0.0.1:1 < %s; echo $?",
           slave, slave, slave);
  res_t r = run_sh(script);
  close(m);
  cr_assert_str_eq(r.out, "1\n1\n1\n1\n1\n1\n");
  char want[1024];
  const char *line = "devpickle: /dev/stdin: is a terminal: a frame is binary (name a file, or pipe a frame in)\n";
  snprintf(want, sizeof want, "%s%s%s%sdevpickle: %s: is a terminal: a frame is binary (name a file, or pipe a frame in)\n%s",
           line, line, line, line, slave, line);
  cr_assert_str_eq(r.err, want);
  res_free(r);
}

/* `devpickle verify /dev/stdout | cat` opened the pipe it writes into by
 * that name, for reading: it held the writing end itself, so the end of
 * its input never came and every reading command waited forever. An input
 * that names a descriptor open for writing only is refused, as an output
 * open for reading only is; one open for reading is read as before. */
Test(cli, an_input_naming_a_descriptor_open_for_writing_only_is_refused_instead_of_waiting_on_itself) {
  pack_json("w.json", "[1]", "w.dpk");
  res_t r = run_sh("for c in verify dump inspect unpack; do { timeout 5 \"$D\" $c /dev/stdout 2>>e.txt; echo $? >>st.txt; } | cat; done;"
                   " { timeout 5 \"$D\" pack /dev/stdout -o x.dpk 2>>e.txt; echo $? >>st.txt; } | cat;"
                   " { timeout 5 \"$D\" send /dev/fd/1 127.0.0.1:1 2>>e.txt; echo $? >>st.txt; } | cat;"
                   " cat st.txt e.txt; \"$D\" verify /dev/fd/3 3<w.dpk");
  const char *line = "devpickle: /dev/stdout: descriptor 1 is open for writing only, so it cannot be the input\n";
  char want[1024];
  snprintf(want, sizeof want, "1\n1\n1\n1\n1\n1\n%s%s%s%s%sdevpickle: /dev/fd/1: descriptor 1 is open for writing only, so it cannot be the input\n"
           "/dev/fd/3: ok, %s", line, line, line, line, line, "");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_eq(strncmp(r.out, want, strlen(want)), 0, "%s", r.out);
  res_free(r);
}

/* A binary frame is not written to a terminal unless asked for (-o -). */
Test(cli, recv_refuses_a_terminal_on_stdout_unless_told_with_dash_o_dash) {
  int m;
  const char *slave = open_pty(&m);
  char script[512];
  snprintf(script, sizeof script, "timeout 20 \"$D\" recv 0 > %s", slave);
  res_t r = run_sh(script);
  cr_assert_eq(r.status, 2, "%s", r.err);
  cr_assert(strstr(r.err, "devpickle recv: stdout is a terminal: a frame is binary (-o FRAME.dpk, or -o - to write it "
                          "there)\n") == r.err, "%s", r.err);
  res_free(r);
  /* with -o -, it listens (and times out, no sender here) */
  snprintf(script, sizeof script, "timeout 20 \"$D\" recv 0 -o - --timeout 0.2 > %s", slave);
  r = run_sh(script);
  close(m);
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert(strstr(r.err, "listening on port"), "%s", r.err);
  res_free(r);
}

/* A count of one reads "1 byte", "1 buffer", never "1 bytes". */
Test(cli, a_count_of_one_is_written_in_the_singular_in_output_and_messages) {
  pack_json("one.json",
            "{\"s\": \"x\", \"t\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 1,"
            " \"dtype\": \"int8\", \"shape\": [1]}}}",
            "one.dpk");
  res_t r = run("inspect one.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, ", 1 buffer, checksum "), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$.s                                       str (1 byte) \"x\"\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$.t                                       tensor int8[1] cpu 0x10 (1 byte) offset 0\n"),
                     "%s", r.out);
  res_free(r);
  r = run("verify one.dpk");
  cr_assert_str_eq(r.out, "one.dpk: ok, 64 bytes, version 1, 1 buffer, 0 device pointers, 1 cpu buffer, out-of-band\n");
  res_free(r);
  run_err_has("send one.dpk 127.0.0.1:1", 1, "devpickle: one.dpk: the frame's 1 buffer is out-of-band: ");
  r = run_sh("printf D | \"$D\" verify -");
  cr_assert_str_eq(r.err, "devpickle: <stdin>: truncated frame: 1 byte, the header needs 40, at byte 1\n");
  res_free(r);
  r = run_sh("(cat one.dpk; printf x) | \"$D\" dump -");
  cr_assert_str_eq(r.err, "devpickle: <stdin>: 1 byte after the end of the frame, at byte 64\n");
  res_free(r);
  r = run_sh("(cat one.dpk; printf x) > two.dpk; \"$D\" unpack two.dpk");
  cr_assert_str_eq(r.err, "devpickle: two.dpk: 1 byte after the end of the frame, at byte 64\n");
  res_free(r);
  pack_fails("s.json", "s.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\","
             " \"shape\": [2, 1], \"strides\": [1]}}",
             "devpickle: s.json: tensor has 1 stride for 2 dimensions, at $\n");
  pack_fails("d.json", "d.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\","
             " \"shape\": [2], \"data\": \"AA==\"}}",
             "devpickle: d.json: tensor data has 1 byte, nbytes says 2, at $\n");
  r = run("demo");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_null(strstr(r.out, "(s)"), "%s", r.out);
  res_free(r);
}

Test(cli, base64_with_bits_past_its_last_byte_and_a_name_given_twice_are_refused_never_changed) {
  pack_fails("pad.json", "x.dpk", "[{\"$bytes\": \"AA==\"}, {\"$bytes\": \"AB==\"}]",
             "devpickle: pad.json: $bytes must be a canonical base64 string (RFC 4648, padded, unused bits zero), "
             "at $[1]\n");
  pack_fails("pad2.json", "x.dpk", "{\"$bytes\": \"AAF=\"}",
             "devpickle: pad2.json: $bytes must be a canonical base64 string (RFC 4648, padded, unused bits zero), "
             "at $\n");
  pack_fails("ids.json", "x.dpk", "{\"$id\": \"a\", \"$value\": {\"$id\": \"b\", \"$value\": [{\"$ref\": \"a\"}]}}",
             "devpickle: ids.json: $id \"a\" names an $id: a node has one name, at $\n");
}

/* VALUE_JSON.md: a node has one name. An $id whose $value was a $ref gave
 * the node named by the $ref a second name ("b" below), and an $id whose
 * $value was a $ref to itself said that the $ref "names no earlier $id",
 * though the $id stood just before it. Both are refused as an $id of an $id
 * is. */
Test(cli, an_id_whose_value_is_a_ref_is_refused_as_a_second_name) {
  pack_fails("two.json", "x.dpk", "[{\"$id\": \"a\", \"$value\": []}, {\"$id\": \"b\", \"$value\": {\"$ref\": \"a\"}}]",
             "devpickle: two.json: $id \"b\" names a $ref: a node has one name (refer to it by \"a\"), at $[1]\n");
  pack_fails("self.json", "x.dpk", "{\"$id\": \"x\", \"$value\": {\"$ref\": \"x\"}}",
             "devpickle: self.json: $id \"x\" names a $ref to itself: a node cannot be its own value, at $\n");
}

/* A $ref that is no string said "$ref (not a string) names no earlier $id";
 * it says what a $ref takes, as $id, $object and $reduce do of their names. */
Test(cli, a_ref_that_is_no_string_says_it_must_be_a_name) {
  pack_fails("n.json", "x.dpk", "[{\"$id\": \"5\", \"$value\": []}, {\"$ref\": 5}]",
             "devpickle: n.json: $ref must be the string name of an earlier $id, at $[1]\n");
}

Test(cli, bad_value_json_names_the_problem_and_where) {
  pack_fails("bad.json", "x.dpk", "{\"a\": [1, 2,, 3]}",
             "devpickle: bad.json: invalid JSON: unexpected ',' (line 1, column 13), at byte 12\n");
  pack_fails("nb.json", "x.dpk",
             "[{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 64, \"dtype\": \"float32\", "
             "\"shape\": [4]}},"
             " {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 32, \"dtype\": \"float32\", "
             "\"shape\": [4]}}]",
             "devpickle: nb.json: tensors on cuda:0 0x1000 disagree on nbytes (64 and 32), at $[1]\n");
  pack_fails("tag.json", "x.dpk", "{\"x\": {\"y\": {\"$tupel\": []}}}",
             "devpickle: tag.json: unknown tag \"$tupel\" (a plain key starting with '$' needs $dict), "
             "at $.x.y\n");
  /* $value is $id's field: "unknown tag" sent the reader looking for a typo */
  pack_fails("val.json", "x.dpk", "{\"x\": {\"$value\": []}}",
             "devpickle: val.json: $value without $id: a named node is {\"$id\": \"name\", \"$value\": V}, "
             "at $.x\n");
  pack_fails("valu.json", "x.dpk", "{\"x\": {\"$valuf\": []}}",
             "devpickle: valu.json: unknown tag \"$valuf\" (a plain key starting with '$' needs $dict), at $.x\n");
  pack_fails("ref.json", "x.dpk", "[{\"$ref\": \"nope\"}]",
             "devpickle: ref.json: $ref \"nope\" names no earlier $id, at $[0]\n");
  pack_fails("dev.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cuda:256\", \"ptr\": \"0x1\", \"nbytes\": 1, \"dtype\": \"int8\", "
             "\"shape\": [1]}}",
             "devpickle: dev.json: tensor device must be \"cpu\", \"cuda:N\" or \"host:N\" (N 0..255), at $\n");
  pack_fails("view.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"float64\", "
             "\"shape\": [2]}}",
             "devpickle: view.json: tensor view exceeds its storage of 8 bytes, at $\n");
}

/* Editors on some systems start UTF-8 with a byte order mark: it is
 * skipped (offsets count it, columns do not); UTF-16 is named as such. */
Test(cli, pack_skips_a_utf8_byte_order_mark_and_names_a_utf16_one_and_any_byte_it_cannot_show) {
  spit("plain.json", "{\"a\": [1, \"\xC3\xA9\"]}");
  spit("bom.json", "\xEF\xBB\xBF{\"a\": [1, \"\xC3\xA9\"]}");
  res_t r = run_sh("\"$D\" pack plain.json -o plain.dpk && \"$D\" pack bom.json -o bom.dpk && cmp plain.dpk bom.dpk");
  cr_assert_eq(r.status, 0, "a byte order mark changes nothing: %s", r.err);
  res_free(r);
  pack_fails("bad.json", "x.dpk", "\xEF\xBB\xBF[1,]",
             "devpickle: bad.json: invalid JSON: a value expected after ',', not ']' (a trailing comma) "
             "(line 1, column 4), at byte 6\n");
  pack_fails("u16.json", "x.dpk", "\xFF\xFE[",
             "devpickle: u16.json: invalid JSON: a UTF-16 or UTF-32 byte order mark: value JSON is UTF-8 "
             "(line 1, column 1), at byte 0\n");
  pack_fails("e.json", "x.dpk", "[\xC3\xA9]",
             "devpickle: e.json: invalid JSON: unexpected '\xC3\xA9' (line 1, column 2), at byte 1\n");
  pack_fails("c3.json", "x.dpk", "[\xC3]",
             "devpickle: c3.json: invalid JSON: unexpected byte 0xC3 (line 1, column 2), at byte 1\n");
  r = run_sh("printf '[1]\\000' > nul.json; \"$D\" pack nul.json -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: nul.json: invalid JSON: end of input expected, not byte 0x00 "
                          "(line 1, column 4), at byte 3\n");
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
    run_ok(args);
  }
  run_out_has("demo", 0, "demo: all checks passed");
}

/* ---- helpers for frames built in process ---- */

/* The suite and the CLI are built alike: under AddressSanitizer (make
 * test-asan), whose shadow memory and redzones cost about 2x, memory bounds
 * are doubled. */
#if defined(__SANITIZE_ADDRESS__)
#define T_MEM_SCALE 2
#else
#define T_MEM_SCALE 1
#endif

/* Builds a frame in a child process: the test process stays small, so the
 * CLI it forks later starts small and its peak memory is its own. The
 * builder returns 0 on success. */
static void build_in_child(int (*build)(void)) {
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) _exit(build());
  int st;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "building the frame failed (%d)", st);
}

/* Pickles v (taking the reference) into dir/name; 0 on success, else 1 with
 * e (when given) saying why if the pickler failed. No Criterion asserts: the
 * builders of build_in_child call it in a child. */
static int write_frame_raw(const char *name, dp_value_t v, int is_inline, dp_error_t *e) {
  dp_frame_t *f;
  dp_pickle_opts_t po = {is_inline ? DP_PICKLE_INLINE : 0, 0, NULL, NULL};
  if (dp_frame_new(&f, e) != 0) {
    dp_value_release(v);
    return 1;
  }
  int bad = dp_pickle(v, &po, f, e) != 0;
  if (!bad) {
    size_t n;
    const uint8_t *b = dp_frame_data(f, &n);
    char path[256];
    path_in(path, sizeof path, name);
    FILE *out = fopen(path, "wb");
    bad = !out || fwrite(b, 1, n, out) != n;
    if (out) bad |= fclose(out) != 0;
  }
  dp_frame_free(f);
  dp_value_release(v);
  return bad;
}

static void write_frame(const char *name, dp_value_t v, int is_inline) {
  dp_error_t e;
  dp_error_clear(&e);
  cr_assert_eq(write_frame_raw(name, v, is_inline, &e), 0, "writing %s: %s", name, e.message);
}

static int same_file(const char *a, const char *b) {
  char pa[256], pb[256];
  path_in(pa, sizeof pa, a);
  path_in(pb, sizeof pb, b);
  FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
  int same = fa && fb;
  while (same) {
    int ca = getc(fa), cb = getc(fb);
    if (ca != cb) same = 0;
    if (ca == EOF) break;
  }
  if (fa) fclose(fa);
  if (fb) fclose(fb);
  return same;
}

/* `unpack F | pack - -o G` and G must equal F. */
static void assert_round_trip(const char *frame) {
  char args[512];
  snprintf(args, sizeof args, "unpack %s > rt.json", frame);
  run_ok(args);
  run_ok("pack rt.json -o rt.dpk");
  cr_assert(same_file(frame, "rt.dpk"), "%s changed in unpack | pack", frame);
}

/* Runs the CLI with argv (no shell) in dir, stdout to /dev/null, under an
 * optional file-size limit; returns the exit status and the child's peak
 * resident memory in KiB (its rusage, as RUSAGE_CHILDREN reports it). */
static int run_child(const char *const *argv, long fsize, long *maxrss_kb, char *err, size_t errsize) {
  char abs[512], errpath[256];
  cr_assert_not_null(realpath(cli, abs));
  path_in(errpath, sizeof errpath, ".childerr");
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    if (chdir(dir) != 0) _exit(126);
    int dn = open("/dev/null", O_WRONLY), en = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(dn, 1);
    dup2(en, 2);
    if (fsize > 0) {
      struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
      setrlimit(RLIMIT_FSIZE, &rl);
    }
    execv(abs, (char *const *)argv);
    _exit(127);
  }
  int st;
  struct rusage ru;
  cr_assert_eq(wait4(pid, &st, 0, &ru), pid);
  if (maxrss_kb) *maxrss_kb = ru.ru_maxrss;
  if (err) {
    char *e = slurp(errpath, NULL);
    snprintf(err, errsize, "%s", e);
    free(e);
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

static int count_entries(void) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* ---- item 14: writes never lose data ---- */

Test(cli, every_write_to_stdout_is_checked_and_a_full_device_is_an_error) {
  spit("v.json", simple_json);
  run_ok("pack v.json -o a.dpk");
  /* an output of many buffers whose failed write leaves nothing to flush at the end: the error is
     the stream's, not the last flush's */
  char *big = malloc(400000);
  size_t k = (size_t)sprintf(big, "[");
  for (int i = 0; i < 20000; i++) k += (size_t)sprintf(big + k, "%s\"%d%d%d\"", i ? ", " : "", i, i, i);
  strcpy(big + k, "]");
  spit("big.json", big);
  free(big);
  run_ok("pack big.json -o big.dpk");
  static const char *const cmds[] = {"verify a.dpk", "--help", "--version", "verify --help", "unpack a.dpk",
                                     "dump a.dpk",   "dump a.dpk --json", "inspect a.dpk", "pack v.json -o -",
                                     "inspect big.dpk", "unpack big.dpk"};
  for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
    char args[128];
    snprintf(args, sizeof args, "%s > /dev/full", cmds[i]);
    run_expect(args, 1, NULL, "devpickle: <stdout>: write failed: No space left on device\n");
  }
}

Test(cli, a_write_that_fails_half_way_leaves_the_old_file_intact_even_when_it_is_the_input) {
  /* an input larger than the file-size limit, packed over itself */
  size_t n = 200000;
  char *big = malloc(n + 64);
  size_t k = (size_t)sprintf(big, "[");
  while (k < n) k += (size_t)sprintf(big + k, "\"%06zu\", ", k);
  strcpy(big + k, "0]");
  spit("big.json", big);
  char err[512];
  long rss;
  const char *const argv[] = {"devpickle", "pack", "big.json", "-o", "big.json", NULL};
  int st = run_child(argv, 65536, &rss, err, sizeof err);
  cr_assert_eq(st, 1, "exit %d: %s", st, err);
  cr_assert_str_eq(err, "devpickle: big.json: write failed: File too large\n");
  assert_file_is("big.json", big, "the input was damaged");
  cr_assert_eq(count_entries(), 1, "a temporary file was left behind");
  /* the same for an existing frame and for unpack's -o */
  spit("v.json", simple_json);
  run_ok("pack v.json -o old.dpk");
  run_ok("pack v.json -o keep.dpk");
  run_ok("pack big.json -o a.dpk");
  spit("old.json", big);
  const char *const argv2[] = {"devpickle", "pack", "big.json", "-o", "old.dpk", NULL};
  cr_assert_eq(run_child(argv2, 65536, NULL, err, sizeof err), 1, "%s", err);
  cr_assert(same_file("old.dpk", "keep.dpk"), "the existing frame was damaged");
  const char *const argv3[] = {"devpickle", "unpack", "a.dpk", "-o", "old.json", NULL};
  cr_assert_eq(run_child(argv3, 65536, NULL, err, sizeof err), 1, "%s", err);
  cr_assert_str_eq(err, "devpickle: old.json: write failed: File too large\n");
  cr_assert(same_file("old.json", "big.json"), "the existing JSON was damaged");
  cr_assert_eq(count_entries(), 6, "a temporary file was left behind");
  free(big);
}

Test(cli, an_output_replaced_whole_keeps_its_mode_and_a_link_keeps_its_target) {
  spit("v.json", simple_json);
  run_ok("pack v.json -o t.dpk");
  char path[256], link_path[256];
  path_in(path, sizeof path, "t.dpk");
  path_in(link_path, sizeof link_path, "l.dpk");
  cr_assert_eq(chmod(path, 0640), 0);
  cr_assert_eq(symlink("t.dpk", link_path), 0);
  run_ok("pack v.json -o l.dpk");
  struct stat st;
  cr_assert_eq(lstat(link_path, &st), 0);
  cr_assert(S_ISLNK(st.st_mode), "the link was replaced by a file");
  cr_assert_eq(stat(path, &st), 0);
  cr_assert_eq(st.st_mode & 07777, 0640, "mode %o", st.st_mode & 07777);
  cr_assert_eq(count_entries(), 3);
}

/* A file replaced whole was left owned by whoever ran the command: root's
 * `pack -o` over a user's file gave it to root, read-only to its user under
 * the mode it kept. Owner and group are kept where the system lets the
 * process give them (root here; elsewhere the test has nothing to show). */
Test(cli, an_output_replaced_whole_keeps_its_owner_and_group_where_the_system_lets_it) {
  if (geteuid() != 0) cr_skip_test("giving a file to another user takes root");
  spit("v.json", simple_json);
  res_free(run_sh("\"$D\" pack v.json -o t.dpk && \"$D\" unpack t.dpk -o t.json"));
  char dpk[256], json[256];
  path_in(dpk, sizeof dpk, "t.dpk");
  path_in(json, sizeof json, "t.json");
  cr_assert_eq(chown(dpk, 1234, 2345), 0);
  cr_assert_eq(chown(json, 1234, 2345), 0);
  cr_assert_eq(chmod(dpk, 0604), 0);
  res_t r = run_sh("\"$D\" pack v.json -o t.dpk && \"$D\" unpack t.dpk -o t.json");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  struct stat st;
  cr_assert_eq(stat(dpk, &st), 0);
  cr_assert(st.st_uid == 1234 && st.st_gid == 2345, "pack gave the file to %u:%u", (unsigned)st.st_uid,
            (unsigned)st.st_gid);
  cr_assert_eq(st.st_mode & 07777, 0604, "mode %o", st.st_mode & 07777);
  cr_assert_eq(stat(json, &st), 0);
  cr_assert(st.st_uid == 1234 && st.st_gid == 2345, "unpack gave the file to %u:%u", (unsigned)st.st_uid,
            (unsigned)st.st_gid);
  cr_assert_eq(count_entries(), 3);
}

/* ---- item 13: what verify accepts, unpack | pack gives back; what pack writes, verify accepts ---- */

Test(cli, a_str_holding_nul_bytes_unpacks_to_json_that_packs_back_to_the_same_bytes) {
  dp_value_t l, s, k, d;
  dp_error_t e;
  cr_assert_eq(dp_list_new(0, &l, &e), 0);
  cr_assert_eq(dp_str_new("a\0b", 3, &s, &e), 0);
  cr_assert_eq(dp_list_append(l, s, &e), 0);
  cr_assert_eq(dp_dict_new(0, &d, &e), 0);
  cr_assert_eq(dp_str_new("k\0ey", 4, &k, &e), 0);
  cr_assert_eq(dp_dict_set(d, k, dp_int(1), &e), 0);
  cr_assert_eq(dp_list_append(l, d, &e), 0);
  write_frame("nul.dpk", l, 0);
  assert_round_trip("nul.dpk");
  res_t r = run("unpack nul.dpk");
  cr_assert_not_null(strstr(r.out, "\"a\\u0000b\""), "%s", r.out);
  res_free(r);
}

Test(cli, class_and_attribute_names_holding_nul_are_refused_by_pack) {
  pack_fails("c.json", "c.dpk", "{\"$object\": \"Cls\\u0000Evil\", \"attrs\": {\"a\": 1}}",
             "devpickle: c.json: class name contains a NUL byte, at $\n");
  pack_fails("a.json", "a.dpk", "{\"$object\": \"Cls\", \"attrs\": {\"a\\u0000x\": 1, \"a\\u0000y\": 2}}",
             "devpickle: a.json: attribute name contains a NUL byte, at $[\"a\\u0000x\"]\n");
}

static dp_value_t nest(int levels, int tuples) {
  dp_value_t v = dp_none();
  dp_error_t e;
  for (int i = 0; i < levels; i++) {
    dp_value_t c;
    if (tuples) {
      cr_assert_eq(dp_tuple_new(i ? 1 : 0, &c, &e), 0);
      if (i) cr_assert_eq(dp_seq_set(c, 0, v, &e), 0);
    } else {
      cr_assert_eq(dp_list_new(1, &c, &e), 0);
      if (i) cr_assert_eq(dp_list_append(c, v, &e), 0);
    }
    v = c;
  }
  return v;
}

Test(cli, nesting_within_the_cli_limit_round_trips_and_deeper_is_refused_by_every_command) {
  write_frame("t1100.dpk", nest(1100, 1), 0);
  assert_round_trip("t1100.dpk");
  /* 2,000 levels with children and an empty list inside: the limit exactly */
  write_frame("l2001.dpk", nest(2001, 0), 0);
  assert_round_trip("l2001.dpk");
  write_frame("l2002.dpk", nest(2002, 0), 0);
  static const char *const cmds[] = {"verify", "unpack", "dump", "inspect"};
  for (int i = 0; i < 4; i++) {
    char args[64];
    snprintf(args, sizeof args, "%s l2002.dpk", cmds[i]);
    run_expect(args, 1, NULL, "devpickle: l2002.dpk: nesting depth exceeds the limit of 2000, at byte 2040\n");
  }
  /* and pack refuses what verify refuses */
  char *deep = malloc(8000);
  memset(deep, '[', 2002);
  memset(deep + 2002, ']', 2002);
  deep[4004] = '\0';
  spit("deep.json", deep);
  free(deep);
  res_t r = run("pack deep.json -o d.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_not_null(strstr(r.err, "containers nested deeper than 2000 levels, at $[0][0]"), "%s", r.err);
  /* the path keeps its head and its tail (docs/VALUE_JSON.md, "Paths") */
  cr_assert_not_null(strstr(r.err, "[0]<…1681 steps…>[0]"), "%s", r.err);
  size_t len = strlen(r.err);
  cr_assert(len < 1200 && strcmp(r.err + len - 4, "[0]\n") == 0, "%s", r.err);
  res_free(r);
}

Test(cli, nan_dict_keys_with_different_payloads_stay_distinct_through_unpack_and_pack) {
  dp_value_t d;
  dp_error_t e;
  cr_assert_eq(dp_dict_new(0, &d, &e), 0);
  uint64_t bits[3] = {0x7ff8000000000001ull, 0xfff8000000000000ull, 0};
  for (int i = 0; i < 3; i++) {
    double f = NAN;
    if (bits[i]) memcpy(&f, &bits[i], sizeof f);
    cr_assert_eq(dp_dict_set(d, dp_float(f), dp_int(i), &e), 0, "%s", e.message);
  }
  cr_assert_eq(dp_dict_len(d), 3);
  write_frame("nan.dpk", d, 0);
  assert_round_trip("nan.dpk");
  res_t r = run("unpack nan.dpk");
  cr_assert_not_null(strstr(r.out, "\"$float\": \"0x7ff8000000000001\""), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "\"$float\": \"0xfff8000000000000\""), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "\"$float\": \"nan\""), "%s", r.out);
  res_free(r);
}

Test(cli, pack_refuses_a_ptr_or_nbytes_that_do_not_fit_and_writes_nothing) {
  pack_fails("p.json", "p.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x10000000000000000\", \"nbytes\": 8, "
             "\"dtype\": \"uint8\", \"shape\": [8]}}",
             "devpickle: p.json: tensor ptr 0x10000000000000000 does not fit in 64 bits, at $\n");
  /* named by its significant digits: leading zeros (allowed, any number)
   * filled the 64 bytes shown */
  pack_fails("z.json", "z.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x0000000000000000000000000000000000000000"
             "0000000000000000000000000000000000000000ab000000000000000\", \"nbytes\": 8, "
             "\"dtype\": \"uint8\", \"shape\": [8]}}",
             "devpickle: z.json: tensor ptr 0xab000000000000000 does not fit in 64 bits, at $\n");
  /* and a string that is no hex number is not called too large for one */
  pack_fails("g.json", "g.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x10000000000000000g\", \"nbytes\": 8, "
             "\"dtype\": \"uint8\", \"shape\": [8]}}",
             "devpickle: g.json: tensor ptr must be a hex string such as \"0x7f0000001000\", at $\n");
  pack_fails("n.json", "n.dpk",
             "{\"x\": [{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 9223372036854775807, "
             "\"dtype\": \"uint8\", \"shape\": [8]}}]}",
             "devpickle: n.json: tensor nbytes 9223372036854775807 exceeds 2^62, the largest buffer a "
             "frame can describe, at $.x[0]\n");
  cr_assert_eq(count_entries(), 4, "a frame was written");
}

/* Fields the library parses as C strings were read only up to a NUL byte
 * (JSON strings may hold one): "nan\u0000junk" packed as a NaN,
 * "cuda:0\u0000x" as cuda:0, "uint8\u0000x" as uint8, and a $tensor field
 * "device\u0000x" passed for "device" and was ignored. None of them is what
 * VALUE_JSON.md allows; each is refused, naming what is wrong. */
Test(cli, pack_refuses_floats_devices_dtypes_and_tensor_fields_with_a_nul_byte_instead_of_cutting_them) {
  pack_fails("f.json", "f.dpk", "[{\"$float\": \"nan\\u0000junk\"}]",
             "devpickle: f.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
             "bits, at $[0]\n");
  pack_fails("d.json", "d.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\\u0000x\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"uint8\", "
             "\"shape\": [8]}}",
             "devpickle: d.json: tensor device must be \"cpu\", \"cuda:N\" or \"host:N\" (N 0..255), at $\n");
  pack_fails("t.json", "t.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"uint8\\u0000x\", "
             "\"shape\": [8]}}",
             "devpickle: t.json: unknown tensor dtype \"uint8\\u0000x\" (one of bool, int8, int16, int32, int64, "
             "uint8, uint16, uint32, uint64, float16, bfloat16, float32, float64, complex64, complex128), at $\n");
  pack_fails("k.json", "k.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"device\\u0000x\": 1, \"ptr\": \"0x1000\", \"nbytes\": 8, "
             "\"dtype\": \"uint8\", \"shape\": [8]}}",
             "devpickle: k.json: unknown $tensor field \"device\\u0000x\", at $\n");
  cr_assert_eq(count_entries(), 4, "a frame was written");
}

/* A tag with another field said that its own (valid) value was wrong:
 * {"$bytes": "", "$tuple": []} was "$bytes must be a canonical base64
 * string". It says what every other tag says. */
Test(cli, a_bytes_or_float_tag_with_another_field_says_it_takes_no_other_fields) {
  pack_fails("b.json", "b.dpk", "{\"$bytes\": \"\", \"$tuple\": []}",
             "devpickle: b.json: $bytes takes no other fields, at $\n");
  pack_fails("f.json", "f.dpk", "[{\"$float\": \"nan\", \"x\": 1}]",
             "devpickle: f.json: $float takes no other fields, at $[0]\n");
  cr_assert_eq(count_entries(), 2, "a frame was written");
}

/* $dict with another field said its (valid) array was wrong: {"$dict": [],
 * "x": 1} was "$dict must be an array of [key, value] pairs". It says what
 * every other tag says, and keeps that message for a $dict that is no array. */
Test(cli, a_dict_tag_with_another_field_says_it_takes_no_other_fields) {
  pack_fails("d.json", "d.dpk", "{\"$dict\": [[\"a\", 1]], \"x\": 1}",
             "devpickle: d.json: $dict takes no other fields, at $\n");
  pack_fails("e.json", "e.dpk", "[{\"$dict\": [], \"$x\": 1}]",
             "devpickle: e.json: $dict takes no other fields, at $[0]\n");
  pack_fails("a.json", "a.dpk", "{\"$dict\": {}}",
             "devpickle: a.json: $dict must be an array of [key, value] pairs, at $\n");
  cr_assert_eq(count_entries(), 3, "a frame was written");
}

/* SECURITY.md bounds unpack's output: --compact, at most about 16 times the
 * frame. It said 4, which a frame of `false` (6 bytes of JSON a byte) and one
 * of zero-dimensional tensors on one buffer (9 bytes of frame, 146 of JSON)
 * both exceed. */
Test(cli, unpack_writes_at_most_sixteen_times_the_frame_compact_and_says_what_costs_most) {
  enum { N = 2000 };
  const char *t = "{\"$tensor\": {\"device\": \"cuda:255\", \"ptr\": \"0xffffffffffffffff\", \"nbytes\": "
                  "4611686018427387904, \"dtype\": \"complex128\", \"shape\": []}}";
  size_t tl = strlen(t);
  char *json = malloc(N * (tl + 1) + 4), *p = json;
  *p++ = '[';
  for (int i = 0; i < N; i++, p += tl + 1) {
    memcpy(p, t, tl);
    p[tl] = i + 1 < N ? ',' : ']';
  }
  *p = '\0';
  spit("t.json", json);
  free(json);
  run_ok("pack t.json -o t.dpk");
  size_t fn = 0, on = 0;
  free(slurp_in("t.dpk", &fn));
  run_ok("unpack t.dpk --compact -o t2.json");
  free(slurp_in("t2.json", &on));
  cr_assert_gt(on, 15 * fn, "the costliest item is no longer what SECURITY.md says: %zu bytes of JSON for %zu", on, fn);
  cr_assert_leq(on, 16.5 * fn, "%zu bytes of JSON for a %zu-byte frame", on, fn);
}

static void spit_frame(const char *name, const void *payload, size_t n);
static void spit_frame_with(const char *name, const void *payload, size_t n, const void *table, size_t tn);

/* The size of what `devpickle CMD FRAME -o OUT` (or `CMD FRAME > OUT`
 * when to_stdout) writes. */
static size_t output_of(const char *cmd, const char *frame, int to_stdout) {
  char args[256], path[160];
  snprintf(args, sizeof args, to_stdout ? "%s %s > o.txt" : "%s %s -o o.txt", cmd, frame);
  run_ok(args);
  path_in(path, sizeof path, "o.txt");
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  unlink(path);
  return (size_t)st.st_size;
}

/* A payload whose `count` chains of `k` dicts of one ending in a false lie
 * 2,000 levels down, each level as deep in value JSON as a level can be: a
 * root list holding a nest of dicts of one under the key 0 (each a $dict
 * pair, three levels of JSON) followed by a back-reference to each of
 * them (each an $id wrapper, one more), the nest ending in a list of the
 * chains; the chains' dicts of one are 2 bytes and 7 lines each (*n: its
 * size). */
static uint8_t *dict_chains_at_the_depth_limit(size_t count, size_t k, size_t *n) {
  size_t outer = 1998 - k, q = 0;
  uint8_t *p = malloc(3 + 2 * outer + 3 + count * (2 * k + 1) + 6 * outer);
  cr_assert_not_null(p);
  p[q++] = 0xdc; /* the root: the nest, then a back-reference to each of its dicts */
  p[q++] = (uint8_t)((outer + 1) >> 8);
  p[q++] = (uint8_t)(outer + 1);
  for (size_t i = 0; i < outer; i++) p[q++] = 0x81, p[q++] = 0x00;
  p[q++] = 0xdc;
  p[q++] = (uint8_t)(count >> 8);
  p[q++] = (uint8_t)count;
  for (size_t i = 0; i < count; i++) {
    for (size_t j = 0; j < k; j++) p[q++] = 0x81, p[q++] = 0x00;
    p[q++] = 0xc2;
  }
  for (size_t i = 1; i <= outer; i++) { /* node i: the nest's dict i (the root is node 0) */
    const uint8_t ref[] = {0xd6, 0x01, 0, 0, (uint8_t)(i >> 8), (uint8_t)i};
    memcpy(p + q, ref, sizeof ref);
    q += sizeof ref;
  }
  *n = q;
  return p;
}

/* Indented, a level of the value is up to four levels of JSON (a $dict
 * pair, three; a shared node's $id wrapper, one), so a line 2,000 levels
 * down starts with up to 16,000 spaces, and a dict of one under the key 0
 * is seven lines for its 2 bytes: chains of them at the depth limit, under
 * a nest of shared dicts, are the costliest input, each byte about 54,800
 * bytes of JSON (SECURITY.md). SECURITY.md said 7,800, for chains of lists
 * of one under lists (a level of JSON a level, two lines a byte): these
 * write seven times that. Measured as what 200 more chains add, so that
 * the nest above them, written once, does not count; counted through a
 * pipe (the larger output is 1.2 GB). */
Test(cli, unpack_writes_at_most_about_54800_times_the_frame_indented_and_says_what_costs_most, .timeout = 120) {
  size_t n1, n2;
  uint8_t *p = dict_chains_at_the_depth_limit(40, 39, &n1);
  spit_frame("c1.dpk", p, n1);
  free(p);
  p = dict_chains_at_the_depth_limit(240, 39, &n2);
  spit_frame("c2.dpk", p, n2);
  free(p);
  res_t r = run_sh("$D unpack c1.dpk | wc -c; $D unpack c2.dpk | wc -c; $D verify c2.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  char *end;
  double f1 = strtod(r.out, &end), f2 = strtod(end, &end);
  cr_assert(strstr(end, "c2.dpk: ok") != NULL, "%s", r.out);
  res_free(r);
  double per_byte = (f2 - f1) / (double)(n2 - n1);
  cr_assert_gt(per_byte, 54700, "the costliest input is no longer what SECURITY.md says: %.0f bytes of JSON a byte",
               per_byte);
  cr_assert_leq(per_byte, 54900, "%.0f bytes of JSON a frame byte", per_byte);
}

/* A payload of `count` one-byte items `item` in a list under three dict
 * keys of control characters: steps of 388, 388 and 238 bytes, a path of
 * 1,015 bytes and the item's index (*n: its size). */
static uint8_t *items_under_long_keys(size_t count, uint8_t item, size_t *n) {
  uint8_t *p = malloc(3 * (3 + 64) + 3 + count), *q = p;
  cr_assert_not_null(p);
  for (int level = 0; level < 3; level++) {
    size_t klen = level < 2 ? 64 : 39;
    *q++ = 0x81;
    *q++ = 0xd9;
    *q++ = (uint8_t)klen;
    memset(q, 0x01, klen);
    q += klen;
  }
  *q++ = 0xdc;
  *q++ = (uint8_t)(count >> 8);
  *q++ = (uint8_t)count;
  memset(q, item, count);
  *n = (size_t)(q + count - p);
  return p;
}

/* inspect's line for a one-byte item is its path, at most 1,024 bytes, and
 * its summary: an empty str, 'str (0 bytes) ""', the longest summary of a
 * one-byte item, under a path just short of the limit is about 1,040 bytes
 * a byte (SECURITY.md; it said 1,035, for "bool false", six bytes
 * shorter), measured as what 3,000 more add. */
Test(cli, inspect_writes_at_most_about_1040_times_the_frame_and_says_what_costs_most) {
  size_t n1, n2;
  uint8_t *p = items_under_long_keys(1000, 0xa0, &n1);
  spit_frame("i1.dpk", p, n1);
  free(p);
  p = items_under_long_keys(4000, 0xa0, &n2);
  spit_frame("i2.dpk", p, n2);
  free(p);
  size_t f1 = output_of("inspect", "i1.dpk", 1), f2 = output_of("inspect", "i2.dpk", 1);
  double per_byte = (double)(f2 - f1) / (double)(n2 - n1);
  cr_assert_gt(per_byte, 1035, "the costliest input is no longer what SECURITY.md says: %.0f bytes a byte", per_byte);
  cr_assert_leq(per_byte, 1045, "%.0f bytes of output a frame byte", per_byte);
}

/* A payload of `count` (at most 127) zero-dimensional tensors, each on a
 * cpu buffer of its own, in a list under eight dict keys of double quotes
 * (seven of 64, one of 45: steps of 132 bytes and one of 94, a path of
 * 1,023 or 1,024 bytes with the item's index, every quote in it written
 * \" and, in JSON, \\\"), and its buffer table (*n, *tn: their sizes): 14
 * bytes an allocation. */
static uint8_t *tensors_under_quote_keys(size_t count, size_t *n, uint8_t *table, size_t *tn) {
  uint8_t *p = malloc(8 * (3 + 64) + 3 + 9 * count), *q = p;
  cr_assert_not_null(p);
  for (int level = 0; level < 8; level++) {
    size_t klen = level < 7 ? 64 : 45;
    *q++ = 0x81;
    *q++ = 0xd9;
    *q++ = (uint8_t)klen;
    memset(q, '"', klen);
    q += klen;
  }
  *q++ = 0xdc;
  *q++ = 0;
  *q++ = (uint8_t)count;
  uint8_t *t = table;
  *t++ = 0xdc;
  *t++ = 0;
  *t++ = (uint8_t)count;
  for (size_t i = 0; i < count; i++) {
    const uint8_t tensor[] = {0x96, 0xd4, 0x00, 0x02, (uint8_t)i, 0x00, 0x90, 0x90, 0x00};
    const uint8_t desc[] = {0x94, 0x00, 0x00, 0x01, (uint8_t)i};
    memcpy(q, tensor, sizeof tensor);
    q += sizeof tensor;
    memcpy(t, desc, sizeof desc);
    t += sizeof desc;
  }
  *n = (size_t)(q - p);
  *tn = (size_t)(t - table);
  return p;
}

/* dump's line for an allocation is its first path, at most 1,024 bytes: an
 * allocation of 14 bytes (its descriptor and a zero-dimensional tensor)
 * under a path just short of the limit is about 77 bytes a byte; with
 * --json, whose strings escape every quote and backslash of the path again,
 * a path of quotes doubles: about 153 (SECURITY.md). SECURITY.md said 93,
 * for a path of control characters (\u0001, seven bytes in JSON for six). */
Test(cli, dump_writes_at_most_about_155_times_the_frame_and_says_what_costs_most) {
  uint8_t t1[3 + 5 * 127], t2[3 + 5 * 127];
  size_t n1, n2, tn1, tn2;
  uint8_t *p1 = tensors_under_quote_keys(40, &n1, t1, &tn1), *p2 = tensors_under_quote_keys(120, &n2, t2, &tn2);
  spit_frame_with("d1.dpk", p1, n1, t1, tn1);
  spit_frame_with("d2.dpk", p2, n2, t2, tn2);
  free(p1);
  free(p2);
  for (int json = 0; json <= 1; json++) {
    size_t f1 = output_of(json ? "dump --json" : "dump", "d1.dpk", 1);
    size_t f2 = output_of(json ? "dump --json" : "dump", "d2.dpk", 1);
    double per_byte = (double)(f2 - f1) / (double)(n2 + tn2 - n1 - tn1);
    cr_assert_gt(per_byte, json ? 150 : 75, "the costliest input is no longer what SECURITY.md says: %.0f bytes a byte",
                 per_byte);
    cr_assert_leq(per_byte, json ? 155 : 80, "%.0f bytes of output a frame byte", per_byte);
  }
}

Test(cli, tensors_sharing_a_storage_must_agree_on_its_data) {
  pack_fails("d.json", "d.dpk",
             "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", "
             "\"shape\": [4], \"data\": \"QUFBQQ==\"}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", "
             "\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4], \"data\": \"QkJCQg==\"}}]",
             "devpickle: d.json: tensors on cpu 0x1000 disagree on data, at $[1]\n");
}

/* A ptr may carry any number of leading zeros (VALUE_JSON.md): a message
 * about its storage names the address read, not the text, which pushed
 * the rest of the message and its path out of the 2 kB it has. */
Test(cli, a_storage_whose_ptr_has_many_leading_zeros_is_named_by_its_address_in_messages) {
  static const char *const tails[] = {"\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4]}}",
                                      "\"nbytes\": 8, \"dtype\": \"uint8\", \"shape\": [4]}}",
                                      "\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4], \"data\": \"QUFBQQ==\"}}",
                                      "\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4], \"data\": \"QkJCQg==\"}}"};
  static const char *const want[] = {
      "devpickle: z.json: tensors on cuda:3 0xab0 disagree on nbytes (4 and 8), at $.w[1]\n",
      "devpickle: z.json: tensors on cuda:3 0xab0 disagree on data, at $.w[1]\n"};
  char ptr[3100] = "0x";
  memset(ptr + 2, '0', 3000);
  strcpy(ptr + 3002, "AB0");
  for (int c = 0; c < 2; c++) {
    char json[8000];
    snprintf(json, sizeof json,
             "{\"w\": [{\"$tensor\": {\"device\": \"cuda:3\", \"ptr\": \"%s\", %s, "
             "{\"$tensor\": {\"device\": \"cuda:3\", \"ptr\": \"%s\", %s]}",
             ptr, tails[2 * c], ptr, tails[2 * c + 1]);
    pack_fails("z.json", "z.dpk", json, want[c]);
  }
}

/* ---- items 9, 11, 12: bounded paths, memory per input byte ---- */

Test(cli, inspect_paths_follow_the_documented_bounds) {
  /* 60 nested dicts under 70-byte keys: each step is cut to 64 bytes + "…" */
  char key[71];
  memset(key, 'k', 70);
  key[70] = '\0';
  dp_value_t v = dp_int(7);
  dp_error_t e;
  for (int i = 0; i < 60; i++) {
    dp_value_t d, k;
    cr_assert_eq(dp_dict_new(1, &d, &e), 0);
    cr_assert_eq(dp_str_new(key, 70, &k, &e), 0);
    cr_assert_eq(dp_dict_set(d, k, v, &e), 0);
    v = d;
  }
  write_frame("p.dpk", v, 0);
  res_t r = run("inspect p.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  char step[80], want[2048];
  snprintf(step, sizeof step, ".%.64s…", key);
  /* 68-byte steps: 3 fit in the 256-byte head (with "$"), 10 in the 704-byte tail */
  size_t n = (size_t)snprintf(want, sizeof want, "\n$");
  for (int i = 0; i < 3; i++) n += (size_t)snprintf(want + n, sizeof want - n, "%s", step);
  n += (size_t)snprintf(want + n, sizeof want - n, "<…47 steps…>");
  for (int i = 0; i < 10; i++) n += (size_t)snprintf(want + n, sizeof want - n, "%s", step);
  snprintf(want + n, sizeof want - n, "  int 7\n");
  cr_assert_not_null(strstr(r.out, want), "%s", r.out);
  cr_assert_null(strstr(r.out, key), "a name was not cut");
  res_free(r);
}

Test(cli, inspect_names_one_left_out_step_in_the_singular) {
  /* keys of control characters escape to 6 bytes a character: steps of 388,
     388 and 304 bytes, a path of 1,081; the tail keeps the last two */
  size_t lens[3] = {64, 64, 50};
  dp_value_t v = dp_int(7);
  dp_error_t e;
  for (int i = 2; i >= 0; i--) {
    char key[64];
    memset(key, 1, lens[i]);
    dp_value_t d, k;
    cr_assert_eq(dp_dict_new(1, &d, &e), 0);
    cr_assert_eq(dp_str_new(key, lens[i], &k, &e), 0);
    cr_assert_eq(dp_dict_set(d, k, v, &e), 0);
    v = d;
  }
  write_frame("p.dpk", v, 0);
  res_t r = run("inspect p.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  char want[1024];
  size_t n = (size_t)snprintf(want, sizeof want, "\n$<…1 step…>[\"");
  for (int i = 0; i < 64; i++) n += (size_t)snprintf(want + n, sizeof want - n, "\\u0001");
  n += (size_t)snprintf(want + n, sizeof want - n, "\"][\"");
  for (int i = 0; i < 50; i++) n += (size_t)snprintf(want + n, sizeof want - n, "\\u0001");
  snprintf(want + n, sizeof want - n, "\"]  int 7\n");
  cr_assert_not_null(strstr(r.out, want), "%s", r.out);
  res_free(r);
}

Test(cli, pack_names_one_left_out_step_in_the_singular) {
  char k64[400] = "", k50[400] = "", json[2048], want[2048];
  for (int i = 0; i < 64; i++) strcat(k64, "\\u0001");
  for (int i = 0; i < 50; i++) strcat(k50, "\\u0001");
  snprintf(json, sizeof json, "{\"%s\": {\"%s\": {\"%s\": {\"$float\": \"x\"}}}}", k64, k64, k50);
  snprintf(want, sizeof want,
           "devpickle: d.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
           "bits, at $<…1 step…>[\"%s\"][\"%s\"]\n",
           k64, k50);
  pack_fails("d.json", "d.dpk", json, want);
}

/* Wraps *v in `levels` dicts of one key each (n bytes of key; with `vary`,
 * its last byte counts the level, '0'..'9'). 0, or 1 when a call failed. */
static int nest_in_dicts(dp_value_t *v, char *key, size_t n, int levels, int vary) {
  for (int i = 0; i < levels; i++) {
    dp_value_t d, k;
    if (vary) key[n - 1] = (char)('0' + i % 10);
    if (dp_dict_new(1, &d, NULL) != 0 || dp_str_new(key, n, &k, NULL) != 0 || dp_dict_set(d, k, *v, NULL) != 0)
      return 1;
    *v = d;
  }
  return 0;
}

static int build_long_path(void) {
  /* 15 dicts nested under 500-byte keys above 25,000 distinct strs: a copy of
   * the 7.5 kB path for each is 190 MB */
  char key[500];
  memset(key, 'q', sizeof key);
  dp_value_t v;
  if (dp_list_new(0, &v, NULL) != 0) return 1;
  for (int i = 0; i < 25000; i++) {
    dp_value_t s;
    char num[16];
    if (dp_str_new(num, (size_t)snprintf(num, sizeof num, "%d", i), &s, NULL) != 0 || dp_list_append(v, s, NULL) != 0)
      return 1;
  }
  if (nest_in_dicts(&v, key, sizeof key, 15, 0)) return 1;
  return write_frame_raw("k.dpk", v, 0, NULL);
}

Test(cli, inspect_memory_does_not_grow_with_path_length_times_nodes) {
  build_in_child(build_long_path);
  long rss;
  char err[512];
  const char *const argv[] = {"devpickle", "inspect", "k.dpk", NULL};
  cr_assert_eq(run_child(argv, 0, &rss, err, sizeof err), 0, "%s", err);
  cr_assert_lt(rss, T_MEM_SCALE * 64 * 1024, "inspect of a 140 kB frame peaked at %ld KiB", rss);
}

static int build_deep_shared(void) {
  /* a str 62 dicts down, under keys of 64 control characters (each shown
   * as \u0001), then 160,000 references to it: 964 kB */
  char key[64];
  memset(key, 1, sizeof key);
  dp_value_t x, v, refs, root;
  if (dp_str_new("", 0, &x, NULL) != 0) return 1;
  v = dp_value_retain(x);
  if (nest_in_dicts(&v, key, sizeof key, 62, 1)) return 1;
  if (dp_list_new(0, &refs, NULL) != 0 || dp_list_new(0, &root, NULL) != 0) return 1;
  for (int i = 0; i < 160000; i++)
    if (dp_list_append(refs, dp_value_retain(x), NULL) != 0) return 1;
  if (dp_list_append(root, v, NULL) != 0 || dp_list_append(root, refs, NULL) != 0) return 1;
  return write_frame_raw("s.dpk", root, 0, NULL);
}

/* Each "-> PATH" rendered every step of the node's path, 62 names of 384
 * escaped bytes, to print the 1 kB that a cut path shows: 15 s for this
 * 964 kB frame. Only the steps shown are rendered now (0.4 s). */
Test(cli, inspect_renders_only_the_steps_a_back_reference_path_shows) {
  build_in_child(build_deep_shared);
  struct rusage r0, r1;
  getrusage(RUSAGE_CHILDREN, &r0);
  char err[512];
  const char *const argv[] = {"devpickle", "inspect", "s.dpk", NULL};
  cr_assert_eq(run_child(argv, 0, NULL, err, sizeof err), 0, "%s", err);
  getrusage(RUSAGE_CHILDREN, &r1);
  double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1e6;
  cr_assert_lt(cpu, T_MEM_SCALE * 4.0, "inspect of 160,000 references to a node 62 levels down took %.1f s of CPU",
               cpu);
  res_t r = run("inspect s.dpk | tail -n 1");
  cr_assert_eq(r.status, 0);
  cr_assert(strncmp(r.out, "$[1][159999]", 12) == 0 && strstr(r.out, "-> $[0]<…61 steps…>[\"\\u0001") != NULL,
            "%.300s", r.out);
  res_free(r);
}

static int build_deep_pointers(void) {
  /* 80,000 tensors, each on its own storage, 62 dicts down under keys of 64
   * control characters: 1.7 MB, a cut path of 1 kB for each pointer */
  char key[64];
  memset(key, 1, sizeof key);
  dp_value_t v;
  if (dp_list_new(0, &v, NULL) != 0) return 1;
  for (int i = 0; i < 80000; i++) {
    dp_storage_t *st;
    dp_value_t t;
    int64_t shape[1] = {1};
    if (dp_storage_new((dp_device_t){DP_DEVICE_CUDA, 0}, (void *)(uintptr_t)(0x1000 + 16 * (uintptr_t)i), 1, NULL,
                       NULL, &st, NULL) != 0 ||
        dp_tensor_new(st, DP_UINT8, 1, shape, NULL, 0, &t, NULL) != 0 || dp_list_append(v, t, NULL) != 0)
      return 1;
  }
  if (nest_in_dicts(&v, key, sizeof key, 62, 1)) return 1;
  return write_frame_raw("p.dpk", v, 0, NULL);
}

/* The walker's paths (dump, verify) wrote each escaped control character
 * with snprintf: about 400 of them for each pointer's path here, 2.8 s of
 * verify for this 1.7 MB frame; 0.5 s now. */
Test(cli, paths_of_escaped_names_cost_no_formatted_print_per_character) {
  build_in_child(build_deep_pointers);
  static const char *const cmds[] = {"verify", "dump"};
  for (int i = 0; i < 2; i++) {
    struct rusage r0, r1;
    getrusage(RUSAGE_CHILDREN, &r0);
    char err[512];
    const char *const argv[] = {"devpickle", cmds[i], "p.dpk", NULL};
    cr_assert_eq(run_child(argv, 0, NULL, err, sizeof err), 0, "%s: %s", cmds[i], err);
    getrusage(RUSAGE_CHILDREN, &r1);
    double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1e6;
    cr_assert_lt(cpu, T_MEM_SCALE * 1.5, "%s of 80,000 pointers under long escaped names took %.1f s of CPU",
                 cmds[i], cpu);
  }
  res_t r = run("dump p.dpk | tail -n 2 | head -n 1");
  cr_assert_eq(r.status, 0);
  cr_assert(strstr(r.out, "cuda:0    0x00000000001397f0") && strstr(r.out, "  $<…61 steps…>[\"\\u0001\\u0001") &&
                strstr(r.out, "\\u00010\"][79999]\n"),
            "%s", r.out);
  res_free(r);
}

/* The documented bound (docs/SECURITY.md, "The CLI"): peak memory at most
 * 200 x the input + 16 MiB for every command that reads a frame. */
static int build_empty_dicts(void) {
  dp_value_t l;
  if (dp_list_new(1 << 20, &l, NULL) != 0) return 1;
  for (int i = 0; i < 1000000; i++) {
    dp_value_t d;
    if (dp_dict_new(0, &d, NULL) != 0 || dp_list_append(l, d, NULL) != 0) return 1;
  }
  return write_frame_raw("d.dpk", l, 0, NULL);
}

Test(cli, every_reading_command_stays_within_the_memory_bound_on_a_megabyte_of_empty_dicts) {
  build_in_child(build_empty_dicts);
  char path[256];
  path_in(path, sizeof path, "d.dpk");
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  long bound_kb = T_MEM_SCALE * ((long)(200 * st.st_size / 1024) + 16 * 1024);
  static const char *const cmds[] = {"verify", "unpack", "dump", "inspect"};
  for (int i = 0; i < 4; i++) {
    const char *const argv[] = {"devpickle", cmds[i], "d.dpk", NULL};
    long rss;
    char err[512];
    cr_assert_eq(run_child(argv, 0, &rss, err, sizeof err), 0, "%s: %s", cmds[i], err);
    cr_assert_leq(rss, bound_kb, "%s of a %lld-byte frame peaked at %ld KiB (bound %ld KiB)", cmds[i],
                  (long long)st.st_size, rss, bound_kb);
  }
}

/* pack holds the document's value and its $id index: the same bound as the
 * frame readers, counted on its JSON (1 MB of empty dicts: about 120 MB,
 * of empty lists 85 MB, on a 2-core VM). */
Test(cli, pack_stays_within_the_memory_bound_on_a_megabyte_of_empty_containers) {
  static const char *const items[] = {"{}", "[]"};
  for (int i = 0; i < 2; i++) {
    char path[256];
    path_in(path, sizeof path, "c.json");
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputc('[', f);
    for (int k = 0; k < (1 << 20) / 3; k++) fprintf(f, "%s%s", k ? "," : "", items[i]);
    fputc(']', f);
    cr_assert_eq(fclose(f), 0);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    long bound_kb = T_MEM_SCALE * ((long)(200 * st.st_size / 1024) + 16 * 1024);
    const char *const argv[] = {"devpickle", "pack", "c.json", "-o", "c.dpk", NULL};
    long rss;
    char err[512];
    cr_assert_eq(run_child(argv, 0, &rss, err, sizeof err), 0, "pack %s: %s", items[i], err);
    cr_assert_leq(rss, bound_kb, "pack of %lld bytes of %s peaked at %ld KiB (bound %ld KiB)", (long long)st.st_size,
                  items[i], rss, bound_kb);
  }
}

static int build_inline(void) {
  size_t n = 64u << 20;
  uint8_t *data = malloc(n);
  if (!data) return 1;
  for (size_t i = 0; i < n; i++) data[i] = (uint8_t)(i * 7);
  dp_storage_t *s;
  dp_value_t t, d, k;
  int64_t shape[1] = {(int64_t)n};
  if (dp_storage_new((dp_device_t){DP_DEVICE_CPU, 0}, data, n, NULL, NULL, &s, NULL) != 0 ||
      dp_tensor_new(s, DP_UINT8, 1, shape, NULL, 0, &t, NULL) != 0 || dp_dict_new(1, &d, NULL) != 0 ||
      dp_str_new("w", 1, &k, NULL) != 0 || dp_dict_set(d, k, t, NULL) != 0)
    return 1;
  return write_frame_raw("big.dpk", d, 1, NULL);
}

Test(cli, checking_an_inline_frame_costs_memory_independent_of_its_data_section) {
  build_in_child(build_inline);
  static const char *const cmds[] = {"verify", "dump", "inspect"};
  for (int i = 0; i < 3; i++) {
    const char *const argv[] = {"devpickle", cmds[i], "big.dpk", NULL};
    long rss;
    char err[512];
    cr_assert_eq(run_child(argv, 0, &rss, err, sizeof err), 0, "%s: %s", cmds[i], err);
    cr_assert_lt(rss, T_MEM_SCALE * 24 * 1024, "%s of a 64 MiB inline frame peaked at %ld KiB", cmds[i], rss);
  }
  /* a changed data byte is still caught */
  char path[256];
  path_in(path, sizeof path, "big.dpk");
  int fd = open(path, O_WRONLY);
  cr_assert_eq(pwrite(fd, "\x01", 1, 40000000), 1);
  close(fd);
  const char *const argv[] = {"devpickle", "verify", "big.dpk", NULL};
  char err[512];
  cr_assert_eq(run_child(argv, 0, NULL, err, sizeof err), 1);
  cr_assert_eq(strncmp(err, "devpickle: big.dpk: checksum mismatch: header says ", 51), 0, "%s", err);
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

static int pack_text(const char *text, dp_value_t *v, char *msg, size_t msgsize) {
  size_t pos;
  json_t *j = vjson_parse(text, strlen(text), msg, msgsize, &pos);
  cr_assert_not_null(j, "%s", msg);
  int is_inline;
  int rc = vjson_to_value(j, v, &is_inline, msg, msgsize);
  json_decref(j);
  return rc;
}

/* A JSON text of 2,001 levels: each level `open` ... `close` around the
 * next, the innermost holding `inner`. */
static char *nest_json(const char *open, const char *inner, const char *close) {
  size_t n = 2001 * (strlen(open) + strlen(close)) + strlen(inner) + 1;
  char *text = malloc(n), *p = text;
  for (int i = 0; i < 2001; i++) p = stpcpy(p, open);
  p = stpcpy(p, inner);
  for (int i = 0; i < 2001; i++) p = stpcpy(p, close);
  return text;
}

/* The message for a container 2,000 steps of `step` down: the path as
 * FORMAT.md cuts it (the steps that fit in 256 bytes with $, the count
 * left out, the steps that fit in 704). */
static void deep_message(char *out, size_t n, const char *step) {
  size_t len = strlen(step), head = 255 / len, tail = 704 / len;
  int k = snprintf(out, n, "containers nested deeper than 2000 levels, at $");
  for (size_t i = 0; i < head; i++) k += snprintf(out + k, n - (size_t)k, "%s", step);
  k += snprintf(out + k, n - (size_t)k, "<…%zu steps…>", 2000 - head - tail);
  for (size_t i = 0; i < tail; i++) k += snprintf(out + k, n - (size_t)k, "%s", step);
}

/* The container past the nesting limit is the one pack names, as the
 * library's walker names it and as verify points at its header: pack named
 * its first child instead — an empty list below it (no level at all), the
 * false it held, or the int key of a $dict (`<key 0>`). */
Test(cli, pack_names_the_container_past_the_nesting_limit_not_its_first_child) {
  static const struct {
    const char *open, *inner, *close, *step;
  } cases[] = {
      {"[", "[]", "]", "[0]"},                         /* 2,001 lists with children, then an empty one */
      {"[", "false", "]", "[0]"},
      {"{\"$dict\": [[0, ", "false", "]]}", "[0]"},   /* it named <key 0> of the last dict */
      {"{\"$reduce\": \"R\", \"state\": ", "1", "}", "<reduce R>"},
      {"{\"k\": ", "null", "}", ".k"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char *text = nest_json(cases[c].open, cases[c].inner, cases[c].close);
    char msg[2048], want[2048];
    dp_value_t v;
    cr_assert_eq(pack_text(text, &v, msg, sizeof msg), DP_ELIMIT, "%zu: %s", c, msg);
    deep_message(want, sizeof want, cases[c].step);
    cr_assert_str_eq(msg, want, "case %zu", c);
    free(text);
  }
}

/* pack reads value JSON and unpack writes it by recursion, a level a call,
 * bounded by the 2,000 levels of the notation: each level must stay small.
 * 2,000 levels of $id and $dict wrappers (four levels of JSON each) around
 * a tensor took 2.7 MB of stack for pack (the locals of leaves inlined
 * into the recursion): a 2 MiB stack, a thread's default in many a
 * runtime, crashed with SIGSEGV. SECURITY.md promises under 512 KiB; the
 * test allows 768 (4 MiB under ASan, whose frames are several times
 * larger). */
#if defined(__SANITIZE_ADDRESS__)
#define DEEP_STACK_KIB "4096"
#else
#define DEEP_STACK_KIB "768"
#endif
Test(cli, pack_and_unpack_handle_the_deepest_value_within_768_kib_of_stack) {
  size_t cap = 2000 * 64 + 256, n = 0;
  char *text = malloc(cap);
  for (int i = 0; i < 2000; i++)
    n += (size_t)snprintf(text + n, cap - n, "{\"$id\": \"i%d\", \"$value\": {\"$dict\": [[%d, ", i, i);
  n += (size_t)snprintf(text + n, cap - n,
                        "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 8, \"dtype\": \"uint8\", "
                        "\"shape\": [8]}}");
  for (int i = 0; i < 2000; i++) n += (size_t)snprintf(text + n, cap - n, "]]}}");
  spit("deep.json", text);
  free(text);
  res_t r = run_sh("ulimit -s " DEEP_STACK_KIB " && $D pack deep.json -o deep.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  run_expect("verify deep.dpk", 0,
             "deep.dpk: ok, 7673 bytes, version 1, 1 buffer, 0 device pointers, 1 cpu buffer, out-of-band\n", NULL);
  r = run_sh("ulimit -s " DEEP_STACK_KIB " && $D unpack deep.dpk -o back.json");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  r = run_sh("ulimit -s " DEEP_STACK_KIB " && $D pack back.json -o again.dpk && cmp deep.dpk again.dpk");
  cr_assert_eq(r.status, 0, "unpack -> pack changed the frame: %s", r.err);
  res_free(r);
}

/* unpack writes a shared tuple through emit, emit_body and a helper for
 * its items: three frames a level, so 2,000 levels of them took 578 KiB of
 * stack, past the 512 KiB SECURITY.md promises (lists, a tail call, took
 * two). A level is now two frames whatever the container: 360 KiB. */
#if defined(__SANITIZE_ADDRESS__)
#define UNPACK_STACK_KIB "4096"
#else
#define UNPACK_STACK_KIB "512"
#endif
Test(cli, unpack_writes_2000_levels_of_shared_tuples_within_512_kib_of_stack) {
  size_t cap = 2000 * 48 + 64, n = 0;
  char *text = malloc(cap);
  for (int i = 0; i < 2000; i++) n += (size_t)snprintf(text + n, cap - n, "{\"$id\": \"t%d\", \"$value\": {\"$tuple\": [", i);
  n += (size_t)snprintf(text + n, cap - n, "0");
  for (int i = 0; i < 2000; i++) n += (size_t)snprintf(text + n, cap - n, "]}}");
  spit("tuples.json", text);
  free(text);
  res_t r = run_sh("$D pack tuples.json -o tuples.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  for (int compact = 0; compact < 2; compact++) {
    r = run_sh(compact ? "ulimit -s " UNPACK_STACK_KIB " && $D unpack --compact tuples.dpk -o back.json"
                       : "ulimit -s " UNPACK_STACK_KIB " && $D unpack tuples.dpk -o back.json");
    cr_assert_eq(r.status, 0, "unpack%s: %s", compact ? " --compact" : "", r.err);
    res_free(r);
    r = run_sh("$D pack back.json -o again.dpk && cmp tuples.dpk again.dpk");
    cr_assert_eq(r.status, 0, "unpack -> pack changed the frame: %s", r.err);
    res_free(r);
  }
}

/* pack parses JSON's 8,008 levels without recursion, but jansson's
 * json_decref freed the tree by recursion, three calls a level: a document
 * of 8,008 nested objects, refused for its depth or for a bad byte at its
 * deepest level, crashed with SIGSEGV under a 512 KiB stack (it took 646
 * KiB) instead of saying why. */
Test(cli, pack_frees_8008_levels_of_json_within_512_kib_of_stack) {
  enum { LEVELS = 8008 };
  static const char *const want[] = {"containers nested deeper than 2000 levels, at $.a.a.a",
                                     "invalid JSON: unexpected 'x' (line 1, column 48049), at byte 48048\n"};
  for (int bad = 0; bad < 2; bad++) {
    size_t cap = LEVELS * 7 + 16, n = 0;
    char *text = malloc(cap);
    for (int i = 0; i < LEVELS; i++) n += (size_t)snprintf(text + n, cap - n, "{\"a\": ");
    n += (size_t)snprintf(text + n, cap - n, bad ? "x" : "0");
    for (int i = 0; i < LEVELS && !bad; i++) n += (size_t)snprintf(text + n, cap - n, "}");
    spit("levels.json", text);
    free(text);
    res_t r = run_sh("ulimit -s " UNPACK_STACK_KIB " && $D pack levels.json -o levels.dpk");
    cr_assert_eq(r.status, 1, "%s: exit status %d (139: SIGSEGV), stderr %s", bad ? "cut" : "too deep", r.status, r.err);
    cr_assert(strstr(r.err, want[bad]), "%s", r.err);
    res_free(r);
  }
}

/* A prefix fails only when no continuation can mend it (vjson.h): one
 * that ends in an integer too large for int64 may yet go on as a real
 * (".5"), so `pack` reading a pipe must not stop there. */
Test(cli, a_prefix_ending_in_an_integer_past_int64_does_not_fail_yet) {
  static const char text[] = "[9223372036854775808.5]";
  cr_assert_eq(vjson_prefix_fails(text, 20), 0, "a fraction may follow \"%.20s\"", text);
  cr_assert_eq(vjson_prefix_fails(text, 21), 0, "nor \"%.21s\"", text);
  dp_value_t v;
  char msg[256];
  cr_assert_eq(pack_text(text, &v, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(dp_value_kind(dp_seq_get(v, 0)), DP_FLOAT);
  dp_value_release(v);
}

/* A tensor's ptr is "0x" and at least one hex digit: "0x" alone is no
 * address (it read as 0). */
Test(cli, a_tensor_ptr_of_0x_without_digits_is_refused) {
  dp_value_t v;
  char msg[512];
  cr_assert_eq(pack_text("{\"t\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x\", \"nbytes\": 4, "
                         "\"dtype\": \"uint8\", \"shape\": [4]}}}",
                         &v, msg, sizeof msg),
               DP_EINVAL, "%s", msg);
  cr_assert(strstr(msg, "tensor ptr must be a hex string such as \"0x7f0000001000\"") && strstr(msg, "$.t"), "%s",
            msg);
  cr_assert_eq(pack_text("{\"t\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x0\", \"nbytes\": 4, "
                         "\"dtype\": \"uint8\", \"shape\": [4]}}}",
                         &v, msg, sizeof msg),
               0, "one digit is an address: %s", msg);
  dp_value_release(v);
}

Test(cli, a_tuple_key_used_by_many_refs_is_looked_into_once_by_pack) {
  /* a key of 512 tuples ($id "t") used by $ref in 2,000 dicts: each use
   * looked into its 512 tuples for one still being built (a million lookups
   * for 70 kB of JSON; 80,000 uses, 2.6 MB, took 7.9 s to pack, 2.7 s now) */
  enum { INNER = 511, USES = 2000 };
  size_t cap = 64 + INNER * 24 + USES * 48, n = 0;
  char *text = malloc(cap);
  n += (size_t)sprintf(text + n, "[{\"$id\": \"t\", \"$value\": {\"$tuple\": [");
  for (int i = 0; i < INNER; i++) n += (size_t)sprintf(text + n, "%s{\"$tuple\": [%d]}", i ? ", " : "", i);
  n += (size_t)sprintf(text + n, "]}}");
  for (int i = 0; i < USES; i++) n += (size_t)sprintf(text + n, ", {\"$dict\": [[{\"$ref\": \"t\"}, %d]]}", i);
  sprintf(text + n, "]");
  vjson_key_tuples_walked = 0;
  dp_value_t v;
  char msg[512];
  cr_assert_eq(pack_text(text, &v, msg, sizeof msg), 0, "%s", msg);
  cr_assert_leq(vjson_key_tuples_walked, INNER + 1, "%llu key tuples looked into", vjson_key_tuples_walked);
  cr_assert_eq(dp_dict_len(dp_seq_get(v, USES)), 1);
  dp_value_release(v);
  free(text);
  /* a key holding a tuple still being built is refused, before and after
   * the same tuple is looked into closed */
  const char *open_key =
      "{\"$id\": \"o\", \"$value\": {\"$tuple\": [{\"$dict\": [[{\"$tuple\": [{\"$ref\": \"o\"}]}, 1]]}]}}";
  cr_assert_eq(pack_text(open_key, &v, msg, sizeof msg), DP_EINVAL);
  cr_assert(strstr(msg, "dict key refers to a node that is still being built, at $[0]<key 0>") != NULL, "%s", msg);
  const char *closed_then_open =
      "[{\"$id\": \"c\", \"$value\": {\"$tuple\": [1]}}, {\"$dict\": [[{\"$ref\": \"c\"}, 1]]},"
      " {\"$id\": \"o\", \"$value\": {\"$tuple\": [{\"$dict\": [[{\"$tuple\": [{\"$ref\": \"c\"}, {\"$ref\": \"o\"}]}, 1]]}]}}]";
  cr_assert_eq(pack_text(closed_then_open, &v, msg, sizeof msg), DP_EINVAL);
  cr_assert(strstr(msg, "still being built") != NULL, "%s", msg);
}

Test(cli, a_long_str_keying_many_dicts_is_scanned_once_by_unpack) {
  /* 500 dicts keyed by one 100 kB str: whether the key could be a plain
   * JSON key was asked by scanning its bytes for a NUL before looking at its
   * sharing, 50 MB for 100 kB of value; now a shared key is never scanned */
  enum { LEN = 100000, DICTS = 500 };
  char *text = malloc(LEN);
  memset(text, 'k', LEN);
  dp_value_t s, l, d;
  cr_assert_eq(dp_str_new(text, LEN, &s, NULL), 0);
  cr_assert_eq(dp_list_new(0, &l, NULL), 0);
  for (int i = 0; i < DICTS; i++) {
    cr_assert_eq(dp_dict_new(1, &d, NULL), 0);
    cr_assert_eq(dp_dict_set(d, dp_value_retain(s), dp_int(i), NULL), 0);
    cr_assert_eq(dp_list_append(l, d, NULL), 0);
  }
  /* and one dict keyed by a str of its own, which may be plain */
  cr_assert_eq(dp_dict_new(1, &d, NULL), 0);
  cr_assert_eq(dp_dict_set(d, t_str("own"), dp_int(0), NULL), 0);
  cr_assert_eq(dp_list_append(l, d, NULL), 0);
  dp_value_release(s);
  free(text);
  FILE *out = fopen("/dev/null", "w");
  char msg[256];
  vjson_key_bytes_scanned = 0;
  cr_assert_eq(vjson_write(out, l, 0, msg, sizeof msg), 0, "%s", msg);
  fclose(out);
  cr_assert_leq(vjson_key_bytes_scanned, 3, "%llu key bytes scanned", vjson_key_bytes_scanned);
  /* the shared key is written once, then referred to */
  json_t *j = vjson_from_value(l, msg, sizeof msg);
  cr_assert_not_null(j, "%s", msg);
  json_t *pair = json_array_get(json_object_get(json_array_get(j, 1), "$dict"), 0);
  const char *ref = json_string_value(json_object_get(json_array_get(pair, 0), "$ref"));
  cr_assert(ref && strcmp(ref, "n0") == 0, "the second dict's key is not {\"$ref\": \"n0\"}");
  cr_assert_not_null(json_object_get(json_array_get(j, DICTS), "own"), "a key of its own stays a plain key");
  json_decref(j);
  dp_value_release(l);
}

/* ---- dp_unpickle_stream, what verify, dump and inspect read with ---- */

Test(cli, the_streamed_reader_fails_cleanly_at_every_allocation_and_matches_the_whole_reader) {
  uint8_t data[64];
  for (int i = 0; i < 64; i++) data[i] = (uint8_t)i;
  dp_storage_t *s;
  dp_value_t t, l;
  dp_error_t e;
  int64_t shape[1] = {16};
  cr_assert_eq(dp_storage_new((dp_device_t){DP_DEVICE_CPU, 0}, data, 64, NULL, NULL, &s, &e), 0);
  cr_assert_eq(dp_tensor_new(s, DP_FLOAT32, 1, shape, NULL, 0, &t, &e), 0);
  cr_assert_eq(dp_list_new(0, &l, &e), 0);
  cr_assert_eq(dp_list_append(l, t, &e), 0);
  dp_frame_t *f;
  dp_pickle_opts_t po = {DP_PICKLE_INLINE, 0, NULL, NULL};
  cr_assert_eq(dp_frame_new(&f, &e), 0);
  cr_assert_eq(dp_pickle(l, &po, f, &e), 0, "%s", e.message);
  dp_value_release(l);
  size_t n;
  const uint8_t *b = dp_frame_data(f, &n);
  t_track();
  for (long k = 1;; k++) {
    cr_assert_lt(k, 200);
    t_fail_at = t_alloc_count + k;
    mem_reader_t c = {b, n, 5};
    dp_value_t v;
    dp_frame_info_t fi;
    uint64_t size = 0;
    int rc = dp_unpickle_stream(mem_read, &c, NULL, &v, &fi, &size, &e);
    t_fail_at = 0;
    if (rc == 0) {
      cr_assert_eq(size, n);
      cr_assert_eq(fi.nbuffers, 1);
      cr_assert_eq(fi.flags, 1);
      cr_assert_eq(fi.data_len, 64);
      dp_value_t whole;
      cr_assert_eq(dp_unpickle(b, n, NULL, &whole, &e), 0);
      cr_assert_eq(dp_value_equal(v, whole, DP_EQ_SHARING, NULL), 1, "the streamed value differs");
      dp_value_t st = dp_seq_get(v, 0);
      cr_assert_null(dp_storage_host_data(dp_tensor_storage(st)), "the data section was kept");
      dp_value_release(whole);
      dp_value_release(v);
      ASSERT_NO_LEAK();
      cr_assert_gt(k, 3);
      break;
    }
    cr_assert_eq(rc, DP_ENOMEM, "allocation %ld: %s (%s)", k, dp_err_name(rc), e.message);
    ASSERT_NO_LEAK();
  }
  dp_set_allocator(NULL, NULL);
  dp_frame_free(f);
}

/* ---- output linear in the frame; paths and names as docs/FORMAT.md ("Paths") says ---- */

/* Runs a shell script in the temp dir, with $D the CLI. */
static size_t count_of(const char *hay, const char *needle) {
  size_t n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

/* unpack --help and the README state how far indentation can grow a deep
 * frame's JSON (the worst case, 54,800 times, is measured above) and give
 * an example: 2,000 dicts {0: 0} at level 2,000 are an 8 KB frame, 72 MB
 * of indented JSON, 40 kB compact. The example must stay true. */
Test(cli, unpack_indentation_grows_a_deep_frame_as_its_help_says_and_compact_does_not) {
  char path[128];
  path_in(path, sizeof path, "deepdicts.json");
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  for (int i = 0; i < 1999; i++) fputc('[', f);
  for (int k = 0; k < 2000; k++) fputs(k ? ",{\"$dict\":[[0,0]]}" : "{\"$dict\":[[0,0]]}", f);
  for (int i = 0; i < 1999; i++) fputc(']', f);
  fclose(f);
  run_ok("pack deepdicts.json -o deepdicts.dpk");
  res_t sz = run_sh("wc -c < deepdicts.dpk; $D unpack deepdicts.dpk | wc -c; $D unpack --compact deepdicts.dpk | wc -c");
  cr_assert_eq(sz.status, 0, "%s", sz.err);
  cr_assert_str_eq(sz.out, "8042\n72065999\n39998\n", "frame, indented and compact sizes");
  res_free(sz);
  res_t r = run("unpack --help");
  cr_assert_eq(r.status, 0);
  cr_assert(strstr(r.out, "grows up to about 54,800\ntimes") && strstr(r.out, "an 8 KB frame, unpack to\n72 MB") &&
                strstr(r.out, "--compact writes no indentation: about 16 times the frame at most"),
            "%s", r.out);
  res_free(r);
}

Test(cli, unpack_writes_a_shared_storages_data_once_and_pack_takes_it_from_the_tensor_that_gives_it) {
  /* 16 views of one 3 kB inline storage: the base64 is written once, not 16 times */
  static uint8_t data[3072];
  for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 13);
  dp_storage_t *s;
  OK(dp_storage_new((dp_device_t){DP_DEVICE_CPU, 0}, data, sizeof data, NULL, NULL, &s, T_ERR));
  dp_value_t l = t_list();
  for (int i = 0; i < 16; i++) OK(dp_list_append(l, t_view(s, 8, i * 8), T_ERR));
  dp_storage_release(s);
  write_frame("inl.dpk", l, 1);
  res_t r = run("unpack inl.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_eq(count_of(r.out, "\"data\""), 1, "data written %zu times", count_of(r.out, "\"data\""));
  cr_assert_lt(strlen(r.out), sizeof data * 4 / 3 + 16 * 300, "%zu bytes of JSON", strlen(r.out));
  /* on the first tensor */
  cr_assert_lt(strstr(r.out, "\"data\"") - r.out, strstr(r.out, "\"offset\": 8") - r.out);
  res_free(r);
  assert_round_trip("inl.dpk");
  /* pack: the data may come on any tensor of the storage, and must agree where repeated */
  spit("later.json", "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", "
                     "\"shape\": [4]}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 4, "
                     "\"dtype\": \"uint8\", \"shape\": [2], \"data\": \"QUFBQQ==\"}}, {\"$tensor\": {\"device\": \"cpu\", "
                     "\"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [1], \"data\": \"QUFBQQ==\"}}]");
  r = run_sh("$D pack later.json -o later.dpk && $D verify later.dpk && $D unpack later.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "later.dpk: ok, 87 bytes, version 1, 1 buffer, 0 device pointers, 1 cpu buffer, inline\n"), "%s", r.out);
  cr_assert_eq(count_of(r.out, "\"data\": \"QUFBQQ==\""), 1, "%s", r.out);
  res_free(r);
  /* a storage with no data anywhere in an inline value is still an error */
  pack_fails("none.json", "none.dpk",
             "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", "
             "\"shape\": [4], \"data\": \"QUFBQQ==\"}}, {\"$tensor\": {\"device\": \"cuda:1\", \"ptr\": \"0x2000\", "
             "\"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [4]}}]",
             "devpickle: none.json: no tensor on cuda:1 0x2000 carries \"data\", but tensors on 1 other "
             "storage do: an inline frame needs each storage's data (on one of its tensors), at $[1]\n");
  /* at the storage's first tensor, however deep, a second name of its node aside */
  pack_fails("deep.json", "deep.dpk",
             "{\"a\": [{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"uint8\", "
             "\"shape\": [4], \"data\": \"QUFBQQ==\"}}], \"b\": {\"$id\": \"x\", \"$value\": {\"$object\": \"C\", "
             "\"attrs\": {\"t\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x3000\", \"nbytes\": 4, \"dtype\": "
             "\"uint8\", \"shape\": [4]}}, \"again\": {\"$ref\": \"x\"}}}}, \"c\": {\"$tensor\": {\"device\": \"cpu\", "
             "\"ptr\": \"0x3000\", \"nbytes\": 4, \"dtype\": \"uint8\", \"shape\": [2]}}}",
             "devpickle: deep.json: no tensor on cpu 0x3000 carries \"data\", but tensors on 1 other "
             "storage do: an inline frame needs each storage's data (on one of its tensors), at $.b.t\n");
}

/* A path step shows the first 64 bytes of a name or key: rendering one
 * costs that, not the name's length. inspect renders a path for every
 * back-reference; with a 4 MiB attribute name over 200,000 of them, or a 4
 * MiB str inside a tuple key over 50,000 dicts, it read the whole name each
 * time (800 GB and 200 GB scanned: minutes); now each step reads 65 bytes
 * (about a second for the whole test). The limit is a hang guard, not a
 * measurement. */
Test(cli, inspect_and_pack_render_a_step_at_the_cost_of_what_it_shows_not_of_the_names_length, .timeout = 60) {
  size_t L = 4 << 20;
  char *big = malloc(L + 1);
  memset(big, 'n', L);
  big[L] = 0;
  dp_value_t obj, a = t_str("a"), l = t_list();
  OK(dp_object_new("C", &obj, T_ERR));
  OK(dp_object_set(obj, big, dp_value_retain(a), T_ERR));
  OK(dp_list_append(l, obj, T_ERR));
  for (int i = 0; i < 200000; i++) OK(dp_list_append(l, dp_value_retain(a), T_ERR));
  dp_value_release(a);
  write_frame("names.dpk", l, 0);
  res_t r = run_sh("$D inspect names.dpk | tail -n 1");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "-> $[0].nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\xe2\x80\xa6"), "%s", r.out);
  res_free(r);

  dp_value_t s, key, l2 = t_list();
  OK(dp_str_new(big, L, &s, T_ERR));
  OK(dp_tuple_new(1, &key, T_ERR));
  OK(dp_seq_set(key, 0, dp_value_retain(s), T_ERR));
  OK(dp_list_append(l2, s, T_ERR));
  for (int i = 0; i < 50000; i++) {
    dp_value_t d;
    OK(dp_dict_new(1, &d, T_ERR));
    OK(dp_dict_set(d, dp_value_retain(key), t_str("v"), T_ERR));
    OK(dp_list_append(l2, d, T_ERR));
  }
  dp_value_release(key);
  write_frame("keys.dpk", l2, 0);
  r = run_sh("$D inspect keys.dpk | tail -n 1");
  cr_assert_eq(r.status, 0, "%s", r.err);
  char want[160]; /* the key's JSON cut at 64 bytes: its 12-byte head and 52 of the str's */
  snprintf(want, sizeof want, "$[50000][{\"$tuple\":[\"%.52s\xe2\x80\xa6]  str (1 byte) \"v\"", big);
  cr_assert_not_null(strstr(r.out, want), "%s", r.out);
  res_free(r);
  r = run_sh("$D unpack keys.dpk > keys.json && $D pack keys.json -o again.dpk && cmp keys.dpk again.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  free(big);
}

Test(cli, dict_keys_show_their_value_json_alike_in_dump_inspect_and_pack_errors) {
  dp_value_t d;
  OK(dp_dict_new(0, &d, T_ERR));
  uint64_t bits[] = {0x7ff0000000000000ull, 0x7ff8000000000000ull, 0x7ff8000000000001ull};
  dp_value_t keys[5] = {dp_int(1), dp_float(1.0)};
  for (int i = 0; i < 3; i++) {
    double f;
    memcpy(&f, &bits[i], sizeof f);
    keys[2 + i] = dp_float(f);
  }
  for (int i = 0; i < 5; i++) OK(dp_dict_set(d, keys[i], t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x1000 * (i + 1), 1), T_ERR));
  write_frame("k.dpk", d, 0);
  static const char *const want[] = {"$[1]", "$[1.0]", "$[{\"$float\":\"inf\"}]", "$[{\"$float\":\"nan\"}]",
                                     "$[{\"$float\":\"0x7ff8000000000001\"}]"};
  res_t r = run("dump k.dpk");
  res_t ri = run("inspect k.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_eq(ri.status, 0, "%s", ri.err);
  for (int i = 0; i < 5; i++) {
    char line[128];
    snprintf(line, sizeof line, "%5u  %s\n", 1u, want[i]);
    cr_assert_not_null(strstr(r.out, line), "dump lacks %s:\n%s", want[i], r.out);
    snprintf(line, sizeof line, "\n%-40s  tensor", want[i]);
    cr_assert_not_null(strstr(ri.out, line), "inspect lacks %s:\n%s", want[i], ri.out);
  }
  res_free(r);
  res_free(ri);
  /* pack names a $dict value by its key's JSON, and the inside of a key by <key N> */
  pack_fails("pe.json", "pe.dpk", "{\"$dict\": [[2, 0], [{\"$tuple\": [1.0]}, {\"$float\": \"bad\"}]]}",
             "devpickle: pe.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of "
             "IEEE 754 bits, at $[{\"$tuple\":[1.0]}]\n");
  pack_fails("pk.json", "pk.dpk", "{\"$dict\": [[{\"$float\": \"nan\"}, {\"$dict\": [[{\"$tuple\": [[1]]}, 2]]}]]}",
             "devpickle: pk.json: dict key of kind tuple is not hashable (a tuple key holds only scalars, str, "
             "bytes and tuples, at most 1024 of them, 32 levels deep), at $[{\"$float\":\"nan\"}]<key 0>\n");
  pack_fails("pd.json", "pd.dpk", "{\"a\": {\"$dict\": [[\"x\\n\", 1], [\"x\\n\", 2]]}}",
             "devpickle: pd.json: duplicate dict key: the entry [\"x\\u000a\"] is given twice, at $.a<key 1>\n");
  pack_fails("pp.json", "pp.dpk", "{\"a b\": {\"$dict\": [[1, 2], 3]}}",
             "devpickle: pp.json: $dict item 1 is not a [key, value] pair, at $[\"a b\"]\n");
}

Test(cli, a_duplicate_json_key_is_reported_at_the_byte_where_the_repeated_key_starts) {
  pack_fails("dup.json", "dup.dpk", "{\"a\": 1,\n \"a\": 2}",
             "devpickle: dup.json: invalid JSON: duplicate object key \"a\" (line 2, column 2), at byte 10\n");
  pack_fails("dupn.json", "dupn.dpk", "[{\"x\": 1, \"x\" : 2}]",
             "devpickle: dupn.json: invalid JSON: duplicate object key \"x\" (line 1, column 11), at byte 10\n");
  /* the repeated key is named, as the frame reader names a duplicate dict key: escaped, cut after 64 bytes */
  pack_fails("dupe.json", "dupe.dpk", "{\"k\\n\\u0000\": 1, \"k\\u000a\\u0000\": 2}",
             "devpickle: dupe.json: invalid JSON: duplicate object key \"k\\u000a\\u0000\" (line 1, column 18), "
             "at byte 17\n");
}

/* An escape that is not one (a bad \u, a lone surrogate, an unknown letter)
 * is reported where the offending item starts: at its backslash, never past
 * it at the closing quote; the character after a backslash is shown as a
 * character or a byte, never as a raw byte of a broken UTF-8 sequence. */
Test(cli, a_bad_escape_in_a_string_is_reported_at_the_byte_where_the_escape_starts) {
  pack_fails("hi.json", "x.dpk", "[\"ab\\ud800\"]",
             "devpickle: hi.json: invalid JSON: invalid \\u escape: a lone high surrogate (line 1, column 5), "
             "at byte 4\n");
  pack_fails("hi2.json", "x.dpk", "[\"\\ud800\\u0041\"]",
             "devpickle: hi2.json: invalid JSON: invalid \\u escape: a lone high surrogate (line 1, column 3), "
             "at byte 2\n");
  pack_fails("lo.json", "x.dpk", "[\"\\udc00\"]",
             "devpickle: lo.json: invalid JSON: invalid \\u escape: a lone low surrogate (line 1, column 3), "
             "at byte 2\n");
  pack_fails("hex.json", "x.dpk", "[\"\\u12G4\"]",
             "devpickle: hex.json: invalid JSON: invalid \\u escape (line 1, column 3), at byte 2\n");
  pack_fails("hex2.json", "x.dpk", "[\"\\ud800\\uZZZZ\"]",
             "devpickle: hex2.json: invalid JSON: invalid \\u escape (line 1, column 9), at byte 8\n");
  pack_fails("x.json", "x.dpk", "{\"k\": \"a\\x\"}",
             "devpickle: x.json: invalid JSON: invalid escape '\\x' in a string (line 1, column 9), at byte 8\n");
  pack_fails("e.json", "x.dpk", "[\"\\\xC3\xA9\"]",
             "devpickle: e.json: invalid JSON: invalid escape '\\\xC3\xA9' in a string (line 1, column 3), at byte 2\n");
  pack_fails("ff.json", "x.dpk", "[\"\\\xFF\"]",
             "devpickle: ff.json: invalid JSON: invalid escape: '\\' before byte 0xFF in a string (line 1, column 3), "
             "at byte 2\n");
}

Test(cli, names_holding_control_characters_are_escaped_so_that_every_line_stays_one_line) {
  /* a type name that would forge a second line */
  pack_fails("nl.json", "nl.dpk",
             "{\"$reduce\": \"A\\ndevpickle: forged.dpk: ok\", \"state\": [{\"$tensor\": {\"device\": \"cuda:0\", "
             "\"ptr\": \"0x1000\", \"nbytes\": 4, \"dtype\": \"float32\", \"shape\": [1]}}, {\"$tensor\": "
             "{\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"float32\", \"shape\": [1]}}]}",
             "devpickle: nl.json: tensors on cuda:0 0x1000 disagree on nbytes (4 and 8), at "
             "$<reduce A\\u000adevpickle: forged.dpk: ok>[1]\n");
  pack_fails("ok.json", "ok.dpk",
             "[{\"$reduce\": \"T>\\u001b\", \"state\": [{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", "
             "\"nbytes\": 4, \"dtype\": \"float32\", \"shape\": [1]}}]}, {\"$object\": \"C\\r\\n\", \"attrs\": "
             "{\"x\\ny\": 1}}, {\"$x\\n\": 1}]",
             "devpickle: ok.json: unknown tag \"$x\\u000a\" (a plain key starting with '$' needs $dict), "
             "at $[2]\n");
  spit("ok.json", "[{\"$reduce\": \"T>\\u001b\", \"state\": [{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", "
                  "\"nbytes\": 4, \"dtype\": \"float32\", \"shape\": [1]}}]}, {\"$object\": \"C\\r\\n\", \"attrs\": "
                  "{\"x\\ny\": 1}}]");
  res_t r = run_sh("$D pack ok.json -o ok.dpk && $D dump ok.dpk && $D inspect ok.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "  $[0]<reduce T\\u003e\\u001b>[0]\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "\n$[0]                                      reduced T\\u003e\\u001b\n"),
                     "%s", r.out);
  cr_assert_not_null(strstr(r.out, "\n$[1]                                      object C\\u000d\\u000a (1 attribute)\n"),
                     "%s", r.out);
  cr_assert_not_null(strstr(r.out, "\n$[1][\"x\\u000ay\"]"), "%s", r.out);
  cr_assert_eq(count_of(r.out, "\n"), 2 + 2 + 1 + 5, "%s", r.out);  /* dump: 3 lines, inspect: 1 + 6 */
  res_free(r);
  /* whatever else reaches stderr (a file name, an argument) is escaped too */
  r = run_sh("$D verify \"$(printf 'no\\nsuch')\"; $D pack -x\"$(printf '\\ny')\"");
  cr_assert_str_eq(r.err, "devpickle: no\\u000asuch: No such file or directory\n"
                          "devpickle pack: unknown option '-x\\u000ay'\nTry 'devpickle pack --help'.\n");
  res_free(r);
}

Test(cli, inspect_puts_the_ellipsis_of_a_cut_quoted_name_inside_the_quotes_as_dump_does) {
  char quoted[128] = "", ident[80];
  for (int i = 0; i < 40; i++) strcat(quoted, "\xc3\xa9");  /* é: 80 bytes, cut to 64 */
  memset(ident, 'a', 64);
  strcpy(ident + 64, "-b");  /* the part shown is an identifier */
  dp_value_t d;
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_dict_set(d, t_str(quoted), t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x1000, 1), T_ERR));
  OK(dp_dict_set(d, t_str(ident), t_tensor(t_dev(DP_DEVICE_CUDA, 0), 0x2000, 1), T_ERR));
  write_frame("q.dpk", d, 0);
  char want[2][256];
  snprintf(want[0], sizeof want[0], "$[\"%.64s\u2026\"]", quoted);
  snprintf(want[1], sizeof want[1], "$.%.64s\u2026", ident);
  res_t r = run("dump q.dpk"), ri = run("inspect q.dpk");
  for (int i = 0; i < 2; i++) {
    char line[600];
    snprintf(line, sizeof line, "  %s\n", want[i]);
    cr_assert_not_null(strstr(r.out, line), "dump lacks %s:\n%s", want[i], r.out);
    snprintf(line, sizeof line, "\n%s ", want[i]);  /* then blanks up to column 42 (characters, not bytes) */
    const char *at = strstr(ri.out, line);
    cr_assert_not_null(at, "inspect lacks %s:\n%s", want[i], ri.out);
    at += strspn(at + strlen(line), " ") + strlen(line);
    cr_assert_eq(strncmp(at, "tensor", 6), 0, "inspect lacks %s:\n%s", want[i], ri.out);
  }
  res_free(r);
  res_free(ri);
}

Test(cli, an_output_through_dangling_relative_or_chained_links_writes_their_target_and_keeps_the_links) {
  spit("v.json", simple_json);
  char p[256], q[256];
  path_in(p, sizeof p, "lnk.dpk");
  cr_assert_eq(symlink("real.dpk", p), 0);  /* dangling */
  path_in(p, sizeof p, "sub");
  cr_assert_eq(mkdir(p, 0755), 0);
  path_in(p, sizeof p, "sub/l1");
  cr_assert_eq(symlink("../sub/t.dpk", p), 0);  /* relative to its own directory, dangling */
  path_in(p, sizeof p, "l2");
  cr_assert_eq(symlink("sub/l1", p), 0);  /* a chain */
  path_in(q, sizeof q, "sub/l1");
  path_in(p, sizeof p, "abs");
  cr_assert_eq(symlink(q, p), 0);  /* absolute, to a link */
  res_t r = run_sh("$D pack v.json -o lnk.dpk && $D pack v.json -o l2 && $D verify real.dpk && $D verify sub/t.dpk "
                   "&& $D pack v.json -o abs && $D verify abs");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  static const char *const links[] = {"lnk.dpk", "sub/l1", "l2", "abs"};
  for (int i = 0; i < 4; i++) {
    struct stat st;
    path_in(p, sizeof p, links[i]);
    cr_assert_eq(lstat(p, &st), 0);
    cr_assert(S_ISLNK(st.st_mode), "%s was replaced by a file", links[i]);
  }
  path_in(p, sizeof p, "loop");
  cr_assert_eq(symlink("loop", p), 0);
  run_expect("pack v.json -o loop", 1, NULL, "devpickle: loop: Too many levels of symbolic links\n");
  cr_assert_eq(count_entries(), 7, "a temporary file was left behind");
}

/* A chain of symbolic links is followed as far as the kernel follows one
 * (40 links, MAXSYMLINKS): the file it ends at is written; one link more is
 * a loop, as open() would say. */
Test(cli, an_output_through_a_chain_of_forty_links_writes_its_target_and_one_more_link_is_refused) {
  spit("v.json", simple_json);
  res_t r = run_sh("i=1; while [ $i -le 41 ]; do ln -s c$((i + 1)) c$i && ln -s d$((i + 1)) d$i; i=$((i + 1)); done; "
                   "$D pack v.json -o c2 && $D verify c42");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_str_eq(r.out, "c42: ok, 113 bytes, version 1, 2 buffers, 1 device pointer, 1 cpu buffer, out-of-band\n");
  res_free(r);
  run_expect("pack v.json -o d1", 1, NULL, "devpickle: d1: Too many levels of symbolic links\n");
  cr_assert_eq(count_entries(), 84, "a temporary file was left behind");
}

Test(cli, an_output_naming_an_open_descriptor_writes_that_descriptor_as_the_shell_opened_it) {
  spit("v.json", simple_json);
  /* a pipe; a file opened for appending; a file the shell writes around the
     output; /dev/fd/N; a descriptor not open */
  res_t r = run_sh("$D pack v.json -o f.dpk && $D unpack f.dpk -o /dev/stdout | cat > piped.json && "
                   "echo old > log && $D unpack f.dpk -o /dev/stdout >> log && "
                   "{ echo header; $D unpack f.dpk -o /proc/self/fd/1; echo footer; } > around.txt && "
                   "{ echo header; $D unpack f.dpk -o /proc/thread-self/fd/1; echo footer; } > thread.txt && "
                   "$D unpack f.dpk -o /dev/fd/9 9> fd9.json && "
                   "$D unpack f.dpk -o //dev/./fd/8 8> fd8.json && ln -s ../../../../../../../../dev/fd/7 fd7 && "
                   "$D unpack f.dpk -o fd7 7> fd7.json && "
                   "$D unpack f.dpk -o plain.json; $D unpack f.dpk -o /dev/fd/7 7>&-");
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_str_eq(r.err, "devpickle: /dev/fd/7: Bad file descriptor\n");
  res_free(r);
  r = run_sh("cmp piped.json plain.json && cmp fd9.json plain.json && cmp fd8.json plain.json && "
             "cmp fd7.json plain.json && { echo old; cat plain.json; } | cmp - log && "
             "{ echo header; cat plain.json; echo footer; } | cmp - around.txt && "
             "{ echo header; cat plain.json; echo footer; } | cmp - thread.txt");
  cr_assert_eq(r.status, 0, "an output through a descriptor's name was not written in place: %s", r.err);
  res_free(r);
  r = run_sh("$D unpack f.dpk -o /dev/fd/6 6< plain.json");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: /dev/fd/6: descriptor 6 is open for reading only\n");
  res_free(r);
  /* a descriptor of a directory is refused as a directory, not for being open for reading */
  r = run_sh("$D unpack f.dpk -o /dev/fd/9 9< .");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: /dev/fd/9: Is a directory\n");
  res_free(r);
  /* a number with a leading zero names no descriptor, as the kernel reads /dev/fd */
  run_expect("unpack f.dpk -o /dev/fd/01", 1, "", "devpickle: /dev/fd/01: No such file or directory\n");
}

Test(cli, an_output_named_with_the_longest_legal_file_name_is_written) {
  spit("v.json", simple_json);
  char name[256], args[1024];
  memset(name, 'n', 251);
  strcpy(name + 251, ".dpk");  /* 255 bytes: NAME_MAX */
  snprintf(args, sizeof args, "$D pack v.json -o %s && $D unpack %s -o %.250s.json", name, name, name);
  res_t r = run_sh(args);
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  snprintf(args, sizeof args, "verify %s", name);
  run_ok(args);
  cr_assert_eq(count_entries(), 3);
}

/* ---- send / recv ---- */

static void ucx_env(void) {
  setenv("UCX_TLS", "tcp,posix,sysv,self", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
}

/* Starts `devpickle recv 0 ... -o OUT` in dir, its stdout on out_fd (-1:
 * this process's), SIGPIPE as a shell leaves it; returns its pid and the
 * port it says it listens on (read from its stderr, which goes to
 * dir/.recv). */
static pid_t start_recv_to(const char *out, int out_fd, int *port) {
  ucx_env();
  char abs[512], errpath[128];
  cr_assert_not_null(realpath(cli, abs));
  path_in(errpath, sizeof errpath, ".recv");
  unlink(errpath); /* never the last receiver's port */
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || dup2(fd, 2) < 0 || chdir(dir) != 0 || (out_fd >= 0 && dup2(out_fd, 1) < 0)) _exit(99);
    signal(SIGPIPE, SIG_DFL);
    signal(SIGHUP, SIG_DFL); /* as a terminal's shell starts it */
    execl(abs, abs, "recv", "0", "--host", "127.0.0.1", "--timeout", "60", "-o", out, (char *)NULL);
    _exit(98);
  }
  char *line = NULL;
  for (int i = 0; i < 2000; i++) { /* up to 20 s for its first line */
    free(line);
    line = slurp(errpath, NULL);
    if (strchr(line, '\n')) break;
    usleep(10000);
  }
  cr_assert_eq(sscanf(line, "devpickle recv: listening on port %d", port), 1, "recv said: %s", line);
  free(line);
  return pid;
}

static pid_t start_recv(const char *out, int *port) { return start_recv_to(out, -1, port); }

static int wait_status(pid_t pid) {
  int st;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(cli, send_and_recv_move_an_inline_frame_that_arrives_verified_and_written_whole) {
  /* an inline frame: its tensor's bytes travel in it */
  pack_json("v.json",
            "{\"$object\": \"Checkpoint\", \"attrs\": {\"step\": 7, \"w\": {\"$tensor\": "
            "{\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"float32\", "
            "\"shape\": [2], \"data\": \"AACAPwAAAEA=\"}}}}",
            "f.dpk");
  int port;
  pid_t pid = start_recv("got.dpk", &port);
  char args[128];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d", port);
  run_out_has(args, 0, "f.dpk: sent ");
  cr_assert_eq(wait_status(pid), 0);
  assert_received_whole("f.dpk", "got.dpk");
  run_ok("verify got.dpk");
}

/* recv -o FIFO opened the FIFO only once a frame had come: with no reader
 * there it blocked in open for good, past its --timeout, and its sender
 * timed out unanswered. The FIFO is now opened before recv listens, its
 * reader awaited within --timeout; a frame then goes through it whole. */
Test(cli, recv_opens_a_fifo_before_it_listens_and_waits_for_its_reader_within_its_timeout, .timeout = 60) {
  ucx_env();
  char fifo[128];
  path_in(fifo, sizeof fifo, "fifo");
  cr_assert_eq(mkfifo(fifo, 0600), 0);
  run_expect("recv 0 --host 127.0.0.1 --timeout 1 -o fifo", 1, NULL,
             "devpickle: fifo: recv timed out: no process opened the FIFO for reading within 1 s (--timeout)\n");
  spit("v.json", "[1, {\"$bytes\": \"AAE=\"}]");
  run_ok("pack v.json -o f.dpk && (cat fifo > got.dpk &)");
  int port;
  pid_t pid = start_recv("fifo", &port);
  char args[128];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 20", port);
  run_ok(args);
  cr_assert_eq(wait_status(pid), 0);
  /* cat, in the background, writes what it read once the FIFO ends: given 10 s */
  res_t r = run_sh(
      "i=0; until cmp -s f.dpk got.dpk; do i=$((i + 1)); [ $i -lt 200 ] || break; sleep 0.05; done; "
      "cmp f.dpk got.dpk");
  cr_assert_eq(r.status, 0, "the frame read from the FIFO differs: %s", r.out);
  res_free(r);
}

/* With its stderr closed (2>&-), recv's output FIFO took descriptor 2 and
 * "devpickle recv: listening on port N" was written into it, ahead of the
 * frame, and recv exited 0. A closed descriptor 0, 1 or 2 is now held
 * (writes to it still fail, as on a closed one). */
Test(cli, a_closed_stderr_never_sends_a_message_into_an_output, .timeout = 60) {
  ucx_env();
  int port, fd = t_loopback_socket(0, &port);
  close(fd);
  spit("v.json", "[1, {\"$bytes\": \"AAE=\"}]");
  char script[1024];
  snprintf(script, sizeof script,
           "$D pack v.json -o f.dpk && mkfifo fifo && (cat fifo > got.dpk &) && "
           "($D recv %d --host 127.0.0.1 --timeout 30 -o fifo 2>&- & echo $! > recv.pid) && "
           "i=0; until $D send f.dpk 127.0.0.1:%d --timeout 10 2>/dev/null; do "
           "i=$((i + 1)); [ $i -lt 100 ] || exit 9; sleep 0.1; done; "
           "while kill -0 $(cat recv.pid) 2>/dev/null; do sleep 0.05; done; "
           "i=0; until cmp -s f.dpk got.dpk; do i=$((i + 1)); [ $i -lt 200 ] || break; sleep 0.05; done; "
           "cmp f.dpk got.dpk",
           port, port);
  res_t r = run_sh(script);
  cr_assert_eq(r.status, 0, "%s%s", r.out, r.err);
  res_free(r);
  r = run_sh("$D verify f.dpk >&-; echo $?"); /* a closed stdout still fails the write */
  cr_assert_str_eq(r.out, "1\n");
  cr_assert_str_eq(r.err, "devpickle: <stdout>: write failed: Bad file descriptor\n");
  res_free(r);
  /* and a name of a closed descriptor names no file, though /dev/null holds its place */
  r = run_sh("$D unpack f.dpk -o /dev/stdout >&-; echo $? >&2; $D verify /dev/stdin <&-; echo $? >&2; "
             "$D pack /dev/fd/0 -o g.dpk <&-; echo $? >&2; $D verify - <&-; echo $? >&2");
  cr_assert_str_eq(r.err,
                   "devpickle: /dev/stdout: Bad file descriptor\n1\n"
                   "devpickle: /dev/stdin: Bad file descriptor\n1\n"
                   "devpickle: /dev/fd/0: Bad file descriptor\n1\n"
                   "devpickle: <stdin>: read error: Bad file descriptor\n1\n");
  res_free(r);
}

/* A receiver that cannot write the frame says why, with the system's
 * reason, and tells the sender, which fails with the same reason. */
Test(cli, a_write_that_fails_on_the_receiver_is_an_error_with_its_reason_on_both_sides) {
  pack_json("v.json", "[1, {\"$bytes\": \"AAE=\"}]", "f.dpk");
  /* a name past 256 bytes is cut in the answer, and the cut marked */
  char longdir[300], longout[320], longwhy[400];
  snprintf(longdir, sizeof longdir, "gone/%0250d", 0);
  snprintf(longout, sizeof longout, "%s/got.dpk", longdir);
  snprintf(longwhy, sizeof longwhy, "%.256s…: No such file or directory", longout);
  const struct { const char *out, *why, *dir; } cases[] = {
      {"/dev/full", "/dev/full: write failed: No space left on device", NULL},
      /* a directory there when recv listens (one missing then is refused at once), gone when the frame comes */
      {"gone/got.dpk", "gone/got.dpk: No such file or directory", "gone"},
      {longout, longwhy, longdir},
  };
  for (int i = 0; i < 3; i++) {
    char cmd[400];
    if (cases[i].dir) {
      snprintf(cmd, sizeof cmd, "mkdir -p %s", cases[i].dir);
      res_free(run_sh(cmd));
    }
    int port;
    pid_t pid = start_recv(cases[i].out, &port);
    if (cases[i].dir) {
      snprintf(cmd, sizeof cmd, "rmdir %s", cases[i].dir);
      res_free(run_sh(cmd));
    }
    char args[128], want[1024];
    snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 30", port);
    res_t r = run(args);
    cr_assert_eq(wait_status(pid), 1, "recv exits 1 when it cannot write");
    cr_assert_eq(r.status, 1, "send: %s", r.err);
    snprintf(want, sizeof want, "devpickle: 127.0.0.1:%d: the receiver could not write the frame: %s\n", port,
             cases[i].why);
    cr_assert_str_eq(r.err, want);
    res_free(r);
    /* recv's own line names the whole file */
    snprintf(want, sizeof want, "devpickle recv: listening on port %d\ndevpickle: %s: %s\n", port, cases[i].out,
             strstr(cases[i].why, ": ") + 2);
    assert_file_is(".recv", want, "recv's stderr");
  }
}

/* recv -o - into a pipe nobody reads: the write fails (EPIPE), reported
 * on both sides as any failed write is — never a receiver killed by
 * SIGPIPE, silent, whose sender waits for UCX's keepalive. */
Test(cli, a_receiver_writing_to_a_closed_pipe_reports_the_broken_pipe_and_tells_the_sender) {
  pack_json("v.json", "[1, {\"$bytes\": \"AAE=\"}]", "f.dpk");
  int fds[2], port;
  cr_assert_eq(pipe(fds), 0);
  cr_assert_eq(fcntl(fds[0], F_SETFD, FD_CLOEXEC), 0); /* recv holds no read end either */
  pid_t pid = start_recv_to("-", fds[1], &port);
  close(fds[0]); /* nobody reads */
  close(fds[1]);
  char args[128], want[256];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 30", port);
  res_t r = run(args);
  cr_assert_eq(wait_status(pid), 1, "recv exits 1 when it cannot write (-1: killed by a signal)");
  cr_assert_eq(r.status, 1, "send: %s", r.err);
  snprintf(want, sizeof want,
           "devpickle: 127.0.0.1:%d: the receiver could not write the frame: <stdout>: write failed: Broken pipe\n",
           port);
  cr_assert_str_eq(r.err, want);
  res_free(r);
  snprintf(want, sizeof want, "devpickle recv: listening on port %d\ndevpickle: <stdout>: write failed: Broken pipe\n",
           port);
  assert_file_is(".recv", want, "recv's stderr");
}

/* Every timeout names the command that timed out and its limit. */
Test(cli, a_timeout_names_the_command_that_timed_out_what_it_waited_for_and_the_limit) {
  ucx_env();
  spit("v.json", "[1]");
  res_t r = run("pack v.json -o f.dpk");
  res_free(r);
  /* a listener that never answers UCX's handshake */
  int port, fd = t_loopback_socket(1, &port);
  char args[128], want[160];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 0.5", port);
  r = run(args);
  close(fd);
  cr_assert_eq(r.status, 1, "%s", r.err);
  snprintf(want, sizeof want,
           "devpickle: 127.0.0.1:%d: send timed out: no answer from the receiver within 0.5 s (--timeout)\n", port);
  cr_assert_str_eq(r.err, want);
  res_free(r);
  r = run("recv 0 --host 127.0.0.1 --timeout 0.25 -o never.dpk");
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_eq(sscanf(r.err, "devpickle recv: listening on port %d", &port), 1, "%s", r.err);
  snprintf(want, sizeof want,
           "devpickle recv: listening on port %d\ndevpickle: 127.0.0.1:%d: recv timed out: no frame within 0.25 s "
           "(--timeout)\n", port, port);
  cr_assert_str_eq(r.err, want);
  res_free(r);
}

Test(cli, a_file_name_holding_a_newline_cannot_forge_a_line_of_verify_or_send_output) {
  spit("v.json", "[1]");
  /* both summaries go to stdout: a name ending in a forged summary must stay on one line */
  res_t r = run_sh("$D pack v.json -o \"$(printf 'x\\ny.dpk: ok')\" && $D verify \"$(printf 'x\\ny.dpk: ok')\"");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_str_eq(r.out, "x\\u000ay.dpk: ok: ok, 43 bytes, version 1, 0 buffers, 0 device pointers, 0 cpu buffers, self-contained\n");
  res_free(r);
  int port;
  pid_t pid = start_recv("got.dpk", &port);
  char args[160];
  snprintf(args, sizeof args, "send \"$(printf 'x\\ny.dpk: ok')\" 127.0.0.1:%d", port);
  r = run(args);
  cr_assert_eq(r.status, 0, "send: %s", r.err);
  cr_assert_eq(wait_status(pid), 0);
  snprintf(args, sizeof args, "x\\u000ay.dpk: ok: sent 43 bytes to 127.0.0.1:%d\n", port);
  cr_assert_str_eq(r.out, args);
  res_free(r);
}

Test(cli, send_refuses_a_bad_frame_before_connecting_and_reports_a_refused_connection) {
  ucx_env();
  spit("bad.dpk", "DPKL this is no frame");
  run_err_has("send bad.dpk 127.0.0.1:1", 1, "devpickle: bad.dpk: ");
  pack_json("v.json", "[1, 2]", "f.dpk");
  /* a port where nobody listens: a bound socket that does not listen */
  int port, fd = t_loopback_socket(0, &port);
  char args[128];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 20", port);
  res_t r = run(args);
  close(fd);
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_not_null(strstr(r.err, "connection refused"), "%s", r.err);
  res_free(r);
  /* a frame over 64 KiB (it goes by rendezvous): the refusal is still the address's, not the file's */
  {
    char bp[256];
    path_in(bp, sizeof bp, "big.json");
    FILE *big = fopen(bp, "w");
    cr_assert_not_null(big);
    fputc('"', big);
    for (int i = 0; i < 200000; i++) fputc('x', big);
    fputs("\"\n", big);
    fclose(big);
  }
  run_ok("pack big.json -o big.dpk");
  fd = t_loopback_socket(0, &port);
  snprintf(args, sizeof args, "send big.dpk 127.0.0.1:%d --timeout 20", port);
  r = run(args);
  close(fd);
  char want[64];
  snprintf(want, sizeof want, "devpickle: 127.0.0.1:%d: ", port);
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_not_null(strstr(r.err, want), "a connection's error blamed on the file: %s", r.err);
  res_free(r);
  /* out-of-band buffers: refused before connecting (a receiver would be left without a frame) */
  pack_json("oob.json", simple_json, "oob.dpk");
  run_err_has("send oob.dpk 127.0.0.1:1", 1,
              "devpickle: oob.dpk: the frame's 2 buffers are out-of-band: send moves "
              "self-contained frames");
  run_err_has("send f.dpk nowhere", 2, "devpickle send: 'nowhere' is not HOST:PORT");
  run_err_has("recv 70000", 2, "devpickle recv: bad PORT '70000'");
}

/* A stream whose first 40 bytes are no frame's header is refused from
 * them: send (and unpack, which reads a frame whole as send does) stop
 * reading there, so /dev/zero or an endless pipe never fills the memory.
 * The stream here is a file of 1 MiB shared with `wc -c`, which counts
 * what the command left unread. */
Test(cli, send_stops_reading_a_stream_whose_header_is_no_frame_instead_of_reading_it_to_the_end) {
  static const char *cmds[] = {"send - 127.0.0.1:1", "unpack -"};
  for (int i = 0; i < 2; i++) {
    char script[256];
    snprintf(script, sizeof script, "head -c 1048576 /dev/zero > zeros.bin; { $D %s; wc -c; } < zeros.bin",
             cmds[i]);
    res_t r = run_sh(script);
    cr_assert_str_eq(r.err, "devpickle: <stdin>: not a devpickle frame (bad magic), at byte 0\n", "%s", cmds[i]);
    long left = strtol(r.out, NULL, 10);
    cr_assert_geq(left, 1048576 - 131072, "%s read %ld bytes past a header that is no frame's", cmds[i],
                  1048576 - left);
    res_free(r);
  }
}

/* A header announcing 2^62 bytes, then zeros: every frame command held
 * what came until the memory ran out (payload), or hashed it forever and
 * held it so (inline data behind a one-byte payload and table). What is
 * held is checked as it grows: a zero is a whole value, so the rest of a
 * 2^62-byte payload is after its root; a zero is no array, so no table,
 * which an inline frame must have. Refused once 64 KiB are in. So is a
 * payload and table well framed, the table's one buffer filling the 2^62
 * bytes of data, but whose value (an int) uses no buffer: the reader refuses
 * it whatever the data, and verify hashed the zeros forever, unpack and
 * send held them until the memory ran out. */
Test(cli, every_frame_command_refuses_zeros_behind_a_header_announcing_2_62_bytes_once_64_kib_are_in) {
  static const char *cmds[] = {"verify -", "dump -", "inspect -", "unpack -", "send - 127.0.0.1:1"};
  static const struct {
    const char *header; /* a printf script writing the 40 bytes to big.bin */
    const char *err;
  } cases[] = {
      {"printf 'DPKL\\001\\000\\000\\000\\000\\000\\000\\000\\000\\000\\000\\100' > big.bin; head -c 28 /dev/zero >> big.bin",
       "4611686018427387903 bytes after the root value in the payload, at byte 41"},
      {"printf 'DPKL\\001\\000\\001\\000\\001\\000\\000\\000\\000\\000\\000\\000\\001' > big.bin;"
       " head -c 14 /dev/zero >> big.bin; printf '\\100' >> big.bin; head -c 8 /dev/zero >> big.bin",
       "buffer table: array expected, at byte 41"},
      {"printf 'DPKL\\001\\000\\001\\000\\001\\000\\000\\000\\000\\000\\000\\000\\017' > big.bin;"
       " head -c 14 /dev/zero >> big.bin; printf '\\100' >> big.bin; head -c 8 /dev/zero >> big.bin;"
       " printf '\\000\\221\\225\\000\\000\\317\\100' >> big.bin; head -c 9 /dev/zero >> big.bin",
       "buffer 0 is referred to by no tensor: a frame lists only the buffers its value uses, at byte 42"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
    for (int i = 0; i < 5; i++) {
      char script[512], want[160];
      snprintf(script, sizeof script, "%s; head -c 4194304 /dev/zero >> big.bin; { $D %s; wc -c; } < big.bin",
               cases[k].header, cmds[i]);
      res_t r = run_sh(script);
      snprintf(want, sizeof want, "devpickle: <stdin>: %s\n", cases[k].err);
      cr_assert_str_eq(r.err, want, "case %zu: %s", k, cmds[i]);
      long left = strtol(r.out, NULL, 10);
      cr_assert_geq(left, 4194304 + 40 - 3 * 65536, "case %zu: %s read %ld bytes of a stream refused at its start", k,
                    cmds[i], 4194304 + 40 - left);
      res_free(r);
    }
}

/* unpack and send read the frame whole: they asked the pipe for 64 KiB at
 * once, so a header that is no frame's, followed by a pipe that stays open
 * and sends nothing more, held them until the pipe closed, while verify,
 * dump and inspect refused it from its 40 bytes. A FIFO that this process
 * keeps open for writing is such a pipe: a command still waiting for it is
 * ended by timeout (status 124). */
#define HEADER_BYTES 40 /* docs/FORMAT.md, "Layout" */

/* "pipe" in the test's folder, a FIFO this process holds open for writing
 * (opened read-write: the open does not wait for a reader), so that a
 * command reading it waits for bytes that never come; the descriptor. */
static int open_held_pipe(void) {
  char fifo[128];
  snprintf(fifo, sizeof fifo, "%s/pipe", dir);
  cr_assert_eq(mkfifo(fifo, 0600), 0);
  int w = open(fifo, O_RDWR | O_CLOEXEC);
  cr_assert_geq(w, 0);
  return w;
}

/* Every command that reads a frame, reading it from stdin. */
static const char *const stdin_frame_cmds[] = {"verify -", "dump -", "inspect -", "unpack -", "send - 127.0.0.1:1"};
Test(cli, every_frame_command_refuses_a_header_that_is_no_frames_while_its_pipe_stays_open, .timeout = 120) {
  int w = open_held_pipe();
  const char *const *cmds = stdin_frame_cmds;
  uint8_t huge[HEADER_BYTES];
  memset(huge, 0, sizeof huge);
  memcpy(huge, "DPKL\x01", 5);
  memset(huge + 8, 0xff, 16); /* payload and table: more than 2^64 bytes together */
  for (int h = 0; h < 2; h++) {
    for (size_t i = 0; i < sizeof stdin_frame_cmds / sizeof *stdin_frame_cmds; i++) {
      uint8_t zeros[HEADER_BYTES] = {0};
      cr_assert_eq(write(w, h ? huge : zeros, HEADER_BYTES), HEADER_BYTES);
      char script[160];
      snprintf(script, sizeof script, "timeout 20 \"$D\" %s < pipe", cmds[i]);
      res_t r = run_sh(script);
      cr_assert_eq(r.status, 1, "%s waited for the pipe to close (status %d): %s", cmds[i], r.status, r.err);
      cr_assert_str_eq(r.err,
                       h ? "devpickle: <stdin>: header announces 18446744073709551615 + 18446744073709551615 + 0 "
                           "body bytes: more than a frame can hold (its length must fit in 64 bits), at byte 8\n"
                         : "devpickle: <stdin>: not a devpickle frame (bad magic), at byte 0\n",
                       "%s", cmds[i]);
      res_free(r);
    }
  }
  close(w);
}

/* A header whose version or flags no frame has is refused by its 40 bytes
 * (README: "a stream whose first 40 bytes are no frame's header is refused
 * from them"): the reader looked at them only once the body they announce
 * was in, so an open pipe behind such a header held every frame command
 * until it closed, and then they read "truncated frame". */
Test(cli, every_frame_command_refuses_a_header_of_another_version_or_unknown_flags_while_its_pipe_stays_open,
     .timeout = 120) {
  int w = open_held_pipe();
  const char *const *cmds = stdin_frame_cmds;
  static const struct {
    uint8_t version, flags;
    const char *err;
  } heads[] = {
      {2, 0, "devpickle: <stdin>: unsupported version 2: this build reads frame version 1, at byte 4\n"},
      {1, 4, "devpickle: <stdin>: unknown frame flags 0x0004, at byte 6\n"},
  };
  for (size_t h = 0; h < sizeof heads / sizeof *heads; h++) {
    for (size_t i = 0; i < sizeof stdin_frame_cmds / sizeof *stdin_frame_cmds; i++) {
      uint8_t head[HEADER_BYTES] = {'D', 'P', 'K', 'L', heads[h].version, 0, heads[h].flags, 0, 1};
      cr_assert_eq(write(w, head, HEADER_BYTES), HEADER_BYTES); /* a payload of 1 byte announced, never sent */
      char script[160];
      snprintf(script, sizeof script, "timeout 5 \"$D\" %s < pipe", cmds[i]);
      res_t r = run_sh(script);
      cr_assert_eq(r.status, 1, "%s waited for the pipe to close (status %d): %s", cmds[i], r.status, r.err);
      cr_assert_str_eq(r.err, heads[h].err, "%s", cmds[i]);
      res_free(r);
    }
  }
  close(w);
  /* from a file, the same words */
  uint8_t head[HEADER_BYTES] = {'D', 'P', 'K', 'L', 2, 0, 0, 0, 1};
  char path[160];
  path_in(path, sizeof path, "v2.dpk");
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f);
  cr_assert_eq(fwrite(head, 1, sizeof head, f), sizeof head);
  fclose(f);
  run_err_only("verify v2.dpk", 1, "devpickle: v2.dpk: unsupported version 2: this build reads frame version 1, at byte 4\n");
}

/* Magic, then version, then the rest: a frame of another version is named
 * as such whatever follows its version bytes — a header cut short there
 * (with its pipe held open: refused from those 6 bytes), lengths no frame
 * has, a checksum that disagrees. Those read "truncated frame" or "more
 * than a frame can hold" before, which tells no reader to upgrade. */
Test(cli, verify_and_inspect_name_another_frame_version_whatever_follows_its_version_bytes, .timeout = 120) {
  int w = open_held_pipe();
  for (size_t i = 0; i < sizeof stdin_frame_cmds / sizeof *stdin_frame_cmds; i++) {
    cr_assert_eq(write(w, "DPKL\x02\x00", 6), 6);
    char script[160];
    snprintf(script, sizeof script, "timeout 5 \"$D\" %s < pipe", stdin_frame_cmds[i]);
    res_t r = run_sh(script);
    cr_assert_eq(r.status, 1, "%s waited for the pipe to close (status %d): %s", stdin_frame_cmds[i], r.status, r.err);
    cr_assert_str_eq(r.err, "devpickle: <stdin>: unsupported version 2: this build reads frame version 1, at byte 4\n",
                     "%s", stdin_frame_cmds[i]);
    res_free(r);
  }
  close(w);
  uint8_t huge[HEADER_BYTES + 3];
  memset(huge, 0xff, sizeof huge); /* lengths past 2^64, a checksum of nothing */
  memcpy(huge, "DPKL\x02\x00", 6);
  static const struct {
    const char *name;
    size_t n;
  } files[] = {{"v2-cut.dpk", 6}, {"v2-short.dpk", 20}, {"v2-huge.dpk", sizeof huge}};
  for (size_t k = 0; k < sizeof files / sizeof *files; k++) {
    char path[160];
    path_in(path, sizeof path, files[k].name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(huge, 1, files[k].n, f), files[k].n);
    fclose(f);
    for (int c = 0; c < 2; c++) {
      char args[64], want[200];
      snprintf(args, sizeof args, "%s %s", c ? "inspect" : "verify", files[k].name);
      snprintf(want, sizeof want,
               "devpickle: %s: unsupported version 2: this build reads frame version 1, at byte 4\n", files[k].name);
      run_err_only(args, 1, want);
    }
  }
}

/* Fewer than 40 bytes that are no frame's start ("hello", value JSON) with a
 * pipe that stays open behind them held every frame command until the pipe
 * closed: the header was asked for whole. The first bytes that differ from
 * the magic end the reading, and the message (and its hint on value JSON,
 * after blanks and a byte order mark) is what the closed pipe gets. */
Test(cli, every_frame_command_refuses_a_stream_from_its_first_bytes_that_are_no_frames_while_its_pipe_stays_open,
     .timeout = 120) {
  int w = open_held_pipe();
  const char *const *cmds = stdin_frame_cmds;
  static const struct {
    const char *bytes, *err;
  } starts[] = {
      {"hello", "devpickle: <stdin>: not a devpickle frame (bad magic), at byte 0\n"},
      {"DPX", "devpickle: <stdin>: not a devpickle frame (bad magic), at byte 0\n"},
      {"\xef\xbb\xbf\n {\"a\"", "devpickle: <stdin>: not a devpickle frame (bad magic): it starts like value JSON, "
                             "which 'devpickle pack' turns into a frame, at byte 0\n"},
  };
  for (size_t k = 0; k < sizeof starts / sizeof *starts; k++) {
    for (size_t i = 0; i < sizeof stdin_frame_cmds / sizeof *stdin_frame_cmds; i++) {
      size_t n = strlen(starts[k].bytes);
      cr_assert_eq(write(w, starts[k].bytes, n), (ssize_t)n);
      char script[160];
      snprintf(script, sizeof script, "timeout 20 \"$D\" %s < pipe", cmds[i]);
      res_t r = run_sh(script);
      cr_assert_eq(r.status, 1, "%s waited for the pipe to close (status %d): %s", cmds[i], r.status, r.err);
      cr_assert_str_eq(r.err, starts[k].err, "%s", cmds[i]);
      res_free(r);
      char drain[64]; /* what the command left unread stays in the pipe for the next */
      int fl = fcntl(w, F_GETFL);
      fcntl(w, F_SETFL, fl | O_NONBLOCK);
      while (read(w, drain, sizeof drain) > 0) {
      }
      fcntl(w, F_SETFL, fl);
    }
  }
  close(w);
}

/* An empty --host is a usage error (status 2, before listening), as a bad
 * PORT is, not a runtime failure naming the address ':0'. */
Test(cli, recv_refuses_an_empty_host_as_a_usage_error) {
  run_expect("recv 0 --host '' -o x.dpk --timeout 1", 2, NULL,
             "devpickle recv: --host needs a host name or address, not ''\n"
             "Try 'devpickle recv --help'.\n");
}

/* A host and its port given to --host (a natural slip: recv 5000 --host
 * 127.0.0.1:5000) was passed on as the host, and the transport named an
 * address nobody typed, "[127.0.0.1:5000]:0". It is a usage error; an IPv6
 * address (two colons and more) still gets the transport's own answer. */
Test(cli, recv_refuses_a_host_holding_a_port_as_a_usage_error) {
  run_expect("recv 5000 --host 127.0.0.1:5000 -o x.dpk --timeout 1", 2, NULL,
             "devpickle recv: --host '127.0.0.1:5000' holds a port: give the host alone (the port is "
             "PORT)\nTry 'devpickle recv --help'.\n");
  run_err_has("recv 0 --host ::1 -o x.dpk --timeout 1", 1, "is an IPv6 address");
}

/* recv built its listening address in a 320-byte buffer: a longer --host
 * lost the port, and the transport said the address was "not HOST:PORT";
 * send showed such a host cut without a mark. Both now pass the host whole,
 * and the transport names its length. */
Test(cli, a_host_too_long_for_the_transport_is_named_whole_with_its_port_by_recv_and_send) {
  char host[401], args[600], want[1000];
  memset(host, 'a', 400);
  host[400] = '\0';
  pack_json("f.json", "[1]", "f.dpk");
  snprintf(args, sizeof args, "recv 0 --host %s -o x.dpk --timeout 1", host);
  res_t r = run(args);
  cr_assert_eq(r.status, 1, "%s", r.err);
  snprintf(want, sizeof want,
           "devpickle: %s:0: transport: the host in '%.32s\xe2\x80\xa6' is too long (400 bytes, at most 255)\n", host,
           host);
  cr_assert_str_eq(r.err, want);
  res_free(r);
  snprintf(args, sizeof args, "send f.dpk %s:5000 --timeout 1", host);
  r = run(args);
  cr_assert_eq(r.status, 1, "%s", r.err);
  snprintf(want, sizeof want,
           "devpickle: %s:5000: transport: the host in '%.32s\xe2\x80\xa6' is too long (400 bytes, at most 255)\n",
           host, host);
  cr_assert_str_eq(r.err, want);
  res_free(r);
}

/* UCX logs its own errors, on stdout by default ("UCX ERROR bind(...)
 * failed: Address already in use"), where recv may be writing its frame; the
 * CLI's promise is one line on stderr per failure, so UCX's log is off unless
 * UCX_LOG_LEVEL asks for it. */
Test(cli, recv_on_a_port_in_use_says_so_in_one_line_naming_the_address_once_with_no_log_of_ucx_beside_it) {
  ucx_env();
  unsetenv("UCX_LOG_LEVEL");
  int port, fd = t_loopback_socket(1, &port);
  char args[160], want[200];
  snprintf(args, sizeof args, "recv %d --host 127.0.0.1 --timeout 1 -o never.dpk", port);
  res_t r = run(args);
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_str_eq(r.out, "", "UCX's log on stdout: %s", r.out);
  /* the transport's message names the address; recv does not name it again in front */
  snprintf(want, sizeof want, "devpickle: recv: cannot listen on 127.0.0.1:%d: the address is in use (", port);
  cr_assert_eq(strncmp(r.err, want, strlen(want)), 0, "%s", r.err);
  int named = 0;
  for (const char *p = r.err; (p = strstr(p, "127.0.0.1")) != NULL; p++) named++;
  cr_assert_eq(named, 1, "the address named %d times: %s", named, r.err);
  cr_assert_eq(strchr(r.err, '\n'), r.err + strlen(r.err) - 1, "more than one line on stderr: %s", r.err);
  res_free(r);
  /* a host given by name: the address it resolved to, once, not "localhost:N: ... 127.0.0.1:N" */
  snprintf(args, sizeof args, "recv %d --host localhost --timeout 1 -o never.dpk", port);
  r = run(args);
  cr_assert_eq(r.status, 1, "%s", r.err);
  snprintf(want, sizeof want, "devpickle: recv: cannot listen on 127.0.0.1:%d: the address is in use (", port);
  cr_assert_eq(strncmp(r.err, want, strlen(want)), 0, "%s", r.err);
  res_free(r);
  close(fd);
  /* asked for, UCX's log is there */
  fd = t_loopback_socket(1, &port);
  snprintf(args, sizeof args, "recv %d --host 127.0.0.1 --timeout 1 -o never.dpk", port);
  setenv("UCX_LOG_LEVEL", "error", 1);
  r = run(args);
  unsetenv("UCX_LOG_LEVEL");
  close(fd);
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert(strstr(r.out, "UCX  ERROR") || strstr(r.err, "UCX  ERROR"), "%s%s", r.out, r.err);
  res_free(r);
}

/* The transport names the peer in its message ("transport: endpoint to
 * 127.0.0.1:N: connection refused ..."); send names it in front, as every
 * message of the connection: said twice, the line read
 * "devpickle: 127.0.0.1:N: transport: endpoint to 127.0.0.1:N: ...". */
Test(cli, send_to_a_port_nobody_listens_on_names_the_address_once) {
  ucx_env();
  pack_json("v.json", "[1, 2]", "f.dpk");
  int port, fd = t_loopback_socket(0, &port); /* bound, not listening: refused at once */
  char args[128], want[128];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 20", port);
  res_t r = run(args);
  close(fd);
  cr_assert_eq(r.status, 1, "%s", r.err);
  snprintf(want, sizeof want, "devpickle: 127.0.0.1:%d: connection refused", port);
  cr_assert_eq(strncmp(r.err, want, strlen(want)), 0, "%s", r.err);
  int named = 0;
  for (const char *p = r.err; (p = strstr(p, "127.0.0.1")) != NULL; p++) named++;
  cr_assert_eq(named, 1, "the address named %d times: %s", named, r.err);
  cr_assert_eq(strchr(r.err, '\n'), r.err + strlen(r.err) - 1, "more than one line: %s", r.err);
  cr_assert_str_eq(r.out, "");
  res_free(r);
}

/* UCX 1.13 cannot reach an IPv6 peer: a receiver on ::1 corrupted its heap
 * on the first connection and aborted; one on "::" dropped IPv4 senders
 * and said only "timed out". Both commands refuse IPv6 with the reason,
 * at once; send shows the address unambiguously: [::1]:PORT, never
 * ::1:PORT (it takes either form); recv names the host once, in the
 * transport's words. */
Test(cli, send_and_recv_refuse_an_ipv6_address_at_once_saying_why_and_send_shows_it_in_brackets) {
  ucx_env();
  pack_json("v.json", "{\"a\": 1}", "f.dpk");
  static const char why[] = "is an IPv6 address, which the transport does not support (UCX 1.13's TCP transport "
                            "corrupts its heap reaching an IPv6 peer): use an IPv4 address";
  static const struct {
    const char *args, *addr, *host, *tail;
  } runs[] = {
      {"recv 0 --host ::1 -o x.dpk --timeout 5", "recv", "::1", " (0.0.0.0: every interface)"},
      {"recv 0 --host :: -o x.dpk --timeout 5", "recv", "::", " (0.0.0.0: every interface)"},
      {"recv 0 --host [::1] -o x.dpk --timeout 5", "recv", "::1", " (0.0.0.0: every interface)"},
      {"send f.dpk [::1]:5000 --timeout 5", "[::1]:5000", "::1", ""},
      {"send f.dpk ::1:5000 --timeout 5", "[::1]:5000", "::1", ""},
  };
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
    char want[512];
    /* recv's message names the host once: the transport's words, as recv's */
    int rcv = strcmp(runs[i].addr, "recv") == 0;
    snprintf(want, sizeof want, "devpickle: %s: %s'%s' %s%s\n", runs[i].addr, rcv ? "" : "transport: ", runs[i].host,
             why, runs[i].tail);
    run_expect(runs[i].args, 1, NULL, want);
  }
}

/* UCX says "Input/output error" when its bind() fails for an address that
 * is not this machine's; recv says what it is. */
Test(cli, recv_on_an_address_that_is_not_this_machines_says_so) {
  ucx_env();
  t_skip_if_local("192.0.2.1");
  run_expect("recv 0 --host 192.0.2.1 -o x.dpk --timeout 5", 1, NULL,
             "devpickle: recv: cannot listen on 192.0.2.1: it is not an address "
             "of this machine (Cannot assign requested address)\n");
}

/* A JSON number has no length limit (RFC 8259): a long decimal is the
 * nearest double, as VALUE_JSON.md says of every number with a fraction,
 * never "number too long"; a long integer that does not fit is named by its
 * first digits and its length. */
Test(cli, a_number_of_any_length_is_read_and_a_long_integer_out_of_range_is_named_briefly) {
  char json[2048];
  int k = snprintf(json, sizeof json, "[1.");
  for (int i = 0; i < 700; i++) json[k++] = '0';
  snprintf(json + k, sizeof json - (size_t)k, "1, 0.%0700d]", 5);
  spit("long.json", json);
  res_t r = run_sh("$D pack long.json -o long.dpk && $D unpack long.dpk --compact");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_str_eq(r.out, "[1.0,0.0]\n");
  res_free(r);
  k = snprintf(json, sizeof json, "[-");
  for (int i = 0; i < 600; i++) json[k++] = (char)('1' + i % 9);
  snprintf(json + k, sizeof json - (size_t)k, "]");
  pack_fails("int.json", "x.dpk", json,
             "devpickle: int.json: invalid JSON: integer -1234567891234567891234567891234567891234\xE2\x80\xA6 "
             "(600 digits) is outside int64 (-2^63 .. 2^63-1) (line 1, column 2), at byte 1\n");
  pack_fails("int.json", "x.dpk", "[9223372036854775807, 9223372036854775808]",
             "devpickle: int.json: invalid JSON: integer 9223372036854775808 is outside int64 (-2^63 .. 2^63-1) "
             "(line 1, column 23), at byte 22\n");
  /* 40 digits are shown whole, 41 cut to 40, with or without a sign */
  pack_fails("int.json", "x.dpk", "[1111111111222222222233333333334444444444]",
             "devpickle: int.json: invalid JSON: integer 1111111111222222222233333333334444444444 is outside int64 "
             "(-2^63 .. 2^63-1) (line 1, column 2), at byte 1\n");
  pack_fails("int.json", "x.dpk", "[11111111112222222222333333333344444444445]",
             "devpickle: int.json: invalid JSON: integer 1111111111222222222233333333334444444444\xE2\x80\xA6 "
             "(41 digits) is outside int64 (-2^63 .. 2^63-1) (line 1, column 2), at byte 1\n");
  pack_fails("int.json", "x.dpk", "[-11111111112222222222333333333344444444445]",
             "devpickle: int.json: invalid JSON: integer -1111111111222222222233333333334444444444\xE2\x80\xA6 "
             "(41 digits) is outside int64 (-2^63 .. 2^63-1) (line 1, column 2), at byte 1\n");
  /* numbers of 511, 512 and 513 characters: the parser's stack buffer holds
   * 511 and a NUL; longer ones go to the heap (ASan checks the edge) */
  for (int len = 511; len <= 513; len++) {
    k = snprintf(json, sizeof json, "[0.");
    for (int i = 2; i < len - 1; i++) json[k++] = '0';
    snprintf(json + k, sizeof json - (size_t)k, "5]");
    spit("edge.json", json);
    r = run_sh("$D pack edge.json -o edge.dpk && $D unpack edge.dpk --compact");
    cr_assert_eq(r.status, 0, "%d: %s", len, r.err);
    cr_assert_str_eq(r.out, "[0.0]\n", "%d", len);
    res_free(r);
  }
}

/* A tag with a field too many says so: a $ref to an existing name is not
 * reported as naming none, nor an $id with its "$value" as lacking one. */
Test(cli, an_id_or_ref_with_a_field_too_many_is_named_as_such) {
  pack_fails("ref.json", "x.dpk", "[{\"$id\": \"a\", \"$value\": []}, {\"$ref\": \"a\", \"x\": 1}]",
             "devpickle: ref.json: $ref takes no other fields, at $[1]\n");
  pack_fails("id.json", "x.dpk", "[{\"$id\": \"a\", \"$value\": [], \"$ref\": \"a\"}]",
             "devpickle: id.json: $id takes one other field, \"$value\", at $[0]\n");
  pack_fails("id2.json", "x.dpk", "[{\"$id\": \"a\"}]",
             "devpickle: id2.json: $id needs a string name and a \"$value\", at $[0]\n");
  pack_fails("ref2.json", "x.dpk", "[{\"$ref\": \"b\"}]", "devpickle: ref2.json: $ref \"b\" names no earlier $id, at $[0]\n");
}

/* The name of a temporary output file in dir (".devpickle-XXXXXX"), if any. */
static int tmp_file_in_dir(void) {
  DIR *d = opendir(dir);
  cr_assert_not_null(d);
  struct dirent *e;
  int found = 0;
  while ((e = readdir(d)) != NULL) found |= strncmp(e->d_name, ".devpickle-", 11) == 0;
  closedir(d);
  return found;
}

/* A command ended by a signal (Ctrl-C, kill, a hang-up) while it writes -o
 * removes its temporary file: an interrupted unpack of a large frame would
 * otherwise leave its gigabytes beside the target under a hidden name. The
 * old file stays as it was. */
/* deep.dpk: 64 nests 2,000 levels deep, which unpack writes indented as
 * about 8 MB of JSON each: long enough to be signalled while it writes. */
static void write_deep_frame(void) {
  char path[128];
  path_in(path, sizeof path, "deep.json");
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputc('[', f);
  for (int k = 0; k < 64; k++) {
    if (k) fputc(',', f);
    for (int i = 0; i < 1999; i++) fputc('[', f);
    fputc('1', f);
    for (int i = 0; i < 1999; i++) fputc(']', f);
  }
  fputs("]\n", f);
  fclose(f);
  run_ok("pack deep.json -o deep.dpk");
}

/* Starts `unpack deep.dpk -o out.json` in dir with sig's disposition set to
 * `disp` (and SIGINT's and SIGHUP's default first, as an interactive shell
 * starts it), and returns its pid once its temporary file is there. */
static pid_t unpack_started_with(int sig, void (*disp)(int)) {
  char abs[512];
  cr_assert_not_null(realpath(cli, abs));
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    if (chdir(dir) != 0) _exit(99);
    signal(SIGINT, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(sig, disp);
    execl(abs, abs, "unpack", "deep.dpk", "-o", "out.json", (char *)NULL);
    _exit(98);
  }
  int st, seen = 0;
  while (!seen && waitpid(pid, &st, WNOHANG) == 0) {
    seen = tmp_file_in_dir();
    if (!seen) usleep(1000);
  }
  cr_assert(seen, "unpack ended before its temporary file was seen");
  return pid;
}

/* `unpack deep.dpk -o out.json` (out.json holding "old") ended by signal
 * sig once its temporary file is there: it dies by sig, its temporary file
 * is gone and out.json is the old one. */
static void unpack_ended_by(int sig) {
  pid_t pid = unpack_started_with(sig, SIG_DFL);
  int st;
  kill(pid, sig);
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == sig, "unpack did not end by signal %d (status %d)", sig, st);
  cr_assert_not(tmp_file_in_dir(), "signal %d left the temporary file", sig);
  assert_file_is("out.json", "old\n", "the old output");
}

Test(cli, a_command_killed_while_it_writes_its_output_removes_its_temporary_file) {
  write_deep_frame();
  spit("out.json", "old\n");
  static const int sigs[] = {SIGTERM, SIGINT, SIGHUP};
  for (size_t s = 0; s < sizeof sigs / sizeof sigs[0]; s++) unpack_ended_by(sigs[s]);
}

/* Not only a terminal's signals end a command: a CPU-time limit (ulimit -t)
 * sends SIGXCPU, timeout -s and kill others, a profiler its timers. Each
 * left the temporary file of an interrupted -o beside the target. */
Test(cli, a_command_ended_by_a_limit_timer_or_user_signal_while_it_writes_removes_its_temporary_file) {
  write_deep_frame();
  spit("out.json", "old\n");
  static const int sigs[] = {SIGXCPU, SIGALRM, SIGUSR1, SIGUSR2, SIGVTALRM, SIGPROF, SIGPIPE};
  for (size_t s = 0; s < sizeof sigs / sizeof sigs[0]; s++) unpack_ended_by(sigs[s]);
}

/* A signal ignored when the command starts (nohup, a shell's background
 * job) stays ignored while the output is written: the command finishes. */
Test(cli, a_command_started_with_a_hang_up_ignored_finishes_its_output_when_hung_up) {
  write_deep_frame();
  spit("out.json", "old\n");
  pid_t pid = unpack_started_with(SIGHUP, SIG_IGN); /* as nohup starts it */
  int st;
  kill(pid, SIGHUP);
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "unpack did not finish (status %d)", st);
  cr_assert_not(tmp_file_in_dir(), "the temporary file was left");
  run_ok("unpack deep.dpk | cmp - out.json");
}

/* libucs takes SIGHUP (UCX_DEBUG_SIGNO) when it is loaded, and its handler
 * only raises UCX's log level: a hang-up left a receiver waiting for its
 * frame (and any command not yet writing) running on. It must end it. */
Test(cli, a_hang_up_ends_a_receiver_that_waits_for_its_frame) {
  int port;
  pid_t pid = start_recv("never.dpk", &port);
  cr_assert_eq(kill(pid, SIGHUP), 0);
  int st = 0;
  pid_t got = 0;
  for (int i = 0; i < 500 && (got = waitpid(pid, &st, WNOHANG)) == 0; i++) usleep(10000);
  if (got == 0) { /* still running after 5 s: end it, then fail */
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }
  cr_assert_eq(got, pid, "recv was still running 5 s after SIGHUP");
  cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGHUP, "recv did not end by SIGHUP (status %d)", st);
  char out[128];
  path_in(out, sizeof out, "never.dpk");
  cr_assert_neq(access(out, F_OK), 0, "a hang-up left an output file");
  cr_assert_not(tmp_file_in_dir(), "a hang-up left a temporary file");
}

/* Feeds `pack - -o x.dpk` a pipe of head then `unit` repeated, up to max
 * bytes or until pack closes it; returns the bytes written before it did. */
static size_t pack_from_a_long_pipe(const char *head, const char *unit, size_t unit_len, size_t max, int *status,
                                    char *err, size_t errsize) {
  char abs[512], errpath[256];
  cr_assert_not_null(realpath(cli, abs));
  path_in(errpath, sizeof errpath, ".childerr");
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    int dn = open("/dev/null", O_WRONLY), en = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (chdir(dir) != 0 || dup2(fds[0], 0) < 0 || dup2(dn, 1) < 0 || dup2(en, 2) < 0) _exit(126);
    close(fds[1]);
    execl(abs, abs, "pack", "-", "-o", "x.dpk", (char *)NULL);
    _exit(127);
  }
  close(fds[0]);
  void (*was)(int) = signal(SIGPIPE, SIG_IGN);
  static char chunk[1 << 16];
  for (size_t i = 0; i < sizeof chunk; i++) chunk[i] = unit[i % unit_len];
  size_t sent = strlen(head);
  cr_assert_eq(write(fds[1], head, sent), (ssize_t)sent);
  while (sent < max) {
    ssize_t k = write(fds[1], chunk, sizeof chunk);
    if (k <= 0) break;
    sent += (size_t)k;
  }
  close(fds[1]);
  signal(SIGPIPE, was);
  int st;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  char *e = slurp(errpath, NULL);
  snprintf(err, errsize, "%s", e);
  free(e);
  return sent;
}

/* README.md: a pipe whose reader has gone ends a command by SIGPIPE, as it
 * ends other filters; where SIGPIPE is ignored, the write fails as any
 * other: "<stdout>: write failed: Broken pipe", status 1 (recv is tested
 * for it apart). Each output here is far longer than a pipe holds. */
Test(cli, a_command_whose_reader_has_gone_reports_the_broken_pipe_where_sigpipe_is_ignored) {
  size_t cap = 20000 * 120 + 16, n = 0;
  char *text = malloc(cap);
  n += (size_t)snprintf(text + n, cap - n, "[");
  for (int i = 0; i < 20000; i++)
    n += (size_t)snprintf(text + n, cap - n,
                          "%s{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x%x\", \"nbytes\": 4, \"dtype\": "
                          "\"uint8\", \"shape\": [4]}}",
                          i ? ", " : "", 0x1000 + 16 * i);
  snprintf(text + n, cap - n, "]");
  spit("many.json", text);
  free(text);
  run_ok("pack many.json -o many.dpk");
  static const char *const cmds[] = {"unpack many.dpk", "unpack --compact many.dpk", "inspect many.dpk",
                                     "dump many.dpk", "dump --json many.dpk", "pack many.json -o -"};
  for (size_t c = 0; c < sizeof cmds / sizeof cmds[0]; c++) {
    char script[512];
    snprintf(script, sizeof script,
             "trap '' PIPE; { $D %s 2>pipe.err; echo $? >pipe.st; } | head -c 1 >/dev/null; cat pipe.st pipe.err",
             cmds[c]);
    res_t r = run_sh(script);
    cr_assert_str_eq(r.out, "1\ndevpickle: <stdout>: write failed: Broken pipe\n", "%s", cmds[c]);
    res_free(r);
    /* and SIGPIPE, as a shell leaves it, ends the command */
    snprintf(script, sizeof script, "{ $D %s 2>pipe.err; echo $? >pipe.st; } | head -c 1 >/dev/null; cat pipe.st pipe.err",
             cmds[c]);
    void (*was)(int) = signal(SIGPIPE, SIG_DFL); /* a shell cannot restore a signal ignored on its entry */
    r = run_sh(script);
    signal(SIGPIPE, was);
    cr_assert_str_eq(r.out, "141\n", "%s", cmds[c]);
    res_free(r);
  }
}

/* pack reads its JSON to the end of its input, but not past a byte that
 * already makes it no JSON: /dev/zero, `yes` or any endless pipe of garbage
 * was read to the memory's end (a frame command stops after a header that
 * is no frame's; pack had no such stop). The message is the one the whole
 * text would get, at the same byte. */
Test(cli, pack_stops_reading_an_input_once_what_came_is_no_json_whatever_follows) {
  static const struct {
    const char *unit;
    size_t len;
    const char *err;
  } runs[] = {
      {"\0", 1, "devpickle: <stdin>: invalid JSON: unexpected byte 0x00 (line 1, column 1), at byte 0\n"},
      {"[1]\n", 4, "devpickle: <stdin>: invalid JSON: end of input expected, not '[' (line 2, column 1), at byte 4\n"},
      {"{\"a\": 1, \"a\": 2}", 17, "devpickle: <stdin>: invalid JSON: duplicate object key \"a\" (line 1, column 10), at byte 9\n"},
  };
  const size_t max = 64 << 20;
  for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
    int status;
    char err[512];
    size_t sent = pack_from_a_long_pipe("", runs[i].unit, runs[i].len, max, &status, err, sizeof err);
    cr_assert_eq(status, 1, "run %zu: %s", i, err);
    cr_assert_str_eq(err, runs[i].err, "run %zu", i);
    cr_assert_lt(sent, (size_t)1 << 20, "run %zu: pack read %zu bytes of a stream that was no JSON from its start", i,
                 sent);
  }
  /* JSON so far is read on: a long valid text is packed whole */
  char path[128];
  path_in(path, sizeof path, "long.json");
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputc('[', f);
  for (int i = 0; i < 300000; i++) fprintf(f, "%s\"s%d\"", i ? "," : "", i);
  fputs("]\n", f);
  fclose(f);
  res_t r = run_sh("$D pack long.json -o long.dpk && $D unpack --compact long.dpk | $D pack - -o again.dpk && "
                   "cmp long.dpk again.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
}

/* A duplicate key makes a text no JSON whatever follows, in an object still
 * open too: pack stops reading there, as it does at any other such error,
 * with the message the whole text gets. It read on to the stream's end (the
 * memory's, for an endless one): the check of what came kept no keys. Keys
 * are compared as decoded ("k\u0061" is "ka"), and only within one object. */
Test(cli, pack_stops_reading_at_a_duplicate_key_of_an_object_still_open) {
  static const struct {
    const char *head;
    const char *err;
  } runs[] = {
      {"{\"a\": 1, \"a\": [", "devpickle: <stdin>: invalid JSON: duplicate object key \"a\" (line 1, column 10), at byte 9\n"},
      {"[{\"x\": {\"k\\u0061\": 1, \"ka\": [",
       "devpickle: <stdin>: invalid JSON: duplicate object key \"ka\" (line 1, column 23), at byte 22\n"},
      {"{\"a\": {\"b\": 1}, \"b\": {\"b\": 2, \"c\": {}}, \"a\": [",
       "devpickle: <stdin>: invalid JSON: duplicate object key \"a\" (line 1, column 41), at byte 40\n"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
    int status;
    char err[512];
    size_t sent = pack_from_a_long_pipe(runs[i].head, "1, ", 3, 64 << 20, &status, err, sizeof err);
    cr_assert_eq(status, 1, "run %zu: %s", i, err);
    cr_assert_str_eq(err, runs[i].err, "run %zu", i);
    cr_assert_lt(sent, (size_t)1 << 20, "run %zu: pack read %zu bytes past a duplicate key", i, sent);
  }
  /* one key in two objects, open or closed, is no duplicate: read to the end */
  int status;
  char err[512];
  size_t sent = pack_from_a_long_pipe("{\"a\": {\"a\": {}, \"b\": {\"a\": 1}}, \"b\": [", "1, ", 3, 4 << 20, &status,
                                      err, sizeof err);
  cr_assert_eq(status, 1, "%s", err);
  cr_assert_geq(sent, (size_t)4 << 20, "pack stopped after %zu bytes of JSON so far", sent);
  cr_assert_not_null(strstr(err, "premature end of input"), "%s", err);
}

/* An empty -o name is no file: it was taken as one, the whole output
 * written to a temporary file and then "devpickle: : write failed: No such
 * file or directory" (status 1) when the rename failed. */
Test(cli, an_empty_output_name_is_a_usage_error_before_anything_is_done) {
  spit("v.json", simple_json);
  run_ok("pack v.json -o a.dpk");
  static const char *const runs[][2] = {
      {"pack v.json -o ''", "devpickle pack: -o needs a file name, not ''\n"},
      {"unpack a.dpk --output ''", "devpickle unpack: --output needs a file name, not ''\n"},
      {"recv 0 --timeout 0.1 -o ''", "devpickle recv: -o needs a file name, not ''\n"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
    res_t r = run(runs[i][0]);
    cr_assert_eq(r.status, 2, "%s: %s", runs[i][0], r.err);
    cr_assert_eq(strncmp(r.err, runs[i][1], strlen(runs[i][1])), 0, "%s: %s", runs[i][0], r.err);
    cr_assert_not(tmp_file_in_dir(), "%s left a temporary file", runs[i][0]);
    res_free(r);
  }
}

/* 'devpickle help COMMAND' is COMMAND --help, as a new user types it. */
Test(cli, help_followed_by_a_command_prints_that_commands_help) {
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify", "demo", "send", "recv"};
  for (int i = 0; i < 8; i++) {
    char args[64], want[64];
    snprintf(args, sizeof args, "help %s", cmds[i]);
    res_t r = run(args);
    cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
    snprintf(want, sizeof want, "usage: devpickle %s", cmds[i]);
    cr_assert_eq(strncmp(r.out, want, strlen(want)), 0, "%s says: %s", args, r.out);
    res_free(r);
  }
  res_t r = run("help bogus");
  cr_assert_eq(r.status, 2);
  cr_assert_eq(strncmp(r.err, "devpickle: unknown command 'bogus'\n", 35), 0, "%s", r.err);
  res_free(r);
  r = run("help help"); /* help is a command too: its help is the main one */
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_eq(strncmp(r.out, "usage: devpickle <command>", 26), 0, "%s", r.out);
  res_free(r);
  run_expect("help pack unpack", 2, NULL,
             "devpickle help: unexpected argument 'unpack'\nTry 'devpickle help COMMAND'.\n");
}

/* A number past the largest double is refused; the message says how value
 * JSON writes an infinity, as docs/VALUE_JSON.md does. */
Test(cli, a_real_number_past_the_largest_double_says_how_to_write_an_infinity) {
  pack_fails("big.json", "big.dpk", "[1e400]",
             "devpickle: big.json: invalid JSON: real number overflow; write an infinity as {\"$float\": \"inf\"} "
             "(line 1, column 2), at byte 1\n");
}

/* A dtype the reader does not know (or none) is answered with the list it
 * knows, so the user need not look it up. */
Test(cli, an_unknown_or_missing_tensor_dtype_lists_the_dtypes_pack_takes) {
  pack_fails("t.json", "t.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": \"float8\", "
             "\"shape\": [8]}}",
             "devpickle: t.json: unknown tensor dtype \"float8\" (one of bool, int8, int16, int32, int64, uint8, "
             "uint16, uint32, uint64, float16, bfloat16, float32, float64, complex64, complex128), at $\n");
  pack_fails("m.json", "m.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"shape\": [8]}}",
             "devpickle: m.json: tensor dtype missing (one of bool, int8, int16, int32, int64, uint8, uint16, "
             "uint32, uint64, float16, bfloat16, float32, float64, complex64, complex128), at $\n");
}

/* inspect's path column is 40 characters wide: a path holding a multi-byte
 * UTF-8 character is padded by characters, so its kind starts where every
 * other line's does. */
Test(cli, inspect_lines_up_a_path_with_a_non_ascii_key_by_characters_not_bytes) {
  pack_json("u.json", "{\"\\u00e9\": 1, \"ab\": 2}", "u.dpk");
  res_t r = run("inspect u.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "\n$[\"\xc3\xa9\"]                                    int 1\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "\n$.ab                                      int 2\n"), "%s", r.out);
  res_free(r);
}

/* A usage error says what the command takes: recv's PORT range, the
 * SECONDS --timeout takes; both helps say the latter too. */
Test(cli, a_bad_port_or_timeout_is_answered_with_what_the_command_takes) {
  static const struct {
    const char *args, *err;
  } runs[] = {
      {"recv 70000", "devpickle recv: bad PORT '70000' (0 to 65535; 0: any free port)\n"
                     "Try 'devpickle recv --help'.\n"},
      {"recv 0 --timeout 0", "devpickle recv: bad --timeout '0' (SECONDS: a number over 0 and at most 1000000, "
                             "as 30 or 0.5)\nTry 'devpickle recv --help'.\n"},
      {"send f.dpk 127.0.0.1:1 --timeout soon", "devpickle send: bad --timeout 'soon' (SECONDS: a number over 0 and "
                                                "at most 1000000, as 30 or 0.5)\nTry 'devpickle send --help'.\n"},
      /* a PORT is digits, 1 to 65535 for send, at most five of them for recv */
      {"send f.dpk 127.0.0.1:0", "devpickle send: '127.0.0.1:0' is not HOST:PORT (PORT 1 to 65535)\n"
                                 "Try 'devpickle send --help'.\n"},
      {"send f.dpk 127.0.0.1:+5000", "devpickle send: '127.0.0.1:+5000' is not HOST:PORT (PORT 1 to 65535)\n"
                                     "Try 'devpickle send --help'.\n"},
      {"send f.dpk '127.0.0.1: 5000'", "devpickle send: '127.0.0.1: 5000' is not HOST:PORT (PORT 1 to 65535)\n"
                                       "Try 'devpickle send --help'.\n"},
      {"recv 000005000 --timeout 0.2", "devpickle recv: bad PORT '000005000' (0 to 65535; 0: any free port)\n"
                                       "Try 'devpickle recv --help'.\n"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
    run_expect(runs[i].args, 2, NULL, runs[i].err);
  }
  res_t r = run("send --help");
  cr_assert_not_null(strstr(r.out, "SECONDS (over 0, at most 1000000, fractions allowed; default 60)"), "%s", r.out);
  res_free(r);
  r = run("recv --help");
  cr_assert_not_null(strstr(r.out, "without a frame (over 0, at most 1000000,\nfractions allowed; default: wait)"),
                     "%s", r.out);
  res_free(r);
}

/* '-x.dpk' is an option until '--'; when a file of that name exists, the
 * usage error shows how to name it: ./-x.dpk, where it stands (the line it
 * showed, "devpickle send -- -f.dpk", fails as typed: it lacks HOST:PORT). */
Test(cli, an_unknown_option_that_names_an_existing_file_shows_how_to_name_it_where_it_stands) {
  pack_json("v.json", simple_json, "./-f.dpk");
  run_expect("verify -f.dpk", 2, NULL,
             "devpickle verify: unknown option '-f.dpk' (the file is ./-f.dpk, or after '--')\n"
             "Try 'devpickle verify --help'.\n");
  run_expect("send -f.dpk 127.0.0.1:1", 2, NULL,
             "devpickle send: unknown option '-f.dpk' (the file is ./-f.dpk, or after '--')\n"
             "Try 'devpickle send --help'.\n");
  spit("-v.json", simple_json);
  run_expect("pack -v.json -o w.dpk", 2, NULL,
             "devpickle pack: unknown option '-v.json' (the file is ./-v.json, or after '--')\n"
             "Try 'devpickle pack --help'.\n");
  res_t r = run("pack ./-v.json -o w.dpk"); /* the line as typed, with the name the hint gives, works */
  cr_assert_eq(r.status, 0, "%s", r.err);
  res_free(r);
  r = run("verify -g.dpk"); /* no such file: an option, nothing more */
  cr_assert_str_eq(r.err, "devpickle verify: unknown option '-g.dpk'\nTry 'devpickle verify --help'.\n");
  res_free(r);
}

/* Value JSON handed to a command that reads a frame (verify model.json) is
 * refused at byte 0, as any non-frame is, and the message names the command
 * that reads it; other bytes get the reader's message alone. */
Test(cli, a_frame_command_given_value_json_says_that_pack_turns_it_into_a_frame) {
  spit("v.json", "\n  {\"a\": 1}");
  static const char *const cmds[] = {"verify v.json", "dump v.json", "inspect v.json", "unpack v.json",
                                     "verify - < v.json", "unpack - < v.json", "send v.json 127.0.0.1:1"};
  for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
    res_t r = run(cmds[i]);
    cr_assert_eq(r.status, 1, "%s: %s", cmds[i], r.err);
    const char *file = strstr(cmds[i], "- <") ? "<stdin>" : "v.json";
    char want[256];
    snprintf(want, sizeof want, "devpickle: %s: not a devpickle frame (bad magic): it starts like value JSON, "
             "which 'devpickle pack' turns into a frame, at byte 0\n", file);
    cr_assert_str_eq(r.err, want, "%s", cmds[i]);
    res_free(r);
  }
  /* after a UTF-8 byte order mark, tabs and CRs; a str is value JSON too */
  static const struct {
    const char *name, *text;
  } others[] = {{"bom.json", "\xef\xbb\xbf[1]"}, {"tab.json", "\t\r\n\"s\""}};
  for (size_t i = 0; i < sizeof others / sizeof *others; i++) {
    spit(others[i].name, others[i].text);
    char args[64], want[256];
    snprintf(args, sizeof args, "verify %s", others[i].name);
    res_t r = run(args);
    cr_assert_eq(r.status, 1, "%s: %s", args, r.err);
    snprintf(want, sizeof want, "devpickle: %s: not a devpickle frame (bad magic): it starts like value JSON, "
             "which 'devpickle pack' turns into a frame, at byte 0\n", others[i].name);
    cr_assert_str_eq(r.err, want, "%s", args);
    res_free(r);
  }
  spit("t.txt", "hello\n");
  res_t r = run("verify t.txt");
  cr_assert_str_eq(r.err, "devpickle: t.txt: not a devpickle frame (bad magic), at byte 0\n");
  res_free(r);
}

/* The converse: a frame handed to pack (pack and unpack confused) was "invalid
 * JSON: unexpected 'D'" alone; the message now names the command that reads
 * it. Other text that is no JSON gets the parser's message alone. */
Test(cli, pack_given_a_frame_says_that_unpack_turns_it_into_value_json) {
  spit("v.json", "[1, \"a\"]");
  run_ok("pack v.json -o f.dpk");
  static const char *const cmds[] = {"pack f.dpk -o g.dpk", "pack - -o g.dpk < f.dpk"};
  for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
    const char *file = strstr(cmds[i], "- -o") ? "<stdin>" : "f.dpk";
    char want[256];
    snprintf(want, sizeof want, "devpickle: %s: invalid JSON: unexpected 'D' (line 1, column 1): it starts like a "
             "devpickle frame, which 'devpickle unpack' turns into value JSON, at byte 0\n", file);
    run_expect(cmds[i], 1, "", want);
  }
  spit("d.txt", "DPK");
  run_expect("pack d.txt -o g.dpk", 1, "", "devpickle: d.txt: invalid JSON: unexpected 'D' (line 1, column 1), at byte 0\n");
  char g[128];
  path_in(g, sizeof g, "g.dpk");
  cr_assert_neq(access(g, F_OK), 0, "pack wrote an output");
}

/* The main help names --version and -o's long form, both of which work. */
Test(cli, the_main_help_names_version_and_the_long_form_of_dash_o) {
  res_t r = run("--help");
  cr_assert_not_null(strstr(r.out, "'devpickle --version' prints the version"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "-o (or --output)"), "%s", r.out);
  res_free(r);
  r = run("--version");
  cr_assert_eq(r.status, 0);
  cr_assert_eq(strncmp(r.out, "devpickle ", 10), 0, "%s", r.out);
  res_free(r);
  spit("v.json", simple_json);
  run_ok("pack v.json --output v.dpk");
  run_ok("verify v.dpk");
  r = run("pack --help");
  cr_assert_not_null(strstr(r.out, "the system's message for a file that cannot be read\nor written"), "%s", r.out);
  res_free(r);
}

/* The main help's list of commands names every option each command's own
 * usage line shows, on that command's line (or the lines that continue it): send's --timeout and recv's
 * --host and --timeout were named only in the note on attached values, with
 * no word of which command takes them. */
Test(cli, the_main_help_names_each_commands_options_on_its_line) {
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify", "demo", "send", "recv"};
  res_t m = run("--help");
  for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
    char args[64], key[32];
    snprintf(args, sizeof args, "%s --help", cmds[i]);
    res_t r = run(args);
    snprintf(key, sizeof key, "\n  %s ", cmds[i]);
    const char *at = strstr(m.out, key);
    cr_assert_not_null(at, "the main help lists no '%s': %s", cmds[i], m.out);
    size_t len = strcspn(at + 1, "\n"); /* with the lines that continue it, indented deeper */
    while (strncmp(at + 1 + len, "\n   ", 4) == 0) len += 1 + strcspn(at + 2 + len, "\n");
    char line[512];
    snprintf(line, sizeof line, "%.*s", (int)len, at + 1);
    size_t ulen = strcspn(r.out, "\n");
    int named = 0;
    for (const char *o = r.out + 1; (o = strchr(o, '-')) && (size_t)(o - r.out) < ulen; o += strcspn(o, " ]\n")) {
      if (o[-1] != ' ' && o[-1] != '[') continue;
      char opt[32];
      snprintf(opt, sizeof opt, "%.*s", (int)strcspn(o, " ]\n"), o);
      named++;
      cr_assert_not_null(strstr(line, opt), "the main help's line for %s does not name %s: '%s'", cmds[i], opt,
                         line);
    }
    if (!strcmp(cmds[i], "recv")) cr_assert_eq(named, 3, "recv's usage names -o, --host and --timeout: %s", r.out);
    res_free(r);
  }
  res_free(m);
}

/* The examples the helps show run as written, in a copy of the source
 * tree's examples/: the main help's, one a line after "examples", then each
 * command's "Example:" line (pack's makes the model.dpk the others read).
 * recv and send's need a port, and are run by the transport tests. */
static void run_example(const char *line) {
  char script[512];
  size_t o = 0;
  for (const char *p = line; *p && *p != '\n' && o < sizeof script - 8;) {
    if (strncmp(p, "devpickle ", 10) == 0 && (p == line || p[-1] == ' ')) {
      o += (size_t)snprintf(script + o, sizeof script - o, "$D ");
      p += 10;
    } else {
      script[o++] = *p++;
    }
  }
  script[o] = '\0';
  res_t r = run_sh(script);
  cr_assert_eq(r.status, 0, "the example '%s' failed: %s", script, r.err);
  res_free(r);
}

Test(cli, every_example_the_helps_show_runs_as_written) {
  char ex[256], src[512];
  path_in(ex, sizeof ex, "examples");
  cr_assert_eq(mkdir(ex, 0755), 0);
  cr_assert_not_null(realpath("examples/model.json", src));
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "cp '%s' '%s/'", src, ex);
  cr_assert_eq(system(cmd), 0);
  res_t h = run("--help");
  const char *at = strstr(h.out, "\nexamples (in the source tree):\n");
  cr_assert_not_null(at, "the main help shows no examples: %s", h.out);
  at = strchr(at + 1, '\n') + 1;
  int n = 0;
  for (; strncmp(at, "  ", 2) == 0; at = strchr(at, '\n') + 1, n++) run_example(at + 2);
  cr_assert_geq(n, 3, "the main help's examples");
  res_free(h);
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify"};
  for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
    char args[64];
    snprintf(args, sizeof args, "%s --help", cmds[i]);
    res_t r = run(args);
    const char *e = strstr(r.out, "\nExample: ");
    cr_assert_not_null(e, "%s shows no example", args);
    run_example(e + 10);
    res_free(r);
  }
}

/* Each command's help that prints says where its output goes, and dump's
 * what its last line is, as the commands do. */
Test(cli, the_helps_of_commands_that_print_say_their_output_goes_to_stdout) {
  static const struct {
    const char *cmd, *says;
  } helps[] = {
      {"dump", "Lists on stdout the device allocations"},
      {"dump", "then 'N\nallocations on M devices'"},
      {"inspect", "Prints on stdout the frame's header"},
      {"verify", "Prints one line on stdout and exits 0: 'FILE: ok, N bytes"},
      {"verify", "B buffers, D device pointers, C cpu buffers"},
      {"verify", "the error line on stderr"},
      {"demo", "Prints on stdout the allocations"},
      {"send", "'FRAME.dpk: sent N bytes to HOST:PORT' on stdout"},
  };
  for (size_t i = 0; i < sizeof helps / sizeof *helps; i++) {
    char args[64];
    snprintf(args, sizeof args, "%s --help", helps[i].cmd);
    res_t r = run(args);
    cr_assert_not_null(strstr(r.out, helps[i].says), "%s lacks \"%s\":\n%s", args, helps[i].says, r.out);
    res_free(r);
  }
  spit("v.json", simple_json);
  res_t r = run("pack v.json -o v.dpk");
  res_free(r);
  run_out_has("dump v.dpk", 0, "\n2 allocations on 2 devices\n");
}

/* pack's help named the notation's document only, which an installed
 * devpickle does not carry: it shows every tagged form, and its tensor
 * example, taken from the help as printed, packs. */
Test(cli, pack_help_shows_every_tag_of_value_json_and_a_tensor_that_packs) {
  res_t r = run("pack --help");
  cr_assert_eq(r.status, 0);
  static const char *const forms[] = {"{\"$tuple\": [...]}", "{\"$bytes\": \"<base64>\"}",
                                      "{\"$dict\": [[key, value], ...]}", "{\"$float\": \"nan\"}",
                                      "{\"$object\": \"Class\", \"attrs\": {...}}",
                                      "{\"$reduce\": \"Type\", \"state\": V}", "{\"$id\": \"name\", \"$value\": V}",
                                      "{\"$ref\": \"name\"}", "\"strides\"", "\"offset\"", "\"data\""};
  for (size_t i = 0; i < sizeof forms / sizeof *forms; i++)
    cr_assert_not_null(strstr(r.out, forms[i]), "pack --help lacks %s:\n%s", forms[i], r.out);
  const char *t = strstr(r.out, "{\"$tensor\":"), *end = t ? strstr(t, "}}") : NULL;
  cr_assert(t && end, "pack --help shows no tensor:\n%s", r.out);
  char json[512];
  snprintf(json, sizeof json, "%.*s", (int)(end + 2 - t), t);
  spit("t.json", json);
  res_free(r);
  run_ok("pack t.json -o t.dpk");
  r = run("dump t.dpk");
  cr_assert_str_eq(r.out, "DEVICE    POINTER                    BYTES   REFS  FIRST PATH\n"
                          "cuda:0    0x00007f0000001000          4096      1  $\n"
                          "1 allocation on 1 device\n");
  res_free(r);
}

/* An option's value may come in its own argument (-o F, --output F) or in
 * the option's (--output=F, -oF, --timeout=S), as getopt_long takes them. */
Test(cli, an_option_takes_its_value_attached_as_well_as_in_the_next_argument) {
  spit("v.json", simple_json);
  static const char *const packs[] = {"pack v.json --output=a.dpk", "pack v.json -ob.dpk", "pack --output c.dpk v.json"};
  static const char *const outs[] = {"a.dpk", "b.dpk", "c.dpk"};
  for (int i = 0; i < 3; i++) {
    run_ok(packs[i]);
    char args[64];
    snprintf(args, sizeof args, "verify %s", outs[i]);
    run_ok(args);
  }
  run_expect("pack v.json --output=", 2, NULL,
             "devpickle pack: --output needs a file name, not ''\nTry 'devpickle pack --help'.\n");
  run_err_has("recv 0 --timeout=0.2", 1, "no frame within 0.2 s (--timeout)");
}

/* SECONDS is a decimal number; strtod's other spellings (hex, words, a
 * sign, leading space) are usage errors, not a time. */
Test(cli, a_timeout_written_in_hex_or_as_a_word_is_refused) {
  static const char *const bad[] = {"0x10", "inf", "nan", "+5", "-1", " 5", "1.2.3", ".", "1e", "1e+", "5s"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    char args[64], want[160];
    snprintf(args, sizeof args, "recv 0 --timeout '%s'", bad[i]);
    snprintf(want, sizeof want, "devpickle recv: bad --timeout '%s' (SECONDS", bad[i]);
    res_t r = run(args);
    cr_assert_eq(r.status, 2, "%s: %s", args, r.err);
    cr_assert_eq(strncmp(r.err, want, strlen(want)), 0, "%s: %s", args, r.err);
    res_free(r);
  }
}

/* --help answers wherever it comes among a command's options, whatever
 * else is there; before a command it is that command's help. */
Test(cli, help_wins_wherever_it_comes_and_before_a_command_is_that_commands_help) {
  static const char *const cmds[] = {"pack", "unpack", "dump", "inspect", "verify", "demo", "send", "recv"};
  for (int i = 0; i < 8; i++) {
    char args[64], want[64];
    snprintf(want, sizeof want, "usage: devpickle %s", cmds[i]);
    snprintf(args, sizeof args, "%s --bogus --help", cmds[i]);
    res_t r = run(args);
    cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
    cr_assert_eq(strncmp(r.out, want, strlen(want)), 0, "%s says: %s", args, r.out);
    res_free(r);
    snprintf(args, sizeof args, "--help %s", cmds[i]);
    r = run(args);
    cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
    cr_assert_eq(strncmp(r.out, want, strlen(want)), 0, "%s says: %s", args, r.out);
    res_free(r);
  }
  /* a name that is no command: the error 'help bogus' and 'bogus' give,
   * with the list of commands */
  static const char *const unknown[] = {"--help bogus", "-h bogus", "help bogus", "bogus"};
  res_t r;
  for (int i = 0; i < 4; i++) {
    r = run(unknown[i]);
    cr_assert_eq(r.status, 2, "%s", unknown[i]);
    cr_assert_eq(strncmp(r.err, "devpickle: unknown command 'bogus'\n\nusage: devpickle <command>", 62), 0, "%s: %s",
                 unknown[i], r.err);
    cr_assert_str_eq(r.out, "");
    res_free(r);
  }
  run_expect("-h pack unpack", 2, NULL, "devpickle -h: unexpected argument 'unpack'\nTry 'devpickle help COMMAND'.\n");
  /* --version has a help, asked for either way round, as a command's is */
  run_expect("--version extra", 2, "",
             "devpickle --version: unexpected argument 'extra'\nTry 'devpickle --version --help'.\n");
  static const char *const version_help[] = {"--version --help", "--version x -h", "--help --version",
                                             "help --version", "-h --version"};
  for (size_t i = 0; i < sizeof version_help / sizeof *version_help; i++) {
    r = run(version_help[i]);
    cr_assert_eq(r.status, 0, "%s: %s", version_help[i], r.err);
    const char *want = "usage: devpickle --version\n\nPrints devpickle's version";
    cr_assert_eq(strncmp(r.out, want, strlen(want)), 0, "%s: %s", version_help[i], r.out);
    cr_assert_str_eq(r.err, "");
    res_free(r);
  }
}

/* '' names no file: a usage error, as -o '' is, not "No such file". */
Test(cli, an_empty_input_name_is_a_usage_error) {
  static const char *const runs[] = {"verify ''", "dump ''", "unpack ''", "inspect ''", "pack '' -o x.dpk",
                                     "verify -- ''", "pack -o x.dpk -- ''"};
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) {
    run_err_has(runs[i], 2, ": an input file name cannot be '' (use - for stdin)\n");
  }
}

/* A negative overflow is told to write "-inf"; a character that would show
 * as nothing (a second byte order mark, a non-breaking space) is named by
 * its code point. */
Test(cli, a_json_error_names_an_invisible_character_by_its_code_point_and_a_negative_overflow_minus_inf) {
  pack_fails("n.json", "n.dpk", "[-1e400]",
             "devpickle: n.json: invalid JSON: real number overflow; write an infinity as {\"$float\": \"-inf\"} "
             "(line 1, column 2), at byte 1\n");
  pack_fails("b.json", "b.dpk", "\xef\xbb\xbf\xef\xbb\xbf[1]",
             "devpickle: b.json: invalid JSON: unexpected U+FEFF (line 1, column 1), at byte 3\n");
  pack_fails("s.json", "s.dpk", "[\xc2\xa0]",
             "devpickle: s.json: invalid JSON: unexpected U+00A0 (line 1, column 2), at byte 1\n");
}

/* Each character a message names by its code point (it would show as
 * nothing or as a space), at both ends of each range, and the characters
 * just outside them, which a message shows as they are. */
static int shown_by_code_point(uint32_t cp) {
  static const uint32_t ranges[][2] = {
      {0x80, 0xA0},       {0xAD, 0xAD},       {0x34F, 0x34F},     {0x61C, 0x61C},     {0x115F, 0x1160},
      {0x1680, 0x1680},   {0x17B4, 0x17B5},   {0x180B, 0x180F},   {0x2000, 0x200F},   {0x2028, 0x202F},
      {0x205F, 0x206F},   {0x2800, 0x2800},   {0x3000, 0x3000},   {0x3164, 0x3164},   {0xFE00, 0xFE0F},
      {0xFEFF, 0xFEFF},   {0xFFA0, 0xFFA0},   {0xFFF0, 0xFFFB},   {0x13430, 0x1343F}, {0x1BCA0, 0x1BCA3},
      {0x1D173, 0x1D17A}, {0xE0000, 0xE0FFF},
  };
  for (size_t i = 0; i < sizeof ranges / sizeof *ranges; i++)
    if (cp >= ranges[i][0] && cp <= ranges[i][1]) return 1;
  return 0;
}

static size_t utf8_put(uint32_t cp, char *o) {
  if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
  if (cp < 0x10000)
    return o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 0x3F)), o[2] = (char)(0x80 | (cp & 0x3F)), 3;
  o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 0x3F));
  o[2] = (char)(0x80 | (cp >> 6 & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

Test(cli, a_json_error_names_each_invisible_character_by_its_code_point_and_its_neighbours_as_they_are) {
  static const uint32_t edges[] = {0xA0,   0xAD,    0x34F,   0x61C,   0x115F,  0x1160,  0x1680,  0x17B4,
                                   0x17B5, 0x180B,  0x180F,  0x2000,  0x200F,  0x2028,  0x202F,  0x205F,
                                   0x206F, 0x2800,  0x3000,  0x3164,  0xFE00,  0xFE0F,  0xFEFF,  0xFFA0,
                                   0xFFF0, 0xFFFB,  0x13430, 0x1343F, 0x1BCA0, 0x1BCA3, 0x1D173, 0x1D17A,
                                   0xE0000, 0xE0FFF};
  for (size_t i = 0; i < sizeof edges / sizeof *edges; i++)
    for (uint32_t cp = edges[i] - 1; cp <= edges[i] + 1; cp++) {
      char text[16] = "[", ch[8] = {0}, msg[256], want[64];
      size_t n = utf8_put(cp, ch), pos;
      snprintf(text + 1, sizeof text - 1, "%s    ]", ch);
      json_t *j = vjson_parse(text, strlen(text), msg, sizeof msg, &pos);
      cr_assert_null(j, "U+%04X was read", (unsigned)cp);
      if (shown_by_code_point(cp)) snprintf(want, sizeof want, "unexpected U+%04X ", (unsigned)cp);
      else snprintf(want, sizeof want, "unexpected '%.*s' ", (int)n, ch);
      cr_assert(strstr(msg, want) != NULL, "U+%04X: %s (want %s)", (unsigned)cp, msg, want);
    }
}

/* --help is looked for as the parser reads the line: the value of -o is a
 * file name, even '--help'; 'help --help' and '-h -h' are the main help. */
Test(cli, help_is_found_as_the_options_are_read_and_the_main_help_answers_its_own_help) {
  spit("v.json", simple_json);
  run_ok("pack v.json -o --help"); /* -o's value, not a request for help */
  res_t r = run("verify -- --help");
  cr_assert_eq(r.status, 0, "a file named --help: %s", r.err);
  cr_assert_eq(strncmp(r.out, "--help: ok, ", 12), 0, "after --, --help is a file name: %s", r.out);
  res_free(r);
  r = run("unpack v.json -o -- --help");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_eq(strncmp(r.out, "usage: devpickle unpack", 23), 0, "%s", r.out);
  res_free(r);
  static const char *const selfs[] = {"help --help", "help -h", "--help --help", "-h -h", "--help help"};
  for (size_t i = 0; i < sizeof selfs / sizeof *selfs; i++) {
    r = run(selfs[i]);
    cr_assert_eq(r.status, 0, "%s: %s", selfs[i], r.err);
    cr_assert_eq(strncmp(r.out, "usage: devpickle <command>", 26), 0, "%s: %s", selfs[i], r.out);
    res_free(r);
  }
  static const struct {
    const char *args, *err;
  } bad[] = {
      {"send '' 127.0.0.1:1", "devpickle send: an input file name cannot be '' (use - for stdin)\n"},
      {"send -- '' 127.0.0.1:1", "devpickle send: an input file name cannot be '' (use - for stdin)\n"},
      {"unpack x.dpk -oa --output=b", "devpickle unpack: --output given twice (-o and --output are one option)\n"},
      {"send x.dpk 127.0.0.1:1 --host=h", "devpickle send: unknown option '--host=h'\n"},
      {"send x.dpk 127.0.0.1:1 --host", "devpickle send: unknown option '--host'\n"},
      {"recv 0 -o", "devpickle recv: -o needs a file name\n"},
      /* an option's name is whole: a longer word is another, unknown option */
      {"pack v.json --outputs x.dpk", "devpickle pack: unknown option '--outputs'\n"},
      {"recv 0 --hosts=h", "devpickle recv: unknown option '--hosts=h'\n"},
      {"recv 0 --timeouts 1", "devpickle recv: unknown option '--timeouts'\n"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    r = run(bad[i].args);
    cr_assert_eq(r.status, 2, "%s: %s", bad[i].args, r.err);
    cr_assert_eq(strncmp(r.err, bad[i].err, strlen(bad[i].err)), 0, "%s: %s", bad[i].args, r.err);
    res_free(r);
  }
}

/* An object's key errors name what came instead, and a comma before '}'
 * is called a trailing comma. */
Test(cli, a_bad_object_key_names_what_came_and_a_trailing_comma_is_called_one) {
  pack_fails("k.json", "k.dpk", "{\"a\":1,\xe2\x80\x8b\"b\":2}",
             "devpickle: k.json: invalid JSON: a key (a string) expected, not U+200B (line 1, column 8), at byte 7\n");
  pack_fails("c.json", "c.dpk", "{\"a\"\xe2\x80\x8b:1}",
             "devpickle: c.json: invalid JSON: ':' expected, not U+200B (line 1, column 5), at byte 4\n");
  pack_fails("t.json", "t.dpk", "{\"a\":1,}",
             "devpickle: t.json: invalid JSON: a key expected after ',', not '}' (a trailing comma) (line 1, column 8), "
             "at byte 7\n");
  pack_fails("x.json", "x.dpk", "{x}",
             "devpickle: x.json: invalid JSON: a key (a string) or '}' expected, not 'x' (line 1, column 2), at byte 1\n");
}

/* What may follow an item is named as what may follow an object's key is:
 * an item without its comma said "unexpected '2'", and an array's trailing
 * comma "unexpected ']'" where an object's is called one. */
Test(cli, an_item_without_its_comma_says_what_may_follow_and_an_arrays_trailing_comma_is_called_one) {
  pack_fails("t.json", "t.dpk", "[1,]",
             "devpickle: t.json: invalid JSON: a value expected after ',', not ']' (a trailing comma) "
             "(line 1, column 4), at byte 3\n");
  pack_fails("w.json", "w.dpk", "[[1, 2,\n  ]]",
             "devpickle: w.json: invalid JSON: a value expected after ',', not ']' (a trailing comma) "
             "(line 2, column 3), at byte 10\n");
  pack_fails("a.json", "a.dpk", "[1 2]",
             "devpickle: a.json: invalid JSON: ',' or ']' expected, not '2' (line 1, column 4), at byte 3\n");
  pack_fails("o.json", "o.dpk", "{\"a\": 1 \"b\": 2}",
             "devpickle: o.json: invalid JSON: ',' or '}' expected, not '\"' (line 1, column 9), at byte 8\n");
  pack_fails("m.json", "m.dpk", "{\"a\": [1}",
             "devpickle: m.json: invalid JSON: ',' or ']' expected, not '}' (line 1, column 9), at byte 8\n");
  /* the streamed reader stops there too, and says the same */
  res_t r = run_sh("{ printf '[1 2'; yes; } | \"$D\" pack - -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: <stdin>: invalid JSON: ',' or ']' expected, not '2' (line 1, column 4), "
                          "at byte 3\n");
  res_free(r);
}

/* Python's json.dumps writes NaN, Infinity and -Infinity by default; pack
 * said "unexpected 'N'" and, for -Infinity, "invalid token". Each is named
 * with the value JSON that spells it, as a real number past the largest
 * double is. */
Test(cli, nan_and_infinity_as_python_writes_them_say_how_value_json_spells_them) {
  pack_fails("n.json", "n.dpk", "[1.5, NaN]",
             "devpickle: n.json: invalid JSON: NaN is no JSON number: write {\"$float\": \"nan\"} (line 1, column 7), "
             "at byte 6\n");
  pack_fails("i.json", "i.dpk", "{\"a\": Infinity}",
             "devpickle: i.json: invalid JSON: Infinity is no JSON number: write {\"$float\": \"inf\"} "
             "(line 1, column 7), at byte 6\n");
  pack_fails("m.json", "m.dpk", "-Infinity",
             "devpickle: m.json: invalid JSON: -Infinity is no JSON number: write {\"$float\": \"-inf\"} "
             "(line 1, column 1), at byte 0\n");
  /* a word that only starts like one is what it was */
  pack_fails("x.json", "x.dpk", "[Nope]", "devpickle: x.json: invalid JSON: unexpected 'N' (line 1, column 2), at byte 1\n");
  pack_fails("c.json", "c.dpk", "[Na", "devpickle: c.json: invalid JSON: unexpected 'N' (line 1, column 2), at byte 1\n");
  /* the streamed reader stops there and says the same */
  res_t r = run_sh("{ printf '[NaN'; yes ,1; } | \"$D\" pack - -o x.dpk");
  cr_assert_eq(r.status, 1);
  cr_assert_str_eq(r.err, "devpickle: <stdin>: invalid JSON: NaN is no JSON number: write {\"$float\": \"nan\"} "
                          "(line 1, column 2), at byte 1\n");
  res_free(r);
}

/* Memory that runs out while the JSON is parsed is no fault of the text:
 * it said "invalid JSON: out of memory (line 1, column N), at byte N". The
 * address space is limited (ulimit -v), which AddressSanitizer's shadow
 * memory cannot start under. */
Test(cli, memory_that_runs_out_while_parsing_is_not_called_invalid_json) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("AddressSanitizer cannot start under ulimit -v");
#endif
  res_t r = run_sh("{ printf '['; yes '[],' | head -n 8000000; printf '[]]'; } > big.json && "
                   "(ulimit -v 400000 && \"$D\" pack big.json -o x.dpk)");
  cr_assert_eq(r.status, 1, "%s", r.err);
  cr_assert_str_eq(r.err, "devpickle: big.json: out of memory parsing the JSON\n");
  res_free(r);
  cr_assert_eq(count_entries(), 1, "a frame or a temporary file was left");
}

/* ---- value JSON as RFC 8259 and docs/VALUE_JSON.md define it ---- */

/* Packs NAME (JSON), unpacks it --compact: the text must be exactly WANT,
 * and packing that text again must give the same frame. */
static void pack_unpack_gives(const char *name, const char *json, const char *want) {
  char script[512];
  spit(name, json);
  snprintf(script, sizeof script,
           "\"$D\" pack %s -o a.dpk && \"$D\" unpack a.dpk --compact > b.json && cat b.json && "
           "\"$D\" pack b.json -o b.dpk && cmp a.dpk b.dpk",
           name);
  res_t r = run_sh(script);
  cr_assert_eq(r.status, 0, "%s: %s", name, r.err);
  cr_assert_str_eq(r.out, want, "%s", name);
  res_free(r);
}

/* VALUE_JSON.md: strides left out are the shape's row-major default, a 0
 * dimension counted as 1 ([2, 0, 3] gets [3, 3, 1], [3, 0] gets [1, 1]);
 * a shape whose default strides overflow 64 bits, empty or not, is an
 * error that says to give them. */
Test(cli, strides_left_out_are_row_major_counting_a_zero_dimension_as_one_and_must_fit) {
  pack_unpack_gives("s.json",
                    "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 6, \"dtype\": \"uint8\", "
                    "\"shape\": [2, 0, 3]}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x20\", \"nbytes\": 6, "
                    "\"dtype\": \"uint8\", \"shape\": [3, 0]}}]",
                    "[{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0x10\",\"nbytes\":6,\"dtype\":\"uint8\",\"shape\":"
                    "[2,0,3],\"strides\":[3,3,1],\"offset\":0}},{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0x20\","
                    "\"nbytes\":6,\"dtype\":\"uint8\",\"shape\":[3,0],\"strides\":[1,1],\"offset\":0}}]\n");
  /* 2^32 * 2^32: empty (a 0 dimension), and the strides still do not fit */
  pack_fails("o.json", "o.dpk",
             "{\"t\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 6, \"dtype\": \"uint8\", "
             "\"shape\": [0, 4294967296, 4294967296]}}}",
             "devpickle: o.json: contiguous strides of this shape overflow int64, at $.t\n");
  /* given, they do */
  pack_unpack_gives("g.json",
                    "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 6, \"dtype\": \"uint8\", "
                    "\"shape\": [0, 4294967296, 4294967296], \"strides\": [0, 0, 0]}}",
                    "{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0x10\",\"nbytes\":6,\"dtype\":\"uint8\",\"shape\":"
                    "[0,4294967296,4294967296],\"strides\":[0,0,0],\"offset\":0}}\n");
}

/* VALUE_JSON.md: a dict's str keys may be empty or hold NUL, and pack reads
 * them as plain dicts all the same; unpack writes a dict as $dict when a
 * key is empty, starts with '$', holds a NUL or is shared (named by $id).
 * Names of classes and attributes may not be empty, as its example says. */
Test(cli, dicts_with_empty_dollar_nul_or_shared_str_keys_unpack_as_dict_tags) {
  pack_unpack_gives("k.json",
                    "[{\"\": 1}, {\"a\\u0000b\": 2}, {\"$dict\": [[\"$x\", 3]]}, {\"$id\": \"k\", \"$value\": \"key\"},"
                    " {\"$dict\": [[{\"$ref\": \"k\"}, 4]]}, {\"plain\": 5}]",
                    "[{\"$dict\":[[\"\",1]]},{\"$dict\":[[\"a\\u0000b\",2]]},{\"$dict\":[[\"$x\",3]]},"
                    "{\"$id\":\"n0\",\"$value\":\"key\"},{\"$dict\":[[{\"$ref\":\"n0\"},4]]},{\"plain\":5}]\n");
  pack_fails("e.json", "e.dpk", "{\"$object\": \"C\", \"attrs\": {\"\": 1}}",
             "devpickle: e.json: attribute name must be non-empty UTF-8 without NUL, at $[\"\"]\n");
  pack_fails("c.json", "c.dpk", "[{\"$object\": \"\"}]",
             "devpickle: c.json: object class name must be non-empty UTF-8 without NUL, at $[0]\n");
}

/* VALUE_JSON.md: a number with a fraction or exponent is the nearest
 * double, so 1e-400 is 0.0 (and -1e-400 is -0.0); past the largest double
 * is refused, saying how to write an infinity. */
Test(cli, a_real_number_below_the_smallest_double_is_zero_of_its_sign) {
  pack_unpack_gives("u.json", "[1e-400, -1e-400, 4.9e-324]", "[0.0,-0.0,4.9406564584124654e-324]\n");
}

/* RFC 4648 pads only the last four characters, with one or two '=':
 * "A===" and "AA==AAAA" are not base64, and reading them would give a
 * second text for the byte 0. */
Test(cli, pack_refuses_base64_padded_with_three_characters_or_anywhere_but_at_the_end) {
  pack_fails("three.json", "x.dpk", "[{\"$bytes\": \"A===\"}]",
             "devpickle: three.json: $bytes must be a canonical base64 string (RFC 4648, padded, unused bits zero), "
             "at $[0]\n");
  pack_fails("mid.json", "x.dpk", "{\"$bytes\": \"AA==AAAA\"}",
             "devpickle: mid.json: $bytes must be a canonical base64 string (RFC 4648, padded, unused bits zero), "
             "at $\n");
  cr_assert_eq(count_entries(), 2, "a frame was written");
}

/* Every block is checked, the last (which may be padded) and the ones
 * before it (read four characters at a time): a character outside the
 * alphabet anywhere, a NUL or a non-ASCII one included, is refused. */
Test(cli, pack_refuses_a_character_outside_base64_in_any_block) {
  const char *bad[] = {"-AAAAAAA", "AAA_AAAA", "AAAA\\u0000AAA", "AAAAAAA\u00e9", "AAAA AAA", "AAAAAA.A"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    char json[64];
    snprintf(json, sizeof json, "[1, {\"$bytes\": \"%s\"}]", bad[i]);
    pack_fails("alpha.json", "x.dpk", json,
               "devpickle: alpha.json: $bytes must be a canonical base64 string (RFC 4648, padded, unused bits zero), "
               "at $[1]\n");
  }
  cr_assert_eq(count_entries(), 1, "a frame was written");
}

/* Bytes of each length modulo 3 end in "==", "=" or no padding. */
Test(cli, unpack_writes_bytes_of_every_length_as_padded_base64_that_packs_back_to_the_same_bytes) {
  pack_unpack_gives("b.json", "[{\"$bytes\": \"AA==\"}, {\"$bytes\": \"AAE=\"}, {\"$bytes\": \"AAEC\"}, {\"$bytes\": \"\"}]",
                    "[{\"$bytes\":\"AA==\"},{\"$bytes\":\"AAE=\"},{\"$bytes\":\"AAEC\"},{\"$bytes\":\"\"}]\n");
}

/* 17 significant digits, ".0" only where the number would read as an int
 * (never after an exponent), and an infinity by its sign. */
Test(cli, unpack_writes_a_float_with_an_exponent_as_a_number_and_each_infinity_by_its_sign) {
  pack_unpack_gives("f.json", "[1e20, -2.5e-10, 1E+2, 3, {\"$float\": \"inf\"}, {\"$float\": \"-inf\"}]",
                    "[1e+20,-2.5000000000000002e-10,100.0,3,{\"$float\":\"inf\"},{\"$float\":\"-inf\"}]\n");
}

/* RFC 8259's whitespace: space, tab, line feed and carriage return. */
Test(cli, pack_reads_tabs_and_crlf_line_ends_as_whitespace) {
  pack_unpack_gives("crlf.json", "{\r\n\t\"a\": [1,\t2],\r\n\t\"b\"\t:\r\n{}\r\n}\r\n", "{\"a\":[1,2],\"b\":{}}\n");
}

/* RFC 8259: a string escapes U+0000 to U+001F; one written raw is refused. */
Test(cli, pack_refuses_a_raw_control_character_in_a_string_up_to_0x1f) {
  pack_fails("c1f.json", "x.dpk", "[\"a\x1f\"]",
             "devpickle: c1f.json: invalid JSON: control character 0x1f in a string (line 1, column 4), at byte 3\n");
  pack_fails("c01.json", "x.dpk", "{\"k\x01\": 1}",
             "devpickle: c01.json: invalid JSON: control character 0x01 in a string (line 1, column 4), at byte 3\n");
}

/* Every escape of RFC 8259 reads as its character (a surrogate pair as the
 * one character it encodes); unpack writes the short escapes back, \u00XX
 * for the other control characters, everything else as it is. */
Test(cli, pack_reads_every_json_escape_and_unpack_writes_the_short_ones_back) {
  pack_unpack_gives("esc.json", "[\"\\\"\\\\\\/\\b\\f\\n\\r\\t \\u0001\\u007f\\u00e9\\u07ff\\u0800\\uffff\\ud83d\\ude00\"]",
                    "[\"\\\"\\\\/\\b\\f\\n\\r\\t \\u0001\\u007f\xc3\xa9\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf\xf0\x9f\x98\x80\"]\n");
  /* and the escapes are the same str as the characters written raw */
  spit("raw.json", "[\"\\\"\\\\/\\b\\f\\n\\r\\t \\u0001\x7f\xc3\xa9\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf\xf0\x9f\x98\x80\"]");
  res_t r = run_sh("\"$D\" pack raw.json -o raw.dpk && cmp a.dpk raw.dpk");
  cr_assert_eq(r.status, 0, "%s%s", r.out, r.err);
  res_free(r);
}

/* A high surrogate escape needs a low one (DC00..DFFF) after it: \ue000 is
 * past them. */
Test(cli, pack_refuses_a_high_surrogate_escape_followed_by_an_escape_past_the_low_surrogates) {
  pack_fails("hi.json", "x.dpk", "[\"\\ud800\\ue000\"]",
             "devpickle: hi.json: invalid JSON: invalid \\u escape: a lone high surrogate (line 1, column 3), "
             "at byte 2\n");
}

/* The surrogate ranges of \u escapes at each of their ends: a pair is
 * one character from U+10000 to U+10FFFF; a high surrogate before a \u
 * that is no low one, and a low one alone, are refused. */
Test(cli, a_surrogate_pair_escape_reads_at_each_end_of_both_ranges_and_a_lone_one_is_refused_at_each_end) {
  static const struct {
    const char *text, *utf8, *err;
  } cases[] = {
      {"\"\\ud7ff\"", "\xed\x9f\xbf", NULL},
      {"\"\\ue000\"", "\xee\x80\x80", NULL},
      {"\"\\ud800\\udc00\"", "\xf0\x90\x80\x80", NULL},
      {"\"\\ud800\\udfff\"", "\xf0\x90\x8f\xbf", NULL},
      {"\"\\udbff\\udc00\"", "\xf4\x8f\xb0\x80", NULL},
      {"\"\\udbff\\udfff\"", "\xf4\x8f\xbf\xbf", NULL},
      {"\"\\ud800\\udbff\"", NULL, "invalid \\u escape: a lone high surrogate (line 1, column 2)"},
      {"\"\\udbff\\ue000\"", NULL, "invalid \\u escape: a lone high surrogate (line 1, column 2)"},
      {"\"\\udc00\"", NULL, "invalid \\u escape: a lone low surrogate (line 1, column 2)"},
      {"\"\\udfff\"", NULL, "invalid \\u escape: a lone low surrogate (line 1, column 2)"},
      /* the text ends two bytes past a high surrogate: no \u, so no pair, whatever follows */
      {"\"\\ud800\\n", NULL, "invalid \\u escape: a lone high surrogate (line 1, column 2)"},
      {"\"\\ud800\\", NULL, "premature end of input in a string (line 1, column 9)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char msg[256] = "";
    size_t pos;
    json_t *j = vjson_parse(cases[i].text, strlen(cases[i].text), msg, sizeof msg, &pos);
    if (cases[i].utf8) {
      cr_assert_not_null(j, "%s: %s", cases[i].text, msg);
      cr_assert_str_eq(json_string_value(j), cases[i].utf8, "%s", cases[i].text);
      vjson_free(j);
    } else {
      cr_assert_null(j, "%s was read", cases[i].text);
      cr_assert_str_eq(msg, cases[i].err, "%s", cases[i].text);
    }
  }
  cr_assert_eq(vjson_prefix_fails("\"\\ud800\\n", 9), 1, "no continuation mends a high surrogate before \\n");
}

/* A \u escape takes the hex digits of either case, each range to its
 * last digit, and refuses the characters just outside them. */
Test(cli, a_u_escape_reads_hex_digits_of_either_case_to_each_ranges_end_and_refuses_their_neighbours) {
  static const struct {
    const char *text, *utf8;
  } ok[] = {
      {"\"\\u0030\\u0039\"", "09"},
      {"\"\\u004a\\u004f\"", "JO"},
      {"\"\\u004A\\u004F\"", "JO"},
      {"\"\\u00fF\\u00Af\"", "\xc3\xbf\xc2\xaf"},
  };
  for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
    char msg[256] = "";
    size_t pos;
    json_t *j = vjson_parse(ok[i].text, strlen(ok[i].text), msg, sizeof msg, &pos);
    cr_assert_not_null(j, "%s: %s", ok[i].text, msg);
    cr_assert_str_eq(json_string_value(j), ok[i].utf8, "%s", ok[i].text);
    vjson_free(j);
  }
  static const char neighbours[] = "/:`g@G";
  for (size_t i = 0; i < sizeof neighbours - 1; i++)
    for (int at = 0; at < 4; at++) {
      char text[16] = "\"\\u0000\"", msg[256] = "";
      size_t pos;
      text[3 + at] = neighbours[i];
      cr_assert_null(vjson_parse(text, strlen(text), msg, sizeof msg, &pos), "%s was read", text);
      cr_assert_str_eq(msg, "invalid \\u escape (line 1, column 2)", "%s", text);
    }
}

/* A named list or tuple is built before its items, as a named object is,
 * so that its items can refer to it: a list holding itself packs, and
 * unpack writes the cycle back. */
Test(cli, a_named_list_or_tuple_can_hold_a_ref_to_itself) {
  spit("l.json", "{\"$id\": \"a\", \"$value\": [1, {\"$ref\": \"a\"}, {\"$tuple\": [{\"$ref\": \"a\"}]}]}");
  run_ok("pack l.json -o l.dpk");
  run_expect("unpack --compact l.dpk", 0, "{\"$id\":\"n0\",\"$value\":[1,{\"$ref\":\"n0\"},{\"$tuple\":[{\"$ref\":\"n0\"}]}]}\n", "");
  spit("t.json", "{\"$id\": \"t\", \"$value\": {\"$tuple\": [1, {\"$ref\": \"t\"}]}}");
  run_ok("pack t.json -o t.dpk");
  run_expect("unpack --compact t.dpk", 0, "{\"$id\":\"n0\",\"$value\":{\"$tuple\":[1,{\"$ref\":\"n0\"}]}}\n", "");
}

/* The text ends where it ends: in a string, after a backslash, or where
 * the byte past it would be the comma of the next item, it ends too soon,
 * reported at its end (and a prefix so cut may yet go on). */
Test(cli, a_text_that_ends_inside_a_string_or_before_the_next_comma_ends_too_soon) {
  static const struct {
    const char *text;
    size_t n;
    const char *err;
  } cases[] = {
      {"\"abc\"", 4, "premature end of input in a string (line 1, column 5)"},
      {"\"abcd\"", 4, "premature end of input in a string (line 1, column 5)"},
      {"\"abc\\n\"", 5, "premature end of input in a string (line 1, column 6)"},
      {"\"\\u0041\"", 7, "premature end of input in a string (line 1, column 8)"},
      {"\"\\ud800\\udc00\"", 13, "premature end of input in a string (line 1, column 14)"},
      {"[[],1]", 3, "premature end of input (line 1, column 4)"},
      {"[[]]", 3, "premature end of input (line 1, column 4)"},
      {"{\"a\": {}}", 8, "premature end of input (line 1, column 9)"},
      {"{\"a\": [],\"b\": 1}", 8, "premature end of input (line 1, column 9)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char msg[256] = "";
    size_t pos = 0;
    cr_assert_null(vjson_parse(cases[i].text, cases[i].n, msg, sizeof msg, &pos), "%.*s was read", (int)cases[i].n,
                   cases[i].text);
    cr_assert_str_eq(msg, cases[i].err, "%.*s", (int)cases[i].n, cases[i].text);
    cr_assert_eq(pos, cases[i].n, "%.*s", (int)cases[i].n, cases[i].text);
    cr_assert_eq(vjson_prefix_fails(cases[i].text, cases[i].n), 0, "%.*s", (int)cases[i].n, cases[i].text);
  }
}

/* An unexpected byte fails a prefix at once when the four bytes that may
 * make up its character are all in; with fewer, what follows may show it
 * otherwise (as the character it starts), so the prefix fails only later. */
Test(cli, a_prefix_fails_at_an_unexpected_byte_once_four_bytes_from_it_are_in) {
  cr_assert_eq(vjson_prefix_fails("[1, xyzw", 8), 1);
  cr_assert_eq(vjson_prefix_fails("[1, xyz", 7), 0);
  cr_assert_eq(vjson_prefix_fails("[1, \xe2\x80\x8b", 7), 0);
  cr_assert_eq(vjson_prefix_fails("[1, \xe2\x80\x8b ", 8), 1);
}

/* RFC 3629: no overlong form, no surrogate, nothing past U+10FFFF. */
Test(cli, pack_refuses_utf8_that_is_overlong_a_surrogate_or_past_u10ffff) {
  static const char *const bad[] = {"[\"\xc0\x80\"]", "[\"\xc1\xbf\"]", "[\"\xed\xa0\x80\"]", "[\"\xed\xbf\xbf\"]",
                                    "[\"\xf4\x90\x80\x80\"]"};
  for (int i = 0; i < 5; i++)
    pack_fails("u.json", "x.dpk", bad[i],
               "devpickle: u.json: invalid JSON: invalid UTF-8 in a string (line 1, column 3), at byte 2\n");
  /* the last of each length is taken */
  pack_unpack_gives("ok.json", "[\"\xc2\x80\xed\x9f\xbf\xee\x80\x80\xf4\x8f\xbf\xbf\"]",
                    "[\"\\u0080\xed\x9f\xbf\xee\x80\x80\xf4\x8f\xbf\xbf\"]\n");
}

/* A hostile frame's str written to a terminal: DEL, C1 (U+009B is CSI to a
 * terminal, U+0085 a new line) and U+2028/U+2029 come out as \uXXXX escapes,
 * which pack reads back to the same bytes; the characters beside them
 * (U+00A0, U+2027, U+202A) stay as they are. They were written raw. */
Test(cli, unpack_escapes_del_c1_and_the_line_separators_and_packs_them_back_to_the_same_bytes) {
  pack_unpack_gives("c1.json", "[\"a\\u009b2J\\u007f\\u0085\\u2028\\u2029\\u009f\\u00a0\\u2027\\u202f\"]",
                    "[\"a\\u009b2J\\u007f\\u0085\\u2028\\u2029\\u009f\xc2\xa0\xe2\x80\xa7\xe2\x80\xaf\"]\n");
  /* a key as well */
  spit("k.json", "{\"$dict\": [[\"\xc2\x9b\", 1]]}");
  res_t r = run_sh("\"$D\" pack k.json -o k.dpk && \"$D\" unpack --compact k.dpk");
  cr_assert_eq(r.status, 0, "%s%s", r.out, r.err);
  cr_assert_str_eq(r.out, "{\"\\u009b\":1}\n");
  res_free(r);
}

/* RFC 8259's number: no leading zero, a digit after '.' and after 'e'.
 * Each says what RFC 8259 wants, where the number starts: "[01]" said
 * "',' or ']' expected, not '1'", "[1.]" and "[1e]" "invalid number", and
 * "[-x]" "invalid token". */
Test(cli, pack_refuses_a_number_with_a_leading_zero_or_without_digits_after_its_point) {
  pack_fails("lz.json", "x.dpk", "[01]",
             "devpickle: lz.json: invalid JSON: invalid number: a leading zero (JSON writes 1, not 01) "
             "(line 1, column 2), at byte 1\n");
  pack_fails("lm.json", "x.dpk", "[-00.5]",
             "devpickle: lm.json: invalid JSON: invalid number: a leading zero (JSON writes 1, not 01) "
             "(line 1, column 2), at byte 1\n");
  pack_fails("pt.json", "x.dpk", "[1.]",
             "devpickle: pt.json: invalid JSON: invalid number: a digit must follow '.' (line 1, column 2), at byte 1\n");
  pack_fails("ex.json", "x.dpk", "[1e]",
             "devpickle: ex.json: invalid JSON: invalid number: a digit must follow the exponent's 'e' "
             "(line 1, column 2), at byte 1\n");
  pack_fails("es.json", "x.dpk", "[1E+x]",
             "devpickle: es.json: invalid JSON: invalid number: a digit must follow the exponent's 'e' "
             "(line 1, column 2), at byte 1\n");
  pack_fails("mx.json", "x.dpk", "[-x]",
             "devpickle: mx.json: invalid JSON: invalid number: a digit must follow '-' (line 1, column 2), at byte 1\n");
  pack_unpack_gives("ok.json", "[0, -0, 0.5, 1e+5, 1e-1, 2E3]", "[0,0,0.5,100000.0,0.10000000000000001,2000.0]\n");
}

/* true, false and null are spelled exactly: "trUe" is no token. */
Test(cli, pack_refuses_a_literal_of_the_right_length_but_the_wrong_letters) {
  pack_fails("t.json", "x.dpk", "[trUe]", "devpickle: t.json: invalid JSON: invalid token (line 1, column 2), at byte 1\n");
  pack_fails("n.json", "x.dpk", "{\"a\": nulL}",
             "devpickle: n.json: invalid JSON: invalid token (line 1, column 7), at byte 6\n");
  pack_fails("f.json", "x.dpk", "[fa1se]", "devpickle: f.json: invalid JSON: invalid token (line 1, column 2), at byte 1\n");
}

/* A number or literal the text ends in before it is whole is input that
 * ends too soon: reported at the end, as an unclosed container is (README),
 * where it was "invalid token" or "invalid number" where the token starts.
 * A literal that is already wrong stays an invalid token where it starts. */
Test(cli, a_number_or_literal_cut_by_the_end_of_the_text_is_reported_at_the_end) {
  pack_fails("t.json", "x.dpk", "[tru",
             "devpickle: t.json: invalid JSON: premature end of input (line 1, column 5), at byte 4\n");
  pack_fails("n.json", "x.dpk", "{\"a\": n",
             "devpickle: n.json: invalid JSON: premature end of input (line 1, column 8), at byte 7\n");
  pack_fails("p.json", "x.dpk", "{\"a\": 1.",
             "devpickle: p.json: invalid JSON: premature end of input in a number (line 1, column 9), at byte 8\n");
  pack_fails("e.json", "x.dpk", "[2e+",
             "devpickle: e.json: invalid JSON: premature end of input in a number (line 1, column 5), at byte 4\n");
  pack_fails("m.json", "x.dpk", "[-",
             "devpickle: m.json: invalid JSON: premature end of input in a number (line 1, column 3), at byte 2\n");
  pack_fails("x.json", "x.dpk", "[trx", "devpickle: x.json: invalid JSON: invalid token (line 1, column 2), at byte 1\n");
}

/* Likewise a string the text ends in the middle of an escape, of a
 * surrogate pair or of a UTF-8 character: "invalid \\u escape", "a lone high
 * surrogate" or "invalid UTF-8" where they start, though more text would
 * have completed them. What no more text could mend keeps its place. */
Test(cli, a_string_cut_in_an_escape_or_a_character_by_the_end_of_the_text_is_reported_at_the_end) {
  static const char *const cut[][2] = {
      {"[\"a\\u00", "(line 1, column 8), at byte 7"},
      {"[\"\\ud800", "(line 1, column 9), at byte 8"},
      {"[\"\\ud800\\udc", "(line 1, column 13), at byte 12"},
      {"[\"\xe2\x82", "(line 1, column 4), at byte 4"},
      {"[\"\xf0\x9f\x98", "(line 1, column 4), at byte 5"},
  };
  for (int i = 0; i < 5; i++) {
    char want[256];
    snprintf(want, sizeof want, "devpickle: s.json: invalid JSON: premature end of input in a string %s\n", cut[i][1]);
    pack_fails("s.json", "x.dpk", cut[i][0], want);
  }
  pack_fails("g.json", "x.dpk", "[\"a\\u0g",
             "devpickle: g.json: invalid JSON: invalid \\u escape (line 1, column 4), at byte 3\n");
  pack_fails("h.json", "x.dpk", "[\"\\ud800x",
             "devpickle: h.json: invalid JSON: invalid \\u escape: a lone high surrogate (line 1, column 3), at byte 2\n");
  pack_fails("u.json", "x.dpk", "[\"\xed\xa0",
             "devpickle: u.json: invalid JSON: invalid UTF-8 in a string (line 1, column 3), at byte 2\n");
}

/* VALUE_JSON.md: a UTF-16 or UTF-32 byte order mark (either byte order) is
 * refused at byte 0; a UTF-8 one is skipped, even when nothing follows it. */
Test(cli, pack_names_a_utf16_or_utf32_byte_order_mark_of_either_byte_order_and_skips_a_lone_utf8_one) {
  static const char *const boms[] = {"\\376\\377", "\\000\\000\\376\\377"};
  for (int i = 0; i < 2; i++) {
    char script[256];
    snprintf(script, sizeof script, "printf '%s[1]' > bom.json; \"$D\" pack bom.json -o x.dpk", boms[i]);
    res_t r = run_sh(script);
    cr_assert_eq(r.status, 1, "%s", r.err);
    cr_assert_str_eq(r.err, "devpickle: bom.json: invalid JSON: a UTF-16 or UTF-32 byte order mark: value JSON is "
                            "UTF-8 (line 1, column 1), at byte 0\n");
    res_free(r);
  }
  pack_fails("only.json", "x.dpk", "\xEF\xBB\xBF",
             "devpickle: only.json: invalid JSON: premature end of input (line 1, column 1), at byte 3\n");
}

/* VALUE_JSON.md: the JSON may nest up to 8,008 levels. 8,008 arrays are
 * read as JSON (and refused as values nested past 2,000); one more is
 * refused as JSON. */
Test(cli, pack_reads_json_nested_8008_levels_and_refuses_8009) {
  char *deep = malloc(2 * 8009 + 1);
  for (int levels = 8008; levels <= 8009; levels++) {
    memset(deep, '[', (size_t)levels);
    memset(deep + levels, ']', (size_t)levels);
    deep[2 * levels] = '\0';
    spit("deep.json", deep);
    res_t r = run("pack deep.json -o d.dpk");
    cr_assert_eq(r.status, 1);
    if (levels == 8008)
      cr_assert_not_null(strstr(r.err, "devpickle: deep.json: containers nested deeper than 2000 levels, at $[0]"),
                         "%s", r.err);
    else
      cr_assert_str_eq(r.err, "devpickle: deep.json: invalid JSON: nesting deeper than 8008 levels (line 1, column "
                              "8009), at byte 8008\n");
    res_free(r);
  }
  free(deep);
}

/* A hex string's digits may be upper case (ptr, $float bits): the same
 * value as in lower case, which unpack writes. */
Test(cli, pack_reads_upper_case_hex_digits_in_a_ptr_and_in_float_bits) {
  static const char *const t =
      "[{\"$float\": \"0x%sf8000000000001\"}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x%s\", \"nbytes\": 1, "
      "\"dtype\": \"int8\", \"shape\": [1]}}]";
  char json[512];
  snprintf(json, sizeof json, t, "7F", "ABCDEF");
  pack_unpack_gives("up.json", json,
                    "[{\"$float\":\"0x7ff8000000000001\"},{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0xabcdef\","
                    "\"nbytes\":1,\"dtype\":\"int8\",\"shape\":[1],\"strides\":[1],\"offset\":0}}]\n");
  snprintf(json, sizeof json, t, "7f", "abcdef");
  spit("low.json", json);
  res_t r = run_sh("\"$D\" pack low.json -o low.dpk && cmp a.dpk low.dpk");
  cr_assert_eq(r.status, 0, "%s%s", r.out, r.err);
  res_free(r);
}

/* VALUE_JSON.md: shape and strides hold at most 16 integers — 16 are taken. */
Test(cli, pack_takes_a_tensor_of_sixteen_dimensions_and_refuses_seventeen) {
  pack_unpack_gives("d16.json",
                    "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", "
                    "\"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2]}}",
                    "{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0x10\",\"nbytes\":2,\"dtype\":\"int8\","
                    "\"shape\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,2],\"strides\":[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1],"
                    "\"offset\":0}}\n");
  pack_fails("d17.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 1, \"dtype\": \"int8\", "
             "\"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}}",
             "devpickle: d17.json: tensor shape must be an array of at most 16 integers, at $\n");
}

/* A negative nbytes is named as such, not as a size past 2^62. */
Test(cli, pack_refuses_a_negative_nbytes_as_not_a_non_negative_integer) {
  pack_fails("neg.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": -1, \"dtype\": \"int8\", \"shape\": [1]}}",
             "devpickle: neg.json: tensor nbytes must be a non-negative integer, at $\n");
}

/* offset is an integer: "1" or 1.0 is refused, never read as 0. */
Test(cli, pack_refuses_a_tensor_offset_that_is_not_an_integer) {
  static const char *const bad[] = {"\"1\"", "1.0", "null"};
  for (int i = 0; i < 3; i++) {
    char json[256];
    snprintf(json, sizeof json,
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 4, \"dtype\": \"int8\", \"shape\": [1],"
             " \"offset\": %s}}", bad[i]);
    pack_fails("off.json", "x.dpk", json, "devpickle: off.json: tensor offset must be an integer, at $\n");
  }
}

/* VALUE_JSON.md: a float by its bits is "0x" and 16 hex digits — no fewer,
 * so that one text is one float. */
/* Sixteen digits exactly: a seventeenth, even a leading zero that keeps
 * the bits in 64, is refused. */
Test(cli, pack_refuses_float_bits_with_more_than_sixteen_hex_digits_even_a_leading_zero) {
  pack_fails("long.json", "x.dpk", "[{\"$float\": \"0x07ff8000000000000\"}]",
             "devpickle: long.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
             "bits, at $[0]\n");
}

Test(cli, pack_refuses_float_bits_with_fewer_than_sixteen_hex_digits) {
  pack_fails("short.json", "x.dpk", "[{\"$float\": \"0x7ff8\"}]",
             "devpickle: short.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
             "bits, at $[0]\n");
  pack_fails("one.json", "x.dpk", "[{\"$float\": \"0x1\"}]",
             "devpickle: one.json: $float must be \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits of IEEE 754 "
             "bits, at $[0]\n");
}

/* VALUE_JSON.md: a tagged object has exactly the keys shown. $tuple, $dict
 * and $reduce with another field, and $object with attrs that are no
 * object, are refused, saying what the tag takes. */
Test(cli, a_tuple_dict_reduce_or_object_tag_with_a_field_it_does_not_take_says_what_it_takes) {
  pack_fails("t.json", "x.dpk", "[{\"$tuple\": [], \"x\": 1}]", "devpickle: t.json: $tuple takes no other fields, at $[0]\n");
  pack_fails("d.json", "x.dpk", "{\"$dict\": [], \"x\": 1}", "devpickle: d.json: $dict takes no other fields, at $\n");
  pack_fails("r.json", "x.dpk", "{\"$reduce\": \"T\", \"state\": 1, \"x\": 2}",
             "devpickle: r.json: $reduce takes one other field, \"state\", at $\n");
  pack_fails("o.json", "x.dpk", "{\"$object\": \"C\", \"attrs\": [1]}",
             "devpickle: o.json: $object takes one other field, \"attrs\", an object, at $\n");
  pack_fails("o.json", "x.dpk", "{\"$object\": \"C\", \"attrs\": {}, \"x\": 1}",
             "devpickle: o.json: $object takes one other field, \"attrs\", an object, at $\n");
  pack_fails("o.json", "x.dpk", "{\"$object\": \"C\", \"x\": 1}",
             "devpickle: o.json: $object takes one other field, \"attrs\", an object, at $\n");
  cr_assert_eq(count_entries(), 4, "a frame was written");
}

/* A $dict item is a pair: three items are refused, never the third ignored. */
Test(cli, pack_refuses_a_dict_item_of_three_values) {
  pack_fails("p.json", "x.dpk", "{\"$dict\": [[1, 2], [3, 4, 5]]}",
             "devpickle: p.json: $dict item 1 is not a [key, value] pair, at $\n");
}

/* Only nodes with identity can be named. */
Test(cli, pack_refuses_an_id_naming_a_scalar) {
  pack_fails("s.json", "x.dpk", "[{\"$id\": \"a\", \"$value\": 1}]",
             "devpickle: s.json: $id names a scalar; only str, bytes, containers and tensors have identity, at $[0]\n");
}

/* vjson.h: vjson_write refuses a value nested deeper than VJSON_MAX_DEPTH
 * (the library's count: an empty container is no level), writing nothing,
 * and writes one at the limit. */
Test(cli, vjson_write_writes_a_value_nested_at_the_limit_and_refuses_one_level_more) {
  for (int levels = 2001; levels <= 2002; levels++) {
    dp_value_t v = nest(levels, 0);
    char *text = NULL, msg[256] = "";
    size_t n = 0;
    FILE *out = open_memstream(&text, &n);
    cr_assert_not_null(out);
    int rc = vjson_write(out, v, 0, msg, sizeof msg);
    cr_assert_eq(fclose(out), 0);
    if (levels == 2001) {
      cr_assert_eq(rc, 0, "%s", msg);
      cr_assert_eq(n, 2 * 2001 + 1);
    } else {
      cr_assert_eq(rc, DP_ELIMIT, "%d: %s", rc, msg);
      cr_assert_str_eq(msg, "containers nested deeper than 2000 levels, too deep for value JSON");
      cr_assert_eq(n, 0, "%zu bytes written", n);
    }
    free(text);
    dp_value_release(v);
  }
}

/* pack stops reading once what came cannot begin JSON, judging it at each
 * 64 KiB read; a character that a read cuts may still show otherwise: the
 * error names the whole character, as when no read cuts it. */
Test(cli, pack_names_an_unexpected_character_cut_by_the_end_of_a_read_as_the_whole_character) {
  char *json = malloc(65540);
  json[0] = '[';
  memset(json + 1, ' ', 65533);
  memcpy(json + 65534, "\xE2\x80\xA6]", 5); /* the 64 KiB read ends inside the U+2026 */
  json[65539] = '\0';
  spit("cut.json", json);
  free(json);
  run_expect("pack cut.json -o x.dpk", 1, NULL,
             "devpickle: cut.json: invalid JSON: unexpected '\xE2\x80\xA6' (line 1, column 65535), at byte 65534\n");
}

/* "Levels deeper than 64 are summarized" (inspect --help): a node 64 levels
 * below the root is shown; a container there has its children summarized in
 * one line, and nothing below it is shown. */
Test(cli, inspect_shows_sixty_four_levels_below_the_root_and_summarizes_the_next) {
  for (int levels = 64; levels <= 65; levels++) {
    char json[256];
    int n = 0;
    for (int i = 0; i < levels; i++) json[n++] = '[';
    json[n++] = '7';
    for (int i = 0; i < levels; i++) json[n++] = ']';
    json[n] = '\0';
    pack_json("d.json", json, "d.dpk");
    res_t r = run("inspect d.dpk");
    cr_assert_eq(r.status, 0, "%s", r.err);
    const char *tail = levels == 64 ? "  list (1 item)\n" : "  list (1 item)\n                                          "
                                                          "(deeper levels not shown)\n";
    size_t len = strlen(r.out), tl = strlen(tail);
    if (levels == 64) {
      cr_assert(len > 8 && strcmp(r.out + len - 8, "  int 7\n") == 0, "%d levels: %s", levels, r.out);
      cr_assert_null(strstr(r.out, "deeper levels"), "%s", r.out);
    } else {
      cr_assert(len > tl && strcmp(r.out + len - tl, tail) == 0, "%d levels: %s", levels, r.out);
      cr_assert_null(strstr(r.out, "int 7"), "a node 65 levels down was shown: %s", r.out);
    }
    res_free(r);
  }
}

/* A shared list first met 64 levels down had a line whose children were cut
 * ("deeper levels not shown"), and its later meeting at the top was "->" that
 * line: its items were shown nowhere. Met again shallower, it is shown in full. */
Test(cli, a_shared_container_whose_children_the_depth_limit_cut_is_shown_in_full_where_met_again_shallower) {
  char json[512];
  int n = snprintf(json, sizeof json, "[");
  for (int i = 0; i < 63; i++) json[n++] = '[';
  n += snprintf(json + n, sizeof json - (size_t)n, "{\"$id\": \"a\", \"$value\": [41, [42]]}");
  for (int i = 0; i < 63; i++) json[n++] = ']';
  snprintf(json + n, sizeof json - (size_t)n, ", {\"$ref\": \"a\"}]");
  pack_json("c.json", json, "c.dpk");
  res_t r = run("inspect c.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "  list (2 items)\n                                          (deeper levels not shown)\n"),
                     "%s", r.out);
  const char *tail = "$[1]                                      list (2 items)\n"
                     "$[1][0]                                   int 41\n"
                     "$[1][1]                                   list (1 item)\n"
                     "$[1][1][0]                                int 42\n";
  size_t len = strlen(r.out), tl = strlen(tail);
  cr_assert(len > tl && strcmp(r.out + len - tl, tail) == 0, "%s", r.out);
  res_free(r);
}

/* inspect shows a float as the 17 significant digits that name its double,
 * not a rounding of it to another double. */
Test(cli, inspect_shows_a_float_with_the_seventeen_digits_that_name_its_double) {
  pack_json("f.json", "[0.30000000000000004, 0.3]", "f.dpk");
  res_t r = run("inspect f.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "$[0]                                      float 0.30000000000000004\n"), "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[1]                                      float 0.29999999999999999\n"), "%s", r.out);
  res_free(r);
}

/* inspect showed every NaN as "nan" (or "-nan"), so that two floats that
 * differ, as dict keys, as unpack writes them and as paths name them, read
 * alike; 100.0 and -0.0 as "100" and "-0". A float reads as value JSON
 * writes it, as in a path. */
/* inspect showed a tensor's shape and offset but not its strides, so that a
 * transpose and the contiguous view of one storage read alike. Strides
 * other than the shape's row-major default are shown. */
/* A tensor field out of range was refused as "tensor dtype out of range",
 * "tensor offset out of range": the reader names the value and the range,
 * as pack does for the same fields in value JSON. */
Test(cli, a_tensor_field_out_of_range_is_named_with_its_value_and_range) {
  /* [tensor, buffer 0, dtype 99, [1], [1], 0] over one cuda:0 buffer of 1 byte */
  uint8_t p[] = {0x96, 0xd4, 0x00, 0x02, 0x00, 0x63, 0x91, 0x01, 0x91, 0x01, 0x00};
  const uint8_t table[] = {0x91, 0x94, 0x01, 0x00, 0x01, 0x10};
  static const struct {
    int at;
    uint8_t byte;
    const char *err;
  } cases[] = {
      {5, 0x63, "tensor dtype 99 out of range (0..14), at byte 45"},
      {4, 0x01, "tensor buffer id 1 out of range (0..0), at byte 44"},
      {10, 0xff, "tensor offset -1 out of range (0..9223372036854775807), at byte 50"},
  };
  for (int i = 0; i < 3; i++) {
    uint8_t q[sizeof p];
    memcpy(q, p, sizeof p);
    if (i > 0) q[5] = 0x05; /* uint8: a valid dtype */
    q[cases[i].at] = cases[i].byte;
    uint8_t frame[64];
    size_t n = 40 + sizeof q + sizeof table;
    memcpy(frame, "DPKL\x01\x00\x00\x00", 8);
    uint64_t lens[4] = {sizeof q, sizeof table, 0, 0};
    memcpy(frame + 8, lens, 32);
    memcpy(frame + 40, q, sizeof q);
    memcpy(frame + 40 + sizeof q, table, sizeof table);
    uint64_t h = XXH3_64bits_withSeed(frame + 40, n - 40, XXH3_64bits(frame, 32));
    memcpy(frame + 32, &h, 8);
    char path[128];
    path_in(path, sizeof path, "t.dpk");
    FILE *f = fopen(path, "wb");
    fwrite(frame, 1, n, f);
    fclose(f);
    res_t r = run("verify t.dpk");
    char want[256];
    snprintf(want, sizeof want, "devpickle: t.dpk: %s\n", cases[i].err);
    cr_assert_eq(r.status, 1, "%s", r.err);
    cr_assert_str_eq(r.err, want);
    res_free(r);
  }
}

Test(cli, inspect_shows_strides_that_are_not_the_shapes_default) {
  pack_json(
      "t.json",
      "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1\", \"nbytes\": 6, \"dtype\": \"uint8\", \"shape\": [2, 3]}},"
      " {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1\", \"nbytes\": 6, \"dtype\": \"uint8\", \"shape\": [2, 3],"
      " \"strides\": [1, 2]}},"
      " {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1\", \"nbytes\": 6, \"dtype\": \"uint8\", \"shape\": [2, 0, "
      "3]}}]",
      "t.dpk");
  res_t r = run("inspect t.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_not_null(strstr(r.out, "$[0]                                      tensor uint8[2, 3] cpu 0x1 (6 bytes) offset 0\n"),
                     "%s", r.out);
  cr_assert_not_null(
      strstr(r.out, "$[1]                                      tensor uint8[2, 3] strides [1, 2] cpu 0x1 (6 bytes) offset 0\n"),
      "%s", r.out);
  cr_assert_not_null(strstr(r.out, "$[2]                                      tensor uint8[2, 0, 3] cpu 0x1 (6 bytes) offset 0\n"),
                     "%s", r.out);
  res_free(r);
}

Test(cli, inspect_shows_distinct_nans_apart_and_a_float_as_value_json_writes_it) {
  pack_json("f.json",
            "[{\"$float\": \"nan\"}, {\"$float\": \"0x7ff8000000000001\"}, {\"$float\": \"0xfff8000000000000\"},"
            " {\"$float\": \"-inf\"}, 100.0, -0.0]",
            "f.dpk");
  res_t r = run("inspect f.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  static const char *const want[] = {"float nan\n", "float 0x7ff8000000000001\n", "float 0xfff8000000000000\n",
                                     "float -inf\n", "float 100.0\n", "float -0.0\n"};
  for (int i = 0; i < 6; i++) {
    char line[128];
    snprintf(line, sizeof line, "$[%d]                                      %s", i, want[i]);
    cr_assert_not_null(strstr(r.out, line), "%s not in %s", line, r.out);
  }
  res_free(r);
}

static int build_many_shared(void) {
  /* 100,000 strs, each in two lists: every one is met again */
  dp_value_t a, b, root;
  if (dp_list_new(0, &a, NULL) != 0 || dp_list_new(0, &b, NULL) != 0 || dp_list_new(0, &root, NULL) != 0) return 1;
  for (int i = 0; i < 100000; i++) {
    dp_value_t s;
    char num[16];
    if (dp_str_new(num, (size_t)snprintf(num, sizeof num, "%d", i), &s, NULL) != 0 ||
        dp_list_append(b, dp_value_retain(s), NULL) != 0 || dp_list_append(a, s, NULL) != 0)
      return 1;
  }
  if (dp_list_append(root, a, NULL) != 0 || dp_list_append(root, b, NULL) != 0) return 1;
  return write_frame_raw("s.dpk", root, 0, NULL);
}

/* inspect's table of the nodes met so far grows as they come: 100,000
 * shared nodes are each found again, in linear time (a full table, or one
 * grown a slot at a time, would never finish). */
Test(cli, inspect_finds_again_every_one_of_many_shared_nodes) {
  build_in_child(build_many_shared);
  res_t r = run_sh("timeout 20 \"$D\" inspect s.dpk > s.txt && grep -c -- '  -> \\$\\[0\\]\\[' s.txt && tail -n 1 s.txt");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_str_eq(r.out, "100000\n$[1][99999]                               -> $[0][99999]\n");
  res_free(r);
}

/* Writes to dir/name an out-of-band frame of a hand-made payload and buffer
 * table (NULL: an empty one), checksummed as docs/FORMAT.md says: what a
 * sender that computes checksums can send, however they break the rules. */
static void spit_frame_with(const char *name, const void *payload, size_t n, const void *table, size_t tn) {
  if (!table) table = "\x90", tn = 1;
  uint8_t *f = calloc(1, 40 + n + tn);
  cr_assert_not_null(f);
  memcpy(f, "DPKL\x01\x00\x00\x00", 8);
  for (int i = 0; i < 8; i++) {
    f[8 + i] = (uint8_t)((uint64_t)n >> (8 * i));   /* payload_len */
    f[16 + i] = (uint8_t)((uint64_t)tn >> (8 * i)); /* table_len */
  }
  memcpy(f + 40, payload, n);
  memcpy(f + 40 + n, table, tn);
  uint64_t sum = XXH3_64bits_withSeed(f + 40, n + tn, XXH3_64bits(f, 32));
  for (int i = 0; i < 8; i++) f[32 + i] = (uint8_t)(sum >> (8 * i));
  char path[256];
  path_in(path, sizeof path, name);
  FILE *out = fopen(path, "wb");
  cr_assert_not_null(out);
  cr_assert_eq(fwrite(f, 1, 40 + n + tn, out), 40 + n + tn);
  cr_assert_eq(fclose(out), 0);
  free(f);
}

static void spit_frame(const char *name, const void *payload, size_t n) { spit_frame_with(name, payload, n, NULL, 0); }

/* Every command that reads a frame refuses file with exit 1 and the one
 * line "devpickle: FILE: message". */
static void every_frame_reader_refuses(const char *file, const char *message) {
  static const char *const verbs[] = {"verify", "unpack", "dump", "inspect"};
  char cmd[256], want[512];
  snprintf(want, sizeof want, "devpickle: %s: %s\n", file, message);
  for (int i = 0; i < 4; i++) {
    snprintf(cmd, sizeof cmd, "%s %s", verbs[i], file);
    run_expect(cmd, 1, NULL, want);
  }
}

/* A stray tag (a dict key that is a bare ext type 0 of one data byte) is
 * named with its one byte in the singular, as every count in a message is. */
Test(cli, a_stray_tag_is_named_as_an_ext_of_one_byte_in_the_singular) {
  static const uint8_t payload[] = {0x81, 0xd4, 0x00, 0x01, 0xc0}; /* {tag 1: None} */
  spit_frame("t.dpk", payload, sizeof payload);
  every_frame_reader_refuses("t.dpk", "unexpected ext type 0 of 1 byte, at byte 41");
}

/* stdin may be a regular file read from past its start (a caller that read
 * a prefix of it first): the bytes after the frame are counted from where
 * the frame started, not from the file's first byte. */
Test(cli, bytes_after_a_frame_on_stdin_are_counted_from_where_stdin_stood) {
  spit("v.json", simple_json);
  res_t r = run_sh("\"$D\" pack v.json -o f.dpk && (head -c 100 /dev/zero; cat f.dpk; head -c 70000 /dev/zero) > p.dpk"
                   " && for c in verify unpack dump inspect; do"
                   " (dd of=/dev/null bs=100 count=1 status=none; \"$D\" $c - >/dev/null) < p.dpk; done");
  cr_assert_eq(r.status, 1, "%s", r.err);
  const char *line = "devpickle: <stdin>: 70000 bytes after the end of the frame, at byte 113\n";
  char want[512];
  snprintf(want, sizeof want, "%s%s%s%s", line, line, line, line);
  cr_assert_str_eq(r.err, want);
  res_free(r);
}

/* A view past its storage is named once as a tensor's: the reader put
 * "tensor: " before a message that starts with "tensor" itself. */
Test(cli, a_view_past_its_storage_is_named_without_a_stutter) {
  /* [tag 2, buffer 0, float32, [5], [1], 0] on a 16-byte cuda:0 buffer */
  static const uint8_t payload[] = {0x96, 0xd4, 0x00, 0x02, 0x00, 0x0b, 0x91, 0x05, 0x91, 0x01, 0x00};
  static const uint8_t table[] = {0x91, 0x94, 0x01, 0x00, 0x10, 0xcd, 0x10, 0x00};
  spit_frame_with("v.dpk", payload, sizeof payload, table, sizeof table);
  every_frame_reader_refuses("v.dpk", "tensor view exceeds its storage of 16 bytes, at byte 40");
}

/* '--' ends demo's options as it ends every command's: demo takes no
 * argument, so '--' alone runs it and what follows is an unexpected
 * argument, an option's spelling too. It was "unknown option '--'". */
Test(cli, demo_takes_a_double_dash_as_the_end_of_its_options) {
  run_out_has("demo --", 0, "demo: all checks passed");
  run_expect("demo -- -x", 2, NULL, "devpickle demo: unexpected argument '-x'\nTry 'devpickle demo --help'.\n");
}

/* '--' ends --version's options as it ends every command's ('demo --' runs
 * the demo): '--version --' said "unexpected argument '--'". */
Test(cli, version_takes_a_double_dash_as_the_end_of_its_options) {
  run_expect("--version --", 0, "devpickle " DP_VERSION_STRING " (frame format version 1)\n", NULL);
  run_expect("--version -- --help", 2, NULL,
             "devpickle --version: unexpected argument '--help'\nTry 'devpickle --version --help'.\n");
}

/* '--' ends help's options too: 'help --' said "unknown command '--'" and
 * 'help pack --' "unexpected argument '--'". */
Test(cli, help_takes_a_double_dash_as_the_end_of_its_options) {
  res_t main_help = run("--help"), pack_help = run("pack --help");
  static const char *const lines[] = {"help --", "help pack --", "help -- pack", "--help -- pack"};
  for (size_t i = 0; i < sizeof lines / sizeof *lines; i++) {
    run_expect(lines[i], 0, i ? pack_help.out : main_help.out, NULL);
  }
  run_expect("help pack -- dump", 2, NULL,
             "devpickle help: unexpected argument 'dump'\nTry 'devpickle help COMMAND'.\n");
  res_free(main_help);
  res_free(pack_help);
}

/* A receiver of our own that answers `send` with `answer` (a str; NULL:
 * the int 7): a fork, listening on 127.0.0.1, its port in *port. */
static pid_t fake_receiver(const char *answer, int *port) {
  ucx_env();
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    alarm(60);
    close(fds[0]);
    setenv("DEVPICKLE_BACKEND", "host", 1);
    dp_transport_t *t;
    dp_listener_t *l;
    dp_endpoint_t *ep;
    dp_future_t *f, *d;
    dp_error_t e;
    if (dp_transport_new(NULL, &t, &e) || dp_listener_new(t, "127.0.0.1:0", &l, &e)) _exit(10);
    int p = dp_listener_port(l);
    if (write(fds[1], &p, sizeof p) != sizeof p) _exit(11);
    if (dp_listener_accept(l, 30ll * 1000000000, &ep, &e) || dp_endpoint_recv_frame(ep, &f, &e) ||
        dp_future_wait(f, 30ll * 1000000000, &e))
      _exit(12);
    dp_value_t v = dp_int(7);
    if (answer && dp_str_new(answer, strlen(answer), &v, &e)) _exit(13);
    if (dp_endpoint_send(ep, v, &d, &e) || dp_future_wait(d, 30ll * 1000000000, &e)) _exit(14);
    dp_value_release(v);
    dp_future_t *bye; /* until the sender closes */
    if (dp_endpoint_recv(ep, &bye, &e) == 0) dp_future_wait(bye, 30ll * 1000000000, NULL), dp_future_release(bye);
    dp_future_release(d);
    dp_future_release(f);
    dp_endpoint_free(ep);
    dp_listener_free(l);
    dp_transport_free(t);
    _exit(0);
  }
  close(fds[1]);
  cr_assert_eq(read(fds[0], port, sizeof *port), (ssize_t)sizeof *port, "the receiver did not start");
  close(fds[0]);
  return pid;
}

/* send prints a receiver's answer after "the receiver ": one in neither
 * known form (an older receiver's) as a refusal, the known ones as they
 * are (TRANSPORT.md, "The CLI"), and exits 1 */
Test(cli, send_prints_an_answer_in_neither_known_form_as_a_refusal_and_the_known_ones_as_they_are) {
  pack_json("v.json", "[1, 2]", "f.dpk");
  static const struct { const char *answer, *says; } cases[] = {
      {"an older receiver's reason", "the receiver refused the frame: an older receiver's reason"},
      {"refused the frame: checksum mismatch", "the receiver refused the frame: checksum mismatch"},
      {"could not write the frame: /x: write failed: No space left on device",
       "the receiver could not write the frame: /x: write failed: No space left on device"}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    int port;
    pid_t pid = fake_receiver(cases[i].answer, &port);
    char args[128], want[512];
    snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 20", port);
    res_t r = run(args);
    snprintf(want, sizeof want, "devpickle: 127.0.0.1:%d: %s\n", port, cases[i].says);
    cr_assert_eq(r.status, 1, "%s", r.err);
    cr_assert_str_eq(r.err, want);
    res_free(r);
    cr_assert_eq(wait_status(pid), 0);
  }
}

/* An answer that is no str and not 0, and one holding a newline: the
 * first is named as no answer devpickle knows, the second cannot forge a
 * line of send's output (one line on stderr) */
Test(cli, send_names_an_unknown_answer_and_never_prints_a_receivers_newline) {
  pack_json("v.json", "[1, 2]", "f.dpk");
  const char *answers[] = {NULL, "bad\ndevpickle: f.dpk: sent 9 bytes"};
  for (int i = 0; i < 2; i++) {
    int port;
    pid_t pid = fake_receiver(answers[i], &port);
    char args[128];
    snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 20", port);
    res_t r = run(args);
    cr_assert_eq(r.status, 1, "%s", r.err);
    cr_assert_str_eq(r.out, "");
    cr_assert_eq(strchr(r.err, '\n'), r.err + strlen(r.err) - 1, "more than one line: %s", r.err);
    if (!answers[i]) cr_assert(strstr(r.err, "the receiver gave no answer devpickle knows"), "%s", r.err);
    res_free(r);
    cr_assert_eq(wait_status(pid), 0);
  }
}

/* recv answers a frame the reader refuses (here: deeper than value JSON's
 * nesting limit, which recv applies as verify does) with "refused the
 * frame: WHY", writes nothing and exits 1 (TRANSPORT.md, "The CLI") */
Test(cli, recv_answers_a_frame_its_reader_refuses_with_the_reason_and_writes_nothing) {
  int port;
  pid_t pid = start_recv("never.dpk", &port);
  setenv("DEVPICKLE_BACKEND", "host", 1);
  dp_value_t v = dp_int(1);
  for (int i = 0; i < 2500; i++) {
    dp_value_t l;
    cr_assert_eq(dp_list_new(1, &l, NULL), 0);
    cr_assert_eq(dp_list_append(l, v, NULL), 0);
    v = l;
  }
  dp_frame_t *fr;
  dp_error_t e;
  cr_assert_eq(dp_frame_new(&fr, &e), 0);
  cr_assert_eq(dp_pickle(v, NULL, fr, &e), 0, "%s", e.message);
  dp_value_release(v);
  size_t n;
  const uint8_t *bytes = dp_frame_data(fr, &n);
  dp_transport_t *t;
  dp_endpoint_t *ep;
  dp_future_t *d, *ans;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  cr_assert_eq(dp_transport_new(NULL, &t, &e), 0, "%s", e.message);
  cr_assert_eq(dp_endpoint_connect(t, addr, &ep, &e), 0, "%s", e.message);
  cr_assert_eq(dp_endpoint_send_frame(ep, bytes, n, &d, &e), 0, "%s", e.message);
  cr_assert_eq(dp_endpoint_recv(ep, &ans, &e), 0, "%s", e.message);
  cr_assert_eq(dp_future_wait(ans, 30ll * 1000000000, &e), 0, "%s", e.message);
  dp_value_t a = dp_future_value(ans);
  cr_assert_eq(dp_value_kind(a), DP_STR);
  const char *why = dp_str_data(a, NULL);
  cr_assert_eq(strncmp(why, "refused the frame: ", 19), 0, "%s", why);
  cr_assert(strstr(why, "depth"), "%s", why);
  dp_future_release(d);
  dp_future_release(ans);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  dp_frame_free(fr);
  cr_assert_eq(wait_status(pid), 1);
  char out[128], *err;
  path_in(out, sizeof out, "never.dpk");
  cr_assert_neq(access(out, F_OK), 0, "a refused frame was written");
  cr_assert_not(tmp_file_in_dir(), "a temporary file was left");
  path_in(out, sizeof out, ".recv");
  err = slurp(out, NULL);
  cr_assert(strstr(err, "depth"), "recv said: %s", err);
  free(err);
}

/* recv on a multicast address: the system would listen there and no
 * sender could ever connect; it says the address is not this machine's,
 * at once, instead of waiting out its --timeout */
Test(cli, recv_on_a_multicast_address_says_it_is_not_this_machines_at_once) {
  ucx_env();
  run_expect("recv 0 --host 224.0.0.1 -o x.dpk --timeout 5", 1, NULL,
             "devpickle: recv: cannot listen on 224.0.0.1: it is not an address "
             "of this machine (a multicast address)\n");
}

/* ---- usage and defaults the helps promise ---- */

/* The main help promises status 2 for a usage error; with no command at
 * all the usage (the text --help prints) is the whole of stderr. */
Test(cli, devpickle_without_a_command_prints_the_main_usage_on_stderr_and_exits_two) {
  res_t help = run("--help");
  cr_assert_eq(help.status, 0);
  cr_assert_eq(strncmp(help.out, "usage: devpickle <command>", 26), 0, "%s", help.out);
  run_err_only("", 2, help.out);
  res_free(help);
}

/* Each command names the operand it lacks, and where its help is. */
Test(cli, every_command_given_no_operand_says_which_one_is_missing_and_exits_two) {
  static const char *const readers[] = {"pack", "unpack", "dump", "inspect", "verify"};
  for (size_t i = 0; i < sizeof readers / sizeof *readers; i++) {
    char want[160];
    snprintf(want, sizeof want, "devpickle %s: missing input file (use - for stdin)\nTry 'devpickle %s --help'.\n",
             readers[i], readers[i]);
    run_err_only(readers[i], 2, want);
  }
  run_err_only("send", 2, "devpickle send: missing FRAME.dpk or HOST:PORT\nTry 'devpickle send --help'.\n");
  run_err_only("send f.dpk", 2, "devpickle send: missing FRAME.dpk or HOST:PORT\nTry 'devpickle send --help'.\n");
  run_err_only("recv", 2, "devpickle recv: missing PORT\nTry 'devpickle recv --help'.\n");
}

/* Every command takes one FILE (send a FRAME.dpk and a HOST:PORT, recv a
 * PORT): an operand more is named, not ignored. */
Test(cli, an_operand_too_many_is_named_as_an_unexpected_argument_by_every_command) {
  static const struct {
    const char *args, *err;
  } runs[] = {
      {"pack a.json b.json -o x.dpk", "devpickle pack: unexpected argument 'b.json'\nTry 'devpickle pack --help'.\n"},
      {"unpack a.dpk b.dpk", "devpickle unpack: unexpected argument 'b.dpk'\nTry 'devpickle unpack --help'.\n"},
      {"dump a.dpk b.dpk", "devpickle dump: unexpected argument 'b.dpk'\nTry 'devpickle dump --help'.\n"},
      {"inspect a.dpk b.dpk", "devpickle inspect: unexpected argument 'b.dpk'\nTry 'devpickle inspect --help'.\n"},
      {"verify a.dpk b.dpk", "devpickle verify: unexpected argument 'b.dpk'\nTry 'devpickle verify --help'.\n"},
      {"send a.dpk 127.0.0.1:1 c", "devpickle send: unexpected argument 'c'\nTry 'devpickle send --help'.\n"},
      {"recv 1 2", "devpickle recv: unexpected argument '2'\nTry 'devpickle recv --help'.\n"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) run_err_only(runs[i].args, 2, runs[i].err);
}

/* "An option's value is the next argument": an option that ends the line
 * has none, and says so by the name it was given. */
Test(cli, an_option_that_ends_the_line_without_its_value_is_a_usage_error_naming_it) {
  static const struct {
    const char *args, *err;
  } runs[] = {
      {"pack v.json -o", "devpickle pack: -o needs a file name\nTry 'devpickle pack --help'.\n"},
      {"pack v.json --output", "devpickle pack: --output needs a file name\nTry 'devpickle pack --help'.\n"},
      {"unpack f.dpk -o", "devpickle unpack: -o needs a file name\nTry 'devpickle unpack --help'.\n"},
      {"recv 0 --output", "devpickle recv: --output needs a file name\nTry 'devpickle recv --help'.\n"},
      {"recv 0 --host", "devpickle recv: --host needs a value\nTry 'devpickle recv --help'.\n"},
      {"recv 0 --timeout", "devpickle recv: --timeout needs a value\nTry 'devpickle recv --help'.\n"},
      {"send f.dpk 127.0.0.1:1 --timeout", "devpickle send: --timeout needs a value\nTry 'devpickle send --help'.\n"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++) run_err_only(runs[i].args, 2, runs[i].err);
}

/* "the system's message for a file that cannot be read": status 1, one
 * line, from every command that reads a file (send before it connects). */
Test(cli, every_reading_command_names_a_missing_input_with_the_systems_message_and_exits_one) {
  static const char *const runs[] = {"pack nofile -o x.dpk", "unpack nofile", "dump nofile", "inspect nofile",
                                     "verify nofile", "send nofile 127.0.0.1:1"};
  for (size_t i = 0; i < sizeof runs / sizeof *runs; i++)
    run_err_only(runs[i], 1, "devpickle: nofile: No such file or directory\n");
  char x[128];
  path_in(x, sizeof x, "x.dpk");
  cr_assert_neq(access(x, F_OK), 0, "pack wrote an output for an input it could not read");
}

/* --timeout: "over 0, at most 1000000". The bound itself is taken (the
 * command goes on to fail for another reason, status 1); one more is a
 * usage error. */
Test(cli, a_timeout_of_one_million_seconds_is_taken_and_one_more_is_refused) {
  ucx_env();
  spit("v.json", "[1]");
  run_ok("pack v.json -o f.dpk");
  int port, fd = t_loopback_socket(0, &port); /* bound, not listening: refused at once */
  char args[128];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 1000000", port);
  res_t r = run(args);
  close(fd);
  cr_assert_eq(r.status, 1, "%s: %s", args, r.err);
  cr_assert_not_null(strstr(r.err, "connection refused"), "%s", r.err);
  res_free(r);
  run_err_only("recv 0 --timeout 1000000 -o nodir/x.dpk", 1, "devpickle: nodir/x.dpk: No such file or directory\n");
  run_err_only("send f.dpk 127.0.0.1:1 --timeout 1000001", 2,
               "devpickle send: bad --timeout '1000001' (SECONDS: a number over 0 and at most 1000000, as 30 or 0.5)\n"
               "Try 'devpickle send --help'.\n");
  run_err_only("recv 0 --timeout 1000001", 2,
               "devpickle recv: bad --timeout '1000001' (SECONDS: a number over 0 and at most 1000000, as 30 or 0.5)\n"
               "Try 'devpickle recv --help'.\n");
}

/* recv's --host is "an IPv4 address or a name": a name is resolved and
 * listened on, and messages show it as given. */
Test(cli, recv_takes_a_host_name_as_well_as_an_address) {
  ucx_env();
  res_t r = run("recv 0 --host localhost --timeout 0.2 -o never.dpk");
  cr_assert_eq(r.status, 1, "%s", r.err);
  int port;
  cr_assert_eq(sscanf(r.err, "devpickle recv: listening on port %d", &port), 1, "%s", r.err);
  char want[192];
  snprintf(want, sizeof want,
           "devpickle recv: listening on port %d\ndevpickle: localhost:%d: recv timed out: no frame within 0.2 s "
           "(--timeout)\n", port, port);
  cr_assert_str_eq(r.err, want);
  res_free(r);
}

/* Without --timeout recv waits ("default: wait") and send allows 60 s: both
 * are still waiting when a far shorter limit (timeout(1)'s 3 s, status
 * 124) ends them, side by side — a default of a second or two, or none,
 * would end them first, even on a loaded machine that spends a second
 * starting them. */
Test(cli, recv_and_send_without_a_timeout_keep_waiting_past_a_short_one) {
  ucx_env();
  spit("v.json", "[1]");
  run_ok("pack v.json -o f.dpk");
  int port, fd = t_loopback_socket(1, &port); /* listening, never answering UCX's handshake */
  char script[256];
  snprintf(script, sizeof script,
           "(timeout 3 \"$D\" recv 0 --host 127.0.0.1 -o never.dpk 2>/dev/null; echo \"recv $?\" > r) & "
           "timeout 3 \"$D\" send f.dpk 127.0.0.1:%d; echo \"send $?\"; wait; cat r",
           port);
  res_t r = run_sh(script);
  close(fd);
  cr_assert_str_eq(r.out, "send 124\nrecv 124\n", "%s", r.err);
  res_free(r);
}

/* recv served only the first connection: a peer that connected and never
 * sent held it until --timeout (forever without one), and the sender behind
 * it timed out unanswered. recv takes the first frame any connection
 * brings; the silent one is closed, unanswered. */
Test(cli, recv_takes_the_first_frame_from_any_connection_past_one_that_never_sends) {
  ucx_env();
  spit("v.json", "[1, 2]");
  run_ok("pack v.json -o f.dpk");
  int port;
  pid_t pid = start_recv("got.dpk", &port);
  dp_transport_opts_t o;
  memset(&o, 0, sizeof o);
  cr_assert_eq(dp_backend_get(DP_DEVICE_HOST, &o.backend, NULL), 0);
  dp_transport_t *t;
  dp_endpoint_t *silent;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  cr_assert_eq(dp_transport_new(&o, &t, NULL), 0);
  cr_assert_eq(dp_endpoint_connect(t, addr, &silent, NULL), 0);
  usleep(500000); /* its connection first: the one recv served alone */
  char args[128];
  snprintf(args, sizeof args, "send f.dpk 127.0.0.1:%d --timeout 10", port);
  run_out_has(args, 0, "f.dpk: sent ");
  cr_assert_eq(wait_status(pid), 0);
  assert_received_whole("f.dpk", "got.dpk");
  dp_error_t e;
  for (int i = 0; i < 1000 && !dp_endpoint_error(silent, NULL); i++) usleep(10000);
  cr_assert_neq(dp_endpoint_error(silent, &e), 0, "the silent connection is still open");
  cr_assert(strstr(e.message, "the peer closed its endpoint"), "%s", e.message);
  dp_endpoint_free(silent);
  dp_transport_free(t);
}

/* recv without -o writes the frame to stdout (here a file, not a
 * terminal), byte for byte. */
Test(cli, recv_without_dash_o_writes_the_frame_it_receives_to_stdout) {
  ucx_env();
  spit("v.json", "{\"a\": [1, 2.5], \"b\": {\"$bytes\": \"AAE=\"}}");
  run_ok("pack v.json -o f.dpk");
  res_t r = run_sh("\"$D\" recv 0 --host 127.0.0.1 --timeout 20 > got.dpk 2> e & "
                   "for i in $(seq 200); do grep -q 'listening' e && break; sleep 0.05; done; "
                   "port=$(sed -n 's/^devpickle recv: listening on port //p' e); "
                   "\"$D\" send f.dpk 127.0.0.1:$port > /dev/null; echo \"send $?\"; wait $!; echo \"recv $?\"; "
                   "cmp f.dpk got.dpk && echo same");
  cr_assert_str_eq(r.out, "send 0\nrecv 0\nsame\n", "%s", r.err);
  res_free(r);
}

/* unpack: "indented two spaces a level; --compact writes it on one line,
 * no space between tokens, a newline at its end". */
Test(cli, unpack_indents_two_spaces_a_level_and_compact_has_no_space_between_tokens) {
  spit("v.json", "{\"a\": [1, 2.5, \"x\"], \"b\": {\"$tuple\": []}}");
  run_ok("pack v.json -o v.dpk");
  run_expect("unpack v.dpk", 0,
             "{\n  \"a\": [\n    1,\n    2.5,\n    \"x\"\n  ],\n  \"b\": {\n    \"$tuple\": []\n  }\n}\n", NULL);
  run_expect("unpack v.dpk --compact", 0, "{\"a\":[1,2.5,\"x\"],\"b\":{\"$tuple\":[]}}\n", NULL);
}

/* demo's help: "DEVPICKLE_BACKEND=host|cuda forces one"; another name is
 * no backend to fall back from, but a failure: status 1, one line saying
 * what it takes. */
Test(cli, demo_refuses_a_backend_it_does_not_know_naming_those_it_takes) {
  setenv("DEVPICKLE_BACKEND", "bogus", 1);
  run_err_only("demo", 1,
               "devpickle: demo: DEVPICKLE_BACKEND='bogus' is no backend: set it to host or cuda, or unset it "
               "(then cuda where a GPU is usable, else host)\n");
  unsetenv("DEVPICKLE_BACKEND");
}

/* A backend asked for that cannot start is named with the variable that
 * asked for it and the other choice; the library's function names
 * ("dp_backend_get(cuda): ") mean nothing to a user of the CLI. */
Test(cli, demo_with_a_backend_that_cannot_start_names_what_was_tried_and_what_to_do) {
  setenv("DEVPICKLE_BACKEND", "cuda", 1);
  res_t r = run("demo");
  unsetenv("DEVPICKLE_BACKEND");
  if (r.status == 0) {
    res_free(r);
    cr_skip_test("a usable GPU: the cuda backend starts");
  }
  cr_assert_eq(r.status, 1, "%s", r.err);
  static const char head[] = "devpickle: demo: the cuda backend (DEVPICKLE_BACKEND=cuda) cannot start: ";
  static const char tail[] = "; DEVPICKLE_BACKEND=host runs the demo on the host executor\n";
  cr_assert_eq(strncmp(r.err, head, strlen(head)), 0, "%s", r.err);
  size_t n = strlen(r.err);
  cr_assert(n > strlen(tail) && strcmp(r.err + n - strlen(tail), tail) == 0, "%s", r.err);
  cr_assert_null(strstr(r.err, "dp_"), "an internal name: %s", r.err);
  cr_assert_eq(strchr(r.err, '\n'), r.err + n - 1, "more than one line: %s", r.err);
  cr_assert_str_eq(r.out, "");
  res_free(r);
}

/* README: DEVPICKLE_HOST_DEVICES sets how many host devices, 1 to 64, and
 * the host backend refuses to start on any other value, naming it. */
Test(cli, demo_runs_on_1_to_64_host_devices_and_names_any_other_count) {
  setenv("DEVPICKLE_BACKEND", "host", 1);
  static const struct {
    const char *count, *first_line;
  } good[] = {{"1", "backend: host (1 device), device host:0\n"}, {"64", "backend: host (64 devices), device host:0\n"}};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    setenv("DEVPICKLE_HOST_DEVICES", good[i].count, 1);
    res_t r = run("demo");
    cr_assert_eq(r.status, 0, "%s: %s", good[i].count, r.err);
    cr_assert_eq(strncmp(r.out, good[i].first_line, strlen(good[i].first_line)), 0, "%s", r.out);
    res_free(r);
  }
  static const char *const bad[] = {"0", "65", "-1", "2x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("DEVPICKLE_HOST_DEVICES", bad[i], 1);
    char want[256];
    snprintf(want, sizeof want,
             "devpickle: demo: the host backend (DEVPICKLE_BACKEND=host) cannot start: "
             "DEVPICKLE_HOST_DEVICES='%s': expected 1..64; DEVPICKLE_BACKEND=cuda runs the demo on the GPU\n",
             bad[i]);
    run_expect("demo", 1, "", want);
  }
  unsetenv("DEVPICKLE_HOST_DEVICES");
  unsetenv("DEVPICKLE_BACKEND");
}

/* "'help', '--help' and '-h' alike: alone ... the main usage", on stdout
 * with status 0 (asked for, it is no usage error). */
Test(cli, help_and_dash_h_alone_print_the_main_usage_on_stdout_as_dash_dash_help_does) {
  res_t help = run("--help");
  cr_assert_eq(help.status, 0);
  cr_assert_eq(strncmp(help.out, "usage: devpickle <command>", 26), 0, "%s", help.out);
  run_expect("help", 0, help.out, "");
  run_expect("-h", 0, help.out, "");
  res_free(help);
}

/* ---- the checks of value JSON's reader, each at its edge ---- */

/* vjson.h: vjson_b64_decode reads the len bytes it is given, no more: a
 * length that is no multiple of four is refused even where the bytes past
 * it would complete the block. */
Test(cli, base64_decoding_refuses_a_length_not_a_multiple_of_four_whatever_bytes_follow_it) {
  static const char text[] = "AAAAAAAA";
  for (size_t len = 5; len < 8; len++) {
    uint8_t *p = NULL;
    size_t n = 0;
    cr_assert_eq(vjson_b64_decode(text, len, &p, &n), -1, "length %zu decoded to %zu bytes", len, n);
  }
  uint8_t *p = NULL;
  size_t n = 0;
  cr_assert_eq(vjson_b64_decode(text, 8, &p, &n), 0);
  cr_assert_eq(n, 6);
  free(p);
}

/* vjson.h: memory for the bytes that cannot be had is -2, not the -1 of a
 * text that is no canonical base64 (the reader then said "not canonical
 * base64" of valid data on a machine out of memory); the text is not read.
 * Under AddressSanitizer, whose malloc aborts instead of failing, skipped. */
Test(cli, base64_decoding_says_apart_that_no_memory_could_be_had_for_the_bytes) {
#if defined(__SANITIZE_ADDRESS__)
  cr_skip_test("AddressSanitizer's malloc aborts on an impossible size instead of returning NULL");
#else
  uint8_t *p = NULL;
  size_t n = 0;
  size_t len = (SIZE_MAX / 4) & ~(size_t)3; /* 3/4 of it: no malloc gives that */
  cr_assert_eq(vjson_b64_decode("", len, &p, &n), -2);
  cr_assert_null(p);
#endif
}

/* vjson.h: vjson_b64_encode writes every length as padded base64, a block
 * of four characters for each three bytes or part of three, and no more
 * (the lengths 0 to 7 meet each end a block can have, twice). */
Test(cli, base64_encoding_writes_each_length_as_padded_blocks_and_nothing_past_the_last) {
  static const char *const want[] = {"", "YQ==", "YWI=", "YWJj", "YWJjZA==", "YWJjZGU=", "YWJjZGVm", "YWJjZGVmZw=="};
  for (size_t n = 0; n < sizeof want / sizeof *want; n++) {
    char *s = vjson_b64_encode((const uint8_t *)"abcdefgh", n);
    cr_assert_not_null(s);
    cr_assert_str_eq(s, want[n], "%zu bytes", n);
    free(s);
  }
}

/* A $tensor whose body is no object says so; it was read as an object
 * without fields, whose missing device named the wrong fault. */
Test(cli, a_tensor_tag_whose_body_is_no_object_says_it_must_be_one) {
  pack_fails("t.json", "x.dpk", "[{\"$tensor\": [\"cpu\"]}]", "devpickle: t.json: $tensor must be an object, at $[0]\n");
}

/* A tensor's data is a base64 string: no other JSON (not even null for an
 * empty storage) reads as no bytes, and base64 that is not canonical is
 * refused, never decoded as something near it. */
Test(cli, tensor_data_that_is_no_string_or_no_canonical_base64_is_refused) {
  static const char *const not_str[] = {"0", "null", "[]"};
  for (int i = 0; i < 3; i++) {
    char json[256];
    snprintf(json, sizeof json,
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 0, \"dtype\": \"int8\", \"shape\": [0],"
             " \"data\": %s}}", not_str[i]);
    pack_fails("ns.json", "x.dpk", json, "devpickle: ns.json: tensor data must be a base64 string, at $\n");
  }
  pack_fails("nc.json", "x.dpk",
             "{\"a\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 1, \"dtype\": \"int8\","
             " \"shape\": [1], \"data\": \"AB==\"}}}",
             "devpickle: nc.json: tensor data is not canonical base64 (RFC 4648, padded, unused bits zero), at $.a\n");
  cr_assert_eq(count_entries(), 2, "a frame was written");
}

/* A $tuple takes an array, $object and $reduce a name: one of another JSON
 * type is named as such, at the tag (a $tuple of 5 packed as an empty
 * tuple). */
Test(cli, a_tuple_object_or_reduce_tag_of_the_wrong_json_type_says_what_it_takes) {
  pack_fails("t.json", "x.dpk", "{\"a\": {\"$tuple\": 5}}", "devpickle: t.json: $tuple must be an array, at $.a\n");
  pack_fails("t2.json", "x.dpk", "[{\"$tuple\": {}}]", "devpickle: t2.json: $tuple must be an array, at $[0]\n");
  pack_fails("o.json", "x.dpk", "{\"a\": {\"$object\": 5, \"attrs\": {}}}",
             "devpickle: o.json: $object must be a class name string, at $.a\n");
  pack_fails("r.json", "x.dpk", "{\"a\": {\"$reduce\": null, \"state\": 1}}",
             "devpickle: r.json: $reduce must be a type name string, at $.a\n");
}

/* The reader grows its storage table past its first 16 entries: a value
 * with many storages, each with its own data, packs and unpacks to the
 * same bytes. */
Test(cli, a_value_with_many_storages_round_trips_each_with_its_own_data) {
  char *json = malloc(64 * 1024), *p = json;
  p += sprintf(p, "[");
  for (int i = 0; i < 200; i++)
    p += sprintf(p, "%s{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x%x\", \"nbytes\": 1, \"dtype\": \"uint8\","
                 " \"shape\": [1], \"data\": \"%s\"}}", i ? ", " : "", 0x1000 + 16 * i, i % 2 ? "AQ==" : "Ag==");
  sprintf(p, "]");
  spit("many.json", json);
  free(json);
  res_t r = run_sh("\"$D\" pack many.json -o a.dpk && \"$D\" unpack a.dpk --compact > b.json && "
                   "\"$D\" pack b.json -o b.dpk && cmp a.dpk b.dpk && \"$D\" verify a.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  cr_assert_str_eq(r.out, "a.dpk: ok, 4190 bytes, version 1, 200 buffers, 0 device pointers, 200 cpu buffers, inline\n");
  res_free(r);
  char *back = slurp_in("b.json", NULL);
  cr_assert_not_null(strstr(back, "\"ptr\":\"0x1c70\",\"nbytes\":1,\"dtype\":\"uint8\",\"shape\":[1],\"strides\":[1],"
                                  "\"offset\":0,\"data\":\"AQ==\"}}]\n"), "%s", back);
  free(back);
}

/* A $tensor tag stands alone; its shape and strides hold integers (a
 * float, even a whole one, or a string is refused, naming the field), and
 * strides, like shape, count at most 16. */
Test(cli, a_tensor_tag_with_another_field_or_a_shape_or_strides_of_non_integers_says_which) {
  pack_fails("x.json", "x.dpk",
             "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 1, \"dtype\": \"int8\", \"shape\": [1]},"
             " \"data\": \"AQ==\"}]",
             "devpickle: x.json: $tensor takes no other fields, at $[0]\n");
  pack_fails("sh.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", \"shape\": [1, 2.0]}}",
             "devpickle: sh.json: tensor shape must hold integers, at $\n");
  pack_fails("st.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", \"shape\": [2],"
             " \"strides\": [\"1\"]}}",
             "devpickle: st.json: tensor strides must hold integers, at $\n");
  pack_fails("sa.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", \"shape\": [2],"
             " \"strides\": 1}}",
             "devpickle: sa.json: tensor strides must be an array of at most 16 integers, at $\n");
  pack_fails("s17.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 1, \"dtype\": \"int8\", "
             "\"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],"
             " \"strides\": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}}",
             "devpickle: s17.json: tensor strides must be an array of at most 16 integers, at $\n");
}

/* An $id names one node: the same name given again, to another node or
 * to an equal one, is refused where it is given the second time. */
Test(cli, an_id_name_given_twice_is_refused_at_its_second_definition) {
  pack_fails("twice.json", "x.dpk", "{\"a\": {\"$id\": \"n\", \"$value\": []}, \"b\": [{\"$id\": \"n\", \"$value\": []}]}",
             "devpickle: twice.json: $id \"n\" is defined twice, at $.b[0]\n");
  pack_fails("str.json", "x.dpk", "[{\"$id\": \"s\", \"$value\": \"x\"}, {\"$id\": \"s\", \"$value\": \"y\"}]",
             "devpickle: str.json: $id \"s\" is defined twice, at $[1]\n");
}

/* Every refusal of the reader gives back what it had built: the value
 * around the fault, a dict key read before its value failed, a named
 * container, the storages of tensors read so far. */
Test(cli, reading_value_json_that_is_refused_leaves_nothing_allocated) {
  static const char *const bad[] = {
      "{\"$id\": \"a\", \"$value\": [1, {\"$ref\": \"zz\"}]}",
      "[[], {\"$id\": \"s\", \"$value\": 1}]",
      "{\"$dict\": [[[1], 2]]}",
      "[{\"$id\": \"t\", \"$value\": {\"$tuple\": [{\"$dict\": [[{\"$ref\": \"t\"}, 1]]}]}}]",
      "{\"$dict\": [[\"k\", 1], [\"k\", 2]]}",
      "{\"$dict\": [[\"k\", {\"$ref\": \"nope\"}]]}",
      "{\"a\": [], \"b\": {\"$ref\": \"nope\"}}",
      "{\"$object\": \"C\", \"attrs\": {\"a\": {\"$ref\": \"x\"}}}",
      "{\"$reduce\": \"T\", \"state\": [{\"$ref\": \"x\"}]}",
      "[\"s\", {\"$bytes\": \"A\"}]",
      "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", \"shape\": [2],"
      " \"data\": \"AAA=\"}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\","
      " \"shape\": [2], \"data\": \"AAE=\"}}]",
      "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", \"shape\": [2]}},"
      " {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, \"dtype\": \"int8\", \"shape\": [3]}}]",
      "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 1, \"dtype\": \"int8\", \"shape\": [1],"
      " \"data\": \"AA==\"}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x20\", \"nbytes\": 1, \"dtype\": \"int8\","
      " \"shape\": [1]}}]",
  };
  t_track();
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    dp_value_t v;
    char msg[512];
    cr_assert_neq(pack_text(bad[i], &v, msg, sizeof msg), 0, "%s was read", bad[i]);
    cr_assert(strstr(msg, ", at $") != NULL, "%s: the failure says where: %s", bad[i], msg);
    ASSERT_NO_LEAK();
  }
  dp_set_allocator(NULL, NULL);
}

/* A str key met once in the value is a plain JSON key even when a caller
 * holds it too (its count of references is then above one): only a key
 * the value itself shares needs $dict, to name it with $id and $ref. */
Test(cli, vjson_write_keeps_a_key_the_caller_also_holds_a_plain_key) {
  dp_value_t d, k, again, l;
  OK(dp_dict_new(0, &d, T_ERR));
  OK(dp_str_new("k", 1, &k, T_ERR));
  OK(dp_dict_set(d, dp_value_retain(k), dp_int(1), T_ERR));
  char msg[256];
  json_t *j = vjson_from_value(d, msg, sizeof msg);
  cr_assert_not_null(j, "%s", msg);
  char *text = json_dumps(j, JSON_COMPACT);
  cr_assert_str_eq(text, "{\"k\":1}");
  free(text);
  json_decref(j);
  /* the same key shared by the value is named */
  OK(dp_dict_new(0, &again, T_ERR));
  OK(dp_dict_set(again, dp_value_retain(k), dp_int(2), T_ERR));
  OK(dp_list_new(2, &l, T_ERR));
  OK(dp_list_append(l, d, T_ERR));
  OK(dp_list_append(l, again, T_ERR));
  dp_value_release(k);
  j = vjson_from_value(l, msg, sizeof msg);
  cr_assert_not_null(j, "%s", msg);
  text = json_dumps(j, JSON_COMPACT);
  cr_assert_str_eq(text, "[{\"$dict\":[[{\"$id\":\"n0\",\"$value\":\"k\"},1]]},{\"$dict\":[[{\"$ref\":\"n0\"},2]]}]");
  free(text);
  json_decref(j);
  dp_value_release(l);
}

/* A dtype that is no string is named as none, not shown as an empty name
 * (`""`, which reads as a dtype given empty). */
Test(cli, a_tensor_dtype_that_is_no_string_is_named_as_not_a_string) {
  pack_fails("t.json", "t.dpk",
             "{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 8, \"dtype\": 32, \"shape\": [8]}}",
             "devpickle: t.json: unknown tensor dtype (not a string) (one of bool, int8, int16, int32, int64, uint8, "
             "uint16, uint32, uint64, float16, bfloat16, float32, float64, complex64, complex128), at $\n");
}

/* nbytes is at most 2^62, the format's largest buffer: one byte more is
 * refused with its value (2^62 itself is taken: a storage that large can be
 * described, never allocated, so a view of it packs). */
Test(cli, a_tensor_nbytes_of_2_62_packs_and_one_more_is_refused) {
  pack_json("max.json",
            "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 4611686018427387904, "
            "\"dtype\": \"uint8\", \"shape\": [1]}}",
            "max.dpk");
  pack_fails("over.json", "x.dpk",
             "{\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x1000\", \"nbytes\": 4611686018427387905, "
             "\"dtype\": \"uint8\", \"shape\": [1]}}",
             "devpickle: over.json: tensor nbytes 4611686018427387905 exceeds 2^62, the largest buffer a frame can "
             "describe, at $\n");
}

/* VALUE_JSON.md: the keys of attrs are attribute names as written, never a
 * tag (an attribute may be named $tuple), and a path writes .name only for
 * an ASCII identifier. */
Test(cli, attrs_keys_are_attribute_names_as_written_and_only_ascii_identifiers_are_dotted) {
  const char *json = "{\"$object\": \"C\", \"attrs\": {\"$tuple\": [1], \"\xc3\xa9\": 2, \"_a1\": 3}}";
  char *text = strdup(json);
  dp_value_t v;
  char msg[512];
  cr_assert_eq(pack_text(text, &v, msg, sizeof msg), 0, "%s", msg);
  dp_value_t a = dp_none();
  OK(dp_object_get(v, "$tuple", &a, T_ERR));
  cr_assert_eq(dp_value_kind(a), DP_LIST, "attrs was read as a tagged object");
  cr_assert_eq(dp_seq_len(a), 1);
  dp_value_release(v);
  free(text);
  pack_json("a.json", json, "a.dpk");
  run_out_has("inspect a.dpk", 0, "$[\"$tuple\"][0] ");
  run_out_has("inspect a.dpk", 0, "$[\"\xc3\xa9\"] ");
  run_out_has("inspect a.dpk", 0, "$._a1 ");
}

/* Whether process pid sits in system call nr on descriptor fd (its
 * /proc/PID/syscall: "NR 0xFD ..."; fd -1: any), as a command waiting on
 * its stdin or stdout does. */
static int blocked_in(pid_t pid, long nr, int fd) {
  char path[64], line[256], want[64];
  snprintf(path, sizeof path, "/proc/%ld/syscall", (long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  int got = fgets(line, sizeof line, f) != NULL;
  fclose(f);
  if (fd < 0) snprintf(want, sizeof want, "%ld ", nr);
  else snprintf(want, sizeof want, "%ld 0x%x ", nr, fd);
  return got && strncmp(line, want, strlen(want)) == 0;
}

/* A command started on a pipe whose end it holds is non-blocking. */
typedef struct nb_child {
  pid_t pid;
  int end;    /* the test's end of the pipe */
  int shared; /* the command's end of a stdin pipe, as the parent holds it too, or -1 */
  int ended;  /* the command ended before it waited on the pipe */
  int status; /* its exit status, once ended */
} nb_child_t;

/* Starts the CLI with args (NULL-terminated) in dir, its descriptor fd an
 * end of a pipe made non-blocking (as a parent's event loop leaves it):
 * the read end when fd is 0, else the write end; the others of stdin,
 * stdout and stderr on /dev/null and files. Returns once it waits on fd in
 * system call nr (read, write), or once it has ended. */
static nb_child_t start_on_a_non_blocking_pipe(const char *const *args, int fd, long nr) {
  char abs[512], out[256], err[256];
  cr_assert_not_null(realpath(cli, abs));
  path_in(out, sizeof out, ".childout");
  path_in(err, sizeof err, ".childerr");
  int p[2], mine = fd == 0 ? 0 : 1;
  cr_assert_eq(pipe(p), 0);
  cr_assert_eq(fcntl(p[mine], F_SETFL, fcntl(p[mine], F_GETFL) | O_NONBLOCK), 0);
  nb_child_t c = {fork(), p[1 - mine], -1, 0, -1};
  cr_assert_neq(c.pid, -1);
  if (c.pid == 0) {
    int in = fd == 0 ? p[0] : open("/dev/null", O_RDONLY);
    int o = fd == 1 ? p[1] : open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int other = fd > 2 ? dup(p[mine]) : -1; /* out of fd's way before the dup2s */
    if (chdir(dir) != 0 || dup2(in, 0) < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0) _exit(126);
    if (fd > 2 && (other < 0 || dup2(other, fd) < 0)) _exit(126);
    close(p[1 - mine]);
    char *argv[16];
    size_t n = 0;
    argv[n++] = abs;
    while (n < 15 && args[n - 1]) {
      argv[n] = (char *)args[n - 1];
      n++;
    }
    argv[n] = NULL;
    execv(abs, argv);
    _exit(127);
  }
  if (fd == 0) c.shared = p[0]; /* a reader's: holding it keeps no EOF away */
  else close(p[mine]);
  int st;
  while (!blocked_in(c.pid, nr, fd > 2 ? -1 : fd)) { /* a named one is written through a descriptor of its own */
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.ended = 1;
      c.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      break;
    }
    usleep(1000);
  }
  return c;
}

/* A stdin, stdout or output descriptor left non-blocking by whoever opened
 * it (O_NONBLOCK is the pipe's open file description's, shared with the
 * parent) failed each read that found the pipe empty and each write that
 * found it full with EAGAIN: `devpickle verify -` ended "<stdin>: read
 * error: Resource temporarily unavailable" before its writer wrote, and
 * `unpack` into a slower reader "<stdout>: write failed: ..." after the
 * first 64 KiB. The commands wait on such a pipe as on any other, and
 * leave the parent's end as it was. */
Test(cli, a_stdin_stdout_or_output_descriptor_left_non_blocking_is_waited_on_as_a_blocking_one) {
  FILE *sc = fopen("/proc/self/syscall", "r");
  cr_assert_not_null(sc, "/proc/PID/syscall tells where a command waits");
  fclose(sc);
  signal(SIGPIPE, SIG_IGN); /* a command that ended early: the write below fails instead */
  size_t cap = 100000 * 8 + 16, n = 0;
  char *text = malloc(cap);
  n += (size_t)snprintf(text + n, cap - n, "[0");
  for (int i = 1; i < 100000; i++) n += (size_t)snprintf(text + n, cap - n, ",%d", i);
  snprintf(text + n, cap - n, "]");
  spit("big.json", text);
  free(text);
  run_ok("pack big.json -o big.dpk");
  run_ok("unpack big.dpk -o big.out.json");
  size_t fn, jn;
  char *frame = slurp_in("big.dpk", &fn), *json = slurp_in("big.out.json", &jn);
  cr_assert_gt(jn, (size_t)1 << 17, "the JSON must be more than a pipe holds");

  /* stdin: the command waits for the frame, which comes once it waits */
  static const char *const verify[] = {"verify", "-", NULL};
  nb_child_t c = start_on_a_non_blocking_pipe(verify, 0, 0 /* read */);
  cr_assert_not(c.ended, "verify ended (status %d) before its frame came: %s", c.status, slurp_in(".childerr", NULL));
  for (size_t at = 0; at < fn;) {
    ssize_t k = write(c.end, frame + at, fn - at);
    cr_assert_gt(k, 0, "the pipe closed: verify gave up");
    at += (size_t)k;
  }
  close(c.end);
  cr_assert_eq(wait_status(c.pid), 0, "%s", slurp_in(".childerr", NULL));
  cr_assert(fcntl(c.shared, F_GETFL) & O_NONBLOCK, "the parent's end was made blocking under it");
  close(c.shared);
  char want[128];
  snprintf(want, sizeof want, "<stdin>: ok, %zu bytes, version 1, 0 buffers", fn);
  char *got = slurp_in(".childout", NULL);
  cr_assert(strncmp(got, want, strlen(want)) == 0, "%s", got);
  free(got);

  /* stdout, and a descriptor named as the output (-o /dev/fd/N, which is
     written as it stands, not replaced): the command waits while the pipe
     is full, and all of it comes */
  static const char *const unpack[] = {"unpack", "big.dpk", NULL};
  static const char *const unpack_fd[] = {"unpack", "big.dpk", "-o", "/dev/fd/5", NULL};
  for (int named = 0; named < 2; named++) {
    int fd = named ? 5 : 1;
    c = start_on_a_non_blocking_pipe(named ? unpack_fd : unpack, fd, 1 /* write */);
    cr_assert_not(c.ended, "unpack to fd %d ended (status %d) with the pipe full: %s", fd, c.status,
                  slurp_in(".childerr", NULL));
    char *back = malloc(jn + 1);
    size_t bn = 0;
    for (ssize_t k; (k = read(c.end, back + bn, jn + 1 - bn)) > 0;) bn += (size_t)k;
    close(c.end);
    cr_assert_eq(wait_status(c.pid), 0, "%s", slurp_in(".childerr", NULL));
    cr_assert_eq(bn, jn, "unpack to fd %d wrote %zu bytes of %zu", fd, bn, jn);
    cr_assert_eq(memcmp(back, json, jn), 0);
    free(back);
  }
  free(frame);
  free(json);
}

/* VALUE_JSON.md, "Round trip": pack then unpack gives back the value, not
 * the text, and each form the frame does not keep comes back in one form
 * (escapes read, numbers as unpack writes them, $id names n0, n1, ... and
 * an unused one dropped, $dict of plain keys as an object, attrs written,
 * a float's bits as its number, every tensor field). */
Test(cli, pack_then_unpack_gives_back_the_value_in_the_forms_value_json_lists) {
  pack_unpack_gives(
      "n.json",
      "{\"b\": 1.50, \"a\": [1E2, \"\\/\\u00e9\", -0, -0.0, {\"$id\": \"zz\", \"$value\": []}, "
      "{\"$id\": \"unused\", \"$value\": []}, {\"$ref\": \"zz\"}, {\"$dict\": [[\"k\", 1]]}, {\"$object\": \"C\"}, "
      "{\"$float\": \"0x3ff0000000000000\"}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 2, "
      "\"dtype\": \"uint8\", \"shape\": [2], \"data\": \"AAE=\"}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": "
      "\"0x10\", \"nbytes\": 2, \"dtype\": \"uint8\", \"shape\": [1], \"offset\": 1, \"data\": \"AAE=\"}}]}",
      "{\"b\":1.5,\"a\":[100.0,\"/\xc3\xa9\",0,-0.0,{\"$id\":\"n0\",\"$value\":[]},[],{\"$ref\":\"n0\"},{\"k\":1},"
      "{\"$object\":\"C\",\"attrs\":{}},1.0,{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0x10\",\"nbytes\":2,"
      "\"dtype\":\"uint8\",\"shape\":[2],\"strides\":[1],\"offset\":0,\"data\":\"AAE=\"}},{\"$tensor\":{\"device\":"
      "\"cpu\",\"ptr\":\"0x10\",\"nbytes\":2,\"dtype\":\"uint8\",\"shape\":[1],\"strides\":[1],\"offset\":1}}]}\n");
}

/* A newcomer's slips at the command: a typo of one ('verfy', 'unpakc',
 * 'inpsect') was answered like any unknown name, with the whole usage and
 * no word of the command meant; and a file named first ('devpickle
 * model.dpk') was called an unknown command without saying that the
 * command comes first. A name no command is near stays as it was. */
Test(cli, an_unknown_command_a_typo_away_from_one_names_it_and_a_file_given_first_says_the_command_comes_first) {
  static const struct {
    const char *typed, *line;
  } cases[] = {
      {"verfy", "devpickle: unknown command 'verfy' (did you mean 'verify'?)\n"},
      {"unpakc", "devpickle: unknown command 'unpakc' (did you mean 'unpack'?)\n"},
      {"inpsect", "devpickle: unknown command 'inpsect' (did you mean 'inspect'?)\n"},
      {"dupm", "devpickle: unknown command 'dupm' (did you mean 'dump'?)\n"},
      {"rcev", "devpickle: unknown command 'rcev' (did you mean 'recv'?)\n"},
      {"ls", "devpickle: unknown command 'ls'\n"},
      {"bogus", "devpickle: unknown command 'bogus'\n"},
      {"f.dpk", "devpickle: unknown command 'f.dpk' (a frame: the command comes first, as in 'devpickle verify "
                "FILE')\n"},
      {"v.json", "devpickle: unknown command 'v.json' (a file: the command comes first, as in 'devpickle pack FILE "
                 "-o FRAME.dpk')\n"},
  };
  pack_json("v.json", "[1]", "f.dpk");
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    res_t r = run(cases[i].typed);
    cr_assert_eq(r.status, 2, "%s", cases[i].typed);
    size_t n = strlen(cases[i].line);
    cr_assert(strncmp(r.err, cases[i].line, n) == 0 && strncmp(r.err + n, "\nusage: devpickle <command>", 27) == 0,
              "%s: %s", cases[i].typed, r.err);
    cr_assert_str_eq(r.out, "");
    res_free(r);
  }
}

/* VALUE_JSON.md, "Round trip": a bidirectional formatting character in a
 * str (U+202E, a right-to-left override) was written as it is, so that
 * the rest of its line — the keys and values after it — displayed
 * reversed in an editor or terminal that honours it: a hostile frame could
 * make its JSON read as another. Each one is written as \\uXXXX (and reads
 * back to the same bytes); its neighbours, which reorder nothing, are not. */
Test(cli, unpack_escapes_bidirectional_formatting_characters_and_packs_them_back_to_the_same_bytes) {
  pack_unpack_gives("bidi.json",
                    "{\"\\u202e\": [\"\\u061c\\u200e\\u200f\\u202a\\u202b\\u202c\\u202d\\u202e\\u2066\\u2067\\u2068\\u2069\", "
                    "\"\\u061b\\u061d\\u200d\\u2010\\u2029\\u202f\\u2065\\u206a\"]}",
                    "{\"\\u202e\":[\"\\u061c\\u200e\\u200f\\u202a\\u202b\\u202c\\u202d\\u202e\\u2066\\u2067\\u2068\\u2069\","
                    "\"\xd8\x9b\xd8\x9d\xe2\x80\x8d\xe2\x80\x90\\u2029\xe2\x80\xaf\xe2\x81\xa5\xe2\x81\xaa\"]}\n");
}

/* Whether signal sig is pending for process pid (its /proc/PID/status:
 * SigPnd for its thread, ShdPnd for the process). */
static int signal_pending(pid_t pid, int sig) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%ld/status", (long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  int pending = 0;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "SigPnd:", 7) == 0 || strncmp(line, "ShdPnd:", 7) == 0)
      pending |= (int)(strtoull(line + 7, NULL, 16) >> (sig - 1) & 1);
  fclose(f);
  return pending;
}

/* A signal whose handler was installed without SA_RESTART — UCX's debug
 * signal, which UCX_DEBUG_SIGNO names and UCX installs as the library
 * loads — interrupted the read of a command waiting on its input: `verify -`
 * ended "<stdin>: read error: Interrupted system call". The read goes on. */
Test(cli, a_signal_handled_without_restart_while_a_command_waits_on_its_input_does_not_fail_the_read) {
  FILE *sc = fopen("/proc/self/syscall", "r");
  cr_assert_not_null(sc, "/proc/PID/syscall tells where a command waits");
  fclose(sc);
  spit("x.json", "[1, 2]");
  run_ok("pack x.json -o x.dpk");
  size_t fn;
  char *frame = slurp_in("x.dpk", &fn);
  char abs[512], err[256];
  signal(SIGPIPE, SIG_IGN); /* a command that ended at the signal: the write below fails instead */
  cr_assert_not_null(realpath(cli, abs));
  path_in(err, sizeof err, ".childerr");
  int p[2];
  cr_assert_eq(pipe(p), 0);
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int o = open("/dev/null", O_WRONLY);
    if (dup2(p[0], 0) < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0) _exit(126);
    close(p[1]);
    setenv("UCX_DEBUG_SIGNO", "10", 1); /* SIGUSR1 */
    execl(abs, abs, "verify", "-", (char *)NULL);
    _exit(127);
  }
  close(p[0]);
  int st;
  while (!blocked_in(pid, 0 /* read */, 0)) {
    cr_assert_neq(waitpid(pid, &st, WNOHANG), pid, "verify ended before its frame came: %s", slurp_in(".childerr", NULL));
    usleep(1000);
  }
  cr_assert_eq(kill(pid, SIGUSR1), 0);
  /* once handled, the read it interrupted is made again: verify waits on its input once more */
  while (signal_pending(pid, SIGUSR1) || !blocked_in(pid, 0, 0)) {
    cr_assert_neq(waitpid(pid, &st, WNOHANG), pid, "verify ended at the signal: %s", slurp_in(".childerr", NULL));
    usleep(1000);
  }
  cr_assert_eq(write(p[1], frame, fn), (ssize_t)fn);
  close(p[1]);
  cr_assert_eq(wait_status(pid), 0, "%s", slurp_in(".childerr", NULL));
  free(frame);
}

/* An overlong form is refused up to the last code point that each shorter
 * form holds, whose lead byte is in range: U+07FF in three bytes (E0 9F BF)
 * and U+FFFF in four (F0 8F BF BF); the first code point of each length
 * (E0 A0 80, F0 90 80 80) is taken. */
Test(cli, pack_refuses_the_overlong_form_of_the_last_code_point_of_each_shorter_length) {
  static const char *const bad[] = {"[\"\xe0\x9f\xbf\"]", "[\"\xf0\x8f\xbf\xbf\"]"};
  for (int i = 0; i < 2; i++)
    pack_fails("u.json", "x.dpk", bad[i],
               "devpickle: u.json: invalid JSON: invalid UTF-8 in a string (line 1, column 3), at byte 2\n");
  pack_unpack_gives("ok.json", "[\"\xe0\xa0\x80\xf0\x90\x80\x80\"]", "[\"\xe0\xa0\x80\xf0\x90\x80\x80\"]\n");
}

/* DEL (0x7F) is a control character: an error names it by its byte, as it
 * names the others, not quoted as a character a terminal shows as nothing;
 * '~' (0x7E) beside it is shown as itself. */
Test(cli, a_json_error_names_a_del_byte_by_its_value_and_the_tilde_before_it_as_itself) {
  pack_fails("d.json", "x.dpk", "[\x7f]",
             "devpickle: d.json: invalid JSON: unexpected byte 0x7F (line 1, column 2), at byte 1\n");
  pack_fails("t.json", "x.dpk", "[~]", "devpickle: t.json: invalid JSON: unexpected '~' (line 1, column 2), at byte 1\n");
}

/* A \u escape cut after three of its hex digits, the longest cut there is,
 * may still be completed: the text ends too soon, reported at its end, not
 * an invalid escape where it starts (also for the low surrogate after a
 * high one). */
Test(cli, a_u_escape_cut_after_three_hex_digits_is_a_premature_end_not_an_invalid_escape) {
  pack_fails("a.json", "x.dpk", "[\"a\\u00e",
             "devpickle: a.json: invalid JSON: premature end of input in a string (line 1, column 9), at byte 8\n");
  pack_fails("b.json", "x.dpk", "[\"\\ud800\\udc0",
             "devpickle: b.json: invalid JSON: premature end of input in a string (line 1, column 14), at byte 13\n");
}

/* A UTF-16 or UTF-32 byte order mark is named whatever follows it, nothing
 * included (a text that is the mark alone), and in little-endian order as
 * in big-endian (FF FE, and FF FE 00 00 for UTF-32). */
Test(cli, pack_names_a_byte_order_mark_of_utf16_or_utf32_alone_and_in_little_endian_order) {
  static const char *const boms[] = {"\\376\\377", "\\000\\000\\376\\377", "\\377\\376[1]", "\\377\\376\\000\\000[1]"};
  for (int i = 0; i < 4; i++) {
    char script[256];
    snprintf(script, sizeof script, "printf '%s' > bom.json; \"$D\" pack bom.json -o x.dpk", boms[i]);
    res_t r = run_sh(script);
    cr_assert_eq(r.status, 1, "%s: %s", boms[i], r.err);
    cr_assert_str_eq(r.err, "devpickle: bom.json: invalid JSON: a UTF-16 or UTF-32 byte order mark: value JSON is "
                            "UTF-8 (line 1, column 1), at byte 0\n", "%s", boms[i]);
    res_free(r);
  }
}

/* Bytes and tensors have identity: an $id names them and a $ref shares
 * them, as unpack writes them back (an $id of bytes was read as a plain
 * dict whose key "$bytes" is an unknown tag). */
Test(cli, an_id_names_bytes_and_a_tensor_that_a_ref_then_shares) {
  pack_unpack_gives("b.json", "[{\"$id\": \"b\", \"$value\": {\"$bytes\": \"AAE=\"}}, {\"$ref\": \"b\"}]",
                    "[{\"$id\":\"n0\",\"$value\":{\"$bytes\":\"AAE=\"}},{\"$ref\":\"n0\"}]\n");
  pack_unpack_gives("t.json",
                    "[{\"$id\": \"t\", \"$value\": {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x10\", \"nbytes\": 4,"
                    " \"dtype\": \"uint8\", \"shape\": [4]}}}, {\"$ref\": \"t\"}]",
                    "[{\"$id\":\"n0\",\"$value\":{\"$tensor\":{\"device\":\"cpu\",\"ptr\":\"0x10\",\"nbytes\":4,"
                    "\"dtype\":\"uint8\",\"shape\":[4],\"strides\":[1],\"offset\":0}}},{\"$ref\":\"n0\"}]\n");
}

/* A key that is "$" alone starts with '$' too: a plain object refuses it
 * as an unknown tag, and $dict takes it. */
Test(cli, a_key_that_is_a_lone_dollar_needs_dict_as_every_key_starting_with_one) {
  pack_fails("d.json", "x.dpk", "{\"$\": 1}",
             "devpickle: d.json: unknown tag \"$\" (a plain key starting with '$' needs $dict), at $\n");
  pack_unpack_gives("ok.json", "{\"$dict\": [[\"$\", 1]]}", "{\"$dict\":[[\"$\",1]]}\n");
}

/* Where several storages of an inline value lack "data", pack names the
 * first of them in document order, at its first tensor. */
Test(cli, of_several_storages_without_data_pack_names_the_first_in_the_document) {
  pack_fails("two.json", "two.dpk",
             "[{\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x1000\", \"nbytes\": 1, \"dtype\": \"uint8\", "
             "\"shape\": [1], \"data\": \"AA==\"}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": \"0x2000\", "
             "\"nbytes\": 1, \"dtype\": \"uint8\", \"shape\": [1]}}, {\"$tensor\": {\"device\": \"cpu\", \"ptr\": "
             "\"0x3000\", \"nbytes\": 1, \"dtype\": \"uint8\", \"shape\": [1]}}]",
             "devpickle: two.json: no tensor on cpu 0x2000 carries \"data\", but tensors on 1 other "
             "storage do: an inline frame needs each storage's data (on one of its tensors), at $[1]\n");
}

/* inspect shows a class name of 64 bytes whole and one of 65 cut to its
 * first 64, followed by the ellipsis, as paths show names. */
Test(cli, inspect_shows_a_class_name_of_64_bytes_whole_and_cuts_one_of_65_with_an_ellipsis) {
  char c64[65], c65[66], json[256], want[256];
  memset(c64, 'C', 64);
  c64[64] = '\0';
  memset(c65, 'C', 65);
  c65[65] = '\0';
  snprintf(json, sizeof json, "[{\"$object\": \"%s\"}, {\"$object\": \"%s\"}]", c64, c65);
  pack_json("c.json", json, "c.dpk");
  res_t r = run("inspect c.dpk");
  cr_assert_eq(r.status, 0, "%s", r.err);
  snprintf(want, sizeof want, "$[0]                                      object %s (0 attributes)\n", c64);
  cr_assert_not_null(strstr(r.out, want), "%s", r.out);
  snprintf(want, sizeof want, "$[1]                                      object %s\xe2\x80\xa6 (0 attributes)\n", c64);
  cr_assert_not_null(strstr(r.out, want), "%s", r.out);
  res_free(r);
}
