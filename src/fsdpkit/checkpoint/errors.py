"""Checkpoint errors. They derive from Exception (DCP's own CheckpointException derives from
BaseException, which `except Exception` would not catch; we wrap it)."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved, found, verified or loaded; the message says why and what to do."""


class CheckpointSaveError(CheckpointError):
    """Saving failed on at least one rank; the previous checkpoint stays `latest`."""


class CheckpointCorruptError(CheckpointError):
    """A file is missing, truncated or fails its checksum."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizer it is loaded into, or the restored state
    differs from it. `differing`: restored tensors of the right shape and dtype whose values differ
    from their checksums (resume.verify_restored)."""

    def __init__(self, message: str, *, differing: list[str] | None = None) -> None:
        super().__init__(message)
        self.differing = differing or []


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds pickled objects outside the allow-list; refused without executing them."""
