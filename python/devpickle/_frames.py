"""The Python half of dumps/loads: what loads() makes of the reserved classes
and of allowed classes, and the arrays it rebuilds over buffers. Called by
the C extension; nothing here imports a module or looks a class up by name
from the frame."""

import collections
import copyreg
import enum
import operator
import reprlib
import re
import sys
import types

from ._devpickle import _format_holds_objects as _holds_objects, _hash_work, scan as _scan
from ._object import Object


def _nd(a, name):
    """numpy.ndarray's own attribute `name` of array a (base, dtype, size,
    nbytes, itemsize, flags, __array_interface__), never what a subclass
    defines under that name: a subclass's property could name any address,
    which a view made by its word would read."""
    return sys.modules["numpy"].ndarray.__dict__[name].__get__(a)


def _storage_of(torch, t):
    """The untyped storage of tensor t, read by torch's C method with
    __torch_function__ off: a subclass's untyped_storage() (or its
    __torch_function__) could answer with a storage naming other memory."""
    base = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
    with torch._C.DisableTorchFunction():
        return base.untyped_storage(t) if hasattr(base, "untyped_storage") else base._storage(t)


class Buffer:
    """One out-of-band buffer of a frame, as dumps() hands it to
    buffer_callback, in the frame's table order.

    device: "cuda:0", "cpu", ...; ptr: its address; nbytes: its size;
    obj: the first tensor or array found on it (its memory is the buffer's).
    raw(): the whole buffer, without a copy: a flat uint8 torch tensor on its
    device (torch), a uint8 numpy array (cpu memory) or a uint8 cupy array.
    """

    __slots__ = ("device", "ptr", "nbytes", "obj")

    def __init__(self, device, ptr, nbytes, obj):
        self.device, self.ptr, self.nbytes, self.obj = device, ptr, nbytes, obj

    def raw(self):
        """The whole buffer: a flat uint8 torch tensor on its device (torch),
        a uint8 numpy array (cpu memory), or a uint8 cupy array (cupy)."""
        for name in ("ptr", "nbytes"):  # settable fields: a view is sized by them
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"devpickle.Buffer.raw: {name} is a {type(v).__name__!r}, not an int")
            if v < 0:
                raise ValueError(f"{self!r}: {name} is negative")
        o = self.obj
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(o, torch.Tensor):
            if self.nbytes == 0:
                # no bytes to view, nor to have moved: an empty storage's
                # buffer is at address 0 wherever the storage points
                # (torch.from_numpy(a[10:]) points at a's memory)
                return torch.empty(0, dtype=torch.uint8, device=o.device)
            s = _storage_of(torch, o)
            if s.data_ptr() != self.ptr or s.nbytes() < self.nbytes:
                # resized since (by a callback): other memory, another size;
                # or nbytes set to name more than the storage holds
                raise self._moved()
            # exactly [ptr, ptr + nbytes), as the numpy and cupy paths give it
            return torch.empty(0, dtype=torch.uint8, device=o.device).set_(s)[:self.nbytes]
        cupy = sys.modules.get("cupy")
        if cupy is not None and isinstance(o, cupy.ndarray):
            mem = o.data.mem  # the allocation dumps found: its base and size
            if mem.ptr != self.ptr or self.nbytes > mem.size:
                raise self._moved()
            return cupy.ndarray((self.nbytes,), cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        np = sys.modules.get("numpy")  # never imported here: an array of numpy's has imported it
        if np is None or not isinstance(o, np.ndarray):
            # the memory is viewed only through the array or tensor found on
            # it, which answers for it: an address alone (a Buffer made by
            # hand) could name any memory
            raise TypeError(f"{self!r}: its obj is a {type(o).__name__!r}, not the torch tensor, numpy or cupy "
                            "array dumps found on the buffer")
        if self.nbytes == 0:
            # no bytes to view, nor to have moved: an empty array's memory lies
            # outside any bounds of its own, and an empty tensor's address is
            # NULL, which numpy refuses in an __array_interface__
            return np.empty(0, dtype=np.uint8)
        if type(o) is np.ndarray and o.base is None and not o.dtype.hasobject and o.flags.c_contiguous:
            # the common case in a few calls: an array of numpy's own type (no
            # subclass's attributes) that owns its memory, contiguous, and is
            # still exactly [ptr, ptr + nbytes): its own bytes, as a view of
            # it (read-only as it is)
            if o.__array_interface__["data"][0] == self.ptr and o.nbytes == self.nbytes:
                return o.reshape(-1).view(np.uint8)
        # exactly [ptr, ptr + nbytes), whatever view of it was found first;
        # read-only when the memory's owner is (bytes, a read-only array)
        owner = o
        while isinstance(owner, np.ndarray):
            if _nd(owner, "dtype").hasobject:
                raise self._objects()
            # every array on the way still in [ptr, ptr + nbytes): one resized
            # since (a.resize(..., refcheck=False) from a callback) freed it
            at = _nd(owner, "__array_interface__")["data"][0]
            if _nd(owner, "size") and not self.ptr <= at < self.ptr + self.nbytes:
                raise self._moved()
            base = _nd(owner, "base")
            if base is None:
                # the array that owns the memory must still hold all of it: a
                # resize to fewer bytes keeps its address (realloc shrinks in
                # place) and frees the rest, which a view of nbytes would read
                lo, hi = _array_bounds(owner)
                if not lo <= self.ptr <= self.ptr + self.nbytes <= hi:
                    raise self._moved()
                break
            if not isinstance(base, np.ndarray) and not (torch is not None and isinstance(base, torch.Tensor)):
                # memory of another owner (bytes, a bytearray, a memoryview,
                # an mmap): dumps took the buffer from that owner's extent,
                # which the walk finds again; ptr and nbytes must lie in it
                # (a Buffer's fields can be set: never a view past it)
                if _format_holds_objects(base):  # np.frombuffer(memoryview(an object array))
                    raise self._objects()
                found = _scan(o, paths=False)
                if not found or not found[0].ptr <= self.ptr <= self.ptr + self.nbytes <= found[0].ptr + found[0].nbytes:
                    raise self._moved()
                break
            owner = base
        if torch is not None and isinstance(owner, torch.Tensor):
            # an array over a tensor (t.numpy()): the tensor's storage, where
            # dumps found the memory, must still hold it (t.resize_() moves it)
            s = _storage_of(torch, owner)
            if not s.data_ptr() <= self.ptr <= self.ptr + self.nbytes <= s.data_ptr() + s.nbytes():
                raise self._moved()
        if _format_holds_objects(owner):
            raise self._objects()
        try:
            with memoryview(owner) as m:
                readonly = m.readonly
        except TypeError:
            readonly = isinstance(o, np.ndarray) and not _nd(o, "flags").writeable
        return np.asarray(_Memory(self.ptr, self.nbytes, readonly, o))

    def _objects(self):
        # what dumps refuses to carry (a WalkError): bytes that are pointers,
        # which a writable uint8 view would let code overwrite
        return TypeError(f"{self!r}: its memory holds Python objects (an object array, or a structured one with an "
                         "object field): raw() gives no view of their pointers")

    def _moved(self):
        return ValueError(f"{self!r}: its memory moved since dumps found it (the array or tensor on it was "
                          "resized, or its ptr or nbytes were changed to name other memory): the frame's buffer is "
                          "gone")

    def __repr__(self):
        ptr = f"{self.ptr:#x}" if isinstance(self.ptr, int) and self.ptr >= 0 else repr(self.ptr)
        return f"devpickle.Buffer(device={self.device!r}, ptr={ptr}, nbytes={self.nbytes!r})"


def _format_holds_objects(x):
    """Whether buffer x's items hold Python objects (struct format 'O', also
    inside a structured format; field names aside where numpy exported it):
    the scanner's rule."""
    try:
        return _holds_objects(x)
    except TypeError:
        return False


def _over_objects(x):
    """Whether x is a view, through memoryviews and numpy arrays, over
    memory that holds Python objects (their owner's dtype or format)."""
    np = sys.modules.get("numpy")
    for _ in range(64):  # numpy and memoryview chains are short; a longer one is not followed
        if np is not None and isinstance(x, np.ndarray):
            if _nd(x, "dtype").hasobject:
                return True
            x = _nd(x, "base")
        elif isinstance(x, memoryview):
            x = x.obj
        else:
            return x is not None and _format_holds_objects(x)
        if _format_holds_objects(x):
            return True
    return False


def _array_bounds(a):
    """[lo, hi): the bytes numpy array a addresses now (empty: (0, 0))."""
    ai = _nd(a, "__array_interface__")
    if _nd(a, "size") == 0:
        return 0, 0
    lo = hi = ai["data"][0]
    strides = ai["strides"]
    if strides is None:
        return lo, lo + _nd(a, "nbytes")
    for n, st in zip(ai["shape"], strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + _nd(a, "itemsize")


class _Memory:
    """cpu memory as numpy sees it (__array_interface__), keeping the object
    that owns it alive as long as the array."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, ptr, nbytes, readonly, owner):
        self.__array_interface__ = {"data": (ptr, readonly), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self.owner = owner


def class_label(cls):
    mod = getattr(cls, "__module__", None)
    q = getattr(cls, "__qualname__", cls.__name__)
    return q if mod in (None, "builtins") else f"{mod}.{q}"


class _Allowed(dict):
    """classes= as a dict label -> class; .ids: the ids of the classes and
    functions listed (named(x)); .functions: the functions it
    lists, by module.qualname, which come back only where the frame holds
    them as a value (a devpickle.global: a model's activation, F.relu), never
    called and never taken for a class."""

    __slots__ = ("functions", "ids")

    def named(self, x):
        """Whether x is one of the listed classes or functions (by identity)."""
        return id(x) in self.ids


def allowed(classes):
    """classes= as a dict label -> class (with .functions, above)."""
    out = _Allowed()
    out.functions, out.ids = {}, frozenset()
    if classes is None:
        return out
    if isinstance(classes, (type, types.FunctionType, types.BuiltinFunctionType)):  # one, as a sequence of one
        classes = (classes,)
    if type(classes) is Object:  # iterable through __getitem__, whose first item raises its own TypeError
        raise TypeError(f"classes= takes classes (and functions): a class, a function or a sequence of them, "
                        f"not a devpickle.Object of class {object.__getattribute__(classes, '__class_name__')!r}")
    try:
        if isinstance(classes, (str, bytes)):  # iterable, but of characters: a name is not a class
            raise TypeError
        classes = iter(classes)
    except TypeError:
        if isinstance(classes, (str, bytes)) or _carried_name(classes) is None:
            raise TypeError(f"classes= takes classes (and functions): a class, a function or a sequence of them, "
                            f"not a {type(classes).__name__!r}") from None
        classes = iter((classes,))  # one object carried by name (torch.float16)
    for c in classes:
        if not isinstance(c, type):  # a function, or an object dumps carries by name
            if isinstance(c, (types.FunctionType, types.BuiltinFunctionType)):
                mod, q = getattr(c, "__module__", None), getattr(c, "__qualname__", None)
                if not isinstance(mod, str) or not isinstance(q, str):
                    raise TypeError(f"classes= takes functions by their module and qualname; {c!r} has none")
                key = f"{mod}.{q}"  # as dumps names a function
            else:
                key = _carried_name(c)
                if key is None:
                    got = (f"a devpickle.Object of class {object.__getattribute__(c, '__class_name__')!r}"
                           if type(c) is Object else f"a {type(c).__name__!r}")
                    raise TypeError(f"classes= takes classes, functions and objects dumps carries by name "
                                    f"(torch.float16); got {got}")
            if out.functions.setdefault(key, c) is not c:
                raise ValueError(f"classes= names {key} twice, by two different objects ({out.functions[key]!r} "
                                 f"and {c!r}): a frame could not say which it means")
            continue
        label = class_label(c)
        # a builtin class is labelled by its qualname ("range", as a frame
        # names an instance's class) and, as a devpickle.global (a class
        # held as a value, a reduce's callable: pickle.whichmodule's name),
        # "builtins.range": classes=(list,) makes both come back
        for key in (label, f"builtins.{label}") if label != f"{c.__module__}.{c.__qualname__}" else (label,):
            if out.setdefault(key, c) is not c:
                # a frame names a class by its label alone: it could mean either
                raise ValueError(f"classes= names {key} twice, by two different classes ({out[key]!r} and {c!r}): "
                                 "a frame could not say which it means")
    out.ids = frozenset(map(id, list(out.values()) + list(out.functions.values())))  # both held by out
    for key, f in out.functions.items():
        if key in out:
            # a devpickle.global names either by that one label
            raise ValueError(f"classes= names {key} twice, by a class and a function ({out[key]!r} and {f!r}): a "
                             "frame could not say which it means")
    return out


def _carried_name(x):
    """The name dumps carries x by, when it carries it as a global: an object
    whose reduce is a str (torch.float16, a numpy ufunc, Ellipsis), which
    pickle saves by name too; else None. Asked of dumps itself, so the name
    listed is the one a frame holds, whatever reduce or dispatch_table entry
    gives it."""
    from ._devpickle import dumps, loads

    try:
        got = loads(dumps(x))
    except Exception:
        return None
    if type(got) is Object and got.__class_name__ == "devpickle.global":
        name = got.__attrs__.get("name")
        return name if isinstance(name, str) else None
    return None


# the array classes' names: a frame's object of one of these names that is
# not in the array form (loads makes those in frames.c) is not an array, and
# is never made by the class, whatever classes= lists (torch.Tensor.__new__
# and its __setstate__ on a frame's attributes, np.ndarray(shape) over
# memory nothing wrote)
_ARRAY_NAMES = frozenset({"torch.Tensor", "numpy.ndarray", "cupy.ndarray"})


def new(name, classes):
    """The object for a frame's plain object, made before its attributes so
    that cycles through it come back."""
    cls = None if name in _ARRAY_NAMES else classes.get(name)
    if cls is None:
        return Object(name)
    if issubclass(cls, tuple):
        return None  # a namedtuple is made from its fields, at the end (finish)
    return cls.__new__(cls)


def fill(obj, attrs, copies=None):
    """A plain object's attributes: those its class keeps in slots set with
    setattr, the others into its __dict__ (pickle's default __setstate__
    for a (dict, slots) state). copies: the loads call's Copies, which
    keeps each class's slot names once found."""
    if isinstance(obj, Object):
        try:
            own = object.__getattribute__(obj, "__attrs__")
        except AttributeError:
            # devpickle.Object listed in classes= and made by its __new__: an
            # Object is its class name and attributes, which its __init__
            # sets and dumps carries as its reduce; a plain frame object of
            # that class has no class name to give it
            raise TypeError(f"loads: a {class_label(type(obj))} object in plain form (attributes: {_shown_names(attrs)}): "
                            "a devpickle.Object is carried as its reduce (its class name and attributes)") from None
        own.update(attrs)
        return obj
    slots = _slot_names(type(obj)) if copies is None else copies.slot_names(type(obj))
    state = {k: v for k, v in attrs.items() if k not in slots}
    slot_state = {k: v for k, v in attrs.items() if k in slots}
    setstate = _setstate(obj) if state or slot_state else None  # pickle calls it for a state other than None
    if setstate is not None:
        # the class's own __setstate__, with the state pickle's default
        # reduce gives it (the __dict__, or (__dict__ or None, slots)), as
        # pickle.loads calls it: a class that rebuilds what it does not keep
        # (a lock, a cache) comes back whole
        setstate((state or None, slot_state) if slot_state else state)
    else:
        _set_state(obj, state, slot_state)
    return obj


def _setstate(obj):
    """obj's __setstate__, looked up as pickle.loads looks it up for BUILD,
    once, on the instance (pickle.py: getattr(inst, "__setstate__", None);
    _pickle.c: _PyObject_LookupAttr): a class __getattr__ that returns one
    is honoured, a staticmethod, classmethod or callable object on the
    class is bound as Python binds it; None when there is none (an
    AttributeError, from a __getattr__ too); any other error the lookup
    raises passes through, as through pickle. obj is the instance loads
    made itself (cls.__new__, or the class's reduce), before its state."""
    return getattr(obj, "__setstate__", None)


def _method(obj, name, found, classes, label):
    """found (obj's `name`, looked up on the instance as pickle looks it up:
    __setstate__, extend, append; or, obj being a dict subclass's argument,
    as dict() and OrderedDict() look up keys and items), unless it is a
    value of the frame — a
    class or function listed in classes=, or an instance of a listed class —
    put where the lookup finds it by the frame's own data: an instance
    attribute (a class whose __init__ does self.__dict__ = self, an
    AttrDict) or an item a class __getattr__ returns (self[name]). loads
    would call it with the frame's state or items: a listed function is
    never called, a class is made only through its __new__ or its reduce,
    and an instance's __call__ is not the method pickle means. One the class
    defines itself (extend = len, a staticmethod) is its own code, as a
    method is."""
    if found is None:
        return found
    if not classes.named(found) and not classes.named(type(found)):  # a type is never a listed function
        return found
    for c in type(obj).__mro__:
        d = vars(c)
        if name in d:
            v = d[name]
            if v is found or isinstance(v, staticmethod) and v.__func__ is found:
                return found
            break
    # a class or function by its repr; an instance by its class (its repr is its code, of the frame's data)
    what = repr(found) if classes.named(found) else f"an instance of {class_label(type(found))}"
    raise TypeError(f"loads: {label}'s {name} is {what}, a value of the frame (a class or function listed in "
                    f"classes=, or an instance of one) that its items or attributes put where {name} is looked up, "
                    "not the class's method: loads never calls a value of the frame")


def _slot_names(cls):
    """The attributes cls's instances keep in slots (member descriptors of
    cls or a base; private names mangled, as a frame names them)."""
    return {k for c in cls.__mro__ for k, v in vars(c).items() if isinstance(v, types.MemberDescriptorType)}


# Names that numpy, torch, copy and pickle look up on the instance, its
# __dict__ first, and use: a frame's value there would answer for the object
# once loaded (np.asarray over an __array_interface__ naming any address,
# copy.deepcopy calling a listed function as __deepcopy__), as
# devpickle.Object's __attrs__ never do.
_INSTANCE_PROTOCOL = frozenset({
    "__array_interface__", "__array_struct__", "__array__", "__array_wrap__", "__array_prepare__",
    "__cuda_array_interface__", "__dlpack__", "__dlpack_device__", "__deepcopy__", "__copy__", "__reduce_ex__",
    "__reduce__", "__getstate__", "__setstate__", "__getnewargs__", "__getnewargs_ex__"})
# and, on a dict subclass's instance, what object.__reduce_ex__ calls for its
# items (copy.deepcopy, pickle and dumps alike): a frame's `items` there, a
# listed `list`, had them write the dict empty; and `keys`, which dict(x),
# {**x} and dict.update call on one whose __iter__ is not dict's (an
# OrderedDict): a listed function there was called by them
_DICT_INSTANCE_PROTOCOL = _INSTANCE_PROTOCOL | {"items", "keys"}
# and, on a list or deque subclass's instance, what copy.deepcopy (and, for
# a list, copy.copy) calls for its items once its state is set: a frame's
# `append` there, a listed function, was called with each item
_LIST_INSTANCE_PROTOCOL = _INSTANCE_PROTOCOL | {"append"}


def _set_state(obj, state, slots):
    """pickle's default __setstate__: state into the instance's __dict__,
    slots with setattr; an instance without a __dict__ is a TypeError
    naming its class, never an AttributeError from inside loads; an
    attribute of _INSTANCE_PROTOCOL's names (and a dict's `items`) is a
    TypeError too."""
    names = (_DICT_INSTANCE_PROTOCOL if isinstance(obj, dict) else
             _LIST_INSTANCE_PROTOCOL if isinstance(obj, (list, collections.deque)) else _INSTANCE_PROTOCOL)
    protocol = sorted(k for k in state if k in names)
    if protocol:
        raise TypeError(f"loads: {class_label(type(obj))}'s attributes {_shown_names(protocol)} are names numpy, torch, copy and "
                        "pickle look up on the instance: a frame's value there would answer for the object (an "
                        "__array_interface__ naming any address), so loads sets none")
    if state:
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict):
            raise TypeError(f"loads: {class_label(type(obj))} has no __dict__ for the attributes "
                            f"{_shown_names(state)} (it keeps only {sorted(_slot_names(type(obj)))!r}, in slots)")
        d.update(state)
    for k, v in slots.items():
        try:
            setattr(obj, k, v)
        except AttributeError as e:  # no such slot, and no __dict__; a read-only attribute
            raise TypeError(f"loads: {class_label(type(obj))} cannot take the slot state {shown(k)}: {e}") from e


class Copies:
    """What one loads() call hands out of nodes the frame may share, bounded.

    A frame stores a node once and may refer to it from many objects: a
    bytearray, a set, a reduced object's <args>, state, <listitems> or
    <dictitems> is filled from the node it refers to, so 1,000 bytearrays
    over one 1 MiB bytes node would make 1,000 MiB out of a 1 MiB frame. An
    immutable result (frozenset, numpy scalar) is made once per node and
    shared, as the node is; a mutable one must be an object of its own, so
    the items and bytes each object is filled from are charged, once per
    object (whether or not an allowed class's code copies them: loads cannot
    tell): at most `max_copies`, by default PER_BYTE per byte of the frame
    plus FIXED. A frame whose objects each have nodes of their own stays
    within that; one where many objects share one node may not, though
    dumps wrote it (1,000 objects whose __getstate__ returns one 1,000-item
    dict: 138 kB of frame, 1,000,000 items made — pickle makes them too):
    no bound on the frame's size alone tells that from a hostile frame, so
    the caller who trusts the sender raises max_copies.

    Hashing is charged to the same bound: CPython keeps no tuple's hash, so
    each set item and dict key that is a tuple hashes its whole tree of
    tuples, shared ones each time (1,000 items (i, T) over one 1,000-item T
    hash 1,000,000 items); the tuple items each hash walks are charged before
    Python hashes them (_hash_work, frames.c)."""

    __slots__ = ("size", "left", "limit", "shared", "hashed", "slots")
    PER_BYTE, FIXED = 4, 65536

    def __init__(self, size, max_copies=None):
        if max_copies is None:
            max_copies = self.PER_BYTE * size + self.FIXED
        elif isinstance(max_copies, bool) or not hasattr(type(max_copies), "__index__"):
            raise TypeError(f"loads: max_copies must be None or an int, not {type(max_copies).__name__}")
        else:
            max_copies = operator.index(max_copies)  # once: an __index__ may not give the same int twice
            if max_copies < 0:
                raise ValueError(f"loads: max_copies must be >= 0, not {max_copies!r}")
        self.size = size
        self.left = self.limit = max_copies
        self.shared = {}  # (kind, id(node's object)) -> (that object, what was made of it)
        self.hashed = {}  # _hash_work's memo: id(tuple) -> (that tuple, its work and height)
        self.slots = {}  # slot_names' memo: class -> its slot names

    def slot_names(self, cls):
        """_slot_names(cls), found once a class a call: it reads every
        attribute of every class in cls's MRO (an nn.Module subclass: some
        200), which a frame of many small objects of one class paid each."""
        names = self.slots.get(cls)
        if names is None:
            names = self.slots[cls] = _slot_names(cls)
        return names

    def charge(self, what, n):
        self.left -= n
        if self.left < 0:
            raise ValueError(f"loads: the frame's {what} would copy more than max_copies={self.limit} items and "
                             f"bytes (the default is {self.PER_BYTE} per byte of the frame's {self.size}, plus "
                             f"{self.FIXED}): objects that share nodes copy them each; pass a larger max_copies "
                             "for a frame you trust")

    def charge_hashing(self, what, n):
        self.left -= n
        if self.left < 0:
            raise ValueError(f"loads: the frame's {what} would hash more than max_copies={self.limit} tuple items: "
                             "CPython keeps no tuple's hash, so a set item or dict key that is a tuple hashes all "
                             "the tuples in it each time, and items that share one large tuple hash it each (the "
                             f"default is {self.PER_BYTE} per byte of the frame's {self.size}, plus {self.FIXED}); "
                             "pass a larger max_copies for a frame you trust")

    def hashes(self, what, items):
        """items (a list or a tuple, as _hash_work takes them; the caller then
        builds of them), once what hashing each costs is charged."""
        self.charge_hashing(what, _hash_work(items, self.hashed, min(self.left, 1 << 62)))
        return items

    def share(self, kind, source, make):
        hit = self.shared.get((kind, id(source)))
        if hit is None:
            hit = self.shared[kind, id(source)] = (source, make())  # source kept: its id is not reused
        return hit[1]


_SIZED = (list, dict, set, frozenset, bytes, bytearray, str)
_COPYING = (list, tuple, dict, set, frozenset, bytearray, bytes, str, collections.deque)
_HASHING = (set, frozenset, dict)  # builtins whose constructor hashes an iterable argument's items


def _args_size(cls, args):
    """What cls(*args) copies that loads can know of: a subclass of a
    builtin container or string (list, tuple, dict, set, frozenset,
    bytearray, bytes, str, deque) copies the items of an iterable argument
    each time it is made, so each argument's length is charged per object;
    any other class's __init__ or __new__ is its own code, which copies
    only what it copies (nothing is charged for it: an allowed class is
    trusted code — 10,000 requests holding one shared prompt, str or
    tuple, load as they are)."""
    if not (isinstance(cls, type) and issubclass(cls, _COPYING)):
        return 0
    n = len(args) + sum(_items_made(x) for x in args)
    if issubclass(cls, (bytes, bytearray)):
        # bytes(n) and bytearray(n) allocate n zero bytes: an int argument (a
        # frame's int64, a numpy integer: bytes() takes any __index__) is
        # charged as the bytes it makes, a buffer (an array) as its bytes
        n += sum(_bytes_made(x) for x in args if not isinstance(x, (str, bytes, bytearray)))
    elif issubclass(cls, str):
        # str(a buffer, encoding) decodes all its bytes, however few its
        # first dimension counts: an array of shape (1, 10**6), 1,000 times
        # (a 1 MB frame), made 1 GB of str
        n += sum(_buffer_bytes(x) for x in args if not isinstance(x, (str, bytes, bytearray)))
    return n


def _buffer_bytes(x):
    """The bytes of buffer x (none for an object that is no buffer)."""
    try:
        with memoryview(x) as m:
            return m.nbytes
    except TypeError:
        return 0


def _items_made(x):
    """The items a builtin container's constructor makes of argument x,
    which it iterates whatever its type: len(x) for anything sized — a
    builtin container or string, and as well an array or tensor (its first
    dimension: a stride-0 view of 2**62 items is 16 bytes of frame) or a
    range; none for an unsized one (an int, a 0-d array, which it refuses
    to iterate)."""
    try:
        return len(x)
    except TypeError:
        return 0
    except OverflowError:  # a range of more than sys.maxsize items
        return 1 << 63


def _hashed_items(x):
    """The items a builtin set or dict constructor hashes of argument x, for
    the count by hash, or None where that count was made when x was (a
    frame's set, frozenset or dict) or cannot collide (str and bytes hash
    with a secret; a range's ints are int64, at most 9 of one hash; a
    tensor's items hash by identity). A numpy array's items are scalars
    hashed by value, a deque's whatever it holds: listed, at the cost
    already charged for them (_items_made)."""
    if isinstance(x, (list, tuple)):
        return x
    np = sys.modules.get("numpy")
    if isinstance(x, collections.deque) or (np is not None and isinstance(x, np.ndarray) and x.ndim > 0):
        return list(x)
    return None


def _pair_key(p):
    """The key dict(pairs) takes from item p (a pair: a 2-item tuple, list or
    array row), else None."""
    np = sys.modules.get("numpy")
    if isinstance(p, (tuple, list)) or (np is not None and isinstance(p, np.ndarray) and p.ndim > 0):
        return (p[0],) if len(p) == 2 else None
    return None


def _bytes_made(x):
    """The bytes bytes(x) makes of an argument that is not str or bytes."""
    try:
        return max(operator.index(x), 0)
    except TypeError:
        pass
    try:
        with memoryview(x) as m:
            return m.nbytes
    except TypeError:
        return 0


def _fill_size(x):
    """What handing x to an allowed class's code (its __init__, __new__ or
    __setstate__) may make it copy: a container's items or a str's or
    bytes' length, and a tuple's items' one level down (pickle's args and
    (dict, slots) states are tuples)."""
    if isinstance(x, tuple):
        return len(x) + sum(len(i) for i in x if isinstance(i, _SIZED))
    return len(x) if isinstance(x, _SIZED) else 0


# the attributes dumps writes for each reserved class, and only those
_RESERVED_FORM = {"builtins.set": {"items"}, "builtins.frozenset": {"items"}, "builtins.complex": {"real", "imag"},
                  "builtins.bytearray": {"data"}, "numpy.generic": {"dtype", "data"}, "devpickle.global": {"name"}}


def _reserved(name, attrs, attr, kind):
    """An attribute of a reserved class, checked: a frame is hostile, and an
    object of another form than dumps writes (an attribute more) is not
    read as one of that form with the rest dropped."""
    v = attrs.get(attr)
    if not isinstance(v, kind):
        raise TypeError(f"loads: a {name} object whose {attr!r} is not a {kind.__name__} "
                        f"(attributes: {_shown_names(attrs)})")
    if set(attrs) != _RESERVED_FORM[name]:
        raise TypeError(f"loads: a {name} object whose attributes are {_shown_names(attrs)}, not "
                        f"{sorted(_RESERVED_FORM[name])!r}")
    return v


def shown(x):
    """x for a message, bounded (reprlib's cuts): a frame's key or item may
    refer to one long str many times, whose full repr is that many copies."""
    return reprlib.repr(x)


_NAMES_REPR = reprlib.Repr()
_NAMES_REPR.maxlist, _NAMES_REPR.maxstring = 8, 64


def _shown_names(attrs):
    """A frame object's attribute names for a message, sorted and bounded:
    the first 8, each cut at 64 characters, and how many there are (a
    frame's object may have a million, each a megabyte long)."""
    ns = sorted(attrs)
    shown_ = _NAMES_REPR.repr(ns)
    return shown_ if len(ns) <= _NAMES_REPR.maxlist else f"{shown_} ({len(ns)} names)"


def _no_merge(name, items, made):
    """made, a set of items, unless two of them are one item in Python (1,
    1.0 and True; 0.0 and -0.0; one node twice): a frame's set holds
    distinct items, so that is a crafted frame — refused, as a dict's keys
    are, never a silent merge."""
    if len(made) == len(items):
        return made
    seen = set()
    for x in items:
        if x in seen:
            raise ValueError(f"loads: a {name} whose items are not distinct in Python (1, 1.0 and True; 0.0 and "
                             f"-0.0): item {shown(x)}")
        seen.add(x)
    raise AssertionError("unreachable: a set shorter than its items holds a repeat")


def finish(name, attrs, classes, copies):
    """The reserved classes, and objects that were reduced; copies: what
    this loads() has copied out of shared nodes (Copies)."""
    if name in ("builtins.set", "builtins.frozenset"):
        items = _reserved(name, attrs, "items", list)
        try:
            if name == "builtins.frozenset":
                return copies.share(name, items,
                                    lambda: _no_merge(name, items, frozenset(copies.hashes("frozenset items", items))))
            copies.charge("sets", len(items))
            return _no_merge(name, items, set(copies.hashes("set items", items)))
        except TypeError as e:  # an unhashable item (a list): no set holds one
            raise TypeError(f"loads: a {name} object whose items cannot be a set's: {e}") from e
        except RecursionError as e:  # equal items compared through frozensets nested past Python's limit
            raise ValueError(f"loads: a {name} whose items are nested too deep to be told apart: {e}") from e
    if name == "builtins.complex":
        return complex(_reserved(name, attrs, "real", float), _reserved(name, attrs, "imag", float))
    if name == "builtins.bytearray":
        # bytes only: bytearray(an int) would allocate that many bytes
        data = _reserved(name, attrs, "data", bytes)
        copies.charge("bytearrays", len(data))
        return bytearray(data)
    if name == "numpy.generic":
        dtype, data = _reserved(name, attrs, "dtype", str), _reserved(name, attrs, "data", bytes)
        return copies.share((name, dtype), data, lambda: _numpy_scalar(dtype, data))
    if name == "devpickle.global":
        label = _reserved(name, attrs, "name", str)
        cls = classes.get(label)
        if cls is None:
            cls = getattr(classes, "functions", {}).get(label)
        return cls if cls is not None else Object(name, attrs)
    cls = None if name in _ARRAY_NAMES else classes.get(name)
    if cls is not None and issubclass(cls, tuple) and not any(k.startswith("<") for k in attrs):
        fields = getattr(cls, "_fields", None)
        if not isinstance(fields, tuple) or set(attrs) != set(fields):
            raise TypeError(f"loads: {name} is a tuple class; the frame's attributes {_shown_names(attrs)} "
                            f"are not its fields {fields!r}")
        return cls(**attrs)
    if cls is None or not any(k.startswith("<") for k in attrs):
        return Object(name, attrs) if cls is None else fill(cls.__new__(cls), attrs, copies)
    if not set(attrs) <= _REDUCE_PARTS:
        # dumps writes a reduce's parts alone: a mix is no form it writes,
        # never read as a reduce with the rest dropped
        raise TypeError(f"loads: a {name} object whose attributes mix a reduce's parts and other names "
                        f"(attributes: {_shown_names(attrs)})")
    return reduced(cls, attrs, classes, copies)


# a reduced object's attributes, as dumps writes them
_REDUCE_PARTS = frozenset({"<callable>", "<args>", "<state>", "<listitems>", "<dictitems>", "<state_setter>"})


_TORCH_TENSOR_CLASSES = ("torch.nn.parameter.Parameter", "torch.nn.parameter.Buffer")


def tensor_subclass(t, name, classes):
    """A torch tensor that was of a subclass (the frame's subclass
    attribute): made that class again when classes= allows it (torch's own
    Parameter and Buffer always are); otherwise an Object of that class name
    holding the plain tensor as data — what loads gives for any class it may
    not make, never a silent change of class."""
    import torch

    cls = classes.get(name)
    if cls is None and name in _TORCH_TENSOR_CLASSES:
        cls = getattr(torch.nn.parameter, name.rsplit(".", 1)[1], None)
    if cls is None:
        return Object(name, {"data": t})
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise TypeError(f"loads: the frame holds a tensor of class {name}, which is not a torch.Tensor subclass")
    grad = t.requires_grad
    if issubclass(cls, torch.nn.Parameter):
        return cls(t.detach(), requires_grad=grad)
    out = t.detach().as_subclass(cls)
    return out.requires_grad_() if grad else out


def _numpy():
    """numpy, if the process imported it: loads never imports a module."""
    np = sys.modules.get("numpy")
    if np is None:
        raise TypeError("loads: the frame holds numpy arrays or scalars; import numpy first")
    return np


_DTYPE_STR = re.compile(r"[<>|=][A-Za-z][0-9]*(\[[0-9]*[A-Za-z]+\])?")


def _numpy_scalar(dtype, data):
    """A numpy scalar from its dtype's str and its bytes: plain data only
    (a dtype holding objects would read pointers from the frame)."""
    np = _numpy()
    # only the forms numpy's dtype.str takes ('<f8', '|b1', '<M8[10ms]'):
    # numpy reads others as Python literals, some with a FutureWarning that
    # a caller's -W error would raise in place of this TypeError
    if not isinstance(dtype, str) or not _DTYPE_STR.fullmatch(dtype):
        raise TypeError(f"loads: a numpy.generic of unknown dtype {dtype!r} (not a scalar dtype's str, as "
                        f"'<f8', '|b1' or '<M8[ns]')")
    try:
        dt = np.dtype(dtype)
    except Exception as e:  # numpy parses some dtype strings as Python literals (SyntaxError, ValueError)
        raise TypeError(f"loads: a numpy.generic of unknown dtype {dtype!r}") from e
    if dt.itemsize == 0 and dt.kind in "SU" and len(data) == (4 if dt.kind == "U" else 1) and not any(data):
        return dt.type()  # numpy's empty str_/bytes_ ('<U0', '|S0') hold one NUL character
    if dt.hasobject or dt.itemsize != len(data):
        raise TypeError(f"loads: a numpy.generic of dtype {dtype!r} with {len(data)} bytes of data")
    if dt.kind in "mM":
        # numpy parses a unit count of 0 ('<M8[0s]'), then divides by it in
        # every cast and arithmetic (a SIGFPE, not an exception); and it
        # holds a datetime without a unit only as NaT (str and repr of any
        # other raise): neither is a scalar numpy makes
        unit, count = np.datetime_data(dt)
        if count == 0:
            raise TypeError(f"loads: a numpy.generic of dtype {dtype!r} with a unit of 0 {unit}: numpy divides by "
                            "the unit's count in every conversion")
        nat = int(np.frombuffer(data, dtype=np.dtype("i8").newbyteorder(dt.byteorder))[0]) == -1 << 63
        if dt.kind == "M" and unit == "generic" and not nat:
            raise TypeError(f"loads: a numpy.generic of dtype {dtype!r} with no unit and a value that is not NaT: "
                            "numpy holds a datetime without a unit only as NaT")
    if dt.kind == "U":
        # numpy makes a str_ of the code points as they are: one past U+10FFFF
        # is CPython's SystemError, or a str no Python code could make
        points = np.frombuffer(data, dtype=np.dtype("u4").newbyteorder(dt.byteorder))
        if points.size and int(points.max()) > 0x10FFFF:
            raise TypeError(f"loads: a numpy.generic of dtype {dtype!r} whose data holds a code point past "
                            f"U+10FFFF ({int(points.max()):#x})")
    return np.ndarray((), dtype=dt, buffer=data)[()]  # itemsize 0 too (numpy.void(b""))


def _global_name(fn):
    """The name a devpickle.global stands for, else None."""
    if isinstance(fn, Object) and fn.__class_name__ == "devpickle.global":
        return fn.__attrs__.get("name")
    return None


# The codecs and error handlers a frame may name to str(), bytes() and
# bytearray() through an allowed subclass: those CPython knows without a
# lookup (its fast paths), each linear. Any other name is looked up: the
# encodings package imports encodings.<name> (a frame naming cp875 imported
# encodings.cp875), a codec or handler a library registered runs its code,
# namereplace imports unicodedata, and punycode encodes in quadratic time
# (10,000 characters, a 30 kB frame: 12 s; 20,000: 85 s).
_TEXT_CODECS = frozenset({"utf-8", "utf8", "latin-1", "latin1", "iso-8859-1", "iso8859-1", "ascii", "us-ascii"})
_ERROR_HANDLERS = frozenset({"strict", "ignore", "replace", "backslashreplace", "surrogateescape", "surrogatepass"})


# Arguments str() renders by their repr, which shows a node each time it is
# referred to, not once: its length is not bounded by the items charged
# (a str of 3,000 references to one 100 kB str, a 118 kB frame, made a
# 300 MB str).
_REPR_GROWS = (list, tuple, dict, set, frozenset, collections.deque, Object)


def _array_ndim(x):
    """x's number of dimensions when it is a numpy or cupy array or a torch
    tensor, else None."""
    for module, kind in (("numpy", "ndarray"), ("torch", "Tensor"), ("cupy", "ndarray")):
        m = sys.modules.get(module)
        if m is not None and isinstance(x, getattr(m, kind)):
            return len(x.shape)
    return None


def _scalar(x):
    """Whether str(x) renders x alone: None, a str, bytes or number (their
    subclasses by their own code), a numpy scalar, or a 0-d array or
    tensor."""
    if x is None or isinstance(x, (str, bytes, bytearray, int, float, complex)):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.generic) or _array_ndim(x) == 0


def _not_rendered(label, x):
    """The TypeError for a str subclass that str() would make by rendering x,
    which is no scalar."""
    tail = "(loads makes a str subclass of a str, bytes with an encoding, or a scalar)"
    if isinstance(x, _REPR_GROWS):
        return TypeError(f"loads: {label} was reduced with a {type(x).__name__} to render: str() of it is its repr, "
                         f"which shows a node as often as it is referred to {tail}")
    if _array_ndim(x) is not None:
        # numpy's and torch's summaries: 6**16 items for a stride-0 view of
        # 16 dimensions, which a frame holds in a few bytes
        return TypeError(f"loads: {label} was reduced with a {type(x).__name__} of shape {tuple(x.shape)} to render: "
                         "str() of an array or tensor prints up to 6 items of each of its dimensions, however few "
                         f"bytes hold them {tail}")
    return TypeError(f"loads: {label} was reduced with a {class_label(type(x))} to render: str() of it runs its "
                     "class's repr, which may show a node as often as it is referred to (a dataclass's shows each "
                     "field; loads makes a str subclass of a str, bytes with an encoding, or a scalar)")


def _check_text(label, cls, args, kwargs, via_new):
    """Refuses what str's or bytes' __new__ or bytearray's __init__ would
    look up by name (an encoding or error handler: their second and third
    arguments, or encoding= and errors=), and anything but a scalar that
    str() would render (a container's repr, an array's items); a subclass with a __new__ (an __init__, for bytearray) of
    its own takes them as its own code does."""
    if issubclass(cls, (str, bytes)):
        if cls.__new__ is not (str if issubclass(cls, str) else bytes).__new__:
            return
        first = args[0] if args else kwargs.get("object")
        if issubclass(cls, str) and len(args) < 2 and "encoding" not in kwargs and not _scalar(first):
            raise _not_rendered(label, first)
    elif not (issubclass(cls, bytearray) and not via_new and cls.__init__ is bytearray.__init__):
        return  # bytearray.__new__ ignores its arguments
    for what, at, allowed in (("encoding", 1, _TEXT_CODECS), ("error handler", 2, _ERROR_HANDLERS)):
        name = args[at] if len(args) > at else kwargs.get("encoding" if at == 1 else "errors")
        if isinstance(name, str):
            # the characters CPython reads: an allowed str subclass's own ==
            # and hash would answer the check for them ('Strict' equal to
            # 'strict')
            name = str.__str__(name)
        # CPython normalizes an encoding's name before it looks for a codec
        # it knows without a lookup, but matches an error handler's exactly:
        # any other spelling ('Strict') is looked up in codecs' registry
        known = str.replace(str.lower(name), "_", "-") if at == 1 and isinstance(name, str) else name
        if isinstance(name, str) and known not in allowed:
            raise TypeError(f"loads: {label} was reduced with the {what} {str(name)!r}: loads looks no codec up by "
                            f"a name from the frame (it takes {', '.join(sorted(allowed))})")


# what an Enum class called with a value (EnumMeta.__call__, Enum.__new__)
# takes from a frame: values whose hash, == and repr are as long as they are
_ENUM_VALUES = (str, bytes, int, float, complex, bool, type(None))


def _check_enum_value(label, cls, args, kwargs, copies):
    """Refuses an Enum class's call with anything but one value, a scalar or
    a tuple of scalars, or one of its members: Enum.__new__ hashes the
    value, compares it with each member's when it cannot (a numpy array's
    == compares each of its items: a stride-0 view of 2**40) and puts its
    repr in the ValueError for one that is no member — a list holding one
    list twice, 40 levels deep, is a 400-byte frame whose repr is 2**40
    items; with more arguments EnumMeta makes a new class. A tuple's items
    are charged as hashing them is (shared ones once per use)."""
    if kwargs or len(args) != 1:
        raise TypeError(f"loads: {label} is an Enum class reduced with {len(args)} args and {len(kwargs)} keyword "
                        "args: loads calls it only with one value, to give that value's member")
    value = args[0]
    if type(value) is cls:
        return
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if type(v) is tuple:
            if id(v) not in seen:
                seen.add(id(v))
                todo.extend(v)
        elif type(v) not in _ENUM_VALUES:
            raise TypeError(f"loads: {label} is an Enum class reduced with a value that holds a {type(v).__name__}: "
                            "loads looks a member up by a str, bytes, int, float, complex, bool or None, or a tuple "
                            "of them (Enum compares any other value with each member's and shows its repr when "
                            "none is equal)")
    copies.hashes("Enum values", [value])


def reduced(cls, parts, classes, copies):
    """An allowed class from its reduce parts (made, then filled)."""
    obj, stand_in = _reduced_make(cls, parts, classes, copies)
    return obj if stand_in else reduced_fill(obj, cls, parts, classes, copies)


def reduced_new(name, parts, classes, copies):
    """A frame's reduced object made from its callable and args alone,
    before its state, listitems and dictitems are rebuilt, as pickle.loads
    makes it (REDUCE, then the memo, then BUILD, APPENDS, SETITEMS): a cycle
    through those parts comes back to this object. parts holds <callable>
    and <args>; frames.c calls this only for an object whose attributes are
    those, <state>, <listitems> and <dictitems> alone (a state_setter, which
    loads refuses, or a mix with other names is refused at the end, nothing
    made first). An object loads may not make (an unlisted class, a
    callable it never calls) is a devpickle.Object, whose parts are filled
    in at the end (reduced_done). A pair: the object, and whether it is
    such a stand-in."""
    cls = None if name in _ARRAY_NAMES else classes.get(name)
    if cls is None:
        return Object(name), True
    return _reduced_make(cls, parts, classes, copies)


def reduced_done(made, name, parts, classes, copies):
    """Fills what reduced_new made (its pair) with all its parts: the object."""
    obj, stand_in = made
    if stand_in:  # the parts as they came
        object.__getattribute__(obj, "__attrs__").update(parts)
        return obj
    return reduced_fill(obj, classes.get(name), parts, classes, copies)


def _reduced_make(cls, parts, classes, copies):
    """An allowed class from its reduce parts, when the callable is the class
    itself, copyreg.__newobj__ of it, or copyreg.__newobj_ex__ of it (what
    pickle's default reduce gives a class with __getnewargs_ex__), and for an
    Enum class a member by name (getattr(cls, name), looked up in
    __members__) or a Flag class two members combined (operator.or_); for
    any other callable, nothing is called: a devpickle.Object of the class
    name holding the parts."""
    label = class_label(cls)
    if parts.get("<state_setter>") is not None:
        raise TypeError(f"loads: {label} was reduced with a state_setter, which loads does not call")
    fn, args = parts.get("<callable>"), parts.get("<args>", ())
    if not isinstance(args, tuple):  # pickle's REDUCE and NEWOBJ take a tuple too
        raise TypeError(f"loads: {label} was reduced with args that are a {type(args).__name__}, not a tuple")
    if cls is Object and fn is cls:
        # dumps writes an Object as (Object, (its class name,), its attributes):
        # Object's own __init__ would str() any other argument (a 10 kB str
        # the frame lists 20,000 times renders as 200 MB) and copy an attrs
        # dict once per Object, neither charged
        if len(args) != 1 or type(args[0]) is not str:
            raise TypeError(f"loads: {label} was reduced with args that are not (a str class name,), as dumps "
                            f"writes a devpickle.Object, but ({', '.join(type(a).__name__ for a in args[:4])})")
    new_kwargs = {}
    member = None
    if fn is cls:
        new_args = args
    elif (_global_name(fn) == "builtins.getattr" or fn is getattr) and issubclass(cls, enum.Enum) and args[:1] \
            and args[0] is cls:
        # an enum member: pickle reduces it to getattr(cls, name); the member
        # is looked up by name among the class's members, nothing is called
        # (args[0] is cls, never ==: the frame's value would answer that
        # comparison, a stride-0 numpy view of 10**9 items item by item)
        if len(args) != 2 or type(args[1]) is not str:
            raise TypeError(f"loads: {label} was reduced with getattr and args that are not (cls, a str name)")
        member = cls.__members__.get(args[1])
        if member is None:
            name = repr(args[1][:64]) + ("..." if len(args[1]) > 64 else "")
            raise TypeError(f"loads: {label} was reduced to getattr({label}, {name}), which is not one of its "
                            "members")
    elif (_global_name(fn) == "_operator.or_" or fn is operator.or_) and issubclass(cls, enum.Flag):
        # a combination of flags, which pickle (Python 3.11) reduces to
        # operator.or_ of two members: combined by the class's own __or__
        if len(args) != 2 or not all(type(a) is cls for a in args):
            raise TypeError(f"loads: {label} was reduced with operator.or_ and args that are not two of its members")
        member = args[0] | args[1]
    elif (_global_name(fn) == "copyreg.__newobj__" or fn is copyreg.__newobj__) and args and args[0] is cls:
        new_args = args[1:]
    elif (_global_name(fn) == "copyreg.__newobj_ex__" or fn is copyreg.__newobj_ex__) and args and args[0] is cls:
        # (cls, args, kwargs), as pickle's NEWOBJ_EX takes them
        if (len(args) != 3 or not isinstance(args[1], tuple) or not isinstance(args[2], dict)
                or not all(isinstance(k, str) for k in args[2])):
            raise TypeError(f"loads: {label} was reduced with copyreg.__newobj_ex__ and args that are not "
                            "(cls, a tuple, a dict by name)")
        new_args, new_kwargs = args[1], args[2]
    else:
        return Object(label, parts), True  # not a call loads makes: it holds the parts
    if cls is Object and fn is not cls:
        # Object.__new__ (object's) makes one without the class name and
        # attributes its __init__ sets: an Object whose repr, == and
        # refusals raise AttributeError
        raise TypeError(f"loads: {label} was reduced with copyreg.__newobj__ or __newobj_ex__, not as dumps writes "
                        "a devpickle.Object: (Object, (a str class name,), its attributes)")
    if member is not None:
        new_args = ()
    else:
        _check_text(label, cls, new_args, new_kwargs, fn is not cls)
        if issubclass(cls, enum.Enum):
            _check_enum_value(label, cls, new_args, new_kwargs, copies)
    copies.charge("reduced objects' args", _args_size(cls, new_args + tuple(new_kwargs.values())))
    if member is None and issubclass(cls, _HASHING):  # set(a list), dict(pairs), Counter(an array): hashes each item
        for a in new_args + tuple(new_kwargs.values()):
            if issubclass(cls, dict):
                # dict(x) calls x.keys() when x has one, and OrderedDict(x)
                # x.items() too, looked up on the instance: a frame's value
                # there (a devpickle.Object's attribute, a listed function)
                # would be called by loads
                for name in ("keys", "items"):
                    _method(a, name, getattr(a, name, None), classes, f"{label}'s argument")
            items = _hashed_items(a)
            if items is not None:
                copies.hashes("reduced objects' args", items)
                if issubclass(cls, dict):  # dict(pairs) hashes each pair's key
                    # and makes each pair a sequence first: one that is no
                    # list or tuple (an array's row, a str) is copied into a
                    # list of all its items, a stride-0 view's row 2**61
                    copies.charge("reduced objects' args",
                                  sum(_items_made(p) for p in items if not isinstance(p, (list, tuple))))
                    copies.hashes("reduced objects' args", [k[0] for k in map(_pair_key, items) if k is not None])
    if member is not None:
        return member, False
    return (cls(*new_args) if fn is cls else cls.__new__(cls, *new_args, **new_kwargs)), False


def reduced_fill(obj, cls, parts, classes, copies):
    """obj, made by _reduced_make, filled with its listitems, dictitems and
    state as pickle.loads fills it."""
    label = class_label(cls)
    listitems, dictitems = parts.get("<listitems>") or [], parts.get("<dictitems>") or []
    if not isinstance(listitems, list) or not isinstance(dictitems, list) or not all(
            isinstance(p, tuple) and len(p) == 2 for p in dictitems):
        raise TypeError(f"loads: {label} was reduced with listitems that are not a list or dictitems "
                        "that are not a list of (key, value) pairs")
    state = parts.get("<state>")
    if type(obj) is Object and not isinstance(state, (dict, type(None))):  # Object.__setstate__ would dict() it
        raise TypeError(f"loads: {label} was reduced with a state that is a {type(state).__name__}, not the dict of "
                        "its attributes dumps writes a devpickle.Object with")
    if (listitems or dictitems or state is not None) and isinstance(obj, (type, enum.Enum)):
        # the class called with a value gives an object the whole process
        # holds (Mode("a") is the member Mode.A; type(x) a class): filling it
        # would change it for every holder, never make an object of the frame
        what = f"the class {obj!r}" if isinstance(obj, type) else f"the member {class_label(type(obj))}.{obj._name_}"
        raise TypeError(f"loads: {label} was reduced to {what}, which the process already holds, with a state, "
                        "listitems or dictitems: loads changes no object but those it makes")
    copies.charge("reduced objects' listitems and dictitems", len(listitems) + len(dictitems))
    copies.hashes("reduced objects' dictitems", [k for k, _ in dictitems])
    if listitems:
        # as pickle.loads's APPENDS: extend() with each batch of 1,000 (pickle.dumps's
        # batches), else append() item by item
        extend = _method(obj, "extend", getattr(obj, "extend", None), classes, label)
        append = None if extend is not None else _method(obj, "append", getattr(obj, "append", None), classes, label)
        if extend is None and append is None:
            raise TypeError(f"loads: {label} was reduced with listitems, and has neither extend nor append")
        for i in range(0, len(listitems), 1000):
            if extend is not None:
                extend(listitems[i:i + 1000])
            else:
                for item in listitems[i:i + 1000]:
                    append(item)
    for k, v in dictitems:
        try:
            obj[k] = v
        except (TypeError, LookupError) as e:  # no __setitem__, an unhashable key; a list's index past its end
            raise TypeError(f"loads: {label} was reduced with dictitems it cannot take: {e}") from e
    # pickle saves a reduce's listitems and dictitems before its state (BUILD
    # comes last): __setstate__ sees the container filled
    setstate = _method(obj, "__setstate__", _setstate(obj), classes, label) if state is not None else None
    if setstate is not None:
        copies.charge("reduced objects' state", _fill_size(state))  # self.__dict__.update(state)
        setstate(state)
    elif state is not None:
        d, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
        if not isinstance(d, (dict, type(None))) or not isinstance(slots, (dict, type(None))) or not all(
                isinstance(k, str) for k in slots or ()):
            raise TypeError(f"loads: {label} has no __setstate__ and its state is not a dict or a "
                            f"(dict, slots dict by name) pair: {type(state).__name__}")
        copies.charge("reduced objects' state", len(d or ()) + len(slots or ()))
        _set_state(obj, d or {}, slots or {})
    return obj


# uint16, uint32 and uint64 exist from torch 2.3 on (checked where used)
_TORCH_DTYPES = {"bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
                 "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
                 "float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
                 "float64": "float64", "complex64": "complex64", "complex128": "complex128"}
# bytes an item, by the frame's dtype name (FORMAT.md's table)
_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "uint32": 4, "float32": 4, "complex64": 8, "int64": 8, "uint64": 8, "float64": 8,
             "complex128": 16}


def torch_dtype(name):
    """torch's dtype for a frame's dtype name, as _array takes it, or None:
    loads' C path asks it once per name (torch_array in frames.c)."""
    torch = sys.modules.get("torch")
    if torch is None or name not in _TORCH_DTYPES or not hasattr(torch, name):
        return None
    return getattr(torch, name)


def _check_contiguous(source, key):
    """A buffer is the bytes of one allocation, end to end: a strided view
    (a slice with a step, a transposed array) is refused, never copied."""
    torch = sys.modules.get("torch")
    cupy = sys.modules.get("cupy")
    if torch is not None and isinstance(source, torch.Tensor):
        if source.is_meta:  # a view over it would be a meta tensor: no values at all
            raise ValueError(f"loads: buffers[{key}] is a torch tensor on meta, which holds no bytes")
        if getattr(source, "_is_zerotensor", None) is not None and source._is_zerotensor():
            # torch._efficientzerotensor: a storage of no memory that reads
            # as zeros; a numpy array over it reads whatever its null-based
            # pointer names, a torch tensor zeros: neither the frame's bytes
            raise ValueError(f"loads: buffers[{key}] is a torch zero tensor (torch._efficientzerotensor), which "
                             "holds no bytes: give a tensor that holds them (torch.zeros)")
        if source.is_quantized:
            # torch's view(torch.uint8) of a quantized tensor keeps its
            # quantizer under a plain dtype: the first read of the view, or
            # of a tensor made over it, crashes the process
            raise ValueError(f"loads: buffers[{key}] is a quantized torch tensor ({source.dtype}), whose values are "
                             "not its bytes: give its bytes as a plain tensor (q.int_repr())")
        if source.is_conj() or source.is_neg():
            # its memory holds other values than it reads: a view of the
            # same dtype (a flat uint8 one's) keeps the bit, and a tensor
            # made over it reads every byte negated
            bit = "conjugate" if source.is_conj() else "negative"
            raise ValueError(f"loads: buffers[{key}] is a {bit} view, whose values are not its bytes: give a plain "
                             f"tensor (t.resolve_{'conj' if bit == 'conjugate' else 'neg'}(), its values)")
        ok = source.is_contiguous()
    elif cupy is not None and isinstance(source, cupy.ndarray):
        ok = source.flags.c_contiguous
    else:
        try:
            with memoryview(source) as m:
                ok = m.c_contiguous
                fmt = m.format
        except TypeError:
            if type(source) is Object:  # named by its class, as every argument names a stand-in
                raise TypeError(f"loads: buffers[{key}] is a devpickle.Object of class "
                                f"{object.__getattribute__(source, '__class_name__')!r}, not a buffer") from None
            raise TypeError(f"loads: buffers[{key}] is of type {type(source).__name__!r}, not a buffer") from None
        except ValueError as e:  # an exporter that refuses: numpy's datetime64 and timedelta64 arrays
            raise TypeError(f"loads: buffers[{key}] is a {type(source).__name__!r} that exports no buffer ({e}): "
                            "give its bytes (a.view(numpy.uint8))") from None
        # a buffer of Python objects (numpy dtype=object, struct format 'O',
        # also inside a structured format) holds pointers: a tensor over it
        # would read them, and writes through it would corrupt the objects'
        # references
        if _format_holds_objects(source) or getattr(getattr(source, "dtype", None), "hasobject", False):
            raise TypeError(f"loads: buffers[{key}] holds Python objects (format {fmt!r}), not bytes")
        if _over_objects(source):
            # bytes of its own format over such memory: np.frombuffer of an
            # object array, a memoryview of that
            raise TypeError(f"loads: buffers[{key}] is a view over memory that holds Python objects (an object "
                            "array's, or a structured one's with an object field), not bytes")
    if not ok:
        raise ValueError(f"loads: buffers[{key}] is not contiguous: a buffer must be its allocation's bytes "
                         "end to end (numpy.ascontiguousarray or .contiguous() makes such a copy)")


def _plain_bytes(np, x):
    """Whether x is flat uint8 memory of numpy's own type over memory that
    numpy's own arrays hold, without objects: raw()'s answer for an array
    that owns its memory, in which no check of _check_contiguous's finds
    anything to refuse (an exact type: no subclass's attributes answer)."""
    if type(x) is not np.ndarray or x.dtype != np.uint8 or x.ndim != 1 or not x.flags.c_contiguous:
        return False
    b = x.base
    return b is None or (type(b) is np.ndarray and b.base is None and not b.dtype.hasobject)


def _read_only(source):
    """Whether a bytes-like buffer's memory is read-only (bytes, a read-only
    array); False for what exports no buffer (cupy), refused elsewhere."""
    try:
        with memoryview(source) as m:
            return m.readonly
    except (TypeError, ValueError):
        return False


def _flat(kind, device, source, cache, key, nbytes, inline):
    """The whole buffer as a flat uint8 array of the kind wanted, made once
    per buffer and kind so that views of one storage share it (cache[key]:
    the buffer's source; cache[key, kind]: its flat array of that kind).
    inline: the source is the frame's own copy of the bytes, which goes to
    the device the frame names, whatever buffers= holds."""
    flat = cache.get((key, kind))  # a tensor and a numpy array over one buffer each get their own kind of view
    if flat is not None:
        return flat
    if source is None:  # the buffer was met before, as another kind: its source is kept
        source = cache[key]
    else:
        if isinstance(source, Buffer):
            # what buffer_callback received, given back as pickle's
            # PickleBuffers are: its memory, as raw() views it
            try:
                source = source.raw()
            except (TypeError, ValueError) as e:
                raise type(e)(f"loads: buffers[{key}]: {e}") from e
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(source, torch.Tensor):
            # a tensor given itself: an alias of the storage it holds now,
            # so that code run before a later view (an allowed class's
            # __setstate__ calling given.set_()) moves only the given
            # tensor, never the views still to be made of this buffer (a
            # flat uint8 one would otherwise be used as it is)
            source = source.detach()
        cache[key] = source
    torch = sys.modules.get("torch")
    if isinstance(source, memoryview):
        try:
            source.nbytes  # any read of a released one raises
        except ValueError:
            # it holds no memory: said as a missing buffer is
            raise ValueError(f"loads: buffers[{key}] is a released memoryview: buffer {key} ({device}, {nbytes} bytes) "
                             "needs its bytes") from None
    np = sys.modules.get("numpy")
    plain = kind == "numpy.ndarray" and np is not None and _plain_bytes(np, source)
    if not plain:
        _check_contiguous(source, key)
    if kind == "torch.Tensor" and not isinstance(source, torch.Tensor) and _read_only(source):
        # a torch tensor is always writable: over a read-only buffer (bytes)
        # it gets a copy, never a writable view of immutable memory. The
        # copy is kept as the buffer's source, so that numpy arrays first
        # made of the buffer after it are made over it too: a tensor and an
        # array that shared memory still do. Arrays made before, over the
        # read-only bytes, stay there (PYTHON.md: give a writable buffer
        # for them to share the tensor's memory)
        source = cache[key] = bytearray(source)
    if kind != "torch.Tensor" and torch is not None and isinstance(source, torch.Tensor):
        if source.device.type != "cpu":
            raise TypeError(f"loads: a {kind} over a torch tensor on {source.device}")
        source = source.detach().reshape(-1).view(torch.uint8).numpy()  # the same memory, as numpy sees it
    if kind == "torch.Tensor":
        if isinstance(source, torch.Tensor):
            # raw()'s answer is flat uint8 already
            flat = source if source.dtype is torch.uint8 and source.dim() == 1 else source.reshape(-1).view(torch.uint8)
        else:
            if memoryview(source).readonly:
                # a torch tensor is always writable: it gets a copy, never a
                # writable view of immutable memory (bytes)
                source = bytearray(source)
            # torch.frombuffer keeps a reference to what it is given but
            # releases its buffer export, so a bytearray (array.array, mmap)
            # given itself could be resized or closed under the tensor: it is
            # given a memoryview, which holds the export as long as the tensor
            # lives (BufferError on a resize), as numpy.frombuffer does
            m = memoryview(source)
            empty = m.nbytes == 0  # nbytes, not len(): a 0-d array has no len
            flat = torch.empty(0, dtype=torch.uint8) if empty else torch.frombuffer(m, dtype=torch.uint8)
            if device.startswith("host:"):
                # devpickle's host backend, simulated devices in host memory:
                # torch has none, and moving the tensor to cpu on its own
                # would change the device the frame names
                raise _cannot(kind, device, key, "torch has no such device (devpickle's host backend)"
                              + _elsewhere(inline))
            if device != "cpu":
                try:
                    flat = flat.to(device)
                except (RuntimeError, AssertionError) as e:  # a torch without that device ("not compiled with CUDA")
                    raise _cannot(kind, device, key, f"{e}{_elsewhere(inline)}") from e
    elif kind == "numpy.ndarray":
        np = _numpy()
        if device != "cpu":  # a frame dumps never writes: numpy arrays are cpu memory
            raise _cannot(kind, device, key, "a numpy array is cpu memory")
        flat = source if plain else np.frombuffer(source, dtype=np.uint8)
    else:
        cupy = sys.modules["cupy"]
        flat = source if isinstance(source, cupy.ndarray) else cupy.asarray(bytearray(source), dtype=cupy.uint8)
        flat = flat.reshape(-1).view(cupy.uint8)
    size = flat.numel() if kind == "torch.Tensor" else flat.size
    if size < nbytes:
        # the frame checked every view against nbytes: a smaller buffer would be read past its end
        raise ValueError(f"loads: buffer {key} holds {size} bytes; the frame describes {nbytes}")
    cache[(key, kind)] = flat
    return flat


def array(kind, device, source, dtype, shape, strides, offset, cache, key, nbytes, inline=False):
    """A tensor or array over buffer `key`: source is bytes-like (an inline
    copy or a cpu buffer), a torch tensor or a cupy array holding the bytes.
    What the framework refuses (a view it cannot make — negative strides for
    torch —, a dtype it lacks — bfloat16 for numpy —, a device it was built
    without) is a ValueError naming the buffer."""
    try:
        return _array(kind, device, source, dtype, shape, strides, offset, cache, key, nbytes, inline)
    except (RuntimeError, AssertionError, OverflowError) as e:
        raise _cannot(kind, device, key, e) from e


def _elsewhere(inline):
    """What a bytes-like buffer's refusal on a device torch lacks says to do:
    a cpu tensor given as the buffer rebuilds the tensor on cpu, where the
    frame's buffers are out of band; an inline frame's bytes are its own."""
    if inline:
        return ("; an inline frame's tensors are rebuilt on the device it names, whatever buffers= holds (a frame "
                "whose buffers are out of band is rebuilt on cpu over cpu tensors given as its buffers)")
    return "; give a cpu tensor as this buffer to rebuild the tensor on cpu"


def _cannot(kind, device, key, why):
    return ValueError(f"loads: a {kind or 'tensor'} over buffer {key} ({device}) cannot be made here: {why}")


def _array(kind, device, source, dtype, shape, strides, offset, cache, key, nbytes, inline):
    torch = sys.modules.get("torch")
    if kind is None:  # a bare tensor: torch if imported, else numpy on cpu
        if torch is None and "numpy" not in sys.modules:
            raise TypeError("loads: the frame holds tensors; import torch (or numpy, for cpu ones) first")
        kind = "torch.Tensor" if torch is not None else "numpy.ndarray"
    if kind == "torch.Tensor" and torch is None:
        raise TypeError("loads: the frame holds torch tensors; import torch first")
    if kind == "cupy.ndarray" and "cupy" not in sys.modules:
        raise TypeError("loads: the frame holds cupy arrays; import cupy first")
    if kind not in ("torch.Tensor", "numpy.ndarray", "cupy.ndarray"):
        raise TypeError(f"loads: unknown array kind {kind}")
    flat = _flat(kind, device, source, cache, key, nbytes, inline)
    if kind == "torch.Tensor":
        if dtype not in _TORCH_DTYPES or not hasattr(torch, dtype):
            raise _cannot(kind, device, key, f"dtype {dtype} has no torch equivalent here")
        dt = getattr(torch, dtype)
        if any(s < 0 for s in strides):
            # torch makes no such view; and below -2**62 its argument parser
            # takes a stride for a symbolic int, a TypeError naming no buffer
            raise _cannot(kind, device, key, f"negative strides {list(strides)}: torch makes no view with them")
        # the whole items only: a storage may end in part of one (a packed
        # 10-byte buffer under an int32 view of its first 8), which torch's
        # view() refuses to reinterpret, as numpy's does (below)
        itemsize = _ITEMSIZE[dtype]
        n = flat.shape[0]  # flat: 1-d (len() of a tensor is Python code in torch)
        typed = (flat[:n - n % itemsize] if n % itemsize else flat).view(dt)
        # as_strided counts the offset from the storage's start: a buffer
        # given as a view of a larger tensor starts further in
        return torch.as_strided(typed, shape, strides, offset + typed.storage_offset())
    if kind == "numpy.ndarray":
        np = _numpy()
        dt = _dtype(np, kind, device, key, dtype)
        byte_strides = _byte_strides(kind, device, key, strides, dt.itemsize)
        # an empty view addresses nothing: the format lets its offset lie
        # past the buffer's end, where numpy's bounds check would refuse it
        at = 0 if 0 in shape else offset * dt.itemsize
        try:
            # the flat array as its base (as_strided's base is a wrapper that
            # is no array): dumps of the loaded views finds them on one buffer
            return np.ndarray(shape, dt, buffer=flat, offset=at, strides=byte_strides)
        except ValueError as e:  # a shape numpy cannot hold ("array is too big"), empty or not
            raise _cannot(kind, device, key, e) from e
    cupy = sys.modules["cupy"]
    dt = _dtype(cupy, kind, device, key, dtype)
    return cupy.ndarray(shape, dt, memptr=flat.data + offset * dt.itemsize,
                        strides=_byte_strides(kind, device, key, strides, dt.itemsize))


def _byte_strides(kind, device, key, strides, itemsize):
    """numpy's (cupy's) strides, in bytes: a frame's, in items, may not fit
    their int64 (a size-1 or empty dimension's stride addresses nothing, so
    the format bounds it only by int64 items)."""
    out = [s * itemsize for s in strides]
    if any(not -(1 << 63) <= s < 1 << 63 for s in out):
        raise _cannot(kind, device, key, f"strides {list(strides)} of {itemsize}-byte items are past "
                      f"{kind.split('.')[0]}'s int64 bytes")
    return out


def _dtype(xp, kind, device, key, dtype):
    """numpy's (or cupy's) dtype for a frame's dtype name; one it lacks
    (bfloat16) is refused naming the buffer, as torch's are."""
    try:
        return xp.dtype(dtype)
    except TypeError as e:
        raise _cannot(kind, device, key, f"dtype {dtype} has no {xp.__name__} equivalent here") from e
