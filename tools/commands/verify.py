"""``linepack verify``: placeholder replaced below."""
