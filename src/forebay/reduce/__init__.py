"""Gradient reduction orchestration on torch.distributed (Horovod's bitvector coordination
and grouping, Kurth et al. 2019), behind Horovod's names::

    import forebay.reduce as fr
    fr.init_process_group()                                  # torchrun, mpiexec or srun
    opt = fr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), groups=4)
    fr.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.stats()                                              # control bytes, fused sizes

See docs/reduce.md.
"""
from ._cache import ResponseCache
from ._coordinator import Coordinator, Handle
from ._launch import init_process_group, launch_env
from ._optimizer import (DistributedOptimizer, allreduce, allreduce_async, broadcast_parameters,
                         shutdown)

__all__ = ["Coordinator", "DistributedOptimizer", "Handle", "ResponseCache", "allreduce",
           "allreduce_async", "broadcast_parameters", "init_process_group", "launch_env",
           "shutdown"]
