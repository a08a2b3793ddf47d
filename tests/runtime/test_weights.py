"""`weights.*`: which transport a run gets on which devices."""

from dorarl.runtime.weights import MIB, WeightsConfig


def test_auto_is_collective_unless_the_trainer_and_the_engines_differ_in_device():
    auto = WeightsConfig()
    assert auto.resolve("cpu", "cpu") == "collective" == auto.resolve("cuda", "cuda")
    assert auto.resolve("cuda", "cpu") == "object_store"
    assert WeightsConfig(transport="object_store").resolve("cuda", "cuda") == "object_store"


def test_the_spec_keeps_the_engines_dtype_and_picks_the_backend_by_device():
    spec = WeightsConfig(bucket_mb=64).spec("cuda", "cuda", "bfloat16")
    assert (spec.kind, spec.dtype, spec.bucket_bytes, spec.backend) == (
        "collective", "bfloat16", 64 * MIB, "nccl",
    )  # fmt: skip
    assert WeightsConfig().spec("cpu", "cpu", "float32").backend == "gloo"
