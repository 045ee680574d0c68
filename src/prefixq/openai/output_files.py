"""The output and error files of one batch's finalization (`OutputFiles`): written under
temporary names in the namespace's files folder, renamed into place and recorded only once every
line is written, so a file that is listed is complete. A finalization a dead server left half done
is redone: its temporary files are removed first (`sweep_stale`). The files expire as the batch's
``output_expires_after`` says (expiry.py). docs/openai.md, "Output and error files".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from prefixq.openai.files import new_file_id
from prefixq.openai.formats import Line, Usage

if TYPE_CHECKING:
    from prefixq.openai.batches import BatchStore

__all__ = ["OutputFiles"]


class OutputFiles:
    """The output and error files of one finalization, written under temporary names."""

    def __init__(self, store: BatchStore, batch_id: str, *, expires_s: int | None = None) -> None:
        self.store, self.batch_id = store, batch_id
        #: the batch's output_expires_after: each file expires that long after its creation
        self.expires_s = expires_s
        self.ids = {"output": new_file_id(), "error": new_file_id()}
        self.lines = {"output": 0, "error": 0}
        self.bytes = {"output": 0, "error": 0}
        self.kinds: dict[str, int] = {}
        self.usage = Usage()

    def tmp(self, which: str) -> Path:
        return self.store.files.dir / f".final-{self.batch_id}-{self.ids[which]}"

    def sweep_stale(self) -> None:
        """Remove what an earlier attempt at this batch left half written (a server killed while
        it finalized): under the lease no other attempt is writing."""
        for old in self.store.files.dir.glob(f".final-{self.batch_id}-*"):
            old.unlink(missing_ok=True)

    async def write(self, lines: list[Line]) -> None:
        out: dict[str, list[str]] = {"output": [], "error": []}
        for ln in lines:
            out["output" if ln.ok else "error"].append(ln.dumps())
            self.kinds[ln.kind] = self.kinds.get(ln.kind, 0) + 1
        for which, texts in out.items():
            if texts:
                data = "".join(texts).encode()
                async with await anyio.open_file(self.tmp(which), "ab") as f:
                    await f.write(data)
                self.lines[which] += len(texts)
                self.bytes[which] += len(data)

    def pending(self) -> str:
        """The ids `publish` is about to create, comma-separated."""
        return ",".join(self.ids[w] for w in ("output", "error") if self.lines[w])

    async def publish(self) -> dict[str, str]:
        """Rename the non-empty files into place and record them; returns the file id fields."""
        out = {"output_file_id": "", "error_file_id": ""}
        for which in ("output", "error"):
            if not self.lines[which]:
                continue
            fid = self.ids[which]
            self.tmp(which).rename(self.store.files.path(fid))
            name = f"{self.batch_id}_{which}.jsonl"
            await self.store.files.record(
                fid, name, "batch_output", self.bytes[which], self.lines[which], self.expires_s
            )
            out[f"{which}_file_id"] = fid
        return out

    def discard(self) -> None:
        for which in ("output", "error"):
            self.tmp(which).unlink(missing_ok=True)
