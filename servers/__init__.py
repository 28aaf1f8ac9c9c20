"""What runs model servers: SGLang launch profiles, supervision, and the `sim` stand-in."""
