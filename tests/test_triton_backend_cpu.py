"""The Triton backend on a machine without a GPU: it must say so, not fail obscurely."""

import pytest

from fleetlab import LLM
from fleetlab.attention.backend import current_device_kind, get_attention_backend


def test_triton_backend_declares_decode_first_and_gpu():
    cls = get_attention_backend("triton")
    assert cls.requires_reorder and cls.reorder_threshold == 1
    assert cls.supported_devices == ("gpu",)


@pytest.mark.skipif(current_device_kind() == "gpu", reason="this machine has a GPU")
def test_triton_backend_needs_a_gpu(fleet_model):
    with pytest.raises(RuntimeError, match="GPU"):
        get_attention_backend("triton")()
    with pytest.raises(RuntimeError, match="GPU"):
        LLM(fleet_model, backend="triton")
    assert not any(n.endswith("core_attention") and type(m).__name__ == "PagedCoreAttention"
                   for n, m in fleet_model.named_sublayers())  # the failed LLM left the model as it was


def test_kernel_source_reads_the_kernels_without_triton():
    from fleetlab.lab.viz.source import source_excerpt

    text = "\n".join(source_excerpt("_decode_kernel", "fleetlab.attention.triton_kernels").lines)
    assert text.startswith("@triton.jit") and "def _decode_kernel(" in text and "block_tables_ptr" in text
    with pytest.raises(ValueError, match="no function"):
        source_excerpt("no_such_kernel", "fleetlab.attention.triton_kernels")
