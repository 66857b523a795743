"""Tensor parallelism's communication and processes: the group a sharded model's layers talk
through (``group``), how a layer's dimensions are cut over its ranks (``sharding``), and the
worker processes an engine starts or that ``torchrun`` starts for it (``workers``)."""
