"""A real `confed serve` for tests and experiments: started on a free loopback port with a fresh
data directory, stopped at the end. What it prints on start gives the demo tenant's token, the
device trust file and the URL."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
import threading
from typing import Iterator

import requests


@contextlib.contextmanager
def confed_server(binary: str, admin_api: bool = False) -> Iterator[dict]:
    """Runs `binary serve`; yields {"url", "token", "trust", "data"} and, with `admin_api`,
    "admin" (the admin token it was started with)."""
    admin = secrets.token_hex(32) if admin_api else None
    env = {**os.environ, "RUST_LOG": "error"}
    if admin:
        env["CONFED_ADMIN_TOKEN"] = admin
    with tempfile.TemporaryDirectory() as data:
        process = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", data],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        found = {"data": data}
        if admin:
            found["admin"] = admin
        for line in process.stdout:
            if line.startswith("CONFED_DEMO_TOKEN="):
                found["token"] = line.split("=", 1)[1].strip()
            if "Device trust file: " in line:
                found["trust"] = line.split("Device trust file: ", 1)[1].strip()
            if line.startswith("confed: serving on "):
                found["url"] = line.removeprefix("confed: serving on ").strip()
                break
        else:
            process.wait(timeout=30)
            raise RuntimeError(f"{binary} serve stopped before it listened")
        # Keep reading what it prints, so a full pipe never stops the server.
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
        try:
            yield found
        finally:
            process.terminate()
            process.wait(timeout=30)


def create_tenant(server: dict, name: str, **quotas) -> str:
    """Creates a tenant through the admin API of a `confed_server(..., admin_api=True)`, with
    quotas such as `max_active_tasks=5`; returns its API token."""
    reply = requests.post(f"{server['url']}/v1/admin/tenants",
                          headers={"Authorization": f"Bearer {server['admin']}"},
                          json={"name": name, **quotas}, timeout=30)
    reply.raise_for_status()
    return reply.json()["token"]
