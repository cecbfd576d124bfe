"""The batched engine as a service: the scheduler (requests from any thread join the running batch) and
the OpenAI-compatible HTTP API over it."""
