"""API key ids given away: under the published ``serve.user_id_salt`` a key id (flywheel/apikeys.py)
is checked against guesses as fast as a plain hash, so serving refuses that salt, or a short one,
beside API keys (serving/main.py ``salt_refusal``), and ``flywheel up`` gives serving a random salt it keeps
(local/up.py ``local_salt``). ``/metrics`` showing no key id is held by
tests/integration/test_serving_usage.py."""

from __future__ import annotations

import secrets
import stat
import time

import pytest

from flywheel.apikeys import key_id
from flywheel.settings import ServeSettings, Settings, load_settings
from serving.main import MIN_SALT_CHARS, routing_secret_refusal, salt_refusal

DEFAULT = ServeSettings().user_id_salt

# (api keys, salt) -> refused?
CASES = [
    ((), DEFAULT, False),                 # anonymous: no key id to give away (serving warns of the pseudonyms)
    (("sk-a",), DEFAULT, True),
    (("sk-a", "sk-b"), DEFAULT, True),
    (("sk-a",), "a-secret-of-our-own", False),
    ((), "a-secret-of-our-own", False),
    (("sk-a",), "", True),                # placeholders and words are guessed as the default is
    (("sk-a",), "x", True),
    (("sk-a",), "changeme", True),
    (("sk-a",), "a" * (MIN_SALT_CHARS - 1), True),
    (("sk-a",), "a" * MIN_SALT_CHARS, False),
    (("sk-a",), secrets.token_hex(32), False),  # what `openssl rand -hex 32` and `flywheel up` make
    ((), "x", False),                     # no key id to give away
]


@pytest.mark.parametrize(("keys", "salt", "refused"), CASES)
def test_api_keys_with_the_published_salt_are_refused(keys, salt, refused):
    why = salt_refusal(ServeSettings(api_keys=keys, user_id_salt=salt, allow_anonymous=not keys))
    assert (why is not None) == refused
    if why is not None:  # says how to set one, never quoting the salt
        assert "FLYWHEEL_SERVE_USER_ID_SALT_FILE" in why and "sk-a" not in why
        assert salt == DEFAULT or (f"at least {MIN_SALT_CHARS}" in why and (len(salt) < 2 or salt not in why))


@pytest.mark.parametrize(("keys", "follow", "secret", "refused"), [
    (("sk-a",), True, "", True),                               # unset: the split is the topic's
    (("sk-a",), True, "a" * (MIN_SALT_CHARS - 1), True),
    (("sk-a",), True, "a" * MIN_SALT_CHARS, False),
    (("sk-a",), True, secrets.token_hex(32), False),           # what `flywheel up` makes
    (("sk-a",), False, "", False),                             # no releases followed: no canary to split
    ((), True, "", False),                                     # no keys: no product users to protect
])
def test_serving_with_api_keys_refuses_to_split_users_without_a_routing_secret(keys, follow, secret, refused):
    settings = Settings(routing_secret=secret, serve=ServeSettings(
        api_keys=keys, allow_anonymous=not keys, follow_releases=follow, user_id_salt=secrets.token_hex(32)))
    why = routing_secret_refusal(settings)
    assert (why is not None) == refused
    if why is not None:  # says how to set one, never quoting it
        assert "FLYWHEEL_ROUTING_SECRET_FILE" in why and (not secret or secret not in why)


def test_a_key_id_under_the_published_salt_gives_a_short_key_away():
    """Why the refusal: the attack the review ran, 10^4 guesses in well under a second."""
    secret = "sk-4711"
    published = key_id(DEFAULT, secret)
    t0 = time.perf_counter()
    found = next(f"sk-{n:04d}" for n in range(10_000) if key_id(DEFAULT, f"sk-{n:04d}") == published)
    assert found == secret and time.perf_counter() - t0 < 5


def test_flywheel_serve_refuses_api_keys_with_the_published_salt_and_says_how_to_set_one(monkeypatch, tmp_path, capsys,
                                                                                         caplog):
    from cli.main import main

    for name in [n for n in __import__("os").environ if n.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no flywheel.toml of the working tree
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "no-model"))
    monkeypatch.setenv("FLYWHEEL_API_KEYS", "sk-product")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "serve.user_id_salt is the published default" in err and "FLYWHEEL_SERVE_USER_ID_SALT_FILE" in err
    assert "sk-product" not in err
    assert not (tmp_path / "data").exists()  # refused before anything started
    # with a salt of its own it goes on, to the routing secret, then to the model (missing here)
    monkeypatch.setenv("FLYWHEEL_SERVE_USER_ID_SALT", "a-secret-of-our-own")
    assert main(["serve"]) == 2
    assert "routing_secret is not set" in capsys.readouterr().err
    monkeypatch.setenv("FLYWHEEL_ROUTING_SECRET", "a-routing-secret-of-our-own")
    assert main(["serve"]) == 2
    assert "published default" not in capsys.readouterr().err and "refusing to serve" in caplog.text


def test_flywheel_up_gives_serving_a_random_salt_it_keeps_and_leaves_an_operators_alone(tmp_path):
    from local.up import local_salt

    env = local_salt(Settings(), tmp_path / "up")
    path = tmp_path / "up" / "user-id-salt"
    assert env == {"FLYWHEEL_SERVE_USER_ID_SALT_FILE": str(path)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
    serve = load_settings(env={**env, "FLYWHEEL_API_KEYS": "sk-local"}).serve
    assert not serve.uses_default_salt and salt_refusal(serve) is None and len(serve.user_id_salt) >= MIN_SALT_CHARS
    before = path.read_text()
    assert local_salt(Settings(), tmp_path / "up") == env and path.read_text() == before  # ids stay across restarts
    assert local_salt(Settings(serve=ServeSettings(user_id_salt="theirs")), tmp_path / "other") == {}
    assert not (tmp_path / "other").exists()


def test_flywheel_up_gives_serving_and_release_a_routing_secret_it_keeps_and_leaves_an_operators_alone(tmp_path):
    from local.up import local_routing_secret

    env = local_routing_secret(Settings(), tmp_path / "up")
    path = tmp_path / "up" / "routing-secret"
    assert env == {"FLYWHEEL_ROUTING_SECRET_FILE": str(path)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
    settings = load_settings(env={**env, "FLYWHEEL_API_KEYS": "sk-local", "FLYWHEEL_SERVE_USER_ID_SALT": "s" * 32})
    assert routing_secret_refusal(settings) is None and settings.routing_secret == path.read_text()
    before = path.read_text()
    assert local_routing_secret(Settings(), tmp_path / "up") == env and path.read_text() == before  # the split stays
    assert local_routing_secret(Settings(routing_secret="theirs-of-16-chars"), tmp_path / "other") == {}
    assert not (tmp_path / "other").exists()
