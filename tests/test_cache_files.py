"""What kvchat keeps in its cache folders is checked before use: a sealed folder whose files changed is
refused, a whole one is trusted without being read again, temporary names of gone writers are swept,
and a conversion that is damaged or cannot be written never stops a start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat import cache_files
from kvchat.models import gguf
from tests.support.models_on_disk import Notes, fake_conversion


def sealed(tmp_path: Path) -> Path:
    folder = tmp_path / "entry"
    folder.mkdir()
    (folder / "a.bin").write_bytes(bytes(range(256)) * 64)
    (folder / "b.json").write_text('{"x": 1}')
    cache_files.seal(folder)
    return folder


def test_a_sealed_folder_is_trusted_until_a_file_changes(tmp_path: Path) -> None:
    folder = sealed(tmp_path)
    assert cache_files.check_seal(folder, ("a.bin",)) is None
    assert cache_files.check_seal(folder, ("c.bin",)) == "its seal does not list c.bin"
    data = bytearray((folder / "a.bin").read_bytes())
    data[1000] ^= 0x04
    stamp = (folder / "a.bin").stat()
    (folder / "a.bin").write_bytes(bytes(data))
    os.utime(folder / "a.bin", ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # its times set back
    assert cache_files.check_seal(folder) == "a.bin was changed since it was written (its SHA-256 differs)"
    (folder / "a.bin").write_bytes(bytes(data[:100]))
    assert cache_files.check_seal(folder) == "a.bin has 100 bytes where 16,384 were written"
    (folder / "a.bin").unlink()
    assert cache_files.check_seal(folder) == "a.bin is missing"


def test_a_whole_file_is_hashed_once_then_known_by_its_stamp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = sealed(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in folder.iterdir():  # a copy: other inodes and times, the same bytes
        (copy / path.name).write_bytes(path.read_bytes())
    hashed: list[str] = []
    real = cache_files.sha256_of
    monkeypatch.setattr(cache_files, "sha256_of", lambda p: hashed.append(p.name) or real(p))
    assert cache_files.check_seal(folder) is None and hashed == []
    assert cache_files.check_seal(copy) is None and sorted(hashed) == ["a.bin", "b.json"]
    assert cache_files.check_seal(copy) is None and len(hashed) == 2  # restamped: not read again


@pytest.mark.parametrize(
    "seal",
    ["", "{", "[]", '{"format": "kvchat-seal/1", "files": {"../x": {}}}', '{"format": "other", "files": {}}'],
)
def test_a_damaged_seal_is_refused(tmp_path: Path, seal: str) -> None:
    folder = sealed(tmp_path)
    (folder / cache_files.SEAL).write_text(seal)
    assert cache_files.check_seal(folder) is not None


def test_sweep_removes_what_gone_writers_left_and_keeps_a_live_ones(tmp_path: Path) -> None:
    tmp_path = tmp_path / "cache"
    tmp_path.mkdir()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    (tmp_path / f".entry.{dead_pid}-0.part").mkdir()
    (tmp_path / f".file.{dead_pid}-3.part").write_text("x")
    mine = cache_files.part_path(tmp_path / "entry")
    mine.mkdir()
    old = tmp_path / ".tmpabc123"  # an older kvchat's temporary name
    old.write_text("x")
    os.utime(old, (0, 0))
    (tmp_path / ".tmpfresh").write_text("x")
    (tmp_path / "entry").mkdir()
    removed = cache_files.sweep(tmp_path)
    assert sorted(removed) == sorted([f".entry.{dead_pid}-0.part", f".file.{dead_pid}-3.part", ".tmpabc123"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, ".tmpfresh", "entry"])


def test_a_damaged_conversion_is_converted_again_and_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    conversions: list[Path] = []
    fake_conversion(monkeypatch, conversions)
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + bytes(100))
    target = tmp_path / "models" / "m"
    assert gguf.convert_once(source, target).folder == target
    (target / "model.safetensors").write_text("truncated")
    told = Notes()
    assert gguf.convert_once(source, target, told).folder == target and len(conversions) == 2
    assert told.notes == [
        f"the converted model in {target} is damaged (model.safetensors has 9 bytes where 27 were "
        "written); converting m.gguf again"
    ]
    assert gguf.is_converted(target)


def test_a_conversion_that_cannot_be_kept_serves_this_start_from_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_conversion(monkeypatch, [])
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + bytes(100))
    (tmp_path / "models").write_text("a file where the folder should be")
    told = Notes()
    conversion = gguf.convert_once(source, tmp_path / "models" / "m", told)
    assert conversion.folder is None and len(told.notes) == 1
    assert told.notes[0].startswith(f"cannot keep the converted model in {tmp_path / 'models'} (")
    assert told.notes[0].endswith("m.gguf is converted again at every start until it can")


def test_a_start_sweeps_what_a_dead_writer_left_beside_a_whole_conversion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_conversion(monkeypatch, [])
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF" + bytes(100))
    target = tmp_path / "models" / "m"
    gguf.convert_once(source, target)
    left = target.with_name(f".{target.name}.999999999-0.part")  # a converter killed mid-write
    left.mkdir()
    (left / "model.safetensors").write_bytes(bytes(1000))
    assert gguf.convert_once(source, target).folder == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]
