"""Hessian spectra: Hessian-vector products, Lanczos, top eigenvalues, trace and spectral density.

The public names are re-exported by :mod:`pipejax.hessian`.
"""
