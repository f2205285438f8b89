"""The members of a policy file (``policies.archive``): a member its header's payload does not name (an extra one, a
name with a path) is refused in one line, not ignored; a zip is stable-baselines3's own only without draftgym's
``header.json``, and a draftgym policy only with it."""

from __future__ import annotations

import zipfile

import pytest

from policies import PolicyError, load_policy
from policies.archive import is_policy_zip, is_sb3_zip
from policies.static import StaticPolicy
from tests.policies.test_safe_files import read_zip, write_zip

ARMS = ["none", "ngram-d2", "ngram-d4"]


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "static.zip"
    StaticPolicy(ARMS, arm="ngram-d4").save(path)
    return path


@pytest.mark.parametrize("name", ["extra.bin", "../header.json", "sub/state.json", "/etc/passwd"])
def test_a_member_the_payload_does_not_name_is_refused(saved, tmp_path, name):
    assert list(load_policy(saved).arm_names) == ARMS  # control
    items = read_zip(saved)
    items[name] = b"\0" * 16
    bad = tmp_path / "bad.zip"
    write_zip(bad, items)
    with pytest.raises(PolicyError, match="is not in header.json's payload") as err:
        load_policy(bad)
    assert "\n" not in str(err.value)


def test_an_sb3_zip_is_told_from_a_draftgym_policy(saved, tmp_path):
    sb3, both = tmp_path / "sb3.zip", tmp_path / "both.zip"
    with zipfile.ZipFile(sb3, "w") as zf:
        zf.writestr("policy.pth", b"x")
        zf.writestr("data", b"{}")
    write_zip(both, {**read_zip(saved), "policy.pth": b"x"})
    assert is_sb3_zip(sb3) and not is_policy_zip(sb3)
    assert is_policy_zip(both) and not is_sb3_zip(both)
    assert is_policy_zip(saved) and not is_sb3_zip(saved)
    (tmp_path / "text.zip").write_text("not a zip")
    assert not is_sb3_zip(tmp_path / "text.zip") and not is_policy_zip(tmp_path / "text.zip")
    assert not is_sb3_zip(tmp_path) and not is_policy_zip(tmp_path)
