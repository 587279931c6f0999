"""The peers `lenbatch bench --peer NAME` can launch: name -> module run with `python -m`."""

from __future__ import annotations

__all__ = ["PEERS"]

PEERS = {"naive": "lenbatch.replay.peers.naive", "ray": "lenbatch.replay.peers.ray_serve"}
# lenbatch's own Ray Serve app (lenbatch.scaleout): length-aware routing / Ray's default routing.
PEERS["ray-lenbatch"] = "lenbatch.replay.peers.ray_lenbatch"
PEERS["ray-lenbatch-p2c"] = "lenbatch.replay.peers.ray_lenbatch_p2c"
