"""Shared building blocks of every model: each layer takes the step's ``OpsConfig`` (or the
whole ``ForwardBatch``) as an argument and computes through ``models.ops``."""
