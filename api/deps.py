"""FastAPI dependencies as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.errors import ServiceUnavailable
from api.model import ModelInfo
from api.tokenizer_manager import TokenizerManager


def get_manager(request: Request) -> TokenizerManager:
    manager: TokenizerManager | None = getattr(request.app.state, "manager", None)
    if manager is None:
        raise ServiceUnavailable("The server is starting.")
    return manager


def get_model(manager: Annotated[TokenizerManager, Depends(get_manager)]) -> ModelInfo:
    return manager.model


TokenizerManagerDep = Annotated[TokenizerManager, Depends(get_manager)]
ModelDep = Annotated[ModelInfo, Depends(get_model)]
