"""Invertible layers with log-determinants, chains with constant-memory backward, and flows.

The public names are re-exported by :mod:`pipejax.invertible`. Files, inner to outer:

``base.py``        the layer protocol and helpers shared by every layer (keys, log-determinants)
``layers.py``      ActNorm, InvertibleLinear, Inv1x1Conv, Squeeze
``coupling.py``    AdditiveCoupling, AffineCoupling and their conditioning networks
``reversible.py``  the constant-memory scan: a ``jax.custom_vjp`` that rebuilds inputs by inversion
``chain.py``       Chain: layers repeated K times with memory "linear", "sqrt" or "constant"
``multiscale.py``  MultiScale: Glow/RealNVP's factoring out of half the channels at each level
``flow.py``        Flow: a standard-normal base, log_prob, sample, dequantisation, bits per dim
"""
