"""The steps a benchmark recipe is made of (`bench/recipes.py`), as `bench/run.py` runs them.

A `Command` is a command line run from the repository root (`lenbatch ARGS` or `python ARGS`); an
`Action` is work done in Python (printing a table); `ServeDuring` keeps a `lenbatch serve` up
while commands run against it. Each step says what it does as text, which is what
`bench/run.py --dry-run` prints instead of running it.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROOT", "Action", "Command", "ServeDuring", "Step", "lenbatch", "script"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Command:
    """A command line run from the repository root: `lenbatch ARGS` or `python ARGS`."""

    tool: str  # "lenbatch" or "python"
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # on top of the runner's environment

    def argv(self) -> list[str]:
        """The command line to execute: this Python, or the lenbatch script beside it."""
        if self.tool == "python":
            return [sys.executable, *self.args]
        script = Path(sys.executable).with_name("lenbatch")
        if script.exists():
            return [str(script), *self.args]
        from lenbatch.replay.targets import LENBATCH_CLI

        return [sys.executable, *LENBATCH_CLI, *self.args]

    def describe(self) -> str:
        """The command as a shell line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join([self.tool, *self.args])

    def run(self, env: dict[str, str]) -> None:
        """Run it to the end in `env` (plus its own variables); a failure stops the recipe."""
        subprocess.run(self.argv(), cwd=ROOT, env={**env, **dict(self.env)}, check=True)


@dataclass(frozen=True)
class Action:
    """Work done in Python, with the line that says what it is."""

    text: str
    work: Callable[[dict[str, str]], None]

    def describe(self) -> str:
        """What the step does, as a shell comment."""
        return f"# {self.text}"

    def run(self, env: dict[str, str]) -> None:
        """Do it."""
        self.work(env)


@dataclass(frozen=True)
class ServeDuring:
    """`lenbatch serve ARGS` on a free loopback port while `steps` run against it (`{url}` in
    their arguments is its address); its output goes to `log`, its `/stats` at the end to
    `stats`."""

    serve: Command
    steps: tuple[Command, ...]
    log: Path
    stats: Path

    def describe(self) -> str:
        """The server, the commands against it, and the stats file."""
        lines = [f"{self.serve.describe()} --port PORT > {self.log} 2>&1 &  # until /health"]
        lines += [s.describe().replace("{url}", "http://127.0.0.1:PORT") for s in self.steps]
        lines.append(f"# GET /stats > {self.stats}; stop the server")
        return "\n".join(lines)

    def run(self, env: dict[str, str]) -> None:
        """Start the server (as `lenbatch bench` starts its targets), run the commands, save
        its stats and stop it, whatever happens."""
        import httpx

        from lenbatch.replay.process import ServerProcess, free_port
        from lenbatch.replay.targets import Target

        argv = (*self.serve.argv(), "--port", "{port}")
        server_env = {**env, **dict(self.serve.env)}
        target = Target("lenbatch serve", "strategy", argv, env=tuple(server_env.items()))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(target, free_port(), self.log)
        try:
            server.wait_ready()
            for step in self.steps:
                args = tuple(a.replace("{url}", server.url) for a in step.args)
                Command(step.tool, args, step.env).run(env)
            with contextlib.suppress(httpx.HTTPError):
                self.stats.write_text(httpx.get(f"{server.url}/stats").text, encoding="utf-8")
        finally:
            server.stop()


Step = Command | Action | ServeDuring


def lenbatch(*args: str, env: dict[str, str] | None = None) -> Command:
    """`lenbatch ARGS`, with `env` added to its environment."""
    return Command("lenbatch", args, tuple((env or {}).items()))


def script(name: str, *args: str) -> Command:
    """`python bench/NAME ARGS`."""
    return Command("python", (f"bench/{name}", *args))
