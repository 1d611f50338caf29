"""flywheel/kafka/security.py and the kafka security settings: combinations that cannot work are
refused at parse time naming the setting; one mapping feeds each client library; the password
never reaches the start-up log. The clients against a secured endpoint are tested in
tests/integration/test_kafka_security.py."""

from __future__ import annotations

import pytest

from flywheel.kafka.security import kafka_python_options, librdkafka_options
from flywheel.settings import SettingsError, describe, load_settings

SASL = {"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "FLYWHEEL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
        "FLYWHEEL_KAFKA_SASL_USERNAME": "fw", "FLYWHEEL_KAFKA_SASL_PASSWORD": "pw-123"}


@pytest.mark.parametrize(("env", "says"), [
    ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "needs sasl_mechanism, sasl_username, sasl_password"),
    ({**SASL, "FLYWHEEL_KAFKA_SASL_USERNAME": ""}, "needs sasl_username"),
    ({"FLYWHEEL_KAFKA_SASL_USERNAME": "fw"}, "sasl_username set, but security_protocol=PLAINTEXT"),
    ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "FLYWHEEL_KAFKA_SASL_MECHANISM": "PLAIN",
      "FLYWHEEL_KAFKA_SASL_USERNAME": "fw", "FLYWHEEL_KAFKA_SASL_PASSWORD": "x", "FLYWHEEL_KAFKA_SSL_CAFILE": "{f}"},
     "ssl_cafile set, but security_protocol=SASL_PLAINTEXT uses no TLS: set security_protocol to SASL_SSL"),
    ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SSL", "FLYWHEEL_KAFKA_SSL_CERTFILE": "{f}"},
     "ssl_certfile and ssl_keyfile go together"),
    ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SSL", "FLYWHEEL_KAFKA_SSL_CAFILE": "{f}.missing"}, "no such file"),
    ({"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "TLS"}, "security_protocol"),
    ({**SASL, "FLYWHEEL_KAFKA_SASL_MECHANISM": "GSSAPI"}, "sasl_mechanism"),
])
def test_combinations_that_cannot_work_are_refused_naming_the_setting(tmp_path, env, says):
    f = tmp_path / "some.pem"
    f.write_text("x")
    with pytest.raises(SettingsError, match=says.replace("{f}", str(f))):
        load_settings({k: v.replace("{f}", str(f)) for k, v in env.items()})


def test_one_mapping_feeds_both_libraries_and_the_password_reads_from_a_file(tmp_path):
    secret, ca = tmp_path / "password", tmp_path / "ca.pem"
    secret.write_text("from-a-file\n")
    ca.write_text("x")
    env = {**SASL, "FLYWHEEL_KAFKA_SASL_PASSWORD": "", "FLYWHEEL_KAFKA_SASL_PASSWORD_FILE": str(secret),
           "FLYWHEEL_KAFKA_SSL_CAFILE": str(ca), "FLYWHEEL_KAFKA_SSL_CHECK_HOSTNAME": "false",
           "FLYWHEEL_KAFKA_BOOTSTRAP": "a:9094,b:9094"}
    del env["FLYWHEEL_KAFKA_SASL_PASSWORD"]
    cfg = load_settings(env).kafka
    assert kafka_python_options(cfg) == {
        "bootstrap_servers": ["a:9094", "b:9094"], "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256", "sasl_plain_username": "fw", "sasl_plain_password": "from-a-file",
        "ssl_check_hostname": False, "ssl_cafile": str(ca), "ssl_certfile": None, "ssl_keyfile": None}
    assert librdkafka_options(cfg) == {
        "bootstrap.servers": "a:9094,b:9094", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "fw", "sasl.password": "from-a-file", "ssl.endpoint.identification.algorithm": "none",
        "ssl.ca.location": str(ca)}


def test_plaintext_sets_no_security_option():
    cfg = load_settings({}).kafka
    assert kafka_python_options(cfg) == {"bootstrap_servers": ["127.0.0.1:9092"], "security_protocol": "PLAINTEXT"}
    assert librdkafka_options(cfg) == {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "PLAINTEXT"}


def test_the_start_up_log_masks_the_password():
    logged = describe(load_settings(SASL))
    assert "pw-123" not in logged and '"sasl_password": "***"' in logged and '"sasl_username": "fw"' in logged
