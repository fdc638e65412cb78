"""A Batch API batch beside interactive streams: does offline work hurt interactive latency?

Against one running redserve (with its jobs tier), rounds alternate:
  alone:  --streams closed-loop clients, each sending --requests streaming completions;
  batch:  a batch of --lines completion lines is created and started, then the same clients
          run while it runs (the batch goes on to its end after them).
Prints per mode the streams' TTFT p50/p99, ITL p50 and output tok/s, and for the batch its
lines and output tokens per second, over its whole run and while the streams ran.

    redserve up &
    python -m bench.batch --url http://127.0.0.1:30000 --tokenizer PATH --lines 500 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from typing import Any

import httpx

from bench.serving import Result, _pct, make_prompts, one_request

TERMINAL = ("completed", "failed", "cancelled", "expired")


async def streams(
    url: str, model: str, prompts: list[list[int]], clients: int, output_len: int
) -> tuple[list[Result], float]:
    """`clients` closed-loop clients sharing `prompts` (each sends its share in turn)."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def one_client(k: int) -> list[Result]:
            return [await one_request(client, model, p, output_len) for p in prompts[k::clients]]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(k) for k in range(clients)))
        return [r for rs in per_client for r in rs], time.perf_counter() - start


async def start_batch(
    client: httpx.AsyncClient, model: str, prompts: list[list[int]], output_len: int
) -> str:
    lines = [
        {"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                  "ignore_eos": True}}
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    data = "\n".join(json.dumps(x) for x in lines).encode()
    files = {"file": ("bench.jsonl", io.BytesIO(data), "application/jsonl")}
    uploaded = (await client.post("/v1/files", files=files, data={"purpose": "batch"})).json()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}  # fmt: skip
    batch = (await client.post("/v1/batches", json=body)).json()
    while (await client.get(f"/v1/batches/{batch['id']}")).json()["status"] == "validating":
        await asyncio.sleep(0.05)
    return str(batch["id"])


async def batch_state(client: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    state: dict[str, Any] = (await client.get(f"/v1/batches/{batch_id}")).json()
    return state


def stream_row(mode: str, results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "mode": mode,
        "requests": len(results),
        "failures": len(results) - len(ok),
        "ttft_p50": _pct([r.ttft for r in ok], 50),
        "ttft_p99": _pct([r.ttft for r in ok], 99),
        "itl_p50": _pct([x for r in ok for x in r.itls], 50),
        "tok_s": sum(r.output_tokens or len(r.itls) + 1 for r in ok) / wall,
    }


async def one_round(args: argparse.Namespace, model: str, prompts: list[list[int]],
                    batch_prompts: list[list[int]]) -> list[dict[str, Any]]:  # fmt: skip
    results, wall = await streams(args.url, model, prompts, args.streams, args.output_len)
    alone = stream_row("alone", results, wall)
    async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:
        batch_id = await start_batch(client, model, batch_prompts, args.batch_output_len)
        begun = time.perf_counter()
        results, wall = await streams(args.url, model, prompts, args.streams, args.output_len)
        during = (await batch_state(client, batch_id))["request_counts"]["completed"]
        beside = stream_row("with batch", results, wall)
        beside["batch_lines_s_during"] = during / wall
        state = await batch_state(client, batch_id)
        while state["status"] not in TERMINAL:
            await asyncio.sleep(0.5)
            state = await batch_state(client, batch_id)
        total_s = time.perf_counter() - begun
    counts = state["request_counts"]
    beside.update(batch_status=state["status"], batch_lines=counts["completed"],
                  batch_failed=counts["failed"], batch_s=total_s,
                  batch_tok_s=counts["completed"] * args.batch_output_len / total_s)  # fmt: skip
    return [alone, beside]


def _batch_cell(r: dict[str, Any]) -> str:
    if "batch_s" not in r:
        return ""
    return (f"{r['batch_lines']} ok / {r['batch_failed']} failed ({r['batch_status']}), "
            f"{r['batch_s']:.0f} s, {r['batch_tok_s']:.0f}")  # fmt: skip


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = ("| round | mode | reqs | fail | TTFT p50 | TTFT p99 | ITL p50 | stream tok/s "
            "| batch lines/s while streams ran | batch: lines, s, tok/s |")  # fmt: skip
    out = [head, "|" + "---|" * 10]
    for i, r in enumerate(rows):
        during = f"{r['batch_lines_s_during']:.2f}" if "batch_lines_s_during" in r else ""
        out.append(f"| {i // 2 + 1} | {r['mode']} | {r['requests']} | {r['failures']} "
                   f"| {r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p99'] * 1000:.0f} ms "
                   f"| {r['itl_p50'] * 1000:.1f} ms | {r['tok_s']:.1f} | {during} "
                   f"| {_batch_cell(r)} |")  # fmt: skip
    alone = [r["ttft_p50"] for r in rows if r["mode"] == "alone"]
    beside = [r["ttft_p50"] for r in rows if r["mode"] == "with batch"]
    ratio = (sum(beside) / len(beside)) / (sum(alone) / len(alone))
    out.append(f"\nTTFT p50 with the batch / alone (mean over rounds): {ratio:.2f}x")
    sys.stdout.write("\n".join(out) + "\n")


async def main_async(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=args.url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    n = args.streams * args.requests
    prompts = make_prompts(args.tokenizer, n, args.input_len)
    batch_prompts = make_prompts(args.tokenizer, args.lines, args.input_len)
    await streams(args.url, model, prompts[: args.streams], args.streams, 8)  # warm-up
    rows = []
    for _ in range(args.rounds):
        rows += await one_round(args, model, prompts, batch_prompts)
    print_rows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--tokenizer", required=True, help="the served model's folder")
    parser.add_argument("--streams", type=int, default=8, help="interactive clients")
    parser.add_argument("--requests", type=int, default=6, help="requests per client")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--lines", type=int, default=500, help="lines of the batch")
    parser.add_argument("--batch-output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
