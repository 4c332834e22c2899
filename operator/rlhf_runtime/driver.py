"""The driver under the name the operator renders (``python -m rlhf_runtime.driver``): ``rlhf_runtime.main``."""

import sys

from rlhf_runtime.main import main

if __name__ == "__main__":
    sys.exit(main())
