"""Tests of quantserve.chat: chat templates, tool-call and reasoning parsers, user grammars."""
