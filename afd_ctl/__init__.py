"""afd-ctl: the control plane for Attention-FFN disaggregated MoE serving.

The daemon (`afd-ctl serve`) registers workers, assigns role ranks and the M:N routing, and
relays one AFDControlPayload per step from the attention side to the FFN workers. Workers use
`afd_ctl.client.ControllerClient`.
"""

__version__ = "0.1.0"
