"""Deciding what runs: requests, the Scheduler protocol, policy extension points, KV bookkeeping.

Nothing here imports from :mod:`cbcore.execution`; this side never touches a tensor of the model.
"""
