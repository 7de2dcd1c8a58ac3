"""Device memory as the hardware states it (issue 39, item 4): the catalog gives each device's
memory in its unit (GiB for HBM and GDDR, whatever a datasheet's "GB" says), each vendor a reserve
for its runtime (context, collective buffers, allocator), and one function, predictor.memory.fits,
answers "does this stage fit" for the predictor, the planner, the pre-flight and the dry run."""

from __future__ import annotations

import pytest

from hethub.errors import SpecError
from hethub.predictor import predict
from hethub.predictor.memory import StageMemory, fits, headroom_gb
from hethub.spec import load_model, parse_cluster, parse_plan
from hethub.spec.accelerator import GIB, catalog, parse_accelerator


def test_the_catalog_reads_hbm_as_gib_and_keeps_the_vendors_reserve() -> None:
    h100 = catalog()["h100"]
    assert h100.memory_bytes == 80 * GIB
    assert h100.memory_reserve_bytes == round(2.5 * GIB)  # catalog.yaml's vendor_defaults
    assert h100.usable_memory_gb == pytest.approx(77.5 * GIB / 1e9)
    assert catalog()["cpu"].memory_reserve_bytes == 0  # host memory: no device context


def test_an_inline_device_gives_its_memory_once_in_either_unit() -> None:
    base = {"name": "x", "vendor": "amd", "bf16_tflops": 100}
    decimal = parse_accelerator({**base, "memory_gb": 64}, "c.yaml", "groups[0].accelerator")
    binary = parse_accelerator({**base, "memory_gib": 64}, "c.yaml", "groups[0].accelerator")
    assert (decimal.memory_bytes, binary.memory_bytes) == (64 * 10**9, 64 * GIB)
    own = parse_accelerator(
        {**base, "memory_gib": 64, "memory_reserve_gib": 1}, "c.yaml", "groups[0].accelerator"
    )
    assert own.usable_memory_gb == pytest.approx(63 * GIB / 1e9)
    with pytest.raises(SpecError, match="memory_gb.*not both"):
        parse_accelerator({**base, "memory_gb": 64, "memory_gib": 64}, "c.yaml", "a")
    with pytest.raises(SpecError, match="memory_gib.*is required"):
        parse_accelerator(base, "c.yaml", "a")


def test_fits_keeps_the_reserve() -> None:
    device = catalog()["a100-80gb"]
    usable = device.usable_memory_gb
    just = StageMemory(weights_gb=usable, grads_gb=0.0, optimizer_gb=0.0, activations_gb=0.0)
    over = StageMemory(weights_gb=usable + 0.01, grads_gb=0.0, optimizer_gb=0.0, activations_gb=0)
    assert fits(just, device) and not fits(over, device)
    assert headroom_gb(over, device) == pytest.approx(-0.01)
    # the old reading, the datasheet's figure as 10^9 bytes and no reserve, lies between
    assert usable > device.memory_gb - 2.5 * GIB / 1e9 - 1e-9 and usable > 80


def test_a_stage_within_the_device_but_not_beside_the_reserve_does_not_fit() -> None:
    model = load_model("llama-7b")
    plan_of = {
        "model": "llama-7b",
        "global_batch": 8,
        "pipelines": [{"count": 1, "stages": [{"group": "g", "tp": 8, "layers": 32}]}],
    }

    def prediction(accelerator):
        cluster = parse_cluster(
            {"groups": [{"name": "g", "accelerator": accelerator, "devices_per_node": 8}]}
        )
        return predict(parse_plan(plan_of), cluster, model)

    need = prediction("a100-80gb").stages[0].memory.total_gb
    # a device 1 GiB larger than the stage: the stage is within its memory, not its usable part
    device = {"name": "tight", "vendor": "nvidia", "bf16_tflops": 312}
    memory_gib = need * 1e9 / GIB + 1
    assert not prediction({**device, "memory_gib": memory_gib}).fits
    assert prediction({**device, "memory_gib": memory_gib, "memory_reserve_gib": 0.5}).fits
