"""The benchmark recipes `bench/run.py` runs: one function each, from its flags to its steps.

A recipe builds the command lines that made a committed result (`lenbatch bench`, `lenbatch
replay` or a script of this folder), with that result's settings as its defaults; its flags
change them. Script recipes run `bench/SCRIPT` with the committed result's arguments, or with
the arguments given after `--` instead. bench/README.md says what each one measures.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import goodput
import llm_goodput
import tables
from steps import ROOT, Action, Command, ServeDuring, Step, lenbatch, script

__all__ = ["LOCKED", "RECIPES", "Recipe"]

Build = Callable[[argparse.Namespace], list[Step]]
Options = Callable[[argparse.ArgumentParser], object]

DEV_CONFIG = "configs/minilm-azure-conv.toml"  # `make serve`'s buckets and thread split
COST = "bench/results/cost_minilm_cpu.json"  # the MiniLM profile the committed results used
# The dev trace mapped to MiniLM (docs/traffic.md says why), and to SmolLM2 completions.
MINILM_TRACE = ("azure-conv", "--length-scale", "0.05", "--max-length", "256")
SMOLLM2_TRACE = ("azure-conv", "--endpoint", "completions", "--length-scale", "0.1",
                 "--max-length", "400", "--output-scale", "0.25", "--max-output", "64")  # fmt: skip
LOCKED = "exclusive CPU lock (bench/run.py): no other benchmark during the run"


@dataclass(frozen=True)
class Recipe:
    """A named benchmark: its flags and the function that turns them into steps."""

    name: str
    build: Build
    options: Sequence[Options]
    script: str | None = None  # the bench/ script a script recipe runs
    defaults: tuple[str, ...] = ()  # a script recipe's arguments when none follow `--`

    @property
    def summary(self) -> str:
        """The first line of the build function's docstring."""
        return (self.build.__doc__ or "").strip().splitlines()[0]


RECIPES: dict[str, Recipe] = {}


def recipe(name: str, *options: Options) -> Callable[[Build], Build]:
    """Register the decorated function as recipe `name`, with `options` adding its flags."""

    def register(build: Build) -> Build:
        RECIPES[name] = Recipe(name, build, options)
        return build

    return register


def script_recipe(name: str, file: str, summary: str, *defaults: str) -> None:
    """Register recipe `name`: `python bench/FILE` with `defaults` (the arguments of the
    committed result), or with the arguments after `--` instead."""

    def build(args: argparse.Namespace) -> list[Step]:
        return [script(file, *(args.script_args or defaults))]

    build.__doc__ = summary
    RECIPES[name] = Recipe(name, build, (), script=file, defaults=defaults)


def opt(flag: str, default: str, help: str) -> Options:
    """A flag whose value goes into a command line as text, its help ending with the default."""
    return lambda p: p.add_argument(flag, default=default, help=f"{help} (default {default})")


def out(default: str) -> Options:
    """`--out`: where the recipe writes."""
    return opt("--out", default, "output folder, from the repository root")


def conditions(p: argparse.ArgumentParser) -> None:
    """`--conditions`: the note on the machine's state every `lenbatch bench` report carries."""
    p.add_argument("--conditions", default=LOCKED, help="a note on the conditions, in the report")


def tail(args: argparse.Namespace, title: str, report: str) -> tuple[str, ...]:
    """The arguments every `lenbatch bench` command of a recipe ends with."""
    return ("--no-progress", "--conditions", args.conditions, "--title", title, "--report", report)


def peer_args(peers: str) -> tuple[str, ...]:
    """`--peer P1,P2`, or nothing for `none`."""
    return () if peers in ("", "none") else ("--peer", peers)


def show_table(kind: str, where: str, make: Callable[[], str]) -> Action:
    """Print a table of `bench/tables.py` after the runs (`bench/run.py table KIND WHERE`)."""
    return Action(f"bench/run.py table {kind} {where}", lambda env: print(make()))


# --- embeddings against peers -------------------------------------------------------------


# Issue 23's long-input traffic: the dev trace at twice the MiniLM mapping's lengths (mean
# about 100 tokens, P95 256), close to the reviewers' held-out trace.
LONG_TRACE = ("azure-conv", "--length-scale", "0.1", "--max-length", "256")


@recipe(
    "headline",
    out("bench/results/headline"),
    opt("--traffic", "dev", "dev: the dev trace mapped to MiniLM; long: its long-input form"),
    opt("--sweep", "", "rate multipliers (default: dev 16,32,48,64; long 8,16,32,48.752,97.504)"),
    opt("--strategies", "adaptive,bucketed", "lenbatch strategies"),
    opt("--peers", "vllm-bf16,infinity-bf16", "peers, or 'none' for lenbatch alone"),
    opt("--cost", "auto", "serve's --cost (`make serve`'s: auto, calibrated on this CPU)"),
    conditions,
)
def headline(args: argparse.Namespace) -> list[Step]:
    """The README's headline: lenbatch as `make serve` runs it against vLLM and Infinity,
    the same requests at every rate up to past saturation."""
    peers = peer_args(args.peers)
    long = args.traffic == "long"
    sweep = args.sweep or ("8,16,32,48.752,97.504" if long else "16,32,48,64")
    what = "long-input traffic" if long else "the dev trace"
    title = "Headline: lenbatch (make serve) " + (
        f"against vLLM and Infinity on {what}" if peers else f"on {what}, no peers"
    )
    serve = f"--config {DEV_CONFIG} --slo-ms 1000 --cost {args.cost}"
    cmd = lenbatch("bench", *(LONG_TRACE if long else MINILM_TRACE), "--start", "600",
                   "--span", "120", "--rate-sweep", sweep, "--keep-server",
                   "--serve-args", serve, "--strategies", args.strategies, *peers,
                   *tail(args, title, args.out))  # fmt: skip
    return [cmd]


@recipe(
    "peers",
    out("bench/results/peers"),
    opt("--parts", "emb,llm", "emb: MiniLM against every peer; llm: SmolLM2 completions"),
    opt("--start", "600", "trace window start, seconds"),
    opt("--span", "120", "emb: seconds of trace time replayed at every rate"),
    opt("--sweep", "4,16,32", "emb: rate multipliers"),
    opt("--cost", COST, "emb: cost model of the simulator's predictions and the oracle"),
    opt("--llm-span", "5", "llm: seconds of trace time"),
    opt("--llm-rate", "0.25", "llm: rate multiplier"),
    conditions,
)
def peers(args: argparse.Namespace) -> list[Step]:
    """lenbatch against Infinity, vLLM, llama.cpp and the naive server (peers.md)."""
    steps: list[Step] = []
    for part in args.parts.split(","):
        if part == "emb":
            title = "Dev trace on MiniLM: lenbatch, Infinity, vLLM and the naive server"
            cmd = lenbatch("bench", *MINILM_TRACE, "--start", args.start, "--span", args.span,
                           "--rate-sweep", args.sweep, "--keep-server",
                           "--serve-args", f"--config {DEV_CONFIG}", "--cost", args.cost,
                           "--strategies", "bucketed,fifo",
                           "--peer", "infinity,vllm,vllm-allcores,naive",
                           *tail(args, title, f"{args.out}/embeddings"))  # fmt: skip
        elif part == "llm":
            title = "SmolLM2-135M completions at a fixed load: lenbatch, vLLM, llama.cpp"
            cmd = lenbatch("bench", "azure-conv", "--endpoint", "completions",
                           "--model", "smollm2", "--length-scale", "0.1", "--max-length", "256",
                           "--output-scale", "0.1", "--max-output", "24",
                           "--start", args.start, "--span", args.llm_span,
                           "--rate-scale", args.llm_rate, "--strategies", "bucketed",
                           "--serve-args", "--decode-mode continuous",
                           "--max-batch", "16", "--max-wait-ms", "20",
                           "--peer", "vllm,llamacpp", "--timeout", "120",
                           *tail(args, title, f"{args.out}/completions"))  # fmt: skip
        else:
            raise SystemExit(f"peers: unknown part {part!r}; choose from emb, llm")
        steps.append(cmd)
    return steps


@recipe(
    "replay-dev-trace",
    out("bench/results/replay-dev-trace"),
    opt("--rate", "3.5", "rate multiplier: above fifo's capacity, below bucketed's"),
    opt("--duration", "60", "seconds of (scaled) traffic per run"),
    opt("--start", "600", "trace window start, seconds"),
    opt("--sweep", "0.3,1", "fractions of --rate"),
    opt("--cost", COST, "cost model of the simulator's predictions"),
    conditions,
)
def replay_dev_trace(args: argparse.Namespace) -> list[Step]:
    """Every strategy, the naive and Ray peers, and the simulator's prediction (docs/replay.md)."""
    title = "Dev trace on MiniLM: every strategy and two peers in one run"
    cmd = lenbatch("bench", *MINILM_TRACE, "--rate-scale", args.rate, "--start", args.start,
                   "--duration", args.duration, "--rate-sweep", args.sweep,
                   "--strategies", "static,fifo,sorted,bucketed", "--peer", "naive,ray",
                   "--serve-args", f"--config {DEV_CONFIG}", "--cost", args.cost,
                   *tail(args, title, args.out))  # fmt: skip
    return [cmd]


@recipe(
    "ray-scaleout",
    out("bench/results/ray-scaleout"),
    opt("--rate", "1", "rate multiplier of the trace"),
    opt("--sweep", "3,5,7", "multipliers of --rate"),
    opt("--duration", "120", "seconds of trace at x1 (~550 requests), replayed at each rate"),
    opt("--start", "600", "trace window start, seconds"),
    opt("--config", DEV_CONFIG, "config of every server (the Ray peers read LENBATCH_CONFIG)"),
    conditions,
)
def ray_scaleout(args: argparse.Namespace) -> list[Step]:
    """lenbatch on Ray Serve, length-aware and default routing, vs one server (ray_scaleout.md)."""
    title = "lenbatch on Ray Serve: 2 replicas, length-aware vs default routing, vs one server"
    # Ray starts its workers at nice 15 by default; at 0 like the single server, a niced
    # background job takes CPU from both sides alike.
    env = {"LENBATCH_CONFIG": args.config, "RAY_worker_niceness": "0"}
    cmd = lenbatch("bench", *MINILM_TRACE, "--rate-scale", args.rate, "--start", args.start,
                   "--duration", args.duration, "--rate-sweep", args.sweep,
                   "--strategies", "bucketed", "--peer", "ray-lenbatch,ray-lenbatch-p2c",
                   "--serve-args", f"--config {args.config}", *tail(args, title, args.out),
                   env=env)  # fmt: skip
    table = show_table(
        "ray-scaleout", args.out, lambda: tables.ray_scaleout_table([ROOT / args.out])
    )
    return [cmd, table]


# --- strategy adaptive, live --------------------------------------------------------------

# The best fixed bucketed config the simulator's grid found per scenario (bench/adaptive_sim.py),
# as (max wait ms, max batch): what the `-best` reports serve.
BEST_FIXED = {"onoff": (5.0, 16), "drift": (0.0, 8)}
# (report, scenario, reference rate, strategies, peers)
AdaptiveRuns = Sequence[tuple[str, str, float, str, str]]
ADAPTIVE_LIVE: AdaptiveRuns = (
    ("onoff", "onoff", 20.0, "fifo,bucketed,adaptive", "naive"),
    ("onoff-best", "onoff", 20.0, "bucketed", ""),
    ("drift", "drift", 20.0, "fifo,bucketed,adaptive", "naive"),
    ("drift-best", "drift", 20.0, "bucketed", ""),
    ("mixed", "mixed", 10.0, "bucketed,adaptive", ""),
)


def adaptive_steps(args: argparse.Namespace, runs: AdaptiveRuns) -> list[Step]:
    """One `lenbatch bench --scenario` per run (1 s SLO, the MiniLM cost model), then the
    goodput table with the simulator's predictions."""
    steps: list[Step] = []
    reports = []
    for report, scenario, rate, strategies, peers in runs:
        serve = f"--slo-ms 1000 --cost {COST}"
        best = BEST_FIXED[scenario] if report.endswith("-best") else None
        if best is not None:
            serve += f" --max-batch {best[1]} --max-wait-ms {best[0]:g}"
        folder = f"{args.out}/{report}"
        cmd = lenbatch("bench", "--scenario", scenario, "--rate", f"{rate:g}",
                       "--duration", args.duration, "--max-length", "256", "--clients", "16",
                       "--strategies", strategies, *peer_args(peers), "--serve-args", serve,
                       "--no-progress", "--conditions", args.conditions,
                       "--report", folder)  # fmt: skip
        steps.append(cmd)
        run = tables.AdaptiveRun(scenario, rate, float(args.duration), ROOT / folder, best)
        reports.append(run)
    specs = " ".join(r.spec() for r in reports)
    steps.append(
        show_table(
            "adaptive-live", specs, lambda: tables.adaptive_live_table(reports, ROOT / COST, 1e3)
        )
    )
    return steps


@recipe(
    "adaptive-live",
    out("bench/results/adaptive-live"),
    opt("--duration", "25", "seconds of each scenario"),
    conditions,
)
def adaptive_live(args: argparse.Namespace) -> list[Step]:
    """adaptive against fifo, bucketed, the best fixed config and naive, live (adaptive.md)."""
    return adaptive_steps(args, ADAPTIVE_LIVE)


@recipe(
    "adaptive-overload",
    out("bench/results/adaptive-live"),
    opt("--rate", "50", "reference rate, req/s: past this CPU's capacity"),
    opt("--duration", "25", "seconds of each scenario"),
    conditions,
)
def adaptive_overload(args: argparse.Namespace) -> list[Step]:
    """adaptive against bucketed and naive past the CPU's capacity, live (adaptive.md)."""
    rate = float(args.rate)
    runs = [(f"overload-{s}", s, rate, "bucketed,adaptive", "naive") for s in ("onoff", "drift")]
    return adaptive_steps(args, runs)


def goodput_options(
    folder: str, span: str, loads: str, strategies: str, repeats: str
) -> tuple[Options, ...]:
    """The flags of the `adaptive-goodput` recipes (`bench/goodput.py`), with these defaults."""
    return (
        out(folder),
        opt("--start", "600", "dev trace window start, seconds"),
        opt("--span", span, "seconds of trace time: the same requests at every rate"),
        opt("--loads", loads, "mean rates as multiples of the measured capacity"),
        opt("--strategies", strategies, "lenbatch strategies"),
        opt("--peers", "none", "peers as well (e.g. vllm-bf16), or 'none'"),
        opt("--repeats", repeats, "replays of every rate (and of the bursts scenario)"),
        opt("--overload", "40", "trace-rate multiplier of the capacity run, far past saturation"),
        opt("--bursts-load", "0.5", "the bursts scenario's mean rate, as a multiple of capacity"),
        opt("--bursts-duration", "25", "seconds of the bursts scenario"),
        lambda p: p.add_argument(
            "--table-only",
            metavar="NAME",
            help="run nothing: rebuild the table from the runs already in --out, the "
            "predictions by this tree's simulator, into the file NAME inside --out",
        ),
        opt(
            "--calibrated",
            "calibrated_cost.json",
            "with --table-only: the calibrated cost model in the first repeat's folder (one "
            "`lenbatch calibrate --out` wrote from its runs with this tree)",
        ),
        conditions,
    )


def goodput_steps(args: argparse.Namespace) -> list[Step]:
    """The steps of the `adaptive-goodput` recipes: the runs and their table, or the table."""
    plan = goodput.plan_from_args(args)
    if args.table_only:
        name = args.table_only
        cal = args.calibrated
        return [Action(f"table of {plan.out} into {name} (calibrated: {cal})",
                       lambda env: goodput.write_table(plan, name, cal))]  # fmt: skip
    return [Action(plan.describe(), lambda env: goodput.run_goodput(plan, env))]


@recipe(
    "adaptive-goodput",
    *goodput_options(
        "bench/results/adaptive-goodput", "120", "0.2,0.5,0.8,1.5,3", "adaptive,bucketed,fifo", "3"
    ),
)
def adaptive_goodput(args: argparse.Namespace) -> list[Step]:
    """adaptive vs bucketed vs fifo at 0.2-3x measured capacity, live beside simulate (issue 24)."""
    return goodput_steps(args)


@recipe(
    "adaptive-sustained",
    *goodput_options("bench/results/adaptive-sustained", "600", "2,3,4", "adaptive,bucketed", "1"),
)
def adaptive_sustained(args: argparse.Namespace) -> list[Step]:
    """adaptive vs bucketed at 2-4x capacity for 15-30 s each: overload that lasts (issue 24)."""
    return goodput_steps(args)


# --- causal-LM decoding -------------------------------------------------------------------


@recipe(
    "llm-decode-peers",
    out("bench/results/llm-decode-peers"),
    opt("--span", "30", "seconds of trace time from t=600 s"),
    opt("--sweep", "0.15,0.3", "rate multipliers: a light load and one near capacity"),
    opt("--peers", "vllm-allcores,llamacpp", "peers, or 'none'"),
    conditions,
)
def llm_decode_peers(args: argparse.Namespace) -> list[Step]:
    """SmolLM2-135M completions: lenbatch, vLLM and llama.cpp in one run (llm_decode_cpu.md)."""
    title = "SmolLM2-135M completions, the decode mapping: lenbatch, vLLM and llama.cpp"
    cmd = lenbatch("bench", *SMOLLM2_TRACE, "--model", "smollm2", "--start", "600",
                   "--span", args.span, "--rate-sweep", args.sweep, "--keep-server",
                   "--strategies", "bucketed", *peer_args(args.peers), "--timeout", "120",
                   *tail(args, title, args.out))  # fmt: skip
    return [cmd]


def tokenizer_folder(model: str) -> tuple[str, list[Step]]:
    """What `lenbatch replay --model` sizes the bodies with, and the step that makes it: for
    SmolLM2, which ships as GGUF only, its tokenizer saved as a folder (once)."""
    folder = "out/smollm2-tokenizer"
    if model != "smollm2" or (ROOT / folder / "config.json").exists():
        return (model if model != "smollm2" else folder), []
    code = (
        "from transformers import AutoConfig, AutoTokenizer\n"
        "from lenbatch.runners.causal import SMOLLM2_GGUF as G, smollm2_folder as f\n"
        f"AutoTokenizer.from_pretrained(f(), gguf_file=G).save_pretrained({folder!r})\n"
        f"AutoConfig.from_pretrained(f(), gguf_file=G).save_pretrained({folder!r})"
    )
    return folder, [Command("python", ("-c", code))]


@recipe(
    "llm-decode-replay",
    out("bench/results/llm-decode-replay"),
    opt("--model", "smollm2", "served model"),
    opt("--duration", "60", "seconds of traffic from t=600 s"),
    lambda p: p.add_argument(
        "--serve-src",
        metavar="DIR",
        help="the servers (not the driver) run the lenbatch of this src folder: a 'before' tree",
    ),
    lambda p: p.add_argument("rate", help="rate multiplier of the trace, e.g. 0.3"),
    lambda p: p.add_argument(
        "labels", nargs="+", metavar="LABEL[:SERVE_ARGS]", help="one server per label"
    ),
)
def llm_decode_replay(args: argparse.Namespace) -> list[Step]:
    """SmolLM2-135M completions replayed against one server per label (llm_decode_cpu.md)."""
    tok, steps = tokenizer_folder(args.model)
    made = []
    for spec in args.labels:
        label, _, serve_args = spec.partition(":")
        stem = f"{args.out}/{label}-x{args.rate}"
        serve_env = {"PYTHONPATH": str(Path(args.serve_src).resolve())} if args.serve_src else None
        serve = lenbatch("serve", "--model", args.model, "--log-level", "warning",
                         *shlex.split(serve_args), env=serve_env)  # fmt: skip
        replay = lenbatch("replay", *SMOLLM2_TRACE, "--model", tok, "--served-model", args.model,
                          "--rate-scale", args.rate, "--start", "600", "--duration", args.duration,
                          "--timeout", "120", "--no-progress", "--url", "{url}",
                          "--json", f"{stem}.json")  # fmt: skip
        log, stats = ROOT / f"{stem}.server.log", ROOT / f"{stem}.stats.json"
        steps.append(ServeDuring(serve, (replay,), log, stats))
        made.append(ROOT / f"{stem}.json")
    # `--out` may lie outside the checkout (a scratch folder): name those files in full
    where = " ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in made)
    steps.append(show_table("llm-decode", where, lambda: tables.llm_decode_table(made)))
    return steps


@recipe(
    "llm-adaptive-goodput",
    out("bench/results/llm-adaptive-goodput"),
    opt("--start", "600", "dev trace window start, seconds"),
    opt("--duration", "60", "seconds of trace time: the same requests for every target"),
    opt("--overload", "1.5", "trace-rate multiplier of the capacity run, past saturation"),
    opt("--load", "2", "mean offered rate of the comparison, as a multiple of capacity"),
    opt("--caps", "4,8,16,32", "continuous's running caps (--max-running) to compare"),
    opt("--repeats", "2", "replays of every target"),
    opt("--adaptive-args", "--slo-ms 1000 --itl-slo-ms 150", "adaptive's serve flags"),
)
def llm_adaptive_goodput(args: argparse.Namespace) -> list[Step]:
    """SmolLM2 completions at 2x capacity: adaptive vs continuous at several caps (issue 25)."""
    tok, steps = tokenizer_folder("smollm2")
    plan = llm_goodput.plan_from_args(args, SMOLLM2_TRACE, tok)
    return [*steps, Action(plan.describe(), lambda env: llm_goodput.run_llm_goodput(plan, env))]


# --- runners: dtype, packing, threads, live -----------------------------------------------

# One torch thread and two batches in flight (the split `make serve` runs).
SPLIT = {"LENBATCH_MODEL__TORCH_THREADS": "1", "LENBATCH_BATCHING__MAX_CONCURRENT_BATCHES": "2"}
RUNNERS_TARGETS = "light,fp32-padded,naive,bf16-padded,bf16-packed,bf16-packed-split"


@recipe(
    "runners-live",
    out("bench/results/runners-live"),
    opt("--targets", RUNNERS_TARGETS, "targets; also before, saturation, saturation-split"),
    opt("--duration", "20", "light load: seconds of traffic at x1.5"),
    opt("--load-duration", "12", "load: seconds of traffic at the target's highest rate"),
    opt("--sat-duration", "10", "saturation: seconds of traffic at x28"),
    opt("--start", "600", "trace window start, seconds"),
    opt("--cost", COST, "cost model of the fp32 light run's predictions"),
    conditions,
)
def runners_live(args: argparse.Namespace) -> list[Step]:
    """bucketed in fp32/bf16, padded/packed, and naive, light to saturation (runners_cpu.md)."""

    def bench(name: str, sweep: str, *more: str, env: dict[str, str] | None = None) -> Command:
        title, report = f"Dev trace on MiniLM: {name}", f"{args.out}/{name}"
        return lenbatch("bench", *MINILM_TRACE, "--start", args.start, "--rate-sweep", sweep,
                        *more, *tail(args, title, report), env=env)  # fmt: skip

    def bucketed(dtype: str = "", execution: str = "") -> tuple[str, ...]:
        flags = f"--config {DEV_CONFIG}"
        if dtype:
            flags += f" --dtype {dtype} --execution {execution}"
        return ("--strategies", "bucketed", "--serve-args", flags)

    cost = ("--cost", args.cost)
    naive = ("--strategies", "", "--peer", "naive")
    # Light load: the first --duration s at x1.5. Load: the first --load-duration s at the
    # target's highest rate, replayed at fractions of it (the same requests at every point).
    light = ("--rate-scale", "1.5", "--duration", args.duration)
    saturate = ("--rate-scale", "28", "--duration", args.sat_duration)

    def load(top: str) -> tuple[str, ...]:
        return ("--rate-scale", top, "--duration", args.load_duration)

    bf16_packed = bucketed("bfloat16", "packed")
    split = "saturation/bfloat16-packed-1thread-2batches"
    split_bf16_packed = bench(split, "1", *saturate, *bf16_packed, env=SPLIT)
    by_target: dict[str, list[Step]] = {
        # a tree older than --dtype/--execution, run with --rev (e.g. 427fde8)
        "before": [bench("light/before", "1", *light, *bucketed(), *cost, "--peer", "")],
        "light": [
            bench("light/fp32-padded", "1", *light, *bucketed("float32", "padded"), *cost),
            bench("light/naive", "1", *light, *naive),
            bench("light/bf16-padded", "1", *light, *bucketed("bfloat16", "padded")),
            bench("light/bf16-packed", "1", *light, *bucketed("bfloat16", "packed")),
        ],
        "fp32-padded": [
            bench("load/fp32-padded", "0.714,1", *load("7"), *bucketed("float32", "padded"))
        ],
        "naive": [bench("load/naive", "0.7,1", *load("5"), *naive)],
        "bf16-padded": [
            bench("load/bf16-padded", "0.5,0.714,1", *load("14"), *bucketed("bfloat16", "padded"))
        ],
        "bf16-packed": [
            bench("load/bf16-packed", "0.5,0.714,1", *load("14"), *bucketed("bfloat16", "packed"))
        ],
        "bf16-packed-split": [
            bench("load/bf16-packed-split", "1", *load("14"), *bf16_packed, env=SPLIT)
        ],
        "saturation": [
            *(
                bench(f"saturation/{d}-{e}", "1", *saturate, *bucketed(d, e))
                for d, e in (("float32", "padded"), ("bfloat16", "padded"), ("bfloat16", "packed"))
            ),
            split_bf16_packed,
        ],
        "saturation-split": [split_bf16_packed],
    }
    steps: list[Step] = []
    for target in args.targets.split(","):
        if target not in by_target:
            known = ", ".join(by_target)
            raise SystemExit(f"runners-live: unknown target {target!r}; choose from {known}")
        steps += by_target[target]
    table = show_table("runners-live", args.out, lambda: tables.runners_live_table(ROOT / args.out))
    return [*steps, table]


# --- scripts ------------------------------------------------------------------------------

script_recipe(
    "profile-minilm", "profile_minilm.py",
    "MiniLM latency and memory over batch x length, and its cost model (profile_minilm_cpu.md).",
    "--conditions", LOCKED,
)  # fmt: skip
script_recipe(
    "waterfall", "waterfall.py",
    "Where tok/s go: GEMMs, eager, runner, engine, server, replay, and why (waterfall.md).",
    "--span", "300", "--conditions", LOCKED, "--out", "bench/results/waterfall.md",
)  # fmt: skip
script_recipe(
    "request-cost", "request_cost.py",
    "CPU per one-input request: event loop, all threads, outside the forward (capacity.md).",
    "--requests", "300",
)  # fmt: skip
script_recipe(
    "request-cost-ab", "request_cost_ab.py",
    "CPU per one-input request, this tree against --against SRC: both servers up, blocks "
    "alternated, paired ratios (request_cost.md).",
    "--blocks", "16",
)  # fmt: skip
script_recipe(
    "hot-route", "hot_route.py",
    "The hot /v1/embeddings route against FastAPI's: loop CPU per call, A/B (request_cost.md).",
    "--blocks", "30",
)  # fmt: skip
script_recipe(
    "packed-attention", "packed_attention.py",
    "The packed encoder's attention, C++ op vs torch's, per bucket and whole forward, A/B "
    "(packed_attention.md).",
    "--rounds", "4",
)  # fmt: skip
script_recipe(
    "decode-attention", "decode_attention.py",
    "A decode step's attention over the running batch's cache, lenbatch's op vs torch's SDPA, "
    "float32, each layer its own cache, alternated (zen3-model1/decode-attention-avx2.md).",
    "--rounds", "5",
)  # fmt: skip
script_recipe(
    "prompt-attention", "prompt_attention.py",
    "A causal LM's whole-prompt attention, the AVX2 build's loop vs torch's SDPA, float32, "
    "alternated (zen3-model1/prompt-attention-avx2.md).",
    "--rounds", "7",
)  # fmt: skip
script_recipe(
    "bursts-drain", "bursts_drain.py",
    "adaptive's predicted drain of each burst's queue against the batch log's, offline "
    "(adaptive-goodput/bursts-drain.md).",
    "--profile", "bench/results/adaptive-goodput/bursts-drain/profile.json",
    "bench/results/adaptive-goodput/bursts-drain/b183.log",
    "bench/results/adaptive-goodput/bursts-drain/d183.log",
    "bench/results/adaptive-goodput/bursts-drain/b230.log",
)  # fmt: skip
script_recipe(
    "memory-growth", "memory_growth.py",
    "RSS of the runner over batches of varied shapes, in-process (capacity.md).",
    "--batches", "400",
)  # fmt: skip
script_recipe(
    "runners", "bench_runners.py",
    "MiniLM forward per dtype and backend, padded and packed, side by side (runners_cpu.md).",
    "--options", "fp32,bf16-cast,bf16-autocast,compile-fp32,compile-bf16,packed-fp32,packed-bf16",
)  # fmt: skip
script_recipe(
    "scheduler", "bench_scheduler.py",
    "Cost of the pure scheduler per request, streaming and backlogged (scheduler.md).",
    "--requests", "20000", "--runs", "7",
)  # fmt: skip
script_recipe(
    "sim-speed", "bench_sim_speed.py",
    "Requests per second of wall time the simulator replays (sim_speed.md).",
    "--repeat", "5", "--runs", "3", "--slices", "100",
)  # fmt: skip
script_recipe(
    "adaptive-sim", "adaptive_sim.py",
    "Simulated scenarios: adaptive against fifo, bucketed, the best fixed one (adaptive_sim.md).",
    "--rate", "20", "--duration", "120", "--scenarios", "mixed,swing,onoff,drift,bimodal,bursts",
    "--out", "bench/results/adaptive_sim.md",
)  # fmt: skip
script_recipe(
    "ray-overhead", "ray_overhead.py",
    "Ray's cost per request and in memory: one server against the Ray app (ray_scaleout.md).",
    "--n", "300",
)  # fmt: skip
script_recipe(
    "soak", "soak.py",
    "The dev trace against one server for a long time, watching its memory (soak.md).",
    "--minutes", "10", "--rate-scale", "2.3", "--out", "bench/results/soak.md",
)  # fmt: skip
script_recipe(
    "fuzz", "fuzz_openapi.py",
    "Schemathesis against a live server; --llm: the generation routes (fuzz_openapi*.md).",
    "--examples", "1000", "--seed", "1", "--out", "bench/results/fuzz_openapi.md",
)  # fmt: skip
script_recipe(
    "profile-decode", "profile_decode.py",
    "Where a decode step's time goes: forward, cache, sampling, Python (llm_decode_cpu.md).",
    "--rows", "16", "--prompt-len", "160", "--steps", "48",
)  # fmt: skip
script_recipe(
    "compile-probe", "compile_probe.py",
    "torch.compile of the static decode shapes: compile time vs step time (llm_decode_cpu.md).",
    "--rows", "16", "--window", "200", "--width", "256",
)  # fmt: skip
script_recipe(
    "rerank", "rerank.py",
    "Rerank 1 query x 20-100 documents: lenbatch, one padded batch per call, Infinity, vLLM; "
    "two models in one process (rerank.md).",
    "--parts", "rerank,two-models", "--rates", "0.25,0.5,1,2", "--duration", "60",
    "--out", "bench/results/rerank",
)  # fmt: skip
script_recipe(
    "two-models", "rerank.py",
    "MiniLM + a cross-encoder in one process: embedding P95 under a rerank load over without "
    "it, embedding capacity beside the reranker over alone (two-models/report.md).",
    "--parts", "two-models", "--duration", "60", "--out", "bench/results/two-models",
)  # fmt: skip
script_recipe(
    "llm-decode-step", "llm_decode_step.py",
    "One decode step per runner option at 1/8/32 rows x 310 columns (llm_decode_step.md).",
    "--rows", "1,8,32", "--cols", "310", "--steps", "30",
    "--out", "bench/results/llm_decode_step.md",
)  # fmt: skip
script_recipe(
    "llm-decode-split", "llm_decode_step.py",
    "One decode step of lean bf16 split by C++ op and product at 1/8/32 rows x 310 columns "
    "(llm_decode_split.md).",
    "--configs", "lean-bf16", "--rows", "1,8,32", "--cols", "310", "--steps", "20", "--split",
    "--out", "bench/results/llm_decode_split.md",
)  # fmt: skip
script_recipe(
    "llm-mixed-step", "llm_decode_step.py",
    "A decode step and a prompt chunk apart and in one forward, lean bf16 (llm_mixed_step.md).",
    "--configs", "lean-bf16", "--rows", "8,24,32", "--cols", "290", "--steps", "15",
    "--mixed", "1x64,1x135,2x135", "--out", "bench/results/llm_mixed_step.md",
)  # fmt: skip
script_recipe(
    "llm-logprobs-vllm", "llm_logprobs_vllm.py",
    "Log-probabilities of greedy completions and of echoed prompts, lenbatch against vLLM "
    "CPU float32 on the same GSM8K prompts (zen3-model1/logprobs-vllm.md).",
    "--prompts", "24", "--tokens", "16",
)  # fmt: skip
script_recipe(
    "llm-structured-vllm", "llm_structured_vllm.py",
    "Structured outputs (a JSON schema, a choice, a regex, tool calls) and free chat, lenbatch "
    "against vLLM CPU float32 on the same GSM8K prompts (zen3-model1/structured-vllm.md).",
    "--prompts", "16",
)  # fmt: skip
script_recipe(
    "llm-prefix-vllm", "llm_prefix_vllm.py",
    "Chats sharing a long few-shot system prompt: lenbatch with and without its prefix cache "
    "against vLLM CPU float32 (prefix caching on), TTFT in sequence and in a burst "
    "(zen3-model1/prefix-vllm.md).",
    "--questions", "16", "--shots", "8",
)  # fmt: skip
script_recipe(
    "llm-padded-prefill", "llm_padded_prefill.py",
    "A left-padded prefill job's forward, its padding left out of the products against run "
    "through them, lean float32 int4 (zen3-model1/padded-prefill.md).",
    "--config", "lean-fp32-int4", "--jobs", "127,101,88,72", "255,190", "400,330", "120,40",
    "--repeats", "9", "--out", "bench/results/zen3-model1/padded-prefill.md",
)  # fmt: skip
script_recipe(
    "omp-pools", "omp_pools.py",
    "Small parallel ops on the thread that started OpenMP's first pool vs a second thread "
    "(omp_pools.md).",
    "--threads", "2", "--repeats", "20", "--rounds", "2", "--out", "bench/results/omp_pools.md",
)  # fmt: skip
script_recipe(
    "bf16-agreement", "llm_bf16_agreement.py",
    "Batched greedy decoding in bf16 against fp32 generate() (llm_bf16_agreement.md).",
    "--model", "smollm2", "--prompts", "24", "--max-new", "32", "--dtype", "bfloat16",
    "--out", "bench/results/llm_bf16_agreement.md",
)  # fmt: skip
script_recipe(
    "rounding-sources", "llm_rounding_sources.py",
    "Which bfloat16 rounding costs greedy agreement, simulated in float32 "
    "(zen3-model1/bf16-rounding-sources.md).",
    "--prompts", "64", "--max-new", "32", "base", "w", "wi", "wio", "wion", "r", "no", "wionr",
)  # fmt: skip
script_recipe(
    "int8-activations", "llm_int8_activations.py",
    "What int8 weights and activations cost SmolLM2's greedy tokens, teacher-forced "
    "(zen3-model1/llm-int8-activations/).",
    "--prompts", "64", "--max-new", "32", "base", "bf16", "w8", "w7", "a8", "a8-keep4",
    "a8-keep16", "a8-block", "onednn", "onednn:qkv", "onednn:o", "onednn:gate_up", "onednn:down",
)  # fmt: skip
script_recipe(
    "one-call-ab", "llm_one_call_ab.py",
    "A decode step's layers in one C++ call against op by op, alternated "
    "(zen3-model1/one-call-f32-ab.md).",
    "--dtype", "float32", "--quantize", "int4",
)  # fmt: skip
