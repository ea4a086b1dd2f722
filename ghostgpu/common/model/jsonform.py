"""The JSON form of the model's dataclasses, derived from their fields: a field is written once.

A dataclass that subclasses `JsonForm` gets `to_json()` and `from_json()`. Its JSON object has one
key per field, in field order, named as the field; the field's type says how its value is written:

    str, int, float, bool, None      as they are
    a StrEnum                        its value ("hidden")
    list[X], tuple[X, ...]           a list (a copy), each item written by its own type
    dict[str, str]                   a dict (a copy)
    a JsonForm dataclass             its JSON object
    X | None                         null, or X written by its type

A ClassVar with a value (a record's `event` kind) is written first, as a constant. What the JSON
contract says otherwise is said on the field, with `field(metadata=json_meta(...))`: another key
(`class` for `cls`), written last, left out while it holds its default, flattened into its
parent's keys, a 0 written as null, a codec (an ioctl request in hex), and constant or derived
keys written right after it.

`from_json()` is the inverse: a missing key takes the field's default, a missing key of a field
without one raises ValueError naming it, keys it does not know (a record's `event`, `ts` read as a
consumer) are ignored.

to_json() sits on the JSON sinks' path (every record `ghostgpu tracer --jsonl` writes), so, like
dataclasses' own __init__, it is generated once per class, on its first call: a dict literal and
a few ifs, what a hand-written one costs.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import Any, ClassVar, Self

JsonObject = dict[str, Any]
_NO_NULL = object()  # json_meta(null=...) not given: no value is written as null but None


@dataclass(frozen=True, slots=True)
class Codec:
    """A value written in another form than its type's: `to_json` writes it, `from_json` reads it."""

    to_json: Callable[[Any], Any]
    from_json: Callable[[Any], Any]


def _int_from_hex(value: str | int) -> int:
    return int(value, 16) if isinstance(value, str) else value


HEX = Codec(lambda v: f"{v:#x}", _int_from_hex)  # an int written as "0xc020462a"; a plain int reads too


@dataclass(frozen=True, slots=True)
class JsonMeta:
    """How one field's JSON departs from the plain rule (json_meta() puts it in the field's metadata)."""

    key: str | None = None  # the JSON key, when it is not the field's name
    last: bool = False  # written after the other fields (in field order among the last ones)
    omit_default: bool = False  # left out while the field holds its default
    flatten: bool = False  # a JsonForm value's keys written into its parent's object
    absent: Mapping[str, Any] | None = None  # flatten: what a None value writes (else nothing)
    null: Any = _NO_NULL  # a value written as null (and read back from null), e.g. 0 for "not yet"
    codec: Codec | None = None
    # Keys written right after this one: a constant, or a function of the object (a property's getter).
    then: Mapping[str, Any] | None = None


def json_meta(*, key: str | None = None, last: bool = False, omit_default: bool = False,
              flatten: bool = False, absent: Mapping[str, Any] | None = None, null: Any = _NO_NULL,
              codec: Codec | None = None, then: Mapping[str, Any] | None = None) -> dict[str, JsonMeta]:
    """A field's `metadata=`: how its JSON differs from the plain rule (see the module docstring)."""
    return {"json": JsonMeta(key, last, omit_default, flatten, absent, null, codec, then)}


class JsonForm:
    """A dataclass's JSON object, derived from its fields (see the module docstring)."""

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "to_json" not in vars(cls):
            # Not a parent's generated one, which writes only the parent's fields: this class's own,
            # generated on its first call.
            setattr(cls, "to_json", JsonForm.to_json)  # noqa: B010 (mypy refuses to assign to a method)

    def to_json(self) -> JsonObject:
        # The first call for a class generates its to_json and installs it on the class, so every
        # later call is the generated function itself.
        generated = _to_json_of(type(self))
        setattr(type(self), "to_json", generated)  # noqa: B010 (mypy refuses to assign to a method)
        result: JsonObject = generated(self)
        return result

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Self:
        """The inverse of to_json(). Raises ValueError naming a missing key or a value it cannot read."""
        values = {slot.name: slot.read(d) for slot in _slots(cls) if slot.name is not None}
        return cls(**{k: v for k, v in values.items() if v is not _DEFAULT})


# --- the plan: one slot per field, from the field, its type and its metadata ---------------------------

_DEFAULT = object()  # a missing key: the dataclass applies the field's default


class _Shape:
    """How a value of one type is written and read."""

    def __init__(self, hint: Any) -> None:
        self.optional = False
        args = typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
            others = [a for a in args if a is not type(None)]
            if len(others) != 1:
                raise TypeError(f"{hint}: one type or None, please")
            self.optional, hint = True, others[0]
        origin = typing.get_origin(hint) or hint
        self.hint = hint
        self.kind = "plain"
        self.item: _Shape | None = None
        if isinstance(origin, type) and issubclass(origin, enum.Enum):
            self.kind = "enum"
        elif isinstance(origin, type) and issubclass(origin, JsonForm):
            self.kind = "form"
        elif origin in (list, tuple):
            self.kind = origin.__name__
            self.item = _Shape(typing.get_args(hint)[0])
        elif origin is dict:
            self.kind = "dict"

    def expr(self, src: str) -> str:
        """Python source writing the value `src` (a simple expression) as JSON."""
        if self.kind == "enum":
            out = f"str({src})"
        elif self.kind == "form":
            out = f"{src}.to_json()"
        elif self.kind in ("list", "tuple"):
            assert self.item is not None
            out = f"list({src})" if self.item.kind == "plain" else f"[{self.item.expr('x')} for x in {src}]"
        elif self.kind == "dict":
            out = f"dict({src})"
        else:
            return src
        return f"(None if {src} is None else {out})" if self.optional else out

    def read(self, value: Any, where: str) -> Any:
        """The value a JSON one stands for; `where` names it in an error ("Consumer JSON: ... class")."""
        if (value is None and self.optional) or self.kind == "plain":
            return value
        if self.kind == "enum":
            try:
                return self.hint(value)
            except ValueError:
                raise ValueError(f"{where} {value!r}") from None
        if self.kind == "form":
            return self.hint.from_json(value)
        if self.kind in ("list", "tuple"):
            assert self.item is not None
            items = [self.item.read(v, where) for v in value]
            return items if self.kind == "list" else tuple(items)
        return dict(value)


class _Slot:
    """One field, or one constant (a ClassVar: `name` None), of a class's JSON object."""

    def __init__(self, owner: type, key: str, name: str | None, hint: Any = None,
                 f: Field[Any] | None = None, constant: Any = None) -> None:
        meta = f.metadata.get("json", JsonMeta()) if f is not None else JsonMeta()
        self.owner, self.key, self.name, self.meta, self.constant = owner.__name__, key, name, meta, constant
        self.shape = _Shape(hint) if name is not None else None
        self.default: Any = f.default if f is not None else MISSING
        self.has_default = f is not None and (f.default is not MISSING or f.default_factory is not MISSING)
        if meta.omit_default and self.default is MISSING:
            raise TypeError(f"{owner.__name__}.{name}: omit_default needs a plain default")
        if meta.flatten and (self.shape is None or self.shape.kind != "form"):
            raise TypeError(f"{owner.__name__}.{name}: only a JsonForm field can be flattened")

    def read(self, d: Mapping[str, Any]) -> Any:
        meta, shape = self.meta, self.shape
        assert shape is not None
        where = f"{self.owner} JSON: unknown {self.key}"
        if meta.flatten:
            # A flattened value reads from its parent's keys; an optional one is there when a key
            # that its absent form does not write is.
            if shape.optional:
                own = {s.key for s in _slots(shape.hint)} - set(meta.absent or ())
                if not any(k in d for k in own):
                    return None
            return shape.hint.from_json(d)
        if self.key not in d:
            if not self.has_default:
                raise ValueError(f"{self.owner} JSON has no {self.key!r} key")
            return _DEFAULT
        value = d[self.key]
        if meta.null is not _NO_NULL and value is None:
            return meta.null
        if meta.codec is not None:
            return meta.codec.from_json(value)
        return shape.read(value, where)


_SLOTS: dict[type, tuple[_Slot, ...]] = {}


def _slots(cls: type) -> tuple[_Slot, ...]:
    """The class's JSON keys in the order they are written (worked out once per class)."""
    found = _SLOTS.get(cls)
    if found is None:
        found = _SLOTS[cls] = _plan(cls)
    return found


def _plan(cls: type) -> tuple[_Slot, ...]:
    if not is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls)
    constants = [_Slot(cls, name, None, constant=getattr(cls, name)) for name, hint in hints.items()
                 if typing.get_origin(hint) is ClassVar and hasattr(cls, name)]
    slots = [_Slot(cls, f.metadata.get("json", JsonMeta()).key or f.name, f.name, hints[f.name], f)
             for f in fields(cls)]
    return (*constants, *(s for s in slots if not s.meta.last), *(s for s in slots if s.meta.last))


_TO_JSON: dict[type, Callable[[Any], JsonObject]] = {}


def _to_json_of(cls: type) -> Callable[[Any], JsonObject]:
    """The class's generated to_json (once per class, also for a caller that holds the base's method)."""
    found = _TO_JSON.get(cls)
    if found is None:
        found = _TO_JSON[cls] = _generate_to_json(cls)
    return found


def _generate_to_json(cls: type) -> Callable[[Any], JsonObject]:
    """Source for the class's to_json, compiled: `d = {...}` while every key is written, then ifs."""
    scope: dict[str, Any] = {}
    literal: list[str] = []  # the dict literal's items, while no key has been conditional
    first = ""  # or the flattened value whose fresh JSON object d starts as
    statements: list[str] = []

    def put(key: str, expr: str) -> None:
        if statements or first:
            statements.append(f"    d[{key!r}] = {expr}")
        else:
            literal.append(f"{key!r}: {expr}")

    def ref(value: Any) -> str:
        if value is None or type(value) in (str, int, bool):
            return repr(value)
        name = f"_v{len(scope)}"
        scope[name] = value
        return name

    for slot in _slots(cls):
        meta = slot.meta
        if slot.name is None:
            put(slot.key, ref(slot.constant))
            continue
        src = f"o.{slot.name}"
        assert slot.shape is not None
        if meta.null is not _NO_NULL:
            expr = f"(None if {src} == {ref(meta.null)} else {src})"
        elif meta.codec is not None:
            expr = f"{ref(meta.codec.to_json)}({src})"
        else:
            expr = slot.shape.expr(src)
        if meta.flatten and not slot.shape.optional and not literal and not statements:
            first = f"{src}.to_json()"  # a fresh object: the record's keys go on after the value's
        elif meta.flatten:
            statements.append(f"    d.update({ref(meta.absent or {})} if {src} is None else {src}.to_json())"
                              if slot.shape.optional else f"    d.update({src}.to_json())")
        elif meta.omit_default:
            test = f"{src} is not None" if slot.default is None else f"{src} != {ref(slot.default)}"
            statements.append(f"    if {test}:\n        d[{slot.key!r}] = {expr}")
        else:
            put(slot.key, expr)
        for key, value in (meta.then or {}).items():
            put(key, f"{ref(value)}(o)" if callable(value) else ref(value))
    start = first or "{" + ", ".join(literal) + "}"
    source = "\n".join(["def to_json(o):", f"    d = {start}", *statements, "    return d"])
    exec(compile(source, f"<{cls.__qualname__}.to_json>", "exec"), scope)
    generated: Callable[[Any], JsonObject] = scope["to_json"]
    generated.__qualname__ = f"{cls.__qualname__}.to_json"
    generated.__doc__ = f"{cls.__name__}'s JSON object (generated from its fields by jsonform)."
    return generated
