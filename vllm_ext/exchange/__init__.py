"""The data plane as both roles of the vLLM extension drive it: the NIXL (host-driven) and the
GPU-driven exchange, their FFN-side CUDA graphs, and their per-step timings."""
