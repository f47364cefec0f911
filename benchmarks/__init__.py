"""Speed benchmarks of mha, outside the package (see README.md)."""
