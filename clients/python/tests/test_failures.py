"""Failures reach the partner at once, with the server's reason: a cancelled or failed task
raises `TaskEnded`, a simulated device whose function returns the wrong tensors raises
`SimulationError`, instead of waiting out a round timeout and returning nothing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from confed_client import Partner, SimulationError, TaskEnded, Trust, run_simulation


def spec(population: str, devices: int) -> dict:
    return {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": 2, "report_goal": devices,
            "min_reports": devices,
            "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}}


def test_a_cancelled_task_raises_task_ended_with_the_reason(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(spec("python-ended", 2), {"w": np.zeros(4, np.float32)})
    partner._call("POST", f"/v1/tasks/{task}/cancel")
    with pytest.raises(TaskEnded) as ended:
        partner.watch(task, progress=False, timeout=10)
    assert ended.value.state == "CANCELLED"
    assert ended.value.reason == "cancelled by partner"
    assert "cancelled by partner" in str(ended.value)
    started = time.monotonic()
    with pytest.raises(TaskEnded):
        partner.wait_for_state(task, "COMPLETED", timeout=60)
    with pytest.raises(TaskEnded):
        partner.wait_for_model(task, 1, timeout=60)
    assert time.monotonic() - started < 10, "raised at once, not at the timeout"
    rounds = partner._call("GET", f"/v1/tasks/{task}/rounds").json()["rounds"]
    assert rounds[0]["state"] == "FAILED" and rounds[0]["failure_reason"] == "task cancelled"


def test_run_simulation_raises_when_the_task_is_cancelled_midway(server):
    partner = Partner(server["url"], server["token"])
    # More devices a round than the simulation has: round 1 never fills, so only the cancel
    # can end it; the simulation must say so at once, not after round_timeout.
    task = partner.create_task(spec("python-sim-cancel", 5), {"w": np.zeros(4, np.float32)})
    timer = threading.Timer(1.0, lambda: partner._call("POST", f"/v1/tasks/{task}/cancel"))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(TaskEnded) as ended:
            run_simulation(partner, task, Trust.load(server["trust"]),
                           lambda i: (lambda w, plan: {"w": np.full(4, 0.1, np.float32)}),
                           num_devices=2, progress=False, round_timeout=120)
    finally:
        timer.cancel()
    assert ended.value.reason == "cancelled by partner"
    assert time.monotonic() - started < 30


def test_run_simulation_stops_at_a_train_function_with_the_wrong_tensors(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(spec("python-sim-wrong", 2), {"w": np.zeros(4, np.float32)})
    started = time.monotonic()
    with pytest.raises(SimulationError) as wrong:
        run_simulation(partner, task, Trust.load(server["trust"]),
                       lambda i: (lambda w, plan: {"weights": np.zeros(3, np.float32)}),
                       num_devices=2, progress=False, round_timeout=120)
    assert time.monotonic() - started < 30
    assert wrong.value.training_problem.kind == "wrong_tensors"
    message = str(wrong.value)
    assert "('weights', (3,))" in message and "('w', (4,))" in message, message
    partner._call("POST", f"/v1/tasks/{task}/cancel")
