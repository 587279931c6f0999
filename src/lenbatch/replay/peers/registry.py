"""The peers `lenbatch bench --peer NAME` can launch.

`PEERS`: name -> module of this package run with `python -m` in lenbatch's own venv.
`EXTERNAL_PEERS`: name -> `module:attribute` of an `ExternalPeer` (another project's server,
in its own venv under `.venv-peers/`; see `peers.external`).
"""

from __future__ import annotations

import importlib

from lenbatch.replay.peers.external import ExternalPeer

__all__ = ["EXTERNAL_PEERS", "PEERS", "external_peer"]

PEERS = {
    "naive": "lenbatch.replay.peers.naive",
    "ray": "lenbatch.replay.peers.ray_serve",
    # lenbatch's own Ray Serve app (lenbatch.scaleout): length-aware / Ray's default routing.
    "ray-lenbatch": "lenbatch.replay.peers.ray_lenbatch",
    "ray-lenbatch-p2c": "lenbatch.replay.peers.ray_lenbatch_p2c",
}

EXTERNAL_PEERS = {
    "infinity": "lenbatch.replay.peers.infinity:INFINITY",
    "infinity-bf16": "lenbatch.replay.peers.infinity:INFINITY_BF16",
    "vllm": "lenbatch.replay.peers.vllm:VLLM",
    "vllm-allcores": "lenbatch.replay.peers.vllm:VLLM_ALL_CORES",
    "vllm-bf16": "lenbatch.replay.peers.vllm:VLLM_BF16",
    "llamacpp": "lenbatch.replay.peers.llamacpp:LLAMACPP",
}


def external_peer(name: str) -> ExternalPeer:
    """The `ExternalPeer` registered as `name` (imported on demand)."""
    module, attr = EXTERNAL_PEERS[name].split(":")
    peer: ExternalPeer = getattr(importlib.import_module(module), attr)
    return peer
