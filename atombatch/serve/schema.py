"""Decoding request bodies the way OpenAI and vLLM clients write them.

Clients written for the OpenAI API or for vLLM send more than this server reads: fields of newer
API versions (`store`, `metadata`, `service_tier`, ...), vLLM extensions, and explicit `null` for
any optional field. A body is decoded in two passes:

1. `msgspec.json.decode` into plain Python values (a syntax error is `invalid_json`);
2. a walk over those values along the request Struct's type tree, which
   - collects every field the Struct does not declare (at any depth, e.g. `messages[0].mood`) and
     removes it: the caller ignores it (and says so) or, in strict mode, rejects it;
   - removes a `null` given for an optional field whose type does not admit None, so the field
     takes its default ("null means unset", as in the OpenAI API);
3. `msgspec.convert` into the Struct, whose validation errors become `SchemaError`s naming the
   offending field with an OpenAI error code (`invalid_type`, `missing_required_parameter`,
   `invalid_value`).

The walk follows the Structs themselves, so a field added to a request Struct is known here
without any list to keep in step.
"""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from atombatch.errors import ConfigError
from atombatch.serve import unhonoured

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"`([^`]*)`")


class SchemaError(ValueError):
    """A body that does not match the request schema (answered with 400)."""

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class Bounds(msgspec.Struct, frozen=True):
    """What decoding one body may cost, whatever the client sends (issue 18).

    The untyped pass is msgspec's C decoder (linear in the body, which `max_body_bytes` bounds);
    the walk below is Python, so it visits only what can hold an object (a list of token ids is
    never iterated here) and stops at `max_objects`. Free-form values (`tools`, `documents`,
    `chat_template_kwargs`, ...) go to a Jinja template that recurses through them, so their
    nesting stops at `max_depth`.
    """

    max_depth: int = 32          # nesting of any value; deeper -> 400 `nesting_too_deep`
    max_objects: int = 16_384    # JSON objects and arrays walked in Python -> 400 `too_many_objects`
    max_unknown: int = 64        # unknown field names kept (and reported) per body
    max_name_chars: int = 64     # an unknown name is reported at most this long, escaped

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an int >= 1")


DEFAULT_BOUNDS = Bounds()


def decode(body: bytes, kind: type[T], *, strict: bool = False,
           bounds: Bounds = DEFAULT_BOUNDS) -> tuple[T, list[str], int]:
    """Decode a JSON request body into `kind`; returns it, the unknown fields that were dropped
    (sanitized: printable ASCII, clipped; the first `bounds.max_unknown` of them) and how many
    there were.

    Raises:
        msgspec.DecodeError: the body is not JSON.
        SchemaError: the body does not match `kind`, breaks a bound, or (strict) has an unknown
            field.
    """
    try:
        raw = msgspec.json.decode(body)
    except RecursionError:
        raise _too_deep(bounds) from None
    except msgspec.DecodeError:
        # Valid JSON the untyped pass cannot hold (a number out of range) may still be a schema
        # error the typed decoder places, e.g. `temperature: 1e999`.
        try:
            msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            raise _schema_error(str(exc)) from None
        except RecursionError:
            raise _too_deep(bounds) from None
        raise
    info = _type_info(kind)  # type: ignore[arg-type]
    if isinstance(raw, dict) and isinstance(info, mi.StructType):
        refusal = unhonoured.refused(raw, {f.encode_name for f in info.fields})
        if refusal is not None:  # changes the result and is not served: never silently dropped
            name, what = refusal
            raise SchemaError(f"{name}: {what} is not supported by this server, so "
                              f"{name}={_clip(raw[name])} cannot be honoured "
                              "(docs/server.md lists the fields served)",
                              param=name, code="unsupported_value")
    walk = _Walk(bounds)
    walk.value(raw, info, None, 0)
    if strict and walk.unknown:
        raise SchemaError(f"unknown field `{walk.unknown[0]}` (the server runs with "
                          "--strict-protocol)", param=walk.unknown[0], code="unknown_parameter")
    try:
        return msgspec.convert(raw, kind), walk.unknown, walk.dropped
    except msgspec.ValidationError as exc:
        raise _schema_error(str(exc)) from None


def _too_deep(bounds: Bounds) -> SchemaError:
    return SchemaError(f"the body nests deeper than max_depth={bounds.max_depth}", param=None,
                       code="nesting_too_deep")


@functools.cache
def _type_info(kind: type) -> mi.Type:
    return mi.type_info(kind)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _admits_none(t: mi.Type) -> bool:
    if isinstance(t, mi.NoneType | mi.AnyType):
        return True
    return isinstance(t, mi.UnionType) and any(_admits_none(m) for m in t.types)


_LISTS = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)


_NEEDS_WALK: dict[int, bool] = {}  # by id: the types live as long as `_type_info`'s cache


def _needs_walk(t: mi.Type) -> bool:
    """Whether a value of type `t` can hold an object to check (a Struct or a free-form value);
    `list[int]`, `str` and the like are left to msgspec's C validation."""
    known = _NEEDS_WALK.get(id(t))
    if known is None:
        if isinstance(t, mi.StructType | mi.AnyType):
            known = True
        elif isinstance(t, mi.UnionType):
            known = any(_needs_walk(m) for m in t.types)
        elif isinstance(t, _LISTS):
            known = _needs_walk(t.item_type)
        elif isinstance(t, mi.DictType):
            known = _needs_walk(t.value_type)
        else:
            known = False
        _NEEDS_WALK[id(t)] = known
    return known


# A path is built only when an unknown field is found: (parent, key) links, key a name or index.
_Path = tuple[Any, "str | int"] | None


def _render(path: _Path, limit: int) -> str:
    parts: list[str | int] = []
    while path is not None:
        path, key = path
        parts.append(key)
    out = ""
    for key in reversed(parts):
        out = f"{out}[{key}]" if isinstance(key, int) else _join(out, _printable(key, limit))
    return out


def _printable(name: str, limit: int) -> str:
    """A client's field name as it may appear in a header or a log line: printable ASCII."""
    clipped = name[:limit]
    text = clipped if clipped.isascii() and clipped.isprintable() else \
        clipped.encode("ascii", "backslashreplace").decode().replace("`", "'")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(name) <= limit else f"{text}...({len(name)} chars)"


class _Walk:
    """Drops unknown fields (recorded) and nulls of optional fields, in place, within bounds."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.unknown: list[str] = []
        self.dropped = 0
        self.objects = 0

    def count(self) -> None:
        self.objects += 1
        if self.objects > self.bounds.max_objects:
            raise SchemaError(f"the body holds more than max_objects={self.bounds.max_objects} "
                              "JSON objects and arrays to check", param=None,
                              code="too_many_objects")

    def value(self, value: Any, t: mi.Type, path: _Path, depth: int) -> None:
        if not isinstance(value, dict | list):
            return
        if depth >= self.bounds.max_depth:
            raise _too_deep(self.bounds)
        if isinstance(t, mi.UnionType):
            t = _member_for(value, t)
        if isinstance(t, mi.AnyType | mi.UnionType):
            self.free(value, depth)
        elif isinstance(t, mi.StructType) and isinstance(value, dict):
            self.count()
            fields = {f.encode_name: f for f in t.fields}
            for key in list(value):
                field = fields.get(key)
                if field is None:
                    self.drop((path, str(key)))
                    del value[key]
                elif value[key] is None and not field.required and not _admits_none(field.type):
                    del value[key]
                elif _needs_walk(field.type):
                    self.value(value[key], field.type, (path, key), depth + 1)
        elif isinstance(t, _LISTS) and isinstance(value, list):
            if _needs_walk(t.item_type):
                self.count()
                for i, item in enumerate(value):
                    self.value(item, t.item_type, (path, i), depth + 1)
        elif isinstance(t, mi.DictType) and isinstance(value, dict) and _needs_walk(t.value_type):
            self.count()
            for key, item in value.items():
                self.value(item, t.value_type, (path, str(key)), depth + 1)

    def free(self, value: dict[str, Any] | list[Any], depth: int) -> None:
        """A free-form value: only its nesting and its number of containers are bounded."""
        stack = [(value, depth)]
        while stack:
            item, level = stack.pop()
            if level >= self.bounds.max_depth:
                raise _too_deep(self.bounds)
            self.count()
            for child in item.values() if isinstance(item, dict) else item:
                if isinstance(child, dict | list):
                    stack.append((child, level + 1))

    def drop(self, path: _Path) -> None:
        self.dropped += 1
        if len(self.unknown) < self.bounds.max_unknown:
            self.unknown.append(_render(path, self.bounds.max_name_chars))


def _member_for(value: Any, union: mi.UnionType) -> mi.Type:
    """The member of a union that a JSON object or array would be decoded as (else the union)."""
    wanted: tuple[type, ...]
    if isinstance(value, dict):
        wanted = (mi.StructType, mi.DictType, mi.TypedDictType, mi.DataclassType)
    elif isinstance(value, list):
        wanted = (mi.ListType, mi.VarTupleType, mi.TupleType, mi.SetType, mi.FrozenSetType)
    else:
        return union
    members = [m for m in union.types if isinstance(m, wanted)]
    return members[0] if len(members) == 1 else union


def _clip(value: Any, limit: int = 60) -> str:
    """A client's value quoted in an error: a scalar clipped, a list or object only named (its
    repr could be as large and as deep as the body)."""
    if isinstance(value, list | dict):
        return f"<a JSON {'array' if isinstance(value, list) else 'object'}>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _schema_error(message: str) -> SchemaError:
    """A msgspec validation message as a SchemaError naming the field (`messages[0].role`)."""
    match = _PATH.search(message)
    path = match.group(1) if match else ""
    text = message[:match.start()] if match else message
    code = "invalid_type" if text.startswith("Expected `") else "invalid_value"
    if text.startswith("Object missing required field"):
        field = _FIELD.search(text)
        if field:
            path = _join(path, field.group(1))
        code = "missing_required_parameter"
    param = path or None
    if text.startswith("Expected `object`") and not path:
        text = "the body must be a JSON object"
    return SchemaError(f"{param}: {text}" if param else text, param=param, code=code)
