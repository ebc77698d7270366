"""linepack.verify."""
