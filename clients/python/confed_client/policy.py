"""The task policy text (docs/protocol.md, "Task policy"): parsed strictly and checked.

A device binds its contribution to the policy's SHA-256, so it must read the policy exactly as
the enclave does: 14 lines (then optionally `device_auth`, then optionally `analytics`), each key in its place, integers in decimal without leading zeros, and
floats in Rust's shortest `{:e}` form (`4e0`, `1e-6`, `1.5e1`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from decimal import Decimal

HEADER = "confed-task-policy/v3"
KEYS = [
    "task_id", "tenant_id", "population", "rounds", "report_goal", "min_reports", "epsilon",
    "delta", "clip_norm", "mechanism", "server_learning_rate", "plan", "upload_window",
]
#: The latest send instant a policy may name: a week, in ms.
MAX_UPLOAD_WINDOW_MS = 7 * 24 * 3600 * 1000
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
_U32 = re.compile(r"(0|[1-9][0-9]*)\Z")
_E = re.compile(r"-?[0-9](\.[0-9]+)?e-?[0-9]+\Z")


class PolicyError(ValueError):
    """The policy text is malformed, or outside the enclave's or the device's limits."""


def rust_e(x: float) -> str:
    """Rust's `{:e}` of a finite f64: the shortest round-trip digits as d[.ddd]e<exp>."""
    if x == 0:
        return "-0e0" if math.copysign(1, x) < 0 else "0e0"
    sign, digits, exponent = Decimal(repr(x)).as_tuple()
    text = "".join(map(str, digits)).rstrip("0") or "0"
    power = len(digits) - 1 + exponent
    mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
    return ("-" if sign else "") + f"{mantissa}e{power}"


def _float(text: str, key: str) -> float:
    if not _E.match(text):
        raise PolicyError(f"{key}={text!r} is not in Rust's {{:e}} form (e.g. 4e0, 1e-6)")
    value = float(text)
    if not math.isfinite(value) or rust_e(value) != text:
        raise PolicyError(f"{key}={text!r} is not canonical (expected {rust_e(value)!r})")
    return value


def _u32(text: str, key: str) -> int:
    if not _U32.match(text) or int(text) > 0xFFFFFFFF:
        raise PolicyError(f"{key}={text!r} is not an unsigned 32-bit decimal")
    return int(text)


def parse_policy(raw: bytes | str) -> dict:
    """The policy's fields, typed; `PolicyError` saying what is wrong otherwise."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    if not text.endswith("\n"):
        raise PolicyError("the last line must end with a line feed")
    lines = text[:-1].split("\n")
    device_auth = analytics = masking = None
    if len(lines) > len(KEYS) + 1 and lines[-1].startswith("analytics="):
        from .analytics import parse_query  # analytics reads this module's number forms

        analytics = parse_query(lines.pop().removeprefix("analytics="))
    if len(lines) > len(KEYS) + 1 and lines[-1].startswith("masking="):
        from .masking import MaskingError, parse_line

        try:
            masking = parse_line(lines.pop().removeprefix("masking="))
        except MaskingError as error:
            raise PolicyError(str(error)) from error
    if len(lines) == len(KEYS) + 2:
        device_auth = _device_auth(lines.pop())
    if len(lines) != len(KEYS) + 1 or lines[0] != HEADER:
        raise PolicyError(f"expected {HEADER!r} and {len(KEYS)} lines of key=value")
    fields: dict = {}
    for key, line in zip(KEYS, lines[1:]):
        name, sep, value = line.partition("=")
        if name != key or not sep:
            raise PolicyError(f"expected {key}=..., found {line[:40]!r}")
        fields[key] = value
    for key in ("task_id", "tenant_id", "population"):
        if not _ID.match(fields[key]):
            raise PolicyError(f"{key} is not 1-128 characters of A-Z a-z 0-9 . _ -")
    for key in ("rounds", "report_goal", "min_reports"):
        fields[key] = _u32(fields[key], key)
    for key in ("epsilon", "delta", "clip_norm", "server_learning_rate"):
        fields[key] = _float(fields[key], key)
    fields["min_separation"] = min_separation(fields["mechanism"])
    fields["adaptive_clipping"] = adaptive_clipping(fields["mechanism"])
    fields["evaluation"] = evaluation(fields["mechanism"])
    fields["health"] = health(fields["mechanism"])
    fields["weighting"] = weighting(fields["mechanism"])
    plan = json.loads(fields["plan"])
    if not isinstance(plan, dict):
        raise PolicyError("plan is not a JSON object")
    fields["plan"] = plan
    fields["upload_window"] = _upload_window(fields["upload_window"])
    fields["device_auth"] = device_auth
    if (masking is not None and masking["noise_variance"] is not None
            and not fields["mechanism"].split(";")[0] == "discrete_gaussian_on_grid"):
        raise PolicyError("distributed noise is per-round Gaussian noise; the mechanism "
                          f"{fields['mechanism']!r} correlates its noise across rounds")
    fields["masking"] = masking
    fields["analytics"] = analytics
    return fields


def _upload_window(text: str) -> tuple[int, int]:
    """`<start_ms>,<end_ms>`: when the device sends, in ms after it received the assignment
    (docs/protocol.md, "Upload window")."""
    start, sep, end = text.partition(",")
    if not sep:
        raise PolicyError(f"upload_window={text!r} is not <start_ms>,<end_ms>")
    window = (_u32(start, "upload_window"), _u32(end, "upload_window"))
    if not window[0] <= window[1] <= MAX_UPLOAD_WINDOW_MS:
        raise PolicyError(f"upload_window={text!r}: need start <= end <= {MAX_UPLOAD_WINDOW_MS}")
    return window


_ISSUER = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")


def _device_auth(line: str) -> dict:
    """The optional last line (docs/protocol.md, "Device tokens"): the issuer whose tokens every
    counted contribution must carry, and its token keys (DER SPKI)."""
    value = line.removeprefix("device_auth=")
    parts = value.split(";")
    if (value == line or len(parts) != 3 or parts[0] != "privacy_pass"
            or not parts[1].startswith("issuer=") or not parts[2].startswith("token_keys=")):
        raise PolicyError("the only line allowed after upload_window is "
                          "device_auth=privacy_pass;issuer=<name>;token_keys=<keys>")
    issuer = parts[1].removeprefix("issuer=")
    if not _ISSUER.match(issuer):
        raise PolicyError("device_auth's issuer is not 1-128 characters of A-Z a-z 0-9 . _ -")
    keys = parts[2].removeprefix("token_keys=").split(",")
    if not 1 <= len(keys) <= 4:
        raise PolicyError("device_auth names 1 to 4 token keys")
    try:
        decoded = [base64.b64decode(k + "=" * (-len(k) % 4), altchars=b"-_", validate=True)
                   for k in keys]
    except ValueError as error:
        raise PolicyError("a device_auth token key is not base64url") from error
    if any(base64.urlsafe_b64encode(d).rstrip(b"=").decode() != k
           for d, k in zip(decoded, keys)):
        raise PolicyError("a device_auth token key is not canonical base64url without padding")
    return {"issuer": issuer, "token_keys": decoded}


_NOISE = re.compile(r"(?P<noise>discrete_gaussian_on_grid"
                    r"|tree_aggregation_on_grid;min_separation=(?P<tree>[1-9][0-9]{0,3})"
                    r"|blt_on_grid;min_separation=(?P<blt>[1-9][0-9]{0,4});buffers=(?P<buffers>[^;]*)"
                    r";max_values=(?P<max_values>[1-9][0-9]{0,9});lattice_bits=(?P<lattice_bits>0|[1-9][0-9]?))"
                    r"(;adaptive_clipping=(?P<a1>[^,;]+),(?P<a2>[^,;]+),(?P<a3>[^,;]+))?"
                    r"(;evaluation=(?P<e1>0|[1-9][0-9]*),(?P<e2>[^,;]+),(?P<e3>0|[1-9][0-9]*),"
                    r"(?P<e4>[^,;]+),(?P<e5>0|[1-9][0-9]*))?"
                    r"(;health=(?P<h1>[^,;]+))?"
                    r"(;weighting=examples,(?P<w1>[1-9][0-9]{0,6}))?\Z")

#: The tensor a device adds to its update in an evaluation round: float32 [3],
#: [loss_sum, correct, examples] of the model it downloaded on its own held-out examples.
EVALUATION_TENSOR = "confed.evaluation"
#: The tensor every update carries under a policy that names `health`: float32 [1], 1.0 when
#: the device sent zeros in place of its trained update, else 0.0 (docs/protocol.md, "Health").
HEALTH_TENSOR = "confed.health"
#: The tensor every update carries under a policy that names `weighting`: float32 [1], the
#: examples the update trained on, capped at the policy's max_examples, 0.0 with zeros sent
#: (docs/protocol.md, "Weighting").
EXAMPLES_TENSOR = "confed.examples"


def _mechanism(mechanism: str) -> re.Match:
    found = _NOISE.match(mechanism)
    if not found or (found.group("tree") and int(found.group("tree")) > 1024):
        raise PolicyError(f"unknown mechanism {mechanism!r}")
    if found.group("blt"):
        _check_blt(found, mechanism)
    return found


def _check_blt(found: re.Match, mechanism: str) -> None:
    """BLT noise's parameters in range (docs/protocol.md, "Task policy"): separation 1..=10000,
    0-10 buffers with decays in (0, 1) decreasing at least 1e-9 apart, positive scales summing to
    at most 1 with sum(scale / decay) < 1, every number a multiple of 2^-52, max_values
    1..=2^32, lattice_bits 0..=14."""
    bad = PolicyError(f"BLT parameters out of range in {mechanism!r}")
    listed = found.group("buffers")
    pairs = [p.split(":") for p in listed.split(",")] if listed else []
    if len(pairs) > 10 or any(len(p) != 2 for p in pairs):
        raise bad
    try:
        decays = [float(t) for t, _ in pairs]
        scales = [float(w) for _, w in pairs]
    except ValueError as error:
        raise bad from error
    on_grid = all(math.isfinite(x) and (x * 2.0**52).is_integer() for x in decays + scales)
    decreasing = all(a - b >= 1e-9 for a, b in zip(decays, decays[1:]))
    if not (int(found.group("blt")) <= 10_000 and on_grid and decreasing
            and all(0 < t < 1 for t in decays) and all(w > 0 for w in scales)
            and sum(scales) <= 1 and sum(w / t for t, w in zip(decays, scales)) < 1
            and int(found.group("max_values")) <= 2**32
            and int(found.group("lattice_bits")) <= 14):
        raise bad


def min_separation(mechanism: str) -> int:
    """Fewest rounds between two rounds of the task one device may serve: 1 for
    `discrete_gaussian_on_grid`, `b` for `tree_aggregation_on_grid;min_separation=<b>` (DP-FTRL,
    b in 1..=1024) and `blt_on_grid;min_separation=<b>;...` (DP-FTRL with BLT noise, b in
    1..=10000), each optionally followed by `;adaptive_clipping=...`; `PolicyError` for any
    other mechanism."""
    found = _mechanism(mechanism)
    separation = found.group("tree") or found.group("blt")
    return int(separation) if separation else 1


def adaptive_clipping(mechanism: str) -> dict | None:
    """The adaptive clipping parameters (`target_quantile`, `learning_rate`, `count_stddev`) a
    mechanism names, each canonical `{:e}` and in range, or None."""
    found = _mechanism(mechanism)
    if not found.group("a1"):
        return None
    names = ("target_quantile", "learning_rate", "count_stddev")
    values = {n: _float(v, f"adaptive_clipping.{n}")
              for n, v in zip(names, found.group("a1", "a2", "a3"))}
    if not (0 < values["target_quantile"] < 1 and 0 < values["learning_rate"] <= 10
            and 0.5 <= values["count_stddev"] <= 1e6):
        raise PolicyError(f"adaptive_clipping out of range in {mechanism!r}")
    return values


def evaluation(mechanism: str) -> dict | None:
    """The evaluation a mechanism names (`every`, `max_loss`, `max_examples`, `stddev`,
    `on_demand`), each canonical and in range, or None (docs/protocol.md, "Evaluation")."""
    found = _mechanism(mechanism)
    if not found.group("e1"):
        return None
    values = {"every": _u32(found.group("e1"), "evaluation.every"),
              "max_loss": _float(found.group("e2"), "evaluation.max_loss"),
              "max_examples": _u32(found.group("e3"), "evaluation.max_examples"),
              "stddev": _float(found.group("e4"), "evaluation.stddev"),
              "on_demand": _u32(found.group("e5"), "evaluation.on_demand")}
    if not (values["every"] <= 10000 and 0 < values["max_loss"] <= 1e6
            and 1 <= values["max_examples"] <= 1_000_000 and 1 <= values["stddev"] <= 1e6
            and values["on_demand"] <= 1000 and (values["every"] or values["on_demand"])):
        raise PolicyError(f"evaluation out of range in {mechanism!r}")
    return values


def health(mechanism: str) -> dict | None:
    """The health signal a mechanism names (`stddev`, canonical `{:e}` in [1, 1e6]), or None."""
    found = _mechanism(mechanism)
    if not found.group("h1"):
        return None
    stddev = _float(found.group("h1"), "health.stddev")
    if not 1 <= stddev <= 1e6:
        raise PolicyError(f"health out of range in {mechanism!r}")
    return {"stddev": stddev}


def weighting(mechanism: str) -> dict | None:
    """The example weighting a mechanism names (`max_examples`, in 1..=1000000), or None."""
    found = _mechanism(mechanism)
    if not found.group("w1"):
        return None
    max_examples = int(found.group("w1"))
    if not 1 <= max_examples <= 1_000_000:
        raise PolicyError(f"weighting out of range in {mechanism!r}")
    return {"max_examples": max_examples}


def evaluates(policy: dict, round_: int) -> bool:
    """Whether `round_` of the task is a scheduled evaluation round: rounds 1, 1 + every, ...
    (none when every is 0)."""
    e = policy.get("evaluation")
    return e is not None and e["every"] > 0 and round_ >= 1 and (round_ - 1) % e["every"] == 0


def _issuer_trusted(device_auth: dict | None, token_issuers: dict) -> bool:
    if device_auth is None:
        return True
    trusted = token_issuers.get(device_auth["issuer"])
    return trusted is not None and all(k in trusted["token_keys"] for k in device_auth["token_keys"])


def _masking_possible(policy: dict) -> bool:
    """What the enclave refuses under a masked policy (docs/protocol.md, "Task policy")."""
    if policy.get("masking") is None:
        return True
    return (policy.get("device_auth") is not None and policy.get("analytics") is None
            and all(policy.get(k) is None
                    for k in ("adaptive_clipping", "evaluation", "health", "weighting")))


def policy_sha256(raw: bytes | str) -> str:
    """Lowercase hex SHA-256 of the policy text: what a contribution is bound to."""
    data = raw.encode("utf-8") if isinstance(raw, str) else raw
    return hashlib.sha256(data).hexdigest()


def check_policy(policy: dict, *, task_id: str, population: str, round_: int,
                 limits: dict, tenant_id: str | None = None,
                 token_issuers: dict | None = None) -> None:
    """The device's checks before it seals anything (docs/protocol.md, "Check-in"): the
    enclave's limits and the device's own from its trust file. Raises `PolicyError` naming the
    first field that fails."""
    checks = [
        ("task_id", policy["task_id"] == task_id),
        ("population", policy["population"] == population),
        ("round", 1 <= round_ <= policy["rounds"]),
        ("epsilon", 0 < policy["epsilon"] <= 100),
        ("delta", 0 < policy["delta"] <= 0.01),
        ("clip_norm", 1e-6 <= policy["clip_norm"] <= 1e6),
        ("min_reports", 1 <= policy["min_reports"] <= policy["report_goal"]),
        ("rounds", policy["rounds"] >= 1),
        ("server_learning_rate", 0 < policy["server_learning_rate"] <= 100),
        ("epsilon (device limit)", policy["epsilon"] <= limits["max_epsilon"]),
        ("delta (device limit)", policy["delta"] <= limits["max_delta"]),
        ("min_reports (device limit)", policy["min_reports"] >= limits["min_reports"]),
        ("tenant_id", tenant_id is None or policy["tenant_id"] == tenant_id),
        ("device_auth (the issuer and its keys must be in the trust file's token_issuers)",
         _issuer_trusted(policy.get("device_auth"), token_issuers or {})),
        ("masking (it needs device_auth, a training task, and no adaptive clipping, "
         "evaluation, health or weighting)", _masking_possible(policy)),
    ]
    for name, ok in checks:
        if not ok:
            raise PolicyError(f"the task policy fails this device's check of {name}")
