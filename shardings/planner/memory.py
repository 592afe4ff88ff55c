"""The planner's one memory model: a step's bytes per rank by role, shared by the estimate and the exact runs.

The roles are the train step's own (:data:`shardings.step.held_memory.HELD_ROLES`: what ``metrics["memory"]``
counts between steps — params, their compute-dtype copies, grads, optimizer state) and what a step adds at its
peak: the activations saved for backward and the buffers (gathered parameters, transient gradients, logits,
pipeline carries). One :class:`StepMemory` record carries them:

- :func:`shardings.planner.estimate.estimate` computes each term from formulas (the held roles exactly, from each
  leaf's specs);
- :func:`shardings.planner.exact.exact` corrects the terms of its own candidate (:func:`corrected`): the held roles
  as its fake steps' ``metrics["memory"]`` counts them (:func:`shardings.step.held_memory.roles`), the activations as
  the step measured them (a pipelined rank's saved-activation peak; without ``pp`` the step's, seen beneath ZeRO-3's
  re-gather hooks), at most what the peak leaves besides the held roles, and the buffers as the rest of the
  measured peak. Nothing measured on one candidate scales another's terms.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from shardings.step.held_memory import HELD_ROLES

__all__ = ["ROLES", "StepMemory", "corrected"]

ROLES = (*HELD_ROLES, "activations", "buffers")


class StepMemory(NamedTuple):
    """Device bytes per rank at a step's peak, by role (:data:`ROLES`); roles kept on the host count 0 here."""

    params: float
    compute: float
    grads: float
    opt_state: float
    activations: float
    buffers: float

    @property
    def peak(self) -> float:
        """The step's peak on the device: every role together."""
        return sum(self)

    @property
    def held(self) -> float:
        """What the step holds between steps (:data:`~shardings.step.held_memory.HELD_ROLES`)."""
        return sum(getattr(self, r) for r in HELD_ROLES)

    def off_device(self, host: Iterable[str]) -> tuple[StepMemory, float]:
        """This memory with the roles in ``host`` (a layout's offloaded roles) moved to host memory, and their
        bytes there."""
        host = tuple(host)
        return self._replace(**dict.fromkeys(host, 0.0)), sum(getattr(self, r) for r in host)


def corrected(estimated: StepMemory, held: dict[str, float], peak: float, activations: float | None,
              host: Iterable[str] = ()) -> StepMemory:
    """``estimated``'s terms replaced by what a candidate's own fake steps measured.

    Args:
        estimated: the candidate's estimate.
        held: its step's ``metrics["memory"]`` (:func:`shardings.step.held_memory.roles`), at the real depth.
        peak: its step's measured device peak (host roles excluded).
        activations: the most saved-activation bytes the step measured at once (counted at most what the peak
            leaves besides the held roles: a step's peak may come before its activations' or after them), or
            ``None`` where none was measured (a pipelined candidate's comm-only run): then the estimate's term.
        host: the roles the layout keeps in host memory (0 on the device).
    """
    host = tuple(host)
    state = {r: 0.0 if r in host else float(held.get(r, 0)) for r in HELD_ROLES}
    rest = max(0.0, peak - sum(state.values()))
    saved = min(rest, estimated.activations if activations is None else float(activations))
    return StepMemory(**state, activations=saved, buffers=rest - saved)
