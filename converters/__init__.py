"""Offline format converters."""
