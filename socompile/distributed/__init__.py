"""Scale-out on torch.distributed: a (dp, sp) process mesh, Ulysses sequence parallelism, ZeRO-style sharding
of the optimizer over data-parallel ranks, and clear failures (timeouts, plan mismatches across ranks).

See docs/distributed.md. Importing this package does not initialise anything; ``init_distributed`` does.
"""
from .faults import CollectiveError, PlanMismatchError, check_plan_across_ranks, guard
from .zero import ZeroSharding, shard_optimizer
from .checkpoint import full_optimizer_state_dict, load, save
from .mesh import DEFAULT_TIMEOUT_S, Topology, average_gradients, init_distributed, make_topology, shutdown
from .ulysses import SequenceParallelError, gather_sequence, parallelize, shard_sequence

__all__ = ["CollectiveError", "PlanMismatchError", "check_plan_across_ranks", "guard", "DEFAULT_TIMEOUT_S",
           "Topology", "average_gradients", "init_distributed", "make_topology", "shutdown",
           "SequenceParallelError", "ZeroSharding", "shard_optimizer", "save", "load", "full_optimizer_state_dict", "gather_sequence", "parallelize", "shard_sequence"]
