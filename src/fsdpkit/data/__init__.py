"""Datasets and the world-size-invariant, resumable sampler."""

from fsdpkit.data.datasets import build_datasets
from fsdpkit.data.sampler import GlobalSampler, describe_split, eval_micro_batches, rank_micro_batches

__all__ = ["GlobalSampler", "build_datasets", "describe_split", "eval_micro_batches", "rank_micro_batches"]
