"""The API key (--api-key, else $MINISGL_API_KEY): `credentials_refused` checks a request's
headers for it (the gate answers 401 on every path but /health), `hide_api_key` masks it in
the server's command line."""

from __future__ import annotations

import hmac
import os
import sys


def env_api_key() -> str | None:
    """MINISGL_API_KEY: the API key when --api-key is not given (private to its user, unlike a
    command line). Empty: none."""
    return os.environ.get("MINISGL_API_KEY") or None


def credentials_refused(headers: list[tuple[bytes, bytes]], key: bytes) -> str | None:
    """Why a request's credentials do not carry the API key, or None when they do."""
    # RFC 7235: exactly one Authorization header, `auth-scheme 1*SP token`, the scheme in any
    # case; or the key alone in one x-api-key header, as Anthropic's clients send it.
    x_api_key = [value for name, value in headers if name == b"x-api-key"]
    if len(x_api_key) == 1 and hmac.compare_digest(x_api_key[0], key):
        return None
    given = [value for name, value in headers if name == b"authorization"]  # names: lower case
    scheme, _, token = (given[0] if given else b"").partition(b" ")
    matches = hmac.compare_digest(token.lstrip(b" "), key)  # always made: constant time
    if len(given) > 1:
        return f"{len(given)} Authorization headers: send exactly one ('Bearer KEY')"
    if scheme.lower() != b"bearer" or not matches:
        return "invalid or missing API key"
    return None


def hide_api_key() -> None:
    """Mask --api-key's value in this process's command line (`ps`, /proc/PID/cmdline), which
    other users can read (MINISGL_API_KEY keeps it private)."""
    argv = list(sys.orig_argv)
    for i, arg in enumerate(argv):
        if arg == "--api-key" and i + 1 < len(argv):
            argv[i + 1] = "***"
        elif arg.startswith("--api-key="):
            argv[i] = "--api-key=***"
    if argv != sys.orig_argv:
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))
