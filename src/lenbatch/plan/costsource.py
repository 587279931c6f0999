"""Where a command's cost model comes from: a file, `auto` (the file measured on this
processor, from a folder of cost models), or a live server's online-fitted model.

`--cost` of `simulate`, `tune`, `fit`, `predict`, `bench` and `serve` takes any of the three:

- `PATH`: that JSON file (`lenbatch profile` or `lenbatch calibrate` output);
- `auto`: among the `*.json` cost models in the cost folders (`cost_folders()`: first the
  user's cache of self-calibrated models for this lenbatch and torch version
  (`plan.costcache`), then `$LENBATCH_COST_DIR` if set, else the source checkout's
  `bench/results/`, found from the package's location, never the current directory), the
  one measured on this machine's
  processor (`processor_mismatch` finds no difference: vendor, family, model number, ISA
  flags and the torch thread count; an older key without model number never matches) and
  with the quantization the command runs, preferring the float type and execution it runs
  with, then a calibrated one (non-empty `calibration`, as `calibrate --out` writes) over a
  plain profile, then the newest; no match is an error listing what the folder holds;
- `http://HOST:PORT`: the online cost model a server running strategy `adaptive` fits from its
  own batches and shows in `GET /stats` (`adaptive.cost_model`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lenbatch.core.costkey import ProcessorKey
from lenbatch.plan.costcache import cost_cache_dir
from lenbatch.plan.costmodel import CostModel, processor_mismatch

__all__ = [
    "AUTO",
    "COST_DIR_ENV",
    "SOURCE_COST_DIR",
    "CostChoice",
    "choose_auto",
    "choose_cost_file",
    "cost_folders",
    "cost_from_stats",
    "fetch_online_cost",
    "is_server_url",
    "resolve_cost",
]

AUTO = "auto"
COST_DIR_ENV = "LENBATCH_COST_DIR"
# The committed cost models of a source checkout: <checkout>/bench/results beside src/lenbatch.
# An installed wheel has no such folder (then only $LENBATCH_COST_DIR holds cost models).
SOURCE_COST_DIR = Path(__file__).resolve().parents[3] / "bench" / "results"


@dataclass(frozen=True)
class CostChoice:
    """A resolved `--cost`: the model, where it came from, and why it was taken."""

    cost: CostModel
    source: str  # the file path or the server URL
    reason: str
    from_file: bool  # False for a live server's online fit


def is_server_url(spec: str) -> bool:
    """Whether `--cost` names a live server rather than a file."""
    return spec.startswith(("http://", "https://"))


def _read_costs(folder: Path) -> tuple[list[tuple[Path, CostModel]], list[str]]:
    """The cost models in `folder`, and the JSON files there that are not cost models."""
    found: list[tuple[Path, CostModel]] = []
    other: list[str] = []
    for path in sorted(folder.glob("*.json")):
        try:
            found.append((path, CostModel.load(path)))
        except (OSError, ValueError, TypeError):
            other.append(path.name)  # another kind of JSON result (e.g. ray_overhead.json)
    return found, other


def choose_cost_file(
    folder: str | Path,
    here: str,
    *,
    dtype: str | None = None,
    execution: str | None = None,
    quantization: str | None = None,
) -> tuple[Path, str]:
    """The cost model file in `folder` measured on processor `here` (a `processor_key()`)
    with `quantization` (any when None), and why it was chosen. Ties: matching `dtype`,
    matching `execution`, calibrated, newest file. Raises ValueError naming every cost file
    and its processor when none matches."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(
            f"--cost auto: cost folder {str(root)!r} does not exist (set {COST_DIR_ENV} or "
            "run `lenbatch profile --out` there)"
        )
    costs, _ = _read_costs(root)
    matching = [
        (p, c)
        for p, c in costs
        if processor_mismatch(c, here) is None
        and (quantization is None or c.quantization == quantization)
    ]
    if not matching:
        listed = (
            "; ".join(
                f"{p.name}: {c.processor or 'no processor key'}"
                + (f" {c.dtype}" if c.dtype else "")
                + (f" {c.execution}" if c.execution else "")
                + (f" quantization {c.quantization}" if c.quantization != "none" else "")
                for p, c in costs
            )
            or "no cost model files"
        )
        quant = "" if quantization is None else f" with quantization {quantization}"
        older = any(c.processor and ProcessorKey.parse(c.processor) is None for _, c in costs)
        note = (
            " (a key without model number and ISA flags is from before keys told CPUs of "
            "one family apart: it never matches)"
            if older
            else ""
        )
        raise ValueError(
            f"--cost auto: no cost model in {str(root)!r} was measured on this processor "
            f"({here!r}){quant}; it holds: {listed}{note}. Run `lenbatch profile --out FILE` "
            "here (with the same torch thread count), or pass --cost FILE"
        )

    def rank(item: tuple[Path, CostModel]) -> tuple[bool, bool, bool, float]:
        path, cost = item
        return (
            dtype is not None and cost.dtype == dtype,
            execution is not None and cost.execution == execution,
            bool(cost.calibration),
            path.stat().st_mtime,
        )

    path, cost = max(matching, key=rank)
    why = [f"measured on this processor ({here})"]
    if dtype is not None:
        why.append(f"dtype {cost.dtype or '?'}" + (" as run" if cost.dtype == dtype else ""))
    if execution is not None:
        same = " as run" if cost.execution == execution else ""
        why.append(f"execution {cost.execution or '?'}{same}")
    why.append(f"calibrated ({cost.calibration})" if cost.calibration else "plain profile")
    if len(matching) > 1:
        others = ", ".join(p.name for p, _ in matching if p != path)
        why.append(f"over {others}")
    return path, "; ".join(why)


def cost_from_stats(stats: Mapping[str, Any], url: str) -> CostModel:
    """A `CostModel` from a server's `/stats`: adaptive's online fit `a + b*B*L + c*B*L^2`
    (measured batch execution times, so `a` already holds the per-batch overhead). Raises
    ValueError when the server has no online model or has not run a batch yet."""
    adaptive = stats.get("adaptive")
    model = adaptive.get("cost_model") if isinstance(adaptive, Mapping) else None
    if not isinstance(model, Mapping):
        raise ValueError(
            f"--cost {url}: the server's /stats has no online cost model (it is shown by "
            "strategy adaptive only: start it with `lenbatch serve --strategy adaptive`)"
        )
    observed = int(model.get("observed_batches", 0))
    if observed < 1:
        raise ValueError(
            f"--cost {url}: the server's online cost model has seen no batch yet (it is only "
            f"its prior, {model.get('prior', '?')}): send it traffic first"
        )
    err = model.get("fit_error")
    # the request-side CPU per request the server measured (`core.occupancy.RequestCpu`):
    # the simulator charges it as the slowdown of the arrival rate, as the server sees it
    cpu = adaptive.get("request_cpu") if isinstance(adaptive, Mapping) else None
    cpu = cpu if isinstance(cpu, Mapping) else {}
    return CostModel(
        const=float(model["a_s"]),
        per_token=float(model["b_s_per_token"]),
        per_token_sq=float(model["c_s_per_token_sq"]),
        model=str(stats.get("model", "")),
        fit_error=float(err) if err is not None else float("nan"),
        cpu_per_request_s=float(cpu.get("cpu_per_request_ms", 0.0)) / 1000,
        cpu_cores=int(cpu.get("cores", 1)),
        # how much one batch's time varied around the fit (servers before it: none)
        batch_spread=[float(x) for x in model.get("batch_spread") or []],
        calibration=(
            f"online fit read from {url}/stats ({observed} batches, window "
            f"{model.get('window', '?')}, prior {model.get('prior', '?')})"
        ),
    )


def fetch_online_cost(url: str, timeout_s: float = 5.0) -> CostModel:
    """Read the online cost model from a live server's `GET /stats`."""
    import httpx

    base = url.rstrip("/")
    try:
        resp = httpx.get(f"{base}/stats", timeout=timeout_s)
        resp.raise_for_status()
        stats = resp.json()
    except httpx.HTTPError as exc:
        raise ValueError(f"--cost {url}: could not read {base}/stats: {exc}") from None
    except json.JSONDecodeError:
        raise ValueError(f"--cost {url}: {base}/stats did not answer JSON") from None
    if not isinstance(stats, Mapping):
        raise ValueError(f"--cost {url}: {base}/stats did not answer a JSON object")
    return cost_from_stats(stats, base)


def cost_folders(
    environ: Mapping[str, str] | None = None, *, cache: bool = False
) -> tuple[Path, ...]:
    """Where `--cost auto` looks, in order: with `cache`, the user's cache of self-calibrated
    cost models for this lenbatch and torch version (`plan.costcache.cost_cache_dir`) when it
    exists; then `$LENBATCH_COST_DIR` when set, else the source checkout's `bench/results/`
    (`SOURCE_COST_DIR`)."""
    env = os.environ if environ is None else environ
    first: tuple[Path, ...] = ()
    if cache and cost_cache_dir(env).is_dir():
        first = (cost_cache_dir(env),)
    if env.get(COST_DIR_ENV):
        return (*first, Path(env[COST_DIR_ENV]).expanduser())
    return (*first, SOURCE_COST_DIR)


def choose_auto(
    here: str,
    *,
    dtype: str | None = None,
    execution: str | None = None,
    quantization: str | None = None,
    environ: Mapping[str, str] | None = None,
    cache: bool = True,
) -> tuple[Path, str]:
    """`--cost auto`: `choose_cost_file` in each of `cost_folders()` (the self-calibration
    cache first, unless `cache` is off) until one matches; raises ValueError with every
    folder's reason when none does."""
    errors: list[str] = []
    for folder in cost_folders(environ, cache=cache):
        try:
            return choose_cost_file(
                folder, here, dtype=dtype, execution=execution, quantization=quantization
            )
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError("; ".join(errors))


def resolve_cost(
    spec: str,
    here: str,
    *,
    dtype: str | None = None,
    execution: str | None = None,
    quantization: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> CostChoice:
    """Turn a `--cost` value (PATH, `auto` or a server URL) into a cost model; `here` is this
    machine's `processor_key()`, `dtype`/`execution`/`quantization` what the command runs
    with (if known)."""
    if is_server_url(spec):
        cost = fetch_online_cost(spec)
        return CostChoice(cost, spec, cost.calibration, from_file=False)
    if spec.strip().lower() == AUTO:
        path, why = choose_auto(
            here, dtype=dtype, execution=execution, quantization=quantization, environ=environ
        )
        return CostChoice(CostModel.load(path), str(path), why, from_file=True)
    return CostChoice(CostModel.load(spec), spec, "given", from_file=True)
