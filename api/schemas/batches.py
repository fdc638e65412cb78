"""OpenAI's Batch API request body (POST /v1/batches)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from api.schemas.common import RequestBody, SafeStr
from shared.batch_lines import ENDPOINTS

MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class CreateBatchRequest(RequestBody):
    input_file_id: SafeStr
    endpoint: Literal[ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
