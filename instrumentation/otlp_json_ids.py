"""OTLP/JSON's ids: hex strings, where protobuf's canonical JSON mapping (``json_format``)
writes and expects base64. One walker converts them in place, in either direction, for
the capture files (instrumentation/capture.py) and the collector's OTLP/HTTP JSON
receiver (collector/otlp_http.py); each side passes its own conversion (the receiver's
refuses with its protocol error, the capture reader also accepts base64).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

__all__ = ["ID_KEYS", "base64_to_hex", "convert_ids"]

# Both key spellings: json_format accepts snake_case field names as well as camelCase.
ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})


def convert_ids(node: Any, convert: Callable[[str, str], str]) -> Any:
    """Replaces every id string under ``node`` (dicts and lists, in place) with
    ``convert(key, value)``; returns ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ID_KEYS and isinstance(value, str):
                node[key] = convert(key, value)
            elif isinstance(value, (dict, list)):
                convert_ids(value, convert)
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, (dict, list)):
                convert_ids(item, convert)
    return node


def base64_to_hex(key: str, value: str) -> str:
    """json_format's base64 id -> OTLP/JSON hex."""
    return binascii.hexlify(base64.b64decode(value)).decode("ascii")
