"""The pointer folders Ray Train keeps for each reported checkpoint
(cluster/run/ray_checkpoint.py)."""

from __future__ import annotations

import pyarrow.fs as pafs
from ray.train import Checkpoint

from cluster.run.ray_checkpoint import POINTER_DIR, pointer_dir_name, read_pointer, write_pointer


def test_pointer_names_the_checkpoint_and_step(tmp_path):
    fs = pafs.LocalFileSystem()
    path = f"{tmp_path}/{pointer_dir_name(40)}"
    write_pointer(fs, path, "/store/run/checkpoints/step_000000040", 40)
    pointer = read_pointer(Checkpoint(path=path, filesystem=fs))
    assert pointer == {"checkpoint": "/store/run/checkpoints/step_000000040", "step": 40}


def test_pointer_names_are_unique_per_report_and_sort_by_step():
    a, b = pointer_dir_name(7), pointer_dir_name(7)
    assert a != b and a.startswith(f"{POINTER_DIR}/step_00000007_")
    assert pointer_dir_name(9) < pointer_dir_name(10)


def test_no_pointer_reads_as_none(tmp_path):
    assert read_pointer(None) is None
    assert read_pointer(Checkpoint(path=str(tmp_path), filesystem=pafs.LocalFileSystem())) is None
