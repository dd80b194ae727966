"""A real `confed serve` for the tests: the binary `CONFED_BIN` names, else the workspace's
debug build (`cargo build --bin confed`)."""

from __future__ import annotations

import os
import pathlib

import pytest

from confed_client.testing import confed_server

ROOT = pathlib.Path(__file__).resolve().parents[3]
PROTOCOL_MD = ROOT / "docs" / "protocol.md"


@pytest.fixture(scope="session")
def server():
    binary = os.environ.get("CONFED_BIN", str(ROOT / "target" / "debug" / "confed"))
    with confed_server(binary, admin_api=True) as found:
        yield found
