"""Shared test hygiene."""

from __future__ import annotations

import pytest

import pjrt_rendezvous.client as pr


@pytest.fixture(autouse=True)
def _main_thread_left_unbound():
    """A test that fails before it unbinds the main thread must not fail every later test
    in this process ("this thread is already bound ..."): its binding goes after it."""
    yield
    binding = pr.current_binding()
    if binding is not None:
        try:
            binding.client.unbind_thread()
        except Exception:  # (a client closed or forked meanwhile: the binding is dropped anyway)
            pass
