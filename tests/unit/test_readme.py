"""The README documents every setting and the two set-up commands."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from shared.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _env_names(model: type[BaseModel], prefix: str) -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            names += _env_names(sub, f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


def test_every_setting_is_documented() -> None:
    missing = [n for n in _env_names(Settings, "REDSERVE_") if f"`{n}`" not in README]
    assert not missing


def test_readme_shows_the_two_commands_first() -> None:
    first_block = README.split("```sh", 1)[1].split("```", 1)[0]
    assert "make serve" in first_block and "make test" in first_block
