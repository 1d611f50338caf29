"""Signatures on the records that move weights: who may say which version users get.

Two records decide what serving runs: a checkpoint announcement (trainer -> release controller,
``flywheel.checkpoints``) and a routing (release controller -> serving, ``flywheel.releases``).
A version's manifest hash proves that the files match the record, not that the record is
genuine: anyone who could write the topic could route users to weights of their own. So each
record is signed with Ed25519 by the one role that writes it, and its reader verifies it at its
edge (serving/follow.py, release/streams.py). A reader holds public keys only, so it cannot
forge what it verifies.

- The signature covers the record's exact value bytes and the key id, and travels in two Kafka
  headers (``flywheel-sig``: 64 raw bytes; ``flywheel-key-id``), so the JSON contract is unchanged.
- Keys are PEM files (``flywheel keys generate``), named by their key id: ``<id>.key`` (PKCS#8
  private, mode 0600) and ``<id>.pub`` (SubjectPublicKeyInfo). A verifier trusts the ``*.pub``
  files its setting names, each a file or a directory (a mounted Secret). A signer's setting names
  its ``<id>.key``, or a directory holding exactly one (a mounted Secret): then a rotation changes
  the Secret only, never the manifest that mounts it.
- Rotation: add the new public key to the verifiers' directory, switch the signer to the new
  private key, then remove the old public key. A verifier reads its keys again whenever a file or
  directory it was given changes, so none of that needs a restart of the readers.
- A verifier configured with no keys checks nothing (and says so at start); one with keys
  refuses every record that is not signed by one of them: :class:`SignatureRefused`, a
  :class:`~flywheel.contracts.ContractError`, which the readers dead-letter as any bad record.
- A key file that cannot be used (not a key, not Ed25519, badly named, unreadable) is refused
  the same way at start and while running: an error log naming the file and why, the
  ``*_key_files_refused`` gauge (:meth:`Verifier.register`), and the file listed in the
  reader's ``/health`` or ``/api/status`` (:class:`TrustState`); the process goes on verifying
  with the keys it can use. Only a start with keys configured and none usable stops (exit 2): a
  half-written update must never stop a restart, nor make a reader trust more.

docs/signing.md says how keys are provisioned and rotated, and which Kafka ACLs each role needs.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flywheel.contracts import ContractError
from flywheel.settings import SettingsError

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "flywheel-sig"
KEY_ID_HEADER = "flywheel-key-id"
#: Why a record was refused, as its dead letter names it.
Refusal = Literal["unsigned", "bad_signature", "unknown_key"]
REFUSALS: tuple[Refusal, ...] = ("unsigned", "bad_signature", "unknown_key")
#: A key id is also a file name and a header value: plain ASCII, no path, no separator.
_KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: What is signed starts with this, so a signature made for anything else never verifies here.
_DOMAIN = b"flywheel-record-v1\x00"

Headers = Sequence[tuple[str, bytes | None]] | None


class SignatureRefused(ContractError):
    """A record that is not signed by a trusted key; ``reason`` is one of :data:`REFUSALS`."""

    def __init__(self, reason: Refusal, detail: str) -> None:
        super().__init__(reason, detail)


class KeyFileError(SettingsError):
    """A key setting that cannot be used (missing, unreadable, not an Ed25519 key, badly named)."""


def _message(key_id: str, value: bytes) -> bytes:
    # the key id is signed too: a signature cannot be moved to another key's name
    return _DOMAIN + key_id.encode("ascii") + b"\x00" + value


def _check_key_id(key_id: str, where: str) -> str:
    if not _KEY_ID.fullmatch(key_id):
        raise KeyFileError(f"{where}: key id {key_id!r} must be 1-64 of A-Z a-z 0-9 . _ - "
                           "(not starting with . _ or -): it names the key's files")
    return key_id


def generate_key_pair(out_dir: Path, key_id: str) -> tuple[Path, Path]:
    """Write ``<key_id>.key`` (private, mode 0600) and ``<key_id>.pub`` into ``out_dir``; never
    overwrites a key."""
    _check_key_id(key_id, str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    private, public = out_dir / f"{key_id}.key", out_dir / f"{key_id}.pub"
    for path in (private, public):
        if path.exists():
            raise KeyFileError(f"{path} exists: a key is never overwritten (rotate to a new key id)")
    key = Ed25519PrivateKey.generate()
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def _one_private_key(path: Path, setting: str) -> Path:
    """``path`` itself, or the one ``<id>.key`` in the directory ``path`` (a mounted Secret, whose
    ``..data`` and timestamped entries are hidden)."""
    if not path.is_dir():
        return path
    keys = sorted(p for p in path.glob("*.key") if not p.name.startswith(".") and p.is_file())
    if len(keys) != 1:
        found = ", ".join(p.name for p in keys) or "none"
        raise KeyFileError(f"{setting}: the directory {path} must hold exactly one private key (<key id>.key), "
                           f"found {found}")
    return keys[0]


@dataclass(frozen=True)
class TrustMetricNames:
    """The gauges a reader's verifier is exported as (``<component>_<what>_<unit>``, one set per
    reader role)."""

    verified: str  # 1 when records are verified, 0 when read unchecked
    trusted: str   # public keys in use
    refused: str   # key files that cannot be used


#: Serving's, over release records (``serve.trusted_release_keys``).
SERVING_RELEASE = TrustMetricNames("serving_release_signatures_verified", "serving_release_trusted_keys",
                                   "serving_release_key_files_refused")
#: The release controller's, over checkpoint announcements (``release.trusted_checkpoint_keys``).
RELEASE_CHECKPOINT = TrustMetricNames("release_checkpoint_signatures_verified", "release_checkpoint_trusted_keys",
                                      "release_checkpoint_key_files_refused")


@dataclass(frozen=True)
class TrustState:
    """What a verifier trusts now: shown in serving's ``/health``, the release API's
    ``/api/status`` and console, and as metrics (:meth:`Verifier.register`)."""

    verified: bool
    """Whether records are checked at all (false: no trusted keys configured)."""
    key_ids: tuple[str, ...]
    """The key ids whose signatures are accepted."""
    refused: tuple[tuple[str, str], ...]
    """(key file, why) for each configured key file that cannot be used."""

    def as_dict(self) -> dict[str, object]:
        return {"verified": self.verified, "trusted_key_ids": list(self.key_ids),
                "refused_key_files": [{"path": p, "reason": r} for p, r in self.refused]}

    def counts(self) -> dict[str, object]:
        """Key ids and counts, no file: for serving's ``/health``, which any product key holder
        reads and which must not map the server's files (the files and reasons are in the log)."""
        return {"verified": self.verified, "trusted_key_ids": list(self.key_ids),
                "key_files_refused": len(self.refused)}


@dataclass(frozen=True)
class Signer:
    """Signs the records one role writes; with no key (``key_id`` None) it signs nothing."""

    key_id: str | None = None
    _key: Ed25519PrivateKey | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: Path | None, *, setting: str = "signing key") -> Signer:
        """The signer of the private key at ``path`` (its key id is the file name without
        ``.key``); None: an unsigned writer, which verifying readers refuse."""
        if path is None:
            log.warning("%s is not set: records go out unsigned, and readers that trust keys refuse them", setting)
            return cls()
        path = _one_private_key(Path(path), setting)
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise KeyFileError(f"{setting}: cannot read a private key from {path}: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{setting}: {path} is not an Ed25519 private key")
        return cls(_check_key_id(Path(path).stem, f"{setting} ({path})"), key)

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The Kafka headers that sign ``value`` (none without a key)."""
        if self._key is None or self.key_id is None:
            return []
        return [(KEY_ID_HEADER, self.key_id.encode("ascii")),
                (SIGNATURE_HEADER, self._key.sign(_message(self.key_id, value)))]


class Verifier:
    """Checks records against the trusted public keys a setting names (files or directories of
    ``<key id>.pub``), read again whenever one of them changes."""

    def __init__(self, sources: Sequence[Path], setting: str) -> None:
        self.sources, self.setting = tuple(Path(s) for s in sources), setting
        self._seen: tuple[tuple[str, int, int, int], ...] | None = None
        self._keys: dict[str, Ed25519PublicKey] = {}
        #: key file -> why it cannot be used, as of the last read
        self._refused: dict[str, str] = {}
        # the reader's thread checks records while a scrape or /health reads the state
        self._lock = threading.Lock()

    @classmethod
    def load(cls, sources: Sequence[Path], *, setting: str) -> Verifier:
        """A verifier of ``sources``; none: records are not verified (logged). A key file that
        cannot be used is refused and logged, the others trusted; with sources but no usable key
        at all, the start stops here (:class:`KeyFileError`: exit 2)."""
        verifier = cls(sources, setting)
        if not verifier.required:
            log.warning("%s is empty: records are not verified, and anyone who may write the topic decides what "
                        "this process does with them (docs/signing.md)", setting)
            return verifier
        verifier._reload()
        if not verifier._keys:
            why = "".join(f"; {reason}" for reason in verifier._refused.values())
            raise KeyFileError(f"{setting}: no public keys (*.pub) it can use in "
                               f"{', '.join(map(str, verifier.sources))}{why}")
        log.info("%s: trusting key ids %s", setting, ", ".join(verifier._keys))
        return verifier

    def state(self) -> TrustState:
        self._refresh()
        return TrustState(self.required, tuple(sorted(self._keys)), tuple(sorted(self._refused.items())))

    def register(self, registry: CollectorRegistry, names: TrustMetricNames) -> None:
        """Export this verifier's state on ``registry`` under ``names`` (:data:`SERVING_RELEASE`,
        :data:`RELEASE_CHECKPOINT`), read at each scrape: a key file changed while no record
        arrives still shows."""
        registry.register(_TrustCollector(self, names))

    @property
    def required(self) -> bool:
        return bool(self.sources)

    def key_ids(self) -> tuple[str, ...]:
        self._refresh()
        return tuple(sorted(self._keys))

    def check(self, value: bytes | None, headers: Headers) -> str | None:
        """The key id that signed ``value``; raises :class:`SignatureRefused` when no trusted key
        did. None when this verifier trusts no keys (nothing is verified)."""
        if not self.required:
            return None
        key_id, signature = _signature(headers)
        self._refresh()
        key = self._keys.get(key_id)
        if key is None:
            raise SignatureRefused("unknown_key", f"signed with key id {key_id!r}, which {self.setting} does not "
                                                  f"hold (trusted: {', '.join(sorted(self._keys)) or 'none'})")
        try:
            key.verify(signature, _message(key_id, value or b""))
        except InvalidSignature:
            raise SignatureRefused("bad_signature", f"the signature is not key {key_id!r}'s over this record") from None
        return key_id

    # -- reading the keys ---------------------------------------------------------------------
    def _files(self) -> list[Path]:
        files: list[Path] = []
        for source in self.sources:
            if source.is_dir():
                # a mounted Secret also holds ..data and timestamped directories: only the keys count
                files += sorted(p for p in source.glob("*.pub") if not p.name.startswith(".") and p.is_file())
            else:
                files.append(source)
        return files

    def _stamp(self, files: list[Path]) -> tuple[tuple[str, int, int, int], ...]:
        stamp = []
        for path in files:
            try:
                st = path.stat()  # follows a Secret's symlinks: an update swaps the file they reach
            except OSError:
                continue
            stamp.append((str(path), st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamp)

    def _refresh(self) -> None:
        if not self.required:
            return
        with self._lock:
            if self._stamp(self._files()) != self._seen:
                self._reload()

    def _reload(self) -> None:
        """Read every key file. A bad one is left out and logged, at start as later: a half-written
        update refuses that key's records (the other keys go on verifying), never trusts more,
        and never stops a restart while a usable key is left."""
        files = self._files()
        keys: dict[str, Ed25519PublicKey] = {}
        refused: dict[str, str] = {}
        for path in files:
            try:
                key_id, key = _read_public(path, self.setting)
            except KeyFileError as exc:
                refused[str(path)] = str(exc)
                continue
            keys[key_id] = key
        for path, why in sorted(refused.items()):
            if self._refused.get(path) != why:  # once per change, not per record
                log.error("%s: refusing key file %s: %s; records signed with its key are refused until it is fixed "
                          "(still trusting: %s)", self.setting, path, why, ", ".join(sorted(keys)) or "no key")
        if self._seen is not None and sorted(keys) != sorted(self._keys):
            log.warning("%s: trusted key ids are now %s (were %s)", self.setting, ", ".join(sorted(keys)) or "none",
                        ", ".join(sorted(self._keys)) or "none")
        self._keys, self._refused, self._seen = keys, refused, self._stamp(files)


class _TrustCollector(Collector):
    """A verifier's :class:`TrustState` as gauges, read at scrape time (:meth:`Verifier.register`)."""

    def __init__(self, verifier: Verifier, names: TrustMetricNames) -> None:
        self.verifier, self.names = verifier, names

    def describe(self) -> list[Metric]:
        return list(self._families(TrustState(False, (), ())))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.verifier.state())

    def _families(self, state: TrustState) -> Iterator[Metric]:
        setting = self.verifier.setting
        yield GaugeMetricFamily(self.names.verified,
                                f"1 when signatures are verified ({setting} names keys), 0 when every record is "
                                "read unchecked", value=int(state.verified))
        yield GaugeMetricFamily(self.names.trusted, f"Public keys of {setting} in use (2 during a "
                                "rotation)", value=len(state.key_ids))
        yield GaugeMetricFamily(self.names.refused, f"Key files of {setting} that cannot be used "
                                "(logged with the reason); their signers' records are refused", value=len(state.refused))


def _read_public(path: Path, setting: str) -> tuple[str, Ed25519PublicKey]:
    key_id = _check_key_id(path.name.removesuffix(".pub"), f"{setting} ({path})")
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"{setting}: cannot read a public key from {path}: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{setting}: {path} is not an Ed25519 public key")
    return key_id, key


def _signature(headers: Headers) -> tuple[str, bytes]:
    """The key id and signature a record's headers carry; exactly one of each, or it is refused."""
    ids = [v for n, v in headers or () if n == KEY_ID_HEADER]
    sigs = [v for n, v in headers or () if n == SIGNATURE_HEADER]
    if not ids or not sigs or ids[0] is None or sigs[0] is None:
        missing = [h for h, got in ((KEY_ID_HEADER, ids), (SIGNATURE_HEADER, sigs)) if not got or got[0] is None]
        raise SignatureRefused("unsigned", f"no {' and no '.join(missing)} header: not written by a signing role")
    if len(ids) > 1 or len(sigs) > 1:
        raise SignatureRefused("bad_signature", f"{len(ids)} key ids and {len(sigs)} signatures: one of each is signed")
    try:
        key_id = ids[0].decode("ascii")
    except UnicodeDecodeError:
        raise SignatureRefused("unknown_key", f"key id {ids[0]!r} is not ASCII: no trusted key has it") from None
    return key_id, sigs[0]
