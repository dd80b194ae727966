"""The enclave's privacy accounting, checked against an independent accountant: Google's
`dp-accounting` package (RDP accountant, PyPI). For a grid of budgets, `confed privacy plan`
(the enclave's own OpenDP calibration and zCDP accounting) gives the per-round noise multiplier
and the epsilon spent after each round; dp-accounting composes the same Gaussian mechanism
(sensitivity one clip norm, standard deviation noise_multiplier clip norms, one release per
round) and converts to (epsilon, delta) with its own code. They must agree within 1 %.

Why they may differ at all: OpenDP converts the composed zCDP rho to (epsilon, delta) exactly
(Canonne, Kamath, Steinke 2020); dp-accounting minimises the same conversion over a finite list
of Renyi orders, so it can only be slightly larger."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("CONFED_BIN", str(ROOT / "target" / "debug" / "confed"))
# Dense Renyi orders, so the minimisation's grid costs far less than the 1 % tolerance.
ORDERS = np.concatenate([np.linspace(1.01, 10, 900), np.linspace(10.1, 1000, 2000)])

GRID = [(epsilon, delta, rounds)
        for epsilon in (0.5, 1.0, 4.0, 8.0)
        for delta in (1e-5, 1e-7)
        for rounds in (1, 10, 100)]


def plan(epsilon: float, delta: float, rounds: int) -> dict:
    run = subprocess.run([BINARY, "privacy", "plan", "--epsilon", str(epsilon), "--delta",
                          str(delta), "--rounds", str(rounds)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout)


def independent_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier), rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("epsilon,delta,rounds", GRID)
def test_epsilon_spent_agrees_with_dp_accounting_within_one_percent(epsilon, delta, rounds):
    got = plan(epsilon, delta, rounds)
    assert len(got["epsilon_spent"]) == rounds
    # The whole plan spends the budget (calibration is tight), never more.
    assert got["epsilon_spent"][-1] <= epsilon
    assert got["epsilon_spent"][-1] >= 0.999 * epsilon
    for k in sorted({1, max(1, rounds // 2), rounds}):
        ours = got["epsilon_spent"][k - 1]
        theirs = independent_epsilon(got["noise_multiplier"], k, delta)
        assert abs(ours - theirs) <= 0.01 * theirs, (k, ours, theirs)


@pytest.mark.parametrize("rounds", (1, 10, 100))
def test_rho_per_round_is_the_gaussian_mechanisms(rounds):
    # zCDP of the Gaussian mechanism with sensitivity 1 and standard deviation z: 1 / (2 z^2).
    got = plan(4.0, 1e-6, rounds)
    expected = 1 / (2 * got["noise_multiplier"] ** 2)
    assert abs(got["rho_per_round"] - expected) <= 1e-9 * expected
