"""The bench targets of lenbatch's own Ray Serve app (`lenbatch.scaleout`).

`ray-lenbatch`: N lenbatch engine replicas behind the length-aware request router;
`ray-lenbatch-p2c` (`ray_lenbatch_p2c`): the same app with Ray's default policy, power of two
choices. Both run `lenbatch serve --ray` with the settings `lenbatch serve` reads (defaults, the
`LENBATCH_CONFIG` file, `LENBATCH_<SECTION>__<FIELD>` variables), so `lenbatch bench` compares
them with its strategies on the same configuration: set the boundaries once, e.g.
`LENBATCH_BATCHING__BOUNDARIES='[16,32,64,128]' lenbatch bench --peer ray-lenbatch,...`.

    python -m lenbatch.replay.peers.ray_lenbatch --port 8202 [--replicas 2] [--routing pow2]
"""

from __future__ import annotations

import argparse
import os

from lenbatch.config import load_settings

__all__ = ["main"]


def main(argv: list[str] | None = None, routing: str = "length") -> int:
    """Deploy the Ray app on a local Ray (127.0.0.1) and serve until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--port", type=int, default=8202)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--routing", choices=["length", "pow2"], default=routing)
    p.add_argument("--max-batch", type=int, help="batching.max_batch (default: settings)")
    p.add_argument("--max-wait-ms", type=float, help="batching.max_wait_ms (default: settings)")
    args = p.parse_args(argv)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lenbatch.scaleout.app import RayOptions, run

    overrides = {
        "model": {"name": args.model},
        "server": {"host": "127.0.0.1", "port": args.port, "log_level": "warning"},
        "batching": {"max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms},
    }
    settings = load_settings(os.environ.get("LENBATCH_CONFIG"), os.environ, overrides)
    options = RayOptions(replicas=args.replicas, routing=args.routing, threads=args.threads)
    return run(settings, options)


if __name__ == "__main__":
    raise SystemExit(main())
