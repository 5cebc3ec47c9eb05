"""What devpickle.Future adds to torch's: results are walked (unless
devices=[]), a result that cannot be walked fails loudly, chains of any
length, threads."""
import re
import threading
import time

import pytest
import torch

import devpickle


def gen():
    yield 1


class Holder:
    def __init__(self, x):
        self.x = x


def test_a_result_that_cannot_be_walked_fails_set_result_and_the_future():
    f = devpickle.Future()
    with pytest.raises(devpickle.WalkError) as e:
        f.set_result({"model": Holder(gen())})
    assert e.value.path == "$.model.x"
    assert f.done()
    with pytest.raises(devpickle.WalkError, match=r"at \$\.model\.x"):
        f.wait()


def test_devices_empty_walks_nothing():
    f = devpickle.Future(devices=[])
    g = gen()
    f.set_result([g])
    assert f.wait()[0] is g


def test_a_then_child_whose_result_cannot_be_walked_fails_never_borrows_the_parents_events():
    f = devpickle.Future()
    child = f.then(lambda fut: Holder(gen()))
    f.set_result(torch.ones(2))
    with pytest.raises(devpickle.WalkError, match=r"at \$\.x"):
        child.wait()


class OnCuda0:
    # memory on cuda:0, as a producer other than torch describes it
    __cuda_array_interface__ = {"data": (0x10000, False), "shape": (4,), "typestr": "<f4", "version": 3}


class CountsReduce:
    # a reduce that counts its calls (in CountsReduce.calls)
    calls = []

    def __init__(self, held):
        self.held = held

    def __reduce__(self):
        CountsReduce.calls.append(1)
        return (CountsReduce, (self.held,))


def test_a_then_child_of_a_future_that_walks_nothing_walks_nothing_and_a_collect_all_ones_walks():
    # docs/PYTHON.md: a then() child takes its parent's devices down the
    # chain (devices=[]: it stores a lock, as torch's CPU future does); a
    # collect_all future has devices=None whatever its inputs', so its
    # child walks its result
    import threading

    lock = threading.Lock()
    parent = devpickle.Future(devices=[])
    grandchild = parent.then(lambda p: 1).then(lambda p: lock)
    parent.set_result(0)
    assert grandchild.wait() is lock
    a, b = devpickle.Future(devices=[]), devpickle.Future(devices=[])
    child = devpickle.collect_all([a, b]).then(lambda p: lock)
    a.set_result(1)
    b.set_result(2)
    with pytest.raises(devpickle.WalkError, match=r"^cannot walk a '_thread\.lock' at \$: it cannot be reduced"):
        child.wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a made-up address on a machine without CUDA")
def test_a_then_child_keeps_its_parents_devices_and_refuses_a_result_on_another():
    parent = devpickle.Future(devices=["cpu"])
    child = parent.then(lambda p: OnCuda0())
    parent.set_result(1)
    with pytest.raises(ValueError, match=r"^the value uses cuda:0 \(first at \$\), which is not among the future's "
                       r"devices \[cpu\] "):
        child.wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a made-up address on a machine without CUDA")
def test_a_refused_device_names_where_the_value_holds_it_by_a_second_walk_with_paths():
    # future.h: the refusal names the path to the value's first memory on
    # the refused device; the walk of a completion keeps no paths, so a
    # refusal walks the value again (its code runs once more), and a value
    # the future accepts is walked once
    calls = CountsReduce.calls = []
    value = {"ok": torch.zeros(2), "blocks": [1, CountsReduce(OnCuda0())]}
    with pytest.raises(ValueError) as e:
        devpickle.Future(devices=["cpu"]).set_result(value)
    assert str(e.value).startswith(
        "the value uses cuda:0 (first at $.blocks[1]<reduce test_future_walk.CountsReduce>.args[0]), which is not "
        "among the future's devices [cpu]"
    ), str(e.value)
    assert len(calls) == 2
    f = devpickle.Future(devices=["cpu"])
    child = f.then(lambda p: value)
    f.set_result(None)
    with pytest.raises(ValueError, match=r"^the value uses cuda:0 \(first at \$\.blocks\[1\]<reduce "):
        child.wait()
    calls.clear()
    devpickle.Future(devices=["cpu"]).set_result({"ok": torch.zeros(2), "h": CountsReduce(7)})
    assert len(calls) == 1


class OnCudaOnce:
    # a reduce that holds memory on cuda:0 the first time only (then 1), or
    # raises from its second call on (raises=True: KeyError; or the class given)
    def __init__(self, raises=False):
        self.calls = 0
        self.raises = raises

    def __reduce__(self):
        self.calls += 1
        if self.calls > 1 and self.raises:
            raise (KeyError if self.raises is True else self.raises)("not again")
        return (int, (1,)) if self.calls > 1 else (Holder, (OnCuda0(),))


REFUSED_WITHOUT_PATH = r"^the value uses cuda:0, which is not among the future's devices \[cpu\]"


def refused_without_a_path(raises, set_result_raises, match):
    # an OnCudaOnce(raises) given to set_result raises set_result_raises
    # (matching match) and leaves the future refused without a path; one
    # returned by a then() callback fails the child so; each reduce runs twice
    v = OnCudaOnce(raises)
    f = devpickle.Future(devices=["cpu"])
    with pytest.raises(set_result_raises, match=match):
        f.set_result([v])
    assert v.calls == 2
    with pytest.raises(ValueError, match=REFUSED_WITHOUT_PATH):
        f.wait()
    v = OnCudaOnce(raises)
    parent = devpickle.Future(devices=["cpu"])
    child = parent.then(lambda p: [v])
    parent.set_result(None)
    with pytest.raises(ValueError, match=REFUSED_WITHOUT_PATH):
        child.wait()
    assert v.calls == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a made-up address on a machine without CUDA")
def test_a_value_its_walk_refuses_stays_refused_whatever_the_walk_for_the_path_finds():
    # the walk that looks for the path only names one: a value whose reduce
    # holds cuda:0 memory the first time and none the second (or fails the
    # second time) is refused, without a path, by set_result and in a then()
    # child — the second walk must not let it through
    for raises in (False, True):
        refused_without_a_path(raises, ValueError, REFUSED_WITHOUT_PATH)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a made-up address on a machine without CUDA")
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_the_walk_for_a_refusals_path_is_raised_by_set_result_and_the_future_stays_refused(interrupt):
    # the second walk (for the path) belongs to set_result's caller as the
    # first does: its interrupt passes through set_result, and the future
    # fails with the refusal, which names no path; a then() child, whose
    # callback nobody can interrupt, fails with the refusal alone
    refused_without_a_path(interrupt, interrupt, "not again")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a made-up address on a machine without CUDA")
def test_cuda_memory_given_to_a_future_without_devices_where_cuda_is_unusable_says_no_devices_were_named():
    # devices=None names none: the message must not read as if the caller
    # had listed the backend's devices, and says why cuda:0 is out of reach
    with pytest.raises(ValueError) as e:
        devpickle.Future().set_result([OnCuda0()])
    assert str(e.value).startswith("the value uses cuda:0 (first at $[0]), which is not among the future's devices "
                                   "(none named: "
                                   "every device of its host backend, [host:0, host:1]; the value's devices: "
                                   "[cuda:0]); memory on cuda:0 cannot be tracked in this process: "), str(e.value)


def test_a_long_then_chain_completes_in_order_without_recursion():
    f = devpickle.Future()
    order = []
    tail = f
    for i in range(20_000):
        tail = tail.then(lambda fut, i=i: (order.append(i), fut.wait() + 1)[1])
    f.set_result(0)
    assert tail.wait() == 20_000
    assert order == list(range(20_000))


def test_threads_complete_and_wait_concurrently():
    futs = [devpickle.Future() for _ in range(200)]
    results = [None] * 200

    def waiter(i):
        results[i] = futs[i].wait()

    ws = [threading.Thread(target=waiter, args=(i,)) for i in range(200)]
    for w in ws:
        w.start()
    for i, f in enumerate(futs):
        threading.Thread(target=f.set_result, args=([torch.ones(1), i],)).start()
    for w in ws:
        w.join(10)
    assert [r[1] for r in results] == list(range(200))


def test_devices_are_parsed_and_bad_ones_refused():
    with pytest.raises(ValueError, match="devices"):
        devpickle.Future(devices=["nonsense:0"])
    devpickle.Future(devices=["cpu"]).set_result([torch.ones(1)])


def test_a_second_set_result_from_a_reduce_does_not_replace_the_first():
    f = devpickle.Future()

    class Sneaky:
        def __reduce__(self):
            with pytest.raises(RuntimeError, match="completed once"):
                f.set_result("loser")
            return (Sneaky, ())

    winner = [Sneaky()]
    f.set_result(winner)
    assert f.wait() is winner


@pytest.mark.skipif(torch.cuda.is_available(), reason="a made-up address on a machine without CUDA")
def test_a_class_another_thread_changes_while_the_walk_reads_it_is_walked_as_changed_not_remembered_as_it_was():
    # The walk reads a class once and keeps what it found under the class's
    # version tag. Reading it runs the class's code (here its metaclass's
    # __getattribute__), and another thread gave the class an array
    # interface meanwhile: what was read before must not be kept under the
    # class's new tag, or no walk would ever find its instances' memory
    # (and a future would not wait for it).
    reading, changed = threading.Event(), threading.Event()

    class Meta(type):
        def __getattribute__(cls, name):
            if name == "__reduce_ex__" and not reading.is_set():
                reading.set()
                assert changed.wait(10)
            return type.__getattribute__(cls, name)

    class Late(metaclass=Meta):
        pass

    def give_it_an_array_interface():
        assert reading.wait(10)
        Late.__cuda_array_interface__ = property(lambda self: dict(OnCuda0.__cuda_array_interface__))
        changed.set()

    t = threading.Thread(target=give_it_an_array_interface, daemon=True)
    t.start()
    first = devpickle.scan(Late())
    t.join(10)
    assert changed.is_set()
    assert [(a.device, a.ptr) for a in first] == [("cuda:0", 0x10000)]
    assert [(a.device, a.ptr) for a in devpickle.scan([Late(), Late()], paths=False)] == [("cuda:0", 0x10000)]
    with pytest.raises(ValueError, match=r"^the value uses cuda:0 \(first at \$\), which is not among the future's "
                       r"devices \[cpu\]"):
        devpickle.Future(devices=["cpu"]).set_result(Late())


class Tagged(devpickle.Future):
    def __init__(self, tag, devices=None):
        super().__init__()
        self.tag = tag


def test_a_subclass_of_future_is_made_as_itself_with_its_own_init():
    import gc
    import weakref

    f = Tagged("x", devices=[])
    assert type(f) is Tagged and f.tag == "x" and isinstance(f, devpickle.Future)
    t = torch.ones(2)
    f.set_result([t])
    assert f.wait()[0] is t and f.then(lambda p: p.value()[0]).wait() is t
    r = weakref.ref(f)
    f.self = f  # a cycle through the subclass's __dict__ is collected
    del f
    gc.collect()
    assert r() is None
    with pytest.raises(TypeError):
        devpickle.Future("positional")


def test_collect_all_and_wait_all_say_that_a_torch_future_in_the_list_must_be_a_devpickle_future():
    # code moving from torch.futures to devpickle read "takes devpickle.Future
    # objects; item 0 is a 'Future'": torch's future is named Future too
    tf = torch.futures.Future()
    tf.set_result(1)
    name = re.escape(f"{type(tf).__module__}.{type(tf).__qualname__}")  # torch.jit.Future on torch 1.13
    for fn in (devpickle.wait_all, devpickle.collect_all):
        with pytest.raises(TypeError, match=rf"^{fn.__name__} takes devpickle.Future objects; item 1 is torch's "
                                            rf"future \('{name}'\): make it a devpickle.Future \(the same "
                                            r"interface\), or use torch.futures' own collect_all and wait_all$"):
            fn([devpickle.Future(), tf])

    class Mine:
        pass

    with pytest.raises(TypeError, match=r"^collect_all takes devpickle.Future objects; item 0 is a "
                                        r"'test_future_walk.test_.*<locals>.Mine'$"):
        devpickle.collect_all([Mine()])


def test_collect_all_and_wait_all_name_themselves_refusing_what_is_not_a_future():
    with pytest.raises(TypeError, match="^wait_all takes devpickle.Future objects; item 0 is a 'int'"):
        devpickle.wait_all([3])
    with pytest.raises(TypeError, match="^collect_all takes devpickle.Future objects; item 1 is a 'str'"):
        devpickle.collect_all([devpickle.Future(), "x"])


class _Slotted(torch.Tensor):
    __slots__ = ("extra",)


def test_set_result_finds_what_scan_finds_in_runs_of_tensors_leaves_and_the_rest():
    """A list or tuple of plain tensors and leaves is read in one run by the
    Future's walk; anything else in it (a tensor holding attributes, a
    subclass with slots, a view, a container) goes through the general walk.
    The allocations are scan()'s, in scan()'s order."""
    base = torch.arange(64, dtype=torch.float32)
    held = torch.ones(3)
    with_attr = torch.zeros(2)
    with_attr.note = held  # its attribute holds another allocation
    slotted = torch.ones(5).as_subclass(_Slotted)
    slotted.extra = torch.ones(7)
    empty = torch.empty(0)
    inner = [torch.ones(2) for _ in range(40)]
    values = [
        [torch.ones(4) for _ in range(100)],
        (1, "a", None, 2.5, True, base, base[1:], base[::2]) * 3,
        [torch.ones(1), with_attr, torch.ones(1), slotted, empty, torch.ones(2)],
        [inner, (inner[3], [inner[5]], 7), inner[::-1], {"k": torch.ones(9)}],
        [torch.ones(2).to_sparse(), torch.ones(3)],
    ]
    for v in values:
        want = [(a.device, a.ptr, a.nbytes) for a in devpickle.scan(v, paths=False)]
        f = devpickle.Future()
        f.set_result(v)
        assert f._allocations() == want
        assert f.wait() is v


def test_a_tensor_that_cannot_be_described_in_a_run_fails_set_result_naming_its_path():
    v = [torch.ones(2), torch.ones(2), torch.empty(3, device="meta"), torch.ones(2)]
    with pytest.raises(devpickle.WalkError) as scanned:
        devpickle.scan(v)
    f = devpickle.Future()
    with pytest.raises(devpickle.WalkError) as completed:
        f.set_result(v)
    assert "$[2]" in str(completed.value)
    assert str(completed.value) == str(scanned.value)


def test_devices_cpu_walks_the_value_and_refuses_what_cannot_be_walked():
    t = torch.ones(2)
    f = devpickle.Future(devices=["cpu"])
    f.set_result([t])
    assert [a[0] for a in f._allocations()] == ["cpu"] and f._devices() == []
    with pytest.raises(devpickle.WalkError, match="generator"):
        devpickle.Future(devices=["cpu"]).set_result(gen())


def test_a_failure_under_20000_nested_collect_all_futures_is_raised_without_recursion():
    f = devpickle.Future(devices=[])
    c = f
    for _ in range(20000):
        c = devpickle.collect_all([c])
    f.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        c.wait()
    with pytest.raises(ValueError, match="boom"):
        c.value()


def test_set_result_of_a_torch_storage_tracks_its_memory_without_reducing_it(monkeypatch):
    t = torch.ones(1000)
    st = t.storage()
    monkeypatch.setattr(type(st), "__reduce_ex__", lambda self, proto: pytest.fail("the storage was reduced"))
    f = devpickle.Future()
    f.set_result({"s": st})
    assert f.wait()["s"] is st


def test_future_and_its_methods_state_their_signatures_by_torchs_argument_names():
    import inspect
    assert str(inspect.signature(devpickle.Future)) == "(*, devices=None, opaque=())"
    assert str(inspect.signature(devpickle.collect_all)) == "(futures)"
    assert str(inspect.signature(devpickle.wait_all)) == "(futures)"
    for name, params in [("set_result", "result"), ("set_exception", "result"), ("then", "callback"),
                         ("add_done_callback", "callback"), ("wait", ""), ("value", ""), ("done", "")]:
        assert str(inspect.signature(getattr(devpickle.Future, name))) == f"(self, /{', ' + params if params else ''})"


# ---- opaque= ----

LOCK = type(threading.Lock())  # threading.Lock is a factory function before Python 3.13, not the type


def test_opaque_types_are_leaves_to_set_result_as_to_scan_and_the_rest_is_tracked():
    # a result holding a lock beside its tensors: a WalkError without
    # opaque=, whatever the devices; with it, the lock is a leaf and the
    # tensors' memory is tracked, as scan(opaque=) finds it
    t = torch.ones(4)
    value = {"t": t, "lock": threading.Lock()}
    for devices in (None, ["cpu"]):
        with pytest.raises(devpickle.WalkError, match=r"cannot walk a '_thread\.lock' at \$\.lock"):
            devpickle.Future(devices=devices).set_result(value)
        f = devpickle.Future(devices=devices, opaque=LOCK)
        f.set_result(value)
        assert f.wait() is value
        assert f._allocations() == [("cpu", t.data_ptr(), 16)]
        assert [(a.device, a.ptr, a.nbytes) for a in devpickle.scan(value, opaque=LOCK)] == f._allocations()
    f = devpickle.Future(opaque=[LOCK, Holder])  # a list of types; an instance of one is a leaf at the root too
    f.set_result(Holder(gen()))
    assert f._allocations() == []


def test_then_children_walk_their_callbacks_results_with_their_parents_opaque_types_down_the_chain():
    f = devpickle.Future(opaque=(LOCK,))
    f.set_result(1)
    lock, t = threading.Lock(), torch.ones(2)
    child = f.then(lambda p: [lock, t])
    assert child.wait()[0] is lock and child._allocations() == [("cpu", t.data_ptr(), 8)]
    assert child.then(lambda p: {"again": lock}).wait() == {"again": lock}
    plain = devpickle.Future()
    plain.set_result(1)
    with pytest.raises(devpickle.WalkError, match=r"cannot walk a '_thread\.lock' at \$\[0\]"):
        plain.then(lambda p: [lock, t]).wait()


def test_opaque_is_taken_and_refused_as_scan_takes_and_refuses_it():
    for bad in (1, ["x"], (LOCK, 3), "abc", threading.Lock):
        with pytest.raises(TypeError) as scan_error:
            devpickle.scan(None, opaque=bad)
        with pytest.raises(TypeError) as future_error:
            devpickle.Future(opaque=bad)
        assert str(future_error.value) == str(scan_error.value) and str(scan_error.value).startswith("opaque= takes types")
    # a generator is read once; None and () are no types
    f = devpickle.Future(opaque=(x for x in [LOCK]))
    f.set_result(threading.Lock())
    for none in (None, (), []):
        with pytest.raises(devpickle.WalkError):
            devpickle.Future(opaque=none).set_result(threading.Lock())


def test_a_subclass_takes_opaque_from_its_constructor_or_its_init_and_a_walk_keeps_the_types_it_began_with():
    class Sub(devpickle.Future):
        def __init__(self, *, tag=None, **kw):
            super().__init__(**kw)
            self.tag = tag

    class Chooses(devpickle.Future):
        def __init__(self):
            super().__init__(opaque=LOCK)

    class KeepsItsOwn(devpickle.Future):
        def __init__(self, *, opaque):  # never calls the future's __init__: what construction read stands
            self.asked = opaque

    for f in (Sub(opaque=LOCK, tag=1), Chooses(), KeepsItsOwn(opaque=[LOCK])):
        f.set_result([threading.Lock()])
    f = Sub(opaque=LOCK)
    f.__init__(opaque=None)  # replaces the types for the walks to come
    with pytest.raises(devpickle.WalkError):
        f.set_result([threading.Lock()])
    f = Sub(opaque=LOCK)
    f.__init__()  # nothing given: nothing changes
    f.set_result([threading.Lock()])
    f = Sub(opaque=LOCK)
    with pytest.raises(TypeError, match="devices must be a list of devices, not a str"):
        f.__init__(opaque=None, devices="cpu")  # refused devices: the types stay as they were
    f.set_result([threading.Lock()])

    class Reinits:
        # the value's own code replaces its future's types while the walk
        # is in it: the walk goes on with the types it began with
        def __reduce__(self):
            fut.__init__(opaque=None)
            self.kept = tuple([float])  # a new 1-tuple, where the old one's memory was
            return (Reinits, ())

    fut = devpickle.Future(opaque=(LOCK,))
    value = [Reinits(), threading.Lock()]
    fut.set_result(value)
    assert fut.wait() is value


def test_a_collect_all_future_walks_its_then_childrens_results_with_the_opaque_types_of_all_its_inputs():
    # collect_all(fs).then(combine), the pattern torch code gathers results
    # with: the combination holds what the inputs held
    a, b, plain = devpickle.Future(opaque=LOCK), devpickle.Future(opaque=(Holder, LOCK)), devpickle.Future()
    combined = devpickle.collect_all([a, b, plain]).then(lambda f: [x.wait() for x in f.wait()])
    lock, holder = threading.Lock(), Holder(gen())
    a.set_result(lock)
    b.set_result(holder)
    plain.set_result(1)
    assert combined.wait() == [lock, holder, 1]
    alone = devpickle.Future()
    child = devpickle.collect_all([alone]).then(lambda f: [lock])
    alone.set_result(1)
    with pytest.raises(devpickle.WalkError, match=r"cannot walk a '_thread\.lock' at \$\[0\]"):
        child.wait()


def test_collect_all_merges_its_inputs_opaque_types_in_time_linear_in_them():
    # a scan of the merged list for each type was quadratic: 60,000 types
    # over two inputs took seconds; each type is also kept once, in order
    many = tuple(type(f"T{i}", (), {"__slots__": ()}) for i in range(60000))
    a, b = devpickle.Future(opaque=many), devpickle.Future(opaque=many[::-1] + (LOCK,))
    start = time.thread_time()  # this thread's CPU time: a loaded machine's waits do not count
    gathered = devpickle.collect_all([a, b])
    assert time.thread_time() - start < 1.0
    child = gathered.then(lambda f: [many[-1](), threading.Lock()])
    a.set_result(1)
    b.set_result(2)
    assert type(child.wait()[0]) is many[-1]


def test_opaque_types_answer_the_futures_walk_as_isinstance_does_for_each_future():
    """The Future's walk answers opaque= from a cache per walk: a
    subclass's instance, a class registered with an ABC and an instance a
    metaclass's __instancecheck__ accepts are leaves, as isinstance says;
    a class one future walked is a leaf to the next that lists it."""
    import abc

    class Base:
        pass

    class Sub(Base):
        def __init__(self, t):
            self.t = t

    class Other:
        def __init__(self, t):
            self.t = t

    class Handle(abc.ABC):
        pass

    class ByFlag(type):
        def __instancecheck__(cls, o):
            return getattr(o, "hide", False)

    class Flagged(metaclass=ByFlag):
        pass

    ts = [torch.ones(n) for n in (1, 2, 3, 4, 5)]
    shown, hidden = Other(ts[2]), Other(ts[3])
    hidden.hide = True
    value = [Sub(ts[0]), Other(ts[1]), shown, hidden, (Sub(ts[4]),)]

    def walked(**kw):
        f = devpickle.Future(**kw)
        f.set_result(value)
        return sorted(nbytes for _, _, nbytes in f._allocations())

    assert walked() == [4, 8, 12, 16, 20]
    assert walked(opaque=Base) == [8, 12, 16]
    assert walked(opaque=(Base, Handle, Flagged)) == [8, 12]
    Handle.register(Other)
    assert walked(opaque=(Base, Handle)) == []
    assert walked(opaque=Other) == [4, 20]
    assert walked() == [4, 8, 12, 16, 20]
