"""What both model engines add to the lifecycle: lanes, queues, admission, metrics, the
scheduling loop's task and wake-up, and the worker threads the model runs in.

`BaseEngine` is the embedding engine's and the generation engine's common base. A subclass
supplies its loop (`_loop`), optionally a warm-up, and what to flush when draining begins; the
ledger, the refusals and the ordered shutdown come from `Lifecycle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from lenbatch.config import AdmissionConfig
from lenbatch.core.admission import Admission
from lenbatch.core.clock import Clock, MonotonicClock
from lenbatch.core.lanes import Lanes
from lenbatch.core.queues import Queues
from lenbatch.serving.budget import ComputeBudget
from lenbatch.serving.ledger import Ledger
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.lifecycle import EngineState, Lifecycle
from lenbatch.serving.metrics import Metrics
from lenbatch.serving.torchthread import torch_executor
from lenbatch.serving.workers import CoreWorkers, pinnable_cores

__all__ = ["BaseEngine"]

log = logging.getLogger("lenbatch.serving.engine")

T = TypeVar("T")


class BaseEngine(Lifecycle[T]):
    """Lanes, queues, admission, metrics, loop task and worker threads of one engine."""

    # Join the worker threads on stop (a unit still running in them finishes first).
    _join_workers_on_stop = False

    def __init__(
        self,
        lanes: Lanes,
        admission: AdmissionConfig | None,
        clock: Clock | None,
        *,
        metrics_label: str,
        workers: int,
        name: str,
        length_log: LengthLog | None = None,
        torch_thread: bool = False,
        pin_workers: bool = False,
    ) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.cfg = lanes.cfg  # what the scheduler runs with now (subclasses may narrow it)
        self.lane_labels = list(lanes.labels)
        self.uses_default_boundaries = lanes.default_boundaries
        self.queues = Queues(lanes.cfg)
        self.metrics = Metrics(self.lane_labels, metrics_label)
        admission = admission or AdmissionConfig()
        self.admission = Admission(admission, lanes.cfg, self.clock.now())
        self.request_timeout = admission.request_timeout_s
        super().__init__(
            Ledger(
                self.clock,
                self.metrics,
                self.lane_labels,
                length_log,
                withdraw=self.queues.remove,
                wake=self._kick,
            )
        )
        self._name = name
        # `torch_thread`: run units on the process's one torch thread (`serving.torchthread`:
        # the thread the models were loaded on), not on threads of this engine's own.
        # `pin_workers`: one worker pinned to each core (`serving.workers.CoreWorkers`) where
        # the workers are as many as the process's usable cores.
        self._shared_executor = torch_thread
        cores = pinnable_cores(workers) if pin_workers and not torch_thread else None
        self._executor: Executor
        # what /stats says of where model calls run (an engine adds its torch threads)
        self.workers_info: dict[str, Any] = {
            "batches_at_once": 1 if torch_thread else workers,
            "pinned_cores": cores,
        }
        if torch_thread:
            self._executor = torch_executor()
        elif cores is not None:
            self._executor = CoreWorkers(cores, name)
            log.info(
                "batch workers: one per core, pinned to cores %s; a batch goes to the first "
                "idle one (batching.pin_workers)",
                ", ".join(map(str, cores)),
            )
        else:
            self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        # Several models in one process: the CPU budget whose turns the model calls take.
        self.budget: ComputeBudget | None = None
        self.budget_owner = ""

    def use_budget(self, budget: ComputeBudget, owner: str) -> None:
        """Take turns on `budget` (shared with the other models' engines) for model calls,
        counted to `owner`'s share (the served model's name)."""
        self.budget = budget
        self.budget_owner = owner

    # ------------------------------------------------------------------ what subclasses supply

    async def _loop(self) -> None:
        """The scheduling loop; runs until cancelled."""
        raise NotImplementedError

    async def _warm_up(self) -> None:
        """Before the loop starts (e.g. a first forward pass); nothing by default."""

    def refresh_memory(self) -> None:
        """Read the runner's memory into the metrics."""

    def _extra_stats(self) -> dict[str, Any]:
        """Engine-specific keys of `stats()`."""
        return {}

    def _extra_prometheus(self) -> bytes:
        """Engine-specific series after the shared ones."""
        return b""

    # ------------------------------------------------------------------ lifecycle hooks

    def _on_state(self, state: EngineState) -> None:
        self.metrics.set_ready(state is EngineState.RUNNING)

    async def _prepare(self) -> None:
        await self._warm_up()
        self._wakeup = asyncio.Event()

    def _started(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name=self._name)
        self.refresh_memory()

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on and run queued ones without waiting for
        their batches to fill. Idempotent; `stop()` finishes the shutdown."""
        super().begin_drain()
        self._kick()

    def _on_drain_timeout(self) -> None:
        self.queues.drain()

    async def _halt(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._shared_executor:
            if self._join_workers_on_stop:  # the unit in flight, if any, finishes first
                await asyncio.get_running_loop().run_in_executor(self._executor, _nothing)
            return
        self._executor.shutdown(wait=self._join_workers_on_stop)

    def _release(self) -> None:
        if not self._shared_executor:
            self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ the loop's wake-up

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _sleep_until_woken(self, wake_at: float | None) -> None:
        """Wait for the wake-up event, or until clock time `wake_at` if given."""
        assert self._wakeup is not None
        timer = None
        if wake_at is not None:
            delay = max(0.0, wake_at - self.clock.now())
            timer = asyncio.get_running_loop().call_later(delay, self._wakeup.set)
        await self._wakeup.wait()
        if timer is not None:
            timer.cancel()

    # ------------------------------------------------------------------ what the routes read

    def describe(self) -> str:
        """One line for the start-up log: strategy and lanes (saying when the boundaries are
        the placeholder default rather than fitted to traffic)."""
        line = f"strategy {self.cfg.strategy.value}"
        if self.cfg.boundaries:
            line += f": boundaries {list(self.cfg.boundaries)}"
            if self.cfg.boundaries[-1] < self.cfg.max_length:
                line += f" + overlong lane up to {self.cfg.max_length}"
        if self.uses_default_boundaries:
            line += (
                " (the default for this model, not fitted to your traffic: run `lenbatch fit` "
                "on a trace or length log and pass --boundaries)"
            )
        return line

    def stats(self) -> dict[str, Any]:
        """JSON summary: waste, latency percentiles, per-bucket figures, state, lanes."""
        self.refresh_memory()
        out = self.metrics.stats()
        out["state"] = self._state.value
        out["boundaries"] = list(self.cfg.boundaries)
        out["default_boundaries"] = self.uses_default_boundaries
        out["queue_depths"] = self.queues.depths()
        out["unanswered"] = self.unanswered
        out["workers"] = dict(self.workers_info)
        out["precision"] = runner_precision(getattr(self, "runner", None))
        out.update(self._extra_stats())
        return out

    def prometheus(self) -> bytes:
        """Prometheus exposition: the per-bucket series, then the engine's own."""
        self.refresh_memory()
        return self.metrics.prometheus() + self._extra_prometheus()


def runner_precision(runner: Any) -> dict[str, str | None]:
    """What a runner computes in: its float type (None where it has none, as the fakes) and
    its weight quantization as resolved at load (`--quantize auto` says there what it found)."""
    precision = getattr(runner, "precision", None)
    return {
        "dtype": None if precision is None else precision.name,
        "quantization": getattr(runner, "quantization", "none"),
    }


def _nothing() -> None:
    """A no-op to queue behind a shared executor's work."""
