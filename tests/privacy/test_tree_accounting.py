"""DP-FTRL's accounting (tree aggregation, restarts every `min_separation` rounds), checked
against dp-accounting's tree-aggregation accountant.

`confed privacy plan --min-separation B` gives the enclave's per-node noise multiplier and the
epsilon spent after each round. A device serves at most one round of each tree (its rounds are at
least B apart and a tree is B rounds long), so after round r the trees begun so far are one
`SingleEpochTreeAggregationDpEvent` each (the full trees with B steps, the current one with the
rounds it has so far), composed: dp-accounting's own RDP of the tree (Kairouz et al. 2021,
Appendix D: depth ceil(log2(steps + 1)) Gaussian releases per tree) and its own conversion to
(epsilon, delta). They must agree within 1 %."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from test_accounting import BINARY, ORDERS

GRID = [(epsilon, rounds, separation)
        for epsilon in (1.0, 4.0, 8.0)
        for rounds, separation in ((10, 10), (100, 10), (100, 100), (64, 16), (1000, 1000),
                                   (7, 3))]
DELTA = 1e-6


def plan(epsilon: float, rounds: int, separation: int) -> dict:
    run = subprocess.run([BINARY, "privacy", "plan", "--epsilon", str(epsilon), "--delta",
                          str(DELTA), "--rounds", str(rounds), "--min-separation", str(separation)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout)


def trees_through(round_: int, separation: int) -> list[int]:
    """Rounds released in each tree begun by round `round_` (1-based)."""
    full, rest = divmod(round_, separation)
    return [separation] * full + ([rest] if rest else [])


def independent_epsilon(noise_multiplier: float, round_: int, separation: int) -> float:
    # dp-accounting states its tree accountant for "replace with a special (zero) record"
    # neighbours. For sums of clipped updates that is the same sensitivity as confed's
    # add/remove relation: removing a device's update changes every node it is in by exactly
    # what replacing it with zeros does.
    accountant = rdp_privacy_accountant.RdpAccountant(
        list(ORDERS), rdp_privacy_accountant.NeighborRel.REPLACE_SPECIAL)
    accountant.compose(dp_event.ComposedDpEvent([
        dp_event.SingleEpochTreeAggregationDpEvent(noise_multiplier, steps)
        for steps in trees_through(round_, separation)
    ]))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("epsilon,rounds,separation", GRID)
def test_tree_epsilon_spent_agrees_with_dp_accounting_within_one_percent(epsilon, rounds,
                                                                          separation):
    got = plan(epsilon, rounds, separation)
    assert got["mechanism"] == f"tree_aggregation_on_grid;min_separation={separation}"
    assert got["epsilon_spent"][-1] <= epsilon
    assert got["epsilon_spent"][-1] >= 0.999 * epsilon
    for r in sorted({1, 2, 3, max(1, rounds // 2), rounds - 1, rounds} - {0}):
        if r > rounds:
            continue
        ours = got["epsilon_spent"][r - 1]
        theirs = independent_epsilon(got["noise_multiplier"], r, separation)
        assert abs(ours - theirs) <= 0.01 * theirs, (r, ours, theirs)


def test_a_tree_needs_less_noise_per_node_than_independent_rounds_need_per_round():
    # 100 rounds in one tree cost depth ceil(log2(101)) = 7 releases instead of 100:
    # sqrt(100 / 7) times less noise (within the discrete sampler's rounding of the variance).
    tree = plan(4.0, 100, 100)["noise_multiplier"]
    gaussian = json.loads(subprocess.run(
        [BINARY, "privacy", "plan", "--epsilon", "4", "--delta", str(DELTA), "--rounds", "100"],
        capture_output=True, text=True, timeout=120, check=True).stdout)["noise_multiplier"]
    assert abs(gaussian / tree - math.sqrt(100 / 7)) < 1e-3 * math.sqrt(100 / 7)
