"""The noised health signal with Python devices, against a real `confed serve`: every update of
a task with `privacy.health` carries the device's "I sent zeros" flag, always in the same shape,
and each release states the round's count of them, noised (docs/privacy.md, "Health")."""

from __future__ import annotations

import numpy as np
import pytest

from confed_client import Device, Partner, Trust, well_formed_update
from confed_client.policy import HEALTH_TENSOR, PolicyError, health
from confed_client.tensors import to_safetensors

from test_side_channels import ROWS, probe_model, trainer

DEVICES = 4


def test_a_round_where_half_the_devices_fail_states_a_noised_count_near_half(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": "py-health",
         "rounds": 1, "report_goal": DEVICES,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0,
                     "health": {"stddev": 1.0}},
         "plan": {"epochs": 1, "batch_size": ROWS, "learning_rate": 0.1}},
        probe_model(10.0))
    trust = Trust.load(server["trust"])

    def failing(weights, plan):
        raise RuntimeError("the partner's training code failed on this device")

    devices = []
    for index in range(DEVICES):
        device = Device(server["url"], "py-health", trust, on_problem=lambda a, p: None)
        train = failing if index % 2 == 0 else trainer(index, False)
        assert device.run_once(train) == "contributed"
        devices.append(device)
    partner.wait_for_release(task, 1)
    kinds = [[p.kind for (_, _, p) in d.problems] for d in devices]
    assert kinds == [["training_failed"], []] * (DEVICES // 2), kinds
    [count] = partner.health(task)
    assert count["round"] == 1 and count["included"] == DEVICES
    assert 1.0 <= count["stddev"] < 1.01
    assert abs(count["zeroed"] - DEVICES // 2) <= 6 * count["stddev"], count
    lines = partner.verify_release(task, 1, trust)
    expected = f"health: {count['zeroed']} of {DEVICES} included devices sent zeros"
    assert any(line.startswith(expected) for line in lines), lines


def test_the_flag_is_always_there_under_a_health_policy_and_one_exactly_when_zeros_were_sent():
    model = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
    good = {"w": np.full((2, 3), 0.5), "b": np.zeros(2)}

    def raises():
        raise RuntimeError("too few examples")

    cases = [(lambda: good, 0.0), (raises, 1.0),
             (lambda: {"w": np.full((2, 3), np.nan), "b": np.zeros(2)}, 1.0)]
    sizes = set()
    for train, flag in cases:
        update, _ = well_formed_update(model, train, None, health=True)
        assert sorted(update) == ["b", HEALTH_TENSOR, "w"]
        assert update[HEALTH_TENSOR].dtype == np.float32
        assert update[HEALTH_TENSOR].tolist() == [flag]
        sizes.add(len(to_safetensors(update)))
    assert len(sizes) == 1, "what the device sends is the same size whatever the flag says"

    # A failed evaluation alone does not set it: the update is the trained one.
    update, problems = well_formed_update(model, lambda: good, lambda: (np.nan, 1.0, 1.0),
                                          health=True)
    assert [p.kind for p in problems] == ["evaluation_non_finite"]
    assert update[HEALTH_TENSOR].tolist() == [0.0]
    # Without a health policy there is no flag.
    assert HEALTH_TENSOR not in well_formed_update(model, raises)[0]


def test_the_policys_health_is_parsed_canonical_and_in_range():
    assert health("discrete_gaussian_on_grid;health=2.5e0") == {"stddev": 2.5}
    assert health("discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,0;health=1e0") == {
        "stddev": 1.0}
    assert health("discrete_gaussian_on_grid") is None
    for bad in ("discrete_gaussian_on_grid;health=5e-1", "discrete_gaussian_on_grid;health=2",
                "discrete_gaussian_on_grid;health=2e0;evaluation=3,1e1,50,2.5e1,0"):
        with pytest.raises(PolicyError):
            health(bad)
