"""The health signal's accounting, checked against dp-accounting.

`confed privacy plan --health-stddev S [--min-separation B]` gives the value noise multiplier
left after the health counts' share and the count noise the enclave samples (on the number of
devices that sent zeros: each device adds 0 or 1, sensitivity 1). dp-accounting composes, per
device, one Gaussian release of the value per round (or its tree events under DP-FTRL) and one
Gaussian count per round it can serve (every round; one per tree), and converts with its own
code. They must agree within 1 %, and the whole plan must spend the budget."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_accounting import BINARY
# The health count composes exactly as adaptive clipping's count does: one Gaussian of
# sensitivity 1 per round a device may serve (one per tree under DP-FTRL).
from test_adaptive_accounting import independent_epsilon

DELTA = 1e-6
GRID = [(epsilon, rounds, separation, stddev)
        for epsilon in (2.0, 8.0)
        for rounds, separation in ((10, None), (100, None), (64, 16))
        for stddev in (50.0, 200.0)]


def plan(epsilon, rounds, separation, stddev) -> dict:
    args = [BINARY, "privacy", "plan", "--epsilon", str(epsilon), "--delta", str(DELTA),
            "--rounds", str(rounds), "--health-stddev", str(stddev)]
    if separation:
        args += ["--min-separation", str(separation)]
    return json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120,
                                     check=True).stdout)


@pytest.mark.parametrize("epsilon,rounds,separation,stddev", GRID)
def test_value_and_health_noise_compose_to_the_budget_as_dp_accounting_says(
        epsilon, rounds, separation, stddev):
    got = plan(epsilon, rounds, separation, stddev)
    assert got["mechanism"].endswith(";health=" + ("5e1" if stddev == 50.0 else "2e2"))
    assert got["health_noise_stddev"] >= stddev
    assert got["epsilon_spent"][-1] <= epsilon
    assert got["epsilon_spent"][-1] >= 0.99 * epsilon
    for r in sorted({1, rounds // 2, rounds}):
        ours = got["epsilon_spent"][r - 1]
        theirs = independent_epsilon(got["noise_multiplier"], got["health_noise_stddev"], r,
                                     separation)
        assert abs(ours - theirs) <= 0.01 * theirs, (r, ours, theirs)


def test_health_counts_that_would_eat_the_budget_are_refused_naming_the_stddev():
    run = subprocess.run([BINARY, "privacy", "plan", "--epsilon", "2", "--delta", str(DELTA),
                          "--rounds", "100", "--health-stddev", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "health stddev" in run.stderr
