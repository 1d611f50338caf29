"""``flywheel usage``: tokens served by API key and version, and tokens trained by version, from the
archives (``flywheel usage [--since 24h] [-o json]``).

- **Served**: the episode archive ingest writes (``<data_dir>/archive/episodes``, one per ingest
  shard process: ``--archive DIR``, repeatable), one row per recorded generation. A request's
  prompt counts once (its first choice: ``n`` choices share one prompt, as OpenAI's ``usage``
  counts it), every choice's completion tokens count, all under ``model_version``, the version
  the request was routed to. A generation archived twice (an episode replayed) counts once. The
  key is the id serving records (``api_key_id``, an HMAC of the key under ``serve.user_id_salt``:
  flywheel/apikeys.py, which says how to find a key's id), ``null`` for a deployment without keys
  and for records written before keys were recorded. Records written before the id was keyed
  carry a plain SHA-256 id, so a key's tokens from before that upgrade show under another id.
  ``--since`` selects by when the generation completed. The archive follows serving by the join
  window (``ingest.window_s``, or ``ingest.emit_after_signal_s`` after a signal) plus
  ``archive.max_age_s``: the newest minutes show in the counters
  (``serving_prompt_tokens_total``, ``serving_completion_tokens_total``) before they show here.
- **Trained**: the trainer's checkpoint store (``--checkpoints DIR``, default the trainer's), each
  version's ledger: the samples it was trained on and their prompt and completion tokens (each
  sample's own), for versions published in the window. A version written before ledgers
  counted tokens shows its samples and no tokens. The counter is ``trainer_trained_tokens_total``.

The same rules as the counters (serving/usage.py, trainer/metrics.py), so the two add up over a
window both cover.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from flywheel.checkpoints import CheckpointStore, store_root
from flywheel.output import emit
from flywheel.settings import Settings
from flywheel.stream.archive import hour_of, read_schema
from ingest.archive import EPISODE_SCHEMA

_COLUMNS = ["generation_id", "api_key_id", "model_version", "choice_index", "completed_at"]


@dataclass
class Served:
    api_key: str | None
    version: int
    requests: int = 0
    generations: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Trained:
    version: int
    published_at: float
    samples: int
    #: None: the version's ledger was written before ledgers counted tokens
    prompt_tokens: int | None
    completion_tokens: int | None


def served(archives: list[Path], since: float) -> list[Served]:
    """Tokens served since ``since`` (epoch seconds), by key and version (module docstring)."""
    rows: dict[tuple[str | None, int], Served] = {}
    seen: set[str] = set()
    for table in _episodes(archives, since):
        cols = table.select(_COLUMNS).to_pydict()
        prompt = pc.list_value_length(table.column("prompt_token_ids")).fill_null(0).to_pylist()
        completion = pc.list_value_length(table.column("completion_token_ids")).fill_null(0).to_pylist()
        for i, gid in enumerate(cols["generation_id"]):
            if gid in seen:
                continue
            seen.add(gid)
            key = (cols["api_key_id"][i], cols["model_version"][i])
            row = rows.get(key) or rows.setdefault(key, Served(*key))
            row.generations += 1
            row.completion_tokens += completion[i]
            if cols["choice_index"][i] == 0:
                row.requests += 1
                row.prompt_tokens += prompt[i]
    return sorted(rows.values(), key=lambda r: (r.api_key or "", r.version))


def _episodes(archives: list[Path], since: float) -> list[pa.Table]:
    # Files sit under the hour their episode resolved, never before the generation completed: the
    # hours before ``since``'s cannot hold a row of the window, and are not opened.
    first = hour_of(since)
    tables = []
    for root in archives:
        files = [str(p) for p in sorted(root.glob("hour=*/part-*.parquet")) if p.parent.name[len("hour="):] >= first]
        if not files:
            continue
        # the archive's whole schema: files written before a column existed read it as nulls
        data = ds.dataset(files, format="parquet", schema=read_schema(EPISODE_SCHEMA))
        tables.append(data.to_table(columns=[*_COLUMNS, "prompt_token_ids", "completion_token_ids"],
                                    filter=ds.field("completed_at") >= since))
    return tables


def trained(store: CheckpointStore, since: float) -> list[Trained]:
    """Each version published since ``since`` that was trained on something, from its ledger."""
    out = []
    for v in store.versions():
        try:
            published = float(store.manifest(v)["created_at"])
            ledger = store.ledger(v)
        except (OSError, KeyError, ValueError):  # a version being pruned or half-copied by a mirror
            continue
        samples = len(ledger.get("trained", ()))
        if published < since or not samples:
            continue
        tokens = ledger.get("tokens") or {}
        out.append(Trained(v, published, samples, tokens.get("prompt"), tokens.get("completion")))
    return out


def summary(archives: list[Path], store: CheckpointStore | None, since: float) -> dict[str, Any]:
    """What ``-o json`` prints: rows and totals of both."""
    s = served(archives, since)
    t = trained(store, since) if store is not None else []
    return {
        "since": since,
        "served": [asdict(r) for r in s],
        "served_total": {k: sum(getattr(r, k) for r in s)
                         for k in ("requests", "generations", "prompt_tokens", "completion_tokens")},
        "trained": [asdict(r) for r in t],
        "trained_total": {"samples": sum(r.samples for r in t),
                          **{k: sum(getattr(r, k) or 0 for r in t) for k in ("prompt_tokens", "completion_tokens")}},
    }


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:  # the first column left, the numbers right
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), *map(line, rows)])


def n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def render(s: dict[str, Any]) -> str:
    """``summary`` as two tables for a person."""
    out = [f"Tokens served since {_utc(s['since'])}, by API key id and version (episode archive)"]
    rows = [[r["api_key"] or "(none)", f"v{r['version']}", n(r["requests"]), n(r["generations"]),
             n(r["prompt_tokens"]), n(r["completion_tokens"])] for r in s["served"]]
    tot = s["served_total"]
    rows.append(["total", "", n(tot["requests"]), n(tot["generations"]), n(tot["prompt_tokens"]),
                 n(tot["completion_tokens"])])
    out.append(_table(["api key", "version", "requests", "generations", "prompt tokens", "completion tokens"], rows))
    out.append("")
    out.append(f"Tokens trained since {_utc(s['since'])}, by the version they went into (checkpoint store ledgers)")
    rows = [[f"v{r['version']}", _utc(r["published_at"]), n(r["samples"]), n(r["prompt_tokens"]),
             n(r["completion_tokens"])] for r in s["trained"]]
    tot = s["trained_total"]
    rows.append(["total", "", n(tot["samples"]), n(tot["prompt_tokens"]), n(tot["completion_tokens"])])
    out.append(_table(["version", "published", "samples", "prompt tokens", "completion tokens"], rows))
    return "\n".join(out)


def run(settings: Settings, args: argparse.Namespace) -> int:
    archives = args.archive or [settings.archive_root / "episodes"]
    for root in archives:
        if not root.is_dir():
            print(f"flywheel usage: no episode archive at {root} (ingest writes it; --archive DIR for another)",
                  file=sys.stderr)
    root = args.checkpoints or store_root(settings)
    store = CheckpointStore(root) if root.is_dir() else None  # the constructor would create it
    if store is None:
        print(f"flywheel usage: no checkpoint store at {root}: nothing trained to count (--checkpoints DIR for "
              "another)", file=sys.stderr)
    s = summary(archives, store, time.time() - args.since)
    emit(args, s, render)
    return 0
