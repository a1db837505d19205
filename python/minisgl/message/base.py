"""msgpack (de)serialisation of registered dataclasses.

A registered dataclass travels as a msgpack extension value holding [type name, *field values];
field values are packed recursively, so messages nest (lists of messages, SamplingParams inside
a message) and plain dicts stay plain dicts with no reserved keys."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgpack

from minisgl.core import SamplingParams

T = TypeVar("T")

_EXT_DATACLASS = 1
_BY_NAME: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}


def register(cls: type[T]) -> type[T]:
    """Class decorator (apply above @dataclass): make `cls` encodable by its class name."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass")
    fields = dataclasses.fields(cls)
    # Decoding rebuilds the object with cls(*values), so every field must be an init argument.
    if any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__}: fields with init=False cannot be (de)serialised")
    prev = _BY_NAME.get(cls.__name__)
    if prev is not None and prev is not cls:
        raise ValueError(f"message type name {cls.__name__!r} is already registered")
    _BY_NAME[cls.__name__] = cls
    _FIELDS[cls] = tuple(f.name for f in fields)
    return cls


def _default(obj: Any) -> msgpack.ExtType:
    names = _FIELDS.get(type(obj))
    if names is None:
        raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message type")
    values = [type(obj).__name__, *(getattr(obj, n) for n in names)]
    return msgpack.ExtType(_EXT_DATACLASS, msgpack.packb(values, default=_default))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_DATACLASS:
        return msgpack.ExtType(code, data)
    name, *values = _unpack(data)
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls(*values)


def _unpack(data: bytes) -> Any:
    # strict_map_key=False: dicts with int keys are allowed (e.g. token id -> logprob maps).
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(msg: Any) -> bytes:
    """Serialise a registered dataclass (or any msgpack value containing them).
    Tuples come back as lists."""
    return msgpack.packb(msg, default=_default)


def decode(data: bytes) -> Any:
    """Inverse of `encode`; ValueError for any payload it did not make (not msgpack, an
    unregistered type, a type given the wrong fields), which the receiver logs and drops."""
    try:
        return _unpack(data)
    except ValueError:  # msgpack's errors are ValueErrors too
        raise
    except Exception as e:  # e.g. TypeError from cls(*values), RecursionError
        raise ValueError(f"malformed message: {type(e).__name__}: {e}") from e


# Shared types that travel inside messages.
register(SamplingParams)
