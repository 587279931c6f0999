"""uvicorn's per-request access log is off unless asked for (`--access-log` or
`server.access_log`), and the setting reaches uvicorn's config."""

from __future__ import annotations

from typing import Any

import pytest

from lenbatch.cli import build_parser
from lenbatch.cli.serve import settings_from_args
from lenbatch.config import Settings
from lenbatch.serving import server


def test_off_by_default_and_on_with_the_flag() -> None:
    assert Settings().server.access_log is False
    plain = build_parser().parse_args(["serve"])
    assert settings_from_args(plain).server.access_log is False
    on = build_parser().parse_args(["serve", "--access-log"])
    assert settings_from_args(on).server.access_log is True


@pytest.mark.parametrize("wanted", [False, True])
def test_serve_app_hands_the_setting_to_uvicorn(
    wanted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(server.DrainingServer, "run", lambda self: seen.append(self.config))
    settings = Settings.model_validate({"server": {"access_log": wanted}})
    server.serve_app(object(), object(), settings)  # type: ignore[arg-type]
    assert [c.access_log for c in seen] == [wanted]
