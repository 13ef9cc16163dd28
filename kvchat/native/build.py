"""Building kvchat's kernel libraries while the model loads, and finding the ones that can be loaded.

`Build(plans).start(progress)` checks each library's folder (build_files.check_library) and, for those
not built, starts the build process (runner.py) and returns at once: the model loads meanwhile. A
thread reads the process's events and reports them: the files being compiled and how many of all are
done. `wait()` gives each library's checked file, or why there is none, in one line. A build stopped
by Ctrl-C stops its compilers; one whose kvchat was killed stops by itself (runner.py).

Each library is built in a folder of its own, under `$TORCH_EXTENSIONS_DIR` where set, else under
kvchat's cache folder (`kernels/`), named by the library (its tier: kvchat/native/tiers.py), the
machine, the sources' folder, Python's and torch's versions: the instructions a library uses are its
explicit flags, part of its key (build_files.py), so a cache shared between machines serves each CPU
only a tier it runs, and two copies of kvchat on one machine keep one each.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

import kvchat
from kvchat import cache_files
from kvchat.cache_files import cache_dir
from kvchat.native import build_files
from kvchat.native.build_files import BuildPlan, LibraryPlan

BUILDING = "building kvchat's kernels"  # how the build's progress descriptions start

Progress = Callable[[str, float, "float | None"], None]


@dataclass(frozen=True)
class Library:
    """One library of kernels: its sources (in kvchat/native) and the flags it is compiled with."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]


def plan(library: Library, source_folder: Path) -> LibraryPlan:
    """How `library` is built on this machine, with this torch, from the sources in `source_folder`."""
    torch_dir = Path(torch.__file__).resolve().parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [f for path in includes for f in ("-isystem", str(path))]
    compile_flags += ["-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *library.flags]
    link_flags = ["-shared", f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch"]
    if sys.platform == "darwin":
        link_flags += ["-undefined", "dynamic_lookup"]
    folder = build_root() / f"kvchat_{library.name}_{_build_tag(source_folder)}"
    return LibraryPlan(
        name=library.name,
        folder=str(folder),
        compiler=os.environ.get("CXX") or "c++",
        compile_flags=tuple(compile_flags),
        link_flags=tuple(link_flags),
        sources=tuple(str(source_folder / name) for name in library.sources),
    )


def build_root() -> Path:
    """`$TORCH_EXTENSIONS_DIR` where set (as torch builds its extensions), else kvchat's cache folder."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(explicit).expanduser() if explicit else cache_dir() / "kernels"


def _build_tag(sources: Path) -> str:
    """A short hash of the machine, where the sources are, and the versions."""
    versions = f"{sys.version_info[:2]} {torch.__version__}"
    text = f"{platform.machine()} {sources.resolve()} {versions}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class Build:
    """One build of kvchat's libraries: started, then waited for."""

    def __init__(self, plans: list[LibraryPlan], num_jobs: int | None = None) -> None:
        self.plans = plans
        self.num_jobs = num_jobs or _num_cpus()  # one compiler a CPU
        self.results: dict[str, Path | str] = {}  # a library's file, or why there is none
        self._proc: subprocess.Popen[str] | None = None
        self._errors: IO[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._progress: Progress | None = None
        self._total = self._done = 0
        self._compiling: list[str] = []

    @property
    def building(self) -> bool:
        """Whether a build process was started (some library was not built)."""
        return self._proc is not None

    def start(self, progress: Progress | None = None) -> None:
        """Check each library; start building those that cannot be used, in the background."""
        todo = []
        for library in self.plans:
            cache_files.sweep(Path(library.folder))  # what builds killed outright left
            if build_files.check_library(Path(library.folder), library) is None:
                self.results[library.name] = build_files.library_path(Path(library.folder))
            else:
                todo.append(library)
        if not todo:
            return
        compiler = todo[0].compiler
        if shutil.which(compiler) is None:
            for library in todo:
                self.results[library.name] = f"no C++ compiler found ({compiler})"
            return
        self._progress = progress
        self._start_runner(BuildPlan(self.num_jobs, tuple(todo)))

    def _start_runner(self, build_plan: BuildPlan) -> None:
        env = dict(os.environ)
        package_root = str(Path(kvchat.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self._errors = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvchat.native.runner", str(Path(build_plan.libraries[0].folder).parent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
            env=env,
            start_new_session=True,  # a Ctrl-C on the terminal is kvchat's to handle
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(build_plan.to_json() + "\n")
        self._proc.stdin.flush()  # and kept open: its closing tells the build that kvchat is gone
        self._reader = threading.Thread(target=self._read_events, name="kvchat-build", daemon=True)
        self._reader.start()

    def _read_events(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self._on_event(event)

    def _on_event(self, event: dict) -> None:
        kind, name = event.get("event"), event.get("library", "")
        if kind == "waiting":
            holder = f" (pid {event['pid']})" if event.get("pid") else ""
            self._report(f"{BUILDING}: waiting for another kvchat building them{holder}")
        elif kind == "start":
            self._total += len(event.get("files", []))
            self._report(f"{BUILDING} for this CPU")
        elif kind == "compiling":
            self._compiling.append(event["file"])
            self._report(self._describe())
        elif kind == "compiled":
            self._compiling.remove(event["file"])
            self._done += 1
            self._report(self._describe())
        elif kind == "linking":
            self._report(f"{BUILDING} for this CPU: linking {name}")
        elif kind == "failed":
            self.results[name] = str(event.get("reason", "the build failed"))

    def _describe(self) -> str:
        """The files being compiled, or that all are done."""
        if self._compiling:
            return f"{BUILDING} for this CPU: {', '.join(self._compiling)}"
        return f"{BUILDING} for this CPU" + (": done" if self._done >= self._total else "")

    def _report(self, description: str) -> None:
        if self._progress is not None:
            self._progress(description, self._done, self._total or None)

    def wait(self) -> dict[str, Path | str]:
        """Wait for the build under way; each library's checked file, or why there is none."""
        if self._proc is not None and self._reader is not None:
            try:
                self._reader.join()
                self._proc.wait()
            except BaseException:  # Ctrl-C: the build stops with its compilers
                self._proc.terminate()
                self._proc.wait()
                raise
            finally:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            crashed = self._proc.returncode != 0 and self._runner_error()
            for library in self.plans:
                if library.name in self.results:
                    continue
                problem = build_files.check_library(Path(library.folder), library)
                folder = Path(library.folder)
                self.results[library.name] = (
                    build_files.library_path(folder)
                    if problem is None
                    else crashed or f"not built: {problem}"
                )
            self._proc = None
        return self.results

    def _runner_error(self) -> str:
        assert self._errors is not None
        self._errors.seek(0)
        lines = self._errors.read().decode(errors="replace").strip().splitlines()
        return f"the build process failed: {lines[-1] if lines else 'no output'}"


def _num_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
