/* transport/shm.c — shared-memory segments of staging slots (shm.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../core/internal.h"
#include "../device/internal.h"
#include "shm.h"

#define HDR_BYTES 4096u
int dp__shm_stale_s = 60;
#define SHM_MAGIC 0x4d485344u /* "DSHM" */

struct dp__shm {
  dp_backend_t *b;
  char name[DP__SHM_NAME_MAX];
  uint8_t *base;
  size_t len;
  size_t slot_bytes;
  unsigned nslots;
  uint64_t token;
  int refs;
  int linked;     /* the creator's name still exists */
  int registered;
};

typedef struct shm_hdr {
  uint32_t magic;
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t token;
} shm_hdr_t;

static void destroy(dp__shm_t *s) {
  if (s->registered) dp__pinned_unregister(s->b, s->base);
  if (s->base) munmap(s->base, s->len);
  if (s->linked) shm_unlink(s->name);
  dp__free(s, sizeof *s);
}

static int sys_err(dp_error_t *err, const char *what, const char *name) {
  return dp__err(err, DP_EIO, "transport: shared memory %s: %s: %s", name, what, strerror(errno));
}

int dp__shm_create(dp_backend_t *b, unsigned nslots, size_t slot_bytes, dp__shm_t **out, dp_error_t *err) {
  static _Atomic unsigned counter;
  *out = NULL;
  if (!nslots || nslots > DP__SHM_MAX_SLOTS || !slot_bytes || slot_bytes > ((size_t)1 << 30))
    return dp__err(err, DP_EINVAL, "transport: shared segment of %u slots of %zu bytes", nslots, slot_bytes);
  dp__shm_t *s = dp__alloc(sizeof *s);
  if (!s) return dp__err(err, DP_ENOMEM, "transport: out of memory");
  memset(s, 0, sizeof *s);
  s->b = b;
  s->refs = 1;
  s->nslots = nslots;
  s->slot_bytes = slot_bytes;
  s->len = HDR_BYTES + (size_t)nslots * slot_bytes;
  uint64_t r = 0;
  /* the token is the segment's only secret: none without the kernel's randomness */
  if (getrandom(&s->token, sizeof s->token, GRND_NONBLOCK) != sizeof s->token ||
      getrandom(&r, sizeof r, GRND_NONBLOCK) != sizeof r) {
    dp__free(s, sizeof *s);
    return dp__err(err, DP_EIO, "transport: no random token for a shared segment (getrandom: %s)", strerror(errno));
  }
  snprintf(s->name, sizeof s->name, "/devpickle-%ld-%u-%016llx", (long)getpid(), atomic_fetch_add(&counter, 1),
           (unsigned long long)r);
  int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    int rc = sys_err(err, "shm_open", s->name);
    dp__free(s, sizeof *s);
    return rc;
  }
  s->linked = 1;
  int rc = 0;
  /* reserved now: tmpfs gives pages on first touch, and a full /dev/shm
     would then kill the process with SIGBUS under a copy */
  int fe = posix_fallocate(fd, 0, (off_t)s->len);
  if (fe) errno = fe, rc = sys_err(err, "posix_fallocate", s->name);
  if (!rc) {
    void *p = mmap(NULL, s->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) rc = sys_err(err, "mmap", s->name);
    else s->base = p;
  }
  close(fd);
  if (!rc && b) rc = dp__pinned_register(b, s->base, s->len, 0, err);
  if (rc) {
    destroy(s);
    return rc;
  }
  s->registered = b != NULL;
  shm_hdr_t h = {SHM_MAGIC, nslots, slot_bytes, s->token};
  memcpy(s->base, &h, sizeof h);
  *out = s;
  return 0;
}

/* "/devpickle-" and then letters, digits and dashes only */
static int name_ok(const char *name) {
  size_t n = strnlen(name, DP__SHM_NAME_MAX);
  if (n == DP__SHM_NAME_MAX || strncmp(name, "/devpickle-", 11) != 0 || n == 11) return 0;
  for (size_t i = 11; i < n; i++) {
    char c = name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-')) return 0;
  }
  return 1;
}

void dp__shm_sweep(void) {
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  uid_t me = geteuid();
  for (struct dirent *e; (e = readdir(d));) {
    long pid = 0;
    unsigned n = 0;
    unsigned long long r = 0;
    char tail;
    if (strlen(e->d_name) >= DP__SHM_NAME_MAX - 1 ||
        sscanf(e->d_name, "devpickle-%ld-%u-%16llx%c", &pid, &n, &r, &tail) != 3 || pid <= 0)
      continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) || st.st_uid != me || !S_ISREG(st.st_mode)) continue;
    /* offers live 2 s: a younger name may be a live process's in another
       PID namespace sharing /dev/shm, whose PID means nothing here */
    if (time(NULL) - st.st_ctime < dp__shm_stale_s) continue;
    if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours to ask) */
    char name[DP__SHM_NAME_MAX];
    name[0] = '/';
    memcpy(name + 1, e->d_name, strlen(e->d_name) + 1);
    shm_unlink(name);
  }
  closedir(d);
}

int dp__shm_map(dp_backend_t *b, const char *name, unsigned nslots, size_t slot_bytes, uint64_t token,
                dp__shm_t **out, dp_error_t *err) {
  *out = NULL;
  if (!name_ok(name)) return dp__err(err, DP_EFORMAT, "transport: a shared segment's name is malformed");
  if (!nslots || nslots > DP__SHM_MAX_SLOTS || !slot_bytes || slot_bytes > ((size_t)1 << 30))
    return dp__err(err, DP_EFORMAT, "transport: shared segment of %u slots of %zu bytes", nslots, slot_bytes);
  /* never blocks: a FIFO of that name (another user's) would hold the
     loop in open until a writer came */
  int fd = shm_open(name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) return sys_err(err, "shm_open", name);
  size_t len = HDR_BYTES + (size_t)nslots * slot_bytes;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return dp__err(err, DP_EFORMAT, "transport: shared segment %s is not a regular file", name);
  }
  if ((uint64_t)st.st_size != len) {
    close(fd);
    return dp__err(err, DP_EFORMAT, "transport: shared segment %s is not of the size its offer says", name);
  }
  /* only a peer of this user (who could touch this process anyway) may
     have this process map its file: one that could shrink it under a copy */
  if (st.st_uid != geteuid() || (st.st_mode & 077)) {
    close(fd);
    return dp__err(err, DP_EFORMAT, "transport: shared segment %s is not this user's alone", name);
  }
  void *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return sys_err(err, "mmap", name);
  shm_hdr_t h;
  memcpy(&h, p, sizeof h);
  if (h.magic != SHM_MAGIC || h.nslots != nslots || h.slot_bytes != slot_bytes || h.token != token) {
    munmap(p, len);
    return dp__err(err, DP_EFORMAT, "transport: shared segment %s is not the one offered", name);
  }
  dp__shm_t *s = dp__alloc(sizeof *s);
  if (!s) {
    munmap(p, len);
    return dp__err(err, DP_ENOMEM, "transport: out of memory");
  }
  memset(s, 0, sizeof *s);
  s->b = b;
  s->refs = 1;
  s->base = p;
  s->len = len;
  s->nslots = nslots;
  s->slot_bytes = slot_bytes;
  s->token = token;
  snprintf(s->name, sizeof s->name, "%s", name);
  int rc = b ? dp__pinned_register(b, s->base, s->len, 1, err) : 0;
  if (rc) {
    destroy(s);
    return rc;
  }
  s->registered = b != NULL;
  *out = s;
  return 0;
}

const char *dp__shm_name(const dp__shm_t *s) { return s->name; }
uint64_t dp__shm_token(const dp__shm_t *s) { return s->token; }
uint8_t *dp__shm_slot(const dp__shm_t *s, unsigned i) { return s->base + HDR_BYTES + (size_t)i * s->slot_bytes; }

void dp__shm_unlink(dp__shm_t *s) {
  if (s->linked) shm_unlink(s->name);
  s->linked = 0;
}

dp__shm_t *dp__shm_retain(dp__shm_t *s) {
  s->refs++;
  return s;
}

void dp__shm_release(dp__shm_t *s) {
  if (s && --s->refs == 0) destroy(s);
}
