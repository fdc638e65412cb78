"""Load generator for any OpenAI-compatible server (streaming /v1/completions).

    python bench/serving.py --url http://127.0.0.1:30000 --tokenizer PATH \
        --input-len 128 --output-len 128 --concurrency 1 4 16 64 --num-prompts 64

Prompts are cut to exactly --input-len tokens of the given tokenizer and sent as token-id
lists, so every server sees the same prompt lengths. Greedy, ignore_eos where the server
accepts it, so every request produces --output-len tokens. Prints one row per concurrency
(output tok/s, req/s, TTFT/ITL/E2E p50 and p99, failures) and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

SEED_TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Science is a body of "
    "empirical, theoretical, and practical knowledge about the natural world, produced by "
    "scientists who emphasize the observation, explanation, and prediction of real-world "
    "phenomena. "
)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_prompts(tokenizer_path: str, n: int, input_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tok(SEED_TEXT * (input_len // 40 + 2))["input_ids"]
    # Rotate the start so prompts differ (no shared prefix beyond chance).
    return [(ids[i % 17 :] + ids)[:input_len] for i in range(n)]


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    res, last = Result(ok=False), 0.0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Result(ok=False, error=f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.e2e, res.ok = time.perf_counter() - start, True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def run_level(
    url: str, model: str, prompts: list[list[int]], concurrency: int, output_len: int
) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    # A fresh connection per request, as independent clients: llama-server closes idle
    # keep-alive connections, and a request sent on one as it closes fails with "Server
    # disconnected without sending a response" (1-4 per level in a sitting).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def guarded(p: list[int]) -> Result:
            async with sem:
                return await one_request(client, model, p, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - start
    return summarize(results, wall, concurrency)


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def summarize(results: list[Result], wall: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens or len(r.itls) + 1 for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failures": len(results) - len(ok),
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "req_s": len(ok) / wall,
        "ttft_p50": _pct([r.ttft for r in ok], 50),
        "ttft_p99": _pct([r.ttft for r in ok], 99),
        "itl_p50": _pct(itls, 50),
        "itl_p99": _pct(itls, 99),
        "e2e_p50": _pct([r.e2e for r in ok], 50),
        "e2e_p99": _pct([r.e2e for r in ok], 99),
        "errors": sorted({r.error for r in results if not r.ok}),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        "| conc | reqs | fail | out tok/s | req/s | TTFT p50 | TTFT p99 "
        "| ITL p50 | ITL p99 | E2E p50 | E2E p99 |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['concurrency']:.0f} | {r['requests']:.0f} | {r['failures']:.0f} "
            f"| {r['output_tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50']:.3f} s "
            f"| {r['ttft_p99']:.3f} s | {r['itl_p50'] * 1000:.1f} ms "
            f"| {r['itl_p99'] * 1000:.1f} ms "
            f"| {r['e2e_p50']:.2f} s | {r['e2e_p99']:.2f} s |"
        )
    for r in rows:
        if r["errors"]:
            lines.append(f"\nfailures at concurrency {r['concurrency']}: {'; '.join(r['errors'])}")
    sys.stdout.write("\n".join(lines) + "\n")


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=args.url, timeout=30) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
    if args.warmup:  # first-call costs (and a scheduler still loading) stay out of the rows
        await run_level(args.url, model, make_prompts(args.tokenizer, args.warmup, 16), 1, 8)
    rows = []
    for conc in args.concurrency:
        n = max(args.num_prompts, conc) if args.num_prompts else conc * 2
        prompts = make_prompts(args.tokenizer, n, args.input_len)
        rows.append(await run_level(args.url, model, prompts, conc, args.output_len))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default="", help="model name to send (default: first of /v1/models)")
    p.add_argument("--tokenizer", required=True, help="HF folder used to cut prompts to length")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default 2x concurrency)")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured short requests first")
    args = p.parse_args()
    sys.stdout.write("command: " + " ".join(sys.argv) + "\n")
    rows = asyncio.run(main_async(args))
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
