"""``flywheel release ...``: the release controller's REST API (release/api.py) from a terminal.

::

    flywheel release status                       stable, canary, pause, lease, controller
    flywheel release list                         every candidate, one line each
    flywheel release show V                       one candidate: gate, live analysis, audit
    flywheel release approve V [--reason R]       promote V (approver)
    flywheel release reject V [--reason R]        turn V down (approver)
    flywheel release rollback [--reason R] [--version V]   end the live canary (approver)
    flywheel release pause --reason R             stop starting gates and canaries (admin)
    flywheel release resume --reason R            start them again (admin)
    flywheel release undo --to N [--reason R]       stable back to an earlier promoted version N (approver)
    flywheel release audit [--version V] [--limit N]
    flywheel release status --watch [--interval S] print the status again whenever it changes (Ctrl-C ends)

Every read command (``status``, ``list``, ``show``, ``audit``) takes ``-o json``: the API's own JSON
body, one line (with ``--watch``, one line per change), for scripts and ``jq`` (flywheel/output.py).

Every command talks HTTP to ``--url`` (default ``http://<release.host>:<release.port>``) with
``--token`` or ``--token-file`` (default ``FLYWHEEL_RELEASE_TOKEN`` or
``FLYWHEEL_RELEASE_TOKEN_FILE``), so it works from any machine that can reach the controller and
does exactly what the console does, with the same checks and the same audit entries. An error from
the API is printed as ``error: <message>``. Exit codes (:data:`EXIT_AUTH`): 0 done; 1 refused or
failed (a 409, a controller out of reach); 2 a usage error, before anything is sent (argparse's,
and a token file that cannot be read); 77 the token is missing, wrong or its role too low (401, 403).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import httpx

from flywheel.output import as_json
from flywheel.terminal import escape

#: Exit codes: what went wrong, for scripts. Authentication and authorization failures (401, 403)
#: get sysexits.h's EX_NOPERM, 77, not 2: 2 is every usage error (argparse exits 2), and a script
#: must tell "fix the command" from "fix the token or ask for a role" without parsing stderr. 77
#: is the one code with that meaning already written down, and no shell or Python code collides
#: with it (1 and 2 are Python's, 126-165 the shell's and signals').
EXIT_OK, EXIT_ERROR, EXIT_AUTH = 0, 1, 77


class ApiError(Exception):
    """The API answered with an error (``status`` 0: it could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ReleaseClient:
    """The JSON API over HTTP; every method returns the decoded body or raises :class:`ApiError`."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/api/status")

    def candidates(self) -> list[dict[str, Any]]:
        return self._call("GET", "/api/candidates")["candidates"]

    def candidate(self, version: int) -> dict[str, Any]:
        return self._call("GET", f"/api/candidates/{version}")

    def approve(self, version: int, reason: str | None) -> dict[str, Any]:
        return self._call("POST", f"/api/candidates/{version}/approve", _reason(reason))

    def reject(self, version: int, reason: str | None) -> dict[str, Any]:
        return self._call("POST", f"/api/candidates/{version}/reject", _reason(reason))

    def rollback(self, reason: str | None, version: int | None = None) -> dict[str, Any]:
        body = _reason(reason) | ({"version": version} if version is not None else {})
        return self._call("POST", "/api/rollback", body)

    def undo(self, to: int, reason: str | None) -> dict[str, Any]:
        return self._call("POST", "/api/undo", {"to": to} | _reason(reason))

    def pause(self, reason: str) -> dict[str, Any]:
        return self._call("POST", "/api/pause", {"reason": reason})

    def resume(self, reason: str) -> dict[str, Any]:
        return self._call("POST", "/api/resume", {"reason": reason})

    def audit(self, version: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("version", version), ("limit", limit)) if v is not None}
        return self._call("GET", "/api/audit", params=params)["entries"]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None) -> Any:
        try:
            resp = self.http.request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the release controller at {self.url} "
                              f"({type(exc).__name__}: {exc})") from None
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, _message(resp))
        try:
            return resp.json()
        except ValueError:
            raise ApiError(resp.status_code, f"{self.url}{path} did not answer JSON: is it the "
                                             "release controller?") from None


def _reason(reason: str | None) -> dict[str, Any]:
    return {"reason": reason} if reason else {}


def _message(resp: httpx.Response) -> str:
    """The API's ``detail`` sentence, or the status line when something else answered."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else f"HTTP {resp.status_code} {resp.reason_phrase}"


# -- formatting ---------------------------------------------------------------------------------

def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart; the last column is not padded (it
    holds free text such as reasons)."""
    # every cell escaped (flywheel/terminal.py): a stored reason or actor must not print a line
    # break, an escape sequence or a bidirectional override, which forged audit rows
    cells = [[escape(h) for h in headers]] + [["-" if c is None else escape(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c if i == len(r) - 1 else c.ljust(widths[i]) for i, c in enumerate(r)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def when(t: float | None) -> str:
    """Epoch seconds as a UTC time a person reads (audit logs from several machines line up)."""
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def _verdict(summary: dict[str, Any] | None) -> str:
    return (summary or {}).get("outcome") or "-"


def format_candidates(candidates: list[dict[str, Any]]) -> str:
    if not candidates:
        return "no candidates yet: the controller has not seen a published checkpoint"
    rows = [(c["version"], c.get("parent"), c.get("step"), c["state"], _verdict(c.get("gate_summary")),
             _verdict(c.get("analysis_summary")), when(c.get("updated_at"))) for c in candidates]
    return table(("VERSION", "PARENT", "STEP", "STATE", "GATE", "CANARY", "UPDATED"), rows)


def format_audit(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no audit entries"
    rows = [(when(e["at"]), e["actor"], e.get("version"), _change(e), e["reason"]) for e in entries]
    return table(("WHEN", "ACTOR", "VERSION", "CHANGE", "REASON"), rows)


def _change(entry: dict[str, Any]) -> str:
    if entry.get("to_state") is None:
        return "-"
    return f"{entry.get('from_state') or 'new'} -> {entry['to_state']}"


def format_candidate(c: dict[str, Any]) -> str:
    head = [("version", c["version"]), ("parent", c.get("parent")), ("step", c.get("step")),
            ("state", c["state"]), ("created", when(c.get("created_at"))), ("updated", when(c.get("updated_at"))),
            ("uri", c.get("uri")), ("manifest", c.get("manifest_sha256"))]
    out = [table(("FIELD", "VALUE"), head)]
    for title, full in (("gate", c.get("gate")), ("canary analysis", c.get("analysis"))):
        out.append(f"\n{title}: " + _describe_result(full))
    out.append("\naudit (newest first):\n" + format_audit(c.get("audit", [])))
    return "\n".join(out)


def _describe_result(result: dict[str, Any] | None) -> str:
    """A gate result or analysis: its outcome and reasons, then its scalar measurements (the
    nested ones, such as the confidence band's history, are for the console's charts)."""
    if not result:
        return "none yet"
    lines = [escape(result.get("outcome", result.get("verdict", "?")))]
    reasons = result.get("reasons") or ([result["reason"]] if result.get("reason") else [])
    lines += [f"  - {escape(r)}" for r in reasons]
    scalars = [(k, v) for k, v in sorted(result.items())
               if k not in ("outcome", "verdict", "reasons", "reason") and isinstance(v, str | int | float | bool)]
    if scalars:
        lines.append("  " + table(("MEASURE", "VALUE"), scalars).replace("\n", "\n  "))
    return "\n".join(lines)


def _canary_line(canary: dict[str, Any]) -> str:
    """``v4 (10% of users; 3 users flagged by reward's guards left out; PASS at level 0.025)``:
    the routing, and what its analysis says of who counts (once there is one)."""
    parts = [f"{canary['share']:.0%} of users"]
    if canary.get("excluded_users") is not None:
        parts.append(f"{canary['excluded_users']} users flagged by reward's guards left out")
    if canary.get("pass_alpha") is not None:
        parts.append(f"PASS at level {canary['pass_alpha']:.3g}")
    return f"v{canary['version']} ({'; '.join(parts)})"


def format_status(s: dict[str, Any]) -> str:
    canary = s.get("canary")
    rev = s.get("revision")
    lease = s.get("lease")
    rows = [
        ("stable", f"v{s['stable_version']}"),
        ("canary", _canary_line(canary) if canary else "none"),
        ("pipeline", "PAUSED" if s.get("paused") else "running"),
        ("revision", f"{rev['revision']} ({_published(rev)}): {rev['reason']}" if rev else "none yet"),
        ("lease", f"{lease['holder']} ({'held' if lease['live'] else 'lapsed'}, until {when(lease['expires_at'])})"
         if lease else "nobody"),
        ("next promotion", _next_promotion(s)),
        ("candidates", ", ".join(f"{n} {state}" for state, n in sorted(s.get("candidates", {}).items())) or "none"),
    ]
    if s.get("controller") is not None:
        controller = dict(s["controller"])
        signing = controller.pop("signing", None)
        rows.append(("controller", ", ".join(f"{k}={v}" for k, v in sorted(controller.items()))))
        if signing is not None:
            rows.append(("signing", signing_line(signing)))
    return table(("", ""), rows).split("\n", 1)[1]  # no header line for a key/value list


def signing_line(signing: dict[str, Any]) -> str:
    """The controller's keys in one line (docs/signing.md): what it verifies checkpoints with, key
    files it refused, and the key its routings are signed with."""
    cp = signing.get("checkpoints") or {}
    parts = [f"checkpoints verified ({', '.join(cp.get('trusted_key_ids') or []) or 'no usable key'})"
             if cp.get("verified") else "checkpoints NOT verified (no trusted keys)"]
    parts += [f"key file refused: {f['path']}" for f in cp.get("refused_key_files") or []]
    signer = signing.get("releases_signed_with")
    parts.append(f"routings signed with {signer}" if signer else "routings UNSIGNED")
    return "; ".join(parts)


def _published(rev: dict[str, Any]) -> str:
    if rev.get("skipped"):
        return "cannot be published: see the audit log"
    return "published" if rev["published"] else "not yet published"


def _next_promotion(s: dict[str, Any]) -> str:
    at = s.get("next_promotion_at")
    # compared with the server's clock: the interval is enforced there, not on this machine
    return f"not before {when(at)}" if at is not None and at > s.get("time", 0) else "any time"


# -- commands -----------------------------------------------------------------------------------

def _revision_note(resp: dict[str, Any]) -> str:
    rev = resp.get("revision")
    return f" (revision {rev['revision']}: stable v{rev['stable_version']})" if rev else ""


def _pipeline_note(resp: dict[str, Any]) -> str:
    state = "paused" if resp["paused"] else "running"
    return f"pipeline {state}" if resp["changed"] else f"pipeline was already {state}: nothing changed"


#: Read commands: what each asks the API for, and how a person reads it (``-o json``: the body as is).
READS = {
    "status": (lambda c, a: c.status(), format_status),
    "list": (lambda c, a: {"candidates": c.candidates()}, lambda body: format_candidates(body["candidates"])),
    "show": (lambda c, a: c.candidate(a.version), format_candidate),
    "audit": (lambda c, a: {"entries": c.audit(a.version, a.limit)}, lambda body: format_audit(body["entries"])),
}


def run_command(client: ReleaseClient, args: argparse.Namespace) -> str:
    """Do ``args.release_cmd`` and say what happened, in a line or a table (a read command's
    body as one JSON line with ``-o json``)."""
    if args.release_cmd in READS:
        fetch, show = READS[args.release_cmd]
        body = fetch(client, args)
        return as_json(body) if getattr(args, "output", "table") == "json" else show(body)
    match args.release_cmd:
        case "approve":
            return f"promoted v{args.version}" + _revision_note(client.approve(args.version, args.reason))
        case "reject":
            return f"rejected v{client.reject(args.version, args.reason)['version']}"
        case "rollback":
            resp = client.rollback(args.reason, args.version)
            return f"rolled back v{resp['version']}" + _revision_note(resp)
        case "undo":
            resp = client.undo(args.to, args.reason)
            return f"stable is v{resp['version']} again" + _revision_note(resp)
        case "pause":
            return _pipeline_note(client.pause(args.reason))
        case "resume":
            return _pipeline_note(client.resume(args.reason))
    raise ValueError(f"unknown release command {args.release_cmd!r}")


def main(args: argparse.Namespace, url: str, token: str | None,
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``args.release_cmd`` against ``url``; prints the result, or ``error: <message>``."""
    out, err = out or sys.stdout, err or sys.stderr
    client = ReleaseClient(url, token)
    try:
        if getattr(args, "watch", False):
            return watch(client, args, out, err)
        print(run_command(client, args), file=out)
        return EXIT_OK
    except ApiError as exc:
        hint = ("; pass --token-file or --token, or set FLYWHEEL_RELEASE_TOKEN_FILE or FLYWHEEL_RELEASE_TOKEN"
                if exc.status == 401 and not token else "")
        print(f"error: {escape(exc.message)}{hint}", file=err)
        return EXIT_AUTH if exc.status in (401, 403) else EXIT_ERROR
    finally:
        client.close()


#: What changes in a status body without anything happening: the server's clock, the lease's
#: renewal, the age of the controller's last turn. ``--watch`` prints again only on the rest.
VOLATILE = (("time",), ("lease", "expires_at"), ("controller", "last_tick_age_s"))


def watch(client: ReleaseClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``status --watch``: the status, then again each time it changes, polled every
    ``--interval`` seconds until Ctrl-C. A controller that cannot be reached (restarting) is
    reported and polled again; a token refused ends the watch."""
    last: Any = None
    try:
        while True:
            try:
                body = client.status()
            except ApiError as exc:
                if exc.status in (401, 403):
                    raise
                print(f"error: {escape(exc.message)}; trying again", file=err, flush=True)
                body = None
            if body is not None and (seen := _steady(body)) != last:
                last = seen
                text = (as_json(body) if args.output == "json"
                        else f"-- {when(body.get('time'))}\n{format_status(body)}")
                print(text, file=out, flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK


def _steady(body: dict[str, Any]) -> str:
    steady = json.loads(json.dumps(body))
    for path in VOLATILE:
        node = steady
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return json.dumps(steady, sort_keys=True)


__all__ = ["ApiError", "ReleaseClient", "main", "table"]
