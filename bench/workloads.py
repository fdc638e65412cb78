r"""Four realistic workloads against any OpenAI-compatible server (streaming /v1/completions).

Prompts are token-id lists cut from varied English text (seeded, so every server and every
run sees identical prompts); greedy with ignore_eos, so every request produces its full
output length. The request plumbing (`one_request`, `summarize`) is bench/serving.py's.

  shared-prefix  one 1,000-token system prompt + a distinct 64-token question per request,
                 64 requests, 16 streams, 64 output tokens (the prefix cache's case)
  long-prompt    distinct 2,048-token prompts, 12 requests, 4 streams, 128 output tokens;
                 watch TTFT p50/p99 (chunked prefill's case); needs 2,176 tokens of context
  multi-turn     8 conversations of 8 turns, 8 streams, 64 output tokens per turn; turn k's
                 prompt = turn k-1's + a 64-token "assistant answer" (fixed seeded tokens,
                 not the server's output, so every server sees the same prompts) + a new
                 32-token user message; a conversation's turns run one after another
  mixed          64 requests, 16 streams, prompt lengths log-uniform in 16..1,024 and output
                 lengths log-uniform in 16..256 (seeded)

Every workload must fit one request's context: at most 2,176 tokens (long-prompt). redserve's
default context (the model's, 8,192 for SmolLM2) is enough. llama-server splits `-c` over its
`--parallel` slots, so `--parallel 16 -c 8192` leaves 512 tokens a slot: start it with
`-c 65536 --parallel 16` (4,096 a slot) so every workload fits.

    TOK=$(.venv/bin/python -c \
        "from shared.model_files import resolve_model; print(resolve_model(''))")
    llama-server -m MODEL.gguf -c 65536 --parallel 16 --port 8080 &
    python bench/workloads.py --url http://127.0.0.1:8080 --tokenizer $TOK \
        --label llama-server --out /tmp/wl-llama.json       # then stop llama-server
    redserve up &                                           # port 30000
    python bench/workloads.py --url http://127.0.0.1:30000 --tokenizer $TOK \
        --label redserve --out /tmp/wl-redserve.json
    python bench/workloads.py --compare /tmp/wl-llama.json /tmp/wl-redserve.json

`--workload long-prompt mixed` runs a subset; `--scale 0.1` cuts every workload's number of
requests (conversations) to a tenth for a quick smoke run. The prompts depend only on --seed,
so a second run against the same live server hits its prefix cache: measure each server
freshly started (or pass another --seed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# The repo root, not bench/, first: bench/kernels.py would shadow the `kernels` package
# that transformers imports.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.serving import Result, _pct, one_request, summarize  # noqa: E402

PARAGRAPHS = (
    "The history of science is the study of how knowledge about the natural world grew. "
    "Early astronomers tracked the planets long before anyone could explain their paths. "
    "Careful measurement slowly replaced appeals to authority. "
    "By the seventeenth century, experiments had become the final judge of a theory.",
    "To bake a loaf of bread, mix flour, water, salt and a little yeast into a soft dough. "
    "Knead it until it feels smooth and springs back when pressed. "
    "Let it rise in a warm corner of the kitchen for about two hours. "
    "Bake it in a hot oven until the crust is brown and the bottom sounds hollow.",
    "The river begins as a thin stream high in the mountains, fed by melting snow. "
    "It gathers tributaries as it winds through forests and narrow valleys. "
    "Near the coast it slows, spreads out, and drops the silt it carried for miles. "
    "Farmers have planted rice and wheat along its banks for thousands of years.",
    "A compiler translates a program written in one language into another, usually machine "
    "code. It first parses the source text into a tree that reflects its structure. "
    "Later passes check types, remove dead code, and choose registers for variables. "
    "Good error messages matter as much to users as fast generated code.",
    "The orchestra tuned their instruments while the audience found their seats. "
    "When the conductor raised her baton, the hall fell completely silent. "
    "The first movement opened with a quiet melody carried by the violins. "
    "By the final chord, several people in the front row were wiping their eyes.",
    "Why does the sky look blue on a clear afternoon? "
    "Sunlight is scattered by the molecules of air, and shorter wavelengths scatter more. "
    "At sunset the light crosses much more air, so the reds and oranges remain. "
    "Could you explain the same effect for the color of the ocean?",
)


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    turn: int = 0  # index within its conversation (0 for one-shot requests)


Chain = list[Request]  # requests sent one after another on one stream (a conversation)


class TokenSource:
    """Endless, seeded token-id text: PARAGRAPHS' sentences in random order."""

    def __init__(self, sentences: list[list[int]], seed: str) -> None:
        self.sentences = sentences
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[int]:
        """n token ids starting at a random point of a random sentence."""
        first = self.rng.choice(self.sentences)
        ids = list(first[self.rng.randrange(len(first)) :])
        while len(ids) < n:
            ids += self.rng.choice(self.sentences)
        return ids[:n]

    def log_uniform(self, low: int, high: int) -> int:
        return round(math.exp(self.rng.uniform(math.log(low), math.log(high))))


def tokenize_sentences(tokenizer_path: str) -> list[list[int]]:
    """Every sentence of PARAGRAPHS as token ids (leading space, so they join naturally)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    sentences = [s for p in PARAGRAPHS for s in re.split(r"(?<=[.!?])\s+", p) if s]
    return [tok(" " + s, add_special_tokens=False)["input_ids"] for s in sentences]


def scaled(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def build_shared_prefix(src: TokenSource, scale: float) -> list[Chain]:
    system = src.take(1000)
    return [[Request(system + src.take(64), 64)] for _ in range(scaled(64, scale))]


def build_long_prompt(src: TokenSource, scale: float) -> list[Chain]:
    return [[Request(src.take(2048), 128)] for _ in range(scaled(12, scale))]


def build_multi_turn(src: TokenSource, scale: float, turns: int = 8) -> list[Chain]:
    conversations = []
    for _ in range(scaled(8, scale)):
        prompt, chain = src.take(32), []
        for turn in range(turns):
            chain.append(Request(prompt, 64, turn))
            prompt = prompt + src.take(64) + src.take(32)  # "assistant answer" + next user
        conversations.append(chain)
    return conversations


def build_mixed(src: TokenSource, scale: float) -> list[Chain]:
    return [
        [Request(src.take(src.log_uniform(16, 1024)), src.log_uniform(16, 256))]
        for _ in range(scaled(64, scale))
    ]


@dataclass
class Workload:
    name: str
    streams: int  # concurrent streams (conversations in flight, for multi-turn)
    build: Callable[[TokenSource, float], list[Chain]]


WORKLOADS = {
    "shared-prefix": Workload("shared-prefix", 16, build_shared_prefix),
    "long-prompt": Workload("long-prompt", 4, build_long_prompt),
    "multi-turn": Workload("multi-turn", 8, build_multi_turn),
    "mixed": Workload("mixed", 16, build_mixed),
}


async def bounded_request(
    client: httpx.AsyncClient, model: str, req: Request, timeout_s: float
) -> Result:
    """serving.one_request with a hard deadline, so a stuck stream cannot hang the run."""
    try:
        return await asyncio.wait_for(
            one_request(client, model, req.prompt, req.output_len), timeout_s
        )
    except TimeoutError:
        return Result(ok=False, error=f"timed out after {timeout_s:g} s")


async def run_chains(
    url: str, model: str, chains: list[Chain], streams: int, timeout_s: float
) -> tuple[list[tuple[Request, Result]], float]:
    """Run the chains, at most `streams` at once, each chain's requests in order.

    Returns every (request, result) and the wall time. Like serving.run_level, a fresh
    connection per request (llama-server drops idle keep-alive connections)."""
    sem = asyncio.Semaphore(streams)
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=0)
    done: list[tuple[Request, Result]] = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def run_chain(chain: Chain) -> None:
            async with sem:
                for req in chain:
                    done.append((req, await bounded_request(client, model, req, timeout_s)))

        start = time.perf_counter()
        await asyncio.gather(*(run_chain(c) for c in chains))
        wall = time.perf_counter() - start
    return done, wall


def ttft_p50_by_turn(done: list[tuple[Request, Result]]) -> list[float]:
    """Median TTFT of each conversation turn (successful requests only)."""
    turns = max(req.turn for req, _ in done) + 1
    by_turn: list[list[float]] = [[] for _ in range(turns)]
    for req, res in done:
        if res.ok:
            by_turn[req.turn].append(res.ttft)
    return [_pct(t, 50) for t in by_turn]


async def run_workload(
    args: argparse.Namespace, model: str, sentences: list[list[int]], w: Workload
) -> dict[str, Any]:
    chains = w.build(TokenSource(sentences, f"{args.seed}-{w.name}"), args.scale)
    done, wall = await run_chains(args.url, model, chains, w.streams, args.request_timeout)
    row: dict[str, Any] = {"workload": w.name, "server": args.label}
    row |= summarize([res for _, res in done], wall, w.streams)
    row["prompt_tokens"] = sum(len(req.prompt) for req, _ in done)
    if any(len(c) > 1 for c in chains):
        row["ttft_p50_by_turn"] = ttft_p50_by_turn(done)
    return row


async def warm_up(args: argparse.Namespace, model: str, sentences: list[list[int]]) -> None:
    """A few short unmeasured requests: first-call costs stay out of the rows."""
    src = TokenSource(sentences, f"{args.seed}-warmup")
    chains = [[Request(src.take(16), 8)] for _ in range(args.warmup)]
    await run_chains(args.url, model, chains, 1, args.request_timeout)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=args.url, timeout=30) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
    sentences = tokenize_sentences(args.tokenizer)
    if args.warmup:
        await warm_up(args, model, sentences)
    rows = []
    for name in args.workload:
        rows.append(await run_workload(args, model, sentences, WORKLOADS[name]))
        sys.stdout.write(f"done: {name} ({rows[-1]['wall_s']:.1f} s)\n")
    return rows


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def print_rows(rows: list[dict[str, Any]]) -> None:
    """One markdown row per workload, then per-turn TTFT and any failures."""
    lines = [
        f"server: {rows[0]['server'] if rows else ''}",
        "| workload | ok/failed | out tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | ITL p99 (ms) | E2E p50 (s) | wall (s) |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        ok = r["requests"] - r["failures"]
        lines.append(
            f"| {r['workload']} | {ok}/{r['failures']} | {r['output_tok_s']:.1f} "
            f"| {r['req_s']:.2f} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} "
            f"| {ms(r['itl_p50'])} | {ms(r['itl_p99'])} | {r['e2e_p50']:.2f} "
            f"| {r['wall_s']:.1f} |"
        )
    for r in rows:
        if r["workload"] == "long-prompt":
            lines.append(
                f"\nlong-prompt (2,048-token prompts, {r['concurrency']} streams): "
                f"TTFT p50 {ms(r['ttft_p50'])} ms, p99 {ms(r['ttft_p99'])} ms"
            )
        if "ttft_p50_by_turn" in r:
            turns = ", ".join(ms(t) for t in r["ttft_p50_by_turn"])
            lines.append(f"\n{r['workload']}: TTFT p50 by turn (ms): {turns}")
        if r["errors"]:
            lines.append(f"\n{r['workload']} failures: {'; '.join(r['errors'])}")
    sys.stdout.write("\n".join(lines) + "\n")


def ratio(b: float, a: float) -> str:
    return f"{b / a:.2f}x" if a and not math.isnan(a) and not math.isnan(b) else "n/a"


def compare(path_a: str, path_b: str) -> None:
    """Per workload, B's figures over A's (throughput up is better; TTFT/ITL down is)."""
    runs = []
    for path in (path_a, path_b):
        with open(path) as f:
            runs.append(json.load(f))
    a, b = ({r["workload"]: r for r in run["rows"]} for run in runs)
    label_a, label_b = runs[0].get("server") or path_a, runs[1].get("server") or path_b
    lines = [
        f"B = {label_b} over A = {label_a}",
        "| workload | A out tok/s | B out tok/s | throughput B/A | TTFT p50 B/A | ITL p50 B/A |",
        "|" + "---|" * 6,
    ]
    for name in [n for n in a if n in b]:
        ra, rb = a[name], b[name]
        lines.append(
            f"| {name} | {ra['output_tok_s']:.1f} | {rb['output_tok_s']:.1f} "
            f"| {ratio(rb['output_tok_s'], ra['output_tok_s'])} "
            f"| {ratio(rb['ttft_p50'], ra['ttft_p50'])} | {ratio(rb['itl_p50'], ra['itl_p50'])} |"
        )
    missing = sorted(set(a) ^ set(b))
    if missing:
        lines.append(f"\nin only one of the files: {', '.join(missing)}")
    sys.stdout.write("\n".join(lines) + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default="", help="model name to send (default: first of /v1/models)")
    p.add_argument("--tokenizer", default="", help="HF folder whose token ids make the prompts")
    p.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--scale", type=float, default=1.0, help="multiplies requests/conversations")
    p.add_argument("--seed", type=int, default=0, help="seeds every prompt and length")
    p.add_argument("--label", default="", help="server name stored in --out (e.g. redserve)")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured short requests first")
    p.add_argument("--request-timeout", type=float, default=300, help="seconds per request")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        default=None,
        help="print B's figures over A's per workload; runs nothing",
    )
    args = p.parse_args()
    if not args.compare and not args.tokenizer:
        p.error("--tokenizer is required (unless --compare)")
    return args


def main() -> None:
    args = parse_args()
    if args.compare:
        compare(*args.compare)
        return
    sys.stdout.write("command: " + " ".join(sys.argv) + "\n")
    rows = asyncio.run(main_async(args))
    print_rows(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"server": args.label, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
