"""Running a decided step: flat batch, KV tensors, attention bridge, Backend protocol, sampler.

From :mod:`cbcore.scheduling` this side takes only the step's plan (:mod:`cbcore.scheduling.plan`).
"""
