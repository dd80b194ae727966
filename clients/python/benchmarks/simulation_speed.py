"""`run_simulation` against the loop a partner would write by hand (issue 48): 100 devices, 30
rounds of 20, a 4-float model, on a real `confed serve` (`CONFED_BIN`, default the workspace's
release build). Prints the seconds each takes and how many distinct devices trained.

    cargo build --release --bin confed
    cd clients/python && python3 benchmarks/simulation_speed.py

It imports the package from this checkout (not an installed copy); `PYTHONPATH=DIR` puts another
copy first, e.g. an older one to measure before a change.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import sys

if "PYTHONPATH" not in os.environ:
    sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from confed_client import Device, Partner, Trust, run_simulation  # noqa: E402
from confed_client.testing import confed_server  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEVICES, ROUNDS, GOAL = 100, 30, 20


def spec(population: str) -> dict:
    # A short upload window, as a simulation wants (the default holds each upload back by one to
    # two device-minutes, the send-instant rule of docs/privacy.md, "Time").
    return {"population": population, "rounds": ROUNDS, "report_goal": GOAL,
            "upload_window": {"start_ms": 100, "end_ms": 300},
            "min_reports": GOAL, "privacy": {"epsilon": 100.0, "delta": 1e-6, "clip_norm": 1.0}}


def recording(trained: list, lock: threading.Lock):
    def client_fn(i: int):
        def train(weights, plan):
            with lock:
                trained.append(i)
            return {"w": np.full(4, 0.01, np.float32)}
        return train
    return client_fn


def by_hand(partner: Partner, task: str, trust: Trust, client_fn) -> None:
    """The loop: sample GOAL devices a round, run each once, wait for the model."""
    population = partner.task(task)["population"]
    devices = [Device(partner.server, population, trust) for _ in range(DEVICES)]
    trains = [client_fn(i) for i in range(DEVICES)]
    for round_ in range(1, ROUNDS + 1):
        sample = random.sample(range(DEVICES), GOAL)
        with ThreadPoolExecutor(GOAL) as pool:
            list(pool.map(lambda i: devices[i].run_once(trains[i], max_wait=1.0), sample))
        partner.wait_for_model(task, round_)


def main() -> None:
    binary = os.environ.get("CONFED_BIN", str(ROOT / "target" / "release" / "confed"))
    with confed_server(binary) as server:
        partner = Partner(server["url"], server["token"])
        trust = Trust.load(server["trust"])
        # An older run_simulation (to measure before a change) may not take a seed.
        seeded = {"seed": 1} if "seed" in inspect.signature(run_simulation).parameters else {}
        for name, run in [
            ("run_simulation", lambda task, fn: run_simulation(
                partner, task, trust, fn, num_devices=DEVICES, progress=False, **seeded)),
            ("loop by hand", lambda task, fn: by_hand(partner, task, trust, fn)),
        ]:
            task = partner.create_task(spec(f"speed-{name.replace(' ', '-')}"),
                                       {"w": np.zeros(4, np.float32)})
            trained, lock = [], threading.Lock()
            started = time.monotonic()
            run(task, recording(trained, lock))
            took = time.monotonic() - started
            print(f"{name}: {ROUNDS} rounds of {GOAL} from {DEVICES} devices in {took:.1f} s "
                  f"({took / ROUNDS:.2f} s a round), {len(set(trained))} distinct devices trained")


if __name__ == "__main__":
    main()
