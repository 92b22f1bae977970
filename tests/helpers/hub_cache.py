"""A Hugging Face hub cache written by hand, in the layout huggingface_hub reads offline."""

from __future__ import annotations

from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(cache: Path, repo_id: str, *, repo_type: str = "model", commit: str = COMMIT) -> Path:
    """``<cache>/<type>s--<org>--<name>/refs/main`` → ``snapshots/<commit>/``, created; returns the snapshot
    folder, into which the caller writes the repo's files (subfolders as in the repo)."""
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot
