"""Measured GPU profiles: step costs from Vidur's published per-operator timings.

The linear and elementwise operators of a layer, the embedding and the
tensor-parallel all-reduce are interpolated in the tables measured on A100,
A40 and H100 GPUs (``data/``, MIT licence, Agrawal et al., MLSys 2024);
attention, which the tables do not contain, is a roofline whose assumptions
every profile states. :mod:`.catalog` names the profiles, :mod:`.tables`
reads and interpolates the data, :mod:`.cost` prices a step and
:mod:`.check` measures the interpolation against held-out rows.
"""
