"""The overflow probe of issue 27 with Python devices, against a real `confed serve`: a tenant's
model overflows training exactly when a device's feature 0 exceeds theta. Whether the devices'
data lies below or above theta, the tenant and the operator see the same: zero updates sealed,
uploaded and reported `completed`, nothing excluded, the same manifests apart from noised values.
The devices alone know (`Device.problems`)."""

from __future__ import annotations

import json
import sqlite3
import threading

import numpy as np

from confed_client import Device, Partner, Trust, well_formed_update
from confed_client.device import draw_send_times, flush_subnormals

DEVICES = 4
CLASSES, FEATURES, ROWS = 3, 5, 20


def private_data(index: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + index)
    x = rng.normal(0.5, 1.0, size=(ROWS, FEATURES)).astype(np.float32)
    x[0, 0] = 2.0  # every device has a row with feature 0 at 2.0; none above 3.0
    x[:, 0] = np.minimum(x[:, 0], 2.0)
    return x, rng.integers(0, CLASSES, size=ROWS)


def probe_model(theta: float) -> dict[str, np.ndarray]:
    weight = np.zeros((CLASSES, FEATURES), np.float32)
    weight[0, 0] = 1e37
    bias = np.zeros(CLASSES, np.float32)
    bias[0] = np.float32(np.finfo(np.float32).max - np.float32(1e37) * np.float32(theta))
    assert np.isfinite(bias).all()
    return {"weight": weight, "bias": bias}


def trainer(index: int, raise_on_overflow: bool):
    """One epoch of softmax-regression SGD in float32 on the device's data. Half the devices'
    partner code raises on overflow (as `np.errstate(over="raise")` does); the others let the
    NaN through."""
    x, y = private_data(index)

    def train(weights: dict, plan: dict) -> dict:
        with np.errstate(all="ignore", over="raise" if raise_on_overflow else "ignore",
                         invalid="raise" if raise_on_overflow else "ignore"):
            w, b = weights["weight"].copy(), weights["bias"].copy()
            logits = x @ w.T + b
            logits = logits - logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(ROWS), y] -= 1.0
            lr = np.float32(plan["learning_rate"] / ROWS)
            new_w, new_b = w - lr * (p.T @ x), b - lr * p.sum(axis=0)
            return {"weight": new_w - w, "bias": new_b - b}

    return train


def loud(assignment: dict, problem) -> None:
    raise RuntimeError(f"a loud callback: {problem.kind}")


def probe(server: dict, population: str, theta: float) -> tuple[dict, list[Device]]:
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": 1, "report_goal": DEVICES,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
         "plan": {"epochs": 1, "batch_size": ROWS, "learning_rate": 0.1}},
        probe_model(theta))
    trust = Trust.load(server["trust"])
    devices = []
    for index in range(DEVICES):
        # Half the devices' problem callbacks raise: that must change nothing the server sees.
        device = Device(server["url"], population, trust,
                        on_problem=loud if index % 2 == 0 else (lambda a, p: None))
        assert device.run_once(trainer(index, index % 2 == 1)) == "contributed"
        devices.append(device)
    release = partner.wait_for_release(task, 1)
    partner.wait_for_state(task, "COMPLETED")
    manifest = release["manifest"]
    manifest = json.loads(manifest) if isinstance(manifest, str) else manifest
    for per_run in ("task_id", "policy_sha256", "model_sha256", "included_digest",
                    "inputs_digest", "average_sha256"):
        manifest.pop(per_run)
    rounds = [{k: v for k, v in r.items() if k not in ("deadline", "opened_at", "closed_at")}
              for r in partner._call("GET", f"/v1/tasks/{task}/rounds").json()["rounds"]]
    view = {k: v for k, v in partner.task(task).items()
            if k not in ("id", "population", "policy", "policy_sha256", "created_at",
                         "updated_at", "recent_eligible_checkins", "recent_eligible_devices")}
    with sqlite3.connect(f"file:{server['data']}/confed.db?mode=ro", uri=True) as db:
        states = sorted(db.execute(
            "SELECT a.state, COUNT(*) FROM assignments a JOIN rounds r ON a.round_id = r.id "
            "WHERE r.task_id = ? GROUP BY a.state", (task,)).fetchall())
        reasons = sorted(db.execute(
            "SELECT COALESCE(h.from_state, '') || ' -> ' || h.to_state || ': ' || h.reason, "
            "COUNT(*) FROM state_history h JOIN assignments a ON h.entity_id = a.id "
            "JOIN rounds r ON a.round_id = r.id WHERE r.task_id = ? GROUP BY 1",
            (task,)).fetchall())
    seen = {"manifest": manifest,
            "release": {k: release[k] for k in ("round", "included", "excluded",
                                                 "epsilon_spent")},
            "rounds": rounds, "task": view, "states": states, "reasons": reasons}
    return seen, devices


def test_the_overflow_probe_reads_the_same_whichever_side_of_theta_the_data_lies(server):
    below, below_devices = probe(server, "py-probe-below", 1.0)
    above, above_devices = probe(server, "py-probe-above", 3.0)
    # The probe did what it is meant to: every device's training overflowed below theta (half
    # raised, half gave NaNs), none above; only the devices know.
    kinds = [[p.kind for (_, _, p) in d.problems] for d in below_devices]
    assert kinds == [["non_finite"], ["training_failed"]] * (DEVICES // 2), kinds
    assert all(not d.problems for d in above_devices)
    assert below["manifest"]["included"] == DEVICES and below["manifest"]["excluded"] == {}
    assert below["states"] == [("COMPLETED", DEVICES)]
    assert below == above


def test_slow_or_fast_training_is_sent_at_each_devices_drawn_instant(server):
    """Issue 45's amplifier, as its effect: training that is slow on one side of theta (here it
    outlasts the whole upload window) and fast on the other. Every device seals at the instant
    it drew before training, and each assignment's created -> completed time the operator
    records is one of those instants plus the round trip, on both sides."""
    window = (300, 900)
    for population, slow in (("py-time-slow", True), ("py-time-fast", False)):
        partner = Partner(server["url"], server["token"])
        task = partner.create_task(
            {"upload_window": {"start_ms": window[0], "end_ms": window[1]},
             "population": population, "rounds": 1, "report_goal": DEVICES,
             "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
             "plan": {"epochs": 1, "batch_size": ROWS, "learning_rate": 0.1}},
            probe_model(10.0))
        trust = Trust.load(server["trust"])
        released = threading.Event()
        devices = []
        for index in range(DEVICES):
            fast = trainer(index, False)

            def train(weights, plan, fast=fast):
                if slow:  # the device's workload, slower than the window: it is sent as zeros
                    released.wait(timeout=30)
                return fast(weights, plan)

            device = Device(server["url"], population, trust, on_problem=lambda a, p: None)
            assert device.run_once(train) == "contributed"
            devices.append(device)
        released.set()
        partner.wait_for_release(task, 1)
        kinds = [[p.kind for (_, _, p) in d.problems] for d in devices]
        assert kinds == ([["late"]] * DEVICES if slow else [[]] * DEVICES), kinds
        drawn = sorted(s["send_ms"] - s["received_ms"] for d in devices for s in d.sent)
        assert len(drawn) == DEVICES and all(window[0] <= t <= window[1] for t in drawn), drawn
        for d in devices:
            for s in d.sent:
                assert 0 <= s["sealed_ms"] - s["send_ms"] < 300, s
        with sqlite3.connect(f"file:{server['data']}/confed.db?mode=ro", uri=True) as db:
            recorded = sorted(t for (t,) in db.execute(
                "SELECT a.updated_at - a.created_at FROM assignments a JOIN rounds r "
                "ON a.round_id = r.id WHERE r.task_id = ? AND a.state = 'COMPLETED'", (task,)))
        assert len(recorded) == DEVICES
        assert all(0 <= r - t < 300 for r, t in zip(recorded, drawn)), (drawn, recorded)


def test_send_instants_follow_the_documented_rule():
    times = draw_send_times(1_000_000, (10_000, 20_000), 1_600_000, 0.5, 0.5)
    assert times == {"received_ms": 1_000_000, "token_ms": 1_007_500, "send_ms": 1_015_000}
    # An assignment expiring inside the window: 2 s before its expiry.
    assert draw_send_times(1_000_000, (10_000, 20_000), 1_012_000, 0.9, 0.0)["send_ms"] == 1_010_000
    # Already expired: now.
    assert draw_send_times(1_000_000, (10_000, 20_000), 0, 0.9, 0.9) == {
        "received_ms": 1_000_000, "token_ms": 1_000_000, "send_ms": 1_000_000}


def test_subnormal_weights_reach_training_as_zero():
    model = {"w": np.array([1e-40, -1e-40, 0.5, np.finfo(np.float32).tiny], np.float32)}
    flushed = flush_subnormals(model)["w"]
    assert flushed.tolist() == [0.0, 0.0, 0.5, float(np.finfo(np.float32).tiny)]
    assert np.signbit(flushed[1]) and flushed.dtype == np.float32


def test_whatever_training_does_the_update_has_the_models_shape():
    model = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
    good = {"w": np.full((2, 3), 0.5), "b": np.zeros(2)}
    update, problems = well_formed_update(model, lambda: good, lambda: (1.0, 2.0, 3.0))
    assert problems == [] and np.allclose(update["w"], 0.5)
    assert update["confed.evaluation"].tolist() == [1.0, 2.0, 3.0]

    def raises():
        raise RuntimeError("too few examples")

    cases = {
        "training_failed": raises,
        "wrong_tensors": lambda: {"w": np.zeros((3, 2)), "b": np.zeros(2)},
        "non_finite": lambda: {"w": np.full((2, 3), np.inf), "b": np.zeros(2)},
    }
    for kind, train in cases.items():
        update, problems = well_formed_update(model, train, lambda: (np.nan, 1.0, 1.0))
        assert [p.kind for p in problems] == ["evaluation_non_finite", kind]
        assert sorted(update) == ["b", "confed.evaluation", "w"]
        assert all(not v.any() for v in update.values()), kind
        assert update["w"].shape == (2, 3) and update["w"].dtype == np.float32
