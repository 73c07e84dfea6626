"""Tests of quantserve.backends, one folder per backend."""
