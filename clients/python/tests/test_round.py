"""A whole round against a real `confed serve`: a partner's task, Python devices, the release."""

from __future__ import annotations

import json

import numpy as np
import pytest

from confed_client import (Device, DeviceError, Partner, ReleaseError, TaskEnded, Trust,
                           verify_release)

DEVICES = 10


def spec(population: str) -> dict:
    return {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": 1, "report_goal": DEVICES,
            "min_reports": DEVICES,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
            "plan": {"epochs": 1, "batch_size": 16, "learning_rate": 0.1}}


def test_python_devices_complete_a_round_and_the_release_is_their_clipped_mean(server):
    partner = Partner(server["url"], server["token"])
    model = {"w": np.zeros(16, dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}
    task = partner.create_task(spec("python-devices"), model)
    trust = Trust.load(server["trust"])
    updates = []
    for index in range(DEVICES):
        device = Device(server["url"], "python-devices", trust)
        # Device `index` moves every weight by 0.01 * (index + 1); the last one's update is
        # above the clip norm (1.0) and is scaled down to it.
        step = 0.01 * (index + 1) if index < DEVICES - 1 else 1.0
        update = {"w": np.full(16, step, np.float32), "b": np.full(2, -step, np.float32)}
        norm = float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in update.values())))
        updates.append({k: v * min(1.0, 1.0 / norm) for k, v in update.items()})
        assert device.run_once(lambda weights, plan, u=update: u) == "contributed"
    release = partner.wait_for_release(task, 1)
    assert release["included"] == DEVICES and release["excluded"] == 0
    manifest = release["manifest"]
    manifest = json.loads(manifest) if isinstance(manifest, str) else manifest
    stddev = manifest["noise"]["stddev_average"]
    average = partner.average(task, 1)
    for name in ("w", "b"):
        clipped_mean = np.mean([u[name] for u in updates], axis=0)
        assert np.all(np.abs(average[name] - clipped_mean) <= 6 * stddev + 1e-6), name
    # The release is committed before model version 1 (the round's APPLYING step).
    assert partner.wait_for_state(task, "COMPLETED")["model_version"] == 1
    # Model version 1 is version 0 plus the server learning rate (1) times the average.
    new = partner.model(task, 1)
    assert np.allclose(new["w"], average["w"], atol=1e-6)


def test_a_device_that_served_a_round_declines_it_and_is_told_to_wait(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        dict(spec("python-decline"), report_goal=2, min_reports=2,
             privacy={"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}),
        {"w": np.zeros(4, np.float32)})
    device = Device(server["url"], "python-decline", Trust.load(server["trust"]))
    assert device.run_once(lambda w, plan: {"w": np.full(4, 0.1, np.float32)}) == "contributed"
    # A Gaussian task: the device does not say what it served (that would link its check-ins),
    # so the server offers the round again, and the device declines it.
    assignment = device.check_in()
    assert assignment["task_id"] == task
    assert device.declines(assignment)
    declined = device.report(assignment, "not_eligible")
    assert declined["state"] == "REJECTED"
    assert declined["retry_window"] == {"min_seconds": 60, "max_seconds": 120}


def test_a_key_not_signed_by_enough_trusted_services_is_refused(server):
    partner = Partner(server["url"], server["token"])
    partner.create_task(spec("python-trust"), {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    device = Device(server["url"], "python-trust",
                    Trust(len(trust.keyservices) + 1, trust.keyservices, trust.limits))
    assignment = device.check_in()
    with pytest.raises(DeviceError, match="requires"):
        device.contribute(assignment, lambda w, plan: w)
    assert device.check_in()["task_id"] == assignment["task_id"], "the slot was freed (failed)"


def test_a_device_never_seals_twice_for_a_round_it_served():
    device = Device("http://127.0.0.1:9", "p", Trust(1, {}, {}))
    device.served.add(("task", 3))
    with pytest.raises(DeviceError, match="already served"):
        device.contribute({"task_id": "task", "round": 3}, lambda w, plan: w)


def test_a_release_verifies_and_a_tampered_one_does_not(server):
    partner = Partner(server["url"], server["token"])
    population = "python-verify"
    task = partner.create_task(dict(spec(population), report_goal=2, min_reports=2,
                                    privacy={"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}),
                               {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    for _ in range(2):
        device = Device(server["url"], population, trust)
        assert device.run_once(lambda w, plan: {"w": np.full(4, 0.1, np.float32)}) == "contributed"
    partner.wait_for_release(task, 1)
    passed = partner.verify_release(task, 1, trust)
    assert any("receipts needed" in line for line in passed), passed
    # The same checks on tampered inputs.
    base = f"/v1/tasks/{task}/releases/1"
    manifest = partner._call("GET", f"{base}/manifest").content
    average = partner._call("GET", f"{base}/average").content
    proof = next(r for r in partner.releases(task) if r["round"] == 1)["proof"]
    with pytest.raises(ReleaseError, match="average hashes"):
        verify_release(manifest, average + b"\0", proof, trust.keyservices, trust.threshold)
    forged = json.loads(json.dumps(proof))
    for receipt in forged["receipts"]:
        receipt["at"] += 1  # no longer what the key service signed
    with pytest.raises(ReleaseError, match="receipts needed"):
        verify_release(manifest, average, forged, trust.keyservices, trust.threshold)
    with pytest.raises(ReleaseError, match="the task's policy"):
        verify_release(manifest, average, proof, trust.keyservices, trust.threshold,
                       policy_text="another policy\n")
    untrusted = {name: key for name, key in list(trust.keyservices.items())[:1]}
    with pytest.raises(ReleaseError, match="receipts needed"):
        verify_release(manifest, average, proof, untrusted, 1)
    # t and n come from the trust file alone: receipts that state another key set (as t
    # colluding key services whose share files say n = t would) are a failed check.
    assert trust.n == len(trust.keyservices) == proof["receipts"][0]["shares"]
    with pytest.raises(ReleaseError, match=f"the trust file pins {trust.threshold} of "
                                           f"{trust.n + 1}"):
        verify_release(manifest, average, proof, trust.keyservices, trust.threshold,
                       shares=trust.n + 1)
    two = dict(list(trust.keyservices.items())[:2])
    with pytest.raises(ReleaseError, match="states threshold 2 of 3 shares; the trust file pins "
                                           "2 of 2"):
        partner.verify_release(task, 1, Trust(trust.threshold, two, trust.limits, shares=2))
    # A trust whose n is below the key services it lists would lower the quorum: refused.
    with pytest.raises(ValueError, match="at least the key services"):
        verify_release(manifest, average, proof, trust.keyservices, trust.threshold, shares=2)


def test_watch_follows_a_task_to_its_end(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(dict(spec("python-watch"), report_goal=2, min_reports=2),
                               {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    for _ in range(2):
        assert Device(server["url"], "python-watch", trust).run_once(
            lambda w, plan: {"w": np.full(4, 0.1, np.float32)}) == "contributed"
    assert partner.watch(task, progress=False, timeout=120)["state"] == "COMPLETED"
    cancelled = partner.create_task(spec("python-watch-cancel"), {"w": np.zeros(4, np.float32)})
    partner._call("POST", f"/v1/tasks/{cancelled}/cancel")
    with pytest.raises(TaskEnded, match="CANCELLED: cancelled by partner"):
        partner.watch(cancelled, progress=False, timeout=10)
