"""What every settings section shares: frozen models that refuse unknown keys and take each
field's docstring as its description (the configuration page is generated from them)."""

from __future__ import annotations

from pydantic import ConfigDict

__all__ = ["FROZEN"]

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
