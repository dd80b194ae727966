"""A real `confed serve` (the binary `CONFED_BIN` names, else the workspace's debug build) with
the admin API on, a task of the demo tenant with three completed rounds trained by Python devices
(the confed-client package), and a headless Chromium driven by Selenium (Debian's `chromium` and
`chromium-driver`)."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from confed_client import Device, Partner, Trust
from confed_client.testing import confed_server, create_tenant

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = 3
DEVICES_PER_ROUND = 4


@pytest.fixture(scope="session")
def server():
    binary = os.environ.get("CONFED_BIN", str(ROOT / "target" / "debug" / "confed"))
    with confed_server(binary, admin_api=True) as found:
        yield found


@pytest.fixture(scope="session")
def trained_task(server):
    """A task of the demo tenant with ROUNDS completed rounds of DEVICES_PER_ROUND devices,
    evaluating every 2 rounds (model versions 0 and 2)."""
    partner = Partner(server["url"], server["token"])
    spec = {"population": "console-phones", "rounds": ROUNDS, "report_goal": DEVICES_PER_ROUND,
            "min_reports": DEVICES_PER_ROUND,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
            "evaluation": {"every": 2, "max_examples": 10, "stddev": 40.0},
            # Devices send 100-200 ms after their assignment (the default is a minute or two).
            "upload_window": {"start_ms": 100, "end_ms": 200}}
    task = partner.create_task(spec, {"w": np.zeros(8, np.float32), "b": np.zeros(2, np.float32)})
    trust = Trust.load(server["trust"])
    rng = np.random.default_rng(7)
    for round_ in range(1, ROUNDS + 1):
        for _ in range(DEVICES_PER_ROUND):
            device = Device(server["url"], "console-phones", trust,
                            evaluate=lambda model: (3.0, 5.0, 10.0))
            update = {"w": rng.normal(0, 0.1, 8).astype(np.float32),
                      "b": rng.normal(0, 0.1, 2).astype(np.float32)}
            assert device.run_once(lambda weights, plan, u=update: u) == "contributed"
        partner.wait_for_model(task, round_)
    partner.wait_for_state(task, "COMPLETED")
    # Devices that check in after the task completed are told there is no task.
    for _ in range(2):
        assert Device(server["url"], "console-phones", trust).run_once(
            lambda weights, plan: {}, max_wait=0) == "no_task"
    return task


@pytest.fixture(scope="session")
def other_tenant(server):
    """A second tenant, with a task of its own."""
    token = create_tenant(server, "rival", max_active_tasks=5)
    partner = Partner(server["url"], token)
    spec = {"population": "rival-phones", "rounds": 1, "report_goal": 2,
            "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0}}
    task = partner.create_task(spec, {"w": np.zeros(4, np.float32)})
    return {"token": token, "task": task}


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1000", "--lang=en-US"):
        options.add_argument(flag)
    service = Service(executable_path=os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()
