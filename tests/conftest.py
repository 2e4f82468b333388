"""Shared fixtures: tiny models and their per-prompt references, built once per session."""

from __future__ import annotations

import pytest
import torch

from cbcore.testing import random_prompts, reference_generate, tiny_model
from cbcore.testing.reference import ReferenceOutput

# 16 prompts of 1-64 tokens; caps cover 1 and 96 and much in between.
PROMPTS = random_prompts(16, 1, 64, seed=0)
CAPS = [1, 96, 17, 64, 5, 80, 33, 2, 48, 90, 12, 70, 25, 96, 8, 40]
PRIORITIES = [i % 3 for i in range(16)]
CLIENTS = ["alice" if i % 3 else "bob" for i in range(16)]


@pytest.fixture(scope="session")
def models() -> dict[str, torch.nn.Module]:
    cache: dict[str, torch.nn.Module] = {}

    class _Models(dict):
        def __missing__(self, family: str) -> torch.nn.Module:
            cache[family] = self[family] = tiny_model(family)
            return cache[family]

    return _Models()


@pytest.fixture(scope="session")
def references(models: dict[str, torch.nn.Module]) -> dict[str, list[ReferenceOutput]]:
    class _Refs(dict):
        def __missing__(self, family: str) -> list[ReferenceOutput]:
            self[family] = reference_generate(models[family], PROMPTS, CAPS)
            return self[family]

    return _Refs()
