"""The cache of self-calibrated cost models (`plan.selfcal` writes them, `--cost auto` reads
them), one file per key, in the user's cache folder.

A cost model holds only for the processor, torch thread count, float type, quantization and
execution it was measured with, and for the code that ran it. Each file is keyed by all of
them:

- the folder: `<cache root>/costs/lenbatch-<version>-<runner code>_torch-<version>/`, so another
  lenbatch or torch version never reads an older file (the old folder is simply left behind).
  `<runner code>` is a hash of the runners' source (`lenbatch/runners/`, its C++ included):
  a source checkout keeps its version string across commits, and a faster forward (the packed
  attention op made MiniLM's 1.2x faster) would otherwise start from a model of the slower one;
- the file name: the execution (`packed`, `padded`) and `CostKey.file_name()` (served model,
  work, dtype, quantization, processor key with its thread count), so a change of any of
  them misses.

The cache root is `$LENBATCH_CACHE_DIR` when set (the tests use their own), else
`$XDG_CACHE_HOME/lenbatch` (the XDG base directory spec: only an absolute value counts), else
`~/.cache/lenbatch`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from functools import cache
from importlib import metadata, resources
from pathlib import Path

from lenbatch.core.costkey import CostKey
from lenbatch.plan.costmodel import CostModel

__all__ = [
    "CACHE_DIR_ENV",
    "cache_root",
    "cached_cost",
    "cost_cache_dir",
    "cost_cache_file",
    "runner_code",
    "store_cost",
]

log = logging.getLogger("lenbatch.costcache")

CACHE_DIR_ENV = "LENBATCH_CACHE_DIR"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


@cache
def runner_code() -> str:
    """8 hex digits of a hash over the runners' source files (`lenbatch/runners/*.py`, `*.cpp`):
    what computes a batch, so what a cost model measured."""
    folder = resources.files("lenbatch.runners")
    digest = hashlib.sha256()
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith((".py", ".cpp")) and entry.is_file():
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes())
    return digest.hexdigest()[:8]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "unknown"


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The lenbatch cache folder: `$LENBATCH_CACHE_DIR`, else `$XDG_CACHE_HOME/lenbatch`
    (absolute values only, as the XDG spec says), else `~/.cache/lenbatch`."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV]).expanduser()
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "lenbatch"


def cost_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of cached cost models for this lenbatch and torch version."""
    # the installed distributions' versions (the package root re-exports `__version__`, but
    # plan/ sits below it and does not import it)
    lenbatch = f"{_slug(_version('lenbatch'))}-{runner_code()}"
    versions = f"lenbatch-{lenbatch}_torch-{_slug(_version('torch'))}"
    return cache_root(environ) / "costs" / versions


def cost_cache_file(key: CostKey, execution: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where the cost model of `key` run with `execution` is cached."""
    return cost_cache_dir(environ) / f"{_slug(execution or 'any')}__{key.file_name()}"


def cached_cost(
    key: CostKey, execution: str, environ: Mapping[str, str] | None = None
) -> tuple[Path, CostModel] | None:
    """The cached cost model of `key` and `execution`, or None (absent, unreadable, or keyed
    otherwise than its name says: a file edited by hand is not trusted)."""
    path = cost_cache_file(key, execution, environ)
    try:
        cost = CostModel.load(path)
    except (OSError, ValueError, TypeError):
        return None
    if cost.cost_key(key.model).difference(key) is not None or cost.execution != execution:
        log.warning("ignoring cached cost model %s: its key does not match its name", path)
        return None
    return path, cost


def store_cost(cost: CostModel, key: CostKey, environ: Mapping[str, str] | None = None) -> Path:
    """Cache `cost` under `key` (atomically: a concurrent start reads the old file or the
    new one, never half of one); returns the path."""
    path = cost_cache_file(key, cost.execution, environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cost.save(tmp)
    os.replace(tmp, path)
    return path
