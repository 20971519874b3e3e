"""``python -m node.cli``: the ``edgenode`` command, as a background start runs the node."""

from node.cli.main import main

main()
