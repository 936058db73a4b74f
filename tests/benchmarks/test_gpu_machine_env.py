"""The GPU check runs on a machine that starts bare: python3 with torch, numpy, pyarrow,
safetensors, tokenizers, transformers and pytest, and nothing else (no ray, hydra, omegaconf,
mlflow or boto3; nothing can be installed there). This builds that environment here: a fresh venv
whose site-packages holds exactly those distributions and what they require (linked from this
venv, so it costs seconds, not a download), and runs in it what the GPU machine will run:
tests/gpu (collected; the CPU twins pass, the CUDA ones skip) and the staged check, which must end
with a clear "no CUDA" result. An import of ray or MLflow that creeps into the engine, the
benchmarks or tests/gpu fails here, in CI, instead of in the GPU session's few minutes.
"""

import importlib.metadata as md
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
THERE = ("torch", "numpy", "pyarrow", "safetensors", "tokenizers", "transformers", "pytest")
NOT_THERE = ("ray", "hydra", "omegaconf", "mlflow", "boto3")


def closure(names) -> dict[str, md.Distribution]:
    """The distributions `names` need: themselves and their requirements, transitively (extras
    not taken, markers evaluated for this python)."""
    found: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist = md.distribution(name)
        for spec in dist.requires or ():
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def bare_venv(where: Path) -> Path:
    """A venv (no system site-packages, no pip) whose site-packages links exactly the files of
    closure(THERE) from this interpreter's; returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    for dist in closure(THERE).values():
        for f in dist.files or ():
            top = f.parts[0]
            if top in ("..", "__pycache__") or (site / top).exists():
                continue
            (site / top).symlink_to(Path(dist.locate_file(top)))
    return py


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return bare_venv(tmp_path_factory.mktemp("bare") / "venv")


def run(py: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(py), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_bare_environment_has_what_the_gpu_machine_has_and_nothing_more(bare_python):
    names = THERE + NOT_THERE
    probe = (
        "import importlib.util, json; "
        f"print(json.dumps({{n: importlib.util.find_spec(n) is not None for n in {names}}}))"
    )
    found = json.loads(run(bare_python, "-c", probe).stdout)
    assert found == {**{n: True for n in THERE}, **{n: False for n in NOT_THERE}}


def test_tests_gpu_collect_and_their_cpu_twins_pass_without_ray_hydra_or_mlflow(bare_python):
    proc = run(bare_python, "-m", "pytest", "-q", "tests/gpu", "-p", "no:cacheprovider", "-rs")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "needs a CUDA GPU" in out, out[-3000:]  # twins ran, CUDA skipped


def test_the_staged_gpu_check_ends_with_a_no_cuda_result_on_a_cpu(bare_python, tmp_path):
    out = tmp_path / "gpu-check"
    proc = run(bare_python, "-m", "benchmarks.gpu_check", "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "no_cuda" and "no CUDA" in summary["message"]
    assert [s["name"] for s in summary["stages"]] == ["env"]  # nothing after it ran
    env = json.loads((out / "01_env.json").read_text())
    assert env["cuda_available"] is False and env["missing_there_present_here"] == []
    assert "no CUDA" in (out / "summary.txt").read_text()
    assert "no CUDA" in proc.stdout


def test_the_closure_leaves_out_the_cluster_layer():
    names = set(closure(THERE))
    assert not names & {"ray", "hydra-core", "omegaconf", "mlflow", "mlflow-skinny", "boto3"}
