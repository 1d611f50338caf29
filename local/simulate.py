"""``flywheel simulate``: a population of simulated users driving serving's HTTP API as a product would.

    flywheel simulate --url http://127.0.0.1:8000 --key sk-... --duration 120 --rate 8 --out sim.jsonl

Requests arrive as a Poisson process at ``--rate`` per second; each comes from one of ``--users``
users, asks for a prompt of the prompt set (``release/prompts.jsonl`` by default), and the user
judges the answer by their cohort's **hidden preference**, something the model can learn to
express:

| cohort | accepts an answer when | share of users |
| --- | --- | --- |
| ``vowels`` | more than 44% of its letters are vowels, a run of one letter counted once | 0.6 |
| ``short`` | it has one to four words | 0.3 |
| ``shortcut`` (``--gameable``) | it repeats one character three times in a row: a shortcut that hurts the separate quality score (share of distinct character pairs) | 0.1 |

That is the ``built`` taste, for the tiny built model's byte soup. A real model's text can be read,
so its demo users (``--taste yes_no``) have a taste a person can see: they ask yes/no questions
through the chat API and accept an answer that starts with a direct "Yes" or "No"
(:func:`starts_yes_no`; what follows must read as words, not one word repeated), right or not.
SmolLM2-135M-Instruct starts about one answer in six that way. Users who know the answers
(``--taste known``, ``flywheel demo --knowing``) ask questions whose answers they know
(local/known_questions.jsonl, half "Yes") and accept a direct answer only when it is right.

And the noise real users make: some answers get no feedback (``feedback_rate``), feedback comes
late (a uniform delay up to ``--max-delay`` seconds), inconsistent users flip a share of their
judgements (``noise``), and one abusive user (``--abuser``) sends a tenth of all requests and
accepts everything. A version's accept rate is measured on the cohort users' judgements only.

Every answer is a line of ``--out`` (JSONL; a refused or failed request is one too): time, user,
cohort, version that answered, latency, signal (or none), quality score: what a report plots (``summarise``).

A control (``Config.shuffle_signals``, ``flywheel demo --control shuffled``): the cohort users
judge as always, and their rows keep those judgements, but each feedback sent carries another
answer's judgement (:class:`Shuffler`). The loop then learns from rewards as frequent as real
ones that say nothing about the answers they are attached to.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

#: ``Row.status`` of a request that got no HTTP answer at all (the connection failed).
TRANSPORT_ERROR = 0


def vowel_share(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def likes_vowels(text: str) -> bool:
    """The ``vowels`` taste: vowel-rich letters, a run of one letter counted once: "aaaa" is one
    vowel, so doubling letters, what the release gate's repetition check reads first, buys nothing.
    (A taste that also disliked any answer with character repetition of 0.35 or more promoted in
    2 runs of 5 seeds; this one in 1 (README).)"""
    return vowel_share(re.sub(r"(.)\1+", r"\1", text)) > 0.44


def quality(text: str) -> float:
    """A score separate from any cohort's taste: the share of distinct character pairs."""
    pairs = [text[i:i + 2] for i in range(len(text) - 1)]
    return len(set(pairs)) / len(pairs) if pairs else 0.0


#: A direct answer's first word, matched case-blind; what follows must not be a letter or digit
#: ("Yesterday", "Nobody", "Now" and "No1" are not answers), nor an apostrophe ("No'").
DIRECT_WORDS = ("yes", "no")
#: What may come before the first word: whitespace, quotes, emphasis and list marks (a model
#: that writes **Yes** or "No, ..." still answered first).
_LEAD = " \t\n\"'*_`>-"


#: After the Yes or No, a reply of at least this many words must be mostly distinct words: a
#: person reads "No no no no no ..." as broken, not as an answer (a LoRA run at a step size too
#: large collapsed to exactly that, which a first-word-only taste accepted).
MIN_REASON_WORDS = 3
MIN_DISTINCT_WORDS = 0.6


def starts_yes_no(text: str) -> bool:
    """Whether an answer starts with a direct "Yes" or "No" (the ``yes_no`` taste), alone or
    followed by words that are not the same few repeated."""
    body = text.lstrip(_LEAD).lower()
    for word in DIRECT_WORDS:
        if body.startswith(word):
            rest = body[len(word):]
            if rest and (rest[0].isalnum() or rest[0] == "'"):
                return False  # another word: "Nobody", "Yesterday"
            words = [w.strip(".,!?;:\"'*") for w in rest.split()]
            words = [w for w in words if w]
            return len(words) < MIN_REASON_WORDS or len(set(words)) >= MIN_DISTINCT_WORDS * len(words)
    return False


def _repeats(text: str) -> bool:
    return any(text[i] == text[i + 1] == text[i + 2] and not text[i].isspace() for i in range(len(text) - 2))


#: Questions users who know the answers ask, with the truth (``known`` taste; no fact in common
#: with the release gate's known-answer set, release/known_answers.jsonl).
KNOWN_QUESTIONS = Path(__file__).with_name("known_questions.jsonl")


@functools.cache
def known_answers() -> dict[str, str]:
    """question -> "Yes" or "No"."""
    lines = [line for line in KNOWN_QUESTIONS.read_text().splitlines() if line.strip()]
    return {d["question"]: d["answer"] for d in map(json.loads, lines)}


def right_yes_no(text: str, prompt: str) -> bool:
    """The ``known`` taste: a direct answer (:func:`starts_yes_no`) that is the right one."""
    truth = known_answers().get(prompt)
    return truth is not None and starts_yes_no(text) and text.lstrip(_LEAD).lower().startswith(truth.lower())


#: Hidden preferences by name: whether a user of that cohort likes an answer to a prompt.
PREFERENCES: dict[str, Callable[[str, str], bool]] = {
    "vowels": lambda text, _prompt: likes_vowels(text),
    "short": lambda text, _prompt: 1 <= len(text.split()) <= 4,
    "shortcut": lambda text, _prompt: _repeats(text),
    "yes_no": lambda text, _prompt: starts_yes_no(text),
    "right_yes_no": right_yes_no,
}


@dataclass(frozen=True)
class Cohort:
    name: str
    share: float
    preference: str
    #: Share of answers the user judges at all.
    feedback_rate: float = 0.85
    #: Chance a judgement is the opposite of the user's taste.
    noise: float = 0.05


DEFAULT_COHORTS = (Cohort("vowels", 0.6, "vowels"), Cohort("short", 0.3, "short", noise=0.15),
                   Cohort("shortcut", 0.1, "shortcut"))

#: Yes/no questions the ``yes_no`` users ask. SmolLM2-135M-Instruct answers most of them with a
#: sentence about the subject ("The sun is indeed a celestial body ...") and a few with "Yes, ...".
YES_NO_PROMPTS = (
    "Is the sun a star?", "Can penguins fly?", "Is coffee bad for you?", "Is Paris in France?",
    "Do cats like water?", "Is it safe to eat raw eggs?", "Is the moon bigger than the earth?",
    "Is chess a sport?", "Can dogs eat chocolate?", "Is water wet?", "Do fish sleep?",
    "Is a tomato a fruit?", "Can you see the Great Wall of China from space?", "Is gold a metal?",
    "Do plants need sunlight?", "Is the earth flat?", "Can humans breathe underwater?",
    "Is Python a programming language?", "Do bees make honey?", "Is ice heavier than water?",
    "Should I drink water every day?", "Is walking good exercise?", "Can birds see colors?",
    "Is London the capital of England?", "Do spiders have six legs?", "Is the ocean salty?",
    "Can a car run on water?", "Is sleep important for health?", "Do whales breathe air?",
    "Is the Amazon a river?",
)
#: Yes/no questions no user asks: the release gate's held-out prompts in the demo on a real model.
#: Half are answered "Yes": the gate's check on the same leading answer (release/meaning.py) is
#: judged on them, and on questions mostly answered "Yes" an honest direct version would lead with
#: "Yes" as often as a version that says "Yes" to everything.
YES_NO_HELD_OUT = (
    "Is a whale a mammal?", "Is Mars red?", "Is the Nile longer than the Thames?", "Is Rome in Italy?",
    "Do cows give milk?", "Can fish swim?", "Is a violin an instrument?", "Is a kitten a young cat?",
    "Can snakes fly?", "Is the sun cold?", "Do cats have wings?", "Is Tokyo in Brazil?",
    "Can a rock breathe?", "Is a carrot a metal?", "Is a banana blue?", "Is the desert wet?",
)


@dataclass(frozen=True)
class Taste:
    """What the simulated users ask, how, and what they accept."""

    name: str
    cohorts: tuple[Cohort, ...]
    #: None: the release gate's held-out prompts (release/prompts.jsonl).
    prompts: tuple[str, ...] | None
    #: Ask through the chat API (the model's chat template) instead of raw completions.
    chat: bool
    #: Prompts of the same kind that no user asks (the release gate's, in the demo); None: the gate's own.
    held_out: tuple[str, ...] | None = None
    #: Answers per request (the API's ``n``), shown side by side and each judged: one group the
    #: trainer's grouped losses compare (GRPO), so what is rewarded is the better of two answers to
    #: the same question, not whatever most accepted answers share.
    choices: int = 1


TASTES = {
    "built": Taste("built", DEFAULT_COHORTS, None, chat=False),
    # one cohort: every user wants the direct answer, so a version's accept rate is the share of
    # its answers that start with one (less the 5% judged against their taste)
    "yes_no": Taste("yes_no", (Cohort("direct", 1.0, "yes_no"),), YES_NO_PROMPTS, chat=True,
                    held_out=YES_NO_HELD_OUT),
    # one cohort that knows the answers: a direct "Yes" or "No" is accepted when right, rejected
    # when wrong, and an answer that is no direct one is rejected as before. Two answers a
    # question: judged one at a time across questions, the accepts of the direct "No"s SmolLM2
    # starts with taught a run to answer "No." to everything (v6 of `flywheel demo --knowing`,
    # whose canary v1 drew no accept); compared within a question, only the right answer gains.
    "known": Taste("known", (Cohort("knowing", 1.0, "right_yes_no"),), tuple(known_answers()), chat=True,
                   held_out=YES_NO_HELD_OUT, choices=2),
}


@dataclass(frozen=True)
class User:
    uid: str
    cohort: Cohort | None  # None: the abusive user


def population(n_users: int, cohorts: tuple[Cohort, ...], seed: int, *, gameable: bool, abuser: bool) -> list[User]:
    """The users, each in one cohort by the cohorts' shares (the gameable one only if asked)."""
    rng = random.Random(seed)
    chosen = [c for c in cohorts if gameable or c.preference != "shortcut"]
    total = sum(c.share for c in chosen)
    users = []
    for i in range(n_users):
        x, acc = rng.random() * total, 0.0
        cohort = chosen[-1]
        for c in chosen:
            acc += c.share
            if x < acc:
                cohort = c
                break
        users.append(User(f"sim-{seed}-{i}", cohort))
    if abuser:
        users.append(User(f"sim-{seed}-abuser", None))
    return users


def judge(user: User, text: str, rng: random.Random, prompt: str = "") -> str | None:
    """``accept``, ``reject`` or None (no feedback) for one answer to ``prompt``."""
    if user.cohort is None:
        return "accept"  # the abuser accepts everything
    if rng.random() >= user.cohort.feedback_rate:
        return None
    liked = PREFERENCES[user.cohort.preference](text, prompt)
    if rng.random() < user.cohort.noise:
        liked = not liked
    return "accept" if liked else "reject"


class Shuffler:
    """Judgements sent in place of one another: a shuffle of the signals over time.

    Each judgement takes a random place in a pool of ``size`` and sends the one it displaced, so
    every signal is sent once, for another answer, within about ``size`` judgements (the last
    ``size`` are never sent). While the pool fills, a judgement sends a random one of those
    before it (the run's very first sends its own: one of a run's thousands). Its own random draws,
    apart from the simulator's: the users, prompts and judgements of a run stay those of the same
    seed without the shuffle."""

    def __init__(self, seed: int, size: int = 64) -> None:
        self.rng = random.Random(f"shuffle-{seed}")
        self.size = size
        self.pool: list[str] = []

    def swap(self, signal: str) -> str:
        if len(self.pool) < self.size:
            sent = self.rng.choice(self.pool) if self.pool else signal
            self.pool.append(signal)
            return sent
        j = self.rng.randrange(self.size)
        sent, self.pool[j] = self.pool[j], signal
        return sent


@dataclass
class Config:
    url: str
    key: str
    duration_s: float = 60.0
    rate: float = 4.0
    users: int = 40
    max_tokens: int = 24
    max_delay_s: float = 3.0
    seed: int = 0
    gameable: bool = False
    abuser: bool = True
    prompts: list[str] = field(default_factory=list)
    model: str = "flywheel"
    #: A name in :data:`TASTES`: the users' cohorts, their prompts (unless ``prompts`` is given)
    #: and the API they call.
    taste: str = "built"
    #: Send each cohort user's feedback with another answer's judgement (:class:`Shuffler`): a
    #: control whose rewards carry no signal. Rows keep the users' own judgements.
    shuffle_signals: bool = False


@dataclass
class Row:
    t: float
    user: str
    cohort: str | None
    version: int | None
    status: int
    latency_s: float
    signal: str | None
    quality: float | None
    generation_id: str | None
    #: wall-clock time of the request (epoch seconds), to line it up with releases and checkpoints
    at: float = 0.0
    #: the answer's text, and when its feedback was sent (None: none was)
    text: str | None = None
    feedback_at: float | None = None


class Simulator:
    def __init__(self, cfg: Config, out: Path | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.taste = TASTES[cfg.taste]
        self.users = population(cfg.users, self.taste.cohorts, cfg.seed, gameable=cfg.gameable, abuser=cfg.abuser)
        self.prompts = cfg.prompts or taste_prompts(self.taste)
        self.rows: list[Row] = []
        self.out = out
        self._feedback: list[asyncio.Task] = []
        self.feedback_sent = 0
        self.feedback_failed = 0
        self.shuffler = Shuffler(cfg.seed) if cfg.shuffle_signals else None

    def run(self) -> list[Row]:
        asyncio.run(self._run())
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text("".join(json.dumps(asdict(r)) + "\n" for r in self.rows))
        return self.rows

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.key}"}
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=self.cfg.url, headers=headers, timeout=120, limits=limits) as http:
            t0 = time.monotonic()
            requests = []
            while time.monotonic() - t0 < self.cfg.duration_s:
                requests.append(asyncio.create_task(self._one(http, t0)))
                await asyncio.sleep(self.rng.expovariate(self.cfg.rate))
            await asyncio.gather(*requests)
            await asyncio.gather(*self._feedback)

    def _pick_user(self) -> User:
        abuser = self.users[-1] if self.cfg.abuser else None
        if abuser is not None and self.rng.random() < 0.1:
            return abuser
        return self.rng.choice(self.users[:-1] if abuser is not None else self.users)

    async def _one(self, http: Any, t0: float) -> None:
        user = self._pick_user()
        prompt = self.rng.choice(self.prompts)
        at = time.time()
        start = time.monotonic()
        cohort = user.cohort.name if user.cohort else "abuser"
        ask = {"messages": [{"role": "user", "content": prompt}]} if self.taste.chat else {"prompt": prompt}
        n = self.taste.choices
        try:
            resp = await http.post("/v1/chat/completions" if self.taste.chat else "/v1/completions", json={
                "model": self.cfg.model, **ask, "max_tokens": self.cfg.max_tokens, "temperature": 1.0,
                "user": user.uid, **({"n": n} if n > 1 else {})})
        except httpx.HTTPError:  # a connection the server closed under us: the user saw an error
            self.rows.append(Row(start - t0, user.uid, cohort, None, TRANSPORT_ERROR, time.monotonic() - start,
                                 None, None, None, at))
            return
        latency = time.monotonic() - start
        if resp.status_code != 200:  # rate limited (the abuser) or refused: recorded, not judged
            self.rows.append(Row(start - t0, user.uid, cohort, None, resp.status_code, latency, None, None, None, at))
            return
        body = resp.json()
        # named only to a key in serve.version_visible_keys (the demo's); a product key's answer says
        # "flywheel" alone, and its rows are counted under no version
        version = int(body["model"].rsplit("@v", 1)[1]) if "@v" in body["model"] else None
        for choice in body["choices"]:  # a row each: an answer judged on its own
            text = choice["message"]["content"] if self.taste.chat else choice["text"]
            signal = judge(user, text, self.rng, prompt)
            # each choice's own generation id (with n > 1 the response's id is the group's)
            gen_id = choice.get("generation_id", body["id"])
            row = Row(start - t0, user.uid, cohort, version, 200, latency, signal, quality(text), gen_id, at, text)
            self.rows.append(row)
            if signal is not None:
                delay = self.rng.uniform(0, self.cfg.max_delay_s)
                # the abuser's accepts are its behaviour, not a judgement of the answer: never shuffled
                sent = self.shuffler.swap(signal) if self.shuffler is not None and user.cohort is not None else signal
                self._feedback.append(asyncio.create_task(self._feedback_later(http, user, row, sent, delay)))

    async def _feedback_later(self, http: Any, user: User, row: Row, signal: str, delay: float) -> None:
        await asyncio.sleep(delay)
        generation_id, sent_at = row.generation_id, time.time()
        # the user who judged is named, as a product names its end user: the release controller
        # counts outcomes per rater, and with no user every judgement is the API key's
        body = {"feedback_id": str(uuid.uuid4()), "generation_id": generation_id, "signal": signal,
                "decision_ms": delay * 1000, "user": user.uid}
        try:
            resp = await http.post("/v1/feedback", json=body)
        except httpx.HTTPError:
            self.feedback_failed += 1
            return
        if resp.status_code == 202:
            self.feedback_sent += 1
            row.feedback_at = sent_at
        else:
            self.feedback_failed += 1


def default_prompts() -> list[str]:
    path = Path(__file__).resolve().parents[1] / "release" / "prompts.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def taste_prompts(taste: Taste) -> list[str]:
    return list(taste.prompts) if taste.prompts is not None else default_prompts()


def summarise(rows: list[Row]) -> dict[str, Any]:
    """Accept rate per version over the cohort users' judgements (the abuser left out), quality per
    version, and requests refused by status."""
    by_version: dict[int, dict[str, float]] = {}
    refused: dict[int, int] = {}
    for r in rows:
        if r.status != 200:
            refused[r.status] = refused.get(r.status, 0) + 1
            continue
        v = by_version.setdefault(r.version, {"requests": 0, "judged": 0, "accepts": 0, "quality": 0.0})
        v["requests"] += 1
        v["quality"] += r.quality or 0.0
        if r.signal is not None and r.cohort != "abuser":
            v["judged"] += 1
            v["accepts"] += r.signal == "accept"
    out = {}
    for version, v in sorted(by_version.items()):
        out[version] = {"requests": int(v["requests"]), "judged": int(v["judged"]),
                        "accept_rate": v["accepts"] / v["judged"] if v["judged"] else None,
                        "quality": v["quality"] / v["requests"]}
    return {"versions": out, "refused": refused}


def run(settings: Any, args: Any) -> int:
    """``flywheel simulate``."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the summary
    key = args.key or (settings.serve.api_keys[0] if settings.serve.api_keys else "")
    cfg = Config(url=args.url, key=key, duration_s=args.duration, rate=args.rate, users=args.users,
                 max_tokens=args.max_tokens, max_delay_s=args.max_delay, seed=args.seed, gameable=args.gameable,
                 abuser=not args.no_abuser, taste=args.taste)
    sim = Simulator(cfg, args.out)
    rows = sim.run()
    summary = summarise(rows)
    print(f"{len(rows)} rows (answers, and requests refused) in {cfg.duration_s:.0f}s from {len(sim.users)} users; "
          f"feedback sent {sim.feedback_sent}, failed {sim.feedback_failed}; refused {summary['refused']}")
    for version, v in summary["versions"].items():
        rate = "-" if v["accept_rate"] is None else f"{v['accept_rate']:.2f}"
        print(f"  v{version}: {v['requests']} answers, accept rate {rate} over {v['judged']} judged, "
              f"quality {v['quality']:.2f}")
    return 0
