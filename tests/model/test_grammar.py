"""Structured output through our core + runner on the real SmolLM2 (no Redis): xgrammar
masks the batch's constrained rows, every output fits its grammar, and the unconstrained
neighbours' greedy output does not change."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from shared.protocol import Grammar, SamplingParams
from tests.support.core import drive
from workers.scheduler.core.scheduler import Scheduler, SchedulerConfig
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.model_runner import TorchModelRunner
from workers.scheduler.grammar.compiler import GrammarCompiler

pytestmark = pytest.mark.model

EOS = 2
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def runner(model_path: str) -> TorchModelRunner:
    return TorchModelRunner.load(model_path, num_kv_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any, runner: TorchModelRunner) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, runner.vocab_size)


def chat(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def constrained(
    compiler: GrammarCompiler, rid: str, prompt: list[int], sp: SamplingParams
) -> Sequence:
    seq = Sequence(rid, prompt, sp)
    if sp.grammar is not None:
        compiler.compile(sp.grammar).result(timeout=60)  # `drive` does not wait for it
        seq.grammar = compiler.constraint(sp.grammar, seq.output_ids)
    return seq


def run(runner: TorchModelRunner, seqs: list[Sequence], **config: Any) -> list[Sequence]:
    core = Scheduler(
        SchedulerConfig(**{
            "num_kv_blocks": 256, "vocab_size": runner.vocab_size, "max_model_len": 2048,
            "eos_token_ids": frozenset({EOS}), **config,
        }),
        decode_tail=lambda ids: "",
    )  # fmt: skip
    drive(core, seqs, runner.run)
    return seqs


def text(tokenizer: Any, seq: Sequence) -> str:
    return str(tokenizer.decode(seq.output_ids, skip_special_tokens=True))


def test_json_schema_outputs_validate_greedy_and_sampled_beside_free_requests(
    tokenizer: Any, runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    prompt = chat(tokenizer, "Describe a person as JSON.")
    free_prompt = chat(tokenizer, "What is the capital of France?")
    schema = Grammar("json_schema", json.dumps(PERSON))
    greedy_free = SamplingParams(temperature=0, max_new_tokens=16)
    alone = run(runner, [Sequence("alone", free_prompt, greedy_free)])[0].output_ids
    seqs = [
        constrained(compiler, "greedy", prompt, SamplingParams(temperature=0, max_new_tokens=120,
                                                                grammar=schema)),
        Sequence("free", free_prompt, greedy_free),
        *[
            constrained(compiler, f"sampled{i}", prompt,
                        SamplingParams(temperature=1.0, seed=i, max_new_tokens=120, grammar=schema))
            for i in range(3)
        ],
    ]  # fmt: skip
    run(runner, seqs)
    assert seqs[1].output_ids == alone  # the neighbours' grammars changed nothing here
    for seq in seqs[:1] + seqs[2:]:
        assert seq.finish is not None and seq.finish.type == "stop", (seq.rid, seq.finish)
        assert seq.output_ids[-1] == EOS
        jsonschema.validate(json.loads(text(tokenizer, seq)), PERSON)
    assert len({text(tokenizer, s) for s in seqs[2:]}) > 1  # sampling still samples


def test_regex_and_ebnf_outputs_match(
    tokenizer: Any, runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    prompt = chat(tokenizer, "Give me a date and a colour.")
    date = r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d"
    ebnf = 'root ::= "The colour is " colour "."\ncolour ::= "red" | "green" | "blue"'
    seqs = [
        constrained(compiler, "re", prompt, SamplingParams(temperature=0, max_new_tokens=20,
                                                            grammar=Grammar("regex", date))),
        constrained(compiler, "ebnf", prompt, SamplingParams(temperature=0.7, seed=3,
                                                              max_new_tokens=20,
                                                              grammar=Grammar("ebnf", ebnf))),
    ]  # fmt: skip
    run(runner, seqs)
    assert re.fullmatch(date, text(tokenizer, seqs[0]))
    assert re.fullmatch(r"The colour is (red|green|blue)\.", text(tokenizer, seqs[1]))
    assert all(s.finish is not None and s.finish.type == "stop" for s in seqs)


def test_a_resumed_request_continues_its_grammar_where_it_stood(
    tokenizer: Any, runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    prompt = chat(tokenizer, "Describe a person as JSON.")
    sp = SamplingParams(temperature=0, max_new_tokens=120,
                        grammar=Grammar("json_schema", json.dumps(PERSON)))  # fmt: skip
    whole = run(runner, [constrained(compiler, "whole", prompt, sp)])[0].output_ids
    # A new owner after a crash: the prompt plus the first ids the dead one published.
    resumed = Sequence("resumed", prompt, sp)
    resumed.resume(whole[:7])
    resumed.grammar = compiler.constraint(sp.grammar, resumed.output_ids)  # type: ignore[arg-type]
    assert resumed.is_ready  # compiled before, cached
    assert run(runner, [resumed])[0].output_ids == whole


def test_a_grammar_that_is_complete_ends_the_request_with_stop(
    tokenizer: Any, runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=50, min_new_tokens=30,
                        grammar=Grammar("regex", "yes|no"))  # fmt: skip
    seq = run(runner, [constrained(compiler, "yn", chat(tokenizer, "Yes or no?"), sp)])[0]
    assert text(tokenizer, seq) in ("yes", "no")
    assert seq.finish is not None and seq.finish.type == "stop"


def test_a_grammar_that_does_not_compile_is_refused_by_the_core(
    runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    sp = SamplingParams(max_new_tokens=4, grammar=Grammar("regex", "[a-"))
    seq = Sequence("bad", [1, 2, 3], sp)
    seq.grammar = compiler.constraint(Grammar("regex", "[a-"), [])
    core = Scheduler(
        SchedulerConfig(num_kv_blocks=16, vocab_size=runner.vocab_size, max_model_len=64),
        decode_tail=lambda ids: "",
    )
    assert core.add(seq) is None
    failed: list[Sequence] = []
    while not failed:
        assert core.schedule() == []  # never started, compiling or failed
        failed = core.fail_grammars()
    assert failed == [seq]
    assert seq.finish is not None and seq.finish.status_code == 400
    assert "Unclosed" in str(seq.finish.message) and core.is_idle


def test_chunked_prefill_and_preemption_keep_each_grammar_in_step(
    tokenizer: Any, runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=60,
                        grammar=Grammar("json_schema", json.dumps(PERSON)))  # fmt: skip
    prompts = [chat(tokenizer, f"Describe person number {i} as JSON.") for i in range(4)]

    def outputs(**config: Any) -> tuple[list[list[int]], int]:
        seqs = [constrained(compiler, f"p{i}", p, sp) for i, p in enumerate(prompts)]
        run(runner, seqs, **config)
        return [s.output_ids for s in seqs], sum(s.num_preemptions for s in seqs)

    roomy, _ = outputs()
    # 8-token prompt chunks, and KV for about two of the four at once: preemptions.
    squeezed, preemptions = outputs(num_kv_blocks=12, max_num_batched_tokens=8)
    assert preemptions > 0 and squeezed == roomy


def test_a_retracted_request_keeps_its_grammar_state(
    tokenizer: Any, runner: TorchModelRunner, compiler: GrammarCompiler
) -> None:
    """Pause with mode retract mid-output (KV freed, back to the queue), then continue: the
    same ids as a run that was never retracted."""
    sp = SamplingParams(temperature=0, max_new_tokens=60,
                        grammar=Grammar("json_schema", json.dumps(PERSON)))  # fmt: skip
    prompt = chat(tokenizer, "Describe a person as JSON.")
    whole = run(runner, [constrained(compiler, "whole", prompt, sp)])[0].output_ids
    seq = constrained(compiler, "retracted", prompt, sp)
    core = Scheduler(
        SchedulerConfig(num_kv_blocks=256, vocab_size=runner.vocab_size, max_model_len=2048,
                        eos_token_ids=frozenset({EOS})),
        decode_tail=lambda ids: "",
    )  # fmt: skip
    assert core.add(seq) is None
    while seq.num_completion_tokens < 12:
        batch = core.schedule()
        core.postprocess(batch, runner.run(batch))
    assert core.retract_all() == 1 and seq.block_table == []
    while not core.is_idle:  # continue: recomputed from its tokens, grammar untouched
        batch = core.schedule()
        core.postprocess(batch, runner.run(batch))
    assert seq.output_ids == whole


def test_llguidance_backend_outputs_validate_and_resume(
    tokenizer: Any, runner: TorchModelRunner
) -> None:
    """--grammar-backend llguidance: JSON schemas and regexes through llguidance (EBNF stays
    on xgrammar), in one batch; a resume continues exactly."""
    compiler = GrammarCompiler(tokenizer, runner.vocab_size, backend="llguidance")
    prompt = chat(tokenizer, "Describe a person as JSON.")
    person = SamplingParams(temperature=0, max_new_tokens=120,
                            grammar=Grammar("json_schema", json.dumps(PERSON)))  # fmt: skip
    date = SamplingParams(temperature=0.8, seed=2, max_new_tokens=20,
                          grammar=Grammar("regex", r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d"))  # fmt: skip
    colour = SamplingParams(temperature=0, max_new_tokens=20, grammar=Grammar(
        "ebnf", 'root ::= "The colour is " ("red" | "green") "."'))  # fmt: skip
    seqs = [constrained(compiler, r, prompt, sp)
            for r, sp in (("person", person), ("date", date), ("colour", colour))]  # fmt: skip
    assert [s.grammar.backend for s in seqs] == ["llguidance", "llguidance", "xgrammar"]  # type: ignore[union-attr]
    run(runner, seqs)
    jsonschema.validate(json.loads(text(tokenizer, seqs[0])), PERSON)
    assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d", text(tokenizer, seqs[1]))
    assert re.fullmatch(r"The colour is (red|green)\.", text(tokenizer, seqs[2]))
    assert all(s.finish is not None and s.finish.type == "stop" for s in seqs)
    resumed = Sequence("resumed", prompt, person)
    resumed.resume(seqs[0].output_ids[:9])
    resumed.grammar = compiler.constraint(person.grammar, resumed.output_ids)  # type: ignore[arg-type]
    assert run(runner, [resumed])[0].output_ids == seqs[0].output_ids
    bad = compiler.constraint(Grammar("json_schema", '{"type": "foo"}'), [])
    while not bad.ready:
        pass
    assert bad.failure is not None and "foo" in bad.failure
