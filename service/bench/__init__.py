"""Benchmarks: the towers against transformers and the floor (`towers`), the HTTP service under load (`http`)."""
