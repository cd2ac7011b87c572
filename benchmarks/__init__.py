"""Benchmarks, run from the repository root as `python -m benchmarks.<name>`; they import
`qjax` (and read `configs/`), and nothing imports them."""
