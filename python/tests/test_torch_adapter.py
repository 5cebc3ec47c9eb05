"""The torch adapter devpickle._torch, called through its C table (the
capsule devpickle._torch._api, torch_api.h) with ctypes, as the extension
calls it.

Skipped when the adapter was not built (no torch headers); set
DEVPICKLE_REQUIRE_TORCH_ADAPTER=1 to make that a failure.
"""
import ctypes
import os

import pytest

torch = pytest.importorskip("torch")
if os.environ.get("DEVPICKLE_REQUIRE_TORCH_ADAPTER") == "1":
    import devpickle._torch as adapter
else:
    adapter = pytest.importorskip("devpickle._torch")

API_VERSION = 4
CAPSULE = b"devpickle._torch._api"
MAX_ALLOCS = 4
CPU, CUDA = 0, 1


class Alloc(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_index", ctypes.c_int),
                ("base", ctypes.c_void_p), ("nbytes", ctypes.c_size_t), ("borrowed", ctypes.c_int)]


class Api(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("has_cuda", ctypes.c_int),
                ("tensor_allocs", ctypes.c_void_p),
                ("current_stream", ctypes.c_void_p),
                ("set_current_stream", ctypes.c_void_p),
                ("pool_stream", ctypes.c_void_p),
                ("record_stream", ctypes.c_void_p),
                ("dense_run", ctypes.c_void_p),
                ("tensor_over", ctypes.c_void_p)]


def _table():
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return Api.from_address(get(adapter._api, CAPSULE))


API = _table()
# PYFUNCTYPE: called with the GIL held, as the contract says; a -1 with a
# Python exception set comes back as that exception.
_tensor_allocs = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object,
                                   ctypes.POINTER(Alloc))(API.tensor_allocs)
_dense_run = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.POINTER(ctypes.py_object), ctypes.c_ssize_t,
                               ctypes.POINTER(Alloc))(API.dense_run)
# a new reference or NULL (declined, or an exception set): c_void_p, read below
_tensor_over = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_size_t, ctypes.c_size_t, ctypes.py_object,
                                 ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                                 ctypes.c_int64)(API.tensor_over)


def allocs(obj):
    """(count, [(device_type, device_index, base, nbytes), ...])."""
    out = (Alloc * MAX_ALLOCS)()
    for a in out:  # a sentinel, to see what was written
        a.device_type, a.device_index, a.base, a.nbytes = -7, -7, 0x7777, 7777
    n = _tensor_allocs(obj, out)
    return n, [(a.device_type, a.device_index, a.base or 0, a.nbytes) for a in out[:max(n, 0)]]


def test_cpu_memory_torch_did_not_allocate_is_borrowed_and_its_own_is_not():
    """What dumps(inline=True) copies when the walk meets it (docs/PYTHON.md)."""
    np = pytest.importorskip("numpy")
    out = (Alloc * MAX_ALLOCS)()

    def borrowed(t):
        assert _tensor_allocs(t, out) == 1
        return out[0].borrowed

    assert borrowed(torch.from_numpy(np.ones(4))) == 1
    assert borrowed(torch.from_numpy(np.ones(4))[1:].t()) == 1  # a view: its storage's
    assert borrowed(torch.frombuffer(bytearray(8), dtype=torch.uint8)) == 1
    assert borrowed(torch.ones(4)) == 0 and borrowed(torch.ones(4)[2:]) == 0
    assert borrowed(torch.ones(0)) == 0  # no memory to borrow


def storage(t):
    """(base, nbytes) of t's storage, through torch's Python API."""
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr(), s.nbytes()


def test_capsule_publishes_version_4_of_the_table():
    assert API.version == API_VERSION
    assert API.tensor_allocs and API.dense_run and API.tensor_over
    cuda_fns = [API.current_stream, API.set_current_stream, API.pool_stream, API.record_stream]
    if API.has_cuda:
        assert all(cuda_fns)
        assert torch.version.cuda is not None
    else:
        assert not any(cuda_fns)
    assert adapter.has_cuda == API.has_cuda


def dense_run(objs):
    """(count read, [(device_type, device_index, base, nbytes), ...] of those)."""
    items = (ctypes.py_object * max(len(objs), 1))(*objs)
    out = (Alloc * max(len(objs), 1))()
    n = _dense_run(items, len(objs), out)
    return n, [(a.device_type, a.device_index, a.base or 0, a.nbytes) for a in out[:n]]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_a_run_of_dense_tensors_reads_each_as_tensor_allocs_does_and_stops_at_the_first_other():
    class Sub(torch.Tensor):
        pass

    base = torch.randn(10, 10)
    dense = [base, base[2:], base.T, torch.empty(0), torch.ones(3, dtype=torch.int8),
             torch.ones(2).as_subclass(Sub), torch.nn.Parameter(torch.ones(2))]
    assert dense_run(dense) == (len(dense), [allocs(t)[1][0] for t in dense])
    assert dense_run([]) == (0, [])
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))
    meta = torch.empty(3, device="meta")
    calls = []

    class Wrapper(torch.Tensor):  # dispatched to Python: its layout, its storage may be Python's answer
        @staticmethod
        def __new__(cls, size):
            return torch.Tensor._make_wrapper_subclass(cls, size)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            raise NotImplementedError(func)

    class LayoutWrapper(Wrapper):  # torch 2: even its layout is asked of Python
        @staticmethod
        def __new__(cls, size):
            return torch.Tensor._make_wrapper_subclass(cls, size, dispatch_layout=True)

    stops = [sparse, meta, torch.ones(2, 2).to_sparse_csr(), Wrapper((2,))]
    try:
        stops.append(LayoutWrapper((2,)))
    except TypeError:  # torch 1.13: no dispatch_layout
        pass
    for stop in stops:
        for at in (0, 1, 4):
            run = dense[:at] + [stop] + dense[:3]
            assert dense_run(run) == (at, [allocs(t)[1][0] for t in dense[:at]])
    assert calls == []  # no Python code ran
    # the item it stopped at is tensor_allocs' to read or report
    with pytest.raises(TypeError, match="meta device"):
        allocs(meta)


def test_a_per_channel_quantized_tensor_gives_its_storage_then_its_scales_and_zero_points():
    x = torch.randn(4, 3)
    q = torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.double),
                                   torch.tensor([0, 1, 2, 3]), 0, torch.qint8)
    want = [(CPU, 0) + storage(t) for t in (q, q.q_per_channel_scales(), q.q_per_channel_zero_points())]
    assert allocs(q) == (3, want)
    assert allocs(q[2:]) == (3, want)  # a view shares its quantizer
    p = torch.quantize_per_tensor(x, 0.1, 2, torch.quint8)  # per tensor: numbers, no tensors
    assert allocs(p) == (1, [(CPU, 0) + storage(p)])
    # a run stops at either: tensor_allocs reads them on their own
    d = torch.ones(2)
    assert dense_run([d, q, d]) == (1, [allocs(d)[1][0]])
    assert dense_run([d, d, p]) == (2, [allocs(d)[1][0]] * 2)


def test_dense_tensor_gives_its_storage():
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    n, a = allocs(t)
    assert n == 1
    assert a[0] == (CPU, 0) + storage(t)
    assert a[0][2] == t.data_ptr() and a[0][3] == 96


@pytest.mark.parametrize("view", [
    lambda t: t[1:],
    lambda t: t.T,
    lambda t: t[::3, 2],
    lambda t: t.view(-1)[7:9],
    lambda t: t.view(torch.int32),
    lambda t: t.expand(2, 10, 10),
])
def test_views_of_one_storage_give_the_same_allocation(view):
    t = torch.randn(10, 10)
    v = view(t)
    assert v.data_ptr() != t.data_ptr() or v.shape != t.shape or v.dtype != t.dtype \
        or v.stride() != t.stride()
    assert allocs(v) == allocs(t) == (1, [(CPU, 0) + storage(t)])


def test_empty_tensor_gives_an_empty_storage():
    for t in (torch.empty(0), torch.zeros(3)[3:], torch.empty(0, 5, dtype=torch.int64)):
        n, a = allocs(t)
        assert n == 1
        base, nbytes = storage(t)
        assert a == [(CPU, 0, base, nbytes)]
    assert allocs(torch.empty(0))[1][0][3] == 0


def test_tensor_subclasses_and_parameters_are_tensors():
    class Mine(torch.Tensor):
        pass

    base = torch.randn(5)
    for t in (torch.nn.Parameter(base), base.as_subclass(Mine),
              torch.nn.Parameter(base).as_subclass(Mine)):
        assert allocs(t) == (1, [(CPU, 0) + storage(base)])


def test_sparse_coo_gives_indices_and_values_without_coalescing():
    i = torch.tensor([[0, 1, 1, 0], [2, 0, 0, 2]])
    v = torch.tensor([3.0, 4.0, 5.0, 6.0])
    s = torch.sparse_coo_tensor(i, v, (2, 3))
    assert not s.is_coalesced()
    n, a = allocs(s)
    assert n == 2
    assert a[0] == (CPU, 0) + storage(s._indices())
    assert a[1] == (CPU, 0) + storage(s._values())
    assert a[0][3] == 8 * 8 and a[1][3] == 4 * 4
    assert not s.is_coalesced()
    c = s.coalesce()
    n, a = allocs(c)
    assert n == 2 and a == [(CPU, 0) + storage(c._indices()), (CPU, 0) + storage(c._values())]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_sparse_compressed_gives_its_index_tensors_and_values(layout):
    d = torch.tensor([[1.0, 0, 0, 2], [0, 0, 3, 0], [0, 0, 0, 0], [4, 0, 0, 5]])
    make = {"csr": lambda: d.to_sparse_csr(),
            "csc": lambda: d.to_sparse_csc(),
            "bsr": lambda: d.to_sparse_bsr((2, 2)),
            "bsc": lambda: d.to_sparse_bsc((2, 2))}[layout]
    try:
        s = make()
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        pytest.skip("this torch cannot make a %s tensor: %s" % (layout, e))
    if layout in ("csr", "bsr"):
        parts = [s.crow_indices(), s.col_indices(), s.values()]
    else:
        parts = [s.ccol_indices(), s.row_indices(), s.values()]
    assert allocs(s) == (3, [(CPU, 0) + storage(p) for p in parts])


class ClaimsToBeATensor:
    """isinstance() says yes (it goes by __class__); its memory is not a
    THPVariable, so the adapter must say no."""

    @property
    def __class__(self):
        return torch.Tensor


@pytest.mark.parametrize("obj", [None, 1, 2.5, "t", b"t", [torch.ones(1)], (torch.ones(1),),
                                 {"t": torch.ones(1)}, torch.float32, torch.device("cpu"),
                                 torch.Tensor, ClaimsToBeATensor()])
def test_non_tensors_give_nothing(obj):
    assert allocs(obj) == (0, [])


def test_an_object_claiming_the_tensor_class_is_not_read():
    obj = ClaimsToBeATensor()
    assert isinstance(obj, torch.Tensor)
    assert allocs(obj) == (0, [])


def test_numpy_array_is_not_a_tensor():
    np = pytest.importorskip("numpy")
    assert allocs(np.zeros(3)) == (0, [])


def test_meta_tensor_raises_a_type_error_naming_the_device():
    t = torch.empty(3, 4, device="meta")
    with pytest.raises(TypeError, match=r"layout torch\.strided, device meta\): its storage is on the meta "
                                         r"device \(a meta or fake tensor has no memory\)"):
        _tensor_allocs(t, (Alloc * MAX_ALLOCS)())


class Wrapper(torch.Tensor):
    """A wrapper subclass (the way DTensor and jagged nested tensors are
    made): a tensor object whose storage holds no data."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(str(func))


def test_wrapper_subclass_raises_a_type_error_not_a_pointer():
    t = Wrapper(torch.randn(3))
    with pytest.raises(TypeError, match=r"devpickle: cannot describe the memory of a torch tensor "
                                        r"\(layout torch\.strided, device cpu\): "):
        _tensor_allocs(t, (Alloc * MAX_ALLOCS)())


def test_fake_tensor_raises_a_type_error():
    fake = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake.FakeTensorMode():
        t = torch.empty(4)
    with pytest.raises(TypeError, match=r"devpickle: cannot describe the memory of a torch tensor "
                                        r"\(layout torch\.strided, device (cpu|meta)\): "):
        _tensor_allocs(t, (Alloc * MAX_ALLOCS)())


def test_sparse_meta_tensor_raises_a_type_error_naming_the_sparse_layout():
    try:
        t = torch.empty(3, 4, device="meta").to_sparse()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip("this torch has no sparse meta tensors: %s" % e)
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo, device meta\)"):
        _tensor_allocs(t, (Alloc * MAX_ALLOCS)())


def test_mkldnn_tensor_raises_a_type_error_naming_the_layout():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without mkldnn")
    t = torch.randn(4).to_mkldnn()
    with pytest.raises(TypeError, match=r"layout torch\._mkldnn, device cpu\): devpickle knows only "
                                        r"strided and sparse layouts"):
        _tensor_allocs(t, (Alloc * MAX_ALLOCS)())


def test_timing_helper_loops_in_c_and_reports_errors():
    ts = [torch.randn(2) for _ in range(100)]
    ns = adapter._time_tensor_allocs(ts, 10)
    assert isinstance(ns, float) and ns > 0
    with pytest.raises(TypeError, match="meta"):
        adapter._time_tensor_allocs(ts + [torch.empty(1, device="meta")], 1)


# --- CUDA: only where the adapter was built with CUDA and a GPU is present ---

cuda = pytest.mark.skipif(not (API.has_cuda and torch.cuda.is_available()),
                          reason="adapter without CUDA, or no GPU")


def _cuda_fns():
    return (ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)(API.current_stream),
            ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)(API.set_current_stream),
            ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)(API.pool_stream),
            ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)(
                API.record_stream))


@cuda
def test_cuda_tensor_gives_its_device_and_storage():
    t = torch.randn(100, device="cuda")
    assert allocs(t[10:]) == (1, [(CUDA, t.device.index) + storage(t)])


@cuda
def test_current_stream_is_torchs():
    current, _, _, _ = _cuda_fns()
    d = torch.cuda.current_device()
    assert (current(d) or 0) == torch.cuda.current_stream().cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert current(d) == s.cuda_stream


@cuda
def test_set_current_stream_sets_and_restores_torchs_stream():
    _, set_current, _, _ = _cuda_fns()
    d = torch.cuda.current_device()
    outer, s = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(outer):
        prev = set_current(d, s.cuda_stream)
        assert prev == outer.cuda_stream
        assert torch.cuda.current_stream().cuda_stream == s.cuda_stream
        assert set_current(d, prev) == s.cuda_stream
        # the very stream comes back (its id too), not a wrapper of its handle
        assert torch.cuda.current_stream() == outer
    default = torch.cuda.current_stream()
    prev = set_current(d, s.cuda_stream)
    assert (prev or 0) == default.cuda_stream
    set_current(d, prev)
    assert torch.cuda.current_stream() == default


@cuda
def test_pool_stream_is_a_torch_stream_that_can_be_made_current():
    _, set_current, pool, _ = _cuda_fns()
    d = torch.cuda.current_device()
    h = pool(d)
    assert h
    prev = set_current(d, h)
    try:
        cur = torch.cuda.current_stream()
        assert cur.cuda_stream == h
        x = torch.ones(1000, device="cuda") * 2  # work on it
        cur.synchronize()
        assert float(x.sum()) == 2000
    finally:
        set_current(d, prev)


def _block_reused(record):
    """Frees a block while a kernel spins on another stream, after recording
    (or not) that stream's use of it; says whether the next allocation of the
    same size got the block back."""
    _, _, _, record_stream = _cuda_fns()
    d = torch.cuda.current_device()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    x = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
    ptr = x.data_ptr()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(1e9))
    if record:
        assert record_stream(ptr, d, side.cuda_stream) == 0
    del x
    y = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
    reused = y.data_ptr() == ptr
    side.synchronize()
    return reused


@cuda
def test_record_stream_keeps_a_torch_block_from_reuse():
    assert _block_reused(record=False)  # negative control: freed, reused at once
    assert not _block_reused(record=True)


@cuda
def test_record_stream_answers_1_for_memory_not_torchs():
    _, _, _, record_stream = _cuda_fns()
    d = torch.cuda.current_device()
    s = torch.cuda.current_stream().cuda_stream
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert record_stream(None, d, s) == 1
    assert record_stream(x.data_ptr() + 512, d, s) == 1  # inside a block, not one
    host = ctypes.create_string_buffer(64)
    assert record_stream(ctypes.addressof(host), d, s) == 1
    assert record_stream(x.data_ptr(), d, s) == 0
    torch.cuda.synchronize()


def tensor_over(source, ptr, nbytes, dtype, shape, strides, offset):
    """The adapter's tensor, or None where it declines (no exception)."""
    n = len(shape)
    p = _tensor_over(source, ptr, nbytes, dtype, n, (ctypes.c_int64 * max(n, 1))(*shape),
                     (ctypes.c_int64 * max(n, 1))(*strides), offset)
    if not p:
        return None
    t = ctypes.cast(p, ctypes.py_object).value
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(t))  # the new reference the call gave
    return t


def test_tensor_over_makes_the_view_loads_asks_for_over_the_storage_itself():
    t = torch.arange(12, dtype=torch.float32)
    base, nbytes = storage(t)
    v = tensor_over(t[3:], base, nbytes, torch.float32, (2, 3), (1, 2), 5)
    assert v.dtype == torch.float32 and v.shape == (2, 3) and v.stride() == (1, 2) and v.storage_offset() == 5
    assert storage(v) == (base, nbytes) and not v.requires_grad and type(v) is torch.Tensor
    assert v.tolist() == torch.as_strided(t, (2, 3), (1, 2), 5).tolist()
    as_int = tensor_over(t, base, nbytes, torch.int32, (12,), (1,), 0)  # reinterpreted, as view() would
    assert as_int.tolist() == t.view(torch.int32).tolist()
    v[0, 0] = -1.0  # the same memory
    assert t[5] == -1.0
    del t
    import gc
    gc.collect()
    assert v[0, 0] == -1.0  # it holds the storage
    p = torch.nn.Parameter(torch.ones(2))
    got = tensor_over(p, *storage(p), torch.float32, (2,), (1,), 0)
    assert type(got) is torch.Tensor and not got.requires_grad and got.tolist() == [1.0, 1.0]


def test_tensor_over_reaches_to_the_storages_end_and_not_past_it_and_bounds_no_empty_view():
    t = torch.zeros(4, dtype=torch.float64)  # 32 bytes
    base, nbytes = storage(t)
    assert tensor_over(t, base, nbytes, torch.float64, (2, 2), (2, 1), 0) is not None
    assert tensor_over(t, base, nbytes, torch.float64, (2, 2), (2, 1), 1) is None  # one item past
    assert tensor_over(t, base, nbytes, torch.int32, (8,), (1,), 0) is not None
    assert tensor_over(t, base, nbytes, torch.int32, (8,), (1,), 1) is None
    assert tensor_over(t, base, nbytes, torch.float64, (3,), (2,), 0) is None  # strides reach past
    # an empty view addresses nothing: as_strided takes any offset for it
    e = tensor_over(t, base, nbytes, torch.float64, (0, 5), (5, 1), 1000)
    assert e.shape == (0, 5) and e.storage_offset() == 1000 and storage(e) == (base, nbytes)
    assert tensor_over(t, base, nbytes, torch.float64, (2,), (1 << 62,), 0) is None  # overflows: not made


@pytest.mark.parametrize("case", ["moved", "larger", "empty", "negative stride", "negative offset", "negative shape",
                                  "subclass", "sparse", "not a dtype", "not a tensor"])
def test_tensor_over_declines_what_buffer_raw_or_as_strided_would_refuse_leaving_it_to_the_python_path(case):
    t = torch.ones(8)
    base, nbytes = storage(t)
    args = dict(source=t, ptr=base, nbytes=nbytes, dtype=torch.float32, shape=(8,), strides=(1,), offset=0)
    if case == "moved":
        args["ptr"] = base + 4
    elif case == "larger":
        args["nbytes"] = nbytes + 1
    elif case == "empty":
        args["nbytes"] = 0
    elif case == "negative stride":
        args.update(shape=(2,), strides=(-1,), offset=4)
    elif case == "negative offset":
        args.update(shape=(1,), offset=-1)
    elif case == "negative shape":
        args.update(shape=(-1,))
    elif case == "subclass":
        class Sub(torch.Tensor):
            pass
        args["source"] = t.as_subclass(Sub)
    elif case == "sparse":
        args["source"] = torch.ones(2).to_sparse()
    elif case == "not a dtype":
        args["dtype"] = "float32"
    else:
        args["source"] = bytearray(32)
    assert tensor_over(**args) is None
    assert tensor_over(t, base, nbytes, torch.float32, (8,), (1,), 0) is not None  # the control


def test_tensor_over_declines_under_a_torch_function_or_dispatch_mode_which_torchs_python_api_would_consult():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Disp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    t = torch.ones(4)
    base, nbytes = storage(t)
    for mode in (Fn, Disp):
        with mode():
            assert tensor_over(t, base, nbytes, torch.float32, (4,), (1,), 0) is None
    assert tensor_over(t, base, nbytes, torch.float32, (4,), (1,), 0) is not None


def _tracked(t):
    """What autograd's view tracking says of a tensor and its base."""
    b = t._base
    return (t._is_view(), t._version, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
            None if b is None else (tuple(b.shape), b.dtype, b._version, b._is_view()))


def test_tensor_over_with_dtype_none_makes_raw_s_flat_tensor_and_views_of_it_as_frames_array_does():
    # dtype None: what Buffer.raw() makes (a uint8 base over the whole
    # storage, set_ having bumped its version, sliced to nbytes); a dtype:
    # the view _frames.array makes of that flat tensor, sharing its base's
    # version counter
    t = torch.arange(6.0)
    base, nbytes = storage(t)
    for n in (nbytes, nbytes - 3):
        flat = tensor_over(t, base, n, None, (), (), 0)
        want = devpickle.Buffer("cpu", base, n, t).raw()
        # the same tensor; the base itself where it is all of it (no one sees it)
        assert _tracked(flat)[1:] == _tracked(want if n < nbytes else want._base)[1:]
        assert flat._is_view() == (n < nbytes) and storage(flat) == (base, nbytes)
        made = []
        for dt, shape, strides, offset in ((torch.float32, (2,), (2,), 1), (torch.int32, (3,), (1,), 0),
                                           (torch.uint8, (4,), (1,), 2)):
            k = n - n % torch.empty(0, dtype=dt).element_size()
            made.append(tensor_over(flat, base, n, dt, shape, strides, offset))
            assert _tracked(made[-1]) == _tracked(torch.as_strided(want[:k].view(dt), shape, strides, offset))
        made[0].add_(1)
        assert flat._version == made[1]._version == made[2]._version == 2  # one counter
        assert t._version == 0  # never the source's


import devpickle  # noqa: E402 (for Buffer.raw above)


@pytest.mark.parametrize("change", ["set_", "resize_", "as_strided_"])
def test_tensor_over_declines_a_view_of_a_flat_tensor_whose_base_was_changed_since(change):
    # torch 2's loaded views show the flat tensor's base as their _base:
    # code run between two views may set_ or resize_ it; a view made of it
    # then would read other memory than the flat tensor's, which the
    # general path views
    t = torch.arange(6.0)
    base, nbytes = storage(t)
    flat = tensor_over(t, base, nbytes, None, (), (), 0)
    assert tensor_over(flat, base, nbytes, torch.float32, (6,), (1,), 0) is not None  # the control
    root = flat  # the base itself: the flat tensor takes all of it
    other = torch.zeros(100, dtype=torch.uint8)
    {"set_": lambda: root.set_(other), "resize_": lambda: root.resize_(8),
     "as_strided_": lambda: root.as_strided_((12,), (2,), 0)}[change]()
    assert tensor_over(flat, base, nbytes, torch.float32, (6,), (1,), 0) is None
