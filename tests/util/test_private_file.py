"""Folders, files and secrets that are this user's alone whatever the umask (DESIGN: files 0600, folders 0700,
whoever's process writes them): a library user such as vLLM does not run under `kvledger`'s umask 077."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from kvledger.util.private_file import claim_secret, open_private, private_dir, write_private
from tests.support import umask


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o000, 0o277], ids=oct)
def test_folders_and_files_are_made_private_whatever_the_umask(tmp_path, mask):
    """0o277 takes the owner's own write and execute bits: the chmod after each creation gives them back."""
    with umask(mask):
        deep = private_dir(tmp_path / "a" / "b" / "c")
        fd = open_private(deep / "f", os.O_WRONLY | os.O_EXCL)
        os.write(fd, b"x")
        os.close(fd)
        write_private(tmp_path / "n" / "secret", "s\n")
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", deep, tmp_path / "n")] == [0o700] * 4
    assert mode(deep / "f") == 0o600 == mode(tmp_path / "n" / "secret")


def test_an_existing_folder_keeps_its_mode_and_an_existing_file_of_ours_is_tightened(tmp_path):
    (tmp_path / "mount").mkdir(mode=0o755)
    os.chmod(tmp_path / "mount", 0o755)
    private_dir(tmp_path / "mount")
    assert mode(tmp_path / "mount") == 0o755   # an operator's mount point is not ours to change
    old = tmp_path / "mount" / "events.jsonl"
    old.write_text("")
    old.chmod(0o644)   # an older version's file
    os.close(open_private(old, os.O_WRONLY | os.O_APPEND))
    assert mode(old) == 0o600


def _claim(path: str, out) -> None:
    from pathlib import Path

    out.put(claim_secret(Path(path), "events key").hex())


def test_concurrent_first_claims_agree_on_one_secret(tmp_path):
    path = tmp_path / "store" / "events.key"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(path), out)) for _ in range(4)]
    for p in procs:
        p.start()
    got = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(10)
    assert len(got) == 1 and bytes.fromhex(got.pop()) == claim_secret(path, "events key")
    assert mode(path) == 0o600 and [p.name for p in path.parent.iterdir()] == ["events.key"]   # no temp file left
    path.chmod(0o640)
    with pytest.raises(ValueError, match=f"^events key {path}: readable by group or others"):
        claim_secret(path, "events key")
