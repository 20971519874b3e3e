"""CURVE key files of the node: generating, allowing and loading them (``keys``)."""
