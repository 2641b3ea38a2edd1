"""A parameter's own name: without the components that torch's module wrappers insert into it."""

from __future__ import annotations

# Module-wrapper components that torch inserts into FQNs (compile, FSDP1, activation
# checkpointing); removed wherever they appear.
WRAPPER_COMPONENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
# DDP/DataParallel put `module.` in front of every name; removed at the start only.
LEADING_WRAPPERS = ("module",)


def clean_name(name: str, *, strip_prefixes: tuple[str, ...] = (), add_prefix: str = "") -> str:
    """Drop wrapper components, then each user prefix that the name starts with, then add one."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] in LEADING_WRAPPERS:
        parts = parts[1:]
    name = ".".join(parts)
    for prefix in strip_prefixes:
        if prefix and name.startswith(prefix):
            name = name[len(prefix):]
    return add_prefix + name
