"""Offline planning, never on the serving path: traces and their analysis, the padding model,
boundary fitting, the cost model and its profile and calibration, the simulator, sweeps, the
oracle and the tuner. Import the module you need (`lenbatch.plan.sim`, ...): this package
re-exports nothing, so a command pays only for what it uses."""

from __future__ import annotations

__all__: list[str] = []
