"""The errors a step's first float32 run raises when the input, not the precision, is at fault.

The message names whose code failed: the model on this batch, the user's ``loss_fn`` or the user's
``train_step`` (an error in the user's own function is not "the model cannot run this batch"), or says that the
step would train nothing although an optimizer or scaler was given.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ampdoctor.errors import ScenarioError

#: the user callable a step loop is running (``StepLoop.stage``)
STAGES = ("model", "loss_fn", "train_step", "step")


def in_module_call(e: BaseException) -> bool:
    """Whether the exception was raised inside an ``nn.Module`` call (the model), judged from its traceback."""
    tb = e.__traceback__
    impls = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
    while tb is not None:
        if tb.tb_frame.f_code in impls:
            return True
        tb = tb.tb_next
    return False


def input_error(e: BaseException, stage: str, output_type: str) -> ScenarioError:
    """The float32 reference's first step raised ``e`` while running ``stage``: say whose code failed."""
    what = f"{type(e).__name__}: {e}"
    if stage == "loss_fn":
        return ScenarioError(
            f"loss_fn(output, batch) raised {what} in the float32 run, on the model's output (a "
            f"{output_type or 'value'}); the error is in loss_fn, not in the model or the precision: fix loss_fn (it "
            "is called as loss_fn(output, batch) and must return a scalar Tensor)")
    if stage == "train_step" and not in_module_call(e):
        return ScenarioError(
            f"train_step raised {what} in the float32 run; the error is in train_step, not in the model or the "
            "precision: fix train_step (it is called as train_step(model, batch), plus optimizer=/scaler= when it "
            "takes them)")
    return ScenarioError(
        f"the model cannot run this batch even in float32: {what}. Check the batch's keys, shapes and dtypes "
        "against the model's forward")


def untrainable(loss: Any, own_loss: bool) -> ScenarioError:
    """An optimizer or scaler was given and the step computes a loss, but one without a graph: it would train
    nothing. (A step with no loss at all is a forward-only diagnosis, which the report says; the watch replays
    forwards whose loss lives outside the model that way.)"""
    if own_loss:
        why = ("loss_fn returned a loss that does not require grad (computed under torch.no_grad(), from .detach() "
               "or .item(), or every parameter is frozen); return the loss with its graph")
    else:
        why = "the model's loss does not require grad (torch.no_grad()? frozen parameters?); return it with its graph"
    return ScenarioError(f"an optimizer or scaler was given but no backward or optimizer step would run: {why}. "
                         "For a forward-only (inference) diagnosis pass no optimizer and no scaler")
