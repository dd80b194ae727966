"""The errors of this package: what failed, and the server's answer when it refused."""

from __future__ import annotations

import requests


class ConfedError(RuntimeError):
    """A check failed, or the server refused. `status` is the HTTP status of the refusal (None
    for a failed local check); `problem` its problem+json body (docs/api.md, "Errors"), and
    `detail` the server's explanation."""

    def __init__(self, message: str, status: int | None = None, problem: dict | None = None):
        super().__init__(message)
        self.status = status
        self.problem = problem or {}
        self.detail = self.problem.get("detail", message)

    @classmethod
    def from_reply(cls, what: str, reply: requests.Response) -> "ConfedError":
        """`what`: HTTP <status>: <detail>, with the problem+json body kept."""
        problem = {}
        if "json" in reply.headers.get("content-type", ""):
            try:
                problem = reply.json()
            except ValueError:
                problem = {}
        detail = problem.get("detail") or reply.text
        return cls(f"{what}: HTTP {reply.status_code}: {detail}", reply.status_code, problem)
