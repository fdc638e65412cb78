"""lm-evaluation-harness against the real stack: `local-completions` scores a small
multiple-choice task (written here, loaded from a local JSONL file) through echo + logprobs,
and its accuracy equals the same task run through Hugging Face transformers in-process on
the same model. Nothing is fetched from a hub (offline mode)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"),
    ("Russia", "Moscow"), ("Greece", "Athens"), ("Norway", "Oslo"), ("Kenya", "Nairobi"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"), ("China", "Beijing"),
    ("Poland", "Warsaw"), ("Sweden", "Stockholm"), ("Cuba", "Havana"), ("Chile", "Santiago"),
    ("Thailand", "Bangkok"), ("Hungary", "Budapest"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Turkey", "Ankara"),
    ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("India", "New Delhi"),
    ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"), ("Iran", "Tehran"),
]  # fmt: skip
TASK = """task: redserve_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_task")
    rng = random.Random(0)
    cities = [city for _, city in CAPITALS]
    with (folder / "capitals.jsonl").open("w") as f:
        for country, city in CAPITALS:
            choices = [city, *rng.sample([c for c in cities if c != city], 3)]
            rng.shuffle(choices)
            row = {"country": country, "choices": [f" {c}" for c in choices],
                   "answer": choices.index(city)}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    (folder / "capitals.yaml").write_text(TASK.format(data=folder / "capitals.jsonl"))
    return folder


def _accuracy(task_dir: Path, model: str, model_args: str) -> float:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results: Any = simple_evaluate(
        model=model, model_args=model_args, tasks=["redserve_capitals"],
        task_manager=TaskManager(include_path=str(task_dir)), batch_size=8,
    )  # fmt: skip
    return float(results["results"]["redserve_capitals"]["acc,none"])


def test_local_completions_accuracy_equals_transformers(
    stack: Stack, model_path: str, task_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    served = _accuracy(
        task_dir, "local-completions",
        f"base_url={stack.base_url}/v1/completions,model=default,tokenizer={model_path},"
        "tokenized_requests=True,num_concurrent=4,max_retries=1",
    )  # fmt: skip
    local = _accuracy(task_dir, "hf", f"pretrained={model_path},dtype=float32,device=cpu")
    assert 0.25 < local  # the task measures something: above chance (4 choices)
    assert abs(served - local) <= 1 / len(CAPITALS), (served, local)
