"""What kvchat keeps on disk is read back as untrusted input: sealed folders, temporary names, digests.

A cache entry (a converted model, a model's quantized layers) is a folder written under a temporary
name, sealed, and renamed into place, so a reader never sees half of one. The seal,
`kvchat-seal.json`, lists each file's size and SHA-256. `check_seal` answers why a folder cannot be
trusted (a file missing, truncated or changed), or None. Hashing gigabytes at every start would cost
seconds, so the seal also keeps each file's stamp (device, inode, size, modification and change times)
from when it was last hashed: a file whose stamp is unchanged was not written since, and is not read
again. Any write through the file system changes the change time, which no program can set back.

Temporary names carry the writer's process id (`.NAME.PID.part`): `sweep` removes those whose writer
is gone, so an interrupted write leaves nothing behind for long. Plain Python (no torch): the kernel
build process imports it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path

SEAL = "kvchat-seal.json"
SEAL_FORMAT = "kvchat-seal/1"
PART = ".part"
# Temporary names of older kvchat versions (mkdtemp, mkstemp, `.NAME.PID`): removed once this old.
_LEGACY_AGE_S = 3600
_counter = itertools.count()

Stamp = list[int]  # [device, inode, size, mtime_ns, ctime_ns]


def cache_dir() -> Path:
    """kvchat's cache folder: `$KVCHAT_CACHE_DIR`, else ~/.cache/kvchat."""
    return Path(os.environ.get("KVCHAT_CACHE_DIR") or "~/.cache/kvchat").expanduser()


def sha256_of(path: Path) -> str:
    """The SHA-256 of a whole file, read in pieces."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def stamp_of(path: Path) -> Stamp:
    """What changes whenever a file is written, moved in or copied: see the module docstring."""
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# -- sealed folders ------------------------------------------------------------------------------


def seal(folder: Path) -> None:
    """Hash every file of `folder` into its seal (written last)."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != SEAL:
            files[path.name] = {
                "size": path.stat().st_size,
                "sha256": sha256_of(path),
                "stamp": stamp_of(path),
            }
    write_atomically(folder / SEAL, json.dumps({"format": SEAL_FORMAT, "files": files}, indent=1).encode())


def check_seal(folder: Path, required: tuple[str, ...] = ()) -> str | None:
    """Why `folder` cannot be trusted, in a few words, or None when every sealed file (and each of
    `required`) is there as it was sealed. Files hashed again and found whole get their new stamp."""
    files = _read_seal(folder)
    if isinstance(files, str):
        return files
    missing = [name for name in required if name not in files]
    if missing:
        return f"its seal does not list {', '.join(missing)}"
    restamped = False
    for name, entry in files.items():
        path = folder / name
        try:
            stamp = stamp_of(path)
        except OSError:
            return f"{name} is missing"
        if stamp[2] != entry["size"]:
            return f"{name} has {stamp[2]:,} bytes where {entry['size']:,} were written"
        if stamp == entry["stamp"]:
            continue
        if sha256_of(path) != entry["sha256"]:
            return f"{name} was changed since it was written (its SHA-256 differs)"
        entry["stamp"], restamped = stamp, True
    if restamped:  # next time, no need to read them again; a read-only folder is hashed each time
        with contextlib.suppress(OSError):
            write_atomically(folder / SEAL, json.dumps({"format": SEAL_FORMAT, "files": files}).encode())
    return None


def _read_seal(folder: Path) -> dict[str, dict] | str:
    """The seal's files, or why it cannot be read."""
    try:
        seal = json.loads((folder / SEAL).read_bytes())
    except FileNotFoundError:
        return "it has no seal (written by an older kvchat, or never finished)"
    except (OSError, ValueError) as exc:
        return f"its seal cannot be read ({type(exc).__name__})"
    files = seal.get("files") if isinstance(seal, dict) and seal.get("format") == SEAL_FORMAT else None
    if not isinstance(files, dict) or not all(_is_entry(name, e) for name, e in files.items()):
        return "its seal is damaged"
    return files


def _is_entry(name: object, entry: object) -> bool:
    return (
        isinstance(name, str)
        and "/" not in name
        and name not in ("", ".", "..", SEAL)
        and isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
        and isinstance(entry.get("stamp"), list)
        and len(entry["stamp"]) == 5
        and all(isinstance(v, int) for v in entry["stamp"])
    )


# -- temporary names, publishing, sweeping -------------------------------------------------------


def part_path(target: Path) -> Path:
    """A temporary name beside `target`, unique to this process: `.NAME.PID-N.part`."""
    return target.with_name(f".{target.name}.{os.getpid()}-{next(_counter)}{PART}")


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` under a temporary name and rename it to `path`; on any error, nothing is left."""
    partial = part_path(path)
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        remove(partial)


def publish(staging: Path, target: Path) -> None:
    """Seal the folder `staging` and rename it to `target`. Where another process published `target`
    first, its folder stands and `staging` is removed. OSError where it cannot be written."""
    seal(staging)
    try:
        os.rename(staging, target)
    except OSError:
        if not target.is_dir() or check_seal(target) is not None:
            raise
        remove(staging)  # another kvchat finished first; its folder is as good as ours


def remove(path: Path) -> None:
    """Remove a file or a folder, as far as it can be: what stays is swept later."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def sweep(folder: Path) -> list[str]:
    """Remove the temporary files and folders in `folder` left by writers that are gone (and older
    versions' ones after an hour); the names removed."""
    removed: list[str] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for path in entries:
        if path.name.startswith(".") and _is_abandoned(path):
            remove(path)
            removed.append(path.name)
    return removed


def _is_abandoned(path: Path) -> bool:
    name = path.name
    if name.endswith(PART):
        pid = name.removesuffix(PART).rpartition(".")[2].partition("-")[0]
        return pid.isdigit() and not _is_alive(int(pid))
    try:
        return time.time() - path.lstat().st_mtime > _LEGACY_AGE_S
    except OSError:
        return False


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True
