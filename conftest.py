"""Doctests under pipejax/ run with the same strict JAX set-up as the tests."""

from tests.conftest import *  # noqa: F401,F403
