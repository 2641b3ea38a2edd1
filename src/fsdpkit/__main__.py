"""`python -m fsdpkit ...` is the same as the `fsdpkit` command (what torchrun launches)."""

from fsdpkit.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
