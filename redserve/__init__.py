"""The `redserve` command: run the whole stack (`redserve up`) or one tier."""
