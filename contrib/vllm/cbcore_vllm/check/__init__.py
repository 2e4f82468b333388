"""The decision check: one workload through cbcore's engine and through vLLM with the adapter, compared.

``python -m cbcore_vllm.check --config my.yaml --workload trace.jsonl`` (docs/vllm.md, "Check your own plugin").
"""
