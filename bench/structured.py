"""Structured output's cost: throughput of concurrent chat streams under a JSON-schema
constraint against the same streams unconstrained, against one running server, rounds
interleaved (free, json, free, json, ...) so a noisy machine's drift hits both alike; and
grammar compile times, cold and cached, in-process with the model's tokenizer.

    redserve up &   # or any OpenAI-compatible server
    python -m bench.structured --url http://127.0.0.1:30000 --tokenizer PATH \
        --concurrency 16 --output-len 128 --rounds 3

Every request asks for exactly --output-len tokens: the schema is an object holding a long
array of strings (it cannot close before that), the free requests ignore eos. Prints one
row per mode (output tok/s, TTFT p50, ITL p50) and the ratio, then the compile table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import httpx


def words_schema(max_length: int | None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "string"}
    if max_length:
        item["maxLength"] = max_length
    words = {"type": "array", "minItems": 200, "items": item}
    return {"type": "object", "properties": {"words": words}, "required": ["words"]}


# Mode -> schema (None: unconstrained). Bounded strings cost xgrammar far more per mask.
MODES: dict[str, dict[str, Any] | None] = {
    "unconstrained": None,
    "json_schema (strings)": words_schema(None),
    "json_schema (strings, maxLength 12)": words_schema(12),
}
SCHEMA = words_schema(12)
SCHEMAS = [  # for compile times: small to larger
    {"type": "object", "properties": {"a": {"type": "integer"}}},
    SCHEMA,
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string",
                                                             "pattern": "^[0-9]{5}$"}}}},
     "required": ["name", "age"]},
]  # fmt: skip


async def one(client: httpx.AsyncClient, i: int, output_len: int, schema: dict[str, Any] | None
              ) -> tuple[float, list[float], int]:  # fmt: skip
    body: dict[str, Any] = {
        "model": "default", "stream": True, "temperature": 0, "max_tokens": output_len,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"List {i + 3} words about the sea, as JSON."}],
    }  # fmt: skip
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "words", "schema": schema}}
    else:
        body["ignore_eos"] = True
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ttft = stamps[0] - start if stamps else float("nan")
    return ttft, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], tokens


async def level(url: str, concurrency: int, output_len: int, schema: dict[str, Any] | None
                ) -> dict[str, Any]:  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            one(client, i, output_len, schema) for i in range(concurrency)))  # fmt: skip
        wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    itls = [x for r in results for x in r[1]]
    return {"tok_s": tokens / wall, "tokens": tokens, "ttft_p50": statistics.median(
        r[0] for r in results), "itl_p50": statistics.median(itls) if itls else float("nan")}


def compile_times(tokenizer_path: str) -> list[tuple[str, float, float]]:
    """(schema, cold ms, cached ms) with a fresh compiler; the first cold one includes the
    vocabulary's preprocessing (TokenizerInfo), shown as its own row."""
    from transformers import AutoConfig, AutoTokenizer

    from shared.protocol import Grammar
    from workers.scheduler.grammar.compiler import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    vocab = AutoConfig.from_pretrained(tokenizer_path).vocab_size
    compiler = GrammarCompiler(tokenizer, vocab)
    rows = []
    start = time.perf_counter()
    compiler._xgrammar_compiler()  # noqa: SLF001 - the one-off vocabulary preprocessing
    rows.append(("(vocabulary preprocessing, once per scheduler)",
                 (time.perf_counter() - start) * 1000, 0.0))  # fmt: skip
    for schema in SCHEMAS:
        spec = Grammar("json_schema", json.dumps(schema))
        start = time.perf_counter()
        compiler.compile(spec).result()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec).result()
        rows.append((json.dumps(schema)[:60], cold * 1000, (time.perf_counter() - start) * 1000))
    compiler.close()
    return rows


async def main_async(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:  # warm up all
        for schema in MODES.values():
            await one(client, 0, 8, schema)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, schema in MODES.items():
            runs[mode].append(await level(args.url, args.concurrency, args.output_len, schema))
    lines = [f"| mode ({args.concurrency} streams, {args.output_len} tokens, {args.rounds} "
             "rounds) | output tok/s (median; each round) | vs unconstrained | TTFT p50 s | "
             "ITL p50 ms |", "|---|---|---|---|---|"]  # fmt: skip
    base = statistics.median(r["tok_s"] for r in runs["unconstrained"])
    for mode, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("tok_s", "ttft_p50", "itl_p50")}
        rounds = ", ".join(f"{r['tok_s']:.1f}" for r in rows)
        lines.append(f"| {mode} | {med['tok_s']:.1f} ({rounds}) | {med['tok_s'] / base:.2f}x | "
                     f"{med['ttft_p50']:.2f} | {med['itl_p50'] * 1000:.1f} |")  # fmt: skip
    if args.tokenizer:
        lines.append("\n| grammar | cold ms | cached ms |\n|---|---|---|")
        for name, cold, cached in compile_times(args.tokenizer):
            lines.append(f"| `{name}` | {cold:.1f} | {cached:.3f} |")
    sys.stdout.write("command: " + " ".join(sys.argv) + "\n" + "\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--tokenizer", default="", help="HF folder: also time grammar compiles")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
