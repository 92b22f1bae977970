"""Errors a user can act on. Each message names the file, section or parameter at fault."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    """One problem found by a check that lists them all: ``where`` (parameter, file or section) and
    ``message`` (what is wrong and what to do)."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class CellPathError(Exception):
    """Base class: the CLI prints the message alone (no traceback) and exits with status 2."""


class ConfigError(CellPathError):
    """params.yaml (or a file it points to) is invalid."""


class ExecutorError(CellPathError):
    """A worker died or the cluster could not be used; the message names the task or the setting."""


class InputError(CellPathError):
    """An input file is missing, malformed or inconsistent."""

    def __init__(self, what: str, *, path: Path | str | None = None, section: str | None = None):
        where = []
        if section is not None:
            where.append(f"section {section}")
        if path is not None:
            where.append(str(path))
        prefix = ": ".join(where)
        super().__init__(f"{prefix}: {what}" if prefix else what)
        self.path = path
        self.section = section


class EncoderUnavailable(CellPathError):
    """The encoder cannot be built here: its weights are missing or cellpath has no loader for it."""


class EncoderLoadError(CellPathError):
    """Weights, their config or the encoder's outputs disagree with the registry row (fix one of them)."""


class DownloadError(CellPathError):
    """A download failed, was truncated, or did not match its checksum."""


class OutputError(CellPathError, OSError):
    """An output could not be written (the disk or quota is full); the previous output is unchanged.

    Also an OSError with the original ``errno``, so code that handles OSError still does."""


class ConcurrentRunError(CellPathError):
    """Another process holds the lock on a download, a stage's work folder or the tracking store."""
