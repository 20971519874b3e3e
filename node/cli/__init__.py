"""The ``edgenode`` command line (``node.cli.main``) and its commands' views."""
