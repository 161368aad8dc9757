"""Ray's token authentication, as logbus meets it: what a cluster uses, and how another process or host joins it.

How Ray 2.60 decides (``ray/_private/worker.py``, ``ray/scripts/scripts.py``,
``ray/_private/authentication/``):

- The mode is the environment variable ``RAY_AUTH_MODE`` (``token`` or
  ``disabled``), read by every Ray process; it is meant to be the same on
  every node. With ``token``, every call to the GCS, a raylet or a worker
  carries the token and is refused without it (``InvalidAuthToken``).
- ``ray.init()`` that starts a new local cluster (the embedded default) turns
  token mode on unless ``RAY_AUTH_MODE`` is set: it sets
  ``RAY_AUTH_MODE=token`` in its own environment (so the cluster's processes
  it starts inherit it) and, if no token is found, writes a new one to
  ``~/.ray/auth_token``.
- ``ray start --head`` turns it on only if ``RAY_AUTH_MODE`` is unset and a
  token is found; ``ray start --address`` (a node joining) uses only what its
  environment says.
- ``ray.init`` joining a running cluster turns it on when the cluster was
  found on this machine (``address`` None or ``"auto"``) and a token is
  found. An explicit address never turns it on: such a driver connects
  without a token, and a cluster in token mode refuses it.
- The token is ``RAY_AUTH_TOKEN``, else the file named by
  ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``.

So a process that joins a cluster by its address, as a second process over
a data directory joins the first one's (``logbus.connect()``), or a host
joining with ``logbus join``, must be given the mode and the token. The
controller notes the cluster's mode, and where its token file is, beside its
owner lock (:func:`cluster_auth`); joiners apply it (:func:`use_auth`).
Auth is never turned off by logbus: a cluster in token mode stays in it.
"""

from __future__ import annotations

import os

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_MODE = "token"
DISABLED_MODE = "disabled"
DEFAULT_TOKEN_FILE = os.path.join("~", ".ray", "auth_token")


def process_auth_mode() -> str:
    """This process's Ray auth mode as Ray's own config has it ("token", "disabled", or Ray's name for another)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode  # noqa: PLC0415 (Ray's private config)

    mode = get_authentication_mode()
    if mode == AuthenticationMode.TOKEN:
        return TOKEN_MODE
    return DISABLED_MODE if mode == AuthenticationMode.DISABLED else str(os.environ.get(AUTH_MODE_ENV, mode))


def token_file_in_use(environ: dict | None = None) -> str | None:
    """The file this process's token comes from: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token if it exists;
    None when the token is given in RAY_AUTH_TOKEN itself (it then lives only in the environment)."""
    environ = os.environ if environ is None else environ
    if environ.get(TOKEN_ENV):
        return None
    if environ.get(TOKEN_PATH_ENV):
        return os.path.abspath(environ[TOKEN_PATH_ENV])
    default = os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".ray", "auth_token")
    return default if os.path.isfile(default) else None


def cluster_auth() -> dict:
    """What a joiner needs to know of this cluster's auth, for the controller's owner note: the mode and,
    in token mode, the token's file (its path only, never the token). Called inside the cluster, where
    Ray's processes run with the environment the cluster was started with."""
    mode = process_auth_mode()
    return {"mode": mode, "token_file": token_file_in_use() if mode == TOKEN_MODE else None}


def has_own_token(environ: dict | None = None) -> bool:
    """Whether this process has a token of its own: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(TOKEN_ENV) or environ.get(TOKEN_PATH_ENV)) or token_file_in_use(environ) is not None


def use_auth(auth: dict) -> None:
    """Make this process (and the processes it starts) use a cluster's auth, as noted by :func:`cluster_auth`.

    Token mode: ``RAY_AUTH_MODE=token``, and the cluster's token file as
    ``RAY_AUTH_TOKEN_PATH`` unless this process was given a token of its own
    (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``: the user's word wins).
    Other modes: ``RAY_AUTH_MODE`` set to that mode. Like Ray itself when it
    turns token mode on for a new cluster, this sets ``os.environ`` and
    reloads Ray's cached config and token; call it before ``ray.init``.
    """
    from ray._raylet import AuthenticationTokenLoader, Config  # noqa: PLC0415 (Ray's private config)

    mode = auth.get("mode") or DISABLED_MODE
    os.environ[AUTH_MODE_ENV] = mode
    if mode == TOKEN_MODE and not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV)) and auth.get("token_file"):
        os.environ[TOKEN_PATH_ENV] = auth["token_file"]
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def use_local_cluster_rule() -> None:
    """Ray's own rule for joining a cluster found on this machine: token mode if RAY_AUTH_MODE is unset
    and a token is found (what ``ray.init(address="auto")`` does)."""
    from ray._private.authentication.authentication_token_setup import (  # noqa: PLC0415 (Ray's private setup)
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def check_token_file(path: str) -> str:
    """The absolute path of a readable, non-empty token file; ValueError saying what is wrong otherwise."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path) as file:
            token = file.read().strip()
    except OSError as error:
        raise ValueError(f"cannot read the token file {path}: {error.strerror or error}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return path


def join_environment(token_file: str | None, environ: dict | None = None) -> dict:
    """The environment for a Ray process joining a cluster in token mode: ``RAY_AUTH_MODE=token`` and the
    token from ``token_file``, else the token this environment already has (ValueError if it has none)."""
    env = dict(os.environ if environ is None else environ)
    env[AUTH_MODE_ENV] = TOKEN_MODE
    if token_file is not None:
        env.pop(TOKEN_ENV, None)  # the file given wins over a token inherited from the environment
        env[TOKEN_PATH_ENV] = check_token_file(token_file)
    elif not has_own_token(env):
        raise ValueError(
            "the cluster's token is needed: give --token-file (on the head: `ray get-auth-token`), "
            f"or set {TOKEN_ENV} or {TOKEN_PATH_ENV}"
        )
    elif env.get(TOKEN_PATH_ENV):
        env[TOKEN_PATH_ENV] = check_token_file(env[TOKEN_PATH_ENV])
    return env
