"""OpenAI's Files API over the shared file store (shared.file_store): upload (multipart),
list, retrieve, content, delete. Uploads are spooled to disk by the multipart parser and copied
into the store in a thread; the edge's 413 stops a body over `api.max_file_bytes` while it is
still being received."""

from __future__ import annotations

import asyncio
from typing import IO, Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from api.deps import TokenizerManagerDep
from api.errors import BadRequest, NotFound, ServiceUnavailable
from api.redis_errors import REDIS_ERRORS, unavailable
from api.tokenizer_manager import TokenizerManager
from shared.file_store import FileRecord, FileStore, new_file_id

router = APIRouter(tags=["files"])

# OpenAI's upload purposes; only `batch` files can be a batch's input.
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
_MIN_EXPIRY_S, _MAX_EXPIRY_S = 3600, 30 * 86400
_COPY_CHUNK = 1 << 20


def get_store(tm: TokenizerManagerDep) -> FileStore:
    return file_store(tm)


def file_store(tm: TokenizerManager) -> FileStore:
    return FileStore(tm.redis, tm.keys, tm.settings.files_path())


StoreDep = Annotated[FileStore, Depends(get_store)]


def _not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="id")


async def find(store: FileStore, file_id: str) -> FileRecord:
    try:
        record = await store.get(file_id)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    if record is None:
        raise _not_found(file_id)
    return record


@router.post("/v1/files")
async def upload_file(request: Request, store: StoreDep) -> dict[str, Any]:
    """multipart/form-data: `file`, `purpose`, optional `expires_after[anchor|seconds]`."""
    limit = request.app.state.settings.api.max_file_bytes
    try:
        form = await request.form(max_files=1, max_fields=8)
    except MultiPartException as e:
        raise BadRequest(f"Invalid multipart body: {e.message}") from None
    try:
        upload, purpose, expires_after_s = _read_form(dict(form))
        if upload.size is not None and upload.size > limit:
            raise BodyTooLarge(limit)
        file_id = new_file_id()
        try:
            await store.fill(file_id, lambda out: _copy(upload.file, out, limit))
        except OSError as e:  # the store's directory: full, missing, not writable
            await store.discard_part(file_id)
            raise ServiceUnavailable(f"Could not store the file: {e.strerror or e}") from e
        except BaseException:
            await store.discard_part(file_id)
            raise
        try:
            record = await store.add(file_id, upload.filename or "file", purpose, expires_after_s)
        except REDIS_ERRORS as e:  # published but not recorded: nothing would name it
            await store.discard(file_id)
            raise unavailable(e, "Redis is unavailable.") from e
        return record.to_api()
    finally:
        await form.close()


class BodyTooLarge(BadRequest):
    status_code = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"The file is larger than the limit of {limit} bytes.", param="file")


def _read_form(form: dict[str, Any]) -> tuple[UploadFile, str, int | None]:
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise BadRequest("'file' is required: the file to upload, as a multipart file part.",
                         param="file")  # fmt: skip
    purpose = form.get("purpose")
    if purpose not in PURPOSES:
        raise BadRequest(f"{purpose!r} is not one of {list(PURPOSES)} - 'purpose'",
                         param="purpose")  # fmt: skip
    anchor = form.get("expires_after[anchor]")
    seconds = form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return upload, str(purpose), None
    if anchor != "created_at":
        raise BadRequest("expires_after[anchor] must be 'created_at'.",
                         param="expires_after.anchor")  # fmt: skip
    try:
        value = int(str(seconds))
    except ValueError:
        value = 0
    if not _MIN_EXPIRY_S <= value <= _MAX_EXPIRY_S:
        raise BadRequest(f"expires_after[seconds] must be an integer from {_MIN_EXPIRY_S} to "
                         f"{_MAX_EXPIRY_S}.", param="expires_after.seconds")  # fmt: skip
    return upload, str(purpose), value


def _copy(source: IO[bytes], out: IO[bytes], limit: int) -> None:
    source.seek(0)
    total = 0
    while chunk := source.read(_COPY_CHUNK):
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge(limit)
        out.write(chunk)


@router.get("/v1/files")
async def list_files(
    store: StoreDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """OpenAI's cursor pagination: `after` a file id, newest first unless `order=asc`."""
    try:
        page, more = await store.page(after=after, limit=limit, descending=order == "desc",
                                      purpose=purpose)  # fmt: skip
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    data = [record.to_api() for record in page]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, store: StoreDep) -> dict[str, Any]:
    return (await find(store, file_id)).to_api()


@router.get("/v1/files/{file_id}/content", response_model=None)
async def file_content(file_id: str, store: StoreDep) -> FileResponse:
    """The file's bytes, streamed from disk."""
    record = await find(store, file_id)
    path = store.path(file_id)
    if not await asyncio.to_thread(path.exists):
        raise _not_found(file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=record.filename)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, store: StoreDep) -> dict[str, Any]:
    await find(store, file_id)
    try:
        deleted = await store.delete(file_id)
    except REDIS_ERRORS as e:
        raise unavailable(e, "Redis is unavailable.") from e
    if not deleted:
        raise _not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
