"""Regenerate docs/configuration.md from the field docstrings in src/lenbatch/config/.

    .venv/bin/python docs/gen_config.py > docs/configuration.md    (or: make docs)

A test checks the committed page matches, so the documentation cannot drift from the code.
"""

from __future__ import annotations

from pydantic import BaseModel

from lenbatch.config import Settings

HEADER = """# Configuration

`lenbatch serve` merges, lowest first: defaults, `--config FILE` (`.toml`, `.yaml`/`.yml`),
environment variables `LENBATCH_<SECTION>__<FIELD>` (lists comma-separated, e.g.
`LENBATCH_BATCHING__BOUNDARIES=32,64,128`), then command-line flags. Unknown keys are errors.

This page is generated from the field docstrings in `src/lenbatch/config/` by
`docs/gen_config.py` (`make docs`); a test keeps it in step with the code.
"""


def render() -> str:
    """The Markdown page."""
    out = [HEADER]
    for section, field in Settings.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            # a list of tables (`[[models]]`): its entries' fields are documented above
            out += [f"## `[[{section}]]`", "", (field.description or "").strip(), ""]
            continue
        out += [
            f"## `[{section}]`",
            "",
            (model.__doc__ or "").strip(),
            "",
            "| field | default | meaning |",
            "|---|---|---|",
        ]
        for name, f in model.model_fields.items():
            default = getattr(f.default, "value", f.default)
            meaning = " ".join((f.description or "").split())  # a table cell is one line
            out.append(f"| `{name}` | `{default!r}` | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
