/* tools/devpickle.c — the devpickle command-line tool (the library's public
 * API only; of UCX, only its log level, set before send and recv start). */
#define _XOPEN_SOURCE 700  /* lstat, readlink */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <ucs/config/global_opts.h>
#include <ucs/debug/debug.h>

#include "cli.h"
#include "demo.h"
#include "inspect.h"
#include "vjson.h"

static const char *const usage_main =
    "usage: devpickle <command> [options] [FILE]\n"
    "\n"
    "Finds the device allocations a value references, and packs values into\n"
    "checksummed frames whose device buffers travel out-of-band.\n"
    "\n"
    "commands:\n"
    "  pack VALUE.json -o FRAME.dpk   value JSON to a frame\n"
    "  unpack FRAME.dpk [-o V.json]   a frame to value JSON (on stdout; --compact: one line)\n"
    "  dump FRAME.dpk [--json]        the allocations a frame's value holds, cpu too\n"
    "  inspect FRAME.dpk              the value as a tree, one node a line, with paths\n"
    "  verify FRAME.dpk               check a frame completely; print a summary\n"
    "  send FRAME.dpk HOST:PORT       send a self-contained frame to 'devpickle recv'\n"
    "                                 (--timeout SECONDS: for the whole exchange, default 60)\n"
    "  recv PORT [-o FRAME.dpk]       receive one frame, verify it, write it\n"
    "                                 (--host HOST, default 0.0.0.0; --timeout SECONDS)\n"
    "  demo                           the future pipeline end to end, every byte checked\n"
    "\n"
    "FILE may be '-' for stdin (and -o - for stdout), named <stdin> and <stdout>\n"
    "in messages; after '--' every argument is a file name, one starting with\n"
    "'-' too (devpickle verify -- -x.dpk), but '-' alone is still stdin (./- is\n"
    "a file named -). An option's value is the next argument or attached\n"
    "(-o F, -oF, --output F, --output=F, --host=H, --timeout=0.5). -o (or --output),\n"
    "--host or --timeout given twice, or given '', is a usage error, as is\n"
    "--json or --compact given twice, or an input named ''.\n"
    "A frame on stdin is read up to its end as its header gives it and at most\n"
    "64 KiB past it (more is an error, so an endless pipe behind a frame never\n"
    "holds a command), and not past a header that is no frame's (nor past its\n"
    "first bytes when they are no frame's magic); a terminal is refused.\n"
    "Run 'devpickle <command> --help' (or 'devpickle help <command>', 'devpickle\n"
    "--help <command>') for a command's options (--help answers wherever it\n"
    "comes among them, before '--');\n"
    "'devpickle --version' prints the version.\n"
    "\n"
    "exit status: 0 ok; 1 bad data or a runtime failure (one line on stderr:\n"
    "'devpickle: FILE: what, at byte N' for a frame or for text that is not JSON,\n"
    "'at $.path' for JSON that is not a value); 2 usage error.\n"
    "\n"
    "examples (in the source tree):\n"
    "  devpickle pack examples/model.json -o model.dpk\n"
    "  devpickle dump model.dpk\n"
    "  devpickle unpack model.dpk | devpickle pack - -o copy.dpk\n"
    "  cmp model.dpk copy.dpk\n"
    "Value JSON: docs/VALUE_JSON.md. Frame format: docs/FORMAT.md.\n";

typedef struct cmd {
  const char *name;
  int (*run)(int argc, char **argv);
} cmd_t;

static int usage_error(const char *cmd, const char *fmt, const char *arg) {
  char what[512];
  snprintf(what, sizeof what, fmt, arg);
  fprintf(stderr, "devpickle %s: ", cmd);
  cli_put_text(stderr, what);
  fprintf(stderr, "\nTry 'devpickle %s --help'.\n", cmd);
  return EXIT_USAGE;
}

/* An argument that starts with '-' and is no option: when a file of that
 * name exists, say how to name it where it stands. ("devpickle pack --
 * -x.json" was shown, a line that fails as typed: it lacks -o, and send's
 * its HOST:PORT; ./-x.json names the file wherever the argument was.) */
static int unknown_option(const char *cmd, const char *arg) {
  if (access(arg, F_OK) != 0) return usage_error(cmd, "unknown option '%s'", arg);
  char what[512];
  snprintf(what, sizeof what, "unknown option '%.200s' (the file is ./%.200s, or after '--')", arg, arg);
  return usage_error(cmd, "%s", what);
}

/* Whether s is the option named shrt or lng, and its value when given in
 * the same argument: --output=FILE, -oFILE (*val: NULL when the value is
 * the next argument). shrt may be NULL. */
static int is_opt(const char *s, const char *shrt, const char *lng, const char **val) {
  size_t n = strlen(lng);
  *val = NULL;
  if ((shrt && strcmp(s, shrt) == 0) || strcmp(s, lng) == 0) return 1;
  if (strncmp(s, lng, n) == 0 && s[n] == '=') return *val = s + n + 1, 1;
  if (shrt && strncmp(s, shrt, 2) == 0 && s[2]) return *val = s + 2, 1;
  return 0;
}

/* The option's name as typed, without an attached value: "--output" for
 * --output=FILE, "-o" for -oFILE (val: is_opt's). */
static const char *opt_name(const char *s, const char *val, const char *shrt, const char *lng) {
  return !val ? s : s[1] == '-' ? lng : shrt;
}

/* An option's value: the one given in its argument, else the next
 * argument (*i moves past it); NULL when there is none. */
static const char *opt_value(const char *val, int argc, char **argv, int *i) {
  if (val) return val;
  return ++*i < argc ? argv[*i] : NULL;
}

/* Whether --help (or -h) comes among a command's options (before "--"),
 * wherever: it answers, whatever else the line holds. An option named in
 * with_value (NULL-terminated) takes the next argument as its value, as
 * the parser does: `-o --help` names a file, `-o -- --help` asks for help. */
static int wants_help(int argc, char **argv, const char *const *with_value) {
  for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return 1;
    for (const char *const *w = with_value; *w; w++)
      if (strcmp(argv[i], *w) == 0) {
        i++;
        break;
      }
  }
  return 0;
}

/* The last error line, less its "devpickle: " (recv passes it on). */
static char last_error[1400];

/* One line on stderr: devpickle: FILE: what[, at byte N] */
static int data_error(const char *file, const char *what, int64_t offset) {
  /* a long name is cut at a character, and the cut is marked */
  size_t fn = strlen(file), fk = dp__name_shown(file, fn, 256);
  int k = snprintf(last_error, sizeof last_error, "%.*s%s: %.1100s", (int)fk, file, fk < fn ? "…" : "", what);
  if (offset >= 0 && k >= 0 && (size_t)k < sizeof last_error)
    snprintf(last_error + k, sizeof last_error - (size_t)k, ", at byte %lld", (long long)offset);
  fputs("devpickle: ", stderr);
  cli_put_text(stderr, file);
  fputs(": ", stderr);
  cli_put_text(stderr, what);
  if (offset >= 0) fprintf(stderr, ", at byte %lld", (long long)offset);
  fputc('\n', stderr);
  return EXIT_DATA;
}

static const char *display(const char *path) { return strcmp(path, "-") == 0 ? "<stdin>" : path; }

/* Doubles a read buffer's capacity; out of memory, frees it (*buf NULL). */
/* fread that goes on after a signal whose handler was installed without
 * SA_RESTART (UCX's debug signal, UCX_DEBUG_SIGNO): the read it interrupted
 * is no error of the input's. Short only at the end of the input or on a
 * real error (ferror set). */
static size_t fread_all(void *dst, size_t n, FILE *f) {
  size_t got = 0;
  for (;;) {
    got += fread((char *)dst + got, 1, n - got, f);
    if (got == n || !ferror(f) || errno != EINTR) return got;
    clearerr(f);
  }
}

static void grow_or_drop(uint8_t **buf, size_t *cap) {
  uint8_t *nb = realloc(*buf, *cap * 2);
  if (!nb) free(*buf);
  else *cap *= 2;
  *buf = nb;
}

static int names_held_fd(const char *path);
static int input_names_write_only_fd(const char *path);

/* Reads value JSON from a file (or stdin) to its end, or up to where what
 * came already fails to parse whatever follows: checked each time the
 * buffer fills (64 KiB, then each doubling, so the checks cost at most two
 * parses), so that /dev/zero, an endless pipe or a huge file of garbage is
 * refused once its first bad byte is in, not read to the memory's end. The
 * parse of the bytes read then reports that byte as the whole text would. */
static int read_json(const char *path, uint8_t **out, size_t *n) {
  if (names_held_fd(path)) return data_error(display(path), strerror(EBADF), -1);
  int rc = input_names_write_only_fd(path);
  if (rc) return rc;
  FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
  if (!f) return data_error(display(path), strerror(errno), -1);
  size_t cap = 1 << 16, len = 0;
  uint8_t *buf = malloc(cap);
  for (;;) {
    if (!buf) break;
    size_t got = fread_all(buf + len, cap - len, f);
    len += got;
    if (len < cap || vjson_prefix_fails((const char *)buf, len)) break;
    grow_or_drop(&buf, &cap);
  }
  int err = ferror(f), why = errno; /* fread's reason (a directory: EISDIR) */
  if (f != stdin) fclose(f);
  if (!buf) return data_error(display(path), "out of memory reading the file", -1);
  if (err) {
    free(buf);
    char msg[128];
    snprintf(msg, sizeof msg, "read error: %s", strerror(why));
    return data_error(display(path), msg, -1);
  }
  *out = buf;
  *n = len;
  return 0;
}

/* Where a command's output goes. A regular file (or a new one) is written
 * as a temporary file beside it, flushed to disk and renamed over it only
 * when complete: a failure half-way leaves the old file as it was (even when
 * it is the input, `pack v.json -o v.json`). A symbolic link (or a chain of
 * them, relative or absolute, dangling or not) keeps pointing where it did:
 * the file it ends at is the one written. stdout and other files (a device,
 * a pipe) are written in place, and so is a name of one of this process's
 * open descriptors (/dev/stdout, /dev/fd/N, /proc/self/fd/N): its
 * descriptor is written as the shell opened it (a pipe, a file opened for
 * appending, a file the shell is writing into). */
typedef struct sink {
  FILE *f;
  const char *path;   /* as the user named it */
  char *tmp;          /* the temporary file, or NULL */
  char *target;       /* the name path's links end at (path itself when none) */
} sink_t;

static const char *out_display(const char *path) { return strcmp(path, "-") == 0 ? "<stdout>" : path; }

#define MAX_LINKS 40  /* as the kernel's own limit (ELOOP) */

/* N when name is a name of this process's descriptor N: an entry N (digits,
 * no leading zero) of a directory that is this process's fd directory
 * however it is spelled (/dev/fd, /proc/self/fd, /proc/thread-self/fd,
 * //dev/./fd, a relative path to one of them), else -1. */
static int fd_name(const char *name) {
  const char *slash = strrchr(name, '/'), *d = slash ? slash + 1 : name;
  long v = 0;
  if (!*d || (d[0] == '0' && d[1])) return -1;
  for (; *d >= '0' && *d <= '9' && v <= INT_MAX / 10; d++) v = v * 10 + (*d - '0');
  if (*d || v > INT_MAX) return -1;
  char *dir = slash ? strndup(name, slash == name ? 1 : (size_t)(slash - name)) : strdup(".");
  char *real = dir ? realpath(dir, NULL) : NULL;
  free(dir);
  if (!real) return -1;
  char fd_dir[48], task[48];
  snprintf(fd_dir, sizeof fd_dir, "/proc/%ld/fd", (long)getpid());
  snprintf(task, sizeof task, "/proc/%ld/task/", (long)getpid());
  size_t n = strlen(real), tn = strlen(task);
  int ours = strcmp(real, fd_dir) == 0 ||
             (strncmp(real, task, tn) == 0 && n > tn + 3 && strcmp(real + n - 3, "/fd") == 0 &&
              strspn(real + tn, "0123456789") == n - tn - 3);
  free(real);
  return ours ? (int)v : -1;
}

/* The name that path ends at once its symbolic links are followed; that
 * name may not exist yet. A new string, or NULL with errno. *fd: -1, or the
 * descriptor whose name the chain reached (then NULL is returned, errno 0). */
static char *follow_links(const char *path, int *fd) {
  char *cur = strdup(path);
  *fd = -1;
  for (int hops = 0; cur; hops++) {
    struct stat st;
    if ((*fd = fd_name(cur)) >= 0) { /* a magic link: not to be followed by name */
      free(cur);
      errno = 0;
      return NULL;
    }
    if (lstat(cur, &st) != 0 || !S_ISLNK(st.st_mode)) return cur;  /* not a link: the name itself */
    if (hops == MAX_LINKS) {
      free(cur);
      errno = ELOOP;
      return NULL;
    }
    size_t cap = st.st_size > 0 ? (size_t)st.st_size + 1 : 256;
    char *link = NULL;
    ssize_t k;
    for (;;) {  /* a link may change size between lstat and readlink */
      char *nl = realloc(link, cap);
      if (!nl) {
        free(link);
        free(cur);
        errno = ENOMEM;
        return NULL;
      }
      link = nl;
      k = readlink(cur, link, cap);
      if (k < 0 || (size_t)k < cap) break;
      cap *= 2;
    }
    if (k < 0) {
      int e = errno;
      free(link);
      free(cur);
      errno = e;
      return NULL;
    }
    link[k] = '\0';
    const char *slash = strrchr(cur, '/');
    size_t dirlen = link[0] == '/' || !slash ? 0 : (size_t)(slash - cur) + 1;  /* a relative link: from its directory */
    char *next = malloc(dirlen + (size_t)k + 1);
    if (next) {
      memcpy(next, cur, dirlen);
      memcpy(next + dirlen, link, (size_t)k + 1);
    }
    free(link);
    free(cur);
    cur = next;
    if (!cur) errno = ENOMEM;
  }
  return NULL;
}

/* The descriptors among 0, 1 and 2 that the caller left closed and
 * hold_std_fds holds (bit N: descriptor N). */
static unsigned held_std;

/* Whether path names (through links) a descriptor that the caller left
 * closed: /dev/stdin with stdin closed is no file, though /dev/null now
 * holds its place. */
static int fd_held(int fd) { return fd >= 0 && fd <= 2 && (held_std >> fd & 1u); }

static int names_held_fd(const char *path) {
  if (!held_std || strcmp(path, "-") == 0) return 0;
  int fd;
  free(follow_links(path, &fd));
  return fd_held(fd);
}

/* An input that names (through links) one of this process's descriptors
 * open for writing only: 0, or the exit status after the message. Opened
 * by that name it is read from the other end: `verify /dev/stdout | cat`
 * read the pipe this command itself holds open for writing, so its end
 * never came and the command waited forever. Refused as an output open
 * for reading only is. */
static int input_names_write_only_fd(const char *path) {
  if (strcmp(path, "-") == 0) return 0;
  int fd, fl;
  free(follow_links(path, &fd));
  if (fd < 0 || fd_held(fd) || (fl = fcntl(fd, F_GETFL)) < 0 || (fl & O_ACCMODE) != O_WRONLY) return 0;
  char what[96];
  snprintf(what, sizeof what, "descriptor %d is open for writing only, so it cannot be the input", fd);
  return data_error(path, what, -1);
}

/* A pipe or a terminal that whoever opened it left non-blocking (a
 * parent's event loop, a program that ran before on the same terminal)
 * failed every read that found it empty, and every write that found it
 * full, with EAGAIN: `devpickle verify -` fed by a writer slower than the
 * reader, or `unpack` into a slower reader, ended "Resource temporarily
 * unavailable" half-way. O_NONBLOCK belongs to the open file description,
 * which the parent shares: cleared there, the parent's own reads would
 * block. So such a descriptor fd is opened again through /proc/self/fd/N,
 * as a description of this process's own, made blocking once open
 * (opened blocking, a FIFO whose other end has gone would wait forever).
 * Returns that new descriptor, or -1 where fd is to be used as it is: a
 * blocking one, a regular file (which O_NONBLOCK does not concern, and
 * whose offset a new description would not share), a device other than a
 * terminal, a socket (which cannot be opened so), or a FIFO without its
 * reader (ENXIO: a write fails as it would have). */
static int blocking_twin(int fd) {
  struct stat st;
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || !(fl & O_NONBLOCK) || fstat(fd, &st) != 0 || !(S_ISFIFO(st.st_mode) || isatty(fd)))
    return -1; /* not another device: opened again, a tape drive's would rewind when this one closes */
  char name[32];
  snprintf(name, sizeof name, "/proc/self/fd/%d", fd);
  int d = open(name, (fl & (O_ACCMODE | O_APPEND)) | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (d < 0) return -1;
  int dl = fcntl(d, F_GETFL);
  if (dl < 0 || fcntl(d, F_SETFL, dl & ~O_NONBLOCK) != 0) {
    close(d);
    return -1;
  }
  return d;
}

/* The temporary file: a short fixed name in the target's directory, so that
 * it fits NAME_MAX whatever the target's own name is. */
#define TMP_NAME ".devpickle-XXXXXX"

/* The temporary file being written, for a signal that ends the command
 * (Ctrl-C, kill, a hang-up) to remove: an interrupted `unpack -o` of a large
 * frame would otherwise leave gigabytes under a hidden name. One output at a
 * time; set once the name is complete, cleared before it is freed. */
static char *volatile tmp_pending;

static void on_fatal_signal(int sig) {
  char *t = tmp_pending;
  if (t) unlink(t); /* async-signal-safe */
  signal(sig, SIG_DFL);
  raise(sig);
}

/* The signals a user or a terminal sends to end a command; a hang-up is
 * taken back from libucs for them (untake_fatal_signals). */
static const int fatal_sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

/* Every signal whose default action ends the process that a command may
 * meet while it writes: fatal_sigs, and those a limit, a timer or another
 * process sends (a CPU-time limit's SIGXCPU, timeout -s, kill -USR1, a
 * profiler's timers, SIGPIPE sent by kill). Handling only fatal_sigs left
 * the temporary file of `ulimit -t` or `kill -USR1` behind. Not SIGXFSZ:
 * ignored, a file-size limit is a failed write (main). */
static const int ending_sigs[] = {SIGINT,  SIGTERM,   SIGHUP,  SIGQUIT, SIGALRM, SIGUSR1,
                                  SIGUSR2, SIGVTALRM, SIGPROF, SIGXCPU, SIGPIPE};

/* Called with ending_sigs blocked: a signal between the temporary file's
 * creation and this call (the handler not yet there, or the name not yet
 * published) would have left the file. */
static void watch_tmp(char *tmp) {
  static int installed;
  if (!installed) {
    const int *sigs = ending_sigs;
    for (size_t i = 0; i < sizeof ending_sigs / sizeof ending_sigs[0]; i++) {
      struct sigaction sa, old;
      memset(&sa, 0, sizeof sa);
      sa.sa_handler = on_fatal_signal;
      sigemptyset(&sa.sa_mask);
      /* only a signal that would end the command: one the caller ignores
       * (nohup, a shell's background job, recv's SIGPIPE) stays ignored, and
       * one a library handles (UCX's debug or async signal) stays its */
      if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_DFL) sigaction(sigs[i], &sa, NULL);
    }
    installed = 1;
  }
  tmp_pending = tmp;
}

/* An output that exists and is no regular file (a FIFO, a device, a socket)
 * is opened before the input is read, and before recv listens, as a shell's
 * '>' would: a FIFO's reader then sees its end when the command fails
 * instead of waiting for a writer that never comes, no sender's frame waits
 * on the open, and one that cannot be opened is refused at once. sink_open
 * takes it up. */
static FILE *early_f;
static const char *early_path;

static int sink_open(sink_t *s, const char *path) {
  memset(s, 0, sizeof *s);
  s->path = path;
  if (early_f && early_path == path) { /* opened before the input was read */
    s->f = early_f;
    early_f = NULL;
    return 0;
  }
  struct stat st;
  if (strcmp(path, "-") == 0) {
    s->f = stdout;
    return 0;
  }
  int fd = -1;
  char *target = follow_links(path, &fd);
  if (fd >= 0) { /* this process's descriptor: written as it is (at its offset, as >&N would) */
    if (fd_held(fd)) return data_error(path, strerror(EBADF), -1);
    struct stat fst;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fstat(fd, &fst) != 0) return data_error(path, strerror(errno), -1);
    if (S_ISDIR(fst.st_mode)) return data_error(path, strerror(EISDIR), -1);
    if ((fl & O_ACCMODE) == O_RDONLY) {
      char what[64];
      snprintf(what, sizeof what, "descriptor %d is open for reading only", fd);
      return data_error(path, what, -1);
    }
    int d = blocking_twin(fd); /* a pipe left non-blocking: waited on as the shell's '>&N' would be */
    if (d < 0) d = dup(fd);
    s->f = d >= 0 ? fdopen(d, "wb") : NULL;
    if (!s->f && d >= 0) close(d);
    return s->f ? 0 : data_error(path, strerror(errno), -1);
  }
  if (!target) return data_error(path, strerror(errno), -1);
  int exists = stat(target, &st) == 0;
  if (!exists && errno != ENOENT) { /* the rename would fail too, after all the work */
    int e = errno;
    free(target);
    return data_error(path, strerror(e), -1);
  }
  if (exists && !S_ISREG(st.st_mode)) {
    free(target);
    s->f = fopen(path, "wb");
    return s->f ? 0 : data_error(path, strerror(errno), -1);
  }
  s->target = target;
  const char *slash = strrchr(target, '/');
  size_t dirlen = slash ? (size_t)(slash - target) + 1 : 0;
  s->tmp = malloc(dirlen + sizeof TMP_NAME);
  if (!s->tmp) {
    free(target);
    s->target = NULL;
    return data_error(path, "out of memory", -1);
  }
  memcpy(s->tmp, target, dirlen);
  memcpy(s->tmp + dirlen, TMP_NAME, sizeof TMP_NAME);
  sigset_t fatal, was;
  sigemptyset(&fatal);
  for (size_t i = 0; i < sizeof ending_sigs / sizeof ending_sigs[0]; i++) sigaddset(&fatal, ending_sigs[i]);
  pthread_sigmask(SIG_BLOCK, &fatal, &was); /* made and watched at once: one arriving meanwhile waits */
  fd = mkstemp(s->tmp);
  if (fd >= 0) watch_tmp(s->tmp);
  pthread_sigmask(SIG_SETMASK, &was, NULL);
  if (fd < 0) {
    int e = errno;
    free(s->tmp);
    free(s->target);
    s->tmp = s->target = NULL;
    return data_error(path, strerror(e), -1);
  }
  mode_t mask = umask(0);
  umask(mask);
  mode_t mode = exists ? st.st_mode & 07777 : 0666 & ~mask;  /* an existing file keeps its mode */
  /* and its owner and group, where the system lets this process give them
   * (root; a group of the caller's own), as `sed -i` does: `sudo devpickle
   * pack ... -o ~/f.dpk` left a user's file owned by root, and read-only to
   * that user under the mode it kept. Before fchmod, which a chown can
   * undo (set-user-ID bits). */
  if (exists && fchown(fd, st.st_uid, st.st_gid) != 0 && fchown(fd, (uid_t)-1, st.st_gid) != 0) {
    /* not ours to give: the file is the caller's, as any file it makes */
  }
  if (fchmod(fd, mode) != 0 || !(s->f = fdopen(fd, "wb"))) {
    int e = errno;
    close(fd);
    unlink(s->tmp);
    tmp_pending = NULL;
    free(s->tmp);
    free(s->target);
    s->tmp = s->target = NULL;
    return data_error(path, strerror(e), -1);
  }
  return 0;
}

/* Finishes the output: on success (ok) flushes, syncs and renames; on any
 * failure removes the temporary file. Returns 0 or the exit status. */
static int sink_close(sink_t *s, int ok) {
  int e = 0;
  if (fflush(s->f) != 0 || ferror(s->f)) e = errno ? errno : EIO;
  if (s->tmp && !e && ok && fsync(fileno(s->f)) != 0) e = errno;
  if (s->f != stdout && fclose(s->f) != 0 && !e) e = errno;
  if (s->tmp) {
    if (!e && ok && rename(s->tmp, s->target ? s->target : s->path) != 0) e = errno;
    if (e || !ok) unlink(s->tmp);
    tmp_pending = NULL;
    free(s->tmp);
  }
  free(s->target);
  if (!ok) return EXIT_DATA;  /* the caller has said why */
  if (!e) return 0;
  char what[160];
  snprintf(what, sizeof what, "write failed: %s", strerror(e));
  return data_error(out_display(s->path), what, -1);
}

/* What sink_open would refuse at once, asked before a wait (recv listens,
 * maybe for hours, before it writes): a directory, a name the system
 * refuses (too long, ...), or a file whose
 * directory is missing, no directory or not writable. 0, or the exit status
 * after the message sink_open would give. A device, a pipe or a descriptor
 * is opened as it is (sink_open_early, before the input is read or recv
 * listens). */
static int sink_probe(const char *path) {
  if (strcmp(path, "-") == 0) return 0;
  int fd = -1, e = 0;
  char *target = follow_links(path, &fd);
  if (fd >= 0) return 0;
  if (!target) return data_error(path, strerror(errno), -1);
  struct stat st;
  int found = stat(target, &st) == 0;
  if (!found && errno != ENOENT) e = errno; /* a name too long, a component no directory, ... */
  else if (found && S_ISDIR(st.st_mode)) e = EISDIR;
  else if (!found || S_ISREG(st.st_mode)) { /* made or replaced beside it */
    const char *slash = strrchr(target, '/');
    char *dir = slash ? strndup(target, slash == target ? 1 : (size_t)(slash - target)) : strdup(".");
    struct stat ds;
    if (!dir) e = ENOMEM;
    else if (stat(dir, &ds) != 0) e = errno;
    else if (!S_ISDIR(ds.st_mode)) e = ENOTDIR;
    else if (access(dir, W_OK | X_OK) != 0) e = errno;
    free(dir);
  }
  free(target);
  return e ? data_error(path, strerror(e), -1) : 0;
}

static int64_t mono_ns(void);

/* Opens path early when it is such an output. A FIFO's open waits for its
 * reader; with a deadline (mono_ns; -1: none) no longer: *ran_out, and
 * ETIMEDOUT. 0 (opened, or left to sink_open: a regular file, a new one, a
 * descriptor already open), or -1 with errno. */
static int sink_open_early(const char *path, int64_t deadline, int *ran_out) {
  *ran_out = 0;
  if (strcmp(path, "-") == 0) return 0;
  int fd = -1;
  char *target = follow_links(path, &fd);
  if (fd >= 0) return 0;
  if (!target) return -1;
  struct stat st;
  int special = stat(target, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
  int fifo = special && S_ISFIFO(st.st_mode);
  free(target);
  if (!special) return 0;
  FILE *f = NULL;
  if (!fifo || deadline < 0) {
    f = fopen(path, "wb");
  } else {
    for (;;) { /* O_NONBLOCK: ENXIO while no process has the FIFO open for reading */
      fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd >= 0 || errno != ENXIO) break;
      if (mono_ns() >= deadline) {
        *ran_out = 1;
        errno = ETIMEDOUT;
        return -1;
      }
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
    }
    int fl = fd >= 0 ? fcntl(fd, F_GETFL) : -1;
    if (fl >= 0 && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == 0) f = fdopen(fd, "wb");
    if (!f && fd >= 0) {
      int e = errno;
      close(fd);
      errno = e;
    }
  }
  if (!f) return -1;
  early_f = f;
  early_path = path;
  return 0;
}

static int write_all(const char *path, const void *p, size_t n) {
  sink_t s;
  int rc = sink_open(&s, path);
  if (rc) return rc;
  fwrite(p, 1, n, s.f);  /* a short write sets the stream's error, which sink_close reports */
  return sink_close(&s, 1);
}

/* Every command ends here when it printed to stdout: a failed write (a full
 * disk, /dev/full) is an error, never a silent exit 0. */
static int stdout_done(int rc) {
  if ((fflush(stdout) != 0 || ferror(stdout)) && rc == 0) {
    char what[160];
    snprintf(what, sizeof what, "write failed: %s", strerror(errno ? errno : EIO));
    return data_error("<stdout>", what, -1);
  }
  return rc;
}

/* Parses "--help" / flags shared by the commands. */
typedef struct args {
  const char *file;
  const char *out;
  int flag;  /* the command's own flag was given (dump --json, unpack --compact) */
  int help;
} args_t;

static int parse_args(const char *cmd, const char *help, int argc, char **argv, args_t *a, int allow_o, int need_o,
                      const char *flag) {
  memset(a, 0, sizeof *a);
  static const char *const with_o[] = {"-o", "--output", NULL};
  if (wants_help(argc, argv, allow_o ? with_o : with_o + 2)) {
    fputs(help, stdout);
    a->help = 1;
    return stdout_done(0) ? EXIT_DATA : -1;
  }
  int opts = 1; /* until "--": after it every argument is a file name, "-f" too */
  const char *val;
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (opts && strcmp(s, "--") == 0) {
      opts = 0;
    } else if (!opts) {
      if (a->file) return usage_error(cmd, "unexpected argument '%s'", s);
      if (!s[0]) return usage_error(cmd, "%s", "an input file name cannot be '' (use - for stdin)");
      a->file = s;
    } else if (allow_o && is_opt(s, "-o", "--output", &val)) {
      const char *name = opt_name(s, val, "-o", "--output");
      if (!(val = opt_value(val, argc, argv, &i))) return usage_error(cmd, "%s needs a file name", name);
      if (a->out) return usage_error(cmd, "%s given twice (-o and --output are one option)", name);
      if (!val[0]) return usage_error(cmd, "%s needs a file name, not ''", name);
      a->out = val;
    } else if (flag && strcmp(s, flag) == 0) {
      if (a->flag) return usage_error(cmd, "%s given twice", flag);
      a->flag = 1;
    } else if (s[0] == '-' && s[1] != '\0') {
      return unknown_option(cmd, s);
    } else if (a->file) {
      return usage_error(cmd, "unexpected argument '%s'", s);
    } else if (!s[0]) {
      return usage_error(cmd, "%s", "an input file name cannot be '' (use - for stdin)");
    } else {
      a->file = s;
    }
  }
  if (!a->file) return usage_error(cmd, "%s", "missing input file (use - for stdin)");
  if (need_o && !a->out) return usage_error(cmd, "%s", "missing -o FRAME.dpk (use -o - for stdout)");
  if (!a->out) a->out = "-";
  return 0;
}

/* The frames the CLI reads are read under value JSON's nesting limit, so
 * that whatever verify accepts, unpack can write and pack read back. */
static dp_unpickle_opts_t cli_unpickle_opts(void) {
  dp_unpickle_opts_t o;
  memset(&o, 0, sizeof o);
  o.limits.max_depth = VJSON_MAX_DEPTH;
  return o;
}

/* The common start of the commands that read a frame: their arguments, the
 * file, its header facts and its value. `whole` reads the frame into memory
 * (unpack needs the inline bytes); otherwise it streams, and the data
 * section of an inline frame is checked without being kept. Returns 0, the
 * exit status, or -1 after --help. */
typedef struct loaded {
  args_t a;
  dp_value_t v;
  dp_frame_info_t info;
  size_t size;
} loaded_t;

/* A frame read from a file or a pipe. Its header gives its length; the
 * stream is read up to that end and at most TRAIL_MAX bytes past it, to say
 * that nothing follows (or how much does): an endless pipe behind a frame is
 * refused once that much has come ("more than 65536 bytes after the end of
 * the frame"), never read to its end. */
#define FRAME_HEADER 40 /* docs/FORMAT.md, "Layout" */
#define TRAIL_MAX 65536

typedef struct src {
  FILE *f;
  uint64_t total;            /* bytes handed out */
  uint64_t limit;            /* the frame's end plus TRAIL_MAX (UINT64_MAX until the header says) */
  uint64_t end;              /* the frame's end, once known */
  uint64_t start;            /* the file's offset where the frame starts (stdin need not be at 0) */
  uint8_t hdr[FRAME_HEADER];
  size_t hdr_len;
  int over;                  /* more than TRAIL_MAX bytes followed the frame */
  int refused;               /* the header is one the library refuses from its own bytes (not a frame's
                                magic, or more than 2^64 bytes announced): nothing more need be read */
  int no_magic;              /* its first bytes are no frame's magic: the stream ends there for the reader */
  int bad_header;            /* its 40 bytes are no frame's header (a version, flags): herr says why */
  dp_error_t herr;
} src_t;

static uint64_t le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* The frame's end once its header is in: 40 + payload + table + data,
 * saturating. A header the library refuses by itself (bad magic, more than
 * 2^64 bytes announced) ends the reading: the stream behind it — /dev/zero,
 * an endless pipe — is never read to its end (or to the memory's). */
static void src_header(src_t *s) {
  if (memcmp(s->hdr, "DPKL", 4) != 0) {
    s->refused = 1;
    return;
  }
  uint64_t end = FRAME_HEADER, len[3] = {le64(s->hdr + 8), le64(s->hdr + 16), le64(s->hdr + 24)};
  for (int i = 0; i < 3; i++) {
    if (len[i] > UINT64_MAX - end) s->refused = 1;
    end = len[i] > UINT64_MAX - end ? UINT64_MAX : end + len[i];
  }
  s->end = end;
  s->limit = end > UINT64_MAX - TRAIL_MAX ? UINT64_MAX : end + TRAIL_MAX;
  /* a version or flags no frame has: the reader refuses them only once the
     body it announces is in, and a pipe that stays open behind the header
     held the command until it closed, then read "truncated frame" */
  dp_error_clear(&s->herr);
  if (!s->refused && dp_frame_prefix_check(s->hdr, FRAME_HEADER, &s->herr) != 0) s->bad_header = 1;
}

/* Whether the first n bytes of a stream already tell it is no frame: they
 * differ from the magic and hold a character that is no blank nor part of a
 * UTF-8 byte order mark (frame_error's hint on value JSON looks no further).
 * A pipe that stays open behind "hello" was waited on for its 40th byte. */
static int no_magic(const uint8_t *h, size_t n) {
  if (memcmp(h, "DPKL", n < 4 ? n : 4) == 0) return 0;
  size_t i = 0;
  if (memcmp(h, "\xef\xbb\xbf", n < 3 ? n : 3) == 0) {
    if (n < 3) return 0;
    i = 3;
  }
  while (i < n && (h[i] == ' ' || h[i] == '\t' || h[i] == '\n' || h[i] == '\r')) i++;
  return i < n;
}

static int src_read(void *ud, void *dst, size_t n, size_t *got, dp_error_t *err) {
  src_t *s = ud;
  *got = 0;
  if (s->no_magic) return 0; /* the reader refuses what it has: waiting on would only hold the command */
  /* Until the magic and the version are in, or what came is known to be
   * no frame, a byte at a time: fread waits for all it is asked, and
   * 'hello' (or a frame of another version) and an open pipe behind it
   * would hold the command until 40 bytes came. */
  if (s->hdr_len < FRAME_HEADER && (s->hdr_len < 6 || memcmp(s->hdr, "DPKL", 4) != 0) && n > 1) n = 1;
  if (s->total >= s->limit) { /* the frame and TRAIL_MAX bytes are in: one more byte says it all */
    int c = fgetc(s->f);
    if (c != EOF) {
      s->over = 1;
      /* a regular file's size says how many follow, without reading them */
      struct stat st;
      if (fstat(fileno(s->f), &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size > s->start &&
          (uint64_t)st.st_size - s->start > s->end) {
        uint64_t after = (uint64_t)st.st_size - s->start - s->end;
        snprintf(err->message, sizeof err->message, "%" PRIu64 " bytes after the end of the frame", after);
      } else {
        snprintf(err->message, sizeof err->message,
                 "more than %d bytes after the end of the frame (a stream holds one frame; the rest was not read)",
                 TRAIL_MAX);
      }
      err->code = DP_EFORMAT;
      return DP_EFORMAT;
    }
  } else {
    if (n > s->limit - s->total) n = (size_t)(s->limit - s->total);
    *got = fread_all(dst, n, s->f);
  }
  if (*got == 0 && ferror(s->f)) {
    snprintf(err->message, sizeof err->message, "read error: %s", strerror(errno));
    err->code = DP_EIO;
    err->offset = -1;
    return DP_EIO;
  }
  if (s->hdr_len < FRAME_HEADER) {
    size_t k = *got < FRAME_HEADER - s->hdr_len ? *got : FRAME_HEADER - s->hdr_len;
    memcpy(s->hdr + s->hdr_len, dst, k);
    if ((s->hdr_len += k) == FRAME_HEADER) src_header(s);
    else if (no_magic(s->hdr, s->hdr_len)) s->no_magic = 1;
    else if (s->hdr_len >= 6 && !s->bad_header) { /* magic and version in: another version ends the reading */
      dp_error_clear(&s->herr);
      if (dp_frame_prefix_check(s->hdr, s->hdr_len, &s->herr) != 0) s->bad_header = 1;
    }
  }
  s->total += *got;
  if (s->bad_header) {
    *err = s->herr;
    return s->herr.code;
  }
  return 0;
}

static void src_close(src_t *s) {
  if (s->f && s->f != stdin) fclose(s->f);
}

/* Opens FILE (or stdin) to read a frame. A terminal is refused, by any
 * name (-, /dev/stdin, /dev/tty): a frame is binary, and waiting there for
 * one would look like a hang. */
static int src_open(src_t *s, const char *path) {
  memset(s, 0, sizeof *s);
  s->limit = UINT64_MAX;
  if (names_held_fd(path)) return data_error(display(path), strerror(EBADF), -1);
  int rc = input_names_write_only_fd(path);
  if (rc) return rc;
  s->f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
  if (!s->f) return data_error(display(path), strerror(errno), -1);
  if (isatty(fileno(s->f))) {
    src_close(s);
    return data_error(display(path), "is a terminal: a frame is binary (name a file, or pipe a frame in)", -1);
  }
  off_t at = ftello(s->f); /* `(read 100 bytes; devpickle verify -) < F`: the frame starts there */
  s->start = at > 0 ? (uint64_t)at : 0;
  return 0;
}

/* A frame refused at byte 0 whose first bytes are no magic but the start of
 * value JSON (after a byte order mark and blanks: '{', '[' or '"') was
 * likely given to the wrong command: the message says which one reads it. */
static int frame_error(const char *path, const uint8_t *head, size_t n, const char *what, int64_t offset) {
  size_t i = n >= 3 && memcmp(head, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
  while (i < n && (head[i] == ' ' || head[i] == '\t' || head[i] == '\n' || head[i] == '\r')) i++;
  if (offset != 0 || i == n || head[i] == '\0' || !strchr("{[\"", head[i]))
    return data_error(display(path), what, offset);
  char hint[1200];
  snprintf(hint, sizeof hint, "%.1000s: it starts like value JSON, which 'devpickle pack' turns into a frame", what);
  return data_error(display(path), hint, offset);
}

/* The error of a frame read through src: a read error is the system's
 * message, without an offset; bytes past TRAIL_MAX are reported where the
 * frame ended. */
static int src_error(const src_t *s, const char *path, int rc, const dp_error_t *e) {
  if (s->bad_header) return frame_error(path, s->hdr, s->hdr_len, s->herr.message, s->herr.offset);
  if (rc == DP_EIO) return data_error(display(path), e->message, -1);
  return frame_error(path, s->hdr, s->hdr_len, e->message, s->over ? (int64_t)s->end : e->offset);
}

/* Reads a whole frame (or stdin) into memory, as src_read bounds it. */
static int read_frame(const char *path, uint8_t **out, size_t *n) {
  src_t s;
  int rc = src_open(&s, path);
  if (rc) return rc;
  size_t cap = 1 << 16, len = 0;
  uint8_t *buf = malloc(cap);
  dp_error_t e;
  dp_error_clear(&e);
  dp_unpickle_opts_t o = cli_unpickle_opts();
  int value_checked = 0; /* the header, payload and table were read whole as the reader reads them */
  while (buf && !s.refused && !s.no_magic) { /* the library refuses such a header by itself: no need to read on */
    /* The header first, alone: fread waits for all it is asked, and a pipe
     * that stays open behind a header that is no frame's would hold the
     * command until it closes (the header alone refuses it). */
    size_t want = cap - len, got;
    if (s.hdr_len < FRAME_HEADER && want > FRAME_HEADER - s.hdr_len) want = FRAME_HEADER - s.hdr_len;
    if ((rc = src_read(&s, buf + len, want, &got, &e)) != 0 || got == 0) break;
    if ((len += got) < cap) continue;
    /* checked as it grows (twice its reading at most), as the library's
       stream reader checks what it holds: garbage behind a long header is
       refused as it comes, not held to the header's end; and once the
       header, payload and table are in, they are read as the reader will
       read them (once), so that a long data section behind a value the
       reader refuses is not held either */
    if (!value_checked) {
      if ((rc = dp_frame_value_check(buf, len, &o, &e)) != 0) break;
      value_checked = len - FRAME_HEADER >= le64(buf + 8) + le64(buf + 16); /* their sum fits: checked */
    }
    grow_or_drop(&buf, &cap);
  }
  src_close(&s);
  if (!buf) return data_error(display(path), "out of memory reading the file", -1);
  if (rc) {
    free(buf);
    return src_error(&s, path, rc, &e);
  }
  *out = buf;
  *n = len;
  return 0;
}

static int load_command(const char *cmd, const char *help, int argc, char **argv, int allow_o, const char *flag,
                        int whole, loaded_t *l) {
  int rc = parse_args(cmd, help, argc, argv, &l->a, allow_o, 0, flag);
  if (rc) return rc;
  if (l->a.out && (rc = sink_probe(l->a.out)) != 0) return rc; /* before reading, as pack */
  int ran_out;
  if (l->a.out && sink_open_early(l->a.out, -1, &ran_out) != 0) return data_error(l->a.out, strerror(errno), -1);
  dp_error_t e;
  dp_error_clear(&e);
  dp_unpickle_opts_t o = cli_unpickle_opts();
  if (whole) {
    uint8_t *bytes;
    if ((rc = read_frame(l->a.file, &bytes, &l->size)) != 0) return rc;
    rc = dp_unpickle(bytes, l->size, &o, &l->v, &e);
    if (rc == 0) dp_frame_check(bytes, l->size, &l->info, NULL);
    if (rc) rc = frame_error(l->a.file, bytes, l->size, e.message, e.offset);
    free(bytes);
    return rc;
  }
  src_t s;
  if ((rc = src_open(&s, l->a.file)) != 0) return rc;
  uint64_t size = 0;
  rc = dp_unpickle_stream(src_read, &s, &o, &l->v, &l->info, &size, &e);
  l->size = (size_t)size;
  src_close(&s);
  return rc ? src_error(&s, l->a.file, rc, &e) : 0;
}

/* How a frame is read from stdin, in every --help that reads one. */
#define STDIN_FRAME                                                              \
  "A pipe is read as it comes, up to the\n"                                     \
  "frame's end (the header gives its length) and at most 64 KiB past it, to\n" \
  "see that nothing follows: the command ends when the pipe closes, or with\n"  \
  "an error as soon as more than 64 KiB follow the frame. A terminal is\n"      \
  "refused.\n"

/* The limits a frame is read under, in every --help that reads one but verify's (which says so itself). */
#define FRAME_LIMITS                                                              \
  "The frame is read as 'verify' reads it: every check, the default limits\n"   \
  "(docs/FORMAT.md) and value JSON's nesting limit of 2,000 levels.\n"

/* ---- pack ---- */

static const char *const help_pack =
    "usage: devpickle pack VALUE.json -o FRAME.dpk\n"
    "\n"
    "Reads a value in value JSON (docs/VALUE_JSON.md; UTF-8, a byte order mark\n"
    "skipped) and writes it as a frame. JSON null, true/false, an integer\n"
    "(int64), a number with a fraction or exponent (float), a string, an array\n"
    "and an object are none, bool, int, float, str, list and dict (str keys, in\n"
    "order); an object with a key starting with '$' spells the rest:\n"
    "  {\"$tuple\": [...]}   {\"$bytes\": \"<base64>\"}   {\"$dict\": [[key, value], ...]}\n"
    "  {\"$float\": \"nan\"} (\"inf\", \"-inf\", or \"0x\" and the 16 hex digits of its bits)\n"
    "  {\"$object\": \"Class\", \"attrs\": {...}}   {\"$reduce\": \"Type\", \"state\": V}\n"
    "  {\"$id\": \"name\", \"$value\": V}, later {\"$ref\": \"name\"}: that node again\n"
    "  {\"$tensor\": {\"device\": \"cuda:0\", \"ptr\": \"0x7f0000001000\", \"nbytes\": 4096,\n"
    "               \"dtype\": \"float32\", \"shape\": [32, 32]}}\n"
    "    device cpu, cuda:N or host:N; optional: \"strides\" and \"offset\" (in\n"
    "    elements; default row-major, 0) and \"data\" (the nbytes, base64)\n"
    "'devpickle unpack' writes any frame's value in this notation.\n"
    "Tensors naming the same device and ptr share one storage. When the tensors\n"
    "carry \"data\" (base64) the frame is inline: it holds the buffer bytes.\n"
    "The frame is checked as 'verify' would before it is written, and written\n"
    "to a temporary file renamed over FRAME.dpk when complete (a FIFO or a\n"
    "device is opened before the input is read, as a shell's '>' would).\n"
    "Use - for stdin, -o - for stdout. The input is read to its end, or until\n"
    "what came is no JSON whatever follows (pack /dev/zero reads 64 KiB).\n"
    "Containers nest at most 2,000 levels (an empty one is no level; the JSON\n"
    "itself at most 8,008), the limit every frame command reads under.\n"
    "Exit status: 0 written; 1 on bad input or a failure, one line on stderr:\n"
    "'devpickle: FILE: what, at byte N' for text that is not JSON (a syntax\n"
    "error, a duplicate key, an integer out of range), 'at $.path' for JSON\n"
    "that is not a value, the system's message for a file that cannot be read\n"
    "or written; 2 usage.\n"
    "Example: devpickle pack examples/model.json -o model.dpk\n";

static int inline_reader(void *ud, dp_device_t d, const void *src, size_t n, void *dst, dp_error_t *err) {
  (void)ud; (void)d; (void)src; (void)n; (void)dst;
  if (err) {
    err->code = DP_EINVAL;
    snprintf(err->message, sizeof err->message, "a tensor without \"data\" in an inline frame");
  }
  return DP_EINVAL;
}

static int cmd_pack(int argc, char **argv) {
  args_t a;
  int rc = parse_args("pack", help_pack, argc, argv, &a, 1, 1, NULL);
  if (rc) return rc < 0 ? 0 : rc;
  if ((rc = sink_probe(a.out)) != 0) return rc; /* before reading: a pipe may take long to end */
  int ran_out;
  if (sink_open_early(a.out, -1, &ran_out) != 0) return data_error(a.out, strerror(errno), -1);
  uint8_t *text = NULL;
  size_t len = 0;
  if ((rc = read_json(a.file, &text, &len)) != 0) return rc;
  char msg[2048];
  size_t pos = 0;
  json_t *j = vjson_parse((const char *)text, len, msg, sizeof msg, &pos);
  /* a frame given to pack (pack and unpack confused) is named as one, as
     the frame commands name value JSON given to them (frame_error) */
  int is_frame = len >= 4 && memcmp(text, "DPKL", 4) == 0;
  free(text);
  if (!j && strncmp(msg, VJSON_NO_MEMORY, strlen(VJSON_NO_MEMORY)) == 0) /* said "invalid JSON: out of memory" */
    return data_error(display(a.file), "out of memory parsing the JSON", -1);
  if (!j) {
    char what[2200];
    snprintf(what, sizeof what, "invalid JSON: %s%s", msg,
             is_frame ? ": it starts like a devpickle frame, which 'devpickle unpack' turns into value JSON" : "");
    return data_error(display(a.file), what, (int64_t)pos);
  }
  dp_value_t v;
  int is_inline = 0;
  rc = vjson_to_value(j, &v, &is_inline, msg, sizeof msg);
  vjson_free(j);
  if (rc) return data_error(display(a.file), msg, -1);
  dp_frame_t *f;
  dp_error_t e;
  dp_error_clear(&e);
  dp_pickle_opts_t po = {is_inline ? DP_PICKLE_INLINE : 0, 0, inline_reader, NULL};
  if ((rc = dp_frame_new(&f, &e)) == 0) rc = dp_pickle(v, &po, f, &e);
  dp_value_release(v);
  if (rc) {
    dp_frame_free(f);
    return data_error(display(a.file), e.message, -1);
  }
  size_t n;
  const uint8_t *b = dp_frame_data(f, &n);
  /* What pack writes, verify accepts: the frame is read back as verify reads it. */
  dp_unpickle_opts_t o = cli_unpickle_opts();
  dp_value_t back;
  if (dp_unpickle(b, n, &o, &back, &e) != 0) {
    char what[DP_ERROR_MSG_MAX + 128];
    snprintf(what, sizeof what, "the frame would not pass verify (%s, at byte %lld); nothing written", e.message,
             (long long)e.offset);
    dp_frame_free(f);
    return data_error(display(a.file), what, -1);
  }
  dp_value_release(back);
  rc = write_all(a.out, b, n);
  dp_frame_free(f);
  return rc;
}

/* ---- unpack ---- */

static const char *const help_unpack =
    "usage: devpickle unpack FRAME.dpk [-o VALUE.json] [--compact]\n"
    "\n"
    "Checks a frame and prints its value as value JSON (on stdout, or into\n"
    "VALUE.json, written whole or not at all; a FIFO or a device is opened\n"
    "before the frame is read, as a shell's '>' would). 'devpickle pack'\n"
    "turns that JSON back into the same bytes. Shared nodes and cycles appear as\n"
    "{\"$id\": ..., \"$value\": ...} and {\"$ref\": ...}.\n"
    "The JSON is indented two spaces a level; --compact writes it on one\n"
    "line, no space between tokens, a newline at its end. Indented, every\n"
    "line carries two spaces a level of JSON (a level of the value is up to\n"
    "four), so a frame of deeply nested values grows up to about 54,800\n"
    "times (docs/SECURITY.md, \"The CLI\"; a dict {0: 0} is 3 bytes of frame\n"
    "and 8 lines: 2,000 of them 2,000 lists down, an 8 KB frame, unpack to\n"
    "72 MB). --compact writes no indentation: about 16 times the frame at most.\n"
    "Use - for stdin, -o - for stdout. " STDIN_FRAME FRAME_LIMITS

    "Exit status: 0 done; 1 a frame the reader refuses ('devpickle: FILE: what,\n"
    "at byte N'), a file that cannot be read or a failed write (one line on\n"
    "stderr); 2 usage.\n"
    "Example: devpickle unpack model.dpk -o model.json\n";

static int cmd_unpack(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("unpack", help_unpack, argc, argv, 1, "--compact", 1, &l);
  if (rc) return rc < 0 ? 0 : rc;
  sink_t s;
  if ((rc = sink_open(&s, l.a.out)) != 0) {
    dp_value_release(l.v);
    return rc;
  }
  char msg[256];
  rc = vjson_write(s.f, l.v, l.a.flag ? 0 : 2, msg, sizeof msg);
  dp_value_release(l.v);
  if (rc && rc != DP_EIO) {
    sink_close(&s, 0);
    return data_error(display(l.a.file), msg, -1);
  }
  return sink_close(&s, 1);
}

/* ---- dump ---- */

static const char *const help_dump =
    "usage: devpickle dump FRAME.dpk [--json]\n"
    "\n"
    "Lists on stdout the device allocations the frame's value references, one\n"
    "a line in the order a walk first meets them: device, pointer, size in\n"
    "bytes, refs (tensors on that storage) and the first path; then 'N\n"
    "allocations on M devices'. CPU storages are listed with device cpu.\n"
    "--json prints one object instead:\n"
    "  {\"count\": N, \"devices\": [...], \"pointers\": [{\"device\": \"cuda:0\",\n"
    "   \"ptr\": \"0x...\", \"nbytes\": N, \"path\": \"$...\", \"refs\": K}, ...]}\n"
    "Use - for stdin. " STDIN_FRAME FRAME_LIMITS

    "Exit status: 0 done; 1 a frame the reader refuses ('devpickle: FILE: what,\n"
    "at byte N'), a file that cannot be read or a failed write (one line on\n"
    "stderr); 2 usage.\n"
    "Example: devpickle dump model.dpk --json\n";

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

static void json_str(const char *s) {
  json_t *j = json_string(s);
  char *t = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
  fputs(t ? t : "\"\"", stdout);
  free(t);
  json_decref(j);
}

static int cmd_dump(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("dump", help_dump, argc, argv, 0, "--json", 0, &l);
  if (rc) return rc < 0 ? 0 : rc;
  dp_ptrset_t *set;
  rc = scan_value(l.a.file, l.v, &set);
  dp_value_release(l.v);
  if (rc) return rc;
  char dev[16];
  size_t count = dp_ptrset_count(set);
  if (l.a.flag) {
    /* printed as it goes: no document tree */
    printf("{\n  \"count\": %zu,\n  \"devices\": [", count);
    for (size_t j = 0; j < dp_ptrset_ndevices(set); j++) {
      printf("%s\n    ", j ? "," : "");
      json_str(dp_device_format(dp_ptrset_device(set, j), dev, sizeof dev));
    }
    printf("%s],\n  \"pointers\": [", dp_ptrset_ndevices(set) ? "\n  " : "");
    for (size_t i = 0; i < count && !ferror(stdout); i++) {
      dp_ptr_info_t p;
      dp_ptrset_get(set, i, &p, NULL);
      printf("%s\n    {\n      \"device\": \"%s\",\n      \"ptr\": \"0x%" PRIxPTR "\",\n      \"nbytes\": %zu,\n"
             "      \"path\": ", i ? "," : "", dp_device_format(p.device, dev, sizeof dev), (uintptr_t)p.base, p.nbytes);
      json_str(p.path ? p.path : "");
      printf(",\n      \"refs\": %u\n    }", p.refs);
    }
    printf("%s]\n}\n", count ? "\n  " : "");
  } else {
    printf("%-8s  %-18s  %12s  %5s  %s\n", "DEVICE", "POINTER", "BYTES", "REFS", "FIRST PATH");
    for (size_t i = 0; i < count && !ferror(stdout); i++) {
      dp_ptr_info_t p;
      dp_ptrset_get(set, i, &p, NULL);
      printf("%-8s  0x%016" PRIxPTR "  %12zu  %5u  %s\n", dp_device_format(p.device, dev, sizeof dev),
             (uintptr_t)p.base, p.nbytes, p.refs, p.path ? p.path : "");
    }
    printf("%zu allocation%s on %zu device%s\n", count, count == 1 ? "" : "s", dp_ptrset_ndevices(set),
           dp_ptrset_ndevices(set) == 1 ? "" : "s");
  }
  dp_ptrset_free(set);
  return stdout_done(0);
}

/* ---- inspect ---- */

static const char *const help_inspect =
    "usage: devpickle inspect FRAME.dpk\n"
    "\n"
    "Prints on stdout the frame's header and its value as a tree, one node a\n"
    "line: the path, the kind and a summary. A node met again is shown as\n"
    "'-> PATH' of its first line. Levels deeper than 64 are summarized, and\n"
    "dict keys are shown only in paths: a node first met there, or a\n"
    "container 64 levels down (whose children are cut), is not pointed back\n"
    "to but shown where it is met again. Long names and paths are shortened\n"
    "(docs/VALUE_JSON.md, \"Paths\"); a str shows its first 40 bytes, then\n"
    "'\xe2\x80\xa6' when longer; a float is written as value JSON writes it (nan,\n"
    "inf, -inf, a NaN other than the default by its bits, 0x...); a tensor's\n"
    "strides are shown when they are not its shape's row-major default.\n"
    "Use - for stdin. " STDIN_FRAME FRAME_LIMITS

    "Exit status: 0 done; 1 a frame the reader refuses ('devpickle: FILE: what,\n"
    "at byte N'), a file that cannot be read or a failed write (one line on\n"
    "stderr); 2 usage.\n"
    "Example: devpickle inspect model.dpk\n";

static int cmd_inspect(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("inspect", help_inspect, argc, argv, 0, NULL, 0, &l);
  if (rc) return rc < 0 ? 0 : rc;
  const dp_frame_info_t fi = l.info;
  printf("frame: %zu bytes, version %u, %s, payload %" PRIu64 ", table %" PRIu64 ", data %" PRIu64
         ", %u buffer%s, checksum %016" PRIx64 "\n",
         l.size, fi.version, (fi.flags & 1) ? "inline" : fi.nbuffers ? "buffers out-of-band" : "self-contained", fi.payload_len, fi.table_len, fi.data_len,
         fi.nbuffers, fi.nbuffers == 1 ? "" : "s", fi.checksum);
  rc = inspect_print(stdout, l.v);
  dp_value_release(l.v);
  if (rc && !ferror(stdout)) return data_error(display(l.a.file), "out of memory", -1);
  return stdout_done(0);
}

/* ---- verify ---- */

static const char *const help_verify =
    "usage: devpickle verify FRAME.dpk\n"
    "\n"
    "Checks a frame completely: header, lengths, checksum, buffer table and\n"
    "every value in the payload, under the default limits (docs/FORMAT.md) and\n"
    "value JSON's nesting limit of 2,000 levels, so that 'unpack' can write\n"
    "whatever passes. An inline frame's data is checked as it streams by, not\n"
    "held. Prints one line on stdout and exits 0: 'FILE: ok, N bytes, version\n"
    "V, B buffers, D device pointers, C cpu buffers, inline' (or out-of-band,\n"
    "or self-contained: no buffers), where the B buffers are the D on devices\n"
    "(cuda, host) and the C cpu storages; otherwise the error line on stderr\n"
    "('devpickle: FILE: what, at byte N') and exit status 1; 2 usage.\n"
    "Use - for stdin. " STDIN_FRAME

    "Example: devpickle verify model.dpk\n";

static int cmd_verify(int argc, char **argv) {
  loaded_t l;
  int rc = load_command("verify", help_verify, argc, argv, 0, NULL, 0, &l);
  if (rc) return rc < 0 ? 0 : rc;
  dp_ptrset_t *set;
  rc = scan_value(l.a.file, l.v, &set);
  dp_value_release(l.v);
  if (rc) return rc;
  const dp_frame_info_t fi = l.info;
  size_t cpu = 0; /* a cpu storage is a buffer but no device pointer */
  for (size_t j = 0; j < dp_ptrset_ndevices(set); j++)
    if (dp_ptrset_device(set, j).type == DP_DEVICE_CPU) cpu += dp_ptrset_device_count(set, j);
  const size_t dev = dp_ptrset_count(set) - cpu;
  cli_put_text(stdout, display(l.a.file));
  printf(": ok, %zu bytes, version %u, %u buffer%s, %zu device pointer%s, %zu cpu buffer%s, %s\n", l.size,
         fi.version, fi.nbuffers, fi.nbuffers == 1 ? "" : "s", dev, dev == 1 ? "" : "s", cpu, cpu == 1 ? "" : "s",
         (fi.flags & 1) ? "inline" : fi.nbuffers ? "out-of-band" : "self-contained");
  dp_ptrset_free(set);
  return stdout_done(0);
}

/* ---- send / recv: a link tested with the tool alone (docs/TRANSPORT.md) ---- */

/* The receiver answers each frame with one value: 0 when the frame verified
 * and was written, else what failed as a str that follows "the receiver ":
 * "refused the frame: WHY" or "could not write the frame: FILE: WHY". */
#define ANSWER_REFUSED "refused the frame: "
#define ANSWER_UNWRITTEN "could not write the frame: "

static const char *const help_send =
    "usage: devpickle send FRAME.dpk HOST:PORT [--timeout SECONDS]\n"
    "\n"
    "Sends a self-contained frame (inline, or without buffers) over UCX to\n"
    "'devpickle recv' listening on HOST:PORT (IPv4: UCX 1.13 cannot reach IPv6\n"
    "peers), and waits for its answer: the receiver verifies the frame as\n"
    "'verify' does and writes it. The frame is verified here first. Prints\n"
    "'FRAME.dpk: sent N bytes to HOST:PORT' on stdout and exits 0 once the\n"
    "receiver has written it; otherwise one line on stderr and status 1: 'devpickle:\n"
    "HOST:PORT: the receiver refused the frame: WHY', '... the receiver could\n"
    "not write the frame: FILE: WHY' (the system's reason there), or the\n"
    "connection's error.\n"
    "--timeout: give up when the whole exchange (send and answer) has taken\n"
    "SECONDS (over 0, at most 1000000, fractions allowed; default 60): 'send\n"
    "timed out: no answer from the receiver within SECONDS s (--timeout)'. A\n"
    "send that times out or loses its connection may still have delivered the\n"
    "frame (it can arrive, and be written, while the answer is on its way): the\n"
    "receiver's exit status says.\n"
    "UCX reads its own environment (UCX_TLS, UCX_NET_DEVICES); its own log is\n"
    "off (UCX_LOG_LEVEL=fatal) unless UCX_LOG_LEVEL is set. Exit status 2:\n"
    "usage.\n"
    "Use - for stdin. " STDIN_FRAME
    "send does not wait for recv to listen: a port nobody listens on yet is\n"
    "'connection refused', at once.\n"
    "Example: devpickle recv 5000 -o got.dpk &  then, once it says 'listening\n"
    "on port 5000': devpickle send f.dpk 127.0.0.1:5000\n";

static const char *const help_recv =
    "usage: devpickle recv PORT [-o FRAME.dpk] [--host HOST] [--timeout SECONDS]\n"
    "\n"
    "Listens on HOST:PORT (HOST an IPv4 address or a name, default 0.0.0.0: UCX\n"
    "1.13 cannot serve IPv6 peers; PORT 0 takes a free port), says 'devpickle\n"
    "recv: listening on port N' on stderr, receives one frame from 'devpickle\n"
    "send' — the first that any connection brings: each is accepted as it comes,\n"
    "so one that never sends holds nothing up, and the others are closed\n"
    "unanswered (their senders fail) — verifies it as 'verify' does, writes it\n"
    "to FRAME.dpk (or stdout; a terminal only with -o -) — a file is written\n"
    "whole under a temporary name and renamed, so a failure leaves no partial\n"
    "file — and answers the sender.\n"
    "An output that is no regular file (a FIFO, a device) is opened before it\n"
    "listens, as a shell's '>' would: a FIFO waits there for its reader.\n"
    "--timeout: give up after SECONDS without a frame (over 0, at most 1000000,\n"
    "fractions allowed; default: wait): 'recv timed out: no frame within\n"
    "SECONDS s (--timeout)'; a FIFO's reader is awaited as long, before it\n"
    "listens ('recv timed out: no process opened the FIFO for reading within\n"
    "SECONDS s (--timeout)').\n"
    "Exit status: 0 a frame received and written; 1 a frame refused, a\n"
    "connection that failed, a timeout or a failed write ('devpickle: FILE:\n"
    "write failed: WHY', or the system's reason FILE cannot be made: a\n"
    "directory, a name too long, or a directory missing or not writable is\n"
    "found before it listens), one line on stderr; the sender is told why a\n"
    "frame was refused or not written. The answer then has 10 s to leave\n"
    "('recv timed out: the answer to the sender was not sent within 10 s\n"
    "(recv's limit for its answer)', the status unchanged); 2 usage.\n"
    "UCX reads its own environment (UCX_TLS, UCX_NET_DEVICES); its own log is\n"
    "off (UCX_LOG_LEVEL=fatal) unless UCX_LOG_LEVEL is set.\n"
    "Example: devpickle recv 0 -o got.dpk (then send to the port it names)\n";

/* SECONDS: a decimal number (30, 0.5, .5, 1e-3), over 0 and at most
 * 1,000,000 — not the other spellings strtod takes (a sign, leading space,
 * hex, inf, nan). 0, or -1. */
static int parse_seconds(const char *s, double *out) {
  const char *p = s;
  int digits = 0;
  for (; *p >= '0' && *p <= '9'; p++) digits++;
  if (*p == '.')
    for (p++; *p >= '0' && *p <= '9'; p++) digits++;
  if (!digits) return -1;
  if (*p == 'e' || *p == 'E') {
    p += p[1] == '+' || p[1] == '-' ? 2 : 1;
    if (*p < '0' || *p > '9') return -1;
    while (*p >= '0' && *p <= '9') p++;
  }
  if (*p) return -1;
  *out = strtod(s, NULL);
  return *out > 0 && *out <= 1e6 ? 0 : -1;
}

typedef struct link_args {
  const char *pos[2];
  int npos;
  const char *out, *host;
  double timeout;
} link_args_t;

static int parse_link(const char *cmd, const char *help, int argc, char **argv, int want_pos, int allow_o,
                      link_args_t *a) {
  memset(a, 0, sizeof *a);
  a->timeout = -1;
  static const char *const with_value[] = {"--timeout", "--host", "-o", "--output", NULL};
  static const char *const with_timeout[] = {"--timeout", NULL};
  if (wants_help(argc, argv, allow_o ? with_value : with_timeout)) {
    fputs(help, stdout);
    return stdout_done(0) ? EXIT_DATA : -1;
  }
  int opts = 1; /* until "--" */
  const char *val;
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    int is_o = 0, is_host = 0;
    if (opts && strcmp(s, "--") == 0) {
      opts = 0;
    } else if (!opts) {
      if (a->npos == want_pos) return usage_error(cmd, "unexpected argument '%s'", s);
      if (!s[0] && want_pos == 2 && a->npos == 0)
        return usage_error(cmd, "%s", "an input file name cannot be '' (use - for stdin)");
      a->pos[a->npos++] = s;
    } else if ((allow_o && (is_o = is_opt(s, "-o", "--output", &val))) ||
               (allow_o && (is_host = is_opt(s, NULL, "--host", &val))) || is_opt(s, NULL, "--timeout", &val)) {
      const char *name = is_o ? opt_name(s, val, "-o", "--output") : is_host ? "--host" : "--timeout";
      if (!(val = opt_value(val, argc, argv, &i)))
        return usage_error(cmd, is_o ? "%s needs a file name" : "%s needs a value", name);
      if (is_host) {
        if (a->host) return usage_error(cmd, "%s", "--host given twice");
        if (!val[0]) return usage_error(cmd, "%s", "--host needs a host name or address, not ''");
        a->host = val;
      } else if (!is_o) {
        if (a->timeout >= 0) return usage_error(cmd, "%s", "--timeout given twice");
        if (parse_seconds(val, &a->timeout))
          return usage_error(cmd, "bad --timeout '%s' (SECONDS: a number over 0 and at most 1000000, as 30 or 0.5)",
                             val);
      } else {
        if (a->out) return usage_error(cmd, "%s given twice (-o and --output are one option)", name);
        if (!val[0]) return usage_error(cmd, "%s needs a file name, not ''", name);
        a->out = val;
      }
    } else if (s[0] == '-' && s[1] != '\0') {
      return unknown_option(cmd, s);
    } else if (a->npos == want_pos) {
      return usage_error(cmd, "unexpected argument '%s'", s);
    } else if (!s[0] && want_pos == 2 && a->npos == 0) {
      return usage_error(cmd, "%s", "an input file name cannot be '' (use - for stdin)");
    } else {
      a->pos[a->npos++] = s;
    }
  }
  if (a->npos < want_pos)
    return usage_error(cmd, "%s", want_pos == 2 ? "missing FRAME.dpk or HOST:PORT" : "missing PORT");
  return 0;
}

/* UCX logs its own errors, on stdout by default (a port in use: "UCX ERROR
 * bind(...) failed"; a peer gone: its shared-memory errors): into the frame
 * recv writes there, and beside the one line on stderr a failure gets here.
 * Its log level is read from the environment when libucs is loaded, before
 * main: so unless the user asked for a level (UCX_LOG_LEVEL), it is set to
 * fatal here, before the transport starts. */
static void quiet_ucx(void) {
  if (!getenv("UCX_LOG_LEVEL")) ucs_global_opts_set_value("LOG_LEVEL", "fatal");
}

/* libucs, loaded with the CLI, takes its debug signal when it is loaded,
 * before main: SIGHUP unless UCX_DEBUG_SIGNO says otherwise. Its handler
 * raises UCX's log level and returns, so a hang-up (a closed terminal, kill
 * -HUP) left every command running: `recv` waiting for a frame forever.
 * A signal that ends a command gets back the disposition it had when the
 * command started (SIG_DFL, or SIG_IGN under nohup); another debug signal
 * is left to UCX. */
static void untake_fatal_signals(void) {
  for (size_t i = 0; i < sizeof fatal_sigs / sizeof fatal_sigs[0]; i++)
    if (ucs_global_opts.debug_signo == (unsigned)fatal_sigs[i]) ucs_debug_disable_signal(fatal_sigs[i]);
}

/* SECONDS as ns, at least 1 (a tiny --timeout is a short one, never 0). */
static int64_t timeout_ns(double s) { return s < 0 ? -1 : s * 1e9 < 1 ? 1 : (int64_t)(s * 1e9); }

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* What is left of a deadline, at least 1 ns (-1: none). */
static int64_t left_ns(int64_t deadline) {
  if (deadline < 0) return -1;
  int64_t left = deadline - mono_ns();
  return left < 1 ? 1 : left;
}

static int64_t deadline_in(double s) { return s < 0 ? -1 : mono_ns() + timeout_ns(s); }

/* Waits for f until the deadline. *ran_out: the wait ended with f still
 * pending (the command's own --timeout); a future that completed just as
 * the wait ran out gives its own outcome. */
static int wait_until(dp_future_t *f, int64_t deadline, int *ran_out, dp_error_t *e) {
  int rc = dp_future_wait(f, left_ns(deadline), e);
  if (rc == DP_ETIMEDOUT) {
    if (!dp_future_is_done(f)) {
      *ran_out = 1;
      return rc;
    }
    rc = dp_future_wait(f, 0, e);
  }
  return rc;
}

/* Every timeout names the command and its limit: the command's own
 * (--timeout, in its seconds), or the connection's (UCX's keepalive found
 * the peer gone). */
static void timeout_message(dp_error_t *e, int ran_out, double s, const char *limit, const char *cmd,
                            const char *what) {
  if (e->code != DP_ETIMEDOUT) return;
  char was[sizeof e->message];
  snprintf(was, sizeof was, "%s", e->message);
  /* The limit as given, in plain decimals: the fewest that read back as s
   * (%g rounded to 6 digits, "0.1000001" showing as "0.1", and wrote
   * 1000000 as "1e+06"). */
  char secs[64];
  snprintf(secs, sizeof secs, "%.17g", s);
  for (int d = 0; d <= 17; d++) {
    char t[64];
    snprintf(t, sizeof t, "%.*f", d, s);
    if (strtod(t, NULL) == s) {
      snprintf(secs, sizeof secs, "%s", t);
      break;
    }
  }
  if (ran_out)
    snprintf(e->message, sizeof e->message, "%s timed out: %s within %s s (%s)", cmd, what, secs, limit);
  else
    snprintf(e->message, sizeof e->message, "%s timed out: %.1900s (the connection's limit: UCX's keepalive)", cmd,
             was);
}

/* HOST:PORT as messages show it, from the first hostlen bytes of host: an
 * IPv6 host in brackets ("[::1]:5000", never the ambiguous "::1:5000"); the
 * last colon splits, as the transport reads it. A new string, sized to the
 * host however long (a host cut to a fixed buffer lost its port, and recv's
 * listener was then told no HOST:PORT at all), or NULL. */
static char *addr_new(const char *host, size_t hostlen, const char *port) {
  int wrap = memchr(host, ':', hostlen) && host[0] != '[';
  size_t cap = hostlen + strlen(port) + 4;
  char *buf = malloc(cap);
  if (buf) snprintf(buf, cap, "%s%.*s%s:%s", wrap ? "[" : "", (int)hostlen, host, wrap ? "]" : "", port);
  return buf;
}

/* The connection's message less the transport's own name for the peer
 * ("transport: endpoint to 127.0.0.1:5000: connection refused ..."): the
 * line names the peer in front already, once is enough. */
static const char *unnamed(const char *peer, const char *msg) {
  static const char head[] = "transport: endpoint to ";
  size_t hn = strlen(head), pn = strlen(peer);
  if (strncmp(msg, head, hn) == 0 && strncmp(msg + hn, peer, pn) == 0 && strncmp(msg + hn + pn, ": ", 2) == 0)
    return msg + hn + pn + 2;
  return msg;
}

static int cmd_send(int argc, char **argv) {
  link_args_t a;
  int rc = parse_link("send", help_send, argc, argv, 2, 0, &a);
  if (rc) return rc < 0 ? 0 : rc;
  const char *colon = strrchr(a.pos[1], ':');
  char *pend = NULL;
  long port = colon && colon != a.pos[1] && colon[1] ? strtol(colon + 1, &pend, 10) : -1;
  if (port < 1 || port > 65535 || !pend || *pend || colon[1] < '0' || colon[1] > '9')
    return usage_error("send", "'%s' is not HOST:PORT (PORT 1 to 65535)", a.pos[1]);
  if (a.timeout < 0) a.timeout = 60;
  quiet_ucx();
  uint8_t *bytes;
  size_t n;
  if ((rc = read_frame(a.pos[0], &bytes, &n)) != 0) return rc;
  dp_error_t e;
  dp_error_clear(&e);
  dp_unpickle_opts_t o = cli_unpickle_opts();
  dp_value_t v;
  if ((rc = dp_unpickle(bytes, n, &o, &v, &e)) != 0) {
    rc = frame_error(a.pos[0], bytes, n, e.message, e.offset);
    free(bytes);
    return rc;
  }
  dp_value_release(v);
  dp_frame_info_t info;
  if (dp_frame_check(bytes, n, &info, &e) == 0 && !(info.flags & 1u) && info.nbuffers) {
    /* refused before connecting: a receiver is never left without its frame */
    char what[160];
    snprintf(what, sizeof what, "the frame's %u buffer%s out-of-band: send moves self-contained frames "
             "(inline: pack writes one when the tensors carry \"data\")", info.nbuffers,
             info.nbuffers == 1 ? " is" : "s are");
    free(bytes);
    return data_error(display(a.pos[0]), what, -1);
  }
  char *peer = addr_new(a.pos[1], (size_t)(colon - a.pos[1]), colon + 1);
  if (!peer) {
    free(bytes);
    return data_error(a.pos[1], "out of memory", -1);
  }
  dp_transport_t *t = NULL;
  dp_endpoint_t *ep = NULL;
  dp_future_t *done = NULL, *ans = NULL;
  const char *where = peer;
  dp_transport_opts_t to;
  memset(&to, 0, sizeof to);
  rc = dp_backend_get(DP_DEVICE_HOST, &to.backend, &e); /* frames only: no GPU to wake */
  if (!rc) rc = dp_transport_new(&to, &t, &e);
  if (!rc) rc = dp_endpoint_connect(t, a.pos[1], &ep, &e);
  if (!rc) where = display(a.pos[0]), rc = dp_endpoint_send_frame(ep, bytes, n, &done, &e);
  if (rc && ep && dp_endpoint_error(ep, NULL)) where = peer; /* the connection's error, not the file's */
  if (!rc) where = peer, rc = dp_endpoint_recv(ep, &ans, &e);
  int64_t deadline = deadline_in(a.timeout); /* one limit for the whole exchange */
  int ran_out = 0;
  if (!rc) rc = wait_until(done, deadline, &ran_out, &e);
  if (!rc) rc = wait_until(ans, deadline, &ran_out, &e);
  if (rc) timeout_message(&e, ran_out, a.timeout, "--timeout", "send", "no answer from the receiver");
  free(bytes);
  int status = 0;
  if (rc) {
    status = data_error(where, where == peer ? unnamed(peer, e.message) : e.message, -1);
  } else {
    dp_value_t r = dp_future_value(ans);
    if (dp_value_kind(r) == DP_STR) { /* what failed there: a refusal, or a write that failed */
      char what[1600];
      const char *why = dp_str_data(r, NULL);
      int says = strncmp(why, ANSWER_REFUSED, strlen(ANSWER_REFUSED)) == 0 ||
                 strncmp(why, ANSWER_UNWRITTEN, strlen(ANSWER_UNWRITTEN)) == 0;
      snprintf(what, sizeof what, "the receiver %s%.1500s", says ? "" : ANSWER_REFUSED, why);
      status = data_error(peer, what, -1);
    } else if (dp_value_kind(r) != DP_INT || dp_value_as_int(r) != 0) {
      status = data_error(peer, "the receiver gave no answer devpickle knows", -1);
    } else {
      cli_put_text(stdout, display(a.pos[0]));
      printf(": sent %zu bytes to ", n);
      cli_put_text(stdout, peer);
      putchar('\n');
    }
  }
  dp_future_release(done);
  dp_future_release(ans);
  dp_endpoint_free(ep);
  dp_transport_free(t);
  free(peer);
  return stdout_done(status);
}

/* Why recv cannot listen. The transport's message names the address
 * itself ("transport: cannot listen on 127.0.0.1:5000: the address is in
 * use"): put after the address again, it named it twice. Such a message is
 * said as recv's, without the layer's name (a host given by name is shown
 * as the address it resolved to); one that names no address (out of
 * memory) keeps the address in front. */
static int listen_error(const char *host, const char *addr, const char *msg) {
  size_t hn = strlen(host);
  if (hn > 2 && host[0] == '[' && host[hn - 1] == ']') host++, hn -= 2; /* [::1]: the transport names ::1 */
  static const char listen[] = "transport: cannot listen on "; /* the address it tried: a name resolved */
  int names = strncmp(msg, listen, sizeof listen - 1) == 0;
  for (const char *p = msg; !names && *p; p++) names = strncmp(p, host, hn) == 0;
  if (!names) return data_error(addr, msg, -1);
  if (strncmp(msg, "transport: ", 11) == 0) msg += 11;
  return data_error("recv", msg, -1);
}

#define ANSWER_WAIT_S 10 /* recv's limit for its answer to leave, and for the sender to close */
#define ACCEPT_SLICE_NS 200000000 /* how soon recv's accepting thread sees that a frame came */

/* recv's connections. Each one is accepted as it comes and given a receive
 * at once; the first receive to complete (a frame, the reader's refusal, a
 * connection lost) is the one recv answers. Only the first connection was
 * served: one that connected and never sent held recv until --timeout, or
 * forever, while the sender behind it could not get through. */
typedef struct recv_conns {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* a receive completed, or the accepting thread failed */
  dp_listener_t *l;
  int stop;          /* the accepting thread leaves at its next look */
  int done;          /* a receive completed, or the accepting thread failed (rc) */
  int rc;
  dp_error_t err;
  size_t n, cap;
  dp_endpoint_t **ep;
  dp_future_t **f, **then;
} recv_conns_t;

/* code in *e, with msg; returns code. */
static int recv_error(dp_error_t *e, int code, const char *msg) {
  dp_error_clear(e);
  e->code = code;
  snprintf(e->message, sizeof e->message, "%s", msg);
  return code;
}

/* A receive completed, whatever its outcome (then_with_ptrs runs on both). */
static int recv_came(void *ud, dp_future_t *parent, dp_value_t *result, dp_ptrset_t *ptrs, dp_error_t *err) {
  (void)parent, (void)ptrs, (void)err;
  recv_conns_t *c = ud;
  pthread_mutex_lock(&c->mu);
  c->done = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  *result = dp_none();
  return 0;
}

/* One connection more in c, its receive posted; 0, or an error in *e. */
static int recv_conn_add(recv_conns_t *c, dp_endpoint_t *ep, dp_error_t *e) {
  dp_future_t *f = NULL, *then = NULL;
  int rc = dp_endpoint_recv_frame(ep, &f, e);
  pthread_mutex_lock(&c->mu);
  if (!rc && c->n == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 8;
    dp_endpoint_t **eps = realloc(c->ep, cap * sizeof *eps);
    if (eps) c->ep = eps;
    dp_future_t **fs = eps ? realloc(c->f, cap * sizeof *fs) : NULL;
    if (fs) c->f = fs;
    dp_future_t **ts = fs ? realloc(c->then, cap * sizeof *ts) : NULL;
    if (ts) c->then = ts, c->cap = cap;
    else rc = recv_error(e, DP_ENOMEM, "out of memory");
  }
  size_t i = c->n;
  if (!rc) c->ep[i] = ep, c->f[i] = f, c->then[i] = NULL, c->n++;
  pthread_mutex_unlock(&c->mu);
  if (rc) {
    dp_future_release(f);
    dp_endpoint_free(ep);
    return rc;
  }
  /* outside the lock: a receive already complete runs recv_came here */
  rc = dp_future_then_with_ptrs(f, recv_came, c, &then, e);
  pthread_mutex_lock(&c->mu);
  c->then[i] = then;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* The accepting thread: connections until recv is done, or an error. */
static void *recv_accepting(void *arg) {
  recv_conns_t *c = arg;
  for (;;) {
    pthread_mutex_lock(&c->mu);
    int stop = c->stop;
    pthread_mutex_unlock(&c->mu);
    if (stop) return NULL;
    dp_endpoint_t *ep = NULL;
    dp_error_t e;
    dp_error_clear(&e);
    int rc = dp_listener_accept(c->l, ACCEPT_SLICE_NS, &ep, &e);
    if (rc == DP_ETIMEDOUT) continue;
    if (!rc) rc = recv_conn_add(c, ep, &e);
    if (!rc) continue;
    pthread_mutex_lock(&c->mu);
    c->rc = rc, c->err = e, c->done = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
  }
}

/* The connections of c (the accepting thread gone): their endpoints
 * closed, their receives released. */
static void recv_conns_drop(recv_conns_t *c) {
  for (size_t i = 0; i < c->n; i++) {
    dp_future_release(c->then[i]);
    dp_future_release(c->f[i]);
    dp_endpoint_free(c->ep[i]);
    c->then[i] = c->f[i] = NULL;
    c->ep[i] = NULL;
  }
  c->n = 0;
}

/* Waits for recv's first receive to complete, until the deadline (-1:
 * none); its index, or -1 with *e (a timeout: *ran_out). */
static long recv_first(recv_conns_t *c, int64_t deadline, int *ran_out, dp_error_t *e) {
  pthread_t th;
  if (pthread_create(&th, NULL, recv_accepting, c) != 0) return recv_error(e, DP_ENOMEM, "cannot start a thread"), -1;
  pthread_mutex_lock(&c->mu);
  while (!c->done) {
    if (deadline < 0) {
      pthread_cond_wait(&c->cv, &c->mu);
      continue;
    }
    struct timespec at = {(time_t)(deadline / 1000000000), (long)(deadline % 1000000000)};
    if (pthread_cond_timedwait(&c->cv, &c->mu, &at) == ETIMEDOUT) break;
  }
  c->stop = 1;
  pthread_mutex_unlock(&c->mu);
  pthread_join(th, NULL);
  for (size_t i = 0; i < c->n; i++)
    if (dp_future_is_done(c->f[i])) return (long)i;
  if (c->rc) {
    *e = c->err;
    return -1;
  }
  *ran_out = 1;
  recv_error(e, DP_ETIMEDOUT, "no frame");
  return -1;
}


static int cmd_recv(int argc, char **argv) {
  link_args_t a;
  int rc = parse_link("recv", help_recv, argc, argv, 1, 1, &a);
  if (rc) return rc < 0 ? 0 : rc;
  const char *port = a.pos[0];
  if (!*port || strspn(port, "0123456789") != strlen(port) || strlen(port) > 5 || atoi(port) > 65535)
    return usage_error("recv", "bad PORT '%s' (0 to 65535; 0: any free port)", port);
  /* one ':' is no IPv6 address but a port (--host 127.0.0.1:5000): it was
   * passed on as the host, and the transport named an address built of it,
   * "[127.0.0.1:5000]:0", that nobody typed */
  if (a.host && a.host[0] != '[' && strchr(a.host, ':') && strchr(a.host, ':') == strrchr(a.host, ':'))
    return usage_error("recv", "--host '%s' holds a port: give the host alone (the port is PORT)", a.host);
  if (!a.out && isatty(STDOUT_FILENO)) /* before listening: no sender is left without an answer */
    return usage_error("recv", "%s", "stdout is a terminal: a frame is binary (-o FRAME.dpk, or -o - to write it there)");
  if (!a.out) a.out = "-";
  if ((rc = sink_probe(a.out)) != 0) return rc; /* before listening: not after a sender's frame came */
  int ran_out = 0; /* a FIFO's reader is awaited for --timeout too, before the frame's own wait */
  if (sink_open_early(a.out, deadline_in(a.timeout), &ran_out) != 0) {
    dp_error_t fe;
    dp_error_clear(&fe);
    snprintf(fe.message, sizeof fe.message, "%s", strerror(errno));
    if (ran_out) fe.code = DP_ETIMEDOUT;
    timeout_message(&fe, ran_out, a.timeout, "--timeout", "recv", "no process opened the FIFO for reading");
    return data_error(a.out, fe.message, -1);
  }
  /* a stdout nobody reads fails the write (EPIPE), reported and answered
     as any failed write: killed by SIGPIPE, recv told its sender nothing */
  signal(SIGPIPE, SIG_IGN);
  quiet_ucx();
  const char *host = a.host ? a.host : "0.0.0.0";
  char *addr = addr_new(host, strlen(host), port);
  if (!addr) return data_error(host, "out of memory", -1);
  dp_error_t e;
  dp_error_clear(&e);
  dp_transport_opts_t to;
  memset(&to, 0, sizeof to);
  dp_unpickle_opts_t uo = cli_unpickle_opts();
  to.unpickle = &uo;
  dp_transport_t *t = NULL;
  dp_listener_t *l = NULL;
  dp_endpoint_t *ep = NULL;
  dp_future_t *f = NULL, *d = NULL;
  int status = 0;
  recv_conns_t conns;
  memset(&conns, 0, sizeof conns);
  pthread_mutex_init(&conns.mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the deadline is mono_ns's */
  pthread_cond_init(&conns.cv, &ca);
  pthread_condattr_destroy(&ca);
  rc = dp_backend_get(DP_DEVICE_HOST, &to.backend, &e); /* frames only: no GPU to wake */
  if (!rc) rc = dp_transport_new(&to, &t, &e);
  if (!rc) rc = dp_listener_new(t, addr, &l, &e);
  if (rc) {
    status = listen_error(host, addr, e.message);
    goto out;
  }
  fprintf(stderr, "devpickle recv: listening on port %d\n", dp_listener_port(l));
  fflush(stderr);
  char bound[8];
  snprintf(bound, sizeof bound, "%d", dp_listener_port(l));
  char *shown = addr_new(host, strlen(host), bound); /* the port bound */
  if (shown) free(addr), addr = shown;
  conns.l = l;
  long first = recv_first(&conns, deadline_in(a.timeout), &ran_out, &e);
  rc = first < 0 ? e.code : 0;
  if (!rc) { /* the others go unanswered: their senders read a close */
    ep = conns.ep[first], f = conns.f[first];
    conns.ep[first] = NULL, conns.f[first] = NULL;
    recv_conns_drop(&conns);
    rc = dp_future_wait(f, 0, &e);
  }
  if (rc) timeout_message(&e, ran_out, a.timeout, "--timeout", "recv", "no frame");
  dp_value_t answer = dp_int(0);
  char why[sizeof last_error + 64];
  if (rc) {
    status = data_error(addr, e.message, e.offset);
    snprintf(why, sizeof why, ANSWER_REFUSED "%.1300s", e.message);
  } else {
    size_t n;
    const uint8_t *b = dp_bytes_data(dp_future_value(f), &n);
    status = write_all(a.out, b, n); /* says why on stderr, with the system's reason */
    snprintf(why, sizeof why, ANSWER_UNWRITTEN "%s", last_error);
  }
  if (status && ep && !dp_endpoint_error(ep, NULL)) dp_str_new(why, strlen(why), &answer, NULL);
  /* answer the sender, then stay until it closes: closing first could
   * overtake the answer (docs/TRANSPORT.md, "Closing") */
  if (ep && !dp_endpoint_error(ep, NULL) && dp_endpoint_send(ep, answer, &d, &e) == 0) {
    dp_future_t *bye = NULL;
    if (dp_future_wait(d, ANSWER_WAIT_S * (int64_t)1000000000, &e) != 0) {
      /* the frame's fate stands (status); the sender will time out or see the connection go */
      ran_out = e.code == DP_ETIMEDOUT && !dp_future_is_done(d);
      timeout_message(&e, ran_out, ANSWER_WAIT_S, "recv's limit for its answer", "recv",
                      "the answer to the sender was not sent");
      data_error(addr, e.message, -1);
    } else if (dp_endpoint_recv(ep, &bye, NULL) == 0) {
      dp_future_wait(bye, ANSWER_WAIT_S * (int64_t)1000000000, NULL); /* the sender closing: no error either way */
    }
    dp_future_release(bye);
  }
  dp_value_release(answer);
out:
  dp_future_release(f);
  dp_future_release(d);
  dp_endpoint_free(ep);
  recv_conns_drop(&conns);
  dp_listener_free(l);
  dp_transport_free(t); /* its thread may run recv_came until then */
  free(conns.ep), free(conns.f), free(conns.then);
  pthread_cond_destroy(&conns.cv);
  pthread_mutex_destroy(&conns.mu);
  free(addr);
  return status;
}

/* ---- demo ---- */

static int cmd_demo(int argc, char **argv) { return stdout_done(demo_run(argc, argv)); }

static const cmd_t commands[] = {
    {"pack", cmd_pack},       {"unpack", cmd_unpack}, {"dump", cmd_dump},
    {"inspect", cmd_inspect}, {"verify", cmd_verify}, {"demo", cmd_demo},
    {"send", cmd_send},       {"recv", cmd_recv},
};

/* The edit distance between a and b (insertions, deletions, substitutions
 * and swaps of neighbours), for names of up to 15 bytes; 99 past that. */
static int name_distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b);
  if (n > 15 || m > 15) return 99;
  int d[16][16];
  for (size_t i = 0; i <= n; i++) d[i][0] = (int)i;
  for (size_t j = 0; j <= m; j++) d[0][j] = (int)j;
  for (size_t i = 1; i <= n; i++)
    for (size_t j = 1; j <= m; j++) {
      int best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
      if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
      if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < best)
        best = d[i - 2][j - 2] + 1;
      d[i][j] = best;
    }
  return d[n][m];
}

/* Names a command that is not one, with the list of those that are; a
 * name a typo away from a command says which one ('verfy': verify), and a
 * file given where the command goes says the command comes first
 * ('devpickle model.dpk' read as a command). */
static int unknown_command(const char *name) {
  fputs("devpickle: unknown command '", stderr);
  cli_put_text(stderr, name);
  fputc('\'', stderr);
  const char *near = NULL;
  int best = strlen(name) < 4 ? 1 : 2; /* 'ls' is no typo of 'dump' */
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
    int k = name_distance(name, commands[i].name);
    if (k <= best) best = k - 1, near = commands[i].name;
  }
  struct stat st;
  FILE *f;
  if (near) {
    fprintf(stderr, " (did you mean '%s'?)", near);
  } else if (name[0] != '-' && stat(name, &st) == 0 && S_ISREG(st.st_mode) && (f = fopen(name, "rb"))) {
    char magic[4] = {0};
    int frame = fread(magic, 1, 4, f) == 4 && memcmp(magic, "DPKL", 4) == 0;
    fclose(f);
    fputs(frame ? " (a frame: the command comes first, as in 'devpickle verify FILE')"
                : " (a file: the command comes first, as in 'devpickle pack FILE -o FRAME.dpk')",
          stderr);
  }
  fprintf(stderr, "\n\n%s", usage_main);
  return EXIT_USAGE;
}

/* 'help', '--help' and '-h' alike: alone (or given one of themselves) the
 * main usage; given a command, that command's --help; given a name that is no
 * command, the same error as running it. */
/* --version has a help of its own, as a command has: asked for either way
 * round (devpickle --version --help, devpickle help --version). */
static const char usage_version[] =
    "usage: devpickle --version\n"
    "\n"
    "Prints devpickle's version and the frame format version it reads and\n"
    "writes, then exits 0. It takes no argument.\n";

static int is_help_word(const char *a) { return !strcmp(a, "--help") || !strcmp(a, "-h"); }

static int cmd_help(int argc, char **argv) {
  /* '--' ends its options, as every command's: 'help --' is the main help,
   * 'help pack --' and 'help -- pack' pack's (they said "unknown command
   * '--'" and "unexpected argument '--'"). */
  char *topic = NULL;
  for (int i = 2, opts = 1; i < argc; i++) {
    if (opts && strcmp(argv[i], "--") == 0) {
      opts = 0;
    } else if (topic) {
      fprintf(stderr, "devpickle %s: unexpected argument '", argv[1]);
      cli_put_text(stderr, argv[i]);
      fputs("'\nTry 'devpickle help COMMAND'.\n", stderr);
      return EXIT_USAGE;
    } else {
      topic = argv[i];
    }
  }
  if (topic && strcmp(topic, "help") != 0 && strcmp(topic, "--help") != 0 && strcmp(topic, "-h") != 0) {
    if (strcmp(topic, "--version") == 0) {
      fputs(usage_version, stdout);
      return stdout_done(0);
    }
    char help_flag[] = "--help", *args[] = {topic, help_flag, NULL};
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
      if (strcmp(topic, commands[i].name) == 0) return commands[i].run(2, args);
    return unknown_command(topic);
  }
  fputs(usage_main, stdout);
  return stdout_done(0);
}

/* A descriptor 0, 1 or 2 that the caller left closed (2>&-) would be the
 * next one opened — an output, the FIFO recv opens before it listens, a
 * socket of UCX's — and what is printed to stdout or stderr would land in
 * it. Each is held by /dev/null opened the other way, so that using it
 * still fails (EBADF) as a closed one does, and so does naming it
 * (/dev/stdout, /dev/fd/N: names_held_fd). */
static void hold_std_fds(void) {
  for (int fd = 0; fd <= 2; fd++) {
    if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    int d = open("/dev/null", fd == 0 ? O_WRONLY : O_RDONLY);
    if (d >= 0 && d != fd) {
      dup2(d, fd);
      close(d);
    }
    if (d >= 0) held_std |= 1u << fd;
  }
}

/* stdin and stdout as blocking_twin leaves them (main). */
static void own_blocking_std_fds(void) {
  for (int fd = 0; fd <= 1; fd++) {
    int d = fd_held(fd) ? -1 : blocking_twin(fd);
    if (d < 0) continue;
    (void)dup2(d, fd); /* failing, fd stays as it was */
    close(d);
  }
}

int main(int argc, char **argv) {
  hold_std_fds();
  own_blocking_std_fds();
  /* A file-size limit makes write() fail with EFBIG, which is reported and
   * cleaned up, instead of killing the process mid-write. */
  signal(SIGXFSZ, SIG_IGN);
  untake_fatal_signals();
  if (argc < 2) {
    fputs(usage_main, stderr);
    return EXIT_USAGE;
  }
  if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)
    return cmd_help(argc, argv);
  if (strcmp(argv[1], "--version") == 0) {
    for (int i = 2; i < argc && strcmp(argv[i], "--") != 0; i++)
      if (is_help_word(argv[i])) { /* --help answers wherever it comes */
        fputs(usage_version, stdout);
        return stdout_done(0);
      }
    int arg = argc > 2 && strcmp(argv[2], "--") == 0 ? 3 : 2; /* '--' ends its options, as every command's */
    if (argc > arg) {
      fputs("devpickle --version: unexpected argument '", stderr);
      cli_put_text(stderr, argv[arg]);
      fputs("'\nTry 'devpickle --version --help'.\n", stderr); /* as every other usage error points to a help */
      return EXIT_USAGE;
    }
    printf("devpickle %s (frame format version 1)\n", DP_VERSION_STRING);
    return stdout_done(0);
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (strcmp(argv[1], commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
  return unknown_command(argv[1]);
}
