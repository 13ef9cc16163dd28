"""The kernel build machinery (kvchat/native/build.py, runner.py) on small C++ libraries: built once
and then loaded without a build, a damaged library built again from its whole objects, a folder
locked by a live build waited for and one left by a dead build taken over, and a build killed at
random points leaving no process behind, with the next build finishing."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.native import build_files
from kvchat.native.build import Build
from kvchat.native.build_files import LibraryPlan

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

SOURCE = """extern "C" int {name}(int x) {{ return x + {value}; }}\n"""
# Each takes a compiler a few tenths of a second: long enough for a kill, or a second build, to land
# inside one.
SLOW_SOURCE = """#include <map>
#include <regex>
#include <string>
extern "C" int {name}(int x) {{ std::map<std::string, int> m{{{{"a", x}}}}; return m["a"] + {value}; }}
"""


def make_plan(
    tmp_path: Path, names: tuple[str, ...] = ("one", "two", "three"), source: str = SOURCE
) -> LibraryPlan:
    sources = tmp_path / "src"
    sources.mkdir(exist_ok=True)
    for value, name in enumerate(names):
        (sources / f"{name}.cpp").write_text(source.format(name=name, value=value))
    return LibraryPlan(
        name="tiny",
        folder=str(tmp_path / "build" / "kvchat_tiny"),
        compiler="c++",
        compile_flags=("-O1", "-fPIC"),
        link_flags=("-shared",),
        sources=tuple(str(sources / f"{name}.cpp") for name in names),
    )


def build(plan: LibraryPlan) -> tuple[Path | str, list[str]]:
    """The library built (or why not) and the progress reported."""
    reports: list[str] = []
    run = Build([plan], num_jobs=2)
    run.start(lambda description, done, total: reports.append(description))
    return run.wait()[plan.name], reports


def call(library: Path, name: str) -> int:
    import ctypes

    return getattr(ctypes.CDLL(str(library)), name)(40)


def test_a_library_is_built_once_then_used_as_it_is(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    library, reports = build(plan)
    assert isinstance(library, Path) and call(library, "three") == 42
    assert "building kvchat's kernels for this CPU: one.cpp, two.cpp" in reports
    folder = Path(plan.folder)
    listing = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    again = Build([plan])
    again.start()
    assert not again.building and again.wait()[plan.name] == library
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == listing  # nothing written


@pytest.mark.parametrize("damage", ["truncate", "empty", "flip", "manifest"])
def test_a_damaged_library_is_built_again_from_its_whole_objects(tmp_path: Path, damage: str) -> None:
    plan = make_plan(tmp_path)
    library, _ = build(plan)
    assert isinstance(library, Path)
    data = library.read_bytes()
    if damage == "truncate":
        library.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        library.write_bytes(b"")
    elif damage == "flip":
        library.write_bytes(data[:4000] + bytes([data[4000] ^ 1]) + data[4001:])
    else:
        (Path(plan.folder) / build_files.MANIFEST).write_text("{")
    assert build_files.check_library(Path(plan.folder), plan) is not None
    (Path(plan.folder) / "two.o").write_bytes(b"damaged")
    rebuilt, reports = build(plan)
    assert isinstance(rebuilt, Path) and call(rebuilt, "two") == 41
    compiled = [r for r in reports if r.endswith(".cpp")]
    assert compiled == ["building kvchat's kernels for this CPU: two.cpp"]  # the others were whole


def test_a_changed_source_is_compiled_again(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    build(plan)
    Path(plan.sources[0]).write_text(SOURCE.format(name="one", value=7))
    library, reports = build(plan)
    assert isinstance(library, Path) and call(library, "one") == 47
    assert [r for r in reports if r.endswith(".cpp")] == ["building kvchat's kernels for this CPU: one.cpp"]


def test_a_compile_error_is_one_line(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    Path(plan.sources[1]).write_text("int broken(")
    reason, _ = build(plan)
    assert isinstance(reason, str) and reason.startswith("two.cpp did not compile: ") and "\n" not in reason


@pytest.mark.slow  # two builds of the slow source
def test_two_builds_at_once_compile_each_file_once(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, source=SLOW_SOURCE)
    reports: list[list[str]] = [[], []]
    runs = [Build([plan], num_jobs=2) for _ in reports]
    for run, seen in zip(runs, reports, strict=True):
        run.start(lambda description, done, total, seen=seen: seen.append(description))
    libraries = [run.wait()[plan.name] for run in runs]
    assert libraries[0] == libraries[1] and isinstance(libraries[0], Path) and call(libraries[0], "two") == 41
    compiled = [r for seen in reports for r in seen if r.endswith(": done") or "waiting" in r]
    assert sum("waiting for another kvchat" in r for r in compiled) == 1  # the second waited, then used it
    assert sum(r.endswith(": done") for r in compiled) == 1


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, str(os.getpid()).encode(), 0)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_lock_of_a_live_build_is_waited_for_and_one_of_a_dead_build_is_taken(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    lock = Path(plan.folder) / build_files.LOCK
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    reports: list[str] = []
    run = Build([plan], num_jobs=2)
    run.start(lambda description, done, total: reports.append(description) or holder.stdin.close())
    library = run.wait()[plan.name]
    holder.wait()
    assert (
        reports[0]
        == f"building kvchat's kernels: waiting for another kvchat building them (pid {holder.pid})"
    )
    assert isinstance(library, Path) and call(library, "one") == 40
    dead = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert dead.stdout is not None and dead.stdout.readline() == b"locked\n"
    dead.kill()  # a build killed while holding the lock: the lock goes with it
    dead.wait()
    library.unlink()
    rebuilt, reports = build(plan)
    assert isinstance(rebuilt, Path) and not any("waiting" in r for r in reports)


BUILD_THEN_WAIT = """
import sys
from kvchat.native.build import Build
from kvchat.native.build_files import BuildPlan
plan = BuildPlan.from_json(sys.argv[1]).libraries[0]
run = Build([plan], num_jobs=2)
run.start(lambda description, done, total: print(description, flush=True))
print("result", run.wait()[plan.name], flush=True)
"""


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_gone(text: str, timeout_s: float = 30.0) -> list[int]:
    """The processes mentioning `text` still there after they had `timeout_s` to go (a bound on a
    wait, not a speed: a runner notices its kvchat went away within a tenth of a second)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc")
def test_a_build_killed_anywhere_leaves_no_process_and_the_next_build_finishes(tmp_path: Path) -> None:
    rng = random.Random(41)
    plan = make_plan(tmp_path, source=SLOW_SOURCE)
    text = json.dumps({"jobs": 2, "libraries": [plan.__dict__]})
    for attempt in range(12):
        kill_after = rng.randrange(0, 8)  # how many progress lines to let through first
        how = rng.choice([signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
        starter = subprocess.Popen(
            [sys.executable, "-c", BUILD_THEN_WAIT, text],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert starter.stdout is not None
        for _ in range(kill_after):
            if not starter.stdout.readline():
                break
        starter.send_signal(how)
        starter.wait()
        assert wait_gone(str(tmp_path)) == [], f"attempt {attempt}: {how.name} after {kill_after} lines"
        if attempt % 3 == 2:
            library, _ = build(plan)
            assert isinstance(library, Path) and call(library, "two") == 41
            for path in Path(plan.folder).iterdir():  # start over for the next kills
                path.unlink()
    library, _ = build(plan)
    assert isinstance(library, Path) and call(library, "one") == 40
    assert [p.name for p in Path(plan.folder).iterdir() if p.name.endswith(".part")] == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc")
def test_a_start_killed_during_the_first_build_then_a_start_that_answers(tmp_path: Path) -> None:
    """kvchat itself killed at a random point of its first kernel build (the real sources): nothing of
    the build runs on, and the next start builds them and answers."""
    import time

    from tests.support.models_on_disk import saved_tiny_qwen2
    from tests.support.processes import KVCHAT, user_env

    folder = saved_tiny_qwen2(tmp_path)
    env = {**user_env(tmp_path / "home"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    args = [*KVCHAT, "-p", "hi", "--model", str(folder), "--max-tokens", "4", "--speculate", "off"]
    rng = random.Random()
    first = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert first.stderr is not None
    line = first.stderr.readline()
    assert re.match(r"kvchat: building kvchat's kernels for this CPU \(\d+ files, once\)", line), line
    time.sleep(rng.uniform(0, 20))  # where the kill lands; nothing is timed
    first.send_signal(rng.choice([signal.SIGKILL, signal.SIGTERM]))
    first.wait()
    assert wait_gone(str(tmp_path / "ext")) == []
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0 and second.stdout, second.stderr  # the tiny model answers blank lines


def test_without_a_compiler_info_says_why_what_to_install_and_the_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvchat.native import kernels

    monkeypatch.setattr(kernels, "_build", lambda: (False, "no C++ compiler found (c++)"))
    line = kernels.status()
    assert line.startswith("not built: no C++ compiler found (c++); install a C++ compiler (Debian/Ubuntu: ")
    assert line.endswith(f"({kernels.COST_WITHOUT})") and "\n" not in line
    monkeypatch.setattr(kernels, "_build", lambda: (True, None))
    monkeypatch.setattr(kernels, "tier", lambda: "avx2")
    monkeypatch.setattr(kernels, "_load", lambda name: (True, None))
    assert kernels.status() == "kvchat's, built for this CPU (avx2 tier)"
    monkeypatch.setattr(kernels, "_load", lambda name: (False, "the build failed: x.cpp: error"))
    failed = "kvchat's, built for this CPU; its avx2 linears are not (the build failed: x.cpp: error)"
    assert kernels.status() == failed
    monkeypatch.setattr(kernels, "tier", lambda: "portable")
    assert kernels.status() == "kvchat's, built for this CPU (portable tier: linears run torch's)"


@pytest.mark.slow
def test_without_a_compiler_a_start_shows_no_warning(tmp_path: Path) -> None:
    from tests.support.models_on_disk import saved_tiny_qwen2
    from tests.support.processes import KVCHAT, user_env

    folder = saved_tiny_qwen2(tmp_path)
    env = {**user_env(tmp_path / "home"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "no-such-c++"}
    args = [*KVCHAT, "run", "-", "--model", str(folder), "--max-tokens", "4"]
    done = subprocess.run(args, input="/info\nhi\n", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == []  # no torch warning, no build line
    assert re.search(r"\nkernels +not built: no C\+\+ compiler found \(no-such-c\+\+\); install", done.stdout)
    assert not (tmp_path / "ext").exists()


def test_a_build_that_fails_is_told_at_start_and_no_compiler_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvchat.native import kernels

    monkeypatch.setattr(kernels, "_build", lambda: (False, "cannot write /x (Permission denied)"))
    assert kernels.failure_note() == (
        f"kvchat's kernels are not built (cannot write /x (Permission denied)); running without them: "
        f"{kernels.COST_WITHOUT}"
    )
    monkeypatch.setattr(kernels, "_build", lambda: (False, "no C++ compiler found (c++)"))
    assert kernels.failure_note() is None  # /info says it; a start stays quiet
