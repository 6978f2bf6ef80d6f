"""qbench's batched KV-cache engine: one concept to a file."""
