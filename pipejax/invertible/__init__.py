"""pipejax.invertible: invertible layers, constant-memory chains and normalizing flows.

Every layer has ``init(key, x) -> params``, ``forward(params, x, key=None) -> (y, logdet)`` and
``inverse(params, y, key=None) -> (x, logdet)``, with ``logdet`` per example (shape ``(batch,)``)
and the inverse returning the negated log-determinant. A :class:`Chain` is itself a layer; with
``memory="constant"`` its backward pass rebuilds activations through the inverses instead of
storing them. See ``docs/invertible.md``.
"""

from pipejax._src.invertible.base import Layer as Layer
from pipejax._src.invertible.base import as_stage as as_stage
from pipejax._src.invertible.base import reconstruction_error as reconstruction_error
from pipejax._src.invertible.chain import MEMORY_MODES as MEMORY_MODES
from pipejax._src.invertible.chain import Chain as Chain
from pipejax._src.invertible.coupling import AdditiveCoupling as AdditiveCoupling
from pipejax._src.invertible.coupling import AffineCoupling as AffineCoupling
from pipejax._src.invertible.flow import Flow as Flow
from pipejax._src.invertible.flow import dequantize as dequantize
from pipejax._src.invertible.flow import standard_normal_log_prob as standard_normal_log_prob
from pipejax._src.invertible.layers import ActNorm as ActNorm
from pipejax._src.invertible.layers import Inv1x1Conv as Inv1x1Conv
from pipejax._src.invertible.layers import InvertibleLinear as InvertibleLinear
from pipejax._src.invertible.layers import Squeeze as Squeeze
from pipejax._src.invertible.multiscale import MultiScale as MultiScale

__all__ = [
    "MEMORY_MODES",
    "ActNorm",
    "AdditiveCoupling",
    "AffineCoupling",
    "Chain",
    "Flow",
    "Inv1x1Conv",
    "InvertibleLinear",
    "Layer",
    "MultiScale",
    "Squeeze",
    "as_stage",
    "dequantize",
    "reconstruction_error",
    "standard_normal_log_prob",
]
