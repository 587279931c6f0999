"""The `llm-adaptive-goodput` recipe's work: SmolLM2 completions under 2x overload, goodput of
strategy `adaptive` against `continuous` at several running caps (issue 25, item 3).

1. **Capacity**: `continuous` (its default cap) replayed far past saturation (`--overload`,
   a trace-rate multiplier) on the dev trace's completions mapping (`bench/recipes.py`
   `SMOLLM2_TRACE`: input x0.1 <= 400, output x0.25 <= 64, `ignore_eos`); capacity is its
   completions per second (`throughput_rps`).
2. **2x overload**: the rate multiplier whose mean offered rate is `--load` (2) x capacity, from
   the capacity run's offered rate; every target (`continuous` with each `--caps` value as
   `--max-running`, then `adaptive` with `--slo-ms 1000 --itl-slo-ms 150`) replayed there, each
   on its own server, `--repeats` times.
3. **Table** (`summary.md`): per target, goodput (`llm_goodput`: streamed answers with TTFT
   <= 1 s and mean inter-token <= 150 ms, per second; mean and range over repeats), completed,
   refused (429/503), TTFT and inter-token P95, and adaptive's goodput over the best cap's.

Nothing here is timed by itself: it runs `lenbatch serve` + `lenbatch replay` and reads the
summaries `replay --json` wrote.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steps import ROOT, ServeDuring, lenbatch

__all__ = ["LLMGoodputPlan", "llm_goodput_table", "plan_from_args", "run_llm_goodput"]

# The capacity run's server: continuous batching at its default running cap.
CAPACITY_SERVE = ("--strategy", "bucketed", "--decode-mode", "continuous")


@dataclass(frozen=True)
class LLMGoodputPlan:
    """What the recipe runs (from its flags)."""

    out: str
    trace: tuple[str, ...]  # the completions mapping's `replay` options
    tokenizer: str  # what `replay --model` sizes the bodies with
    start: str
    duration: str
    overload: float
    load: float
    caps: tuple[int, ...]
    repeats: int
    adaptive_args: str

    def targets(self) -> list[tuple[str, tuple[str, ...]]]:
        """(label, serve flags) of every target, continuous caps first."""
        out = [(f"continuous-cap{c}", ("--strategy", "bucketed", "--decode-mode", "continuous",
                                       "--max-running", str(c))) for c in self.caps]  # fmt: skip
        out.append(("adaptive", ("--strategy", "adaptive", *self.adaptive_args.split())))
        return out

    def run_at(self, label: str, serve: Sequence[str], rate: str, stem: str) -> ServeDuring:
        """One server (`serve` flags) with one replay at trace-rate multiplier `rate`."""
        cmd = lenbatch("serve", "--model", "smollm2", "--log-level", "warning", *serve)
        replay = lenbatch("replay", *self.trace, "--model", self.tokenizer,
                          "--served-model", "smollm2", "--rate-scale", rate,
                          "--start", self.start, "--duration", self.duration, "--timeout", "120",
                          "--no-progress", "--url", "{url}", "--json", f"{stem}.json")  # fmt: skip
        return ServeDuring(cmd, (replay,), ROOT / f"{stem}.server.log", ROOT / f"{stem}.stats.json")

    def describe(self) -> str:
        """What `--dry-run` prints."""
        cap = self.run_at("capacity", CAPACITY_SERVE, f"{self.overload:g}", f"{self.out}/capacity")
        lines = [cap.describe(), f"# then, at the rate giving {self.load:g}x the capacity run's "
                 f"completions/s, {self.repeats}x each of:"]  # fmt: skip
        for label, serve in self.targets():
            lines.append(self.run_at(label, serve, "RATE", f"{self.out}/{label}-r1").describe())
        lines.append(f"# write {self.out}/summary.md")
        return "\n".join(lines)


def plan_from_args(args: Any, trace: tuple[str, ...], tokenizer: str) -> LLMGoodputPlan:
    """The plan from the recipe's parsed flags."""
    return LLMGoodputPlan(
        out=args.out,
        trace=trace,
        tokenizer=tokenizer,
        start=args.start,
        duration=args.duration,
        overload=float(args.overload),
        load=float(args.load),
        caps=tuple(int(c) for c in args.caps.split(",")),
        repeats=int(args.repeats),
        adaptive_args=args.adaptive_args,
    )


def run_llm_goodput(plan: LLMGoodputPlan, env: dict[str, str]) -> None:
    """Run the recipe's steps (see the module docstring) and write `summary.md`."""
    out = ROOT / plan.out
    out.mkdir(parents=True, exist_ok=True)
    plan.run_at("capacity", CAPACITY_SERVE, f"{plan.overload:g}", f"{plan.out}/capacity").run(env)
    cap = json.loads((out / "capacity.json").read_text(encoding="utf-8"))
    capacity = float(cap["throughput_rps"])
    offered = float(cap["requests"]) / max(float(cap["duration_s"]), 1e-9)
    rate = plan.overload * plan.load * capacity / offered
    meta = {"capacity_rps": capacity, "offered_rps_at_overload": offered, "rate_scale": rate}
    (out / "plan.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    print(f"capacity {capacity:.2f} completions/s: {plan.load:g}x is --rate-scale {rate:.3f}")
    for rep in range(1, plan.repeats + 1):
        for label, serve in plan.targets():
            plan.run_at(label, serve, f"{rate:.4f}", f"{plan.out}/{label}-r{rep}").run(env)
    text = llm_goodput_table(out, [label for label, _ in plan.targets()])
    (out / "summary.md").write_text(text + "\n", encoding="utf-8")
    print(text)


def _cell(v: float | None, fmt: str = ",.0f") -> str:
    return "–" if v is None else format(v, fmt)


def llm_goodput_table(folder: Path, labels: Sequence[str]) -> str:
    """One row per target from `LABEL-rN.json` in `folder`, then adaptive over the best
    `continuous` cap (goodput means)."""
    lines = [
        "| target | goodput /s (mean, range) | completed | refused | TTFT P95 ms | ITL P95 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    means: dict[str, float] = {}
    for label in labels:
        runs = [json.loads(p.read_text(encoding="utf-8"))
                for p in sorted(folder.glob(f"{label}-r*.json"))
                if not p.name.endswith(".stats.json")]  # fmt: skip
        if not runs:
            continue
        good = [float((r.get("llm_goodput") or {}).get("per_s", 0.0)) for r in runs]
        means[label] = statistics.fmean(good)
        done = statistics.fmean(r["completed"] for r in runs)
        refused = statistics.fmean(r.get("rejected", 0) for r in runs)
        ttft = [r["ttft_p95_ms"] for r in runs if r.get("ttft_p95_ms") is not None]
        itl = [r["itl_p95_ms"] for r in runs if r.get("itl_p95_ms") is not None]
        lines.append(
            f"| {label} | {means[label]:.2f} ({min(good):.2f}-{max(good):.2f}) | {done:.0f}/"
            f"{runs[0]['requests']} | {refused:.0f} | "
            f"{_cell(statistics.fmean(ttft) if ttft else None)} | "
            f"{_cell(statistics.fmean(itl) if itl else None)} |"
        )
    best = max((v for k, v in means.items() if k.startswith("continuous")), default=None)
    if best is not None and "adaptive" in means:
        ratio = means["adaptive"] / best if best > 0 else float("inf")
        lines.append("")
        lines.append(f"adaptive / best continuous cap: {ratio:.2f}x (bar: >= 1.5x)")
    return "\n".join(lines)
