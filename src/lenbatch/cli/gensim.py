"""`lenbatch simulate-generation`: goodput of a causal LM's `continuous` at several running caps
and of `adaptive`, on a completions trace, at multiples of the simulated capacity
(`plan.gensim`, with the engine's own policies)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from lenbatch.config import AdaptiveConfig, GenerationConfig
from lenbatch.core.costfit import CostCoefficients

__all__ = ["register", "run"]

# `generate.costs`' generic priors, repeated here so that building the parser imports no
# torch (a test checks they agree).
PREFILL_DEFAULT = CostCoefficients(0.02, 3e-4, 0.0)
DECODE_DEFAULT = CostCoefficients(0.035, 8e-6, 0.0)


def _pair(text: str) -> CostCoefficients:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        msg = f"expected A,B (seconds, seconds per token), got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if a < 0 or b < 0:
        raise argparse.ArgumentTypeError(f"costs must be >= 0, got {text!r}")
    return CostCoefficients(a, b)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def register(sub: Any) -> None:
    """Add the `simulate-generation` subcommand."""
    p = sub.add_parser(
        "simulate-generation",
        help="goodput of continuous (per running cap) and adaptive for a causal LM, simulated",
        description="Replay a completions trace through a virtual causal-LM engine with the "
        "server's own decode policies; capacity is continuous's completions/s far past "
        "saturation; goodput = answers with TTFT <= --slo-ms and mean inter-token <= "
        "--itl-slo-ms, per second.",
    )
    p.add_argument("trace", nargs="?", default="azure-conv", help="bundled trace or file")
    p.add_argument("--length-scale", type=float, default=0.1)
    p.add_argument("--max-length", type=int, default=400)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--start", type=float, default=600.0, help="trace window start, s")
    p.add_argument("--duration", type=float, default=60.0, help="trace window, s")
    p.add_argument("--loads", type=_floats, default=(0.5, 1.0, 2.0),
                   help="mean rates as multiples of capacity (default 0.5,1,2)")  # fmt: skip
    p.add_argument("--caps", default="4,8,16,32", help="continuous's running caps")
    p.add_argument("--max-running", type=int, default=64, help="adaptive's most rows")
    p.add_argument("--step-tokens", type=int, default=256, help="continuous's step budget")
    p.add_argument("--prefill-cost", type=_pair, default=PREFILL_DEFAULT,
                   help="prefill chunk: A,B = seconds per call, per row x column")  # fmt: skip
    p.add_argument("--decode-cost", type=_pair, default=DECODE_DEFAULT,
                   help="decode step: A,B = seconds per call, per row x cache column")  # fmt: skip
    p.add_argument("--padded-prefill", action="store_true",
                   help="price a prefill chunk by rows x padded columns, as transformers' "
                   "forward runs it (default: by its real prompt tokens, as the lean Llama "
                   "path runs it)")  # fmt: skip
    p.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT objective")
    p.add_argument("--itl-slo-ms", type=float, default=150.0, help="mean inter-token objective")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print one table row per load: each cap's goodput, adaptive's, and its refusals."""
    from lenbatch.generate.adaptive import AdaptiveGenPolicy
    from lenbatch.generate.costs import GenCosts
    from lenbatch.generate.policy import ContinuousPolicy
    from lenbatch.plan.gensim import goodput, requests_of, scaled, simulate_generation
    from lenbatch.plan.trace import load_trace, map_trace

    trace = map_trace(
        load_trace(args.trace),
        length_scale=args.length_scale,
        max_length=args.max_length,
        start_s=args.start,
        end_s=args.start + args.duration,
    )
    if trace.output_lengths is not None:
        out = (trace.output_lengths * args.output_scale).round().clip(1, args.max_output)
        trace = trace.with_note("outputs mapped", output_lengths=out.astype("int64"))
    reqs = requests_of(trace)
    span = max(r.arrival for r in reqs) or 1.0
    caps = [int(c) for c in args.caps.split(",")]
    pre, dec = args.prefill_cost, args.decode_cost
    real = not args.padded_prefill
    # capacity: continuous at its largest cap with every request arriving within one second
    flood = scaled(reqs, span)
    outs = simulate_generation(
        flood, ContinuousPolicy(max(caps), args.step_tokens), pre, dec, real_tokens=real
    )
    done = [o.finished for o in outs if not math.isnan(o.finished)]
    capacity = len(done) / max(done)
    offered = len(reqs) / span
    print(f"{len(reqs)} requests over {span:.0f} s; simulated capacity {capacity:.2f}/s")
    head = " | ".join(f"cap {c}" for c in caps)
    print(f"| load | {head} | adaptive | refused |")
    print("|---:|" + "---:|" * (len(caps) + 2))
    cfg = AdaptiveConfig(slo_ms=args.slo_ms, itl_slo_ms=args.itl_slo_ms)
    ttft, itl = args.slo_ms / 1000, args.itl_slo_ms / 1000
    for load in args.loads:
        at = scaled(reqs, load * capacity / offered)
        width = max(r.arrival for r in at) or 1.0
        cells = [
            goodput(simulate_generation(at, ContinuousPolicy(c, args.step_tokens), pre, dec,
                                        real_tokens=real), width, ttft, itl)
            for c in caps
        ]  # fmt: skip
        gen = GenerationConfig(max_running=args.max_running, step_tokens=args.step_tokens)
        policy = AdaptiveGenPolicy(gen, cfg, GenCosts("simulated", prefill_prior=pre,
                                                      decode_prior=dec))  # fmt: skip
        outs = simulate_generation(at, policy, pre, dec, real_tokens=real)
        ours = goodput(outs, width, ttft, itl)
        refused = 100 * sum(o.refused for o in outs) / len(outs)
        row = " | ".join(f"{g:.2f}" for g in cells)
        print(f"| {load:g}x | {row} | {ours:.2f} | {refused:.1f} % |")
    return 0
