"""Scale-out on Ray Serve: lenbatch engine replicas behind a length-aware request router.

`lenbatch serve --ray --replicas N` runs `app.run`; `app.build_app` gives the bound application
for `serve.run` or a Serve config. Needs `pip install 'lenbatch[ray]'`. The pure parts (length
ranges, group assignment, spill ranking) are `lenbatch.core.ranges`.
"""

from __future__ import annotations

__all__: list[str] = []
