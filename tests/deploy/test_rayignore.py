""".rayignore keeps `ray job submit --working-dir .` small, checked with Ray's own packager.

Ray zips the working directory honouring .rayignore (and .gitignore, which a user may switch off
with RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1, so .rayignore must stand alone). A venv alone is several
GB against Ray's 500 MiB upload limit.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from deploy_helpers import REPO_ROOT

# What a working checkout holds besides the code: none of it may be uploaded.
JUNK = (
    ".venv/bin/python",
    ".venv/lib/python3.11/site-packages/torch/__init__.py",
    ".git/HEAD",
    "runs/elastic-fsdp/checkpoints/step_20/manifest.json",
    "outputs/2026-01-01/12-00-00/train.log",
    "multirun/2026-01-01/12-00-00/0/train.log",
    "data/prepared/shard_00000.parquet",
    "mlruns/0/meta.yaml",
    "mlflow.db",
    "mlflow.db-journal",
    "mlartifacts/1/abc/artifacts/config.yaml",
    "cluster/__pycache__/train.cpython-311.pyc",
    "trainer/fsdp/__pycache__/flat.cpython-311.pyc",
    "elastic_fsdp.egg-info/PKG-INFO",
    ".pytest_cache/v/cache/nodeids",
    ".whl/torch-2.13.0.whl",
    ".gl/state",
)
# The code and config the job needs, including names that resemble excluded ones deeper down.
CODE = (
    "pyproject.toml",
    "cluster/train.py",
    "trainer/config.py",
    "trainer/data/__init__.py",
    "conf/config.yaml",
    "conf/data/stdlib.yaml",
    "conf/cluster/ray.yaml",
    "tests/deploy/test_rayignore.py",
    "deploy/README.md",
)


def _package(root: Path, tmp: Path, include_gitignore: bool) -> zipfile.ZipFile:
    from ray._private.runtime_env.packaging import create_package

    target = tmp / f"pkg-{include_gitignore}.zip"
    create_package(str(root), target, include_gitignore=include_gitignore)
    return zipfile.ZipFile(target)


def test_ray_packager_uploads_only_code_from_a_checkout_full_of_outputs(tmp_path):
    checkout = tmp_path / "checkout"
    for rel in JUNK + CODE:
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text("x")
    shutil.copy(REPO_ROOT / ".rayignore", checkout / ".rayignore")
    names = set(_package(checkout, tmp_path, include_gitignore=False).namelist())
    assert names == set(CODE) | {".rayignore"}


def test_rayignore_prunes_whole_folders_so_ray_never_walks_the_venv():
    """A folder pattern must match the folder itself; 'name/' would only match the files below,
    and Ray would still visit every file of a several-GB venv."""
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    (rayignore,) = get_excludes_from_ignore_files(REPO_ROOT, include_gitignore=False)
    for folder in (
        ".venv",
        ".git",
        "runs",
        "outputs",
        "multirun",
        "data",
        "mlruns",
        "mlartifacts",
        "cluster/__pycache__",
        "elastic_fsdp.egg-info",
        ".pytest_cache",
        ".whl",
        ".gl",
    ):
        assert rayignore(REPO_ROOT / folder), (
            f".rayignore does not match the folder {folder} itself"
        )
    for kept in ("conf/data", "trainer", "cluster", "deploy"):
        assert not rayignore(REPO_ROOT / kept), f".rayignore drops {kept}"


def test_upload_of_this_checkout_is_small(tmp_path):
    """The real tree as `ray job submit --working-dir .` would send it (venv, .git, runs
    present)."""
    with _package(REPO_ROOT, tmp_path, include_gitignore=False) as pkg:
        names = pkg.namelist()
        size = sum(i.compress_size for i in pkg.infolist())
    top = {n.split("/")[0] for n in names}
    assert not top & {
        ".venv",
        ".git",
        "runs",
        "outputs",
        "multirun",
        "data",
        "mlruns",
        "mlartifacts",
    }, top
    assert "cluster/train.py" in names and "conf/config.yaml" in names
    assert size < 20 * 2**20, f"upload is {size / 2**20:.1f} MiB"
