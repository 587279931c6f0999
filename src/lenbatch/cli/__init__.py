"""`lenbatch` command line: one module per subcommand, each with `register()` and `run()`;
`main` builds the parser from them. This package is the only place that reads argv and the
environment."""

from __future__ import annotations

from lenbatch.cli.main import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
