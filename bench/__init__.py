"""Benchmarks: each a `python -m bench.<name>` script that writes JSON and a markdown table under bench/results/."""
