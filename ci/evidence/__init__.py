"""What a GPU run proves: its artifact tree, the known-good table, the bench gate."""
