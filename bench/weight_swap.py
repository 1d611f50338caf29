"""Weight swaps under load: request latency with and without swaps, release-to-answering time, and
what serving two versions at once costs.

    .venv/bin/python bench/weight_swap.py [--seconds 15] [--concurrency 16] [--versions 5]

One process runs serving (two vLLM engines, the API, the recorder, the release follower) on the
locally built tiny model against an embedded broker; a client process keeps ``--concurrency``
requests of ``--max-tokens`` tokens in flight for ``--seconds`` per phase. The checkpoint store
holds ``--versions`` versions, each a small perturbation of the one before, stored as a delta
chain (only the newest keeps full weights), so each release fetches, rebuilds and verifies.

Phases, in one run:

1. ``one version``: stable only, every request on one engine;
2. ``two versions``: stable and a canary at share 0.5, no swaps (its throughput against phase 1 is
   the cost of serving two versions on the same cores);
3. ``swaps, idle engine``: stable only, a new stable version released every ``--swap-every`` s (it
   loads into the idle engine, then everyone moves: no request pauses);
4. ``swaps, in place``: two versions at share 0.5, both replaced every ``--swap-every`` s (each
   engine pauses, reloads and resumes under its running requests).

Goals: p95 during swaps at most 1.5x the p95 of the same routing without swaps; release record to
new version answering, p95 under 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = "sk-bench"


def build_store(model_dir: Path, root: Path, n: int):
    """``n`` versions after the model directory's, each a small perturbation of its parent."""
    import torch
    from safetensors.torch import load_file, save_file

    from flywheel.checkpoints import CheckpointStore

    store = CheckpointStore(root, full_every=1000, keep_full=1)
    weights = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for v in range(n + 1):
        tmp = store.staging_dir(v)
        if v:
            weights = {k: t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point() else t
                       for k, t in weights.items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        store.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=model_dir, extra={}, ledger={})
    return store


def client(url: str, seconds: float, max_tokens: int, concurrency: int, conn) -> None:
    """Own process: closed-loop load; its start (perf_counter) and per request (start offset,
    latency s, model, completion tokens)."""
    host, port = url.removeprefix("http://").split(":")

    def request(i: int) -> bytes:
        body = json.dumps({"model": "flywheel", "prompt": f"tell me about item {i}", "max_tokens": max_tokens,
                           "temperature": 1.0, "user": f"user-{i % 97}"}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    async def worker(w: int, t0: float, out: list) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        i = w
        while time.perf_counter() - t0 < seconds:
            start = time.perf_counter()
            writer.write(request(i))
            status = await reader.readline()
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            if b" 200 " not in status:
                raise RuntimeError(f"request failed: {status!r} {body}")
            out.append((start - t0, time.perf_counter() - start, body["model"], body["usage"]["completion_tokens"]))
            i += concurrency
        writer.close()

    async def go() -> tuple[float, list]:
        out: list = []
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, t0, out) for w in range(concurrency)))
        return t0, out

    # its start on the machine's monotonic clock too (perf_counter is one clock for every process
    # on Linux): a caller lines its own events up with the offsets
    conn.send(asyncio.run(go()))


class Rig:
    def __init__(self, model_dir: Path, store, args: argparse.Namespace, bootstrap: str) -> None:
        from kafka import KafkaProducer

        from flywheel.contracts import Topics
        from flywheel.kafka.topics import ensure_declared
        from flywheel.metrics import new_registry
        from flywheel.settings import KafkaSettings, ServeSettings, Settings
        from serving.app import create_app
        from serving.follow import ReleaseFollower
        from serving.main import make_recorder
        from serving.server import AppServer, LoopThread

        # the bench's key is told which version answered each request (serve.version_visible_keys):
        # what it measures is the version answers came from across a swap
        serve = ServeSettings(api_keys=(KEY,), version_visible_keys=(KEY,), max_num_seqs=args.concurrency,
                              rate_limit_burst=1_000_000,
                              rate_limit_per_minute=1e9, rate_limit_key_burst=1_000_000,
                              rate_limit_key_per_minute=1e9, cpu_threads_bind=args.bind,
                              **getattr(args, "serve_overrides", {}))
        prefix = getattr(args, "topic_prefix", "bench.")
        self.settings = Settings(model_dir=model_dir, data_dir=Path(tempfile.mkdtemp(prefix="bench-swap-")),
                                 topic_prefix=prefix, kafka=KafkaSettings(bootstrap=bootstrap), serve=serve)
        self.topics = Topics(prefix)
        ensure_declared(self.settings.kafka, self.topics)
        self.registry = new_registry()
        self.recorder = make_recorder(self.settings, self.registry)
        self.loop = LoopThread()

        self.fleet = self.build_fleet(serve, model_dir)
        self.follower = ReleaseFollower(self.settings, self.fleet, lambda fn: self.loop.call(fn, timeout_s=300),
                                        self.registry)
        self.follower.catch_up(10)
        self.follower.start()
        self.server = AppServer(create_app(self.settings, self.fleet, self.recorder, self.registry, self.follower),
                                self.loop).start()
        self.store, self.args = store, args
        self.producer = KafkaProducer(bootstrap_servers=bootstrap)
        self.revision = 0
        self.applies: list[dict] = []

    def build_fleet(self, serve, model_dir: Path):
        """Two full-weight engines (bench/adapter_serving.py's rig builds one adapter engine instead)."""
        from serving.engine import VllmEngine
        from serving.versions import Fleet

        async def build():
            return VllmEngine(serve, model_dir)

        self.engines = [self.loop.call(build)]
        self.rss_one = tree_rss_gib()
        self.engines.append(self.loop.call(build))
        self.rss_two = tree_rss_gib()
        return Fleet(self.engines, self.registry)

    def ref(self, v: int):
        from flywheel.contracts import VersionRef

        if v == 0:
            return None
        sha = hashlib.sha256((self.store.path(v) / "flywheel-manifest.json").read_bytes()).hexdigest()
        return VersionRef(version=v, uri=str(self.store.path(v)), manifest_sha256=sha)

    def release(self, stable: int, canary: int | None = None, share: float = 0.0) -> None:
        """Publish, then wait until every newly loaded version answers a pinned request."""
        import httpx

        from flywheel.contracts import ReleaseEvent, encode

        before = set(self.fleet.served_versions().values())
        self.revision += 1
        ev = ReleaseEvent(revision=self.revision, stable_version=stable, canary_version=canary, canary_share=share,
                          stable_ref=self.ref(stable), canary_ref=self.ref(canary) if canary else None,
                          updated_at=time.time())
        t0 = time.perf_counter()
        self.producer.send(self.topics.releases, key=b"flywheel", value=encode(ev)).get(timeout=10)
        new = {stable, canary} - {None} - before
        with httpx.Client(base_url=self.server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            for v in new:
                while c.post("/v1/completions", json={"model": f"flywheel@v{v}", "prompt": "ping",
                                                      "max_tokens": 1}).status_code != 200:
                    time.sleep(0.01)
        answering = time.perf_counter() - t0
        while self.follower.applied is None or self.follower.applied.revision != ev.revision:
            time.sleep(0.01)
        if new:
            self.applies.append({"answering": answering, **self.follower.last_apply["seconds"]})

    def load(self, seconds: float, swaps: list[tuple[int, int | None, float]] | None = None) -> list:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=client, args=(self.server.url, seconds, self.args.max_tokens,
                                                self.args.concurrency, child))
        proc.start()
        if swaps:
            def swapper() -> None:
                t_end = time.monotonic() + seconds - self.args.swap_every / 2
                i = 0
                while time.monotonic() < t_end:
                    time.sleep(self.args.swap_every)
                    self.release(*swaps[i % len(swaps)])
                    i += 1
            t = threading.Thread(target=swapper, daemon=True)
            t.start()
        self.load_t0, out = parent.recv()
        proc.join()
        if swaps:
            t.join()
        return out

    def close(self) -> None:
        self.server.stop()
        self.follower.stop()
        self.recorder.stop()
        self.producer.close()

        async def down(e):
            e.shutdown()

        for e in self.engines:
            self.loop.call(lambda e=e: down(e))
        self.loop.stop()


def tree_rss_gib() -> float:
    """Resident memory of this process and every process under it (the engines' own), in GiB."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**30


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="load per phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--swap-every", type=float, default=1.5)
    p.add_argument("--bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for both engines (serving's default: auto)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()

    from flywheel.modelinit import ModelSpec, init_model
    from flywheel.settings import ServeSettings
    from local.broker import EmbeddedBroker
    from serving.engine import configure_vllm_env

    configure_vllm_env(ServeSettings(cpu_threads_bind=args.bind))
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-model-"))
    model_dir = init_model(tmp / "model", ModelSpec())
    store = build_store(model_dir, tmp / "checkpoints", args.versions)
    n = args.versions
    with EmbeddedBroker() as broker:
        rig = Rig(model_dir, store, args, broker.bootstrap)
        try:
            rig.load(3)  # warm both routes' kernels, untimed
            rig.release(n)
            one = rig.load(args.seconds)
            rig.release(n, n - 1, 0.5)
            two = rig.load(args.seconds)
            rig.release(n)
            idle = rig.load(args.seconds, [(v, None, 0.0) for v in (n - 2, n - 3, n)])
            rig.release(n, n - 1, 0.5)
            in_place = rig.load(args.seconds, [(n - 2, n - 3, 0.5), (n, n - 1, 0.5)])
        finally:
            rig.close()
    report(args, one, two, idle, in_place, rig.applies, (rig.rss_one, rig.rss_two))


def report(args, one, two, idle, in_place, applies, rss) -> None:
    def lat(run, q):
        return pct([r[1] for r in run], q)

    def tps(run):
        return sum(r[3] for r in run) / args.seconds

    rows = []
    print(f"\nconcurrency {args.concurrency}, {args.max_tokens} tokens per request, {args.seconds:.0f} s per phase, "
          f"a swap every {args.swap_every} s, {len(applies)} releases loaded")
    print(f"{'phase':<22} {'requests':>8} {'tokens/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p95 ratio':>10} {'goal':>8}")
    for name, run, base, goal in (("one version", one, one, None), ("two versions", two, one, None),
                                  ("swaps, idle engine", idle, one, 1.5), ("swaps, in place", in_place, two, 1.5)):
        ratio = lat(run, 0.95) / lat(base, 0.95)
        rows.append({"phase": name, "requests": len(run), "tokens_per_s": tps(run), "p50_s": lat(run, 0.5),
                     "p95_s": lat(run, 0.95), "p95_ratio": ratio, "goal": goal,
                     "met": None if goal is None else ratio <= goal})
        print(f"{name:<22} {len(run):>8} {tps(run):>9.0f} {lat(run, 0.5) * 1e3:>8.0f} {lat(run, 0.95) * 1e3:>8.0f} "
              f"{ratio:>10.2f} {('<= ' + str(goal)) if goal else '':>8}")
    print(f"two versions / one version throughput: {tps(two) / tps(one):.2f}; resident memory with one engine "
          f"{rss[0]:.2f} GiB, with two {rss[1]:.2f} GiB (all processes, before any load)")
    print(f"\nrelease record -> new version answering ({len(applies)} releases), seconds:")
    print(f"{'':<10} {'answering':>10} {'fetch':>8} {'rebuild':>8} {'verify':>8} {'load':>8}")
    for q, name in ((0.5, "p50"), (0.95, "p95")):
        print(f"{name:<10} " + " ".join(f"{pct([a[k] for a in applies], q):>{w}.3f}" for k, w in
                                          (("answering", 10), ("fetch", 8), ("rebuild", 8), ("verify", 8), ("load", 8))))
    p95 = pct([a["answering"] for a in applies], 0.95)
    print(f"goal p95 answering < 5 s: {'met' if p95 < 5 else 'NOT met'} ({p95:.2f} s); "
          f"median total apply {statistics.median([a['total'] for a in applies]):.3f} s")
    if args.json:
        args.json.write_text(json.dumps({"phases": rows, "releases": applies, "rss_gib": list(rss),
                                         "throughput_two_over_one": tps(two) / tps(one)}, indent=2))


if __name__ == "__main__":
    main()
