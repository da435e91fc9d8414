"""What takes part in a scheduler step besides the model: ``StepParticipant``.

The scheduler runs each step as plan -> forward -> draw -> commit (``engine/step.py``,
``engine/commit.py``). Speculative decoding (``Speculator``) and prefill/decode disaggregation
(``PDQueues``) act around it through these hooks, called on every participant in one order, the
speculator's before the PD queues' (a draft computes its KV of a chunk before the chunk's pages
are sent, and a prompt's last pages go once the draft's work of the step is done):
- ``before_forward``: the plan is made and the forward batch built (prefill: sends layer by layer
  as the forward writes them, ``ForwardBatch.layer_done``);
- ``after_forward``: the forward ran and each row's ``kv_len`` counts what it computed (a draft
  follows the target's chunk; prefill sends the pages a chunk completed);
- ``after_commit``: every drawn token is committed (a draft head reads the step's hidden states);
- ``takes_over``: a request's first token is committed; True when the participant takes the
  request from here (prefill hands it to decode), so that its finish reason is not applied here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.request import Req
    from pdserve.engine.step import StepPlan
    from pdserve.forward_batch import ForwardBatch


class StepParticipant:
    """Hooks around a step's forward; each does nothing unless a participant overrides it."""

    def before_forward(self, plan: "StepPlan", fb: "ForwardBatch") -> None:
        pass

    def after_forward(self, plan: "StepPlan") -> None:
        pass

    def after_commit(self, plan: "StepPlan") -> None:
        pass

    def takes_over(self, req: "Req") -> bool:
        return False
