"""pipejax.hessian: Hessian-vector products, top eigenvalues, trace and spectral density.

Everything takes ``loss(params, *args) -> scalar`` and one batch ``*args`` (or ``data=``, a list
of batches, averaged by batch size), works under ``jax.jit``, and passes through
:func:`pipejax.pipeline` with parameters sharded over its stages. See ``docs/hessian.md``.
"""

from pipejax._src.hessian.blocks import stage_blocks as stage_blocks
from pipejax._src.hessian.data import Stream as Stream
from pipejax._src.hessian.data import stream as stream
from pipejax._src.hessian.density import Density as Density
from pipejax._src.hessian.density import density as density
from pipejax._src.hessian.density import smooth_density as smooth_density
from pipejax._src.hessian.density import spectral_range as spectral_range
from pipejax._src.hessian.eigenvalues import eigenvalues as eigenvalues
from pipejax._src.hessian.hvp import hvp as hvp
from pipejax._src.hessian.lanczos import Tridiagonal as Tridiagonal
from pipejax._src.hessian.lanczos import lanczos as lanczos
from pipejax._src.hessian.losses import CompositeLoss as CompositeLoss
from pipejax._src.hessian.losses import GradientLoss as GradientLoss
from pipejax._src.hessian.losses import composite as composite
from pipejax._src.hessian.losses import from_value_and_grad as from_value_and_grad
from pipejax._src.hessian.trace import trace as trace

__all__ = [
    "CompositeLoss",
    "Density",
    "GradientLoss",
    "Stream",
    "Tridiagonal",
    "composite",
    "density",
    "eigenvalues",
    "from_value_and_grad",
    "hvp",
    "lanczos",
    "smooth_density",
    "spectral_range",
    "stage_blocks",
    "stream",
    "trace",
]
