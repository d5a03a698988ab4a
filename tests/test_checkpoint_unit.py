"""The checkpointer's pieces without processes: checksums computed while writing, the save-pause hook."""

from __future__ import annotations

import pytest

from supervisor import store


def test_digests_computed_while_writing_match_the_bytes_on_disk(tmp_path):
    import torch

    from train_entry.checkpoint import _HashingFileSystem

    fs = _HashingFileSystem()
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        for i in range(3):  # DCP writes tensors one after another with torch.save
            torch.save(torch.arange(1000 * (i + 1), dtype=torch.float32), stream)
    with fs.create_stream(tmp_path / ".metadata.tmp", "wb") as stream:
        stream.write(b"metadata")
    (tmp_path / ".metadata.tmp").rename(tmp_path / ".metadata")
    assert fs.digests["__0_0.distcp"] == store.checksum_file(tmp_path / "__0_0.distcp")
    assert fs.digests[".metadata"] == store.checksum_file(tmp_path / ".metadata")
    records = store.describe_files(tmp_path, ["__0_0.distcp", ".metadata"], known=fs.digests)
    assert {r.name: r.checksum for r in records} == fs.digests


def test_a_seek_falls_back_to_reading_the_file_back(tmp_path):
    from train_entry.checkpoint import _HashingFileSystem

    fs = _HashingFileSystem()
    with fs.create_stream(tmp_path / "f", "wb") as stream:
        stream.write(b"aaaa")
        stream.seek(0)
        stream.write(b"b")
    assert "f" not in fs.digests
    assert store.describe_files(tmp_path, ["f"], known=fs.digests)[0].checksum == store.checksum_file(tmp_path / "f")


def test_save_pause_parsing():
    from train_entry.checkpoint import SavePause

    assert SavePause.parse("mid_data:30") == SavePause("mid_data", 30.0, None)
    assert SavePause.parse("before_marker:2.5@20") == SavePause("before_marker", 2.5, 20)
    with pytest.raises(ValueError):
        SavePause.parse("sometime:3")
