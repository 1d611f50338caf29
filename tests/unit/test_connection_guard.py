"""The connection guard's rules (flywheel/connections.py): who may open one more connection, what
a cut connection is told, and the open-file limit a process starts with."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flywheel.connections import FILES_BESIDE_CONNECTIONS, Cut, admit, refusal
from flywheel.settings import HttpSettings, SettingsError, load_settings

LIMITS = HttpSettings(max_connections=10, max_connections_per_client=3)


@pytest.mark.parametrize(("open_total", "open_client", "limits", "verdict"), [
    (0, 0, LIMITS, None),
    (9, 2, LIMITS, None),  # one short of both caps
    (5, 3, LIMITS, Cut.CLIENT_CAP),  # the address holds its share; the process has room
    (10, 0, LIMITS, Cut.PROCESS_CAP),  # a new address, but the process is full
    (10, 3, LIMITS, Cut.PROCESS_CAP),  # both: the process cap is named, it refuses everyone alike
    (9, 500, HttpSettings(max_connections=10, max_connections_per_client=0), None),  # 0: no cap per address
])
def test_admit(open_total, open_client, limits, verdict):
    assert admit(open_total, open_client, limits) is verdict


@pytest.mark.parametrize(("cut", "status"), [(Cut.HEADER_TIMEOUT, 408), (Cut.BODY_TIMEOUT, 408),
                                             (Cut.HEAD_TOO_LARGE, 431), (Cut.CLIENT_CAP, 429),
                                             (Cut.PROCESS_CAP, 503)])
def test_a_cut_connection_is_told_why_and_that_it_closes(cut, status):
    head, _, body = refusal(cut).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} ")
    assert "connection: close" in lines
    assert f"content-length: {len(body)}" in lines
    assert cut.value.encode() in body
    # a cap may have room again; a timeout or a head too large is the client's doing
    assert ("retry-after: 1" in lines) is (status in (429, 503))


def test_a_client_cap_above_the_process_cap_is_refused_at_start():
    with pytest.raises(SettingsError, match="max_connections_per_client=300 exceeds max_connections=200"):
        load_settings(env={"FLYWHEEL_HTTP_MAX_CONNECTIONS": "200", "FLYWHEEL_HTTP_MAX_CONNECTIONS_PER_CLIENT": "300"})


RAISE = "from flywheel.connections import raise_open_files; from flywheel.settings import HttpSettings; " \
        "f = raise_open_files(HttpSettings(max_connections={})); print(f.before, f.soft, f.hard, f.enough)"


@pytest.mark.parametrize(("hard", "max_connections", "enough"), [(4096, 2048, True), (1024, 2048, False)])
def test_the_open_file_limit_is_raised_to_the_hard_one_and_a_short_one_is_named(hard, max_connections, enough):
    # a process started with 256 files (a small container's soft limit) and a hard limit above it
    done = subprocess.run(["prlimit", f"--nofile=256:{hard}", sys.executable, "-c", RAISE.format(max_connections)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["256", str(hard), str(hard), str(enough)]
    if not enough:
        assert f"the open-file limit is {hard} (hard {hard}), below the {max_connections + FILES_BESIDE_CONNECTIONS}" in done.stderr
        assert "http.max_connections" in done.stderr
