"""DP-FTRL from a Python device's side (docs/protocol.md, "Task policy"; docs/privacy.md,
"DP-FTRL"): the policy names the tree, a device keeps its rounds of the task `min_separation`
apart (declining closer ones, whatever the server assigns), and the releases of a tree verify and
sum to the tree's running sum."""

from __future__ import annotations

import json

import numpy as np
import pytest

from confed_client import Device, DeviceError, Partner, PolicyError, Trust, parse_policy


def test_the_policy_names_the_tree_and_unknown_mechanisms_are_refused():
    from confed_client.policy import adaptive_clipping, min_separation
    assert min_separation("discrete_gaussian_on_grid") == 1
    assert min_separation("tree_aggregation_on_grid;min_separation=16") == 16
    adaptive = ";adaptive_clipping=5e-1,2e-1,5e0"
    assert min_separation("tree_aggregation_on_grid;min_separation=16" + adaptive) == 16
    assert adaptive_clipping("discrete_gaussian_on_grid" + adaptive) == {
        "target_quantile": 0.5, "learning_rate": 0.2, "count_stddev": 5.0}
    assert adaptive_clipping("discrete_gaussian_on_grid") is None
    for bad in ("tree_aggregation_on_grid", "tree_aggregation_on_grid;min_separation=0",
                "tree_aggregation_on_grid;min_separation=016",
                "tree_aggregation_on_grid;min_separation=1025", "laplace",
                "discrete_gaussian_on_grid;adaptive_clipping=0.5,2e-1,5e0",
                "discrete_gaussian_on_grid;adaptive_clipping=1e0,2e-1,5e0",
                "discrete_gaussian_on_grid;adaptive_clipping=5e-1,2e-1"):
        with pytest.raises(PolicyError):
            adaptive_clipping(bad)


def test_a_device_serves_a_tree_task_only_min_separation_rounds_apart(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": "python-ftrl", "rounds": 3, "report_goal": 1, "min_reports": 1,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0,
                     "mechanism": "tree_aggregation", "min_separation": 2}},
        {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    first = Device(server["url"], "python-ftrl", trust)
    second = Device(server["url"], "python-ftrl", trust)
    step = lambda w, plan: {"w": np.full(4, 0.1, np.float32)}  # noqa: E731

    assert first.run_once(step) == "contributed"
    partner.wait_for_model(task, 1)
    # Round 2 is one round after the first device's: told so, the server does not assign it...
    answer = first.check_in()
    assert answer.get("reason") == "min_separation", answer
    # ...and assigned it anyway (by a server that ignores `served`, here a device that does not
    # send it), the device declines, and refuses to seal if pushed.
    assignment = Device(server["url"], "python-ftrl", trust).check_in()
    assert (assignment["task_id"], assignment["round"]) == (task, 2)
    policy = parse_policy(assignment["policy"])
    assert policy["mechanism"] == "tree_aggregation_on_grid;min_separation=2"
    assert "at least 2 apart" in first.declines(assignment)
    with pytest.raises(DeviceError, match="at least 2 apart"):
        first.contribute(assignment, step)
    # The second device serves round 2; the first serves round 3, two rounds after its first.
    assert second.run_once(step) == "contributed"
    partner.wait_for_model(task, 2)
    assert first.run_once(step) == "contributed"
    partner.wait_for_state(task, "COMPLETED")

    manifests = []
    for round_ in (1, 2, 3):
        release = partner.wait_for_release(task, round_)
        manifest = release["manifest"]
        manifests.append(json.loads(manifest) if isinstance(manifest, str) else manifest)
        assert partner.verify_release(task, round_, trust), "raises when a check fails"
    trees = [(m["noise"]["tree"]["tree"], m["noise"]["tree"]["position"]) for m in manifests]
    assert trees == [(0, 1), (0, 2), (1, 1)], "trees of 2 rounds: round 3 starts the second"
    # Every round was released under one key per tree (the key services pin it).
    assert manifests[0]["key_id"] == manifests[1]["key_id"]


def test_a_blt_policy_parses_and_out_of_range_parameters_are_refused():
    from confed_client.policy import min_separation
    good = ("blt_on_grid;min_separation=100;buffers=9.375e-1:2.5e-1,5e-1:1.25e-1;"
            "max_values=16777216;lattice_bits=12")
    assert min_separation(good) == 100
    assert min_separation(good + ";adaptive_clipping=5e-1,2e-1,5e0") == 100
    assert min_separation("blt_on_grid;min_separation=3;buffers=;max_values=1;lattice_bits=0") == 3
    pairs = "9.375e-1:2.5e-1,5e-1:1.25e-1"
    for bad in (good.replace("=100;", "=10001;"),
                good.replace(pairs, "5e-1:1.25e-1,9.375e-1:2.5e-1"),  # not decreasing
                good.replace(pairs, "5e-1:5e-1"),  # sum(scale / decay) >= 1
                good.replace("9.375e-1:2.5e-1", "9.375e-1:0e0"),  # a scale not positive
                good.replace("9.375e-1", "9e-1"),  # not a multiple of 2^-52
                good.replace("16777216", "4294967297"),
                good.replace("lattice_bits=12", "lattice_bits=15"),
                "blt_on_grid;min_separation=100"):
        with pytest.raises(PolicyError):
            min_separation(bad)


def test_a_blt_task_runs_round_after_round_and_its_releases_chain_their_state(server):
    """DP-FTRL with BLT noise from a Python device's side: the server resolves the matrix, the
    policy names it, every release verifies, and each names the sealed state the one before left."""
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": "python-blt", "rounds": 2, "report_goal": 1, "min_reports": 1,
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0,
                     "mechanism": "blt", "min_separation": 1}},
        {"w": np.zeros(4, np.float32)})
    trust = Trust.load(server["trust"])
    device = Device(server["url"], "python-blt", trust)
    step = lambda w, plan: {"w": np.full(4, 0.1, np.float32)}  # noqa: E731
    assert device.run_once(step) == "contributed"
    partner.wait_for_model(task, 1)
    assert device.run_once(step) == "contributed"
    partner.wait_for_state(task, "COMPLETED")
    blts = []
    for round_ in (1, 2):
        release = partner.wait_for_release(task, round_)
        manifest = release["manifest"]
        manifest = json.loads(manifest) if isinstance(manifest, str) else manifest
        assert manifest["noise"]["mechanism"].startswith("blt_on_grid;min_separation=1;")
        blts.append(manifest["noise"]["blt"])
        lines = partner.verify_release(task, round_, trust)
        # The guarantee over the planned rounds first, then what this release alone carries.
        assert lines[0].startswith("noise: the accounting guarantees "), lines
        blt = manifest["noise"]["blt"]
        assert blt["accounted_stddev_sum"] <= manifest["noise"]["stddev_sum"]
        assert abs(blt["accounted_stddev_sum"] * blt["accounted_sensitivity"]
                   - blts[0]["accounted_stddev_sum"] * blts[0]["accounted_sensitivity"]) < 1e-9
    assert "state_in_blake3" not in blts[0]
    assert blts[1]["state_in_blake3"] == blts[0]["state_out_blake3"]
