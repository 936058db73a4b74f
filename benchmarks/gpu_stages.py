"""The GPU check as one prepared, staged run, for a GPU machine that starts bare.

    python3 -m benchmarks.gpu_check --out gpu-check/      # what to run there (make gpu-check)
    python3 -m benchmarks.gpu_stages env --file F.json    # one stage alone

That machine has python3 with CUDA torch, numpy, pyarrow, safetensors, tokenizers, transformers
and pytest, and nothing else: no ray, hydra, omegaconf, mlflow or boto3, maybe no `make`, no
network, and minutes of time. Everything here needs only those
(tests/benchmarks/test_gpu_machine_env.py runs this module and tests/gpu in a venv holding just
them, in CI).

Stages, in order; each runs in its own process under its own time limit, and writes its result
file to the --out folder as soon as it ends, so a stage that hangs (a collective that never
returns) is killed at its limit and leaves every earlier result:

  01 env       torch, CUDA, NCCL, the device, what the CUDA context and NCCL take, which
               packages are missing
  02 leak      a model built, stepped and dropped gives all of its device memory back (ours,
               ours with the optimizer offloaded, FSDP2): later stages' peaks are their own
  03 tests     tests/gpu on CUDA (NCCL at world size 1, no host syncs)
  04 threaded  the threaded harness: world sizes 2-4 on the one device, over every engine path
               (FULL_SHARD, SHARD_GRAD_OP with two in flight, NO_SHARD, HYBRID_SHARD, bf16
               reduction, fp16 with the scaler, the optimizer offloaded)
  05 bench     ours against FSDP2, 125m (benchmarks/gpu_check.py), rows as they finish
  06 bench     the same on 1b
  07 levers    1b with the levers, ours and FSDP2 given the same: blocks compiled, compiled +
               Float8 (tensorwise; skipped, saying why, without torchao or below sm_89), and
               sharding.offload=params (FSDP2: CPUOffloadPolicy)
  08 moe       a mixture of experts (benchmarks/gpu_moe.py): the experts' torch._grouped_mm
               against a loop of matmuls at Qwen3-30B-A3B's and Mixtral-8x7B's shapes, and a
               0.7B-parameter mixture trained on our engine, MFU on its active FLOPs, beside the
               dense model of its active parameters. After the benches: it takes no time from
               the stages before it (with 1b absent it follows bench_125m)
  09 context   context parallelism (benchmarks/gpu_context.py): 1b training one 32k-token
               sequence on the GPU with activation checkpointing (tokens/s, MFU, peak memory),
               and one rank's attention at context 2, 4 and 8 (its two chunks over the key
               ranges they read, forward + backward) against the whole sequence's. Last: it is
               the newest

The whole run keeps within --budget-s (default 600: the lent H200 gives 15 minutes, its start
and the transfers included): a stage
gets min(its own limit, what is left), and one with under MIN_STAGE_S left is skipped and marked
so. The folder ends with summary.json (every stage's status, seconds, result file) and
summary.txt (the same as a table). Without CUDA the env stage says so and nothing else runs:
summary.json has status "no_cuda". Exit status: 0 every stage passed, 1 one failed or timed out,
2 no CUDA.

Estimated on one H200 from the CPU timings of the same code and the rows' FLOPs (no GPU has run
it yet; 01_env.json and the stages' seconds in summary.json are the first real figures):
  env ~10 s (torch import, CUDA and a one-rank NCCL communicator); leak ~25 s (a 4-block 125m,
  4 contestants x 2 steps); tests ~40 s (pytest start, 125m steps, a data preparation of 0.1 MB
  measured at 0.5 s here); threaded ~30 s (11 CUDA tests of the 60k-parameter test model; their CPU
  twins take 7 s here); 125m ~40 s (initial weights 1.3 s here; 4 contestant runs x 35 steps of
  65k tokens, 0.13-0.20 s a step at 45-30% MFU); 1b ~90 s (initial weights 17 s here, 4 runs x
  30 steps of 16k tokens, 0.30-0.45 s a step); levers ~4 minutes (initial weights 17 s; two
  inductor compiles of the 1b block, forward and backward, ~1 minute each on 16 cores, FSDP2's
  the same graphs from inductor's cache; 15 steps per contestant; the offloaded 1b steps AdamW on
  the host, seconds a step, so 4 steps); moe ~40 s (start ~10 s; the two expert shapes, 10
  forward + backward passes of each path, ~5 s; the 0.7B mixture initialised on the host ~5 s,
  15 steps of 16k tokens at ~50 ms, and its dense twin); context ~45 s (start ~10 s, the 1b on
  the host ~20 s, 4 steps of one 32k sequence at ~2 s, attention ~10 s), skipped when the
  others leave it under MIN_STAGE_S. About 10 minutes in all; the limits
  below sum past the budget on purpose, so a slow stage cannot take more than its own limit
  from the others.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
BUDGET_S = 600.0
MIN_STAGE_S = 20.0
ABSENT_THERE = ("ray", "hydra", "omegaconf", "mlflow", "boto3")
"""Packages the bare GPU machine lacks: the env stage reports which of them this python has."""
CUDA_HINT = (
    "needs torch with CUDA and a visible GPU; install the CUDA build with "
    'make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128, '
    "or run a python that has one: make gpu-check PY=python3 (or --device cpu --quick here)"
)
LEAK_SLACK = 1 * MiB
"""What a dropped model may leave allocated (the allocator's own small blocks); a leaked 4-layer
125m keeps its fp32 shards, ~370 MiB."""


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    limit_s: float
    argv: tuple[str, ...]
    """Arguments after `python -m`; {file} is replaced by the stage's result file, {xml} by its
    junit XML (pytest stages)."""

    @property
    def stem(self) -> str:
        return f"{self.number:02d}_{self.name}"


def stages(models: tuple[str, ...]) -> list[Stage]:
    py = ("benchmarks.gpu_stages",)
    pytest = ("pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--junitxml", "{xml}")
    out = [
        Stage(1, "env", 60, (*py, "env", "--file", "{file}")),
        Stage(2, "leak", 90, (*py, "leak", "--file", "{file}")),
        Stage(
            3,
            "tests",
            150,
            (*pytest, "tests/gpu", "--ignore", "tests/gpu/test_threaded_ranks.py"),
        ),
        Stage(4, "threaded", 180, (*pytest, "tests/gpu/test_threaded_ranks.py")),
    ]
    limits = {"125m": 150, "1b": 240}
    for m in models:
        argv = ("benchmarks.gpu_check", "--models", m, "--rows-file", "{file}")
        out.append(Stage(len(out) + 1, f"bench_{m}", limits.get(m, 240), argv))
    if "1b" in models:  # last: a slow compile cannot take the plain rows' time
        argv = ("benchmarks.gpu_check", "--models", "1b", "--levers", "--rows-file", "{file}")
        out.append(Stage(len(out) + 1, "bench_1b_levers", 300, argv))
    # after every earlier stage: what they leave of the budget (~2 minutes, estimated) is its
    out.append(Stage(len(out) + 1, "moe", 90, ("benchmarks.gpu_moe", "--file", "{file}")))
    # the newest, so after the mixture's: it takes what the others leave
    out.append(Stage(len(out) + 1, "context", 90, ("benchmarks.gpu_context", "--file", "{file}")))
    return out


@dataclass
class StageResult:
    name: str
    status: str
    """passed, failed, timeout, skipped (no budget left) or no_cuda."""
    seconds: float
    limit_s: float
    file: Optional[str]
    log: str
    detail: str = ""


# ---- the runner --------------------------------------------------------------------------------
def run_stage(stage: Stage, out: Path, limit_s: float) -> StageResult:
    """One stage in its own process group, its output streamed to out/NN_name.log; killed (the
    whole group) at limit_s."""
    file = out / f"{stage.stem}.json"
    log = out / f"{stage.stem}.log"
    xml = out / f"{stage.stem}.xml"
    argv = [sys.executable, "-m"]
    argv += [a.replace("{file}", str(file)).replace("{xml}", str(xml)) for a in stage.argv]
    path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    t0 = time.monotonic()
    with open(log, "w") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage's own group: it and its children
            proc.wait()
            rc = None
    seconds = time.monotonic() - t0
    if stage.argv[0] == "pytest":
        _junit_summary(xml, file, rc)
    if rc is None:
        status, detail = "timeout", f"killed after {limit_s:.0f} s"
    elif rc == 0:
        status, detail = "passed", ""
    elif rc == NO_CUDA_EXIT:
        status, detail = "no_cuda", "torch sees no CUDA device"
    else:
        status, detail = "failed", f"exit status {rc}; see {log.name}"
    found = str(file) if file.exists() else None
    return StageResult(stage.name, status, round(seconds, 1), limit_s, found, str(log), detail)


def run_all(out: Path, models: tuple[str, ...], budget_s: float = BUDGET_S) -> int:
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    results: list[StageResult] = []
    for stage in stages(models):
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            results.append(
                StageResult(stage.name, "skipped", 0.0, stage.limit_s, None, "", "no budget left")
            )
            continue
        r = run_stage(stage, out, min(stage.limit_s, left))
        results.append(r)
        print(f"gpu-check {stage.stem:14s} {r.status:8s} {r.seconds:6.1f} s {r.detail}", flush=True)
        _write_summary(out, results, budget_s)  # after every stage: a later hang keeps this
        if r.status == "no_cuda":
            break
    status = _write_summary(out, results, budget_s)
    print((out / "summary.txt").read_text(), end="", flush=True)
    return {"passed": 0, "no_cuda": NO_CUDA_EXIT}.get(status, 1)


def _write_summary(out: Path, results: list[StageResult], budget_s: float) -> str:
    if any(r.status == "no_cuda" for r in results):
        status = "no_cuda"
    elif all(r.status == "passed" for r in results):
        status = "passed"
    else:
        status = "failed"
    summary = dict(
        check="gpu_check",
        status=status,
        budget_s=budget_s,
        elapsed_s=round(sum(r.seconds for r in results), 1),
        stages=[asdict(r) for r in results],
    )
    if status == "no_cuda":
        summary["message"] = (
            f"no CUDA: {sys.executable}'s torch sees no GPU, so nothing was checked. The check "
            f"{CUDA_HINT} (README: 'On a GPU machine')."
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"gpu check: {status} ({summary['elapsed_s']} s of a {budget_s:.0f} s budget)"]
    if "message" in summary:
        lines.append(summary["message"])
    for r in results:
        lines.append(f"  {r.name:14s} {r.status:8s} {r.seconds:7.1f} s  {r.detail}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return status


def _junit_summary(xml: Path, file: Path, rc: Optional[int]) -> None:
    """pytest's junit XML as the stage's JSON: counts, and each failure's message."""
    if not xml.exists():
        return
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failures = [
        dict(test=f"{c.get('classname')}::{c.get('name')}", message=(e.get("message") or "")[:2000])
        for c in suite.iter("testcase")
        for e in list(c)
        if e.tag in ("failure", "error")
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    file.write_text(
        json.dumps(
            dict(exit_status=rc, seconds=float(suite.get("time", 0)), **counts, failed=failures),
            indent=2,
        )
        + "\n"
    )


# ---- stage: env --------------------------------------------------------------------------------
NO_CUDA_EXIT = 2


def env_stage(file: Path) -> int:
    """What the machine is. Exit NO_CUDA_EXIT (after writing the file) when there is no GPU."""
    import torch  # noqa: PLC0415 -- this module's runner needs no torch; its stages do

    info = dict(
        python=sys.version.split()[0],
        executable=sys.executable,
        platform=platform.platform(),
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        missing_there_present_here=[p for p in ABSENT_THERE if importlib.util.find_spec(p)],
        present={
            p: importlib.util.find_spec(p) is not None
            for p in ("numpy", "pyarrow", "safetensors", "tokenizers", "transformers", "pytest")
        },
    )
    if info["cuda_available"]:
        info.update(_cuda_facts(torch))
    file.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), flush=True)
    return 0 if info["cuda_available"] else NO_CUDA_EXIT


def _cuda_facts(torch) -> dict:
    """The device, and what the CUDA context takes before any tensor: total - free - reserved
    after the first allocation (the planner's CUDA-context reserve is an estimate of this)."""
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    context = total - free - torch.cuda.memory_reserved()
    facts = dict(
        device=props.name,
        capability=f"{props.major}.{props.minor}",
        devices=torch.cuda.device_count(),
        total_memory_gib=total / 2**30,
        cuda_context_mib=context / MiB,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        bf16=torch.cuda.is_bf16_supported(),
        fp8_capable=(props.major, props.minor) >= (8, 9),
    )
    facts["nccl_world1_mib"] = _nccl_cost(torch)
    return facts


def _nccl_cost(torch) -> Optional[float]:
    """Device memory NCCL takes outside torch's allocator for a one-rank communicator that ran
    one all-reduce (a floor: communicators of more ranks take more; the planner's figure)."""
    import torch.distributed as dist  # noqa: PLC0415 -- see env_stage

    before = torch.cuda.mem_get_info()[0]
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        x = torch.ones(1024, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        after = torch.cuda.mem_get_info()[0]
    finally:
        dist.destroy_process_group()
    return (before - after) / MiB


def resolve_device(name: str):
    """cuda:0 (fails with how to get a CUDA build when there is none) or the CPU."""
    import torch  # noqa: PLC0415 -- see env_stage

    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks.gpu_check --device cuda: torch {torch.__version__} in {sys.executable} "
            f"sees no CUDA device (torch.version.cuda={torch.version.cuda}); {CUDA_HINT}"
        )
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


# ---- stage: leak -------------------------------------------------------------------------------
def leak_stage(file: Path) -> int:
    """Build, step and drop each contestant on CUDA; the device memory allocated afterwards must
    be what it was before (within LEAK_SLACK), and it must have held memory while alive."""
    import torch  # noqa: PLC0415 -- see env_stage
    import torch.distributed as dist  # noqa: PLC0415 -- see env_stage

    from benchmarks import gpu_contestants  # noqa: PLC0415 -- torch, the engine and FSDP2

    if not torch.cuda.is_available():
        file.write_text(json.dumps(dict(status="no_cuda")) + "\n")
        return NO_CUDA_EXIT
    device = resolve_device("cuda")

    def allocated() -> int:
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)

    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    rows = []
    try:
        for label, build in leak_contestants(gpu_contestants, device, "125m"):
            rows.append(probe(label, build, device, allocated))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    ok = all(r["freed"] for r in rows)
    file.write_text(json.dumps(dict(status="passed" if ok else "failed", rows=rows), indent=2))
    return 0 if ok else 1


def leak_contestants(
    contestants, device, model: str, batch: int = 4, seq_len: int = 128
) -> list[tuple[str, Callable]]:
    """(label, build) for each contestant the GPU check measures, on a 4-block `model`, each
    stepped twice on `batch` x `seq_len` tokens (`contestants`: benchmarks.gpu_contestants)."""
    from trainer.config import (  # noqa: PLC0415 -- see leak_stage
        OptimConfig,
        ShardingConfig,
        model_config,
    )

    mcfg = model_config(model, n_layers=4)
    init = contestants.initial_state(mcfg)
    setup = contestants.Setup(model, batch, seq_len, 0, 2)

    def make(cls, **sharding):
        cfg = ShardingConfig(strategy="FULL_SHARD", param_dtype="bfloat16", **sharding)
        return lambda: (cls(mcfg, cfg, OptimConfig(), device, init), setup)

    return [
        ("ours", make(contestants.Ours)),
        ("ours offload=optimizer", make(contestants.Ours, offload="optimizer")),
        ("ours activation checkpointing", make(contestants.Ours, activation_checkpointing=True)),
        ("fsdp2", make(contestants.FSDP2)),
    ]


def probe(label: str, build: Callable, device, allocated: Callable[[], int]) -> dict:
    """Build one contestant, step it, drop it; what `allocated` says before, alive and after."""
    import torch  # noqa: PLC0415 -- see env_stage

    gc.collect()
    base = allocated()
    contestant, setup = build()
    x = torch.randint(0, 256, (setup.batch, setup.seq_len), device=device)
    for _ in range(setup.steps):
        contestant.step(x, x, x.numel())
    alive = allocated() - base
    del contestant, x
    gc.collect()
    left = allocated() - base
    return dict(
        contestant=label,
        held_while_alive_mib=alive / MiB,
        left_after_del_mib=left / MiB,
        freed=alive > 10 * LEAK_SLACK and left <= LEAK_SLACK,
    )


# ---- entry -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one stage of the GPU check (see the module doc)")
    p.add_argument("stage", choices=("env", "leak"))
    p.add_argument("--file", required=True, type=Path, help="the stage's result file")
    args = p.parse_args(argv)
    return {"env": env_stage, "leak": leak_stage}[args.stage](args.file)


if __name__ == "__main__":
    sys.exit(main())
