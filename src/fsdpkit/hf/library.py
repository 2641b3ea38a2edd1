"""transformers itself: the version fsdpkit needs, whether a model is one transformers built, and
that model seen with the class transformers gave it (fully_shard renames it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

# The oldest transformers fsdpkit is tested with (tests/cuda ran on 5.17, CI on the newest): reading and
# writing hub folders goes through transformers 5's weight conversions (transformers.core_model_loading),
# whose helpers change between releases.
MIN_TRANSFORMERS = "5.17"


def require_transformers():
    """The transformers module, or an ImportError that says which version to install."""
    try:
        import transformers
    except ImportError:
        raise ImportError("model.kind=hf needs transformers: pip install 'fsdpkit[hf]' (with -c constraints.txt "
                          "here)") from None
    from packaging.version import Version

    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise ImportError(f"fsdpkit reads and writes Hugging Face folders through transformers>={MIN_TRANSFORMERS}'s "
                          f"weight conversions, and this environment has transformers {transformers.__version__}: "
                          f"pip install -U 'transformers>={MIN_TRANSFORMERS}'")
    return transformers


def is_hf_model(model: nn.Module) -> bool:
    """Whether transformers built `model` (it has the hooks `from_pretrained` initialises with)."""
    return hasattr(model, "_init_weights") and hasattr(model, "initialize_weights") and hasattr(model, "config")


@contextlib.contextmanager
def transformers_class(model: nn.Module) -> Iterator[nn.Module]:
    """`model` seen, inside the block, with the class transformers built. fully_shard gives a root
    the class FSDP<Name>, defined in a torch module: transformers looks conversion rules up by
    class name, and treats a class defined outside `transformers.` as custom code, whose
    `initialize_weights` skips every module whose own tensors are flagged initialised (so a hook
    that sets a child's buffer from the parent, as FalconH1Model's does, would never run)."""
    wrapped = type(model)
    if isinstance(model, FSDPModule):
        model.__class__ = next(c for c in wrapped.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = wrapped
