"""A unit refused on Ray Data (a missing image) reaches the driver as the ConfigError it is, not
as Ray's wrapped task error: the preparation's folder is removed and the message names the
record and the file. The Ray Data UDF's own code (TokenizeUnits.one) and the driver's
(records_or_refusal) run here in one process; Ray's part, mapping the UDF over the units, is
tests/cluster/test_data_cli.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.prepare import REFUSED, TokenizeUnits, records_or_refusal
from tests.cluster.vision_task import write_records, write_vlm_folder
from trainer.config import ConfigError, DataConfig
from trainer.data import prepare
from trainer.data.planning import plan_preparation


def ray_udf_runner(plan, units):
    """What ray_data_runner does, Ray's map left out: the UDF returns a record for every unit
    (one that raised would reach the driver as Ray's RayTaskError instead)."""
    udf = TokenizeUnits(plan.unit_args())
    records = [udf.one(json.loads(json.dumps(u.to_json()))) for u in units]
    SEEN.extend(r for r in records if REFUSED in r)
    return records_or_refusal(records)


SEEN: list[dict] = []


def test_a_missing_image_on_ray_data_is_refused_by_name_and_leaves_nothing(tmp_path):
    model = write_vlm_folder(tmp_path / "model")
    write_records(tmp_path / "data", 6, seed=3)
    (tmp_path / "data" / "pictures" / "4.png").unlink()
    cfg = DataConfig(
        source=str(tmp_path / "data" / "records.jsonl"), format="jsonl", kind="chat",
        tokenizer=str(model / "tokenizer.json"), prepared_dir=str(tmp_path / "prepared"),
        seq_len=128, eval_fraction=0.0,
    )  # fmt: skip
    digest = plan_preparation(cfg).digest
    with pytest.raises(
        ConfigError, match=r"records.jsonl, record 4 \(line 5\): image 1 of 1 .*4.png"
    ):
        prepare(cfg, runner=ray_udf_runner)
    assert not (Path(cfg.prepared_dir) / digest[:16]).exists()
    assert len(SEEN) == 1 and "4.png" in SEEN[0][REFUSED]  # a record, not an exception
    # the same data, the picture back: the runner prepares it
    write_records(tmp_path / "data", 6, seed=3)
    assert prepare(cfg, runner=ray_udf_runner).created
