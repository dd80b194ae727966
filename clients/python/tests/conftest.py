"""A real `confed serve` for the tests: the binary `CONFED_BIN` names, else the workspace's
debug build (`cargo build --bin confed`)."""

from __future__ import annotations

import os
import pathlib
import secrets
import subprocess
import tempfile
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
PROTOCOL_MD = ROOT / "docs" / "protocol.md"


@pytest.fixture(scope="session")
def server():
    binary = os.environ.get("CONFED_BIN", str(ROOT / "target" / "debug" / "confed"))
    admin = secrets.token_hex(32)
    with tempfile.TemporaryDirectory() as data:
        process = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", data],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "RUST_LOG": "error", "CONFED_ADMIN_TOKEN": admin})
        found = {"admin": admin}
        for line in process.stdout:
            if line.startswith("CONFED_DEMO_TOKEN="):
                found["token"] = line.split("=", 1)[1].strip()
            if "Device trust file: " in line:
                found["trust"] = line.split("Device trust file: ", 1)[1].strip()
            if line.startswith("confed: serving on "):
                found["url"] = line.removeprefix("confed: serving on ").strip()
                break
        else:
            raise RuntimeError(f"{binary} serve stopped before it listened")
        # Keep reading what it prints, so a full pipe never stops the server.
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
        try:
            yield found
        finally:
            process.terminate()
            process.wait(timeout=30)
