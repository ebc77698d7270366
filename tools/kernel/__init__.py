"""linepack.kernel."""
