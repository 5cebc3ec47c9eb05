"""devpickle.scan: what pickle would walk, memory found once, paths, errors."""
import collections
import copyreg
import dataclasses
import enum
import gc
import io
import pickle
import re
import subprocess
import sys
import threading
import typing
import weakref

import numpy as np
import pytest
import torch

import devpickle


class Holder:
    def __init__(self, t):
        self.t = t


@dataclasses.dataclass
class Block:
    qkv: object
    bias: object = None


Pair = collections.namedtuple("Pair", "a b")


class Slotted:
    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w


class Custom:
    def __init__(self, t):
        self.hidden = t

    def __reduce__(self):
        return (Custom, (self.hidden,))


class Color(enum.Enum):
    RED = 1


def storage_ptr(t):
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._storage
    return s.data_ptr(), s.nbytes()


def test_leaves_and_empty_containers_hold_no_memory():
    assert devpickle.scan([None, True, 1, 2.5, 3j, "s", b"b", [], (), {}, set(), frozenset(), int, len, Color.RED]) == []


def test_views_of_one_storage_are_one_allocation_with_a_count_of_distinct_tensors():
    t = torch.arange(16, dtype=torch.float32)
    got = devpickle.scan([t, t[2:], t.view(4, 4), t])
    assert len(got) == 1
    a = got[0]
    assert (a.ptr, a.nbytes) == storage_ptr(t)
    assert a.device == "cpu" and a.refs == 3 and a.path == "$[0]"
    assert a["ptr"] == a.ptr and a._asdict()["refs"] == 3


def test_refs_count_each_distinct_tensor_once_however_often_and_in_whatever_order_it_is_met():
    ts = [torch.ones(2) for _ in range(100)]
    for paths in (True, False):
        # more tensors than a batch of the walk; every one met again, and a view of each
        got = devpickle.scan(ts + [None, "x"] + ts[::-1] + [t[1:] for t in ts] + ts, paths=paths)
        assert [x.ptr for x in got] == [storage_ptr(t)[0] for t in ts]
        assert [x.refs for x in got] == [2] * 100
        assert [x.path for x in got] == ([f"$[{i}]" for i in range(100)] if paths else [None] * 100)
    t = torch.arange(6.0)
    v = t[2:]
    # the view first, then the tensor, each twice; a numpy array over the same memory
    got = devpickle.scan([v, (1, t), [v, t], t.numpy(), t])
    assert [(x.refs, x.path) for x in got] == [(3, "$[0]")]
    sp = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))
    assert [x.refs for x in devpickle.scan([sp, sp, [sp]])] == [1, 1]


def test_refs_match_the_distinct_objects_met_on_each_allocation_in_any_order_and_count():
    import random

    rng = random.Random(7)
    bases = [torch.arange(8.0) for _ in range(3)]
    # up to six distinct objects a storage: the tensor and views of it
    objs = [[b] + [b[i:] for i in range(1, 6)] for b in bases]
    for _ in range(200):
        seq = [rng.choice(objs[rng.randrange(3)][: rng.randint(1, 6)]) for _ in range(rng.randint(1, 14))]
        want = {}
        for o in seq:
            want.setdefault(storage_ptr(o)[0], set()).add(id(o))
        # flat, and in small tuples and lists (read in place without paths)
        for value in (seq, [tuple(seq[i:i + 3]) for i in range(0, len(seq), 3)],
                      [(o, [o, (o,)]) for o in seq]):
            for paths in (True, False):
                got = devpickle.scan(value, paths=paths)
                assert {x.ptr: x.refs for x in got} == {p: len(ids) for p, ids in want.items()}, (seq, paths)


def test_runs_of_tensors_read_at_once_give_what_paths_give_wherever_the_run_stops():
    """Without paths a run of plain tensors in a list is read by the adapter
    at once; an item it cannot read so (sparse, attributes, a leaf, another
    class) ends the run there and is walked as with paths, and the run goes
    on after it — across the batch's size too."""
    import random

    class Sub(torch.Tensor):
        pass

    rng = random.Random(11)
    bases = [torch.arange(16.0) for _ in range(5)]
    with_attr = torch.ones(3)
    with_attr.extra = torch.zeros(2)

    def fresh_attr():  # its attribute in the words before the object, no dict made yet
        t = torch.ones(2)
        t.extra = torch.zeros(1)
        return t

    def emptied():  # an attribute set, then deleted: nothing held, the words not empty
        t = torch.ones(2)
        t.gone = torch.zeros(1)
        del t.gone
        return t

    def dict_read():  # an empty dict made by reading it
        t = torch.ones(2)
        t.__dict__
        return t
    kinds = [
        lambda: rng.choice(bases),
        lambda: rng.choice(bases)[rng.randrange(1, 8):],
        lambda: torch.ones(rng.randrange(1, 4)),
        lambda: torch.empty(0),
        lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
        lambda: with_attr,
        lambda: torch.ones(2).as_subclass(Sub),
        lambda: rng.choice([1, "s", None, 2.5]),
        fresh_attr,
        emptied,
        dict_read,
    ]
    weights = [30, 20, 20, 3, 2, 2, 2, 5, 2, 2, 2]
    for _ in range(60):
        seq = [rng.choices(kinds, weights)[0]() for _ in range(rng.randint(1, 120))]
        for value in (seq, tuple(seq)):
            with_paths = [(x.device, x.ptr, x.nbytes, x.refs) for x in devpickle.scan(value)]
            assert [(x.device, x.ptr, x.nbytes, x.refs) for x in devpickle.scan(value, paths=False)] == with_paths
            f = devpickle.Future()
            f.set_result(value)
            assert [(d, p, n) for d, p, n, _ in with_paths] == f._allocations()


@pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12)), reason="the words are read on 3.11 and 3.12 only")
def test_the_attribute_words_of_a_tensor_are_read_where_their_layout_was_checked():
    """On 3.11 and 3.12 a run asks whether a tensor holds attributes by
    reading the words before it, checked against CPython at import: a check
    that failed would make every run ask CPython instead, which makes a dict
    of a tensor's inline attributes (an allocation, and on 3.11 perhaps a
    garbage collection in the middle of a run)."""
    assert devpickle._devpickle._managed_words is True


def test_a_tensor_that_cannot_be_described_ends_a_run_and_is_reported_at_its_path():
    for at in (0, 1, 31, 32, 33, 70):
        v = [torch.ones(2) for _ in range(80)]
        v[at] = torch.empty(3, device="meta")
        for paths in (True, False):
            with pytest.raises(devpickle.WalkError, match=r"at \$\[%d\]: .*meta device" % at):
                devpickle.scan(v, paths=paths)


def test_small_containers_nested_in_each_other_give_the_allocations_paths_would_give():
    ts = [torch.ones(i + 1) for i in range(12)]
    shared = [ts[3]]

    def deep(n, leaf):
        for _ in range(n):
            leaf = [leaf]
        return leaf

    values = [
        [(t, [t[:1], (t[1:], [t])]) for t in ts],  # three levels in each item
        [deep(n, t) for n, t in enumerate(ts)],  # 0 to 11 levels: past the levels read in place
        [(t, shared, [shared]) for t in ts],  # a list held twice: entered once, by the memo
        [(t, list(ts)) for t in ts[:3]],  # an inner list longer than those read in place
        [(1, "x", None, (2.0, [b"y", (t, 3)])) for t in ts],
        [((t, ts[0]), [ts[0], (t,)]) for t in ts[::-1]],
    ]
    for v in values:
        with_paths = [(x.device, x.ptr, x.nbytes, x.refs) for x in devpickle.scan(v)]
        assert [(x.device, x.ptr, x.nbytes, x.refs) for x in devpickle.scan(v, paths=False)] == with_paths
        f = devpickle.Future(devices=None)
        f.set_result(v)
        assert f.done() and f.value() is v


def test_instances_in_a_list_give_the_allocations_paths_would_give_whatever_their_dict_holds():
    import copyreg

    class Plain:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Registered(Plain):
        pass

    class Meta(type):
        pass

    class WithMeta(Plain, metaclass=Meta):
        pass

    class Iface(Plain):
        pass

    ts = [torch.ones(i + 1) for i in range(12)]
    hidden = torch.ones(99)
    shared = Plain(t=ts[0])

    def odd():
        o = Plain(t=ts[5])
        o.__dict__[7] = ts[6]  # a key that is not a str
        return o

    def iface():
        o = Iface(t=ts[8])
        o.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3}
        return o

    # each instance held by its list only (those read in place), but `shared`
    values = [
        [Plain(t=t, n=1, s="x", sub=[t[1:], (t,)]) for t in ts],
        [Plain(a=t, b=Plain(c=t)) for t in ts],  # an instance in an instance: entered by visit()
        [shared, shared, Plain(u=shared)],
        [odd(), Plain(**{f"a{i}": ts[i] for i in range(10)}), Plain(), Plain(x=None)],  # 10: more than read in place
        [iface(), Plain(t=ts[9])],
        [WithMeta(t=ts[10]), Registered(t=ts[11])],
    ]
    copyreg.pickle(Registered, lambda o: (Registered, (), {"t": o.t, "extra": hidden}))
    try:
        for v in values:
            with_paths = [(x.device, x.ptr, x.nbytes, x.refs) for x in devpickle.scan(v)]
            assert [(x.device, x.ptr, x.nbytes, x.refs) for x in devpickle.scan(v, paths=False)] == with_paths, v
        # the dispatch table's reduce is walked, not the instance's __dict__
        assert storage_ptr(hidden)[0] in [x.ptr for x in devpickle.scan(values[5], paths=False)]
        assert 0x1000 in [x.ptr for x in devpickle.scan(values[4], paths=False)]
        # an interface set on the instance is read, malformed or not
        def bad():
            o = Iface(t=ts[0])
            o.__cuda_array_interface__ = 5
            return [o]  # the list's reference its only one

        for paths in (True, False):
            with pytest.raises(devpickle.WalkError, match="malformed __cuda_array_interface__"):
                devpickle.scan(bad(), paths=paths)
    finally:
        del copyreg.dispatch_table[Registered]


class _PlainHolder:
    pass


def _held_by_instance_reduce(name, t):
    o = _PlainHolder()
    o.other = 1
    if name == "__reduce_ex__":
        setattr(o, name, lambda proto: (_PlainHolder, (), {"hidden": t}))
    else:
        setattr(o, name, lambda: {"hidden": t})
    return o


@pytest.mark.parametrize("name", ["__reduce_ex__", "__getstate__"])
def test_an_instances_own_reduce_ex_or_getstate_is_walked_as_pickle_calls_it(name):
    # pickle looks __reduce_ex__ up on the instance, and object.__reduce_ex__
    # looks __getstate__ up there too: the memory they return is what pickle
    # carries, and the walk read the instance's __dict__ instead (finding a
    # function and missing the tensor)
    t = torch.arange(4.0)
    o = _held_by_instance_reduce(name, t)
    assert list(pickle.loads(pickle.dumps(o)).__dict__) == ["hidden"]
    got = devpickle.scan({"o": o})
    assert [(a.ptr, a.path) for a in got] == [(t.data_ptr(), "$.o<reduce test_scan._PlainHolder>.state.hidden")]
    for value in ([_held_by_instance_reduce(name, t)], [o, o]):  # a run's object, held by its slot alone too
        assert [a.ptr for a in devpickle.scan(value, paths=False)] == [t.data_ptr()]


def test_an_instances_dict_is_read_for_reduce_names_by_their_characters_running_no_keys_eq():
    # the walk tells whether an instance's __dict__ holds __reduce_ex__ or
    # __getstate__ by one pass over its keys, as the in-place read of a list
    # does; a lookup by hash ran this key's __eq__ for every object entered
    # (dumps' walk, which carries a key of a str subclass as a name)
    class Name(str):
        calls = 0

        def __eq__(self, other):
            Name.calls += 1
            return str.__eq__(self, other)

        def __hash__(self):
            return hash("__getstate__")

    class Holder:
        pass

    t = torch.arange(4.0)
    o = Holder()
    o.__dict__[Name("tag")] = 1
    o.t = t
    # dumps reads the instance in place, the key an attribute name
    for value in (o, [o, o]):
        devpickle.dumps(value, inline=True)
    assert Name.calls == 0
    # scan reduces it, as pickle does for a key of a str subclass (an
    # object of its own), through Python's own lookups
    for value, paths in ((o, True), ([o, o], False)):
        assert [a.ptr for a in devpickle.scan(value, paths=paths)] == [t.data_ptr()]


def test_nesting_past_the_depth_limit_in_small_lists_is_refused_without_paths_too():
    x = torch.zeros(1)
    for _ in range(262_145):
        x = [x]
    for paths in (True, False):
        with pytest.raises(devpickle.WalkError, match="too deep"):
            devpickle.scan([x], paths=paths)


def test_a_tensor_with_attributes_met_after_a_view_of_it_has_them_walked():
    t = torch.ones(4)
    t.extra = torch.zeros(2)
    got = devpickle.scan([t[1:], "leaf", t, t])
    assert [(x.refs, x.path) for x in got] == [(2, "$[0]"), (1, "$[2].extra")]


def test_allocations_come_in_discovery_order_with_their_first_path():
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(4)
    value = {"blocks": [Block(a, bias=b)], "x y": Holder(c), 7: a}
    got = devpickle.scan(value)
    assert [x.path for x in got] == ["$.blocks[0].qkv", "$.blocks[0].bias", '$["x y"].t']
    assert [x.ptr for x in got] == [storage_ptr(t)[0] for t in (a, b, c)]


def test_allocations_outlive_their_list_and_each_other_and_free_their_memory_with_the_last():
    import gc
    import tracemalloc

    ts = [torch.ones(i + 1) for i in range(50)]
    value = {f"k{i}": t for i, t in enumerate(ts)}
    kept = devpickle.scan(value)[7::20]  # the list goes; three of its Allocations stay
    gc.collect()
    assert [(a.path, a.ptr, a.refs) for a in kept] == [(f'$.k{i}', storage_ptr(ts[i])[0], 1) for i in (7, 27, 47)]
    assert kept[0].path is kept[0].path and repr(kept[1]).endswith("path='$.k27')")
    assert kept[2] == dict(kept[2]) and kept[0] != kept[1]
    assert devpickle.scan([ts[7]])[0] != kept[0]  # the same memory at another path
    assert devpickle.scan([ts[7]], paths=False)[0] == devpickle.scan([ts[7]], paths=False)[0]
    assert devpickle.scan([1, "x"]) == []
    del kept
    tracemalloc.start()
    try:
        devpickle.scan(value)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            got = devpickle.scan(value)
            one = got[3]
            del got
            assert one.path == "$.k3"
            del one
        assert tracemalloc.get_traced_memory()[0] - before < 4096
    finally:
        tracemalloc.stop()


def test_an_allocations_repr_names_its_fields_and_allocations_compare_by_all_of_them():
    t = torch.ones(3)
    a = devpickle.scan({"x": t})[0]
    assert repr(a) == f"Allocation(device='cpu', ptr={hex(a.ptr)}, nbytes=12, refs=1, path='$.x')"
    b = devpickle.scan({"x": t}, paths=False)[0]
    assert repr(b) == f"Allocation(device='cpu', ptr={hex(a.ptr)}, nbytes=12, refs=1, path=None)"
    # the same allocation found with and without a path, or by another count of tensors
    assert a != b and b != a and not a == b and not b == a
    c = devpickle.scan({"x": t, "y": t[1:]})[0]
    assert (c.path, c.refs) == ("$.x", 2) and a != c and not a == c
    assert a == devpickle.scan({"x": t})[0] and not a != devpickle.scan({"x": t})[0]
    with pytest.raises(TypeError):
        a < b


def test_paths_false_gives_none_paths():
    got = devpickle.scan([torch.ones(1)], paths=False)
    assert got[0].path is None


def test_namedtuples_slots_custom_reduce_and_dict_subclasses_are_walked():
    ts = [torch.ones(i + 1) for i in range(5)]
    value = [Pair(1, ts[0]), Slotted(ts[1]), Custom(ts[2]), collections.OrderedDict(k=ts[3]),
             collections.defaultdict(list, {"d": [ts[4]]})]
    got = devpickle.scan(value)
    assert [x.path for x in got] == [
        "$[0].b",
        "$[1]<reduce test_scan.Slotted>.state[1].w",
        "$[2]<reduce test_scan.Custom>.args[0]",
        "$[3]<reduce collections.OrderedDict>.dictitems.k",
        "$[4]<reduce collections.defaultdict>.dictitems.d[0]",
    ]


class _NewArgs:
    held = None

    def __new__(cls, *args):
        return object.__new__(cls)

    def __init__(self):
        self.x = 1

    def __getnewargs__(self):
        return (_NewArgs.held,)


class _GetState:
    held = None

    def __init__(self):
        self.x = 1

    def __getstate__(self):
        return {"s": _GetState.held}


class _SlotsAndDict:
    __slots__ = ("w", "__dict__")

    def __init__(self, w):
        self.w = w
        self.x = 1


def test_a_class_with_getnewargs_getstate_or_slots_is_walked_through_its_reduce_not_its_dict():
    t = torch.ones(1)
    _NewArgs.held = _GetState.held = t
    for obj, step in ((_NewArgs(), "args[1]"), (_GetState(), "state.s"), (_SlotsAndDict(t), "state[1].w")):
        assert obj.__dict__ == {"x": 1}
        got = devpickle.scan([obj])
        assert [(a.ptr, a.path) for a in got] == [(storage_ptr(t)[0], f"$[0]<reduce {__name__}.{type(obj).__name__}>.{step}")]


def test_shared_objects_and_cycles_are_walked_once():
    t = torch.ones(3)
    h = Holder(t)
    cyc = [h]
    cyc.append(cyc)
    h.back = cyc
    got = devpickle.scan([cyc, h, h, {"again": cyc}])
    assert len(got) == 1 and got[0].refs == 1 and got[0].path == "$[0][0].t"


def test_numpy_arrays_and_buffers_are_cpu_memory_owner_first_never_copied():
    a = np.zeros(100, dtype=np.float64)
    view = a[10:20]
    ba = bytearray(32)
    got = devpickle.scan({"view": view, "a": a, "ba": ba, "mv": memoryview(ba)})
    assert [(x.device, x.nbytes, x.refs) for x in got] == [("cpu", 800, 2), ("cpu", 32, 2)]
    assert got[0].ptr == a.__array_interface__["data"][0]


def test_a_released_memoryview_is_a_walk_error_never_a_read_of_its_former_base():
    b = bytearray(16)
    m = memoryview(b)
    m.release()
    with pytest.raises(devpickle.WalkError, match="released memoryview") as e:
        devpickle.scan({"m": m})
    assert e.value.path == "$.m"

    class Own(np.ndarray):  # weakly referenceable: its death can be checked
        pass

    for _ in range(3):  # the base freed by the release: its address is garbage
        a = np.arange(4096.0).view(Own)
        w = weakref.ref(a)
        m = memoryview(a)
        del a
        m.release()
        assert w() is None
        junk = [np.ones(64) for _ in range(64)]  # noqa: F841 (reuses the freed memory)
        with pytest.raises(devpickle.WalkError, match="released memoryview"):
            devpickle.scan([m])


def test_an_object_that_cannot_be_reduced_is_a_walk_error_naming_type_and_path():
    def gen():
        yield 1

    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"blocks": [Holder(gen())]})
    assert isinstance(e.value, TypeError)
    assert e.value.path == "$.blocks[0].t" and e.value.type_name == "generator"
    assert str(e.value).startswith("cannot walk a 'generator' at $.blocks[0].t: an iterator cannot be reduced")


def test_a_walk_error_escapes_control_characters_and_line_separators_in_the_type_name_it_quotes():
    U = type("U\n\x9b\u2028", (), {"__reduce__": lambda self: 1 / 0})
    U.__module__ = "m"
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"x": U()})
    assert str(e.value).startswith("cannot walk a 'm.U\\u000a\\u009b\\u2028' at $.x: "), str(e.value)
    assert e.value.type_name == "m.U\n\x9b\u2028"  # the attribute holds the name itself


def test_a_walk_error_quotes_a_long_type_name_cut_on_a_character_with_an_ellipsis():
    # the name was cut at 255 bytes before the message's 256-byte cut: mid-
    # character (shown as \ufffd) and without the ellipsis
    Q = type("Q", (), {"__reduce__": lambda self: 1 / 0})
    Q.__qualname__ = "Q" + "\xe9" * 300
    Q.__module__ = "m"
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"x": Q()})
    assert str(e.value).startswith("cannot walk a 'm.Q" + "\xe9" * 126 + "\u2026' at $.x: "), str(e.value)
    assert e.value.type_name == "m.Q" + "\xe9" * 300
    assert e.value.path == "$.x"


def test_a_future_holds_no_memory_of_its_own_only_its_attributes_are_walked():
    # A future's value is reached through its own wait(), which orders the
    # consumer after the future's events: torch's extractor skips futures,
    # and so does the walk (pickle refuses them: dumps too). What an
    # instance or a subclass adds is part of the value.
    t, u = torch.ones(3), torch.ones(5)
    done = devpickle.Future()
    done.set_result([u])
    theirs = torch.futures.Future()
    theirs.set_result(u)
    assert devpickle.scan([done, theirs, devpickle.Future(), torch.futures.Future()]) == []
    done.extra = t
    theirs.extra = t

    class Slotted(devpickle.Future):
        __slots__ = ("w", "unset")

    sl = Slotted()
    sl.w = t
    got = devpickle.scan({"a": done, "b": theirs, "c": sl})
    assert [(a.path, a.nbytes, a.refs) for a in got] == [("$.a.extra", 12, 1)]  # one tensor, met three times
    assert [a.path for a in devpickle.scan([sl])] == ["$[0].w"]
    # what is in an attribute is walked by the rules: a generator is an error
    done.bad = (x for x in ())
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"a": done})
    assert e.value.path == "$.a.bad" and e.value.type_name == "generator"


def test_a_future_subclass_that_makes_itself_picklable_is_reduced_as_pickle_would():
    t = torch.ones(2)

    class Portable(devpickle.Future):
        def __reduce__(self):
            return (Portable, (), {"t": t})

    assert [a.path for a in devpickle.scan([Portable()])] [0].endswith(">.state.t")

    class Registered(devpickle.Future):
        pass

    copyreg.pickle(Registered, lambda f: (Registered, (), {"t": t}))
    try:
        assert [a.path for a in devpickle.scan([Registered()])] [0].endswith(">.state.t")
    finally:
        del copyreg.dispatch_table[Registered]
    # a dispatch table entry for the class of a future is used too
    assert devpickle.scan([Registered()]) == []


def test_opaque_types_are_leaves():
    def gen():
        yield 1

    class Secret:
        def __init__(self):
            self.t = torch.ones(2)

    assert devpickle.scan([Secret(), gen()], opaque=(Secret, type(gen()))) == []
    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=(1,))
    assert str(e.value) == "opaque= takes types; got a 'int'"
    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=[Secret, "x"])
    assert str(e.value) == "opaque= takes types; got a 'str'"


def test_an_unreducible_object_says_to_list_its_type_in_opaque_where_the_walk_takes_opaque():
    # a lock beside the tensors: scan and the Future take opaque=, so their
    # error says how to walk past it; dumps takes none, so its error does not
    lock = threading.Lock()
    hint = "it cannot be reduced (if it holds no device memory, list its type in opaque=): cannot pickle '_thread.lock'"
    with pytest.raises(devpickle.WalkError, match=re.escape(f"cannot walk a '_thread.lock' at $.lock: {hint}")):
        devpickle.scan({"lock": lock, "t": torch.ones(1)})
    with pytest.raises(devpickle.WalkError, match=re.escape(f"at $[0]: {hint}")):
        devpickle.Future().set_result([lock])
    with pytest.raises(devpickle.WalkError, match=r"at \$\[0\]: it cannot be reduced: cannot pickle '_thread.lock'"):
        devpickle.dumps([lock])
    assert len(devpickle.scan({"lock": lock, "t": torch.ones(1)}, opaque=type(lock))) == 1


def test_a_then_futures_unreducible_object_says_its_opaque_types_are_its_parents():
    # then() takes no opaque=: "list its type in opaque=" sent the user to an
    # argument the future whose walk failed has none of; its types are its
    # parent's (a collect_all future's, its inputs')
    lock = threading.Lock()
    hint = ("it cannot be reduced (if it holds no device memory, list its type in opaque= of the future then() was "
            "called on: a then() future walks with its parent's types, a collect_all future's with its inputs'): "
            "cannot pickle '_thread.lock' object")
    parent, a = devpickle.Future(), devpickle.Future()
    children = [parent.then(lambda p: [lock]), parent.then(lambda p: 1).then(lambda p: [lock]),
                devpickle.collect_all([a]).then(lambda p: [lock])]
    parent.set_result(1)
    a.set_result(1)
    for child in children:
        with pytest.raises(devpickle.WalkError) as e:
            child.wait()
        assert str(e.value) == f"cannot walk a '_thread.lock' at $[0]: {hint}"
    # the parent's own walk keeps the short hint, and its types reach the child
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.Future().set_result([lock])
    assert str(e.value) == ("cannot walk a '_thread.lock' at $[0]: it cannot be reduced (if it holds no device "
                            "memory, list its type in opaque=): cannot pickle '_thread.lock' object")
    listed = devpickle.Future(opaque=type(lock))
    child = listed.then(lambda p: [lock])
    listed.set_result(1)
    assert child.wait() == [lock]


def test_a_factory_given_as_an_opaque_type_says_to_give_the_type_of_what_it_makes():
    # threading.Lock is a function before Python 3.13 (a type after)
    def make():
        return threading.Lock()

    for opaque, head in ((make, "opaque= takes types: a type or an iterable of types, not a 'function'"),
                         ((int, make), "opaque= takes types; got a 'function'")):
        with pytest.raises(TypeError) as e:
            devpickle.scan([], opaque=opaque)
        assert str(e.value) == (f"{head} (test_a_factory_given_as_an_opaque_type_says_to_give_the_type_of_what_it_"
                                "makes.<locals>.make is callable, not a type: give the type of what it makes, as "
                                "type(threading.Lock()) for threading.Lock)")


@pytest.mark.parametrize("opaque, says", [
    (list[int], "a 'types.GenericAlias' (a generic alias is not a type: give its origin, list)"),
    (typing.List[int], "a '_GenericAlias' (a generic alias is not a type: give its origin, list)"),
    (int | torch.Tensor, "a 'types.UnionType' (a union is not a type: give its types instead, (int, torch.Tensor))"),
    (typing.Optional[int], "a '_UnionGenericAlias' (a union is not a type: give its types instead, (int, NoneType))"),
])
def test_a_generic_or_a_union_given_as_opaque_says_which_types_to_give_instead(opaque, says):
    # a generic alias is callable, and was told to give "the type of
    # what it makes" as a factory is; typing's is iterable, and was read as
    # its unpacking (Unpack[...]); a typing.Union is subscriptable, and was
    # refused with no hint
    for take in (lambda o: devpickle.scan([], opaque=o), lambda o: devpickle.Future(opaque=o)):
        with pytest.raises(TypeError) as e:
            take(opaque)
        assert str(e.value) == f"opaque= takes types: a type or an iterable of types, not {says}"
        with pytest.raises(TypeError) as e:
            take((str, opaque))
        assert str(e.value) == f"opaque= takes types; got {says}"


@pytest.mark.parametrize("raised", [KeyboardInterrupt, MemoryError, SystemExit])
def test_an_interrupt_raised_reading_a_callable_opaques_name_passes_through(raised):
    # the name the factory hint reads is the object's own code: what it
    # raises is swallowed as a missing name, but not an interrupt or a
    # MemoryError, which the walk never swallows either
    class Factory:
        def __call__(self):
            return threading.Lock()

        def __getattr__(self, name):
            if name == "__qualname__":
                raise raised("while reading __qualname__")
            raise AttributeError(name)

    for opaque in (Factory(), [int, Factory()]):
        for take in (lambda: devpickle.scan([], opaque=opaque), lambda: devpickle.Future(opaque=opaque)):
            with pytest.raises(raised, match="^while reading __qualname__$"):
                take()

    class Quiet(Factory):
        def __getattr__(self, name):
            raise ValueError(name)

    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=Quiet())
    assert str(e.value) == "opaque= takes types: a type or an iterable of types, not a 'Quiet'"


@pytest.mark.parametrize("opaque", [5, 1.5, object(), int | str], ids=["int", "float", "object", "a union"])
def test_opaque_that_is_neither_a_type_nor_an_iterable_is_a_type_error_naming_opaque(opaque):
    # "anything else ... is a TypeError", saying which argument (as classes=
    # does), not Python's "'int' object is not iterable"
    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=opaque)
    assert str(e.value).startswith("opaque= takes types: a type or an iterable of types, not a '")
    assert type(opaque).__name__ in str(e.value)


def test_a_deep_value_walks_without_recursion_and_a_limit_names_the_path():
    deep = t = torch.ones(1)
    for _ in range(100_000):
        deep = [deep]
    got = devpickle.scan(deep)
    assert len(got) == 1 and got[0].ptr == storage_ptr(t)[0]
    assert "<\u2026" in got[0].path and len(got[0].path.encode()) <= 1024


def test_keys_that_are_not_str_show_in_paths_as_json_words_reprs_or_the_key_itself():
    ts = [torch.ones(1) for _ in range(8)]
    value = {None: ts[0], True: ts[1], False: ts[2], 3: ts[3], (1, "x"): ts[4], b"ab": ts[5], (ts[6],): 1, "k y": ts[7]}
    assert [a.path for a in devpickle.scan(value)] == [
        "$[null]", "$[true]", "$[false]", "$[3]", "$[(1, 'x')]", "$[b'ab']", "$<key 6>[0]", '$["k y"]']


def test_keys_sharing_a_large_item_cost_what_their_paths_show_not_the_item_once_a_key():
    # A tuple key's step was its whole repr, cut to 64 bytes: keys (i, T)
    # sharing one 100,000-item T each cost T's repr (400 keys: 1.7 s,
    # 10,000: 40 s), and an item's __repr__ ran once a key. A tuple's and a
    # frozenset's step is made of its items' reprs up to what it shows, each
    # item's once a walk; the step is the one the whole repr gives.
    calls = []

    class Shown:
        def __repr__(self):
            calls.append(1)
            return "Shown()"

    def step(k):  # the whole repr, cut to 64 bytes and escaped
        text = repr(k)
        cut = len(text.encode()) > 64
        text = text[:64]
        while len(text.encode()) > 64:
            text = text[:-1]
        return "$[" + text.replace("\n", "\\u000a") + ("\u2026" if cut else "") + "]"

    shown, big = Shown(), tuple(range(20_000))
    value = {(i, shown, big): np.zeros(1) for i in range(400)}
    paths = [a.path for a in devpickle.scan(value)]
    assert len(calls) == 1
    assert paths == [step(k) for k in value]
    z = np.zeros(1)
    keys = [(1, "x"), (1,), (), frozenset(), frozenset([3]), ((1, 2), (3,)), (1, "a" * 100), tuple(range(30)),
            (frozenset([(1, 2)]), None, 1.5, b"x\n", 2j), ("\u20ac" * 70,), (((((((((),),),),),),),),), ("'", '"'),
            (frozenset([frozenset([b"q" * 80])]),)]
    for k in keys:
        assert [a.path for a in devpickle.scan({k: z})] == [step(k)], k


def test_long_keys_are_cut_in_paths():
    got = devpickle.scan({"k" * 1000: torch.ones(1)})
    assert got[0].path == "$." + "k" * 64 + "\u2026"


def test_a_class_changed_after_a_scan_is_walked_as_it_is_now():
    class Late:
        def __init__(self):
            self.t = torch.ones(2)

    obj = Late()
    assert devpickle.scan(obj)[0].path == "$.t"
    Late.__reduce__ = lambda self: (Late, ())
    assert devpickle.scan(obj) == []


def test_a_reduce_that_empties_the_containers_around_it_does_not_crash_the_walk():
    outer = []

    class Clearer:
        def __reduce__(self):
            outer.clear()
            return (Clearer, ())

    inner = [torch.ones(2) for _ in range(20)]
    outer.extend([[Clearer(), *inner]])
    del inner
    got = devpickle.scan(outer)  # the walk holds what it iterates
    assert len(got) == 20


def test_dictitems_that_are_not_pairs_are_a_walk_error():
    class R:
        def __reduce__(self):
            return (R, (), None, None, iter([1, 2]))

    with pytest.raises(devpickle.WalkError, match="dictitems must yield"):
        devpickle.scan(R())


class _BadPairs:
    items = None

    def __reduce__(self):
        return (_BadPairs, (), None, None, iter(_BadPairs.items))


@pytest.mark.parametrize("items", [[(1, 2, 3)], [(1,)], [("k", 1), [1, 2]]])
def test_dictitems_of_other_than_two_items_are_a_walk_error_at_the_item_naming_the_reduced_type(items):
    _BadPairs.items = items
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan([_BadPairs()])
    at = f"$[0]<reduce {__name__}._BadPairs>.dictitems[{len(items) - 1}]"
    assert str(e.value) == (f"cannot walk a '{__name__}._BadPairs' at {at}: its items cannot be read: "
                            "dictitems must yield (key, value) pairs")
    assert e.value.path == at and isinstance(e.value.__cause__, TypeError)


class _KeyedDict(dict):
    pass


def test_a_dict_subclass_s_keys_holding_memory_are_walked_through_its_dictitems():
    t, u, w = torch.ones(1), torch.ones(2), torch.ones(3)
    d = _KeyedDict()
    d[(t,)], d["k"], d[w] = 1, u, 2
    at = f"$[0]<reduce {__name__}._KeyedDict>.dictitems"
    got = devpickle.scan([d])
    assert [(a.ptr, a.path) for a in got] == [
        (storage_ptr(t)[0], at + "<key 0>[0]"), (storage_ptr(u)[0], at + ".k"), (storage_ptr(w)[0], at + "<key 2>")]


def test_a_malformed_cuda_array_interface_is_a_walk_error():
    class Fake:
        __cuda_array_interface__ = {"data": (4096, False), "shape": (4, 4), "strides": (4,), "typestr": "<f4",
                                    "version": 3}

    with pytest.raises(devpickle.WalkError, match="strides must be None or a tuple as long as shape"):
        devpickle.scan(Fake())


def test_a_dict_key_holding_memory_does_not_make_the_walk_look_its_value_up_again():
    class K:
        def __init__(self):
            self.t = torch.ones(1)
            self.n = 0

        def __hash__(self):  # changes after insertion: a second lookup would miss
            self.n += 1
            return self.n

    d = {"first": torch.ones(2)}
    d[K()] = torch.ones(3)
    d["after"] = torch.ones(4)
    assert len(devpickle.scan(d)) == 4


def test_devices_given_as_a_str_is_a_clear_type_error():
    with pytest.raises(TypeError, match="not a str"):
        devpickle.Future(devices="cuda:0")


def test_a_tensor_subclass_and_a_tensor_with_attributes_have_their_dict_walked():
    # pickle carries a tensor's __dict__ (torch._utils._get_obj_state); so does the walk
    inner = torch.zeros(3)
    p = torch.nn.Parameter(torch.ones(2))
    p.extra = {"t": inner}
    got = devpickle.scan([p])
    assert [a.ptr for a in got] == [storage_ptr(p)[0], storage_ptr(inner)[0]]
    assert got[1].path == '$[0].extra.t'
    t = torch.ones(2)
    t.note = inner
    assert [a.path for a in devpickle.scan({"x": t})] == ['$.x', '$.x.note']


class Bytes(bytearray):
    pass


class Arr(np.ndarray):
    pass


def test_a_buffer_subclass_has_its_memory_and_its_dict_walked_never_skipped():
    # pickle carries a bytearray subclass's __dict__; a tensor kept there is found
    inner = torch.zeros(3)
    b = Bytes(b"abc")
    b.t = inner
    got = devpickle.scan([b])
    assert [a.path for a in got] == ['$[0]', '$[0].t']
    assert got[1].ptr == storage_ptr(inner)[0]
    n = np.zeros(4).view(Arr)
    n.meta = {"t": inner}
    assert [a.path for a in devpickle.scan(n)] == ['$', '$.meta.t']
    plain = np.zeros(4).view(Arr)  # no attributes: the array alone
    assert [a.path for a in devpickle.scan(plain)] == ['$']


class SlottedTensor(torch.Tensor):
    __slots__ = ("extra", "unset")


def test_a_tensor_subclass_with_slots_has_them_walked_and_dumps_refuses_it():
    s = torch.zeros(2).as_subclass(SlottedTensor)
    s.extra = torch.ones(5)
    got = devpickle.scan({"s": s})
    assert [a.path for a in got] == ['$.s', '$.s.extra']
    assert got[1].ptr == storage_ptr(s.extra)[0]
    with pytest.raises(devpickle.WalkError, match=r"SlottedTensor' at \$: it cannot be carried in a frame"):
        devpickle.dumps(s, inline=True)
    bare = torch.zeros(2).as_subclass(SlottedTensor)  # no slot set: the storage alone
    assert [a.path for a in devpickle.scan(bare)] == ['$']


def test_object_arrays_walk_their_items_and_numpy_scalars_are_leaves():
    t = torch.ones(2)
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = t, "x"
    got = devpickle.scan([arr])
    assert [a.ptr for a in got] == [storage_ptr(t)[0]]  # the array's pointer block is not memory anyone shares
    assert got[0].path.startswith("$[0]<reduce numpy.ndarray>")
    assert devpickle.scan([np.float64(1.5), np.int32(3), np.bool_(True)]) == []


def test_an_object_array_subclass_has_its_items_and_its_attributes_walked():
    # "a numpy array subclass's __dict__ and slots, which numpy's reduce
    # drops, are walked too": of dtype=object as well, after its items
    t, extra, slot = torch.ones(2), torch.ones(3), torch.ones(4)
    arr = np.empty(1, dtype=object).view(Arr)
    arr[0] = t
    arr.meta = {"t": extra}
    got = devpickle.scan([arr])
    assert [a.ptr for a in got] == [storage_ptr(x)[0] for x in (t, extra)]
    assert [a.path for a in got] == ["$[0]<reduce test_scan.Arr>.state[4][0]", "$[0]<reduce test_scan.Arr>.meta.t"]
    assert [a.ptr for a in devpickle.scan([arr], paths=False)] == [a.ptr for a in got]
    fut = devpickle.Future()
    fut.set_result(arr)
    assert sorted(p for _, p, _ in fut._allocations()) == sorted(a.ptr for a in got)

    class Slotted(np.ndarray):
        __slots__ = ("s",)

    s = np.empty(1, dtype=object).view(Slotted)
    s.s = slot
    assert [a.ptr for a in devpickle.scan(s)] == [storage_ptr(slot)[0]]


def test_a_bound_builtin_method_walks_its_self_as_pickle_does():
    t = torch.ones(2)
    lst = [t]
    got = devpickle.scan({"cb": lst.append})
    assert [a.ptr for a in got] == [storage_ptr(t)[0]]
    assert got[0].path.startswith('$.cb<reduce builtin_function_or_method>.args')
    assert devpickle.scan([len, print]) == []  # module-level builtins are globals


def test_a_module_is_a_walk_error_as_pickle_refuses_it():
    import os

    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"m": os})
    assert e.value.type_name == "module" and e.value.path == '$.m'


class Interrupting:
    def __init__(self, exc):
        self.exc = exc

    def __reduce__(self):
        raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, MemoryError])
def test_an_interrupt_raised_by_a_reduce_passes_through_unwrapped(exc):
    with pytest.raises(exc):
        devpickle.scan([Interrupting(exc())])


_ENDLESS_LISTITEMS = """
import itertools, signal, devpickle
class Endless:
    def __reduce__(self):
        return (list, (), None, itertools.count())
def stop(*a):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, stop)
signal.setitimer(signal.ITIMER_REAL, 0.3)
try:
    devpickle.scan([Endless()])
except KeyboardInterrupt:
    print("interrupted")
"""


def test_a_signal_stops_a_walk_draining_endless_listitems():
    # itertools.count() never returns to the interpreter's loop: without a
    # check of signals while draining, the walk would run until memory ends
    out = subprocess.run([sys.executable, "-c", _ENDLESS_LISTITEMS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "interrupted"


_ENDLESS_HANDLER = """
import itertools, signal, devpickle
class Endless:
    def __reduce__(self):
        return (list, (), None, itertools.count())
class EndlessPairs:
    def __reduce__(self):
        return (dict, (), None, None, zip(itertools.count(), itertools.count()))
def stop(*a):
    raise TimeoutError("the handler's")
signal.signal(signal.SIGALRM, stop)
walks = [devpickle.scan, devpickle.dumps, lambda v: devpickle.Future().set_result(v)]
for walk in walks:
    for value in ([Endless()], [EndlessPairs()]):
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            walk(value)
        except TimeoutError as e:
            print(type(e).__name__, e)
        signal.setitimer(signal.ITIMER_REAL, 0)
"""


def test_a_signal_handlers_exception_stopping_a_drain_passes_through_as_it_is():
    # not only an interrupt: whatever the handler raises is no error of the
    # value's, and passes through as from a loop in Python (not a WalkError)
    out = subprocess.run([sys.executable, "-c", _ENDLESS_HANDLER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["TimeoutError the handler's"] * 6


def test_a_numpy_view_of_a_torch_tensor_is_the_tensors_allocation():
    t = torch.arange(8, dtype=torch.float32)
    got = devpickle.scan([t, t.numpy()[2:], t[1:].numpy()])
    assert len(got) == 1
    assert (got[0].ptr, got[0].nbytes) == storage_ptr(t)
    assert got[0].refs == 3


def _raises_when_iterated():
    raise ValueError("no items")
    yield


class BadListItems:
    def __reduce__(self):
        return (list, (), None, _raises_when_iterated())


def test_a_reduce_whose_parts_cannot_be_read_names_the_reduced_type():
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan([BadListItems()])
    assert e.value.type_name.endswith("BadListItems"), e.value
    assert "listitems" in e.value.path


class NTReduced(collections.namedtuple("NTReduced", "a")):
    def __reduce__(self):
        return (NTReduced, (self.a,), None, None, None)


NTDispatched = collections.namedtuple("NTDispatched", "a")


def test_a_dispatch_table_entry_that_removes_itself_is_held_while_it_runs_as_pickle_holds_it():
    # copyreg.dispatch_table's function for a class was called as the table
    # held it: one that removed itself — here a bound dict.get, whose key's
    # __eq__ deletes the entry — freed itself and its dict under its own
    # call, which went on in whatever dict was made next in that memory (a
    # reduce out of nowhere). Held, it answers as pickle has it answer: None.
    made, t = [], torch.ones(3)

    class Key:
        def __hash__(self):
            return 12345

        def __eq__(self, other):
            if Reduced in copyreg.dispatch_table:
                del copyreg.dispatch_table[Reduced]  # the last reference to the bound get, and its dict
                made.append({other: (list, ([t],))})  # made in the freed dict's memory
            return False

    class Reduced:
        def __hash__(self):
            return 12345

        def __eq__(self, other):
            return self is other

    for walk in (devpickle.scan, devpickle.dumps):
        copyreg.dispatch_table[Reduced] = {Key(): (list, ())}.get
        try:
            with pytest.raises(devpickle.WalkError, match="its reduce is malformed: __reduce_ex__ must return a string "
                                                          "or a tuple of 2 to 6 items"):
                walk([Reduced()])
        finally:
            copyreg.dispatch_table.pop(Reduced, None)


def test_a_namedtuple_with_its_own_reduce_or_a_dispatch_entry_is_walked_through_it():
    import copyreg

    t = torch.ones(2)
    hidden = torch.zeros(2)
    got = devpickle.scan(NTReduced(t))
    assert [a.path for a in got] == ["$<reduce test_scan.NTReduced>.args[0]"]
    copyreg.pickle(NTDispatched, lambda nt: (NTDispatched, (hidden,)))
    try:
        got = devpickle.scan(NTDispatched(t))
    finally:
        del copyreg.dispatch_table[NTDispatched]
    assert [a.ptr for a in got] == [storage_ptr(hidden)[0]]


class _FieldsOnTuple(tuple):
    __slots__ = ()
    _fields = ("a", "b")


def test_a_tuple_subclass_with_fields_and_tuples_own_getnewargs_is_walked_as_a_namedtuple():
    # pickle makes it from tuple(self) (tuple.__getnewargs__), as it makes a
    # namedtuple: its items, named by _fields, not a reduce's args.
    t = torch.ones(2)
    got = devpickle.scan(_FieldsOnTuple((1, t)))
    assert [a.path for a in got] == ["$.b"]
    assert pickle.loads(pickle.dumps(_FieldsOnTuple((1, 2)))) == (1, 2)


def test_a_reduces_state_setter_is_walked():
    import functools

    t = torch.ones(2)

    class S:
        def __reduce__(self):
            return (S, (), {}, None, None, functools.partial(setattr, t))

    got = devpickle.scan(S())
    assert len(got) == 1 and ".state_setter" in got[0].path


def test_a_tensor_type_is_asked_for_its_slots_once_not_once_a_tensor():
    # torch.Tensor is larger than its C base, so the walk asks
    # copyreg._slotnames whether it has __slots__; the answer is cached with
    # the type's version tag. _slotnames itself sets __slotnames__, which
    # clears the tag until something looks an attribute up in the class —
    # the cache then never hit and every tensor paid a Python call.
    import subprocess
    import sys
    code = (
        "import copyreg\n"
        "calls = []\n"
        "orig = copyreg._slotnames\n"
        "def counting(cls):\n"
        "    calls.append(cls)\n"
        "    return orig(cls)\n"
        "copyreg._slotnames = counting\n"
        "import torch, devpickle\n"
        "v = [torch.zeros(2) for _ in range(1000)]\n"
        "for _ in range(3):\n"
        "    devpickle.scan(v)\n"
        "    devpickle.Future().set_result(v)\n"
        "print(sum(c is torch.Tensor for c in calls))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) <= 2


def test_an_object_freed_by_a_reduce_does_not_hide_a_new_object_at_its_address():
    # the memo is keyed by address: once the value's Python code runs, the
    # walk keeps what it entered alive, so no address is reused meanwhile
    missed = 0
    for _ in range(20):
        holder = {}

        class Box:
            def __init__(self, v):
                self.v = v

        class Evil:
            def __reduce__(self):
                del holder["first"]
                return (Evil, (Box(torch.ones(1000)),))

        holder["first"] = Box(None)
        found = devpickle.scan((holder, Evil()))  # holder is walked, and left, before Evil's reduce
        missed += not any(a.nbytes == 4000 for a in found)
    assert missed == 0


def test_dumps_refuses_a_tensor_a_reduce_resized_after_the_walk_met_it():
    t = torch.ones(1 << 16)

    class Evil:
        def __reduce__(self):
            t.resize_(1 << 18)
            return (Evil, ())

    if devpickle._devpickle._torch_adapter() == "python":  # every cpu tensor is copied when met
        back = devpickle.loads(devpickle.dumps({"t": t, "e": Evil()}, inline=True), classes=(Evil,))
        assert back["t"].shape == (1 << 16,) and bool((back["t"] == 1).all())
        return
    with pytest.raises(devpickle.WalkError, match="storage was resized") as e:
        devpickle.dumps({"t": t, "e": Evil()}, inline=True)
    assert e.value.path == "$.t"  # where the walk found it


class _Iface:
    """Any object exposing numpy's array interface over another's memory."""

    def __init__(self, a):
        self.__array_interface__ = a.__array_interface__


def _long_chain(x, pairs=40):
    """x seen through 80 more views: ndarray -> memoryview -> ndarray ..."""
    for _ in range(pairs):
        x = np.frombuffer(memoryview(x), dtype=x.dtype)
    return x


@pytest.mark.parametrize("view", ["tensor", "numpy_over_it", "np_from_dlpack", "np_from_dlpack_of_tensor",
                                  "np_over_an_interface", "a_chain_of_80_views_over_an_interface"])
def test_dumps_copies_borrowed_cpu_memory_when_met_so_its_owner_freeing_it_later_is_never_read(view):
    """torch.from_numpy(a)'s storage still reports a's memory after numpy
    frees it (a.resize(refcheck=False)): no later check could see it go, so
    an inline dumps copies it when the walk meets it, as pickle reads it.
    So is a numpy array whose owner is no buffer (a DLPack capsule, an
    __array_interface__ object), or is further than the walk follows (64
    views): the walk cannot follow it to the memory's owner."""
    a = np.full(1 << 22, 7.0)  # 32 MiB: its own mapping, unmapped when freed
    t = torch.from_numpy(a)
    if view.startswith("np_from_dlpack") and not hasattr(np, "from_dlpack"):
        pytest.skip("this numpy has no from_dlpack")
    v = {"tensor": lambda: t, "numpy_over_it": lambda: t.numpy()[2:], "np_from_dlpack": lambda: np.from_dlpack(a),
         "np_from_dlpack_of_tensor": lambda: np.from_dlpack(t), "np_over_an_interface": lambda: np.asarray(_Iface(a)),
         "a_chain_of_80_views_over_an_interface": lambda: _long_chain(np.asarray(_Iface(a)))}[view]()

    class Shrink:
        def __reduce__(self):
            a.resize(16, refcheck=False)
            return (Shrink, ())

    back = devpickle.loads(devpickle.dumps([v, Shrink()], inline=True), classes=(Shrink,))
    assert a.size == 16 and back[0][:3].tolist() == [7.0, 7.0, 7.0] and back[0].shape == v.shape


@pytest.mark.skipif(devpickle._devpickle._torch_adapter() != "c++", reason="the C++ adapter tells torch's own memory")
def test_dumps_reads_torchs_own_cpu_memory_when_it_writes_the_frame_not_when_met():
    t = torch.full((4,), 7.0)

    class Fill:
        def __reduce__(self):
            t.fill_(1.0)
            return (Fill, ())

    assert devpickle.loads(devpickle.dumps([t, Fill()], inline=True), classes=(Fill,))[0].tolist() == [1.0] * 4


def test_a_dict_changed_by_the_values_own_code_during_the_walk_is_an_error_not_a_silent_skip():
    t = torch.ones(100)
    d = {}

    class Mut:
        def __reduce__(self):
            d.clear()
            d["b"] = t
            return (Mut, ())

    d["a"] = Mut()
    d["b"] = t
    with pytest.raises(devpickle.WalkError, match="dictionary changed size during the walk") as e:
        devpickle.scan({"outer": d})
    assert (e.value.type_name, e.value.path) == ("dict", "$.outer")  # the dict's path, not its last item's


def _mk():
    class C:
        def __init__(self):
            self.t = torch.ones(3)

        def __reduce__(self):
            return (C, (), {"t": self.t})

    return C()


def test_a_path_that_leaves_out_one_step_says_step_as_the_c_library_does():
    # keys of control characters escape to 6 bytes each: steps of 388, 388
    # and 304 bytes, a path of 1,081 bytes whose tail keeps the last two
    a = np.ones(4)
    v = {"\x01" * 64: {"\x01" * 64: {"\x01" * 50: a}}}
    k64, k50 = "\\u0001" * 64, "\\u0001" * 50
    assert devpickle.scan(v)[0]["path"] == f'$<\u20261 step\u2026>["{k64}"]["{k50}"]'


def test_a_path_escapes_what_would_end_its_step_or_break_its_line():
    make = _mk

    class K:
        def __repr__(self):
            return "line1\nline2"

        def __hash__(self):
            return 1

    paths = [a.path for a in devpickle.scan({"x": make(), K(): torch.ones(5)})]
    assert paths[0].endswith(".<locals\\u003e.C>.state.t"), paths[0]
    assert paths[1] == "$[line1\\u000aline2]"
    assert all("\n" not in p for p in paths)


def test_a_path_escapes_delete_c1_controls_and_line_separators_as_the_c_library_does():
    # U+009B is CSI to a terminal, U+0085 a new line; U+2028/U+2029 end a
    # line in JavaScript and many JSON readers. Neighbours (U+00A0, U+2027)
    # are shown as they are.
    class K:
        def __repr__(self):
            return "k\x9b\u2028"

        def __hash__(self):
            return 1

    obj = Holder(torch.ones(1))
    obj.__dict__["a\x7f\u2029"] = obj.__dict__.pop("t")
    R = type("R\x85\u2028", (), {"__reduce__": lambda self: (R, (), {"t": torch.ones(2)})})
    R.__module__ = "m"
    v = {"a\x7fb\x85c\x9bd\u2028e\u2029f\xa0\u2027": torch.ones(3), K(): torch.ones(4), "o": obj, "r": R()}
    paths = [a.path for a in devpickle.scan(v)]
    assert paths == [
        '$["a\\u007fb\\u0085c\\u009bd\\u2028e\\u2029f\xa0\u2027"]',
        "$[k\\u009b\\u2028]",
        '$.o["a\\u007f\\u2029"]',
        "$.r<reduce m.R\\u0085\\u2028>.state.t",
    ], paths


def test_a_key_whose_repr_raises_shows_its_type_name_cut_and_escaped_as_a_name():
    # the type's name stood in raw: a newline or CSI in it broke the line,
    # and one cut mid-character by its 64-byte limit made scan fail to
    # decode its own path (UnicodeDecodeError)
    def key_type(name):
        return type(name, (), {"__repr__": lambda self: 1 / 0, "__hash__": lambda self: 1})

    K = key_type("K\n\x9b>\\")
    assert devpickle.scan({K(): torch.ones(1)})[0].path == "$[<K\\u000a\\u009b\\u003e\\\\>]"
    L = key_type("L" + "\xe9" * 40)
    assert devpickle.scan({L(): torch.ones(1)})[0].path == "$[<L" + "\xe9" * 31 + "\u2026>]"


def test_a_str_key_holding_a_lone_surrogate_is_shown_by_its_json_escape():
    # it has no UTF-8: the path wrote [<str>], hiding which key it was
    assert devpickle.scan({"a\ud800": torch.ones(1)})[0].path == '$["a\\ud800"]'
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.dumps({"k": {"\udc00x": 1}})
    assert e.value.path == '$.k["\\udc00x"]', e.value.path


def test_an_opaque_type_whose_instancecheck_raises_gives_a_walk_error_naming_the_path():
    class Meta(type):
        def __instancecheck__(cls, obj):
            raise ValueError("no")

    class Odd(metaclass=Meta):
        pass

    with pytest.raises(devpickle.WalkError) as ei:
        devpickle.scan({"a": [object()]}, opaque=(Odd,))
    assert ei.value.path.startswith("$")
    assert isinstance(ei.value.__cause__, ValueError)


def test_dumps_refuses_a_tensor_a_subclass_torch_function_resized_after_the_walk_met_it():
    victim = torch.ones(1 << 16)
    state = {"done": False}

    class Evil(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if not state["done"]:
                state["done"] = True
                victim.resize_(1 << 18)  # moves the storage the walk met
            return super().__torch_function__(func, types, args, kwargs or {})

    e = torch.Tensor._make_subclass(Evil, torch.zeros(3))
    if devpickle._devpickle._torch_adapter() == "python":  # every cpu tensor is copied when met
        back = devpickle.loads(devpickle.dumps([victim, e], inline=True))
        assert state["done"] and back[0].shape == (1 << 16,) and bool((back[0] == 1).all())
        return
    with pytest.raises(devpickle.WalkError, match="storage was resized"):
        devpickle.dumps([victim, e], inline=True)
    assert state["done"]


class _HandsBack:
    """Its reduce hands back a tensor the walk already entered through a
    list that held the only reference to it."""

    def __init__(self, box):
        self.box = box

    def __reduce__(self):
        return (_HandsBack, (self.box[0],))


def test_a_tensor_met_again_through_what_a_reduce_returns_counts_once():
    box = [torch.ones(3)]          # the tensor's only holder
    v = [box, _HandsBack(box)]     # the reduce returns box[0]: a second reference, made during the walk
    (a,) = devpickle.scan(v)
    assert a.refs == 1 and a.path == "$[0][0]"
    w = [[torch.ones(3)], (lambda t: [t, t[1:]])(torch.ones(4))]
    assert [x.refs for x in devpickle.scan(w)] == [1, 2]  # a view is another tensor on the storage


def test_objects_sharing_one_dict_have_its_values_walked_once():
    class Borg:  # the shared-state idiom: every instance has the same __dict__
        shared = {}

        def __init__(self):
            self.__dict__ = Borg.shared

    a = Borg()
    a.weights = [torch.zeros(4)]
    got = devpickle.scan([a, Borg()])
    assert [(x.refs, x.path) for x in got] == [(1, "$[0].weights[0]")]

    class A:
        pass

    bottom = [torch.zeros(4)]
    for _ in range(18):  # each level: two objects sharing one dict that holds the level below
        x, y = A(), A()
        y.__dict__ = x.__dict__
        x.below = bottom
        bottom = [x, y]
    (only,) = devpickle.scan(bottom, paths=False)
    assert only.refs == 1
    f = devpickle.Future()
    f.set_result(bottom)
    assert len(f._allocations()) == 1


def test_what_the_walk_entered_stays_alive_while_code_it_runs_drops_it():
    """Code the walk runs without calling the value's own methods — here a
    metaclass __getattr__ met while the walk classifies a type — may drop
    objects the walk already entered; they stay alive until the walk ends,
    so no new object can take a freed one's address and pass as seen."""
    class Box:
        pass

    box = Box()
    box.t = torch.ones(2)
    alive_during = []

    class Meta(type):
        def __getattr__(cls, name):
            if root[0] is not None:
                ref = weakref.ref(root[0])
                root[0] = root[1] = None
                alive_during.append(ref() is not None)
            raise AttributeError(name)

    class Late(metaclass=Meta):
        pass

    root = [box, box, Late()]
    ref = weakref.ref(box)
    del box
    got = devpickle.scan(root)
    assert alive_during and all(alive_during)
    assert [a.nbytes for a in got] == [8]
    del got
    assert ref() is None  # let go once the walk ended


class _Reduces:
    parts = None

    def __reduce__(self):
        return _Reduces.parts


def _malformed_reduce_causes(parts):
    """The causes of the WalkErrors scan, dumps and set_result raise for a
    reduce returning parts, which pickle refuses too."""
    _Reduces.parts = parts
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(_Reduces(), protocol=5)
    causes = []
    for walk in (devpickle.scan, devpickle.dumps, devpickle.Future().set_result):
        with pytest.raises(devpickle.WalkError, match=r"_Reduces' at \$\[0\]: its reduce is malformed") as e:
            walk([_Reduces()])
        causes.append(e.value.__cause__)
    return causes


@pytest.mark.parametrize("parts,error", [
    ((1, 2), "first element of the tuple returned by __reduce__ must be callable, not int"),
    ((print, [1]), "second element of the tuple returned by __reduce__ must be a tuple, not list"),
    ((print, (), None, [1]), "fourth element of the tuple returned by __reduce__ must be an iterator, not list"),
    ((print, (), None, None, {1: 2}), "fifth element of the tuple returned by __reduce__ must be an iterator, not dict"),
    ((print, (), None, None, None, 7), "sixth element of the tuple returned by __reduce__ must be a function, not int"),
])
def test_a_reduce_result_pickle_refuses_is_a_walk_error_in_scan_dumps_and_set_result(parts, error):
    for cause in _malformed_reduce_causes(parts):
        assert str(cause) == error


def __newobj__(cls, *args):  # pickle knows the callable by its name alone
    return cls.__new__(cls, *args)


@pytest.mark.parametrize("parts,error", [
    ((copyreg.__newobj__, ()), "__newobj__ arglist is empty"),
    ((copyreg.__newobj__, ("cls", 1)), "args[0] from __newobj__ args is not a type"),
    ((copyreg.__newobj__, (Holder, torch.ones(1))), "args[0] from __newobj__ args has the wrong class"),
    ((__newobj__, (Holder,)), "args[0] from __newobj__ args has the wrong class"),
    ((copyreg.__newobj_ex__, (_Reduces, ())), "length of the NEWOBJ_EX argument tuple must be exactly 3, not 2"),
    ((copyreg.__newobj_ex__, ("cls", (), {})), "first item from NEWOBJ_EX argument tuple must be a class, not str"),
    ((copyreg.__newobj_ex__, (_Reduces, [], {})), "second item from NEWOBJ_EX argument tuple must be a tuple, not list"),
    ((copyreg.__newobj_ex__, (_Reduces, (), [])), "third item from NEWOBJ_EX argument tuple must be a dict, not list"),
])
def test_a_newobj_reduce_pickle_refuses_is_a_walk_error_worded_as_pickle_words_it(parts, error):
    for cause in _malformed_reduce_causes(parts):
        assert isinstance(cause, TypeError)
        assert str(cause) == error


def test_a_newobj_reduce_pickle_takes_is_walked():
    t = torch.ones(2)
    for parts in [(copyreg.__newobj__, (_Reduces, t)), (copyreg.__newobj_ex__, (_Reduces, (t,), {"k": t}))]:
        _Reduces.parts = parts
        pickle.dumps(_Reduces(), protocol=5)
        assert [a.ptr for a in devpickle.scan(_Reduces())] == [storage_ptr(t)[0]]


@pytest.mark.parametrize("parts", [(print,), (print, (), None, None, None, None, None), [print, ()], 7])
def test_a_reduce_returning_neither_a_str_nor_a_tuple_of_2_to_6_items_is_a_walk_error(parts):
    for cause in _malformed_reduce_causes(parts):
        assert isinstance(cause, TypeError)
        assert str(cause) == "__reduce_ex__ must return a string or a tuple of 2 to 6 items"


def test_a_key_is_rendered_once_however_many_allocations_lie_under_it():
    class Key:
        reprs = 0

        def __repr__(self):
            Key.reprs += 1
            return "K" * 1000

    k = Key()
    got = devpickle.scan({k: [bytearray(1) for _ in range(300)], (k,): [bytearray(1)]})
    assert len(got) == 301 and Key.reprs == 2  # once as a key, once inside the tuple key
    assert got[0].path == "$[" + "K" * 64 + "\u2026][0]" and got[299].path.endswith("\u2026][299]")
    assert got[300].path.startswith("$[(KKKK")


def test_an_interrupt_raised_by_code_the_walk_calls_for_a_path_or_a_type_passes_through():
    class Key:
        def __repr__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        devpickle.scan({Key(): bytearray(4)})

    class Meta(type):
        def __getattribute__(cls, name):
            if name == "__reduce_ex__":
                raise KeyboardInterrupt
            return type.__getattribute__(cls, name)

    class C(metaclass=Meta):
        pass

    with pytest.raises(KeyboardInterrupt):
        devpickle.scan([C()])

    class Fails:
        def __repr__(self):
            raise ValueError("no repr")

    assert devpickle.scan({Fails(): bytearray(4)})[0].path.endswith("[<Fails>]")  # an error of the value's: a placeholder
    assert devpickle.scan([bytearray(2)])[0].nbytes == 2  # nothing left over for the next walk


def test_an_interrupt_held_by_one_walk_is_raised_by_that_walk_not_by_another():
    import threading

    class Key:
        def __init__(self, fn):
            self.fn = fn

        def __repr__(self):
            return self.fn()

    def interrupt():
        raise SystemExit("held by the outer walk")

    def walks_again():
        assert devpickle.scan([]) == []  # a walk inside the walk: it finishes clean
        return "K2"

    # nested on one thread: the outer walk raises its own interrupt
    with pytest.raises(SystemExit, match="outer walk"):
        devpickle.scan({Key(interrupt): {Key(walks_again): bytearray(2)}})

    # another thread walking while this one's walk holds an interrupt
    started, other = threading.Event(), {}

    def sleeps_then_interrupts():
        started.set()
        import time

        time.sleep(0.05)  # releases the GIL while the other thread walks
        raise SystemExit("mine")

    def other_thread():
        started.wait()
        other["got"] = devpickle.scan([bytearray(3)])

    t = threading.Thread(target=other_thread)
    t.start()
    with pytest.raises(SystemExit, match="mine"):
        devpickle.scan({Key(sleeps_then_interrupts): bytearray(1), "x": bytearray(5)})
    t.join()
    assert [a.nbytes for a in other["got"]] == [3]


def torch_storages(t):
    """t's storage as each kind torch has: typed (t.storage()) and untyped."""
    return [t.storage(), t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._storage]


@pytest.mark.parametrize("kind", ["typed", "untyped"])
def test_a_torch_storage_is_its_allocation_read_without_its_reduce(kind, monkeypatch):
    t = torch.arange(1000, dtype=torch.float32)
    st = torch_storages(t)[kind == "untyped"]
    monkeypatch.setattr(type(st), "__reduce_ex__", lambda self, proto: pytest.fail("the storage was reduced"))
    got = devpickle.scan({"s": st})
    assert [(a.device, a.ptr, a.nbytes, a.path) for a in got] == [("cpu", *storage_ptr(t), "$.s")]
    both = devpickle.scan({"t": t, "s": st})
    assert len(both) == 1 and both[0].path == "$.t" and both[0].refs == 2
    assert devpickle.scan(torch_storages(torch.ones(0))) == []  # an empty storage holds no memory


def test_a_storage_without_memory_is_a_walk_error_as_a_meta_tensor_is():
    with pytest.raises(devpickle.WalkError, match="a storage on device type 'meta' has no memory") as e:
        devpickle.scan([torch.ones(3, device="meta").storage()])
    assert e.value.path == "$[0]"


@pytest.mark.parametrize("attr", ["__reduce_ex__", "__reduce__", "__getstate__"])
def test_an_interrupt_raised_by_a_metaclass_asked_about_a_types_reduce_passes_through(attr):
    raised = []

    class Meta(type):
        def __getattribute__(cls, name):
            if name == attr:
                raised.append(name)
                raise KeyboardInterrupt(f"from the metaclass: {name}")
            return type.__getattribute__(cls, name)

    class C(metaclass=Meta):
        pass

    c = C()
    c.x = np.ones(3)
    with pytest.raises(KeyboardInterrupt, match=f"from the metaclass: {attr}"):
        devpickle.scan([c])
    assert raised == [attr]
    raised.clear()
    with pytest.raises(KeyboardInterrupt):  # classified afresh, not from a cache filled while it was held
        devpickle.scan([c])
    assert raised == [attr]


def test_an_interrupt_raised_by_a_metaclass_asked_for_a_types_module_passes_through():
    # A type is named module.qualname (a <reduce T> step, a WalkError's
    # message, a frame's class): the __qualname__ lookup ran with the
    # __module__ lookup's KeyboardInterrupt still pending, which CPython
    # turned into a SystemError, then cleared: the interrupt was lost and the
    # walk went on.
    class Meta(type):
        def __getattribute__(cls, name):
            if name == "__module__":
                raise KeyboardInterrupt("from the metaclass: __module__")
            return type.__getattribute__(cls, name)

    class C(metaclass=Meta):
        def __reduce__(self):
            return (dict, (), {"t": np.ones(2)})

    class Fails(metaclass=Meta):
        def __reduce__(self):
            raise ValueError("cannot")

    for walk in (devpickle.scan, devpickle.dumps):
        for value in ([C()], [Fails()]):
            with pytest.raises(KeyboardInterrupt, match="from the metaclass"):
                walk(value)


@pytest.mark.parametrize("reduce", [False, True])
def test_a_metaclass_whose_hash_raises_is_a_walk_error_naming_the_object_an_interrupt_passes_through(reduce):
    # The class is looked up in copyreg.dispatch_table, which hashes it: a
    # metaclass's __hash__ is the value's code. What it raised escaped as
    # itself (a bare ValueError, no path), or, in dumps, as a WalkError
    # saying the __dict__ could not be read.
    class Meta(type):
        def __hash__(cls):
            raise cls.error("from the metaclass's __hash__")

    body = {"__reduce__": lambda self: (dict, ())} if reduce else {}
    C = Meta("C", (), body)
    C.error = ValueError
    for walk in (devpickle.scan, devpickle.dumps, devpickle.Future().set_result):
        with pytest.raises(devpickle.WalkError, match="cannot be looked up in copyreg.dispatch_table") as e:
            walk({"k": [C()]})
        assert e.value.path == "$.k[0]" and isinstance(e.value.__cause__, ValueError)
    C.error = KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt, match="from the metaclass"):
        devpickle.scan({"k": [C()]})


@pytest.mark.parametrize("attr", ["__cuda_array_interface__", "__array_interface__", "__dlpack__", "__getnewargs__"])
def test_a_metaclass_is_never_asked_whether_the_instances_of_its_classes_have_an_attribute(attr):
    # getattr(cls, name) asks the metaclass too (its attributes, its
    # __getattr__), which answers for the class, never for an instance:
    # pickle looks __getnewargs__ up in the class's MRO, and cupy, numba and
    # torch getattr the instance. A catch-all metaclass made every instance
    # an array interface that its own getattr refused (a WalkError where
    # pickle succeeds).
    asked = []

    class Meta(type):
        def __getattr__(cls, name):
            asked.append(name)
            if name == attr:
                return 42
            raise AttributeError(name)

    class C(metaclass=Meta):
        pass

    c = C()
    c.x = np.ones(3)
    (a,) = devpickle.scan([c])
    assert (a.path, a.nbytes) == ("$[0].x", 24)
    assert attr not in asked
    f = devpickle.Future()
    f.set_result([c])
    assert f.wait()[0] is c
    assert devpickle.loads(devpickle.dumps([c], inline=True), classes=(C,))[0].x.tolist() == [1.0] * 3


def test_an_allocation_reads_as_a_read_only_mapping_of_its_fields():
    a = devpickle.scan({"x": np.ones(3)})[0]
    keys = ("device", "ptr", "nbytes", "refs", "path")
    assert a._fields == keys and a.keys() == keys and tuple(a) == keys and len(a) == 5
    assert dict(a) == dict(**a) == a._asdict() == {"device": "cpu", "ptr": a.ptr, "nbytes": 24, "refs": 1, "path": "$.x"}
    assert a.values() == ("cpu", a.ptr, 24, 1, "$.x") and a.items() == tuple(zip(keys, a.values()))
    assert "ptr" in a and "nope" not in a and 0 not in a
    assert a.get("nbytes") == 24 and a.get("nope") is None and a.get("nope", 7) == 7
    with pytest.raises(KeyError):
        a["nope"]
    with pytest.raises(TypeError):
        a["ptr"] = 1
    assert isinstance(a, collections.abc.Mapping)


def test_an_allocation_finds_its_keys_given_as_a_str_subclass_and_takes_get_s_arguments_as_a_dict_does():
    class Key(str):
        pass

    a = devpickle.scan({"x": np.ones(3)})[0]
    assert a[Key("ptr")] == a.ptr and Key("refs") in a and a.get(Key("nbytes")) == 24
    assert [k in a for k in ("device", "ptr", "nbytes", "refs", "path", "Device", "", None)] == [True] * 5 + [False] * 3
    with pytest.raises(TypeError) as e:
        a.get()
    assert str(e.value) == "get expected at least 1 argument, got 0"
    with pytest.raises(TypeError) as e:
        a.get("ptr", 1, 2)
    assert str(e.value) == "get expected at most 2 arguments, got 3"
    with pytest.raises(KeyError) as e:
        a[1]
    assert type(e.value) is KeyError and e.value.args == (1,)


def test_an_allocation_key_is_its_whole_str_never_a_field_name_before_a_nul():
    # as a dict's: "ptr\0x" is no key of it, though a C string of it reads "ptr"
    a = devpickle.scan({"x": np.ones(3)})[0]
    assert "ptr\x00x" not in a and "path\x00" not in a and a.get("nbytes\x00", 7) == 7
    with pytest.raises(KeyError):
        a["device\x00"]
    assert all(k in a for k in a._fields)


def test_refs_docstring_counts_storages_as_the_docs_do():
    # PYTHON.md: refs counts the distinct Python objects -- tensors, arrays,
    # storages -- found on the memory; help() says the same
    t = torch.ones(2)
    assert devpickle.scan([t, t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._storage])[0].refs == 2
    assert "storages" in devpickle.Allocation.refs.__doc__


class DictItems:
    """The items of a dict, read as a Mapping reads them (no Mapping base)."""

    def __init__(self, d):
        self.d = d

    def __getitem__(self, k):
        return self.d[k]

    def __iter__(self):
        return iter(self.d)

    def __len__(self):
        return len(self.d)


def test_an_allocation_equals_a_mapping_only_registered_as_one_whose_own_eq_knows_nothing_of_mappings():
    class Registered(DictItems):  # not a Mapping subclass: object's __eq__, which answers NotImplemented
        def keys(self):
            return self.d.keys()

    collections.abc.Mapping.register(Registered)
    a = devpickle.scan({"x": np.ones(3)})[0]
    d = dict(a)
    assert a == Registered(d) and Registered(d) == a and not a != Registered(d)
    assert a != Registered({**d, "path": None}) and not a == Registered({**d, "path": None})


def test_reading_an_allocation_as_a_mapping_keeps_nothing_it_made():
    import tracemalloc

    a = devpickle.scan({"x": np.ones(3)})[0]
    d = dict(a)

    def read():
        assert a._asdict() == d and a == d and not a != d and a.values() and a.items() and a.keys()
        assert a.get("path") == a["path"] == a.path == "$.x" and a.get("device") == a.device == "cpu"
        assert repr(a).endswith("path='$.x')")

    read()
    refs = sys.getrefcount(a.path), sys.getrefcount(a.device)
    tracemalloc.start()
    try:
        for _ in range(100):  # the interpreter's own caches fill first
            read()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(500):
            read()
        assert tracemalloc.get_traced_memory()[0] - before < 4096
    finally:
        tracemalloc.stop()
    assert (sys.getrefcount(a.path), sys.getrefcount(a.device)) == refs


def test_an_allocation_matches_mapping_patterns_and_equals_mappings_of_its_items():
    a = devpickle.scan({"x": np.ones(3)})[0]
    match a:
        case {"ptr": p, "nbytes": 24}:
            assert p == a.ptr
        case _:
            pytest.fail("a mapping pattern did not match an Allocation")

    class M(DictItems, collections.abc.Mapping):
        pass

    d = dict(a)
    assert a == d and d == a and a == M(d) and M(d) == a and not a != d
    assert a != {**d, "refs": 2} and a != {k: d[k] for k in list(d)[:4]} and a != [*a] and a != 1
    assert set(a.keys()) == d.keys()  # keys() is a tuple (documented), not a view


def test_the_depth_limit_on_a_chain_of_objects_names_the_objects_class_not_its_dict():
    class Node:
        pass

    x = torch.zeros(1)
    for _ in range(262_145):
        n = Node()
        n.a = x
        x = n
    with pytest.raises(devpickle.WalkError, match=r"cannot walk a '[\w.<>]*Node' at \$.*: too deep") as e:
        devpickle.scan(x)
    assert e.value.type_name.endswith("Node") and isinstance(e.value.__cause__, RecursionError)


class Reduced:
    def __init__(self, child):
        self.child = child

    def __reduce__(self):
        return (Reduced, (self.child,))


def test_the_depth_limit_on_a_chain_of_reduced_objects_names_their_class_not_the_reduce_tuple():
    x = torch.zeros(1)
    for _ in range(131_073):  # two levels each: the reduce, its args
        x = Reduced(x)
    with pytest.raises(devpickle.WalkError, match="too deep") as e:
        devpickle.scan(x)
    assert e.value.type_name.endswith("Reduced")


class _DLProducer:
    """A DLPack producer returning whatever it is given (a capsule, or a
    function making one)."""

    def __init__(self, device, capsule):
        self.device, self.capsule = device, capsule

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        return self.capsule() if callable(self.capsule) else self.capsule


def _dl_capsule(shape, strides=None, *, data=0x10000, bits=32, name=b"dltensor", version=None, device=(1, 0)):
    """A DLManagedTensor (or the versioned form) built by hand, in a capsule
    without a destructor: (capsule, what keeps its memory alive)."""
    import ctypes

    n = len(shape)

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                    ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                    ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    shp = (ctypes.c_int64 * max(n, 1))(*shape)
    st = (ctypes.c_int64 * max(n, 1))(*strides) if strides is not None else None
    t = DLTensor(data, device[0], device[1], n, 2, bits, 1, shp, st, 0)
    if version is None:
        head = ctypes.create_string_buffer(bytes(t) + bytes(16))  # DLManagedTensor: the tensor, ctx, deleter
    else:
        head = ctypes.create_string_buffer(
            version[0].to_bytes(4, "little") + version[1].to_bytes(4, "little") + bytes(24) + bytes(t))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(head), name, None), (head, shp, st, name)


def test_dlpack_a_consumed_or_foreign_capsule_is_a_walk_error_never_read():
    import datetime

    t = torch.arange(10, dtype=torch.float32)
    used = torch.utils.dlpack.to_dlpack(t)
    torch.utils.dlpack.from_dlpack(used)  # consumed: renamed "used_dltensor", its tensor its consumer's
    with pytest.raises(devpickle.WalkError, match="named 'used_dltensor'") as e:
        devpickle.scan({"x": _DLProducer((1, 0), used)})
    assert e.value.path == "$.x"
    with pytest.raises(devpickle.WalkError, match="named 'datetime.datetime_CAPI'"):  # not a DLManagedTensor
        devpickle.scan(_DLProducer((1, 0), datetime.datetime_CAPI))
    with pytest.raises(devpickle.WalkError, match="a 'NoneType', not a capsule"):
        devpickle.scan(_DLProducer((1, 0), None))
    ok = devpickle.scan(_DLProducer((1, 0), lambda: torch.utils.dlpack.to_dlpack(t)))
    assert [(a.device, a.ptr, a.nbytes) for a in ok] == [("cpu", t.data_ptr(), 40)]


@pytest.mark.parametrize("dev", [(2, 256), (2, 300), (2, -1)])
def test_dlpack_a_cuda_device_id_out_of_range_is_a_walk_error_never_another_device(dev):
    cap, _keep = _dl_capsule((4,))
    with pytest.raises(devpickle.WalkError, match=f"DLPack device id {dev[1]} is not a CUDA device's"):
        devpickle.scan(_DLProducer(dev, cap))


def test_dlpack_a_device_that_is_not_a_pair_is_named_as_such():
    cap, _keep = _dl_capsule((4,))
    with pytest.raises(devpickle.WalkError, match=r"must return a \(device_type, device_id\) tuple, not list"):
        devpickle.scan(_DLProducer([1, 0], cap))


@pytest.mark.parametrize("shape, strides", [((-3,), None), ((2, -3), None), ((-3,), (1,)), ((2,), (2**62,))])
def test_dlpack_a_negative_shape_or_overflowing_strides_is_a_walk_error(shape, strides):
    cap, _keep = _dl_capsule(shape, strides)
    with pytest.raises(devpickle.WalkError, match="bad shape, strides or dtype"):
        devpickle.scan(_DLProducer((1, 0), cap))


def test_dlpack_capsules_built_by_hand_describe_their_extent():
    cap, _keep = _dl_capsule((2, 3), (1, 2), data=0x10000)  # a transposed view: items 0..5, 4 bytes each
    assert [(a.ptr, a.nbytes) for a in devpickle.scan(_DLProducer((1, 0), cap))] == [(0x10000, 24)]
    cap, _keep = _dl_capsule((0, 3), data=0x10000)
    assert devpickle.scan(_DLProducer((1, 0), cap)) == []
    cap, _keep = _dl_capsule((4,), name=b"dltensor_versioned", version=(1, 0))
    assert [(a.ptr, a.nbytes) for a in devpickle.scan(_DLProducer((1, 0), cap))] == [(0x10000, 16)]
    cap, _keep = _dl_capsule((4,), name=b"dltensor_versioned", version=(2, 0))
    with pytest.raises(devpickle.WalkError, match=r"a DLPack 2\.x capsule"):
        devpickle.scan(_DLProducer((1, 0), cap))


class _CAI:
    def __init__(self, **cai):
        self.cai = {"data": (0x100000, False), "typestr": "<f4", "version": 3, **cai}

    @property
    def __cuda_array_interface__(self):
        return self.cai


@pytest.mark.parametrize("shape, strides, typestr, lo, extent", [
    ((4, 4), None, "<f4", 0, 64),
    ((2,), (6,), "<f4", 0, 10),      # a stride that is not a multiple of the item size: bytes 0..9
    ((3,), (2,), "<f4", 0, 8),       # overlapping items: bytes 0..7
    ((2,), (-6,), "<f4", -6, 10),    # backwards: bytes -6..3
    ((3, 2), (2, 12), "<f4", 0, 20),
    ((2,), None, "<U10", 0, 80),     # numpy reads <U10 as 10 characters of 4 bytes
    ((2,), None, "<M8[ns]", 0, 16),
    ((2, 0), None, "<f4", 0, 0),     # empty: no memory
])
def test_cuda_array_interface_extent_is_read_in_bytes_as_given(shape, strides, typestr, lo, extent):
    got = devpickle.scan([_CAI(shape=shape, strides=strides, typestr=typestr)])
    if not extent:
        assert got == []
        return
    assert [(a.device, a.ptr, a.nbytes, a.path) for a in got] == [("cuda:0", 0x100000 + lo, extent, "$[0]")]


@pytest.mark.parametrize("shape, strides, message", [
    ((-3,), None, r"a negative dimension \(-3\) in shape"),
    ((4, -3), None, r"a negative dimension \(-3\) in shape"),
    ((-1,), (4,), r"a negative dimension \(-1\) in shape"),
    ((2**40, 2**40, 2**40), None, "the view's extent overflows"),
    ((3, 2), (2**62, 4), "the view's extent overflows"),
    ((2,), (2**70,), "too large"),
])
def test_cuda_array_interface_a_negative_or_overflowing_shape_is_a_walk_error(shape, strides, message):
    with pytest.raises(devpickle.WalkError, match=message) as e:
        devpickle.scan({"x": _CAI(shape=shape, strides=strides)})
    assert e.value.path == "$.x" and e.value.type_name.endswith("_CAI")


@pytest.mark.parametrize("data, shape, strides, message", [
    ((-1, False), (4,), None, "a negative address in data"),      # read as 0xffffffffffffffff
    ((-2**70, False), (4,), None, "a negative address in data"),
    ((8, False), (4,), (-4,), "the view's extent overflows"),      # bytes -4..11: below address 0
    ((2**64 - 8, False), (4,), None, "the view's extent overflows"),  # past the top of the address space
    ((0, False), (4,), None, "a NULL data pointer for a view that is not empty"),
])
def test_cuda_array_interface_an_address_range_outside_memory_is_a_walk_error(data, shape, strides, message):
    # an extent that overflows is a WalkError (docs/PYTHON.md): the address
    # with it, not only the shape; a negative address was taken as a huge one
    with pytest.raises(devpickle.WalkError, match=message) as e:
        devpickle.scan({"x": _CAI(data=data, shape=shape, strides=strides)})
    assert e.value.path == "$.x"
    assert devpickle.scan(_CAI(data=(0, False), shape=(0,))) == []  # NULL is an empty view's address


def test_an_allocation_at_address_zero_reads_as_hex_in_its_repr():
    # "%p" wrote NULL as "0x(nil)"; a backwards view from 12 starts at 0
    got = devpickle.scan(_CAI(data=(12, False), shape=(4,), strides=(-4,)), paths=False)
    assert [(a.ptr, a.nbytes) for a in got] == [(0, 16)]
    assert repr(got[0]) == "Allocation(device='cuda:0', ptr=0x0, nbytes=16, refs=1, path=None)"
    got = devpickle.scan(_CAI(data=(0x1000, False), shape=(4,)), paths=False)
    assert repr(got[0]) == "Allocation(device='cuda:0', ptr=0x1000, nbytes=16, refs=1, path=None)"


@pytest.mark.parametrize("typestr", ["<f", "<f0", "<fx", "f4", "<f99999999999999999999999"])
def test_cuda_array_interface_a_typestr_without_an_item_size_is_a_walk_error(typestr):
    with pytest.raises(devpickle.WalkError, match=f"unsupported typestr '{typestr}': it names no item size"):
        devpickle.scan(_CAI(shape=(2,), typestr=typestr))


def test_cuda_array_interface_of_more_than_64_dimensions_is_a_walk_error_saying_so():
    with pytest.raises(devpickle.WalkError, match=r"unsupported shape: 65 dimensions \(64 at most\)"):
        devpickle.scan(_CAI(shape=(1,) * 65))


class _Interfaces:
    """An object with a __cuda_array_interface__ as given (not completed, as _CAI's is)."""

    def __init__(self, cai):
        self.cai = cai

    @property
    def __cuda_array_interface__(self):
        return self.cai


class _ArrayInterface:
    """An object with an __array_interface__ as given."""

    def __init__(self, cai):
        self.cai = cai

    @property
    def __array_interface__(self):
        return self.cai


@pytest.mark.parametrize("cls, name", [(_Interfaces, "__cuda_array_interface__"),
                                       (_ArrayInterface, "__array_interface__")])
@pytest.mark.parametrize("cai, says", [
    ([("data", (16, False))], "it is a 'list', not a dict"),
    ({"shape": (2,), "typestr": "<f4"}, r"data must be a tuple \(address, read-only flag\), not missing"),
    ({"data": 16, "shape": (2,), "typestr": "<f4"}, r"data must be a tuple \(address, read-only flag\), not a 'int'"),
    ({"data": (), "shape": (2,), "typestr": "<f4"}, r"data must be a tuple \(address, read-only flag\), not an empty tuple"),
    ({"data": (16, False), "typestr": "<f4"}, "shape must be a tuple of ints, not missing"),
    ({"data": (16, False), "shape": [2], "typestr": "<f4"}, "shape must be a tuple of ints, not a 'list'"),
    ({"data": (16, False), "shape": (2,)}, "typestr must be a str \\(as '<f4'\\), not missing"),
    ({"data": (16, False), "shape": (2,), "typestr": 4}, "typestr must be a str \\(as '<f4'\\), not a 'int'"),
])
def test_a_malformed_array_interface_says_which_part_is_wrong_and_what_it_is_instead(cls, name, cai, says):
    # each of these said only that the interface "lacks data, shape or
    # typestr", though it held them (a list for shape, numpy's own refusal)
    with pytest.raises(devpickle.WalkError, match=f"a malformed {name}: {says}") as e:
        devpickle.scan({"x": cls(cai)})
    assert e.value.path == "$.x"


def test_an_ndarray_subclass_property_cannot_hide_what_the_array_holds():
    class LyingBase(np.ndarray):
        @property
        def base(self):  # names other memory than the array's
            return b"x" * 64

    a = np.arange(10.0).view(LyingBase)
    got = devpickle.scan(a)
    assert [(x.ptr, x.nbytes) for x in got] == [(a.ctypes.data, 80)]

    class LyingDtype(np.ndarray):
        @property
        def dtype(self):  # an object array that says it holds floats
            return np.dtype("f8")

    o = np.empty(2, dtype=object)
    o[:] = [torch.ones(2), torch.ones(3)]
    got = devpickle.scan(o.view(LyingDtype))
    assert [x.nbytes for x in got] == [8, 12]  # the tensors, not the pointer block

    class RaisingDtype(np.ndarray):
        @property
        def dtype(self):
            raise RuntimeError("no dtype")

    r = np.arange(3.0).view(RaisingDtype)
    assert [(x.ptr, x.nbytes) for x in devpickle.scan(r)] == [(r.ctypes.data, 24)]


# a child's st(t): the (data_ptr, nbytes) of tensor t's untyped storage, on
# torch 1.13 and 2.x alike
_CHILD_STORAGE = (
    "def st(t):\n"
    "    s = t.untyped_storage() if hasattr(t, 'untyped_storage') else t.storage()._storage\n"
    "    return (s.data_ptr(), s.nbytes())\n"
)


_SPARSE_COMPRESSED = (
    "import torch, devpickle, warnings\n"
    "warnings.simplefilter('ignore')\n"
    "d = torch.tensor([[1.0, 0, 0, 2], [0, 0, 3, 0], [0, 0, 0, 0], [4, 0, 0, 5]])\n"
    + _CHILD_STORAGE +
    "for name, make, parts in [\n"
    "        ('csr', lambda: d.to_sparse_csr(), ('crow_indices', 'col_indices', 'values')),\n"
    "        ('csc', lambda: d.to_sparse_csc(), ('ccol_indices', 'row_indices', 'values')),\n"
    "        ('bsr', lambda: d.to_sparse_bsr((2, 2)), ('crow_indices', 'col_indices', 'values')),\n"
    "        ('bsc', lambda: d.to_sparse_bsc((2, 2)), ('ccol_indices', 'row_indices', 'values'))]:\n"
    "    try:\n"
    "        s = make()\n"
    "    except (AttributeError, RuntimeError, NotImplementedError):\n"
    "        continue\n"
    "    got = [(a.ptr, a.nbytes, a.path) for a in devpickle.scan({'s': s})]\n"
    "    want = [st(getattr(s, p)()) + ('$.s',) for p in parts]\n"
    "    assert got == want, (name, got, want)\n"
    "    print(name, devpickle._devpickle._torch_adapter())\n"
)


def _run_child_adapter(code, no_adapter):
    """code run by a child interpreter, with the C++ torch adapter
    (no_adapter "0") or without it ("1": DEVPICKLE_NO_TORCH_ADAPTER)."""
    import os
    env = dict(os.environ)
    env.pop("DEVPICKLE_NO_TORCH_ADAPTER", None)
    if no_adapter == "1":
        env["DEVPICKLE_NO_TORCH_ADAPTER"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def _assert_child_prints(code, no_adapter, marker):
    """code ran to its end in a child (_run_child_adapter) and printed marker."""
    out = _run_child_adapter(code, no_adapter)
    assert out.returncode == 0, out.stderr
    assert marker in out.stdout


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_sparse_compressed_tensors_are_walked_with_or_without_the_torch_adapter(no_adapter):
    # the Python path (no C++ adapter) read only COO: a CSR tensor's storage
    # lookup raised, a WalkError where the adapter gives its three tensors
    _assert_child_prints(_SPARSE_COMPRESSED, no_adapter, "csr")


_QUANTIZED = (
    "import torch, devpickle\n"
    "x = torch.randn(4, 3)\n"
    + _CHILD_STORAGE +
    "scales = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.double)\n"
    "for q in [torch.quantize_per_channel(x, scales, torch.tensor([0, 1, 2, 3]), 0, torch.qint8),\n"
    "          torch.quantize_per_channel(x, scales.float(), scales.float(), 0, torch.quint8)]:\n"
    "    s, z = q.q_per_channel_scales(), q.q_per_channel_zero_points()\n"
    "    got = [(a.ptr, a.nbytes, a.refs, a.path) for a in devpickle.scan({'q': q, 'v': q.detach()})]\n"
    "    want = [st(t) + (2, '$.q') for t in (q, s, z)]\n"
    "    assert got == want, (q.qscheme(), got, want)\n"
    "    assert len({a[0] for a in got}) == 3\n"
    "    f = devpickle.Future(devices=[])\n"
    "    f.set_result([q])\n"
    "    assert f.wait()[0] is q\n"
    "    try:\n"
    "        devpickle.dumps(q)\n"
    "    except devpickle.WalkError as e:\n"
    "        assert 'per-channel quantized' in str(e) and e.path == '$', e\n"
    "    else:\n"
    "        raise AssertionError('dumps carried a quantized tensor')\n"
    "p = torch.quantize_per_tensor(x, 0.1, 2, torch.quint8)\n"
    "assert [(a.ptr, a.nbytes) for a in devpickle.scan([p])] == [st(p)]\n"
    "print('quantized', devpickle._devpickle._torch_adapter())\n"
)


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_a_per_channel_quantized_tensor_gives_its_storage_scales_and_zero_points_with_or_without_the_adapter(
        no_adapter):
    # pickle carries a per-channel quantized tensor's scales and zero points
    # (tensors of the quantizer's own) in its reduce, and kernels read them
    # with the values: the walk reported the data storage alone
    _assert_child_prints(_QUANTIZED, no_adapter, "quantized")


def test_a_cuda_array_interface_set_on_the_instance_is_device_memory_too():
    # cupy.asarray, numba and torch.as_tensor read the interface with getattr,
    # so an instance carrying it in its __dict__ is device memory to them
    class Wrapper:
        def __init__(self, cai, **attrs):
            self.__cuda_array_interface__ = cai
            self.__dict__.update(attrs)

    cai = {"data": (0x200000, False), "shape": (8,), "typestr": "<f4", "version": 3}
    w = Wrapper(cai, extra=torch.ones(3))
    got = devpickle.scan({"w": w})
    assert [(a.device, a.ptr, a.nbytes, a.path) for a in got] == [
        ("cuda:0", 0x200000, 32, "$.w"), ("cpu", w.extra.data_ptr(), 12, "$.w.extra")]
    with pytest.raises(devpickle.WalkError, match="a negative dimension"):
        devpickle.scan(Wrapper(dict(cai, shape=(-1,))))
    with pytest.raises(devpickle.WalkError, match="memory that cannot be carried in a frame") as e:
        devpickle.dumps({"w": w})
    assert e.value.path == "$.w"


def test_an_interface_set_on_an_instance_that_pickle_reduces_for_its_dict_keys_is_still_its_memory():
    # a plain instance whose __dict__ holds a key that is no str (or one of
    # a str subclass) is reduced, as pickle reduces it; the interface set on
    # it is device memory all the same, as for any plain or reduced object
    class Plain:
        pass

    class Name(str):
        pass

    cai = {"data": (0x200000, False), "shape": (8,), "typestr": "<f4", "version": 3}
    t = torch.ones(2)
    for key in (1, Name("k")):
        o = Plain()
        o.__cuda_array_interface__ = cai
        o.__dict__[key] = t
        got = devpickle.scan(o)
        assert [(a.device, a.ptr, a.path) for a in got][:1] == [("cuda:0", 0x200000, "$")]
        assert t.data_ptr() in [a.ptr for a in got]


def test_an_instance_interface_read_by_code_that_replaces_the_instance_dict_is_walked_safely():
    # Looking the interface up in a plain instance's dict compares it with a
    # key of the same hash: a str subclass whose __eq__ replaces the
    # instance's __dict__ frees the dict the lookup reads, unless it holds it.
    # (A key of a str subclass has the instance reduced, as pickle reduces
    # it: the interface is looked up first, and the reduce then reads the
    # __dict__ the key's __eq__ left, which holds the interface alone.)
    cai = {"data": (0x200000, False), "shape": (8,), "typestr": "<f4", "version": 3}
    box = []

    class Evil(str):
        def __hash__(self):
            return hash("__cuda_array_interface__")

        def __eq__(self, other):
            if box:
                object.__setattr__(box.pop(), "__dict__", {"__cuda_array_interface__": cai})
                [{"k%d" % i: i} for i in range(1000)]  # reuses the freed dict's memory
            return False

        __ne__ = object.__ne__

    class Sneaky:
        pass

    for _ in range(10):
        s = Sneaky()
        s.__dict__[Evil("x")] = 0  # met first by the lookup of the interface
        s.__dict__["__cuda_array_interface__"] = cai
        s.__dict__.update({"t%d" % j: torch.ones(1) for j in range(20)})
        box[:] = [s]
        got = devpickle.scan(s)
        assert [(a.ptr, a.path) for a in got] == [(0x200000, "$")]  # the interface; the dict left holds no tensor
        assert box == []


def test_a_tensor_whose_dict_a_keys_eq_replaces_is_looked_up_in_its_own_dict_not_in_freed_memory():
    # Whether a tensor has a __reduce_ex__ of its own is looked up in its
    # __dict__, which the lookup compares with a key of the same hash: a str
    # subclass whose __eq__ replaced the tensor's __dict__ freed the dict
    # under the lookup, which then read the dict made next in its memory —
    # here one holding __reduce_ex__, so the tensor was reduced (refs 2).
    victims, made = [], []

    class Evil(str):
        def __hash__(self):
            return hash("__reduce_ex__")

        def __eq__(self, other):
            while victims:
                victims.pop().__dict__ = {}  # frees the dict being looked in
                made.append({"__reduce_ex__": 1, "b": 2})  # made in its memory (the dicts' free list)
            return False

        __ne__ = object.__ne__

    for _ in range(10):
        t = torch.ones(3)
        t.__dict__[Evil("x")] = 1
        victims.append(t)
        found = devpickle.scan([t])
        assert [(a.path, a.refs) for a in found] == [("$[0]", 1)]  # its memory; no reduce of its own
        assert victims == [] and t.__dict__ == {}


def test_an_array_interface_without_the_buffer_protocol_is_the_cpu_memory_it_describes():
    # np.asarray(x) makes an array over the memory x's class's
    # __array_interface__ names: that memory is x's, reported at x's path,
    # and what pickle would walk of x is walked too
    a = np.arange(16.0)

    class Prop:
        def __init__(self, a, t):
            self._iface = dict(a.__array_interface__)
            self.t = t

        @property
        def __array_interface__(self):
            return self._iface

    t = torch.ones(3)
    got = devpickle.scan({"p": Prop(a[4:], t), "q": Prop(a[::2], None)})
    assert [(x.device, x.ptr, x.nbytes) for x in got] == [
        ("cpu", a.ctypes.data + 32, 96), ("cpu", t.data_ptr(), 12), ("cpu", a.ctypes.data, 120)]
    assert [x.path for x in got] == ["$.p", "$.p.t", "$.q"]  # a plain class's attributes, as without it
    assert np.asarray(Prop(a[::2], None))[1] == 2.0  # what numpy makes of it: the same memory

    class Copying:  # PIL's way: a fresh bytes object each time, no address of its own
        @property
        def __array_interface__(self):
            return {"data": b"\0" * 8, "shape": (8,), "typestr": "|u1", "version": 3}

    assert devpickle.scan(Copying()) == []

    class Reduced(Prop):  # a class of its own reduce: reduced, as without it
        def __reduce__(self):
            return (Reduced, (None, self.t))

    got = devpickle.scan(Reduced(a[4:], t))
    assert [x.ptr for x in got] == [a.ctypes.data + 32, t.data_ptr()]
    assert got[1].path.startswith("$<reduce ") and got[1].path.endswith(">.args[1]")
    bad = Prop(a, None)
    bad._iface = {"data": (4096, False), "shape": (-1,), "typestr": "<f8"}
    with pytest.raises(devpickle.WalkError, match=r"a malformed __array_interface__: a negative dimension") as e:
        devpickle.scan([bad])
    assert e.value.path == "$[0]"
    frame = devpickle.dumps(Prop(a, None))  # carried as pickle carries it: reduced
    assert len(frame) > 0


def test_a_cuda_array_interface_on_a_reduced_instance_is_device_memory_too():
    import types

    cai = {"data": (0x300000, False), "shape": (4,), "typestr": "<f4", "version": 3}
    t = torch.ones(2)
    got = devpickle.scan({"ns": types.SimpleNamespace(__cuda_array_interface__=cai, t=t)})
    assert [(a.device, a.ptr, a.nbytes) for a in got] == [("cuda:0", 0x300000, 16), ("cpu", t.data_ptr(), 8)]
    assert got[0].path == "$.ns" and got[1].path == "$.ns<reduce types.SimpleNamespace>.state.t"

    class Reduced:
        def __init__(self):
            self.__cuda_array_interface__ = cai

        def __reduce__(self):
            return (Reduced, ())

    assert [(a.device, a.path) for a in devpickle.scan([Reduced()])] == [("cuda:0", "$[0]")]
    for v in (types.SimpleNamespace(__cuda_array_interface__=cai), Reduced()):
        with pytest.raises(devpickle.WalkError, match="memory that cannot be carried in a frame"):
            devpickle.dumps(v)


@pytest.mark.parametrize("said, capsule", [((1, 0), (2, 0)), ((2, 0), (1, 0)), ((2, 0), (2, 1))])
def test_dlpack_a_capsule_on_another_device_than_dlpack_device_said_is_a_walk_error(said, capsule):
    cap, _keep = _dl_capsule((4,), device=capsule)
    with pytest.raises(devpickle.WalkError, match=r"__dlpack_device__ says \(%d, %d\), its capsule \(%d, %d\)"
                       % (said + capsule)):
        devpickle.scan(_DLProducer(said, cap))
    cap, _keep = _dl_capsule((4,), device=said)
    assert [a.device for a in devpickle.scan(_DLProducer(said, cap))] == ["cpu" if said[0] == 1 else "cuda:0"]


class _Node:
    def __init__(self, child):
        self.child = child


class _ReturnsLevel:
    """Holds a level of a chain by weak reference only (no count), and its
    reduce hands the walk a strong one: a new reference, made mid-walk, to
    an object the walk entered without the memo."""

    def __init__(self, node):
        self.w = weakref.ref(node)

    def __reduce__(self):
        return (_ReturnsLevel, (), {"x": self.w()})


def _chain_with_late_references(depth):
    nodes = [_Node(torch.ones(1))]
    for _ in range(depth - 1):
        nodes.append(_Node(nodes[-1]))
    nodes.reverse()  # nodes[0] is the top; each node's one reference is its parent's attribute
    return [nodes[0]] + [_ReturnsLevel(n) for n in nodes]  # the list of nodes goes


def test_objects_with_one_reference_met_again_through_reduces_keep_the_walk_linear():
    """An object whose one reference is its container's slot is walked
    without the memo; once the walk has run Python code (a reduce), every
    object enters it, so a chain met again from every one of its levels,
    through references the reduces make, is walked at most twice — not once
    per level (quadratic)."""
    import time

    def cpu(depth):
        value = _chain_with_late_references(depth)
        best = 1e9
        for _ in range(7):
            t0 = time.thread_time()
            got = devpickle.scan(value, paths=False)
            best = min(best, time.thread_time() - t0)
        assert [(a.nbytes, a.refs) for a in got] == [(4, 1)]
        return best

    # 16x the depth: linear ~16x, quadratic ~256x — but a deep chain also
    # leaves the caches, and the walk measures 35-45x here (the same before
    # and after the memo rule); a machine under load once gave 66x. The bound
    # sits 2x under quadratic, which with the caches' share comes to ~600x.
    small, large = cpu(400), cpu(6400)
    assert large < 128 * small, (small, large)


def test_a_chain_met_again_through_reduces_keeps_its_first_path_and_its_count():
    value = _chain_with_late_references(5)
    (a,) = devpickle.scan(value)
    assert (a.refs, a.path) == (1, "$[0].child.child.child.child.child")
    f = devpickle.Future()
    f.set_result(value)
    assert len(f._allocations()) == 1


def _fields(allocs):
    return [(a.device, a.ptr, a.nbytes, a.refs) for a in allocs]


def test_small_containers_held_once_give_the_same_allocations_with_or_without_paths():
    """Without paths, a small list or tuple held once is read in place (no
    frame, no memo): the allocations, their order and their counts are those
    the walk with paths finds."""
    ts = [torch.ones(i + 1) for i in range(6)]
    values = [
        [(t, [t[:1]]) for t in ts],
        [(t,) for t in ts] + [(ts[0], ts[0][1:], 3, "x")],
        [[t, None, 1.5] for t in ts] + [[], ()],
        [tuple(ts) + (1,) * 5, (ts[0],) * 9],  # past the size read in place
        [(torch.ones(2), [torch.ones(3), (torch.ones(4),)])],
    ]
    for v in values:
        assert _fields(devpickle.scan(v, paths=False)) == _fields(devpickle.scan(v)), v
        f = devpickle.Future()
        f.set_result(v)
        assert sorted(f._allocations()) == sorted((d, p, n) for d, p, n, _ in _fields(devpickle.scan(v)))


def test_a_tensor_without_memory_in_a_small_tuple_names_its_own_path_without_paths_too():
    meta = torch.empty(2, device="meta")
    for paths in (False, True):
        with pytest.raises(devpickle.WalkError) as e:
            devpickle.scan([(torch.ones(1),), (torch.ones(2), meta)], paths=paths)
        assert "$[1][1]" in str(e.value), str(e.value)


class _FreshTensorReduce:
    """A reduce that makes a new tensor each call (a conversion in
    __reduce__) and carries the object itself in its state, as pickle
    allows (the object is memoized before its state)."""

    calls = 0

    def __reduce__(self):
        type(self).calls += 1
        return (_FreshTensorReduce, (), {"me": self, "t": torch.ones(3)})


class _ParentByWeakref:
    calls = 0

    def __init__(self, parent):
        self.w = weakref.ref(parent)

    def __reduce__(self):
        type(self).calls += 1
        return (_ParentByWeakref, (), {"parent": self.w(), "t": torch.ones(2)})


@pytest.mark.parametrize("how", ["scan", "paths", "future"])
def test_an_object_held_once_runs_its_reduce_once_as_pickle_does(how):
    """An object whose one reference is its container's slot skipped the
    memo even when its walk ran its reduce: a reduce handing the object
    back (in its state, or its parent's through a weak reference) had it
    walked, and reduced, twice — two tensors where pickle (and dumps) make
    one."""

    def walk(value):
        if how == "future":
            f = devpickle.Future()
            f.set_result(value)
            return f._allocations()
        return devpickle.scan(value, paths=how == "paths")

    _FreshTensorReduce.calls = 0
    assert len(walk([_FreshTensorReduce()])) == 1
    assert _FreshTensorReduce.calls == 1
    parent = _Node(None)
    parent.child = _ParentByWeakref(parent)
    value = [parent]
    del parent
    _ParentByWeakref.calls = 0
    assert len(walk(value)) == 1
    assert _ParentByWeakref.calls == 1
    _ParentByWeakref.calls = 0
    pickle.dumps(value)
    assert _ParentByWeakref.calls == 1


def test_code_run_by_an_array_interface_or_opaque_isinstance_cannot_loop_the_walk():
    """A property read for __array_interface__, or an opaque type's
    __instancecheck__, is the value's code too: one that re-attached the
    parent walked without the memo (held once, by weak reference) had the
    walk meet it again, held once again, and run the code again, forever.
    Run at most 50 times here; once is right."""
    held, runs = [], [0]

    class Parent:
        pass

    class Iface:
        @property
        def __array_interface__(self):
            runs[0] += 1
            if runs[0] < 50:
                held[:] = [None] * len(held) + [wparent()]
            return {"shape": (0,), "typestr": "<f4", "data": (0, False), "version": 3}

    p = Parent()
    p.child = Iface()
    wparent = weakref.ref(p)
    held.append(p)
    del p
    devpickle.scan(held, paths=False)
    assert runs[0] == 1

    class Meta(type):
        def __instancecheck__(cls, o):
            if o is wchild():
                runs[0] += 1
                if runs[0] < 50:
                    held[:] = [None] * len(held) + [wparent()]
            return False

    class Opaque(metaclass=Meta):
        pass

    p = Parent()
    p.child = Parent()
    p.child.x = 1
    wparent, wchild = weakref.ref(p), weakref.ref(p.child)
    held[:] = [p]
    del p
    runs[0] = 0
    devpickle.scan(held, paths=False, opaque=(Opaque,))
    assert runs[0] == 1


def test_a_dict_emptied_while_its_keys_type_is_classified_never_walks_a_freed_value():
    # Classifying a key's type reads attributes of the class, which a
    # metaclass's __getattr__ answers with Python code: here it empties the
    # dict whose item is being walked. The value, held only by that dict,
    # was read after that code ran (freed: a crash); it is held first.
    d = {}

    class Meta(type):
        def __getattr__(cls, name):
            d.clear()
            raise AttributeError(name)

    class Key(metaclass=Meta):
        pass

    class Value:
        pass

    v = Value()
    v.t = torch.ones(3)
    d[Key()] = v
    del v
    with pytest.raises(devpickle.WalkError, match="dictionary changed size during the walk") as e:
        devpickle.scan({"d": d})
    assert (e.value.type_name, e.value.path) == ("dict", "$.d")


def test_an_array_interface_whose_dict_a_keys_eq_empties_is_read_from_parts_held():
    # Looking "typestr" up compares it with a key of the same hash: a str
    # subclass whose __eq__ empties the dict (and puts typestr back) freed
    # data and shape, found before, under the walk that then read them.
    box, junk = [], []

    class Evil(str):
        def __hash__(self):
            return hash("typestr")

        def __eq__(self, other):
            if box:
                d = box.pop()
                d.clear()
                d["typestr"] = "<f4"
                # the freed blocks, made again with other contents
                junk.extend(tuple([int("7")] * 42) for _ in range(8))
            return False

        __ne__ = object.__ne__

    class Iface:
        @property
        def __array_interface__(self):
            # tuples too long for CPython's free lists: freed memory is returned
            d = {"data": tuple([int("4096"), False] + [0] * 40), "shape": tuple([4] + [1] * 40), Evil("x"): 1}
            d["typestr"] = "<f4"
            box[:] = [d]
            return d

    (a,) = devpickle.scan([Iface()])
    assert (a.device, a.ptr, a.nbytes, a.path) == ("cpu", 4096, 16, "$[0]")


@pytest.mark.parametrize("bad_str", ["raises", "not a str"])
def test_a_reduce_error_whose_str_fails_is_still_a_walk_error_naming_it(bad_str):
    # The cause's text is the value's own code: an exception whose __str__
    # raises (or returns a non-str) made scan raise that __str__'s error in
    # place of the WalkError, which lost the type and the path.
    class Unprintable(Exception):
        def __str__(self):
            if bad_str == "raises":
                raise ValueError("no text")
            return 5

    class Refuses:
        def __reduce__(self):
            raise Unprintable()

    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"x": [Refuses()]})
    assert str(e.value).endswith("at $.x[0]: it cannot be reduced (if it holds no device memory, list its type in "
                                 "opaque=): <exception str() failed>")
    assert e.value.path == "$.x[0]" and isinstance(e.value.__cause__, Unprintable)
    f = devpickle.Future()
    with pytest.raises(devpickle.WalkError, match="exception str"):
        f.set_result([Refuses()])
    with pytest.raises(devpickle.WalkError, match="exception str"):
        f.wait()


def test_an_interrupt_raised_by_a_reduce_errors_str_passes_through():
    class Unprintable(Exception):
        def __str__(self):
            raise KeyboardInterrupt

    class Refuses:
        def __reduce__(self):
            raise Unprintable()

    with pytest.raises(KeyboardInterrupt):
        devpickle.scan([Refuses()])


SLOTNAMES_CHANGED = r"""
import torch, devpickle
class Name(str):  # a name only the class's __slotnames__ holds
    pass
def make(base, change):
    class C(base):
        __slots__ = ("s",)
        @property
        def extra(self):
            change(type(self).__slotnames__)
            return torch.ones(2)
    C.__slotnames__ = [Name("extra"), Name("s")]  # copyreg._slotnames returns it as it is
    return C
for base, make_one in [(devpickle.Future, lambda C: C()), (bytearray, lambda C: C(b"ab")),
                       (torch.Tensor, lambda C: torch.Tensor._make_subclass(C, torch.zeros(3)))]:
    for change in [list.clear, lambda names: names.append(Name("s")), lambda names: names.pop()]:
        o = make_one(make(base, change))
        o.s = torch.zeros(4)
        try:
            devpickle.scan([o])
        except devpickle.WalkError as e:
            assert "its __slots__ cannot be read: __slotnames__ changed size during the walk" in str(e), e
        else:
            raise AssertionError(f"the walk of a {base.__name__} went on")
    def rename(names):  # the same size: the name read is freed
        names[0] = Name("other")
    o = make_one(make(base, rename))
    if base is not torch.Tensor:  # dumps refuses a tensor with attributes
        assert [a.path for a in devpickle.scan([o])][-1] == "$[0].extra"
print("ok")
"""


def test_a_class_whose_slot_read_changes_its_slotnames_is_refused_as_object_getstate_refuses_it():
    # A future's, a bytearray's or a tensor's slots are read by the names
    # copyreg._slotnames gives, the class's own __slotnames__ list: a read
    # (a property it names) that changed that list freed the name being
    # read (a use after free), and one that grew it was read without end.
    # As object.__getstate__ does ("__slotnames__ changed size during
    # iteration"), a change in its size is a WalkError; the name read is
    # held. (A subprocess: the old code crashed.)
    r = subprocess.run([sys.executable, "-c", SLOTNAMES_CHANGED], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_a_tensor_whose_class_code_replaces_its_dict_while_its_slots_are_read_never_walks_a_freed_dict():
    # A tensor subclass with __slots__: the walk asks copyreg._slotnames for
    # them, which reads cls.__dict__ through the metaclass. Its
    # __getattribute__ here replaces the tensor's __dict__ — the dict the
    # walk had borrowed and then copied (freed: a crash).
    victim = []

    class Meta(type(torch.Tensor)):
        def __getattribute__(cls, name):
            if name == "__dict__" and victim:
                victim.pop().__dict__ = {"y": 1}
            return super().__getattribute__(name)

    class Slotted(torch.Tensor, metaclass=Meta):
        __slots__ = ("s",)

    class Box:
        pass

    t = torch.Tensor._make_subclass(Slotted, torch.zeros(3))
    b = Box()
    b.big = torch.ones(5)
    t.x = b
    t.s = 5
    del b
    victim.append(t)
    assert [a.path for a in devpickle.scan([t])] == ["$[0]", "$[0].x.big"]  # the dict found, walked whole
    t.x = Box()
    victim.append(t)
    with pytest.raises(devpickle.WalkError, match="a tensor's attributes"):
        devpickle.dumps([t])


_SCAN_WHILE_TORCH_IMPORTS = """
import threading, devpickle
stop = False
def spin():
    while not stop:
        devpickle.scan([1, 2])
        devpickle.Future().set_result([1])
t = threading.Thread(target=spin)
t.start()
import torch
stop = True
t.join()
print(devpickle._devpickle._torch_adapter(), [a.nbytes for a in devpickle.scan([torch.ones(3)])])
"""


def test_a_walk_on_another_thread_while_torch_is_imported_does_not_blind_devpickle_to_torch():
    # sys.modules holds torch from the start of its import: a walk on
    # another thread meanwhile found no Tensor class yet, concluded that
    # this "torch" was not PyTorch, and never looked again — every tensor
    # afterwards was a WalkError (or reduced, its memory missed). A module
    # still being imported (spec._initializing) is now looked at again later.
    out = subprocess.run([sys.executable, "-c", _SCAN_WHILE_TORCH_IMPORTS], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["c++" if devpickle._devpickle._torch_adapter() == "c++" else "python", "[12]"]


_STORAGE_LIARS = """
import devpickle, torch
class FakeUntyped:
    def data_ptr(self): return 16
    def nbytes(self): return 1 << 20
    device = torch.device("cpu")
class FakeTyped:
    _storage = _untyped_storage = FakeUntyped()
class Liar(torch.Tensor):
    def storage(self): return FakeTyped()
    def untyped_storage(self): return FakeUntyped()
class LyingStorage(torch.UntypedStorage):
    def data_ptr(self): return 16
    def nbytes(self): return 1 << 20
t = torch.Tensor._make_subclass(Liar, torch.arange(3, dtype=torch.float32))
(a,) = devpickle.scan([t])
assert (a.nbytes, a.ptr) == (12, t.data_ptr()), a
back = devpickle.loads(devpickle.dumps([t], inline=True), classes=(Liar,))[0]
assert back.tolist() == [0.0, 1.0, 2.0], back
s = LyingStorage(8)
(a,) = devpickle.scan([s])
assert (a.nbytes, a.ptr) == (8, torch.UntypedStorage.data_ptr(s)), a
print("ok")
"""


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_a_tensor_or_storage_whose_python_methods_lie_about_its_memory_is_read_through_torchs_own(no_adapter):
    # Without the adapter the walk read a tensor's memory through its
    # storage() / untyped_storage() and the storage's data_ptr() / nbytes()
    # — methods a subclass overrides: an address of its choosing, which
    # dumps(inline=True) then copied (a crash reading address 16). torch's
    # own C methods are asked now, and what they give is type-checked.
    out = _run_child_adapter(_STORAGE_LIARS, no_adapter)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def test_scan_states_its_documented_signature_and_takes_obj_by_keyword():
    import inspect
    assert str(inspect.signature(devpickle.scan)) == "(obj, *, paths=True, opaque=())"
    t = torch.ones(2)
    assert devpickle.scan(obj=[t]) == devpickle.scan([t])
    with pytest.raises(TypeError):
        devpickle.scan([t], True)  # paths is keyword-only


def _sparse():
    return torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))


class _SparseReads:
    """A dispatch mode: a sparse tensor's parts go through torch's
    dispatcher, so reading its memory runs this Python code (each read
    counted, and whatever `act` does on the read it is given)."""

    def __init__(self, act=None):
        self.reads, self.act = 0, act

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "_indices" in str(func):
                    outer.reads += 1
                    if outer.act:
                        outer.act(outer.reads, args[0])
                return func(*args, **(kwargs or {}))

        return Mode()


def _three_walks(make, act=None):
    """scan(paths=True), scan(paths=False) and set_result of a fresh value
    each, under a _SparseReads: (outcome, reads) each, the outcome the
    allocations (device, nbytes, refs: each walk's value is its own) or the
    WalkError's text."""
    devpickle.scan([torch.ones(1), Holder(None)], paths=False)  # the classes known: the runs read them
    out = []
    for how in ("paths", "no paths", "future"):
        r = _SparseReads(act)
        v = make()
        with r.mode():
            try:
                if how == "future":
                    devpickle.Future().set_result(v)
                    got = "set"
                else:
                    got = [(d, n, c) for d, _, n, c in _fields(devpickle.scan(v, paths=how == "paths"))]
            except devpickle.WalkError as e:
                got = str(e)
        out.append((got, r.reads))
    return out


def test_a_container_read_in_place_up_to_an_item_it_cannot_read_so_reads_nothing_twice():
    """Without paths, a small tuple is read in place until an item that
    cannot be (a set); the walk went back and entered the tuple from its
    first item, reading its sparse tensor again: the tensor's dispatch ran
    twice, and what it did twice (a tensor appended to a list walked later)
    was found twice."""
    extra = []

    def make():
        extra.clear()
        h = Holder(_sparse())
        h.s = {1}
        return [(torch.ones(2), (_sparse(), {1}), 3), h, extra]

    paths, no_paths, future = _three_walks(make, lambda n, t: extra.append(torch.ones(n)))
    assert no_paths == paths and len(paths[0]) == 7 and paths[1] == 2, (paths, no_paths)
    assert future == ("set", 2)


def test_an_error_a_tensors_dispatch_raises_is_a_walk_error_once_its_class_is_known_too():
    """A sparse tensor whose read raised (its dispatch's code) was read
    again by visit() once the run knew its class, and the second read
    succeeded: the error was swallowed (with paths too), where dumps and a
    first walk reported it."""

    def fail_first(n, t):
        if n == 1:
            raise ValueError("the first read fails")

    for make, path in [(lambda: [torch.ones(1), _sparse()], "$[1]"), (lambda: [(torch.ones(1), (1, _sparse()))], "$[0][1][1]")]:
        for got, reads in _three_walks(make, fail_first):
            assert reads == 1 and "the first read fails" in got, (got, reads)
            assert got == "set" or f"at {path}:" in got, got


def test_attributes_a_tensors_dispatch_gives_it_while_read_are_walked_as_visit_walks_them():
    def give(n, t):
        t.extra = torch.ones(7)

    paths, no_paths, future = _three_walks(lambda: [torch.ones(1), (_sparse(), 2)], give)
    assert no_paths == paths and [n for _, n, _ in paths[0]] == [4, 16, 8, 28], (paths, no_paths)


def test_an_objects_dict_replaced_while_read_in_place_is_read_on_as_a_frame_reads_it():
    """A frame over an object's __dict__ holds the dict it entered: code
    that replaces the object's __dict__ meanwhile changes nothing of that
    walk; the walk without paths went back and read the new dict."""
    held = []

    def swap(n, t):
        h = held[0]()
        if h is not None and n == 1:
            h.__dict__ = {"new": torch.ones(5)}

    def make():
        h = Holder(_sparse())
        h.later = torch.ones(3)
        held[:] = [weakref.ref(h)]
        return [h]

    paths, no_paths, future = _three_walks(make, swap)
    assert no_paths == paths and [n for _, n, _ in paths[0]] == [16, 8, 12], (paths, no_paths)


def test_an_objects_class_is_looked_up_in_copyreg_once_without_paths_too():
    """The lookup of a class in copyreg.dispatch_table compares it with a
    key of the same hash (a metaclass's __eq__: the value's code); an
    object that the walk without paths looked at but did not read in place
    (more than 8 attributes) was looked up again by visit()."""
    calls = []

    class Meta(type):
        def __hash__(cls):
            return hash(Holder)

        def __eq__(cls, other):
            calls.append(other)
            return False

    class Twin(metaclass=Meta):
        pass

    def make():
        h = Holder(torch.ones(3))
        h.__dict__.update({f"k{i}": i for i in range(8)})
        return [h]

    devpickle.scan([Holder(None)], paths=False)
    import copyreg

    copyreg.dispatch_table[Twin] = lambda o: (Twin, ())
    try:
        seen = []
        for walk in (lambda v: devpickle.scan(v), lambda v: devpickle.scan(v, paths=False),
                     lambda v: devpickle.Future().set_result(v)):
            calls.clear()
            walk(make())
            seen.append(len(calls))
        assert seen[0] > 0 and seen == [seen[0]] * 3, seen
    finally:
        del copyreg.dispatch_table[Twin]


def test_a_walked_class_and_what_it_holds_are_freed_once_the_value_is_gone():
    import gc
    import weakref

    class Big:
        pass

    def make():
        class Msg:
            payload = Big()  # a class attribute: freed with the class

        m = Msg()
        m.t = torch.zeros(1)
        return m, weakref.ref(Msg), weakref.ref(Msg.payload)

    m, cls, payload = make()
    assert len(devpickle.scan(m)) == 1
    devpickle.Future().set_result(m)
    devpickle.dumps(m)
    del m
    gc.collect()
    assert cls() is None and payload() is None


SUBINTERP_TAGS = r'''
import ctypes, gc, sys
import devpickle
OFF_FLAGS, OFF_TAG = 168, 384  # PyTypeObject.tp_flags, tp_version_tag (CPython 3.12, 64-bit)
def tag(c): return ctypes.c_uint.from_address(id(c) + OFF_TAG).value
class Probe: pass
assert ctypes.c_ulong.from_address(id(Probe) + OFF_FLAGS).value == Probe.__flags__, "layout"
def bump(to):  # moves this interpreter's tag counter on to `to`
    while True:
        d = type("D", (), {}); getattr(d, "zz", None)
        if tag(d) + 1 >= to: return
'''
SUBINTERP_FIRST = SUBINTERP_TAGS + r'''
bump(131072 + 60000)
ps = []
for i in range(3000):  # plain classes, walked by their __dict__: cached so
    P = type("P", (), {"__init__": lambda s: setattr(s, "a", 1)})
    devpickle.dumps(P()); ps.append(P)
cand = {id(P): tag(P) for P in ps}
del ps, P; gc.collect()
open(OUT, "w").write(repr(cand))
'''
SUBINTERP_SECOND = SUBINTERP_TAGS + r'''
cand = eval(open(OUT).read())
rs = [type("R", (), {"__reduce__": lambda s: (int, (7,))}) for i in range(6000)]
met = wrong = 0
for R in rs:
    want = cand.get(id(R))
    if want is None or tag(R) >= want: continue
    R.x = 0; bump(want); getattr(R, "zz", None)  # R now has the tag the freed class had at its address
    if tag(R) != want: continue
    met += 1
    v = devpickle.loads(devpickle.dumps(R()))
    wrong += "<callable>" not in getattr(v, "__attrs__", {})  # walked by __dict__: its __reduce__ ignored
open(OUT, "w").write(repr((met, wrong)))
'''


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="per-interpreter type tags from a shared start: 3.12")
def test_a_class_of_another_interpreter_with_a_freed_class_s_address_and_tag_is_classified_afresh(tmp_path):
    # From 3.12 each interpreter counts its classes' version tags from the
    # same start: the walk's type cache must not answer for a class of one
    # interpreter with what it learnt of another's freed class at that
    # address with that tag (a subprocess: legacy subinterpreters)
    out = tmp_path / "out"
    first, second = (f"OUT = {str(out)!r}\n" + code for code in (SUBINTERP_FIRST, SUBINTERP_SECOND))
    script = (f"import _testcapi\nassert _testcapi.run_in_subinterp({first!r}) == 0\n"
              f"assert _testcapi.run_in_subinterp({second!r}) == 0\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if "No module named '_testcapi'" in r.stderr:
        pytest.skip("this CPython has no _testcapi")
    assert r.returncode == 0, r.stderr[-2000:]
    met, wrong = eval(out.read_text())
    if not met:
        pytest.skip("no class of the second interpreter took a freed class's address and tag this run")
    assert wrong == 0, f"{wrong} of {met} classes classified by another interpreter's freed class"


def test_the_walks_own_holdings_are_out_of_reach_of_gc_get_referrers():
    # Code the walk runs (a reduce) used to find the walker's keep list through
    # gc.get_referrers and empty it: a namedtuple's _fields, held only there and
    # read by its frame for the paths, was freed and its tuple reused by another.
    import gc
    import types

    n = 12
    NT = collections.namedtuple("NT", ["f%d" % i for i in range(n)])
    emptied = []

    class Thief:
        def __reduce_ex__(self, proto):
            old = NT._fields
            new = tuple(str(x) for x in old)
            for r in gc.get_referrers(old):
                if type(r) is list:
                    emptied.append(len(r))
                    r.clear()
                elif type(r) is types.CellType:
                    r.cell_contents = new
            NT._fields = NT.__match_args__ = new
            del old, r
            Thief.reuse = tuple([object()] * n)  # a tuple of the freed one's size
            return (Thief, ())

    v = [NT(Thief(), *[torch.randn(2) for _ in range(n - 1)])]
    got = devpickle.scan(v, paths=True)
    assert [a.path for a in got] == ["$[0].f%d" % i for i in range(1, n)]
    assert emptied == []  # no list of the walker's was found


class LooksForListsHoldingIt:
    found = None

    def __reduce_ex__(self, proto):
        # a value's code looking for the lists that hold it (and free to empty them)
        type(self).found = [r for r in gc.get_referrers(self) if type(r) is list]
        return (LooksForListsHoldingIt, ())


@pytest.mark.parametrize("how", ["scan", "set_result", "dumps"])
def test_the_lists_a_walk_makes_of_a_set_s_items_are_out_of_reach_of_the_value_s_code(how):
    value = [{LooksForListsHoldingIt(), *range(100, 108)}, torch.zeros(1)]
    if how == "scan":
        assert len(devpickle.scan(value)) == 1
    elif how == "set_result":
        devpickle.Future().set_result(value)
    else:
        devpickle.dumps(value)
    assert LooksForListsHoldingIt.found == []


def pickles_order(value, storages=False):
    """The storages of the tensors pickle meets, in the order it meets them
    (a persistent_id, as torch's _extract_tensors collects tensors; with
    storages=True, the storages of the tensors pickle reduces, as torch.save
    collects them)."""
    import io

    met = []
    kinds = (torch.TypedStorage, torch.UntypedStorage) if storages else torch.Tensor

    class Collect(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, kinds):
                p = obj.data_ptr() if storages else storage_ptr(obj)[0]
                if p not in met:
                    met.append(p)
                return len(met)
            return None

    Collect(io.BytesIO(), protocol=5).dump(value)
    return met


class ReducedInParts:
    def __init__(self, *parts):
        self.parts = parts

    def __reduce__(self):
        callable_, args, state, listitems, dictitems, setter = self.parts
        return (callable_, args, state, iter(listitems), iter(dictitems), setter)


def test_a_reduces_parts_are_walked_in_pickles_order_listitems_dictitems_then_the_state():
    import functools

    state, item, value, setter = torch.ones(1), torch.ones(2), torch.ones(3), torch.ones(4)
    r = ReducedInParts(ReducedInParts, (), {"s": state}, [item], [("k", value)],
                       functools.partial(setattr, setter))
    got = devpickle.scan(r)
    assert [a.ptr for a in got] == pickles_order(r) == [storage_ptr(t)[0] for t in (item, value, setter, state)]
    reduce = "$<reduce test_scan.ReducedInParts>"
    assert [a.path for a in got] == [reduce + ".listitems[0]", reduce + ".dictitems.k",
                                     reduce + ".state_setter<reduce functools.partial>.state[1][0]",
                                     reduce + ".state.s"]
    assert [a.ptr for a in devpickle.scan(r, paths=False)] == [a.ptr for a in got]


def test_a_reduces_state_setter_is_not_walked_without_a_state_as_pickle_never_saves_it():
    import functools

    unpicklable = functools.partial(print, (x for x in ()))  # a generator: pickle refuses it
    r = ReducedInParts(ReducedInParts, (), None, [], [], unpicklable)
    assert pickles_order(r) == []  # pickle saves no state_setter where there is no state
    assert devpickle.scan(r) == []
    devpickle.Future().set_result(r)
    r.parts = (ReducedInParts, (), {}, [], [], unpicklable)  # with a state, both refuse it
    with pytest.raises(TypeError, match="cannot pickle 'generator' object"):
        pickles_order(r)
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan(r)
    assert e.value.path == "$<reduce test_scan.ReducedInParts>.state_setter<reduce functools.partial>.state[1][0]"


class SlottedBytes(bytearray):
    __slots__ = ("t", "unset")


class SlottedBytesWithDict(bytearray):
    __slots__ = ("t", "__dict__")


def test_a_bytearray_subclass_has_its_slots_walked_as_pickle_carries_them():
    inner, attr = torch.zeros(3), torch.ones(2)
    b = SlottedBytes(b"abc")
    b.t = inner
    assert pickles_order(b) == [storage_ptr(inner)[0]]  # bytearray's reduce carries (None, {'t': inner})
    got = devpickle.scan([b])
    assert [(a.path, a.ptr) for a in got] == [("$[0]", got[0].ptr), ("$[0].t", storage_ptr(inner)[0])]
    assert [a.ptr for a in devpickle.scan([b], paths=False)] == [a.ptr for a in got]
    both = SlottedBytesWithDict(b"xy")
    both.t, both.d = inner, attr
    assert pickles_order(both) == [storage_ptr(t)[0] for t in (attr, inner)]
    assert [a.path for a in devpickle.scan(both)] == ["$", "$.d", "$.t"]
    assert [a.path for a in devpickle.scan(SlottedBytes(b"q"))] == ["$"]  # no slot set: its memory alone


def test_a_storage_of_no_bytes_is_no_allocation_wherever_it_points():
    x = np.arange(4.0)
    empty = torch.from_numpy(x[:0])  # a storage of 0 bytes at x's own address
    assert storage_ptr(empty) == (x.ctypes.data, 0)
    for paths in (True, False):
        assert devpickle.scan(empty, paths=paths) == []
        assert devpickle.scan(torch_storages(empty), paths=paths) == []
        got = devpickle.scan({"empty": [empty, empty.storage()], "x": x}, paths=paths)
        assert [(a.ptr, a.nbytes, a.refs, a.path) for a in got] == [(x.ctypes.data, 32, 1, "$.x" if paths else None)]
        over = devpickle.scan([empty, torch.from_numpy(x)], paths=paths)  # a run of tensors read at once
        assert [(a.ptr, a.nbytes, a.refs) for a in over] == [(x.ctypes.data, 32, 1)]


STATE_ONLY_GETSTATE_GIVES = []


class TensorWithOwnState(torch.Tensor):
    def __getstate__(self):
        return {"kept": STATE_ONLY_GETSTATE_GIVES[0]}


class BytesWithOwnState(bytearray):
    def __getstate__(self):
        return {"kept": STATE_ONLY_GETSTATE_GIVES[0]}


def test_the_state_a_tensor_or_bytearray_subclass_s_own_getstate_returns_is_walked_as_pickle_carries_it():
    kept = torch.ones(3)
    STATE_ONLY_GETSTATE_GIVES[:] = [kept]
    try:
        t = torch.zeros(2).as_subclass(TensorWithOwnState)  # no attributes: read in a run without paths
        b = BytesWithOwnState(b"abc")
        # torch's reduce of a subclass and bytearray's carry what __getstate__ returns
        assert pickles_order(t, storages=True) == [storage_ptr(t)[0], storage_ptr(kept)[0]]
        assert pickles_order(b) == [storage_ptr(kept)[0]]
        got = devpickle.scan([t, b])
        assert [(a.path, a.ptr) for a in got] == [
            ("$[0]", storage_ptr(t)[0]),
            ("$[0]<reduce test_scan.TensorWithOwnState>.state.kept", storage_ptr(kept)[0]),
            ("$[1]", got[2].ptr)]
        assert got[1].refs == 1  # met twice, once through each __getstate__
        assert [a.ptr for a in devpickle.scan([t, b], paths=False)] == [a.ptr for a in got]
        assert devpickle.scan(b)[1].path == "$<reduce test_scan.BytesWithOwnState>.state.kept"
        # a frame has no field for a tensor's state: refused, never dropped
        with pytest.raises(devpickle.WalkError, match=r"TensorWithOwnState' at \$: it cannot be carried in a frame: "
                                                      r"a tensor's attributes \(a subclass's state\) are not"):
            devpickle.dumps(t, inline=True)
        STATE_ONLY_GETSTATE_GIVES[:] = [(x for x in ())]  # a generator: pickle refuses it
        with pytest.raises(devpickle.WalkError) as e:
            devpickle.Future().set_result([t])
        assert e.value.path == "$[0]<reduce test_scan.TensorWithOwnState>.state.kept"
    finally:
        STATE_ONLY_GETSTATE_GIVES.clear()


class TensorWithOwnReduce(torch.Tensor):
    def __reduce_ex__(self, proto):
        return (list, ([STATE_ONLY_GETSTATE_GIVES[0]],))


def test_a_tensor_s_own_reduce_is_walked_as_pickle_calls_it_beside_its_memory():
    # pickle carries what a tensor's own __reduce_ex__ returns (a subclass's,
    # or one set on the instance): memory only that reduce holds was missed,
    # and a future did not wait on it
    other = torch.zeros(7)
    STATE_ONLY_GETSTATE_GIVES[:] = [other]
    try:
        t = torch.ones(3).as_subclass(TensorWithOwnReduce)  # no attributes: read in a run without paths
        assert [type(x) for x in pickle.loads(pickle.dumps(t))] == [torch.Tensor]
        got = devpickle.scan([t, t])
        assert [(a.path, a.ptr, a.refs) for a in got] == [
            ("$[0]", storage_ptr(t)[0], 1),
            ("$[0]<reduce test_scan.TensorWithOwnReduce>.args[0][0]", storage_ptr(other)[0], 1)]
        assert [a.ptr for a in devpickle.scan([t, t], paths=False)] == [a.ptr for a in got]
        u = torch.ones(2)
        u.__reduce_ex__ = lambda proto: (list, ([other],))  # pickle looks it up on the instance
        assert [(a.path, a.ptr) for a in devpickle.scan(u)] == [
            ("$", storage_ptr(u)[0]), ("$<reduce torch.Tensor>.args[0][0]", storage_ptr(other)[0])]
        # torch's own reduces (torch.Tensor's, nn.Parameter's) carry the data: read directly, as before
        p = torch.nn.Parameter(torch.ones(4))
        assert [a.path for a in devpickle.scan([p, torch.ones(1)])] == ["$[0]", "$[1]"]
        # a frame carries a tensor's data, never what its reduce returns: refused, never dropped
        for v in (t, u):
            with pytest.raises(devpickle.WalkError, match=r"at \$: it cannot be carried in a frame: a tensor with a "
                                                          r"reduce of its own \(its class's __reduce_ex__"):
                devpickle.dumps(v, inline=True)
        STATE_ONLY_GETSTATE_GIVES[:] = [(x for x in ())]  # a generator: pickle refuses it
        with pytest.raises(devpickle.WalkError) as e:
            devpickle.Future().set_result([t])
        assert e.value.path == "$[0]<reduce test_scan.TensorWithOwnReduce>.args[0][0]"
    finally:
        STATE_ONLY_GETSTATE_GIVES.clear()


class AnswersForItsReduce:
    """pickle looks __reduce_ex__ up on the instance: this class's
    __getattribute__ answers with a reduce of its own, holding memory its
    __dict__ does not."""

    hidden = None

    def __getattribute__(self, name):
        if name == "__reduce_ex__":
            return lambda proto: (Holder, (AnswersForItsReduce.hidden,))
        return object.__getattribute__(self, name)


class ClaimsAnotherClass:
    @property
    def __class__(self):
        return Holder


def test_a_class_whose_getattribute_or_class_answers_for_pickle_is_reduced_as_pickle_reduces_it():
    hidden, attr = torch.ones(2), torch.zeros(3)
    AnswersForItsReduce.hidden = hidden
    a = AnswersForItsReduce()
    a.attr = attr
    assert pickles_order([a]) == [storage_ptr(hidden)[0]]
    for paths in (True, False):
        got = devpickle.scan([a], paths=paths)
        assert [(x.ptr, x.path) for x in got] == [
            (storage_ptr(hidden)[0], "$[0]<reduce test_scan.AnswersForItsReduce>.args[0]" if paths else None)]
    c = ClaimsAnotherClass()
    c.t = torch.ones(1)
    with pytest.raises(pickle.PicklingError, match=r"^args\[0\] from __newobj__ args has the wrong class$"):
        pickles_order([c])
    for walk in (devpickle.scan, lambda v: devpickle.scan(v, paths=False), devpickle.Future().set_result):
        with pytest.raises(devpickle.WalkError, match=r"ClaimsAnotherClass' at \$\[0\]: its reduce is malformed: "
                                                      r"args\[0\] from __newobj__ args has the wrong class$"):
            walk([c])


class HidesItsReduceEx:
    """A __getattribute__ that has no __reduce_ex__ to give: pickle falls
    back to __reduce__ (here one of the class's own), else refuses."""

    kept = None

    def __getattribute__(self, name):
        if name == "__reduce_ex__" or (name == "__reduce__" and HidesItsReduceEx.kept is None):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def __reduce__(self):
        return (Holder, (HidesItsReduceEx.kept,))


def test_an_object_without_a_reduce_ex_is_reduced_through_its_reduce_as_pickle_falls_back_to_it():
    kept = torch.ones(2)
    HidesItsReduceEx.kept = kept
    try:
        assert pickles_order([HidesItsReduceEx()]) == [storage_ptr(kept)[0]]
        got = devpickle.scan([HidesItsReduceEx()])
        assert [(a.ptr, a.path) for a in got] == [(storage_ptr(kept)[0], "$[0]<reduce test_scan.HidesItsReduceEx>.args[0]")]
        HidesItsReduceEx.kept = None  # neither: both refuse
        with pytest.raises(pickle.PicklingError, match="^can't pickle 'HidesItsReduceEx' object"):
            pickles_order([HidesItsReduceEx()])
        with pytest.raises(devpickle.WalkError, match=r"HidesItsReduceEx' at \$\[0\]: it cannot be reduced \(if it "
                                                      r"holds no device memory, list its type in opaque=\): can't "
                                                      r"pickle 'HidesItsReduceEx' object$"):
            devpickle.scan([HidesItsReduceEx()])
    finally:
        HidesItsReduceEx.kept = None


# ---- scan against pickle's own walk, over random values ----

class _RPlain:
    pass


class _RSlots:
    __slots__ = ("a", "b")


class _RGetstate:
    def __getstate__(self):
        return {"s": self.__dict__.get("s")}


class _RReduced:
    def __reduce__(self):
        callable_, args, state, listitems, dictitems = self.__dict__["parts"]
        return (callable_, args, state, iter(listitems), iter(dictitems))


class _RBytes(bytearray):
    __slots__ = ("x",)


class _RList(list):
    pass


class _RDict(dict):
    pass


class _RTensor(torch.Tensor):
    pass


_RPair = collections.namedtuple("_RPair", "a b")


def _rebuilt(*args):
    return None


class _PicklesWalk(pickle.Pickler):
    """What pickle meets, in its order: each tensor's storage, numpy array's
    owner and bytearray (persistent_id sees every object pickle saves), and
    a tensor's attributes as torch's reduce carries them (reducer_override)."""

    def __init__(self):
        import io

        super().__init__(io.BytesIO(), protocol=5)
        self.found, self.held = {}, []

    def met(self, ptr, nbytes, obj):
        if nbytes:
            entry = self.found.setdefault(ptr, [nbytes, set()])
            entry[0] = max(entry[0], nbytes)
            entry[1].add(id(obj))
            self.held.append(obj)

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self.met(*storage_ptr(obj), obj)
        elif isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            owner = obj
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            self.met(owner.ctypes.data, owner.nbytes, obj)
            return id(obj)
        elif isinstance(obj, bytearray):
            self.met(np.frombuffer(obj, np.uint8).ctypes.data if obj else 0, len(obj), obj)
            return None if type(obj) is not bytearray else id(obj)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return (_rebuilt, (), obj.__getstate__() if type(obj) is not torch.Tensor else obj.__dict__ or None)
        return NotImplemented


def _random_value(rng, depth, nodes, pool):
    """A value of containers, shared references and cycles, objects of many
    shapes, tensors (views of a few storages), numpy arrays and bytearrays."""
    pick = rng.randrange(16 if depth < 4 else 3)
    if pick == 0:
        return rng.choice([None, 1, 2.5, "s", b"b", 1j, int, np.float32(1)])
    if pick in (1, 2):
        base = rng.choice(pool)
        if isinstance(base, torch.Tensor):
            return rng.choice([base, base[1:], base[::2], base[:0], torch.nn.Parameter(base.float()),
                               base.as_subclass(_RTensor)])
        if isinstance(base, np.ndarray):  # an empty tensor over it: a storage of no bytes at its address
            return rng.choice([base, base[1:], base[::-1], torch.from_numpy(base[:0])])
        return base
    if pick == 3 and nodes:
        return rng.choice(nodes)
    kid = lambda: _random_value(rng, depth + 1, nodes, pool)  # noqa: E731
    if pick in (4, 5):
        made = [] if pick == 4 else {}
        nodes.append(made)
        for i in range(rng.randrange(4)):
            if pick == 4:
                made.append(kid())
            else:
                made[rng.choice([i, "k%d" % i, (i, "t"), rng.choice(pool[:2])])] = kid()
        return made
    if pick == 6:
        return tuple(kid() for _ in range(rng.randrange(3)))
    if pick == 7:
        return frozenset([rng.choice(pool[:2]), rng.randrange(9)])
    if pick == 8:
        o = rng.choice([_RPlain, _RGetstate])()
        nodes.append(o)
        o.a, o.s = kid(), kid()
        return o
    if pick == 9:
        o = _RSlots()
        nodes.append(o)
        o.a = kid()
        return o
    if pick == 10:
        o = _RReduced()
        o.parts = (rng.choice([_RPlain, _rebuilt]), (kid(),), rng.choice([None, kid()]), [kid()], [("k", kid())])
        return o
    if pick == 11:
        b = _RBytes(b"ab")
        b.x = kid()
        return b
    if pick == 12:
        o = _RList([kid()])
        o.attr = kid()
        nodes.append(o)
        return o
    if pick == 13:
        o = _RDict(k=kid())
        nodes.append(o)
        return o
    if pick == 14:
        t = rng.choice(pool[:2]).detach().clone()
        t.extra = kid()
        return t
    return _RPair(kid(), kid())


def test_scan_finds_what_pickles_walk_meets_in_its_order_over_random_values():
    import random

    rng = random.Random(20240613)
    for _ in range(1500):
        pool = [torch.arange(6.0), torch.arange(4), np.arange(5.0), bytearray(b"xyz"), torch.zeros(0)]
        value = _random_value(rng, 0, [], pool)
        walk = _PicklesWalk()
        walk.dump(value)
        want = [(ptr, nbytes, len(objs)) for ptr, (nbytes, objs) in walk.found.items()]
        got = devpickle.scan(value)
        assert [(a.ptr, a.nbytes, a.refs) for a in got] == want
        assert [(a.ptr, a.nbytes, a.refs) for a in devpickle.scan(value, paths=False)] == want
        devpickle.Future().set_result(value)


def _lists_holding(x):
    return [r for r in gc.get_referrers(x) if type(r) is list and any(i is x for i in r)]


def test_a_list_read_in_place_that_a_tensors_dispatch_empties_is_read_afresh_never_past_its_end():
    """Without paths a small list held once is read in place; the sparse
    tensor's dispatch (Python code) empties it while it is read: the walk
    reads its length afresh, as the frame with paths does, and finds only
    what it read before."""

    def empty(n, t):
        for lst in _lists_holding(t):
            lst.clear()

    paths, no_paths, future = _three_walks(lambda: [[_sparse(), torch.ones(2), torch.ones(3)]], empty)
    assert no_paths == paths and [n for _, n, _ in paths[0]] == [16, 8], (paths, no_paths)
    assert future == ("set", 1)


def test_a_list_read_in_place_that_a_tensors_dispatch_drops_from_its_container_is_read_to_its_end():
    """The dispatch empties the list around the one being read in place,
    whose only reference that was: the walk holds what it reads, as the
    frame with paths holds its list, and reads it to its end."""

    def drop(n, t):
        for inner in _lists_holding(t):
            for outer in _lists_holding(inner):
                outer.clear()

    paths, no_paths, future = _three_walks(lambda: [[_sparse(), torch.ones(2), torch.ones(3)]], drop)
    assert no_paths == paths and [n for _, n, _ in paths[0]] == [16, 8, 8, 12], (paths, no_paths)
    assert future == ("set", 1)


def test_an_objects_dict_that_a_tensors_dispatch_grows_while_read_in_place_is_a_walk_error_as_with_paths():
    """An object held once is read in place without paths; an attribute
    given to it by code its tensor's dispatch runs changes the size of the
    __dict__ being read: the walk reports it, as the frame with paths
    does, never reads on over a changed dict."""
    held = []

    def grow(n, t):
        h = held[0]()
        if h is not None:
            h.added = torch.ones(9)

    def make():
        h = Holder(_sparse())
        h.later = torch.ones(3)
        held[:] = [weakref.ref(h)]
        return [h]

    paths, no_paths, future = _three_walks(make, grow)
    assert paths == (f"cannot walk a '{__name__}.Holder' at $[0]: its items cannot be read: dictionary changed size during "
                        "the walk (Python code of the value's changed it)", 1), paths
    assert no_paths == paths and future == (paths[0], 1), (no_paths, future)


def test_a_cuda_array_interface_set_under_a_key_not_interned_is_found_without_paths_too():
    """An instance's __cuda_array_interface__ is found by its name's value,
    not by the identity of the str: a key made at run time (not interned)
    holds it as well."""
    t = torch.ones(2)

    def make():  # the object held by its list alone: read in place without paths
        o = Holder(t)
        name = "".join(["__cuda_array_", "interface__"])
        assert name == "__cuda_array_interface__" and name is not sys.intern(name)  # another str object
        o.__dict__[name] = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3}
        return [o]

    for paths in (True, False):
        got = devpickle.scan(make(), paths=paths)
        assert [(a.device, a.ptr, a.nbytes) for a in got] == [("cuda:0", 0x1000, 16), ("cpu", t.data_ptr(), 8)], paths


@pytest.mark.parametrize("wrap", ["list", "object", "object over a list"])
def test_the_depth_limit_is_the_same_with_or_without_paths_at_every_depth_around_it(wrap):
    """Small lists and objects held once are read in place without paths,
    up to three levels at a time: the nesting the limit refuses is the one
    the walk with paths refuses, wherever in those levels the limit falls."""

    class Node:
        pass

    def wrap_once(x, i):  # the value one frame deeper
        if wrap != "list" and i % 2 == (wrap == "object over a list"):  # "object": the tensor its attribute
            n = Node()
            n.a = x
            return n
        return [x]

    limit = 262_144
    x = t = torch.ones(1)
    for frames in range(limit + 2):
        if frames >= limit - 3:  # the walk with paths needs `frames` frames
            for paths in (True, False):
                if frames <= limit:
                    assert [a.ptr for a in devpickle.scan(x, paths=paths)] == [t.data_ptr()], (frames, paths)
                else:
                    with pytest.raises(devpickle.WalkError, match="too deep"):
                        devpickle.scan(x, paths=paths)
        x = wrap_once(x, frames)


def test_an_object_held_once_after_the_walk_ran_value_code_is_entered_once_without_paths_too():
    """Once the walk has run the value's code (a reduce), an object held
    only by its list's slot may still be met again (a reduce hands it back
    through a weak reference): it enters the memo, and without paths it
    is not read in place either — its sparse tensor was read, and its
    dispatch run, twice."""

    def make():
        p = _Node(None)  # its attributes: child, then s
        p.s = _sparse()
        p.child = _ParentByWeakref(p)  # its reduce: the state {"parent": p, "t": torch.ones(2)}
        return [Custom(torch.ones(1)), p]

    paths, no_paths, future = _three_walks(make)
    assert no_paths == paths and paths[1] == 1 and [n for _, n, _ in paths[0]] == [4, 8, 16, 8], (paths, no_paths)
    assert future == ("set", 1)


def test_paths_name_each_item_of_small_containers_and_objects_held_once_their_class_known_or_not():
    """Small lists, tuples and plain objects held by one slot are read in
    place only when no path is asked for: with paths each allocation names
    its own item, the second time a class is met (cached) as the first."""

    class Fresh:
        pass

    def make():
        o = Fresh()
        o.t = torch.ones(3)
        o.inner = (torch.ones(4),)
        return [(torch.ones(1), [torch.ones(2)]), o]

    for _ in range(2):
        got = devpickle.scan(make())
        assert [(a.nbytes, a.path) for a in got] == [(4, "$[0][0]"), (8, "$[0][1][0]"), (12, "$[1].t"),
                                                     (16, "$[1].inner[0]")]


def test_opaque_tensor_classes_are_leaves_in_a_list_of_tensors_with_or_without_paths():
    """A list of tensors is read in runs, without a visit per item: a class
    declared opaque is still a leaf there, known to the walk before or
    not."""

    class Opaque(torch.Tensor):
        pass

    hidden, shown = torch.ones(2).as_subclass(Opaque), torch.ones(3)
    value = [hidden, shown, hidden, (hidden,), [shown]]
    for paths in (True, False):
        for _ in range(2):  # the second time its class is known
            assert [a.nbytes for a in devpickle.scan(value, paths=paths)] == [8, 12]
            assert [a.nbytes for a in devpickle.scan(value, paths=paths, opaque=(Opaque,))] == [12]
            assert devpickle.scan(value, paths=paths, opaque=torch.Tensor) == []


def test_a_run_of_plain_tensors_stops_at_a_tensor_of_another_class_whose_slots_or_state_it_walks():
    """A run of plain tensors read at once ends at the first item of
    another class, even a tensor class: the slots and the state of its own
    __getstate__ that a subclass carries are walked, as with paths."""
    slot, state = torch.ones(5), torch.ones(6)
    STATE_ONLY_GETSTATE_GIVES[:] = [state]
    slotted = torch.zeros(2).as_subclass(SlottedTensor)
    slotted.extra = slot
    own = torch.zeros(3).as_subclass(TensorWithOwnState)
    for value, want in [([torch.ones(1), torch.ones(1), slotted], [4, 4, 8, 20]),
                        ([torch.ones(1), torch.ones(1), own], [4, 4, 12, 24])]:
        for _ in range(2):  # the second time the classes are known
            for paths in (True, False):
                assert [a.nbytes for a in devpickle.scan(value, paths=paths)] == want, paths


def test_a_tensor_given_attributes_while_read_in_a_run_is_read_once_wherever_it_lies():
    """The attributes a tensor's dispatch gives it while a run reads it are
    walked after its memory, and the run goes on past it: the tensor, and
    its dispatch, are never read a second time — in the run's own list, in
    a list or tuple read in place, or before more items."""

    def give(n, t):
        t.extra = torch.ones(7)

    for make, sizes in [
        (lambda: [torch.ones(1), _sparse(), torch.ones(3)], [4, 16, 8, 28, 12]),
        (lambda: [torch.ones(1), (_sparse(), 2)], [4, 16, 8, 28]),
        (lambda: [torch.ones(1), [_sparse(), torch.ones(5)], torch.ones(3)], [4, 16, 8, 28, 20, 12]),
    ]:
        paths, no_paths, future = _three_walks(make, give)
        assert paths == no_paths == ([("cpu", n, 1) for n in sizes], 1), (paths, no_paths)
        assert future == ("set", 1)


class _DropsAView:
    """A reduce that drops a view the walk counted (its list's slot its
    only reference) and hands the walk new views of the same storage:
    one of them may take the dropped view's address."""

    def __init__(self, holder, at, base):
        self.holder, self.at, self.base = holder, at, base

    def __reduce__(self):
        self.holder[self.at] = None
        return (_DropsAView, (), {"views": [self.base[4:] for _ in range(5)]})


def test_a_counted_view_freed_by_a_reduce_does_not_hide_a_new_view_at_its_address():
    """refs counts distinct objects by address: every object counted is
    held until the walk ends, so a new view made at the address of one
    freed meanwhile is counted too."""
    for paths in (True, False):
        base = torch.arange(8.0)
        value = [base[1:], base[2:], base[3:], None]
        value[3] = _DropsAView(value, 2, base)
        got = devpickle.scan(value, paths=paths)
        assert [(a.ptr, a.refs) for a in got] == [(base.data_ptr(), 8)], paths


def test_a_tensor_without_memory_in_an_object_held_once_names_its_attribute_without_paths_too():
    """An object held once is read in place without paths: a tensor in it
    whose memory cannot be described is reported at its own attribute's
    path, as with paths, the object's class known or not."""

    def make(inner):
        h = Holder(torch.ones(1))
        h.m = (torch.ones(1), torch.empty(2, device="meta")) if inner else torch.empty(2, device="meta")
        return [h]

    for inner, path in [(False, "$[0].m"), (True, "$[0].m[1]")]:
        for _ in range(2):
            for paths in (True, False):
                with pytest.raises(devpickle.WalkError) as e:
                    devpickle.scan(make(inner), paths=paths)
                assert (e.value.type_name, e.value.path) == ("torch.Tensor", path), paths
                assert str(e.value).startswith(f"cannot walk a 'torch.Tensor' at {path}: a tensor whose memory "
                                               "cannot be described: devpickle: cannot describe the memory"), paths


def test_an_object_whose_metaclass_code_empties_its_list_during_the_copyreg_lookup_is_walked_whole():
    """Looking an object's class up in copyreg.dispatch_table may run its
    metaclass's __eq__ (a key of the same hash): code that empties the list
    holding the object then. The walk holds the object first, with paths
    or without (where objects held once are read in place): it is walked
    whole, and nothing after it in the emptied list."""
    held = []

    class Meta(type):
        def __hash__(cls):
            return 12345

        def __eq__(cls, other):
            for lst in held:
                lst.clear()
            return cls is other

    class Anchor(metaclass=Meta):
        pass

    class Victim(metaclass=Meta):
        pass

    def make():
        v = Victim()
        v.t = torch.ones(3)
        v.u = (torch.ones(4), torch.ones(5))
        return [v, torch.ones(6)]

    copyreg.dispatch_table[Anchor] = lambda o: (Anchor, ())
    try:
        for paths in (True, False):
            for _ in range(2):  # the second time the class is known
                value = make()
                held[:] = [value]
                assert [a.nbytes for a in devpickle.scan(value, paths=paths)] == [12, 16, 20], paths
                held.clear()
    finally:
        del copyreg.dispatch_table[Anchor]


def test_a_small_tuple_shared_by_containers_read_in_place_is_entered_once():
    """Containers and objects held once are read in place without paths,
    but a tuple they share (more than one reference) is entered through
    the memo: its sparse tensor is read, and its dispatch run, once, as
    with paths."""

    def make():
        shared = (_sparse(), torch.ones(2))
        return [(shared, 1), [2, shared], ((shared,),)]

    def make_objects():  # objects held once, read in place, sharing a tuple
        shared = (_sparse(), torch.ones(2))
        a, b = Holder(shared), Holder(None)
        b.s = shared
        return [a, b]

    for mk in (make, make_objects):
        paths, no_paths, future = _three_walks(mk)
        assert paths == no_paths == ([("cpu", 16, 1), ("cpu", 8, 1), ("cpu", 8, 1)], 1), (mk, paths, no_paths)
        assert future == ("set", 1)


def test_a_tensor_class_with_slots_cached_where_a_class_without_them_was_has_its_slots_walked():
    """The type cache remembers that a tensor class has no slots; a class
    that takes its entry afterwards (another type at an address of the
    same cache slot) is asked for its own, and its slots are walked."""

    def slot(c):  # the cache entry a class takes (its address, as scan_classify.h hashes it)
        return (id(c) >> 4) % 512

    class NoSlots(torch.Tensor):
        pass

    plain = torch.ones(1).as_subclass(NoSlots)
    plain.__dict__  # a dict made (empty): visited, and its class asked for its slots
    assert [a.nbytes for a in devpickle.scan({"p": plain})] == [4]
    made = []  # every class tried stays alive: none takes another's address
    while not made or slot(made[-1]) != slot(NoSlots):
        made.append(type(f"Slotted{len(made)}", (torch.Tensor,), {"__slots__": ("extra",)}))
    s = torch.ones(2).as_subclass(made[-1])
    s.extra = torch.ones(3)
    for paths in (True, False):
        assert [(a.nbytes, a.path) for a in devpickle.scan({"s": s}, paths=paths)] == [
            (8, "$.s" if paths else None), (12, "$.s.extra" if paths else None)]


class _CpuOnly:
    """A wrapper whose interface properties have none for cpu data: they
    raise AttributeError, as torch's __cuda_array_interface__ of a cpu
    tensor does, so hasattr() is false and numpy, cupy and numba read no
    memory through them."""

    def __init__(self):
        self.t = torch.ones(2)


def _no_interface(self):
    raise AttributeError("no such interface for cpu data")


def _dlpack_device(self):
    return (2, 0)


_NO_IFACE = {
    "__array_interface__": type("NoHostIface", (_CpuOnly,), {"__array_interface__": property(_no_interface)}),
    "__cuda_array_interface__": type("NoCudaIface", (_CpuOnly,), {"__cuda_array_interface__": property(_no_interface)}),
    "__dlpack__": type("NoDlpack", (_CpuOnly,), {"__dlpack__": property(_no_interface),
                                                 "__dlpack_device__": _dlpack_device}),
    "__dlpack_device__": type("NoDlpackDevice", (_CpuOnly,), {"__dlpack__": lambda self, stream=None: None,
                                                              "__dlpack_device__": property(_no_interface)}),
}


@pytest.mark.parametrize("name", list(_NO_IFACE))
def test_an_interface_property_raising_attribute_error_means_no_interface_and_the_object_is_walked_as_without_it(name):
    # scan and the Future raised "WalkError: cannot walk a 'NoCudaIface' at
    # $.o: __cuda_array_interface__ failed", and dumps refused it as device
    # memory, where hasattr() is false, numpy makes no array over it and
    # pickle carries it by its attributes
    o = _NO_IFACE[name]()
    assert not hasattr(o, name)
    for found in (devpickle.scan({"o": o}), devpickle.scan({"o": o}, paths=False)):
        assert [(a.ptr, a.nbytes) for a in found] == [(o.t.data_ptr(), 8)]
    # docs/PYTHON.md: a device interface's class is walked through its reduce
    # (pickle's), an __array_interface__'s as a plain object
    assert devpickle.scan({"o": o})[0].path == ("$.o.t" if name == "__array_interface__"
                                                else f"$.o<reduce test_scan.{type(o).__name__}>.state.t")
    f = devpickle.Future()
    f.set_result({"o": o})
    assert f.wait()["o"] is o
    back = devpickle.loads(devpickle.dumps({"o": o}, inline=True), classes=type(o))["o"]
    assert type(back) is type(o) and torch.equal(back.t, o.t)


def test_a_numpy_subclass_whose_cuda_interface_property_raises_attribute_error_is_its_cpu_memory():
    class HostArray(np.ndarray):
        @property
        def __cuda_array_interface__(self):
            raise AttributeError("host memory")

    a = np.arange(4.0).view(HostArray)
    assert [(x.ptr, x.nbytes, x.path) for x in devpickle.scan([a])] == [(a.ctypes.data, 32, "$[0]")]
    with pytest.raises(devpickle.WalkError, match="numpy.ndarray subclass|cannot be carried"):
        devpickle.dumps([a])


def test_an_interface_property_raising_another_error_is_still_a_walk_error_naming_it():
    class Broken(_CpuOnly):
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("driver gone")

    with pytest.raises(devpickle.WalkError, match=r"^cannot walk a 'test_scan\.test_an_interface_property_raising_"
                                                  r"another_error_is_still_a_walk_error_naming_it\.<locals>\.Broken'"
                                                  r" at \$\[0\]: __cuda_array_interface__ failed: driver gone$"):
        devpickle.scan([Broken()])


def test_an_iterator_or_a_dict_view_where_a_value_belongs_says_to_walk_a_list_of_it():
    # scan(model.parameters()) and scan(sd.values()) said only pickle's
    # "cannot pickle 'generator' object": nothing of what to walk instead
    model = torch.nn.Linear(2, 2)
    sd = model.state_dict()
    for value, kind, name in [(model.parameters(), "an iterator", "generator"),
                              (sd.values(), "a dict view", "odict_values"),
                              ({"k": {}.items()}, "a dict view", "dict_items")]:
        with pytest.raises(devpickle.WalkError, match=rf"^cannot walk a '{name}' at \$(\.k)?: {kind} cannot be "
                                                      rf"reduced \(walk list\(\.\.\.\) of it\): cannot pickle "
                                                      rf"'{name}' object$"):
            devpickle.scan(value)
        with pytest.raises(devpickle.WalkError, match=rf"{kind} cannot be reduced \(walk list\(\.\.\.\) of it\)"):
            devpickle.Future().set_result(value)
    assert len(devpickle.scan(list(model.parameters()))) == 2
    assert len(devpickle.scan(list(sd.values()))) == 2


# ---- opaque=: isinstance's answers, from a cache per walk ----

class OpaqueBase:
    pass


class OpaqueSub(OpaqueBase):
    def __init__(self, t=None):
        self.t = t


class NotOpaque:
    def __init__(self, t=None):
        self.t = t


def _nbytes(value, **kw):
    return [a.nbytes for a in devpickle.scan(value, **kw)]


def test_an_opaque_types_subclasses_are_opaque_wherever_the_walk_meets_them():
    """isinstance's answer: a subclass's instance is a leaf, in a run of a
    list, in a tuple or list read in place, as an attribute, as a dict
    value; another class's instance is walked."""
    hidden, shown = OpaqueSub(torch.ones(2)), NotOpaque(torch.ones(3))
    value = [hidden, shown, (hidden,), [OpaqueSub(torch.ones(5))], {"k": hidden}, NotOpaque(hidden),
             OpaqueSub(torch.ones(7))]
    for paths in (True, False):
        for _ in range(2):  # the second time every class is known
            assert _nbytes(value, paths=paths) == [8, 12, 20, 28]
            assert _nbytes(value, paths=paths, opaque=OpaqueBase) == [12]
            assert _nbytes(value, paths=paths, opaque=(NotOpaque, OpaqueSub)) == []


def test_a_type_walked_then_listed_opaque_then_not_is_answered_afresh_each_call():
    # the cache is one walk's: what a type was to the last call's types
    # says nothing of this call's
    value = [OpaqueSub(torch.ones(2)), OpaqueSub(torch.ones(3))]
    for paths in (True, False):
        assert _nbytes(value, paths=paths) == [8, 12]
        assert _nbytes(value, paths=paths, opaque=OpaqueSub) == []
        assert _nbytes(value, paths=paths, opaque=NotOpaque) == [8, 12]
        assert _nbytes(value, paths=paths, opaque=OpaqueBase) == []
        assert _nbytes(value, paths=paths) == [8, 12]


def test_an_abc_listed_opaque_answers_as_isinstance_does_registered_classes_included():
    import abc

    class Handle(abc.ABC):
        pass

    class Foreign:  # no relation to Handle until registered
        def __init__(self, t):
            self.t = t

    value = [Foreign(torch.ones(2)), NotOpaque(torch.ones(3))]
    for paths in (True, False):
        assert _nbytes(value, paths=paths, opaque=Handle) == [8, 12]
    Handle.register(Foreign)
    for paths in (True, False):
        assert _nbytes(value, paths=paths, opaque=Handle) == [12]
        assert _nbytes(value, paths=paths, opaque=(NotOpaque, Handle)) == []


def test_an_opaque_type_whose_metaclass_answers_per_instance_is_asked_for_each_instance_in_isinstances_order():
    """A metaclass's __instancecheck__ may answer by the instance, not its
    type: it is asked for every object as isinstance(o, types) asks it —
    not for an object an earlier item already answered for."""
    asked = []

    class ByFlag(type):
        def __instancecheck__(cls, o):
            asked.append(type(o).__name__)
            return getattr(o, "hide", False)

    class Flagged(metaclass=ByFlag):
        pass

    a, b = NotOpaque(torch.ones(2)), NotOpaque(torch.ones(3))
    b.hide = True
    value = [a, b, OpaqueSub(torch.ones(5))]
    for paths in (True, False):
        del asked[:]
        assert _nbytes(value, paths=paths, opaque=Flagged) == [8, 20]
        assert sorted(set(asked)) == ["NotOpaque", "OpaqueSub", "Tensor", "list"]
        del asked[:]
        assert _nbytes(value, paths=paths, opaque=(OpaqueBase, Flagged)) == [8]
        assert "OpaqueSub" not in asked  # OpaqueBase answered first, as in isinstance(o, (OpaqueBase, Flagged))


def test_nn_parameter_listed_opaque_is_asked_through_its_metaclass():
    # torch's _ParameterMeta makes a plain tensor flagged _is_param an
    # instance of Parameter: opaque to isinstance, so to the walk
    flagged, plain = torch.ones(2), torch.ones(3)
    flagged._is_param = True
    if not isinstance(flagged, torch.nn.Parameter):
        pytest.skip("this torch's Parameter has no __instancecheck__ of its own")
    for paths in (True, False):
        assert _nbytes([flagged, plain, torch.nn.Parameter(torch.ones(5))], paths=paths,
                       opaque=torch.nn.Parameter) == [12]


def test_an_object_whose_class_attribute_names_an_opaque_type_is_opaque_as_isinstance_says():
    """isinstance reads o.__class__ when o's type is not a subclass: a
    class's own __class__ or __getattribute__, or a proxy's, makes o an
    instance of another class."""
    import weakref as wr

    class Liar:
        __class__ = property(lambda self: OpaqueBase)

        def __init__(self):
            self.t = torch.ones(2)

    class Masked:
        def __init__(self):
            self.t = torch.ones(3)

        def __getattribute__(self, name):
            return OpaqueSub if name == "__class__" else object.__getattribute__(self, name)

    target = OpaqueSub(torch.ones(5))
    value = [Liar(), Masked(), wr.proxy(target), NotOpaque(torch.ones(7))]
    assert [isinstance(o, OpaqueBase) for o in value] == [True, True, True, False]
    for paths in (True, False):
        assert _nbytes(value, paths=paths, opaque=OpaqueBase) == [28]


def test_an_opaque_types_metaclass_that_gains_an_instancecheck_during_the_walk_is_asked_from_then_on():
    """A listed type's metaclass that keeps type's __instancecheck__ is
    answered by the type's MRO; once Python code the walk runs (a reduce)
    gives it one of its own, isinstance asks that, and so does the walk."""

    class Meta(type):
        pass

    class Listed(metaclass=Meta):
        pass

    class Child(Listed):
        def __init__(self, t):
            self.t = t

    class Trigger:
        def __reduce__(self):
            Meta.__instancecheck__ = lambda cls, o: False
            return (Trigger, ())

    try:
        value = [Child(torch.ones(2)), Trigger(), Child(torch.ones(3))]
        assert _nbytes(value, opaque=Listed) == [12]  # the first Child was a leaf, the second is walked
    finally:
        if "__instancecheck__" in Meta.__dict__:
            del Meta.__instancecheck__
    assert _nbytes([Child(torch.ones(2))], opaque=Listed) == []


def test_an_opaque_type_given_another_metaclass_during_the_walk_is_asked_through_it_from_then_on():
    """A listed type's __class__ can be assigned another metaclass by code
    the walk runs (a reduce): the first metaclass is unchanged, so watching
    its tag alone missed it, and the walk went on answering by the MRO
    where isinstance asks the new metaclass's __instancecheck__."""

    class Plain(type):
        pass

    class Says(type):
        def __instancecheck__(cls, o):
            return True

    class Listed(metaclass=Plain):
        pass

    class Other:
        def __init__(self, t):
            self.t = t

    class Trigger:
        def __reduce__(self):
            Listed.__class__ = Says
            return (Trigger, ())

    for paths in (True, False):
        Listed.__class__ = Plain
        value = [Other(torch.ones(2)), Trigger(), Other(torch.ones(3))]
        assert _nbytes(value, paths=paths, opaque=Listed) == [8], paths  # the second Other is a leaf to isinstance
        assert isinstance(Other(None), Listed)


def test_an_abc_whose_hook_gives_a_later_opaque_type_another_metaclass_has_that_type_asked_through_it():
    """isinstance(o, (Abc, Listed)) runs the ABC's __subclasshook__ first;
    when that code gives Listed a metaclass with an __instancecheck__ of
    its own, Listed is asked through it for this very object, as
    isinstance asks it, not answered by the MRO read before."""
    import abc

    class Plain(type):
        pass

    class Says(type):
        def __instancecheck__(cls, o):
            return True

    class Listed(metaclass=Plain):
        pass

    class Hooked(abc.ABC):
        @classmethod
        def __subclasshook__(cls, c):
            Listed.__class__ = Says
            return NotImplemented

    class Other:
        def __init__(self, t):
            self.t = t

    assert _nbytes([Other(torch.ones(2))], opaque=(Hooked, Listed)) == []
    assert isinstance(Other(None), (Hooked, Listed))


def test_an_abc_registered_during_the_walk_answers_from_then_on_as_isinstance_does():
    """An ABC's answer for a type is kept for the walk, as ABCMeta keeps
    it, until a register() (here from a reduce the walk runs) moves
    abc.get_cache_token(): the instances after it answer afresh."""
    import abc

    class Handle(abc.ABC):
        pass

    for paths in (True, False):
        class Foreign:  # a class no walk has asked Handle about
            def __init__(self, t):
                self.t = t

        class Registers:
            def __reduce__(self, F=Foreign):
                Handle.register(F)
                return (Registers, ())

        value = [Foreign(torch.ones(2)), Registers(), Foreign(torch.ones(3))]
        assert _nbytes(value, paths=paths, opaque=(OpaqueBase, Handle)) == [8]
        assert isinstance(value[2], Handle)


def test_an_abc_or_protocol_that_answers_per_call_or_per_instance_is_asked_for_every_object():
    """ABCMeta keeps its answers; an ABC with a __subclasscheck__ of its own,
    a metaclass that overrides ABCMeta's __subclasscheck__, and a typing
    protocol (whose answer reads the instance) do not: each is asked for
    every object."""
    import abc
    import typing

    flip = [False]

    def flipped(cls, sub):  # NotOpaque is one every other time it is asked
        if sub is not NotOpaque:
            return False
        flip[0] = not flip[0]
        return flip[0]

    class OwnCheck(abc.ABC):
        __subclasscheck__ = classmethod(flipped)

    class FlipMeta(abc.ABCMeta):
        def __subclasscheck__(cls, sub):
            return flipped(cls, sub)

    class MetaCheck(metaclass=FlipMeta):
        pass

    @typing.runtime_checkable
    class Closes(typing.Protocol):
        def close(self): ...

    value = [NotOpaque(torch.ones(n)) for n in (1, 2, 3, 4)]
    for listed in (OwnCheck, MetaCheck):
        flip[0] = False
        assert [isinstance(o, listed) for o in value] == [True, False, True, False]
        for paths in (True, False):
            flip[0] = False
            assert _nbytes(value, paths=paths, opaque=(OpaqueBase, listed)) == [8, 16], (listed, paths)
    a, b = NotOpaque(torch.ones(2)), NotOpaque(torch.ones(3))
    b.close = lambda: None
    for paths in (True, False):
        assert _nbytes([a, b], paths=paths, opaque=Closes) == [8]


LOCK_TYPE = type(threading.Lock())


def _rekeyed(kind):
    """A dict (or an object's __dict__) holding a "t" tensor after an item
    whose reduce pops key "a" and puts it back: the same size, its keys in
    another order, "a" met again by iteration."""
    class Rekey:
        def __reduce__(self):
            d.pop("a")
            d["a"] = self
            return (Rekey, ())

    if kind == "dict":
        d = {"a": Rekey(), "t": torch.ones(3)}
        return d, d

    class Plain:
        pass

    o = Plain()
    o.a, o.t = Rekey(), torch.ones(3)
    d = o.__dict__
    return o, d


@pytest.mark.parametrize("kind", ["dict", "attrs"])
@pytest.mark.parametrize("how", ["scan", "no paths", "dumps", "future"])
def test_a_dict_whose_keys_the_values_own_code_reorders_is_a_walk_error_as_python_iteration_refuses_it(kind, how):
    # Python's own dict iteration raises "dictionary keys changed during
    # iteration" when it meets more keys than the dict holds; the walk met
    # "a" twice: scan silently, dumps blaming two NaN keys the dict never
    # held — and in an instance's __dict__ (a split table, in insertion
    # order) "t" moved back past the walk: scan missed its tensor.
    value, _ = _rekeyed(kind)
    with pytest.raises(devpickle.WalkError) as e:
        if how == "scan":
            devpickle.scan({"outer": value})
        elif how == "no paths":
            devpickle.scan({"outer": value}, paths=False)
        elif how == "dumps":
            devpickle.dumps({"outer": value})
        else:
            devpickle.Future().set_result({"outer": value})
    name = "dict" if kind == "dict" else f"{__name__}._rekeyed.<locals>.Plain"
    assert str(e.value).startswith(f"cannot walk a '{name}' at $.outer: its "), str(e.value)
    assert str(e.value).endswith("dictionary keys changed during the walk (Python code of the value's changed it)"), \
        str(e.value)
    assert "NaN" not in str(e.value)


def test_an_objects_attributes_that_the_values_own_code_reorders_during_a_run_are_a_walk_error_never_one_missed():
    # Without paths an object's __dict__ is read in place; a sparse tensor's
    # read runs Python code (its dispatch) that put the attribute read back
    # at the end of the dict: "later" moved before the position reached, and
    # the run read "t" again and missed "later"'s tensor.
    held = []

    def move(n, t):
        h = held[0]()
        if n == 1 and h is not None:
            h.__dict__["t"] = h.__dict__.pop("t")

    def make():
        h = Holder(_sparse())
        h.later = torch.ones(3)
        held[:] = [weakref.ref(h)]
        return [h]

    paths, no_paths, future = _three_walks(make, move)
    assert paths == (f"cannot walk a '{__name__}.Holder' at $[0]: its items cannot be read: dictionary keys changed "
                     "during the walk (Python code of the value's changed it)", 1), paths
    assert no_paths == paths and future == (paths[0], 1), (no_paths, future)


@pytest.mark.parametrize("how", ["scan", "no paths", "dumps", "future"])
def test_a_set_whose_size_the_values_own_code_changes_is_a_walk_error_as_pickle_refuses_it(how):
    # pickle raises "set changed size during iteration"; the walk went on
    # over the items it had listed, missing the tensor added meanwhile.
    t = torch.ones(5)
    s = set()

    class Adds:
        def __reduce__(self):
            s.add(t)
            return (Adds, ())

    s.add(Adds())
    with pytest.raises(devpickle.WalkError) as e:
        if how == "scan":
            devpickle.scan({"outer": s})
        elif how == "no paths":
            devpickle.scan({"outer": s}, paths=False)
        elif how == "dumps":
            devpickle.dumps({"outer": s})
        else:
            devpickle.Future().set_result({"outer": s})
    assert str(e.value) == ("cannot walk a 'set' at $.outer: its items cannot be read: set changed size during the walk "
                            "(Python code of the value's changed it)")
    assert (e.value.type_name, e.value.path) == ("set", "$.outer")


@pytest.mark.parametrize("paths", [True, False])
def test_a_dict_changed_at_its_size_is_walked_as_python_iterates_it_refused_where_python_refuses_it(paths):
    # Python's iteration refuses a dict from which a key already met was
    # removed and another added (it would yield more keys than it holds),
    # and yields the new key where a key not yet met made room for it.
    t = torch.ones(7)

    def walk(act):
        d = {}

        class Acts:
            def __reduce__(self):
                act(d)
                return (Acts, ())

        d.update(a=1, b=Acts(), c=torch.ones(3))
        return [a.nbytes for a in devpickle.scan({"d": d}, paths=paths)]

    with pytest.raises(devpickle.WalkError, match=r"^cannot walk a 'dict' at \$\.d: its items cannot be read: dictionary "
                                                  r"keys changed during the walk \(Python code of the value's changed it\)$"):
        walk(lambda d: (d.pop("a"), d.__setitem__("n", t)))
    assert walk(lambda d: (d.pop("c"), d.__setitem__("n", t))) == [28]
    assert walk(lambda d: d.__setitem__("c", t)) == [28]



_list_acts = {"appended": lambda l: l.append(torch.ones(3)), "removed": lambda l: l.pop(0), "cleared": lambda l: l.clear()}


class _ListActs:
    """An item whose reduce changes the list held in `box` (pickle needs a
    class it can name)."""

    box = {}

    def __reduce__(self):
        _list_acts[self.box["act"]](self.box["l"])
        return (_ListActs, ())


@pytest.mark.parametrize("act", sorted(_list_acts))
def test_a_list_changed_by_the_values_own_code_is_walked_by_index_as_pickle_walks_it(act):
    # What PYTHON.md says of lists: items appended are walked, one shifted
    # back past the walk by a removal is unseen — by pickle too.
    class Record(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.Tensor):
                self.found.append(o.numel())
                return len(self.found)
            return None

    def fresh():
        _ListActs.box.update(act=act, l=[_ListActs(), torch.ones(1), torch.ones(2)])
        return _ListActs.box["l"]

    r = Record(io.BytesIO(), protocol=5)
    r.found = []
    r.dump(fresh())
    walked = [[a.nbytes // 4 for a in devpickle.scan(fresh(), paths=p)] for p in (True, False)]
    assert walked == [r.found, r.found] == {"appended": [[1, 2, 3]] * 2, "removed": [[2]] * 2, "cleared": [[]] * 2}[act]


def test_a_class_whose_metaclass_is_in_the_dispatch_table_is_a_leaf_never_reduced_through_it():
    # docs/PYTHON.md: globals are leaves, never looked up; pickle would call
    # copyreg.dispatch_table[type(C)](C), the walk calls nothing
    import copyreg

    calls = []

    class Meta(type):
        pass

    class C(metaclass=Meta):
        pass

    def reduce_class(c):
        calls.append(c)
        return (Meta, ("D", (), {"t": torch.ones(1)}))

    copyreg.pickle(Meta, reduce_class)
    try:
        assert devpickle.scan([C, {"k": C}]) == []
        f = devpickle.Future()
        f.set_result(C)
        assert f.wait() is C
        back = devpickle.loads(devpickle.dumps({"c": C}, inline=True), classes=C)
        assert back == {"c": C}
        assert calls == []
    finally:
        del copyreg.dispatch_table[Meta]


def test_an_attribute_or_key_that_is_no_ascii_identifier_is_a_quoted_step_and_an_ascii_one_a_dotted_step():
    # docs/PYTHON.md, "Paths": .name only for an ASCII identifier (a keyword
    # too), ["..."] for any other str key or attribute name
    class Holder:
        pass

    h = Holder()
    for i, name in enumerate(["a b", "é", "1x", "ok", "class"]):
        setattr(h, name, torch.ones(i + 1))
    assert [a.path for a in devpickle.scan(h)] == ['$["a b"]', '$["é"]', '$["1x"]', "$.ok", "$.class"]
    found = devpickle.scan({"é": torch.ones(1), "class": torch.ones(2), "_": torch.ones(3), "a-b": torch.ones(4)})
    assert [a.path for a in found] == ['$["é"]', "$.class", "$._", '$["a-b"]']


def test_a_key_of_a_str_subclass_is_shown_by_its_repr_not_as_a_name():
    # docs/PYTHON.md, "Paths": .name and ["key"] are for str keys; a str
    # subclass's key (an enum's, a user class's) is any other key, [repr]
    class Name(str):
        pass

    assert [a.path for a in devpickle.scan({Name("ab"): torch.ones(1)})] == ["$['ab']"]

    class Loud(str):
        def __repr__(self):
            return "Loud!"

    assert [a.path for a in devpickle.scan({Loud("ab"): torch.ones(1)})] == ["$[Loud!]"]


def test_dlpack_cuda_pinned_host_memory_is_cpu_and_another_host_device_type_a_walk_error():
    # docs/PYTHON.md: DLPack's CPU and its CUDA-pinned host memory
    # (kDLCUDAHost, 3) are cpu, the only devices but cuda:N scan reports
    cap, _keep = _dl_capsule((4,), data=0x20000, device=(3, 0))
    assert [(a.device, a.ptr, a.nbytes) for a in devpickle.scan(_DLProducer((3, 0), cap))] == [("cpu", 0x20000, 16)]
    cap, _keep = _dl_capsule((4,), data=0x20000, device=(13, 0))  # kDLCUDAManaged
    with pytest.raises(devpickle.WalkError, match=r"DLPack device type 13 is not cpu or cuda$"):
        devpickle.scan(_DLProducer((13, 0), cap))


def test_dumps_of_a_tensor_whose_subclass_is_in_copyreg_dispatch_table_names_the_dispatch_table():
    """pickle carries what a dispatch_table entry returns, which a frame has
    no field for: refused, and the message says where the reduce comes from."""
    class Dispatched(torch.Tensor):
        pass

    t = torch.ones(2).as_subclass(Dispatched)
    copyreg.dispatch_table[Dispatched] = lambda x: (list, ([],))
    try:
        with pytest.raises(devpickle.WalkError, match=r"a tensor with a reduce of its own \(its class's "
                                                      r"__reduce_ex__, one set on it, or copyreg\.dispatch_table's\)"):
            devpickle.dumps(t)
    finally:
        del copyreg.dispatch_table[Dispatched]


def test_a_slot_name_that_cannot_be_hashed_is_a_walk_error_naming_the_object():
    """A class's __slotnames__ may hold a str whose __hash__ raises; its
    __getattribute__ answers the read all the same, and the name cannot key
    the state: a WalkError at the object's path, the hash's error its cause."""
    class Unhashable(str):
        def __hash__(self):
            raise ValueError("no hash")

        __eq__ = str.__eq__

    class Slots(bytearray):
        __slots__ = ("a",)

        def __getattribute__(self, n):
            return torch.ones(1) if n == "a" else bytearray.__getattribute__(self, n)

    Slots.__slotnames__ = [Unhashable("a")]
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"b": Slots(b"x")})
    assert e.value.path == "$.b"
    assert e.value.type_name.endswith("Slots")
    assert "its __slots__ cannot be read: no hash" in str(e.value)
    assert type(e.value.__cause__) is ValueError


def test_an_abc_listed_opaque_is_asked_once_for_a_type_not_once_for_each_of_its_instances():
    """ABCMeta keeps its answer for a type; so does the walk: a hundred
    instances of one class run the ABC's __instancecheck__ once a walk."""
    import abc

    class Handle(abc.ABC):
        pass

    class Foreign:
        def __init__(self, t):
            self.t = t

    value = [Foreign(torch.ones(1)) for _ in range(100)]
    for paths in (True, False):
        calls = []

        def prof(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "__instancecheck__":
                calls.append(frame.f_locals.get("instance"))

        sys.setprofile(prof)
        try:
            got = _nbytes(value, paths=paths, opaque=(OpaqueBase, Handle))
        finally:
            sys.setprofile(None)
        assert got == [4] * 100
        assert len([c for c in calls if type(c) is Foreign]) == 1, paths


def test_an_abc_listed_opaque_is_asked_once_for_each_of_hundreds_of_types_met_in_turn():
    """The walk keeps an answer for every type it meets, not as many as a
    fixed table holds: 300 classes, their instances met in turn (each
    class's next instance after all the others'), ask the ABC once each."""
    import abc

    class Handle(abc.ABC):
        pass

    classes = [type(f"Foreign{i}", (), {}) for i in range(300)]
    value = []
    for _ in range(3):
        for c in classes:
            o = c()
            o.t = torch.ones(1)
            value.append(o)
    calls = collections.Counter()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__instancecheck__":
            calls[type(frame.f_locals.get("instance"))] += 1

    for paths in (True, False):
        calls.clear()
        sys.setprofile(prof)
        try:
            got = _nbytes(value, paths=paths, opaque=(Handle,))
        finally:
            sys.setprofile(None)
        assert got == [4] * 900
        assert {c: calls[c] for c in classes} == {c: 1 for c in classes}, paths


_ALIGNED_TYPES = r"""
import abc, devpickle, torch
calls = [0]
class Meta(type):
    def __getattribute__(cls, name):
        calls[0] += 1
        return type.__getattribute__(cls, name)
class Handle(abc.ABC):
    pass
asked = [0]
def prof(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "__instancecheck__" and type(frame.f_locals.get("instance")) in classes:
        asked[0] += 1
classes = [Meta(f"C{i}", (), {}) for i in range(24)]
value = []
for _ in range(50):
    for c in classes:
        o = c()
        o.t = torch.ones(1)
        value.append(o)
devpickle.scan(value, paths=False)
calls[0] = 0
assert len(devpickle.scan(value, paths=False)) == 1200
import sys
sys.setprofile(prof)
devpickle.scan(value, paths=False, opaque=(Handle,))
sys.setprofile(None)
print(calls[0], asked[0], sorted({id(c) % 1024 for c in classes}) == [id(classes[0]) % 1024])
"""


def test_classes_an_allocator_puts_a_kibibyte_apart_are_each_classified_once_not_once_an_instance():
    """An allocator that aligns what it hands out (jemalloc, mimalloc,
    ThreadSanitizer's: here the last, preloaded into a child interpreter)
    puts classes 1 KiB apart: their addresses' low bits are all equal.
    The walk's caches of what a type is, and of what opaque= answers for
    it, must still tell them apart: 24 classes, 50 instances each met in
    turn, are classified once each (a second walk reads no class
    attribute) and the ABC asked once a class."""
    import os
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    if "libtsan" not in preload:
        if preload:
            pytest.skip("another runtime is preloaded (make test-python-asan)")
        try:
            tsan = subprocess.run(["gcc", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pytest.skip("no gcc to find ThreadSanitizer's runtime")
        if not os.path.isabs(tsan):
            pytest.skip("gcc has no ThreadSanitizer runtime")
        env.update(LD_PRELOAD=tsan, TSAN_OPTIONS="report_bugs=0", UCX_MEM_MMAP_HOOK_MODE="none",
                   UCX_MEM_MALLOC_HOOKS="no")
        bare = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, env=env, timeout=60)
        if bare.returncode != 0:  # it maps terabytes of address space: a ulimit -v refuses them
            pytest.skip("ThreadSanitizer's runtime cannot start here: " + bare.stderr.strip()[:200])
    out = subprocess.run([sys.executable, "-c", _ALIGNED_TYPES], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    reads, asked, aligned = out.stdout.split()
    assert aligned == "True", "the preloaded allocator did not put the classes 1 KiB apart: the test sees nothing"
    # 24 x 50 instances: every instance classified again would read its
    # class's attributes about 4,800 times; three classes that share a set
    # of the cache would read them 600 times
    assert int(reads) < 1000
    assert int(asked) == 24


def test_the_metaclasses_an_opaque_walk_watches_are_let_go_of_when_it_ends():
    class Meta(type):
        pass

    class Listed(metaclass=Meta):
        pass

    class Other(metaclass=Meta):
        pass

    before = sys.getrefcount(Meta)
    for _ in range(20):
        assert _nbytes([torch.ones(2)], opaque=(Listed, Other)) == [8]
    assert sys.getrefcount(Meta) == before


def test_a_future_subclass_with_a_reduce_ex_of_its_own_is_reduced_through_it():
    t = torch.ones(2)

    class PortableEx(devpickle.Future):
        def __reduce_ex__(self, protocol):
            return (PortableEx, (), {"t": t})

    (path,) = [a.path for a in devpickle.scan([PortableEx()])]
    assert path.startswith("$[0]<reduce ") and path.endswith(">.state.t"), path


class Global:
    """Reduced to a global by name, as pickle saves it: a leaf."""

    def __reduce__(self):
        return "Global"


def test_an_object_whose_reduce_is_a_global_name_is_a_leaf():
    t = torch.ones(2)
    assert [a.path for a in devpickle.scan([Global(), {"g": Global(), "t": t}])] == ["$[1].t"]


def test_a_class_whose_reduce_ex_cannot_be_looked_up_on_it_is_walked_through_its_reduce():
    """A metaclass that hides __reduce_ex__ from the class (not from its
    instances, which pickle asks) leaves no sign of pickle's default: the
    instance is reduced, as pickle reduces it, not read as a plain object."""

    class Hides(type):
        def __getattribute__(cls, name):
            if name == "__reduce_ex__":
                raise AttributeError(name)
            return type.__getattribute__(cls, name)

    class Hidden(metaclass=Hides):
        def __init__(self, t):
            self.t = t

    (path,) = [a.path for a in devpickle.scan([Hidden(torch.ones(2))])]
    assert path.startswith("$[0]<reduce ") and path.endswith(">.state.t"), path


def test_the_state_an_own_getstate_returns_is_let_go_of_when_the_walk_ends():
    t = torch.ones(2)
    state = {"t": t}

    class Stated(bytearray):
        def __getstate__(self):
            return state

    b = Stated(b"x")
    assert [a.path for a in devpickle.scan([b])][1].endswith(">.state.t")
    before = sys.getrefcount(state)
    for _ in range(20):
        devpickle.scan([b])
    assert sys.getrefcount(state) == before


def test_an_own_getstate_that_raises_is_a_walk_error_naming_the_object():
    class Refuses(bytearray):
        def __getstate__(self):
            raise ValueError("no state")

    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"b": Refuses(b"x")})
    assert e.value.path == "$.b"
    assert e.value.type_name.endswith("Refuses")
    assert "its __getstate__ failed: no state" in str(e.value)
    assert type(e.value.__cause__) is ValueError


class _Maker:
    """A reduce's callable without a __name__ (pickle saves it by its own
    reduce), or whose __name__ raises."""

    def __init__(self, broken):
        self.broken = broken

    def __call__(self, *args):
        return None

    def __getattr__(self, name):
        if name == "__name__" and self.broken:
            raise ValueError("no name")
        raise AttributeError(name)


def test_a_reduce_callable_whose_name_cannot_be_read_is_a_walk_error_unless_it_has_none():
    class Made:
        def __init__(self, broken):
            self.broken = broken

        def __reduce__(self):
            return (_Maker(self.broken), (torch.ones(2),))

    (path,) = [a.path for a in devpickle.scan([Made(False)])]
    assert path.startswith("$[0]<reduce ") and path.endswith(">.args[0]"), path
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"m": Made(True)})
    assert e.value.path == "$.m"
    assert e.value.type_name.endswith("Made")
    assert "it cannot be reduced (if it holds no device memory, list its type in opaque=): no name" in str(e.value)
    assert type(e.value.__cause__) is ValueError


def test_an_instance_of_a_module_subclass_is_refused_as_pickle_refuses_it_not_walked_as_an_object():
    import types

    class Namespace(types.ModuleType):
        pass

    m = Namespace("ns")
    m.t = torch.ones(2)
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"m": m})
    assert e.value.path == "$.m"
    assert e.value.type_name.endswith("Namespace")
    assert str(e.value).endswith("it cannot be reduced (if it holds no device memory, list its type in opaque=): "
                                 "cannot pickle 'Namespace' object")


def test_an_abc_listed_opaque_is_asked_for_an_object_whose_class_answers_its_own_dunder_class():
    """ABCMeta reads o.__class__: for a class with a __class__ of its own the
    ABC is asked for each object, the ABC itself included, as isinstance asks it."""
    import abc

    class Handle(abc.ABC):
        pass

    class Odd:
        def __init__(self, t):
            self.t = t

        @property
        def __class__(self):
            return Odd

    Handle.register(Odd)
    assert isinstance(Odd(None), Handle)
    for paths in (True, False):
        assert _nbytes([Odd(torch.ones(2)), torch.ones(3)], paths=paths, opaque=(Handle, OpaqueBase)) == [12], paths


def test_a_slot_of_a_buffer_subclass_that_cannot_be_read_is_a_walk_error_naming_the_object():
    class Unreadable(bytearray):
        __slots__ = ("a",)

        def __getattribute__(self, n):
            if n == "a":
                raise ValueError("unreadable")
            return bytearray.__getattribute__(self, n)

    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"b": Unreadable(b"x")})
    assert e.value.path == "$.b"
    assert e.value.type_name.endswith("Unreadable")
    assert "a slot cannot be read: unreadable" in str(e.value)
    assert type(e.value.__cause__) is ValueError


def test_an_objects_reduce_ex_is_asked_for_protocol_5_as_the_walk_promises():
    asked = []
    t = torch.ones(2)

    class Asks:
        def __reduce_ex__(self, protocol):
            asked.append(protocol)
            return (Asks, (), {"t": t})

    (path,) = [a.path for a in devpickle.scan([Asks()])]
    assert path.endswith(">.state.t") and asked == [5], (path, asked)


def test_a_buffer_subclass_type_is_asked_for_its_slots_once_not_once_an_instance():
    code = (
        "import copyreg\n"
        "calls = []\n"
        "orig = copyreg._slotnames\n"
        "def counting(cls):\n"
        "    calls.append(cls)\n"
        "    return orig(cls)\n"
        "copyreg._slotnames = counting\n"
        "import devpickle\n"
        "class B(bytearray):\n"
        "    pass\n"
        "v = [B(b'x') for _ in range(100)]\n"
        "for _ in range(3):\n"
        "    devpickle.scan(v)\n"
        "print(sum(c is B for c in calls))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) <= 3, r.stdout


def test_a_tensor_class_that_cannot_be_looked_up_in_the_dispatch_table_is_a_walk_error():
    class Unhashable(type(torch.Tensor)):
        def __hash__(cls):
            raise ValueError("no hash")

    class Odd(torch.Tensor, metaclass=Unhashable):
        pass

    o = torch.ones(2).as_subclass(Odd)
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"o": o})
    assert e.value.path == "$.o"
    assert "its reduce cannot be looked up: no hash" in str(e.value), str(e.value)
    assert type(e.value.__cause__) is ValueError


def _dl_capsule_at(shape, strides=None, *, data=0x10000, byte_offset=0):
    """_dl_capsule with a byte_offset written into its DLTensor."""
    import ctypes

    cap, keep = _dl_capsule(shape, strides, data=data)
    ctypes.memmove(ctypes.addressof(keep[0]) + 40, byte_offset.to_bytes(8, "little"), 8)  # after shape, strides
    return cap, keep


@pytest.mark.parametrize("data, byte_offset, strides, message", [
    (8, 0, (-1,), "a DLPack tensor whose extent overflows"),            # bytes -4..11: below address 0
    (2**64 - 8, 0, None, "a DLPack tensor whose extent overflows"),     # past the top of the address space
    (0x10000, 2**64 - 4, None, "a DLPack tensor whose extent overflows"),  # data + byte_offset wraps
    (0, 0, None, "a NULL data pointer for a DLPack tensor that is not empty"),
])
def test_dlpack_an_address_range_outside_memory_is_a_walk_error(data, byte_offset, strides, message):
    # as the array interfaces': the view was reported at the wrapped address
    cap, _keep = _dl_capsule_at((4,), strides, data=data, byte_offset=byte_offset)
    with pytest.raises(devpickle.WalkError, match=message) as e:
        devpickle.scan({"x": _DLProducer((1, 0), cap)})
    assert e.value.path == "$.x" and type(e.value.__cause__) is ValueError
    cap, _keep = _dl_capsule_at((4,), data=0x10000, byte_offset=8)
    assert [(a.ptr, a.nbytes) for a in devpickle.scan(_DLProducer((1, 0), cap))] == [(0x10008, 16)]
    cap, _keep = _dl_capsule_at((0,), data=0)
    assert devpickle.scan(_DLProducer((1, 0), cap)) == []  # NULL is an empty view's address


@pytest.mark.parametrize("shape, strides", [((2**62, 0), None), ((4, 0), (2**62, 4)), ((0, 2**62), (4, 2**62))])
def test_a_view_with_an_empty_dimension_addresses_nothing_however_far_its_strides_reach(shape, strides):
    # the extent of a view of no items is 0: a span of another dimension
    # that overflows was a WalkError ("the view's extent overflows")
    assert devpickle.scan({"x": _CAI(shape=shape, strides=strides)}) == []
    elems = None if strides is None else tuple(s // 4 for s in strides)
    cap, _keep = _dl_capsule(shape, elems)
    assert devpickle.scan({"x": _DLProducer((1, 0), cap)}) == []


_LYING_TORCH_FUNCTION = (
    "import torch, devpickle\n"
    "other = torch.zeros(1000)\n"
    "class Liar(torch.Tensor):\n"
    "    @classmethod\n"
    "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
    "        name = getattr(func, '__name__', '')\n"
    "        if name in ('storage', '_storage', 'untyped_storage'):\n"
    "            return getattr(other, name)()\n"
    "        return super().__torch_function__(func, types, args, kwargs or {})\n"
    "class Sparse(torch.Tensor):  # says it is sparse, its parts another tensor\n"
    "    @classmethod\n"
    "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
    "        if getattr(func, '__self__', None) is torch.Tensor.layout:\n"
    "            return torch.sparse_coo\n"
    "        if getattr(func, '__name__', '') in ('_indices', '_values'):\n"
    "            return other\n"
    "        return super().__torch_function__(func, types, args, kwargs or {})\n"
    "t = torch.ones(4)\n"
    "for c in (Liar, Sparse):\n"
    "    got = [(a.ptr, a.nbytes, a.path) for a in devpickle.scan({'l': t.as_subclass(c)})]\n"
    "    assert got == [(t.data_ptr(), 16, '$.l')], (c, got, t.data_ptr(), other.data_ptr())\n"
    "print(devpickle._devpickle._torch_adapter())\n"
)


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_a_tensor_subclass_cannot_name_another_tensors_memory_as_its_own_with_or_without_the_adapter(no_adapter):
    # torch's Python API (no C++ adapter) asked the subclass's
    # __torch_function__ for its storage, and its own layout and _values():
    # another tensor's memory was reported (and an inline frame would copy
    # it) where the adapter reads the tensor itself
    out = _run_child_adapter(_LYING_TORCH_FUNCTION, no_adapter)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("python" if no_adapter == "1" else "c++"), out.stdout


_LYING_TORCH_FUNCTION_MODE = (
    "import torch, devpickle\n"
    "from torch.overrides import TorchFunctionMode\n"
    "other = torch.zeros(1000)\n"
    "asked = []\n"
    "class Liar(TorchFunctionMode):\n"
    "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
    "        name = getattr(func, '__name__', '')\n"
    "        asked.append(name)\n"
    "        r = func(*args, **(kwargs or {}))\n"
    "        return getattr(other, name)() if name in ('storage', '_storage', 'untyped_storage') else r\n"
    "ts = [torch.ones(4), torch.ones(8)[2:], torch.ones(2).as_subclass(type('Sub', (torch.Tensor,), {}))]\n"
    "want = [(t.data_ptr() - t.storage_offset() * 4, t.untyped_storage().nbytes() if hasattr(t, 'untyped_storage')\n"
    "         else t.storage().nbytes()) for t in ts]\n"
    "with Liar():\n"
    "    got = [(a.ptr, a.nbytes) for a in devpickle.scan(ts)]\n"
    "assert got == want, (got, want, other.data_ptr(), asked)\n"
    "assert asked == [], asked\n"
    "print(devpickle._devpickle._torch_adapter())\n"
)


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_an_active_torch_function_mode_neither_sees_nor_answers_the_walks_reads_of_a_tensor(no_adapter):
    # torch's Python API (no C++ adapter) went through the mode: a plain
    # tensor's storage was read without disabling torch function at all,
    # so a mode saw every read and could answer it with another tensor's
    # memory. torch 2's DisableTorchFunction covers modes; torch 1's does
    # not (PYTHON.md)
    if no_adapter == "1" and not hasattr(torch._C, "DisableTorchFunctionSubclass"):
        pytest.skip("torch 1: DisableTorchFunction leaves modes on (PYTHON.md, The torch adapter)")
    out = _run_child_adapter(_LYING_TORCH_FUNCTION_MODE, no_adapter)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("python" if no_adapter == "1" else "c++"), out.stdout


@pytest.mark.parametrize("cuda", [True, False])
def test_an_interface_shape_or_strides_of_numpy_integers_is_read_as_numpy_reads_it(cuda):
    # numpy reads shape and strides through __index__ (a shape taken from
    # an array holds numpy integers); they were "an integer is required"
    name = "__cuda_array_interface__" if cuda else "__array_interface__"
    iface = {"data": (0x100000, False), "shape": (np.int64(2), np.int32(3)), "strides": (np.int64(-12), np.int8(4)),
             "typestr": "<f4", "version": 3}
    got = devpickle.scan({"x": type("I", (), {name: iface})()})
    assert [(a.ptr, a.nbytes, a.path) for a in got] == [(0x100000 - 12, 24, "$.x")]
    if not cuda:  # as numpy does
        buf = np.zeros(8, np.float32)
        over = type("I", (), {name: dict(iface, data=(buf.ctypes.data + 12, False))})()
        assert np.asarray(over).shape == (2, 3)
    with pytest.raises(devpickle.WalkError, match="cannot be interpreted as an integer") as e:
        devpickle.scan({"x": type("I", (), {name: dict(iface, shape=(2, 3.0))})()})
    assert e.value.path == "$.x" and type(e.value.__cause__) is TypeError


def test_a_chain_of_views_is_followed_to_its_owner_for_64_views():
    a = np.arange(100.0)
    x = a[10:20]
    for depth in range(1, 70):
        x = np.asarray(memoryview(x))
        got = [(m.ptr - a.ctypes.data, m.nbytes) for m in devpickle.scan(x)]
        # docs/PYTHON.md: the owner through 64 views, then the view's own span
        assert got == ([(0, 800)] if 2 * depth < 64 else [(80, 80)]), (depth, got)


@pytest.mark.parametrize("version, flags, shape, strides, bits, lo, nbytes", [
    ((1, 1), 0, (9,), None, 4, 0, 5),         # nine 4-bit items, packed: 36 bits in 5 bytes
    ((1, 1), 0, (3,), None, 12, 0, 5),        # 36 bits
    ((1, 1), 0, (9,), (-1,), 4, -4, 5),       # backwards: bits -32..3
    ((1, 1), 0, (3, 3), (4, 1), 4, 0, 6),     # items 0..10: 44 bits
    ((1, 1), 0, (9,), None, 1, 0, 2),
    ((1, 1), 1 << 2, (9,), None, 4, 0, 9),    # DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED: a byte each
    ((1, 0), 0, (9,), None, 4, 0, 9),         # before 1.1: padded (TVM's 1-bit bools take a byte each)
    (None, 0, (9,), None, 1, 0, 9),
])
def test_dlpack_sub_byte_items_are_packed_from_dlpack_1_1_unless_its_flags_say_padded(version, flags, shape, strides,
                                                                                        bits, lo, nbytes):
    # a packed int4 view was reported at a byte an item, twice the bytes it spans
    import ctypes

    name = b"dltensor" if version is None else b"dltensor_versioned"
    cap, keep = _dl_capsule(shape, strides, data=0x10000, bits=bits, name=name, version=version)
    if flags:
        at = ctypes.addressof(keep[0]) + 8 + 2 * ctypes.sizeof(ctypes.c_void_p)  # after version, ctx, deleter
        ctypes.memmove(at, flags.to_bytes(8, "little"), 8)
    got = devpickle.scan({"x": _DLProducer((1, 0), cap)})
    assert [(a.ptr - 0x10000, a.nbytes, a.path) for a in got] == [(lo, nbytes, "$.x")]


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_a_meta_tensor_is_worded_alike_with_or_without_the_adapter(no_adapter):
    # torch's Python API said "a tensor on device type 'meta' has no memory
    # devpickle can track" where the adapter names the layout and the device
    code = ("import torch, devpickle\n"
            "try:\n"
            "    devpickle.scan({'m': torch.empty(2, device='meta')})\n"
            "except devpickle.WalkError as e:\n"
            "    print(e)\n")
    out = _run_child_adapter(code, no_adapter)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        "cannot walk a 'torch.Tensor' at $.m: a tensor whose memory cannot be described: devpickle: cannot describe "
        "the memory of a torch tensor (layout torch.strided, device meta): its storage is on the meta device (a meta "
        "or fake tensor has no memory)"), out.stdout


def test_a_structured_numpy_scalar_with_object_fields_is_walked_as_its_reduce_carries_them():
    """A numpy scalar is a value, not memory — save a structured one
    (numpy.void) whose dtype holds objects: its reduce carries them, a
    tensor among them, as an object array's does. It was a leaf: the
    tensor went unseen by scan and by a Future."""
    a = np.zeros(2, dtype=[("a", "O"), ("b", "<f4")])
    t = torch.ones(4)
    a[0]["a"] = t
    got = devpickle.scan(a[0])
    assert [(x.ptr, x.nbytes) for x in got] == [(t.data_ptr(), 16)]
    assert got[0].path.startswith("$<reduce numpy.void>.args[1]<reduce numpy.ndarray>")
    f = devpickle.Future()
    f.set_result([a[0]])
    assert [n for _, _, n in f._allocations()] == [16]
    # scalars without objects stay leaves: a structured one of numbers, a plain one, one holding None
    plain = np.zeros(1, dtype=[("x", "<f4")])[0]
    assert devpickle.scan([a[1], plain, np.float64(2)]) == []



_DRAINED_LEAVES = """
import tracemalloc, devpickle
N = 1_000_000
class Many:
    def __init__(self, pairs):
        self.pairs = pairs
    def __reduce__(self):
        if self.pairs:
            return (dict, (), None, None, ((i, float(i)) for i in range(10**9, 10**9 + N)))
        return (list, (), None, (str(i) for i in range(10**9, 10**9 + N)))
for pairs in (False, True):
    tracemalloc.start()
    assert devpickle.scan(Many(pairs)) == []
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(peak // N)
"""


def test_scan_keeps_no_leaf_a_reduces_listitems_or_dictitems_yield():
    # The walk drains a reduce's items into a list it keeps until it ends.
    # A million distinct ints, strs or (int, float) pairs held there cost
    # 40 to 100 bytes each; what the walk keeps of a leaf (None, or one
    # shared pair) is the list's pointer: 8 bytes an item, 9 with its growth.
    out = subprocess.run([sys.executable, "-c", _DRAINED_LEAVES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    per_item = [int(n) for n in out.stdout.split()]
    assert len(per_item) == 2 and max(per_item) <= 12, per_item


def test_an_item_after_drained_leaves_keeps_its_index_in_the_path():
    a, b = np.zeros(3), np.ones(2)
    r = ReducedInParts(ReducedInParts, (), None, [1, "x", b"y", 2.5, a, None], [(1, 2.0), ("k", b), ("z", 3)], None)
    got = devpickle.scan(r)
    reduce = "$<reduce test_scan.ReducedInParts>"
    assert [a.path for a in got] == [reduce + ".listitems[4]", reduce + ".dictitems.k"]


def test_a_python_class_of_module_builtins_is_named_by_its_qualname_alone():
    # "module.qualname, a builtin one by its qualname alone": a class whose
    # __module__ is "builtins" is named as builtins' own are, in <reduce T>
    # and in WalkError's type_name.
    t = torch.ones(2)

    class InBuiltins:
        def __reduce__(self):
            return (list, ([t],))

    class LockLike:
        def __reduce__(self):
            raise TypeError("no")

    for c in (InBuiltins, LockLike):
        c.__module__, c.__qualname__ = "builtins", c.__name__
    got = devpickle.scan(InBuiltins())
    assert [a.path for a in got] == ["$<reduce InBuiltins>.args[0][0]"]
    with pytest.raises(devpickle.WalkError) as e:
        devpickle.scan({"x": LockLike()})
    assert e.value.type_name == "LockLike" and e.value.path == "$.x"
    assert str(e.value).startswith("cannot walk a 'LockLike' at $.x: ")


class _BytesSub(bytes):
    pass


def test_a_bytes_subclass_is_reduced_as_pickle_carries_it_not_reported_as_cpu_memory():
    # bytes is a leaf, not memory; a subclass is reduced (its attributes in
    # the state), never taken for a buffer-protocol object's memory.
    b = _BytesSub(b"abc")
    b.t = torch.ones(2)
    assert [(a.device, a.path) for a in devpickle.scan([b])] == [("cpu", "$[0]<reduce test_scan._BytesSub>.state.t")]
    assert devpickle.scan([_BytesSub(b"xyz"), b"xyz"]) == []


def test_a_class_with_dlpack_but_no_dlpack_device_is_no_dlpack_array():
    # DLPack is both methods: __dlpack__ alone is walked as any instance
    # (its attributes), never called.
    called = []

    class HalfDLPack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            called.append(1)
            raise AssertionError("called")

    t = torch.ones(2)
    assert [a.path for a in devpickle.scan({"h": HalfDLPack(t)})] == ["$.h.t"]
    assert called == []


class _PairWithDict(Pair):  # no __slots__: its instances have a __dict__, which pickle carries
    pass


def test_a_namedtuple_subclass_with_a_dict_is_reduced_and_its_attributes_walked():
    t, extra = torch.ones(2), torch.zeros(3)
    p = _PairWithDict(t, 1)
    p.extra = extra
    got = devpickle.scan(p)
    assert sorted(a.path for a in got) == ["$<reduce test_scan._PairWithDict>.args[1]",
                                           "$<reduce test_scan._PairWithDict>.state.extra"]
    assert pickle.loads(pickle.dumps(p)).extra is not None


def test_a_drained_item_of_three_parts_is_kept_whole_though_its_first_two_are_leaves():
    # only an exact pair of bare leaves is kept as a shared pair of Nones: a
    # longer tuple whose first two items are leaves holds more
    a = np.zeros(3)
    r = ReducedInParts(ReducedInParts, (), None, [(1, 2, a)], [], None)
    assert [x.path for x in devpickle.scan(r)] == ["$<reduce test_scan.ReducedInParts>.listitems[0][2]"]


class _PairOtherClass(Pair):
    __slots__ = ()

    @property
    def __class__(self):
        return Pair


def test_a_namedtuple_with_a_class_property_of_its_own_is_reduced_as_pickle_refuses_it():
    # pickle asks obj.__class__ of a __newobj__ reduce: another class is
    # refused; the walk reduces it and words the refusal as pickle does
    with pytest.raises(pickle.PicklingError, match="has the wrong class"):
        pickle.dumps(_PairOtherClass(1, 2), protocol=5)
    with pytest.raises(devpickle.WalkError, match=r"^cannot walk a 'test_scan._PairOtherClass' at \$: its reduce is "
                                                  r"malformed: args\[0\] from __newobj__ args has the wrong class"):
        devpickle.scan(_PairOtherClass(torch.ones(2), 1))


class _NewArgsEx:
    def __init__(self, t, hidden):
        self.t, self._hidden = t, hidden

    def __getnewargs_ex__(self):
        return (self._hidden,), {}

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)


def test_a_class_with_getnewargs_ex_alone_is_walked_through_its_reduce():
    t, hidden = torch.ones(2), torch.zeros(3)
    got = devpickle.scan(_NewArgsEx(t, hidden))
    paths = {a.ptr: a.path for a in got}
    assert paths[storage_ptr(hidden)[0]] == "$<reduce test_scan._NewArgsEx>.args[1]"  # copyreg.__newobj__(cls, *args)
    assert paths[storage_ptr(t)[0]] == "$<reduce test_scan._NewArgsEx>.state.t"


class _ReduceExCallable:  # no __get__: the class attribute is called as it is
    def __init__(self, hidden):
        self.hidden = hidden

    def __call__(self, protocol):
        return (list, ([self.hidden],))


def test_a_tensor_subclass_whose_reduce_ex_is_no_function_is_reduced_through_it():
    hidden = torch.zeros(3)

    class T(torch.Tensor):
        __reduce_ex__ = _ReduceExCallable(hidden)

    t = torch.ones(2).as_subclass(T)
    got = devpickle.scan({"w": t})
    assert [a.path for a in got] == ["$.w", "$.w<reduce test_scan.test_a_tensor_subclass_whose_reduce_ex_is_no_function_…"
                                            ">.args[0][0]"]
    assert got[1].ptr == storage_ptr(hidden)[0]


class _PairOwnReduce(Pair):
    __slots__ = ()  # no __dict__: only its own __reduce__ makes pickle reduce it

    def __reduce__(self):
        return (Pair, (self.b, self.a))


def test_a_slotted_namedtuple_with_its_own_reduce_is_walked_through_it():
    t, u = torch.ones(2), torch.zeros(3)
    got = devpickle.scan(_PairOwnReduce(t, u))
    assert [a.path for a in got] == ["$<reduce test_scan._PairOwnReduce>.args[0]",
                                     "$<reduce test_scan._PairOwnReduce>.args[1]"]
    assert got[0].ptr == storage_ptr(u)[0]


def test_a_frozensets_items_are_walked_as_a_sets_by_position_not_through_its_reduce():
    t = torch.ones(2)
    for fs in (frozenset([t]), {t}):
        assert [a.path for a in devpickle.scan([1, fs])] == ["$[1][0]"], type(fs)


class _NoCudaButArray:
    """A __cuda_array_interface__ that has none (AttributeError) beside an
    __array_interface__ that names host memory."""

    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        raise AttributeError("no cuda here")

    @property
    def __array_interface__(self):
        return self.a.__array_interface__


def test_a_cuda_interface_that_has_none_leaves_the_array_interface_to_name_the_memory():
    a = np.zeros(4)
    got = devpickle.scan({"x": _NoCudaButArray(a)})
    assert [(g.device, g.ptr, g.path) for g in got][0] == ("cpu", a.__array_interface__["data"][0], "$.x")


_QUANTIZED_REFS = (
    "import torch, devpickle\n"
    "x = torch.randn(4, 3)\n"
    "S = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.double)\n"
    "q = torch.quantize_per_channel(x, S, torch.tensor([0, 1, 2, 3]), 0, torch.qint8)\n"
    "f = torch.tensor([0.1, 0.2, 0.3, 0.4])\n"
    "r = torch.quantize_per_channel(x, f, f, 0, torch.quint8)  # scales and zero points one tensor\n"
    "for paths in (False, True):\n"
    "    got = [a.refs for a in devpickle.scan([q, q, q.detach(), q[1:]], paths=paths)]\n"
    "    assert got == [3, 3, 3], (paths, got)\n"
    "    got = [a.refs for a in devpickle.scan([r, r.detach(), r.detach()], paths=paths)]\n"
    "    assert got == [3, 3], (paths, got)\n"
    "print('refs ok')\n"
)


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_objects_on_several_allocations_count_in_the_refs_of_each(no_adapter):
    # refs kept one set of objects counted past two for all allocations: a
    # tensor counted on its data's storage was taken as counted already on
    # its quantizer's scales (q, q.detach(), q[1:] share all three): 2, not 3
    _assert_child_prints(_QUANTIZED_REFS, no_adapter, "refs ok")


def test_an_abc_listed_opaque_is_asked_per_object_where_its_class_attribute_answers_per_instance():
    """ABCMeta reads o.__class__: where that differs from one instance to
    the next, the ABC's answer for one instance is not its type's — each is
    asked, as isinstance(o, Handle) asks it."""
    import abc

    class Handle(abc.ABC):
        pass

    class Registered:
        pass

    Handle.register(Registered)

    class Shifty:
        def __init__(self, t, pose):
            self.t, self.pose = t, pose

        @property
        def __class__(self):
            return Registered if self.pose else Shifty

    hidden, shown = Shifty(torch.ones(2), True), Shifty(torch.ones(3), False)
    assert [isinstance(o, Handle) for o in (hidden, shown)] == [True, False]
    for paths in (True, False):
        assert _nbytes([hidden, shown], paths=paths, opaque=Handle) == [12], paths
        assert _nbytes([shown, hidden], paths=paths, opaque=Handle) == [12], paths


def test_an_abc_with_a_subclasscheck_of_its_own_is_asked_for_each_object_as_isinstance_asks_it():
    """ABCMeta's __instancecheck__ calls cls.__subclasscheck__: an ABC's
    own answers each time, not once for a type (here: no, then yes)."""
    import abc

    asked = []

    class Turns(abc.ABC):
        @classmethod
        def __subclasscheck__(cls, c):
            if c is NotOpaque:
                asked.append(c)
                return len(asked) % 2 == 0
            return False

    value = [NotOpaque(torch.ones(2)), NotOpaque(torch.ones(3))]
    for paths in (True, False):
        del asked[:]
        assert _nbytes(value, paths=paths, opaque=Turns) == [8], paths
        assert len(asked) == 2
    del asked[:]
    assert [isinstance(o, Turns) for o in value] == [False, True]


def test_a_class_registered_with_an_opaque_abc_during_the_walk_is_opaque_from_then_on():
    """abc's register() moves the cache token: the answers the walk kept
    for the ABC are forgotten, and the class's next instance is opaque."""
    import abc

    for paths in (True, False):
        class Handle(abc.ABC):
            pass

        class Foreign:
            def __init__(self, t):
                self.t = t

        class Registers:
            def __reduce__(self):
                Handle.register(Foreign)
                return (Registers, ())

        value = [Foreign(torch.ones(2)), Registers(), Foreign(torch.ones(3))]
        assert _nbytes(value, paths=paths, opaque=Handle) == [8], paths
        assert isinstance(value[0], Handle)


def test_an_abc_whose_metaclass_reads_its_subclasscheck_through_its_own_getattribute_is_asked_each_time():
    """ABCMeta's __instancecheck__ reads cls.__subclasscheck__ through the
    metaclass's __getattribute__: one of its own may answer each time
    anew (here: no, then yes), and is asked for each object."""
    import abc

    asked = []

    class Turning(abc.ABCMeta):
        def __getattribute__(cls, name):
            if name == "__subclasscheck__":
                def check(c):
                    if c is NotOpaque:
                        asked.append(c)
                        return len(asked) % 2 == 0
                    return False
                return check
            return super().__getattribute__(name)

    class Turns(metaclass=Turning):
        pass

    value = [NotOpaque(torch.ones(2)), NotOpaque(torch.ones(3))]
    for paths in (True, False):
        del asked[:]
        assert _nbytes(value, paths=paths, opaque=Turns) == [8], paths
        assert len(asked) == 2
    del asked[:]
    assert [isinstance(o, Turns) for o in value] == [False, True]


def test_an_allocation_key_that_cannot_be_encoded_is_no_key_of_it_as_of_a_dict():
    # a lone surrogate has no UTF-8: no field's name, and no error of its own
    a = devpickle.scan({"x": np.ones(3)})[0]
    assert "\ud800" not in a and "ptr\ud800" not in a
    assert a.get("\ud800", 7) == 7 and a.get("\ud800") is None
    with pytest.raises(KeyError) as e:
        a["\ud800"]
    assert e.value.args == ("\ud800",)
    assert a == dict(a)


def test_an_abc_whose_hook_gives_a_later_opaque_type_another_metaclass_for_this_very_class_has_it_asked():
    """As above, with the hook changing Listed only when asked about the
    object's own class (not the list holding it, met first): Listed is
    asked through its new metaclass for that object."""
    import abc

    for paths in (True, False):
        class Plain(type):
            pass

        class Says(type):
            def __instancecheck__(cls, o):
                return type(o).__name__ == "Other"

        class Listed(metaclass=Plain):
            pass

        class Other:
            def __init__(self, t):
                self.t = t

        class Hooked(abc.ABC):
            @classmethod
            def __subclasshook__(cls, c):
                if c is Other:
                    Listed.__class__ = Says
                return NotImplemented

        assert _nbytes([torch.ones(1), Other(torch.ones(2)), torch.ones(3)], paths=paths,
                       opaque=(Hooked, Listed)) == [4, 12], paths
        assert isinstance(Other(None), (Hooked, Listed))


@pytest.mark.parametrize("raised", [KeyboardInterrupt, MemoryError])
def test_an_interrupt_raised_reading_an_opaques_origin_or_args_passes_through(raised):
    # the generic-alias hint reads __origin__ and __args__, the object's own
    # code: an interrupt or a MemoryError it raises is not swallowed
    for attr in ("__origin__", "__args__"):
        class Reads:
            def __getattr__(self, name):
                if name == attr:
                    raise raised(f"while reading {attr}")
                raise AttributeError(name)

        for opaque in (Reads(), [int, Reads()]):
            with pytest.raises(raised, match=f"^while reading {attr}$"):
                devpickle.scan([], opaque=opaque)


def test_an_opaque_with_args_of_one_type_or_none_is_told_as_code_writes_a_tuple():
    class OneArg:
        __args__ = (int,)

    class NoArgs:
        __args__ = ()

    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=OneArg())
    assert str(e.value) == ("opaque= takes types: a type or an iterable of types, not a 'OneArg' "
                            "(a union is not a type: give its types instead, (int,))")
    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=NoArgs())
    assert str(e.value) == "opaque= takes types: a type or an iterable of types, not a 'NoArgs'"


def test_an_opaque_item_that_is_not_callable_gets_no_factory_hint_whatever_its_qualname():
    class Named:
        pass

    named = Named()
    named.__qualname__ = "Pretends"
    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=[int, named])
    assert str(e.value) == "opaque= takes types; got a 'Named'"


def test_a_callable_opaque_item_whose_qualname_is_no_str_gets_no_factory_hint():
    class Odd:
        def __call__(self):
            return 1

    odd = Odd()
    odd.__qualname__ = 5
    with pytest.raises(TypeError) as e:
        devpickle.scan([], opaque=[int, odd])
    assert str(e.value) == "opaque= takes types; got a 'Odd'"


def test_opaque_given_as_a_sequence_of_the_old_getitem_protocol_is_read_by_index():
    class Types:
        def __getitem__(self, i):
            if i == 0:
                return NotOpaque
            raise IndexError(i)

    assert _nbytes([NotOpaque(torch.ones(2)), torch.ones(3)], opaque=Types()) == [12]


_SPARSE_COO_ORDER = (
    "import torch, devpickle\n"
    "sp = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,))\n"
    + _CHILD_STORAGE +
    "got = [a.ptr for a in devpickle.scan([sp])]\n"
    "assert got == [st(sp._indices())[0], st(sp._values())[0]], got\n"
    "print('coo')\n"
)


@pytest.mark.parametrize("no_adapter", ["0", "1"])
def test_a_sparse_coo_tensor_gives_its_indices_then_its_values_with_or_without_the_adapter(no_adapter):
    _assert_child_prints(_SPARSE_COO_ORDER, no_adapter, "coo")


class _SwapsStorage:
    """Its reduce points tensor t at u's storage: t's memory changes mid-walk."""

    def __init__(self, t, u):
        self.t, self.u = t, u

    def __reduce__(self):
        self.t.set_(self.u.storage())
        return (tuple, ((),))


@pytest.mark.parametrize("paths", [False, True])
def test_a_tensor_counted_on_one_allocation_still_counts_on_the_one_it_moves_to(paths):
    # `counted` was keyed by object (and part): t, counted past two on its
    # first storage, was taken as counted already on u's, which the value's
    # code moved it to — u's refs read 3 where u, its two views and t hold it
    torch = pytest.importorskip("torch")
    t, u = torch.zeros(8), torch.ones(8)
    v = [t, t.detach(), t.detach(), u, u.detach(), u.detach(), _SwapsStorage(t, u), t]
    assert [a.refs for a in devpickle.scan(v, paths=paths)] == [3, 4]
