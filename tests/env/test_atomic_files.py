"""``env.files``: an atomic write leaves the old file or the new one; an output that is a directory is named as
itself in the error (the temporary the replace would have failed on means nothing to the user)."""

from __future__ import annotations

import pytest

from env.files import atomic_write_text


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out" / "r.json"
    atomic_write_text(path, "{}")
    atomic_write_text(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_a_directory_in_the_way_is_named_as_itself(tmp_path):
    (tmp_path / "r.json").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_text(tmp_path / "r.json", "{}")
    assert info.value.filename == str(tmp_path / "r.json") and ".tmp" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
