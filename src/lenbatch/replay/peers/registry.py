"""The peers `lenbatch bench --peer NAME` can launch: name -> module run with `python -m`."""

from __future__ import annotations

__all__ = ["PEERS"]

PEERS = {"naive": "lenbatch.replay.peers.naive", "ray": "lenbatch.replay.peers.ray_serve"}
