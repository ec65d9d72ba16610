"""Integrations of moe_dispatcher with training frameworks (installed as ``moe_dispatcher.integrations``).

``moe_dispatcher.integrations.megatron``: a Megatron-Core token dispatcher; importing it registers the
dispatcher types ``"moe_dispatcher"`` and ``"moe_dispatcher_ll"``.
"""
