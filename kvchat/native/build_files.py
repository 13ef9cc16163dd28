"""What a kernel build plans and leaves in its folder, and the checks that decide whether it can be
used: read by kvchat (kvchat/native/build.py) and by the build process (runner.py). Plain Python.

A library's folder holds its objects, each with a note of what it was compiled from and its SHA-256
(`X.o.json`), the library under a name carrying its digest, and the manifest (`kvchat-build.json`)
written last: the key of everything the library is built from (compiler, flags, each source's
content) and the library's size and SHA-256. A library is used only when its manifest is whole, its
key is the one this kvchat would build, and its file hashes to the manifest's digest: a library
truncated or damaged on disk is never loaded (loading one can crash the process), it is built again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvchat import cache_files

LOCK = "kvchat.lock"
MANIFEST = "kvchat-build.json"
FORMAT = "kvchat-build/1"


@dataclass(frozen=True)
class LibraryPlan:
    """How one library is built: its sources, compiler and flags, and where."""

    name: str
    folder: str
    compiler: str
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]
    sources: tuple[str, ...]  # absolute paths

    @property
    def key(self) -> str:
        """A hash of everything the library is built from (the sources by content)."""
        inputs = {
            "format": FORMAT,
            "name": self.name,
            "compiler": self.compiler,
            "compile": self.compile_flags,
            "link": self.link_flags,
            "sources": [object_key(self, s) for s in self.sources],
        }
        return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


@dataclass(frozen=True)
class BuildPlan:
    """What the build process is asked to do: libraries, built `jobs` compilers at a time."""

    jobs: int
    libraries: tuple[LibraryPlan, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BuildPlan:
        data = json.loads(text)
        libraries = tuple(
            LibraryPlan(
                name=lib["name"],
                folder=lib["folder"],
                compiler=lib["compiler"],
                compile_flags=tuple(lib["compile_flags"]),
                link_flags=tuple(lib["link_flags"]),
                sources=tuple(lib["sources"]),
            )
            for lib in data["libraries"]
        )
        return cls(data["jobs"], libraries)


def object_name(source: str) -> str:
    return f"{Path(source).stem}.o"


def object_key(plan: LibraryPlan, source: str) -> str:
    """A hash of what an object is compiled from: the compiler, its flags, the source's content and
    that of the headers beside it (kvchat's own, which sources may include)."""
    digest = hashlib.sha256(json.dumps([plan.compiler, plan.compile_flags, Path(source).name]).encode())
    digest.update(Path(source).read_bytes())
    for header in sorted(Path(source).parent.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()


def note_object(folder: Path, plan: LibraryPlan, source: str) -> None:
    """Record what the object of `source`, just compiled, was made from and its SHA-256."""
    obj = folder / object_name(source)
    note = {"key": object_key(plan, source), "sha256": cache_files.sha256_of(obj)}
    cache_files.write_atomically(obj.with_name(obj.name + ".json"), json.dumps(note).encode())


def object_is_whole(folder: Path, plan: LibraryPlan, source: str) -> bool:
    """Whether the object of `source` in `folder` was compiled from what the plan compiles, intact."""
    obj = folder / object_name(source)
    try:
        note = json.loads(obj.with_name(obj.name + ".json").read_bytes())
        return note == {"key": object_key(plan, source), "sha256": cache_files.sha256_of(obj)}
    except (OSError, ValueError):
        return False


def check_library(folder: Path, plan: LibraryPlan) -> str | None:
    """Why the library in `folder` cannot be used for `plan`, or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        return "not built yet"
    except (OSError, ValueError):
        return "its manifest is damaged"
    fields = ("format", "key", "library", "size", "sha256")
    if not isinstance(manifest, dict) or sorted(manifest) != sorted(fields) or manifest["format"] != FORMAT:
        return "its manifest is damaged"
    if manifest["key"] != plan.key:
        return "built from other sources or flags"
    library = folder / str(manifest["library"])
    if library.parent != folder:
        return "its manifest is damaged"
    try:
        size = library.stat().st_size
        if size != manifest["size"]:
            return f"the library has {size:,} bytes where {manifest['size']:,} were written"
        if cache_files.sha256_of(library) != manifest["sha256"]:
            return "the library was changed since it was built"
    except OSError:
        return "the library is missing"
    return None


def library_path(folder: Path) -> Path:
    """The library the manifest names (after check_library said it can be used)."""
    return folder / json.loads((folder / MANIFEST).read_bytes())["library"]


def publish_library(folder: Path, plan: LibraryPlan, partial: Path) -> None:
    """Name the library just linked at `partial` by its digest, write the manifest, and remove older
    libraries (a process that has one loaded keeps it: removing a file does not unmap it)."""
    digest = cache_files.sha256_of(partial)
    final = folder / f"{plan.name}-{digest[:16]}.so"
    size = partial.stat().st_size
    os.replace(partial, final)
    manifest = {"format": FORMAT, "key": plan.key, "library": final.name, "size": size, "sha256": digest}
    cache_files.write_atomically(folder / MANIFEST, json.dumps(manifest).encode())
    for old in folder.glob(f"{plan.name}-*.so"):
        if old != final:
            with contextlib.suppress(OSError):
                old.unlink()
