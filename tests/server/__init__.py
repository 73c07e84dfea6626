"""Tests of quantserve.server: the app and its APIs, the router, the chat page, vision inputs, loadgen."""
