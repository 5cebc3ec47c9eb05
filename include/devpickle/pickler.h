/*
 * devpickle/pickler.h — scan, pickle and unpickle.
 *
 * One walker reduces every value to its parts: containers are entered,
 * tensors report their storage, customs are reduced through their type's
 * reduce() and their state is walked. Shared nodes and cycles are visited
 * once (a memo). The walker is iterative: depth is bounded by a limit, never
 * by the C stack.
 *
 * Thread safety: a dp_ptrset_t or dp_frame_t is used by one thread at a time;
 * different threads may walk the same value at once (the value must not be
 * mutated meanwhile). Customs' reduce functions may then run concurrently.
 */
#ifndef DEVPICKLE_PICKLER_H
#define DEVPICKLE_PICKLER_H

#include "ptrset.h"
#include "value.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- limits (a field of 0 means its default) ----
 * Depth is counted alike by every walk (scan, pickle) and by the reader:
 * the number of nested containers that have children — list, tuple, dict,
 * object with attributes, and every custom or reduce node (its state is its
 * child). An empty container, a leaf or a back-reference adds no level. So
 * whatever dp_pickle writes under a depth limit, dp_unpickle reads under the
 * same limit. */
#define DP_DEFAULT_MAX_DEPTH 262144u                 /* nesting levels */
#define DP_MAX_NESTED_WALKS 64u                      /* scans and pickles running inside one another's reduce() on
                                                        one thread; the innermost past it is DP_ELIMIT */
#define DP_MAX_NESTED_UNPICKLES 64u                  /* reads (dp_unpickle, dp_unpickle_stream, dp_frame_value_check)
                                                        running inside one another's bind or resolve callbacks on
                                                        one thread: frames nested in frames, as deep as the input
                                                        says; the innermost past it is DP_ELIMIT at offset 0 */
/* The other defaults are the format's own: memory is bounded by the input
 * (below) whatever they are, and the reader reads every frame the writer
 * writes. Set them to refuse large frames outright. */
#define DP_DEFAULT_MAX_ITEMS UINT64_MAX               /* values in one frame */
#define DP_DEFAULT_MAX_BYTES UINT64_MAX               /* str + bytes + names + inline data */
#define DP_DEFAULT_MAX_STR 0xffffffffull              /* one str, bytes or name (class, attribute,
                                                         reduce type): 32-bit lengths */
#define DP_DEFAULT_MAX_BUFFERS UINT32_MAX             /* buffer descriptors */

/* Memory, the reader's bound. dp_unpickle of an n-byte frame holds at most
 *   DP_UNPICKLE_MEMORY_PER_BYTE * n + DP_UNPICKLE_MEMORY_FIXED
 * bytes through the allocator hook at any moment, with the default limits
 * or any others, counting each block as malloc holds it (an 8-byte header,
 * 16-byte granules, at least 32); what bind and resolve callbacks allocate
 * is theirs. Beside the bound, a resolver's allow-list of more than 16
 * names (and fewer than 2^30 - 1, what the index's 32-bit slots count;
 * a longer one, 8 GB of pointers, is scanned) is indexed when the first
 * reduce node is read (at most 16 bytes a
 * name, and 32 more; DP_ENOMEM when that memory cannot be had), so that
 * each reduce node costs one lookup whatever the list's length. The worst
 * input is one byte per nesting level ([[[...]]]: a list, its node-table
 * entry and its open frame for every byte); 1 MB of empty dicts holds
 * 128 MB. dp_frame_check allocates nothing. */
#define DP_UNPICKLE_MEMORY_PER_BYTE 192u
#define DP_UNPICKLE_MEMORY_FIXED (64u << 10)

typedef struct dp_limits {
  uint32_t max_depth;
  uint32_t max_buffers;
  uint64_t max_items;
  uint64_t max_bytes;
  uint64_t max_str;
} dp_limits_t;

/* ---- scan ---- */
#define DP_SCAN_PATHS 1u   /* record each storage's first path in the set */

typedef struct dp_scan_opts {
  uint32_t flags;       /* DP_SCAN_* */
  uint32_t max_depth;   /* 0: DP_DEFAULT_MAX_DEPTH */
} dp_scan_opts_t;

/** Walks v and adds every storage it references to set (which is not
 *  cleared first). opts may be NULL. Errors: DP_ETYPE (a custom without
 *  reduce, or whose reduce failed other than with DP_ENOMEM: the message names
 *  the type and the path),
 *  DP_ELIMIT (nesting deeper than max_depth), DP_ENOMEM; DP_EINVAL for a
 *  NULL set or a flag other than DP_SCAN_PATHS (nothing is walked: a flag
 *  this version does not know is never silently ignored); DP_ESTATE when a
 *  scan into set has not returned yet (a reduce() that scans into the set
 *  its own scan fills: that scan goes on unharmed). The set belongs to the
 *  scan until it returns: a reduce() must not clear, free or add to it,
 *  and what it reads of it meanwhile (count, get, find) may lack storages
 *  met before its custom — a scan without DP_SCAN_PATHS looks tensors up
 *  in batches, so that their cache misses overlap; the set is whole when
 *  the scan returns. Walks
 *  started inside reduce() callbacks nest at most DP_MAX_NESTED_WALKS deep
 *  on a thread (DP_ELIMIT past it). On error the set holds what was found
 *  before it. */
DP_API int dp_scan(dp_value_t v, const dp_scan_opts_t *opts, dp_ptrset_t *set, dp_error_t *err);

/* ---- frames ---- */
typedef struct dp_frame dp_frame_t;

/** A buffer descriptor: one storage a frame refers to. `base` is the
 *  sender's address, for diagnostics only. `data` is the inline copy
 *  (NULL unless the frame is inline). */
typedef struct dp_buffer_desc {
  uint32_t id;
  dp_device_t device;
  uint64_t nbytes;
  uint64_t base;
  const void *data;
} dp_buffer_desc_t;

/** Copies nbytes of device memory at src to host memory at dst. */
typedef int (*dp_read_cb)(void *ud, dp_device_t device, const void *src, size_t nbytes, void *dst,
                          dp_error_t *err);

#define DP_PICKLE_INLINE 1u   /* copy buffer bytes into the frame (a value without buffers: no flag, FORMAT.md) */

typedef struct dp_pickle_opts {
  uint32_t flags;       /* DP_PICKLE_* */
  uint32_t max_depth;   /* 0: DP_DEFAULT_MAX_DEPTH */
  /** Reads device memory for DP_PICKLE_INLINE. Storages carrying host data
   *  (dp_storage_set_host_data) use it, read given or not; read is called
   *  for the others, cpu ones included. NULL: cpu storages are read
   *  directly (one at a NULL base, with bytes, is DP_ENODEV); any other
   *  without host data is DP_ENODEV. dp_device_read (device.h) reads
   *  device memory through its backend, ordered after the current stream's
   *  work. A storage dp_unpickle made for a buffer without a bind callback
   *  holds the sender's address, which is never read through: its host
   *  data is used (an inline frame's bytes), and without any it is
   *  DP_ENODEV, read or not. */
  dp_read_cb read;
  void *read_ud;
} dp_pickle_opts_t;

/** A reusable output frame. */
DP_API int dp_frame_new(dp_frame_t **out, dp_error_t *err);
/** Frees the frame (NULL is fine). */
DP_API void dp_frame_free(dp_frame_t *f);
/** The frame's bytes (borrowed; valid until the next pickle or free) and
 *  their number in *len (may be NULL); NULL and 0 for an empty frame (new,
 *  or left empty by a failed pickle). While a pickle into the frame has
 *  not returned (read from its own reduce() or read callback), the frame is
 *  half written and reads as empty: NULL and 0, no buffers, and
 *  dp_frame_buffer is DP_ESTATE. */
DP_API const uint8_t *dp_frame_data(const dp_frame_t *f, size_t *len);
/** Number of buffer descriptors in the frame's table (0 before a pickle). */
DP_API size_t dp_frame_nbuffers(const dp_frame_t *f);
/** Buffer i's descriptor. DP_EINVAL when out of range (an empty frame has
 *  none); DP_ESTATE while a pickle into the frame has not returned. */
DP_API int dp_frame_buffer(const dp_frame_t *f, size_t i, dp_buffer_desc_t *out, dp_error_t *err);

/** Serializes v into frame (replacing its contents). The same value always
 *  gives the same bytes, and dp_unpickle reads them back (with the same
 *  max_depth): what the format cannot carry is an error, never a frame the
 *  reader refuses. Errors as dp_scan (a flag other than DP_PICKLE_INLINE is
 *  DP_EINVAL, nothing written), plus DP_ENODEV when an inline buffer
 *  cannot be read; DP_EINVAL when two storages at one (device, base) — one
 *  buffer in the frame — differ in size or, in an inline frame, in their
 *  host bytes (or only one has host bytes); DP_ELIMIT for a storage over
 *  2^62 bytes, a str, bytes, name (class, attribute, reduce type), list
 *  or dict longer than 2^32 - 1 (a tuple:
 *  2^32 - 2, an object: 2^31 - 2 attributes — MessagePack's 32-bit counts
 *  hold a tuple's tag and an object's class and attribute names too), or a
 *  value of more than 2^32 - 2 heap nodes (32-bit back-references). Messages name the path, running
 *  out of memory during the walk included ("out of memory ... at $.a[3]") — except those of
 *  what is done after the walk: the count of heap nodes, memory for the buffer table and the
 *  inline data, and an inline buffer's read: DP_ENODEV names the buffer by its
 *  size and device, and a read callback's failure is its own code and message (base.h's
 *  "the read callback failed: ..." when it wrote none). On error the frame
 *  is empty. DP_ESTATE, changing nothing, when a pickle into frame has not
 *  returned yet (a reduce() or read callback that pickles into the frame
 *  its own pickle writes: that pickle goes on unharmed). The frame belongs
 *  to the pickle until it returns: a callback must not free it. */
DP_API int dp_pickle(dp_value_t v, const dp_pickle_opts_t *opts, dp_frame_t *frame, dp_error_t *err);

/* ---- unpickle ---- */

/** Binds buffer `desc` to a local storage (*out, a new reference) of at
 *  least desc->nbytes bytes, on any device; no storage, or a smaller one, is
 *  DP_EINVAL. A larger one changes nothing the reader checks: tensors are
 *  bounded by desc->nbytes (FORMAT.md), whatever storage is bound. On
 *  failure, what the callback left in *out is released by the library, and
 *  err->offset is that of the buffer's descriptor. */
typedef int (*dp_bind_cb)(void *ud, const dp_buffer_desc_t *desc, dp_storage_t **out, dp_error_t *err);

/** Rebuilds an allowed custom from its state. The state is borrowed and must
 *  not be modified: retain what the custom keeps. The state stays alive
 *  until dp_unpickle returns (later back-references may name any node in
 *  it), whatever the custom keeps. A state that refers to its own reduce
 *  node or to a container around it (the custom would be in a cycle, which
 *  the collector cannot see through) is DP_EFORMAT without calling this.
 *  Returns 0 and a new reference in *out (usually dp_custom_new; dp_none()
 *  is a value too — returning 0 without setting *out is DP_EINVAL), or an
 *  error (what it left in *out is then released by the library). */
typedef int (*dp_resolve_cb)(void *ud, const char *type_name, dp_value_t state, dp_value_t *out,
                             dp_error_t *err);

typedef struct dp_resolver {
  const char *const *types;   /* allow-list of type names (NULL only with ntypes 0; NULL entries
                                 match nothing); a long one costs one lookup a reduce node (see the
                                 memory bound above) */
  size_t ntypes;
  dp_resolve_cb resolve;      /* required: a resolver without it is DP_EINVAL */
  void *ud;
} dp_resolver_t;

typedef struct dp_unpickle_opts {
  dp_limits_t limits;               /* zero fields: defaults */
  const dp_resolver_t *resolver;    /* NULL: customs come back as generic objects */
  /** NULL: each buffer becomes a storage on the sender's device whose base is
   *  the sender's address (never dereferenced), carrying the inline bytes
   *  as host data when the frame has them. */
  dp_bind_cb bind;
  void *bind_ud;
} dp_unpickle_opts_t;

/** Rebuilds a value from a frame. The input is treated as hostile: every
 *  failure is an error code with a message and err->offset, the byte offset
 *  in the frame where reading stopped; nothing leaks; memory stays within
 *  the bound stated with DP_UNPICKLE_MEMORY_PER_BYTE. Types are never
 *  instantiated from the wire except through opts->resolver. Errors:
 *  DP_ETRUNC, DP_ECHECKSUM, DP_EVERSION, DP_EFORMAT, DP_ELIMIT, DP_ENOMEM,
 *  or a bind/resolve error. Reads started inside bind or resolve callbacks
 *  (a resolver reading a frame its state holds) nest at most
 *  DP_MAX_NESTED_UNPICKLES deep on a thread (DP_ELIMIT past it). */
DP_API int dp_unpickle(const void *bytes, size_t n, const dp_unpickle_opts_t *opts, dp_value_t *out,
                       dp_error_t *err);

/** Header facts of a frame, after checking its length and checksum. */
typedef struct dp_frame_info {
  uint16_t version;
  uint16_t flags;
  uint64_t payload_len;
  uint64_t table_len;
  uint64_t data_len;
  uint64_t checksum;
  uint32_t nbuffers;
} dp_frame_info_t;

/** Validates the header, lengths and checksum and counts the buffers;
 *  *info (may be NULL) is written on success only. Allocates nothing.
 *  The magic is checked first, then the version, as soon as its two bytes
 *  are in: a frame of another version (whose layout may differ) is
 *  DP_EVERSION at 4, "unsupported version N: ...", whatever follows it —
 *  a header cut short, lengths, checksum. dp_unpickle and
 *  dp_unpickle_stream check in the same order. */
DP_API int dp_frame_check(const void *bytes, size_t n, dp_frame_info_t *info, dp_error_t *err);

/** Checks the first n bytes of a frame still arriving, for readers that
 *  gather a frame from a stream: the magic; the version once its two
 *  bytes are in; once the header is in, its
 *  lengths (as dp_frame_check checks them), flags and a data
 *  section without the inline flag (as dp_frame_check checks them after
 *  the checksum); the framing of the payload and buffer table bytes in so
 *  far — each is one MessagePack value filling its section exactly, so a
 *  byte that is no MessagePack type, a length or count running past the
 *  section, more values owed than bytes left, or bytes after the value are
 *  refused; and once the whole table is in, its descriptors as the reader
 *  checks them (fields, device, size, the inline layout, which must fill
 *  the data section the header announces), then that the payload is not
 *  empty (an empty section holds no value). 0 while the bytes can still
 *  begin a frame: the checksum, the value itself and what is left of the
 *  table's checks (a limit, an allocation described twice) are checked
 *  once the frame is whole (dp_frame_check, dp_unpickle), and may still
 *  refuse it. Otherwise DP_EFORMAT (DP_EVERSION for a version this build
 *  does not read, DP_EINVAL for NULL bytes with n > 0) and err->offset the
 *  offending byte's (a bad magic's: 0, the magic's own, as every reader
 *  says it). Whatever it refuses, dp_unpickle refuses too (its
 *  error may name another fault, or the checksum, first). So garbage
 *  behind a long header (`cat header /dev/zero`) is refused as it comes,
 *  not held to the header's end: dp_unpickle_stream checks so at 64 KiB of
 *  payload and table held and at each doubling (twice their reading at
 *  most), and once more, the payload and table whole, when 64 KiB of data
 *  are in and more are announced. Allocates nothing; time linear in n;
 *  thread-safe. */
DP_API int dp_frame_prefix_check(const void *bytes, size_t n, dp_error_t *err);

/** dp_frame_prefix_check, then, once the header, payload and buffer table
 *  are all in (n >= 40 + payload_len + table_len), the value: they are
 *  read as dp_unpickle reads them under opts' limits — everything but the
 *  checksum and the data bytes, which need the frame whole — and the value
 *  is dropped. So a frame that those bytes alone make no frame's (a value
 *  the reader refuses, a buffer no tensor uses, a limit passed) is refused
 *  before the rest of a long data section is read. No callback runs:
 *  nothing is bound (opts->bind is not called; what it would refuse is
 *  refused once the frame is whole), and with opts->resolver set the value
 *  is not read (0 after the prefix check), since a resolver may make of a
 *  reduce node what a generic object cannot be (a dict key); a resolver
 *  dp_unpickle refuses as an argument (a NULL resolve, NULL types with
 *  ntypes) is DP_EINVAL here too. opts may be
 *  NULL (the default limits). Whatever it refuses, dp_unpickle with the
 *  same opts refuses too (its error may name another fault, or the
 *  checksum, first). Memory as dp_unpickle of the header, payload and
 *  table (DP_UNPICKLE_MEMORY_PER_BYTE), time linear in n; thread-safe.
 *  dp_unpickle_stream runs it once 64 KiB of a longer data section are in;
 *  the CLI's commands that read a frame whole (unpack, send), once the
 *  header, payload and table are in. */
DP_API int dp_frame_value_check(const void *bytes, size_t n, const dp_unpickle_opts_t *opts, dp_error_t *err);

/** Reads up to n bytes into dst: 0 and *got (at most n; 0 only at the end
 *  of the stream), or a DP_E* code (DP_EIO) with err filled in. A *got
 *  above n is DP_EINVAL, never a write past dst or a hash of it. */
typedef int (*dp_stream_read_cb)(void *ud, void *dst, size_t n, size_t *got, dp_error_t *err);

/** Reads a frame from a stream and rebuilds its value as dp_unpickle does,
 *  with the same checks, limits and errors (offsets count from the start of
 *  the stream) but one: a header, payload and table bytes that
 *  dp_frame_prefix_check refuses are refused as they arrive, from 64 KiB
 *  of payload and table on, with its error, before the checksum at the
 *  frame's end can be compared (dp_unpickle may name the checksum first) —
 *  and so is a frame whose header, payload or table dp_frame_value_check
 *  refuses (with opts) once 64 KiB of a longer data section are in (a data
 *  section no frame with that header, payload and table can have is not
 *  hashed to its end).
 *  It holds in memory only the header, payload and buffer table:
 *  an inline frame's data section is hashed and its layout checked as it
 *  streams by, then dropped. So checking a frame costs memory independent
 *  of its data section. The price: inline storages come back WITHOUT host
 *  data (dp_storage_host_data is NULL) and a bind callback sees desc->data
 *  NULL; use dp_unpickle when the bytes are wanted.
 *  On success *out is a new reference, *info (may be NULL) the frame's
 *  header facts and *size (may be NULL) its length. read is called from this
 *  thread only; the call is thread-safe as dp_unpickle is. The stream holds
 *  one frame: it is read to its end, and bytes after the frame are
 *  DP_EFORMAT ("N bytes after the end of the frame"), at the frame's end;
 *  past 65,536 of them it stops reading ("more than 65536 bytes after the
 *  end of the frame"), so a stream that never ends behind a frame does not
 *  hold the call. Errors: those of dp_unpickle, and read's. */
DP_API int dp_unpickle_stream(dp_stream_read_cb read, void *ud, const dp_unpickle_opts_t *opts, dp_value_t *out,
                              dp_frame_info_t *info, uint64_t *size, dp_error_t *err);

#ifdef __cplusplus
}
#endif
#endif
