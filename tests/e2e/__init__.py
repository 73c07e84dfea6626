"""End-to-end tests: real `quantserve` processes, the server and the CLI, on the real model."""
