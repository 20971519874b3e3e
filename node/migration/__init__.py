"""The migration log (shadow, dual, degrade, full records) and ``edgenode report``'s summary."""
