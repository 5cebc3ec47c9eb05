"""The racy control of make test-python-tsan: two threads write the same
bytes through ctypes with nothing ordering them. ThreadSanitizer must report
it, or the run is blind.

The threads are started by pthread_create itself, each running libc's
time() on the buffer (a write the sanitizer's interceptor records), so that
nothing but their creation orders them and the report does not depend on
timing. Two Python threads each calling memcpy through ctypes were missed
about once in ten runs on a loaded machine: every GIL handoff orders what
came before it, so one thread running its whole loop before the other took
the GIL left no race to see."""
import ctypes

buf = ctypes.create_string_buffer(64)
libc = ctypes.CDLL(None)
write_time = ctypes.cast(libc.time, ctypes.c_void_p)  # time(buf): writes 8 bytes at buf
threads = [ctypes.c_ulong() for _ in range(2)]
for t in threads:
    assert libc.pthread_create(ctypes.byref(t), None, write_time, buf) == 0
for t in threads:
    assert libc.pthread_join(t, None) == 0
print("control ran")
