"""What service managers and orchestrators read of a node: systemd's notify
protocol (``notify``) and whether the node can serve (``health``)."""
