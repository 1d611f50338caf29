"""A secured Kafka endpoint for tests: TLS (mutual) and SASL/SCRAM in front of the embedded broker.

The embedded broker (Tansu 0.6, local/broker.py) cannot be secured by itself, as its source shows:
- ``--cert``/``--key`` build a TLS acceptor that is never used (tansu-broker ``broker.rs``:
  ``let _acceptor = ...``), so connections stay plaintext; and clap puts both flags in one
  group, so giving both is refused as conflicting.
- ``--authentication`` offers SCRAM only (rsasl built without PLAIN), and its in-memory store,
  the only one this build has, keeps no SCRAM credentials (``upsert_user_scram_credential`` is
  a no-op, ``user_scram_credential`` answers none): no login can ever succeed, and ``tansu user
  create`` cannot log in to create one ("early eof" is the broker closing the unauthenticated
  connection).

So each layer is put in front of a plaintext broker, as a proxy would be in front of any:
- TLS: Debian's ``stunnel`` terminates TLS and asks for a client certificate signed by the
  test authority;
- SASL: :class:`SaslGateway` speaks Kafka's SaslHandshake (v1) and SaslAuthenticate (v0-v2)
  itself, checks SCRAM-SHA-256/512 with ``scramp`` (an independent SCRAM implementation), and
  after a successful login relays the connection's bytes to the broker untouched. Before it,
  only ApiVersions is relayed (clients ask it first); any other request closes the connection,
  as Kafka does.
The broker advertises the outermost port, so clients reconnect through the same layers.

Certificates are made here with ``cryptography`` for each test session: an authority, a server
certificate for 127.0.0.1 and localhost, a client certificate, and a second authority that
signed nothing the server holds (for the untrusted-authority test).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from local.broker import EmbeddedBroker, free_port

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE, SASL_AUTHENTICATION_FAILED = 33, 34, 58


# -- certificates ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Certs:
    ca: Path  # the authority that signed the server's and the client's certificates
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # an authority that signed neither


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _authority(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, cn: str, *, server: bool
          ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _authority("flywheel test authority")
    server_key, server = _leaf(ca_key, ca, "127.0.0.1", server=True)
    client_key, client = _leaf(ca_key, ca, "flywheel", server=False)
    _, other = _authority("some other authority")
    return Certs(
        ca=_write_cert(ca, directory / "ca.pem"),
        server_cert=_write_cert(server, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server.key"),
        client_cert=_write_cert(client, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client.key"),
        other_ca=_write_cert(other, directory / "other-ca.pem"),
    )


# -- SASL -----------------------------------------------------------------------------------

def _parse_header(frame: bytes) -> tuple[int, int, int, int]:
    """(api_key, api_version, correlation_id, offset of the body) of a request frame's payload."""
    api_key, api_version, correlation_id, client_len = struct.unpack_from(">hhih", frame, 0)
    offset = 10 + max(client_len, 0)
    if api_key == SASL_AUTHENTICATE and api_version >= 2:  # flexible: request header v2
        offset += 1  # no tagged fields from the clients we meet (a count of 0)
    return api_key, api_version, correlation_id, offset


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_uvarint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def _auth_bytes(frame: bytes, offset: int, version: int) -> bytes:
    if version >= 2:
        length, offset = _read_uvarint(frame, offset)
        return frame[offset:offset + length - 1]
    (length,) = struct.unpack_from(">i", frame, offset)
    return frame[offset + 4:offset + 4 + length]


def _handshake_response(correlation_id: int, error: int, mechanisms: list[str]) -> bytes:
    body = struct.pack(">ihi", correlation_id, error, len(mechanisms))
    for m in mechanisms:
        body += struct.pack(">h", len(m)) + m.encode()
    return body


def _authenticate_response(correlation_id: int, version: int, error: int, message: str | None,
                           auth: bytes) -> bytes:
    msg = None if message is None else message.encode()
    if version >= 2:  # flexible: response header v1 (tagged fields), compact fields
        out = struct.pack(">i", correlation_id) + b"\x00" + struct.pack(">h", error)
        out += _uvarint(0) if msg is None else _uvarint(len(msg) + 1) + msg
        out += _uvarint(len(auth) + 1) + auth + struct.pack(">q", 3_600_000) + b"\x00"
        return out
    out = struct.pack(">ih", correlation_id, error)
    out += struct.pack(">h", -1) if msg is None else struct.pack(">h", len(msg)) + msg
    out += struct.pack(">i", len(auth)) + auth
    if version >= 1:
        out += struct.pack(">q", 3_600_000)
    return out


class SaslGateway:
    """A SASL/SCRAM login in front of a plaintext Kafka broker (module docstring)."""

    def __init__(self, upstream: tuple[str, int], users: dict[str, str],
                 mechanisms: tuple[str, ...] = ("SCRAM-SHA-256", "SCRAM-SHA-512")) -> None:
        from scramp import ScramMechanism

        self.upstream, self.port = upstream, free_port()
        self.mechanisms = mechanisms
        self._scram = {m: ScramMechanism(m) for m in mechanisms}
        # what the broker would store: salted keys, never the passwords
        self._auth = {(m, user): self._scram[m].make_auth_info(pw, iteration_count=4096)
                      for m in mechanisms for user, pw in users.items()}
        self.refused = 0  # logins refused, for the tests' messages
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sasl-gateway", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> SaslGateway:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self._loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        try:
            if await self._login(reader, writer, up_reader, up_writer):
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for w in (writer, up_writer):
                w.close()

    async def _login(self, reader, writer, up_reader, up_writer) -> bool:
        server = mechanism = None
        while True:
            frame = await _read_frame(reader)
            api_key, version, correlation_id, offset = _parse_header(frame)
            if api_key == API_VERSIONS:
                up_writer.write(struct.pack(">i", len(frame)) + frame)
                writer.write(await _read_sized(up_reader))
            elif api_key == SASL_HANDSHAKE:
                (length,) = struct.unpack_from(">h", frame, offset)
                asked = frame[offset + 2:offset + 2 + length].decode()
                ok = asked in self.mechanisms
                if ok:
                    mechanism = asked
                    server = self._scram[asked].make_server(lambda user, m=asked: self._auth[(m, user)])
                writer.write(_sized(_handshake_response(correlation_id, 0 if ok else UNSUPPORTED_SASL_MECHANISM,
                                                        list(self.mechanisms))))
                if not ok:
                    await writer.drain()
                    return False
            elif api_key == SASL_AUTHENTICATE and server is not None:
                done, answer, error = self._step(server, _auth_bytes(frame, offset, version))
                message = None if error is None else f"Authentication failed during authentication due to " \
                                                      f"invalid credentials with SASL mechanism {mechanism}"
                writer.write(_sized(_authenticate_response(correlation_id, version,
                                                           SASL_AUTHENTICATION_FAILED if error else 0, message, answer)))
                await writer.drain()
                if error:
                    self.refused += 1
                    return False
                if done:
                    return True
            else:  # anything else before a login: Kafka closes the connection
                return False
            await writer.drain()

    def _step(self, server, data: bytes) -> tuple[bool, bytes, str | None]:
        """(login finished, the server's answer, why it failed)."""
        from scramp import ScramException

        try:
            if server.stage is None:  # the client's first message: user and nonce
                server.set_client_first(data.decode())
                return False, server.get_server_first().encode(), None
            server.set_client_final(data.decode())
            return True, server.get_server_final().encode(), None
        except (ScramException, KeyError) as exc:  # a wrong proof, or no such user
            return True, b"", str(exc) or type(exc).__name__


def _sized(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return await reader.readexactly(size)


async def _read_sized(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(4)
    return head + await reader.readexactly(struct.unpack(">i", head)[0])


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


# -- TLS ------------------------------------------------------------------------------------

def stunnel_binary() -> str:
    found = shutil.which("stunnel4") or shutil.which("stunnel")
    if found is None:
        raise FileNotFoundError("stunnel is not installed (Debian: apt-get install stunnel4)")
    return found


class TlsFront:
    """stunnel on ``port``: TLS with the server certificate, a client certificate signed by the
    test authority required, the plaintext relayed to ``upstream``."""

    def __init__(self, certs: Certs, upstream: tuple[str, int], directory: Path) -> None:
        self.port, self.upstream, self.directory = free_port(), upstream, directory
        self.certs = certs
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> TlsFront:
        conf = self.directory / f"stunnel-{self.port}.conf"
        conf.write_text("\n".join([
            "foreground = yes", "pid =", f"output = {self.directory / f'stunnel-{self.port}.log'}",
            "[kafka]", f"accept = 127.0.0.1:{self.port}", f"connect = {self.upstream[0]}:{self.upstream[1]}",
            f"cert = {self.certs.server_cert}", f"key = {self.certs.server_key}",
            f"CAfile = {self.certs.ca}", "verifyChain = yes", "requireCert = yes", "",
        ]))
        self._proc = subprocess.Popen([stunnel_binary(), str(conf)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"stunnel exited with {self._proc.returncode} at start; see {conf}.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stunnel not listening on {self.port} after {timeout_s}s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


# -- the endpoint ---------------------------------------------------------------------------

class SecuredBroker:
    """The embedded broker behind SASL and/or TLS, as ``protocol`` says; clients dial
    ``bootstrap``. ``users`` may log in with either SCRAM mechanism."""

    def __init__(self, protocol: str, certs: Certs, directory: Path, users: dict[str, str]) -> None:
        self.protocol, self.certs, self.directory, self.users = protocol, certs, directory, users
        self.broker = EmbeddedBroker()
        self.gateway: SaslGateway | None = None
        self.tls: TlsFront | None = None

    def start(self) -> SecuredBroker:
        inner = ("127.0.0.1", self.broker.port)
        if self.protocol.startswith("SASL_"):
            self.gateway = SaslGateway(inner, self.users).start()
            inner = ("127.0.0.1", self.gateway.port)
        if self.protocol.endswith("SSL"):
            self.tls = TlsFront(self.certs, inner, self.directory).start()
            inner = ("127.0.0.1", self.tls.port)
        # the broker tells clients to come back the way they came in: through the outermost layer
        self.broker.start(advertised=f"tcp://127.0.0.1:{inner[1]}")
        self.bootstrap = f"127.0.0.1:{inner[1]}"
        return self

    def stop(self) -> None:
        for part in (self.tls, self.gateway, self.broker):
            if part is not None:
                part.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
