"""``pdserve cascade calibrate``: choose a cascade's threshold on a prompt set.

Every prompt runs (greedy, each stage's engine as the cluster YAML configures it, in this
process) on the cascade's first stage, with its tokens' log-probabilities, and on its last stage,
the reference. For each candidate threshold on the first stage's mean token log-probability the
table gives:

    answered cheap   the share of prompts whose first-stage answer clears the threshold
    agreement        the share whose cascade answer (first stage if accepted, else the last) is
                     token for token the last stage's answer (or its first --agree-tokens tokens)
    cheap agree      among the accepted, the share equal to the last stage's answer
    compute saved    1 - (first stage on every prompt + last stage on the escalated ones) / (last
                     stage on every prompt), each prompt's cost its stage's measured time for the
                     whole set shared out by the prompt's tokens (prompt + answer); the set runs
                     --batch prompts at a time (all at once by default)

and suggests the lowest threshold whose agreement reaches ``--target-agreement``, as the line to
put under ``cascades.NAME`` in the YAML. Middle stages of a longer cascade are not calibrated here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "data" / "cascade_prompts.jsonl"


@dataclass(frozen=True)
class StageRun:
    """One stage over the prompt set: each prompt's answer, its tokens' log-probabilities, its cost."""

    model: str
    answers: list[list[int]]
    logprobs: list[list[float]]
    seconds: float
    tokens: list[int]  # prompt + answer tokens, per prompt

    def costs(self) -> list[float]:
        total = sum(self.tokens) or 1
        return [self.seconds * t / total for t in self.tokens]


@dataclass(frozen=True)
class Row:
    threshold: float
    answered_cheap: float
    agreement: float
    cheap_agree: float | None
    compute_saved: float


def read_prompts(path: str | Path) -> list[dict]:
    """A JSONL file: one object per line with ``messages`` (a chat, OpenAI's shape) or ``prompt`` (text)."""
    from pdserve.bench.workloads import prompt_objects

    prompts = [obj for _, obj in prompt_objects(path, "--prompts")]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts")
    return prompts


def run_stage(name: str, engine_config, prompts: list[dict], max_tokens: int, batch: int | None = None) -> StageRun:
    """The stage's greedy answers to every prompt, timed: in batches of ``batch`` prompts (None: all
    at once, as a busy server runs them; 1: one at a time, as an idle one does)."""
    import dataclasses

    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config))
    ids = [llm.tokenizer.encode_chat(p["messages"]) if "messages" in p else llm.tokenizer.encode(p["prompt"])
           for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    batch = batch or len(ids)
    started = time.perf_counter()
    results = []
    for i in range(0, len(ids), batch):
        results += llm.generate(ids[i:i + batch], params, use_tqdm=batch > 1)
    seconds = time.perf_counter() - started
    answers = [r.outputs[0].token_ids for r in results]
    logprobs = [[lp.sampled.logprob for lp in r.outputs[0].logprobs or []] for r in results]
    return StageRun(name, answers, logprobs, seconds, [len(i) + len(a) for i, a in zip(ids, answers)])


def mean_logprob(values: list[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


def agree(a: list[int], b: list[int], tokens: int = 0) -> bool:
    """Two answers agree: equal token for token (``tokens`` > 0: in their first that many)."""
    return a[:tokens] == b[:tokens] if tokens > 0 else a == b


def table(cheap: StageRun, dear: StageRun, thresholds: list[float], agree_tokens: int = 0) -> list[Row]:
    """The calibration table (pure): one row per threshold on the cheap stage's mean logprob."""
    means = [mean_logprob(v) for v in cheap.logprobs]
    same = [agree(a, b, agree_tokens) for a, b in zip(cheap.answers, dear.answers)]
    cheap_cost, dear_cost = cheap.costs(), dear.costs()
    everything = sum(dear_cost) or 1.0
    rows = []
    for t in thresholds:
        accepted = [m >= t for m in means]
        n_accepted = sum(accepted)
        agreed = sum(s if a else True for s, a in zip(same, accepted))
        cost = sum(cheap_cost) + sum(d for d, a in zip(dear_cost, accepted) if not a)
        rows.append(Row(t, n_accepted / len(means), agreed / len(means),
                        sum(s for s, a in zip(same, accepted) if a) / n_accepted if n_accepted else None,
                        1.0 - cost / everything))
    return rows


def candidate_thresholds(cheap: StageRun, count: int = 11) -> list[float]:
    """Quantiles of the cheap stage's mean logprobs (every answer accepted at the lowest), and 0."""
    means = sorted(m for m in (mean_logprob(v) for v in cheap.logprobs) if not math.isinf(m))
    if not means:
        return [0.0]
    picks = {round(means[min(len(means) - 1, int(q * (len(means) - 1) / (count - 1)))], 3) for q in range(count)}
    return sorted(picks | {0.0})


def suggest(rows: list[Row], target: float) -> Row | None:
    """The row answering most prompts cheaply whose agreement reaches ``target``."""
    good = [r for r in rows if r.agreement >= target]
    return max(good, key=lambda r: (r.answered_cheap, -r.threshold)) if good else None


def format_table(rows: list[Row]) -> str:
    lines = [f"{'threshold':>10} {'answered cheap':>15} {'agreement':>10} {'cheap agree':>12} {'compute saved':>14}"]
    for r in rows:
        cheap_agree = "-" if r.cheap_agree is None else f"{r.cheap_agree:.1%}"
        lines.append(f"{r.threshold:>10.3f} {r.answered_cheap:>15.1%} {r.agreement:>10.1%} {cheap_agree:>12} "
                     f"{r.compute_saved:>14.1%}")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.answered_cheap for r in rows], [r.agreement for r in rows], marker="o")
    for r in rows:
        ax.annotate(f"{r.threshold:g}", (r.answered_cheap, r.agreement), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("answered by the cheap stage")
    ax.set_ylabel("agreement with the last stage")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import load_serve_config
    from pdserve.engine.cpu_isa import describe_cpu

    config = load_serve_config(args.config)
    if args.cascade not in config.cascades:
        raise ValueError(f"--cascade: {args.cascade!r} is not in {args.config}'s cascades "
                         f"({', '.join(config.cascades) or 'none'})")
    cascade = config.cascades[args.cascade]
    by_name = {n: m for m in config.served() for n in (m.name, *m.aliases)}
    prompts = read_prompts(args.prompts)[:args.limit]
    first, last = by_name[cascade.stages[0]], by_name[cascade.stages[-1]]
    print(f"calibrating {args.cascade}: {first.name} against {last.name} on {len(prompts)} prompts from "
          f"{args.prompts}, up to {args.max_tokens} tokens each, {args.batch or len(prompts)} at a time",
          file=sys.stderr)
    cheap = run_stage(first.name, first.engine, prompts, args.max_tokens, args.batch)
    dear = run_stage(last.name, last.engine, prompts, args.max_tokens, args.batch)
    rows = table(cheap, dear, candidate_thresholds(cheap), args.agree_tokens)
    print(describe_cpu())
    same = sum(agree(a, b, args.agree_tokens) for a, b in zip(cheap.answers, dear.answers))
    what = f"in their first {args.agree_tokens} tokens" if args.agree_tokens > 0 else "token for token"
    print(f"{cheap.model}: {cheap.seconds:.1f} s for the set; {dear.model}: {dear.seconds:.1f} s "
          f"({cheap.seconds / dear.seconds:.2f}x); answers agreeing {what}: {same}/{len(prompts)}")
    print(format_table(rows))
    best = suggest(rows, args.target_agreement)
    if best is None:
        print(f"no threshold reaches {args.target_agreement:.0%} agreement: every answer would need the last stage")
    else:
        print(f"suggested (agreement >= {args.target_agreement:.0%}): under cascades.{args.cascade}:\n"
              f"  accept_mean_logprob: {best.threshold}    # {best.answered_cheap:.0%} answered by {cheap.model}, "
              f"{best.agreement:.1%} agreement, {best.compute_saved:.0%} compute saved")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cascade": args.cascade, "stages": [cheap.model, dear.model], "prompts": len(prompts),
            "max_tokens": args.max_tokens, "agree_tokens": args.agree_tokens, "batch": args.batch,
            "seconds": {cheap.model: cheap.seconds, dear.model: dear.seconds},
            "rows": [r.__dict__ for r in rows], "suggested": best.threshold if best else None}, indent=2))
    if args.plot:
        plot(rows, Path(args.plot), f"cascade {args.cascade}: {cheap.model} then {dear.model}")
    return 0


def add_commands(sub) -> None:
    cascade = sub.add_parser("cascade", help="cascades: calibrate a cascade's threshold",
                             description="Tools for cascades (cascades: in the cluster YAML).")
    cascade_sub = cascade.add_subparsers(dest="cascade_command", required=True)
    calibrate = cascade_sub.add_parser(
        "calibrate", help="run a prompt set on a cascade's stages and print the threshold table",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    calibrate.add_argument("--config", metavar="FILE", required=True,
                           help="the cluster YAML naming the cascade and its stages' models")
    calibrate.add_argument("--cascade", required=True, metavar="NAME", help="the cascade to calibrate")
    calibrate.add_argument("--prompts", metavar="FILE", default=str(DEFAULT_PROMPTS),
                           help="a JSONL file, one {messages: [...]} (chat) or {prompt: TEXT} per line (default: the "
                                "120 prompts shipped in pdserve/bench/data/cascade_prompts.jsonl)")
    calibrate.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N prompts")
    calibrate.add_argument("--max-tokens", type=int, default=64,
                           help="most tokens of each answer (default: 64)")
    calibrate.add_argument("--batch", type=int, default=None, metavar="N",
                           help="run the prompts N at a time (compute saved depends on it: 1 is an idle "
                                "server, decode bound by reading the weights; default: all at once, a busy one)")
    calibrate.add_argument("--agree-tokens", type=int, default=0, metavar="N",
                           help="two answers agree when their first N tokens are equal (default: 0, the whole "
                                "answer)")
    calibrate.add_argument("--target-agreement", type=float, default=0.9, metavar="SHARE",
                           help="the suggestion's least agreement with the last stage (default: 0.9)")
    calibrate.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    calibrate.add_argument("--plot", metavar="FILE.png", help="also plot agreement against the cheap share")
    calibrate.set_defaults(func=cmd_calibrate)
