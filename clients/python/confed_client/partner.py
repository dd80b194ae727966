"""A partner (tenant) on the task-management API (docs/api.md)."""

from __future__ import annotations

import json
import time

import numpy as np
import requests

from .errors import ConfedError
from .tensors import from_safetensors, to_safetensors

#: Task states after which nothing changes.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED")


class PartnerError(ConfedError):
    """The server refused a request: `status`, `problem` (its problem+json, with
    `invalid_params` naming each bad field of a task) and `detail` say why."""


class TaskEnded(PartnerError):
    """The task failed or was cancelled while you waited for something it will now never do:
    `task` is the task as it ended, `state` its state (FAILED or CANCELLED) and `reason` the
    server's `failure_reason` (docs/api.md, "Why a task or round failed")."""

    def __init__(self, task: dict):
        self.task = task
        self.state = task["state"]
        self.reason = task.get("failure_reason") or "no reason recorded"
        super().__init__(f"task {task['id']} is {self.state}: {self.reason}")


def _unless_ended(task: dict) -> dict:
    """`task`, or `TaskEnded` when it failed or was cancelled."""
    if task["state"] in ("FAILED", "CANCELLED"):
        raise TaskEnded(task)
    return task


class Partner:
    def __init__(self, server: str, token: str, session: requests.Session | None = None):
        self.server = server.rstrip("/")
        self.session = session or requests.Session()
        self.session.headers["authorization"] = f"Bearer {token}"

    def _call(self, method: str, path: str, expect=(200,), **kwargs):
        reply = self.session.request(method, self.server + path, timeout=60, **kwargs)
        if reply.status_code not in expect:
            raise PartnerError.from_reply(f"{method} {path}", reply)
        return reply

    def create_task(self, spec: dict, model) -> str:
        """Creates a task from its spec (`POST /v1/tasks`) and uploads `model` (a dict of NumPy
        arrays or a PyTorch state dict) as version 0."""
        task = self._call("POST", "/v1/tasks", expect=(201,), json=spec).json()
        self._call("PUT", f"/v1/tasks/{task['id']}/model", expect=(201,),
                   data=to_safetensors(model),
                   headers={"content-type": "application/octet-stream"})
        return task["id"]

    def create_analytics_task(self, spec: dict) -> str:
        """Creates an analytics task (`POST /v1/tasks` with `"kind": "analytics"` and its
        `analytics` query; docs/api.md, "Analytics tasks"): it opens at once, no model to
        upload."""
        return self._call("POST", "/v1/tasks", expect=(201,),
                          json={"kind": "analytics", **spec}).json()["id"]

    def result(self, task_id: str, round_: int) -> dict:
        """An analytics release's result (`confed-analytics-release/v1`): `keys` (open
        domains: `[key, noised count]` above the threshold), `histogram` (closed domains),
        `tree` and `quantiles` (quantile queries), with `noise_stddev` and `threshold`."""
        return self._call("GET", f"/v1/tasks/{task_id}/releases/{round_}/average").json()

    def task(self, task_id: str) -> dict:
        return self._call("GET", f"/v1/tasks/{task_id}").json()

    def releases(self, task_id: str) -> list[dict]:
        return self._call("GET", f"/v1/tasks/{task_id}/releases").json()["releases"]

    def health(self, task_id: str) -> list[dict]:
        """Per released round of a task with `privacy.health`: `round`, `included` and the
        noised count of devices that sent zeros in place of a trained update (`zeroed`, with
        its noise's `stddev`; docs/privacy.md, "Health"). Unbiased, so a count may lie below 0
        or above `included`; sum it over rounds for a steadier reading."""
        return [{"round": r["round"], "included": r["included"], **r["health"]}
                for r in self.releases(task_id) if r.get("health")]

    def evaluations(self, task_id: str) -> dict:
        """The task's evaluations (`GET /v1/tasks/{id}/evaluations`): the noised metrics per
        evaluated model version, the best version and whether early stopping ended the task."""
        return self._call("GET", f"/v1/tasks/{task_id}/evaluations").json()

    def request_evaluation(self, task_id: str) -> dict:
        """Asks for an on-demand evaluation of the task's next round (`POST
        /v1/tasks/{id}/evaluations`, within the policy's `evaluation.on_demand`)."""
        return self._call("POST", f"/v1/tasks/{task_id}/evaluations", expect=(202,)).json()

    def model(self, task_id: str, version: int) -> dict[str, np.ndarray]:
        reply = self._call("GET", f"/v1/tasks/{task_id}/models/{version}")
        return from_safetensors(reply.content)

    def model_if_stored(self, task_id: str, version: int) -> dict[str, np.ndarray] | None:
        """Model version `version`, or None while it does not exist yet."""
        reply = self.session.get(f"{self.server}/v1/tasks/{task_id}/models/{version}",
                                 timeout=60)
        if reply.status_code == 404:
            return None
        if reply.status_code != 200:
            raise PartnerError.from_reply(f"model {version}", reply)
        return from_safetensors(reply.content)

    def average(self, task_id: str, round_: int) -> dict[str, np.ndarray]:
        """A release's noised average update, as arrays."""
        reply = self._call("GET", f"/v1/tasks/{task_id}/releases/{round_}/average")
        return from_safetensors(reply.content)

    def wait_for_model(self, task_id: str, version: int,
                       timeout: float = 120.0) -> dict[str, np.ndarray]:
        """Model version `version` once it exists (the next round opens with it); `TaskEnded`
        as soon as the task fails or is cancelled instead."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.model_if_stored(task_id, version)
            if model is not None:
                return model
            if _unless_ended(self.task(task_id))["state"] == "COMPLETED":
                # Looked again: the task may have completed, with this version, between the two
                # reads; a model stored before completion is there now or never.
                model = self.model_if_stored(task_id, version)
                if model is not None:
                    return model
                raise PartnerError(f"task {task_id} completed without model version {version}")
            time.sleep(0.2)
        raise PartnerError(f"task {task_id} has no model version {version} after {timeout} s")

    def verify_release(self, task_id: str, round_: int, trust) -> list[str]:
        """Checks round `round_`'s release against `trust` (a `Trust`: the key services the
        partner trusts) and the task's own policy; the checks that passed, or `ReleaseError`
        listing those that failed (`confed verify release` does the same)."""
        from .release import verify_release

        base = f"/v1/tasks/{task_id}/releases/{round_}"
        manifest = self._call("GET", f"{base}/manifest").content
        average = self._call("GET", f"{base}/average").content
        release = next((r for r in self.releases(task_id) if r["round"] == round_), None)
        if release is None or not release.get("proof"):
            raise PartnerError(f"round {round_} of task {task_id} has no release with a proof")
        passed = verify_release(manifest, average, release["proof"], trust.keyservices,
                                trust.threshold, self.task(task_id)["policy"], shares=trust.n)
        chain = self._blt_chain(task_id, round_, json.loads(manifest))
        if chain is not None:
            passed.append(chain)
        return passed

    def _blt_chain(self, task_id: str, round_: int, manifest: dict) -> str | None:
        """Under BLT noise, checks that the state the release continued is the one round
        `round_ - 1`'s release names as left (round 1: none); the check's line, `ReleaseError`
        when it fails, None for other mechanisms (docs/privacy.md, "DP-FTRL with BLT noise")."""
        from .release import ReleaseError

        blt = manifest.get("noise", {}).get("blt")
        if blt is None:
            return None
        continued = blt.get("state_in_blake3")
        if round_ <= 1:
            left = None
        else:
            previous = json.loads(self._call(
                "GET", f"/v1/tasks/{task_id}/releases/{round_ - 1}/manifest").content)
            left = (previous.get("noise", {}).get("blt") or {}).get("state_out_blake3")
            if left is None:
                raise ReleaseError([f"BLT: round {round_ - 1}'s release names no state left"])
        line = (f"BLT: the state round {round_} continued ({continued}) is the one round "
                f"{round_ - 1} left ({left})")
        if continued != left:
            raise ReleaseError([line])
        return line

    def wait_for_state(self, task_id: str, state: str, timeout: float = 120.0) -> dict:
        """The task once it is in `state` (e.g. "COMPLETED"); `TaskEnded` as soon as it fails
        or is cancelled instead, `PartnerError` when it ended in another state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            task = self.task(task_id)
            if task["state"] == state:
                return task
            _unless_ended(task)
            if task["state"] in FINAL_STATES:
                raise PartnerError(f"task {task_id} is {task['state']}, and will never be {state}")
            time.sleep(0.2)
        raise PartnerError(f"task {task_id} is not {state} after {timeout} s")

    def wait_for_release(self, task_id: str, round_: int, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for release in self.releases(task_id):
                if release["round"] == round_:
                    return release
            if _unless_ended(self.task(task_id))["state"] == "COMPLETED":
                # As in wait_for_model: the round may have completed between the two reads.
                for release in self.releases(task_id):
                    if release["round"] == round_:
                        return release
                raise PartnerError(f"task {task_id} completed without a release of round {round_}")
            time.sleep(0.2)
        raise PartnerError(f"no release of round {round_} of task {task_id} in {timeout} s")

    def watch(self, task_id: str, progress: bool = True, timeout: float | None = None,
              poll: float = 1.0) -> dict:
        """Follows a task until it completes (returns the task), fails or is cancelled
        (`TaskEnded`, with the server's reason) or `timeout` seconds pass (`PartnerError`),
        with a progress bar of rounds done and privacy spent on stderr when `progress`."""
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        task = self.task(task_id)
        budget = task["privacy"]["epsilon"]
        with tqdm(total=task["rounds"], unit="round", disable=not progress,
                  desc=f"task {task_id[:8]}") as bar:
            while True:
                done = task.get("model_version") or 0
                bar.update(done - bar.n)
                releases = self.releases(task_id) if done else []
                spent = releases[-1]["epsilon_spent"] if releases else 0.0
                bar.set_postfix_str(f"{task['state']}, epsilon {spent:.2f} of {budget}")
                if task["state"] in FINAL_STATES:
                    return _unless_ended(task)
                if deadline is not None and time.monotonic() > deadline:
                    raise PartnerError(f"task {task_id} is still {task['state']} after "
                                       f"{timeout} s")
                time.sleep(poll)
                task = self.task(task_id)
