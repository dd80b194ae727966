"""Analytics accounting (docs/analytics.md) against independent implementations.

`confed privacy analytics` plans a query's noise and threshold with the code the enclave will
release with; `confed privacy threshold` gives the threshold a given noise needs. They are held to:

- OpenDP 0.16's privacy maps: rho of a round (`make_gaussian_threshold` for open domains,
  `make_gaussian` for closed histograms and quantile trees) and the epsilon of the whole task
  (`make_zCDP_to_approxDP`), to 1e-6 relative;
- an exact sum of the discrete Gaussian's mass written here: the threshold is the smallest
  integer whose delta fits, and its delta agrees to 1e-6 relative;
- Google's partition selection (PyDP 1.1.5, `GaussianPartitionSelection`): the continuous
  threshold at the same noise and delta, to 1e-6 relative.

OpenDP's threshold delta is not confed's: OpenDP 0.16 bounds P[Z > tau - c] while releasing keys
whose noised count is >= tau (docs/privacy.md, "Partition selection"), so confed's delta at tau,
the exact P[Z >= tau - c], is never below OpenDP's and confed's at tau + 1 never above it."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from test_accounting import BINARY

import opendp.prelude as dp
import pydp.algorithms.partition_selection as partition_selection
from pydp.algorithms.numerical_mechanisms import GaussianMechanism

dp.enable_features("contrib")


def confed(*args: str) -> dict:
    run = subprocess.run([BINARY, "privacy", *args], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def analytics_plan(query: dict, epsilon: float, delta: float, rounds: int) -> dict:
    return confed("analytics", "--query", json.dumps(query), "--epsilon", str(epsilon),
                  "--delta", str(delta), "--rounds", str(rounds))


def discrete_tail(variance: int, m: int) -> float:
    """P[Z >= m] for the discrete Gaussian of variance parameter `variance`, summed exactly."""
    reach = int(45 * math.sqrt(variance)) + 10
    mass = [math.exp(-x * x / (2 * variance)) for x in range(-reach, reach + 1)]
    return math.fsum(mass[m + reach:]) / math.fsum(mass)


def joint(single: float, keys: int) -> float:
    return -math.expm1(keys * math.log1p(-single))


def close(ours: float, theirs: float, tolerance: float = 1e-6) -> bool:
    return abs(ours - theirs) <= tolerance * abs(theirs)


OPEN_GRID = [(epsilon, delta, rounds, keys)
             for epsilon in (0.5, 2.0, 8.0)
             for delta, rounds in ((1e-6, 1), (1e-9, 10))
             for keys in (1, 16, 64)]


@pytest.mark.parametrize("epsilon,delta,rounds,keys", OPEN_GRID)
def test_open_domain_rho_threshold_and_epsilon_agree_with_opendp_and_an_exact_sum(
        epsilon, delta, rounds, keys):
    query = {"query": "open_histogram", "max_key_bytes": 32, "keys_per_device": keys}
    plan = analytics_plan(query, epsilon, delta, rounds)
    threshold = plan["threshold"]
    variance, tau = plan["noise_variance"], threshold["tau"]

    # Rho of one round, and OpenDP's (looser) delta, from make_gaussian_threshold's map: the
    # L2 bound given as keys (OpenDP tightens it to sqrt(keys) * 1 itself).
    measurement = dp.m.make_gaussian_threshold(
        dp.map_domain(dp.atom_domain(T=str), dp.atom_domain(T=int)),
        dp.l02inf_distance(dp.absolute_distance(T=int)),
        scale=math.sqrt(variance), threshold=tau)
    rho, opendp_delta = measurement.map((keys, keys, 1))
    assert close(plan["rho_histogram"], rho), (plan["rho_histogram"], rho)
    # The check of the distinct keys against the enclave's table: a count of sensitivity
    # `keys` noised with 512 * keys, its rho from OpenDP's Gaussian map.
    check = plan["distinct_check"]
    assert check["noise_stddev"] == 512 * keys
    count = dp.m.make_gaussian(dp.atom_domain(T=int), dp.absolute_distance(T=int),
                               scale=check["noise_stddev"])
    assert close(check["rho"], count.map(keys))
    assert close(plan["rho_per_round"], rho + check["rho"])

    # The threshold: the smallest integer whose exact delta fits this round's share.
    budget = delta / 2 / rounds - check["delta"]
    assert close(threshold["delta_budget"], budget)
    exact_at = joint(discrete_tail(variance, tau - 1), keys)
    exact_below = joint(discrete_tail(variance, tau - 2), keys)
    assert close(threshold["delta_at_tau"], exact_at), (threshold, exact_at)
    assert close(threshold["delta_below_tau"], exact_below)
    assert exact_at <= budget < exact_below
    # OpenDP bounds P[Z > tau - 1]: between confed's delta at tau + 1 and at tau.
    assert joint(discrete_tail(variance, tau), keys) <= opendp_delta * (1 + 1e-6)
    assert opendp_delta <= exact_at

    # The whole task's epsilon at the conversion's delta (half the task's), OpenDP's cast.
    # One Gaussian release whose rho is the task's whole (rounds x the round's).
    whole = dp.c.make_fix_delta(dp.c.make_zCDP_to_approxDP(dp.m.make_gaussian(
        dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float),
        scale=1.0 / math.sqrt(2 * rounds * plan["rho_per_round"]))), delta / 2)
    opendp_epsilon, _ = whole.map(1.0)
    assert close(plan["epsilon_spent"][-1], opendp_epsilon), (plan["epsilon_spent"],
                                                               opendp_epsilon)
    assert plan["epsilon_spent"][-1] <= epsilon
    assert close(plan["threshold_delta_spent"][-1], rounds * (exact_at + check["delta"]))


CLOSED = [
    {"query": "histogram", "domain_size": 1 << 20, "keys_per_device": 16},
    {"query": "histogram", "domain_size": 1000, "keys_per_device": 4, "max_value": 600},
    {"query": "quantiles", "min": 0, "max": 3600, "ranks": [0.5, 0.9, 0.99],
     "values_per_device": 3},
]


@pytest.mark.parametrize("query", CLOSED, ids=["counts", "sums", "quantiles"])
@pytest.mark.parametrize("epsilon,rounds", [(1.0, 1), (4.0, 12)])
def test_closed_domains_and_quantile_trees_agree_with_opendps_gaussian(query, epsilon, rounds):
    delta = 1e-7
    plan = analytics_plan(query, epsilon, delta, rounds)
    assert "threshold" not in plan and "distinct_check" not in plan
    assert plan["conversion_delta"] == delta
    # Sensitivity: sqrt(k) * c for histograms, sqrt(4 levels) * v for the quantile tree.
    expected = (2 * 3 if query["query"] == "quantiles"
                else math.sqrt(query["keys_per_device"]) * query.get("max_value", 1))
    assert close(plan["sensitivity"], expected, 1e-12)
    gaussian = dp.m.make_gaussian(dp.atom_domain(T=float, nan=False),
                                  dp.absolute_distance(T=float),
                                  scale=math.sqrt(plan["noise_variance"]))
    assert close(plan["rho_per_round"], gaussian.map(expected))
    assert plan["rho_histogram"] == plan["rho_per_round"]
    whole = dp.c.make_fix_delta(dp.c.make_zCDP_to_approxDP(dp.m.make_gaussian(
        dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float),
        scale=math.sqrt(plan["noise_variance"] / rounds))), delta)
    opendp_epsilon, _ = whole.map(expected)
    assert close(plan["epsilon_spent"][-1], opendp_epsilon)
    # The variance is the calibrated one rounded up: the budget holds, and is nearly spent.
    assert 0.9 * epsilon <= plan["epsilon_spent"][-1] <= epsilon


@pytest.mark.parametrize("epsilon,delta,keys", [(1.0, 1e-6, 4), (0.3, 1e-8, 1),
                                               (4.0, 1e-5, 16), (2.0, 1e-10, 64)])
def test_the_continuous_threshold_is_googles_at_the_same_noise(epsilon, delta, keys):
    strategy = partition_selection.create_partition_strategy("gaussian", epsilon, delta, keys)
    # GaussianPartitionSelection gives half its delta to the noise and half to the threshold.
    stddev = GaussianMechanism(epsilon, delta / 2, math.sqrt(keys)).std
    ours = confed("threshold", "--stddev", repr(stddev), "--delta", repr(delta / 2),
                  "--keys", str(keys))
    assert close(ours["continuous"], strategy.threshold), (ours, strategy.threshold)
    # The exact discrete threshold is within a unit or two of it.
    assert abs(ours["tau"] - strategy.threshold) < 2.5


def test_a_threshold_no_round_can_reach_is_refused_saying_what_to_raise():
    run = subprocess.run([BINARY, "privacy", "analytics", "--query", json.dumps(
        {"query": "open_histogram", "max_key_bytes": 16, "keys_per_device": 16}),
        "--epsilon", "1", "--delta", "1e-8", "--rounds", "10", "--report-goal", "50"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "Raise report_goal to at least" in run.stderr, run.stderr


def test_a_query_past_the_caps_is_refused_naming_the_field():
    run = subprocess.run([BINARY, "privacy", "analytics", "--query", json.dumps(
        {"query": "open_histogram", "max_key_bytes": 300, "keys_per_device": 16}),
        "--epsilon", "1", "--delta", "1e-8", "--rounds", "1"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "max_key_bytes" in run.stderr, run.stderr
