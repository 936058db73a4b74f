"""Our fully sharded data parallel engine. It imports torch only; no third-party sharding library."""
from trainer.config import ShardingStrategy

from .accounting import Accounting
from .engine import FSDPModel, block_policy
from .flat_param import FlatParameter
from .mesh import ShardMesh, build_mesh
from .unit import FSDPUnit, TrainingState

__all__ = ["Accounting", "FSDPModel", "FSDPUnit", "FlatParameter", "ShardMesh", "ShardingStrategy",
           "TrainingState", "block_policy", "build_mesh"]
