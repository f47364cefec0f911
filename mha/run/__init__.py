"""The plumbing of a run: command lines, config checks, metric writers,
workdir locks, write failures, devices and the compilation cache.

Nothing here changes a number a run computes; the model, the layer and the
pruning techniques live one level up (``mha/``).
"""
