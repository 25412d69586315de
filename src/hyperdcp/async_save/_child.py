"""Entry point of a persist process: ``python -m hyperdcp.async_save._child <fd>``."""

import sys

from hyperdcp.async_save.persist_process import main

if __name__ == "__main__":
    main(int(sys.argv[1]))
