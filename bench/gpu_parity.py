"""Compare real CUDA autocast with ampdoctor's ``cuda_autocast`` emulation, op by op, on the public cases.

For every scenario file in the cases folder whose ``precision`` is ``"fp16-amp"`` or ``"bf16-amp"``, the forward
pass (and ``loss_fn``, if the case has one) runs twice on the same CUDA device from the same RNG state: once under
``torch.autocast("cuda", dtype)``, once under ``cuda_autocast(dtype, device_type="cuda")``. A ``TorchDispatchMode``
logs ``(aten op, output dtypes)`` for every aten op except ``_to_copy`` (CUDA autocast caches the casts of weights,
the emulation does not: numerically the same); the two sequences are compared.

    python bench/gpu_parity.py [--cases DIR] [--out FILE] [--strict] [--fake-cuda]

Writes ``bench/results/gpu_parity.json``. Without a CUDA device it prints "no CUDA device; nothing to compare" and
exits 0. ``--fake-cuda`` runs on fake CUDA tensors instead (``FakeTensorMode``: torch's own CUDA autocast kernels on
a CPU-only machine; shapes and dtypes only, no autograd; indexing views, SDPA and cuDNN need a real GPU there, so
the HF cases fail with "PyTorch is not linked with support for cuda devices" - plain-module models work).
``--strict`` exits 1 when a sequence differs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASES = REPO.parent / "shared" / "cases"
DEFAULT_OUT = REPO / "bench" / "results" / "gpu_parity.json"
AMP = {"fp16-amp": torch.float16, "bf16-amp": torch.bfloat16}


class OpLog(TorchDispatchMode):
    """Logs (aten op, output dtypes) of every aten op except ``_to_copy``."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and func is not torch.ops.aten._to_copy.default:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.log.append((str(func), tuple(str(o.dtype).replace("torch.", "") for o in outs
                                              if isinstance(o, torch.Tensor))))
        return out


@contextlib.contextmanager
def real_autocast(dtype: torch.dtype, fake: bool):
    if not fake:
        with torch.autocast("cuda", dtype=dtype):
            yield
        return
    # torch.autocast("cuda") refuses to start without a GPU: set the state its __enter__ would set
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def load_case(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_parity_case_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to_device(obj: Any, fake: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        if fake:  # fake CUDA tensors are created, not copied (a copy to "cuda" needs a GPU)
            return torch.zeros(obj.shape, dtype=obj.dtype, device="cuda")
        return obj.to("cuda")
    if isinstance(obj, dict):
        return {k: to_device(v, fake) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, fake) for v in obj)
    return obj


def model_to_device(model: nn.Module, fake: bool) -> nn.Module:
    if not fake:
        return model.to("cuda")
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device="cuda"), requires_grad=False))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                mod.register_buffer(name, torch.zeros(b.shape, dtype=b.dtype, device="cuda"),
                                    persistent=name not in mod._non_persistent_buffers_set)
    return model


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def run_once(spec: dict, ctx: Any) -> list[tuple[str, tuple[str, ...]]]:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)
    with torch.no_grad(), OpLog() as log, ctx:
        out = call_model(spec["model"], spec.get("batch"))
        if spec.get("loss_fn") is not None:
            spec["loss_fn"](out, spec.get("batch"))
    return log.log


def compare_case(path: Path, fake: bool) -> dict[str, Any] | None:
    from ampdoctor.precision.emulation import cuda_autocast

    module = load_case(path)
    spec = module.make()
    precision = spec.get("precision")
    if precision not in AMP:
        return None
    dtype = AMP[precision]
    entry: dict[str, Any] = {"case": path.stem, "precision": precision}
    try:
        with _fake_mode() if fake else contextlib.nullcontext():
            spec["model"] = model_to_device(spec["model"], fake)
            spec["batch"] = to_device(spec.get("batch"), fake)
            real = run_once(spec, real_autocast(dtype, fake))
            emulated = run_once(spec, cuda_autocast(dtype, device_type="cuda"))
    except Exception as e:  # a case that cannot run here is reported, not fatal
        entry.update(error=f"{type(e).__name__}: {e}".splitlines()[0][:300], trace=traceback.format_exc()[-2000:])
        return entry
    mismatch = next((i for i, (a, b) in enumerate(zip(real, emulated)) if a != b), None)
    if mismatch is None and len(real) != len(emulated):
        mismatch = min(len(real), len(emulated))
    entry.update(ops_real=len(real), ops_emulated=len(emulated), equal=mismatch is None,
                 dtype_counts_real=_counts(real), dtype_counts_emulated=_counts(emulated))
    if mismatch is not None:
        entry["first_mismatch"] = {"index": mismatch,
                                   "real": real[mismatch: mismatch + 5], "emulated": emulated[mismatch: mismatch + 5]}
    return entry


def _counts(log: list[tuple[str, tuple[str, ...]]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, dtypes in log:
        for d in dtypes:
            out[d] = out.get(d, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES, help=f"scenario folder (default {DEFAULT_CASES})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON result (default {DEFAULT_OUT})")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a sequence differs")
    parser.add_argument("--fake-cuda", action="store_true", help="run on fake CUDA tensors (no GPU needed)")
    args = parser.parse_args(argv)
    if not args.fake_cuda and not torch.cuda.is_available():
        print("no CUDA device; nothing to compare")
        return 0
    if not args.cases.is_dir():
        print(f"cases folder {args.cases} not found; pass --cases DIR", file=sys.stderr)
        return 2
    results = []
    for path in sorted(args.cases.glob("*.py")):
        entry = compare_case(path, args.fake_cuda)
        if entry is None:
            continue
        results.append(entry)
        status = "error: " + entry["error"] if "error" in entry else ("same" if entry["equal"] else "DIFFERENT")
        print(f"{entry['case']:45s} {entry['precision']:9s} {status}")
    doc = {"torch": torch.__version__, "device": "fake-cuda" if args.fake_cuda else torch.cuda.get_device_name(0),
           "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    differ = [e["case"] for e in results if e.get("equal") is False]
    return 1 if args.strict and differ else 0


if __name__ == "__main__":
    sys.exit(main())
