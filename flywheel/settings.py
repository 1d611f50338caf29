"""Settings, parsed once at each entrypoint and passed down as one validated object.

Sources, later wins: built-in defaults < ``flywheel.toml`` (path from ``FLYWHEEL_CONFIG``, else
``./flywheel.toml`` when present) < environment variables. An environment variable names a field
as ``FLYWHEEL_<SECTION>_<FIELD>`` (``FLYWHEEL_SERVE_PORT`` -> ``serve.port``) or, for top-level
fields, ``FLYWHEEL_<FIELD>`` (``FLYWHEEL_DATA_DIR``). A few historical names are aliases (see
``_ALIASES``). Every setting can also be read from a file: ``FLYWHEEL_<NAME>_FILE=/path`` gives
``FLYWHEEL_<NAME>`` the file's content, less its trailing newline, so a secret mounts as a file
(setting both is an error).

An orchestrator adds variables of its own to a process's environment: Kubernetes injects service
links (``FLYWHEEL_SERVICE_HOST`` for a Service named ``flywheel``, ``FLYWHEEL_SERVE_PORT=tcp://IP:PORT``
for one named ``flywheel-serve``). So an unknown ``FLYWHEEL_*`` variable, and a service link's
``tcp://`` value under a real setting's name, is ignored with a warning logged once per process
(no value is logged: a misspelt secret's name must not print the secret). A key of
``flywheel.toml`` that names no setting stays an error: a file is written by a person, a typo in it
is always theirs.

This module must stay free of torch and of stage code: every process imports it first.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flywheel.addresses import is_internal, literal_ip
from flywheel.apikeys import key_id
from flywheel.contracts import MAX_OUTPUT_REQUEST_BYTES
from flywheel.dburl import database_url_refusal, redact_database_url
from flywheel.environment import VariableError, read_environment, warn_once


def _distinct(shards: tuple[int, ...]) -> tuple[int, ...]:
    if len(set(shards)) != len(shards):
        raise ValueError(f"shards {list(shards)} name a partition twice")
    return tuple(sorted(shards))


#: Partition numbers a stage process owns (empty: all, through its consumer group).
Shards = Annotated[tuple[Annotated[int, Field(ge=0)], ...], AfterValidator(_distinct)]


class _Section(BaseModel):
    # No setting is meant to be infinite or NaN, and one that is would poison the arithmetic it
    # feeds (an infinite penalty makes every reward null on the wire) rather than fail at start.
    # A refused value stays out of pydantic's message (its input_value=...): it may be a secret
    # (a webhook URL's token, a password, an API key), and the message ends up in logs. The
    # error names the setting and says what is wrong; a validator here quotes a value only where
    # it cannot be a secret (a number, a loss name) or with its passwords masked.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False, hide_input_in_errors=True)


class KafkaSettings(_Section):
    bootstrap: str = "127.0.0.1:9092"
    """Comma-separated ``host:port`` list of the Kafka cluster (or the embedded broker)."""
    client_id: str = "flywheel"
    """Prefix of every client id; the process role is appended."""
    session_timeout_ms: int = Field(default=10_000, ge=1_000)
    """Consumer-group session timeout. The embedded broker holds a join for half of it, so tests
    and the demo use ~2000 for fast rebalances; production clusters keep 10-45 s."""
    heartbeat_interval_ms: int = Field(default=3_000, ge=100)
    """Consumer heartbeat; must be well under ``session_timeout_ms``."""
    max_poll_interval_ms: int = Field(default=300_000, ge=1_000)
    """Longest a consumer may go between polls (one loop turn of a stage or the trainer) before it
    leaves its group. It rejoins on its next turn: one rebalance per turn that takes longer,
    nothing lost or doubled, but partitions pause meanwhile. Size ``reward.max_batch`` so that
    turns stay well under it."""
    partitions: int = Field(default=4, ge=1)
    """Partitions for topics Flywheel creates itself (existing topics are left as they are)."""
    replication_factor: int = Field(default=1, ge=1)
    """Replication for topics Flywheel creates; 3 on a production cluster."""
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=MAX_OUTPUT_REQUEST_BYTES)
    """Largest produce request; records hold token ids and logprobs, so allow a few MB. It may
    not be set below the largest record a stage sends (a dead letter quoting the largest valid
    episode, about 7 MiB): a client refuses a larger record before it reaches the broker."""
    linger_ms: int = Field(default=5, ge=0)
    """Producer batching delay: trades a few ms of latency for far fewer requests."""
    request_timeout_ms: int = Field(default=30_000, ge=500)
    """How long a producer waits for the broker to answer one request before retrying it; also
    how long a process starting while the broker does not answer waits before it says so."""
    delivery_timeout_ms: int = Field(default=120_000, ge=1_000)
    """How long a producer keeps retrying a record before it reports the send failed. Nothing is
    lost when that happens: the sender keeps the record, replaces the producer and sends it again
    (at least once; the stages' outbox settles its shard first and stays exactly once). Must be at
    least ``request_timeout_ms + linger_ms``."""
    producer_client: Literal["confluent", "kafka-python"] = "confluent"
    """Client library for the ingest and reward stages' exactly-once outputs (their outbox):
    ``confluent`` (librdkafka; a third or less of kafka-python's CPU per record in
    bench/ingest_throughput.py) or ``kafka-python``. Both are idempotent with ``acks=all``; every
    other Kafka client (consumers, serving's producer) is kafka-python either way."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How every client (kafka-python, confluent-kafka, the admin client, the CLI tools) reaches
    the brokers: ``PLAINTEXT``, ``SSL`` (TLS), ``SASL_PLAINTEXT`` (SASL login, no TLS: the login
    and the records cross the network in the clear) or ``SASL_SSL`` (both; what managed clusters
    ask for). docs/deploy.md, Secured Kafka."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism, required with a ``SASL_*`` protocol. ``PLAIN`` sends the password itself
    (use it over ``SASL_SSL`` only); the SCRAM ones prove it without sending it."""
    sasl_username: str = ""
    """SASL user, required with a ``SASL_*`` protocol."""
    sasl_password: str = ""
    """SASL password, required with a ``SASL_*`` protocol. Mount it as a file and name that with
    ``FLYWHEEL_KAFKA_SASL_PASSWORD_FILE``; it is masked in the start-up log."""
    ssl_cafile: Path | None = None
    """PEM file of the certificate authorities that sign the brokers' certificates, with ``SSL``
    or ``SASL_SSL``. Unset: the system's trust store (enough for most managed clusters)."""
    ssl_certfile: Path | None = None
    """PEM client certificate, for brokers that authenticate clients by TLS (mutual TLS). Needs
    ``ssl_keyfile``."""
    ssl_keyfile: Path | None = None
    """PEM private key of ``ssl_certfile`` (unencrypted: mount it from a Secret)."""
    ssl_check_hostname: bool = True
    """Check that the broker's certificate names the host the client dialled. Turn it off only
    for brokers whose certificates name no advertised host (the certificate is still checked
    against ``ssl_cafile``)."""

    @model_validator(mode="after")
    def _security_fits_protocol(self) -> KafkaSettings:
        if problems := security_problems(self):
            raise ValueError("; ".join(problems))
        return self

    @field_validator("delivery_timeout_ms")
    @classmethod
    def _delivery_covers_a_request(cls, v: int, info: Any) -> int:
        floor = info.data.get("request_timeout_ms", 30_000) + info.data.get("linger_ms", 5)
        if v < floor:
            raise ValueError(f"delivery_timeout_ms={v} must be at least request_timeout_ms + linger_ms ({floor})")
        return v

    @field_validator("heartbeat_interval_ms")
    @classmethod
    def _heartbeat_below_session(cls, v: int, info: Any) -> int:
        session = info.data.get("session_timeout_ms", 10_000)
        if v * 3 > session:
            raise ValueError(
                f"heartbeat_interval_ms={v} must be at most a third of session_timeout_ms={session}"
            )
        return v


def security_problems(cfg: KafkaSettings) -> list[str]:
    """What is wrong with ``cfg``'s security settings taken together, each a sentence that names
    the setting and says what to do; empty when they fit."""
    protocol = cfg.security_protocol
    sasl, tls = protocol.startswith("SASL_"), protocol.endswith("SSL")
    problems: list[str] = []
    if sasl:
        missing = [name for name in ("sasl_mechanism", "sasl_username", "sasl_password") if not getattr(cfg, name)]
        if missing:
            problems.append(f"security_protocol={protocol} needs {', '.join(missing)}")
    elif given := [name for name in ("sasl_mechanism", "sasl_username", "sasl_password") if getattr(cfg, name)]:
        problems.append(f"{', '.join(given)} set, but security_protocol={protocol} logs in with no SASL: "
                        "set security_protocol to SASL_SSL (or SASL_PLAINTEXT), or remove them")
    tls_files = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
    if not tls and (given := [name for name in tls_files if getattr(cfg, name) is not None]):
        problems.append(f"{', '.join(given)} set, but security_protocol={protocol} uses no TLS: "
                        f"set security_protocol to {'SASL_SSL' if sasl else 'SSL'}, or remove them")
    if (cfg.ssl_certfile is None) != (cfg.ssl_keyfile is None):
        problems.append("ssl_certfile and ssl_keyfile go together (a client certificate and its key)")
    for name in tls_files:
        path = getattr(cfg, name)
        if path is not None and not path.is_file():
            problems.append(f"{name}={path}: no such file")
    return problems


class ServeSettings(_Section):
    host: str = "127.0.0.1"
    """Interface the API binds to; 0.0.0.0 behind a load balancer."""
    port: int = Field(default=8000, ge=0, le=65535)
    """API port (``FLYWHEEL_SERVE_PORT``); 0 picks a free one."""
    api_keys: tuple[str, ...] = ()
    """Product API keys (``FLYWHEEL_API_KEYS``, comma-separated). Empty means no auth, allowed
    only with ``allow_anonymous`` so an unauthenticated deployment is always a deliberate act."""
    allow_anonymous: bool = False
    """Accept requests without an API key when ``api_keys`` is empty (local demo only)."""
    model_name: str = "flywheel"
    """Deployment name listed by ``GET /v1/models``; responses name ``<model_name>@v<version>``."""
    rate_limit_per_minute: float = Field(default=600.0, gt=0)
    """Sustained requests per minute allowed to one user of one API key (token bucket): the same
    user named through two keys has two buckets, so one product cannot spend another's. Each
    serving replica limits on its own: over N replicas a user may get N times this
    (docs/serving-api.md, Rate limits)."""
    rate_limit_burst: int = Field(default=60, ge=1)
    """Requests one user of one API key may make at once before the sustained rate applies."""
    rate_limit_key_per_minute: float = Field(default=30_000.0, gt=0)
    """Sustained requests per minute allowed to one API key, whichever users it names (token
    bucket). The user is whoever the client names, so without this a client that makes up a new
    ``user`` per request multiplies the per-user limit. One product key may carry all of its
    product's users: the default is 50 users' worth of the per-user default."""
    rate_limit_key_burst: int = Field(default=3_000, ge=1)
    """Requests one API key may make at once before its sustained rate applies (per replica, as
    every rate limit)."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    """Larger request bodies get 413 (feedback bodies also above 1 MiB: see MAX_FEEDBACK_BODY_BYTES)."""
    max_tokens_limit: int = Field(default=1024, ge=1)
    """Upper bound on ``max_tokens`` a client may ask for."""
    max_n: int = Field(default=8, ge=1)
    """Upper bound on ``n`` (samples per prompt; choices of one request form a GRPO group)."""
    user_id_salt: str = "flywheel-dev-salt"
    """Secret mixed into user pseudonyms and API key ids (HMAC-SHA256: flywheel/apikeys.py); set a
    real secret in production, the same on every serving replica, and keep it: a new one makes
    every user a new user and gives every key a new id. ``flywheel serve`` with ``api_keys``
    refuses to start on this published default or on one shorter than 16 characters (anyone could
    check a guessed key against its id: serving/main.py ``MIN_SALT_CHARS``); ``flywheel up`` and
    ``flywheel demo`` make a random one and keep it under ``<data_dir>/up``."""
    metrics_key_ids: bool = False
    """Label serving's token counters on ``/metrics`` by API key id (``api_key="key-..."``).
    ``/metrics`` answers without a key, and a key id lets whoever reads it check guesses of the key
    offline once the salt is known: off, every series is labelled ``api_key="all"``, and usage per
    key comes from ``flywheel usage`` (the episode archive). Turn it on only where ``/metrics`` is
    reachable by the monitoring system alone."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve ``/metrics`` on a port of its own (with the probes beside it, as the stages' ops port),
    and not on the API port, which then answers it 404: whoever reaches the product's API (the
    product, its users' network) does not read the deployment's metrics, and Prometheus scrapes
    without a key. Unset, ``/metrics`` is on the API port, as under ``flywheel up``. The Kubernetes
    manifests set 9100, the port the PodMonitor and the NetworkPolicy name ``metrics``."""
    ack_timeout_s: float = Field(default=2.0, gt=0)
    """How long to wait for a broker ack before an event goes to the local journal instead."""

    journal_max_bytes: int = Field(default=256 * 1024 * 1024, ge=4096)
    """Bound on the local journal; when full, feedback answers 503 rather than lose data."""
    vllm_kv_cache_gib: float = Field(default=1.0, gt=0)
    """KV-cache size on the CPU backend (``VLLM_CPU_KVCACHE_SPACE``)."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Share of GPU memory serving's engines may use together on a GPU machine (each of
    ``engines`` takes an equal part)."""
    max_model_len: int | None = None
    """Context length served; defaults to the model's ``max_position_embeddings``."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Sequences the engine batches at once (continuous batching)."""
    enforce_eager: bool = True
    """Skip graph capture: starts much faster on the CPU and small models."""
    dtype: str = "auto"
    """Engine dtype (``auto`` follows the checkpoint; ``bfloat16`` on most GPUs)."""
    engine_stats: bool = True
    """Collect vLLM's own statistics per engine (time to first token, inter-token latency,
    waiting and running requests, KV-cache use) and export them on ``/metrics``
    (serving/engine_stats.py); ``flywheel bench --only engine_stats`` measures what they cost."""
    cpu_threads_bind: str = "auto"
    """CPU build only (``VLLM_CPU_OMP_THREADS_BIND``): ``auto`` pins OpenMP threads to cores,
    ``nobind`` leaves placement to the OS (kinder to a machine shared with other stages), or a
    core list such as ``0-1``."""
    publish_queue_max: int = Field(default=100_000, ge=1)
    """Events waiting for the background publisher; beyond it generations are counted as
    dropped and feedback answers 503."""
    engines: int = Field(default=2, ge=1, le=2)
    """vLLM engines serving runs (``FLYWHEEL_SERVE_ENGINES``): 2 serves a canary beside stable
    and loads a new version into the idle engine without pausing anyone; 1 halves the memory,
    follows stable releases by reloading in place, and refuses releases that name a canary."""
    lora: Literal["auto", "on", "off"] = "auto"
    """Serve LoRA adapter versions (docs/serving-releases.md, "Adapter versions"): ``on`` runs ONE
    engine of ``model_dir`` with vLLM's LoRA support, where stable and canary are adapters chosen
    per request and a swap adds and removes an adapter (no second engine, no weight reload);
    ``engines`` is then not used, and a full-weight version other than ``model_dir`` is refused
    (``needs_full_engines``). ``off``: ``engines`` full-weight engines, an adapter version is refused
    (``needs_lora_engine``). ``auto``: ``on`` when ``trainer.lora_rank`` is above 0."""
    max_loras: int = Field(default=4, ge=1, le=64)
    """Adapters one batch may mix (vLLM's ``max_loras``, also its cache of loaded adapters): stable,
    canary, and the two a release that replaces both routes leaves finishing their last requests.
    Fewer make a new adapter's first requests wait in the queue for an old one's last."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Largest adapter rank served (vLLM's ``max_lora_rank``; these are the values it takes). It
    sizes the engine's adapter buffers; an adapter of a higher rank is refused
    (``lora_rank_too_high``): keep it at or above ``trainer.lora_rank``."""
    follow_releases: bool = True
    """Follow ``release.deployment``'s routing on the releases topic (docs/serving-releases.md);
    false serves the model directory only."""
    release_wait_s: float = Field(default=30.0, gt=0)
    """How long serving waits at start for the releases topic and the checkpoint store before it
    opens its port on the last release it applied (or the model directory)."""
    routing_wait_s: float = Field(default=120.0, ge=0)
    """How long a serving that has applied no release (none on the topic and none saved under
    ``data_dir``, or the newest one's versions not fetched yet) answers ``/readyz`` 503 (``no
    routing yet``) while it waits for the release controller, which announces its routing at its
    start and every ``release.reannounce_s`` (docs/serving-releases.md, "At start"). Past it,
    serving takes traffic on the model directory as version 0, loudly: an error in its log,
    ``serving_release_routing_unconfirmed`` 1 on ``/metrics`` and ``releases.routing`` on
    ``/health`` say so until a routing arrives. Keep it above ``release.reannounce_s``; 0 serves
    the model directory at once (still marked unconfirmed)."""
    drain_s: float = Field(default=25.0, ge=0)
    """On SIGTERM serving stops taking new requests (its port closes, ``/readyz`` stops
    answering) and lets the requests in flight finish for up to this many seconds, streams
    included; what is still running then is cut. Keep the pod's ``terminationGracePeriodSeconds``
    above it plus about 20 s for the publisher's flush and the engines' shutdown
    (deploy/k8s/base/serving.yaml)."""
    pin_api_keys: tuple[str, ...] = ()
    """API keys allowed to pin a loaded version (``model: flywheel@v12``, evaluation traffic),
    besides ``version_visible_keys``, which may too; any other key gets 403 (a pinned answer
    compared with a routed one would tell a user their canary arm). Without API keys (local
    only) every caller may pin. Pinned requests are recorded with ``route=pinned`` and left out
    of canary statistics."""
    version_visible_keys: tuple[str, ...] = ()
    """API keys (``FLYWHEEL_SERVE_VERSION_VISIBLE_KEYS``, comma-separated) whose answers name the
    version that produced them (``"model": "flywheel@v12"``) and to which ``GET /v1/models`` and
    ``/health`` list the loaded versions: an operator's or an evaluation key. Every other key sees
    the deployment's name only (``"model": "flywheel"``), canary or not, so no user can tell
    which arm of a canary they are in and steer it (docs/serving-api.md, "Versions"); a request
    that pins a version (``model: flywheel@v12``) still names it."""
    feedback_other_user: Literal["refuse", "record"] = "refuse"
    """Feedback that names a user other than the one its generation was made for: ``refuse``
    answers 409 (``feedback_user_mismatch``) and records nothing; ``record`` answers 202 and
    records it marked ``other_user``, for audit only: ingest never counts it as a signal, so it
    is no one's judgement, in a canary or in training (docs/serving-api.md, "Feedback")."""
    trusted_release_keys: tuple[Path, ...] = ()
    """Public keys (``<key id>.pub`` files, or directories of them such as a mounted Secret) whose
    signatures serving accepts on release records (flywheel/signing.py, docs/signing.md): any
    other record is dead-lettered (``unsigned``, ``bad_signature``, ``unknown_key``) and serving
    keeps its routing. Empty: releases are not verified (logged at start); ``flywheel up`` signs
    and verifies with a pair it makes under ``<data_dir>/keys``. Read again when they change."""

    @property
    def uses_default_salt(self) -> bool:
        """Whether ``user_id_salt`` is the published default (serving warns at start)."""
        return self.user_id_salt == type(self).model_fields["user_id_salt"].default


class TrainerSettings(_Section):
    group_id: str = "flywheel-trainer"
    """Consumer group on the rewards topic. Its committed offsets are for lag monitoring only: a
    restart resumes from the offsets stored inside the latest durable checkpoint."""
    deepspeed_config: Path | None = None
    """DeepSpeed JSON config (ZeRO stage, precision, optimizer). None: ZeRO-0, fp32, AdamW."""
    lr: float = Field(default=1e-5, ge=0)
    """AdamW learning rate, used when the DeepSpeed config names no optimizer. 0 leaves the
    weights as they are while everything else runs: a control run with learning off
    (``flywheel demo --control``)."""
    loss: str = "grpo"
    """Objective from the loss registry: reinforce, ppo, grpo, gspo or dapo."""
    batch_size: int = Field(default=16, ge=1)
    """Samples per optimizer step (all ranks together)."""
    group_size: int = Field(default=0, ge=0)
    """Samples per prompt group for grouped losses; 0 trains on whatever groups arrived."""
    active_sampling: bool = True
    """Grouped losses: wait for full groups with non-zero reward variance (zero-advantage groups
    are dropped as ``zero_advantage`` instead of wasting a step)."""
    clip_low: float = Field(default=0.2, ge=0)
    """Lower PPO clip range (ratio floor 1 - clip_low)."""
    clip_high: float = Field(default=0.28, ge=0)
    """Upper clip range; DAPO's asymmetric clipping raises it above ``clip_low``."""
    tis_cap: float = Field(default=2.0, gt=0)
    """Truncated importance sampling: per-token trainer/behaviour ratio capped here. 0 is invalid;
    a very large value effectively turns the correction off."""
    entropy_coef: float = Field(default=0.01, ge=0)
    """Per-token-mean entropy bonus against collapse (0 turns it off)."""
    kl_coef: float = Field(default=0.02, ge=0)
    """KL penalty to the reference policy (0 turns it off and skips the reference forward)."""
    reference_dir: Path | None = None
    """Reference policy for the KL penalty (the current stable release); None: the initial model."""
    max_staleness: int = Field(default=4, ge=0)
    """Samples whose ``trainer version - model_version`` exceeds this are dropped as ``stale``."""
    max_seq_len: int = Field(default=512, ge=8)
    """Prompt + completion tokens above this go to the dead-letter topic as ``too_long``."""
    publish_every_steps: int = Field(default=10, ge=1)
    """Publish a version after this many optimizer steps ..."""
    publish_every_s: float = Field(default=60.0, gt=0)
    """... or this many seconds after the first step (or declared drop) since the last version,
    whichever comes first: an idle spell before it does not count."""
    full_every: int = Field(default=10, ge=1)
    """Every K-th version is a full snapshot; the others carry a delta against their parent."""
    keep_full: int = Field(default=3, ge=1)
    """Newest versions that keep full weights; older non-snapshot versions keep only their delta."""
    keep_optimizer: int = Field(default=2, ge=1)
    """Newest versions that keep the DeepSpeed checkpoint (optimizer state for resume)."""
    served_dtype: str = "auto"
    """Dtype of published weights: ``auto`` (the model directory's), ``bfloat16``, ``float32``..."""
    lora_rank: int = Field(default=0, ge=0, le=1024)
    """LoRA rank (docs/trainer.md, "LoRA"): above 0 the trainer trains a PEFT LoRA adapter on the
    frozen ``model_dir`` and every version it publishes is that adapter (PEFT's
    ``adapter_config.json`` and ``adapter_model.safetensors``), its manifest naming the base by
    the sha256 of the base's manifest. 0: full-weight training and versions."""
    lora_alpha: float = Field(default=16.0, gt=0)
    """LoRA scaling numerator: the adapter adds ``lora_alpha / lora_rank * B @ A`` to each target
    weight."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """Module names the adapter wraps (``q_proj``, ``v_proj``, ...), or ``all-linear``: every linear
    layer but the output head, as PEFT resolves it (vLLM serves adapters on those)."""
    store: str = ""
    """Checkpoint store: a local directory, or an object store's URL (``s3://bucket/prefix``, with
    the ``s3`` extra; the endpoint is ``AWS_ENDPOINT_URL`` for MinIO, Ceph and other S3-compatible
    stores, the credentials the standard AWS variables). With a URL the trainer keeps a working copy
    under ``<data_dir>/checkpoints``, publishes each version to the URL before announcing it, and
    pulls the newest one there at start; the release controller and serving fetch the announced
    URL into caches of their own: no volume is shared (flywheel/checkpoints/remote.py). Empty
    means ``<data_dir>/checkpoints``."""
    seed: int = 0
    """Seed for sampling primitives and data order."""
    cpu_threads: int = Field(default=1, ge=0)
    """Intra-op threads on the CPU backend; 0 keeps torch's default (every core). One by default:
    the trainer shares the CPU with serving and the other stages, and OpenMP's spin-waiting under
    that contention made two threads >10x slower than one on a 2-core machine (measured with
    bench/trainer_throughput.py)."""
    signing_key: Path | None = None
    """Ed25519 private key (``<key id>.key``, from ``flywheel keys generate``) the trainer signs
    its checkpoint announcements with, or a directory holding exactly one (a mounted Secret); the
    file name is the key id. Unset: announcements go out
    unsigned, and a controller with ``release.trusted_checkpoint_keys`` refuses them."""
    host: str = "127.0.0.1"
    """Interface for ``/metrics`` and ``/health``."""
    port: int = Field(default=9103, ge=0, le=65535)
    """Ops port; 0 picks a free one."""

    @field_validator("lora_target_modules")
    @classmethod
    def _targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or any(not m for m in v):
            raise ValueError("name at least one module (or all-linear), and no empty name")
        if "all-linear" in v and len(v) > 1:
            raise ValueError("all-linear already names every linear layer; give it alone or list modules")
        return v

    @field_validator("store")
    @classmethod
    def _store_reachable(cls, v: str) -> str:
        if "://" not in v:
            return v
        import fsspec

        protocol = v.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ValueError(f"{v!r}: fsspec knows no protocol {protocol!r}") from None
        except ImportError:
            extra = " (pip install 'flywheel[s3]')" if protocol in ("s3", "s3a") else ""
            raise ValueError(f"{v!r} needs the client library of {protocol!r}{extra}") from None
        return v

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        known = ("reinforce", "ppo", "grpo", "gspo", "dapo")
        if v not in known:
            raise ValueError(f"unknown loss {v!r}; choose one of {', '.join(known)}")
        return v


class IngestSettings(_Section):
    group_id: str = "flywheel-ingest"
    """Consumer group on the generations and feedback topics (range assignment, so partition p
    of both topics goes to the same member). Committed offsets are informational: a restart
    resumes from the offsets in the state store (see docs/exactly-once.md)."""
    window_s: float = Field(default=300.0, gt=0)
    """Join window: feedback counts when the user acted within this many seconds after the
    generation completed. The window also stays open this long after the generation reached the
    stage, for feedback delayed along with a late generation (ingest/join.py)."""
    orphan_wait_s: float = Field(default=300.0, gt=0)
    """How long feedback whose generation has not arrived waits for it (from when the feedback
    arrived, so a replayed orphan waits afresh) before it is dead-lettered as ``orphan_feedback``.
    Raise it when generations can trail their feedback by longer (the generation's own window
    still decides whether the feedback counts)."""
    grace_s: float = Field(default=2.0, ge=0)
    """Extra wait after a window's deadline for clock skew and transport delay before closing."""
    emit_after_signal_s: float | None = Field(default=None, ge=0)
    """Emit an episode this many seconds after its first decisive signal (accept, reject, edit)
    reached the stage, instead of when its window closes. Signals that arrive in that time fold
    in by the usual rule; one that arrives after is dead-lettered as ``late_feedback``. None
    waits out the window, so a user who changes their mind within ``window_s`` is heard; set it
    where feedback-to-training latency matters more (``flywheel demo`` uses 1 s)."""
    closed_retention_s: float = Field(default=3600.0, gt=0)
    """How long closed generations are remembered, to tell late or duplicate feedback apart."""
    max_future_s: float = Field(default=600.0, gt=0)
    """Records stamped more than this many seconds ahead of the stage's clock (a generation's
    ``completed_at``, feedback's ``created_at``) are dead-lettered as ``clock_skew``: a window
    that far in the future would hold its join state until then."""
    max_batch: int = Field(default=5000, ge=1)
    """Most records processed in one state-store transaction, and most windows (or orphaned
    feedback records) closed per shard in one: a backlog of due windows closes over several."""
    poll_ms: int = Field(default=200, ge=1)
    """Longest wait for records in one poll."""
    shards: Shards = ()
    """Input partitions this process owns, to run the stage as several processes (``0,1`` in one,
    ``2,3`` in another), each with a data_dir of its own. Empty: every partition, through the
    consumer group (one process per data_dir). A shard's state stays in the data_dir that
    processed it, so a process keeps its shards across restarts (docs/exactly-once.md)."""
    host: str = "127.0.0.1"
    """Interface for ``/metrics`` and ``/health``."""
    port: int = Field(default=9101, ge=0, le=65535)
    """Ops port; 0 picks a free one."""


class RewardSettings(_Section):
    group_id: str = "flywheel-reward"
    """Consumer group on the episodes topic; offsets live in the state store, as for ingest."""
    labelers: tuple[str, ...] = Field(default=("signal", "edit", "latency"), min_length=1)
    """Labelers summed into the reward, by registry name (reward/labelers.py): signal, edit,
    latency, verifier:<name>, reward_model:<name>. At least one: with none, every reward would
    be 0 less the guards' penalties, whatever users did."""
    plugins: tuple[str, ...] = ()
    """Python modules imported when the stage starts, before ``labelers`` are looked up: your
    own verifiers, reward models and labelers register themselves there (reward/labelers.py)."""
    accept_value: float = 0.75
    """Reward for ``accept``."""
    reject_value: float = -0.25
    """Reward for ``reject``."""
    ignore_value: float = 0.0
    """Reward for an explicit ``ignore`` (and for timed-out episodes when ``emit_ignored``)."""
    emit_ignored: bool = False
    """Emit rewards for timed-out episodes (no user signal). Off: they are counted and skipped."""
    edit_max_chars: int = Field(default=20_000, ge=1)
    """The edit labeler compares at most this many characters of the completion and of the
    user's text (Levenshtein is quadratic: two 1 MB texts would stall the stage for seconds);
    longer texts score the lower of their prefixes' and their suffixes' similarity, capped by the
    ratio of their lengths."""
    latency_bonus: float = Field(default=0.05, ge=0)
    """Extra reward, in the direction of the decision, for a decision taken instantly; it fades
    linearly to 0 at ``latency_ref_ms``. 0 turns the latency labeler off."""
    latency_ref_ms: float = Field(default=10_000.0, gt=0)
    """Decision time at which the latency bonus reaches 0."""
    length_target_tokens: int = Field(default=256, ge=1)
    """Completions longer than this pay ``length_penalty`` per target-length of excess."""
    length_penalty: float = Field(default=0.1, ge=0)
    """Length penalty slope (guard against reward hacking by verbosity); 0 turns it off."""
    length_penalty_max: float = Field(default=1.0, gt=0, le=1e6)
    """Most length penalty one sample pays. Past the span of the signal values (1.0 between the
    default accept and reject) a runaway completion's penalty would drown its user's verdict, and
    with it the advantage of every other sample in its batch. At most 1e6: no reward scale needs
    more, and near float's range the penalties would add up to an infinite reward, which no
    reward record can carry."""
    repetition_ngram: int = Field(default=3, ge=1)
    """n-gram size for the repetition/degeneration detector."""
    repetition_min_distinct: float = Field(default=0.5, gt=0, le=1)
    """Completions whose distinct n-gram ratio is below this are flagged ``repetition``: token
    n-grams, or character pairs (the share that are neither a doubled character nor a pair seen
    before, over the first 64 characters: flywheel/degeneracy.py). Natural sentences keep 0.7 or
    more of their character pairs new; ``aaa eee ooo`` keeps 0.4."""
    repetition_min_tokens: int = Field(default=16, ge=1)
    """Completions with fewer tokens are too short to judge by token n-grams."""
    repetition_min_chars: int = Field(default=8, ge=2)
    """Completions with fewer characters are too short to judge by character pairs; from this
    many, a completion of a few tokens (``aaaaaaaa`` is one to three) is judged too."""
    repetition_penalty: float = Field(default=0.5, ge=0, le=1e6)
    """Reward subtracted from a ``repetition``-flagged sample. At most 1e6, as
    ``length_penalty_max``: a larger one only risks an infinite reward."""
    dedupe_retention_s: float = Field(default=86_400.0, gt=0)
    """How long labeled generation ids are remembered: an episode seen again within it (an
    upstream duplicate, a repeated replay) is dropped, later it would be labeled again."""
    guard_window_s: float = Field(default=3600.0, ge=1)
    """Tumbling window (by generation time) for per-user share and rate guards. Changing it on a
    running deployment starts the guard counts afresh (the current window's shares from zero)."""
    user_cap_share: float = Field(default=0.2, gt=0, le=1)
    """Most of a window's kept samples (those that reach training) one user may own; their
    samples beyond it get weight 0."""
    user_cap_min: int = Field(default=50, ge=1)
    """A user may always contribute this many samples per window, whatever the share."""
    constant_min_signals: int = Field(default=20, ge=2)
    """Signals needed before a user whose signals are all the same is flagged ``constant_user``."""
    constant_weight: float = Field(default=0.2, ge=0, le=1)
    """Weight multiplier for ``constant_user`` samples."""
    rate_factor: float = Field(default=10.0, gt=1)
    """A user with more than this times the mean count of the window's other users is
    ``rate_anomaly``."""
    rate_min: int = Field(default=100, ge=1)
    """... and at least this many samples in the window."""
    rate_weight: float = Field(default=0.5, ge=0, le=1)
    """Weight multiplier for ``rate_anomaly`` samples."""
    max_batch: int = Field(default=5000, ge=1)
    """Most records processed in one state-store transaction. A turn labels up to this many
    episodes, so with a slow labeler (a reward model, a verifier) keep ``max_batch`` times its
    seconds per episode well under a minute: ``/health`` turns unhealthy, and
    ``reward_stalled_seconds`` grows, while one turn runs; and under
    ``kafka.max_poll_interval_ms``."""
    poll_ms: int = Field(default=200, ge=1)
    """Longest wait for records in one poll."""
    shards: Shards = ()
    """Input partitions this process owns, as for ``ingest.shards``. The abuse guards then count
    each user over this process's shards only: generation ids spread a user's samples evenly over
    shards, so a share cap per process caps the user's share overall."""
    host: str = "127.0.0.1"
    """Interface for ``/metrics`` and ``/health``."""
    port: int = Field(default=9102, ge=0, le=65535)
    """Ops port; 0 picks a free one."""


class ArchiveSettings(_Section):
    max_rows: int = Field(default=50_000, ge=1)
    """The ingest and reward stages write their Parquet archive (episodes, rewards) when this
    many rows are queued for it, one file per hour the rows fall in (docs/exactly-once.md)."""
    max_age_s: float = Field(default=300.0, ge=0)
    """... or when the oldest queued row has waited this long, and at shutdown. The archive lags
    the topics by up to this much; larger values mean fewer, larger files."""
    root: Path | None = None
    """Folder of the archives: ``<root>/episodes`` (ingest) and ``<root>/rewards`` (reward).
    Unset: ``<data_dir>/archive``. With ``stream.database_url``, give every replica of a stage
    the same root, a volume they all mount (docs/shared-state.md, Archives): a replica that takes
    shards over then sees the files their previous owner wrote, and writes none of their rows
    again."""


class StreamSettings(_Section):
    """Where the stream stages (ingest, reward) keep their state (docs/shared-state.md)."""

    database_url: str = ""
    """A database shared by every replica of a stage (``FLYWHEEL_STREAM_DATABASE_URL``):
    ``postgresql://...`` in production, or ``sqlite:////<absolute path>/<name>.sqlite3`` for
    replicas on one host (each stage's state in ``<name>.<its group>.sqlite3`` beside it). The
    replicas then share the input partitions through the consumer group, with no ``shards``, and
    a partition's state moves with it. Empty: each process keeps its state in
    ``<data_dir>/<stage>/state.sqlite3``. A password is written percent-encoded (``@`` as
    ``%40``)."""

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, v: str) -> str:
        if v and not v.startswith(("postgresql://", "postgres://", "sqlite:///")):
            raise ValueError("must be postgresql://..., or sqlite:////<absolute path>/<name>.sqlite3 (replicas on "
                             "one host), or empty for a state store in each process's data_dir")
        if why := database_url_refusal(v):
            raise ValueError(why)
        # a relative path is resolved against each process's working directory: replicas started
        # from different ones would each get a "shared" database of their own
        if v.startswith("sqlite:///") and not v.removeprefix("sqlite:///").startswith("/"):
            raise ValueError(f"{redact_database_url(v)!r} names a relative path: replicas started in other "
                             "directories would not share it; write sqlite:////<absolute path>/<name>.sqlite3")
        return v


class ReleaseSettings(_Section):
    """The release controller (``flywheel release serve``, release/README.md)."""

    database_url: str = ""
    """Where the controller keeps candidates, the audit log and its lease
    (``FLYWHEEL_DATABASE_URL``): ``postgresql://...`` in production; empty means an SQLite file
    under ``<data_dir>/release/``. A password is written percent-encoded (``@`` as ``%40``): a URL
    that holds one raw is refused, since the driver's error would show its tail."""
    host: str = "127.0.0.1"
    """Interface of the REST API and the web console."""
    port: int = Field(default=8100, ge=0, le=65535)
    """Port of the REST API and the web console (``FLYWHEEL_RELEASE_PORT``); 0 picks a free one."""
    tokens: tuple[str, ...] = ()
    """Bearer tokens of the people and tools that use the API, each ``name:role:token`` with role
    ``viewer``, ``approver`` or ``admin`` (``FLYWHEEL_RELEASE_TOKENS``, comma-separated). An
    approval records the name. Empty: every route answers 401."""
    group_id: str = "flywheel-release"
    """Consumer group on the checkpoints, episodes and rewards topics (for lag tools; the
    controller reads every topic from where its database says it has measured)."""
    deployment: str = "flywheel"
    """The deployment whose routing this controller publishes (serving follows its own)."""
    auto_promote: bool = False
    """Promote a canary whose analysis passes without waiting for an approver. A written policy:
    the audit log names it as the actor. Off by default: a person approves."""
    promotion_interval_s: float = Field(default=4 * 3600.0, ge=0)
    """At most one promotion per this many seconds (hours in production, minutes in a demo)."""
    canary_share: float = Field(default=0.1, gt=0, le=1)
    """Share of users (by a hash of their pseudonymous id) routed to the canary."""
    prompts_file: Path | None = None
    """Held-out prompts for the offline gate, one JSON object per line with a ``prompt``; empty
    takes the default set release/prompts.jsonl ships."""
    plugins: tuple[str, ...] = ()
    """Modules imported at start that register verifiers and reward models (flywheel/scorers.py),
    usually the same as ``reward.plugins``."""
    gate_scorers: tuple[str, ...] = ()
    """Verifiers and reward models the gate scores candidate and stable with, by name
    (``verifier:compiles``, ``reward_model:helpful``); the candidate fails on a mean drop of more
    than ``gate_max_score_drop``."""
    gate_max_score_drop: float = Field(default=0.1, ge=0)
    """Largest drop of a scorer's mean, candidate against stable, the gate allows."""
    gate_max_new_tokens: int = Field(default=24, ge=1)
    """Tokens generated per held-out prompt, for candidate and stable alike."""
    gate_max_length_ratio: float = Field(default=2.0, gt=1)
    """The candidate's mean output length must stay within this factor of stable's."""
    gate_max_kl: float = Field(default=1.0, gt=0)
    """Most mean per-token KL of the candidate from stable (nats) on the held-out prompts."""
    gate_min_entropy_ratio: float = Field(default=0.5, gt=0, le=1)
    """The candidate's per-token entropy must stay above this share of stable's."""
    gate_min_distinct_ratio: float = Field(default=0.8, gt=0, le=1)
    """The candidate's share of distinct completions must stay above this share of stable's."""
    gate_min_trainer_entropy: float = Field(default=0.05, ge=0)
    """Least policy entropy (nats per token) the trainer may report with the checkpoint (its
    ``entropy`` metric): below it the gate fails the candidate as collapsed, whatever it samples."""
    gate_min_trainer_distinct: float = Field(default=0.2, ge=0, le=1)
    """Least share of distinct completions per batch the trainer may report with the checkpoint
    (its ``distinct_frac`` metric) before the gate fails the candidate as collapsed."""
    alpha: float = Field(default=0.05, gt=0, lt=1)
    """False-alarm rate of the canary analysis, however often it is looked at. A rollback is
    tested at it per canary; a promotion at the share of it the deployment's budget across
    canaries gives each one (e-LOND in blocks of ``budget_canaries``: within a block the expected
    share of promotions no better than stable, the false discovery rate, stays at most alpha; not
    the chance of any false promotion over a deployment's life: release/README.md)."""
    min_events: int = Field(default=50, ge=1)
    """Requests each arm must have served before a guardrail is judged, and accepts, rejects or
    edits before the accept rate is."""
    deadline_s: float = Field(default=3600.0, gt=0)
    """A canary with no verdict by then is held for a person (Inconclusive)."""
    outcome_window_s: float = Field(default=60.0, ge=0)
    """A canary user's outcome is their first accept, reject or edit on an answer completed within
    this many seconds after their first answer in the canary (none: not accepted), read this long
    plus ``ingest.window_s`` and ``ingest.grace_s`` after that first answer, whatever and whenever
    they answered, and users are paired in the order of their first answers: so which users pair
    never depends on their feedback (release/README.md, "Outcome-blind pairs"). Feedback that
    reaches the controller after that counts for nothing. Longer: more of each user's answers can
    give their outcome, and each outcome, so each verdict, comes later."""
    new_users: Literal["exclude", "count"] = "exclude"
    """Users first seen after a canary started (no generation of theirs made before it reached the
    controller): ``exclude`` counts them apart (``new_users`` in the analysis), never as outcomes,
    so ids made up during a canary cannot vote in it; ``count`` counts them like any user
    (release/README.md, "Who counts")."""
    known_users_lookback_s: float = Field(default=604_800.0, ge=0)
    """As a canary starts, the controller reads the episodes written this long before it and counts
    their users as seen before it (``new_users = "exclude"``; the 200,000 most recent). Bounded by
    the episodes topic's retention (7 days, flywheel/topology.py): a longer lookback reads what is
    left. Longer: more returning users count, and each canary's start reads more."""
    on_inconclusive: Literal["hold", "rollback"] = "hold"
    """A canary with no verdict by ``deadline_s``: ``hold`` it for a person (it keeps its share,
    and newer candidates wait), or ``rollback`` so the newest candidate, which holds all training
    since, gets its turn: for auto-promote deployments that no person watches."""
    error_limit: int = Field(default=3, ge=1)
    """Failed measurements or gates before the candidate is rolled back (never promoted)."""
    max_error_rate_increase: float = Field(default=0.02, ge=0)
    """Guardrail: the canary's share of failed generations over stable's."""
    max_latency_ratio: float = Field(default=1.5, gt=1)
    """Guardrail: the canary's p95 latency over stable's, the 95th percentile of each arm's users'
    own mean latencies (a heavy user counts once), judged at the guardrail looks."""
    max_length_ratio: float = Field(default=2.0, gt=1)
    """Guardrail: the canary's mean output length against stable's, either way: the mean of each
    arm's users' own mean lengths, judged at the guardrail looks."""
    max_reject_share_increase: float = Field(default=0.15, ge=0)
    """Guardrail: the canary's share of rejects over stable's."""
    max_flag_rate_increase: float = Field(default=0.05, ge=0)
    """Guardrail: the canary's share of rewards flagged for reward hacking (``long``,
    ``repetition``) over stable's. Abuse flags are about users, whom the hash assigns to arms,
    so they are not compared."""
    guardrail_alpha: float = Field(default=0.01, gt=0, lt=1)
    """The chance that two identical versions are rolled back by a rate guardrail (error rate,
    share of rejects, reward-guard flags), however long the canary runs. They are judged per user
    (each user's own rate, so a few heavy users weigh as a few) at looks when each arm has 20, 40,
    80, ... users, each look spending part of this (release/budget.py); the degeneracy guardrails
    are judged at the same looks and levels, per answer."""
    srm_alpha: float = Field(default=0.001, gt=0, lt=1)
    """Sample-ratio check: a canary whose arms' users are not the split ``canary_share`` asked for
    (an e-process on the users per arm, looked at every tick, past ``1 / srm_alpha``) is held for
    a person, neither promoted nor rolled back: the chance a correct routing is held is at most
    this."""
    budget_canaries: int = Field(default=20, ge=1)
    """The budget across canaries runs in blocks of this many canaries (release/budget.py): within
    a block the expected share of promotions no better than stable stays at most ``alpha``, and
    each canary of it is tested for PASS at no less than ``alpha / (2 budget_canaries)``, so a
    real lift stays promotable after any number of canaries. Larger: a stronger guarantee (fewer
    blocks over a deployment's life), less power per canary."""
    max_repetition_increase: float = Field(default=0.05, ge=0)
    """Gate check and canary guardrail: the candidate's mean character repetition over stable's
    (the share of an answer's character pairs that double a character or repeat an earlier pair,
    over its first 64 characters: flywheel/degeneracy.py). Natural sentences score 0.1-0.3 and
    ``aaa eee ooo`` 0.6; measured on short answers too, where token n-grams say nothing."""
    max_char_class_shift: float = Field(default=0.15, ge=0)
    """Gate check and canary guardrail: how far the mean share of one class of characters in an
    answer (vowels, consonants, digits, spaces, other) may move from stable's, either way.
    Relative to stable, so a model vowel-rich from the start passes; one that starts stuffing
    vowels in does not."""
    max_collapse_increase: float = Field(default=0.25, ge=0)
    """Gate check and canary guardrail: the share of the candidate's answers far shorter than
    stable's median answer (under a quarter to a half of it), over stable's own share. The mean
    length (``gate_max_length_ratio``, ``max_length_ratio``) misses a version that collapses some
    answers and keeps the others long."""
    max_leading_share_increase: float = Field(default=0.4, ge=0)
    """Gate check and canary guardrail: the share of the candidate's answers that open with its
    most common first word, over stable's share for its own (release/meaning.py). A version that
    leads with "No" whatever the question moves it from stable's spread of openings to nearly all;
    an honest direct one splits between "Yes" and "No" as the questions' answers do, half each on
    a balanced question set (the gate's held-out prompts should be one), two in three where two
    questions in three are answered "Yes"."""
    max_shared_affix_increase: float = Field(default=0.3, ge=0)
    """Gate check and canary guardrail: the share of the candidate's answers that start or end
    with its most common three words, over stable's: a fixed prefix ("Yes, great question!") or
    suffix bolted onto every answer."""
    max_unrelated_increase: float = Field(default=0.2, ge=0)
    """Gate check and canary guardrail: the share of the candidate's answers of four words or more
    that share no content word with their prompt, over stable's: fluent text about something else
    after a pleasing first word."""
    min_distinct_ratio: float = Field(default=0.8, gt=0, le=1)
    """Canary guardrail: the candidate's share of distinct answers (among the first answers of each
    arm, release/meaning.py) must stay above this share of stable's: the same sentence to everyone."""
    evals: tuple[str, ...] = ("known_answers",)
    """Held-out evals the gate scores candidate and stable on (release/evals.py): the shipped
    known-answer set (``known_answers``, 344 short factual questions) and any a ``release.plugins``
    module registers. Each is scored by the likelihood of the right answer against the wrong one
    and by the parsed greedy answer; the candidate fails when it is not shown within
    ``eval_margin`` of stable (a paired non-inferiority test at ``eval_alpha``). Empty: none."""
    eval_margin: float = Field(default=0.05, gt=0, lt=1)
    """Non-inferiority margin of the held-out evals: the accuracy the candidate may lose against
    stable before it fails (0.05: five questions in a hundred)."""
    eval_alpha: float = Field(default=0.05, gt=0, lt=1)
    """Level of the held-out evals' non-inferiority tests, split over every eval and both ways of
    scoring it: the chance a candidate exactly ``eval_margin`` worse passes."""
    eval_questions: int = Field(default=0, ge=0)
    """Questions of each held-out eval the gate asks: a fixed subset of at most this many, yes/no
    pairs kept whole (release/evals.py). 0: every one. Fewer cost the gate less (every question is
    one pass of each version over its prompt: 40 s a version for SmolLM2's 344 on two CPU cores)
    and widen the test's bounds: a candidate must then be better to be shown within the margin,
    and under 1 / ``eval_margin`` questions none can be (refused at start)."""
    eval_max_new_tokens: int = Field(default=8, ge=1)
    """Tokens of each greedy answer to a held-out eval's question (a yes/no answer's first word is
    parsed; a one-word answer is looked for among all of them)."""
    lease_ttl_s: float = Field(default=15.0, gt=0)
    """The controller lease lapses this long after its holder last renewed it; another
    controller then takes over."""
    tick_s: float = Field(default=1.0, gt=0)
    """How often the controller looks at its candidates."""
    tally_save_s: float = Field(default=30.0, ge=0)
    """How often the live canary's measurement (its tally: offsets, open windows, the users seen
    before it, per-user counts) is written to the database; also at each verdict and guardrail
    look. Between saves it is kept in memory; a controller that restarts, or takes over, resumes
    from the last save and reads the records since again (each counted once). Up to several MB at
    production volume: written every turn, it was most of the controller's work. 0: every turn."""
    reannounce_s: float = Field(default=60.0, gt=0)
    """How often the controller holding the lease sends its current routing again on the releases
    topic (the newest revision Kafka acked, or revision 0, every user on the model directory, when
    it has decided nothing yet), and it does so as it takes the lease too. The record is the one
    it published, so serving skips it as a repeat; a serving that starts after retention, or a
    recreated topic, lost every record gets the routing within this period instead of serving the
    model directory (``serve.routing_wait_s``, docs/serving-releases.md)."""
    signing_key: Path | None = None
    """Ed25519 private key (``<key id>.key``) the controller signs its release records with, or a
    directory holding exactly one (a mounted Secret); the file name is the key id. Serving holds
    the public key (``serve.trusted_release_keys``). Unset:
    releases go out unsigned, and a serving that trusts keys refuses them."""
    trusted_checkpoint_keys: tuple[Path, ...] = ()
    """Public keys (files or directories of ``<key id>.pub``) whose signatures the controller
    accepts on checkpoint announcements (the trainer's); any other is dead-lettered and never
    becomes a candidate. Empty: announcements are not verified (logged at start)."""
    webhooks: tuple[str, ...] = ()
    """URLs (``http://`` or ``https://``) every release decision is POSTed to as JSON, with a
    ``text`` field a chat tool shows, escaped for Slack's mrkdwn and Mattermost's Markdown
    (release/webhooks.py; ``FLYWHEEL_RELEASE_WEBHOOKS``, comma-separated). Each URL has a queue and
    a sender of its own: one receiver down delays no other. Logged as scheme and host only: chat
    tools put their secret in the path."""
    webhook_attempts: int = Field(default=5, ge=1)
    """Attempts at each webhook body before it is given up (and counted failed)."""
    webhook_backoff_s: float = Field(default=1.0, gt=0)
    """Wait after a webhook's first failed attempt; doubled after each next one, at most a minute."""
    webhook_allow_internal: bool = False
    """Allow webhook URLs that reach internal addresses: loopback, private ranges, link-local (the
    cloud metadata services: 169.254.169.254, fd00:ec2::254), shared and reserved ranges
    (flywheel/addresses.py). Off, such a URL is refused when settings load if it names the address
    literally, and a name that resolves there is refused at each send (counted as
    ``release_webhook_deliveries_total{outcome="refused"}`` and logged): the controller posts from
    inside the deployment, and must not become a way into it. Turn it on for a receiver you run
    on your own network."""

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, v: str) -> str:
        if why := database_url_refusal(v):
            raise ValueError(why)
        return v

    @field_validator("webhooks")
    @classmethod
    def _webhook_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for n, url in enumerate(urls, 1):
            try:
                parts = urlsplit(url)
                parts.port  # noqa: B018 - raises on a port that is not one (":abc", ":99999")
            except ValueError:
                parts = None
            if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
                # the value is not shown: it may hold the receiver's secret
                raise ValueError(f"webhook {n} of {len(urls)} is not an http:// or https:// URL with a host "
                                 "and a valid port")
        return urls

    @model_validator(mode="after")
    def _webhooks_outside(self) -> ReleaseSettings:
        if self.webhook_allow_internal:
            return self
        for n, url in enumerate(self.webhooks, 1):
            ip = literal_ip(urlsplit(url).hostname or "")
            if ip is not None and is_internal(ip):
                raise ValueError(f"webhook {n} of {len(self.webhooks)} (release.webhooks) targets an internal "
                                 "address (loopback, private, link-local or metadata, reserved): point it at the "
                                 "receiver's public address, or set release.webhook_allow_internal = true for a "
                                 "receiver on your own network")
        return self


class HttpSettings(_Section):
    """How serving's API and the release API hold their clients' connections (flywheel/connections.py).

    A client may not hold a connection without sending a request, nor send its request slowly,
    nor open more connections than its share: a slow-loris attack (many connections, each sending
    a byte now and then) would otherwise keep every connection and file of the process until
    ``/health`` itself could not be answered. docs/serving-api.md, Connections, has the measured
    figures."""

    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's headers must have arrived this long after its connection opened (or after its
    first byte, on a kept-alive connection): else 408 and the connection is closed (closed with no
    answer when not one byte came). Clients send their headers at once; this only cuts the slow."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """A request's body must have arrived this long after its headers: else 408 and the connection
    is closed. Only reading the request is timed: a response, a stream or a long generation is
    never cut by it. The APIs' bodies are JSON of a few MB at most; 30 s allows 100 kB/s."""
    max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    """A request's line and headers may be this long at most: more is answered 431 and the
    connection closed. The HTTP parser keeps a head whole until it ends, so without a cap one
    client could fill the memory before ``header_timeout_s``. Browsers and SDKs send a few kB."""
    keep_alive_s: float = Field(default=5.0, gt=0)
    """An idle kept-alive connection is closed after this long. Behind a load balancer that reuses
    connections, keep it above the balancer's own idle timeout (else it may send a request on a
    connection being closed)."""
    max_connections: int = Field(default=2048, ge=1)
    """Open connections one process holds at most; one more is answered 503 and closed. The
    process raises its open-file limit to the hard limit at start and warns when that is below
    this and the files its own work needs (``flywheel.connections.FILES_BESIDE_CONNECTIONS``)."""
    max_connections_per_client: int = Field(default=256, ge=0)
    """Open connections one client address holds at most; one more is answered 429 and closed, and
    other addresses are still served. 0: no cap per address. Behind a proxy or an ingress that
    connects from its own address, every client shares that address: raise it to the proxy's
    connection pool, or set 0 and let the proxy cap its clients."""

    @model_validator(mode="after")
    def _client_cap_within_process_cap(self) -> HttpSettings:
        if self.max_connections_per_client > self.max_connections:
            raise ValueError(f"max_connections_per_client={self.max_connections_per_client} exceeds "
                             f"max_connections={self.max_connections}: lower it, or raise max_connections")
        return self


class ProbeSettings(_Section):
    """What ``/livez`` and ``/readyz`` of the ingest, reward and trainer processes and of the
    release controller judge (serving's are its engines: serving/app.py)."""

    stale_s: float = Field(default=60.0, gt=0)
    """``/readyz`` (and ``/health``) answer 503 while the loop has not finished a turn, or has
    made no progress with the broker, for this long: a long labeling turn, a broker that does not
    answer. ``/livez`` stays 200 meanwhile, so Kubernetes waits instead of restarting."""
    hung_s: float = Field(default=900.0, gt=0)
    """``/livez`` answers 503 once the loop has neither started nor finished a turn for this long:
    a turn that long (a labeling turn, a gate, a training step or a publish) is taken as hung, and
    Kubernetes restarts the process. Keep it above the longest turn you expect: a turn longer than
    ``kafka.max_poll_interval_ms`` already costs a rebalance."""


class TelemetrySettings(_Section):
    """Traces, exported with OTLP over HTTP (flywheel/telemetry.py). Off unless an endpoint is set."""

    otlp_endpoint: str = ""
    """Base URL of an OTLP/HTTP collector (``http://collector:4318``); spans are posted to
    ``<endpoint>/v1/traces``. Empty: no traces are made or sent. The standard
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` variable sets it too (``FLYWHEEL_TELEMETRY_OTLP_ENDPOINT`` wins)."""
    service_name: str = "flywheel"
    """``service.name`` of the spans; the process role is appended (``flywheel-serving``)."""
    export_timeout_s: float = Field(default=5.0, gt=0)
    """How long one export may wait for the collector. Exports run on a thread of their own: a
    collector that is slow or away delays and then drops spans, never a request or a record."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if v and (urlsplit(v).scheme not in ("http", "https") or not urlsplit(v).hostname):
            raise ValueError("must be an http:// or https:// URL with a host (the collector's OTLP/HTTP port, "
                             "usually 4318), or empty for no traces")
        return v.rstrip("/")


class Settings(_Section):
    """Everything a Flywheel process may be configured with."""

    model_dir: Path = Path("data/model")
    """Hugging Face model directory served at start (``FLYWHEEL_MODEL_DIR``)."""
    data_dir: Path = Path("data")
    """Journals, checkpoints, archives and databases live under here (``FLYWHEEL_DATA_DIR``)."""
    topic_prefix: str = "flywheel."
    """Prefix of every topic name (``FLYWHEEL_TOPIC_PREFIX``)."""
    routing_secret: str = ""
    """Serving's secret key of the canary split (``FLYWHEEL_ROUTING_SECRET``, or
    ``FLYWHEEL_ROUTING_SECRET_FILE``): the hash that splits users between a canary and stable is
    salted with ``HMAC(routing_secret, canary salt)`` (serving/arms.py), so the split cannot be
    computed from the releases topic, which carries only the canary salt. ``flywheel serve`` with
    API keys refuses to start while it is empty or shorter than 16 characters; ``flywheel up`` and
    ``flywheel demo`` make a random one and keep it under ``<data_dir>/up``. The same on every
    serving replica (docs/deploy.md, "Secrets"); no other stage reads it: the release controller
    tells the arms apart by the version on each record."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Log level of every Flywheel logger (kafka-python stays at WARNING unless this is lower);
    ``--log-level`` on the command line overrides it. Any case: ``debug`` is ``DEBUG``."""
    log_format: Literal["text", "json"] = "text"
    """``text``, or ``json``: one object per line with time, level, logger, message, the request id
    and generation id when known, and an exception's traceback (flywheel/logs.py).
    ``--log-format`` on the command line overrides it."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    """The continuous trainer (``flywheel train``, see docs/trainer.md)."""
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    """The ingest stage (``flywheel ingest``, see docs/exactly-once.md)."""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """The reward stage (``flywheel reward``)."""
    archive: ArchiveSettings = Field(default_factory=ArchiveSettings)
    """The stages' Parquet archives of episodes and rewards."""
    stream: StreamSettings = Field(default_factory=StreamSettings)
    """Where the ingest and reward stages keep their state."""
    release: ReleaseSettings = Field(default_factory=ReleaseSettings)
    """The release controller (``flywheel release serve``)."""
    probes: ProbeSettings = Field(default_factory=ProbeSettings)
    """``/livez`` and ``/readyz`` of every role but serving (docs/deploy.md, Probes)."""
    http: HttpSettings = Field(default_factory=HttpSettings)
    """Connection limits of serving's API and the release API (slow and greedy clients)."""
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    """OpenTelemetry traces of requests and the records they become (docs/deploy.md, Logs and traces)."""

    @property
    def archive_root(self) -> Path:
        """Where the stages' archives are: ``archive.root``, else ``<data_dir>/archive``."""
        return self.archive.root if self.archive.root is not None else self.data_dir / "archive"

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_in_any_case(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _shards_or_shared_state(self) -> Settings:
        # Shards are a stage's static split, each with a store of its own; a shared store splits
        # through the consumer group, and a shard list beside it would only leave partitions out.
        for stage in ("ingest", "reward"):
            if getattr(self, stage).shards and self.stream.database_url:
                raise ValueError(f"{stage}.shards and stream.database_url exclude each other: with a shared "
                                 "database the replicas share the partitions through the consumer group; "
                                 f"unset {stage}.shards (docs/shared-state.md)")
        if self.stream.database_url and self.ingest.group_id == self.reward.group_id:
            raise ValueError("ingest.group_id and reward.group_id must differ: with stream.database_url each "
                             "stage's state is found by its consumer group")
        return self


    @model_validator(mode="after")
    def _routing_wait_outlasts_the_reannouncement(self) -> Settings:
        # a serving that starts just after an announcement hears the next one reannounce_s later:
        # a shorter wait would serve the model directory in a deployment where nothing is wrong
        wait, period = self.serve.routing_wait_s, self.release.reannounce_s
        if 0 < wait <= period:
            raise ValueError(f"serve.routing_wait_s={wait:g} must be above release.reannounce_s={period:g}: the "
                             "controller sends its routing again only that often; raise serve.routing_wait_s "
                             "(or lower release.reannounce_s), or set it to 0 to serve the model directory at once")
        return self


#: Environment names kept short because operators type them most.
_ALIASES: dict[str, tuple[str, ...]] = {
    "FLYWHEEL_API_KEYS": ("serve", "api_keys"),
    "FLYWHEEL_KAFKA_BOOTSTRAP": ("kafka", "bootstrap"),
    "FLYWHEEL_DATABASE_URL": ("release", "database_url"),
}
#: Variables of the same prefix that are not settings: the config file's path, and the token the
#: ``flywheel release`` client commands send (a person's, not the deployment's), or the file that
#: holds it (cli/main.py reads it by the same rule as a setting's ``_FILE``).
_NOT_SETTINGS = {"FLYWHEEL_CONFIG", "FLYWHEEL_RELEASE_TOKEN", "FLYWHEEL_RELEASE_TOKEN_FILE"}


#: OpenTelemetry's standard variable for the collector: read as ``telemetry.otlp_endpoint``.
OTEL_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"


class SettingsError(ValueError):
    """Configuration that cannot be used; the message says which setting and why."""

    #: What ``flywheel`` exits with on it: 2, a usage error (argparse's own code), unless a kind
    #: says otherwise (a refused login exits 77, EX_NOPERM, as the release CLI's 401 does).
    exit_code: int = 2


def load_settings(
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build :class:`Settings` from defaults, the TOML file, the environment and ``overrides``.

    ``overrides`` is a nested dict (what command-line flags set) applied last.
    """
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    path = config_file or (Path(env["FLYWHEEL_CONFIG"]) if "FLYWHEEL_CONFIG" in env else None)
    if path is None and Path("flywheel.toml").is_file():
        path = Path("flywheel.toml")
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read config file {path}: {exc}") from None
    if env.get(OTEL_ENDPOINT_ENV):  # the standard variable, below Flywheel's own name for it
        _merge(data, {"telemetry": {"otlp_endpoint": env[OTEL_ENDPOINT_ENV]}})
    _merge(data, _from_env(env))
    _merge(data, dict(overrides or {}))
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        msgs = [_message(e) for e in exc.errors()]
        raise SettingsError("invalid settings: " + "; ".join(msgs)) from None


#: Settings a release took away, and what to set instead: a config written for an older release
#: is refused (a setting silently ignored would judge canaries by a rule nobody chose), with the
#: way forward rather than pydantic's bare "Extra inputs are not permitted".
RETIRED: dict[str, str] = {
    "release.guardrail_z": "guardrails are judged per user at planned looks now; their error rate is "
                           "release.guardrail_alpha (release/README.md, section Guardrails per user)",
}


def _message(error: Any) -> str:
    where = ".".join(map(str, error["loc"]))
    if error["type"] == "extra_forbidden" and where in RETIRED:
        return f"{where} was removed: {RETIRED[where]}"
    return f"{where}: {error['msg']}"


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sections = {
        name: field.annotation
        for name, field in Settings.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    try:
        reading = read_environment(env, setting_of, skip=_NOT_SETTINGS)
    except VariableError as exc:
        raise SettingsError(str(exc)) from None
    warn_once(reading.ignored)
    for var in reading.values:
        _merge(out, _nest(var.path, _coerce(var.path, var.raw, sections)))
    return out


def setting_of(variable: str) -> tuple[str, ...] | None:
    """The field path a ``FLYWHEEL_*`` variable names (``FLYWHEEL_SERVE_PORT`` -> ``("serve",
    "port")``), or None when it names no setting. ``FLYWHEEL_<NAME>_FILE`` is resolved by
    flywheel/environment.py on top of this; the Kubernetes manifests' tests use both."""
    sections = {
        name: field.annotation
        for name, field in Settings.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    return _ALIASES.get(variable) or _env_path(variable[len("FLYWHEEL_"):].lower(), sections)


def _env_path(name: str, sections: dict[str, Any]) -> tuple[str, ...] | None:
    if name in Settings.model_fields and name not in sections:
        return (name,)
    for section, model in sections.items():
        prefix = section + "_"
        if name.startswith(prefix) and name[len(prefix):] in model.model_fields:
            return (section, name[len(prefix):])
    return None


def _coerce(path: tuple[str, ...], raw: str, sections: dict[str, Any]) -> Any:
    """Strings from the environment become lists for tuple fields; pydantic does the rest."""
    model = sections[path[0]] if len(path) == 2 else Settings
    annotation = str(model.model_fields[path[-1]].annotation)
    if annotation.startswith("tuple"):
        raw = raw.strip()
        if raw.startswith("["):
            try:
                return json.loads(raw)
            except ValueError:  # was a traceback; named here without the text (API keys, tokens)
                raise SettingsError(f"invalid settings: {'.'.join(path)}: a value that starts with '[' is read "
                                    "as a JSON list, and this one is none (write a comma-separated list, or a "
                                    'JSON list such as ["a", "b"])') from None
        return [part.strip() for part in raw.split(",") if part.strip()]
    return raw


def _nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {path[-1]: value}
    for part in reversed(path[:-1]):
        out = {part: out}
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def describe(settings: Settings) -> str:
    """Settings as one JSON line for the start-up log, with secrets masked."""
    data = settings.model_dump(mode="json")
    serve = data.get("serve", {})
    for keys in ("api_keys", "pin_api_keys", "version_visible_keys"):
        if serve.get(keys):
            # the id serving records each key under (flywheel/apikeys.py): keyed, so no guess at a
            # short key can be checked against the log, and the same id usage reports name
            serve[keys] = [key_id(settings.serve.user_id_salt, k) for k in serve[keys]]
    release = data.get("release", {})
    if release.get("tokens"):  # name:role:token -> name:role:***
        release["tokens"] = [":".join(t.split(":")[:2] + ["***"]) for t in release["tokens"]]
    if release.get("database_url"):
        release["database_url"] = redact_database_url(release["database_url"])
    stream = data.get("stream", {})
    if stream.get("database_url"):
        stream["database_url"] = redact_database_url(stream["database_url"])
    if release.get("webhooks"):  # a webhook URL holds its secret in the path or the query: host and port only
        release["webhooks"] = [f"{(u := urlsplit(url)).scheme}://{u.netloc.rpartition('@')[2]}/***"
                               for url in release["webhooks"]]
    serve["user_id_salt"] = "***"
    if data.get("routing_secret"):
        data["routing_secret"] = "***"
    if data.get("telemetry", {}).get("otlp_endpoint"):  # a collector's password may ride in its URL
        data["telemetry"]["otlp_endpoint"] = redact_database_url(data["telemetry"]["otlp_endpoint"])
    if data.get("kafka", {}).get("sasl_password"):
        data["kafka"]["sasl_password"] = "***"
    return json.dumps(data, sort_keys=True)


def refuse_leaking_url(url: str) -> None:
    """Raise :class:`SettingsError` for a database URL :func:`database_url_refusal` refuses: the
    stores check it again before they connect, whoever built them (settings refuse it at start)."""
    if why := database_url_refusal(url):
        raise SettingsError(f"database URL {why}")
