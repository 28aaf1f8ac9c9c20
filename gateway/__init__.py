"""crossover's HTTP gateway: one OpenAI-compatible URL in front of a speculative and a plain SGLang pool."""
