"""Which memory allocator the process runs on, and where tcmalloc is.

Why it matters, measured on an Intel Xeon family 6 model 167 (2 cores, AMX), MiniLM bf16
packed, `make serve`'s config:

- Memory. glibc's malloc keeps the freed activation buffers of a batch's varied shapes in its
  arenas instead of returning them: `bench/memory_growth.py --batches 1200` (the served
  runner and threads, random dev-trace-like shapes, saturated) ends at 1,197-1,241 MB on
  glibc and 942-955 MB on tcmalloc (gperftools' minimal build, preloaded). glibc's own knobs
  bound it only by paying per allocation: `MALLOC_MMAP_THRESHOLD_=131072` 808 MB but the loop
  50 % slower; `malloc_trim(0)` every 1-5 s 992-1,045 MB and 5-8 % slower.
- Speed. The same loop runs ~10 % faster on tcmalloc, and the server more: long-input
  waterfall, alternated runs, the server step 24.6k / 26.8k real tok/s on glibc vs 30.4k /
  32.5k on tcmalloc, the full replay 24.7k / 26.3k vs 27.4k / 29.3k.

vLLM's CPU build and Intel's launchers preload tcmalloc for the same reasons. An allocator can
only be chosen before the process starts, so `lenbatch serve` re-executes itself once with
`LD_PRELOAD` set (`choose`, `preload_environment`); what it ended up on is read back from the
process's own memory map (`allocator_in_use`).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "REEXEC_MARK",
    "TCMALLOC_NAMES",
    "allocator_in_use",
    "choose",
    "find_tcmalloc",
    "preload_environment",
]

# tcmalloc's shared objects, the minimal build (no heap profiler) first.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")

# Set in the re-executed process's environment, so it never re-executes again (a preload the
# dynamic loader ignored would otherwise loop).
REEXEC_MARK = "LENBATCH_ALLOCATOR_REEXEC"


def _library_dirs() -> list[Path]:
    """Where shared libraries live: the environment's own, then the system's."""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    for root in ("/usr/local/lib", "/usr/lib", "/lib"):
        if multiarch:
            dirs.append(Path(root) / str(multiarch))
        dirs.append(Path(root))
    dirs += [Path("/usr/lib64"), Path("/lib64")]
    return dirs


def find_tcmalloc(dirs: Sequence[Path] | None = None) -> Path | None:
    """The first tcmalloc shared object in `dirs` (default: the environment's and the
    system's library folders), or None."""
    for folder in _library_dirs() if dirs is None else dirs:
        for name in TCMALLOC_NAMES:
            candidate = folder / name
            if candidate.is_file():
                return candidate
    return None


def allocator_in_use(maps: str | None = None) -> str:
    """`tcmalloc`, `jemalloc` or `glibc`: the malloc this process runs on, read from its
    memory map (`maps`: the text of /proc/self/maps; read here when None). `unknown` where
    there is no /proc."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text(encoding="ascii", errors="replace")
        except OSError:
            return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"


def preload_environment(
    choice: str, env: Mapping[str, str], in_use: str, found: Path | None
) -> tuple[dict[str, str] | None, str]:
    """Whether to re-execute with tcmalloc preloaded, and why: (the new environment, or None
    to go on as is; the reason, for the log). `choice` is the `[server] allocator` setting
    (`auto`, `tcmalloc` or `system`); raises ValueError where `tcmalloc` was asked for and
    cannot be had."""
    if choice == "system":
        return None, f"{in_use} (allocator = system: as launched)"
    if in_use != "glibc":
        how = "preloaded at start" if env.get(REEXEC_MARK) else "already loaded"
        return None, f"{in_use} ({how})"
    if env.get(REEXEC_MARK):
        why = f"{found} was preloaded but is not in the process's memory map"
        if choice == "tcmalloc":
            raise ValueError(f"allocator tcmalloc: {why}")
        return None, f"glibc ({why})"
    if found is None:
        where = "no " + " or ".join(TCMALLOC_NAMES) + " in the library folders"
        if choice == "tcmalloc":
            raise ValueError(
                f"allocator tcmalloc: {where} (install gperftools' libtcmalloc-minimal4)"
            )
        return None, (
            f"glibc ({where}; install libtcmalloc-minimal4 for a resident set that stays put "
            "under varied batch shapes)"
        )
    preload = " ".join(p for p in (str(found), env.get("LD_PRELOAD", "")) if p)
    return {**env, "LD_PRELOAD": preload, REEXEC_MARK: "1"}, f"tcmalloc ({found}, preloaded)"


def choose(choice: str, command: Sequence[str] | None) -> str:
    """Re-execute `command` (the whole command line, the interpreter first) with tcmalloc
    preloaded where `choice` and the machine say so (this call then never returns); else say
    which allocator the process runs on, and why. Without a command it goes on as it is."""
    in_use = allocator_in_use()
    env, why = preload_environment(choice, os.environ, in_use, find_tcmalloc())
    if env is None:
        return why
    if not command:
        return f"{in_use} (not re-executed: no command line to re-run)"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], list(command), env)
    raise AssertionError("unreachable: execve returned")  # pragma: no cover
