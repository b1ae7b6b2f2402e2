"""The cluster token file: never written through a planted link, refused when another user could have
planted it, refused when short enough to guess."""

from __future__ import annotations

import os
import re
import stat

import pytest

from kvledger.util.cluster_token import ENV, MIN_CHARS, load_token, new_token_file

NOBODY = 65534
GOOD = "0123456789abcdef" * 4   # 64 characters


def test_a_planted_link_is_replaced_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "data" / "cluster.token"
    path.parent.mkdir()
    path.symlink_to(victim)
    token = new_token_file(path)
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text() == token + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(bytes.fromhex(token)) * 8 >= 128   # secrets, 256 bits
    assert [p.name for p in path.parent.iterdir()] == ["cluster.token"]   # no temp file left


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666], ids=oct)
def test_a_token_file_others_may_write_is_refused(tmp_path, mode):
    path = tmp_path / "cluster.token"
    path.write_text(GOOD)
    path.chmod(mode)
    with pytest.raises(ValueError, match="--token-file .*writable by group or others"):
        load_token(path)
    path.chmod(0o600)
    assert load_token(path) == GOOD


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644], ids=oct)
def test_a_token_file_others_may_read_is_refused(tmp_path, mode):
    """Issue 54 item 4: whoever reads the token speaks to every engine's internal API."""
    path = tmp_path / "cluster.token"
    path.write_text(GOOD)
    path.chmod(mode)
    line = f"--token-file {path}: readable by group or others (mode {mode:04o}); chmod 600 {path}"
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        load_token(path)
    path.chmod(0o600)
    assert load_token(path) == GOOD


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_token_file_another_user_owns_is_refused(tmp_path):
    path = tmp_path / "cluster.token"
    path.write_text(GOOD)
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ValueError, match="--token-file .*owned by uid 65534"):
        load_token(path)


@pytest.mark.parametrize("token", ["a" * 16, "x" * (MIN_CHARS - 1), "s3cr3t"])
def test_short_tokens_are_refused(tmp_path, monkeypatch, token):
    path = tmp_path / "cluster.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="--token-file .*at least 32 characters"):
        load_token(path)
    monkeypatch.setenv(ENV, token)
    with pytest.raises(ValueError, match=f"\\${ENV}: .*at least 32 characters"):
        load_token(None)
    monkeypatch.setenv(ENV, "y" * MIN_CHARS)
    assert load_token(None) == "y" * MIN_CHARS


@pytest.mark.parametrize("command", [["entrypoint"], ["engine", "--role", "both"]], ids=["entrypoint", "engine"])
def test_the_cli_names_the_flag_in_one_line_and_exits_2(run_cli, tmp_path, command):
    path = tmp_path / "cluster.token"
    path.write_text(GOOD)
    path.chmod(0o644)
    r = run_cli(*command, "--redis-url", "redis://127.0.0.1:9/0", "--data-dir", str(tmp_path / "d"),
                "--token-file", str(path), "--model", "tiny-v4", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvledger: error: --token-file "), r.stderr
