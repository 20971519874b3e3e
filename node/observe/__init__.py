"""What the node tells its operators besides ``status``: its logs (``logs``)."""
