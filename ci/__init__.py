"""CI and environment tooling (Python >= 3.11): the configuration matrix and its locks."""
