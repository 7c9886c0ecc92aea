"""`python -m transformer_mt ...`: the same CLI as `tmt`; torchrun needs this form (`-m`)."""

from transformer_mt.cli import main

if __name__ == "__main__":
    main()
