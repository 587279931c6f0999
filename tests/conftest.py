"""Shared test set-up: never reach for a model hub."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Import Hypothesis now, at a shallow stack: CPython 3.11.7 can raise "AST constructor
# recursion depth mismatch" when pytest's assertion rewriter first imports it from deep inside
# the terminal-summary hook at the end of a session that never used it.
import hypothesis  # noqa: F401
