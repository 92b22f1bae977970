"""A stage's pickled work state (its context file) is read only when it is this user's own file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cellpath.errors import ExecutorError
from cellpath.runtime import shards
from cellpath.runtime.shards import read_context, write_context


def test_a_context_is_written_private_and_read_back(tmp_path: Path) -> None:
    path = write_context(tmp_path, "probe", {"a": 1}, {"panel": [1, 2, 3]})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_context(path) == {"panel": [1, 2, 3]}


class _Planted:
    """Unpickling this runs code: what a planted context file would do."""

    def __reduce__(self):
        return (Path.touch, (Path(os.environ["PLANTED_MARK"]),))


@pytest.mark.parametrize("how", ["group-writable", "another-owner", "a-link"])
def test_a_context_that_is_not_this_users_own_is_not_unpickled(tmp_path: Path, monkeypatch, how: str) -> None:
    mark = tmp_path / "ran"
    monkeypatch.setenv("PLANTED_MARK", str(mark))
    path = write_context(tmp_path, "probe", {"a": 1}, {"panel": []})
    import pickle

    path.chmod(0o600)
    path.write_bytes(pickle.dumps(_Planted()))  # another process rewrote it in place
    if how == "group-writable":
        path.chmod(0o664)
    elif how == "another-owner":
        real = os.geteuid()
        monkeypatch.setattr(shards.os, "geteuid", lambda: real + 1)  # as seen by another user
    else:
        target = tmp_path / "elsewhere.pkl"
        path.rename(target)
        path.symlink_to(target)
    with pytest.raises(ExecutorError, match="not this user's own .* it is pickled state, which runs code when loaded"):
        read_context(path)
    with pytest.raises(ExecutorError, match="Delete it"):
        write_context(tmp_path, "probe", {"a": 1}, {"panel": []})  # not silently trusted when it is found either
    assert not mark.exists()
    pickle.loads(path.read_bytes())  # the control: unguarded, the file runs its code
    assert mark.exists()
