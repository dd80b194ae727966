"""Adaptive clipping's accounting, checked against dp-accounting.

`confed privacy plan --adaptive-count-stddev S [--min-separation B]` gives the value noise
multiplier left after the counts' share and the count noise the enclave samples (on
`sum(2 b_i - 1)`, sensitivity 1). dp-accounting composes, per device, one Gaussian release of the
value per round (or its tree events under DP-FTRL) and one Gaussian count per round it can serve
(every round; one per tree), and converts with its own code. They must agree within 1 %, and the
whole plan must spend the budget."""

from __future__ import annotations

import json
import subprocess

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from test_accounting import BINARY, ORDERS
from test_tree_accounting import trees_through

DELTA = 1e-6
GRID = [(epsilon, rounds, separation, count_stddev)
        for epsilon in (2.0, 8.0)
        for rounds, separation in ((10, None), (100, None), (64, 16), (100, 100))
        for count_stddev in (25.0, 50.0)]


def plan(epsilon, rounds, separation, count_stddev) -> dict:
    args = [BINARY, "privacy", "plan", "--epsilon", str(epsilon), "--delta", str(DELTA),
            "--rounds", str(rounds), "--adaptive-count-stddev", str(count_stddev)]
    if separation:
        args += ["--min-separation", str(separation)]
    return json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120,
                                     check=True).stdout)


def independent_epsilon(value_z, count_z, round_, separation) -> float:
    if separation:
        trees = trees_through(round_, separation)
        value = [dp_event.SingleEpochTreeAggregationDpEvent(value_z, steps) for steps in trees]
        counts = len(trees)
        relation = rdp_privacy_accountant.NeighborRel.REPLACE_SPECIAL  # see test_tree_accounting
    else:
        value = [dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(value_z), round_)]
        counts = round_
        relation = rdp_privacy_accountant.NeighborRel.ADD_OR_REMOVE_ONE
    events = value + [dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(count_z), counts)]
    accountant = rdp_privacy_accountant.RdpAccountant(list(ORDERS), relation)
    accountant.compose(dp_event.ComposedDpEvent(events))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("epsilon,rounds,separation,count_stddev", GRID)
def test_value_and_count_noise_compose_to_the_budget_as_dp_accounting_says(
        epsilon, rounds, separation, count_stddev):
    got = plan(epsilon, rounds, separation, count_stddev)
    assert ";adaptive_clipping=5e-1,2e-1," in got["mechanism"]
    assert got["count_noise_scale"] >= 2 * count_stddev
    assert got["epsilon_spent"][-1] <= epsilon
    assert got["epsilon_spent"][-1] >= 0.99 * epsilon
    for r in sorted({1, rounds // 2, rounds}):
        ours = got["epsilon_spent"][r - 1]
        theirs = independent_epsilon(got["noise_multiplier"], got["count_noise_scale"], r,
                                     separation)
        assert abs(ours - theirs) <= 0.01 * theirs, (r, ours, theirs)


def test_counts_that_would_eat_the_budget_are_refused_naming_count_stddev():
    run = subprocess.run([BINARY, "privacy", "plan", "--epsilon", "2", "--delta", str(DELTA),
                          "--rounds", "100", "--adaptive-count-stddev", "5"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "raise their noise" in run.stderr
