"""An analytics task from Python against a real `confed serve`: `run_analytics` plays devices that
answer from their own records (the Python device library, byte-identical to Rust's answers),
the server's enclave worker releases each round's noised result, and every release verifies.
A device with no records declines the task instead of training."""

from __future__ import annotations

import pytest

from confed_client import Device, DeviceError, Partner, Trust, run_analytics

DEVICES = 30


def test_python_devices_discover_the_words_most_of_them_hold(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_analytics_task({
        "analytics": {"query": "open_histogram", "max_key_bytes": 16, "keys_per_device": 4},
        "population": "python-words", "rounds": 2, "report_goal": DEVICES,
        "privacy": {"epsilon": 8.0, "delta": 1e-6},
        "upload_window": {"start_ms": 200, "end_ms": 400},
    })
    assert partner.task(task)["state"] == "OPEN"

    def records(i: int, query: dict) -> list:
        assert query["query"] == "open_histogram"
        # Every device holds "common"; each also holds a word of its own, twice.
        return ["common", f"own-{i}", f"own-{i}"]

    history = run_analytics(partner, task, Trust.load(server["trust"]), records,
                            num_devices=DEVICES, seed=3)
    assert [r.round for r in history] == [1, 2]
    for result in history:
        assert result.included == DEVICES
        keys = dict(result.result["keys"])
        assert "common" in keys, result.result
        # Within 6 standard deviations of the round's count; no device's own word passes.
        assert abs(keys["common"] - DEVICES) <= 6 * result.result["noise_stddev"]
        assert not any(k.startswith("own-") for k in keys), keys
        assert result.verified, result
    assert partner.task(task)["state"] == "COMPLETED"


def test_a_device_without_records_declines_an_analytics_task(server):
    partner = Partner(server["url"], server["token"])
    partner.create_analytics_task({
        "analytics": {"query": "histogram", "domain_size": 10, "keys_per_device": 1},
        "population": "python-norecords", "rounds": 1, "report_goal": 5,
        "privacy": {"epsilon": 8.0, "delta": 1e-6},
    })
    device = Device(server["url"], "python-norecords", Trust.load(server["trust"]))
    assignment = device.check_in()
    assert "assignment_id" in assignment, assignment
    with pytest.raises(DeviceError, match="no records"):
        device.contribute(assignment, lambda weights, plan: weights)
