"""In-memory snapshots on peer keepers (cluster/snapshots/), on a real 3-node Ray.

Two ranks run as Ray tasks pinned to the two worker nodes, each saving its own shard through
the unchanged CheckpointWriter to keeper://<run_key>/snapshots and meeting at a barrier actor;
the test process (on the head node) lists and reads the snapshot back. A node loss is played by
killing its keeper, which is what Ray does to a detached actor whose node is gone.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.snapshots import keeper_fs
from cluster.snapshots import keepers as snapshots
from tests.cluster.elastic_cluster import LocalCluster
from trainer import storage
from trainer.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    TensorChunk,
    latest_checkpoint,
    list_checkpoints,
)
from trainer.checkpoint.format import CHUNK_TABLE, MANIFEST, data_file_name

WORLD = 2
BLOCK_BYTES = 256  # small checksum blocks: reads below are ranged over many blocks
HANG_S = 60.0


# ---- the cluster and the two ranks ------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """Head + 2 worker nodes, 1 CPU each; this process is the driver, on the head node."""
    c = LocalCluster(head_cpus=1)
    try:
        # Both workers start at once (add_node waits for each in turn otherwise).
        added = [c.cluster.add_node(wait=False, num_cpus=1, temp_dir=c.ray_tmp) for _ in "ab"]
        c.cluster.wait_for_nodes()
        workers = [n.node_id for n in added]
        ray.init(address=c.address, logging_level="WARNING")
        keeper_fs.register_keeper_scheme()
        try:
            head = ray.get_runtime_context().get_node_id()
            assert head not in workers  # the driver's node is the head: three distinct nodes
            yield SimpleNamespace(head=head, workers=workers, ring=sorted([head, *workers]))
        finally:
            storage.unregister_scheme(keeper_fs.SCHEME)
    finally:
        ray.shutdown()
        c.close()


def start_run(cluster) -> SimpleNamespace:
    """A fresh run key with a keeper on every node, as each node's workers would start them."""
    key = f"test-{uuid.uuid4().hex[:12]}"
    handles = {n: snapshots.ensure_keeper(key, n) for n in cluster.ring}
    # Pinned where they are named for (and up: the first call waits for the actor's start).
    assert {n: ray.get(h.node_id.remote()) for n, h in handles.items()} == {
        n: n for n in cluster.ring
    }
    return SimpleNamespace(key=key, root=f"keeper://{key}/snapshots", cluster=cluster)


@pytest.fixture
def run(cluster):
    """A run of its own, for a test that kills keepers or counts every byte they hold."""
    r = start_run(cluster)
    yield r
    snapshots.stop_keepers(r.key)


@pytest.fixture(scope="module")
def saved(cluster):
    """One run with step 1 saved by both ranks, shared by the tests that only look at it."""
    r = start_run(cluster)
    r.path = save(r, 1)
    yield r
    snapshots.stop_keepers(r.key)


@ray.remote(num_cpus=0, max_concurrency=WORLD)
class Barrier:
    """What the writer's gloo barrier is to real ranks: WORLD threads meet in wait()."""

    def __init__(self, n: int):
        self._barrier = threading.Barrier(n, timeout=HANG_S)

    def wait(self) -> None:
        self._barrier.wait()


@ray.remote(num_cpus=1)
def save_rank(root, step, rank, world, chunks, keep, barrier) -> str:
    """One rank's save, as a training worker on its node makes it (synchronously here)."""
    keeper_fs.register_keeper_scheme()
    writer = CheckpointWriter(root, keep=keep, async_save=False, block_bytes=BLOCK_BYTES)
    with writer:
        writer.save(
            step, rank, world, chunks, {"step": step}, lambda: ray.get(barrier.wait.remote())
        )
        return writer.wait()


def save(run, step: int, keep: int = 3) -> str:
    """Rank r saves its shard of TENSORS on worker node r; returns the committed path."""
    barrier = Barrier.remote(WORLD)
    refs = [
        save_rank.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                run.cluster.workers[rank], soft=False
            )
        ).remote(run.root, step, rank, WORLD, chunks_of(rank), keep, barrier)
        for rank in range(WORLD)
    ]
    paths = ray.get(refs, timeout=HANG_S)
    ray.kill(barrier)
    return paths[0]


# ---- the tensors and their split --------------------------------------------------------------


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 61, generator=g)
    w[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return {
        "model/layers.0.attention.wq.weight": w,
        "model/norm.weight": torch.randn(61, generator=g).to(torch.bfloat16),
        "optim/layers.0.attention.wq.weight/exp_avg": torch.randn(64, 61, generator=g),
        "optim/step": torch.tensor(7, dtype=torch.int64),
    }


TENSORS = sample()


def split(world: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, its (key, start, numel) ranges: the tensors laid end to end and cut into
    `world` equal slices, as FSDP's flat parameter is (a rank may span several tensors)."""
    spans, pos = [], 0
    for key, t in TENSORS.items():
        spans.append((key, pos, t.numel()))
        pos += t.numel()
    per = -(-pos // world)
    return [
        [
            (key, max(lo, s) - s, min(lo + per, s + n) - max(lo, s))
            for key, s, n in spans
            if max(lo, s) < min(lo + per, s + n)
        ]
        for lo in range(0, per * world, per)
    ]


def chunks_of(rank: int) -> list[TensorChunk]:
    return [
        TensorChunk(
            k, tuple(TENSORS[k].shape), TENSORS[k].dtype, s, TENSORS[k].reshape(-1)[s : s + n]
        )
        for k, s, n in split(WORLD)[rank]
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_reads_back_whole(reader: CheckpointReader) -> None:
    """Every tensor bit for bit, whole and at 3 ranks' ranges (resharded: 2 wrote, 3 read)."""
    assert reader.world_size == WORLD and reader.keys() == sorted(TENSORS)
    for key, t in TENSORS.items():
        got = reader.read_full(key)
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert torch.equal(bits(got), bits(t)), key
    for ranges in split(3):
        for key, start, numel in ranges:
            want = TENSORS[key].reshape(-1)[start : start + numel]
            assert torch.equal(bits(reader.read(key, start, numel)), bits(want)), key


def open_shards(reader: CheckpointReader) -> None:
    """Read one element of each rank's shard, so the reader holds both files open."""
    for rank, pick in ((0, 0), (1, -1)):
        key, start, _ = split(WORLD)[rank][pick]
        reader.read(key, start, 1)


# ---- what the keepers hold --------------------------------------------------------------------


def held(key: str) -> dict[str, dict[str, int]]:
    """node id -> {path: size} of every live keeper of the run."""
    found = snapshots.keepers(key)
    return dict(zip(found, ray.get([h.list.remote("") for h in found.values()])))


def holders(key: str) -> dict[str, set[str]]:
    """path -> the nodes whose keepers hold it."""
    out: dict[str, set[str]] = {}
    for node, files in held(key).items():
        for path in files:
            out.setdefault(path, set()).add(node)
    return out


def next_node(ring: list[str], node: str) -> str:
    return ring[(ring.index(node) + 1) % len(ring)]


def bytes_held(key: str) -> dict[str, int]:
    found = snapshots.keepers(key)
    return dict(zip(found, ray.get([h.bytes_held.remote() for h in found.values()])))


def kill_keeper(key: str, node: str) -> None:
    """Kill `key`'s keeper on `node` as a node loss would, and return once Ray has it dead and
    its name free. ray.kill only asks (Ray has no call that waits for the death): until the kill
    has gone through, calls still reach the keeper, it stays listed, and a start under its name
    gets it back."""
    handle = snapshots.keepers(key)[node]
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + HANG_S
    while True:
        try:
            ray.get(handle.node_id.remote(), timeout=HANG_S)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, f"keeper on {node} still answers after {HANG_S} s"
        time.sleep(0.01)
    while node in snapshots.keepers(key, fresh=True):  # the name is freed with the death
        assert time.monotonic() < deadline, f"keeper on {node} still listed after {HANG_S} s"
        time.sleep(0.01)


def within(seconds: float, fn):
    """fn() run in a thread; fail (instead of hanging the suite) if it takes longer."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s: it hangs"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- tests ------------------------------------------------------------------------------------


def test_two_ranks_on_two_nodes_save_a_snapshot_that_lists_and_reads_back_bitwise(saved):
    assert saved.path == f"{saved.root}/step_000000001"
    infos = list_checkpoints(saved.root)
    assert [(i.step, i.path, i.problem) for i in infos] == [(1, saved.path, None)]
    assert latest_checkpoint(saved.root) == saved.path
    with CheckpointReader(saved.path) as reader:
        assert reader.state == {"step": 1}
        assert_reads_back_whole(reader)


def test_every_file_is_on_its_writers_keeper_and_the_next_nodes_and_bytes_add_up(saved):
    ring, workers = saved.cluster.ring, saved.cluster.workers
    step = "snapshots/step_000000001"
    writer_of = {f"{step}/{data_file_name(r, WORLD)}": workers[r] for r in range(WORLD)}
    writer_of |= {f"{step}/{MANIFEST}": workers[0], f"{step}/{CHUNK_TABLE}": workers[0]}
    where = {p: nodes for p, nodes in holders(saved.key).items() if p.startswith("snapshots/")}
    assert sorted(where) == sorted(writer_of)  # the ranks' indexes were merged and removed
    for path, writer in writer_of.items():
        assert where[path] == {writer, next_node(ring, writer)}, path
    files = held(saved.key)
    per_keeper = bytes_held(saved.key)
    assert per_keeper == {n: sum(listing.values()) for n, listing in files.items()}
    sizes = {path: size for listing in files.values() for path, size in listing.items()}
    assert sum(per_keeper.values()) == 2 * sum(sizes.values())


def test_a_snapshot_still_reads_back_whole_after_the_loss_of_any_one_keeper(run):
    for step, victim in enumerate(run.cluster.ring, start=1):  # every position on the ring
        path = save(run, step, keep=1)
        with CheckpointReader(path) as opened:
            open_shards(opened)  # each file open on one keeper holding it, this node's first
            kill_keeper(run.key, victim)
            assert sorted(snapshots.keepers(run.key)) == sorted(set(run.cluster.ring) - {victim})
            assert_reads_back_whole(opened)  # a file open on the lost keeper reads the other copy
        assert [(i.step, i.problem) for i in list_checkpoints(run.root)] == [(step, None)]
        with CheckpointReader(path) as reader:
            assert_reads_back_whole(reader)
        # The node's workers start a new, empty keeper under the same name; the ranks' processes
        # still hold a handle of the dead one, which the next save must get over.
        snapshots.ensure_keeper(run.key, victim)


def test_losing_both_copies_of_a_shard_makes_the_snapshot_incomplete_not_wrong(run):
    path = save(run, 1)
    # Manifest and chunk table read while everything was there; shard files opened or not.
    unopened, opened = CheckpointReader(path), CheckpointReader(path)
    open_shards(opened)
    lost_file = f"snapshots/step_000000001/{data_file_name(1, WORLD)}"
    for node in holders(run.key)[lost_file]:
        kill_keeper(run.key, node)

    infos = within(HANG_S, lambda: list_checkpoints(run.root))
    assert len(infos) == 1 and infos[0].problem is not None
    assert f"{data_file_name(1, WORLD)}: missing" in infos[0].problem
    assert within(HANG_S, lambda: latest_checkpoint(run.root, log=lambda m: None)) is None
    with pytest.raises(CheckpointError, match="incomplete"):
        within(HANG_S, lambda: CheckpointReader(path))
    rank1_key, start, numel = split(WORLD)[1][-1]
    with pytest.raises(CheckpointError, match="cannot open shard file"):
        within(HANG_S, lambda: unopened.read(rank1_key, start, numel))
    # Through a file opened before the loss the keeper filesystem's OSError comes as it is
    # (the checkpoint reader wraps errors opening a shard file, not reading one).
    with pytest.raises(OSError, match="no live keeper holds it any more"):
        within(HANG_S, lambda: opened.read(rank1_key, start, numel))
    # Rank 0's shard had a copy on the third node (on a ring of 3, a node and its successor
    # leave the one before them): what it holds still reads back right.
    key, start, numel = split(WORLD)[0][0]
    want = TENSORS[key].reshape(-1)[start : start + numel]
    for reader in (unopened, opened):
        assert torch.equal(bits(within(HANG_S, lambda: reader.read(key, start, numel))), bits(want))
        reader.close()


def test_retention_keep_2_deletes_older_snapshots_from_the_keepers_memory(run):
    totals = {}
    for step in (1, 2, 3, 4):
        save(run, step, keep=2)
        totals[step] = sum(bytes_held(run.key).values())
    assert [(i.step, i.problem) for i in list_checkpoints(run.root)] == [(4, None), (3, None)]
    where = holders(run.key)
    assert {p.split("/")[1] for p in where} == {"step_000000003", "step_000000004"}
    sizes = {path: size for listing in held(run.key).values() for path, size in listing.items()}
    assert totals[4] == 2 * sum(sizes.values())  # two copies of two snapshots, nothing else
    # Four snapshots would hold twice what two do; the manifests' lengths differ by a few bytes.
    assert abs(totals[4] - totals[2]) < 64 and totals[3] < 1.1 * totals[2]


def test_alone_a_keeper_holds_the_only_copy(cluster):
    key = f"test-{uuid.uuid4().hex[:12]}"
    try:
        loc = storage.resolve(f"keeper://{key}/x/a.bin")  # no keeper yet: the write starts one
        storage.write_bytes(loc, b"abc")
        assert holders(key) == {"x/a.bin": {cluster.head}}
        assert storage.read_bytes(loc) == b"abc"
    finally:
        snapshots.stop_keepers(key)
    assert snapshots.keepers(key, fresh=True) == {}


@ray.remote(num_cpus=0)
def start_keeper(key: str, node: str) -> str:
    return ray.get(snapshots.ensure_keeper(key, node).node_id.remote())


def test_a_write_gets_over_a_keeper_replaced_under_the_same_name(cluster):
    key = f"test-{uuid.uuid4().hex[:12]}"
    try:
        loc = storage.resolve(f"keeper://{key}/x.bin")
        storage.write_bytes(loc, b"old")  # starts this node's keeper; this process keeps its handle
        kill_keeper(key, cluster.head)
        # Another process (a worker of the node) starts a new one under the same name.
        assert ray.get(start_keeper.remote(key, cluster.head)) == cluster.head
        storage.write_bytes(loc, b"new")
        assert holders(key) == {"x.bin": {cluster.head}}
        assert storage.read_bytes(loc) == b"new"
    finally:
        snapshots.stop_keepers(key)


def test_keeper_filesystem_answers_as_a_pyarrow_filesystem(saved):
    before = sum(bytes_held(saved.key).values())
    root = storage.resolve(f"keeper://{saved.key}/fs")
    fs = root.fs
    assert fs.type_name == "py::keeper" and fs.equals(storage.resolve(saved.root).fs)
    for name, data in {"a/x.bin": b"0123456789", "a/b/y.bin": b"yy", "z.bin": b""}.items():
        storage.write_bytes(root.child(name), data)
    p = root.path
    infos = fs.get_file_info([p, f"{p}/a", f"{p}/a/x.bin", f"{p}/z.bin", f"{p}/nope"])
    assert [i.type for i in infos] == [
        pafs.FileType.Directory,
        pafs.FileType.Directory,
        pafs.FileType.File,
        pafs.FileType.File,
        pafs.FileType.NotFound,
    ]
    assert (infos[2].size, infos[3].size) == (10, 0)
    flat = fs.get_file_info(pafs.FileSelector(p))
    assert [(i.path, i.type.name) for i in flat] == [
        (f"{p}/a", "Directory"),
        (f"{p}/z.bin", "File"),
    ]
    deep = fs.get_file_info(pafs.FileSelector(p, recursive=True))
    assert [i.path[len(p) + 1 :] for i in deep] == ["a", "a/b", "a/b/y.bin", "a/x.bin", "z.bin"]
    assert fs.get_file_info(pafs.FileSelector(f"{p}/nope", allow_not_found=True)) == []
    with pytest.raises(FileNotFoundError):
        fs.get_file_info(pafs.FileSelector(f"{p}/nope"))
    with fs.open_input_file(f"{p}/a/x.bin") as f:  # ranged reads, as the checkpoint reader does
        assert f.size() == 10 and f.read_at(4, 3) == b"3456"
        f.seek(8)
        assert f.read() == b"89"
    fs.copy_file(f"{p}/a/x.bin", f"{p}/c.bin")
    fs.move(f"{p}/a", f"{p}/moved")
    assert storage.read_bytes(root.child("moved/b/y.bin")) == b"yy"
    assert storage.read_bytes(root.child("c.bin")) == b"0123456789"
    fs.delete_file(f"{p}/c.bin")
    with pytest.raises(FileNotFoundError):
        fs.delete_file(f"{p}/c.bin")
    fs.delete_dir(f"{p}/moved")
    assert [i.path for i in fs.get_file_info(pafs.FileSelector(p))] == [f"{p}/z.bin"]
    fs.delete_dir_contents(p)
    assert storage.list_dir(root) == {} and sum(bytes_held(saved.key).values()) == before
    assert list_checkpoints(saved.root)[0].problem is None  # the snapshot beside it untouched


def test_a_process_lists_the_keepers_at_most_once_a_second_and_again_after_a_failure(
    monkeypatch,
):
    """No cluster: Ray's listing and lookup are stood in for, and counted."""
    key, clock = "listing-test", {"t": 100.0}
    prefix = snapshots.keeper_name(key, "")
    live = ["n1", "n2"]
    calls = []

    def list_named_actors(all_namespaces):
        calls.append(clock["t"])
        return [{"namespace": snapshots.NAMESPACE, "name": prefix + n} for n in live]

    monkeypatch.setattr(snapshots.ray.util, "list_named_actors", list_named_actors)
    monkeypatch.setattr(snapshots.ray, "get_actor", lambda name, namespace: f"handle:{name}")
    monkeypatch.setattr(snapshots.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(snapshots, "_LISTED", {})
    monkeypatch.setattr(snapshots, "_HANDLES", {})
    assert sorted(snapshots.keepers(key)) == ["n1", "n2"] and len(calls) == 1
    clock["t"] += 0.5
    live.remove("n2")  # died: not seen until the listing is asked again
    assert sorted(snapshots.keepers(key)) == ["n1", "n2"] and len(calls) == 1
    snapshots._forget(key, ["n2"])  # what a failed call to it does
    assert sorted(snapshots.keepers(key)) == ["n1"] and len(calls) == 2
    clock["t"] += snapshots.LIST_EVERY_S
    live.append("n3")
    assert sorted(snapshots.keepers(key)) == ["n1", "n3"] and len(calls) == 3
    assert sorted(snapshots.keepers(key, fresh=True)) == ["n1", "n3"] and len(calls) == 4


@ray.remote(num_cpus=0)
class StuckKeeper:
    """A keeper that is alive but never answers (its node wedged, say)."""

    def put(self, key, ref):
        time.sleep(3600)

    def info(self, keys):
        time.sleep(3600)


def test_a_keeper_that_does_not_answer_fails_the_put_and_is_left_out(cluster, monkeypatch):
    monkeypatch.setattr(keeper_fs, "CALL_TIMEOUT_S", 1.0)
    key = f"stuck-{uuid.uuid4().hex[:12]}"
    stuck = StuckKeeper.options(
        name=snapshots.keeper_name(key, cluster.head),
        namespace=snapshots.NAMESPACE,
        lifetime="detached",
    ).remote()
    try:
        fs = pafs.PyFileSystem(keeper_fs.KeeperFileSystem(key, cluster.head))
        started = time.monotonic()
        with pytest.raises(OSError, match="did not answer within 1 s"):
            with fs.open_output_stream("/a.bin") as f:
                f.write(b"abc")
        # a listing leaves it out rather than waiting for it
        assert fs.get_file_info(["/a.bin"])[0].type == pafs.FileType.NotFound
        assert time.monotonic() - started < HANG_S
    finally:
        ray.kill(stuck)


# ---- files in parts ----------------------------------------------------------------------------


def test_a_keeper_keeps_a_parted_file_and_reads_any_range_of_it():
    """The keeper class itself, no Ray: parts, their commit, ranges across part boundaries."""
    from cluster.snapshots.keeper import SnapshotKeeper

    k = SnapshotKeeper()
    data = bytes(range(256)) * 9
    parts = [data[i : i + 700] for i in range(0, len(data), 700)]
    for i, part in enumerate(parts):
        k.put_part("s/a.bin", i, part)
    assert k.info(["s/a.bin", "s"]) == {} and k.read("s/a.bin", 0, 10) is None  # not yet
    assert k.bytes_held() == len(data)  # an upload in progress holds memory too
    assert k.commit("s/a.bin", len(parts)) == len(data)
    assert k.info(["s/a.bin", "s"]) == {"s/a.bin": len(data), "s": None}
    for offset in (0, 1, 699, 700, 701, 1399, 2000, len(data) - 1, len(data), len(data) + 5):
        for length in (0, 1, 2, 699, 700, 1401, len(data)):
            assert k.read("s/a.bin", offset, length) == data[offset : offset + length]
    k.put_part("s/b.bin", 0, b"x")
    with pytest.raises(ValueError, match="part 2 out of order"):
        k.put_part("s/b.bin", 2, b"y")
    with pytest.raises(ValueError, match="commit of 3 parts, but 1 came"):
        k.commit("s/b.bin", 3)
    assert k.delete_prefix("s/") == 1 and k.bytes_held() == 0  # the abandoned upload too


def test_a_file_larger_than_a_part_goes_in_parts_and_reads_back_whole(cluster, monkeypatch):
    monkeypatch.setattr(keeper_fs, "PART_BYTES", 1000)
    key = f"parts-{uuid.uuid4().hex[:12]}"
    data = torch.randint(0, 256, (5500,), dtype=torch.uint8).numpy().tobytes()
    try:
        for n in cluster.ring:
            snapshots.ensure_keeper(key, n)
        loc = storage.resolve(f"keeper://{key}/x/big.bin")
        with loc.fs.open_output_stream(loc.path) as f:
            for i in range(0, len(data), 300):  # the writer's small writes
                f.write(data[i : i + 300])
        assert storage.read_bytes(loc) == data
        assert holders(key) == {"x/big.bin": {cluster.head, next_node(cluster.ring, cluster.head)}}
        with loc.fs.open_input_file(loc.path) as f:
            f.seek(990)
            assert f.read(1020) == data[990:2010]  # across two part boundaries
        assert sum(bytes_held(key).values()) == 2 * len(data)
    finally:
        snapshots.stop_keepers(key)


def test_a_keeper_lost_during_a_parted_upload_fails_the_file(cluster, monkeypatch):
    monkeypatch.setattr(keeper_fs, "PART_BYTES", 1000)
    key = f"parts-{uuid.uuid4().hex[:12]}"
    try:
        for n in cluster.ring:
            snapshots.ensure_keeper(key, n)
        peer = next_node(cluster.ring, cluster.head)
        loc = storage.resolve(f"keeper://{key}/x/big.bin")
        f = loc.fs.open_output_stream(loc.path)
        f.write(b"a" * 2500)  # two parts sent
        kill_keeper(key, peer)
        with pytest.raises(OSError, match="was lost or did not answer during the upload"):
            f.write(b"b" * 2500)
            f.close()
        assert loc.fs.get_file_info(loc.path).type == pafs.FileType.NotFound
    finally:
        snapshots.stop_keepers(key)
