"""Tests of quantserve.engine: the scheduler, the async engine, the paged KV ledger, the model plan."""
