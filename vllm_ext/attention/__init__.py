"""The attention role: a normal `vllm serve` whose decoder layers send their MLP/MoE input to the
FFN side. `worker` (vLLM's worker and runner seam), `session` (its link to afd-ctl and its data
plane), `steps` (the step state machine the runner drives), `tp_group` (attention TP > 1),
`step_failures` and `failure_logs` (a failed step fails its requests, not the server), `health`
(the API server's `/health` and error replies)."""
