"""linepack.evaluate."""
