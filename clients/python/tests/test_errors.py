"""Every documented error answer (docs/api.md, "Routes"; docs/protocol.md, the upload and report
tables), provoked from a real `confed serve`, and what the client does with it: the error carries
the server's status and problem+json, and a device follows protocol.md's guidance (retry with the
same bytes, report `failed`, or drop). 503/507 cannot be provoked from a healthy server on
demand; the retry on those is checked against a small local HTTP server that answers them."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time

import numpy as np
import pytest
import requests

from confed_client import Device, DeviceError, Partner, PartnerError, Trust
from confed_client.envelope import encode_envelope
from confed_client.testing import create_tenant

MODEL = {"w": np.zeros(4, np.float32)}


def spec(population: str, **extra) -> dict:
    return {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": 1, "report_goal": 5,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0}, **extra}


class Counting(requests.Session):
    """A session that counts the requests of each method it sends."""

    def __init__(self):
        super().__init__()
        self.sent: dict[str, int] = {}

    def request(self, method, url, *args, **kwargs):
        self.sent[method] = self.sent.get(method, 0) + 1
        return super().request(method, url, *args, **kwargs)


@pytest.fixture(scope="module")
def token(server):
    """A tenant of its own, so these tests' open tasks leave the demo tenant's quota alone."""
    return create_tenant(server, "errors", max_active_tasks=50)


def device(server, population, **options) -> Device:
    return Device(server["url"], population, Trust.load(server["trust"]), **options)


def raises(status: int, call) -> DeviceError | PartnerError:
    with pytest.raises((DeviceError, PartnerError)) as caught:
        call()
    assert caught.value.status == status, caught.value
    assert caught.value.detail and str(status) in str(caught.value)
    return caught.value


# Partner side (docs/api.md, "Routes").

def test_partner_errors_carry_the_status_and_the_problem(server, token):
    partner = Partner(server["url"], token)
    error = raises(400, lambda: partner.create_task(spec("errors-a", rounds=0), MODEL))
    assert [p["name"] for p in error.problem["invalid_params"]] == ["rounds"]
    raises(401, lambda: Partner(server["url"], "cft_0123456789abcdef_wrong").task("x"))
    raises(404, lambda: partner.task("no-such-task"))
    task = partner.create_task(spec("errors-a"), MODEL)
    raises(409, lambda: partner._call("PUT", f"/v1/tasks/{task}/model", expect=(201,),
                                      data=b"x", headers={"content-type": "application/octet-stream"}))
    partner._call("POST", f"/v1/tasks/{task}/cancel")
    raises(409, lambda: partner._call("POST", f"/v1/tasks/{task}/cancel"))
    raises(400, lambda: partner._call("GET", f"/v1/tasks/{task}/releases/one/average"))
    raises(404, lambda: partner.average(task, 1))
    raises(415, lambda: partner._call("POST", "/v1/tasks", expect=(201,), data="{}",
                                      headers={"content-type": "text/plain"}))


def test_a_tenant_over_its_quota_gets_403(server):
    partner = Partner(server["url"], create_tenant(server, "one-task-only", max_active_tasks=1))
    partner.create_task(spec("errors-quota"), MODEL)
    error = raises(403, lambda: partner.create_task(spec("errors-quota"), MODEL))
    assert "quota" in error.problem["type"]


def test_a_device_with_a_bad_client_version_is_told_what_is_wrong(server):
    error = raises(400, lambda: device(server, "errors-b", client_version="one").check_in())
    assert "client_version" in error.detail


# Device side (docs/protocol.md): one open task per test, each assignment provoked differently.

@pytest.fixture
def assignment_of(server, token):
    partner = Partner(server["url"], token)

    def make(population: str, **extra):
        partner.create_task(spec(population, **extra), MODEL)
        dev = device(server, population, key_retry_wait=0.01, session=Counting())
        answer = dev.check_in()
        assert "assignment_id" in answer, answer
        return dev, answer

    return make


def report_state(dev, assignment) -> str:
    """The assignment's state, by repeating the report the device should have made."""
    return dev.report(assignment, "failed")["state"]


def test_upload_400_is_reported_failed_and_raised(assignment_of):
    dev, assignment = assignment_of("errors-400")
    raises(400, lambda: dev.upload(assignment, b"not an envelope"))
    assert report_state(dev, assignment) == "FAILED"


def test_upload_404_for_an_unknown_assignment(assignment_of):
    dev, assignment = assignment_of("errors-404")
    forged = dict(assignment, upload_url="/v1/assignments/no-such-assignment/contribution",
                  report_url="/v1/assignments/no-such-assignment/report")
    raises(404, lambda: dev.upload(forged, b"x"))
    raises(404, lambda: dev.report(forged, "completed"))


def test_upload_409_for_other_bytes_after_a_contribution(assignment_of):
    dev, assignment = assignment_of("errors-409")
    dev.contribute(assignment, lambda weights, plan: {"w": np.full(4, 0.1, np.float32)})
    # A well-formed envelope for the round's key (400 and 422 come before the bytes' 409).
    other = encode_envelope(assignment["encryption"]["key_id"], os.urandom(32), os.urandom(64))
    error = raises(409, lambda: dev.upload(assignment, other))
    assert "different" in error.detail


def test_upload_413_above_max_contribution_bytes(assignment_of):
    dev, assignment = assignment_of("errors-413")
    raises(413, lambda: dev.upload(assignment, b"\0" * (assignment["max_contribution_bytes"] + 1)))
    assert report_state(dev, assignment) == "FAILED"


def test_upload_415_for_another_media_type(assignment_of):
    dev, assignment = assignment_of("errors-415")
    raises(415, lambda: dev.upload(dict(assignment, upload_headers={"content-type": "text/plain"}),
                                   b"x"))
    assert report_state(dev, assignment) == "FAILED"


def test_upload_422_is_retried_with_the_same_bytes_then_reported_failed(assignment_of):
    dev, assignment = assignment_of("errors-422")
    sealed = encode_envelope("not-the-rounds-key", os.urandom(32), os.urandom(64))
    raises(422, lambda: dev.upload(assignment, sealed))
    assert dev.session.sent["PUT"] == dev.attempts
    assert report_state(dev, assignment) == "FAILED"


def test_upload_410_after_the_assignment_expired_is_dropped_without_a_report(assignment_of):
    dev, assignment = assignment_of("errors-410", assignment_timeout_seconds=10,
                                    round_deadline_seconds=600)
    time.sleep(10.5)
    posts = dev.session.sent.get("POST", 0)
    raises(410, lambda: dev.upload(assignment, b"x"))
    assert dev.session.sent.get("POST", 0) == posts, "no report for an expired assignment"


def test_report_completed_before_an_upload_is_409(assignment_of):
    dev, assignment = assignment_of("errors-report-409")
    raises(409, lambda: dev.report(assignment, "completed"))


# 503 / 507: a local server that answers them (a healthy confed does not, on demand).

class _Flaky(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []
    seen: list[bytes] = []

    def _answer(self):
        length = int(self.headers.get("content-length", 0))
        _Flaky.seen.append(self.rfile.read(length))
        status = _Flaky.answers.pop(0) if _Flaky.answers else 201
        body = json.dumps({"type": "urn:confed:problem:unavailable", "title": "t",
                           "status": status, "detail": "try later"}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/problem+json")
        self.send_header("retry-after", "0")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = _answer
    do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Flaky.seen.clear()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_503_and_507_are_retried_with_the_same_bytes_after_retry_after(server, flaky):
    dev = Device(flaky, "p", Trust.load(server["trust"]))
    assignment = {"upload_url": "/upload", "report_url": "/report"}
    _Flaky.answers = [503, 507]
    dev.upload(assignment, b"sealed once")
    assert _Flaky.seen == [b"sealed once"] * 3
    _Flaky.seen.clear()
    _Flaky.answers = [507] * dev.attempts
    raises(507, lambda: dev.upload(assignment, b"sealed once"))
    # Every attempt carried the same bytes, then the slot was freed with a `failed` report.
    assert _Flaky.seen[:dev.attempts] == [b"sealed once"] * dev.attempts
    assert json.loads(_Flaky.seen[dev.attempts])["outcome"] == "failed"
