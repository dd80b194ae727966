"""Server optimizers (FedAvgM, FedAdam, FedYogi) step for step against a reference written here in
NumPy from Reddi et al., "Adaptive Federated Optimization" (Algorithm 2) and Hsu et al. 2019:
each model version the server makes equals the reference's step from the previous version with
the round's released (noised) average, the moments kept between rounds."""

from __future__ import annotations

import numpy as np
import pytest

from confed_client import Device, Partner, PartnerError, Trust

ROUNDS, DEVICES, LR = 3, 3, 0.5


def reference(name: str, params: dict):
    """The optimizer as a function (x, delta, state) -> (x', state'), moments held in float32
    as the server stores them, each step computed in float64."""
    tau = params.get("tau", 1e-3)

    def step(x, delta, state):
        x, delta = x.astype(np.float64), delta.astype(np.float64)
        if name == "fedavgm":
            m = params.get("momentum", 0.9) * state["m"].astype(np.float64) + delta
            m = m.astype(np.float32)
            return (x + LR * m.astype(np.float64)).astype(np.float32), {"m": m}
        b1, b2 = params.get("beta1", 0.9), params.get("beta2", 0.99)
        m = (b1 * state["m"].astype(np.float64) + (1 - b1) * delta).astype(np.float32)
        v = state["v"].astype(np.float64)
        if name == "fedadam":
            v = b2 * v + (1 - b2) * delta ** 2
        else:  # fedyogi
            v = v - (1 - b2) * delta ** 2 * np.sign(v - delta ** 2)
        v = v.astype(np.float32)
        step_ = m.astype(np.float64) / (np.sqrt(np.maximum(v.astype(np.float64), 0)) + tau)
        return (x + LR * step_).astype(np.float32), {"m": m, "v": v}

    def initial(n):
        state = {"m": np.zeros(n, np.float32)}
        if name != "fedavgm":
            state["v"] = np.full(n, tau * tau, np.float32)
        return state

    return step, initial


@pytest.mark.parametrize("name,params", [
    ("fedavgm", {"momentum": 0.8}),
    ("fedadam", {"beta1": 0.9, "beta2": 0.99, "tau": 0.01}),
    ("fedyogi", {"tau": 0.001}),
])
def test_each_model_version_is_the_reference_step(server, name, params):
    partner = Partner(server["url"], server["token"])
    population = f"python-{name}"
    task = partner.create_task(
        {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": ROUNDS, "report_goal": DEVICES,
         "min_reports": DEVICES, "server_learning_rate": LR,
         "server_optimizer": {"name": name, **params},
         "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}},
        {"w": np.zeros(6, np.float32), "b": np.zeros(2, np.float32)})
    assert partner.task(task)["server_optimizer"]["name"] == name
    trust = Trust.load(server["trust"])
    rng = np.random.default_rng(11)
    step, initial = reference(name, params)
    state = initial(8)
    previous = partner.model(task, 0)
    for round_ in range(1, ROUNDS + 1):
        for _ in range(DEVICES):
            update = {"w": rng.normal(0, 0.1, 6).astype(np.float32),
                      "b": rng.normal(0, 0.1, 2).astype(np.float32)}
            assert Device(server["url"], population, trust).run_once(
                lambda weights, plan, u=update: u) == "contributed"
        model = partner.wait_for_model(task, round_)
        average = partner.average(task, round_)
        flat = lambda t: np.concatenate([t["b"], t["w"]])  # schema order: names sorted
        expected, state = step(flat(previous), flat(average), state)
        np.testing.assert_allclose(flat(model), expected, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{name} round {round_}")
        previous = model


def test_a_bad_optimizer_is_refused_naming_the_field(server):
    partner = Partner(server["url"], server["token"])
    for bad in ({"name": "fedavgm", "momentum": 1.0}, {"name": "sgd"}):
        with pytest.raises(PartnerError) as caught:
            partner.create_task(
                {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": "python-bad-optimizer", "rounds": 1, "report_goal": 2,
                 "server_optimizer": bad,
                 "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0}},
                {"w": np.zeros(2, np.float32)})
        assert caught.value.status == 400
        if bad["name"] == "fedavgm":  # a known optimizer with a bad value: the field is named
            assert [p["name"] for p in caught.value.problem["invalid_params"]] == [
                "server_optimizer"]
            assert "momentum" in caught.value.problem["invalid_params"][0]["reason"]
        else:  # an unknown optimizer: the body does not parse, and the detail says why
            assert "sgd" in caught.value.detail
