"""edgenode fallback: the deterministic rule engine (imports only broker.protocol)."""
