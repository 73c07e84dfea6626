"""Types shared by the engine and the backends: sequences, sampling parameters, detokenization, and the contract
between the engine and a runner (what it runs each step, what it says about its vocabulary and KV cache)."""
