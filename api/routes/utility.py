"""/tokenize and /detokenize (also under /v1)."""

from __future__ import annotations

from typing import Any

from api.deps import TokenizerManagerDep
from api.errors import BadRequest
from api.inputs import embed_prompts
from api.routes.common import make_router
from api.schemas.native import DetokenizeRequest, TokenizeRequest
from api.tokenizer_manager import TokenizerManager
from api.validation import check_chars, check_ids

router = make_router("utility")


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, tm: TokenizerManagerDep) -> dict[str, Any]:
    """Token ids of a prompt (a string, a batch of strings, cross-encoder pairs, which also
    give token_type_ids) or of chat messages through the chat template."""
    ctx = tm.model.context_length
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("Exactly one of prompt or messages should be provided.")
    if body.messages is not None:
        if not body.messages:
            raise BadRequest("messages must not be empty.", param="messages")
        messages = [m.template_dict() for m in body.messages]
        ids = await tm.render_chat(messages, add_generation_prompt=body.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx}
    prompts, is_single = embed_prompts(body.prompt)
    tokens, types = await _tokenize_prompts(tm, prompts, body.add_special_tokens)
    out: dict[str, Any] = {
        "tokens": tokens[0] if is_single else tokens,
        "count": len(tokens[0]) if is_single else [len(t) for t in tokens],
        "max_model_len": ctx,
    }
    if types is not None:
        out["token_type_ids"] = types
    return out


async def _tokenize_prompts(
    tm: TokenizerManager, prompts: list[Any], add_special_tokens: bool
) -> tuple[list[list[int]], list[list[int]] | None]:
    if not prompts:
        raise BadRequest("prompt must not be empty.", param="prompt")
    if isinstance(prompts[0], list):  # ids: checked and echoed
        for ids in prompts:
            check_ids(ids, tm.model, "prompt")
        return prompts, None
    if isinstance(prompts[0], tuple):
        for query, doc in prompts:
            check_chars(len(query) + len(doc), tm.model)
        enc = await tm.tok.encode_pairs(prompts, add_special_tokens)
        return enc.input_ids, enc.token_type_ids
    for text in prompts:
        check_chars(len(text), tm.model)
    return await tm.tok.encode_batch(prompts, add_special_tokens), None


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, tm: TokenizerManagerDep) -> dict[str, Any]:
    """Text of a list of ids, or of each list in a batch."""
    tokens: Any = body.tokens
    is_single = not tokens or not isinstance(tokens[0], list)
    batch: list[list[int]] = [tokens] if is_single else tokens
    for ids in batch:
        check_ids(ids, tm.model, "tokens")
    texts = await tm.tok.decode_batch(batch, body.skip_special_tokens)
    return {"text": texts[0] if is_single else texts}
