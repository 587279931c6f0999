#!/usr/bin/env python3
"""Log-probabilities from lenbatch's completions against vLLM's, on the same real prompts.

    bench/run.py llm-logprobs-vllm
    python bench/llm_logprobs_vllm.py --prompts 24 --tokens 16 --out FILE

Starts `lenbatch serve --model smollm2` (its defaults on this CPU, `--serve-args` added),
then vLLM CPU (`vllm-allcores`: float32, the same GGUF weights dequantized to a transformers
folder), one at a time, and sends both the same calls: greedy completions of GSM8K
questions (the bundled `gsm8k_test.jsonl`) with `logprobs=5`, `ignore_eos` and token ids as
names (`return_tokens_as_token_ids`, which both servers take), then `echo` with `logprobs=5`
and `max_tokens=1` (the prompt's own log-probabilities, as evaluation harnesses ask for them).

It reports, over every generated position where the two greedy sequences still agree: how
many sequences are identical, the mean and largest |difference| of the chosen token's
log-probability, and how often the two top-5 sets are the same set; and the same for the
echoed prompt tokens (every prompt token after the first). Both are float32 arithmetic over
the same weights: differences come from summation order and kernels (and, on lenbatch's
default int4 path, from its own float32 activations over the 4-bit groups).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOP = 5
T = TypeVar("T")


def prompts(n: int) -> list[str]:
    """`n` GSM8K questions from the bundled texts (the test split's first)."""
    path = Path(str(resources.files("lenbatch") / "data" / "text")) / "gsm8k_test.jsonl"
    rows = path.read_text(encoding="utf-8").splitlines()[:n]
    return [json.loads(r)["question"] for r in rows]


def ask(url: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """One completion call's first choice's `logprobs`, as parsed JSON."""
    import httpx

    resp = httpx.post(f"{url}/v1/completions", json={"model": model, **body}, timeout=300)
    resp.raise_for_status()
    out: dict[str, Any] = resp.json()["choices"][0]["logprobs"]
    return out


def collect(url: str, model: str, texts: list[str], tokens: int) -> dict[str, list[Any]]:
    """Each prompt's greedy `logprobs` and its echoed `logprobs` from the server at `url`."""
    common = {"temperature": 0, "logprobs": TOP, "return_tokens_as_token_ids": True}
    gen = [
        ask(url, model, {"prompt": t, "max_tokens": tokens, "ignore_eos": True, **common})
        for t in texts
    ]
    echo = [ask(url, model, {"prompt": t, "max_tokens": 1, "echo": True, **common}) for t in texts]
    return {"gen": gen, "echo": echo}


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Agreement of two servers' `logprobs` objects, position by position while the chosen
    tokens agree (from position `skip` on: 1 leaves out an echo's first, null, token)."""
    diffs: list[float] = []
    same_top = positions = identical = 0
    for a, b in zip(ours, theirs, strict=True):
        ta, tb = a["tokens"], b["tokens"]
        identical += ta == tb
        for i in range(skip, min(len(ta), len(tb))):
            if ta[i] != tb[i]:
                break
            la, lb = a["token_logprobs"][i], b["token_logprobs"][i]
            diffs.append(abs(la - lb))
            top_a = sorted(a["top_logprobs"][i], key=a["top_logprobs"][i].get, reverse=True)
            top_b = sorted(b["top_logprobs"][i], key=b["top_logprobs"][i].get, reverse=True)
            same_top += set(top_a[:TOP]) == set(top_b[:TOP])
            positions += 1
    return {
        "sequences": len(ours),
        "identical": identical,
        "positions": positions,
        "mean_abs_diff": statistics.fmean(diffs) if diffs else float("nan"),
        "max_abs_diff": max(diffs, default=float("nan")),
        "same_top5": same_top / positions if positions else float("nan"),
    }


def served(target: Any, work: Callable[[str, str], T]) -> T:
    """Start `target`, run `work(url, served model name)`, stop it (the bench scripts that
    send two servers the same calls share this)."""
    import httpx

    from lenbatch.replay.process import ServerProcess, free_port

    log = Path(tempfile.mkdtemp(prefix="vllm-pair-")) / f"{target.name}.log"
    server = ServerProcess(target, free_port(), log)
    try:
        server.wait_ready()
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        return work(server.url, model)
    finally:
        server.stop()


def smollm2_pair(serve_args: str) -> tuple[Any, Any]:
    """(lenbatch `serve --model smollm2` with `serve_args`, vLLM `vllm-allcores`), ready."""
    from lenbatch.replay.targets import prepare_target, targets_for

    ours, peer = targets_for(
        ["bucketed"], ["vllm-allcores"], model="smollm2", max_batch=32,
        serve_args=shlex.split(serve_args),
    )  # fmt: skip
    return ours, prepare_target(peer, model="smollm2", endpoint="completions", max_batch=32)


def emit(text: str, out: Path | None) -> None:
    """Print a report, and write it to `out` where given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")


def main() -> int:
    """Run both servers and print (and with --out write) the agreement table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--serve-args", default="", help="more `lenbatch serve` flags")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from lenbatch.runners.hardware import processor_key

    texts = prompts(args.prompts)
    ours_t, peer_t = smollm2_pair(args.serve_args)
    ours = served(ours_t, lambda url, model: collect(url, model, texts, args.tokens))
    theirs = served(peer_t, lambda url, model: collect(url, model, texts, args.tokens))
    rows = [
        ("generated tokens", compare(ours["gen"], theirs["gen"], 0)),
        ("echoed prompt tokens", compare(ours["echo"], theirs["echo"], 1)),
    ]
    cmd = " ".join(["python bench/llm_logprobs_vllm.py", *sys.argv[1:]])
    lines = [
        "# Log-probabilities: lenbatch's completions against vLLM CPU's, same prompts",
        "",
        f"Command: `{cmd}`  ",
        f"Processor: `{processor_key()}`; lenbatch `serve --model smollm2 {args.serve_args}` "
        "(its defaults on this CPU), vLLM `vllm-allcores` (float32, the GGUF's weights "
        f"dequantized); {len(texts)} GSM8K questions, greedy, {args.tokens} tokens with "
        f"`ignore_eos`, `logprobs={TOP}`; then `echo` with `logprobs={TOP}`, `max_tokens=1`.",
        "",
        "| what | sequences | identical | positions compared | mean abs diff | max abs diff "
        "| same top-5 set |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['sequences']} | {r['identical']} | {r['positions']} | "
            f"{r['mean_abs_diff']:.2e} | {r['max_abs_diff']:.2e} | {r['same_top5']:.1%} |"
        )
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
