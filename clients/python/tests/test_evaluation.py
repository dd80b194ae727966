"""Federated evaluation from a Python device's side (docs/protocol.md, "Evaluation"): the policy
names the schedule, a device adds its metrics of the downloaded model in evaluation rounds only,
and the partner reads the noised sums per model version, within their recorded noise."""

from __future__ import annotations

import numpy as np
import pytest

from confed_client import Device, Partner, PolicyError, Trust, parse_policy
from confed_client.policy import evaluates, evaluation


def test_the_policy_names_the_evaluation_rounds_and_refuses_a_malformed_one():
    text = "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,2"
    assert evaluation(text) == {"every": 3, "max_loss": 10.0, "max_examples": 50,
                                "stddev": 25.0, "on_demand": 2}
    assert evaluation("discrete_gaussian_on_grid") is None
    rounds = [r for r in range(1, 11) if evaluates({"evaluation": evaluation(text)}, r)]
    assert rounds == [1, 4, 7, 10]
    only_on_demand = evaluation("discrete_gaussian_on_grid;evaluation=0,1e1,50,2.5e1,1")
    assert not evaluates({"evaluation": only_on_demand}, 1)
    for bad in ("discrete_gaussian_on_grid;evaluation=0,1e1,50,2.5e1,0",
                "discrete_gaussian_on_grid;evaluation=3,10,50,2.5e1,0",
                "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1",
                "discrete_gaussian_on_grid;evaluation=3,1e1,50,5e-1,0",
                "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,1001",
                "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,01"):
        with pytest.raises(PolicyError):
            evaluation(bad)


def test_devices_evaluate_in_evaluation_rounds_and_the_partner_reads_the_noised_metrics(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": "python-eval", "rounds": 2, "report_goal": 4, "min_reports": 4,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
         "evaluation": {"every": 2, "max_loss": 5.0, "max_examples": 10, "stddev": 5.0}},
        {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    seen = []

    def evaluate(model):
        seen.append(model["w"].copy())
        return (6.0, 7.0, 10.0)  # mean loss 0.6, accuracy 0.7 on 10 examples

    devices = [Device(server["url"], "python-eval", trust, evaluate=evaluate) for _ in range(8)]
    step = lambda w, plan: {"w": np.full(4, 0.1, np.float32)}  # noqa: E731
    for round_ in (1, 2):
        for device in devices[4 * (round_ - 1):4 * round_]:
            assert device.run_once(step) == "contributed"
        partner.wait_for_model(task, round_)
    assert len(seen) == 4, "only round 1 evaluates (every 2)"
    assert all(np.array_equal(w, np.zeros(4)) for w in seen), "the downloaded model, untrained"

    listed = partner.evaluations(task)
    assert [p["model_version"] for p in listed["evaluations"]] == [0]
    point = listed["evaluations"][0]
    assert 5.0 <= point["stddev"] < 5.01
    for key, truth in (("examples", 40.0), ("correct", 28.0), ("loss_sum", 24.0)):
        scale = 5.0 if key == "loss_sum" else 1.0  # the loss sum's noise is in max_loss units
        assert abs(point[key] - truth) < 6 * point["stddev"] * scale, (key, point)
    assert listed["best_model_version"] == 0
    assert listed["evaluation"]["every"] == 2


def test_an_on_demand_evaluation_is_asked_for_and_each_device_grants_at_most_its_policys(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": "python-on-demand", "rounds": 3, "report_goal": 2, "min_reports": 2,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
         "evaluation": {"every": 0, "max_examples": 10, "stddev": 5.0, "on_demand": 1}},
        {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    step = lambda w, plan: {"w": np.full(4, 0.1, np.float32)}  # noqa: E731
    calls = []
    devices = [Device(server["url"], "python-on-demand", trust,
                      evaluate=lambda model: calls.append(1) or (4.0, 5.0, 10.0))
               for _ in range(2)]
    for device in devices:
        assert device.run_once(step) == "contributed"
    partner.wait_for_model(task, 1)
    assert not calls, "round 1 was not asked to evaluate"
    answer = partner.request_evaluation(task)
    assert (answer["used"], answer["allowed"]) == (0, 1)
    assert partner.request_evaluation(task)["used"] == 0, "idempotent while it waits"
    # Round 2 is already open: the request waits for round 3. The same two devices serve both.
    for device in devices:
        assert device.run_once(step) == "contributed"
    partner.wait_for_model(task, 2)
    assert not calls
    for device in devices:
        assignment = device.check_in()
        assert assignment["round"] == 3 and assignment["evaluate"] is True, assignment
        device.contribute(assignment, step)
    partner.wait_for_state(task, "COMPLETED")
    assert len(calls) == 2
    listed = partner.evaluations(task)["evaluations"]
    assert [(p["round"], p["model_version"]) for p in listed] == [(3, 2)]
    assert abs(listed[0]["examples"] - 20.0) < 6 * listed[0]["stddev"]
    # A device that granted its one on-demand evaluation grants no second one, whatever the
    # server says.
    again = dict(assignment, round=4)
    assert not devices[0]._evaluates(parse_policy(assignment["policy"]), again)
