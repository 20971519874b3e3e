"""Remote workers: the host agent that runs a board's workers for another board's node."""
