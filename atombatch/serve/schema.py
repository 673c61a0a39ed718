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


def decode(body: bytes, kind: type[T], *, strict: bool = False) -> tuple[T, list[str]]:
    """Decode a JSON request body into `kind`; returns it and the unknown fields that were dropped.

    Raises:
        msgspec.DecodeError: the body is not JSON.
        SchemaError: the body does not match `kind`, or (strict) it has an unknown field.
    """
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError:
        # Valid JSON the untyped pass cannot hold (a number out of range) may still be a schema
        # error the typed decoder places, e.g. `temperature: 1e999`.
        try:
            msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            raise _schema_error(str(exc)) from None
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
    unknown: list[str] = []
    _walk(raw, info, "", unknown)
    if strict and unknown:
        raise SchemaError(f"unknown field `{unknown[0]}` (the server runs with --strict-protocol)",
                          param=unknown[0], code="unknown_parameter")
    try:
        return msgspec.convert(raw, kind), unknown
    except msgspec.ValidationError as exc:
        raise _schema_error(str(exc)) from None


@functools.cache
def _type_info(kind: type) -> mi.Type:
    return mi.type_info(kind)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _admits_none(t: mi.Type) -> bool:
    if isinstance(t, mi.NoneType | mi.AnyType):
        return True
    return isinstance(t, mi.UnionType) and any(_admits_none(m) for m in t.types)


def _walk(value: Any, t: mi.Type, path: str, unknown: list[str]) -> None:
    """Drop unknown fields (recorded in `unknown`) and nulls of optional fields, in place."""
    if isinstance(t, mi.UnionType):
        t = _member_for(value, t)
    if isinstance(t, mi.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f for f in t.fields}
        for key in list(value):
            field = fields.get(key)
            if field is None:
                unknown.append(_join(path, str(key)))
                del value[key]
            elif value[key] is None and not field.required and not _admits_none(field.type):
                del value[key]
            else:
                _walk(value[key], field.type, _join(path, key), unknown)
    elif isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType) \
            and isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, t.item_type, f"{path}[{i}]", unknown)
    elif isinstance(t, mi.DictType) and isinstance(value, dict):
        for key, item in value.items():
            _walk(item, t.value_type, _join(path, str(key)), unknown)


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
