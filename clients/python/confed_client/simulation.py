"""Many simulated devices against a real server, the way Flower users try a model with
`run_simulation`: you give a task, a function that makes each device's training function, and
optionally an evaluation of each new model version; the devices run concurrently, round after
round, until the task ends. Each round's participants are sampled at random from the devices,
as from a real population: a device sampled for a round contributes to that round only."""

from __future__ import annotations

import math
import os
import random
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .device import Device, DeviceError, Evaluate, Train, Trust
from .errors import ConfedError
from .partner import FINAL_STATES, Partner, PartnerError, TaskEnded


class SimulationError(ConfedError):
    """A simulated device's own code is wrong (its train or evaluate function returned the
    wrong tensors): the devices sent zero updates, as real ones would, but a simulation is where
    you find such a bug, so it stops at once. `device` is its index, `training_problem` the
    `TrainingProblem`."""

    def __init__(self, device: int, task_id: str, round_: int, problem):
        super().__init__(f"device {device}, task {task_id} round {round_}: your function is "
                         f"wrong ({problem.kind}): {problem.detail}")
        self.device = device
        self.training_problem = problem


@dataclass
class RoundResult:
    """One round as the partner sees it: its release and, with `evaluate_fn`, your metrics of
    the model version it produced."""

    round: int
    included: int
    excluded: int
    epsilon_spent: float
    metrics: dict = field(default_factory=dict)


def _until_contributed(device: Device, train: Train, round_: int, stop: threading.Event,
                       max_wait: float) -> bool:
    """Runs one device sampled for round `round_` until it contributes to it or `stop` is set
    (the round ended); a device told to wait waits at most `max_wait` seconds at a time, and
    stops waiting when the round ends. An assignment to another round (the next one opened
    before `stop` was seen) is declined: the device was not sampled for it."""
    # Its waits end with the round (a real device would sleep on; a simulated one is free to
    # take part in the next round as soon as this one is over).
    device.sleep = stop.wait
    while not stop.is_set():
        try:
            if device.run_once(train, max_wait=max_wait, only_round=round_) == "contributed":
                return True
        except DeviceError as error:
            # The round closed (its goal reached by others) between this device's check-in
            # and its upload: the update is dropped, as protocol.md says; check in again.
            if error.status != 410:
                raise
    return False


def _programming_error(devices: list[Device], task_id: str) -> SimulationError | None:
    """The first programming error any device met in this task (its own log of problems)."""
    for index, device in enumerate(devices):
        for task, round_, problem in list(device.problems):
            if task == task_id and problem.is_programming_error:
                return SimulationError(index, task_id, round_, problem)
    return None


def _await_round(partner: Partner, task_id: str, round_: int, devices: list[Device],
                 running: list, timeout: float) -> dict[str, np.ndarray] | None:
    """Model version `round_` once the round completes, or None when the task completed before
    it (early stopping). Raises at once, instead of waiting for
    `timeout`: `TaskEnded` when the task fails or is cancelled, `SimulationError` when a
    device's function is wrong, and whatever a device's own thread raised."""
    deadline = time.monotonic() + timeout
    while True:
        if (error := _programming_error(devices, task_id)) is not None:
            raise error
        model = partner.model_if_stored(task_id, round_)
        if model is not None:
            return model
        task = partner.task(task_id)
        if task["state"] in FINAL_STATES:
            # The model may have been stored between the two reads: look once more, now that
            # nothing can change any more.
            model = partner.model_if_stored(task_id, round_)
            if model is not None:
                return model
            # Before the devices' errors: their uploads to an ended task are refused, and the
            # task's end is what explains that.
            if task["state"] != "COMPLETED":
                raise TaskEnded(task)
            # Completed before this round: its early-stopping rule ended it (api.md).
            return None
        for future in running:
            if future.done() and future.exception() is not None:
                raise future.exception()
        if time.monotonic() > deadline:
            raise PartnerError(f"round {round_} of task {task_id} did not complete in "
                               f"{timeout} s (the task is {task['state']}; its rounds, with "
                               f"reports_received, are at GET /v1/tasks/{task_id}/rounds)")
        time.sleep(0.2)


def _run_round(partner: Partner, task_id: str, round_: int, devices: list[Device],
               trains: list[Train], busy: dict, pool: ThreadPoolExecutor,
               sampler: random.Random, max_wait: float,
               timeout: float) -> dict[str, np.ndarray] | None:
    """Runs round `round_` with the available devices (not in `busy`) in a random order;
    returns its model version as `_await_round` does. Once it has one, the round's devices are
    told to stop; those still finishing a call stay in `busy`, and are not sampled again until
    they are done (a real population's busy devices do not check in either)."""
    stop = threading.Event()
    order = [i for i in range(len(devices)) if i not in busy]
    sampler.shuffle(order)
    running = {i: pool.submit(_until_contributed, devices[i], trains[i], round_, stop,
                              max_wait)
               for i in order}
    try:
        return _await_round(partner, task_id, round_, devices, list(running.values()),
                            timeout)
    finally:
        stop.set()
        for index, future in running.items():
            # Those not started yet were not sampled; the others finish their call in the
            # background.
            if not future.cancel():
                busy[index] = future


def run_simulation(partner: Partner, task_id: str, trust: Trust,
                   client_fn: Callable[[int], Train], num_devices: int,
                   evaluate_fn: Callable[[dict[str, np.ndarray]], dict] | None = None,
                   client_evaluate_fn: Callable[[int], Evaluate] | None = None,
                   concurrency: int | None = None, max_wait: float = 1.0,
                   progress: bool = True,
                   round_timeout: float = 600.0, state_dir: str | None = None,
                   attestation_fn: Callable[[int], object] | None = None,
                   seed: int | None = None,
                   **device_options) -> list[RoundResult]:
    """Runs `num_devices` devices of the task's population until the task completes; returns
    one `RoundResult` per round. Raises as soon as something goes wrong, not at the round
    timeout: `TaskEnded` (with the server's `reason`) when the task fails or is cancelled,
    `SimulationError` when `client_fn`'s or `client_evaluate_fn`'s function returns the wrong
    tensors, `PartnerError` when a round does not complete in `round_timeout` seconds.

    - `client_fn(i)` returns device i's training function `train(weights, plan) -> update`
      (new weights minus the given ones), over that device's own data;
    - `evaluate_fn(model)` (optional) returns metrics of each new model version, e.g. accuracy
      on held-out data;
    - `client_evaluate_fn(i)` (optional) returns device i's `evaluate(model) -> (loss_sum,
      correct, examples)` over its own held-out data, for tasks with federated evaluation (read
      the released metrics with `Partner.evaluations`);
    - every round, the devices available (not still busy with the round before) check in in a
      random order (`seed` makes it repeatable), at most `concurrency` at a time (default: as
      many as a round assigns, `report_goal` plus over-selection), each until it has
      contributed or the round has ended (the report goal reached by others): the round's
      participants are a random sample, a different one every round, and a device sampled for
      a round declines an assignment to the next; a device told to wait waits at most
      `max_wait` seconds, and no longer than its round lasts;
    - `state_dir` (optional): device i keeps what it served in `state_dir/device-<i>.json`, so
      a simulation run again with the same directory has devices that remember (without it
      they keep it in memory, as long as the simulation runs);
    - `attestation_fn(i)` (optional) returns device i's attestation (e.g. `DevAttestation()`),
      for tasks that require device tokens of an issuer listed in `trust.token_issuers`: one
      per device, since an issuer grants each attested device its own allowance;
    - `device_options` go to each `Device` (e.g. `tensors="torch"`, `attributes={...}`).
    """
    task = partner.task(task_id)
    population = task["population"]
    if state_dir is not None:
        os.makedirs(state_dir, exist_ok=True)
    with warnings.catch_warnings():
        # Simulated devices live as long as the simulation: keeping what they served in memory
        # is what they need, not something to warn about on every run.
        warnings.filterwarnings("ignore", message="this confed Device keeps", category=UserWarning)
        devices = [Device(partner.server, population, trust,
                          evaluate=client_evaluate_fn(i) if client_evaluate_fn else None,
                          attestation=attestation_fn(i) if attestation_fn else None,
                          state_file=(os.path.join(state_dir, f"device-{i}.json")
                                      if state_dir is not None else None),
                          **device_options)
                   for i in range(num_devices)]
    trains = [client_fn(i) for i in range(num_devices)]
    history: list[RoundResult] = []
    from tqdm.auto import tqdm

    if concurrency is None:
        concurrency = math.ceil(task["report_goal"] * (1 + task.get("over_selection", 0.3)))
    sampler = random.Random(seed)
    # Devices still finishing an earlier round's call (index -> future): not available.
    busy: dict[int, Future] = {}
    with tqdm(total=task["rounds"], unit="round", disable=not progress,
              desc=f"task {task_id[:8]}") as bar, \
            ThreadPoolExecutor(min(concurrency, num_devices)) as pool:
        try:
            # One result per round, in order, whatever rounds completed in between: a round
            # counts once its model version exists, read by its number, never skipped.
            while len(history) < task["rounds"]:
                round_ = len(history) + 1
                for index in [i for i, future in busy.items() if future.done()]:
                    busy.pop(index).result()  # a device's own error surfaces here
                model = _run_round(partner, task_id, round_, devices, trains, busy, pool,
                                   sampler, max_wait, round_timeout)
                if model is None:
                    break
                release = next(r for r in partner.releases(task_id) if r["round"] == round_)
                result = RoundResult(round_, release["included"], release["excluded"],
                                     release["epsilon_spent"],
                                     evaluate_fn(model) if evaluate_fn else {})
                history.append(result)
                bar.update(1)
                bar.set_postfix_str(f"epsilon {result.epsilon_spent:.2f}" + "".join(
                    f", {k} {v:.3g}" for k, v in result.metrics.items()
                    if isinstance(v, (int, float))))
        finally:
            wait(list(busy.values()))
        for future in busy.values():
            future.result()
        task = partner.task(task_id)
    if task["state"] != "COMPLETED":
        raise TaskEnded(task)
    return history


@dataclass
class AnalyticsRound:
    """One analytics round as the partner sees it: its release's counts and cost, and the
    released result (`Partner.result`), verified against the trust file's key services."""

    round: int
    included: int
    excluded: int
    epsilon_spent: float
    result: dict
    verified: list = field(default_factory=list)


def _until_answered(device: Device, round_: int, stop: threading.Event, max_wait: float) -> bool:
    return _until_contributed(device, None, round_, stop, max_wait)


def run_analytics(partner: Partner, task_id: str, trust: Trust,
                  records_fn: Callable[[int, dict], list], num_devices: int,
                  concurrency: int | None = None, max_wait: float = 1.0,
                  round_timeout: float = 600.0, seed: int | None = None,
                  **device_options) -> list[AnalyticsRound]:
    """`run_simulation` for an analytics task (`Partner.create_analytics_task`): runs
    `num_devices` devices of the task's population, device i answering from
    `records_fn(i, query)` (its local records for the query: `(key_index, value)` pairs,
    strings or numbers), until the task completes; returns each round's released result,
    verified against `trust`. Every round the available devices check in in a random order,
    each until it has answered or the round has ended; raises `TaskEnded` when the task fails
    or is cancelled and `PartnerError` when a round does not release in `round_timeout`
    seconds."""
    task = partner.task(task_id)
    population = task["population"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this confed Device keeps", category=UserWarning)
        devices = [Device(partner.server, population, trust,
                          records=(lambda query, i=i: records_fn(i, query)), **device_options)
                   for i in range(num_devices)]
    if concurrency is None:
        concurrency = math.ceil(task["report_goal"] * (1 + task.get("over_selection", 0.3)))
    sampler = random.Random(seed)
    history: list[AnalyticsRound] = []
    with ThreadPoolExecutor(min(concurrency, num_devices)) as pool:
        for round_ in range(1, task["rounds"] + 1):
            stop = threading.Event()
            order = list(range(num_devices))
            sampler.shuffle(order)
            running = [pool.submit(_until_answered, devices[i], round_, stop, max_wait)
                       for i in order]
            try:
                release = partner.wait_for_release(task_id, round_, timeout=round_timeout)
            finally:
                stop.set()
                for future in running:
                    future.cancel()
            wait([f for f in running if not f.cancelled()])
            for future in running:
                if not future.cancelled() and future.exception() is not None:
                    raise future.exception()
            history.append(AnalyticsRound(
                round_, release["included"], release["excluded"], release["epsilon_spent"],
                partner.result(task_id, round_), partner.verify_release(task_id, round_, trust)))
    task = partner.wait_for_state(task_id, "COMPLETED", timeout=round_timeout)
    return history
