"""A device (docs/protocol.md, "Device protocol"): check in, verify the round's key, download the
model, train, seal, upload, report."""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import os
import random
import secrets
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import requests
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from . import envelope, masking, tokens
from .errors import ConfedError
from .policy import (EVALUATION_TENSOR, EXAMPLES_TENSOR, HEALTH_TENSOR, PolicyError,
                     check_policy, evaluates, parse_policy, policy_sha256)
from . import analytics
from .tensors import as_arrays, from_safetensors, to_safetensors, to_torch

#: `train(weights, plan)`: the update (new weights minus the given ones), or `(update,
#: num_examples)` as Flower's clients return it (what a task that weighs by examples needs).
Train = Callable[[dict, dict], "dict | tuple[dict, float]"]
#: Called on the device when training or evaluation failed and a zero update (or zero metrics)
#: was sent instead: `(assignment, problem)`. The server is never told (docs/privacy.md).
OnProblem = Callable[[dict, "TrainingProblem"], None]

log = logging.getLogger("confed_client.device")

#: The `format` of a device's state file (`Device.state_file`).
STATE_FORMAT = "confed-device-state/v1"
#: A device's evaluation of a model: (loss_sum, correct, examples) over its held-out examples.
Evaluate = Callable[[dict], tuple]


class DeviceError(ConfedError):
    """A check failed, or the server refused (the message says which and why; `status` is the
    server's answer, None for a check of the device's own)."""


@dataclass(frozen=True)
class TrainingProblem:
    """What went wrong between accepting an assignment and sealing, kept on the device: `kind`
    is `training_failed`, `wrong_tensors` (a programming error: the train function's output is
    not the model's tensors and shapes), `no_example_count` (a programming error: a task that
    weighs updates by examples got no `(update, num_examples)` with a finite count >= 0),
    `non_finite`, `evaluation_failed` or `evaluation_non_finite`, or `late` (training had not
    finished at the send instant drawn before it started); `detail` says more."""

    kind: str
    detail: str

    @property
    def is_programming_error(self) -> bool:
        return self.kind in ("wrong_tensors", "no_example_count")


def _describe(error: BaseException) -> str:
    """`Type: message` of an exception, even one whose `__str__` raises."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001
        return type(error).__name__


def _well_formed_metrics(evaluate: Callable[[], object]
                         ) -> tuple[np.ndarray, list[TrainingProblem]]:
    """`evaluate()` as three finite F32 numbers, or zeros and why."""
    try:
        metrics = np.asarray(evaluate(), np.float32)
        if metrics.shape != (3,):
            raise ValueError(f"evaluate returned shape {metrics.shape}, not three numbers")
    except Exception as error:  # noqa: BLE001 - any failure of the partner's code is the same
        return np.zeros(3, np.float32), [TrainingProblem("evaluation_failed",
                                                         _describe(error))]
    if not np.isfinite(metrics).all():
        return np.zeros(3, np.float32), [TrainingProblem("evaluation_non_finite",
                                                         str(metrics.tolist()))]
    return metrics, []


def _example_count(examples, weighting: dict) -> float | None:
    """A weighting task's count as sent: finite, >= 0, capped at max_examples; else None."""
    try:
        count = float(examples)
    except Exception:  # noqa: BLE001 - whatever the training code returned (10**400 overflows)
        return None
    if not np.isfinite(count) or count < 0:
        return None
    return min(count, float(weighting["max_examples"]))


def well_formed_update(model: dict[str, np.ndarray], train: Callable[[], dict],
                       evaluate: Callable[[], object] | None = None, health: bool = False,
                       weighting: dict | None = None
                       ) -> tuple[dict[str, np.ndarray], list[TrainingProblem]]:
    """The update a device seals, whatever `train()` and `evaluate()` do: the model's exact
    tensors and shapes as finite F32 (zeros where training raised, gave the wrong tensors or a
    NaN/infinity) and, when `evaluate` is given (an evaluation round: it runs first, on the
    model before training), the metrics tensor (zeros where evaluation raised or was not three
    finite numbers); with `health` (a policy naming it) the health flag, 1.0 exactly when the
    model's values were replaced by zeros; with `weighting` (a policy naming it) the example
    count: `train()` returns `(update, num_examples)` (a plain update, or a count that is not a
    finite number >= 0, is a programming error: zeros are sent), sent capped at the policy's
    `max_examples`, 0.0 with zeros; and the problems, for the device's own log. Nothing
    of the server's view
    then depends on the device's data but the values the enclave clips and noises
    (docs/privacy.md, "What leaves a device")."""
    problems: list[TrainingProblem] = []
    metrics = None
    if evaluate is not None:
        metrics, problems = _well_formed_metrics(evaluate)
    zeros = {name: np.zeros(array.shape, np.float32) for name, array in model.items()}
    examples = None
    try:
        result = train()
        # Flower's shape: (update, num_examples); the count matters under weighting only.
        if isinstance(result, tuple) and len(result) == 2:
            result, examples = result
        trained = as_arrays(result)
    except Exception as error:  # noqa: BLE001 - any failure of the partner's code is the same
        problems.append(TrainingProblem("training_failed", _describe(error)))
        trained = None
    count = _example_count(examples, weighting) if weighting is not None else None
    update = zeros
    zeroed = True
    if trained is None:
        pass
    elif set(trained) != set(model) or any(trained[k].shape != model[k].shape for k in model):
        problems.append(TrainingProblem(
            "wrong_tensors", "the update does not have the model's tensors and shapes: got "
            f"{sorted((k, tuple(v.shape)) for k, v in trained.items())}, the model has "
            f"{sorted((k, tuple(v.shape)) for k, v in model.items())}"))
    elif bad := sorted(k for k in model if not np.isfinite(trained[k]).all()):
        problems.append(TrainingProblem("non_finite", f"tensors {bad}"))
    elif weighting is not None and count is None:
        problems.append(TrainingProblem(
            "no_example_count", "the task weighs updates by examples: train must return "
            f"(update, num_examples) with a finite count >= 0, got {examples!r}"))
    else:
        update = {k: trained[k] for k in model}
        zeroed = False
    if metrics is not None:
        update = dict(update)
        update[EVALUATION_TENSOR] = metrics
    if health:
        update = dict(update)
        update[HEALTH_TENSOR] = np.array([1.0 if zeroed else 0.0], np.float32)
    if weighting is not None:
        update = dict(update)
        update[EXAMPLES_TENSOR] = np.array([0.0 if zeroed else count], np.float32)
    return update, problems


def flush_subnormals(model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model with every subnormal F32 value set to zero: a model of subnormal weights would
    make training slow until the data steers it out of them (defence in depth; the send instant
    is the fix, docs/privacy.md, "Time")."""
    tiny = np.finfo(np.float32).tiny
    return {name: np.where(np.abs(array) < tiny, np.float32(0) * np.sign(array), array)
            .astype(np.float32) for name, array in model.items()}


def _late() -> dict:
    raise TimeoutError("late")


#: What a device keeps before the assignment expires, at the latest, to seal, upload and report.
EXPIRY_ALLOWANCE_MS = 2000


def draw_send_times(received_ms: int, window: tuple[int, int], expires_ms: int,
                    send_unit: float, token_unit: float) -> dict:
    """The instants of an assignment received at `received_ms` (Unix ms) under the policy's
    upload window, from two uniform draws in [0, 1) (docs/protocol.md, "Upload window"): the
    send instant `received + start + floor(u * (end - start))`, moved to 2 s before the expiry
    if later; the token request `received + floor(v * (send - received))`."""
    start, end = window
    latest = max(received_ms, expires_ms - EXPIRY_ALLOWANCE_MS)
    send = min(received_ms + start + min(int(send_unit * (end - start)), end - start), latest)
    token = received_ms + min(int(token_unit * (send - received_ms)), send - received_ms)
    return {"received_ms": received_ms, "token_ms": token, "send_ms": send}


def _log_problem(assignment: dict, problem: TrainingProblem) -> None:
    level = logging.ERROR if problem.is_programming_error else logging.WARNING
    log.log(level, "task %s round %s: sent a zero update instead (%s: %s)",
            assignment.get("task_id"), assignment.get("round"), problem.kind, problem.detail)


def _b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class Trust:
    """The device trust file (docs/protocol.md, "Device trust file")."""

    threshold: int
    keyservices: dict[str, ec.EllipticCurvePublicKey]
    limits: dict
    tenant_id: str | None = None
    #: n, the number of key services holding a share of each key (the file's `shares`, else the
    #: key services listed): with `threshold`, the release quorum `verify_release` asks for.
    shares: int | None = None
    #: issuer name -> {"token_keys": [DER SPKI], "url"}: the token issuers whose tokens the
    #: device obtains for tasks that require them (docs/protocol.md, "Device tokens").
    token_issuers: dict = field(default_factory=dict)
    #: Contribute only to masked tasks (`require_masking`): a task in the clear is refused.
    require_masking: bool = False
    #: Contribute only to masked tasks whose key services draw the noise
    #: (`require_distributed_noise`; docs/secure-aggregation.md, "Distributed noise").
    require_distributed_noise: bool = False

    @property
    def n(self) -> int:
        return len(self.keyservices) if self.shares is None else self.shares

    @classmethod
    def load(cls, path: str) -> "Trust":
        """Reads and checks a trust file; `ValueError` saying what is wrong."""
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        unknown = set(raw) - {"threshold", "keyservices", "limits", "tenant_id", "shares",
                              "token_issuers", "require_masking", "require_distributed_noise"}
        if unknown:
            raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
        keys = {entry["id"]: ec.EllipticCurvePublicKey.from_encoded_point(
            ec.SECP256R1(), _b64url(entry["verifying_key"])) for entry in raw["keyservices"]}
        limits = raw["limits"]
        missing = {"max_epsilon", "max_delta", "min_reports"} - set(limits)
        if missing:
            raise ValueError(f"{path}: limits lack {sorted(missing)}")
        if not 1 <= raw["threshold"] <= len(keys):
            raise ValueError(f"{path}: threshold {raw['threshold']} is not between 1 and the "
                             f"{len(keys)} key services listed")
        shares = raw.get("shares")
        if shares is not None and not max(raw["threshold"], len(keys)) <= shares <= 65535:
            raise ValueError(f"{path}: shares {shares} must be at least the threshold "
                             f"{raw['threshold']} and the {len(keys)} key services listed")
        names = [entry["name"] for entry in raw.get("token_issuers", [])]
        if len(set(names)) != len(names):
            raise ValueError(f"{path}: a token issuer is listed twice; list each once")
        issuers = {entry["name"]: {"token_keys": [_b64url(k) for k in entry["token_keys"]],
                                   "url": entry["url"]}
                   for entry in raw.get("token_issuers", [])}
        return cls(raw["threshold"], keys, limits, raw.get("tenant_id"), shares, issuers,
                   bool(raw.get("require_masking", False)),
                   bool(raw.get("require_distributed_noise", False)))

    def verify_key(self, encryption: dict, now: float) -> bytes:
        """The X25519 public key of an assignment's `encryption`, if at least `threshold` (and
        at least one) trusted key services signed this exact entry and it is valid now."""
        def message(service: str) -> bytes:
            return "|".join([
                "confed-keyset-v1", service, encryption["key_id"], encryption["suite"],
                encryption["public_key"], str(encryption["not_before"]),
                str(encryption["not_after"]), str(encryption["threshold"]),
                str(encryption["shares"])]).encode("utf-8")

        signers = set()
        for entry in encryption.get("signatures", []):
            service = entry.get("keyservice_id")
            key = self.keyservices.get(service)
            if key is None:
                continue  # not a key service this device trusts
            try:
                raw = _b64url(entry["signature"])
                if len(raw) != 64:
                    continue
                der = encode_dss_signature(int.from_bytes(raw[:32], "big"),
                                           int.from_bytes(raw[32:], "big"))
                key.verify(der, message(service), ec.ECDSA(hashes.SHA256()))
            except (InvalidSignature, ValueError, KeyError):
                continue
            signers.add(service)
        if len(signers) < max(1, self.threshold):
            raise DeviceError(f"key {encryption['key_id']} is signed by {len(signers)} trusted "
                              f"key services; this device requires {self.threshold}")
        if not encryption["not_before"] <= now < encryption["not_after"]:
            raise DeviceError(f"key {encryption['key_id']} is not valid now")
        return _b64url(encryption["public_key"])


@dataclass
class Device:
    """One device of a population. `train(model, plan)` returns the update (the new weights
    minus the model's), tensor by tensor."""

    server: str
    population: str
    trust: Trust
    client_version: str = "1.0.0"
    attributes: dict = field(default_factory=dict)
    session: requests.Session = field(default_factory=requests.Session)
    #: (task_id, round) this device sealed an update for: it seals at most once per round (and
    #: under DP-FTRL keeps its rounds `min_separation` apart). Kept in `state_file`.
    served: set = field(default_factory=set)
    #: Attempts of an upload or report that the server answers 503/507 or the network fails.
    attempts: int = 5
    #: Longest wait between those attempts, in seconds (the server's `Retry-After`, else 1 s).
    max_retry_after: float = 30.0
    #: Wait before uploading the same bytes again after a 422 (a replica behind on the key set).
    key_retry_wait: float = 1.0
    #: "numpy" or "torch": what `train` is given (it may return either).
    tensors: str = "numpy"
    #: Whether check-ins tell the server the rounds served (`served`, tree tasks only); off, the
    #: device declines instead and its check-ins stay unlinkable to its earlier assignments.
    send_served: bool = True
    #: task -> (population, min_separation, rounds) of the tree tasks this device served.
    separated: dict = field(default_factory=dict)
    #: `evaluate(model) -> (loss_sum, correct, examples)` over this device's held-out examples:
    #: called in a task's evaluation rounds on the model the device downloaded, and sent with
    #: the update (docs/protocol.md, "Evaluation"). None: the device sends no metrics.
    evaluate: Evaluate | None = None
    #: (task_id, round) of the on-demand evaluations this device granted: at most the policy's
    #: `on_demand` per task, whatever the server asks (the accounting counts on it). Kept in
    #: `state_file`.
    on_demand: set = field(default_factory=set)
    #: Where the device keeps `served`, `separated` and `on_demand` across restarts (JSON,
    #: replaced atomically and fsync'd before the update or the metrics they guard are sealed):
    #: only the device knows them, and the privacy accounting counts on them. Loaded when the
    #: device is made (added to what is given). None keeps them in memory only, with a warning:
    #: a restarted device would then serve rounds closer than `min_separation` and grant
    #: on-demand evaluations again.
    state_file: str | os.PathLike | None = None
    #: Called when training or evaluation failed and zeros were sent instead (default: a log
    #: line, an error for a programming error such as the wrong tensors). The server hears an
    #: ordinary `completed` contribution either way.
    on_problem: OnProblem = _log_problem
    #: The latest 100 (task_id, round, TrainingProblem) of this device, for its own inspection
    #: (bounded: a device whose training fails every round for months must not grow with it).
    problems: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100))
    #: How the device attests to token issuers (`tokens.DevAttestation` for tests and demos,
    #: `tokens.AndroidKeyAttestation`, `tokens.AppleAppAttest`). None: it declines tasks that
    #: require device tokens.
    attestation: tokens.DevAttestation | tokens.AndroidKeyAttestation | tokens.AppleAppAttest \
        | None = None
    #: After an assignment it could not serve (no device token, a refused upload, ...), the
    #: device's next `run_once` first waits a uniform time in this window (seconds), as the Rust
    #: device does (`tokens::AFTER_FAILURE`): a failure that will fail again (an issuer that offers
    #: none of a policy's keys during a rotation) must not become a loop of assignments, each
    #: holding a slot of the round until it is reported.
    after_failure: tuple[float, float] = (60.0, 120.0)
    #: How the device waits (injectable for tests).
    sleep: Callable[[float], None] = time.sleep
    #: `records(query) -> list`: this device's local records for an analytics task's query
    #: (`query` as `confed_client.analytics.parse_query` gives it): `(key_index, value)` pairs
    #: for a histogram, strings for an open histogram, numbers for quantiles. The device answers
    #: from them by the query (docs/protocol.md, "Analytics answers"), never with partner code.
    #: None: the device declines analytics tasks.
    records: Callable[[dict], list] | None = None
    #: The latest 100 sends of this device, for its own inspection: {"task_id", "round",
    #: "received_ms", "send_ms" (drawn before training), "sealed_ms" (when the seal started)}.
    sent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100))
    #: assignment reference -> the instants drawn for it before training ({"received_ms",
    #: "token_ms", "send_ms"}, Unix ms), until it is reported. Kept in `state_file`.
    sends: dict = field(default_factory=dict)
    _token_sources: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    #: Unix seconds before which `run_once` does not check in (after a failed assignment).
    _not_before: float = field(default=0.0, init=False, compare=False, repr=False)
    _serving: threading.Lock = field(default_factory=threading.Lock, init=False,
                                     compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.state_file is None:
            warnings.warn("this confed Device keeps the rounds it served and the evaluations it "
                          "granted in memory only: a restarted device forgets them and may serve "
                          "rounds its policies' accounting forbids; pass state_file=...",
                          stacklevel=3)
            return
        try:
            with open(self.state_file, encoding="utf-8") as f:
                saved = json.load(f)
        except FileNotFoundError:
            self._save()
            return
        except json.JSONDecodeError as error:
            raise ValueError(f"{self.state_file}: not JSON ({error})") from error
        members = {"format", "served", "on_demand", "separated"}
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
            raise ValueError(f"{self.state_file}: not a {STATE_FORMAT} file")
        if set(saved) - {"sends"} != members:
            raise ValueError(f"{self.state_file}: members {sorted(saved)}, expected "
                             f"{sorted(members)} and optionally sends")
        try:
            self.served |= {(str(t), int(r)) for t, r in saved["served"]}
            self.on_demand |= {(str(t), int(r)) for t, r in saved["on_demand"]}
            for task, (population, separation, rounds) in saved["separated"].items():
                self.separated.setdefault(task, (population, int(separation), int(rounds)))
            for ref, times in saved.get("sends", {}).items():
                if set(times) != {"received_ms", "token_ms", "send_ms"} or not all(
                        type(v) is int for v in times.values()):
                    raise ValueError(f"sends[{ref}] is not three integers received_ms, "
                                     f"token_ms, send_ms: {times}")
                self.sends.setdefault(str(ref), dict(times))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{self.state_file}: {error}") from error

    def _save(self) -> None:
        """Writes the state to `state_file` durably (a temporary file fsync'd, renamed over the
        old one, the directory fsync'd); raises if it cannot, so nothing is sealed that the
        device might forget."""
        if self.state_file is None:
            return
        state = {"format": STATE_FORMAT, "served": sorted(self.served),
                 "on_demand": sorted(self.on_demand),
                 "separated": {t: list(v) for t, v in sorted(self.separated.items())}}
        if self.sends:  # left out when empty: the previous release reads such a file too
            state["sends"] = dict(sorted(self.sends.items()))
        path = os.fspath(self.state_file)
        directory = os.path.dirname(os.path.abspath(path))
        temporary = f"{path}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def _url(self, path: str) -> str:
        return path if path.startswith("http") else self.server.rstrip("/") + path

    def _send(self, method: str, url: str, **kwargs) -> requests.Response:
        """The request, sent again after `Retry-After` while the server answers 503/507 or the
        network fails (at most `attempts` times in all)."""
        for attempt in range(1, self.attempts + 1):
            try:
                reply = self.session.request(method, url, **kwargs)
            except requests.RequestException:
                if attempt == self.attempts:
                    raise
                time.sleep(1.0)
                continue
            if reply.status_code not in (503, 507) or attempt == self.attempts:
                return reply
            try:
                wait = float(reply.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            time.sleep(min(self.max_retry_after, max(0.0, wait)))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def check_in(self) -> dict:
        """The assignment (201), or {"retry_window", "reason"} (200)."""
        body = {"client_version": self.client_version, "attributes": self.attributes}
        if self.trust.tenant_id:
            body["tenant_id"] = self.trust.tenant_id
        latest: dict[str, int] = {}
        for task, round_ in self.served if self.send_served else ():
            population, separation, rounds = self.separated.get(task, (None, 1, 0))
            if population == self.population and separation > 1 and round_ < rounds:
                latest[task] = max(round_, latest.get(task, round_))
        if latest:
            # The latest round of each task (at most 256): the server skips rounds this device
            # would decline (docs/protocol.md, "Check-in").
            recent = sorted(latest.items(), key=lambda item: -item[1])[:256]
            body["served"] = [{"task_id": t, "round": r} for t, r in recent]
        reply = self._send("POST", self._url(f"/v1/populations/{self.population}/checkin"),
                           json=body, timeout=30)
        if reply.status_code not in (200, 201):
            raise DeviceError.from_reply("check-in", reply)
        return reply.json()

    def report(self, assignment: dict, outcome: str, error: str | None = None) -> dict:
        body = {"outcome": outcome}
        if error is not None:
            body["error"] = error[:1000]
        reply = self._send("POST", self._url(assignment["report_url"]), json=body, timeout=30)
        if reply.status_code != 200:
            raise DeviceError.from_reply(f"report {outcome}", reply)
        return reply.json()

    def _fail(self, assignment: dict, error: BaseException) -> None:
        """Reports `failed` (freeing the slot) without hiding `error` if that report fails."""
        try:
            self.report(assignment, "failed", str(error))
            self._forget_schedule(assignment)
        except (DeviceError, requests.RequestException):
            pass  # the original error is the one the caller needs

    def declines(self, assignment: dict) -> str | None:
        """Why this device must decline the assignment (report `not_eligible`), or None: it
        served the round already, or, under DP-FTRL (`tree_aggregation_on_grid`), a round of the
        task fewer than the policy's `min_separation` rounds away (docs/protocol.md)."""
        task, round_ = assignment["task_id"], assignment["round"]
        try:
            separation = parse_policy(assignment["policy"])["min_separation"]
        except (PolicyError, KeyError, ValueError):
            separation = 1  # an unreadable policy is refused when the device contributes
        close = [r for (t, r) in self.served if t == task and abs(r - round_) < separation]
        if not close:
            return None
        nearest = min(close, key=lambda r: abs(r - round_))
        if nearest == round_:
            return f"round {round_} of task {task} was already served by this device"
        return (f"this device served round {nearest} of task {task}; its policy keeps a "
                f"device's rounds at least {separation} apart")

    def _evaluates(self, policy: dict, assignment: dict) -> bool:
        """Whether to evaluate in this assignment: a scheduled evaluation round, or one the
        server says the partner asked for on demand (`evaluate`) while this device has granted
        fewer than the policy's `on_demand` of the task (granted here, counted at once)."""
        if evaluates(policy, assignment["round"]):
            return True
        allowed = (policy.get("evaluation") or {}).get("on_demand", 0)
        if not assignment.get("evaluate") or not allowed:
            return False
        key = (assignment["task_id"], assignment["round"])
        with self._serving:
            granted = sum(1 for (task, _) in self.on_demand if task == key[0])
            if key not in self.on_demand and granted >= allowed:
                return False
            if key not in self.on_demand:
                self.on_demand.add(key)
                try:
                    self._save()  # before the metrics are measured and sealed
                except OSError:
                    # Not kept, not granted: no metrics (the device's disk, not its data).
                    self.on_demand.discard(key)
                    log.exception("cannot save the on-demand evaluation grant; sending none")
                    return False
        return True

    def contribute(self, assignment: dict, train: Train) -> None:
        """Verifies, trains, seals, uploads and reports one assignment. A failed check before
        training (the policy, the key, the model download: the same for every device of the
        round) is reported `failed` with the reason and raised. Once the policy is accepted the
        device draws when it will ask for its device token and when it will send (uniform in
        the policy's upload window, from the operating system's randomness, before anything
        reads its data; kept in `state_file`), trains on a thread, and at the send instant
        seals whatever is ready: nothing the server hears, nor when, depends on what training
        does. An exception, a NaN, the wrong tensors or training still running at the instant
        become a zero update of the model's shape, sealed, uploaded and reported `completed`
        like any other; the problem goes to `problems` and, once the report is sent, to
        `on_problem` (whose own exceptions are logged, never raised), on the device only
        (docs/privacy.md, "What leaves a device" and "Time"). A device seals at most once per
        round (and under DP-FTRL at most once per `min_separation` rounds): the round is
        recorded as served before the update is sealed, whatever happens after."""
        received_ms = int(time.time() * 1000)
        served = (assignment["task_id"], assignment["round"])
        why = self.declines(assignment)
        if why:
            raise DeviceError(f"{why}: decline it (not_eligible)")
        try:
            policy_text = assignment["policy"]
            policy = parse_policy(policy_text)
            check_policy(policy, task_id=assignment["task_id"], population=self.population,
                         round_=assignment["round"], limits=self.trust.limits,
                         tenant_id=self.trust.tenant_id, token_issuers=self.trust.token_issuers)
            public_key = self.trust.verify_key(assignment["encryption"], time.time())
            if policy["masking"] is not None:
                self._masking_keys(policy)  # refused before anything is drawn or trained
                if (self.trust.require_distributed_noise
                        and policy["masking"]["noise_variance"] is None):
                    raise DeviceError("the task's key services do not draw its noise, and this "
                                      "device's trust file requires distributed noise "
                                      "(require_distributed_noise)")
            elif self.trust.require_masking or self.trust.require_distributed_noise:
                flag = ("require_masking" if self.trust.require_masking
                        else "require_distributed_noise")
                raise DeviceError("the task does not mask its updates, and this device's trust "
                                  f"file requires masking ({flag})")
            if policy["device_auth"] is not None and self.attestation is None:
                raise DeviceError("the task requires device tokens and this device has no "
                                  "attestation (Device(attestation=...))")
            if policy["analytics"] is not None and self.records is None:
                raise DeviceError("the task is an analytics query and this device has no "
                                  "records to answer it from (Device(records=...))")
            times = self._schedule(assignment, policy, received_ms)
            reply = self._send("GET", self._url(assignment["model_url"]), timeout=60)
            if reply.status_code != 200:
                raise DeviceError.from_reply("model", reply)
            model_bytes = reply.content
            try:
                model = from_safetensors(model_bytes)
            except Exception as error:  # noqa: BLE001 - the model's fault, not the data's
                raise DeviceError(f"the model is not safetensors: {error}") from error
            if not model or any(a.dtype != np.float32 for a in model.values()):
                raise DeviceError("the model must be F32 tensors")
        except Exception as error:  # the server hears why, then the caller does
            self._fail(assignment, error)
            raise
        evaluating = self.evaluate is not None and self._evaluates(policy, assignment)
        model = flush_subnormals(model)

        def trained() -> dict:
            weights = {k: v.copy() for k, v in model.items()}
            return train(to_torch(weights) if self.tensors == "torch" else weights,
                         policy["plan"])

        def evaluated():
            # The model as downloaded, before training touches anything.
            measured = {k: v.copy() for k, v in model.items()}
            return self.evaluate(to_torch(measured) if self.tensors == "torch" else measured)

        if policy["analytics"] is not None:
            update_bytes, problems, (eks, token, seeds) = self._answer_until(
                times, policy, assignment)
        else:
            update_bytes, problems, (eks, token, seeds) = self._train_until(
                times, model, trained, evaluated if evaluating else None, policy, assignment)
        self.sent.append({"task_id": served[0], "round": served[1],
                          "received_ms": times["received_ms"], "send_ms": times["send_ms"],
                          "sealed_ms": int(time.time() * 1000)})
        self.problems.extend((served[0], served[1], problem) for problem in problems)
        with self._serving:
            # Again, under the lock: a concurrent contribution may have served a close round.
            why = self.declines(assignment)
            if why:
                raise DeviceError(f"{why}: decline it (not_eligible)")
            self.served.add(served)
            if policy["min_separation"] > 1:
                self.separated[served[0]] = (policy["population"], policy["min_separation"],
                                             policy["rounds"])
            self._save()  # before sealing: a device that forgot could serve the round again
        sealed_seeds = None
        if seeds is not None:
            # Clipped on the device and masked: the enclave only ever holds the masked vector.
            update_bytes = self._masked(policy, assignment, seeds, update_bytes)
            sealed_seeds = b"".join(seeds["sealed"])
        sealed = envelope.seal_update(
            public_key, assignment["encryption"]["key_id"],
            envelope.aad(assignment["task_id"], assignment["round"],
                         assignment["assignment_id"], policy_sha256(policy_text),
                         hashlib.sha256(model_bytes).hexdigest()),
            update_bytes, eks=eks, token=token, seeds=sealed_seeds)
        self.upload(assignment, sealed)
        self.report(assignment, "completed")
        self._forget_schedule(assignment)
        # Only now, after the server heard what it hears whatever training did: a callback
        # that raises (or is slow) must not change that.
        for problem in problems:
            try:
                self.on_problem(assignment, problem)
            except Exception:  # noqa: BLE001 - the device's own callback, not the server's
                log.exception("on_problem raised")

    def _schedule(self, assignment: dict, policy: dict, received_ms: int) -> dict:
        """The assignment's token and send instants (Unix ms): drawn now from the operating
        system's randomness and kept in `state_file` before training starts, or the ones drawn
        when this device first received the same assignment."""
        ref = envelope.assignment_ref(assignment["assignment_id"])
        with self._serving:
            times = self.sends.get(ref)
            if times is None:
                draw = secrets.SystemRandom()
                times = draw_send_times(received_ms, policy["upload_window"],
                                        int(assignment["expires_at"]) * 1000,
                                        draw.random(), draw.random())
                week = 8 * 24 * 3600 * 1000
                self.sends = {r: t for r, t in self.sends.items()
                              if t["send_ms"] >= received_ms - week}
                self.sends[ref] = times
                self._save()
        return times

    def _forget_schedule(self, assignment: dict) -> None:
        ref = envelope.assignment_ref(assignment["assignment_id"])
        with self._serving:
            if self.sends.pop(ref, None) is not None:
                try:
                    self._save()
                except OSError:
                    log.warning("cannot save the state file; a finished schedule stays a week")

    def _train_until(self, times: dict, model: dict, trained, evaluated, policy: dict,
                     assignment: dict) -> tuple[dict, list, tuple]:
        """Trains on a thread; asks for the device token at its instant; returns at the send
        instant with whatever is ready, as safetensors bytes: the trained update (serialized on
        the training thread), or the zero update serialized before training started (zero
        metrics in an evaluation round) when training is still running (its late result is
        dropped); and (ephemeral key, device token) of `_token`. Both candidates are bytes of
        the same length before the instant, so the seal after it costs the same either way."""
        def wait_until(ms: int) -> None:
            time.sleep(max(0.0, ms / 1000 - time.time()))

        health = policy.get("health") is not None
        weighting = policy.get("weighting")
        zeros, _ = well_formed_update(model, _late, (lambda: (0.0, 0.0, 0.0))
                                      if evaluated else None, health, weighting)
        zeros = to_safetensors(zeros)
        done: dict = {}
        finished = threading.Event()

        def work() -> None:
            try:
                update, problems = well_formed_update(model, trained, evaluated, health,
                                                      weighting)
                done["result"] = (to_safetensors(update), problems)
            finally:
                finished.set()

        threading.Thread(target=work, name="confed-training", daemon=True).start()
        wait_until(times["token_ms"])
        try:
            values = sum(int(np.asarray(v).size) for v in model.values())
            token = self._token(policy, assignment, values)
        except Exception as error:
            wait_until(times["send_ms"])  # a refusal, too, leaves at the send instant
            self._fail(assignment, error)
            raise
        wait_until(times["send_ms"])
        if finished.is_set() and "result" in done:
            update, problems = done["result"]
        else:
            update, problems = zeros, [TrainingProblem(
                "late", "training had not finished at the send instant drawn from the "
                "policy's upload window; zeros were sent")]
        return update, problems, token

    def _answer_until(self, times: dict, policy: dict, assignment: dict) -> tuple:
        """An analytics task's `_train_until`: computes the answer from `records` on a thread
        and returns at the send instant with it, or with the failed answer (made first, the
        same length) when it is not ready or failed: what the server hears, and when, says
        nothing of the device's records."""
        query = policy["analytics"]
        failed = analytics.failed_answer(query)
        done: dict = {}
        finished = threading.Event()

        def work() -> None:
            try:
                done["result"] = analytics.answer(query, self.records(query))
            except Exception as error:  # noqa: BLE001 - the device's records, its own log
                done["problem"] = TrainingProblem("training_failed", _describe(error))
            finally:
                finished.set()

        threading.Thread(target=work, name="confed-answer", daemon=True).start()

        def wait_until(ms: int) -> None:
            time.sleep(max(0.0, ms / 1000 - time.time()))

        wait_until(times["token_ms"])
        try:
            token = self._token(policy, assignment)
        except Exception as error:
            wait_until(times["send_ms"])
            self._fail(assignment, error)
            raise
        wait_until(times["send_ms"])
        if finished.is_set() and "result" in done:
            return done["result"], [], token
        problem = done.get("problem") or TrainingProblem(
            "late", "the answer was not ready at the send instant; no keys were sent")
        return failed, [problem], token

    def _masking_keys(self, policy: dict) -> list[bytes]:
        """The masking keys of a masked policy, as this device's trusted key services signed
        them; `DeviceError` otherwise."""
        try:
            return masking.accept(policy["masking"], self.trust.threshold, self.trust.n,
                                  self.trust.keyservices)
        except masking.MaskingError as error:
            raise DeviceError(f"the task policy's masking is refused: {error}") from error

    def _masked(self, policy: dict, assignment: dict, seeds: dict, update_bytes: bytes) -> bytes:
        """The masked update sealed in place of `update_bytes` (the model's tensors): clipped
        to the policy's clip norm on the grid, every group's stream added."""
        values = masking.flatten(from_safetensors(update_bytes))
        if values.size != seeds["values"]:
            raise DeviceError(f"the update has {values.size} values; its seeds were drawn "
                              f"for {seeds['values']}")
        grid = masking.clip_to_grid(values, policy["clip_norm"])
        ring = policy["masking"]["ring"]
        return masking.encode_masked(masking.mask(grid, seeds["seeds"], seeds["context"], ring),
                                     ring)

    def _token(self, policy: dict, assignment: dict, values: int | None = None):
        """(ephemeral key, device token, seeds) when the task requires tokens, else (None,
        None, None): the envelope's key drawn now, the token bound to it and to the assignment;
        in a masked task (`values` values) the mask seeds drawn now and sealed to each key
        service, which the token binds too."""
        auth = policy.get("device_auth")
        if auth is None:
            return None, None, None
        if self.attestation is None:
            raise DeviceError("the task requires device tokens and this device has no "
                              "attestation (Device(attestation=...))")
        issuer = self.trust.token_issuers[auth["issuer"]]
        source = self._token_sources.setdefault(
            auth["issuer"], tokens.TokenSource(issuer["url"], self.attestation))
        eks = envelope.ephemeral()
        enc = envelope.ephemeral_enc(eks)
        ref = envelope.assignment_ref(assignment["assignment_id"])
        seeds = None
        if policy.get("masking") is not None:
            if values is None:
                raise DeviceError("a masked task's token needs the model's size")
            line = policy["masking"]
            n, t = len(line["services"]), line["threshold"]
            context = masking.context(assignment["task_id"], assignment["round"], ref,
                                      policy_sha256(assignment["policy"]), values)
            drawn = masking.draw_seeds(n, t)
            sealed = masking.seal_seeds(n, t, drawn, self._masking_keys(policy), context)
            seeds = {"seeds": drawn, "sealed": sealed, "context": context, "values": values}
        token = tokens.obtain(source, auth["issuer"], source.key_for(auth["token_keys"]),
                              assignment["task_id"], assignment["round"], ref, enc,
                              nonce=None if seeds is None else masking.masked_nonce(
                                  enc, seeds["sealed"]))
        return eks, token, seeds

    def upload(self, assignment: dict, sealed: bytes) -> None:
        """Uploads a sealed update, the same bytes on every attempt (docs/protocol.md, "What a
        device does with each"): 503/507 again after `Retry-After`, 422 again after
        `key_retry_wait` (a replica behind on the key set), then gives up. A refusal is
        reported `failed` (freeing the slot), except 410: an expired assignment holds none."""
        headers = assignment.get("upload_headers") or {"content-type": "application/cbor"}
        for attempt in range(1, self.attempts + 1):
            reply = self._send("PUT", self._url(assignment["upload_url"]), data=sealed,
                               headers=headers, timeout=120)
            if reply.status_code != 422 or attempt == self.attempts:
                break
            time.sleep(self.key_retry_wait)
        # A signed blob-store URL answers 412 when an earlier attempt (whose answer was lost)
        # already stored the object: it is stored.
        stored = reply.status_code in (200, 201) or (
            reply.status_code == 412 and not assignment["upload_url"].startswith("/"))
        if not stored:
            error = DeviceError.from_reply("upload", reply)
            if reply.status_code != 410:
                self._fail(assignment, error)
            raise error

    def run_once(self, train: Train, max_wait: float = 600.0,
                 only_round: int | None = None) -> str:
        """One check-in and what follows: "contributed", "declined" or a retry reason (after
        waiting inside the retry window, at most `max_wait` seconds). After an assignment that
        failed (raised), the next call first waits inside `after_failure`, at most `max_wait`.
        `only_round` (a simulation's sample of one round): an assignment to any other round is
        declined."""
        backoff = self._not_before - time.time()
        if backoff > 0:
            self.sleep(min(max_wait, backoff))
        answer = self.check_in()
        if "assignment_id" not in answer:
            window = answer["retry_window"]
            self.sleep(min(max_wait, random.uniform(window["min_seconds"], window["max_seconds"])))
            return answer["reason"]
        if (only_round is not None and answer["round"] != only_round) or self.declines(answer):
            declined = self.report(answer, "not_eligible")
            window = declined.get("retry_window")
            if window:
                self.sleep(min(max_wait, random.uniform(window["min_seconds"],
                                                        window["max_seconds"])))
            return "declined"
        try:
            self.contribute(answer, train)
        except Exception as error:
            # 410: the round closed under the device (others reached its goal): not a failure
            # that repeats.
            if not (isinstance(error, DeviceError) and error.status == 410):
                self._not_before = time.time() + random.uniform(*self.after_failure)
            raise
        return "contributed"
