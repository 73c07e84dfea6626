"""Backend-agnostic serving engine: sequences, scheduler, detokenizer and the step loop."""
