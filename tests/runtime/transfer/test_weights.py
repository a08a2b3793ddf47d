"""`weights.*`: which transport a run gets on which devices."""

from dorarl.runtime.transfer.weights_config import MIB, WeightsConfig


def test_auto_is_collective_on_one_kind_of_device_and_the_object_store_on_mixed_ones():
    auto = WeightsConfig()
    assert auto.resolve("cuda", "cuda") == "collective" == auto.resolve("cpu", "cpu")
    assert auto.resolve("cuda", "cpu") == "object_store" == auto.resolve("cpu", "cuda:0")
    assert WeightsConfig(transport="collective").resolve("cpu", "cpu") == "collective"
    assert WeightsConfig(transport="object_store").resolve("cuda", "cuda") == "object_store"


def test_the_spec_keeps_the_engines_dtype_and_picks_the_backend_by_device():
    spec = WeightsConfig(bucket_mb=64).spec("cuda", "cuda", "bfloat16")
    assert (spec.kind, spec.dtype, spec.bucket_bytes, spec.backend) == (
        "collective", "bfloat16", 64 * MIB, "nccl",
    )  # fmt: skip
    assert WeightsConfig().spec("cpu", "cpu", "float32").backend == "gloo"


def test_the_engines_auto_dtype_is_what_they_hold_on_their_device():
    assert WeightsConfig().spec("cuda", "cuda", "auto").dtype == "bfloat16"
    assert WeightsConfig().spec("cpu", "cpu", "auto").dtype == "float32"
