"""What Ray costs per request and in memory: one `lenbatch serve` against the Ray app.

Each server is started the way `lenbatch bench` starts it (own process group, loopback, free
port), warmed up, then sent `--n` short requests one at a time (closed loop: one in flight, so
no queueing, only each hop's cost plus the same batch wait in both). Reports the latency
percentiles, their difference, and the resident memory of each server's whole process tree
(Ray: driver, GCS, raylet, controller, proxy, ingress and replicas) when idle after warm-up.

    bench/run.py ray-overhead -- [--n 300] [--config configs/minilm-azure-conv.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from lenbatch.replay.bench import machine_description
from lenbatch.replay.process import ServerProcess, free_port, tree_rss
from lenbatch.replay.targets import LENBATCH_CLI, Target

TEXT = "How many apples are left if Tom eats two of the five he bought?"


def measure(target: Target, n: int, log_dir: Path) -> dict[str, float]:
    """Start `target`, send `n` sequential requests, stop it; latency and memory figures."""
    server = ServerProcess(target, free_port(), log_dir / f"{target.name}.log")
    try:
        ready_s = server.wait_ready()
        body = {"input": TEXT}
        with httpx.Client(base_url=server.url, trust_env=False, timeout=30) as c:
            for _ in range(20):
                assert c.post("/v1/embeddings", json=body).status_code == 200
            time.sleep(1.0)
            idle_rss = tree_rss(server.proc.pid)
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = c.post("/v1/embeddings", json=body)
                lat.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
    finally:
        server.stop()
    ms = np.asarray(lat) * 1000
    return {
        "startup_s": ready_s,
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "mean_ms": float(statistics.fmean(ms)),
        "idle_rss_mb": idle_rss / 2**20,
        "peak_rss_mb": server.peak_rss / 2**20,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--config", default="configs/minilm-azure-conv.toml")
    p.add_argument("--out", default="/tmp/ray_overhead")
    args = p.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", LENBATCH_CONFIG=args.config)
    # Ray's workers at nice 0 like the single server (Ray's default is 15), as in ray-scaleout.
    os.environ.setdefault("RAY_worker_niceness", "0")
    targets = [
        Target(
            "lenbatch serve (bucketed, 2 threads)",
            "strategy",
            (
                sys.executable,
                *LENBATCH_CLI,
                "serve",
                "--config",
                args.config,
                "--port",
                "{port}",
                "--log-level",
                "warning",
            ),
        ),
        Target(
            "ray-lenbatch (2 replicas x 1 thread)",
            "peer",
            (sys.executable, "-m", "lenbatch.replay.peers.ray_lenbatch", "--port", "{port}"),
        ),
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {t.name: measure(t, args.n, out) for t in targets}
    print(f"machine: {machine_description()}")
    print(f"{args.n} sequential requests of one short text ({TEXT.count(' ') + 1} words)\n")
    print("| server | P50 ms | P95 ms | mean ms | idle RSS MB | peak RSS MB | start s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['mean_ms']:.1f} | "
            f"{r['idle_rss_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['startup_s']:.1f} |"
        )
    single, ray = rows.values()
    print(
        f"\nRay's cost: +{ray['p50_ms'] - single['p50_ms']:.1f} ms per request at P50, "
        f"+{ray['idle_rss_mb'] - single['idle_rss_mb']:.0f} MB resident when idle"
    )
    (out / "ray_overhead.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
