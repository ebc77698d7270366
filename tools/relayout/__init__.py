"""linepack.relayout."""
