"""What both servers share: the engine lifecycle, the HTTP shell (app, guard, error shape,
draining uvicorn server), the metrics recorder and the length log."""

from __future__ import annotations

from lenbatch.serving.http import new_app
from lenbatch.serving.http_errors import error_response
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.metrics import Metrics
from lenbatch.serving.server import DrainingServer, serve_app

__all__ = ["DrainingServer", "LengthLog", "Metrics", "error_response", "new_app", "serve_app"]
