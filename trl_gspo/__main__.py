"""`python -m trl_gspo ...` (also what `accelerate launch -m trl_gspo ...` runs): the `trl-gspo` CLI."""

from .cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
