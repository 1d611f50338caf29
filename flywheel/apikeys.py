"""The id a product API key is known by outside serving's memory: in generation records (and so
the episode archive and ``flywheel usage``), the start-up log and, only where
``serve.metrics_key_ids`` asks, serving's token counters on ``/metrics``. Never the key itself.

``key-`` and the first 12 hex digits (48 bits) of ``HMAC-SHA256(serve.user_id_salt, "api-key:" +
key)``. Keyed with the deployment's secret: a plain hash of a short or guessable key, once
published in a record or a metric label, gives the key away to anyone who hashes guesses; a keyed
one cannot be checked without the secret. Stable on every replica and across restarts, as the
records that accumulate under it need (the salt is already the one secret every serving replica
shares for good: user pseudonyms use it too). The ``api-key:`` prefix keeps the id apart from
the pseudonym of a request that names no user, which is the key's HMAC under the same salt.
Under the published default salt the id is no harder to check a guess against than a plain hash
(10^4 guesses at a short key took 0.01 s), so ``flywheel serve`` refuses that salt beside API
keys (serving/main.py ``salt_refusal``): production sets a secret of its own
(deploy/k8s/secrets.example.yaml), and ``flywheel up`` makes one and keeps it.

An operator finds a key's id (``SALT``: the deployment's ``serve.user_id_salt``) with::

    printf 'api-key:%s' "$KEY" | openssl dgst -sha256 -hmac "$SALT" | awk '{print "key-" substr($NF, 1, 12)}'

Ids recorded before the id was keyed (a plain SHA-256) differ from the ids of the same keys now.
"""

from __future__ import annotations

import hashlib
import hmac

#: Hex digits of the HMAC in an id: 48 bits, no collision among any deployment's keys.
KEY_ID_HEX = 12


def key_id(salt: str, key: str) -> str:
    """``key``'s id under the deployment secret ``salt`` (``serve.user_id_salt``)."""
    # surrogatepass: a key read from the environment may hold undecodable bytes as surrogates
    mac = hmac.new(salt.encode("utf-8", "surrogatepass"), b"api-key:" + key.encode("utf-8", "surrogatepass"),
                   hashlib.sha256)
    return "key-" + mac.hexdigest()[:KEY_ID_HEX]
