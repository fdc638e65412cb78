"""SGLang-native routes: /generate, /abort_request, /health (readiness), /health_generate,
/live (liveness), /get_model_info, /get_server_info."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from api import fleet, readiness
from api.deps import TokenizerManagerDep
from api.errors import ServiceUnavailable
from api.inputs import native_reqs, raise_for_error
from api.renderers import native_output
from api.routes.common import collect, make_router
from api.routes.ops import read_fleet_or_503
from api.schemas.native import AbortRequestIn, GenerateRequest
from api.stream_spec import StreamSpec
from api.streams import stream_response

logger = logging.getLogger(__name__)

router = make_router("native")


@router.post("/generate", response_model=None)
@router.put("/generate", response_model=None, include_in_schema=False)
async def generate(body: GenerateRequest, request: Request, tm: TokenizerManagerDep) -> Response:
    """Generate from `text` or `input_ids` (single or batch, `n` samples each); SSE when
    `stream` is true: cumulative chunks, or deltas with --incremental-streaming-output;
    batch items' chunks interleave as they come, tagged with their index."""
    reqs, is_single = native_reqs(body, tm.settings.api)
    if body.stream:
        incremental = tm.settings.api.incremental_streaming_output
        spec = StreamSpec(kind="generate", is_single=is_single, incremental=incremental)
        return await stream_response(tm, reqs, spec, request)
    results = await collect(await tm.generate(reqs, request))
    raise_for_error(results)
    payload = [native_output(out, tm.tok.token_texts) for out in results]
    return JSONResponse(payload[0] if is_single else payload)


@router.post("/abort_request")
async def abort_request(body: AbortRequestIn, tm: TokenizerManagerDep) -> Response:
    """Abort one request by rid (on any replica), or every request of this replica."""
    if body.abort_all:
        await tm.abort_all()
    elif body.rid:
        await tm.abort_request([body.rid])
    return Response(status_code=200)


@router.get("/health")
async def health(tm: TokenizerManagerDep) -> Response:
    """Readiness: 200 while Redis answers and at least one scheduler is ready, else 503 with
    the reason (also from the moment the replica drains for a shutdown)."""
    return _ok_unless(await readiness.not_ready(tm))


@router.get("/health_generate")
async def health_generate(tm: TokenizerManagerDep) -> Response:
    """Readiness, and one real token through the whole fleet within the timeout."""
    return _ok_unless(await readiness.not_generating(tm))


@router.get("/live")
async def live(tm: TokenizerManagerDep) -> Response:
    """Liveness (compose's healthcheck): this replica runs and Redis answers, whether or not
    a scheduler is ready."""
    return _ok_unless(await readiness.not_live(tm))


def _ok_unless(reason: str | None) -> Response:
    if reason:
        raise ServiceUnavailable(reason)
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(tm: TokenizerManagerDep) -> dict[str, Any]:
    """The served model (SGLang's fields plus context length and vocabulary size); its
    model_path and weight_version are the fleet's current target (after live updates)."""
    model = tm.model
    model_path, weight_version = await tm.weights.current()
    return {
        "model_path": model_path,
        "tokenizer_path": model.resolved_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": weight_version,
        "served_model_name": model.served_model_name,
        "context_length": model.context_length,
        "vocab_size": model.vocab_size,
        "model_type": model.model_type,
        "architectures": list(model.architectures),
    }


@router.get("/get_server_info")
async def get_server_info(tm: TokenizerManagerDep) -> dict[str, Any]:
    """This replica's settings (secrets redacted), model and load (SGLang's server info), and
    the fleet: the live workers of each tier (id, state, load, weight version) and the
    request stream's backlog."""
    settings = tm.settings.model_dump(mode="json")
    settings["redis_url"] = redact_url(tm.settings.redis_url)
    settings["api"]["api_keys"] = f"<{len(tm.settings.api.api_keys)} keys>"
    return {
        **settings,
        "version": _version(),
        "served_model_name": tm.model.served_model_name,
        "model_path": tm.model.model_path,
        "context_length": tm.model.context_length,
        "vocab_size": tm.model.vocab_size,
        "num_running_requests": len(tm.rid_to_state),
        "tokenizer_calls": tm.tok.batcher.num_calls,
        "workers": fleet.describe(await read_fleet_or_503(tm)),
    }


def redact_url(url: str) -> str:
    """A Redis URL without its password."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _version() -> str:
    try:
        return version("redserve")
    except PackageNotFoundError:
        return "unknown"
