"""The shipped training configurations, installed with the package and addressable by name.

A name is the TOML file's path below this folder without ``.toml``: ``debug_cpu``, ``paper/qwen3_0.6b_parallax``,
``long_context/qwen3_0.6b_gdn_64k``. ``--job.config_file`` takes a file path or such a name (a leading
``configs/`` and a trailing ``.toml`` are accepted too, so a checkout's ``configs/paper/X.toml`` spelling keeps
working from any folder).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
"""The folder holding the shipped ``.toml`` files."""


def names() -> list[str]:
    """Every shipped configuration's name, sorted."""
    return sorted(p.relative_to(ROOT).with_suffix("").as_posix() for p in ROOT.rglob("*.toml"))


def path(name: str) -> Path:
    """The file of the shipped configuration ``name``; a ValueError listing the folders of names otherwise."""
    key = name.removesuffix(".toml").replace(os.sep, "/")
    for prefix in ("attnlab/configs/", "configs/"):
        key = key.removeprefix(prefix)
    found = ROOT / f"{key}.toml"
    if found.is_file():
        return found
    groups = sorted({n.rpartition("/")[0] or "." for n in names()})
    raise ValueError(f"job.config_file={name!r}: no such file, and no shipped configuration of that name "
                     f"(`python -m attnlab.configs` lists them; folders: {groups})")


def resolve(value: str) -> str:
    """``--job.config_file``'s value as a file path: an existing file as given, else the shipped config it names."""
    return value if os.path.isfile(value) else str(path(value))


if __name__ == "__main__":
    print("\n".join(names()))
