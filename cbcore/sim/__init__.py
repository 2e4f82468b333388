"""Simulation: the real scheduler and block manager on a virtual clock, with a step cost model.

Only the model forward is replaced (by :mod:`cbcore.sim.cost`); requests,
policies, the block manager and the per-step bookkeeping are the engine's
own (:class:`cbcore.engine_core.EngineCore`), and workloads, metrics and
reports are the benchmark's.
"""
