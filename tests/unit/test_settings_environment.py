"""Settings in an orchestrator's environment: Kubernetes' service links are ignored with a warning,
unknown names warn once, and every setting can be read from a file (flywheel/environment.py)."""

from __future__ import annotations

import logging

import pytest

from flywheel import environment
from flywheel.environment import Ignored, IgnoredVariable, read_environment
from flywheel.settings import Settings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(environment, "_warned", set())


def service_links(service: str, ip: str, ports: dict[str, int]) -> dict[str, str]:
    """The variables the kubelet injects into every pod of the namespace for one Service (its
    documented ``{SVCNAME}_*`` and Docker-link forms), ``ports`` by port name."""
    name = service.upper().replace("-", "_")
    first = next(iter(ports.values()))
    env = {f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": str(first), f"{name}_PORT": f"tcp://{ip}:{first}"}
    for port_name, port in ports.items():
        env[f"{name}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
        link = f"{name}_PORT_{port}_TCP"
        env.update({link: f"tcp://{ip}:{port}", f"{link}_PROTO": "tcp", f"{link}_PORT": str(port), f"{link}_ADDR": ip})
    return env


#: Services a Flywheel deployment might name, each injecting links under the FLYWHEEL_ prefix.
LINKS = {
    **service_links("flywheel", "10.0.0.1", {"http": 8000}),
    **service_links("flywheel-serve", "10.0.0.2", {"http": 8000, "metrics": 9100}),
    **service_links("flywheel-release", "10.0.0.3", {"http": 8100}),
    **service_links("flywheel-ingest", "fd00::4", {"ops": 9101}),
    **service_links("flywheel-kafka", "10.0.0.5", {"kafka": 9092}),
}


def test_the_links_of_every_flywheel_service_leave_the_settings_at_their_defaults(caplog):
    assert "FLYWHEEL_SERVE_PORT" in LINKS and "FLYWHEEL_RELEASE_PORT" in LINKS  # real settings' names
    with caplog.at_level(logging.WARNING, logger="flywheel.settings"):
        assert load_settings(env=LINKS) == Settings()
    warned = sorted(r.getMessage().split()[0] for r in caplog.records)
    assert warned == sorted(LINKS)
    assert all("Kubernetes service link" in r.getMessage() and "enableServiceLinks: false" in r.getMessage()
               for r in caplog.records)
    assert not any("10.0.0" in r.getMessage() or "tcp://" in r.getMessage() for r in caplog.records)


def test_a_real_port_beside_the_links_still_applies():
    env = {**service_links("flywheel-serve", "10.0.0.2", {"http": 8000}), "FLYWHEEL_RELEASE_PORT": "8200"}
    s = load_settings(env=env)
    assert s.serve.port == 8000 and s.release.port == 8200
    with pytest.raises(SettingsError, match="serve.port"):  # a value that is neither a port nor a link
        load_settings(env={"FLYWHEEL_SERVE_PORT": "http://10.0.0.2:8000"})


@pytest.mark.parametrize("name, value, why", [
    ("FLYWHEEL_SERVE_PORT", "tcp://10.0.0.1:8000", Ignored.SERVICE_LINK),
    ("FLYWHEEL_SERVE_PORT", "TCP://[fd00::1]:8000", Ignored.SERVICE_LINK),
    ("FLYWHEEL_SERVICE_HOST", "10.0.0.1", Ignored.SERVICE_LINK),
    ("FLYWHEEL_SERVE_SERVICE_PORT_HTTP", "8000", Ignored.SERVICE_LINK),
    ("FLYWHEEL_KAFKA_PORT_9092_TCP_ADDR", "10.0.0.1", Ignored.SERVICE_LINK),
    ("FLYWHEEL_KAFKA_PORT", "tcp://10.0.0.1:9092", Ignored.SERVICE_LINK),
    ("FLYWHEEL_SERVE_PROT", "8000", Ignored.NOT_A_SETTING),
    ("FLYWHEEL_CONFIG_FILE", "/etc/flywheel.toml", Ignored.NOT_A_SETTING),  # the config path is no setting
])
def test_what_is_ignored_and_why(name, value, why):
    reading = read_environment({name: value}, _resolve, skip={"FLYWHEEL_CONFIG"})
    assert reading.values == () and reading.ignored == (IgnoredVariable(name, why),)


def _resolve(key: str) -> tuple[str, ...] | None:
    return {"FLYWHEEL_SERVE_PORT": ("serve", "port"), "FLYWHEEL_API_KEYS": ("serve", "api_keys")}.get(key)


def test_each_ignored_name_is_warned_about_once_per_process(caplog):
    env = {"FLYWHEEL_SERVICE_HOST": "10.0.0.1", "FLYWHEEL_SERVE_PROT": "1"}
    with caplog.at_level(logging.WARNING, logger="flywheel.settings"):
        load_settings(env=env)
        load_settings(env=env)
        load_settings(env={**env, "FLYWHEEL_REWARD_PROT": "1"})
    assert sorted(r.getMessage().split()[0] for r in caplog.records) == [
        "FLYWHEEL_REWARD_PROT", "FLYWHEEL_SERVE_PROT", "FLYWHEEL_SERVICE_HOST"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_a_value_in_the_environment_is_never_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="flywheel.settings"):
        load_settings(env={"FLYWHEEL_API_KEY": "sk-live-secret"})  # FLYWHEEL_API_KEYS, misspelt
    assert caplog.records and "sk-live-secret" not in caplog.text


# -- FLYWHEEL_<NAME>_FILE ----------------------------------------------------------------------
def test_a_setting_reads_its_value_from_a_file_without_the_trailing_newline(tmp_path):
    (tmp_path / "salt").write_text("s3cr3t salt\n")
    (tmp_path / "keys").write_text("sk-a,sk-b\r\n")
    (tmp_path / "tokens").write_text("ops:admin:tok1,alice:approver:tok2\n")
    (tmp_path / "port").write_text("9001")
    s = load_settings(env={"FLYWHEEL_SERVE_USER_ID_SALT_FILE": str(tmp_path / "salt"),
                           "FLYWHEEL_API_KEYS_FILE": str(tmp_path / "keys"),  # an alias too
                           "FLYWHEEL_RELEASE_TOKENS_FILE": str(tmp_path / "tokens"),
                           "FLYWHEEL_SERVE_PORT_FILE": str(tmp_path / "port")})
    assert s.serve.user_id_salt == "s3cr3t salt"
    assert s.serve.api_keys == ("sk-a", "sk-b")
    assert s.release.tokens == ("ops:admin:tok1", "alice:approver:tok2")
    assert s.serve.port == 9001


def test_a_file_value_is_typed_and_checked_as_the_variable_would_be(tmp_path):
    (tmp_path / "port").write_text("not-a-port\n")
    with pytest.raises(SettingsError, match="serve.port"):
        load_settings(env={"FLYWHEEL_SERVE_PORT_FILE": str(tmp_path / "port")})


def test_a_setting_whose_name_ends_in_file_stays_that_setting(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    s = load_settings(env={"FLYWHEEL_RELEASE_PROMPTS_FILE": str(prompts)})
    assert s.release.prompts_file == prompts  # the path itself, not the file's content
    (tmp_path / "holds-the-path").write_text(f"{prompts}\n")
    s = load_settings(env={"FLYWHEEL_RELEASE_PROMPTS_FILE_FILE": str(tmp_path / "holds-the-path")})
    assert s.release.prompts_file == prompts


def test_the_value_and_its_file_together_are_an_error_naming_both(tmp_path):
    (tmp_path / "salt").write_text("x\n")
    env = {"FLYWHEEL_SERVE_USER_ID_SALT": "y", "FLYWHEEL_SERVE_USER_ID_SALT_FILE": str(tmp_path / "salt")}
    with pytest.raises(SettingsError, match="FLYWHEEL_SERVE_USER_ID_SALT and FLYWHEEL_SERVE_USER_ID_SALT_FILE "
                                            "are both set"):
        load_settings(env=env)


def test_a_file_that_cannot_be_read_names_the_variable_and_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SettingsError, match=f"FLYWHEEL_API_KEYS_FILE: cannot read {missing}: No such file"):
        load_settings(env={"FLYWHEEL_API_KEYS_FILE": str(missing)})
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SettingsError, match="FLYWHEEL_API_KEYS_FILE: cannot read"):
        load_settings(env={"FLYWHEEL_API_KEYS_FILE": str(tmp_path / "bin")})


# -- log_level -----------------------------------------------------------------------------------
def test_the_log_level_is_checked_and_taken_in_any_case():
    assert load_settings(env={"FLYWHEEL_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert load_settings(env={}, overrides={"log_level": "Warning"}).log_level == "WARNING"
    with pytest.raises(SettingsError, match="log_level"):
        load_settings(env={"FLYWHEEL_LOG_LEVEL": "LOUD"})
