"""How often the gate's checks on answers fail a version that did not change: two independent
samples of one model's answers, judged as stable and candidate.

    .venv/bin/python bench/meaning_false_alarms.py [--model-dir DIR] [--yes-no] [--trials 40] [--json PATH]

Each trial samples the gate's held-out prompts twice from one model (temperature 1, as the gate
samples), with different random streams, and judges the second sample against the first with the
gate's character checks (flywheel/degeneracy.py) and its checks on what answers say
(release/meaning.py), at the production limits and the gate's z = 0. Every breach is a false
alarm: the two samples come from the same weights. The gate itself draws both versions from one
random stream (common random numbers), so an unchanged version answers exactly as stable and
fails nothing; a changed, honest one sits between the two: this is the upper bound of its rate.

``--model-dir``: a model (default: the small built model); ``--yes-no``: the real demo's held-out
questions through the chat template (local/simulate.py ``YES_NO_HELD_OUT``) instead of the
shipped held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--yes-no", action="store_true", help="the real demo's held-out yes/no questions, as chat")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.degeneracy import TextProfile
    from flywheel.modelinit import ModelSpec, init_model
    from flywheel.settings import ReleaseSettings
    from local.simulate import YES_NO_HELD_OUT
    from release.gate import _sample_all, load_prompts
    from release.judge import DegeneracyLimits, degenerate, unmeaning
    from release.meaning import MeaningProfile

    torch.set_num_threads(2)
    model_dir = args.model_dir or init_model(Path(tempfile.mkdtemp(prefix="bench-meaning-")) / "model", ModelSpec())
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts = list(YES_NO_HELD_OUT) if args.yes_no else load_prompts(None)
    if args.yes_no:
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in prompts]
    else:
        ids = [tok.encode(q) for q in prompts]
    limits = DegeneracyLimits.of(ReleaseSettings())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def sample(seed: int) -> list[str]:
        torch.manual_seed(seed)
        with torch.no_grad():
            seqs = _sample_all(model, ids, args.max_tokens, tok.eos_token_id, pad, "cpu")
        return [tok.decode(s, skip_special_tokens=True) for s in seqs]

    alarms: Counter[str] = Counter()
    failed = 0
    for t in range(args.trials):
        a, b = sample(2 * t), sample(2 * t + 1)
        reasons = (degenerate(TextProfile.of(a), TextProfile.of(b), limits, 0.0)
                   + unmeaning(MeaningProfile.of(list(zip(prompts, a))), MeaningProfile.of(list(zip(prompts, b))),
                               limits, 0.0))
        names = {r.split(":")[0].split(" (")[0].split(" 0.")[0].strip() for r in reasons}
        alarms.update(names)
        failed += bool(names)
    checks = ("character repetition", "character-class stuffing", "length collapse", "same leading answer",
              "shared prefix or suffix", "answers unrelated to their prompt", "repetition anywhere in the answer",
              "appended filler")
    print(f"{model_dir.name}: {len(prompts)} prompts, {args.trials} trials of two independent samples")
    print(f"{'check':<36} {'false alarms':>12}")
    for c in checks:
        print(f"{c:<36} {alarms[c] / args.trials:>12.3f}")
    print(f"{'any':<36} {failed / args.trials:>12.3f}")
    if args.json:
        args.json.write_text(json.dumps({"trials": args.trials, "prompts": len(prompts),
                                         "rates": {c: alarms[c] / args.trials for c in checks},
                                         "any": failed / args.trials}, indent=2))


if __name__ == "__main__":
    main()
