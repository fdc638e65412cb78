"""HTTP routes: thin adapters between the schemas and the TokenizerManager."""

from fastapi import APIRouter

from api.routes import chat, completions, models, native

router = APIRouter()
router.include_router(native.router)
router.include_router(completions.router)
router.include_router(chat.router)
router.include_router(models.router)
