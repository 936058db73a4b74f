"""docs/configuration.md's group table names every option Hydra has: each model preset and each
conf/<group>/<option>.yaml (issue 35, item 3: `data=chat` and `model=70b` were missing)."""

import re
from pathlib import Path

from trainer.model.config import PRESETS

REPO = Path(__file__).resolve().parents[2]


def test_the_group_table_lists_every_option_of_every_group():
    text = (REPO / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)`\s*\|(.*)\|\s*$", text, flags=re.M))
    listed = {group: set(re.findall(r"`([\w.-]+)`", cell)) for group, cell in rows.items()}
    assert set(PRESETS) <= listed["model"], set(PRESETS) - listed["model"]
    for folder in sorted((REPO / "conf").iterdir()):
        if folder.is_dir():
            options = {p.stem for p in folder.glob("*.yaml")}
            assert options <= listed.get(folder.name, set()), (folder.name, options)
