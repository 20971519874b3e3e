"""What the node tells its operators besides ``status``: its logs (``logs``) and its
Prometheus metrics, served from the broker's process (``[metrics] listen``: ``server``),
fed by the broker's observations (``events``) and its state (``state``)."""
