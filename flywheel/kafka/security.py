"""How every Kafka client reaches the brokers: the ``kafka.security_*``, ``kafka.sasl_*`` and
``kafka.ssl_*`` settings mapped, in one place, to each client library's options, and a check at
start that says which setting is wrong instead of letting a client retry forever.

kafka-python (consumers, serving's producer, the admin client, ``flywheel deadletters``) takes
:func:`kafka_python_options`; confluent-kafka (the stages' exactly-once outputs) takes
:func:`librdkafka_options`. Whoever makes a client takes one of the two, so no client can be
left plaintext on a secured cluster.

A client with a wrong password, an untrusted certificate authority or the wrong protocol does not
fail: it logs, reconnects and retries, so a process would wait for a broker that "does not
answer" forever. :func:`check_access` asks once with librdkafka, whose connection errors say what
went wrong, and raises :class:`KafkaAccessError` (a :class:`~flywheel.settings.SettingsError`:
the process exits with the message) naming the setting.
:func:`~flywheel.kafka.topics.ensure_declared` (the first broker call of every role),
:func:`ensure_topics` and the CLI tools call it.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Mapping

from flywheel.settings import KafkaSettings, SettingsError

log = logging.getLogger(__name__)

#: kafka-python's options that say where and how to connect (a client's ``config`` holds them).
CONNECTION_KEYS = ("bootstrap_servers", "security_protocol", "sasl_mechanism", "sasl_plain_username",
                   "sasl_plain_password", "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")


class KafkaAccessError(SettingsError):
    """The brokers answered, and refused this client for its security settings; the message
    names the setting to fix. Retrying cannot help, so a process exits with it."""


class KafkaLoginRefused(KafkaAccessError):
    """The brokers refused this client's SASL login (a wrong password, or no such user for the
    mechanism): an authentication failure, so ``flywheel`` exits 77 (EX_NOPERM) for it, as for a
    refused release API token, not 2 like a setting of the wrong form. A script or a supervisor
    tells "fix the credentials" from "fix the command" by the code alone."""

    exit_code = 77


def kafka_python_options(cfg: KafkaSettings) -> dict[str, object]:
    """``bootstrap_servers`` and the security options of a kafka-python client."""
    opts: dict[str, object] = {
        "bootstrap_servers": cfg.bootstrap.split(","),
        "security_protocol": cfg.security_protocol,
    }
    if cfg.security_protocol.startswith("SASL_"):
        opts.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                    sasl_plain_password=cfg.sasl_password)
    if cfg.security_protocol.endswith("SSL"):
        opts.update(ssl_check_hostname=cfg.ssl_check_hostname,
                    ssl_cafile=_path(cfg.ssl_cafile), ssl_certfile=_path(cfg.ssl_certfile),
                    ssl_keyfile=_path(cfg.ssl_keyfile))
    return opts


def connection_of(config: Mapping[str, object]) -> dict[str, object]:
    """The connection options of a kafka-python client's ``config``: another client made with
    them reaches the same brokers the same way."""
    return {key: config[key] for key in CONNECTION_KEYS if key in config}


def librdkafka_options(cfg: KafkaSettings) -> dict[str, object]:
    """``bootstrap.servers`` and the security options of a confluent-kafka (librdkafka) client."""
    conf: dict[str, object] = {
        "bootstrap.servers": cfg.bootstrap,
        "security.protocol": cfg.security_protocol,
    }
    if cfg.security_protocol.startswith("SASL_"):
        conf.update({"sasl.mechanism": cfg.sasl_mechanism, "sasl.username": cfg.sasl_username,
                     "sasl.password": cfg.sasl_password})
    if cfg.security_protocol.endswith("SSL"):
        # "https" is librdkafka's name for checking the host name against the certificate
        conf["ssl.endpoint.identification.algorithm"] = "https" if cfg.ssl_check_hostname else "none"
        for key, path in (("ssl.ca.location", cfg.ssl_cafile), ("ssl.certificate.location", cfg.ssl_certfile),
                          ("ssl.key.location", cfg.ssl_keyfile)):
            if path is not None:
                conf[key] = str(path)
    return conf


def _path(path: object) -> str | None:
    return None if path is None else str(path)


def check_access(cfg: KafkaSettings, timeout_s: float = 10.0) -> bool:
    """Ask the brokers for metadata once, as every client will: True if they answered, False if
    none answered in ``timeout_s`` (down, unreachable: the caller waits and retries as before).

    Raises :class:`KafkaAccessError` as soon as a broker refuses the login or the TLS handshake,
    or speaks another protocol than ``kafka.security_protocol``: within a second or two, however
    long ``timeout_s`` is.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    errors: list[object] = []
    conf = librdkafka_options(cfg) | {
        "client.id": f"{cfg.client_id}-access-check",
        "error_cb": errors.append,
        # the errors come to error_cb and, judged, into the exception: not also logged per retry
        "log_level": 0,
        # one failed connection is enough to judge: do not wait seconds between tries
        "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 500,
    }
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout_s
    asked_tls = cfg.security_protocol.endswith("SSL")
    while time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=min(0.5, max(0.05, deadline - time.monotonic())))
            return True
        except KafkaException:
            admin.poll(0)  # serves error_cb
        for err in errors:
            if (problem := access_problem(cfg, err.code(), err.str())) is not None:  # type: ignore[attr-defined]
                raise (KafkaLoginRefused if login_refused(err.code(), err.str()) else KafkaAccessError)(problem)  # type: ignore[attr-defined]
        if not asked_tls:
            # A TLS listener given a plaintext request just drops the connection, which librdkafka
            # reports as any dropped connection ("brokers are down"): ask it for TLS once to tell.
            asked_tls = True
            if (host := _tls_listener(cfg.bootstrap)) is not None:
                raise KafkaAccessError(
                    f"kafka.bootstrap={cfg.bootstrap}: {host} speaks TLS, but kafka.security_protocol="
                    f"{cfg.security_protocol} does not: set it to {'SASL_SSL' if cfg.sasl_mechanism else 'SSL'}")
    log.debug("access check errors: %s", [e.str() for e in errors])  # type: ignore[attr-defined]
    log.debug("access check: no broker of %s answered in %.0fs (%s)", cfg.bootstrap, timeout_s, errors[-1:])
    return False


def _tls_listener(bootstrap: str, timeout_s: float = 2.0) -> str | None:
    """The first of ``bootstrap``'s addresses that answers a TLS handshake, if one does.

    Its certificate is not checked: the question is only whether it speaks TLS. A handshake
    the server ends with an alert (no client certificate, say) still shows it speaks TLS; a
    Kafka listener without TLS reads the hello as a request of impossible size and closes.
    """
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with (socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock,
                  context.wrap_socket(sock, server_hostname=host.strip("[]"))):
                return address
        except ssl.SSLEOFError:
            continue
        except ssl.SSLError as exc:
            if "WRONG_VERSION_NUMBER" in str(exc) or "RECORD_LAYER" in str(exc):
                continue
            return address  # an alert from a TLS server
        except (OSError, ValueError):
            continue
    return None


def login_refused(code: int, text: str) -> bool:
    """Whether a librdkafka connection error is the brokers refusing the SASL login."""
    from confluent_kafka import KafkaError

    return code == KafkaError._AUTHENTICATION or "sasl authentication" in text.lower()


def access_problem(cfg: KafkaSettings, code: int, text: str) -> str | None:
    """What a librdkafka connection error says about the security settings, naming the setting
    to fix; None for errors that are not about them (a broker down, a timeout)."""

    lower = text.lower()
    where = f"kafka.bootstrap={cfg.bootstrap}"
    if login_refused(code, text):
        return (f"{where} refused the SASL login of kafka.sasl_username={cfg.sasl_username!r} with "
                f"kafka.sasl_mechanism={cfg.sasl_mechanism}: check kafka.sasl_password (and that the user "
                f"exists for that mechanism) [{text}]")
    if "certificate verify failed" in lower or "could not be verified" in lower:
        trust = f"kafka.ssl_cafile={cfg.ssl_cafile}" if cfg.ssl_cafile else "the system's trust store (kafka.ssl_cafile unset)"
        return (f"{where}: the broker's TLS certificate is not signed by a certificate authority in {trust}; "
                f"set kafka.ssl_cafile to the PEM file of the authority that signed it [{text}]")
    if "certificate name" in lower or "hostname mismatch" in lower or "ip address mismatch" in lower:
        return (f"{where}: the broker's TLS certificate does not name the host dialled; advertise a listener "
                f"its certificate names, or set kafka.ssl_check_hostname=false [{text}]")
    if "connecting to a ssl listener" in lower:
        return (f"{where} speaks TLS, but kafka.security_protocol={cfg.security_protocol} does not: "
                f"set it to SSL or SASL_SSL [{text}]")
    if "connecting to a plaintext" in lower or "wrong version number" in lower:
        return (f"{where} does not speak TLS, but kafka.security_protocol={cfg.security_protocol} does: "
                f"set it to PLAINTEXT or SASL_PLAINTEXT [{text}]")
    if "unsupported sasl mechanism" in lower or "mechanism handshake failed" in lower:
        return (f"{where} does not offer kafka.sasl_mechanism={cfg.sasl_mechanism}, or no SASL at all "
                f"(check kafka.security_protocol={cfg.security_protocol}) [{text}]")
    return None
