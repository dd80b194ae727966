"""A device's answer to an analytics query (docs/protocol.md, "Analytics answers"), computed from
its local records by the declared query and laid out in the query's fixed shape, byte for byte as
the Rust device library writes it (tests/vectors/analytics_answers.json).

`parse_query` reads the task policy's `analytics=` line; `answer` builds the plaintext a device
seals in place of a training update."""

from __future__ import annotations

import math
import operator
import random as _random
import re

import numpy as np
from safetensors.numpy import save

from .policy import PolicyError, _float, _u32, rust_e

PRESENT_TENSOR = "confed.present"
KEYS_TENSOR = "confed.keys"
VALUES_TENSOR = "confed.values"
HEALTH_TENSOR = "confed.health"

MAX_DOMAIN_SIZE = 1 << 22
MAX_KEYS_PER_DEVICE = 64
MAX_KEY_BYTES = 64
MAX_VALUE = 1 << 20
MAX_RANKS = 16
MAX_QUANTILE_BOUND = 1e15
#: Leaves of the quantile tree: 16^4.
QUANTILE_LEAVES = 16 ** 4

_FIELDS = {
    "histogram": ("domain_size", "keys_per_device", "max_value"),
    "open_histogram": ("max_key_bytes", "keys_per_device"),
    "quantiles": ("min", "max", "ranks", "values_per_device"),
}


def parse_query(value: str) -> dict:
    """The value of an `analytics=` line as the task definition's JSON object, checked: fields in
    order, canonical numbers, within the caps (`PolicyError` otherwise)."""
    kind, *parts = value.split(";")
    if kind not in _FIELDS:
        raise PolicyError(f"analytics names an unknown query {kind!r}")
    names = _FIELDS[kind]
    if len(parts) != len(names):
        raise PolicyError(f"analytics={kind} needs exactly {', '.join(names)}")
    query: dict = {"query": kind}
    for name, part in zip(names, parts):
        key, sep, text = part.partition("=")
        if key != name or not sep:
            raise PolicyError(f"analytics={kind}: expected {name}= at {part!r}")
        if name in ("min", "max"):
            query[name] = _float(text, name)
        elif name == "ranks":
            query[name] = [_float(r, "ranks") for r in text.split(",")]
        elif name == "max_value":
            if not re.fullmatch(r"0|[1-9][0-9]*", text):
                raise PolicyError(f"max_value={text!r} is not a decimal integer")
            query[name] = int(text)
        else:
            query[name] = _u32(text, name)
    _check_caps(query)
    return query


def _check_caps(query: dict) -> None:
    bad = PolicyError(f"analytics query outside the caps: {query}")
    per_device = query.get("keys_per_device", query.get("values_per_device"))
    if not 1 <= per_device <= MAX_KEYS_PER_DEVICE:
        raise bad
    kind = query["query"]
    if kind == "histogram" and not (1 <= query["domain_size"] <= MAX_DOMAIN_SIZE
                                    and 1 <= query["max_value"] <= MAX_VALUE):
        raise bad
    if kind == "open_histogram" and not 1 <= query["max_key_bytes"] <= MAX_KEY_BYTES:
        raise bad
    if kind == "quantiles":
        low, high, ranks = query["min"], query["max"], query["ranks"]
        if not (abs(low) <= MAX_QUANTILE_BOUND and abs(high) <= MAX_QUANTILE_BOUND and low < high
                and 1 <= len(ranks) <= MAX_RANKS and all(0 < r < 1 for r in ranks)
                and all(a < b for a, b in zip(ranks, ranks[1:]))):
            raise bad


def encode_query(query: dict) -> str:
    """The `analytics=` line's value of a query (the inverse of `parse_query`)."""
    kind = query["query"]
    values = []
    for name in _FIELDS[kind]:
        value = query.get(name, 1 if name == "max_value" else None)
        if name in ("min", "max"):
            value = rust_e(float(value))
        elif name == "ranks":
            value = ",".join(rust_e(float(r)) for r in value)
        values.append(f"{name}={value}")
    return ";".join([kind, *values])


def quantile_leaf(low: float, high: float, value: float) -> int | None:
    """The leaf of the quantile tree `value` falls in (clamped to the ends; None for NaN)."""
    if math.isnan(value):
        return None
    position = min(max((value - low) / (high - low), 0.0), 1.0)
    return min(math.floor(position * QUANTILE_LEAVES), QUANTILE_LEAVES - 1)


def _cut(text: str, limit: int) -> bytes:
    """The longest prefix of `text`'s UTF-8 of at most `limit` bytes ending at a character."""
    data = text.encode("utf-8")
    end = min(limit, len(data))
    while end > 0 and end < len(data) and (data[end] & 0xC0) == 0x80:
        end -= 1
    return data[:end]


def answer(query: dict, records, *, rng: _random.Random | None = None) -> bytes:
    """The answer's plaintext for a device's `records`: `[(key_index, value), ...]` for a
    histogram, strings for an open histogram, numbers for quantiles. A device with more keys
    (values) than the bound sends a uniformly random choice of them (`rng`, default the OS's)."""
    rng = rng or _random.SystemRandom()
    kind = query["query"]
    bound = query.get("keys_per_device", query.get("values_per_device"))
    if kind == "histogram":
        totals: dict[int, int] = {}
        for key, value in records:
            # Keys are integers (2.5 is refused, never rounded onto another key's index).
            key = operator.index(key)
            if 0 <= key < query["domain_size"]:
                totals[key] = totals.get(key, 0) + operator.index(value)
        cap = query.get("max_value", 1)
        chosen = _choose(sorted(totals), bound, rng)
        # A total is sent within [0, max_value] (a negative one as 0), as the Rust library does.
        slots = sorted((key, 1 if cap == 1 else max(0, min(totals[key], cap)))
                       for key in chosen)
    elif kind == "open_histogram":
        distinct = sorted({cut for cut in (_cut(str(r), query["max_key_bytes"]) for r in records)
                           if cut and b"\0" not in cut})
        slots = sorted((key, 1) for key in _choose(distinct, bound, rng))
    elif kind == "quantiles":
        leaves = [leaf for leaf in (quantile_leaf(query["min"], query["max"], float(v))
                                    for v in records) if leaf is not None]
        slots = sorted((leaf, 1) for leaf in _choose(leaves, bound, rng))
    else:
        raise ValueError(f"unknown query {kind!r}")
    return write(query, slots, failed=False)


def failed_answer(query: dict) -> bytes:
    """The answer of a device whose computation failed: no keys, the health flag set."""
    return write(query, [], failed=True)


def _choose(items: list, count: int, rng: _random.Random) -> list:
    return list(items) if len(items) <= count else rng.sample(items, count)


def write(query: dict, slots: list, *, failed: bool) -> bytes:
    """Lays out present slots (sorted `(key, value)`) and padding in the query's fixed shape."""
    bound = query.get("keys_per_device", query.get("values_per_device"))
    present = np.zeros(bound, dtype=np.uint8)
    values = np.zeros(bound, dtype=np.int64)
    width = query.get("max_key_bytes") if query["query"] == "open_histogram" else None
    keys = (np.zeros((bound, width), dtype=np.uint8) if width
            else np.zeros(bound, dtype=np.int64))
    for i, (key, value) in enumerate(slots):
        present[i] = 1
        values[i] = value
        if width:
            keys[i, :len(key)] = np.frombuffer(key, dtype=np.uint8)
        else:
            keys[i] = key
    health = np.array([1.0 if failed else 0.0], dtype=np.float32)
    return save({PRESENT_TENSOR: present, KEYS_TENSOR: keys, VALUES_TENSOR: values,
                 HEALTH_TENSOR: health})
