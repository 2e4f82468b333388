"""Plugins of the whole test session, the suite in tests/ and the contrib packages' tests alike.

``vllm_helpers`` (contrib/vllm/tests/, on the path through ``pythonpath`` in pyproject.toml)
holds the session fixtures that start vLLM's processes in the background when the session
starts. The suite's own fixtures are in tests/conftest.py.
"""

pytest_plugins = ["vllm_helpers"]
