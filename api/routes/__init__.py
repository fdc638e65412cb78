"""HTTP routes: thin adapters between the schemas and the TokenizerManager."""

from fastapi import APIRouter

from api.routes import (
    batches,
    chat,
    completions,
    control,
    embeddings,
    files,
    models,
    native,
    ops,
    requests,
    responses,
    utility,
    weights,
)

router = APIRouter()
for module in (native, completions, chat, responses, embeddings, files, batches, models,
               utility, requests, control, ops, weights):  # fmt: skip
    router.include_router(module.router)
