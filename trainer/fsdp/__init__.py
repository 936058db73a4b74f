"""Our fully sharded data parallel engine. It imports torch only; no third-party sharding library.

    mesh = build_mesh(sharding, rank, world_size, local_world_size)
    fsdp = parallelize(model, sharding, mesh, device, init_fn=...)

config.py (ShardingConfig and its enums), parallelize.py (the one way to build the engine),
engine.py (the hooks), unit.py (a unit's storage and lifecycle), scheduler.py (order and
prefetch), reducer.py (reductions in flight), wrap.py (units from a policy, flattening,
materialisation), flat_param.py, collectives.py, mesh.py, mixed_precision.py, accounting.py,
state.py (named element ranges for checkpoints, whole tensors for tests).
"""

from .accounting import Accounting
from .config import ConfigError, DType, ShardingConfig, ShardingStrategy
from .engine import FSDPModel
from .flat_param import FlatParameter
from .mesh import Mesh, Placement, build_mesh, mesh_shape, virtual_mesh
from .parallelize import parallelize
from .unit import FSDPUnit, TrainingState
from .wrap import NO_INIT, block_policy, transformer_policy

__all__ = [
    "NO_INIT",
    "Accounting",
    "ConfigError",
    "DType",
    "FSDPModel",
    "FSDPUnit",
    "FlatParameter",
    "Mesh",
    "Placement",
    "ShardingConfig",
    "ShardingStrategy",
    "TrainingState",
    "block_policy",
    "transformer_policy",
    "build_mesh",
    "mesh_shape",
    "parallelize",
    "virtual_mesh",
]
