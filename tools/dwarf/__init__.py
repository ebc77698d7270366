"""DWARF for a new code layout: rewrite (relayout) and check (verify --against)."""
