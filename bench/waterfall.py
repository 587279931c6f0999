#!/usr/bin/env python3
"""Where the machine's tokens/s go between the matrix products and the HTTP answer.

    bench/run.py waterfall                                   # the committed settings
    bench/run.py --dry-run waterfall
    bench/run.py waterfall -- --span 10 --steps gemm,eager,runner --out /tmp/w.md  # tiny

One table, one row per step, each the same requests (the dev trace mapped to MiniLM, a window
of `--span` s of trace time) pushed through one more layer of the stack:

1. `gemm`: the model's linear layers alone (Q/K/V, attention output, feed-forward up and down,
   every layer), `F.linear` on the batches' packed token counts: the arithmetic limit;
2. `eager`: Hugging Face's forward (`AutoModel`) on the same batches, padded to each batch's
   longest row;
3. `padded` / `packed`: lenbatch's runner (`EncoderRunner.embed`, `PackedEncoderRunner.
   embed_packed`) on the same batches, pooling and the numpy answer included; per bucket too;
4. `engine`: the `Engine` in this process, no HTTP: every text submitted at once (past
   saturation), tokenized, scheduled, batched and answered through the ledger;
5. `server`: `lenbatch serve` with the same config over loopback, fed past saturation by a
   minimal keep-alive client (hand-written HTTP/1.1, `--connections` at a time);
6. `replay`: the same server fed by lenbatch's replay driver (aiohttp, open loop), the driver on
   the same cores, past saturation: the trace's arrivals compressed to offer `--overload` times
   the rate the `server` step completed (without that step: `--rate-scale` times the trace's
   rate); the row says whether the server completed under 0.9 of what it was offered.

Batches are formed as the bucketed scheduler forms them when its queues are full: by bucket
(the config's boundaries), in arrival order, `max_batch` rows and `max_batch_tokens` padded
tokens at most. Every in-process step runs the served thread layout: `max_concurrent_batches`
worker threads of `torch_threads` each. tok/s counts real input tokens only.

The causes: each step records CPU seconds per thread (/proc), split into the event loop, the
runner threads and the rest; in the runner threads, the forward pass's wall time against its
CPU time (`wall/cpu` above 1 is time the forward waited: the GIL or the other thread on a
shared core); the server steps the server's threads and the client's CPU; with `--py-spy`, a
py-spy profile of the server during the `server` step (its top functions, if py-spy is
installed). The report carries the command, the processor key and the load average.

`--quantize int8` runs every step in int8 as `serve --quantize int8` does: `gemm` times
lenbatch's int8 product (`Int8Linear`, its activation and output passes included), `eager`
Hugging Face's forward with its linears replaced by those, the runners and the server with
`quantization int8`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

STEPS = ("gemm", "eager", "padded", "packed", "engine", "server", "replay")
DEV_CONFIG = "configs/minilm-azure-conv.toml"
SATURATED = 0.9  # past saturation once the server completes under this share of the offer
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ /proc per-thread CPU


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of process `pid`, by thread id, with its
    name (`comm`)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[int(t)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[int, tuple[str, float]]:
    """Per-thread CPU seconds spent between two `thread_cpu` readings."""
    return {
        tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()
    }


@dataclass
class Cpu:
    """CPU seconds of one step, split by role."""

    loop: float = 0.0  # the event loop's thread (the main thread)
    runner: float = 0.0  # the threads that run the model
    other: float = 0.0  # tokenizer workers, OpenMP, HTTP client, ...
    client: float = 0.0  # the load generator (server steps)

    def text(self, wall: float, tokens: int) -> str:
        """`role cores (ms per 1k tokens)` for each role that used CPU."""
        parts = []
        for role in ("loop", "runner", "other", "client"):
            s = getattr(self, role)
            if s > 0.005:
                parts.append(
                    f"{role} {s / wall:.2f} cores ({1e6 * s / max(tokens, 1):.0f} ms/ktok)"
                )
        return "; ".join(parts)


@dataclass
class Row:
    """One step of the waterfall."""

    step: str
    tokens: int
    wall_s: float
    cpu: Cpu = field(default_factory=Cpu)
    notes: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        """Real input tokens per second."""
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")


# ------------------------------------------------------------------ traffic and batches


def build_traffic(args: argparse.Namespace) -> Any:
    """The dev trace's window as texts and HTTP bodies (`lenbatch.cli.traffic`)."""
    from lenbatch.cli.traffic import add_traffic_options, traffic_from_args

    p = argparse.ArgumentParser()
    add_traffic_options(p)
    argv = [*shlex.split(args.trace), "--start", str(args.start), "--span", str(args.span),
            "--rate-scale", str(args.rate_scale), "--model", "minilm"]  # fmt: skip
    return traffic_from_args(p.parse_args(argv))


def form_batches(lengths: Sequence[int], batching: Any) -> list[list[int]]:
    """Indices of the requests in each batch, as the bucketed scheduler fills them when its
    queues are full: per bucket, in arrival order, capped in rows and padded tokens."""
    bounds = list(batching.boundaries)
    lanes: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        lane = next((k for k, b in enumerate(bounds) if n <= b), len(bounds))
        lanes.setdefault(lane, []).append(i)
    batches: list[list[int]] = []
    for lane in sorted(lanes):
        rows = batching.max_batch if lane < len(bounds) else batching.overlong_max_batch
        cur: list[int] = []
        for i in lanes[lane]:
            longest = max([lengths[j] for j in cur] + [lengths[i]])
            if cur and (len(cur) >= rows or longest * (len(cur) + 1) > batching.max_batch_tokens):
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    return batches


def run_pool(
    work: Callable[[Any], Any], items: Sequence[Any], workers: int
) -> tuple[float, dict[int, tuple[str, float]], set[int]]:
    """Run `work(item)` for every item on `workers` threads; the wall seconds, the per-thread
    CPU of this process meanwhile, and the workers' thread ids."""
    tids: set[int] = set()

    def call(item: Any) -> Any:
        tids.add(threading.get_native_id())
        return work(item)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(call, items[: workers * 2]))  # warm: allocator, oneDNN primitives
        before = thread_cpu(os.getpid())
        t0 = time.perf_counter()
        list(pool.map(call, items))
        wall = time.perf_counter() - t0
        after = thread_cpu(os.getpid())
    return wall, cpu_delta(before, after), tids


def split_cpu(delta: dict[int, tuple[str, float]], runner_tids: set[int]) -> Cpu:
    """A process's per-thread CPU split into the main thread, the runner threads and others."""
    cpu = Cpu()
    main = os.getpid()
    for tid, (_, s) in delta.items():
        if tid == main:
            cpu.loop += s
        elif tid in runner_tids:
            cpu.runner += s
        else:
            cpu.other += s
    return cpu


class Timed:
    """Wraps a runner method: the forward's wall and thread-CPU seconds, summed over calls."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.wall = 0.0
        self.cpu = 0.0
        self.tids: set[int] = set()
        self.lock = threading.Lock()

    def __call__(self, batch: Any) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return self.fn(batch)
        finally:
            dw, dc = time.perf_counter() - w, time.thread_time() - c
            with self.lock:
                self.wall += dw
                self.cpu += dc
                self.tids.add(threading.get_native_id())

    def note(self) -> str:
        """The forward's wall time over its CPU time in the runner threads."""
        if self.cpu <= 0:
            return ""
        return f"forward wall/cpu {self.wall / self.cpu:.2f} (runner threads)"


# ------------------------------------------------------------------ the in-process steps


def step_gemm(batches_tokens: list[int], runner: Any, workers: int, quantize: str) -> Row:
    """The linear layers' matrix products alone, on each batch's packed tokens: `F.linear` in
    the runner's dtype, or with `quantize` int8 the runner's int8 product (`Int8Linear`:
    activation quantization, oneDNN's product, scale and bias; GELU on the feed-forward up)."""
    import torch
    import torch.nn.functional as F

    cfg = runner.model.config
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    dtype = runner.precision.dtype
    shapes = [(3 * h, h), (h, h), (inter, h), (h, inter)]
    weights = [(torch.randn(o, i, dtype=dtype), torch.randn(o, dtype=dtype)) for o, i in shapes]
    products: list[Callable[[Any], Any]] = [
        lambda x, w=w, b=b: F.linear(x, w, b) for w, b in weights
    ]
    if quantize == "int8":
        from lenbatch.runners.int8 import Int8Linear

        products = [
            Int8Linear(w, b, "gelu" if o == inter else "none")
            for (w, b), (o, _) in zip(weights, shapes, strict=True)
        ]

    @torch.inference_mode()
    def work(tokens: int) -> None:
        x_h = torch.randn(tokens, h, dtype=dtype)
        x_i = torch.randn(tokens, inter, dtype=dtype)
        for _ in range(layers):
            for product, (_, i) in zip(products, shapes, strict=True):
                product(x_i if i == inter else x_h)

    wall, delta, tids = run_pool(work, batches_tokens, workers)
    flops = sum(2 * t * sum(o * i for o, i in shapes) * layers for t in batches_tokens)
    row = Row("gemm", sum(batches_tokens), wall, split_cpu(delta, tids))
    kind = "GOP/s in int8" if quantize == "int8" else f"GFLOP/s in {runner.precision.name}"
    row.notes.append(f"{flops / wall / 1e9:.0f} {kind}")
    return row


def step_eager(seqs: list[list[int]], batches: list[list[int]], runner: Any, workers: int) -> Row:
    """Hugging Face's forward on each batch padded to its longest row."""
    import torch

    from lenbatch.core.collate import collate

    info = runner.info
    padded = [collate([seqs[i] for i in b], info.pad_token_id, info.padding_side) for b in batches]

    @torch.inference_mode()
    def work(c: Any) -> None:
        runner.model(
            input_ids=torch.from_numpy(c.input_ids),
            attention_mask=torch.from_numpy(c.attention_mask),
        )

    timed = Timed(work)
    wall, delta, tids = run_pool(timed, padded, workers)
    tokens = sum(len(seqs[i]) for b in batches for i in b)
    row = Row("eager", tokens, wall, split_cpu(delta, tids), [timed.note()])
    real = tokens / sum(c.padded_tokens for c in padded)
    row.notes.append(f"padding: {100 * (1 - real):.0f} % of computed tokens")
    return row


def step_runner(
    name: str,
    seqs: list[list[int]],
    batches: list[list[int]],
    runner: Any,
    workers: int,
    bounds: Sequence[int],
) -> tuple[Row, list[str]]:
    """lenbatch's runner on the same batches (packed or padded), and per-bucket lines."""
    from lenbatch.core.collate import collate, pack

    info = runner.info
    if name == "packed":
        prepared = [pack([seqs[i] for i in b]) for b in batches]
        fn = runner.embed_packed
    else:
        prepared = [
            collate([seqs[i] for i in b], info.pad_token_id, info.padding_side) for b in batches
        ]
        fn = runner.embed
    timed = Timed(fn)
    wall, delta, tids = run_pool(timed, prepared, workers)
    tokens = sum(len(seqs[i]) for b in batches for i in b)
    row = Row(name, tokens, wall, split_cpu(delta, tids), [timed.note()])
    # Per bucket: each bucket's batches alone, one thread at a time (what a batch costs).
    lines = []
    lanes: dict[int, list[int]] = {}
    for k, b in enumerate(batches):
        longest = max(len(seqs[i]) for i in b)
        lane = next((j for j, u in enumerate(bounds) if longest <= u), len(bounds))
        lanes.setdefault(lane, []).append(k)
    for lane, ks in sorted(lanes.items()):
        toks = sum(len(seqs[i]) for k in ks for i in batches[k])
        t0 = time.perf_counter()
        for k in ks:
            fn(prepared[k])
        dt = time.perf_counter() - t0
        upper = bounds[lane] if lane < len(bounds) else "overlong"
        rows = np.mean([len(batches[k]) for k in ks])
        lines.append(
            f"| {name} | <= {upper} | {len(ks)} | {rows:.1f} | {toks / dt:,.0f} | "
            f"{1e3 * dt / len(ks):.1f} |"
        )
    return row, lines


def step_engine(texts: list[str], lengths: list[int], runner: Any, settings: Any) -> Row:
    """The engine in this process, no HTTP: every text submitted at once."""
    from lenbatch.embed.engine import Engine

    timed = Timed(runner.embed_packed if hasattr(runner, "embed_packed") else runner.embed)
    if hasattr(runner, "embed_packed"):
        runner.embed_packed = timed
    else:
        runner.embed = timed
    engine = Engine(runner, settings.batching, settings.admission, recovery=settings.recovery)

    async def main() -> tuple[float, int, int, dict[int, tuple[str, float]]]:
        await engine.start()
        try:
            warm = [engine.embed_with_usage([t]) for t in texts[:8]]
            await asyncio.gather(*warm)
            timed.wall = timed.cpu = 0.0
            before = thread_cpu(os.getpid())
            t0 = time.perf_counter()
            done = await asyncio.gather(
                *(engine.embed_with_usage([t]) for t in texts), return_exceptions=True
            )
            wall = time.perf_counter() - t0
            # Read before stopping: the engine's threads are gone afterwards.
            delta = cpu_delta(before, thread_cpu(os.getpid()))
        finally:
            await engine.stop()
        ok = [d for d in done if not isinstance(d, BaseException)]
        return wall, sum(d.prompt_tokens for d in ok), len(done) - len(ok), delta

    wall, tokens, failed, delta = asyncio.run(main())
    row = Row("engine", tokens, wall, split_cpu(delta, timed.tids), [timed.note()])
    if failed:
        row.notes.append(f"{failed} requests failed")
    if abs(tokens - sum(lengths)) > 0:
        row.notes.append(f"{tokens} of {sum(lengths)} tokens answered")
    return row


# ------------------------------------------------------------------ the server steps


async def _closed_loop(url: str, bodies: list[bytes], connections: int) -> tuple[float, int]:
    """Send every body over `connections` keep-alive connections, each waiting for its answer
    before sending the next; the wall seconds and how many were answered 200."""
    host, port = url.removeprefix("http://").split(":")
    queue = list(reversed(range(len(bodies))))
    ok = 0

    async def conn() -> None:
        nonlocal ok
        reader, writer = await asyncio.open_connection(host, int(port))
        while queue:
            body = bodies[queue.pop()]
            head = (
                f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            writer.write(head + body)
            status = await reader.readline()
            size = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    size = int(line.split(b":")[1])
            await reader.readexactly(size)
            ok += status.split()[1] == b"200"
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(connections)))
    return time.perf_counter() - t0, ok


def server_cpu(pid: int, delta: dict[int, tuple[str, float]], top: int) -> tuple[Cpu, str]:
    """A server's per-thread CPU: its main thread (event loop), the `top` busiest others
    (the runner threads when it runs `top` batches at once) and the rest."""
    cpu = Cpu(loop=delta.get(pid, ("", 0.0))[1])
    others = sorted((s for t, (_, s) in delta.items() if t != pid), reverse=True)
    cpu.runner = sum(others[:top])
    cpu.other = sum(others[top:])
    busy = sum(1 for s in others if s > 0.01)
    return cpu, f"{len(delta)} threads, {busy + 1} busy"


def step_servers(
    args: argparse.Namespace, traffic: Any, steps: set[str], workers: int
) -> list[Row]:
    """`server` and `replay`: one `lenbatch serve`, fed by each client in turn."""
    from lenbatch.replay.driver import replay
    from lenbatch.replay.process import ServerProcess, free_port
    from lenbatch.replay.targets import LENBATCH_CLI, Target

    plan = traffic.plan
    tokens = int(plan.lengths.sum())
    argv = (sys.executable, *LENBATCH_CLI, "serve", "--config", args.config,
            "--quantize", args.quantize, "--log-level", "warning", "--port", "{port}")  # fmt: skip
    log_path = Path(tempfile.mkdtemp(prefix="waterfall-")) / "server.log"
    server = ServerProcess(Target("lenbatch serve", "strategy", argv), free_port(), log_path)
    rows = []
    try:
        ready = server.wait_ready()
        pid = server.proc.pid
        warm = plan.bodies[: 4 * workers]
        asyncio.run(_closed_loop(server.url, warm, workers))
        if "server" in steps:
            spy = _py_spy(pid, args) if args.py_spy else None
            before, c0 = thread_cpu(pid), time.process_time()
            wall, ok = asyncio.run(_closed_loop(server.url, plan.bodies, args.connections))
            client = time.process_time() - c0
            delta = cpu_delta(before, thread_cpu(pid))
            cpu, threads = server_cpu(pid, delta, workers)
            cpu.client = client
            row = Row("server", tokens, wall, cpu, [threads, f"ready in {ready:.1f} s"])
            if ok != len(plan.bodies):
                row.notes.append(f"only {ok} of {len(plan.bodies)} answered 200")
            if spy is not None:
                row.notes.append(_py_spy_top(spy))
            rows.append(row)
        if "replay" in steps:
            sent = plan
            if rows:  # past saturation: offer `--overload` x what the server step completed
                want = args.overload * len(plan) / rows[-1].wall_s
                sent = dataclasses.replace(plan, scheduled=plan.scheduled * (_rate(plan) / want))
            before, c0 = thread_cpu(pid), time.process_time()
            res = asyncio.run(replay(server.url, sent, traffic.endpoint, progress=False))
            client = time.process_time() - c0
            delta = cpu_delta(before, thread_cpu(pid))
            cpu, threads = server_cpu(pid, delta, workers)
            cpu.client = client
            ok = res.outcomes == 0
            wall = float(np.nanmax(res.done) - np.nanmin(res.sent))
            row = Row("replay", int(res.lengths[ok].sum()), wall, cpu, [threads])
            offered_rate = _rate(sent)
            done_rate = int(ok.sum()) / wall
            past = done_rate < SATURATED * offered_rate
            row.notes.append(
                f"{len(sent)} requests offered at {offered_rate:.0f} req/s, "
                f"{int(ok.sum())} ok at {done_rate:.0f} req/s: "
                + ("past saturation" if past else "**not past saturation**")
            )
            rows.append(row)
    finally:
        server.stop()
    return rows


def _rate(plan: Any) -> float:
    """The requests per second a replay plan offers."""
    return len(plan) / max(float(plan.scheduled[-1]), 1e-9)


def _py_spy(pid: int, args: argparse.Namespace) -> Path | None:
    """Start `py-spy record` on the server (raw collapsed stacks); None without py-spy."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("waterfall: py-spy not installed: no profile", file=sys.stderr)
        return None
    out = Path(tempfile.mkdtemp(prefix="waterfall-spy-")) / "server.txt"
    errors = out.with_suffix(".err")
    subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--format", "raw", "--output", str(out),
         "--duration", str(args.py_spy), "--rate", "200", "--threads", "--gil"],
        stdout=errors.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    return out


def _py_spy_top(path: Path, n: int = 6) -> str:
    """The functions py-spy saw holding the GIL most often (self time), from its raw output."""
    for _ in range(50):
        if path.exists():
            break
        time.sleep(0.2)
    counts: dict[str, int] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        err = path.with_suffix(".err")
        why = err.read_text(errors="replace").splitlines()[:1] if err.exists() else []
        return f"py-spy: no profile ({why[0] if why else 'no output'})"
    for line in lines:
        stack, _, num = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        counts[leaf] = counts.get(leaf, 0) + int(num)
        total += int(num)
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    return "py-spy (GIL holders, self): " + ", ".join(
        f"{k} {100 * v / max(total, 1):.0f} %" for k, v in top
    )


# ------------------------------------------------------------------ report


def report(rows: list[Row], bucket_lines: list[str], header: list[str]) -> str:
    """The waterfall table, the per-bucket table and the notes, as Markdown."""
    out = [*header, "", "| step | tok/s | ratio to the step above | wall s | CPU by role | notes |",
           "|---|---:|---:|---:|---|---|"]  # fmt: skip
    prev: Row | None = None
    for r in rows:
        ratio = "" if prev is None else f"{r.tok_s / prev.tok_s:.2f}"
        notes = "; ".join(n for n in r.notes if n)
        out.append(
            f"| {r.step} | {r.tok_s:,.0f} | {ratio} | {r.wall_s:.2f} | "
            f"{r.cpu.text(r.wall_s, r.tokens)} | {notes} |"
        )
        prev = r
    if bucket_lines:
        out += ["", "Per bucket, its batches one at a time on one thread:", "",
                "| runner | bucket | batches | rows/batch | tok/s | ms/batch |",
                "|---|---|---:|---:|---:|---:|", *bucket_lines]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen steps and print (and with --out write) the table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default=DEV_CONFIG, help=f"server config (default {DEV_CONFIG})")
    p.add_argument("--trace", default="azure-conv --length-scale 0.05 --max-length 256",
                   help="trace and mapping, as `lenbatch replay` takes them")  # fmt: skip
    p.add_argument("--start", type=float, default=600.0, help="trace window start, s")
    p.add_argument("--span", type=float, default=120.0, help="seconds of trace time")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=28.0,
        help="the trace's rate multiplier (the replay step's without a server step)",
    )
    p.add_argument("--overload", type=float, default=2.0,
                   help="replay step: offer this x the server step's completed rate")  # fmt: skip
    p.add_argument("--steps", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}")
    p.add_argument("--connections", type=int, default=256,
                   help="server step: connections (enough to fill every batch slot)")  # fmt: skip
    p.add_argument("--py-spy", type=float, default=0.0, metavar="S",
                   help="server step: py-spy the server for S seconds (0: off)")  # fmt: skip
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="every step's products in int8, as `serve --quantize int8`")  # fmt: skip
    p.add_argument("--conditions", default="", help="what else ran on the machine")
    p.add_argument("--out", type=Path, help="Markdown file to write")
    args = p.parse_args(argv)
    steps = {s.strip() for s in args.steps.split(",") if s.strip()}
    if steps - set(STEPS):
        p.error(f"unknown steps {sorted(steps - set(STEPS))}; choose from {','.join(STEPS)}")
    # The in-process steps run on the malloc the server runs on (it preloads tcmalloc where
    # installed, which changes the runner's speed): re-executed once here likewise.
    from lenbatch.runners.allocator import choose

    allocator = choose("auto", [sys.executable, *sys.argv] if argv is None else None)

    import torch

    from lenbatch.config.settings import load_settings
    from lenbatch.runners import load_runner
    from lenbatch.runners.hardware import processor_key

    settings = load_settings(args.config)
    m, batching = settings.model, settings.batching
    workers, threads = batching.max_concurrent_batches, m.torch_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    traffic = build_traffic(args)
    texts = _texts(traffic)
    rows: list[Row] = []
    bucket_lines: list[str] = []
    packed = load_runner(m.name, execution="packed", dtype=m.dtype, torch_threads=threads,
                         quantization=args.quantize)  # fmt: skip
    seqs = packed.tokenize(texts, True)
    lengths = [len(s) for s in seqs]
    batches = form_batches(lengths, batching)
    batch_tokens = [sum(lengths[i] for i in b) for b in batches]
    if "gemm" in steps:
        rows.append(step_gemm(batch_tokens, packed, workers, args.quantize))
    if steps & {"eager", "padded"}:
        padded = load_runner(m.name, execution="padded", dtype=m.dtype, torch_threads=threads,
                             quantization=args.quantize)  # fmt: skip
        if "eager" in steps:
            rows.append(step_eager(seqs, batches, padded, workers))
        if "padded" in steps:
            row, lines = step_runner("padded", seqs, batches, padded, workers, batching.boundaries)
            rows.append(row)
            bucket_lines += lines
        del padded
    if "packed" in steps:
        row, lines = step_runner("packed", seqs, batches, packed, workers, batching.boundaries)
        rows.append(row)
        bucket_lines += lines
    if "engine" in steps:
        rows.append(step_engine(texts, lengths, packed, settings))
    if steps & {"server", "replay"}:
        rows += step_servers(args, traffic, steps, workers)
    load_after = os.getloadavg()
    cmd = shlex.join(["python", "bench/waterfall.py", *(sys.argv[1:] if argv is None else argv)])
    header = [
        "# Waterfall: where tokens/s go between the matrix products and the answer",
        "",
        f"Command: `{cmd}`  ",
        f"Processor: `{processor_key(threads=threads)}`; {workers} batches at once on "
        f"{threads} torch thread(s) each; {m.dtype} ({packed.precision.name}), quantization "
        f"{args.quantize}; in-process "
        f"steps on {allocator}, the server on its default allocator (`--allocator auto`)  ",
        f"Traffic: {args.trace}, {args.span:g} s from t={args.start:g} s: {len(texts)} requests, "
        f"{sum(lengths):,} tokens (mean {np.mean(lengths):.0f}), {len(batches)} batches "
        f"(mean {np.mean([len(b) for b in batches]):.1f} rows)  ",
        f"Load average before {load_before[0]:.2f}, after {load_after[0]:.2f}. "
        f"Conditions: {args.conditions or 'not stated'}",
    ]
    text = report(rows, bucket_lines, header)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


def _texts(traffic: Any) -> list[str]:
    """The request texts back from the plan's JSON bodies."""
    import json

    return [json.loads(b)["input"] for b in traffic.plan.bodies]


if __name__ == "__main__":
    sys.exit(main())
