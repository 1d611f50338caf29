"""What validating a record at a stage's edge costs, against parsing its JSON alone.

Run: ``python bench/decode_cost.py [--tokens 32] [--n 20000]``. For a generation, a feedback
record and an episode as the stages read them (completions of ``--tokens`` tokens, each with a
logprob), it times :func:`flywheel.contracts.decode` (the strict contract every stage applies
to every input record) and ``json.loads`` of the same bytes in this process, best of 5 runs of
``--n`` calls each, and prints microseconds per record and their ratio. Compare ratios, and
the rows of one run: absolute times move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import timeit

from flywheel.contracts import (
    EpisodeEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    decode,
    encode,
)


def records(tokens: int) -> list[tuple[type, bytes]]:
    toks = tuple(range(tokens))
    g = GenerationEvent(
        generation_id="g1", group_id="g1", model_name="m", model_version=0, user_id="u1", endpoint="chat",
        created_at=0.0, completed_at=0.0, latency_ms=20, prompt_text="a prompt", prompt_token_ids=(1, 2, 3, 4),
        completion_text="x" * (3 * tokens), completion_token_ids=toks, logprobs=tuple(-0.5 for _ in toks),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64), finish_reason="stop")
    f = FeedbackEvent(feedback_id="f1", generation_id="g1", signal="accept", decision_ms=900.0, created_at=0.0,
                      received_at=0.0)
    e = EpisodeEvent(generation=g, signal="accept", decision_ms=900.0, feedback_ids=("f1",), resolved_at=1.0)
    return [(GenerationEvent, encode(g)), (FeedbackEvent, encode(f)), (EpisodeEvent, encode(e))]


def best_us(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    print(f"{'record':<16}{'bytes':>7}{'json.loads us':>15}{'decode us':>11}{'ratio':>7}")
    for cls, raw in records(args.tokens):
        parse = best_us(lambda raw=raw: json.loads(raw), args.n)
        full = best_us(lambda cls=cls, raw=raw: decode(cls, raw), args.n)
        print(f"{cls.__name__:<16}{len(raw):>7}{parse:>15.2f}{full:>11.2f}{full / parse:>7.2f}")


if __name__ == "__main__":
    main()
