"""What an in-memory snapshot costs the training thread, and what it moves and holds.

    python -m benchmarks.snapshots                      # tiny and mid models, 2 gloo ranks
    python -m benchmarks.snapshots --models tiny --steps 3 --reps 1

The real path, end to end: a Ray cluster of two nodes on this machine (ray.cluster_utils, its own
temp dir), a keeper actor on each (cluster/snapshots/keeper.py), and 2 gloo ranks (torch
multiprocessing) connected to it, each training our FULL_SHARD engine (benchmarks.engine's
models, batches and step) with trainer.checkpoint.checkpointer.Checkpointer writing snapshots to
keeper://: every file on its writer's node and the other one, two generations kept.

Three modes per model, alternating inside every repetition (a noisy machine hits them alike):
- off: no snapshots (the baseline step);
- every: train.snapshot_every=1, a snapshot after every step, waiting for the previous one;
- auto: train.snapshot_every=null, a snapshot at every step where the previous one was sent.
Per step: the training step (barrier to barrier) and the time the training thread then spends in
Checkpointer.after_step (agreeing whether a snapshot is due, and copying the shard state to host
memory when it is): the "blocked" time. The goal: blocked < 5% of a step in the default mode
(auto); "every" shows what forcing a snapshot per step costs when sending one takes longer than
a step (it then waits for the previous one). Also reported: the
step with snapshots against the step without (the background sending competes for these 2 cores),
the bytes of one snapshot (per rank, and sent to a peer node per snapshot: one of the two copies
of each file leaves its node), and the host memory the keepers hold at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.engine import MODELS, Run, batches, build_ours, train_step
from cluster.snapshots import keeper_fs
from cluster.snapshots import keepers as snapshots
from tests.cluster.elastic_cluster import LocalCluster
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.launch_storage import LaunchStorage
from trainer.config import TrainerConfig
from trainer.fsdp.mixed_precision import ShardedGradScaler

MODES = ("off", "every", "auto")
GOAL_BLOCKED = 0.05  # of a step


@dataclass
class Args:
    models: list
    world: int
    steps: int
    reps: int
    warmup: int
    address: str
    run_key: str
    tmp: str
    port: int


def rank_main(rank: int, a: Args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    ray.init(address=a.address, logging_level="ERROR", log_to_driver=False)
    keeper_fs.register_keeper_scheme()
    out = {}
    for name in a.models:
        model = MODELS[name]
        run = Run(name, model, a.world, "float32", 1.0, 1, 600.0)
        contestant = build_ours("full_shard", run, rank)
        control = dist.new_group(backend="gloo")
        ckpts = {}
        for mode in MODES:
            cfg = TrainerConfig()
            cfg.train.steps, cfg.train.checkpoint_every = 10**9, 0
            cfg.train.snapshot_every = {"off": 0, "every": 1, "auto": None}[mode]
            storage = LaunchStorage(
                os.path.join(a.tmp, f"durable-{name}-{mode}"),
                snapshot_root=f"keeper://{a.run_key}/{name}-{mode}",
            )
            ckpts[mode] = Checkpointer(
                cfg,
                storage,
                contestant.fsdp,
                contestant.optimizer,
                ShardedGradScaler(enabled=False),
                rank=rank,
                world_size=a.world,
                device=torch.device("cpu"),
                control=control,
                log=lambda *_: None,
            )
        total_steps = a.reps * len(MODES) * (a.steps + a.warmup)
        data = batches(run, rank, total_steps)
        times = {m: ([], []) for m in MODES}  # (step s, blocked s)
        step_no = {m: 0 for m in MODES}
        for rep in range(a.reps):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            for mode in order:
                ck = ckpts[mode]
                for i in range(a.warmup + a.steps):
                    x, y = data[contestant.steps_done]
                    dist.barrier()
                    t0 = time.perf_counter()
                    train_step(contestant, x, y, run.global_tokens, run.clip)
                    dist.barrier()
                    t1 = time.perf_counter()
                    step_no[mode] += 1
                    ck.after_step(step_no[mode])
                    t2 = time.perf_counter()
                    if i >= a.warmup:
                        times[mode][0].append(t1 - t0)
                        times[mode][1].append(t2 - t1)
        snap_bytes = {}
        for mode, ck in ckpts.items():
            if ck.snapshots is not None:
                ck.snapshots.close()
                snap_bytes[mode] = ck.snapshots.bytes
        dist.barrier()
        out[name] = dict(
            times=times,
            taken={m: ckpts[m].snapshots.taken if ckpts[m].snapshots else 0 for m in MODES},
            shard_bytes=max(snap_bytes.values()) if snap_bytes else 0,
        )
    queue.put((rank, out))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_ms(values: list) -> float:
    return statistics.median(values) * 1000.0 if values else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,mid")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per repetition")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    ns = p.parse_args(argv)
    models = [m for m in ns.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"--models: unknown {unknown}; valid: {sorted(MODELS)}", file=sys.stderr)
        return 2

    # tests/cluster/elastic_cluster.py's: Ray's files (its address file too) in its own temp dir
    cluster = LocalCluster(head_cpus=1)
    tmp = cluster.tmp
    try:
        cluster.add_node(1)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        key = f"bench-{os.getpid()}"
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        ray.get([snapshots.ensure_keeper(key, n).node_id.remote() for n in nodes])
        a = Args(models, ns.world, ns.steps, ns.reps, ns.warmup, cluster.address, key, tmp,
                 free_port())  # fmt: skip
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, a, queue)) for r in range(ns.world)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join(60)
        held = sum(ray.get([h.bytes_held.remote() for h in snapshots.keepers(key).values()]))
        report(results, models, ns.world, held, len(nodes))
        snapshots.stop_keepers(key)
    finally:
        ray.shutdown()
        cluster.close()
    return 0


def report(results: dict, models: list, world: int, held: int, nodes: int) -> None:
    r0 = results[0]
    head = (
        f"{'model':<6} {'mode':<6} {'step ms':>9} {'blocked ms':>11} {'blocked/step':>13} "
        f"{'step vs off':>12} {'snapshots':>10} {'MiB/rank':>9} {'MiB to peers':>13}"
    )
    print(head)
    print("-" * len(head))
    summary, goal = {}, True
    for name in models:
        res = r0[name]
        shard = max(results[r][name]["shard_bytes"] for r in results)
        off_step = median_ms(res["times"]["off"][0])
        summary[name] = {}
        for mode in MODES:
            steps, blocked = res["times"][mode]
            step_ms, blocked_ms = median_ms(steps), median_ms(blocked)
            ratio = blocked_ms / step_ms
            if mode == "auto":  # the default; "every" waits for the previous one by design
                goal &= ratio < GOAL_BLOCKED
            to_peers = world * shard / 2**20 if mode != "off" else 0.0
            print(
                f"{name:<6} {mode:<6} {step_ms:>9.1f} {blocked_ms:>11.2f} {ratio:>12.2%} "
                f"{step_ms / off_step:>11.3f}x {res['taken'][mode]:>10} "
                f"{(shard if mode != 'off' else 0) / 2**20:>9.2f} {to_peers:>13.2f}"
            )
            summary[name][mode] = dict(
                step_ms=round(step_ms, 2),
                blocked_ms=round(blocked_ms, 3),
                blocked_over_step=round(ratio, 4),
                step_vs_off=round(step_ms / off_step, 3),
                snapshots=res["taken"][mode],
            )
        summary[name]["shard_bytes_per_rank"] = shard
        summary[name]["bytes_to_peers_per_snapshot"] = world * shard
    expected = sum(4 * world * max(results[r][m]["shard_bytes"] for r in results) for m in models)
    print(
        f"\nkeepers ({nodes} nodes) hold {held / 2**20:.1f} MiB at the end (expected "
        f"{2 * expected / 2**20:.1f}: every file twice, on its writer's node and the other, two "
        "generations, for each model x the two snapshot modes); "
        f"goal (auto, the default) blocked < {GOAL_BLOCKED:.0%} of a step: "
        f"{'met' if goal else 'NOT met'}"
    )
    line = {
        "benchmark": "snapshots",
        "world": world,
        "models": summary,
        "keepers_bytes_held": held,
        f"goal_blocked_lt_{GOAL_BLOCKED}_of_step": goal,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    sys.exit(main())
