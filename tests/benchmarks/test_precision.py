"""`python -m benchmarks.precision` runs end to end in its quickest mode (the micro model, 2
steps), prints both tables and ends with a JSON line holding every variant and offload level.

Not a quality test (2 steps decide nothing; the full run is in the report): it proves the
benchmark still builds each lever through parallelize and build_optimizer and reads the bytes
per parameter the engine accounts: 12 / 8 / 6 resident for fp32 / bf16 moments / bf16 master
and moments, and none on the device with offload=params."""

from benchmarks import precision


def test_the_precision_benchmark_reports_every_lever(capsys):
    result = precision.main(["--model", "micro", "--steps", "2", "--memory-steps", "1"])
    out = capsys.readouterr().out
    assert "quality (held-out loss after the last step)" in out
    assert set(result["final"]) == set(precision.VARIANTS)
    assert set(result["offload_bytes_per_param"]) == set(precision.OFFLOAD)
    resident = {k: v["resident"] for k, v in result["bytes_per_param"].items()}
    assert resident == {"fp32": 12.0, "bf16 state": 8.0, "bf16 master": 6.0, "bf16 nearest": 6.0}
    offload = result["offload_bytes_per_param"]
    assert offload["params"]["resident"] == 0.0 and offload["params"]["host"] == 12.0
    assert offload["params + bf16"]["host_with_grads"] == 8.0
    assert out.strip().splitlines()[-1].startswith('{"benchmark": "precision"')
