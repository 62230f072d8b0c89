"""What `--models-dir` serves: .gguf files by name (a split file by its first part), Hugging Face folders by
name; other entries skipped; two entries of one name refused."""

from __future__ import annotations

import pytest

from aioengine.model.catalog import scan_models_dir


def test_a_folder_lists_gguf_files_split_files_and_checkpoint_folders(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()  # no config.json: not a model
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".hidden.gguf").write_bytes(b"GGUF")
    found = scan_models_dir(tmp_path)
    assert found == {
        "a": str(tmp_path / "a.gguf"),
        "big": str(tmp_path / "big-00001-of-00002.gguf"),
        "hf": str(tmp_path / "hf"),
    }


def test_two_models_of_one_name_and_a_missing_folder_are_refused(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="both named 'm'"):
        scan_models_dir(tmp_path)
    with pytest.raises(ValueError, match="not a folder"):
        scan_models_dir(tmp_path / "nope")
