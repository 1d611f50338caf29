"""Signatures on the records that move weights (flywheel/signing.py), one narrow case per rule.

Each case starts from a record a trusted key signed, which the verifier accepts, and changes one
thing: the value, the key id, the key, a header. A refusal must name its reason, because the
reason is what the dead letter tells an on-call engineer (``unsigned``: a writer without a key,
``unknown_key``: a key not or no longer trusted, ``bad_signature``: a forgery or tampering).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flywheel.contracts import ContractError
from flywheel.settings import SettingsError
from flywheel.signing import (
    KEY_ID_HEADER,
    SERVING_RELEASE,
    SIGNATURE_HEADER,
    KeyFileError,
    SignatureRefused,
    Signer,
    Verifier,
    generate_key_pair,
)

VALUE = b'{"kind":"release","revision":7}'


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A directory with two key pairs, ``alpha`` and ``beta``, and a trusted directory holding alpha."""
    for key_id in ("alpha", "beta"):
        generate_key_pair(tmp_path / "pairs", key_id)
    (tmp_path / "trusted").mkdir()
    (tmp_path / "trusted" / "alpha.pub").write_bytes((tmp_path / "pairs" / "alpha.pub").read_bytes())
    return tmp_path


def signer(keys: Path, key_id: str) -> Signer:
    return Signer.load(keys / "pairs" / f"{key_id}.key")


def _replace(headers: list[tuple[str, bytes]], name: str, value: bytes | None) -> list[tuple[str, bytes | None]]:
    return [(n, value if n == name else v) for n, v in headers]


def _drop(headers: list[tuple[str, bytes]], name: str) -> list[tuple[str, bytes]]:
    return [(n, v) for n, v in headers if n != name]


# (what is changed, value, headers from the alpha-signed headers) -> the reason, or None: accepted
CASES = [
    ("genuine", lambda h: (VALUE, h), None),
    ("the value changed by one byte", lambda h: (VALUE.replace(b"7", b"8"), h), "bad_signature"),
    ("the value with a byte appended", lambda h: (VALUE + b" ", h), "bad_signature"),
    ("the key id renamed to another trusted key", lambda h: (VALUE, _replace(h, KEY_ID_HEADER, b"beta")),
     "bad_signature"),
    ("the key id renamed to an unknown one", lambda h: (VALUE, _replace(h, KEY_ID_HEADER, b"gamma")), "unknown_key"),
    ("a key id that is not ASCII", lambda h: (VALUE, _replace(h, KEY_ID_HEADER, b"\xffalpha")), "unknown_key"),
    ("no signature header", lambda h: (VALUE, _drop(h, SIGNATURE_HEADER)), "unsigned"),
    ("no key id header", lambda h: (VALUE, _drop(h, KEY_ID_HEADER)), "unsigned"),
    ("no headers at all", lambda h: (VALUE, []), "unsigned"),
    ("headers None (kafka-python's empty)", lambda h: (VALUE, None), "unsigned"),
    ("a signature header with no value", lambda h: (VALUE, _replace(h, SIGNATURE_HEADER, None)), "unsigned"),
    ("a truncated signature", lambda h: (VALUE, _replace(h, SIGNATURE_HEADER, dict(h)[SIGNATURE_HEADER][:63])),
     "bad_signature"),
    ("a signature of zeros", lambda h: (VALUE, _replace(h, SIGNATURE_HEADER, bytes(64))), "bad_signature"),
    ("a second signature header", lambda h: (VALUE, [*h, (SIGNATURE_HEADER, bytes(64))]), "bad_signature"),
    ("a second key id header", lambda h: (VALUE, [*h, (KEY_ID_HEADER, b"alpha")]), "bad_signature"),
    ("other headers beside it", lambda h: (VALUE, [("flywheel-replay-of", b"0:1"), *h]), None),
]


@pytest.mark.parametrize(("what", "change", "reason"), CASES, ids=[c[0] for c in CASES])
def test_a_trusted_signature_is_accepted_and_each_change_refused_with_its_reason(keys, what, change, reason):
    verifier = Verifier.load([keys / "trusted", keys / "pairs" / "beta.pub"], setting="test.keys")
    value, headers = change(signer(keys, "alpha").headers(VALUE))
    if reason is None:
        assert verifier.check(value, headers) == "alpha"
        return
    with pytest.raises(SignatureRefused) as exc:
        verifier.check(value, headers)
    assert exc.value.reason == reason
    assert isinstance(exc.value, ContractError)  # the consumers' edge dead-letters it as any bad record


def test_a_record_signed_by_an_untrusted_key_under_a_trusted_id_is_refused(keys, tmp_path):
    # the attacker names their own key "alpha": the id is known, the signature is not alpha's
    generate_key_pair(tmp_path / "attacker", "alpha")
    forged = Signer.load(tmp_path / "attacker" / "alpha.key").headers(VALUE)
    with pytest.raises(SignatureRefused) as exc:
        Verifier.load([keys / "trusted"], setting="test.keys").check(VALUE, forged)
    assert exc.value.reason == "bad_signature"


def test_a_record_signed_by_a_key_the_verifier_does_not_hold_is_unknown(keys):
    with pytest.raises(SignatureRefused) as exc:
        Verifier.load([keys / "trusted"], setting="test.keys").check(VALUE, signer(keys, "beta").headers(VALUE))
    assert exc.value.reason == "unknown_key"


def test_a_verifier_with_no_keys_trusts_every_record_and_says_so(caplog):
    verifier = Verifier.load([], setting="serve.trusted_release_keys")
    assert not verifier.required
    assert verifier.check(VALUE, None) is None
    assert "serve.trusted_release_keys" in caplog.text and "not verified" in caplog.text


def test_a_signer_with_no_key_signs_nothing(caplog):
    unsigned = Signer.load(None, setting="trainer.signing_key")
    assert unsigned.key_id is None and unsigned.headers(VALUE) == []
    assert "trainer.signing_key" in caplog.text


def test_rotation_adds_then_removes_a_key_without_a_restart(keys):
    """Rotation: trust the new key beside the old, switch the signer, then remove the old key.
    The verifier reads its directory again when it changes (a mounted Secret is updated in place)."""
    verifier = Verifier.load([keys / "trusted"], setting="test.keys")
    old, new = signer(keys, "alpha"), signer(keys, "beta")
    assert verifier.check(VALUE, old.headers(VALUE)) == "alpha"
    with pytest.raises(SignatureRefused):
        verifier.check(VALUE, new.headers(VALUE))
    (keys / "trusted" / "beta.pub").write_bytes((keys / "pairs" / "beta.pub").read_bytes())
    assert verifier.check(VALUE, new.headers(VALUE)) == "beta"
    assert verifier.check(VALUE, old.headers(VALUE)) == "alpha"  # both, while signers switch
    (keys / "trusted" / "alpha.pub").unlink()
    assert verifier.check(VALUE, new.headers(VALUE)) == "beta"
    with pytest.raises(SignatureRefused) as exc:
        verifier.check(VALUE, old.headers(VALUE))
    assert exc.value.reason == "unknown_key"
    assert verifier.key_ids() == ("beta",)


def test_a_key_file_replaced_in_place_is_read_again(keys):
    verifier = Verifier.load([keys / "trusted" / "alpha.pub"], setting="test.keys")
    assert verifier.check(VALUE, signer(keys, "alpha").headers(VALUE)) == "alpha"
    # alpha.pub now holds beta's public key: alpha's records no longer verify
    path = keys / "trusted" / "alpha.pub"
    path.write_bytes((keys / "pairs" / "beta.pub").read_bytes())
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)  # a coarse clock would hide the change
    with pytest.raises(SignatureRefused) as exc:
        verifier.check(VALUE, signer(keys, "alpha").headers(VALUE))
    assert exc.value.reason == "bad_signature"


def test_keys_load_from_files_and_directories_and_are_named_by_their_file(keys):
    verifier = Verifier.load([keys / "trusted", keys / "pairs" / "beta.pub"], setting="test.keys")
    assert verifier.key_ids() == ("alpha", "beta")
    assert signer(keys, "beta").key_id == "beta"


def test_generated_pairs_keep_the_private_key_private_and_are_never_overwritten(tmp_path):
    private, public = generate_key_pair(tmp_path, "release-2026-01")
    assert (private.name, public.name) == ("release-2026-01.key", "release-2026-01.pub")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    before = private.read_bytes()
    with pytest.raises(KeyFileError, match="exists"):
        generate_key_pair(tmp_path, "release-2026-01")
    assert private.read_bytes() == before


@pytest.mark.parametrize("key_id", ["", "has space", "../up", "a/b", ".hidden", "x" * 65, "é"])
def test_a_key_id_must_be_a_plain_name(tmp_path, key_id):
    with pytest.raises(KeyFileError, match="key id"):
        generate_key_pair(tmp_path, key_id)


# (what the trusted keys setting names) -> the error's words: every one stops the process at start
BAD_SOURCES = [
    ("a missing file", lambda d: d / "nope.pub", "nope.pub"),
    ("an empty directory", lambda d: _mkdir(d / "empty"), "no public keys"),
    ("a file that is not a key", lambda d: _write(d / "junk.pub", b"not a key"), "junk.pub"),
    ("a private key", lambda d: d / "pairs" / "alpha.key", "alpha.key"),
    ("a file named with a bad key id", lambda d: _write(d / "bad id.pub", (d / "pairs" / "alpha.pub").read_bytes()),
     "key id"),
]


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("what", "make", "words"), BAD_SOURCES, ids=[c[0] for c in BAD_SOURCES])
def test_trusted_keys_that_cannot_be_used_stop_the_start_with_a_message(keys, what, make, words):
    with pytest.raises(KeyFileError, match="test.keys") as exc:
        Verifier.load([make(keys)], setting="test.keys")
    assert words in str(exc.value)
    assert isinstance(exc.value, SettingsError)  # the command prints it and exits 2, no traceback


def test_a_signing_key_that_is_a_public_key_stops_the_start(keys):
    with pytest.raises(KeyFileError, match="alpha.pub"):
        Signer.load(keys / "pairs" / "alpha.pub", setting="release.signing_key")


def test_flywheel_keys_generate_writes_a_pair_that_signs_and_verifies(tmp_path, capsys):
    from cli.main import main

    assert main(["keys", "generate", "--out", str(tmp_path / "k"), "--key-id", "release-2026-12"]) == 0
    value_signed = Signer.load(tmp_path / "k" / "release-2026-12.key").headers(VALUE)
    assert Verifier.load([tmp_path / "k"], setting="t").check(VALUE, value_signed) == "release-2026-12"
    assert main(["keys", "generate", "--out", str(tmp_path / "k"), "--key-id", "release-2026-12"]) == 2
    assert "never overwritten" in capsys.readouterr().err


def test_flywheel_up_signs_the_loop_with_pairs_it_keeps_and_leaves_configured_records_alone(tmp_path):
    from flywheel.settings import ServeSettings, Settings
    from local.up import local_keys

    env = local_keys(Settings(), tmp_path / "keys")
    assert sorted(env) == ["FLYWHEEL_RELEASE_SIGNING_KEY", "FLYWHEEL_RELEASE_TRUSTED_CHECKPOINT_KEYS",
                           "FLYWHEEL_SERVE_TRUSTED_RELEASE_KEYS", "FLYWHEEL_TRAINER_SIGNING_KEY"]
    release = Signer.load(Path(env["FLYWHEEL_RELEASE_SIGNING_KEY"]))
    trainer = Signer.load(Path(env["FLYWHEEL_TRAINER_SIGNING_KEY"]))
    serving = Verifier.load([Path(env["FLYWHEEL_SERVE_TRUSTED_RELEASE_KEYS"])], setting="t")
    controller = Verifier.load([Path(env["FLYWHEEL_RELEASE_TRUSTED_CHECKPOINT_KEYS"])], setting="t")
    assert serving.check(VALUE, release.headers(VALUE)) == "release-local"
    assert controller.check(VALUE, trainer.headers(VALUE)) == "trainer-local"
    with pytest.raises(SignatureRefused):  # each reader trusts only its writer
        serving.check(VALUE, trainer.headers(VALUE))
    before = (tmp_path / "keys" / "release-local.key").read_bytes()
    assert local_keys(Settings(), tmp_path / "keys") == env  # the next start keeps the pairs
    assert (tmp_path / "keys" / "release-local.key").read_bytes() == before
    # an operator who set either side of a record configures that record
    mine = Settings(serve=ServeSettings(trusted_release_keys=(tmp_path / "theirs",)))
    assert sorted(local_keys(mine, tmp_path / "other")) == ["FLYWHEEL_RELEASE_TRUSTED_CHECKPOINT_KEYS",
                                                           "FLYWHEEL_TRAINER_SIGNING_KEY"]


# -- a key file that cannot be used: the same at start and while running ---------------------------
def _gauges(registry) -> dict[str, float]:
    names = SERVING_RELEASE
    return {"signatures_verified": registry.get_sample_value(names.verified),
            "trusted_keys": registry.get_sample_value(names.trusted),
            "key_files_refused": registry.get_sample_value(names.refused)}


@pytest.mark.parametrize("junk", [b"not a key", b"", b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"],
                         ids=["text", "empty", "truncated PEM"])
def test_a_bad_key_file_beside_a_good_one_is_refused_loudly_at_start_and_the_good_one_trusted(keys, junk, caplog):
    """A malformed ``.pub`` in the trusted directory once stopped every restart (while a running
    reader only logged it): now a start refuses that file as loudly as a running reader does,
    and goes on with the keys it can use."""
    from flywheel.metrics import new_registry

    (keys / "trusted" / "junk.pub").write_bytes(junk)
    verifier = Verifier.load([keys / "trusted"], setting="test.keys")  # raised KeyFileError, and the start stopped
    assert verifier.check(VALUE, signer(keys, "alpha").headers(VALUE)) == "alpha"
    state = verifier.state()
    assert state.verified and state.key_ids == ("alpha",)
    [(path, why)] = state.refused
    assert path.endswith("junk.pub") and "test.keys" in why
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "junk.pub" in errors[0].getMessage() and "alpha" in errors[0].getMessage()
    registry = new_registry()
    verifier.register(registry, SERVING_RELEASE)
    assert _gauges(registry) == {"signatures_verified": 1, "trusted_keys": 1, "key_files_refused": 1}


def test_a_bad_key_file_that_appears_while_running_is_refused_loudly_and_shown(keys, caplog):
    from flywheel.metrics import new_registry

    verifier = Verifier.load([keys / "trusted"], setting="test.keys")
    registry = new_registry()
    verifier.register(registry, SERVING_RELEASE)
    assert _gauges(registry) == {"signatures_verified": 1, "trusted_keys": 1, "key_files_refused": 0}
    caplog.clear()
    (keys / "trusted" / "beta.pub").write_bytes(b"half a key")  # a rotation's file half written
    # shown at the next scrape, before any record arrives to make the verifier look
    assert _gauges(registry) == {"signatures_verified": 1, "trusted_keys": 1, "key_files_refused": 1}
    assert verifier.check(VALUE, signer(keys, "alpha").headers(VALUE)) == "alpha"
    with pytest.raises(SignatureRefused) as exc:
        verifier.check(VALUE, signer(keys, "beta").headers(VALUE))
    assert exc.value.reason == "unknown_key"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "beta.pub" in errors[0]  # once per change, not once per record or scrape
    (keys / "trusted" / "beta.pub").write_bytes((keys / "pairs" / "beta.pub").read_bytes())  # the write completes
    assert verifier.check(VALUE, signer(keys, "beta").headers(VALUE)) == "beta"
    assert _gauges(registry) == {"signatures_verified": 1, "trusted_keys": 2, "key_files_refused": 0}


def test_a_verifier_with_no_keys_shows_that_nothing_is_verified():
    from flywheel.metrics import new_registry

    verifier = Verifier.load([], setting="serve.trusted_release_keys")
    registry = new_registry()
    verifier.register(registry, SERVING_RELEASE)
    assert _gauges(registry) == {"signatures_verified": 0, "trusted_keys": 0, "key_files_refused": 0}
    assert verifier.state().as_dict() == {"verified": False, "trusted_key_ids": [], "refused_key_files": []}


def test_a_signer_reads_the_one_key_of_a_directory_so_a_rotation_changes_only_the_secret(keys, tmp_path):
    mounted = tmp_path / "release-key"
    mounted.mkdir()
    (mounted / "..data").mkdir()  # what a mounted Secret also holds
    with pytest.raises(KeyFileError, match="exactly one private key"):
        Signer.load(mounted, setting="release.signing_key")
    (mounted / "alpha.key").write_bytes((keys / "pairs" / "alpha.key").read_bytes())
    loaded = Signer.load(mounted, setting="release.signing_key")
    assert loaded.key_id == "alpha"
    assert Verifier.load([keys / "trusted"], setting="t").check(VALUE, loaded.headers(VALUE)) == "alpha"
    (mounted / "beta.key").write_bytes((keys / "pairs" / "beta.key").read_bytes())
    with pytest.raises(KeyFileError, match="alpha.key, beta.key"):  # which one signs is never a guess
        Signer.load(mounted, setting="release.signing_key")


def test_flywheel_release_status_says_what_the_controller_verifies_and_signs_with(keys):
    from release.client import format_status
    from release.streams import signing_report

    base = {"stable_version": 0, "time": 0.0, "candidates": {},
            "controller": {"controller": "c1", "active": True, "last_tick_age_s": 0.2}}
    off = format_status({**base, "controller": {**base["controller"], "signing": signing_report(
        Verifier.load([], setting="release.trusted_checkpoint_keys"), Signer())}})
    assert "checkpoints NOT verified (no trusted keys); routings UNSIGNED" in off
    (keys / "trusted" / "junk.pub").write_text("x")
    on = format_status({**base, "controller": {**base["controller"], "signing": signing_report(
        Verifier.load([keys / "trusted"], setting="release.trusted_checkpoint_keys"), signer(keys, "beta"))}})
    assert "checkpoints verified (alpha); key file refused:" in on and "junk.pub; routings signed with beta" in on
    assert "signing=" not in on  # its own row, not a dict dumped into the controller's
