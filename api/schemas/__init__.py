"""Pydantic models of the HTTP edge (the only pydantic request/response models in redserve)."""
