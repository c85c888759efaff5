"""Result files: the output folder proven writable first, every file replaced atomically."""

import errno
import os

import pytest

from pml_rank.harness import outputs


def test_prepare_output_dir_creates_the_folder_and_leaves_nothing_in_it(tmp_path):
    folder = outputs.prepare_output_dir(tmp_path / "a" / "b")
    assert folder.is_dir() and not list(folder.iterdir())


@pytest.mark.parametrize("below", [False, True])
def test_prepare_output_dir_refuses_a_file(tmp_path, below):
    a_file = tmp_path / "results"
    a_file.write_text("")
    path = a_file / "sub" if below else a_file
    with pytest.raises(outputs.OutputError, match="--out") as error:
        outputs.prepare_output_dir(path)
    assert str(path) in str(error.value)


def test_prepare_output_dir_refuses_a_full_disk(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "fsync", full)
    with pytest.raises(outputs.OutputError, match="not writable.*No space"):
        outputs.prepare_output_dir(tmp_path / "out", option="--cache-dir")
    assert not list((tmp_path / "out").iterdir())


def test_prepare_output_dir_refuses_a_read_only_folder(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: file modes do not stop writes")
        with pytest.raises(outputs.OutputError, match="not writable"):
            outputs.prepare_output_dir(folder)
    finally:
        folder.chmod(0o755)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_one(tmp_path):
    path = outputs.write_text(tmp_path / "result.json", "old")
    with pytest.raises(OSError, match="No space"):
        with outputs.atomic_write(path) as f:
            f.write("half of the new")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_an_interrupt_leaves_no_temporary_file(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with outputs.atomic_write(tmp_path / "a.bin", "wb") as f:
            f.write(b"x")
            raise KeyboardInterrupt
    assert not list(tmp_path.iterdir())


def test_written_files_get_the_usual_permissions(tmp_path):
    path = outputs.write_bytes(tmp_path / "a.bin", b"abc")
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_bytes() == b"abc"
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
