"""Replicas of one pipeline (data parallel over `width`), or none: REDUCE averages across them."""

from __future__ import annotations

from ..lightning import ReplicasLayer


class NoReplicas(ReplicasLayer):
    """One pipeline."""


class AllReduce(ReplicasLayer):
    """`width` replicas of the pipeline (data parallel): REDUCE averages each chunk's gradients."""

    averages_gradients = True
