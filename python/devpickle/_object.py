"""devpickle.Object: an instance of a class that loads() was not allowed to
rebuild — its class name and its attributes, nothing imported or called."""

import reprlib


class Object:
    """A class name and attributes, as they came in a frame.

    Attributes are readable as attributes (obj.w) and as a dict
    (obj.__attrs__). Two Objects are equal when their class names and
    attributes are.
    """

    __slots__ = ("__class_name__", "__attrs__")

    def __init__(self, class_name, attrs=None):
        object.__setattr__(self, "__class_name__", str(class_name))
        object.__setattr__(self, "__attrs__", dict(attrs or {}))

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "__attrs__")[name]
        except (KeyError, AttributeError):  # AttributeError: not made yet (copy, pickle)
            raise AttributeError(
                f"devpickle.Object of class {self.__class_name__!r} has no attribute {name!r}"
            ) from None

    def __setattr__(self, name, value):
        self.__attrs__[name] = value

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
