"""model_kwargs lora_matmuls in the trainer's own LoRAModule (toolkit/lora_matmuls.py): bf16 runs the
LoRA's two matmuls in bf16 under autocast, fp32 and tf32 in float32 as the trainer did; the weights
and their gradients stay float32 either way, and bf16 trains what float32 trains."""

import weakref

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.patch("lora-the-LoRA-s-matmuls")


class BaseModel:
    def __init__(self, model_kwargs):
        self.model_config = type("ModelConfig", (), {"model_kwargs": model_kwargs})()


class Network:
    """What a LoRA module's forward reads of its network (LoRASpecialNetwork's fields)."""

    is_lorm, is_active, is_merged_in, _multiplier, network_type = False, True, False, 1.0, "lora"

    def __init__(self, base_model):
        self.torch_multiplier = torch.tensor([1.0])
        self.base_model_ref = weakref.ref(base_model)


def lora_step(model_kwargs: dict):
    """One forward and backward of a bf16 Linear with the trainer's LoRAModule on it: the dtype the
    LoRA path computed in, and the down projection's weight and gradient."""
    from toolkit.lora_special import LoRAModule

    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    base_model = BaseModel(model_kwargs)
    network = Network(base_model)  # the module holds weak references to both
    lora = LoRAModule("probe", linear, lora_dim=4, alpha=4, network=network)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to()
    computed = []
    inner = lora._call_forward
    lora._call_forward = lambda x: computed.append(inner(x)) or computed[-1]
    linear(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().sum().backward()
    return computed[0].dtype, lora.lora_down.weight, lora.lora_down.weight.grad


@pytest.mark.parametrize("kwargs, computed_in", [({}, torch.bfloat16), ({"lora_matmuls": "bf16"}, torch.bfloat16),
                                                 ({"lora_matmuls": "fp32"}, torch.float32),
                                                 ({"lora_matmuls": "tf32"}, torch.float32)])
def test_the_lora_path_computes_in_the_settings_precision(trainer_on_path, kwargs, computed_in):
    dtype, weight, grad = lora_step(kwargs)
    assert dtype == computed_in
    assert weight.dtype == grad.dtype == torch.float32 and grad.abs().sum() > 0


def test_bf16_gives_the_float32_gradient_to_bf16_precision(trainer_on_path):
    _, _, grad_bf16 = lora_step({"lora_matmuls": "bf16"})
    _, _, grad_fp32 = lora_step({"lora_matmuls": "fp32"})
    relative = float((grad_bf16 - grad_fp32).norm() / grad_fp32.norm())
    assert 0 < relative < 2e-2  # bf16 keeps 8 bits of mantissa: ~4e-3 per operand; not the same numbers


def test_a_value_the_catalogue_does_not_allow_names_the_setting(trainer_on_path):
    from flux2_contract.settings import SettingError

    with pytest.raises(SettingError, match="lora_matmuls"):
        lora_step({"lora_matmuls": "fp16"})


def test_the_first_call_traced_by_torch_compile_breaks_no_graph(trainer_on_path):
    """A compiled block's first forward is where the precision is first read: the read traces whole."""
    from toolkit.lora_special import LoRAModule

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    base_model = BaseModel({"lora_matmuls": "bf16"})
    network = Network(base_model)
    lora = LoRAModule("probe", linear, lora_dim=4, alpha=4, network=network)
    lora.apply_to()
    compiled = torch.compile(lambda x: linear(x), backend="aot_eager", fullgraph=True)
    out = compiled(torch.randn(8, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and not torch._dynamo.utils.counters["graph_break"]
