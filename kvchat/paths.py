"""Paths a user typed (a command's argument, a setting): ~ expanded, one clear error for what cannot
name a file."""

from __future__ import annotations

from pathlib import Path

from kvchat.errors import PathError


def user_path(text: str) -> Path:
    """`text` as a path with a leading ~ or ~user expanded; raises PathError for a NUL byte or an
    unknown user."""
    if "\0" in text:
        raise PathError(f"{text!r}: a path cannot hold a NUL byte")
    try:
        return Path(text).expanduser()
    except RuntimeError:
        user = text.split("/", 1)[0]
        raise PathError(f"{text}: no such user {user[1:]!r}") from None
