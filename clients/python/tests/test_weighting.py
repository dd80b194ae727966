"""Example-weighted averaging with Python devices, against a real `confed serve`: a task with
`privacy.weighting` has each device send `(update, num_examples)`, and the release is the
bounded weighted average, computed here independently, plus the stated noise (docs/privacy.md,
"Weighted averaging")."""

from __future__ import annotations

import json

import numpy as np

from confed_client import Device, Partner, Trust, well_formed_update
from confed_client.policy import EXAMPLES_TENSOR, weighting
from confed_client.tensors import to_safetensors

MAX_EXAMPLES = 10
CLIP = 1.0
# (update, examples): two groups that pull the average apart, one with many examples (one above
# the cap, one clipped), one with few.
DEVICES = [
    ([0.9, 0.0, 0.0], 10), ([0.6, 0.0, 0.0], 40), ([3.0, 0.0, 0.0], 10),
    ([0.0, 0.8, 0.0], 1), ([0.0, 0.8, 0.0], 2), ([0.0, 0.8, 0.0], 0),
]


def expected_average() -> np.ndarray:
    """Each update clipped to the clip norm, times min(examples, max) / max, summed, divided by
    the number of devices."""
    total = np.zeros(3)
    for values, examples in DEVICES:
        update = np.array(values, np.float64)
        update *= min(1.0, CLIP / np.linalg.norm(update))
        total += update * min(examples, MAX_EXAMPLES) / MAX_EXAMPLES
    return total / len(DEVICES)


def test_a_weighted_round_releases_the_bounded_weighted_average_within_its_noise(server):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(
        {"upload_window": {"start_ms": 100, "end_ms": 300}, "population": "py-weighting",
         "rounds": 1, "report_goal": len(DEVICES),
         "privacy": {"epsilon": 100.0, "delta": 1e-6, "clip_norm": CLIP,
                     "weighting": {"by": "examples", "max_examples": MAX_EXAMPLES}}},
        {"w": np.zeros(3, np.float32)})
    assert partner.task(task)["privacy"]["weighting"] == {"by": "examples",
                                                          "max_examples": MAX_EXAMPLES}
    trust = Trust.load(server["trust"])
    for values, examples in DEVICES:
        device = Device(server["url"], "py-weighting", trust)

        def train(weights, plan, values=values, examples=examples):
            return {"w": np.array(values, np.float32)}, examples

        assert device.run_once(train) == "contributed"
        assert list(device.problems) == []
    partner.wait_for_release(task, 1)
    manifest = json.loads(partner._call(
        "GET", f"/v1/tasks/{task}/releases/1/manifest").content)
    stddev = manifest["noise"]["stddev_average"]
    released = partner.average(task, 1)["w"]
    expected = expected_average()
    assert np.all(np.abs(released - expected) <= 6 * stddev), (released, expected, stddev)
    # The uniform average of the same clipped updates is far outside the noise: the test would
    # fail if the counts were ignored.
    uniform = np.mean([np.array(v) * min(1.0, CLIP / np.linalg.norm(v)) for v, _ in DEVICES],
                      axis=0)
    assert np.abs(uniform[1] - expected[1]) > 20 * stddev, (uniform, expected, stddev)


def test_the_count_is_always_there_capped_and_zero_with_zeros_sent():
    model = {"w": np.ones(3, np.float32)}
    rule = {"max_examples": 50}
    cases = [
        (lambda: ({"w": np.full(3, 0.5)}, 12), [12.0], []),
        (lambda: ({"w": np.full(3, 0.5)}, 1e9), [50.0], []),
        (lambda: {"w": np.full(3, 0.5)}, [0.0], ["no_example_count"]),
        (lambda: ({"w": np.full(3, 0.5)}, -1), [0.0], ["no_example_count"]),
        (lambda: ({"w": np.full(3, 0.5)}, float("nan")), [0.0], ["no_example_count"]),
        (lambda: ({"w": np.full(3, 0.5)}, 10**400), [0.0], ["no_example_count"]),
        (lambda: ({"w": np.full(3, 0.5)}, "many"), [0.0], ["no_example_count"]),
        (lambda: ({"w": np.full(3, np.nan)}, 12), [0.0], ["non_finite"]),
    ]
    sizes = set()
    for train, count, kinds in cases:
        update, problems = well_formed_update(model, train, weighting=rule)
        assert sorted(update) == [EXAMPLES_TENSOR, "w"]
        assert update[EXAMPLES_TENSOR].dtype == np.float32
        assert update[EXAMPLES_TENSOR].tolist() == count, count
        assert [p.kind for p in problems] == kinds
        if kinds:
            assert update["w"].tolist() == [0.0] * 3
        sizes.add(len(to_safetensors(update)))
    assert len(sizes) == 1, "what the device sends is the same size whatever its count"
    # Without a weighting policy a (update, count) pair is taken, and no count is sent.
    update, problems = well_formed_update(model, lambda: ({"w": np.full(3, 0.5)}, 12))
    assert sorted(update) == ["w"] and problems == []


def test_the_policys_weighting_is_parsed_canonical_and_in_range():
    assert weighting("discrete_gaussian_on_grid;weighting=examples,64") == {"max_examples": 64}
    assert weighting("discrete_gaussian_on_grid;health=1e0;weighting=examples,1") == {
        "max_examples": 1}
    assert weighting("discrete_gaussian_on_grid") is None
    for bad in ["discrete_gaussian_on_grid;weighting=examples,0",
                "discrete_gaussian_on_grid;weighting=examples,064",
                "discrete_gaussian_on_grid;weighting=examples,10000000",
                "discrete_gaussian_on_grid;weighting=examples,64;health=1e0"]:
        try:
            weighting(bad)
        except Exception:  # noqa: BLE001 - PolicyError
            continue
        raise AssertionError(f"{bad} was accepted")
