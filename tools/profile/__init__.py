"""linepack.profile."""
