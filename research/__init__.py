"""Research built on pipedream_fast and kept out of the library: not installed with it (setup.py
packages only `pipedream_fast`); run from the repository root, e.g. `python -m research.study`."""
