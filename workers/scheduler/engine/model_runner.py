"""The model runner: turns one scheduled step into input tensors, runs the forward over the
paged KV cache and samples one token per sequence that reached its last token. A step mixes
prefill chunks and decodes: each sequence brings `num_new_tokens` tokens from
`num_computed_tokens` on, attending to all of its cached context. Only this side of the
scheduler imports torch (with llama.py and sampler.py); the loop sees it through the
`ModelRunner` protocol. It also sizes the KV cache from a memory budget.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from shared.config import use_inductor_cache
from shared.protocol import SamplingParams
from workers.scheduler.core.sequence import Sequence
from workers.scheduler.engine.batch import AttentionBatch, AttentionGroup, LayerCache, score_bias
from workers.scheduler.engine.compiled import CompiledDecode
from workers.scheduler.engine.cuda_graphs import GraphedDecode, cuda_capture
from workers.scheduler.engine.dtypes import DTYPES, resolve_dtype, resolve_kv_dtype
from workers.scheduler.engine.fused_step import FusedStep
from workers.scheduler.engine.kernel_choices import recall_or_time_kernels
from workers.scheduler.engine.memory import (
    available_memory,
    cache_zeros,
    keep_freed_memory,
    kv_bytes_per_token,
    num_kv_blocks_for,
)
from workers.scheduler.engine.outputs import (
    record_embeddings,
    record_input_logprobs,
    record_output_logprobs,
    step_spans,
    wants_prompt_outputs,
)
from workers.scheduler.engine.reload import reload_runner
from workers.scheduler.engine.sampler import process_logits, sample
from workers.scheduler.grammar.masks import GrammarMasks, Masks, apply_masks
from workers.scheduler.kernels.c_build import keep_builds_in
from workers.scheduler.layers.attention_tuning import PREFILL_TOKENS, AttentionChoice
from workers.scheduler.layers.auto_quantization import plan_quantization
from workers.scheduler.layers.prepacked import prepack_linears
from workers.scheduler.layers.quantization import calibration_ids, quantize_model
from workers.scheduler.model.checkpoint import load_model
from workers.scheduler.model.llama import Attention, LlamaForCausalLM

logger = logging.getLogger(__name__)

# Decode groups of at least this many sequences take `Attention._attend_matmuls` (where
# `matmul_decodes`): SDPA wins on a few sequences, the matmuls on many (measured in
# bench/README.md).
DECODE_MATMUL_MIN_SEQS = 8

# Contexts are gathered as at least this many blocks (the padding masked): a 1-block
# context makes a dimension of size 1, which torch.compile specializes, so a step with a
# prompt of up to one block would compile a graph of its own while serving (compiled.py).
MIN_GATHERED_BLOCKS = 2


class TorchModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_kv_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Allocates the KV cache: per layer a K and a V tensor of [kv_heads, (num_kv_blocks
        + 1) * block_size slots, head_dim] (head-major, so a block of one head is one
        contiguous row to gather), zeroed so that padding slots never carry NaNs; in
        `kv_dtype` (the model's if None). Block `num_kv_blocks` is the padding block, which
        no sequence owns: graphed decode steps (cuda_graphs.py) write their padding rows
        there."""
        self.model = model
        self.block_size = block_size
        # Masked until min_new_tokens (the scheduler's finish check has the same ids).
        self.eos_token_ids: frozenset[int] = frozenset()
        self.grammar_masks = GrammarMasks()  # structured output's masks, filled per step
        self.num_kv_blocks = num_kv_blocks
        self.padding_block = num_kv_blocks
        self.cache_blocks = num_kv_blocks + 1  # the padding block last
        args, weight = model.args, model.embed_tokens.weight
        self.device = weight.device
        # bf16/fp16 decodes on CPU may take Attention._attend_matmuls (`use_attention`);
        # fp32 keeps SDPA (the exact reference; quantized fp32 runners are timed at load),
        # and so does CUDA.
        self.matmul_decodes = self.device.type == "cpu" and weight.dtype != torch.float32
        self.paged_decodes = False  # decode groups through kernels/paged_decode.py's kernel
        self.matmul_prefill_max_context = 0  # prefill chunks' longest context for matmuls
        shape = (args.num_kv_heads, self.cache_blocks * block_size, args.head_dim)
        kv_dtype = kv_dtype or weight.dtype
        self.kv_cache: list[LayerCache] = [
            (
                cache_zeros(shape, kv_dtype, weight.device),
                cache_zeros(shape, kv_dtype, weight.device),
            )
            for _ in range(args.num_layers)
        ]
        self.compiled: CompiledDecode | None = None
        self.graphs: GraphedDecode | None = None
        self.fused: FusedStep | None = None  # decode steps in one C call (`use_fused_step`)
        # What `reload` prepares new weights like: the load's quantization, and where
        # converted GGUF checkpoints are cached (settings.cache_dir; "" = the default).
        self.quantization = "none"
        self.cache_dir = ""
        self.model_path = ""  # the checkpoint loaded last, as given

    @classmethod
    def load(
        cls,
        model_path: str,
        num_kv_blocks: int,
        block_size: int,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int = 0,
        kv_memory_fraction: float = 0.0,
        quantization: str = "none",
        torch_compile_max_bs: int = 0,
        kv_cache_dtype: str = "auto",
        cuda_graph_max_bs: int = 0,
        tuning_dir: Path | None = None,
    ) -> TorchModelRunner:
        """Prepares the model (`prepare_model`), sizes the KV cache: at most `num_kv_blocks`
        blocks and at most `kv_memory_fraction` of the memory left once the weights are in
        (0 = no bound from that one), then picks the kernels and compiles or records the
        decode steps (`choose_kernels`; `tuning_dir`: where the choices and compiled graphs
        are kept between starts, None = nowhere). `kv_cache_dtype`: see `resolve_kv_dtype`."""
        if num_threads:
            torch.set_num_threads(num_threads)
        keep_builds_in(None if tuning_dir is None else tuning_dir / "kernels")
        if torch.device(device).type == "cpu" and not keep_freed_memory():
            logger.warning("not glibc: freed CPU memory may go back to the kernel each step")
        started = time.monotonic()
        dtype = resolve_dtype(dtype, device)
        model = prepare_model(model_path, DTYPES[dtype], device, quantization, block_size)
        logger.info("loaded weights from %s in %.1fs", model_path, time.monotonic() - started)
        weight = model.embed_tokens.weight
        quantized = quantization == "auto" and (
            plan_quantization(quantization, device, model_path).method != "none"
        )
        kv_dtype = resolve_kv_dtype(kv_cache_dtype, weight.dtype, quantized)
        bytes_per_block = kv_bytes_per_token(model.args, kv_dtype) * block_size
        available = available_memory(weight.device) if kv_memory_fraction else 0
        num_kv_blocks = num_kv_blocks_for(
            num_kv_blocks, kv_memory_fraction, available, bytes_per_block
        )
        runner = cls(model, num_kv_blocks, block_size, kv_dtype)
        runner.model_path = model_path
        runner.choose_kernels(quantization, torch_compile_max_bs, cuda_graph_max_bs, tuning_dir)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.0f MiB, %s on %s; model in %s)",
            num_kv_blocks,
            block_size,
            num_kv_blocks * bytes_per_block / 2**20,
            str(kv_dtype).removeprefix("torch."),
            device,
            dtype,
        )
        return runner

    def choose_kernels(
        self,
        quantization: str,
        torch_compile_max_bs: int,
        cuda_graph_max_bs: int,
        tuning_dir: Path | None = None,
    ) -> None:
        """Times the kernels here, or takes what an earlier start timed (kernel_choices.py),
        then compiles decode steps of up to `torch_compile_max_bs` sequences (compiled.py)
        and, on CUDA, records CUDA graphs of up to `cuda_graph_max_bs`; 0 = none."""
        self.quantization = quantization
        recall_or_time_kernels(self, tuning_dir)
        if torch_compile_max_bs:
            if tuning_dir:
                use_inductor_cache(tuning_dir / "inductor")
            logger.info("compiling decode steps of up to %d sequences", torch_compile_max_bs)
            self.compiled = CompiledDecode(self.model, torch_compile_max_bs)
            self.compiled.warm_up(self.forward, self.num_kv_blocks, self.block_size)
        if cuda_graph_max_bs and self.device.type == "cuda":
            self.graphs = self.graphed_decode(cuda_graph_max_bs)
            self.graphs.capture_all(cuda_capture())

    def reload(self, model_path: str) -> None:
        """Serve the checkpoint at `model_path` (same architecture and shapes) instead of
        the loaded one, prepared as `load` prepared it; the KV cache stays allocated (its
        contents are stale: flush the prefix cache). Call it with nothing running (it may
        run in a worker thread). Raises, keeping the old weights, for a checkpoint that is
        missing or of another shape (ReloadError) or incomplete (the loader's error). See
        reload.py."""
        reload_runner(self, model_path, prepare_model)
        if (fused := self.fused) is not None:  # it points at the weights it was built on
            self.use_fused_step(fused.max_batch, None, fused.prefill_rows, fused.split_steps)

    def use_attention(self, choice: AttentionChoice) -> None:
        """The attention kernels `choose_attention` timed fastest on this CPU."""
        logger.info("attention kernels: %s", choice)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.upcast_sdpa = choice.upcast_sdpa
        self.matmul_decodes = choice.matmul_decodes
        self.paged_decodes = choice.paged_decodes
        self.matmul_prefill_max_context = choice.matmul_prefill_max_context

    def use_fused_step(
        self,
        max_batch: int,
        built: FusedStep | None = None,
        prefill_rows: int = 0,
        split_steps: bool = False,
    ) -> None:
        """Decode steps of up to `max_batch` sequences through the fused C step where it
        takes the model (fused_step.py; `built`: one already made over this model), and
        steps with prefill chunks of up to `prefill_rows` new tokens (larger ones as several
        such calls with `split_steps`); the others (all with `max_batch` 0) through the
        torch forward."""
        fused = built
        if max_batch > 0 and fused is None:
            rows = max(max_batch, prefill_rows)
            fused = FusedStep.of(self.model, self.kv_cache, self.block_size, rows)
        if fused is not None:
            fused.max_batch = min(max_batch, fused.decoder.max_rows)
            fused.prefill_rows = min(prefill_rows, fused.decoder.max_rows)
            fused.split_steps = split_steps and fused.prefill_rows > 0
        self.fused = fused if max_batch > 0 else None

    def graphed_decode(self, max_batch: int) -> GraphedDecode:
        """Decode steps of up to `max_batch` sequences over contexts up to the model's
        longest (or the whole cache), for CUDA graphs; not recorded yet."""
        max_blocks = -(-self.model.args.max_position_embeddings // self.block_size)
        return GraphedDecode(
            self.model,
            self.kv_cache,
            self.block_size,
            self.padding_block,
            max_batch,
            max_blocks=min(max_blocks, self.num_kv_blocks),
            min_blocks=MIN_GATHERED_BLOCKS,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        """The next token of each of `seqs` that reaches its last token in this step
        (`seq.will_sample`), in order; logprobs and embeddings land on the sequences."""
        samplers = [seq for seq in seqs if seq.will_sample]
        masks = self.grammar_masks.start(samplers, self.vocab_size)  # filled during forward
        hidden, batch = self.forward(seqs)
        return self._outputs(seqs, hidden, batch, masks)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionBatch]:
        """Final hidden states [T, hidden] of the step's new tokens: `seq.num_new_tokens`
        of each sequence, from `seq.num_computed_tokens` on."""
        if self.graphs is not None and self.graphs.takes(seqs):
            return self.graphs(seqs)
        if self.fused is not None and (parts := self.fused.parts(seqs)) is not None:
            return self.fused(seqs, parts)
        input_ids = torch.tensor(
            [
                t
                for seq in seqs
                for t in seq.token_ids[
                    seq.num_computed_tokens : seq.num_computed_tokens + seq.num_new_tokens
                ]
            ],
            dtype=torch.long,
            device=self.device,
        )
        batch = self._prepare(seqs)
        if self.compiled is not None and self.compiled.takes(seqs):
            return self.compiled(input_ids, batch, self.kv_cache), batch
        return self.model(input_ids, batch, self.kv_cache), batch

    def _outputs(
        self,
        seqs: list[Sequence],
        hidden: torch.Tensor,
        batch: AttentionBatch,
        masks: Future[Masks | None] | None = None,
    ) -> list[int]:
        """Prompt logprobs and embeddings of the step's positions, then one token per
        sequence sampled from its last position, with its logprobs (see outputs.py)."""
        if any(wants_prompt_outputs(seq) for seq in seqs):
            spans = step_spans(batch.positions, batch.last_index)
            record_input_logprobs(self.model.compute_logits, hidden, seqs, spans)
            record_embeddings(hidden, seqs, spans)
        rows = [i for i, seq in enumerate(seqs) if seq.will_sample]
        if not rows:  # only prefill chunks that stop short of their prompt's end
            return []
        samplers = [seqs[i] for i in rows]
        logits = self.model.compute_logits(hidden[batch.last_index[rows]])
        logits = process_logits(logits, samplers, self.eos_token_ids)
        apply_masks(logits, masks)
        token_ids = sample(logits, samplers)
        record_output_logprobs(logits, samplers, token_ids)
        return token_ids

    def _prepare(self, seqs: list[Sequence]) -> AttentionBatch:
        device, bs = self.device, self.block_size
        q_lens = torch.tensor([seq.num_new_tokens for seq in seqs], device=device)
        starts = torch.tensor([seq.num_computed_tokens for seq in seqs], device=device)
        first_row = torch.cumsum(q_lens, 0) - q_lens
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs), device=device), q_lens)
        rows = torch.arange(len(seq_of_token), device=device)
        positions = starts[seq_of_token] + rows - first_row[seq_of_token]
        max_blocks = max(MIN_GATHERED_BLOCKS, *(len(seq.block_table) for seq in seqs))
        tables = torch.tensor(
            [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs],
            device=device,
        )
        slot_mapping = tables[seq_of_token, positions // bs] * bs + positions % bs
        # Decodes apart from prefill chunks, so one long chunk does not pad every decode.
        decodes = [i for i, seq in enumerate(seqs) if seq.num_new_tokens == 1]
        chunks = [i for i, seq in enumerate(seqs) if seq.num_new_tokens > 1]
        groups = [
            self._group(torch.tensor(index, device=device), tables, starts, q_lens, first_row)
            for index in (decodes, chunks)
            if index
        ]
        return AttentionBatch(
            positions=positions,
            slot_mapping=slot_mapping,
            groups=groups,
            last_index=first_row + q_lens - 1,
            block_size=bs,
        )

    def _group(
        self,
        index: torch.Tensor,
        tables: torch.Tensor,
        starts: torch.Tensor,
        q_lens: torch.Tensor,
        first_row: torch.Tensor,
    ) -> AttentionGroup:
        """The sequences `index` attended together: queries padded to [B, Lq], contexts
        gathered as whole blocks, [B, Lk] with Lk a multiple of the block size."""
        device, bs = self.device, self.block_size
        start, q_len = starts[index], q_lens[index]
        kv_len = start + q_len
        max_q = int(q_len.max())
        blocks = tables[index, : max(MIN_GATHERED_BLOCKS, -(-int(kv_len.max()) // bs))]
        kv_heads = self.model.args.num_kv_heads
        heads = torch.arange(kv_heads, device=device).view(-1, 1) * self.cache_blocks
        # Row j of sequence b is position start_b + j; padding rows still see key 0, so no
        # softmax row is empty (NaN).
        q_pos = start.unsqueeze(1) + torch.arange(max_q, device=device)
        key_pos = torch.arange(blocks.shape[1] * bs, device=device)
        mask = (key_pos <= q_pos.unsqueeze(-1)) & (key_pos < kv_len.view(-1, 1, 1))
        is_query = torch.arange(max_q, device=device) < q_len.unsqueeze(1)
        group = AttentionGroup(
            token_index=(first_row[index].unsqueeze(1) + torch.arange(max_q, device=device))[
                is_query
            ],
            padded_index=is_query.flatten().nonzero().squeeze(1),
            kv_rows=(blocks.flatten() + heads).flatten(),
            mask=mask.unsqueeze(1),
        )
        if max_q == 1 and self.paged_decodes:
            group.block_tables = blocks.to(torch.int32)
            group.context_lens = kv_len.to(torch.int32)
        elif self._takes_matmuls(max_q, len(index), context=key_pos.shape[0]):
            group.score_bias = score_bias(group.mask)
        return group

    def _takes_matmuls(self, max_q: int, num_seqs: int, context: int) -> bool:
        """Whether a group takes `Attention._attend_matmuls`: decodes of enough sequences
        where `matmul_decodes`; prefill chunks over contexts of up to
        `matmul_prefill_max_context` tokens (as timed at load) whose scores are no larger
        than those timed there (a step budget above PREFILL_TOKENS makes larger ones, and
        the matmuls lose to SDPA once the scores spill out of the caches; measured in
        bench/README.md)."""
        if max_q == 1:
            return self.matmul_decodes and num_seqs >= DECODE_MATMUL_MIN_SEQS
        longest = self.matmul_prefill_max_context
        return context <= longest and num_seqs * max_q * context <= PREFILL_TOKENS * longest


def prepare_model(
    model_path: str, dtype: torch.dtype, device: str, quantization: str, block_size: int
) -> LlamaForCausalLM:
    """The checkpoint's weights in `dtype` on `device`, plus compact copies of the
    projections with `quantization` ("auto": what the checkpoint was stored in,
    layers/auto_quantization.py; `w8a8_int8` calibrated by one prefill here) and bf16
    projections prepacked for oneDNN."""
    model = load_model(model_path, dtype, device)
    plan = plan_quantization(quantization, device, model_path)
    input_max = None
    if plan.method == "w8a8_int8":
        input_max = projection_input_max(model, calibration_ids(model_path), block_size)
    wrapped = quantize_model(model, plan.method, input_max, plan.keep_dense, plan.int8_bf16_too)
    if wrapped:
        logger.info("compact %s copies of %d projections for small steps", plan.method, wrapped)
    if prepack_linears(model):
        logger.info("bf16 projections prepacked in oneDNN's layout")
    return model


def projection_input_max(
    model: LlamaForCausalLM, token_ids: list[int], block_size: int
) -> dict[nn.Module, torch.Tensor]:
    """Per input channel, the largest |value| each decoder projection and the LM head take
    in one prefill of `token_ids`: the calibration run of `--quantization w8a8_int8`."""
    runner = TorchModelRunner(model, -(-len(token_ids) // block_size), block_size)
    seq = Sequence("calibration", token_ids, SamplingParams(max_new_tokens=1))
    seq.block_table = list(range(runner.num_kv_blocks))
    seq.num_new_tokens = len(token_ids)
    input_max: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        input_max[module] = args[0].detach().abs().amax(0).float()

    handles = [
        module.register_forward_pre_hook(record)
        for module in model.layers.modules()
        if isinstance(module, nn.Linear)
    ]
    try:
        hidden, _ = runner.forward([seq])
    finally:
        for handle in handles:
            handle.remove()
    input_max[model.lm_head] = hidden.detach().abs().amax(0).float()
    return input_max
