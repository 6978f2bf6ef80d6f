"""``qbench bench``: speed and memory of qbench and its peers, measured in one run."""
