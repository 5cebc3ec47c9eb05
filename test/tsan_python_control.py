"""The racy control of make test-python-tsan: two threads write the same
bytes through ctypes, which lets go of the GIL around a foreign call, with
nothing ordering them. ThreadSanitizer must report it, or the run is blind."""
import ctypes
import threading

buf = ctypes.create_string_buffer(64)
libc = ctypes.CDLL(None)
go = threading.Barrier(2)


def writer(byte):
    src = ctypes.create_string_buffer(bytes([byte]) * 64)
    go.wait()
    for _ in range(2000):
        libc.memcpy(buf, src, 64)


threads = [threading.Thread(target=writer, args=(b,)) for b in (1, 2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("control ran")
