"""Plain record classes for the runner, built without :mod:`dataclasses`.

Every sandbox starts a fresh interpreter for its runner, and that start-up lies between a
freed slot and the next item's work. Importing :mod:`dataclasses` (it pulls in ``inspect``,
``ast``, ``dis`` and ``tokenize``) and generating each class's methods took about half of
the runner's import: some 15 ms of CPU per sandbox, measured with ``python -X importtime``.
:func:`record` makes the same kind of class from its annotations with no code generation:
an ``__init__`` taking the fields in order (positionally or by name), ``__repr__``
(without the fields marked ``repr=False``: tokens), ``__eq__``, and for frozen records
(the default) ``__hash__`` and no assignment. :func:`replace` copies one with changes.
Type checkers see it as a dataclass (``dataclass_transform``).
"""

from __future__ import annotations

from collections.abc import Callable

TYPE_CHECKING = False  # not typing's: importing typing costs the start-up 2 ms more
if TYPE_CHECKING:
    from typing import Any, TypeVar, dataclass_transform

    T = TypeVar("T")
else:

    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda decorator: decorator


_MISSING: Any = object()


class FrozenRecordError(AttributeError):
    """A frozen record was assigned to."""


class _Field:
    __slots__ = ("default", "factory", "repr")

    def __init__(self, default: Any, factory: Callable[[], Any] | None, repr: bool) -> None:
        self.default, self.factory, self.repr = default, factory, repr


def field(
    *, default: Any = _MISSING, default_factory: Callable[[], Any] | None = None, repr: bool = True
) -> Any:
    """A field's default (or a factory called for each new record) and whether ``repr``
    shows it."""
    return _Field(default, default_factory, repr)


@dataclass_transform(field_specifiers=(field,))
def record(cls: Any = None, /, *, frozen: bool = True) -> Any:
    """Make ``cls`` a record of its annotated fields (see the module's docstring)."""

    def make(cls: Any) -> Any:
        fields = dict(getattr(cls, "__record_fields__", {}))
        # Not inspect.get_annotations: inspect is what this module keeps out of start-up.
        for name in cls.__dict__.get("__annotations__", {}):  # noqa: RUF063
            declared = cls.__dict__.get(name, _MISSING)
            spec = declared if isinstance(declared, _Field) else _Field(declared, None, True)
            if spec.default is _MISSING and isinstance(declared, _Field):
                delattr(cls, name)
            elif isinstance(declared, _Field):
                setattr(cls, name, spec.default)
            fields[name] = spec
        _check_order(cls, fields)
        cls.__record_fields__ = fields
        cls.__record_frozen__ = frozen
        cls.__init__ = _init(fields)
        cls.__repr__ = _repr
        cls.__eq__ = _eq
        if frozen:
            cls.__setattr__ = cls.__delattr__ = _refuse
            cls.__hash__ = _hash
        else:
            cls.__hash__ = None
        return cls

    return make if cls is None else make(cls)


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of record ``obj`` with ``changes`` (by field name)."""
    values = {name: getattr(obj, name) for name in type(obj).__record_fields__}  # type: ignore[attr-defined]
    unknown = changes.keys() - values.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {', '.join(sorted(unknown))}")
    return type(obj)(**(values | changes))


def _check_order(cls: Any, fields: dict[str, _Field]) -> None:
    seen_default = False
    for name, spec in fields.items():
        has_default = spec.default is not _MISSING or spec.factory is not None
        if seen_default and not has_default:
            raise TypeError(f"{cls.__name__}.{name}: a field without a default after one with")
        seen_default = seen_default or has_default


def _init(fields: dict[str, _Field]) -> Callable[..., None]:
    names = tuple(fields)
    specs = tuple(fields.values())

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} field(s)")
        for name in names[: len(args)]:
            if name in kwargs:
                raise TypeError(f"{type(self).__name__} got {name} twice")
        kwargs.update(zip(names, args, strict=False))
        for name, spec in zip(names, specs, strict=True):
            if name in kwargs:
                value = kwargs.pop(name)
            elif spec.factory is not None:
                value = spec.factory()
            elif spec.default is not _MISSING:
                value = spec.default
            else:
                raise TypeError(f"{type(self).__name__} missing field {name}")
            object.__setattr__(self, name, value)
        if kwargs:
            raise TypeError(f"{type(self).__name__} has no field(s) {', '.join(sorted(kwargs))}")

    return __init__


def _values(obj: Any) -> tuple[Any, ...]:
    return tuple(getattr(obj, name) for name in type(obj).__record_fields__)


def _repr(self: Any) -> str:
    shown = ", ".join(
        f"{name}={getattr(self, name)!r}"
        for name, spec in type(self).__record_fields__.items()
        if spec.repr
    )
    return f"{type(self).__qualname__}({shown})"


def _eq(self: Any, other: object) -> object:  # a bool, or NotImplemented
    if type(other) is not type(self):
        return NotImplemented
    return _values(self) == _values(other)


def _hash(self: Any) -> int:
    return hash(_values(self))


def _refuse(self: Any, name: str, *value: Any) -> None:
    raise FrozenRecordError(f"{type(self).__name__} is frozen: cannot set or delete {name}")
