"""`run_simulation` as a partner coming from Flower uses it: each round's participants are a
random sample of the devices (not the same first ones every round), every round comes back,
and many simulations at high concurrency all return complete histories (issue 48)."""

from __future__ import annotations

import os
import pathlib
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from confed_client import Partner, Trust, run_simulation
from confed_client.testing import confed_server

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def own_server():
    """A server of the test's own: the session's server holds other tests' tasks, and a tenant
    may keep at most 10 active (its quota)."""
    binary = os.environ.get("CONFED_BIN", str(ROOT / "target" / "debug" / "confed"))
    with confed_server(binary) as found:
        yield found


def spec(population: str, rounds: int, goal: int) -> dict:
    return {"upload_window": {"start_ms": 100, "end_ms": 300}, "population": population,
            "rounds": rounds, "report_goal": goal, "min_reports": goal,
            "privacy": {"epsilon": 100.0, "delta": 1e-6, "clip_norm": 1.0}}


def recording(trained: list, lock: threading.Lock):
    """`client_fn` whose devices note their index each time they train."""
    def client_fn(i: int):
        def train(weights, plan):
            with lock:
                trained.append(i)
            return {"w": np.full(4, 0.01, np.float32)}
        return train
    return client_fn


def test_100_devices_30_rounds_of_20_train_at_least_90_distinct_devices(own_server):
    """The digits comparison's shape: 100 devices, 30 rounds of 20. Devices used to be started
    in index order, so devices 0-25 filled every round and 74 never trained."""
    server = own_server
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(spec("python-sim-sample", 30, 20), {"w": np.zeros(4, np.float32)})
    trained, lock = [], threading.Lock()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        history = run_simulation(partner, task, Trust.load(server["trust"]),
                                 recording(trained, lock), num_devices=100, progress=False,
                                 seed=7)
    # Simulated devices live as long as the simulation: no warning about in-memory state.
    assert not [w for w in warned if "in memory only" in str(w.message)]
    assert [r.round for r in history] == list(range(1, 31))
    assert all(r.included == 20 for r in history), [r.included for r in history]
    assert len(set(trained)) >= 90, f"{len(set(trained))} distinct devices trained"
    # A device sampled for a round contributes to that round only: never more often than once
    # a round on average, and no device in every round.
    counts = np.bincount(trained, minlength=100)
    assert counts.max() < 30, counts.max()


def test_eight_tasks_at_concurrency_100_all_return_complete_histories(own_server):
    """Eight simulations at once, each with 100 threads: rounds used to be skipped (a round
    the leftover devices completed before the simulation looked), and the last model read
    raced the task's completion."""
    server = own_server
    partner = Partner(server["url"], server["token"])
    trust = Trust.load(server["trust"])
    rounds = [3, 8, 8, 5, 8, 3, 6, 8]
    tasks = [partner.create_task(spec(f"python-sim-many-{n}", r, 10),
                                 {"w": np.zeros(4, np.float32)})
             for n, r in enumerate(rounds)]

    def simulate(task: str):
        return run_simulation(partner, task, trust,
                              lambda i: (lambda w, plan: {"w": np.full(4, 0.01, np.float32)}),
                              num_devices=30, concurrency=100, progress=False, seed=1)

    with ThreadPoolExecutor(len(tasks)) as pool:
        histories = list(pool.map(simulate, tasks))
    for task, planned, history in zip(tasks, rounds, histories):
        assert [r.round for r in history] == list(range(1, planned + 1)), (task, history)
        assert all(r.included == 10 for r in history), (task, history)
