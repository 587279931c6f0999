"""Live measurement against running servers: the open-loop driver, its results, request bodies
of exact token lengths, synthetic scenarios, endpoint protocols, the one-command bench with its
report, and the peers it compares against. Import the module you need (`lenbatch.replay.driver`,
...): this package re-exports nothing, so a command pays only for what it uses."""

from __future__ import annotations

__all__: list[str] = []
