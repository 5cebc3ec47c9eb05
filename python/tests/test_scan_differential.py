"""devpickle.scan against pickle itself: the memory pickle (protocol 5) meets,
recorded by a Pickler's persistent_id as torch's own extractor does it, is
the memory scan finds, in the same order, and each object's reduce runs at
most once."""
import collections
import io
import pickle

import numpy as np
import pytest
import torch

import devpickle


class Recorder(pickle.Pickler):
    """Records the base of every tensor, storage and array pickle meets (a
    storage of no bytes: none), and whether pickle refuses the value."""

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
    for cls, parts in ((PairNewArgs, ["args[1]", "args[2]"]), (PairNewArgsEx, ["args[1]", "args[2]"])):
        got = devpickle.scan(cls(t, 1))
        assert [a.ptr for a in got] == pickle_meets(cls(t, 1)) == [h.storage().data_ptr() for h in HIDDEN]
        assert [a.path for a in got] == ["$<reduce test_scan_differential.%s>.%s" % (cls.__qualname__, p)
                                         for p in parts]


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
