"""Peers that are other projects' servers (Infinity, vLLM, llama.cpp), each in its own venv.

They need other versions of transformers (and more) than lenbatch, so each lives in
`.venv-peers/NAME` (under the current folder, or `$LENBATCH_PEERS_DIR`), created on first use
with exact pins in one pip command (torch==2.13.0 among them wherever the peer takes torch, so
pip never pulls a CUDA build), then a stamp file records the pins, the install time, the disk
size and the installed versions. A venv whose stamp does not match the pins is installed again.

A peer is launched the same way as lenbatch's own servers (`replay.process.ServerProcess`: its
own process group, 127.0.0.1, health-checked, stopped by its PID), offline and with telemetry
off (`OFFLINE_ENV`), and its versions, flags and environment go into the report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "OFFLINE_ENV",
    "ExternalPeer",
    "PeerContext",
    "PeerLaunch",
    "PeerVenv",
    "VenvSpec",
    "peers_dir",
]

# Every peer gets these: no model hub, no usage statistics (each project names its own switch).
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}

_STAMP = "lenbatch-peer.json"

Runner = Callable[..., Any]  # subprocess.run's signature; tests pass a recorder


def peers_dir() -> Path:
    """Where the peer venvs live: `$LENBATCH_PEERS_DIR`, else `./.venv-peers`."""
    return Path(os.environ.get("LENBATCH_PEERS_DIR") or ".venv-peers").absolute()


@dataclass(frozen=True)
class VenvSpec:
    """One peer's virtual environment: what to install (exact pins, one pip command), what to
    remove afterwards (wheels a dependency drags in that break the peer) and which
    distributions' versions the report names."""

    name: str
    requirements: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    report_versions: tuple[str, ...] = ()
    build_env: Mapping[str, str] = field(default_factory=dict)  # e.g. a source build's flags


class PeerVenv:
    """A peer's venv under `peers_dir()`: created on first use, then reused while its stamp
    matches the spec's pins."""

    def __init__(self, spec: VenvSpec, root: Path | None = None) -> None:
        self.spec = spec
        self.path = (root or peers_dir()) / spec.name
        self.python = self.path / "bin" / "python"

    def stamp(self) -> dict[str, Any] | None:
        """The install record, or None when the venv is absent or was built from other pins."""
        try:
            data = json.loads((self.path / _STAMP).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("requirements") != list(self.spec.requirements):
            return None
        return data

    def ensure(
        self, log: Callable[[str], None] = print, run: Runner = subprocess.run
    ) -> dict[str, Any]:
        """The install record, installing first if needed (this can take minutes)."""
        found = self.stamp()
        if found is not None:
            return found
        return self.install(log, run)

    def pip_command(self) -> list[str]:
        """The one pip command that installs the peer."""
        return [str(self.python), "-m", "pip", "install", "--quiet", *self.spec.requirements]

    def install(
        self, log: Callable[[str], None] = print, run: Runner = subprocess.run
    ) -> dict[str, Any]:
        """Create the venv, install the pins, remove what must go, write the stamp."""
        log(
            f"peers: installing {self.spec.name} into {self.path} "
            f"({' '.join(self.spec.requirements)})"
        )
        t0 = time.monotonic()
        env = dict(os.environ, **self.spec.build_env)
        run([sys.executable, "-m", "venv", "--clear", str(self.path)], check=True)
        run(self.pip_command(), check=True, env=env)
        if self.spec.uninstall:
            run([str(self.python), "-m", "pip", "uninstall", "--yes", "--quiet",
                 *self.spec.uninstall], check=True)  # fmt: skip
        record = {
            "requirements": list(self.spec.requirements),
            "uninstalled": list(self.spec.uninstall),
            "build_env": dict(self.spec.build_env),
            "install_s": round(time.monotonic() - t0, 1),
            "disk_mb": round(_disk_bytes(self.path) / 2**20),
            "versions": self.versions(run),
            "python": _python_version(self.python, run),
        }
        (self.path / _STAMP).write_text(json.dumps(record, indent=2), encoding="utf-8")
        log(
            f"peers: {self.spec.name} installed in {record['install_s']:g} s, "
            f"{record['disk_mb']} MB"
        )
        return record

    def versions(self, run: Runner = subprocess.run) -> dict[str, str]:
        """Installed versions of the spec's `report_versions`, read inside the venv."""
        code = (
            "import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for d in sys.argv[1:]:\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: out[d] = 'absent'\n"
            "print(json.dumps(out))"
        )
        done = run(
            [str(self.python), "-c", code, *self.spec.report_versions],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        versions: dict[str, str] = json.loads(done.stdout)
        return versions


def _python_version(python: Path, run: Runner) -> str:
    done = run([str(python), "-c", "import platform; print(platform.python_version())"],
               check=True, capture_output=True, text=True)  # fmt: skip
    return str(done.stdout).strip()


def _disk_bytes(path: Path) -> int:
    """Bytes the folder takes (files' sizes; hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


@dataclass(frozen=True)
class PeerContext:
    """What a peer's launch may depend on: the bench's model, endpoint and batch cap."""

    model: str  # lenbatch's name for it (`minilm`, `smollm2`, a folder)
    endpoint: str  # "embeddings" or "completions"
    max_batch: int
    python: Path  # the peer venv's interpreter
    venv: Path
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass(frozen=True)
class PeerLaunch:
    """How to start a peer: argv (`{port}` is replaced), extra environment, where its health
    check answers and a note for the report on the flags chosen and why."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    notes: tuple[str, ...] = ()
    served_model: str | None = None  # the `model` name the peer answers to, if it needs one


class ExternalPeer(Protocol):
    """A peer from another project: its venv, the endpoints it serves and how to launch it."""

    name: str
    venv: VenvSpec
    endpoints: tuple[str, ...]

    def launch(self, ctx: PeerContext) -> PeerLaunch:
        """The command line and environment for `ctx` (may prepare files, e.g. a model)."""
        ...


def which_or_none(name: str) -> str | None:
    """`shutil.which`, for peers that want a system library or tool."""
    return shutil.which(name)
