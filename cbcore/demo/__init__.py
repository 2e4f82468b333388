"""`cb demo`: static waves vs continuous batching on the seeds' six requests."""
