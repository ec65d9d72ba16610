"""The router's probs applied by our combine instead of by the experts: an offer the experts may accept.

Megatron's experts compute ``fc2(act(fc1(x)) * p)``: a float32 multiply of every expert row's FFN
activation by its permuted prob, and its backward. With bias-free linear layers that equals ``p * fc2(...)``,
which our Buffer's expert-major combine computes while it sums a token's rows anyway (``weights``, fused into
the un-permute reduction in the compiled backend). So the normal-mode dispatcher offers the experts to apply
the probs itself:

  dispatch_postprocess   attaches a ``ProbsOffer`` to the permuted probs it hands to the experts
  experts.forward        ``leave_probs_to_combine(permuted_probs)``: True (the offer is now accepted) means
                         "do not multiply"; experts that never call it (all of Megatron's) multiply as always
  token_combine          weights the combine by the permuted probs only if the offer was accepted; the
                         probs' gradient then comes from the combine's backward (moe_dispatcher.autograd)

The offer lives on the probs tensor object itself, so it reaches exactly the experts of the same layer and
call; anything that rebuilds the tensor on the way (a view, a cast, another dispatcher) drops it, and then
the experts multiply and the combine does not: both sides always agree, whatever they are. The tensor holds
the offer and the dispatcher holds both (no reference cycle through the autograd graph).
"""
from __future__ import annotations

import torch

_ATTRIBUTE = "_moe_dispatcher_probs_offer"


class ProbsOffer:
    """One dispatch's offer to apply its permuted probs in the combine; ``accepted`` once experts took it."""

    __slots__ = ("accepted",)

    def __init__(self) -> None:
        self.accepted = False


def offer_probs(permuted_probs: torch.Tensor) -> ProbsOffer:
    """Attach a fresh offer to ``permuted_probs`` (the tensor the experts will get) and return it."""
    offer = ProbsOffer()
    setattr(permuted_probs, _ATTRIBUTE, offer)
    return offer


def leave_probs_to_combine(permuted_probs: torch.Tensor) -> bool:
    """For experts whose output is linear in the probs (no bias after the multiply): True when the dispatcher
    that produced ``permuted_probs`` will multiply each expert row by its prob in the combine, in which case
    the caller must not multiply; the offer is accepted by this call. False: multiply as usual."""
    offer = getattr(permuted_probs, _ATTRIBUTE, None)
    if offer is None:
        return False
    offer.accepted = True
    return True
