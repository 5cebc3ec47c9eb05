"""devpickle.scan against pickle itself: the memory pickle (protocol 5) meets,
recorded by a Pickler's persistent_id as torch's own extractor does it, is
the memory scan finds, in the same order, and each object's reduce runs at
most once."""
import collections
import copyreg
import dataclasses
import enum
import functools
import io
import pickle
import random
import sys
import threading

import numpy as np
import pytest
import torch

import devpickle


class Recorder(pickle.Pickler):
    """Records the base of every tensor, storage and array pickle meets (a
    storage of no bytes: none); what pickle refuses raises from dump()."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=5)
        self.found = []

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            st = obj.storage()
            if st.nbytes():
                self.found.append(st.data_ptr())
            if type(obj) is torch.Tensor and not obj.__dict__:
                return ("tensor", len(self.found))
            return None  # its attributes are pickled too: its storage comes back here
        if isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
            if obj.nbytes():
                self.found.append(obj.data_ptr())
            return ("storage", len(self.found))
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            if obj.nbytes:
                self.found.append(base.ctypes.data)
            return ("array", len(self.found))
        return None

    def reducer_override(self, obj):
        # torch >= 2.0 pickles a plain tensor's attributes; 1.13 drops them
        # (the walk follows the former: docs/PYTHON.md)
        if type(obj) is torch.Tensor and obj.__dict__:
            func, args = obj._reduce_ex_internal(5)
            return (torch._tensor._rebuild_from_type_v2, (func, torch.Tensor, args, obj.__dict__))
        return NotImplemented


def pickle_meets(obj):
    r = Recorder()
    r.dump(obj)
    return list(dict.fromkeys(r.found))


def storage_ptr(t):
    return t.storage().data_ptr()


Pair = collections.namedtuple("Pair", "a b")
HIDDEN = [torch.arange(3.0) + i for i in range(2)]


class PairNewArgs(Pair):
    __slots__ = ()

    def __getnewargs__(self):
        return tuple(HIDDEN)


class PairNewArgsEx(Pair):
    __slots__ = ()

    def __getnewargs_ex__(self):
        return (HIDDEN[0], HIDDEN[1]), {}


class FieldsTuple(tuple):
    __slots__ = ()
    _fields = ("a", "b")


def test_a_namedtuple_whose_class_gives_its_own_newargs_is_walked_through_them_as_pickle_carries_them():
    # pickle makes a namedtuple from what __getnewargs__ returns: a subclass
    # that returns other objects than its items has pickle carry those, not
    # the items; walked by its fields, the memory it hands pickle went unseen
    t = torch.ones(2)
    for cls in (PairNewArgs, PairNewArgsEx):  # __newobj__(cls, *args): the args after the class
        got = devpickle.scan(cls(t, 1))
        assert [a.ptr for a in got] == pickle_meets(cls(t, 1)) == [storage_ptr(h) for h in HIDDEN]
        assert [a.path for a in got] == ["$<reduce test_scan_differential.%s>.args[%d]" % (cls.__qualname__, i)
                                         for i in (1, 2)]


def test_a_namedtuple_and_a_tuple_with_fields_keep_their_items_named_by_their_fields():
    t, u = torch.ones(2), torch.zeros(3)
    for cls in (Pair, FieldsTuple):
        value = cls((t, u)) if cls is FieldsTuple else cls(t, u)
        got = devpickle.scan(value)
        assert [a.path for a in got] == ["$.a", "$.b"]
        assert [a.ptr for a in got] == pickle_meets(value)


class Plain:
    pass


class AttrDict(dict):
    pass


class ItemsDict(dict):
    def items(self):
        return [("given", HIDDEN[0])]


def plain_with(d=None, **attrs):
    o = Plain()
    if d is not None:
        o.__dict__ = d
    o.__dict__.update(attrs)
    return o


def test_an_instance_whose_dict_holds_a_key_that_is_not_a_str_is_reduced_and_the_key_walked_as_pickle_walks_it():
    # pickle's state for such an instance is its __dict__, keys and all:
    # read as attributes, the walk met the values and never the keys
    t, u = torch.ones(2), torch.zeros(3)
    for key, step in ((t, "<key 1>"), ((t, 1), "<key 1>[0]")):
        o = plain_with(x=u)
        o.__dict__[key] = 1
        got = devpickle.scan(o)
        assert [a.ptr for a in got] == pickle_meets(o) == [storage_ptr(u), storage_ptr(t)]
        assert [a.path for a in got] == ["$<reduce test_scan_differential.Plain>.state.x",
                                         "$<reduce test_scan_differential.Plain>.state" + step]


class Name(str):
    """A str subclass with attributes of its own, which pickle carries."""


def test_an_instance_whose_dict_holds_a_key_of_a_str_subclass_is_reduced_and_the_key_walked_as_pickle_walks_it():
    # pickle reduces such a key as it reduces any str subclass: its own
    # attributes too; read as an attribute name, the walk never met them
    t, u = torch.ones(2), torch.zeros(3)
    name = Name("k")
    name.held = t
    o = plain_with(x=u)
    o.__dict__[name] = 1
    got = devpickle.scan(o)
    assert [a.ptr for a in got] == pickle_meets(o) == [storage_ptr(u), storage_ptr(t)]
    assert got[1].path.startswith("$<reduce test_scan_differential.Plain>.state<key 1>"), got[1].path


def test_an_instance_whose_dict_is_a_dict_subclass_is_reduced_and_that_dict_walked_as_any_value():
    # pickle saves that dict as it saves any value: its own attributes and
    # what its items() returns, not the entries a plain dict's read shows
    t = torch.ones(2)
    d = AttrDict(x=torch.zeros(1))
    d.extra = t
    for o in (plain_with(d), plain_with(ItemsDict(x=t))):
        got = devpickle.scan(o)
        assert [a.ptr for a in got] == pickle_meets(o)
        assert all(a.path.startswith("$<reduce test_scan_differential.Plain>.state<reduce ") for a in got), got
    assert [a.ptr for a in devpickle.scan(plain_with(ItemsDict(x=t)))] == [storage_ptr(HIDDEN[0])]


def test_an_instance_held_only_by_its_list_is_reduced_by_its_own_reduce_ex_however_many_attributes_it_has():
    # without paths a small object held only by its list slot is read in
    # place; one with more attributes than that read takes was left to the
    # walk, which took it for a plain object: its own __reduce_ex__, and the
    # memory it hands pickle, went unseen (a Future's walk missed it)
    t = torch.ones(2)

    def made(nattrs, how):
        o = Plain()
        for i in range(nattrs):
            setattr(o, "a%d" % i, i)
        if how == "reduce":
            o.__reduce_ex__ = lambda proto: (list, ([t],))
        else:
            o.__dict__[t] = 1
        return o

    for nattrs in (2, 40):
        for how in ("reduce", "key"):
            for paths in (True, False):
                got = devpickle.scan([made(nattrs, how)], paths=paths)
                assert [a.ptr for a in got] == [storage_ptr(t)], (nattrs, how, paths)
                assert [a.ptr for a in got] == pickle_meets([made(nattrs, how)])


# ---- random values, compared with pickle ----
#
# Each seed makes one value of nested containers, shared references and
# cycles, objects of every form pickle reduces (defaults, slots,
# __getstate__, __reduce__ of 2 to 6 parts with iterators and a
# state_setter, __reduce_ex__, copyreg.dispatch_table, __getnewargs__ and
# __getnewargs_ex__, dataclasses, namedtuples, enums, builtin subclasses),
# tensors (views, subclasses, attributes, storages) and numpy arrays, and
# at times something pickle refuses. scan must meet the memory pickle meets,
# in its order, with and without paths, raise where pickle raises, and call
# each object's reduce at most once.

CALLS = collections.Counter()


def _rebuild(*args, **kwargs):
    return None


def _set_state(obj, state):
    pass


class _RPlain:
    pass


class _RSlots:
    __slots__ = ("a", "b")


class _RSlotsDict:
    __slots__ = ("a", "__dict__")


class _RGetstate:
    def __init__(self, v):
        self.v = v

    def __getstate__(self):
        CALLS[id(self)] += 1
        return self.v


class _RReduce:
    def __init__(self, parts):
        self.parts = parts

    def __reduce__(self):
        CALLS[id(self)] += 1
        return tuple(iter(p) if i in (3, 4) and p is not None else p for i, p in enumerate(self.parts))


class _RReduceEx:
    def __init__(self, v):
        self.v = v

    def __reduce_ex__(self, proto):
        CALLS[id(self)] += 1
        return (_rebuild, (self.v,), None)


class _RDispatched:
    def __init__(self, v):
        self.v = v


def _reduce_dispatched(o):
    CALLS[id(o)] += 1
    return (_rebuild, (o.v,))


copyreg.dispatch_table[_RDispatched] = _reduce_dispatched


class _RNewArgs:
    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, v, k=None):
        self.v, self.k = v, k

    def __getnewargs_ex__(self):
        CALLS[id(self)] += 1
        return (self.v,), {"k": self.k}


@dataclasses.dataclass
class _RData:
    a: object
    b: object = None


@dataclasses.dataclass(frozen=True, slots=True)
class _RFrozenSlots:
    a: object
    b: object = None


_RPair = collections.namedtuple("_RPair", "a b")


class _RPairNewArgs(_RPair):
    __slots__ = ()

    def __getnewargs__(self):
        CALLS[id(self)] += 1
        return (self.b, self.a)


class _RColor(enum.Enum):
    RED = 1


class _RTuple(tuple):
    pass


class _RList(list):
    pass


class _RDict(dict):
    pass


class _RTensor(torch.Tensor):
    pass


class _RMethods:
    def __init__(self, v):
        self.v = v

    def m(self):
        return self.v


def _generator():
    yield 1


class _Random:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.pool = []

    def memory(self):
        rng, n = self.rng, self.rng.randrange(6)
        return rng.choice([
            lambda: torch.arange(float(n)),
            lambda: torch.arange(float(n + 3))[rng.randrange(3):],
            lambda: np.arange(float(n)),
            lambda: np.arange(float(n + 2))[1:],
            lambda: torch.arange(float(n)).as_subclass(_RTensor),
            lambda: torch.nn.Parameter(torch.arange(float(n))),
            lambda: torch.from_numpy(np.arange(float(n + 1))),
            lambda: torch.arange(float(n)).storage(),
        ])()

    def value(self, depth):
        rng = self.rng
        if self.pool and rng.random() < 0.15:
            return rng.choice(self.pool)
        if depth <= 0:
            x = self.memory() if rng.random() < 0.6 else rng.choice([None, 1, "s", b"b", _RColor.RED, len, _RPlain])
        else:
            x = rng.choice(self.FORMS)(self, depth - 1)
        if rng.random() < 0.5:
            self.pool.append(x)
        return x

    def values(self, depth, most=3):
        return [self.value(depth) for _ in range(self.rng.randrange(most + 1))]

    def a_list(self, d):
        x = self.values(d)
        if self.rng.random() < 0.2:
            x.append(x)
        return x

    def a_dict(self, d):
        x = {}
        for i, v in enumerate(self.values(d)):
            x[self.rng.choice([i, "k%d" % i, (i, "t"), torch.arange(2.0)])] = v
        if self.rng.random() < 0.2:
            x["self"] = x
        return x

    def a_set(self, d):
        items = [torch.arange(3.0), frozenset([torch.arange(1.0), 2]), 5, _RPlain()]
        return self.rng.choice([set, frozenset])(self.rng.sample(items, self.rng.randrange(4)))

    def a_plain(self, d):
        o = _RPlain()
        o.a, o.b = self.value(d), self.value(d)
        if self.rng.random() < 0.2:
            o.me = o
        return o

    def slots(self, d):
        o = self.rng.choice([_RSlots, _RSlotsDict])()
        if self.rng.random() < 0.8:
            o.a = self.value(d)
        if self.rng.random() < 0.5:
            setattr(o, "b", self.value(d))
        return o

    def a_reduce(self, d):
        rng = self.rng
        parts = [_rebuild, tuple(self.values(d, 2))]
        n = rng.randrange(2, 7)
        if n > 2:
            parts.append(rng.choice([None, self.value(d), {"s": self.value(d)}]))
        if n > 3:
            parts.append(rng.choice([None, self.values(d, 2)]))
        if n > 4:
            parts.append(rng.choice([None, list(enumerate(self.values(d, 2))), [(torch.arange(2.0), 1)]]))
        if n > 5:
            parts.append(rng.choice([None, _set_state]))
        return _RReduce(parts)

    def reduced(self, d):
        cls = self.rng.choice([_RGetstate, _RReduceEx, _RDispatched, _RNewArgs])
        return cls(self.value(d))

    def fields(self, d):
        cls = self.rng.choice([_RData, _RFrozenSlots, _RPair, _RPairNewArgs])
        return cls(self.value(d), self.value(d))

    def subclass(self, d):
        cls = self.rng.choice([_RTuple, _RList, _RDict])
        o = cls(("k%d" % i, v) for i, v in enumerate(self.values(d))) if cls is _RDict else cls(self.values(d))
        if self.rng.random() < 0.4:
            o.attr = self.value(d)
        return o

    def tensor(self, d):
        t = torch.arange(float(self.rng.randrange(1, 6)))
        if self.rng.random() < 0.5:
            t = t.as_subclass(_RTensor)
        t.extra = self.value(d)
        return t

    def callables(self, d):
        rng = self.rng
        return rng.choice([lambda: _RMethods(self.value(d)).m, lambda: self.values(d).append,
                           lambda: functools.partial(_rebuild, self.value(d), k=self.value(d))])()

    def attrs(self, d):
        # instance dicts pickle carries otherwise than as str-named attributes,
        # and objects of more attributes than a list's in-place read takes
        rng = self.rng
        o = _RPlain()
        pick = rng.randrange(3)
        if pick == 0:
            o.__dict__[rng.choice([torch.arange(2.0), (torch.arange(float(d + 1)),), 7])] = self.value(d)
        elif pick == 1:
            o.__dict__ = _RDict(a=self.value(d))
            o.__dict__.attr = self.value(d)
        else:
            for i in range(rng.randrange(1, 20)):
                setattr(o, "f%d" % i, self.value(d) if i % 5 == 0 else i)
            if rng.random() < 0.5:
                m = self.memory()
                o.__reduce_ex__ = lambda proto: (_rebuild, (m,))
        return [o, self.value(d)] if rng.random() < 0.5 else o

    def refused(self, d):
        return self.rng.choice([_generator, threading.Lock, lambda: sys.modules["os"]])()

    FORMS = [a_list, lambda self, d: tuple(self.values(d)), a_dict, a_set, a_plain, slots, a_reduce, reduced, fields,
             subclass, tensor, callables, attrs]


def random_value(seed, refused=False):
    gen = _Random(seed)
    if refused:
        gen.FORMS = _Random.FORMS + [_Random.refused]
    return gen.value(4)


def differences(value):
    """What scan does otherwise than pickle with value: [] when nothing."""
    CALLS.clear()
    try:
        met, refused = pickle_meets(value), None
    except Exception as e:  # noqa: BLE001 - whatever pickle raises, scan must raise a WalkError
        met, refused = None, e
    CALLS.clear()
    out = []
    for paths in (True, False):
        try:
            got = [a.ptr for a in devpickle.scan(value, paths=paths)]
        except devpickle.WalkError as e:
            if refused is None:
                out.append("scan raised %r where pickle did not (paths=%s)" % (e, paths))
            continue
        if refused is not None:
            out.append("pickle raised %r where scan did not (paths=%s)" % (refused, paths))
        elif got != met:
            out.append("scan met %s, pickle %s (paths=%s)" % (got, met, paths))
        twice = [k for k, n in CALLS.items() if n > 1]
        if twice:
            out.append("a reduce called %d times (paths=%s)" % (max(CALLS.values()), paths))
        CALLS.clear()
    return out


# seeds whose values scan once walked otherwise than pickle: a namedtuple
# whose class gives its own __getnewargs__ (17, 29), an instance whose
# __dict__ holds a key that is not a str or is a dict subclass (5, 16), an
# object of more attributes than a list's in-place read takes, with a
# __reduce_ex__ of its own, walked without paths (95, 171)
@pytest.mark.parametrize("seed", [5, 16, 17, 29, 95, 171])
def test_values_once_walked_otherwise_than_pickle_are_walked_as_pickle_walks_them(seed):
    assert differences(random_value(seed)) == []


def test_random_values_are_walked_as_pickle_walks_them():
    for seed in range(2000):
        assert differences(random_value(seed)) == [], seed


def test_random_values_holding_what_pickle_refuses_raise_where_pickle_raises():
    for seed in range(1000, 1500):
        assert differences(random_value(seed, refused=True)) == [], seed


class _Property(property):
    pass


class _StaticMethod(staticmethod):
    pass


def test_an_instance_whose_c_base_keeps_state_pickle_refuses_is_refused_as_pickle_refuses_it():
    # object.__reduce_ex__ refuses an instance holding more than its dict and
    # weakref pointers beyond object's header (a Python subclass of property
    # or staticmethod): read as a plain object by its __dict__, it was walked
    # where pickle raises
    t = torch.ones(2)
    for o in (_Property(), _StaticMethod(len)):
        o.t = t
        with pytest.raises(TypeError, match="cannot pickle") as refused:
            pickle_meets(o)
        with pytest.raises(devpickle.WalkError) as e:
            devpickle.scan([o])
        name = type(o).__qualname__
        assert str(e.value) == ("cannot walk a 'test_scan_differential.%s' at $[0]: it cannot be reduced (if it holds "
                                "no device memory, list its type in opaque=): cannot pickle '%s' object" % (name, name))
        assert str(e.value.__cause__) == str(refused.value)


class _ReducedBy:
    def __init__(self, make):
        self.make = make

    def __reduce__(self):
        return (self.make, ())


def test_a_reduces_callable_that_is_a_bound_builtin_method_is_walked_as_pickle_reduces_it():
    # pickle saves a builtin function by name but reduces a bound builtin
    # method to getattr(self, name), walking its __self__: as a reduce's
    # callable it was taken for a builtin function, its __self__ unseen
    t = torch.ones(2)
    for make, step in (([t].pop, "[0]"), ({"a": t}.copy, ".a"), (t.clone, "")):
        got = devpickle.scan(_ReducedBy(make))
        assert [a.ptr for a in got] == pickle_meets(_ReducedBy(make)) == [storage_ptr(t)]
        assert [a.path for a in got] == ["$<reduce test_scan_differential._ReducedBy>.callable"
                                         "<reduce builtin_function_or_method>.args[0]" + step]
    assert devpickle.scan(_ReducedBy(len)) == [] == pickle_meets(_ReducedBy(len))  # a builtin function: a leaf


def test_a_tensors_attribute_keyed_by_a_tensor_is_walked_key_and_all_as_pickle_walks_that_state():
    # torch pickles a tensor subclass's __dict__ as its state, a dict whose
    # keys pickle walks: the walk read it as attributes, and never met a key
    # that is not a str
    t, key = torch.arange(2.0).as_subclass(_RTensor), torch.ones(3)
    t.__dict__[key] = torch.zeros(1)
    got = devpickle.scan([t])
    assert [a.path for a in got] == ["$[0]", "$[0]<key 0>", "$[0][tensor([1., 1., 1.])]"]
    assert [a.ptr for a in got] == pickle_meets([t])


def test_dumps_carries_an_instance_dict_of_a_dict_subclass_as_its_attributes_still():
    # the walk reduces such an instance as pickle does; a frame keeps its
    # entries as the object's attributes, which loads gives back with the
    # object's class alone listed
    o = plain_with(AttrDict(x=1))
    back = devpickle.loads(devpickle.dumps(o), classes=Plain)
    assert type(back) is Plain and back.__dict__ == {"x": 1}
