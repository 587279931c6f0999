"""Options and setup shared by `replay` and `bench`: which traffic, which bodies, which API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lenbatch.cli.common import add_trace_options, map_from_args, trace_from_args
from lenbatch.plan.trace import Trace
from lenbatch.replay.driver import ReplayPlan, plan_from_trace
from lenbatch.replay.endpoints import ENDPOINTS, Endpoint, make_endpoint
from lenbatch.replay.scenarios import SCENARIOS, build_scenario, pools_from_builder

__all__ = ["Traffic", "add_traffic_options", "driver_options", "traffic_from_args"]


def add_traffic_options(p: argparse.ArgumentParser) -> None:
    """TRACE or --scenario, the mapping options, and how requests are built and sent."""
    add_trace_options(p, optional_trace=True)
    g = p.add_argument_group("traffic")
    g.add_argument(
        "--scenario",
        choices=SCENARIOS,
        help="synthetic arrivals with real text lengths instead of TRACE",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=10.0,
        metavar="R",
        help="--scenario: mean requests per second (default 10)",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="replay only requests scheduled in the first S seconds (after rate scaling); "
        "--scenario: its length (default 60)",
    )
    g.add_argument(
        "--span",
        type=float,
        default=None,
        metavar="S",
        help="replay a fixed S seconds of trace time from --start (before --rate-scale), so a "
        "rate sweep sends the same arrivals and lengths at every rate (each rate's text drawn "
        "afresh) and the run lasts S / rate; "
        "--scenario: its length in scenario time. Not with --duration or --end",
    )
    g.add_argument("--seed", type=int, default=0, help="scenario and text seed (default 0)")
    r = p.add_argument_group("requests")
    r.add_argument(
        "--model",
        default="minilm",
        help="the served model, whose tokenizer sizes the bodies (alias or folder; default minilm)",
    )
    r.add_argument(
        "--payload",
        choices=["text", "tokens"],
        default="text",
        help="send real text of the trace's token length, or token-id arrays (default text)",
    )
    r.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="embeddings",
        help="embeddings: POST /v1/embeddings; completions: POST /v1/completions, streamed, "
        "max_tokens from the trace's output length (default embeddings)",
    )
    r.add_argument(
        "--served-model",
        default=None,
        metavar="NAME",
        help="send this `model` name in each body (default: none)",
    )
    r.add_argument(
        "--output-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="completions: multiply the trace's output lengths by X (at least 1 token)",
    )
    r.add_argument(
        "--max-output",
        type=int,
        default=None,
        metavar="N",
        help="completions: clip output lengths to N tokens",
    )
    r.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="completions: do not send ignore_eos=true (outputs may then stop before the "
        "trace's length)",
    )
    r.add_argument(
        "--clients", type=int, default=16, help="HTTP clients to spread requests over (16)"
    )
    r.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="per-request timeout (60 s)"
    )
    r.add_argument(
        "--max-in-flight",
        type=int,
        default=4096,
        metavar="N",
        help="requests in flight beyond which the driver does not send (counted as errors)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class Traffic:
    """What `traffic_from_args` builds."""

    trace: Trace
    plan: ReplayPlan
    endpoint: Endpoint
    warmup: list[bytes]
    max_length: int | None
    # The plan again with its text drawn by another seed: the same arrivals and lengths.
    plan_with_text: Callable[[int], ReplayPlan] | None = None

    def rate_plans(self, n: int, seed: int) -> list[ReplayPlan]:
        """One plan per rate of an `n`-rate sweep: `plan` first, then the same arrivals and
        lengths with text drawn afresh (seeds past the warm-up's), so a server that caches
        prompt prefixes (vLLM does by default) cannot answer one rate from what an earlier
        rate sent it."""
        redraw = self.plan_with_text
        return [self.plan if redraw is None or k == 0 else redraw(seed + 1 + k) for k in range(n)]


def traffic_from_args(args: argparse.Namespace) -> Traffic:
    """Load or build the traffic, then build every request body (before anything is sent)."""
    from lenbatch.replay.bodies import TextBuilder, load_tokenizer

    if args.trace is None and args.scenario is None:
        raise ValueError("give a TRACE or --scenario")
    if args.trace is not None and args.scenario is not None:
        raise ValueError("give a TRACE or --scenario, not both")
    span = getattr(args, "span", None)
    if span is not None:
        if span <= 0:
            raise ValueError(f"--span must be a positive number of seconds, got {span:g}")
        if args.duration is not None or args.end is not None:
            raise ValueError(
                "--span fixes the window of trace time: give it without --duration or --end"
            )
        if args.trace is not None:
            args = argparse.Namespace(**vars(args))  # the caller's namespace stays as given
            args.end = (args.start or 0.0) + span
    tokenizer = load_tokenizer(args.model)
    builder = TextBuilder(tokenizer)
    if args.scenario is not None:
        duration = args.duration if args.duration is not None else 60.0
        if span is not None:  # the scenario is made as long as the span, in its own time
            duration = span + (args.start or 0.0)
        raw = build_scenario(
            args.scenario,
            pools_from_builder(builder),
            rate=args.rate,
            duration_s=duration,
            seed=args.seed,
        )
        trace = map_from_args(raw, args)
    else:
        trace = trace_from_args(args)
    if args.duration is not None and trace.arrivals is not None:
        keep = trace.arrivals < args.duration
        trace = trace.with_note(
            f"first {args.duration:g} s: {int(keep.sum())} requests",
            input_lengths=trace.input_lengths[keep],
            arrivals=trace.arrivals[keep],
            output_lengths=None if trace.output_lengths is None else trace.output_lengths[keep],
        )
    if args.endpoint == "completions":
        trace = _map_outputs(trace, args.output_scale, args.max_output)
    endpoint = make_endpoint(args.endpoint, args.served_model, not args.no_ignore_eos)
    span_s = None if span is None else span / args.rate_scale

    def plan_with_text(seed: int) -> ReplayPlan:
        """The plan with bodies drawn from the bundled text by `seed`."""
        if args.payload == "text":
            bodies = builder.texts(trace.input_lengths, seed=seed)
        else:
            bodies = builder.token_ids(trace.input_lengths, seed=seed)
        note = (
            f"bodies: {args.payload} from bundled real text, {bodies.exact} of "
            f"{len(bodies.lengths)} at their exact trace length in {args.model}'s tokenizer"
        )
        if bodies.mismatched:
            diff = np.abs(bodies.lengths - trace.input_lengths)
            note += f" (others off by at most {int(diff.max())} tokens; real lengths are reported)"
            if seed == args.seed:
                print(f"replay: {note}", file=sys.stderr)
        notes: tuple[str, ...] = (note,)
        if span is not None:
            notes += (
                f"span: {span:g} s of trace time, {len(trace)} requests, replayed in "
                f"{span_s:g} s at rate x1 (the same arrivals and lengths at every rate of a "
                "sweep; each rate's text drawn afresh)",
            )
        return plan_from_trace(
            trace, endpoint, bodies.inputs, bodies.lengths, notes=notes, span_s=span_s
        )

    warm = builder.texts([8, 32, 64, 16], seed=args.seed + 1)
    warmup = [endpoint.body(x, 4) for x in warm.inputs]
    return Traffic(
        trace, plan_with_text(args.seed), endpoint, warmup, args.max_length, plan_with_text
    )


def _map_outputs(trace: Trace, scale: float, limit: int | None) -> Trace:
    """Output lengths for completions, scaled and clipped, each step noted."""
    if trace.output_lengths is None:
        raise ValueError("--endpoint completions needs output lengths; this trace has none")
    if scale <= 0:
        raise ValueError(f"--output-scale must be positive, got {scale}")
    out = trace.output_lengths
    if scale != 1.0:
        out = np.maximum(1, np.rint(out * scale)).astype(np.int64)
        trace = trace.with_note(f"output lengths x{scale:g}", output_lengths=out)
    if limit is not None:
        n_over = int((out > limit).sum())
        out = np.minimum(out, limit)
        trace = trace.with_note(f"clipped {n_over} outputs to {limit} tokens", output_lengths=out)
    return trace


def driver_options(args: argparse.Namespace) -> dict[str, Any]:
    """How the load driver sends, from the flags `add_traffic_options` added: keyword
    arguments of `replay.driver.replay` (and fields of `replay.bench.BenchConfig`)."""
    return {
        "clients": args.clients,
        "timeout_s": args.timeout,
        "max_in_flight": args.max_in_flight,
        "progress": not args.no_progress,
    }


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """Settings worth printing beside the results."""
    return {
        "payload": args.payload,
        "endpoint": args.endpoint,
        "model (tokenizer)": args.model,
        "clients": args.clients,
        "per-request timeout": f"{args.timeout:g} s",
        "seed": args.seed,
        "span": "none" if getattr(args, "span", None) is None else f"{args.span:g} s of trace time",
    }
