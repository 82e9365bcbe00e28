"""Running a step in a target precision next to an fp32 reference, on copies of the caller's objects.

``run(spec, reference=False)`` runs the target precision, ``run(spec, reference=True)`` the float32
reference (autocast disabled, also inside the user's own ``torch.autocast`` blocks; explicit casts in user
code still cast). Precisions: see :data:`PRECISIONS`.
"""

from ampdoctor.precision._runner import ParamState, RunResult, call_model, default_loss, run, saved_rng
from ampdoctor.precision._spec import (
    PRECISIONS,
    ScenarioError,
    StepSpec,
    expected,
    load_scenario_module,
    make_spec,
    spec_from_module,
)

__all__ = [
    "PRECISIONS",
    "ParamState",
    "RunResult",
    "ScenarioError",
    "StepSpec",
    "call_model",
    "default_loss",
    "expected",
    "load_scenario_module",
    "make_spec",
    "run",
    "saved_rng",
    "spec_from_module",
]
