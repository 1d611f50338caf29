"""Render the settings schema as a commented ``flywheel.toml`` (``flywheel config example``).

Generated from the field docstrings in :mod:`flywheel.settings`, so the example can never drift
from what the code accepts; ``tests/unit/test_configdoc.py`` loads it back as a check.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from pydantic import BaseModel

from flywheel.settings import Settings


def _toml_value(value: Any) -> str | None:
    if value is None:
        return None  # TOML has no null: the field stays commented out
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    return json.dumps(str(value))


def _env_name(section: str | None, field: str) -> str:
    return "FLYWHEEL_" + (f"{section}_{field}" if section else field).upper()


def _fields(model: type[BaseModel], section: str | None) -> list[str]:
    lines: list[str] = []
    defaults = model()
    for name, info in model.model_fields.items():
        value = getattr(defaults, name)
        if isinstance(value, BaseModel):
            continue
        doc = (info.description or "").strip()
        for para in textwrap.wrap(" ".join(doc.split()), 96):
            lines.append(f"# {para}")
        lines.append(f"# env: {_env_name(section, name)}")
        rendered = _toml_value(value.as_posix() if hasattr(value, "as_posix") else value)
        lines.append(f"{name} = {rendered}" if rendered is not None else f"# {name} =  (unset)")
        lines.append("")
    return lines


def example_toml() -> str:
    out = ["# flywheel.toml: every setting with its default. Environment variables override this file:",
           "# each setting's variable below, or that name with _FILE naming a file that holds the value.", ""]
    out += _fields(Settings, None)
    for name, info in Settings.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += [f"[{name}]"] + _fields(annotation, name)
    return "\n".join(out).rstrip() + "\n"
