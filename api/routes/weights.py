"""POST /update_weights_from_disk (SGLang's): load new weights on every scheduler."""

from __future__ import annotations

from typing import Any

from api.deps import TokenizerManagerDep
from api.routes.common import make_router
from api.schemas.weights import UpdateWeightsIn

router = make_router("weights")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    body: UpdateWeightsIn, tm: TokenizerManagerDep
) -> dict[str, Any]:
    """Every scheduler loads `model_path` as `weight_version` (mode `all`: new requests wait
    meanwhile on every replica; `rolling`: one scheduler at a time). 200 with `success`
    false and the reasons when a scheduler could not (the fleet then goes back)."""
    result = await tm.weights.update(body)
    return result.to_dict()
