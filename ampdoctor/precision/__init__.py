"""Running a step in a target precision next to an fp32 reference, on copies of the caller's objects.

One step runner for every caller (:mod:`ampdoctor.precision._step`): :func:`prepare` makes the copies,
:class:`StepLoop` runs N steps under the precision's context with optional :class:`Observer` s
(:func:`run_steps` does both). ``run(spec, reference=False)`` is the diagnosis's traced target run,
``run(spec, reference=True)`` the float32 reference (autocast disabled, also inside the user's own
``torch.autocast`` blocks; explicit casts in user code still cast). Precisions: see :data:`PRECISIONS`.
"""

from ampdoctor.precision._compiled import compare_compiled, compare_compiled_generation, compare_outputs
from ampdoctor.precision._cuda_policy import POLICIES, policy_for, policy_table_markdown
from ampdoctor.precision._distributed import (
    PHASES,
    RankInfo,
    exchange_rows,
    is_collective,
    own_origins,
    rank_info,
    wrapper_kind,
)
from ampdoctor.precision._generate import (
    GENERATION_PRECISIONS,
    NOISE_MARGIN_RMS,
    NOISE_REL_ERR,
    DecodeStat,
    Generation,
    decoder_start,
    generate,
    validate_generation,
)
from ampdoctor.precision._keep_fp32 import keep_fp32_transform
from ampdoctor.precision._positions import first_position, headroom_curve, position_profile
from ampdoctor.precision._runner import ParamState, RunResult, run, unread_updates
from ampdoctor.precision._shared_copy import SharedCopy
from ampdoctor.precision._spec import (
    FP8_FORMATS,
    MAX_STEPS,
    PRECISIONS,
    ScenarioError,
    StepSpec,
    check_steps,
    load_scenario_module,
    make_spec,
    spec_from_module,
)
from ampdoctor.precision._step import (
    AMP_DTYPES,
    LOW_DTYPES,
    GradSnapshot,
    Observer,
    ParamSnapshot,
    Prepared,
    StepLoop,
    StepResult,
    call_model,
    default_loss,
    prepare,
    run_steps,
    saved_rng,
)
from ampdoctor.precision.emulation import cuda_autocast
from ampdoctor.precision.fp8 import Fp8Autocast, Fp8Recipe, Fp8Stats, Fp8TensorStats, fp8_autocast, fp8_disabled
from ampdoctor.precision.headroom import Headroom, HeadroomRow, headroom

__all__ = [
    "AMP_DTYPES",
    "LOW_DTYPES",
    "GENERATION_PRECISIONS",
    "NOISE_MARGIN_RMS",
    "NOISE_REL_ERR",
    "DecodeStat",
    "Generation",
    "decoder_start",
    "compare_compiled",
    "compare_compiled_generation",
    "compare_outputs",
    "first_position",
    "generate",
    "headroom_curve",
    "keep_fp32_transform",
    "position_profile",
    "validate_generation",
    "POLICIES",
    "Fp8Autocast",
    "FP8_FORMATS",
    "Fp8Recipe",
    "Fp8Stats",
    "Fp8TensorStats",
    "Headroom",
    "HeadroomRow",
    "cuda_autocast",
    "fp8_autocast",
    "fp8_disabled",
    "headroom",
    "policy_for",
    "policy_table_markdown",
    "MAX_STEPS",
    "PHASES",
    "RankInfo",
    "exchange_rows",
    "is_collective",
    "own_origins",
    "rank_info",
    "wrapper_kind",
    "PRECISIONS",
    "GradSnapshot",
    "Observer",
    "ParamSnapshot",
    "ParamState",
    "Prepared",
    "StepLoop",
    "StepResult",
    "prepare",
    "run_steps",
    "RunResult",
    "SharedCopy",
    "ScenarioError",
    "StepSpec",
    "call_model",
    "default_loss",
    "load_scenario_module",
    "check_steps",
    "make_spec",
    "run",
    "unread_updates",
    "saved_rng",
    "spec_from_module",
]
