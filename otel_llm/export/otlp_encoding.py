"""What OTLP's signals share in otel_llm's own encoding (:mod:`otel_llm.export.span_encoding`,
:mod:`otel_llm.export.metric_encoding`): protobuf fields written as bytes, the resource, scope and
attribute messages with their encodings kept, and the install of an encoder into an SDK exporter
module for the exports of otel_llm's exporters only."""

from __future__ import annotations

import contextvars
import importlib
import logging
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

_log = logging.getLogger(__name__)

PACK_FIXED64 = struct.Struct("<Q").pack
PACK_DOUBLE = struct.Struct("<d").pack

_CACHED_VALUES = 4096  # encodings kept per cache; cleared when full

_SMALL = [bytes((i,)) for i in range(128)]


def varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def string(number: int, value: Optional[str]) -> bytes:
    """A proto3 string field: absent when empty."""
    return field(number, value.encode()) if value else b""


def uint(number: int, value: int) -> bytes:
    """A proto3 varint field: absent when zero."""
    return varint(number << 3) + varint(value) if value else b""


def _any_value(value: Any) -> bytes:
    """An AnyValue message (the exporters' rules: None is an empty value)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return field(1, value.encode())
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + PACK_DOUBLE(value)
    if isinstance(value, bytes):
        return field(7, value)
    if isinstance(value, Sequence):
        return field(5, b"".join(field(1, _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        return field(6, b"".join(field(1, _key_value(str(k), v)) for k, v in value.items()))
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    return string(1, key) + field(2, _any_value(value))


def keep(cache: dict[Any, bytes], key: Any, encoded: bytes) -> bytes:
    """``encoded`` kept in ``cache`` under ``key`` (the cache cleared when full); returned."""
    if len(cache) >= _CACHED_VALUES:
        cache.clear()
    cache[key] = encoded
    return encoded


class OtlpEncoder:
    """What OTLP's signals share: resources, scopes and attributes, their encodings kept."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, str, type, Any], bytes] = {}
        self._resources: dict[int, tuple[Any, bytes]] = {}
        self._scopes: dict[int, tuple[Any, bytes]] = {}

    def attributes(self, number: int, attributes: Optional[Mapping[str, Any]]) -> bytes:
        """The repeated KeyValue field ``number``. Strings, ints and bools are kept by value (a
        float rarely repeats: a latency); a float's key is kept."""
        if not attributes:
            return b""
        values = self._values
        out = []
        for key, value in attributes.items():
            kind = type(value)
            if kind is float:
                prefix = values.get((number, key, kind, None))
                if prefix is None:
                    key_part = string(1, key)
                    prefix = varint(number << 3 | 2) + varint(len(key_part) + 11) + key_part + b"\x12\x09\x21"
                    keep(values, (number, key, kind, None), prefix)
                out.append(prefix + PACK_DOUBLE(value))
                continue
            if kind is tuple and len(value) == 1 and type(value[0]) is str:
                ident: Optional[tuple] = (number, key, kind, value)  # a finish reason: one of a few
            elif kind is str or kind is int or kind is bool:
                ident = (number, key, kind, value)
            else:
                ident = None
            encoded = values.get(ident) if ident is not None else None
            if encoded is None:
                encoded = field(number, _key_value(key, value))
                if ident is not None:
                    keep(values, ident, encoded)
            out.append(encoded)
        return b"".join(out)

    def resource(self, resource: Any) -> bytes:
        kept = self._resources.get(id(resource))
        if kept is None or kept[0] is not resource:
            kept = self._resources[id(resource)] = (resource, field(1, self.attributes(1, resource.attributes)))
        return kept[1]

    def scope(self, scope: Any) -> bytes:
        kept = self._scopes.get(id(scope))
        if kept is None or kept[0] is not scope:
            if scope is None:
                encoded = field(1, b"")
            else:
                encoded = field(
                    1,
                    string(1, scope.name) + string(2, scope.version) + self.attributes(3, scope.attributes),
                )
            kept = self._scopes[id(scope)] = (scope, encoded)
        return kept[1]


class Serialized:
    """What the HTTP exporters ask of the message that their module's encoding function returns:
    its bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data

    SerializePartialToString = SerializeToString


_installed: dict[str, bool] = {}  # by module, of every signal: whether its encoding function is ours
_install_lock = threading.Lock()


def install_encoder(
    module_name: str,
    function: str,
    active: "contextvars.ContextVar[Any]",
    wrap_for: Callable[[Any], Callable[[Any], Any]],
    signal: str,
) -> bool:
    """``module_name``'s ``function`` (an exporter module's ``encode_spans`` or ``encode_metrics``)
    made to use the encoder that ``active`` holds in the exporting context, its result handed to
    the exporter as ``wrap_for(module)`` makes it (called once, at the install); the SDK's
    encoding where none is active or the encoder fails. False where the module has no such
    function (an SDK whose exporter encodes otherwise: its own encoding is used)."""
    with _install_lock:
        if module_name in _installed:
            return _installed[module_name]
        module = importlib.import_module(module_name)
        original = getattr(module, function, None)
        if not callable(original):
            _installed[module_name] = False
            return False
        wrap = wrap_for(module)

        def encode(batch: Any) -> Any:
            encoder = active.get()
            if encoder is None:
                return original(batch)
            try:
                return wrap(encoder.encode(batch))
            except Exception:  # noqa: BLE001 - the SDK's encoding, which reports what it cannot encode
                _log.warning("otel_llm: %s encoding failed; the SDK's encoder is used", signal, exc_info=True)
                return original(batch)

        setattr(module, function, encode)
        _installed[module_name] = True
        return True
