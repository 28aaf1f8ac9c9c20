"""Concurrency sweeps against OpenAI-compatible endpoints, crossover detection and threshold advice."""
