"""An SGLang stand-in: SGLang's HTTP surface over a continuous-batching performance model (see README.md)."""
