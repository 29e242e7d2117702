"""Cutting a sequence of layers into pipeline stages: ``partition`` and ``balance``.

A *layer* has the signature of a stage, ``layer(params, x, key) -> y``. :func:`partition` groups
contiguous layers into stage functions for :func:`pipejax.pipeline`, ``balance[s]`` layers in
stage ``s`` (torchgpipe's ``GPipe(module, balance=...)``). :func:`balance` chooses the balance:
it measures a cost per layer (:func:`layer_costs`: XLA's flop count, wall time, or memory) and
:func:`balance_costs` finds the contiguous cut into ``k`` stages whose most expensive stage is as
cheap as possible, exactly.

Inside a stage, layer ``j`` (counting from 0 within the stage) receives
``jax.random.fold_in(stage_key, j)`` (:func:`layer_key`), or ``None`` when the stage gets
``None``.

The modules: :mod:`~pipejax._src.balance.partitioning` holds :func:`partition`,
:class:`Partition` and the checks of a balance; :mod:`~pipejax._src.balance.costs` holds
:func:`layer_costs` and its cost models; :mod:`~pipejax._src.balance.solver` holds
:func:`balance`, :func:`balance_costs` and :class:`Balance`.
"""

from pipejax._src.balance.costs import COST_MODELS as COST_MODELS
from pipejax._src.balance.costs import layer_costs as layer_costs
from pipejax._src.balance.partitioning import Layer as Layer
from pipejax._src.balance.partitioning import Partition as Partition
from pipejax._src.balance.partitioning import _check_balance as _check_balance
from pipejax._src.balance.partitioning import partition as partition
from pipejax._src.balance.solver import Balance as Balance
from pipejax._src.balance.solver import balance as balance
from pipejax._src.balance.solver import balance_costs as balance_costs
