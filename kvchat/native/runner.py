"""The process that builds kvchat's kernel libraries (`python -m kvchat.native.runner FOLDER`, the
folder named for `ps` only), started by kvchat/native/build.py while the model loads.

It reads its plan, one JSON line, from stdin, and tells what it does, one JSON line per event, on stdout:
`waiting` (another build holds the folder), `compiling`/`compiled` per source file, `linking`, `built`,
or `failed` with the reason. Each library is built in its own folder, under an exclusive `flock` on
`kvchat.lock`: the kernel drops the lock with its holder, so a build killed anywhere never blocks the
next one. Objects and libraries are written under temporary names and renamed; the folder's manifest
(build_files.MANIFEST), written last, lists each file's SHA-256. A library whose sources, flags or
compiler changed, or whose files were damaged, is built again; objects that are still whole are kept.

The compilers run in process groups of their own. When kvchat goes away (stdin closes), or this
process is told to stop, they are killed with their children and the temporary files removed: no
compiler outlives the start that wanted it. Plain Python (no torch), so it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvchat import cache_files
from kvchat.native import build_files

_POLL_S = 0.1  # how often running compilers are looked at while waiting for kvchat to go away
_ERROR_LINES = 3  # of a compiler's output, in the reason a build failed


class Stopped(Exception):
    """kvchat went away, or this process was told to stop."""


@dataclass
class Job:
    """One library's build: its plan, its lock, the sources still to compile."""

    plan: build_files.LibraryPlan
    lock: int | None = None
    todo: list[str] = field(default_factory=list)
    compiling: int = 0
    failed: str | None = None

    @property
    def folder(self) -> Path:
        return Path(self.plan.folder)


@dataclass
class Child:
    """A compiler or linker running for a job, and the file it writes."""

    job: Job
    source: str | None  # None: the linker
    proc: subprocess.Popen[bytes]
    partial: Path


class Runner:
    """Builds the plan's libraries, `num_jobs` compilers at a time; owns every process it starts."""

    def __init__(self, plan: build_files.BuildPlan) -> None:
        self.jobs = [Job(library) for library in plan.libraries]
        self.num_jobs = max(1, plan.jobs)
        self.children: list[Child] = []

    def run(self) -> None:
        for job in self.jobs:
            self._prepare(job)
        queue = [(job, source) for job in self.jobs for source in job.todo]
        while queue or self.children:
            while queue and len(self.children) < self.num_jobs:
                job, source = queue.pop(0)
                if job.failed is None:
                    self._start(job, source)
            _watch(_POLL_S)
            for child in [c for c in self.children if c.proc.poll() is not None]:
                if child not in self.children:
                    continue  # killed with its job's failure meanwhile
                self.children.remove(child)
                self._finish(child)
                job = child.job
                if job.failed is None and child.source is not None:
                    job.compiling -= 1
                    if not job.compiling and not any(j is job for j, _ in queue):
                        self._start_link(job)

    def stop(self) -> None:
        """Kill every process still running, with its children, and remove what it was writing."""
        for child in self.children:
            _kill(child.proc)
            cache_files.remove(child.partial)
        self.children.clear()

    def _prepare(self, job: Job) -> None:
        """Take the library's lock (waiting while another build holds it) and find what is left to do."""
        try:
            job.folder.mkdir(parents=True, exist_ok=True)
            job.lock = os.open(job.folder / build_files.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fail(job, f"cannot write {job.folder} ({exc.strerror or exc})")
            return
        told = False
        while not _try_lock(job.lock):
            if not told:
                holder = os.pread(job.lock, 32, 0).decode(errors="replace").strip()
                _emit("waiting", job, pid=int(holder) if holder.isdigit() else None)
                told = True
            _watch(_POLL_S)
        os.ftruncate(job.lock, 0)
        os.pwrite(job.lock, str(os.getpid()).encode(), 0)
        if build_files.check_library(job.folder, job.plan) is None:
            _emit("built", job)  # another build finished it while we waited
            return
        for path in job.folder.glob(f".*{cache_files.PART}"):
            cache_files.remove(path)  # we hold the lock: whoever wrote these is gone
        plan = job.plan
        job.todo = [s for s in plan.sources if not build_files.object_is_whole(job.folder, plan, s)]
        _emit("start", job, files=[Path(s).name for s in job.todo], total=len(plan.sources))
        job.compiling = len(job.todo)
        if not job.todo:
            self._start_link(job)

    def _start(self, job: Job, source: str) -> None:
        obj = job.folder / build_files.object_name(source)
        partial = cache_files.part_path(obj)
        command = [job.plan.compiler, *job.plan.compile_flags, "-c", source, "-o", str(partial)]
        self._spawn(job, source, command, partial, obj.with_name(obj.name + ".log"))
        _emit("compiling", job, file=Path(source).name)

    def _start_link(self, job: Job) -> None:
        objects = [str(job.folder / build_files.object_name(s)) for s in job.plan.sources]
        partial = cache_files.part_path(job.folder / "library.so")
        command = [job.plan.compiler, *objects, *job.plan.link_flags, "-o", str(partial)]
        self._spawn(job, None, command, partial, job.folder / "link.log")
        _emit("linking", job)

    def _spawn(self, job: Job, source: str | None, command: list[str], partial: Path, log: Path) -> None:
        with log.open("wb") as out:  # its own group: killed with the processes it starts
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append(Child(job, source, proc, partial))

    def _finish(self, child: Child) -> None:
        job, source = child.job, child.source
        what = f"{Path(source).name} did not compile" if source is not None else "linking failed"
        log = job.folder / (f"{build_files.object_name(source)}.log" if source is not None else "link.log")
        if child.proc.returncode != 0 or job.failed is not None:
            cache_files.remove(child.partial)
            if job.failed is None:
                self._fail(job, f"{what}: {_error_lines(log)}")
            return
        cache_files.remove(log)  # what a failure said is kept; a success says nothing worth keeping
        if source is None:
            build_files.publish_library(job.folder, job.plan, child.partial)
            _emit("built", job)
            return
        os.replace(child.partial, job.folder / build_files.object_name(source))
        build_files.note_object(job.folder, job.plan, source)
        _emit("compiled", job, file=Path(source).name)

    def _fail(self, job: Job, reason: str) -> None:
        """The job's library cannot be built: its other compilers are stopped; other libraries go on."""
        job.failed = reason
        for child in [c for c in self.children if c.job is job]:
            _kill(child.proc)
            cache_files.remove(child.partial)
            self.children.remove(child)
        _emit("failed", job, reason=reason)


def main() -> int:
    line = sys.stdin.readline()
    if not line:
        return 1
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    runner = Runner(build_files.BuildPlan.from_json(line))
    try:
        runner.run()
    except Stopped:
        return 1
    finally:
        runner.stop()
    return 0


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def _emit(event: str, job: Job, **fields: object) -> None:
    print(json.dumps({"event": event, "library": job.plan.name, **fields}), flush=True)


def _watch(timeout: float) -> None:
    """Wait up to `timeout` seconds; Stopped as soon as kvchat closes our stdin (it went away)."""
    readable, _, _ = select.select([sys.stdin], [], [], timeout)
    if readable and not sys.stdin.readline():
        raise Stopped("kvchat is gone")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _error_lines(log: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        errors = [line for line in lines if "error" in line.lower()] or lines
        return " / ".join(errors[:_ERROR_LINES]) or "no output"
    return "no output"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill a compiler with every process it started (its group: the driver, cc1plus, the assembler)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


if __name__ == "__main__":
    sys.exit(main())
