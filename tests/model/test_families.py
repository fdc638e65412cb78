"""Our forward for each supported family against Hugging Face's, on tiny random-weight models
built from transformers' config classes (no download): logits allclose in fp32, for a batched
prefill and for a decode step over the paged KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.engine import BLOCK_SIZE, hand_seqs, step
from tests.support.models import SMALL, random_hf_model
from tests.support.routing import route_every_size
from workers.scheduler.engine import model_runner
from workers.scheduler.engine.model_runner import DECODE_MATMUL_MIN_SEQS, TorchModelRunner
from workers.scheduler.kernels.paged_decode import kernel_library, paged_decode
from workers.scheduler.layers.attention_tuning import AttentionChoice
from workers.scheduler.layers.prepacked import PrepackedLinear, can_prepack
from workers.scheduler.layers.quantization import fits, quantize_model
from workers.scheduler.layers.tiered import DENSE, TieredLinear
from workers.scheduler.model import llama
from workers.scheduler.model.checkpoint import load_model
from workers.scheduler.model.config import ModelArgs


def _configs() -> dict[str, Any]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama-tied": LlamaConfig(**SMALL, tie_word_embeddings=True),
        "llama-bias": LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
        "qwen2": Qwen2Config(**SMALL, tie_word_embeddings=False),
        "qwen2-tied": Qwen2Config(**SMALL, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),
        "qwen3-bias": Qwen3Config(**SMALL, head_dim=8, attention_bias=True),
        "mistral": MistralConfig(**SMALL, head_dim=16, sliding_window=4096),
    }


FAMILIES = ["llama-tied", "llama-bias", "qwen2", "qwen2-tied", "qwen3", "qwen3-bias", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(HF model, folder it was saved to) with every weight random, biases and norms too."""
    model = random_hf_model(_configs()[request.param], weight_std=0.05)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_logits_match_hugging_face_in_prefill_and_decode(family: Any) -> None:
    hf, folder = family
    runner = TorchModelRunner.load(str(folder), num_kv_blocks=16, block_size=BLOCK_SIZE)
    assert runner.model.args.tie_word_embeddings == hf.config.tie_word_embeddings
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (21, 9, 16)]
    seqs = hand_seqs(prompts)
    with torch.inference_mode():
        hidden = step(runner, seqs)
        ours = runner.model.compute_logits(hidden).split([len(p) for p in prompts])
        for p, logits in zip(prompts, ours, strict=True):
            theirs = hf(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4)
        # Two decode steps over the paged cache.
        for token in (7, 8):
            for seq in seqs:
                seq.append_token(token)
            ours_last = runner.model.compute_logits(step(runner, seqs))
            for seq, logits in zip(seqs, ours_last, strict=True):
                theirs = hf(torch.tensor([seq.token_ids])).logits[0, -1]
                torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4)


def test_int4_runs_every_family_close_to_fp32(family: Any) -> None:
    """Random weights are the worst case for int4 (no Q4 origin: logits move by up to ~20%
    of their range), so the check is loose: every family's shapes pack, and the compact
    path's logits follow the dense ones."""
    _, folder = family
    dense = TorchModelRunner.load(str(folder), num_kv_blocks=16, block_size=BLOCK_SIZE)
    int4 = TorchModelRunner.load(
        str(folder), num_kv_blocks=16, block_size=BLOCK_SIZE, quantization="int4"
    )
    assert isinstance(int4.model.layers[0].mlp.gate_up_proj, TieredLinear)
    route_every_size(int4.model)  # the compact kernels, whatever is fastest here
    prompts = [[3, 5, 7, 11, 13], [2, 4, 6]]
    seqs = {name: hand_seqs(prompts) for name in ("dense", "int4")}
    with torch.inference_mode():
        for runner, name in ((dense, "dense"), (int4, "int4")):
            step(runner, seqs[name])  # prefill: 8 tokens
            for seq in seqs[name]:
                seq.append_token(9)
        exact = dense.model.compute_logits(step(dense, seqs["dense"]))
        compact = int4.model.compute_logits(step(int4, seqs["int4"]))
    assert not torch.equal(compact, exact)
    # Measured: correlation 0.980-0.993 over the families (a wrong packing gives ~0).
    correlation = torch.corrcoef(torch.stack([compact.flatten(), exact.flatten()]))[0, 1]
    assert correlation > 0.95


@pytest.mark.parametrize("kernel", ["matmuls", "bf16 sdpa", "paged"])
def test_bf16_decode_attention_follows_sdpa(
    family: Any, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bf16 CPU decode paths (two matmuls over K/V gathered head-major, SDPA on the
    bf16 tensors, or the C kernel reading the cache in place) against SDPA in fp32 on the
    same cache and inputs: grouped-query heads, and sequences of unequal lengths (up to 18
    tokens over two blocks, the shorter ones padded)."""
    if kernel == "paged" and kernel_library() is None:
        pytest.skip("no C compiler here: the paged decode kernel is not built")
    _, folder = family
    runner = TorchModelRunner.load(
        str(folder), num_kv_blocks=32, block_size=BLOCK_SIZE, dtype="bfloat16"
    )
    runner.use_attention(AttentionChoice(upcast_sdpa=True, matmul_decodes=True))
    calls: list[int] = []
    monkeypatch.setattr(llama, "paged_decode", lambda *a: calls.append(1) or paged_decode(*a))
    lengths = [18, 3, 5, 1, 9, 16, 17, 2][:DECODE_MATMUL_MIN_SEQS]
    seqs = hand_seqs([list(range(3, 3 + n)) for n in lengths])
    with torch.inference_mode():
        step(runner, seqs)
        for seq in seqs:
            seq.append_token(9)
            seq.num_new_tokens = 1
        assert runner._prepare(seqs[1:]).groups[0].score_bias is None  # too few: SDPA
        input_ids = torch.full((len(seqs),), 9)
        batch = runner._prepare(seqs)
        (group,) = batch.groups
        assert group.score_bias is not None
        score_bias = group.score_bias
        group.score_bias = None  # the general path: upcast, SDPA
        reference = runner.model(input_ids, batch, runner.kv_cache).float()
        if kernel == "matmuls":
            group.score_bias = score_bias
        elif kernel == "paged":
            runner.use_attention(AttentionChoice(True, True, paged_decodes=True))
            batch = runner._prepare(seqs)
            assert batch.groups[0].block_tables is not None
        else:
            runner.use_attention(AttentionChoice(upcast_sdpa=False, matmul_decodes=False))
        fast = runner.model(input_ids, batch, runner.kv_cache).float()
    # The kernel, fp32 throughout as the reference, may give its very bits after rounding.
    assert len(calls) == (len(runner.model.layers) if kernel == "paged" else 0)
    assert kernel == "paged" or not torch.equal(fast, reference)
    error = (fast - reference).abs().max() / reference.abs().max()
    # Measured: 0.008-0.010 either way (the matmuls on another CPU 0.007-0.016: bf16
    # rounding); no mask 0.36-0.92, wrong kv head 0.06-0.60.
    assert error < 0.03, error


def test_bf16_prefill_attention_without_the_upcast_follows_it(family: Any) -> None:
    """Prefill chunks through SDPA on bf16 tensors against SDPA upcast to fp32: three
    sequences' prompts, then a second chunk of one of them over its cached first."""
    _, folder = family
    outputs = []
    for upcast in (True, False):
        runner = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE, dtype="bfloat16")
        runner.use_attention(AttentionChoice(upcast_sdpa=upcast, matmul_decodes=True))
        seqs = hand_seqs([list(range(3, 3 + n)) for n in (21, 9, 16)])
        with torch.inference_mode():
            hidden = [step(runner, seqs)]
            seqs[0].token_ids.extend(range(40, 48))  # within its 2 blocks
            hidden.append(step(runner, seqs[:1]))
        outputs.append(torch.cat(hidden).float())
    reference, native = outputs
    assert not torch.equal(native, reference)
    error = (native - reference).abs().max() / reference.abs().max()
    assert error < 0.03, error  # measured 0.008-0.010


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_attention_as_matmuls_follows_sdpa(family: Any, dtype: str) -> None:
    """Prefill chunks through `Attention._attend_matmuls` (contexts up to the runner's
    `matmul_prefill_max_context`) against SDPA: three prompts of unequal lengths (padded
    query rows), then a second chunk of one of them over its cached first (a mask that
    starts mid-context), in fp32 (only the summation order differs) and in bf16."""
    _, folder = family
    outputs = []
    for max_context in (0, 64):
        runner = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE, dtype=dtype)
        runner.use_attention(AttentionChoice(True, True, matmul_prefill_max_context=max_context))
        seqs = hand_seqs([list(range(3, 3 + n)) for n in (21, 9, 16)])
        with torch.inference_mode():
            for seq in seqs:
                seq.num_new_tokens = seq.num_uncomputed_tokens
            (group,) = runner._prepare(seqs).groups  # contexts of 2 blocks: 32 tokens
            assert (group.score_bias is not None) is (max_context > 0)
            hidden = [step(runner, seqs)]
            seqs[0].token_ids.extend(range(40, 48))  # within its 2 blocks
            hidden.append(step(runner, seqs[:1]))
        outputs.append(torch.cat(hidden).float())
    reference, matmuls = outputs
    error = (matmuls - reference).abs().max() / reference.abs().max()
    # Measured: fp32 ~1e-7, bf16 ~0.01; a mask shifted by one position 0.1-0.5.
    assert error < (1e-5 if dtype == "float32" else 0.03), error


def test_prefill_chunks_over_longer_contexts_or_more_scores_stay_on_sdpa(
    family: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, folder = family
    runner = TorchModelRunner.load(str(folder), 32, BLOCK_SIZE, dtype="bfloat16")
    runner.use_attention(AttentionChoice(True, True, matmul_prefill_max_context=32))
    seqs = hand_seqs([list(range(3, 3 + n)) for n in (40, 9)])  # 48 and 32 tokens gathered
    for seq in seqs:
        seq.num_new_tokens = seq.num_uncomputed_tokens
    assert runner._prepare(seqs).groups[0].score_bias is None
    assert runner._prepare(seqs[1:]).groups[0].score_bias is not None
    # 9 x 32 scores a head: more than timed in steps of 8 tokens over 32
    monkeypatch.setattr(model_runner, "PREFILL_TOKENS", 8)
    assert runner._prepare(seqs[1:]).groups[0].score_bias is None


@pytest.mark.skipif(
    not can_prepack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_bf16_prepacked_projections_give_the_plain_bits(family: Any, quantization: str) -> None:
    """A bf16 runner's projections (int4's dense ones too) prepacked in oneDNN's layout give
    exactly what `F.linear` gives on the plain weights, prefill and decode."""
    _, folder = family
    packed = TorchModelRunner.load(
        str(folder), 16, BLOCK_SIZE, dtype="bfloat16", quantization=quantization
    )
    plain = TorchModelRunner(load_model(folder, torch.bfloat16, "cpu"), 16, BLOCK_SIZE)
    quantize_model(plain.model, quantization)
    for runner in (packed, plain):
        route_every_size(runner.model, DENSE)
        runner.use_attention(AttentionChoice(upcast_sdpa=True, matmul_decodes=True))
        runner.use_fused_step(0)  # decode steps through the projections too
    linears = [m for m in packed.model.modules() if isinstance(m, PrepackedLinear)]
    assert len(linears) == 4 * len(packed.model.layers) + 1  # and the LM head, wrapped or not
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 19)]
    outputs = []
    with torch.inference_mode():
        for runner in (packed, plain):
            seqs = hand_seqs(prompts)
            hidden = [step(runner, seqs)]
            for seq in seqs:
                seq.append_token(9)
            hidden.append(step(runner, seqs))
            outputs.append([runner.model.compute_logits(h) for h in hidden])
    for ours, theirs in zip(*outputs, strict=True):
        assert torch.equal(ours, theirs)


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(NotImplementedError, match="llama, mistral, qwen2, qwen3"):
        ModelArgs.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_a_sliding_window_shorter_than_the_context_caps_the_context() -> None:
    from transformers import MistralConfig, Qwen2Config

    mistral = MistralConfig(**{**SMALL, "max_position_embeddings": 8192}, sliding_window=4096)
    assert ModelArgs.from_hf_config(mistral.to_dict()).max_position_embeddings == 4096
    unused = Qwen2Config(**{**SMALL, "max_position_embeddings": 8192}, sliding_window=4096)
    assert ModelArgs.from_hf_config(unused.to_dict()).max_position_embeddings == 8192


@pytest.mark.parametrize(
    ("in_features", "out_features", "bits", "packs"),
    [
        (64, 96, 4, True),
        (64, 100, 4, False),
        (63, 96, 4, False),
        (64, 100, 8, True),
        (63, 16, 8, False),
    ],
)
def test_shapes_the_packed_kernels_cannot_take_stay_dense(
    in_features: int, out_features: int, bits: int, packs: bool
) -> None:
    assert fits(torch.nn.Linear(in_features, out_features), bits) is packs


def test_weights_missing_from_the_folder_are_an_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(**SMALL).save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="weights missing"):
        TorchModelRunner.load(str(tmp_path), num_kv_blocks=4, block_size=BLOCK_SIZE)
