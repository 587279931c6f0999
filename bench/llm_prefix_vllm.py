#!/usr/bin/env python3
"""Prefix caching: chats that share a long few-shot system prompt, lenbatch against vLLM.

    bench/run.py llm-prefix-vllm
    python bench/llm_prefix_vllm.py --questions 16 --shots 8 --out FILE

A common shape of real traffic: every call carries the same long instructions and worked
examples (here `--shots` solved GSM8K problems, question and answer, from the bundled
`gsm8k_test.jsonl`), then its own question (the next `--questions` of the file). Three servers,
one at a time, get the same greedy chat calls, streamed:

* lenbatch `serve --model smollm2` with its prefix cache (the default);
* the same with `--prefix-cache-mb 0` (every prompt prefilled whole: the baseline);
* vLLM CPU (`vllm-allcores`: float32, the GGUF's weights dequantized; its prefix caching is
  on by default), with `--enable-prompt-tokens-details` so that it reports cached tokens too.

Each server first gets `--questions` other questions all at once on the system prompt it
has not seen (a burst on a new prompt: whoever prefills the shared head once wins), then one
warm-up call (another question: it fills the cache), then the questions one at a time (time
to first token and wall time per call), then all at once (a burst: TTFT P50 and P95, output
tokens per second). The report gives each server's figures,
the prompt tokens each says it took from its cache, and how many answers are identical to
the baseline's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from llm_logprobs_vllm import emit, served, smollm2_pair

MAX_TOKENS = 32
PEER_ARGS = "--enable-prompt-tokens-details"


def gsm8k(n: int) -> list[dict[str, str]]:
    """The first `n` problems of the bundled GSM8K test split (question and answer)."""
    path = Path(str(resources.files("lenbatch") / "data" / "text")) / "gsm8k_test.jsonl"
    return [json.loads(r) for r in path.read_text(encoding="utf-8").splitlines()[:n]]


def system_prompt(shots: list[dict[str, str]]) -> str:
    """Instructions and worked examples, the same for every call."""
    parts = [
        "You solve grade-school math word problems. Think step by step, show each "
        "calculation, and end with a line '#### N' giving the answer. Worked examples follow."
    ]
    for i, s in enumerate(shots, 1):
        parts.append(f"Example {i}.\nQuestion: {s['question']}\nAnswer: {s['answer']}")
    return "\n\n".join(parts)


def call(url: str, model: str, system: str, question: str) -> dict[str, Any]:
    """One greedy streamed chat call: its text, TTFT, wall time, tokens and cached tokens."""
    import httpx

    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, first, usage = [], None, {}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(text),
        "ttft": (first or end) - start,
        "wall": end - start,
        "prompt": usage.get("prompt_tokens", 0),
        "tokens": usage.get("completion_tokens", 0),
        "cached": details.get("cached_tokens") or 0,
    }


def at_once(url: str, model: str, system: str, questions: list[str]) -> tuple[list[Any], float]:
    """Every question at once: the calls' results and the wall seconds."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        runs = list(pool.map(lambda q: call(url, model, system, q), questions))
    return runs, time.perf_counter() - start


def run_all(
    url: str, model: str, system: str, questions: list[str], warm: str, cold: list[str]
) -> dict[str, Any]:
    """The `cold` questions all at once on a system prompt the server has not seen, then a
    warm-up call, the questions in sequence, then all at once."""
    out: dict[str, Any] = {}
    out["cold"], out["cold_wall"] = at_once(url, model, system, cold)
    call(url, model, system, warm)
    out["seq"] = [call(url, model, system, q) for q in questions]
    out["burst"], out["burst_wall"] = at_once(url, model, system, questions)
    return out


def _p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20, method="inclusive")[18] if len(xs) > 1 else xs[0]


def rows(name: str, r: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """Markdown rows of one server: in sequence and in the burst."""
    out = []
    names = {"cold": "all at once, new system prompt", "seq": "one at a time",
             "burst": "all at once"}  # fmt: skip
    for phase in ("cold", "seq", "burst"):
        runs = r[phase]
        ttft = [1000 * x["ttft"] for x in runs]
        prompt = sum(x["prompt"] for x in runs)
        cached = sum(x["cached"] for x in runs)
        same = sum(x["text"] == y["text"] for x, y in zip(runs, base[phase], strict=True))
        if phase == "seq":
            tok_s = sum(x["tokens"] for x in runs) / sum(x["wall"] for x in runs)
        else:
            tok_s = sum(x["tokens"] for x in runs) / r[f"{phase}_wall"]
        out.append(
            f"| {name} | {names[phase]} | "
            f"{statistics.median(ttft):.0f} | {_p95(ttft):.0f} | {tok_s:.1f} | "
            f"{prompt / len(runs):.0f} | {cached}/{prompt} | {same}/{len(runs)} |"
        )
    return out


def main() -> int:
    """Run the three servers and print (and with --out write) the table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--shots", type=int, default=8, help="worked examples in the system prompt")
    p.add_argument("--serve-args", default="", help="more `lenbatch serve` flags")
    p.add_argument(
        "--peer-args", default=PEER_ARGS, help=f"more `vllm serve` flags ({PEER_ARGS!r})"
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from lenbatch.runners.hardware import processor_key

    n = args.questions
    problems = gsm8k(args.shots + 2 * n + 1)
    system = system_prompt(problems[: args.shots])
    warm = problems[args.shots]["question"]
    questions = [x["question"] for x in problems[args.shots + 1 : args.shots + 1 + n]]
    cold = [x["question"] for x in problems[args.shots + 1 + n :]]
    ours_t, peer_t = smollm2_pair(args.serve_args)
    off_t = dataclasses.replace(
        ours_t, name=f"{ours_t.name}-no-prefix", argv=(*ours_t.argv, "--prefix-cache-mb", "0")
    )
    peer_t = dataclasses.replace(peer_t, argv=(*peer_t.argv, *shlex.split(args.peer_args)))

    def work(url: str, model: str) -> dict[str, Any]:
        return run_all(url, model, system, questions, warm, cold)

    results = {}
    for name, target in (("lenbatch", ours_t), ("lenbatch, prefix cache off", off_t)):
        results[name] = served(target, work)
    results["vLLM"] = served(peer_t, work)
    base = results["lenbatch, prefix cache off"]
    cmd = " ".join(["python bench/llm_prefix_vllm.py", *sys.argv[1:]])
    lines = [
        "# Prefix caching: a shared few-shot system prompt, lenbatch against vLLM CPU",
        "",
        f"Command: `{cmd}`  ",
        f"Processor: `{processor_key()}`; lenbatch `serve --model smollm2 {args.serve_args}` "
        "(its defaults on this CPU), the same with `--prefix-cache-mb 0`, and vLLM "
        f"`vllm-allcores` (float32, the GGUF's weights dequantized, `{args.peer_args}`), one "
        f"at a time. Chat calls, greedy, streamed, `max_tokens={MAX_TOKENS}`: a system prompt "
        f"of instructions and {args.shots} worked GSM8K problems, then one of "
        f"{len(questions)} other GSM8K questions. First {len(cold)} more questions all at "
        "once on the system prompt the server has not seen yet, then one warm-up call "
        "(another question), then the questions one at a time, then all at once.",
        "",
        "| server | calls | TTFT P50 ms | TTFT P95 ms | output tok/s | mean prompt tokens | "
        "prompt tokens cached | texts identical to lenbatch without its cache |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines += rows(name, r, base)
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
