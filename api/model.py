"""What the api knows about the served model: its tokenizer, name, context length and vocabulary
size. Loaded once in the app's lifespan (blocking; run it in a thread)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.config import Settings
from shared.model_files import DEFAULT_GGUF, resolve_model

logger = logging.getLogger(__name__)

# Tokenizers without a real limit report a huge model_max_length.
_MAX_SANE_CONTEXT = 10_000_000


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that the api uses."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, *args: Any, **kwargs: Any) -> Any: ...

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class ModelInfo:
    model_path: str  # as configured (empty = the packaged default)
    resolved_path: str  # the local folder (or hub id) the tokenizer and config load from
    tokenizer: Tokenizer = field(repr=False)
    served_model_name: str
    context_length: int
    vocab_size: int
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))


def served_name(settings: Settings) -> str:
    if settings.api.served_model_name:
        return settings.api.served_model_name
    if not settings.model:
        return Path(DEFAULT_GGUF).stem
    path = Path(settings.model).expanduser()
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.name
    return settings.model  # a hub id keeps its org/name


def _load_config(path: str) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # any failure means "no config": fall back below
        logger.warning("no model config at %s (%s); using tokenizer limits", path, e)
        return None
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def load_model_info(settings: Settings, tokenizer: Tokenizer | None = None) -> ModelInfo:
    path = resolve_model(settings.model, settings.cache_dir)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    config = _load_config(path)
    context = settings.context_length or getattr(config, "max_position_embeddings", 0) or 0
    if not context:
        limit = int(getattr(tokenizer, "model_max_length", 0) or 0)
        context = limit if 0 < limit < _MAX_SANE_CONTEXT else 0
    if not context:
        raise RuntimeError(f"cannot tell the context length of {path}: set context_length")
    vocab = int(getattr(config, "vocab_size", 0) or 0) or len(tokenizer)
    info = ModelInfo(
        model_path=settings.model or path,
        resolved_path=path,
        tokenizer=tokenizer,
        served_model_name=served_name(settings),
        context_length=int(context),
        vocab_size=vocab,
        model_type=getattr(config, "model_type", None),
        architectures=tuple(getattr(config, "architectures", None) or ()),
    )
    logger.info(
        "model %s: served as %s, context_length=%d vocab_size=%d",
        path, info.served_model_name, info.context_length, info.vocab_size,
    )  # fmt: skip
    return info
