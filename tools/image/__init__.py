"""linepack.image."""
