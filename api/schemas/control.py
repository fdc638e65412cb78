"""Bodies of the fleet control routes (SGLang's PauseGenerationReqInput)."""

from __future__ import annotations

from typing import Literal

from api.schemas.common import RequestBody


class PauseGenerationIn(RequestBody):
    """POST /pause_generation: `abort` ends in-flight requests, `retract` returns them to
    their scheduler's queue (KV freed), `in_place` freezes them with their KV."""

    mode: Literal["abort", "retract", "in_place"] = "abort"
