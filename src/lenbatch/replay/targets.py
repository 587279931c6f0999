"""What `lenbatch bench` runs: each target is a `lenbatch serve --strategy S` command line or a
peer server's, with the environment and health path to launch it with.

A peer from another project (`external`) gets its command line only once `prepare_target` has
made its venv (first use: minutes) and asked it how to launch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lenbatch.replay.peers.external import (
    OFFLINE_ENV,
    ExternalPeer,
    PeerContext,
    PeerVenv,
    peers_dir,
)

__all__ = ["LENBATCH_CLI", "Target", "prepare_target", "targets_for"]


@dataclass(frozen=True)
class Target:
    """A server to benchmark: a lenbatch strategy or a peer.

    A peer from another project (`external`) has no command line until `prepare_target`
    has made its venv and asked it how to launch; then `argv`, `env`, `health_path` and
    `info` (versions, flags, install record: for the report) are filled in.
    """

    name: str
    kind: str  # "strategy" or "peer"
    argv: tuple[str, ...]  # command line; "{port}" is replaced by the port
    env: tuple[tuple[str, str], ...] = ()  # added to the environment
    health_path: str = "/health"
    external: ExternalPeer | None = field(default=None, compare=False)
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def command(self, port: int) -> list[str]:
        """The command line for `port`."""
        return [a.replace("{port}", str(port)) for a in self.argv]


LENBATCH_CLI = ("-c", "import sys; from lenbatch.cli import main; sys.exit(main())")
"""`python` arguments that run the `lenbatch` command of the tree this Python imports (so
`PYTHONPATH` picks the tree, as it does for the benchmark itself)."""


def targets_for(
    strategies: Sequence[str],
    peers: Sequence[str],
    *,
    model: str = "minilm",
    max_batch: int = 32,
    max_wait_ms: float = 10.0,
    serve_args: Sequence[str] = (),
) -> list[Target]:
    """Targets for the given strategies and peers, all with the same batch size and wait."""
    from lenbatch.config import Strategy
    from lenbatch.replay.peers.registry import EXTERNAL_PEERS, PEERS, external_peer

    out = []
    for s in strategies:
        Strategy.parse(s)
        argv = (
            sys.executable, *LENBATCH_CLI, "serve", "--model", model, "--strategy", s,
            "--port", "{port}", "--max-batch", str(max_batch), "--max-wait-ms", f"{max_wait_ms:g}",
            "--log-level", "warning", *serve_args,
        )  # fmt: skip
        out.append(Target(s, "strategy", argv))
    for p in peers:
        if p in EXTERNAL_PEERS:
            out.append(Target(p, "peer", (), external=external_peer(p)))
            continue
        if p not in PEERS:
            known = ", ".join([*PEERS, *EXTERNAL_PEERS])
            raise ValueError(f"unknown peer {p!r}; choose from: {known}")
        argv = (sys.executable, "-m", PEERS[p], "--model", model, "--port", "{port}")
        if p == "ray":
            argv += ("--max-batch", str(max_batch), "--max-wait-ms", f"{max_wait_ms:g}")
        out.append(Target(p, "peer", argv))
    return out


def prepare_target(
    target: Target,
    *,
    model: str,
    endpoint: str,
    max_batch: int,
    log: Callable[[str], None] = print,
    root: Path | None = None,
) -> Target:
    """The target ready to launch: for a peer from another project, its venv made (first use
    only: minutes) and its launch command, environment and report record filled in."""
    peer = target.external
    if peer is None or target.argv:  # a lenbatch target, or one prepared already
        return target
    if endpoint not in peer.endpoints:
        raise ValueError(
            f"peer {target.name} serves {', '.join(peer.endpoints)}, not {endpoint} "
            "(see --endpoint)"
        )
    venv = PeerVenv(peer.venv, root or peers_dir())
    record = venv.ensure(log)
    ctx = PeerContext(
        model=model, endpoint=endpoint, max_batch=max_batch, python=venv.python, venv=venv.path
    )
    launch = peer.launch(ctx)
    env = {**OFFLINE_ENV, **launch.env}
    info = {
        "versions": record.get("versions", {}),
        "python": record.get("python"),
        "requirements": record.get("requirements", []),
        "uninstalled": record.get("uninstalled", []),
        "install_s": record.get("install_s"),
        "disk_mb": record.get("disk_mb"),
        "env": env,
        "notes": list(launch.notes),
    }
    return replace(
        target, argv=launch.argv, env=tuple(env.items()), health_path=launch.health_path, info=info
    )
