"""Where lanefleet's own files live: migrations, lane instructions and hidden-file templates.

From a checkout (``uv run``) they are the repository's top-level folders; an installed wheel
carries them under ``worker/_resources/`` (see pyproject's force-include).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """The folder ``name`` (``migrations``, ``lane_instructions``, ``hidden_files``)."""
    for candidate in (_PACKAGE / "_resources" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"lanefleet's {name}/ folder is missing from {_PACKAGE.parent}")


def migrations_dir() -> Path:
    return resource_dir("migrations")
