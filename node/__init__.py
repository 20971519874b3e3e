"""edgenode host side: config, model, worker processes, supervisor, composition root, CLI."""
