"""CUDA semantics of devpickle.Future with torch (and cupy, jax where
installed): device work made slow on purpose (torch.cuda._sleep), and a
negative control for every wait. Skipped without a GPU."""
import pytest
import torch

import devpickle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

SPIN = 50_000_000  # cycles: tens of milliseconds on an H200


class Boxed:
    def __init__(self, t):
        self.payload = t


def slow_fill(t, value, stream):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        t.fill_(value)


def test_the_adapter_is_in_use_with_cuda():
    assert devpickle._devpickle._torch_adapter() == "c++"


def test_scan_finds_cuda_storages_with_their_device():
    t = torch.ones(1024, device="cuda")
    got = devpickle.scan({"a": [Boxed(t), t[10:]]})
    assert len(got) == 1
    assert got[0].device == "cuda:0" and got[0].ptr == t.untyped_storage().data_ptr()
    assert got[0].nbytes == t.untyped_storage().nbytes() and got[0].refs == 2 and got[0].path == "$.a[0].payload"


def test_a_cuda_event_in_a_value_holds_no_memory_and_is_stored_as_torchs_future_stores_it():
    t = torch.ones(16, device="cuda")
    ev = torch.cuda.Event()
    ev.record()
    got = devpickle.scan({"t": t, "ready": ev})
    assert [a.path for a in got] == ["$.t"]
    f = devpickle.Future(devices=["cuda:0"])
    f.set_result({"t": t, "ready": ev})
    assert f.wait()["ready"] is ev
    theirs = torch.futures.Future(devices=["cuda:0"])
    theirs.set_result({"t": t, "ready": ev})  # torch's extractor skips events too
    assert theirs.wait()["ready"] is ev
    with pytest.raises(devpickle.WalkError):
        devpickle.dumps([ev])


def consumer_reads(wait):
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    fut = devpickle.Future()
    with torch.cuda.stream(producer):
        slow_fill(t, 7.0, producer)
        fut.set_result(Boxed(t))  # event on the producer (current) stream
    with torch.cuda.stream(consumer):
        v = fut.wait() if wait else fut.value()
        out = v.payload.sum()  # queued on the consumer stream
    torch.cuda.synchronize()
    return out.item()


def test_a_consumer_that_waits_sees_the_producers_data():
    assert consumer_reads(True) == 7.0 * (1 << 20)


def test_negative_control_a_consumer_that_does_not_wait_reads_stale_data():
    assert consumer_reads(False) != 7.0 * (1 << 20)


def child_reads(wait_on_child):
    parent = devpickle.Future()
    made = {}

    def cb(fut):
        x = torch.zeros(1 << 20, device="cuda")  # on the callback's pool stream
        torch.cuda._sleep(SPIN)
        x.fill_(3.0)
        made["stream"] = torch.cuda.current_stream()
        return Boxed(x)

    child = parent.then(cb)
    parent.set_result(torch.ones(4, device="cuda"))
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        if wait_on_child:
            v = child.wait()
        else:
            parent.wait()
            v = child.value()
        out = v.payload.sum()
    torch.cuda.synchronize()
    assert made["stream"] != torch.cuda.default_stream(), "the callback ran on a pool stream"
    return out.item()


def test_the_consumer_of_a_then_child_sees_the_callbacks_kernel():
    assert child_reads(True) == 3.0 * (1 << 20)


def test_negative_control_the_parents_events_do_not_cover_the_callbacks_kernel():
    assert child_reads(False) != 3.0 * (1 << 20)


def reuse_corrupts(record):
    """A consumer stream reads a block slowly; the producer frees it and
    allocates again on its own stream. Recorded on the consumer's stream (what
    wait() does, through torch's allocator), the block is not reused."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    n = 1 << 22
    with torch.cuda.stream(producer):
        x = torch.full((n,), 5.0, device="cuda")
        fut = devpickle.Future()
        fut.set_result([x])
        ptr = x.data_ptr()
    with torch.cuda.stream(consumer):
        if record:
            v = fut.wait()[0]
        else:
            consumer.wait_stream(producer)  # ordered, but the allocator is not told
            v = fut.value()[0]
        torch.cuda._sleep(SPIN)
        total = v.sum()
    del v, x
    fut = None
    with torch.cuda.stream(producer):
        y = torch.empty(n, device="cuda")
        reused = y.data_ptr() == ptr
        y.fill_(-1.0)
    torch.cuda.synchronize()
    return reused, total.item()


def test_wait_records_torch_blocks_so_they_are_not_reused_under_the_consumer():
    reused, total = reuse_corrupts(True)
    assert not reused and total == 5.0 * (1 << 22)


def test_negative_control_without_the_record_the_block_is_reused():
    reused, _ = reuse_corrupts(False)
    assert reused


def test_devices_none_tracks_the_devices_found():
    fut = devpickle.Future()
    fut.set_result({"w": torch.ones(3, device="cuda")})
    assert fut._devices() == ["cuda:0"]
    cpu = devpickle.Future(devices=[])
    cpu.set_result({"w": torch.ones(3, device="cuda")})
    assert cpu._devices() == []


def test_a_value_on_a_device_not_listed_is_refused():
    fut = devpickle.Future(devices=["cpu"])
    fut.set_result(torch.ones(1))  # cpu memory needs no stream
    if torch.cuda.device_count() > 1:
        f2 = devpickle.Future(devices=["cuda:0"])
        with pytest.raises(ValueError, match="cuda:1"):
            f2.set_result(torch.ones(1, device="cuda:1"))


def test_dumps_inline_reads_device_memory_after_the_current_streams_work():
    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        slow_fill(t, 2.0, s)
        frame = devpickle.dumps({"t": t}, inline=True)
    out = devpickle.loads(frame)
    assert out["t"].device.type == "cuda" and out["t"].sum().item() == 2.0 * (1 << 20)


def test_out_of_band_cuda_buffers_come_back_over_the_tensors_given():
    t = torch.arange(16, dtype=torch.float32, device="cuda")
    bufs = []
    frame = devpickle.dumps({"t": t, "v": t[4:8]}, buffer_callback=bufs.append)
    assert [b.device for b in bufs] == ["cuda:0"]
    raw = [b.raw() for b in bufs]
    out = devpickle.loads(frame, buffers=raw)
    assert torch.equal(out["v"], t[4:8]) and out["t"].data_ptr() == t.data_ptr()


def test_cuda_tensors_over_the_buffers_dumps_gave_are_the_views_over_the_same_storage():
    # given back as Buffers, the adapter makes them over the storage itself;
    # the general path (raw() given) makes the same tensors
    t = torch.arange(24, dtype=torch.float32, device="cuda")
    bufs = []
    frame = devpickle.dumps([t, t[4:12].view(2, 4).t(), t.view(torch.int32)[1:]], buffer_callback=bufs.append)
    fast = devpickle.loads(frame, buffers=bufs)
    general = devpickle.loads(frame, buffers=[b.raw() for b in bufs])
    for a, b, want in zip(fast, general, [t, t[4:12].view(2, 4).t(), t.view(torch.int32)[1:]]):
        assert a.device == want.device and a.dtype == want.dtype and a.shape == want.shape
        assert a.stride() == b.stride() == want.stride() and a.storage_offset() == b.storage_offset()
        assert a.data_ptr() == b.data_ptr() == want.data_ptr() and torch.equal(a, want)
    fast[0][5] = -1.0  # the same memory
    assert t[5].item() == -1.0


SPIN_SRC = r"""
extern "C" __global__ void spin(float *x, long long cycles, float v) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
  x[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
"""


def cupy_consumer_reads(wait):
    cupy = pytest.importorskip("cupy")
    spin = cupy.RawKernel(SPIN_SRC, "spin")
    n = 1 << 20
    prod, cons = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    fut = devpickle.Future()
    with prod:
        spin((n // 256,), (256,), (x, cupy.int64(20_000_000), cupy.float32(4.0)))
        fut.set_result({"x": x})  # the event goes on cupy's current stream
    with cons:
        v = fut.wait() if wait else fut.value()
        total = v["x"].sum()
    cupy.cuda.Device().synchronize()
    return float(total)


def test_a_cupy_consumer_that_waits_sees_the_producers_data():
    assert cupy_consumer_reads(True) == 4.0 * (1 << 20)


def test_negative_control_a_cupy_consumer_that_does_not_wait_reads_stale_data():
    assert cupy_consumer_reads(False) != 4.0 * (1 << 20)


def test_cupy_and_jax_arrays_are_found():
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(100, dtype=cupy.float32)
    got = devpickle.scan({"a": a, "v": a[10:]})
    assert len(got) == 1 and got[0].device == "cuda:0" and got[0].ptr == a.data.mem.ptr
    jnp = pytest.importorskip("jax.numpy")
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU here")
    j = jnp.ones(256, dtype=jnp.float32)
    got = devpickle.scan([j])
    assert len(got) == 1 and got[0].device.startswith("cuda:") and got[0].nbytes == 1024


def test_a_cupy_buffers_raw_is_its_allocation_and_one_naming_other_memory_is_refused():
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(64, dtype=cupy.uint8)
    bufs = []
    devpickle.dumps({"v": a[8:]}, buffer_callback=bufs.append)
    (b,) = bufs
    assert (b.ptr, b.nbytes) == (a.data.mem.ptr, a.data.mem.size)
    assert int(b.raw()[8]) == 8 and b.raw().nbytes == b.nbytes
    for ptr, nbytes in ((b.ptr, b.nbytes + 1), (b.ptr + 8, 8), (b.ptr, 1 << 40)):
        with pytest.raises(ValueError, match="its memory moved since dumps found it"):
            devpickle.Buffer(b.device, ptr, nbytes, a).raw()


def test_dumps_inline_of_cuda_and_cpu_memory_rechecks_cpu_memory_another_thread_freed_during_the_device_copy():
    """The device copy waits without the GIL; a thread that frees a numpy
    array meanwhile makes dumps refuse it, never read its freed memory."""
    import threading
    import time

    import numpy as np

    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    a = np.ones(1 << 22, dtype=np.uint8)
    torch.cuda.synchronize()

    def shrink():
        time.sleep(0.005)  # the walk is over: dumps waits on the slow fill
        a.resize(16, refcheck=False)

    th = threading.Thread(target=shrink)
    with torch.cuda.stream(s):
        slow_fill(t, 2.0, s)
        torch.cuda._sleep(SPIN * 10)
        th.start()
        with pytest.raises(devpickle.WalkError, match="memory moved") as e:
            devpickle.dumps({"t": t, "a": a}, inline=True)
    th.join()
    assert e.value.path == "$.a"
