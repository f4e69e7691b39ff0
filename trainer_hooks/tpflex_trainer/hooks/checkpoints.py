"""The hooks' checkpoint directory: a checkpoint every N steps, and a ``latest`` pointer.

Each checkpoint is a directory ``step-NNNNNNNN`` that every rank writes its share of
(``NtpRuntime.save_checkpoint``); the writer (the rank at index 0 of the world) then points
``latest`` at it by an atomic rename, so a reader never sees a half-written pointer. Fresh
processes with nobody to receive units from load the checkpoint ``latest`` names.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointDir:
    def __init__(self, directory: str, every: int) -> None:
        self.directory = Path(directory) if directory else None
        self.every = every  # steps; 0 = never
        self._taken = -1  # the step last checkpointed (or resumed from)

    def latest(self) -> str | None:
        """The checkpoint ``latest`` points at, if it exists."""
        if self.directory is None:
            return None
        pointer = self.directory / "latest"
        if not pointer.exists():
            return None
        path = self.directory / pointer.read_text().strip()
        return str(path) if path.exists() else None

    def skip(self, step: int) -> None:
        """Members of a new layout all resume at ``step``: none checkpoints it again, so
        all of them take the same checkpoints from here on."""
        self._taken = step

    def due(self, step: int) -> bool:
        return bool(self.directory and self.every and step and step % self.every == 0 and step != self._taken)

    def save(self, runtime, step: int, writer: bool) -> None:
        """At a step boundary where ``due(step)``: every rank saves its share; the writer
        then moves ``latest`` to it."""
        self._taken = step
        name = f"step-{step:08d}"
        runtime.save_checkpoint(self.directory / name)
        if writer:
            tmp = self.directory / "latest.tmp"
            tmp.write_text(name)
            tmp.replace(self.directory / "latest")
