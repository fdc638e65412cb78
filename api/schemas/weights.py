"""POST /update_weights_from_disk: SGLang's body, plus `mode` (how the fleet switches)."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import StringConstraints, model_validator

from api.schemas.common import RequestBody, SafeStr
from shared.fleet_control import STARTED_VERSION

# The version of the weights each scheduler started with (no target set): never a new one.
# load_format values that mean what we load anyway (an HF folder's safetensors, a .gguf).
LOAD_FORMATS = ("auto", "safetensors", "gguf")

ModelPath = Annotated[SafeStr, StringConstraints(max_length=4096)]
# Part of a Redis key name: no whitespace.
WeightVersion = Annotated[
    SafeStr, StringConstraints(min_length=1, max_length=128, pattern=r"^\S+$")
]


class UpdateWeightsIn(RequestBody):
    """Load `model_path` on every scheduler as `weight_version` (a new one when not given):
    all at once while new requests wait (`all`), or one scheduler at a time while the
    others serve (`rolling`). `abort_all_requests` first aborts this replica's requests.
    SGLang's other fields (is_async, flush_cache, ...) are ignored: the schedulers always
    drain first and flush their prefix cache after."""

    model_path: ModelPath
    load_format: str | None = None
    weight_version: WeightVersion | None = None
    abort_all_requests: bool = False
    mode: Literal["all", "rolling"] = "all"

    @model_validator(mode="after")
    def _known_values(self) -> Self:
        self.model_path = self.model_path.strip()
        if not self.model_path:
            raise ValueError("model_path must be a non-empty string")
        if self.load_format is not None and self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format {self.load_format!r} is not supported ({', '.join(LOAD_FORMATS)})"
            )
        if self.weight_version == STARTED_VERSION:
            raise ValueError(
                f"weight_version {STARTED_VERSION!r} names the weights the schedulers "
                "started with: choose another"
            )
        return self
