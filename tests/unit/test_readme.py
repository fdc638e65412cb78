"""The README documents every setting with the default and flag it really has, stays short, and
bench/README.md opens with one table whose links land on its sections."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from redserve.cli import FLAGS
from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BENCH = (ROOT / "bench" / "README.md").read_text()

# Settings whose default is no literal (a default_factory, or None standing for something
# derived), documented in words. A new one must be added here deliberately.
PROSE_DEFAULTS = {
    "REDSERVE_API__API_ID": "host + random",
    "REDSERVE_SCHEDULER__WORKER_ID": "host + random",
    "REDSERVE_DETOKENIZER__WORKER_ID": "host + random",
    "REDSERVE_JOBS__WORKER_ID": "host + random",
    "REDSERVE_API__SERVED_MODEL_NAME": "model's name",
}


def _env_names(model: type[BaseModel], prefix: str) -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            names += _env_names(sub, f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


def _settings_rows() -> dict[str, list[str]]:
    """variable -> [default, flag, description] of each row of the settings table."""
    rows = {}
    for line in README.splitlines():
        if line.startswith("| `REDSERVE_"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            assert len(cells) == 4, line
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _path(env_name: str) -> str:
    return env_name.removeprefix("REDSERVE_").lower().replace("__", ".")


def _default(path: str) -> Any:
    model: type[BaseModel] = Settings
    *parents, leaf = path.split(".")
    for name in parents:
        annotation = model.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model.model_fields[leaf].get_default(call_default_factory=True)


def _literal(cell: str) -> tuple[bool, Any]:
    """(True, value) for a cell that is one backticked literal: JSON, else a bare string."""
    match = re.fullmatch(r"`([^`]*)`", cell)
    if not match:
        return False, None
    try:
        return True, json.loads(match.group(1))
    except json.JSONDecodeError:
        return True, match.group(1)


def test_every_setting_is_documented() -> None:
    missing = [n for n in _env_names(Settings, "REDSERVE_") if f"`{n}`" not in README]
    assert not missing


def test_every_setting_has_one_row_and_every_row_a_setting() -> None:
    assert set(_settings_rows()) == set(_env_names(Settings, "REDSERVE_"))


def test_each_documented_default_is_the_settings_default() -> None:
    for name, (default_cell, _flag, _what) in _settings_rows().items():
        is_literal, value = _literal(default_cell)
        if name in PROSE_DEFAULTS:
            assert not is_literal and default_cell == PROSE_DEFAULTS[name], name
            continue
        assert is_literal, f"{name}: document a literal default or add it to PROSE_DEFAULTS"
        expected = _default(_path(name))
        same_kind = type(value) is type(expected) or {type(value), type(expected)} == {int, float}
        assert same_kind, f"{name}: README says {default_cell}, Settings {expected!r}"
        assert value == expected, f"{name}: README says {default_cell}, Settings {expected!r}"


def test_each_documented_flag_is_the_flag_of_that_setting() -> None:
    by_path = {f.path: f.name for f in FLAGS}
    for name, (_default_cell, flag_cell, _what) in _settings_rows().items():
        documented = re.findall(r"`(--[a-z0-9-]+)`", flag_cell)
        assert documented == ([by_path[_path(name)]] if _path(name) in by_path else []), name


def test_readme_shows_the_two_commands_first() -> None:
    first_block = README.split("```sh", 1)[1].split("```", 1)[0]
    assert "make serve" in first_block and "make test" in first_block


def test_readme_stays_short_and_narrow() -> None:
    lines = README.splitlines()
    assert len(lines) < 300
    wide = [f"{n}: {len(line)}" for n, line in enumerate(lines, 1) if len(line) > 200]
    assert not wide


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_bench_readme_opens_with_one_table_that_links_its_sections() -> None:
    body = BENCH.split("\n", 1)[1].lstrip("\n")  # after the title
    table = []
    for line in body.splitlines():
        if not line.startswith("|"):
            break
        table.append(line)
    header, rule, *rows = table
    assert header.split("|")[1:-1] == [
        " CPU kind (2 vCPUs) ",
        " mode ",
        " against llama-server in the same sitting ",
        " date ",
        " section ",
    ]
    assert set(rule) <= set("|-")
    assert rows
    anchors = _anchors(BENCH)
    for row in rows:
        links = re.findall(r"\]\(#([^)]+)\)", row)
        assert len(links) == 1 and links[0] in anchors, row
        assert re.search(r"\| 20\d\d-\d\d-\d\d \|", row), row


def test_readme_links_into_bench_readme_land_on_a_section() -> None:
    anchors = _anchors(BENCH)
    for anchor in re.findall(r"\(bench/README\.md#([^)]+)\)", README):
        assert anchor in anchors, anchor
