"""`ray-lenbatch-p2c`: lenbatch's Ray app with Ray's default routing (power of two choices).

python -m lenbatch.replay.peers.ray_lenbatch_p2c --port 8203
"""

from __future__ import annotations

from lenbatch.replay.peers.ray_lenbatch import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main(routing="pow2"))
