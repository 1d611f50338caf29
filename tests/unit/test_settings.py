"""Settings: env beats file beats defaults; typos and contradictions fail with a clear message."""

import pytest

from flywheel.settings import SettingsError, load_settings


def test_defaults():
    s = load_settings(env={})
    assert s.serve.port == 8000
    assert s.topic_prefix == "flywheel."


def test_required_environment_names():
    s = load_settings(
        env={
            "FLYWHEEL_KAFKA_BOOTSTRAP": "k1:9092,k2:9092",
            "FLYWHEEL_MODEL_DIR": "/models/x",
            "FLYWHEEL_DATA_DIR": "/var/fw",
            "FLYWHEEL_API_KEYS": "a, b ,c",
            "FLYWHEEL_SERVE_PORT": "9001",
            "FLYWHEEL_TOPIC_PREFIX": "prod.",
        }
    )
    assert s.kafka.bootstrap == "k1:9092,k2:9092"
    assert str(s.model_dir) == "/models/x"
    assert str(s.data_dir) == "/var/fw"
    assert s.serve.api_keys == ("a", "b", "c")
    assert s.serve.port == 9001
    assert s.topic_prefix == "prod."


def test_file_then_env(tmp_path):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text('topic_prefix = "file."\n[serve]\nport = 7000\nmodel_name = "fromfile"\n')
    s = load_settings(env={"FLYWHEEL_SERVE_PORT": "7100"}, config_file=cfg)
    assert s.serve.port == 7100
    assert s.serve.model_name == "fromfile"
    assert s.topic_prefix == "file."


def test_unknown_variable_is_a_warning_not_an_error(monkeypatch, caplog):
    """An orchestrator puts variables of its own under the prefix (tests/unit/test_settings_environment.py)."""
    from flywheel import environment

    monkeypatch.setattr(environment, "_warned", set())
    assert load_settings(env={"FLYWHEEL_SERVE_PROT": "1"}) == load_settings(env={})
    assert [r.getMessage() for r in caplog.records if "FLYWHEEL_SERVE_PROT" in r.getMessage()] == [
        ("FLYWHEEL_SERVE_PROT is not a setting: ignored (a misspelt name? `flywheel config example` lists every "
         "setting's variable)")]


def test_a_typo_in_the_config_file_stays_an_error(tmp_path):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text("[serve]\nprot = 9001\n")
    with pytest.raises(SettingsError, match="serve.prot: Extra inputs are not permitted"):
        load_settings(env={}, config_file=cfg)


def test_a_retired_setting_says_what_replaced_it(tmp_path):
    """A config written for an older release is refused with the way forward, not a bare typo."""
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text("[release]\nguardrail_z = 3.0\n")
    with pytest.raises(SettingsError, match=r"release.guardrail_z was removed: .*release.guardrail_alpha"):
        load_settings(env={}, config_file=cfg)


def test_bad_value_names_the_field():
    with pytest.raises(SettingsError, match="serve.port"):
        load_settings(env={"FLYWHEEL_SERVE_PORT": "not-a-port"})


def test_heartbeat_must_be_below_session_timeout():
    with pytest.raises(SettingsError, match="heartbeat_interval_ms"):
        load_settings(env={"FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS": "2000", "FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS": "1500"})


def test_delivery_timeout_must_cover_a_request_and_the_linger():
    env = {"FLYWHEEL_KAFKA_REQUEST_TIMEOUT_MS": "1000", "FLYWHEEL_KAFKA_LINGER_MS": "5"}
    with pytest.raises(SettingsError, match=r"delivery_timeout_ms=1004 must be at least .*\(1005\)"):
        load_settings(env={**env, "FLYWHEEL_KAFKA_DELIVERY_TIMEOUT_MS": "1004"})
    assert load_settings(env={**env, "FLYWHEEL_KAFKA_DELIVERY_TIMEOUT_MS": "1005"}).kafka.delivery_timeout_ms == 1005


def test_a_produce_request_limit_below_the_largest_output_is_refused():
    """A client refuses a record over its limit before the broker sees it: a stage's dead letter
    quoting the largest valid episode must fit, or that letter would wait in the outbox forever."""
    from flywheel.contracts import MAX_DEADLETTER_BYTES, MAX_OUTPUT_REQUEST_BYTES

    assert MAX_DEADLETTER_BYTES < MAX_OUTPUT_REQUEST_BYTES <= load_settings(env={}).kafka.max_request_bytes
    with pytest.raises(SettingsError, match="max_request_bytes"):
        load_settings(env={"FLYWHEEL_KAFKA_MAX_REQUEST_BYTES": str(1024 * 1024)})
    assert load_settings(env={"FLYWHEEL_KAFKA_MAX_REQUEST_BYTES": str(MAX_OUTPUT_REQUEST_BYTES)})


@pytest.mark.parametrize("env", [
    {"FLYWHEEL_REWARD_REPETITION_PENALTY": "inf"},  # every flagged reward would be null on the wire
    {"FLYWHEEL_REWARD_ACCEPT_VALUE": "nan"},
    {"FLYWHEEL_REWARD_LATENCY_BONUS": "Infinity"},
    {"FLYWHEEL_REWARD_GUARD_WINDOW_S": "1e-10"},  # window numbers past SQLite's integers
    {"FLYWHEEL_REWARD_LABELERS": "[]"},  # every reward 0 whatever users did
])
def test_a_setting_that_would_poison_the_arithmetic_is_refused_at_start(env):
    (name,) = env
    with pytest.raises(SettingsError, match=name.removeprefix("FLYWHEEL_REWARD_").lower()):
        load_settings(env=env)


# -- what the start-up log and `flywheel config show` print ------------------------------------------
KEYS = ("sk-live-7f3a9c2e51", "sk-pin-0b6d44e1a8")


@pytest.mark.parametrize("url, secret, kept", [
    ("postgresql://flywheel:s3cr3t-pw@db.internal:5432/release", "s3cr3t-pw", "postgresql://flywheel:***@db.internal:5432/release"),
    ("postgresql://db.internal/release?user=flywheel&password=s3cr3t-pw&sslmode=require", "s3cr3t-pw",
     "postgresql://db.internal/release?user=flywheel&password=***&sslmode=require"),
    ("postgresql://db/release?sslpassword=s3cr3t-pw", "s3cr3t-pw", "postgresql://db/release?sslpassword=***"),
    ("postgresql://db/release?PASSWORD=s3cr3t-pw", "s3cr3t-pw", "postgresql://db/release?PASSWORD=***"),
    ("postgresql://db/release?pass%77ord=s3cr3t-pw", "s3cr3t-pw", "postgresql://db/release?pass%77ord=***"),
    ("postgresql://u:a%40b@db/release?password=s3cr3t-pw", "s3cr3t-pw", "postgresql://u:***@db/release?password=***"),
    ("host=db dbname=release user=flywheel password=s3cr3t-pw", "s3cr3t-pw",
     "host=db dbname=release user=flywheel password=***"),
    ("host=db password = 's3cr3t pw' user=x", "s3cr3t", "host=db password=*** user=x"),
    ("postgresql://flywheel@db/release?options=-csearch_path%3Dx", None,
     "postgresql://flywheel@db/release?options=-csearch_path%3Dx"),
    ("sqlite:///var/flywheel/release.sqlite3", None, "sqlite:///var/flywheel/release.sqlite3"),
])
def test_a_database_password_is_never_logged(url, secret, kept):
    """Wherever it sits: the URL's userinfo, its query string (``?password=``, which the start-up
    log once printed whole), or a libpq ``key=value`` string."""
    import json

    from flywheel.settings import describe

    shown = json.loads(describe(load_settings(env={"FLYWHEEL_DATABASE_URL": url})))["release"]["database_url"]
    assert shown == kept
    if secret:
        assert secret not in shown and "a%40b" not in shown


@pytest.mark.parametrize(("url", "refused"), [
    ("postgresql://flywheel:s3cr3t-pw@db:5432/release", False),
    ("postgresql://flywheel:a%40b%2Fc%25@db/release", False),  # percent-encoded: what libpq reads
    ("postgresql://flywheel:it's;(ok)*+,=!$&:~@db/release", False),  # sub-delims and ':' are userinfo
    ("postgresql://flywheel@db/release?options=-csearch_path%3Dx", False),
    ("postgresql://db/release", False),
    ("sqlite:////var/lib/flywheel/a@b/stream.sqlite3", False),  # a path, not a URL's userinfo
    ("postgresql://flywheel:s3cr3t@tail@db/release", True),  # libpq: host 'tail@db', in its error
    ("postgres://fly@wheel:pw@db/release", True),
    ("postgresql://flywheel:pct%zz@db/release", True),  # libpq quotes the password whole
    ("postgresql://flywheel:a/b@db/release", True),
    ("postgresql://flywheel:a?b@db/release", True),  # the log's redaction took '?b@db/...' for a query
    ("postgresql://flywheel:a#b@db/release", True),
    ("postgresql://flywheel:a b@db/release", True),
    ("postgresql://db/release?application_name=a@b", True),  # percent-encoded, it is read the same
])
def test_a_database_url_whose_password_the_driver_would_show_is_refused(url, refused):
    from flywheel.settings import database_url_refusal

    why = database_url_refusal(url)
    assert (why is not None) == refused
    if why:
        assert "%40" in why and "tail" not in why and "pct" not in why


@pytest.mark.parametrize("var", ["FLYWHEEL_DATABASE_URL", "FLYWHEEL_STREAM_DATABASE_URL"])
def test_settings_refuse_a_raw_at_in_a_database_password_without_showing_it(var):
    with pytest.raises(SettingsError, match="percent-encode") as refused:
        load_settings(env={var: f"postgresql://flywheel:{PASSWORD}@x@db/flywheel"})
    assert not leaks(str(refused.value)), str(refused.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "169.254.169.254", "[fd00:ec2::254]", "10.0.0.7",
                                  "192.168.1.20", "100.100.100.200", "127.1", "2130706433", "[::ffff:127.0.0.1]"])
def test_a_webhook_at_an_internal_address_is_refused_unless_allowed(host):
    """The controller posts from inside the deployment: a webhook at the metadata service or a
    private address made it a way in. A literal address is refused at load (a name, at send:
    release/webhooks.py); ``release.webhook_allow_internal`` lets a receiver on one's own network in."""
    url = f"http://{host}:8080/services/T0/B0/{HOOK_SECRET}"
    with pytest.raises(SettingsError, match="webhook_allow_internal") as refused:
        load_settings(env={"FLYWHEEL_RELEASE_WEBHOOKS": url})
    assert not leaks(str(refused.value)), str(refused.value)
    allowed = load_settings(env={"FLYWHEEL_RELEASE_WEBHOOKS": url, "FLYWHEEL_RELEASE_WEBHOOK_ALLOW_INTERNAL": "true"})
    assert allowed.release.webhooks == (url,)


@pytest.mark.parametrize("url", ["https://hooks.slack.com/services/T0/B0/x", "https://8.8.8.8/hook",
                                 "http://localhost:9/x"])  # a name: checked once it resolves, at send
def test_a_webhook_at_a_public_address_or_a_name_loads(url):
    assert load_settings(env={"FLYWHEEL_RELEASE_WEBHOOKS": url}).release.webhooks == (url,)


def test_no_part_of_an_api_key_is_logged_or_shown(monkeypatch, capsys):
    """The start-up log showed each key's first 3 characters, then a plain sha256 fingerprint (a
    short key is found by hashing guesses); now the id serving records the key under, keyed with
    the deployment's secret, which tells keys apart without a character of any. `flywheel config
    show` prints the same."""
    import hashlib
    import json

    from cli.main import main
    from flywheel.apikeys import key_id
    from flywheel.settings import describe

    monkeypatch.setenv("FLYWHEEL_SERVE_USER_ID_SALT", "pepper-5e1f")
    monkeypatch.setenv("FLYWHEEL_API_KEYS", ",".join(KEYS))
    monkeypatch.setenv("FLYWHEEL_SERVE_PIN_API_KEYS", KEYS[1])
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", "postgresql://db/release?password=s3cr3t-pw")
    assert main(["config", "show"]) == 0
    shown = capsys.readouterr().out
    assert shown.strip() == describe(load_settings())
    serve = json.loads(shown)["serve"]
    ids = [key_id("pepper-5e1f", k) for k in KEYS]
    assert serve["api_keys"] == ids and serve["pin_api_keys"] == ids[1:]
    for key in KEYS:  # no plain hash of a key either
        assert hashlib.sha256(key.encode()).hexdigest()[:8] not in shown
    assert "pepper" not in shown
    for key in KEYS:  # no prefix or suffix of any length that says more than "sk-"
        assert not any(key[:n] in shown or key[-n:] in shown for n in range(4, len(key) + 1)), key
    assert "s3cr3t-pw" not in shown


@pytest.mark.parametrize(("env", "message"), [
    ({"FLYWHEEL_STREAM_DATABASE_URL": "mysql://db/flywheel"}, "must be postgresql://"),
    ({"FLYWHEEL_STREAM_DATABASE_URL": "sqlite:///state/stream.sqlite3"}, "names a relative path"),
    ({"FLYWHEEL_STREAM_DATABASE_URL": "postgresql://db/flywheel", "FLYWHEEL_INGEST_SHARDS": "0,1"},
     "ingest.shards and stream.database_url exclude each other"),
])
def test_a_stream_database_the_replicas_could_not_share_is_refused(env, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(env=env)


def test_a_shared_stream_database_on_sqlite_takes_an_absolute_path():
    url = "sqlite:////var/lib/flywheel/stream.sqlite3"
    assert load_settings(env={"FLYWHEEL_STREAM_DATABASE_URL": url}).stream.database_url == url


# -- a refused value is never echoed: it may be a secret ---------------------------------------------
HOOK_SECRET = "XoXb7Qp2Lr9SecretToken"
PASSWORD = "s3cr3t-pw-41f"


def leaks(text: str) -> bool:
    """Whether ``text`` shows 6 characters in a row of either secret: pydantic shortens a long
    input to its head and tail, which may cut a secret yet show most of it."""
    return any(secret[i:i + 6] in text for secret in (HOOK_SECRET, PASSWORD) for i in range(len(secret) - 5))


@pytest.mark.parametrize(("section", "values", "named"), [
    # a Slack hook URL holds its secret in the path
    ("ReleaseSettings", {"webhooks": (f"ftp://hooks.slack.com/services/T0/B0/{HOOK_SECRET}",)}, "webhooks"),
    # a port that is no port passed, and the delivery thread died on the first decision (InvalidURL)
    ("ReleaseSettings", {"webhooks": (f"https://hooks.slack.com:abc/services/T0/B0/{HOOK_SECRET}",)}, "webhooks"),
    ("ReleaseSettings", {"webhooks": (f"https://hooks.slack.com:99999/services/{HOOK_SECRET}",)}, "webhooks"),
    ("ReleaseSettings", {"webhooks": (f"https://user@/services/{HOOK_SECRET}",)}, "webhooks"),
    ("ReleaseSettings", {"database_url": 5, "tokens": f"ops:admin:{PASSWORD}"}, "tokens"),
    ("StreamSettings", {"database_url": f"postgres ql://flywheel:{PASSWORD}@db/flywheel"}, "database_url"),
    ("StreamSettings", {"database_url": f"sqlite:///state/stream.sqlite3?password={PASSWORD}"}, "database_url"),
    ("KafkaSettings", {"sasl_password": PASSWORD}, "sasl_password"),
    ("KafkaSettings", {"sasl_password": [PASSWORD]}, "sasl_password"),
    ("ServeSettings", {"api_keys": f"sk-live-{PASSWORD}"}, "api_keys"),
    ("ServeSettings", {"user_id_salt": [PASSWORD]}, "user_id_salt"),
])
def test_a_refused_secret_is_not_in_the_error(section, values, named):
    """pydantic's own message shows each refused input (``input_value=...``), whoever prints the
    exception: a test, a traceback in a log, code that builds one section of the settings."""
    from pydantic import ValidationError

    from flywheel import settings

    with pytest.raises(ValidationError) as refused:
        getattr(settings, section)(**values)
    text = str(refused.value)
    assert named in text and not leaks(text), text


@pytest.mark.parametrize(("url", "kept"), [
    (f"https://hooks.slack.com/services/T0/B0/{HOOK_SECRET}", "https://hooks.slack.com/***"),
    # a receiver that takes its secret in the query, with no path: the log once showed it whole
    (f"https://hooks.example.com?token={HOOK_SECRET}", "https://hooks.example.com/***"),
    (f"https://hooks.example.com:8443#{HOOK_SECRET}", "https://hooks.example.com:8443/***"),
    (f"https://ops:{PASSWORD}@hooks.example.com/x", "https://hooks.example.com/***"),
])
def test_the_start_up_log_shows_a_webhook_by_its_host(url, kept):
    import json

    from flywheel.settings import describe

    shown = json.loads(describe(load_settings(env={"FLYWHEEL_RELEASE_WEBHOOKS": url})))["release"]["webhooks"]
    assert shown == [kept] and not leaks(str(shown)), shown


def test_an_assignment_refused_does_not_echo_the_secret():
    from pydantic import ValidationError

    release = load_settings(env={}).release
    with pytest.raises(ValidationError) as refused:  # sections validate assignments
        release.webhooks = (f"hooks.slack.com/services/T0/B0/{HOOK_SECRET}",)
    assert "webhooks" in str(refused.value) and not leaks(str(refused.value)), str(refused.value)


@pytest.mark.parametrize(("env", "named"), [
    ({"FLYWHEEL_RELEASE_WEBHOOKS": f"hooks.slack.com/services/T0/B0/{HOOK_SECRET}"}, "release.webhooks"),
    ({"FLYWHEEL_KAFKA_SASL_PASSWORD": PASSWORD}, "sasl_password"),
    ({"FLYWHEEL_STREAM_DATABASE_URL": f"sqlite:///state/s.sqlite3?password={PASSWORD}"}, "stream.database_url"),
    # a value starting with "[" is read as a JSON list; one that is none failed as a traceback
    ({"FLYWHEEL_API_KEYS": f'["sk-live-{PASSWORD}'}, "serve.api_keys"),
    ({"FLYWHEEL_RELEASE_TOKENS": f"[ops:admin:{PASSWORD}]"}, "release.tokens"),
])
def test_flywheel_names_an_invalid_secret_setting_without_its_value(monkeypatch, capsys, tmp_path, env, named):
    from cli.main import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flywheel: ") and err.count("\n") == 1 and named in err, err
    assert not leaks(err), err


def test_the_published_default_salt_is_told_apart_from_a_secret_one():
    assert load_settings(env={}).serve.uses_default_salt
    assert not load_settings(env={"FLYWHEEL_SERVE_USER_ID_SALT": "k3pt-s3cret"}).serve.uses_default_salt
