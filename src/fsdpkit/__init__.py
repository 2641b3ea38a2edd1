"""fsdpkit: train large PyTorch models with FSDP2 and checkpoint them so that every
checkpoint can be trusted."""

__version__ = "0.1.0"
