"""Where a save may be written: a new file, or a regular file that already holds a kvchat save.

The file is written to a temporary beside it and renamed over it, so a failed save leaves the old one.
Temporaries are named `.NAME.kvchat-PID-RANDOM.tmp`: one left by a killed process is removed by the
next save into that folder, and none is left behind by an error or an interrupt.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvchat.errors import StateFileError

_TEMPORARY = re.compile(r"^\..*\.kvchat-(\d+)-[0-9a-f]+\.tmp$")


def write(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    is_state_meta: Callable[[str], bool],
) -> None:
    """Write a safetensors file to `path` atomically, refusing a target that is not ours to replace;
    any failure is one StateFileError naming why."""
    check_target(path, is_state_meta)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        tmp = path.parent / f".{path.name}.kvchat-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        mode = _create_under_umask(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.chmod(tmp, mode)  # safetensors may write a file of its own with mode 0600
        os.replace(tmp, path)
    except (OSError, SafetensorError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise StateFileError(f"cannot save to {path}: {reason}") from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


def _create_under_umask(path: Path) -> int:
    """Create an empty file as any tool would (0666 less the umask); returns its mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def check_target(path: Path, is_state_meta: Callable[[str], bool]) -> None:
    """Refuse what a save must not replace: a directory, a link, a device or FIFO, a file that is not
    a kvchat save, or a path under a file."""
    blocker = next((p for p in path.parents if os.path.lexists(p)), None)
    if blocker is not None and not blocker.is_dir():
        raise StateFileError(f"cannot save to {path}: {blocker} is a file, not a directory")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise StateFileError(f"cannot save to {path}: {err.strerror}") from None
    if stat.S_ISDIR(mode):
        raise StateFileError(f"cannot save to {path}: it is a directory")
    if stat.S_ISLNK(mode):
        raise StateFileError(f"cannot save to {path}: it is a symbolic link; name the file itself")
    if not stat.S_ISREG(mode):
        raise StateFileError(f"cannot save to {path}: not a regular file")
    if not _holds_state(path, is_state_meta):
        raise StateFileError(f"cannot save to {path}: it exists and is not a kvchat save")


def _holds_state(path: Path, is_state_meta: Callable[[str], bool]) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            return is_state_meta((f.metadata() or {}).get("kvchat", "null"))
    except (SafetensorError, OSError, ValueError):
        return False


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporaries of saves whose process is gone; returns what was removed."""
    removed = []
    for entry in folder.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match and not _is_running(int(match.group(1))) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _is_running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # one of ours, left by an earlier failure this one cannot have
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
