"""The FFN role: `vllm serve MODEL --afd-role ffn`, experts only, no scheduler or KV cache.
`cli` (its entry point), `server` (the loop over payloads, epochs, reconnects, stop), `steps`
(what one step runs, and its counts), `engine` (vLLM's MLP/MoE modules for every layer),
`stack` (the FFN half and the slice of the experts one rank holds)."""
