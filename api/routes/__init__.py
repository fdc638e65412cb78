"""HTTP routes: thin adapters between the schemas and the TokenizerManager."""

from fastapi import APIRouter

from api.routes import chat, completions, embeddings, models, native, requests, utility

router = APIRouter()
for module in (native, completions, chat, embeddings, models, utility, requests):
    router.include_router(module.router)
