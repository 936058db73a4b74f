"""The capacity check's arithmetic (cluster/capacity.py), on the cluster views Ray can give: the
nodes alive now, an autoscaler v2's node groups, an autoscaler v1 that does not name its types.
The real local Ray cases are tests/cluster/test_launch_fails_fast.py."""

from __future__ import annotations

from cluster.capacity import Capacity, NodeGroup, Request
from cluster.config import ClusterConfig

GPU_NODE = {"CPU": 16.0, "GPU": 4.0, "memory": 64e9}
CPU_NODE = {"CPU": 2.0}


def gpu_job(**kw) -> Request:
    return Request.of(ClusterConfig(use_gpu=True, cpus_per_worker=4.0, **kw))


def test_a_workers_bundle_must_fit_on_one_node_not_in_the_sum():
    # 2 nodes of 3 CPUs: 6 CPUs in all, yet only 2 workers of 2 CPUs each (one per node)
    job = Request.of(ClusterConfig(num_workers=3, cpus_per_worker=2.0))
    problem = job.infeasible(Capacity("head:6379", [{"CPU": 3.0}, {"CPU": 3.0}]))
    assert "holds 2 such workers" in problem and "at most 2 workers" in problem


def test_gpu_workers_fit_the_gpus_and_the_cpus_of_the_nodes():
    assert gpu_job(num_workers=8).infeasible(Capacity("h", [GPU_NODE, GPU_NODE])) is None
    problem = gpu_job(num_workers=9).infeasible(Capacity("h", [GPU_NODE, GPU_NODE]))
    assert "9 workers x {CPU: 4, GPU: 1}" in problem and "holds 8 such workers" in problem


def test_an_autoscaler_v2_that_can_add_the_nodes_lets_the_job_wait_for_them():
    groups = [NodeGroup("head", {"CPU": 2.0}, 1), NodeGroup("gpu", dict(GPU_NODE), 2)]
    capacity = Capacity("h", [CPU_NODE], node_groups=groups)
    assert gpu_job(num_workers=8).infeasible(capacity) is None
    assert "waiting for the autoscaler" in gpu_job(num_workers=8).waits_for(capacity)
    problem = gpu_job(num_workers=9).infeasible(capacity)
    assert "gpu: {CPU: 16, GPU: 4} x 2" in problem and "hold at most 8" in problem


def test_an_autoscaler_v1_is_trusted_to_add_nodes_it_does_not_name():
    assert gpu_job(num_workers=8).infeasible(Capacity("h", [CPU_NODE], autoscaler_v1=True)) is None


def test_gpu_workers_on_a_cluster_without_gpus_are_told_to_set_use_gpu_false():
    problem = gpu_job(num_workers=1).infeasible(Capacity("h", [CPU_NODE]))
    assert "no autoscaler" in problem and "cluster.use_gpu=false" in problem


def test_an_elastic_run_needs_its_min_workers_and_grows_to_its_max():
    job = Request.of(ClusterConfig(min_workers=2, max_workers=4))
    capacity = Capacity("h", [{"CPU": 3.0}])
    assert job.infeasible(capacity) is None
    assert "starts with 3 and grows when nodes join" in job.waits_for(capacity)
    problem = Request.of(ClusterConfig(min_workers=4, max_workers=6)).infeasible(capacity)
    assert "4-6 workers" in problem and "cluster.min_workers" in problem
