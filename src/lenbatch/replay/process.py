"""A server under test as a subprocess: started in its own process group, polled until its
health path answers, its whole process tree's resident memory sampled while it runs, its CPU
time read from /proc, and stopped with SIGTERM (SIGKILL for whatever of its group lingers).

`lenbatch bench` starts every target this way, so every server's peak memory and start-up
time are measured alike; benchmark scripts use the same pieces (`ServerProcess`, `free_port`,
`tree_rss`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from lenbatch.replay.targets import Target

__all__ = ["ServerProcess", "free_port", "tree_rss"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants (Linux /proc; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(e)
        children.setdefault(int(fields[1]), []).append(pid)  # field 4: ppid
        rss[pid] = int(fields[21]) * page  # field 24: rss in pages
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def _cpu_seconds(stat_path: str) -> float | None:
    """utime + stime of a /proc stat file, in seconds; None if unreadable."""
    try:
        with open(stat_path, encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


def _thread_cpu_seconds(pid: int, tid: int) -> float | None:
    """CPU seconds of one thread, to the nanosecond from its schedstat where the kernel keeps
    one (a short replay's event loop may use less than one 10 ms clock tick), else from its
    stat in clock ticks."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return _cpu_seconds(f"/proc/{pid}/task/{tid}/stat")


class ServerProcess:
    """A server subprocess in its own process group, with a peak-RSS sampler."""

    def __init__(self, target: Target, port: int, log_path: Path) -> None:
        self.target = target
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
        if target.external is not None:  # another project's venv: nothing of lenbatch's
            for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
                env.pop(key, None)
        env.update(dict(target.env))
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            target.command(port),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, so stop() can end every child it made
            env=env,
        )
        self.peak_rss = 0
        self._stop_sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop_sampling.wait(0.25):
            self.peak_rss = max(self.peak_rss, tree_rss(self.proc.pid))

    def cpu_seconds(self) -> dict[str, float] | None:
        """CPU seconds so far of the server's main thread (for `lenbatch serve`, its event
        loop: HTTP, JSON, tokenization, scheduling) and of its whole process; None where
        /proc cannot tell."""
        pid = self.proc.pid
        loop = _thread_cpu_seconds(pid, pid)
        process = _cpu_seconds(f"/proc/{pid}/stat")
        if loop is None or process is None:
            return None
        return {"loop_s": loop, "process_s": process}

    def log_tail(self, n: int = 2000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll the target's health path until 200; returns seconds waited. Raises if the
        process exits."""
        t0 = time.monotonic()
        with httpx.Client(base_url=self.url, trust_env=False, timeout=5.0) as c:
            while time.monotonic() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.target.name} exited with {self.proc.returncode} before it was "
                        f"ready; its log ends:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.target.health_path).status_code == 200:
                        return time.monotonic() - t0
                time.sleep(0.25)
        raise RuntimeError(f"{self.target.name} not ready after {timeout_s:g} s")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole group; nothing it started is left running."""
        self._stop_sampling.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, 0)  # anyone left in the group?
            except ProcessLookupError:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            time.sleep(2.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
