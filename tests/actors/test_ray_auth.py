"""Ray's token auth as logbus applies it: where a token comes from, and a joining process's environment.

No Ray cluster: these read and build environments only.
"""

from __future__ import annotations

import pytest

from logbus.actors import ray_auth


def test_the_token_file_in_use_follows_rays_precedence(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    assert ray_auth.token_file_in_use({"HOME": str(home)}) is None  # no token anywhere
    (home / ".ray" / "auth_token").write_text("t")
    assert ray_auth.token_file_in_use({"HOME": str(home)}) == str(home / ".ray" / "auth_token")
    assert ray_auth.token_file_in_use({"HOME": str(home), "RAY_AUTH_TOKEN_PATH": "x/token"}).endswith("/x/token")
    # A token given in the environment itself lives in no file.
    assert ray_auth.token_file_in_use({"HOME": str(home), "RAY_AUTH_TOKEN": "t", "RAY_AUTH_TOKEN_PATH": "x"}) is None
    assert ray_auth.has_own_token({"HOME": str(tmp_path), "RAY_AUTH_TOKEN": "t"})
    assert not ray_auth.has_own_token({"HOME": str(tmp_path)})


def test_a_joining_environment_always_has_token_mode_and_a_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret\n")
    env = ray_auth.join_environment(str(token), {"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "old"})
    assert env["RAY_AUTH_MODE"] == "token"  # never off
    assert env["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert "RAY_AUTH_TOKEN" not in env  # the file given wins over an inherited token
    kept = ray_auth.join_environment(None, {"HOME": str(tmp_path), "RAY_AUTH_TOKEN": "mine"})
    assert kept["RAY_AUTH_TOKEN"] == "mine" and kept["RAY_AUTH_MODE"] == "token"
    with pytest.raises(ValueError, match="the cluster's token is needed"):
        ray_auth.join_environment(None, {"HOME": str(tmp_path)})


def test_bad_token_files_are_refused_with_their_reason(tmp_path):
    with pytest.raises(ValueError, match="cannot read the token file .*missing"):
        ray_auth.check_token_file(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        ray_auth.check_token_file(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        ray_auth.join_environment(None, {"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})
