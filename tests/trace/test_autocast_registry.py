"""The autocast part of the op registry: declared once per device, read by the precision layer's policy lookup."""

from __future__ import annotations

import pytest

from ampdoctor.precision import policy_for
from ampdoctor.precision._cuda_policy import COMPOSITE_POLICY, CPU_POLICY, CUDA_POLICY
from ampdoctor.trace import AUTOCAST, AutocastClass, autocast_class, declare_autocast, declare_composite


def test_a_second_declaration_of_an_op_on_one_device_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"cuda autocast: 'mm' is already declared 'lower'.*once per device"):
        declare_autocast("cuda", "fp32", "mm")
    with pytest.raises(ValueError, match=r"'lstm' is already declared"):
        declare_composite("fp32", "lstm")
    with pytest.raises(ValueError, match=r"autocast policy 'fp64': expected one of lower, fp32"):
        declare_autocast("cpu", "fp64", "never_declared_op")
    with pytest.raises(ValueError, match=r"autocast device 'xpu'"):
        declare_autocast("xpu", "lower", "never_declared_op")
    assert autocast_class("never_declared_op", "cpu") is None  # a rejected declaration leaves nothing behind


def test_registry_entries_are_what_the_policy_lookup_reads() -> None:
    mm = autocast_class("mm", "cuda")
    assert mm == AutocastClass("mm", "cuda", "lower", frozenset({""}))
    assert policy_for("aten.mm.default") == mm.policy
    pow_ = autocast_class("pow", "cuda")
    assert pow_ is not None and pow_.overloads == {"Tensor_Scalar", "Tensor_Tensor", "Scalar"}
    assert autocast_class("cat", "cuda") is None and autocast_class("cat", "cpu").policy == "promote"
    with pytest.raises(ValueError, match="invalid device kind 'tpu'"):
        autocast_class("mm", "tpu")


def test_composites_are_kept_apart_from_the_dispatcher_registrations() -> None:
    composites = {n for n, c in AUTOCAST["cuda"].items() if c.composite}
    assert composites == set(COMPOSITE_POLICY) and not composites & set(CUDA_POLICY)
    assert COMPOSITE_POLICY["square"] == "fp32" and COMPOSITE_POLICY["lstm"] == "lower"
    assert autocast_class("pairwise_distance").approximate and not autocast_class("square").approximate
    assert not any(c.composite for c in AUTOCAST["cpu"].values()) and set(CPU_POLICY) == set(AUTOCAST["cpu"])
