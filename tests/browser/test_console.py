"""The partner console in a real headless Chromium: sign in, the task list, a task with completed
rounds whose plot and funnel show the API's numbers, creating, opening (model upload) and
cancelling a task through the forms, another tenant's task out of reach, forged posts refused, a
copied release row not verified, the populations view, WCAG AA by axe-core, sign out.
Screenshots go to $CONSOLE_SCREENSHOTS when it is set (docs/console/ holds the committed ones)."""

from __future__ import annotations

import datetime
import http.server
import os
import pathlib
import re
import sqlite3
import threading

import numpy as np
import pytest
import requests
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from confed_client import Partner, to_safetensors
from conftest import DEVICES_PER_ROUND, ROUNDS


def shoot(browser, name: str) -> None:
    target = os.environ.get("CONSOLE_SCREENSHOTS")
    if target:
        pathlib.Path(target).mkdir(parents=True, exist_ok=True)
        height = browser.execute_script("return document.documentElement.scrollHeight")
        width = browser.get_window_size()["width"]
        browser.set_window_size(width, max(height + 140, 600))
        browser.save_screenshot(str(pathlib.Path(target) / f"{name}.png"))
        browser.set_window_size(width, 1000)


def sign_in(browser, server, token=None) -> None:
    browser.get(f"{server['url']}/console")
    assert browser.current_url.endswith("/console/sign-in")
    field = browser.find_element(By.ID, "token")
    field.send_keys(token or server["token"])
    field.submit()
    WebDriverWait(browser, 10).until(expected_conditions.url_contains("/console/tasks"))


def heading_says(browser, text: str) -> None:
    """Waits until the page's heading contains `text` (the old page's heading may go stale as
    the form's answer replaces it; Chromium then sometimes answers with an inspector error,
    "Node with given id does not belong to the document", instead of a stale element)."""
    WebDriverWait(browser, 10,
                  ignored_exceptions=[StaleElementReferenceException, WebDriverException]).until(
        lambda b: text in b.find_element(By.TAG_NAME, "h1").text)


def api(server, path: str, token=None) -> dict:
    reply = requests.get(f"{server['url']}{path}", timeout=30,
                         headers={"Authorization": f"Bearer {token or server['token']}"})
    reply.raise_for_status()
    return reply.json()


def session_cookie(browser) -> dict:
    cookies = {c["name"]: c for c in browser.get_cookies()}
    assert "confed_session" in cookies, cookies
    return cookies["confed_session"]


def test_sign_in_sets_a_strict_http_only_session_and_lists_only_this_tenants_tasks(
        browser, server, trained_task, other_tenant):
    sign_in(browser, server)
    cookie = session_cookie(browser)
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    # The token itself is nowhere in the browser.
    assert server["token"] not in cookie["value"]
    storage = browser.execute_script(
        "return JSON.stringify(localStorage) + JSON.stringify(sessionStorage) + document.cookie")
    assert server["token"] not in storage and "confed_session" not in storage
    rows = browser.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")
    listed = {row.get_attribute("data-task") for row in rows}
    assert trained_task in listed
    assert other_tenant["task"] not in listed
    row = browser.find_element(By.CSS_SELECTOR, f'#tasks tr[data-task="{trained_task}"]')
    assert "COMPLETED" in row.text
    assert row.find_element(By.CSS_SELECTOR, '[data-field="rounds"]').text == f"{ROUNDS} of {ROUNDS}"
    spent = api(server, f"/v1/tasks/{trained_task}/releases")["releases"][-1]["epsilon_spent"]
    assert f"{spent:.3f}" in row.find_element(By.CSS_SELECTOR, '[data-field="privacy"]').text


def test_task_page_plot_and_funnel_show_the_releases_numbers(browser, server, trained_task):
    browser.get(f"{server['url']}/console/tasks/{trained_task}")
    releases = api(server, f"/v1/tasks/{trained_task}/releases")["releases"]
    assert [r["round"] for r in releases] == list(range(1, ROUNDS + 1))
    # The plot: one point per release at its epsilon, and the task's budget.
    plot = browser.find_element(By.ID, "privacy-plot")
    assert float(plot.get_attribute("data-budget")) == 8.0
    points = plot.find_elements(By.CSS_SELECTOR, "circle.spent")
    assert [(int(p.get_attribute("data-round")), float(p.get_attribute("data-epsilon")))
            for p in points] == [(r["round"], r["epsilon_spent"]) for r in releases]
    # The funnel: each round's assignments, uploads, reports and inclusions.
    for release in releases:
        row = browser.find_element(By.CSS_SELECTOR, f'#funnel tr[data-round="{release["round"]}"]')
        cell = lambda field: row.find_element(By.CSS_SELECTOR, f'[data-field="{field}"]').text
        assert int(cell("included")) == release["included"] == DEVICES_PER_ROUND
        assert cell("excluded").startswith(str(release["excluded"]))
        assert int(cell("assigned")) == DEVICES_PER_ROUND
        assert int(cell("uploaded")) == DEVICES_PER_ROUND
        assert int(cell("reported")) == DEVICES_PER_ROUND
        assert cell("epsilon") == f"{release['epsilon_spent']:.4f}"
        assert "verified" in row.text and "NOT verified" not in row.text
    bars = {b.get_attribute("data-stage"): int(b.get_attribute("data-count"))
            for b in browser.find_elements(By.CSS_SELECTOR, "#funnel-chart rect.stage")}
    assert bars == {"accepted": DEVICES_PER_ROUND, "uploaded": DEVICES_PER_ROUND,
                    "reported": DEVICES_PER_ROUND, "included": DEVICES_PER_ROUND}
    # Durations: collection until the round stopped collecting, then aggregation until it
    # completed; together, the round's life as the API reports it.
    rounds = {r["round"]: r for r in api(server, f"/v1/tasks/{trained_task}/rounds")["rounds"]}
    millis = lambda stamp: int(datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
                               .timestamp() * 1000 + 0.5)
    for kind in ("collection", "aggregation"):
        assert len(browser.find_elements(
            By.CSS_SELECTOR, f"#durations-chart rect.{kind}[data-round]")) == ROUNDS
    for number, round_ in rounds.items():
        parts = [int(b.get_attribute("data-millis")) for b in browser.find_elements(
            By.CSS_SELECTOR, f'#durations-chart rect[data-round="{number}"]')]
        assert sum(parts) == millis(round_["closed_at"]) - millis(round_["opened_at"]), parts
    # Model versions 0..ROUNDS, each downloadable.
    links = browser.find_elements(By.CSS_SELECTOR, "#models a")
    assert [link.text for link in links] == [f"version {v}" for v in range(ROUNDS, -1, -1)]
    shoot(browser, "task")
    browser.set_window_size(390, 844)
    try:
        browser.refresh()
        assert_chart_text_inside(browser)
        shoot(browser, "task-phone")
    finally:
        browser.set_window_size(1280, 1000)


def assert_chart_text_inside(browser) -> None:
    """Every label of every chart lies inside its chart's drawing: at a phone's width the
    console sets larger type, and the round-durations chart once cut "round 1" to "und 1"."""
    outside = browser.execute_script("""
        const out = [];
        for (const svg of document.querySelectorAll('svg.chart')) {
            // Screen boxes: they include each label's transform (a rotated axis title).
            const box = svg.getBoundingClientRect();
            for (const text of svg.querySelectorAll('text')) {
                const b = text.getBoundingClientRect();
                if (b.left < box.left - 1 || b.top < box.top - 1
                    || b.right > box.right + 1 || b.bottom > box.bottom + 1) {
                    out.push(`${svg.id}: "${text.textContent}" at x ${(b.left - box.left).toFixed(1)}..${(b.right - box.left).toFixed(1)}, y ${(b.top - box.top).toFixed(1)}..${(b.bottom - box.top).toFixed(1)} of ${box.width.toFixed(1)}x${box.height.toFixed(1)} px`);
                }
            }
        }
        return out;""")
    assert outside == [], outside


def test_model_download_link_serves_the_version(browser, server, trained_task):
    cookie = session_cookie(browser)
    reply = requests.get(f"{server['url']}/console/tasks/{trained_task}/models/{ROUNDS}",
                         cookies={"confed_session": cookie["value"]}, timeout=30)
    assert reply.status_code == 200
    assert "attachment" in reply.headers["Content-Disposition"]
    api_bytes = requests.get(f"{server['url']}/v1/tasks/{trained_task}/models/{ROUNDS}",
                             headers={"Authorization": f"Bearer {server['token']}"}, timeout=30)
    assert reply.content == api_bytes.content


def test_a_task_is_created_opened_and_cancelled_through_the_forms(browser, server, tmp_path):
    browser.get(f"{server['url']}/console/tasks/new")
    shoot(browser, "new-task")
    browser.find_element(By.ID, "name").send_keys("Form phones, FedAdam")
    population = browser.find_element(By.ID, "population")
    population.send_keys("form-phones")
    rounds = browser.find_element(By.ID, "rounds")
    rounds.clear()
    rounds.send_keys("5")
    deadline = browser.find_element(By.ID, "round_deadline_seconds")
    deadline.send_keys("120")
    Select(browser.find_element(By.ID, "server_optimizer")).select_by_value("fedadam")
    browser.find_element(By.ID, "adaptive_clipping").click()
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/tasks'] button[type=submit]").click()
    WebDriverWait(browser, 10).until(
        lambda b: re.search(r"/console/tasks/[0-9a-f-]{36}$", b.current_url))
    task = browser.current_url.rsplit("/", 1)[1]
    created = api(server, f"/v1/tasks/{task}")
    assert created["state"] == "CREATED" and created["rounds"] == 5
    assert created["population"] == "form-phones"
    assert created["name"] == "Form phones, FedAdam"
    assert created["assignment_timeout_seconds"] == 120, "follows the short deadline"
    assert created["server_optimizer"]["name"] == "fedadam"
    assert created["privacy"]["adaptive_clipping"]["target_quantile"] == 0.5
    heading = browser.find_element(By.TAG_NAME, "h1").text
    assert "CREATED" in heading and "Form phones, FedAdam" in heading
    assert browser.find_element(By.ID, "task-id").text == task
    # Upload model version 0 through the form: the task opens.
    model = tmp_path / "model.safetensors"
    model.write_bytes(to_safetensors({"w": np.zeros(3, np.float32)}))
    browser.find_element(By.ID, "model").send_keys(str(model))
    browser.find_element(By.CSS_SELECTOR, "form[enctype='multipart/form-data'] button").click()
    heading_says(browser, "OPEN")
    opened = api(server, f"/v1/tasks/{task}")
    assert opened["state"] == "OPEN" and opened["model_version"] == 0
    assert "deadline" in browser.find_element(By.ID, "live-round").text
    browser.find_element(By.CSS_SELECTOR, "button.danger").click()
    heading_says(browser, "CANCELLED")
    assert api(server, f"/v1/tasks/{task}")["state"] == "CANCELLED"
    assert browser.find_element(By.ID, "failure-reason").text == "Cancelled: cancelled by partner"


def test_an_invalid_form_names_the_field_and_creates_nothing(browser, server):
    before = len(api(server, "/v1/tasks?limit=100")["tasks"])
    browser.get(f"{server['url']}/console/tasks/new")
    browser.find_element(By.ID, "population").send_keys("bad-phones")
    epsilon = browser.find_element(By.ID, "epsilon")
    epsilon.clear()
    epsilon.send_keys("0")
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/tasks'] button[type=submit]").click()
    problem = browser.find_element(By.ID, "epsilon-problem")
    assert problem.text
    assert browser.find_element(By.ID, "epsilon").get_attribute("aria-invalid") == "true"
    assert len(api(server, "/v1/tasks?limit=100")["tasks"]) == before


def test_the_forms_evaluation_defaults_are_accepted_and_a_too_noisy_evaluation_says_so(
        browser, server):
    """The issue's case: epsilon 4, 5 rounds of 20 devices, evaluating every round, noise left
    to its default. The form used to be refused, asking for noise it had no field for; now the
    default fits the budget, the task is created, and its page says the evaluation is too noisy
    to choose a version by."""
    browser.get(f"{server['url']}/console/tasks/new")
    assert browser.find_element(By.ID, "evaluation_stddev").get_attribute("value") == ""
    browser.find_element(By.ID, "population").send_keys("eval-phones")
    for field, value in (("rounds", "5"), ("report_goal", "20"), ("epsilon", "4"),
                         ("evaluation_every", "1")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/tasks'] button[type=submit]").click()
    heading_says(browser, "CREATED")
    task = browser.find_element(By.ID, "task-id").text
    spec = api(server, f"/v1/tasks/{task}")
    assert spec["evaluation"]["stddev"] > 20 * 100 / 20, spec["evaluation"]
    warning = browser.find_element(By.ID, "evaluation-too-noisy").text
    assert warning.startswith("Too noisy to choose a version by."), warning
    shoot(browser, "evaluation-too-noisy")


def test_a_missing_field_and_an_out_of_range_value_are_both_named_after_one_submit(browser, server):
    browser.get(f"{server['url']}/console/tasks/new")
    browser.find_element(By.ID, "population").send_keys("range-phones")
    browser.find_element(By.ID, "rounds").clear()  # required: the form's own check
    epsilon = browser.find_element(By.ID, "epsilon")
    epsilon.clear()
    epsilon.send_keys("400")  # out of the API's range
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/tasks'] button[type=submit]").click()
    assert browser.find_element(By.ID, "rounds-problem").text == "is required"
    assert "100" in browser.find_element(By.ID, "epsilon-problem").text


def test_a_refusal_no_field_shows_is_in_the_banner_in_the_apis_words(browser, server):
    browser.get(f"{server['url']}/console/tasks/new")
    browser.find_element(By.ID, "population").send_keys("tiny-phones")
    for field, value in (("rounds", "100"), ("report_goal", "2"), ("epsilon", "0.5")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/tasks'] button[type=submit]").click()
    banner = browser.find_element(By.ID, "form-problems").text
    assert banner.startswith("The task was not created: privacy: ") and "report_goal" in banner
    assert "marked below" not in banner, "no field is marked, so none is promised"
    shoot(browser, "new-task-refused")


def test_another_tenants_task_is_not_reachable_by_url(browser, server, other_tenant):
    for path in (f"/console/tasks/{other_tenant['task']}",
                 f"/console/tasks/{other_tenant['task']}/models/0"):
        browser.get(f"{server['url']}{path}")
        assert "404" in browser.find_element(By.TAG_NAME, "h1").text
        assert other_tenant["task"] in browser.find_element(By.CSS_SELECTOR, "[role=alert]").text
    # Nor can a form of this tenant's session cancel it.
    cookie = session_cookie(browser)
    browser.get(f"{server['url']}/console/tasks")
    csrf = browser.find_element(By.NAME, "csrf").get_attribute("value")
    reply = requests.post(f"{server['url']}/console/tasks/{other_tenant['task']}/cancel",
                          data={"csrf": csrf}, cookies={"confed_session": cookie["value"]},
                          headers={"Origin": server["url"]}, allow_redirects=False, timeout=30)
    assert reply.status_code == 404
    assert api(server, f"/v1/tasks/{other_tenant['task']}", other_tenant["token"])["state"] == "OPEN"


class _Attacker(http.server.BaseHTTPRequestHandler):
    target = ""

    def do_GET(self):
        page = (f'<form method="post" action="{self.target}"><input type="hidden" name="csrf" '
                f'value="guess"><button id="go">win a prize</button></form>').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args):
        pass


def test_forged_posts_without_the_csrf_token_are_refused(browser, server):
    partner_task = requests.post(
        f"{server['url']}/v1/tasks", headers={"Authorization": f"Bearer {server['token']}"},
        json={"population": "forged-phones", "rounds": 1, "report_goal": 2,
              "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0}}, timeout=30).json()["id"]
    cancel = f"{server['url']}/console/tasks/{partner_task}/cancel"
    # From another site (same host, other port: same-site, so the Strict cookie is sent).
    _Attacker.target = cancel
    # Threaded: Chromium opens spare connections that a one-at-a-time server would wait on.
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    attacker.daemon_threads = True
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{attacker.server_port}/")
        browser.find_element(By.ID, "go").click()
        WebDriverWait(browser, 10).until(expected_conditions.url_contains("/cancel"))
        assert "403" in browser.find_element(By.TAG_NAME, "h1").text
    finally:
        attacker.shutdown()
    # From this origin but without the session's token (a script or a copied form).
    cookie = session_cookie(browser)
    for data in ({"reason": "no token at all"}, {"csrf": "guess"}):
        reply = requests.post(cancel, data=data, cookies={"confed_session": cookie["value"]},
                              headers={"Origin": server["url"]}, allow_redirects=False,
                              timeout=30)
        assert reply.status_code == 403, reply.text
        assert "security token" in reply.text
    # With the token but saying nothing of where it comes from (no Origin): refused too.
    browser.get(f"{server['url']}/console/tasks")
    csrf = browser.find_element(By.NAME, "csrf").get_attribute("value")
    reply = requests.post(cancel, data={"csrf": csrf}, cookies={"confed_session": cookie["value"]},
                          allow_redirects=False, timeout=30)
    assert reply.status_code == 403 and "another site" in reply.text
    assert api(server, f"/v1/tasks/{partner_task}")["state"] == "CREATED"


def test_a_release_row_copied_from_another_round_is_not_verified(browser, server, trained_task):
    """The operator of the database copies round 1's genuine release (manifest, proof, average
    digest) over round 2's: every signature still verifies, but it is not round 2's release."""
    db = sqlite3.connect(os.path.join(server["data"], "confed.db"), timeout=30)
    columns = "manifest_json, proof_json, average_sha256"
    row = lambda n: db.execute(f"SELECT {columns} FROM releases WHERE task_id = ? AND "
                               "round_number = ?", (trained_task, n)).fetchone()
    original, copied = row(2), row(1)
    update = (f"UPDATE releases SET manifest_json = ?, proof_json = ?, average_sha256 = ? "
              "WHERE task_id = ? AND round_number = 2")
    try:
        db.execute(update, (*copied, trained_task))
        db.commit()
        browser.get(f"{server['url']}/console/tasks/{trained_task}")
        row2 = browser.find_element(By.CSS_SELECTOR, '#funnel tr[data-round="2"]')
        assert "NOT verified" in row2.text
        details = browser.find_element(By.CSS_SELECTOR, 'details[data-round="2"]')
        assert "FAILED: the manifest is for task" in details.get_attribute("textContent")
        row1 = browser.find_element(By.CSS_SELECTOR, '#funnel tr[data-round="1"]')
        assert "NOT verified" not in row1.text and "verified" in row1.text
    finally:
        db.execute(update, (*original, trained_task))
        db.commit()
        db.close()
    browser.get(f"{server['url']}/console/tasks/{trained_task}")
    assert "NOT verified" not in browser.find_element(By.ID, "funnel").text


def test_populations_show_recent_check_ins_and_their_outcomes(browser, server, trained_task):
    browser.get(f"{server['url']}/console/populations")
    section = browser.find_element(By.CSS_SELECTOR, 'section[data-population="console-phones"]')
    checkins = int(section.find_element(By.CSS_SELECTOR, '[data-field="checkins"]').text)
    assigned = int(section.find_element(By.CSS_SELECTOR, 'tr[data-outcome="assigned"] td').text)
    no_task = int(section.find_element(By.CSS_SELECTOR, 'tr[data-outcome="no_task"] td').text)
    assert assigned == ROUNDS * DEVICES_PER_ROUND
    assert no_task == 2
    assert checkins == assigned + no_task
    shoot(browser, "populations")
    # The task list, now with the tasks the other tests made (for docs/console/).
    browser.get(f"{server['url']}/console/tasks")
    shoot(browser, "tasks")


def axe_violations(browser) -> list[str]:
    """WCAG 2.0/2.1 A and AA violations axe-core finds on the current page (the script is
    injected through WebDriver, which the page's script-free CSP does not govern)."""
    browser.execute_script(pathlib.Path(os.environ["AXE_JS"]).read_text(encoding="utf-8"))
    return browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        axe.run(document, {runOnly: {type: "tag",
                                     values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]}})
           .then(r => done(r.violations.map(v => v.id + ": " + v.help + " at " +
                                                 v.nodes.map(n => n.target.join(" ")).join(", "))));
    """)


@pytest.mark.skipif(not os.environ.get("AXE_JS"), reason="tests/browser/run.sh provides axe-core")
def test_the_task_page_lists_the_evaluated_model_versions(browser, server, trained_task):
    browser.get(f"{server['url']}/console/tasks/{trained_task}")
    rows = browser.find_elements(By.CSS_SELECTOR, "#evaluations tbody tr")
    assert [r.get_attribute("data-version") for r in rows] == ["0", "2"]
    listed = Partner(server["url"], server["token"]).evaluations(trained_task)["evaluations"]
    # The model-quality charts: one point per evaluated version that has the metric (noise can
    # leave too few examples for one), at the released value.
    for chart, metric, scale in (("accuracy-chart", "accuracy", 100.0), ("loss-chart", "loss", 1.0)):
        points = browser.find_elements(By.CSS_SELECTOR, f"#{chart} circle[data-version]")
        drawn = [(int(p.get_attribute("data-version")), float(p.get_attribute("data-value")))
                 for p in points]
        released = [(p["model_version"], p[metric] * scale) for p in listed
                    if p.get(metric) is not None]
        assert [v for v, _ in drawn] == [v for v, _ in released], chart
        assert all(abs(a - b) < 1e-9 * max(1.0, abs(b)) for (_, a), (_, b) in zip(drawn, released))
    shown = [r.find_element(By.CSS_SELECTOR, "[data-field=examples]").text for r in rows]
    assert shown == [f"{p['examples']:.0f}" for p in listed]


def test_every_page_meets_wcag_aa_by_axe(browser, server, trained_task):
    for path in ("/console/tasks", f"/console/tasks/{trained_task}", "/console/tasks/new",
                 "/console/populations"):
        browser.get(f"{server['url']}{path}")
        assert axe_violations(browser) == [], path
    browser.set_window_size(390, 844)
    browser.get(f"{server['url']}/console/tasks/{trained_task}")
    assert axe_violations(browser) == [], "the task page on a phone"
    # Chart text stays readable on a phone (at least 10 px as drawn).
    sizes = browser.execute_script(
        "return [...document.querySelectorAll('svg text')].map(t => t.getBoundingClientRect().height)")
    assert sizes and min(sizes) >= 10, sizes
    browser.set_window_size(1280, 1000)
    # ...and the round table fits a laptop's width without scrolling sideways.
    browser.get(f"{server['url']}/console/tasks/{trained_task}")
    region = browser.find_element(By.CSS_SELECTOR, "div.scroll:has(#funnel)")
    assert browser.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth",
                                  region), "the round table overflows at 1280 px"


def test_sign_out_ends_the_session_on_the_server(browser, server):
    old = session_cookie(browser)["value"]
    browser.get(f"{server['url']}/console/tasks")
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/sign-out'] button").click()
    WebDriverWait(browser, 10).until(expected_conditions.url_contains("/console/sign-in"))
    browser.get(f"{server['url']}/console/tasks")
    assert browser.current_url.endswith("/console/sign-in")
    # The old cookie, replayed, no longer signs anyone in.
    reply = requests.get(f"{server['url']}/console/tasks", cookies={"confed_session": old},
                         allow_redirects=False, timeout=30)
    assert reply.status_code == 303 and reply.headers["Location"] == "/console/sign-in"


def test_a_wrong_token_is_refused_with_a_clear_message(browser, server):
    browser.get(f"{server['url']}/console/sign-in")
    field = browser.find_element(By.ID, "token")
    field.send_keys("cft_0000000000000000_not-a-real-secret")
    field.submit()
    assert "not valid" in browser.find_element(By.ID, "sign-in-problem").text
    assert not [c for c in browser.get_cookies() if c["name"] == "confed_session"]
    if os.environ.get("AXE_JS"):
        assert axe_violations(browser) == [], "the sign-in page with its problem"
