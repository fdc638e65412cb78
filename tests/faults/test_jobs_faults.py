"""The jobs tier under real faults: `redserve jobs` (arq) killed with SIGKILL in the middle of
a batch, a new jobs worker started. The maintenance cron sees the batch's lease gone and
queues a new run, which resumes from the output file: the batch completes with every
custom_id exactly once, each answer the same as the request sent directly (fp32, greedy)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.fleet import Fleet, assert_invariants

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_LINES = 16
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    fleet.settings.files_dir = str(tmp_path_factory.mktemp("files"))
    fleet.start("detok", "detokenizer")
    fleet.start("api", "api")
    fleet.start("sched", "scheduler")
    fleet.start("jobs-a", "jobs", env={"REDSERVE_JOBS__MAX_LINES_IN_FLIGHT": "4"})
    return fleet


def _body(i: int) -> dict[str, Any]:
    question = f"Tell me a fact about the number {i}."
    return {"model": "default", "temperature": 0, "max_tokens": 16, "ignore_eos": True,
            "messages": [{"role": "user", "content": question}]}  # fmt: skip


def test_a_killed_jobs_worker_is_resumed_by_the_next_with_each_line_once(stack: Fleet) -> None:
    client = OpenAI(base_url=stack.url() + "/v1", api_key="unused", max_retries=0)
    bodies = {f"line-{i}": _body(i) for i in range(NUM_LINES)}
    data = "\n".join(json.dumps({"custom_id": c, "method": "POST", "url": CHAT, "body": b})
                     for c, b in bodies.items()).encode()  # fmt: skip
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                  completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch.id)
        if batch.request_counts and batch.request_counts.completed >= 3:
            break
        time.sleep(0.1)
    stack.kill("jobs-a")
    at_kill = client.batches.retrieve(batch.id)
    assert at_kill.status == "in_progress" and at_kill.request_counts is not None
    assert 3 <= at_kill.request_counts.completed < NUM_LINES
    stack.start("jobs-b", "jobs")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and batch.status not in ("completed", "failed"):
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", f"{batch}\n{stack.logs()}"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (NUM_LINES, 0)
    assert batch.output_file_id is not None
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(bodies)  # each exactly once
    runs = {line["response"]["request_id"].split("-")[-2] for line in lines}
    assert runs == {"0", "1"}  # lines from the killed run and from the one that resumed it
    for line in lines:
        body = dict(bodies[line["custom_id"]])
        extra = {"ignore_eos": body.pop("ignore_eos")}
        direct = client.chat.completions.create(**body, extra_body=extra)
        answer = line["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == direct.choices[0].message.content, line["custom_id"]
    r = stack.redis()
    assert not r.exists(stack.keys.batch_lines(batch.id))
    assert not r.exists(stack.keys.batch_lease(batch.id))
    parts = list(Path(stack.settings.files_dir).glob("*.part"))
    assert parts == []
    assert_invariants(stack)
    assert stack.stop("jobs-b") == 0
