"""Hessian spectra: Hessian-vector products, Lanczos, top eigenvalues, trace and spectral density.

The public names are re-exported by :mod:`pipejax.hessian`. The modules: ``hvp`` (the products
and the :class:`~pipejax._src.hessian.hvp.Operator` every estimator drives), ``losses``
(``composite``, ``from_value_and_grad``), ``data`` (the datasets of ``data=``), ``lanczos``,
``eigenvalues``, ``trace``, ``density``, ``blocks`` (the operator restricted to some parameters),
``progress`` (progress reports) and ``tree`` (linear algebra on pytrees).
"""
