"""nvFuser's Python frontend on fuser: ``FusionDefinition``, ``FusionManager``, ``DataType``.

    from fuser.frontend import FusionDefinition, DataType
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        fd.add_output(fd.ops.relu(fd.ops.add(t0, 1.0)))
    out, = fd.execute([torch.randn(4, 8)])

See README.md ("FusionDefinition frontend") and ``help(FusionDefinition.Operators)``.
"""
from .datatype import DataType
from .definition import FusionDefinition, FusionManager
from .handles import Scalar, Tensor, Vector
from .records import CACHE as FusionCache

__all__ = ["DataType", "FusionDefinition", "FusionManager", "FusionCache", "Tensor", "Scalar", "Vector"]
