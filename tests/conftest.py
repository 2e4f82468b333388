"""Fixtures and hooks only: tiny models and their per-prompt references, built once per session; the test
server. What test modules import lives in the ``support`` package beside this file."""

from __future__ import annotations

import os

import pytest
import torch
from support import CAPS, PROMPTS, SERVE_ARGS, SERVE_KEY, LazyDict

from cbcore.testing import reference_generate, tiny_model
from cbcore.testing.reference import ReferenceOutput

# A local Ray instance binds its services to loopback rather than the machine's
# outward address (read by Ray when it is first imported, so set here).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Tiny models gain nothing from intra-op threads, and on a small shared machine
# threads fighting over cores slow every test down by an order of magnitude.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def models() -> dict[str, torch.nn.Module]:
    """Tiny random model per family (``models["llama"]``), shared by the session."""
    return LazyDict(tiny_model)


@pytest.fixture(scope="session")
def references(models: dict[str, torch.nn.Module]) -> dict[str, list[ReferenceOutput]]:
    """HF ``generate`` of PROMPTS/CAPS per family, computed once."""
    return LazyDict(lambda family: reference_generate(models[family], PROMPTS, CAPS))


# -- the HTTP server (tests/test_serve_*.py) ------------------------------------------


@pytest.fixture(scope="session")
def tiny_server(cb_tiny_model_dir):
    """`cb serve` on the tiny model in a subprocess (API key SERVE_KEY), shared by the serve tests."""
    from cbcore.serve.launch import ServerProcess

    server = ServerProcess(
        ["--model", str(cb_tiny_model_dir), "--api-key", SERVE_KEY, *SERVE_ARGS], env={"OMP_NUM_THREADS": "1"}
    )
    with server:
        yield server
    assert server.proc is not None and server.proc.returncode == 0, server.log_text()[-2000:]
