"""Options shared by several commands: reading a trace (analyze, fit, simulate, tune, replay),
the batching flags (serve, simulate), and loading a cost model (with a warning when it was
measured on another processor)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from lenbatch.plan.costmodel import CostModel, processor_mismatch
from lenbatch.plan.trace import TRACE_FORMATS, ColumnMap, Trace, load_trace, map_trace

__all__ = [
    "COST_HELP",
    "adaptive_overrides",
    "add_adaptive_options",
    "add_batching_options",
    "add_boundaries_option",
    "add_cost_option",
    "add_precision_options",
    "add_quantize_option",
    "add_trace_options",
    "batching_overrides",
    "float_list",
    "int_list",
    "load_cost_model",
    "map_from_args",
    "name_list",
    "pin_cost_spec",
    "trace_from_args",
]

T = TypeVar("T")


def _parsed_list(text: str, convert: Callable[[str], T], example: str) -> list[T]:
    """`text` split at commas, blanks dropped, each item converted (an argparse type's body)."""
    try:
        return [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}") from None


def int_list(text: str) -> list[int]:
    """Parse `32,64,128` (an argparse type)."""
    return _parsed_list(text, int, "comma-separated integers like 32,64,128")


def float_list(text: str) -> list[float]:
    """Parse `0.5,1,2` (an argparse type)."""
    return _parsed_list(text, float, "comma-separated numbers like 0.5,1,2")


def name_list(text: str) -> list[str]:
    """Parse `fifo,bucketed` (an argparse type); an empty text is an empty list."""
    return _parsed_list(text, str, "comma-separated names")


def boundaries_arg(text: str) -> list[int] | str:
    """`32,64,128`, or `auto` (learn them online; strategy adaptive) (an argparse type)."""
    if text.strip().lower() == "auto":
        return "auto"
    return int_list(text)


def add_boundaries_option(p: Any, purpose: str) -> None:
    """`--boundaries B1,B2,...`: bucket upper bounds in tokens, for `purpose` (its help)."""
    p.add_argument("--boundaries", type=int_list, metavar="B1,B2,...", help=purpose)


def add_batching_options(p: argparse.ArgumentParser) -> None:
    """The batching flags that override a config file (strategy is added by each command)."""
    p.add_argument(
        "--boundaries",
        type=boundaries_arg,
        metavar="B1,B2,...",
        help="bucket upper bounds in tokens, e.g. 32,64,128 (default: the "
        "model's default; fit your own with `lenbatch fit`), or 'auto' (adaptive: learn "
        "them from the traffic)",
    )
    p.add_argument("--max-batch", type=int, help="most requests per batch (default 32)")
    p.add_argument(
        "--max-wait-ms", type=float, help="longest wait for a batch to fill, ms (default 10)"
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        help="batch token budget: size x padded length (default 8192)",
    )


def add_quantize_option(p: argparse.ArgumentParser) -> None:
    """`--quantize`: the model's weight quantization, apart from `--dtype`."""
    p.add_argument(
        "--quantize",
        choices=["auto", "none", "int8", "int4"],
        help="weight quantization, apart from --dtype (default auto: the weights as the model "
        "ships them; a float32 causal LM stored as GGUF Q4_1 runs int4, as Q8_0 int8, exactly; "
        "anything else none): causal LMs run int8 or int4 weight-only products at small row "
        "counts (with --dtype float32, int4 runs a Q4_1 GGUF's own weights exactly); encoders "
        "run int8 (int8 weights per channel and activations per token, float32 around them; "
        "--dtype float32 or auto). A runner that does not implement the one asked for refuses "
        "to start",
    )


def add_adaptive_options(p: argparse.ArgumentParser) -> None:
    """The `[adaptive]` flags (strategy adaptive) that override a config file."""
    g = p.add_argument_group("strategy adaptive")
    g.add_argument(
        "--slo-ms",
        type=float,
        metavar="MS",
        help="SLO, arrival to answer (default: 4x the predicted time of the longest input "
        "alone, at least 100 ms; X-Request-Timeout overrides it per call); for a causal LM, "
        "arrival to first token (default 1000)",
    )
    g.add_argument(
        "--itl-slo-ms",
        type=float,
        metavar="MS",
        help="causal LMs: mean inter-token latency objective (default 150; --slo-ms is then "
        "the time to first token, default 1000)",
    )
    g.add_argument(
        "--shed",
        choices=["429", "503", "late"],
        help="a request predicted to miss its deadline: 429 or 503 at once with Retry-After, "
        "or serve it late (default 429)",
    )
    g.add_argument(
        "--priority-levels",
        type=int,
        metavar="N",
        help="strict priority levels 0..N-1 (the `priority` field / X-Priority header; default 1)",
    )
    g.add_argument("--no-late-binding", action="store_true", help="never wait to fill")
    g.add_argument("--no-merge", action="store_true", help="never top up from shorter lanes")
    g.add_argument(
        "--refit",
        action="store_true",
        help="re-fit the boundaries online when the lengths drift",
    )


def adaptive_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `adaptive` section of settings overrides from `add_adaptive_options`' flags."""
    return {
        "slo_ms": args.slo_ms,
        "itl_slo_ms": getattr(args, "itl_slo_ms", None),
        "shed": args.shed,
        "priority_levels": args.priority_levels,
        "late_binding": False if args.no_late_binding else None,
        "merge": False if args.no_merge else None,
        "refit": True if args.refit else None,
    }


def batching_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `batching` section of settings overrides from the flags `add_batching_options`
    added (None values leave the config file and environment in force)."""
    return {
        "boundaries": args.boundaries,
        "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms,
        "max_batch_tokens": args.max_batch_tokens,
    }


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def add_trace_options(p: argparse.ArgumentParser, *, optional_trace: bool = False) -> None:
    """Add TRACE and the explicit mapping options (applied in this order: window, length
    scale, max length, rate scale, limit). `optional_trace` lets a command take its traffic
    from elsewhere (replay and bench: `--scenario`)."""
    p.add_argument(
        "trace",
        metavar="TRACE",
        nargs="?" if optional_trace else None,
        default=None,
        help="trace file (Azure CSV, Mooncake JSONL, ShareGPT CSV, a `serve --length-log` "
        "file, or any CSV/JSONL with --length-column), or a bundled trace: azure-conv, "
        "mooncake, sharegpt",
    )
    c = p.add_argument_group("trace columns (for a generic CSV/JSONL)")
    c.add_argument(
        "--format",
        dest="trace_format",
        choices=TRACE_FORMATS,
        default=None,
        help="trace format (default: detected from the first line)",
    )
    c.add_argument("--length-column", metavar="NAME", help="column with input token counts")
    c.add_argument(
        "--arrival-column",
        metavar="NAME",
        help="column with arrival times (numbers in --time-unit, or ISO date-times)",
    )
    c.add_argument("--output-column", metavar="NAME", help="column with output token counts")
    c.add_argument(
        "--time-unit",
        choices=sorted(_TIME_UNITS),
        default="s",
        help="unit of numeric arrival times (default s)",
    )
    g = p.add_argument_group("trace mapping (reported with the results)")
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply input lengths by X (map an LLM trace onto a small model)",
    )
    g.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="model limit N: longer inputs are handled by --overflow",
    )
    g.add_argument(
        "--overflow",
        choices=["clip", "drop", "keep"],
        default="clip",
        help="inputs over --max-length: clip to N (they land in the top lane), "
        "drop them, or keep them (to test rejection) (default clip)",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="Y",
        help="multiply the arrival rate by Y (timestamps divided by Y)",
    )
    g.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="K",
        help="use only the first K requests (after the window)",
    )
    g.add_argument(
        "--start",
        type=float,
        default=None,
        metavar="S",
        help="window start, seconds from the trace's first request",
    )
    g.add_argument(
        "--end",
        type=float,
        default=None,
        metavar="S",
        help="window end, seconds from the trace's first request",
    )


def trace_from_args(args: argparse.Namespace) -> Trace:
    """Load and map the trace the options describe."""
    columns = None
    if args.length_column:
        columns = ColumnMap(
            length=args.length_column,
            arrival=args.arrival_column,
            output=args.output_column,
            time_unit=_TIME_UNITS[args.time_unit],
        )
    elif args.arrival_column or args.output_column:
        raise ValueError("--arrival-column and --output-column need --length-column too")
    trace = load_trace(args.trace, args.trace_format, columns=columns)
    return map_from_args(trace, args)


def map_from_args(trace: Trace, args: argparse.Namespace) -> Trace:
    """`trace` mapped as the options of `add_trace_options` say (window, length scale, max
    length, rate scale, limit)."""
    return map_trace(
        trace,
        length_scale=args.length_scale,
        max_length=args.max_length,
        overflow=args.overflow,
        rate_scale=args.rate_scale,
        limit=args.limit,
        start_s=args.start,
        end_s=args.end,
    )


def load_cost_model(
    spec: str,
    device: str = "cpu",
    *,
    warn: bool = True,
    dtype: str | None = None,
    execution: str | None = None,
    threads: int | None = None,
) -> CostModel:
    """Read the cost model `--cost` names: a JSON file, `auto` (the one measured on this
    processor: the self-calibration cache, then `LENBATCH_COST_DIR`, default the source
    checkout's `bench/results/`; see `lenbatch.plan.costsource`) or a live server's URL
    (strategy adaptive's online fit).
    `threads` is the torch thread count the command runs the model with (part of the key).
    Says on stderr which one was taken and why (with `warn`), and warns when a file was
    measured on another processor than this one, whose latencies it then does not describe."""
    import sys

    from lenbatch.plan.costsource import resolve_cost
    from lenbatch.runners.hardware import processor_key

    here = processor_key(device, threads)
    choice = resolve_cost(spec, here, dtype=dtype, execution=execution)
    if warn:
        if choice.source != spec or not choice.from_file:
            print(f"cost model: {choice.source} ({choice.reason})", file=sys.stderr)
        problem = processor_mismatch(choice.cost, here) if choice.from_file else None
        if problem:
            print(f"warning: {choice.source}: {problem}", file=sys.stderr)
    return choice.cost


def pin_cost_spec(
    spec: str,
    device: str = "cpu",
    *,
    dtype: str | None = None,
    execution: str | None = None,
    threads: int | None = None,
) -> str:
    """`--cost auto` resolved to the file it picks (said on stderr); a path or URL unchanged.
    For commands that read the cost model more than once or name it in a report. `threads`:
    the torch thread count the measured servers run with (default this process's)."""
    import sys

    from lenbatch.plan.costsource import AUTO, choose_auto
    from lenbatch.runners.hardware import processor_key

    if spec.strip().lower() != AUTO:
        return spec
    path, why = choose_auto(processor_key(device, threads), dtype=dtype, execution=execution)
    print(f"cost model: {path} ({why})", file=sys.stderr)
    return str(path)


COST_HELP = (
    "cost model: a JSON file (`lenbatch profile` or `calibrate` output), 'auto' (the one "
    "measured on this processor: same CPU model number, ISA flags and torch threads, from "
    "the user's cache of models `serve` self-calibrated ($XDG_CACHE_HOME/lenbatch or "
    "$LENBATCH_CACHE_DIR), else $LENBATCH_COST_DIR, default the source checkout's "
    "bench/results/; preferring the dtype/execution run and a calibrated one), or a live "
    "server's URL http://HOST:PORT "
    "(strategy adaptive's online-fitted model from /stats)"
)


def add_cost_option(p: Any, purpose: str = "", *, required: bool = False) -> None:
    """`--cost FILE|auto|URL`, its help `purpose` followed by what the three forms mean."""
    p.add_argument("--cost", required=required, metavar="FILE|auto|URL", help=purpose + COST_HELP)


def add_precision_options(p: Any, *, default: str | None = None) -> None:
    """`--dtype` and `--execution`, as `serve` runs the model (`default`: what an absent flag
    gives; None leaves the config file in force)."""
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "auto"],
        default=default,
        help="model float type (default auto: bfloat16 where the hardware runs it natively, "
        "else float32); the start-up log says what was picked and why",
    )
    p.add_argument(
        "--execution",
        choices=["auto", "padded", "packed"],
        default=default,
        help="packed (padding-free: token-wise layers on real tokens only; BERT-family "
        "encoders), padded (each batch padded to its longest member) or auto (the default: "
        "packed where the model supports it, else padded)",
    )
