"""Entry point of a persist process: ``python -m hyperdcp.async_saving._child <fd>``."""

import sys

from hyperdcp.async_saving.child import main

if __name__ == "__main__":
    main(int(sys.argv[1]))
