"""A device keeps what only it knows across restarts (`Device.state_file`): the rounds it served
(one contribution per round, `min_separation` under DP-FTRL) and the on-demand evaluations it
granted. Without a state file it warns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from confed_client import Device, Partner, Trust
from confed_client.device import STATE_FORMAT


def test_a_restarted_device_remembers_the_round_it_served(server, tmp_path):
    partner = Partner(server["url"], server["token"])
    population = "python-restart"
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": 1, "report_goal": 2, "min_reports": 2,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}},
        {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    state = tmp_path / "device.json"
    device = Device(server["url"], population, trust, state_file=state)
    assert device.run_once(lambda w, plan: {"w": np.full(4, 0.1, np.float32)}) == "contributed"
    saved = json.loads(state.read_text())
    assert saved["format"] == STATE_FORMAT and saved["served"] == [[task, 1]]
    # The same device after a restart: a new object over the same file.
    restarted = Device(server["url"], population, trust, state_file=state)
    assert (task, 1) in restarted.served
    assignment = restarted.check_in()
    assert assignment["task_id"] == task and assignment["round"] == 1
    assert "already served" in restarted.declines(assignment)
    restarted.report(assignment, "not_eligible")


def policy_with_on_demand(allowed: int) -> dict:
    return {"evaluation": {"every": 0, "on_demand": allowed}}


def test_on_demand_evaluations_granted_survive_a_restart(tmp_path):
    trust = Trust(1, {}, {"max_epsilon": 10, "max_delta": 1e-5, "min_reports": 1})
    state = tmp_path / "device.json"
    device = Device("http://127.0.0.1:9", "p", trust, state_file=state)
    asked = {"task_id": "t1", "round": 3, "evaluate": True}
    assert device._evaluates(policy_with_on_demand(1), asked)
    restarted = Device("http://127.0.0.1:9", "p", trust, state_file=state)
    assert restarted.on_demand == {("t1", 3)}
    # The one on-demand evaluation the policy allows is spent, restart or not.
    assert not restarted._evaluates(policy_with_on_demand(1), dict(asked, round=5))
    assert restarted._evaluates(policy_with_on_demand(1), asked), "the same round again"


def test_a_device_without_a_state_file_warns(tmp_path):
    trust = Trust(1, {}, {"max_epsilon": 10, "max_delta": 1e-5, "min_reports": 1})
    with pytest.warns(UserWarning, match="memory only"):
        Device("http://127.0.0.1:9", "p", trust)
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a confed-device-state/v1 file"):
        Device("http://127.0.0.1:9", "p", trust, state_file=tmp_path / "bad.json")
    (tmp_path / "garbled.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        Device("http://127.0.0.1:9", "p", trust, state_file=tmp_path / "garbled.json")
    (tmp_path / "short.json").write_text('{"format": "confed-device-state/v1", "served": []}')
    with pytest.raises(ValueError, match="members"):
        Device("http://127.0.0.1:9", "p", trust, state_file=tmp_path / "short.json")


def test_an_on_demand_grant_that_cannot_be_kept_is_not_granted(tmp_path):
    trust = Trust(1, {}, {"max_epsilon": 10, "max_delta": 1e-5, "min_reports": 1})
    state = tmp_path / "device.json"
    device = Device("http://127.0.0.1:9", "p", trust, state_file=state)
    device.state_file = tmp_path / "no-such-directory" / "device.json"
    asked = {"task_id": "t1", "round": 3, "evaluate": True}
    assert not device._evaluates(policy_with_on_demand(1), asked)
    assert device.on_demand == set(), "forgotten, so asking again does not find it granted"


def test_drawn_send_instants_survive_a_restart_and_read_strictly(tmp_path):
    """The instants drawn for an assignment are kept before training (docs/protocol.md, "Upload
    window"); a file without pending sends leaves the member out, as the Rust client does."""
    import json

    trust = Trust(1, {}, {"max_epsilon": 10, "max_delta": 1e-5, "min_reports": 1})
    state = tmp_path / "device.json"
    device = Device("http://127.0.0.1:9", "p", trust, state_file=state)
    assert "sends" not in json.loads(state.read_text())
    assignment = {"assignment_id": "a1", "expires_at": 2_000_000_000}
    times = device._schedule(assignment, {"upload_window": (1000, 2000)}, 1_700_000_000_000)
    assert 1_700_000_001_000 <= times["send_ms"] <= 1_700_000_002_000
    restarted = Device("http://127.0.0.1:9", "p", trust, state_file=state)
    assert restarted._schedule(assignment, {"upload_window": (0, 0)}, 0) == times, "kept"
    saved = json.loads(state.read_text())
    ref = next(iter(saved["sends"]))
    saved["sends"][ref]["send_ms"] = 1.5
    state.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="three integers"):
        Device("http://127.0.0.1:9", "p", trust, state_file=state)
