#!/usr/bin/env python3
"""Structured outputs from lenbatch against vLLM's, on the same real prompts.

    bench/run.py llm-structured-vllm
    python bench/llm_structured_vllm.py --prompts 16 --out FILE

Starts `lenbatch serve --model smollm2` (its defaults on this CPU, `--serve-args` added),
then vLLM CPU (`vllm-allcores`: float32, the same GGUF weights dequantized to a transformers
folder; its default structured-output backend), one at a time, and sends both the same greedy
calls over GSM8K questions (the bundled `gsm8k_test.jsonl`), one at a time:

* `json`: chat with OpenAI's `response_format` `json_schema` (an answer and its unit);
* `choice`: completions with `structured_outputs.choice` (yes or no);
* `regex`: completions with `structured_outputs.regex` (`The answer is N.`);
* `tool`: the `json` call's chat with `tools` and `tool_choice` naming `give_answer`;
* `tools`: the same with `tool_choice: required` (two tools);
* `free`: the `json` call's chat without a `response_format`, the baseline of time per token.

It reports per server and kind: answers that follow their constraint (checked here with
`jsonschema` and `re`, not by either server), those that ended by themselves (`stop`, or
`tool_calls`), texts identical to the other server's, mean completion tokens, and wall
milliseconds per completion token (calls in sequence; prefill included, so compare kinds
within a server and servers within a kind). Then every `json` and every `free` call again,
all at once (one batch: what the token masks cost beside each other), with their output
tokens per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from llm_logprobs_vllm import emit, served, smollm2_pair
from llm_logprobs_vllm import prompts as questions

MAX_TOKENS = 96
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "number"},
        "unit": {"type": "string", "maxLength": 24},
    },
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no"]
PATTERN = r"The answer is [0-9]{1,6}\."
UNIT_TOOL = {
    "type": "object",
    "properties": {"unit": {"type": "string", "maxLength": 24}},
    "required": ["unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "give_answer", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ask_unit", "parameters": UNIT_TOOL}},
]
TOOL_PARAMS = {"give_answer": SCHEMA, "ask_unit": UNIT_TOOL}
KINDS = ("json", "choice", "regex", "tool", "tools", "free")
PEER_ARGS = "--enable-auto-tool-choice --tool-call-parser pythonic"


def call(url: str, model: str, kind: str, question: str) -> dict[str, Any]:
    """One greedy call of `kind`: its text, finish reason, completion tokens and wall seconds."""
    import httpx

    common = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS}
    if kind in ("json", "free", "tool", "tools"):
        route = "chat/completions"
        ask = f"{question}\nReply with JSON: the numeric answer and its unit."
        body: dict[str, Any] = {"messages": [{"role": "user", "content": ask}], **common}
        if kind == "json":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA},
            }
        elif kind in ("tool", "tools"):
            body["tools"] = TOOLS
            body["tool_choice"] = (
                {"type": "function", "function": {"name": "give_answer"}}
                if kind == "tool"
                else "required"
            )
    else:
        route = "completions"
        tail = "Is the answer more than 50? Answer yes or no:" if kind == "choice" else ""
        body = {"prompt": f"Question: {question}\n{tail}", **common}
        body["structured_outputs"] = {"choice": CHOICES} if kind == "choice" else {"regex": PATTERN}
    start = time.perf_counter()
    resp = httpx.post(f"{url}/v1/{route}", json=body, timeout=600)
    wall = time.perf_counter() - start
    if resp.status_code != 200:  # counted as not following, its status kept in the text
        return {"text": f"<{resp.status_code}: {resp.text[:120]}>", "finish": "error",
                "tokens": 0, "wall": wall}  # fmt: skip
    out = resp.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    calls = (choice.get("message") or {}).get("tool_calls")
    if calls:  # the calls, as comparable text: [[name, arguments parsed], ...]
        text = json.dumps(
            [[c["function"]["name"], json.loads(c["function"]["arguments"])] for c in calls]
        )
    return {
        "text": text or "",
        "finish": choice["finish_reason"],
        "tokens": out["usage"]["completion_tokens"],
        "wall": wall,
    }


def follows(kind: str, text: str) -> bool:
    """True when `text` follows `kind`'s constraint (free text always does)."""
    if kind == "free":
        return True
    if kind in ("tool", "tools"):
        import jsonschema

        try:
            calls = json.loads(text)
            for name, args in calls:
                jsonschema.validate(args, TOOL_PARAMS[name])
        except (ValueError, TypeError, KeyError, jsonschema.ValidationError):
            return False
        return bool(calls) and (kind == "tools" or calls[0][0] == "give_answer")
    if kind == "choice":
        return text in CHOICES
    if kind == "regex":
        return re.fullmatch(PATTERN, text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def together(url: str, model: str, kind: str, texts: list[str]) -> dict[str, Any]:
    """Every call of `kind` at once: the answers, and output tokens per wall second."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        runs = list(pool.map(lambda t: call(url, model, kind, t), texts))
    wall = time.perf_counter() - start
    return {"runs": runs, "tok_s": sum(r["tokens"] for r in runs) / wall, "wall": wall}


def run_all(url: str, model: str, texts: list[str]) -> dict[str, Any]:
    """Every kind's calls in sequence (one warm-up call of each first), then the `json` and
    `free` calls all at once."""
    for kind in KINDS:  # each kind's first call pays its one-time costs here
        call(url, model, kind, texts[0])
    out: dict[str, Any] = {kind: [call(url, model, kind, t) for t in texts] for kind in KINDS}
    out["together"] = {k: together(url, model, k, texts) for k in ("json", "free")}
    return out


def table(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Markdown rows: per kind, each server's figures."""
    rows = [
        "| kind | server | follow the constraint | ended by themselves | identical to the "
        "other's | mean tokens | ms per token |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        a, b = ours[kind], theirs[kind]
        same = sum(x["text"] == y["text"] for x, y in zip(a, b, strict=True))
        for name, runs in (("lenbatch", a), ("vLLM", b)):
            n = len(runs)
            ok = sum(follows(kind, r["text"]) for r in runs)
            stopped = sum(r["finish"] in ("stop", "tool_calls") for r in runs)
            tokens = sum(r["tokens"] for r in runs)
            ms = 1000 * sum(r["wall"] for r in runs) / max(tokens, 1)
            rows.append(
                f"| {kind} | {name} | {ok}/{n} | {stopped}/{n} | {same}/{n} | "
                f"{tokens / n:.1f} | {ms:.1f} |"
            )
    return rows


def main() -> int:
    """Run both servers and print (and with --out write) the table and the texts."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--serve-args", default="", help="more `lenbatch serve` flags")
    p.add_argument(
        "--peer-args",
        default=PEER_ARGS,
        help=f"more `vllm serve` flags (default {PEER_ARGS!r}: vLLM takes tool_choice "
        "required or named only with a tool-call parser set; pythonic needs no special "
        "tokens in the vocabulary)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from lenbatch.runners.hardware import processor_key

    texts = questions(args.prompts)
    ours_t, peer_t = smollm2_pair(args.serve_args)
    peer_t = dataclasses.replace(peer_t, argv=(*peer_t.argv, *shlex.split(args.peer_args)))
    ours = served(ours_t, lambda url, model: run_all(url, model, texts))
    theirs = served(peer_t, lambda url, model: run_all(url, model, texts))
    batch_rows = [
        "| kind, all calls at once | server | follow the constraint | identical to the "
        "other's | output tok/s | wall s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for kind in ("json", "free"):
        a, b = ours["together"][kind], theirs["together"][kind]
        same = sum(x["text"] == y["text"] for x, y in zip(a["runs"], b["runs"], strict=True))
        for name, r in (("lenbatch", a), ("vLLM", b)):
            ok = sum(follows(kind, x["text"]) for x in r["runs"])
            batch_rows.append(
                f"| {kind} | {name} | {ok}/{len(texts)} | {same}/{len(texts)} | "
                f"{r['tok_s']:.1f} | {r['wall']:.1f} |"
            )
    cmd = " ".join(["python bench/llm_structured_vllm.py", *sys.argv[1:]])
    lines = [
        "# Structured outputs: lenbatch against vLLM CPU, same prompts",
        "",
        f"Command: `{cmd}`  ",
        f"Processor: `{processor_key()}`; lenbatch `serve --model smollm2 {args.serve_args}` "
        "(its defaults on this CPU), vLLM `vllm-allcores` (float32, the GGUF's weights "
        f"dequantized, its default structured-output backend, `{args.peer_args}`); "
        f"{len(texts)} GSM8K questions, "
        f"greedy, `max_tokens={MAX_TOKENS}`, calls in sequence. Constraints checked here with "
        f"`jsonschema` and `re`: json = chat `response_format` `json_schema` {json.dumps(SCHEMA)}; "
        f"choice = completions `structured_outputs.choice` {CHOICES}; regex = "
        f"`structured_outputs.regex` `{PATTERN}`; tool = the json call's chat with `tools` "
        f"(give_answer: the json schema; ask_unit: {json.dumps(UNIT_TOOL)}) and `tool_choice` "
        "naming give_answer; tools = the same with `tool_choice: required` (calls compared as "
        "names and parsed arguments); free = the json call's chat unconstrained.",
        "",
        *table(ours, theirs),
        "",
        *batch_rows,
        "",
        "## First texts of each kind (lenbatch / vLLM)",
        "",
    ]
    for kind in KINDS:
        for i in range(min(3, len(texts))):
            lines.append(
                f"- {kind} {i}: `{ours[kind][i]['text'][:160]!r}` / "
                f"`{theirs[kind][i]['text'][:160]!r}`"
            )
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
