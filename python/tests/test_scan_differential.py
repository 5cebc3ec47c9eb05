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


def scan_meets(obj):
    return [a.ptr for a in devpickle.scan(obj)]


def assert_as_pickle(obj):
    assert scan_meets(obj) == pickle_meets(obj)


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
