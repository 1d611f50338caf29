"""The release console in a real browser: headless Debian chromium, driven through Selenium, against
the real release API (release/api.py) over a real store on an SQLite file, on a loopback port.

The store is seeded through its own API (add_candidate, transition, save) with a realistic history:
a version the gate rejected, one rolled back for a breached guardrail, one superseded, and a canary
that passed its analysis and awaits approval, its accept-rate history and always-valid band
computed by release/sequential.py from simulated outcomes. A person then looks at it, is refused as
a viewer (403, nothing changes), approves as an approver (promoted: the page and the store agree),
and is refused a second promotion inside the promotion interval (409, the reason shown). Then undo:
stable back to an earlier promoted version, confirmed in a second click, refused in the server's
words for a version never promoted, the version already stable, under a live canary and for a
version whose checkpoint fails verification, and done for one a real checkpoint store verifies.

Skipped, saying why, where chromium or chromedriver is not installed (``apt-get install chromium
chromium-driver``; .ci/run installs both). Run alone with
``.venv/bin/pytest tests/integration/test_release_console.py``.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_release_ops import commit_versions

from flywheel.settings import ReleaseSettings
from release.judge import ArmStats, CanaryMeasurement, CanaryPolicy, judge_canary
from release.sequential import PairCount, confidence_band, log_e_better, log_e_worse
from release.states import State
from release.store import ReleaseStore, Routing

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
APPROVER, VIEWER = "tok-alice-approver", "tok-vic-viewer"
TOKENS = (f"alice:approver:{APPROVER}", f"vic:viewer:{VIEWER}")
#: A reason with markup in it: the page must show it as text (no element made from it).
MARKUP_REASON = "<b id=injected>bold</b> is not a reason"
WAIT_S = 8.0  # longest wait for one thing to show (the page polls every 2 s)


# -- a realistic store ---------------------------------------------------------------------------

def _event(version: int, parent: int | None) -> dict[str, Any]:
    return {"version": version, "parent": parent, "uri": f"file:///data/checkpoints/v{version}",
            "manifest_sha256": f"{version:064x}", "step": 200 * version,
            "metrics": {"entropy": 1.9, "distinct_frac": 0.8}}


def canary_analysis(stable_rate: float, canary_rate: float, n: int, started_at: float,
                    alpha: float = 0.05, seed: int = 7, pass_alpha: float = 0.025) -> dict[str, Any]:
    """The analysis the controller saves (release/controller.py, ``_record``) for a canary after
    ``n`` simulated outcomes per arm, judged by release/judge.py, with the history the console
    draws (a point per 10 outcomes, one every 2 minutes)."""
    rng = random.Random(seed)
    pairs, stable, canary, history = PairCount(), [], [], []
    for i in range(1, n + 1):
        s, c = rng.random() < stable_rate, rng.random() < canary_rate
        stable.append(s)
        canary.append(c)
        pairs = pairs.add(c, s)
        if i % 10 == 0:
            lo, hi = confidence_band(pairs, alpha)
            history.append({"t": started_at + 12.0 * i, "stable_rate": sum(stable) / i,
                            "canary_rate": sum(canary) / i, "band_lo": lo, "band_hi": hi,
                            "e_better": math.exp(min(log_e_better(pairs), 700.0)),
                            "e_worse": math.exp(min(log_e_worse(pairs), 700.0))})
    arms = {"stable": ArmStats(outcomes=n, accepts=sum(stable), requests=2 * n, errors=3, latency_ms_p95=812.0,
                               completion_tokens_mean=41.3, flagged=2, rewards=n),
            "canary": ArmStats(outcomes=n, accepts=sum(canary), requests=2 * n, errors=4, latency_ms_p95=861.0,
                               completion_tokens_mean=44.9, flagged=3, rewards=n)}
    m = CanaryMeasurement(arms["stable"], arms["canary"], pairs, elapsed_s=12.0 * n)
    verdict = judge_canary(m, replace(CanaryPolicy.of(ReleaseSettings(alpha=alpha)), pass_alpha=pass_alpha))
    last = history[-1]
    return {
        "outcome": verdict.outcome.value, "reasons": list(verdict.reasons),
        **{name: {**asdict(a), "accept_rate": a.accept_rate, "error_rate": a.error_rate,
                  "reject_share": a.reject_share, "flag_rate": a.flag_rate, **degenerate}
           for (name, a), degenerate in zip(arms.items(), DEGENERACY)},
        "char_class": "vowels",
        "pairs": asdict(pairs), "e_better": last["e_better"], "e_worse": last["e_worse"],
        "band": [last["band_lo"], last["band_hi"]], "alpha": alpha, "pass_alpha": pass_alpha, "excluded_users": 2,
        "flagged_after_counting": 0, "elapsed_s": m.elapsed_s, "history": history,
    }


#: The degeneracy guardrails' numbers the controller records per arm (stable, canary).
DEGENERACY = ({"repetition": 0.135, "char_class_share": 0.284, "collapsed_share": 0.0},
              {"repetition": 0.141, "char_class_share": 0.301, "collapsed_share": 0.02})


GATE_PASS = {"outcome": "pass", "reasons": ["32 held-out prompts: every check within its limit"],
             "measurement": {"prompts": 32, "stable_length_mean": 40.2, "candidate_length_mean": 43.9,
                             "kl_from_stable": 0.21, "stable_entropy": 1.93, "candidate_entropy": 1.81,
                             "evals": [{"name": "known_answers", "method": "greedy", "items": 344,
                                        "stable_right": 62, "stable_wrong": 28, "candidate_right": 90,
                                        "candidate_wrong": 30, "diff_sum": 13.0, "diff_sq": 40.0}]}}


def seed(store: ReleaseStore, canary: int = 4) -> None:
    """Versions 1 .. ``canary``: v1 rejected by the gate, v2 rolled back on a guardrail, v3
    superseded, and ``canary`` live on 10% of users, its analysis passed, awaiting approval.
    Stable stays v0, the model serving started on."""
    c = "controller"
    for v in range(1, canary + 1):
        store.add_candidate(_event(v, v - 1 if v > 1 else None), "controller:test")
    store.transition(1, State.GATING, c, "gate started")
    store.save(1, gate={"outcome": "fail", "reasons": ["KL from stable 1.840 nats/token (at most 1.0)"],
                        "measurement": {"prompts": 32, "kl_from_stable": 1.84}})
    store.transition(1, State.REJECTED, c, f"gate failed: {MARKUP_REASON}")
    store.transition(2, State.GATING, c, "gate started")
    store.save(2, gate=GATE_PASS)
    store.transition(2, State.CANARY, c, "gate passed", routing=Routing(0, 2, 0.1))
    store.save(2, analysis={"outcome": "fail", "reasons": ["guardrail latency: p95 1900 ms against 800 ms (at most x1.5)"]})
    store.transition(2, State.ROLLED_BACK, c, "analysis fail: guardrail latency: p95 1900 ms against 800 ms",
                     routing=Routing(0, None, 0.0))
    store.transition(3, State.SUPERSEDED, c, f"version {canary} arrived while it waited")
    store.transition(canary, State.GATING, c, "gate started")
    store.save(canary, gate=GATE_PASS)
    started = time.time() - 12.0 * 500
    store.transition(canary, State.CANARY, c, "gate passed", routing=Routing(0, canary, 0.1))
    analysis = canary_analysis(0.58, 0.70, 500, started)
    assert analysis["outcome"] == "pass", analysis["reasons"]  # the seed is what it says it is
    store.save(canary, analysis=analysis)
    store.transition(canary, State.AWAITING_APPROVAL, c, f"analysis passed: {analysis['reasons'][0]}",
                     {"verdict": "pass"})


# -- the server and the browser ------------------------------------------------------------------

@pytest.fixture
def trust() -> dict[str, Any]:
    """What the console's controller report says of signing: the real verifier and signer the
    controller would hold (release/streams.py ``signing_report``), swapped by the test. At first a
    controller with no keys at all: checkpoints unverified, routings unsigned."""
    from flywheel.signing import Signer, Verifier

    return {"verifier": Verifier.load([], setting="release.trusted_checkpoint_keys"), "signer": Signer()}


@pytest.fixture
def console(tmp_path: Path, trust: dict[str, Any]) -> Iterator[tuple[str, ReleaseStore]]:
    """The API on a loopback port over the seeded store, verifying undo targets against a real
    checkpoint store at ``<tmp_path>/checkpoints`` (empty: the test commits what it needs), with
    a controller report that says what ``trust`` holds."""
    from flywheel.checkpoints import CheckpointStore
    from release.api import make_app
    from release.controller import verify_version
    from release.main import ApiServer
    from release.streams import signing_report

    def status() -> dict[str, Any]:
        return {"controller": "console-test", "active": True, "last_tick_age_s": 0.1,
                "signing": signing_report(trust["verifier"], trust["signer"])}

    url = f"sqlite:///{tmp_path / 'release.sqlite3'}"
    seeding = ReleaseStore(url)
    seed(seeding)
    seeding.close()
    app_store, check_store = ReleaseStore(url), ReleaseStore(url)  # the app's own connection, and ours
    settings = ReleaseSettings(tokens=TOKENS, promotion_interval_s=3600.0)
    checkpoints = CheckpointStore(tmp_path / "checkpoints")
    server = ApiServer(make_app(app_store, settings, status, verify=partial(verify_version, checkpoints)),
                       "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{server.port}", check_store
    finally:
        server.stop()
        app_store.close()
        check_store.close()


@pytest.fixture
def browser(tmp_path: Path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                    "apt-get install chromium chromium-driver")
    from selenium import webdriver  # the dev extra: missing, it is an install error, not a skip
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,800", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


def wait_for(driver, what: str, check, timeout_s: float = WAIT_S):
    """Poll ``check(driver)`` until it gives something truthy; fail naming ``what`` otherwise."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.05,
                             ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: check(d))
    except Exception as exc:
        raise AssertionError(f"did not see {what} within {timeout_s}s; page says: "
                             f"{driver.find_element('tag name', 'body').text[:2000]}") from exc


def row_state(driver, version: int) -> str:
    return driver.find_element("css selector", f'tr[data-version="{version}"] td:nth-child(2)').text


def use_token(driver, token: str) -> None:
    field = driver.find_element("id", "token")
    field.clear()
    field.send_keys(token)
    driver.find_element("id", "token-use").click()


# -- the test ------------------------------------------------------------------------------------

BY_CSS = "css selector"


def sees_the_canary(browser) -> None:
    """The routing, the table, the live canary's charts, verdict and reasons, and the audit log."""
    wait_for(browser, "the candidates table", lambda d: len(d.find_elements(BY_CSS, "#candidates-body tr")) == 4)
    status = browser.find_element("id", "status").text
    assert "Stable v0" in status and "Canary v4" in status and "10.0%" in status and "running" in status
    assert [row_state(browser, v) for v in (1, 2, 3, 4)] == ["rejected", "rolled back", "superseded",
                                                            "awaiting approval"]
    assert browser.find_element("id", "detail-h").text == "Version 4"  # the live canary, unasked
    lines = browser.find_elements(BY_CSS, "#rate-chart svg path.line")
    assert {p.get_attribute("class") for p in lines} == {"line stable", "line canary"}
    assert all(p.get_attribute("d").count("L") == 49 for p in lines)  # 50 points each
    assert browser.find_elements(BY_CSS, "#band-chart svg path.band")
    assert browser.find_elements(BY_CSS, "#band-chart svg line.ref")  # the 0.5 line
    assert browser.find_element("id", "verdict").text == "pass"
    assert "canary accepted more often" in browser.find_element("id", "reasons").text
    evidence = browser.find_element("id", "evidence").text
    assert "(PASS at 40, FAIL at 20)" in evidence and "2 users flagged by reward's guards left out" in evidence
    guard = browser.find_element("id", "guardrails-body").text
    assert "latency p95 812 ms 861 ms" in guard and "breached" not in guard and "within" in guard
    assert "character repetition 0.135 0.141 +0.6 pt" in guard and "vowels share 28.4% 30.1%" in guard
    assert "collapsed answers 0.0% 2.0%" in guard
    # the gate's held-out evals, both versions' scores: right 1, wrong 0, no answer 0.5
    assert browser.find_element("id", "gate-evals-body").text == (
        "known_answers (greedy) 0.549 0.587 90 / 30 against 62 / 28 344")
    audit = browser.find_element("id", "audit-body").text
    assert newest_audit(browser)[0] == "v4 canary → awaiting approval by controller"
    assert MARKUP_REASON in audit and not browser.find_elements(BY_CSS, "#injected")  # text, never markup


def sees_what_is_signed(browser, trust: dict[str, Any], tmp_path: Path) -> None:
    """Signing off is in the status line for every viewer (it was only one log line at start);
    then keys are configured, one of their files malformed: the trusted key ids, the refused file
    and the routings' key id show."""
    from flywheel.signing import Signer, Verifier, generate_key_pair

    status = browser.find_element("id", "status").text
    assert "Checkpoints not verified" in status and "Routings unsigned" in status
    generate_key_pair(tmp_path / "keys", "trainer-2026-11")
    private, _ = generate_key_pair(tmp_path / "signing", "release-2026-11")
    (tmp_path / "keys" / "trainer-2026-12.pub").write_text("half a key")  # a rotation's file, half written
    trust["verifier"] = Verifier.load([tmp_path / "keys"], setting="release.trusted_checkpoint_keys")
    trust["signer"] = Signer.load(private, setting="release.signing_key")
    said = wait_for(browser, "the trusted keys", lambda d: "Checkpoints verified" in d.find_element("id", "status").text
                    and d.find_element("id", "status").text)
    assert "Checkpoints verified (trainer-2026-11)" in said and "not verified" not in said
    assert "Key file refused" in said and "trainer-2026-12.pub" in said
    assert "Routings signed with release-2026-11" in said and "unsigned" not in said
    refused = browser.find_element(BY_CSS, "#status .refused-key")
    assert "not an Ed25519 public key" in refused.get_attribute("title") or "cannot read" in refused.get_attribute("title")


def newest_audit(browser) -> tuple[str, str]:
    """The newest audit entry as shown: (what changed and by whom, why)."""
    row = browser.find_element(BY_CSS, "#audit-body tr:first-child")
    return row.find_element(BY_CSS, ".entry-head").text, row.find_element(BY_CSS, ".reason").text


def action_message(browser, code: str) -> str:
    return wait_for(browser, f"the {code} message", lambda d: code in d.find_element("id", "action-msg").text
                    and d.find_element("id", "action-msg").text)


def test_console_shows_the_canary_approves_it_and_undoes(browser, console, trust, tmp_path, tiny_model_dir) -> None:
    url, store = console
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
    browser.get(url + "/")
    assert "Not connected" in browser.find_element("id", "conn").text

    use_token(browser, "not-a-token")
    wait_for(browser, "the 401", lambda d: "401" in d.find_element("id", "conn").text)
    assert "invalid token" in browser.find_element("id", "conn").text
    assert not browser.find_element("id", "main").is_displayed()

    use_token(browser, VIEWER)
    sees_the_canary(browser)
    sees_what_is_signed(browser, trust, tmp_path)

    # a viewer may look, not approve: the 403 is shown in the server's words, and nothing changes
    browser.find_element("id", "reason").send_keys("looks good to me")
    browser.find_element("id", "approve").click()
    assert "needs the approver role; vic is a viewer" in action_message(browser, "403")
    assert store.get(4).state == State.AWAITING_APPROVAL and store.stable_version() == 0

    # an approver approves: promoted in the page and in the store, the reason in the audit log
    use_token(browser, APPROVER)
    reason = browser.find_element("id", "reason")
    reason.clear()
    reason.send_keys("lift holds across 500 outcomes")
    browser.find_element("id", "approve").click()
    wait_for(browser, "v4 promoted in the table", lambda d: row_state(d, 4) == "promoted")
    assert browser.find_element("id", "action-msg").text == "v4 approved."
    assert store.get(4).state == State.PROMOTED and store.stable_version() == 4
    assert store.audit(4, limit=1)[0].actor == "alice"
    wait_for(browser, "the approval in the audit log", lambda d: newest_audit(d) == (
        "v4 awaiting approval → promoted by alice", "lift holds across 500 outcomes"))
    assert not browser.find_element("id", "decide").is_displayed()  # nothing left to decide on v4

    # a second promotion inside the promotion interval: the 409 and its reason are shown
    store.add_candidate(_event(5, 4), "controller:test")
    store.transition(5, State.GATING, "controller", "gate started")
    store.transition(5, State.CANARY, "controller", "gate passed", routing=Routing(4, 5, 0.1))
    store.transition(5, State.HELD, "controller", "held for a person: no verdict after 3600s")
    wait_for(browser, "the way back to the live canary", lambda d: d.find_element("id", "follow-live").is_displayed())
    browser.find_element("id", "follow-live").click()
    wait_for(browser, "v5 held, to decide on", lambda d: d.find_element("id", "approve").text == "Approve v5")
    browser.find_element("id", "approve").click()
    assert "the next promotion is allowed in" in action_message(browser, "409")
    assert store.get(5).state == State.HELD and store.stable_version() == 4

    undoes(browser, store, tmp_path, tiny_model_dir)

    csp = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
    assert not csp, csp


def ask_undo(browser, version: int | str, reason: str) -> None:
    """Fill in the undo form and give its first click; the second is the caller's."""
    for field, text in (("undo-to", str(version)), ("undo-reason", reason)):
        box = browser.find_element("id", field)
        box.clear()
        box.send_keys(text)
    browser.find_element("id", "undo-ask").click()


def undo_refused(browser, version: int, words: str) -> None:
    ask_undo(browser, version, "trying the way back")
    wait_for(browser, "the confirmation", lambda d: d.find_element("id", "undo-yes").is_displayed())
    browser.find_element("id", "undo-yes").click()
    said = wait_for(browser, f"undo to v{version} refused", lambda d: "refused" in d.find_element("id", "undo-msg").text
                    and d.find_element("id", "undo-msg").text)
    assert said.startswith(f"Undo to v{version} refused (409, not possible now): ") and words in said, said


def undoes(browser, store: ReleaseStore, tmp_path: Path, model_dir: Path) -> None:
    """Stable v4, v5 held. v5 is rolled back; v6 (a real checkpoint) promoted and v7 (real) made
    the live canary, later promoted; the console's undo is refused four ways and done once."""
    from flywheel.checkpoints import CheckpointStore

    shas = commit_versions(CheckpointStore(tmp_path / "checkpoints"), model_dir, (6, 7))
    store.transition(5, State.ROLLED_BACK, "controller", "rolled back for the undo test", routing=Routing(4, None, 0.0))
    for v, parent in ((6, 4), (7, 6)):
        store.add_candidate({**_event(v, parent), "manifest_sha256": shas[v]}, "controller:test")
        store.transition(v, State.GATING, "controller", "gate started")
        store.transition(v, State.CANARY, "controller", "gate passed", routing=Routing(store.stable_version(), v, 0.1))
        if v == 6:  # v7 stays the live canary
            store.transition(6, State.PROMOTED, "alice", "approved", routing=Routing(6, None, 0.0))
    wait_for(browser, "the promoted versions offered", lambda d: d.find_element("id", "undo-hint").text.startswith(
        "Promoted before: v6 (stable now), v4."))
    assert [o.get_attribute("value") for o in browser.find_elements(BY_CSS, "#undo-versions option")] == ["4"]

    # the form says what is missing before anything is sent; the first click only asks
    ask_undo(browser, "", "no version given")
    assert "Give the number of the version" in browser.find_element("id", "undo-msg").text
    ask_undo(browser, 4, "<i id=undo-injected>v6 answers worse</i>")
    assert browser.find_element("id", "undo-question").text == "Every user goes back from v6 to v4, once it is verified again."
    browser.find_element("id", "undo-no").click()  # cancelled: nothing sent
    assert not browser.find_element("id", "undo-confirm").is_displayed() and store.stable_version() == 6

    undo_refused(browser, 3, "version 3 is superseded: only a version promoted before can be stable again")
    undo_refused(browser, 6, "version 6 is already stable")
    undo_refused(browser, 4, "a canary is live (v7): roll it back first, then undo")
    store.transition(7, State.PROMOTED, "auto-promote policy", "analysis passed", routing=Routing(7, None, 0.0))
    # v4's announcement named a manifest no checkpoint store holds: refused, stable stays
    undo_refused(browser, 4, "version 4 failed verification, stable stays")
    assert store.stable_version() == 7

    # back to v6, which the checkpoint store verifies
    reason = "<b id=undo-injected>v7</b> answers worse in French"
    ask_undo(browser, 6, reason)
    wait_for(browser, "the confirmation", lambda d: d.find_element("id", "undo-yes").text == "Confirm: stable back to v6")
    browser.find_element("id", "undo-yes").click()
    said = wait_for(browser, "the undo done", lambda d: "again" in d.find_element("id", "undo-msg").text
                    and d.find_element("id", "undo-msg").text)
    assert said.startswith("Stable is v6 again (revision ")
    assert store.stable_version() == 6 and store.audit(6, limit=1)[0].actor == "alice"
    wait_for(browser, "stable v6 in the status line", lambda d: "Stable v6" in d.find_element("id", "status").text)
    wait_for(browser, "the undo in the audit log", lambda d: newest_audit(d) == (
        "v6 note by alice", f"undo: stable back to v6 from v7: {reason}"))
    assert not browser.find_elements(BY_CSS, "#undo-injected")  # the reason is text, never markup
    assert browser.find_element("id", "undo-reason").get_attribute("value") == ""
