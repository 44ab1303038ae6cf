"""``pdserve profile``: measure this machine's engine into a latency profile (or model another's)."""

from __future__ import annotations

import argparse
import dataclasses

from pdserve.bench.latency_model import Profile, StepFeatures, chunk_pairs
from pdserve.bench.profile import ProfileConfig, StepSample
from pdserve.configs import add_arguments, collect_arguments, field_help, from_dict

# The table's example steps: (label, features).
EXAMPLES = [
    ("prefill 512 tokens", StepFeatures(512, chunk_pairs(0, 512))),
    ("prefill 2048 tokens", StepFeatures(2048, chunk_pairs(0, 2048))),
    ("decode batch 1, context 512", StepFeatures(decode_seqs=1, decode_context=512)),
    ("decode batch 32, context 512", StepFeatures(decode_seqs=32, decode_context=32 * 512)),
]
COEFFICIENTS = {"overhead_s": "per step", "per_prefill_token_s": "per prefill token",
                "per_attention_pair_s": "per attention pair (prefill)", "per_decode_seq_s": "per decode sequence",
                "per_decode_context_s": "per decode context token"}


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.bench.profile import measure, roofline_profile

    config = from_dict(ProfileConfig, collect_arguments(args, ProfileConfig), "profile")
    samples: list[StepSample] = []
    if config.roofline:
        profile = roofline_profile(config)
    elif config.from_trace:
        from pdserve.bench.step_trace import profile_from_traces

        transfer = Profile.load(config.transfer_from) if config.transfer_from else None
        profile, samples = profile_from_traces(config.traces, transfer, config.seed, config.trace_skip_s,
                                               config.transfer_from)
    else:
        profile, samples = measure(config)
    if config.serving_url:
        from pdserve.bench.profile import with_request_overhead

        profile = with_request_overhead(profile, config.serving_url, config.serving_samples, config.seed)
    profile.save(config.output)
    print(table(profile))
    print(f"wrote {config.output}")
    if config.plot:
        if samples:
            plot(samples, profile, config.plot)
            print(f"wrote {config.plot}")
        else:
            print("--plot: a modelled profile has no measured steps to plot; none written")
    return 0


def seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns" if s else "0"


def table(profile: Profile) -> str:
    """The profile for a terminal: what it is of, its coefficients and fit, example predictions."""
    m, hw, fit = profile.model, profile.hardware, profile.fit
    where = hw.get("cpu") or hw.get("name", "?")
    if profile.kind == "measured":
        where += f", {hw.get('cores')} cores, {hw.get('threads')} threads, torch {hw.get('torch')}"
    dtype = f"{m['dtype']}, " if "dtype" in m else ""
    lines = [f"{profile.kind} profile of {m['name']} ({dtype}{m['kv_bytes_per_token']} KV bytes/token) on {where}"]
    if hw.get("cpu_flags"):
        lines.append("CPU flags: " + " ".join(hw["cpu_flags"]) + (f"; ISA {hw['isa']}" if "isa" in hw else ""))
    lines.append("step time =")
    for name, label in COEFFICIENTS.items():
        lines.append(f"  {seconds(getattr(profile.step, name)):>10}  {label}")
    if "samples" in fit:
        line = (f"fit: {fit['samples']} steps, r2 {fit['r2']:.3f}, mean |error| {fit['mean_abs_pct_error']:.1f}%, "
                f"max {fit['max_abs_pct_error']:.0f}%")
        if "holdout_samples" in fit:
            line += (f"; held out ({fit['holdout_samples']} steps): mean {fit['holdout_mean_abs_pct_error']:.1f}%, "
                     f"max {fit['holdout_max_abs_pct_error']:.0f}%")
        lines.append(line)
    elif fit.get("note"):
        lines.append(f"fit: {fit['note']}")
    lines.append("predicted:")
    lines += [f"  {seconds(profile.step_s(f)):>10}  {label}" for label, f in EXAMPLES]
    if "request_overhead" in fit:
        o = fit["request_overhead"]
        lines.append(f"  {seconds(profile.request_overhead_s):>10}  a request outside engine steps (through "
                     f"{o['url']}: median TTFT {seconds(o['median_ttft_s'])} of {o['requests']} prompts of "
                     f"{o['prompt_tokens']} tokens, less their step)")
    for backend, t in sorted(profile.transfer.items()):
        lines.append(f"  {seconds(profile.transfer_s(2048, backend)):>10}  KV of 2048 tokens over {backend} "
                     f"({seconds(t.overhead_s)} + {t.s_per_byte * 1e9:.3g} s/GB)")
    for backend, note in sorted(fit.get("transfer", {}).items()):
        if backend not in profile.transfer:
            lines.append(f"  {backend}: {note}")
    return "\n".join(lines)


def plot(samples: list[StepSample], profile: Profile, path: str) -> None:
    """Predicted against measured step time, one colour per step shape, log-log."""
    from pdserve.bench.report import _pyplot, save_figure

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for shape in ("prefill", "decode", "mixed"):
        chosen = [s for s in samples if s.shape == shape]
        ax.scatter([s.seconds * 1e3 for s in chosen], [profile.step_s(s.features) * 1e3 for s in chosen], s=8,
                   label=f"{shape} ({len(chosen)})")
    values = [s.seconds * 1e3 for s in samples] + [profile.step_s(s.features) * 1e3 for s in samples]
    low, high = max(min(values), 1e-3), max(values)
    ax.plot([low, high], [low, high], "k--", lw=0.8, label="predicted = measured")
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title=f"{profile.model['name']}: r2 {profile.fit.get('r2', float('nan')):.3f}")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path, dpi=120)


def add_commands(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure this machine's engine step and KV transfer times into a latency profile (JSON)",
        description="Run the real engine on this machine over a designed set of steps (prefill chunks of 16 "
                    "tokens to the step budget, at context 0 and after it; decode batches of 1-64 at contexts "
                    "32-2048; mixed steps), time each, and fit step time = overhead + prefill tokens + attention "
                    "pairs + decode sequences + decode context; time KV transfers per backend, and on a CPU "
                    "what shipping KV over grpc adds to a prefill worker's steps (the same prompts' steps with "
                    "and without it, to a receiver in another process). Writes a versioned "
                    "JSON profile with the hardware and model it was measured on (`pdserve sim` reads it). "
                    "With --from-trace: the same fit to the steps serving workers ran (their --step-trace), so "
                    "the profile holds the cluster's speed, not the engine's alone. "
                    "With --roofline HW --shape PRESET: a modelled profile from a hardware description instead, "
                    "no engine run.")
    add_arguments(p, ProfileConfig, skip=("output",))
    default = next(f.default for f in dataclasses.fields(ProfileConfig) if f.name == "output")
    p.add_argument("-o", "--output", default=None, help=f"{field_help(ProfileConfig, 'output')} (default: {default})")
    p.set_defaults(func=cmd_profile)
