"""Parsing what follows a command: numbers and files. Bad input is a CommandError naming it."""

from __future__ import annotations

from pathlib import Path

from kvchat.errors import CommandError
from kvchat.paths import user_path

MAX_FILE_BYTES = 16 << 20  # the largest file /context @FILE reads


def count(arg: str) -> int:
    """A whole number of 1 or more, as typed after a command."""
    try:
        number = int(arg)
    except ValueError:
        raise CommandError(f"not a number: {arg!r}") from None
    if number < 1:
        raise CommandError(f"must be 1 or more: {arg}")
    return number


def file_argument(text: str) -> Path:
    """The file named after `@` (a leading ~ expanded); a CommandError where none is named."""
    if not text.strip():
        raise CommandError("@ needs a file name: @FILE")
    return user_path(text)


def read_text(path: Path) -> str:
    """The UTF-8 text of a file of at most MAX_FILE_BYTES, without its final newlines."""
    # At most one byte past the limit is read, so /dev/zero or a huge file cannot hang or fill memory;
    # a named pipe is refused, since opening one waits for a writer that may never come.
    if path.is_fifo():
        raise CommandError(f"{path} is a pipe, not a file")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise CommandError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise CommandError(f"{path} is a directory, not a file") from None
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise CommandError(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise CommandError(f"{path} is empty")
    return text.rstrip("\n")
