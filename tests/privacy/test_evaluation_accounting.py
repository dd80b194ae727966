"""Evaluation's accounting, checked against dp-accounting.

`confed privacy plan --evaluation EVERY,MAX_LOSS,MAX_EXAMPLES,STDDEV,ON_DEMAND [--min-separation B]` gives
the value noise left after the evaluations' share and the noise the enclave samples on each
metric sum. A device adds at most `[MAX_EXAMPLES]*3` (examples units) to the three sums of an
evaluation round: L2 sensitivity sqrt(3) MAX_EXAMPLES, so each evaluation is one Gaussian release
of noise multiplier STDDEV / (sqrt(3) MAX_EXAMPLES). A device is in every evaluation round
(Gaussian) or in one per tree that has an evaluation round (DP-FTRL: one round per tree), and
in at most ON_DEMAND on-demand evaluations (the device counts them), one per round outside the
schedule; under DP-FTRL never more than one per tree begun. Here
dp-accounting composes those with the value releases (and adaptive clipping's counts in one
case) and converts with its own code; they must agree within 1 %, and the plan must spend the
budget."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from test_accounting import BINARY, ORDERS
from test_tree_accounting import trees_through

DELTA = 1e-6
MAX_EXAMPLES = 50
STDDEV = 1000.0
# (epsilon, rounds, min_separation or None, every, on_demand, adaptive count_stddev or None)
GRID = [(epsilon, rounds, separation, every, on_demand, count)
        for epsilon in (4.0, 8.0)
        for rounds, separation, every, on_demand, count in (
            (10, None, 2, 0, None), (100, None, 10, 3, None), (30, None, 1, 0, 25.0),
            (64, 16, 4, 2, None), (100, 100, 7, 0, None), (30, 5, 3, 1, 25.0),
            (30, 5, 10, 0, None), (20, None, 0, 4, None))]


def plan(epsilon, rounds, separation, every, on_demand, count) -> dict:
    args = [BINARY, "privacy", "plan", "--epsilon", str(epsilon), "--delta", str(DELTA),
            "--rounds", str(rounds),
            "--evaluation", f"{every},10,{MAX_EXAMPLES},{STDDEV},{on_demand}"]
    if separation:
        args += ["--min-separation", str(separation)]
    if count:
        args += ["--adaptive-count-stddev", str(count)]
    return json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120,
                                     check=True).stdout)


def evaluations_through(round_: int, every: int, on_demand: int, separation: int | None) -> int:
    scheduled = list(range(1, round_ + 1, every)) if every else []
    asked = min(on_demand, round_ - len(scheduled))
    if separation is None:
        return len(scheduled) + asked
    # A device serves one round per tree: at most one evaluation per tree begun.
    trees_begun = (round_ - 1) // separation + 1
    return min(trees_begun, len({(r - 1) // separation for r in scheduled}) + asked)


def independent_epsilon(got: dict, round_: int, separation, every, on_demand) -> float:
    value_z = got["noise_multiplier"]
    if separation:
        trees = trees_through(round_, separation)
        events = [dp_event.SingleEpochTreeAggregationDpEvent(value_z, steps) for steps in trees]
        counts = len(trees)
        relation = rdp_privacy_accountant.NeighborRel.REPLACE_SPECIAL  # see test_tree_accounting
    else:
        events = [dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(value_z), round_)]
        counts = round_
        relation = rdp_privacy_accountant.NeighborRel.ADD_OR_REMOVE_ONE
    if "count_noise_scale" in got:
        events.append(dp_event.SelfComposedDpEvent(
            dp_event.GaussianDpEvent(got["count_noise_scale"]), counts))
    evaluation_z = got["evaluation_noise_stddev"] / (math.sqrt(3) * MAX_EXAMPLES)
    events.append(dp_event.SelfComposedDpEvent(
        dp_event.GaussianDpEvent(evaluation_z),
        evaluations_through(round_, every, on_demand, separation)))
    accountant = rdp_privacy_accountant.RdpAccountant(list(ORDERS), relation)
    accountant.compose(dp_event.ComposedDpEvent(events))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("epsilon,rounds,separation,every,on_demand,count", GRID)
def test_value_and_evaluation_noise_compose_to_the_budget_as_dp_accounting_says(
        epsilon, rounds, separation, every, on_demand, count):
    got = plan(epsilon, rounds, separation, every, on_demand, count)
    assert f";evaluation={every},1e1,{MAX_EXAMPLES},1e3,{on_demand}" in got["mechanism"]
    assert got["evaluation_noise_stddev"] >= STDDEV
    assert got["epsilon_spent"][-1] <= epsilon
    assert got["epsilon_spent"][-1] >= 0.99 * epsilon
    for r in sorted({1, 2, rounds // 2, rounds}):
        ours = got["epsilon_spent"][r - 1]
        theirs = independent_epsilon(got, r, separation, every, on_demand)
        assert abs(ours - theirs) <= 0.01 * theirs, (r, ours, theirs)


def test_evaluations_that_would_eat_the_budget_are_refused_saying_what_to_change():
    run = subprocess.run([BINARY, "privacy", "plan", "--epsilon", "2", "--delta", str(DELTA),
                          "--rounds", "100", "--evaluation", f"1,10,{MAX_EXAMPLES},50"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "evaluate less often" in run.stderr
