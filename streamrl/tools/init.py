"""`streamrl init DIR`: a starter project outside any checkout: recipe.yaml (the quick-start task)
and my_rewards.py (the reward function it names), copied from the installed package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

FILES = {"recipe.yaml": "starter.yaml", "my_rewards.py": "starter_rewards.py"}  # written name -> packaged name


def init_project(directory: str | Path) -> list[Path]:
    """Write the starter files into `directory`; raises FileExistsError (nothing written) when
    one of them is already there."""
    d = Path(directory)
    taken = [d / name for name in FILES if (d / name).exists()]
    if taken:
        raise FileExistsError(f"{', '.join(map(str, taken))} already exist(s); nothing was written "
                              "(pick another directory, or move them away)")
    d.mkdir(parents=True, exist_ok=True)
    src = resources.files("streamrl.recipes")
    written = []
    for name, packaged in FILES.items():
        (d / name).write_text((src / packaged).read_text())
        written.append(d / name)
    return written
