"""OpenAI-compatible GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from api.deps import ModelDep
from api.errors import NotFound
from api.model import ModelInfo
from api.routes.common import make_router
from api.schemas.openai import ModelCard, ModelList

router = make_router("openai")


def _card(model: ModelInfo) -> ModelCard:
    return ModelCard(
        id=model.served_model_name,
        created=model.created,
        root=model.model_path,
        max_model_len=model.context_length,
    )


@router.get("/v1/models")
async def list_models(model: ModelDep) -> ModelList:
    """The one model this deployment serves."""
    return ModelList(data=[_card(model)])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, model: ModelDep) -> ModelCard:
    """The served model by name; 404 for any other name."""
    if model_id != model.served_model_name:
        raise NotFound(
            f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
        )
    return _card(model)
