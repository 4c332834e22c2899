"""The driver under the name the operator renders (``python -m rlhf_runtime.driver``): ``rlhf_runtime.main``."""

from rlhf_runtime.main import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
