"""The HTTP edge: app assembly, one module per endpoint group, the one error middleware."""
