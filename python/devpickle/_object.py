"""devpickle.Object: an instance of a class that loads() was not allowed to
rebuild — its class name and its attributes, nothing imported or called."""

import reprlib
import types


# the names loads never makes a class of, whatever classes= lists: the
# array forms (frames.c makes those)
_NEVER_MADE = frozenset({"torch.Tensor", "numpy.ndarray", "cupy.ndarray"})
_NEWOBJ = frozenset({"copyreg.__newobj__", "copyreg.__newobj_ex__"})


def _global_name(x):
    """The name a frame's global (a class or function held as a value)
    carries, else None."""
    if type(x) is Object and object.__getattribute__(x, "__class_name__") == "devpickle.global":
        name = object.__getattribute__(x, "__attrs__").get("name")
        return name if isinstance(name, str) else None
    return None


def _callable_name(x):
    """The module.qualname of a reduce's callable: a frame's global, or a
    function or class classes= listed (read from the object itself, never
    through a metaclass), else None."""
    name = _global_name(x)
    if name is None and isinstance(x, (types.FunctionType, types.BuiltinFunctionType, type)):
        get = type.__getattribute__ if isinstance(x, type) else object.__getattribute__
        try:
            mod, qual = get(x, "__module__"), get(x, "__qualname__")
        except AttributeError:
            return None
        if isinstance(mod, str) and isinstance(qual, str):
            name = f"{mod}.{qual}"  # as dumps names a global
    return name


def _unlisted_hint(cls, attrs):
    """What an Object's missing attribute says of classes=: the class (or,
    for a global, the object) to list where listing it would have had loads
    make it — a global; a plain object; one reduced by its class itself or
    copyreg's __newobj__ of it; an enum member (getattr, or operator.or_ of
    a Flag's, on its class) — and, for one reduced by another callable
    (pickle's factory functions), that loads never calls it; else nothing:
    an array name, a custom's state."""
    if cls == "devpickle.global":
        name = attrs.get("name")
        return f": loads returns {name} only where its classes= lists it (classes=({name}, ...))" \
            if isinstance(name, str) else ""
    if cls in _NEVER_MADE or set(attrs) == {"__reduce__"}:
        return ""
    if any(isinstance(k, str) and k.startswith("<") for k in attrs):  # reduced
        callable_ = _callable_name(attrs.get("<callable>"))
        args = attrs.get("<args>")
        args = args if type(args) is tuple else ()
        if (callable_ == "builtins.getattr" and args[:1] != () and _callable_name(args[0]) == cls
                or callable_ == "_operator.or_" and args != () and all(
                    type(a) is Object and object.__getattribute__(a, "__class_name__") == cls for a in args)):
            pass  # an enum member, or a Flag's combination of them: made once its class is listed
        elif callable_ not in (cls, f"builtins.{cls}") and callable_ not in _NEWOBJ:
            if callable_ is None:
                return ""
            return (f": loads makes a {cls} only from a reduce by the class itself (or copyreg.__newobj__ of it), "
                    f"and this one's callable is {callable_}, which loads never calls, listed or not")
    return f": loads makes a {cls} only where its classes= lists it (classes=({cls}, ...))"


class Object:
    """A class name and attributes, as they came in a frame.

    Attributes are read, set and deleted as attributes (obj.w) and as a dict
    (obj.__attrs__). Two Objects are equal when their class names and
    attributes are. obj.__class_name__ and obj.__attrs__ are the Object's
    own: setting them replaces the class name (a str) and the attributes (a
    dict made of what is given); they cannot be deleted.

    A name of Python's protocols (__x__: __array_interface__, __deepcopy__,
    __dict__, ...) is read only through __attrs__: numpy, copy, vars() and
    others look such names up on the instance, and a frame's data must not
    answer them (an __array_interface__ from the frame would have np.asarray
    make an array over whatever address the frame names).

    It holds no items and cannot be called: `in`, obj[key] (and iteration),
    obj[key] = v, del obj[key] and obj(...) raise TypeError naming the class,
    and what to list in loads' classes= where listing it would have had loads
    make it (a missing attribute raises AttributeError saying the same).
    """

    __slots__ = ("__class_name__", "__attrs__")

    def __init__(self, class_name, attrs=None):
        object.__setattr__(self, "__class_name__", str(class_name))
        object.__setattr__(self, "__attrs__", dict(attrs or {}))

    def __getattr__(self, name):
        try:
            attrs = object.__getattribute__(self, "__attrs__")
            cls = object.__getattribute__(self, "__class_name__")
        except AttributeError:  # not made yet (copy, pickle)
            raise AttributeError(name) from None
        if len(name) > 4 and name[:2] == name[-2:] == "__":  # a protocol name: never the frame's
            raise AttributeError(f"devpickle.Object of class {cls!r} answers no protocol name ({name!r}) from "
                                 "its attributes" + (": read it in __attrs__" if name in attrs else ""))
        try:
            return attrs[name]
        except KeyError:
            raise AttributeError(f"devpickle.Object of class {cls!r} has no attribute {name!r}"
                                 + _unlisted_hint(cls, attrs)) from None

    def _refused(self, what):
        """The TypeError for an operation an Object refuses, saying what to
        list where listing would help."""
        cls = object.__getattribute__(self, "__class_name__")
        return TypeError(f"a devpickle.Object of class {cls!r} {what}"
                         + _unlisted_hint(cls, object.__getattribute__(self, "__attrs__")))

    # An Object holds no items and does nothing when called (it stands for a
    # class or function loads did not make): `in`, `[]` and a call are
    # refused as Python refuses them, but saying what to list —
    # nn.Module.__getattr__ tests `name in self._parameters`, so a module
    # whose OrderedDicts were not listed fails at `in` once called; a model
    # whose activation (F.relu) was not listed, at the call. No __iter__ or
    # __len__: they would make an Object an Iterable or Sized to
    # collections.abc, and a sequence to numpy, which takes one whose len()
    # fails as a scalar; iteration goes through __getitem__ and is refused
    # there. The call makes callable(obj) true: an API that checks it first
    # (defaultdict) takes the Object, and the call it makes later says this.
    def __contains__(self, item):
        raise self._refused("holds no items to test with in")

    def __getitem__(self, key):
        raise self._refused("holds no items to subscript or iterate over")

    def __setitem__(self, key, value):
        raise self._refused("holds no items to set")

    def __delitem__(self, key):
        raise self._refused("holds no items to delete")

    def __call__(self, *args, **kwargs):
        raise self._refused("cannot be called")

    def __setattr__(self, name, value):
        if name == "__class_name__":  # its own fields: set as __init__ sets them, read back as set
            object.__setattr__(self, name, str(value))
        elif name == "__attrs__":
            object.__setattr__(self, name, dict(value))
        else:
            self.__attrs__[name] = value

    def __delattr__(self, name):
        if name in ("__class_name__", "__attrs__"):
            raise AttributeError(f"devpickle.Object's {name} cannot be deleted")
        try:
            del self.__attrs__[name]
        except KeyError:
            raise AttributeError(f"devpickle.Object of class {self.__class_name__!r} has no attribute {name!r}") from None

    # copy, deepcopy and pickle: made first, then its attributes set (a
    # cycle through its attributes comes back as one)
    def __reduce__(self):
        return (Object, (self.__class_name__,), self.__attrs__)

    def __setstate__(self, attrs):
        object.__setattr__(self, "__attrs__", dict(attrs))

    def __eq__(self, other):
        if not isinstance(other, Object):
            return NotImplemented
        return self.__class_name__ == other.__class_name__ and self.__attrs__ == other.__attrs__

    __hash__ = None

    @reprlib.recursive_repr("devpickle.Object(...)")
    def __repr__(self):
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.__attrs__.items())
        return f"devpickle.Object({self.__class_name__!r}, {attrs})" if attrs else f"devpickle.Object({self.__class_name__!r})"
