"""Print the README's configuration table from `prefixq.core.settings.Settings` (fields and their
``#:`` comments). tests/test_docs.py checks that the README holds exactly this table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prefixq.core.settings import Settings


def table() -> str:
    src = (Path(__file__).resolve().parent.parent / "src/prefixq/core/settings.py").read_text()
    lines = src.splitlines()
    docs: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = re.match(r"    (\w+): [\w\[\] |]+ = ", line)
        if m:
            j, comment = i - 1, []
            while j >= 0 and lines[j].strip().startswith("#:"):
                comment.insert(0, lines[j].strip()[2:].strip())
                j -= 1
            docs[m.group(1)] = " ".join(comment).replace("|", "\\|")
    s = Settings()
    rows = ["| setting | env var | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        rows.append(
            f"| `{f.name}` | `{s.env_name(f.name)}` | `{flag}` | "
            f"`{getattr(s, f.name)!r}` | {docs.get(f.name, '')} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
